//! Convolutions on the GPU: im2col columns in scratch and cuBLAS f32 GEMMs, the CPU kernel's
//! lowering (`tessera-runtime`'s `kernels/vision.rs`) step for step.
//!
//! For image `b` and group `g`, with `K = C/g·kh·kw` and `P = Ho·Wo`:
//! - forward: `y[b, g] (O/g × P) = W[g] (O/g × K) · col[b, g] (K × P)`;
//! - backward-data: `dcol[b, g] = W[g]ᵀ · dy[b, g]`, then `vision_col2im` gathers each input
//!   element's taps (no atomics);
//! - backward-filter: `dW[g] += dy[b, g] · col[b, g]ᵀ`, image after image in order (`beta` 0
//!   for the first, 1 after), so the sum's order is fixed.
//!
//! The columns of [`CONV_IMAGES_PER_CHUNK`] images at a time live in one scratch buffer: exactly
//! the workspace the op declares (`Op::workspace_bytes`), which the planner charges, so the
//! prediction covers it. Being scratch, it is outside the allocator's Program books: where a
//! convolution's workspace sets the step's peak, the Program peak is below the accountant's by
//! that workspace (the ResNet fixture at batch 6: 144,048 against 157,168 bytes on an H200,
//! 18,432 bytes of scratch beside). A 1×1, stride-1, unpadded kernel reads `x` (and writes dx) in place
//! as its own columns: no buffer. Each chunk's products are strided-batched GEMMs: over the
//! chunk's images for each group, or over the groups for each image, whichever makes fewer
//! calls.

use super::{bad, dims4, F32};
use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::gemm::{gemm_f32, ColMat};
use crate::launch::{elementwise, launch_then, Arg};
use crate::tensor::CudaTensor;
use cudarc::driver::DeviceRepr;
use tessera_ir::ops::vision::CONV_IMAGES_PER_CHUNK;
use tessera_ir::{Conv2dSpec, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

/// A convolution's sizes (`struct ConvGeom` in `vision.cu`): x `[n, c, h, w]`, weight
/// `[o, c/groups, kh, kw]`, y `[n, o, ho, wo]`, then stride, padding and dilation per dim.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ConvGeom {
    pub n: i64,
    pub c: i64,
    pub h: i64,
    pub w: i64,
    pub o: i64,
    pub kh: i64,
    pub kw: i64,
    pub ho: i64,
    pub wo: i64,
    pub groups: i64,
    pub sh: i64,
    pub sw: i64,
    pub ph: i64,
    pub pw: i64,
    pub dh: i64,
    pub dw: i64,
}

// SAFETY: plain old data with the C layout the kernels declare (sixteen i64).
unsafe impl DeviceRepr for ConvGeom {}

impl ConvGeom {
    /// The CPU kernel's checks (`Geom::new`): x `[n, c, h, w]` and weight `wd` fit `spec`.
    pub(crate) fn new(x: [usize; 4], wd: [usize; 4], spec: &Conv2dSpec, op: &str) -> Result<Self> {
        let g = spec.groups;
        if g == 0 || x[1] != wd[1] * g || !wd[0].is_multiple_of(g) {
            return Err(bad(format!("{op}: x {x:?} and weight {wd:?} do not fit groups {g}")));
        }
        let [ho, wo] =
            spec.out_hw([x[2], x[3]], [wd[2], wd[3]]).map_err(|e| bad(format!("{op}: {e}")))?;
        let i = |v: usize| v as i64;
        Ok(ConvGeom {
            n: i(x[0]),
            c: i(x[1]),
            h: i(x[2]),
            w: i(x[3]),
            o: i(wd[0]),
            kh: i(wd[2]),
            kw: i(wd[3]),
            ho: i(ho),
            wo: i(wo),
            groups: i(g),
            sh: i(spec.stride[0]),
            sw: i(spec.stride[1]),
            ph: i(spec.padding[0]),
            pw: i(spec.padding[1]),
            dh: i(spec.dilation[0]),
            dw: i(spec.dilation[1]),
        })
    }
    fn u(v: i64) -> usize {
        v as usize
    }
    pub(crate) fn n(&self) -> usize {
        Self::u(self.n)
    }
    fn groups(&self) -> usize {
        Self::u(self.groups)
    }
    /// Output positions per image, `Ho·Wo`.
    pub(crate) fn p(&self) -> usize {
        Self::u(self.ho * self.wo)
    }
    /// Column rows per group, `C/g·kh·kw`.
    pub(crate) fn k(&self) -> usize {
        Self::u(self.c / self.groups * self.kh * self.kw)
    }
    pub(crate) fn og(&self) -> usize {
        Self::u(self.o / self.groups)
    }
    /// Column elements of one image (all groups).
    pub(crate) fn col_len(&self) -> usize {
        Self::u(self.c * self.kh * self.kw) * self.p()
    }
    pub(crate) fn image_len(&self) -> usize {
        Self::u(self.c * self.h * self.w)
    }
    /// Output (or dy) elements of one image.
    pub(crate) fn out_len(&self) -> usize {
        Self::u(self.o) * self.p()
    }
    /// `x` is its own column matrix: a 1×1 kernel, stride 1, no padding.
    pub(crate) fn direct(&self) -> bool {
        [self.kh, self.kw, self.sh, self.sw] == [1; 4] && [self.ph, self.pw] == [0, 0]
    }
    /// Images per chunk (the CPU kernel's, so the columns are the declared workspace).
    pub(crate) fn chunk(&self) -> usize {
        self.n().clamp(1, CONV_IMAGES_PER_CHUNK)
    }
}

/// One operand of a [`Gemm`]: column-major, `off` elements from its buffer's base.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mat {
    pub off: usize,
    pub ld: usize,
    pub stride: usize,
    pub trans: bool,
}

/// `C = op(A)·op(B) + beta·C`, column-major `m × n` with inner `k`, `count` strided products
/// (cuBLAS's terms; a row-major `R × S` matrix is a column-major `S × R` one).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: Mat,
    pub b: Mat,
    pub beta: f32,
    pub c: Mat,
    pub count: usize,
}

fn mat(off: usize, ld: usize, stride: usize, trans: bool) -> Mat {
    Mat { off, ld, stride, trans }
}

/// The forward's products for a chunk of `imgs` images: A the chunk's columns (`[imgs,
/// groups, K, P]`), B the weight, C the chunk's outputs (`[imgs, O, P]`).
/// Row-major `y[b,g] = W[g]·col[b,g]` is column-major `yᵀ (P × og) = colᵀ (P × K) · Wᵀ (K × og)`.
pub(crate) fn forward_gemms(g: &ConvGeom, imgs: usize) -> Vec<Gemm> {
    let (p, k, og, groups) = (g.p(), g.k(), g.og(), g.groups());
    let (col, out) = (g.col_len(), g.out_len());
    let gemm = |a, b, c, count| Gemm { m: p, n: og, k, a, b, beta: 0.0, c, count };
    if groups <= imgs {
        (0..groups)
            .map(|gr| {
                gemm(
                    mat(gr * k * p, p, col, false),
                    mat(gr * og * k, k, 0, false),
                    mat(gr * og * p, p, out, false),
                    imgs,
                )
            })
            .collect()
    } else {
        (0..imgs)
            .map(|i| {
                gemm(
                    mat(i * col, p, k * p, false),
                    mat(0, k, og * k, false),
                    mat(i * out, p, og * p, false),
                    groups,
                )
            })
            .collect()
    }
}

/// The backward-data products for a chunk: A the chunk's dy (`[imgs, O, P]`), B the weight, C
/// the chunk's column gradients (`[imgs, groups, K, P]`).
/// Row-major `dcol[b,g] = W[g]ᵀ·dy[b,g]` is column-major `dcolᵀ (P × K) = dyᵀ (P × og) · W (og × K)`.
pub(crate) fn backward_input_gemms(g: &ConvGeom, imgs: usize) -> Vec<Gemm> {
    let (p, k, og, groups) = (g.p(), g.k(), g.og(), g.groups());
    let (col, out) = (g.col_len(), g.out_len());
    let gemm = |a, b, c, count| Gemm { m: p, n: k, k: og, a, b, beta: 0.0, c, count };
    if groups <= imgs {
        (0..groups)
            .map(|gr| {
                gemm(
                    mat(gr * og * p, p, out, false),
                    mat(gr * og * k, k, 0, true),
                    mat(gr * k * p, p, col, false),
                    imgs,
                )
            })
            .collect()
    } else {
        (0..imgs)
            .map(|i| {
                gemm(
                    mat(i * out, p, og * p, false),
                    mat(0, k, og * k, true),
                    mat(i * col, p, k * p, false),
                    groups,
                )
            })
            .collect()
    }
}

/// The backward-filter product of image `i` of a chunk, over every group: A the chunk's
/// columns, B the chunk's dy, C the weight gradient (`beta` 0 for the step's first image).
/// Row-major `dW[g] += dy[b,g]·col[b,g]ᵀ` is column-major `dWᵀ (K × og) += col (K × P) · dyᵀ (P × og)`.
pub(crate) fn backward_weight_gemm(g: &ConvGeom, i: usize, first: bool) -> Gemm {
    let (p, k, og, groups) = (g.p(), g.k(), g.og(), g.groups());
    Gemm {
        m: k,
        n: og,
        k: p,
        a: mat(i * g.col_len(), p, k * p, true),
        b: mat(i * g.out_len(), p, og * p, false),
        beta: if first { 0.0 } else { 1.0 },
        c: mat(0, k, og * k, false),
        count: groups,
    }
}

/// Runs `gm` on operands whose buffers start at device addresses `a`, `b`, `c` (f32).
fn run_gemm(be: &CudaBackend, gm: &Gemm, a: u64, b: u64, c: u64) -> Result<()> {
    let sizes = [gm.m, gm.n, gm.k, gm.count, gm.a.ld, gm.b.ld, gm.c.ld];
    if sizes.iter().any(|&s| s > i32::MAX as usize) {
        return Err(RuntimeError::Unsupported {
            backend: "cuda".into(),
            op: "conv2d".into(),
            reason: format!("a convolution GEMM of {sizes:?} (cuBLAS takes 32-bit sizes)"),
        });
    }
    let m = |base: u64, x: Mat| ColMat {
        ptr: base + (x.off * F32) as u64,
        ld: x.ld as i64,
        stride: x.stride as i64,
        trans: x.trans,
    };
    gemm_f32(be, (gm.m, gm.n, gm.k), 1.0, m(a, gm.a), m(b, gm.b), gm.beta, m(c, gm.c), gm.count)
}

/// `imgs` images' columns from `x` (the first image's address) into `col`.
fn im2col(be: &CudaBackend, g: &ConvGeom, x: u64, col: u64, imgs: usize) -> Result<()> {
    let n = imgs * g.col_len();
    let args = [Arg::Ptr(x), Arg::Ptr(col), Arg::I64(imgs as i64)];
    launch_then(be.gpu(), "vision_im2col", elementwise(n), &args, Some(g))
}

fn col2im(be: &CudaBackend, g: &ConvGeom, col: u64, dx: u64, imgs: usize) -> Result<()> {
    let n = imgs * g.image_len();
    let args = [Arg::Ptr(col), Arg::Ptr(dx), Arg::I64(imgs as i64)];
    launch_then(be.gpu(), "vision_col2im", elementwise(n), &args, Some(g))
}

/// The chunk's column buffer, none for a direct convolution. It is the op's declared workspace
/// to the byte (`Op::workspace_bytes`, which the memory accountant charges while the op runs),
/// so it is Program memory: the allocator's Program peak equals the accountant's where a
/// convolution sets the step's peak.
fn columns(be: &CudaBackend, g: &ConvGeom) -> Result<Option<CudaTensor>> {
    if g.direct() {
        return Ok(None);
    }
    let len = g.chunk() * g.col_len();
    Ok(Some(CudaTensor::empty(be.gpu(), &[len], tessera_ir::DType::F32, Purpose::Program)?))
}

fn addr(t: &CudaTensor, elements: usize) -> u64 {
    t.ptr() + (elements * F32) as u64
}

fn expect_dims(op: &str, what: &str, got: [usize; 4], want: [usize; 4]) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(bad(format!("{op}: {what} {got:?} must be {want:?}")))
    }
}

/// `y = conv(x, w)`.
pub(crate) fn forward(
    be: &CudaBackend,
    x: &CudaTensor,
    w: &CudaTensor,
    spec: &Conv2dSpec,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "conv2d";
    let g = ConvGeom::new(dims4(x.dims(), OP, "x")?, dims4(w.dims(), OP, "weight")?, spec, OP)?;
    let yd = dims4(out.shape.dims(), OP, "output")?;
    expect_dims(OP, "output", yd, [g.n, g.o, g.ho, g.wo].map(|v| v as usize))?;
    let y = be.new_out(out, p)?;
    if y.numel() == 0 {
        return Ok(y);
    }
    if g.k() == 0 {
        be.fill_pub(&y, 0.0)?;
        return Ok(y);
    }
    let (x, w) = (be.dense_pub(x)?, be.dense_pub(w)?);
    let col = columns(be, &g)?;
    for b0 in (0..g.n()).step_by(g.chunk()) {
        let imgs = g.chunk().min(g.n() - b0);
        let src = match &col {
            None => addr(&x, b0 * g.image_len()),
            Some(col) => {
                im2col(be, &g, addr(&x, b0 * g.image_len()), col.ptr(), imgs)?;
                col.ptr()
            }
        };
        for gm in forward_gemms(&g, imgs) {
            run_gemm(be, &gm, src, w.ptr(), addr(&y, b0 * g.out_len()))?;
        }
    }
    Ok(y)
}

/// dx of a convolution from `w` and `dy`.
pub(crate) fn backward_input(
    be: &CudaBackend,
    w: &CudaTensor,
    dy: &CudaTensor,
    spec: &Conv2dSpec,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "conv2d_backward_input";
    let xd = dims4(out.shape.dims(), OP, "output")?;
    let g = ConvGeom::new(xd, dims4(w.dims(), OP, "weight")?, spec, OP)?;
    expect_dims(OP, "dy", dims4(dy.dims(), OP, "dy")?, [g.n, g.o, g.ho, g.wo].map(|v| v as usize))?;
    let dx = be.new_out(out, p)?;
    if dx.numel() == 0 {
        return Ok(dx);
    }
    if g.og() == 0 {
        be.fill_pub(&dx, 0.0)?;
        return Ok(dx);
    }
    let (w, dy) = (be.dense_pub(w)?, be.dense_pub(dy)?);
    let col = columns(be, &g)?;
    for b0 in (0..g.n()).step_by(g.chunk()) {
        let imgs = g.chunk().min(g.n() - b0);
        let dst = col.as_ref().map_or_else(|| addr(&dx, b0 * g.image_len()), |c| c.ptr());
        for gm in backward_input_gemms(&g, imgs) {
            run_gemm(be, &gm, addr(&dy, b0 * g.out_len()), w.ptr(), dst)?;
        }
        if let Some(col) = &col {
            col2im(be, &g, col.ptr(), addr(&dx, b0 * g.image_len()), imgs)?;
        }
    }
    Ok(dx)
}

/// dw of a convolution from `x` and `dy`.
pub(crate) fn backward_weight(
    be: &CudaBackend,
    x: &CudaTensor,
    dy: &CudaTensor,
    spec: &Conv2dSpec,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "conv2d_backward_weight";
    let wd = dims4(out.shape.dims(), OP, "output")?;
    let g = ConvGeom::new(dims4(x.dims(), OP, "x")?, wd, spec, OP)?;
    expect_dims(OP, "dy", dims4(dy.dims(), OP, "dy")?, [g.n, g.o, g.ho, g.wo].map(|v| v as usize))?;
    let dw = be.new_out(out, p)?;
    if dw.numel() == 0 {
        return Ok(dw);
    }
    if g.n() == 0 {
        be.fill_pub(&dw, 0.0)?;
        return Ok(dw);
    }
    let (x, dy) = (be.dense_pub(x)?, be.dense_pub(dy)?);
    let col = columns(be, &g)?;
    for b0 in (0..g.n()).step_by(g.chunk()) {
        let imgs = g.chunk().min(g.n() - b0);
        let src = match &col {
            None => addr(&x, b0 * g.image_len()),
            Some(col) => {
                im2col(be, &g, addr(&x, b0 * g.image_len()), col.ptr(), imgs)?;
                col.ptr()
            }
        };
        for i in 0..imgs {
            let gm = backward_weight_gemm(&g, i, b0 == 0 && i == 0);
            run_gemm(be, &gm, src, addr(&dy, b0 * g.out_len()), dw.ptr())?;
        }
    }
    Ok(dw)
}

#[cfg(test)]
mod tests {
    //! The GEMM plans and the column layout, run on the CPU (a column-major GEMM and the
    //! kernels' im2col / col2im index arithmetic in Rust) against the CPU kernels.
    use super::*;
    use candle_core::{Device, Tensor};
    use tessera_ir::{DType, Op, Shape};

    fn gemm_ref(gm: &Gemm, a: &[f32], b: &[f32], c: &mut [f32]) {
        for t in 0..gm.count {
            let (ao, bo, co) = (
                gm.a.off + t * gm.a.stride,
                gm.b.off + t * gm.b.stride,
                gm.c.off + t * gm.c.stride,
            );
            for j in 0..gm.n {
                for i in 0..gm.m {
                    let mut s = 0f64;
                    for l in 0..gm.k {
                        let av = if gm.a.trans {
                            a[ao + i * gm.a.ld + l]
                        } else {
                            a[ao + l * gm.a.ld + i]
                        };
                        let bv = if gm.b.trans {
                            b[bo + l * gm.b.ld + j]
                        } else {
                            b[bo + j * gm.b.ld + l]
                        };
                        s += av as f64 * bv as f64;
                    }
                    let dst = &mut c[co + j * gm.c.ld + i];
                    // cuBLAS reads no C when beta is 0 (the buffers start as NaN here).
                    *dst = if gm.beta == 0.0 { s as f32 } else { s as f32 + gm.beta * *dst };
                }
            }
        }
    }

    /// `vision_im2col` for `imgs` images of `x`.
    fn im2col_ref(g: &ConvGeom, x: &[f32], imgs: usize) -> Vec<f32> {
        let (p, rows) = (g.p() as i64, g.c * g.kh * g.kw);
        (0..imgs as i64 * rows * p)
            .map(|i| {
                let (pos, r, b) = (i % p, (i / p) % rows, i / (p * rows));
                let (ci, ky, kx) = (r / (g.kh * g.kw), (r / g.kw) % g.kh, r % g.kw);
                let iy = (pos / g.wo) * g.sh + ky * g.dh - g.ph;
                let ix = (pos % g.wo) * g.sw + kx * g.dw - g.pw;
                let inside = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
                if inside {
                    x[(((b * g.c + ci) * g.h + iy) * g.w + ix) as usize]
                } else {
                    0.0
                }
            })
            .collect()
    }

    /// `vision_col2im` for `imgs` images.
    fn col2im_ref(g: &ConvGeom, col: &[f32], imgs: usize) -> Vec<f32> {
        let p = g.p() as i64;
        (0..imgs as i64 * g.c * g.h * g.w)
            .map(|i| {
                let (ix, iy, plane) = (i % g.w, (i / g.w) % g.h, i / (g.h * g.w));
                let mut s = 0f32;
                for ky in 0..g.kh {
                    let ty = iy + g.ph - ky * g.dh;
                    if ty < 0 || ty % g.sh != 0 || ty / g.sh >= g.ho {
                        continue;
                    }
                    for kx in 0..g.kw {
                        let tx = ix + g.pw - kx * g.dw;
                        if tx < 0 || tx % g.sw != 0 || tx / g.sw >= g.wo {
                            continue;
                        }
                        let r = (plane * g.kh + ky) * g.kw + kx;
                        s += col[(r * p + ty / g.sh * g.wo + tx / g.sw) as usize];
                    }
                }
                s
            })
            .collect()
    }

    fn rand(st: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *st ^= *st << 13;
                *st ^= *st >> 7;
                *st ^= *st << 17;
                (*st >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    fn cpu(op: &Op, x: &[(&[usize], &[f32])]) -> Vec<f32> {
        let ts: Vec<Tensor> = x
            .iter()
            .map(|(d, v)| Tensor::from_vec(v.to_vec(), d.to_vec(), &Device::Cpu).unwrap())
            .collect();
        let metas: Vec<TensorMeta> = x
            .iter()
            .map(|(d, _)| TensorMeta { shape: Shape::from(d.to_vec()), dtype: DType::F32 })
            .collect();
        let out = op.infer(&metas.iter().collect::<Vec<_>>()).unwrap();
        let refs: Vec<&Tensor> = ts.iter().collect();
        let y = tessera_runtime::kernels::execute(op, &refs, &out).unwrap();
        y[0].flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    fn close(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        let num: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
        let err = (num / den.max(1e-30)).sqrt();
        assert!(err < 1e-5, "{what}: rel err {err:e}");
    }

    /// Every path (direct, columns; images or groups batched; chunks of 4 and a tail) of the
    /// three ops, their plans run on the CPU, against the CPU kernels.
    #[test]
    fn the_gemm_plans_are_the_cpu_convolutions() {
        type Case = ([usize; 4], [usize; 4], [usize; 2], [usize; 2], [usize; 2], usize);
        let cases: &[Case] = &[
            ([2, 3, 9, 7], [5, 3, 3, 3], [1, 1], [1, 1], [1, 1], 1),
            ([6, 4, 11, 13], [6, 4, 3, 3], [2, 2], [1, 1], [1, 1], 1),
            ([2, 4, 10, 9], [4, 4, 5, 3], [2, 1], [2, 1], [1, 2], 1),
            ([5, 6, 12, 10], [4, 3, 3, 3], [1, 1], [2, 2], [2, 2], 2),
            ([3, 8, 9, 9], [8, 1, 3, 3], [1, 1], [1, 1], [1, 1], 8),
            ([2, 4, 8, 7], [8, 1, 3, 3], [2, 2], [1, 1], [1, 1], 4),
            ([5, 8, 6, 5], [12, 8, 1, 1], [1, 1], [0, 0], [1, 1], 1),
            ([5, 8, 6, 5], [12, 4, 1, 1], [1, 1], [0, 0], [1, 1], 2),
            ([2, 6, 7, 7], [4, 6, 1, 1], [2, 2], [0, 0], [1, 1], 1),
        ];
        let mut st = 0x1234_5678_9ABC_DEF1u64;
        for &(xd, wd, stride, padding, dilation, groups) in cases {
            let spec = Conv2dSpec { stride, padding, dilation, groups };
            let g = ConvGeom::new(xd, wd, &spec, "test").unwrap();
            let yd = [g.n, g.o, g.ho, g.wo].map(|v| v as usize);
            let (x, w, dy) = (
                rand(&mut st, xd.iter().product()),
                rand(&mut st, wd.iter().product()),
                rand(&mut st, yd.iter().product()),
            );
            let what = format!("{xd:?} {wd:?} {spec:?}");
            let (mut y, mut dx, mut dw) =
                (vec![0f32; dy.len()], vec![0f32; x.len()], vec![f32::NAN; w.len()]);
            for b0 in (0..g.n()).step_by(g.chunk()) {
                let imgs = g.chunk().min(g.n() - b0);
                let xs = &x[b0 * g.image_len()..(b0 + imgs) * g.image_len()];
                let cols = if g.direct() { xs.to_vec() } else { im2col_ref(&g, xs, imgs) };
                let ys = &mut y[b0 * g.out_len()..(b0 + imgs) * g.out_len()];
                for gm in forward_gemms(&g, imgs) {
                    gemm_ref(&gm, &cols, &w, ys);
                }
                let dys = &dy[b0 * g.out_len()..(b0 + imgs) * g.out_len()];
                let mut dcol = vec![f32::NAN; imgs * g.col_len()];
                for gm in backward_input_gemms(&g, imgs) {
                    gemm_ref(&gm, dys, &w, &mut dcol);
                }
                let dxs = if g.direct() { dcol } else { col2im_ref(&g, &dcol, imgs) };
                dx[b0 * g.image_len()..(b0 + imgs) * g.image_len()].copy_from_slice(&dxs);
                for i in 0..imgs {
                    gemm_ref(&backward_weight_gemm(&g, i, b0 == 0 && i == 0), &cols, dys, &mut dw);
                }
            }
            close(&y, &cpu(&Op::Conv2d(spec), &[(&xd, &x), (&wd, &w)]), &format!("forward {what}"));
            let op = Op::Conv2dBackwardInput { spec, input_hw: [xd[2], xd[3]] };
            close(&dx, &cpu(&op, &[(&wd, &w), (&yd, &dy)]), &format!("backward input {what}"));
            let op = Op::Conv2dBackwardWeight { spec, kernel_hw: [wd[2], wd[3]] };
            close(&dw, &cpu(&op, &[(&xd, &x), (&yd, &dy)]), &format!("backward weight {what}"));
        }
    }

    /// The column buffer is exactly the workspace the op declares.
    #[test]
    fn the_columns_are_the_declared_workspace() {
        let spec = Conv2dSpec { stride: [2, 1], padding: [1, 1], ..Default::default() };
        let (xd, wd) = ([7usize, 3, 10, 9], [4usize, 3, 3, 3]);
        let g = ConvGeom::new(xd, wd, &spec, "test").unwrap();
        let m = |d: &[usize]| TensorMeta { shape: Shape::from(d.to_vec()), dtype: DType::F32 };
        let declared = Op::Conv2d(spec).workspace_bytes(&[&m(&xd), &m(&wd)]);
        assert_eq!((g.chunk() * g.col_len() * F32) as u64, declared);
    }
}
