//! The first round's pilots (`SearchKnobs::pilots`): the Megatron-style jobs the ILP ranks
//! fastest run ahead of the others, and their fits bound the rest of the round. A bound may
//! only spare work, never change the answer: the plan (layout, figures, Megatron baseline)
//! must be the one the round finds without pilots, with fewer Programs finished. Alone in its
//! file: the search's work counters are per process.

use tessera_ir::{DType, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::planner::{plan_auto, Request};
use tessera_plan::search::{Forward, SearchKnobs};
use tessera_plan::trace::{calls, Work};
use tessera_plan::{Cluster, PlanError};

/// The plan as JSON, without what counts the search's own work (it is what pilots change).
fn plan(cfg: &ModelConfig, pilots: usize, budget: u64) -> (serde_json::Value, u64) {
    let cfg = cfg.clone();
    let (batch, seq) = (16, 512);
    let b = move |mb: usize| -> tessera_plan::Result<Forward> {
        let m = build(&cfg, &BuildOptions::new(mb, seq, DType::BF16))
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    };
    let cluster = Cluster::parse("8xRTX3060").unwrap();
    let req = Request {
        build: &b,
        model: "test".into(),
        batch,
        seq,
        dtype: DType::BF16,
        budget,
        cluster,
        train: TrainConfig::default(),
        model_flops: 1e12,
        ckpt: tessera_plan::search::CkptSearch::Joint,
        pipeline: Default::default(),
        search: SearchKnobs { pilots, ..Default::default() },
    };
    let before = calls(Work::Finish);
    let plan = plan_auto(&req).unwrap();
    let finishes = calls(Work::Finish) - before;
    let mut json = serde_json::to_value(&plan).unwrap();
    strip_counts(&mut json);
    (json, finishes)
}

/// `v` without the search's counts, at any depth (the Megatron baseline carries its own).
fn strip_counts(v: &mut serde_json::Value) {
    if let Some(obj) = v.as_object_mut() {
        for key in ["search_ms", "configurations_tried", "configurations_fitting"] {
            obj.remove(key);
        }
        obj.values_mut().for_each(strip_counts);
    }
}

#[test]
fn pilots_spare_finishes_and_change_no_answer() {
    let json = r#"{"model_type": "llama", "hidden_size": 512, "intermediate_size": 1408,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
        "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}"#;
    let cfg = ModelConfig::from_hf_json(json).unwrap();
    // Unbounded first, then under a budget that forces recomputation on the fastest layout:
    // the case where every job's checkpointing DP ran without a bound.
    let (free, _) = plan(&cfg, 0, u64::MAX / 4);
    let peak = free["predicted"]["peak_bytes_per_device"][0].as_u64().unwrap();
    let budget = (peak as f64 * 0.6) as u64;
    let (without, spent_without) = plan(&cfg, 0, budget);
    let (with, spent_with) = plan(&cfg, 2, budget);
    assert!(
        without["predicted"]["recompute_s"].as_f64().unwrap() > 0.0,
        "the budget must force recomputation: {}",
        without["config"]
    );
    assert!(without["baselines"]["megatron"].is_object(), "no Megatron baseline to compare");
    assert_eq!(with, without, "pilots changed the plan");
    assert!(
        spent_with < spent_without,
        "pilots finished {spent_with} Programs, the round without them {spent_without}"
    );
}
