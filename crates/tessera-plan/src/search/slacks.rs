//! A candidate's slacks (step 2 of [`super::evaluate`]): checkpointing buys memory back, so the
//! ILP is solved under growing multiples of the budget and each solution lowered and
//! checkpointed to fit it; and the sharding-only plan before them (step 1), the ILP under the
//! budget tightened by each miss of the lowered peak.

use super::space::Space;
use super::{Candidate, Evaluated, Forward, Search};
use crate::ilp::{self, Problem};
use crate::lower::{lower, Fidelity, Lowered};
use crate::rules::Strategy;
use crate::Result;
use std::cell::Cell;

/// Lowers and checkpoints one layout under the candidate's policy (`None`: it does not fit).
pub(super) type Finish<'a> = dyn Fn(&[Option<Strategy>]) -> Result<Option<Lowered>> + 'a;

/// What the slacks of one candidate walk from: the bounds, the ILP's fastest objective (memory
/// aside: where the walk stops) and what the steps before found.
pub(super) struct Walk<'a> {
    pub(super) cand: &'a Candidate,
    pub(super) space: &'a Space,
    pub(super) budget: f64,
    /// What a plan of the candidate must beat, and the ILP's cut over it (`hopeless × bound`;
    /// infinite under exact pruning).
    pub(super) bound: f64,
    pub(super) hopeless: f64,
    pub(super) unconstrained: f64,
    /// Whether the budget's own layout is the first to checkpoint (no sharding-only fit, or a
    /// fixed checkpointing the ILP does not model).
    pub(super) from_budget: bool,
    /// The ILP's objective under the budget, where the sharding-only plan fitted.
    pub(super) plain_objective: Option<f64>,
    /// The most frugal layout, when it was lowered and checkpointed as the first fit.
    pub(super) frugal_layout: Option<&'a [Option<Strategy>]>,
}

impl Walk<'_> {
    /// Walks the slacks, keeping the fastest fit in `best` (and its time in `local_best`, the
    /// checkpoint search's bound): each ILP solution not priced over the cut and new is
    /// finished by `finish` (`None`: it does not fit, nor will a looser slack's layout, which
    /// holds more).
    pub(super) fn run(
        self,
        p: &Search<'_>,
        problem: &mut Problem,
        local_best: &Cell<f64>,
        finish: &Finish<'_>,
        best: &mut Option<Evaluated>,
    ) -> Result<()> {
        let Walk { cand, space, budget, bound, hopeless, unconstrained, .. } = self;
        let (mesh, mb) = (&cand.mesh, cand.micro_batches.max(1));
        let slacks: Vec<f64> = match self.from_budget {
            true => [1.0].into_iter().chain(p.problem.knobs.slacks.iter().copied()).collect(),
            false => p.problem.knobs.slacks.clone(),
        };
        let mut last = if self.from_budget { None } else { self.plain_objective };
        for slack in slacks {
            // A layout the ILP prices hopelessly above what it must beat is not worth its MIP,
            // nor its lowering (the rule the unconstrained layout met before the walk); the LP
            // bound says so before the MIP runs. Looser slacks may still price lower.
            let cutoff = hopeless * bound.min(local_best.get());
            let sol = with_budget(problem, budget * slack, |pr| {
                ilp::solve_below(pr, &p.problem.knobs.solve, cutoff)
            })?;
            let Some(sol) = sol else { continue };
            if last.is_some_and(|o| sol.objective >= o * (1.0 - 1e-3)) {
                // The same layout as the tighter budget gave (or no faster): nothing new.
                if sol.objective <= unconstrained * (1.0 + 1e-3) {
                    break;
                }
                continue;
            }
            last = Some(sol.objective);
            let strategies = space.assignment(&sol.picks);
            if self.frugal_layout == Some(strategies.as_slice()) {
                // Already the candidate's fit: no faster here, and a looser slack may differ.
                if sol.objective <= unconstrained * (1.0 + 1e-3) {
                    break;
                }
                continue;
            }
            let finished = finish(&strategies)?;
            if std::env::var_os("TESSERA_TRACE").is_some() {
                eprintln!(
                    "trace: mesh {:?} {:?} zero {} mb {mb}: slack {slack}, ilp {:.4} s (fastest \
                     {unconstrained:.4}), lowered {}",
                    mesh.shape,
                    cand.rule,
                    cand.zero,
                    sol.objective,
                    finished.as_ref().map_or("no fit".into(), |l| format!(
                        "{:.4} s, recompute {:.4} s",
                        l.time.step_time_s, l.time.recompute_s
                    )),
                );
            }
            match finished {
                Some(lowered) => {
                    if best.as_ref().is_none_or(|b| lowered.time.step_time_s < b.step_time_s()) {
                        local_best.set(lowered.time.step_time_s);
                        *best = Some(Evaluated {
                            candidate: cand.clone(),
                            strategies,
                            lowered,
                            ilp_objective_s: sol.objective,
                        });
                    }
                }
                // A looser budget's layout holds more, so it would not fit either.
                None => break,
            }
            if sol.objective <= unconstrained * (1.0 + 1e-3) {
                break;
            }
        }
        Ok(())
    }
}

/// `solve` on `problem` under `budget`, the problem's own budget restored afterwards (the
/// search's solves differ only in their budgets: setting it in place spares a copy of the
/// problem per solve).
pub(super) fn with_budget<T>(
    problem: &mut Problem,
    budget: f64,
    solve: impl FnOnce(&Problem) -> Result<T>,
) -> Result<T> {
    let own = std::mem::replace(&mut problem.budget, budget);
    let out = solve(problem);
    problem.budget = own;
    out
}

/// A layout, lowered, with its ILP objective.
pub(super) type Fit = (Vec<Option<Strategy>>, Lowered, f64);

/// The sharding-only plan of a candidate: the ILP under the budget, tightened by each miss of
/// the lowered Program's simulated peak (four tries). Returns the fitting layout, if any, and
/// the objective of the ILP's first solution (`None`: the ILP has none under the budget).
pub(super) fn sharding_only(
    p: &Search<'_>,
    cand: &Candidate,
    problem: &mut Problem,
    space: &Space,
    fwd: &Forward,
    budget: f64,
    t_build: std::time::Duration,
) -> Result<(Option<Fit>, Option<f64>)> {
    let (g, mesh, mb) = (&fwd.graph, &cand.mesh, cand.micro_batches.max(1));
    let lopts = super::plain_options(p, cand);
    let mut target = budget;
    let mut plain_objective = None;
    // The last layout lowered and its peak: a tightened budget that gives the ILP the same
    // layout again misses by the same bytes, so it is tightened again without a lowering.
    let mut missed: Option<(Vec<Option<Strategy>>, f64)> = None;
    for _ in 0..4 {
        let t1 = std::time::Instant::now();
        let sol = with_budget(problem, target, |pr| ilp::solve(pr, &p.problem.knobs.solve))?;
        let Some(sol) = sol else { break };
        let t_solve = t1.elapsed();
        let strategies = space.assignment(&sol.picks);
        if let Some((_, peak)) = missed.as_ref().filter(|(s, _)| *s == strategies) {
            target *= (budget / peak) * 0.98;
            continue;
        }
        let lowered =
            lower(g, fwd.loss, &strategies, mesh, &p.problem.cost, &lopts, Fidelity::Priced)?;
        if std::env::var_os("TESSERA_TRACE").is_some() {
            eprintln!(
                "trace: mesh {:?} {:?} zero {} mb {}: {} vars, build {:?} solve {:?} lower {:?} ilp {:.4} lowered {:.4} peak {:.2}/{:.2} GiB",
                mesh.shape,
                cand.rule,
                cand.zero,
                mb,
                problem.choices.len(),
                t_build,
                t_solve,
                t1.elapsed() - t_solve,
                sol.objective,
                lowered.time.step_time_s,
                lowered.memory.peak_bytes as f64 / (1u64 << 30) as f64,
                budget / (1u64 << 30) as f64,
            );
        }
        plain_objective.get_or_insert(sol.objective);
        let peak = lowered.memory.peak_bytes as f64;
        if peak <= budget || !budget.is_finite() {
            return Ok((Some((strategies, lowered, sol.objective)), plain_objective));
        }
        // The ILP's estimate missed the simulated peak: tighten its budget by the miss.
        target *= (budget / peak) * 0.98;
        missed = Some((strategies, peak));
    }
    Ok((None, plain_objective))
}
