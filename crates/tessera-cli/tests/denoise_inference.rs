//! `tessera profile --inference` of a diffusers UNet (one denoising step's forward): with
//! `--quantize int8` every linear weight counts at one byte per element plus one f32 scale per
//! output channel and everything else at the model's dtype, as counted independently from the
//! diffusers checkpoint's tensors; and the quantised step, run by the runtime, peaks at exactly
//! the bytes the profile predicts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{DType as CDType, Device, Tensor};
use tessera_ir::{DType, Tier};
use tessera_models::{ModelConfig, Quantize};
use tessera_runtime::{CpuBackend, Executor};

fn tiny_sd2() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/diffusers_unet/tiny_sd2")
}

fn profile(extra: &[&str]) -> serde_json::Value {
    let config = tiny_sd2().join("config.json");
    let mut args = vec!["profile", "--inference", "--model", config.to_str().unwrap()];
    args.extend(["--batch", "2", "--seq", "5", "--dtype", "bf16", "--format", "json"]);
    args.extend(extra);
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(&args).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON report")
}

/// Bytes of the checkpoint's tensors held as the profile should hold them: in bf16, or, with
/// `int8`, each rank-2 `.weight` (diffusers' linears) as int8 codes plus an f32 scale a row.
fn checkpoint_bytes(int8: bool) -> u64 {
    let path = tiny_sd2().join("diffusion_pytorch_model.safetensors");
    let tensors: HashMap<String, Tensor> = candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    tensors
        .iter()
        .map(|(name, t)| match t.dims() {
            [n, k] if int8 && name.ends_with(".weight") => (n * k + 4 * n) as u64,
            _ => 2 * t.elem_count() as u64,
        })
        .sum()
}

#[test]
fn int8_profile_holds_the_linears_in_int8() {
    let float = profile(&[]);
    let int8 = profile(&["--quantize", "int8"]);
    let w = |r: &serde_json::Value| r["memory"]["weights_bytes"].as_u64().unwrap();
    assert_eq!(w(&float), checkpoint_bytes(false), "bf16 weights: {float}");
    assert_eq!(w(&int8), checkpoint_bytes(true), "int8 weights: {int8}");
    assert_eq!(int8["quantized_weights"], 58, "every linear of the tiny UNet: {int8}");
    let peak = |r: &serde_json::Value| r["memory"]["peak_bytes"].as_u64().unwrap();
    assert!(peak(&int8) < peak(&float), "int8 {} vs bf16 {}", peak(&int8), peak(&float));
}

/// Zeros of `meta`'s shape and dtype (u8 codes, f32 scales, float weights and inputs).
fn zeros(meta: &tessera_ir::TensorMeta) -> Tensor {
    let dtype = match meta.dtype {
        DType::U8 => CDType::U8,
        DType::I64 => CDType::I64,
        DType::BF16 => CDType::BF16,
        _ => CDType::F32,
    };
    Tensor::zeros(meta.shape.dims(), dtype, &Device::Cpu).unwrap()
}

#[test]
fn int8_denoising_step_peaks_as_profiled() {
    let cfg = ModelConfig::from_path(&tiny_sd2()).unwrap();
    for quantize in [None, Some(Quantize::Int8)] {
        let step =
            tessera_cli::denoise_infer::denoise_step(&cfg, 2, 5, DType::F32, quantize).unwrap();
        let predicted = tessera_profile::simulate_memory(&step.program).report.peak_bytes;
        let program = step.program.clone();
        let g = program.graph();
        let mut exec = Executor::new(step.program, CpuBackend::new(0), None);
        for &t in &program.live_in {
            exec.bind(t, zeros(g.meta(t))).unwrap();
        }
        exec.run().unwrap_or_else(|e| panic!("{quantize:?}: {e}"));
        assert!(exec.get(step.output).is_some(), "the output is kept");
        let measured = exec.tier_accountant(Tier::Device).peak_bytes();
        assert_eq!(measured, predicted, "{quantize:?}: measured vs profiled peak");
    }
}
