//! In-place access to a candle tensor's CPU storage (AdamW's update, the KV-cache write), and
//! the float element types kernels read and write ([`Elem`]).

use crate::{Result, RuntimeError};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor, WithDType};
use half::{bf16, f16};
use std::cell::Cell;

/// A float element type the update reads and writes.
pub(super) trait Elem: WithDType + Copy + Send + Sync {
    fn get(self) -> f32;
    fn put(x: f32) -> Self;
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
}

impl Elem for f32 {
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
    #[inline(always)]
    fn put(x: f32) -> f32 {
        x
    }
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [f32]> {
        match s {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn put(x: f32) -> bf16 {
        // `half`'s bits (round to nearest even, NaN stays quiet), branch-free so loops over
        // it vectorise.
        bf16::from_bits(super::gemm_bf16::round_bf16(x))
    }
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [bf16]> {
        match s {
            CpuStorage::BF16(v) => Some(v),
            _ => None,
        }
    }
}

impl Elem for f16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(x: f32) -> f16 {
        f16::from_f32(x)
    }
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [f16]> {
        match s {
            CpuStorage::F16(v) => Some(v),
            _ => None,
        }
    }
}

/// An in-place op that hands the tensor's storage to a closure, once.
struct WithMut<F> {
    f: Cell<Option<F>>,
    result: Cell<Option<Result<()>>>,
}

impl<F: FnOnce(&mut CpuStorage, &Layout) -> Result<()>> InplaceOp1 for WithMut<F> {
    fn name(&self) -> &'static str {
        "in-place"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        if let Some(f) = self.f.take() {
            self.result.set(Some(f(storage, layout)));
        }
        Ok(())
    }
}

/// Runs `f` on the contiguous elements of `t` (type `T`), borrowed mutably in place; `what`
/// names the operand in errors (`adamw: m`).
pub(super) fn with_slice_mut<T: Elem>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(&mut [T]) -> Result<()>,
) -> Result<()> {
    let op = WithMut {
        f: Cell::new(Some(|s: &mut CpuStorage, l: &Layout| {
            let Some((start, end)) = l.contiguous_offsets() else {
                return Err(RuntimeError::Binding(format!("{what} must be contiguous")));
            };
            let dtype = s.dtype();
            let data = T::slice_mut(s).ok_or_else(|| {
                RuntimeError::Binding(format!("{what} is {dtype:?}, expected {:?}", T::DTYPE))
            })?;
            f(&mut data[start..end])
        })),
        result: Cell::new(None),
    };
    t.inplace_op1(&op)?;
    op.result
        .take()
        .unwrap_or_else(|| Err(RuntimeError::Binding(format!("{what} is not on the CPU"))))
}
