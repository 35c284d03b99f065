//! Imported dynamo exports against PyTorch: the fixtures of `scripts/make_onnx_dynamo_fixtures.py`
//! hold each model exported by current PyTorch's default `torch.onnx.export` (dynamo, opset 20,
//! external data, the optimizer's folds), a batch, and PyTorch's logits, loss and parameter
//! gradients. The imported graph, run by the IR's reference interpreter (f64) with the
//! file's initialisers, must reproduce them.

use crate::support;

use std::path::PathBuf;
use support::pytorch::{self, Loss};
use tessera_onnx::OnnxModel;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tessera-cli/tests/fixtures/onnx-dynamo")
        .join(name)
}

/// Fixture `name` against PyTorch ([`pytorch::check`]).
fn check(name: &str, input: &str, loss_kind: Loss) -> tessera_ir::Graph {
    pytorch::check(&fixture(name), name, input, loss_kind)
}

#[test]
fn gpt2_matches_pytorch() {
    check("gpt2", "input_ids", Loss::CrossEntropy);
}
#[test]
fn llama_matches_pytorch() {
    check("llama", "input_ids", Loss::CrossEntropy);
}
#[test]
fn llama_static_matches_pytorch() {
    check("llama-static", "input_ids", Loss::CrossEntropy);
}
#[test]
fn opt_matches_pytorch() {
    check("opt", "input_ids", Loss::CrossEntropy);
}
#[test]
fn resnet_matches_pytorch() {
    check("resnet", "pixel_values", Loss::CrossEntropy);
}
#[test]
fn unet_matches_pytorch() {
    check("unet", "pixel_values", Loss::Mse);
}
#[test]
fn vit_matches_pytorch() {
    check("vit", "pixel_values", Loss::CrossEntropy);
}
#[test]
fn parameters_are_pytorchs_names_in_order_tied_heads_once() {
    // The folded transposes (`val_N`) read as their Linear weights, the tied head as the
    // embedding: the parameter list is named_parameters()'s, shapes included.
    for name in ["gpt2", "llama", "opt", "vit"] {
        let model = OnnxModel::open(&fixture(name).join("model.onnx")).unwrap();
        let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
        let j: serde_json::Value = serde_json::from_str(&text).unwrap();
        let want: Vec<(String, Vec<usize>)> = j["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let shape = p["shape"].as_array().unwrap();
                (
                    p["name"].as_str().unwrap().to_string(),
                    shape.iter().map(|d| d.as_u64().unwrap() as usize).collect(),
                )
            })
            .collect();
        assert_eq!(model.weight_shapes(), want, "{name}");
    }
}
