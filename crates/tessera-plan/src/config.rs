//! Parallelism config strings: one grammar and one type ([`ParallelConfig`]) for the CLI, plan
//! files, explanations and tests.
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
    pub cp_comm: Option<crate::context::CpComm>,
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

    fn parse(raw: &str, value: &str) -> std::result::Result<MlpMode, String> {
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

    fn parse(raw: &str, value: &str) -> std::result::Result<LossMode, String> {
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
    fn written(seen: &[&str]) -> Pins {
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

const GRAMMAR: &str = "a config is tokens dpN, tpN, cpN (cp=a2a), ppN, zeroK (K = 0..3), mbN, \
                       sp or sp=off, ckpt=none|selective|full, sched=gpipe|1f1b|interleaved:V|zb-h1 \
                       and stages=N[:MODE],... (with ppN, N > 1), \
                       offload=[act+]opt|grads+opt|all[:K/16]|act|none, nvme, shard=N and \
                       loss=whole|chunkN, mlp=whole|tileN, separated by spaces or +, e.g. \
                       `dp2 tp4 sp zero1 mb4 ckpt=selective` or `dp2 tp2 pp4 mb8 sched=1f1b`";

/// The schedules' spellings, for messages.
const SCHEDULES: &str = "gpipe, 1f1b, interleaved:V (V >= 2 chunks per device) and zb-h1";

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
    /// Parses and validates a config string (see the module docs); the knobs it does not
    /// write hold their defaults.
    pub fn parse(s: &str) -> Result<ParallelConfig> {
        ParallelConfig::parse_pinned(s).map(|(cfg, _)| cfg)
    }

    /// [`ParallelConfig::parse`], with which of the planner's free knobs the string writes.
    pub fn parse_pinned(s: &str) -> Result<(ParallelConfig, Pins)> {
        // A message that already quotes the whole config needs no `config ...:` prefix.
        let invalid = |msg: String| {
            if msg.starts_with(&format!("`{}`", s.trim())) {
                PlanError::Invalid(format!("config {msg}"))
            } else {
                PlanError::Invalid(format!("config `{}`: {msg}", s.trim()))
            }
        };
        let mut cfg = ParallelConfig::default();
        let mut seen: Vec<&'static str> = Vec::new();
        let mut any = false;
        // `grads+opt` and `act+opt` are one offload value, not two tokens joined by `+`.
        let joined = join_grads_opt(s);
        let mut nvme: Option<Option<u32>> = None;
        for raw in joined.split(|c: char| c == '+' || c.is_whitespace()).filter(|t| !t.is_empty()) {
            any = true;
            let tok = raw.to_ascii_lowercase();
            if let Some(msg) = bare_keyword(raw, &tok) {
                return Err(invalid(msg));
            }
            let cp_token = crate::context::parse_token(raw, &tok, &mut cfg.cp, &mut cfg.cp_comm);
            let ep_token = crate::expert::parse_token(raw, &tok, &mut cfg.ep);
            let kind: &'static str = if let Some(kind) = cp_token {
                kind.map_err(&invalid)?
            } else if let Some(kind) = ep_token {
                kind.map_err(&invalid)?
            } else if tok == "sp" || tok == "sp=off" {
                cfg.sp = tok == "sp";
                "sp"
            } else if tok == "offload=none" {
                cfg.offload = None;
                "offload"
            } else if tok == "nvme" {
                nvme = Some(None);
                "nvme"
            } else if let Some(k) = tok.strip_prefix("nvme:") {
                let k = positive(raw, k, "nvme:", "nvme:4").map_err(&invalid)?;
                nvme = Some(Some(u32::try_from(k).unwrap_or(u32::MAX)));
                "nvme"
            } else if let Some(value) = tok.strip_prefix("loss=") {
                cfg.loss = Some(LossMode::parse(raw, value).map_err(&invalid)?);
                "loss"
            } else if let Some(value) = tok.strip_prefix("mlp=") {
                cfg.mlp = Some(MlpMode::parse(raw, value).map_err(&invalid)?);
                "mlp"
            } else if let Some(n) = tok.strip_prefix("shard=") {
                cfg.shard = Some(positive(raw, n, "shard=", "shard=8").map_err(&invalid)?);
                "shard"
            } else if let Some(value) = tok.strip_prefix("offload=") {
                cfg.offload = Some(Offload::parse_value(raw, value).map_err(&invalid)?);
                "offload"
            } else if let Some(mode) = tok.strip_prefix("ckpt=") {
                cfg.ckpt = Some(CkptMode::parse(mode).ok_or_else(|| {
                    invalid(format!(
                        "`{raw}`: checkpoint modes are none, selective and full, e.g. ckpt=full"
                    ))
                })?);
                "ckpt"
            } else if let Some(list) = tok.strip_prefix("stages=") {
                cfg.stages = layout::parse_stages(raw, list).map_err(&invalid)?;
                "stages"
            } else if let Some(name) = tok.strip_prefix("sched=") {
                cfg.schedule = Some(schedule(raw, name).map_err(&invalid)?);
                "sched"
            } else if let Some(k) = tok.strip_prefix("zero") {
                let stage = count(raw, k, "zero", "zero1").map_err(&invalid)?;
                if stage > 3 {
                    return Err(invalid(format!(
                        "`{raw}`: ZeRO has stages 0 to 3; write zero1, zero2 or zero3"
                    )));
                }
                cfg.zero = stage as u8;
                "zero"
            } else if let Some(n) = tok.strip_prefix("dp") {
                cfg.dp = positive(raw, n, "dp", "dp8").map_err(&invalid)?;
                "dp"
            } else if let Some(n) = tok.strip_prefix("tp") {
                cfg.tp = positive(raw, n, "tp", "tp4").map_err(&invalid)?;
                "tp"
            } else if let Some(n) = tok.strip_prefix("pp") {
                cfg.pp = positive(raw, n, "pp", "pp4").map_err(&invalid)?;
                "pp"
            } else if let Some(n) = tok.strip_prefix("mb") {
                cfg.micro_batches = positive(raw, n, "mb", "mb4").map_err(&invalid)?;
                "mb"
            } else {
                return Err(invalid(format!("unknown token `{raw}`; {GRAMMAR}")));
            };
            if seen.contains(&kind) {
                return Err(invalid(format!("`{kind}` is given twice; keep one")));
            }
            seen.push(kind);
        }
        if !any {
            return Err(PlanError::Invalid(format!("empty parallel config; {GRAMMAR}")));
        }
        let pins = Pins::written(&seen);
        if let Some(k) = nvme {
            let Some(o) = cfg.offload.as_mut().filter(|o| o.moves_state()) else {
                return Err(invalid(
                    "`nvme` puts offloaded optimizer state on the NVMe: add offload=opt or \
                     offload=grads+opt"
                        .into(),
                ));
            };
            if k.is_some_and(|k| k > o.chunks) {
                return Err(invalid(format!(
                    "nvme:{} is more chunks than the {} offloaded: give at most nvme:{}",
                    k.unwrap_or(0),
                    o.chunks,
                    o.chunks
                )));
            }
            o.nvme = k.unwrap_or(o.chunks);
        }
        cfg.validate().map_err(|e| invalid(e.to_string()))?;
        Ok((cfg, pins))
    }

    /// Checks the rules a parsed config obeys (for configs built or deserialised directly).
    /// The rules that need the model are [`ParallelConfig::check_pipeline`]'s.
    pub fn validate(&self) -> Result<()> {
        if self.dp == 0 || self.tp == 0 || self.pp == 0 || self.micro_batches == 0 {
            return Err(PlanError::Invalid(
                "dp, tp, pp and mb must be at least 1 (1 means not split)".into(),
            ));
        }
        crate::context::validate(
            self.cp,
            self.cp_comm,
            self.shard.is_some(),
            // Activation offload alone composes (a rewrite of the checkpointed Program); model
            // state offload's chunks are laid out on a `[dp, tp]` mesh.
            self.offload.is_some_and(|o| o.moves_state()),
        )?;
        crate::expert::validate(
            self.ep,
            self.shard.is_some(),
            self.offload.is_some_and(|o| o.moves_state()),
        )?;
        let product = [self.tp, self.pp, self.micro_batches, self.cp, self.ep]
            .iter()
            .try_fold(self.dp, |n, &k| n.checked_mul(k));
        if product.is_none() {
            return Err(PlanError::Invalid(format!(
                "dp{} × cp{} × tp{} × pp{} × mb{} overflows: no cluster or batch is that large; \
                 use smaller degrees",
                self.dp, self.cp, self.tp, self.pp, self.micro_batches
            )));
        }
        if self.zero > 3 {
            return Err(PlanError::Invalid(format!(
                "zero{}: ZeRO has stages 0 to 3; write zero1, zero2 or zero3",
                self.zero
            )));
        }
        if self.offload.is_some() && self.pp > 1 {
            return Err(PlanError::Invalid(
                "offload with a pipeline (ppN) is not supported yet: drop offload= or ppN".into(),
            ));
        }
        if let Some(n) = self.shard {
            let why = if self.zero == 0 {
                Some("groups ZeRO's shards: add zero1, zero2 or zero3".to_string())
            } else if n < 2 || n >= self.dp || !self.dp.is_multiple_of(n) {
                Some(format!(
                    "needs a group of 1 < N < dp ranks with N dividing dp{} (shard=dp is plain \
                     ZeRO: drop shard=)",
                    self.dp
                ))
            } else if self.pp > 1 {
                Some("with a pipeline (ppN) is not supported yet: drop shard= or ppN".into())
            } else if self.offload.is_some() {
                Some("with offload= is not supported yet: drop one of them".into())
            } else {
                None
            };
            if let Some(why) = why {
                return Err(PlanError::Invalid(format!("shard={n} {why}")));
            }
        }
        if self.sp && self.tp < 2 {
            return Err(PlanError::Invalid(
                "sp shards the sequence over the tensor-parallel axis: add tpN with N > 1".into(),
            ));
        }
        if let Some(sched) = self.schedule {
            if let ScheduleKind::Interleaved { v } = sched {
                if v < 2 {
                    return Err(PlanError::Invalid(format!(
                        "sched=interleaved:{v}: interleaving needs at least 2 chunks per device \
                         (V >= 2), e.g. sched=interleaved:2; with one chunk write sched=1f1b"
                    )));
                }
            }
            if self.pp < 2 {
                return Err(PlanError::Invalid(format!(
                    "sched={sched}: a schedule needs pp >= 2; add ppN, e.g. `pp2 sched={sched}`"
                )));
            }
        }
        if !self.stages.is_empty() {
            let list = layout::format_stages(&self.stages);
            if self.pp < 2 {
                return Err(PlanError::Invalid(format!(
                    "stages={list}: stages need a pipeline; add ppN with N = the number of \
                     stages, e.g. `pp{} stages={list}`",
                    self.stages.len().max(2)
                )));
            }
            let chunks = self.schedule.map_or(1, ScheduleKind::chunks);
            let want = self.pp.saturating_mul(chunks);
            if self.stages.len() != want {
                return Err(PlanError::Invalid(format!(
                    "stages={list} lists {} stages but pp{} makes {want} virtual stages: give \
                     one block count per virtual stage",
                    self.stages.len(),
                    self.pp
                )));
            }
        }
        Ok(())
    }

    /// Checks the config against a model of `num_blocks` repeated blocks (the chain that
    /// pipeline stages cut): every stage needs a block (pp <= blocks). `interleaved:V` needs a
    /// block for each of its pp·V virtual stages, V must divide the blocks per stage when the
    /// blocks split evenly over the stages, and the micro-batch count must be a multiple of pp
    /// (Megatron's rule for the interleaved schedule). The micro-batch count is the config's
    /// `mbN` when N > 1, else `micro_batches_hint` (e.g. the count a planner is trying); with
    /// neither, that rule is not checked. GPipe, 1F1B and ZB-H1 need nothing more.
    pub fn check_pipeline(
        &self,
        num_blocks: usize,
        micro_batches_hint: Option<usize>,
    ) -> Result<()> {
        self.validate()?;
        let pp = self.pp;
        if pp == 1 {
            return Ok(());
        }
        if pp > num_blocks {
            let fix = if num_blocks >= 2 {
                format!("use pp{num_blocks} or fewer")
            } else {
                "drop ppN (no pipeline)".to_string()
            };
            return Err(PlanError::Invalid(format!(
                "pp{pp} needs at least {pp} blocks; the model has {num_blocks}: {fix}"
            )));
        }
        if !self.stages.is_empty() {
            let chunks = self.schedule.map_or(1, ScheduleKind::chunks);
            layout::check(&self.stages, pp, chunks, num_blocks)?;
        }
        let Some(ScheduleKind::Interleaved { v }) = self.schedule else {
            return Ok(());
        };
        let sched = format!("sched=interleaved:{v}");
        if pp.checked_mul(v).is_none_or(|stages| stages > num_blocks) {
            let most = num_blocks / pp;
            let fix = if most >= 2 {
                format!("use sched=interleaved:{most} or fewer chunks, or sched=1f1b")
            } else {
                "use sched=1f1b (no interleaving)".to_string()
            };
            return Err(PlanError::Invalid(format!(
                "{sched} on pp{pp} makes pp × V = {pp} × {v} virtual stages, each needing a \
                 block, but the model has {num_blocks} blocks: {fix}"
            )));
        }
        if num_blocks.is_multiple_of(pp) && self.stages.is_empty() {
            let per_stage = num_blocks / pp;
            if !per_stage.is_multiple_of(v) {
                let fits: Vec<String> = (2..=per_stage)
                    .filter(|w| per_stage.is_multiple_of(*w))
                    .map(|w| format!("interleaved:{w}"))
                    .collect();
                return Err(PlanError::Invalid(format!(
                    "{sched} on pp{pp}: each stage's {per_stage} blocks ({num_blocks} blocks / \
                     pp{pp}) do not split into {v} chunks: use V dividing {per_stage} ({}), or \
                     sched=1f1b",
                    fits.join(", ")
                )));
            }
        }
        let mb = if self.micro_batches > 1 { Some(self.micro_batches) } else { micro_batches_hint };
        if let Some(mb) = mb.filter(|mb| !mb.is_multiple_of(pp)) {
            let up = mb.div_ceil(pp).saturating_mul(pp);
            let down = mb / pp * pp;
            let fix =
                if down >= pp { format!("use mb{down} or mb{up}") } else { format!("use mb{up}") };
            return Err(PlanError::Invalid(format!(
                "{sched} on pp{pp} needs a micro-batch count that is a multiple of pp = {pp} \
                 (Megatron's interleaved schedule), but it is {mb}: {fix}, or sched=1f1b"
            )));
        }
        Ok(())
    }

    /// `dp2 tp4 sp zero1 mb4`; `dp8 tp1` for pure data parallelism; `dp2 tp2 pp4 mb8
    /// sched=1f1b`. The order is the module docs'. Parses back to `self`.
    pub fn canonical(&self) -> String {
        let mut s = format!("dp{}{} tp{}", self.dp, crate::expert::canonical(self.ep), self.tp);
        s.push_str(&crate::context::canonical(self.cp, self.cp_comm));
        if self.pp > 1 {
            s.push_str(&format!(" pp{}", self.pp));
        }
        if self.sp {
            s.push_str(" sp");
        }
        if self.zero > 0 {
            s.push_str(&format!(" zero{}", self.zero));
        }
        if let Some(n) = self.shard {
            s.push_str(&format!(" shard={n}"));
        }
        if self.micro_batches > 1 {
            s.push_str(&format!(" mb{}", self.micro_batches));
        }
        if let Some(sched) = self.schedule {
            s.push_str(&format!(" sched={sched}"));
        }
        if !self.stages.is_empty() {
            s.push_str(&format!(" stages={}", layout::format_stages(&self.stages)));
        }
        if let Some(m) = self.ckpt {
            s.push_str(&format!(" ckpt={m}"));
        }
        if let Some(o) = self.offload {
            s.push_str(&format!(" {o}"));
        }
        if let Some(l) = self.loss {
            s.push_str(&format!(" loss={l}"));
        }
        if let Some(m) = self.mlp {
            s.push_str(&format!(" mlp={m}"));
        }
        s
    }

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

    /// Errs unless the config spans exactly `num_devices`; the message suggests the
    /// data-parallel degree that would fit when there is one.
    pub fn check_devices(&self, num_devices: usize) -> Result<()> {
        if self.devices() == num_devices {
            return Ok(());
        }
        let model_parallel =
            self.ep.saturating_mul(self.cp).saturating_mul(self.tp).saturating_mul(self.pp);
        let fix = if num_devices > 0 && num_devices.is_multiple_of(model_parallel) {
            let fitted = self.clone().with_dp(num_devices / model_parallel);
            format!("e.g. `{}`", fitted.canonical())
        } else {
            "choose other degrees".to_string()
        };
        Err(PlanError::Invalid(format!(
            "config `{}` spans {} devices but the cluster has {num_devices}: choose \
             degrees that multiply to {num_devices}, {fix}",
            self.canonical(),
            match (self.ep > 1, self.cp > 1) {
                (true, _) => format!(
                    "dp×ep×cp×tp×pp = {}×{}×{}×{}×{} = {}",
                    self.dp,
                    self.ep,
                    self.cp,
                    self.tp,
                    self.pp,
                    self.devices()
                ),
                (false, true) => format!(
                    "dp×cp×tp×pp = {}×{}×{}×{} = {}",
                    self.dp,
                    self.cp,
                    self.tp,
                    self.pp,
                    self.devices()
                ),
                (false, false) =>
                    format!("dp×tp×pp = {}×{}×{} = {}", self.dp, self.tp, self.pp, self.devices()),
            }
        )))
    }

    /// The equivalent Megatron-LM flags: `--tensor-model-parallel-size`, then
    /// `--context-parallel-size N --cp-comm-type a2a` when cp > 1,
    /// `--pipeline-model-parallel-size` when pp > 1, `--num-virtual-stages-per-pipeline-rank V`
    /// for `sched=interleaved:V`, `--sequence-parallel` and `--use-distributed-optimizer`
    /// (ZeRO-1: optimizer state sharded over data-parallel ranks) when set. The data-parallel
    /// degree is implied by the world size (`dp = world / (tp × cp × pp)`), so it has no flag; `mbN`
    /// is gradient accumulation (the pipeline's micro-batches), which Megatron derives from
    /// `--global-batch-size = N × dp × --micro-batch-size`. ZeRO-2 and -3 have no exact
    /// Megatron flag (the distributed optimizer is the closest, and it is what is emitted);
    /// they map to DeepSpeed stages — see [`ParallelConfig::deepspeed_config`].
    ///
    /// Schedules: Megatron runs 1F1B by default, and interleaved 1F1B with virtual stages.
    /// `--num-virtual-stages-per-pipeline-rank` is recent Megatron-LM's flag; older releases
    /// only take `--num-layers-per-virtual-pipeline-stage` (layers / pp / V), which needs the
    /// model's layer count and is not emitted. GPipe and ZB-H1 have no Megatron-LM flag: those
    /// configs get 1F1B's flags. Unequal stages (`stages=`) whose middle stages are equal map
    /// to Megatron-core's `--decoder-first-pipeline-num-layers` and
    /// `--decoder-last-pipeline-num-layers`; other layouts and per-stage checkpointing have no
    /// Megatron flag.
    pub fn megatron_flags(&self) -> String {
        self.megatron_args().join(" ")
    }

    /// [`ParallelConfig::megatron_flags`], one argument (flag and value) per entry.
    pub fn megatron_args(&self) -> Vec<String> {
        let mut flags = vec![format!("--tensor-model-parallel-size {}", self.tp)];
        flags.extend(crate::context::megatron_args(self.cp, self.cp_comm));
        flags.extend(crate::expert::megatron_args(self.ep));
        if self.pp > 1 {
            flags.push(format!("--pipeline-model-parallel-size {}", self.pp));
            if let Some(ScheduleKind::Interleaved { v }) = self.schedule {
                flags.push(format!("--num-virtual-stages-per-pipeline-rank {v}"));
            }
            let sizes = layout::sizes(&self.stages);
            if let [first, middle @ .., last] = sizes.as_slice() {
                let even = middle.first().is_none_or(|m| middle.iter().all(|x| x == m));
                if self.schedule.map_or(1, ScheduleKind::chunks) == 1 && even {
                    flags.push(format!("--decoder-first-pipeline-num-layers {first}"));
                    flags.push(format!("--decoder-last-pipeline-num-layers {last}"));
                }
            }
        }
        if self.sp {
            flags.push("--sequence-parallel".into());
        }
        if self.zero >= 1 {
            flags.push("--use-distributed-optimizer".into());
            if self.replicas() > 1 {
                flags.push(format!("--num-distributed-optimizer-instances {}", self.replicas()));
            }
        }
        flags
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

/// `s` with every `grads+opt` (any case) written `grads_opt`, so splitting on `+` keeps it
/// whole.
fn join_grads_opt(s: &str) -> String {
    let mut s = s.to_string();
    for (joined, with) in [("grads+opt", "grads_opt"), ("offload=act+", "offload=act_")] {
        let lower = s.to_ascii_lowercase();
        let mut out = String::with_capacity(s.len());
        let mut i = 0;
        while let Some(k) = lower[i..].find(joined) {
            out.push_str(&s[i..i + k]);
            out.push_str(with);
            i += k + joined.len();
        }
        out.push_str(&s[i..]);
        s = out;
    }
    s
}

/// The message for a keyword given without its `=value`, if `tok` is one.
fn bare_keyword(raw: &str, tok: &str) -> Option<String> {
    match tok {
        "ckpt" => Some(format!("`{raw}`: write ckpt=none, ckpt=selective or ckpt=full")),
        "offload" => Some(format!(
            "`{raw}`: write offload=opt, offload=grads+opt or offload=all (optionally :K/16), \
             or offload=act (activations), alone or before them: offload=act+opt"
        )),
        "act" => Some(format!(
            "`{raw}`: activation offload is written offload=act, or before model-state \
             offload: offload=act+opt"
        )),
        "stages" => Some(format!(
            "`{raw}`: give the blocks of each virtual stage, e.g. stages=7:full,8,9,8 (with ppN)"
        )),
        "loss" => Some(format!("`{raw}`: write loss=whole or loss=chunkN, e.g. loss=chunk4096")),
        "mlp" => Some(format!("`{raw}`: write mlp=whole or mlp=tileN, e.g. mlp=tile8192")),
        "sched" => Some(format!(
            "`{raw}`: write sched=gpipe, sched=1f1b, sched=interleaved:V or sched=zb-h1 (with ppN)"
        )),
        _ => None,
    }
}

/// A schedule's name after `sched=` (lower-cased): see [`SCHEDULES`].
fn schedule(raw: &str, name: &str) -> Result<ScheduleKind, String> {
    match name {
        "gpipe" => Ok(ScheduleKind::Gpipe),
        "1f1b" => Ok(ScheduleKind::OneFOneB),
        "zb-h1" => Ok(ScheduleKind::ZbH1),
        "interleaved" => Err(format!(
            "`{raw}`: give the chunks per device as interleaved:V with V >= 2, e.g. \
             sched=interleaved:2"
        )),
        _ => {
            let Some(v) = name.strip_prefix("interleaved:") else {
                return Err(format!("`{raw}`: schedules are {SCHEDULES}, e.g. sched=1f1b"));
            };
            let v = count(raw, v, "interleaved:", "interleaved:2")?;
            if v < 2 {
                return Err(format!(
                    "`{raw}`: interleaving needs at least 2 chunks per device (V >= 2), e.g. \
                     sched=interleaved:2; with one chunk write sched=1f1b"
                ));
            }
            Ok(ScheduleKind::Interleaved { v })
        }
    }
}

/// The count after a token's name: digits only.
fn count(raw: &str, digits: &str, name: &str, example: &str) -> Result<usize, String> {
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("`{raw}`: expected a number after `{name}`, e.g. {example}"));
    }
    digits.parse().map_err(|_| format!("`{raw}`: the number is too large"))
}

/// A count that must be at least 1.
fn positive(raw: &str, digits: &str, name: &str, example: &str) -> Result<usize, String> {
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

#[cfg(test)]
mod tests;
