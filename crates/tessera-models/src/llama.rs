//! LLaMA-family causal language models: `LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`, and the MoE ones `MixtralForCausalLM`, `Qwen3MoeForCausalLM` and
//! `DeepseekV3ForCausalLM`, whose sparse block (`moe.rs`) takes the MLP's place, whose Qwen3
//! attention RMS-normalises each query and key head before RoPE (`q_norm`, `k_norm`), and
//! whose DeepSeek-V3 attention is multi-head latent attention (`mla.rs`).
//!
//! Papers: Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models" and
//! "Llama 2"; Jiang et al. 2023, "Mistral 7B" (sliding-window attention, GQA); Qwen2 technical
//! report (Yang et al. 2024; q/k/v biases). Components: RMSNorm (Zhang & Sennrich 2019), RoPE
//! (Su et al. 2021), SwiGLU (Shazeer 2020), GQA (Ainslie et al. 2023). Reference
//! implementation: Hugging Face `transformers`, `models/llama/modeling_llama.py`,
//! `models/mistral/modeling_mistral.py`, `models/qwen2/modeling_qwen2.py`.
//!
//! ```text
//! x_bsd = embed_tokens[input_ids]
//! for each layer:  q_bshe, k_bske, v_bske = q/k/v_proj(input_layernorm x), rope on q and k
//!                  x += o_proj(attn(q, k, v))          # causal, GQA, window if configured
//!                  x += down_proj(act(gate_proj h) * up_proj h),  h = post_attention_layernorm x
//! logits_bsv = lm_head(norm x)                          # or · embed_tokensᵀ when tied
//! ```
//! `nn.Linear` weights are `[out, in]` (y = x·Wᵀ). No dropout (`attention_dropout` is 0 in
//! every released config and could not apply inside fused attention anyway).
//!
//! Shape suffixes: `b` batch, `s` sequence, `d` hidden, `h` query heads, `k` key/value heads,
//! `e` head dim, `i` intermediate, `v` vocabulary.
//!
//! FLOPs (2·m·n·k per matmul; attention as dense S×S products): forward per token =
//! L·(2d·(h·e) + 4d·(k·e) + 2(h·e)·d + 6d·i + 4·S·h·e) + 2·d·v; training 3× that. RoPE,
//! RMSNorm and SwiGLU's elementwise work is counted as "other" by the IR.

use crate::config::LlamaConfig;
use crate::error::Result;
use crate::nn::{self, Decoder, Inputs, IrResult};
use crate::{BuildOptions, Built, GenerateOptions};
use tessera_ir::{AttentionSpec, Builder, DType, TensorId};

/// The training step's graph, or with `generate` one generation step over a KV cache.
pub(crate) fn build(
    cfg: &LlamaConfig,
    opts: &BuildOptions,
    generate: Option<&GenerateOptions>,
) -> Result<Built> {
    let dtype = opts.dtype;
    let (v, d) = (cfg.vocab_size, cfg.hidden_size);
    let mut b = Builder::new();
    let mut inputs = Inputs::new();
    let (mut dec, ids) = Decoder::start(&mut b, &mut inputs, opts, generate, v);
    let inv_freq = cfg.inv_freq();
    let mut router_logits = Vec::new();
    let mut buffers = Vec::new();

    b.push_scope("model");
    let embed_vd = b.scoped("embed_tokens", |b| b.parameter("weight", [v, d], dtype));
    let x_bsd = b.scoped("embed_tokens", |b| b.embedding(embed_vd, ids))?;
    let mut x_bsd = nn::to(&mut b, x_bsd, nn::RESIDUAL_DTYPE)?;
    for layer in 0..cfg.num_hidden_layers {
        b.set_block(Some(layer as u32));
        b.push_scope(format!("layers.{layer}"));
        x_bsd = decoder_layer(
            &mut b,
            cfg,
            layer,
            &mut dec,
            &inv_freq,
            x_bsd,
            dtype,
            (&mut router_logits, &mut buffers),
        )?;
        b.pop_scope();
    }
    b.set_block(None);
    let aux = match (&cfg.moe, dec.generation()) {
        (Some(moe), None) => {
            let aux = crate::moe::aux_loss(&mut b, moe, &router_logits)?;
            match (aux, crate::moe::buffer_anchor(&mut b, &buffers)?) {
                (Some(a), Some(z)) => Some(b.add(a, z)?),
                (a, z) => a.or(z),
            }
        }
        _ => None,
    };
    let x_bsd = dec.head_rows(&mut b, x_bsd)?;
    let x_bsd = nn::rms_norm_to(&mut b, "norm", x_bsd, cfg.rms_norm_eps, dtype)?;
    b.pop_scope();

    let tied = cfg.tie_word_embeddings.then_some(embed_vd);
    let logits_bsv = nn::lm_head(&mut b, x_bsd, tied, v)?;
    Ok(dec.finish_with(b, inputs, logits_bsv, aux)?)
}

/// One decoder layer, inside scope `model.layers.{layer}`; a sparse block's router logits and
/// buffers go to `moe_out`.
#[allow(clippy::too_many_arguments)]
fn decoder_layer(
    b: &mut Builder,
    cfg: &LlamaConfig,
    layer: usize,
    dec: &mut Decoder,
    inv_freq: &[f64],
    x_bsd: TensorId,
    dtype: DType,
    moe_out: (&mut Vec<TensorId>, &mut Vec<TensorId>),
) -> IrResult<TensorId> {
    let (d, e) = (cfg.hidden_size, cfg.head_dim());
    let (h, k) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let eps = cfg.rms_norm_eps;

    let n_bsd = nn::rms_norm_to(b, "input_layernorm", x_bsd, eps, dtype)?;
    let a_bsd = b.scoped("self_attn", |b| {
        if let Some(mla) = &cfg.mla {
            return crate::mla::attention(b, cfg, mla, dec, inv_freq, n_bsd, dtype);
        }
        let q_bs_he = dec.linear(b, "q_proj", n_bsd, h * e, cfg.qkv_bias)?;
        let k_bs_ke = dec.linear(b, "k_proj", n_bsd, k * e, cfg.qkv_bias)?;
        let v_bs_ke = dec.linear(b, "v_proj", n_bsd, k * e, cfg.qkv_bias)?;
        let mut q_bshe = nn::split_heads(b, q_bs_he, h)?;
        let mut k_bske = nn::split_heads(b, k_bs_ke, k)?;
        let v_bske = nn::split_heads(b, v_bs_ke, k)?;
        if cfg.qk_norm {
            q_bshe = nn::rms_norm_to(b, "q_norm", q_bshe, eps, dtype)?;
            k_bske = nn::rms_norm_to(b, "k_norm", k_bske, eps, dtype)?;
        }
        let q_bshe = dec.rope(b, q_bshe, inv_freq)?;
        let k_bske = dec.rope(b, k_bske, inv_freq)?;
        let spec = AttentionSpec { window: cfg.window(layer), ..AttentionSpec::causal(e) };
        let o_bshe = dec.attention(b, q_bshe, k_bske, v_bske, spec)?;
        let o_bs_he = nn::merge_heads(b, o_bshe)?;
        dec.linear(b, "o_proj", o_bs_he, d, cfg.o_bias)
    })?;
    let a_bsd = nn::to(b, a_bsd, nn::RESIDUAL_DTYPE)?;
    let x_bsd = b.add(x_bsd, a_bsd)?;

    let n_bsd = nn::rms_norm_to(b, "post_attention_layernorm", x_bsd, eps, dtype)?;
    if let Some(moe) = cfg.moe.as_ref().filter(|m| m.is_sparse(layer)) {
        let m_bsd = crate::moe::sparse_block(b, cfg, moe, n_bsd, moe_out.0, moe_out.1)?;
        let m_bsd = nn::to(b, m_bsd, nn::RESIDUAL_DTYPE)?;
        return b.add(x_bsd, m_bsd);
    }
    let m_bsd = b.scoped("mlp", |b| {
        let i = cfg.intermediate_size;
        let gate_bsi = dec.linear(b, "gate_proj", n_bsd, i, cfg.mlp_bias)?;
        let gate_bsi = b.unary(cfg.hidden_act.unary_op(), gate_bsi)?;
        let up_bsi = dec.linear(b, "up_proj", n_bsd, i, cfg.mlp_bias)?;
        let g_bsi = b.mul(gate_bsi, up_bsi)?;
        dec.linear(b, "down_proj", g_bsi, d, cfg.mlp_bias)
    })?;
    let m_bsd = nn::to(b, m_bsd, nn::RESIDUAL_DTYPE)?;
    b.add(x_bsd, m_bsd)
}
