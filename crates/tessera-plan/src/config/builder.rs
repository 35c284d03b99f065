//! Building a [`ParallelConfig`] in code: [`ParallelConfig::new`] and one `with_*` setter per
//! knob (the struct is sealed, so this is the only way outside `config.rs` besides parsing).

use super::layout::{ScheduleKind, Stage};
use super::{LossMode, MlpMode, ParallelConfig};
use crate::offload::Offload;
use tessera_ir::CkptMode;

/// Building a config: `ParallelConfig::new(2, 4).with_zero(1).with_micro_batches(8)`. The
/// setters do not check; [`ParallelConfig::validate`] does (and [`ParallelConfig::parse`]
/// validates what it parses).
impl ParallelConfig {
    /// `dp × tp`, every other knob at its default: ZeRO 0, one micro-batch, no sequence,
    /// context or pipeline parallelism, checkpointing, offload and loss chunking left to the
    /// planner.
    pub fn new(dp: usize, tp: usize) -> ParallelConfig {
        ParallelConfig { dp, tp, ..ParallelConfig::default() }
    }

    /// The data-parallel degree.
    pub fn with_dp(self, dp: usize) -> ParallelConfig {
        ParallelConfig { dp, ..self }
    }

    /// The tensor-parallel degree.
    pub fn with_tp(self, tp: usize) -> ParallelConfig {
        ParallelConfig { tp, ..self }
    }

    /// The ZeRO stage (0–3).
    pub fn with_zero(self, zero: u8) -> ParallelConfig {
        ParallelConfig { zero, ..self }
    }

    /// Micro-batches per step.
    pub fn with_micro_batches(self, micro_batches: usize) -> ParallelConfig {
        ParallelConfig { micro_batches, ..self }
    }

    /// Sequence parallelism on the tensor-parallel axis.
    pub fn with_sp(self, sp: bool) -> ParallelConfig {
        ParallelConfig { sp, ..self }
    }

    /// Checkpointing of every block (`None`: the planner's choice per block).
    pub fn with_ckpt(self, ckpt: Option<CkptMode>) -> ParallelConfig {
        ParallelConfig { ckpt, ..self }
    }

    /// Pipeline stages (devices along the pipeline axis).
    pub fn with_pp(self, pp: usize) -> ParallelConfig {
        ParallelConfig { pp, ..self }
    }

    /// The pipeline schedule (`None`: the default or the planner's choice).
    pub fn with_schedule(self, schedule: Option<ScheduleKind>) -> ParallelConfig {
        ParallelConfig { schedule, ..self }
    }

    /// Each virtual stage's blocks and checkpointing (empty: even stages).
    pub fn with_stages(self, stages: Vec<Stage>) -> ParallelConfig {
        ParallelConfig { stages, ..self }
    }

    /// Model state below the device (`None`: all on the device).
    pub fn with_offload(self, offload: Option<Offload>) -> ParallelConfig {
        ParallelConfig { offload, ..self }
    }

    /// Hybrid sharding's group size (`None`: every data-parallel rank).
    pub fn with_shard(self, shard: Option<usize>) -> ParallelConfig {
        ParallelConfig { shard, ..self }
    }

    /// The context-parallel degree.
    pub fn with_cp(self, cp: usize) -> ParallelConfig {
        ParallelConfig { cp, ..self }
    }

    /// The expert-parallel degree ([`crate::expert`]).
    pub fn with_ep(self, ep: usize) -> ParallelConfig {
        ParallelConfig { ep, ..self }
    }

    /// How the context-parallel axis exchanges keys and values (`None`: the default).
    pub fn with_cp_comm(self, cp_comm: Option<super::CpComm>) -> ParallelConfig {
        ParallelConfig { cp_comm, ..self }
    }

    /// The LM head and its loss, whole or chunked (`None`: the planner's choice).
    pub fn with_loss(self, loss: Option<LossMode>) -> ParallelConfig {
        ParallelConfig { loss, ..self }
    }

    /// Each block's MLP whole or tiled (`None`: the planner's choice).
    pub fn with_mlp(self, mlp: Option<MlpMode>) -> ParallelConfig {
        ParallelConfig { mlp, ..self }
    }
}
