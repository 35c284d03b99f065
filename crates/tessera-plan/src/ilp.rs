//! The strategy ILP (Alpa-style): pick one strategy per decision, minimising the summed
//! per-decision and pairwise (resharding) costs in seconds, under per-device memory rows.
//!
//! **Model.** A binary `x[i][s]` per decision `i` and strategy `s`, with `Σ_s x[i][s] = 1`. Each
//! pairwise [`Edge`] gets continuous `e[s][t] ≥ 0` tied to both endpoints by their marginals,
//! `Σ_t e[s][t] = x[from][s]` and `Σ_s e[s][t] = x[to][t]` (the last of these is implied and
//! left out): with `x` integral, `e` is the indicator of the chosen pair, and the relaxation is
//! the tight "local polytope". The objective is `Σ cost·x + Σ edge_cost·e`; every [`MemRow`] is
//! `constant + Σ bytes·x ≤ budget`.
//!
//! **Reductions** (none changes the optimum):
//! - a strategy that alone breaks some memory row (even with every other decision at its
//!   smallest) is removed, repeated until nothing changes;
//! - a strategy *dominated* by another of the same decision — no more cost, no more pairwise
//!   cost against each strategy of each neighbour, no more bytes in each memory row — is
//!   removed (ties keep the lowest index): switching an optimal plan from the dominated to the
//!   dominating strategy never costs more nor breaks a row;
//! - a decision left with one strategy is a constant: no variable, its edges become linear
//!   costs on the neighbour, its bytes become row constants;
//! - edges between the same pair are summed; an edge whose matrix is separable
//!   (`c[s][t] = a[s] + b[t]`, all-zero included) is folded into the two decisions' costs;
//! - per decision the smallest cost and per row the smallest bytes are taken out as constants,
//!   and rows that hold for every plan are dropped.
//!
//! **Search.** With no memory row left and the edges forming a forest (chains, trees), dynamic
//! programming finds the exact optimum without HiGHS (2000 × 8 chain: ~30 ms). Otherwise min-sum
//! diffusion ([`diffusion`]) comes first: its lower bound (at most the LP relaxation's) may
//! already prove a caller's cutoff, and without memory rows its decoded plan is the answer when
//! within the MIP gap of that bound, else HiGHS's starting plan. With memory rows,
//! the LP relaxation comes first: rounded per decision to the fewest bytes among the strategies
//! it uses, repaired greedily until every row fits and polished by improving single switches,
//! it is a first plan — the answer if within the MIP gap of the LP bound. Then HiGHS solves the
//! MIP restricted to the strategies the relaxation uses (RENS, 40% of the time left), and
//! finally the full MIP, each started from the best plan so far. Every HiGHS plan is repaired
//! (if a row is over by HiGHS's tolerance) and polished the same way.
//!
//! **Numerics.** Memory rows are divided by the budget (by the first plan's peak in
//! [`min_peak`]), costs by a typical (median, nonzero) coefficient, capped so that no scaled cost
//! exceeds 1e6; HiGHS's feasibility tolerances are 1e-9. A plan *fits* when every row is at
//! most `budget + 1e-9·max(|budget|, 1)` ([`fits`], the same test [`brute_force`] uses, and the
//! bound handed to HiGHS and the heuristics). The returned objective and peak are recomputed
//! exactly from the picks with [`evaluate`], and the picks are checked with [`fits`]: should a
//! plan still not fit, the search is redone with the budget lowered by the overshoot (twice at
//! most, then an error); if that lowered budget is infeasible, the answer is `None` — in that
//! pathological case the least memory any plan needs is within about 1e-8 of the budget, which
//! [`min_peak`] then reports. Costs below HiGHS's dual tolerance (1e-7 of the scaled costs) are
//! noise to it: plans whose objectives differ by less may be mistaken for one another.
//!
//! **Solver.** HiGHS through `good_lp` 1.15 (its `highs` feature): the modelling layer is
//! enough, and its `set_option` reaches every HiGHS option needed. Silent (`output_flag` and
//! `log_to_console` off), one thread (deterministic), the feasibility-jump heuristic off (we hand
//! HiGHS a plan instead), its presolve off (the reductions above did the useful part; its own
//! took three quarters of the time on 2-D-mesh ILPs), with the time limit and relative MIP gap
//! of [`SolveOptions`] (`mip_rel_gap = 0` also sets `mip_abs_gap = 0`: a proven optimum). The
//! gap is relative to the whole objective: HiGHS sees the reduced one, so it also gets the
//! matching absolute gap (the relative gap times the LP bound plus the reductions' constant).
//! When a limit stops the search — the time limit, or the node limit
//! ([`SolveOptions::mip_max_nodes`], which stops every run at the same point whatever the
//! machine's load) — the best plan found is returned; without one, a greedy plan (per decision
//! the cheapest strategy, else the fewest bytes, repaired until every row fits, polished); only
//! when neither fits, an error.

use crate::PlanError;

mod diffusion;
mod local;
mod model;
mod reduce;

use local::Local;
use reduce::{Mode, Reduced};

/// One decision: pick exactly one strategy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Choice {
    /// Seconds per strategy (already multiplied by the repetition count).
    pub cost: Vec<f64>,
}

/// Pairwise cost between two decisions' strategies (e.g. resharding): `cost[s_from][s_to]`
/// seconds. `from == to` is allowed and charges the diagonal `cost[s][s]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Edge {
    pub from: usize,
    pub to: usize,
    pub cost: Vec<Vec<f64>>,
}

/// A memory constraint: `constant + Σ_terms bytes[node][s]·x[node][s] ≤ budget`. One row per
/// point in program order whose peak must be bounded (liveness-aware: the caller builds rows).
/// A node may appear in several terms of one row; its bytes add up.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemRow {
    pub constant: f64,
    pub terms: Vec<(usize, Vec<f64>)>,
}

/// Decisions, pairwise costs, memory rows and the per-device budget in bytes
/// (`f64::INFINITY` for none).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Problem {
    pub choices: Vec<Choice>,
    pub edges: Vec<Edge>,
    pub memory: Vec<MemRow>,
    pub budget: f64,
}

/// A plan: one strategy per decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Solution {
    /// The strategy picked for each decision.
    pub picks: Vec<usize>,
    /// Seconds, recomputed exactly from `picks` ([`evaluate`]).
    pub objective: f64,
    /// Bytes: the largest memory row's value (0 without rows).
    pub peak: f64,
}

/// Limits for HiGHS.
#[derive(Debug, Clone, PartialEq)]
pub struct SolveOptions {
    /// Wall-clock limit in seconds for one search (LP relaxation, RENS and MIP share it).
    pub time_limit_s: f64,
    /// Relative MIP gap at which the search stops (0: prove optimality), relative to the whole
    /// objective: the constants the reductions take out count, so a gap of 1% means 1% of the
    /// plan's estimated step time, not of the part that still depends on the choices.
    pub mip_rel_gap: f64,
    /// Branch-and-bound nodes after which HiGHS stops and returns its best plan (`None`: no
    /// limit). Unlike the time limit, it stops every run at the same point whatever the
    /// machine's load.
    pub mip_max_nodes: Option<u64>,
}

impl Default for SolveOptions {
    fn default() -> Self {
        SolveOptions { time_limit_s: 10.0, mip_rel_gap: 1e-4, mip_max_nodes: None }
    }
}

/// Relative slack on the budget under which a plan still fits (see [`fits`]).
pub const FIT_REL_TOL: f64 = 1e-9;

/// HiGHS's feasibility tolerance on the scaled (÷ budget) rows.
const HIGHS_FEAS_TOL: f64 = 1e-9;

/// How many times [`solve`] lowers the budget after HiGHS returned a plan that does not fit.
const MAX_RETRIES: usize = 2;

/// Share of the time left that the MIP restricted to the relaxation's strategies (RENS) gets.
const RENS_SHARE: f64 = 0.4;

/// Sweeps of min-sum diffusion at most ([`diffusion`]); each costs about one pass over the
/// edges' matrices (~0.25 ms on gpt2-xl's 2-D mesh ILP), and it usually settles in 10–20.
const DIFFUSION_SWEEPS: usize = 50;

/// Largest scaled cost handed to HiGHS (relative to the typical cost, which is 1).
const MAX_SCALED_COST: f64 = 1e6;

fn tolerance(budget: f64) -> f64 {
    FIT_REL_TOL * budget.abs().max(1.0)
}

fn row_value(row: &MemRow, picks: &[usize]) -> f64 {
    row.constant + row.terms.iter().map(|(n, b)| b[picks[*n]]).sum::<f64>()
}

/// The objective (seconds) and peak (bytes, the largest row; 0 without rows) of `picks`.
/// Panics if `picks` does not index every decision's strategies.
pub fn evaluate(p: &Problem, picks: &[usize]) -> (f64, f64) {
    assert_eq!(picks.len(), p.choices.len(), "one pick per choice");
    let mut objective: f64 = p.choices.iter().zip(picks).map(|(c, &s)| c.cost[s]).sum();
    objective += p.edges.iter().map(|e| e.cost[picks[e.from]][picks[e.to]]).sum::<f64>();
    let peak = p.memory.iter().map(|r| row_value(r, picks)).reduce(f64::max).unwrap_or(0.0);
    (objective, peak)
}

/// Whether every memory row of `picks` is within the budget (`+ 1e-9·max(|budget|, 1)`).
pub fn fits(p: &Problem, picks: &[usize]) -> bool {
    let limit = p.budget + tolerance(p.budget);
    p.memory.iter().all(|r| row_value(r, picks) <= limit)
}

fn solution(p: &Problem, picks: Vec<usize>) -> Solution {
    let (objective, peak) = evaluate(p, &picks);
    Solution { picks, objective, peak }
}

/// Exhaustive oracle for tests: the least-objective plan that [`fits`] (the first found among
/// ties, in lexicographic order of picks), or `None` if none fits. Exponential.
pub fn brute_force(p: &Problem) -> Option<Solution> {
    let mut best: Option<Solution> = None;
    for_each_pick(p, |picks| {
        if fits(p, picks) {
            let (objective, _) = evaluate(p, picks);
            if best.as_ref().is_none_or(|b| objective < b.objective) {
                best = Some(solution(p, picks.to_vec()));
            }
        }
    });
    best
}

/// Calls `f` on every combination of picks, in lexicographic order (nothing if a decision has
/// no strategy).
pub fn for_each_pick(p: &Problem, mut f: impl FnMut(&[usize])) {
    let sizes: Vec<usize> = p.choices.iter().map(|c| c.cost.len()).collect();
    if sizes.contains(&0) {
        return;
    }
    let mut picks = vec![0; sizes.len()];
    loop {
        f(&picks);
        let mut i = sizes.len();
        loop {
            if i == 0 {
                return;
            }
            i -= 1;
            picks[i] += 1;
            if picks[i] < sizes[i] {
                break;
            }
            picks[i] = 0;
        }
    }
}

fn invalid(msg: String) -> PlanError {
    PlanError::Invalid(format!("strategy ILP: {msg}"))
}

fn validate(p: &Problem) -> Result<(), PlanError> {
    let n = p.choices.len();
    let finite = |v: &[f64]| v.iter().all(|x| x.is_finite());
    for (i, c) in p.choices.iter().enumerate() {
        if c.cost.is_empty() {
            return Err(invalid(format!("choice {i} has no strategy")));
        }
        if !finite(&c.cost) {
            return Err(invalid(format!("choice {i} has a cost that is not finite")));
        }
    }
    for (k, e) in p.edges.iter().enumerate() {
        if e.from >= n || e.to >= n {
            return Err(invalid(format!("edge {k} names a choice beyond the {n} there are")));
        }
        let (rows, cols) = (p.choices[e.from].cost.len(), p.choices[e.to].cost.len());
        if e.cost.len() != rows || e.cost.iter().any(|r| r.len() != cols) {
            return Err(invalid(format!("edge {k}'s cost matrix is not {rows}x{cols}")));
        }
        if !e.cost.iter().all(|r| finite(r)) {
            return Err(invalid(format!("edge {k} has a cost that is not finite")));
        }
    }
    for (k, r) in p.memory.iter().enumerate() {
        if !r.constant.is_finite() {
            return Err(invalid(format!("memory row {k}'s constant is not finite")));
        }
        for (node, bytes) in &r.terms {
            if *node >= n || bytes.len() != p.choices[*node].cost.len() {
                return Err(invalid(format!("memory row {k} has a term that matches no choice")));
            }
            if !finite(bytes) {
                return Err(invalid(format!("memory row {k} has bytes that are not finite")));
            }
        }
    }
    if p.budget.is_nan() || p.budget == f64::NEG_INFINITY {
        return Err(invalid(format!("the memory budget is {}: give bytes or +inf", p.budget)));
    }
    Ok(())
}

/// The least-cost plan that [`fits`] the budget; `Ok(None)`: no plan fits. Errors: a malformed
/// problem ([`PlanError::Invalid`]), or HiGHS failing or finding no plan in the time limit
/// ([`PlanError::Internal`]).
pub fn solve(p: &Problem, opts: &SolveOptions) -> Result<Option<Solution>, PlanError> {
    solve_below(p, opts, f64::INFINITY)
}

/// [`solve`] for a caller that wants no plan whose objective exceeds `cutoff` seconds:
/// `Ok(None)` also when the LP relaxation's bound proves that none of the plans that fit is
/// that cheap (no MIP is then solved), or when the plan found is not. Exact with respect to the
/// ILP: a `None` here means no fitting plan of objective ≤ `cutoff` exists.
pub fn solve_below(
    p: &Problem,
    opts: &SolveOptions,
    cutoff: f64,
) -> Result<Option<Solution>, PlanError> {
    validate(p)?;
    let tol = tolerance(p.budget);
    let mut budget = p.budget;
    for _ in 0..=MAX_RETRIES {
        let Some(picks) = solve_under(p, budget, opts, cutoff)? else {
            return Ok(None);
        };
        if fits(p, &picks) {
            let s = solution(p, picks);
            return Ok((s.objective <= cutoff).then_some(s));
        }
        let (_, peak) = evaluate(p, &picks);
        budget -= (peak - p.budget) + tol;
    }
    Err(PlanError::Internal(format!(
        "strategy ILP: HiGHS kept returning plans over the memory budget after {MAX_RETRIES} \
         retries with a lowered budget"
    )))
}

/// The plan whose largest memory row is least (costs and budget ignored): the least memory any
/// plan needs. `Ok(None)` never happens for a valid problem (every plan is a candidate); with
/// no memory rows every plan needs 0 bytes and the cheapest one is returned. If the time limit
/// stops HiGHS, the best plan found so far is returned (its peak is then an upper bound).
pub fn min_peak(p: &Problem, opts: &SolveOptions) -> Result<Option<Solution>, PlanError> {
    validate(p)?;
    if p.memory.is_empty() {
        let unbounded = Problem { budget: f64::INFINITY, ..p.clone() };
        return solve(&unbounded, opts);
    }
    let red = Reduced::new(p, None, Mode::Peak)?.expect("min_peak never prunes");
    let picks = red.solve_min_peak(opts)?;
    Ok(Some(solution(p, picks)))
}

fn solve_under(
    p: &Problem,
    budget: f64,
    opts: &SolveOptions,
    cutoff: f64,
) -> Result<Option<Vec<usize>>, PlanError> {
    let budget = budget.is_finite().then_some(budget);
    match Reduced::new(p, budget, Mode::Cost)? {
        None => Ok(None),
        Some(mut red) => {
            // The reductions shift the objective by a constant: measure it on any plan.
            let first = vec![0; red.alive.len()];
            red.offset = evaluate(p, &red.picks(|_| 0)).0 - Local::new(&red).cost(&first);
            red.solve_min_cost(opts, cutoff)
        }
    }
}

fn argmax(values: impl Iterator<Item = f64>) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (k, v) in values.enumerate() {
        if v > best.1 {
            best = (k, v);
        }
    }
    best.0
}
