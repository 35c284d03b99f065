//! The pipeline's layout in the config grammar: unequal stages — how many blocks each virtual
//! stage runs and, optionally, its own activation checkpointing (the `stages=` token) — and the
//! schedule (`sched=`, [`ScheduleKind`]).
//!
//! ```text
//! stages := STAGE (',' STAGE)*        one per virtual stage (pp · V), in pipeline order
//! STAGE  := N | N ':' MODE            N >= 1 blocks; MODE = none | selective | full
//! ```
//!
//! e.g. `pp4 stages=7:full,8,9,8`: the first stage runs blocks 0..7 with full recomputation
//! (under 1F1B it holds the most micro-batches in flight), the others keep their activations.
//! A stage without a mode takes the config's `ckpt=` (none when absent). Without `stages=` the
//! blocks split as evenly as they go.

use crate::{PlanError, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use tessera_ir::{Checkpointing, CkptMode};

/// One virtual stage of an explicit layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Stage {
    /// Consecutive blocks it runs (at least one).
    pub blocks: usize,
    /// Its blocks' checkpointing; `None`: the config's `ckpt=` (none when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ckpt: Option<CkptMode>,
}

/// `7:full` or `8`.
impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ckpt {
            Some(m) => write!(f, "{}:{m}", self.blocks),
            None => write!(f, "{}", self.blocks),
        }
    }
}

/// The config-string spelling of a layout: `7:full,8,9,8`.
pub fn format_stages(stages: &[Stage]) -> String {
    stages.iter().map(Stage::to_string).collect::<Vec<_>>().join(",")
}

/// Parses the value of `stages=` (lower-cased); `raw` is the token as written, for messages.
pub fn parse_stages(raw: &str, value: &str) -> std::result::Result<Vec<Stage>, String> {
    if value.is_empty() {
        return Err(format!(
            "`{raw}`: give the blocks of each virtual stage, e.g. stages=7:full,8,9,8"
        ));
    }
    value
        .split(',')
        .map(|item| {
            let (n, mode) = match item.split_once(':') {
                Some((n, m)) => (n, Some(m)),
                None => (item, None),
            };
            let blocks = n.parse::<usize>().ok().filter(|&b| b > 0).ok_or_else(|| {
                format!(
                    "`{raw}`: `{item}` is not a stage; each stage is its block count (at least \
                     1), optionally with a checkpoint mode, e.g. 8 or 7:full"
                )
            })?;
            let ckpt = match mode {
                None => None,
                Some(m) => Some(CkptMode::parse(m).ok_or_else(|| {
                    format!(
                        "`{raw}`: `{item}`: checkpoint modes are none, selective and full, e.g. \
                         {blocks}:full"
                    )
                })?),
            };
            Ok(Stage { blocks, ckpt })
        })
        .collect()
}

/// Checks a layout against the pipeline: one stage per virtual stage (`pp · chunks`) and every
/// block of the model's `num_blocks` in exactly one stage.
pub fn check(stages: &[Stage], pp: usize, chunks: usize, num_blocks: usize) -> Result<()> {
    let want = pp * chunks.max(1);
    if stages.len() != want {
        let per = if chunks > 1 { format!(" (pp{pp} × {chunks} chunks)") } else { String::new() };
        return Err(PlanError::Invalid(format!(
            "stages= lists {} stages but the pipeline has {want} virtual stages{per}: give one \
             block count per virtual stage",
            stages.len()
        )));
    }
    let total: usize = stages.iter().map(|s| s.blocks).sum();
    if total != num_blocks {
        return Err(PlanError::Invalid(format!(
            "stages= covers {total} blocks but the model has {num_blocks}: the counts must add \
             up to {num_blocks}"
        )));
    }
    Ok(())
}

/// Blocks per virtual stage.
pub fn sizes(stages: &[Stage]) -> Vec<usize> {
    stages.iter().map(|s| s.blocks).collect()
}

/// The per-block checkpointing of a layout: each stage's mode on its blocks, `uniform` on the
/// blocks of stages without one.
pub fn checkpointing(stages: &[Stage], uniform: Option<CkptMode>) -> Checkpointing {
    let mut out = Checkpointing::default();
    let mut block = 0u32;
    for s in stages {
        let mode = s.ckpt.or(uniform).unwrap_or(CkptMode::None);
        for _ in 0..s.blocks {
            if mode != CkptMode::None {
                out.modes.insert(block, mode);
            }
            block += 1;
        }
    }
    out
}

/// The layout of `sizes` with a mode per stage, written compactly: a mode equal to `uniform` is
/// left out.
pub fn from_parts(sizes: &[usize], modes: &[CkptMode], uniform: Option<CkptMode>) -> Vec<Stage> {
    sizes
        .iter()
        .zip(modes)
        .map(|(&blocks, &m)| Stage {
            blocks,
            ckpt: (m != uniform.unwrap_or(CkptMode::None)).then_some(m),
        })
        .collect()
}

/// Which pipeline schedule a plan runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al., 2019).
    Gpipe,
    /// One forward, one backward in the steady state (PipeDream-Flush, Megatron's default):
    /// device `d` of `p` holds at most `p - d` micro-batches of activations.
    #[default]
    OneFOneB,
    /// Interleaved 1F1B (Narayanan et al., 2021): each device holds `v` chunks.
    Interleaved { v: usize },
    /// Zero-bubble ZB-H1 (Qi et al., 2023): backward split into the input-gradient part `B`
    /// and the weight-gradient part `W`, which fills the bubbles; 1F1B's memory.
    ZbH1,
}

impl ScheduleKind {
    /// Chunks (virtual stages) per device.
    pub fn chunks(self) -> usize {
        match self {
            ScheduleKind::Interleaved { v } => v.max(1),
            ScheduleKind::Gpipe | ScheduleKind::OneFOneB | ScheduleKind::ZbH1 => 1,
        }
    }

    /// Whether backward is split into `B` (input gradients) and `W` (weight gradients).
    pub fn splits_backward(self) -> bool {
        matches!(self, ScheduleKind::ZbH1)
    }
}

/// The config-string spelling: `gpipe`, `1f1b`, `interleaved:V`, `zb-h1`.
impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::Gpipe => write!(f, "gpipe"),
            ScheduleKind::OneFOneB => write!(f, "1f1b"),
            ScheduleKind::Interleaved { v } => write!(f, "interleaved:{v}"),
            ScheduleKind::ZbH1 => write!(f, "zb-h1"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_parse_format_and_check() {
        let s = parse_stages("stages=7:full,8,9,8", "7:full,8,9,8").unwrap();
        assert_eq!(s.len(), 4);
        assert_eq!(s[0], Stage { blocks: 7, ckpt: Some(CkptMode::Full) });
        assert_eq!(s[1], Stage { blocks: 8, ckpt: None });
        assert_eq!(format_stages(&s), "7:full,8,9,8");
        assert!(check(&s, 4, 1, 32).is_ok());
        let e = check(&s, 4, 1, 30).unwrap_err().to_string();
        assert!(e.contains("32 blocks") && e.contains("30"), "{e}");
        let e = check(&s, 2, 1, 32).unwrap_err().to_string();
        assert!(e.contains("4 stages") && e.contains("2 virtual"), "{e}");
        for bad in ["", "0,4", "a,4", "4:fast", "4,,4"] {
            let e = parse_stages(&format!("stages={bad}"), bad).unwrap_err();
            assert!(e.contains("stages="), "{bad}: {e}");
        }
    }

    #[test]
    fn layouts_checkpoint_each_stage_its_own_way() {
        let (none, sel, full) = (CkptMode::None, CkptMode::Selective, CkptMode::Full);
        let s = parse_stages("", "2:full,1,2:selective").unwrap();
        let c = checkpointing(&s, None);
        let modes: Vec<CkptMode> = (0..5).map(|b| c.mode(b)).collect();
        assert_eq!(modes, [full, full, none, sel, sel]);
        // A stage without a mode takes the uniform one.
        let c = checkpointing(&s, Some(sel));
        assert_eq!(c.mode(2), sel);
        // from_parts writes only the modes that differ from the uniform one.
        let back = from_parts(&[2, 1, 2], &[full, none, sel], None);
        assert_eq!(back, s);
        let back = from_parts(&[2, 3], &[full, full], Some(full));
        assert!(back.iter().all(|s| s.ckpt.is_none()));
    }
}
