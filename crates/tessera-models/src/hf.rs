//! Hugging Face `config.json` import.
//!
//! Required: the architecture dims (vocab, hidden size, layers, heads, the MLP width where the
//! architecture has one, and the learned position table's length). Everything else takes the
//! defaults of the matching `transformers` config class. Both key generations are read:
//! `rope_theta` + `rope_scaling` + `torch_dtype` (transformers 4.x) and `rope_parameters` +
//! `dtype` (5.x). A JSON `null` counts as absent, except Mistral's `sliding_window`, where
//! null means "no window" and absence means the class default (4096).

use crate::config::*;
use crate::error::{ModelError, Result};
use crate::rope::{RopeScaling, SUPPORTED_ROPE_TYPES};
use crate::ModelConfig;
use serde_json::{Map, Value};
use tessera_ir::DType;

/// The `model_type` values a config.json may have.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "bloom",
    "bert",
    "vit",
    "mlp",
    "onnx",
];

/// Parses a config.json's `text`; `origin` names it in errors, `fallback_name` names the model
/// when the file has no `_name_or_path`.
pub(crate) fn parse(text: &str, origin: &str, fallback_name: Option<&str>) -> Result<ModelConfig> {
    let value: Value = serde_json::from_str(text).map_err(|e| {
        let full = e.to_string();
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        ModelError::Json {
            path: origin.to_string(),
            line: e.line(),
            column: e.column(),
            message: full.strip_suffix(&suffix).unwrap_or(&full).to_string(),
        }
    })?;
    let Value::Object(map) = &value else {
        return Err(ModelError::invalid(
            origin,
            format!("must be a JSON object of settings, got {}", json_kind(&value)),
        ));
    };
    // diffusers writes `_class_name` instead of `model_type`.
    if let Some(class) = map.get("_class_name").and_then(Value::as_str) {
        let name = match map.get("_name_or_path").and_then(Value::as_str) {
            Some(n) if !n.is_empty() => n.to_string(),
            _ => fallback_name.unwrap_or(class).to_string(),
        };
        return match class {
            crate::diffusion::DIT_CLASS_NAME => crate::diffusion::dit_from_diffusers(map, name),
            other => Err(ModelError::Unsupported {
                what: "diffusers _class_name".into(),
                found: other.to_string(),
                supported: crate::diffusion::DIT_CLASS_NAME.into(),
            }),
        };
    }
    let model_type = match map.get("model_type") {
        Some(Value::String(s)) => s.as_str(),
        None | Some(Value::Null) => {
            return Err(ModelError::MissingField {
                model_type: String::new(),
                field: "model_type".into(),
            })
        }
        Some(other) => {
            return Err(ModelError::invalid(
                "model_type",
                format!("must be a string such as \"llama\", got {}", json_kind(other)),
            ))
        }
    };
    let f = Fields { map, model_type, prefix: "" };
    let name = match f.str("_name_or_path")? {
        Some(n) if !n.is_empty() => n.to_string(),
        _ => fallback_name.unwrap_or(model_type).to_string(),
    };
    match model_type {
        "gpt2" => gpt2(&f, name),
        "llama" => llama(&f, name, LlamaVariant::Llama),
        "mistral" => llama(&f, name, LlamaVariant::Mistral),
        "qwen2" => llama(&f, name, LlamaVariant::Qwen2),
        "mixtral" => llama(&f, name, LlamaVariant::Mixtral),
        "qwen2_moe" => llama(&f, name, LlamaVariant::Qwen2Moe),
        "qwen3_moe" => llama(&f, name, LlamaVariant::Qwen3Moe),
        "deepseek_v3" => llama(&f, name, LlamaVariant::DeepseekV3),
        "bloom" => bloom(&f, name),
        "bert" => bert(&f, name),
        "vit" => vit(&f, name),
        "mlp" => mlp(&f, name),
        "onnx" => onnx(&f, origin),
        other => Err(ModelError::UnknownModelType {
            found: other.to_string(),
            supported: SUPPORTED_MODEL_TYPES.join(", "),
        }),
    }
}

/// A checkpoint of a model imported from ONNX (what `train --save` writes for one): its
/// `onnx_model` is the file the graph is read from, relative to the config's folder when not
/// absolute; the weights are the checkpoint's.
fn onnx(f: &Fields, origin: &str) -> Result<ModelConfig> {
    let Some(file) = f.str("onnx_model")? else {
        return Err(ModelError::MissingField {
            model_type: "onnx".into(),
            field: "onnx_model".into(),
        });
    };
    let mut path = std::path::PathBuf::from(file);
    if path.is_relative() {
        if let Some(dir) = std::path::Path::new(origin).parent() {
            path = dir.join(path);
        }
    }
    if !path.is_file() {
        return Err(ModelError::invalid(
            "onnx_model",
            format!(
                "{origin} names the ONNX file {} as its graph, which does not exist: put the \
                 file back there, or set onnx_model to where it is now",
                path.display()
            ),
        ));
    }
    crate::onnx::OnnxConfig::open(&path).map(ModelConfig::Onnx)
}

fn gpt2(f: &Fields, name: String) -> Result<ModelConfig> {
    let n_embd = f.req_usize(&["n_embd", "hidden_size"])?;
    let mut p = Gpt2Params::new(
        name,
        f.req_usize(&["vocab_size"])?,
        f.req_usize(&["n_positions", "max_position_embeddings"])?,
        n_embd,
        f.req_usize(&["n_layer", "num_hidden_layers"])?,
        f.req_usize(&["n_head", "num_attention_heads"])?,
    );
    f.set_usize("n_inner", &mut p.n_inner)?;
    f.set_activation("activation_function", &mut p.activation_function)?;
    f.set_f64("layer_norm_epsilon", &mut p.layer_norm_epsilon)?;
    f.set_f64("embd_pdrop", &mut p.embd_pdrop)?;
    f.set_f64("resid_pdrop", &mut p.resid_pdrop)?;
    f.set_f64("attn_pdrop", &mut p.attn_pdrop)?;
    f.set_bool("scale_attn_weights", &mut p.scale_attn_weights)?;
    f.set_bool("scale_attn_by_inverse_layer_idx", &mut p.scale_attn_by_inverse_layer_idx)?;
    f.set_bool("tie_word_embeddings", &mut p.tie_word_embeddings)?;
    p.dtype = f.dtype()?;
    Ok(ModelConfig::Gpt2(Gpt2Config::new(p)?))
}

fn llama(f: &Fields, name: String, variant: LlamaVariant) -> Result<ModelConfig> {
    // Qwen-MoE's `intermediate_size` is only its dense layers' (`mlp_only_layers`,
    // `decoder_sparse_step`) width: the class default when absent.
    let intermediate_size = match variant {
        LlamaVariant::Qwen3Moe => f.usize("intermediate_size")?.unwrap_or(6144),
        LlamaVariant::Qwen2Moe => f.usize("intermediate_size")?.unwrap_or(5632),
        _ => f.req_usize(&["intermediate_size"])?,
    };
    let mut p = LlamaParams::new(
        variant,
        name,
        f.req_usize(&["vocab_size"])?,
        f.req_usize(&["hidden_size"])?,
        intermediate_size,
        f.req_usize(&["num_hidden_layers"])?,
        f.req_usize(&["num_attention_heads"])?,
    );
    f.set_usize("num_key_value_heads", &mut p.num_key_value_heads)?;
    p.head_dim = f.usize("head_dim")?;
    f.set_usize("max_position_embeddings", &mut p.max_position_embeddings)?;
    f.set_activation("hidden_act", &mut p.hidden_act)?;
    f.set_f64("rms_norm_eps", &mut p.rms_norm_eps)?;
    f.set_bool("tie_word_embeddings", &mut p.tie_word_embeddings)?;
    (p.rope_theta, p.rope_scaling) = rope(f, p.max_position_embeddings)?;
    let theta_given = f.value("rope_theta").is_some()
        || f.object("rope_parameters")?.is_some_and(|m| m.get("rope_theta").is_some());
    if variant == LlamaVariant::Mixtral && !theta_given {
        p.rope_theta = 1e6; // MixtralConfig's default
    }
    match variant {
        LlamaVariant::Llama => {
            let attention_bias = f.bool("attention_bias")?.unwrap_or(false);
            p.qkv_bias = attention_bias;
            p.o_bias = attention_bias;
            f.set_bool("mlp_bias", &mut p.mlp_bias)?;
        }
        LlamaVariant::Mistral => {
            p.sliding_window = match f.map.get("sliding_window") {
                None => Some(4096),
                Some(Value::Null) => None,
                Some(_) => f.usize("sliding_window")?,
            };
        }
        LlamaVariant::Mixtral => {
            // MixtralConfig's window defaults to none (Mistral's to 4096).
            p.sliding_window = f.usize("sliding_window")?;
        }
        LlamaVariant::DeepseekV3 => {
            let attention_bias = f.bool("attention_bias")?.unwrap_or(false);
            (p.qkv_bias, p.o_bias) = (attention_bias, attention_bias);
            mla_fields(f, &mut p)?;
        }
        LlamaVariant::Qwen2 | LlamaVariant::Qwen2Moe | LlamaVariant::Qwen3Moe => {
            if variant == LlamaVariant::Qwen2Moe {
                // Qwen2MoeAttention: q/k/v biased (`qkv_bias`, default true), o_proj not.
                f.set_bool("qkv_bias", &mut p.qkv_bias)?;
            }
            if variant == LlamaVariant::Qwen3Moe {
                let attention_bias = f.bool("attention_bias")?.unwrap_or(false);
                (p.qkv_bias, p.o_bias) = (attention_bias, attention_bias);
            }
            p.sliding_window = if f.bool("use_sliding_window")?.unwrap_or(false) {
                match f.map.get("sliding_window") {
                    None => Some(4096),
                    Some(_) => f.usize("sliding_window")?,
                }
            } else {
                None
            };
            f.set_usize("max_window_layers", &mut p.sliding_window_from_layer)?;
        }
    }
    if let Some(moe) = p.moe.as_mut() {
        moe_fields(f, variant, moe)?;
    }
    p.dtype = f.dtype()?;
    Ok(ModelConfig::Llama(LlamaConfig::new(p)?))
}

/// `DeepseekV3Config`'s attention keys; `head_dim` is `qk_nope_head_dim + qk_rope_head_dim`
/// (transformers sets `head_dim` to the RoPE dim, which this crate reads from the MLA fields).
fn mla_fields(f: &Fields, p: &mut LlamaParams) -> Result<()> {
    let mla = p.mla.get_or_insert_with(MlaParams::deepseek_v3);
    if f.map.contains_key("q_lora_rank") {
        mla.q_lora_rank = f.usize("q_lora_rank")?;
    }
    f.set_usize("kv_lora_rank", &mut mla.kv_lora_rank)?;
    f.set_usize("qk_nope_head_dim", &mut mla.qk_nope_head_dim)?;
    f.set_usize("qk_rope_head_dim", &mut mla.qk_rope_head_dim)?;
    f.set_usize("v_head_dim", &mut mla.v_head_dim)?;
    f.set_bool("rope_interleave", &mut mla.rope_interleave)?;
    p.head_dim = Some(mla.qk_head_dim());
    if f.usize("num_key_value_heads")?.is_none() {
        p.num_key_value_heads = p.num_attention_heads;
    }
    Ok(())
}

/// `MixtralConfig` / `Qwen2MoeConfig` / `Qwen3MoeConfig` / `DeepseekV3Config`'s MoE keys, and
/// tessera's own `capacity_factor` (absent or null: dropless).
fn moe_fields(f: &Fields, variant: LlamaVariant, moe: &mut MoeParams) -> Result<()> {
    if variant == LlamaVariant::DeepseekV3 {
        if let Some(n) = f.usize("n_routed_experts")?.or(f.usize("num_local_experts")?) {
            moe.num_experts = n;
        }
        f.set_usize("moe_intermediate_size", &mut moe.expert_intermediate_size)?;
        f.set_bool("norm_topk_prob", &mut moe.norm_topk_prob)?;
        f.set_usize("first_k_dense_replace", &mut moe.first_dense_layers)?;
        let ds = moe.deepseek.get_or_insert(DeepseekRouting {
            n_group: 8,
            topk_group: 4,
            routed_scaling_factor: 2.5,
            n_shared_experts: 1,
        });
        f.set_usize("n_group", &mut ds.n_group)?;
        f.set_usize("topk_group", &mut ds.topk_group)?;
        f.set_f64("routed_scaling_factor", &mut ds.routed_scaling_factor)?;
        f.set_usize("n_shared_experts", &mut ds.n_shared_experts)?;
        // `moe_layer_freq` (DeepSeek's own code) is not read by transformers: every layer
        // past the dense ones is sparse.
    } else if variant == LlamaVariant::Mixtral {
        f.set_usize("num_local_experts", &mut moe.num_experts)?;
        if f.f64("router_jitter_noise")?.is_some_and(|x| x != 0.0) {
            return Err(ModelError::Unsupported {
                what: "router_jitter_noise".into(),
                found: format!("{}", f.f64("router_jitter_noise")?.unwrap_or(0.0)),
                supported: "0 (no jitter on the router's input)".into(),
            });
        }
    } else {
        // transformers 5 writes Qwen-MoE configs' `num_experts` under its alias
        // `num_local_experts`.
        if let Some(n) = f.usize("num_experts")?.or(f.usize("num_local_experts")?) {
            moe.num_experts = n;
        }
        f.set_usize("moe_intermediate_size", &mut moe.expert_intermediate_size)?;
        f.set_bool("norm_topk_prob", &mut moe.norm_topk_prob)?;
        f.set_usize("decoder_sparse_step", &mut moe.decoder_sparse_step)?;
        if variant == LlamaVariant::Qwen2Moe {
            if let Some(s) = f.usize("shared_expert_intermediate_size")? {
                moe.shared_expert_intermediate_size = Some(s);
            }
        }
        if let Some(v) = f.value("mlp_only_layers") {
            let Value::Array(items) = v else {
                return Err(f.wrong("mlp_only_layers", "a list of layer indices", v));
            };
            moe.mlp_only_layers =
                items.iter().map(|x| as_usize(x, "mlp_only_layers")).collect::<Result<_>>()?;
        }
    }
    f.set_usize("num_experts_per_tok", &mut moe.num_experts_per_tok)?;
    f.set_f64("router_aux_loss_coef", &mut moe.router_aux_loss_coef)?;
    f.set_bool("output_router_logits", &mut moe.output_router_logits)?;
    if variant == LlamaVariant::DeepseekV3 {
        // DeepseekV3ForCausalLM returns router logits but never adds an auxiliary loss.
        moe.output_router_logits = false;
    }
    moe.capacity_factor = f.f64("capacity_factor")?;
    Ok(())
}

/// `(rope_theta, scaling)` from `rope_parameters` (transformers 5) or `rope_theta` +
/// `rope_scaling` (4.x); `max_pos` is YaRN's default original context.
fn rope(f: &Fields, max_pos: usize) -> Result<(f64, RopeScaling)> {
    if let Some(map) = f.object("rope_parameters")? {
        let rp = Fields { map, model_type: f.model_type, prefix: "rope_parameters." };
        let theta = match rp.f64("rope_theta")? {
            Some(t) => t,
            None => f.f64("rope_theta")?.unwrap_or(10000.0),
        };
        return Ok((theta, rope_scaling(&rp, max_pos)?));
    }
    let theta = f.f64("rope_theta")?.unwrap_or(10000.0);
    let scaling = match f.object("rope_scaling")? {
        None => RopeScaling::Default,
        Some(map) => {
            let rs = Fields { map, model_type: f.model_type, prefix: "rope_scaling." };
            rope_scaling(&rs, max_pos)?
        }
    };
    Ok((theta, scaling))
}

fn rope_scaling(f: &Fields, max_pos: usize) -> Result<RopeScaling> {
    let kind = match f.str("rope_type")? {
        Some(k) => k,
        None => f.str("type")?.unwrap_or("default"),
    };
    Ok(match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: f.req_f64("factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: f.req_f64("factor")?,
            low_freq_factor: f.req_f64("low_freq_factor")?,
            high_freq_factor: f.req_f64("high_freq_factor")?,
            original_max_position_embeddings: f.req_usize(&["original_max_position_embeddings"])?,
        },
        // transformers 5 `_compute_yarn_parameters`: a null factor is max_pos / original.
        "yarn" => {
            let original = f.usize("original_max_position_embeddings")?.unwrap_or(max_pos);
            let factor = match f.f64("factor")? {
                Some(x) => x,
                None => max_pos as f64 / original.max(1) as f64,
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: f.f64("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
                beta_slow: f.f64("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
                mscale: f.f64("mscale")?,
                mscale_all_dim: f.f64("mscale_all_dim")?,
                attention_factor: f.f64("attention_factor")?,
                truncate: f.bool("truncate")?.unwrap_or(true),
            }
        }
        other => {
            return Err(ModelError::Unsupported {
                what: format!("{}rope_type", f.prefix),
                found: other.to_string(),
                supported: SUPPORTED_ROPE_TYPES.to_string(),
            })
        }
    })
}

/// `BloomConfig`: `n_embed` wins over `hidden_size` when both are given (as in its
/// `__init__`); `num_hidden_layers` and `num_attention_heads` are its `attribute_map` aliases.
/// `pretraining_tp` and `slow_but_exact` change only how HF slices its matmuls, not what
/// they compute, so they are not read.
fn bloom(f: &Fields, name: String) -> Result<ModelConfig> {
    let hidden_size = match f.usize("n_embed")? {
        Some(h) => h,
        None => f.req_usize(&["hidden_size"])?,
    };
    let mut p = BloomParams::new(
        name,
        f.req_usize(&["vocab_size"])?,
        hidden_size,
        f.req_usize(&["n_layer", "num_hidden_layers"])?,
        f.req_usize(&["n_head", "num_attention_heads"])?,
    );
    f.set_f64("layer_norm_epsilon", &mut p.layer_norm_epsilon)?;
    f.set_f64("hidden_dropout", &mut p.hidden_dropout)?;
    f.set_f64("attention_dropout", &mut p.attention_dropout)?;
    f.set_bool(
        "apply_residual_connection_post_layernorm",
        &mut p.apply_residual_connection_post_layernorm,
    )?;
    f.set_bool("tie_word_embeddings", &mut p.tie_word_embeddings)?;
    p.dtype = f.dtype()?;
    Ok(ModelConfig::Bloom(BloomConfig::new(p)?))
}

fn bert(f: &Fields, name: String) -> Result<ModelConfig> {
    let mut p = BertParams::new(
        name,
        f.req_usize(&["vocab_size"])?,
        f.req_usize(&["hidden_size"])?,
        f.req_usize(&["num_hidden_layers"])?,
        f.req_usize(&["num_attention_heads"])?,
        f.req_usize(&["intermediate_size"])?,
        f.req_usize(&["max_position_embeddings"])?,
    );
    f.set_usize("type_vocab_size", &mut p.type_vocab_size)?;
    f.set_activation("hidden_act", &mut p.hidden_act)?;
    f.set_f64("layer_norm_eps", &mut p.layer_norm_eps)?;
    f.set_f64("hidden_dropout_prob", &mut p.hidden_dropout_prob)?;
    f.set_f64("attention_probs_dropout_prob", &mut p.attention_probs_dropout_prob)?;
    f.set_bool("tie_word_embeddings", &mut p.tie_word_embeddings)?;
    if let Some(kind) = f.str("position_embedding_type")? {
        if kind != "absolute" {
            return Err(ModelError::Unsupported {
                what: "position_embedding_type".into(),
                found: kind.to_string(),
                supported: "absolute".into(),
            });
        }
    }
    p.dtype = f.dtype()?;
    Ok(ModelConfig::Bert(BertConfig::new(p)?))
}

fn vit(f: &Fields, name: String) -> Result<ModelConfig> {
    let mut p = VitParams::new(
        name,
        f.req_usize(&["hidden_size"])?,
        f.req_usize(&["num_hidden_layers"])?,
        f.req_usize(&["num_attention_heads"])?,
        f.req_usize(&["intermediate_size"])?,
    );
    f.set_activation("hidden_act", &mut p.hidden_act)?;
    f.set_f64("layer_norm_eps", &mut p.layer_norm_eps)?;
    f.set_f64("hidden_dropout_prob", &mut p.hidden_dropout_prob)?;
    f.set_f64("attention_probs_dropout_prob", &mut p.attention_probs_dropout_prob)?;
    f.set_usize("num_channels", &mut p.num_channels)?;
    f.set_bool("qkv_bias", &mut p.qkv_bias)?;
    if let Some(hw) = f.pair("image_size")? {
        p.image_size = hw;
    }
    if let Some(hw) = f.pair("patch_size")? {
        p.patch_size = hw;
    }
    // As PretrainedConfig: `id2label` decides the label count when present.
    p.num_labels = match f.object("id2label")? {
        Some(labels) => labels.len(),
        None => f.usize("num_labels")?.unwrap_or(2),
    };
    p.dtype = f.dtype()?;
    Ok(ModelConfig::Vit(VitConfig::new(p)?))
}

fn mlp(f: &Fields, name: String) -> Result<ModelConfig> {
    let input_dim = f.req_usize(&["input_dim"])?;
    let hidden = match f.value("hidden_dims") {
        None => return Err(f.missing("hidden_dims")),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(ModelError::invalid(
                "hidden_dims",
                format!(
                    "must be an array of layer widths such as [1024, 1024], got {}",
                    json_kind(other)
                ),
            ))
        }
    };
    let hidden_dims =
        hidden.iter().map(|v| as_usize(v, "hidden_dims")).collect::<Result<Vec<_>>>()?;
    let num_classes = f.req_usize(&["num_classes"])?;
    let p = MlpParams { name, input_dim, hidden_dims, num_classes, dtype: f.dtype()? };
    Ok(ModelConfig::Mlp(MlpConfig::new(p)?))
}

// ---- typed field access ----------------------------------------------------------------------

/// One JSON object's fields, with errors naming `prefix + key`.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    model_type: &'a str,
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    /// The value at `key`; absent and `null` both read as `None`.
    fn value(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn missing(&self, key: &str) -> ModelError {
        ModelError::MissingField {
            model_type: self.model_type.to_string(),
            field: format!("{}{key}", self.prefix),
        }
    }

    fn wrong(&self, key: &str, expected: &str, v: &Value) -> ModelError {
        ModelError::invalid(
            format!("{}{key}", self.prefix),
            format!("must be {expected}, got {}", json_kind(v)),
        )
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        self.value(key).map(|v| as_usize(v, &format!("{}{key}", self.prefix))).transpose()
    }

    /// The first of `keys` present (aliases); a missing-field error names the first.
    fn req_usize(&self, keys: &[&str]) -> Result<usize> {
        for key in keys {
            if let Some(v) = self.usize(key)? {
                return Ok(v);
            }
        }
        Err(self.missing(keys.first().copied().unwrap_or("?")))
    }

    fn set_usize(&self, key: &str, dst: &mut usize) -> Result<()> {
        if let Some(v) = self.usize(key)? {
            *dst = v;
        }
        Ok(())
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.wrong(key, "a number", v)),
        }
    }

    fn req_f64(&self, key: &str) -> Result<f64> {
        self.f64(key)?.ok_or_else(|| self.missing(key))
    }

    fn set_f64(&self, key: &str, dst: &mut f64) -> Result<()> {
        if let Some(v) = self.f64(key)? {
            *dst = v;
        }
        Ok(())
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.wrong(key, "true or false", v)),
        }
    }

    fn set_bool(&self, key: &str, dst: &mut bool) -> Result<()> {
        if let Some(v) = self.bool(key)? {
            *dst = v;
        }
        Ok(())
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.wrong(key, "a string", v)),
        }
    }

    fn object(&self, key: &str) -> Result<Option<&'a Map<String, Value>>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v.as_object().map(Some).ok_or_else(|| self.wrong(key, "an object", v)),
        }
    }

    /// An int `n` (meaning `[n, n]`) or a two-element array `[h, w]`.
    fn pair(&self, key: &str) -> Result<Option<[usize; 2]>> {
        let field = format!("{}{key}", self.prefix);
        match self.value(key) {
            None => Ok(None),
            Some(Value::Array(items)) => match items.as_slice() {
                [h, w] => Ok(Some([as_usize(h, &field)?, as_usize(w, &field)?])),
                _ => Err(ModelError::invalid(
                    field,
                    format!("must be an integer or [height, width], got {} elements", items.len()),
                )),
            },
            Some(v) => {
                let n = as_usize(v, &field)?;
                Ok(Some([n, n]))
            }
        }
    }

    fn set_activation(&self, key: &str, dst: &mut Activation) -> Result<()> {
        if let Some(name) = self.str(key)? {
            *dst = Activation::from_hf(name).ok_or_else(|| ModelError::Unsupported {
                what: format!("{}{key}", self.prefix),
                found: name.to_string(),
                supported: Activation::SUPPORTED.to_string(),
            })?;
        }
        Ok(())
    }

    /// The checkpoint's dtype: `dtype` (transformers 5) or `torch_dtype` (4.x). Names that
    /// are not a dtype (`"auto"`) read as unstated.
    fn dtype(&self) -> Result<Option<DType>> {
        let name = match self.str("dtype")? {
            Some(n) => Some(n),
            None => self.str("torch_dtype")?,
        };
        Ok(name.and_then(DType::parse))
    }
}

/// A non-negative integer (an integral float such as `4096.0` is accepted too).
fn as_usize(v: &Value, field: &str) -> Result<usize> {
    let n = match v {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64().filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x < 9.0e15).map(|x| x as u64)
        }),
        _ => None,
    };
    n.and_then(|n| usize::try_from(n).ok()).ok_or_else(|| {
        ModelError::invalid(field, format!("must be a non-negative integer, got {}", short(v)))
    })
}

fn json_kind(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(_) => format!("the boolean {v}"),
        Value::Number(_) => format!("the number {v}"),
        Value::String(_) => format!("the string {}", short(v)),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// A value's JSON text, cut to a readable length.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 {
        format!("{}…", s.chars().take(40).collect::<String>())
    } else {
        s
    }
}
