//! Run files (`train|plan --config FILE`) through the binary: a run file plans exactly like
//! the same flags, the command line overrides it, bad keys and values are one clear error line,
//! a run file's value counts as given against a plan file, every example in `examples/` and
//! every `--config` command of the READMEs runs as written, and progress off a terminal is
//! plain lines.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The binary, run from the repository root (where the examples' paths start).
fn tessera<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(repo_root())
        .args(args)
        .output()
        .expect("tessera runs")
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-run-file-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes a run file `run.toml` in a fresh temporary directory.
fn run_file(name: &str, text: &str) -> PathBuf {
    let path = temp(name).join("run.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// stdout as JSON, less the timing fields (`search_ms`, ...), which differ between runs.
fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", stderr(out));
    let mut v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    strip_timings(&mut v);
    v
}

fn strip_timings(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(map) => {
            map.retain(|k, _| !k.ends_with("_ms"));
            map.values_mut().for_each(strip_timings);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(strip_timings),
        _ => {}
    }
}

/// Expects exactly one line on stderr, `error: ...`, naming the run file and every `needle`.
fn one_error(out: &Output, file: &Path, needles: &[&str]) -> String {
    let err = stderr(out);
    assert!(!out.status.success(), "should fail: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: ") && err.ends_with('\n'), "{err}");
    assert!(err.contains(&file.display().to_string()), "names the run file: {err}");
    for needle in needles {
        assert!(err.contains(needle), "`{err}` should mention `{needle}`");
    }
    err
}

const PLAN_FLAGS: &[&str] = &[
    "plan",
    "--model",
    "gpt2-tiny",
    "--cluster",
    "4xcpu",
    "--batch",
    "8",
    "--seq",
    "64",
    "--dtype",
    "fp32",
    "--memory-budget",
    "40MiB",
    "--baseline",
    "sharding-only",
    "--baseline",
    "megatron",
    "--format",
    "json",
];

/// The same run as `PLAN_FLAGS`, `-` and `_` both, a list for the repeatable flag.
const PLAN_FILE: &str = r#"
model = "gpt2-tiny"
cluster = "4xcpu"
batch = 8
seq = 64
dtype = "fp32"
memory_budget = "40MiB"
baseline = ["sharding-only", "megatron"]
format = "json"
explain = false
"#;

#[test]
fn a_run_file_plans_like_the_same_flags() {
    let file = run_file("same", PLAN_FILE);
    let from_flags = json(&tessera(PLAN_FLAGS));
    let from_file = json(&tessera(&["plan", "--config", file.to_str().unwrap()]));
    assert_eq!(from_file, from_flags);
    assert!(from_file["baselines"]["megatron"].is_object(), "{}", from_file["baselines"]);
    assert!(from_file["baselines"]["sharding_only"].is_object(), "{}", from_file["baselines"]);
}

#[test]
fn the_command_line_overrides_the_file() {
    let file = run_file("override", PLAN_FILE);
    let f = file.to_str().unwrap();
    // A value, and a repeatable flag: the command line's list replaces the file's.
    let v = json(&tessera(&["plan", "--config", f, "--batch", "4", "--baseline", "megatron"]));
    assert_eq!(v["batch"], 4);
    assert_eq!(v["seq"], 64, "the file's other flags stay");
    assert!(v["baselines"]["megatron"].is_object(), "{}", v["baselines"]);
    assert!(v["baselines"]["sharding_only"].is_null(), "{}", v["baselines"]);
    // Before or after --config alike.
    let w = json(&tessera(&["plan", "--batch", "4", "--baseline", "megatron", "--config", f]));
    assert_eq!(v, w);
    // A switch the file leaves off.
    let out = tessera(&["plan", "--config", f, "--format", "table", "--explain"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(serde_json::from_slice::<serde_json::Value>(&out.stdout).is_err(), "a table now");
}

#[test]
fn bad_keys_and_values_are_one_clear_error() {
    let cases: &[(&str, &str, &[&str])] = &[
        // Unknown keys: named, the closest flag suggested, the valid keys listed.
        ("plan", "bach = 8", &["`bach`", "did you mean `batch`", "memory-budget", "seq"]),
        ("train", "model = \"gpt2-tiny\"\nsteps_count = 3", &["`steps_count`", "`steps`"]),
        ("plan", "config = \"other.toml\"", &["`config`"]),
        // Values of the wrong type: the key named.
        ("plan", "batch = \"eight\"", &["batch", "eight"]),
        ("plan", "batch = 8.5", &["batch"]),
        ("plan", "batch = [8, 16]", &["batch"]),
        ("plan", "explain = \"yes\"", &["explain", "true or false"]),
        ("plan", "dtype = \"fp64\"", &["dtype", "fp32, bf16, fp16"]),
        ("plan", "baseline = [\"megatron\", \"chenn\"]", &["baseline", "chen"]),
        ("plan", "model = true", &["model"]),
        ("train", "memory-budget = \"2XB\"", &["memory-budget", "XB"]),
        ("train", "steps = -1", &["steps"]),
        ("plan", "memory_budget = \"1GiB\"\nmemory-budget = \"2GiB\"", &["memory-budget", "twice"]),
        // Not TOML: the line.
        ("plan", "batch = 8\nseq = \n", &["line 2"]),
    ];
    for (i, (command, text, needles)) in cases.iter().enumerate() {
        let file = run_file(&format!("bad{i}"), text);
        let out = tessera(&[*command, "--config", file.to_str().unwrap()]);
        one_error(&out, &file, needles);
    }
    // Under --format json the failure is one JSON object on stdout too.
    let file = run_file("bad-json", "bach = 8");
    let out = tessera(&["plan", "--config", file.to_str().unwrap(), "--format", "json"]);
    one_error(&out, &file, &["`bach`"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a JSON error");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("`bach`")), "{v}");
    let missing = temp("missing").join("nowhere.toml");
    one_error(&tessera(&["train", "--config", missing.to_str().unwrap()]), &missing, &[]);
}

/// A run file's batch counts as given: against a plan file made for another batch it is a
/// conflict, and the message names the run file (the value did not come from a flag).
#[test]
fn a_run_file_disagreeing_with_a_plan_file_is_refused() {
    let dir = temp("conflict");
    let plan = dir.join("plan.json");
    let out = tessera(&[
        "plan",
        "--model",
        "gpt2-tiny",
        "--cluster",
        "2xcpu",
        "--batch",
        "16",
        "--seq",
        "32",
        "--dtype",
        "fp32",
        "--plan",
        "dp2",
        "--out",
        plan.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let p = plan.to_str().unwrap();
    for (command, others) in [("train", "devices = 2\nsteps = 1"), ("plan", "cluster = \"2xcpu\"")]
    {
        let file = dir.join(format!("{command}.toml"));
        std::fs::write(&file, format!("plan = {p:?}\nbatch = 8\n{others}\n")).unwrap();
        let f = file.to_str().unwrap();
        let err =
            one_error(&tessera(&[command, "--config", f]), &file, &["batch = 8", "batch 16", p]);
        assert!(err.contains(&format!("batch = 8 in run file {f}")), "{err}");
        if command == "plan" {
            // The command line's --batch wins over the file's, and agrees with the plan file.
            let ok = tessera(&["plan", "--config", f, "--batch", "16"]);
            assert!(ok.status.success(), "{}", stderr(&ok));
        }
    }
}

#[test]
fn config_is_in_the_help() {
    for command in ["train", "plan"] {
        let out = tessera(&[command, "--help"]);
        assert!(out.status.success());
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.contains("--config <FILE>"), "{command} --help: {help}");
    }
}

/// The command an example's comment gives: exactly one `#   tessera ... --config
/// examples/<name>`.
fn example_command(name: &str) -> Vec<String> {
    let text = std::fs::read_to_string(repo_root().join("examples").join(name)).unwrap();
    let commands: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix('#').map(str::trim))
        .filter(|l| l.starts_with("tessera "))
        .collect();
    assert_eq!(commands.len(), 1, "{name}: one command in its comment: {commands:?}");
    let words: Vec<String> = commands[0].split_whitespace().map(String::from).collect();
    let path = format!("examples/{name}");
    assert_eq!(words[2..], ["--config".to_string(), path], "{name}: {}", commands[0]);
    words
}

/// Runs an example as its comment says; the summary names its model.
fn run_example(name: &str) -> String {
    let words = example_command(name);
    let text = std::fs::read_to_string(repo_root().join("examples").join(name)).unwrap();
    let table: toml::Table = text.parse().unwrap();
    let model = table["model"].as_str().unwrap().to_string();
    let out = tessera(&words[1..]);
    assert!(out.status.success(), "{name}: {}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(stdout.contains(&model), "{name}: {stdout}");
    stdout
}

const EXAMPLES: &[&str] =
    &["gpt2.toml", "llama.toml", "bert.toml", "vit.toml", "plan-llama3-8b.toml"];

#[test]
fn every_example_is_tested() {
    let mut found: Vec<String> = std::fs::read_dir(repo_root().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".toml"))
        .collect();
    found.sort();
    let mut tested: Vec<String> = EXAMPLES.iter().map(|s| s.to_string()).collect();
    tested.sort();
    assert_eq!(found, tested, "a new example needs its test below");
}

#[test]
fn example_gpt2_trains() {
    let out = run_example("gpt2.toml");
    assert!(out.contains("held-out") && out.contains("2 devices"), "{out}");
}

#[test]
fn example_llama_trains() {
    let out = run_example("llama.toml");
    assert!(out.contains("plan dp1 tp2 sp"), "{out}");
}

#[test]
fn example_bert_trains() {
    let out = run_example("bert.toml");
    assert!(out.contains("held-out"), "{out}");
}

#[test]
fn example_vit_trains() {
    assert!(
        repo_root().join("data/digits.csv").is_file(),
        "data/digits.csv is missing: run scripts/setup.sh (or data/fetch_digits.sh)"
    );
    let out = run_example("vit.toml");
    assert!(out.contains("top-1 (held-out)"), "{out}");
}

#[test]
fn example_plan_llama3_8b_plans() {
    let out = run_example("plan-llama3-8b.toml");
    assert!(out.contains("megatron") && out.contains("chen"), "{out}");
}

/// Every `--config` command the READMEs show runs as written (the examples' own commands run
/// in their tests above).
#[test]
fn the_readme_run_file_commands_run() {
    let own: Vec<Vec<String>> = EXAMPLES.iter().map(|n| example_command(n)).collect();
    let mut shown = 0;
    for readme in ["README.md", "examples/README.md"] {
        let text = std::fs::read_to_string(repo_root().join(readme)).unwrap();
        for line in text.lines().filter(|l| l.starts_with("tessera ") && l.contains("--config")) {
            shown += 1;
            let command = line.split('#').next().unwrap();
            let words: Vec<String> = command.split_whitespace().map(String::from).collect();
            if own.contains(&words) {
                continue;
            }
            let out = tessera(&words[1..]);
            assert!(out.status.success(), "{readme}: {line}: {}", stderr(&out));
        }
    }
    assert!(shown >= 4, "the READMEs show their run files ({shown} commands)");
}

/// With stderr piped (not a terminal), `train` prints plain progress lines: the first and the
/// last step, complete lines, no escape codes anywhere.
#[test]
fn progress_off_a_terminal_is_plain_lines() {
    let file = run_file(
        "progress",
        "model = \"gpt2-tiny\"\ndevices = 2\nsteps = 4\nbatch = 4\nseq = 32\neval-batches = 1\n",
    );
    let out = tessera(&["train", "--config", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!out.stderr.contains(&0x1b), "escape codes on stderr: {:?}", stderr(&out));
    assert!(!out.stdout.contains(&0x1b), "escape codes on stdout");
    assert!(!out.stderr.contains(&b'\r'), "carriage returns on stderr: {:?}", stderr(&out));
    let err = stderr(&out);
    assert!(err.ends_with('\n'), "the last line is complete: {err:?}");
    let steps: Vec<&str> = err.lines().filter(|l| l.starts_with("step ")).collect();
    assert!(steps.first().is_some_and(|l| l.starts_with("step 1/4 | loss ")), "{err}");
    assert!(steps.last().is_some_and(|l| l.starts_with("step 4/4 | loss ")), "{err}");
    for line in &steps {
        let fields: Vec<&str> = line.split(" | ").collect();
        assert!(fields.len() >= 4, "{line}");
        assert!(
            fields[1].strip_prefix("loss ").is_some_and(|x| x.parse::<f64>().is_ok()),
            "{line}"
        );
        assert!(fields[2].ends_with(" tok/s"), "{line}");
        let elapsed =
            fields.last().unwrap().strip_prefix("elapsed ").and_then(|e| e.strip_suffix('s'));
        assert!(elapsed.is_some_and(|e| e.parse::<f64>().is_ok()), "{line}");
    }
}
