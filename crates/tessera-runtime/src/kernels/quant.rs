//! Weight-only quantised matmul ([`tessera_ir::QuantSpec`]): `x · dequant(w)ᵀ`, the weight
//! dequantised inside the kernel, never as a whole.
//!
//! Two paths, both accumulating in f32:
//!
//! - **Few rows of x** (≤ [`SMALL_M`], decode): parallel over blocks of output features (rows
//!   of the weight). Each weight row is read from memory once for all rows of x: for a block
//!   of up to 8 rows of x at a time (the row stays in L1 between blocks), its codes become
//!   exact f32 `u − offset` in registers and meet x through fixed-width lane accumulators,
//!   which LLVM vectorises (a copy compiled for AVX2+FMA is picked at run time). A group's
//!   lanes are scaled into the row's totals when the group ends, so the hot loop is a plain
//!   u8 → f32 convert and FMA. For int4, x is first split into its even and odd features, so a
//!   byte's low nibble meets the even ones and its high nibble the odd ones, both contiguous.
//!   Scratch: that split copy of x (int4 only; ≤ 16 rows of K, within the declared tile).
//! - **Many rows** (prefill): a tile of ≤ [`TILE_ROWS`] weight rows is dequantised into one f32
//!   scratch `[64, K]` and multiplied with `gemm` straight into the tile's strided output
//!   columns; tiles run one after another (gemm parallel inside), so the scratch stays one
//!   tile — what the op declares as its workspace (`tessera_ir::ops::quant`).
//!
//! Products are exact `x · (u − offset)` (or `x · scale·(u − offset)` in a tile), so results
//! differ from a plain scalar loop only by summation order (and a tile's rounding of
//! `scale·(u − offset)` to f32). Subtracting `offset · Σx` after a `Σx·u` loop was not used:
//! it cancels badly when x has a large mean (GELU outputs), for no gain — the convert is
//! exact and costs one integer op per 8 codes, shared by the rows of x.

use super::matmul::{all_threads, gemm_f32, MatMut, MatRef, SendPtr};
use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::{DType, Tensor};
use rayon::prelude::*;
use std::array::from_fn;
use tessera_ir::QuantSpec;

/// Rows of x up to which the per-feature (decode) path runs; above it, tiles and gemm.
pub const SMALL_M: usize = 16;

/// Weight rows dequantised at once on the gemm path (`tessera_ir`'s `QMATMUL_TILE_ROWS`).
pub const TILE_ROWS: usize = 64;

fn bad(reason: String) -> RuntimeError {
    RuntimeError::Binding(format!("qmatmul: {reason}"))
}

/// The quantised weight: row `j`'s codes and scales.
#[derive(Clone, Copy)]
struct Weights<'a> {
    codes: &'a [u8],
    scales: &'a [f32],
    n: usize,
    k: usize,
    rb: usize,
    groups: usize,
    q: QuantSpec,
}

impl<'a> Weights<'a> {
    fn row(&self, j: usize) -> (&'a [u8], &'a [f32]) {
        (
            &self.codes[j * self.rb..(j + 1) * self.rb],
            &self.scales[j * self.groups..(j + 1) * self.groups],
        )
    }
}

/// `x [.., K] f32 · dequant(w [N, K·bits/8] u8, scales [N, K/group] f32)ᵀ` → `[.., N]`.
pub fn qmatmul(x: &Tensor, w: &Tensor, scales: &Tensor, q: QuantSpec) -> Result<Tensor> {
    if x.dtype() != DType::F32 || w.dtype() != DType::U8 || scales.dtype() != DType::F32 {
        return Err(bad(format!(
            "x {:?}, weight {:?}, scales {:?}: expected f32, u8, f32",
            x.dtype(),
            w.dtype(),
            scales.dtype()
        )));
    }
    let Some((&k, lead)) = x.dims().split_last() else {
        return Err(bad("x has no features".into()));
    };
    let &[n, rb] = w.dims() else { return Err(bad(format!("weight {:?} is not 2-d", w.dims()))) };
    if !matches!(q.bits, 4 | 8) || q.group == 0 {
        return Err(bad(format!("{} bits in groups of {}: give 8 or 4 bits", q.bits, q.group)));
    }
    let groups = k / q.group;
    if k % q.group != 0
        || (k * q.bits as usize) % 8 != 0
        || rb != q.row_bytes(k)
        || scales.dims() != [n, groups]
    {
        return Err(bad(format!(
            "weight {:?} / scales {:?} do not fit {k} features ({} bits, groups of {})",
            w.dims(),
            scales.dims(),
            q.bits,
            q.group
        )));
    }
    let m: usize = lead.iter().product();
    let mut dims = x.dims().to_vec();
    if let Some(l) = dims.last_mut() {
        *l = n;
    }
    let mut out = vec![0f32; m * n];
    if m > 0 && n > 0 && k > 0 {
        let (x, w, scales) = (contiguous(x)?, contiguous(w)?, contiguous(scales)?);
        let (xs, ws, ss) = (read::<f32>(&x)?, read::<u8>(&w)?, read::<f32>(&scales)?);
        let wt = Weights { codes: &ws, scales: &ss, n, k, rb, groups, q };
        if m <= SMALL_M {
            few_rows(&xs, m, wt, &mut out);
        } else {
            tiled(&xs, m, wt, &mut out);
        }
    }
    from_vec(out, &dims)
}

// ---- few rows of x: per output feature ------------------------------------------------------

/// `out [m, N] = x [m, K] · dequant(w)ᵀ`, parallel over blocks of weight rows.
fn few_rows(xs: &[f32], m: usize, w: Weights, out: &mut [f32]) {
    // int4 in even groups: x's even and odd features apart (`[m, K/2]` each), so both nibbles
    // of a byte meet contiguous x.
    let split = (w.q.bits == 4 && w.q.group % 2 == 0).then(|| deinterleave(xs, m, w.k));
    let split = split.as_ref().map(|(e, o)| (e.as_slice(), o.as_slice()));
    let tasks = rayon::current_num_threads().max(1) * 4;
    let chunk = w.n.div_ceil(tasks).clamp(8, 256);
    let op = SendPtr(out.as_mut_ptr());
    (0..w.n.div_ceil(chunk)).into_par_iter().for_each(|t| {
        let rows = (t * chunk, ((t + 1) * chunk).min(w.n));
        // SAFETY: this task writes output columns rows.0..rows.1 only; `out` is [m, N].
        unsafe { rows_task(xs, split, m, w, rows, op) };
    });
}

/// `(even, odd)` features of each row of `x [m, k]`, each `[m, k/2]`.
fn deinterleave(xs: &[f32], m: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
    let h = k / 2;
    let (mut e, mut o) = (vec![0f32; m * h], vec![0f32; m * h]);
    for ((row, er), or) in
        xs.chunks_exact(k).take(m).zip(e.chunks_exact_mut(h)).zip(o.chunks_exact_mut(h))
    {
        for ((p, a), b) in row.chunks_exact(2).zip(er).zip(or) {
            *a = p[0];
            *b = p[1];
        }
    }
    (e, o)
}

/// # Safety
/// `out` points at an `[m, w.n]` buffer whose columns `rows` no other thread touches.
unsafe fn rows_task(
    xs: &[f32],
    split: Option<(&[f32], &[f32])>,
    m: usize,
    w: Weights,
    rows: (usize, usize),
    out: SendPtr<f32>,
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports the features the function is compiled for; the rest is
        // the caller's contract.
        return unsafe { rows_task_avx2(xs, split, m, w, rows, out) };
    }
    // SAFETY: the caller's contract.
    unsafe { rows_task_body::<false>(xs, split, m, w, rows, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_task_avx2(
    xs: &[f32],
    split: Option<(&[f32], &[f32])>,
    m: usize,
    w: Weights,
    rows: (usize, usize),
    out: SendPtr<f32>,
) {
    // SAFETY: the caller's contract.
    unsafe { rows_task_body::<true>(xs, split, m, w, rows, out) }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// Output columns `rows` of every row of x: blocks of 8, 4, 2 and 1 rows of x per weight row.
#[inline(always)]
unsafe fn rows_task_body<const FMA: bool>(
    xs: &[f32],
    split: Option<(&[f32], &[f32])>,
    m: usize,
    w: Weights,
    rows: (usize, usize),
    out: SendPtr<f32>,
) {
    for j in rows.0..rows.1 {
        let (codes, scales) = w.row(j);
        let mut i = 0;
        while i < m {
            let left = m - i;
            // SAFETY (each arm): the caller's contract; element (i + r, j) of `[m, n]`.
            if left >= 8 {
                let v = block::<8, 8, FMA>(xs, split, i, w, codes, scales);
                unsafe { store(out, w.n, i, j, &v) };
                i += 8;
            } else if left >= 4 {
                let v = block::<4, 8, FMA>(xs, split, i, w, codes, scales);
                unsafe { store(out, w.n, i, j, &v) };
                i += 4;
            } else if left >= 2 {
                let v = block::<2, 16, FMA>(xs, split, i, w, codes, scales);
                unsafe { store(out, w.n, i, j, &v) };
                i += 2;
            } else {
                let v = block::<1, 32, FMA>(xs, split, i, w, codes, scales);
                unsafe { store(out, w.n, i, j, &v) };
                i += 1;
            }
        }
    }
}

/// # Safety
/// Elements `(i + r, j)` of the `[.., n]` buffer at `out` are in bounds and this thread's.
#[inline(always)]
unsafe fn store<const R: usize>(out: SendPtr<f32>, n: usize, i: usize, j: usize, v: &[f32; R]) {
    for (r, &x) in v.iter().enumerate() {
        // SAFETY: the caller's contract.
        unsafe { *out.get().add((i + r) * n + j) = x };
    }
}

/// Output feature `j` (its `codes`, `scales`) of rows `i..i + R` of x.
#[inline(always)]
fn block<const R: usize, const L: usize, const FMA: bool>(
    xs: &[f32],
    split: Option<(&[f32], &[f32])>,
    i: usize,
    w: Weights,
    codes: &[u8],
    scales: &[f32],
) -> [f32; R] {
    let k = w.k;
    if w.q.bits == 8 {
        let x: [&[f32]; R] = from_fn(|r| &xs[(i + r) * k..(i + r + 1) * k]);
        int8_rows::<R, L, FMA>(x, codes, scales, w.q.group)
    } else if let Some((e, o)) = split {
        let h = k / 2;
        let xe: [&[f32]; R] = from_fn(|r| &e[(i + r) * h..(i + r + 1) * h]);
        let xo: [&[f32]; R] = from_fn(|r| &o[(i + r) * h..(i + r + 1) * h]);
        int4_rows::<R, L, FMA>(xe, xo, codes, scales, w.q.group / 2)
    } else {
        from_fn(|r| dot_any(&xs[(i + r) * k..(i + r + 1) * k], codes, scales, w.q))
    }
}

/// `a·b + c`, fused where the CPU has FMA (this copy is compiled with it).
#[inline(always)]
fn fmadd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Sum of the lanes, pairwise (so it vectorises).
#[inline(always)]
fn lanes_sum<const L: usize>(a: &[f32; L]) -> f32 {
    let mut v = *a;
    let mut w = L;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            v[l] += v[l + w];
        }
    }
    v[0]
}

/// Rows `x[r]` (K features) against one int8 weight row in groups of `g`.
#[inline(always)]
fn int8_rows<const R: usize, const L: usize, const FMA: bool>(
    x: [&[f32]; R],
    codes: &[u8],
    scales: &[f32],
    g: usize,
) -> [f32; R] {
    let mut tot = [[0f32; L]; R];
    let mut tail = [0f32; R];
    for (gi, (wg, &s)) in codes.chunks_exact(g).zip(scales).enumerate() {
        let xg: [&[f32]; R] = from_fn(|r| &x[r][gi * g..(gi + 1) * g]);
        let mut acc = [[0f32; L]; R];
        let chunks = wg.chunks_exact(L);
        let rest = chunks.remainder();
        for (c, wl) in chunks.enumerate() {
            let mut wf = [0f32; L];
            for (f, &b) in wf.iter_mut().zip(wl) {
                *f = (b as i32 - 128) as f32;
            }
            for (a, xr) in acc.iter_mut().zip(&xg) {
                let xr = &xr[c * L..c * L + L];
                for l in 0..L {
                    a[l] = fmadd::<FMA>(xr[l], wf[l], a[l]);
                }
            }
        }
        let at = g - rest.len();
        let mut part = [0f32; R];
        for (f, &b) in rest.iter().enumerate() {
            let wv = (b as i32 - 128) as f32;
            for (p, xr) in part.iter_mut().zip(&xg) {
                *p = fmadd::<FMA>(xr[at + f], wv, *p);
            }
        }
        for r in 0..R {
            for l in 0..L {
                tot[r][l] = fmadd::<FMA>(s, acc[r][l], tot[r][l]);
            }
            tail[r] = fmadd::<FMA>(s, part[r], tail[r]);
        }
    }
    from_fn(|r| lanes_sum(&tot[r]) + tail[r])
}

/// Rows of x split into even (`xe`) and odd (`xo`) features against one int4 weight row whose
/// groups hold `h` bytes (2·h features).
#[inline(always)]
fn int4_rows<const R: usize, const L: usize, const FMA: bool>(
    xe: [&[f32]; R],
    xo: [&[f32]; R],
    codes: &[u8],
    scales: &[f32],
    h: usize,
) -> [f32; R] {
    let mut tot = [[0f32; L]; R];
    let mut tail = [0f32; R];
    for (gi, (wg, &s)) in codes.chunks_exact(h).zip(scales).enumerate() {
        let eg: [&[f32]; R] = from_fn(|r| &xe[r][gi * h..(gi + 1) * h]);
        let og: [&[f32]; R] = from_fn(|r| &xo[r][gi * h..(gi + 1) * h]);
        let mut acc = [[0f32; L]; R];
        let chunks = wg.chunks_exact(L);
        let rest = chunks.remainder();
        for (c, wl) in chunks.enumerate() {
            let (mut lo, mut hi) = ([0f32; L], [0f32; L]);
            for ((a, b), &byte) in lo.iter_mut().zip(hi.iter_mut()).zip(wl) {
                *a = ((byte & 15) as i32 - 8) as f32;
                *b = ((byte >> 4) as i32 - 8) as f32;
            }
            for r in 0..R {
                let (er, or) = (&eg[r][c * L..c * L + L], &og[r][c * L..c * L + L]);
                for l in 0..L {
                    acc[r][l] = fmadd::<FMA>(er[l], lo[l], acc[r][l]);
                    acc[r][l] = fmadd::<FMA>(or[l], hi[l], acc[r][l]);
                }
            }
        }
        let at = h - rest.len();
        let mut part = [0f32; R];
        for (t, &byte) in rest.iter().enumerate() {
            let lo = ((byte & 15) as i32 - 8) as f32;
            let hi = ((byte >> 4) as i32 - 8) as f32;
            for r in 0..R {
                part[r] = fmadd::<FMA>(eg[r][at + t], lo, part[r]);
                part[r] = fmadd::<FMA>(og[r][at + t], hi, part[r]);
            }
        }
        for r in 0..R {
            for l in 0..L {
                tot[r][l] = fmadd::<FMA>(s, acc[r][l], tot[r][l]);
            }
            tail[r] = fmadd::<FMA>(s, part[r], tail[r]);
        }
    }
    from_fn(|r| lanes_sum(&tot[r]) + tail[r])
}

/// The code of feature `f` minus the offset (any format, any group).
#[inline(always)]
fn code(codes: &[u8], f: usize, q: QuantSpec) -> f32 {
    let raw = if q.bits == 8 {
        codes[f] as i32
    } else if f % 2 == 0 {
        (codes[f / 2] & 15) as i32
    } else {
        (codes[f / 2] >> 4) as i32
    };
    (raw - q.offset()) as f32
}

/// `Σ_f x[f] · scale[f / group] · (code[f] − offset)`, feature by feature (int4 in odd groups,
/// whose groups split bytes).
fn dot_any(x: &[f32], codes: &[u8], scales: &[f32], q: QuantSpec) -> f32 {
    let g = q.group;
    let mut acc = 0f32;
    for (gi, &s) in scales.iter().enumerate() {
        let sum: f32 = (gi * g..(gi + 1) * g).map(|f| x[f] * code(codes, f, q)).sum();
        acc += s * sum;
    }
    acc
}

// ---- many rows of x: dequantised tiles and gemm ---------------------------------------------

/// `out [m, N] = x [m, K] · dequant(w)ᵀ` through one f32 tile of ≤ [`TILE_ROWS`] weight rows.
fn tiled(xs: &[f32], m: usize, w: Weights, out: &mut [f32]) {
    let (n, k) = (w.n, w.k);
    let t = TILE_ROWS.min(n);
    let mut tile = vec![0f32; t * k];
    let x = MatRef { ptr: xs.as_ptr(), rs: k as isize, cs: 1 };
    for j0 in (0..n).step_by(t) {
        let rows = t.min(n - j0);
        tile[..rows * k].par_chunks_mut(k).enumerate().for_each(|(r, dst)| {
            let (codes, scales) = w.row(j0 + r);
            dequantize_row(codes, scales, w.q, dst);
        });
        // Tile row r is output column j0 + r: rhs (f, r) = tile[r·k + f].
        let rhs = MatRef { ptr: tile.as_ptr(), rs: k as isize, cs: 1 }.t();
        let dst = MatMut { ptr: out[j0..].as_mut_ptr(), rs: n as isize, cs: 1 };
        // SAFETY: x is [m, k], the tile holds rows·k elements, and dst's m × rows elements
        // (row stride n, from column j0) lie inside out [m, n]; nothing else touches them.
        unsafe { gemm_f32(m, rows, k, dst, false, x, rhs, 1.0, all_threads()) };
    }
}

/// `dst[f] = scale[f / group] · (code[f] − offset)` for one weight row.
fn dequantize_row(codes: &[u8], scales: &[f32], q: QuantSpec, dst: &mut [f32]) {
    let g = q.group;
    if q.bits == 8 {
        for ((d, c), &s) in dst.chunks_exact_mut(g).zip(codes.chunks_exact(g)).zip(scales) {
            for (d, &b) in d.iter_mut().zip(c) {
                *d = s * (b as i32 - 128) as f32;
            }
        }
    } else if g % 2 == 0 {
        for ((d, c), &s) in dst.chunks_exact_mut(g).zip(codes.chunks_exact(g / 2)).zip(scales) {
            for (d, &b) in d.chunks_exact_mut(2).zip(c) {
                d[0] = s * ((b & 15) as i32 - 8) as f32;
                d[1] = s * ((b >> 4) as i32 - 8) as f32;
            }
        }
    } else {
        for (f, d) in dst.iter_mut().enumerate() {
            *d = scales[f / g] * code(codes, f, q);
        }
    }
}
