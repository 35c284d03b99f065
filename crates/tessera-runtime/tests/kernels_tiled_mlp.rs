//! The CPU kernels of the tiled MLP (`Op::TiledMlp` and its backward) against the f64
//! reference interpreter, gated (SwiGLU, `nn.Linear` weights) and plain (GPT-2's GELU with
//! `Conv1D` weights and a bias), for chunks that divide the rows, that do not, and that exceed
//! them.

use candle_core::{Device, Tensor};
use tessera_ir::interp::{eval_op, Value};
use tessera_ir::ops::{MlpSpec, UnaryOp};
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
fn kernels_match_the_reference() {
    let (rows, d, f) = ([3usize, 7usize], 8usize, 20usize);
    for (act, gated) in [(UnaryOp::Silu, true), (UnaryOp::GeluTanh, false)] {
        for chunk_rows in [1, 5, 7, 64] {
            let spec = MlpSpec { act, gated, conv1d: !gated, bias: !gated, chunk_rows };
            let up = if gated { vec![f, d] } else { vec![d, f] };
            let mut shapes = vec![vec![rows[0], rows[1], d], up.clone()];
            shapes.push(if gated { up.clone() } else { vec![f] });
            shapes.push(vec![up[1], up[0]]);
            shapes.push(vec![rows[0], rows[1], d]); // dy
            let ts: Vec<Tensor> = shapes
                .iter()
                .enumerate()
                .map(|(k, s)| {
                    let n = s.iter().product();
                    Tensor::from_vec(values(n, k as u64 + 3), s.as_slice(), &Device::Cpu).unwrap()
                })
                .collect();
            let refs: Vec<&Tensor> = ts.iter().collect();
            let vals: Vec<Value> = ts.iter().map(value).collect();
            let vrefs: Vec<&Value> = vals.iter().collect();
            let what = format!("{spec:?}");
            let fwd = Op::TiledMlp(spec);
            let y = run(&fwd, &refs[..4]);
            close(&y[0], &eval_op(&fwd, &vrefs[..4]).unwrap()[0].data, &format!("{what} y"));
            let back = Op::TiledMlpBackward(spec);
            let got = run(&back, &refs);
            let want = eval_op(&back, &vrefs).unwrap();
            assert_eq!(got.len(), 4);
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.dims(), w.shape.dims(), "{what} grad {k}");
                close(g, &w.data, &format!("{what} grad {k}"));
            }
        }
    }
}
