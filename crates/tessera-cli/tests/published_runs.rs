//! The cost model against reality: every published, measured run in
//! `scripts/published-runs.tsv` (sources named there and in BENCHMARKS.md), evaluated with
//! `tessera plan --plan CONFIG` (and the row's further flags, such as a mixture of experts'
//! `--capacity-factor`), must be predicted within 20% of its measured step time — 25% for a
//! long-context run (sequence at least 32768: issue 44's bound) and for a mixture of experts
//! (issue 45's bound, asked of the model config, not its name). The mean absolute error over the
//! runs held to 20% — issue 20's runs, dense and short — must be at most 10% (issue 20's rule, as
//! before the wider bounds); the long-context and MoE runs, each within 25%, are not averaged in
//! (their own mean is printed): mixing them in would let the wider bound loosen issue 20's.
//!
//! Misses are not averaged in, and do not pass silently: the published runs the model misses by
//! more than their bound, or that the planner refuses (a memory miss), sit in
//! `scripts/published-runs-outside.tsv`, each with the reason in its source column, and are checked
//! to be misses still — a run the model comes to predict within its bound fails
//! `runs_listed_outside_the_bound_are_still_outside_it` until it moves to the held set (where it
//! counts in the mean). So the mean is over the runs the model claims, and every run it does not
//! claim is listed, reasoned and re-checked.

use std::process::Command;

use tessera_models::ModelConfig;

const RUNS: &str = include_str!("../../../scripts/published-runs.tsv");
const OUTSIDE: &str = include_str!("../../../scripts/published-runs-outside.tsv");

/// The shortest sequence issue 44 counts as long context.
const LONG_CONTEXT_SEQ: u64 = 32768;

/// The relative error a run is held to: issue 20's 20%, or 25% at long context (issue 44) and for
/// a mixture of experts (issue 45).
fn bound(seq: u64, moe: bool) -> f64 {
    if seq >= LONG_CONTEXT_SEQ || moe {
        0.25
    } else {
        0.20
    }
}

/// The data rows of a TSV, split into their tab-separated columns (10 of them: run, model,
/// cluster, batch, seq, dtype, config, flags, measured step (s), source).
fn rows(tsv: &str) -> Vec<Vec<&str>> {
    let lines = tsv.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty());
    lines
        .map(|line| {
            let f: Vec<&str> = line.split('\t').collect();
            assert_eq!(f.len(), 10, "malformed line (10 tab-separated columns): {line}");
            f
        })
        .collect()
}

/// A row's model: a preset, or a config.json path relative to the repository root.
fn model_config(run: &str, model: &str) -> ModelConfig {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(model);
    let resolved = match ModelConfig::preset(model) {
        Ok(cfg) => Ok(cfg),
        Err(_) => ModelConfig::resolve(&path.to_string_lossy()),
    };
    resolved.unwrap_or_else(|e| panic!("{run}: {model} is neither a preset nor a config file: {e}"))
}

/// The model argument `tessera plan` takes for a row (a config path made absolute: the test
/// runs in the crate's directory).
fn model_arg(model: &str) -> String {
    if ModelConfig::preset(model).is_ok() {
        return model.to_string();
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.join(model).to_string_lossy().into_owned()
}

/// One run of a TSV, evaluated.
struct Run {
    name: String,
    /// Its bound (`bound`).
    bound: f64,
    measured: f64,
    /// The predicted step time, or the planner's refusal.
    predicted: Result<f64, String>,
    /// The source column, where an outside run states its reason.
    source: String,
}

/// Each run of a TSV with its measured and predicted step times. Columns: run, model, cluster,
/// batch, seq, dtype, config, flags (`-`: none; else whitespace-separated `tessera plan` flags),
/// measured step (s), source.
fn evaluate(tsv: &str) -> Vec<Run> {
    let mut out = Vec::new();
    for f in rows(tsv) {
        let (run, model, cluster, batch, seq, dtype, config, flags) =
            (f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]);
        let measured: f64 = f[8].parse().expect("measured step time");
        let seq_len: u64 = seq.parse().expect("sequence length");
        let moe = model_config(run, model).is_moe();
        let extra: Vec<&str> =
            if flags == "-" { Vec::new() } else { flags.split_whitespace().collect() };
        let model = model_arg(model);
        let output = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["plan", "--model", &model, "--cluster", cluster, "--batch", batch, "--seq", seq])
            .args(["--dtype", dtype, "--plan", config])
            .args(&extra)
            .args(["--format", "json"])
            .output()
            .unwrap();
        let predicted = if output.status.success() {
            let v: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
            Ok(v["predicted"]["step_time_s"].as_f64().unwrap())
        } else {
            Err(String::from_utf8_lossy(&output.stderr).into_owned())
        };
        out.push(Run {
            name: run.to_string(),
            bound: bound(seq_len, moe),
            measured,
            predicted,
            source: f[9].to_string(),
        });
    }
    out
}

#[test]
fn the_bound_is_wider_only_for_long_context_and_mixtures_of_experts() {
    // The MoE bound follows the model config: a Mixtral and a dense Llama of the same shape.
    assert!(ModelConfig::preset("mixtral-8x7b").unwrap().is_moe());
    assert!(!ModelConfig::preset("llama3-8b").unwrap().is_moe());
    assert_eq!(bound(4096, false), 0.20);
    assert_eq!(bound(4096, true), 0.25);
    assert_eq!(bound(32767, false), 0.20);
    assert_eq!(bound(32768, false), 0.25);
}

#[test]
fn long_context_and_moe_runs_are_listed_held_or_missed() {
    // Issues 44 and 45: at least two measured long-context runs and two MoE runs, each within
    // 25% (published-runs.tsv) or listed as a miss with its reason (published-runs-outside.tsv).
    // Counted without the planner; the other tests check which file each belongs in.
    let (mut long, mut moe) = (0, 0);
    for f in rows(RUNS).into_iter().chain(rows(OUTSIDE)) {
        let seq: u64 = f[4].parse().expect("sequence length");
        long += usize::from(seq >= LONG_CONTEXT_SEQ);
        moe += usize::from(model_config(f[0], f[1]).is_moe());
    }
    assert!(long >= 2, "issue 44 asks for two long-context runs, found {long}");
    assert!(moe >= 2, "issue 45 asks for two MoE runs, found {moe}");
}

#[test]
fn predicted_step_time_is_within_the_bound_of_published_runs() {
    let runs = evaluate(RUNS);
    // Absolute errors of issue 20's runs (bound 20%) and of the long-context and MoE runs.
    let (mut narrow, mut wide) = (Vec::new(), Vec::new());
    let mut report = String::new();
    for Run { name: run, bound, measured, predicted, .. } in &runs {
        let predicted =
            predicted.as_ref().unwrap_or_else(|e| panic!("{run}: refused by the planner: {e}"));
        let error = predicted / measured - 1.0;
        report += &format!(
            "{run}: measured {measured} s, predicted {predicted:.3} s ({:+.1}%, bound {:.0}%)\n",
            100.0 * error,
            100.0 * bound
        );
        assert!(
            error.abs() <= *bound,
            "{run}: predicted {predicted:.3} s vs measured {measured} s, over the {:.0}% bound\n{report}",
            100.0 * bound
        );
        if *bound > 0.20 { &mut wide } else { &mut narrow }.push(error.abs());
    }
    let checked = narrow.len();
    assert!(checked >= 12, "issue 20 asks for at least twelve published runs, found {checked}");
    let mean = |e: &[f64]| e.iter().sum::<f64>() / e.len().max(1) as f64;
    let mae = mean(&narrow);
    assert!(mae <= 0.10, "mean absolute error {:.1}% is over 10%\n{report}", 100.0 * mae);
    println!(
        "{report}mean absolute error {:.1}% over issue 20's {checked} runs; {:.1}% over the {} \
         long-context and MoE runs (each within 25%)",
        100.0 * mae,
        100.0 * mean(&wide),
        wide.len()
    );
}

#[test]
fn runs_listed_outside_the_bound_are_still_outside_it() {
    let runs = evaluate(OUTSIDE);
    assert!(!runs.is_empty(), "published-runs-outside.tsv lists no runs");
    for Run { name: run, bound, measured, predicted, source } in runs {
        assert!(
            source.len() > 40 && source.contains("→"),
            "{run}: an outside run quotes its figure and derivation and states its reason"
        );
        // A memory refusal is a miss (the row's source column quotes it); any other refusal is a
        // broken row (a config the planner cannot read), not a miss.
        let predicted = match predicted {
            Ok(t) => t,
            Err(e) if e.contains("no plan fits") => continue,
            Err(e) => panic!("{run}: refused by the planner, not for memory: {e}"),
        };
        let error = predicted / measured - 1.0;
        assert!(
            error.abs() > bound,
            "{run}: predicted {predicted:.3} s vs measured {measured} s ({:+.1}%) is within the \
             {:.0}% bound now: move it to scripts/published-runs.tsv (an FP8 run only once FP8 \
             is priced)",
            100.0 * error,
            100.0 * bound
        );
    }
}
