//! Measuring a GPU for the planner: matrix-product FLOP/s per dtype (8192³ products through
//! the backend's own GEMM path, on random data — never on constants), device-memory bandwidth
//! (a 4 GiB device-to-device copy, bytes read plus written) and the cost of one kernel launch
//! (small launches back to back). Each rate is the achieved one, so a device preset built from
//! it has efficiencies of 1.0. `tessera calibrate --device cuda` writes them as a cluster file.

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::gpu::Gpu;
use crate::tensor::CudaTensor;
use candle_core::Tensor;
use std::sync::Arc;
use std::time::Instant;
use tessera_ir::dist::MeshPos;
use tessera_ir::{DType, Op, Shape, TensorMeta, Tier};
use tessera_runtime::{Backend, Result};

/// What was measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Measured {
    pub name: String,
    pub memory_bytes: u64,
    pub fp32_flops: f64,
    pub bf16_flops: f64,
    pub fp16_flops: f64,
    pub memory_bandwidth: f64,
    pub kernel_overhead_s: f64,
}

/// Random `n × n` operands of `dtype` (an xorshift stream in [-0.5, 0.5)).
fn random(be: &CudaBackend, n: usize, dtype: DType) -> Result<CudaTensor> {
    let mut st = 0x9E37_79B9_7F4A_7C15u64;
    let host: Vec<f32> = (0..n * n)
        .map(|_| {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            (st >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    let t = Tensor::from_vec(host, (n, n), &candle_core::Device::Cpu)?;
    let t = t.to_dtype(tessera_runtime::tensor::candle_dtype(dtype))?;
    be.upload_as(&t, Purpose::Scratch)
}

/// Achieved FLOP/s of `n³` products in `dtype`: 3 warm-ups, then the best of `reps` timed.
fn gemm_flops(be: &CudaBackend, n: usize, dtype: DType, reps: usize) -> Result<f64> {
    let a = random(be, n, dtype)?;
    let meta = TensorMeta { shape: Shape::from(&[n, n][..]), dtype };
    let mm = Op::MatMul { trans_a: false, trans_b: true };
    let at = MeshPos::single();
    for _ in 0..3 {
        be.execute(&mm, &[&a, &a], std::slice::from_ref(&meta), &at)?;
    }
    be.gpu().synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t0 = Instant::now();
        be.execute(&mm, &[&a, &a], std::slice::from_ref(&meta), &at)?;
        be.gpu().synchronize()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(2.0 * (n as f64).powi(3) / best)
}

/// Bytes read plus written per second by a device-to-device copy of `bytes`.
fn copy_bandwidth(be: &CudaBackend, bytes: usize) -> Result<f64> {
    let n = bytes / 4;
    let meta = TensorMeta { shape: Shape::from(&[n][..]), dtype: DType::F32 };
    let at = MeshPos::single();
    let fill = Op::Fill { value: 1.0, meta: meta.clone() };
    let x = be.execute(&fill, &[], std::slice::from_ref(&meta), &at)?.remove(0);
    let copy = Op::Transfer { from: Tier::Device, to: Tier::Device };
    be.execute(&copy, &[&x], std::slice::from_ref(&meta), &at)?;
    be.gpu().synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t0 = Instant::now();
        be.execute(&copy, &[&x], std::slice::from_ref(&meta), &at)?;
        be.gpu().synchronize()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(2.0 * (n * 4) as f64 / best)
}

/// Seconds per kernel launch: `k` one-element fills back to back, one synchronisation.
fn launch_seconds(be: &CudaBackend, k: usize) -> Result<f64> {
    let meta = TensorMeta { shape: Shape::from(&[1usize][..]), dtype: DType::F32 };
    let fill = Op::Fill { value: 0.0, meta: meta.clone() };
    let at = MeshPos::single();
    be.execute(&fill, &[], std::slice::from_ref(&meta), &at)?;
    be.gpu().synchronize()?;
    let t0 = Instant::now();
    for _ in 0..k {
        be.execute(&fill, &[], std::slice::from_ref(&meta), &at)?;
    }
    be.gpu().synchronize()?;
    Ok(t0.elapsed().as_secs_f64() / k as f64)
}

/// Measures `gpu` (a few seconds).
pub fn measure(gpu: &Arc<Gpu>) -> Result<Measured> {
    let be = CudaBackend::new(gpu.clone());
    let (_, total) = gpu.mem_info()?;
    Ok(Measured {
        name: gpu.device_name().to_string(),
        memory_bytes: total,
        bf16_flops: gemm_flops(&be, 8192, DType::BF16, 10)?,
        fp16_flops: gemm_flops(&be, 8192, DType::F16, 10)?,
        fp32_flops: gemm_flops(&be, 8192, DType::F32, 3)?,
        memory_bandwidth: copy_bandwidth(&be, 4 << 30)?,
        kernel_overhead_s: launch_seconds(&be, 2000)?,
    })
}
