//! Activation checkpointing end to end through the binary: a memory budget that only fits
//! with recomputation makes the planner checkpoint blocks, the runtime carries the recompute
//! instructions out, every device's measured peak equals the predicted one and stays under the
//! budget, and the losses equal those of the run without checkpointing (recomputed values are
//! the originals bit for bit, so the tolerance 1e-6 is slack). Also: a budget too small even
//! for full recomputation names the minimum, and `tessera plan` reports per-block modes,
//! recompute time and the Chen / full-recompute baselines.

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("tessera runs")
}

fn ok(out: &Output, what: &str) -> Value {
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{what}: not JSON: {e}"))
}

fn temp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Per-step losses of a `--log-json` file.
fn losses(path: &PathBuf) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

fn peaks(doc: &Value, key: &str) -> Vec<u64> {
    doc["memory"][key].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect()
}

/// Trains `model` on `devices` for a few steps, without a budget (under `reference`, a fixed
/// plan, or the automatic one) and then with a budget at `fraction` of that run's peak;
/// returns the budgeted run's report.
///
/// On several devices the reference is ZeRO-3 data parallelism, the most memory-frugal plain
/// layout: a fraction of the automatic plan's peak says little, since that plan may hold far
/// more than it needs (ZeRO-1 at the same speed) or far less than full recompute reaches.
fn budgeted_run(model: &str, devices: usize, fraction: f64, reference: Option<&str>) -> Value {
    let dir = temp(&format!("{model}-{devices}-{fraction}"));
    let d = devices.to_string();
    let base = [
        "train",
        "--model",
        model,
        "--devices",
        &d,
        "--steps",
        "4",
        "--batch",
        "8",
        "--seq",
        "64",
        "--eval-batches",
        "0",
        "--format",
        "json",
    ];
    let free_log = dir.join("free.jsonl");
    let mut args: Vec<&str> = base.to_vec();
    let free_log_s = free_log.to_str().unwrap().to_string();
    args.extend(["--log-json", &free_log_s]);
    if let Some(plan) = reference {
        args.extend(["--plan", plan]);
    }
    let free = ok(&tessera(&args), "unconstrained run");
    let free_peak = *peaks(&free, "predicted_peak_bytes").iter().max().unwrap();
    if devices > 1 {
        let blocks = free["checkpoint"].as_array().unwrap();
        assert!(blocks.iter().all(|b| b["mode"] == "none"), "no budget, no recompute: {blocks:?}");
    }

    let budget = (free_peak as f64 * fraction) as u64;
    let budget_s = budget.to_string();
    let ckpt_log = dir.join("ckpt.jsonl");
    let ckpt_log_s = ckpt_log.to_str().unwrap().to_string();
    let mut args: Vec<&str> = base.to_vec();
    args.extend(["--log-json", &ckpt_log_s, "--memory-budget", &budget_s]);
    let run = ok(&tessera(&args), "budgeted run");
    let predicted = peaks(&run, "predicted_peak_bytes");
    let measured = peaks(&run, "measured_peak_bytes");
    assert_eq!(predicted, measured, "{model} on {devices}: measured peak == predicted");
    for p in &predicted {
        assert!(*p <= budget, "{model} on {devices}: peak {p} over the budget {budget}");
    }
    let (a, b) = (losses(&free_log), losses(&ckpt_log));
    assert_eq!(a.len(), 4);
    assert_eq!(a.len(), b.len());
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        let rel = (x - y).abs() / x.abs().max(1e-12);
        assert!(rel <= 1e-6, "{model} on {devices}, step {}: {x} vs {y}", step + 1);
    }
    run
}

#[test]
fn one_device_budget_forces_recompute_with_equal_losses() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        // One device holds the whole model state (16 B per parameter), so less room to win.
        budgeted_run(model, 1, 0.85, None);
    }
}

#[test]
fn four_devices_budget_forces_recompute_with_equal_losses() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        let run = budgeted_run(model, 4, 0.8, Some("dp4 zero3"));
        let blocks = run["checkpoint"].as_array().expect("checkpoint per block");
        assert!(!blocks.is_empty());
        assert!(
            blocks.iter().any(|b| b["mode"] != "none"),
            "{model}: a budget at 80% of ZeRO-3's peak needs recomputation: {blocks:?}"
        );
        assert!(run["recompute_s"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn a_budget_below_full_recompute_names_the_minimum() {
    for devices in ["1", "4"] {
        let out = tessera(&[
            "train",
            "--devices",
            devices,
            "--steps",
            "2",
            "--batch",
            "8",
            "--seq",
            "64",
            "--memory-budget",
            "4MiB",
        ]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("4.00 MiB"), "{devices}: {err}");
        assert!(
            err.contains("least") && err.contains("MiB"),
            "{devices}: names the minimum: {err}"
        );
    }
}

/// `tessera plan` for gpt2-tiny on 4 simulated devices (fp32, batch 8 × seq 64) with `extra`
/// arguments; its JSON.
fn plan_gpt2_tiny(extra: &[&str], what: &str) -> Value {
    let mut args = vec!["plan", "--model", "gpt2-tiny", "--cluster", "4xcpu", "--batch", "8"];
    args.extend(["--seq", "64", "--dtype", "fp32", "--format", "json"]);
    args.extend(extra);
    ok(&tessera(&args), what)
}

#[test]
fn plan_reports_modes_recompute_and_baselines() {
    let free = plan_gpt2_tiny(&["--plan", "dp4 zero3"], "ZeRO-3 data parallelism without a budget");
    // 80% of the most memory-frugal plain layout's peak: only checkpointing fits.
    let peak = free["predicted"]["peak_bytes_per_device"][0].as_u64().unwrap();
    let budget = (peak as f64 * 0.8) as u64;
    let plan = plan_gpt2_tiny(
        &["--memory-budget", &budget.to_string(), "--baseline", "all"],
        "plan under a tight budget",
    );
    let blocks = plan["checkpoint"].as_array().unwrap();
    assert_eq!(blocks.len(), 8, "gpt2-tiny has 8 blocks: {blocks:?}");
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(b["block"].as_u64(), Some(i as u64));
        assert!(["none", "selective", "full"].contains(&b["mode"].as_str().unwrap()));
    }
    let pred = &plan["predicted"];
    assert!(pred["peak_bytes_per_device"][0].as_u64().unwrap() <= budget);
    assert!(pred["recompute_s"].as_f64().unwrap() > 0.0, "the budget forces recomputation");
    let step = pred["step_time_s"].as_f64().unwrap();
    // Full recompute fits wherever the joint plan does (it keeps the least); Chen may not.
    let full = plan["baselines"]["full_recompute"]["step_time_s"].as_f64();
    let full = full.expect("full recompute fits at 80% of ZeRO-3's plain peak");
    assert!(step <= full * (1.0 + 1e-9), "joint plan {step} slower than full recompute {full}");
    if let Some(t) = plan["baselines"]["chen"]["step_time_s"].as_f64() {
        assert!(step <= t * (1.0 + 1e-9), "joint plan {step} slower than Chen {t}");
    }
    // The policies applied to the joint plan's own sharding: full recompute keeps the least,
    // so it fits there too; neither beats the joint choice on its own sharding.
    let same = |k: &str| plan["baselines"][k]["same_sharding_step_time_s"].as_f64();
    let full_same = same("full_recompute").expect("full recompute fits on the plan's sharding");
    assert!(step <= full_same * (1.0 + 1e-9), "joint {step} vs full on its sharding {full_same}");
    if let Some(t) = same("chen") {
        assert!(step <= t * (1.0 + 1e-9), "joint {step} vs Chen on its sharding {t}");
    }
    // Checkpointing off: the search either finds a slower (or equal) plan or none at all.
    let only = &plan["baselines"]["sharding_only"];
    assert!(only.is_object(), "--baseline all includes sharding-only: {only}");
    if let Some(t) = only["step_time_s"].as_f64() {
        assert!(step <= t * (1.0 + 1e-9), "joint plan {step} slower than sharding only {t}");
        assert_eq!(only["recompute_s"].as_f64(), Some(0.0));
    }
    assert!(plan["baselines"]["megatron"].is_object());
    // A fixed config with a checkpoint mode is carried out on every block.
    let fixed = plan_gpt2_tiny(&["--plan", "dp4 ckpt=full"], "fixed ckpt=full");
    assert_eq!(fixed["config"], "dp4 tp1 ckpt=full");
    assert!(fixed["checkpoint"].as_array().unwrap().iter().all(|b| b["mode"] == "full"));
    assert!(fixed["predicted"]["recompute_s"].as_f64().unwrap() > 0.0);
}
