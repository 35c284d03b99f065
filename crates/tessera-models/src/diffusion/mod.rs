//! Diffusion models in diffusers' layout: a `config.json` with a `_class_name` (and no
//! `model_type`) is a diffusers model, dispatched here by class name.
//!
//! - `blocks`: reusable diffusers blocks (ResnetBlock2D, down/upsampling, the timestep
//!   embedding, Transformer2DModel, the spatial attention block).
//! - `unet`: `UNet2DConditionModel`.
//! - `dit`: `DiTTransformer2DModel` (inputs `hidden_states`, `timestep`, `class_labels`).
//! - `vae`: `AutoencoderKL`.
//!
//! Inputs (diffusers' forward-argument names): `sample [B,C,H,W]` (`InputKind::Pixels`,
//! images or latents), `timestep [B]` f32 (`InputKind::Timesteps`),
//! `encoder_hidden_states [B,T,D]` (`InputKind::Condition`) and the training `target
//! [B,C,H,W]` (`InputKind::Targets`). The output (`ForwardModel::logits`) is the prediction
//! `[B,C,H,W]`; the loss is its mean squared error against `target`, in f32.

pub(crate) mod blocks;
mod config;
mod dit;
mod unet;
mod vae;

pub use config::{DownBlock, UNetConfig, UNetParams, UpBlock, SUPPORTED_CLASS_NAMES};
pub(crate) use dit::build as build_dit;
pub use dit::{DitConfig, DitParams, DIT_CLASS_NAME, TIMESTEP_FEATURES};
pub use vae::{VaeConfig, VaeParams, VaePart};

use crate::error::{ModelError, Result};
use crate::{BuildOptions, ForwardModel, ModelConfig};
use serde_json::{Map, Value};

/// Parses a diffusers config (the `_class_name` arm of the config parser).
pub(crate) fn parse(
    map: &Map<String, Value>,
    class_name: &str,
    name: String,
) -> Result<ModelConfig> {
    match class_name {
        "UNet2DConditionModel" => config::parse_unet(map, name).map(ModelConfig::UNet),
        "AutoencoderKL" => vae::parse(map, name).map(ModelConfig::Vae),
        DIT_CLASS_NAME => dit::from_diffusers(map, name),
        other => Err(ModelError::Unsupported {
            what: "diffusers `_class_name`".into(),
            found: other.into(),
            supported: SUPPORTED_CLASS_NAMES.join(", "),
        }),
    }
}

/// Text tokens a diffusion model is built with when none are asked for (CLIP's 77).
pub const DEFAULT_TEXT_TOKENS: usize = 77;

/// Builds a UNet at `opts` (`opts.seq` text tokens) and `side × side` samples (the config's
/// `sample_size` unless [`UNetConfig::with_sample_size`] changed it).
pub(crate) fn build_unet(cfg: &UNetConfig, opts: &BuildOptions) -> Result<ForwardModel> {
    let side = cfg.sample_size as u128;
    let (batch, widest) =
        (opts.batch as u128, cfg.time_embed_dim.max(4 * cfg.block_out_channels[0]) as u128);
    let positions = side * side;
    let activations = batch.checked_mul(positions).and_then(|n| n.checked_mul(widest));
    let attention = batch
        .checked_mul(positions)
        .and_then(|n| n.checked_mul(positions.max(opts.seq as u128)))
        .and_then(|n| n.checked_mul(widest));
    if activations.is_none_or(|n| n > 1 << 50) || attention.is_none_or(|n| n > 1 << 56) {
        return Err(ModelError::invalid(
            "batch/image size",
            format!(
                "batch {} of {}×{} samples makes tensors beyond 2^50 elements (or attention \
                 beyond 2^56 multiply-adds) in {}; reduce the batch or the image size",
                opts.batch, cfg.sample_size, cfg.sample_size, cfg.name
            ),
        ));
    }
    unet::build(cfg, opts, cfg.sample_size)
}

/// Builds an `AutoencoderKL`'s part at `opts.batch` on its `sample_size` images.
pub(crate) fn build_vae(cfg: &VaeConfig, opts: &BuildOptions) -> Result<ForwardModel> {
    vae::build(cfg, opts)
}

/// Parameters of `cfg`: its graph built at the smallest sample and one token, counted.
pub(crate) fn unet_parameters(cfg: &UNetConfig) -> Result<u64> {
    let side = cfg.downscale();
    let opts = BuildOptions::new(1, 1, tessera_ir::DType::F32);
    let m = unet::build(cfg, &opts, side)?;
    Ok(m.builder.graph.num_parameters())
}
