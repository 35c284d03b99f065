//! Kernel launches: arguments collected as values (so none is a dangling temporary), then
//! pushed to cudarc's launch builder; every launch's error is checked.

use crate::gpu::Gpu;
use crate::tensor::Layout;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use tessera_runtime::{Result, RuntimeError};

/// Attention geometry (matches `struct Attn` in `kernels.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Attn {
    pub b: i64,
    pub s: i64,
    pub t: i64,
    pub h: i64,
    pub hkv: i64,
    pub d: i64,
    pub causal: i32,
    pub window: i64,
    pub scale: f32,
}

// SAFETY: plain old data with the C layout the kernels declare.
unsafe impl DeviceRepr for Attn {}

/// The dtype codes of a norm kernel's operands (matches `struct NormCodes` in `kernels.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct NormCodes {
    pub x: i32,
    pub w: i32,
    pub b: i32,
    pub y: i32,
    pub dy: i32,
}

// SAFETY: plain old data with the C layout the kernels declare.
unsafe impl DeviceRepr for NormCodes {}

/// One kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device address (0: a null pointer).
    Ptr(u64),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
    F64(f64),
    Layout(Layout),
    Attn(Attn),
    Norm(NormCodes),
}

/// Threads per block of the elementwise and row kernels.
pub const THREADS: u32 = 256;

/// A grid-stride launch over `n` elements.
pub fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 20) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// One block per row (or output element).
pub fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub fn launch(gpu: &Gpu, name: &'static str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
    if cfg.grid_dim.0 == 0 {
        return Ok(());
    }
    let f = gpu.func(name)?;
    let args: Vec<Arg> = args
        .iter()
        .map(|a| match a {
            Arg::Layout(l) => Arg::Layout(l.collapsed()),
            other => *other,
        })
        .collect();
    let mut b = gpu.stream.launch_builder(f);
    for a in &args {
        match a {
            Arg::Ptr(v) | Arg::U64(v) => b.arg(v),
            Arg::I32(v) => b.arg(v),
            Arg::I64(v) => b.arg(v),
            Arg::F32(v) => b.arg(v),
            Arg::F64(v) => b.arg(v),
            Arg::Layout(v) => b.arg(v),
            Arg::Attn(v) => b.arg(v),
            Arg::Norm(v) => b.arg(v),
        };
    }
    // SAFETY: the arguments match the kernel's signature in kernels.cu (one call site per
    // kernel, each checked by the GPU parity run); pointers are live device buffers.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| RuntimeError::Binding(format!("cuda: launching {name}: {e}")))
}
