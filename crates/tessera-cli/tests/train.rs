//! The runtime against the profiler and against reality: the accountant's peak equals the
//! Program's predicted peak exactly, the process heap follows it, a model really learns, and
//! bad data or budgets are clear errors.

use std::path::PathBuf;
use std::process::{Command, Output};
use tessera_ir::{build_training_graph, DType, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_profile::simulate_memory;
use tessera_runtime::{CpuBackend, LrSchedule, Trainer};

fn trainer(model: &str, batch: usize, seq: usize, budget: Option<u64>) -> Trainer<CpuBackend> {
    trainer_in(model, batch, seq, budget, DType::F32)
}

fn trainer_in(
    model: &str,
    batch: usize,
    seq: usize,
    budget: Option<u64>,
    dtype: DType,
) -> Trainer<CpuBackend> {
    let cfg = ModelConfig::resolve(model).expect("model");
    let fm = build(&cfg, &BuildOptions { batch, seq, dtype }).expect("builds");
    let tg = build_training_graph(fm.builder, fm.loss, &TrainConfig::default()).expect("graph");
    Trainer::single(tg, CpuBackend::new(0), LrSchedule::Constant { lr: 1e-3 }, 7, budget)
        .expect("trainer")
}

/// Deterministic pseudo-random token batch.
fn tokens(n: usize, vocab: u64, salt: u64) -> Vec<i64> {
    (0..n as u64)
        .map(|i| ((i.wrapping_mul(2654435761) ^ salt.wrapping_mul(40503)) % vocab) as i64)
        .collect()
}

#[test]
fn accountant_peak_equals_the_profilers_prediction_exactly() {
    for (model, dtype) in
        [("gpt2-tiny", DType::F32), ("llama-tiny", DType::F32), ("gpt2-tiny", DType::BF16)]
    {
        for (batch, seq) in [(1, 16), (3, 40), (2, 128)] {
            let mut t = trainer_in(model, batch, seq, None, dtype);
            let predicted = simulate_memory(t.program()).report.peak_bytes;
            for step in 0..2 {
                let x = tokens(batch * seq, 256, step);
                let y = tokens(batch * seq, 256, step + 100);
                let stats = t.step(&x, &y).expect("step");
                assert_eq!(
                    stats.peak_bytes, predicted,
                    "{model} {dtype} b{batch} s{seq} step {step}: measured {} vs predicted {predicted}",
                    stats.peak_bytes
                );
            }
        }
    }
}

#[test]
fn a_budget_below_the_peak_is_a_clear_error_naming_the_tensor() {
    let probe = trainer("gpt2-tiny", 2, 32, None);
    let predicted = simulate_memory(probe.program()).report.peak_bytes;
    drop(probe);
    // Exactly the predicted peak fits ...
    let mut ok = trainer("gpt2-tiny", 2, 32, Some(predicted));
    ok.step(&tokens(64, 256, 1), &tokens(64, 256, 2)).expect("fits exactly");
    // ... one byte less does not.
    let mut t = trainer("gpt2-tiny", 2, 32, Some(predicted - 1));
    let err = t.step(&tokens(64, 256, 1), &tokens(64, 256, 2)).expect_err("must not fit");
    let msg = err.to_string();
    assert!(msg.contains("out of memory") && msg.contains(&(predicted - 1).to_string()), "{msg}");
    assert!(msg.contains("transformer"), "names the scope: {msg}");
}

#[test]
fn learns_a_repetitive_text_beyond_any_unigram_model() {
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(40);
    let bytes: Vec<i64> = text.bytes().map(i64::from).collect();
    // Byte-unigram entropy of the text: the best loss a model ignoring context can reach.
    let mut counts = [0f64; 256];
    for &b in &bytes {
        counts[b as usize] += 1.0;
    }
    let n = bytes.len() as f64;
    let unigram: f64 = counts.iter().filter(|&&c| c > 0.0).map(|&c| -(c / n) * (c / n).ln()).sum();

    let (batch, seq) = (4, 32);
    let cfg = ModelConfig::resolve("gpt2-tiny").unwrap();
    let fm = build(&cfg, &BuildOptions { batch, seq, dtype: DType::F32 }).unwrap();
    let tg = build_training_graph(fm.builder, fm.loss, &TrainConfig::default()).unwrap();
    let schedule = LrSchedule::WarmupCosine { peak: 3e-3, min_lr: 3e-4, warmup: 10, total: 150 };
    let mut t = Trainer::single(tg, CpuBackend::new(0), schedule, 1, None).unwrap();
    let mut last = f64::INFINITY;
    for step in 0..150u64 {
        let mut x = Vec::with_capacity(batch * seq);
        let mut y = Vec::with_capacity(batch * seq);
        for row in 0..batch as u64 {
            let off = ((step * 7919 + row * 104729) % (bytes.len() - seq - 1) as u64) as usize;
            x.extend_from_slice(&bytes[off..off + seq]);
            y.extend_from_slice(&bytes[off + 1..off + seq + 1]);
        }
        last = t.step(&x, &y).unwrap().loss;
    }
    assert!(last < 0.5 * unigram, "final loss {last:.4} vs unigram entropy {unigram:.4}");
}

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("tessera runs")
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-train-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn train_json_log_and_heap_follow_the_prediction() {
    let log = temp("log").join("steps.jsonl");
    let out = tessera(&[
        "train",
        "--devices",
        "1",
        "--steps",
        "3",
        "--batch",
        "8",
        "--seq",
        "256",
        "--format",
        "json",
        "--log-json",
        log.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    // stderr is not a terminal here: the run still leaves progress lines (the first step, the
    // last, and one every few seconds between).
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("step 1/3 | loss") && err.contains("step 3/3 | loss"), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    for key in ["initial_loss", "final_loss", "eval_loss", "steps", "tokens_per_s"] {
        assert!(v[key].is_number(), "{key}: {}", v[key]);
    }
    let predicted = v["memory"]["predicted_peak_bytes"][0].as_u64().unwrap();
    let measured = v["memory"]["measured_peak_bytes"][0].as_u64().unwrap();
    assert_eq!(predicted, measured);
    let heap = v["memory"]["heap_peak_bytes"].as_u64().unwrap() as f64;
    let err = (heap - predicted as f64).abs() / predicted as f64;
    assert!(err < 0.10, "heap peak {heap} vs predicted {predicted}: {:.1}% off", err * 100.0);
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["step"].as_u64(), Some(i as u64 + 1));
        assert!(r["loss"].is_number() && r["grad_norm"].is_number());
    }
}

/// Runs `train` expecting one clear error line.
fn train_error(args: &[&str]) -> String {
    let mut all = vec!["train", "--devices", "1", "--steps", "1"];
    all.extend_from_slice(args);
    let out = tessera(&all);
    assert!(!out.status.success(), "should fail: {args:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(!err.contains("panicked"), "panic: {err}");
    let last = err.lines().last().unwrap_or("").to_string();
    assert!(last.starts_with("error: "), "{err}");
    last
}

#[test]
fn bad_data_and_budgets_are_clear_errors() {
    let dir = temp("bad");
    let e = train_error(&["--data", dir.join("missing.txt").to_str().unwrap()]);
    assert!(e.contains("missing.txt"), "{e}");

    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let e = train_error(&["--data", empty.to_str().unwrap()]);
    assert!(e.contains("empty"), "{e}");

    let short = dir.join("short.txt");
    std::fs::write(&short, "just a few words, far fewer than one sequence").unwrap();
    let e = train_error(&["--data", short.to_str().unwrap(), "--seq", "128"]);
    assert!(e.contains("128") || e.contains("129"), "{e}");

    // Enough text to train on, but a held-out split (the last 10%: 200 bytes) too small for
    // one evaluation batch: refused before the first step, not after the training.
    let small = dir.join("small.txt");
    std::fs::write(&small, "abcdefghij".repeat(200)).unwrap();
    let mut all = vec!["train", "--devices", "1", "--steps", "1", "--data"];
    all.extend([small.to_str().unwrap(), "--seq", "64", "--batch", "16"]);
    let out = tessera(&all);
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(!out.status.success() && !err.contains("step 1/1"), "{err}");
    assert!(err.contains("held-out evaluation") && err.contains("--eval-batches 0"), "{err}");

    // `--save` that cannot happen is refused before step 1 (issue 17: it failed when the first
    // save was due, after the training): onto an existing file, or under one.
    let file = dir.join("a-file");
    std::fs::write(&file, "keep me").unwrap();
    for (save, want) in
        [(file.clone(), "not a Tessera checkpoint"), (file.join("ck"), "cannot create")]
    {
        let mut all = vec!["train", "--devices", "1", "--steps", "1", "--save"];
        all.push(save.to_str().unwrap());
        let out = tessera(&all);
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(!out.status.success() && !err.contains("step 1/1"), "{err}");
        assert!(err.contains("--save") && err.contains(want), "{err}");
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");

    // A nanoGPT u16 token file with an id beyond gpt2-tiny's 256-entry vocabulary.
    let bin = dir.join("tokens.bin");
    let ids: Vec<u8> = (0..4000u16).flat_map(|i| (i % 300).to_le_bytes()).collect();
    std::fs::write(&bin, ids).unwrap();
    let e = train_error(&["--data", bin.to_str().unwrap(), "--seq", "32"]);
    assert!(e.contains("256") && e.contains("300") || e.contains("256"), "{e}");

    // A budget below what any plan needs (recomputation included) names the minimum before
    // any step: one device is planned like any other.
    let e = train_error(&["--memory-budget", "1MiB"]);
    assert!(e.contains("the least any plan needs is") && e.contains("on 1 device;"), "{e}");
    assert!(e.contains("1.00 MiB"), "{e}");
}

/// Per-step losses of gpt2-tiny on the shipped corpus.
fn loss_curve(dtype: DType, steps: u64) -> Vec<f64> {
    let text = include_str!("../../../data/shakespeare.txt");
    let data =
        tessera_runtime::data::Dataset::from_text(text, &tessera_runtime::data::Tokenizer::Byte)
            .unwrap();
    let (batch, seq) = (4, 32);
    let cfg = ModelConfig::resolve("gpt2-tiny").unwrap();
    let fm = build(&cfg, &BuildOptions { batch, seq, dtype }).unwrap();
    let tg = build_training_graph(fm.builder, fm.loss, &TrainConfig::default()).unwrap();
    // With warmup, as `tessera train` runs it: without, Adam's first full-size steps spike
    // the loss and the two runs' trajectories decorrelate.
    let schedule = LrSchedule::WarmupCosine { peak: 1e-3, min_lr: 1e-4, warmup: 20, total: steps };
    let mut t = Trainer::single(tg, CpuBackend::new(0), schedule, 7, None).unwrap();
    (1..=steps)
        .map(|step| {
            let b = data.train_batch(3, step, batch, seq).unwrap();
            t.step(&b.inputs, &b.targets).unwrap().loss
        })
        .collect()
}

#[test]
fn bf16_mixed_precision_tracks_the_fp32_loss_curve() {
    let steps = 200;
    let fp32 = loss_curve(DType::F32, steps);
    let bf16 = loss_curve(DType::BF16, steps);
    // Single steps are noisy in both precisions: compare 10-step means (measured: ≤ 0.7%).
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let gaps: Vec<f64> = fp32
        .chunks(10)
        .zip(bf16.chunks(10))
        .map(|(a, b)| (mean(b) - mean(a)).abs() / mean(a))
        .collect();
    let worst = gaps.iter().copied().fold(0.0, f64::max);
    assert!(worst < 0.02, "bf16 strays {:.2}% from fp32; 10-step gaps {gaps:.3?}", worst * 100.0);
    assert!(fp32[steps as usize - 1] < fp32[0] * 0.6, "the run must actually learn");
}

/// The learning rate a `--log-json` file records for `step`.
fn straight_lr(path: &std::path::Path, step: u64) -> f64 {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["step"].as_u64() == Some(step))
        .and_then(|v| v["lr"].as_f64())
        .unwrap()
}

fn losses(path: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

#[test]
fn resume_is_bit_exact_with_the_cosine_schedule() {
    let dir = temp("resume");
    let ck = dir.join("ckpt");
    let common = [
        "train",
        "--devices",
        "1",
        "--steps",
        "30",
        "--batch",
        "2",
        "--seq",
        "32",
        "--warmup",
        "5",
    ];
    let run = |extra: &[&str], log: &str| {
        let mut args = common.to_vec();
        args.extend_from_slice(extra);
        let log = dir.join(log);
        args.extend_from_slice(&["--log-json", log.to_str().unwrap(), "--format", "json"]);
        let out = tessera(&args);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        losses(&log)
    };
    let straight = run(&[], "straight.jsonl");
    let first = run(&["--stop-after", "20", "--save", ck.to_str().unwrap()], "first.jsonl");
    let second = run(&["--resume", ck.to_str().unwrap()], "second.jsonl");
    assert_eq!(first.len(), 20);
    assert_eq!(second.len(), 10);
    let resumed: Vec<f64> = first.into_iter().chain(second).collect();
    // Bit for bit: same batches (keyed by seed and step), same schedule position, same state.
    assert_eq!(resumed, straight);

    // A larger --steps extends the run: the steps before the save are the same, the schedule
    // re-spreads its decay over the new horizon from the saved step, and the run says so.
    let ext_log = dir.join("extended.jsonl");
    let mut args = common.to_vec();
    args[4] = "40";
    args.extend_from_slice(&["--resume", ck.to_str().unwrap(), "--format", "json"]);
    args.extend_from_slice(&["--log-json", ext_log.to_str().unwrap()]);
    let out = tessera(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--steps 30") && err.contains("step 40"), "says so: {err}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["resumed"]["from_step"], 20, "{doc}");
    assert_eq!(doc["last_step"], 40);
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&ext_log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 20);
    // The extended schedule: warmup 5 and peak 1e-3 as saved, cosine to 1e-4 at step 40.
    let want = LrSchedule::WarmupCosine { peak: 1e-3, min_lr: 1e-4, warmup: 5, total: 40 };
    for r in &rows {
        let step = r["step"].as_u64().unwrap();
        let lr = r["lr"].as_f64().unwrap();
        assert!((lr - want.lr_at(step)).abs() < 1e-12, "step {step}: lr {lr}");
    }
    // The first extended step is the saved run's step 21 in all but the learning rate.
    assert!(rows[0]["lr"].as_f64().unwrap() > straight_lr(&dir.join("straight.jsonl"), 21));

    // Resuming with other data settings is refused with a clear message.
    let out = tessera(&[
        "train",
        "--devices",
        "1",
        "--steps",
        "30",
        "--batch",
        "4",
        "--seq",
        "32",
        "--resume",
        ck.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("\"batch\":2") && !err.contains("panicked"), "{err}");

    // Another learning rate, or other data, is refused (issue 17: both were silently taken).
    let refused = |extra: &[&str]| {
        let mut args = common.to_vec();
        args.extend_from_slice(&["--resume", ck.to_str().unwrap()]);
        args.extend_from_slice(extra);
        let out = tessera(&args);
        assert!(!out.status.success(), "{extra:?} was accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refused(&["--lr", "3e-3"]);
    assert!(err.contains("--lr 0.003 differs") && err.contains("--lr 0.001"), "{err}");
    let other = dir.join("other.txt");
    std::fs::write(&other, "other words entirely. ".repeat(400)).unwrap();
    let err = refused(&["--data", other.to_str().unwrap()]);
    assert!(err.contains("the training data differs"), "{err}");
}

/// BERT learns its own objective: masked-LM on a repetitive text (where both sides of a masked
/// byte predict it) ends below what any model ignoring context can reach — the text's byte
/// unigram entropy, which the report carries. (On the shipped corpus BERT's masked-LM learns
/// slowly: BENCHMARKS.md.)
#[test]
fn bert_masked_lm_learns_from_context() {
    let dir = temp("mlm");
    let data = dir.join("text.txt");
    std::fs::write(&data, "the quick brown fox jumps over the lazy dog. ".repeat(200)).unwrap();
    let out = tessera(&[
        "train",
        "--model",
        "bert-tiny",
        "--data",
        data.to_str().unwrap(),
        "--devices",
        "1",
        "--steps",
        "300",
        "--batch",
        "8",
        "--seq",
        "64",
        "--lr",
        "1e-3",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (eval, unigram) =
        (v["eval_loss"].as_f64().unwrap(), v["unigram_entropy"].as_f64().unwrap());
    assert!(v["initial_loss"].as_f64().unwrap() > 5.0, "starts near ln 260: {v}");
    assert!(eval < 0.95 * unigram, "held-out masked-LM loss {eval:.4} vs unigram {unigram:.4}");
}
