//! The seam between "what to compute" and "where": a [`Backend`] runs one IR op on tensors of
//! its device. The CPU backend is candle tensors with kernels written on host slices (rayon for
//! threads, gemm for matrix products); a CUDA backend will arrive behind a cargo feature and
//! implement the same trait. The trait is deliberately small: one entry point per node.

use crate::kernels;
use crate::Result;
use candle_core::{Device, Tensor};
use tessera_ir::{Op, TensorMeta};

pub trait Backend: Send + Sync {
    /// Human-readable device name used in errors (`cpu:0`).
    fn name(&self) -> &str;
    fn device(&self) -> &Device;
    /// Executes `op` on `inputs`, returning one tensor per output with exactly the metas
    /// `outputs`. Outputs the IR declares as aliases (views, in-place updates) share their
    /// input's storage.
    fn execute(&self, op: &Op, inputs: &[&Tensor], outputs: &[TensorMeta]) -> Result<Vec<Tensor>>;
}

/// Host CPU: candle tensors on `Device::Cpu`, kernels in [`crate::kernels`].
pub struct CpuBackend {
    name: String,
    device: Device,
}

impl CpuBackend {
    pub fn new(index: usize) -> CpuBackend {
        CpuBackend { name: format!("cpu:{index}"), device: Device::Cpu }
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new(0)
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        &self.name
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn execute(&self, op: &Op, inputs: &[&Tensor], outputs: &[TensorMeta]) -> Result<Vec<Tensor>> {
        kernels::execute(op, inputs, outputs)
    }
}
