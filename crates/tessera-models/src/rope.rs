//! Rotary position embedding frequencies (Su et al. 2021, "RoFormer"), with the scaling
//! variants of Hugging Face's `modeling_rope_utils.py` that this crate supports.
//!
//! The base frequencies are `inv_freq[i] = theta^(-2i/d)` for `i < d/2` (`d` = head_dim);
//! scaling then rewrites them once, at build time, and the IR's `Rope` op carries the result.
//! YaRN (Peng et al. 2023) also scales the rotated values (`attention_factor`, transformers'
//! `attention_scaling` on cos and sin) and, in DeepSeek-V3's attention, the softmax scale
//! ([`RopeScaling::softmax_mscale`]); only the `deepseek_v3` family accepts it, since the
//! LLaMA layers do not apply the attention factor.

use crate::error::{ModelError, Result};
use serde::Serialize;
use std::f64::consts::PI;

/// How the base RoPE frequencies are rescaled (HF `rope_type`).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Position interpolation (Chen et al. 2023): every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1's frequency-dependent scaling (HF `_compute_llama3_parameters`): long
    /// wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// YaRN (HF `_compute_yarn_parameters`): each frequency blends interpolation (÷ `factor`)
    /// and extrapolation by a linear ramp between the correction dims of `beta_fast` and
    /// `beta_slow` rotations over `original_max_position_embeddings`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        /// `mscale` / `mscale_all_dim`: with both non-zero the attention factor is
        /// `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`, else
        /// `get_mscale(factor)`; `mscale_all_dim` also scales DeepSeek's softmax.
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        /// Overrides the attention factor when given.
        attention_factor: Option<f64>,
        /// Round the correction range outward (HF default true).
        truncate: bool,
    },
}

/// The `rope_type` names accepted in a config.json.
pub const SUPPORTED_ROPE_TYPES: &str = "default, linear, llama3, yarn (deepseek_v3 only)";

/// YaRN's `get_mscale`: `0.1·m·ln(scale) + 1` above 1, else 1.
fn get_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// The HF `rope_type` name.
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }

    /// The factor YaRN multiplies RoPE's cos and sin by (1 for the other types).
    pub fn attention_factor(&self) -> f64 {
        match *self {
            RopeScaling::Yarn { factor, mscale, mscale_all_dim, attention_factor, .. } => {
                match (attention_factor, mscale, mscale_all_dim) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                        get_mscale(factor, m) / get_mscale(factor, a)
                    }
                    _ => get_mscale(factor, 1.0),
                }
            }
            RopeScaling::Default | RopeScaling::Linear { .. } | RopeScaling::Llama3 { .. } => 1.0,
        }
    }

    /// DeepSeek's softmax-scale multiplier (HF `yarn_apply_mscale`): `get_mscale(factor,
    /// mscale_all_dim)²` for YaRN with a non-zero `mscale_all_dim`, else 1.
    pub fn softmax_mscale(&self) -> f64 {
        match *self {
            RopeScaling::Yarn { factor, mscale_all_dim: Some(a), .. } if a != 0.0 => {
                get_mscale(factor, a).powi(2)
            }
            RopeScaling::Yarn { .. }
            | RopeScaling::Default
            | RopeScaling::Linear { .. }
            | RopeScaling::Llama3 { .. } => 1.0,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let factor_ok = |field: &str, f: f64| {
            if f.is_finite() && f > 0.0 {
                Ok(())
            } else {
                Err(ModelError::invalid(
                    field,
                    format!("{f} must be a positive number (HF uses factors >= 1)"),
                ))
            }
        };
        match *self {
            RopeScaling::Default => Ok(()),
            RopeScaling::Linear { factor } => factor_ok("rope_scaling.factor", factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                factor_ok("rope_scaling.factor", factor)?;
                factor_ok("rope_scaling.low_freq_factor", low_freq_factor)?;
                factor_ok("rope_scaling.high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(ModelError::invalid(
                        "rope_scaling.high_freq_factor",
                        format!(
                            "{high_freq_factor} must exceed low_freq_factor \
                             {low_freq_factor} (Llama 3.1 uses 4 and 1)"
                        ),
                    ));
                }
                if original_max_position_embeddings == 0 {
                    return Err(ModelError::invalid(
                        "rope_scaling.original_max_position_embeddings",
                        "must be at least 1 (Llama 3.1 uses 8192)",
                    ));
                }
                Ok(())
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate: _,
            } => {
                factor_ok("rope_scaling.factor", factor)?;
                factor_ok("rope_scaling.beta_fast", beta_fast)?;
                factor_ok("rope_scaling.beta_slow", beta_slow)?;
                for (field, v) in [
                    ("rope_scaling.mscale", mscale),
                    ("rope_scaling.mscale_all_dim", mscale_all_dim),
                    ("rope_scaling.attention_factor", attention_factor),
                ] {
                    if let Some(v) = v.filter(|v| !(v.is_finite() && *v >= 0.0)) {
                        return Err(ModelError::invalid(field, format!("{v} must be ≥ 0")));
                    }
                }
                if original_max_position_embeddings == 0 {
                    return Err(ModelError::invalid(
                        "rope_scaling.original_max_position_embeddings",
                        "must be at least 1 (DeepSeek-V3 uses 4096)",
                    ));
                }
                Ok(())
            }
        }
    }

    /// Rescales one base inverse frequency (YaRN is applied by [`inv_freq`] over all dims).
    fn apply(&self, inv: f64) -> f64 {
        match *self {
            RopeScaling::Default | RopeScaling::Yarn { .. } => inv,
            RopeScaling::Linear { factor } => inv / factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old_ctx = original_max_position_embeddings as f64;
                let low_freq_wavelen = old_ctx / low_freq_factor;
                let high_freq_wavelen = old_ctx / high_freq_factor;
                let wavelen = 2.0 * PI / inv;
                if wavelen < high_freq_wavelen {
                    inv
                } else if wavelen > low_freq_wavelen {
                    inv / factor
                } else {
                    let smooth = (old_ctx / wavelen - low_freq_factor)
                        / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * inv / factor + smooth * inv
                }
            }
        }
    }
}

/// The `head_dim / 2` inverse frequencies fed to the IR's `Rope` op.
pub fn inv_freq(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f64> {
    let base = (0..head_dim / 2).map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64));
    let RopeScaling::Yarn {
        factor,
        original_max_position_embeddings,
        beta_fast,
        beta_slow,
        truncate,
        ..
    } = *scaling
    else {
        return base.map(|inv| scaling.apply(inv)).collect();
    };
    let dim = head_dim as f64;
    // The dim whose frequency makes `rotations` turns over the original context.
    let correction_dim = |rotations: f64| {
        dim * (original_max_position_embeddings as f64 / (rotations * 2.0 * PI)).ln()
            / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        high += 0.001; // HF: prevents a zero-width ramp
    }
    base.enumerate()
        .map(|(i, inv)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation = 1.0 - ramp;
            inv / factor * (1.0 - extrapolation) + inv * extrapolation
        })
        .collect()
}
