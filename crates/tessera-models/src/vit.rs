//! Vision Transformer for image classification (`ViTForImageClassification`, no pooler).
//!
//! Paper: Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words: Transformers for Image
//! Recognition at Scale". Reference implementation: Hugging Face `transformers`,
//! `models/vit/modeling_vit.py`.
//!
//! ```text
//! patches_bnd = patchify(pixel_values) · projection.weightᵀ + bias   # the stride-p conv
//! x_bsd = concat(cls_token, patches) + position_embeddings, dropout  # S = N + 1
//! for each layer (pre-LN):
//!     x += drop(attention.output.dense(attn(query/key/value(layernorm_before x))))
//!     x += drop(output.dense(gelu(intermediate.dense(layernorm_after x))))
//! logits_bl = classifier(layernorm(x)[:, 0])
//! ```
//! The patch convolution (kernel = stride = p) is written as a reshape
//! `[B,C,H/p,p,W/p,p]` → permute → `[B,N,C·p·p]` and a matmul with the conv weight viewed as
//! `[D, C·p·p]`; patches are numbered row-major as HF's `flatten(2)` does. The sequence length
//! is fixed by the image (`--seq` does not apply). Attention is bidirectional;
//! `attention_probs_dropout_prob` is not applied (fused attention).
//!
//! Shape suffixes: `b` batch, `c` channels, `n` patches, `s` = n + 1 tokens, `d` hidden, `h`
//! heads, `e` head dim, `i` intermediate, `l` labels.
//!
//! FLOPs (2·m·n·k per matmul; attention as dense S×S products): forward per image =
//! 2·N·(C·p²)·d (patch projection) + S·L·(8d² + 4d·i + 4·S·d) + 2·d·l; training 3× that.

use crate::bert::self_attention;
use crate::config::VitConfig;
use crate::error::Result;
use crate::nn::{self, Dropout, Inputs, IrResult};
use crate::{BuildOptions, ForwardModel, InputKind};
use tessera_ir::{Builder, DType, TensorId};

pub(crate) fn build(cfg: &VitConfig, opts: &BuildOptions) -> Result<ForwardModel> {
    let (batch, dtype) = (opts.batch, opts.dtype);
    let d = cfg.hidden_size;
    let c = cfg.num_channels;
    let [img_h, img_w] = cfg.image_size;
    let [ph, pw] = cfg.patch_size;
    let (rows, cols) = (img_h / ph, img_w / pw);
    let n = cfg.num_patches();
    let s = cfg.seq_len();
    let p = cfg.hidden_dropout_prob;

    let mut b = Builder::new();
    let mut inputs = Inputs::new();
    let pixels_bchw =
        inputs.add(&mut b, "pixel_values", [batch, c, img_h, img_w], dtype, InputKind::Pixels);
    let labels_b = inputs.add(
        &mut b,
        "labels",
        [batch],
        DType::I64,
        InputKind::Labels { num_classes: cfg.num_labels, ignore_index: None },
    );
    let mut drop = inputs.dropout(&mut b, &[p]);

    b.push_scope("vit");
    b.push_scope("embeddings");
    let patches_bnd = b.scoped("patch_embeddings", |b| {
        b.scoped("projection", |b| {
            let w_dcpp = b.parameter("weight", [d, c, ph, pw], dtype);
            let bias_d = b.parameter("bias", [d], dtype);
            let x = b.reshape(pixels_bchw, [batch, c, rows, ph, cols, pw])?;
            let x = b.permute(x, &[0, 2, 4, 1, 3, 5])?;
            let x_bnk = b.reshape(x, [batch, n, c * ph * pw])?;
            let w_dk = b.reshape(w_dcpp, [d, c * ph * pw])?;
            let y_bnd = b.matmul(x_bnk, w_dk, false, true)?;
            b.add(y_bnd, bias_d)
        })
    })?;
    let cls_11d = b.parameter("cls_token", [1, 1, d], dtype);
    let pos_1sd = b.parameter("position_embeddings", [1, s, d], dtype);
    let cls_b1d = b.expand(cls_11d, [batch, 1, d])?;
    let x_bsd = b.concat(&[cls_b1d, patches_bnd], 1)?;
    let x_bsd = b.add(x_bsd, pos_1sd)?;
    let mut x_bsd = drop.apply(&mut b, "dropout", x_bsd, p)?;
    b.pop_scope();

    b.push_scope("encoder");
    for layer in 0..cfg.num_hidden_layers {
        b.set_block(Some(layer as u32));
        b.push_scope(format!("layer.{layer}"));
        x_bsd = encoder_layer(&mut b, cfg, &mut drop, x_bsd)?;
        b.pop_scope();
    }
    b.set_block(None);
    b.pop_scope();
    let x_bsd = nn::layer_norm(&mut b, "layernorm", x_bsd, cfg.layer_norm_eps)?;
    b.pop_scope();

    let cls_b1d = b.slice(x_bsd, 1, 0, 1)?;
    let cls_bd = b.reshape(cls_b1d, [batch, d])?;
    let logits_bl = nn::linear(&mut b, "classifier", cls_bd, cfg.num_labels, true)?;
    let loss = b.cross_entropy(logits_bl, labels_b, None)?;
    Ok(ForwardModel { builder: b, loss, logits: logits_bl, batch, seq: s, inputs: inputs.list })
}

/// One `ViTLayer` (pre-LN), inside scope `vit.encoder.layer.{i}`.
fn encoder_layer(
    b: &mut Builder,
    cfg: &VitConfig,
    drop: &mut Dropout,
    x_bsd: TensorId,
) -> IrResult<TensorId> {
    let (d, p, eps) = (cfg.hidden_size, cfg.hidden_dropout_prob, cfg.layer_norm_eps);
    let h_bsd = nn::layer_norm(b, "layernorm_before", x_bsd, eps)?;
    let a_bsd = b.scoped("attention", |b| {
        let o_bsd = b.scoped("attention", |b| {
            self_attention(b, h_bsd, cfg.num_attention_heads, cfg.head_dim(), cfg.qkv_bias, false)
        })?;
        b.scoped("output", |b| {
            let o_bsd = nn::linear(b, "dense", o_bsd, d, true)?;
            drop.apply(b, "dropout", o_bsd, p)
        })
    })?;
    let x_bsd = b.add(x_bsd, a_bsd)?;
    let h_bsd = nn::layer_norm(b, "layernorm_after", x_bsd, eps)?;
    let u_bsi = b.scoped("intermediate", |b| {
        let u_bsi = nn::linear(b, "dense", h_bsd, cfg.intermediate_size, true)?;
        b.unary(cfg.hidden_act.unary_op(), u_bsi)
    })?;
    let o_bsd = b.scoped("output", |b| {
        let o_bsd = nn::linear(b, "dense", u_bsi, d, true)?;
        drop.apply(b, "dropout", o_bsd, p)
    })?;
    b.add(x_bsd, o_bsd)
}
