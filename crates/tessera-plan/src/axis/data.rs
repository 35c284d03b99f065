//! The data-parallel axis: `dpN` replicas splitting the batch, ZeRO (`zeroK`) sharding their
//! model state, and hybrid sharding (`shard=N`: ZeRO within groups of N ranks, the groups a
//! `replica` mesh axis before the data axis). It has no pins: under a config's rule its mesh
//! axes split the batch of every op that has one (`search/space.rs`).

use super::{Axis, ConfigError, Engine, ExportFields, Parsed, Slot, Token};
use crate::config::{count, positive, ParallelConfig};
use crate::AxisName;

/// `dpN`, `zeroK`, `shard=N`.
pub(super) struct DataAxis;

impl Axis for DataAxis {
    fn name(&self) -> &'static str {
        "dp"
    }

    fn parse_token(&self, t: Token<'_>, cfg: &mut ParallelConfig) -> Parsed {
        let (raw, tok) = (t.raw, t.lower);
        if let Some(n) = tok.strip_prefix("shard=") {
            return Some(positive(raw, n, "shard=", "shard=8").map(|n| {
                cfg.shard = Some(n);
                "shard"
            }));
        }
        if let Some(k) = tok.strip_prefix("zero") {
            return Some(count(raw, k, "zero", "zero1").and_then(|stage| {
                if stage > 3 {
                    return Err(format!(
                        "`{raw}`: ZeRO has stages 0 to 3; write zero1, zero2 or zero3"
                    ));
                }
                cfg.zero = stage as u8;
                Ok("zero")
            }));
        }
        let n = tok.strip_prefix("dp")?;
        Some(positive(raw, n, "dp", "dp8").map(|n| {
            cfg.dp = n;
            "dp"
        }))
    }

    fn canonical(&self, cfg: &ParallelConfig) -> Vec<(Slot, String)> {
        let mut out = vec![(10, format!("dp{}", cfg.dp))];
        if cfg.zero > 0 {
            out.push((60, format!("zero{}", cfg.zero)));
        }
        if let Some(n) = cfg.shard {
            out.push((70, format!("shard={n}")));
        }
        out
    }

    fn validate(&self, cfg: &ParallelConfig) -> Result<(), ConfigError> {
        if cfg.zero > 3 {
            return Err(ConfigError::OutOfRange {
                knob: "zero",
                message: format!(
                    "zero{}: ZeRO has stages 0 to 3; write zero1, zero2 or zero3",
                    cfg.zero
                ),
            });
        }
        let Some(n) = cfg.shard else { return Ok(()) };
        let message = |why: &str| format!("shard={n} {why}");
        if cfg.zero == 0 {
            return Err(ConfigError::Requires {
                knob: "shard",
                needs: "zero",
                message: message("groups ZeRO's shards: add zero1, zero2 or zero3"),
            });
        }
        if n < 2 || n >= cfg.dp || !cfg.dp.is_multiple_of(n) {
            return Err(ConfigError::OutOfRange {
                knob: "shard",
                message: message(&format!(
                    "needs a group of 1 < N < dp ranks with N dividing dp{} (shard=dp is plain \
                     ZeRO: drop shard=)",
                    cfg.dp
                )),
            });
        }
        if cfg.pp > 1 {
            return Err(ConfigError::Unsupported {
                knob: "shard",
                with: "pp",
                message: message("with a pipeline (ppN) is not supported yet: drop shard= or ppN"),
            });
        }
        if cfg.offload.is_some() {
            return Err(ConfigError::Unsupported {
                knob: "shard",
                with: "offload",
                message: message("with offload= is not supported yet: drop one of them"),
            });
        }
        Ok(())
    }

    /// `[dp]`, or with hybrid sharding `[dp/N, N]`: the replica groups, then the ranks ZeRO
    /// shards over.
    fn mesh_axes(&self, cfg: &ParallelConfig) -> Vec<(Slot, AxisName, usize)> {
        match cfg.shard {
            Some(n) => vec![(0, AxisName::Replica, cfg.replicas()), (10, AxisName::Data, n)],
            None => vec![(10, AxisName::Data, cfg.dp)],
        }
    }

    /// Megatron-LM: the data-parallel degree is the world size's rest (no flag); ZeRO maps to
    /// the distributed optimizer, hybrid sharding to its instances.
    fn export(&self, engine: Engine, cfg: &ParallelConfig) -> ExportFields {
        let mut args = Vec::new();
        if engine == Engine::Megatron && cfg.zero >= 1 {
            args.push((50, "--use-distributed-optimizer".to_string()));
            if cfg.replicas() > 1 {
                args.push((
                    50,
                    format!("--num-distributed-optimizer-instances {}", cfg.replicas()),
                ));
            }
        }
        ExportFields::Args(args)
    }
}
