//! Parallelism config strings: one grammar and one type ([`ParallelConfig`]) for the CLI, plan
//! files, explanations and tests.
//!
//! ```text
//! config := token ((' ' | '+')+ token)*          case-insensitive, each kind at most once
//! token  := dpN | tpN | ppN | zeroK | mbN | sp | ckpt=MODE | sched=SCHED
//!                                                N >= 1, K in 0..=3
//! MODE   := none | selective | full
//! SCHED  := gpipe | 1f1b | interleaved:V | zb-h1  V >= 2 (chunks per device)
//! ```
//!
//! Defaults: `dp1 tp1 pp1 zero0 mb1`, no `sp`, no schedule (`sched=` not given: 1F1B, or the
//! planner's choice), checkpointing searched (no `ckpt=`: the planner picks a mode per block
//! under the budget). A schedule needs a pipeline: `sched=` with pp1 is refused.
//!
//! Canonical form ([`ParallelConfig::canonical`], also `Display`): `dp{dp} tp{tp}` always, then
//! `pp{pp}` if pp > 1, `sp`, `zero{k}` if k > 0, `mb{n}` if n > 1, `sched={schedule}` if given
//! and `ckpt={mode}` if given — e.g. `dp2 tp4 sp zero1 mb4 ckpt=selective`,
//! `dp2 tp2 pp4 zero1 mb8 sched=interleaved:2`, or `dp8 tp1` for pure data parallelism. It
//! parses back to the same config.
//!
//! A config spans dp × tp × pp devices ([`ParallelConfig::check_devices`]). The rules that need
//! the model (enough blocks for the stages and chunks, Megatron's micro-batch rule for
//! interleaving) are in [`ParallelConfig::check_pipeline`].

use crate::pipeline::ScheduleKind;
use crate::{PlanError, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use tessera_ir::CkptMode;

/// How one training step is split: data-parallel, tensor-parallel and pipeline degrees, ZeRO
/// stage, micro-batches (gradient accumulation), sequence parallelism and the pipeline
/// schedule.
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
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

const GRAMMAR: &str = "a config is tokens dpN, tpN, ppN, zeroK (K = 0..3), mbN, sp, \
                       ckpt=none|selective|full and sched=gpipe|1f1b|interleaved:V|zb-h1 \
                       (with ppN, N > 1), separated by spaces or +, e.g. \
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
        }
    }
}

impl ParallelConfig {
    /// Parses and validates a config string (see the module docs).
    pub fn parse(s: &str) -> Result<ParallelConfig> {
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
        for raw in s.split(|c: char| c == '+' || c.is_whitespace()).filter(|t| !t.is_empty()) {
            any = true;
            let tok = raw.to_ascii_lowercase();
            if let Some(msg) = bare_keyword(raw, &tok) {
                return Err(invalid(msg));
            }
            let kind: &'static str = if tok == "sp" {
                cfg.sp = true;
                "sp"
            } else if let Some(mode) = tok.strip_prefix("ckpt=") {
                cfg.ckpt = Some(CkptMode::parse(mode).ok_or_else(|| {
                    invalid(format!(
                        "`{raw}`: checkpoint modes are none, selective and full, e.g. ckpt=full"
                    ))
                })?);
                "ckpt"
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
        cfg.validate().map_err(|e| invalid(e.to_string()))?;
        Ok(cfg)
    }

    /// Checks the rules a parsed config obeys (for configs built or deserialised directly).
    /// The rules that need the model are [`ParallelConfig::check_pipeline`]'s.
    pub fn validate(&self) -> Result<()> {
        if self.dp == 0 || self.tp == 0 || self.pp == 0 || self.micro_batches == 0 {
            return Err(PlanError::Invalid(
                "dp, tp, pp and mb must be at least 1 (1 means not split)".into(),
            ));
        }
        let product = [self.tp, self.pp, self.micro_batches]
            .iter()
            .try_fold(self.dp, |n, &k| n.checked_mul(k));
        if product.is_none() {
            return Err(PlanError::Invalid(format!(
                "dp{} × tp{} × pp{} × mb{} overflows: no cluster or batch is that large; use \
                 smaller degrees",
                self.dp, self.tp, self.pp, self.micro_batches
            )));
        }
        if self.zero > 3 {
            return Err(PlanError::Invalid(format!(
                "zero{}: ZeRO has stages 0 to 3; write zero1, zero2 or zero3",
                self.zero
            )));
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
        if num_blocks.is_multiple_of(pp) {
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
        let mut s = format!("dp{} tp{}", self.dp, self.tp);
        if self.pp > 1 {
            s.push_str(&format!(" pp{}", self.pp));
        }
        if self.sp {
            s.push_str(" sp");
        }
        if self.zero > 0 {
            s.push_str(&format!(" zero{}", self.zero));
        }
        if self.micro_batches > 1 {
            s.push_str(&format!(" mb{}", self.micro_batches));
        }
        if let Some(sched) = self.schedule {
            s.push_str(&format!(" sched={sched}"));
        }
        if let Some(m) = self.ckpt {
            s.push_str(&format!(" ckpt={m}"));
        }
        s
    }

    /// Devices the config spans: dp × tp × pp (saturating; a validated config does not
    /// overflow).
    pub fn devices(&self) -> usize {
        self.dp.saturating_mul(self.tp).saturating_mul(self.pp)
    }

    /// Errs unless the config spans exactly `num_devices`; the message suggests the
    /// data-parallel degree that would fit when there is one.
    pub fn check_devices(&self, num_devices: usize) -> Result<()> {
        if self.devices() == num_devices {
            return Ok(());
        }
        let model_parallel = self.tp.saturating_mul(self.pp);
        let fix = if num_devices > 0 && num_devices.is_multiple_of(model_parallel) {
            let fitted = ParallelConfig { dp: num_devices / model_parallel, ..self.clone() };
            format!("e.g. `{}`", fitted.canonical())
        } else {
            "choose other degrees".to_string()
        };
        Err(PlanError::Invalid(format!(
            "config `{}` spans dp×tp×pp = {}×{}×{} = {} devices but the cluster has \
             {num_devices}: choose degrees that multiply to {num_devices}, {fix}",
            self.canonical(),
            self.dp,
            self.tp,
            self.pp,
            self.devices()
        )))
    }

    /// The equivalent Megatron-LM flags: `--tensor-model-parallel-size`, then
    /// `--pipeline-model-parallel-size` when pp > 1, `--num-virtual-stages-per-pipeline-rank V`
    /// for `sched=interleaved:V`, `--sequence-parallel` and `--use-distributed-optimizer`
    /// (ZeRO-1: optimizer state sharded over data-parallel ranks) when set. The data-parallel
    /// degree is implied by the world size (`dp = world / (tp × pp)`), so it has no flag; `mbN`
    /// is gradient accumulation (the pipeline's micro-batches), which Megatron derives from
    /// `--global-batch-size = N × dp × --micro-batch-size`. ZeRO-2 and -3 have no exact
    /// Megatron flag (the distributed optimizer is the closest, and it is what is emitted);
    /// they map to DeepSpeed stages — see [`ParallelConfig::deepspeed_config`].
    ///
    /// Schedules: Megatron runs 1F1B by default, and interleaved 1F1B with virtual stages.
    /// `--num-virtual-stages-per-pipeline-rank` is recent Megatron-LM's flag; older releases
    /// only take `--num-layers-per-virtual-pipeline-stage` (layers / pp / V), which needs the
    /// model's layer count and is not emitted. GPipe and ZB-H1 have no Megatron-LM flag: those
    /// configs get 1F1B's flags.
    pub fn megatron_flags(&self) -> String {
        let mut flags = vec![format!("--tensor-model-parallel-size {}", self.tp)];
        if self.pp > 1 {
            flags.push(format!("--pipeline-model-parallel-size {}", self.pp));
            if let Some(ScheduleKind::Interleaved { v }) = self.schedule {
                flags.push(format!("--num-virtual-stages-per-pipeline-rank {v}"));
            }
        }
        if self.sp {
            flags.push("--sequence-parallel".into());
        }
        if self.zero >= 1 {
            flags.push("--use-distributed-optimizer".into());
        }
        flags.join(" ")
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

/// The message for a keyword given without its `=value`, if `tok` is one.
fn bare_keyword(raw: &str, tok: &str) -> Option<String> {
    match tok {
        "ckpt" => Some(format!("`{raw}`: write ckpt=none, ckpt=selective or ckpt=full")),
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
mod tests {
    use super::*;

    fn cfg(dp: usize, tp: usize, zero: u8, micro_batches: usize, sp: bool) -> ParallelConfig {
        ParallelConfig { dp, tp, zero, micro_batches, sp, ckpt: None, pp: 1, schedule: None }
    }

    fn err(s: &str) -> String {
        ParallelConfig::parse(s).expect_err(s).to_string()
    }

    #[test]
    fn parses_tokens_in_any_order_and_case() {
        let cases = [
            ("dp2 tp4 zero1 mb2 sp", cfg(2, 4, 1, 2, true)),
            ("SP+TP4+dp2", cfg(2, 4, 0, 1, true)),
            ("zero2", cfg(1, 1, 2, 1, false)),
            ("dp8", cfg(8, 1, 0, 1, false)),
            ("  tp2 +  dp4  ", cfg(4, 2, 0, 1, false)),
            ("dp1 tp1 zero0 mb1", ParallelConfig::default()),
            ("dp4 zero3", cfg(4, 1, 3, 1, false)),
            ("zero1", cfg(1, 1, 1, 1, false)),
        ];
        for (s, want) in cases {
            assert_eq!(ParallelConfig::parse(s).unwrap(), want, "{s}");
            assert_eq!(s.parse::<ParallelConfig>().unwrap(), want, "{s}");
        }
    }

    #[test]
    fn canonical_form_and_round_trip() {
        assert_eq!(cfg(2, 4, 1, 4, true).canonical(), "dp2 tp4 sp zero1 mb4");
        assert_eq!(cfg(8, 1, 0, 1, false).canonical(), "dp8 tp1");
        assert_eq!(cfg(1, 1, 2, 1, false).to_string(), "dp1 tp1 zero2");
        for s in [
            "dp2 tp4 zero1 mb2 sp",
            "zero2",
            "dp8",
            "mb8+tp2+sp",
            "dp16 tp8 zero3",
            "pp4 mb8 sched=interleaved:2 ckpt=selective",
        ] {
            let c = ParallelConfig::parse(s).unwrap();
            let canon = c.canonical();
            let back = ParallelConfig::parse(&canon).unwrap();
            assert_eq!(back, c, "{s}");
            assert_eq!(back.canonical(), canon, "{s}");
        }
    }

    #[test]
    fn devices_is_dp_times_tp() {
        let c = ParallelConfig::parse("dp2 tp4").unwrap();
        assert_eq!(c.devices(), 8);
        assert!(c.check_devices(8).is_ok());
        let e = c.check_devices(16).unwrap_err().to_string();
        assert!(e.contains("8 devices") && e.contains("16"), "{e}");
    }

    fn pipe(dp: usize, tp: usize, pp: usize, schedule: Option<ScheduleKind>) -> ParallelConfig {
        ParallelConfig { dp, tp, pp, schedule, ..ParallelConfig::default() }
    }

    #[test]
    fn pipeline_tokens_parse_and_round_trip() {
        let cases = [
            ("pp4", pipe(1, 1, 4, None), "dp1 tp1 pp4"),
            ("tp2+pp4", pipe(1, 2, 4, None), "dp1 tp2 pp4"),
            (
                "dp2 tp2 pp4 zero1",
                ParallelConfig { zero: 1, ..pipe(2, 2, 4, None) },
                "dp2 tp2 pp4 zero1",
            ),
            (
                "pp2 sched=interleaved:2",
                pipe(1, 1, 2, Some(ScheduleKind::Interleaved { v: 2 })),
                "dp1 tp1 pp2 sched=interleaved:2",
            ),
            ("pp2 sched=zb-h1", pipe(1, 1, 2, Some(ScheduleKind::ZbH1)), "dp1 tp1 pp2 sched=zb-h1"),
            (
                "pp2 sched=gpipe",
                pipe(1, 1, 2, Some(ScheduleKind::Gpipe)),
                "dp1 tp1 pp2 sched=gpipe",
            ),
            (
                "PP2 SCHED=1F1B",
                pipe(1, 1, 2, Some(ScheduleKind::OneFOneB)),
                "dp1 tp1 pp2 sched=1f1b",
            ),
            (
                "sched=1f1b pp2",
                pipe(1, 1, 2, Some(ScheduleKind::OneFOneB)),
                "dp1 tp1 pp2 sched=1f1b",
            ),
            ("pp1 dp4", pipe(4, 1, 1, None), "dp4 tp1"),
            (
                "ckpt=full sched=Interleaved:4 mb8 sp tp2 pp3 zero1 dp2",
                ParallelConfig {
                    zero: 1,
                    micro_batches: 8,
                    sp: true,
                    ckpt: Some(CkptMode::Full),
                    ..pipe(2, 2, 3, Some(ScheduleKind::Interleaved { v: 4 }))
                },
                "dp2 tp2 pp3 sp zero1 mb8 sched=interleaved:4 ckpt=full",
            ),
        ];
        for (s, want, canon) in cases {
            let c = ParallelConfig::parse(s).unwrap();
            assert_eq!(c, want, "{s}");
            assert_eq!(c.canonical(), canon, "{s}");
            assert_eq!(c.to_string(), canon, "{s}");
            assert_eq!(canon.parse::<ParallelConfig>().unwrap(), c, "{s}");
            assert!(c.validate().is_ok(), "{s}");
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(serde_json::from_str::<ParallelConfig>(&json).unwrap(), c, "{json}");
        }
        // pp1 and no schedule stay out of plan files written before pipelines.
        let json = serde_json::to_value(ParallelConfig::parse("dp2").unwrap()).unwrap();
        assert!(json.get("pp").is_none() && json.get("schedule").is_none(), "{json}");
    }

    #[test]
    fn malformed_pipeline_tokens_name_the_problem() {
        let e = err("pp0");
        assert!(e.contains("`pp0`: pp must be at least 1"), "{e}");
        let e = err("ppx");
        assert!(e.contains("expected a number after `pp`") && e.contains("pp4"), "{e}");
        let e = err("pp2 sched=foo");
        assert!(e.contains("`sched=foo`: schedules are gpipe, 1f1b, interleaved:V"), "{e}");
        assert!(e.contains("zb-h1"), "{e}");
        let e = err("pp2 sched=");
        assert!(e.contains("schedules are"), "{e}");
        let e = err("pp2 sched");
        assert!(e.contains("write sched=gpipe"), "{e}");
        let e = err("pp2 sched=interleaved");
        assert!(e.contains("`sched=interleaved`") && e.contains("interleaved:2"), "{e}");
        let e = err("pp2 sched=interleaved:1");
        assert!(e.contains("at least 2 chunks") && e.contains("sched=1f1b"), "{e}");
        let e = err("pp2 sched=interleaved:0");
        assert!(e.contains("at least 2 chunks"), "{e}");
        let e = err("pp2 sched=interleaved:x");
        assert!(e.contains("expected a number after `interleaved:`"), "{e}");
        let e = err("pp2 sched=interleaved:99999999999999999999999");
        assert!(e.contains("too large"), "{e}");
        let e = err("sched=1f1b");
        assert!(e.contains("a schedule needs pp >= 2; add ppN"), "{e}");
        let e = err("dp2 pp1 sched=zb-h1");
        assert!(e.contains("a schedule needs pp >= 2") && e.contains("pp2 sched=zb-h1"), "{e}");
        let e = err("pp2 pp4");
        assert!(e.contains("`pp` is given twice"), "{e}");
        let e = err("pp2 sched=1f1b sched=gpipe");
        assert!(e.contains("`sched` is given twice"), "{e}");
        let e = err("dp4294967296 pp4294967296");
        assert!(e.contains("overflows") && e.contains("pp4294967296"), "{e}");
    }

    #[test]
    fn devices_count_the_pipeline() {
        let c = ParallelConfig::parse("dp2 tp2 pp4 zero1").unwrap();
        assert_eq!(c.devices(), 16);
        assert!(c.check_devices(16).is_ok());
        let e = ParallelConfig::parse("dp2 pp4").unwrap().check_devices(4).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("dp×tp×pp = 2×1×4 = 8 devices"), "{e}");
        assert!(e.contains("the cluster has 4") && e.contains("multiply to 4"), "{e}");
        assert!(e.contains("e.g. `dp1 tp1 pp4`"), "{e}");
        // No data-parallel degree fits: no example.
        let e = ParallelConfig::parse("tp2 pp4").unwrap().check_devices(4).unwrap_err();
        assert!(!e.to_string().contains("e.g."), "{e}");
    }

    #[test]
    fn check_pipeline_needs_enough_blocks() {
        let c = ParallelConfig::parse("pp8").unwrap();
        let e = c.check_pipeline(4, None).unwrap_err().to_string();
        assert!(
            e.contains("pp8 needs at least 8 blocks; the model has 4: use pp4 or fewer"),
            "{e}"
        );
        assert!(c.check_pipeline(8, None).is_ok());
        assert!(c.check_pipeline(13, Some(3)).is_ok(), "1f1b has no micro-batch rule");
        let e = ParallelConfig::parse("pp2").unwrap().check_pipeline(1, None).unwrap_err();
        assert!(e.to_string().contains("drop ppN"), "{e}");
        // No pipeline, nothing to check.
        assert!(ParallelConfig::parse("dp4").unwrap().check_pipeline(0, Some(3)).is_ok());
        for s in ["pp4 sched=gpipe mb3", "pp4 sched=zb-h1", "pp4 sched=1f1b mb5"] {
            assert!(ParallelConfig::parse(s).unwrap().check_pipeline(6, Some(7)).is_ok(), "{s}");
        }
    }

    #[test]
    fn check_pipeline_interleaved_rules() {
        let c = ParallelConfig::parse("pp2 sched=interleaved:3").unwrap();
        // 8 blocks: 4 per stage, which 3 chunks do not split.
        let e = c.check_pipeline(8, None).unwrap_err().to_string();
        assert!(e.contains("sched=interleaved:3 on pp2"), "{e}");
        assert!(e.contains("each stage's 4 blocks (8 blocks / pp2) do not split into 3"), "{e}");
        assert!(e.contains("interleaved:2, interleaved:4"), "{e}");
        assert!(c.check_pipeline(12, None).is_ok());
        // Uneven stages: only every virtual stage needing a block.
        assert!(c.check_pipeline(7, None).is_ok());
        let e = c.check_pipeline(5, None).unwrap_err().to_string();
        assert!(e.contains("pp × V = 2 × 3 virtual stages") && e.contains("has 5 blocks"), "{e}");
        assert!(e.contains("use sched=interleaved:2 or fewer chunks"), "{e}");
        let e = c.check_pipeline(3, None).unwrap_err().to_string();
        assert!(e.contains("use sched=1f1b"), "{e}");
        // Megatron: micro-batches a multiple of pp.
        let c = ParallelConfig::parse("pp4 mb6 sched=interleaved:2").unwrap();
        let e = c.check_pipeline(16, None).unwrap_err().to_string();
        assert!(e.contains("multiple of pp = 4") && e.contains("but it is 6"), "{e}");
        assert!(e.contains("use mb4 or mb8"), "{e}");
        assert!(c.check_pipeline(16, Some(8)).is_err(), "the config's mb wins over the hint");
        let c = ParallelConfig::parse("pp4 sched=interleaved:2").unwrap();
        assert!(c.check_pipeline(16, None).is_ok());
        assert!(c.check_pipeline(16, Some(8)).is_ok());
        let e = c.check_pipeline(16, Some(2)).unwrap_err().to_string();
        assert!(e.contains("but it is 2: use mb4"), "{e}");
        // Hand-built configs are validated first.
        let bad = pipe(1, 1, 0, None);
        assert!(bad.check_pipeline(4, None).is_err());
        let bad = pipe(1, 1, 2, Some(ScheduleKind::Interleaved { v: 1 }));
        assert!(bad.check_pipeline(4, None).unwrap_err().to_string().contains("V >= 2"));
    }

    #[test]
    fn ckpt_modes_parse_and_round_trip() {
        for (s, mode) in [
            ("dp2 ckpt=none", CkptMode::None),
            ("dp2 tp2 ckpt=Selective", CkptMode::Selective),
            ("dp2+ckpt=full", CkptMode::Full),
        ] {
            let c = ParallelConfig::parse(s).unwrap();
            assert_eq!(c.ckpt, Some(mode), "{s}");
            assert_eq!(ParallelConfig::parse(&c.canonical()).unwrap(), c, "{s}");
        }
        assert_eq!(ParallelConfig::parse("dp2").unwrap().ckpt, None);
        let e = err("dp2 ckpt=some");
        assert!(e.contains("none, selective and full"), "{e}");
        let e = err("dp2 ckpt");
        assert!(e.contains("ckpt=full"), "{e}");
        let e = err("ckpt=full ckpt=none");
        assert!(e.contains("`ckpt` is given twice"), "{e}");
    }

    #[test]
    fn malformed_configs_name_the_problem() {
        let e = err("dp2 foo");
        assert!(e.contains("unknown token `foo`") && e.contains("dpN"), "{e}");
        let e = err("dp2 dp4");
        assert!(e.contains("`dp` is given twice"), "{e}");
        let e = err("dp2 tp2 sp sp");
        assert!(e.contains("`sp` is given twice"), "{e}");
        let e = err("dp0");
        assert!(e.contains("at least 1"), "{e}");
        let e = err("tp0");
        assert!(e.contains("at least 1"), "{e}");
        let e = err("mb0");
        assert!(e.contains("at least 1"), "{e}");
        let e = err("zero4");
        assert!(e.contains("stages 0 to 3"), "{e}");
        let e = err("dp2 sp");
        assert!(e.contains("add tpN with N > 1"), "{e}");
        let e = err("tp1 sp");
        assert!(e.contains("add tpN with N > 1"), "{e}");
        let e = err("dpx");
        assert!(e.contains("expected a number after `dp`"), "{e}");
        let e = err("zero");
        assert!(e.contains("expected a number after `zero`"), "{e}");
        let e = err("tp-2");
        assert!(e.contains("expected a number"), "{e}");
        let e = err("dp99999999999999999999999");
        assert!(e.contains("too large"), "{e}");
        let e = err("   ");
        assert!(e.contains("empty") && e.contains("e.g."), "{e}");
        let e = err("++");
        assert!(e.contains("empty"), "{e}");
    }

    #[test]
    fn zero_without_dp_is_kept() {
        let c = ParallelConfig::parse("tp2 zero1").unwrap();
        assert_eq!(c.zero, 1);
        assert_eq!(c.canonical(), "dp1 tp2 zero1");
    }

    #[test]
    fn megatron_and_deepspeed_exports() {
        let c = ParallelConfig::parse("dp2 tp4 sp zero1 mb4").unwrap();
        assert_eq!(
            c.megatron_flags(),
            "--tensor-model-parallel-size 4 --sequence-parallel --use-distributed-optimizer"
        );
        assert_eq!(
            ParallelConfig::parse("dp8").unwrap().megatron_flags(),
            "--tensor-model-parallel-size 1"
        );
        let ds = ParallelConfig::parse("dp8 zero3 mb2").unwrap().deepspeed_config();
        assert_eq!(ds["zero_optimization"]["stage"], 3);
        assert_eq!(ds["gradient_accumulation_steps"], 2);
        assert!(ds.get("pipeline").is_none(), "{ds}");
        let c = ParallelConfig::parse("dp2 tp2 pp4 zero1 mb8").unwrap();
        assert_eq!(
            c.megatron_flags(),
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 \
             --use-distributed-optimizer"
        );
        let ds = c.deepspeed_config();
        assert_eq!(ds["pipeline"]["stages"], 4);
        assert_eq!(ds["gradient_accumulation_steps"], 8);
        let c = ParallelConfig::parse("tp2 pp4 sp mb8 sched=interleaved:2").unwrap();
        assert_eq!(
            c.megatron_flags(),
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 \
             --num-virtual-stages-per-pipeline-rank 2 --sequence-parallel"
        );
        for s in ["pp2 sched=gpipe", "pp2 sched=zb-h1", "pp2 sched=1f1b", "pp2"] {
            assert_eq!(
                ParallelConfig::parse(s).unwrap().megatron_flags(),
                "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2",
                "{s}"
            );
        }
    }

    #[test]
    fn validate_catches_hand_built_configs() {
        assert!(cfg(0, 1, 0, 1, false).validate().is_err());
        assert!(cfg(1, 1, 4, 1, false).validate().is_err());
        assert!(cfg(2, 1, 0, 1, true).validate().is_err());
        assert!(cfg(2, 2, 0, 1, true).validate().is_ok());
        assert!(pipe(1, 1, 0, None).validate().is_err());
        assert!(pipe(1, 1, 1, Some(ScheduleKind::OneFOneB)).validate().is_err());
        assert!(pipe(1, 1, 2, Some(ScheduleKind::Interleaved { v: 1 })).validate().is_err());
        assert!(pipe(1, 1, 2, Some(ScheduleKind::Interleaved { v: 2 })).validate().is_ok());
        assert!(pipe(usize::MAX, 1, 2, None).validate().is_err());
    }
}
