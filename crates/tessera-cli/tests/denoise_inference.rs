//! `tessera profile --inference` of a diffusers UNet (one denoising step's forward): with
//! `--quantize int8` every linear and convolution weight counts at one byte per element plus
//! one f32 scale per output channel and everything else at the model's dtype, as counted independently from the
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
/// `int8`, each rank-2 and rank-4 `.weight` (diffusers' linears and convolutions) as int8
/// codes plus an f32 scale per output channel.
fn checkpoint_bytes(int8: bool) -> u64 {
    let path = tiny_sd2().join("diffusion_pytorch_model.safetensors");
    let tensors: HashMap<String, Tensor> = candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    tensors
        .iter()
        .map(|(name, t)| match t.dims() {
            [n, k] if int8 && name.ends_with(".weight") => (n * k + 4 * n) as u64,
            [o, i, kh, kw] if int8 && name.ends_with(".weight") => (o * i * kh * kw + 4 * o) as u64,
            _ => 2 * t.elem_count() as u64,
        })
        .sum()
}

/// The checkpoint's linear and convolution weights (rank-2 and rank-4 `.weight` tensors).
fn quantizable_weights() -> u64 {
    let path = tiny_sd2().join("diffusion_pytorch_model.safetensors");
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let n = tensors.iter().filter(|(k, t)| k.ends_with(".weight") && matches!(t.rank(), 2 | 4));
    n.count() as u64
}

#[test]
fn int8_profile_holds_the_linears_and_convolutions_in_int8() {
    let float = profile(&[]);
    let int8 = profile(&["--quantize", "int8"]);
    let w = |r: &serde_json::Value| r["memory"]["weights_bytes"].as_u64().unwrap();
    assert_eq!(w(&float), checkpoint_bytes(false), "bf16 weights: {float}");
    assert_eq!(w(&int8), checkpoint_bytes(true), "int8 weights: {int8}");
    assert_eq!(
        int8["quantized_weights"].as_u64(),
        Some(quantizable_weights()),
        "every linear and convolution of the tiny UNet: {int8}"
    );
    let peak = |r: &serde_json::Value| r["memory"]["peak_bytes"].as_u64().unwrap();
    assert!(peak(&int8) < peak(&float), "int8 {} vs bf16 {}", peak(&int8), peak(&float));
}

/// A live-in tensor of the step: the checkpoint's weight of that name (its int8 codes or
/// scales where the Program holds them quantised: `<name>` as u8 codes `[O, K]`,
/// `<name>_scale`), else a fixed pseudo-random input of its shape and dtype.
fn bind(meta: &tessera_ir::TensorMeta, name: &str, weights: &HashMap<String, Tensor>) -> Tensor {
    let salt: usize = name.bytes().map(usize::from).sum();
    let int8 = |source: &str| {
        let w = &weights[source];
        let o = w.dims()[0];
        let w = w.to_dtype(CDType::F32).unwrap().reshape((o, w.elem_count() / o)).unwrap();
        let spec = tessera_ir::QuantSpec { bits: 8, group: w.dims()[1] };
        tessera_runtime::quantize::quantize(&w, spec).unwrap()
    };
    let to = |t: Tensor| match meta.dtype {
        DType::BF16 => t.to_dtype(CDType::BF16).unwrap(),
        _ => t,
    };
    if meta.dtype == DType::U8 {
        return int8(name).0;
    }
    if let Some(source) = name.strip_suffix("_scale").filter(|s| weights.contains_key(*s)) {
        return int8(source).1;
    }
    if let Some(w) = weights.get(name) {
        return to(w.to_dtype(CDType::F32).unwrap());
    }
    if meta.dtype == DType::I64 {
        return Tensor::full(500i64, meta.shape.dims(), &Device::Cpu).unwrap();
    }
    let n = meta.shape.numel() as usize;
    let v: Vec<f32> =
        (0..n).map(|i| (((i * 7919 + salt * 104729) % 2003) as f32 / 1001.5) - 1.0).collect();
    to(Tensor::from_vec(v, meta.shape.dims(), &Device::Cpu).unwrap())
}

/// One denoising step of the tiny UNet from its checkpoint, float and with int8 linears and
/// convolutions: the runtime's peak equals the profiled peak for both, and the int8 step's
/// output is the float step's within int8's rounding (per-channel codes of 255 levels), but
/// not equal to it (the weights did go through int8).
#[test]
fn int8_denoising_step_peaks_as_profiled_and_stays_near_the_float_output() {
    let cfg = ModelConfig::from_path(&tiny_sd2()).unwrap();
    let path = tiny_sd2().join("diffusion_pytorch_model.safetensors");
    let weights = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let mut outputs = Vec::new();
    for quantize in [None, Some(Quantize::Int8)] {
        let step =
            tessera_cli::denoise_infer::denoise_step(&cfg, 2, 5, DType::F32, quantize).unwrap();
        let predicted = tessera_profile::simulate_memory(&step.program).report.peak_bytes;
        let program = step.program.clone();
        let g = program.graph();
        let mut exec = Executor::new(step.program, CpuBackend::new(0), None);
        for &t in &program.live_in {
            exec.bind(t, bind(g.meta(t), g.tensor_scope(t), &weights)).unwrap();
        }
        exec.run().unwrap_or_else(|e| panic!("{quantize:?}: {e}"));
        let out = exec.get(step.output).expect("the output is kept").clone();
        let measured = exec.tier_accountant(Tier::Device).peak_bytes();
        assert_eq!(measured, predicted, "{quantize:?}: measured vs profiled peak");
        outputs.push(out.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    let (f, q) = (&outputs[0], &outputs[1]);
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let diff: Vec<f32> = f.iter().zip(q).map(|(a, b)| a - b).collect();
    let rel = norm(&diff) / norm(f);
    assert!(norm(f) > 0.0 && rel > 0.0 && rel < 2e-2, "int8 vs float output: relative {rel:.3e}");
}
