//! The cost model against reality: every published, measured run in
//! `scripts/published-runs.tsv` (sources named there and in BENCHMARKS.md), evaluated with
//! `tessera plan --plan CONFIG`, must be predicted within 20% of its measured step time (25% for
//! a long-context run, sequence at least 32768: issue 44's bound), and the mean absolute error over
//! all of them must be at most 10% (issue 20). The published runs it misses by more, or that the
//! planner refuses (a memory miss), sit in `scripts/published-runs-outside.tsv`, and are checked to
//! be misses still: a run the model comes to predict within the bound moves to the held set.

use std::process::Command;

const RUNS: &str = include_str!("../../../scripts/published-runs.tsv");
const OUTSIDE: &str = include_str!("../../../scripts/published-runs-outside.tsv");

/// The shortest sequence issue 44 counts as long context.
const LONG_CONTEXT_SEQ: u64 = 32768;

/// The relative error a run is held to: issue 20's 20%, or issue 44's 25% at long context.
fn bound(seq: u64) -> f64 {
    if seq >= LONG_CONTEXT_SEQ {
        0.25
    } else {
        0.20
    }
}

/// One run of a TSV, evaluated.
struct Run {
    name: String,
    seq: u64,
    measured: f64,
    /// The predicted step time, or the planner's refusal.
    predicted: Result<f64, String>,
}

/// Each run of a TSV with its measured and predicted step times.
fn evaluate(tsv: &str) -> Vec<Run> {
    let mut out = Vec::new();
    for line in tsv.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let f: Vec<&str> = line.split('\t').collect();
        assert_eq!(f.len(), 9, "malformed line: {line}");
        let (run, model, cluster, batch, seq, dtype, config) =
            (f[0], f[1], f[2], f[3], f[4], f[5], f[6]);
        let measured: f64 = f[7].parse().expect("measured step time");
        let seq_len: u64 = seq.parse().expect("sequence length");
        let output = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["plan", "--model", model, "--cluster", cluster, "--batch", batch, "--seq", seq])
            .args(["--dtype", dtype, "--plan", config, "--format", "json"])
            .output()
            .unwrap();
        let predicted = if output.status.success() {
            let v: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
            Ok(v["predicted"]["step_time_s"].as_f64().unwrap())
        } else {
            Err(String::from_utf8_lossy(&output.stderr).into_owned())
        };
        out.push(Run { name: run.to_string(), seq: seq_len, measured, predicted });
    }
    out
}

#[test]
fn predicted_step_time_is_within_the_bound_of_published_runs() {
    let mut checked = 0;
    let mut abs_errors = 0.0;
    let mut report = String::new();
    for Run { name: run, seq, measured, predicted } in evaluate(RUNS) {
        let predicted = predicted.unwrap_or_else(|e| panic!("{run}: refused by the planner: {e}"));
        let error = predicted / measured - 1.0;
        report += &format!(
            "{run}: measured {measured} s, predicted {predicted:.3} s ({:+.1}%)\n",
            100.0 * error
        );
        assert!(
            error.abs() <= bound(seq),
            "{run}: predicted {predicted:.3} s vs measured {measured} s, over the {:.0}% bound\n{report}",
            100.0 * bound(seq)
        );
        checked += 1;
        abs_errors += error.abs();
    }
    assert!(checked >= 12, "the issue asks for at least twelve published runs, found {checked}");
    let mae = abs_errors / checked as f64;
    assert!(mae <= 0.10, "mean absolute error {:.1}% is over 10%\n{report}", 100.0 * mae);
    println!("{report}");
}

#[test]
fn runs_listed_outside_the_bound_are_still_outside_it() {
    let runs = evaluate(OUTSIDE);
    assert!(!runs.is_empty(), "published-runs-outside.tsv lists no runs");
    for Run { name: run, seq, measured, predicted } in runs {
        // A memory refusal is a miss (the row's source column quotes it); any other refusal is a
        // broken row (a config the planner cannot read), not a miss.
        let predicted = match predicted {
            Ok(t) => t,
            Err(e) if e.contains("no plan fits") => continue,
            Err(e) => panic!("{run}: refused by the planner, not for memory: {e}"),
        };
        let error = predicted / measured - 1.0;
        assert!(
            error.abs() > bound(seq),
            "{run}: predicted {predicted:.3} s vs measured {measured} s ({:+.1}%) is within the \
             {:.0}% bound now: move it to scripts/published-runs.tsv (an FP8 run only once FP8 \
             is priced)",
            100.0 * error,
            100.0 * bound(seq)
        );
    }
}
