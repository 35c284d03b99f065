//! The matmuls of a training step, inside the step and on their own, in GFLOP/s.
//!
//! Builds a preset's forward and backward graph (the `tessera train` step without the
//! optimizer), runs it on the executor with per-op timings, and reads the matmul kind's
//! achieved GFLOP/s *inside the step* (IR FLOP count over the kernel's wall time). Then it
//! replays every `MatMul` instruction of that Program, same shapes and transposes, on fresh
//! contiguous operands of its own, one after another: the same GEMMs *outside the step*. The
//! ratio of the two is what the step costs the matmul kernel (issue 48: within 10%); the kernel
//! micro-benchmark (`--bench kernels`) gives one large shape's figure beside them.
//!
//! `cargo bench -p tessera-runtime --bench step_matmuls`
//! env: `STEP_BENCH="model batch seq"` (default `gpt2 4 256`, bench-vs-torch's case),
//!      `STEP_BENCH_RUNS` timed step runs (default 3),
//!      `STEP_BENCH_DTYPE=bf16` the model in bf16 (its GEMMs on the CPU's bf16 kernel: AMX or
//!      `vdpbf16ps`, else f32 upcasts), default fp32.

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tessera_ir::{autodiff::gradients, DType, Instr, Op, Program, TensorMeta};
use tessera_models::{build, BuildOptions, InputKind, ModelConfig};
use tessera_runtime::kernels::execute;
use tessera_runtime::{CpuBackend, Executor};

struct Case {
    model: String,
    batch: usize,
    seq: usize,
    dtype: DType,
}

fn case() -> Case {
    let spec = std::env::var("STEP_BENCH").unwrap_or_else(|_| "gpt2 4 256".into());
    let f: Vec<&str> = spec.split_whitespace().collect();
    let (model, batch, seq) = match f.as_slice() {
        [m, b, s] => (m.to_string(), b.parse().ok(), s.parse().ok()),
        _ => (String::new(), None, None),
    };
    match (batch, seq) {
        (Some(batch), Some(seq)) if !model.is_empty() => {
            let dtype = match std::env::var("STEP_BENCH_DTYPE").as_deref() {
                Ok("bf16") => DType::BF16,
                Ok("fp32") | Err(_) => DType::F32,
                Ok(other) => panic!("STEP_BENCH_DTYPE must be fp32 or bf16, got {other:?}"),
            };
            Case { model, batch, seq, dtype }
        }
        _ => panic!("STEP_BENCH must be \"model batch seq\", got {spec:?}"),
    }
}

/// A step's Program on its executor, with the batch it binds before each run (the Program
/// frees its inputs after their last use).
struct Step {
    exec: Executor<CpuBackend>,
    batch: Vec<(tessera_ir::TensorId, Tensor)>,
}

impl Step {
    fn run(&mut self) {
        for (t, v) in &self.batch {
            self.exec.bind(*t, v.clone()).expect("bind an input");
        }
        self.exec.run().expect("step");
    }
}

/// The forward + backward Program of `case` with its parameters bound.
fn step(case: &Case) -> Step {
    let cfg = ModelConfig::resolve(&case.model).expect("a preset name");
    let mut m = build(&cfg, &BuildOptions::new(case.batch, case.seq, case.dtype)).expect("build");
    let params = m.builder.graph.trainable_parameters();
    let grads = gradients(&mut m.builder, m.loss, &params).expect("gradients");
    let grad_ids: Vec<_> = grads.into_iter().flatten().collect();
    let inputs = m.inputs.clone();
    let loss = m.loss;
    let graph = m.builder.finish();
    let values = tessera_runtime::init::init_parameters(&graph, 1).expect("init");
    // Each parameter in its declared dtype (a bf16 model keeps some, norms', in f32).
    let values: Vec<_> = values
        .into_iter()
        .map(|(t, v)| {
            let want = tessera_runtime::tensor::candle_dtype(graph.meta(t).dtype);
            (t, v.to_dtype(want).expect("cast a parameter"))
        })
        .collect();
    let mut kept = vec![loss];
    kept.extend(&grad_ids);
    let mut exec =
        Executor::new(Program::lower_graph(graph, kept, &grad_ids), CpuBackend::new(0), None);
    for (t, v) in values {
        exec.bind(t, v).expect("bind a parameter");
    }
    let (b, s, cpu) = (case.batch, case.seq, &Device::Cpu);
    let mut batch = Vec::new();
    for i in inputs {
        let v = match i.kind {
            InputKind::TokenIds { vocab_size }
            | InputKind::Labels { num_classes: vocab_size, .. } => {
                let ids: Vec<i64> =
                    (0..b * s).map(|k| ((k * 7919 + 13) % vocab_size) as i64).collect();
                Tensor::from_vec(ids, (b, s), cpu)
            }
            InputKind::Seed => Tensor::new(1i64, cpu),
            InputKind::TargetCount => Tensor::new((b * s) as f32, cpu),
            other => panic!("step_matmuls benches token models; input {:?} is {other:?}", i.name),
        };
        batch.push((i.tensor, v.expect("an input tensor")));
    }
    Step { exec, batch }
}

/// Every MatMul of the Program: its operand metas, transposes and output meta.
type MatMulCall = (TensorMeta, TensorMeta, bool, bool, TensorMeta);

fn matmuls(exec: &Executor<CpuBackend>) -> Vec<MatMulCall> {
    let p = exec.program();
    let g = &p.graph;
    p.instrs
        .iter()
        .filter_map(|i| match i {
            Instr::Run(n) => Some(&g.nodes[n.index()]),
            _ => None,
        })
        .filter_map(|node| match node.op {
            Op::MatMul { trans_a, trans_b } => Some((
                g.meta(node.inputs[0]).clone(),
                g.meta(node.inputs[1]).clone(),
                trans_a,
                trans_b,
                g.meta(node.outputs[0]).clone(),
            )),
            _ => None,
        })
        .collect()
}

fn flops((a, b, ta, tb, y): &MatMulCall) -> u64 {
    Op::MatMul { trans_a: *ta, trans_b: *tb }.flops(&[a, b], &[y]).total()
}

fn rand(meta: &TensorMeta) -> Tensor {
    let t = Tensor::randn(0f32, 1f32, meta.shape.dims(), &Device::Cpu).expect("randn");
    t.to_dtype(tessera_runtime::tensor::candle_dtype(meta.dtype)).expect("the operand's dtype")
}

/// Runs the step `runs` times with timings; the matmul kind's (flops, seconds).
fn in_step(step: &mut Step, runs: usize) -> (u64, f64, f64) {
    step.run();
    step.exec.record_timings(true);
    let t0 = Instant::now();
    for _ in 0..runs {
        step.run();
    }
    let wall = t0.elapsed().as_secs_f64();
    let t = step.exec.timings().and_then(|t| t.get("matmul").copied()).unwrap_or_default();
    (t.flops, t.seconds, wall)
}

/// Replays `calls` on fresh operands (made once per distinct call, outside the timing).
fn isolated(calls: &[MatMulCall], runs: usize) -> (u64, f64, BTreeMap<String, (u64, f64)>) {
    let mut per_shape: BTreeMap<String, (u64, f64)> = BTreeMap::new();
    let (mut total_flops, mut total_s) = (0, 0.0);
    let operands: Vec<(Tensor, Tensor)> = calls.iter().map(|c| (rand(&c.0), rand(&c.1))).collect();
    for _ in 0..runs {
        for (c, (a, b)) in calls.iter().zip(&operands) {
            let op = Op::MatMul { trans_a: c.2, trans_b: c.3 };
            let t0 = Instant::now();
            let y = execute(&op, &[a, b], std::slice::from_ref(&c.4)).expect("matmul");
            let dt = t0.elapsed().as_secs_f64();
            drop(y);
            let f = flops(c);
            let key = format!(
                "{:?}{} x {:?}{}",
                c.0.shape.dims(),
                if c.2 { "ᵀ" } else { "" },
                c.1.shape.dims(),
                if c.3 { "ᵀ" } else { "" }
            );
            let e = per_shape.entry(key).or_default();
            e.0 += f;
            e.1 += dt;
            total_flops += f;
            total_s += dt;
        }
    }
    (total_flops, total_s, per_shape)
}

fn bench(c: &mut Criterion) {
    let case = case();
    let runs: usize =
        std::env::var("STEP_BENCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let mut step = step(&case);
    let calls = matmuls(&step.exec);
    let step_flops: u64 = calls.iter().map(flops).sum();
    let (f_in, s_in, wall) = in_step(&mut step, runs);
    let (f_out, s_out, per_shape) = isolated(&calls, runs);
    let (g_in, g_out) = (f_in as f64 / s_in / 1e9, f_out as f64 / s_out / 1e9);
    println!(
        "{} batch {} × seq {}, {}: {} matmuls, {:.1} GFLOP per forward+backward",
        case.model,
        case.batch,
        case.seq,
        case.dtype,
        calls.len(),
        step_flops as f64 / 1e9
    );
    println!(
        "matmul inside the step: {g_in:.1} GFLOP/s ({:.0}% of {:.2} s of step wall time); \
         the same GEMMs on their own: {g_out:.1} GFLOP/s; inside / outside = {:.2}",
        100.0 * s_in / wall,
        wall / runs as f64,
        g_in / g_out
    );
    for (shape, (f, s)) in &per_shape {
        println!("  {shape:<44} {:>7.1} GFLOP/s on its own", *f as f64 / s / 1e9);
    }

    let mut g = c.benchmark_group("step_matmuls");
    g.sample_size(10).measurement_time(Duration::from_secs(10));
    g.throughput(Throughput::Elements(step_flops));
    let name = format!("{}_{}_fwd_bwd", case.model, case.dtype);
    g.bench_function(name, |bch| bch.iter(|| step.run()));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
