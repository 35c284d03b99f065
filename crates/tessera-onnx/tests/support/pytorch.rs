//! Parity with PyTorch for the fixture scripts' exports (`scripts/make-onnx-fixtures.sh`,
//! `scripts/make_onnx_dynamo_fixtures.py`): each fixture directory holds `model.onnx`, a batch,
//! and PyTorch's logits, loss and parameter gradients (`reference.safetensors`,
//! `reference.json`); [`check`] imports the model and compares, in the IR's f64 interpreter.

use std::collections::HashMap;
use std::path::Path;
use tessera_ir::interp::{self, Value};
use tessera_ir::{gradients, DType, TensorId};
use tessera_onnx::{import, Bind, OnnxModel};

/// The reference tensors as (shape, f64 values).
pub fn reference(dir: &Path) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            let d = v.data();
            let vals: Vec<f64> = match v.dtype() {
                safetensors::Dtype::F32 => d
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                    .collect(),
                safetensors::Dtype::I64 => d
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("unexpected dtype {other:?}"),
            };
            (n, (v.shape().to_vec(), vals))
        })
        .collect()
}

pub fn num_parameters(dir: &Path) -> u64 {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    j["num_parameters"].as_u64().unwrap()
}

/// Largest |a - b| over the largest |b| (or 1e-30).
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.abs()).fold(1e-30, f64::max);
    diff / scale
}

/// The loss PyTorch took of the fixture's output.
#[derive(Clone, Copy)]
pub enum Loss {
    /// Cross-entropy of `[.., V]` logits against `labels` (mean).
    CrossEntropy,
    /// Mean squared error against `target`.
    Mse,
}

/// Imports the fixture in `dir`, called `name` in messages (data input `input` bound to the reference tensor of that name),
/// takes PyTorch's loss of its output, runs forward and backward in the reference interpreter
/// and checks output, loss and every gradient against PyTorch. Returns the forward graph.
pub fn check(dir: &Path, name: &str, input: &str, loss_kind: Loss) -> tessera_ir::Graph {
    let model = OnnxModel::open(&dir.join("model.onnx")).unwrap();
    let refs = reference(dir);
    let (x_shape, x) = refs[input].clone();
    let (batch, seq) = (x_shape[0], x_shape.get(1).copied().unwrap_or(1));
    let dtype_of =
        |v: &str| if v == "input_ids" || v == "labels" { DType::I64 } else { DType::F32 };
    let mut imp = import(&model, &Bind { batch, seq, dtype: DType::F32 }).unwrap();
    let out_t = imp.outputs[0];
    let b = &mut imp.builder;
    let (target_name, target_shape) = match loss_kind {
        Loss::CrossEntropy => ("labels", refs["labels"].0.clone()),
        Loss::Mse => ("target", refs["target"].0.clone()),
    };
    let target = b.input(target_name, target_shape.clone(), dtype_of(target_name));
    let loss = match loss_kind {
        Loss::CrossEntropy => b.cross_entropy(out_t, target, None).unwrap(),
        Loss::Mse => {
            let d = b.sub(out_t, target).unwrap();
            let sq = b.mul(d, d).unwrap();
            let dims: Vec<usize> = (0..target_shape.len()).collect();
            b.reduce(tessera_ir::ReduceOp::Mean, sq, &dims, false).unwrap()
        }
    };
    let params = b.graph.parameters();
    let numel: u64 = params.iter().map(|&p| b.shape(p).numel()).sum();
    assert_eq!(numel, num_parameters(dir), "{name}: parameter count");
    let forward = b.graph.clone();
    let grads = gradients(b, loss, &params).unwrap();
    let graph = b.graph.clone();
    let mut bind: HashMap<TensorId, Value> = HashMap::new();
    bind.insert(imp.inputs[0].tensor, Value::new(x_shape.clone(), x));
    bind.insert(target, Value::new(target_shape.clone(), refs[target_name].1.clone()));
    for &p in &params {
        let pname = graph.tensor_scope(p);
        let (shape, w) = model.weights_f32(pname).unwrap().unwrap();
        bind.insert(p, Value::new(shape, w.into_iter().map(f64::from).collect()));
    }
    let mut wanted = vec![out_t, loss];
    wanted.extend(grads.iter().map(|g| g.expect("every parameter reaches the loss")));
    let out = interp::eval_outputs(&graph, &bind, &wanted).unwrap();
    let e = rel_err(&out[0].data, &refs["logits"].1);
    assert!(e < 1e-4, "{name}: output differs from PyTorch's by {e:e} (relative)");
    let e = (out[1].item() - refs["loss"].1[0]).abs();
    assert!(e < 1e-4, "{name}: loss {} vs PyTorch {}", out[1].item(), refs["loss"].1[0]);
    // Gradients: relative to the largest gradient of the model (some are zero but for
    // rounding: softmax ignores a per-key bias).
    let global = refs
        .iter()
        .filter(|(k, _)| k.starts_with("grad."))
        .flat_map(|(_, v)| v.1.iter())
        .fold(0.0f64, |m, x| m.max(x.abs()));
    for (k, &p) in params.iter().enumerate() {
        let pname = graph.tensor_scope(p);
        let r = &refs[&format!("grad.{pname}")].1;
        let got = &out[2 + k].data;
        let diff = got.iter().zip(r).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        let own = r.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        assert!(
            diff <= 1e-4 * own.max(1e-3 * global),
            "{name}: gradient of {pname} differs by {diff:e} (its largest {own:e})"
        );
    }
    forward
}
