//! Pipeline parallelism: the third axis of a plan.
//!
//! A pipelined plan cuts the chain of repeated blocks into contiguous *stages* (the embedding
//! joins the first, the head and the loss the last); each stage runs on its own group of
//! devices, which splits it further by data and tensor parallelism. With interleaving, a
//! device holds `V` non-adjacent *chunks* (virtual stages `c·p + d`).
//!
//! - [`schedule`]: schedules as data — GPipe, 1F1B, interleaved 1F1B and ZB-H1 as an ordered
//!   list of [`Slot`]s per device — and their simulation in time (bubble, Gantt chart).
//!
//! The shared vocabulary lives here: [`ScheduleKind`], [`Pass`], [`Slot`].

use serde::{Deserialize, Serialize};
use std::fmt;

pub mod auto;
pub mod balance;
pub mod layout;
pub mod lower;
pub mod plan;
pub mod schedule;
pub mod search;
pub mod split;

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

/// What a slot of a schedule runs for one micro-batch on one chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Pass {
    /// Forward.
    F,
    /// Backward; under a split schedule only the input gradients.
    B,
    /// Weight gradients (split schedules only).
    W,
}

/// One entry of a device's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Slot {
    pub micro_batch: usize,
    /// The device's chunk (0 without interleaving); its virtual stage is `chunk·p + device`.
    pub chunk: usize,
    pub pass: Pass,
}
