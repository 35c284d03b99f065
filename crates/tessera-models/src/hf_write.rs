//! Hugging Face `config.json` export: [`ModelConfig::to_hf_json`], the inverse of
//! [`ModelConfig::from_hf_json`].
//!
//! The JSON is what `save_pretrained` of the matching `transformers` class writes
//! (transformers 4.x keys: `rope_theta` + `rope_scaling`, `torch_dtype`), so
//! `AutoModelFor*.from_pretrained(dir)` rebuilds the same architecture and
//! `from_hf_json(to_hf_json(c)) == c` for every configuration `transformers` can express.
//!
//! Written per family:
//! - GPT-2: `GPT2LMHeadModel`; `n_inner` is `null` when it is transformers' default 4·n_embd;
//!   `bos_token_id`/`eos_token_id` are the last token (50256 for the real vocabulary, and in
//!   range for small ones).
//! - LLaMA / Mistral / Qwen2: `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM`;
//!   `head_dim` only when explicit; `rope_scaling` null for plain RoPE. Mixtral / Qwen2-MoE /
//!   Qwen3-MoE: `MixtralForCausalLM` / `Qwen2MoeForCausalLM` / `Qwen3MoeForCausalLM` with
//!   their MoE keys; DeepSeek-V3: `DeepseekV3ForCausalLM` with its MLA and routing keys (no
//!   `head_dim`: its config class derives it).
//! - BLOOM: `BloomForCausalLM` with BLOOM's own key names (`n_layer`, `n_head`,
//!   `layer_norm_epsilon`), `pretraining_tp` 1; `bos_token_id`/`eos_token_id` are
//!   `BloomConfig`'s 1 and 2 (the last token for smaller vocabularies).
//! - BERT: `BertForMaskedLM`, absolute positions. ViT: `ViTForImageClassification` with an
//!   `id2label` of `LABEL_i` (transformers' own default names).
//! - MLP: our own `model_type: "mlp"` (no `architectures`).
//! - UNet: diffusers' `UNet2DConditionModel` config (`_class_name`, no `model_type`).
//!
//! `torch_dtype` is the config's dtype, `float32` when it states none.
//!
//! Not expressible in `transformers`, so not round-tripped (the nearest config is written):
//! a llama with `qkv_bias != o_bias` (HF has one `attention_bias`, written from `qkv_bias`),
//! biases on Mistral, a Qwen2 without q/k/v bias or with MLP/o biases, and a sliding window
//! or `sliding_window_from_layer` on the `llama` variant.

use crate::config::{
    Activation, BertConfig, BloomConfig, Gpt2Config, LlamaConfig, LlamaVariant, MlpConfig,
    MoeParams, VitConfig,
};
use crate::rope::RopeScaling;
use crate::ModelConfig;
use serde_json::{json, Map, Value};
use tessera_ir::DType;

impl ModelConfig {
    /// The Hugging Face `config.json` of this configuration (see the module docs of
    /// `hf_write.rs` for what each family writes).
    pub fn to_hf_json(&self) -> Value {
        let mut map = match self {
            ModelConfig::Gpt2(c) => gpt2(c),
            ModelConfig::Llama(c) => llama(c),
            ModelConfig::Bert(c) => bert(c),
            ModelConfig::Vit(c) => vit(c),
            ModelConfig::Mlp(c) => mlp(c),
            ModelConfig::Bloom(c) => bloom(c),
            ModelConfig::ClipText(c) => clip_text(c),
            // A diffusers model: its own config layout (`_class_name`, no `model_type`).
            ModelConfig::Dit(c) => return c.to_diffusers_json(),
            // No transformers class reads an ONNX graph: the file it came from is recorded,
            // as an absolute path where it resolves (a checkpoint is read from anywhere).
            ModelConfig::Onnx(c) => {
                let mut m = Map::new();
                let path = std::fs::canonicalize(&c.path)
                    .map_or_else(|_| c.path.clone(), |p| p.display().to_string());
                m.insert("onnx_model".into(), json!(path));
                m
            }
            // diffusers configs have `_class_name` and no `model_type`.
            ModelConfig::UNet(c) => return c.to_diffusers_json(),
            ModelConfig::Vae(c) => return c.to_diffusers_json(),
        };
        map.insert("_name_or_path".into(), json!(self.name()));
        map.insert("model_type".into(), json!(self.model_type()));
        map.insert("torch_dtype".into(), json!(hf_dtype(self.dtype().unwrap_or(DType::F32))));
        Value::Object(map)
    }
}

/// `CLIPTextConfig`'s fields.
fn clip_text(c: &crate::ClipTextConfig) -> Map<String, Value> {
    let act = match c.hidden_act {
        crate::ClipActivation::QuickGelu => "quick_gelu",
        crate::ClipActivation::Gelu => "gelu",
        crate::ClipActivation::GeluTanh => "gelu_pytorch_tanh",
    };
    let v = json!({
        "architectures": ["CLIPTextModel"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": act,
        "layer_norm_eps": c.layer_norm_eps,
    });
    v.as_object().cloned().unwrap_or_default()
}

/// The `torch.dtype` name (`float32`, `bfloat16`, ...).
fn hf_dtype(d: DType) -> &'static str {
    match d {
        DType::F64 => "float64",
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::Bool => "bool",
        DType::U8 => "uint8",
    }
}

/// The `ACT2FN` name; GPT-2's tanh GELU is traditionally `gelu_new`, the others'
/// `gelu_pytorch_tanh` (the same function).
fn hf_activation(a: Activation, gpt2: bool) -> &'static str {
    match a {
        Activation::Gelu => "gelu",
        Activation::GeluTanh if gpt2 => "gelu_new",
        Activation::GeluTanh => "gelu_pytorch_tanh",
        Activation::Relu => "relu",
        Activation::Silu => "silu",
        Activation::Sigmoid => "sigmoid",
        Activation::Tanh => "tanh",
    }
}

fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!("json! of an object literal"),
    }
}

fn gpt2(c: &Gpt2Config) -> Map<String, Value> {
    let n_inner = if c.n_inner == 4 * c.n_embd { Value::Null } else { json!(c.n_inner) };
    let last_token = c.vocab_size - 1;
    object(json!({
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": c.vocab_size,
        "n_positions": c.n_positions,
        "n_ctx": c.n_positions,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": n_inner,
        "activation_function": hf_activation(c.activation_function, true),
        "layer_norm_epsilon": c.layer_norm_epsilon,
        "embd_pdrop": c.embd_pdrop,
        "resid_pdrop": c.resid_pdrop,
        "attn_pdrop": c.attn_pdrop,
        "scale_attn_weights": c.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx": c.scale_attn_by_inverse_layer_idx,
        "reorder_and_upcast_attn": false,
        "tie_word_embeddings": c.tie_word_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": last_token,
        "eos_token_id": last_token,
        "use_cache": true,
    }))
}

fn rope_scaling(s: &RopeScaling) -> Value {
    match *s {
        RopeScaling::Default => Value::Null,
        RopeScaling::Linear { factor } => json!({ "rope_type": "linear", "factor": factor }),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            attention_factor,
            truncate,
        } => {
            let mut m = object(json!({
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": original_max_position_embeddings,
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
                "truncate": truncate,
            }));
            for (k, v) in [
                ("mscale", mscale),
                ("mscale_all_dim", mscale_all_dim),
                ("attention_factor", attention_factor),
            ] {
                if let Some(v) = v {
                    m.insert(k.into(), json!(v));
                }
            }
            Value::Object(m)
        }
    }
}

fn llama(c: &LlamaConfig) -> Map<String, Value> {
    let architecture = match c.variant {
        LlamaVariant::Llama => "LlamaForCausalLM",
        LlamaVariant::Mistral => "MistralForCausalLM",
        LlamaVariant::Qwen2 => "Qwen2ForCausalLM",
        LlamaVariant::Mixtral => "MixtralForCausalLM",
        LlamaVariant::Qwen2Moe => "Qwen2MoeForCausalLM",
        LlamaVariant::Qwen3Moe => "Qwen3MoeForCausalLM",
        LlamaVariant::DeepseekV3 => "DeepseekV3ForCausalLM",
    };
    let mut m = object(json!({
        "architectures": [architecture],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": hf_activation(c.hidden_act, false),
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_scaling(&c.rope_scaling),
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": true,
    }));
    // DeepseekV3Config derives its own head_dim (the RoPE dim) from the MLA keys.
    if let Some(h) = c.params().head_dim.filter(|_| c.mla.is_none()) {
        m.insert("head_dim".into(), json!(h));
    }
    match c.variant {
        LlamaVariant::Llama => {
            m.insert("attention_bias".into(), json!(c.qkv_bias));
            m.insert("mlp_bias".into(), json!(c.mlp_bias));
            m.insert("pretraining_tp".into(), json!(1));
        }
        LlamaVariant::Mistral => {
            m.insert("sliding_window".into(), json!(c.sliding_window));
        }
        LlamaVariant::Qwen2 | LlamaVariant::Qwen2Moe | LlamaVariant::Qwen3Moe => {
            m.insert("use_sliding_window".into(), json!(c.sliding_window.is_some()));
            m.insert("sliding_window".into(), json!(c.sliding_window));
            m.insert("max_window_layers".into(), json!(c.sliding_window_from_layer));
        }
        LlamaVariant::Mixtral => {
            m.insert("sliding_window".into(), json!(c.sliding_window));
        }
        LlamaVariant::DeepseekV3 => {
            m.insert("attention_bias".into(), json!(c.qkv_bias));
            if let Some(mla) = &c.mla {
                m.insert("q_lora_rank".into(), json!(mla.q_lora_rank));
                m.insert("kv_lora_rank".into(), json!(mla.kv_lora_rank));
                m.insert("qk_nope_head_dim".into(), json!(mla.qk_nope_head_dim));
                m.insert("qk_rope_head_dim".into(), json!(mla.qk_rope_head_dim));
                m.insert("v_head_dim".into(), json!(mla.v_head_dim));
                m.insert("rope_interleave".into(), json!(mla.rope_interleave));
            }
        }
    }
    if let Some(moe) = &c.moe {
        moe_keys(&mut m, c, moe);
    }
    m
}

/// The MoE keys of `MixtralConfig` / `Qwen2MoeConfig` / `Qwen3MoeConfig` /
/// `DeepseekV3Config`; `capacity_factor` (tessera's own) only when set.
fn moe_keys(m: &mut Map<String, Value>, c: &LlamaConfig, moe: &MoeParams) {
    if let Some(ds) = &moe.deepseek {
        m.insert("n_routed_experts".into(), json!(moe.num_experts));
        m.insert("moe_intermediate_size".into(), json!(moe.expert_intermediate_size));
        m.insert("norm_topk_prob".into(), json!(moe.norm_topk_prob));
        m.insert("first_k_dense_replace".into(), json!(moe.first_dense_layers));
        m.insert("n_group".into(), json!(ds.n_group));
        m.insert("topk_group".into(), json!(ds.topk_group));
        m.insert("routed_scaling_factor".into(), json!(ds.routed_scaling_factor));
        m.insert("n_shared_experts".into(), json!(ds.n_shared_experts));
    } else if matches!(c.variant, LlamaVariant::Qwen2Moe | LlamaVariant::Qwen3Moe) {
        if c.variant == LlamaVariant::Qwen3Moe {
            m.insert("attention_bias".into(), json!(c.qkv_bias));
        } else {
            m.insert("qkv_bias".into(), json!(c.qkv_bias));
            if let Some(s) = moe.shared_expert_intermediate_size {
                m.insert("shared_expert_intermediate_size".into(), json!(s));
            }
        }
        m.insert("num_experts".into(), json!(moe.num_experts));
        m.insert("moe_intermediate_size".into(), json!(moe.expert_intermediate_size));
        m.insert("norm_topk_prob".into(), json!(moe.norm_topk_prob));
        m.insert("decoder_sparse_step".into(), json!(moe.decoder_sparse_step));
        m.insert("mlp_only_layers".into(), json!(moe.mlp_only_layers));
    } else {
        m.insert("num_local_experts".into(), json!(moe.num_experts));
        m.insert("router_jitter_noise".into(), json!(0.0));
    }
    m.insert("num_experts_per_tok".into(), json!(moe.num_experts_per_tok));
    m.insert("router_aux_loss_coef".into(), json!(moe.router_aux_loss_coef));
    m.insert("output_router_logits".into(), json!(moe.output_router_logits));
    if let Some(f) = moe.capacity_factor {
        m.insert("capacity_factor".into(), json!(f));
    }
}

fn bloom(c: &BloomConfig) -> Map<String, Value> {
    let last_token = c.vocab_size - 1;
    object(json!({
        "architectures": ["BloomForCausalLM"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "layer_norm_epsilon": c.layer_norm_epsilon,
        "hidden_dropout": c.hidden_dropout,
        "attention_dropout": c.attention_dropout,
        "apply_residual_connection_post_layernorm": c.apply_residual_connection_post_layernorm,
        "tie_word_embeddings": c.tie_word_embeddings,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "slow_but_exact": false,
        "bos_token_id": last_token.min(1),
        "eos_token_id": last_token.min(2),
        "use_cache": true,
    }))
}

fn bert(c: &BertConfig) -> Map<String, Value> {
    object(json!({
        "architectures": ["BertForMaskedLM"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings,
        "type_vocab_size": c.type_vocab_size,
        "hidden_act": hf_activation(c.hidden_act, false),
        "layer_norm_eps": c.layer_norm_eps,
        "hidden_dropout_prob": c.hidden_dropout_prob,
        "attention_probs_dropout_prob": c.attention_probs_dropout_prob,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": c.tie_word_embeddings,
        "initializer_range": 0.02,
        "pad_token_id": 0,
        "use_cache": true,
    }))
}

/// `n` for a square `[n, n]`, else `[h, w]` (transformers accepts both).
fn pair(hw: [usize; 2]) -> Value {
    if hw[0] == hw[1] {
        json!(hw[0])
    } else {
        json!(hw)
    }
}

fn vit(c: &VitConfig) -> Map<String, Value> {
    let id2label: Map<String, Value> =
        (0..c.num_labels).map(|i| (i.to_string(), json!(format!("LABEL_{i}")))).collect();
    let label2id: Map<String, Value> =
        (0..c.num_labels).map(|i| (format!("LABEL_{i}"), json!(i))).collect();
    object(json!({
        "architectures": ["ViTForImageClassification"],
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "intermediate_size": c.intermediate_size,
        "hidden_act": hf_activation(c.hidden_act, false),
        "layer_norm_eps": c.layer_norm_eps,
        "hidden_dropout_prob": c.hidden_dropout_prob,
        "attention_probs_dropout_prob": c.attention_probs_dropout_prob,
        "image_size": pair(c.image_size),
        "patch_size": pair(c.patch_size),
        "num_channels": c.num_channels,
        "qkv_bias": c.qkv_bias,
        "encoder_stride": c.patch_size[0],
        "initializer_range": 0.02,
        "id2label": id2label,
        "label2id": label2id,
    }))
}

fn mlp(c: &MlpConfig) -> Map<String, Value> {
    object(json!({
        "input_dim": c.input_dim,
        "hidden_dims": c.hidden_dims,
        "num_classes": c.num_classes,
    }))
}
