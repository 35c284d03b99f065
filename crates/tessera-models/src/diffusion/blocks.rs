//! Reusable diffusers building blocks on NCHW tensors, each under its diffusers module name so
//! its parameters carry the checkpoint's names (`<scope>.conv1.weight`, `<scope>.to_q.weight`).
//!
//! Reference: diffusers `models/resnet.py` (`ResnetBlock2D`), `models/downsampling.py`,
//! `models/upsampling.py`, `models/embeddings.py` (`get_timestep_embedding`,
//! `TimestepEmbedding`), `models/transformers/transformer_2d.py` and
//! `models/attention.py` (`BasicTransformerBlock`, `FeedForward` with GEGLU),
//! `models/attention_processor.py` (`Attention`).
//!
//! ```text
//! ResnetBlock2D:  h = conv1(silu(norm1 x)) (+ time_emb_proj(silu temb)[:, :, None, None])
//!                 h = conv2(silu(norm2 h));  out = (shortcut(x) + h) / output_scale_factor
//! Transformer2DModel: r = x; x = norm x; proj_in (1×1 conv, or linear after flattening)
//!                 → [B, H·W, C] → BasicTransformerBlock × layers → proj_out → + r
//! BasicTransformerBlock: x += attn1(norm1 x); x += attn2(norm2 x, context); x += ff(norm3 x)
//! ```
//! Convolutions are the IR's bias-free `Conv2d` plus a `[C, 1, 1]` broadcast bias; attention is
//! the fused op, bidirectional, scaled by `1/sqrt(head_dim)`, its keys the text states' tokens
//! in cross-attention (a key length other than the query's).
//!
//! Shape suffixes: `b` batch, `c` channels, `h`/`w` spatial, `s` = h·w positions, `t` text
//! tokens, `e` time-embedding width.

use crate::nn::{self, IrResult};
use tessera_ir::{AttentionSpec, BinaryOp, Builder, Conv2dSpec, DType, TensorId, UnaryOp};

/// `[N, C, H, W]` of a 4-D tensor.
fn dims4(b: &Builder, x: TensorId) -> [usize; 4] {
    let d = b.shape(x).dims();
    [d[0], d[1], d[2], d[3]]
}

/// `nn.Conv2d(C, out, kernel, stride, padding, bias)` named `name` on `x [N,C,H,W]`.
pub(crate) fn conv2d(
    b: &mut Builder,
    name: &str,
    x: TensorId,
    out: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
) -> IrResult<TensorId> {
    let ([_, c, _, _], dtype) = (dims4(b, x), b.dtype(x));
    b.scoped(name, |b| {
        let w = b.parameter("weight", [out, c, kernel, kernel], dtype);
        let spec = Conv2dSpec {
            stride: [stride, stride],
            padding: [padding, padding],
            ..Conv2dSpec::default()
        };
        let y = b.conv2d(x, w, spec)?;
        let bias = b.parameter("bias", [out], dtype);
        let bias_c11 = b.reshape(bias, [out, 1, 1])?;
        b.add(y, bias_c11)
    })
}

/// `nn.GroupNorm(groups, C, eps)` named `name` on `x [N,C,..]`.
pub(crate) fn group_norm(
    b: &mut Builder,
    name: &str,
    x: TensorId,
    groups: usize,
    eps: f64,
) -> IrResult<TensorId> {
    let (c, dtype) = (b.shape(x).dims()[1], b.dtype(x));
    b.scoped(name, |b| {
        let w = b.parameter("weight", [c], dtype);
        let bias = b.parameter("bias", [c], dtype);
        b.group_norm(x, w, bias, groups, eps)
    })
}

/// The settings of a `ResnetBlock2D` (diffusers' `resnet_groups`, `resnet_eps`,
/// `output_scale_factor`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ResnetSpec {
    pub(crate) groups: usize,
    pub(crate) eps: f64,
    pub(crate) output_scale_factor: f64,
}

/// `ResnetBlock2D` named `name`: `x [N,C,H,W]` → `[N,out,H,W]`. With `temb [N, E]` it has
/// the `time_emb_proj` linear (the UNet's); without (the VAE's `temb_channels=None`) none.
/// The 1×1 `conv_shortcut` exists when the channel count changes.
pub(crate) fn resnet_block(
    b: &mut Builder,
    name: &str,
    x_bchw: TensorId,
    out: usize,
    temb_be: Option<TensorId>,
    spec: ResnetSpec,
) -> IrResult<TensorId> {
    let c = dims4(b, x_bchw)[1];
    b.scoped(name, |b| {
        let h = group_norm(b, "norm1", x_bchw, spec.groups, spec.eps)?;
        let h = b.unary(UnaryOp::Silu, h)?;
        let mut h = conv2d(b, "conv1", h, out, 3, 1, 1)?;
        if let Some(temb_be) = temb_be {
            let n = b.shape(temb_be).dims()[0];
            let t = b.unary(UnaryOp::Silu, temb_be)?;
            let t_bo = nn::linear(b, "time_emb_proj", t, out, true)?;
            let t_bo11 = b.reshape(t_bo, [n, out, 1, 1])?;
            h = b.add(h, t_bo11)?;
        }
        let h = group_norm(b, "norm2", h, spec.groups, spec.eps)?;
        let h = b.unary(UnaryOp::Silu, h)?;
        let h = conv2d(b, "conv2", h, out, 3, 1, 1)?;
        let shortcut =
            if c != out { conv2d(b, "conv_shortcut", x_bchw, out, 1, 1, 0)? } else { x_bchw };
        let y = b.add(shortcut, h)?;
        if spec.output_scale_factor == 1.0 {
            Ok(y)
        } else {
            b.scale(y, 1.0 / spec.output_scale_factor)
        }
    })
}

/// `Downsample2D(use_conv=True)` named `name`: a stride-2 3×3 `conv` with `padding`.
pub(crate) fn downsample(
    b: &mut Builder,
    name: &str,
    x_bchw: TensorId,
    padding: usize,
) -> IrResult<TensorId> {
    let c = dims4(b, x_bchw)[1];
    b.scoped(name, |b| conv2d(b, "conv", x_bchw, c, 3, 2, padding))
}

/// `Upsample2D(use_conv=True)` named `name`: nearest 2× upsampling, then a 3×3 `conv`.
pub(crate) fn upsample(b: &mut Builder, name: &str, x_bchw: TensorId) -> IrResult<TensorId> {
    let c = dims4(b, x_bchw)[1];
    b.scoped(name, |b| {
        let up = b.upsample_nearest2d(x_bchw, [2, 2])?;
        conv2d(b, "conv", up, c, 3, 1, 1)
    })
}

/// `0, 1, …, n−1` as an f32 `[n]` constant: `Fill`s doubled by concatenation (log₂ n steps).
fn arange(b: &mut Builder, n: usize) -> IrResult<TensorId> {
    let mut a = b.fill(0.0, [1], DType::F32)?;
    let mut len = 1;
    while len < n {
        let shifted = {
            let k = b.fill(len as f64, [1], DType::F32)?;
            b.add(a, k)?
        };
        a = b.concat(&[a, shifted], 0)?;
        len *= 2;
    }
    if len == n {
        Ok(a)
    } else {
        b.slice(a, 0, 0, n)
    }
}

/// diffusers' `get_timestep_embedding` (the `Timesteps` module, no parameters): `t [N]` f32 →
/// `[N, dim]` f32, `[sin(t·f), cos(t·f)]` (`[cos, sin]` with `flip_sin_to_cos`) where
/// `f_k = exp(−ln(10000)·k / (dim/2 − freq_shift))`, computed in f32 in the reference's order.
pub(crate) fn timestep_features(
    b: &mut Builder,
    t_n: TensorId,
    dim: usize,
    flip_sin_to_cos: bool,
    freq_shift: f64,
) -> IrResult<TensorId> {
    let n = b.shape(t_n).dims()[0];
    let half = dim / 2;
    let k = arange(b, half)?;
    let c = b.fill(-(10000f64.ln() as f32) as f64, [1], DType::F32)?;
    let exponent = b.mul(k, c)?;
    let denom = b.fill(half as f64 - freq_shift, [1], DType::F32)?;
    let exponent = b.binary(BinaryOp::Div, exponent, denom)?;
    let freq_h = b.unary(UnaryOp::Exp, exponent)?;
    let t_n1 = b.reshape(t_n, [n, 1])?;
    let arg_nh = b.mul(t_n1, freq_h)?;
    let sin = b.unary(UnaryOp::Sin, arg_nh)?;
    let cos = b.unary(UnaryOp::Cos, arg_nh)?;
    let parts = if flip_sin_to_cos { [cos, sin] } else { [sin, cos] };
    let emb = b.concat(&parts, 1)?;
    if dim % 2 == 1 {
        b.pad(emb, 1, 0, 1)
    } else {
        Ok(emb)
    }
}

/// `TimestepEmbedding` named `name`: `linear_1`, SiLU, `linear_2` (`[N, C]` → `[N, out]`).
pub(crate) fn timestep_embedding(
    b: &mut Builder,
    name: &str,
    x_nc: TensorId,
    out: usize,
) -> IrResult<TensorId> {
    b.scoped(name, |b| {
        let h = nn::linear(b, "linear_1", x_nc, out, true)?;
        let h = b.unary(UnaryOp::Silu, h)?;
        nn::linear(b, "linear_2", h, out, true)
    })
}

/// diffusers' `Attention` (no norm inside) named `name` on `x [B,S,C]`: `to_q`, `to_k`,
/// `to_v` (bias-free unless `qkv_bias`) read `context [B,T,Dc]` for keys and values when given
/// (cross-attention), `x` otherwise; `to_out.0` (with bias) maps back to `C`.
pub(crate) fn attention(
    b: &mut Builder,
    name: &str,
    x_bsc: TensorId,
    context_btd: Option<TensorId>,
    heads: usize,
    head_dim: usize,
    qkv_bias: bool,
) -> IrResult<TensorId> {
    b.scoped(name, |b| attention_in_scope(b, x_bsc, context_btd, heads, head_dim, qkv_bias))
}

/// `[B,C,H,W]` → `[B,H·W,C]`.
pub(crate) fn to_tokens(b: &mut Builder, x_bchw: TensorId) -> IrResult<TensorId> {
    let [n, c, h, w] = dims4(b, x_bchw);
    let x = b.permute(x_bchw, &[0, 2, 3, 1])?;
    b.reshape(x, [n, h * w, c])
}

/// `[B,H·W,C]` → `[B,C,H,W]`.
pub(crate) fn from_tokens(b: &mut Builder, x_bsc: TensorId, hw: [usize; 2]) -> IrResult<TensorId> {
    let d = b.shape(x_bsc).dims().to_vec();
    let x = b.reshape(x_bsc, [d[0], hw[0], hw[1], d[2]])?;
    b.permute(x, &[0, 3, 1, 2])
}

/// The VAE's (and old UNets') spatial self-attention block, diffusers' `Attention` built with
/// `norm_num_groups` and `residual_connection=True`, named `name`: `group_norm`, one head
/// of width `C` over the `H·W` positions (bias on `to_q`/`to_k`/`to_v`), `to_out.0`, plus the
/// input.
#[allow(dead_code)] // the AutoencoderKL's mid block (issue 47) builds on it
pub(crate) fn spatial_self_attention(
    b: &mut Builder,
    name: &str,
    x_bchw: TensorId,
    groups: usize,
    eps: f64,
) -> IrResult<TensorId> {
    let [_, c, h, w] = dims4(b, x_bchw);
    b.scoped(name, |b| {
        let n = group_norm(b, "group_norm", x_bchw, groups, eps)?;
        let n_bsc = to_tokens(b, n)?;
        let o_bsc = attention_in_scope(b, n_bsc, None, 1, c, true)?;
        let o = from_tokens(b, o_bsc, [h, w])?;
        b.add(o, x_bchw)
    })
}

/// [`attention`]'s body in the current scope (diffusers' VAE attention has no submodule name).
fn attention_in_scope(
    b: &mut Builder,
    x_bsc: TensorId,
    context_btd: Option<TensorId>,
    heads: usize,
    head_dim: usize,
    qkv_bias: bool,
) -> IrResult<TensorId> {
    let c = b.shape(x_bsc).last();
    let inner = heads * head_dim;
    let kv_src = context_btd.unwrap_or(x_bsc);
    let q = nn::linear(b, "to_q", x_bsc, inner, qkv_bias)?;
    let k = nn::linear(b, "to_k", kv_src, inner, qkv_bias)?;
    let v = nn::linear(b, "to_v", kv_src, inner, qkv_bias)?;
    let q = nn::split_heads(b, q, heads)?;
    let k = nn::split_heads(b, k, heads)?;
    let v = nn::split_heads(b, v, heads)?;
    let spec = AttentionSpec { causal: false, ..AttentionSpec::causal(head_dim) };
    let o = b.attention(q, k, v, spec)?;
    let o = nn::merge_heads(b, o)?;
    b.scoped("to_out", |b| nn::linear(b, "0", o, c, true))
}

/// `Transformer2DModel`'s settings (continuous input, `BasicTransformerBlock`s).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TransformerSpec {
    pub(crate) heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) layers: usize,
    /// `norm_num_groups` of its GroupNorm (eps 1e-6, as diffusers).
    pub(crate) groups: usize,
    /// `proj_in`/`proj_out` as `nn.Linear` (after flattening) rather than 1×1 convolutions.
    pub(crate) linear_projection: bool,
}

/// `Transformer2DModel` named `name` on `x [B,C,H,W]` with text states `context [B,T,Dc]`.
pub(crate) fn transformer_2d(
    b: &mut Builder,
    name: &str,
    x_bchw: TensorId,
    context_btd: TensorId,
    spec: TransformerSpec,
) -> IrResult<TensorId> {
    let [_, c, h, w] = dims4(b, x_bchw);
    let inner = spec.heads * spec.head_dim;
    b.scoped(name, |b| {
        let n = group_norm(b, "norm", x_bchw, spec.groups, 1e-6)?;
        let mut x_bsi = if spec.linear_projection {
            let t = to_tokens(b, n)?;
            nn::linear(b, "proj_in", t, inner, true)?
        } else {
            let p = conv2d(b, "proj_in", n, inner, 1, 1, 0)?;
            to_tokens(b, p)?
        };
        for l in 0..spec.layers {
            b.push_scope(format!("transformer_blocks.{l}"));
            x_bsi = basic_transformer_block(b, x_bsi, context_btd, spec)?;
            b.pop_scope();
        }
        let out = if spec.linear_projection {
            let o = nn::linear(b, "proj_out", x_bsi, c, true)?;
            from_tokens(b, o, [h, w])?
        } else {
            let o = from_tokens(b, x_bsi, [h, w])?;
            conv2d(b, "proj_out", o, c, 1, 1, 0)?
        };
        b.add(out, x_bchw)
    })
}

/// `BasicTransformerBlock` (LayerNorm eps 1e-5, GEGLU feed-forward of width 4·dim) in the
/// current scope.
fn basic_transformer_block(
    b: &mut Builder,
    x_bsi: TensorId,
    context_btd: TensorId,
    spec: TransformerSpec,
) -> IrResult<TensorId> {
    let (heads, hd) = (spec.heads, spec.head_dim);
    let dim = b.shape(x_bsi).last();
    let n = nn::layer_norm(b, "norm1", x_bsi, 1e-5)?;
    let a = attention(b, "attn1", n, None, heads, hd, false)?;
    let x = b.add(a, x_bsi)?;
    let n = nn::layer_norm(b, "norm2", x, 1e-5)?;
    let a = attention(b, "attn2", n, Some(context_btd), heads, hd, false)?;
    let x = b.add(a, x)?;
    let n = nn::layer_norm(b, "norm3", x, 1e-5)?;
    let f = b.scoped("ff.net", |b| {
        let ff = 4 * dim;
        let p = b.scoped("0", |b| nn::linear(b, "proj", n, 2 * ff, true))?;
        let hidden = b.slice(p, 2, 0, ff)?;
        let gate = b.slice(p, 2, ff, 2 * ff)?;
        let gate = b.unary(UnaryOp::Gelu, gate)?;
        let g = b.mul(hidden, gate)?;
        nn::linear(b, "2", g, dim, true)
    })?;
    b.add(f, x)
}
