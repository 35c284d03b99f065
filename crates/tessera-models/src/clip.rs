//! CLIP's text encoder (`CLIPTextModel`): the text states Stable Diffusion conditions on.
//!
//! Paper: Radford et al. 2021, "Learning Transferable Visual Models From Natural Language
//! Supervision". Reference implementation: Hugging Face `transformers`,
//! `models/clip/modeling_clip.py` (`CLIPTextTransformer`).
//!
//! ```text
//! x_btd = token_embedding[input_ids] + position_embedding[0..T]
//! for each layer (pre-LN, causal self-attention):
//!     x += out_proj(attn(q/k/v_proj(layer_norm1 x)))
//!     x += fc2(act(fc1(layer_norm2 x)))            # act: quick_gelu (SD 1.x) or gelu (SD 2)
//! last_hidden_state_btd = final_layer_norm(x)
//! ```
//! The model output ([`ForwardModel::logits`]) is `last_hidden_state` `[B, T, D]`; the loss
//! is the f32 mean squared error against an input `target` of that shape (the diffusion
//! convention), so the graph differentiates and profiles like any other, though Stable
//! Diffusion keeps the encoder frozen. Padding masks are not modelled (SD's pipelines pass
//! none); the pooled output (the EOS token's state) and `text_projection` are not built.
//! Weight names are transformers' (`text_model.encoder.layers.0.self_attn.q_proj.weight`).
//!
//! A config is `model_type: clip_text_model` (a `CLIPTextConfig`, as SD checkpoints ship
//! `text_encoder/config.json`), or `clip` with a `text_config` object (a whole `CLIPModel`,
//! whose text tower has the same weight names).
//!
//! Shape suffixes: `b` batch, `t` tokens, `d` hidden, `i` MLP width, `v` vocabulary.

use crate::bert::self_attention_named;
use crate::config::{count, positive};
use crate::error::{ModelError, Result};
use crate::nn::{self, Inputs};
use crate::{BuildOptions, ForwardModel, InputKind};
use serde::Serialize;
use tessera_ir::{Builder, DType, IrError, ReduceOp, TensorId, UnaryOp};

/// The text encoder's MLP activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClipActivation {
    /// `x · sigmoid(1.702 x)` (OpenAI CLIP, SD 1.x).
    QuickGelu,
    /// Exact GELU (OpenCLIP ViT-H, SD 2).
    Gelu,
    /// Tanh-approximated GELU (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
}

impl ClipActivation {
    pub const SUPPORTED: &'static str = "quick_gelu, gelu, gelu_new, gelu_pytorch_tanh";

    pub fn from_hf(name: &str) -> Option<ClipActivation> {
        match name {
            "quick_gelu" => Some(ClipActivation::QuickGelu),
            "gelu" => Some(ClipActivation::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" => Some(ClipActivation::GeluTanh),
            _ => None,
        }
    }

    fn apply(self, b: &mut Builder, x: TensorId) -> std::result::Result<TensorId, IrError> {
        match self {
            ClipActivation::QuickGelu => {
                let s = b.scale(x, 1.702)?;
                let s = b.unary(UnaryOp::Sigmoid, s)?;
                b.mul(x, s)
            }
            ClipActivation::Gelu => b.unary(UnaryOp::Gelu, x),
            ClipActivation::GeluTanh => b.unary(UnaryOp::GeluTanh, x),
        }
    }
}

/// `CLIPTextConfig` fields (HF names and defaults).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClipTextParams {
    pub name: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    pub hidden_act: ClipActivation,
    pub layer_norm_eps: f64,
    pub dtype: Option<DType>,
}

impl ClipTextParams {
    /// `CLIPTextConfig()`'s defaults (the text tower of openai/clip-vit-base-patch32).
    pub fn new(name: impl Into<String>) -> ClipTextParams {
        ClipTextParams {
            name: name.into(),
            vocab_size: 49408,
            hidden_size: 512,
            intermediate_size: 2048,
            num_hidden_layers: 12,
            num_attention_heads: 8,
            max_position_embeddings: 77,
            hidden_act: ClipActivation::QuickGelu,
            layer_norm_eps: 1e-5,
            dtype: None,
        }
    }

    fn validate(&self) -> Result<()> {
        positive("vocab_size", self.vocab_size)?;
        positive("hidden_size", self.hidden_size)?;
        positive("intermediate_size", self.intermediate_size)?;
        positive("num_attention_heads", self.num_attention_heads)?;
        positive("max_position_embeddings", self.max_position_embeddings)?;
        if !(1..=crate::MAX_LAYERS).contains(&self.num_hidden_layers) {
            return Err(ModelError::invalid(
                "num_hidden_layers",
                format!(
                    "{} layers: must be between 1 and {}",
                    self.num_hidden_layers,
                    crate::MAX_LAYERS
                ),
            ));
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(ModelError::invalid(
                "hidden_size",
                format!(
                    "hidden_size {} is not divisible by num_attention_heads {}",
                    self.hidden_size, self.num_attention_heads
                ),
            ));
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return Err(ModelError::invalid(
                "layer_norm_eps",
                "must be a small positive number such as 1e-5",
            ));
        }
        match self.count() {
            Some(n) if n <= crate::MAX_PARAMETERS => Ok(()),
            _ => {
                Err(ModelError::invalid("config", "the model would have more than 2^50 parameters"))
            }
        }
    }

    fn count(&self) -> Option<u128> {
        let (v, d, i, p) = (
            self.vocab_size,
            self.hidden_size,
            self.intermediate_size,
            self.max_position_embeddings,
        );
        // q, k, v, out projections with biases; two layer norms; fc1, fc2 with biases.
        let layer = count(&[&[4, d, d], &[4, d], &[4, d], &[2, d, i], &[i], &[d]])?;
        let base = count(&[&[v, d], &[p, d], &[2, d]])?;
        layer.checked_mul(self.num_hidden_layers as u128)?.checked_add(base)
    }
}

/// A validated CLIP text-encoder configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(transparent)]
pub struct ClipTextConfig(ClipTextParams);

impl ClipTextConfig {
    pub fn new(params: ClipTextParams) -> Result<ClipTextConfig> {
        params.validate()?;
        Ok(ClipTextConfig(params))
    }
    pub fn params(&self) -> &ClipTextParams {
        &self.0
    }
    pub fn head_dim(&self) -> usize {
        self.0.hidden_size / self.0.num_attention_heads
    }
    /// `CLIPTextModel`'s parameters (no projection).
    pub fn num_parameters(&self) -> u64 {
        self.0.count().map_or(u64::MAX, |n| n as u64)
    }
}

impl std::ops::Deref for ClipTextConfig {
    type Target = ClipTextParams;
    fn deref(&self) -> &ClipTextParams {
        &self.0
    }
}

/// The forward graph: `input_ids [B, T]` → `last_hidden_state [B, T, D]`, loss = MSE against
/// `target [B, T, D]`.
pub(crate) fn build(cfg: &ClipTextConfig, opts: &BuildOptions) -> Result<ForwardModel> {
    let (batch, t, dtype) = (opts.batch, opts.seq, opts.dtype);
    let d = cfg.hidden_size;
    let mut b = Builder::new();
    let mut inputs = Inputs::new();
    let kind = InputKind::TokenIds { vocab_size: cfg.vocab_size };
    let ids_bt = inputs.add(&mut b, "input_ids", [batch, t], DType::I64, kind);
    let target_btd = inputs.add(&mut b, "target", [batch, t, d], dtype, InputKind::Targets);

    b.push_scope("text_model");
    let x_btd = b.scoped("embeddings", |b| {
        let tok_vd =
            b.scoped("token_embedding", |b| b.parameter("weight", [cfg.vocab_size, d], dtype));
        let pos_pd = b.scoped("position_embedding", |b| {
            b.parameter("weight", [cfg.max_position_embeddings, d], dtype)
        });
        let x_btd = b.embedding(tok_vd, ids_bt)?;
        let pos_td = b.slice(pos_pd, 0, 0, t)?;
        let pos_1td = b.reshape(pos_td, [1, t, d])?;
        b.add(x_btd, pos_1td)
    })?;
    b.push_scope("encoder");
    let mut x_btd = x_btd;
    for layer in 0..cfg.num_hidden_layers {
        b.set_block(Some(layer as u32));
        x_btd = b.scoped(format!("layers.{layer}"), |b| encoder_layer(b, cfg, x_btd))?;
    }
    b.set_block(None);
    b.pop_scope();
    let out_btd = nn::layer_norm(&mut b, "final_layer_norm", x_btd, cfg.layer_norm_eps)?;
    b.pop_scope();

    let loss = mse(&mut b, out_btd, target_btd)?;
    Ok(ForwardModel { builder: b, loss, logits: out_btd, batch, seq: t, inputs: inputs.list })
}

/// One `CLIPEncoderLayer`, inside scope `text_model.encoder.layers.{i}`.
fn encoder_layer(b: &mut Builder, cfg: &ClipTextConfig, x_btd: TensorId) -> nn::IrResult<TensorId> {
    let (d, eps) = (cfg.hidden_size, cfg.layer_norm_eps);
    let h_btd = nn::layer_norm(b, "layer_norm1", x_btd, eps)?;
    let a_btd = b.scoped("self_attn", |b| {
        let names = ["q_proj", "k_proj", "v_proj"];
        let o_btd =
            self_attention_named(b, h_btd, cfg.num_attention_heads, cfg.head_dim(), names, true)?;
        nn::linear(b, "out_proj", o_btd, d, true)
    })?;
    let x_btd = b.add(x_btd, a_btd)?;
    let h_btd = nn::layer_norm(b, "layer_norm2", x_btd, eps)?;
    let m_btd = b.scoped("mlp", |b| {
        let u_bti = nn::linear(b, "fc1", h_btd, cfg.intermediate_size, true)?;
        let u_bti = cfg.hidden_act.apply(b, u_bti)?;
        nn::linear(b, "fc2", u_bti, d, true)
    })?;
    b.add(x_btd, m_btd)
}

/// The mean over every element of `(x − target)²`, in f32.
pub(crate) fn mse(b: &mut Builder, x: TensorId, target: TensorId) -> nn::IrResult<TensorId> {
    let x = nn::to(b, x, DType::F32)?;
    let target = nn::to(b, target, DType::F32)?;
    let diff = b.sub(x, target)?;
    let sq = b.mul(diff, diff)?;
    let dims: Vec<usize> = (0..b.shape(sq).rank()).collect();
    b.reduce(ReduceOp::Mean, sq, &dims, false)
}
