//! Activation offload in the search: at long context the inputs the fully checkpointed blocks
//! keep decide the peak, and when no plan fits without them on the device — not even with
//! every chunk's model state on the host — the search keeps them on the host instead, at a
//! peak below the least any other plan reaches; a budget that fits without it leaves the plan
//! as it was. With context parallelism, activation offload (the only kind cp composes with) takes
//! llama3-8b to 2M tokens on 8 H100s.

use tessera_ir::{DType, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::config::ParallelConfig;
use tessera_plan::plan::Plan;
use tessera_plan::planner::{plan_auto, plan_fixed, Request};
use tessera_plan::search::Forward;
use tessera_plan::{Cluster, PlanError};

const SEQ: usize = 131_072;
const HIDDEN: usize = 256;
const BLOCKS: usize = 4;

fn plan_with(budget: Option<u64>, fixed: Option<&str>) -> Result<Plan, PlanError> {
    let json = format!(
        r#"{{"model_type": "llama", "hidden_size": {HIDDEN}, "intermediate_size": 512,
            "num_hidden_layers": {BLOCKS}, "num_attention_heads": 4, "num_key_value_heads": 4,
            "vocab_size": 1024, "max_position_embeddings": {SEQ}, "rms_norm_eps": 1e-5}}"#
    );
    let cfg = ModelConfig::from_hf_json(&json).unwrap();
    let b = move |mb: usize| -> tessera_plan::Result<Forward> {
        let m = build(&cfg, &BuildOptions::new(mb, SEQ, DType::BF16))
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    };
    let cluster = Cluster::parse("1xH100").unwrap();
    assert!(cluster.host.memory_bytes > 1 << 30, "the H100 preset has host memory");
    let req = Request {
        build: &b,
        model: "test".into(),
        batch: 1,
        seq: SEQ,
        dtype: DType::BF16,
        budget: budget.unwrap_or(cluster.device.usable_bytes()),
        cluster,
        train: TrainConfig::default(),
        model_flops: 1e12,
        ckpt: tessera_plan::search::CkptSearch::Joint,
        pipeline: Default::default(),
        search: Default::default(),
    };
    match fixed {
        Some(c) => plan_fixed(&req, &ParallelConfig::parse(c)?),
        None => plan_auto(&req),
    }
}

fn peak(p: &Plan) -> u64 {
    p.predicted.peak_bytes_per_device[0]
}

#[test]
fn long_context_search_offloads_the_kept_block_inputs_when_nothing_else_fits() {
    // The least peak without activation offload: every chunk's state on the host, every
    // block recomputed in full (the least any checkpointing reaches).
    let least = plan_with(None, Some("dp1 ckpt=full offload=all")).unwrap();
    let input = (SEQ * HIDDEN * 2) as u64; // one block's kept input, bf16
    let budget = peak(&least) - input;
    let p = plan_with(Some(budget), None).unwrap();
    assert!(p.config.contains("offload=act"), "{}", p.config);
    assert!(peak(&p) <= budget, "{} over the budget {budget}", peak(&p));
    let o = p.offload.as_ref().unwrap();
    assert!(o.act && o.act_bytes_per_step >= input, "{o:?}");
    assert!(o.host_peak_bytes >= o.act_bytes_per_step, "{o:?}");
    eprintln!(
        "`{}`: peak {} B, the least without activation offload {} B",
        p.config,
        peak(&p),
        peak(&least)
    );

    // With room for the plan without it, the search does not offload activations.
    let p = plan_with(Some(peak(&least) + input), None).unwrap();
    assert!(!p.config.contains("offload=act"), "{}", p.config);
}

/// With context parallelism (activation offload is the one offload cp composes with): llama3-8b
/// at 2M tokens on 8 H100s fits only with the kept block inputs on the host — `cp8 zero3`
/// alone is refused, the search finds a cp plan with `offload=act` within the budget.
#[test]
fn context_parallel_plans_offload_activations_at_two_million_tokens() {
    let seq = 2 * 1024 * 1024;
    let cfg = ModelConfig::resolve("llama3-8b").unwrap();
    let b = move |mb: usize| -> tessera_plan::Result<Forward> {
        let m = build(&cfg, &BuildOptions::new(mb, seq, DType::BF16))
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    };
    let cluster = Cluster::parse("8xH100").unwrap();
    let req = Request {
        build: &b,
        model: "llama3-8b".into(),
        batch: 1,
        seq,
        dtype: DType::BF16,
        budget: cluster.device.usable_bytes(),
        cluster,
        train: TrainConfig::default(),
        model_flops: 1e12,
        ckpt: tessera_plan::search::CkptSearch::Joint,
        pipeline: Default::default(),
        search: Default::default(),
    };
    let without = plan_fixed(&req, &ParallelConfig::parse("cp8 zero3").unwrap());
    assert!(matches!(without, Err(PlanError::Infeasible { .. })), "{without:?}");
    let p = plan_auto(&req).expect("2M tokens fit 8 H100s with activations on the host");
    assert!(p.config.contains("cp8") && p.config.contains("offload=act"), "{}", p.config);
    assert!(p.predicted.peak_bytes_per_device.iter().all(|&b| b <= p.memory_budget_bytes));
    let o = p.offload.as_ref().expect("the plan records its offload");
    assert!(o.act && o.chunks_offloaded == 0 && o.act_bytes_per_step > 0, "{o:?}");
}
