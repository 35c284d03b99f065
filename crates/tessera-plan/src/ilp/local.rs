//! The reduced problem's plans by index into `alive`: exact dynamic programming on forests,
//! and the rounding, repair, polishing and greedy fallback around HiGHS.

use super::reduce::Reduced;
use super::{argmax, tolerance};

/// The reduced problem's plans by index into `alive`, for exact dynamic programming on forests
/// and the rounding, repair and polishing heuristics.
pub(super) struct Local<'a> {
    red: &'a Reduced,
    /// Per node: `(edge, whether the node is the edge's first end)`.
    adj: Vec<Vec<(usize, bool)>>,
    /// Per node: `(row, term)` where it appears.
    member: Vec<Vec<(usize, usize)>>,
    limit: f64,
}

impl<'a> Local<'a> {
    pub(super) fn new(red: &'a Reduced) -> Self {
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
    pub(super) fn cost(&self, ks: &[usize]) -> f64 {
        let lin: f64 =
            self.red.lin.iter().zip(ks).filter(|(l, _)| !l.is_empty()).map(|(l, &k)| l[k]).sum();
        lin + self.red.edges.iter().map(|(a, b, m)| m[ks[*a]][ks[*b]]).sum::<f64>()
    }

    pub(super) fn row_values(&self, ks: &[usize]) -> Vec<f64> {
        let rows = &self.red.rows;
        rows.iter()
            .map(|r| r.constant + r.terms.iter().map(|(i, b)| b[ks[*i]]).sum::<f64>())
            .collect()
    }

    pub(super) fn fits(&self, ks: &[usize]) -> bool {
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
    pub(super) fn forest_dp(&self) -> Option<Vec<usize>> {
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
    pub(super) fn round(&self, xv: &[Vec<f64>]) -> Option<Vec<usize>> {
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
    pub(super) fn settle(&self, ks: &mut [usize]) {
        let mut rowv = self.row_values(ks);
        if rowv.iter().any(|&v| v > self.limit) {
            self.repair(ks, &mut rowv);
        }
        self.polish(ks);
    }

    /// A plan without HiGHS, for when its limits stop it before it found one: per node the
    /// cheapest strategy, repaired until every row fits, else per node the fewest bytes,
    /// repaired; then polished. `None` when neither repair fits.
    pub(super) fn fallback(&self) -> Option<Vec<usize>> {
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
    pub(super) fn fewest_bytes(&self) -> Vec<usize> {
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
