//! Imported models against PyTorch: the fixtures of `scripts/make-onnx-fixtures.sh` hold each
//! model exported by `torch.onnx.export`, a batch, and PyTorch's logits, loss and parameter
//! gradients. The imported graph, run by the IR's reference interpreter (f64) with the
//! file's initialisers, must reproduce them.

use crate::support;

use std::path::PathBuf;
use support::pytorch::{self, Loss};
use tessera_ir::DType;
use tessera_onnx::{import, Bind, OnnxError, OnnxModel};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tessera-cli/tests/fixtures/onnx").join(name)
}

/// How many nodes of the graph run `op` (by its debug name's head).
fn count(graph: &tessera_ir::Graph, op: &str) -> usize {
    graph
        .nodes
        .iter()
        .filter(|n| format!("{:?}", n.op).split(['(', ' ', '{']).next() == Some(op))
        .count()
}

/// Fixture `name` against PyTorch ([`pytorch::check`]).
fn check(name: &str, input: &str, loss_kind: Loss) -> tessera_ir::Graph {
    pytorch::check(&fixture(name), name, input, loss_kind)
}

fn check_lm(name: &str) -> tessera_ir::Graph {
    check(name, "input_ids", Loss::CrossEntropy)
}

#[test]
fn resnet_matches_pytorch() {
    let g = check("resnet", "pixel_values", Loss::CrossEntropy);
    assert!(count(&g, "Conv2d") >= 5 && count(&g, "MaxPool2d") == 1 && count(&g, "GroupNorm") >= 3);
}

#[test]
fn vit_matches_pytorch() {
    let g = check("vit", "pixel_values", Loss::CrossEntropy);
    // Exact GELU from its erf formula, unmasked fused attention, the patch embedding a conv.
    assert_eq!(count(&g, "Attention"), 2);
    assert_eq!(count(&g, "Softmax"), 0);
    assert!(g.nodes.iter().any(|n| n.op == tessera_ir::Op::Unary(tessera_ir::UnaryOp::Gelu)));
    assert_eq!(count(&g, "Conv2d"), 1);
}

#[test]
fn unet_matches_pytorch() {
    let g = check("unet", "pixel_values", Loss::Mse);
    assert!(
        count(&g, "Conv2d") >= 3 && count(&g, "AvgPool2d") == 1 && count(&g, "Upsample2d") == 1
    );
}

#[test]
fn gpt2_matches_pytorch() {
    let g = check_lm("gpt2");
    // Two layers: two fused causal attentions, no softmax or mask left, and the weights'
    // transposes read as matmul flags.
    assert_eq!(count(&g, "Attention"), 2);
    assert_eq!(count(&g, "Softmax"), 0);
    assert_eq!(count(&g, "Permute"), 0, "head splits and merges are views of [B,S,H,D]");
}

#[test]
fn merged_parameters_come_back_under_their_own_names() {
    // Freshly initialised: the exporter merged 14 equal-valued biases and norms into others
    // (Identity nodes). Each must be a parameter of its own: the count, and every gradient by
    // name, match PyTorch's separate parameters.
    let g = check_lm("gpt2-fresh");
    let model = OnnxModel::open(&fixture("gpt2-fresh").join("model.onnx")).unwrap();
    assert_eq!(model.weight_shapes().len(), 28, "14 initialisers + 14 merged parameters");
    // As `named_parameters()` lists them (the tied head is wte itself).
    assert_eq!(g.parameters().len(), 28);
}

#[test]
fn llama_matches_pytorch() {
    let g = check_lm("llama");
    // Rotary embeddings on q and k of both layers, attention reading the 2 key/value heads
    // (repeat_kv looked through).
    assert_eq!(count(&g, "Rope"), 4);
    assert_eq!(count(&g, "Attention"), 2);
    for n in g.nodes.iter().filter(|n| matches!(n.op, tessera_ir::Op::Attention(_))) {
        assert_eq!(g.shape(n.inputs[1]).dims()[2], 2, "k has the 2 key/value heads");
    }
    assert_eq!(count(&g, "Expand"), 0);
}

#[test]
fn opt_matches_pytorch() {
    let g = check_lm("opt");
    assert_eq!(count(&g, "Attention"), 2);
    assert_eq!(count(&g, "Softmax"), 0);
}

#[test]
fn unsupported_operator_is_named_with_its_node_and_readers() {
    let model = OnnxModel::open(&fixture("unsupported").join("model.onnx")).unwrap();
    let err = import(&model, &Bind { batch: 2, seq: 8, dtype: DType::F32 })
        .err()
        .expect("Det has no mapping");
    let OnnxError::UnsupportedOp { op, node, used_by, supported } = &err else { panic!("{err}") };
    assert_eq!(op, "Det");
    assert!(node.contains("Det"), "{node}");
    // The fixture's Det feeds an Unsqueeze (then the head's Gemm).
    assert!(used_by.contains("(Unsqueeze)"), "{used_by}");
    assert!(supported.contains("MatMul"));
    let text = err.to_string();
    assert!(text.contains("Det") && text.contains("not supported"), "{text}");
}

#[test]
fn every_fixture_uses_only_supported_operators() {
    // The up-front check the CLI runs agrees with what the walk can import.
    for name in ["gpt2", "gpt2-fresh", "llama", "opt", "resnet", "unet", "vit"] {
        let model = OnnxModel::open(&fixture(name).join("model.onnx")).unwrap();
        model.check_operators().unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let model = OnnxModel::open(&fixture("unsupported").join("model.onnx")).unwrap();
    assert!(
        matches!(model.check_operators(), Err(OnnxError::UnsupportedOp { op, .. }) if op == "Det")
    );
}

#[test]
fn the_readme_lists_exactly_the_supported_operators() {
    let readme =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
            .unwrap();
    let start = readme.find("- Operators: ").expect("README lists the ONNX operators");
    let end =
        start + readme[start..].find("(`tessera_onnx::SUPPORTED_OPS`)").expect("the list ends");
    let listed: std::collections::BTreeSet<String> = readme[start + 13..end]
        .split(',')
        .map(|w| w.split_whitespace().next().unwrap_or("").to_string())
        .filter(|w| !w.is_empty())
        .collect();
    let supported: std::collections::BTreeSet<String> =
        tessera_onnx::SUPPORTED_OPS.iter().map(|s| s.to_string()).collect();
    assert_eq!(listed, supported);
}

#[test]
fn external_data_reads_each_tensors_own_bytes() {
    // The GPT-2 fixture with every initialiser moved into one `weights.bin`, as
    // `onnx.save_model(.., save_as_external_data=True)` writes models over 2 GB.
    use onnx_protobuf::{Message, ModelProto, StringStringEntryProto};
    let bytes = std::fs::read(fixture("gpt2").join("model.onnx")).unwrap();
    let mut m = ModelProto::parse_from_bytes(&bytes).unwrap();
    let mut blob = Vec::new();
    for t in m.graph.as_mut().unwrap().initializer.iter_mut() {
        assert!(!t.raw_data.is_empty(), "the exporter writes raw_data");
        let entry = |k: &str, v: String| {
            let mut e = StringStringEntryProto::new();
            e.key = k.into();
            e.value = v;
            e
        };
        t.external_data = vec![
            entry("location", "weights.bin".into()),
            entry("offset", blob.len().to_string()),
            entry("length", t.raw_data.len().to_string()),
        ];
        blob.extend(std::mem::take(&mut t.raw_data));
        t.data_location = protobuf::EnumOrUnknown::from_i32(1);
    }
    let dir = std::env::temp_dir().join(format!("tessera-onnx-external-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("weights.bin"), &blob).unwrap();
    std::fs::write(dir.join("model.onnx"), m.write_to_bytes().unwrap()).unwrap();
    let external = OnnxModel::open(&dir.join("model.onnx")).unwrap();
    let inline = OnnxModel::open(&fixture("gpt2").join("model.onnx")).unwrap();
    for (name, _) in inline.weight_shapes() {
        assert_eq!(
            external.weights_f32(&name).unwrap(),
            inline.weights_f32(&name).unwrap(),
            "{name}"
        );
    }
    // A location outside the model's folder is refused.
    let mut evil = m.clone();
    evil.graph.as_mut().unwrap().initializer[0].external_data[0].value = "../weights.bin".into();
    std::fs::write(dir.join("evil.onnx"), evil.write_to_bytes().unwrap()).unwrap();
    let evil = OnnxModel::open(&dir.join("evil.onnx")).unwrap();
    let name = evil.weight_shapes()[0].0.clone();
    let err = evil.weights_f32(&name).unwrap_err().to_string();
    assert!(err.contains("leaves the model's folder"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn later_imports_reuse_the_mask_verdicts() {
    // The planner imports one file at many batch sizes: the first import folds and checks
    // the masks, later ones at the same sequence take the verdict and fold nothing of them.
    let model = OnnxModel::open(&fixture("llama").join("model.onnx")).unwrap();
    let graphs: Vec<tessera_ir::Graph> = [(2, 8), (5, 8), (2, 12)]
        .iter()
        .map(|&(batch, seq)| {
            import(&model, &Bind { batch, seq, dtype: DType::F32 }).unwrap().builder.finish()
        })
        .collect();
    for g in &graphs {
        let specs: Vec<bool> = g
            .nodes
            .iter()
            .filter_map(|n| match &n.op {
                tessera_ir::Op::Attention(s) => Some(s.causal),
                _ => None,
            })
            .collect();
        assert_eq!(specs, vec![true, true]);
    }
    // Same structure at another batch: only shapes differ.
    assert_eq!(graphs[0].nodes.len(), graphs[1].nodes.len());
}
