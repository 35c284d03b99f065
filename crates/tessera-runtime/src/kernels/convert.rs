//! bf16 ↔ f32 conversions of whole tensors, the CPU backend's mixed precision: every op that
//! computes on bf16 operands reads them widened to f32 and rounds its results back.
//!
//! Widening is exact (a bf16 is the high half of an f32; `half` quiets a signalling NaN);
//! narrowing rounds to nearest, ties to
//! even, NaN staying a quiet NaN — the bits `half::bf16::from_f32` (and so candle's
//! `to_dtype`) gives, which the tests check. Both are single passes over memory: vectorised by
//! [`wide!`], split over rayon's threads past [`PAR_MIN`] elements, written straight into
//! fresh uninitialised buffers (a zeroed one would cost a memset, since the counting
//! allocator hands back cached blocks).

use super::gemm_bf16::round_bf16;
use super::simd::wide;
use crate::tensor::{from_vec, read};
use crate::Result;
use candle_core::{DType, Tensor};
use half::bf16;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Elements below which one thread converts (the hand-off to rayon costs more).
const PAR_MIN: usize = 1 << 16;
/// Elements per parallel chunk.
const CHUNK: usize = 1 << 14;

/// `n` elements of `src` mapped by `f` into a fresh vector, over chunks in parallel when long.
fn map_fresh<S: Sync + Copy, D: Send>(src: &[S], f: impl Fn(S) -> D + Sync) -> Vec<D> {
    let n = src.len();
    let mut out: Vec<D> = Vec::with_capacity(n);
    let fill = |(dst, s): (&mut [MaybeUninit<D>], &[S])| {
        wide! {
            for (d, &x) in dst.iter_mut().zip(s) {
                d.write(f(x));
            }
        }
    };
    let spare = &mut out.spare_capacity_mut()[..n];
    if n >= PAR_MIN && rayon::current_num_threads() > 1 {
        spare.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(fill);
    } else {
        fill((spare, src));
    }
    // SAFETY: every one of the first n elements was written above.
    unsafe { out.set_len(n) };
    out
}

/// `x` as f32: bf16 widened exactly; any other dtype through candle.
pub fn widen(x: &Tensor) -> Result<Tensor> {
    if x.dtype() != DType::BF16 || !x.is_contiguous() {
        return Ok(x.to_dtype(DType::F32)?);
    }
    let src = read::<bf16>(x)?;
    let out = map_fresh(&src, |b: bf16| b.to_f32());
    drop(src);
    from_vec(out, x.dims())
}

/// `x` (f32) rounded to bf16 as `half` rounds; any other pair of dtypes through candle.
pub fn narrow_to_bf16(x: &Tensor) -> Result<Tensor> {
    if x.dtype() != DType::F32 || !x.is_contiguous() {
        return Ok(x.to_dtype(DType::BF16)?);
    }
    let src = read::<f32>(x)?;
    let out = map_fresh(&src, |v: f32| bf16::from_bits(round_bf16(v)));
    drop(src);
    from_vec(out, x.dims())
}

/// `x` converted to `to`: [`widen`] and [`narrow_to_bf16`] where they apply, else candle.
pub fn to_dtype(x: &Tensor, to: DType) -> Result<Tensor> {
    match (x.dtype(), to) {
        (DType::BF16, DType::F32) => widen(x),
        (DType::F32, DType::BF16) => narrow_to_bf16(x),
        _ => Ok(x.to_dtype(to)?),
    }
}
