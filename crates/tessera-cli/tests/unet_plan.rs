//! A tiny diffusers UNet planned by the automatic search on one small device (issue 47, item
//! 6): under a budget below its plain peak the search checkpoints it, and under one below its
//! resting model state it offloads that state to the host — a UNet's checkpointing and offload
//! chosen as for any model. Each plan's Program runs (one simulated device, the CPU backend):
//! the losses are the unconstrained single device's, and the device and host peak exactly where
//! the plan predicts.
//!
//! What this pins: a UNet has no repeated blocks, so its strategy ILP has a decision per op; on
//! one device each decision has one strategy, and the ILP's memory rows are constants
//! (`search::space::build_problem`) instead of a term per decision in a row per decision, and
//! the offload phase's probes share the forward graphs (`Search::sharing_graphs`) — the two
//! costs that made SD 2's UNet slow to plan. The plans found here are the same either way.

use tessera_ir::{build_training_graph, DType, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::plan::Plan;
use tessera_plan::planner::{self, Request};
use tessera_plan::search::Forward;
use tessera_plan::{Cluster, PlanError};
use tessera_runtime::collective::DeviceMesh;
use tessera_runtime::init::init_rules_by_name;
use tessera_runtime::tensor::from_vec;
use tessera_runtime::{CpuBackend, DeviceSetup, LrSchedule, StartState, StepBatch, Trainer};

const STEPS: u64 = 2;
const BATCH: usize = 2;
const TOKENS: usize = 3;
const SEED: u64 = 4748;
const TOL: f64 = 1e-5;
const HOST: u64 = 1 << 30;

const UNET: &str = r#"{"_class_name": "UNet2DConditionModel", "_name_or_path": "unet-tiny",
    "sample_size": 4, "block_out_channels": [4, 8], "layers_per_block": 1,
    "norm_num_groups": 2, "cross_attention_dim": 4, "attention_head_dim": [2, 2],
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "use_linear_projection": true}"#;

fn cfg() -> ModelConfig {
    ModelConfig::from_hf_json(UNET).unwrap()
}

fn schedule() -> LrSchedule {
    LrSchedule::Constant { lr: 1e-2 }
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

fn request(budget: u64) -> Request<'static> {
    Request {
        build: &forward,
        model: "unet-tiny".into(),
        batch: BATCH,
        seq: TOKENS,
        dtype: DType::F32,
        cluster: Cluster::parse("1xcpu").unwrap().with_host_memory(HOST),
        budget,
        train: train_cfg(),
        model_flops: 1.0,
        ckpt: tessera_plan::search::CkptSearch::Joint,
        pipeline: Default::default(),
        search: Default::default(),
    }
}

/// Runs `plan` on one simulated device: per-step losses; asserts the device and host peaks.
fn run(plan: &Plan, budget: u64) -> Vec<f64> {
    let req = request(budget);
    let exe = planner::lower_plan(&req, plan).unwrap();
    let rules = init_rules_by_name(&forward(BATCH).unwrap().graph);
    let setup = DeviceSetup {
        mesh: DeviceMesh::single(),
        budget: Some(budget),
        host_budget: Some(HOST),
        offload_dir: None,
    };
    let mut t = Trainer::new(
        exe.lowered.training.clone(),
        CpuBackend::new(0),
        None,
        setup,
        schedule(),
        SEED,
        StartState::Fresh { rules },
    )
    .unwrap();
    let mut losses = Vec::new();
    for s in 1..=STEPS {
        let st = t.step_batch(&batch(s)).unwrap();
        losses.push(st.loss);
        assert_eq!(st.peak_bytes, plan.predicted.peak_bytes_per_device[0], "{}", plan.config);
        assert_eq!(st.peak_bytes, exe.lowered.memory.peak_bytes, "{}", plan.config);
        assert_eq!(
            st.host_peak_bytes, exe.lowered.memory.host_peak_bytes,
            "{}: the host peak",
            plan.config
        );
    }
    losses
}

fn single() -> Vec<f64> {
    let fm = build(&cfg(), &BuildOptions::new(BATCH, TOKENS, DType::F32)).unwrap();
    let tg = build_training_graph(fm.builder, fm.loss, &train_cfg()).unwrap();
    let mut t = Trainer::single(tg, CpuBackend::new(0), schedule(), SEED, None).unwrap();
    (1..=STEPS).map(|s| t.step_batch(&batch(s)).unwrap().loss).collect()
}

#[test]
fn tiny_unet_on_one_small_device_checkpoints_then_offloads_as_predicted() {
    let reference = single();
    let free = planner::plan_auto(&request(1 << 40)).unwrap();
    assert!(free.offload.is_none() && free.predicted.recompute_s == 0.0, "{}", free.config);
    let plain_peak = free.predicted.peak_bytes_per_device[0];
    let state =
        free.predicted.params_bytes + free.predicted.grads_bytes + free.predicted.optimizer_bytes;

    // Below the plain peak, above the state: checkpointing.
    let ckpt_budget = state + (plain_peak - state) * 3 / 4;
    let ckpt = planner::plan_auto(&request(ckpt_budget)).unwrap();
    assert!(ckpt.predicted.recompute_s > 0.0, "recomputes: {}", ckpt.config);
    assert!(ckpt.offload.is_none(), "no offload needed: {}", ckpt.config);

    // Below the resting state: offload.
    let off_budget = state * 3 / 4;
    let off = planner::plan_auto(&request(off_budget)).unwrap();
    assert!(off.offload.is_some(), "offloads: {}", off.config);

    for (plan, budget) in [(&ckpt, ckpt_budget), (&off, off_budget)] {
        assert!(plan.predicted.peak_bytes_per_device[0] <= budget, "{}", plan.config);
        let losses = run(plan, budget);
        for (k, (l, r)) in losses.iter().zip(&reference).enumerate() {
            assert!((l - r).abs() <= TOL * r.abs(), "{} step {}: {l} vs {r}", plan.config, k + 1);
        }
    }
}
