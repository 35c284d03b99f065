//! A folder of captioned pictures and Stable Diffusion's latent pipeline (issue 47), against the
//! fixtures of `tests/fixtures/tiny_sd/` (written by its `make_fixtures.py` with diffusers,
//! transformers and PIL):
//! - the picture folder's pixels equal PIL's resize and crop (torchvision's, as diffusers'
//!   `train_text_to_image` calls them) exactly for PNGs, captions from `.txt` files and from
//!   `metadata.jsonl`, classes from sub-folders, and the typed errors;
//! - the frozen VAE's latents (mean × `scaling_factor`) and CLIP's states of the tokenized
//!   captions equal diffusers'/transformers' within 1e-4, the ids exactly;
//! - `train` on the pipeline's UNet: its first-step loss equals the loss `tessera eval` gives
//!   for the batch built from diffusers' own latents and states with the objective's keyed draws
//!   (so the whole data path, pictures → latents → batch, matches the reference);
//! - `sample` through the VAE writes an RGB PNG grid of the decoded size.

use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use tessera_models::ModelConfig;
use tessera_runtime::diffusion::{DiffusionObjective, ScheduleConfig};
use tessera_runtime::diffusion_text::{CaptionTokenizer, TextLatents};
use tessera_runtime::picture_folder::{prepare, Needs, PictureError, PictureFolder};
use tessera_runtime::TrainData;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_sd")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("latent-pipeline-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Every tensor of a safetensors file as f64 values.
fn read(path: &Path) -> BTreeMap<String, Vec<f64>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).expect("a safetensors file");
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            let vals: Vec<f64> = match v.dtype() {
                safetensors::Dtype::F32 => v
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                safetensors::Dtype::I64 => v
                    .data()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("{n}: {other:?}"),
            };
            (n, vals)
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths");
    a.iter().zip(b).map(|(&x, &y)| (f64::from(x) - y).abs()).fold(0.0, f64::max)
}

fn tessera(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("run tessera")
}

fn copy_pictures(to: &Path, with_txt: bool) {
    for e in std::fs::read_dir(fixtures().join("pictures")).unwrap() {
        let p = e.unwrap().path();
        let is_txt = p.extension().is_some_and(|x| x == "txt");
        if p.is_file() && (with_txt || !is_txt) {
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    }
}

#[test]
fn picture_folder_equals_pil_and_reads_txt_captions() {
    let expected = read(&fixtures().join("expected.safetensors"));
    let f = PictureFolder::load(&fixtures().join("pictures"), 16, Needs::Captions).unwrap();
    let names: Vec<_> = f.files.iter().map(|p| p.file_name().unwrap().to_owned()).collect();
    assert_eq!(names, ["a.png", "b.png", "c.png", "d.png"]);
    // PNGs: the same bytes as PIL's resize and crop (1e-6: f32 rounding of v/127.5 − 1).
    assert!(max_diff(&f.pixels, &expected["pixels"]) < 1e-6);
    assert_eq!(f.captions[0].as_deref(), Some("a red square"));
    assert_eq!(f.captions[1].as_deref(), Some("the blue sky, at noon"));
    // JPEG: a different decoder (zune-jpeg against libjpeg's), so within a few 8-bit levels.
    let jpeg = prepare(&fixtures().join("pictures/jpeg/e.jpg"), 16).unwrap();
    let d = max_diff(&jpeg, &expected["jpeg_pixels"]);
    assert!(d <= 4.0 / 127.5 + 1e-6, "JPEG off by {d}");
}

#[test]
fn captions_from_metadata_and_classes_from_folders() {
    let dir = scratch("meta");
    copy_pictures(&dir, false);
    let meta = |lines: &[(&str, &str)]| {
        let text: String = lines
            .iter()
            .map(|(f, t)| serde_json::json!({"file_name": f, "text": t}).to_string() + "\n")
            .collect();
        std::fs::write(dir.join("metadata.jsonl"), text).unwrap();
    };
    meta(&[("a.png", "one"), ("b.png", "two"), ("c.png", "three")]);
    match PictureFolder::load(&dir, 16, Needs::Captions) {
        Err(PictureError::NoCaption { path, .. }) => assert!(path.ends_with("d.png"), "{path}"),
        other => panic!("expected NoCaption for d.png, got {other:?}"),
    }
    // Without text conditioning a caption is not needed.
    assert!(PictureFolder::load(&dir, 16, Needs::Nothing).is_ok());
    meta(&[("a.png", "one"), ("b.png", "two"), ("c.png", "three"), ("d.png", "four")]);
    let f = PictureFolder::load(&dir, 16, Needs::Captions).unwrap();
    let caps: Vec<_> = f.captions.iter().map(|c| c.clone().unwrap()).collect();
    assert_eq!(caps, ["one", "two", "three", "four"]);
    std::fs::write(dir.join("metadata.jsonl"), "{\"file_name\": \"zz.png\", \"text\": \"x\"}\n")
        .unwrap();
    assert!(matches!(
        PictureFolder::load(&dir, 16, Needs::Nothing),
        Err(PictureError::BadMetadata { line: 1, .. })
    ));

    // One sub-folder per class, sorted.
    let classes = scratch("classes");
    for (class, files) in [("cat", &["a.png"][..]), ("dog", &["b.png", "c.png"][..])] {
        std::fs::create_dir_all(classes.join(class)).unwrap();
        for file in files {
            std::fs::copy(fixtures().join("pictures").join(file), classes.join(class).join(file))
                .unwrap();
        }
    }
    let f = PictureFolder::load(&classes, 8, Needs::Classes(2)).unwrap();
    assert_eq!(f.labels, [Some(0), Some(1), Some(1)]);
    assert_eq!(f.class_names, ["cat", "dog"]);
    assert_eq!(f.pixels.len(), 3 * 3 * 8 * 8);
    assert!(matches!(
        PictureFolder::load(&classes, 8, Needs::Classes(1)),
        Err(PictureError::LabelOutOfRange { label: 1, classes: 1, .. })
    ));
}

#[test]
fn picture_folder_errors_name_the_problem() {
    let empty = scratch("empty");
    std::fs::write(empty.join("notes.txt"), "no pictures here").unwrap();
    assert!(matches!(PictureFolder::load(&empty, 8, Needs::Nothing), Err(PictureError::Empty(_))));
    assert!(matches!(
        PictureFolder::load(&empty.join("notes.txt"), 8, Needs::Nothing),
        Err(PictureError::NotADirectory(_))
    ));
    let bad = scratch("bad");
    std::fs::write(bad.join("broken.png"), b"not a png at all").unwrap();
    match PictureFolder::load(&bad, 8, Needs::Nothing) {
        Err(e @ PictureError::Unreadable { .. }) => {
            assert!(e.to_string().contains("broken.png"), "{e}")
        }
        other => panic!("expected Unreadable, got {other:?}"),
    }
    let unlabelled = scratch("unlabelled");
    copy_pictures(&unlabelled, true);
    assert!(matches!(
        PictureFolder::load(&unlabelled, 8, Needs::Classes(10)),
        Err(PictureError::NoLabel { .. })
    ));
}

/// The frozen VAE and text encoder give diffusers' latents and transformers' states; the
/// UNet's first training step on the folder has the loss `eval` gives on the batch built from
/// those reference values; `sample` decodes through the VAE to an RGB PNG.
#[test]
fn latent_pipeline_trains_on_reference_latents_and_samples() {
    let expected = read(&fixtures().join("expected.safetensors"));
    let pipe = fixtures().join("pipeline");
    let unet_dir = pipe.join("unet");
    let pictures = fixtures().join("pictures");

    let tok = CaptionTokenizer::open(&pipe.join("tokenizer"), 16).unwrap();
    let captions: Vec<String> = ["a", "b", "c", "d"]
        .iter()
        .map(|s| std::fs::read_to_string(pictures.join(format!("{s}.txt"))).unwrap())
        .map(|s| s.trim().to_string())
        .collect();
    let refs: Vec<&str> = captions.iter().map(String::as_str).collect();
    let ids: Vec<f64> = tok.encode(&refs).unwrap().into_iter().map(|i| i as f64).collect();
    assert_eq!(ids, expected["input_ids"]);
    let null: Vec<f64> = tok.encode(&[""]).unwrap().into_iter().map(|i| i as f64).collect();
    assert_eq!(null, expected["null_ids"]);

    let ModelConfig::UNet(unet) = ModelConfig::from_path(&unet_dir).unwrap() else {
        panic!("a UNet")
    };
    let got = tessera_cli::latent::text_latents(&unet_dir, &unet, &pictures).unwrap();
    assert_eq!((got.seq, got.dim, got.shape), (16, 32, [4, 8, 8]));
    let d = max_diff(&got.latents, &expected["latents"]);
    assert!(d < 1e-4, "latents off by {d}");
    let d = max_diff(&got.states, &expected["states"]);
    assert!(d < 1e-4, "states off by {d}");
    let d = max_diff(&got.null_states, &expected["null_states"]);
    assert!(d < 1e-4, "null states off by {d}");

    // Train two steps from the pipeline's weights.
    let (p, u, pics) =
        (pipe.to_str().unwrap(), unet_dir.to_str().unwrap(), pictures.to_str().unwrap());
    let _ = p;
    let out = tessera(&[
        "train",
        "--model",
        u,
        "--init",
        u,
        "--data",
        pics,
        "--steps",
        "2",
        "--batch",
        "4",
        "--devices",
        "1",
        "--eval-batches",
        "0",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    let first = v["initial_loss"].as_f64().expect("initial_loss");
    let predicted = v["memory"]["predicted_peak_bytes"][0].as_u64().unwrap();
    let measured = v["memory"]["measured_peak_bytes"][0].as_u64().unwrap();
    assert_eq!(predicted, measured);
    // Only the UNet trains: the report counts its parameters, not the VAE's or CLIP's.
    let unet_params = ModelConfig::UNet(unet.clone()).num_parameters();
    assert_eq!(v["parameters"]["total"].as_u64(), Some(unet_params), "{}", v["parameters"]);

    // The same step's batch from the reference latents and states, its loss by `eval`.
    let f32s = |name: &str| expected[name].iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let reference = TextLatents {
        source: "reference".into(),
        latents: f32s("latents"),
        shape: [4, 8, 8],
        states: f32s("states"),
        null_states: f32s("null_states"),
        seq: 16,
        dim: 32,
    };
    let text = std::fs::read_to_string(pipe.join("scheduler/scheduler_config.json")).unwrap();
    let objective =
        DiffusionObjective::new(ScheduleConfig::from_json(&text).unwrap(), 0.1, 0).unwrap();
    let data = TrainData::TextDiffusion { data: reference, objective };
    let batch = data.train_batch(1337, 1, 4, 16).unwrap();
    let tensors: HashMap<String, candle_core::Tensor> =
        batch.names().iter().map(|n| (n.to_string(), batch.get(n).unwrap().clone())).collect();
    let dir = scratch("eval");
    let (inp, outp) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
    candle_core::safetensors::save(&tensors, &inp).unwrap();
    let out = tessera(&[
        "eval",
        "--model-dir",
        u,
        "--inputs",
        inp.to_str().unwrap(),
        "--outputs",
        outp.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let want = read(&outp)["loss"][0];
    assert!((first - want).abs() < 1e-4 * want.abs().max(1.0), "train {first} vs eval {want}");

    // Sampling through the VAE: 2 prompts × 2, 8×8 latents decoded to 16×16 RGB.
    let png = dir.join("grid.png");
    let out = tessera(&[
        "sample",
        "--model-dir",
        u,
        "--prompt",
        "a red square",
        "--prompt",
        "grey stones",
        "--per-class",
        "2",
        "--steps",
        "3",
        "--zoom",
        "1",
        "--out",
        png.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let (w, h) = (
        u32::from_be_bytes(bytes[16..20].try_into().unwrap()),
        u32::from_be_bytes(bytes[20..24].try_into().unwrap()),
    );
    assert_eq!((w, h), (2 * 17 + 1, 2 * 17 + 1), "2 × 2 cells of 16 + 1 pixels, + 1");
    assert_eq!(bytes[25], 2, "truecolour (RGB)");
}
