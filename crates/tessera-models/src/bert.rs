//! BERT with its masked-language-model head (`BertForMaskedLM`, no pooler).
//!
//! Paper: Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers for
//! Language Understanding". Reference implementation: Hugging Face `transformers`,
//! `models/bert/modeling_bert.py`.
//!
//! ```text
//! x_bsd = LayerNorm(word[input_ids] + token_type[token_type_ids] + position[0:S]), dropout
//! for each layer (post-LN):
//!     a = attention.output.LayerNorm(x + drop(attention.output.dense(attn(q, k, v))))
//!     x = output.LayerNorm(a + drop(output.dense(gelu(intermediate.dense a))))
//! logits_bsv = transform(x) · wordᵀ + cls.predictions.bias    # decoder tied to word
//! ```
//! Attention is bidirectional (no causal mask); padding masks are not modelled (every
//! position attends to every other). Labels use −100 for positions without a target, as in
//! HF; the loss is the mean over the step's targets, as the sum of cross-entropies divided by
//! the input `num_targets` (their count over the whole step). `attention_probs_dropout_prob` is not applied (fused attention).
//!
//! Shape suffixes: `b` batch, `s` sequence, `d` hidden, `h` heads, `e` head dim, `i`
//! intermediate, `v` vocabulary.
//!
//! FLOPs (2·m·n·k per matmul; attention as dense S×S products): forward per token =
//! L·(8d² + 4d·i + 4·S·d) + 2d² (transform) + 2·d·v (decoder); training 3× that.

use crate::config::BertConfig;
use crate::error::Result;
use crate::nn::{self, Dropout, Inputs, IrResult};
use crate::{BuildOptions, ForwardModel, InputKind};
use tessera_ir::{AttentionSpec, Builder, DType, TensorId};

pub(crate) fn build(cfg: &BertConfig, opts: &BuildOptions) -> Result<ForwardModel> {
    let (batch, seq, dtype) = (opts.batch, opts.seq, opts.dtype);
    let (v, d) = (cfg.vocab_size, cfg.hidden_size);
    let p = cfg.hidden_dropout_prob;
    let mut b = Builder::new();
    let mut inputs = Inputs::new();
    let ids = inputs.add(
        &mut b,
        "input_ids",
        [batch, seq],
        DType::I64,
        InputKind::TokenIds { vocab_size: v },
    );
    let types = inputs.add(
        &mut b,
        "token_type_ids",
        [batch, seq],
        DType::I64,
        InputKind::TokenTypeIds { type_vocab_size: cfg.type_vocab_size },
    );
    let (labels, num_targets) = inputs.counted_targets(&mut b, batch, seq, v);
    let mut drop = inputs.dropout(&mut b, &[p]);

    b.push_scope("bert");
    b.push_scope("embeddings");
    let word_vd = b.scoped("word_embeddings", |b| b.parameter("weight", [v, d], dtype));
    let pos_pd = b.scoped("position_embeddings", |b| {
        b.parameter("weight", [cfg.max_position_embeddings, d], dtype)
    });
    let type_td = b.scoped("token_type_embeddings", |b| {
        b.parameter("weight", [cfg.type_vocab_size, d], dtype)
    });
    let word_bsd = b.scoped("word_embeddings", |b| b.embedding(word_vd, ids))?;
    let type_bsd = b.scoped("token_type_embeddings", |b| b.embedding(type_td, types))?;
    let pos_sd = b.scoped("position_embeddings", |b| b.slice(pos_pd, 0, 0, seq))?;
    let x_bsd = b.add(word_bsd, type_bsd)?;
    let x_bsd = b.add(x_bsd, pos_sd)?;
    let x_bsd = nn::layer_norm(&mut b, "LayerNorm", x_bsd, cfg.layer_norm_eps)?;
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
    b.pop_scope();

    b.push_scope("cls");
    b.push_scope("predictions");
    let t_bsd = b.scoped("transform", |b| {
        let t_bsd = nn::linear(b, "dense", x_bsd, d, true)?;
        let t_bsd = b.unary(cfg.hidden_act.unary_op(), t_bsd)?;
        nn::layer_norm(b, "LayerNorm", t_bsd, cfg.layer_norm_eps)
    })?;
    let bias_v = b.parameter("bias", [v], dtype);
    let logits_bsv = if cfg.tie_word_embeddings {
        b.scoped("decoder", |b| b.matmul(t_bsd, word_vd, false, true))?
    } else {
        nn::linear(&mut b, "decoder", t_bsd, v, false)?
    };
    let logits_bsv = b.scoped("decoder", |b| b.add(logits_bsv, bias_v))?;
    b.pop_scope();
    b.pop_scope();

    // The mean over the step's masked positions.
    let loss = nn::mean_over_targets(&mut b, logits_bsv, labels, num_targets)?;
    Ok(ForwardModel { builder: b, loss, logits: logits_bsv, batch, seq, inputs: inputs.list })
}

/// One `BertLayer`, inside scope `bert.encoder.layer.{i}`.
fn encoder_layer(
    b: &mut Builder,
    cfg: &BertConfig,
    drop: &mut Dropout,
    x_bsd: TensorId,
) -> IrResult<TensorId> {
    let (d, p, eps) = (cfg.hidden_size, cfg.hidden_dropout_prob, cfg.layer_norm_eps);
    let a_bsd = b.scoped("attention", |b| {
        let o_bsd = b.scoped("self", |b| {
            self_attention(b, x_bsd, cfg.num_attention_heads, cfg.head_dim(), true, false)
        })?;
        b.scoped("output", |b| {
            let o_bsd = nn::linear(b, "dense", o_bsd, d, true)?;
            let o_bsd = drop.apply(b, "dropout", o_bsd, p)?;
            let r_bsd = b.add(o_bsd, x_bsd)?;
            nn::layer_norm(b, "LayerNorm", r_bsd, eps)
        })
    })?;
    let u_bsi = b.scoped("intermediate", |b| {
        let u_bsi = nn::linear(b, "dense", a_bsd, cfg.intermediate_size, true)?;
        b.unary(cfg.hidden_act.unary_op(), u_bsi)
    })?;
    b.scoped("output", |b| {
        let o_bsd = nn::linear(b, "dense", u_bsi, d, true)?;
        let o_bsd = drop.apply(b, "dropout", o_bsd, p)?;
        let r_bsd = b.add(o_bsd, a_bsd)?;
        nn::layer_norm(b, "LayerNorm", r_bsd, eps)
    })
}

/// BERT/ViT self-attention: `query`/`key`/`value` linears, fused attention with scale
/// 1/sqrt(head_dim), heads merged back; in the caller's scope.
pub(crate) fn self_attention(
    b: &mut Builder,
    x_bsd: TensorId,
    heads: usize,
    head_dim: usize,
    bias: bool,
    causal: bool,
) -> IrResult<TensorId> {
    self_attention_with(b, x_bsd, heads, head_dim, ["query", "key", "value"], bias, causal)
}

/// [`self_attention`] with biased projections named `names` (q, k, v): CLIP's `q_proj`, ...
pub(crate) fn self_attention_named(
    b: &mut Builder,
    x_bsd: TensorId,
    heads: usize,
    head_dim: usize,
    names: [&str; 3],
    causal: bool,
) -> IrResult<TensorId> {
    self_attention_with(b, x_bsd, heads, head_dim, names, true, causal)
}

fn self_attention_with(
    b: &mut Builder,
    x_bsd: TensorId,
    heads: usize,
    head_dim: usize,
    [q, k, v]: [&str; 3],
    bias: bool,
    causal: bool,
) -> IrResult<TensorId> {
    let width = heads * head_dim;
    let q_bsd = nn::linear(b, q, x_bsd, width, bias)?;
    let k_bsd = nn::linear(b, k, x_bsd, width, bias)?;
    let v_bsd = nn::linear(b, v, x_bsd, width, bias)?;
    let q_bshe = nn::split_heads(b, q_bsd, heads)?;
    let k_bshe = nn::split_heads(b, k_bsd, heads)?;
    let v_bshe = nn::split_heads(b, v_bsd, heads)?;
    let spec = AttentionSpec { causal, ..AttentionSpec::causal(head_dim) };
    let o_bshe = b.attention(q_bshe, k_bshe, v_bshe, spec)?;
    nn::merge_heads(b, o_bshe)
}
