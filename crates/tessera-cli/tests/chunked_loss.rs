//! The chunked LM head and loss (`loss=chunkN`, `Op::LinearCrossEntropy`) in training runs:
//! the same losses as the whole logits (fp32, within 1e-6 relative per step) on one device and
//! on two thread devices (`dp2`, and `tp2 sp` against one device), each device's measured peak
//! equal to the plan's prediction in every run, and the peak the whole logits cost removed:
//! the chunked Program's peak below the whole one's by at least the logits' bytes less one
//! chunk. And `tessera train --plan "... loss=chunkN"` through the CLI.
//!
//! The models are gpt2-tiny and llama-tiny's shapes cut down (2 blocks of 64 features) with an
//! 8,192-token vocabulary, so the logits are what peaks, as they are at long sequences: at
//! the presets' 256 tokens the peak lies elsewhere and the chunking moves nothing.

use crate::support;

use std::process::Command;
use support::{assert_losses, Measured, Run};
use tessera_plan::plan::Plan;
use tessera_plan::planner::Executable;
use tessera_plan::PlanError;

const STEPS: u64 = 3;
const BATCH: usize = 8;
const SEQ: usize = 64;
const SEED: u64 = 7;
const CHUNK: usize = 24; // does not divide a device's 512 (or 256) rows
const VOCAB: u64 = 8192;

/// A small causal LM with a large vocabulary, written as a Hugging Face config.json (so the
/// CLI reads it too); returns its path.
fn model(family: &str) -> String {
    let j = match family {
        "gpt2" => serde_json::json!({
            "model_type": "gpt2", "vocab_size": VOCAB, "n_positions": 64, "n_embd": 64,
            "n_layer": 2, "n_head": 4, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0
        }),
        _ => serde_json::json!({
            "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": false
        }),
    };
    support::write_model("chunked-loss", family, &j)
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

/// A whole and a chunked plan of one config: equal losses, measured == predicted peaks, and
/// the peak of the whole logits gone.
fn whole_vs_chunked(model: &str, devices: usize, config: &str) {
    let (wp, we) = plan(model, devices, &format!("{config} loss=whole")).unwrap();
    let (cp, ce) = plan(model, devices, &format!("{config} loss=chunk{CHUNK}")).unwrap();
    assert_eq!(wp.loss_chunk_rows, None);
    assert_eq!(cp.loss_chunk_rows, Some(CHUNK));
    assert!(cp.config.ends_with(&format!("loss=chunk{CHUNK}")), "{}", cp.config);
    let (wl, wpeaks) = run(model, &we);
    let (cl, cpeaks) = run(model, &ce);
    assert_losses(&cl, &wl, 1e-6, &format!("{model} `{config}` chunked vs whole"));
    for (plan, peaks) in [(&wp, &wpeaks), (&cp, &cpeaks)] {
        assert_eq!(&plan.predicted.peak_bytes_per_device, peaks, "{model} `{}`", plan.config);
    }
    // One device's logits, in f32, and one chunk of them.
    let rows = (BATCH * SEQ / devices) as u64;
    let (logits, chunk) = (rows * VOCAB * 4, CHUNK as u64 * VOCAB * 4);
    let removed = wp.predicted.peak_bytes_per_device[0] - cp.predicted.peak_bytes_per_device[0];
    // At least the logits less one chunk of them; at most the logits and their gradient,
    // which the whole loss's backward holds together.
    assert!(
        removed >= logits - chunk && removed <= 2 * logits,
        "{model} `{config}`: the chunked loss removes {removed} B of peak; the logits are \
         {logits} B, one chunk of them {chunk} B"
    );
}

#[test]
fn gpt2_chunked_loss_matches_whole_logits_on_one_and_two_devices() {
    let m = model("gpt2");
    whole_vs_chunked(&m, 1, "dp1");
    whole_vs_chunked(&m, 2, "dp2");
}

#[test]
fn llama_chunked_loss_matches_whole_logits_on_one_and_two_devices() {
    let m = model("llama");
    whole_vs_chunked(&m, 1, "dp1");
    whole_vs_chunked(&m, 2, "dp2");
}

/// Under `tp2 sp` the chunked op splits its rows over the tensor axis (the sequence) where the
/// whole logits would be vocabulary-parallel: both within 1e-5 of one device (the collectives
/// sum in another order), measured peaks as predicted.
#[test]
fn tensor_parallel_chunked_loss_matches_one_device() {
    let m = model("llama");
    let (_, one) = plan(&m, 1, "dp1 loss=whole").unwrap();
    let (reference, _) = run(&m, &one);
    for config in ["tp2 sp loss=whole", "tp2 sp loss=chunk24"] {
        let (p, exe) = plan(&m, 2, config).unwrap();
        let (losses, peaks) = run(&m, &exe);
        assert_losses(&losses, &reference, 1e-5, config);
        assert_eq!(p.predicted.peak_bytes_per_device, peaks, "{config}");
    }
}

fn tessera(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("tessera runs")
}

/// `tessera train --plan "... loss=chunkN"`: the plan reaches the run — data-parallel and
/// pipelined (the fused op on the last stage) — whose losses are the whole logits' and whose
/// measured peaks are the prediction, the highest of them lower.
#[test]
fn train_cli_runs_the_chunked_loss() {
    let m = model("gpt2");
    let train = |plan: &str| -> serde_json::Value {
        let out = tessera(&[
            "train",
            "--model",
            &m,
            "--devices",
            "2",
            "--steps",
            "2",
            "--batch",
            "8",
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
    for base in ["dp2", "pp2 mb2"] {
        let whole = train(&format!("{base} loss=whole"));
        let chunked = train(&format!("{base} loss=chunk40"));
        let config = chunked["config"].as_str().unwrap();
        assert!(config.ends_with("loss=chunk40"), "{config}");
        for v in [&whole, &chunked] {
            assert_eq!(v["memory"]["predicted_peak_bytes"], v["memory"]["measured_peak_bytes"]);
        }
        for key in ["initial_loss", "final_loss"] {
            let (c, w) = (chunked[key].as_f64().unwrap(), whole[key].as_f64().unwrap());
            assert!((c - w).abs() <= 1e-6 * w.abs(), "`{base}` {key}: {c} vs {w}");
        }
        let peak = |v: &serde_json::Value| {
            let p = v["memory"]["predicted_peak_bytes"].as_array().unwrap();
            p.iter().map(|x| x.as_u64().unwrap()).max().unwrap()
        };
        assert!(peak(&chunked) < peak(&whole), "`{base}`: {} vs {}", peak(&chunked), peak(&whole));
    }
}
