//! The `tessera` binary end to end: the JSON contract of `profile` and one clear error line
//! (no panic, non-zero exit) for each kind of bad input.

use std::path::PathBuf;
use std::process::{Command, Output};

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("tessera runs")
}

fn temp_config(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-cli-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("config.json");
    std::fs::write(&path, text).expect("write config");
    path
}

#[test]
fn profile_json_has_the_promised_keys() {
    let out = tessera(&[
        "profile", "--model", "gpt2", "--batch", "2", "--seq", "256", "--format", "json",
    ]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is only JSON");
    for key in [
        "/params",
        "/flops/forward",
        "/flops/backward",
        "/flops/total",
        "/flops/matmul",
        "/memory/params_bytes",
        "/memory/grads_bytes",
        "/memory/optimizer_bytes",
        "/memory/activations_bytes",
        "/memory/peak_bytes",
        "/profile_ms",
    ] {
        let x = v.pointer(key).unwrap_or_else(|| panic!("missing {key}"));
        assert!(x.is_number(), "{key} is not a number: {x}");
    }
    assert_eq!(v["params"], 124_439_808u64);
    let f = &v["flops"];
    let total = f["forward"].as_u64().unwrap()
        + f["backward"].as_u64().unwrap()
        + f["optimizer"].as_u64().unwrap();
    assert_eq!(f["total"].as_u64().unwrap(), total);
}

/// The README's timeline command, as written (it once asked gpt2-tiny for 1024 positions of
/// its 256).
#[test]
fn the_readme_timeline_command_runs() {
    let dir = std::env::temp_dir().join(format!("tessera-readme-timeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("timeline.csv");
    let args = ["profile", "--model", "gpt2-tiny", "--seq", "256", "--timeline"];
    let out = tessera(&[&args[..], &[csv.to_str().unwrap()]].concat());
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&csv).expect("timeline written");
    // The CSV's largest live figure is the peak the table reports beside it, to the byte.
    let peak = text.lines().skip(1).filter_map(|l| l.split(',').nth(1)?.parse::<u64>().ok()).max();
    let (ok, json) = {
        let o = tessera(&["profile", "--model", "gpt2-tiny", "--seq", "256", "--format", "json"]);
        (o.status.success(), String::from_utf8(o.stdout).unwrap())
    };
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(peak, v["memory"]["peak_bytes"].as_u64(), "{}", v["memory"]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn profile_table_and_timeline() {
    let dir = std::env::temp_dir().join(format!("tessera-timeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("timeline.csv");
    let out = tessera(&[
        "profile",
        "--model",
        "llama-tiny",
        "--batch",
        "2",
        "--seq",
        "64",
        "--timeline",
        csv.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("peak"), "{table}");
    let text = std::fs::read_to_string(&csv).expect("timeline written");
    assert!(text.starts_with("instr,live_bytes\n"));
    assert!(text.lines().count() > 100);
}

/// Runs `profile` on a bad config and returns its single stderr line.
fn expect_clean_error(args: &[&str]) -> String {
    let out = tessera(args);
    assert!(!out.status.success(), "should fail: {args:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(!err.contains("panicked"), "panic on bad input: {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one error line expected, got: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(out.stdout.is_empty(), "nothing on stdout on error");
    lines[0].to_string()
}

#[test]
fn malformed_json_is_one_clear_error() {
    let p = temp_config("malformed", "{\"model_type\": \"gpt2\", \"n_embd\": 768,,}");
    let e = expect_clean_error(&["profile", "--model", p.to_str().unwrap()]);
    assert!(e.contains("config.json:1:38"), "names the file and position: {e}");
}

#[test]
fn unknown_model_type_is_one_clear_error() {
    let p = temp_config("unknown", r#"{"model_type": "mamba", "hidden_size": 64}"#);
    let e = expect_clean_error(&["profile", "--model", p.to_str().unwrap()]);
    assert!(e.contains("mamba") && e.contains("llama"), "names it and lists supported: {e}");
}

#[test]
fn missing_field_is_one_clear_error() {
    let p = temp_config(
        "missing",
        r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}"#,
    );
    let e = expect_clean_error(&["profile", "--model", p.to_str().unwrap()]);
    assert!(e.contains("num_hidden_layers"), "names the field: {e}");
}

#[test]
fn indivisible_heads_is_one_clear_error() {
    let p = temp_config(
        "heads",
        r#"{"model_type": "gpt2", "vocab_size": 100, "n_embd": 100, "n_layer": 2, "n_head": 3, "n_positions": 64}"#,
    );
    let e = expect_clean_error(&["profile", "--model", p.to_str().unwrap(), "--seq", "32"]);
    assert!(e.contains("100") && e.contains('3'), "names the sizes: {e}");
}

#[test]
fn unknown_preset_and_missing_file_are_clear_errors() {
    let e = expect_clean_error(&["profile", "--model", "gpt5-ultra"]);
    assert!(e.contains("gpt5-ultra") && e.contains("gpt2"), "{e}");
    let e = expect_clean_error(&["profile", "--model", "/nonexistent/dir/config.json"]);
    assert!(e.contains("/nonexistent"), "{e}");
}

#[test]
fn zero_batch_is_a_clear_error() {
    // The parser refuses it, naming the flag and its range (issue 43).
    let out = tessera(&["profile", "--model", "gpt2-tiny", "--batch", "0"]);
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.starts_with("error: ") && err.contains("--batch") && err.contains("1..="), "{err}");
    assert!(out.stdout.is_empty(), "nothing on stdout without --format json");
}

/// Without `--seq`, `profile` and `plan` take 1024 positions, or the model's learned positions
/// where it has fewer (gpt2-tiny's 256; RoPE models have no such limit).
#[test]
fn the_default_sequence_fits_the_model() {
    for (model, want) in [("gpt2-tiny", 256), ("gpt2", 1024), ("llama-tiny", 1024)] {
        let out = tessera(&["profile", "--model", model, "--batch", "1", "--format", "json"]);
        assert!(out.status.success(), "{model}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["seq"], want, "{model}");
    }
    let out = tessera(&["plan", "--model", "gpt2-tiny", "--cluster", "2xcpu", "--format", "json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["seq"], 256);
    // A given --seq is kept, and too long a one is still refused.
    let out = tessera(&["profile", "--model", "gpt2-tiny", "--seq", "512"]);
    assert!(!out.status.success());
}
