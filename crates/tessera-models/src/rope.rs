//! Rotary position embedding frequencies (Su et al. 2021, "RoFormer"), with the scaling
//! variants of Hugging Face's `modeling_rope_utils.py` that this crate supports.
//!
//! The base frequencies are `inv_freq[i] = theta^(-2i/d)` for `i < d/2` (`d` = head_dim);
//! scaling then rewrites them once, at build time, and the IR's `Rope` op carries the result.

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
}

/// The `rope_type` names accepted in a config.json.
pub const SUPPORTED_ROPE_TYPES: &str = "default, linear, llama3";

impl RopeScaling {
    /// The HF `rope_type` name.
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
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
        }
    }

    /// Rescales one base inverse frequency.
    fn apply(&self, inv: f64) -> f64 {
        match *self {
            RopeScaling::Default => inv,
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
    (0..head_dim / 2)
        .map(|i| scaling.apply(theta.powf(-((2 * i) as f64) / head_dim as f64)))
        .collect()
}
