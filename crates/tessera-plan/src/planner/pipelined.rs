//! Pipelines in the planner: a fixed pipelined configuration (`--plan "dp2 tp2 pp4 zero1"`)
//! and the automatic search's pipeline phase ([`best_pipelined`], see [`crate::pipeline::search`]).

use super::{parallel_map, Request};
use crate::config::ParallelConfig;
use crate::mesh::AxisName;
use crate::pipeline::search::{self as psearch, Screened, Shape};
use crate::plan::{BaselineJson, Plan};
use crate::search::{self, AxisRule, Candidate, CkptSearch, Evaluated, Search};
use crate::{PlanError, Result};
use std::collections::BTreeMap;
use std::time::Instant;

/// A fixed pipelined configuration: the Megatron layout of one stage's `dp × tp` mesh, the
/// blocks split evenly or as `stages=` says, the schedule simulated (see
/// [`crate::pipeline::plan`]).
pub fn plan_fixed_pipelined(req: &Request<'_>, cfg: &ParallelConfig) -> Result<Plan> {
    let t0 = Instant::now();
    let fixed = lower_fixed(req, cfg, None)?;
    fixed_plan(req, cfg, fixed, t0)
}

/// A fixed pipelined configuration lowered exactly, whatever its memory.
pub struct FixedLowered {
    pub lowered: crate::pipeline::lower::PipeLowered,
    /// The full mesh (stage axes, then the pipeline's).
    pub full: crate::Mesh,
    /// The stage's layout, as evaluated on one micro-batch.
    stage: Evaluated,
}

/// Lowers `cfg` exactly (see [`plan_fixed_pipelined`]). With a `probe` budget (the search's
/// check of a screened candidate) a device found to miss it ends the lowering early
/// ([`crate::pipeline::lower::lower_within`]): the answer is then `PlanError::Infeasible`
/// with that device's peak, which the worst stage's reaches at least.
pub fn lower_fixed(
    req: &Request<'_>,
    cfg: &ParallelConfig,
    probe: Option<u64>,
) -> Result<FixedLowered> {
    use crate::pipeline::plan as pplan;
    cfg.check_devices(req.cluster.num_devices())?;
    let mb = cfg.micro_batches.max(1);
    if !req.batch.is_multiple_of(cfg.dp * cfg.ep * mb) {
        return Err(PlanError::Invalid(format!(
            "batch {} does not split into {} data-parallel replicas × {mb} micro-batches: use a \
             batch that is a multiple of {}",
            req.batch,
            cfg.dp * cfg.ep,
            cfg.dp * cfg.ep * mb
        )));
    }
    let fwd = (req.build)(req.batch / mb)?;
    let nb = tessera_ir::remat::num_blocks(&fwd.graph) as usize;
    cfg.check_pipeline(nb, Some(mb))?;
    let (stage_shape, stage_names) = crate::axis::stage_mesh(cfg);
    let (stage, full) = pplan::meshes(&req.cluster, &stage_shape, &stage_names, cfg.pp)?;
    // The stage's layout: Megatron's on its mesh, whatever the memory (the pipeline is priced
    // and checked below).
    // One micro-batch suffices to choose it (the layout is per forward node, the same for
    // every micro-batch), and is mb times cheaper to lower than all of them.
    let mut p = req.problem();
    p.problem.ckpt = CkptSearch::Off;
    p.problem.batch = req.batch / mb;
    let cand = Candidate {
        mesh: stage.clone(),
        rule: AxisRule::Megatron { sp: cfg.sp, cp: cfg.cp > 1 },
        zero: cfg.zero,
        micro_batches: 1,
        offload: None,
    };
    let e = search::evaluate(&p, &cand, None)?
        .ok_or_else(|| search::cannot_split(&p, &cand, &cfg.canonical()))?;
    let schedule = cfg.schedule.unwrap_or_default();
    let (map, ckpt) = if cfg.stages.is_empty() {
        let ckpt = match cfg.ckpt {
            Some(m) => tessera_ir::Checkpointing::uniform(nb as u32, m),
            None => tessera_ir::Checkpointing::default(),
        };
        (crate::pipeline::split::StageMap::even(nb, cfg.pp, schedule.chunks(), 2)?, ckpt)
    } else {
        let sizes = crate::pipeline::layout::sizes(&cfg.stages);
        let map = crate::pipeline::split::StageMap::from_sizes(&sizes, cfg.pp, 2)?;
        (map, crate::pipeline::layout::checkpointing(&cfg.stages, cfg.ckpt))
    };
    let r = pplan::PipelineRequest {
        forward: &fwd.graph,
        loss: fwd.loss,
        strategies: &e.strategies,
        stage_mesh: &stage,
        full: &full,
        zero: cfg.zero,
        micro_batches: mb,
        train: &req.train,
        ckpt,
        map,
        schedule,
    };
    let lowered = match probe {
        None => pplan::lower_pipelined(&r, &p.problem.cost)?,
        Some(budget) => {
            pplan::lower_pipelined_within(&r, &p.problem.cost, budget)?.map_err(|needed| {
                PlanError::Infeasible {
                    budget,
                    needed,
                    hint: format!(
                    "`{}`: a pipeline stage, the first found over the budget; add micro-batches \
                     or stages",
                    cfg.canonical()
                ),
                }
            })?
        }
    };
    Ok(FixedLowered { lowered, full, stage: e })
}

/// The plan of a lowered fixed configuration, if it fits the budget.
pub fn fixed_plan(
    req: &Request<'_>,
    cfg: &ParallelConfig,
    fixed: FixedLowered,
    t0: Instant,
) -> Result<Plan> {
    let FixedLowered { lowered: l, full, stage: e } = fixed;
    let mb = cfg.micro_batches.max(1);
    if l.peak_bytes() > req.budget {
        return Err(PlanError::Infeasible {
            budget: req.budget,
            needed: l.peak_bytes(),
            hint: format!(
                "`{}`: its worst pipeline stage; add micro-batches or stages{}",
                cfg.canonical(),
                if cfg.dp > 1 { ", or raise ZeRO" } else { "" }
            ),
        });
    }
    let worst = l
        .devices
        .iter()
        .max_by_key(|d| d.lowered.memory.peak_bytes)
        .map(|d| d.lowered.clone())
        .ok_or_else(|| PlanError::Internal("a pipeline without devices".into()))?;
    let cand = Candidate { micro_batches: mb, ..e.candidate };
    let e = Evaluated { lowered: worst, candidate: cand, ..e };
    let mut plan = req.to_plan(&e, "fixed", t0.elapsed().as_secs_f64() * 1e3)?;
    crate::plan::attach_pipeline(&mut plan, &l, &full, req.batch * req.seq);
    plan.config = cfg.canonical();
    Ok(plan)
}

/// The automatic search's pipeline phase: every shape of the cluster ([`psearch::shapes`]) at
/// each micro-batch size of the knobs, sampled once per checkpointing mode on its stage mesh
/// (in parallel), screened by estimate against `bound` (the fastest plan without a pipeline),
/// then the fastest estimates lowered exactly ([`plan_fixed_pipelined`]). Returns the fastest
/// fitting pipelined plan, if any beats `bound`.
pub fn best_pipelined(req: &Request<'_>, bound: f64) -> Result<PipelinePhase> {
    let n = req.cluster.num_devices();
    if !req.pipeline.enabled || n < 2 {
        return Ok(PipelinePhase { plan: None, even: None, screened: 0, fitting: 0 });
    }
    let nb = tessera_ir::remat::num_blocks(&(req.build)(1)?.graph) as usize;
    let space = PipeSpace {
        shapes: psearch::shapes(&req.cluster, nb),
        knobs: req.pipeline.clone(),
        recut: true,
        stages: Vec::new(),
        accept: &|_| true,
    };
    best_in(req, bound, &space)
}

/// The part of the pipeline phase's space one search looks at: the automatic search's is
/// every shape with the knobs' sizes, schedules and modes, re-cuts included
/// ([`best_pipelined`]); a config string's is its own shape with its free knobs
/// ([`crate::planner::plan_config`]).
pub struct PipeSpace<'a> {
    pub shapes: Vec<Shape>,
    /// Micro-batch sizes, schedules, checkpointing modes and how many to verify.
    pub knobs: psearch::PipelineKnobs,
    /// Whether the stages of the verified candidates may be re-cut ([`crate::pipeline::balance`]).
    pub recut: bool,
    /// The stages every candidate takes (`stages=`; empty: even, or re-cut).
    pub stages: Vec<crate::pipeline::layout::Stage>,
    /// Which configurations may be the answer (an export engine's constraint).
    pub accept: &'a (dyn Fn(&ParallelConfig) -> bool + Sync),
}

/// [`best_pipelined`] over `space`.
pub fn best_in(req: &Request<'_>, bound: f64, space: &PipeSpace<'_>) -> Result<PipelinePhase> {
    let knobs = &space.knobs;
    let none = PipelinePhase { plan: None, even: None, screened: 0, fitting: 0 };
    let t0 = Instant::now();
    let nb = tessera_ir::remat::num_blocks(&(req.build)(1)?.graph) as usize;
    // (shape, micro-batch size): the micro-batch count m = batch / (dp · size) must give every
    // pipeline device work in the steady state (m ≥ pp).
    let mut items: Vec<(Shape, usize)> = Vec::new();
    for s in &space.shapes {
        for &size in &knobs.micro_batch_sizes {
            let per = s.dp * size;
            if size > 0 && req.batch.is_multiple_of(per) && req.batch / per >= s.pp {
                items.push((*s, size));
            }
        }
    }
    if items.is_empty() {
        return Ok(none);
    }
    // One problem per micro-batch's global size (dp · size sequences): its forward graph and
    // ILP caches are shared by the shapes that need it.
    let mut problems: BTreeMap<usize, Search<'_>> = BTreeMap::new();
    for (s, size) in &items {
        problems.entry(s.dp * size).or_insert_with(|| {
            let mut p = req.problem();
            p.problem.batch = s.dp * size;
            p.problem.ckpt = CkptSearch::Off;
            p
        });
    }
    let budget = req.budget as f64;
    let screened = parallel_map(&items, |(shape, size)| -> Result<Vec<Screened>> {
        let p = &problems[&(shape.dp * size)];
        let (stage, full) = crate::pipeline::plan::meshes(
            &req.cluster,
            &[shape.dp, shape.tp],
            &[AxisName::Data, AxisName::Tensor],
            shape.pp,
        )?;
        let m = req.batch / (shape.dp * size);
        let link = full.links.last().ok_or_else(|| PlanError::Internal("no mesh axes".into()))?;
        let link = link.p2p(shape.pp);
        let at = psearch::ScreenAt { shape: *shape, m, num_blocks: nb, knobs, link, budget, bound };
        psearch::sample_and_screen(p, &stage, &at)
    });
    let mut ranked: Vec<Screened> = Vec::new();
    for s in screened {
        for mut c in s? {
            if !space.stages.is_empty() {
                c.config.stages = space.stages.clone();
                if c.config.check_pipeline(nb, None).is_err() {
                    continue;
                }
            }
            if (space.accept)(&c.config) {
                ranked.push(c);
            }
        }
    }
    ranked.sort_by(|a, b| a.estimate.step_time_s.total_cmp(&b.estimate.step_time_s));
    let trace = std::env::var_os("TESSERA_TRACE").is_some();
    if trace {
        eprintln!(
            "trace: pipeline phase screened {} shapes × sizes, {} candidates under bound \
             {bound:.4} s, in {:?}",
            items.len(),
            ranked.len(),
            t0.elapsed()
        );
    }
    // The fastest estimates lowered exactly, even stages first; then the re-cuts whose
    // modelled step beats every fitting even one (and the bound).
    let verify = &ranked[..ranked.len().min(knobs.verify)];
    let evens = parallel_map(verify, |c| verify_even(req, c, space.recut));
    let mut best = Best { bound, plan: None, even: None, fitting: 0, trace };
    let mut recuts = Vec::new();
    for (c, v) in verify.iter().zip(evens) {
        let (plan, recut) = v?;
        let even_s = plan.as_ref().ok().map(|p| p.predicted.step_time_s);
        best.offer(c, &c.config, plan, true)?;
        if let Some(r) = recut {
            recuts.push((c, r, even_s));
        }
    }
    if trace {
        for (_, r, even_s) in &recuts {
            eprintln!(
                "trace: re-cut `{}` models {:.4}× the even step ({even_s:?} s)",
                r.config, r.ratio
            );
        }
    }
    let wanted: Vec<_> = recuts
        .into_iter()
        .filter(|(_, r, even_s)| even_s.is_none_or(|t| t * r.ratio < best.limit()))
        .collect();
    let planned = parallel_map(&wanted, |(_, r, _)| plan_fixed_pipelined(req, &r.config));
    for ((c, r, _), plan) in wanted.iter().zip(planned) {
        match plan {
            // A re-cut the lowering refuses is no answer, not an error.
            Err(e) if !matches!(e, PlanError::Infeasible { .. }) => {
                if trace {
                    eprintln!("trace: re-cut `{}` refused: {e}", r.config);
                }
            }
            plan => best.offer(c, &r.config, plan, false)?,
        }
    }
    let Best { plan: best, even, fitting, .. } = best;
    let plan = best.map(|mut plan| {
        plan.source = "auto".to_string();
        plan.search_ms = t0.elapsed().as_secs_f64() * 1e3;
        plan
    });
    Ok(PipelinePhase { plan, even, screened: ranked.len(), fitting })
}

/// Lowers a screened candidate exactly with even stages: its plan (or why it has none) and
/// the re-cut of its stages and their checkpointing ([`crate::pipeline::balance`]), if one differs.
fn verify_even(
    req: &Request<'_>,
    c: &Screened,
    recut: bool,
) -> Result<(Result<Plan>, Option<crate::pipeline::balance::Recut>)> {
    let t0 = Instant::now();
    // The re-cut reads every device's figures, a miss's too (a re-cut may fit where even
    // stages do not): only without it may the probes end the lowering early.
    let probe = (!recut).then_some(req.budget);
    let even = match lower_fixed(req, &c.config, probe) {
        Ok(f) => f,
        Err(e @ PlanError::Infeasible { .. }) => return Ok((Err(e), None)),
        Err(e) => return Err(e),
    };
    if !recut {
        return Ok((fixed_plan(req, &c.config, even, t0), None));
    }
    let cost = crate::cost::CostModel::for_cluster(&req.cluster)
        .with_moe_imbalance(req.search.moe_imbalance);
    let devices = crate::pipeline::balance::device_costs(&even.lowered, &even.full, &cost);
    let recut = crate::pipeline::balance::rebalance(
        &c.config,
        &even.lowered,
        &devices,
        &c.costs,
        req.budget as f64,
    );
    Ok((fixed_plan(req, &c.config, even, t0), recut))
}

/// The fastest verified pipelined plan so far, and the fastest with even stages.
struct Best {
    bound: f64,
    plan: Option<Plan>,
    even: Option<Plan>,
    /// Verified plans that fit.
    fitting: usize,
    trace: bool,
}

impl Best {
    /// What a plan must beat: the bound, and the fastest so far.
    fn limit(&self) -> f64 {
        self.plan.as_ref().map_or(self.bound, |p| p.predicted.step_time_s.min(self.bound))
    }

    /// Takes `config`'s exact result (screened as `c`; `even`: its stages split evenly, a
    /// Megatron configuration): a fit counts, and wins when faster; an infeasible one (the
    /// estimate was optimistic: the worst stage holds more than the average) is passed over;
    /// any other error is the search's.
    fn offer(
        &mut self,
        c: &Screened,
        config: &ParallelConfig,
        exact: Result<Plan>,
        even: bool,
    ) -> Result<()> {
        if self.trace {
            eprintln!(
                "trace: pipeline `{}` estimated {:.4} s, {:.2} GiB; exact {}",
                config.canonical(),
                c.estimate.step_time_s,
                c.estimate.peak_bytes / (1u64 << 30) as f64,
                match &exact {
                    Ok(p) => format!(
                        "{:.4} s, {:.2} GiB",
                        p.predicted.step_time_s,
                        p.predicted.peak_bytes_per_device.iter().max().copied().unwrap_or(0) as f64
                            / (1u64 << 30) as f64
                    ),
                    Err(e) => e.to_string(),
                }
            );
        }
        match exact {
            Ok(plan) => {
                self.fitting += 1;
                let t = plan.predicted.step_time_s;
                let faster_even = self.even.as_ref().is_none_or(|e| t < e.predicted.step_time_s);
                if even && t < self.bound && faster_even {
                    self.even = Some(plan.clone());
                }
                if t < self.limit() {
                    self.plan = Some(plan);
                }
                Ok(())
            }
            Err(PlanError::Infeasible { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// What the pipeline phase found: the fastest pipelined plan that beats the bound (its config
/// string reproduces it), the fastest with even stages (a Megatron configuration), the
/// candidates the screen passed and how many of those verified fit.
pub struct PipelinePhase {
    pub plan: Option<Plan>,
    pub even: Option<Plan>,
    pub screened: usize,
    pub fitting: usize,
}

impl PipelinePhase {
    /// The Megatron baseline with pipelines: the faster of `flat` (the grid without them) and
    /// the phase's fastest plan with even stages (re-cut stages and per-stage checkpointing
    /// are not Megatron's), counting the phase's candidates.
    pub fn megatron_baseline(&self, flat: Option<BaselineJson>) -> Option<BaselineJson> {
        let piped = self.even.as_ref().map(|p| BaselineJson {
            config: p.config.clone(),
            step_time_s: p.predicted.step_time_s,
            peak_bytes_per_device: p.predicted.peak_bytes_per_device.clone(),
            configurations_tried: 0,
            configurations_fitting: 0,
        });
        let (tried, fits) =
            flat.as_ref().map_or((0, 0), |f| (f.configurations_tried, f.configurations_fitting));
        let mut best = match (flat, piped) {
            (Some(f), Some(p)) if p.step_time_s < f.step_time_s => p,
            (Some(f), _) => f,
            (None, Some(p)) => p,
            (None, None) => return None,
        };
        best.configurations_tried = tried + self.screened;
        best.configurations_fitting = fits + self.fitting;
        Some(best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::search::{sample_and_screen, PipelineKnobs, ScreenAt};
    use crate::Cluster;

    /// DeepSeek-V3's tiny preset with `layers` layers: one dense, then sparse ones (a sparse
    /// block holds several times a dense one's parameters).
    fn deepseek(layers: usize) -> tessera_models::ModelConfig {
        let mut cfg = tessera_models::ModelConfig::preset("deepseek-v3-tiny").unwrap();
        if let tessera_models::ModelConfig::Llama(c) = &mut cfg {
            let mut p = c.params().clone();
            p.num_hidden_layers = layers;
            *c = tessera_models::LlamaConfig::new(p).unwrap();
        }
        cfg
    }

    /// Blocks that differ, and an embedding and head as large as a block: the screen's
    /// estimate of each pipelined candidate is the worst device's exact peak within the
    /// screen's slack from above (it turns away no candidate that fits; the average over
    /// blocks, which spread the embedding and head over every stage, was 7% over) and within
    /// a tenth from below.
    #[test]
    fn the_screen_sees_the_heaviest_stage_of_unlike_blocks() {
        use crate::mesh::AxisName;
        use crate::planner::plan_fixed;
        use tessera_ir::{DType, TrainConfig};
        // 5 layers over 2 stages: 3 (the dense one and 2 sparse) and 2 sparse with the head.
        let cfg = deepseek(5);
        let build = move |mb: usize| -> Result<search::Forward> {
            let m =
                tessera_models::build(&cfg, &tessera_models::BuildOptions::new(mb, 16, DType::F32))
                    .map_err(|e| PlanError::Invalid(e.to_string()))?;
            Ok(search::Forward { graph: m.builder.finish(), loss: m.loss })
        };
        let req = Request {
            build: &build,
            model: "deepseek-v3-tiny".into(),
            batch: 8,
            seq: 16,
            dtype: DType::F32,
            budget: u64::MAX,
            cluster: Cluster::parse("2xcpu").unwrap(),
            train: TrainConfig::default(),
            model_flops: 1e12,
            ckpt: search::CkptSearch::Off,
            pipeline: Default::default(),
            search: Default::default(),
        };
        let shape = Shape { pp: 2, dp: 1, tp: 1, sp: false, zero: 0 };
        let mut p = req.problem();
        p.problem.batch = 1;
        p.problem.ckpt = search::CkptSearch::Off;
        let (stage, full) = crate::pipeline::plan::meshes(
            &req.cluster,
            &[1, 1],
            &[AxisName::Data, AxisName::Tensor],
            2,
        )
        .unwrap();
        let knobs = PipelineKnobs::default();
        let at = ScreenAt {
            shape,
            m: 8,
            num_blocks: 5,
            knobs: &knobs,
            link: full.links.last().unwrap().p2p(2),
            budget: f64::INFINITY,
            bound: f64::INFINITY,
        };
        let screened = sample_and_screen(&p, &stage, &at).unwrap();
        assert!(screened.len() >= 2, "{screened:?}");
        for c in &screened {
            let plan = plan_fixed(&req, &c.config).unwrap();
            let exact = *plan.predicted.peak_bytes_per_device.iter().max().unwrap() as f64;
            let est = c.estimate.peak_bytes;
            assert!(
                est <= exact * knobs.memory_slack,
                "{}: {est} over {exact}",
                c.config.canonical()
            );
            assert!(est >= 0.9 * exact, "{}: {est} under {exact}", c.config.canonical());
        }
    }
}
