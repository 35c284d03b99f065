//! The GPU check (`scripts/gpu-check.sh` runs it on a lent GPU): every claim the CUDA
//! backend makes, measured against an independent reference in one run.
//!
//! 1. **Kernels**: one training step of each model through a backend that runs every node on
//!    the CPU *and* on the GPU from the same inputs, comparing each output (the CPU kernels are
//!    the reference); the worst relative error per op kind is printed.
//! 2. **Training**: loss curves on the GPU (fp32 and bf16) against the CPU's fp32 curve.
//! 3. **Memory**: the profiler's predicted peak, the accountant's, and the caching
//!    allocator's (Program tensors; scratch beside), plus the driver's used-memory delta.
//! 4. **Calibration**: bf16 GEMM FLOP/s and device-to-device copy bandwidth.
//! 5. **Speed**: tokens/s of a training step of a larger model (`--speed MODEL`).
//!
//! Output: one JSON object per line (`{"check": ...}`), then a summary; exit code 1 when a
//! bound fails.

use candle_core::Tensor;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tessera_cuda::alloc::Purpose;
use tessera_cuda::{CudaBackend, CudaTensor, Gpu};
use tessera_ir::dist::MeshPos;
use tessera_ir::{build_training_graph, DType, Op, TensorMeta, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_runtime::{Backend, CpuBackend, LrSchedule, Result, Trainer};

/// Runs every op on both backends, returns the CPU's result, records the worst error.
struct Both {
    cpu: CpuBackend,
    gpu: CudaBackend,
    worst: Arc<Mutex<BTreeMap<String, (f64, u64)>>>,
}

fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?;
    let b = b.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?;
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(&b) {
        if x.is_infinite() && x == y {
            continue;
        }
        num += (x - y) * (x - y);
        den += y * y;
    }
    if num.is_nan() {
        return Ok(f64::INFINITY);
    }
    Ok((num / den.max(1e-30)).sqrt())
}

impl Backend for Both {
    type Value = Tensor;
    fn name(&self) -> &str {
        "cpu+cuda"
    }
    fn upload(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn download(&self, v: &Tensor) -> Result<Tensor> {
        Ok(v.clone())
    }
    fn meta(&self, v: &Tensor) -> Result<TensorMeta> {
        self.cpu.meta(v)
    }
    fn execute(&self, op: &Op, x: &[&Tensor], out: &[TensorMeta], at: &MeshPos) -> Result<Vec<Tensor>> {
        // AdamW writes in place: the GPU's copies are taken before the CPU updates.
        let dev: Vec<CudaTensor> = x
            .iter()
            .map(|t| self.gpu.upload_as(t, Purpose::Scratch))
            .collect::<Result<_>>()?;
        let want = self.cpu.execute(op, x, out, at)?;
        let refs: Vec<&CudaTensor> = dev.iter().collect();
        let got = match self.gpu.execute(op, &refs, out, at) {
            Ok(g) => g,
            Err(e) => {
                let mut w = self.worst.lock().unwrap();
                let e = w.entry(format!("{} FAILED: {e}", op.name())).or_default();
                e.0 = f64::INFINITY;
                e.1 += 1;
                return Ok(want);
            }
        };
        let mut w = self.worst.lock().unwrap();
        for (a, b) in got.iter().zip(&want) {
            let err = rel_err(&self.gpu.download(a)?, b)?;
            let e = w.entry(op.name().to_string()).or_default();
            e.0 = e.0.max(err);
            e.1 += 1;
        }
        Ok(want)
    }
}

/// Token batches: `n` fixed random batches, cycled (the loss must fall as they are learnt).
fn batches(vocab: usize, batch: usize, seq: usize, n: usize) -> Vec<(Vec<i64>, Vec<i64>)> {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s % vocab as u64) as i64
    };
    (0..n)
        .map(|_| {
            let t: Vec<i64> = (0..batch * (seq + 1)).map(|_| next()).collect();
            let mut inp = Vec::new();
            let mut tgt = Vec::new();
            for r in 0..batch {
                let row = &t[r * (seq + 1)..(r + 1) * (seq + 1)];
                inp.extend_from_slice(&row[..seq]);
                tgt.extend_from_slice(&row[1..]);
            }
            (inp, tgt)
        })
        .collect()
}

fn graph(model: &str, batch: usize, seq: usize, dtype: DType) -> tessera_ir::TrainingGraph {
    let cfg = ModelConfig::resolve(model).expect("model");
    let fm = build(&cfg, &BuildOptions { batch, seq, dtype }).expect("build");
    build_training_graph(fm.builder, fm.loss, &TrainConfig::default()).expect("training graph")
}

fn vocab(model: &str) -> usize {
    ModelConfig::resolve(model).expect("model").vocab_size().expect("a language model")
}

fn check_kernels(gpu: &Arc<Gpu>, model: &str, fails: &mut Vec<String>) {
    let worst = Arc::new(Mutex::new(BTreeMap::new()));
    let both = Both { cpu: CpuBackend::new(0), gpu: CudaBackend::new(gpu.clone()), worst: worst.clone() };
    let (b, s) = (2, 64);
    let mut t = Trainer::single(graph(model, b, s, DType::F32), both, LrSchedule::Constant { lr: 1e-3 }, 7, None)
        .expect("trainer");
    for (inp, tgt) in batches(vocab(model), b, s, 2) {
        t.step(&inp, &tgt).expect("step");
    }
    for (op, (err, calls)) in worst.lock().unwrap().iter() {
        let ok = *err <= 1e-4;
        println!("{{\"check\":\"kernel\",\"model\":\"{model}\",\"op\":\"{op}\",\"calls\":{calls},\"rel_err\":{err:e},\"ok\":{ok}}}");
        if !ok {
            fails.push(format!("{model} {op}: rel err {err:e}"));
        }
    }
}

fn curve<B: Backend>(model: &str, dtype: DType, backend: B, steps: usize) -> (Vec<f64>, Trainer<B>) {
    let (b, s) = (4, 64);
    let mut t = Trainer::single(graph(model, b, s, dtype), backend, LrSchedule::Constant { lr: 1e-3 }, 7, None)
        .expect("trainer");
    let data = batches(vocab(model), b, s, 4);
    let losses = (0..steps).map(|k| {
        let (i, g) = &data[k % data.len()];
        t.step(i, g).expect("step").loss
    });
    (losses.collect(), t)
}

fn check_training(gpu: &Arc<Gpu>, model: &str, fails: &mut Vec<String>) {
    let steps = 50;
    let (cpu, _) = curve(model, DType::F32, CpuBackend::new(0), steps);
    for dtype in [DType::F32, DType::BF16] {
        let (got, _) = curve(model, dtype, CudaBackend::new(gpu.clone()), steps);
        let worst = cpu.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
        let bound = if dtype == DType::F32 { 1e-3 } else { 1e-2 };
        let ok = worst <= bound && got.iter().all(|l| l.is_finite());
        println!(
            "{{\"check\":\"curve\",\"model\":\"{model}\",\"dtype\":\"{}\",\"steps\":{steps},\"first\":[{:.5},{:.5}],\"last\":[{:.5},{:.5}],\"max_abs_diff\":{worst:e},\"bound\":{bound},\"ok\":{ok}}}",
            format!("{dtype:?}"), cpu[0], got[0], cpu[steps - 1], got[steps - 1]
        );
        if !ok {
            fails.push(format!("{model} {} curve: max |Δloss| {worst:e} > {bound}", format!("{dtype:?}")));
        }
    }
}

fn check_memory(gpu: &Arc<Gpu>, model: &str, batch: usize, seq: usize, dtype: DType, fails: &mut Vec<String>) {
    gpu.empty_cache();
    let (free0, _) = gpu.mem_info().expect("mem info");
    let tg = graph(model, batch, seq, dtype);
    let mut t = Trainer::single(tg, CudaBackend::new(gpu.clone()), LrSchedule::Constant { lr: 1e-4 }, 7, None)
        .expect("trainer");
    let predicted = tessera_profile::simulate_memory(t.program()).report.peak_bytes;
    let data = batches(vocab(model), batch, seq, 2);
    t.step(&data[0].0, &data[0].1).expect("warm-up step");
    gpu.synchronize().expect("sync");
    gpu.reset_peaks();
    let t0 = Instant::now();
    let st = t.step(&data[1].0, &data[1].1).expect("step");
    gpu.synchronize().expect("sync");
    let secs = t0.elapsed().as_secs_f64();
    let m = gpu.memory();
    let (free1, _) = gpu.mem_info().expect("mem info");
    let used = free0.saturating_sub(free1);
    let ok = m.program.peak == st.peak_bytes;
    println!(
        "{{\"check\":\"memory\",\"model\":\"{model}\",\"dtype\":\"{}\",\"batch\":{batch},\"seq\":{seq},\"predicted_peak\":{predicted},\"accountant_peak\":{},\"allocator_program_peak\":{},\"allocator_scratch_peak\":{},\"reserved\":{},\"driver_used_delta\":{used},\"step_s\":{secs:.4},\"tokens_per_s\":{:.1},\"ok\":{ok}}}",
        format!("{dtype:?}"), st.peak_bytes, m.program.peak, m.scratch.peak, m.reserved.current,
        (batch * seq) as f64 / secs
    );
    if !ok {
        fails.push(format!("{model} memory: allocator {} != accountant {}", m.program.peak, st.peak_bytes));
    }
}

fn speed(gpu: &Arc<Gpu>, model: &str, batch: usize, seq: usize, dtype: DType, steps: usize) {
    let tg = graph(model, batch, seq, dtype);
    let mut t = Trainer::single(tg, CudaBackend::new(gpu.clone()), LrSchedule::Constant { lr: 1e-4 }, 7, None)
        .expect("trainer");
    let flops = tessera_profile::profile(t.program()).flops.total;
    let data = batches(vocab(model), batch, seq, 2);
    t.record_timings(true);
    t.step(&data[0].0, &data[0].1).expect("warm-up");
    gpu.synchronize().expect("sync");
    let t0 = Instant::now();
    for k in 0..steps {
        let (i, g) = &data[k % 2];
        t.step(i, g).expect("step");
    }
    gpu.synchronize().expect("sync");
    let secs = t0.elapsed().as_secs_f64() / steps as f64;
    let mut by: Vec<(&str, f64)> = t.timings().map(|m| m.iter().map(|(k, v)| (*k, v.seconds)).collect()).unwrap_or_default();
    by.sort_by(|a, b| b.1.total_cmp(&a.1));
    let top: Vec<String> = by.iter().take(8).map(|(k, s)| format!("\"{k}\":{s:.3}")).collect();
    println!(
        "{{\"check\":\"speed\",\"model\":\"{model}\",\"dtype\":\"{}\",\"batch\":{batch},\"seq\":{seq},\"step_s\":{secs:.4},\"tokens_per_s\":{:.1},\"flops_per_step\":{flops},\"tflops\":{:.2},\"op_seconds_total\":{{{}}}}}",
        format!("{dtype:?}"), (batch * seq) as f64 / secs, flops as f64 / secs / 1e12, top.join(",")
    );
}

fn calibrate(gpu: &Arc<Gpu>) {
    let be = CudaBackend::new(gpu.clone());
    let n = 8192usize;
    let meta = TensorMeta { shape: tessera_ir::Shape::from(&[n, n][..]), dtype: DType::BF16 };
    let a = tessera_cuda::CudaTensor::empty(gpu, &[n, n], DType::BF16, Purpose::Scratch).unwrap();
    let fill = Op::Fill { value: 0.5, meta: meta.clone() };
    let a = be.execute(&fill, &[], &[meta.clone()], &MeshPos::single()).map(|mut v| v.remove(0)).unwrap_or(a);
    let mm = Op::MatMul { trans_a: false, trans_b: true };
    let run = || be.execute(&mm, &[&a, &a], &[meta.clone()], &MeshPos::single()).unwrap();
    for _ in 0..3 {
        run();
    }
    gpu.synchronize().unwrap();
    let reps = 10;
    let t0 = Instant::now();
    for _ in 0..reps {
        run();
    }
    gpu.synchronize().unwrap();
    let tf = 2.0 * (n as f64).powi(3) * reps as f64 / t0.elapsed().as_secs_f64() / 1e12;
    let big = TensorMeta { shape: tessera_ir::Shape::from(&[1usize << 30][..]), dtype: DType::F32 };
    let x = be.execute(&Op::Fill { value: 1.0, meta: big.clone() }, &[], &[big.clone()], &MeshPos::single()).unwrap().remove(0);
    let cp = Op::Transfer { from: tessera_ir::Tier::Device, to: tessera_ir::Tier::Device };
    be.execute(&cp, &[&x], &[big.clone()], &MeshPos::single()).unwrap();
    gpu.synchronize().unwrap();
    let t0 = Instant::now();
    for _ in 0..5 {
        be.execute(&cp, &[&x], &[big.clone()], &MeshPos::single()).unwrap();
    }
    gpu.synchronize().unwrap();
    let bw = 2.0 * 4.0 * (1u64 << 30) as f64 * 5.0 / t0.elapsed().as_secs_f64() / 1e12;
    println!("{{\"check\":\"calibrate\",\"device\":\"{}\",\"bf16_gemm_tflops\":{tf:.1},\"copy_tb_per_s\":{bw:.2}}}", gpu.device_name());
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let (free, total) = gpu.mem_info().unwrap_or((0, 0));
    println!("{{\"check\":\"device\",\"name\":\"{}\",\"free\":{free},\"total\":{total}}}", gpu.device_name());
    let only = |what: &str| args.len() < 2 || args.iter().any(|a| a == what);
    let mut fails = Vec::new();
    let models = ["gpt2-tiny", "llama-tiny"];
    let step = |name: &str, f: &mut dyn FnMut()| {
        let t0 = Instant::now();
        f();
        eprintln!("[{name}: {:.1} s]", t0.elapsed().as_secs_f64());
    };
    if only("kernels") {
        step("kernels", &mut || for m in models { check_kernels(&gpu, m, &mut fails) });
    }
    if only("training") {
        step("training", &mut || for m in models { check_training(&gpu, m, &mut fails) });
    }
    if only("memory") {
        step("memory", &mut || {
            for m in models {
                check_memory(&gpu, m, 8, 256, DType::F32, &mut fails);
                check_memory(&gpu, m, 8, 256, DType::BF16, &mut fails);
            }
        });
    }
    if only("calibrate") {
        step("calibrate", &mut || calibrate(&gpu));
    }
    if only("speed") {
        step("speed", &mut || {
            speed(&gpu, "gpt2-medium", 4, 512, DType::BF16, 3);
            speed(&gpu, "gpt2-medium", 4, 512, DType::F32, 3);
        });
    }
    if fails.is_empty() {
        println!("{{\"check\":\"summary\",\"ok\":true}}");
    } else {
        println!("{{\"check\":\"summary\",\"ok\":false,\"failures\":{:?}}}", fails);
        std::process::exit(1);
    }
}
