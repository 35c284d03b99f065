//! Parity with Hugging Face `transformers` through the `tessera` binary: `tessera eval` on the
//! checkpoints in `tests/fixtures/hf/` (written by `scripts/make_hf_fixtures.py` with
//! `save_pretrained`) must reproduce the per-position logits `transformers` computed (max abs
//! difference ≤ 1e-4) and its mean next-token cross-entropy (relative difference ≤ 1e-5); and
//! every kind of bad checkpoint must give one clear `error:` naming the file or the tensors,
//! never a panic.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Acceptance bounds: max |logit - expected| and |loss - expected| / |expected|.
const LOGITS_ABS_TOL: f64 = 1e-4;
const LOSS_REL_TOL: f64 = 1e-5;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

/// An empty scratch directory for one test (under cargo's per-target temp dir).
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hf-parity-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("tessera runs")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

fn f64s(v: &Value, what: &str) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("{what} is not an array"))
        .iter()
        .map(|x| x.as_f64().unwrap_or_else(|| panic!("{what} holds a non-number: {x}")))
        .collect()
}

fn matrix(v: &Value, what: &str) -> Vec<Vec<f64>> {
    let rows = v.as_array().unwrap_or_else(|| panic!("{what} is not an array of rows"));
    rows.iter().enumerate().map(|(i, r)| f64s(r, &format!("{what}[{i}]"))).collect()
}

/// What one fixture measured against `transformers`.
struct Parity {
    max_logit_err: f64,
    /// (position, vocab index) of that error.
    worst: (usize, usize),
    loss: f64,
    expected_loss: f64,
}

impl Parity {
    fn loss_rel_err(&self) -> f64 {
        (self.loss - self.expected_loss).abs() / self.expected_loss.abs()
    }
}

/// Runs `tessera eval` on fixture `name` and measures it against its `expected.json`
/// (`tokens`, `logits` = transformers' fp32 logits of the first n-1 positions, `loss` = their
/// mean cross-entropy against ids[1..] in f64).
fn check(name: &str) -> Parity {
    let dir = fixtures().join(name);
    let expected = read_json(&dir.join("expected.json"));
    let tokens: Vec<String> =
        f64s(&expected["tokens"], "tokens").iter().map(|&t| (t as i64).to_string()).collect();
    let want = matrix(&expected["logits"], "expected logits");
    let expected_loss = expected["loss"].as_f64().expect("expected loss");

    let logits_path = scratch(name).join("logits.json");
    let out = tessera(&[
        "eval",
        "--model-dir",
        dir.to_str().unwrap(),
        "--tokens",
        &tokens.join(","),
        "--format",
        "json",
        "--logits",
        logits_path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{name}: eval failed: {}", String::from_utf8_lossy(&out.stderr));
    let stdout: Value = serde_json::from_slice(&out.stdout).expect("stdout is only JSON");
    let loss = stdout["loss"].as_f64().unwrap_or_else(|| panic!("{name}: no loss in {stdout}"));

    let doc = read_json(&logits_path);
    let (n, vocab) = (tokens.len() - 1, want[0].len());
    assert_eq!(f64s(&doc["shape"], "shape"), [n as f64, vocab as f64], "{name}: logits shape");
    assert_eq!(doc["tokens"], expected["tokens"], "{name}: tokens echoed");
    let got = matrix(&doc["logits"], "logits");
    assert_eq!(got.len(), n, "{name}: rows");
    let mut parity = Parity { max_logit_err: 0.0, worst: (0, 0), loss, expected_loss };
    for (pos, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), vocab, "{name}: row {pos} length");
        for (v, (a, b)) in g.iter().zip(w).enumerate() {
            let err = (a - b).abs();
            assert!(err.is_finite(), "{name}: logit [{pos}, {v}] = {a}, expected {b}");
            if err > parity.max_logit_err {
                parity.max_logit_err = err;
                parity.worst = (pos, v);
            }
        }
    }
    parity
}

/// Every fixture directory with an `expected.json`, so a new one is checked without edits here.
fn parity_fixtures() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(fixtures())
        .expect("tests/fixtures/hf exists (scripts/make-hf-fixtures.sh writes it)")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.join("expected.json").is_file())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn logits_and_loss_match_transformers() {
    let names = parity_fixtures();
    for required in ["gpt2", "llama", "qwen2", "mistral", "mistral-window"] {
        assert!(names.iter().any(|n| n == required), "fixture {required} missing: {names:?}");
    }
    let mut failures = Vec::new();
    for name in &names {
        let p = check(name);
        let (pos, v) = p.worst;
        let line = format!(
            "{name:>15}: max |logit err| {:.2e} at [{pos}, {v}], loss {:.7} vs {:.7} (rel {:.1e})",
            p.max_logit_err,
            p.loss,
            p.expected_loss,
            p.loss_rel_err()
        );
        eprintln!("{line}");
        if !(p.max_logit_err <= LOGITS_ABS_TOL && p.loss_rel_err() <= LOSS_REL_TOL) {
            failures.push(line);
        }
    }
    assert!(
        failures.is_empty(),
        "outside logits {LOGITS_ABS_TOL:e} abs / loss {LOSS_REL_TOL:e} rel:\n{}",
        failures.join("\n")
    );
}

// --- bad checkpoints ----------------------------------------------------------------------

/// Runs `eval` on `dir`, expecting failure: returns stderr after checking that it is one error
/// (its first line starts with `error: `, no other line does), not a panic, with nothing on
/// stdout. Continuation lines (a list of tensors) are allowed.
fn eval_error(dir: &Path, tokens: &str) -> String {
    let out = tessera(&["eval", "--model-dir", dir.to_str().unwrap(), "--tokens", tokens]);
    let err = String::from_utf8(out.stderr).expect("utf-8 stderr");
    assert!(!out.status.success(), "should fail on {}: {err}", dir.display());
    assert!(!err.contains("panicked"), "panic on bad input: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.lines().filter(|l| l.starts_with("error")).count(), 1, "one error: {err}");
    assert!(out.stdout.is_empty(), "nothing on stdout on error");
    err
}

/// [`eval_error`] for errors that must fit on one line.
fn eval_error_line(dir: &Path, tokens: &str) -> String {
    let err = eval_error(dir, tokens);
    assert_eq!(err.lines().count(), 1, "one error line expected, got: {err}");
    err
}

/// A scratch copy of fixture `name` (its config.json and model.safetensors).
fn copy_fixture(name: &str, test: &str) -> PathBuf {
    let dir = scratch(test);
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join(name).join(f), dir.join(f)).expect("copy fixture");
    }
    dir
}

#[test]
fn directory_without_weights_names_the_file() {
    let dir = copy_fixture("llama", "no-weights");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let e = eval_error_line(&dir, "1,2,3");
    assert!(e.contains("model.safetensors"), "names the expected file: {e}");
    assert!(e.contains(dir.to_str().unwrap()), "names the directory: {e}");
}

#[test]
fn missing_tensor_is_named() {
    let e = eval_error(&fixtures().join("broken-missing"), "1,2,3");
    assert!(e.contains("model.layers.0.mlp.down_proj.weight"), "names the tensor: {e}");
    assert!(e.contains("missing"), "says it is missing: {e}");
}

#[test]
fn unexpected_tensor_is_named() {
    let e = eval_error(&fixtures().join("broken-extra"), "1,2,3");
    assert!(e.contains("model.layers.0.mlp.extra_proj.weight"), "names the tensor: {e}");
}

#[test]
fn shapes_that_disagree_with_config_are_named() {
    // broken-shape/config.json says vocab_size 100; the weights have 32 rows.
    let e = eval_error(&fixtures().join("broken-shape"), "1,2,3");
    for tensor in ["model.embed_tokens.weight", "lm_head.weight"] {
        assert!(e.contains(tensor), "names {tensor}: {e}");
    }
    assert!(e.contains("[32, 16]") && e.contains("[100, 16]"), "shows both shapes: {e}");
    assert!(e.contains("config.json"), "points at the config: {e}");
}

#[test]
fn corrupt_safetensors_is_a_clean_error() {
    let source = fixtures().join("llama/model.safetensors");
    let bytes = std::fs::read(&source).expect("fixture weights");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let cuts = [
        ("empty", 0),
        ("len-prefix", 4),
        ("header", 8 + header_len / 2),
        ("data", 8 + header_len + (bytes.len() - 8 - header_len) / 2),
        ("last-byte", bytes.len() - 1),
    ];
    for (what, len) in cuts {
        let dir = copy_fixture("llama", &format!("truncated-{what}"));
        std::fs::write(dir.join("model.safetensors"), &bytes[..len]).unwrap();
        let e = eval_error_line(&dir, "1,2,3");
        assert!(
            e.contains("model.safetensors"),
            "truncated at {len} ({what}): names the file: {e}"
        );
    }
    // Not truncated but garbage: a header length far beyond the file.
    let dir = copy_fixture("llama", "garbage");
    std::fs::write(dir.join("model.safetensors"), b"\xff\xff\xff\xff\xff\xff\xff\x7fnot json")
        .unwrap();
    let e = eval_error_line(&dir, "1,2,3");
    assert!(e.contains("model.safetensors"), "names the file: {e}");
}

#[test]
fn token_outside_the_vocabulary_is_a_clean_error() {
    let e = eval_error_line(&fixtures().join("llama"), "1,96,3");
    assert!(e.contains("96") && e.contains("vocabulary"), "{e}");
}

/// Fine-tuning starts from a `transformers` checkpoint's weights on any plan: `train --init`
/// on 1 device and on 4 (the automatic plan and `dp2 tp2`) reports a first-step loss equal to
/// `tessera eval`'s on the same tokens — every row of the batch is the one window of the
/// data — and the plans then take the same steps.
#[test]
fn init_fine_tunes_a_transformers_checkpoint_on_any_plan() {
    let dir = scratch("init");
    let model = fixtures().join("llama");
    let seq = 16usize;
    let ids: Vec<u16> = (0..=seq).map(|i| ((i * 37 + 11) % 96) as u16).collect();
    let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
    // One window of seq+1 tokens: every batch row is it.
    std::fs::write(dir.join("train.bin"), &bytes).unwrap();
    let val: Vec<u8> = (0..4 * seq + 1).flat_map(|i| ((i * 7 % 96) as u16).to_le_bytes()).collect();
    std::fs::write(dir.join("val.bin"), val).unwrap();
    let tokens = ids.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    let out = tessera(&[
        "eval",
        "--model-dir",
        model.to_str().unwrap(),
        "--tokens",
        &tokens,
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "eval: {}", String::from_utf8_lossy(&out.stderr));
    let want = serde_json::from_slice::<Value>(&out.stdout).unwrap()["loss"].as_f64().unwrap();
    let mut logs = Vec::new();
    for (devices, plan) in [("1", "auto"), ("4", "auto"), ("4", "dp2 tp2")] {
        let log = dir.join(format!("{devices}-{}.jsonl", plan.replace(' ', "_")));
        let out = tessera(&[
            "train",
            "--init",
            model.to_str().unwrap(),
            "--data",
            dir.to_str().unwrap(),
            "--devices",
            devices,
            "--plan",
            plan,
            "--batch",
            "4",
            "--seq",
            &seq.to_string(),
            "--steps",
            "3",
            "--lr",
            "1e-3",
            "--eval-batches",
            "1",
            "--format",
            "json",
            "--log-json",
            log.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{plan}: {}", String::from_utf8_lossy(&out.stderr));
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
        let first = doc["initial_loss"].as_f64().unwrap();
        assert!((first - want).abs() <= LOSS_REL_TOL * want, "{plan}: {first} vs eval {want}");
        logs.push(std::fs::read_to_string(&log).unwrap());
    }
    let losses = |text: &str| -> Vec<f64> {
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap()["loss"].as_f64().unwrap())
            .collect()
    };
    let reference = losses(&logs[0]);
    assert_eq!(reference.len(), 3);
    assert!(reference[2] < reference[0], "fine-tuning lowers the loss: {reference:?}");
    for log in &logs[1..] {
        for (a, b) in losses(log).iter().zip(&reference) {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{a} vs {b}");
        }
    }
}
