//! `tessera plan` as users run it: the JSON contract, fixed configurations, plan files, and one
//! clear error line (no panic) for each kind of bad input.

use std::process::Command;

fn tessera(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const SMALL: &[&str] = &["plan", "--model", "gpt2-tiny", "--batch", "8", "--seq", "64"];

fn plan(extra: &[&str]) -> serde_json::Value {
    let args: Vec<&str> = SMALL.iter().chain(extra).copied().collect();
    let (ok, out, err) = tessera(&args);
    assert!(ok, "{err}");
    serde_json::from_str(&out).unwrap()
}

fn fails(extra: &[&str], needle: &str) {
    let args: Vec<&str> = SMALL.iter().chain(extra).copied().collect();
    let (ok, _, err) = tessera(&args);
    assert!(!ok, "{args:?} should fail");
    assert!(err.starts_with("error: "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains(needle), "{args:?}: `{err}` should mention `{needle}`");
}

#[test]
fn json_has_the_promised_keys_and_the_baseline_is_no_faster() {
    let v = plan(&["--cluster", "4xH100", "--baseline", "megatron", "--format", "json"]);
    // The layout says whether the config string reproduces the plan.
    assert!(matches!(v["layout"].as_str(), Some("megatron" | "per-op")), "{}", v["layout"]);
    // A pipelined plan's mesh is one stage's; the pipeline multiplies it.
    let stages = v["pipeline"]["devices"].as_u64().unwrap_or(1);
    assert_eq!(
        v["mesh"]["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).product::<u64>()
            * stages,
        4
    );
    let peaks = v["predicted"]["peak_bytes_per_device"].as_array().unwrap();
    assert_eq!(peaks.len(), 4);
    assert!(v["predicted"]["mfu"].as_f64().unwrap() > 0.0);
    assert!(v["search_ms"].as_f64().unwrap() >= 0.0);
    let t = v["predicted"]["step_time_s"].as_f64().unwrap();
    let m = v["baselines"]["megatron"]["step_time_s"].as_f64().unwrap();
    assert!(t <= m * (1.0 + 1e-9), "auto {t} vs megatron {m}");
    assert!(v["config"].as_str().unwrap().starts_with("dp"));
}

#[test]
fn fixed_configurations_and_plan_files_round_trip() {
    let v = plan(&["--cluster", "4xH100", "--plan", "tp2+dp2 zero1", "--format", "json"]);
    assert_eq!(v["config"], "dp2 tp2 zero1");
    assert_eq!(v["zero_stage"], 1);
    let dir = std::env::temp_dir().join(format!("tessera-plan-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("plan.json");
    std::fs::write(&file, serde_json::to_string(&v).unwrap()).unwrap();
    let again =
        plan(&["--cluster", "4xH100", "--plan", file.to_str().unwrap(), "--format", "json"]);
    assert_eq!(again["predicted"]["step_time_s"], v["predicted"]["step_time_s"]);
    assert_eq!(
        again["predicted"]["peak_bytes_per_device"],
        v["predicted"]["peak_bytes_per_device"]
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_input_is_one_clear_error() {
    fails(&["--cluster", "8xH1000"], "H100");
    fails(&["--cluster", "4xH100", "--plan", "dp2 tq2"], "tq2");
    fails(&["--cluster", "4xH100", "--plan", "dp2 tp4"], "8");
    fails(&["--cluster", "4xH100", "--plan", "dp2 pp4"], "8 devices");
    fails(&["--cluster", "4xH100", "--plan", "dp4 mb4"], "batch");
    fails(&["--cluster", "4xH100", "--memory-budget", "1MiB"], "least any plan needs");
    fails(&["--cluster", "4xH100", "--memory-budget", "lots"], "invalid memory size");
}
