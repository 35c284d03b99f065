//! The one training loop: what every device of every plan (a single device included) runs —
//! the steps, the step log, the checkpoints, the held-out evaluation and the end-of-run
//! gathering of every device's peak and traffic. Callers (the CLI) build the [`Trainer`], say
//! what to run ([`RunSpec`]), where its steps come from ([`StepSource`]: a data set's batches,
//! or a front end's, with saves, evaluations and an early stop between steps, the same on
//! every device) and watch it ([`Observer`]: progress, fault injection).
//!
//! Checkpoints: a 1-device run writes the Hugging Face directory of [`save_checkpoint`]; a
//! run on several devices the sharded one of [`save_sharded`] (each rank its own shards);
//! [`crate::checkpoint::load_checkpoint`] reads both, so either resumes under any plan.

use crate::batch::{StepBatch, TrainData};
use crate::checkpoint::{save_checkpoint, Manifest};
use crate::dist_checkpoint::save_sharded;
use crate::loss_scale::{LossScaleState, SCALER_KEY};
use crate::trainer::{EvalStats, StepStats, Trainer};
use crate::{Backend, Result, RuntimeError};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;
use tessera_comm::{CommStats, Group};

/// Where and how often to save.
#[derive(Clone, Debug)]
pub struct SaveSpec {
    pub dir: PathBuf,
    /// Also save every N steps (the last step is always saved).
    pub every: Option<u64>,
    /// The model's HF config (`ModelConfig::to_hf_json`).
    pub config_json: Value,
    /// The manifest to write; its `step` is set at each save.
    pub manifest: Manifest,
    /// The plan, verbatim, for sharded checkpoints.
    pub layout: Value,
}

/// What a device does next, asked of the [`StepSource`] before each step: every device of a
/// run gets the same answers in the same order.
pub enum Next {
    /// Train step `step` on this global batch.
    Batch(StepBatch),
    /// Save a checkpoint now (the run's `save` spec), then ask again.
    Save,
    /// Evaluate on these global batches now (rank 0's observer gets the result), then ask again.
    Evaluate(Vec<StepBatch>),
    /// End the run before this step: save (if saving) and gather, without the held-out eval.
    Stop,
}

/// Where a run's steps come from: its data set's batches, or a caller's (a Python iterable),
/// and when to save, evaluate or stop. `call` counts a device's questions from 0; the devices
/// of a process share one source, which answers call `k` once for all of them.
pub trait StepSource: Sync {
    fn next(&self, rank: usize, call: u64, step: u64) -> Result<Next>;
}

/// The batches of a data set, step after step ([`TrainData::train_batch`]).
pub struct DataSteps<'a> {
    pub data: &'a TrainData,
    pub seed: u64,
    pub batch: usize,
    pub seq: usize,
}

impl StepSource for DataSteps<'_> {
    fn next(&self, _rank: usize, _call: u64, step: u64) -> Result<Next> {
        self.data.train_batch(self.seed, step, self.batch, self.seq).map(Next::Batch)
    }
}

/// What a run does, the same on every device.
pub struct RunSpec<'a> {
    /// Where the steps come from.
    pub steps: &'a dyn StepSource,
    /// The held-out batches' data set for the final evaluation (none: no final evaluation).
    pub data: Option<&'a TrainData>,
    /// Global batch (rows per step) and sequence length (the model's: patches + 1 for ViT).
    pub batch: usize,
    pub seq: usize,
    /// The run seed (batch order).
    pub seed: u64,
    /// Steps `first..=last` run.
    pub first: u64,
    pub last: u64,
    pub save: Option<SaveSpec>,
    /// Held-out batches for the final evaluation (0: none).
    pub eval_batches: usize,
    /// One JSON line per step (rank 0 writes it; flushed as each step ends).
    pub log: Option<&'a Mutex<std::io::BufWriter<std::fs::File>>>,
}

/// Hooks for the caller: progress and fault injection.
pub trait Observer: Sync {
    /// Before step `step` on `rank`; an error ends the run.
    fn before_step(&self, _rank: usize, _step: u64) -> Result<()> {
        Ok(())
    }
    /// After each step, on rank 0 only.
    fn after_step(&self, _stats: &StepStats, _seconds: f64) {}
    /// After an evaluation [`Next::Evaluate`] asked for, on rank 0 only.
    fn after_eval(&self, _stats: Option<&EvalStats>) {}
}

/// The no-op observer.
pub struct Quiet;
impl Observer for Quiet {}

/// What a device reports when its run is done.
#[derive(Clone, Debug, Default)]
pub struct RankOutcome {
    /// Rank 0 only: every step's stats and wall time.
    pub steps: Vec<(StepStats, f64)>,
    /// Every rank's measured peak and last-step collective bytes (gathered on every rank).
    pub measured_peak: Vec<u64>,
    /// Every rank's measured host-tier peak (offloaded state; 0 without offload).
    pub measured_host_peak: Vec<u64>,
    pub measured_comm: Vec<u64>,
    /// Every rank's device-allocator peak of Program bytes over its training steps, where the
    /// backend keeps one ([`crate::Backend::allocator_peak_bytes`]; the CUDA allocator), else
    /// empty.
    pub allocator_peak: Vec<u64>,
    /// This rank's collective calls per kind in the last step.
    pub calls: BTreeMap<String, u64>,
    /// Rank 0 only: the held-out loss and top-1 accuracy.
    pub eval: Option<EvalStats>,
    pub elapsed_s: f64,
    /// Rank 0, when its trainer recorded them: wall time and FLOPs per op kind.
    pub op_times: Vec<crate::executor::OpTimeRow>,
    /// Rank 0, fp16: the loss scale at the end.
    pub loss_scale: Option<f64>,
    /// The step the run stopped before ([`Next::Stop`]), if it ended early.
    pub stopped_before: Option<u64>,
}

/// Runs `spec` on this device: trains, saves, evaluates, and gathers the peaks and traffic.
pub fn run_device<B: Backend>(
    trainer: &mut Trainer<B>,
    spec: &RunSpec<'_>,
    observer: &dyn Observer,
) -> Result<RankOutcome> {
    let rank = trainer.mesh().rank;
    let mut out = RankOutcome::default();
    let mut measured = 0u64;
    let mut measured_host = 0u64;
    let mut last_bytes = 0u64;
    let start = Instant::now();
    let mut call = 0u64;
    let mut step = spec.first;
    while step <= spec.last {
        observer.before_step(rank, step)?;
        let next = spec.steps.next(rank, call, step)?;
        call += 1;
        let batch = match next {
            Next::Batch(batch) => batch,
            Next::Save => {
                save(trainer, spec)?;
                continue;
            }
            Next::Evaluate(batches) => {
                let stats = trainer.eval(&batches)?;
                if rank == 0 {
                    observer.after_eval(stats.as_ref());
                }
                continue;
            }
            Next::Stop => {
                out.stopped_before = Some(step);
                break;
            }
        };
        let before = trainer.comm_stats();
        let t0 = Instant::now();
        let stats = trainer.step_batch(&batch)?;
        let dt = t0.elapsed().as_secs_f64();
        let after = trainer.comm_stats();
        last_bytes = after.total_bytes() - before.total_bytes();
        out.calls = calls_between(&before, &after);
        measured = measured.max(stats.peak_bytes);
        measured_host = measured_host.max(stats.host_peak_bytes);
        if rank == 0 {
            log_step(spec, &stats, dt, trainer.loss_scale_state().is_some())?;
            observer.after_step(&stats, dt);
            out.steps.push((stats, dt));
        }
        let due = spec
            .save
            .as_ref()
            .and_then(|s| s.every)
            .is_some_and(|k| k > 0 && step.is_multiple_of(k));
        if due && step != spec.last {
            save(trainer, spec)?;
        }
        step += 1;
    }
    // The device allocator's peak over the training steps (before the save's copies and the
    // evaluation's Program); u64::MAX where the backend keeps no such books.
    let allocator = trainer.allocator_peak_bytes();
    save(trainer, spec)?;
    out.elapsed_s = start.elapsed().as_secs_f64();

    // Every rank's peaks and traffic, on every rank.
    let n = trainer.mesh().size();
    let mine = pack(&[measured, last_bytes, measured_host, allocator.unwrap_or(u64::MAX)]);
    let all = match trainer.communicator() {
        Some(c) if n > 1 => c.all_gather(&Group::world(n)?, &mine)?,
        _ => mine,
    };
    let all = unpack(&all);
    out.measured_peak = all.iter().step_by(4).copied().collect();
    out.measured_comm = all.iter().skip(1).step_by(4).copied().collect();
    out.measured_host_peak = all.iter().skip(2).step_by(4).copied().collect();
    let alloc: Vec<u64> = all.iter().skip(3).step_by(4).copied().collect();
    if alloc.iter().all(|&a| a != u64::MAX) {
        out.allocator_peak = alloc;
    }

    if let Some(data) = spec.data.filter(|_| spec.eval_batches > 0 && out.stopped_before.is_none())
    {
        let val = data.val_batches(spec.seed, spec.batch, spec.seq, spec.eval_batches)?;
        out.eval = trainer.eval(&val)?;
    }
    Ok(out)
}

fn log_step(spec: &RunSpec<'_>, stats: &StepStats, dt: f64, scaled: bool) -> Result<()> {
    let Some(log) = spec.log else { return Ok(()) };
    let tps = (spec.batch * spec.seq) as f64 / dt;
    // A skipped step's norm is inf or NaN, which JSON cannot hold: it is written null.
    let grad_norm = stats.grad_norm.is_finite().then_some(stats.grad_norm);
    let mut line = json!({"step": stats.step, "loss": stats.loss, "grad_norm": grad_norm,
                          "lr": stats.lr, "tokens_per_s": tps,
                          "samples_per_s": spec.batch as f64 / dt,
                          "peak_bytes": stats.peak_bytes});
    if scaled {
        line["loss_scale"] = json!(stats.loss_scale);
        line["skipped"] = json!(stats.skipped);
    }
    let mut w = log.lock().map_err(|_| RuntimeError::Data("the step log is poisoned".into()))?;
    let io = |e: std::io::Error| RuntimeError::Data(format!("writing the step log: {e}"));
    writeln!(w, "{line}").map_err(io)?;
    // Flushed as each step ends: a killed run leaves its steps on disk.
    w.flush().map_err(io)
}

/// Saves a checkpoint of the run at the trainer's current step (every rank calls it).
fn save<B: Backend>(trainer: &mut Trainer<B>, spec: &RunSpec<'_>) -> Result<()> {
    let Some(s) = &spec.save else { return Ok(()) };
    let mut manifest = s.manifest.clone();
    manifest.step = trainer.steps_done();
    if let Some(state) = trainer.loss_scale_state() {
        if !manifest.extra.is_object() {
            manifest.extra = json!({});
        }
        manifest.extra[SCALER_KEY] = serde_json::to_value(state)
            .map_err(|e| RuntimeError::Checkpoint(format!("the loss scaler's state: {e}")))?;
    }
    let context = |e: RuntimeError| {
        RuntimeError::Checkpoint(format!("saving a checkpoint to {}: {e}", s.dir.display()))
    };
    if trainer.mesh().size() == 1 {
        let params = trainer.parameters()?;
        let optimizer = trainer.optimizer_state()?;
        return save_checkpoint(&s.dir, &s.config_json, &params, &optimizer, &manifest)
            .map_err(context);
    }
    let local: Vec<_> =
        trainer.local_state()?.into_iter().map(|(name, t, p, _)| (name, t, p)).collect();
    let mesh = trainer.mesh().clone();
    let comm = trainer.communicator().ok_or_else(|| {
        RuntimeError::Binding("saving a sharded checkpoint needs a communicator".into())
    })?;
    save_sharded(&s.dir, &mesh, &local, comm, &s.config_json, &manifest, s.layout.clone())
        .map_err(context)
}

/// Restores what a checkpoint's manifest carries besides tensors (the fp16 loss scaler).
pub fn restore_extra<B: Backend>(trainer: &mut Trainer<B>, manifest: &Manifest) -> Result<()> {
    if let Some(state) = manifest.extra.get(SCALER_KEY) {
        let state: LossScaleState = serde_json::from_value(state.clone())
            .map_err(|e| RuntimeError::Checkpoint(format!("bad {SCALER_KEY}: {e}")))?;
        trainer.set_loss_scale_state(state)?;
    }
    Ok(())
}

/// Packs u64s into f32s exactly (16 bits each), to gather counters through a communicator.
pub fn pack(values: &[u64]) -> Vec<f32> {
    values.iter().flat_map(|&v| (0..4).map(move |k| ((v >> (16 * k)) & 0xFFFF) as f32)).collect()
}

/// The inverse of [`pack`].
pub fn unpack(data: &[f32]) -> Vec<u64> {
    data.chunks(4)
        .map(|c| c.iter().enumerate().map(|(k, &x)| (x as u64) << (16 * k)).sum())
        .collect()
}

/// Collective calls per kind between two snapshots of a device's counters.
pub fn calls_between(before: &CommStats, after: &CommStats) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (kind, s) in &after.per_kind {
        let prev = before.per_kind.get(kind).map_or(0, |p| p.calls);
        if s.calls > prev {
            out.insert(kind.name().to_string(), s.calls - prev);
        }
    }
    out
}
