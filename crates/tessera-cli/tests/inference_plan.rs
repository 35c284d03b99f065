//! Planning inference (issue 21): `tessera profile --inference` and `tessera plan --inference`
//! read the Programs `tessera generate` runs, so a tensor-parallel plan's per-device peak is
//! the peak the runtime measures; BLOOM-176B in int8 over 8 RTX 4090s is set beside the
//! seed's figure (352.3 GB in fp16 → 185.6 GB in int8 → 23.2 GB per GPU); the KV cache is
//! counted by its formula.

use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn tessera(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json_of(args: &[&str]) -> Value {
    let (ok, out, err) = tessera(args);
    assert!(ok, "tessera {args:?} failed:\n{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}):\n{out}"))
}

fn gpt2_fixture() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/gpt2").display().to_string()
}

#[test]
fn a_tensor_parallel_plan_predicts_the_peak_generate_measures() {
    let m = gpt2_fixture();
    for tp in ["1", "2", "4"] {
        let plan = json_of(&[
            "plan",
            "--inference",
            "--model",
            &m,
            "--cluster",
            &format!("{tp}xcpu"),
            "--plan",
            &format!("tp{tp}"),
            "--batch",
            "2",
            "--seq",
            "9",
            "--new-tokens",
            "6",
            "--dtype",
            "fp32",
            "--format",
            "json",
        ]);
        assert_eq!(plan["config"], format!("tp{tp}"));
        let predicted = plan["best"]["peak_bytes_per_device"].as_u64().unwrap();
        let run = json_of(&[
            "generate",
            "--model-dir",
            &m,
            "--tokens",
            "3,17,42,8,95",
            "--tokens",
            "3,17,42,8,95,0,61,17,29",
            "--max-new-tokens",
            "6",
            "--devices",
            tp,
            "--format",
            "json",
        ]);
        for got in run["memory"]["measured_peak_bytes"].as_array().unwrap() {
            assert_eq!(got.as_u64().unwrap(), predicted, "tp{tp}: measured vs planned peak");
        }
    }
}

#[test]
fn the_kv_cache_is_counted_by_its_formula() {
    // The gpt2 fixture: 2 layers, 4 heads of 16 (n_embd 64), f32.
    let r = json_of(&[
        "profile",
        "--inference",
        "--model",
        &gpt2_fixture(),
        "--batch",
        "3",
        "--seq",
        "10",
        "--new-tokens",
        "7",
        "--format",
        "json",
    ]);
    // 2 (k and v) · layers · batch · capacity · n_embd · 4 bytes (f32).
    let want = 2 * 2 * 3 * (10 + 7 - 1) * 64 * 4;
    assert_eq!(r["memory"]["kv_cache_bytes"].as_u64().unwrap(), want as u64);
    let int8 = json_of(&[
        "profile",
        "--inference",
        "--model",
        &gpt2_fixture(),
        "--batch",
        "3",
        "--seq",
        "10",
        "--new-tokens",
        "7",
        "--quantize",
        "int8",
        "--format",
        "json",
    ]);
    let (w, w8) = (
        r["memory"]["weights_bytes"].as_u64().unwrap(),
        int8["memory"]["weights_bytes"].as_u64().unwrap(),
    );
    assert!(w8 < w / 2, "int8 weights {w8} vs fp32 {w}");
}

#[test]
fn bloom_176b_in_int8_is_served_by_eight_rtx_4090s() {
    let plan = json_of(&[
        "plan",
        "--inference",
        "--model",
        "bloom-176b",
        "--cluster",
        "8xRTX4090",
        "--quantize",
        "int8",
        "--batch",
        "1",
        "--seq",
        "512",
        "--new-tokens",
        "128",
        "--format",
        "json",
    ]);
    assert_eq!(plan["params"].as_u64().unwrap(), 176_247_271_424, "Hugging Face's count");
    assert_eq!(plan["config"], "tp8");
    let best = &plan["best"];
    let peak = best["peak_bytes_per_device"].as_u64().unwrap() as f64;
    assert!(peak <= plan["budget_bytes"].as_u64().unwrap() as f64);
    // The seed's 23.2 GB per GPU: int8 linear weights plus fp16 embeddings, over 8.
    let weights = best["weights_bytes_per_device"].as_u64().unwrap() as f64;
    assert!((weights / 23.2e9 - 1.0).abs() < 0.05, "weights per device {weights}");
    // In bf16 no split of 8 RTX 4090s holds it: refused, naming the least memory per device.
    let (ok, out, _) = tessera(&[
        "plan",
        "--inference",
        "--model",
        "bloom-176b",
        "--cluster",
        "8xRTX4090",
        "--batch",
        "1",
        "--seq",
        "512",
        "--new-tokens",
        "128",
        "--format",
        "json",
    ]);
    assert!(!ok);
    let e: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(e["error"]["kind"], "infeasible");
    assert!(e["error"]["needed_bytes"].as_u64().unwrap() > 40 << 30, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("--quantize"), "{e}");
}

#[test]
fn throughput_serves_replicas_where_latency_splits_the_model() {
    let run = |objective: &str| {
        json_of(&[
            "plan",
            "--inference",
            "--model",
            "llama2-7b",
            "--cluster",
            "8xH100",
            "--batch",
            "4",
            "--seq",
            "256",
            "--new-tokens",
            "64",
            "--objective",
            objective,
            "--format",
            "json",
        ])
    };
    let (lat, thr) = (run("latency"), run("throughput"));
    let t = |p: &Value, k: &str| p["best"][k].as_f64().unwrap();
    assert!(thr["best"]["replicas"].as_u64().unwrap() > lat["best"]["replicas"].as_u64().unwrap());
    assert!(t(&thr, "throughput_tokens_per_s") >= t(&lat, "throughput_tokens_per_s"));
    assert!(t(&lat, "request_s") <= t(&thr, "request_s"));
}
