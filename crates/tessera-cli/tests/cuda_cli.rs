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
