//! Where a step's state lives: activation checkpointing (`ckpt=`) and offload below the
//! device (`offload=`, `nvme`). Neither adds a mesh axis; both are rewrites of the lowered
//! Program that the lowering applies (`ckpt.rs`, `lower/act_offload.rs`, `offload.rs`), and
//! their search is the planner's (`planner/`).

use super::{Axis, ConfigError, Parsed, Slot, Token};
use crate::config::{positive, ParallelConfig};
use crate::offload::Offload;
use tessera_ir::CkptMode;

/// `ckpt=none|selective|full`.
pub(super) struct CheckpointAxis;

impl Axis for CheckpointAxis {
    fn name(&self) -> &'static str {
        "ckpt"
    }

    fn parse_token(&self, t: Token<'_>, cfg: &mut ParallelConfig) -> Parsed {
        let mode = t.lower.strip_prefix("ckpt=")?;
        Some(match CkptMode::parse(mode) {
            Some(m) => {
                cfg.ckpt = Some(m);
                Ok("ckpt")
            }
            None => Err(format!(
                "`{}`: checkpoint modes are none, selective and full, e.g. ckpt=full",
                t.raw
            )),
        })
    }

    fn bare_keyword(&self, t: Token<'_>) -> Option<String> {
        (t.lower == "ckpt")
            .then(|| format!("`{}`: write ckpt=none, ckpt=selective or ckpt=full", t.raw))
    }

    fn canonical(&self, cfg: &ParallelConfig) -> Vec<(Slot, String)> {
        cfg.ckpt.map(|m| (110, format!("ckpt={m}"))).into_iter().collect()
    }
}

/// `offload=...`, `offload=none`, `nvme`, `nvme:K`.
pub(super) struct OffloadAxis;

impl Axis for OffloadAxis {
    fn name(&self) -> &'static str {
        "offload"
    }

    fn parse_token(&self, t: Token<'_>, cfg: &mut ParallelConfig) -> Parsed {
        let (raw, tok) = (t.raw, t.lower);
        if tok == "offload=none" {
            cfg.offload = None;
            return Some(Ok("offload"));
        }
        if let Some(value) = tok.strip_prefix("offload=") {
            return Some(Offload::parse_value(raw, value).map(|o| {
                cfg.offload = Some(o);
                "offload"
            }));
        }
        // `nvme` applies to the offload written anywhere in the string: see `finish`.
        if tok == "nvme" {
            return Some(Ok("nvme"));
        }
        let k = tok.strip_prefix("nvme:")?;
        Some(positive(raw, k, "nvme:", "nvme:4").map(|_| "nvme"))
    }

    /// `nvme` puts the offloaded chunks' optimizer state on the NVMe (`nvme:K`: the last K's).
    fn finish(
        &self,
        cfg: &mut ParallelConfig,
        seen: &[(&'static str, String)],
    ) -> Result<(), String> {
        let Some((_, tok)) = seen.iter().find(|(kind, _)| *kind == "nvme") else { return Ok(()) };
        // Parsed already (`parse_token`): a count of at least 1.
        let k: Option<u32> = tok
            .strip_prefix("nvme:")
            .map(|k| k.parse::<usize>().map_or(u32::MAX, |k| u32::try_from(k).unwrap_or(u32::MAX)));
        let Some(o) = cfg.offload.as_mut().filter(|o| o.moves_state()) else {
            return Err("`nvme` puts offloaded optimizer state on the NVMe: add offload=opt or \
                        offload=grads+opt"
                .into());
        };
        if k.is_some_and(|k| k > o.chunks) {
            return Err(format!(
                "nvme:{} is more chunks than the {} offloaded: give at most nvme:{}",
                k.unwrap_or(0),
                o.chunks,
                o.chunks
            ));
        }
        o.nvme = k.unwrap_or(o.chunks);
        Ok(())
    }

    fn bare_keyword(&self, t: Token<'_>) -> Option<String> {
        let raw = t.raw;
        match t.lower {
            "offload" => Some(format!(
                "`{raw}`: write offload=opt, offload=grads+opt or offload=all (optionally \
                 :K/16), or offload=act (activations), alone or before them: offload=act+opt"
            )),
            "act" => Some(format!(
                "`{raw}`: activation offload is written offload=act, or before model-state \
                 offload: offload=act+opt"
            )),
            _ => None,
        }
    }

    /// `offload=...` (with its `nvme`, as `Offload` writes it).
    fn canonical(&self, cfg: &ParallelConfig) -> Vec<(Slot, String)> {
        cfg.offload.map(|o| (120, o.to_string())).into_iter().collect()
    }

    fn validate(&self, cfg: &ParallelConfig) -> Result<(), ConfigError> {
        if cfg.offload.is_some() && cfg.pp > 1 {
            return Err(ConfigError::Unsupported {
                knob: "offload",
                with: "pp",
                message: "offload with a pipeline (ppN) is not supported yet: drop offload= or ppN"
                    .into(),
            });
        }
        Ok(())
    }
}
