//! A README that cannot rot (issue 20): every command in README.md's code blocks is run here,
//! in order, in one scratch directory (so a block's `--save ck` is the next line's `--resume
//! ck`), or is named in [`COVERED`] with the test that runs it. A command that is neither
//! fails this test, so a new README command needs a test before it lands.
//!
//! What runs here runs as written, but for three things, all mechanical:
//! - `tessera` and `cargo run --release --bin tessera --` are this build's binary;
//! - training is shortened: step counts (`--steps`, `--stop-after`) are divided by ten (at
//!   least 2), `--steps 8` is added where a `train` gives none (its default is 150) and
//!   `--eval-batches 1` where it names none (the default is 8), so the suite stays short;
//!   everything a command says about checkpoints, plans, devices, data and the evaluation
//!   still happens;
//! - placeholders ([`PLACEHOLDERS`]) become files: a Hugging Face `config.json` fixture, an
//!   ONNX fixture, diffusers UNet fixtures, a text file and an offload directory; the repository's `data/` is linked into the scratch
//!   directory.
//!
//! A command whose README comment says it fails ([`FAILS`]) must fail with the message named.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Commands run elsewhere: a prefix of the README command → the test file and function that
/// runs it (checked to exist), or what else covers it.
const COVERED: &[(&str, &str, &str)] = &[
    ("make demo", "", "`make demo` runs `tessera train`, which runs here"),
    ("make test", "", ".ci/run runs exactly this command"),
    (
        "cargo build --release --features mpi && mpirun",
        "mpi_train.rs",
        "mpi_runs_equal_threads_and_one_device",
    ),
    (
        "tessera train --init hf-dir --data sft.jsonl",
        "families.rs",
        "init_fine_tunes_on_prompt_completion_examples_with_a_tokenizer",
    ),
    (
        "tessera train --init hf-dir --data tokens",
        "hf_parity.rs",
        "init_fine_tunes_a_transformers_checkpoint_on_any_plan",
    ),
    (
        "tessera calibrate --device cuda",
        "calibrate.rs",
        "calibrate_on_cuda_measures_or_names_the_missing_driver",
    ),
    ("tessera calibrate", "calibrate.rs", "calibrate_writes_a_cpu_preset_the_planner_reads"),
    (
        "cargo build --release --features tessera-cli/cuda",
        "",
        "`make test` builds and tests with this feature",
    ),
    (
        "tessera train --device cuda",
        "cuda_cli.rs",
        "train_on_cuda_trains_or_names_the_missing_driver",
    ),
    (
        "tessera generate --device cuda",
        "cuda_cli.rs",
        "generate_on_cuda_gives_transformers_tokens_or_names_what_is_missing",
    ),
    ("tessera train --config", "run_file.rs", "the_readme_run_file_commands_run"),
    ("tessera plan --config", "run_file.rs", "the_readme_run_file_commands_run"),
];

/// README placeholders and what stands for them here.
const PLACEHOLDERS: &[(&str, &str)] = &[
    ("path/to/config.json", "crates/tessera-cli/tests/fixtures/hf/llama/config.json"),
    ("my.txt", "my.txt"),
    ("/mnt/nvme/tessera", "nvme-dir"),
    ("my-model.onnx", "crates/tessera-cli/tests/fixtures/onnx/llama/model.onnx"),
    (
        "path/to/unet/config.json",
        "crates/tessera-cli/tests/fixtures/diffusers_unet/sd2/config.json",
    ),
    ("path/to/tiny-unet", "crates/tessera-cli/tests/fixtures/diffusers_unet/tiny_sd2"),
    (
        "path/to/tiny-unet-inputs.safetensors",
        "crates/tessera-cli/tests/fixtures/diffusers_unet/tiny_sd2/inputs.safetensors",
    ),
];

/// Commands the README says fail, and a fragment of the error they must print.
const FAILS: &[(&str, &str)] = &[("--memory-budget 50MiB", "no plan fits")];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The README's commands: code-block lines starting with a command, continuation lines joined,
/// trailing `# comments` dropped.
fn readme_commands() -> Vec<String> {
    let text = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let mut out = Vec::new();
    let mut in_block = false;
    let mut pending = String::new();
    for line in text.lines() {
        if line.starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if !in_block {
            continue;
        }
        let line = strip_comment(line);
        let starts = ["tessera ", "cargo ", "make ", "mpirun "].iter().any(|p| line.starts_with(p));
        if pending.is_empty() && !starts {
            continue;
        }
        let (body, continues) = match line.trim_end().strip_suffix('\\') {
            Some(b) => (b.trim_end(), true),
            None => (line.trim_end(), false),
        };
        if !pending.is_empty() {
            pending.push(' ');
        }
        pending += body.trim_start();
        if !continues {
            out.push(std::mem::take(&mut pending));
        }
    }
    out
}

/// The line without a `#` comment outside double quotes.
fn strip_comment(line: &str) -> &str {
    let mut quoted = false;
    for (i, c) in line.char_indices() {
        match c {
            '"' => quoted = !quoted,
            '#' if !quoted => return line[..i].trim_end(),
            _ => {}
        }
    }
    line
}

/// Splits a command into words (double quotes group).
fn words(cmd: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in cmd.chars() {
        match c {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            _ => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The binary's arguments for one README command (`None`: not a `tessera` command).
fn tessera_args(cmd: &str) -> Option<Vec<String>> {
    let rest = cmd
        .strip_prefix("cargo run --release --bin tessera -- ")
        .or_else(|| cmd.strip_prefix("tessera "))?;
    let mut args = words(rest);
    for a in args.iter_mut() {
        if let Some((_, to)) = PLACEHOLDERS.iter().find(|(from, _)| a == from) {
            *a = if to.contains('/') {
                repo_root().join(to).to_string_lossy().into_owned()
            } else {
                (*to).to_string()
            };
        }
    }
    if args.first().is_some_and(|a| a == "train") {
        shorten(&mut args);
    }
    Some(args)
}

/// Step counts divided by ten (at least 2); `--steps 8` where none is given (the README's
/// `--stop-after 50`, cut to 5, stays inside the run); one held-out batch instead of the
/// default eight where none is named (the evaluation runs, at an eighth of the cost: eight
/// batches of the README's `--model gpt2` cost more than its two training steps).
fn shorten(args: &mut Vec<String>) {
    let mut has_steps = false;
    for i in 0..args.len().saturating_sub(1) {
        if args[i] == "--steps" || args[i] == "--stop-after" {
            has_steps |= args[i] == "--steps";
            let n: u64 = args[i + 1].parse().expect("a step count");
            args[i + 1] = (n / 10).max(2).to_string();
        }
    }
    if !has_steps {
        args.extend(["--steps".to_string(), "8".to_string()]);
    }
    if !args.iter().any(|a| a == "--eval-batches") {
        args.extend(["--eval-batches".to_string(), "1".to_string()]);
    }
}

#[test]
fn every_readme_command_runs_or_names_its_test() {
    let dir = std::env::temp_dir().join(format!("tessera-readme-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Enough text for a held-out batch of 8 × 128 tokens.
    let text: String =
        (0..3000).map(|i| format!("line {i}: the quick brown fox jumps. ")).collect();
    std::fs::write(dir.join("my.txt"), text).unwrap();
    // An NVMe directory for offloaded state.
    std::fs::create_dir_all(dir.join("nvme-dir")).unwrap();
    // The README runs from the repository root: its data (the digits `scripts/setup.sh`
    // installs) is seen from the scratch directory too.
    std::os::unix::fs::symlink(repo_root().join("data"), dir.join("data")).unwrap();
    let commands = readme_commands();
    assert!(commands.len() > 30, "the README's commands were not found: {commands:?}");
    let mut ran = 0;
    for cmd in &commands {
        if let Some((_, file, test)) = COVERED.iter().find(|(p, _, _)| cmd.starts_with(p)) {
            if !file.is_empty() {
                let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join(file);
                let source = std::fs::read_to_string(&path).unwrap();
                assert!(source.contains(&format!("fn {test}()")), "{file} has no test {test}");
            }
            continue;
        }
        // `A && B`: each in turn.
        for part in cmd.split(" && ") {
            let args = tessera_args(part.trim()).unwrap_or_else(|| {
                panic!("README command `{cmd}` neither runs here nor names its test in COVERED")
            });
            let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
                .args(&args)
                .current_dir(&dir)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            match FAILS.iter().find(|(needle, _)| part.contains(needle)) {
                Some((_, message)) => {
                    assert!(!out.status.success(), "`{part}` should fail, as the README says");
                    assert!(err.contains(message), "`{part}`: {err}");
                    assert!(!err.contains("panicked"), "`{part}`: {err}");
                }
                None => assert!(out.status.success(), "README command `{part}` ({args:?}): {err}"),
            }
            ran += 1;
        }
    }
    assert!(ran > 20, "only {ran} README commands ran");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The parser finds what the README shows: continuation lines joined, comments dropped.
#[test]
fn readme_commands_are_parsed_whole() {
    let cmds = readme_commands();
    let joined =
        cmds.iter().find(|c| c.contains("--out plan.json &&")).expect("the joined command");
    assert!(joined.ends_with("tessera train --plan plan.json"), "{joined}");
    assert!(cmds.iter().all(|c| !c.contains(" # ") && !c.ends_with('\\')), "{cmds:?}");
}
