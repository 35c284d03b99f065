//! Offload to host memory and NVMe (issue 19), end to end through the `tessera` binary: under a
//! device budget below the model's state the automatic plan offloads, and the run's losses are
//! the unconstrained run's while the device and host accountants peak exactly where the plan's
//! Program says; parameters resting on the host, the NVMe tier and ZeRO-3 on 4 devices
//! likewise; offloaded state checkpoints
//! and resumes under another plan after a kill; bad tiers are refused before the first step.

use serde_json::Value;
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_tessera");
/// gpt2-tiny, 4 × 64 tokens, 3 steps: a few seconds per run.
const RUN: &[&str] = &["--model", "gpt2-tiny", "--batch", "4", "--seq", "64"];

fn tessera(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN).args(args).output().expect("runs tessera");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A 3-step run: its JSON report and its per-step losses.
fn train(dir: &Path, name: &str, extra: &[&str]) -> (Value, Vec<f64>) {
    let log = dir.join(format!("{name}.jsonl"));
    let log_arg = log.to_str().unwrap();
    let mut args = vec!["train", "--steps", "3", "--format", "json", "--log-json", log_arg];
    args.extend_from_slice(RUN);
    args.extend_from_slice(extra);
    let (ok, out, err) = tessera(&args);
    assert!(ok, "{name}: tessera {args:?} failed:\n{err}\n{out}");
    let report: Value = serde_json::from_str(&out).unwrap();
    let losses = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect();
    (report, losses)
}

fn same_losses(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-6 * w.abs(), "{what}: step {} loss {g} vs {w}", k + 1);
    }
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// Predicted == measured on the device (within `budget`) and on the host, on every device.
fn peaks_as_predicted(what: &str, r: &Value, budget: Option<u64>) {
    let m = &r["memory"];
    let (pred, meas) = (u64s(&m["predicted_peak_bytes"]), u64s(&m["measured_peak_bytes"]));
    assert_eq!(pred, meas, "{what}: device peaks");
    if let Some(b) = budget {
        assert!(meas.iter().all(|&p| p <= b), "{what}: {meas:?} over the budget {b}");
    }
    let host = &m["host_peak_bytes"];
    let (hp, hm) = (u64s(&host["predicted"]), u64s(&host["measured"]));
    assert_eq!(hp, hm, "{what}: host peaks");
    assert!(hm.iter().all(|&p| p > 0), "{what}: an offloaded run holds state on the host");
}

/// Parameters + gradients + AdamW state of gpt2-tiny in fp32, as the profiler counts them.
fn model_state_bytes() -> u64 {
    let (ok, out, err) = tessera(&[
        "profile",
        "--format",
        "json",
        "--batch",
        "4",
        "--seq",
        "64",
        "--model",
        "gpt2-tiny",
    ]);
    assert!(ok, "{err}");
    let m = &serde_json::from_str::<Value>(&out).unwrap()["memory"];
    ["params_bytes", "grads_bytes", "optimizer_bytes"].iter().map(|k| m[k].as_u64().unwrap()).sum()
}

#[test]
fn offloaded_runs_train_exactly_and_peak_as_predicted() {
    let dir = tempfile::tempdir().unwrap();
    let (_, reference) = train(dir.path(), "device", &["--devices", "1"]);

    // 40% of the model state: nothing fits without offload, so the search offloads.
    let budget = model_state_bytes() * 2 / 5;
    let b = budget.to_string();
    let (r, losses) = train(
        dir.path(),
        "host",
        &["--devices", "1", "--memory-budget", &b, "--host-memory", "1GiB"],
    );
    let config = r["config"].as_str().unwrap();
    assert!(config.contains("offload="), "the automatic plan offloads: {config}");
    same_losses("host offload", &losses, &reference);
    peaks_as_predicted("host offload", &r, Some(budget));

    // Too little host memory for the offloaded state: the search moves chunks to the NVMe,
    // whose files live under --offload-dir.
    let off = dir.path().join("nvme");
    std::fs::create_dir(&off).unwrap();
    let o = off.to_str().unwrap();
    let (r, losses) = train(
        dir.path(),
        "nvme",
        &[
            "--devices",
            "1",
            "--memory-budget",
            &b,
            "--host-memory",
            "40MiB",
            "--nvme-size",
            "1GiB",
            "--offload-dir",
            o,
        ],
    );
    let config = r["config"].as_str().unwrap();
    assert!(config.contains("nvme"), "40 MiB of host memory needs the NVMe: {config}");
    same_losses("NVMe offload", &losses, &reference);
    peaks_as_predicted("NVMe offload", &r, Some(budget));
    let host = u64s(&r["memory"]["host_peak_bytes"]["measured"]);
    assert!(host[0] <= 40 << 20, "the host peak {host:?} stays within --host-memory");

    // Parameters resting on the host too, fetched before each use (one block ahead) and again
    // for the backward pass.
    let (r, losses) = train(
        dir.path(),
        "all",
        &["--devices", "1", "--plan", "dp1 tp1 mb2 offload=all", "--host-memory", "1GiB"],
    );
    same_losses("parameters on the host", &losses, &reference);
    peaks_as_predicted("parameters on the host", &r, None);

    // ZeRO-3 over 4 devices with everything offloaded (ZeRO-Infinity's layout), host and NVMe
    // chunks.
    let plan = "dp4 tp1 zero3 offload=all nvme:4";
    let (r, losses) = train(
        dir.path(),
        "zero3",
        &[
            "--devices",
            "4",
            "--plan",
            plan,
            "--host-memory",
            "1GiB",
            "--nvme-size",
            "1GiB",
            "--offload-dir",
            o,
        ],
    );
    assert_eq!(r["config"], plan);
    same_losses("ZeRO-3 + offload on 4 devices", &losses, &reference);
    peaks_as_predicted("ZeRO-3 + offload on 4 devices", &r, None);
    // The state files go with the run.
    assert_eq!(std::fs::read_dir(&off).unwrap().count(), 0, "offload files left behind");
}

#[test]
fn offloaded_state_checkpoints_and_resumes_under_another_plan() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let c = ckpt.to_str().unwrap();
    let steps = |n: &'static str| ["--steps", n];
    let log = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let losses = |name: &str| -> Vec<f64> {
        std::fs::read_to_string(dir.path().join(name))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap()["loss"].as_f64().unwrap())
            .collect()
    };
    let run = |extra: &[&str], fault: Option<&str>| {
        let mut args = vec!["train", "--devices", "1"];
        args.extend_from_slice(RUN);
        args.extend_from_slice(extra);
        let mut cmd = Command::new(BIN);
        cmd.args(&args);
        if let Some(f) = fault {
            cmd.env("TESSERA_FAULT", f);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.success(), fault.is_none(), "tessera {args:?}:\n{err}");
    };
    let straight = log("straight.jsonl");
    run(&[&steps("4")[..], &["--log-json", &straight]].concat(), None);
    // Everything offloaded, saved every 2 steps, killed (SIGKILL's exit) before step 4: the
    // step-2 checkpoint, offloaded state included, resumes on the device alone.
    let first = log("first.jsonl");
    run(
        &[
            &steps("4")[..],
            &["--save-every", "2", "--save", c, "--log-json", &first],
            &["--plan", "dp1 tp1 offload=all nvme:8", "--host-memory", "1GiB"],
            &["--nvme-size", "1GiB", "--offload-dir", dir.path().to_str().unwrap()],
        ]
        .concat(),
        Some("rank=0,step=4,kind=kill"),
    );
    let mut saved = losses("first.jsonl");
    assert_eq!(saved.len(), 3, "steps 1-3 ran before the kill");
    saved.truncate(2);
    let second = log("second.jsonl");
    run(&[&steps("4")[..], &["--resume", c, "--log-json", &second]].concat(), None);
    let mut resumed = saved;
    resumed.extend(losses("second.jsonl"));
    same_losses("offloaded save, device resume", &resumed, &losses("straight.jsonl"));
}

#[test]
fn tiers_that_cannot_hold_the_plan_are_refused_before_the_first_step() {
    let dir = tempfile::tempdir().unwrap();
    let train_with = |extra: &[&str]| {
        let mut args = vec!["train", "--devices", "1", "--steps", "2"];
        args.extend_from_slice(RUN);
        args.extend_from_slice(extra);
        let (ok, out, err) = tessera(&args);
        assert!(!ok, "tessera {args:?} must fail:\n{out}");
        assert!(!out.contains("step 1"), "refused before the first step:\n{out}");
        err
    };
    // Host memory below what the plan's Program needs there: the figures and the fix.
    let err = train_with(&["--plan", "dp1 tp1 offload=opt", "--host-memory", "1MiB"]);
    assert!(
        err.contains("of host memory per device, which has 1.00 MiB")
            && err.contains("--host-memory"),
        "{err}"
    );
    // No host memory given on simulated devices: none is set aside.
    let err = train_with(&["--plan", "dp1 tp1 offload=opt"]);
    assert!(err.contains("which has 0 B") && err.contains("--host-memory"), "{err}");
    // An NVMe too small for the state put there.
    let err = train_with(&[
        "--plan",
        "dp1 tp1 offload=opt nvme",
        "--host-memory",
        "1GiB",
        "--nvme-size",
        "1MiB",
    ]);
    assert!(err.contains("of NVMe per device, which has 1.00 MiB"), "{err}");
    // An offload directory that is not there, or not a directory.
    let missing = dir.path().join("no-such-dir");
    let err = train_with(&["--offload-dir", missing.to_str().unwrap()]);
    assert!(err.contains("no-such-dir") && err.contains("no such directory"), "{err}");
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let err = train_with(&["--offload-dir", file.to_str().unwrap()]);
    assert!(err.contains("a-file"), "{err}");
    // A plan with NVMe chunks and nowhere to put their files.
    let err = train_with(&[
        "--plan",
        "dp1 tp1 offload=opt nvme",
        "--host-memory",
        "1GiB",
        "--nvme-size",
        "1GiB",
    ]);
    assert!(err.contains("--offload-dir"), "{err}");
}

#[test]
fn a_large_model_on_one_consumer_gpu_is_an_offloaded_plan_not_an_error() {
    // The CLI contract's command: llama2-7b does not fit a 24 GiB RTX 4090 on its own; with
    // 64 GiB of host memory (and the preset's 1 TB NVMe) the answer is an offloaded plan.
    let plan_7b = |extra: &[&str]| {
        let mut args = vec!["plan", "--model", "llama2-7b", "--cluster", "1xRTX4090"];
        args.extend(["--batch", "4", "--seq", "1024", "--host-memory", "64GiB"]);
        args.extend_from_slice(extra);
        args.extend(["--format", "json"]);
        tessera(&args)
    };
    let (ok, out, err) = plan_7b(&[]);
    assert!(ok, "{err}");
    let plan: Value = serde_json::from_str(&out).unwrap();
    let o = &plan["offload"];
    assert!(o["moved_bytes_per_step"].as_u64().unwrap() > 0, "{o}");
    let host = o["host_peak_bytes"].as_u64().unwrap();
    assert!(host > 0 && host <= 64 << 30, "host peak {host} within 64 GiB");
    let device = plan["predicted"]["peak_bytes_per_device"][0].as_u64().unwrap();
    assert!(device <= plan["memory_budget_bytes"].as_u64().unwrap());
    assert_eq!(o["chunks"].as_array().unwrap().len(), 16);
    // Without the NVMe, 64 GiB cannot hold 6.7 B parameters' AdamW state (12 bytes each):
    // refused, naming the host memory the least-offloaded fitting plan needs.
    let (ok, out, _) = plan_7b(&["--nvme-size", "0"]);
    assert!(!ok);
    let e = &serde_json::from_str::<Value>(&out).unwrap()["error"];
    assert_eq!(e["kind"], "infeasible");
    assert_eq!(e["tier"], "host");
    assert!(e["needed_bytes"].as_u64().unwrap() > 64 << 30, "{e}");
}

#[test]
fn an_offloaded_plan_is_not_exported_as_something_else() {
    let export = |config: &str| {
        tessera(&[
            "plan",
            "--model",
            "gpt2-tiny",
            "--cluster",
            "1xcpu",
            "--batch",
            "4",
            "--seq",
            "64",
            "--host-memory",
            "1GiB",
            "--plan",
            config,
            "--export",
            "deepspeed",
        ])
    };
    // `offload=opt` keeps gradients on the device until the step, which DeepSpeed's
    // offload_optimizer does not: refused, naming both, with a plan that exports.
    let (ok, out, err) = export("dp1 tp1 offload=opt");
    assert!(!ok, "{out}");
    assert!(err.contains("offload=opt") && err.contains("offload=grads+opt"), "{err}");
    assert!(err.contains("export it with --plan \"dp1 tp1"), "names a plan that exports: {err}");
    // `offload=grads+opt` is DeepSpeed's ZeRO-Offload; on one data-parallel rank, ZeRO-1
    // (which it needs) partitions nothing.
    let (ok, out, err) = export("dp1 tp1 offload=grads+opt");
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let z = &v["zero_optimization"];
    assert_eq!(z["offload_optimizer"]["device"], "cpu", "{out}");
    assert_eq!(z["stage"], 1, "{out}");
    assert!(z.get("offload_param").is_none(), "{out}");
}
