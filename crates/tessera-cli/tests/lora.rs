//! Frozen parameters and LoRA, end to end through the `tessera` binary, against PEFT +
//! transformers (fixtures/lora, made by its `make_lora_fixture.py`): a tiny LLaMA with a
//! PEFT adapter whose B is nonzero follows PEFT's per-step losses; the adapter it saves reads
//! back bit for bit, has PEFT's config keys and gives PEFT's trained logits; the frozen base
//! carries no gradient or optimizer bytes (the plan's prediction, equal to the measured
//! peak); `dp2`, `tp2` and `dp2 zero3` follow one device. `--freeze` leaves the frozen
//! weights untouched and counts only what trains.
//!
//! QLoRA (`--quantize-base`): an int4 base under LoRA follows, step for step, LoRA on the
//! same base quantised and dequantised offline (the f64 interpreter's `dequantize`); its loss
//! falls, its held-out loss stays within the stated bound of LoRA on the float base, the
//! base counts at its quantised bytes (predicted == measured); multi-device QLoRA is refused.

use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("lora-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `tessera ARGS`, asserting success; returns stdout.
fn tessera(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("runs");
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "tessera {args:?} failed:\n{stderr}\n{stdout}");
    stdout.into_owned()
}

fn tessera_fails(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("runs");
    assert!(!out.status.success(), "tessera {args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn expected() -> Value {
    read_json(&fixture().join("expected.json"))
}

fn tokens_arg(e: &Value) -> String {
    let ids: Vec<String> =
        e["tokens"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap().to_string()).collect();
    ids.join(",")
}

fn matrix(v: &Value) -> Vec<Vec<f64>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect())
        .collect()
}

fn max_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f64::max)
}

/// `tessera eval` logits of `model_dir` (with `adapter`) on the fixture's tokens.
fn eval_logits(dir: &Path, model_dir: &Path, adapter: Option<&Path>) -> Vec<Vec<f64>> {
    let out = dir.join("logits.json");
    let tokens = tokens_arg(&expected());
    let mut args = vec![
        "eval".to_string(),
        "--model-dir".into(),
        model_dir.display().to_string(),
        "--tokens".into(),
        tokens,
        "--logits".into(),
        out.display().to_string(),
    ];
    if let Some(a) = adapter {
        args.extend(["--adapter".into(), a.display().to_string()]);
    }
    tessera(&args.iter().map(String::as_str).collect::<Vec<_>>());
    matrix(&read_json(&out)["logits"])
}

/// `tessera train` from the fixture's base and adapter on its tokens, with `extra` flags;
/// returns the report and the per-step losses.
fn train(dir: &Path, extra: &[&str]) -> (Value, Vec<f64>) {
    let f = fixture();
    let log = dir.join("log.jsonl");
    let (base, data) = (f.join("base"), f.join("data"));
    let mut args = vec![
        "train",
        "--init",
        base.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--steps",
        "10",
        "--batch",
        "2",
        "--seq",
        "16",
        "--lr",
        "1e-2",
        "--schedule",
        "constant",
        "--weight-decay",
        "0",
        "--max-grad-norm",
        "0",
        "--eval-batches",
        "0",
        "--format",
        "json",
        "--log-json",
        log.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let report: Value = serde_json::from_str(&tessera(&args)).unwrap();
    let losses = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect();
    (report, losses)
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// Predicted == measured peaks and collective bytes, per device.
fn assert_memory_promise(report: &Value, what: &str) {
    let m = &report["memory"];
    assert_eq!(u64s(&m["predicted_peak_bytes"]), u64s(&m["measured_peak_bytes"]), "{what}");
    let c = &report["comm"];
    assert_eq!(u64s(&c["predicted_bytes"]), u64s(&c["measured_bytes"]), "{what}");
}

fn load(path: &Path) -> HashMap<String, candle_core::Tensor> {
    candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap()
}

fn bits(t: &candle_core::Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

#[test]
fn lora_follows_peft_and_saves_an_adapter_peft_reads() {
    let dir = scratch("peft");
    let e = expected();
    let f = fixture();
    // The fixture adapter (nonzero B) on the base gives PEFT's logits.
    let got = eval_logits(&dir, &f.join("base"), Some(&f.join("adapter")));
    let d = max_diff(&got, &matrix(&e["fixture_logits"]));
    assert!(d <= 1e-4, "fixture adapter logits differ from PEFT's by {d}");

    let (ckpt, adapter, merged) = (dir.join("ckpt"), dir.join("adapter"), dir.join("merged"));
    let adapter_in = f.join("adapter");
    let (report, losses) = train(
        &dir,
        &[
            "--init-adapter",
            adapter_in.to_str().unwrap(),
            "--devices",
            "1",
            "--save",
            ckpt.to_str().unwrap(),
            "--save-adapter",
            adapter.to_str().unwrap(),
            "--merge-into",
            merged.to_str().unwrap(),
        ],
    );
    let want: Vec<f64> =
        e["losses"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(losses.len(), want.len());
    for (s, (a, b)) in losses.iter().zip(&want).enumerate() {
        assert!((a - b).abs() <= 1e-5, "step {}: tessera {a}, PEFT {b}", s + 1);
    }
    assert_memory_promise(&report, "one device");
    // Only A and B train: q_proj (A [4,32], B [32,4]) and v_proj (A [4,32], B [16,4]) in
    // each of 2 layers.
    let trainable = 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4);
    assert_eq!(report["parameters"]["trainable"], trainable);
    let state = &report["memory"]["predicted_state_bytes"];
    assert_eq!(state["grads"], 4 * trainable, "the frozen base has no gradient bytes");
    assert_eq!(state["optimizer"], 8 * trainable, "nor optimizer state (m and v, fp32)");
    assert_eq!(state["params"], 4 * report["parameters"]["total"].as_u64().unwrap());

    // The adapter: PEFT's config keys and values, and our tensors bit for bit.
    let ours = read_json(&adapter.join("adapter_config.json"));
    let peft = read_json(&f.join("adapter/adapter_config.json"));
    for key in ours.as_object().unwrap().keys() {
        assert!(peft.get(key).is_some(), "adapter_config.json key {key} is not one PEFT writes");
    }
    for key in ["peft_type", "r", "lora_alpha", "target_modules", "bias", "fan_in_fan_out"] {
        assert_eq!(ours[key], peft[key], "adapter_config.json {key}");
    }
    let saved = load(&adapter.join("adapter_model.safetensors"));
    let trained = load(&ckpt.join("model.safetensors"));
    assert_eq!(saved.len(), 8);
    let reread = tessera_cli::finetune::read_adapter(&adapter).unwrap();
    for (key, t) in &saved {
        let name = key.strip_prefix("base_model.model.").expect("PEFT's prefix");
        assert!(name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight"), "{key}");
        assert_eq!(bits(t), bits(&trained[name]), "{key} as saved vs as trained");
        assert_eq!(bits(&reread.tensors[name]), bits(t), "{key} read back");
    }
    // The frozen base is untouched.
    let base = load(&f.join("base/model.safetensors"));
    for (name, t) in &base {
        assert_eq!(bits(t), bits(&trained[name]), "frozen {name} changed");
    }
    // The trained adapter, and the merged model, give PEFT's trained logits.
    let peft_trained = matrix(&e["trained_logits"]);
    let d = max_diff(&eval_logits(&dir, &f.join("base"), Some(&adapter)), &peft_trained);
    assert!(d <= 1e-4, "trained adapter logits differ from PEFT's by {d}");
    let d = max_diff(&eval_logits(&dir, &merged, None), &peft_trained);
    assert!(d <= 1e-4, "merged model logits differ from PEFT's by {d}");
    let merged_weights = load(&merged.join("model.safetensors"));
    assert!(merged_weights.keys().all(|k| !k.contains("lora_")), "merged keeps no LoRA tensor");
}

#[test]
fn lora_under_dp2_tp2_and_zero3_follows_one_device() {
    let adapter = fixture().join("adapter");
    let adapter = adapter.to_str().unwrap();
    let dir = scratch("one");
    let (one, ref_losses) = train(&dir, &["--init-adapter", adapter, "--devices", "1"]);
    let trainable_bytes = 4 * one["parameters"]["trainable"].as_u64().unwrap();
    for plan in ["dp2", "tp2", "dp2 zero3"] {
        let dir = scratch(&plan.replace(' ', "-"));
        let (report, losses) =
            train(&dir, &["--init-adapter", adapter, "--devices", "2", "--plan", plan]);
        for (s, (a, b)) in losses.iter().zip(&ref_losses).enumerate() {
            assert!((a - b).abs() <= 1e-5, "{plan} step {}: {a} vs one device {b}", s + 1);
        }
        assert_memory_promise(&report, plan);
        if plan == "dp2" {
            // Only the adapters' gradients are all-reduced (and two scalars).
            let sent = u64s(&report["comm"]["measured_bytes"]);
            assert!(sent.iter().all(|&b| b <= trainable_bytes + 64), "{plan}: {sent:?}");
        }
        if plan == "dp2 zero3" {
            let state = &report["memory"]["predicted_state_bytes"];
            // m and v (2 × the adapters' bytes) sharded over 2 devices.
            assert_eq!(state["optimizer"], trainable_bytes, "{plan}: sharded m and v");
        }
    }
}

#[test]
fn frozen_globs_get_no_gradient_and_stay_as_loaded() {
    let dir = scratch("freeze");
    let ckpt = dir.join("ckpt");
    let frozen = ["model.embed_tokens.*", "*.mlp.*"];
    let (report, losses) = train(
        &dir,
        &["--freeze", frozen[0], "--freeze", frozen[1], "--devices", "2", "--plan", "dp2"],
    );
    assert!(losses.last() < losses.first(), "{losses:?}");
    assert_memory_promise(&report, "--freeze dp2");
    let (total, trainable) = (
        report["parameters"]["total"].as_u64().unwrap(),
        report["parameters"]["trainable"].as_u64().unwrap(),
    );
    // embed 64·32, per layer gate/up 64·32 and down 32·64.
    assert_eq!(total - trainable, 64 * 32 + 2 * 3 * 64 * 32);
    let state = &report["memory"]["predicted_state_bytes"];
    assert_eq!(state["grads"], 4 * trainable);
    let sent = u64s(&report["comm"]["measured_bytes"]);
    assert!(sent.iter().all(|&b| b <= 4 * trainable + 64), "{sent:?}");

    let _ = train(
        &dir,
        &[
            "--freeze",
            frozen[0],
            "--freeze",
            frozen[1],
            "--devices",
            "1",
            "--save",
            ckpt.to_str().unwrap(),
        ],
    );
    let base = load(&fixture().join("base/model.safetensors"));
    let trained = load(&ckpt.join("model.safetensors"));
    let glob = |n: &str| n.starts_with("model.embed_tokens.") || n.contains(".mlp.");
    for (name, t) in &base {
        let same = bits(t) == bits(&trained[name]);
        assert_eq!(same, glob(name), "{name}: frozen weights stay, the others train");
    }
    let opt = load(&ckpt.join("optimizer.safetensors"));
    assert!(opt.keys().all(|k| !glob(k)), "optimizer state for a frozen weight");

    // `profile` and `plan` count what trains.
    let base_dir = fixture().join("base");
    let base_dir = base_dir.to_str().unwrap();
    let prof: Value = serde_json::from_str(&tessera(&[
        "profile", "--model", base_dir, "--batch", "2", "--seq", "16", "--format", "json",
        "--freeze", frozen[0], "--freeze", frozen[1],
    ]))
    .unwrap();
    assert_eq!(prof["trainable_params"], trainable);
    assert_eq!(prof["memory"]["grads_bytes"], 4 * trainable);
    let err = tessera_fails(&["profile", "--model", base_dir, "--freeze", "nothing.*"]);
    assert!(err.contains("`nothing.*` matches no parameter"), "{err}");
}

// ---- QLoRA -------------------------------------------------------------------------------

/// A learnable token stream for the tiny LLaMA (vocabulary 64): each token mostly determines
/// the next (`t' = 5t + 3 mod 64`), one in eight drawn at random; `train.bin` and `val.bin`
/// (u16, nanoGPT's layout) from different seeds.
fn pattern_data(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    for (file, len, seed) in [("train.bin", 4096usize, 1u64), ("val.bin", 1024, 2)] {
        let mut state = seed;
        let mut rand = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as u16
        };
        let mut t = 0u16;
        let mut bytes = Vec::with_capacity(2 * len);
        for _ in 0..len {
            t = if rand() % 8 == 0 { rand() % 64 } else { (5 * t + 3) % 64 };
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        std::fs::write(data.join(file), bytes).unwrap();
    }
    data
}

const QLORA_SPEC: &str =
    "r=4,alpha=8,targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";

/// `tessera train` of LoRA (all seven linears) from `base` on `data` for `steps` steps with a
/// held-out evaluation; returns the report and per-step losses.
fn finetune(
    dir: &Path,
    base: &Path,
    data: &Path,
    steps: &str,
    extra: &[&str],
) -> (Value, Vec<f64>) {
    let log = dir.join("log.jsonl");
    let mut args = vec![
        "train",
        "--init",
        base.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--lora",
        QLORA_SPEC,
        "--steps",
        steps,
        "--batch",
        "4",
        "--seq",
        "16",
        "--lr",
        "2e-2",
        "--schedule",
        "constant",
        "--weight-decay",
        "0",
        "--max-grad-norm",
        "0",
        "--eval-batches",
        "8",
        "--format",
        "json",
        "--log-json",
        log.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let report: Value = serde_json::from_str(&tessera(&args)).unwrap();
    let losses = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect();
    (report, losses)
}

/// The fixture base with every decoder linear quantised (int4, `tessera_runtime::quantize`)
/// and dequantised by the f64 interpreter (`tessera_ir::interp::dequantize`): the float base
/// QLoRA's int4 base stands for. Returns the directory and the bytes the quantised linears
/// take (codes + f32 scales) with their float element count.
fn dequantised_base(dir: &Path) -> (PathBuf, u64, u64) {
    let out = dir.join("dequantised");
    std::fs::create_dir_all(&out).unwrap();
    let base = fixture().join("base");
    std::fs::copy(base.join("config.json"), out.join("config.json")).unwrap();
    let mut weights = load(&base.join("model.safetensors"));
    let (mut bytes, mut elems) = (0u64, 0u64);
    let linear = |n: &str| n.starts_with("model.layers.") && n.ends_with("_proj.weight");
    for (_, t) in weights.iter_mut().filter(|(n, _)| linear(n.as_str())) {
        let (n, k) = t.dims2().unwrap();
        let spec = tessera_models::Quantize::Int4.spec(k);
        let (codes, scales) = tessera_runtime::quantize::quantize(t, spec).unwrap();
        let value = |t: &candle_core::Tensor| {
            let v: Vec<f64> = t
                .flatten_all()
                .unwrap()
                .to_dtype(candle_core::DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap();
            tessera_ir::interp::Value::new(t.dims().to_vec(), v)
        };
        let w = tessera_ir::interp::dequantize(&value(&codes), &value(&scales), spec, k);
        let w: Vec<f32> = w.iter().map(|&x| x as f32).collect();
        *t = candle_core::Tensor::from_vec(w, (n, k), &candle_core::Device::Cpu).unwrap();
        bytes += (codes.elem_count() + 4 * scales.elem_count()) as u64;
        elems += (n * k) as u64;
    }
    candle_core::safetensors::save(&weights, out.join("model.safetensors")).unwrap();
    (out, bytes, elems)
}

/// Held-out loss of QLoRA against LoRA on the float base: within this many nats.
///
/// The bound: int4 rounds each weight to within half a step of its group's `max|w| / 7`,
/// a noise of about 9% of the weights' RMS for normal weights in groups of 32; through the
/// two layers it moves the fixture base's held-out loss by ≈ 1e-3 (the base is near-uniform,
/// ≈ ln 64). LoRA trains on top of whichever base it is given, so after fine-tuning the two
/// runs differ by the adapters' response to that noise; QLoRA's paper finds 4-bit bases
/// recover 16-bit LoRA's quality. 0.05 nats (≈ 2% of the losses here, ≈ 2.5–3.5) allows the
/// quantisation noise's effect while failing if the quantised base were wrong (a wrong scale
/// or nibble order leaves loss near ln 64 ≈ 4.16, > 0.5 nats above LoRA's).
const QLORA_HELD_OUT_BOUND: f64 = 0.05;

#[test]
fn qlora_int4_base_trains_as_lora_on_its_dequantised_base() {
    let dir = scratch("qlora");
    let data = pattern_data(&dir);
    let base = fixture().join("base");
    let (deq, quant_bytes, quant_elems) = dequantised_base(&dir);

    let (float_run, float_losses) =
        finetune(&scratch("qlora-float"), &base, &data, "30", &["--devices", "1"]);
    let (q_run, q_losses) = finetune(
        &scratch("qlora-int4"),
        &base,
        &data,
        "30",
        &["--quantize-base", "int4", "--devices", "1"],
    );
    let (deq_run, deq_losses) =
        finetune(&scratch("qlora-deq"), &deq, &data, "30", &["--devices", "1"]);

    // The int4 base is its dequantised float base, step for step.
    for (s, (a, b)) in q_losses.iter().zip(&deq_losses).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5,
            "step {}: QLoRA {a}, LoRA on the dequantised base {b}",
            s + 1
        );
    }
    let held_out = |r: &Value| r["eval_loss"].as_f64().unwrap();
    assert!((held_out(&q_run) - held_out(&deq_run)).abs() <= 1e-5);
    // It trains: the loss falls from the base's (≈ ln 64).
    let first = q_losses[..3].iter().sum::<f64>() / 3.0;
    let last = q_losses[q_losses.len() - 3..].iter().sum::<f64>() / 3.0;
    assert!(last < first - 0.15, "QLoRA losses {q_losses:?}");
    // Held out, within the stated bound of LoRA on the float base.
    let gap = (held_out(&q_run) - held_out(&float_run)).abs();
    assert!(
        gap <= QLORA_HELD_OUT_BOUND,
        "QLoRA held-out {} vs LoRA {} (gap {gap}); losses {q_losses:?} vs {float_losses:?}",
        held_out(&q_run),
        held_out(&float_run)
    );

    // Memory: predicted == measured; the base at its quantised bytes, no gradient or optimizer
    // state but the adapters'.
    assert_memory_promise(&q_run, "QLoRA int4");
    let trainable = q_run["parameters"]["trainable"].as_u64().unwrap();
    assert_eq!(trainable, float_run["parameters"]["trainable"].as_u64().unwrap());
    let state = &q_run["memory"]["predicted_state_bytes"];
    assert_eq!(state["grads"], 4 * trainable);
    assert_eq!(state["optimizer"], 8 * trainable);
    let float_params = float_run["memory"]["predicted_state_bytes"]["params"].as_u64().unwrap();
    assert_eq!(state["params"], float_params - 4 * quant_elems + quant_bytes, "the base's bytes");
}

#[test]
fn qlora_refuses_what_it_cannot_run_by_name() {
    let base = fixture().join("base");
    let data = fixture().join("data");
    let (base, data) = (base.to_str().unwrap(), data.to_str().unwrap());
    let common = ["train", "--data", data, "--steps", "1", "--batch", "1", "--seq", "8"];
    let run = |extra: &[&str]| {
        let mut a: Vec<&str> = common.to_vec();
        a.extend_from_slice(extra);
        tessera_fails(&a)
    };
    let one = "--devices";
    let err = run(&["--init", base, "--quantize-base", "int4", one, "1"]);
    assert!(err.contains("--quantize-base int4") && err.contains("--lora"), "{err}");
    let err = run(&["--init", base, "--lora", "r=2", "--quantize-base", "int4", one, "2"]);
    assert!(err.contains("one device"), "{err}");
    let err = run(&["--model", "llama-tiny", "--lora", "r=2", "--quantize-base", "int8", one, "1"]);
    assert!(err.contains("--init"), "{err}");
    let err = run(&["--init", base, "--lora", "r=2", "--quantize-base", "int3"]);
    assert!(err.contains("int8 or int4"), "{err}");
}
