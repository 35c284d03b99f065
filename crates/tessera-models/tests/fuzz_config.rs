//! Fuzzing the Hugging Face `config.json` reader (issue 17, item 7): any text gives a config
//! or an error with a message, never a panic; and a config that is accepted builds (or is
//! refused with a message) at a tiny batch and sequence.
//!
//! Inputs: arbitrary strings, truncated real configs, arbitrary JSON objects over the keys the
//! reader knows, and — the most useful — real configs (the fixtures and every preset's
//! `to_hf_json()`) with fields replaced by hostile values (negative, zero, huge, fractional,
//! strings, nulls, arrays, objects) or removed. Accepted configs are built with at most 2
//! blocks (the builder is linear in the layer count, up to `MAX_LAYERS` = 65536 of them, and
//! nothing else depends on it), so every case stays fast.

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::sync::OnceLock;
use tessera_ir::DType;
use tessera_models::{
    build, BertConfig, BloomConfig, BuildOptions, Gpt2Config, LlamaConfig, MlpConfig, ModelConfig,
    VitConfig, MAX_HEAD_DIM, MAX_LAYERS, MAX_PARAMETERS, PRESETS,
};

const FIXTURES: &[&str] = &[
    "bert-large-uncased.json",
    "gpt2.json",
    "llama-3.2-1b.json",
    "mistral-7b-v0.1.json",
    "qwen2-0.5b.json",
    "smollm2-135m-v5.json",
    "llama-2-7b-hf/config.json",
];

/// Every key some family reads, so mutations reach every field (plus ones no family reads).
const KEYS: &[&str] = &[
    "model_type",
    "_name_or_path",
    "vocab_size",
    "n_positions",
    "max_position_embeddings",
    "n_embd",
    "hidden_size",
    "n_layer",
    "num_hidden_layers",
    "n_head",
    "num_attention_heads",
    "n_inner",
    "intermediate_size",
    "num_key_value_heads",
    "head_dim",
    "activation_function",
    "hidden_act",
    "layer_norm_epsilon",
    "layer_norm_eps",
    "rms_norm_eps",
    "embd_pdrop",
    "resid_pdrop",
    "attn_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "tie_word_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "type_vocab_size",
    "position_embedding_type",
    "num_channels",
    "qkv_bias",
    "image_size",
    "patch_size",
    "id2label",
    "num_labels",
    "input_dim",
    "hidden_dims",
    "num_classes",
    "dtype",
    "torch_dtype",
    "n_ctx",
    "n_embed",
    "hidden_dropout",
    "attention_dropout",
    "apply_residual_connection_post_layernorm",
    "unknown_key",
];

/// Keys inside `rope_scaling` / `rope_parameters`.
const ROPE_KEYS: &[&str] = &[
    "rope_type",
    "type",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "rope_theta",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
];

/// The real configs every mutation starts from: the fixtures and every preset.
fn bases() -> &'static [Value] {
    static BASES: OnceLock<Vec<Value>> = OnceLock::new();
    BASES.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let mut out: Vec<Value> = FIXTURES
            .iter()
            .map(|f| {
                let text = std::fs::read_to_string(dir.join(f)).unwrap();
                serde_json::from_str(&text).unwrap()
            })
            .collect();
        out.extend(PRESETS.iter().map(|p| ModelConfig::preset(p).unwrap().to_hf_json()));
        out
    })
}

fn number(x: f64) -> Value {
    serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)
}

/// Leaf values chosen to break validation: signs, zero, huge and fractional numbers, numbers
/// as strings, names of dtypes, activations and rope types, empty strings.
fn leaf() -> impl Strategy<Value = Value> {
    let ints = prop::sample::select(vec![
        0i64,
        1,
        2,
        3,
        4,
        7,
        8,
        16,
        64,
        255,
        4096,
        65536,
        65537,
        -1,
        -2,
        -4096,
        i64::MIN,
        i64::MAX,
        1 << 31,
        1 << 32,
        (1 << 32) + 1,
        1 << 40,
        1 << 50,
        1 << 53,
        (1 << 53) + 1,
    ]);
    let floats = prop::sample::select(vec![
        0.0f64,
        -0.0,
        0.1,
        0.5,
        0.999_999,
        1.0,
        1.5,
        2.0,
        1e-12,
        -1e-5,
        4096.0,
        4096.5,
        9.0e15,
        1e16,
        1e30,
        -1e30,
        1e300,
        f64::MAX,
        f64::MIN,
        f64::MIN_POSITIVE,
        f64::EPSILON,
    ]);
    let strings = prop::sample::select(vec![
        "",
        "auto",
        "gelu",
        "gelu_new",
        "silu",
        "relu",
        "swish",
        "tanh",
        "quick_gelu",
        "float32",
        "bfloat16",
        "float16",
        "float64",
        "int64",
        "bool",
        "llama3",
        "linear",
        "dynamic",
        "yarn",
        "default",
        "absolute",
        "relative_key",
        "llama",
        "gpt2",
        "bert",
        "vit",
        "mlp",
        "mistral",
        "qwen2",
        "t5",
        "12",
        "-1",
        "1e30",
        "NaN",
        "ü",
        "\u{0}",
        "LABEL_0",
    ]);
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        ints.prop_map(Value::from),
        prop_oneof![Just(u64::MAX), Just(1u64 << 63), Just(usize::MAX as u64 - 1)]
            .prop_map(Value::from),
        (0u64..70_000).prop_map(Value::from),
        floats.prop_map(number),
        any::<f64>().prop_map(number),
        strings.prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ]
}

/// Any JSON value: leaves, arrays and objects (objects over rope keys or label ids).
fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(ROPE_KEYS), inner.clone()), 0..6).prop_map(
                |kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            ),
            prop::collection::vec((0u32..12, inner), 0..6).prop_map(|kv| Value::Object(
                kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
            )),
        ]
    })
}

/// A `rope_scaling`-shaped object with hostile values.
fn rope_object() -> impl Strategy<Value = Value> {
    let kind = prop_oneof![
        prop::sample::select(vec!["default", "linear", "llama3", "yarn", "dynamic", ""])
            .prop_map(Value::from),
        leaf(),
    ];
    (kind, prop::collection::vec((prop::sample::select(ROPE_KEYS), leaf()), 0..6)).prop_map(
        |(kind, kv)| {
            let mut m: Map<String, Value> = Map::new();
            m.insert("rope_type".into(), kind);
            for (k, v) in kv {
                m.insert(k.to_string(), v);
            }
            Value::Object(m)
        },
    )
}

#[derive(Clone, Debug)]
enum Mutation {
    Remove(String),
    Set(String, Value),
    /// Sets `key.sub`, making `key` an object if it is not one.
    SetNested(String, String, Value),
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(KEYS).prop_map(str::to_string),
        1 => "[a-z_]{1,10}",
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        2 => key().prop_map(Mutation::Remove),
        6 => (key(), leaf()).prop_map(|(k, v)| Mutation::Set(k, v)),
        2 => (key(), value()).prop_map(|(k, v)| Mutation::Set(k, v)),
        1 => prop::sample::select(vec!["rope_scaling", "rope_parameters"])
            .prop_flat_map(|k| rope_object().prop_map(move |v| Mutation::Set(k.to_string(), v))),
        2 => (
            prop::sample::select(vec!["rope_scaling", "rope_parameters", "id2label"]),
            prop::sample::select(ROPE_KEYS),
            leaf()
        )
            .prop_map(|(k, s, v)| Mutation::SetNested(k.into(), s.into(), v)),
    ]
}

fn apply(mut config: Value, mutations: &[Mutation]) -> Value {
    let Value::Object(map) = &mut config else { return config };
    for m in mutations {
        match m {
            Mutation::Remove(k) => {
                map.remove(k);
            }
            Mutation::Set(k, v) => {
                map.insert(k.clone(), v.clone());
            }
            Mutation::SetNested(k, s, v) => {
                let slot = map.entry(k.clone()).or_insert_with(|| json!({}));
                if !slot.is_object() {
                    *slot = json!({});
                }
                if let Value::Object(inner) = slot {
                    inner.insert(s.clone(), v.clone());
                }
            }
        }
    }
    config
}

/// The same configuration with at most 2 repeated blocks (still valid: fewer layers only
/// lower the parameter count).
fn at_most_two_blocks(cfg: &ModelConfig) -> ModelConfig {
    let valid = "a config with fewer layers is valid";
    match cfg {
        ModelConfig::Gpt2(c) => {
            let mut p = c.clone().into_params();
            p.n_layer = p.n_layer.min(2);
            ModelConfig::Gpt2(Gpt2Config::new(p).expect(valid))
        }
        ModelConfig::Llama(c) => {
            let mut p = c.clone().into_params();
            p.num_hidden_layers = p.num_hidden_layers.min(2);
            ModelConfig::Llama(LlamaConfig::new(p).expect(valid))
        }
        ModelConfig::Bert(c) => {
            let mut p = c.clone().into_params();
            p.num_hidden_layers = p.num_hidden_layers.min(2);
            ModelConfig::Bert(BertConfig::new(p).expect(valid))
        }
        ModelConfig::Vit(c) => {
            let mut p = c.clone().into_params();
            p.num_hidden_layers = p.num_hidden_layers.min(2);
            ModelConfig::Vit(VitConfig::new(p).expect(valid))
        }
        ModelConfig::Bloom(c) => {
            let mut p = c.clone().into_params();
            p.n_layer = p.n_layer.min(2);
            ModelConfig::Bloom(BloomConfig::new(p).expect(valid))
        }
        ModelConfig::Mlp(c) => {
            let mut p = c.clone().into_params();
            p.hidden_dims.truncate(2);
            ModelConfig::Mlp(MlpConfig::new(p).expect(valid))
        }
        ModelConfig::ClipText(c) => {
            let mut p = c.params().clone();
            p.num_hidden_layers = p.num_hidden_layers.min(2);
            ModelConfig::ClipText(tessera_models::ClipTextConfig::new(p).expect(valid))
        }
        // Fewer layers keep every other field valid.
        ModelConfig::Dit(c) => {
            let mut c = c.clone();
            c.num_layers = c.num_layers.min(2);
            ModelConfig::Dit(c)
        }
        // Not made from a config.json: never generated here.
        ModelConfig::Onnx(_) => cfg.clone(),
        // Not generated here (its fuzzing is not written); kept as it is.
        ModelConfig::UNet(_) | ModelConfig::Vae(_) => cfg.clone(),
    }
}

/// What every accepted config must satisfy: the validated bounds hold, its own export reads
/// back, and it builds (or is refused with a message) at batch 1–2 and a short sequence.
fn check_accepted(cfg: &ModelConfig, text: &str) -> Result<(), TestCaseError> {
    prop_assert!(
        u128::from(cfg.num_parameters()) <= MAX_PARAMETERS,
        "{} parameters accepted: {text}",
        cfg.num_parameters()
    );
    prop_assert!(cfg.num_blocks() <= MAX_LAYERS, "{} blocks accepted: {text}", cfg.num_blocks());
    let exported = cfg.to_hf_json().to_string();
    if let Err(e) = ModelConfig::from_hf_json(&exported) {
        return Err(TestCaseError::fail(format!(
            "the export of an accepted config is refused ({e}): {exported} (from {text})"
        )));
    }

    let small = at_most_two_blocks(cfg);
    let max_seq = small.max_seq().unwrap_or(usize::MAX);
    for (batch, seq) in [(1, 1), (2, max_seq.min(5))] {
        match build(&small, &BuildOptions::new(batch, seq, DType::F32)) {
            Err(e) => prop_assert!(!e.to_string().trim().is_empty(), "empty error: {text}"),
            Ok(m) => {
                let g = m.builder.finish();
                prop_assert_eq!(
                    g.num_parameters(),
                    small.num_parameters(),
                    "graph and config disagree on the parameter count: {}",
                    text
                );
                prop_assert_eq!(g.meta(m.loss).shape.dims(), &[] as &[usize], "{}", text);
            }
        }
    }
    Ok(())
}

/// Reads `text`; an error must say something, a config must satisfy [`check_accepted`].
fn check(text: &str) -> Result<(), TestCaseError> {
    match ModelConfig::from_hf_json(text) {
        Err(e) => {
            prop_assert!(!e.to_string().trim().is_empty(), "empty error for {text:?}");
            Ok(())
        }
        Ok(cfg) => check_accepted(&cfg, text),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn real_configs_with_hostile_fields_never_panic(
        base in prop::sample::select(bases()),
        mutations in prop::collection::vec(mutation(), 1..5),
    ) {
        check(&apply(base, &mutations).to_string())?;
    }

    #[test]
    fn arbitrary_json_objects_never_panic(
        model_type in prop_oneof![
            4 => prop::sample::select(tessera_models::SUPPORTED_MODEL_TYPES)
                .prop_map(Value::from),
            1 => leaf(),
        ],
        fields in prop::collection::vec((key(), value()), 0..24),
    ) {
        let mut map: Map<String, Value> = fields.into_iter().collect();
        map.insert("model_type".into(), model_type);
        check(&Value::Object(map).to_string())?;
    }

    #[test]
    fn arbitrary_text_never_panics(text in prop_oneof![
        ".*",
        "[\\[\\]{}\":,0-9a-z_ .eE+-]{0,64}",
        value().prop_map(|v| v.to_string()),
    ]) {
        check(&text)?;
    }

    #[test]
    fn truncated_and_spliced_configs_never_panic(
        base in prop::sample::select(bases()),
        cut in any::<prop::sample::Index>(),
        insert in ".{0,3}",
    ) {
        let text = serde_json::to_string_pretty(&base).unwrap();
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        let at = bounds[cut.index(bounds.len())];
        check(&text[..at])?;
        check(&format!("{}{insert}{}", &text[..at], &text[at..]))?;
    }
}

/// The hostile values one at a time on every field of every base: the cases a random search
/// may miss, each read and (when accepted) built.
#[test]
fn every_field_of_every_base_takes_every_extreme_value() {
    let extremes = [
        Value::Null,
        json!(0),
        json!(-1),
        json!(1.5),
        json!(1e30),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(1u64 << 32),
        json!(1u64 << 50),
        json!("x"),
        json!([]),
        json!([0, 0]),
        json!({}),
        json!(true),
    ];
    for base in bases() {
        let keys: Vec<String> = base.as_object().unwrap().keys().cloned().collect();
        for k in keys.iter().map(String::as_str).chain(KEYS.iter().copied()) {
            let removed = apply(base.clone(), &[Mutation::Remove(k.into())]);
            check(&removed.to_string()).unwrap();
            for v in &extremes {
                let text = apply(base.clone(), &[Mutation::Set(k.into(), v.clone())]).to_string();
                check(&text).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}

/// Found by this fuzzer: an explicit `head_dim` of 2^32 on llama-tiny was accepted (2^47
/// parameters, under the bound) and building it allocated its 2^31 RoPE frequencies
/// (16 GiB, an abort). A head dim beyond `MAX_HEAD_DIM` is now refused by name.
#[test]
fn a_huge_head_dim_is_refused_before_anything_is_allocated() {
    let mut cfg = ModelConfig::preset("llama-tiny").unwrap().to_hf_json();
    for (head_dim, accepted) in [(256u64, true), (MAX_HEAD_DIM as u64, true), (1 << 32, false)] {
        cfg["head_dim"] = json!(head_dim);
        match ModelConfig::from_hf_json(&cfg.to_string()) {
            Ok(c) => {
                assert!(accepted, "head_dim {head_dim} accepted");
                check_accepted(&c, &cfg.to_string()).unwrap();
            }
            Err(e) => {
                assert!(!accepted, "head_dim {head_dim}: {e}");
                let msg = e.to_string();
                assert!(msg.contains("head_dim") && msg.contains("exceeds 4096"), "{msg}");
            }
        }
    }
    // Implied by hidden_size / num_attention_heads, the message says so.
    let mut cfg = ModelConfig::preset("llama-tiny").unwrap().to_hf_json();
    (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) =
        (json!(1 << 13), json!(1), json!(1));
    let msg = ModelConfig::from_hf_json(&cfg.to_string()).unwrap_err().to_string();
    assert!(msg.contains("hidden_size 8192 / num_attention_heads 1"), "{msg}");
}
