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

use std::collections::BTreeMap;
use std::time::Instant;

use good_lp::solvers::highs::HighsProblem;
use good_lp::{
    highs, variable, Expression, ProblemVariables, ResolutionError, Solution as _, SolverModel,
    Variable, WithInitialSolution,
};

use crate::PlanError;

mod diffusion;

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

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Minimise cost under the budget.
    Cost,
    /// Minimise the largest row; costs do not matter.
    Peak,
}

/// A memory row with one term per node, summed: `(node, bytes per strategy)`.
struct Row {
    constant: f64,
    terms: Vec<(usize, Vec<f64>)>,
}

/// The problem after the reductions, in "alive" strategy indices.
struct Reduced {
    /// Per node: the original indices of the strategies kept.
    alive: Vec<Vec<usize>>,
    /// Per node (with more than one strategy): the cost of each kept strategy, edges folded in.
    lin: Vec<Vec<f64>>,
    /// Edges between two nodes with several strategies each: `(a, b, cost[s_a][s_b])`, `a < b`.
    edges: Vec<(usize, usize, Vec<Vec<f64>>)>,
    /// Rows over nodes with several strategies; constants absorb the rest.
    rows: Vec<Row>,
    /// Cost mode: the budget rows are bounded by; `None` for no bound.
    budget: Option<f64>,
    /// Cost mode: the original objective minus the reduced one (the same for every plan).
    offset: f64,
}

impl Reduced {
    /// `None` when the reductions prove that no plan fits.
    fn new(p: &Problem, budget: Option<f64>, mode: Mode) -> Result<Option<Reduced>, PlanError> {
        let n = p.choices.len();
        let sizes: Vec<usize> = p.choices.iter().map(|c| c.cost.len()).collect();
        // Rows with one term per node, in original strategy indices.
        let rows: Vec<Row> = p
            .memory
            .iter()
            .map(|r| {
                let mut terms: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
                for (node, bytes) in &r.terms {
                    let acc = terms.entry(*node).or_insert_with(|| vec![0.0; bytes.len()]);
                    acc.iter_mut().zip(bytes).for_each(|(a, b)| *a += b);
                }
                Row { constant: r.constant, terms: terms.into_iter().collect() }
            })
            .collect();
        let mut alive: Vec<Vec<bool>> = sizes.iter().map(|&s| vec![true; s]).collect();

        // 1. Strategies that alone break a row.
        if let Some(budget) = budget {
            let limit = budget + tolerance(budget);
            for _round in 0..50 {
                let mut changed = false;
                for row in &rows {
                    let mins: Vec<f64> =
                        row.terms.iter().map(|(node, b)| min_alive(b, &alive[*node])).collect();
                    let slack = limit - row.constant - mins.iter().sum::<f64>();
                    if slack < 0.0 {
                        return Ok(None);
                    }
                    for ((node, b), m) in row.terms.iter().zip(&mins) {
                        for (s, &bytes) in b.iter().enumerate() {
                            if alive[*node][s] && bytes - m > slack {
                                alive[*node][s] = false;
                                changed = true;
                            }
                        }
                    }
                }
                if !changed {
                    break;
                }
            }
            if alive.iter().any(|a| !a.contains(&true)) {
                return Ok(None);
            }
        }

        // 2. Dominated strategies. Per node, a comparison vector per strategy: cost (with any
        //    self-edge's diagonal), pairwise cost against each alive neighbour strategy, bytes per
        //    row. Costs are left out when minimising the peak.
        let mut features: Vec<Vec<Vec<f64>>> = sizes.iter().map(|&s| vec![Vec::new(); s]).collect();
        if mode == Mode::Cost {
            for (i, c) in p.choices.iter().enumerate() {
                for (s, &cost) in c.cost.iter().enumerate() {
                    let diag: f64 = p
                        .edges
                        .iter()
                        .filter(|e| e.from == i && e.to == i)
                        .map(|e| e.cost[s][s])
                        .sum();
                    features[i][s].push(cost + diag);
                }
            }
            for e in p.edges.iter().filter(|e| e.from != e.to) {
                for s in 0..sizes[e.from] {
                    for t in 0..sizes[e.to] {
                        if alive[e.to][t] {
                            features[e.from][s].push(e.cost[s][t]);
                        }
                        if alive[e.from][s] {
                            features[e.to][t].push(e.cost[s][t]);
                        }
                    }
                }
            }
        }
        // Without a budget, bytes only matter when minimising the peak.
        for row in rows.iter().filter(|_| budget.is_some() || mode == Mode::Peak) {
            for (node, b) in &row.terms {
                for (s, &bytes) in b.iter().enumerate() {
                    features[*node][s].push(bytes);
                }
            }
        }
        for i in 0..n {
            let f = &features[i];
            let dominated: Vec<bool> = (0..sizes[i])
                .map(|s| {
                    alive[i][s]
                        && (0..sizes[i]).any(|t| {
                            t != s && alive[i][t] && {
                                let le = f[t].iter().zip(&f[s]).all(|(a, b)| a <= b);
                                le && (t < s || f[t] != f[s])
                            }
                        })
                })
                .collect();
            for (a, d) in alive[i].iter_mut().zip(dominated) {
                *a &= !d;
            }
        }
        drop(features);
        let alive: Vec<Vec<usize>> = alive
            .iter()
            .map(|a| a.iter().enumerate().filter(|(_, &k)| k).map(|(s, _)| s).collect())
            .collect();
        let multi = |i: usize| alive[i].len() > 1;

        // 3. Linear costs, with single-strategy neighbours and separable edges folded in.
        let mut lin: Vec<Vec<f64>> = vec![Vec::new(); n];
        let mut edges = Vec::new();
        if mode == Mode::Cost {
            for i in (0..n).filter(|&i| multi(i)) {
                lin[i] = alive[i].iter().map(|&s| p.choices[i].cost[s]).collect();
            }
            let mut pairs: BTreeMap<(usize, usize), Vec<Vec<f64>>> = BTreeMap::new();
            for e in &p.edges {
                let (f, t) = (e.from, e.to);
                if f == t {
                    if multi(f) {
                        for (k, &s) in alive[f].iter().enumerate() {
                            lin[f][k] += e.cost[s][s];
                        }
                    }
                } else if multi(f) && multi(t) {
                    let (a, b) = (f.min(t), f.max(t));
                    let m = pairs
                        .entry((a, b))
                        .or_insert_with(|| vec![vec![0.0; alive[b].len()]; alive[a].len()]);
                    for (ka, &sa) in alive[a].iter().enumerate() {
                        for (kb, &sb) in alive[b].iter().enumerate() {
                            m[ka][kb] += if f == a { e.cost[sa][sb] } else { e.cost[sb][sa] };
                        }
                    }
                } else if multi(f) {
                    let st = alive[t][0];
                    for (k, &s) in alive[f].iter().enumerate() {
                        lin[f][k] += e.cost[s][st];
                    }
                } else if multi(t) {
                    let sf = alive[f][0];
                    for (k, &s) in alive[t].iter().enumerate() {
                        lin[t][k] += e.cost[sf][s];
                    }
                }
            }
            for ((a, b), m) in pairs {
                let big = m.iter().flatten().fold(0.0f64, |x, y| x.max(y.abs()));
                let separable = m.iter().enumerate().all(|(s, row)| {
                    row.iter()
                        .enumerate()
                        .all(|(t, &c)| (c - m[s][0] - m[0][t] + m[0][0]).abs() <= 1e-12 * big)
                });
                if separable {
                    for (s, row) in m.iter().enumerate() {
                        lin[a][s] += row[0];
                    }
                    for t in 0..m[0].len() {
                        lin[b][t] += m[0][t] - m[0][0];
                    }
                } else {
                    edges.push((a, b, m));
                }
            }
            // Constant offsets do not matter: the smallest cost per node becomes 0.
            for l in lin.iter_mut() {
                let lo = l.iter().copied().fold(f64::INFINITY, f64::min);
                l.iter_mut().for_each(|c| *c -= lo);
            }
        }

        // 4. Rows over multi-strategy nodes, smallest bytes taken out as constants.
        let mut out_rows = Vec::new();
        for row in rows {
            let mut constant = row.constant;
            let mut terms = Vec::new();
            let mut most = 0.0;
            for (node, b) in row.terms {
                let kept: Vec<f64> = alive[node].iter().map(|&s| b[s]).collect();
                let lo = kept.iter().copied().fold(f64::INFINITY, f64::min);
                constant += lo;
                if kept.len() > 1 {
                    let shifted: Vec<f64> = kept.iter().map(|v| v - lo).collect();
                    let hi = shifted.iter().copied().fold(0.0, f64::max);
                    if hi > 0.0 {
                        most += hi;
                        terms.push((node, shifted));
                    }
                }
            }
            match budget {
                Some(budget) => {
                    if constant > budget + tolerance(budget) {
                        return Ok(None);
                    }
                    // A row that holds for every plan is no constraint.
                    if !terms.is_empty() && constant + most > budget {
                        out_rows.push(Row { constant, terms });
                    }
                }
                None if mode == Mode::Peak => out_rows.push(Row { constant, terms }),
                None => {}
            }
        }
        Ok(Some(Reduced { alive, lin, edges, rows: out_rows, budget, offset: 0.0 }))
    }

    fn picks(&self, chosen: impl Fn(usize) -> usize) -> Vec<usize> {
        (0..self.alive.len())
            .map(
                |i| {
                    if self.alive[i].len() > 1 {
                        self.alive[i][chosen(i)]
                    } else {
                        self.alive[i][0]
                    }
                },
            )
            .collect()
    }

    /// One-hot variables (binary, or in [0, 1] for the LP relaxation) for every node with several
    /// strategies; those not `allowed` are fixed to 0.
    fn one_hot(
        &self,
        vars: &mut ProblemVariables,
        integral: bool,
        allowed: Option<&[Vec<bool>]>,
    ) -> Vec<Vec<Variable>> {
        let def = if integral { variable().binary() } else { variable().min(0.0).max(1.0) };
        (0..self.alive.len())
            .map(|i| {
                let ok = |k: usize| allowed.is_none_or(|a| a[i][k]);
                (0..self.alive[i].len())
                    .filter(|_| self.alive[i].len() > 1)
                    .map(|k| vars.add(if ok(k) { def.clone() } else { def.clone().max(0.0) }))
                    .collect()
            })
            .collect()
    }

    fn memory_scale(&self) -> f64 {
        match self.budget {
            Some(b) if b > 0.0 => b,
            _ => self
                .rows
                .iter()
                .map(|r| {
                    r.constant.abs()
                        + r.terms.iter().flat_map(|(_, b)| b).fold(0.0f64, |a, &b| a.max(b))
                })
                .fold(1.0, f64::max),
        }
    }

    /// The least-cost picks; `None` when none fits, or when the LP relaxation proves that no
    /// plan that fits costs at most `cutoff` (whole objective, seconds).
    fn solve_min_cost(
        &self,
        opts: &SolveOptions,
        cutoff: f64,
    ) -> Result<Option<Vec<usize>>, PlanError> {
        if self.alive.iter().all(|a| a.len() == 1) {
            return Ok(Some(self.picks(|_| 0)));
        }
        let local = Local::new(self);
        if self.rows.is_empty() {
            if let Some(ks) = local.forest_dp() {
                return Ok(Some(self.picks(|i| ks[i])));
            }
        }
        let start = Instant::now();
        let left = || opts.time_limit_s - start.elapsed().as_secs_f64();
        let gap = opts.mip_rel_gap.max(0.0);
        let mut best: Option<(Vec<usize>, f64)> = None;
        let offer = |ks: Vec<usize>, best: &mut Option<(Vec<usize>, f64)>| {
            let cost = local.cost(&ks);
            if local.fits(&ks) && best.as_ref().is_none_or(|(_, c)| cost < *c) {
                *best = Some((ks, cost));
            }
        };
        let offset = self.offset;
        let done = |best: &Option<(Vec<usize>, f64)>, bound: f64| {
            best.as_ref().is_some_and(|(_, c)| c - bound <= gap * (c + offset).abs())
        };
        // HiGHS sees the reduced objective: its absolute gap is the relative gap of the whole.
        let mut abs_gap = f64::INFINITY;
        // Min-sum diffusion bounds every plan's cost, memory aside, in milliseconds: a cutoff
        // it proves spares every solve; without memory rows its plan is the answer when within
        // the gap of its bound, and else starts the MIP. (With rows and no cutoff it has
        // nothing to offer.)
        let cut = cutoff * (1.0 + 1e-9);
        let diffused = (self.rows.is_empty() || cutoff.is_finite())
            .then(|| diffusion::diffuse(&self.lin, &self.edges, DIFFUSION_SWEEPS, cut - offset));
        if diffused.as_ref().is_some_and(|d| d.bound + offset > cut) {
            return Ok(None);
        }
        if let (true, Some(diffused)) = (self.rows.is_empty(), diffused) {
            offer(diffused.plan, &mut best);
            if done(&best, diffused.bound) {
                return Ok(best.map(|(ks, _)| self.picks(|i| ks[i])));
            }
            abs_gap = gap * (diffused.bound + offset).abs();
            // The LP relaxation's bound may still prove the cutoff where diffusion stalled
            // below it (every plan costs at least the bound), sparing the MIP.
            if cutoff.is_finite() {
                if let Some(bound) = self.lp_bound(opts) {
                    if bound + offset > cutoff * (1.0 + 1e-9) {
                        return Ok(None);
                    }
                    abs_gap = gap * (bound.max(diffused.bound) + offset).abs();
                }
            }
        } else {
            // Memory rows make the relaxation fractional. Its rounding (repaired, polished) is a
            // first plan; a MIP over the strategies the relaxation uses (RENS) a better one.
            let (model, x, links) = self.cost_model(false, opts, left(), None, abs_gap);
            let sol = match model.solve() {
                Err(ResolutionError::Infeasible) => return Ok(None),
                Err(_) => None, // e.g. out of time: leave it to the MIP
                Ok(sol) => Some(sol),
            };
            if let Some(sol) = sol {
                let xv: Vec<Vec<f64>> =
                    x.iter().map(|xi| xi.iter().map(|&v| sol.value(v)).collect()).collect();
                let mut bound: f64 = xv
                    .iter()
                    .zip(&self.lin)
                    .flat_map(|(a, b)| a.iter().zip(b))
                    .map(|(a, b)| a * b)
                    .sum();
                for ((_, _, m), (_, _, e)) in self.edges.iter().zip(&links) {
                    for (mr, er) in m.iter().zip(e) {
                        bound += mr.iter().zip(er).map(|(c, &v)| c * sol.value(v)).sum::<f64>();
                    }
                }
                if let Some(ks) = local.round(&xv) {
                    offer(ks, &mut best);
                }
                if bound + offset > cutoff * (1.0 + 1e-9) {
                    return Ok(None);
                }
                abs_gap = gap * (bound + offset).abs();
                if done(&best, bound) {
                    return Ok(best.map(|(ks, _)| self.picks(|i| ks[i])));
                }
                let support: Vec<Vec<bool>> =
                    xv.iter().map(|x| x.iter().map(|&v| v > 1e-6).collect()).collect();
                let within =
                    |ks: &[usize]| ks.iter().zip(&support).all(|(&k, s)| s.is_empty() || s[k]);
                let hint = best.as_ref().map(|(ks, _)| ks.as_slice()).filter(|ks| within(ks));
                if let Ok(Some(mut ks)) =
                    self.mip(opts, RENS_SHARE * left(), Some(&support), hint, abs_gap)
                {
                    local.settle(&mut ks);
                    offer(ks, &mut best);
                }
                if done(&best, bound) {
                    return Ok(best.map(|(ks, _)| self.picks(|i| ks[i])));
                }
            }
        }
        if left() <= 0.0 && best.is_some() {
            return Ok(best.map(|(ks, _)| self.picks(|i| ks[i])));
        }
        let hint = best.as_ref().map(|(ks, _)| ks.as_slice());
        match self.mip(opts, left(), None, hint, abs_gap) {
            Ok(Some(mut ks)) => {
                // HiGHS may break a row by its tolerance: repair, then polish.
                local.settle(&mut ks);
                if best.is_none() && !local.fits(&ks) {
                    return Ok(Some(self.picks(|i| ks[i]))); // solve() lowers the budget
                }
                offer(ks, &mut best);
                Ok(best.map(|(ks, _)| self.picks(|i| ks[i])))
            }
            Ok(None) => Ok(None),
            Err(_) if best.is_some() => Ok(best.map(|(ks, _)| self.picks(|i| ks[i]))),
            // HiGHS stopped (time or node limit) before any plan: the greedy one, if it fits.
            Err(e) => match local.fallback() {
                Some(ks) => Ok(Some(self.picks(|i| ks[i]))),
                None => Err(highs_error(e, opts)),
            },
        }
    }

    /// The LP relaxation's optimum of the reduced objective (a lower bound of every plan's
    /// reduced cost); `None` when HiGHS does not solve it (out of time, numerical trouble).
    fn lp_bound(&self, opts: &SolveOptions) -> Option<f64> {
        let (model, x, links) =
            self.cost_model(false, opts, opts.time_limit_s, None, f64::INFINITY);
        let sol = model.solve().ok()?;
        let mut bound: f64 = x
            .iter()
            .zip(&self.lin)
            .flat_map(|(xi, li)| xi.iter().zip(li))
            .map(|(&v, c)| sol.value(v) * c)
            .sum();
        for ((_, _, m), (_, _, e)) in self.edges.iter().zip(&links) {
            for (mr, er) in m.iter().zip(e) {
                bound += mr.iter().zip(er).map(|(c, &v)| c * sol.value(v)).sum::<f64>();
            }
        }
        Some(bound)
    }

    /// The cost MIP, optionally restricted to `allowed` strategies and started from `hint`:
    /// `Ok(None)` if infeasible.
    fn mip(
        &self,
        opts: &SolveOptions,
        time_limit_s: f64,
        allowed: Option<&[Vec<bool>]>,
        hint: Option<&[usize]>,
        abs_gap: f64,
    ) -> Result<Option<Vec<usize>>, ResolutionError> {
        let (mut model, x, links) = self.cost_model(true, opts, time_limit_s, allowed, abs_gap);
        if let Some(ks) = hint {
            let one = |b: bool| if b { 1.0 } else { 0.0 };
            let mut start = Vec::new();
            for (xi, &k) in x.iter().zip(ks) {
                start.extend(xi.iter().enumerate().map(|(s, &v)| (v, one(s == k))));
            }
            for (a, b, e) in &links {
                for (s, er) in e.iter().enumerate() {
                    let row = er.iter().enumerate();
                    start.extend(row.map(|(t, &v)| (v, one(s == ks[*a] && t == ks[*b]))));
                }
            }
            model = model.with_initial_solution(start);
        }
        match model.solve() {
            Ok(sol) => {
                Ok(Some(x.iter().map(|xi| argmax(xi.iter().map(|&v| sol.value(v)))).collect()))
            }
            Err(ResolutionError::Infeasible) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The cost-minimising model: one-hot `x` (binary, or in [0, 1] for the LP relaxation),
    /// marginal edge variables and memory rows.
    #[allow(clippy::type_complexity)]
    fn cost_model(
        &self,
        integral: bool,
        opts: &SolveOptions,
        time_limit_s: f64,
        allowed: Option<&[Vec<bool>]>,
        abs_gap: f64,
    ) -> (HighsProblem, Vec<Vec<Variable>>, Vec<(usize, usize, Vec<Vec<Variable>>)>) {
        // Scale costs by a typical (median nonzero) magnitude, keeping the largest ≤ 1e6.
        let mut mags: Vec<f64> = self
            .lin
            .iter()
            .flatten()
            .chain(self.edges.iter().flat_map(|(_, _, m)| m.iter().flatten()))
            .map(|c| c.abs())
            .filter(|&c| c > 0.0)
            .collect();
        let cost_scale = if mags.is_empty() {
            1.0
        } else {
            let mid = mags.len() / 2;
            let median = *mags.select_nth_unstable_by(mid, f64::total_cmp).1;
            let max = mags.iter().copied().fold(0.0, f64::max);
            median.max(max / MAX_SCALED_COST)
        };
        let mem_scale = self.memory_scale();

        let mut vars = ProblemVariables::new();
        let x = self.one_hot(&mut vars, integral, allowed);
        let mut objective = Expression::with_capacity(self.lin.iter().map(Vec::len).sum());
        for (xi, li) in x.iter().zip(&self.lin) {
            for (&v, &c) in xi.iter().zip(li) {
                if c != 0.0 {
                    objective.add_mul(c / cost_scale, v);
                }
            }
        }
        let mut links = Vec::new();
        for (a, b, m) in &self.edges {
            let e: Vec<Vec<Variable>> = m
                .iter()
                .map(|row| vars.add_vector(variable().min(0.0).max(1.0), row.len()))
                .collect();
            for (er, mr) in e.iter().zip(m) {
                for (&v, &c) in er.iter().zip(mr) {
                    if c != 0.0 {
                        objective.add_mul(c / cost_scale, v);
                    }
                }
            }
            links.push((*a, *b, e));
        }
        let mut model = configure(highs(vars.minimise(objective)), opts, time_limit_s);
        if abs_gap.is_finite() && opts.mip_rel_gap > 0.0 {
            model = model.set_option("mip_abs_gap", abs_gap / cost_scale);
        }
        self.add_one_hot(&mut model, &x);
        for (a, b, e) in &links {
            // Σ_t e[s][t] = x[a][s]; Σ_s e[s][t] = x[b][t] (the last one is implied).
            for (s, row) in e.iter().enumerate() {
                let mut ex = Expression::with_capacity(row.len() + 1);
                row.iter().for_each(|&v| ex.add_mul(1.0, v));
                ex.add_mul(-1.0, x[*a][s]);
                model.add_constraint(ex.eq(0.0));
            }
            for t in 0..x[*b].len() - 1 {
                let mut ex = Expression::with_capacity(e.len() + 1);
                e.iter().for_each(|row| ex.add_mul(1.0, row[t]));
                ex.add_mul(-1.0, x[*b][t]);
                model.add_constraint(ex.eq(0.0));
            }
        }
        let budget = self.budget.unwrap_or(f64::INFINITY);
        for row in &self.rows {
            let ex = row_expression(row, &x, mem_scale);
            let rhs = budget + tolerance(budget) - row.constant;
            model.add_constraint(ex.leq(rhs / mem_scale));
        }
        (model, x, links)
    }

    fn solve_min_peak(&self, opts: &SolveOptions) -> Result<Vec<usize>, PlanError> {
        if self.alive.iter().all(|a| a.len() == 1) {
            return Ok(self.picks(|_| 0));
        }
        // A first plan (fewest bytes per node) starts HiGHS, and its peak scales the rows, so
        // that the peak variable is about 1 and byte differences stay well above tolerances.
        let local = Local::new(self);
        let first = local.fewest_bytes();
        let first_peak = local.row_values(&first).into_iter().fold(f64::NEG_INFINITY, f64::max);
        let mem_scale = if first_peak.abs() >= 1.0 { first_peak.abs() } else { 1.0 };
        let mut vars = ProblemVariables::new();
        let x = self.one_hot(&mut vars, true, None);
        // Every row is at least its constant.
        let floor = self.rows.iter().map(|r| r.constant).fold(f64::NEG_INFINITY, f64::max);
        let m = vars.add(variable().min(floor / mem_scale));
        let mut model = configure(highs(vars.minimise(m)), opts, opts.time_limit_s);
        self.add_one_hot(&mut model, &x);
        for row in self.rows.iter().filter(|r| !r.terms.is_empty()) {
            let mut ex = row_expression(row, &x, mem_scale);
            ex.add_mul(-1.0, m);
            model.add_constraint(ex.leq(-row.constant / mem_scale));
        }
        let mut start = vec![(m, first_peak / mem_scale)];
        for (xi, &k) in x.iter().zip(&first) {
            start.extend(xi.iter().enumerate().map(|(s, &v)| (v, if s == k { 1.0 } else { 0.0 })));
        }
        let model = model.with_initial_solution(start);
        let ks: Vec<usize> = match model.solve() {
            Ok(sol) => x.iter().map(|xi| argmax(xi.iter().map(|&v| sol.value(v)))).collect(),
            Err(ResolutionError::Other("NoSolutionFound")) => first.clone(),
            Err(e) => return Err(highs_error(e, opts)),
        };
        let peak =
            |ks: &[usize]| local.row_values(ks).into_iter().fold(f64::NEG_INFINITY, f64::max);
        let ks = if peak(&ks) <= peak(&first) { ks } else { first };
        Ok(self.picks(|i| ks[i]))
    }

    fn add_one_hot(&self, model: &mut impl SolverModel, x: &[Vec<Variable>]) {
        for xi in x.iter().filter(|xi| !xi.is_empty()) {
            let mut ex = Expression::with_capacity(xi.len());
            xi.iter().for_each(|&v| ex.add_mul(1.0, v));
            model.add_constraint(ex.eq(1.0));
        }
    }
}

/// The reduced problem's plans by index into `alive`, for exact dynamic programming on forests
/// and the rounding, repair and polishing heuristics.
struct Local<'a> {
    red: &'a Reduced,
    /// Per node: `(edge, whether the node is the edge's first end)`.
    adj: Vec<Vec<(usize, bool)>>,
    /// Per node: `(row, term)` where it appears.
    member: Vec<Vec<(usize, usize)>>,
    limit: f64,
}

impl<'a> Local<'a> {
    fn new(red: &'a Reduced) -> Self {
        let n = red.alive.len();
        let mut adj = vec![Vec::new(); n];
        for (k, (a, b, _)) in red.edges.iter().enumerate() {
            adj[*a].push((k, true));
            adj[*b].push((k, false));
        }
        let mut member = vec![Vec::new(); n];
        for (r, row) in red.rows.iter().enumerate() {
            for (t, (node, _)) in row.terms.iter().enumerate() {
                member[*node].push((r, t));
            }
        }
        let limit = red.budget.map_or(f64::INFINITY, |b| b + tolerance(b));
        Local { red, adj, member, limit }
    }

    fn size(&self, i: usize) -> usize {
        self.red.alive[i].len()
    }

    /// Cost of a plan (up to the constants the reductions took out).
    fn cost(&self, ks: &[usize]) -> f64 {
        let lin: f64 =
            self.red.lin.iter().zip(ks).filter(|(l, _)| !l.is_empty()).map(|(l, &k)| l[k]).sum();
        lin + self.red.edges.iter().map(|(a, b, m)| m[ks[*a]][ks[*b]]).sum::<f64>()
    }

    fn row_values(&self, ks: &[usize]) -> Vec<f64> {
        let rows = &self.red.rows;
        rows.iter()
            .map(|r| r.constant + r.terms.iter().map(|(i, b)| b[ks[*i]]).sum::<f64>())
            .collect()
    }

    fn fits(&self, ks: &[usize]) -> bool {
        self.row_values(ks).iter().all(|&v| v <= self.limit)
    }

    /// Change in cost when node `i` switches to strategy `k`.
    fn delta(&self, ks: &[usize], i: usize, k: usize) -> f64 {
        let cur = ks[i];
        let mut d = self.red.lin[i][k] - self.red.lin[i][cur];
        for &(e, first) in &self.adj[i] {
            let (a, b, m) = &self.red.edges[e];
            d += if first { m[k][ks[*b]] - m[cur][ks[*b]] } else { m[ks[*a]][k] - m[ks[*a]][cur] };
        }
        d
    }

    /// Whether switching `i` to `k` leaves no row it grows over the budget.
    fn move_fits(&self, rowv: &[f64], ks: &[usize], i: usize, k: usize) -> bool {
        self.member[i].iter().all(|&(r, t)| {
            let b = &self.red.rows[r].terms[t].1;
            b[k] <= b[ks[i]] || rowv[r] + b[k] - b[ks[i]] <= self.limit
        })
    }

    fn apply(&self, rowv: &mut [f64], ks: &mut [usize], i: usize, k: usize) {
        for &(r, t) in &self.member[i] {
            let b = &self.red.rows[r].terms[t].1;
            rowv[r] += b[k] - b[ks[i]];
        }
        ks[i] = k;
    }

    /// Without memory rows and with a forest of edges: the exact optimum by dynamic programming.
    fn forest_dp(&self) -> Option<Vec<usize>> {
        let n = self.red.alive.len();
        let edges = &self.red.edges;
        let mut root: Vec<usize> = (0..n).collect();
        fn find(root: &mut [usize], mut i: usize) -> usize {
            while root[i] != i {
                root[i] = root[root[i]];
                i = root[i];
            }
            i
        }
        for (a, b, _) in edges {
            let (ra, rb) = (find(&mut root, *a), find(&mut root, *b));
            if ra == rb {
                return None;
            }
            root[ra] = rb;
        }
        // Parents before children.
        let mut order = Vec::with_capacity(n);
        let mut up: Vec<Option<(usize, usize)>> = vec![None; n];
        let mut seen = vec![false; n];
        for r in 0..n {
            if seen[r] {
                continue;
            }
            seen[r] = true;
            order.push(r);
            let mut stack = vec![r];
            while let Some(v) = stack.pop() {
                for &(e, first) in &self.adj[v] {
                    let w = if first { edges[e].1 } else { edges[e].0 };
                    if !seen[w] {
                        seen[w] = true;
                        up[w] = Some((e, v));
                        order.push(w);
                        stack.push(w);
                    }
                }
            }
        }
        let mut inbox: Vec<Vec<f64>> = (0..n)
            .map(|i| if self.size(i) > 1 { self.red.lin[i].clone() } else { vec![0.0] })
            .collect();
        let mut best_given_parent: Vec<Vec<usize>> = vec![Vec::new(); n];
        for &v in order.iter().rev() {
            let Some((e, p)) = up[v] else { continue };
            let (a, _, m) = &edges[e];
            let v_first = *a == v;
            let mut msg = vec![0.0; self.size(p)];
            let mut arg = vec![0; self.size(p)];
            for (sp, (msg, arg)) in msg.iter_mut().zip(arg.iter_mut()).enumerate() {
                let mut best = (0, f64::INFINITY);
                for (sv, &c) in inbox[v].iter().enumerate() {
                    let total = c + if v_first { m[sv][sp] } else { m[sp][sv] };
                    if total < best.1 {
                        best = (sv, total);
                    }
                }
                (*arg, *msg) = best;
            }
            inbox[p].iter_mut().zip(&msg).for_each(|(x, y)| *x += y);
            best_given_parent[v] = arg;
        }
        let mut ks = vec![0; n];
        for &v in &order {
            ks[v] = match up[v] {
                None => argmax(inbox[v].iter().map(|c| -c)),
                Some((_, p)) => best_given_parent[v][ks[p]],
            };
        }
        Some(ks)
    }

    /// A plan from the LP relaxation's `x`: per node, the strategy with the fewest bytes among
    /// those the LP uses (so each row stays at most its LP value when only one node per row is
    /// fractional), then repaired until it fits and polished. `None` if the repair fails.
    fn round(&self, xv: &[Vec<f64>]) -> Option<Vec<usize>> {
        let mut ks: Vec<usize> = xv
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let top = argmax(x.iter().copied());
                if x.is_empty() || x[top] >= 1.0 - 1e-6 {
                    return top;
                }
                let bytes = |k: usize| -> f64 {
                    self.member[i].iter().map(|&(r, t)| self.red.rows[r].terms[t].1[k]).sum()
                };
                (0..x.len())
                    .filter(|&k| x[k] > 1e-6)
                    .min_by(|&k, &l| bytes(k).total_cmp(&bytes(l)).then(x[l].total_cmp(&x[k])))
                    .unwrap_or(top)
            })
            .collect();
        let mut rowv = self.row_values(&ks);
        if !self.repair(&mut ks, &mut rowv) {
            return None;
        }
        self.polish(&mut ks);
        self.fits(&ks).then_some(ks)
    }

    /// Repair (if a row is over the budget), then polish.
    fn settle(&self, ks: &mut [usize]) {
        let mut rowv = self.row_values(ks);
        if rowv.iter().any(|&v| v > self.limit) {
            self.repair(ks, &mut rowv);
        }
        self.polish(ks);
    }

    /// A plan without HiGHS, for when its limits stop it before it found one: per node the
    /// cheapest strategy, repaired until every row fits, else per node the fewest bytes,
    /// repaired; then polished. `None` when neither repair fits.
    fn fallback(&self) -> Option<Vec<usize>> {
        let cheapest: Vec<usize> = (0..self.red.alive.len())
            .map(|i| match self.size(i) > 1 {
                true => argmax(self.red.lin[i].iter().map(|c| -c)),
                false => 0,
            })
            .collect();
        for mut ks in [cheapest, self.fewest_bytes()] {
            let mut rowv = self.row_values(&ks);
            if self.repair(&mut ks, &mut rowv) {
                self.polish(&mut ks);
                if self.fits(&ks) {
                    return Some(ks);
                }
            }
        }
        None
    }

    /// Per node, the strategy with the fewest bytes summed over its rows.
    fn fewest_bytes(&self) -> Vec<usize> {
        (0..self.red.alive.len())
            .map(|i| {
                let bytes = |k: usize| -> f64 {
                    self.member[i].iter().map(|&(r, t)| self.red.rows[r].terms[t].1[k]).sum()
                };
                argmax((0..self.size(i)).map(|k| -bytes(k)))
            })
            .collect()
    }

    /// Greedy: while a row is over the budget, make the move on it with the least added cost
    /// per byte saved that grows no row over the budget.
    fn repair(&self, ks: &mut [usize], rowv: &mut [f64]) -> bool {
        let steps: usize = self.red.alive.iter().map(Vec::len).sum();
        for _ in 0..=steps {
            let Some((r, over)) =
                rowv.iter().map(|v| v - self.limit).enumerate().max_by(|a, b| a.1.total_cmp(&b.1))
            else {
                return true;
            };
            if over <= 0.0 {
                return true;
            }
            let mut best: Option<(usize, usize, f64)> = None;
            for (i, b) in &self.red.rows[r].terms {
                for k in 0..b.len() {
                    let saved = b[ks[*i]] - b[k];
                    if saved <= 0.0 || !self.move_fits(rowv, ks, *i, k) {
                        continue;
                    }
                    let score = self.delta(ks, *i, k).max(0.0) / saved.min(over);
                    if best.is_none_or(|(_, _, s)| score < s) {
                        best = Some((*i, k, score));
                    }
                }
            }
            let Some((i, k, _)) = best else { return false };
            self.apply(rowv, ks, i, k);
        }
        false
    }

    /// Best-improvement single switches that keep every row it grows within the budget.
    fn polish(&self, ks: &mut [usize]) {
        let mut rowv = self.row_values(ks);
        for _pass in 0..4 {
            let mut improved = false;
            for i in (0..ks.len()).filter(|&i| self.size(i) > 1) {
                let mut best = (ks[i], 0.0);
                for k in (0..self.size(i)).filter(|&k| k != ks[i]) {
                    let d = self.delta(ks, i, k);
                    if d < best.1 && self.move_fits(&rowv, ks, i, k) {
                        best = (k, d);
                    }
                }
                if best.0 != ks[i] {
                    self.apply(&mut rowv, ks, i, best.0);
                    improved = true;
                }
            }
            if !improved {
                break;
            }
        }
    }
}

fn row_expression(row: &Row, x: &[Vec<Variable>], scale: f64) -> Expression {
    let mut ex = Expression::with_capacity(row.terms.iter().map(|(_, b)| b.len()).sum());
    for (node, bytes) in &row.terms {
        for (&v, &b) in x[*node].iter().zip(bytes) {
            if b != 0.0 {
                ex.add_mul(b / scale, v);
            }
        }
    }
    ex
}

fn configure(model: HighsProblem, opts: &SolveOptions, time_limit_s: f64) -> HighsProblem {
    let gap = opts.mip_rel_gap.max(0.0);
    let mut model = model
        .set_option("output_flag", false)
        .set_option("log_to_console", false)
        .set_option("threads", 1)
        .set_option("time_limit", time_limit_s.max(0.0))
        .set_option("mip_rel_gap", gap)
        .set_option("mip_feasibility_tolerance", HIGHS_FEAS_TOL)
        .set_option("primal_feasibility_tolerance", HIGHS_FEAS_TOL)
        // Any plan fits without binding rows, and with them solve() hands HiGHS a rounded plan:
        // the feasibility-jump heuristic only costs time (1.5 s on a 2000-node chain).
        .set_option("mip_heuristic_run_feasibility_jump", false)
        // Our reductions already did the presolve's useful work; HiGHS's own presolve took 1.4
        // of 1.9 s on llama3-8b's 2-D mesh ILP (19 decisions, 4,000 edge variables).
        .set_option("presolve", "off");
    if gap == 0.0 {
        model = model.set_option("mip_abs_gap", 0.0);
    }
    if let Some(nodes) = opts.mip_max_nodes {
        model = model.set_option("mip_max_nodes", nodes.min(i32::MAX as u64) as i32);
    }
    model
}

fn highs_error(e: ResolutionError, opts: &SolveOptions) -> PlanError {
    match e {
        ResolutionError::Other("NoSolutionFound") => PlanError::Internal(format!(
            "strategy ILP: HiGHS found no plan within the {} s time limit; raise the limit or \
             shrink the problem",
            opts.time_limit_s
        )),
        e => PlanError::Internal(format!("strategy ILP: HiGHS failed: {e}")),
    }
}

fn min_alive(b: &[f64], alive: &[bool]) -> f64 {
    b.iter().zip(alive).filter(|(_, &a)| a).map(|(&v, _)| v).fold(f64::INFINITY, f64::min)
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
