//! A device with measured kernels (`tessera calibrate --device cuda`): the planner prices each
//! kernel by its curve and replays the host's issue of the step, so the step is the device's
//! busy time where the host keeps ahead, and the host's issue time where it falls behind.

use std::collections::BTreeMap;
use tessera_ir::{DType, Instr, Op, TensorMeta, Tier, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::config::ParallelConfig;
use tessera_plan::planner::{lower_plan, plan_fixed, Request};
use tessera_plan::search::{CkptSearch, Forward};
use tessera_plan::Cluster;
use tessera_profile::kernels::{kernel_work, KernelCurve, KernelTable, Work};

/// The keys of `program`'s kernels, and how many ops it issues (kernels and views) and how
/// many of them launch a kernel.
fn census(p: &tessera_ir::Program) -> (Vec<(String, Work)>, usize, usize) {
    let g = p.graph();
    let (mut keys, mut issued, mut kernels) = (BTreeMap::new(), 0, 0);
    for instr in &p.instrs {
        let Instr::Run(id) = *instr else { continue };
        let n = g.node(id);
        if n.tier != Tier::Device || (n.op.is_leaf() && !matches!(n.op, Op::Fill { .. })) {
            continue;
        }
        if matches!(n.op, Op::Reshard(_) | Op::Send(_) | Op::Recv(..) | Op::Transfer { .. }) {
            continue;
        }
        issued += 1;
        let x: Vec<&TensorMeta> = n.inputs.iter().map(|&i| g.meta(i)).collect();
        let y: Vec<&TensorMeta> = n.outputs.iter().map(|&o| g.meta(o)).collect();
        if let Some(w) = kernel_work(&n.op, &x, &y) {
            kernels += 1;
            keys.insert(w.key, w.work);
        }
    }
    (keys.into_iter().collect(), issued, kernels)
}

/// gpt2-tiny `dp1` on one H100 whose device carries `table` (or none): the lowered Program and
/// the plan's predicted step.
fn plan(table: Option<KernelTable>) -> (tessera_ir::Program, tessera_plan::plan::Plan) {
    let cfg = ModelConfig::preset("gpt2-tiny").unwrap();
    let b = move |mb: usize| -> tessera_plan::Result<Forward> {
        let m = build(&cfg, &BuildOptions::new(mb, 64, DType::BF16))
            .map_err(|e| tessera_plan::PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    };
    let mut cluster = Cluster::parse("1xH100").unwrap();
    cluster.device.kernels = table;
    let req = Request {
        build: &b,
        model: "gpt2-tiny".into(),
        batch: 4,
        seq: 64,
        dtype: DType::BF16,
        budget: 1 << 34,
        cluster,
        train: TrainConfig::default(),
        model_flops: 1e12,
        ckpt: CkptSearch::Joint,
        pipeline: Default::default(),
        search: Default::default(),
    };
    let p = plan_fixed(&req, &ParallelConfig::parse("dp1").unwrap()).unwrap();
    let exe = lower_plan(&req, &p).unwrap();
    (exe.lowered.program, p)
}

/// Every key of the Program at a flat `secs` per kernel, every kind issued in `host` seconds.
fn flat(keys: &[(String, Work)], secs: f64, host: f64, gap: f64) -> KernelTable {
    let curves = keys
        .iter()
        .map(|(k, w)| (k.clone(), KernelCurve { work: *w, points: vec![[1e30, secs]] }))
        .collect();
    let kinds = ["matmul", "binary", "reshape", "attention", "layer_norm", "adamw", "cast"];
    let host_s = kinds.iter().map(|k| (k.to_string(), host)).collect();
    KernelTable { curves, host_s, host_overhead_s: host, gap_s: gap, source: "test".into() }
}

#[test]
fn measured_kernels_price_each_op_and_the_step_is_their_sum_when_the_host_keeps_ahead() {
    let (program, roofline) = plan(None);
    assert_eq!(roofline.predicted.issue_wait_s, 0.0, "no measured kernels: no host replay");
    let (keys, _, kernels) = census(&program);
    assert!(kernels > 100 && keys.len() > 10, "{kernels} kernels over {} keys", keys.len());
    // 10 µs a kernel plus a 1 µs gap; a host that issues an op in 0.1 µs keeps ahead.
    let (_, p) = plan(Some(flat(&keys, 10e-6, 0.0, 1e-6)));
    let want = kernels as f64 * 11e-6;
    let got = p.predicted.step_time_s;
    assert!((got - want).abs() < 1e-9 * want.max(1.0), "step {got} s, {kernels} kernels: {want} s");
    assert_eq!(p.predicted.issue_wait_s, 0.0);
    assert!(got != roofline.predicted.step_time_s, "the table, not the roofline, priced it");
}

#[test]
fn a_slow_host_sets_the_step() {
    let (program, _) = plan(None);
    let (keys, issued, kernels) = census(&program);
    // Each op costs the host 100 µs (its kind's 50 µs and the executor's 50 µs) and the device
    // 1 µs: the device waits on the host, and the step is the host's issue plus the last op.
    let mut table = flat(&keys, 1e-6, 50e-6, 0.0);
    table.host_s = BTreeMap::new();
    table.host_s.insert("matmul".into(), 50e-6);
    let matmuls = program
        .instrs
        .iter()
        .filter(|i| matches!(i, Instr::Run(id) if matches!(program.graph().node(*id).op, Op::MatMul { .. })))
        .count();
    let (_, p) = plan(Some(table));
    let host = issued as f64 * 50e-6 + matmuls as f64 * 50e-6;
    let got = p.predicted.step_time_s;
    assert!(got >= host - 1e-12 && got <= host + 1e-6 + 1e-12, "step {got} s, host {host} s");
    let busy = kernels as f64 * 1e-6;
    assert!((p.predicted.issue_wait_s - (got - busy)).abs() < 1e-9, "{:?}", p.predicted);
}
