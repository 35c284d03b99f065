//! BLOOM language model (`BloomForCausalLM`).
//!
//! Paper: BigScience Workshop 2022, "BLOOM: A 176B-Parameter Open-Access Multilingual Language
//! Model"; positions are ALiBi (Press et al. 2022, "Train Short, Test Long: Attention with
//! Linear Biases Enables Input Length Extrapolation"), and the embedding LayerNorm comes from
//! bitsandbytes' StableEmbedding (Dettmers et al. 2022). Reference implementation: Hugging
//! Face `transformers`, `src/transformers/models/bloom/modeling_bloom.py` (4.46).
//!
//! ```text
//! x_bsd = word_embeddings_layernorm(word_embeddings[input_ids])   # no position embeddings
//! for each layer:  qkv = query_key_value(input_layernorm x)         # [B,S,H·3·E], per head
//!                  q, k, v = qkv.view(B, S, H, 3, E)[..., 0|1|2, :]
//!                  x += drop(dense(attn(q, k, v)))     # causal + ALiBi, scale 1/sqrt(E)
//!                  x += drop(dense_4h_to_h(gelu_tanh(dense_h_to_4h(post_attention_layernorm x))))
//! logits_bsv = ln_f(x) · word_embeddingsᵀ                           # tied lm_head
//! ```
//! `nn.Linear` weights are `[out, in]`, every linear has a bias. `query_key_value`'s output
//! interleaves the heads: head h's query, key and value are its columns
//! `3·E·h .. 3·E·h + E`, the next E, and the E after (so a column split of the weight keeps
//! whole heads). ALiBi adds `slope_h · (j − i)` to the score of key j for query i
//! ([`tessera_ir::Alibi`]; HF adds `slope_h · j`, the same after softmax), not scaled by
//! 1/sqrt(E). The residuals are the LayerNorms' inputs
//! (`apply_residual_connection_post_layernorm = false`, the only setting supported).
//! The MLP's `bloom_gelu_forward` is the tanh GELU ([`UnaryOp::GeluTanh`]; HF truncates
//! sqrt(2/π) to 0.79788456, 6e-11 relative). `hidden_dropout` is applied before each residual
//! add (HF's `dropout_add`), each call site its own RNG stream; `attention_dropout` is not
//! (fused attention).
//!
//! Shape suffixes: `b` batch, `s` sequence, `d` hidden, `h` heads, `e` head dim, `i` MLP width
//! (4d), `v` vocabulary.
//!
//! FLOPs (2·m·n·k per matmul; attention as dense S×S products): forward per token =
//! L·(6d² + 2d² + 16d² + 4·S·d) + 2·d·v, i.e. 24d² + 4Sd per layer as GPT-2 at i = 4d;
//! a training step is 3× the forward: bloom-560m at B=1, S=1024 is 3,743,063,998,464
//! (tested). ALiBi's bias is one add per score ("other").

use crate::config::BloomConfig;
use crate::error::Result;
use crate::nn::{self, Decoder, Dropout, Inputs, IrResult};
use crate::{BuildOptions, Built, GenerateOptions};
use tessera_ir::{Alibi, AttentionSpec, Builder, DType, TensorId, UnaryOp};

/// The training step's graph, or with `generate` one generation step over a KV cache (ALiBi
/// biases at the cache positions, logits at `last_index`).
pub(crate) fn build(
    cfg: &BloomConfig,
    opts: &BuildOptions,
    generate: Option<&GenerateOptions>,
) -> Result<Built> {
    let dtype = opts.dtype;
    let (v, d) = (cfg.vocab_size, cfg.hidden_size);
    let mut b = Builder::new();
    let mut inputs = Inputs::new();
    let (mut dec, ids) = Decoder::start(&mut b, &mut inputs, opts, generate, v);
    let p = if generate.is_some() { 0.0 } else { cfg.hidden_dropout };
    let mut drop = inputs.dropout(&mut b, &[p]);

    b.push_scope("transformer");
    let wte_vd = b.scoped("word_embeddings", |b| b.parameter("weight", [v, d], dtype));
    let tok_bsd = b.scoped("word_embeddings", |b| b.embedding(wte_vd, ids))?;
    let tok_bsd = nn::to(&mut b, tok_bsd, nn::RESIDUAL_DTYPE)?;
    // The normed embeddings are the residual stream (layer 0's residual too), kept in f32.
    // Its weights in f32, as every norm's on the f32 stream (autocast's policy).
    let mut x_bsd =
        nn::layer_norm(&mut b, "word_embeddings_layernorm", tok_bsd, cfg.layer_norm_epsilon)?;
    x_bsd = nn::to(&mut b, x_bsd, nn::RESIDUAL_DTYPE)?;
    for layer in 0..cfg.n_layer {
        b.set_block(Some(layer as u32));
        b.push_scope(format!("h.{layer}"));
        x_bsd = block(&mut b, cfg, &mut dec, &mut drop, x_bsd, dtype, p)?;
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

/// One `BloomBlock` (pre-LN, residuals before the norms), inside scope `transformer.h.{layer}`;
/// `p` is `hidden_dropout`.
fn block(
    b: &mut Builder,
    cfg: &BloomConfig,
    dec: &mut Decoder,
    drop: &mut Dropout,
    x_bsd: TensorId,
    dtype: DType,
    p: f64,
) -> IrResult<TensorId> {
    let (d, h, e) = (cfg.hidden_size, cfg.n_head, cfg.head_dim());
    let eps = cfg.layer_norm_epsilon;

    let n_bsd = nn::layer_norm_to(b, "input_layernorm", x_bsd, eps, dtype)?;
    let a_bsd = b.scoped("self_attention", |b| {
        let qkv_bs_h3e = dec.linear(b, "query_key_value", n_bsd, 3 * d, true)?;
        // view(B, S, H, 3·E): each head's q, k, v are consecutive E-wide slices.
        let qkv_bsh3e = nn::split_heads(b, qkv_bs_h3e, h)?;
        let q_bshe = b.slice(qkv_bsh3e, 3, 0, e)?;
        let k_bshe = b.slice(qkv_bsh3e, 3, e, 2 * e)?;
        let v_bshe = b.slice(qkv_bsh3e, 3, 2 * e, 3 * e)?;
        let spec = AttentionSpec {
            alibi: Some(Alibi { heads: h, shard: None }),
            ..AttentionSpec::causal(e)
        };
        let o_bshe = dec.attention(b, q_bshe, k_bshe, v_bshe, spec)?;
        let o_bsd = nn::merge_heads(b, o_bshe)?;
        let o_bsd = dec.linear(b, "dense", o_bsd, d, true)?;
        drop.apply(b, "hidden_dropout", o_bsd, p)
    })?;
    let a_bsd = nn::to(b, a_bsd, nn::RESIDUAL_DTYPE)?;
    let x_bsd = b.add(x_bsd, a_bsd)?;

    let n_bsd = nn::layer_norm_to(b, "post_attention_layernorm", x_bsd, eps, dtype)?;
    let m_bsd = b.scoped("mlp", |b| {
        let u_bsi = dec.linear(b, "dense_h_to_4h", n_bsd, cfg.mlp_width(), true)?;
        let u_bsi = b.unary(UnaryOp::GeluTanh, u_bsi)?;
        let m_bsd = dec.linear(b, "dense_4h_to_h", u_bsi, d, true)?;
        drop.apply(b, "hidden_dropout", m_bsd, p)
    })?;
    let m_bsd = nn::to(b, m_bsd, nn::RESIDUAL_DTYPE)?;
    b.add(x_bsd, m_bsd)
}
