//! The planner's choice of the tiled MLP (`crate::mlp_tile`): llama3-8b at 512K tokens over
//! 8 H100s (`dp1 cp8 zero3 ckpt=full`, torchtitan's long-context layout) is planned with its
//! MLPs tiled, with a lower peak than the whole MLPs (`mlp=whole`); no `scripts/bench-plan.sh`
//! row nor published run tiles (their plans stay as they were); the rewrite fuses one MLP per
//! block of Llama and GPT-2 and refuses a pinned tiling where there is none.

use tessera_ir::{DType, Op, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::config::ParallelConfig;
use tessera_plan::mlp_tile::{self, Problem, TILE_SHARE};
use tessera_plan::plan::Plan;
use tessera_plan::planner::{plan_fixed, Request};
use tessera_plan::search::{CkptSearch, Forward};
use tessera_plan::{Cluster, PlanError};

type Builder = Box<dyn Fn(usize) -> tessera_plan::Result<Forward> + Sync>;

fn builder(model: &str, seq: usize, dtype: DType) -> Builder {
    let cfg = ModelConfig::resolve(model).unwrap();
    Box::new(move |mb: usize| {
        let m = build(&cfg, &BuildOptions::new(mb, seq, dtype))
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    })
}

fn plan(seq: usize, config: &str) -> Result<Plan, PlanError> {
    plan_on(seq, config, true)
}

/// `plan` for a runtime with (`tiled_mlp`) or without the tiled MLP's kernel.
fn plan_on(seq: usize, config: &str, tiled_mlp: bool) -> Result<Plan, PlanError> {
    let b = builder("llama3-8b", seq, DType::BF16);
    let cluster = Cluster::parse("8xH100").unwrap().with_host_memory(0);
    let req = Request {
        build: &*b,
        model: "llama3-8b".into(),
        batch: 1,
        seq,
        dtype: DType::BF16,
        budget: cluster.device.usable_bytes(),
        cluster,
        train: TrainConfig::default(),
        model_flops: 1e12,
        ckpt: CkptSearch::Joint,
        pipeline: Default::default(),
        search: tessera_plan::search::SearchKnobs { tiled_mlp, ..Default::default() },
    };
    plan_fixed(&req, &ParallelConfig::parse(config)?)
}

/// The predicted peak of a config: its plan's, or, where none fits, what its most frugal
/// layout needs (the refusal's figure).
fn peak(seq: usize, config: &str) -> u64 {
    match plan(seq, config) {
        Ok(p) => p.predicted.peak_bytes_per_device[0],
        Err(PlanError::Infeasible { needed, .. }) => needed,
        Err(e) => panic!("{config}: {e}"),
    }
}

#[test]
fn a_long_sequence_tiles_the_mlp_for_a_lower_peak() {
    let (seq, base) = (512 * 1024, "dp1 cp8 zero3");
    let tiled = plan(seq, base).expect("512K tokens fit 8 H100s");
    let rows = tiled.mlp_tile_rows.expect("the planner tiles MLPs that matter for the peak");
    assert!(tiled.config.ends_with(&format!("mlp=tile{rows}")), "{}", tiled.config);
    // A tile's whole-ffn bf16 intermediate is at most 1/256 of the budget, the largest power
    // of two rows that is: 8,192 rows of 14,336 features (235 MB) under an H100's 84.4 GB.
    let tile = |r: u64| (r * 14_336 * 2) as f64;
    let budget = tiled.memory_budget_bytes as f64;
    assert!(rows.is_power_of_two(), "{rows}");
    assert!(
        tile(rows as u64) <= TILE_SHARE * budget && tile(2 * rows as u64) > TILE_SHARE * budget
    );
    assert!(tiled.strategies.iter().any(|s| s.op == "tiled_mlp"));
    let whole = plan(seq, &format!("{base} mlp=whole")).unwrap();
    assert_eq!(whole.mlp_tile_rows, None);
    assert!(whole.strategies.iter().all(|s| s.op != "tiled_mlp"));
    // Both fill the budget recomputing blocks; the tiled plan's step is no slower (its blocks
    // are cheaper to keep), though each MLP's forward runs once more.
    assert!(
        tiled.predicted.step_time_s <= whole.predicted.step_time_s,
        "tiled {} s vs whole {} s",
        tiled.predicted.step_time_s,
        whole.predicted.step_time_s
    );
    // Under the same checkpointing the tiled MLPs' peak is far lower: kept blocks save their
    // MLP's [S/8, ffn] intermediates (1.9 GB each per device) whole, not at all tiled. At
    // 512K neither fits there; the figures are what each config's most frugal layout needs.
    let one = (seq / 8 * 14_336 * 2) as u64;
    for ckpt in ["ckpt=selective", "ckpt=none"] {
        let t = peak(seq, &format!("{base} {ckpt} mlp=tile{rows}"));
        let w = peak(seq, &format!("{base} {ckpt} mlp=whole"));
        assert!(t + 32 * one <= w, "{ckpt}: tiled {t} B vs whole {w} B");
    }
}

/// Every `scripts/bench-plan.sh` row and every published run (`scripts/published-runs*.tsv`)
/// keeps its MLPs whole: the choice leaves their plans exactly as they were.
#[test]
fn bench_rows_and_published_runs_keep_their_mlps_whole() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts");
    let read = |f: &str| std::fs::read_to_string(root.join(f)).unwrap();
    let mut rows: Vec<(String, String, usize, Option<String>)> = Vec::new();
    for l in read("bench-plan.sh").lines().map(str::trim) {
        if l.starts_with('"') && l.ends_with('"') {
            let f: Vec<&str> = l.trim_matches('"').split_whitespace().collect();
            rows.push((
                f[0].into(),
                f[1].into(),
                f[3].parse().unwrap(),
                f.get(4).map(|s| s.to_string()),
            ));
        }
    }
    assert!(rows.len() >= 20, "{} rows read from bench-plan.sh", rows.len());
    for tsv in ["published-runs.tsv", "published-runs-outside.tsv"] {
        for l in read(tsv).lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
            let f: Vec<&str> = l.split('\t').collect();
            // A model is a preset or a config.json path from the repository's root.
            let model = match ModelConfig::preset(f[1]) {
                Ok(_) => f[1].to_string(),
                Err(_) => root.join("..").join(f[1]).to_string_lossy().into_owned(),
            };
            rows.push((model, f[2].into(), f[4].parse().unwrap(), None));
        }
    }
    let mut long = 0;
    for (model, cluster, seq, budget) in rows {
        let cluster = Cluster::parse(&cluster).unwrap();
        let budget = match budget {
            Some(b) => tessera_plan::units::parse_bytes(&b).unwrap(),
            None => cluster.device.usable_bytes(),
        };
        let b = builder(&model, seq, DType::BF16);
        // Not vacuous: every dense model has MLPs the rewrite would tile (a mixture of experts
        // has expert MLPs, which it does not tile).
        if mlp_tile::sites(&b(1).unwrap().graph).is_empty() {
            assert!(ModelConfig::resolve(&model).unwrap().is_moe(), "{model} has no MLP to tile");
            continue;
        }
        let node_devices = cluster.num_devices().min(cluster.gpus_per_node);
        let p = Problem { build: &*b, node_devices, budget, runnable: true };
        assert_eq!(mlp_tile::choose(p).unwrap(), None, "{model} {seq}");
        long += usize::from(seq >= 131_072);
    }
    assert!(long >= 2, "the published runs reach 128K tokens");
}

#[test]
fn the_rewrite_fuses_one_mlp_per_block_and_a_pinned_tile_needs_one() {
    for (model, gated) in [("llama-tiny", true), ("gpt2-tiny", false)] {
        let fwd = builder(model, 16, DType::F32)(2).unwrap();
        let blocks = fwd.graph.nodes.iter().filter_map(|n| n.block).max().unwrap() + 1;
        let sites = mlp_tile::sites(&fwd.graph);
        assert_eq!(sites.len(), blocks as usize, "{model}");
        assert!(sites.iter().all(|s| s.spec.gated == gated && s.rows == 32), "{model}");
        let fused = mlp_tile::fuse(&fwd, 8).unwrap();
        let removed = if gated { 4 } else { 3 };
        assert_eq!(fused.graph.nodes.len(), fwd.graph.nodes.len() - removed * sites.len());
        assert_eq!(fused.graph.meta(fused.loss), fwd.graph.meta(fwd.loss));
        let tiled = fused
            .graph
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::TiledMlp(s) if s.chunk_rows == 8));
        assert_eq!(tiled.count(), sites.len(), "{model}");
        assert!(mlp_tile::sites(&fused.graph).is_empty());
    }
    let b = builder("vit-tiny", 1, DType::F32);
    let p = Problem { build: &*b, node_devices: 1, budget: 1 << 34, runnable: true };
    let pinned = Some(tessera_plan::config::MlpMode::Tile(8));
    let err = mlp_tile::resolve(p, pinned).unwrap_err();
    assert!(err.to_string().contains("no such MLP: drop mlp="), "{err}");
}

/// A runtime without the fused op's kernel (the CUDA backend, `tessera train --device cuda`):
/// the same request keeps its MLPs whole, and a written `mlp=tileN` is refused naming the fix.
#[test]
fn a_runtime_without_the_kernel_keeps_mlps_whole() {
    let (seq, base) = (512 * 1024, "dp1 cp8 zero3");
    let whole = plan_on(seq, base, false).expect("512K tokens fit 8 H100s untiled");
    assert_eq!(whole.mlp_tile_rows, None);
    assert!(whole.strategies.iter().all(|s| s.op != "tiled_mlp"));
    let err = plan_on(seq, &format!("{base} mlp=tile4096"), false).unwrap_err().to_string();
    assert!(err.contains("mlp=whole") && err.contains("CUDA"), "{err}");
}
