//! Tessera on NVIDIA GPUs: a [`tessera_runtime::Backend`] whose values live in device memory.
//!
//! - [`gpu::Gpu`] opens a device through the driver API, loaded at run time (cudarc's
//!   dynamic loading: this crate builds, and CI compiles it, on machines with no CUDA), and
//!   compiles the kernels (`kernels.cu`, `reduce.cu`, `layers.cu`, `flash.cu`) with NVRTC
//!   for the device's architecture;
//! - [`alloc::CachingAllocator`] hands out device memory and keeps the books the memory
//!   accountant keeps: the Program's live bytes, exactly, with scratch reported beside;
//! - [`backend::CudaBackend`] runs every training op: cuBLAS GEMMs (bf16 operands with fp32
//!   accumulation), elementwise, reductions, norms, embedding, cross-entropy, attention and
//!   AdamW kernels. The executor, trainer and checkpoints are the CPU's, unchanged: a GPU is
//!   another backend of the one training path.
//!
//! - [`nccl::NcclComm`] is the NCCL transport behind `tessera_comm::Communicator` (one rank per
//!   GPU; bootstrapped by [`rendezvous`] from torchrun's variables, or from an id shared by
//!   other means), checked on a GPU by [`nccl_check`].
//!
//! What runs where is checked by `scripts/gpu-check.sh` on a GPU (every node of real
//! training graphs against the CPU kernels, loss curves, memory against the prediction).

pub mod alloc;
mod attention;
pub mod backend;
pub mod calibrate;
mod dropout;
mod fault;
pub mod fixtures;
pub mod flash;
mod gemm;
pub mod gpu;
mod infer;
pub mod launch;
mod linear_loss;
mod loss;
mod moe;
pub mod nccl;
pub mod nccl_check;
mod optim;
mod reduce;
pub mod rendezvous;
mod ring;
pub mod source;
pub mod tensor;
pub mod timer;
pub mod unverified;
mod vision;

pub use backend::CudaBackend;
pub use gemm::{gemm_path, set_gemm_path, GemmPath};
pub use gpu::{Gpu, GpuInfo};
pub use nccl::NcclComm;
pub use tensor::CudaTensor;
pub use timer::OpTimer;
