//! `tessera train --device cuda` from the command line: with a GPU it trains; without one
//! (CI) it stops before step 1 with an error naming the missing driver, and several devices
//! are refused naming the fix. The kernels themselves are checked on a GPU by
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
        // A machine with a GPU: the run reports its steps.
        assert!(stdout.contains("\"loss\""), "a successful run reports losses: {stdout}");
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
fn several_cuda_devices_are_refused_naming_the_fix() {
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
    assert!(!out.status.success());
    let all =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(all.contains("--devices 1") || all.contains("built without CUDA"), "{all}");
}
