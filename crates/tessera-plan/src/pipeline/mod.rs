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
//! The shared vocabulary lives here: [`Pass`], [`Slot`] (and, with the config grammar,
//! [`ScheduleKind`]).

use serde::{Deserialize, Serialize};

pub mod balance;
pub mod lower;
pub mod plan;
pub mod schedule;
pub mod search;
pub mod split;

// The config grammar's pipeline vocabulary (stages, schedules) lives with the grammar.
pub use crate::config::layout;
pub use crate::config::layout::ScheduleKind;

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
