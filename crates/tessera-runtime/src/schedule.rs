//! Learning-rate schedules. The horizon is the run's total `--steps`, so a resumed run follows
//! the same curve as an uninterrupted one.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LrSchedule {
    Constant {
        lr: f64,
    },
    /// Linear warmup from lr/warmup to `peak` over `warmup` steps, then cosine decay to
    /// `min_lr` at step `total`.
    WarmupCosine {
        peak: f64,
        min_lr: f64,
        warmup: u64,
        total: u64,
    },
}

impl LrSchedule {
    /// Learning rate of 1-based `step`.
    pub fn lr_at(&self, step: u64) -> f64 {
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupCosine { peak, min_lr, warmup, total } => {
                if warmup > 0 && step <= warmup {
                    return peak * step as f64 / warmup as f64;
                }
                if step >= total {
                    return min_lr;
                }
                let progress = (step - warmup) as f64 / (total - warmup).max(1) as f64;
                min_lr + 0.5 * (peak - min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }

    /// The same schedule over a new horizon of `total` steps (a resumed run extended or
    /// shortened): warmup and rates unchanged, the decay re-spread to end at `total`.
    pub fn with_horizon(&self, total: u64) -> LrSchedule {
        match *self {
            LrSchedule::Constant { lr } => LrSchedule::Constant { lr },
            LrSchedule::WarmupCosine { peak, min_lr, warmup, .. } => {
                LrSchedule::WarmupCosine { peak, min_lr, warmup, total }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_min() {
        let s = LrSchedule::WarmupCosine { peak: 1e-3, min_lr: 1e-4, warmup: 10, total: 110 };
        assert!((s.lr_at(1) - 1e-4).abs() < 1e-15);
        assert!((s.lr_at(10) - 1e-3).abs() < 1e-15);
        // Half-way through the decay the cosine term is zero: the midpoint of peak and min.
        assert!((s.lr_at(60) - 5.5e-4).abs() < 1e-12);
        assert!((s.lr_at(110) - 1e-4).abs() < 1e-15);
        assert!((s.lr_at(500) - 1e-4).abs() < 1e-15);
        for step in 11..110 {
            assert!(s.lr_at(step + 1) <= s.lr_at(step), "monotone decay at {step}");
        }
        assert_eq!(LrSchedule::Constant { lr: 0.5 }.lr_at(77), 0.5);
    }
}
