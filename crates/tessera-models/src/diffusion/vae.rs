//! diffusers' `AutoencoderKL` (Stable Diffusion's VAE): an image to its latent distribution's
//! mean, and a latent back to an image.
//!
//! Reference: diffusers `models/autoencoders/autoencoder_kl.py`, `models/autoencoders/vae.py`
//! (`Encoder`, `Decoder`), `models/unets/unet_2d_blocks.py` (`DownEncoderBlock2D`,
//! `UpDecoderBlock2D`, `UNetMidBlock2D`).
//!
//! ```text
//! encoder: h = conv_in(sample)
//!          per down block: resnets (ResnetBlock2D, no time embedding) → Downsample2D
//!                          (pad right/bottom by 1, 3×3 stride-2 conv; all but the last block)
//!          mid_block: resnet → spatial self-attention (one head, GroupNorm, residual) → resnet
//!          moments = quant_conv(conv_out(silu(conv_norm_out h)))      # 2·latent channels
//!          mean = moments[:, :latent]                                 # latent_dist.mean
//! decoder: h = conv_in(post_quant_conv(z)); mid_block
//!          per up block (block_out_channels reversed): layers_per_block + 1 resnets →
//!                          Upsample2D (nearest 2×, 3×3 conv; all but the last block)
//!          image = conv_out(silu(conv_norm_out h))
//! ```
//! Every GroupNorm has `norm_num_groups` groups and eps 1e-6. One config builds one
//! [`VaePart`]: the encoder (`sample [B,C,H,W]` → latent mean `[B,L,H/f,W/f]`), the decoder
//! (`z [B,L,h,w]` → image `[B,C,h·f,w·f]`), or the whole autoencoder (diffusers'
//! `AutoencoderKL.forward(sample)` with the posterior's mode: `sample` → reconstruction), the
//! default; f = 2^(blocks − 1). The loss is the f32 mean squared error of the output against
//! `target`. The latent is unscaled, as diffusers' `encode` returns it: Stable Diffusion
//! multiplies it by `scaling_factor` (kept in the config) before the UNet.
//!
//! Shape suffixes: `b` batch, `c` channels, `h`/`w` spatial.

use super::blocks::{self, ResnetSpec};
use crate::config::positive;
use crate::error::{ModelError, Result};
use crate::nn::{Inputs, IrResult};
use crate::{BuildOptions, ForwardModel, InputKind};
use serde::Serialize;
use serde_json::{Map, Value};
use tessera_ir::{Builder, DType, TensorId, UnaryOp};

/// Which part of the autoencoder a config builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VaePart {
    /// `sample` → the latent distribution's mean.
    Encoder,
    /// `z` → the decoded image.
    Decoder,
    /// `sample` → the reconstruction (encoder, the mean, decoder).
    Autoencoder,
}

impl VaePart {
    pub const NAMES: &'static str = "encoder, decoder, autoencoder";

    pub fn parse(name: &str) -> Option<VaePart> {
        match name {
            "encoder" => Some(VaePart::Encoder),
            "decoder" => Some(VaePart::Decoder),
            "autoencoder" => Some(VaePart::Autoencoder),
            _ => None,
        }
    }
}

/// `AutoencoderKL`'s architecture fields (diffusers' names) and the part to build.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct VaeParams {
    pub name: String,
    pub in_channels: usize,
    pub out_channels: usize,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: usize,
    pub latent_channels: usize,
    pub norm_num_groups: usize,
    /// Image side the model was trained at (`sample_size`); the graph's default.
    pub sample_size: usize,
    /// What Stable Diffusion multiplies the latent by (not applied here).
    pub scaling_factor: f64,
    pub use_quant_conv: bool,
    pub use_post_quant_conv: bool,
    pub mid_block_add_attention: bool,
    pub part: VaePart,
    pub dtype: Option<DType>,
}

/// A validated `AutoencoderKL` configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(transparent)]
pub struct VaeConfig(VaeParams);

impl std::ops::Deref for VaeConfig {
    type Target = VaeParams;
    fn deref(&self) -> &VaeParams {
        &self.0
    }
}

impl VaeConfig {
    pub fn new(params: VaeParams) -> Result<VaeConfig> {
        params.validate()?;
        Ok(VaeConfig(params))
    }
    pub fn params(&self) -> &VaeParams {
        &self.0
    }
    /// The same model building `part`.
    pub fn with_part(&self, part: VaePart) -> VaeConfig {
        VaeConfig(VaeParams { part, ..self.0.clone() })
    }
    /// The same model on `side × side` images (a multiple of the downscale factor).
    pub fn with_sample_size(&self, side: usize) -> Result<VaeConfig> {
        VaeConfig::new(VaeParams { sample_size: side, ..self.0.clone() })
    }
    /// How much the encoder shrinks the image: 2^(blocks − 1).
    pub fn downscale(&self) -> usize {
        1 << (self.block_out_channels.len() - 1)
    }
    /// Resnets (the mid block as one): the graph's block indices.
    pub fn num_blocks(&self) -> usize {
        let n = self.block_out_channels.len();
        match self.part {
            VaePart::Encoder => n * self.layers_per_block + 1,
            VaePart::Decoder => n * (self.layers_per_block + 1) + 1,
            VaePart::Autoencoder => n * (2 * self.layers_per_block + 1) + 2,
        }
    }
    /// Parameters of the part built (the whole autoencoder's for [`VaePart::Autoencoder`],
    /// diffusers' `sum(p.numel() for p in vae.parameters())`).
    pub fn num_parameters(&self) -> u64 {
        let opts = BuildOptions::new(1, 1, DType::F32);
        let small = VaeConfig(VaeParams { sample_size: self.downscale(), ..self.0.clone() });
        build(&small, &opts).map_or(u64::MAX, |m| m.builder.graph.num_parameters())
    }
}

impl VaeConfig {
    /// The diffusers `config.json` of this autoencoder (the keys that shape the network; the
    /// part built is not a diffusers setting and reads back as the whole autoencoder).
    pub fn to_diffusers_json(&self) -> Value {
        let n = self.block_out_channels.len();
        let dtype = match self.dtype {
            Some(DType::BF16) => "bfloat16",
            Some(DType::F16) => "float16",
            _ => "float32",
        };
        serde_json::json!({
            "_class_name": "AutoencoderKL",
            "_name_or_path": self.name,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "down_block_types": vec!["DownEncoderBlock2D"; n],
            "up_block_types": vec!["UpDecoderBlock2D"; n],
            "block_out_channels": self.block_out_channels,
            "layers_per_block": self.layers_per_block,
            "act_fn": "silu",
            "latent_channels": self.latent_channels,
            "norm_num_groups": self.norm_num_groups,
            "sample_size": self.sample_size,
            "scaling_factor": self.scaling_factor,
            "use_quant_conv": self.use_quant_conv,
            "use_post_quant_conv": self.use_post_quant_conv,
            "mid_block_add_attention": self.mid_block_add_attention,
            "torch_dtype": dtype,
        })
    }
}

impl VaeParams {
    fn validate(&self) -> Result<()> {
        positive("in_channels", self.in_channels)?;
        positive("out_channels", self.out_channels)?;
        positive("latent_channels", self.latent_channels)?;
        positive("layers_per_block", self.layers_per_block)?;
        positive("norm_num_groups", self.norm_num_groups)?;
        positive("sample_size", self.sample_size)?;
        let n = self.block_out_channels.len();
        if !(1..=8).contains(&n) {
            return Err(ModelError::invalid(
                "block_out_channels",
                format!("{n} blocks: AutoencoderKL has between 1 and 8"),
            ));
        }
        if self.layers_per_block > 64 {
            return Err(ModelError::invalid("layers_per_block", "at most 64"));
        }
        for &c in &self.block_out_channels {
            if c == 0 || c % self.norm_num_groups != 0 || c > 1 << 20 {
                return Err(ModelError::invalid(
                    "block_out_channels",
                    format!(
                        "{c} channels: each must be a positive multiple of norm_num_groups {} \
                         (at most 2^20)",
                        self.norm_num_groups
                    ),
                ));
            }
        }
        let f = 1usize << (n - 1);
        if !self.sample_size.is_multiple_of(f) || self.sample_size > 1 << 16 {
            return Err(ModelError::invalid(
                "sample_size",
                format!(
                    "{}: the image side must be a multiple of {f} (the encoder halves it {} \
                     times), at most 65536",
                    self.sample_size,
                    n - 1
                ),
            ));
        }
        if self.in_channels > 1 << 16
            || self.out_channels > 1 << 16
            || self.latent_channels > 1 << 16
        {
            return Err(ModelError::invalid("channels", "at most 65536"));
        }
        Ok(())
    }
}

/// Parses a diffusers `AutoencoderKL` config.json (its top-level object): the part built is
/// the whole autoencoder.
pub(crate) fn parse(map: &Map<String, Value>, name: String) -> Result<VaeConfig> {
    let usize_of = |key: &str, default: usize| -> Result<usize> {
        match map.get(key).filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(v) => v.as_u64().map(|n| n as usize).ok_or_else(|| {
                ModelError::invalid(key, format!("must be a non-negative integer, got {v}"))
            }),
        }
    };
    let bool_of = |key: &str, default: bool| -> Result<bool> {
        match map.get(key).filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| ModelError::invalid(key, format!("must be true or false, got {v}"))),
        }
    };
    let strings = |key: &str| -> Result<Option<Vec<String>>> {
        match map.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        ModelError::invalid(key, format!("must be a list of names, got {v}"))
                    })
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(ModelError::invalid(key, format!("must be a list, got {v}"))),
        }
    };
    let block_out_channels = match map.get("block_out_channels").filter(|v| !v.is_null()) {
        None => vec![64],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64().map(|n| n as usize).ok_or_else(|| {
                    ModelError::invalid("block_out_channels", format!("must be integers, got {v}"))
                })
            })
            .collect::<Result<Vec<_>>>()?,
        Some(v) => {
            return Err(ModelError::invalid(
                "block_out_channels",
                format!("must be a list, got {v}"),
            ))
        }
    };
    let n = block_out_channels.len();
    for (key, want) in
        [("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")]
    {
        let types = strings(key)?.unwrap_or_else(|| vec![want.to_string(); n]);
        if types.len() != n {
            return Err(ModelError::invalid(
                key,
                format!("{} blocks, but block_out_channels has {n}", types.len()),
            ));
        }
        if let Some(other) = types.iter().find(|t| *t != want) {
            return Err(ModelError::Unsupported {
                what: format!("AutoencoderKL `{key}`"),
                found: other.clone(),
                supported: want.into(),
            });
        }
    }
    for (key, default) in [("act_fn", Value::from("silu")), ("norm_type", Value::from("group"))] {
        if let Some(v) = map.get(key).filter(|v| !v.is_null() && **v != default) {
            return Err(ModelError::Unsupported {
                what: format!("AutoencoderKL setting `{key}`"),
                found: v.to_string(),
                supported: format!("{default} (diffusers' default)"),
            });
        }
    }
    let scaling_factor = match map.get("scaling_factor").filter(|v| !v.is_null()) {
        None => 0.18215,
        Some(v) => v.as_f64().ok_or_else(|| {
            ModelError::invalid("scaling_factor", format!("must be a number, got {v}"))
        })?,
    };
    let dtype = map
        .get("torch_dtype")
        .or_else(|| map.get("dtype"))
        .and_then(Value::as_str)
        .and_then(DType::parse);
    VaeConfig::new(VaeParams {
        name,
        in_channels: usize_of("in_channels", 3)?,
        out_channels: usize_of("out_channels", 3)?,
        block_out_channels,
        layers_per_block: usize_of("layers_per_block", 1)?,
        latent_channels: usize_of("latent_channels", 4)?,
        norm_num_groups: usize_of("norm_num_groups", 32)?,
        sample_size: usize_of("sample_size", 32)?,
        scaling_factor,
        use_quant_conv: bool_of("use_quant_conv", true)?,
        use_post_quant_conv: bool_of("use_post_quant_conv", true)?,
        mid_block_add_attention: bool_of("mid_block_add_attention", true)?,
        part: VaePart::Autoencoder,
        dtype,
    })
}

const EPS: f64 = 1e-6;

/// Builds `cfg.part` at `opts.batch` on `sample_size` images (`opts.seq` is not used).
pub(crate) fn build(cfg: &VaeConfig, opts: &BuildOptions) -> Result<ForwardModel> {
    let (batch, dtype) = (opts.batch, opts.dtype);
    let (side, f, l) = (cfg.sample_size, cfg.downscale(), cfg.latent_channels);
    let mut b = Builder::new();
    let mut inputs = Inputs::new();
    let mut block = 0u32;
    let (output, target_shape) = match cfg.part {
        VaePart::Encoder | VaePart::Autoencoder => {
            let x = inputs.add(
                &mut b,
                "sample",
                [batch, cfg.in_channels, side, side],
                dtype,
                InputKind::Pixels,
            );
            let mean = b.scoped("encoder", |b| encoder(b, cfg, x, &mut block))?;
            let mean = quant(&mut b, cfg, mean)?;
            if cfg.part == VaePart::Encoder {
                (mean, [batch, l, side / f, side / f])
            } else {
                let image = decode(&mut b, cfg, mean, &mut block)?;
                (image, [batch, cfg.out_channels, side, side])
            }
        }
        VaePart::Decoder => {
            let z =
                inputs.add(&mut b, "z", [batch, l, side / f, side / f], dtype, InputKind::Pixels);
            (decode(&mut b, cfg, z, &mut block)?, [batch, cfg.out_channels, side, side])
        }
    };
    let target = inputs.add(&mut b, "target", target_shape, dtype, InputKind::Targets);
    let loss = crate::clip::mse(&mut b, output, target)?;
    Ok(ForwardModel { builder: b, loss, logits: output, batch, seq: 1, inputs: inputs.list })
}

fn spec(cfg: &VaeConfig) -> ResnetSpec {
    ResnetSpec { groups: cfg.norm_num_groups, eps: EPS, output_scale_factor: 1.0 }
}

/// `quant_conv` and the mean half of the moments.
fn quant(b: &mut Builder, cfg: &VaeConfig, moments: TensorId) -> IrResult<TensorId> {
    let l = cfg.latent_channels;
    let moments = match cfg.use_quant_conv {
        true => blocks::conv2d(b, "quant_conv", moments, 2 * l, 1, 1, 0)?,
        false => moments,
    };
    b.slice(moments, 1, 0, l)
}

/// `post_quant_conv` and the decoder.
fn decode(b: &mut Builder, cfg: &VaeConfig, z: TensorId, block: &mut u32) -> IrResult<TensorId> {
    let l = cfg.latent_channels;
    let z = match cfg.use_post_quant_conv {
        true => blocks::conv2d(b, "post_quant_conv", z, l, 1, 1, 0)?,
        false => z,
    };
    b.scoped("decoder", |b| decoder(b, cfg, z, block))
}

/// `UNetMidBlock2D` (no time embedding): resnet, attention, resnet; one repeated block.
fn mid_block(b: &mut Builder, cfg: &VaeConfig, x: TensorId, block: &mut u32) -> IrResult<TensorId> {
    let c = b.shape(x).dims()[1];
    b.set_block(Some(*block));
    *block += 1;
    b.scoped("mid_block", |b| {
        let x = blocks::resnet_block(b, "resnets.0", x, c, None, spec(cfg))?;
        let x = match cfg.mid_block_add_attention {
            true => b.scoped("attentions", |b| {
                blocks::spatial_self_attention(b, "0", x, cfg.norm_num_groups, EPS)
            })?,
            false => x,
        };
        blocks::resnet_block(b, "resnets.1", x, c, None, spec(cfg))
    })
}

/// `conv_norm_out`, SiLU, `conv_out` to `out` channels.
fn head(b: &mut Builder, cfg: &VaeConfig, x: TensorId, out: usize) -> IrResult<TensorId> {
    b.set_block(None);
    let x = blocks::group_norm(b, "conv_norm_out", x, cfg.norm_num_groups, EPS)?;
    let x = b.unary(UnaryOp::Silu, x)?;
    blocks::conv2d(b, "conv_out", x, out, 3, 1, 1)
}

/// The `Encoder` (its moments, 2·latent channels), in scope `encoder`; its repeated blocks
/// (each resnet, the mid block) numbered from `block` on.
fn encoder(b: &mut Builder, cfg: &VaeConfig, x: TensorId, block: &mut u32) -> IrResult<TensorId> {
    let boc = &cfg.block_out_channels;
    let mut x = blocks::conv2d(b, "conv_in", x, boc[0], 3, 1, 1)?;
    for (i, &out) in boc.iter().enumerate() {
        x = b.scoped(format!("down_blocks.{i}"), |b| {
            let mut x = x;
            for j in 0..cfg.layers_per_block {
                b.set_block(Some(*block));
                *block += 1;
                x = blocks::resnet_block(b, &format!("resnets.{j}"), x, out, None, spec(cfg))?;
            }
            if i + 1 < boc.len() {
                // Downsample2D(padding=0): pad right and bottom by one, then the stride-2 conv.
                let padded = b.pad(x, 2, 0, 1)?;
                let padded = b.pad(padded, 3, 0, 1)?;
                x = blocks::downsample(b, "downsamplers.0", padded, 0)?;
            }
            Ok(x)
        })?;
    }
    let x = mid_block(b, cfg, x, block)?;
    head(b, cfg, x, 2 * cfg.latent_channels)
}

/// The `Decoder`, in scope `decoder`; its repeated blocks numbered from `block` on.
fn decoder(b: &mut Builder, cfg: &VaeConfig, z: TensorId, block: &mut u32) -> IrResult<TensorId> {
    let reversed: Vec<usize> = cfg.block_out_channels.iter().rev().copied().collect();
    let x = blocks::conv2d(b, "conv_in", z, reversed[0], 3, 1, 1)?;
    let mut x = mid_block(b, cfg, x, block)?;
    for (i, &out) in reversed.iter().enumerate() {
        x = b.scoped(format!("up_blocks.{i}"), |b| {
            let mut x = x;
            for j in 0..=cfg.layers_per_block {
                b.set_block(Some(*block));
                *block += 1;
                x = blocks::resnet_block(b, &format!("resnets.{j}"), x, out, None, spec(cfg))?;
            }
            if i + 1 < reversed.len() {
                x = blocks::upsample(b, "upsamplers.0", x)?;
            }
            Ok(x)
        })?;
    }
    head(b, cfg, x, cfg.out_channels)
}
