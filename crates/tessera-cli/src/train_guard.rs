//! `train`'s start flags that contradict each other or the run being resumed, refused before
//! anything is built, each naming the fix:
//!
//! - `--init` with `--resume`: a resume continues a saved run (its weights, optimizer state and
//!   model); `--init` starts a new one from weights. One or the other.
//! - `--init` with a `--model` that is not the same model: `--init`'s `config.json` is the model.
//! - On `--resume`, the saved run's settings are kept, as `--lr` already was: a `--schedule` or
//!   `--warmup` given that differs from the saved schedule, and a `--weight-decay` or
//!   `--max-grad-norm` that differs from the values the checkpoint records (saved under
//!   [`OPTIMIZER_KEY`] of the manifest's `extra`), are refused with the saved value. A
//!   checkpoint that records no optimizer settings (an older one) is resumed with the values
//!   given, and the run says so on stderr.

use crate::train_cmd::{ScheduleKind, TrainArgs};
use anyhow::{bail, Result};
use serde_json::{json, Value};
use tessera_models::ModelConfig;
use tessera_runtime::checkpoint::Manifest;
use tessera_runtime::LrSchedule;

/// The key of the manifest's `extra` holding the run's optimizer settings.
pub const OPTIMIZER_KEY: &str = "optimizer";

/// The optimizer settings a save records (and a resume compares).
pub fn optimizer_facts(args: &TrainArgs) -> Value {
    json!({"weight_decay": args.weight_decay, "max_grad_norm": args.max_grad_norm})
}

/// Refuses `--init` with `--resume`, and `--init` with a `--model` that is another model.
pub fn check_start(args: &TrainArgs) -> Result<()> {
    let Some(init) = &args.init else { return Ok(()) };
    let i = init.display();
    if let Some(ck) = &args.resume {
        bail!(
            "--init {i} and --resume {} both say where the run starts: --resume continues a \
             saved run (its weights, optimizer state and model), --init starts a new run from \
             weights; drop --init to continue {}, or drop --resume to fine-tune from {i}",
            ck.display(),
            ck.display()
        );
    }
    if !args.given.gave("model") {
        return Ok(());
    }
    let same_path = match (std::fs::canonicalize(&args.model), std::fs::canonicalize(init)) {
        (Ok(a), Ok(b)) => a == b || a.parent() == Some(b.as_path()),
        _ => false,
    };
    let same_config = || -> bool {
        match (ModelConfig::resolve(&args.model), ModelConfig::from_path(init)) {
            (Ok(a), Ok(b)) => a.to_hf_json() == b.to_hf_json(),
            _ => false,
        }
    };
    if same_path || same_config() {
        return Ok(());
    }
    bail!(
        "--model {} and --init {i} disagree: with --init, {i}/config.json is the model; drop \
         --model (or give the model those weights were saved for)",
        args.model
    )
}

/// Refuses, on `--resume`, settings that differ from the saved run's (module docs).
pub fn check_resume_settings(args: &TrainArgs, m: &Manifest) -> Result<()> {
    let dir = args.resume.as_ref().map(|d| d.display().to_string()).unwrap_or_default();
    let keep = |flag: &str, got: String, saved: String| -> Result<()> {
        bail!(
            "--{flag} {got} differs from the saved run's {saved} ({dir}); a resumed run keeps \
             its settings: resume with --{flag} {saved}, or start a new \
             run with --init {dir} to change it"
        )
    };
    if args.given.gave("schedule") {
        let saved = match m.schedule {
            LrSchedule::Constant { .. } => ScheduleKind::Constant,
            LrSchedule::WarmupCosine { .. } => ScheduleKind::Cosine,
        };
        if saved != args.schedule {
            let name = |k: ScheduleKind| format!("{k:?}").to_lowercase();
            keep("schedule", name(args.schedule), name(saved))?;
        }
    }
    if let (Some(w), LrSchedule::WarmupCosine { warmup, .. }) = (args.warmup, &m.schedule) {
        if w != *warmup {
            keep("warmup", w.to_string(), warmup.to_string())?;
        }
    }
    let saved = m.extra.get(OPTIMIZER_KEY);
    for (flag, key, got) in [
        ("weight-decay", "weight_decay", args.weight_decay),
        ("max-grad-norm", "max_grad_norm", args.max_grad_norm),
    ] {
        match saved.and_then(|s| s.get(key)).and_then(Value::as_f64) {
            Some(v) if v != got => keep(flag, got.to_string(), v.to_string())?,
            Some(_) => {}
            None if args.given.gave(key) || args.given.gave(&key.replace('_', "-")) => eprintln!(
                "note: {dir} does not record the saved run's --{flag}: the run continues with \
                 --{flag} {got}"
            ),
            None => {}
        }
    }
    Ok(())
}
