//! AVX-512 packing of transposed bf16 operands for the bf16 GEMMs: both are a 16 × 16
//! transpose of 32-bit words ([`transpose16`]), where the scalar packing wrote one element at a
//! time (a fifth of the AMX GEMM's time on a training step's weight gradients).
//!
//! - [`lhs_tile_from_cols`]: a column-major `lhs` (a transposed operand: 16 rows of a column
//!   are contiguous) into one AMX `lhs` tile, 16 rows × 32 elements along k. Two columns are
//!   interleaved into words first (`(a[m][2q], a[m][2q+1])` for the 16 rows), then the 16 × 16
//!   words are transposed into rows.
//! - [`rhs_pairs_from_rows`]: a transposed `rhs` (each column of `rhs` is a contiguous row of
//!   the stored matrix, so each pair `(b[2p][j], b[2p+1][j])` is one aligned-or-not word) into
//!   the pair-interleaved panel layout: 16 columns × 16 pairs transposed into 16 rows of pairs.
//!
//! Pure data movement: the packed words are the source's bits, which the tests check against
//! the scalar packing through every GEMM layout. x86-64 only (the module is compiled there
//! alone).

use std::arch::x86_64::*;

/// Whether these routines may run: the CPU has AVX-512F (every AMX or AVX512_BF16 CPU does;
/// asked anyway, std caches the answer).
#[inline]
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

/// Transposes 16 rows of 16 words: `out[j]` lane `i` = `r[i]` lane `j`.
#[target_feature(enable = "avx512f")]
#[inline]
fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
    // Words within 128-bit lanes: t[2i] lane L = r[2i][4L], r[2i+1][4L], r[2i][4L+1], r[2i+1][4L+1].
    let mut t = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // Pairs of words: u[4i + c] lane L = column 4L + c of rows 4i .. 4i + 3.
    let mut u = [_mm512_setzero_si512(); 16];
    for i in 0..4 {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // 128-bit lanes: row 4L + c gathers lane L of u[c], u[4 + c], u[8 + c], u[12 + c].
    let mut out = [_mm512_setzero_si512(); 16];
    for c in 0..4 {
        let even_a = _mm512_shuffle_i32x4::<0x88>(u[c], u[4 + c]); // lanes 0, 2 of each
        let even_b = _mm512_shuffle_i32x4::<0x88>(u[8 + c], u[12 + c]);
        let odd_a = _mm512_shuffle_i32x4::<0xDD>(u[c], u[4 + c]); // lanes 1, 3 of each
        let odd_b = _mm512_shuffle_i32x4::<0xDD>(u[8 + c], u[12 + c]);
        out[c] = _mm512_shuffle_i32x4::<0x88>(even_a, even_b);
        out[8 + c] = _mm512_shuffle_i32x4::<0xDD>(even_a, even_b);
        out[4 + c] = _mm512_shuffle_i32x4::<0x88>(odd_a, odd_b);
        out[12 + c] = _mm512_shuffle_i32x4::<0xDD>(odd_a, odd_b);
    }
    out
}

/// One AMX `lhs` tile from a column-major source: `out[m·32 + kk] = src[m + kk·ld]` for 16
/// rows `m` and 32 columns `kk`.
///
/// # Safety
/// [`available`]; the 16 × 32 source elements are readable; `out` holds 512 elements.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn lhs_tile_from_cols(src: *const u16, ld: isize, out: *mut u16) {
    let mut w = [_mm512_setzero_si512(); 16];
    for (q, wq) in w.iter_mut().enumerate() {
        // SAFETY: columns 2q, 2q + 1 hold 16 readable elements each (contract).
        let (lo, hi) = unsafe {
            (
                _mm256_loadu_si256(src.offset(2 * q as isize * ld).cast()),
                _mm256_loadu_si256(src.offset((2 * q + 1) as isize * ld).cast()),
            )
        };
        // Word m = (column 2q, column 2q + 1) of row m.
        *wq = _mm512_or_si512(
            _mm512_cvtepu16_epi32(lo),
            _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)),
        );
    }
    for (m, row) in transpose16(w).into_iter().enumerate() {
        // SAFETY: row m's 32 elements are inside the tile (contract).
        unsafe { _mm512_storeu_si512(out.add(m * 32).cast(), row) };
    }
}

/// 16 columns × 16 pairs of a transposed `rhs` into pair rows: `out[p·stride + j]` = the word
/// at `src + j·ld + 2p` (elements `2p`, `2p + 1` of stored row `j`), for `j, p < 16`.
///
/// # Safety
/// [`available`]; the 16 × 32 source elements are readable; `out` holds `15·stride + 16`
/// words.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn rhs_pairs_from_rows(src: *const u16, ld: isize, out: *mut u32, stride: usize) {
    let mut r = [_mm512_setzero_si512(); 16];
    for (j, rj) in r.iter_mut().enumerate() {
        // SAFETY: stored row j holds 32 readable elements from src (contract).
        *rj = unsafe { _mm512_loadu_si512(src.offset(j as isize * ld).cast()) };
    }
    for (p, row) in transpose16(r).into_iter().enumerate() {
        // SAFETY: pair row p's 16 words are inside out (contract).
        unsafe { _mm512_storeu_si512(out.add(p * stride).cast(), row) };
    }
}

/// One pair row of a row-major `rhs`: `out[j] = r0[j] | r1[j] << 16` for 32 columns `j` (the
/// words `(b[2p][j], b[2p+1][j])`).
///
/// # Safety
/// [`available`]; `r0` and `r1` hold 32 readable elements; `out` holds 32 words.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn rhs_pairs_interleave(r0: *const u16, r1: *const u16, out: *mut u32) {
    for h in 0..2 {
        // SAFETY: elements 16h .. 16h + 16 of both rows, words 16h .. 16h + 16 of out
        // (contract).
        unsafe {
            let lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(r0.add(16 * h).cast()));
            let hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(r1.add(16 * h).cast()));
            let w = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
            _mm512_storeu_si512(out.add(16 * h).cast(), w);
        }
    }
}
