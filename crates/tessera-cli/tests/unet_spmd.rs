//! A tiny diffusers UNet (`UNet2DConditionModel`: convolutions, GroupNorm, timestep embedding,
//! self- and cross-attention, skip concatenations, down- and upsampling) trained by the SPMD
//! runtime on simulated devices under dp2, dp2 with ZeRO-3 and tp2 (the planner's Megatron
//! layout: attention by heads, the GEGLU MLP by columns and rows, convolutions and GroupNorm
//! whole with the resharding that needs), each of them with every block checkpointed, and with
//! its model state offloaded to host memory (and with that, ZeRO-3 and checkpointing),
//! computes what one device computes (per-step loss and gradient norm within 1e-5 relative,
//! 10 steps), and every device peaks at exactly the device and host memory the plan predicts. The inputs are synthetic (seeded draws of `sample`,
//! `timestep`, `encoder_hidden_states` and `target`): the fidelity of the parallel step, not
//! the diffusion objective, is what is checked.

use std::time::Duration;
use tessera_comm::ThreadComm;
use tessera_ir::{build_training_graph, DType, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::config::ParallelConfig;
use tessera_plan::plan::Plan;
use tessera_plan::planner::{self, Request};
use tessera_plan::search::Forward;
use tessera_plan::{Cluster, PlanError};
use tessera_runtime::collective::{CommRunner, DeviceMesh};
use tessera_runtime::init::init_rules_by_name;
use tessera_runtime::tensor::from_vec;
use tessera_runtime::{CpuBackend, DeviceSetup, LrSchedule, StartState, StepBatch, Trainer};

const STEPS: u64 = 10;
const BATCH: usize = 4;
const TOKENS: usize = 3;
const SEED: u64 = 4747;
const TOL: f64 = 1e-5;

const UNET: &str = r#"{"_class_name": "UNet2DConditionModel", "_name_or_path": "unet-tiny",
    "sample_size": 4, "block_out_channels": [4, 8], "layers_per_block": 1,
    "norm_num_groups": 2, "cross_attention_dim": 4, "attention_head_dim": [2, 2],
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "use_linear_projection": true}"#;

fn cfg() -> ModelConfig {
    ModelConfig::from_hf_json(UNET).unwrap()
}

fn schedule() -> LrSchedule {
    LrSchedule::WarmupCosine { peak: 1e-2, min_lr: 1e-3, warmup: 1, total: STEPS }
}

fn train_cfg() -> TrainConfig {
    TrainConfig { weight_decay: 0.1, max_grad_norm: Some(1.0), ..TrainConfig::default() }
}

fn forward(mb: usize) -> tessera_plan::Result<Forward> {
    let fm = build(&cfg(), &BuildOptions::new(mb, TOKENS, DType::F32))
        .map_err(|e| PlanError::Invalid(e.to_string()))?;
    Ok(Forward { graph: fm.builder.finish(), loss: fm.loss })
}

/// Seeded draws in [-1, 1] for every input; timesteps in 0..1000.
fn batch(step: u64) -> StepBatch {
    let draw = |i: u64, salt: u64| {
        let z = tessera_ir::rng::splitmix64(i ^ salt.wrapping_mul(0x9E37_79B9));
        (z % 2001) as f32 / 1000.0 - 1.0
    };
    let field = |name: &str, dims: &[usize], salt: u64| {
        let n = dims.iter().product::<usize>() as u64;
        let v: Vec<f32> = (0..n).map(|i| draw(i, step * 8 + salt)).collect();
        (name.to_string(), from_vec(v, dims).unwrap())
    };
    let t: Vec<f32> = (0..BATCH as u64).map(|i| 500.0 * (draw(i, step * 8 + 3) + 1.0)).collect();
    StepBatch::new(vec![
        field("sample", &[BATCH, 4, 4, 4], 1),
        ("timestep".into(), from_vec(t, &[BATCH]).unwrap()),
        field("encoder_hidden_states", &[BATCH, TOKENS, 4], 2),
        field("target", &[BATCH, 4, 4, 4], 4),
    ])
    .unwrap()
}

fn single() -> Vec<(f64, f64)> {
    let fm = build(&cfg(), &BuildOptions::new(BATCH, TOKENS, DType::F32)).unwrap();
    let tg = build_training_graph(fm.builder, fm.loss, &train_cfg()).unwrap();
    let mut t = Trainer::single(tg, CpuBackend::new(0), schedule(), SEED, None).unwrap();
    (1..=STEPS)
        .map(|s| {
            let st = t.step_batch(&batch(s)).unwrap();
            (st.loss, st.grad_norm)
        })
        .collect()
}

fn request(devices: usize) -> Request<'static> {
    // 1 GiB of host memory per device, for the offloaded plans' model state.
    let mut cluster = Cluster::parse(&format!("{devices}xcpu")).unwrap();
    cluster.host.memory_bytes = 1 << 30;
    Request {
        build: &forward,
        model: "unet-tiny".into(),
        batch: BATCH,
        seq: TOKENS,
        dtype: DType::F32,
        cluster,
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

/// One device's run: per-step (loss, grad norm), its peak and its host peak.
type DeviceRun = (Vec<(f64, f64)>, u64, u64);

/// `plan` on its devices (simulated): per-step (loss, grad norm) of rank 0; checks each
/// device's peak, and its host peak, against the plan's prediction.
fn parallel(plan: &Plan, config: &str) -> Vec<(f64, f64)> {
    let devices: usize = plan.mesh.shape.iter().product();
    let req = request(devices);
    let exe = planner::lower_plan(&req, plan).unwrap_or_else(|e| panic!("{config}: {e}"));
    if let Some(o) = &plan.offload {
        // The plan's figure is the one `tessera train` reports as predicted: its Program and the
        // one lowered from the plan file must be the same.
        let host = exe.lowered.memory.host_peak_bytes;
        assert_eq!(o.host_peak_bytes, host, "{config}: the plan's host peak vs its Program's");
    }
    let rules = init_rules_by_name(&forward(BATCH).unwrap().graph);
    let comms = ThreadComm::world(devices, Duration::from_secs(60)).unwrap();
    let results: Vec<DeviceRun> = std::thread::scope(|s| {
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
                    let (mut steps, mut peak, mut host) = (Vec::new(), 0, 0);
                    for s in 1..=STEPS {
                        let st = t.step_batch(&batch(s)).unwrap();
                        steps.push((st.loss, st.grad_norm));
                        peak = peak.max(st.peak_bytes);
                        host = host.max(st.host_peak_bytes);
                    }
                    (steps, peak, host)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    for (rank, (_, peak, host)) in results.iter().enumerate() {
        assert_eq!(*peak, exe.lowered.memory.peak_bytes, "{config} rank {rank}: peak");
        assert_eq!(
            plan.predicted.peak_bytes_per_device[rank], *peak,
            "{config} rank {rank}: the plan's predicted peak"
        );
        assert_eq!(*host, exe.lowered.memory.host_peak_bytes, "{config} rank {rank}: host peak");
        let offloads = plan.offload.as_ref().is_some_and(|o| o.chunks_offloaded > 0);
        assert_eq!(*host > 0, offloads, "{config} rank {rank}: host peak {host} B");
    }
    results.into_iter().next().expect("rank 0").0
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

#[test]
fn tiny_unet_data_and_tensor_parallel_plans_match_one_device() {
    let reference = single();
    // The parameters move: the gradient norm changes from step to step.
    assert!(rel(reference[2].1, reference[0].1) > 1e-3, "{reference:?}");
    for config in [
        "dp2",
        "dp2 zero3",
        "tp2",
        "dp2 ckpt=full",
        "dp2 zero3 ckpt=full",
        "tp2 ckpt=full",
        "dp2 offload=all",
        "tp2 offload=grads+opt",
        "dp2 zero3 ckpt=full offload=all",
    ] {
        let steps = parallel(&plan(2, config), config);
        for (i, ((l, g), (l1, g1))) in steps.iter().zip(&reference).enumerate() {
            assert!(
                rel(*l, *l1) < TOL && rel(*g, *g1) < TOL,
                "{config} step {}: loss {l} vs {l1}, grad norm {g} vs {g1}",
                i + 1
            );
        }
    }
}
