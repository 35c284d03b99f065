//! GPT-2 language model (`GPT2LMHeadModel`).
//!
//! Paper: Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"; the
//! architecture is GPT-1's (Radford et al. 2018) with pre-LayerNorm blocks and a final
//! LayerNorm. Reference implementation: Hugging Face `transformers`,
//! `src/transformers/models/gpt2/modeling_gpt2.py` (and nanoGPT's `model.py`).
//!
//! ```text
//! x_bsd = drop(wte[input_ids] + wpe[0:S])
//! for each layer:  x += drop(c_proj(attn(c_attn(ln_1 x))))      # causal, scale 1/sqrt(e)
//!                  x += drop(mlp.c_proj(gelu_new(c_fc(ln_2 x))))
//! logits_bsv = ln_f(x) · wteᵀ                                    # tied lm_head
//! ```
//! `Conv1D` weights are `[in, out]` (y = x·W + b), unlike `nn.Linear`. `attn_pdrop` is not
//! applied (fused attention); `embd_pdrop` and `resid_pdrop` are, each call site its own RNG
//! stream.
//!
//! Shape suffixes: `b` batch, `s` sequence, `d` n_embd, `h` heads, `e` head dim, `i` n_inner,
//! `v` vocabulary.
//!
//! FLOPs (2·m·n·k per matmul; attention's QKᵀ and AV as dense S×S products, no causal
//! discount): forward per token = L·(6d² + 2d² + 4d·i + 4·S·d) + 2·d·v, i.e. 24d² + 4Sd per
//! layer at i = 4d; a training step is 3× the forward (every matmul has a dX and a dW
//! product). gpt2 at B=1, S=1024: 874,944,921,600 (tested). nanoGPT's MFU estimate,
//! 6N + 12·L·h·e·S per token, approximates this with N = all parameters but `wpe` (its 6N
//! also counts biases and norms as if they were matmul weights).

use crate::config::Gpt2Config;
use crate::error::Result;
use crate::nn::{self, Decoder, Dropout, Inputs, IrResult};
use crate::{BuildOptions, Built, GenerateOptions};
use tessera_ir::{AttentionSpec, Builder, DType, TensorId};

/// The training step's graph, or with `generate` one generation step over a KV cache (learned
/// positions looked up at `position_ids`, logits at `last_index`).
pub(crate) fn build(
    cfg: &Gpt2Config,
    opts: &BuildOptions,
    generate: Option<&GenerateOptions>,
) -> Result<Built> {
    let (seq, dtype) = (opts.seq, opts.dtype);
    let (v, d) = (cfg.vocab_size, cfg.n_embd);
    let mut b = Builder::new();
    let mut inputs = Inputs::new();
    let (mut dec, ids) = Decoder::start(&mut b, &mut inputs, opts, generate, v);
    let probs = match generate {
        Some(_) => [0.0, 0.0],
        None => [cfg.embd_pdrop, cfg.resid_pdrop],
    };
    let mut drop = inputs.dropout(&mut b, &probs);

    b.push_scope("transformer");
    let wte_vd = b.scoped("wte", |b| b.parameter("weight", [v, d], dtype));
    let wpe_pd = b.scoped("wpe", |b| b.parameter("weight", [cfg.n_positions, d], dtype));
    let tok_bsd = b.scoped("wte", |b| b.embedding(wte_vd, ids))?;
    let pos_sd = match dec.generation() {
        Some(g) => b.scoped("wpe", |b| b.embedding(wpe_pd, g.positions))?,
        None => b.scoped("wpe", |b| b.slice(wpe_pd, 0, 0, seq))?,
    };
    let tok_bsd = nn::to(&mut b, tok_bsd, nn::RESIDUAL_DTYPE)?;
    let pos_sd = nn::to(&mut b, pos_sd, nn::RESIDUAL_DTYPE)?;
    let mut x_bsd = b.add(tok_bsd, pos_sd)?;
    x_bsd = drop.apply(&mut b, "drop", x_bsd, probs[0])?;
    for layer in 0..cfg.n_layer {
        b.set_block(Some(layer as u32));
        b.push_scope(format!("h.{layer}"));
        x_bsd = block(&mut b, cfg, layer, &mut dec, &mut drop, x_bsd, dtype, probs[1])?;
        b.pop_scope();
    }
    b.set_block(None);
    let x_bsd = dec.head_rows(&mut b, x_bsd)?;
    let x_bsd = nn::layer_norm_to(&mut b, "ln_f", x_bsd, cfg.layer_norm_epsilon, dtype)?;
    b.pop_scope();

    let tied = cfg.tie_word_embeddings.then_some(wte_vd);
    let logits_bsv = nn::lm_head(&mut b, x_bsd, tied, v)?;
    Ok(dec.finish(b, inputs, logits_bsv)?)
}

/// One `GPT2Block` (pre-LN), inside scope `transformer.h.{layer}`; `p` is the residual
/// dropout.
#[allow(clippy::too_many_arguments)]
fn block(
    b: &mut Builder,
    cfg: &Gpt2Config,
    layer: usize,
    dec: &mut Decoder,
    drop: &mut Dropout,
    x_bsd: TensorId,
    dtype: DType,
    p: f64,
) -> IrResult<TensorId> {
    let d = cfg.n_embd;
    let eps = cfg.layer_norm_epsilon;

    let h_bsd = nn::layer_norm_to(b, "ln_1", x_bsd, eps, dtype)?;
    let a_bsd = b.scoped("attn", |b| {
        let qkv_bs3d = dec.conv1d(b, "c_attn", h_bsd, 3 * d)?;
        let q_bsd = b.slice(qkv_bs3d, 2, 0, d)?;
        let k_bsd = b.slice(qkv_bs3d, 2, d, 2 * d)?;
        let v_bsd = b.slice(qkv_bs3d, 2, 2 * d, 3 * d)?;
        let q_bshe = nn::split_heads(b, q_bsd, cfg.n_head)?;
        let k_bshe = nn::split_heads(b, k_bsd, cfg.n_head)?;
        let v_bshe = nn::split_heads(b, v_bsd, cfg.n_head)?;
        let mut scale =
            if cfg.scale_attn_weights { 1.0 / (cfg.head_dim() as f64).sqrt() } else { 1.0 };
        if cfg.scale_attn_by_inverse_layer_idx {
            scale /= (layer + 1) as f64;
        }
        let spec = AttentionSpec { scale, ..AttentionSpec::causal(cfg.head_dim()) };
        let o_bshe = dec.attention(b, q_bshe, k_bshe, v_bshe, spec)?;
        let o_bsd = nn::merge_heads(b, o_bshe)?;
        let o_bsd = dec.conv1d(b, "c_proj", o_bsd, d)?;
        drop.apply(b, "resid_dropout", o_bsd, p)
    })?;
    let a_bsd = nn::to(b, a_bsd, nn::RESIDUAL_DTYPE)?;
    let x_bsd = b.add(x_bsd, a_bsd)?;

    let h_bsd = nn::layer_norm_to(b, "ln_2", x_bsd, eps, dtype)?;
    let m_bsd = b.scoped("mlp", |b| {
        let u_bsi = dec.conv1d(b, "c_fc", h_bsd, cfg.n_inner)?;
        let u_bsi = b.unary(cfg.activation_function.unary_op(), u_bsi)?;
        let m_bsd = dec.conv1d(b, "c_proj", u_bsi, d)?;
        drop.apply(b, "dropout", m_bsd, p)
    })?;
    let m_bsd = nn::to(b, m_bsd, nn::RESIDUAL_DTYPE)?;
    b.add(x_bsd, m_bsd)
}
