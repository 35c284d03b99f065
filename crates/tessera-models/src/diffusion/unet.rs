//! diffusers' `UNet2DConditionModel` (Stable Diffusion's noise predictor), trained with the
//! mean squared error of its prediction against a target.
//!
//! Paper: Rombach et al. 2022, "High-Resolution Image Synthesis with Latent Diffusion Models".
//! Reference implementation: diffusers `models/unets/unet_2d_condition.py` and
//! `models/unets/unet_2d_blocks.py` (`CrossAttnDownBlock2D`, `DownBlock2D`,
//! `UNetMidBlock2DCrossAttn`, `CrossAttnUpBlock2D`, `UpBlock2D`).
//!
//! ```text
//! emb = time_embedding(timesteps(timestep))                       # [B, 4·c0]
//! x = conv_in(sample); skips = [x]
//! for each down block i: (resnet (+ attention)) × layers_per_block, each output a skip;
//!                        downsampler (not on the last block), its output a skip
//! x = mid_block: resnet, attention, resnet
//! for each up block (widths reversed): (concat(x, skips.pop()) → resnet (+ attention))
//!                        × (layers_per_block + 1); upsampler (not on the last block)
//! pred = conv_out(silu(conv_norm_out(x)))                          # [B, C_out, H, W]
//! loss = mean((pred − target)²)                                    # f32
//! ```
//! Heads: diffusers' `attention_head_dim` is the head count of each down block (SD 2's list
//! `[5, 10, 20, 20]`, or one int for all), so a block of C channels has heads of width C/h;
//! the up blocks take the list reversed and the mid block its last entry.

use super::blocks::{self, ResnetSpec, TransformerSpec};
use super::config::{DownBlock, UNetConfig, UpBlock};
use crate::error::Result;
use crate::nn::{self, Inputs, IrResult};
use crate::{BuildOptions, ForwardModel, InputKind};
use tessera_ir::{Builder, DType, ReduceOp, TensorId};

/// The settings every `Transformer2DModel` shares.
struct Ctx {
    groups: usize,
    layers: usize,
    linear_projection: bool,
}

impl Ctx {
    fn transformer(&self, channels: usize, heads: usize) -> TransformerSpec {
        TransformerSpec {
            heads,
            head_dim: channels / heads,
            layers: self.layers,
            groups: self.groups,
            linear_projection: self.linear_projection,
        }
    }
}

/// Builds the UNet at `opts.batch`, `side × side` samples and `opts.seq` text tokens.
pub(crate) fn build(cfg: &UNetConfig, opts: &BuildOptions, side: usize) -> Result<ForwardModel> {
    let (batch, dtype, tokens) = (opts.batch, opts.dtype, opts.seq);
    let mut b = Builder::new();
    let mut inputs = Inputs::new();
    let sample_shape = [batch, cfg.in_channels, side, side];
    let sample = inputs.add(&mut b, "sample", sample_shape, dtype, InputKind::Pixels);
    let timestep = inputs.add(&mut b, "timestep", [batch], DType::F32, InputKind::Timesteps);
    let context_btd = inputs.add(
        &mut b,
        "encoder_hidden_states",
        [batch, tokens, cfg.cross_attention_dim],
        dtype,
        InputKind::Condition,
    );
    let target_shape = [batch, cfg.out_channels, side, side];
    let target = inputs.add(&mut b, "target", target_shape, dtype, InputKind::Targets);

    let pred = forward(&mut b, cfg, sample, timestep, context_btd)?;
    let pred32 = nn::to(&mut b, pred, DType::F32)?;
    let target32 = nn::to(&mut b, target, DType::F32)?;
    let d = b.sub(pred32, target32)?;
    let sq = b.mul(d, d)?;
    let loss = b.reduce(ReduceOp::Mean, sq, &[0, 1, 2, 3], false)?;
    Ok(ForwardModel { builder: b, loss, logits: pred, batch, seq: tokens, inputs: inputs.list })
}

/// The noise prediction `[B, out_channels, H, W]` of `sample` at `timestep`, conditioned on
/// `context` (the text states).
fn forward(
    b: &mut Builder,
    cfg: &UNetConfig,
    sample: TensorId,
    timestep: TensorId,
    context_btd: TensorId,
) -> IrResult<TensorId> {
    let c0 = cfg.block_out_channels[0];
    let dtype = b.dtype(sample);
    let t_feat = b.scoped("time_proj", |b| {
        blocks::timestep_features(b, timestep, c0, cfg.flip_sin_to_cos, cfg.freq_shift)
    })?;
    let t_feat = nn::to(b, t_feat, dtype)?;
    let temb_be = blocks::timestep_embedding(b, "time_embedding", t_feat, cfg.time_embed_dim)?;
    let resnet =
        ResnetSpec { groups: cfg.norm_num_groups, eps: cfg.norm_eps, output_scale_factor: 1.0 };
    let cx = Ctx {
        groups: cfg.norm_num_groups,
        layers: cfg.transformer_layers_per_block,
        linear_projection: cfg.use_linear_projection,
    };

    let mut x = sample;
    if cfg.center_input_sample {
        x = b.scale(x, 2.0)?;
        let one = b.scalar_like(1.0, x)?;
        x = b.sub(x, one)?;
    }
    let mut x = blocks::conv2d(b, "conv_in", x, c0, 3, 1, 1)?;
    let mut skips = vec![x];
    let n = cfg.block_out_channels.len();
    let mut block = 0u32;
    for (i, kind) in cfg.down_block_types.iter().enumerate() {
        let out = cfg.block_out_channels[i];
        b.push_scope(format!("down_blocks.{i}"));
        for l in 0..cfg.layers_per_block {
            b.set_block(Some(block));
            block += 1;
            x = blocks::resnet_block(b, &format!("resnets.{l}"), x, out, Some(temb_be), resnet)?;
            if *kind == DownBlock::CrossAttn {
                let spec = cx.transformer(out, cfg.heads[i]);
                x = blocks::transformer_2d(b, &format!("attentions.{l}"), x, context_btd, spec)?;
            }
            skips.push(x);
        }
        if i + 1 < n {
            x = blocks::downsample(b, "downsamplers.0", x, cfg.downsample_padding)?;
            skips.push(x);
        }
        b.pop_scope();
    }

    b.set_block(Some(block));
    block += 1;
    b.push_scope("mid_block");
    let mid = cfg.block_out_channels[n - 1];
    let mid_resnet = ResnetSpec { output_scale_factor: cfg.mid_block_scale_factor, ..resnet };
    x = blocks::resnet_block(b, "resnets.0", x, mid, Some(temb_be), mid_resnet)?;
    let spec = cx.transformer(mid, cfg.heads[n - 1]);
    x = blocks::transformer_2d(b, "attentions.0", x, context_btd, spec)?;
    x = blocks::resnet_block(b, "resnets.1", x, mid, Some(temb_be), mid_resnet)?;
    b.pop_scope();

    for (i, kind) in cfg.up_block_types.iter().enumerate() {
        let out = cfg.block_out_channels[n - 1 - i];
        let heads = cfg.heads[n - 1 - i];
        b.push_scope(format!("up_blocks.{i}"));
        for l in 0..=cfg.layers_per_block {
            b.set_block(Some(block));
            block += 1;
            let skip = skips.pop().ok_or_else(|| {
                tessera_ir::IrError::Graph(
                    "the up path reads more skips than the down path made".into(),
                )
            })?;
            x = b.concat(&[x, skip], 1)?;
            x = blocks::resnet_block(b, &format!("resnets.{l}"), x, out, Some(temb_be), resnet)?;
            if *kind == UpBlock::CrossAttn {
                let spec = cx.transformer(out, heads);
                x = blocks::transformer_2d(b, &format!("attentions.{l}"), x, context_btd, spec)?;
            }
        }
        if i + 1 < n {
            x = blocks::upsample(b, "upsamplers.0", x)?;
        }
        b.pop_scope();
    }
    b.set_block(None);

    let x = blocks::group_norm(b, "conv_norm_out", x, cfg.norm_num_groups, cfg.norm_eps)?;
    let x = b.unary(tessera_ir::UnaryOp::Silu, x)?;
    blocks::conv2d(b, "conv_out", x, cfg.out_channels, 3, 1, 1)
}
