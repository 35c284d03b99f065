//! The inter-op pass (issue 18): the automatic search re-cuts a pipeline's stages — unequal
//! block counts, each stage with its own checkpointing — when that is faster than even stages
//! or fits where they do not, and the config string it reports (`stages=`) reproduces the plan
//! when given back with `--plan`.

use tessera_ir::{DType, TrainConfig};
use tessera_models::{build, BuildOptions, LlamaConfig, ModelConfig};
use tessera_plan::config::ParallelConfig;
use tessera_plan::planner::{plan_auto, plan_fixed, Request};
use tessera_plan::search::{CkptSearch, Forward};
use tessera_plan::{Cluster, PlanError};

/// llama-tiny with a `vocab`-token head: at 6144 tokens the head and loss cost about two
/// blocks, so the last of even stages is the slowest.
fn heavy_head(vocab: usize) -> ModelConfig {
    let ModelConfig::Llama(c) = ModelConfig::preset("llama-tiny").unwrap() else { unreachable!() };
    let mut p = c.into_params();
    p.vocab_size = vocab;
    ModelConfig::Llama(LlamaConfig::new(p).unwrap())
}

/// The forward graph of `cfg` (no dropout) at a micro-batch of `mb` sequences of 32.
fn builder(cfg: ModelConfig) -> impl Fn(usize) -> tessera_plan::Result<Forward> + Sync {
    let cfg = cfg.without_dropout();
    move |mb: usize| {
        let m = build(&cfg, &BuildOptions::new(mb, 32, DType::F32))
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    }
}

/// Four machines of one CPU each on a slow link, where pipelines beat data parallelism.
fn slow_cluster() -> Cluster {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("balance-{}-{n}.toml", std::process::id()));
    std::fs::write(
        &path,
        "nodes = 4\ngpus_per_node = 1\ndevice = \"cpu\"\n[inter]\nlatency_s = 1e-4\nbandwidth = 2e7\n",
    )
    .unwrap();
    let c = Cluster::from_file(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    c
}

fn request<'a>(
    b: &'a (dyn Fn(usize) -> tessera_plan::Result<Forward> + Sync),
    budget: u64,
) -> Request<'a> {
    Request {
        build: b,
        model: "llama-tiny-heavy-head".into(),
        batch: 8,
        seq: 32,
        dtype: DType::F32,
        budget,
        cluster: slow_cluster(),
        train: TrainConfig::default(),
        model_flops: 1e12,
        ckpt: CkptSearch::default(),
        pipeline: Default::default(),
        search: Default::default(),
    }
}

#[test]
fn the_search_recuts_stages_around_a_heavy_head_and_the_config_reproduces_it() {
    let b = builder(heavy_head(6144));
    let req = request(&b, u64::MAX);
    let auto = plan_auto(&req).unwrap();
    let config = ParallelConfig::parse(&auto.config).unwrap();
    assert!(config.pp >= 2, "a pipeline wins on a slow link: {}", auto.config);
    assert!(
        !config.stages.is_empty(),
        "even stages leave the head's stage slowest: {}",
        auto.config
    );
    let pipe = auto.pipeline.as_ref().unwrap();
    let sizes = pipe.sizes();
    assert!(sizes.last() < sizes.first(), "the head's stage runs fewer blocks: {sizes:?}");
    assert_eq!(sizes.iter().sum::<usize>(), 8);
    // The same shape with even stages, lowered exactly: slower (the pass keeps a re-cut only
    // when it is faster).
    let even = config.clone().with_stages(Vec::new());
    let even = plan_fixed(&req, &even).unwrap();
    assert!(
        auto.predicted.step_time_s < even.predicted.step_time_s,
        "re-cut {} s vs even {} s",
        auto.predicted.step_time_s,
        even.predicted.step_time_s
    );
    // The Megatron baseline is a configuration Megatron runs: even stages, no slower than the
    // re-cut plan.
    let megatron = auto.baselines.megatron.as_ref().expect("a Megatron baseline");
    assert!(!megatron.config.contains("stages="), "{}", megatron.config);
    assert!(megatron.step_time_s >= auto.predicted.step_time_s, "{megatron:?}");
    // The config string is the plan: given back, it lowers to the same figures.
    let again = plan_fixed(&req, &config).unwrap();
    assert_eq!(again.config, auto.config);
    assert_eq!(again.predicted.step_time_s, auto.predicted.step_time_s);
    assert_eq!(again.predicted.peak_bytes_per_device, auto.predicted.peak_bytes_per_device);
    assert_eq!(again.pipeline.as_ref().unwrap().sizes(), sizes);
}

#[test]
fn a_recut_fits_where_even_stages_do_not() {
    let b = builder(heavy_head(6144));
    // Even stages put the embedding's and the head's state (and, under 1F1B, the most
    // micro-batches in flight) on the first and last devices, which then need over 60 MB.
    let budget = 60_000_000;
    let req = request(&b, budget);
    let auto = plan_auto(&req).unwrap();
    let config = ParallelConfig::parse(&auto.config).unwrap();
    assert!(config.pp >= 2 && !config.stages.is_empty(), "{}", auto.config);
    assert!(auto.predicted.peak_bytes_per_device.iter().all(|&p| p <= budget), "{auto:?}");
    let even = config.clone().with_stages(Vec::new());
    match plan_fixed(&req, &even) {
        Err(PlanError::Infeasible { needed, .. }) => assert!(needed > budget),
        other => panic!("`{even}` with even stages fits or fails otherwise: {other:?}"),
    }
    // Cheaper than any plan without a pipeline on this link (which does fit, far slower).
    let flat = plan_fixed(&req, &ParallelConfig::parse("tp4 sp").unwrap()).unwrap();
    assert!(auto.predicted.step_time_s < flat.predicted.step_time_s);
}

/// The pipeline phase runs first where the model state fills the budget
/// (`PipelineKnobs::first_over_state_share`), and then bounds one flat round; otherwise it runs
/// between two flat rounds. The order only decides which bound prunes which phase: both orders
/// find the same plan, with the same figures, whether a pipeline or a flat plan wins.
#[test]
fn either_phase_order_finds_the_same_plan() {
    let b = builder(heavy_head(6144));
    for budget in [u64::MAX, 60_000_000] {
        let plan_with = |share: f64| {
            let mut req = request(&b, budget);
            req.pipeline.first_over_state_share = share;
            plan_auto(&req).unwrap()
        };
        let (first, between) = (plan_with(0.0), plan_with(f64::INFINITY));
        assert_eq!(first.config, between.config, "budget {budget}");
        assert_eq!(first.predicted.step_time_s, between.predicted.step_time_s);
        assert_eq!(first.predicted.peak_bytes_per_device, between.predicted.peak_bytes_per_device);
        // The Megatron baseline too (how many configurations each order tried differs).
        let key = |p: &tessera_plan::plan::Plan| {
            let m = p.baselines.megatron.as_ref();
            m.map(|m| (m.config.clone(), m.step_time_s, m.peak_bytes_per_device.clone()))
        };
        assert_eq!(key(&first), key(&between), "budget {budget}");
    }
    // A flat plan winning: a fast link, where pipelines only add bubbles.
    let cfg = ModelConfig::preset("llama-tiny").unwrap();
    let b = builder(cfg);
    let plan_with = |share: f64| {
        let mut req = request(&b, u64::MAX);
        req.cluster = Cluster::parse("4xH100").unwrap();
        req.pipeline.first_over_state_share = share;
        plan_auto(&req).unwrap()
    };
    let (first, between) = (plan_with(0.0), plan_with(f64::INFINITY));
    assert!(first.pipeline.is_none(), "{}", first.config);
    assert_eq!(first.config, between.config);
    assert_eq!(first.predicted.step_time_s, between.predicted.step_time_s);
}
