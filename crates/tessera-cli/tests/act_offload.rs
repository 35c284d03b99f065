//! Activation offload (`offload=act`): the input each fully checkpointed block keeps rests in
//! host memory between the passes. Against the same plan without it, on a small llama (6
//! blocks of 32 features, 8 × 128 tokens, fp32): the same losses (the copies are exact), the device peak
//! lower by the kept inputs it moves, and each device's measured device and host peaks equal
//! to the Program's prediction — on one device and under `dp2 mb2` on two thread devices
//! and `cp2` (against one device's losses), and beside model-state offload
//! (`offload=act+opt`). And
//! `tessera plan --explain` names it; the exports refuse it.

use crate::support;

use std::process::Command;
use support::{assert_losses, Measured, Run};
use tessera_plan::plan::Plan;
use tessera_plan::planner::Executable;
use tessera_plan::PlanError;

const STEPS: u64 = 2;
const BATCH: usize = 8;
const SEQ: usize = 128;
const HIDDEN: u64 = 32;
const BLOCKS: u64 = 6;
const SEED: u64 = 11;

/// A small llama as a Hugging Face config.json (narrow and deep, on long enough sequences that
/// the blocks' inputs, not the model state or the logits, decide the peak); returns its path.
fn model() -> String {
    let j = serde_json::json!({
        "model_type": "llama", "vocab_size": 64, "hidden_size": HIDDEN,
        "intermediate_size": 64, "num_hidden_layers": BLOCKS, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": SEQ, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": false
    });
    support::write_model("act-offload", "llama", &j)
}

/// The runs' shape (the host holds 1 GiB per device).
const RUN: Run = Run {
    batch: BATCH,
    seq: SEQ,
    steps: STEPS,
    seed: SEED,
    tokens: 64,
    host_memory: Some(1 << 30),
};

fn plan(model: &str, devices: usize, config: &str) -> Result<(Plan, Executable), PlanError> {
    RUN.plan(model, devices, config)
}

fn run(model: &str, exe: &Executable) -> Measured {
    RUN.train(model, exe)
}

/// `config` with and without `offload=act`: losses within `tol` of `reference` (and of each
/// other, exactly: the copies change no value), measured == predicted on the device and the
/// host, and the device peak lower by at least `min_inputs` blocks' inputs. Returns the offloaded plan.
fn with_and_without(
    m: &str,
    devices: usize,
    config: &str,
    reference: &[f64],
    tol: f64,
    min_inputs: u64,
) -> Plan {
    let (kp, ke) = plan(m, devices, config).unwrap();
    let (op, oe) = plan(m, devices, &format!("{config} offload=act")).unwrap();
    assert!(op.config.ends_with("offload=act"), "{}", op.config);
    let o = op.offload.as_ref().expect("the plan records its offload");
    assert!(o.act && o.chunks_offloaded == 0, "{o:?}");
    let (kr, or) = (run(m, &ke), run(m, &oe));
    assert_losses(&kr.losses, reference, tol, &format!("`{config}`"));
    assert_eq!(or.losses, kr.losses, "`{config}`: activation offload changes no value");
    for (p, e, r) in [(&kp, &ke, &kr), (&op, &oe, &or)] {
        assert_eq!(p.predicted.peak_bytes_per_device, r.peaks, "`{}`: device peaks", p.config);
        let host = vec![e.lowered.memory.host_peak_bytes; r.peaks.len()];
        assert_eq!(host, r.host_peaks, "`{}`: host peaks", p.config);
    }
    assert!(kr.host_peaks.iter().all(|&h| h == 0), "without offload the host holds nothing");
    // The kept inputs of the blocks checkpointed in full rest on the host: one device's share
    // of a block's input (f32 [rows, hidden]) per block and micro-batch, moved in one step.
    let mb = kp.micro_batches as u64;
    let input = (BATCH * SEQ / devices) as u64 / mb * HIDDEN * 4;
    assert_eq!(o.act_tensors_per_step, BLOCKS * mb, "{o:?}");
    assert_eq!(o.act_bytes_per_step, BLOCKS * mb * input, "{o:?}");
    assert_eq!(or.host_peaks[0], BLOCKS * input, "one micro-batch's inputs rest on the host");
    // The device no longer holds them between the passes: without it the peak (in the
    // backward pass) holds every block's input as a saved activation, with it none — the
    // peak moves later in the backward pass, where gradients have grown, so it falls by the
    // inputs less that growth, still at least `min_inputs` blocks' inputs here.
    let saved = |p: &Plan| p.predicted.peak_breakdown["saved_activations"];
    assert_eq!(saved(&kp), BLOCKS * input, "`{config}`: every input kept at the peak");
    assert_eq!(saved(&op), 0, "`{config}`: no input kept on the device at the peak");
    let (before, after) = (kr.peaks[0], or.peaks[0]);
    eprintln!("`{config}`: device peak {before} B -> {after} B with offload=act");
    assert!(
        before >= after + min_inputs * input,
        "`{config}`: activation offload removes {} B of device peak; each block's input is \
         {input} B",
        before as i64 - after as i64
    );
    op
}

#[test]
fn activation_offload_trains_exactly_and_peaks_as_predicted() {
    let m = model();
    let (_, one) = plan(&m, 1, "dp1 ckpt=full").unwrap();
    let reference = run(&m, &one).losses;
    with_and_without(&m, 1, "dp1 ckpt=full", &reference, 0.0, 2);
    with_and_without(&m, 2, "dp2 mb2 ckpt=full", &reference, 1e-6, 2);
    // Context parallelism: each device keeps (and moves) its half of every block's input.
    with_and_without(&m, 2, "cp2 ckpt=full", &reference, 1e-5, 1);
    // Beside model-state offload (the host runs AdamW for the chunks it holds).
    let config = "dp1 ckpt=full offload=act+opt";
    let (p, e) = plan(&m, 1, config).unwrap();
    let r = run(&m, &e);
    assert_losses(&r.losses, &reference, 1e-6, config);
    assert_eq!(p.predicted.peak_bytes_per_device, r.peaks, "{config}: device peaks");
    assert_eq!(r.host_peaks, vec![e.lowered.memory.host_peak_bytes], "{config}: host peaks");
    let input = (BATCH * SEQ) as u64 * HIDDEN * 4;
    assert!(r.host_peaks[0] > BLOCKS * input, "{config}: inputs and state on the host");
}

/// `tessera plan --explain` with `offload=act` says what moves; a composed config parses and
/// prints back canonically; every export refuses it by name.
#[test]
fn explain_names_activation_offload() {
    let m = model();
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["plan", "--model", &m, "--cluster", "1xcpu", "--batch", "8", "--seq", "128"])
        .args(["--plan", "dp1 ckpt=full offload=act+opt", "--host-memory", "1GiB", "--explain"])
        .output()
        .expect("tessera runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("offload=act+opt"), "{text}");
    let moved = format!("activations: {BLOCKS} kept block inputs");
    assert!(text.contains(&moved), "{text}");
    let out_dir = tempfile::tempdir().unwrap();
    for engine in ["deepspeed", "megatron", "torchtitan"] {
        let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["plan", "--model", &m, "--cluster", "1xcpu", "--batch", "8", "--seq", "128"])
            .args(["--plan", "dp1 ckpt=full offload=act", "--host-memory", "1GiB"])
            .args(["--export", engine, "--out"])
            .arg(out_dir.path().join(engine))
            .output()
            .expect("tessera runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{engine}: exported activation offload");
        assert!(err.contains("`offload=act`: activation offload"), "{engine}: {err}");
    }
}
