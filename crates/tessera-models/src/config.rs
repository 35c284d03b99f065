//! Model configurations: one plain `*Params` struct per family (public fields, transformers'
//! defaults, what a config.json says) and one validated `*Config` newtype around it.
//!
//! A `*Config` can only be made by [`Gpt2Config::new`] & co., which check every size once
//! (positive dims, divisibility, head counts, probabilities, epsilons, an overall size bound);
//! model builders then trust it. Fields stay readable through `Deref`; to change one, take
//! [`Gpt2Config::into_params`], edit, and validate again.

use crate::error::{ModelError, Result};
pub use crate::mla::MlaParams;
pub use crate::moe::{DeepseekRouting, MoeParams};
use crate::rope::{self, RopeScaling};
use serde::Serialize;
use tessera_ir::{DType, UnaryOp};

/// Upper bound on a model's parameter count (2^50 ≈ 1.1e15, ~500× today's largest models).
/// Keeps every size a `u64` product away from overflow downstream.
pub const MAX_PARAMETERS: u128 = 1 << 50;

/// Upper bound on the number of repeated blocks.
pub const MAX_LAYERS: usize = 1 << 16;

/// Upper bound on a RoPE model's head dim (released models use 64 to 256). Every rotary op
/// of the graph holds its `head_dim / 2` frequencies, so this keeps them to a few KiB per op.
pub const MAX_HEAD_DIM: usize = 1 << 12;

/// Activation functions, by their Hugging Face `ACT2FN` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// Exact GELU (`gelu`).
    Gelu,
    /// Tanh-approximated GELU (`gelu_new`, `gelu_pytorch_tanh`, `gelu_fast`).
    GeluTanh,
    Relu,
    /// `silu` / `swish`.
    Silu,
    Sigmoid,
    Tanh,
}

impl Activation {
    pub const SUPPORTED: &'static str =
        "gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, relu, silu, swish, sigmoid, tanh";

    /// Parses an HF activation name (`hidden_act`, `activation_function`).
    pub fn from_hf(name: &str) -> Option<Activation> {
        Some(match name {
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Activation::GeluTanh,
            "relu" => Activation::Relu,
            "silu" | "swish" => Activation::Silu,
            "sigmoid" => Activation::Sigmoid,
            "tanh" => Activation::Tanh,
            _ => return None,
        })
    }

    pub fn unary_op(self) -> UnaryOp {
        match self {
            Activation::Gelu => UnaryOp::Gelu,
            Activation::GeluTanh => UnaryOp::GeluTanh,
            Activation::Relu => UnaryOp::Relu,
            Activation::Silu => UnaryOp::Silu,
            Activation::Sigmoid => UnaryOp::Sigmoid,
            Activation::Tanh => UnaryOp::Tanh,
        }
    }
}

// ---- validation helpers ----------------------------------------------------------------------

pub(crate) fn positive(field: &str, v: usize) -> Result<()> {
    if v == 0 {
        return Err(ModelError::invalid(field, "must be at least 1, got 0"));
    }
    Ok(())
}

/// Layer counts: at least 1, at most [`MAX_LAYERS`] (block indices are `u32`, and graphs
/// beyond that would not be built in reasonable time).
fn layers(field: &str, v: usize) -> Result<()> {
    if !(1..=MAX_LAYERS).contains(&v) {
        return Err(ModelError::invalid(
            field,
            format!("{v} layers: must be between 1 and {MAX_LAYERS}"),
        ));
    }
    Ok(())
}

fn divisible(num_field: &str, num: usize, den_field: &str, den: usize) -> Result<()> {
    // checked_rem: a zero divisor is reported, not a panic.
    if num.checked_rem(den) != Some(0) {
        return Err(ModelError::invalid(
            num_field,
            format!(
                "{num_field} {num} is not divisible by {den_field} {den}; choose sizes where \
                 {den_field} divides {num_field}"
            ),
        ));
    }
    Ok(())
}

fn probability(field: &str, p: f64) -> Result<()> {
    if !(0.0..1.0).contains(&p) {
        return Err(ModelError::invalid(
            field,
            format!("dropout probability {p} must be in [0, 1) (0 disables dropout)"),
        ));
    }
    Ok(())
}

fn epsilon(field: &str, eps: f64) -> Result<()> {
    if !(eps.is_finite() && eps > 0.0) {
        return Err(ModelError::invalid(
            field,
            format!("{eps} must be a small positive number such as 1e-5"),
        ));
    }
    Ok(())
}

/// Sum of products, checked; `None` on overflow.
pub(crate) fn count(terms: &[&[usize]]) -> Option<u128> {
    terms.iter().try_fold(0u128, |acc, t| {
        let prod = t.iter().try_fold(1u128, |p, &d| p.checked_mul(d as u128))?;
        acc.checked_add(prod)
    })
}

pub(crate) fn within_bound(n: Option<u128>) -> Result<u64> {
    match n {
        Some(n) if n <= MAX_PARAMETERS => Ok(n as u64),
        _ => Err(ModelError::invalid(
            "config",
            "the model would have more than 2^50 parameters; check the sizes for a typo",
        )),
    }
}

macro_rules! validated_config {
    ($(#[$doc:meta])* $cfg:ident, $params:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Serialize)]
        #[serde(transparent)]
        pub struct $cfg($params);

        impl $cfg {
            /// Validates `params`: the only way to obtain this type.
            pub fn new(params: $params) -> Result<$cfg> {
                params.validate()?;
                Ok($cfg(params))
            }
            pub fn params(&self) -> &$params {
                &self.0
            }
            pub fn into_params(self) -> $params {
                self.0
            }
        }

        impl std::ops::Deref for $cfg {
            type Target = $params;
            fn deref(&self) -> &$params {
                &self.0
            }
        }
    };
}

// ---- GPT-2 -----------------------------------------------------------------------------------

/// `GPT2Config` fields (HF names). Dropout on attention probabilities (`attn_pdrop`) is kept
/// for fidelity but not applied: attention is one fused op.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Gpt2Params {
    pub name: String,
    pub vocab_size: usize,
    /// Rows of the learned position table: the longest sequence.
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// MLP width (HF `n_inner`, None there meaning 4·n_embd).
    pub n_inner: usize,
    pub activation_function: Activation,
    pub layer_norm_epsilon: f64,
    pub embd_pdrop: f64,
    pub resid_pdrop: f64,
    pub attn_pdrop: f64,
    pub scale_attn_weights: bool,
    pub scale_attn_by_inverse_layer_idx: bool,
    pub tie_word_embeddings: bool,
    /// The dtype the checkpoint was saved in (`torch_dtype`/`dtype`), if stated.
    pub dtype: Option<DType>,
}

impl Gpt2Params {
    /// The given architecture dims with transformers' defaults for everything else.
    pub fn new(
        name: impl Into<String>,
        vocab_size: usize,
        n_positions: usize,
        n_embd: usize,
        n_layer: usize,
        n_head: usize,
    ) -> Gpt2Params {
        Gpt2Params {
            name: name.into(),
            vocab_size,
            n_positions,
            n_embd,
            n_layer,
            n_head,
            n_inner: n_embd.saturating_mul(4),
            activation_function: Activation::GeluTanh,
            layer_norm_epsilon: 1e-5,
            embd_pdrop: 0.1,
            resid_pdrop: 0.1,
            attn_pdrop: 0.1,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            tie_word_embeddings: true,
            dtype: None,
        }
    }

    fn validate(&self) -> Result<()> {
        positive("vocab_size", self.vocab_size)?;
        positive("n_positions", self.n_positions)?;
        positive("n_embd", self.n_embd)?;
        layers("n_layer", self.n_layer)?;
        positive("n_head", self.n_head)?;
        positive("n_inner", self.n_inner)?;
        divisible("n_embd", self.n_embd, "n_head", self.n_head)?;
        epsilon("layer_norm_epsilon", self.layer_norm_epsilon)?;
        probability("embd_pdrop", self.embd_pdrop)?;
        probability("resid_pdrop", self.resid_pdrop)?;
        probability("attn_pdrop", self.attn_pdrop)?;
        within_bound(self.count())?;
        Ok(())
    }

    fn count(&self) -> Option<u128> {
        let (v, p, d, i) = (self.vocab_size, self.n_positions, self.n_embd, self.n_inner);
        let layer = count(&[&[4, d], &[3, d, d], &[3, d], &[d, d], &[d], &[2, d, i], &[i], &[d]])?;
        let lm_head = if self.tie_word_embeddings { 0 } else { v };
        let base = count(&[&[v, d], &[p, d], &[2, d], &[lm_head, d]])?;
        layer.checked_mul(self.n_layer as u128)?.checked_add(base)
    }
}

validated_config!(
    /// A validated GPT-2 configuration.
    Gpt2Config,
    Gpt2Params
);

impl Gpt2Config {
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }
    /// Trainable parameters, tied tensors once (matches `graph.num_parameters()`).
    pub fn num_parameters(&self) -> u64 {
        self.count().map_or(u64::MAX, |n| n as u64)
    }
}

// ---- LLaMA family ----------------------------------------------------------------------------

/// Which Hugging Face model type of the LLaMA family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LlamaVariant {
    Llama,
    Mistral,
    Qwen2,
    /// `MixtralForCausalLM`: Mistral's attention, a sparse MoE block in every layer.
    Mixtral,
    /// `Qwen2MoeForCausalLM`: Qwen2's attention (q/k/v biases), sparse MoE blocks with a
    /// shared expert behind a sigmoid gate.
    Qwen2Moe,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention (q/k RMSNorm per head), sparse MoE blocks.
    Qwen3Moe,
    /// `DeepseekV3ForCausalLM`: multi-head latent attention (`mla.rs`), dense MLPs in the
    /// first `first_k_dense_replace` layers, then sigmoid-routed experts with shared experts.
    DeepseekV3,
}

impl LlamaVariant {
    pub fn model_type(self) -> &'static str {
        match self {
            LlamaVariant::Llama => "llama",
            LlamaVariant::Mistral => "mistral",
            LlamaVariant::Qwen2 => "qwen2",
            LlamaVariant::Mixtral => "mixtral",
            LlamaVariant::Qwen2Moe => "qwen2_moe",
            LlamaVariant::Qwen3Moe => "qwen3_moe",
            LlamaVariant::DeepseekV3 => "deepseek_v3",
        }
    }
}

/// `LlamaConfig` / `MistralConfig` / `Qwen2Config` fields, normalised: biases are explicit per
/// projection group and the sliding window is resolved per layer range.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LlamaParams {
    pub variant: LlamaVariant,
    pub name: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Explicit head dim (HF `head_dim`); None means hidden_size / num_attention_heads.
    pub head_dim: Option<usize>,
    /// Informational for RoPE models: positions are not a learned table, so not a limit.
    pub max_position_embeddings: usize,
    pub hidden_act: Activation,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// Bias on q_proj, k_proj, v_proj (llama `attention_bias`; always for qwen2).
    pub qkv_bias: bool,
    /// Bias on o_proj (llama `attention_bias`).
    pub o_bias: bool,
    /// Bias on gate/up/down_proj (llama `mlp_bias`).
    pub mlp_bias: bool,
    pub tie_word_embeddings: bool,
    /// Sliding attention window in tokens (Mistral; Qwen2 with `use_sliding_window`).
    pub sliding_window: Option<usize>,
    /// Layers with index >= this use the window (Qwen2 `max_window_layers`; else 0).
    pub sliding_window_from_layer: usize,
    /// RMSNorm of each query and key head before RoPE (`self_attn.q_norm` / `k_norm`: Qwen3).
    pub qk_norm: bool,
    /// The sparse MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3); `None` for a dense
    /// model.
    pub moe: Option<MoeParams>,
    /// Multi-head latent attention (DeepSeek-V3) in place of q/k/v projections; `head_dim`
    /// is then its query/key head dim and RoPE covers only `qk_rope_head_dim` of it.
    pub mla: Option<MlaParams>,
    pub dtype: Option<DType>,
}

impl LlamaParams {
    /// The given architecture dims with the variant's transformers defaults for the rest.
    pub fn new(
        variant: LlamaVariant,
        name: impl Into<String>,
        vocab_size: usize,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
    ) -> LlamaParams {
        let (max_position_embeddings, sliding_window, qkv_bias, from_layer) = match variant {
            LlamaVariant::Llama => (2048, None, false, 0),
            LlamaVariant::Mistral => (4096 * 32, Some(4096), false, 0),
            // Qwen2's window applies only with `use_sliding_window`, which defaults to false.
            LlamaVariant::Qwen2 => (32768, None, true, 28),
            LlamaVariant::Mixtral => (4096 * 32, None, false, 0),
            // Qwen2MoeAttention: q/k/v with bias, o_proj without.
            LlamaVariant::Qwen2Moe => (32768, None, true, 28),
            LlamaVariant::Qwen3Moe => (32768, None, false, 28),
            LlamaVariant::DeepseekV3 => (4096, None, false, 0),
        };
        let moe = match variant {
            LlamaVariant::Llama | LlamaVariant::Mistral | LlamaVariant::Qwen2 => None,
            LlamaVariant::Mixtral => Some(MoeParams::mixtral(intermediate_size)),
            LlamaVariant::Qwen2Moe => Some(MoeParams::qwen2_moe()),
            LlamaVariant::Qwen3Moe => Some(MoeParams::qwen3_moe()),
            LlamaVariant::DeepseekV3 => Some(MoeParams::deepseek_v3()),
        };
        let mla = (variant == LlamaVariant::DeepseekV3).then(MlaParams::deepseek_v3);
        // MixtralConfig's defaults differ from LlamaConfig's here.
        let (rms_norm_eps, rope_theta) =
            if variant == LlamaVariant::Mixtral { (1e-5, 1e6) } else { (1e-6, 10000.0) };
        LlamaParams {
            variant,
            name: name.into(),
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: num_attention_heads,
            head_dim: mla.as_ref().map(MlaParams::qk_head_dim),
            max_position_embeddings,
            hidden_act: Activation::Silu,
            rms_norm_eps,
            rope_theta,
            rope_scaling: RopeScaling::Default,
            qkv_bias,
            o_bias: false,
            mlp_bias: false,
            tie_word_embeddings: false,
            sliding_window,
            sliding_window_from_layer: from_layer,
            qk_norm: variant == LlamaVariant::Qwen3Moe,
            moe,
            mla,
            dtype: None,
        }
    }

    fn validate(&self) -> Result<()> {
        positive("vocab_size", self.vocab_size)?;
        positive("hidden_size", self.hidden_size)?;
        positive("intermediate_size", self.intermediate_size)?;
        layers("num_hidden_layers", self.num_hidden_layers)?;
        positive("num_attention_heads", self.num_attention_heads)?;
        positive("num_key_value_heads", self.num_key_value_heads)?;
        positive("max_position_embeddings", self.max_position_embeddings)?;
        let head_dim = match self.head_dim {
            Some(h) => {
                positive("head_dim", h)?;
                h
            }
            None => {
                divisible(
                    "hidden_size",
                    self.hidden_size,
                    "num_attention_heads",
                    self.num_attention_heads,
                )?;
                self.hidden_size / self.num_attention_heads
            }
        };
        divisible(
            "num_attention_heads",
            self.num_attention_heads,
            "num_key_value_heads",
            self.num_key_value_heads,
        )?;
        // MLA rotates only its qk_rope_head_dim (checked by MlaParams).
        if head_dim % 2 != 0 && self.mla.is_none() {
            return Err(ModelError::invalid(
                "head_dim",
                format!("RoPE rotates pairs of dims, so head_dim {head_dim} must be even"),
            ));
        }
        if head_dim > MAX_HEAD_DIM {
            let source = match self.head_dim {
                Some(_) => String::new(),
                None => format!(
                    " (hidden_size {} / num_attention_heads {})",
                    self.hidden_size, self.num_attention_heads
                ),
            };
            return Err(ModelError::invalid(
                "head_dim",
                format!(
                    "head_dim {head_dim}{source} exceeds {MAX_HEAD_DIM}; released models use 64 \
                     to 256: check head_dim, hidden_size and num_attention_heads for a typo"
                ),
            ));
        }
        epsilon("rms_norm_eps", self.rms_norm_eps)?;
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(ModelError::invalid(
                "rope_theta",
                format!("{} must be a number above 1 (LLaMA uses 10000)", self.rope_theta),
            ));
        }
        self.rope_scaling.validate()?;
        if let Some(mla) = &self.mla {
            mla.validate(self.num_attention_heads, self.num_key_value_heads)?;
            if self.head_dim != Some(mla.qk_head_dim()) {
                return Err(ModelError::invalid(
                    "head_dim",
                    format!(
                        "{:?}: with multi-head latent attention it is qk_nope_head_dim + \
                         qk_rope_head_dim = {}",
                        self.head_dim,
                        mla.qk_head_dim()
                    ),
                ));
            }
        } else if matches!(self.rope_scaling, RopeScaling::Yarn { .. }) {
            return Err(ModelError::Unsupported {
                what: "rope_scaling.rope_type".into(),
                found: format!("yarn on {}", self.variant.model_type()),
                supported: "yarn on deepseek_v3 only (the LLaMA layers do not apply YaRN's \
                            attention factor); default, linear or llama3 elsewhere"
                    .into(),
            });
        }
        if self.sliding_window == Some(0) {
            return Err(ModelError::invalid(
                "sliding_window",
                "must be at least 1 token, or null for full attention",
            ));
        }
        if let Some(moe) = &self.moe {
            moe.validate(self.num_hidden_layers)?;
        }
        within_bound(self.count(head_dim))?;
        Ok(())
    }

    /// Whether layer `layer` has the sparse MoE block (else the dense SwiGLU MLP).
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(layer))
    }

    fn count(&self, head_dim: usize) -> Option<u128> {
        let (v, d, i) = (self.vocab_size, self.hidden_size, self.intermediate_size);
        let (h, kv, hd) = (self.num_attention_heads, self.num_key_value_heads, head_dim);
        let b = |on: bool| usize::from(on);
        let layer = match &self.mla {
            Some(mla) => {
                count(&[&[2, d]])?.checked_add(mla.count(d, h, self.qkv_bias, self.o_bias)?)?
            }
            None => count(&[
                &[2, d],
                &[2, d, h, hd],
                &[2, d, kv, hd],
                &[b(self.qkv_bias), h, hd],
                &[b(self.qkv_bias), 2, kv, hd],
                &[b(self.o_bias), d],
                &[b(self.qk_norm), 2, hd],
            ])?,
        };
        let dense = count(&[&[3, d, i], &[b(self.mlp_bias), 2, i], &[b(self.mlp_bias), d]])?;
        let layers = (0..self.num_hidden_layers).try_fold(0u128, |acc, l| {
            let mlp = match &self.moe {
                Some(moe) if moe.is_sparse(l) => moe.count(d)?,
                _ => dense,
            };
            acc.checked_add(layer.checked_add(mlp)?)
        })?;
        let lm_head = if self.tie_word_embeddings { 0 } else { v };
        let base = count(&[&[v, d], &[d], &[lm_head, d]])?;
        layers.checked_add(base)
    }
}

validated_config!(
    /// A validated LLaMA-family (llama, mistral, qwen2, mixtral, qwen2_moe, qwen3_moe,
    /// deepseek_v3) configuration.
    LlamaConfig,
    LlamaParams
);

impl LlamaConfig {
    pub fn head_dim(&self) -> usize {
        self.0.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }
    /// The RoPE inverse frequencies after scaling (`head_dim / 2` of them; under multi-head
    /// latent attention `qk_rope_head_dim / 2`).
    pub fn inv_freq(&self) -> Vec<f64> {
        let dim = self.mla.as_ref().map_or(self.head_dim(), |m| m.qk_rope_head_dim);
        rope::inv_freq(dim, self.rope_theta, &self.rope_scaling)
    }
    /// The attention window of layer `layer`, if it uses one.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|_| layer >= self.sliding_window_from_layer)
    }
    pub fn num_parameters(&self) -> u64 {
        self.count(self.head_dim()).map_or(u64::MAX, |n| n as u64)
    }
}

// ---- BLOOM -----------------------------------------------------------------------------------

/// `BloomConfig` fields (HF names). The MLP is 4·hidden wide (BLOOM has no `n_inner`); there
/// is no position table (ALiBi). `attention_dropout` is kept for fidelity but not applied:
/// attention is one fused op.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BloomParams {
    pub name: String,
    pub vocab_size: usize,
    /// HF `hidden_size` (alias `n_embed`).
    pub hidden_size: usize,
    /// HF `n_layer` (alias `num_hidden_layers`).
    pub n_layer: usize,
    /// HF `n_head` (alias `num_attention_heads`).
    pub n_head: usize,
    pub layer_norm_epsilon: f64,
    /// Dropout on the attention and MLP outputs before each residual add.
    pub hidden_dropout: f64,
    pub attention_dropout: f64,
    /// Whether the residuals are the LayerNorms' outputs (true) or inputs (false, every
    /// released BLOOM). Only false is supported; [`BloomConfig::new`] refuses true.
    pub apply_residual_connection_post_layernorm: bool,
    pub tie_word_embeddings: bool,
    pub dtype: Option<DType>,
}

impl BloomParams {
    /// The given architecture dims with transformers' defaults for everything else.
    pub fn new(
        name: impl Into<String>,
        vocab_size: usize,
        hidden_size: usize,
        n_layer: usize,
        n_head: usize,
    ) -> BloomParams {
        BloomParams {
            name: name.into(),
            vocab_size,
            hidden_size,
            n_layer,
            n_head,
            layer_norm_epsilon: 1e-5,
            hidden_dropout: 0.0,
            attention_dropout: 0.0,
            apply_residual_connection_post_layernorm: false,
            tie_word_embeddings: true,
            dtype: None,
        }
    }

    fn validate(&self) -> Result<()> {
        positive("vocab_size", self.vocab_size)?;
        positive("hidden_size", self.hidden_size)?;
        layers("n_layer", self.n_layer)?;
        positive("n_head", self.n_head)?;
        divisible("hidden_size", self.hidden_size, "n_head", self.n_head)?;
        epsilon("layer_norm_epsilon", self.layer_norm_epsilon)?;
        probability("hidden_dropout", self.hidden_dropout)?;
        probability("attention_dropout", self.attention_dropout)?;
        if self.apply_residual_connection_post_layernorm {
            return Err(ModelError::invalid(
                "apply_residual_connection_post_layernorm",
                "true (residuals taken after the LayerNorms) is not supported; every released \
                 BLOOM uses false",
            ));
        }
        within_bound(self.count())?;
        Ok(())
    }

    /// V·H (+ V·H untied) + 2H (embedding LayerNorm) + L·(12H² + 13H) + 2H (`ln_f`): per
    /// layer `query_key_value` 3H² + 3H, `dense` H² + H, `dense_h_to_4h` 4H² + 4H,
    /// `dense_4h_to_h` 4H² + H, two LayerNorms 4H.
    fn count(&self) -> Option<u128> {
        let (v, d) = (self.vocab_size, self.hidden_size);
        let layer = count(&[&[12, d, d], &[13, d]])?;
        let lm_head = if self.tie_word_embeddings { 0 } else { v };
        let base = count(&[&[v, d], &[4, d], &[lm_head, d]])?;
        layer.checked_mul(self.n_layer as u128)?.checked_add(base)
    }
}

validated_config!(
    /// A validated BLOOM configuration.
    BloomConfig,
    BloomParams
);

impl BloomConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.n_head
    }
    /// The MLP width, 4·hidden.
    pub fn mlp_width(&self) -> usize {
        4 * self.hidden_size
    }
    /// Trainable parameters, tied tensors once (matches `graph.num_parameters()`).
    pub fn num_parameters(&self) -> u64 {
        self.count().map_or(u64::MAX, |n| n as u64)
    }
}

// ---- BERT ------------------------------------------------------------------------------------

/// `BertConfig` fields (absolute position embeddings only).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BertParams {
    pub name: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub hidden_act: Activation,
    pub layer_norm_eps: f64,
    pub hidden_dropout_prob: f64,
    /// Not applied: attention is one fused op.
    pub attention_probs_dropout_prob: f64,
    pub tie_word_embeddings: bool,
    pub dtype: Option<DType>,
}

impl BertParams {
    pub fn new(
        name: impl Into<String>,
        vocab_size: usize,
        hidden_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        intermediate_size: usize,
        max_position_embeddings: usize,
    ) -> BertParams {
        BertParams {
            name: name.into(),
            vocab_size,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            intermediate_size,
            max_position_embeddings,
            type_vocab_size: 2,
            hidden_act: Activation::Gelu,
            layer_norm_eps: 1e-12,
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            tie_word_embeddings: true,
            dtype: None,
        }
    }

    fn validate(&self) -> Result<()> {
        positive("vocab_size", self.vocab_size)?;
        positive("hidden_size", self.hidden_size)?;
        layers("num_hidden_layers", self.num_hidden_layers)?;
        positive("num_attention_heads", self.num_attention_heads)?;
        positive("intermediate_size", self.intermediate_size)?;
        positive("max_position_embeddings", self.max_position_embeddings)?;
        positive("type_vocab_size", self.type_vocab_size)?;
        divisible(
            "hidden_size",
            self.hidden_size,
            "num_attention_heads",
            self.num_attention_heads,
        )?;
        epsilon("layer_norm_eps", self.layer_norm_eps)?;
        probability("hidden_dropout_prob", self.hidden_dropout_prob)?;
        probability("attention_probs_dropout_prob", self.attention_probs_dropout_prob)?;
        within_bound(self.count())?;
        Ok(())
    }

    fn count(&self) -> Option<u128> {
        let (v, d, i) = (self.vocab_size, self.hidden_size, self.intermediate_size);
        let layer = count(&[&[4, d, d], &[4, d], &[4, d], &[2, d, i], &[i], &[d]])?;
        let decoder = if self.tie_word_embeddings { 0 } else { v };
        let base = count(&[
            &[v, d],
            &[self.max_position_embeddings, d],
            &[self.type_vocab_size, d],
            &[2, d],
            &[d, d],
            &[3, d],
            &[v],
            &[decoder, d],
        ])?;
        layer.checked_mul(self.num_hidden_layers as u128)?.checked_add(base)
    }
}

validated_config!(
    /// A validated BERT (masked-LM) configuration.
    BertConfig,
    BertParams
);

impl BertConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
    pub fn num_parameters(&self) -> u64 {
        self.count().map_or(u64::MAX, |n| n as u64)
    }
}

// ---- ViT -------------------------------------------------------------------------------------

/// `ViTConfig` fields plus the classifier's label count.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct VitParams {
    pub name: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub hidden_act: Activation,
    pub layer_norm_eps: f64,
    pub hidden_dropout_prob: f64,
    /// Not applied: attention is one fused op.
    pub attention_probs_dropout_prob: f64,
    /// (height, width) in pixels.
    pub image_size: [usize; 2],
    /// (height, width) of one patch.
    pub patch_size: [usize; 2],
    pub num_channels: usize,
    pub qkv_bias: bool,
    pub num_labels: usize,
    pub dtype: Option<DType>,
}

impl VitParams {
    pub fn new(
        name: impl Into<String>,
        hidden_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        intermediate_size: usize,
    ) -> VitParams {
        VitParams {
            name: name.into(),
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            intermediate_size,
            hidden_act: Activation::Gelu,
            layer_norm_eps: 1e-12,
            hidden_dropout_prob: 0.0,
            attention_probs_dropout_prob: 0.0,
            image_size: [224, 224],
            patch_size: [16, 16],
            num_channels: 3,
            qkv_bias: true,
            num_labels: 2,
            dtype: None,
        }
    }

    fn validate(&self) -> Result<()> {
        positive("hidden_size", self.hidden_size)?;
        layers("num_hidden_layers", self.num_hidden_layers)?;
        positive("num_attention_heads", self.num_attention_heads)?;
        positive("intermediate_size", self.intermediate_size)?;
        positive("num_channels", self.num_channels)?;
        for k in 0..2 {
            positive("image_size", self.image_size[k])?;
            positive("patch_size", self.patch_size[k])?;
            divisible("image_size", self.image_size[k], "patch_size", self.patch_size[k])?;
        }
        divisible(
            "hidden_size",
            self.hidden_size,
            "num_attention_heads",
            self.num_attention_heads,
        )?;
        if self.num_labels < 2 {
            return Err(ModelError::invalid(
                "num_labels",
                format!(
                    "{} labels: classification needs at least 2 (1 means regression, which \
                     is not supported)",
                    self.num_labels
                ),
            ));
        }
        epsilon("layer_norm_eps", self.layer_norm_eps)?;
        probability("hidden_dropout_prob", self.hidden_dropout_prob)?;
        probability("attention_probs_dropout_prob", self.attention_probs_dropout_prob)?;
        within_bound(self.count())?;
        Ok(())
    }

    fn count(&self) -> Option<u128> {
        let (d, i, l) = (self.hidden_size, self.intermediate_size, self.num_labels);
        let [h, w] = self.image_size;
        let [ph, pw] = self.patch_size;
        let qkv_bias = usize::from(self.qkv_bias);
        let patches = (h / ph).checked_mul(w / pw)?;
        let layer = count(&[&[4, d], &[4, d, d], &[3, qkv_bias, d], &[d], &[2, d, i], &[i], &[d]])?;
        let base = count(&[
            &[d],
            &[patches.checked_add(1)?, d],
            &[d, self.num_channels, ph, pw],
            &[d],
            &[2, d],
            &[l, d],
            &[l],
        ])?;
        layer.checked_mul(self.num_hidden_layers as u128)?.checked_add(base)
    }
}

validated_config!(
    /// A validated ViT (image classification) configuration.
    VitConfig,
    VitParams
);

impl VitConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
    /// Patches per image, N = (H/p)·(W/p).
    pub fn num_patches(&self) -> usize {
        (self.image_size[0] / self.patch_size[0]) * (self.image_size[1] / self.patch_size[1])
    }
    /// The encoder's sequence length: N patches plus the `[CLS]` token.
    pub fn seq_len(&self) -> usize {
        self.num_patches() + 1
    }
    pub fn num_parameters(&self) -> u64 {
        self.count().map_or(u64::MAX, |n| n as u64)
    }
}

// ---- MLP -------------------------------------------------------------------------------------

/// Our own `model_type: "mlp"`: a ReLU classifier `input_dim → hidden_dims… → num_classes`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MlpParams {
    pub name: String,
    pub input_dim: usize,
    pub hidden_dims: Vec<usize>,
    pub num_classes: usize,
    pub dtype: Option<DType>,
}

impl MlpParams {
    fn validate(&self) -> Result<()> {
        positive("input_dim", self.input_dim)?;
        if self.hidden_dims.len() > MAX_LAYERS {
            return Err(ModelError::invalid(
                "hidden_dims",
                format!("{} layers: at most {MAX_LAYERS}", self.hidden_dims.len()),
            ));
        }
        for &h in &self.hidden_dims {
            positive("hidden_dims", h)?;
        }
        if self.num_classes < 2 {
            return Err(ModelError::invalid(
                "num_classes",
                format!("{}: a classifier needs at least 2 classes", self.num_classes),
            ));
        }
        within_bound(self.count())?;
        Ok(())
    }

    /// (in, out) of each linear layer, hidden ones first.
    pub fn layer_dims(&self) -> Vec<(usize, usize)> {
        let mut dims = Vec::with_capacity(self.hidden_dims.len() + 1);
        let mut prev = self.input_dim;
        for &h in self.hidden_dims.iter().chain(std::iter::once(&self.num_classes)) {
            dims.push((prev, h));
            prev = h;
        }
        dims
    }

    fn count(&self) -> Option<u128> {
        self.layer_dims()
            .iter()
            .try_fold(0u128, |acc, &(i, o)| acc.checked_add(count(&[&[i, o], &[o]])?))
    }
}

validated_config!(
    /// A validated MLP configuration.
    MlpConfig,
    MlpParams
);

impl MlpConfig {
    pub fn num_parameters(&self) -> u64 {
        self.count().map_or(u64::MAX, |n| n as u64)
    }
}
