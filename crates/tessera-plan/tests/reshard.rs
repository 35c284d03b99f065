//! Resharding: move rules, cost formulas, and Dijkstra against an exhaustive oracle.

use tessera_plan::reshard::{
    apply_move, brute_force_all, brute_force_path, cheapest_path, move_cost, moves_from,
    Collective, CommStep, ReshardCache, ReshardPath, MOVE_TIE_BREAK_S,
};
use tessera_plan::{Link, Mesh, Spec};

const SLOW: Link = Link { latency_s: 10e-6, bandwidth: 10e9 };
const FAST: Link = Link { latency_s: 5e-6, bandwidth: 300e9 };
const MID: Link = Link { latency_s: 2e-6, bandwidth: 50e9 };

fn spec(s: &str) -> Spec {
    Spec::parse(s).unwrap_or_else(|| panic!("bad spec {s}"))
}

fn step(op: Collective, axis: usize, mesh: &Mesh) -> CommStep {
    CommStep { op, axis, size: mesh.shape[axis] }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs()) + 1e-300
}

fn show(from: &Spec, p: &ReshardPath) -> String {
    let specs = p.specs(from).unwrap();
    let mut s = format!("{from}");
    for (st, sp) in p.steps.iter().zip(&specs[1..]) {
        s += &format!(" --{}{:?}@{}--> {sp}", st.name(), st.op, st.axis);
    }
    format!("{s}  ({:.6e} s)", p.cost_s)
}

/// Every spec of a rank-`rank` tensor over `ndim` mesh axes: each axis unused, pending, or
/// inserted at any position of any dim (so every order within a dim appears once).
fn all_specs(ndim: usize, rank: usize) -> Vec<Spec> {
    fn go(axis: usize, ndim: usize, cur: &mut Spec, out: &mut Vec<Spec>) {
        if axis == ndim {
            out.push(cur.clone());
            return;
        }
        go(axis + 1, ndim, cur, out);
        cur.partial.push(axis);
        go(axis + 1, ndim, cur, out);
        cur.partial.pop();
        for d in 0..cur.dims.len() {
            for pos in 0..=cur.dims[d].len() {
                cur.dims[d].insert(pos, axis);
                go(axis + 1, ndim, cur, out);
                cur.dims[d].remove(pos);
            }
        }
    }
    let mut out = Vec::new();
    go(0, ndim, &mut Spec::replicated(rank), &mut out);
    out
}

/// Replays a path: every step applies, every spec divides, sizes match the mesh, the end is
/// `to`, and the cost is the sum of the move costs.
fn check_path(mesh: &Mesh, shape: &[usize], eb: u64, from: &Spec, to: &Spec, p: &ReshardPath) {
    let mut cur = from.clone();
    let mut cost = 0.0;
    for st in &p.steps {
        assert_eq!(st.size, mesh.shape[st.axis]);
        cost += move_cost(mesh, shape, eb, &cur, st);
        cur = apply_move(&cur, st).unwrap_or_else(|| panic!("{st:?} does not apply to {cur}"));
        assert!(cur.local_shape(mesh, shape).is_some(), "{cur} does not divide {shape:?}");
    }
    assert_eq!(&cur, to);
    assert!(close(cost, p.cost_s), "{} vs {}", cost, p.cost_s);
}

/// For every source in `sources` (every `stride`-th spec) and every target spec: Dijkstra
/// agrees with the exhaustive oracle on paths of at most `max_len` moves, is never worse,
/// and reaches exactly the dividing targets whose pending axes the source also has.
fn compare_all(mesh: &Mesh, shape: &[usize], eb: u64, max_len: usize, stride: usize) -> usize {
    let specs = all_specs(mesh.ndim(), shape.len());
    let mut compared = 0;
    for from in specs.iter().step_by(stride) {
        let oracle = brute_force_all(mesh, shape, eb, from, max_len);
        for to in &specs {
            let d = cheapest_path(mesh, shape, eb, from, to);
            let reachable = from.local_shape(mesh, shape).is_some()
                && to.local_shape(mesh, shape).is_some()
                && to.partial.iter().all(|a| from.partial.contains(a));
            assert_eq!(d.is_some(), reachable, "{from} -> {to}");
            match (&d, oracle.get(to)) {
                (Some(d), Some(o)) => {
                    check_path(mesh, shape, eb, from, to, d);
                    check_path(mesh, shape, eb, from, to, o);
                    assert!(
                        d.cost_s <= o.cost_s * (1.0 + 1e-12),
                        "dijkstra worse: {} vs oracle {}",
                        show(from, d),
                        show(from, o)
                    );
                    if d.steps.len() <= max_len {
                        assert!(
                            close(d.cost_s, o.cost_s),
                            "{} vs oracle {}",
                            show(from, d),
                            show(from, o)
                        );
                    }
                    compared += 1;
                }
                (Some(d), None) => {
                    check_path(mesh, shape, eb, from, to, d);
                    assert!(d.steps.len() > max_len, "oracle missed {}", show(from, d));
                }
                (None, Some(o)) => panic!("dijkstra found nothing, oracle {}", show(from, o)),
                (None, None) => {}
            }
        }
    }
    compared
}

// ---- moves ----

#[test]
fn move_rules() {
    let m = Mesh::with_links(&[2, 2], vec![SLOW, FAST]);
    let s01 = spec("[R, S01]");
    // Gather only the minor-most axis of a dim.
    assert_eq!(apply_move(&s01, &step(Collective::AllGather { dim: 1 }, 0, &m)), None);
    assert_eq!(
        apply_move(&s01, &step(Collective::AllGather { dim: 1 }, 1, &m)),
        Some(spec("[R, S0]"))
    );
    assert_eq!(apply_move(&s01, &step(Collective::AllGather { dim: 0 }, 1, &m)), None);
    // All-to-all: the axis leaves concat_dim (its minor end) for the minor end of split_dim.
    let a2a = |split_dim, concat_dim| Collective::AllToAll { split_dim, concat_dim };
    assert_eq!(apply_move(&s01, &step(a2a(0, 1), 1, &m)), Some(spec("[S1, S0]")));
    assert_eq!(apply_move(&s01, &step(a2a(0, 1), 0, &m)), None);
    assert_eq!(apply_move(&s01, &step(a2a(1, 1), 1, &m)), None);
    assert_eq!(apply_move(&spec("[S1, S0]"), &step(a2a(0, 1), 0, &m)), Some(spec("[S10, R]")));
    // Reduce-scatter appends minor-most; all-reduce drops the pending axis.
    let p = spec("[S1, R] P0");
    assert_eq!(
        apply_move(&p, &step(Collective::ReduceScatter { dim: 0 }, 0, &m)),
        Some(spec("[S10, R]"))
    );
    assert_eq!(apply_move(&p, &step(Collective::AllReduce, 0, &m)), Some(spec("[S1, R]")));
    assert_eq!(apply_move(&p, &step(Collective::AllReduce, 1, &m)), None);
    assert_eq!(apply_move(&p, &step(Collective::ReduceScatter { dim: 0 }, 1, &m)), None);
    // Shard only an unused axis (not a sharded one, not a pending one).
    assert_eq!(apply_move(&p, &step(Collective::Shard { dim: 1 }, 0, &m)), None);
    assert_eq!(apply_move(&p, &step(Collective::Shard { dim: 1 }, 1, &m)), None);
    assert_eq!(apply_move(&spec("[S1, R] P0"), &step(Collective::Shard { dim: 0 }, 1, &m)), None);
    assert_eq!(
        apply_move(&spec("[R, R] P0"), &step(Collective::Shard { dim: 0 }, 1, &m)),
        Some(spec("[S1, R] P0"))
    );
    // Dims out of range.
    assert_eq!(apply_move(&s01, &step(Collective::Shard { dim: 2 }, 0, &m)), None);
    assert_eq!(apply_move(&s01, &step(a2a(2, 1), 1, &m)), None);
}

#[test]
fn moves_respect_divisibility() {
    let m = Mesh::with_links(&[4], vec![FAST]);
    let r = spec("[R, R]");
    let got: Vec<_> = moves_from(&m, &[2, 8], &r).into_iter().map(|(_, s)| s.to_string()).collect();
    assert_eq!(got, ["[R, S0]"]);
    // An all-to-all into a dim that does not divide is not offered either.
    let got: Vec<_> =
        moves_from(&m, &[2, 8], &spec("[R, S0]")).into_iter().map(|(_, s)| s.to_string()).collect();
    assert_eq!(got, ["[R, R]"]);
    // Nothing from a spec that does not divide or is invalid.
    assert!(moves_from(&m, &[2, 8], &spec("[S0, R]")).is_empty());
    assert!(moves_from(&m, &[8, 8], &spec("[S0, R] P0")).is_empty());
    // All moves from a pending spec on a 2-D mesh.
    let m2 = Mesh::with_links(&[2, 2], vec![SLOW, FAST]);
    let got: Vec<_> = moves_from(&m2, &[4, 4], &spec("[S1, R] P0"))
        .into_iter()
        .map(|(st, s)| format!("{}@{} {s}", st.name(), st.axis))
        .collect();
    assert_eq!(
        got,
        [
            "all_reduce@0 [S1, R]",
            "reduce_scatter@0 [S10, R]",
            "reduce_scatter@0 [S1, S0]",
            "all_gather@1 [R, R] P0",
            "all_to_all@1 [R, S1] P0",
        ]
    );
}

// ---- costs ----

#[test]
fn cost_formulas_by_hand() {
    // 1 MiB local on a 4-device axis at 100 GB/s and 5 µs.
    let link = Link { latency_s: 5e-6, bandwidth: 100e9 };
    let m = Mesh::with_links(&[4], vec![link]);
    let mib = 1024.0 * 1024.0;
    let t = MOVE_TIE_BREAK_S;
    // [512, 512] f32 replicated (or pending) = 1 MiB per device.
    let shape = [512, 512];
    let ar = move_cost(&m, &shape, 4, &spec("[R, R] P0"), &step(Collective::AllReduce, 0, &m));
    // 2·3·5µs + 2·3/4·1 MiB / 100 GB/s = 30 µs + 15.72864 µs.
    assert!(close(ar, 3e-5 + 1.572864e-5 + t), "{ar}");
    assert!(close(ar, 2.0 * 3.0 * 5e-6 + 1.5 * mib / 100e9 + t));
    let rs = move_cost(
        &m,
        &shape,
        4,
        &spec("[R, R] P0"),
        &step(Collective::ReduceScatter { dim: 0 }, 0, &m),
    );
    assert!(close(rs, 1.5e-5 + 7.86432e-6 + t), "{rs}");
    let a2a = move_cost(
        &m,
        &[2048, 512],
        4,
        &spec("[S0, R]"),
        &step(Collective::AllToAll { split_dim: 1, concat_dim: 0 }, 0, &m),
    );
    assert!(close(a2a, 1.5e-5 + 7.86432e-6 + t), "{a2a}");
    // All-gather of 1 MiB local shards (output 4 MiB): 3·5µs + 3 MiB / 100 GB/s.
    let ag = move_cost(
        &m,
        &[2048, 512],
        4,
        &spec("[S0, R]"),
        &step(Collective::AllGather { dim: 0 }, 0, &m),
    );
    assert!(close(ag, 1.5e-5 + 3.145728e-5 + t), "{ag}");
    let sh = move_cost(&m, &shape, 4, &spec("[R, R]"), &step(Collective::Shard { dim: 0 }, 0, &m));
    assert_eq!(sh, t);
    // bf16 halves the bandwidth term; the link comes from the step's axis.
    let m2 = Mesh::with_links(&[2, 4], vec![SLOW, link]);
    let ar16 = move_cost(&m2, &shape, 2, &spec("[R, R] P1"), &step(Collective::AllReduce, 1, &m2));
    assert!(close(ar16, 3e-5 + 1.572864e-5 / 2.0 + t), "{ar16}");
    // B is the local size: a [S0, R] pending spec holds half on a 2-device axis 0.
    let ar_local =
        move_cost(&m2, &[1024, 512], 4, &spec("[S0, R] P1"), &step(Collective::AllReduce, 1, &m2));
    assert!(close(ar_local, ar), "{ar_local} vs {ar}");
}

// ---- named cases ----

#[test]
fn reduce_scatter_beats_all_reduce_then_slice() {
    for m in [
        Mesh::with_links(&[4], vec![FAST]),
        Mesh::with_links(&[2, 2], vec![SLOW, FAST]),
        Mesh::with_links(&[4, 4], vec![SLOW, FAST]),
    ] {
        let (from, to) = (spec("[R, R] P0"), spec("[S0, R]"));
        let p = cheapest_path(&m, &[64, 64], 4, &from, &to).unwrap();
        assert_eq!(
            p.steps,
            [step(Collective::ReduceScatter { dim: 0 }, 0, &m)],
            "{}",
            show(&from, &p)
        );
        let o = brute_force_path(&m, &[64, 64], 4, &from, &to, 4).unwrap();
        assert!(close(p.cost_s, o.cost_s));
    }
}

#[test]
fn all_to_all_beats_gather_then_slice() {
    for m in [Mesh::with_links(&[4], vec![FAST]), Mesh::with_links(&[2, 2], vec![SLOW, FAST])] {
        let (from, to) = (spec("[S0, R]"), spec("[R, S0]"));
        let p = cheapest_path(&m, &[64, 64], 4, &from, &to).unwrap();
        let a2a = Collective::AllToAll { split_dim: 1, concat_dim: 0 };
        assert_eq!(p.steps, [step(a2a, 0, &m)], "{}", show(&from, &p));
        let gather_slice =
            move_cost(&m, &[64, 64], 4, &from, &step(Collective::AllGather { dim: 0 }, 0, &m))
                + move_cost(
                    &m,
                    &[64, 64],
                    4,
                    &spec("[R, R]"),
                    &step(Collective::Shard { dim: 1 }, 0, &m),
                );
        assert!(p.cost_s < gather_slice);
        let o = brute_force_path(&m, &[64, 64], 4, &from, &to, 4).unwrap();
        assert!(close(p.cost_s, o.cost_s));
    }
}

#[test]
fn sharded_dim_moves_between_dims() {
    let shape = [64, 64, 64];
    let cases = [
        (Mesh::with_links(&[2, 2], vec![SLOW, FAST]), "[R, S01, R]", "[S01, R, R]", 5),
        (Mesh::with_links(&[4, 4], vec![SLOW, FAST]), "[R, S01, R]", "[S01, R, R]", 5),
        (Mesh::with_links(&[4, 4], vec![FAST, SLOW]), "[R, S01, R]", "[S01, R, R]", 5),
        (Mesh::with_links(&[2, 2, 2], vec![SLOW, MID, FAST]), "[R, S01, R]", "[S01, R, R]", 5),
        (Mesh::with_links(&[2, 2, 2], vec![SLOW, MID, FAST]), "[R, S012, R]", "[S012, R, R]", 5),
        (Mesh::with_links(&[2, 2, 2], vec![SLOW, MID, FAST]), "[R, S01, S2]", "[S01, S2, R]", 5),
    ];
    for (m, from, to, max_len) in cases {
        let (from, to) = (spec(from), spec(to));
        let p = cheapest_path(&m, &shape, 2, &from, &to).unwrap();
        check_path(&m, &shape, 2, &from, &to, &p);
        let o = brute_force_path(&m, &shape, 2, &from, &to, max_len).unwrap();
        assert!(close(p.cost_s, o.cost_s), "{} vs {}", show(&from, &p), show(&from, &o));
        assert!(p.steps.len() <= max_len);
        // Cheaper than gathering everything and slicing again.
        let mut naive = 0.0;
        let mut cur = from.clone();
        while let Some((st, next)) = moves_from(&m, &shape, &cur)
            .into_iter()
            .find(|(st, _)| matches!(st.op, Collective::AllGather { .. }))
        {
            naive += move_cost(&m, &shape, 2, &cur, &st);
            cur = next;
        }
        assert!(p.cost_s < naive, "{} vs gather-all {naive}", show(&from, &p));
    }
}

#[test]
fn pending_over_two_axes_to_replicated() {
    for (m, shape) in [
        (Mesh::with_links(&[2, 2], vec![SLOW, FAST]), [64, 64]),
        (Mesh::with_links(&[4, 4], vec![SLOW, FAST]), [64, 64]),
        (Mesh::with_links(&[4, 4], vec![SLOW, FAST]), [1024, 1024]),
    ] {
        let (from, to) = (spec("[R, R] P01"), spec("[R, R]"));
        let p = cheapest_path(&m, &shape, 4, &from, &to).unwrap();
        check_path(&m, &shape, 4, &from, &to, &p);
        let o = brute_force_path(&m, &shape, 4, &from, &to, 5).unwrap();
        assert!(close(p.cost_s, o.cost_s), "{} vs {}", show(&from, &p), show(&from, &o));
        // Never worse than two flat all-reduces; with bandwidth to save, hierarchical
        // (reduce-scatter on the fast axis, all-reduce the smaller shard on the slow one,
        // all-gather on the fast axis) wins.
        let flat = move_cost(&m, &shape, 4, &from, &step(Collective::AllReduce, 0, &m))
            + move_cost(&m, &shape, 4, &spec("[R, R] P1"), &step(Collective::AllReduce, 1, &m));
        assert!(p.cost_s < flat, "{} vs flat {flat}", show(&from, &p));
        assert_eq!(p.steps.len(), 3, "{}", show(&from, &p));
        assert!(matches!(p.steps[0].op, Collective::ReduceScatter { .. }) && p.steps[0].axis == 1);
        assert!(p.steps[1].op == Collective::AllReduce && p.steps[1].axis == 0);
        assert!(matches!(p.steps[2].op, Collective::AllGather { .. }) && p.steps[2].axis == 1);
    }
}

#[test]
fn trivial_and_unreachable() {
    let m = Mesh::with_links(&[2, 2], vec![SLOW, FAST]);
    let shape = [16, 16];
    let s = spec("[S0, S1]");
    let p = cheapest_path(&m, &shape, 4, &s, &s).unwrap();
    assert!(p.steps.is_empty() && p.cost_s == 0.0);
    // A pending sum cannot be created.
    assert!(cheapest_path(&m, &shape, 4, &spec("[R, R]"), &spec("[R, R] P0")).is_none());
    assert!(cheapest_path(&m, &shape, 4, &spec("[R, R] P1"), &spec("[R, R] P0")).is_none());
    // Invalid or non-dividing endpoints.
    assert!(cheapest_path(&m, &shape, 4, &spec("[R, R]"), &spec("[S0, S0]")).is_none());
    assert!(cheapest_path(&m, &shape, 4, &spec("[R, R]"), &spec("[S2, R]")).is_none());
    assert!(cheapest_path(&m, &shape, 4, &spec("[R, R]"), &spec("[R, R, R]")).is_none());
    assert!(cheapest_path(&m, &[3, 16], 4, &spec("[R, R]"), &spec("[S0, R]")).is_none());
    assert!(cheapest_path(&m, &[3, 16], 4, &spec("[S0, R]"), &spec("[R, R]")).is_none());
    assert!(brute_force_path(&m, &[3, 16], 4, &spec("[S0, R]"), &spec("[R, R]"), 3).is_none());
    // Only dims that divide are used on the way: [S0, R] -> [R, S0] on a 2-wide dim 1 with
    // a 4-device axis is impossible, and with dim 1 of 4 it is one all-to-all.
    let m4 = Mesh::with_links(&[4], vec![FAST]);
    assert!(cheapest_path(&m4, &[8, 2], 4, &spec("[S0, R]"), &spec("[R, S0]")).is_none());
    assert_eq!(
        cheapest_path(&m4, &[8, 4], 4, &spec("[S0, R]"), &spec("[R, S0]")).unwrap().steps.len(),
        1
    );
}

// ---- exhaustive comparison with the oracle ----

#[test]
fn matches_oracle_1d() {
    let m = Mesh::with_links(&[4], vec![FAST]);
    assert_eq!(all_specs(1, 2).len(), 4);
    let n = compare_all(&m, &[16, 16], 4, 4, 1) + compare_all(&m, &[16, 16, 16], 2, 4, 1);
    assert!(n > 20, "{n}");
    // A dim that does not divide the axis constrains the paths.
    compare_all(&m, &[16, 2, 8], 4, 4, 1);
}

#[test]
fn matches_oracle_2x2() {
    let m = Mesh::with_links(&[2, 2], vec![SLOW, FAST]);
    assert_eq!(all_specs(2, 2).len(), 18);
    let n = compare_all(&m, &[16, 16], 4, 4, 1) + compare_all(&m, &[16, 64, 16], 2, 4, 1);
    assert!(n > 400, "{n}");
    // Uneven: dim 0 takes only one axis.
    compare_all(&m, &[2, 16], 4, 4, 1);
}

#[test]
fn matches_oracle_4x4() {
    let m = Mesh::with_links(&[4, 4], vec![SLOW, FAST]);
    compare_all(&m, &[64, 64], 4, 4, 1);
    compare_all(&m, &[16, 64, 64], 2, 4, 1);
    // Latency-bound: a tiny tensor where per-hop latency dominates.
    compare_all(&m, &[16, 16], 2, 4, 1);
}

#[test]
fn matches_oracle_2x4_uneven_axes() {
    let m = Mesh::with_links(&[2, 4], vec![SLOW, FAST]);
    compare_all(&m, &[8, 16], 4, 4, 1);
    compare_all(&m, &[8, 4, 16], 2, 4, 1);
    let m = Mesh::with_links(&[4, 2], vec![FAST, SLOW]);
    compare_all(&m, &[8, 16], 4, 4, 1);
}

#[test]
fn matches_oracle_2x2x2() {
    let m = Mesh::with_links(&[2, 2, 2], vec![SLOW, MID, FAST]);
    compare_all(&m, &[16, 16], 4, 4, 1);
    compare_all(&m, &[16, 16, 16], 4, 4, 1);
    // Deeper oracle on a sample of sources: optima of up to 5 moves must match too.
    compare_all(&m, &[16, 16], 4, 5, 2);
}

#[test]
fn longer_paths_match_deeper_oracle() {
    // A few pairs whose optimum needs more than 4 moves, checked with a deeper oracle.
    let m = Mesh::with_links(&[2, 2, 2], vec![SLOW, MID, FAST]);
    let shape = [16, 16, 16];
    let specs = all_specs(3, 3);
    let mut checked = 0;
    for (i, from) in specs.iter().enumerate().step_by(37) {
        let to = &specs[(i * 7919 + 13) % specs.len()];
        let Some(d) = cheapest_path(&m, &shape, 4, from, to) else { continue };
        if d.steps.len() <= 4 || d.steps.len() > 6 {
            continue;
        }
        let o = brute_force_path(&m, &shape, 4, from, to, d.steps.len()).unwrap();
        assert!(close(d.cost_s, o.cost_s), "{} vs {}", show(from, &d), show(from, &o));
        checked += 1;
    }
    assert!(checked > 0);
}

// ---- the cache ----

#[test]
fn cache_memoises() {
    fn send<T: Send>() {}
    send::<ReshardCache>();
    let m = Mesh::with_links(&[2, 2], vec![SLOW, FAST]);
    let mut c = ReshardCache::new(m.clone());
    let specs = all_specs(2, 2);
    for _ in 0..2 {
        for from in &specs {
            for to in &specs {
                let want = cheapest_path(&m, &[16, 16], 4, from, to);
                assert_eq!(c.path(&[16, 16], 4, from, to), want.as_ref());
                assert_eq!(c.cost(&[16, 16], 4, from, to), want.map(|p| p.cost_s));
            }
        }
    }
    // One search per source, however many targets.
    let n = specs.len() * specs.len();
    assert_eq!(c.queries(), 4 * n as u64);
    assert_eq!(c.searches(), specs.len() as u64);
    // Shape and element size are part of the key.
    let (a, b) = (spec("[S0, R]"), spec("[R, S0]"));
    let c1 = c.cost(&[16, 16], 4, &a, &b).unwrap();
    let c2 = c.cost(&[16, 32], 4, &a, &b).unwrap();
    let c3 = c.cost(&[16, 16], 2, &a, &b).unwrap();
    assert!(c2 > c1 && c3 < c1);
    assert_eq!(c.searches(), specs.len() as u64 + 2);
    // Invalid endpoints are not an error, just unreachable.
    assert_eq!(c.cost(&[16, 16], 4, &a, &spec("[S0, S0]")), None);
    assert_eq!(c.path(&[3, 16], 4, &a, &b), None);
}
