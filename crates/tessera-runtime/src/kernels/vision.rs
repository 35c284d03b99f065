//! NCHW vision kernels: 2-D convolution (forward, backward-data, backward-filter), GroupNorm,
//! max / average pooling and nearest upsampling, with their backward passes.
//!
//! Convolutions are GEMMs over im2col columns: for image `b` and group `g`,
//! `y[b, g] (O/g × Ho·Wo) = W[g] (O/g × K) · col[b, g] (K × Ho·Wo)` with `K = C/g·kh·kw`. The
//! columns of [`CONV_IMAGES_PER_CHUNK`] images at a time are the kernel's declared workspace
//! (`Op::workspace_bytes`); images of a chunk run in parallel, one single-threaded GEMM per
//! (image, group), or one multithreaded GEMM when the chunk holds one image. A 1×1 kernel
//! with stride 1 and no padding reads `x` itself as its columns (no copy). The backward-data
//! op computes column gradients `Wᵀ · dy` and scatters them back (col2im); the backward-filter
//! op accumulates `dy · colᵀ` image after image in a fixed order, so results do not depend on
//! the thread count.
//!
//! GroupNorm, pooling and upsampling run plane by plane (or group by group) in parallel;
//! GroupNorm's statistics and its dweight / dbias partials are f64, summed in sample order.

use super::elementwise::{expect_f32, unsupported};
use super::matmul::{all_threads, gemm_f32, MatMut, MatRef};
use super::reduce::par_rows;
use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::Tensor;
use gemm::Parallelism;
use rayon::prelude::*;
use tessera_ir::ops::vision::CONV_IMAGES_PER_CHUNK;
use tessera_ir::{Conv2dSpec, Pool2dSpec, TensorMeta};

fn dims4(t: &Tensor, op: &str, what: &str) -> Result<[usize; 4]> {
    match t.dims() {
        &[a, b, c, d] => Ok([a, b, c, d]),
        d => Err(RuntimeError::Binding(format!("{op}: {what} {d:?} must be 4-D [N, C, H, W]"))),
    }
}

fn out4(out: &TensorMeta, op: &str) -> Result<[usize; 4]> {
    match out.shape.dims() {
        &[a, b, c, d] => Ok([a, b, c, d]),
        _ => Err(RuntimeError::Binding(format!("{op}: output {out} must be 4-D"))),
    }
}

// ---- convolution ---------------------------------------------------------------------------

/// Sizes of one convolution: x `[n, c, h, w]`, weight `[o, cg, kh, kw]`, y `[n, o, ho, wo]`.
#[derive(Clone, Copy)]
struct Geom {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    ho: usize,
    wo: usize,
    groups: usize,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
}

impl Geom {
    fn new(x: [usize; 4], wd: [usize; 4], spec: &Conv2dSpec, op: &str) -> Result<Geom> {
        let bad = |e: String| RuntimeError::Binding(format!("{op}: {e}"));
        let g = spec.groups;
        if g == 0 || x[1] != wd[1] * g || !wd[0].is_multiple_of(g) {
            return Err(bad(format!("x {x:?} and weight {wd:?} do not fit groups {g}")));
        }
        let [ho, wo] = spec.out_hw([x[2], x[3]], [wd[2], wd[3]]).map_err(bad)?;
        Ok(Geom {
            n: x[0],
            c: x[1],
            h: x[2],
            w: x[3],
            o: wd[0],
            kh: wd[2],
            kw: wd[3],
            ho,
            wo,
            groups: g,
            stride: spec.stride,
            padding: spec.padding,
            dilation: spec.dilation,
        })
    }
    /// Output positions per image.
    fn p(&self) -> usize {
        self.ho * self.wo
    }
    /// Column rows per group, `C/g·kh·kw`.
    fn k(&self) -> usize {
        self.c / self.groups * self.kh * self.kw
    }
    fn og(&self) -> usize {
        self.o / self.groups
    }
    /// Column elements of one image (all groups).
    fn col_len(&self) -> usize {
        self.c * self.kh * self.kw * self.p()
    }
    fn image_len(&self) -> usize {
        self.c * self.h * self.w
    }
    /// `x` is its own column matrix: a 1×1 kernel, stride 1, no padding.
    fn direct(&self) -> bool {
        let spec = Conv2dSpec {
            stride: self.stride,
            padding: self.padding,
            dilation: self.dilation,
            groups: self.groups,
        };
        spec.is_pointwise([self.kh, self.kw])
    }
    fn chunk(&self) -> usize {
        self.n.clamp(1, CONV_IMAGES_PER_CHUNK)
    }
    /// Input index along one spatial dim for output `o` and kernel tap `k`, if inside.
    #[inline]
    fn src(&self, dim: usize, o: usize, k: usize) -> Option<usize> {
        let i =
            (o * self.stride[dim] + k * self.dilation[dim]) as isize - self.padding[dim] as isize;
        let limit = if dim == 0 { self.h } else { self.w };
        (i >= 0 && (i as usize) < limit).then_some(i as usize)
    }

    /// For kernel column `kx`: the outputs `lo..hi` whose input column `ox·s + off` lies inside
    /// the input, and `off = kx·d − p`.
    #[inline]
    fn valid_cols(&self, kx: usize) -> (usize, usize, isize) {
        let (s, w) = (self.stride[1] as isize, self.w as isize);
        let off = (kx * self.dilation[1]) as isize - self.padding[1] as isize;
        let lo = if off >= 0 { 0 } else { (-off + s - 1) / s };
        let hi = if w - off <= 0 { 0 } else { ((w - off + s - 1) / s).min(self.wo as isize) };
        let lo = lo.min(hi);
        (lo as usize, hi as usize, off)
    }

    /// Fills one image's columns `[C·kh·kw, Ho·Wo]` (zeros for padding).
    fn im2col(&self, x: &[f32], col: &mut [f32]) {
        let p = self.p();
        for (r, row) in col.chunks_mut(p).enumerate() {
            let (ci, ky, kx) = (r / (self.kh * self.kw), r / self.kw % self.kh, r % self.kw);
            let plane = &x[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for oy in 0..self.ho {
                let out = &mut row[oy * self.wo..(oy + 1) * self.wo];
                match self.src(0, oy, ky) {
                    None => out.fill(0.0),
                    Some(iy) => {
                        let line = &plane[iy * self.w..(iy + 1) * self.w];
                        let (lo, hi, off) = self.valid_cols(kx);
                        out[..lo].fill(0.0);
                        out[hi..].fill(0.0);
                        if self.stride[1] == 1 {
                            let start = (lo as isize + off) as usize;
                            out[lo..hi].copy_from_slice(&line[start..start + (hi - lo)]);
                        } else {
                            for (ox, v) in out[lo..hi].iter_mut().enumerate() {
                                *v = line[(((lo + ox) * self.stride[1]) as isize + off) as usize];
                            }
                        }
                    }
                }
            }
        }
    }

    /// Adds one image's column gradients back into its input gradient (col2im).
    fn col2im(&self, col: &[f32], dx: &mut [f32]) {
        let p = self.p();
        for (r, row) in col.chunks(p).enumerate() {
            let (ci, ky, kx) = (r / (self.kh * self.kw), r / self.kw % self.kh, r % self.kw);
            let plane = &mut dx[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for oy in 0..self.ho {
                let Some(iy) = self.src(0, oy, ky) else { continue };
                let line = &mut plane[iy * self.w..(iy + 1) * self.w];
                let (lo, hi, off) = self.valid_cols(kx);
                let src = &row[oy * self.wo + lo..oy * self.wo + hi];
                for (ox, &v) in src.iter().enumerate() {
                    line[(((lo + ox) * self.stride[1]) as isize + off) as usize] += v;
                }
            }
        }
    }
}

/// Parallelism for the GEMMs of a chunk: one thread each when images run side by side.
fn gemm_par(images: usize) -> Parallelism {
    if images > 1 {
        Parallelism::None
    } else {
        all_threads()
    }
}

fn check_conv_dtypes(op: &str, a: (&Tensor, &str), b: (&Tensor, &str)) -> Result<()> {
    expect_f32(a.0, op, a.1)?;
    expect_f32(b.0, op, b.1)
}

/// `y = conv(x, w)`; `out` is the IR's output meta.
pub fn conv2d(x: &Tensor, w: &Tensor, spec: &Conv2dSpec, out: &TensorMeta) -> Result<Tensor> {
    const OP: &str = "conv2d";
    check_conv_dtypes(OP, (x, "x"), (w, "weight"))?;
    let g = Geom::new(dims4(x, OP, "x")?, dims4(w, OP, "weight")?, spec, OP)?;
    let yd = out4(out, OP)?;
    if yd != [g.n, g.o, g.ho, g.wo] {
        return Err(RuntimeError::Binding(format!("{OP}: output {out} does not fit the inputs")));
    }
    let (xc, wc) = (contiguous(x)?, contiguous(w)?);
    let (xs_guard, ws_guard) = (read::<f32>(&xc)?, read::<f32>(&wc)?);
    let (xs, ws): (&[f32], &[f32]) = (&xs_guard, &ws_guard);
    let (p, k, og) = (g.p(), g.k(), g.og());
    let mut y = vec![0f32; g.n * g.o * p];
    if y.is_empty() {
        return from_vec(y, &yd);
    }
    let direct = g.direct();
    let mut cols = if direct { Vec::new() } else { vec![0f32; g.chunk() * g.col_len()] };
    for (ci, ychunk) in y.chunks_mut(g.chunk() * g.o * p).enumerate() {
        let b0 = ci * g.chunk();
        let images = ychunk.len() / (g.o * p);
        let xchunk = &xs[b0 * g.image_len()..(b0 + images) * g.image_len()];
        let run = |xi: &[f32], col: &[f32], yi: &mut [f32], par: Parallelism| {
            let src = if direct { xi } else { col };
            for grp in 0..g.groups {
                let dst = MatMut { ptr: yi[grp * og * p..].as_mut_ptr(), rs: p as isize, cs: 1 };
                let lhs = MatRef { ptr: ws[grp * og * k..].as_ptr(), rs: k as isize, cs: 1 };
                let rhs = MatRef { ptr: src[grp * k * p..].as_ptr(), rs: p as isize, cs: 1 };
                // SAFETY: dst addresses og×p elements of this image's own output block, lhs
                // og×k of the weight, rhs k×p of this image's columns; no overlap.
                unsafe { gemm_f32(og, p, k, dst, false, lhs, rhs, 1.0, par) };
            }
        };
        let par = gemm_par(images);
        if direct {
            ychunk
                .par_chunks_mut(g.o * p)
                .zip(xchunk.par_chunks(g.image_len()))
                .for_each(|(yi, xi)| run(xi, &[], yi, par));
        } else {
            let cols = &mut cols[..images * g.col_len()];
            cols.par_chunks_mut(g.col_len())
                .zip(xchunk.par_chunks(g.image_len()))
                .zip(ychunk.par_chunks_mut(g.o * p))
                .for_each(|((col, xi), yi)| {
                    g.im2col(xi, col);
                    run(xi, col, yi, par);
                });
        }
    }
    from_vec(y, &yd)
}

/// dx of a convolution from `w` and `dy`.
pub fn conv2d_backward_input(
    w: &Tensor,
    dy: &Tensor,
    spec: &Conv2dSpec,
    out: &TensorMeta,
) -> Result<Tensor> {
    const OP: &str = "conv2d_backward_input";
    check_conv_dtypes(OP, (w, "weight"), (dy, "dy"))?;
    let xd = out4(out, OP)?;
    let g = Geom::new(xd, dims4(w, OP, "weight")?, spec, OP)?;
    if dims4(dy, OP, "dy")? != [g.n, g.o, g.ho, g.wo] {
        return Err(RuntimeError::Binding(format!(
            "{OP}: dy {:?} must be {:?}",
            dy.dims(),
            [g.n, g.o, g.ho, g.wo]
        )));
    }
    let (wc, dc) = (contiguous(w)?, contiguous(dy)?);
    let (ws_guard, ds_guard) = (read::<f32>(&wc)?, read::<f32>(&dc)?);
    let (ws, ds): (&[f32], &[f32]) = (&ws_guard, &ds_guard);
    let (p, k, og) = (g.p(), g.k(), g.og());
    let mut dx = vec![0f32; g.n * g.image_len()];
    if dx.is_empty() {
        return from_vec(dx, &xd);
    }
    let direct = g.direct();
    let mut cols = if direct { Vec::new() } else { vec![0f32; g.chunk() * g.col_len()] };
    for (ci, dxchunk) in dx.chunks_mut(g.chunk() * g.image_len()).enumerate() {
        let b0 = ci * g.chunk();
        let images = dxchunk.len() / g.image_len();
        let dychunk = &ds[b0 * g.o * p..(b0 + images) * g.o * p];
        // dcol[grp] (k×p) = W[grp]ᵀ (k×og) · dy[grp] (og×p), into `dst` (the columns, or dx).
        let run = |dyi: &[f32], dst: &mut [f32], par: Parallelism| {
            for grp in 0..g.groups {
                let d = MatMut { ptr: dst[grp * k * p..].as_mut_ptr(), rs: p as isize, cs: 1 };
                let lhs = MatRef { ptr: ws[grp * og * k..].as_ptr(), rs: k as isize, cs: 1 }.t();
                let rhs = MatRef { ptr: dyi[grp * og * p..].as_ptr(), rs: p as isize, cs: 1 };
                // SAFETY: d addresses k×p elements of this image's own block, lhs og×k of the
                // weight (read transposed), rhs og×p of this image's dy; no overlap.
                unsafe { gemm_f32(k, p, og, d, false, lhs, rhs, 1.0, par) };
            }
        };
        let par = gemm_par(images);
        if direct {
            dxchunk
                .par_chunks_mut(g.image_len())
                .zip(dychunk.par_chunks(g.o * p))
                .for_each(|(dxi, dyi)| run(dyi, dxi, par));
        } else {
            let cols = &mut cols[..images * g.col_len()];
            cols.par_chunks_mut(g.col_len())
                .zip(dychunk.par_chunks(g.o * p))
                .zip(dxchunk.par_chunks_mut(g.image_len()))
                .for_each(|((col, dyi), dxi)| {
                    run(dyi, col, par);
                    g.col2im(col, dxi);
                });
        }
    }
    from_vec(dx, &xd)
}

/// dw of a convolution from `x` and `dy`.
pub fn conv2d_backward_weight(
    x: &Tensor,
    dy: &Tensor,
    spec: &Conv2dSpec,
    out: &TensorMeta,
) -> Result<Tensor> {
    const OP: &str = "conv2d_backward_weight";
    check_conv_dtypes(OP, (x, "x"), (dy, "dy"))?;
    let wd = out4(out, OP)?;
    let g = Geom::new(dims4(x, OP, "x")?, wd, spec, OP)?;
    if dims4(dy, OP, "dy")? != [g.n, g.o, g.ho, g.wo] {
        return Err(RuntimeError::Binding(format!(
            "{OP}: dy {:?} must be {:?}",
            dy.dims(),
            [g.n, g.o, g.ho, g.wo]
        )));
    }
    let (xc, dc) = (contiguous(x)?, contiguous(dy)?);
    let (xs_guard, ds_guard) = (read::<f32>(&xc)?, read::<f32>(&dc)?);
    let (xs, ds): (&[f32], &[f32]) = (&xs_guard, &ds_guard);
    let (p, k, og) = (g.p(), g.k(), g.og());
    let mut dw = vec![0f32; g.o * k];
    if dw.is_empty() {
        return from_vec(dw, &wd);
    }
    let direct = g.direct();
    let mut cols = if direct { Vec::new() } else { vec![0f32; g.chunk() * g.col_len()] };
    let par = all_threads();
    let mut first = true;
    for b0 in (0..g.n).step_by(g.chunk()) {
        let images = (g.n - b0).min(g.chunk());
        let xchunk = &xs[b0 * g.image_len()..(b0 + images) * g.image_len()];
        if !direct {
            cols[..images * g.col_len()]
                .par_chunks_mut(g.col_len())
                .zip(xchunk.par_chunks(g.image_len()))
                .for_each(|(col, xi)| g.im2col(xi, col));
        }
        for i in 0..images {
            let src = if direct {
                &xchunk[i * g.image_len()..(i + 1) * g.image_len()]
            } else {
                &cols[i * g.col_len()..(i + 1) * g.col_len()]
            };
            let dyi = &ds[(b0 + i) * g.o * p..(b0 + i + 1) * g.o * p];
            for grp in 0..g.groups {
                // dW[grp] (og×k) += dy[grp] (og×p) · col[grp]ᵀ (p×k).
                let d = MatMut { ptr: dw[grp * og * k..].as_mut_ptr(), rs: k as isize, cs: 1 };
                let lhs = MatRef { ptr: dyi[grp * og * p..].as_ptr(), rs: p as isize, cs: 1 };
                let rhs = MatRef { ptr: src[grp * k * p..].as_ptr(), rs: p as isize, cs: 1 }.t();
                // SAFETY: d addresses og×k elements of dw, lhs og×p of dy, rhs k×p of the
                // columns (read transposed); dw overlaps neither.
                unsafe { gemm_f32(og, k, p, d, !first, lhs, rhs, 1.0, par) };
            }
            first = false;
        }
    }
    from_vec(dw, &wd)
}

// ---- group norm ----------------------------------------------------------------------------

/// (N, C, spatial size) of `x [N, C, ..]` against `w [C]`.
fn group_dims(op: &str, x: &Tensor, ws: &[(&Tensor, &str)], groups: usize) -> Result<[usize; 3]> {
    expect_f32(x, op, "x")?;
    let d = x.dims();
    if d.len() < 2 {
        return Err(unsupported(op, format!("x {d:?} must be [N, C, ..]")));
    }
    let c = d[1];
    if groups == 0 || !c.is_multiple_of(groups) {
        return Err(RuntimeError::Binding(format!(
            "{op}: channels {c} not divisible by groups {groups}"
        )));
    }
    for &(w, what) in ws {
        expect_f32(w, op, what)?;
        if w.dims() != [c] {
            return Err(RuntimeError::Binding(format!(
                "{op}: {what} {:?} must be [{c}]",
                w.dims()
            )));
        }
    }
    Ok([d[0], c, d[2..].iter().product()])
}

/// (mean, 1/sqrt(var + eps)) of a group, biased variance, two passes in f64.
fn stats(v: &[f32], eps: f64) -> (f64, f64) {
    let m = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / m;
    let var = v
        .iter()
        .map(|&x| {
            let c = x as f64 - mean;
            c * c
        })
        .sum::<f64>()
        / m;
    (mean, 1.0 / (var + eps).sqrt())
}

pub fn group_norm(x: &Tensor, w: &Tensor, b: &Tensor, groups: usize, eps: f64) -> Result<Tensor> {
    const OP: &str = "group_norm";
    let [_, c, s] = group_dims(OP, x, &[(w, "weight"), (b, "bias")], groups)?;
    let (xc, wc, bc) = (contiguous(x)?, contiguous(w)?, contiguous(b)?);
    let (xs_guard, ws_guard, bs_guard) = (read::<f32>(&xc)?, read::<f32>(&wc)?, read::<f32>(&bc)?);
    let (xs, ws, bs): (&[f32], &[f32], &[f32]) = (&xs_guard, &ws_guard, &bs_guard);
    let (cg, len) = (c / groups, c / groups * s);
    let mut out = vec![0f32; xs.len()];
    if len > 0 {
        par_rows(&mut out, len, |k, og| {
            let xg = &xs[k * len..(k + 1) * len];
            let (mean, rstd) = stats(xg, eps);
            let c0 = (k % groups) * cg;
            for (j, (oc, xc)) in og.chunks_mut(s.max(1)).zip(xg.chunks(s.max(1))).enumerate() {
                let (a, sh) = (rstd * ws[c0 + j] as f64, bs[c0 + j] as f64);
                for (o, &v) in oc.iter_mut().zip(xc) {
                    *o = ((v as f64 - mean) * a + sh) as f32;
                }
            }
        });
    }
    from_vec(out, x.dims())
}

/// `[dx, dw, db]`. Per group, with x̂ = (x − mean)·rstd and g = dy·w[c]:
/// dx = rstd·(g − mean(g) − x̂·mean(g·x̂)); dw[c] = Σ dy·x̂, db[c] = Σ dy.
pub fn group_norm_backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    groups: usize,
    eps: f64,
) -> Result<Vec<Tensor>> {
    const OP: &str = "group_norm_backward";
    let [_, c, s] = group_dims(OP, x, &[(w, "weight")], groups)?;
    expect_f32(dy, OP, "dy")?;
    if dy.dims() != x.dims() {
        return Err(RuntimeError::Binding(format!(
            "{OP}: dy {:?} must have x's shape {:?}",
            dy.dims(),
            x.dims()
        )));
    }
    let (xc, wc, gc) = (contiguous(x)?, contiguous(w)?, contiguous(dy)?);
    let (xs_guard, ws_guard, gs_guard) = (read::<f32>(&xc)?, read::<f32>(&wc)?, read::<f32>(&gc)?);
    let (xs, ws, gs): (&[f32], &[f32], &[f32]) = (&xs_guard, &ws_guard, &gs_guard);
    let (cg, len) = (c / groups, c / groups * s);
    let mut dx = vec![0f32; xs.len()];
    let (mut dw, mut db) = (vec![0f64; c], vec![0f64; c]);
    if len > 0 && s > 0 {
        // Per group: its channels' (Σ dy·x̂, Σ dy), summed over samples in order below.
        let partials: Vec<(Vec<f64>, Vec<f64>)> = dx
            .par_chunks_mut(len)
            .enumerate()
            .map(|(k, dxg)| {
                let (xg, gg) = (&xs[k * len..(k + 1) * len], &gs[k * len..(k + 1) * len]);
                let (mean, rstd) = stats(xg, eps);
                let c0 = (k % groups) * cg;
                let (mut pw, mut pb) = (vec![0f64; cg], vec![0f64; cg]);
                let (mut sum_g, mut sum_gx) = (0f64, 0f64);
                for j in 0..cg {
                    let wj = ws[c0 + j] as f64;
                    for i in j * s..(j + 1) * s {
                        let (d, xhat) = (gs[k * len + i] as f64, (xg[i] as f64 - mean) * rstd);
                        pw[j] += d * xhat;
                        pb[j] += d;
                        sum_g += d * wj;
                        sum_gx += d * wj * xhat;
                    }
                }
                let (mean_g, mean_gx) = (sum_g / len as f64, sum_gx / len as f64);
                for j in 0..cg {
                    let wj = ws[c0 + j] as f64;
                    for i in j * s..(j + 1) * s {
                        let xhat = (xg[i] as f64 - mean) * rstd;
                        dxg[i] = (rstd * (gg[i] as f64 * wj - mean_g - xhat * mean_gx)) as f32;
                    }
                }
                (pw, pb)
            })
            .collect();
        for (k, (pw, pb)) in partials.iter().enumerate() {
            let c0 = (k % groups) * cg;
            for j in 0..cg {
                dw[c0 + j] += pw[j];
                db[c0 + j] += pb[j];
            }
        }
    }
    let f32s = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
    Ok(vec![from_vec(dx, x.dims())?, from_vec(f32s(dw), &[c])?, from_vec(f32s(db), &[c])?])
}

// ---- pooling -------------------------------------------------------------------------------

/// The window of output `(oy, ox)` clipped to the input: row range and column range.
#[inline]
fn window(
    pool: &Pool2dSpec,
    hw: [usize; 2],
    oy: usize,
    ox: usize,
) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let r = |o: usize, d: usize| {
        let start = (o * pool.stride[d]) as isize - pool.padding[d] as isize;
        let end = (start + pool.kernel[d] as isize).min(hw[d] as isize);
        (start.max(0) as usize)..(end.max(0) as usize)
    };
    (r(oy, 0), r(ox, 1))
}

/// Checks a pooling's input `[N, C, H, W]` against its output meta; returns (in, out) dims.
fn pool_dims(op: &str, x: [usize; 4], pool: &Pool2dSpec, y: [usize; 4]) -> Result<()> {
    let hw = pool.out_hw([x[2], x[3]]).map_err(|e| RuntimeError::Binding(format!("{op}: {e}")))?;
    if y != [x[0], x[1], hw[0], hw[1]] {
        return Err(RuntimeError::Binding(format!(
            "{op}: output {y:?} is not the pooling of {x:?}"
        )));
    }
    Ok(())
}

/// The window's first maximum (row-major window order; a NaN, the first one, wins).
#[inline]
fn argmax(
    plane: &[f32],
    w: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) -> Option<usize> {
    let mut best: Option<usize> = None;
    for iy in rows {
        for ix in cols.clone() {
            let i = iy * w + ix;
            best = match best {
                None => Some(i),
                Some(b) if plane[b].is_nan() => Some(b),
                Some(b) if plane[i] > plane[b] || plane[i].is_nan() => Some(i),
                keep => keep,
            };
        }
    }
    best
}

pub fn max_pool2d(x: &Tensor, pool: &Pool2dSpec, out: &TensorMeta) -> Result<Tensor> {
    const OP: &str = "max_pool2d";
    expect_f32(x, OP, "x")?;
    let xd = dims4(x, OP, "x")?;
    let yd = out4(out, OP)?;
    pool_dims(OP, xd, pool, yd)?;
    let xc = contiguous(x)?;
    let xs_guard = read::<f32>(&xc)?;
    let xs: &[f32] = &xs_guard;
    let (hw, plane_in, plane_out) = ([xd[2], xd[3]], xd[2] * xd[3], yd[2] * yd[3]);
    let mut y = vec![0f32; yd.iter().product()];
    if plane_out > 0 {
        par_rows(&mut y, plane_out, |pl, yp| {
            let xp = &xs[pl * plane_in..(pl + 1) * plane_in];
            for (o, v) in yp.iter_mut().enumerate() {
                let (rows, cols) = window(pool, hw, o / yd[3], o % yd[3]);
                *v = argmax(xp, xd[3], rows, cols).map_or(f32::NEG_INFINITY, |i| xp[i]);
            }
        });
    }
    from_vec(y, &yd)
}

pub fn max_pool2d_backward(
    x: &Tensor,
    dy: &Tensor,
    pool: &Pool2dSpec,
    out: &TensorMeta,
) -> Result<Tensor> {
    const OP: &str = "max_pool2d_backward";
    expect_f32(x, OP, "x")?;
    expect_f32(dy, OP, "dy")?;
    let xd = dims4(x, OP, "x")?;
    let yd = dims4(dy, OP, "dy")?;
    pool_dims(OP, xd, pool, yd)?;
    if out4(out, OP)? != xd {
        return Err(RuntimeError::Binding(format!("{OP}: output {out} must be x's shape")));
    }
    let (xc, dc) = (contiguous(x)?, contiguous(dy)?);
    let (xs_guard, ds_guard) = (read::<f32>(&xc)?, read::<f32>(&dc)?);
    let (xs, ds): (&[f32], &[f32]) = (&xs_guard, &ds_guard);
    let (hw, plane_in, plane_out) = ([xd[2], xd[3]], xd[2] * xd[3], yd[2] * yd[3]);
    let mut dx = vec![0f32; xs.len()];
    if plane_in > 0 {
        par_rows(&mut dx, plane_in, |pl, dxp| {
            let xp = &xs[pl * plane_in..(pl + 1) * plane_in];
            let dp = &ds[pl * plane_out..(pl + 1) * plane_out];
            for (o, &g) in dp.iter().enumerate() {
                let (rows, cols) = window(pool, hw, o / yd[3], o % yd[3]);
                if let Some(i) = argmax(xp, xd[3], rows, cols) {
                    dxp[i] += g;
                }
            }
        });
    }
    from_vec(dx, &xd)
}

fn divisor(pool: &Pool2dSpec, count_include_pad: bool, rows: usize, cols: usize) -> f32 {
    if count_include_pad {
        (pool.kernel[0] * pool.kernel[1]) as f32
    } else {
        (rows * cols) as f32
    }
}

pub fn avg_pool2d(
    x: &Tensor,
    pool: &Pool2dSpec,
    count_include_pad: bool,
    out: &TensorMeta,
) -> Result<Tensor> {
    const OP: &str = "avg_pool2d";
    expect_f32(x, OP, "x")?;
    let xd = dims4(x, OP, "x")?;
    let yd = out4(out, OP)?;
    pool_dims(OP, xd, pool, yd)?;
    let xc = contiguous(x)?;
    let xs_guard = read::<f32>(&xc)?;
    let xs: &[f32] = &xs_guard;
    let (hw, plane_in, plane_out) = ([xd[2], xd[3]], xd[2] * xd[3], yd[2] * yd[3]);
    let mut y = vec![0f32; yd.iter().product()];
    if plane_out > 0 {
        par_rows(&mut y, plane_out, |pl, yp| {
            let xp = &xs[pl * plane_in..(pl + 1) * plane_in];
            for (o, v) in yp.iter_mut().enumerate() {
                let (rows, cols) = window(pool, hw, o / yd[3], o % yd[3]);
                let (nr, nc) = (rows.len(), cols.len());
                let mut s = 0f64;
                for iy in rows {
                    s += xp[iy * xd[3]..][cols.clone()].iter().map(|&v| v as f64).sum::<f64>();
                }
                *v = (s / divisor(pool, count_include_pad, nr, nc) as f64) as f32;
            }
        });
    }
    from_vec(y, &yd)
}

pub fn avg_pool2d_backward(
    dy: &Tensor,
    pool: &Pool2dSpec,
    count_include_pad: bool,
    out: &TensorMeta,
) -> Result<Tensor> {
    const OP: &str = "avg_pool2d_backward";
    expect_f32(dy, OP, "dy")?;
    let yd = dims4(dy, OP, "dy")?;
    let xd = out4(out, OP)?;
    pool_dims(OP, xd, pool, yd)?;
    let dc = contiguous(dy)?;
    let ds_guard = read::<f32>(&dc)?;
    let ds: &[f32] = &ds_guard;
    let (hw, plane_in, plane_out) = ([xd[2], xd[3]], xd[2] * xd[3], yd[2] * yd[3]);
    let mut dx = vec![0f32; xd.iter().product()];
    if plane_in > 0 {
        par_rows(&mut dx, plane_in, |pl, dxp| {
            let dp = &ds[pl * plane_out..(pl + 1) * plane_out];
            for (o, &g) in dp.iter().enumerate() {
                let (rows, cols) = window(pool, hw, o / yd[3], o % yd[3]);
                let share = g / divisor(pool, count_include_pad, rows.len(), cols.len());
                for iy in rows {
                    for v in &mut dxp[iy * xd[3]..][cols.clone()] {
                        *v += share;
                    }
                }
            }
        });
    }
    from_vec(dx, &xd)
}

// ---- upsampling ----------------------------------------------------------------------------

pub fn upsample2d(x: &Tensor, scale: [usize; 2], out: &TensorMeta) -> Result<Tensor> {
    const OP: &str = "upsample2d";
    expect_f32(x, OP, "x")?;
    let [n, c, h, w] = dims4(x, OP, "x")?;
    let yd = out4(out, OP)?;
    if yd != [n, c, h * scale[0], w * scale[1]] {
        return Err(RuntimeError::Binding(format!("{OP}: output {out} is not x scaled")));
    }
    let xc = contiguous(x)?;
    let xs_guard = read::<f32>(&xc)?;
    let xs: &[f32] = &xs_guard;
    let (ho, wo) = (yd[2], yd[3]);
    let mut y = vec![0f32; yd.iter().product()];
    if ho * wo > 0 {
        par_rows(&mut y, ho * wo, |pl, yp| {
            let xp = &xs[pl * h * w..(pl + 1) * h * w];
            for (oy, row) in yp.chunks_mut(wo).enumerate() {
                let line = &xp[oy / scale[0] * w..][..w];
                for (ox, v) in row.iter_mut().enumerate() {
                    *v = line[ox / scale[1]];
                }
            }
        });
    }
    from_vec(y, &yd)
}

pub fn upsample2d_backward(dy: &Tensor, scale: [usize; 2], out: &TensorMeta) -> Result<Tensor> {
    const OP: &str = "upsample2d_backward";
    expect_f32(dy, OP, "dy")?;
    let [n, c, ho, wo] = dims4(dy, OP, "dy")?;
    let xd = out4(out, OP)?;
    if [xd[0], xd[1], xd[2] * scale[0], xd[3] * scale[1]] != [n, c, ho, wo] {
        return Err(RuntimeError::Binding(format!("{OP}: output {out} is not dy unscaled")));
    }
    let dc = contiguous(dy)?;
    let ds_guard = read::<f32>(&dc)?;
    let ds: &[f32] = &ds_guard;
    let (h, w) = (xd[2], xd[3]);
    let mut dx = vec![0f32; xd.iter().product()];
    if h * w > 0 {
        par_rows(&mut dx, h * w, |pl, dxp| {
            let dp = &ds[pl * ho * wo..(pl + 1) * ho * wo];
            for (iy, row) in dxp.chunks_mut(w).enumerate() {
                for (ix, v) in row.iter_mut().enumerate() {
                    let mut s = 0f32;
                    for oy in iy * scale[0]..(iy + 1) * scale[0] {
                        s += dp[oy * wo + ix * scale[1]..][..scale[1]].iter().sum::<f32>();
                    }
                    *v = s;
                }
            }
        });
    }
    from_vec(dx, &xd)
}
