//! The MoE families (`mixtral`, `qwen2_moe`, `qwen3_moe`, `deepseek_v3`) end to end through
//! the binary: tiny inline configs train on one device and on the plan the planner picks for
//! two (loss finite and falling, the first step's loss equal across plans, measured peak ==
//! predicted); `profile` of the `mixtral-8x7b` preset counts the step's matmul FLOPs as the
//! closed form does (the experts on every capacity row); `profile` of every released MoE
//! preset and of its config.json counts transformers' parameters (DeepSeek-V3's with its
//! correction-bias buffers); and on checkpoints written by `transformers`
//! (`scripts/make-moe-fixtures.sh`) `eval` reproduces its logits and its loss (router auxiliary
//! loss included or not, as the config says), `generate` its greedy tokens (one device and
//! tp2; DeepSeek-V3's compressed latent KV cache on one), and a `train --save` of one writes
//! the Hub's per-expert tensors back one to one.

use crate::support;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(repo_root())
        .args(args)
        .output()
        .expect("tessera runs")
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn json(out: &Output) -> Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

/// A tiny config of `family` written to a temporary config.json; returns its path.
fn config(family: &str) -> PathBuf {
    let j = match family {
        "mixtral" => serde_json::json!({
            "model_type": "mixtral", "_name_or_path": "mixtral-test", "vocab_size": 256,
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
            "num_experts_per_tok": 2, "output_router_logits": true,
            "router_aux_loss_coef": 0.02, "max_position_embeddings": 256
        }),
        "qwen2_moe" => serde_json::json!({
            "model_type": "qwen2_moe", "_name_or_path": "qwen2-moe-test", "vocab_size": 256,
            "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
            "num_experts_per_tok": 2, "decoder_sparse_step": 2, "output_router_logits": true,
            "max_position_embeddings": 256
        }),
        // MLA with a low-rank q, v narrower than q/k, YaRN; one dense layer, then 8 experts in
        // 4 groups (2 kept), top 2, a shared expert.
        "deepseek_v3" => serde_json::json!({
            "model_type": "deepseek_v3", "_name_or_path": "deepseek-v3-test", "vocab_size": 256,
            "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "max_position_embeddings": 256,
            "rope_scaling": {"type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 64, "mscale": 1.0,
                             "mscale_all_dim": 0.5}
        }),
        _ => serde_json::json!({
            "model_type": "qwen3_moe", "_name_or_path": "qwen3-moe-test", "vocab_size": 256,
            "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true,
            "mlp_only_layers": [0], "output_router_logits": true,
            "max_position_embeddings": 256
        }),
    };
    PathBuf::from(support::write_model("moe-models", family, &j))
}

fn train(model: &Path, devices: &str) -> Value {
    json(&tessera(&[
        "train",
        "--model",
        model.to_str().unwrap(),
        "--steps",
        "3",
        "--batch",
        "4",
        "--seq",
        "32",
        "--devices",
        devices,
        "--format",
        "json",
    ]))
}

fn check_run(family: &str, v: &Value) {
    let (first, last) = (v["initial_loss"].as_f64().unwrap(), v["final_loss"].as_f64().unwrap());
    assert!(first.is_finite() && last.is_finite(), "{family}: {v}");
    assert!(last < first, "{family}: loss did not fall over 3 steps: {first} -> {last}");
    let m = &v["memory"];
    assert_eq!(m["measured_peak_bytes"], m["predicted_peak_bytes"], "{family}: {m}");
}

#[test]
fn tiny_moe_models_train_on_one_and_two_devices() {
    for family in ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"] {
        let model = config(family);
        let one = train(&model, "1");
        check_run(family, &one);
        assert_eq!(one["devices"], 1);
        let two = train(&model, "2");
        check_run(family, &two);
        // The first step's loss is the untrained model's on the same batch: the plan must not
        // change it (router aux loss included).
        let (a, b) = (one["initial_loss"].as_f64().unwrap(), two["initial_loss"].as_f64().unwrap());
        assert!((a - b).abs() <= 1e-5 * a, "{family}: 1 device {a}, plan {} {b}", two["config"]);
    }
}

/// Tensor parallelism splits multi-head latent attention by heads (the shared RoPE key is
/// broadcast to every head before it is rotated): `tp2` gives the one-device loss, and its
/// measured peak is its predicted one.
#[test]
fn deepseek_v3_trains_under_tensor_parallelism() {
    let model = config("deepseek_v3");
    let one = train(&model, "1");
    let m = model.to_str().unwrap();
    let args = ["train", "--model", m, "--steps", "3", "--batch", "4", "--seq", "32"];
    let tp = json(&tessera(
        &[&args[..], &["--devices", "2", "--plan", "tp2", "--format", "json"]].concat(),
    ));
    assert!(tp["config"].as_str().unwrap().contains("tp2"), "{}", tp["config"]);
    check_run("deepseek_v3 tp2", &tp);
    let (a, b) = (one["initial_loss"].as_f64().unwrap(), tp["initial_loss"].as_f64().unwrap());
    assert!((a - b).abs() <= 1e-5 * a, "1 device {a}, tp2 {b}");
}

/// Forward matmul FLOPs of Mixtral-8x7B at batch 8 × 1024 by hand (N = 8192 tokens, d 4096,
/// h 32, kv 8, e 128, E 8, f 14336, v 32000, 32 layers): per layer the projections
/// 2·N·d·(h·e + 2·kv·e + h·e), attention as dense S×S products 4·N·S·h·e, the router
/// 2·N·d·E and the experts 3 · 2·E·C·d·f on every capacity row, C = N (dropless: E/k = 4
/// times the active experts' work); plus the head 2·N·d·v.
#[test]
fn profile_of_mixtral_8x7b_counts_the_experts_on_capacity_rows() {
    let v = json(&tessera(&["profile", "--model", "mixtral-8x7b", "--format", "json"]));
    let (n, s, d, h, e, kv, experts, f, vocab) =
        (8192u64, 1024u64, 4096u64, 32u64, 128u64, 8u64, 8u64, 14336u64, 32000u64);
    let layer = 2 * n * d * (h * e + 2 * kv * e + h * e)
        + 4 * n * s * h * e
        + 2 * n * d * experts
        + 3 * 2 * experts * n * d * f;
    let want = 32 * layer + 2 * n * d * vocab;
    assert_eq!(v["flops"]["matmul_forward"].as_u64().unwrap(), want, "{}", v["flops"]);
    assert_eq!(v["params"], 46_702_792_704u64, "{v}");
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_moe")
}

/// `eval` of `dir` on `tokens`: (loss, logits rows).
fn eval(dir: &Path, tokens: &[String], tag: &str) -> (f64, Vec<Vec<f64>>) {
    let logits_path =
        std::env::temp_dir().join(format!("tessera-moe-{}-{tag}.json", std::process::id()));
    let out = json(&tessera(&[
        "eval",
        "--model-dir",
        dir.to_str().unwrap(),
        "--tokens",
        &tokens.join(","),
        "--format",
        "json",
        "--logits",
        logits_path.to_str().unwrap(),
    ]));
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(&logits_path).unwrap()).expect("logits JSON");
    let _ = std::fs::remove_file(&logits_path);
    (out["loss"].as_f64().unwrap(), rows(&doc["logits"]))
}

fn rows(v: &Value) -> Vec<Vec<f64>> {
    let row = |r: &Value| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    v.as_array().unwrap().iter().map(row).collect()
}

fn max_diff(got: &[Vec<f64>], want: &[Vec<f64>], name: &str) -> f64 {
    assert_eq!(got.len(), want.len(), "{name}: rows");
    let mut worst = 0f64;
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len(), "{name}: vocabulary");
        for (a, b) in g.iter().zip(w) {
            worst = worst.max((a - b).abs());
        }
    }
    worst
}

const FAMILIES: [&str; 3] = ["mixtral", "qwen2_moe", "qwen3_moe"];

/// DeepSeek-V3's parameter count equals transformers' on the meta device (the fixture script
/// builds `DeepseekV3ForCausalLM` from deepseek-ai/DeepSeek-V3's config.json): its parameters
/// plus the `e_score_correction_bias` buffers, which tessera holds as (constant) parameters.
#[test]
fn profile_of_deepseek_v3_counts_transformers_parameters() {
    let text = std::fs::read_to_string(fixtures().join("deepseek_v3_params.json")).unwrap();
    let hf: Value = serde_json::from_str(&text).unwrap();
    let hf = &hf["deepseek-v3"];
    let want = hf["parameters"].as_u64().unwrap() + hf["e_score_correction_bias"].as_u64().unwrap();
    let v = json(&tessera(&["profile", "--model", "deepseek-v3", "--format", "json"]));
    assert_eq!(v["params"].as_u64(), Some(want), "{v}");
}

/// Greedy generation over DeepSeek-V3's compressed latent KV cache: transformers' `generate`
/// tokens (its KV cache; `generate.json`), the three prompts of different lengths generated
/// together; the measured peak is the predicted one, cache included.
#[test]
fn deepseek_v3_greedy_tokens_equal_transformers_generate() {
    let dir = fixtures().join("deepseek_v3");
    let text = std::fs::read_to_string(dir.join("generate.json")).unwrap();
    let expected: Value = serde_json::from_str(&text).unwrap();
    let r = generate(&dir, &expected, &[]);
    let want: Vec<Vec<i64>> = expected["new_tokens"].as_array().unwrap().iter().map(ids).collect();
    let got: Vec<Vec<i64>> = r["new_tokens"].as_array().unwrap().iter().map(ids).collect();
    assert_eq!(got, want, "tokens differ from transformers' generate");
    let m = &r["memory"];
    assert_eq!(m["measured_peak_bytes"], m["predicted_peak_bytes"], "{m}");
    assert!(m["kv_cache_bytes"].as_u64().unwrap() > 0, "the prediction holds the cache: {m}");
}

/// Fine-tuning the DeepSeek-V3 checkpoint leaves its `e_score_correction_bias` exactly as
/// loaded (a transformers buffer: no gradient, no optimizer step; here a parameter whose
/// gradient is an exact zero) while the router weight it sits beside trains; the saved
/// checkpoint evaluates again.
#[test]
fn fine_tuning_deepseek_v3_keeps_the_correction_bias() {
    let src = fixtures().join("deepseek_v3");
    let tmp = std::env::temp_dir().join(format!("tessera-dsv3-ft-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    // Token ids below the fixture's 96-id vocabulary, as a nanoGPT uint16 file.
    let tokens: Vec<u8> =
        (0..4096u32).flat_map(|i| (((i * 37 + i / 7) % 96) as u16).to_le_bytes()).collect();
    let data = tmp.join("tokens.bin");
    std::fs::write(&data, tokens).unwrap();
    let save = tmp.join("ft");
    let args = [
        "train",
        "--init",
        src.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "8",
        "--devices",
        "1",
        "--save",
        save.to_str().unwrap(),
        "--format",
        "json",
    ];
    let v = json(&tessera(&args));
    assert!(v["final_loss"].as_f64().unwrap().is_finite(), "{v}");
    let before = std::fs::read(src.join("model.safetensors")).unwrap();
    let after = std::fs::read(save.join("model.safetensors")).unwrap();
    let (before, after) = (
        safetensors::SafeTensors::deserialize(&before).unwrap(),
        safetensors::SafeTensors::deserialize(&after).unwrap(),
    );
    let mut biases = 0;
    for layer in 1..3 {
        let name = format!("model.layers.{layer}.mlp.gate.e_score_correction_bias");
        let (b, a) = (before.tensor(&name).unwrap(), after.tensor(&name).unwrap());
        assert_eq!(a.dtype(), safetensors::Dtype::F32, "{name}");
        assert_eq!(b.data(), a.data(), "{name} changed in training");
        let w = format!("model.layers.{layer}.mlp.gate.weight");
        assert_ne!(before.tensor(&w).unwrap().data(), after.tensor(&w).unwrap().data(), "{w}");
        biases += 1;
    }
    assert_eq!(biases, 2);
    let tokens = "3,17,42,8,95,0,61,17";
    let e = json(&tessera(&[
        "eval",
        "--model-dir",
        save.to_str().unwrap(),
        "--tokens",
        tokens,
        "--format",
        "json",
    ]));
    assert!(e["loss"].as_f64().unwrap().is_finite(), "{e}");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// `eval` on each transformers checkpoint: logits within 1e-4 of transformers', and the loss
/// (cross-entropy + `router_aux_loss_coef` · load-balancing loss, as transformers computes with
/// `output_router_logits`) within 1e-5 relative — a bound far below the aux term itself. With
/// `output_router_logits: false` in its config.json the same checkpoint's loss is the
/// cross-entropy alone, as transformers' is then. DeepSeek-V3 (MLA, YaRN, group-limited
/// sigmoid routing with a non-zero correction bias, shared experts) has no auxiliary loss in
/// transformers.
#[test]
fn eval_matches_transformers_on_moe_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FAMILIES.into_iter().chain(["deepseek_v3"]) {
        let dir = fixtures().join(name);
        let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
        let expected: Value = serde_json::from_str(&text).unwrap();
        let tokens: Vec<String> = expected["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_i64().unwrap().to_string())
            .collect();
        let (loss, got) = eval(&dir, &tokens, name);
        let want = expected["loss"].as_f64().unwrap();
        let ce = expected["ce"].as_f64().unwrap();
        let aux = want - ce;
        if name == "deepseek_v3" {
            assert_eq!(aux, 0.0, "{name}: transformers adds no auxiliary loss");
        } else {
            assert!(aux > 1e-3 * want, "{name}: the fixture's aux term {aux} is too small to test");
        }
        assert!((loss - want).abs() <= 1e-5 * want, "{name}: loss {loss}, transformers {want}");
        let worst = max_diff(&got, &rows(&expected["logits"]), name);
        assert!(worst <= 1e-4, "{name}: logits differ from transformers' by up to {worst}");

        // Without the auxiliary loss: the same weights, output_router_logits false.
        let plain = tmp.path().join(name);
        std::fs::create_dir_all(&plain).unwrap();
        std::fs::copy(dir.join("model.safetensors"), plain.join("model.safetensors")).unwrap();
        let mut cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        cfg["output_router_logits"] = Value::Bool(false);
        std::fs::write(plain.join("config.json"), cfg.to_string()).unwrap();
        let (loss, got) = eval(&plain, &tokens, &format!("{name}-plain"));
        assert!((loss - ce).abs() <= 1e-5 * ce, "{name} without aux: loss {loss}, ce {ce}");
        assert!(max_diff(&got, &rows(&expected["logits"]), name) <= 1e-4, "{name} without aux");
    }
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array().expect("an array").iter().map(|x| x.as_i64().expect("an id")).collect()
}

/// `generate` of the fixture's prompts together (greedy) with `extra` arguments.
fn generate(dir: &Path, expected: &Value, extra: &[&str]) -> Value {
    let prompts: Vec<String> = expected["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| ids(p).iter().map(i64::to_string).collect::<Vec<_>>().join(","))
        .collect();
    let max = expected["max_new_tokens"].as_u64().unwrap().to_string();
    let mut args = vec!["generate", "--model-dir", dir.to_str().unwrap(), "--max-new-tokens", &max];
    for p in &prompts {
        args.extend(["--tokens", p]);
    }
    args.extend(["--format", "json"]);
    args.extend_from_slice(extra);
    json(&tessera(&args))
}

/// Greedy `generate` (KV cache) gives transformers' `generate` tokens on every MoE fixture, on
/// one device and under tp2, each device's measured peak its predicted one.
#[test]
fn greedy_generation_matches_transformers_on_moe_checkpoints() {
    for name in FAMILIES {
        let dir = fixtures().join(name);
        let text = std::fs::read_to_string(dir.join("generate.json")).unwrap();
        let expected: Value = serde_json::from_str(&text).unwrap();
        let want: Vec<Vec<i64>> =
            expected["new_tokens"].as_array().unwrap().iter().map(ids).collect();
        for devices in ["1", "2"] {
            let r = generate(&dir, &expected, &["--devices", devices]);
            let got: Vec<Vec<i64>> = r["new_tokens"].as_array().unwrap().iter().map(ids).collect();
            assert_eq!(
                got, want,
                "{name} on {devices} device(s): tokens differ from transformers'"
            );
            let m = &r["memory"];
            assert_eq!(m["measured_peak_bytes"], m["predicted_peak_bytes"], "{name}: {m}");
        }
    }
}

/// Parameter counts of the released MoE presets equal transformers' (`param_counts.json`:
/// the model built from each checkpoint's config.json on the meta device), both as presets
/// and read from those config.json files.
#[test]
fn released_moe_parameter_counts_equal_transformers() {
    let text = std::fs::read_to_string(fixtures().join("param_counts.json")).unwrap();
    let counts: Value = serde_json::from_str(&text).unwrap();
    let counts = counts.as_object().unwrap();
    assert_eq!(counts.len(), 6, "{counts:?}");
    for (preset, want) in counts {
        let file = fixtures().join("real_configs").join(format!("{preset}.json"));
        for model in [preset.as_str(), file.to_str().unwrap()] {
            let v = json(&tessera(&["profile", "--model", model, "--format", "json"]));
            assert_eq!(&v["params"], want, "{model}");
        }
    }
}
