//! The config string's grammar over the registry: [`ParallelConfig::parse`] asks each axis
//! ([`AXES`]) for the tokens it owns, [`ParallelConfig::validate`] for its rules,
//! [`ParallelConfig::canonical`] for its tokens and [`ParallelConfig::megatron_args`] for its
//! flags. The grammar is `crate::config`'s module docs'; the type is `crate::config`'s.

use super::{export_fields, ConfigError, Engine, ExportFields, Token, AXES};
use crate::config::{ParallelConfig, Pins};
use crate::{PlanError, Result};

pub(super) const GRAMMAR: &str = "a config is tokens dpN, epN, tpN, cpN (cp=a2a|ring), ppN, zeroK (K = 0..3), mbN, \
                       sp or sp=off, ckpt=none|selective|full, sched=gpipe|1f1b|interleaved:V|zb-h1 \
                       and stages=N[:MODE],... (with ppN, N > 1), \
                       offload=[act+]opt|grads+opt|all[:K/16]|act|none, nvme, shard=N and \
                       loss=whole|chunkN, mlp=whole|tileN, separated by spaces or +, e.g. \
                       `dp2 tp4 sp zero1 mb4 ckpt=selective` or `dp2 tp2 pp4 mb8 sched=1f1b`";

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
        let mut seen: Vec<(&'static str, String)> = Vec::new();
        // `grads+opt` and `act+opt` are one offload value, not two tokens joined by `+`.
        let joined = join_grads_opt(s);
        for raw in joined.split(|c: char| c == '+' || c.is_whitespace()).filter(|t| !t.is_empty()) {
            let lower = raw.to_ascii_lowercase();
            let token = Token { raw, lower: &lower };
            if let Some(msg) = AXES.iter().find_map(|a| a.bare_keyword(token)) {
                return Err(invalid(msg));
            }
            let Some(parsed) = AXES.iter().find_map(|a| a.parse_token(token, &mut cfg)) else {
                return Err(invalid(format!("unknown token `{raw}`; {GRAMMAR}")));
            };
            let kind = parsed.map_err(&invalid)?;
            if seen.iter().any(|(k, _)| *k == kind) {
                return Err(invalid(format!("`{kind}` is given twice; keep one")));
            }
            seen.push((kind, lower.clone()));
        }
        if seen.is_empty() {
            return Err(PlanError::Invalid(format!("empty parallel config; {GRAMMAR}")));
        }
        let kinds: Vec<&str> = seen.iter().map(|(k, _)| *k).collect();
        let pins = Pins::written(&kinds);
        for a in AXES {
            a.finish(&mut cfg, &seen).map_err(&invalid)?;
        }
        cfg.validate()
            .map_err(|error| PlanError::Config { config: Some(s.trim().into()), error })?;
        Ok((cfg, pins))
    }

    /// Checks the rules a parsed config obeys (for configs built or deserialised directly):
    /// every degree at least 1 and their product in range, then each axis's rules
    /// ([`super::Axis::validate`]) in registry order. The rules that need the model are
    /// [`ParallelConfig::check_pipeline`]'s.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let degrees =
            [("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("mb", self.micro_batches)];
        if let Some(&(knob, _)) = degrees.iter().find(|(_, n)| *n == 0) {
            return Err(ConfigError::Zero {
                knob,
                message: "dp, tp, pp and mb must be at least 1 (1 means not split)".into(),
            });
        }
        if self.cp == 0 {
            return Err(ConfigError::Zero {
                knob: "cp",
                message: "cp must be at least 1 (1 means not split)".into(),
            });
        }
        if self.ep == 0 {
            return Err(ConfigError::Zero {
                knob: "ep",
                message: "ep must be at least 1 (1 means not split)".into(),
            });
        }
        let product = [self.tp, self.pp, self.micro_batches, self.cp, self.ep]
            .iter()
            .try_fold(self.dp, |n, &k| n.checked_mul(k));
        if product.is_none() {
            return Err(ConfigError::Overflow {
                message: format!(
                    "dp{} × cp{} × tp{} × pp{} × mb{} overflows: no cluster or batch is that \
                     large; use smaller degrees",
                    self.dp, self.cp, self.tp, self.pp, self.micro_batches
                ),
            });
        }
        AXES.iter().try_for_each(|a| a.validate(self))
    }

    /// `dp2 tp4 sp zero1 mb4`; `dp8 tp1` for pure data parallelism; `dp2 tp2 pp4 mb8
    /// sched=1f1b`: every axis's tokens in slot order ([`super::Slot`]). Parses back to `self`.
    pub fn canonical(&self) -> String {
        let mut tokens: Vec<(super::Slot, String)> =
            AXES.iter().flat_map(|a| a.canonical(self)).collect();
        tokens.sort_by_key(|&(slot, _)| slot);
        tokens.into_iter().map(|(_, t)| t).collect::<Vec<_>>().join(" ")
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

    /// [`ParallelConfig::megatron_flags`], one argument (flag and value) per entry: every
    /// axis's Megatron-LM arguments in slot order.
    pub fn megatron_args(&self) -> Vec<String> {
        match export_fields(Engine::Megatron, self) {
            ExportFields::Args(args) => args.into_iter().map(|(_, a)| a).collect(),
            // No axis refuses Megatron-LM; the export (`export::megatron`) asks the registry
            // first and reports a refusal by name, so none reaches here.
            ExportFields::Refused { .. } => Vec::new(),
        }
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
