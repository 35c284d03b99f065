//! Ring attention in the automatic search: where the all-to-all cannot split the KV heads
//! (cp × tp past them), the search tries the same grid point by ring attention. llama3-8b
//! (8 KV heads) at 1M tokens on two nodes of 8 H100s: 16 devices, so every context-parallel
//! point of the grid puts cp × tp past 8 heads or leaves dp; the search picks ring attention,
//! within the budget.

use tessera_ir::{DType, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::planner::{plan_auto, Request};
use tessera_plan::search::Forward;
use tessera_plan::{Cluster, PlanError};

#[test]
fn the_search_picks_ring_attention_past_the_kv_heads() {
    let seq = 1 << 20;
    let cfg = ModelConfig::resolve("llama3-8b").unwrap();
    let b = move |mb: usize| -> tessera_plan::Result<Forward> {
        let m = build(&cfg, &BuildOptions::new(mb, seq, DType::BF16))
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    };
    let cluster = Cluster::parse("2x8xH100").unwrap();
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
    let p = plan_auto(&req).expect("1M tokens fit 16 H100s");
    assert!(p.config.contains("cp=ring"), "{}", p.config);
    assert!(p.mesh.ring, "{:?}", p.mesh);
    assert!(
        p.predicted.peak_bytes_per_device.iter().all(|&b| b <= p.memory_budget_bytes),
        "{:?} over {}",
        p.predicted.peak_bytes_per_device,
        p.memory_budget_bytes
    );
    // The ring's K/V blocks are counted: sends over the cp axis.
    assert!(p.collectives.iter().any(|c| c.op == "send"), "{}", p.config);
    eprintln!("{}: {:.1} s/step", p.config, p.predicted.step_time_s);
}
