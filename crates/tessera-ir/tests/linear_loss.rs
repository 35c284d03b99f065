//! The chunked LM head and loss (`Op::LinearCrossEntropy` and its backward) against the pair it
//! fuses — `MatMul { trans_b }` then the summed `CrossEntropy` — on the f64 interpreter, for
//! chunk sizes that divide the rows, that do not, and that exceed them; and its declared
//! workspace, FLOPs and shape checks.

use tessera_ir::interp::{eval_op, Value};
use tessera_ir::{DType, Op, Shape, TensorMeta};

/// Deterministic values in (−1, 1).
fn values(n: usize, seed: u64) -> Vec<f64> {
    (0..n as u64)
        .map(|i| {
            let h = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xbf58_476d);
            ((h >> 11) % 2000) as f64 / 1000.0 - 1.0
        })
        .collect()
}

fn close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-12 * (1.0 + y.abs()), "{what}[{k}]: {x} vs {y}");
    }
}

#[test]
fn fused_equals_the_matmul_and_cross_entropy_it_replaces() {
    let (b, s, d, v) = (2usize, 5usize, 3usize, 7usize);
    let x = Value::new(Shape::from(vec![b, s, d]), values(b * s * d, 1));
    let w = Value::new(Shape::from(vec![v, d]), values(v * d, 2));
    let ids: Vec<f64> = [3, -100, 0, 6, 2, 1, 5, -100, 4, 6].iter().map(|&t| t as f64).collect();
    let t = Value::new(Shape::from(vec![b, s]), ids);
    let ignore = Some(-100);
    // The pair.
    let logits = eval_op(&Op::MatMul { trans_a: false, trans_b: true }, &[&x, &w]).unwrap();
    let ce = Op::CrossEntropy { ignore_index: ignore, sum: true, classes: None };
    let pair = eval_op(&ce, &[&logits[0], &t]).unwrap();
    let dloss = Value::scalar(0.7);
    let ce_back = Op::CrossEntropyBackward { ignore_index: ignore, sum: true, classes: None };
    let g = eval_op(&ce_back, &[&logits[0], &t, &pair[1], &dloss]).unwrap();
    let dx = eval_op(&Op::MatMul { trans_a: false, trans_b: false }, &[&g[0], &w]).unwrap();
    // dW = Σ over rows: Gᵀ·x with both read as [rows, ·].
    let g2 = Value::new(Shape::from(vec![b * s, v]), g[0].data.clone());
    let x2 = Value::new(Shape::from(vec![b * s, d]), x.data.clone());
    let dw = eval_op(&Op::MatMul { trans_a: true, trans_b: false }, &[&g2, &x2]).unwrap();
    for chunk_rows in [1, 3, 4, 10, 64] {
        let op = Op::LinearCrossEntropy { chunk_rows, ignore_index: ignore };
        let fused = eval_op(&op, &[&x, &w, &t]).unwrap();
        close(&fused[0].data, &pair[0].data, &format!("loss, chunk {chunk_rows}"));
        close(&fused[1].data, &pair[1].data, &format!("logsumexp, chunk {chunk_rows}"));
        assert_eq!(fused[1].shape, t.shape);
        let back = Op::LinearCrossEntropyBackward { chunk_rows, ignore_index: ignore };
        let grads = eval_op(&back, &[&x, &w, &t, &fused[1], &dloss]).unwrap();
        assert_eq!(grads[0].shape, x.shape);
        assert_eq!(grads[1].shape, w.shape);
        close(&grads[0].data, &dx[0].data, &format!("dx, chunk {chunk_rows}"));
        close(&grads[1].data, &dw[0].data, &format!("dweight, chunk {chunk_rows}"));
    }
}

#[test]
fn workspace_is_one_chunk_of_logits_and_flops_count_the_recomputation() {
    let m = |dims: Vec<usize>, dt| TensorMeta::new(Shape::from(dims), dt);
    let (x, w, t) = (
        m(vec![2, 100, 16], DType::BF16),
        m(vec![50, 16], DType::BF16),
        m(vec![2, 100], DType::I64),
    );
    let op = Op::LinearCrossEntropy { chunk_rows: 64, ignore_index: None };
    let out = op.infer(&[&x, &w, &t]).unwrap();
    assert_eq!(out[0], m(vec![], DType::F32));
    assert_eq!(out[1], m(vec![2, 100], DType::F32));
    assert_eq!(op.workspace_bytes(&[&x, &w, &t]), 64 * 50 * 4);
    // A chunk larger than the rows holds the rows only.
    let big = Op::LinearCrossEntropy { chunk_rows: 1000, ignore_index: None };
    assert_eq!(big.workspace_bytes(&[&x, &w, &t]), 200 * 50 * 4);
    let y: Vec<&TensorMeta> = out.iter().collect();
    let f = op.flops(&[&x, &w, &t], &y);
    assert_eq!(f.matmul, 2 * 200 * 16 * 50);
    let (lse, dl) = (m(vec![2, 100], DType::F32), m(vec![], DType::F32));
    let back = Op::LinearCrossEntropyBackward { chunk_rows: 64, ignore_index: None };
    let grads = back.infer(&[&x, &w, &t, &lse, &dl]).unwrap();
    assert_eq!(grads, vec![x.clone(), w.clone()]);
    let gy: Vec<&TensorMeta> = grads.iter().collect();
    assert_eq!(back.flops(&[&x, &w, &t, &lse, &dl], &gy).matmul, 3 * 2 * 200 * 16 * 50);
    assert_eq!(back.workspace_bytes(&[&x, &w, &t, &lse, &dl]), 64 * 50 * 4);
    // Shape errors name the problem.
    let bad_w = m(vec![50, 8], DType::BF16);
    assert!(op.infer(&[&x, &bad_w, &t]).unwrap_err().contains("weight"));
    let zero = Op::LinearCrossEntropy { chunk_rows: 0, ignore_index: None };
    assert!(zero.infer(&[&x, &w, &t]).unwrap_err().contains("chunk_rows"));
}
