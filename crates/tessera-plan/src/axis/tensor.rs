//! The tensor-parallel axis: `tpN` (Megatron-LM's column and row splits) and sequence
//! parallelism on it (`sp`: the norms' sequence). Its mesh axis is the stage mesh's last; its
//! pins are Megatron-LM's layout op by op (`search/megatron.rs`, `tp_labels`), which the
//! search space asks for directly (not yet through [`super::Axis::pins`]).

use super::{Axis, ConfigError, Engine, ExportFields, Parsed, Slot, Token};
use crate::config::{positive, ParallelConfig};
use crate::AxisName;

/// `tpN`, `sp`, `sp=off`.
pub(super) struct TensorAxis;

impl Axis for TensorAxis {
    fn name(&self) -> &'static str {
        "tp"
    }

    fn parse_token(&self, t: Token<'_>, cfg: &mut ParallelConfig) -> Parsed {
        if t.lower == "sp" || t.lower == "sp=off" {
            cfg.sp = t.lower == "sp";
            return Some(Ok("sp"));
        }
        let n = t.lower.strip_prefix("tp")?;
        Some(positive(t.raw, n, "tp", "tp4").map(|n| {
            cfg.tp = n;
            "tp"
        }))
    }

    fn canonical(&self, cfg: &ParallelConfig) -> Vec<(Slot, String)> {
        let mut out = vec![(20, format!("tp{}", cfg.tp))];
        if cfg.sp {
            out.push((50, "sp".to_string()));
        }
        out
    }

    fn validate(&self, cfg: &ParallelConfig) -> Result<(), ConfigError> {
        if cfg.sp && cfg.tp < 2 {
            return Err(ConfigError::Requires {
                knob: "sp",
                needs: "tp",
                message: "sp shards the sequence over the tensor-parallel axis: add tpN with N > 1"
                    .into(),
            });
        }
        Ok(())
    }

    fn mesh_axes(&self, cfg: &ParallelConfig) -> Vec<(Slot, AxisName, usize)> {
        vec![(90, AxisName::Tensor, cfg.tp)]
    }

    fn export(&self, engine: Engine, cfg: &ParallelConfig) -> ExportFields {
        let mut args = Vec::new();
        if engine == Engine::Megatron {
            args.push((10, format!("--tensor-model-parallel-size {}", cfg.tp)));
            if cfg.sp {
                args.push((40, "--sequence-parallel".to_string()));
            }
        }
        ExportFields::Args(args)
    }
}
