//! BLOOM (`BloomForCausalLM`): Hugging Face names and shapes, the configs `transformers`
//! wrote for the parity fixtures, logits and greedy generation on those fixtures' weights
//! (through the f64 reference interpreter) against what `transformers` computed, and the
//! generation graph's KV caches.
//!
//! The fixtures live in `crates/tessera-cli/tests/fixtures/hf/{bloom,bloom-6heads}` (see the
//! README there): `config.json`, `model.safetensors` (fp32) and `expected.json` /
//! `generate.json` written by transformers 4.46.3.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use tessera_ir::interp::{self, Value};
use tessera_ir::{DType, Graph, Op, TensorId, TensorMeta};
use tessera_models::{
    build, build_generation, BloomConfig, BloomParams, BuildOptions, GenerateOptions, InputKind,
    ModelConfig, ModelError,
};

fn hf_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tessera-cli/tests/fixtures/hf").join(name)
}

fn bloom(cfg: &ModelConfig) -> &BloomConfig {
    match cfg {
        ModelConfig::Bloom(c) => c,
        other => panic!("expected a bloom config, got {}", other.family()),
    }
}

/// Parameter name → shape.
fn params(g: &Graph) -> BTreeMap<String, Vec<usize>> {
    g.parameters()
        .into_iter()
        .map(|p| (g.tensor_scope(p).to_string(), g.shape(p).dims().to_vec()))
        .collect()
}

/// The tensors of a safetensors file: name → (shape, f32 values). Only F32 is expected.
fn read_safetensors(path: &PathBuf) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out = BTreeMap::new();
    for (name, t) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        assert_eq!(t["dtype"], "F32", "{name}");
        let shape: Vec<usize> =
            t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
        let [start, end] = [0, 1].map(|i| t["data_offsets"][i].as_u64().unwrap() as usize);
        let values: Vec<f32> = data[start..end]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(values.len(), shape.iter().product::<usize>(), "{name}");
        out.insert(name.clone(), (shape, values));
    }
    out
}

fn read_json(path: PathBuf) -> serde_json::Value {
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<i64> {
    v.as_array().unwrap().iter().map(|t| t.as_i64().unwrap()).collect()
}

/// The checkpoint's weights bound to the graph's parameters (by name, as f64).
fn bind_weights(g: &Graph, path: &PathBuf) -> HashMap<TensorId, Value> {
    let weights = read_safetensors(path);
    g.parameters()
        .into_iter()
        .map(|p| {
            let name = g.tensor_scope(p);
            let (shape, values) =
                weights.get(name).unwrap_or_else(|| panic!("{name} not in {}", path.display()));
            assert_eq!(shape.as_slice(), g.shape(p).dims(), "{name}");
            (p, Value::new(shape.clone(), values.iter().map(|&x| f64::from(x)).collect()))
        })
        .collect()
}

// ---- names, shapes, counts ---------------------------------------------------------------------

#[test]
fn bloom_parameters_have_hf_names_and_linear_shapes() {
    // bloom-tiny: vocabulary 256, hidden 64, 2 layers, 4 heads; the names of
    // `BloomForCausalLM(config).state_dict()` without the tied `lm_head.weight`.
    let (v, d) = (256, 64);
    let mut want: Vec<(String, Vec<usize>)> = vec![
        ("transformer.word_embeddings.weight".into(), vec![v, d]),
        ("transformer.word_embeddings_layernorm.weight".into(), vec![d]),
        ("transformer.word_embeddings_layernorm.bias".into(), vec![d]),
        ("transformer.ln_f.weight".into(), vec![d]),
        ("transformer.ln_f.bias".into(), vec![d]),
    ];
    for i in 0..2 {
        let h = format!("transformer.h.{i}");
        want.extend([
            (format!("{h}.input_layernorm.weight"), vec![d]),
            (format!("{h}.input_layernorm.bias"), vec![d]),
            (format!("{h}.self_attention.query_key_value.weight"), vec![3 * d, d]),
            (format!("{h}.self_attention.query_key_value.bias"), vec![3 * d]),
            (format!("{h}.self_attention.dense.weight"), vec![d, d]),
            (format!("{h}.self_attention.dense.bias"), vec![d]),
            (format!("{h}.post_attention_layernorm.weight"), vec![d]),
            (format!("{h}.post_attention_layernorm.bias"), vec![d]),
            (format!("{h}.mlp.dense_h_to_4h.weight"), vec![4 * d, d]),
            (format!("{h}.mlp.dense_h_to_4h.bias"), vec![4 * d]),
            (format!("{h}.mlp.dense_4h_to_h.weight"), vec![d, 4 * d]),
            (format!("{h}.mlp.dense_4h_to_h.bias"), vec![d]),
        ]);
    }
    let len = want.len();
    let want: BTreeMap<String, Vec<usize>> = want.into_iter().collect();
    assert_eq!(want.len(), len, "duplicate names in the expected table");

    let cfg = ModelConfig::preset("bloom-tiny").unwrap();
    let m = build(&cfg, &BuildOptions::new(2, 8, DType::F32)).unwrap();
    let g = &m.builder.graph;
    assert_eq!(params(g), want);
    assert_eq!(g.num_parameters(), cfg.num_parameters());
    // The head is the tied embedding, a matmul against it with trans_b.
    let head = g.producer(m.logits);
    assert_eq!(head.op, Op::MatMul { trans_a: false, trans_b: true });
    assert_eq!(g.tensor_scope(head.inputs[1]), "transformer.word_embeddings.weight");
    assert_eq!(g.shape(m.logits).dims(), &[2, 8, v]);

    // Attention: causal, ALiBi over all 4 heads, scale 1/sqrt(16), q/k/v [B,S,H,E].
    let attn: Vec<_> = g.nodes.iter().filter(|n| matches!(n.op, Op::Attention(_))).collect();
    assert_eq!(attn.len(), 2);
    for n in attn {
        let Op::Attention(spec) = &n.op else { unreachable!() };
        assert!(spec.causal && spec.window.is_none());
        assert_eq!(spec.alibi, Some(tessera_ir::Alibi { heads: 4, shard: None }));
        assert!((spec.scale - 0.25).abs() < 1e-15);
        for &x in &n.inputs {
            assert_eq!(g.shape(x).dims(), &[2, 8, 4, 16]);
        }
    }
    // No rotary embeddings, no position table, no dropout (hidden_dropout defaults to 0).
    assert!(!g.nodes.iter().any(|n| matches!(n.op, Op::Rope { .. } | Op::Dropout { .. })));
    let names: Vec<&str> = m.inputs.iter().map(|i| i.name).collect();
    assert_eq!(names, ["input_ids", "labels", "num_targets"]);
}

#[test]
fn every_layer_node_is_tagged_with_its_block() {
    let cfg = ModelConfig::preset("bloom-tiny").unwrap();
    let m = build(&cfg, &BuildOptions::new(1, 8, DType::F32)).unwrap();
    let g = &m.builder.graph;
    let mut per_block = [0usize; 2];
    for n in &g.nodes {
        let scope = g.scope_name(n.scope);
        let layer = (0..2).find(|i| {
            let p = format!("transformer.h.{i}");
            scope == p || scope.starts_with(&format!("{p}."))
        });
        assert_eq!(n.block, layer.map(|i| i as u32), "{} node in scope {scope}", n.op.name());
        if let Some(i) = layer {
            per_block[i] += 1;
        }
    }
    assert!(per_block[0] > 10 && per_block[0] == per_block[1], "{per_block:?}");
}

#[test]
fn fixture_checkpoints_hold_exactly_the_graph_parameters() {
    // The tensors `save_pretrained` wrote are the graph's parameters, name for name and
    // shape for shape (no lm_head.weight: it is tied).
    for dir in ["bloom", "bloom-6heads"] {
        let cfg = ModelConfig::from_path(&hf_fixture(dir)).unwrap();
        let m = build(&cfg, &BuildOptions::new(1, 4, DType::F32)).unwrap();
        let file: BTreeMap<String, Vec<usize>> =
            read_safetensors(&hf_fixture(dir).join("model.safetensors"))
                .into_iter()
                .map(|(name, (shape, _))| (name, shape))
                .collect();
        assert_eq!(params(&m.builder.graph), file, "{dir}");
        let total: usize = file.values().map(|s| s.iter().product::<usize>()).sum();
        assert_eq!(cfg.num_parameters(), total as u64, "{dir}");
    }
}

// ---- config.json ----------------------------------------------------------------------------

#[test]
fn fixture_configs_parse() {
    let cfg = ModelConfig::from_path(&hf_fixture("bloom")).unwrap();
    assert_eq!((cfg.family(), cfg.model_type(), cfg.name()), ("bloom", "bloom", "bloom"));
    let c = bloom(&cfg);
    assert_eq!((c.vocab_size, c.hidden_size, c.n_layer, c.n_head), (96, 64, 2, 4));
    assert_eq!((c.head_dim(), c.mlp_width()), (16, 256));
    assert_eq!(c.layer_norm_epsilon, 1e-5);
    assert_eq!((c.hidden_dropout, c.attention_dropout), (0.0, 0.0));
    assert!(c.tie_word_embeddings, "absent means true");
    assert!(!c.apply_residual_connection_post_layernorm);
    assert_eq!(cfg.dtype(), Some(DType::F32));
    assert_eq!(cfg.max_seq(), None, "ALiBi: no position table");
    assert_eq!(cfg.effective_seq(5000), 5000);
    assert_eq!(
        (cfg.num_heads(), cfg.num_kv_heads(), cfg.vocab_size()),
        (Some(4), Some(4), Some(96))
    );
    assert_eq!((cfg.num_blocks(), cfg.hidden_size()), (2, 64));
    // 96·64 + 2·64 + 2·(12·64² + 13·64) + 2·64.
    assert_eq!(cfg.num_parameters(), 106_368);

    let cfg = ModelConfig::from_path(&hf_fixture("bloom-6heads/config.json")).unwrap();
    assert_eq!(cfg.name(), "bloom-6heads");
    let c = bloom(&cfg);
    assert_eq!((c.vocab_size, c.hidden_size, c.n_layer, c.n_head, c.head_dim()), (96, 48, 2, 6, 8));
}

#[test]
fn config_keys_aliases_and_defaults_follow_bloom_config() {
    // Only the dims, under BloomConfig's attribute_map aliases; the rest its defaults.
    let text = r#"{"model_type": "bloom", "vocab_size": 100, "hidden_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4}"#;
    let cfg = ModelConfig::from_hf_json(text).unwrap();
    let c = bloom(&cfg);
    assert_eq!((c.hidden_size, c.n_layer, c.n_head), (32, 3, 4));
    assert_eq!(c.layer_norm_epsilon, 1e-5);
    assert_eq!((c.hidden_dropout, c.attention_dropout), (0.0, 0.0));
    assert!(c.tie_word_embeddings && !c.apply_residual_connection_post_layernorm);
    assert_eq!(cfg.dtype(), None);
    // bigscience/bloom's own config names the width `n_embed`, which BloomConfig's __init__
    // takes over `hidden_size`.
    let text = r#"{"model_type": "bloom", "vocab_size": 250880, "n_embed": 14336,
        "n_layer": 70, "num_attention_heads": 112, "pretraining_tp": 4,
        "slow_but_exact": false, "hidden_size": 64}"#;
    let cfg = ModelConfig::from_hf_json(text).unwrap();
    assert_eq!(cfg.num_parameters(), ModelConfig::preset("bloom-176b").unwrap().num_parameters());
    // Dropouts are read and validated; without_dropout clears them.
    let text = r#"{"model_type": "bloom", "vocab_size": 100, "hidden_size": 32, "n_layer": 1,
        "n_head": 4, "hidden_dropout": 0.1, "attention_dropout": 0.2}"#;
    let cfg = ModelConfig::from_hf_json(text).unwrap();
    assert_eq!((bloom(&cfg).hidden_dropout, bloom(&cfg).attention_dropout), (0.1, 0.2));
    let clean = cfg.without_dropout();
    assert_eq!((bloom(&clean).hidden_dropout, bloom(&clean).attention_dropout), (0.0, 0.0));
    let bad = text.replace("0.2", "1.5");
    let msg = ModelConfig::from_hf_json(&bad).unwrap_err().to_string();
    assert!(msg.contains("attention_dropout") && msg.contains("[0, 1)"), "{msg}");
}

#[test]
fn residuals_after_the_layernorms_are_refused_by_name() {
    let text = r#"{"model_type": "bloom", "vocab_size": 100, "hidden_size": 32, "n_layer": 1,
        "n_head": 4, "apply_residual_connection_post_layernorm": true}"#;
    let e = ModelConfig::from_hf_json(text).unwrap_err();
    assert!(matches!(e, ModelError::Invalid { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("apply_residual_connection_post_layernorm"), "{msg}");
    let mut p = BloomParams::new("x", 100, 32, 1, 4);
    p.apply_residual_connection_post_layernorm = true;
    assert!(BloomConfig::new(p).is_err());
}

#[test]
fn bad_bloom_configs_name_the_field() {
    for (text, needle) in [
        (
            r#"{"model_type": "bloom", "vocab_size": 100, "hidden_size": 30, "n_layer": 1, "n_head": 4}"#,
            "hidden_size 30 is not divisible by n_head 4",
        ),
        (r#"{"model_type": "bloom", "vocab_size": 100, "n_layer": 1, "n_head": 4}"#, "hidden_size"),
        (
            r#"{"model_type": "bloom", "vocab_size": 100, "hidden_size": 32, "n_head": 4}"#,
            "n_layer",
        ),
        (
            r#"{"model_type": "bloom", "vocab_size": 100, "hidden_size": 32, "n_layer": 0, "n_head": 4}"#,
            "n_layer",
        ),
        (
            r#"{"model_type": "bloom", "vocab_size": 100, "hidden_size": 32, "n_layer": 1, "n_head": 4, "layer_norm_epsilon": 0}"#,
            "layer_norm_epsilon",
        ),
    ] {
        let msg = ModelConfig::from_hf_json(text).unwrap_err().to_string();
        assert!(msg.contains(needle), "{text}: {msg}");
    }
}

#[test]
fn to_hf_json_writes_a_bloom_config() {
    let json = ModelConfig::preset("bloom-560m").unwrap().to_hf_json();
    assert_eq!(json["architectures"], serde_json::json!(["BloomForCausalLM"]));
    assert_eq!(json["model_type"], "bloom");
    for (key, want) in [
        ("vocab_size", 250880),
        ("hidden_size", 1024),
        ("n_layer", 24),
        ("n_head", 16),
        ("bos_token_id", 1),
        ("eos_token_id", 2),
        ("pretraining_tp", 1),
    ] {
        assert_eq!(json[key], want, "{key}");
    }
    assert_eq!(json["apply_residual_connection_post_layernorm"], false);
    assert_eq!(json["layer_norm_epsilon"], 1e-5);
    // The fixture's own config (written by transformers) reads back to the same config.
    let cfg = ModelConfig::from_path(&hf_fixture("bloom")).unwrap();
    let back = ModelConfig::from_hf_json(&cfg.to_hf_json().to_string()).unwrap();
    assert_eq!(back, cfg);
    let file = read_json(hf_fixture("bloom/config.json"));
    for key in
        ["hidden_size", "n_layer", "n_head", "vocab_size", "layer_norm_epsilon", "torch_dtype"]
    {
        assert_eq!(cfg.to_hf_json()[key], file[key], "{key}");
    }
}

// ---- numerics against transformers -------------------------------------------------------------

#[test]
fn fixture_logits_and_loss_match_transformers() {
    // `model(ids[:-1]).logits[0]` in fp32 and the mean cross-entropy against ids[1:] in f64:
    // the f64 interpreter on the fp32 weights agrees to fp32 round-off.
    for dir in ["bloom", "bloom-6heads"] {
        let cfg = ModelConfig::from_path(&hf_fixture(dir)).unwrap();
        let expected = read_json(hf_fixture(dir).join("expected.json"));
        let tokens = ids(&expected["tokens"]);
        let seq = tokens.len() - 1;
        let m = build(&cfg, &BuildOptions::new(1, seq, DType::F64)).unwrap();
        let g = m.builder.finish();
        let mut bindings = bind_weights(&g, &hf_fixture(dir).join("model.safetensors"));
        for input in &m.inputs {
            let value = match input.kind {
                InputKind::TokenIds { .. } => Value::from_i64([1, seq], &tokens[..seq]),
                InputKind::Labels { .. } => Value::from_i64([1, seq], &tokens[1..]),
                InputKind::TargetCount => Value::scalar(seq as f64),
                ref other => panic!("{dir}: unexpected input {other:?}"),
            };
            bindings.insert(input.tensor, value);
        }
        let out = interp::eval_outputs(&g, &bindings, &[m.logits, m.loss]).unwrap();
        let want: Vec<f64> = expected["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
            .collect();
        let v = cfg.vocab_size().unwrap();
        assert_eq!(out[0].dims(), &[1, seq, v], "{dir}");
        assert_eq!(want.len(), seq * v, "{dir}");
        let worst = out[0].data.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        let loss = expected["loss"].as_f64().unwrap();
        let rel = (out[1].item() - loss).abs() / loss;
        eprintln!("{dir}: logits max abs error {worst:.1e}, loss relative error {rel:.1e}");
        assert!(worst < 1e-4, "{dir}: logits differ from transformers' by up to {worst:e}");
        assert!(rel < 1e-5, "{dir}: loss {} vs transformers' {loss}", out[1].item());
    }
}

/// Greedy decoding through generation graphs on the interpreter: one prefill of the prompt,
/// then one-token steps, the KV caches carried from each step's `cache_write` outputs.
fn greedy(cfg: &ModelConfig, weights: &PathBuf, prompt: &[i64], new: usize) -> Vec<i64> {
    let capacity = prompt.len() + new;
    let step = |seq: usize| {
        let opts = GenerateOptions {
            batch: 1,
            seq,
            capacity,
            dtype: DType::F64,
            quantize: None,
            all_logits: false,
        };
        let m = build_generation(cfg, &opts).unwrap();
        let g = m.builder.finish();
        (g, m.logits, m.inputs)
    };
    let (prefill, decode) = (step(prompt.len()), step(1));
    // Each graph's cache leaves and the `cache_write` output that updates each.
    let caches = |g: &Graph| -> Vec<(TensorId, TensorId)> {
        g.nodes
            .iter()
            .filter(|n| n.op == Op::CacheWrite)
            .map(|n| (n.inputs[0], n.outputs[0]))
            .collect()
    };
    let mut state: Vec<Value> = Vec::new();
    let (mut out, mut start, mut tokens) = (Vec::new(), 0usize, prompt.to_vec());
    for k in 0..new {
        let (g, logits, inputs) = if k == 0 { &prefill } else { &decode };
        let seq = tokens.len();
        let mut bindings = bind_weights(g, weights);
        for input in inputs {
            let value = match input.kind {
                InputKind::TokenIds { .. } => Value::from_i64([1, seq], &tokens),
                InputKind::CacheStart => Value::from_i64([1], &[start as i64]),
                InputKind::Positions => {
                    let pos: Vec<i64> = (start..start + seq).map(|p| p as i64).collect();
                    Value::from_i64([1, seq], &pos)
                }
                InputKind::LastIndex => Value::from_i64([1], &[seq as i64 - 1]),
                ref other => panic!("unexpected generation input {other:?}"),
            };
            bindings.insert(input.tensor, value);
        }
        let cw = caches(g);
        for (i, &(leaf, _)) in cw.iter().enumerate() {
            let value = match state.get(i) {
                Some(v) => v.clone(),
                None => Value::zeros(g.shape(leaf).clone()),
            };
            bindings.insert(leaf, value);
        }
        let mut wanted = vec![*logits];
        wanted.extend(cw.iter().map(|&(_, written)| written));
        let mut values = interp::eval_outputs(g, &bindings, &wanted).unwrap();
        state = values.split_off(1);
        let row = &values[0].data;
        let next = (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
        out.push(next as i64);
        start += seq;
        tokens = vec![next as i64];
    }
    out
}

#[test]
fn greedy_generation_over_the_kv_cache_matches_transformers() {
    // ALiBi at cache positions: a prefill from position 0, then single tokens at 5, 6, ...
    for dir in ["bloom", "bloom-6heads"] {
        let cfg = ModelConfig::from_path(&hf_fixture(dir)).unwrap();
        let expected = read_json(hf_fixture(dir).join("generate.json"));
        let new = expected["max_new_tokens"].as_u64().unwrap() as usize;
        let weights = hf_fixture(dir).join("model.safetensors");
        let prompts = expected["prompts"].as_array().unwrap();
        for (prompt, want) in prompts.iter().zip(expected["new_tokens"].as_array().unwrap()) {
            let got = greedy(&cfg, &weights, &ids(prompt), new);
            assert_eq!(got, ids(want), "{dir}: prompt {prompt}");
        }
    }
}

// ---- the generation graph ------------------------------------------------------------------------

#[test]
fn generation_graph_has_a_kv_cache_per_layer() {
    let cfg = ModelConfig::preset("bloom-tiny").unwrap();
    let opts = GenerateOptions {
        batch: 2,
        seq: 3,
        capacity: 8,
        dtype: DType::F32,
        quantize: None,
        all_logits: false,
    };
    let m = build_generation(&cfg, &opts).unwrap();
    let g = &m.builder.graph;
    assert_eq!(g.meta(m.logits), &TensorMeta::new([2, 1, 256], DType::F32));
    let names: Vec<&str> = m.inputs.iter().map(|i| i.name).collect();
    assert_eq!(names, ["input_ids", "cache_start", "position_ids", "last_index"]);
    for layer in 0..2 {
        for cache in ["k_cache", "v_cache"] {
            let name = format!("transformer.h.{layer}.self_attention.{cache}");
            let t = g.find_leaf(&name).unwrap_or_else(|| panic!("no leaf {name}"));
            assert!(matches!(g.producer(t).op, Op::KvCache(_)), "{name}");
            assert_eq!(g.meta(t), &TensorMeta::new([2, 8, 4, 16], DType::F32), "{name}");
        }
    }
    let caches = g.nodes.iter().filter(|n| matches!(n.op, Op::KvCache(_))).count();
    assert_eq!(caches, 2 * 2);
    // Attention over the caches from each row's start, with the ALiBi of all 4 heads.
    let start = m.input("cache_start").unwrap();
    for n in g.nodes.iter().filter(|n| matches!(n.op, Op::Attention(_))) {
        let Op::Attention(spec) = &n.op else { unreachable!() };
        assert_eq!(spec.alibi.as_ref().map(|a| a.heads), Some(4));
        assert_eq!(n.inputs.len(), 4);
        assert_eq!(n.inputs[3], start);
        assert_eq!(g.shape(n.inputs[1]).dims(), &[2, 8, 4, 16]);
    }
    assert_eq!(g.num_parameters(), cfg.num_parameters());

    // Quantised: every block linear becomes a u8 weight with scales; the embedding (and so
    // the tied head) and the norms stay float.
    let q = GenerateOptions { quantize: Some(tessera_models::Quantize::Int8), ..opts };
    let m = build_generation(&cfg, &q).unwrap();
    let mut sources: Vec<String> = m.quantized.iter().map(|w| w.source.clone()).collect();
    sources.sort();
    let mut want = Vec::new();
    for layer in 0..2 {
        for module in [
            "mlp.dense_4h_to_h",
            "mlp.dense_h_to_4h",
            "self_attention.dense",
            "self_attention.query_key_value",
        ] {
            want.push(format!("transformer.h.{layer}.{module}.weight"));
        }
    }
    assert_eq!(sources, want);
    assert!(m.quantized.iter().all(|w| !w.transposed));
}
