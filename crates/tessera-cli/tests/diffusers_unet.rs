//! diffusers' `UNet2DConditionModel` against diffusers itself
//! (fixtures/diffusers_unet/, written by scripts/make-diffusion-fixtures.sh): the parameter
//! counts of the real SD 1.5 and SD 2 configs, and on two tiny checkpoints saved by
//! `save_pretrained` (SD 2's style: linear projections, a head count per block; SD 1.5's: conv
//! projections, one head count) the prediction and every parameter's gradient of the MSE loss,
//! as `tessera eval --inputs --outputs --grads` computes them from the checkpoint's files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tessera_models::ModelConfig;
use tessera_runtime::tensor::to_f64_vec;

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

/// `tessera eval --model-dir DIR --inputs DIR/inputs.safetensors --outputs OUT --grads` on a
/// fixture: the prediction, the loss and every parameter's gradient against diffusers'.
fn parity(name: &str) {
    let dir = fixtures().join(name);
    let out = std::env::temp_dir()
        .join(format!("tessera-unet-{}-{name}.safetensors", std::process::id()));
    let (d, i, o) = (dir.to_str().unwrap(), dir.join("inputs.safetensors"), out.to_str().unwrap());
    let run = tessera(&[
        "eval",
        "--model-dir",
        d,
        "--inputs",
        i.to_str().unwrap(),
        "--outputs",
        o,
        "--grads",
    ]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let got = read(&out);
    std::fs::remove_file(&out).unwrap();
    let want = read(&dir.join("outputs.safetensors"));
    let (loss, want_loss) = (got["loss"].1[0], want["loss"].1[0]);
    assert!(
        (loss - want_loss).abs() < 1e-5 * want_loss.abs().max(1.0),
        "{name}: loss {loss} vs {want_loss}"
    );
    assert_eq!(got["logits"].0, want["sample"].0, "{name}: prediction shape");
    let err = rel_err(&got["logits"].1, &want["sample"].1);
    assert!(err < 1e-4, "{name}: prediction off by {err:.2e}");
    let grads: Vec<&String> = want.keys().filter(|k| k.starts_with("grad.")).collect();
    for g in grads {
        let ours = got.get(g).unwrap_or_else(|| panic!("{name}: no {g} in eval's output"));
        assert_eq!(ours.0, want[g].0, "{g}");
        let err = rel_err(&ours.1, &want[g].1);
        assert!(err < 1e-4, "{name}: {g} off by {err:.2e}");
    }
    // Every gradient eval wrote is one diffusers computed.
    assert_eq!(got.len(), want.len(), "{name}: {:?}", got.keys().collect::<Vec<_>>());
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
    // sample and target [2, 4, side, side], timestep [2], encoder_hidden_states [2, T, 8]; f32;
    // plus the optimizer's few scalar inputs (learning rate, step), the same in both.
    let bytes = |side: u64, tokens: u64| 4 * 2 * (2 * 4 * side * side + 1 + tokens * 8);
    let (seq, default) = inputs_bytes(&[]);
    assert_eq!(seq, 77);
    let scalars = default - bytes(8, 77);
    assert!(scalars <= 32, "{default}");
    assert_eq!(inputs_bytes(&["--seq", "5", "--image-size", "16"]), (5, bytes(16, 5) + scalars));
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
