//! Frozen parameters and LoRA, end to end through the `tessera` binary, against PEFT +
//! transformers (fixtures/lora, made by its `make_lora_fixture.py`): a tiny LLaMA with a
//! PEFT adapter whose B is nonzero follows PEFT's per-step losses; the adapter it saves reads
//! back bit for bit, has PEFT's config keys and gives PEFT's trained logits; the frozen base
//! carries no gradient or optimizer bytes (the plan's prediction, equal to the measured
//! peak); `dp2`, `tp2` and `dp2 zero3` follow one device. `--freeze` leaves the frozen
//! weights untouched and counts only what trains.

use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("lora-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `tessera ARGS`, asserting success; returns stdout.
fn tessera(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("runs");
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "tessera {args:?} failed:\n{stderr}\n{stdout}");
    stdout.into_owned()
}

fn tessera_fails(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("runs");
    assert!(!out.status.success(), "tessera {args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn expected() -> Value {
    read_json(&fixture().join("expected.json"))
}

fn tokens_arg(e: &Value) -> String {
    let ids: Vec<String> =
        e["tokens"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap().to_string()).collect();
    ids.join(",")
}

fn matrix(v: &Value) -> Vec<Vec<f64>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect())
        .collect()
}

fn max_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f64::max)
}

/// `tessera eval` logits of `model_dir` (with `adapter`) on the fixture's tokens.
fn eval_logits(dir: &Path, model_dir: &Path, adapter: Option<&Path>) -> Vec<Vec<f64>> {
    let out = dir.join("logits.json");
    let tokens = tokens_arg(&expected());
    let mut args = vec![
        "eval".to_string(),
        "--model-dir".into(),
        model_dir.display().to_string(),
        "--tokens".into(),
        tokens,
        "--logits".into(),
        out.display().to_string(),
    ];
    if let Some(a) = adapter {
        args.extend(["--adapter".into(), a.display().to_string()]);
    }
    tessera(&args.iter().map(String::as_str).collect::<Vec<_>>());
    matrix(&read_json(&out)["logits"])
}

/// `tessera train` from the fixture's base and adapter on its tokens, with `extra` flags;
/// returns the report and the per-step losses.
fn train(dir: &Path, extra: &[&str]) -> (Value, Vec<f64>) {
    let f = fixture();
    let log = dir.join("log.jsonl");
    let (base, data) = (f.join("base"), f.join("data"));
    let mut args = vec![
        "train",
        "--init",
        base.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--steps",
        "10",
        "--batch",
        "2",
        "--seq",
        "16",
        "--lr",
        "1e-2",
        "--schedule",
        "constant",
        "--weight-decay",
        "0",
        "--max-grad-norm",
        "0",
        "--eval-batches",
        "0",
        "--format",
        "json",
        "--log-json",
        log.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let report: Value = serde_json::from_str(&tessera(&args)).unwrap();
    let losses = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect();
    (report, losses)
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// Predicted == measured peaks and collective bytes, per device.
fn assert_memory_promise(report: &Value, what: &str) {
    let m = &report["memory"];
    assert_eq!(u64s(&m["predicted_peak_bytes"]), u64s(&m["measured_peak_bytes"]), "{what}");
    let c = &report["comm"];
    assert_eq!(u64s(&c["predicted_bytes"]), u64s(&c["measured_bytes"]), "{what}");
}

fn load(path: &Path) -> HashMap<String, candle_core::Tensor> {
    candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap()
}

fn bits(t: &candle_core::Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

#[test]
fn lora_follows_peft_and_saves_an_adapter_peft_reads() {
    let dir = scratch("peft");
    let e = expected();
    let f = fixture();
    // The fixture adapter (nonzero B) on the base gives PEFT's logits.
    let got = eval_logits(&dir, &f.join("base"), Some(&f.join("adapter")));
    let d = max_diff(&got, &matrix(&e["fixture_logits"]));
    assert!(d <= 1e-4, "fixture adapter logits differ from PEFT's by {d}");

    let (ckpt, adapter, merged) = (dir.join("ckpt"), dir.join("adapter"), dir.join("merged"));
    let adapter_in = f.join("adapter");
    let (report, losses) = train(
        &dir,
        &[
            "--init-adapter",
            adapter_in.to_str().unwrap(),
            "--devices",
            "1",
            "--save",
            ckpt.to_str().unwrap(),
            "--save-adapter",
            adapter.to_str().unwrap(),
            "--merge-into",
            merged.to_str().unwrap(),
        ],
    );
    let want: Vec<f64> =
        e["losses"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(losses.len(), want.len());
    for (s, (a, b)) in losses.iter().zip(&want).enumerate() {
        assert!((a - b).abs() <= 1e-5, "step {}: tessera {a}, PEFT {b}", s + 1);
    }
    assert_memory_promise(&report, "one device");
    // Only A and B train: q_proj (A [4,32], B [32,4]) and v_proj (A [4,32], B [16,4]) in
    // each of 2 layers.
    let trainable = 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4);
    assert_eq!(report["parameters"]["trainable"], trainable);
    let state = &report["memory"]["predicted_state_bytes"];
    assert_eq!(state["grads"], 4 * trainable, "the frozen base has no gradient bytes");
    assert_eq!(state["optimizer"], 8 * trainable, "nor optimizer state (m and v, fp32)");
    assert_eq!(state["params"], 4 * report["parameters"]["total"].as_u64().unwrap());

    // The adapter: PEFT's config keys and values, and our tensors bit for bit.
    let ours = read_json(&adapter.join("adapter_config.json"));
    let peft = read_json(&f.join("adapter/adapter_config.json"));
    for key in ours.as_object().unwrap().keys() {
        assert!(peft.get(key).is_some(), "adapter_config.json key {key} is not one PEFT writes");
    }
    for key in ["peft_type", "r", "lora_alpha", "target_modules", "bias", "fan_in_fan_out"] {
        assert_eq!(ours[key], peft[key], "adapter_config.json {key}");
    }
    let saved = load(&adapter.join("adapter_model.safetensors"));
    let trained = load(&ckpt.join("model.safetensors"));
    assert_eq!(saved.len(), 8);
    let reread = tessera_cli::finetune::read_adapter(&adapter).unwrap();
    for (key, t) in &saved {
        let name = key.strip_prefix("base_model.model.").expect("PEFT's prefix");
        assert!(name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight"), "{key}");
        assert_eq!(bits(t), bits(&trained[name]), "{key} as saved vs as trained");
        assert_eq!(bits(&reread.tensors[name]), bits(t), "{key} read back");
    }
    // The frozen base is untouched.
    let base = load(&f.join("base/model.safetensors"));
    for (name, t) in &base {
        assert_eq!(bits(t), bits(&trained[name]), "frozen {name} changed");
    }
    // The trained adapter, and the merged model, give PEFT's trained logits.
    let peft_trained = matrix(&e["trained_logits"]);
    let d = max_diff(&eval_logits(&dir, &f.join("base"), Some(&adapter)), &peft_trained);
    assert!(d <= 1e-4, "trained adapter logits differ from PEFT's by {d}");
    let d = max_diff(&eval_logits(&dir, &merged, None), &peft_trained);
    assert!(d <= 1e-4, "merged model logits differ from PEFT's by {d}");
    let merged_weights = load(&merged.join("model.safetensors"));
    assert!(merged_weights.keys().all(|k| !k.contains("lora_")), "merged keeps no LoRA tensor");
}

#[test]
fn lora_under_dp2_tp2_and_zero3_follows_one_device() {
    let adapter = fixture().join("adapter");
    let adapter = adapter.to_str().unwrap();
    let dir = scratch("one");
    let (one, ref_losses) = train(&dir, &["--init-adapter", adapter, "--devices", "1"]);
    let trainable_bytes = 4 * one["parameters"]["trainable"].as_u64().unwrap();
    for plan in ["dp2", "tp2", "dp2 zero3"] {
        let dir = scratch(&plan.replace(' ', "-"));
        let (report, losses) =
            train(&dir, &["--init-adapter", adapter, "--devices", "2", "--plan", plan]);
        for (s, (a, b)) in losses.iter().zip(&ref_losses).enumerate() {
            assert!((a - b).abs() <= 1e-5, "{plan} step {}: {a} vs one device {b}", s + 1);
        }
        assert_memory_promise(&report, plan);
        if plan == "dp2" {
            // Only the adapters' gradients are all-reduced (and two scalars).
            let sent = u64s(&report["comm"]["measured_bytes"]);
            assert!(sent.iter().all(|&b| b <= trainable_bytes + 64), "{plan}: {sent:?}");
        }
        if plan == "dp2 zero3" {
            let state = &report["memory"]["predicted_state_bytes"];
            // m and v (2 × the adapters' bytes) sharded over 2 devices.
            assert_eq!(state["optimizer"], trainable_bytes, "{plan}: sharded m and v");
        }
    }
}

#[test]
fn frozen_globs_get_no_gradient_and_stay_as_loaded() {
    let dir = scratch("freeze");
    let ckpt = dir.join("ckpt");
    let frozen = ["model.embed_tokens.*", "*.mlp.*"];
    let (report, losses) = train(
        &dir,
        &["--freeze", frozen[0], "--freeze", frozen[1], "--devices", "2", "--plan", "dp2"],
    );
    assert!(losses.last() < losses.first(), "{losses:?}");
    assert_memory_promise(&report, "--freeze dp2");
    let (total, trainable) = (
        report["parameters"]["total"].as_u64().unwrap(),
        report["parameters"]["trainable"].as_u64().unwrap(),
    );
    // embed 64·32, per layer gate/up 64·32 and down 32·64.
    assert_eq!(total - trainable, 64 * 32 + 2 * 3 * 64 * 32);
    let state = &report["memory"]["predicted_state_bytes"];
    assert_eq!(state["grads"], 4 * trainable);
    let sent = u64s(&report["comm"]["measured_bytes"]);
    assert!(sent.iter().all(|&b| b <= 4 * trainable + 64), "{sent:?}");

    let _ = train(
        &dir,
        &[
            "--freeze",
            frozen[0],
            "--freeze",
            frozen[1],
            "--devices",
            "1",
            "--save",
            ckpt.to_str().unwrap(),
        ],
    );
    let base = load(&fixture().join("base/model.safetensors"));
    let trained = load(&ckpt.join("model.safetensors"));
    let glob = |n: &str| n.starts_with("model.embed_tokens.") || n.contains(".mlp.");
    for (name, t) in &base {
        let same = bits(t) == bits(&trained[name]);
        assert_eq!(same, glob(name), "{name}: frozen weights stay, the others train");
    }
    let opt = load(&ckpt.join("optimizer.safetensors"));
    assert!(opt.keys().all(|k| !glob(k)), "optimizer state for a frozen weight");

    // `profile` and `plan` count what trains.
    let base_dir = fixture().join("base");
    let base_dir = base_dir.to_str().unwrap();
    let prof: Value = serde_json::from_str(&tessera(&[
        "profile", "--model", base_dir, "--batch", "2", "--seq", "16", "--format", "json",
        "--freeze", frozen[0], "--freeze", frozen[1],
    ]))
    .unwrap();
    assert_eq!(prof["trainable_params"], trainable);
    assert_eq!(prof["memory"]["grads_bytes"], 4 * trainable);
    let err = tessera_fails(&["profile", "--model", base_dir, "--freeze", "nothing.*"]);
    assert!(err.contains("`nothing.*` matches no parameter"), "{err}");
}
