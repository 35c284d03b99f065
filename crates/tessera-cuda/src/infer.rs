//! The generation ops on the GPU: the KV cache's write, the selection of the positions whose
//! logits are kept, and the weight-only quantised matmuls (kernels of `infer.cu`, each the
//! CPU kernel's arithmetic: `tessera-runtime`'s `kernels/infer.rs` and `kernels/quant.rs`).

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::tensor::CudaTensor;
use tessera_ir::{Op, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

/// The kernels of `infer.cu` the backend launches.
pub const FUNCTIONS: &[&str] = &[];

/// Runs one generation op.
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
        reason: "generation runs on the CPU backend for now (KV-cache and quantised kernels are \
                 not yet written for CUDA)"
            .into(),
    })
}
