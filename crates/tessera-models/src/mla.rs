//! Multi-head latent attention (MLA), DeepSeek-V3's attention: queries through a low-rank
//! projection with its own RMSNorm, keys and values decompressed from one shared latent per
//! token, and a decoupled RoPE part of every query head that meets a single rotated key head
//! shared by all heads.
//!
//! Papers: DeepSeek-AI 2024, "DeepSeek-V2" (section 2.1, MLA) and "DeepSeek-V3 Technical
//! Report"; YaRN (Peng et al. 2023) for the long-context RoPE. Reference implementation:
//! Hugging Face `transformers`, `models/deepseek_v3/modeling_deepseek_v3.py`
//! (`DeepseekV3Attention`).
//!
//! ```text
//! q_bs(h·dq) = q_b_proj(q_a_layernorm(q_a_proj x))        # or q_proj x without q_lora_rank
//! q_nope, q_pe = split(q_bshq, [dn, dr])                  # dq = dn + dr
//! c, k_pe = split(kv_a_proj_with_mqa x, [r_kv, dr])       # the latent and the shared RoPE key
//! k_nope, v = split(kv_b_proj(kv_a_layernorm c) as [b,s,h,dn+dv], [dn, dv])
//! q_pe, k_pe = rope(q_pe), rope(k_pe)       # rope_interleave: pairs (2i, 2i+1) de-interleaved
//!                                           # first; YaRN: both × attention_factor
//! o = attn([q_nope, q_pe], [k_nope, k_pe broadcast over heads], v)
//!     scale = dq^-½ · mscale(factor, mscale_all_dim)²   (the second factor only under YaRN)
//! out = o_proj(o)
//! ```
//! The IR's attention takes one head dim for q, k and v, so v is zero-padded from `dv` to
//! `dq` (or q and k to `dv` when it is wider) and the output cut back to `dv` columns: the
//! padding's extra FLOPs and bytes are the Program's, so they are priced and measured as they
//! run. `attention_bias` puts biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` only
//! (the `qkv_bias` / `o_bias` flags of the config), as transformers does.
//!
//! Generation keeps the compressed latent KV cache: per layer and position the normalised
//! latent and the rotated shared key (`kv_lora_rank + qk_rope_head_dim` values instead of
//! `2 · h · head_dim`), decompressed through `kv_b_proj` at every step (no weight absorption).

use crate::config::{positive, LlamaConfig, MAX_HEAD_DIM};
use crate::error::{ModelError, Result};
use crate::nn::{self, Decoder, IrResult};
use serde::Serialize;
use tessera_ir::{AttentionSpec, Builder, DType, TensorId};

/// Upper bound on `q_lora_rank` and `kv_lora_rank` (keeps their sums far from overflow).
pub const MAX_LORA_RANK: usize = 1 << 20;

/// ε of `q_a_layernorm` and `kv_a_layernorm` (`DeepseekV3RMSNorm`'s default).
pub const LATENT_NORM_EPS: f64 = 1e-6;

/// The MLA fields of `DeepseekV3Config` (HF names).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MlaParams {
    /// Rank of the query projection; `None`: one dense `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    /// Per-head query/key dims without and with RoPE.
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The RoPE dims come in interleaved pairs `(x0, x1), (x2, x3), …` (HF default true).
    pub rope_interleave: bool,
}

impl MlaParams {
    /// `DeepseekV3Config`'s defaults.
    pub fn deepseek_v3() -> MlaParams {
        MlaParams {
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            rope_interleave: true,
        }
    }

    /// The query/key head dim, `qk_nope_head_dim + qk_rope_head_dim` (saturating: validation
    /// bounds both).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim.saturating_add(self.qk_rope_head_dim)
    }

    pub(crate) fn validate(&self, heads: usize, kv_heads: usize) -> Result<()> {
        if let Some(r) = self.q_lora_rank {
            positive("q_lora_rank", r)?;
        }
        positive("kv_lora_rank", self.kv_lora_rank)?;
        positive("qk_rope_head_dim", self.qk_rope_head_dim)?;
        positive("v_head_dim", self.v_head_dim)?;
        for (field, v) in [
            ("qk_nope_head_dim + qk_rope_head_dim", self.qk_head_dim()),
            ("v_head_dim", self.v_head_dim),
        ] {
            if v > MAX_HEAD_DIM {
                return Err(ModelError::invalid(
                    field,
                    format!("{v} exceeds {MAX_HEAD_DIM} (DeepSeek-V3 uses 192 and 128)"),
                ));
            }
        }
        if self.kv_lora_rank > MAX_LORA_RANK || self.q_lora_rank.is_some_and(|r| r > MAX_LORA_RANK)
        {
            return Err(ModelError::invalid(
                "kv_lora_rank",
                format!(
                    "q_lora_rank {:?} / kv_lora_rank {}: at most {MAX_LORA_RANK} (DeepSeek-V3 uses \
                     1536 and 512)",
                    self.q_lora_rank, self.kv_lora_rank
                ),
            ));
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(ModelError::invalid(
                "qk_rope_head_dim",
                format!("RoPE rotates pairs of dims, so {} must be even", self.qk_rope_head_dim),
            ));
        }
        // kv_b_proj makes one key head per query head; transformers' repeat_kv would
        // otherwise multiply them again.
        if kv_heads != heads {
            return Err(ModelError::invalid(
                "num_key_value_heads",
                format!(
                    "{kv_heads}: multi-head latent attention makes one key/value head per query \
                     head, so it must equal num_attention_heads {heads} (as in every released \
                     DeepSeek config)"
                ),
            ));
        }
        Ok(())
    }

    /// Parameters of one attention block (`bias`: on `q_a_proj` and `kv_a_proj_with_mqa`;
    /// `o_bias`: on `o_proj`).
    pub(crate) fn count(
        &self,
        hidden: usize,
        heads: usize,
        bias: bool,
        o_bias: bool,
    ) -> Option<u128> {
        let d = hidden;
        let (dq, dr, dn, dv) =
            (self.qk_head_dim(), self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim);
        let r = self.kv_lora_rank;
        let b = usize::from(bias);
        let q = match self.q_lora_rank {
            Some(rq) => crate::config::count(&[&[d, rq], &[b, rq], &[rq], &[rq, heads, dq]])?,
            None => crate::config::count(&[&[d, heads, dq]])?,
        };
        let kv = crate::config::count(&[
            &[d, r + dr],
            &[b, r + dr],
            &[r],
            &[r, heads, dn + dv],
            &[heads, dv, d],
            &[usize::from(o_bias), d],
        ])?;
        q.checked_add(kv)
    }
}

/// `[.., 2i + j]` → `[.., j·D/2 + i]`: the interleaved RoPE pairs into rotate-half layout
/// (q and k alike, so their dot products are unchanged).
fn deinterleave(b: &mut Builder, x: TensorId) -> IrResult<TensorId> {
    let dims = b.shape(x).dims().to_vec();
    let (&d, lead) = dims.split_last().expect("a [B,S,H,D] operand");
    let mut pairs = lead.to_vec();
    pairs.extend([d / 2, 2]);
    let x = b.reshape(x, pairs.clone())?;
    let n = pairs.len();
    let mut perm: Vec<usize> = (0..n).collect();
    perm.swap(n - 2, n - 1);
    let x = b.permute(x, &perm)?;
    b.reshape(x, dims)
}

/// `x [B,S,H,D]` zero-padded to `[B,S,H,to]` on the last dim.
fn pad_heads(b: &mut Builder, x: TensorId, to: usize) -> IrResult<TensorId> {
    let mut dims = b.shape(x).dims().to_vec();
    let d = dims[3];
    if d == to {
        return Ok(x);
    }
    dims[3] = to - d;
    let zeros = b.fill(0.0, dims, b.dtype(x))?;
    b.concat(&[x, zeros], 3)
}

/// MLA on `n_bsd` (after `input_layernorm`), inside the layer's `self_attn` scope. When
/// generating, the layer's cache holds each position's normalised latent and rotated shared
/// key (`kv_lora_rank + qk_rope_head_dim` values, one "head"), and every step decompresses
/// the whole cache through `kv_b_proj` before attending.
pub(crate) fn attention(
    b: &mut Builder,
    cfg: &LlamaConfig,
    mla: &MlaParams,
    dec: &mut Decoder,
    inv_freq: &[f64],
    n_bsd: TensorId,
    dtype: DType,
) -> IrResult<TensorId> {
    let (d, h) = (cfg.hidden_size, cfg.num_attention_heads);
    // transformers builds both latent norms with DeepseekV3RMSNorm's default ε, not the
    // config's `rms_norm_eps`.
    let eps = LATENT_NORM_EPS;
    let (dq, dn, dr, dv) =
        (mla.qk_head_dim(), mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim);
    let r = mla.kv_lora_rank;
    let dims = b.shape(n_bsd).dims().to_vec();
    let (batch, seq) = (dims[0], dims[1]);

    let q_bs_hq = match mla.q_lora_rank {
        Some(rq) => {
            let a = dec.linear(b, "q_a_proj", n_bsd, rq, cfg.qkv_bias)?;
            let a = nn::rms_norm_to(b, "q_a_layernorm", a, eps, dtype)?;
            dec.linear(b, "q_b_proj", a, h * dq, false)?
        }
        None => dec.linear(b, "q_proj", n_bsd, h * dq, false)?,
    };
    let q_bshq = nn::split_heads(b, q_bs_hq, h)?;
    let q_nope = b.slice(q_bshq, 3, 0, dn)?;
    let q_pe = b.slice(q_bshq, 3, dn, dq)?;

    let ckv = dec.linear(b, "kv_a_proj_with_mqa", n_bsd, r + dr, cfg.qkv_bias)?;
    let c = b.slice(ckv, 2, 0, r)?;
    let k_pe = b.slice(ckv, 2, r, r + dr)?;
    let k_pe = b.reshape(k_pe, [batch, seq, 1, dr])?;
    let c = nn::rms_norm_to(b, "kv_a_layernorm", c, eps, dtype)?;
    let q_pe = rotate(b, cfg, mla, dec, inv_freq, q_pe)?;

    // The latents and shared keys attended over: this step's, or the whole cache's.
    let (c, k_pe, start) = match dec.generation() {
        // Broadcast over the heads before rotating (the same values: RoPE acts per head), so
        // that tensor parallelism splits the rotation by heads as it does the queries'.
        None => {
            let k_pe = b.expand(k_pe, [batch, seq, h, dr])?;
            (c, rotate(b, cfg, mla, dec, inv_freq, k_pe)?, None)
        }
        Some(g) => {
            let k_pe = rotate(b, cfg, mla, dec, inv_freq, k_pe)?;
            let c4 = b.reshape(c, [batch, seq, 1, r])?;
            let latent = b.concat(&[c4, k_pe], 3)?;
            let cache = b.kv_cache("latent_cache", [batch, g.capacity, 1, r + dr], dtype);
            let cache = b.cache_write(cache, latent, g.start)?;
            let c_all = b.slice(cache, 3, 0, r)?;
            let c_all = b.reshape(c_all, [batch, g.capacity, r])?;
            (c_all, b.slice(cache, 3, r, r + dr)?, Some(g.start))
        }
    };
    let t = b.shape(c).dim(1);
    let kv = dec.linear(b, "kv_b_proj", c, h * (dn + dv), false)?;
    let kv = nn::split_heads(b, kv, h)?;
    let k_nope = b.slice(kv, 3, 0, dn)?;
    let v = b.slice(kv, 3, dn, dn + dv)?;
    let k_pe = if b.shape(k_pe).dim(2) == h { k_pe } else { b.expand(k_pe, [batch, t, h, dr])? };
    let q = b.concat(&[q_nope, q_pe], 3)?;
    let k = b.concat(&[k_nope, k_pe], 3)?;

    let width = dq.max(dv);
    let (q, k, v) = (pad_heads(b, q, width)?, pad_heads(b, k, width)?, pad_heads(b, v, width)?);
    let scale = (dq as f64).powf(-0.5) * cfg.rope_scaling.softmax_mscale();
    let spec = AttentionSpec { scale, ..AttentionSpec::causal(width) };
    let o = match start {
        None => b.attention(q, k, v, spec)?,
        Some(start) => b.attention_at(q, k, v, start, spec)?,
    };
    let o = if width == dv { o } else { b.slice(o, 3, 0, dv)? };
    let o = nn::merge_heads(b, o)?;
    dec.linear(b, "o_proj", o, d, cfg.o_bias)
}

/// RoPE on the decoupled dims `x [B,S,H,dr]` at the tokens' positions: de-interleaved first
/// (`rope_interleave`), then scaled by YaRN's attention factor.
fn rotate(
    b: &mut Builder,
    cfg: &LlamaConfig,
    mla: &MlaParams,
    dec: &Decoder,
    inv_freq: &[f64],
    x: TensorId,
) -> IrResult<TensorId> {
    let x = if mla.rope_interleave { deinterleave(b, x)? } else { x };
    let x = dec.rope(b, x, inv_freq)?;
    match cfg.rope_scaling.attention_factor() {
        af if af != 1.0 => b.scale(x, af),
        _ => Ok(x),
    }
}
