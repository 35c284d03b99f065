//! The binary-level harness of the parallel-axis tests (`context_parallel.rs`,
//! `ring_attention.rs`, `expert_parallel.rs`): training runs of the `tessera` binary on thread
//! devices or under `mpirun`, their per-step loss and gradient norm read back from
//! `--log-json`, and the two checks every such run gets — each step within 1e-5 relative of
//! one device's, and each device's measured peak memory and collective bytes equal to the
//! plan's prediction.

use serde_json::Value;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A run's shape: global batch and sequence, and the steps of a fidelity run.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub batch: usize,
    pub seq: usize,
    pub steps: usize,
}

/// A fresh scratch directory of this process for test file `test`, case `name`.
pub fn temp(test: &str, name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{test}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes the model's config.json as `<name>.json` in `dir`; returns its path.
pub fn model_file(dir: &Path, name: &str, json: &str) -> String {
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, json).unwrap();
    path.to_str().unwrap().to_string()
}

/// Runs this build's binary.
pub fn tessera<S: AsRef<OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("tessera runs")
}

/// The training flags every run shares (`--devices` or `mpirun` say how many devices):
/// `steps` steps of `shape`, no held-out evaluation, the JSON report, the per-step log.
pub fn run_args(model: &str, plan: &str, log: &str, shape: Shape, steps: usize) -> Vec<String> {
    let (batch, seq, steps) = (shape.batch.to_string(), shape.seq.to_string(), steps.to_string());
    [
        "train",
        "--model",
        model,
        "--steps",
        &steps,
        "--batch",
        &batch,
        "--seq",
        &seq,
        "--plan",
        plan,
        "--eval-batches",
        "0",
        "--format",
        "json",
        "--log-json",
        log,
    ]
    .map(String::from)
    .to_vec()
}

/// Trains `model` under `plan` on `devices` threads for `shape.steps` steps: the report and
/// `(loss, grad_norm)` per step.
pub fn train(
    dir: &Path,
    model: &str,
    devices: usize,
    plan: &str,
    shape: Shape,
) -> (Value, Vec<(f64, f64)>) {
    let stem = Path::new(model).file_stem().unwrap().to_string_lossy().to_string();
    let tag = format!("{stem}-{devices}-{}", plan.replace([' ', ':', '='], "_"));
    let log = dir.join(format!("{tag}.jsonl"));
    let mut args = run_args(model, plan, log.to_str().unwrap(), shape, shape.steps);
    args.extend(["--devices".to_string(), devices.to_string()]);
    let out = tessera(&args);
    assert!(out.status.success(), "{plan}: {}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    (doc, steps_of(&log))
}

/// Runs `args` (a `train` command line) as `n` MPI ranks; the JSON report, checked to span
/// `n` devices.
pub fn mpirun(n: usize, args: &[String]) -> Value {
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n"])
        .arg(n.to_string())
        .arg(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run mpirun ({e}): run scripts/setup.sh"));
    assert!(out.status.success(), "mpirun {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(doc["devices"], n, "{doc}");
    doc
}

/// `(loss, grad_norm)` per step of a `--log-json` file.
pub fn steps_of(log: &Path) -> Vec<(f64, f64)> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["loss"].as_f64().unwrap(), v["grad_norm"].as_f64().unwrap())
        })
        .collect()
}

/// `a` and `b` within `rel` of the larger.
pub fn within(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs())
}

/// Every step's loss and gradient norm within 1e-5 relative of the single-device run's
/// (`first` numbers the first step, for messages).
pub fn assert_follows(what: &str, steps: &[(f64, f64)], single: &[(f64, f64)], first: usize) {
    assert_eq!(steps.len(), single.len(), "{what}: steps logged");
    for (k, (s, p)) in single.iter().zip(steps).enumerate() {
        assert!(within(s.0, p.0, 1e-5), "{what} step {}: loss {} vs {}", k + first, p.0, s.0);
        assert!(within(s.1, p.1, 1e-5), "{what} step {}: norm {} vs {}", k + first, p.1, s.1);
    }
}

/// Every device's measured peak and collective bytes equal the plan's prediction.
pub fn assert_accounted(what: &str, doc: &Value) {
    let m = &doc["memory"];
    assert_eq!(m["measured_peak_bytes"], m["predicted_peak_bytes"], "{what}: {m}");
    let c = &doc["comm"];
    assert_eq!(c["measured_bytes"], c["predicted_bytes"], "{what}: {c}");
}
