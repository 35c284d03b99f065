//! The planner's choice of the chunked loss (`crate::loss_chunk`): a long sequence whose
//! logits dominate the memory — a Llama 3.2 1B (128,256-token vocabulary) at 96K tokens on
//! one H100 — is planned with the head and loss fused in chunks, with a lower peak than the
//! whole logits (`loss=whole`) under the same checkpointing, so the search keeps more and the
//! step is faster; a short sequence keeps its logits whole and its plan as it was; a pinned
//! chunk size is the one the plan runs. (At 128K this model needs more than an H100 either
//! way: the attention's blocked workspace dominates there, not the logits.)

use tessera_ir::{DType, Op, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::config::ParallelConfig;
use tessera_plan::loss_chunk::{self, CHUNK_SHARE};
use tessera_plan::plan::Plan;
use tessera_plan::planner::{plan_auto, plan_fixed, Request};
use tessera_plan::search::{CkptSearch, Forward};
use tessera_plan::{Cluster, PlanError};

const VOCAB: u64 = 128_256;

/// Llama 3.2 1B's shape (tied embeddings), as Hugging Face's config.json says.
fn llama32_1b() -> ModelConfig {
    let j = serde_json::json!({
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": true
    });
    ModelConfig::from_hf_json(&j.to_string()).unwrap()
}

fn plan(seq: usize, config: Option<&str>) -> Result<Plan, PlanError> {
    let cfg = llama32_1b();
    let b = move |mb: usize| -> tessera_plan::Result<Forward> {
        let m = build(&cfg, &BuildOptions::new(mb, seq, DType::BF16))
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    };
    let cluster = Cluster::parse("1xH100").unwrap().with_host_memory(0);
    let req = Request {
        build: &b,
        model: "llama3.2-1b".into(),
        batch: 1,
        seq,
        dtype: DType::BF16,
        budget: cluster.device.usable_bytes(),
        cluster,
        train: TrainConfig::default(),
        model_flops: 1e12,
        ckpt: CkptSearch::Joint,
        pipeline: Default::default(),
        search: Default::default(),
    };
    match config {
        Some(c) => plan_fixed(&req, &ParallelConfig::parse(c)?),
        None => plan_auto(&req),
    }
}

#[test]
fn long_sequences_chunk_the_loss_for_a_lower_peak_and_a_faster_step() {
    let seq = 96 * 1024;
    let p = plan(seq, None).expect("96K tokens fit one H100");
    let rows = p.loss_chunk_rows.expect("the search chunks logits that dominate the memory");
    // (The config names the tiled MLP after it: at 96K tokens on one GPU the MLP tiles too.)
    assert!(p.config.contains(&format!("loss=chunk{rows}")), "{}", p.config);
    // One chunk's f32 logits are at most 1/32 of the budget, the largest power of two rows
    // that are: 4,096 rows of 128,256 classes (2.1 GB) under an H100's 84.4 GB.
    let chunk = |r: u64| (r * VOCAB * 4) as f64;
    let budget = p.memory_budget_bytes as f64;
    assert!(rows.is_power_of_two(), "{rows}");
    assert!(
        chunk(rows as u64) <= CHUNK_SHARE * budget && chunk(2 * rows as u64) > CHUNK_SHARE * budget
    );
    assert!(p.strategies.iter().any(|s| s.op == "linear_cross_entropy"));
    // The whole [S, V] logits (25 GB in bf16, kept to the backward beside their gradient)
    // fit only by recomputing every block: the chunked plan keeps more and steps faster.
    let whole = plan(seq, Some("dp1 loss=whole")).unwrap();
    assert!(whole.strategies.iter().all(|s| s.op != "linear_cross_entropy"));
    assert!(
        p.predicted.step_time_s < whole.predicted.step_time_s,
        "chunked {} s vs whole {} s",
        p.predicted.step_time_s,
        whole.predicted.step_time_s
    );
    // Under the same checkpointing the chunked loss's peak is the lower.
    let full = |loss: &str| plan(seq, Some(&format!("dp1 ckpt=full {loss}"))).unwrap();
    let (cf, wf) = (full(&format!("loss=chunk{rows}")), full("loss=whole"));
    let peak = |p: &Plan| p.predicted.peak_bytes_per_device[0];
    assert!(peak(&cf) < peak(&wf), "chunked {} B vs whole {} B", peak(&cf), peak(&wf));
}

#[test]
fn short_sequences_keep_their_logits_whole_and_their_plan() {
    let auto = plan(2048, None).unwrap();
    assert_eq!(auto.loss_chunk_rows, None, "{}", auto.config);
    assert!(!auto.config.contains("loss="), "{}", auto.config);
    assert!(auto.strategies.iter().any(|s| s.op == "cross_entropy"));
    // The same plan as with the logits pinned whole.
    let whole = plan(2048, Some(&format!("{} loss=whole", auto.config))).unwrap();
    assert_eq!(whole.predicted.peak_bytes_per_device, auto.predicted.peak_bytes_per_device);
    assert_eq!(whole.predicted.step_time_s, auto.predicted.step_time_s);
}

#[test]
fn a_pinned_chunk_is_the_plans_and_the_fused_graph_is_the_pairs_shape() {
    let p = plan(4096, Some("dp1 loss=chunk1000")).unwrap();
    assert_eq!(p.loss_chunk_rows, Some(1000));
    assert_eq!(p.config, "dp1 tp1 loss=chunk1000");
    // The rewrite: the head's matmul and the loss become one op with the loss's outputs.
    let cfg = ModelConfig::resolve("llama-tiny").unwrap();
    let m = build(&cfg, &BuildOptions::new(2, 16, DType::F32)).unwrap();
    let fwd = Forward { graph: m.builder.finish(), loss: m.loss };
    let sites = loss_chunk::sites(&fwd.graph);
    assert_eq!(sites.len(), 1);
    assert_eq!((sites[0].rows, sites[0].classes), (32, 256));
    let fused = loss_chunk::fuse(&fwd, 8).unwrap();
    assert_eq!(fused.graph.nodes.len(), fwd.graph.nodes.len() - 1);
    assert_eq!(fused.graph.meta(fused.loss), fwd.graph.meta(fwd.loss));
    let count = |g: &tessera_ir::Graph, f: &dyn Fn(&Op) -> bool| {
        g.nodes.iter().filter(|n| f(&n.op)).count()
    };
    assert_eq!(count(&fused.graph, &|o| matches!(o, Op::CrossEntropy { .. })), 0);
    assert_eq!(
        count(&fused.graph, &|o| matches!(o, Op::LinearCrossEntropy { chunk_rows: 8, .. })),
        1
    );
    assert!(loss_chunk::sites(&fused.graph).is_empty());
}

#[test]
fn a_chunked_loss_for_a_model_without_a_head_to_fuse_is_refused_by_name() {
    let cfg = ModelConfig::resolve("vit-tiny").unwrap();
    let b = move |mb: usize| -> tessera_plan::Result<Forward> {
        let m = build(&cfg, &BuildOptions::new(mb, 1, DType::F32))
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    };
    let req = Request {
        build: &b,
        model: "vit-tiny".into(),
        batch: 4,
        seq: 1,
        dtype: DType::F32,
        budget: 1 << 34,
        cluster: Cluster::parse("1xcpu").unwrap(),
        train: TrainConfig::default(),
        model_flops: 1e9,
        ckpt: CkptSearch::Joint,
        pipeline: Default::default(),
        search: Default::default(),
    };
    let err = plan_fixed(&req, &ParallelConfig::parse("dp1 loss=chunk8").unwrap()).unwrap_err();
    assert!(err.to_string().contains("no such pair: drop loss="), "{err}");
    // Whole is what it runs anyway.
    let p = plan_fixed(&req, &ParallelConfig::parse("dp1 loss=whole").unwrap()).unwrap();
    assert_eq!(p.loss_chunk_rows, None);
}

/// Every `scripts/bench-plan.sh` row (model, cluster, batch × seq, budget; bf16) keeps its
/// logits whole: the choice leaves the benchmark's plans exactly as they were.
#[test]
fn bench_plan_rows_keep_their_logits_whole() {
    let script = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench-plan.sh"),
    )
    .unwrap();
    let rows: Vec<Vec<&str>> = script
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('"') && l.ends_with('"'))
        .map(|l| l.trim_matches('"').split_whitespace().collect())
        .collect();
    assert!(rows.len() >= 20, "{} rows read from bench-plan.sh", rows.len());
    for row in rows {
        let (model, cluster) = (row[0], Cluster::parse(row[1]).unwrap());
        let (batch, seq): (usize, usize) = (row[2].parse().unwrap(), row[3].parse().unwrap());
        let budget = match row.get(4) {
            Some(b) => tessera_plan::units::parse_bytes(b).unwrap(),
            None => cluster.device.usable_bytes(),
        };
        let cfg = ModelConfig::resolve(model).unwrap();
        let b = move |mb: usize| -> tessera_plan::Result<Forward> {
            let m = build(&cfg, &BuildOptions::new(mb, seq, DType::BF16))
                .map_err(|e| PlanError::Invalid(e.to_string()))?;
            Ok(Forward { graph: m.builder.finish(), loss: m.loss })
        };
        // Not vacuous: every row's model has a head and loss the rewrite would fuse.
        assert_eq!(loss_chunk::sites(&b(batch).unwrap().graph).len(), 1, "{row:?}");
        let p = loss_chunk::Problem { build: &b, batch, devices: cluster.num_devices(), budget };
        assert_eq!(loss_chunk::choose(p).unwrap(), None, "{row:?}");
    }
}
