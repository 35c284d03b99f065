//! The tiled MLP (`Op::TiledMlp` and its backward) against the unfused ops it replaces —
//! matmuls, the bias add, the activation and (gated) the product, differentiated by autodiff —
//! on the f64 interpreter, for chunks that divide the rows, that do not, and that exceed
//! them; and its declared workspace, FLOPs and shape checks.

use std::collections::HashMap;
use tessera_ir::interp::{self, Value};
use tessera_ir::ops::{MlpSpec, UnaryOp};
use tessera_ir::{Builder, DType, Op, Shape, TensorId, TensorMeta};

/// Deterministic values in (−1, 1).
fn values(n: usize, seed: u64) -> Vec<f64> {
    (0..n as u64)
        .map(|i| {
            let h = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xbf58_476d);
            ((h >> 11) % 2000) as f64 / 1000.0 - 1.0
        })
        .collect()
}

/// `[x, up weight(s), (bias), down weight]` shapes of a spec.
fn shapes(spec: &MlpSpec, rows: [usize; 2], d: usize, f: usize) -> Vec<Vec<usize>> {
    let up = if spec.conv1d { vec![d, f] } else { vec![f, d] };
    let mut s = vec![vec![rows[0], rows[1], d], up.clone()];
    if spec.gated {
        s.push(up.clone());
    }
    if spec.bias {
        s.push(vec![f]);
    }
    s.push(vec![up[1], up[0]]);
    s
}

/// The MLP as the model builds it, unfused.
fn unfused(b: &mut Builder, spec: &MlpSpec, ins: &[TensorId]) -> TensorId {
    let proj = |b: &mut Builder, x, w| b.matmul(x, w, false, !spec.conv1d).unwrap();
    let mut h = proj(b, ins[0], ins[1]);
    if let Some(i) = spec.bias_at() {
        h = b.add(h, ins[i]).unwrap();
    }
    let mut g = b.unary(spec.act, h).unwrap();
    if let Some(i) = spec.up() {
        let u = proj(b, ins[0], ins[i]);
        g = b.mul(g, u).unwrap();
    }
    proj(b, g, ins[spec.down()])
}

/// `y` and the gradient of every input of `Σ y ⊙ r` (r fixed), fused or not.
fn run(spec: &MlpSpec, fused: bool) -> Vec<Value> {
    let mut b = Builder::new();
    let mut bind = HashMap::new();
    let mut ins = Vec::new();
    for (k, s) in shapes(spec, [2, 5], 3, 4).into_iter().enumerate() {
        let t = b.parameter(&format!("p{k}"), s.clone(), DType::F64);
        let n = s.iter().product();
        bind.insert(t, Value::new(Shape::from(s), values(n, k as u64 + 1)));
        ins.push(t);
    }
    let y = if fused {
        b.push1(Op::TiledMlp(*spec), &ins).unwrap()
    } else {
        unfused(&mut b, spec, &ins)
    };
    let r = b.input("r", vec![2, 5, 3], DType::F64);
    bind.insert(r, Value::new(Shape::from(vec![2, 5, 3]), values(30, 99)));
    let prod = b.mul(y, r).unwrap();
    let loss = b.reduce(tessera_ir::ops::ReduceOp::Sum, prod, &[0, 1, 2], false).unwrap();
    let grads = tessera_ir::gradients(&mut b, loss, &ins).unwrap();
    let mut outs = vec![y];
    outs.extend(grads.into_iter().map(|g| g.unwrap()));
    let g = b.finish();
    interp::eval_outputs(&g, &bind, &outs).unwrap()
}

#[test]
fn fused_equals_the_ops_it_replaces_and_its_gradients() {
    for (act, gated) in [(UnaryOp::Silu, true), (UnaryOp::GeluTanh, false), (UnaryOp::Gelu, false)]
    {
        for chunk_rows in [1, 3, 4, 10, 64] {
            let spec = MlpSpec { act, gated, conv1d: !gated, bias: !gated, chunk_rows };
            let (a, b) = (run(&spec, true), run(&spec, false));
            for (k, (p, q)) in a.iter().zip(&b).enumerate() {
                assert_eq!(p.shape, q.shape, "{spec:?} output {k}");
                for (i, (x, y)) in p.data.iter().zip(&q.data).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-12 * (1.0 + y.abs()),
                        "{spec:?} [{k}][{i}]: {x} vs {y}"
                    );
                }
            }
        }
    }
}

#[test]
fn workspace_is_one_chunk_of_intermediates_and_flops_count_the_recomputation() {
    let m = |dims: Vec<usize>| TensorMeta::new(Shape::from(dims), DType::BF16);
    let (x, wg, wu, wd) = (m(vec![2, 100, 16]), m(vec![56, 16]), m(vec![56, 16]), m(vec![16, 56]));
    let spec =
        MlpSpec { act: UnaryOp::Silu, gated: true, conv1d: false, bias: false, chunk_rows: 64 };
    let op = Op::TiledMlp(spec);
    let ins = [&x, &wg, &wu, &wd];
    assert_eq!(op.infer(&ins).unwrap(), vec![x.clone()]);
    // Gated: the gate, the up projection and their product, one chunk of each.
    assert_eq!(op.workspace_bytes(&ins), 3 * 64 * 56 * 2);
    let big = Op::TiledMlp(MlpSpec { chunk_rows: 1000, ..spec });
    assert_eq!(big.workspace_bytes(&ins), 3 * 200 * 56 * 2);
    let y = [&x];
    assert_eq!(op.flops(&ins, &y).matmul, 3 * 2 * 200 * 16 * 56);
    let back = Op::TiledMlpBackward(spec);
    let bins = [&x, &wg, &wu, &wd, &x];
    let grads = back.infer(&bins).unwrap();
    assert_eq!(grads, vec![x.clone(), wg.clone(), wu.clone(), wd.clone()]);
    let gy: Vec<&TensorMeta> = grads.iter().collect();
    assert_eq!(back.flops(&bins, &gy).matmul, 3 * 3 * 2 * 200 * 16 * 56);
    assert_eq!(back.workspace_bytes(&bins), 6 * 64 * 56 * 2);
    // Shape errors name the problem.
    let bad = m(vec![16, 56]);
    assert!(op.infer(&[&x, &bad, &wu, &wd]).unwrap_err().contains("up weight"));
    let zero = Op::TiledMlp(MlpSpec { chunk_rows: 0, ..spec });
    assert!(zero.infer(&ins).unwrap_err().contains("chunk_rows"));
    let gated_bias = Op::TiledMlp(MlpSpec { bias: true, ..spec });
    assert!(gated_bias.infer(&ins).unwrap_err().contains("no bias"));
}
