//! fp16 dynamic loss scaling (training graphs with [`tessera_ir::TrainingGraph::loss_scale`]),
//! following PyTorch's `GradScaler`: the scale starts at [`LossScaleConfig::init_scale`]
//! (2^16); a step whose unscaled gradient norm is not finite is *skipped* (the AdamW nodes leave
//! parameters and state untouched) and halves the scale; [`LossScaleConfig::growth_interval`]
//! (2000) consecutive good steps double it. As in PyTorch, a skipped step still counts as an
//! iteration — the step counter, learning-rate schedule, batch order and dropout seed advance
//! — but not as an optimizer step: AdamW's bias-correction `step` input is the number of
//! updates actually applied plus one (PyTorch's Adam does not advance its `step` state when
//! `GradScaler` skips `optimizer.step()`).
//!
//! On several devices the decision needs no extra agreement: it is a function of the global
//! gradient norm, which the Program all-reduces (sums in group order, so every rank holds the
//! same bits), and the AdamW nodes of every rank skip on that same value.

use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use tessera_ir::TensorId;

/// Dynamic loss scaling settings (PyTorch `GradScaler`'s defaults).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaleConfig {
    pub init_scale: f64,
    /// Multiplies the scale after `growth_interval` consecutive good steps.
    pub growth_factor: f64,
    /// Multiplies the scale after a step whose gradients overflowed.
    pub backoff_factor: f64,
    pub growth_interval: u64,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        LossScaleConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// The loss scaler's state, saved with a checkpoint to resume exactly.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaleState {
    /// The scale the next step runs with.
    pub scale: f64,
    /// Consecutive good steps since the last growth or backoff.
    pub good_steps: u64,
    /// Skipped steps since the start of the run (AdamW's step is `steps − skipped + 1`).
    pub skipped_steps: u64,
}

/// The scaler of an fp16 training graph: its input, settings and state.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LossScaler {
    pub(crate) input: TensorId,
    pub(crate) cfg: LossScaleConfig,
    pub(crate) state: LossScaleState,
}

impl LossScaler {
    pub(crate) fn new(input: TensorId, cfg: LossScaleConfig) -> LossScaler {
        let state = LossScaleState { scale: cfg.init_scale, good_steps: 0, skipped_steps: 0 };
        LossScaler { input, cfg, state }
    }

    /// Records a step's outcome and adjusts the scale.
    pub(crate) fn update(&mut self, overflow: bool) {
        let s = &mut self.state;
        if overflow {
            s.scale *= self.cfg.backoff_factor;
            s.good_steps = 0;
            s.skipped_steps += 1;
        } else {
            s.good_steps += 1;
            if s.good_steps >= self.cfg.growth_interval {
                s.scale *= self.cfg.growth_factor;
                s.good_steps = 0;
            }
        }
    }
}

pub(crate) fn check_scale_config(cfg: &LossScaleConfig) -> Result<()> {
    let ok = cfg.init_scale.is_finite()
        && cfg.init_scale > 0.0
        && cfg.init_scale <= f64::from(f32::MAX)
        && cfg.growth_factor >= 1.0
        && cfg.growth_factor.is_finite()
        && cfg.backoff_factor > 0.0
        && cfg.backoff_factor < 1.0
        && cfg.growth_interval >= 1;
    if ok {
        Ok(())
    } else {
        Err(RuntimeError::Binding(format!(
            "invalid loss scaling: initial scale {}, growth factor {}, backoff factor {}, \
             growth interval {}; need 0 < initial scale ≤ {:e} (f32's largest; --loss-scale), \
             growth factor ≥ 1, 0 < backoff factor < 1 and growth interval ≥ 1 \
             (--loss-scale-window)",
            cfg.init_scale,
            cfg.growth_factor,
            cfg.backoff_factor,
            cfg.growth_interval,
            f32::MAX
        )))
    }
}

/// Key of the loss scaler's state in a checkpoint manifest's `extra`.
pub const SCALER_KEY: &str = "loss_scaler";

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused configuration reads as figures and the flags that set them, not a Rust
    /// debug struct (issue 43).
    #[test]
    fn a_bad_loss_scale_is_worded_not_debug_printed() {
        let cfg = LossScaleConfig { init_scale: f64::INFINITY, ..LossScaleConfig::default() };
        let e = check_scale_config(&cfg).unwrap_err().to_string();
        assert!(e.contains("initial scale inf") && e.contains("--loss-scale"), "{e}");
        assert!(!e.contains("LossScaleConfig") && !e.contains('{'), "{e}");
        assert!(check_scale_config(&LossScaleConfig::default()).is_ok());
    }
}
