//! Conversions between candle tensors, IR metadata and host slices.
//!
//! Kernels read their inputs as contiguous host slices ([`read`]) and return owned vectors
//! wrapped without a copy ([`from_vec`]). A non-contiguous input (only views made by `Expand`
//! reach kernels) is materialised first by [`contiguous`].

use crate::{Result, RuntimeError};
use candle_core::{Device, Storage, StorageRef, Tensor, WithDType};
use std::marker::PhantomData;
use std::ops::{Deref, Range};
use tessera_ir::{DType, Shape, TensorMeta};

/// The IR dtype of a candle dtype.
pub fn ir_dtype(d: candle_core::DType) -> Option<DType> {
    Some(match d {
        candle_core::DType::F64 => DType::F64,
        candle_core::DType::F32 => DType::F32,
        candle_core::DType::F16 => DType::F16,
        candle_core::DType::BF16 => DType::BF16,
        candle_core::DType::I64 => DType::I64,
        candle_core::DType::U8 => DType::Bool,
        _ => return None,
    })
}

/// The candle dtype storing an IR dtype (i32 is widened to i64, bool stored as u8).
pub fn candle_dtype(d: DType) -> candle_core::DType {
    match d {
        DType::F64 => candle_core::DType::F64,
        DType::F32 => candle_core::DType::F32,
        DType::F16 => candle_core::DType::F16,
        DType::BF16 => candle_core::DType::BF16,
        DType::I32 | DType::I64 => candle_core::DType::I64,
        DType::Bool | DType::U8 => candle_core::DType::U8,
    }
}

/// Bytes a tensor occupies (as the memory accountant charges it).
pub fn size_bytes(t: &Tensor) -> u64 {
    t.elem_count() as u64 * t.dtype().size_in_bytes() as u64
}

/// The IR metadata of a tensor.
pub fn meta_of(t: &Tensor) -> Option<TensorMeta> {
    Some(TensorMeta { shape: Shape::from(t.dims()), dtype: ir_dtype(t.dtype())? })
}

/// Checks that `t` has exactly the shape and dtype the IR expects.
pub fn check_meta(t: &Tensor, want: &TensorMeta, what: &str) -> Result<()> {
    let ok = t.dims() == want.shape.dims() && t.dtype() == candle_dtype(want.dtype);
    if ok {
        Ok(())
    } else {
        Err(RuntimeError::Binding(format!(
            "{what}: expected {want}, got {:?}{:?}",
            t.dtype(),
            t.dims()
        )))
    }
}

/// `t` itself when contiguous (a cheap handle clone), else a contiguous copy.
pub fn contiguous(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous() {
        Ok(t.clone())
    } else {
        Ok(t.contiguous()?)
    }
}

/// Wraps a host vector as a CPU tensor without copying.
pub fn from_vec<T: WithDType>(data: Vec<T>, dims: &[usize]) -> Result<Tensor> {
    Ok(Tensor::from_vec(data, dims, &Device::Cpu)?)
}

/// A read-only view of a contiguous CPU tensor's elements.
pub struct HostSlice<'a, T> {
    guard: StorageRef<'a>,
    range: Range<usize>,
    _t: PhantomData<T>,
}

impl<T: WithDType> Deref for HostSlice<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &*self.guard {
            Storage::Cpu(c) => &c.as_slice::<T>().expect("dtype checked when the view was made")
                [self.range.clone()],
            _ => unreachable!("device checked when the view was made"),
        }
    }
}

/// Borrows the elements of a contiguous CPU tensor of element type `T`.
pub fn read<T: WithDType>(t: &Tensor) -> Result<HostSlice<'_, T>> {
    let (guard, layout) = t.storage_and_layout();
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(RuntimeError::Binding(
            "kernel input is not contiguous (call tensor::contiguous first)".into(),
        ));
    };
    match &*guard {
        Storage::Cpu(c) => {
            c.as_slice::<T>()?;
        }
        _ => {
            return Err(RuntimeError::Binding(
                "the CPU backend got a tensor on another device".into(),
            ))
        }
    }
    Ok(HostSlice { guard, range: start..end, _t: PhantomData })
}

/// Copies a tensor's elements out as f64 (tests, reports).
pub fn to_f64_vec(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?)
}
