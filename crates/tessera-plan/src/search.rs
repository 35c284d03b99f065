//! The search: for one mesh, ZeRO stage and micro-batch count, build the strategy ILP of the
//! forward graph ([`space`]) and solve it; over candidates, lower each solution and keep the
//! fastest Program that fits. This module is the policy: the budgets the ILP is solved under
//! (the budget, then slacks that checkpointing pays back), the bounds that prune candidates,
//! the most memory-frugal fallback and the least peak an infeasible search reports.

mod frugal;
mod megatron;
mod scan;
mod sharing;
mod slacks;
mod space;

pub use megatron::tp_strategies;
pub use scan::resting_floor;
// The data the search's phases exchange ([`crate::figures`]), under their old paths too.
pub use crate::figures::{AxisRule, Candidate, Evaluated, Forward, LeastPeak, Miss, SharedForward};

use crate::cost::CostModel;
use crate::ilp::{self, Problem, SolveOptions};
// Many micro-batches priced from a few ([`Fidelity::Priced`]); the plan picked is lowered
// exactly ([`exactly`]).
use crate::lower::{finish, lower, lower_unfinished, Fidelity, LowerOptions, Lowered};
use crate::rules::Strategy;
use crate::{Mesh, PlanError, Result};
use frugal::{frugal_candidate, frugal_fit, Frugal};
use slacks::{sharding_only, with_budget, Fit};
use space::{build_problem, Space};
use std::collections::HashMap;
use tessera_ir::{Checkpointing, CkptMode, Program};

/// One search: what it solves ([`SearchProblem`], fixed before it starts) and what its
/// threads share while it runs ([`SearchState`]). Every phase takes it whole; only the state
/// changes under it.
pub struct Search<'a> {
    pub problem: SearchProblem<'a>,
    pub state: SearchState,
}

impl<'a> Search<'a> {
    /// A search of `problem` from an empty state.
    pub fn new(problem: SearchProblem<'a>) -> Search<'a> {
        Search { problem, state: SearchState::default() }
    }

    /// A search of the same problem from an empty state but for the forward graphs and edge
    /// costs built so far, which it shares with this one (the offload phase's probes: each
    /// needs bounds and hopeless marks of its own, not graphs of its own — rebuilding and
    /// differentiating the forward graph per probe was most of a UNet's offload phase).
    pub fn sharing_graphs(&self) -> Search<'a> {
        let state = SearchState { graphs: self.state.graphs.clone(), ..SearchState::default() };
        Search { problem: self.problem.clone(), state }
    }
}

/// What the search needs besides the candidate: the model (built per micro-batch size), the
/// device, the training settings and the search's knobs. Immutable while the search runs.
#[derive(Clone)]
pub struct SearchProblem<'a> {
    /// Builds the forward graph for a given micro-batch size (global, all devices).
    pub build: &'a (dyn Fn(usize) -> Result<Forward> + Sync),
    pub batch: usize,
    pub cost: CostModel,
    pub train: tessera_ir::TrainConfig,
    /// What the phases try and where they stop.
    pub knobs: SearchKnobs,
    /// Whether and how activation checkpointing is searched.
    pub ckpt: CkptSearch,
}

/// What a search's threads share and update while it runs: the forward graphs built so far,
/// the bounds, the deferred candidates and the least peak.
#[derive(Default)]
pub struct SearchState {
    /// Forward graphs and their saved-activation sets, per micro-batch size, and what the
    /// ILPs built on them share: they depend on the model and the micro-batch alone, so
    /// searches of one request may share them ([`Search::sharing_graphs`]).
    pub graphs: std::sync::Arc<Graphs>,
    /// Step times (f64 bits) of the fastest fitting plans found so far by any job, per axis
    /// rule: the bound that lets the checkpoint search skip layouts that cannot win.
    pub fastest: FastestSoFar,
    /// (mesh, rule, ZeRO stage) whose model state alone (parameters, optimizer state: what
    /// is resting before a step) exceeds the budget at the most frugal layout: more
    /// micro-batches are unlikely to make them fit, so their further candidates are deferred.
    /// (Not certain: with more micro-batches, the most frugal layout may trade activations
    /// for a smaller state.)
    pub hopeless: std::sync::Mutex<Vec<(Mesh, AxisRule, u8)>>,
    /// Candidates skipped as hopeless, or ruled out by a smaller micro-batch count's miss
    /// ([`Miss`]): the planner evaluates them ([`evaluate_deferred`]) when nothing else fits,
    /// so that an infeasible search has seen every candidate's least peak.
    pub deferred: std::sync::Mutex<Vec<Candidate>>,
    /// The least peak any candidate that did not fit reaches ([`LeastPeak`]): what an
    /// infeasible search reports.
    pub least: std::sync::Mutex<Option<LeastPeak>>,
    /// While set, the bound prunes by its exact rules only (a plain Program slower than the
    /// bound skips the checkpoint DP; a resting state over the budget skips full recompute),
    /// not by the ILP's figures (`SearchKnobs::hopeless_over_bound`, the slacks' skip): under
    /// ZeRO-3 the ILP prices layouts up to 4× over their lowered steps (it does not see the
    /// gathers overlap the compute: llama3-8b's HSDP layout on 2x8xH100, 1.29 against 0.33 s).
    /// The first round sets it for the jobs its pilots bound (`planner::rounds::first_round`).
    pub exact_pruning: std::sync::atomic::AtomicBool,
}

/// The fastest fitting step times found so far, shared by the search's threads: the bound of
/// its branch and bound. A free per-op plan only wins by beating the best Megatron-style one
/// by 0.1% (see `planner::fastest`), and the Megatron results double as a baseline, so each
/// rule keeps its own record and is bounded by what can still change the answer.
///
/// Fits are recorded as they come, but bounds read the record as of the last
/// [`FastestSoFar::publish`] (the planner publishes between its phases). Bounds therefore do
/// not depend on which thread finished first, and neither does the plan.
#[derive(Debug)]
pub struct FastestSoFar {
    /// Recorded: [free, megatron].
    recorded: [std::sync::atomic::AtomicU64; 2],
    /// As of the last `publish`: what bounds read.
    published: [std::sync::atomic::AtomicU64; 2],
}

impl Default for FastestSoFar {
    fn default() -> Self {
        let inf = || std::sync::atomic::AtomicU64::new(f64::INFINITY.to_bits());
        FastestSoFar { recorded: [inf(), inf()], published: [inf(), inf()] }
    }
}

impl FastestSoFar {
    fn index(rule: &AxisRule) -> usize {
        match rule {
            AxisRule::Free => 0,
            AxisRule::Megatron { .. } => 1,
        }
    }

    /// Records a fitting plan's step time. Non-negative floats order like their bits.
    fn record(&self, rule: &AxisRule, step_time_s: f64) {
        self.recorded[Self::index(rule)]
            .fetch_min(step_time_s.to_bits(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Records what the pipeline phase found and publishes it as a bound: its fastest plan for
    /// per-op layouts, and its fastest with even stages — a Megatron configuration — for
    /// Megatron-style ones (a re-cut pipeline is not Megatron's, so it must not prune the
    /// Megatron grid, whose best is the `--baseline megatron` answer).
    pub fn seed_pipelined(&self, fastest_s: f64, even_s: Option<f64>) {
        self.record(&AxisRule::Free, fastest_s);
        if let Some(t) = even_s {
            self.record(&AxisRule::Megatron { sp: false, cp: false }, t);
        }
        self.publish();
    }

    /// Makes everything recorded so far the bound (call with no search thread running).
    pub fn publish(&self) {
        for (r, p) in self.recorded.iter().zip(&self.published) {
            p.store(
                r.load(std::sync::atomic::Ordering::Relaxed),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
    }

    /// A step time a plan of `rule` must beat to change the search's answer.
    pub(crate) fn bound(&self, rule: &AxisRule) -> f64 {
        let load =
            |i: usize| f64::from_bits(self.published[i].load(std::sync::atomic::Ordering::Relaxed));
        match rule {
            AxisRule::Megatron { .. } => load(1),
            AxisRule::Free => load(0).min(load(1) * (1.0 - 1e-3)),
        }
    }
}

/// What the candidates of one search share: the forward graph per micro-batch size (with its
/// saved-activation flags), and the ILPs' edge costs ([`space::EdgeCache`]).
#[derive(Default)]
pub struct Graphs {
    forwards: std::sync::Mutex<HashMap<usize, SharedForward>>,
    edges: space::EdgeCache,
    spaces: space::SpaceCache,
}

impl Search<'_> {
    /// The forward graph of one micro-batch and which of its tensors the backward pass reads
    /// (built once per micro-batch size and shared by all candidates).
    pub(crate) fn forward(&self, micro_batch: usize) -> Result<SharedForward> {
        let forwards = &self.state.graphs.forwards;
        if let Some(f) = forwards.lock().ok().and_then(|m| m.get(&micro_batch).cloned()) {
            return Ok(f);
        }
        let fwd = (self.problem.build)(micro_batch)?;
        let saved = saved_tensors(&fwd, &self.problem.train)?;
        let f = std::sync::Arc::new((fwd, saved));
        if let Ok(mut m) = forwards.lock() {
            m.insert(micro_batch, f.clone());
        }
        Ok(f)
    }
}

/// Saved activations of the global training step: forward tensors the backward pass reads.
fn saved_tensors(fwd: &Forward, train: &tessera_ir::TrainConfig) -> Result<Vec<bool>> {
    let b = tessera_ir::Builder::from_graph(fwd.graph.clone());
    let tg = tessera_ir::build_training_graph(b, fwd.loss, train)
        .map_err(|e| PlanError::Invalid(format!("differentiating the model: {e}")))?;
    let p = Program::lower(tg);
    let n = fwd.graph.tensors.len();
    Ok((0..n)
        .map(|t| {
            let buf = p.buffer_of[t].index();
            buf < n && p.role[buf] == tessera_ir::Role::SavedActivation
        })
        .collect())
}

/// Chen et al.'s √n schedule: segments of round(√L) blocks.
pub fn chen_schedule(num_blocks: u32) -> Checkpointing {
    let k = (num_blocks as f64).sqrt().round().max(1.0) as u32;
    Checkpointing::chen(num_blocks, k)
}

/// How activation checkpointing enters a search.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum CkptSearch {
    /// None: the sharding-only plan.
    Off,
    /// The same mode on every block (a fixed `ckpt=` config).
    Uniform(CkptMode),
    /// Chen et al.'s √n segments on every sharding (the `--baseline chen` search).
    Chen,
    /// Searched jointly with the sharding (the default): see [`evaluate`].
    #[default]
    Joint,
}

/// The flat search's knobs: what its phases try and where they give up, one struct instead of
/// constants in its loops (the pipeline phase has its own, `pipeline::search::PipelineKnobs`).
#[derive(Clone, Debug, PartialEq)]
pub struct SearchKnobs {
    /// Budget multipliers the sharding ILP is solved under when checkpointing may pay for the
    /// difference: the ILP then picks faster layouts that hold more activations, and the
    /// checkpoint DP brings the peak back under the real budget.
    pub slacks: Vec<f64>,
    /// A candidate whose fastest layout the ILP prices above this multiple of the fastest fit
    /// found so far is not lowered at all (the answer is "no plan that matters"). A heuristic
    /// bound, like the slacks': lowered steps ranged over 0.81–1.18× the ILP's objective in
    /// the llama searches of BENCHMARKS.md (`TESSERA_TRACE=1` prints both), so such a layout
    /// loses with a wide margin.
    pub hopeless_over_bound: f64,
    /// A ZeRO stage whose fit cannot win and is faster than the stage before by less than
    /// this share ends the job's ZeRO scan (`planner::rounds::run_job`).
    pub zero_scan_min_gain: f64,
    /// How many Megatron-style jobs the first round runs ahead of the others, their fits
    /// published as the others' bound (`planner::rounds::pilots`; 0: none, every job of the
    /// round unbounded).
    pub pilots: usize,
    /// HiGHS's limits for one ILP.
    pub solve: SolveOptions,
    /// Whether the runtime that will run the plan has a kernel for the tiled MLP
    /// (`Op::TiledMlp`, [`crate::mlp_tile`]): the CPU backend has, the CUDA backend not yet,
    /// so `tessera train --device cuda` turns this off and the planner keeps MLPs whole.
    pub tiled_mlp: bool,
    /// Routing imbalance of a mixture of experts' grouped GEMMs (`--moe-imbalance`; 1:
    /// balanced, see [`CostModel::moe_imbalance`]).
    pub moe_imbalance: f64,
    /// Whether the automatic search tries ring attention (`cp=ring`) where the all-to-all
    /// variant cannot split the KV heads. `tessera train --device cuda` turns this off: the
    /// CUDA kernels exist (a plan naming `cp=ring` runs them) but take the unfused attention,
    /// not the flash kernels, so the search does not pick them for a GPU yet.
    pub ring: bool,
}

impl Default for SearchKnobs {
    fn default() -> Self {
        SearchKnobs {
            slacks: vec![1.5, 2.5, 4.0, 8.0],
            hopeless_over_bound: 1.5,
            zero_scan_min_gain: 0.01,
            // One per thread of a 2-core machine's pool: the wave leaves no core idle.
            pilots: 2,
            // The node limit stops an ILP at the same point on a busy machine as on an idle
            // one; the time limit is the backstop, and a limit that stops HiGHS before it
            // found a plan falls back to a greedy one (`crate::ilp`).
            solve: SolveOptions {
                time_limit_s: 5.0,
                mip_rel_gap: 1e-2,
                mip_max_nodes: Some(10_000),
            },
            tiled_mlp: true,
            moe_imbalance: 1.0,
            ring: true,
        }
    }
}

/// A per-device memory budget in bytes; `None`: unbounded (a caller that only wants the
/// fastest layout). Converted to the ILP's f64 rows only inside the search.
pub type Budget = Option<u64>;

/// Builds and solves the ILP of one candidate, then lowers the solution. `Ok(None)` when no
/// plan of this candidate fits `budget`.
///
/// The joint search ([`CkptSearch::Joint`]): the sharding-only plan (the ILP under the budget,
/// tightened until the lowered Program fits), then the ILP under `budget × slack` for growing
/// slacks, each solution checkpointed by the DP under the real budget ([`crate::ckpt`]); the
/// fastest fitting Program wins. Slacks stop once the ILP's objective stops improving (memory
/// no longer binds it), so an unconstrained candidate costs one extra solve. The
/// sharding-only search ([`CkptSearch::Off`]) walks the same slacks and keeps a layout when it
/// fits as it is; a fixed schedule (`Uniform`, `Chen`) is applied to each slack's layout.
///
/// Branch and bound with [`SearchState::fastest`] (the fastest fit of the search's previous
/// phase): a layout whose plain Program is slower than the bound skips the checkpoint DP
/// (exact: recomputation only adds time), and a candidate whose ILP-fastest layout, lowered,
/// is slower skips its slacks (heuristic: it trusts the ILP's ranking of layouts). When
/// nothing fits plainly, one lowering of the ILP's most frugal layout under the most frugal
/// checkpointing decides whether anything can (and records its least peak in
/// [`SearchState::least`]); when the resting model state alone misses the budget, the (mesh,
/// rule, ZeRO stage)'s further candidates are deferred ([`SearchState::hopeless`]).
pub fn evaluate(p: &Search<'_>, cand: &Candidate, budget: Budget) -> Result<Option<Evaluated>> {
    Ok(evaluate_traced(p, cand, budget, f64::INFINITY, false)?.fit)
}

/// What [`evaluate_within`] found: the fastest fit, or how the most frugal layout missed
/// (when the search got that far: a candidate skipped by a bound says nothing of its memory).
#[derive(Debug, Default)]
pub struct Outcome {
    pub fit: Option<Evaluated>,
    pub miss: Option<Miss>,
    /// Skipped by the bound before anything was checkpointed: by the ILP's ranking no layout
    /// of this candidate is faster than what it must beat, nor of its mesh, rule and ZeRO stage
    /// with more micro-batches (which can spare recomputation, and nothing here recomputes).
    pub cannot_win: bool,
}

/// [`evaluate`] where the caller already holds a fit of `bound_s` seconds (a smaller
/// micro-batch count of the same layout): the same branch and bound as with
/// [`SearchState::fastest`], against the lower of the two.
pub fn evaluate_within(
    p: &Search<'_>,
    cand: &Candidate,
    budget: Budget,
    bound_s: f64,
) -> Result<Outcome> {
    evaluate_traced(p, cand, budget, bound_s, false)
}

/// [`evaluate`] for a candidate [`SearchState::deferred`] holds, whatever
/// [`SearchState::hopeless`] says. Its (mesh, rule, ZeRO stage)'s state missed the budget, so the
/// sharding-only ILP under the budget is skipped: the most frugal layout decides at once.
pub fn evaluate_deferred(
    p: &Search<'_>,
    cand: &Candidate,
    budget: Budget,
) -> Result<Option<Evaluated>> {
    Ok(evaluate_traced(p, cand, budget, f64::INFINITY, true)?.fit)
}

fn evaluate_traced(
    p: &Search<'_>,
    cand: &Candidate,
    budget: Budget,
    outer: f64,
    deferred: bool,
) -> Result<Outcome> {
    let t0 = std::time::Instant::now();
    let counts = || {
        use crate::trace::{on_this_thread, Work};
        (on_this_thread(Work::Lowering), on_this_thread(Work::Finish))
    };
    let before = counts();
    // The ILP's boundary: its memory rows are f64, an unbounded budget an infinite one.
    let budget = budget.map_or(f64::INFINITY, |b| b as f64);
    let miss = std::cell::Cell::new(None);
    let cannot_win = std::cell::Cell::new(false);
    let e = evaluate_candidate(p, cand, budget, outer, deferred, &miss, &cannot_win)?;
    if std::env::var_os("TESSERA_TRACE").is_some() {
        let after = counts();
        eprintln!(
            "trace: evaluated mesh {:?} {:?} zero {} mb {} in {:?} ({} lowerings, {} finishes): {}",
            cand.mesh.shape,
            cand.rule,
            cand.zero,
            cand.micro_batches,
            t0.elapsed(),
            after.0 - before.0,
            after.1 - before.1,
            e.as_ref().map_or("no fit".to_string(), |e| format!(
                "{:.4} s, recompute {:.4} s, peak {:.2} GiB",
                e.step_time_s(),
                e.lowered.time.recompute_s,
                e.peak_bytes() as f64 / (1u64 << 30) as f64
            )),
        );
    }
    if let Some(e) = &e {
        p.state.fastest.record(&cand.rule, e.step_time_s());
    }
    Ok(Outcome { fit: e, miss: miss.get(), cannot_win: cannot_win.get() })
}

fn evaluate_candidate(
    p: &Search<'_>,
    cand: &Candidate,
    budget: f64,
    outer: f64,
    deferred: bool,
    miss: &std::cell::Cell<Option<Miss>>,
    cannot_win: &std::cell::Cell<bool>,
) -> Result<Option<Evaluated>> {
    // What a plan of this candidate must beat to matter.
    let bound = p.state.fastest.bound(&cand.rule).min(outer);
    let mb = cand.micro_batches.max(1);
    if !p.problem.batch.is_multiple_of(mb) {
        return Ok(None);
    }
    let key = (cand.mesh.clone(), cand.rule.clone(), cand.zero);
    if !deferred && p.state.hopeless.lock().is_ok_and(|h| h.contains(&key)) {
        if let Ok(mut d) = p.state.deferred.lock() {
            d.push(cand.clone());
        }
        return Ok(None);
    }
    let shared = p.forward(p.problem.batch / mb)?;
    let (fwd, saved) = (&shared.0, &shared.1);
    let g = &fwd.graph;
    let mesh = &cand.mesh;
    let space = p.state.graphs.spaces.get(p.problem.batch / mb, g, mesh, &cand.rule)?;
    if space.options.contains(&0) {
        return Ok(None);
    }
    // Every layout's resting state misses the budget, at every micro-batch count: hopeless,
    // and deferred like the counts after it. Only with a fit elsewhere (a finite bound), as
    // in `frugal_fit`: a search where nothing fits reports the least peak its lowerings
    // reached (a pinned config's error names it).
    if !deferred
        && bound.is_finite()
        && cand.offload.is_none()
        && scan::layout_floor(g, mesh, &space, cand.zero) as f64 > budget
    {
        if let Ok(mut h) = p.state.hopeless.lock() {
            h.push(key);
        }
        if let Ok(mut d) = p.state.deferred.lock() {
            d.push(cand.clone());
        }
        return Ok(None);
    }
    let t0 = std::time::Instant::now();
    // One problem for every solve of this candidate: only its budget changes between them
    // (cloning its memory rows, quadratic in the decisions, per solve was a visible cost).
    let mut problem = build_problem(p, cand, fwd, &space, saved, budget)?;
    let t_build = t0.elapsed();
    // The ILP's fastest layout, memory aside: no layout of this candidate is faster by its
    // figures. One more solve (milliseconds) can spare every lowering of a candidate that
    // cannot win ([`SearchKnobs::hopeless_over_bound`]).
    // With a finite cut the solve stops at the LP bound when that already exceeds it.
    let heuristic = !p.state.exact_pruning.load(std::sync::atomic::Ordering::Relaxed);
    let hopeless = if heuristic { p.problem.knobs.hopeless_over_bound } else { f64::INFINITY };
    let cut = hopeless * bound;
    let unconstrained = with_budget(&mut problem, f64::INFINITY, |pr| {
        ilp::solve_below(pr, &p.problem.knobs.solve, cut)
    })?;
    // Without a budget every layout fits: `None` under a finite cut is a layout priced above it.
    let cut_off = unconstrained.as_ref().map_or(cut.is_finite(), |s| s.objective > cut);
    if cut_off {
        return Ok(None);
    }

    let lopts = plain_options(p, cand);
    let found = |strategies: Vec<Option<Strategy>>, lowered: Lowered, objective: f64| Evaluated {
        candidate: cand.clone(),
        strategies,
        lowered,
        ilp_objective_s: objective,
    };
    let nb = tessera_ir::remat::num_blocks(g);
    // A schedule fixed in advance (the ILP does not model it, so it is applied afterwards).
    let fixed_mode = match &p.problem.ckpt {
        CkptSearch::Uniform(m) if *m != CkptMode::None => Some(Checkpointing::uniform(nb, *m)),
        CkptSearch::Chen => Some(chen_schedule(nb)),
        _ => None,
    };
    // This candidate's fastest fit so far (a bound for the checkpoint search, like
    // `p.state.fastest` across candidates).
    let local_best = std::cell::Cell::new(f64::INFINITY);
    // Lowers one ILP solution under the policy: `None` when it does not fit.
    let finish_policy = |strategies: &[Option<Strategy>]| -> Result<Option<Lowered>> {
        let u = lower_unfinished(g, fwd.loss, strategies, mesh, &lopts, Fidelity::Priced)?;
        match (&p.problem.ckpt, &fixed_mode) {
            (_, Some(schedule)) => {
                let l = finish(&u, schedule, mesh, &p.problem.cost)?;
                Ok((l.memory.peak_bytes as f64 <= budget || !budget.is_finite()).then_some(l))
            }
            (CkptSearch::Joint, None) if budget.is_finite() => {
                let bound = bound.min(local_best.get());
                crate::ckpt::choose(&u, mesh, &p.problem.cost, budget as u64, bound)
            }
            _ => {
                let l = finish(&u, &Checkpointing::default(), mesh, &p.problem.cost)?;
                Ok((l.memory.peak_bytes as f64 <= budget || !budget.is_finite()).then_some(l))
            }
        }
    };

    // Whether the layout of `picks`, lowered without recomputation, is slower than the bound.
    let fastest_over_bound = |picks: &[usize]| -> Result<bool> {
        let strategies = space.assignment(picks);
        let l = lower(g, fwd.loss, &strategies, mesh, &p.problem.cost, &lopts, Fidelity::Priced)?;
        Ok(l.time.step_time_s > bound)
    };

    // 1. The sharding-only plan (not for a deferred candidate: see `evaluate_deferred`).
    let mut best: Option<Evaluated> = None;
    let mut plain_objective = None;
    if fixed_mode.is_none() && !deferred {
        let (fit, objective) = sharding_only(p, cand, &mut problem, &space, fwd, budget, t_build)?;
        plain_objective = objective;
        if let Some((strategies, lowered, objective)) = fit {
            local_best.set(lowered.time.step_time_s);
            best = Some(found(strategies, lowered, objective));
        }
    }
    if !budget.is_finite() {
        return Ok(best);
    }
    let joint = matches!(p.problem.ckpt, CkptSearch::Joint);
    // Nothing to checkpoint: no slack can pay for itself.
    let blockless = nb == 0 && joint;
    let frugal_may_win = cand.zero == 3 && cand.rule == AxisRule::Free && !blockless;
    if let (Some(b), Some(_), true) = (&best, plain_objective, frugal_may_win) {
        // The ILP's cost is an estimate (it does not see how a lowered step overlaps
        // collectives with compute), and under ZeRO-3 on a free mesh its most memory-frugal
        // layout — parameters sharded over every axis, gathered hierarchically — can be faster
        // once lowered than the layout it thinks fastest. It costs one more lowering.
        if let Some(sol) = ilp::min_peak(&problem, &p.problem.knobs.solve)? {
            let strategies = space.assignment(&sol.picks);
            if strategies != b.strategies {
                if let Some(l) = finish_policy(&strategies)? {
                    if l.time.step_time_s < b.step_time_s() {
                        local_best.set(l.time.step_time_s);
                        best = Some(found(strategies, l, sol.objective));
                    }
                }
            }
        }
    }
    // The most frugal layout, once lowered and checkpointed as the candidate's first fit: a
    // slack whose ILP picks it again (a third of DeepSeek-V3's repeated lowerings) would
    // checkpoint the same Program under a bound no looser, so it is not lowered again.
    let mut frugal_layout = None;
    // The same question as the slacks' (step 2 below), asked before the most frugal layout is
    // lowered and checkpointed, where that layout is no faster than the fastest: on a free mesh
    // below ZeRO-3 (under ZeRO-3 it can be, `frugal_may_win`). When the fastest layout, lowered,
    // cannot beat the bound, neither can the frugal layout's checkpointings: the candidate
    // cannot win, and more micro-batches will not change that ([`Outcome::cannot_win`]). On
    // DeepSeek-V3 it skips three of the six free-mesh candidates that planned 17-36x over the
    // bound.
    let fastest_first = best.is_none()
        && !deferred
        && !blockless
        && cand.rule == AxisRule::Free
        && cand.zero < 3
        && bound.is_finite()
        && heuristic;
    let mut fastest_checked = false;
    if let (true, Some(free)) = (fastest_first, &unconstrained) {
        if fastest_over_bound(&free.picks)? {
            cannot_win.set(true);
            return Ok(None);
        }
        fastest_checked = true;
    }
    if best.is_none() {
        let (strategies, l, objective) =
            match frugal_candidate(p, cand, &problem, &space, fwd, budget, bound)? {
                Ok(fit) => fit,
                Err(frugal::Missed { miss: missed, plain_s }) => {
                    miss.set(missed);
                    // With one layout, its step without recomputation is the least any count
                    // of it reaches (more micro-batches only add to it, the rule that ends
                    // `first_fit`'s scan after a fit): slower than the bound, it cannot win.
                    // DeepSeek-V3's Megatron grid has one layout per job, most of them
                    // 1.5-7x over the bound.
                    if space.single_layout() && plain_s.is_some_and(|s| s > bound) {
                        cannot_win.set(true);
                    }
                    return Ok(None);
                }
            };
        // A fitting plan: the slacks below look for faster ones.
        local_best.set(l.time.step_time_s);
        frugal_layout = Some(strategies.clone());
        best = Some(found(strategies, l, objective));
        plain_objective = None;
    }
    if blockless {
        return Ok(best);
    }

    // 2. Checkpointing buys memory back: the ILP under growing slack, each solution
    //    checkpointed to fit. The unconstrained objective says when to stop. Without
    //    checkpointing (`Off`) the same layouts are lowered as they are: the ILP's memory rows
    //    are conservative, so a layout solved under a looser budget can still fit this one
    //    (and be faster than the one solved under it).
    let Some(free) = unconstrained else { return Ok(best) };
    let unconstrained = free.objective;
    if best.is_some() && plain_objective.is_some_and(|o| o <= unconstrained * (1.0 + 1e-3)) {
        // Memory never bound the sharding: recomputation could only slow it down.
        return Ok(best);
    }
    if bound.is_finite() && heuristic && !fastest_checked && fastest_over_bound(&free.picks)? {
        // By the ILP's ranking, its fastest layout without recomputation is as fast as this
        // candidate gets (recomputation only adds time; the slacks' layouts rank slower).
        // When another candidate already beats it, the slacks are skipped. (A heuristic bound,
        // unlike the others: it trusts the ILP's ranking, which the lowering refines.)
        return Ok(best);
    }
    // Without a sharding-only fit (or with a fixed mode, which the ILP does not model) the
    // budget's own layout is the first to checkpoint.
    let walk = slacks::Walk {
        cand,
        space: &space,
        budget,
        bound,
        hopeless,
        unconstrained,
        from_budget: fixed_mode.is_some() || (plain_objective.is_none() && joint),
        plain_objective,
        frugal_layout: frugal_layout.as_deref(),
    };
    walk.run(p, &mut problem, &local_best, &finish_policy, &mut best)?;
    Ok(best)
}

/// How `cand` lowers before any checkpointing: its ZeRO stage, micro-batches and offload, the
/// problem's optimizer.
fn plain_options(p: &Search<'_>, cand: &Candidate) -> LowerOptions {
    LowerOptions {
        zero: cand.zero,
        micro_batches: cand.micro_batches.max(1),
        train: p.problem.train.clone(),
        ckpt: Checkpointing::default(),
        offload: cand.offload,
    }
}

/// The error for a config whose candidate cannot be lowered: why `cand`'s rule cannot split
/// the model on its mesh (a Megatron layout whose heads or features its tensor-parallel degree
/// does not divide), or else the general reason.
pub fn cannot_split(p: &Search<'_>, cand: &Candidate, config: &str) -> PlanError {
    let mb = cand.micro_batches.max(1);
    let why = p
        .forward(p.problem.batch / mb)
        .and_then(|shared| Ok(Space::new(&shared.0.graph, &cand.mesh, &cand.rule)?.unsplittable));
    PlanError::Invalid(match why {
        Ok(Some(why)) => format!("`{config}` cannot split this model: {why}"),
        _ => format!(
            "`{config}` cannot split this model: a degree does not divide the batch, heads or \
             hidden size"
        ),
    })
}

/// The least peak this candidate reaches in the search ([`LeastPeak`]: the ILP's most
/// memory-frugal layout under the most frugal checkpointing the policy accepts); `None` when
/// the model does not split this way.
pub fn min_peak(p: &Search<'_>, cand: &Candidate) -> Result<Option<u64>> {
    let Some((shared, space, problem)) = unbudgeted(p, cand)? else { return Ok(None) };
    let fwd = &shared.0;
    let Some(sol) = ilp::min_peak(&problem, &p.problem.knobs.solve)? else { return Ok(None) };
    let strategies = space.assignment(&sol.picks);
    let lopts = plain_options(p, cand);
    let u =
        lower_unfinished(&fwd.graph, fwd.loss, &strategies, &cand.mesh, &lopts, Fidelity::Priced)?;
    // Nothing fits a negative budget: the answer is the least peak.
    Ok(Some(match frugal_fit(p, &u, &cand.mesh, -1.0, f64::INFINITY)? {
        Frugal::Misses { least, .. } => least.0,
        Frugal::Fits(l) => l.memory.peak_bytes,
    }))
}

/// The least bytes any layout of `cand`'s mesh, rule and ZeRO stage rests on a device before
/// a step ([`scan::layout_floor`]); 0 with offload (its state rests below the device) or
/// where the model does not split this way.
pub fn layout_floor(p: &Search<'_>, cand: &Candidate) -> Result<u64> {
    let mb = cand.micro_batches.max(1);
    if cand.offload.is_some() || !p.problem.batch.is_multiple_of(mb) {
        return Ok(0);
    }
    let shared = p.forward(p.problem.batch / mb)?;
    let g = &shared.0.graph;
    let space = p.state.graphs.spaces.get(p.problem.batch / mb, g, &cand.mesh, &cand.rule)?;
    if space.options.contains(&0) {
        return Ok(0);
    }
    Ok(scan::layout_floor(g, &cand.mesh, &space, cand.zero))
}

/// The ILP's fastest layout of `cand` with memory aside: its objective (seconds), a floor of
/// what the candidate's Programs cost by the ILP's figures. `None` when the candidate has no
/// layout (a micro-batch count that does not divide the batch, an op without a strategy).
pub fn unconstrained_objective(p: &Search<'_>, cand: &Candidate) -> Result<Option<f64>> {
    let Some((_, _, problem)) = unbudgeted(p, cand)? else { return Ok(None) };
    Ok(ilp::solve_below(&problem, &p.problem.knobs.solve, f64::INFINITY)?.map(|s| s.objective))
}

/// `cand`'s forward graph, ILP space and ILP without a budget; `None` when the candidate has
/// no layout (a micro-batch count that does not divide the batch, an op without a strategy).
fn unbudgeted(
    p: &Search<'_>,
    cand: &Candidate,
) -> Result<Option<(SharedForward, std::sync::Arc<Space>, Problem)>> {
    let mb = cand.micro_batches.max(1);
    if !p.problem.batch.is_multiple_of(mb) {
        return Ok(None);
    }
    let shared = p.forward(p.problem.batch / mb)?;
    let (fwd, saved) = (&shared.0, &shared.1);
    let space =
        p.state.graphs.spaces.get(p.problem.batch / mb, &fwd.graph, &cand.mesh, &cand.rule)?;
    if space.options.contains(&0) {
        return Ok(None);
    }
    let problem = build_problem(p, cand, fwd, &space, saved, f64::INFINITY)?;
    Ok(Some((shared, space, problem)))
}

/// `e` with its Program lowered exactly (the same layout, ZeRO stage, micro-batches and
/// checkpointing): `e` itself when it already is.
pub fn exactly(p: &Search<'_>, e: &Evaluated) -> Result<Evaluated> {
    if e.lowered.exact {
        return Ok(e.clone());
    }
    let mb = e.candidate.micro_batches.max(1);
    let shared = p.forward(p.problem.batch / mb)?;
    let fwd = &shared.0;
    let opts = LowerOptions {
        zero: e.candidate.zero,
        micro_batches: mb,
        train: p.problem.train.clone(),
        ckpt: e.lowered.ckpt.clone(),
        offload: e.candidate.offload,
    };
    let lowered = lower(
        &fwd.graph,
        fwd.loss,
        &e.strategies,
        &e.candidate.mesh,
        &p.problem.cost,
        &opts,
        Fidelity::Exact,
    )?;
    Ok(Evaluated { lowered, ..e.clone() })
}
