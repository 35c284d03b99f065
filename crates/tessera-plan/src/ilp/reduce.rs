//! The reductions of the parent module's docs: a strategy that alone breaks a row, or that
//! another of its decision dominates, is removed; a decision left with one strategy becomes a
//! constant; separable edges fold into their ends; the least cost and bytes come out as
//! constants. What is left, in "alive" strategy indices, is what HiGHS ([`super::model`]), the
//! local search ([`super::local`]) and diffusion ([`super::diffusion`]) work on.

use std::collections::BTreeMap;

use super::{tolerance, Problem};
use crate::PlanError;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Minimise cost under the budget.
    Cost,
    /// Minimise the largest row; costs do not matter.
    Peak,
}

/// A memory row with one term per node, summed: `(node, bytes per strategy)`.
pub(super) struct Row {
    pub(super) constant: f64,
    pub(super) terms: Vec<(usize, Vec<f64>)>,
}

/// The problem after the reductions, in "alive" strategy indices.
pub(super) struct Reduced {
    /// Per node: the original indices of the strategies kept.
    pub(super) alive: Vec<Vec<usize>>,
    /// Per node (with more than one strategy): the cost of each kept strategy, edges folded in.
    pub(super) lin: Vec<Vec<f64>>,
    /// Edges between two nodes with several strategies each: `(a, b, cost[s_a][s_b])`, `a < b`.
    pub(super) edges: Vec<(usize, usize, Vec<Vec<f64>>)>,
    /// Rows over nodes with several strategies; constants absorb the rest.
    pub(super) rows: Vec<Row>,
    /// Cost mode: the budget rows are bounded by; `None` for no bound.
    pub(super) budget: Option<f64>,
    /// Cost mode: the original objective minus the reduced one (the same for every plan).
    pub(super) offset: f64,
}

impl Reduced {
    /// `None` when the reductions prove that no plan fits.
    pub(super) fn new(
        p: &Problem,
        budget: Option<f64>,
        mode: Mode,
    ) -> Result<Option<Reduced>, PlanError> {
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

    pub(super) fn picks(&self, chosen: impl Fn(usize) -> usize) -> Vec<usize> {
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
}

fn min_alive(b: &[f64], alive: &[bool]) -> f64 {
    b.iter().zip(alive).filter(|(_, &a)| a).map(|(&v, _)| v).fold(f64::INFINITY, f64::min)
}
