//! The step's own knobs, which split no device axis: micro-batches (`mbN`, gradient
//! accumulation and the pipeline's micro-batches), the LM head and loss in row chunks
//! (`loss=`, [`crate::loss_chunk`]) and the MLP in row tiles (`mlp=`, [`crate::mlp_tile`]).

use super::{Axis, Parsed, Slot, Token};
use crate::config::{positive, LossMode, MlpMode, ParallelConfig};

/// `mbN`, `loss=`, `mlp=`.
pub(super) struct StepKnobs;

impl Axis for StepKnobs {
    fn name(&self) -> &'static str {
        "step"
    }

    fn parse_token(&self, t: Token<'_>, cfg: &mut ParallelConfig) -> Parsed {
        let (raw, tok) = (t.raw, t.lower);
        if let Some(value) = tok.strip_prefix("loss=") {
            return Some(LossMode::parse(raw, value).map(|l| {
                cfg.loss = Some(l);
                "loss"
            }));
        }
        if let Some(value) = tok.strip_prefix("mlp=") {
            return Some(MlpMode::parse(raw, value).map(|m| {
                cfg.mlp = Some(m);
                "mlp"
            }));
        }
        let n = tok.strip_prefix("mb")?;
        Some(positive(raw, n, "mb", "mb4").map(|n| {
            cfg.micro_batches = n;
            "mb"
        }))
    }

    fn bare_keyword(&self, t: Token<'_>) -> Option<String> {
        let raw = t.raw;
        match t.lower {
            "loss" => {
                Some(format!("`{raw}`: write loss=whole or loss=chunkN, e.g. loss=chunk4096"))
            }
            "mlp" => Some(format!("`{raw}`: write mlp=whole or mlp=tileN, e.g. mlp=tile8192")),
            _ => None,
        }
    }

    fn canonical(&self, cfg: &ParallelConfig) -> Vec<(Slot, String)> {
        let mut out = Vec::new();
        if cfg.micro_batches > 1 {
            out.push((80, format!("mb{}", cfg.micro_batches)));
        }
        if let Some(l) = cfg.loss {
            out.push((130, format!("loss={l}")));
        }
        if let Some(m) = cfg.mlp {
            out.push((140, format!("mlp={m}")));
        }
        out
    }
}
