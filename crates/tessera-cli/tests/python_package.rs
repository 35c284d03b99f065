//! The Python package's promise, tested where it is kept: `tessera.profile` and `tessera.plan`
//! return what `tessera_cli::json_report` returns (crates/tessera-py turns it into the dict
//! `json.loads` makes), which must be the JSON `tessera profile|plan --format json` prints —
//! timings aside — and fail with the CLI's message and error object; `tessera.train`'s batches
//! and stop reach the run through `tessera_cli::run_json`'s hooks. Building, installing and
//! importing the wheel, and training from Python, is `scripts/check-wheel.sh`'s (it needs
//! maturin from PyPI).

use serde_json::Value;
use std::process::Command;

/// `value` without its timings (`profile_ms`, `search_ms`, ...), which differ run to run.
fn without_timings(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|k, _| !k.ends_with("_ms"));
            map.values_mut().for_each(without_timings);
        }
        Value::Array(items) => items.iter_mut().for_each(without_timings),
        _ => {}
    }
}

/// The binary's stdout under `--format json` (a report or an error object), and its stderr.
fn cli(args: &[&str]) -> (bool, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .args(["--format", "json"])
        .output()
        .expect("tessera runs");
    let json = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: stdout is not JSON ({e})"));
    (out.status.success(), json, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The library's report equals the binary's JSON for `args`.
fn check(args: &[&str]) -> Value {
    let (ok, mut want, stderr) = cli(args);
    assert!(ok, "{args:?}: {stderr}");
    let mut got = tessera_cli::json_report(args)
        .unwrap_or_else(|e| panic!("{args:?}: the library failed: {}", e.message));
    without_timings(&mut want);
    without_timings(&mut got);
    if let Some(at) = difference(&got, &want, String::new()) {
        panic!("{args:?}: the library's report differs from the CLI's JSON at {at}");
    }
    got
}

/// Where `a` and `b` first differ: a path and both values.
fn difference(a: &Value, b: &Value, path: String) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) if x.len() == y.len() => {
            x.iter().find_map(|(k, v)| {
                let path = format!("{path}.{k}");
                match y.get(k) {
                    Some(w) => difference(v, w, path),
                    None => Some(format!("{path}: only in the library's")),
                }
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (v, w))| difference(v, w, format!("{path}[{i}]"))),
        // Floats to 1e-12 relative: a sum of per-op times can round differently in its last
        // place from one run to another (seen under a loaded machine), the plan unchanged.
        (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
            let (x, y) = (x.as_f64().unwrap_or(f64::NAN), y.as_f64().unwrap_or(f64::NAN));
            let close = (x - y).abs() <= 1e-12 * x.abs().max(y.abs());
            (!close).then(|| format!("{path}: library {x}, CLI {y}"))
        }
        _ if a == b => None,
        _ => Some(format!("{path}: library {a}, CLI {b}")),
    }
}

/// The library fails as the binary does: its message is the binary's `error: ` line, its error
/// object the one the binary prints on stdout.
fn check_failure(args: &[&str], needle: &str) {
    let (ok, want, stderr) = cli(args);
    assert!(!ok, "{args:?} should fail");
    let e = tessera_cli::json_report(args).expect_err("the library fails too");
    assert_eq!(format!("error: {}\n", e.message), stderr, "{args:?}");
    assert_eq!(e.error, want["error"], "{args:?}");
    assert!(e.message.contains(needle), "{args:?}: `{}` should mention `{needle}`", e.message);
}

#[test]
fn profiles_are_the_cli_json() {
    let v = check(&["profile", "--model", "gpt2-tiny", "--batch", "2", "--seq", "64"]);
    assert_eq!((v["model"].as_str(), v["seq"].as_u64()), (Some("gpt2-tiny"), Some(64)));
    assert!(v["memory"]["peak_bytes"].as_u64().is_some_and(|b| b > 0), "{v}");
    // Defaults come from the same parser: no --seq is the model's positions (gpt2-tiny: 256).
    let v = check(&["profile", "--model", "gpt2-tiny", "--batch", "1", "--dtype", "bf16"]);
    assert_eq!(v["seq"].as_u64(), Some(256));
    check(&["profile", "--model", "llama-tiny", "--inference", "--batch", "2", "--seq", "16"]);
    // An imported ONNX model goes through the same resolution.
    let onnx = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/onnx/gpt2/model.onnx");
    check(&["profile", "--model", onnx, "--batch", "2", "--seq", "8"]);
}

#[test]
fn plans_are_the_cli_json() {
    let v = check(&[
        "plan",
        "--model",
        "llama-tiny",
        "--cluster",
        "2xH100",
        "--batch",
        "8",
        "--seq",
        "128",
    ]);
    assert!(v["config"].is_string(), "{v}");
    // One predicted peak per device.
    assert!(v["predicted"]["peak_bytes_per_device"][1].as_u64().is_some_and(|b| b > 0), "{v}");
    // Flags map one to one: a fixed config under a budget, repeated baselines.
    check(&[
        "plan",
        "--model",
        "gpt2-tiny",
        "--cluster",
        "2xcpu",
        "--batch",
        "4",
        "--seq",
        "32",
        "--plan",
        "dp2 zero1",
        "--memory-budget",
        "1GiB",
        "--baseline",
        "megatron",
    ]);
    check(&["plan", "--model", "gpt2-tiny", "--cluster", "2xH100", "--inference", "--seq", "16"]);
}

#[test]
fn failures_carry_the_cli_message() {
    check_failure(&["profile", "--model", "gpt9"], "gpt9");
    check_failure(
        &["plan", "--model", "gpt2-tiny", "--seq", "64", "--memory-budget", "1KiB"],
        "no plan fits",
    );
    // clap refuses before any command runs: the binary prints its usage text instead.
    let e = tessera_cli::json_report(["profile", "--dtype", "fp64"]).expect_err("fp64");
    assert_eq!(e.error["kind"], "usage");
    assert!(e.message.contains("'fp64'") && e.message.contains("--dtype"), "{}", e.message);
    // A command with no JSON report (`train`, `eval` and `generate` have one now).
    let e = tessera_cli::json_report(["export"]).expect_err("export");
    assert!(e.message.contains("profile") && e.message.contains("train"), "{}", e.message);
}

/// A front end's batches (here the data set's own windows, handed over one step at a time)
/// train as `--data` does, on two devices sharing the source: the same losses, bit for bit.
/// Stopping at a step boundary ends the run there with a report of the steps that ran.
#[test]
fn train_takes_batches_and_stops_from_the_front_end() {
    use std::sync::{Arc, Mutex};
    use tessera_cli::hooks::{BatchSource, Events, Hooks, Request};
    use tessera_runtime::data::{DataOptions, Dataset};

    let dir = tempfile::tempdir().expect("tempdir");
    let tokens: Vec<u16> = (0..2000u32).map(|i| ((i * 7919 + i / 3) % 256) as u16).collect();
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(dir.path().join("train.bin"), &bytes).expect("train.bin");
    std::fs::write(dir.path().join("val.bin"), &bytes[..800]).expect("val.bin");
    let data = dir.path().to_str().expect("utf-8 path").to_string();
    let flags = ["--model", "gpt2-tiny", "--devices", "2", "--plan", "dp2", "--steps", "6"];
    let shape = ["--batch", "2", "--seq", "16", "--eval-batches", "0"];
    let (ok, want, stderr) =
        cli(&[&["train"][..], &flags, &shape, &["--stop-after", "2", "--data", &data]].concat());
    assert!(ok, "{stderr}");

    struct Windows(Dataset);
    impl BatchSource for Windows {
        fn next(&mut self, step: u64) -> anyhow::Result<Request> {
            if step > 2 {
                return Ok(Request::Stop);
            }
            let b = self.0.train_batch(1337, step, 2, 16)?;
            Ok(Request::Batch(tessera_runtime::StepBatch::tokens(b.inputs, b.targets, 2, 16)?))
        }
    }
    struct Losses(Mutex<Vec<f64>>);
    impl Events for Losses {
        fn event(&self, kind: &str, value: Value) {
            if kind == "step" {
                self.0.lock().expect("losses").push(value["loss"].as_f64().unwrap_or(f64::NAN));
            }
        }
    }
    let dataset = Dataset::load(dir.path(), &DataOptions::default()).expect("data set");
    let source: Box<dyn BatchSource> = Box::new(Windows(dataset));
    let losses = Arc::new(Losses(Mutex::new(Vec::new())));
    let hooks = Hooks {
        steps: Some(Arc::new(Mutex::new(source))),
        caller_data: true,
        events: Some(losses.clone()),
        stop: None,
    };
    let got = tessera_cli::run_json([&["train"][..], &flags, &shape].concat(), &hooks)
        .unwrap_or_else(|e| panic!("{}", e.message));
    assert_eq!(got["steps"], 2, "{got}");
    assert_eq!(got["stopped_before_step"], 3, "{got}");
    assert_eq!(got["initial_loss"], want["initial_loss"]);
    assert_eq!(got["final_loss"], want["final_loss"]);
    assert_eq!(got["memory"]["predicted_peak_bytes"], want["memory"]["predicted_peak_bytes"]);
    let seen = losses.0.lock().expect("losses").clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(Some(seen[1]), want["final_loss"].as_f64());
    // The stop flag: set before the run, it ends before step 1, which the report refuses.
    let stop = Hooks { stop: Some(Arc::new(true.into())), ..Hooks::default() };
    let e = tessera_cli::run_json([&["train"][..], &flags, &shape].concat(), &stop)
        .expect_err("no step ran");
    assert!(e.message.contains("no step ran"), "{}", e.message);
}
