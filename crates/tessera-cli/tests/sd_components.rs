//! Stable Diffusion's frozen components against their reference libraries, through
//! `tessera eval --inputs/--outputs` on the fixtures of `tests/fixtures/clip_vae/` (written by
//! its `make_fixtures.py` with `save_pretrained`): CLIP's text encoder (`last_hidden_state`,
//! quick_gelu and gelu variants) against `transformers`, diffusers' `AutoencoderKL` (the
//! encoder's latent mean, the decoder's image) against `diffusers`, and the parameter counts
//! of SD 1.5's and SD 2's text encoders and SD's VAE against the reference libraries' own.

use safetensors::SafeTensors;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use tessera_models::{build, BuildOptions, ModelConfig};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/clip_vae")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("sd-components-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Every f32 tensor of a safetensors file, as (shape, values).
fn read(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes =
        std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).expect("a safetensors file");
    st.tensors()
        .into_iter()
        .filter(|(_, v)| v.dtype() == safetensors::Dtype::F32)
        .map(|(n, v)| {
            let vals =
                v.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64);
            (n, (v.shape().to_vec(), vals.collect()))
        })
        .collect()
}

/// Writes the f32 tensors `names` of `from` into a safetensors file of their own.
fn subset(from: &Path, names: &[&str], tag: &str) -> PathBuf {
    let all = read(from);
    let bytes: Vec<(&str, Vec<usize>, Vec<u8>)> = names
        .iter()
        .map(|n| {
            let (shape, v) = &all[*n];
            (*n, shape.clone(), v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect())
        })
        .collect();
    let views = bytes.iter().map(|(n, shape, data)| {
        (
            *n,
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                .unwrap(),
        )
    });
    let path = scratch(tag).join("in.safetensors");
    safetensors::tensor::serialize_to_file(views, None, &path).unwrap();
    path
}

/// `tessera eval --model-dir DIR --inputs IN --outputs OUT [extra]`, the outputs read back.
fn eval(
    dir: &Path,
    inputs: &Path,
    extra: &[&str],
    tag: &str,
) -> BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    let out = scratch(tag).join("out.safetensors");
    let mut args = vec![
        "eval",
        "--model-dir",
        dir.to_str().unwrap(),
        "--inputs",
        inputs.to_str().unwrap(),
        "--outputs",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    let o = Command::new(env!("CARGO_BIN_EXE_tessera")).args(&args).output().expect("tessera runs");
    assert!(o.status.success(), "{tag}: eval failed: {}", String::from_utf8_lossy(&o.stderr));
    read(&out)
}

fn assert_close(got: &(Vec<usize>, Vec<f64>), want: &(Vec<usize>, Vec<f64>), tol: f64, what: &str) {
    assert_eq!(got.0, want.0, "{what}: shape");
    let err = got.1.iter().zip(&want.1).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    let scale = want.1.iter().map(|x| x.abs()).fold(0.0, f64::max);
    assert!(scale > 0.1, "{what}: the reference is degenerate (max |x| {scale})");
    assert!(err <= tol, "{what}: max abs difference {err:e} > {tol:e}");
}

#[test]
fn clip_text_encoder_matches_transformers() {
    for name in ["clip_text", "clip_text_gelu"] {
        let dir = fixtures().join(name);
        let out = eval(&dir, &dir.join("inputs.safetensors"), &[], name);
        let want = &read(&dir.join("expected.safetensors"))["last_hidden_state"];
        assert_close(&out["logits"], want, 1e-4, &format!("{name} last_hidden_state"));
        assert!(!out.contains_key("loss"), "{name}: no target, no loss");
    }
}

#[test]
fn clip_text_parameter_counts_match_transformers() {
    let text = std::fs::read_to_string(fixtures().join("param_counts.json")).unwrap();
    let counts: Value = serde_json::from_str(&text).unwrap();
    for name in ["sd15_text_encoder", "sd2_text_encoder"] {
        let entry = &counts[name];
        let cfg = ModelConfig::from_hf_json(&entry["config"].to_string()).expect("parses");
        let want = entry["parameters"].as_u64().unwrap();
        assert_eq!(cfg.num_parameters(), want, "{name}: from the config");
        let m = build(&cfg, &BuildOptions::new(1, 77, tessera_ir::DType::F32)).expect("builds");
        assert_eq!(m.builder.graph.num_parameters(), want, "{name}: the built graph");
    }
    // A CLIPModel config reads its text tower.
    let clip = serde_json::json!({"model_type": "clip", "text_config": counts["sd15_text_encoder"]["config"]});
    let cfg = ModelConfig::from_hf_json(&clip.to_string()).expect("a clip config parses");
    assert_eq!(cfg.num_parameters(), counts["sd15_text_encoder"]["parameters"].as_u64().unwrap());
}

#[test]
fn vae_encoder_and_decoder_match_diffusers() {
    let dir = fixtures().join("vae");
    let inputs = dir.join("inputs.safetensors");
    let want = read(&dir.join("expected.safetensors"));
    let sample = subset(&inputs, &["sample"], "vae-sample");
    let out = eval(&dir, &sample, &["--component", "encoder"], "vae-encoder");
    assert_close(&out["logits"], &want["latent_mean"], 1e-4, "encoder latent mean");
    let z = subset(&inputs, &["z"], "vae-z");
    let out = eval(&dir, &z, &["--component", "decoder"], "vae-decoder");
    assert_close(&out["logits"], &want["decoded"], 1e-4, "decoder image");
    // The default part is the whole autoencoder: an image back.
    let out = eval(&dir, &sample, &[], "vae-autoencoder");
    assert_eq!(out["logits"].0, [2, 3, 16, 16]);

    // The parts' inputs are named; a wrong one lists them, a wrong part is named.
    let refused = |args: &[&str]| {
        let mut all = vec!["eval", "--model-dir", dir.to_str().unwrap(), "--outputs", "/dev/null"];
        all.extend(args);
        let o = Command::new(env!("CARGO_BIN_EXE_tessera")).args(&all).output().unwrap();
        assert!(!o.status.success());
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    let e = refused(&["--inputs", sample.to_str().unwrap(), "--component", "decoder"]);
    assert!(e.contains("`sample` is not an input") && e.contains("`z` (f32 "), "{e}");
    let e = refused(&["--inputs", sample.to_str().unwrap(), "--component", "unet"]);
    assert!(e.contains("--component unet") && e.contains("encoder, decoder"), "{e}");
}

#[test]
fn sd_vae_parameter_count_matches_diffusers() {
    let text = std::fs::read_to_string(fixtures().join("param_counts.json")).unwrap();
    let counts: Value = serde_json::from_str(&text).unwrap();
    let cfg = ModelConfig::from_hf_json(&counts["sd_vae"]["config"].to_string()).expect("parses");
    assert_eq!(cfg.num_parameters(), counts["sd_vae"]["parameters"].as_u64().unwrap());
}
