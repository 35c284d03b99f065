//! Each family's own data through the one training path, end to end through the binary: ViT
//! classifies the handwritten digits `scripts/setup.sh` installs (data/README.md) and `eval`
//! reports the same held-out accuracy as `train`; fine-tuning examples (JSONL, prompt and
//! completion) train alike on one device and on a plan of two.

use std::path::PathBuf;
use std::process::{Command, Output};

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(repo_root())
        .args(args)
        .output()
        .expect("tessera runs")
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-families-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

/// The data set is there: `make test` runs scripts/setup.sh first, which installs it.
fn digits() -> PathBuf {
    let path = repo_root().join("data/digits.csv");
    assert!(
        path.is_file(),
        "{} is missing: run scripts/setup.sh (or data/fetch_digits.sh)",
        path.display()
    );
    path
}

/// ViT on the digits on 2 devices: 300 steps (seconds on 2 cores) reach a held-out top-1
/// accuracy far above chance (10%), and `eval` on the saved checkpoint reports the accuracy
/// and loss `train` measured: batch 40 makes 9 full batches of the 360 held-out images, so
/// both see every one.
#[test]
fn vit_learns_the_digits_and_eval_reports_the_same_accuracy() {
    let data = digits();
    let save = temp("vit");
    let out = tessera(&[
        "train",
        "--model",
        "vit-tiny",
        "--data",
        data.to_str().unwrap(),
        "--devices",
        "2",
        "--steps",
        "300",
        "--batch",
        "40",
        "--lr",
        "2e-3",
        "--eval-batches",
        "9",
        "--save",
        save.to_str().unwrap(),
        "--format",
        "json",
    ]);
    let v = json(&out);
    let accuracy = v["eval_accuracy"].as_f64().unwrap();
    let loss = v["eval_loss"].as_f64().unwrap();
    assert!(accuracy > 0.6, "held-out top-1 accuracy {accuracy} (chance 0.1): {v}");
    assert!(loss < 0.5 * v["unigram_entropy"].as_f64().unwrap(), "{v}");

    let e = json(&tessera(&["eval", "--model-dir", save.to_str().unwrap(), "--format", "json"]));
    assert_eq!(e["examples"], 360);
    assert_eq!(e["accuracy"].as_f64().unwrap(), accuracy, "eval {e} vs train {v}");
    let eval_loss = e["loss"].as_f64().unwrap();
    assert!((eval_loss - loss).abs() < 1e-5 * loss.max(1.0), "eval {eval_loss} vs train {loss}");
    let _ = std::fs::remove_dir_all(&save);
}

/// Prompt/completion examples of unequal lengths: each row holds a different count of
/// completion tokens, so only a loss summed over the step's targets and divided by their
/// count over the whole step is the same on every plan.
fn write_examples(path: &std::path::Path) {
    let mut text = String::new();
    for i in 0..40u64 {
        let (a, b) = (i * 37 % 100, i * 53 % 1000);
        text += &serde_json::json!({"prompt": format!("{a}+{b}="), "completion": format!("{}\n", a + b)})
            .to_string();
        text += "\n";
    }
    text += &serde_json::json!({"text": "plain text records train on every token"}).to_string();
    text += "\n";
    std::fs::write(path, text).unwrap();
}

fn step_losses(log: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

/// Fine-tuning on prompt/completion examples: the same per-step losses on one device and
/// under `dp2` and `tp2` (within 1e-5), and a loss that falls.
#[test]
fn prompt_completion_examples_train_alike_on_every_plan() {
    let dir = temp("jsonl");
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("sft.jsonl");
    write_examples(&data);
    let run = |devices: &str, plan: &str| {
        let log = dir.join(format!("{devices}-{}.jsonl", plan.replace(' ', "_")));
        let out = tessera(&[
            "train",
            "--model",
            "gpt2-tiny",
            "--data",
            data.to_str().unwrap(),
            "--devices",
            devices,
            "--plan",
            plan,
            "--steps",
            "6",
            "--batch",
            "8",
            "--seq",
            "16",
            "--lr",
            "1e-4",
            "--log-json",
            log.to_str().unwrap(),
            "--format",
            "json",
        ]);
        json(&out);
        step_losses(&log)
    };
    let one = run("1", "auto");
    assert_eq!(one.len(), 6);
    assert!(one[5] < one[0], "the loss falls: {one:?}");
    for (devices, plan) in [("2", "dp2"), ("2", "tp2")] {
        let got = run(devices, plan);
        for (step, (a, b)) in got.iter().zip(&one).enumerate() {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{plan} step {}: {a} vs {b}", step + 1);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bad examples are errors naming the line and the fix.
#[test]
fn bad_examples_name_the_line() {
    let dir = temp("bad-jsonl");
    std::fs::create_dir_all(&dir).unwrap();
    let check = |name: &str, text: &str, seq: &str, want: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let out = tessera(&[
            "train",
            "--model",
            "gpt2-tiny",
            "--data",
            path.to_str().unwrap(),
            "--devices",
            "1",
            "--steps",
            "1",
            "--batch",
            "2",
            "--seq",
            seq,
        ]);
        assert!(!out.status.success(), "{name} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{name}: {err}");
    };
    let ok = "{\"text\": \"hello there\"}\n";
    check("keys.jsonl", &format!("{ok}{{\"question\": \"q\"}}\n{ok}"), "16", "line 2: expected");
    check("json.jsonl", &format!("{ok}{ok}not json\n"), "16", "line 3: not a JSON object");
    check("type.jsonl", &format!("{{\"text\": 3}}\n{ok}"), "16", "line 1: `text` must be a string");
    let long = "{\"prompt\": \"a long prompt here\", \"completion\": \"x\"}\n";
    check("long.jsonl", &format!("{ok}{long}"), "8", "line 2: the prompt is 18 tokens");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The README's fine-tuning command: `--init` a `transformers` checkpoint (the LLaMA fixture
/// of `scripts/make-hf-fixtures.sh`) with prompt/completion examples encoded by a
/// `tokenizer.json`, on one device and on `dp2 tp2`: the same losses, falling.
#[test]
fn init_fine_tunes_on_prompt_completion_examples_with_a_tokenizer() {
    let dir = temp("init-jsonl");
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("sft.jsonl");
    let mut text = String::new();
    let words = ["to", "be", "or", "not", "that", "is", "the", "question"];
    for i in 0..30 {
        let prompt: Vec<&str> = (0..1 + i % 3).map(|k| words[(i + k) % 8]).collect();
        let completion: Vec<&str> = (0..2 + i % 2).map(|k| words[(i * 3 + k) % 8]).collect();
        text +=
            &serde_json::json!({"prompt": prompt.join(" "), "completion": completion.join(" ")})
                .to_string();
        text += "\n";
    }
    std::fs::write(&data, text).unwrap();
    let root = repo_root();
    let model = root.join("crates/tessera-cli/tests/fixtures/hf/llama");
    let tokenizer = root.join("crates/tessera-runtime/tests/fixtures/wordlevel_tokenizer.json");
    let run = |devices: &str, plan: &str| {
        let log = dir.join(format!("{devices}.jsonl"));
        json(&tessera(&[
            "train",
            "--init",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--devices",
            devices,
            "--plan",
            plan,
            "--steps",
            "5",
            "--batch",
            "4",
            "--seq",
            "8",
            "--lr",
            "1e-4",
            "--log-json",
            log.to_str().unwrap(),
            "--format",
            "json",
        ]));
        step_losses(&log)
    };
    let one = run("1", "auto");
    assert!(one[4] < one[0], "{one:?}");
    let four = run("4", "dp2 tp2");
    for (step, (a, b)) in four.iter().zip(&one).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "step {}: {a} vs {b}", step + 1);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
