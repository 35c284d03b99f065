//! The search on small cases whose right answer is known: data parallel when the batch is large
//! and weights small, Megatron column→row tensor parallel when the batch is 1 and weights are
//! large, sequence-parallel norms under tensor parallelism, and the clear errors.

use tessera_ir::{DType, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::config::ParallelConfig;
use tessera_plan::plan::Plan;
use tessera_plan::planner::{plan_auto, plan_fixed, Request};
use tessera_plan::search::Forward;
use tessera_plan::{Cluster, PlanError};

fn llama(hidden: usize, inter: usize, heads: usize) -> ModelConfig {
    let json = format!(
        r#"{{"model_type": "llama", "hidden_size": {hidden}, "intermediate_size": {inter},
            "num_hidden_layers": 2, "num_attention_heads": {heads}, "num_key_value_heads": {heads},
            "vocab_size": 1024, "max_position_embeddings": 65536, "rms_norm_eps": 1e-5}}"#
    );
    ModelConfig::from_hf_json(&json).unwrap()
}

fn plan_with(
    cfg: &ModelConfig,
    cluster: &str,
    batch: usize,
    seq: usize,
    budget: Option<u64>,
    fixed: Option<&str>,
) -> Result<Plan, PlanError> {
    let cfg = cfg.clone();
    let b = move |mb: usize| -> tessera_plan::Result<Forward> {
        let m = build(&cfg, &BuildOptions::new(mb, seq, DType::BF16))
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    };
    let cluster = Cluster::parse(cluster).unwrap();
    let req = Request {
        build: &b,
        model: "test".into(),
        batch,
        seq,
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

fn strategy<'a>(p: &'a Plan, scope_suffix: &str, op: &str) -> &'a tessera_plan::plan::NodeStrategy {
    p.strategies
        .iter()
        .find(|s| s.scope.ends_with(scope_suffix) && s.op == op)
        .unwrap_or_else(|| panic!("no {op} at {scope_suffix}"))
}

#[test]
fn large_batch_small_weights_plans_data_parallel() {
    let cfg = ModelConfig::preset("gpt2-tiny").unwrap().without_dropout();
    let p = plan_with(&cfg, "4xH100", 64, 128, None, None).unwrap();
    assert_eq!(p.config.split(' ').next(), Some("dp4"), "{}", p.config);
    // Every matmul splits its rows over all four devices and keeps its weight whole.
    let fc = strategy(&p, "mlp.c_fc", "matmul");
    assert_eq!(fc.inputs[1], "[R, R]", "{fc:?}");
    assert!(p.collectives.iter().any(|c| c.op == "all_reduce" && c.phase == "optimizer"));
}

#[test]
fn batch_one_large_weights_plans_megatron_column_then_row() {
    let cfg = llama(4096, 16384, 32);
    // Replicated weights (~4.8 GiB of bf16 state per layer) do not fit 3 GiB.
    let p = plan_with(&cfg, "4xH100", 1, 64, Some(3 << 30), None).unwrap();
    // HF layout: weights are [out, in]. Column parallel splits `out`; row parallel splits `in`
    // and leaves a pending sum that an all-reduce completes.
    let up = strategy(&p, "layers.0.mlp.up_proj", "matmul");
    let down = strategy(&p, "layers.0.mlp.down_proj", "matmul");
    assert!(up.inputs[1].starts_with("[S"), "up_proj weight {up:?}");
    assert!(down.inputs[1].starts_with("[R, S"), "down_proj weight {down:?}");
    assert!(down.outputs[0].contains('P'), "down_proj output is a pending sum: {down:?}");
    assert!(p.collectives.iter().any(|c| c.op == "all_reduce" && c.phase == "forward"));
    assert!(p.predicted.peak_bytes_per_device[0] <= 3 << 30);
}

#[test]
fn long_sequences_under_tensor_parallelism_shard_norms_along_the_sequence() {
    let cfg = llama(1024, 4096, 16);
    let p = plan_with(&cfg, "4xH100", 1, 16384, None, Some("dp1 tp4 sp")).unwrap();
    let norm = strategy(&p, "layers.1.post_attention_layernorm", "rms_norm");
    assert!(norm.inputs[0].starts_with("[R, S"), "norm input {norm:?}");
    // Leaving and entering the sequence-split region moves activations between layouts (the
    // cost model prices all-to-all, or reduce-scatter + all-gather, whichever is cheaper).
    assert!(p.collectives.iter().any(|c| c.phase == "forward" && c.op != "all_reduce"));
}

/// Attention declares the scores of at most `ATTENTION_SCRATCH_ROWS` query rows as workspace,
/// not one head's S×T block: at 256K tokens that block alone would be 256 GiB per device
/// whatever the split; the bound is 4 GiB and a plan fits 8 H100s.
#[test]
fn a_quarter_million_tokens_fit_without_an_s_by_t_attention_workspace() {
    let cfg = llama(1024, 4096, 16);
    let seq = 262_144;
    let p = plan_with(&cfg, "8xH100", 1, seq, None, None).unwrap();
    let peak = p.predicted.peak_bytes_per_device[0];
    let block = (seq * seq * 4) as u64;
    assert!(peak < block / 8, "peak {peak} bytes: the S×T block {block} is still charged");
    let bound = (tessera_ir::ATTENTION_SCRATCH_ROWS * seq * 4) as u64;
    assert!(peak >= bound, "peak {peak} below the attention workspace {bound} it must hold");
}

#[test]
fn predicted_peak_is_the_simulation_of_the_lowered_program_and_zero_shrinks_it() {
    let cfg = ModelConfig::preset("gpt2-tiny").unwrap().without_dropout();
    let mut peaks = Vec::new();
    for z in 0..=3 {
        let p = plan_with(&cfg, "4xH100", 16, 64, None, Some(&format!("dp4 zero{z}"))).unwrap();
        assert_eq!(p.zero_stage, z);
        peaks.push((p.predicted.peak_bytes_per_device[0], p.predicted.optimizer_bytes));
    }
    // Optimizer state is split four ways from ZeRO-1 on; peaks never grow with the stage.
    assert!(peaks[1].1 * 3 < peaks[0].1, "{peaks:?}");
    assert!(peaks.windows(2).all(|w| w[1].0 <= w[0].0), "{peaks:?}");
}

#[test]
fn bad_inputs_give_clear_errors() {
    let cfg = ModelConfig::preset("gpt2-tiny").unwrap();
    let e = plan_with(&cfg, "4xH100", 8, 64, None, Some("dp2 tp4")).unwrap_err().to_string();
    assert!(e.contains("8") && e.contains("4"), "{e}");
    let e = plan_with(&cfg, "4xH100", 6, 64, None, Some("dp4")).unwrap_err().to_string();
    assert!(e.contains("batch 6"), "{e}");
    // 1 MiB fits once everything but a layer's working set rests on the host (ZeRO-3 +
    // offload=all, full recompute); 1 KiB holds not even one micro-batch's activations.
    let p = plan_with(&cfg, "4xH100", 8, 64, Some(1 << 20), None).unwrap();
    assert!(p.config.contains("offload=all"), "{}", p.config);
    let e = plan_with(&cfg, "4xH100", 8, 64, Some(1 << 10), None).unwrap_err();
    match e {
        PlanError::Infeasible { needed, budget, .. } => assert!(needed > budget),
        other => panic!("expected an infeasible error, got {other}"),
    }
    let e = plan_with(&cfg, "4xH100", 8, 64, Some(1 << 20), Some("dp4")).unwrap_err().to_string();
    assert!(e.contains("least any plan needs"), "{e}");
}

#[test]
fn reshards_in_lowered_programs_carry_collectives_of_the_plan() {
    let cfg = ModelConfig::preset("gpt2-tiny").unwrap().without_dropout();
    let p = plan_with(&cfg, "4xH100", 8, 64, None, Some("dp2 tp2")).unwrap();
    assert_eq!(p.mesh.shape, vec![2, 2]);
    assert!(p.collectives.iter().all(|c| c.group == 2 && c.bytes > 0));
}

/// The automatic search prunes with the fastest fit found so far (branch and bound) and runs
/// ZeRO-3 first; none of that may lose a plan: under a budget that forces checkpointing, no
/// fixed configuration — each searched on its own, with nothing to prune against — is faster.
#[test]
fn pruned_search_is_no_slower_than_any_fixed_configuration_under_a_tight_budget() {
    let cfg = llama(512, 1408, 8);
    let (batch, seq) = (8, 512);
    let free = plan_with(&cfg, "4xRTX3060", batch, seq, None, None).unwrap();
    let budget = (free.predicted.peak_bytes_per_device[0] as f64 * 0.6) as u64;
    let auto = plan_with(&cfg, "4xRTX3060", batch, seq, Some(budget), None).unwrap();
    assert!(auto.predicted.peak_bytes_per_device[0] <= budget);
    assert!(auto.predicted.recompute_s > 0.0, "the budget must force recomputation");
    let mut fitting = 0;
    for (dp, tp) in [(4, 1), (2, 2), (1, 4)] {
        for zero in 0..=3 {
            for mb in [1, 2] {
                for ckpt in ["", " ckpt=selective", " ckpt=full"] {
                    let c = format!("dp{dp} tp{tp} zero{zero} mb{mb}{ckpt}");
                    let Ok(fixed) =
                        plan_with(&cfg, "4xRTX3060", batch, seq, Some(budget), Some(&c))
                    else {
                        continue;
                    };
                    fitting += 1;
                    let (a, f) = (auto.predicted.step_time_s, fixed.predicted.step_time_s);
                    assert!(
                        a <= f * (1.0 + 1e-9),
                        "auto {} ({a} s) slower than `{c}` ({f} s)",
                        auto.config
                    );
                }
            }
        }
    }
    assert!(
        fitting >= 4,
        "only {fitting} fixed configurations fit: the budget is too tight to test"
    );
}
