//! The CPU kernels of the chunked LM head and loss (`Op::LinearCrossEntropy` and its backward)
//! against the f64 reference interpreter, for chunk sizes that divide the rows, that do not,
//! and that exceed them, with ignored rows; and against the unfused matmul + cross-entropy
//! kernels they replace.

use candle_core::{Device, Tensor};
use tessera_ir::interp::{eval_op, Value};
use tessera_ir::{Op, Shape, TensorMeta};
use tessera_runtime::kernels;
use tessera_runtime::tensor::{meta_of, to_f64_vec};

fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xbf58_476d);
            ((h >> 11) % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn value(t: &Tensor) -> Value {
    Value::new(Shape::from(t.dims().to_vec()), to_f64_vec(t).unwrap())
}

fn run(op: &Op, x: &[&Tensor]) -> Vec<Tensor> {
    let metas: Vec<TensorMeta> = x.iter().map(|t| meta_of(t).unwrap()).collect();
    let refs: Vec<&TensorMeta> = metas.iter().collect();
    let out = op.infer(&refs).unwrap();
    kernels::execute(op, x, &out).unwrap()
}

fn close(a: &Tensor, b: &[f64], what: &str) {
    let a = to_f64_vec(a).unwrap();
    assert_eq!(a.len(), b.len(), "{what}");
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-3);
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 2e-5 * (y.abs() + 1e-2 * scale), "{what}[{k}]: {x} vs {y}");
    }
}

#[test]
fn kernels_match_the_interpreter_and_the_unfused_pair() {
    let (b, s, d, v) = (3usize, 37usize, 24usize, 61usize);
    let x = Tensor::from_vec(values(b * s * d, 1), (b, s, d), &Device::Cpu).unwrap();
    let w = Tensor::from_vec(values(v * d, 2), (v, d), &Device::Cpu).unwrap();
    let ids: Vec<i64> =
        (0..b * s).map(|i| if i % 7 == 3 { -100 } else { ((i * 13) % v) as i64 }).collect();
    let t = Tensor::from_vec(ids, (b, s), &Device::Cpu).unwrap();
    let dloss = Tensor::from_vec(vec![0.37f32], (), &Device::Cpu).unwrap();
    let ig = Some(-100);
    // The unfused kernels.
    let logits = run(&Op::MatMul { trans_a: false, trans_b: true }, &[&x, &w]);
    let ce =
        run(&Op::CrossEntropy { ignore_index: ig, sum: true, classes: None }, &[&logits[0], &t]);
    for chunk_rows in [1usize, 16, 37, 50, 1000] {
        let op = Op::LinearCrossEntropy { chunk_rows, ignore_index: ig };
        let fused = run(&op, &[&x, &w, &t]);
        let want = eval_op(&op, &[&value(&x), &value(&w), &value(&t)]).unwrap();
        close(&fused[0], &want[0].data, &format!("loss, chunk {chunk_rows}"));
        close(&fused[1], &want[1].data, &format!("lse, chunk {chunk_rows}"));
        let pair0 = to_f64_vec(&ce[0]).unwrap()[0];
        let got0 = to_f64_vec(&fused[0]).unwrap()[0];
        assert!((got0 - pair0).abs() <= 1e-6 * pair0.abs(), "loss {got0} vs unfused {pair0}");
        let back = Op::LinearCrossEntropyBackward { chunk_rows, ignore_index: ig };
        let grads = run(&back, &[&x, &w, &t, &fused[1], &dloss]);
        let vals = [&x, &w, &t, &fused[1], &dloss].map(value);
        let refs: Vec<&Value> = vals.iter().collect();
        let want = eval_op(&back, &refs).unwrap();
        close(&grads[0], &want[0].data, &format!("dx, chunk {chunk_rows}"));
        close(&grads[1], &want[1].data, &format!("dweight, chunk {chunk_rows}"));
    }
}

#[test]
fn out_of_range_targets_are_refused_by_name() {
    let x = Tensor::from_vec(values(8, 3), (2, 4), &Device::Cpu).unwrap();
    let w = Tensor::from_vec(values(12, 4), (3, 4), &Device::Cpu).unwrap();
    let t = Tensor::from_vec(vec![1i64, 7], 2, &Device::Cpu).unwrap();
    let op = Op::LinearCrossEntropy { chunk_rows: 1, ignore_index: None };
    let metas = [meta_of(&x).unwrap(), meta_of(&w).unwrap(), meta_of(&t).unwrap()];
    let out = op.infer(&[&metas[0], &metas[1], &metas[2]]).unwrap();
    let err = kernels::execute(&op, &[&x, &w, &t], &out).unwrap_err().to_string();
    assert!(err.contains("target 7"), "{err}");
}
