//! A small convolutional network (convolutions plain, grouped and pointwise, GroupNorm, max and
//! global average pooling, nearest upsampling) trained by the SPMD runtime on simulated devices
//! — data parallel (dp2, dp4, dp2 with ZeRO-3) and a plan whose ungrouped convolutions split
//! their output channels (weights by rows) — computes what one device computes: per-step loss
//! and gradient norm within 1e-5 relative, final parameters within 2e-5, and every device
//! peaks at exactly the memory the plan predicts (the criterion of `spmd.rs`).

use candle_core::Tensor;
use std::collections::HashMap;
use std::time::Duration;
use tessera_comm::ThreadComm;
use tessera_ir::{
    build_training_graph, Builder, Conv2dSpec, DType, TensorId, TrainConfig, UnaryOp,
};
use tessera_plan::config::ParallelConfig;
use tessera_plan::plan::Plan;
use tessera_plan::planner::{self, Request};
use tessera_plan::search::Forward;
use tessera_plan::{Cluster, PlanError};
use tessera_runtime::collective::{CommRunner, DeviceMesh};
use tessera_runtime::init::init_rules_by_name;
use tessera_runtime::trainer::gather_params_to;
use tessera_runtime::{CpuBackend, DeviceSetup, LrSchedule, StartState, StepBatch, Trainer};

const STEPS: u64 = 4;
const BATCH: usize = 8;
const SEED: u64 = 1337;
const TOL: f64 = 1e-5;
const CLASSES: usize = 10;

fn schedule() -> LrSchedule {
    LrSchedule::WarmupCosine { peak: 1e-2, min_lr: 1e-3, warmup: 1, total: STEPS }
}

fn train_cfg() -> TrainConfig {
    TrainConfig { weight_decay: 0.1, max_grad_norm: Some(1.0), ..TrainConfig::default() }
}

/// The network on `mb` 3×8×8 images, named as the trainer binds batches (`pixel_values`,
/// `labels`).
fn cnn(mb: usize) -> tessera_ir::Result<(Builder, TensorId)> {
    let mut b = Builder::new();
    let x = b.input("pixel_values", [mb, 3, 8, 8], DType::F32);
    let labels = b.input("labels", [mb], DType::I64);
    let conv = |stride: usize, padding: usize, groups: usize| Conv2dSpec {
        stride: [stride; 2],
        padding: [padding; 2],
        dilation: [1, 1],
        groups,
    };
    let w1 = b.parameter("stem.weight", [8, 3, 3, 3], DType::F32);
    let gw = b.parameter("gn.weight", [8], DType::F32);
    let gb = b.parameter("gn.bias", [8], DType::F32);
    let w2 = b.parameter("down.weight", [8, 4, 3, 3], DType::F32);
    let b2 = b.parameter("down.bias", [1, 8, 1, 1], DType::F32);
    let w3 = b.parameter("proj.weight", [6, 8, 1, 1], DType::F32);
    let head = b.parameter("head.weight", [6, CLASSES], DType::F32);
    let h = b.conv2d(x, w1, conv(1, 1, 1))?;
    let h = b.group_norm(h, gw, gb, 4, 1e-5)?;
    let h = b.unary(UnaryOp::Silu, h)?;
    let h = b.max_pool2d(h, [2, 2], [2, 2], [0, 0])?; // 4×4
    let h = b.conv2d(h, w2, conv(1, 1, 2))?;
    let h = b.add(h, b2)?;
    let h = b.upsample_nearest2d(h, [2, 2])?; // 8×8
    let h = b.conv2d(h, w3, conv(1, 0, 1))?;
    let h = b.avg_pool2d(h, [8, 8], [1, 1], [0, 0], false)?;
    let h = b.reshape(h, [mb, 6])?;
    let logits = b.matmul(h, head, false, false)?;
    let loss = b.cross_entropy(logits, labels, None)?;
    Ok((b, loss))
}

/// Deterministic pseudo-random images in [-1, 1] and labels of a step.
fn batch(step: u64) -> StepBatch {
    let dims = [BATCH, 3, 8, 8];
    let draw = |i: u64, salt: u64| tessera_ir::rng::splitmix64(i ^ salt.wrapping_mul(0x9E37_79B9));
    let n = dims.iter().product::<usize>() as u64;
    let pixels = (0..n).map(|i| (draw(i, step * 2 + 1) % 2001) as f32 / 1000.0 - 1.0).collect();
    let labels = (0..BATCH as u64).map(|i| (draw(i, step * 2 + 2) % CLASSES as u64) as i64);
    StepBatch::images(pixels, dims, labels.collect()).unwrap()
}

struct Run {
    /// (loss, grad norm) per step.
    steps: Vec<(f64, f64)>,
    params: HashMap<String, Tensor>,
}

fn single() -> Run {
    let (b, loss) = cnn(BATCH).unwrap();
    let tg = build_training_graph(b, loss, &train_cfg()).unwrap();
    let mut t = Trainer::single(tg, CpuBackend::new(0), schedule(), SEED, None).unwrap();
    let steps = (1..=STEPS)
        .map(|s| {
            let st = t.step_batch(&batch(s)).unwrap();
            (st.loss, st.grad_norm)
        })
        .collect();
    Run { steps, params: t.parameters().unwrap().into_iter().collect() }
}

fn forward(mb: usize) -> tessera_plan::Result<Forward> {
    let (b, loss) = cnn(mb).map_err(|e| PlanError::Invalid(e.to_string()))?;
    Ok(Forward { graph: b.finish(), loss })
}

fn request(devices: usize) -> Request<'static> {
    Request {
        build: &forward,
        model: "cnn".into(),
        batch: BATCH,
        seq: 1,
        dtype: DType::F32,
        cluster: Cluster::parse(&format!("{devices}xcpu")).unwrap(),
        budget: 1 << 40,
        train: train_cfg(),
        model_flops: 1.0,
        ckpt: tessera_plan::search::CkptSearch::Joint,
        pipeline: Default::default(),
        search: Default::default(),
    }
}

fn plan(devices: usize, config: &str) -> Plan {
    planner::plan_fixed(&request(devices), &ParallelConfig::parse(config).unwrap())
        .unwrap_or_else(|e| panic!("{config}: {e}"))
}

/// `plan` on its devices (simulated); checks each device's peak against the plan's prediction.
fn parallel(plan: &Plan, config: &str) -> Run {
    let devices: usize = plan.mesh.shape.iter().product();
    let req = request(devices);
    let exe = planner::lower_plan(&req, plan).unwrap_or_else(|e| panic!("{config}: {e}"));
    let rules = init_rules_by_name(&cnn(BATCH).unwrap().0.finish());
    let comms = ThreadComm::world(devices, Duration::from_secs(60)).unwrap();
    let results: Vec<(Option<Run>, u64)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let (exe, rules) = (&exe, &rules);
                s.spawn(move || {
                    let mesh = DeviceMesh::new(&exe.mesh.shape, rank).unwrap();
                    let runner = CommRunner::new(Box::new(comm), mesh.clone()).unwrap();
                    let setup =
                        DeviceSetup { mesh, budget: None, host_budget: None, offload_dir: None };
                    let mut t = Trainer::new(
                        exe.lowered.training_graph(),
                        CpuBackend::new(rank),
                        Some(runner),
                        setup,
                        schedule(),
                        SEED,
                        StartState::Fresh { rules },
                    )
                    .unwrap();
                    let (mut steps, mut peak) = (Vec::new(), 0);
                    for s in 1..=STEPS {
                        let st = t.step_batch(&batch(s)).unwrap();
                        steps.push((st.loss, st.grad_norm));
                        peak = st.peak_bytes;
                    }
                    let run =
                        gather_params_to(&mut t, 0).unwrap().map(|params| Run { steps, params });
                    (run, peak)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    let mut run = None;
    for (rank, (r, peak)) in results.into_iter().enumerate() {
        assert_eq!(peak, exe.lowered.memory.peak_bytes, "{config} rank {rank}: peak");
        assert_eq!(
            plan.predicted.peak_bytes_per_device[rank], peak,
            "{config} rank {rank}: the plan's predicted peak"
        );
        run = run.or(r);
    }
    run.expect("rank 0 reports")
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

#[test]
fn cnn_data_and_channel_parallel_plans_match_one_device() {
    let reference = single();
    // The parameters move (the loss of random labels stays near ln 10; the gradient grows as
    // the small initial weights do).
    let (first, last) = (reference.steps[0].1, reference.steps[STEPS as usize - 1].1);
    assert!(rel(last, first) > 1e-2, "{:?}", reference.steps);
    // Ungrouped convolutions split by output channels (weights by rows) under tp2: a hand-
    // edited plan file, re-lowered and re-predicted by the planner.
    let mut channels = plan(2, "tp2");
    // The tensor-parallel axis (the mesh is [dp, tp] = [1, 2]).
    let tp = channels.mesh.shape.iter().position(|&d| d == 2).expect("a tp axis");
    let g = forward(BATCH).unwrap().graph;
    let mut edited = 0;
    for s in &mut channels.strategies {
        if matches!(g.nodes[s.node].op, tessera_ir::Op::Conv2d(c) if c.groups == 1) {
            s.inputs = vec!["[R, R, R, R]".into(), format!("[S{tp}, R, R, R]")];
            s.outputs = vec![format!("[R, S{tp}, R, R]")];
            s.compute_axes = vec![tp];
            edited += 1;
        }
    }
    assert_eq!(edited, 2);
    let channels = planner::plan_from_file(&request(2), &channels).unwrap();
    let local = |name: &str| {
        let t = channels.tensors.iter().find(|t| t.name == name).expect("a planned tensor");
        t.local_shape.clone()
    };
    assert_eq!(local("stem.weight"), vec![4, 3, 3, 3]);
    assert_eq!(local("proj.weight"), vec![3, 8, 1, 1]);
    let runs = [
        ("dp2", plan(2, "dp2")),
        ("dp4", plan(4, "dp4")),
        ("dp2 zero3", plan(2, "dp2 zero3")),
        ("tp2, convolutions by output channels", channels),
    ];
    for (config, p) in &runs {
        let run = parallel(p, config);
        for (i, ((l, g), (l1, g1))) in run.steps.iter().zip(&reference.steps).enumerate() {
            assert!(
                rel(*l, *l1) < TOL && rel(*g, *g1) < TOL,
                "{config} step {}: loss {l} vs {l1}, grad norm {g} vs {g1}",
                i + 1
            );
        }
        for (name, want) in &reference.params {
            if name.contains(".adam_") || name.ends_with(".master") {
                continue;
            }
            let got = run.params.get(name).unwrap_or_else(|| panic!("{config}: {name} missing"));
            let g = tessera_runtime::tensor::to_f64_vec(got).unwrap();
            let w = tessera_runtime::tensor::to_f64_vec(want).unwrap();
            let scale = w.iter().fold(0f64, |m, x| m.max(x.abs())).max(1.0);
            let d = g.iter().zip(&w).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale;
            assert!(d < 2.0 * TOL, "{config}: final {name} differs by {d:e}");
        }
    }
}
