//! The strategy ILP against its brute-force oracle, plus a large chain.

use std::time::Instant;

use proptest::prelude::*;
use proptest::sample::Index;
use tessera_plan::ilp::{
    brute_force, evaluate, fits, for_each_pick, min_peak, solve, solve_below, Choice, Edge, MemRow,
    Problem, SolveOptions,
};
use tessera_plan::PlanError;

fn exact() -> SolveOptions {
    SolveOptions { time_limit_s: 60.0, mip_rel_gap: 0.0, mip_max_nodes: None }
}

/// Costs: zeros, log-uniform over 1e-9..1e3 s, and a few small integers (ties).
fn cost() -> impl Strategy<Value = f64> {
    prop_oneof![
        2 => Just(0.0),
        5 => (-9.0..3.0f64).prop_map(|e| 10f64.powf(e)),
        3 => (0u32..4).prop_map(f64::from),
    ]
}

/// Bytes: zeros, log-uniform over 1e3..1e11, and multiples of 1e8 (ties).
fn bytes() -> impl Strategy<Value = f64> {
    prop_oneof![
        1 => Just(0.0),
        5 => (3.0..11.0f64).prop_map(|e| 10f64.powf(e).round()),
        3 => (0u32..8).prop_map(|k| f64::from(k) * 1e8),
    ]
}

type RawEdge = (Index, Index, Vec<Vec<f64>>, bool);
type RawRow = (f64, Vec<(Index, Vec<f64>, f64)>);

/// Random problems: ≤ 6 decisions of ≤ 4 strategies, ≤ 10 edges (some all-zero, some
/// self-edges, some parallel), 1–3 memory rows over random nodes; the budget is placed between
/// the least and the largest peak of any plan by `frac` (below 0: infeasible; exactly 0: the
/// least peak). In half of them every decision trades time for memory (costs ascending, bytes
/// descending), so that few strategies are dominated and HiGHS has work to do.
fn problem() -> impl Strategy<Value = Problem> {
    prop::collection::vec(1usize..=4, 1..=6).prop_flat_map(|sizes| {
        let costs: Vec<_> = sizes.iter().map(|&s| prop::collection::vec(cost(), s)).collect();
        let matrix = prop::collection::vec(prop::collection::vec(cost(), 4), 4);
        let edges = prop::collection::vec(
            (any::<Index>(), any::<Index>(), matrix, prop::bool::weighted(0.2)),
            0..=10,
        );
        let term = (any::<Index>(), prop::collection::vec(bytes(), 4), 0.5..2.0f64);
        let rows = prop::collection::vec(
            (prop_oneof![Just(0.0), 0.0..1e10f64], prop::collection::vec(term, 0..=6)),
            1..=3,
        );
        let profiles: Vec<_> = sizes.iter().map(|&s| prop::collection::vec(bytes(), s)).collect();
        let frac = prop_oneof![1 => Just(0.0), 1 => -0.3..0.0f64, 4 => 0.0..1.2f64];
        let tradeoff = any::<bool>();
        (Just(sizes), costs, edges, rows, profiles, frac, tradeoff).prop_map(build)
    })
}

#[allow(clippy::type_complexity)]
fn build(
    (sizes, mut costs, edges, rows, mut profiles, frac, tradeoff): (
        Vec<usize>,
        Vec<Vec<f64>>,
        Vec<RawEdge>,
        Vec<RawRow>,
        Vec<Vec<f64>>,
        f64,
        bool,
    ),
) -> Problem {
    let n = sizes.len();
    if tradeoff {
        costs.iter_mut().for_each(|c| c.sort_by(f64::total_cmp));
        profiles.iter_mut().for_each(|b| b.sort_by(|x, y| y.total_cmp(x)));
    }
    let choices = costs.into_iter().map(|cost| Choice { cost }).collect();
    let edges = edges
        .into_iter()
        .map(|(a, b, m, zero)| {
            let (from, to) = (a.index(n), b.index(n));
            let cost = (0..sizes[from])
                .map(|s| (0..sizes[to]).map(|t| if zero { 0.0 } else { m[s][t] }).collect())
                .collect();
            Edge { from, to, cost }
        })
        .collect();
    let memory = rows
        .into_iter()
        .map(|(constant, terms)| MemRow {
            constant,
            terms: terms
                .into_iter()
                .map(|(i, b, scale)| {
                    let node = i.index(n);
                    let bytes = if tradeoff {
                        profiles[node].iter().map(|v| (v * scale).round()).collect()
                    } else {
                        b[..sizes[node]].to_vec()
                    };
                    (node, bytes)
                })
                .collect(),
        })
        .collect();
    let mut p = Problem { choices, edges, memory, budget: 0.0 };
    let (lo, hi) = peak_range(&p);
    p.budget = lo + frac * (hi - lo);
    if frac < 0.0 && p.budget >= lo {
        p.budget = lo - 1e6; // all peaks equal: still make it infeasible
    }
    p
}

fn largest_cost(p: &Problem) -> f64 {
    let node = p.choices.iter().flat_map(|c| &c.cost);
    let edge = p.edges.iter().flat_map(|e| e.cost.iter().flatten());
    node.chain(edge).fold(0.0, |m, c| m.max(c.abs()))
}

/// The least and the largest peak over every plan.
fn peak_range(p: &Problem) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for_each_pick(p, |picks| {
        let (_, peak) = evaluate(p, picks);
        lo = lo.min(peak);
        hi = hi.max(peak);
    });
    (lo, hi)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5000))]

    #[test]
    fn solve_matches_brute_force(p in problem()) {
        let got = solve(&p, &exact()).unwrap();
        let want = brute_force(&p);
        prop_assert_eq!(got.is_none(), want.is_none(), "solve {:?} vs brute force {:?}", got, want);
        if let (Some(got), Some(want)) = (got, want) {
            prop_assert!(fits(&p, &got.picks), "picks {:?} break the budget", got.picks);
            let (objective, peak) = evaluate(&p, &got.picks);
            prop_assert_eq!((objective, peak), (got.objective, got.peak));
            // Equal within 1e-6 relative; HiGHS resolves costs to its dual feasibility tolerance
            // (1e-7 of the scaled costs), so a cost that small next to the largest is noise.
            let tol = 1e-6 * want.objective.abs() + 1e-7 * largest_cost(&p);
            prop_assert!(got.objective >= want.objective - 1e-12 * want.objective.abs());
            prop_assert!(
                got.objective <= want.objective + tol,
                "solve {} > brute force {} (picks {:?} vs {:?})",
                got.objective, want.objective, got.picks, want.picks
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// A cutoff changes nothing but whether a plan above it is returned: under the brute
    /// force's optimum (less a margin wider than the solver's tolerance) there is none; at or
    /// over it, the plan `solve` gives.
    #[test]
    fn solve_below_cuts_off_exactly(p in problem(), over in 0.0f64..2.0) {
        let want = brute_force(&p);
        let Some(want) = want else {
            prop_assert!(solve_below(&p, &exact(), f64::INFINITY).unwrap().is_none());
            return Ok(());
        };
        let tol = 1e-6 * want.objective.abs() + 1e-7 * largest_cost(&p) + 1e-12;
        let under = want.objective - tol - 1e-3 * want.objective.abs() - 1e-9;
        prop_assert!(solve_below(&p, &exact(), under).unwrap().is_none(), "a plan under the optimum");
        let cutoff = want.objective + tol + over * want.objective.abs();
        let got = solve_below(&p, &exact(), cutoff).unwrap();
        prop_assert_eq!(got, solve(&p, &exact()).unwrap());
    }

    #[test]
    fn min_peak_matches_brute_force(p in problem()) {
        let got = min_peak(&p, &exact()).unwrap().expect("every problem has a least peak");
        let (lo, _) = peak_range(&p);
        prop_assert_eq!(evaluate(&p, &got.picks), (got.objective, got.peak));
        prop_assert!(got.peak >= lo);
        prop_assert!(got.peak <= lo + 1e-6 * lo.abs() + 1e-6, "min_peak {} > brute force {}", got.peak, lo);
    }
}

#[test]
fn zero_choices_is_trivial() {
    let row = MemRow { constant: 5.0, terms: vec![] };
    let p = Problem { choices: vec![], edges: vec![], memory: vec![row], budget: 10.0 };
    let s = solve(&p, &SolveOptions::default()).unwrap().unwrap();
    assert_eq!((s.picks.len(), s.objective, s.peak), (0, 0.0, 5.0));
    assert_eq!(min_peak(&p, &SolveOptions::default()).unwrap().unwrap().peak, 5.0);
    let tight = Problem { budget: 4.0, ..p };
    assert!(solve(&tight, &SolveOptions::default()).unwrap().is_none());
    assert!(brute_force(&tight).is_none());
}

#[test]
fn no_memory_rows_means_no_limit() {
    let p = Problem {
        choices: vec![Choice { cost: vec![3.0, 1.0] }, Choice { cost: vec![1.0, 2.0] }],
        edges: vec![Edge { from: 0, to: 1, cost: vec![vec![0.0, 5.0], vec![5.0, 0.0]] }],
        memory: vec![],
        budget: -1.0,
    };
    let s = solve(&p, &SolveOptions::default()).unwrap().unwrap();
    assert_eq!((s.picks, s.objective, s.peak), (vec![1, 1], 3.0, 0.0));
    let m = min_peak(&p, &SolveOptions::default()).unwrap().unwrap();
    assert_eq!((m.objective, m.peak), (3.0, 0.0));
}

#[test]
fn malformed_problems_are_errors() {
    let ok = Problem {
        choices: vec![Choice { cost: vec![1.0, 2.0] }, Choice { cost: vec![1.0] }],
        edges: vec![Edge { from: 0, to: 1, cost: vec![vec![0.0], vec![1.0]] }],
        memory: vec![MemRow { constant: 0.0, terms: vec![(0, vec![1.0, 2.0])] }],
        budget: 10.0,
    };
    assert!(solve(&ok, &SolveOptions::default()).unwrap().is_some());
    let mut empty = ok.clone();
    empty.choices.push(Choice { cost: vec![] });
    let mut shape = ok.clone();
    shape.edges[0].cost = vec![vec![0.0, 1.0], vec![1.0, 0.0]];
    let mut node = ok.clone();
    node.memory[0].terms.push((7, vec![1.0]));
    let mut nan = ok.clone();
    nan.choices[0].cost[1] = f64::NAN;
    let mut budget = ok.clone();
    budget.budget = f64::NEG_INFINITY;
    for bad in [empty, shape, node, nan, budget] {
        assert!(matches!(solve(&bad, &SolveOptions::default()), Err(PlanError::Invalid(_))));
        assert!(matches!(min_peak(&bad, &SolveOptions::default()), Err(PlanError::Invalid(_))));
    }
}

/// splitmix64 → uniform in [0, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// 2000 decisions × 8 strategies, an edge between consecutive decisions; strategy s shards a
/// node's tensors 2^(s mod 4) ways (faster compute, less memory, costlier resharding between
/// different strategies). 40 liveness rows, each over a window of 100 decisions.
fn chain() -> Problem {
    let (n, k) = (2000, 8);
    let mut rng = Rng(7);
    let choices: Vec<Choice> = (0..n)
        .map(|_| {
            let base = 1e-3 * (0.5 + rng.next());
            let cost =
                (0..k).map(|s| base / f64::from(1 << (s % 4)) * (1.0 + 0.3 * rng.next())).collect();
            Choice { cost }
        })
        .collect();
    let edges = (1..n)
        .map(|i| {
            let cost = (0..k)
                .map(|s| {
                    (0..k).map(|t| if s == t { 0.0 } else { 1e-4 * (0.2 + rng.next()) }).collect()
                })
                .collect();
            Edge { from: i - 1, to: i, cost }
        })
        .collect();
    let bytes: Vec<Vec<f64>> = (0..n)
        .map(|_| {
            let base = 1e8 * (0.5 + rng.next());
            (0..k).map(|s| (base / f64::from(1 << (3 - s % 4))).round()).collect()
        })
        .collect();
    let memory = (0..n / 50)
        .map(|w| MemRow {
            constant: 1e9,
            terms: (50 * w..(50 * w + 100).min(n)).map(|i| (i, bytes[i].clone())).collect(),
        })
        .collect();
    Problem { choices, edges, memory, budget: f64::INFINITY }
}

#[test]
fn chain_of_2000_solves() {
    let opts = SolveOptions::default();
    let free = chain();
    let t = Instant::now();
    let fast = solve(&free, &opts).unwrap().expect("no budget: feasible");
    eprintln!(
        "chain 2000x8, no budget: {:.2} s, objective {:.6} s, peak {:.3e} B",
        t.elapsed().as_secs_f64(),
        fast.objective,
        fast.peak
    );
    let t = Instant::now();
    let least = min_peak(&free, &opts).unwrap().unwrap();
    eprintln!(
        "chain 2000x8, min_peak: {:.2} s, peak {:.3e} B",
        t.elapsed().as_secs_f64(),
        least.peak
    );
    assert!(least.peak <= fast.peak);

    // Closing the chain into a ring leaves the exact dynamic programme to HiGHS.
    let mut ring = free.clone();
    let back = ring.edges[0].cost.clone();
    ring.edges.push(Edge { from: 1999, to: 0, cost: back });
    let t = Instant::now();
    let r = solve(&ring, &opts).unwrap().expect("no budget: feasible");
    eprintln!(
        "ring 2000x8 (HiGHS), no budget: {:.2} s, objective {:.6} s",
        t.elapsed().as_secs_f64(),
        r.objective
    );
    assert!(r.objective >= fast.objective - 1e-9);

    // A budget halfway between the least peak and the fastest plan's peak binds; this one is
    // hard for HiGHS (it stops at the time limit: ~0.4% above the LP bound), so give it 5 s.
    let tight = Problem { budget: 0.5 * (least.peak + fast.peak), ..free };
    let t = Instant::now();
    let quick = SolveOptions { time_limit_s: 5.0, ..opts };
    let s = solve(&tight, &quick).unwrap().expect("feasible: the least-peak plan fits");
    eprintln!(
        "chain 2000x8, budget {:.3e} B: {:.2} s, objective {:.6} s, peak {:.3e} B",
        tight.budget,
        t.elapsed().as_secs_f64(),
        s.objective,
        s.peak
    );
    assert!(fits(&tight, &s.picks));
    assert!(s.objective >= fast.objective * (1.0 - 1e-4));

    let below = Problem { budget: least.peak * (1.0 - 1e-3), ..tight };
    let t = Instant::now();
    assert!(solve(&below, &opts).unwrap().is_none());
    eprintln!("chain 2000x8, budget below the least peak: {:.2} s", t.elapsed().as_secs_f64());
}

/// A limit that stops HiGHS before it found any plan (here a time limit of 0 s: the LP
/// relaxation and the MIP stop at once, on any machine) no longer ends in an error: the
/// answer is the greedy fallback, a plan that fits, whose figures are its exact evaluation
/// and which no fitting plan of the brute-force oracle undercuts by more than it costs.
/// The same problem under a node limit with a generous time limit is solved exactly.
#[test]
fn a_limit_that_stops_highs_early_returns_a_fitting_plan() {
    // Four decisions, each trading time for memory, in a ring (so no forest DP), under a
    // budget that binds: a plan that takes the fastest strategy everywhere does not fit.
    let choices: Vec<Choice> =
        (0..4).map(|i| Choice { cost: vec![1.0 + i as f64, 2.0 + i as f64, 4.0] }).collect();
    let link = vec![vec![0.0, 0.5, 1.0], vec![0.5, 0.0, 0.5], vec![1.0, 0.5, 0.0]];
    let edges: Vec<Edge> =
        (0..4).map(|i| Edge { from: i, to: (i + 1) % 4, cost: link.clone() }).collect();
    let bytes = vec![8.0, 4.0, 1.0];
    let memory = vec![
        MemRow { constant: 2.0, terms: (0..4).map(|i| (i, bytes.clone())).collect() },
        MemRow { constant: 0.0, terms: vec![(0, vec![9.0, 5.0, 0.0]), (2, bytes.clone())] },
    ];
    let p = Problem { choices, edges, memory, budget: 20.0 };
    let best = brute_force(&p).expect("the fewest bytes everywhere fit");
    assert!(!fits(&p, &[0; 4]), "the budget must bind");

    let stopped = SolveOptions { time_limit_s: 0.0, mip_rel_gap: 0.0, mip_max_nodes: Some(0) };
    let s = solve(&p, &stopped).unwrap().expect("a fitting plan exists");
    assert!(fits(&p, &s.picks));
    assert_eq!(evaluate(&p, &s.picks), (s.objective, s.peak));
    assert!(s.objective >= best.objective - 1e-12);

    let nodes = SolveOptions { time_limit_s: 60.0, mip_rel_gap: 0.0, mip_max_nodes: Some(1_000) };
    let s = solve(&p, &nodes).unwrap().expect("a fitting plan exists");
    assert!(fits(&p, &s.picks));
    assert!((s.objective - best.objective).abs() <= 1e-9, "{} vs {}", s.objective, best.objective);
}
