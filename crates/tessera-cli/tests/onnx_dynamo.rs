//! Models exported by current PyTorch's default `torch.onnx.export` (the dynamo exporter:
//! opset 20, weights in `model.onnx.data`, the optimizer's folded transposes), fixtures of
//! `scripts/make_onnx_dynamo_fixtures.py`, through the `tessera` binary:
//! - `profile` counts PyTorch's parameters (OPT's and GPT-2's tied heads once);
//! - `eval` gives the next-token loss of PyTorch's own logits within 1e-5 (relative).

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/onnx-dynamo").join(name)
}

fn ok_json(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("runs");
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e})"))
}

fn reference_json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

/// PyTorch's logits (row 0 of the batch) and input ids of an LM fixture.
fn logits_and_ids(name: &str) -> (Vec<Vec<f64>>, Vec<i64>) {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("input_ids").unwrap();
    let seq = ids.shape()[1];
    let ids: Vec<i64> = ids.data()[..seq * 8]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let lg = st.tensor("logits").unwrap();
    let vocab = lg.shape()[2];
    let vals: Vec<f64> = lg.data()[..seq * vocab * 4]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect();
    (vals.chunks(vocab).map(<[f64]>::to_vec).collect(), ids)
}

#[test]
fn dynamo_exports_profile_with_pytorchs_parameter_count() {
    for name in ["gpt2", "llama", "opt", "resnet", "unet", "vit"] {
        let model = fixture(name).join("model.onnx");
        let (batch, seq) = ("2", "8");
        let p = ok_json(&[
            "profile",
            "--model",
            model.to_str().unwrap(),
            "--batch",
            batch,
            "--seq",
            seq,
            "--format",
            "json",
        ]);
        let want = reference_json(name)["num_parameters"].as_u64().unwrap();
        assert_eq!(p["params"].as_u64(), Some(want), "{name}: {}", p["params"]);
    }
}

#[test]
fn dynamo_exports_evaluate_to_pytorchs_loss() {
    for name in ["gpt2", "llama", "opt"] {
        let (want, tokens) = logits_and_ids(name);
        let seq = tokens.len();
        let expected: f64 = (0..seq - 1)
            .map(|i| {
                let row = &want[i];
                let m = row.iter().cloned().fold(f64::MIN, f64::max);
                let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                lse - row[tokens[i + 1] as usize]
            })
            .sum::<f64>()
            / (seq - 1) as f64;
        let list: Vec<String> = tokens.iter().map(i64::to_string).collect();
        let model = fixture(name).join("model.onnx");
        let out = ok_json(&[
            "eval",
            "--model-dir",
            model.to_str().unwrap(),
            "--tokens",
            &list.join(","),
            "--format",
            "json",
        ]);
        let loss = out["loss"].as_f64().unwrap();
        assert!((loss - expected).abs() <= 1e-5 * expected, "{name}: loss {loss} vs {expected}");
    }
}

#[test]
fn a_dynamo_export_trains_with_memory_as_predicted() {
    // The folded Linear transposes are parameters read through a pending transpose, the tied
    // head one parameter: two devices, memory and traffic as the Program predicts.
    for name in ["gpt2", "opt"] {
        let model = fixture(name).join("model.onnx");
        let out = ok_json(&[
            "train",
            "--model",
            model.to_str().unwrap(),
            "--steps",
            "2",
            "--batch",
            "4",
            "--seq",
            "16",
            "--devices",
            "2",
            "--format",
            "json",
        ]);
        let first = out["initial_loss"].as_f64().unwrap_or_else(|| panic!("{name}: {out}"));
        assert!(first.is_finite() && (first - 256f64.ln()).abs() < 0.5, "{name}: {first}");
        let mem = &out["memory"];
        assert_eq!(mem["predicted_peak_bytes"], mem["measured_peak_bytes"], "{name}: {mem}");
        assert_eq!(out["comm"]["predicted_bytes"], out["comm"]["measured_bytes"], "{name}");
    }
}
