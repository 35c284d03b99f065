//! Models imported from ONNX through the `tessera` binary (`--model model.onnx`), on the
//! fixtures of `scripts/make-onnx-fixtures.sh` (PyTorch exports with PyTorch's logits):
//! - `eval` reproduces PyTorch's logits (≤ 1e-4) and the next-token loss computed from them;
//! - the profile of the imported GPT-2 equals the built-in `gpt2` family's on the same config
//!   (FLOPs and peak memory exactly): the importer loses nothing the hand-written builder has;
//! - `train` runs an imported model from its own weights with predicted = measured memory;
//! - an operator without a mapping is one clear error naming it, never a panic.

use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/onnx").join(name)
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("onnx-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("tessera runs")
}

fn ok_json(args: &[&str]) -> Value {
    let out = tessera(args);
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e})"))
}

/// PyTorch's reference tensors of a fixture as (shape, values).
fn reference(name: &str) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            let d = v.data();
            let vals = match v.dtype() {
                safetensors::Dtype::F32 => d
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                _ => d
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
            };
            (n, (v.shape().to_vec(), vals))
        })
        .collect()
}

#[test]
fn eval_reproduces_pytorch_logits_and_loss() {
    for name in ["gpt2", "llama", "opt"] {
        let r = reference(name);
        let (ids_shape, ids) = &r["input_ids"];
        let (seq, vocab) = (ids_shape[1], r["logits"].0[2]);
        // Row 0 of the batch: causal, so eval on its tokens sees what PyTorch saw.
        let tokens: Vec<i64> = ids[..seq].iter().map(|&x| x as i64).collect();
        let want: Vec<&[f64]> = r["logits"].1[..seq * vocab].chunks(vocab).collect();
        // The next-token loss of PyTorch's own logits, in f64.
        let expected_loss: f64 = (0..seq - 1)
            .map(|i| {
                let row = want[i];
                let m = row.iter().cloned().fold(f64::MIN, f64::max);
                let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                lse - row[tokens[i + 1] as usize]
            })
            .sum::<f64>()
            / (seq - 1) as f64;
        let logits_path = scratch(name).join("logits.json");
        let model = fixture(name).join("model.onnx");
        let list: Vec<String> = tokens.iter().map(i64::to_string).collect();
        let out = ok_json(&[
            "eval",
            "--model-dir",
            model.to_str().unwrap(),
            "--tokens",
            &list.join(","),
            "--format",
            "json",
            "--logits",
            logits_path.to_str().unwrap(),
        ]);
        let loss = out["loss"].as_f64().unwrap();
        assert!(
            (loss - expected_loss).abs() <= 1e-5 * expected_loss,
            "{name}: loss {loss} vs {expected_loss}"
        );
        let got: Value =
            serde_json::from_str(&std::fs::read_to_string(&logits_path).unwrap()).unwrap();
        let rows = got["logits"].as_array().unwrap();
        assert_eq!(rows.len(), seq - 1);
        for (i, row) in rows.iter().enumerate() {
            for (j, x) in row.as_array().unwrap().iter().enumerate() {
                let d = (x.as_f64().unwrap() - want[i][j]).abs();
                assert!(d <= 1e-4, "{name}: logit [{i}, {j}] differs by {d:e}");
            }
        }
    }
}

#[test]
fn imported_models_profile_like_the_builtin_families() {
    // GPT-2 (tanh GELU, tied head), LLaMA (RMSNorm, RoPE, GQA, SiLU) and ViT (exact GELU,
    // unmasked attention, patch conv) against the built-in family on the fixture's own
    // config.json (as transformers wrote it): FLOPs and peak memory exactly equal.
    for name in ["gpt2", "llama", "vit"] {
        let dir = scratch(&format!("{name}-config"));
        let j: Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(name).join("reference.json")).unwrap(),
        )
        .unwrap();
        std::fs::write(dir.join("config.json"), j["config"].to_string()).unwrap();
        for (batch, seq) in [("2", "16"), ("4", "64")] {
            let model = fixture(name).join("model.onnx");
            let common = ["--batch", batch, "--seq", seq, "--format", "json"];
            let a =
                ok_json(&[&["profile", "--model", dir.to_str().unwrap()][..], &common].concat());
            let b =
                ok_json(&[&["profile", "--model", model.to_str().unwrap()][..], &common].concat());
            for key in ["forward", "backward", "optimizer", "matmul"] {
                assert_eq!(
                    a["flops"][key], b["flops"][key],
                    "{name}: flops.{key} at {batch}x{seq}"
                );
            }
            assert_eq!(
                a["memory"]["peak_bytes"], b["memory"]["peak_bytes"],
                "{name}: peak at {batch}x{seq}"
            );
            assert_eq!(a["params"], b["params"]);
            assert!(a["params"].as_u64().is_some_and(|n| n > 0));
        }
    }
}

#[test]
fn train_runs_an_imported_model_on_a_planned_mesh() {
    let model = fixture("llama").join("model.onnx");
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
    assert_eq!(out["devices"], 2);
    let first = out["initial_loss"].as_f64().unwrap_or_else(|| panic!("no initial_loss in {out}"));
    assert!(first.is_finite() && (first - 256f64.ln()).abs() < 0.5, "initial loss {first}");
    // The standing promise holds for imported graphs: memory and traffic as predicted.
    let mem = &out["memory"];
    assert_eq!(mem["predicted_peak_bytes"], mem["measured_peak_bytes"], "{mem}");
    assert_eq!(out["comm"]["predicted_bytes"], out["comm"]["measured_bytes"], "{}", out["comm"]);
}

#[test]
fn an_unsupported_operator_is_one_clear_error() {
    let model = fixture("unsupported").join("model.onnx");
    let out = tessera(&["profile", "--model", model.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ONNX operator Det") && err.contains("is not supported"), "{err}");
    assert!(err.contains("Supported operators:") && err.contains("MatMul"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // A file that is not ONNX at all.
    let bad = scratch("bad").join("model.onnx");
    std::fs::write(&bad, b"not a protobuf").unwrap();
    let out = tessera(&["profile", "--model", bad.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is not an ONNX model"), "{err}");
}

#[test]
fn an_imported_resnet_and_unet_train_on_the_digits() {
    // The ResNet fixture takes digits' [1, 8, 8] images: `train` reads data/digits.csv.
    let resnet = fixture("resnet").join("model.onnx");
    let digits = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/digits.csv");
    let out = ok_json(&[
        "train",
        "--model",
        resnet.to_str().unwrap(),
        "--data",
        digits.to_str().unwrap(),
        "--steps",
        "20",
        "--batch",
        "16",
        "--devices",
        "2",
        "--lr",
        "3e-3",
        "--format",
        "json",
    ]);
    let (first, last) =
        (out["initial_loss"].as_f64().unwrap(), out["final_loss"].as_f64().unwrap());
    assert!(last < first - 0.1, "the loss must fall: {first} → {last}");
    // Better than chance (10 classes) on held-out digits after 20 steps.
    assert!(out["eval_accuracy"].as_f64().unwrap() > 0.2, "{out}");
    let mem = &out["memory"];
    assert_eq!(mem["predicted_peak_bytes"], mem["measured_peak_bytes"], "{mem}");

    // The UNet (dense: MSE against targets of the output's shape) plans, and trains as a
    // denoiser of the digits: noisy images in, clean ones as targets.
    let unet = fixture("unet").join("model.onnx");
    let p = ok_json(&[
        "profile",
        "--model",
        unet.to_str().unwrap(),
        "--batch",
        "4",
        "--format",
        "json",
    ]);
    assert_eq!(p["params"], 3657, "{p}");
    let plan = ok_json(&[
        "plan",
        "--model",
        unet.to_str().unwrap(),
        "--cluster",
        "4xH100",
        "--batch",
        "64",
        "--format",
        "json",
    ]);
    let peaks = plan["predicted"]["peak_bytes_per_device"].as_array().expect("a plan");
    assert_eq!(peaks.len(), 4, "{plan}");
    let out = ok_json(&[
        "train",
        "--model",
        unet.to_str().unwrap(),
        "--data",
        digits.to_str().unwrap(),
        "--steps",
        "30",
        "--batch",
        "16",
        "--devices",
        "2",
        "--lr",
        "1e-2",
        "--format",
        "json",
    ]);
    let (first, eval) = (out["initial_loss"].as_f64().unwrap(), out["eval_loss"].as_f64().unwrap());
    assert!(eval < first, "the held-out denoising error must fall: {first} → {eval}");
    assert!(out["eval_accuracy"].is_null(), "no labels, no accuracy: {out}");
    let mem = &out["memory"];
    assert_eq!(mem["predicted_peak_bytes"], mem["measured_peak_bytes"], "{mem}");
}

/// A checkpoint saved from an imported model is a model of its own: `eval --model-dir` reads
/// its graph from the ONNX file its config.json names and its weights from the checkpoint
/// (after a step at a vanishing learning rate it evaluates as the file does; after real
/// training, not), `--resume` continues the run bit for bit, and resuming under another model
/// is refused naming the saved one.
#[test]
fn checkpoints_of_imported_models_evaluate_and_resume() {
    let model = fixture("llama").join("model.onnx");
    let m = model.to_str().unwrap();
    let dir = scratch("ckpt");
    let run = ["train", "--model", m, "--batch", "2", "--seq", "16", "--steps", "3"];
    let train = |extra: &[&str]| ok_json(&[&run[..], extra, &["--format", "json"]].concat());

    // Resume: two steps, saved, then the third, against three in a row.
    let straight = train(&[]);
    let ck = dir.join("ck");
    let ck = ck.to_str().unwrap();
    train(&["--stop-after", "2", "--save", ck]);
    let resumed = train(&["--resume", ck]);
    assert_eq!(resumed["final_loss"], straight["final_loss"], "resumed {resumed}");

    // Resuming under another model names the saved one.
    let other = tessera(&[
        "train",
        "--model",
        "llama-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "3",
        "--resume",
        ck,
    ]);
    let err = String::from_utf8_lossy(&other.stderr);
    assert!(!other.status.success() && err.contains("resume with --model"), "{err}");
    assert!(err.contains("model.onnx"), "names the saved model: {err}");

    // Eval of checkpoints against the file itself, on the same tokens.
    let eval = |model_dir: &str| {
        let out = ok_json(&[
            "eval",
            "--model-dir",
            model_dir,
            "--tokens",
            "1,5,9,2,7,3,8,4",
            "--format",
            "json",
        ]);
        out["loss"].as_f64().unwrap()
    };
    let file_loss = eval(m);
    let still = dir.join("still");
    train(&["--stop-after", "1", "--lr", "1e-9", "--save", still.to_str().unwrap()]);
    let still_loss = eval(still.to_str().unwrap());
    assert!(
        (still_loss - file_loss).abs() <= 1e-5 * file_loss,
        "a checkpoint one step of lr 1e-9 away evaluates as the file: {still_loss} vs {file_loss}"
    );
    let trained = dir.join("trained");
    train(&["--lr", "1e-2", "--save", trained.to_str().unwrap()]);
    let trained_loss = eval(trained.to_str().unwrap());
    assert!(
        (trained_loss - file_loss).abs() > 1e-3,
        "a trained checkpoint's weights are its own: {trained_loss} vs the file's {file_loss}"
    );
}

/// A protobuf writer for the few ONNX messages the malformed-model tests need (the CLI's
/// tests do not depend on the ONNX crate): fields are (number, payload).
mod pb {
    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    pub fn int(field: u32, v: i64) -> Vec<u8> {
        let mut out = Vec::new();
        varint(&mut out, (field as u64) << 3);
        varint(&mut out, v as u64);
        out
    }
    pub fn bytes(field: u32, v: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        varint(&mut out, ((field as u64) << 3) | 2);
        varint(&mut out, v.len() as u64);
        out.extend_from_slice(v);
        out
    }
    pub fn msg(field: u32, parts: &[Vec<u8>]) -> Vec<u8> {
        bytes(field, &parts.concat())
    }
    /// A graph input or output: name, element type (1 float, 7 int64), dims (names dynamic).
    pub fn port(field: u32, name: &str, elem: i64, dims: &[&str]) -> Vec<u8> {
        let dims: Vec<Vec<u8>> = dims
            .iter()
            .map(|d| match d.parse::<i64>() {
                Ok(n) => msg(1, &[int(1, n)]),
                Err(_) => msg(1, &[bytes(2, d.as_bytes())]),
            })
            .collect();
        let tensor = msg(1, &[int(1, elem), msg(2, &dims)]);
        msg(field, &[bytes(1, name.as_bytes()), msg(2, &[tensor])])
    }
    pub fn node(name: &str, op: &str, inputs: &[&str], outputs: &[&str]) -> Vec<u8> {
        let mut parts: Vec<Vec<u8>> = inputs.iter().map(|i| bytes(1, i.as_bytes())).collect();
        parts.extend(outputs.iter().map(|o| bytes(2, o.as_bytes())));
        parts.push(bytes(3, name.as_bytes()));
        parts.push(bytes(4, op.as_bytes()));
        msg(1, &parts)
    }
    pub fn floats(name: &str, dims: &[i64], v: &[f32]) -> Vec<u8> {
        let mut parts: Vec<Vec<u8>> = dims.iter().map(|&d| int(1, d)).collect();
        parts.push(int(2, 1));
        let data: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        parts.push(bytes(4, &data));
        parts.push(bytes(8, name.as_bytes()));
        msg(5, &parts)
    }
    /// A model (IR 8, opset 17) of `graph`'s fields.
    pub fn model(graph: &[Vec<u8>]) -> Vec<u8> {
        [int(1, 8), msg(8, &[int(2, 17)]), msg(7, graph)].concat()
    }
}

/// A tiny causal LM over bytes: input_ids `[batch, seq]` → Gather(emb `[256, 8]`) → MatMul(w
/// `[8, 256]`) → logits; `emb_at` overrides one embedding value, `mm_inputs` the MatMul's
/// inputs.
fn tiny_lm(dir: &Path, emb_at: Option<(usize, f32)>, mm_inputs: &[&str]) -> PathBuf {
    let mut emb: Vec<f32> = (0..2048).map(|i| (i as f32 * 0.37).sin() * 0.1).collect();
    if let Some((i, x)) = emb_at {
        emb[i] = x;
    }
    let w: Vec<f32> = (0..2048).map(|i| (i as f32 * 0.11).cos() * 0.1).collect();
    let graph = [
        pb::node("/embed/Gather", "Gather", &["emb", "input_ids"], &["h"]),
        pb::node("/head/MatMul", "MatMul", mm_inputs, &["logits"]),
        pb::bytes(2, b"tiny"),
        pb::floats("emb", &[256, 8], &emb),
        pb::floats("w", &[8, 256], &w),
        pb::port(11, "input_ids", 7, &["batch", "seq"]),
        pb::port(12, "logits", 1, &["batch", "seq", "256"]),
    ];
    let path = dir.join("tiny.onnx");
    std::fs::write(&path, pb::model(&graph)).unwrap();
    path
}

#[test]
fn malformed_graphs_are_refused_by_name_not_by_a_panic() {
    let dir = scratch("malformed");
    // The well-formed file profiles: the refusals below are the malformations'.
    let good = tiny_lm(&dir, None, &["h", "w"]);
    let out =
        tessera(&["profile", "--model", good.to_str().unwrap(), "--batch", "2", "--seq", "4"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for (inputs, want) in [
        (&["h"][..], "\"/head/MatMul\" (MatMul, node #1) has 1 inputs, but the operator takes 2"),
        (&["h", "w", "w"][..], "(MatMul, node #1) has 3 inputs"),
        (&["logits", "w"][..], "cycle through node \"/head/MatMul\" (MatMul, node #1)"),
    ] {
        let model = tiny_lm(&dir, None, inputs);
        let out = tessera(&["profile", "--model", model.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{inputs:?} was accepted");
        assert!(err.contains(want) && err.contains("onnx.checker"), "{inputs:?}: {err}");
        assert!(!err.contains("panicked") && !err.contains("deeper"), "{err}");
    }
}

#[test]
fn a_nan_initialiser_is_refused_by_name_before_training() {
    let dir = scratch("nan");
    let train = |model: &Path| {
        tessera(&["train", "--model", model.to_str().unwrap(), "--steps", "1", "--batch", "2"])
    };
    // The same model with finite weights trains: the refusal below is the NaN's.
    let good = train(&tiny_lm(&dir, None, &["h", "w"]));
    assert!(good.status.success(), "{}", String::from_utf8_lossy(&good.stderr));
    let out = train(&tiny_lm(&dir, Some((19, f32::NAN)), &["h", "w"]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "trained from a NaN weight: {err}");
    assert!(err.contains("initialiser emb holds 1 non-finite value(s)"), "{err}");
    assert!(err.contains("first at element 19 (NaN)"), "{err}");
    assert!(!err.contains("learning rate") && !err.contains("panicked"), "{err}");
}

#[test]
fn generate_on_an_onnx_file_says_what_it_needs() {
    let dir = scratch("generate");
    let model = tiny_lm(&dir, None, &["h", "w"]);
    let out = tessera(&["generate", "--model-dir", model.to_str().unwrap(), "--tokens", "1,2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("generate needs a Hugging Face model directory"), "{err}");
    assert!(err.contains("an ONNX file is for profile, plan, train"), "{err}");
    assert!(!err.contains("UTF-8"), "{err}");
}
