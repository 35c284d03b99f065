//! Hugging Face config.json import: field mapping and defaults, both key generations, RoPE
//! scaling, sliding windows, and the error for each kind of bad input.

use std::path::PathBuf;
use tessera_ir::{DType, Op};
use tessera_models::{
    build, BuildOptions, LlamaConfig, LlamaVariant, ModelConfig, ModelError, RopeScaling,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn llama(cfg: &ModelConfig) -> &LlamaConfig {
    match cfg {
        ModelConfig::Llama(c) => c,
        other => panic!("expected a llama-family config, got {}", other.family()),
    }
}

/// The error message, which must exist.
fn err_text<T>(r: Result<T, ModelError>) -> (ModelError, String) {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => {
            let text = e.to_string();
            (e, text)
        }
    }
}

// ---- presets are the published configs --------------------------------------------------------

/// `file` parses to the same parameters as `preset`, apart from the name.
fn check_same_as_preset(file: &str, preset: &str) {
    let parsed = ModelConfig::from_path(&fixture(file)).unwrap();
    let preset_cfg = ModelConfig::preset(preset).unwrap();
    let rename = |c: &ModelConfig| {
        let mut json = serde_json::to_value(c).unwrap();
        json.as_object_mut().unwrap().remove("name");
        json
    };
    assert_eq!(rename(&parsed), rename(&preset_cfg), "{file} vs preset {preset}");
}

#[test]
fn presets_equal_their_hugging_face_config_files() {
    check_same_as_preset("gpt2.json", "gpt2");
    check_same_as_preset("bert-large-uncased.json", "bert-large");
    // A directory holding config.json.
    check_same_as_preset("llama-2-7b-hf", "llama2-7b");
}

#[test]
fn names_come_from_name_or_path_then_the_directory() {
    let cfg = ModelConfig::from_path(&fixture("llama-2-7b-hf")).unwrap();
    assert_eq!(cfg.name(), "meta-llama/Llama-2-7b-hf");
    let cfg = ModelConfig::from_path(&fixture("mistral-7b-v0.1.json")).unwrap();
    assert_eq!(cfg.name(), "mistral-7b-v0.1");
    let cfg = ModelConfig::from_hf_json(
        r#"{"model_type": "mlp", "input_dim": 4, "hidden_dims": [], "num_classes": 2}"#,
    )
    .unwrap();
    assert_eq!(cfg.name(), "mlp");
}

// ---- llama family -----------------------------------------------------------------------------

#[test]
fn mistral_fixture_sets_gqa_untied_and_sliding_window() {
    let cfg = ModelConfig::from_path(&fixture("mistral-7b-v0.1.json")).unwrap();
    let c = llama(&cfg);
    assert_eq!(c.variant, LlamaVariant::Mistral);
    assert_eq!(cfg.model_type(), "mistral");
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim()), (32, 8, 128));
    assert!(!c.tie_word_embeddings && !c.qkv_bias && !c.o_bias);
    assert_eq!(c.window(0), Some(4096));
    assert_eq!(c.window(31), Some(4096));
    assert_eq!(cfg.dtype(), Some(DType::BF16));
    assert_eq!(c.rms_norm_eps, 1e-5);

    // Every attention node of the built graph carries the window.
    let model = build(&cfg, &BuildOptions::new(1, 16, DType::BF16)).unwrap();
    let windows: Vec<Option<usize>> = model
        .builder
        .graph
        .nodes
        .iter()
        .filter_map(|n| match &n.op {
            Op::Attention(spec) => Some(spec.window),
            _ => None,
        })
        .collect();
    assert_eq!(windows, vec![Some(4096); 32]);
    assert!(model.builder.graph.find_leaf("lm_head.weight").is_some());
}

#[test]
fn mistral_sliding_window_null_means_none_and_absent_means_default() {
    let base = std::fs::read_to_string(fixture("mistral-7b-v0.1.json")).unwrap();
    let null = base.replace(r#""sliding_window": 4096"#, r#""sliding_window": null"#);
    assert_ne!(null, base);
    let cfg = ModelConfig::from_hf_json(&null).unwrap();
    assert_eq!(llama(&cfg).window(0), None);
    let absent = base.replace(r#""sliding_window": 4096,"#, "");
    assert_ne!(absent, base);
    let cfg = ModelConfig::from_hf_json(&absent).unwrap();
    assert_eq!(llama(&cfg).window(0), Some(4096), "MistralConfig's default is 4096");
}

#[test]
fn qwen2_fixture_has_qkv_bias_tied_head_and_no_window() {
    let cfg = ModelConfig::from_path(&fixture("qwen2-0.5b.json")).unwrap();
    let c = llama(&cfg);
    assert_eq!(c.variant, LlamaVariant::Qwen2);
    assert!(c.qkv_bias && !c.o_bias && !c.mlp_bias && c.tie_word_embeddings);
    assert_eq!(c.rope_theta, 1_000_000.0);
    // use_sliding_window is false: sliding_window 131072 must not apply.
    assert_eq!(c.window(23), None);

    let model = build(&cfg, &BuildOptions::new(1, 8, DType::F32)).unwrap();
    let g = &model.builder.graph;
    let shape = |name: &str| g.find_leaf(name).map(|t| g.shape(t).dims().to_vec());
    assert_eq!(shape("model.layers.0.self_attn.q_proj.bias"), Some(vec![896]));
    assert_eq!(shape("model.layers.0.self_attn.k_proj.bias"), Some(vec![128]));
    assert_eq!(shape("model.layers.0.self_attn.v_proj.bias"), Some(vec![128]));
    assert_eq!(shape("model.layers.0.self_attn.o_proj.bias"), None);
    assert_eq!(shape("lm_head.weight"), None, "tied to model.embed_tokens.weight");
}

#[test]
fn qwen2_sliding_window_applies_from_max_window_layers_when_enabled() {
    let base = std::fs::read_to_string(fixture("qwen2-0.5b.json")).unwrap();
    let text = base
        .replace(r#""use_sliding_window": false"#, r#""use_sliding_window": true"#)
        .replace(r#""max_window_layers": 24"#, r#""max_window_layers": 20"#);
    let cfg = ModelConfig::from_hf_json(&text).unwrap();
    let c = llama(&cfg);
    assert_eq!(c.window(19), None);
    assert_eq!(c.window(20), Some(131072));
    assert_eq!(c.window(23), Some(131072));
}

#[test]
fn transformers_v5_keys_rope_parameters_and_dtype_are_read() {
    let cfg = ModelConfig::from_path(&fixture("smollm2-135m-v5.json")).unwrap();
    let c = llama(&cfg);
    assert_eq!(c.rope_theta, 100_000.0, "rope_parameters.rope_theta");
    assert_eq!(c.rope_scaling, RopeScaling::Default);
    assert_eq!(cfg.dtype(), Some(DType::BF16), "`dtype`, not `torch_dtype`");
    assert_eq!((c.num_key_value_heads, c.head_dim()), (3, 64));
    // theta^(-2i/d) with theta = 1e5, d = 64: i = 16 gives 1e5^(-1/2) = 0.0031622776601683794.
    let inv = c.inv_freq();
    assert_eq!(inv.len(), 32);
    assert!((inv[16] - 0.003_162_277_660_168_379_4).abs() < 1e-15, "{}", inv[16]);
}

#[test]
fn llama3_rope_scaling_matches_hand_computed_frequencies() {
    let cfg = ModelConfig::from_path(&fixture("llama-3.2-1b.json")).unwrap();
    let c = llama(&cfg);
    assert_eq!(
        c.rope_scaling,
        RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        }
    );
    // head_dim 64, theta 5e5: base inv_freq[i] = 5e5^(-i/32), wavelength 2π/inv.
    // Bands: wavelength < 8192/4 = 2048 keeps inv; > 8192/1 = 8192 divides by 32; between,
    // smooth = (8192/wavelength − 1)/(4 − 1) and inv' = (1 − smooth)·inv/32 + smooth·inv.
    // i = 16 by hand: inv = 5e5^(-1/2) = 1/707.10678 = 1.4142136e-3, wavelength 4442.883,
    // smooth = (1.8438583 − 1)/3 = 0.2812826, inv' = inv·(0.7187174/32 + 0.2812826)
    // = 1.4142136e-3 · 0.3037426 = 4.295568e-4. The other values were computed the same way
    // in double precision (Python `math`), independently of this crate.
    let expected: &[(usize, f64)] = &[
        (0, 1.0),                     // wavelength 6.28: kept
        (14, 0.0032114459947525913),  // wavelength 1956: kept
        (15, 0.001290547928209264),   // wavelength 2948: smooth 0.5928
        (16, 0.00042955679655936815), // wavelength 4443: smooth 0.2813
        (17, 9.70828780262767e-05),   // wavelength 6695: smooth 0.0745
        (18, 1.9461638184831125e-05), // wavelength 10089: divided by 32
        (31, 9.418306725434909e-08),  // wavelength 2.08e6: divided by 32
    ];
    let inv = c.inv_freq();
    assert_eq!(inv.len(), 32);
    for &(i, want) in expected {
        let rel = (inv[i] - want).abs() / want;
        assert!(rel < 1e-12, "inv_freq[{i}] = {} but expected {want}", inv[i]);
    }
    // The graph's rope nodes carry exactly these frequencies.
    let model = build(&cfg, &BuildOptions::new(1, 4, DType::F32)).unwrap();
    let rope = model.builder.graph.nodes.iter().find_map(|n| match &n.op {
        Op::Rope { inv_freq, inverse: false } => Some(inv_freq.clone()),
        _ => None,
    });
    assert_eq!(rope, Some(inv));
}

#[test]
fn linear_rope_scaling_divides_every_frequency() {
    let text = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "rope_scaling": {"type": "linear", "factor": 4.0}}"#;
    let cfg = ModelConfig::from_hf_json(text).unwrap();
    let inv = llama(&cfg).inv_freq();
    // head_dim 16, theta 1e4 (default): inv[i] = 1e4^(-i/8) / 4.
    assert_eq!(inv.len(), 8);
    assert_eq!(inv[0], 0.25);
    assert!((inv[4] - 0.01 / 4.0).abs() < 1e-15, "{}", inv[4]);
}

#[test]
fn llama_defaults_follow_transformers() {
    let text = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}"#;
    let cfg = ModelConfig::from_hf_json(text).unwrap();
    let c = llama(&cfg);
    assert_eq!(c.num_key_value_heads, 4, "defaults to num_attention_heads");
    assert_eq!(c.rms_norm_eps, 1e-6);
    assert_eq!(c.rope_theta, 10000.0);
    assert_eq!(c.max_position_embeddings, 2048);
    assert!(!c.tie_word_embeddings && !c.qkv_bias && !c.o_bias && !c.mlp_bias);
    assert_eq!(c.window(0), None);
    assert_eq!(cfg.dtype(), None);
}

// ---- other families ---------------------------------------------------------------------------

#[test]
fn gpt2_defaults_and_attribute_map_aliases() {
    // Only the required dims, under GPT2Config's attribute_map aliases.
    let text = r#"{"model_type": "gpt2", "vocab_size": 1000, "max_position_embeddings": 64,
        "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "n_inner": null}"#;
    let cfg = ModelConfig::from_hf_json(text).unwrap();
    let ModelConfig::Gpt2(c) = &cfg else { panic!("expected gpt2") };
    assert_eq!((c.n_positions, c.n_embd, c.n_layer, c.n_head), (64, 128, 2, 4));
    assert_eq!(c.n_inner, 512, "n_inner null means 4·n_embd");
    assert_eq!(c.layer_norm_epsilon, 1e-5);
    assert_eq!(c.activation_function, tessera_models::Activation::GeluTanh);
    assert_eq!((c.embd_pdrop, c.resid_pdrop, c.attn_pdrop), (0.1, 0.1, 0.1));
    assert!(c.tie_word_embeddings);
}

#[test]
fn vit_labels_come_from_id2label_and_sizes_may_be_pairs() {
    let text = r#"{"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 128, "image_size": [32, 48],
        "patch_size": 8, "num_labels": 7,
        "id2label": {"0": "a", "1": "b", "2": "c", "3": "d", "4": "e"}}"#;
    let cfg = ModelConfig::from_hf_json(text).unwrap();
    let ModelConfig::Vit(c) = &cfg else { panic!("expected vit") };
    assert_eq!(c.num_labels, 5, "id2label wins over num_labels, as in PretrainedConfig");
    assert_eq!(c.image_size, [32, 48]);
    assert_eq!(c.num_patches(), 4 * 6);
    assert_eq!(cfg.effective_seq(999), 25);
    let defaults = ModelConfig::from_hf_json(
        r#"{"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 128}"#,
    )
    .unwrap();
    let ModelConfig::Vit(d) = &defaults else { panic!("expected vit") };
    assert_eq!(
        (d.image_size, d.patch_size, d.num_channels, d.num_labels),
        ([224, 224], [16, 16], 3, 2)
    );
    assert_eq!(d.layer_norm_eps, 1e-12);
}

#[test]
fn mlp_config_json() {
    let cfg = ModelConfig::from_hf_json(
        r#"{"model_type": "mlp", "input_dim": 784, "hidden_dims": [1024, 1024], "num_classes": 10}"#,
    )
    .unwrap();
    assert_eq!(cfg.num_blocks(), 2);
    assert_eq!(cfg.num_parameters(), ModelConfig::preset("mlp").unwrap().num_parameters());
}

#[test]
fn resolve_takes_presets_then_paths() {
    assert_eq!(ModelConfig::resolve("gpt2").unwrap().name(), "gpt2");
    let path = fixture("qwen2-0.5b.json");
    assert_eq!(ModelConfig::resolve(path.to_str().unwrap()).unwrap().model_type(), "qwen2");
    let (e, text) = err_text(ModelConfig::resolve("no/such/model"));
    assert!(matches!(e, ModelError::UnknownPreset { .. }), "{e:?}");
    assert!(text.contains("no/such/model") && text.contains("llama2-70b"), "{text}");
}

// ---- bad input --------------------------------------------------------------------------------

#[test]
fn malformed_json_names_file_and_position() {
    let dir = std::env::temp_dir().join(format!("tessera-models-bad-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.json");
    std::fs::write(
        &path,
        "{\n  \"model_type\": \"gpt2\",\n  \"n_embd\": 768\n  \"n_head\": 12\n}\n",
    )
    .unwrap();
    let (e, text) = err_text(ModelConfig::from_path(&dir));
    std::fs::remove_dir_all(&dir).unwrap();
    let ModelError::Json { line, column, .. } = e else { panic!("expected Json, got {e:?}") };
    assert_eq!((line, column), (4, 3), "{text}");
    assert!(text.contains(&path.display().to_string()), "names the file: {text}");
    assert!(text.contains(":4:3") && text.contains("expected `,`"), "{text}");
}

#[test]
fn unknown_model_type_lists_supported_ones() {
    let (e, text) = err_text(ModelConfig::from_hf_json(r#"{"model_type": "t5", "d_model": 512}"#));
    assert!(matches!(e, ModelError::UnknownModelType { .. }), "{e:?}");
    assert!(text.contains("\"t5\""), "{text}");
    for t in tessera_models::SUPPORTED_MODEL_TYPES {
        assert!(text.contains(t), "lists {t}: {text}");
    }
}

#[test]
fn missing_required_field_is_named() {
    let text = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4}"#;
    let (e, msg) = err_text(ModelConfig::from_hf_json(text));
    let ModelError::MissingField { model_type, field } = &e else { panic!("{e:?}") };
    assert_eq!((model_type.as_str(), field.as_str()), ("llama", "intermediate_size"));
    assert!(msg.contains("`intermediate_size`") && msg.contains("llama"), "{msg}");
    // A missing model_type says which ones exist.
    let (_, msg) = err_text(ModelConfig::from_hf_json(r#"{"hidden_size": 64}"#));
    assert!(msg.contains("model_type") && msg.contains("qwen2"), "{msg}");
}

#[test]
fn hidden_size_not_divisible_by_heads() {
    let text = r#"{"model_type": "bert", "vocab_size": 100, "hidden_size": 100,
        "num_hidden_layers": 1, "num_attention_heads": 3, "intermediate_size": 64,
        "max_position_embeddings": 32}"#;
    let (e, msg) = err_text(ModelConfig::from_hf_json(text));
    assert!(matches!(e, ModelError::Invalid { .. }), "{e:?}");
    assert!(msg.contains("hidden_size 100 is not divisible by num_attention_heads 3"), "{msg}");
}

#[test]
fn query_heads_must_be_a_multiple_of_kv_heads() {
    let text = r#"{"model_type": "mistral", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 8,
        "num_key_value_heads": 3}"#;
    let (_, msg) = err_text(ModelConfig::from_hf_json(text));
    assert!(
        msg.contains("num_attention_heads 8 is not divisible by num_key_value_heads 3"),
        "{msg}"
    );
}

#[test]
fn odd_head_dim_is_rejected_for_rope() {
    let text = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 60,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4}"#;
    let (_, msg) = err_text(ModelConfig::from_hf_json(text));
    assert!(msg.contains("head_dim 15 must be even"), "{msg}");
}

#[test]
fn wrongly_typed_field_says_what_was_expected() {
    let text = r#"{"model_type": "gpt2", "vocab_size": "50257", "n_positions": 1024,
        "n_embd": 768, "n_layer": 12, "n_head": 12}"#;
    let (e, msg) = err_text(ModelConfig::from_hf_json(text));
    assert!(matches!(e, ModelError::Invalid { .. }), "{e:?}");
    assert!(msg.contains("`vocab_size`") && msg.contains("non-negative integer"), "{msg}");
}

#[test]
fn unknown_preset_lists_presets() {
    let (e, msg) = err_text(ModelConfig::preset("gpt5"));
    assert!(matches!(e, ModelError::UnknownPreset { .. }), "{e:?}");
    assert!(msg.contains("\"gpt5\""), "{msg}");
    for p in tessera_models::PRESETS {
        assert!(msg.contains(p), "lists {p}: {msg}");
    }
}

#[test]
fn unsupported_rope_type_lists_supported_ones() {
    let text = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}"#;
    let (e, msg) = err_text(ModelConfig::from_hf_json(text));
    assert!(matches!(e, ModelError::Unsupported { .. }), "{e:?}");
    assert!(msg.contains("\"longrope\"") && msg.contains("default, linear, llama3"), "{msg}");
    // The same through transformers 5's rope_parameters.
    let v5 = text.replace("rope_scaling", "rope_parameters");
    let (_, msg) = err_text(ModelConfig::from_hf_json(&v5));
    assert!(msg.contains("rope_parameters.rope_type") && msg.contains("\"longrope\""), "{msg}");
    // YaRN is read, but only DeepSeek-V3's attention applies its attention factor.
    let yarn = text.replace("longrope", "yarn");
    let (e, msg) = err_text(ModelConfig::from_hf_json(&yarn));
    assert!(matches!(e, ModelError::Unsupported { .. }), "{e:?}");
    assert!(msg.contains("yarn on llama") && msg.contains("deepseek_v3"), "{msg}");
}

#[test]
fn sequence_longer_than_learned_positions() {
    let gpt2 = ModelConfig::preset("gpt2").unwrap();
    let (e, msg) = err_text(build(&gpt2, &BuildOptions::new(1, 2048, DType::F32)));
    let ModelError::SequenceTooLong { seq, max, .. } = e else { panic!("{e:?}") };
    assert_eq!((seq, max), (2048, 1024));
    assert!(msg.contains("n_positions = 1024") && msg.contains("at most 1024"), "{msg}");
    assert!(build(&gpt2, &BuildOptions::new(1, 1024, DType::F32)).is_ok(), "1024 fits exactly");

    let bert = ModelConfig::preset("bert-large").unwrap();
    let (_, msg) = err_text(build(&bert, &BuildOptions::new(1, 513, DType::F32)));
    assert!(msg.contains("max_position_embeddings = 512"), "{msg}");
}

#[test]
fn missing_file_is_an_io_error_naming_the_path() {
    let (e, msg) = err_text(ModelConfig::from_path(&fixture("no-such-dir")));
    assert!(matches!(e, ModelError::Io { .. }), "{e:?}");
    assert!(msg.contains("no-such-dir"), "{msg}");
}

#[test]
fn not_an_object_and_bad_dropout_are_invalid() {
    let (e, _) = err_text(ModelConfig::from_hf_json("[1, 2]"));
    assert!(matches!(e, ModelError::Invalid { .. }), "{e:?}");
    let text = r#"{"model_type": "gpt2", "vocab_size": 10, "n_positions": 8, "n_embd": 8,
        "n_layer": 1, "n_head": 2, "resid_pdrop": 1.5}"#;
    let (_, msg) = err_text(ModelConfig::from_hf_json(text));
    assert!(msg.contains("resid_pdrop") && msg.contains("[0, 1)"), "{msg}");
}

#[test]
fn absurd_sizes_are_rejected_not_overflowed() {
    let text = r#"{"model_type": "gpt2", "vocab_size": 18446744073709551615,
        "n_positions": 1024, "n_embd": 4294967296, "n_layer": 1, "n_head": 1}"#;
    let (_, msg) = err_text(ModelConfig::from_hf_json(text));
    assert!(msg.contains("2^50"), "{msg}");
    let gpt2 = ModelConfig::preset("llama2-70b").unwrap();
    let (_, msg) = err_text(build(&gpt2, &BuildOptions::new(1 << 20, 1 << 20, DType::F32)));
    assert!(msg.contains("reduce batch or seq"), "{msg}");
}

// ---- export: to_hf_json is the inverse of from_hf_json ---------------------------------------

/// `cfg` with an unstated dtype read as f32, which is what `to_hf_json` writes for it.
fn with_stated_dtype(cfg: &ModelConfig) -> serde_json::Value {
    let mut json = serde_json::to_value(cfg).unwrap();
    if json["dtype"].is_null() {
        json["dtype"] = serde_json::to_value(DType::F32).unwrap();
    }
    json
}

/// Parameter names and shapes of the built graph, in declaration order.
fn param_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let model = build(cfg, &BuildOptions::new(1, 4, DType::F32)).unwrap();
    let g = &model.builder.graph;
    g.parameters()
        .into_iter()
        .map(|p| (g.tensor_scope(p).to_string(), g.shape(p).dims().to_vec()))
        .collect()
}

fn check_round_trip(cfg: &ModelConfig, what: &str) {
    let json = cfg.to_hf_json();
    // diffusers' configs name their class (`_class_name`) instead of a `model_type`.
    if json.get("_class_name").is_some() {
        assert!(json.get("model_type").is_none(), "{what}: a diffusers config has no model_type");
    } else {
        assert_eq!(json["model_type"], cfg.model_type(), "{what}");
    }
    let text = serde_json::to_string_pretty(&json).unwrap();
    let back = ModelConfig::from_hf_json(&text).unwrap_or_else(|e| panic!("{what}: {e}\n{text}"));
    assert_eq!(with_stated_dtype(&back), with_stated_dtype(cfg), "{what}:\n{text}");
    if cfg.dtype().is_some() {
        assert_eq!(&back, cfg, "{what}: a stated dtype round-trips exactly");
    }
    assert_eq!(back.name(), cfg.name(), "{what}");
    assert_eq!(back.num_parameters(), cfg.num_parameters(), "{what}");
    // Small enough to build: the graphs have the same parameters, names and shapes.
    if cfg.num_parameters() < 200_000_000 {
        assert_eq!(param_shapes(&back), param_shapes(cfg), "{what}");
    }
}

#[test]
fn to_hf_json_round_trips_every_preset_and_fixture() {
    for name in tessera_models::PRESETS {
        check_round_trip(&ModelConfig::preset(name).unwrap(), &format!("preset {name}"));
    }
    let hf = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tessera-cli/tests/fixtures/hf");
    for dir in ["bloom", "bloom-6heads"] {
        check_round_trip(&ModelConfig::from_path(&hf.join(dir)).unwrap(), dir);
    }
    for file in [
        "bert-large-uncased.json",
        "gpt2.json",
        "llama-2-7b-hf",
        "llama-3.2-1b.json",
        "mistral-7b-v0.1.json",
        "qwen2-0.5b.json",
        "smollm2-135m-v5.json",
    ] {
        check_round_trip(&ModelConfig::from_path(&fixture(file)).unwrap(), file);
    }
}

#[test]
fn to_hf_json_round_trips_non_default_settings() {
    use tessera_models::{Activation, LlamaParams, VitConfig, VitParams};
    let base = |variant| LlamaParams::new(variant, "x", 64, 32, 48, 2, 4);
    let mut variants = Vec::new();
    // Tied llama with explicit head_dim, biases, linear RoPE scaling and bf16.
    let mut p = base(LlamaVariant::Llama);
    (p.tie_word_embeddings, p.head_dim, p.qkv_bias, p.o_bias, p.mlp_bias) =
        (true, Some(16), true, true, true);
    p.rope_scaling = RopeScaling::Linear { factor: 4.0 };
    p.hidden_act = Activation::GeluTanh;
    p.dtype = Some(DType::BF16);
    variants.push(p);
    // Mistral without a window; Qwen2 with one from layer 1.
    let mut p = base(LlamaVariant::Mistral);
    p.sliding_window = None;
    variants.push(p);
    let mut p = base(LlamaVariant::Qwen2);
    (p.sliding_window, p.sliding_window_from_layer, p.num_key_value_heads) = (Some(8), 1, 2);
    variants.push(p);
    for p in variants {
        let cfg = ModelConfig::Llama(LlamaConfig::new(p).unwrap());
        check_round_trip(&cfg, &format!("{:?}", cfg));
    }
    // GPT-2 with a non-default MLP width, untied head and inverse-layer scaling.
    let mut p = tessera_models::Gpt2Params::new("g", 100, 16, 32, 2, 4);
    (p.n_inner, p.tie_word_embeddings, p.scale_attn_by_inverse_layer_idx) = (40, false, true);
    p.activation_function = Activation::Relu;
    check_round_trip(&ModelConfig::Gpt2(tessera_models::Gpt2Config::new(p).unwrap()), "gpt2");
    // ViT with rectangular images and patches, 3 labels.
    let mut p = VitParams::new("v", 32, 1, 2, 64);
    (p.image_size, p.patch_size, p.num_labels, p.qkv_bias) = ([32, 48], [8, 16], 3, false);
    check_round_trip(&ModelConfig::Vit(VitConfig::new(p).unwrap()), "vit");
    // Untied BLOOM with dropouts and bf16.
    let mut p = tessera_models::BloomParams::new("bl", 60, 24, 2, 3);
    (p.tie_word_embeddings, p.hidden_dropout, p.attention_dropout) = (false, 0.1, 0.05);
    (p.layer_norm_epsilon, p.dtype) = (1e-6, Some(DType::BF16));
    check_round_trip(&ModelConfig::Bloom(tessera_models::BloomConfig::new(p).unwrap()), "bloom");
    // Untied BERT.
    let mut p = tessera_models::BertParams::new("b", 50, 16, 1, 2, 32, 20);
    (p.tie_word_embeddings, p.type_vocab_size) = (false, 3);
    check_round_trip(&ModelConfig::Bert(tessera_models::BertConfig::new(p).unwrap()), "bert");
}

#[test]
fn to_hf_json_writes_what_transformers_expects() {
    let gpt2 = ModelConfig::preset("gpt2").unwrap().to_hf_json();
    assert_eq!(gpt2["architectures"], serde_json::json!(["GPT2LMHeadModel"]));
    assert_eq!(gpt2["activation_function"], "gelu_new");
    assert_eq!(gpt2["n_inner"], serde_json::Value::Null);
    assert_eq!(gpt2["eos_token_id"], 50256);
    assert_eq!(gpt2["torch_dtype"], "float32");
    let llama3 = ModelConfig::from_path(&fixture("llama-3.2-1b.json")).unwrap().to_hf_json();
    assert_eq!(llama3["architectures"], serde_json::json!(["LlamaForCausalLM"]));
    assert_eq!(llama3["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(llama3["rope_theta"], 500000.0);
    assert_eq!(llama3["tie_word_embeddings"], true);
    assert_eq!(llama3["torch_dtype"], "bfloat16");
    let mistral = ModelConfig::from_path(&fixture("mistral-7b-v0.1.json")).unwrap().to_hf_json();
    assert_eq!(mistral["architectures"], serde_json::json!(["MistralForCausalLM"]));
    assert_eq!(mistral["sliding_window"], 4096);
    let qwen = ModelConfig::from_path(&fixture("qwen2-0.5b.json")).unwrap().to_hf_json();
    assert_eq!(qwen["architectures"], serde_json::json!(["Qwen2ForCausalLM"]));
    assert_eq!(qwen["use_sliding_window"], false);
    let bert = ModelConfig::preset("bert-large").unwrap().to_hf_json();
    assert_eq!(bert["architectures"], serde_json::json!(["BertForMaskedLM"]));
    let vit = ModelConfig::preset("vit-base").unwrap().to_hf_json();
    assert_eq!(vit["architectures"], serde_json::json!(["ViTForImageClassification"]));
    assert_eq!(vit["id2label"].as_object().unwrap().len(), 1000);
    assert_eq!(ModelConfig::preset("mlp").unwrap().to_hf_json()["model_type"], "mlp");
    let bloom = ModelConfig::preset("bloom-7b1").unwrap().to_hf_json();
    assert_eq!(bloom["architectures"], serde_json::json!(["BloomForCausalLM"]));
    assert_eq!((bloom["n_layer"].as_u64(), bloom["n_head"].as_u64()), (Some(30), Some(32)));
}
