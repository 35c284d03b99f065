//! Random values and garbage for the numeric flags, and random argv-ish token lists, through
//! the parser and the commands (issue 43): `profile` and `plan` in-process through
//! [`tessera_cli::json_report`] (the binary's code under `--format json`), and a handful of
//! binary runs of `train` and `generate` with bad flags. Whatever comes in: no panic, and a
//! failure is an error object with a kind and a non-empty message.

use proptest::prelude::*;
use serde_json::Value;
use std::process::Command;

/// Values a numeric flag may be given: garbage, signs, non-finite, huge, and a few sane ones.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("nan".to_string()),
        Just("inf".to_string()),
        Just("-inf".to_string()),
        Just("1e20".to_string()),
        Just("1e-300".to_string()),
        Just("-5".to_string()),
        Just("0".to_string()),
        Just("".to_string()),
        Just("18446744073709551616".to_string()),
        Just("99999999999".to_string()),
        Just("1,,2".to_string()),
        Just("--".to_string()),
        Just("0x10".to_string()),
        (-1_000_000_i64..1_000_000).prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| f.to_string()),
        "[ -~]{0,12}",
    ]
}

/// A report or an error object with a kind and a non-empty message; never a panic.
fn check(args: &[String]) -> Result<(), TestCaseError> {
    match tessera_cli::json_report(args) {
        Ok(v) => prop_assert!(v.is_object(), "{args:?}: {v}"),
        Err(e) => {
            prop_assert!(!e.message.trim().is_empty(), "{args:?}: empty message");
            let kind = e.error["kind"].as_str().unwrap_or_default();
            prop_assert!(
                ["usage", "invalid", "infeasible", "internal", "failed"].contains(&kind),
                "{args:?}: {}",
                e.error
            );
            prop_assert_eq!(e.error["message"].as_str(), Some(e.message.as_str()));
        }
    }
    Ok(())
}

/// `profile`'s flags, each with a random value, on a tiny model (symbolic: no tensor is made).
fn profile_args() -> impl Strategy<Value = Vec<String>> {
    let flag = prop::sample::select(vec!["--batch", "--seq", "--new-tokens"]);
    (prop::collection::vec((flag, value()), 1..4), any::<bool>()).prop_map(|(flags, infer)| {
        let mut a: Vec<String> = ["profile", "--model", "gpt2-tiny"].map(String::from).to_vec();
        if infer {
            a.push("--inference".into());
        }
        // gpt2-tiny's 256 positions hold a prompt of 32 and the default 128 new tokens.
        if !flags.iter().any(|(f, _)| *f == "--seq") {
            a.extend(["--seq", "32"].map(String::from));
        }
        for (f, v) in flags {
            a.push(f.to_string());
            a.push(v);
        }
        a
    })
}

/// `plan`'s numeric and size flags with random values: every value but the sane ones is
/// refused before the search, and the sane ones plan a tiny model on a small cluster.
fn plan_args() -> impl Strategy<Value = Vec<String>> {
    let flag = prop::sample::select(vec![
        "--batch",
        "--seq",
        "--memory-budget",
        "--reserve",
        "--host-memory",
        "--cluster",
    ]);
    prop::collection::vec((flag, value()), 1..3).prop_map(|flags| {
        let mut a: Vec<String> =
            ["plan", "--model", "gpt2-tiny", "--plan", "dp2"].map(String::from).to_vec();
        // The defaults of a small run, where the case does not give the flag.
        for (f, v) in [("--cluster", "2xH100"), ("--batch", "4"), ("--seq", "32")] {
            if !flags.iter().any(|(g, _)| *g == f) {
                a.extend([f, v].map(String::from));
            }
        }
        for (f, v) in flags {
            // A value beyond the sane range would make a real plan slow, not wrong: keep the
            // numbers that do parse small.
            let v = match v.parse::<u64>() {
                Ok(n) if n > 64 && (f == "--batch" || f == "--seq") => n.to_string() + "x",
                _ => v,
            };
            let v = if f == "--cluster" { format!("{v}xH100") } else { v };
            a.push(f.to_string());
            a.push(v);
        }
        a
    })
}

/// Argv-ish token lists: subcommand and flag names, values and garbage in any order.
fn token_lists() -> impl Strategy<Value = Vec<String>> {
    let token = prop_oneof![
        prop::sample::select(vec![
            "profile",
            "plan",
            "--batch",
            "--seq",
            "--model",
            "gpt2-tiny",
            "--dtype",
            "bf16",
            "--inference",
            "--format",
            "json",
            "--help-me",
            "-x",
            "--",
            "=",
            "--batch=",
            "--seq=-1",
        ])
        .prop_map(String::from),
        value(),
    ];
    (prop::sample::select(vec!["profile", "plan"]), prop::collection::vec(token, 0..6)).prop_map(
        |(cmd, rest)| {
            let mut a = vec![cmd.to_string()];
            // Keep `plan` on the tiny model (the default is GPT-2 on 8 H100s).
            if cmd == "plan" {
                a.extend(["--model", "gpt2-tiny", "--batch", "4", "--seq", "32"].map(String::from));
                a.extend(["--plan", "dp1", "--cluster", "1xH100"].map(String::from));
            }
            a.extend(rest.into_iter().filter(|t| t != "--batch" && t != "--seq"));
            a
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn profile_flags_never_panic(args in profile_args()) {
        check(&args)?;
    }

    #[test]
    fn plan_flags_never_panic(args in plan_args()) {
        check(&args)?;
    }

    #[test]
    fn token_lists_never_panic(args in token_lists()) {
        check(&args)?;
    }
}

/// The binary, for the commands the library does not report: bad values for `train` and
/// `generate` end with exit status 2 and, under `--format json`, one usage error object.
#[test]
fn train_and_generate_refuse_bad_flags_as_json() {
    let bin = env!("CARGO_BIN_EXE_tessera");
    let cases: [&[&str]; 8] = [
        &["train", "--lr", "1e999"],
        &["train", "--batch", "nan"],
        &["train", "--warmup", "1.5"],
        &["train", "--eval-batches", "-1"],
        &["train", "--loss-scale-window", "0"],
        &["generate", "--model-dir", "x", "--seed", "1e3"],
        &["generate", "--model-dir", "x", "--devices", "65537"],
        &["generate", "--model-dir", "x", "--temperature", "inf"],
    ];
    for args in cases {
        let out = Command::new(bin).args(args).args(["--format", "json"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        let v: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e})"));
        assert_eq!(v["error"]["kind"], "usage", "{args:?}: {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    }
}

/// The runs the cases above edit plan and profile as given, so that an edited value reaches
/// the commands' own checks and not only the parser's.
#[test]
fn the_fuzzed_runs_start_from_ones_that_succeed() {
    let plan = ["plan", "--model", "gpt2-tiny", "--plan", "dp2", "--cluster", "2xH100"];
    let plan = [&plan[..], &["--batch", "4", "--seq", "32"]].concat();
    let v = tessera_cli::json_report(plan).expect("the base plan");
    assert_eq!(v["devices"], 2, "{v}");
    let v =
        tessera_cli::json_report(["profile", "--model", "gpt2-tiny", "--inference", "--seq", "32"]);
    assert!(v.expect("the base profile").is_object());
}
