//! The vision ops on the GPU (convolution, GroupNorm, pooling, upsampling and their
//! backwards): kernels of `vision.cu`, each the CPU kernel's arithmetic (`tessera-runtime`'s
//! `kernels/vision.rs`).

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::tensor::CudaTensor;
use tessera_ir::{Op, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

/// The kernels of `vision.cu` the backend launches.
pub const FUNCTIONS: &[&str] = &[];

/// Runs one vision op.
pub(crate) fn run(
    _be: &CudaBackend,
    op: &Op,
    _x: &[&CudaTensor],
    _out: &[TensorMeta],
    _p: Purpose,
) -> Result<Vec<CudaTensor>> {
    Err(RuntimeError::Unsupported {
        backend: "cuda".into(),
        op: op.name().into(),
        reason: "vision ops (convolution, GroupNorm, pooling, upsampling) run on the CPU backend \
                 for now (no CUDA kernels yet): train convolutional models with `--device cpu`"
            .into(),
    })
}
