//! Parallelism config strings: one grammar and one type ([`ParallelConfig`]) for the CLI, plan
//! files, explanations and tests.
//!
//! ```text
//! config := token ((' ' | '+')+ token)*          case-insensitive
//! token  := dpN | tpN | zeroK | mbN | sp | ckpt=MODE   N >= 1, K in 0..=3
//! MODE   := none | selective | full
//! ```
//!
//! Defaults: `dp1 tp1 zero0 mb1`, no `sp`, checkpointing searched (no `ckpt=`: the planner
//! picks a mode per block under the budget). Canonical form: `dp{dp} tp{tp}` always, then
//! `sp`, `zero{k}` if k > 0, `mb{n}` if n > 1 and `ckpt={mode}` if given — e.g.
//! `dp2 tp4 sp zero1 mb4 ckpt=selective`, or `dp8 tp1` for pure data parallelism. `ppN` and
//! `sched=...` are reserved for pipeline parallelism and rejected until it lands.

use crate::pipeline::ScheduleKind;
use crate::{PlanError, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use tessera_ir::CkptMode;

/// How one training step is split: data-parallel and tensor-parallel degrees, ZeRO stage,
/// micro-batches (gradient accumulation) and sequence parallelism.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParallelConfig {
    /// Data-parallel degree (replicas).
    pub dp: usize,
    /// Tensor-parallel degree (Megatron-style column/row sharding).
    pub tp: usize,
    /// ZeRO stage over the data-parallel axis: 0 none, 1 optimizer state, 2 + gradients,
    /// 3 + parameters.
    pub zero: u8,
    /// Micro-batches per step (gradient accumulation; the pipeline's micro-batches later).
    pub micro_batches: usize,
    /// Sequence parallelism: norms and dropout sharded over the sequence on the tp axis.
    pub sp: bool,
    /// Activation checkpointing on every block; `None`: chosen per block by the planner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ckpt: Option<CkptMode>,
    /// Pipeline stages (devices along the pipeline axis); 1: no pipeline.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub pp: usize,
    /// The pipeline schedule (`None`: the default, 1F1B, or the planner's choice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<ScheduleKind>,
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

const GRAMMAR: &str = "a config is tokens dpN, tpN, zeroK (K = 0..3), mbN, sp and \
                       ckpt=none|selective|full, separated by spaces or +, e.g. \
                       `dp2 tp4 sp zero1 mb4 ckpt=selective`";

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
            if let Some(msg) = reserved(raw, &tok) {
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
    pub fn validate(&self) -> Result<()> {
        if self.dp == 0 || self.tp == 0 || self.micro_batches == 0 {
            return Err(PlanError::Invalid(
                "dp, tp and mb must be at least 1 (1 means not split)".into(),
            ));
        }
        if self.dp.checked_mul(self.tp).and_then(|n| n.checked_mul(self.micro_batches)).is_none() {
            return Err(PlanError::Invalid(format!(
                "dp{} × tp{} × mb{} overflows: no cluster or batch is that large; use smaller \
                 degrees",
                self.dp, self.tp, self.micro_batches
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
        Ok(())
    }

    /// `dp2 tp4 sp zero1 mb4`; `dp8 tp1` for pure data parallelism. Parses back to `self`.
    pub fn canonical(&self) -> String {
        let mut s = format!("dp{} tp{}", self.dp, self.tp);
        if self.sp {
            s.push_str(" sp");
        }
        if self.zero > 0 {
            s.push_str(&format!(" zero{}", self.zero));
        }
        if self.micro_batches > 1 {
            s.push_str(&format!(" mb{}", self.micro_batches));
        }
        if let Some(m) = self.ckpt {
            s.push_str(&format!(" ckpt={m}"));
        }
        s
    }

    /// Devices the config spans: dp × tp.
    pub fn devices(&self) -> usize {
        self.dp * self.tp
    }

    /// Errs unless the config spans exactly `num_devices`.
    pub fn check_devices(&self, num_devices: usize) -> Result<()> {
        if self.devices() == num_devices {
            return Ok(());
        }
        Err(PlanError::Invalid(format!(
            "config `{}` spans dp×tp = {} devices but the cluster has {num_devices}: choose \
             degrees that multiply to {num_devices}",
            self.canonical(),
            self.devices()
        )))
    }

    /// The equivalent Megatron-LM flags: `--tensor-model-parallel-size`, then
    /// `--sequence-parallel` and `--use-distributed-optimizer` (ZeRO-1: optimizer state sharded
    /// over data-parallel ranks) when set. The data-parallel degree is implied by the world
    /// size (`dp = world / tp`), so it has no flag; `mbN` is gradient accumulation, which
    /// Megatron derives from `--global-batch-size = N × dp × --micro-batch-size`. ZeRO-2 and -3
    /// have no exact Megatron flag (the distributed optimizer is the closest, and it is what is
    /// emitted); they map to DeepSpeed stages — see [`ParallelConfig::deepspeed_config`].
    pub fn megatron_flags(&self) -> String {
        let mut flags = vec![format!("--tensor-model-parallel-size {}", self.tp)];
        if self.sp {
            flags.push("--sequence-parallel".into());
        }
        if self.zero >= 1 {
            flags.push("--use-distributed-optimizer".into());
        }
        flags.join(" ")
    }

    /// The DeepSpeed config fragment: `zero_optimization.stage` and
    /// `gradient_accumulation_steps` (tensor parallelism is not DeepSpeed's; combine with
    /// [`ParallelConfig::megatron_flags`] as Megatron-DeepSpeed does).
    pub fn deepspeed_config(&self) -> serde_json::Value {
        serde_json::json!({
            "zero_optimization": { "stage": self.zero },
            "gradient_accumulation_steps": self.micro_batches,
        })
    }
}

/// The message for a token reserved for a later feature, if `tok` is one.
fn reserved(raw: &str, tok: &str) -> Option<String> {
    if tok.starts_with("sched=") || tok == "sched" {
        Some(format!(
            "`{raw}`: pipeline schedules are not supported yet (planned, with pipeline \
             parallelism); remove it"
        ))
    } else if tok == "ckpt" {
        Some(format!("`{raw}`: write ckpt=none, ckpt=selective or ckpt=full"))
    } else if tok.strip_prefix("pp").is_some_and(|n| n.chars().all(|c| c.is_ascii_digit())) {
        Some(format!("`{raw}`: pipeline parallelism is not supported yet (planned); remove it"))
    } else {
        None
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
        for s in ["dp2 tp4 zero1 mb2 sp", "zero2", "dp8", "mb8+tp2+sp", "dp16 tp8 zero3"] {
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

    #[test]
    fn reserved_tokens_are_rejected_by_kind() {
        let e = err("tp2+pp4");
        assert!(e.contains("`pp4`: pipeline parallelism is not supported yet"), "{e}");
        assert!(e.contains("remove it"), "{e}");
        let e = err("dp2 sched=1f1b");
        assert!(e.contains("`sched=1f1b`") && e.contains("schedules"), "{e}");
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
    }

    #[test]
    fn validate_catches_hand_built_configs() {
        assert!(cfg(0, 1, 0, 1, false).validate().is_err());
        assert!(cfg(1, 1, 4, 1, false).validate().is_err());
        assert!(cfg(2, 1, 0, 1, true).validate().is_err());
        assert!(cfg(2, 2, 0, 1, true).validate().is_ok());
    }
}
