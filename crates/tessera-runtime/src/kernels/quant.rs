//! Weight-only quantised matmul ([`tessera_ir::QuantSpec`]): `x · dequant(w)ᵀ`, the weight
//! dequantised inside the kernel, never as a whole.
//!
//! Two paths, both accumulating in f32:
//!
//! - **Few rows of x** (≤ [`SMALL_M`], decode): parallel over blocks of output features (rows
//!   of the weight, rayon). Each weight row is read from memory once for all rows of x: it
//!   meets blocks of 8, 4, 2 and 1 rows of x in turn (staying in L1 between blocks). 8 codes
//!   at a time become exact f32 `u − offset` in one register and are multiplied into `R`
//!   rows × `S` registers of lane accumulators (8 × 1, 4 × 2, 2 × 2, 1 × 4); a group's
//!   accumulators are scaled into the row's totals when the group ends, and summed across
//!   lanes once per output. The CPU's AVX2 + FMA copy (picked at run time with
//!   `is_x86_feature_detected!`) is written with intrinsics: left to auto-vectorisation these
//!   multi-row loops came out scalarised, or shuffled across rows, depending on small changes
//!   (int8 at 8 rows ran 2 to 6× slower); the portable copy keeps fixed-width lane arrays.
//!   For int4, x is first permuted so that 8 bytes' low nibbles meet 8 contiguous features of
//!   x and their high nibbles the next 8 ([`nibble_order`]); scratch: that copy of x (≤ 16
//!   rows of K, within the declared tile). int4 in odd groups (which split a byte; the IR
//!   allows them, `quantize` never makes them) goes feature by feature.
//! - **Many rows** (prefill): a tile of ≤ [`TILE_ROWS`] weight rows is dequantised into one f32
//!   scratch `[64, K]` and multiplied with `gemm` straight into the tile's strided output
//!   columns; tiles run one after another (gemm parallel inside), so the scratch stays one
//!   tile — what the op declares as its workspace (`tessera_ir::ops::quant`).
//!
//! Products are exact `x · (u − offset)` (or `x · scale·(u − offset)` in a tile), so results
//! differ from a plain scalar loop only by summation order (and a tile's rounding of
//! `scale·(u − offset)` to f32). Subtracting `offset · Σx` after a `Σx·u` loop was not used:
//! it cancels badly when x has a large mean (GELU outputs), for no gain — the exact convert
//! costs one integer op per 8 codes, shared by the rows of x.

use super::matmul::{gemm_f32, MatMut, MatRef, SendConstPtr, SendPtr};
use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::{DType, Tensor};
use gemm::Parallelism;
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
        || !(k * q.bits as usize).is_multiple_of(8)
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

/// `dy [.., N] f32 · dequant(w [N, K·bits/8] u8, scales [N, K/group] f32)` → `dx [.., K]`: the
/// input gradient of [`qmatmul`]. Tiles of ≤ [`TILE_ROWS`] weight rows are dequantised into
/// one f32 scratch `[64, K]` (the workspace the op declares) and each adds its
/// `dy[:, tile] · tile` into dx with `gemm`.
pub fn qmatmul_backward(dy: &Tensor, w: &Tensor, scales: &Tensor, q: QuantSpec) -> Result<Tensor> {
    if dy.dtype() != DType::F32 || w.dtype() != DType::U8 || scales.dtype() != DType::F32 {
        return Err(bad(format!(
            "dy {:?}, weight {:?}, scales {:?}: expected f32, u8, f32",
            dy.dtype(),
            w.dtype(),
            scales.dtype()
        )));
    }
    let Some((&n, lead)) = dy.dims().split_last() else {
        return Err(bad("dy has no features".into()));
    };
    let &[wn, rb] = w.dims() else { return Err(bad(format!("weight {:?} is not 2-d", w.dims()))) };
    if !matches!(q.bits, 4 | 8) || q.group == 0 {
        return Err(bad(format!("{} bits in groups of {}: give 8 or 4 bits", q.bits, q.group)));
    }
    let k = rb * 8 / q.bits as usize;
    let groups = k / q.group;
    if wn != n || !k.is_multiple_of(q.group) || scales.dims() != [n, groups] {
        return Err(bad(format!(
            "dy {:?}, weight {:?}, scales {:?} do not fit ({} bits, groups of {})",
            dy.dims(),
            w.dims(),
            scales.dims(),
            q.bits,
            q.group
        )));
    }
    let m: usize = lead.iter().product();
    let mut dims = dy.dims().to_vec();
    if let Some(l) = dims.last_mut() {
        *l = k;
    }
    let mut out = vec![0f32; m * k];
    if m > 0 && n > 0 && k > 0 {
        let (dy, w, scales) = (contiguous(dy)?, contiguous(w)?, contiguous(scales)?);
        let (ys, ws, ss) = (read::<f32>(&dy)?, read::<u8>(&w)?, read::<f32>(&scales)?);
        let wt = Weights { codes: &ws, scales: &ss, n, k, rb, groups, q };
        let t = TILE_ROWS.min(n);
        let mut tile = vec![0f32; t * k];
        let par = match rayon::current_num_threads() {
            0 | 1 => Parallelism::None,
            p => Parallelism::Rayon(p),
        };
        for j0 in (0..n).step_by(t) {
            let rows = t.min(n - j0);
            tile[..rows * k].par_chunks_mut(k).enumerate().for_each(|(r, dst)| {
                let (codes, scales) = wt.row(j0 + r);
                dequantize_row(codes, scales, q, dst);
            });
            let lhs = MatRef { ptr: ys.as_ptr().wrapping_add(j0), rs: n as isize, cs: 1 };
            let rhs = MatRef { ptr: tile.as_ptr(), rs: k as isize, cs: 1 };
            let dst = MatMut { ptr: out.as_mut_ptr(), rs: k as isize, cs: 1 };
            // SAFETY: dy is [m, n] (columns j0..j0+rows read, row stride n), the tile holds
            // rows × k, out is [m, k]; out overlaps neither and this thread alone writes it.
            unsafe { gemm_f32(m, k, rows, dst, j0 > 0, lhs, rhs, 1.0, par) };
        }
    }
    from_vec(out, &dims)
}

// ---- few rows of x: per output feature ------------------------------------------------------

/// Codes per vector step: 8 f32 lanes (one AVX2 register).
const V: usize = 8;

/// `out [m, N] = x [m, K] · dequant(w)ᵀ`, parallel over blocks of weight rows.
fn few_rows(xs: &[f32], m: usize, w: Weights, out: &mut [f32]) {
    // int4 in even groups: x permuted so that both nibbles of 8 bytes meet contiguous x.
    let perm =
        (w.q.bits == 4 && w.q.group.is_multiple_of(2)).then(|| nibble_order(xs, m, w.k, w.q.group));
    let x = perm.as_deref().unwrap_or(xs);
    let tasks = rayon::current_num_threads().max(1) * 4;
    let chunk = w.n.div_ceil(tasks).clamp(8, 256);
    let op = SendPtr(out.as_mut_ptr());
    (0..w.n.div_ceil(chunk)).into_par_iter().for_each(|t| {
        let rows = (t * chunk, ((t + 1) * chunk).min(w.n));
        // SAFETY: this task writes output columns rows.0..rows.1 only; `out` is [m, N].
        unsafe { rows_task(x, m, w, rows, op) };
    });
}

/// Rows of `x [m, k]` in the order int4 codes in groups of `g` (even) meet them: in each group,
/// every 16 features (8 bytes of codes) become their 8 even features then their 8 odd ones
/// (low nibbles, then high); the group's last `g mod 16` features stay in order.
fn nibble_order(xs: &[f32], m: usize, k: usize, g: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * k];
    for (src, dst) in xs.chunks_exact(g).take(m * k / g).zip(out.chunks_exact_mut(g)) {
        let blocks = src.chunks_exact(2 * V);
        let rest = blocks.remainder();
        let mut dblocks = dst.chunks_exact_mut(2 * V);
        for (s, d) in blocks.zip(&mut dblocks) {
            for l in 0..V {
                d[l] = s[2 * l];
                d[V + l] = s[2 * l + 1];
            }
        }
        dblocks.into_remainder().copy_from_slice(rest);
    }
    out
}

/// # Safety
/// `out` points at an `[m, w.n]` buffer whose columns `rows` no other thread touches.
unsafe fn rows_task(x: &[f32], m: usize, w: Weights, rows: (usize, usize), out: SendPtr<f32>) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports the features the function is compiled for; the rest is
        // the caller's contract.
        return unsafe { rows_task_avx2(x, m, w, rows, out) };
    }
    // SAFETY: the caller's contract.
    unsafe { rows_task_body::<false>(x, m, w, rows, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_task_avx2(x: &[f32], m: usize, w: Weights, rows: (usize, usize), out: SendPtr<f32>) {
    // SAFETY: the caller's contract; AVX2 and FMA are enabled here.
    unsafe { rows_task_body::<true>(x, m, w, rows, out) }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// Output columns `rows` of every row of x: for each weight row, blocks of 8, 4, 2 and 1 rows
/// of x (`R` rows × `S` vectors of 8 accumulators: 4 to 8 registers).
///
/// # Safety
/// As [`rows_task`]; with `AVX`, the CPU has AVX2 and FMA.
#[inline(always)]
unsafe fn rows_task_body<const AVX: bool>(
    x: &[f32],
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
            // SAFETY (each arm): the caller's contract; elements (i.., j) of `[m, n]`.
            if left >= 8 {
                let v = unsafe { block::<8, 1, AVX>(x, i, w, codes, scales) };
                unsafe { store(out, w.n, i, j, &v) };
                i += 8;
            } else if left >= 4 {
                let v = unsafe { block::<4, 2, AVX>(x, i, w, codes, scales) };
                unsafe { store(out, w.n, i, j, &v) };
                i += 4;
            } else if left >= 2 {
                let v = unsafe { block::<2, 2, AVX>(x, i, w, codes, scales) };
                unsafe { store(out, w.n, i, j, &v) };
                i += 2;
            } else {
                let v = unsafe { block::<1, 4, AVX>(x, i, w, codes, scales) };
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

/// Output feature `j` (its `codes`, `scales`) of rows `i..i + R` of x (int4 in even groups: x
/// in [`nibble_order`]).
///
/// # Safety
/// With `AVX`, the CPU has AVX2 and FMA.
#[inline(always)]
unsafe fn block<const R: usize, const S: usize, const AVX: bool>(
    x: &[f32],
    i: usize,
    w: Weights,
    codes: &[u8],
    scales: &[f32],
) -> [f32; R] {
    let k = w.k;
    let mut xr: [&[f32]; R] = [&[]; R];
    for (r, xr) in xr.iter_mut().enumerate() {
        *xr = &x[(i + r) * k..(i + r + 1) * k];
    }
    let g = w.q.group;
    match (w.q.bits == 8, g.is_multiple_of(2), AVX) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        (true, _, true) => unsafe { avx2::int8_rows::<R, S>(xr, codes, scales, g) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        (false, true, true) => unsafe { avx2::int4_rows::<R, S>(xr, codes, scales, g) },
        (true, _, _) => portable::int8_rows::<R, S>(xr, codes, scales, g),
        (false, true, _) => portable::int4_rows::<R, S>(xr, codes, scales, g),
        (false, false, _) => from_fn(|r| dot_any(xr[r], codes, scales, w.q)),
    }
}

/// The rows kernels in plain Rust over fixed-width lane arrays (CPUs without AVX2).
mod portable {
    use super::V;

    /// `acc += x · w`, lane by lane.
    #[inline(always)]
    fn lanes_fma(acc: &mut [f32; V], x: &[f32], w: &[f32; V]) {
        let x: &[f32; V] = x[..V].try_into().expect("V lanes");
        for l in 0..V {
            acc[l] += x[l] * w[l];
        }
    }

    /// Sum of all lanes, pairwise.
    #[inline(always)]
    fn lanes_total<const S: usize>(t: &[[f32; V]; S]) -> f32 {
        let mut v = [0f32; V];
        for a in t {
            for l in 0..V {
                v[l] += a[l];
            }
        }
        ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
    }

    /// Adds a finished group's accumulators, scaled, to the row totals.
    #[inline(always)]
    fn fold<const R: usize, const S: usize>(
        tot: &mut [[[f32; V]; S]; R],
        acc: &[[[f32; V]; S]; R],
        scale: f32,
    ) {
        for (t, a) in tot.iter_mut().zip(acc) {
            for (t, a) in t.iter_mut().zip(a) {
                for l in 0..V {
                    t[l] += scale * a[l];
                }
            }
        }
    }

    /// Rows `x[r]` (K features) against one int8 weight row in groups of `g`.
    pub(super) fn int8_rows<const R: usize, const S: usize>(
        x: [&[f32]; R],
        codes: &[u8],
        scales: &[f32],
        g: usize,
    ) -> [f32; R] {
        let mut tot = [[[0f32; V]; S]; R];
        let mut tail = [0f32; R];
        for (gi, &s) in scales.iter().enumerate() {
            let base = gi * g;
            let wg = &codes[base..base + g];
            let mut acc = [[[0f32; V]; S]; R];
            let mut f = 0;
            while f + V <= g {
                let b: &[u8; V] = wg[f..f + V].try_into().expect("V codes");
                let mut wv = [0f32; V];
                for l in 0..V {
                    wv[l] = (b[l] as i32 - 128) as f32;
                }
                let v = (f / V) % S;
                for (a, xr) in acc.iter_mut().zip(&x) {
                    lanes_fma(&mut a[v], &xr[base + f..], &wv);
                }
                f += V;
            }
            let mut part = [0f32; R];
            for (f, &b) in wg.iter().enumerate().skip(f) {
                let wv = (b as i32 - 128) as f32;
                for (p, xr) in part.iter_mut().zip(&x) {
                    *p += xr[base + f] * wv;
                }
            }
            fold(&mut tot, &acc, s);
            for (t, p) in tail.iter_mut().zip(part) {
                *t += s * p;
            }
        }
        std::array::from_fn(|r| lanes_total(&tot[r]) + tail[r])
    }

    /// Rows `x[r]` (in `nibble_order` for groups of `g`) against one int4 weight row.
    pub(super) fn int4_rows<const R: usize, const S: usize>(
        x: [&[f32]; R],
        codes: &[u8],
        scales: &[f32],
        g: usize,
    ) -> [f32; R] {
        let h = g / 2;
        let mut tot = [[[0f32; V]; S]; R];
        let mut tail = [0f32; R];
        for (gi, &s) in scales.iter().enumerate() {
            let (wg, base) = (&codes[gi * h..(gi + 1) * h], gi * g);
            let mut acc = [[[0f32; V]; S]; R];
            let mut t = 0;
            while t + V <= h {
                let b: &[u8; V] = wg[t..t + V].try_into().expect("V codes");
                let (mut lo, mut hi) = ([0f32; V], [0f32; V]);
                for l in 0..V {
                    lo[l] = ((b[l] & 15) as i32 - 8) as f32;
                    hi[l] = ((b[l] >> 4) as i32 - 8) as f32;
                }
                let v = (t / V) % S;
                for (a, xr) in acc.iter_mut().zip(&x) {
                    lanes_fma(&mut a[v], &xr[base + 2 * t..], &lo);
                    lanes_fma(&mut a[v], &xr[base + 2 * t + V..], &hi);
                }
                t += V;
            }
            let mut part = [0f32; R];
            for (t, &b) in wg.iter().enumerate().skip(t) {
                let (lo, hi) = (((b & 15) as i32 - 8) as f32, ((b >> 4) as i32 - 8) as f32);
                for (p, xr) in part.iter_mut().zip(&x) {
                    *p += xr[base + 2 * t] * lo + xr[base + 2 * t + 1] * hi;
                }
            }
            fold(&mut tot, &acc, s);
            for (t, p) in tail.iter_mut().zip(part) {
                *t += s * p;
            }
        }
        std::array::from_fn(|r| lanes_total(&tot[r]) + tail[r])
    }
}

/// The rows kernels with AVX2 + FMA intrinsics: codes widened to i32 lanes, offset
/// subtracted, converted to f32 (exact), one register of 8 codes meeting `R` rows of x.
/// (Left to auto-vectorisation, these multi-row loops came out scalarised or shuffled across
/// rows depending on small changes; intrinsics keep the accumulators in registers.)
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::V;
    use std::arch::x86_64::*;

    /// Horizontal sum of `S` vectors.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn total<const S: usize>(v: &[__m256; S]) -> f32 {
        let mut a = _mm256_setzero_ps();
        for &x in v {
            a = _mm256_add_ps(a, x);
        }
        let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// `tot += scale · acc` for every accumulator.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn fold<const R: usize, const S: usize>(
        tot: &mut [[__m256; S]; R],
        acc: &[[__m256; S]; R],
        scale: f32,
    ) {
        let sv = _mm256_set1_ps(scale);
        for (t, a) in tot.iter_mut().zip(acc) {
            for (t, &a) in t.iter_mut().zip(a) {
                *t = _mm256_fmadd_ps(sv, a, *t);
            }
        }
    }

    /// 8 bytes at `p` widened to i32 lanes.
    ///
    /// # Safety
    /// 8 bytes at `p` are readable.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn widen(p: *const u8) -> __m256i {
        // SAFETY: the caller's contract (an unaligned 8-byte load).
        _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) })
    }

    /// # Safety
    /// AVX2 and FMA are available; every `x[r]` and `codes` hold the K = scales.len()·g
    /// features (checked).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn int8_rows<const R: usize, const S: usize>(
        x: [&[f32]; R],
        codes: &[u8],
        scales: &[f32],
        g: usize,
    ) -> [f32; R] {
        let k = scales.len() * g;
        assert!(codes.len() >= k && x.iter().all(|r| r.len() >= k), "int8 row of {k} features");
        let (cp, xp) = (codes.as_ptr(), x.map(<[f32]>::as_ptr));
        let off = _mm256_set1_epi32(128);
        let mut tot = [[_mm256_setzero_ps(); S]; R];
        let mut tail = [0f32; R];
        for (gi, &s) in scales.iter().enumerate() {
            let (mut f, end) = (gi * g, (gi + 1) * g);
            let mut acc = [[_mm256_setzero_ps(); S]; R];
            // SAFETY (loads): f + S·V ≤ end ≤ k (then f + V ≤ end) elements of codes and x.
            while f + S * V <= end {
                let mut wv = [_mm256_setzero_ps(); S];
                for (v, wv) in wv.iter_mut().enumerate() {
                    let c = unsafe { widen(cp.add(f + v * V)) };
                    *wv = _mm256_cvtepi32_ps(_mm256_sub_epi32(c, off));
                }
                for (a, &xr) in acc.iter_mut().zip(&xp) {
                    for (v, (a, &wv)) in a.iter_mut().zip(&wv).enumerate() {
                        let xv = unsafe { _mm256_loadu_ps(xr.add(f + v * V)) };
                        *a = _mm256_fmadd_ps(xv, wv, *a);
                    }
                }
                f += S * V;
            }
            while f + V <= end {
                let c = unsafe { widen(cp.add(f)) };
                let wv = _mm256_cvtepi32_ps(_mm256_sub_epi32(c, off));
                for (a, &xr) in acc.iter_mut().zip(&xp) {
                    let xv = unsafe { _mm256_loadu_ps(xr.add(f)) };
                    a[0] = _mm256_fmadd_ps(xv, wv, a[0]);
                }
                f += V;
            }
            let mut part = [0f32; R];
            for f in f..end {
                let wv = (codes[f] as i32 - 128) as f32;
                for (p, xr) in part.iter_mut().zip(&x) {
                    *p = xr[f].mul_add(wv, *p);
                }
            }
            fold(&mut tot, &acc, s);
            for (t, p) in tail.iter_mut().zip(part) {
                *t = s.mul_add(p, *t);
            }
        }
        let mut out = [0f32; R];
        for ((o, t), tl) in out.iter_mut().zip(&tot).zip(tail) {
            *o = total(t) + tl;
        }
        out
    }

    /// # Safety
    /// AVX2 and FMA are available; every `x[r]` (in `nibble_order` for groups of `g`, even)
    /// holds the K = scales.len()·g features and `codes` their K/2 bytes (checked).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn int4_rows<const R: usize, const S: usize>(
        x: [&[f32]; R],
        codes: &[u8],
        scales: &[f32],
        g: usize,
    ) -> [f32; R] {
        let (h, k) = (g / 2, scales.len() * g);
        assert!(
            g.is_multiple_of(2) && codes.len() >= k / 2 && x.iter().all(|r| r.len() >= k),
            "int4 row of {k} features"
        );
        let (cp, xp) = (codes.as_ptr(), x.map(<[f32]>::as_ptr));
        let (nib, off) = (_mm256_set1_epi32(15), _mm256_set1_epi32(8));
        let mut tot = [[_mm256_setzero_ps(); S]; R];
        let mut tail = [0f32; R];
        for (gi, &s) in scales.iter().enumerate() {
            // Bytes t of the group meet x features base + 2t (low nibbles: 8 at base + 2t, then
            // high nibbles: 8 at base + 2t + 8, for each step of 8 bytes).
            let (base, mut t, end) = (gi * g, gi * h, (gi + 1) * h);
            let mut acc = [[_mm256_setzero_ps(); S]; R];
            // SAFETY (loads): t + S·V ≤ end ≤ k/2 bytes (then t + V ≤ end), and x features
            // up to base + 2·(end − gi·h) = (gi + 1)·g ≤ k.
            while t + S * V <= end {
                let mut lo = [_mm256_setzero_ps(); S];
                let mut hi = [_mm256_setzero_ps(); S];
                for (v, (lo, hi)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
                    let c = unsafe { widen(cp.add(t + v * V)) };
                    *lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(c, nib), off));
                    *hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32::<4>(c), off));
                }
                let at = base + 2 * (t - gi * h);
                for (a, &xr) in acc.iter_mut().zip(&xp) {
                    for (v, a) in a.iter_mut().enumerate() {
                        let xl = unsafe { _mm256_loadu_ps(xr.add(at + 2 * v * V)) };
                        let xh = unsafe { _mm256_loadu_ps(xr.add(at + 2 * v * V + V)) };
                        *a = _mm256_fmadd_ps(xl, lo[v], *a);
                        *a = _mm256_fmadd_ps(xh, hi[v], *a);
                    }
                }
                t += S * V;
            }
            while t + V <= end {
                let c = unsafe { widen(cp.add(t)) };
                let lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(c, nib), off));
                let hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32::<4>(c), off));
                let at = base + 2 * (t - gi * h);
                for (a, &xr) in acc.iter_mut().zip(&xp) {
                    let xl = unsafe { _mm256_loadu_ps(xr.add(at)) };
                    let xh = unsafe { _mm256_loadu_ps(xr.add(at + V)) };
                    a[0] = _mm256_fmadd_ps(xl, lo, a[0]);
                    a[0] = _mm256_fmadd_ps(xh, hi, a[0]);
                }
                t += V;
            }
            let mut part = [0f32; R];
            for (t, &b) in codes[..end].iter().enumerate().skip(t) {
                let (lo, hi) = (((b & 15) as i32 - 8) as f32, ((b >> 4) as i32 - 8) as f32);
                let at = base + 2 * (t - gi * h);
                for (p, xr) in part.iter_mut().zip(&x) {
                    *p = xr[at].mul_add(lo, *p);
                    *p = xr[at + 1].mul_add(hi, *p);
                }
            }
            fold(&mut tot, &acc, s);
            for (t, p) in tail.iter_mut().zip(part) {
                *t = s.mul_add(p, *t);
            }
        }
        let mut out = [0f32; R];
        for ((o, t), tl) in out.iter_mut().zip(&tot).zip(tail) {
            *o = total(t) + tl;
        }
        out
    }
}

/// The code of feature `f` minus the offset (any format, any group).
#[inline(always)]
fn code(codes: &[u8], f: usize, q: QuantSpec) -> f32 {
    let raw = if q.bits == 8 {
        codes[f] as i32
    } else if f.is_multiple_of(2) {
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
///
/// Each tile's rows are split among the threads (≥ 16 rows each): a thread dequantises its
/// rows and multiplies them into their output columns with one gemm, so a tile costs one join
/// (a parallel dequantisation then a parallel gemm cost two, and gemm's split of a 64-column
/// product over rows of x was 10 to 25% slower at 24 to 128 rows on 2 cores).
fn tiled(xs: &[f32], m: usize, w: Weights, out: &mut [f32]) {
    let (n, k) = (w.n, w.k);
    let t = TILE_ROWS.min(n);
    let mut tile = vec![0f32; t * k];
    let threads = rayon::current_num_threads().max(1);
    let x = SendConstPtr(xs.as_ptr());
    let op = SendPtr(out.as_mut_ptr());
    for j0 in (0..n).step_by(t) {
        let rows = t.min(n - j0);
        let parts = (rows / 16).clamp(1, threads);
        let per = rows.div_ceil(parts);
        // Threads left over (many cores, a thin tile) go to each part's gemm.
        let par = match threads / parts {
            0 | 1 => Parallelism::None,
            p => Parallelism::Rayon(p),
        };
        tile[..rows * k].par_chunks_mut(per * k).enumerate().for_each(|(p, part)| {
            let r0 = j0 + p * per;
            for (r, dst) in part.chunks_exact_mut(k).enumerate() {
                let (codes, scales) = w.row(r0 + r);
                dequantize_row(codes, scales, w.q, dst);
            }
            // Tile row r is output column r0 + r: rhs (f, r) = part[r·k + f].
            let lhs = MatRef { ptr: x.get(), rs: k as isize, cs: 1 };
            let rhs = MatRef { ptr: part.as_ptr(), rs: k as isize, cs: 1 }.t();
            let dst = MatMut { ptr: op.get().wrapping_add(r0), rs: n as isize, cs: 1 };
            // SAFETY: x is [m, k] (alive for the call), `part` holds part.len() / k rows of
            // k, and dst's m × those columns (row stride n, from column r0) lie inside
            // out [m, n] and belong to this part alone.
            unsafe { gemm_f32(m, part.len() / k, k, dst, false, lhs, rhs, 1.0, par) };
        });
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
    } else if g.is_multiple_of(2) {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `out [m, n]` by the per-feature path, portable (`avx` false) or AVX2 kernels.
    fn few_rows_by(xs: &[f32], m: usize, w: Weights, avx: bool) -> Vec<f32> {
        let perm = (w.q.bits == 4 && w.q.group.is_multiple_of(2))
            .then(|| nibble_order(xs, m, w.k, w.q.group));
        let x = perm.as_deref().unwrap_or(xs);
        let mut out = vec![0f32; m * w.n];
        let op = SendPtr(out.as_mut_ptr());
        // SAFETY: one thread writes every column; AVX2 only where the CPU has it.
        unsafe {
            if avx {
                #[cfg(target_arch = "x86_64")]
                rows_task_avx2(x, m, w, (0, w.n), op);
            } else {
                rows_task_body::<false>(x, m, w, (0, w.n), op);
            }
        }
        out
    }

    /// Both builds of the per-feature kernels against an f64 sum, on every block of rows
    /// (13 = 8 + 4 + 1, 15 = 8 + 4 + 2 + 1), groups with tails past 8 and 32 codes, and the
    /// tiled path on the same weights. (The integration tests see only the CPU's build.)
    #[test]
    fn portable_and_avx2_kernels_agree_with_f64() {
        let mut seed = 12345u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        #[cfg(target_arch = "x86_64")]
        let builds = if has_avx2_fma() { vec![false, true] } else { vec![false] };
        #[cfg(not(target_arch = "x86_64"))]
        let builds = vec![false];
        for (bits, k, g) in [
            (8u8, 200, 200),
            (8, 100, 25),
            (8, 33, 11),
            (8, 72, 72),
            (4, 256, 128),
            (4, 100, 50),
            (4, 36, 6),
            (4, 30, 2),
            (4, 96, 48),
            (4, 18, 3),
        ] {
            let q = QuantSpec { bits, group: g };
            let (n, rb, groups) = (6, q.row_bytes(k), k / g);
            let codes: Vec<u8> = (0..n * rb).map(|_| next() as u8).collect();
            let scales: Vec<f32> =
                (0..n * groups).map(|_| (next() % 1000) as f32 / 1e4 - 0.05).collect();
            let w = Weights { codes: &codes, scales: &scales, n, k, rb, groups, q };
            for m in [1, 2, 3, 13, 15] {
                let xs: Vec<f32> = (0..m * k).map(|_| (next() % 2000) as f32 / 1e3 - 1.0).collect();
                let mut want = vec![0f64; m * n];
                let mut bound = vec![0f64; m * n];
                for i in 0..m {
                    for j in 0..n {
                        for f in 0..k {
                            let c = code(w.row(j).0, f, q) as f64;
                            let v = xs[i * k + f] as f64 * c * scales[j * groups + f / g] as f64;
                            want[i * n + j] += v;
                            bound[i * n + j] += v.abs();
                        }
                    }
                }
                let mut tiled_out = vec![0f32; m * n];
                tiled(&xs, m, w, &mut tiled_out);
                let runs = builds.iter().map(|&avx| (avx, few_rows_by(&xs, m, w, avx)));
                for (what, got) in runs
                    .map(|(avx, o)| (if avx { "avx2" } else { "portable" }, o))
                    .chain([("tiled", tiled_out)])
                {
                    for e in 0..m * n {
                        assert!(
                            (got[e] as f64 - want[e]).abs() <= 1e-5 * bound[e] + 1e-30,
                            "{what} int{bits} K={k} group {g} M={m}: [{e}] {} vs {}",
                            got[e],
                            want[e]
                        );
                    }
                }
            }
        }
    }
}
