//! A small convolutional network — stem convolution, GroupNorm, ReLU, max pooling, a strided
//! grouped convolution with a bias, nearest upsampling, a 1×1 convolution, global average
//! pooling and a linear classifier under cross-entropy — differentiated by the IR, lowered to
//! a Program and run by the executor on the CPU kernels; its loss and every gradient must
//! match the f64 reference interpreter on the same graph and values (norm-wise 1e-4, the
//! whole-model criterion of the CLI's `runtime_grads`).

use std::collections::HashMap;
use tessera_ir::interp::{eval_outputs, Value};
use tessera_ir::{gradients, Builder, Conv2dSpec, DType, Program, TensorId};
use tessera_runtime::tensor::{from_vec, to_f64_vec};
use tessera_runtime::{CpuBackend, Executor};

/// Uniform in [-1, 1) from a counter (splitmix64).
fn uniform(seed: u64, i: u64) -> f64 {
    let mut z = (seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 52) as f64 * 2.0 - 1.0
}

/// The network in `dtype` (weights, pixels and activations), run by the executor; returns the
/// largest norm-wise relative error of its loss and gradients against the interpreter.
fn worst_error(dtype: DType) -> f64 {
    let (n, classes) = (4, 5);
    let mut b = Builder::new();
    let x = b.input("pixels", [n, 3, 12, 12], dtype);
    let labels = b.input("labels", [n], DType::I64);
    let conv = |stride: usize, padding: usize, groups: usize| Conv2dSpec {
        stride: [stride; 2],
        padding: [padding; 2],
        dilation: [1, 1],
        groups,
    };
    let w1 = b.parameter("stem.weight", [8, 3, 3, 3], dtype);
    let (gw, gb) = (b.parameter("gn.weight", [8], dtype), b.parameter("gn.bias", [8], dtype));
    let w2 = b.parameter("down.weight", [8, 4, 3, 3], dtype);
    let b2 = b.parameter("down.bias", [1, 8, 1, 1], dtype);
    let w3 = b.parameter("proj.weight", [6, 8, 1, 1], dtype);
    let head = b.parameter("head.weight", [6, classes], dtype);
    let loss = (|| -> tessera_ir::Result<TensorId> {
        let h = b.conv2d(x, w1, conv(1, 1, 1))?; // [n, 8, 12, 12]
        let h = b.group_norm(h, gw, gb, 4, 1e-5)?;
        let h = b.unary(tessera_ir::UnaryOp::Relu, h)?;
        let h = b.max_pool2d(h, [3, 3], [2, 2], [1, 1])?; // [n, 8, 6, 6]
        let h = b.conv2d(h, w2, conv(2, 1, 2))?; // [n, 8, 3, 3]
        let h = b.add(h, b2)?;
        let h = b.upsample_nearest2d(h, [2, 2])?; // [n, 8, 6, 6]
        let h = b.conv2d(h, w3, conv(1, 0, 1))?; // [n, 6, 6, 6]
        let h = b.avg_pool2d(h, [6, 6], [1, 1], [0, 0], false)?; // [n, 6, 1, 1]
        let h = b.reshape(h, [n, 6])?;
        let logits = b.matmul(h, head, false, false)?;
        b.cross_entropy(logits, labels, None)
    })()
    .expect("the model builds");
    let params = b.graph.parameters();
    let grads: Vec<TensorId> = gradients(&mut b, loss, &params)
        .expect("autodiff")
        .into_iter()
        .map(|g| g.expect("every parameter has a gradient"))
        .collect();
    let graph = b.finish();

    let mut f32_values: HashMap<TensorId, Vec<f32>> = HashMap::new();
    for (k, &t) in params.iter().chain([&x]).enumerate() {
        let numel = graph.meta(t).numel();
        let scale = if graph.shape(t).rank() == 1 { 0.2 } else { 0.5 };
        let offset = if graph.tensor_scope(t) == "gn.weight" { 1.0 } else { 0.0 };
        // Values the dtype holds exactly, so both sides start from the same numbers.
        let round = |v: f64| match dtype {
            DType::BF16 => half::bf16::from_f64(v).to_f32(),
            _ => v as f32,
        };
        let v = (0..numel).map(|i| round(offset + scale * uniform(k as u64, i))).collect();
        f32_values.insert(t, v);
    }
    let label_values: Vec<i64> = (0..n as i64).map(|i| (3 * i + 1) % classes as i64).collect();

    let mut bindings = HashMap::new();
    for (&t, v) in &f32_values {
        bindings
            .insert(t, Value::new(graph.shape(t).clone(), v.iter().map(|&x| x as f64).collect()));
    }
    bindings.insert(labels, Value::from_i64(graph.shape(labels).clone(), &label_values));
    let mut wanted = vec![loss];
    wanted.extend(&grads);
    let reference = eval_outputs(&graph, &bindings, &wanted).expect("interpreter runs");

    let program = Program::lower_graph(graph.clone(), wanted.clone(), &grads);
    let mut exec = Executor::new(program, CpuBackend::new(0), None);
    for (&t, v) in &f32_values {
        let value = from_vec(v.clone(), graph.shape(t).dims()).unwrap();
        let value = value.to_dtype(tessera_runtime::tensor::candle_dtype(dtype)).unwrap();
        exec.bind(t, value).unwrap();
    }
    exec.bind(labels, from_vec(label_values, &[n]).unwrap()).unwrap();
    exec.run().expect("runtime runs");

    let mut worst = 0f64;
    for (k, (&t, want)) in wanted.iter().zip(&reference).enumerate() {
        let got = to_f64_vec(exec.get(t).expect("output kept")).unwrap();
        let diff = got.iter().zip(&want.data).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
        let norm = want.data.iter().map(|b| b * b).sum::<f64>().sqrt();
        let what = if k == 0 {
            "loss".to_string()
        } else {
            format!("grad of {}", graph.tensor_scope(params[k - 1]))
        };
        assert!(norm > 0.0, "{dtype} {what} is identically zero");
        worst = worst.max(diff / norm);
    }
    worst
}

#[test]
fn small_cnn_loss_and_gradients_match_the_interpreter() {
    let err = worst_error(DType::F32);
    assert!(err < 1e-4, "worst relative error {err:.2e}");
}

/// bf16 weights and activations (each op upcast to f32 and its outputs rounded to bf16, the
/// CPU backend's mixed precision): within bf16's rounding of the f64 reference.
#[test]
fn small_cnn_in_bf16_stays_within_bf16_rounding() {
    let err = worst_error(DType::BF16);
    assert!(err < 5e-2, "worst relative error {err:.2e}");
}
