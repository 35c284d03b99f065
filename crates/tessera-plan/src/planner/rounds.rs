//! The flat search's rounds: jobs (a mesh with the free per-op ILP, or one Megatron
//! `dp × tp (sp)` layout), each scanned over ZeRO stages and micro-batch counts
//! ([`first_fit`]), run on all cores — ZeRO-3 for every job first, then the lower stages
//! ([`first_round`], [`second_round`]), or in one round when another phase set the bound
//! ([`one_round`]).

use super::{megatron_mesh, Request};
use crate::config::ParallelConfig;
use crate::search::{self, AxisRule, Candidate, Evaluated, Search};
use crate::{Mesh, Result};

/// The smallest fitting micro-batch count for one (mesh, rule, zero). With `past_recompute`, a
/// fit that needs recomputation does not end the scan: more micro-batches may fit without it
/// and be faster, so the scan goes on to the first fit without recomputation and keeps the
/// fastest (the first round leaves that to [`one_more`], under a published bound). Counts
/// that a smaller count's miss rules out ([`search::Miss`]) are deferred, not lowered (a
/// miss of another ZeRO stage says nothing certain: ZeRO-3's gathered layers can peak above
/// ZeRO-0's whole model, `tests/scan_bound.rs`). Returns the counts tried and the fastest fit.
pub(super) fn first_fit(
    req: &Request<'_>,
    p: &Search<'_>,
    scan: Scan<'_>,
    past_recompute: bool,
) -> Result<(usize, Option<Evaluated>)> {
    let Scan { mesh, rule, zero, mbs, offload } = scan;
    let mut tried = 0;
    let mut best: Option<Evaluated> = None;
    // The last miss, and the resting floor of this (mesh, rule, ZeRO stage)'s devices (the
    // same for every count).
    let mut missed: Option<search::Miss> = None;
    let mut floor: Option<u64> = None;
    for &mb in mbs {
        let cand =
            Candidate { mesh: mesh.clone(), rule: rule.clone(), zero, micro_batches: mb, offload };
        if let (Some(m), Some(f)) = (missed, floor) {
            if m.rules_out(mb, f, req.budget) {
                // Evaluated after all should nothing fit anywhere (the least peak stays exact).
                if let Ok(mut d) = p.state.deferred.lock() {
                    d.push(cand);
                }
                continue;
            }
        }
        tried += 1;
        let recomputing_fit = best.is_some();
        // A smaller count's fit bounds this one's search (see `search::evaluate_within`).
        let within = best.as_ref().map_or(f64::INFINITY, Evaluated::step_time_s);
        let outcome = search::evaluate_within(p, &cand, Some(req.budget), within)?;
        if let Some(m) = outcome.miss {
            if floor.is_none() {
                // The model's state spread evenly, or what this layout's state rests at.
                let even = search::resting_floor(p, req.batch / mb, mesh.num_devices())?;
                floor = Some(even.max(search::layout_floor(p, &cand)?));
            }
            if std::env::var_os("TESSERA_TRACE").is_some() {
                let mib = |b: u64| b >> 20;
                eprintln!(
                    "trace: missed mesh {:?} {rule:?} zero {zero} mb {mb}: least peak {} MiB, \
                     resting {} MiB, floor {} MiB, budget {} MiB",
                    mesh.shape,
                    mib(m.least_peak),
                    mib(m.resting),
                    floor.map_or(0, mib),
                    mib(req.budget)
                );
            }
            missed = Some(m);
        }
        if outcome.cannot_win {
            break;
        }
        if let Some(e) = outcome.fit {
            let recomputes = e.lowered.time.recompute_s > 0.0;
            // More micro-batches can save the recomputation at most; when the step without it
            // is already slower than the fastest fit found so far, they cannot win.
            let cannot_win =
                e.step_time_s() - e.lowered.time.recompute_s > p.state.fastest.bound(rule);
            if best.as_ref().is_none_or(|b| e.step_time_s() < b.step_time_s()) {
                best = Some(e);
            }
            if !recomputes || cannot_win || !past_recompute {
                break;
            }
        }
        // One doubling past a recomputing fit: halving the activations again rarely beats
        // recomputing a few blocks, and every count costs a full evaluation.
        if recomputing_fit {
            break;
        }
    }
    Ok((tried, best))
}

/// One unit of the search, run on one thread: a mesh with its axis rule, over ZeRO stages.
#[derive(Clone)]
pub(super) enum Job {
    /// The free per-op ILP on a mesh.
    Free(Mesh),
    /// A Megatron-style `dp × ep × cp × tp` configuration (sequence parallel on or off), ZeRO
    /// over every data-parallel rank or, with `shard`, within groups of that many (hybrid
    /// sharding); `cp` > 1 only for long sequences, by ring attention with `ring` (else the
    /// all-to-all variant); `ep` > 1 only for a model with experts (the axes' grids,
    /// [`crate::axis::grid`]).
    Megatron {
        dp: usize,
        tp: usize,
        sp: bool,
        shard: Option<usize>,
        cp: usize,
        ep: usize,
        ring: bool,
    },
}

/// What one job found: per ZeRO stage that fits, the plan at its smallest fitting micro-batch
/// count, and how many (stage, micro-batch) configurations were tried.
pub(super) struct JobResult {
    pub(super) tried: usize,
    pub(super) fits: Vec<Evaluated>,
}

/// What [`first_fit`] scans: one (mesh, rule, ZeRO stage) over micro-batch counts.
#[derive(Clone, Copy)]
pub(super) struct Scan<'a> {
    pub(super) mesh: &'a Mesh,
    pub(super) rule: &'a AxisRule,
    pub(super) zero: u8,
    pub(super) mbs: &'a [usize],
    /// Model state below the device (a config string's `offload=`); the search's rounds: none.
    pub(super) offload: Option<crate::offload::Offload>,
}

/// The job's mesh, axis rule and the micro-batch counts its rule allows.
pub(super) fn job_space(
    req: &Request<'_>,
    job: &Job,
    mbs: &[usize],
) -> Result<(Mesh, AxisRule, Vec<usize>)> {
    Ok(match job {
        Job::Free(mesh) => (mesh.clone(), AxisRule::Free, mbs.to_vec()),
        Job::Megatron { dp, tp, sp, shard, cp, ep, ring } => {
            let comm = ring.then_some(crate::context::CpComm::Ring);
            let cfg = ParallelConfig::new(*dp, *tp)
                .with_sp(*sp)
                .with_shard(*shard)
                .with_cp(*cp)
                .with_ep(*ep)
                .with_cp_comm(comm);
            let replicas = dp * ep;
            let mbs =
                mbs.iter().copied().filter(|m| req.batch.is_multiple_of(m * replicas)).collect();
            (megatron_mesh(&req.cluster, &cfg)?, AxisRule::Megatron { sp: *sp, cp: *cp > 1 }, mbs)
        }
    })
}

/// ZeRO-3 at its smallest fitting micro-batch count: the most memory-frugal stage, so the one
/// most likely to fit a tight budget. The search runs it for every job first, so that the
/// fastest fit so far ([`search::FastestSoFar`]) bounds the rest of the search early.
pub(super) fn run_job_zero3(
    req: &Request<'_>,
    p: &Search<'_>,
    job: &Job,
    mbs: &[usize],
) -> Result<JobResult> {
    let (mesh, rule, mbs) = job_space(req, job, mbs)?;
    let (tried, e) = first_fit(
        req,
        p,
        Scan { mesh: &mesh, rule: &rule, zero: 3, mbs: &mbs, offload: None },
        false,
    )?;
    Ok(JobResult { tried, fits: e.into_iter().collect() })
}

/// The doubling [`first_fit`] would try past a recomputing fit, for a first-round fit: run
/// once every job's first fit is published, so the bound prunes those that cannot win.
/// Returns the counts tried (0 or 1) and the faster fit, if it found one.
pub(super) fn one_more(
    req: &Request<'_>,
    p: &Search<'_>,
    job: &Job,
    mbs: &[usize],
    fit: &Evaluated,
) -> Result<(usize, Option<Evaluated>)> {
    let (mesh, rule, mbs) = job_space(req, job, mbs)?;
    let mb = fit.candidate.micro_batches;
    let Some(&next) = mbs.iter().find(|&&m| m > mb) else { return Ok((0, None)) };
    // As in `first_fit`: more micro-batches save the recomputation at most.
    let without = fit.step_time_s() - fit.lowered.time.recompute_s;
    if fit.lowered.time.recompute_s <= 0.0 || without > p.state.fastest.bound(&rule) {
        return Ok((0, None));
    }
    let cand = Candidate {
        mesh,
        rule,
        zero: fit.candidate.zero,
        micro_batches: next,
        offload: fit.candidate.offload,
    };
    let outcome = search::evaluate_within(p, &cand, Some(req.budget), fit.step_time_s())?;
    Ok((1, outcome.fit.filter(|e| e.step_time_s() < fit.step_time_s())))
}

/// ZeRO stages 0–2 in order, each at its smallest fitting micro-batch count. A higher stage goes
/// on being tried while it pays: when the stage before needed micro-batches or recomputation
/// (or did not fit), a higher one may fit without them; and when the stage before was faster
/// than its own predecessor, the next may be faster again — the optimizer update runs on a
/// 1/dp shard from stage 1, and from stage 2 gradients are reduce-scattered (half an
/// all-reduce's traffic, so more of it hides under the backward pass). The scan stops at the
/// first stage that fits plainly and gains nothing over the one before, and at a stage whose
/// fit cannot win (slower than the bound even without its recomputation) and gains under 1%
/// over the one before (`SearchKnobs::zero_scan_min_gain`): the layout already shards what the stage would (a per-op layout
/// spreads parameters and optimizer state over every axis), so the next stage, which only
/// shards one more kind of state, is not expected to gain either. (Stage 3 is
/// [`run_job_zero3`]'s.)
pub(super) fn run_job(
    req: &Request<'_>,
    p: &Search<'_>,
    job: &Job,
    mbs: &[usize],
) -> Result<JobResult> {
    let (mesh, rule, mbs) = job_space(req, job, mbs)?;
    let mut out = JobResult { tried: 0, fits: Vec::new() };
    let mut previous: Option<f64> = None;
    // Hybrid sharding is searched as FSDP's (ZeRO-3, [`run_job_zero3`]): the job without
    // `shard` covers ZeRO-0, and `shard=N` with ZeRO-1/2 is left to config strings.
    let first = match job {
        Job::Megatron { shard: Some(_), .. } => 3,
        _ => 0,
    };
    for zero in first..=2u8 {
        let (tried, e) = first_fit(
            req,
            p,
            Scan { mesh: &mesh, rule: &rule, zero, mbs: &mbs, offload: None },
            true,
        )?;
        out.tried += tried;
        let needs_more = e
            .as_ref()
            .is_none_or(|e| e.candidate.micro_batches > 1 || e.lowered.time.recompute_s > 0.0);
        let time = e.as_ref().map(Evaluated::step_time_s);
        let gained_by =
            |share: f64| matches!((previous, time), (Some(a), Some(b)) if b < a * (1.0 - share));
        let (gained, gained_much) =
            (gained_by(1e-6), gained_by(p.problem.knobs.zero_scan_min_gain));
        let cannot_win = e.as_ref().is_some_and(|e| {
            e.step_time_s() - e.lowered.time.recompute_s > p.state.fastest.bound(&rule)
        });
        previous = time.or(previous);
        out.fits.extend(e);
        if zero >= 1 && ((!needs_more && !gained) || (cannot_win && !gained_much)) {
            break;
        }
    }
    Ok(out)
}

/// Runs every job: ZeRO-3 for all of them first (see [`run_job_zero3`]), then the lower
/// stages. Results in job order.
pub(super) fn run_jobs(
    req: &Request<'_>,
    p: &Search<'_>,
    jobs: &[Job],
    mbs: &[usize],
) -> Result<Vec<JobResult>> {
    let first = first_round(req, p, jobs, mbs)?;
    second_round(req, p, jobs, mbs, first, true)
}

/// The first round: every job under ZeRO-3 at its smallest fitting count ([`run_job_zero3`]),
/// the [`pilots`] first and their fits published as the bound of the others; then, bounded by
/// all those fits, one count more where a fit recomputes ([`one_more`]); its fits are
/// published as the second round's bound (the same whatever the timing).
pub(super) fn first_round(
    req: &Request<'_>,
    p: &Search<'_>,
    jobs: &[Job],
    mbs: &[usize],
) -> Result<Vec<JobResult>> {
    // The pilots first, alone: their fits bound every other job of the round.
    let pilots = pilots(req, p, jobs, mbs)?;
    let mut first: Vec<Option<JobResult>> = (0..jobs.len()).map(|_| None).collect();
    let exact = |on: bool| p.state.exact_pruning.store(on, std::sync::atomic::Ordering::Relaxed);
    for wave in [true, false] {
        // The pilots' bound prunes the others by its exact rules only (`exact_pruning`).
        exact(!wave && !pilots.is_empty());
        let ids: Vec<usize> = (0..jobs.len()).filter(|i| pilots.contains(i) == wave).collect();
        let ran = parallel_map(&ids, |&i| run_job_zero3(req, p, &jobs[i], mbs));
        exact(false);
        for (i, r) in ids.into_iter().zip(ran) {
            first[i] = Some(r?);
        }
        p.state.fastest.publish();
    }
    let mut first: Vec<JobResult> = first.into_iter().flatten().collect();
    let fits: Vec<(&Job, &Evaluated)> =
        jobs.iter().zip(&first).filter_map(|(j, r)| Some((j, r.fits.first()?))).collect();
    let more = parallel_map(&fits, |(j, fit)| one_more(req, p, j, mbs, fit));
    for (r, more) in first.iter_mut().filter(|r| !r.fits.is_empty()).zip(more) {
        let (tried, faster) = more?;
        r.tried += tried;
        if let Some(e) = faster {
            r.fits = vec![e];
        }
    }
    p.state.fastest.publish();
    Ok(first)
}

/// The jobs [`first_round`] runs first, by index: the `SearchKnobs::pilots` Megatron-style
/// jobs whose ILP prices their fastest layout lowest, memory aside, at their smallest
/// micro-batch count (milliseconds per job: the spaces built are the ones the evaluations
/// reuse).
///
/// Without them the first round ran every job unbounded (bounds are published between waves,
/// so that the plan does not depend on thread timing), and a model whose candidates are slow
/// to lower paid for every one in full: DeepSeek-V3's Megatron grid on 32x8xH100, one to
/// three seconds a job. The pilots' bound prunes the others by its exact rules only
/// (`SearchState::exact_pruning`: the ILP overprices ZeRO-3 layouts too much to cut by it
/// here, see its docs), which skips most of their checkpoint DPs. A Megatron fit
/// bounds every job (a free per-op plan must beat the best Megatron one,
/// [`search::FastestSoFar`]), and the Megatron grid only by its own fits, so the
/// `--baseline megatron` answer stays the grid's best. The ranking is a guess, never a
/// verdict: a pilot that does not fit leaves the bound where it was.
fn pilots(req: &Request<'_>, p: &Search<'_>, jobs: &[Job], mbs: &[usize]) -> Result<Vec<usize>> {
    let megatron: Vec<usize> =
        (0..jobs.len()).filter(|&i| matches!(jobs[i], Job::Megatron { .. })).collect();
    let pilots = p.problem.knobs.pilots;
    if pilots == 0 || megatron.len() <= pilots {
        return Ok(Vec::new());
    }
    let floors = parallel_map(&megatron, |&i| -> Result<Option<f64>> {
        let (mesh, rule, allowed) = job_space(req, &jobs[i], mbs)?;
        let Some(&mb) = allowed.first() else { return Ok(None) };
        let cand = Candidate { mesh, rule, zero: 3, micro_batches: mb, offload: None };
        search::unconstrained_objective(p, &cand)
    });
    let mut ranked: Vec<(f64, usize)> = Vec::new();
    for (&i, floor) in megatron.iter().zip(floors) {
        if let Some(s) = floor? {
            ranked.push((s, i));
        }
    }
    // Ties by job order: the same pilots whatever the timing.
    ranked.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    Ok(ranked.into_iter().take(pilots).map(|(_, i)| i).collect())
}

/// The second round: every job's lower ZeRO stages, bounded by what is published; the
/// results merged with the first round's, in job order. When nothing fitted and `deferred`
/// (no other phase has a plan), the deferred candidates are evaluated ([`run_deferred`]).
pub(super) fn second_round(
    req: &Request<'_>,
    p: &Search<'_>,
    jobs: &[Job],
    mbs: &[usize],
    first: Vec<JobResult>,
    deferred: bool,
) -> Result<Vec<JobResult>> {
    let rest: Vec<JobResult> =
        parallel_map(jobs, |j| run_job(req, p, j, mbs)).into_iter().collect::<Result<_>>()?;
    let results: Vec<JobResult> = rest
        .into_iter()
        .zip(first)
        .map(|(mut r, z3)| {
            r.tried += z3.tried;
            r.fits.extend(z3.fits);
            r
        })
        .collect();
    with_deferred(req, p, jobs, mbs, results, deferred)
}

/// `results`, with the deferred candidates evaluated when nothing fitted and `deferred` (no
/// other phase has a plan: [`run_deferred`]).
fn with_deferred(
    req: &Request<'_>,
    p: &Search<'_>,
    jobs: &[Job],
    mbs: &[usize],
    mut results: Vec<JobResult>,
    deferred: bool,
) -> Result<Vec<JobResult>> {
    if deferred && results.iter().all(|r| r.fits.is_empty()) {
        run_deferred(req, p, jobs, mbs, &mut results)?;
    }
    Ok(results)
}

/// Every job's ZeRO stages in one round (ZeRO-3 first within each job, past a recomputing fit
/// as the lower stages are), for a search whose bound another phase already set (the
/// pipeline phase, run first): two rounds would only add barriers where one thread waits for
/// the other. The results, in job order, as [`second_round`] gives them.
pub(super) fn one_round(
    req: &Request<'_>,
    p: &Search<'_>,
    jobs: &[Job],
    mbs: &[usize],
    deferred: bool,
) -> Result<Vec<JobResult>> {
    let all = parallel_map(jobs, |j| -> Result<JobResult> {
        let (mesh, rule, allowed) = job_space(req, j, mbs)?;
        let scan = Scan { mesh: &mesh, rule: &rule, zero: 3, mbs: &allowed, offload: None };
        let (tried, zero3) = first_fit(req, p, scan, true)?;
        let mut r = run_job(req, p, j, mbs)?;
        r.tried += tried;
        r.fits.extend(zero3);
        Ok(r)
    });
    let results = all.into_iter().collect::<Result<Vec<_>>>()?;
    p.state.fastest.publish();
    with_deferred(req, p, jobs, mbs, results, deferred)
}

/// When nothing fitted: the candidates deferred as hopeless ([`SearchState::hopeless`]), whose
/// model state missed the budget at a smaller micro-batch count's most frugal layout — which
/// says nothing certain about theirs. Their fits join their jobs' results; either way, every
/// candidate the search enumerates has then recorded its least peak ([`SearchState::least`]).
pub(super) fn run_deferred(
    req: &Request<'_>,
    p: &Search<'_>,
    jobs: &[Job],
    mbs: &[usize],
    results: &mut [JobResult],
) -> Result<()> {
    let mut deferred =
        p.state.deferred.lock().map(|mut d| std::mem::take(&mut *d)).unwrap_or_default();
    // In a fixed order: threads deferred them in any.
    deferred.sort_by(|a, b| a.order_key().cmp(&b.order_key()));
    let spaces: Vec<(Mesh, AxisRule)> = jobs
        .iter()
        .map(|j| job_space(req, j, mbs).map(|(mesh, rule, _)| (mesh, rule)))
        .collect::<Result<_>>()?;
    let found = parallel_map(&deferred, |c| search::evaluate_deferred(p, c, Some(req.budget)));
    for (c, e) in deferred.iter().zip(found) {
        let Some(e) = e? else { continue };
        if let Some(i) = spaces.iter().position(|(m, r)| *m == c.mesh && *r == c.rule) {
            results[i].fits.push(e);
        }
    }
    Ok(())
}

/// Every Megatron-style layout of the search: `dp × tp` within a node (sp on and off, hybrid
/// sharding across nodes), then the axes' grids ([`crate::axis::grid`]: context parallelism
/// for long sequences, expert parallelism for a model with `experts` experts per layer).
pub(super) fn megatron_jobs(req: &Request<'_>, experts: usize) -> Vec<Job> {
    let n = req.cluster.num_devices();
    let mut jobs = Vec::new();
    for tp in (1..=req.cluster.gpus_per_node.min(n)).filter(|&t| n.is_multiple_of(t)) {
        let dp = n / tp;
        // Hybrid sharding (HSDP: ZeRO-3 over the data-parallel ranks of one node, replicated
        // across nodes).
        let per_node = req.cluster.gpus_per_node / tp;
        let hybrid = (req.cluster.nodes > 1
            && req.cluster.gpus_per_node.is_multiple_of(tp)
            && per_node > 1
            && per_node < dp
            && dp.is_multiple_of(per_node))
        .then_some(per_node);
        for sp in [false, true] {
            if !(sp && tp == 1) {
                jobs.push(Job::Megatron { dp, tp, sp, shard: None, cp: 1, ep: 1, ring: false });
                if hybrid.is_some() {
                    jobs.push(Job::Megatron {
                        dp,
                        tp,
                        sp,
                        shard: hybrid,
                        cp: 1,
                        ep: 1,
                        ring: false,
                    });
                }
            }
        }
    }
    // Context parallelism, for long sequences only (the grid of short ones stays as fast);
    // expert parallelism, for a model with experts only.
    let cx = crate::axis::GridContext {
        devices: n,
        gpus_per_node: req.cluster.gpus_per_node,
        nodes: req.cluster.nodes,
        seq: req.seq,
        experts,
    };
    let grid = crate::axis::grid(&cx);
    // Ring attention where the all-to-all variant cannot go: cp × tp past the KV heads, and
    // the ring's tags fit the transport's (every ring of a Program reuses one ring's
    // 6·(cp − 1) tags: up to cp 2,729, `lower::ring::MAX_RING`).
    let kv_heads = if grid.is_empty() || !req.search.ring { None } else { kv_heads(req) };
    for cfg in grid {
        let (dp, cp, tp, ep) = (cfg.dp, cfg.cp, cfg.tp, cfg.ep);
        let ring = crate::lower::ring::supports(cp)
            && kv_heads.is_some_and(|kv| !kv.is_multiple_of(cp * tp));
        for sp in [false, true] {
            // Megatron-LM runs expert with tensor parallelism only with sequence parallelism
            // (its MoE README).
            let megatron_runs = if tp == 1 { !sp } else { sp || ep == 1 };
            if megatron_runs {
                jobs.push(Job::Megatron { dp, tp, sp, shard: None, cp, ep, ring: false });
                if ring {
                    jobs.push(Job::Megatron { dp, tp, sp, shard: None, cp, ep, ring: true });
                }
            }
        }
    }
    jobs
}

/// The KV heads of the model's first attention (`None`: it has none, or it does not build).
fn kv_heads(req: &Request<'_>) -> Option<usize> {
    let f = (req.build)(1).ok()?;
    f.graph.nodes.iter().find_map(|n| match n.op {
        tessera_ir::Op::Attention(_) if n.inputs.len() == 3 => {
            f.graph.meta(n.inputs[1]).shape.dims().get(2).copied()
        }
        _ => None,
    })
}

/// Every job of the automatic search: the free ILP on each mesh, then every Megatron layout
/// (`experts`: the model's experts per layer, 0 without).
pub(super) fn auto_jobs(req: &Request<'_>, experts: usize) -> Result<Vec<Job>> {
    let n = req.cluster.num_devices();
    let mut meshes: Vec<Mesh> = vec![Mesh::new(&req.cluster, &[n], &[])?];
    for t in 2..=req.cluster.gpus_per_node.min(n) {
        if n.is_multiple_of(t) && req.cluster.gpus_per_node.is_multiple_of(t) && t < n {
            let mesh = Mesh::new(&req.cluster, &[n / t, t], &[])?;
            // Within one node `[2, 4]` and `[4, 2]` are one mesh: the free ILP finds the same
            // plans on both, up to naming the axes.
            if !meshes.iter().any(|m| m.equivalent(&mesh)) {
                meshes.push(mesh);
            }
        }
    }
    // The free 2-D meshes are the slowest jobs: they go first so the threads stay busy.
    let mut jobs: Vec<Job> = meshes.into_iter().rev().map(Job::Free).collect();
    jobs.extend(megatron_jobs(req, experts));
    Ok(jobs)
}

// Runs `f` over `items` on the machine's threads, keeping order (`crate::par::map`).
pub(crate) use crate::par::map as parallel_map;
