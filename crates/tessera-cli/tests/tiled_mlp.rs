//! The tiled MLP (`mlp=tileN`, `Op::TiledMlp`) in training runs: the same losses as the whole
//! MLP (fp32, within 1e-6 relative per step) on one device, under `ckpt=full`, under `dp2
//! zero1` and under `tp2 sp` (the ffn features split, as Megatron's MLP), each device's
//! measured peak equal to the plan's prediction in every run, and the peak the whole MLP's
//! `[rows, ffn]` intermediates cost removed. And `tessera train --plan "... mlp=tileN"`
//! through the CLI.
//!
//! The models are gpt2-tiny and llama-tiny's shapes cut down (2 blocks of 64 features) with an
//! 8× wide MLP (512 ffn features) and a small vocabulary, so the MLP's intermediates are what
//! peaks, as they are at long sequences.

use crate::support;

use std::process::Command;
use support::{assert_losses, Measured, Run};
use tessera_plan::plan::Plan;
use tessera_plan::planner::Executable;
use tessera_plan::PlanError;

const STEPS: u64 = 3;
const BATCH: usize = 4;
const SEQ: usize = 64;
const SEED: u64 = 11;
const TILE: usize = 24; // does not divide a device's 256 (or 128) rows
const FFN: u64 = 512;

/// A small causal LM with a wide MLP, written as a Hugging Face config.json (so the CLI reads
/// it too); returns its path.
fn model(family: &str) -> String {
    let j = match family {
        "gpt2" => serde_json::json!({
            "model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 64,
            "n_inner": FFN, "n_layer": 2, "n_head": 4, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
            "attn_pdrop": 0.0
        }),
        _ => serde_json::json!({
            "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": FFN, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": false
        }),
    };
    support::write_model("tiled-mlp", family, &j)
}

/// The runs' shape.
const RUN: Run =
    Run { batch: BATCH, seq: SEQ, steps: STEPS, seed: SEED, tokens: 256, host_memory: None };

fn plan(model: &str, devices: usize, config: &str) -> Result<(Plan, Executable), PlanError> {
    RUN.plan(model, devices, config)
}

/// Per-step losses and each device's measured peak of a plan run on thread devices.
fn run(model: &str, exe: &Executable) -> (Vec<f64>, Vec<u64>) {
    let Measured { losses, peaks, .. } = RUN.train(model, exe);
    (losses, peaks)
}

/// A whole and a tiled plan of one config: equal losses, measured == predicted peaks, and at
/// least `removed_ffn` whole `[rows, ffn]` f32 intermediates (one device's rows, its share of
/// the features) of peak gone.
fn whole_vs_tiled(model: &str, devices: usize, config: &str, split: [u64; 2], removed_ffn: u64) {
    let (wp, we) = plan(model, devices, &format!("{config} mlp=whole")).unwrap();
    let (tp, te) = plan(model, devices, &format!("{config} mlp=tile{TILE}")).unwrap();
    assert_eq!(wp.mlp_tile_rows, None);
    assert_eq!(tp.mlp_tile_rows, Some(TILE));
    assert!(tp.config.ends_with(&format!("mlp=tile{TILE}")), "{}", tp.config);
    let (wl, wpeaks) = run(model, &we);
    let (tl, tpeaks) = run(model, &te);
    assert_losses(&tl, &wl, 1e-6, &format!("{model} `{config}` tiled vs whole"));
    for (plan, peaks) in [(&wp, &wpeaks), (&tp, &tpeaks)] {
        assert_eq!(&plan.predicted.peak_bytes_per_device, peaks, "{model} `{}`", plan.config);
    }
    let [rows_split, ffn_split] = split;
    let one = (BATCH * SEQ) as u64 / rows_split * FFN / ffn_split * 4;
    let removed = wpeaks[0] as i64 - tpeaks[0] as i64;
    assert!(
        removed >= (removed_ffn * one) as i64,
        "{model} `{config}`: tiling removes {removed} B of peak; one [rows, ffn] intermediate \
         is {one} B"
    );
}

#[test]
fn llama_tiled_mlp_matches_whole_on_one_device_and_checkpointed() {
    let m = model("llama");
    whole_vs_tiled(&m, 1, "dp1 ckpt=none", [1, 1], 6);
    whole_vs_tiled(&m, 1, "dp1 ckpt=full", [1, 1], 3);
}

#[test]
fn gpt2_tiled_mlp_matches_whole_on_one_device() {
    whole_vs_tiled(&model("gpt2"), 1, "dp1 ckpt=none", [1, 1], 4);
}

/// Data parallel with ZeRO (rows split, weight gradients reduced) and tensor parallel with
/// `sp` (the ffn features split, the output a pending sum reduce-scattered over the sequence).
#[test]
fn tiled_mlp_composes_with_dp_zero_and_tp() {
    let m = model("llama");
    whole_vs_tiled(&m, 2, "dp2 zero1 ckpt=none", [2, 1], 6);
    whole_vs_tiled(&m, 2, "tp2 sp ckpt=none", [1, 2], 6);
}

fn tessera(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("tessera runs")
}

/// `tessera train --plan "... mlp=tileN"`: the plan reaches the run, whose losses are the
/// whole MLP's and whose measured peaks are the prediction, the highest of them lower.
#[test]
fn train_cli_runs_the_tiled_mlp() {
    let m = model("gpt2");
    let train = |plan: &str| -> serde_json::Value {
        let out = tessera(&[
            "train",
            "--model",
            &m,
            "--devices",
            "1",
            "--steps",
            "2",
            "--batch",
            "4",
            "--seq",
            "64",
            "--plan",
            plan,
            "--format",
            "json",
        ]);
        assert!(out.status.success(), "{plan}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("stdout is JSON")
    };
    let whole = train("dp1 ckpt=none mlp=whole");
    let tiled = train("dp1 ckpt=none mlp=tile40");
    let config = tiled["config"].as_str().unwrap();
    assert!(config.ends_with("mlp=tile40"), "{config}");
    for v in [&whole, &tiled] {
        assert_eq!(v["memory"]["predicted_peak_bytes"], v["memory"]["measured_peak_bytes"]);
    }
    for key in ["initial_loss", "final_loss"] {
        let (t, w) = (tiled[key].as_f64().unwrap(), whole[key].as_f64().unwrap());
        assert!((t - w).abs() <= 1e-6 * w.abs(), "{key}: {t} vs {w}");
    }
    let peak = |v: &serde_json::Value| {
        let p = v["memory"]["predicted_peak_bytes"].as_array().unwrap();
        p.iter().map(|x| x.as_u64().unwrap()).max().unwrap()
    };
    assert!(peak(&tiled) < peak(&whole), "{} vs {}", peak(&tiled), peak(&whole));
}
