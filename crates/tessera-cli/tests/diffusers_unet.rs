//! diffusers' `UNet2DConditionModel` against diffusers itself
//! (fixtures/diffusers_unet/, written by scripts/make-diffusion-fixtures.sh): the parameter
//! counts of the real SD 1.5 and SD 2 configs, and on two tiny checkpoints saved by
//! `save_pretrained` (SD 2's style: linear projections, a head count per block; SD 1.5's: conv
//! projections, one head count) the prediction and every parameter's gradient of the MSE loss,
//! run by the runtime's CPU executor on the checkpoint's weights.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tessera_ir::{gradients, DType, Program, TensorId};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_runtime::hf_weights::load_hf_weights;
use tessera_runtime::tensor::to_f64_vec;
use tessera_runtime::{CpuBackend, Executor};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/diffusers_unet")
}

fn counts() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("parameter_counts.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn stable_diffusion_unet_parameter_counts_match_diffusers() {
    let counts = counts();
    for name in ["sd15", "sd2", "tiny_sd15", "tiny_sd2"] {
        let cfg = ModelConfig::from_path(&fixtures().join(name)).unwrap();
        assert_eq!(cfg.family(), "unet");
        let want = counts[name].as_u64().unwrap();
        assert_eq!(cfg.num_parameters(), want, "{name}");
    }
}

/// The tensors of a safetensors file, as f64 values and shapes by name.
fn read(path: &Path) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let tensors = candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap();
    tensors.into_iter().map(|(n, t)| (n, (t.dims().to_vec(), to_f64_vec(&t).unwrap()))).collect()
}

/// Max |got − want| over `want`'s largest magnitude (at least 1).
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1f64, |m, x| m.max(x.abs()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max) / scale
}

fn parity(name: &str) {
    let dir = fixtures().join(name);
    let cfg = ModelConfig::from_path(&dir).unwrap();
    let inputs = read(&dir.join("inputs.safetensors"));
    let outputs = read(&dir.join("outputs.safetensors"));
    let (batch, tokens) =
        (inputs["encoder_hidden_states"].0[0], inputs["encoder_hidden_states"].0[1]);
    let fm = build(&cfg, &BuildOptions { batch, seq: tokens, dtype: DType::F32 }).unwrap();
    let mut b = fm.builder;
    let params = b.graph.parameters();
    let grads: Vec<TensorId> =
        gradients(&mut b, fm.loss, &params).unwrap().into_iter().map(|g| g.unwrap()).collect();
    let graph = b.finish();
    let weights = load_hf_weights(&dir, &graph).unwrap();
    let mut wanted = vec![fm.loss, fm.logits];
    wanted.extend(&grads);
    let program = Program::lower_graph(graph.clone(), wanted.clone(), &grads);
    let mut exec = Executor::new(program, CpuBackend::new(0), None);
    for (p, t) in weights {
        exec.bind(p, t).unwrap();
    }
    for input in &fm.inputs {
        let (dims, data) = &inputs[input.name];
        assert_eq!(dims.as_slice(), graph.shape(input.tensor).dims(), "{}", input.name);
        let data: Vec<f32> = data.iter().map(|&x| x as f32).collect();
        exec.bind(input.tensor, tessera_runtime::tensor::from_vec(data, dims).unwrap()).unwrap();
    }
    exec.run().unwrap();
    let get = |t: TensorId| to_f64_vec(exec.get(t).unwrap()).unwrap();
    let loss = get(fm.loss)[0];
    let want_loss = outputs["loss"].1[0];
    assert!(
        (loss - want_loss).abs() < 1e-5 * want_loss.abs().max(1.0),
        "{name}: loss {loss} vs {want_loss}"
    );
    let err = rel_err(&get(fm.logits), &outputs["sample"].1);
    assert!(err < 1e-4, "{name}: prediction off by {err:.2e}");
    for (&p, &g) in params.iter().zip(&grads) {
        let pname = graph.tensor_scope(p);
        let want = &outputs[&format!("grad.{pname}")];
        assert_eq!(want.0.as_slice(), graph.shape(p).dims(), "{pname}");
        let err = rel_err(&get(g), &want.1);
        assert!(err < 1e-4, "{name}: gradient of {pname} off by {err:.2e}");
    }
    // Every gradient diffusers computed is one of ours.
    assert_eq!(outputs.len(), params.len() + 2, "{name}");
}

#[test]
fn tiny_sd2_style_unet_matches_diffusers() {
    parity("tiny_sd2");
}

#[test]
fn tiny_sd15_style_unet_matches_diffusers() {
    parity("tiny_sd15");
}

fn tessera(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().unwrap()
}

/// `profile` of a diffusion config: 77 text tokens and the config's `sample_size` unless
/// `--seq` / `--image-size` say otherwise (the data inputs' bytes show the shapes built).
#[test]
fn profile_defaults_to_the_sample_size_and_77_text_tokens() {
    let dir = fixtures().join("tiny_sd2");
    let dir = dir.to_str().unwrap();
    let inputs_bytes = |extra: &[&str]| {
        let mut args = vec!["profile", "--model", dir, "--batch", "2", "--format", "json"];
        args.extend(extra);
        let out = tessera(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (v["seq"].as_u64().unwrap(), v["memory"]["inputs_bytes"].as_u64().unwrap())
    };
    // sample and target [2, 4, side, side], timestep [2], encoder_hidden_states [2, T, 8]; f32.
    let bytes = |side: u64, tokens: u64| 4 * 2 * (2 * 4 * side * side + 1 + tokens * 8);
    assert_eq!(inputs_bytes(&[]), (77, bytes(8, 77)));
    assert_eq!(inputs_bytes(&["--seq", "5", "--image-size", "16"]), (5, bytes(16, 5)));
    // A side the down path cannot halve is refused by name.
    let out = tessera(&["profile", "--model", dir, "--image-size", "9"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("sample_size"));
}

#[test]
fn unknown_diffusers_classes_and_settings_are_refused_by_name() {
    let err = |json: &str| ModelConfig::from_hf_json(json).unwrap_err().to_string();
    let e = err(r#"{"_class_name": "UNet3DConditionModel"}"#);
    assert!(e.contains("UNet3DConditionModel") && e.contains("UNet2DConditionModel"), "{e}");
    let e = err(r#"{"_class_name": "UNet2DConditionModel", "class_embed_type": "timestep"}"#);
    assert!(e.contains("class_embed_type"), "{e}");
    let e = err(
        r#"{"_class_name": "UNet2DConditionModel", "down_block_types": ["SimpleCrossAttnDownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D"]}"#,
    );
    assert!(e.contains("SimpleCrossAttnDownBlock2D"), "{e}");
}
