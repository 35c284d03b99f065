//! Tessera's model zoo: architectures written against the IR [`Builder`], and Hugging Face
//! `config.json` import.
//!
//! - [`ModelConfig`]: what to build — from a preset ([`PRESETS`]), a config.json, or by hand
//!   through the validated `*Config::new` constructors. Validation happens there, once.
//! - [`build`]: config + [`BuildOptions`] (batch, sequence, dtype) → [`ForwardModel`], a
//!   forward graph ending in a scalar f32 loss, ready for `tessera_ir::build_training_graph`.
//!
//! Conventions shared by every model file:
//! - Parameters carry their exact Hugging Face weight names (`transformer.h.3.attn.c_attn.weight`)
//!   and layouts (`nn.Linear` is `[out, in]`, GPT-2's `Conv1D` is `[in, out]`), so checkpoints
//!   map one to one; tied weights are one parameter.
//! - Every node of repeated layer `i` has block `Some(i)`; embeddings and heads have `None`.
//! - Language models take already-shifted next-token `labels` (nanoGPT convention): the loss
//!   is `cross_entropy(logits[B,S,V], labels[B,S])`; BERT ignores label −100.
//! - Weights and activations use [`BuildOptions::dtype`]; the loss is f32.
//! - Attention is the IR's fused op, so attention-probability dropout (`attn_pdrop`,
//!   `attention_probs_dropout_prob`) is not applied; padding masks are not modelled.
//!
//! Shape suffixes in the model files: `b` batch, `s` sequence, `d` hidden, `h` query heads,
//! `k` key/value heads, `e` head dim, `i` MLP width, `v` vocabulary, `n` patches, `c`
//! channels, `p` patch side, `l` labels.

mod bert;
mod bloom;
mod clip;
mod config;
pub mod diffusion;
mod error;
mod gpt2;
mod hf;
mod hf_write;
mod llama;
pub mod lora;
mod mla;
mod mlp;
mod moe;
mod nn;
mod onnx;
mod presets;
pub mod qlora;
pub mod rope;
mod vit;

pub use clip::{ClipActivation, ClipTextConfig, ClipTextParams};
pub use config::{
    Activation, BertConfig, BertParams, BloomConfig, BloomParams, DeepseekRouting, Gpt2Config,
    Gpt2Params, LlamaConfig, LlamaParams, LlamaVariant, MlaParams, MlpConfig, MlpParams, MoeParams,
    VitConfig, VitParams, MAX_HEAD_DIM, MAX_LAYERS, MAX_PARAMETERS,
};
pub use diffusion::{UNetConfig, UNetParams, VaeConfig, VaeParams, VaePart};
pub use error::{ModelError, Result};
pub use hf::SUPPORTED_MODEL_TYPES;
pub use nn::{Quantize, QuantizedWeight, IGNORE_INDEX, INT4_GROUP};
pub use onnx::{OnnxConfig, OnnxTask};
pub use presets::PRESETS;
pub use rope::RopeScaling;

use serde::Serialize;
use std::path::Path;
use tessera_ir::{Builder, DType, TensorId};

/// A validated model configuration of one of the supported families.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "family", rename_all = "snake_case")]
// A config is made once per run and passed by reference: the LLaMA family's variant (MoE and
// MLA settings included) being a few hundred bytes larger than the others costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum ModelConfig {
    Gpt2(Gpt2Config),
    /// LLaMA, Mistral, Qwen2, Mixtral, Qwen3-MoE and DeepSeek-V3 (see
    /// [`LlamaParams::variant`]).
    Llama(LlamaConfig),
    Bert(BertConfig),
    Vit(VitConfig),
    Mlp(MlpConfig),
    /// BLOOM (`BloomForCausalLM`): ALiBi positions.
    Bloom(BloomConfig),
    /// A model imported from an ONNX file (`torch.onnx.export`).
    Onnx(OnnxConfig),
    /// diffusers' `UNet2DConditionModel` (a `config.json` with `_class_name`).
    UNet(UNetConfig),
    /// CLIP's text encoder (`CLIPTextModel`): Stable Diffusion's text conditioning.
    ClipText(ClipTextConfig),
    /// diffusers' `AutoencoderKL` (Stable Diffusion's VAE): its encoder, decoder, or both.
    Vae(VaeConfig),
    /// diffusers' `DiTTransformer2DModel` (class-conditional image diffusion).
    Dit(diffusion::DitConfig),
}

impl ModelConfig {
    /// The same model with every dropout probability set to zero: evaluation and inference
    /// (and parity checks against a reference) run without dropout.
    pub fn without_dropout(&self) -> ModelConfig {
        // Zero is always a valid probability, so re-validation cannot fail.
        const VALID: &str = "a config with zero dropout is valid";
        match self {
            ModelConfig::Gpt2(c) => {
                let mut p = c.clone().into_params();
                (p.embd_pdrop, p.resid_pdrop, p.attn_pdrop) = (0.0, 0.0, 0.0);
                ModelConfig::Gpt2(Gpt2Config::new(p).expect(VALID))
            }
            ModelConfig::Bert(c) => {
                let mut p = c.clone().into_params();
                (p.hidden_dropout_prob, p.attention_probs_dropout_prob) = (0.0, 0.0);
                ModelConfig::Bert(BertConfig::new(p).expect(VALID))
            }
            ModelConfig::Vit(c) => {
                let mut p = c.clone().into_params();
                (p.hidden_dropout_prob, p.attention_probs_dropout_prob) = (0.0, 0.0);
                ModelConfig::Vit(VitConfig::new(p).expect(VALID))
            }
            ModelConfig::Bloom(c) => {
                let mut p = c.clone().into_params();
                (p.hidden_dropout, p.attention_dropout) = (0.0, 0.0);
                ModelConfig::Bloom(BloomConfig::new(p).expect(VALID))
            }
            // An ONNX file exported in eval mode holds no dropout; the UNet and DiT have none.
            ModelConfig::Llama(_)
            | ModelConfig::Mlp(_)
            | ModelConfig::Onnx(_)
            | ModelConfig::UNet(_)
            | ModelConfig::Vae(_)
            // CLIP's dropouts are not modelled (SD keeps the encoder frozen, in eval mode).
            | ModelConfig::Dit(_)
            | ModelConfig::ClipText(_) => self.clone(),
        }
    }

    /// Parses the text of a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<ModelConfig> {
        hf::parse(text, "config.json", None)
    }

    /// Reads a `config.json`, or the `config.json` inside directory `path`. Without a
    /// `_name_or_path` in the file, the model is named after its directory.
    pub fn from_path(path: &Path) -> Result<ModelConfig> {
        let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
        let io = |source| ModelError::Io { path: file.display().to_string(), source };
        // A config.json is a few KiB: read at most 16 MiB, so that a device (`/dev/zero`) or
        // a huge file passed as the model is refused, not read until memory runs out.
        const MAX_CONFIG_BYTES: u64 = 16 << 20;
        let mut bytes = Vec::new();
        use std::io::Read as _;
        std::fs::File::open(&file)
            .and_then(|f| f.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut bytes))
            .map_err(io)?;
        if bytes.len() as u64 > MAX_CONFIG_BYTES {
            return Err(io(std::io::Error::other("more than 16 MiB, which no model config is")));
        }
        let text = String::from_utf8(bytes)
            .map_err(|e| io(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
        let name = if file.file_name().is_some_and(|n| n == "config.json") {
            file.parent().and_then(Path::file_name)
        } else {
            file.file_stem()
        };
        let name = name.map(|n| n.to_string_lossy().into_owned()).filter(|n| !n.is_empty());
        hf::parse(&text, &file.display().to_string(), name.as_deref())
    }

    /// One of [`PRESETS`]; the error lists them.
    pub fn preset(name: &str) -> Result<ModelConfig> {
        presets::preset(name)
    }

    /// A preset name, else a path to an ONNX file, a config.json or a directory holding one.
    pub fn resolve(spec: &str) -> Result<ModelConfig> {
        if PRESETS.contains(&spec) {
            return presets::preset(spec);
        }
        let path = Path::new(spec);
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("onnx")) {
            return OnnxConfig::open(path).map(ModelConfig::Onnx);
        }
        if path.exists() {
            return ModelConfig::from_path(path);
        }
        Err(ModelError::UnknownPreset { name: spec.to_string(), presets: PRESETS.join(", ") })
    }

    /// The same diffusion model on `side × side` samples (`--image-size`: the latent side for
    /// a latent model); refused for the other families, whose input size is not an image's.
    pub fn with_image_size(&self, side: usize) -> Result<ModelConfig> {
        match self {
            ModelConfig::UNet(c) => c.with_sample_size(side).map(ModelConfig::UNet),
            ModelConfig::Vae(c) => c.with_sample_size(side).map(ModelConfig::Vae),
            ModelConfig::Dit(_)
            | ModelConfig::Gpt2(_)
            | ModelConfig::Llama(_)
            | ModelConfig::Bert(_)
            | ModelConfig::Vit(_)
            | ModelConfig::Mlp(_)
            | ModelConfig::Bloom(_)
            | ModelConfig::Onnx(_)
            | ModelConfig::ClipText(_) => Err(ModelError::Unsupported {
                what: "--image-size for model family".into(),
                found: self.family().into(),
                supported:
                    "diffusion models (unet, vae); a ViT's or DiT's image size is its config's"
                        .into(),
            }),
        }
    }

    /// The sequence length a command uses when none is given, where the family fixes one:
    /// a diffusion model's text tokens, [`diffusion::DEFAULT_TEXT_TOKENS`] (CLIP's 77).
    pub fn default_seq(&self) -> Option<usize> {
        match self {
            ModelConfig::UNet(_) => Some(diffusion::DEFAULT_TEXT_TOKENS),
            ModelConfig::Dit(_)
            | ModelConfig::Vae(_)
            | ModelConfig::Gpt2(_)
            | ModelConfig::Llama(_)
            | ModelConfig::Bert(_)
            | ModelConfig::Vit(_)
            | ModelConfig::Mlp(_)
            | ModelConfig::Bloom(_)
            | ModelConfig::Onnx(_)
            | ModelConfig::ClipText(_) => None,
        }
    }

    /// The preset name, the config's `_name_or_path`, or its directory's name.
    pub fn name(&self) -> &str {
        match self {
            ModelConfig::Gpt2(c) => &c.name,
            ModelConfig::Llama(c) => &c.name,
            ModelConfig::Bert(c) => &c.name,
            ModelConfig::Vit(c) => &c.name,
            ModelConfig::Mlp(c) => &c.name,
            ModelConfig::Bloom(c) => &c.name,
            ModelConfig::Onnx(c) => &c.name,
            ModelConfig::UNet(c) => &c.name,
            ModelConfig::ClipText(c) => &c.name,
            ModelConfig::Vae(c) => &c.name,
            ModelConfig::Dit(c) => &c.name,
        }
    }

    /// The family: `gpt2`, `llama`, `bert`, `vit`, `mlp`, `bloom`, `onnx`, `unet`, `clip_text`
    /// or `vae`.
    pub fn family(&self) -> &'static str {
        match self {
            ModelConfig::Gpt2(_) => "gpt2",
            ModelConfig::Llama(_) => "llama",
            ModelConfig::Bert(_) => "bert",
            ModelConfig::Vit(_) => "vit",
            ModelConfig::Mlp(_) => "mlp",
            ModelConfig::Bloom(_) => "bloom",
            ModelConfig::Onnx(_) => "onnx",
            ModelConfig::UNet(_) => "unet",
            ModelConfig::ClipText(_) => "clip_text",
            ModelConfig::Vae(_) => "vae",
            ModelConfig::Dit(_) => "dit",
        }
    }

    /// Whether the model has mixture-of-experts layers (routed expert MLPs).
    pub fn is_moe(&self) -> bool {
        matches!(self, ModelConfig::Llama(c) if c.moe.is_some())
    }

    /// The Hugging Face `model_type` (`mistral` and `qwen2` are of the `llama` family).
    pub fn model_type(&self) -> &'static str {
        match self {
            ModelConfig::Llama(c) => c.variant.model_type(),
            ModelConfig::ClipText(_) => "clip_text_model",
            _ => self.family(),
        }
    }

    /// Number of repeated blocks (transformer layers; an MLP's hidden layers).
    pub fn num_blocks(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.n_layer,
            ModelConfig::Llama(c) => c.num_hidden_layers,
            ModelConfig::Bert(c) => c.num_hidden_layers,
            ModelConfig::Vit(c) => c.num_hidden_layers,
            ModelConfig::Mlp(c) => c.hidden_dims.len(),
            ModelConfig::Bloom(c) => c.n_layer,
            ModelConfig::Onnx(c) => c.num_blocks,
            ModelConfig::UNet(c) => c.num_blocks(),
            ModelConfig::ClipText(c) => c.num_hidden_layers,
            ModelConfig::Vae(c) => c.num_blocks(),
            ModelConfig::Dit(c) => c.num_layers,
        }
    }

    /// Model width (an MLP's widest hidden layer, or its input dim if it has none).
    pub fn hidden_size(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.n_embd,
            ModelConfig::Llama(c) => c.hidden_size,
            ModelConfig::Bert(c) => c.hidden_size,
            ModelConfig::Vit(c) => c.hidden_size,
            ModelConfig::Mlp(c) => c.hidden_dims.iter().copied().max().unwrap_or(c.input_dim),
            ModelConfig::Bloom(c) => c.hidden_size,
            ModelConfig::Onnx(c) => c.widest,
            ModelConfig::UNet(c) => c.block_out_channels.iter().copied().max().unwrap_or(0),
            ModelConfig::ClipText(c) => c.hidden_size,
            ModelConfig::Vae(c) => c.block_out_channels.iter().copied().max().unwrap_or(0),
            ModelConfig::Dit(c) => c.inner_dim(),
        }
    }

    /// Query heads (None for the MLP).
    pub fn num_heads(&self) -> Option<usize> {
        match self {
            ModelConfig::Gpt2(c) => Some(c.n_head),
            ModelConfig::Llama(c) => Some(c.num_attention_heads),
            ModelConfig::Bert(c) => Some(c.num_attention_heads),
            ModelConfig::Vit(c) => Some(c.num_attention_heads),
            ModelConfig::Bloom(c) => Some(c.n_head),
            ModelConfig::UNet(c) => c.heads.iter().copied().max(),
            ModelConfig::ClipText(c) => Some(c.num_attention_heads),
            ModelConfig::Dit(c) => Some(c.num_attention_heads),
            ModelConfig::Mlp(_) | ModelConfig::Onnx(_) | ModelConfig::Vae(_) => None,
        }
    }

    /// Key/value heads (fewer than query heads under GQA).
    pub fn num_kv_heads(&self) -> Option<usize> {
        match self {
            ModelConfig::Llama(c) => Some(c.num_key_value_heads),
            _ => self.num_heads(),
        }
    }

    /// Token vocabulary (None for ViT and the MLP).
    pub fn vocab_size(&self) -> Option<usize> {
        match self {
            ModelConfig::Gpt2(c) => Some(c.vocab_size),
            ModelConfig::Llama(c) => Some(c.vocab_size),
            ModelConfig::Bert(c) => Some(c.vocab_size),
            ModelConfig::Bloom(c) => Some(c.vocab_size),
            ModelConfig::Onnx(c) => c.vocab_size(),
            ModelConfig::ClipText(c) => Some(c.vocab_size),
            ModelConfig::Vit(_)
            | ModelConfig::Mlp(_)
            | ModelConfig::UNet(_)
            | ModelConfig::Vae(_)
            | ModelConfig::Dit(_) => None,
        }
    }

    /// The longest sequence a learned position table allows (GPT-2, BERT); None where
    /// positions are rotary (LLaMA), ALiBi biases (BLOOM) or fixed by the input (ViT, MLP).
    pub fn max_seq(&self) -> Option<usize> {
        match self {
            ModelConfig::Gpt2(c) => Some(c.n_positions),
            ModelConfig::Bert(c) => Some(c.max_position_embeddings),
            ModelConfig::Onnx(c) => c.fixed_seq(),
            ModelConfig::Llama(_)
            | ModelConfig::Bloom(_)
            | ModelConfig::Vit(_)
            | ModelConfig::Mlp(_)
            | ModelConfig::UNet(_)
            | ModelConfig::Vae(_)
            | ModelConfig::Dit(_) => None,
            ModelConfig::ClipText(c) => Some(c.max_position_embeddings),
        }
    }

    /// The sequence length the graph will have for a requested one: ViT's is its patch
    /// count + 1 and the MLP's is 1, whatever is asked; the others take the request.
    pub fn effective_seq(&self, requested: usize) -> usize {
        match self {
            ModelConfig::Vit(c) => c.seq_len(),
            ModelConfig::Mlp(_) | ModelConfig::Vae(_) => 1,
            ModelConfig::Dit(c) => c.num_patches(),
            ModelConfig::Onnx(c) => match c.task {
                OnnxTask::CausalLm { .. } => c.fixed_seq().unwrap_or(requested),
                OnnxTask::ImageClassifier { .. } | OnnxTask::Regression { .. } => 1,
            },
            // A diffusion model's sequence is its text tokens.
            ModelConfig::Gpt2(_)
            | ModelConfig::Llama(_)
            | ModelConfig::Bert(_)
            | ModelConfig::Bloom(_)
            | ModelConfig::UNet(_)
            | ModelConfig::ClipText(_) => requested,
        }
    }

    /// The dtype the checkpoint was saved in, if its config states one.
    pub fn dtype(&self) -> Option<DType> {
        match self {
            ModelConfig::Gpt2(c) => c.dtype,
            ModelConfig::Llama(c) => c.dtype,
            ModelConfig::Bert(c) => c.dtype,
            ModelConfig::Vit(c) => c.dtype,
            ModelConfig::Mlp(c) => c.dtype,
            ModelConfig::Bloom(c) => c.dtype,
            ModelConfig::Dit(c) => c.dtype,
            ModelConfig::Onnx(_) => None,
            ModelConfig::UNet(c) => c.dtype,
            ModelConfig::ClipText(c) => c.dtype,
            ModelConfig::Vae(c) => c.dtype,
        }
    }

    /// Trainable parameters, tied tensors counted once, from the config alone (the built
    /// graph's `num_parameters()` agrees; tests check both against Hugging Face's figures).
    pub fn num_parameters(&self) -> u64 {
        match self {
            ModelConfig::Gpt2(c) => c.num_parameters(),
            ModelConfig::Llama(c) => c.num_parameters(),
            ModelConfig::Bert(c) => c.num_parameters(),
            ModelConfig::Vit(c) => c.num_parameters(),
            ModelConfig::Mlp(c) => c.num_parameters(),
            ModelConfig::Bloom(c) => c.num_parameters(),
            ModelConfig::Onnx(c) => c.num_parameters,
            ModelConfig::UNet(c) => c.num_parameters(),
            ModelConfig::ClipText(c) => c.num_parameters(),
            ModelConfig::Vae(c) => c.num_parameters(),
            ModelConfig::Dit(c) => c.num_parameters(),
        }
    }

    /// (widest activation row, total attention width H·head_dim) — for the size guard.
    fn widths(&self) -> (usize, usize) {
        let max = |xs: &[usize]| xs.iter().copied().max().unwrap_or(0);
        match self {
            ModelConfig::Gpt2(c) => (max(&[c.vocab_size, 3 * c.n_embd, c.n_inner]), c.n_embd),
            ModelConfig::Llama(c) => {
                let q = c.num_attention_heads * c.head_dim();
                // Saturating: a Qwen3-MoE without dense layers never checks its dense width.
                let experts = c.moe.as_ref().map_or(0, |m| {
                    let shared = m.shared_expert_intermediate_size.unwrap_or(0);
                    m.expert_intermediate_size.max(shared).saturating_mul(2)
                });
                let dense = c.intermediate_size.saturating_mul(2);
                (max(&[c.vocab_size, dense, experts, q, c.hidden_size]), q)
            }
            ModelConfig::Bert(c) => {
                (max(&[c.vocab_size, c.intermediate_size, c.hidden_size]), c.hidden_size)
            }
            ModelConfig::Vit(c) => {
                let patch = c.num_channels * c.patch_size[0] * c.patch_size[1];
                (max(&[patch, c.intermediate_size, c.hidden_size]), c.hidden_size)
            }
            ModelConfig::Mlp(c) => (max(&[c.input_dim, c.num_classes, max(&c.hidden_dims)]), 0),
            ModelConfig::Bloom(c) => {
                (max(&[c.vocab_size, 3 * c.hidden_size, c.mlp_width()]), c.hidden_size)
            }
            ModelConfig::Onnx(c) => (c.widest, c.widest),
            // The sample's `[B, C, H, W]` activations are checked by the builder.
            ModelConfig::UNet(c) => (c.cross_attention_dim, c.cross_attention_dim),
            ModelConfig::ClipText(c) => {
                (max(&[c.vocab_size, c.intermediate_size, c.hidden_size]), c.hidden_size)
            }
            // One "position" of H·W pixels at the widest channel count; attention over the
            // mid block's (H/f)·(W/f) positions.
            ModelConfig::Vae(c) => {
                let (side, widest) = (c.sample_size, max(&c.block_out_channels));
                let mid = (side / c.downscale()).saturating_mul(side / c.downscale());
                (
                    side.saturating_mul(side).saturating_mul(widest),
                    mid.saturating_mul(mid).saturating_mul(widest),
                )
            }
            ModelConfig::Dit(c) => {
                let (d, p) = (c.inner_dim(), c.patch_size);
                let patch = c.in_channels.max(c.out_channels) * p * p;
                (max(&[patch, 6 * d, 4 * d, crate::diffusion::TIMESTEP_FEATURES]), d)
            }
        }
    }
}

/// How to instantiate a configuration as a graph.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BuildOptions {
    pub batch: usize,
    /// Tokens per sequence. Ignored by ViT (patches + 1) and the MLP (1).
    pub seq: usize,
    /// Weights and activations (a float type; F32 or BF16 in practice). The loss is f32.
    pub dtype: DType,
}

impl BuildOptions {
    pub fn new(batch: usize, seq: usize, dtype: DType) -> BuildOptions {
        BuildOptions { batch, seq, dtype }
    }
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions { batch: 1, seq: 128, dtype: DType::F32 }
    }
}

/// What a data input holds, so loaders can fill it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InputKind {
    /// Token ids in `0..vocab_size`.
    TokenIds { vocab_size: usize },
    /// BERT segment ids in `0..type_vocab_size`.
    TokenTypeIds { type_vocab_size: usize },
    /// Class targets in `0..num_classes`, or `ignore_index`.
    Labels { num_classes: usize, ignore_index: Option<i64> },
    /// Images `[B, C, H, W]` in the model dtype.
    Pixels,
    /// Feature vectors `[B, input_dim]` in the model dtype.
    Features,
    /// Regression targets shaped like the model's output, in the model dtype (an imported
    /// dense model trained with a mean squared error).
    Targets,
    /// The step's i64 RNG seed for dropout.
    Seed,
    /// An f32 scalar: how many targets of the whole step (every micro-batch and shard) are not
    /// ignored — the denominator of a mean loss over them, the same on every plan.
    TargetCount,
    /// Generation: `[B]`, the KV-cache position of each row's first token of the step.
    CacheStart,
    /// Generation: `[B, S]`, each token's position (`cache_start[b] + i`).
    Positions,
    /// Generation: `[B]`, the step position whose logits each row wants.
    LastIndex,
    /// Diffusion: `[B]` f32, each row's timestep (`0..num_train_timesteps`, fractional when
    /// sampling).
    Timesteps,
    /// Diffusion: `[B, T, D]` conditioning states in the model dtype (the text encoder's
    /// `encoder_hidden_states`, T tokens of width `cross_attention_dim`).
    Condition,
    /// Diffusion: `[B]` i64 class conditions in `0..=num_classes`, `num_classes` being the
    /// null (unconditional) class of classifier-free guidance.
    ClassLabels { num_classes: usize },
}

/// One data input of a built model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelInput {
    pub name: &'static str,
    pub tensor: TensorId,
    pub kind: InputKind,
}

/// A built forward graph.
pub struct ForwardModel {
    pub builder: Builder,
    /// The scalar f32 training loss.
    pub loss: TensorId,
    /// The logits the loss is taken of (`[B, S, V]`, or `[B, L]` for classifiers).
    pub logits: TensorId,
    pub batch: usize,
    /// The graph's sequence length: ViT's is patches + 1, the MLP's 1.
    pub seq: usize,
    /// The data inputs, in declaration order.
    pub inputs: Vec<ModelInput>,
}

impl ForwardModel {
    /// The input named `name` (`input_ids`, `labels`, `token_type_ids`, `pixel_values`,
    /// `inputs`, `seed`).
    pub fn input(&self, name: &str) -> Option<TensorId> {
        self.inputs.iter().find(|i| i.name == name).map(|i| i.tensor)
    }

    /// The labels input and the label value its loss ignores, if any.
    pub fn labels(&self) -> Option<(TensorId, Option<i64>)> {
        self.inputs.iter().find_map(|i| match i.kind {
            InputKind::Labels { ignore_index, .. } => Some((i.tensor, ignore_index)),
            _ => None,
        })
    }
}

/// One step of generation with a KV cache: `seq` new tokens per row (the prompt for the
/// prefill, 1 for a decode step) into caches of `capacity` positions.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GenerateOptions {
    pub batch: usize,
    pub seq: usize,
    /// Positions each layer's KV cache holds (prompt + new tokens).
    pub capacity: usize,
    pub dtype: DType,
    pub quantize: Option<Quantize>,
    /// Logits at every position (`[B, S, V]`: scoring a text, `tessera eval --quantize`)
    /// instead of at each row's `last_index` (`[B, 1, V]`: generating).
    pub all_logits: bool,
}

/// A built generation step: logits `[B, 1, V]` (f32) at each row's `last_index` (or
/// `[B, S, V]` with [`GenerateOptions::all_logits`]).
pub struct GenerationModel {
    pub builder: Builder,
    pub logits: TensorId,
    pub batch: usize,
    pub seq: usize,
    pub capacity: usize,
    /// `input_ids`, `cache_start`, `position_ids`, `last_index`.
    pub inputs: Vec<ModelInput>,
    /// The quantised weights and where they come from.
    pub quantized: Vec<QuantizedWeight>,
}

impl GenerationModel {
    pub fn input(&self, name: &str) -> Option<TensorId> {
        self.inputs.iter().find(|i| i.name == name).map(|i| i.tensor)
    }
}

/// What a causal-LM family builder returns, in training or generation.
pub(crate) struct Built {
    pub(crate) builder: Builder,
    pub(crate) loss: Option<TensorId>,
    pub(crate) logits: TensorId,
    pub(crate) inputs: Vec<ModelInput>,
    pub(crate) quantized: Vec<QuantizedWeight>,
}

impl Built {
    fn forward(self, batch: usize, seq: usize) -> Result<ForwardModel> {
        let loss = self
            .loss
            .ok_or_else(|| ModelError::invalid("mode", "a generation graph has no loss"))?;
        Ok(ForwardModel {
            builder: self.builder,
            loss,
            logits: self.logits,
            batch,
            seq,
            inputs: self.inputs,
        })
    }
}

/// Builds one generation step of a causal language model (GPT-2, LLaMA family, BLOOM).
pub fn build_generation(cfg: &ModelConfig, opts: &GenerateOptions) -> Result<GenerationModel> {
    if opts.capacity < opts.seq {
        return Err(ModelError::invalid(
            "capacity",
            format!(
                "the KV cache holds {} positions, fewer than the step's {}",
                opts.capacity, opts.seq
            ),
        ));
    }
    if let Some(max) = cfg.max_seq() {
        if opts.capacity > max {
            return Err(ModelError::SequenceTooLong {
                seq: opts.capacity,
                max,
                field: "n_positions",
                model: cfg.name().to_string(),
            });
        }
    }
    let build_opts = BuildOptions::new(opts.batch, opts.seq, opts.dtype);
    check_basic(&build_opts)?;
    check_sizes(cfg, &BuildOptions { seq: opts.capacity, ..build_opts.clone() })?;
    let built = match cfg {
        ModelConfig::Gpt2(c) => gpt2::build(c, &build_opts, Some(opts))?,
        ModelConfig::Llama(c) => llama::build(c, &build_opts, Some(opts))?,
        ModelConfig::Bloom(c) => bloom::build(c, &build_opts, Some(opts))?,
        ModelConfig::Bert(_)
        | ModelConfig::Vit(_)
        | ModelConfig::Mlp(_)
        | ModelConfig::Onnx(_)
        | ModelConfig::UNet(_)
        | ModelConfig::ClipText(_)
        | ModelConfig::Vae(_)
        | ModelConfig::Dit(_) => {
            return Err(ModelError::Unsupported {
                what: "generation".into(),
                found: cfg.family().into(),
                supported:
                    "causal language models: gpt2, llama, mistral, qwen2, mixtral, qwen3_moe, \
                            deepseek_v3, bloom"
                        .into(),
            })
        }
    };
    Ok(GenerationModel {
        builder: built.builder,
        logits: built.logits,
        batch: opts.batch,
        seq: opts.seq,
        capacity: opts.capacity,
        inputs: built.inputs,
        quantized: built.quantized,
    })
}

/// Activation elements per tensor stay below 2^50 and attention's B·S²·H·D below 2^56, so no
/// FLOP or byte count of the graph can overflow a u64.
const MAX_ACTIVATION_ELEMENTS: u128 = 1 << 50;
const MAX_ATTENTION_VOLUME: u128 = 1 << 56;

/// Builds the forward graph of `cfg` at `opts`' batch, sequence and dtype.
pub fn build(cfg: &ModelConfig, opts: &BuildOptions) -> Result<ForwardModel> {
    check_basic(opts)?;
    if let Some(max) = cfg.max_seq() {
        if opts.seq > max {
            let field = match cfg {
                ModelConfig::Gpt2(_) => "n_positions",
                _ => "max_position_embeddings",
            };
            return Err(ModelError::SequenceTooLong {
                seq: opts.seq,
                max,
                field,
                model: cfg.name().to_string(),
            });
        }
    }
    let seq = cfg.effective_seq(opts.seq);
    let opts = BuildOptions { seq, ..opts.clone() };
    check_sizes(cfg, &opts)?;
    match cfg {
        ModelConfig::Gpt2(c) => gpt2::build(c, &opts, None)?.forward(opts.batch, seq),
        ModelConfig::Llama(c) => llama::build(c, &opts, None)?.forward(opts.batch, seq),
        ModelConfig::Bloom(c) => bloom::build(c, &opts, None)?.forward(opts.batch, seq),
        ModelConfig::Bert(c) => bert::build(c, &opts),
        ModelConfig::Vit(c) => vit::build(c, &opts),
        ModelConfig::Mlp(c) => mlp::build(c, &opts),
        ModelConfig::Dit(c) => diffusion::build_dit(c, &opts),
        ModelConfig::Onnx(c) => onnx::build(c, &opts),
        ModelConfig::UNet(c) => diffusion::build_unet(c, &opts),
        ModelConfig::ClipText(c) => clip::build(c, &opts),
        ModelConfig::Vae(c) => diffusion::build_vae(c, &opts),
    }
}

fn check_basic(opts: &BuildOptions) -> Result<()> {
    if opts.batch == 0 {
        return Err(ModelError::invalid("batch", "must be at least 1, got 0"));
    }
    if opts.seq == 0 {
        return Err(ModelError::invalid("seq", "must be at least 1, got 0"));
    }
    if !opts.dtype.is_float() {
        return Err(ModelError::Unsupported {
            what: "model dtype".into(),
            found: opts.dtype.to_string(),
            supported: "f32, bf16, f16, f64".into(),
        });
    }
    Ok(())
}

/// Refuses graphs whose tensors no device holds (and whose counts could overflow).
fn check_sizes(cfg: &ModelConfig, opts: &BuildOptions) -> Result<()> {
    let seq = opts.seq;
    let (widest, attention_width) = cfg.widths();
    let (b, s) = (opts.batch as u128, seq as u128);
    let activations = b.checked_mul(s).and_then(|t| t.checked_mul(widest as u128));
    let attention = b
        .checked_mul(s)
        .and_then(|t| t.checked_mul(s))
        .and_then(|t| t.checked_mul(attention_width as u128));
    if activations.is_none_or(|n| n > MAX_ACTIVATION_ELEMENTS)
        || attention.is_none_or(|n| n > MAX_ATTENTION_VOLUME)
    {
        return Err(ModelError::invalid(
            "batch/seq",
            format!(
                "batch {} x seq {seq} makes tensors beyond 2^50 elements (or attention beyond \
                 2^56 multiply-adds) in {}; no device holds that: reduce batch or seq",
                opts.batch,
                cfg.name()
            ),
        ));
    }
    Ok(())
}
