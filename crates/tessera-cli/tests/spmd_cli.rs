//! `tessera train --devices N` end to end through the binary: the report's per-device
//! predictions and measurements, sharded checkpoints that resume under another plan and
//! device count, `tessera export --hf`, and failures that end every rank with a clear error in
//! bounded time.

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Instant;

fn tessera(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("tessera runs")
}

fn temp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("spmd-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn ok(out: &Output, what: &str) -> Value {
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{what}: not JSON: {e}"))
}

/// `(step, loss, grad_norm)` of a `--log-json` file.
fn log(path: &PathBuf) -> Vec<(u64, f64, f64)> {
    log_of(&std::fs::read_to_string(path).unwrap())
}

const SMALL: [&str; 8] = ["--batch", "8", "--seq", "32", "--lr", "1e-4", "--warmup", "1"];

#[test]
fn default_train_reports_every_device_predicted_against_measured() {
    let dir = temp("default");
    let steps = dir.join("steps.jsonl");
    let mut args = vec!["train", "--steps", "3", "--eval-batches", "1", "--format", "json"];
    args.extend(SMALL);
    args.extend(["--log-json", steps.to_str().unwrap()]);
    let doc = ok(&tessera(&args, &[]), "train");
    assert_eq!(doc["devices"], 4, "{doc}");
    assert!(doc["config"].as_str().is_some_and(|c| c.starts_with("dp")), "{doc}");
    for key in [
        "memory.predicted_peak_bytes",
        "memory.measured_peak_bytes",
        "comm.predicted_bytes",
        "comm.measured_bytes",
    ] {
        let (a, b) = key.split_once('.').unwrap();
        let v = doc[a][b].as_array().unwrap_or_else(|| panic!("{key} missing: {doc}"));
        assert_eq!(v.len(), 4, "{key}");
        assert!(v.iter().all(|x| x.as_u64().is_some_and(|b| b > 0)), "{key}: {v:?}");
    }
    assert_eq!(doc["memory"]["predicted_peak_bytes"], doc["memory"]["measured_peak_bytes"]);
    assert_eq!(doc["comm"]["predicted_bytes"], doc["comm"]["measured_bytes"]);
    assert_eq!(doc["comm"]["predicted_calls"], doc["comm"]["measured_calls"]);
    let lines = log(&steps);
    assert_eq!(lines.iter().map(|l| l.0).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert!(lines.iter().all(|l| l.1.is_finite() && l.2 > 0.0), "{lines:?}");
}

/// A checkpoint saved by `tp4` on 4 devices resumes under `dp2` on 2 devices, and the loss curve
/// continues the single-device one; `tessera export --hf` gathers it into a model directory
/// that evaluates like the single-device checkpoint of the same step.
#[test]
fn tp4_checkpoint_resumes_under_dp2_and_exports() {
    let dir = temp("resume");
    let ck = dir.join("ck");
    let run = |extra: &[&str], log_name: &str| -> PathBuf {
        let path = dir.join(log_name);
        let mut args = vec!["train", "--steps", "10", "--eval-batches", "0", "--format", "json"];
        args.extend(SMALL);
        args.extend(extra);
        args.extend(["--log-json", path.to_str().unwrap()]);
        ok(&tessera(&args, &[]), log_name);
        path
    };
    let single_ck = dir.join("single");
    let reference = log(&run(
        &["--devices", "1", "--stop-after", "5", "--save", single_ck.to_str().unwrap()],
        "ref-a.jsonl",
    ));
    let reference_b =
        log(&run(&["--devices", "1", "--resume", single_ck.to_str().unwrap()], "ref-b.jsonl"));
    let a = log(&run(
        &["--devices", "4", "--plan", "tp4", "--stop-after", "5", "--save", ck.to_str().unwrap()],
        "a.jsonl",
    ));
    // Export now, while `ck` holds step 5, like the single-device checkpoint.
    let hf = dir.join("hf");
    let out = tessera(
        &["export", "--checkpoint", ck.to_str().unwrap(), "--hf", hf.to_str().unwrap()],
        &[],
    );
    assert!(out.status.success(), "export: {}", String::from_utf8_lossy(&out.stderr));
    // Exporting onto the checkpoint itself is refused and leaves it whole (it resumes below).
    let onto = ck.to_str().unwrap();
    let out = tessera(&["export", "--checkpoint", onto, "--hf", onto], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("a Tessera checkpoint"), "{err}");
    assert!(err.contains("--force"), "{err}");
    let b = log(&run(
        &["--devices", "2", "--plan", "dp2", "--resume", ck.to_str().unwrap()],
        "b.jsonl",
    ));
    assert_eq!(a.len(), 5);
    assert_eq!(b.iter().map(|l| l.0).collect::<Vec<_>>(), vec![6, 7, 8, 9, 10]);
    let want: Vec<_> = reference.iter().chain(&reference_b).collect();
    for (got, want) in a.iter().chain(&b).zip(want) {
        let rel = |x: f64, y: f64| (x - y).abs() / y.abs();
        assert!(
            rel(got.1, want.1) < 1e-5 && rel(got.2, want.2) < 1e-5,
            "step {}: loss {} grad_norm {} vs one device {} {}",
            got.0,
            got.1,
            got.2,
            want.1,
            want.2
        );
    }

    let tokens = "10,72,101,108,108,111,32,119,111,114,108,100,33,10";
    let eval = |d: &PathBuf| -> f64 {
        let doc = ok(
            &tessera(
                &[
                    "eval",
                    "--model-dir",
                    d.to_str().unwrap(),
                    "--tokens",
                    tokens,
                    "--format",
                    "json",
                ],
                &[],
            ),
            "eval",
        );
        doc["loss"].as_f64().unwrap_or_else(|| panic!("no loss: {doc}"))
    };
    let (exported, single) = (eval(&hf), eval(&single_ck));
    assert!(
        (exported - single).abs() / single < 1e-5,
        "exported {exported} vs single-device checkpoint {single}"
    );
}

/// A rank that fails (or stalls past --comm-timeout) ends the whole run with an error naming
/// the rank and the collective, well within 60 s.
#[test]
fn a_failing_or_stuck_rank_ends_the_run_with_a_clear_error() {
    for kind in ["error", "hang"] {
        let t0 = Instant::now();
        let fault = format!("rank=2,step=2,kind={kind}");
        let mut args = vec!["train", "--devices", "4", "--plan", "dp2 tp2", "--steps", "4"];
        args.extend(SMALL);
        args.extend(["--comm-timeout", "2", "--eval-batches", "0"]);
        let out = tessera(&args, &[("TESSERA_FAULT", fault.as_str())]);
        let elapsed = t0.elapsed().as_secs_f64();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{kind}: should fail");
        assert!(elapsed < 60.0, "{kind}: took {elapsed:.0} s");
        assert!(err.contains("error:"), "{kind}: {err}");
        if kind == "error" {
            assert!(err.contains("rank 2 failed") && err.contains("TESSERA_FAULT"), "{err}");
        } else {
            assert!(err.contains("timed out"), "{kind}: {err}");
            assert!(
                ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
                    .iter()
                    .any(|c| err.contains(c)),
                "{kind}: no collective named: {err}"
            );
        }
    }
}

/// One training path: a GPT-2 with dropout and an fp16 model train on several devices
/// through the binary, step for step as on one device (dropout masks keyed by the global
/// element index; fp16 loss scaling with the same skipped steps).
#[test]
fn dropout_and_fp16_runs_match_one_device_through_the_cli() {
    let dir = temp("one-path");
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type":"gpt2","vocab_size":256,"n_positions":64,"n_embd":32,"n_layer":2,
            "n_head":2,"resid_pdrop":0.1,"embd_pdrop":0.1,"attn_pdrop":0.1}"#,
    )
    .unwrap();
    let run = |model: &str, extra: &[&str], devices: &str, name: &str| {
        let log = dir.join(format!("{name}-{devices}.jsonl"));
        let mut args = vec!["train", "--model", model, "--devices", devices, "--steps", "4"];
        args.extend(["--eval-batches", "0", "--format", "json", "--log-json"]);
        args.push(log.to_str().unwrap());
        args.extend(SMALL);
        args.extend(extra);
        let doc = ok(&tessera(&args, &[]), name);
        (doc, std::fs::read_to_string(&log).unwrap())
    };
    let (one, one_log) = run(cfg.to_str().unwrap(), &[], "1", "dropout");
    let (two, two_log) = run(cfg.to_str().unwrap(), &["--plan", "dp2"], "2", "dropout");
    assert_eq!(two["devices"], 2);
    let (a, b) = (log_of(&one_log), log_of(&two_log));
    assert_eq!(a.len(), 4);
    for ((s, l1, g1), (_, l2, g2)) in a.iter().zip(&b) {
        assert!((l1 - l2).abs() <= 1e-5 * l1.abs(), "dropout step {s}: loss {l1} vs {l2}");
        assert!((g1 - g2).abs() <= 1e-5 * g1.abs(), "dropout step {s}: norm {g1} vs {g2}");
    }
    assert_eq!(one["final_loss"].as_f64().map(|x| x > 0.0), Some(true));

    let fp16 = ["--dtype", "fp16", "--loss-scale", "2097152"];
    let (one, _) = run("gpt2-tiny", &fp16, "1", "fp16");
    let (two, _) = run("gpt2-tiny", &[&fp16[..], &["--plan", "tp2"]].concat(), "2", "fp16");
    assert!(one["skipped_steps"].as_u64().is_some_and(|k| k > 0), "{one}");
    assert_eq!(one["skipped_steps"], two["skipped_steps"], "{one}\n{two}");
    assert_eq!(one["loss_scale"], two["loss_scale"]);
}

/// `(step, loss, grad_norm)` of the lines of a `--log-json` file's text.
fn log_of(text: &str) -> Vec<(u64, f64, f64)> {
    text.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap(),
                v["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// bf16 across plans has a stated bound (issue 17: 4 devices drifted 4.2e-2 from 1 device by
/// step 11 with none): the criterion bf16 meets against fp32 — 10-step mean losses within 2%
/// (`bf16_mixed_precision_tracks_the_fp32_loss_curve`). Single steps are not bounded: at a
/// loss spike (a batch unlike the others) bf16 rounding of a differently split computation
/// moves that step's loss by up to ~7% while the next step agrees to 1e-4 again; measured on
/// 10-step windows: 0.76%.
#[test]
fn bf16_on_four_devices_stays_within_the_mixed_precision_bound() {
    let dir = temp("bf16-bound");
    let run = |devices: &str, plan: &[&str], name: &str| {
        let log = dir.join(format!("{name}.jsonl"));
        let mut args = vec!["train", "--devices", devices, "--steps", "20", "--batch", "8"];
        args.extend(["--seq", "32", "--dtype", "bf16", "--eval-batches", "0", "--format"]);
        args.extend(["json", "--log-json", log.to_str().unwrap()]);
        args.extend(plan);
        ok(&tessera(&args, &[]), name);
        log_of(&std::fs::read_to_string(&log).unwrap())
    };
    let one = run("1", &[], "one");
    let four = run("4", &["--plan", "dp2 tp2"], "four");
    assert_eq!((one.len(), four.len()), (20, 20));
    let mean = |v: &[(u64, f64, f64)]| v.iter().map(|s| s.1).sum::<f64>() / v.len() as f64;
    for (a, b) in one.chunks(10).zip(four.chunks(10)) {
        let gap = (mean(b) - mean(a)).abs() / mean(a);
        assert!(
            gap < 0.02,
            "steps {}-{}: 10-step means differ {:.2}%",
            a[0].0,
            a[9].0,
            gap * 100.0
        );
    }
    assert!(one[19].1 < one[0].1 * 0.8, "the runs must learn: {one:?}");
}
