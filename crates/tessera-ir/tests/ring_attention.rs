//! Ring attention's IR pieces in the f64 interpreter: attention over one device's block of
//! keys at global positions (`AttentionSpec::ring`), its log-sum-exp differentiated (the
//! backward's seventh input), and the log-sum-exp merge (`Op::AttentionMerge`).
//!
//! - Blocks merged == whole attention: the device at the mesh origin's queries against every
//!   device's key block (steps `0..cp`), merged, equal the rows of one whole-sequence
//!   attention at those positions — contiguous and zig-zag layouts, causal, sliding window,
//!   ALiBi and GQA; and their gradients (through the merge's and the blocks' backwards) equal
//!   the whole attention's backward fed the same output gradient on those rows.
//! - Finite differences: a block's attention with both outputs read (out and log-sum-exp),
//!   and a whole ring (blocks → merge), against central differences of the interpreter.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_ir::interp::{eval_op, Value};
use tessera_ir::{Alibi, AttentionSpec, Op, RingBlock};

fn random(rng: &mut StdRng, dims: &[usize]) -> Value {
    let n = dims.iter().product();
    Value::new(dims.to_vec(), (0..n).map(|_| rng.random_range(-1.0..1.0)).collect())
}

/// Rows `pos` (of dim 1) of a `[B, N, ...]` value.
fn take_rows(x: &Value, pos: &[i64]) -> Value {
    let (b, n) = (x.dims()[0], x.dims()[1]);
    let row = x.numel() / (b * n);
    let mut data = Vec::with_capacity(b * pos.len() * row);
    for bi in 0..b {
        for &p in pos {
            let o = (bi * n + p as usize) * row;
            data.extend_from_slice(&x.data[o..o + row]);
        }
    }
    let mut dims = x.dims().to_vec();
    dims[1] = pos.len();
    Value::new(dims, data)
}

fn max_diff(a: &Value, b: &Value) -> f64 {
    assert_eq!(a.dims(), b.dims());
    a.data.iter().zip(&b.data).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// Whole attention over `n` tokens vs the origin device's queries against each of `cp`
/// blocks, merged: outputs and gradients.
fn blocks_match_whole(cp: usize, zigzag: bool, base: &AttentionSpec, h: usize, hkv: usize) {
    let (b, d, local) = (2, 3, 4);
    let n = cp * local;
    let mut rng = StdRng::seed_from_u64(cp as u64 * 7 + zigzag as u64);
    let (q, k, v) = (
        random(&mut rng, &[b, n, h, d]),
        random(&mut rng, &[b, n, hkv, d]),
        random(&mut rng, &[b, n, hkv, d]),
    );
    let whole = eval_op(&Op::Attention(base.clone()), &[&q, &k, &v]).unwrap();
    let ring = |step| RingBlock { axis: 0, size: cp, step, zigzag };
    let qpos = ring(0).positions_of(local, 0);
    let ql = take_rows(&q, &qpos);

    let mut pairs = Vec::new();
    let mut blocks = Vec::new();
    for step in 0..cp {
        let spec = AttentionSpec { ring: Some(ring(step)), ..base.clone() };
        let (qp, kp) = ring(step).positions(local, local, None);
        assert_eq!(qp, qpos);
        let (kb, vb) = (take_rows(&k, &kp), take_rows(&v, &kp));
        let ol = eval_op(&Op::Attention(spec.clone()), &[&ql, &kb, &vb]).unwrap();
        pairs.extend(ol.clone());
        blocks.push((spec, kb, vb, kp, ol));
    }
    let refs: Vec<&Value> = pairs.iter().collect();
    let merged = eval_op(&Op::AttentionMerge, &refs).unwrap().remove(0);
    let want = take_rows(&whole[0], &qpos);
    let what = format!("cp{cp} zigzag={zigzag} {base:?}");
    assert!(max_diff(&merged, &want) < 1e-12, "{what}: merged output off");

    // Gradients: the whole backward fed dout on the origin's rows only.
    let dl = random(&mut rng, &[b, local, h, d]);
    let mut dout = Value::zeros(vec![b, n, h, d]);
    for bi in 0..b {
        for (r, &p) in qpos.iter().enumerate() {
            let (to, from) = (((bi * n + p as usize) * h) * d, ((bi * local + r) * h) * d);
            dout.data[to..to + h * d].copy_from_slice(&dl.data[from..from + h * d]);
        }
    }
    let gw =
        eval_op(&Op::AttentionBackward(base.clone()), &[&q, &k, &v, &whole[0], &whole[1], &dout])
            .unwrap();
    let mut x = refs.clone();
    x.push(&dl);
    let gm = eval_op(&Op::AttentionMergeBackward, &x).unwrap();
    let mut dq = Value::zeros(ql.dims().to_vec());
    for (r, (spec, kb, vb, kp, ol)) in blocks.iter().enumerate() {
        let x = [&ql, kb, vb, &ol[0], &ol[1], &gm[2 * r], &gm[2 * r + 1]];
        let g = eval_op(&Op::AttentionBackward(spec.clone()), &x).unwrap();
        dq.data.iter_mut().zip(&g[0].data).for_each(|(a, b)| *a += b);
        assert!(max_diff(&g[1], &take_rows(&gw[1], kp)) < 1e-12, "{what}: dk of block {r}");
        assert!(max_diff(&g[2], &take_rows(&gw[2], kp)) < 1e-12, "{what}: dv of block {r}");
    }
    assert!(max_diff(&dq, &take_rows(&gw[0], &qpos)) < 1e-12, "{what}: dq");
}

#[test]
fn blocks_merged_by_logsumexp_equal_whole_attention() {
    let causal = AttentionSpec::causal(3);
    let window = AttentionSpec { window: Some(5), ..causal.clone() };
    let alibi = AttentionSpec { alibi: Some(Alibi { heads: 4, shard: None }), ..causal.clone() };
    let full = AttentionSpec { causal: false, ..causal.clone() };
    for (cp, zigzag) in [(2, false), (3, false), (2, true), (3, true)] {
        for spec in [&causal, &window, &alibi, &full] {
            blocks_match_whole(cp, zigzag, spec, 4, 2);
        }
    }
}

#[test]
fn zigzag_positions_pair_early_and_late_chunks() {
    let r = RingBlock { axis: 1, size: 2, step: 1, zigzag: true };
    assert_eq!(r.positions_of(4, 0), vec![0, 1, 6, 7]);
    assert_eq!(r.positions_of(4, 1), vec![2, 3, 4, 5]);
    let c = RingBlock { zigzag: false, ..r };
    assert_eq!(c.positions_of(4, 1), vec![4, 5, 6, 7]);
    // Step 1 on device 0 reads device 1's keys.
    assert_eq!(r.positions(4, 4, None), (vec![0, 1, 6, 7], vec![2, 3, 4, 5]));
}

/// `Σ out ⊙ w` of the ops' outputs at `x`: a scalar to differentiate numerically.
fn weighted(f: &dyn Fn(&[Value]) -> Vec<Value>, x: &[Value], w: &[Value]) -> f64 {
    f(x).iter()
        .zip(w)
        .map(|(o, w)| o.data.iter().zip(&w.data).map(|(a, b)| a * b).sum::<f64>())
        .sum()
}

/// The gradient `grad` of `weighted` at `x` against central differences.
fn check_fd(
    what: &str,
    f: &dyn Fn(&[Value]) -> Vec<Value>,
    x: &[Value],
    w: &[Value],
    grad: &[Value],
) {
    for (i, (xi, gi)) in x.iter().zip(grad).enumerate() {
        let mut num = vec![0.0; xi.numel()];
        for (e, n) in num.iter_mut().enumerate() {
            let h = 1e-5 * xi.data[e].abs().max(1.0);
            let mut up = x.to_vec();
            up[i].data[e] += h;
            let mut down = x.to_vec();
            down[i].data[e] -= h;
            *n = (weighted(f, &up, w) - weighted(f, &down, w)) / (2.0 * h);
        }
        let err: f64 = num.iter().zip(&gi.data).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
        let nn = num.iter().map(|a| a * a).sum::<f64>().sqrt();
        // A block no query sees has a zero gradient, exactly so analytically.
        if nn < 1e-9 {
            assert!(gi.data.iter().all(|&g| g == 0.0), "{what}: input {i} should have none");
            continue;
        }
        assert!(err / nn < 1e-6, "{what}: input {i}'s gradient off by {:e}", err / nn);
    }
}

#[test]
fn a_blocks_logsumexp_and_the_merge_match_finite_differences() {
    let mut rng = StdRng::seed_from_u64(11);
    let (b, s, h, hkv, d, cp) = (1, 4, 4, 2, 3, 2);
    for zigzag in [false, true] {
        // One block, both outputs read: q of device 0 against its own keys (every row sees one).
        let spec = AttentionSpec {
            ring: Some(RingBlock { axis: 0, size: cp, step: 0, zigzag }),
            ..AttentionSpec::causal(d)
        };
        let x = vec![
            random(&mut rng, &[b, s, h, d]),
            random(&mut rng, &[b, s, hkv, d]),
            random(&mut rng, &[b, s, hkv, d]),
        ];
        let w = vec![random(&mut rng, &[b, s, h, d]), random(&mut rng, &[b, h, s])];
        let op = Op::Attention(spec.clone());
        let f = |x: &[Value]| eval_op(&op, &x.iter().collect::<Vec<_>>()).unwrap();
        let y = f(&x);
        let g = eval_op(
            &Op::AttentionBackward(spec.clone()),
            &[&x[0], &x[1], &x[2], &y[0], &y[1], &w[0], &w[1]],
        )
        .unwrap();
        check_fd(&format!("block zigzag={zigzag}"), &f, &x, &w, &g);

        // A whole ring from device 0: blocks (one fully masked under contiguous chunks) merged.
        let x: Vec<Value> = std::iter::once(random(&mut rng, &[b, s, h, d]))
            .chain((0..2 * cp).map(|_| random(&mut rng, &[b, s, hkv, d])))
            .collect();
        let specs: Vec<AttentionSpec> = (0..cp)
            .map(|step| AttentionSpec {
                ring: Some(RingBlock { axis: 0, size: cp, step, zigzag }),
                ..AttentionSpec::causal(d)
            })
            .collect();
        let blocks = |x: &[Value]| -> Vec<Vec<Value>> {
            specs
                .iter()
                .enumerate()
                .map(|(r, sp)| {
                    eval_op(&Op::Attention(sp.clone()), &[&x[0], &x[1 + 2 * r], &x[2 + 2 * r]])
                        .unwrap()
                })
                .collect()
        };
        let f = |x: &[Value]| {
            let bl = blocks(x);
            let refs: Vec<&Value> = bl.iter().flatten().collect();
            eval_op(&Op::AttentionMerge, &refs).unwrap()
        };
        let w = vec![random(&mut rng, &[b, s, h, d])];
        let bl = blocks(&x);
        let mut refs: Vec<&Value> = bl.iter().flatten().collect();
        refs.push(&w[0]);
        let gm = eval_op(&Op::AttentionMergeBackward, &refs).unwrap();
        let mut grads = vec![Value::zeros(vec![b, s, h, d])];
        for (r, sp) in specs.iter().enumerate() {
            let (o, l) = (&bl[r][0], &bl[r][1]);
            let xs = [&x[0], &x[1 + 2 * r], &x[2 + 2 * r], o, l, &gm[2 * r], &gm[2 * r + 1]];
            let g = eval_op(&Op::AttentionBackward(sp.clone()), &xs).unwrap();
            grads[0].data.iter_mut().zip(&g[0].data).for_each(|(a, b)| *a += b);
            grads.extend([g[1].clone(), g[2].clone()]);
        }
        // Device 0's queries see none of device 1's keys with contiguous chunks.
        let masked = grads[3].data.iter().chain(&grads[4].data).all(|&g| g == 0.0);
        assert_eq!(masked, !zigzag);
        check_fd(&format!("ring zigzag={zigzag}"), &f, &x, &w, &grads);
    }
}

/// Causal work per device over a whole ring: zig-zag chunks give every device the same number
/// of visible (query, key) pairs; contiguous chunks leave the first device with the least.
/// The pairs are counted by the mask the kernels apply, checked here against a brute count.
#[test]
fn zigzag_chunks_balance_causal_work_and_contiguous_do_not() {
    use tessera_ir::dist::MeshPos;
    let local = 8;
    for cp in [2, 4] {
        let work = |zigzag: bool| -> Vec<u64> {
            (0..cp)
                .map(|c| {
                    let at = MeshPos::new(&[cp], c).unwrap();
                    (0..cp)
                        .map(|step| {
                            let ring = RingBlock { axis: 0, size: cp, step, zigzag };
                            let spec =
                                AttentionSpec { ring: Some(ring), ..AttentionSpec::causal(2) };
                            let (qp, kp) = ring.positions(local, local, Some(&at));
                            let brute =
                                qp.iter().flat_map(|p| kp.iter().filter(move |k| *k <= p)).count();
                            let pairs = spec.visible_pairs(local, local, Some(&at));
                            assert_eq!(pairs, brute as u64);
                            pairs
                        })
                        .sum()
                })
                .collect()
        };
        let (zz, contiguous) = (work(true), work(false));
        let n = (cp * local) as u64;
        assert_eq!(zz.iter().sum::<u64>(), n * (n + 1) / 2, "every causal pair once");
        assert_eq!(contiguous.iter().sum::<u64>(), n * (n + 1) / 2);
        assert!(zz.iter().all(|&w| w == zz[0]), "cp{cp}: zig-zag work {zz:?}");
        assert!(contiguous[cp - 1] > 2 * contiguous[0], "cp{cp}: contiguous work {contiguous:?}");
    }
}
