//! DiT (`DiTTransformer2DModel`) against diffusers: the tiny model of
//! `tests/fixtures/diffusers_dit/` (written by its `make_fixture.py` with `save_pretrained`)
//! run by the runtime's f32 CPU kernels on the fixture's inputs must give diffusers' output
//! and every parameter's gradient of the MSE within 1e-4; DiT-XL/2's parameter count equals
//! diffusers'; the diffusion objective's schedules and the samplers' steps equal diffusers'.
//! Training: a tiny DiT trains under `dp2`, `tp2`, `dp2 zero3`, with checkpointing and with
//! its model state offloaded to host memory like one device (per-step loss and gradient norm
//! within 1e-5 for 10 steps, device and host peaks and traffic as predicted), and
//! `dit-tiny` trained on the digits draws digits a ViT trained on the digits recognises as
//! the requested class.

use crate::support;

use candle_core::Tensor;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tessera_ir::{gradients, DType, Program, TensorId};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_runtime::hf_weights::load_hf_weights;
use tessera_runtime::tensor::to_f64_vec;
use tessera_runtime::{CpuBackend, Executor};

const TOL: f64 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/diffusers_dit")
}

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &candle_core::Device::Cpu)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn max_abs_diff(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max)
}

#[test]
fn tiny_dit_matches_diffusers_output_and_gradients() {
    let dir = fixture();
    let cfg = ModelConfig::from_path(&dir.join("model")).expect("the fixture's config parses");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    assert_eq!(cfg.num_parameters(), meta["tiny_parameters"].as_u64().unwrap());
    let inputs = tensors(&dir.join("inputs.safetensors"));
    let reference = tensors(&dir.join("reference.safetensors"));
    let batch = inputs["hidden_states"].dims()[0];

    let fm = build(&cfg, &BuildOptions::new(batch, 1, DType::F32)).expect("builds");
    assert_eq!(fm.builder.graph.num_parameters(), cfg.num_parameters());
    let mut b = fm.builder;
    let params = b.graph.parameters();
    let grads: Vec<TensorId> = gradients(&mut b, fm.loss, &params)
        .expect("autodiff")
        .into_iter()
        .map(|g| g.expect("every parameter has a gradient"))
        .collect();
    let graph = b.finish();
    let mut wanted = vec![fm.logits, fm.loss];
    wanted.extend(&grads);
    let program = Program::lower_graph(graph.clone(), wanted.clone(), &grads);
    let mut exec = Executor::new(program, CpuBackend::new(0), None);
    for (p, t) in load_hf_weights(&dir.join("model"), &graph).expect("diffusers weights load") {
        exec.bind(p, t).unwrap();
    }
    for input in &fm.inputs {
        let t = inputs.get(input.name).unwrap_or_else(|| panic!("fixture lacks {}", input.name));
        exec.bind(input.tensor, t.clone()).unwrap();
    }
    exec.run().expect("runtime runs");

    let mut names = vec!["logits".to_string(), "loss".to_string()];
    names.extend(params.iter().map(|&p| format!("grad.{}", graph.tensor_scope(p))));
    assert_eq!(names.len() - 2, reference.len() - 2, "one reference gradient per parameter");
    for (name, &t) in names.iter().zip(&wanted) {
        let got = to_f64_vec(exec.get(t).expect("output kept")).unwrap();
        let want = to_f64_vec(&reference[name]).unwrap();
        let err = max_abs_diff(&got, &want);
        assert!(err <= TOL, "{name}: max |tessera − diffusers| = {err:.2e} > {TOL:.0e}");
    }
}

#[test]
fn dit_xl_2_has_diffusers_parameter_count() {
    let dir = fixture();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let cfg = ModelConfig::from_path(&dir.join("dit_xl_2")).expect("DiT-XL/2's config parses");
    let ModelConfig::Dit(dit) = &cfg else { panic!("a DiT config, got {}", cfg.family()) };
    assert_eq!((dit.num_layers, dit.inner_dim(), dit.out_channels), (28, 1152, 8));
    assert_eq!(cfg.num_parameters(), meta["dit_xl_2_parameters"].as_u64().unwrap());
    // The config written back reads as the same model.
    let json = cfg.to_hf_json().to_string();
    assert_eq!(ModelConfig::from_hf_json(&json).unwrap(), cfg);
}

// ---- the objective and the samplers against diffusers' schedulers ------------------------------

use tessera_runtime::diffusion::{
    BetaSchedule, DiffusionObjective, NoiseSchedule, Prediction, Sampler, SamplerKind,
    ScheduleConfig,
};

fn f32s(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_dtype(candle_core::DType::F32).unwrap().to_vec1().unwrap()
}

/// max |got − want| / max(|want|, floor) over the elements.
fn rel_err(got: &[f64], want: &[f64], floor: f64) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(a, b)| (a - b).abs() / b.abs().max(floor)).fold(0.0, f64::max)
}

#[test]
fn beta_schedules_equal_diffusers() {
    let reference = tensors(&fixture().join("schedulers.safetensors"));
    for (name, schedule) in [
        ("linear", BetaSchedule::Linear),
        ("scaled_linear", BetaSchedule::ScaledLinear),
        ("squaredcos_cap_v2", BetaSchedule::SquaredcosCapV2),
    ] {
        let cfg = ScheduleConfig { beta_schedule: schedule, ..ScheduleConfig::default() };
        let s = NoiseSchedule::new(&cfg);
        let want = |k: &str| to_f64_vec(&reference[&format!("{name}.{k}")]).unwrap();
        // diffusers holds f32: the betas agree to f32 rounding, the products to the f32
        // cumulative product's rounding over 1000 factors.
        let e = rel_err(&s.betas, &want("betas"), 0.0);
        assert!(e < 1e-6, "{name} betas: relative error {e:.1e}");
        let e = rel_err(&s.alphas_cumprod, &want("alphas_cumprod"), 0.0);
        assert!(e < 2e-5, "{name} alphas_cumprod: relative error {e:.1e}");
    }
}

#[test]
fn noising_and_velocity_equal_diffusers() {
    let r = tensors(&fixture().join("schedulers.safetensors"));
    let (x0, noise) = (f32s(&r["add_noise.x0"]), f32s(&r["add_noise.noise"]));
    let half = x0.len() / 2;
    for prediction in [Prediction::Epsilon, Prediction::VPrediction] {
        let cfg = ScheduleConfig { prediction, ..ScheduleConfig::default() };
        let obj = DiffusionObjective::new(cfg, 0.1, 10).unwrap();
        let (mut noisy, mut target) = (Vec::new(), Vec::new());
        for (row, t) in [10usize, 700].into_iter().enumerate() {
            let range = row * half..(row + 1) * half;
            let (x, y) = obj.noised(&x0[range.clone()], &noise[range], t);
            noisy.extend(x.iter().map(|&v| f64::from(v)));
            target.extend(y.iter().map(|&v| f64::from(v)));
        }
        let want = to_f64_vec(&r["add_noise.noisy"]).unwrap();
        assert!(max_abs_diff(&noisy, &want) < 1e-5, "add_noise");
        let want = match prediction {
            Prediction::Epsilon => noise.iter().map(|&v| f64::from(v)).collect(),
            Prediction::VPrediction => to_f64_vec(&r["add_noise.velocity"]).unwrap(),
        };
        assert!(max_abs_diff(&target, &want) < 1e-5, "{prediction:?} target");
    }
}

#[test]
fn ddim_and_euler_steps_equal_diffusers() {
    let dir = fixture();
    let r = tensors(&dir.join("schedulers.safetensors"));
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let list = |k: &str| -> Vec<f64> {
        meta["steps"][k].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect()
    };
    for (pname, prediction) in
        [("epsilon", Prediction::Epsilon), ("v_prediction", Prediction::VPrediction)]
    {
        let cfg = ScheduleConfig { prediction, ..ScheduleConfig::default() };
        for (sname, kind) in [("ddim", SamplerKind::Ddim), ("euler", SamplerKind::Euler)] {
            let s = Sampler::new(kind, cfg.clone(), 10).unwrap();
            let what = format!("{sname} {pname}");
            let e = max_abs_diff(&s.timesteps, &list(&format!("{sname}.{pname}.timesteps")));
            assert!(e < 1e-3, "{what}: timesteps differ by {e}");
            if kind == SamplerKind::Euler {
                let e = rel_err(&s.sigmas, &list(&format!("euler.{pname}.sigmas")), 1e-3);
                let want = list(&format!("euler.{pname}.sigmas"));
                assert!(e < 1e-5, "{what}: sigmas differ by {e:.1e}: {:?} vs {want:?}", s.sigmas);
                let want = meta["steps"][format!("euler.{pname}.init_noise_sigma")].as_f64();
                assert!((s.init_noise_sigma() - want.unwrap()).abs() < 1e-3, "{what}");
            }
            for i in 0..3 {
                let get = |k: &str| f32s(&r[&format!("{sname}.{pname}.{i}.{k}")]);
                let (sample, out) = (get("sample"), get("model_output"));
                let widen = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
                if kind == SamplerKind::Euler {
                    let scaled = widen(s.scale_model_input(i, &sample));
                    let e = max_abs_diff(&scaled, &widen(get("scaled")));
                    assert!(e < 1e-5, "{what} step {i}: scale_model_input off by {e:.1e}");
                }
                let next = widen(s.step(i, &out, &sample));
                let want = widen(get("prev_sample"));
                let e = rel_err(&next, &want, 1.0);
                assert!(e < 1e-5, "{what} step {i}: prev_sample off by {e:.1e}");
            }
        }
    }
}

// ---- training --------------------------------------------------------------------------------

use support::axis_runs::{self, assert_accounted, assert_follows, model_file, Shape};

/// A tiny class-conditional DiT on the digits' 8×8 grey images: width 32, 2 blocks, 2 heads.
const DIT_DIGITS: &str = r#"{"_class_name": "DiTTransformer2DModel", "_name_or_path": "dit-fid",
    "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 1, "out_channels": 2,
    "num_layers": 2, "sample_size": 8, "patch_size": 2, "num_embeds_ada_norm": 10}"#;

#[test]
fn tiny_dit_trains_like_one_device_under_every_plan() {
    let dir = axis_runs::temp("dit", "fidelity");
    let model = model_file(&dir, "dit-fid", DIT_DIGITS);
    let shape = Shape { batch: 8, seq: 16, steps: 10 };
    let train = |devices: usize, plan: &str| {
        let tag = plan.replace([' ', '=', '+'], "_");
        let log = dir.join(format!("{devices}-{tag}.jsonl"));
        let mut args = axis_runs::run_args(&model, plan, log.to_str().unwrap(), shape, shape.steps);
        args.extend(["--devices".into(), devices.to_string(), "--data".into(), digits()]);
        if plan.contains("offload=") {
            args.extend(["--host-memory".into(), "1GiB".into()]);
        }
        let out = axis_runs::tessera(&args);
        assert!(out.status.success(), "{plan}: {}", String::from_utf8_lossy(&out.stderr));
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
        (doc, axis_runs::steps_of(&log))
    };
    let (_, single) = train(1, "dp1");
    assert!(single.iter().all(|s| s.0.is_finite() && s.0 > 0.0), "{single:?}");
    for plan in [
        "dp2",
        "tp2",
        "dp2 zero3",
        "dp2 ckpt=full",
        "tp2 ckpt=full",
        "dp2 offload=all",
        "tp2 ckpt=full offload=grads+opt",
    ] {
        let (doc, steps) = train(2, plan);
        let what = format!("dit `{plan}`");
        assert_follows(&what, &steps, &single, 1);
        assert_accounted(&what, &doc);
        // An offloaded plan's host memory peaks where its Program says, above nothing.
        let host = &doc["memory"]["host_peak_bytes"];
        assert_eq!(host["predicted"], host["measured"], "{what}: host peaks {host}");
        let held =
            host["measured"].as_array().is_some_and(|h| h.iter().all(|b| b.as_u64() > Some(0)));
        assert_eq!(held, plan.contains("offload="), "{what}: host peaks {host}");
    }
}

/// The shipped digits (`scripts/setup.sh` installs them).
fn digits() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/digits.csv");
    path.to_str().unwrap().to_string()
}

/// The class a ViT checkpoint gives each of `images` (`[n, 1, 8, 8]` in `[-1, 1]`).
fn classify(vit_dir: &Path, images: &Tensor) -> Vec<usize> {
    let n = images.dims()[0];
    let cfg = ModelConfig::from_path(vit_dir).expect("the ViT checkpoint's config");
    let fm = build(&cfg, &BuildOptions::new(n, 1, DType::F32)).unwrap();
    let (logits, inputs) = (fm.logits, fm.inputs.clone());
    let graph = fm.builder.finish();
    let program = Program::lower_graph(graph.clone(), vec![logits], &[]);
    let mut exec = Executor::new(program, CpuBackend::new(0), None);
    for (p, t) in load_hf_weights(vit_dir, &graph).expect("ViT weights") {
        exec.bind(p, t).unwrap();
    }
    for input in inputs {
        let value = match input.name {
            "pixel_values" => images.clone(),
            "labels" => {
                Tensor::zeros(n, candle_core::DType::I64, &candle_core::Device::Cpu).unwrap()
            }
            "seed" => Tensor::new(0i64, &candle_core::Device::Cpu).unwrap(),
            other => panic!("ViT input {other}"),
        };
        exec.bind(input.tensor, value).unwrap();
    }
    exec.run().unwrap();
    let z = to_f64_vec(exec.get(logits).unwrap()).unwrap();
    let classes = z.len() / n;
    z.chunks(classes)
        .map(|r| (0..classes).fold(0, |b, i| if r[i] > r[b] { i } else { b }))
        .collect()
}

#[test]
fn dit_tiny_draws_digits_a_classifier_recognises() {
    let dir = axis_runs::temp("dit", "learning");
    let digits = digits();
    let digits = digits.as_str();
    let run = |args: &[&str]| {
        let out = axis_runs::tessera(args);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    // The classifier: vit-tiny as the README trains it (about 85% held-out accuracy).
    let vit = dir.join("vit");
    run(&[
        "train",
        "--model",
        "vit-tiny",
        "--data",
        digits,
        "--steps",
        "300",
        "--batch",
        "40",
        "--lr",
        "2e-3",
        "--devices",
        "1",
        "--plan",
        "dp1",
        "--eval-batches",
        "0",
        "--save",
        vit.to_str().unwrap(),
    ]);
    let dit = dir.join("dit");
    run(&[
        "train",
        "--model",
        "dit-tiny",
        "--data",
        digits,
        "--steps",
        DIT_STEPS,
        "--batch",
        "64",
        "--lr",
        "2e-3",
        "--devices",
        "1",
        "--plan",
        "dp1",
        "--eval-batches",
        "0",
        "--save",
        dit.to_str().unwrap(),
    ]);
    let samples = dir.join("samples.safetensors");
    run(&[
        "sample",
        "--model-dir",
        dit.to_str().unwrap(),
        "--per-class",
        "10",
        "--steps",
        "25",
        "--guidance-scale",
        "3",
        "--out",
        dir.join("grid.png").to_str().unwrap(),
        "--tensors",
        samples.to_str().unwrap(),
    ]);
    let s = tensors(&samples);
    let labels: Vec<i64> = s["class_labels"].to_vec1().unwrap();
    let images = s["samples"].clamp(-1f32, 1f32).unwrap();
    let predicted = classify(&vit, &images);
    let hits = predicted.iter().zip(&labels).filter(|(p, l)| **p as i64 == **l).count();
    let rate = hits as f64 / labels.len() as f64;
    eprintln!("dit-tiny: {hits}/{} samples recognised as their class", labels.len());
    assert!(rate >= 0.7, "only {:.0}% of the samples read as their class", 100.0 * rate);
}

/// DiT training steps of the learning test.
const DIT_STEPS: &str = "1500";
