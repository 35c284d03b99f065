//! The HiGHS models over the reduced problem: the cost MIP (with its LP relaxation, rounding
//! and RENS, see the parent module's docs) and the least-peak MIP, and HiGHS's options.

use std::time::Instant;

use good_lp::solvers::highs::HighsProblem;
use good_lp::{
    highs, variable, Expression, ProblemVariables, ResolutionError, Solution as _, SolverModel,
    Variable, WithInitialSolution,
};

use super::reduce::{Reduced, Row};
use super::{
    argmax, diffusion, tolerance, Local, SolveOptions, DIFFUSION_SWEEPS, HIGHS_FEAS_TOL,
    MAX_SCALED_COST, RENS_SHARE,
};
use crate::trace::{timed, Work};
use crate::PlanError;

impl Reduced {
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

    /// The least-cost picks; `None` when none fits, or when a lower bound (min-sum
    /// diffusion's or the LP relaxation's) proves that no plan that fits costs at most `cutoff`
    /// (whole objective, seconds).
    pub(super) fn solve_min_cost(
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
        let diffused = (self.rows.is_empty() || cutoff.is_finite()).then(|| {
            timed(Work::Diffusion, || {
                diffusion::diffuse(&self.lin, &self.edges, DIFFUSION_SWEEPS, cut - offset)
            })
        });
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
            let sol = match timed(Work::Relaxation, || model.solve()) {
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
        let sol = timed(Work::Relaxation, || model.solve()).ok()?;
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
        match timed(Work::Mip, || model.solve()) {
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

    pub(super) fn solve_min_peak(&self, opts: &SolveOptions) -> Result<Vec<usize>, PlanError> {
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
        let ks: Vec<usize> = match timed(Work::Mip, || model.solve()) {
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
