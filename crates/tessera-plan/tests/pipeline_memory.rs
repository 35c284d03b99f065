//! What a schedule holds (issue 18): under 1F1B, device d of p keeps min(p − d, m)
//! micro-batches of activations alive (the first stage p, the last one), under GPipe all m;
//! the plan's peak is its worst device's, never an average.

use tessera_ir::{DType, Role, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::config::ParallelConfig;
use tessera_plan::planner::{lower_plan, plan_fixed, Request};
use tessera_plan::search::{CkptSearch, Forward};
use tessera_plan::{Cluster, PlanError};

/// gpt2-tiny's forward graph builder: f32, sequences of 32.
fn gpt2_tiny() -> impl Fn(usize) -> tessera_plan::Result<Forward> + Sync {
    let cfg = ModelConfig::preset("gpt2-tiny").unwrap().without_dropout();
    move |mb: usize| -> tessera_plan::Result<Forward> {
        let m = build(&cfg, &BuildOptions::new(mb, 32, DType::F32))
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    }
}

/// Batch 16 of `b` on 4 CPU devices, without a budget.
fn request(b: &(dyn Fn(usize) -> tessera_plan::Result<Forward> + Sync)) -> Request<'_> {
    Request {
        build: b,
        model: "gpt2-tiny".into(),
        batch: 16,
        seq: 32,
        dtype: DType::F32,
        budget: u64::MAX,
        cluster: Cluster::parse("4xcpu").unwrap(),
        train: TrainConfig::default(),
        model_flops: 1e12,
        ckpt: CkptSearch::Off,
        pipeline: Default::default(),
        search: Default::default(),
    }
}

/// Saved activations at each device's peak, and the plan's peaks, for `config` on 4 devices.
fn activations(config: &str) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
    let b = gpt2_tiny();
    let req = request(&b);
    let plan = plan_fixed(&req, &ParallelConfig::parse(config).unwrap()).unwrap();
    let exe = lower_plan(&req, &plan).unwrap();
    let pipe = exe.pipeline.expect("a pipelined plan");
    let saved_at_peak = |m: &tessera_profile::MemoryReport| {
        m.peak_by_role.iter().filter(|(r, _)| *r == Role::SavedActivation).map(|(_, b)| b).sum()
    };
    let acts = pipe.devices.iter().map(|d| saved_at_peak(&d.lowered.memory)).collect();
    let peaks = pipe.devices.iter().map(|d| d.lowered.memory.peak_bytes).collect();
    let stage_peaks =
        plan.pipeline.expect("a pipeline section").stages.iter().map(|s| s.peak_bytes).collect();
    assert_eq!(plan.predicted.peak_bytes_per_device.len(), 4);
    let worst = *plan.predicted.peak_bytes_per_device.iter().max().unwrap();
    assert_eq!(worst, exe.lowered.memory.peak_bytes, "the plan's peak is its worst device's");
    (acts, peaks, stage_peaks)
}

#[test]
fn one_f_one_b_holds_p_minus_d_micro_batches_gpipe_all() {
    let (m, p) = (8.0, 4.0);
    let (fb, fb_peaks, fb_stages) = activations("pp4 mb8 sched=1f1b");
    let (gp, _, _) = activations("pp4 mb8 sched=gpipe");
    assert_eq!(fb_peaks, fb_stages, "each stage's peak is its device's");
    for d in 0..4 {
        // Same stage, same micro-batch size: the ratio is that of the micro-batches in flight
        // (within a fraction of one micro-batch: at its peak instant a device may be partway
        // through a backward pass that already freed some of that micro-batch's values).
        let want = m / f64::min(p - d as f64, m);
        let got = gp[d] as f64 / fb[d] as f64;
        assert!(
            (0.85 * want..=1.25 * want).contains(&got),
            "device {d}: GPipe/1F1B {got:.3}, want {want}"
        );
    }
    // The first stage holds the most under 1F1B, and the plan fits by its worst device.
    assert!(fb_peaks[0] > fb_peaks[2], "{fb_peaks:?}");
}

/// The search's exact check of a screened pipeline stops at the first device found over the
/// budget (`pipeline::lower::lower_within`): what it answers must be what the whole lowering
/// says — under the worst device's peak, that same peak as the miss (its probes take the
/// device holding the most parameters and the first, the one with the most in flight); one
/// byte over, the same Program figures on every device.
#[test]
fn a_probed_pipeline_check_answers_as_the_whole_lowering() {
    use tessera_plan::planner::pipelined::lower_fixed;
    let b = gpt2_tiny();
    let req = request(&b);
    for config in ["pp4 mb8 sched=1f1b", "dp2 pp2 mb4 sched=gpipe zero1"] {
        let cfg = ParallelConfig::parse(config).unwrap();
        let whole = lower_fixed(&req, &cfg, None).unwrap().lowered;
        let peaks: Vec<u64> = whole.devices.iter().map(|d| d.lowered.memory.peak_bytes).collect();
        let worst = whole.peak_bytes();
        match lower_fixed(&req, &cfg, Some(worst - 1)) {
            Err(PlanError::Infeasible { needed, budget, .. }) => {
                assert_eq!(budget, worst - 1);
                assert_eq!(needed, worst, "{config}: the probes missed the worst device {peaks:?}");
            }
            other => panic!(
                "{config}: under the worst peak, {:?}",
                other.map(|f| f.lowered.peak_bytes())
            ),
        }
        let fits = lower_fixed(&req, &cfg, Some(worst)).unwrap().lowered;
        for (d, (a, b)) in fits.devices.iter().zip(&whole.devices).enumerate() {
            let (ma, mb) = (&a.lowered.memory, &b.lowered.memory);
            assert_eq!(ma.peak_bytes, mb.peak_bytes, "{config}: device {d}'s peak");
            assert_eq!(ma.peak_by_role, mb.peak_by_role, "{config}: device {d}'s peak by role");
            assert_eq!(ma.resting_bytes, mb.resting_bytes, "{config}: device {d}'s resting bytes");
            assert_eq!(
                a.lowered.time.step_time_s, b.lowered.time.step_time_s,
                "{config}: device {d}"
            );
        }
        assert_eq!(fits.step_time_s, whole.step_time_s, "{config}: the schedule's step");
    }
}
