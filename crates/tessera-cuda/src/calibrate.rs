//! Measuring a GPU for the planner: matrix-product FLOP/s per dtype (8192³ products through
//! the backend's own GEMM path, on random data — never on constants), device-memory bandwidth
//! (a 4 GiB device-to-device copy, bytes read plus written) and the cost of one kernel launch
//! (small launches back to back). Each rate is the achieved one, so a device preset built from
//! it has efficiencies of 1.0. `tessera calibrate --device cuda` writes them as a cluster file.
//!
//! [`measure_kernels`] times the runtime's own kernels: every op of real training steps (CUDA
//! events around each, the host's dispatch time beside) and a GEMM sweep, which
//! [`kernel_table`] turns into the cost model's measured kernels
//! ([`tessera_profile::kernels::KernelTable`]): the planner then predicts this runtime's step,
//! not a roofline's.

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::gpu::Gpu;
use crate::tensor::CudaTensor;
use crate::timer::OpTimer;
use candle_core::Tensor;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tessera_ir::dist::MeshPos;
use tessera_ir::{build_training_graph, DType, Op, Shape, TensorMeta, Tier, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_profile::kernels::{KernelSample, KernelTable};
use tessera_runtime::{Backend, LrSchedule, Result, Trainer};

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

/// Random `n × n` operands of `dtype` (see [`random_matrix`]).
fn random(be: &CudaBackend, n: usize, dtype: DType) -> Result<CudaTensor> {
    random_matrix(be, n, n, dtype)
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

/// One calibration workload's measurements.
pub struct KernelRun {
    /// What ran (`gpt2 bf16 8x1024`).
    pub what: String,
    /// Every op of one step, in order.
    pub samples: Vec<KernelSample>,
    /// A step's wall time without timers (the mean of two).
    pub step_s: f64,
}

/// The training workloads the kernels are timed on: GPT-2 (124M: LayerNorm, GELU, learned
/// positions, head dim 64) at two batches — the smaller one more host-bound — and a LLaMA of
/// 0.33B (RMSNorm, SwiGLU, RoPE, head dim 128, grouped KV heads), all bf16. None of them is a
/// model the cost model is later checked on.
fn workloads() -> Result<Vec<(String, ModelConfig, usize, usize)>> {
    let llama = r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32000, "hidden_size": 1536, "intermediate_size": 4096,
        "num_hidden_layers": 8, "num_attention_heads": 12, "num_key_value_heads": 4,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}"#;
    let llama = ModelConfig::from_hf_json(llama).map_err(|e| bad(e.to_string()))?;
    let gpt2 = ModelConfig::resolve("gpt2").map_err(|e| bad(e.to_string()))?;
    Ok(vec![
        ("gpt2 bf16 2x1024".into(), gpt2.clone(), 2, 1024),
        ("gpt2 bf16 8x1024".into(), gpt2, 8, 1024),
        ("llama-0.33b bf16 4x2048".into(), llama, 4, 2048),
    ])
}

fn bad(msg: String) -> tessera_runtime::RuntimeError {
    tessera_runtime::RuntimeError::Binding(format!("calibration: {msg}"))
}

/// Times every op of a training step of each workload ([`workloads`]) with CUDA events, and
/// bf16 and f32 GEMMs of transformer shapes beyond the workloads' sizes (up to 16384 tokens ×
/// 8192²), on `gpu` (about half a minute on an H100).
pub fn measure_kernels(gpu: &Arc<Gpu>) -> Result<(Vec<KernelRun>, Vec<KernelSample>)> {
    let mut runs = Vec::new();
    for (what, cfg, batch, seq) in workloads()? {
        let fm = build(&cfg, &BuildOptions { batch, seq, dtype: DType::BF16 })
            .map_err(|e| bad(e.to_string()))?;
        let tg = build_training_graph(fm.builder, fm.loss, &TrainConfig::default())
            .map_err(|e| bad(e.to_string()))?;
        let vocab = cfg.vocab_size().unwrap_or(2);
        let timer = OpTimer::default();
        let be = CudaBackend::new(gpu.clone()).with_op_timer(timer.clone());
        let mut t = Trainer::single(tg, be, LrSchedule::Constant { lr: 1e-4 }, 7, None)?;
        let data = crate::fixtures::token_batches(vocab, batch, seq, 2);
        t.step(&data[0].0, &data[0].1)?;
        gpu.synchronize()?;
        let t0 = Instant::now();
        for (i, g) in &data {
            t.step(i, g)?;
        }
        gpu.synchronize()?;
        let step_s = t0.elapsed().as_secs_f64() / data.len() as f64;
        timer.events.store(true, Ordering::Relaxed);
        let timed = t.step(&data[1].0, &data[1].1);
        timer.events.store(false, Ordering::Relaxed);
        timed?;
        gpu.synchronize()?;
        runs.push(KernelRun { what, samples: timer.samples()?, step_s });
        drop(t);
        gpu.empty_cache();
    }
    Ok((runs, gemm_sweep(gpu)?))
}

/// Matrix products of the shapes transformer layers run (tokens × hidden × hidden'), in bf16
/// and f32, in the three layouts training takes (`nt` forward through a Linear weight, `nn`
/// and `tn` its input and weight gradients), each timed three times by events; and the flash
/// attention forward and backward over head counts and sequence lengths: the curves' points
/// past the workloads' sizes.
fn gemm_sweep(gpu: &Arc<Gpu>) -> Result<Vec<KernelSample>> {
    let timer = OpTimer::default();
    let be = CudaBackend::new(gpu.clone()).with_op_timer(timer.clone());
    let at = MeshPos::single();
    let shapes = [(4096, 2048, 2048), (8192, 2048, 5632), (8192, 4096, 4096), (16384, 4096, 11008)];
    for dtype in [DType::BF16, DType::F32] {
        for &(m, k, n) in &shapes {
            for (trans_a, trans_b) in [(false, true), (false, false), (true, false)] {
                let a = if trans_a {
                    random_matrix(&be, k, m, dtype)?
                } else {
                    random_matrix(&be, m, k, dtype)?
                };
                let b = if trans_b {
                    random_matrix(&be, n, k, dtype)?
                } else {
                    random_matrix(&be, k, n, dtype)?
                };
                let meta = TensorMeta { shape: Shape::from(&[m, n][..]), dtype };
                let mm = Op::MatMul { trans_a, trans_b };
                be.execute(&mm, &[&a, &b], std::slice::from_ref(&meta), &at)?;
                gpu.synchronize()?;
                timer.events.store(true, Ordering::Relaxed);
                for _ in 0..3 {
                    be.execute(&mm, &[&a, &b], std::slice::from_ref(&meta), &at)?;
                }
                timer.events.store(false, Ordering::Relaxed);
                gpu.synchronize()?;
            }
        }
    }
    attention_sweep(&be, &timer)?;
    let samples = timer.samples()?;
    gpu.empty_cache();
    Ok(samples)
}

/// Causal bf16 flash attention, forward and backward, over batch × heads of 24 to 192 at
/// sequences of 1024 and 2048 and head dims 64 and 128 (the kernels' occupancy grows with
/// the number of blocks), each timed twice, into `timer`'s records.
fn attention_sweep(be: &CudaBackend, timer: &OpTimer) -> Result<()> {
    let at = MeshPos::single();
    for d in [64, 128] {
        for s in [1024, 2048] {
            for h in [6, 12, 24, 48] {
                let b = 4;
                let spec = tessera_ir::AttentionSpec::causal(d);
                let bshd = |dtype| TensorMeta { shape: Shape::from(&[b, s, h, d][..]), dtype };
                let lse = TensorMeta { shape: Shape::from(&[b, h, s][..]), dtype: DType::F32 };
                let q = random_matrix(be, b * s * h, d, DType::BF16)?.reshaped(&[b, s, h, d]);
                let fwd = Op::Attention(spec.clone());
                let outs = [bshd(DType::BF16), lse];
                let y = be.execute(&fwd, &[&q, &q, &q], &outs, &at)?;
                let bwd = Op::AttentionBackward(spec);
                let grads = [bshd(DType::BF16), bshd(DType::BF16), bshd(DType::BF16)];
                let inputs = [&q, &q, &q, &y[0], &y[1], &q];
                be.execute(&bwd, &inputs, &grads, &at)?;
                be.gpu().synchronize()?;
                timer.events.store(true, Ordering::Relaxed);
                for _ in 0..2 {
                    be.execute(&fwd, &[&q, &q, &q], &outs, &at)?;
                    be.execute(&bwd, &inputs, &grads, &at)?;
                }
                timer.events.store(false, Ordering::Relaxed);
                be.gpu().synchronize()?;
            }
        }
    }
    Ok(())
}

/// Random `rows × cols` operands of `dtype` (an xorshift stream in [-0.5, 0.5)).
fn random_matrix(be: &CudaBackend, rows: usize, cols: usize, dtype: DType) -> Result<CudaTensor> {
    let mut st = 0x9E37_79B9_7F4A_7C15u64 ^ (rows * 31 + cols) as u64;
    let host: Vec<f32> = (0..rows * cols)
        .map(|_| {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            (st >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    let t = Tensor::from_vec(host, (rows, cols), &candle_core::Device::Cpu)?;
    let t = t.to_dtype(tessera_runtime::tensor::candle_dtype(dtype))?;
    be.upload_as(&t, Purpose::Scratch)
}

/// A step replayed as its host issues it (see `tessera-plan`'s step-time walk): each op costs
/// the host its kind's dispatch plus `host_extra`, and the device its curve time plus `gap`.
fn replay(table: &KernelTable, samples: &[KernelSample], host_extra: f64, gap: f64) -> f64 {
    let (mut issued, mut end) = (0.0f64, 0.0f64);
    for s in samples {
        issued += table.host_seconds(&s.kind) + host_extra;
        let d = s.work.as_ref().and_then(|w| table.device_seconds(w)).map_or(0.0, |t| t + gap);
        end = end.max(issued) + d;
    }
    end
}

/// The kernel table of a calibration: the samples' curves and host times, and the two
/// per-op overheads the replay needs to meet the workloads' measured steps — the executor's
/// own host time beyond the backend's dispatch, and the gap between kernels — fitted by a
/// grid search for the least worst relative error over the workloads.
pub fn kernel_table(runs: &[KernelRun], sweep: &[KernelSample]) -> KernelTable {
    let all: Vec<KernelSample> =
        runs.iter().flat_map(|r| r.samples.iter().cloned()).chain(sweep.iter().cloned()).collect();
    let what: Vec<&str> = runs.iter().map(|r| r.what.as_str()).collect();
    let source = format!("training steps of {} and a GEMM sweep", what.join(", "));
    let mut table = KernelTable::from_samples(&all, 0.0, source);
    let mut best = (f64::INFINITY, 0.0, 0.0);
    for hi in 0..=40 {
        let host_extra = hi as f64 * 1e-6;
        for gi in 0..=20 {
            let gap = gi as f64 * 0.5e-6;
            let worst = runs
                .iter()
                .map(|r| (replay(&table, &r.samples, host_extra, gap) / r.step_s - 1.0).abs())
                .fold(0.0, f64::max);
            if worst < best.0 {
                best = (worst, host_extra, gap);
            }
        }
    }
    table.host_overhead_s = best.1;
    table.gap_s = best.2;
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_profile::kernels::{KernelWork, Work};

    fn op(kind: &str, amount: f64, device_s: f64, host_s: f64) -> KernelSample {
        let work = (kind != "reshape").then(|| KernelWork {
            key: kind.to_string(),
            work: Work::Bytes,
            amount,
        });
        KernelSample { kind: kind.into(), work, device_s, host_s }
    }

    /// Steps whose wall time carries a known executor overhead per op (host side) and gap
    /// between kernels (device side): the fit finds both, one from the host-bound workload,
    /// the other from the device-bound one.
    #[test]
    fn the_fit_recovers_the_host_overhead_and_the_kernel_gap() {
        let (extra, gap) = (7e-6, 1.5e-6);
        // Host-bound: tiny kernels, 20 µs of dispatch each.
        let small: Vec<KernelSample> = (0..200)
            .flat_map(|_| [op("binary", 1e3, 2e-6, 20e-6), op("reshape", 0.0, 0.0, 5e-6)])
            .collect();
        // Device-bound: 300 µs kernels.
        let large: Vec<KernelSample> = (0..200).map(|_| op("matmul", 1e9, 300e-6, 30e-6)).collect();
        let runs: Vec<KernelRun> = [("small", small), ("large", large)]
            .into_iter()
            .map(|(what, samples)| {
                let table = KernelTable::from_samples(&samples, 0.0, String::new());
                let step_s = replay(&table, &samples, extra, gap);
                KernelRun { what: what.into(), samples, step_s }
            })
            .collect();
        let t = kernel_table(&runs, &[]);
        assert!((t.host_overhead_s - extra).abs() < 1e-12, "{}", t.host_overhead_s);
        assert!((t.gap_s - gap).abs() < 1e-12, "{}", t.gap_s);
        assert!(t.source.contains("small, large"), "{}", t.source);
        t.validate().unwrap();
    }
}
