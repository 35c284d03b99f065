//! Min-sum diffusion (Schlesinger; Werner, "A linear programming approach to max-sum problem",
//! 2007): a lower bound of the cost ILP without memory rows, and a plan decoded from it, in
//! milliseconds where HiGHS's LP relaxation takes tens and its MIP hundreds.
//!
//! The costs are *reparametrised*: at a node, each incident edge's matrix hands its minima over
//! the other end (per strategy of the node) to the node, and the node's costs are then spread
//! evenly back over it and its edges. Every plan's total cost is unchanged by this, and
//! `Σ_node min_s cost + Σ_edge min_st cost` bounds every plan's cost from below; sweeping all
//! nodes never lowers that bound, and it never exceeds the LP relaxation's optimum (on the
//! search's sharding ILPs it reaches it within a few sweeps, BENCHMARKS "Issue 44's search-time
//! rows"). The bound thus proves what the LP would prove, and when the decoded plan's cost meets
//! it, the plan is optimal without a MIP.

/// What diffusion found: the bound and a plan, in the reduced problem's strategy indices.
pub(super) struct Diffused {
    /// A lower bound of every plan's (reduced) cost.
    pub bound: f64,
    /// Per node, a strategy: greedy in node order on the reparametrised costs.
    pub plan: Vec<usize>,
}

/// Sweeps until the bound gains less than `1e-9` of itself, exceeds `stop_above` (a bound
/// that already proves what the caller asks), or `max_sweeps` have run. `lin`: per node, its
/// strategies' costs (empty for a node with one strategy); `edges`: `(a, b, cost[s_a][s_b])`
/// between nodes with several strategies.
pub(super) fn diffuse(
    lin: &[Vec<f64>],
    edges: &[(usize, usize, Vec<Vec<f64>>)],
    max_sweeps: usize,
    stop_above: f64,
) -> Diffused {
    let n = lin.len();
    let mut node: Vec<Vec<f64>> = lin.to_vec();
    let mut edge: Vec<Vec<Vec<f64>>> = edges.iter().map(|(_, _, m)| m.clone()).collect();
    let mut adj: Vec<Vec<(usize, bool)>> = vec![Vec::new(); n];
    for (k, (a, b, _)) in edges.iter().enumerate() {
        adj[*a].push((k, true));
        adj[*b].push((k, false));
    }
    let mut bound = lower_bound(&node, &edge);
    let mut mins: Vec<Vec<f64>> = Vec::new();
    for _ in 0..max_sweeps {
        if bound > stop_above {
            break;
        }
        for (i, incident) in adj.iter().enumerate() {
            if incident.is_empty() || node[i].is_empty() {
                continue;
            }
            mins.clear();
            mins.extend(incident.iter().map(|&(k, first)| minima(&edge[k], first)));
            let share = (incident.len() + 1) as f64;
            for (s, c) in node[i].iter_mut().enumerate() {
                *c = (*c + mins.iter().map(|m| m[s]).sum::<f64>()) / share;
            }
            // Each edge gives up its minima and takes the node's new cost instead: its minima
            // over the other end become the node's cost, every plan's total unchanged.
            for (&(k, first), m) in incident.iter().zip(&mins) {
                let mat = &mut edge[k];
                for (s, (&c, &lo)) in node[i].iter().zip(m).enumerate() {
                    let shift = c - lo;
                    match first {
                        true => mat[s].iter_mut().for_each(|v| *v += shift),
                        false => mat.iter_mut().for_each(|row| row[s] += shift),
                    }
                }
            }
        }
        let next = lower_bound(&node, &edge);
        let gained = next - bound;
        bound = bound.max(next);
        if gained <= 1e-9 * bound.abs().max(1e-12) {
            break;
        }
    }
    Diffused { bound, plan: decode(&node, &edge, edges, &adj) }
}

/// Per strategy of an edge's `first` end (else its second), the least cost over the other end.
fn minima(m: &[Vec<f64>], first: bool) -> Vec<f64> {
    match first {
        true => m.iter().map(|row| row.iter().copied().fold(f64::INFINITY, f64::min)).collect(),
        false => (0..m.first().map_or(0, Vec::len))
            .map(|t| m.iter().map(|row| row[t]).fold(f64::INFINITY, f64::min))
            .collect(),
    }
}

/// `Σ_node min_s cost + Σ_edge min_st cost` of a reparametrisation.
fn lower_bound(node: &[Vec<f64>], edge: &[Vec<Vec<f64>>]) -> f64 {
    let least = |it: &mut dyn Iterator<Item = f64>| it.fold(f64::INFINITY, f64::min);
    let nodes: f64 =
        node.iter().filter(|c| !c.is_empty()).map(|c| least(&mut c.iter().copied())).sum();
    let edges: f64 = edge.iter().map(|m| least(&mut m.iter().flatten().copied())).sum();
    nodes + edges
}

/// Strategies in node order, each the cheapest given the nodes already decided (its own
/// reparametrised cost plus its edges to them).
fn decode(
    node: &[Vec<f64>],
    edge: &[Vec<Vec<f64>>],
    edges: &[(usize, usize, Vec<Vec<f64>>)],
    adj: &[Vec<(usize, bool)>],
) -> Vec<usize> {
    let mut plan = vec![0; node.len()];
    for (i, costs) in node.iter().enumerate() {
        let mut best = (0, f64::INFINITY);
        for (s, &c) in costs.iter().enumerate() {
            let mut total = c;
            for &(k, first) in &adj[i] {
                let (a, b, _) = edges[k];
                total += match first {
                    true if b < i => edge[k][s][plan[b]],
                    false if a < i => edge[k][plan[a]][s],
                    _ => 0.0,
                };
            }
            if total < best.1 {
                best = (s, total);
            }
        }
        plan[i] = best.0;
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The least cost of any plan, by enumeration.
    fn brute(lin: &[Vec<f64>], edges: &[(usize, usize, Vec<Vec<f64>>)]) -> f64 {
        let sizes: Vec<usize> = lin.iter().map(|c| c.len().max(1)).collect();
        let mut ks = vec![0; lin.len()];
        let mut best = f64::INFINITY;
        loop {
            best = best.min(cost_of(lin, edges, &ks));
            let mut i = 0;
            while i < ks.len() {
                ks[i] += 1;
                if ks[i] < sizes[i] {
                    break;
                }
                ks[i] = 0;
                i += 1;
            }
            if i == ks.len() {
                return best;
            }
        }
    }

    fn cost_of(lin: &[Vec<f64>], edges: &[(usize, usize, Vec<Vec<f64>>)], ks: &[usize]) -> f64 {
        lin.iter().zip(ks).filter(|(c, _)| !c.is_empty()).map(|(c, &k)| c[k]).sum::<f64>()
            + edges.iter().map(|(a, b, m)| m[ks[*a]][ks[*b]]).sum::<f64>()
    }

    /// A small deterministic generator (no dependency for a test).
    fn lcg(state: &mut u64) -> f64 {
        *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*state >> 11) as f64 / (1u64 << 53) as f64
    }

    #[test]
    fn the_bound_never_exceeds_the_optimum_and_grows_with_sweeps() {
        let mut seed = 7;
        for case in 0..40 {
            let n = 3 + case % 4;
            let lin: Vec<Vec<f64>> =
                (0..n).map(|_| (0..3).map(|_| lcg(&mut seed)).collect()).collect();
            // A cycle plus a chord: not a forest, so the LP can be fractional.
            let mut pairs: Vec<(usize, usize)> = (0..n).map(|i| (i, (i + 1) % n)).collect();
            pairs.push((0, n / 2));
            let edges: Vec<(usize, usize, Vec<Vec<f64>>)> = pairs
                .into_iter()
                .map(|(a, b)| (a.min(b), a.max(b)))
                .filter(|(a, b)| a != b)
                .map(|(a, b)| {
                    let m = (0..3).map(|_| (0..3).map(|_| 2.0 * lcg(&mut seed)).collect());
                    (a, b, m.collect())
                })
                .collect();
            let opt = brute(&lin, &edges);
            let mut last = f64::NEG_INFINITY;
            for sweeps in [0, 1, 3, 10, 50] {
                let d = diffuse(&lin, &edges, sweeps, f64::INFINITY);
                assert!(d.bound <= opt + 1e-12, "case {case}: bound {} over {opt}", d.bound);
                assert!(d.bound >= last - 1e-12, "case {case}: the bound fell");
                // The decoded plan is a plan: its cost is at least the optimum.
                assert!(cost_of(&lin, &edges, &d.plan) >= opt - 1e-12);
                last = d.bound;
            }
        }
    }

    #[test]
    fn a_tree_is_solved_exactly() {
        // On a chain the diffusion fixed point is tight: the decoded plan is optimal.
        let lin = vec![vec![1.0, 0.0], vec![0.0, 0.5], vec![0.3, 0.0]];
        let swap = vec![vec![0.0, 1.0], vec![1.0, 0.0]];
        let edges = vec![(0, 1, swap.clone()), (1, 2, swap)];
        let d = diffuse(&lin, &edges, 100, f64::INFINITY);
        let opt = brute(&lin, &edges);
        assert!((d.bound - opt).abs() < 1e-9, "bound {} vs {opt}", d.bound);
        assert!((cost_of(&lin, &edges, &d.plan) - opt).abs() < 1e-9);
    }

    #[test]
    fn a_bound_past_the_stop_ends_the_sweeps() {
        // Without sweeps the bound is 0 + 0 + 0; the optimum (one node at 1, the other at 0)
        // is 1, which sweeping reaches on this tree.
        let lin = vec![vec![0.0, 1.0], vec![0.0, 1.0]];
        let edges = vec![(0, 1, vec![vec![5.0, 0.0], vec![0.0, 5.0]])];
        let swept = diffuse(&lin, &edges, 100, f64::INFINITY);
        assert!((swept.bound - 1.0).abs() < 1e-9, "swept bound {}", swept.bound);
        // A stop below the first bound: no sweep runs.
        let stopped = diffuse(&lin, &edges, 100, -1.0);
        assert_eq!(stopped.bound, 0.0);
    }
}
