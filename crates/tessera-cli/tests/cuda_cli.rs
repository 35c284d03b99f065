//! `tessera train --device cuda` from the command line: with a GPU it trains; without one
//! (CI) it stops before step 1 with an error naming the missing driver, for one device or
//! several (GPU i per device, over NCCL). The kernels themselves are checked on a GPU by
//! `scripts/gpu-check.sh` (BENCHMARKS.md holds its figures).

use std::process::Command;

fn tessera(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("run tessera")
}

#[test]
fn train_on_cuda_trains_or_names_the_missing_driver() {
    let out = tessera(&[
        "train",
        "--device",
        "cuda",
        "--devices",
        "1",
        "--model",
        "gpt2-tiny",
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "32",
        "--format",
        "json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.success() {
        // A machine with a GPU: the run reports its steps, on the GPU.
        let doc: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
        assert_eq!(doc["device"], "cuda", "{doc}");
        assert!(doc["final_loss"].as_f64().is_some_and(f64::is_finite), "{doc}");
    } else {
        let all = format!("{stdout}{stderr}");
        assert!(
            all.contains("libcuda.so") || all.contains("built without CUDA"),
            "the failure must name the missing driver or the missing feature: {all}"
        );
        assert!(!all.contains("panicked"), "a clear error, not a panic: {all}");
    }
}

#[test]
fn several_cuda_devices_train_or_name_what_is_missing() {
    let out = tessera(&[
        "train",
        "--device",
        "cuda",
        "--devices",
        "2",
        "--model",
        "gpt2-tiny",
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq",
        "32",
    ]);
    let all =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        // No driver (CI), no CUDA in this build, fewer than two GPUs, or no NCCL: each named.
        assert!(
            ["libcuda.so", "built without CUDA", "GPU 1", "NCCL"].iter().any(|w| all.contains(w)),
            "the failure must name what is missing: {all}"
        );
        assert!(!all.contains("panicked"), "a clear error, not a panic: {all}");
    }
}

/// `tessera generate --device cuda` on the GPT-2 and LLaMA fixtures, one device and two (which
/// share the GPU where there is one): with a GPU, transformers' greedy tokens
/// (`generate.json`) and every device's measured peak its predicted peak; without one, the
/// missing driver or feature named, never a panic.
#[test]
fn generate_on_cuda_gives_transformers_tokens_or_names_what_is_missing() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf");
    for (name, devices) in [("gpt2", "1"), ("llama", "1"), ("gpt2", "2")] {
        let dir = fixtures.join(name);
        let text = std::fs::read_to_string(dir.join("generate.json")).expect("fixture");
        let expected: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let prompts: Vec<String> = expected["prompts"]
            .as_array()
            .expect("prompts")
            .iter()
            .map(|p| {
                let ids: Vec<String> =
                    p.as_array().expect("ids").iter().map(|i| i.to_string()).collect();
                ids.join(",")
            })
            .collect();
        let max = expected["max_new_tokens"].to_string();
        let mut args = vec!["generate", "--device", "cuda", "--devices", devices];
        args.extend(["--model-dir", dir.to_str().expect("a UTF-8 path"), "--max-new-tokens", &max]);
        for p in &prompts {
            args.extend(["--tokens", p.as_str()]);
        }
        args.extend(["--format", "json"]);
        let out = tessera(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let all = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
        if !out.status.success() {
            assert!(
                all.contains("libcuda.so") || all.contains("built without CUDA"),
                "{name} on {devices}: the failure must name the missing driver or feature: {all}"
            );
            assert!(!all.contains("panicked"), "a clear error, not a panic: {all}");
            continue;
        }
        let doc: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
        assert_eq!(doc["device"], "cuda", "{doc}");
        assert_eq!(doc["new_tokens"], expected["new_tokens"], "{name} on {devices} GPU device(s)");
        let m = &doc["memory"];
        assert_eq!(m["measured_peak_bytes"], m["predicted_peak_bytes"], "{name}: {m}");
    }
}
