//! Parallelism config strings: one grammar and one type ([`ParallelConfig`]) for the CLI, plan
//! files, explanations and tests. The type and its builder are here; the grammar's code is the
//! axes' ([`crate::axis`]: each axis parses, checks and spells its own tokens, and
//! `axis/grammar.rs` runs [`ParallelConfig::parse`], `validate`, `canonical` and the Megatron
//! flags over them).
//!
//! ```text
//! config := token ((' ' | '+')+ token)*          case-insensitive, each kind at most once
//! token  := dpN | tpN | cpN | ppN | zeroK | mbN | sp | sp=off | ckpt=MODE | sched=SCHED
//!         | stages=STAGES | cp=CP | offload=OFFLOAD | offload=none | nvme[:N] | shard=N
//!         | loss=LOSS | mlp=MLP                    N >= 1, K in 0..=3
//! MODE   := none | selective | full
//! CP     := a2a | ring                              ring: refused (not yet)
//! SCHED  := gpipe | 1f1b | interleaved:V | zb-h1  V >= 2 (chunks per device)
//! STAGES := N[:MODE] (',' N[:MODE])*              blocks (and checkpointing) per virtual stage
//! OFFLOAD:= act | [act '+'] STATE                 act: activation offload
//! STATE  := (opt | grads+opt | all) [':' K '/16']  chunks offloaded (default all 16)
//! LOSS   := whole | chunkN                       the LM head and loss: whole, or N rows a chunk
//! MLP    := whole | tileN                        each block's MLP: whole, or N rows a tile
//! ```
//!
//! `loss=chunkN` fuses a causal LM's head and its cross-entropy into one op computed N rows
//! (tokens) at a time ([`crate::loss_chunk`]): no more than one chunk's `[N, V]` logits ever
//! exist, at the price of recomputing the logits in the backward (one more GEMM of the head's
//! size). `loss=whole` keeps the matmul and the loss apart (the `[rows, V]` logits live from
//! the forward to the backward). Without `loss=` the planner chooses: chunks where one
//! device's share of the logits is at least a quarter of the memory budget, whole otherwise.
//!
//! `mlp=tileN` fuses each transformer block's MLP into one op computed N rows (tokens) at a
//! time ([`crate::mlp_tile`], ALST's tiled MLP): no `[rows, ffn]` intermediate exists beyond
//! one tile, at the price of recomputing the MLP's forward in its backward. `mlp=whole` keeps
//! the MLP's ops apart. Without `mlp=` the planner chooses ([`crate::mlp_tile::choose`]).
//!
//! `nvme` puts the offloaded chunks' optimizer state on the NVMe, `nvme:K` that of the last K
//! offloaded chunks (needs `offload=` with model state).
//!
//! `offload=act` is activation offload (see [`crate::offload`]): the input each fully
//! checkpointed block keeps for its backward pass rests in host memory, copied down in the
//! forward pass and fetched back one block ahead of the block's backward pass. It composes with
//! model-state offload written after it: `offload=act+opt`, `offload=act+grads+opt:8/16 nvme`.
//! Plan files without it read and write as before.
//!
//! `shard=N` is hybrid sharding (HSDP; DeepSpeed's MiCS, Megatron-LM's distributed optimizer
//! instances): ZeRO shards its state over groups of N consecutive data-parallel ranks (one
//! node's GPUs, say) and each of the dp/N groups holds a whole replica of it, so the
//! gathers stay within a group and only the gradient all-reduce crosses groups. It needs a
//! ZeRO stage and 1 < N < dp with N dividing dp.
//!
//! `cpN` is context parallelism (see [`crate::context`]): a mesh axis splitting every
//! activation's sequence, and attention's heads, exchanged by all-to-alls (DeepSpeed-Ulysses,
//! `cp=a2a`, the default). `cp=` needs cp > 1; `cp=ring` (ring attention) is refused, naming
//! the gap and the fix.
//!
//! Defaults: `dp1 tp1 cp1 pp1 zero0 mb1`, no `sp`, no schedule (`sched=` not given: 1F1B, or the
//! planner's choice), checkpointing searched (no `ckpt=`: the planner picks a mode per block
//! under the budget). A schedule needs a pipeline: `sched=` with pp1 is refused.
//!
//! Pinned and free knobs ([`Pins`], from [`ParallelConfig::parse_pinned`]): the degrees and
//! the ZeRO stage are what the string says (their defaults above), but the micro-batches,
//! `sp`, the schedule, checkpointing and offload are fixed only when written — `mb1`, `sp` or
//! `sp=off`, `sched=...`, `ckpt=...`, `offload=...` or `offload=none` — and otherwise chosen
//! by the planner's search within the named degrees ([`crate::planner::plan_config`]). The
//! [`ParallelConfig`] a parse returns holds the defaults for the free knobs, so a plan's
//! `config` (the chosen knobs written canonically) and old plan files read as before.
//!
//! Canonical form ([`ParallelConfig::canonical`], also `Display`): `dp{dp} tp{tp}` always, then
//! `cp{cp} cp=a2a` if cp > 1 (the variant written, so plan files stay unambiguous when ring
//! attention arrives), `pp{pp}` if pp > 1, `sp`, `zero{k}` if k > 0, `shard={n}` if given, `mb{n}` if n > 1,
//! `sched={schedule}` if given, `stages={list}` if given (unequal stages, see [`crate::pipeline::layout`]) and `ckpt={mode}`
//! if given, then `offload=...` and `nvme`, then `loss=...` and `mlp=...` if given — e.g. `dp2 tp4 sp zero1 mb4 ckpt=selective`,
//! `dp2 tp2 pp4 zero1 mb8 sched=interleaved:2`, or `dp8 tp1` for pure data parallelism. It
//! parses back to the same config.
//!
//! A config spans dp × cp × tp × pp devices ([`ParallelConfig::check_devices`]). The rules that need
//! the model (enough blocks for the stages and chunks, Megatron's micro-batch rule for
//! interleaving) are in [`ParallelConfig::check_pipeline`].

mod builder;
pub mod layout;

use crate::offload::Offload;
use crate::{PlanError, Result};
use layout::{ScheduleKind, Stage};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use tessera_ir::CkptMode;

/// How one training step is split: data-parallel, tensor-parallel, context-parallel and
/// pipeline degrees, ZeRO stage, micro-batches (gradient accumulation), sequence parallelism
/// and the pipeline schedule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParallelConfig {
    /// Data-parallel degree (replicas).
    pub dp: usize,
    /// Tensor-parallel degree (Megatron-style column/row sharding).
    pub tp: usize,
    /// ZeRO stage over the data-parallel axis: 0 none, 1 optimizer state, 2 + gradients,
    /// 3 + parameters.
    pub zero: u8,
    /// Micro-batches per step (gradient accumulation; with pp > 1 also the pipeline's
    /// micro-batches).
    pub micro_batches: usize,
    /// Sequence parallelism: norms and dropout sharded over the sequence on the tp axis.
    pub sp: bool,
    /// Activation checkpointing on every block; `None`: chosen per block by the planner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ckpt: Option<CkptMode>,
    /// Pipeline stages (devices along the pipeline axis); 1: no pipeline.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub pp: usize,
    /// The pipeline schedule (`None`: the default, 1F1B, or the planner's choice). Only with
    /// pp > 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<ScheduleKind>,
    /// Blocks (and optionally checkpointing) of each virtual stage, in pipeline order; empty:
    /// the blocks split evenly (see [`crate::pipeline::layout`]). Only with pp > 1.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<Stage>,
    /// Model state of some chunks below the device (host memory or NVMe); `None`: all on the
    /// device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload: Option<Offload>,
    /// Hybrid sharding: ZeRO shards over groups of this many data-parallel ranks, replicated
    /// across the groups (see the module docs); `None`: over every data-parallel rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<usize>,
    /// Context-parallel degree (see [`crate::context`]); 1: the sequence is not split.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub cp: usize,
    /// Expert-parallel degree (see [`crate::expert`]): an axis inside the data-parallel
    /// group; the tokens split over dp × ep, the experts over ep. 1: not split.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub ep: usize,
    /// How the cp axis exchanges keys and values (`None`: the default, all-to-all). Only with
    /// cp > 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cp_comm: Option<CpComm>,
    /// The LM head and its loss, whole or in row chunks (`loss=`); `None`: the planner's
    /// choice ([`crate::loss_chunk::choose`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<LossMode>,
    /// Each block's MLP, whole or in row tiles (`mlp=`); `None`: the planner's choice
    /// ([`crate::mlp_tile::choose`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp: Option<MlpMode>,
    /// Seals the struct: outside this module a config is made by [`ParallelConfig::new`] (or
    /// parsed) and changed by its `with_*` setters, never by a struct literal, so a new knob
    /// has one default and one place that spells it.
    #[serde(skip)]
    built: Built,
}

/// How a transformer block's MLP runs (`mlp=whole` / `mlp=tileN`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpMode {
    /// The MLP's ops apart: its `[rows, ffn]` intermediates whole.
    Whole,
    /// Fused and computed this many rows (tokens) at a time (`Op::TiledMlp`).
    Tile(usize),
}

impl MlpMode {
    /// Rows per tile, `None` for [`MlpMode::Whole`].
    pub fn tile_rows(self) -> Option<usize> {
        match self {
            MlpMode::Whole => None,
            MlpMode::Tile(n) => Some(n),
        }
    }

    pub(crate) fn parse(raw: &str, value: &str) -> std::result::Result<MlpMode, String> {
        if value == "whole" {
            return Ok(MlpMode::Whole);
        }
        match value.strip_prefix("tile") {
            Some(n) => positive(raw, n, "mlp=tile", "mlp=tile8192").map(MlpMode::Tile),
            None => Err(format!(
                "`{raw}`: the MLP is mlp=whole or mlp=tileN (N rows per tile, e.g. mlp=tile8192)"
            )),
        }
    }
}

impl fmt::Display for MlpMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MlpMode::Whole => write!(f, "whole"),
            MlpMode::Tile(n) => write!(f, "tile{n}"),
        }
    }
}

/// How the cp axis exchanges what attention needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpComm {
    /// All-to-all (Ulysses): sequence-split to head-split around attention and back.
    #[default]
    A2a,
    /// Ring attention: K/V blocks passed around the cp ring, partial outputs merged by their
    /// log-sum-exp (Megatron-LM's `p2p`, torchtitan's context parallelism).
    Ring,
}

impl fmt::Display for CpComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CpComm::A2a => f.write_str("a2a"),
            CpComm::Ring => f.write_str("ring"),
        }
    }
}

/// The private field of [`ParallelConfig`] (not part of the plan file).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Built;

/// How a causal LM's head and cross-entropy run (`loss=whole` / `loss=chunkN`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossMode {
    /// The head's matmul and the loss apart: the `[rows, V]` logits are a saved activation.
    Whole,
    /// Fused and computed this many rows (tokens) at a time (`Op::LinearCrossEntropy`).
    Chunk(usize),
}

impl LossMode {
    /// Rows per chunk, `None` for [`LossMode::Whole`].
    pub fn chunk_rows(self) -> Option<usize> {
        match self {
            LossMode::Whole => None,
            LossMode::Chunk(n) => Some(n),
        }
    }

    pub(crate) fn parse(raw: &str, value: &str) -> std::result::Result<LossMode, String> {
        if value == "whole" {
            return Ok(LossMode::Whole);
        }
        match value.strip_prefix("chunk") {
            Some(n) => positive(raw, n, "loss=chunk", "loss=chunk4096").map(LossMode::Chunk),
            None => Err(format!(
                "`{raw}`: the loss is loss=whole or loss=chunkN (N rows per chunk, e.g. \
                 loss=chunk4096)"
            )),
        }
    }
}

impl fmt::Display for LossMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossMode::Whole => write!(f, "whole"),
            LossMode::Chunk(n) => write!(f, "chunk{n}"),
        }
    }
}

/// Which of the knobs the planner would otherwise choose a config string writes: a written
/// knob is pinned to its value (`mb1` and `sp=off` included), an unwritten one is searched
/// ([`crate::planner::plan_config`]). Beside [`ParallelConfig`] rather than inside it (as
/// `Option`s): the config stays the fully written layout every other reader takes — plans,
/// exports, the runtime, the ~30 places that build one — and only the entry point of a config
/// string reads what was left open.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pins {
    /// `mbN`.
    pub micro_batches: bool,
    /// `sp` or `sp=off`.
    pub sp: bool,
    /// `sched=`.
    pub schedule: bool,
    /// `ckpt=` (or per-stage modes in `stages=`).
    pub ckpt: bool,
    /// `offload=` (`offload=none` included).
    pub offload: bool,
}

impl Pins {
    /// Every knob written: the config is the plan's layout exactly.
    pub const ALL: Pins =
        Pins { micro_batches: true, sp: true, schedule: true, ckpt: true, offload: true };

    /// The pins of the token kinds a parse saw.
    pub(crate) fn written(seen: &[&str]) -> Pins {
        let has = |k: &str| seen.contains(&k);
        Pins {
            micro_batches: has("mb"),
            sp: has("sp"),
            schedule: has("sched"),
            ckpt: has("ckpt") || has("stages"),
            offload: has("offload"),
        }
    }

    /// Whether every knob that matters for `cfg` is written: `sp` only with tp > 1, a
    /// schedule only with a pipeline. Checkpointing and offload are not needed: unwritten,
    /// a flat config searches checkpointing per block as it always has, and offload is tried
    /// only when nothing fits without it.
    pub fn complete_for(&self, cfg: &ParallelConfig) -> bool {
        self.micro_batches
            && (self.sp || cfg.tp < 2)
            && (cfg.pp < 2 || (self.schedule && self.ckpt))
    }
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl Default for ParallelConfig {
    fn default() -> ParallelConfig {
        ParallelConfig {
            dp: 1,
            tp: 1,
            zero: 0,
            micro_batches: 1,
            sp: false,
            ckpt: None,
            pp: 1,
            schedule: None,
            stages: Vec::new(),
            offload: None,
            shard: None,
            cp: 1,
            ep: 1,
            cp_comm: None,
            loss: None,
            mlp: None,
            built: Built,
        }
    }
}

impl ParallelConfig {
    /// Data-parallel groups holding whole replicas of the ZeRO state (dp / shard; 1 without
    /// hybrid sharding).
    pub fn replicas(&self) -> usize {
        self.shard.map_or(1, |n| self.dp / n.max(1))
    }

    /// Devices the config spans: dp × cp × tp × pp (saturating; a validated config does not
    /// overflow).
    pub fn devices(&self) -> usize {
        self.dp
            .saturating_mul(self.ep)
            .saturating_mul(self.cp)
            .saturating_mul(self.tp)
            .saturating_mul(self.pp)
    }

    /// The DeepSpeed config fragment: `zero_optimization.stage`, `gradient_accumulation_steps`
    /// (with a pipeline, DeepSpeed's micro-batches per step) and, when pp > 1,
    /// `pipeline.stages` (tensor parallelism is not DeepSpeed's; combine with
    /// [`ParallelConfig::megatron_flags`] as Megatron-DeepSpeed does). DeepSpeed's pipeline
    /// engine takes its stage count from the model's `PipelineModule(num_stages = pp)`, which
    /// this fragment cannot set; it runs its own 1F1B-like schedule whatever `sched=` says, and
    /// it refuses ZeRO-2 and -3 with a pipeline.
    pub fn deepspeed_config(&self) -> serde_json::Value {
        let mut ds = serde_json::json!({
            "zero_optimization": { "stage": self.zero },
            "gradient_accumulation_steps": self.micro_batches,
        });
        if self.pp > 1 {
            ds["pipeline"] = serde_json::json!({ "stages": self.pp });
        }
        ds
    }
}

/// The count after a token's name: digits only.
pub(crate) fn count(raw: &str, digits: &str, name: &str, example: &str) -> Result<usize, String> {
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("`{raw}`: expected a number after `{name}`, e.g. {example}"));
    }
    digits.parse().map_err(|_| format!("`{raw}`: the number is too large"))
}

/// A count that must be at least 1.
pub(crate) fn positive(
    raw: &str,
    digits: &str,
    name: &str,
    example: &str,
) -> Result<usize, String> {
    let n = count(raw, digits, name, example)?;
    if n == 0 {
        return Err(format!("`{raw}`: {name} must be at least 1 (1 means not split)"));
    }
    Ok(n)
}

impl fmt::Display for ParallelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.canonical())
    }
}

impl FromStr for ParallelConfig {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<ParallelConfig> {
        ParallelConfig::parse(s)
    }
}
