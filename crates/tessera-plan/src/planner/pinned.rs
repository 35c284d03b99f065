//! A config string as a restricted search: the degrees and ZeRO stage it names are fixed, and
//! the knobs it leaves unwritten ([`Pins`]) — micro-batches, `sp`, the schedule,
//! checkpointing, offload — are chosen by the search's own machinery within them: the
//! micro-batch scan of the flat search ([`super::rounds::first_fit`]) with the joint
//! checkpoint search, `sp` on and off, the pipeline phase on the config's one shape
//! ([`super::pipelined::best_in`]), and the offload phase on its layout when nothing fits
//! on the devices. With an export engine, only what that engine runs is searched: each
//! completion is asked of [`crate::export::runs`], and checkpointing is then one mode on every
//! block (an engine names no per-block mix). A config that writes every knob is planned
//! exactly as written ([`super::plan_fixed`]).

use super::pipelined::{best_in, PipeSpace};
use super::rounds::{first_fit, Scan};
use super::{megatron_mesh, offload, Request};
use crate::config::{ParallelConfig, Pins};
use crate::export::{self, CkptPattern, Framework};
use crate::pipeline::search::Shape;
use crate::pipeline::ScheduleKind;
use crate::plan::Plan;
use crate::search::{self, AxisRule, Candidate, CkptSearch, Evaluated, Search};
use crate::{PlanError, Result};
use std::time::Instant;
use tessera_ir::CkptMode;

/// The modes a uniform checkpointing search tries, least recomputation first.
const MODES: [CkptMode; 3] = [CkptMode::None, CkptMode::Selective, CkptMode::Full];

/// Plans `cfg` with its unwritten knobs searched (see the module docs). `engine`: the plan is
/// to be exported there, so only what it runs is searched — unless nothing the config pins
/// is runnable there, when the search is the plain one and the export's refusal names why.
pub fn plan_config(
    req: &Request<'_>,
    cfg: &ParallelConfig,
    pins: Pins,
    engine: Option<Framework>,
) -> Result<Plan> {
    // The loss as `loss=` says or as the planner chooses, as `plan_fixed` does: the search
    // below then sees the fused graph, and the chosen config names a chunking it picked.
    let rows = crate::loss_chunk::resolve(req.loss_problem(), cfg.loss)?;
    let tile = crate::mlp_tile::resolve(req.mlp_problem(), cfg.mlp)?;
    let mut plan = super::with_loss(req, rows, |r| {
        super::with_mlp(r, tile, |r| plan_config_as_built(r, cfg, pins, engine))
    })?;
    // The loss as written, or the chunking chosen (a pipelined completion's config is the
    // pipeline phase's, which does not name it).
    let loss = cfg.loss.or(rows.map(crate::config::LossMode::Chunk));
    let mlp = cfg.mlp.or(tile.map(crate::config::MlpMode::Tile));
    if loss.is_some() || mlp.is_some() {
        let mut chosen = ParallelConfig::parse(&plan.config)?;
        chosen.loss = loss;
        chosen.mlp = mlp;
        plan.config = chosen.canonical();
    }
    Ok(plan)
}

/// [`plan_config`] on the request's forward graphs as they are built.
fn plan_config_as_built(
    req: &Request<'_>,
    cfg: &ParallelConfig,
    pins: Pins,
    engine: Option<Framework>,
) -> Result<Plan> {
    let nb = tessera_ir::remat::num_blocks(&(req.build)(1)?.graph) as usize;
    // A pipelined completion checkpoints every block alike.
    let runs = |c: &ParallelConfig| {
        engine.is_none_or(|fw| export::runs(fw, c, CkptPattern::uniform(c.ckpt), nb).is_none())
    };
    let t0 = Instant::now();
    // Context parallelism under a pipeline is planned as written: the pipeline phase's shapes
    // have no cp axis yet.
    // So is expert parallelism (the searched knobs' meshes have no ep axis).
    let exact = (cfg.cp > 1 && cfg.pp > 1) || cfg.ep > 1;
    if exact || (pins.complete_for(cfg) && (engine.is_none() || pins.ckpt)) {
        return with_offload(req, cfg, pins, super::plan_fixed_as_built(req, cfg), t0);
    }
    let mut plan = match cfg.pp > 1 {
        true => pipelined(req, cfg, pins, &runs)?,
        false => with_offload(req, cfg, pins, flat(req, cfg, pins, engine, nb), t0)?,
    };
    plan.source = "fixed".into();
    plan.search_ms = t0.elapsed().as_secs_f64() * 1e3;
    Ok(plan)
}

/// The values of `sp` the search tries: the written one, or both with tensor parallelism.
fn sps(cfg: &ParallelConfig, pins: Pins) -> Vec<bool> {
    match pins.sp || cfg.tp < 2 {
        true => vec![cfg.sp],
        false => vec![false, true],
    }
}

/// `result`, or where nothing fits on the devices and offload is not written, the offload
/// phase on the config's layout ([`offload::run_layout`]).
fn with_offload(
    req: &Request<'_>,
    cfg: &ParallelConfig,
    pins: Pins,
    result: Result<Plan>,
    t0: Instant,
) -> Result<Plan> {
    let device = match result {
        Err(e @ PlanError::Infeasible { .. }) => e,
        other => return other,
    };
    // Offload is refused with a pipeline and with hybrid sharding (`ParallelConfig::validate`).
    // So is it with context parallelism (`context::validate`).
    if pins.offload
        || cfg.offload.is_some()
        || cfg.pp > 1
        || cfg.shard.is_some()
        || cfg.cp > 1
        || cfg.ep > 1
    {
        return Err(device);
    }
    // The phase's probes search checkpointing as the config says, over its micro-batches.
    let req = &Request {
        ckpt: cfg.ckpt.map_or(req.ckpt.clone(), CkptSearch::Uniform),
        model: req.model.clone(),
        cluster: req.cluster.clone(),
        train: req.train.clone(),
        pipeline: req.pipeline.clone(),
        search: req.search.clone(),
        ..*req
    };
    let mbs = match pins.micro_batches {
        true => vec![cfg.micro_batches],
        false => req.micro_batch_options(),
    };
    let phase = offload::run_layout(req, (cfg.dp, cfg.tp), &sps(cfg, pins), cfg.zero, &mbs)?;
    let Some(e) = &phase.fit else { return Err(offload::infeasible(req, &phase, device)) };
    let e = crate::search::exactly(&req.problem(), e)?;
    let chosen = cfg
        .clone()
        .with_sp(matches!(e.candidate.rule, AxisRule::Megatron { sp: true, .. }))
        .with_micro_batches(e.candidate.micro_batches)
        .with_offload(e.candidate.offload);
    crate::offload::check_tiers(&req.cluster, &e.lowered.memory, &chosen.canonical())?;
    let mut plan = req.to_plan(&e, "fixed", t0.elapsed().as_secs_f64() * 1e3)?;
    plan.config = chosen.canonical();
    Ok(plan)
}

/// A flat config: the micro-batch scan for each `sp` and checkpointing policy the config and
/// the engine allow, the fastest fit lowered exactly. For an engine, checkpointing is searched
/// per block as without one (taken when the engine names the pattern found) and one mode on
/// every block; the engine's rules ([`export::runs`]) decide which completions count.
fn flat(
    req: &Request<'_>,
    cfg: &ParallelConfig,
    pins: Pins,
    engine: Option<Framework>,
    nb: usize,
) -> Result<Plan> {
    let mesh = megatron_mesh(&req.cluster, cfg)?;
    let mbs: Vec<usize> = match pins.micro_batches {
        true => vec![cfg.micro_batches],
        false => req.micro_batch_options(),
    };
    let mbs: Vec<usize> =
        mbs.into_iter().filter(|m| req.batch.is_multiple_of(m * cfg.dp)).collect();
    if mbs.is_empty() {
        return Err(PlanError::Invalid(format!(
            "batch {} does not split into {} data-parallel replicas × {} micro-batches: use a \
             batch that is a multiple of {}",
            req.batch,
            cfg.dp,
            cfg.micro_batches,
            cfg.dp * cfg.micro_batches
        )));
    }
    let runs = |c: &ParallelConfig, ckpt: CkptPattern| {
        engine.is_none_or(|fw| export::runs(fw, c, ckpt, nb).is_none())
    };
    // (the checkpointing written into the chosen config, its search policy).
    let mut ckpts: Vec<(Option<CkptMode>, CkptSearch)> = match cfg.ckpt {
        Some(m) => vec![(Some(m), CkptSearch::Uniform(m))],
        None => vec![(None, req.ckpt.clone())],
    };
    if engine.is_some() && !pins.ckpt {
        ckpts.extend(MODES.iter().map(|&m| (Some(m), CkptSearch::Uniform(m))));
    }
    // Each (sp, checkpointing) the engine may run: a per-block search is judged on its result.
    let mut options: Vec<(bool, Option<CkptMode>, CkptSearch)> = Vec::new();
    for sp in sps(cfg, pins) {
        for (mode, search) in &ckpts {
            let c = cfg.clone().with_sp(sp).with_ckpt(*mode);
            let pattern = mode.map_or(CkptPattern::None, |m| CkptPattern::uniform(Some(m)));
            if runs(&c, pattern) {
                options.push((sp, *mode, search.clone()));
            }
        }
    }
    // Nothing the engine runs: the plain search, and the export's refusal says why.
    let judged = !options.is_empty();
    if !judged {
        let search = cfg.ckpt.map_or(req.ckpt.clone(), CkptSearch::Uniform);
        options.push((cfg.sp, cfg.ckpt, search));
    }
    let problems: Vec<Search<'_>> = options
        .iter()
        .map(|(_, _, search)| {
            let mut p = req.problem();
            p.problem.ckpt = search.clone();
            p
        })
        .collect();
    let items: Vec<usize> = (0..options.len()).collect();
    let found = super::parallel_map(&items, |&i| {
        let rule = AxisRule::Megatron { sp: options[i].0, cp: cfg.cp > 1 };
        let scan =
            Scan { mesh: &mesh, rule: &rule, zero: cfg.zero, mbs: &mbs, offload: cfg.offload };
        first_fit(req, &problems[i], scan, true).map(|(_, e)| e)
    });
    let mut fits: Vec<(usize, Evaluated)> = Vec::new();
    for (i, e) in found.into_iter().enumerate() {
        fits.extend(e?.map(|e| (i, e)));
    }
    if std::env::var_os("TESSERA_TRACE").is_some() {
        let found: Vec<_> = fits.iter().map(|(i, e)| (&options[*i], e.step_time_s())).collect();
        eprintln!("trace: `{cfg}` completions (judged by an engine: {judged}): {found:?}");
    }
    // Fastest first; on a tie the earlier option (the per-block search, sp off).
    fits.sort_by(|(i, a), (j, b)| a.step_time_s().total_cmp(&b.step_time_s()).then(i.cmp(j)));
    let mut over: Option<PlanError> = None;
    for (i, e) in &fits {
        let (sp, ckpt, _) = &options[*i];
        let e = crate::search::exactly(&problems[*i], e)?;
        let chosen =
            cfg.clone().with_sp(*sp).with_ckpt(*ckpt).with_micro_batches(e.candidate.micro_batches);
        if e.peak_bytes() > req.budget {
            over.get_or_insert(PlanError::Infeasible {
                budget: req.budget,
                needed: e.peak_bytes(),
                hint: format!("`{}` lowered exactly", chosen.canonical()),
            });
            continue;
        }
        crate::offload::check_tiers(&req.cluster, &e.lowered.memory, &chosen.canonical())?;
        let mut plan = req.to_plan(&e, "fixed", 0.0)?;
        plan.config = chosen.canonical();
        // A per-block search's pattern, judged by the engine (a uniform one already was).
        if judged && ckpt.is_none() && !runs(&chosen, CkptPattern::of(&plan.checkpoint)) {
            continue;
        }
        return Ok(plan);
    }
    let first = Candidate {
        mesh,
        rule: AxisRule::Megatron { sp: options[0].0, cp: cfg.cp > 1 },
        zero: cfg.zero,
        micro_batches: mbs[0],
        offload: cfg.offload,
    };
    Err(over.unwrap_or_else(|| least(req, cfg, &problems, &first)))
}

/// The error when no completion of a flat config fits: the least peak its scans reached.
fn least(
    req: &Request<'_>,
    cfg: &ParallelConfig,
    problems: &[Search<'_>],
    first: &Candidate,
) -> PlanError {
    let least = problems
        .iter()
        .filter_map(|p| p.state.least.lock().ok().and_then(|l| l.as_ref().map(|l| l.peak_bytes)))
        .min();
    match least {
        Some(needed) => PlanError::Infeasible {
            budget: req.budget,
            needed,
            hint: format!(
                "`{}` with its micro-batches, sp and checkpointing searched, at its most \
                 memory-frugal layout; {}",
                cfg.canonical(),
                match cfg.dp * cfg.cp > 1 && cfg.zero < 3 {
                    true => "raise ZeRO, or add devices",
                    false => "add devices",
                }
            ),
        },
        None => search::cannot_split(&problems[0], first, &cfg.canonical()),
    }
}

/// A pipelined config: the pipeline phase on its one shape (each `sp` allowed), over the
/// micro-batch sizes, schedules and checkpointing modes left open, even stages (or the
/// written ones); the fastest verified plan. When none fits, the config's most frugal
/// completion (the most micro-batches, full recomputation) planned as written says by how
/// much.
fn pipelined(
    req: &Request<'_>,
    cfg: &ParallelConfig,
    pins: Pins,
    runs: &(dyn Fn(&ParallelConfig) -> bool + Sync),
) -> Result<Plan> {
    let mut knobs = req.pipeline.clone();
    knobs.enabled = true;
    if pins.micro_batches {
        let per = cfg.dp * cfg.micro_batches;
        if !req.batch.is_multiple_of(per) {
            return super::pipelined::plan_fixed_pipelined(req, cfg);
        }
        knobs.micro_batch_sizes = vec![req.batch / per];
    }
    if pins.schedule {
        knobs.schedules = vec![cfg.schedule.unwrap_or_default()];
    }
    if pins.ckpt {
        knobs.ckpt_modes = vec![cfg.ckpt.unwrap_or_default()];
    }
    let shapes = sps(cfg, pins)
        .into_iter()
        .map(|sp| Shape { pp: cfg.pp, dp: cfg.dp, tp: cfg.tp, sp, zero: cfg.zero })
        .collect();
    let accept = |c: &ParallelConfig| runs(c);
    let space =
        PipeSpace { shapes, knobs, recut: false, stages: cfg.stages.clone(), accept: &accept };
    if let Some(mut plan) = best_in(req, f64::INFINITY, &space)?.plan {
        // The default schedule stays unwritten, as a config string writes it.
        let mut chosen = ParallelConfig::parse(&plan.config)?;
        if !pins.schedule && chosen.schedule == Some(ScheduleKind::default()) {
            chosen.schedule = None;
            plan.config = chosen.canonical();
        }
        return Ok(plan);
    }
    let frugal = cfg
        .clone()
        .with_micro_batches(match pins.micro_batches {
            true => cfg.micro_batches,
            false => req.batch / cfg.dp,
        })
        .with_ckpt(match pins.ckpt {
            true => cfg.ckpt,
            false => Some(CkptMode::Full),
        })
        .with_schedule(match pins.schedule {
            true => cfg.schedule,
            false => None,
        })
        .with_sp(cfg.sp || (!pins.sp && cfg.tp > 1));
    super::pipelined::plan_fixed_pipelined(req, &frugal)
}
