//! The planner's entry points: the automatic search, a fixed configuration, a plan file, and
//! the Megatron-LM baseline — all priced by the same cost model on lowered Programs.
//!
//! Search space of `auto`: meshes `[N]` and `[N/t, t]` for every tensor-axis size `t` that
//! divides a node (so the inner axis stays on the fast link; meshes equal up to axis order,
//! like `[2, 4]` and `[4, 2]` inside one node, are searched once), each with the free per-op
//! ILP, plus every Megatron-style configuration (the ILP constrained to `dp` on the batch).
//! Per mesh, ZeRO stages, each at the smallest micro-batch count that fits (more
//! micro-batches only add per-kernel overhead and ZeRO-3 gathers); see [`rounds::run_job`] for
//! which stages can win. Jobs (one mesh or Megatron `dp × tp × sp` each) run on all cores,
//! ZeRO-3 for every job first: it is the stage most likely to fit, and the fastest of those
//! fits then bounds the rest of the search (branch and bound, see [`search::evaluate`]); the
//! pipeline phase runs between the two rounds, or first where memory binds
//! ([`plan_auto`]). The bound is fixed between phases, so the plan does not depend on thread
//! timing. The Megatron results
//! double as the `--baseline megatron` answer. When nothing fits, the error names the least
//! peak any candidate of the search reaches ([`search::LeastPeak`]): a budget of exactly that
//! finds a plan; under one byte less the error reports it again.

mod loss;
mod mlp;
mod offload;
mod pinned;
pub mod pipelined;
mod rounds;

pub use loss::with_loss;
pub use mlp::with_mlp;
pub use pinned::plan_config;

pub(crate) use rounds::parallel_map;
use rounds::{
    auto_jobs, first_round, megatron_jobs, one_round, run_jobs, second_round, Job, JobResult,
};

use crate::config::ParallelConfig;
use crate::mesh::AxisName;
use crate::plan::{BaselineJson, Plan, PlanContext};
use crate::search::{self, AxisRule, Candidate, CkptSearch, Evaluated, Forward, LeastPeak, Search};
use crate::{Cluster, Mesh, PlanError, Result};
use std::time::Instant;
use tessera_ir::{DType, TrainConfig};

pub struct Request<'a> {
    /// Builds the global forward graph for a micro-batch size.
    pub build: &'a (dyn Fn(usize) -> Result<Forward> + Sync),
    pub model: String,
    pub batch: usize,
    pub seq: usize,
    pub dtype: DType,
    pub cluster: Cluster,
    /// Per-device memory budget, bytes.
    pub budget: u64,
    pub train: TrainConfig,
    /// Matmul FLOPs of one global step (for MFU).
    pub model_flops: f64,
    /// Activation checkpointing: searched jointly (default), fixed, or off.
    pub ckpt: CkptSearch,
    /// The automatic search's pipeline phase.
    pub pipeline: crate::pipeline::search::PipelineKnobs,
    /// The phases without a pipeline.
    pub search: search::SearchKnobs,
}

impl Request<'_> {
    pub(crate) fn problem(&self) -> Search<'_> {
        Search::new(search::SearchProblem {
            build: self.build,
            batch: self.batch,
            cost: crate::cost::CostModel::for_cluster(&self.cluster)
                .with_moe_imbalance(self.search.moe_imbalance),
            train: self.train.clone(),
            knobs: self.search.clone(),
            ckpt: self.ckpt.clone(),
        })
    }

    fn context<'g>(&self, forward: &'g tessera_ir::Graph) -> PlanContext<'g> {
        PlanContext {
            model: self.model.clone(),
            cluster: self.cluster.to_string(),
            batch: self.batch,
            seq: self.seq,
            dtype: self.dtype.to_string(),
            budget: self.budget,
            host_memory_bytes: self.cluster.host.memory_bytes,
            model_flops: self.model_flops,
            peak_flops: self.cluster.device.peak_flops(self.dtype),
            forward,
        }
    }

    pub(crate) fn to_plan(&self, e: &Evaluated, source: &str, ms: f64) -> Result<Plan> {
        if !e.lowered.exact {
            return Err(PlanError::Internal(
                "a plan was made from priced figures, not its own Program's; lower it with \
                 `search::exactly` first"
                    .into(),
            ));
        }
        let fwd = (self.build)(self.batch / e.candidate.micro_batches.max(1))?;
        Ok(Plan::from_evaluated(&self.context(&fwd.graph), e, source, ms))
    }

    fn micro_batch_options(&self) -> Vec<usize> {
        (0..8)
            .map(|k| 1usize << k)
            .filter(|&m| m <= self.batch && self.batch.is_multiple_of(m))
            .collect()
    }
}

/// A config's mesh, its axes' ([`crate::axis::stage_mesh`]): `[dp, tp]`, `[dp, cp, tp]` with
/// context parallelism, or with hybrid sharding (`shard=N`) `[dp/N, N, tp]`, the first axis
/// holding the replicas; the tensor axis is always the last.
fn megatron_mesh(cluster: &Cluster, cfg: &ParallelConfig) -> Result<Mesh> {
    cfg.check_devices(cluster.num_devices())?;
    let (shape, names) = crate::axis::stage_mesh(cfg);
    let replicas: Vec<usize> =
        (0..names.len()).filter(|&a| names[a] == AxisName::Replica).collect();
    let ring = cfg.cp > 1 && cfg.cp_comm == Some(crate::context::CpComm::Ring);
    let mesh = Mesh::named(cluster, &shape, &names)?.with_ring(ring);
    Ok(if replicas.is_empty() { mesh } else { mesh.with_replicas(&replicas) })
}

/// Evaluates a fixed configuration (the best plan within it): every knob as `cfg` holds it,
/// checkpointing searched per block when `cfg.ckpt` is `None`. A config string's unwritten
/// knobs are searched by [`plan_config`]. The loss runs as `loss=` says, or as
/// [`crate::loss_chunk::choose`] decides when the config does not say; the plan's config
/// string names a chunking it chose.
pub fn plan_fixed(req: &Request<'_>, cfg: &ParallelConfig) -> Result<Plan> {
    let rows = crate::loss_chunk::resolve(req.loss_problem(), cfg.loss)?;
    let tile = crate::mlp_tile::resolve(req.mlp_problem(), cfg.mlp)?;
    let mut plan = with_loss(req, rows, |r| with_mlp(r, tile, |r| plan_fixed_as_built(r, cfg)))?;
    if let (None, Some(rows)) = (cfg.loss, rows) {
        let chosen = cfg.clone().with_loss(Some(crate::config::LossMode::Chunk(rows)));
        plan.config = chosen.canonical();
    }
    mlp::name_choice(plan, cfg.mlp, tile)
}

/// [`plan_fixed`] on the request's forward graphs as they are built.
pub(super) fn plan_fixed_as_built(req: &Request<'_>, cfg: &ParallelConfig) -> Result<Plan> {
    if cfg.pp > 1 {
        return pipelined::plan_fixed_pipelined(req, cfg);
    }
    let t0 = Instant::now();
    let mesh = megatron_mesh(&req.cluster, cfg)?;
    if !req.batch.is_multiple_of(cfg.dp * cfg.ep * cfg.micro_batches) {
        return Err(PlanError::Invalid(format!(
            "batch {} does not split into {} data-parallel replicas × {} micro-batches: use a batch \
             that is a multiple of {}",
            req.batch,
            cfg.dp * cfg.ep,
            cfg.micro_batches,
            cfg.dp * cfg.ep * cfg.micro_batches
        )));
    }
    let mut p = req.problem();
    if let Some(m) = cfg.ckpt {
        p.problem.ckpt = CkptSearch::Uniform(m);
    }
    let cand = Candidate {
        mesh,
        rule: AxisRule::Megatron { sp: cfg.sp, cp: cfg.cp > 1 },
        zero: cfg.zero,
        micro_batches: cfg.micro_batches,
        offload: cfg.offload,
    };
    let found = search::evaluate(&p, &cand, Some(req.budget))?;
    let found = found.map(|e| crate::search::exactly(&p, &e)).transpose()?;
    match found {
        Some(e) if e.peak_bytes() > req.budget => Err(PlanError::Infeasible {
            budget: req.budget,
            needed: e.peak_bytes(),
            hint: format!("`{}` lowered exactly", cfg.canonical()),
        }),
        Some(e) => {
            crate::offload::check_tiers(&req.cluster, &e.lowered.memory, &cfg.canonical())?;
            let mut plan = req.to_plan(&e, "fixed", t0.elapsed().as_secs_f64() * 1e3)?;
            plan.config = cfg.canonical();
            Ok(plan)
        }
        // The candidate's least peak, as the search found it (`None`: it cannot be lowered).
        None => match p.state.least.lock().ok().and_then(|l| l.clone()) {
            Some(least) => Err(PlanError::Infeasible {
                budget: req.budget,
                needed: least.peak_bytes,
                hint: format!(
                    "`{}` at its most memory-frugal layout; {}",
                    cfg.canonical(),
                    // ZeRO shards over the data-parallel (and context-parallel) replicas: none
                    // to shard over, or sharded already at stage 3.
                    match cfg.dp * cfg.cp > 1 && cfg.zero < 3 {
                        true => "raise ZeRO, add micro-batches or devices",
                        false => "add micro-batches or devices",
                    }
                ),
            }),
            None => Err(search::cannot_split(&p, &cand, &cfg.canonical())),
        },
    }
}

/// Experts per MoE layer of the search's model (0: none), from its forward graph of one
/// micro-batch (the search builds that one anyway).
fn model_experts(p: &Search<'_>) -> Result<usize> {
    let shared = p.forward(p.problem.batch)?;
    Ok(crate::expert::expert_facts(&shared.0.graph).map_or(0, |f| f.experts))
}

/// The best Megatron configuration among job results, with the counts tried and fitting.
fn best_megatron(
    jobs: &[Job],
    results: &[JobResult],
) -> Option<(Evaluated, ParallelConfig, usize, usize)> {
    let (mut tried, mut fitting) = (0, 0);
    let mut best: Option<(Evaluated, ParallelConfig)> = None;
    for (job, r) in jobs.iter().zip(results) {
        let Job::Megatron { dp, tp, sp, shard, cp, ep, ring } = *job else { continue };
        tried += r.tried;
        fitting += r.fits.len();
        for e in &r.fits {
            if best.as_ref().is_none_or(|(b, _)| e.step_time_s() < b.step_time_s()) {
                let cfg = ParallelConfig::new(dp, tp)
                    .with_zero(e.candidate.zero)
                    .with_micro_batches(e.candidate.micro_batches)
                    .with_sp(sp)
                    .with_shard(shard.filter(|_| e.candidate.zero > 0))
                    .with_cp(cp)
                    .with_ep(ep)
                    .with_cp_comm(ring.then_some(crate::context::CpComm::Ring));
                best = Some((e.clone(), cfg));
            }
        }
    }
    best.map(|(e, c)| (e, c, tried, fitting))
}

/// All Megatron-LM-style configurations (dp × tp within a node, sp on/off, ZeRO stages,
/// micro-batches); returns the fastest that fits, with the counts tried and fitting.
pub fn megatron(req: &Request<'_>) -> Result<Option<(Evaluated, ParallelConfig, usize, usize)>> {
    let p = req.problem();
    let mbs = req.micro_batch_options();
    let jobs = megatron_jobs(req, model_experts(&p)?);
    let results = run_jobs(req, &p, &jobs, &mbs)?;
    Ok(best_megatron(&jobs, &results))
}

/// The fastest fitting candidate of the jobs' results (a per-op layout must beat the best
/// Megatron-style one by more than 0.1%: that one is reproducible from its config string and
/// familiar).
fn fastest<'r>(jobs: &[Job], results: &'r [JobResult]) -> Option<&'r Evaluated> {
    let best = |free: bool| {
        jobs.iter()
            .zip(results)
            .filter(|(j, _)| matches!(j, Job::Free(_)) == free)
            .flat_map(|(_, r)| &r.fits)
            .min_by(|a, b| a.step_time_s().total_cmp(&b.step_time_s()))
    };
    match (best(true), best(false)) {
        (Some(f), Some(m)) => {
            Some(if f.step_time_s() < m.step_time_s() * (1.0 - 1e-3) { f } else { m })
        }
        (f, m) => f.or(m),
    }
}

/// [`fastest`], lowered exactly ([`crate::search::exactly`]): the search prices many
/// micro-batches from a few, and a plan carries its own Program's figures. Should the exact
/// peak miss the budget (the priced one is the same wherever the micro-batches between the
/// first and the last are alike), the next fastest is taken.
fn exact_fastest(
    req: &Request<'_>,
    p: &Search<'_>,
    jobs: &[Job],
    results: &mut [JobResult],
) -> Result<Option<Evaluated>> {
    loop {
        let Some(e) = fastest(jobs, results) else { return Ok(None) };
        let exact = crate::search::exactly(p, e)?;
        if exact.peak_bytes() <= req.budget {
            return Ok(Some(exact));
        }
        let (cand, t) = (e.candidate.clone(), e.step_time_s());
        for r in results.iter_mut() {
            r.fits.retain(|f| !(f.candidate == cand && f.step_time_s() == t));
        }
    }
}

/// The automatic plan: the fastest fitting candidate of the whole space.
pub fn plan_auto(req: &Request<'_>) -> Result<Plan> {
    let rows = crate::loss_chunk::choose(req.loss_problem())?;
    let tile = crate::mlp_tile::choose(req.mlp_problem())?;
    with_loss(req, rows, |r| with_mlp(r, tile, plan_auto_as_built))
}

/// [`plan_auto`] on the request's forward graphs as they are built.
fn plan_auto_as_built(req: &Request<'_>) -> Result<Plan> {
    let t0 = Instant::now();
    let p = req.problem();
    let mbs = req.micro_batch_options();
    let jobs = auto_jobs(req, model_experts(&p)?)?;
    let trace = std::env::var_os("TESSERA_TRACE").is_some();
    // When the model state alone cannot fit the devices, the offload phase at once: the flat
    // and pipelined phases could only learn it candidate by candidate. Should the offload
    // phase find nothing either, the search below runs for the error's least peak.
    if offload::device_state_cannot_fit(req, &p)? {
        let phase = offload::run(req)?;
        if let Some(e) = phase.fit {
            let e = crate::search::exactly(&req.problem(), &e)?;
            crate::offload::check_tiers(&req.cluster, &e.lowered.memory, "")?;
            let mut plan = req.to_plan(&e, "auto", 0.0)?;
            plan.search_ms = t0.elapsed().as_secs_f64() * 1e3;
            return Ok(plan);
        }
    }
    // Where memory binds, the pipeline phase first: its plans bound one flat round
    // (`PipelineKnobs::first_over_state_share`, `seed`).
    let early = match pipeline_first(req, &p)? {
        true => Some(pipelined::best_pipelined(req, f64::INFINITY)?),
        false => None,
    };
    if let Some(phase) = &early {
        seed(&p, phase);
    }
    let (phase, mut results) = match early {
        Some(phase) => {
            if trace {
                eprintln!("trace: the pipeline phase (first) done at {:?}", t0.elapsed());
            }
            let deferred = phase.plan.is_none();
            (phase, one_round(req, &p, &jobs, &mbs, deferred)?)
        }
        None => {
            let first = first_round(req, &p, &jobs, &mbs)?;
            if trace {
                eprintln!("trace: the first round (ZeRO-3) done at {:?}", t0.elapsed());
            }
            // The pipeline phase between the two rounds: bounded by the first round's fastest
            // fit (its priced step time is its exact one, `crate::lower::priced`), and its plan bounds
            // the second round, which then skips what cannot beat it.
            let bound = fastest(&jobs, &first).map_or(f64::INFINITY, Evaluated::step_time_s);
            let phase = pipelined::best_pipelined(req, bound)?;
            seed(&p, &phase);
            if trace {
                eprintln!("trace: the pipeline phase done at {:?}", t0.elapsed());
            }
            let deferred = phase.plan.is_none();
            (phase, second_round(req, &p, &jobs, &mbs, first, deferred)?)
        }
    };
    let piped = phase.plan.as_ref().map(|plan| plan.predicted.step_time_s);
    if trace {
        let tried: usize = results.iter().map(|r| r.tried).sum();
        eprintln!(
            "trace: phases without a pipeline: {tried} candidates, done at {:?}",
            t0.elapsed()
        );
    }
    // The Megatron baseline from the search's own figures (priced, see `crate::lower::priced`).
    let flat_megatron = best_megatron(&jobs, &results).map(|m| baseline_json(req, &m));
    // Every pipelined candidate is a Megatron configuration: the baseline grid includes them.
    let megatron = phase.megatron_baseline(flat_megatron);
    let flat = fastest(&jobs, &results).map(Evaluated::step_time_s);
    let pipeline_wins = piped.is_some_and(|t| flat.is_none_or(|f| t < f));
    let mut plan = match phase.plan {
        Some(plan) if pipeline_wins => plan,
        // Lowered exactly only when it is the answer; should no flat plan fit exactly (its
        // priced peak was the same), the pipelined one still does.
        piped_plan => match (exact_fastest(req, &p, &jobs, &mut results)?, piped_plan) {
            (Some(e), _) => req.to_plan(&e, "auto", 0.0)?,
            (None, Some(plan)) => plan,
            // Nothing fits on the devices: the offload phase.
            (None, None) => {
                let phase = offload::run(req)?;
                match phase.fit {
                    Some(e) => {
                        let e = crate::search::exactly(&req.problem(), &e)?;
                        crate::offload::check_tiers(&req.cluster, &e.lowered.memory, "")?;
                        req.to_plan(&e, "auto", 0.0)?
                    }
                    None => return Err(offload::infeasible(req, &phase, infeasible(req, &p))),
                }
            }
        },
    };
    plan.search_ms = t0.elapsed().as_secs_f64() * 1e3;
    if trace {
        eprintln!("trace: the search ran {}", crate::trace::summary());
    }
    // The search priced every Megatron configuration anyway: keep the best as baseline.
    plan.baselines.megatron = megatron;
    Ok(plan)
}

/// The pipeline phase's plans as the flat search's bounds ([`search::FastestSoFar`]).
fn seed(p: &Search<'_>, phase: &pipelined::PipelinePhase) {
    if let Some(plan) = &phase.plan {
        let even = phase.even.as_ref().map(|e| e.predicted.step_time_s);
        p.state.fastest.seed_pipelined(plan.predicted.step_time_s, even);
    }
}

/// Whether the pipeline phase runs first: the model state alone, spread over every device,
/// takes at least [`PipelineKnobs::first_over_state_share`] of the budget.
///
/// [`PipelineKnobs::first_over_state_share`]: crate::pipeline::search::PipelineKnobs
fn pipeline_first(req: &Request<'_>, p: &Search<'_>) -> Result<bool> {
    if !req.pipeline.enabled || req.cluster.num_devices() < 2 {
        return Ok(false);
    }
    let floor = search::resting_floor(p, req.batch, req.cluster.num_devices())?;
    Ok(floor as f64 >= req.pipeline.first_over_state_share * req.budget as f64)
}

/// The automatic search with checkpointing fixed to `ckpt` (the `chen` and `full_recompute`
/// baselines): the fastest fitting candidate, if any.
pub fn auto_with(req: &Request<'_>, ckpt: CkptSearch) -> Result<Option<Evaluated>> {
    let mut p = req.problem();
    p.problem.ckpt = ckpt;
    let mbs = req.micro_batch_options();
    let jobs = auto_jobs(req, model_experts(&p)?)?;
    let results = run_jobs(req, &p, &jobs, &mbs)?;
    Ok(fastest(&jobs, &results).cloned())
}

/// Which checkpointing baselines to search for ([`attach_ckpt_baselines`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct CkptBaselines {
    /// Chen et al.'s √n segments on every block.
    pub chen: bool,
    /// `full` recompute on every block.
    pub full_recompute: bool,
    /// No checkpointing (what the plan would be without it).
    pub sharding_only: bool,
}

/// Fills the requested checkpointing baselines: each is the automatic search under that
/// policy, set against the plan's step time. Chen and full recompute are also applied to the
/// plan's own sharding (`same_sharding_step_time_s`).
pub fn attach_ckpt_baselines(
    req: &Request<'_>,
    plan: &mut Plan,
    which: CkptBaselines,
) -> Result<()> {
    let n = req.cluster.num_devices();
    let plan_s = plan.predicted.step_time_s;
    let json = |e: Option<Evaluated>, same: Option<f64>| crate::plan::CkptBaselineJson {
        step_time_s: e.as_ref().map(|e| e.step_time_s()),
        peak_bytes_per_device: e.as_ref().map_or_else(Vec::new, |e| vec![e.peak_bytes(); n]),
        recompute_s: e.as_ref().map_or(0.0, |e| e.lowered.time.recompute_s),
        plan_over_baseline: e.as_ref().map(|e| plan_s / e.step_time_s()),
        same_sharding_step_time_s: same,
    };
    // The policy on the plan's own sharding: `None` when it does not fit the budget there.
    let own = plan.clone();
    let on_plan = |ckpt: tessera_ir::Checkpointing| -> Result<Option<f64>> {
        let exe = lower_plan_with(req, &own, ckpt)?;
        Ok((exe.lowered.memory.peak_bytes <= req.budget).then_some(exe.lowered.time.step_time_s))
    };
    let blocks = plan.checkpoint.len() as u32;
    if which.chen {
        let same = if blocks > 0 { on_plan(search::chen_schedule(blocks))? } else { None };
        plan.baselines.chen = Some(json(auto_with(req, CkptSearch::Chen)?, same));
    }
    if which.full_recompute {
        let full = tessera_ir::CkptMode::Full;
        let same = match blocks {
            0 => None,
            _ => on_plan(tessera_ir::Checkpointing::uniform(blocks, full))?,
        };
        plan.baselines.full_recompute =
            Some(json(auto_with(req, CkptSearch::Uniform(full))?, same));
    }
    if which.sharding_only {
        plan.baselines.sharding_only = Some(json(auto_with(req, CkptSearch::Off)?, None));
    }
    Ok(())
}

/// A plan lowered to the Program every device runs, ready for the SPMD runtime.
pub struct Executable {
    /// The mesh of all devices (a pipelined plan's ends with the pipeline axis).
    pub mesh: Mesh,
    /// A pipelined plan: each pipeline device's Program (rank r runs `devices[r % pp]`);
    /// `lowered` is then the worst device's.
    pub pipeline: Option<crate::pipeline::lower::PipeLowered>,
    pub lowered: crate::lower::Lowered,
    pub zero_stage: u8,
    pub micro_batches: usize,
    /// Strategy per node of the forward graph (`None` for leaves).
    pub strategies: Vec<Option<crate::rules::Strategy>>,
}

impl Executable {
    /// The lowering of each distinct device Program: one for a flat plan (every device runs
    /// it), one per pipeline device (rank r runs `[r % len]`). Their memory reports are the
    /// plan's predicted peaks.
    pub fn per_device(&self) -> Vec<&crate::lower::Lowered> {
        match &self.pipeline {
            Some(p) => p.devices.iter().map(|d| &d.lowered).collect(),
            None => vec![&self.lowered],
        }
    }
}

/// Lowers a plan's strategies (hand edits included) on the request's model and cluster.
pub fn lower_plan(req: &Request<'_>, file: &Plan) -> Result<Executable> {
    lower_plan_with(req, file, file.checkpointing())
}

/// [`lower_plan`] with another checkpointing than the plan's own.
pub fn lower_plan_with(
    req: &Request<'_>,
    file: &Plan,
    ckpt: tessera_ir::Checkpointing,
) -> Result<Executable> {
    with_loss(req, file.loss_chunk_rows, |r| {
        with_mlp(r, file.mlp_tile_rows, |r| lower_plan_as_built(r, file, ckpt))
    })
}

/// [`lower_plan_with`] on the request's forward graphs as they are built (the plan's chunked
/// loss already applied).
fn lower_plan_as_built(
    req: &Request<'_>,
    file: &Plan,
    ckpt: tessera_ir::Checkpointing,
) -> Result<Executable> {
    if file.version != crate::plan::PLAN_VERSION {
        return Err(PlanError::Invalid(format!(
            "plan file version {} is not supported (this tessera writes version {})",
            file.version,
            crate::plan::PLAN_VERSION
        )));
    }
    if let Some(&a) = file.mesh.replicas.iter().find(|&&a| a >= file.mesh.shape.len()) {
        return Err(PlanError::Invalid(format!(
            "plan file's mesh.replicas names axis {a}, but the mesh {:?} has {} axes: list \
             axes of the mesh (or drop replicas)",
            file.mesh.shape,
            file.mesh.shape.len()
        )));
    }
    if file.pipeline.is_some() && !file.mesh.replicas.is_empty() {
        return Err(PlanError::Invalid(
            "plan file has mesh.replicas (hybrid sharding) and a pipeline, which are not \
             supported together: drop one of them"
                .into(),
        ));
    }
    let mesh = match &file.pipeline {
        // One stage's mesh: the strategies' axes.
        Some(pj) => {
            use crate::pipeline::plan as pplan;
            let names = pplan::file_stage_names(&file.mesh.axes, file.mesh.shape.len());
            pplan::meshes(&req.cluster, &file.mesh.shape, &names, pj.devices)?.0
        }
        None => Mesh::new(
            &req.cluster,
            &file.mesh.shape,
            &file.mesh.axes.iter().map(String::as_str).collect::<Vec<_>>(),
        )?
        .with_replicas(&file.mesh.replicas)
        .with_ring(file.mesh.ring),
    };
    if file.micro_batches == 0 {
        return Err(PlanError::Invalid(
            "the plan's micro_batches is 0: give 1 (no micro-batching) or more".into(),
        ));
    }
    let mb = file.micro_batches;
    if !req.batch.is_multiple_of(mb) {
        return Err(PlanError::Invalid(format!(
            "batch {} does not split into {mb} micro-batches",
            req.batch
        )));
    }
    let fwd = (req.build)(req.batch / mb)?;
    let strategies = file.node_strategies(&fwd.graph, &mesh)?;
    let p = req.problem();
    if let Some(pj) = &file.pipeline {
        return lower_pipeline_file(req, file, pj, &fwd, strategies, ckpt);
    }
    let opts = crate::lower::LowerOptions {
        zero: file.zero_stage,
        micro_batches: mb,
        train: req.train.clone(),
        ckpt,
        offload: file.offload_choice(),
    };
    let lowered = crate::lower::lower(
        &fwd.graph,
        fwd.loss,
        &strategies,
        &mesh,
        &p.problem.cost,
        &opts,
        crate::lower::Fidelity::Exact,
    )?;
    Ok(Executable {
        mesh,
        pipeline: None,
        lowered,
        zero_stage: file.zero_stage,
        micro_batches: mb,
        strategies,
    })
}

/// [`lower_plan_with`] for a pipelined plan file.
fn lower_pipeline_file(
    req: &Request<'_>,
    file: &Plan,
    pj: &crate::pipeline::plan::PipelineJson,
    fwd: &Forward,
    strategies: Vec<Option<crate::rules::Strategy>>,
    ckpt: tessera_ir::Checkpointing,
) -> Result<Executable> {
    use crate::pipeline::plan as pplan;
    let (stage, full) = pplan::meshes(
        &req.cluster,
        &file.mesh.shape,
        &pplan::file_stage_names(&file.mesh.axes, file.mesh.shape.len()),
        pj.devices,
    )?;
    let map = crate::pipeline::split::StageMap::from_sizes(&pj.sizes(), pj.devices, stage.ndim())?;
    let r = pplan::PipelineRequest {
        forward: &fwd.graph,
        loss: fwd.loss,
        strategies: &strategies,
        stage_mesh: &stage,
        full: &full,
        zero: file.zero_stage,
        micro_batches: file.micro_batches.max(1),
        train: &req.train,
        ckpt,
        map,
        schedule: pj.kind()?,
    };
    let cost = crate::cost::CostModel::for_cluster(&req.cluster)
        .with_moe_imbalance(req.search.moe_imbalance);
    let l = pplan::lower_pipelined(&r, &cost)?;
    let lowered = l
        .devices
        .iter()
        .max_by_key(|d| d.lowered.memory.peak_bytes)
        .map(|d| d.lowered.clone())
        .ok_or_else(|| PlanError::Internal("a pipeline without devices".into()))?;
    Ok(Executable {
        mesh: full,
        pipeline: Some(l),
        lowered,
        zero_stage: file.zero_stage,
        micro_batches: file.micro_batches.max(1),
        strategies,
    })
}

/// Re-lowers a plan file's strategies (hand edits included) with the current cost model.
pub fn plan_from_file(req: &Request<'_>, file: &Plan) -> Result<Plan> {
    with_loss(req, file.loss_chunk_rows, |r| {
        with_mlp(r, file.mlp_tile_rows, |r| plan_from_file_as_built(r, file))
    })
}

/// [`plan_from_file`] on the request's forward graphs as they are built.
fn plan_from_file_as_built(req: &Request<'_>, file: &Plan) -> Result<Plan> {
    let t0 = Instant::now();
    let exe = lower_plan_as_built(req, file, file.checkpointing())?;
    let e = Evaluated {
        candidate: Candidate {
            // A pipelined plan's strategies are one stage's: its mesh drops the pipeline axis.
            mesh: match &exe.pipeline {
                Some(_) => Mesh {
                    shape: file.mesh.shape.clone(),
                    axes: exe.mesh.axes[..file.mesh.shape.len()].to_vec(),
                    links: exe.mesh.links[..file.mesh.shape.len()].to_vec(),
                    replicas: Vec::new(),
                    ring: false,
                },
                None => exe.mesh.clone(),
            },
            rule: AxisRule::Free,
            zero: exe.zero_stage,
            micro_batches: exe.micro_batches,
            offload: file.offload_choice(),
        },
        strategies: exe.strategies,
        lowered: exe.lowered,
        ilp_objective_s: f64::NAN,
    };
    if let Some(l) = &exe.pipeline {
        let mut plan = req.to_plan(&e, "file", t0.elapsed().as_secs_f64() * 1e3)?;
        crate::plan::attach_pipeline(&mut plan, l, &exe.mesh, req.batch * req.seq);
        plan.config = file.config.clone();
        if l.peak_bytes() > req.budget {
            return Err(PlanError::Infeasible {
                budget: req.budget,
                needed: l.peak_bytes(),
                hint: "this plan file's worst pipeline stage".into(),
            });
        }
        check_derived(file, &plan)?;
        return Ok(plan);
    }
    if e.peak_bytes() > req.budget {
        return Err(PlanError::Infeasible {
            budget: req.budget,
            needed: e.peak_bytes(),
            hint: "this plan file's layout".into(),
        });
    }
    let plan = req.to_plan(&e, "file", t0.elapsed().as_secs_f64() * 1e3)?;
    check_derived(file, &plan)?;
    Ok(plan)
}

/// A plan file's `devices` is its mesh's size: a hand edit of it would be ignored, so one that
/// disagrees is refused. `config` and `tensors` are a report of what the layout lowers to
/// (editing `strategies` changes them): they are recomputed on load, and
/// [`derived_differences`] says where a file's differ.
fn check_derived(file: &Plan, lowered: &Plan) -> Result<()> {
    if file.devices != lowered.devices {
        return Err(PlanError::Invalid(format!(
            "the plan file's `devices` is {}, but its mesh {:?} holds {}: `devices` is the \
             mesh's size, not a setting; edit `mesh` (and `strategies`) instead, or re-plan \
             with `tessera plan --out`",
            file.devices, file.mesh.shape, lowered.devices
        )));
    }
    Ok(())
}

/// Where a plan file's reported `config` and `tensors` differ from what its layout lowers to
/// (`lowered`, from [`plan_from_file`]): one line each, empty when they agree. They are not
/// read (the lowering is the plan); a caller says so to the user.
pub fn derived_differences(file: &Plan, lowered: &Plan) -> Vec<String> {
    let mut out = Vec::new();
    if file.config != lowered.config {
        out.push(format!("`config` is `{}`, the layout's is `{}`", file.config, lowered.config));
    }
    if file.tensors != lowered.tensors {
        let first = file.tensors.iter().zip(&lowered.tensors).find(|(a, b)| a != b);
        out.push(match first {
            Some((a, b)) => format!(
                "`tensors` has {} {} {:?}, the layout gives {} {} {:?}",
                a.name, a.spec, a.local_shape, b.name, b.spec, b.local_shape
            ),
            None => format!(
                "`tensors` has {} entries, the layout gives {}",
                file.tensors.len(),
                lowered.tensors.len()
            ),
        });
    }
    out
}

/// The error when nothing fits: the least peak any candidate of the search reaches
/// ([`LeastPeak`]), which every candidate that did not fit recorded as the search went. A
/// budget of that figure finds a plan; the search explores nothing more to report it.
fn infeasible(req: &Request<'_>, p: &Search<'_>) -> PlanError {
    let n = req.cluster.num_devices();
    let Some(least) = p.state.least.lock().ok().and_then(|l| l.clone()) else {
        return PlanError::Invalid(format!(
            "no layout of the search splits this model over {n} devices: a degree does not \
             divide the batch, heads or hidden size"
        ));
    };
    PlanError::Infeasible {
        budget: req.budget,
        needed: least.peak_bytes,
        hint: format!(
            "reached by {} on {n} device{}; add devices or memory, or shorten the sequence",
            describe(&least),
            if n == 1 { "" } else { "s" }
        ),
    }
}

/// The candidate that reaches a least peak, in words: the config string of a Megatron-style
/// layout, the mesh and settings of a per-op one.
fn describe(least: &LeastPeak) -> String {
    let c = &least.candidate;
    let ck = &least.ckpt;
    let first = ck.modes.values().next().copied();
    let uniform = ck.segments.is_empty() && ck.modes.values().all(|&m| Some(m) == first);
    match &c.rule {
        AxisRule::Megatron { sp, cp } if uniform => {
            // `[dp, tp]`, or `[dp, cp, tp]` with context parallelism.
            let at = |k: usize| c.mesh.shape.get(k).copied().unwrap_or(1);
            let cfg = ParallelConfig::new(at(0), if *cp { at(2) } else { at(1) })
                .with_cp(if *cp { at(1) } else { 1 })
                .with_zero(c.zero)
                .with_micro_batches(c.micro_batches)
                .with_sp(*sp)
                .with_ckpt(first);
            format!("`{}`", cfg.canonical())
        }
        _ => {
            let ckpt = match first {
                _ if !ck.segments.is_empty() => ", Chen's √n checkpoint segments".to_string(),
                Some(m) if uniform => format!(", ckpt={m}"),
                Some(_) => ", per-block checkpointing".to_string(),
                None => String::new(),
            };
            format!(
                "a per-op layout (mesh {:?}, ZeRO-{}, {} micro-batches{ckpt})",
                c.mesh.shape, c.zero, c.micro_batches
            )
        }
    }
}

fn baseline_json(
    req: &Request<'_>,
    (e, cfg, tried, fitting): &(Evaluated, ParallelConfig, usize, usize),
) -> BaselineJson {
    BaselineJson {
        config: cfg.canonical(),
        step_time_s: e.step_time_s(),
        peak_bytes_per_device: vec![e.peak_bytes(); req.cluster.num_devices()],
        configurations_tried: *tried,
        configurations_fitting: *fitting,
    }
}

/// Fills the Megatron baseline of a plan (kept if the automatic search already did).
pub fn attach_megatron(req: &Request<'_>, plan: &mut Plan) -> Result<()> {
    if plan.baselines.megatron.is_none() {
        let flat = megatron(req)?.as_ref().map(|m| baseline_json(req, m));
        let bound = flat.as_ref().map_or(f64::INFINITY, |f| f.step_time_s);
        let phase = pipelined::best_pipelined(req, bound)?;
        plan.baselines.megatron = phase.megatron_baseline(flat);
    }
    Ok(())
}
