//! A hostile user (issue 43): flags out of range, garbage, resources the machine does not have,
//! hand-edited files. Each is refused by the binary with a message naming the cause and the
//! fix, never a panic, an abort or a run that does not end; under `--format json` the refusal
//! is one JSON error object on stdout.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

fn tessera(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("tessera runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn temp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("misuse-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
        .to_str()
        .unwrap()
        .to_string()
}

/// Runs `args`, which must fail with exit status `code` (not a signal, not a panic) and a
/// message on stderr holding every one of `says`; returns stderr.
fn refused(args: &[&str], code: i32, says: &[&str]) -> String {
    let out = tessera(args);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(err.starts_with("error: "), "{args:?}: {err}");
    for s in says {
        assert!(err.contains(s), "{args:?}: `{s}` not in:\n{err}");
    }
    err
}

/// Runs `args` (with `--format json` among them), which must fail, and returns the error
/// object it prints on stdout.
fn json_error(args: &[&str]) -> Value {
    let out = tessera(args);
    assert!(!out.status.success(), "{args:?} must fail");
    let stdout = text(&out.stdout);
    let v: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{args:?}: stdout is not one JSON object ({e}): {stdout:?}"));
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(!message.is_empty(), "{args:?}: {v}");
    v["error"].clone()
}

#[test]
fn a_huge_comm_timeout_is_refused_not_a_panic() {
    for cmd in [&["train"][..], &["generate", "--model-dir", "x"]] {
        let args = [cmd, &["--comm-timeout", "1e20"]].concat();
        refused(&args, 2, &["--comm-timeout", "(0, 1000000]", "give seconds like 30"]);
    }
}

/// Under `ulimit -v` a run whose devices do not fit in the address space left is refused by
/// name before any device allocates (an allocation past the limit aborts the process).
#[test]
fn an_address_space_limit_is_refused_before_step_1() {
    let script = format!(
        "ulimit -v 1000000 && exec {BIN} train --devices 4 --batch 32 --seq 256 --steps 1 \
         --eval-batches 0"
    );
    let out = Command::new("bash").args(["-c", &script]).output().expect("bash runs");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "killed or aborted? {err}");
    assert!(err.contains("address-space limit (ulimit -v)"), "{err}");
    assert!(err.contains("raise the limit") && err.contains("--devices"), "{err}");
    assert!(!err.contains("step 1/"), "it trained: {err}");
}

#[test]
fn a_device_as_data_is_read_up_to_a_cap_and_refused() {
    let err = refused(&["train", "--devices", "1", "--data", "/dev/zero"], 1, &["/dev/zero"]);
    assert!(err.contains("not a regular file") && err.contains("256 MiB"), "{err}");
    assert!(err.contains("write the data to a regular file"), "{err}");
}

#[test]
fn a_data_file_larger_than_memory_is_refused_before_it_is_read() {
    let dir = temp("sparse");
    let path = dir.join("huge.txt");
    // Sparse: 2 TiB by size, nothing on disk.
    std::fs::File::create(&path).unwrap().set_len(2 << 40).unwrap();
    let p = path.to_str().unwrap();
    let err = refused(&["train", "--devices", "1", "--data", p], 1, &["huge.txt", "2048.00 GiB"]);
    assert!(err.contains("use a smaller file"), "{err}");
}

#[test]
fn cluster_sizes_are_bounded_with_the_limit_named() {
    let base = ["plan", "--model", "gpt2-tiny", "--cluster"];
    refused(&[&base[..], &["99999999999xH100"]].concat(), 1, &["at most 4096 devices"]);
    refused(&[&base[..], &["70000x8xH100"]].concat(), 1, &["at most 65536 nodes"]);
    refused(&[&base[..], &["9000x8xH100"]].concat(), 1, &["72000 devices", "65536"]);
    let e = json_error(&[&base[..], &["99999999999xH100", "--format", "json"]].concat());
    assert_eq!(e["kind"], "invalid", "{e}");
}

/// Every command answers a command line the parser refuses with one JSON object under
/// `--format json` (or `--format=json`), exit status 2, and clap's text on stderr.
#[test]
fn usage_errors_are_json_for_every_command() {
    let m = fixture("gpt2");
    let cases: Vec<Vec<&str>> = vec![
        vec!["train", "--steps", "-5"],
        vec!["train", "--steps", "0"],
        vec!["train", "--batch", "abc"],
        vec!["train", "--seq", "1e9"],
        vec!["train", "--lr", "nan"],
        vec!["train", "--lr", "inf"],
        vec!["train", "--weight-decay", "1e39"],
        vec!["train", "--max-grad-norm", "-1"],
        vec!["train", "--warmup", "-1"],
        vec!["train", "--devices", "0"],
        vec!["train", "--comm-timeout", "1e20"],
        vec!["train", "--save", "x", "--save-every", "0"],
        vec!["train", "--stop-after", "0"],
        vec!["train", "--loss-scale", "0"],
        vec!["train", "--seed", "-1"],
        vec!["train", "--no-such-flag"],
        vec!["generate", "--model-dir", &m, "--temperature", "-1"],
        vec!["generate", "--model-dir", &m, "--top-p", "0"],
        vec!["generate", "--model-dir", &m, "--top-k", "-3"],
        vec!["generate", "--model-dir", &m, "--max-new-tokens", "0"],
        vec!["generate", "--model-dir", &m, "--eos", "-2"],
        vec!["eval", "--bogus"],
        vec!["profile", "--batch", "-1"],
        vec!["profile", "--dtype", "fp64"],
        vec!["profile", "--inference", "--new-tokens", "18446744073709551615"],
        vec!["plan", "--seq", "0"],
        vec!["checkpoint", "verify"],
        vec!["export", "--checkpoint", "a"],
        vec!["calibrate", "--quick", "--bogus"],
    ];
    for (i, case) in cases.iter().enumerate() {
        let format: &[&str] = if i % 2 == 0 { &["--format", "json"] } else { &["--format=json"] };
        let args = [&case[..], format].concat();
        let out = tessera(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out.stderr));
        assert!(text(&out.stderr).starts_with("error: "), "{args:?}");
        let e = json_error(&args);
        assert_eq!(e["kind"], "usage", "{args:?}: {e}");
    }
    // Without --format json: clap's text only, nothing on stdout.
    let out = tessera(&["train", "--steps", "-5"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty() && text(&out.stderr).contains("1..=1000000000"));
    // --help and --version print as ever, even beside --format json.
    let out = tessera(&["train", "--help", "--format", "json"]);
    assert!(out.status.success() && text(&out.stdout).contains("Usage: tessera train"));
    let out = tessera(&["--version"]);
    assert!(out.status.success() && text(&out.stdout).starts_with("tessera "));
}

#[test]
fn checkpoint_verify_reports_its_failure_as_json() {
    let dir = temp("verify");
    let missing = dir.join("nothing-here");
    let m = missing.to_str().unwrap();
    let e = json_error(&["checkpoint", "verify", m, "--format", "json"]);
    assert_eq!(e["kind"], "failed", "{e}");
    assert!(e["message"].as_str().unwrap().contains("nothing-here"), "{e}");
}

#[test]
fn numeric_flags_name_their_range() {
    let cases: [(&[&str], &str); 6] = [
        (&["train", "--weight-decay", "1e39"], "'--weight-decay <WEIGHT_DECAY>': 1e39 is not"),
        (&["train", "--lr", "-1e-3"], "(0, 10]"),
        (&["train", "--batch", "99999999"], "1..=1048576"),
        (
            &["train", "--save", "x", "--save-every", "0"],
            "'--save-every <SAVE_EVERY>': 0 is not in",
        ),
        (&["generate", "--model-dir", "x", "--top-p", "1.5"], "(0, 1]"),
        (&["plan", "--batch", "18446744073709551616"], "1..=1048576"),
    ];
    for (args, says) in cases {
        refused(args, 2, &[says]);
    }
}

#[test]
fn weight_decay_that_diverges_is_named_not_blamed_on_the_learning_rate() {
    let err = refused(
        &["train", "--lr", "0.5", "--weight-decay", "4", "--steps", "2"],
        1,
        &["--weight-decay 4 with --lr 0.5", "lower --weight-decay"],
    );
    assert!(!err.contains("lower the learning rate"), "{err}");
}

#[test]
fn stop_after_past_the_run_is_refused_with_the_fix() {
    refused(
        &["train", "--steps", "5", "--stop-after", "10"],
        1,
        &["--stop-after 10 is past the run's last step (--steps 5)", "raise --steps"],
    );
}

#[test]
fn kv_positions_past_the_model_name_both_numbers() {
    let base = ["plan", "--model", "gpt2-tiny", "--cluster", "1xH100", "--inference"];
    refused(
        &[&base[..], &["--seq", "200", "--new-tokens", "100"]].concat(),
        1,
        &["200 tokens (--seq)", "100 new tokens", "need 299 positions", "at most 256"],
    );
    let m = fixture("gpt2");
    refused(
        &["generate", "--model-dir", &m, "--tokens", "1,2,3", "--max-new-tokens", "70"],
        1,
        &["need 72 positions", "at most 64 positions (n_positions)", "lower --max-new-tokens"],
    );
}

#[test]
fn token_lists_and_eos_are_checked() {
    let m = fixture("gpt2");
    refused(
        &["generate", "--model-dir", &m, "--tokens", "1,,2"],
        1,
        &["--tokens `1,,2`: item 2 is empty", "comma-separated"],
    );
    refused(&["eval", "--model-dir", &m, "--tokens", "1,2,"], 1, &["item 3 is empty"]);
    refused(
        &["generate", "--model-dir", &m, "--tokens", "1,2", "--eos", "999"],
        1,
        &["--eos 999 is outside the model's vocabulary of 96", "-1 to never stop"],
    );
}

#[test]
fn a_reserve_beyond_the_device_names_reserve() {
    let err = refused(
        &["plan", "--model", "gpt2-tiny", "--cluster", "1xH100", "--reserve", "1PiB"],
        1,
        &["--reserve 1PiB leaves nothing", "give a smaller --reserve"],
    );
    assert!(!err.contains("--memory-budget"), "{err}");
}

#[test]
fn nan_in_a_cluster_file_names_the_field() {
    let dir = temp("nan-cluster");
    let file = dir.join("c.toml");
    std::fs::write(
        &file,
        "gpus_per_node = 2\ndevice = \"H100\"\n[intra]\nlatency_s = nan\nbandwidth = 1e9\n",
    )
    .unwrap();
    let c = file.to_str().unwrap();
    refused(
        &["plan", "--model", "gpt2-tiny", "--cluster", c],
        1,
        &["`intra.latency_s` is not a finite number", "nan and inf are not allowed"],
    );
}

/// A plan file's `devices` that is not its mesh's size, and `micro_batches: 0`, are refused
/// naming the field; its `config` and `tensors` (a report of what the layout lowers to, which
/// editing `strategies` changes) are recomputed, and the run says so. The unedited file plans
/// as written.
#[test]
fn hand_edited_plan_files_are_refused_or_recomputed_and_said() {
    let dir = temp("plan-file");
    let file = dir.join("plan.json");
    let f = file.to_str().unwrap();
    let base = ["plan", "--model", "gpt2-tiny", "--cluster", "4xH100", "--batch", "8"];
    let base = [&base[..], &["--seq", "64"]].concat();
    let out = tessera(&[&base[..], &["--plan", "dp2 tp2", "--out", f]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let plan: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let out = tessera(&[&base[..], &["--plan", f]].concat());
    assert!(out.status.success(), "the unedited file: {}", text(&out.stderr));
    let edit = |path: &str, value: Value| {
        let mut edited = plan.clone();
        *edited.pointer_mut(path).unwrap() = value;
        let e = dir.join("edited.json");
        std::fs::write(&e, edited.to_string()).unwrap();
        [&base[..], &["--plan", e.to_str().unwrap(), "--format", "json"]].concat().join("\u{1}")
    };
    let args = |joined: &String| joined.split('\u{1}').map(String::from).collect::<Vec<_>>();
    // Settings the lowering cannot honour: refused.
    for (path, value, says) in [
        ("/devices", 8.into(), "`devices` is 8"),
        ("/micro_batches", 0.into(), "micro_batches is 0: give 1"),
    ] {
        let a = args(&edit(path, value));
        refused(&a.iter().map(String::as_str).collect::<Vec<_>>(), 1, &[says]);
    }
    // The report of what the layout lowers to: recomputed, and the run says so.
    let reference = tessera(&[&base[..], &["--plan", f, "--format", "json"]].concat());
    for (path, value, says) in [
        ("/config", "dp4".into(), "`config` is `dp4`, the layout's is `dp2 tp2`"),
        ("/tensors/0/spec", "[R, R]".into(), "`tensors` has"),
    ] {
        let a = args(&edit(path, value));
        let out = tessera(&a.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(out.status.success(), "{}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(err.contains(says) && err.contains("the run uses the layout's"), "{err}");
        let got: Value = serde_json::from_slice(&out.stdout).unwrap();
        let want: Value = serde_json::from_slice(&reference.stdout).unwrap();
        for key in ["config", "tensors", "predicted"] {
            assert_eq!(got[key], want[key], "the edit changed the plan's {key}");
        }
    }
}

/// A run file that asks for `format = "json"` has its own refusal reported as JSON too.
#[test]
fn a_run_file_asking_for_json_gets_its_refusal_as_json() {
    let dir = temp("run-file");
    let file = dir.join("run.toml");
    std::fs::write(&file, "steps = -5\nformat = \"json\"\n").unwrap();
    let args = ["train", "--config", file.to_str().unwrap()];
    let e = json_error(&args);
    let message = e["message"].as_str().unwrap();
    assert!(message.contains("`steps = -5`") && message.contains("1..=1000000000"), "{e}");
    refused(&args, 1, &["run file", "steps = -5"]);
}

/// A device given where a file is read (a tokenizer, a model config) is refused at a cap, not
/// read until memory runs out.
#[test]
fn devices_as_tokenizer_or_model_are_refused() {
    refused(
        &["train", "--devices", "1", "--tokenizer", "/dev/zero"],
        1,
        &["/dev/zero is not a regular file", "256 MiB"],
    );
    refused(&["train", "--devices", "1", "--model", "/dev/zero"], 1, &["more than 16 MiB"]);
    refused(&["eval", "--model-dir", "/dev/zero", "--tokens", "1,2"], 1, &["more than 16 MiB"]);
}
