//! Checkpoints: Hugging Face weight import (exact, prefix-less, tied aliases, shards, dtype
//! conversion, every kind of mismatch) and the save/resume directory (bit-exact round trip,
//! version check, and the atomicity protocol under simulated crashes).

use candle_core::{DType as CDType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tessera_ir::{DType, Graph, StateKind, TensorId};
use tessera_models::{build, BuildOptions, Gpt2Params, LlamaParams, LlamaVariant, ModelConfig};
use tessera_runtime::checkpoint::{
    load_checkpoint, load_hf_weights, optimizer_key, save_checkpoint, Manifest, FORMAT_VERSION,
};
use tessera_runtime::{LrSchedule, RuntimeError};

// ---- helpers ---------------------------------------------------------------------------------

/// Tensors by name, in order.
type Named = Vec<(String, Tensor)>;

/// A fresh, empty scratch directory for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("checkpoint-tests").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn graph_of(cfg: &ModelConfig, dtype: DType) -> Graph {
    build(cfg, &BuildOptions::new(1, 8, dtype)).unwrap().builder.graph
}

/// A small GPT-2 (tied head, as GPT-2 is).
fn gpt2_small() -> ModelConfig {
    let p = Gpt2Params::new("gpt2-small-test", 64, 16, 32, 2, 4);
    ModelConfig::Gpt2(tessera_models::Gpt2Config::new(p).unwrap())
}

/// A small LLaMA with `tie_word_embeddings` (no `lm_head.weight` parameter).
fn llama_tied() -> ModelConfig {
    let mut p = LlamaParams::new(LlamaVariant::Llama, "llama-tied-test", 64, 32, 48, 2, 4);
    p.num_key_value_heads = 2;
    p.tie_word_embeddings = true;
    ModelConfig::Llama(tessera_models::LlamaConfig::new(p).unwrap())
}

fn random_tensor(rng: &mut StdRng, dims: &[usize], dtype: CDType) -> Tensor {
    let n: usize = dims.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(data, dims, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

/// Random values for every parameter, by HF name, in the graph's dtype.
fn random_params(graph: &Graph, seed: u64) -> Vec<(String, Tensor)> {
    let mut rng = StdRng::seed_from_u64(seed);
    graph
        .parameters()
        .into_iter()
        .map(|p| {
            let dtype = tessera_runtime::tensor::candle_dtype(graph.meta(p).dtype);
            (
                graph.tensor_scope(p).to_string(),
                random_tensor(&mut rng, graph.shape(p).dims(), dtype),
            )
        })
        .collect()
}

/// Random AdamW state (m, v, and an f32 master for low-precision weights).
fn random_optimizer(params: &[(String, Tensor)], seed: u64) -> Vec<(String, Tensor)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for (name, t) in params {
        out.push((
            optimizer_key(name, StateKind::AdamM),
            random_tensor(&mut rng, t.dims(), CDType::F32),
        ));
        out.push((
            optimizer_key(name, StateKind::AdamV),
            random_tensor(&mut rng, t.dims(), CDType::F32),
        ));
        if t.dtype() != CDType::F32 {
            out.push((optimizer_key(name, StateKind::Master), t.to_dtype(CDType::F32).unwrap()));
        }
    }
    out
}

/// The raw bytes of a tensor (bit-exact comparisons, any dtype).
fn bits(t: &Tensor) -> (CDType, Vec<usize>, Vec<u64>) {
    let flat = t.flatten_all().unwrap();
    let words = match t.dtype() {
        CDType::F32 => flat.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits() as u64).collect(),
        CDType::BF16 => {
            flat.to_vec1::<half::bf16>().unwrap().iter().map(|x| x.to_bits() as u64).collect()
        }
        CDType::F16 => {
            flat.to_vec1::<half::f16>().unwrap().iter().map(|x| x.to_bits() as u64).collect()
        }
        CDType::F64 => flat.to_vec1::<f64>().unwrap().iter().map(|x| x.to_bits()).collect(),
        other => panic!("unexpected dtype {other:?}"),
    };
    (t.dtype(), t.dims().to_vec(), words)
}

fn assert_same_tensors(got: &HashMap<String, Tensor>, want: &[(String, Tensor)], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: tensor count");
    for (name, t) in want {
        let g = got.get(name).unwrap_or_else(|| panic!("{what}: {name} missing"));
        assert!(bits(g) == bits(t), "{what}: {name} differs");
    }
}

/// `load_hf_weights`' result matches `want` (by name, in parameter order), bit for bit.
fn assert_loaded(graph: &Graph, got: &[(TensorId, Tensor)], want: &[(String, Tensor)]) {
    let order: Vec<TensorId> = graph.parameters();
    assert_eq!(got.iter().map(|(p, _)| *p).collect::<Vec<_>>(), order, "parameter order");
    for ((p, t), (name, w)) in got.iter().zip(want) {
        assert_eq!(graph.tensor_scope(*p), name);
        assert!(bits(t) == bits(w), "{name} differs");
    }
}

/// Writes tensors the way `candle_core::safetensors::save` does (no metadata).
fn write_st(path: &Path, tensors: &[(String, Tensor)]) {
    let map: HashMap<String, Tensor> = tensors.iter().cloned().collect();
    candle_core::safetensors::save(&map, path).unwrap();
}

/// A loaded manifest without the checksums its save added (checking they are there: every
/// file the checkpoint holds but the manifest itself).
fn without_checksums(m: &Manifest) -> Manifest {
    assert!(m.checksums.contains_key("config.json"), "{:?}", m.checksums.keys());
    assert!(
        m.checksums.keys().all(|k| k.ends_with(".safetensors") || k == "config.json"),
        "{:?}",
        m.checksums.keys()
    );
    let mut m = m.clone();
    m.checksums.clear();
    m
}

fn manifest(step: u64) -> Manifest {
    let schedule = LrSchedule::WarmupCosine { peak: 1e-3, min_lr: 1e-4, warmup: 10, total: 100 };
    let mut m = Manifest::new(step, 100, 1234, "llama-tiny", schedule);
    m.extra = serde_json::json!({ "data_offset": step * 4096, "note": "test" });
    m
}

fn error_text<T: std::fmt::Debug>(r: Result<T, RuntimeError>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Saves a checkpoint of `cfg` with values from `seed`; returns (params, optimizer).
fn save_random(
    dir: &Path,
    cfg: &ModelConfig,
    dtype: DType,
    seed: u64,
    step: u64,
) -> (Named, Named) {
    let graph = graph_of(cfg, dtype);
    let params = random_params(&graph, seed);
    let optimizer = random_optimizer(&params, seed + 1);
    save_checkpoint(dir, &cfg.to_hf_json(), &params, &optimizer, &manifest(step)).unwrap();
    (params, optimizer)
}

// ---- save / load round trip ------------------------------------------------------------------

#[test]
fn save_then_load_is_bit_exact() {
    let root = scratch("round-trip");
    let dir = root.join("ckpt");
    let cfg = ModelConfig::preset("llama-tiny").unwrap();
    let (params, optimizer) = save_random(&dir, &cfg, DType::F32, 1, 7);

    assert_eq!(
        entries(&dir),
        ["config.json", "manifest.json", "model.safetensors", "optimizer.safetensors"]
    );
    assert_eq!(entries(&root), ["ckpt"], "no temporary or old directory is left");

    let ck = load_checkpoint(&dir).unwrap();
    assert_eq!(without_checksums(&ck.manifest), manifest(7));
    assert_eq!(ck.manifest.format_version, FORMAT_VERSION);
    assert_eq!(ck.config_json, cfg.to_hf_json());
    assert_eq!(ModelConfig::from_hf_json(&ck.config_json.to_string()).unwrap(), {
        // Unstated dtype is written as float32.
        let mut p = match cfg.clone() {
            ModelConfig::Llama(c) => c.into_params(),
            _ => unreachable!(),
        };
        p.dtype = Some(DType::F32);
        ModelConfig::Llama(tessera_models::LlamaConfig::new(p).unwrap())
    });
    assert_same_tensors(&ck.params, &params, "params");
    assert_same_tensors(&ck.optimizer, &optimizer, "optimizer");
    assert_eq!(ck.dir, dir);

    // The directory is a Hugging Face model directory: weights load by name, and the file
    // carries transformers' {"format": "pt"} metadata.
    let graph = graph_of(&cfg, DType::F32);
    assert_loaded(&graph, &load_hf_weights(&dir, &graph).unwrap(), &params);
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        meta.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str),
        Some("pt")
    );
}

#[test]
fn bf16_weights_and_master_state_round_trip_in_their_dtypes() {
    let dir = scratch("bf16").join("ckpt");
    let (params, optimizer) = save_random(&dir, &llama_tied(), DType::BF16, 3, 1);
    // bf16 mixed precision holds the norms' weights in fp32 (autocast's policy), the rest in
    // bf16.
    let fp32 = |n: &str| n.contains("norm");
    assert!(params
        .iter()
        .all(|(n, t)| t.dtype() == if fp32(n) { CDType::F32 } else { CDType::BF16 }));
    assert!(params.iter().any(|(n, _)| !fp32(n)));
    assert!(optimizer.iter().any(|(n, _)| n.ends_with(".master")));
    let ck = load_checkpoint(&dir).unwrap();
    assert_same_tensors(&ck.params, &params, "params");
    assert_same_tensors(&ck.optimizer, &optimizer, "optimizer");
    assert_eq!(ck.config_json["torch_dtype"], "bfloat16", "config states the saved dtype");
    assert!(!ck.params.contains_key("lm_head.weight"), "tied tensors are stored once");
}

#[test]
fn saving_again_replaces_the_checkpoint_and_leaves_nothing_behind() {
    let root = scratch("resave");
    let dir = root.join("ckpt");
    let cfg = gpt2_small();
    save_random(&dir, &cfg, DType::F32, 1, 10);
    let (params, optimizer) = save_random(&dir, &cfg, DType::F32, 2, 20);
    let ck = load_checkpoint(&dir).unwrap();
    assert_eq!(ck.manifest.step, 20);
    assert_same_tensors(&ck.params, &params, "params");
    assert_same_tensors(&ck.optimizer, &optimizer, "optimizer");
    assert_eq!(entries(&root), ["ckpt"]);
}

#[test]
fn inconsistent_optimizer_state_is_refused_before_writing() {
    let dir = scratch("bad-optimizer").join("ckpt");
    let graph = graph_of(&gpt2_small(), DType::F32);
    let params = random_params(&graph, 1);
    let mut optimizer = random_optimizer(&params, 2);
    optimizer.push(("transformer.nope.weight.adam_m".into(), params[0].1.clone()));
    optimizer.push(("transformer.wte.weight.momentum".into(), params[0].1.clone()));
    let wrong = random_tensor(&mut StdRng::seed_from_u64(0), &[3], CDType::F32);
    optimizer.push((optimizer_key("transformer.ln_f.weight", StateKind::Master), wrong));
    let msg = error_text(save_checkpoint(
        &dir,
        &gpt2_small().to_hf_json(),
        &params,
        &optimizer,
        &manifest(1),
    ));
    assert!(msg.contains("no parameter transformer.nope.weight"), "{msg}");
    assert!(msg.contains("transformer.wte.weight.momentum"), "{msg}");
    assert!(msg.contains("transformer.ln_f.weight.master has shape [3]"), "{msg}");
    assert!(!dir.exists());
}

#[test]
fn unknown_manifest_version_is_named() {
    let dir = scratch("version").join("ckpt");
    save_random(&dir, &gpt2_small(), DType::F32, 1, 1);
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    m["format_version"] = 2.into();
    std::fs::write(&path, m.to_string()).unwrap();
    let msg = error_text(load_checkpoint(&dir));
    assert!(msg.contains("format_version 2 is not supported"), "{msg}");
    assert!(msg.contains("reads version 1"), "{msg}");
    assert!(msg.contains("manifest.json"), "{msg}");
}

#[test]
fn missing_or_foreign_checkpoint_directories_are_explained() {
    let root = scratch("missing-dir");
    let msg = error_text(load_checkpoint(&root.join("nowhere")));
    assert!(msg.contains("nowhere") && msg.contains("does not exist"), "{msg}");
    // A Hugging Face model directory is not a resumable checkpoint.
    let hf = root.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    let graph = graph_of(&gpt2_small(), DType::F32);
    write_st(&hf.join("model.safetensors"), &random_params(&graph, 1));
    let msg = error_text(load_checkpoint(&hf));
    assert!(msg.contains("no manifest.json") && msg.contains("load_hf_weights"), "{msg}");
}

// ---- atomicity ---------------------------------------------------------------------------------

#[test]
fn a_save_killed_while_writing_leaves_the_previous_checkpoint() {
    let root = scratch("killed-writing");
    let dir = root.join("ckpt");
    let cfg = gpt2_small();
    let (params, _) = save_random(&dir, &cfg, DType::F32, 1, 10);
    // The killed save got as far as half a model file in its temporary directory.
    let tmp = root.join("ckpt.tmp-999999");
    std::fs::create_dir(&tmp).unwrap();
    let full = std::fs::read(dir.join("model.safetensors")).unwrap();
    std::fs::write(tmp.join("model.safetensors"), &full[..full.len() / 2]).unwrap();

    let ck = load_checkpoint(&dir).unwrap();
    assert_eq!(ck.manifest.step, 10);
    assert_same_tensors(&ck.params, &params, "params");
    // The next save clears the leftover.
    save_random(&dir, &cfg, DType::F32, 2, 20);
    assert_eq!(entries(&root), ["ckpt"]);
    assert_eq!(load_checkpoint(&dir).unwrap().manifest.step, 20);
}

#[test]
fn a_save_killed_between_its_renames_is_recovered() {
    let root = scratch("killed-renaming");
    let dir = root.join("ckpt");
    let cfg = gpt2_small();
    let (params, optimizer) = save_random(&dir, &cfg, DType::F32, 1, 10);
    // The killed save had renamed DIR → DIR.old-<pid>, not yet DIR.tmp-<pid> → DIR.
    std::fs::rename(&dir, root.join("ckpt.old-424242")).unwrap();
    let tmp = root.join("ckpt.tmp-424242");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::write(tmp.join("model.safetensors"), b"partial").unwrap();
    assert!(!dir.exists());

    let ck = load_checkpoint(&dir).unwrap();
    assert_eq!(without_checksums(&ck.manifest), manifest(10));
    assert_same_tensors(&ck.params, &params, "params");
    assert_same_tensors(&ck.optimizer, &optimizer, "optimizer");
    assert_eq!(ck.dir, dir);
    assert!(dir.is_dir(), "recovery renamed the previous checkpoint back");
    assert_eq!(entries(&root), ["ckpt", "ckpt.tmp-424242"]);

    save_random(&dir, &cfg, DType::F32, 2, 20);
    assert_eq!(entries(&root), ["ckpt"]);
}

#[test]
fn a_save_killed_before_removing_the_old_copy_has_already_committed() {
    let root = scratch("killed-cleanup");
    let dir = root.join("ckpt");
    let cfg = gpt2_small();
    save_random(&dir, &cfg, DType::F32, 1, 10);
    // The crash window: the new DIR is in place, the previous one still sits in DIR.old-<pid>.
    let old = root.join("ckpt.old-31337");
    std::fs::create_dir(&old).unwrap();
    for f in entries(&dir) {
        std::fs::copy(dir.join(&f), old.join(&f)).unwrap();
    }
    let (params, _) = save_random(&dir, &cfg, DType::F32, 2, 20);
    assert_eq!(entries(&root), ["ckpt"], "the save removed the stale old copy");
    std::fs::create_dir(&old).unwrap();
    std::fs::write(old.join("manifest.json"), "{}").unwrap();
    let ck = load_checkpoint(&dir).unwrap();
    assert_eq!(ck.manifest.step, 20, "DIR wins over any DIR.old-*");
    assert_same_tensors(&ck.params, &params, "params");
}

// ---- Hugging Face weights ------------------------------------------------------------------------

#[test]
fn hf_weights_load_by_exact_name() {
    let dir = scratch("hf-exact");
    let cfg = ModelConfig::preset("gpt2-tiny").unwrap();
    let graph = graph_of(&cfg, DType::F32);
    let params = random_params(&graph, 5);
    write_st(&dir.join("model.safetensors"), &params);
    // A directory, and the file itself.
    assert_loaded(&graph, &load_hf_weights(&dir, &graph).unwrap(), &params);
    assert_loaded(
        &graph,
        &load_hf_weights(&dir.join("model.safetensors"), &graph).unwrap(),
        &params,
    );
}

#[test]
fn hf_base_model_checkpoints_without_prefix_load_and_buffers_are_skipped() {
    let dir = scratch("hf-prefixless");
    // GPT-2's original checkpoint: `h.0.attn.c_attn.weight`, `wte.weight`, plus the causal
    // mask buffers `h.N.attn.bias` / `h.N.attn.masked_bias`.
    let cfg = gpt2_small();
    let graph = graph_of(&cfg, DType::F32);
    let params = random_params(&graph, 6);
    let mut stored: Vec<(String, Tensor)> = params
        .iter()
        .map(|(n, t)| (n.strip_prefix("transformer.").unwrap_or(n).to_string(), t.clone()))
        .collect();
    assert!(stored.iter().any(|(n, _)| n == "h.0.attn.c_attn.weight"));
    let mask = Tensor::ones((1, 1, 16, 16), CDType::U8, &Device::Cpu).unwrap();
    stored.push(("h.0.attn.bias".into(), mask.clone()));
    stored.push(("h.1.attn.masked_bias".into(), Tensor::new(-1e4f32, &Device::Cpu).unwrap()));
    let file = dir.join("gpt2.safetensors");
    write_st(&file, &stored);
    assert_loaded(&graph, &load_hf_weights(&file, &graph).unwrap(), &params);

    // A tied LLaMA base model (`layers.0...`, `embed_tokens.weight`) with RoPE buffers.
    let cfg = llama_tied();
    let graph = graph_of(&cfg, DType::F32);
    let params = random_params(&graph, 7);
    let mut stored: Vec<(String, Tensor)> = params
        .iter()
        .map(|(n, t)| (n.strip_prefix("model.").unwrap().to_string(), t.clone()))
        .collect();
    let inv = Tensor::ones(4, CDType::F32, &Device::Cpu).unwrap();
    stored.push(("layers.0.self_attn.rotary_emb.inv_freq".into(), inv));
    let file = dir.join("llama.safetensors");
    write_st(&file, &stored);
    assert_loaded(&graph, &load_hf_weights(&file, &graph).unwrap(), &params);
}

#[test]
fn hf_tied_models_accept_a_redundant_lm_head_equal_to_the_embedding() {
    let dir = scratch("hf-tied");
    let cfg = llama_tied();
    let graph = graph_of(&cfg, DType::F32);
    assert!(graph.find_leaf("lm_head.weight").is_none(), "tied: one parameter");
    let params = random_params(&graph, 8);
    let embed = params.iter().find(|(n, _)| n == "model.embed_tokens.weight").unwrap().1.clone();

    let mut stored = params.clone();
    stored.push(("lm_head.weight".into(), embed.clone()));
    write_st(&dir.join("model.safetensors"), &stored);
    assert_loaded(&graph, &load_hf_weights(&dir, &graph).unwrap(), &params);

    // Only the head stored (the embedding dropped as its tied duplicate): it fills the parameter.
    let only_head: Vec<(String, Tensor)> = params
        .iter()
        .map(|(n, t)| {
            if n == "model.embed_tokens.weight" {
                ("lm_head.weight".to_string(), t.clone())
            } else {
                (n.clone(), t.clone())
            }
        })
        .collect();
    write_st(&dir.join("model.safetensors"), &only_head);
    assert_loaded(&graph, &load_hf_weights(&dir, &graph).unwrap(), &params);

    // A head that differs means the checkpoint was not tied.
    let mut stored = params.clone();
    stored.push(("lm_head.weight".into(), (embed + 1.0).unwrap()));
    write_st(&dir.join("model.safetensors"), &stored);
    let msg = error_text(load_hf_weights(&dir, &graph));
    assert!(msg.contains("lm_head.weight differs from model.embed_tokens.weight"), "{msg}");
    assert!(msg.contains("tie_word_embeddings"), "{msg}");
}

#[test]
fn hf_half_precision_weights_are_converted_to_the_parameter_dtype() {
    let dir = scratch("hf-dtypes");
    let cfg = gpt2_small();
    let graph = graph_of(&cfg, DType::F32);
    let params = random_params(&graph, 9);
    // Alternate bf16, f16 and f64 storage; values representable in bf16 convert exactly.
    let dtypes = [CDType::BF16, CDType::F16, CDType::F64];
    let stored: Vec<(String, Tensor)> = params
        .iter()
        .enumerate()
        .map(|(i, (n, t))| (n.clone(), t.to_dtype(dtypes[i % 3]).unwrap()))
        .collect();
    write_st(&dir.join("model.safetensors"), &stored);
    let want: Vec<(String, Tensor)> =
        stored.iter().map(|(n, t)| (n.clone(), t.to_dtype(CDType::F32).unwrap())).collect();
    let got = load_hf_weights(&dir, &graph).unwrap();
    assert!(got.iter().all(|(_, t)| t.dtype() == CDType::F32));
    assert_loaded(&graph, &got, &want);

    // Into a bf16 model: f32 weights are rounded to bf16, but for the norms', which bf16 mixed
    // precision holds in fp32.
    let graph = graph_of(&cfg, DType::BF16);
    write_st(&dir.join("model.safetensors"), &params);
    let held = |n: &str| match n.contains("ln_") {
        true => CDType::F32,
        false => CDType::BF16,
    };
    let want: Vec<(String, Tensor)> =
        params.iter().map(|(n, t)| (n.clone(), t.to_dtype(held(n)).unwrap())).collect();
    assert!(want.iter().any(|(_, t)| t.dtype() == CDType::BF16));
    assert_loaded(&graph, &load_hf_weights(&dir, &graph).unwrap(), &want);
}

#[test]
fn hf_sharded_checkpoints_load_through_their_index() {
    let dir = scratch("hf-sharded");
    let cfg = ModelConfig::preset("llama-tiny").unwrap();
    let graph = graph_of(&cfg, DType::F32);
    let params = random_params(&graph, 10);
    let half = params.len() / 2;
    let shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
    write_st(&dir.join(shards[0]), &params[..half]);
    write_st(&dir.join(shards[1]), &params[half..]);
    let weight_map: serde_json::Map<String, serde_json::Value> = params
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.clone(), shards[usize::from(i >= half)].into()))
        .collect();
    let index = serde_json::json!({ "metadata": { "total_size": 0 }, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert_loaded(&graph, &load_hf_weights(&dir, &graph).unwrap(), &params);
    assert_loaded(
        &graph,
        &load_hf_weights(&dir.join("model.safetensors.index.json"), &graph).unwrap(),
        &params,
    );

    // A missing shard is named.
    std::fs::remove_file(dir.join(shards[1])).unwrap();
    let msg = error_text(load_hf_weights(&dir, &graph));
    assert!(msg.contains(shards[1]) && msg.contains("incomplete"), "{msg}");
}

#[test]
fn hf_bert_legacy_names_and_unbuilt_heads() {
    let dir = scratch("hf-bert");
    let p = tessera_models::BertParams::new("bert-test", 50, 16, 1, 2, 32, 20);
    let cfg = ModelConfig::Bert(tessera_models::BertConfig::new(p).unwrap());
    let graph = graph_of(&cfg, DType::F32);
    let params = random_params(&graph, 11);
    let get = |name: &str| params.iter().find(|(n, _)| n == name).unwrap().1.clone();
    // Old checkpoints: LayerNorm gamma/beta, the pooler and NSP head, tied decoder aliases.
    let mut stored: Vec<(String, Tensor)> = params
        .iter()
        .map(|(n, t)| {
            let n = n
                .replace("LayerNorm.weight", "LayerNorm.gamma")
                .replace("LayerNorm.bias", "LayerNorm.beta");
            (n, t.clone())
        })
        .collect();
    let mut rng = StdRng::seed_from_u64(0);
    stored
        .push(("bert.pooler.dense.weight".into(), random_tensor(&mut rng, &[16, 16], CDType::F32)));
    stored.push((
        "cls.seq_relationship.weight".into(),
        random_tensor(&mut rng, &[2, 16], CDType::F32),
    ));
    stored.push((
        "bert.embeddings.position_ids".into(),
        Tensor::zeros((1, 20), CDType::I64, &Device::Cpu).unwrap(),
    ));
    stored.push((
        "cls.predictions.decoder.weight".into(),
        get("bert.embeddings.word_embeddings.weight"),
    ));
    stored.push(("cls.predictions.decoder.bias".into(), get("cls.predictions.bias")));
    write_st(&dir.join("model.safetensors"), &stored);
    assert_loaded(&graph, &load_hf_weights(&dir, &graph).unwrap(), &params);
}

#[test]
fn hf_mismatches_are_all_reported_by_name_in_one_error() {
    let dir = scratch("hf-mismatch");
    let cfg = gpt2_small();
    let graph = graph_of(&cfg, DType::F32);
    let params = random_params(&graph, 12);
    let mut rng = StdRng::seed_from_u64(1);
    let mut stored: Vec<(String, Tensor)> = params
        .iter()
        .filter(|(n, _)| n != "transformer.h.1.mlp.c_fc.bias" && n != "transformer.ln_f.bias")
        .map(|(n, t)| {
            if n == "transformer.wpe.weight" {
                (n.clone(), random_tensor(&mut rng, &[32, 32], CDType::F32))
            } else if n == "transformer.h.0.ln_1.weight" {
                (n.clone(), Tensor::zeros(32, CDType::I64, &Device::Cpu).unwrap())
            } else {
                (n.clone(), t.clone())
            }
        })
        .collect();
    stored.push((
        "transformer.h.2.attn.c_attn.weight".into(),
        random_tensor(&mut rng, &[32, 96], CDType::F32),
    ));
    stored.push(("score.weight".into(), random_tensor(&mut rng, &[2, 32], CDType::F32)));
    write_st(&dir.join("model.safetensors"), &stored);
    let msg = error_text(load_hf_weights(&dir, &graph));
    for needle in [
        "6 problems",
        "missing from the checkpoint (2)",
        "transformer.h.1.mlp.c_fc.bias [128]",
        "transformer.ln_f.bias [32]",
        "not in the model (2)",
        "transformer.h.2.attn.c_attn.weight [32, 96]",
        "score.weight [2, 32]",
        "wrong shape (1)",
        "transformer.wpe.weight: checkpoint [32, 32], model [16, 32]",
        "unsupported dtype",
        "transformer.h.0.ln_1.weight: I64",
        "does config.json match these weights?",
        "model.safetensors",
    ] {
        assert!(msg.contains(needle), "missing {needle:?} in:\n{msg}");
    }
}

#[test]
fn hf_bad_files_are_named() {
    let dir = scratch("hf-bad-files");
    let graph = graph_of(&gpt2_small(), DType::F32);

    let msg = error_text(load_hf_weights(&dir.join("absent"), &graph));
    assert!(msg.contains("absent") && msg.contains("no such file or directory"), "{msg}");
    let msg = error_text(load_hf_weights(&dir, &graph));
    assert!(msg.contains("no model.safetensors or model.safetensors.index.json"), "{msg}");

    // Random bytes.
    let mut rng = StdRng::seed_from_u64(2);
    let junk: Vec<u8> = (0..4096).map(|_| rng.random()).collect();
    let file = dir.join("model.safetensors");
    std::fs::write(&file, junk).unwrap();
    let msg = error_text(load_hf_weights(&dir, &graph));
    assert!(msg.contains("model.safetensors") && msg.contains("corrupt or truncated"), "{msg}");

    // A valid file cut short.
    write_st(&file, &random_params(&graph, 3));
    let full = std::fs::read(&file).unwrap();
    std::fs::write(&file, &full[..full.len() - 100]).unwrap();
    let msg = error_text(load_hf_weights(&dir, &graph));
    assert!(msg.contains("model.safetensors") && msg.contains("corrupt or truncated"), "{msg}");

    // The same for a checkpoint's optimizer file.
    let ck = dir.join("ckpt");
    save_random(&ck, &gpt2_small(), DType::F32, 1, 1);
    let opt = ck.join("optimizer.safetensors");
    let full = std::fs::read(&opt).unwrap();
    std::fs::write(&opt, &full[..full.len() / 3]).unwrap();
    let msg = error_text(load_checkpoint(&ck));
    assert!(msg.contains("optimizer.safetensors") && msg.contains("corrupt or truncated"), "{msg}");
}

#[test]
fn saving_over_a_directory_that_is_not_a_checkpoint_is_refused() {
    let root = scratch("foreign-dir");
    let dir = root.join("runs");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "precious").unwrap();
    let graph = graph_of(&gpt2_small(), DType::F32);
    let params = random_params(&graph, 1);
    let msg =
        error_text(save_checkpoint(&dir, &gpt2_small().to_hf_json(), &params, &[], &manifest(1)));
    assert!(msg.contains("is not a Tessera checkpoint"), "{msg}");
    assert_eq!(std::fs::read_to_string(dir.join("notes.txt")).unwrap(), "precious");
    assert_eq!(entries(&root), ["runs"]);
    // An empty directory is fine, and an optimizer-free checkpoint loads.
    let empty = root.join("empty");
    std::fs::create_dir(&empty).unwrap();
    save_checkpoint(&empty, &gpt2_small().to_hf_json(), &params, &[], &manifest(1)).unwrap();
    let ck = load_checkpoint(&empty).unwrap();
    assert!(ck.optimizer.is_empty());
    assert_same_tensors(&ck.params, &params, "params");
}

/// A device reads its shard of a mapped checkpoint: equal, bit for bit, to slicing the whole
/// tensor, for every parameter under row, column and 2-axis splits and in another dtype; a
/// tied alias that differs is caught on the slice read.
#[test]
fn shards_read_from_the_file_equal_slices_of_the_whole_tensors() {
    use tessera_runtime::collective::{shard, DeviceMesh};
    use tessera_runtime::hf_weights::HfWeights;
    let dir = scratch("hf-shards");
    let graph = graph_of(&llama_tied(), DType::F32);
    let params = random_params(&graph, 11);
    let embed = params.iter().find(|(n, _)| n == "model.embed_tokens.weight").unwrap().1.clone();
    let mut stored = params.clone();
    stored.push(("lm_head.weight".into(), embed.clone()));
    write_st(&dir.join("model.safetensors"), &stored);
    let weights = HfWeights::open(&dir, &graph).unwrap();
    let whole: HashMap<String, Tensor> = params.into_iter().collect();
    let mut checked = 0;
    for (name, global) in &whole {
        let rank = global.dims().len();
        let mut placements = vec![vec![Vec::new(); rank]];
        placements.push((0..rank).map(|d| if d == 0 { vec![0] } else { vec![] }).collect());
        placements.push((0..rank).map(|d| if d + 1 == rank { vec![1] } else { vec![] }).collect());
        if rank == 2 {
            placements.push(vec![vec![1], vec![0]]);
        }
        for placement in &placements {
            for r in 0..4 {
                let mesh = DeviceMesh::new(&[2, 2], r).unwrap();
                let want = shard(&mesh, global, placement, name).unwrap();
                let got = weights.shard(name, placement, &mesh, CDType::F32).unwrap();
                assert_eq!(got.dims(), want.dims(), "{name} {placement:?} rank {r}");
                let (g, w) = (got.flatten_all().unwrap(), want.flatten_all().unwrap());
                assert_eq!(g.to_vec1::<f32>().unwrap(), w.to_vec1::<f32>().unwrap(), "{name}");
                let half = weights.shard(name, placement, &mesh, CDType::BF16).unwrap();
                assert_eq!(
                    half.to_dtype(CDType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap(),
                    w.to_dtype(CDType::BF16)
                        .unwrap()
                        .to_dtype(CDType::F32)
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 50, "{checked}");

    // Untied values: the rank whose slice differs reports it.
    let mut stored = whole.clone().into_iter().collect::<Vec<_>>();
    let mut head = embed.to_vec2::<f32>().unwrap();
    head[63][31] += 1.0;
    stored.push(("lm_head.weight".into(), Tensor::new(head, &Device::Cpu).unwrap()));
    write_st(&dir.join("model.safetensors"), &stored);
    let weights = HfWeights::open(&dir, &graph).unwrap();
    let rows = vec![vec![0], vec![]];
    let first = DeviceMesh::new(&[2, 2], 0).unwrap();
    let last = DeviceMesh::new(&[2, 2], 3).unwrap();
    let name = "model.embed_tokens.weight";
    assert!(weights.shard(name, &rows, &first, CDType::F32).is_ok(), "rows 0..32 agree");
    let msg = weights.shard(name, &rows, &last, CDType::F32).unwrap_err().to_string();
    assert!(msg.contains("lm_head.weight differs from model.embed_tokens.weight"), "{msg}");
}

/// A buffer the model skips may have a dtype Tessera cannot read (a bool causal mask, as some
/// `transformers` versions store): the weights still load; a parameter of such a dtype is named.
#[test]
fn hf_skipped_buffers_of_unreadable_dtypes_do_not_stop_a_load() {
    struct Raw(safetensors::Dtype, Vec<usize>, Vec<u8>);
    impl safetensors::View for &Raw {
        fn dtype(&self) -> safetensors::Dtype {
            self.0
        }
        fn shape(&self) -> &[usize] {
            &self.1
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(&self.2)
        }
        fn data_len(&self) -> usize {
            self.2.len()
        }
    }
    let raw = |t: &Tensor| {
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        Raw(
            safetensors::Dtype::F32,
            t.dims().to_vec(),
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
    };
    let dir = scratch("hf-bool-buffer");
    let graph = graph_of(&gpt2_small(), DType::F32);
    let params = random_params(&graph, 3);
    let mask = Raw(safetensors::Dtype::BOOL, vec![1, 1, 4, 4], vec![1; 16]);
    let mut views: Vec<(String, Raw)> = params.iter().map(|(n, t)| (n.clone(), raw(t))).collect();
    views.push(("transformer.h.0.attn.bias".into(), mask));
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views.iter().map(|(n, r)| (n.as_str(), r)), None, &path)
        .unwrap();
    assert_loaded(&graph, &load_hf_weights(&dir, &graph).unwrap(), &params);

    // A parameter stored as bool is named with its dtype.
    let wte = views.iter().position(|(n, _)| n == "transformer.wte.weight").unwrap();
    let dims = views[wte].1 .1.clone();
    views[wte].1 = Raw(safetensors::Dtype::BOOL, dims.clone(), vec![0; dims.iter().product()]);
    safetensors::serialize_to_file(views.iter().map(|(n, r)| (n.as_str(), r)), None, &path)
        .unwrap();
    let msg = error_text(load_hf_weights(&dir, &graph));
    assert!(msg.contains("transformer.wte.weight: BOOL"), "{msg}");
}
