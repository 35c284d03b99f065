//! What a front end other than the binary hands a command besides its flags: a data source
//! (batches from Python), an event sink (progress, tokens as they are generated) and a stop
//! flag (Ctrl-C in a Python loop). The binary passes none ([`Hooks::default`]); the commands
//! are the same code either way ([`crate::run_json`]).
//!
//! The devices of a run (threads) share one [`SharedSteps`]: the first device to ask for its
//! k-th step (a batch, a save, an evaluation or the end) asks the front end once, and every
//! other device gets the same answer — so a stop or a batch from Python is one decision for
//! all of them, taken at a step boundary.

use crate::train_prepare::RunContext;
use anyhow::{Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tessera_runtime::run::{Next, StepSource};
use tessera_runtime::RuntimeError;
pub use tessera_runtime::StepBatch;

/// One field's values, C order.
pub enum Values {
    I64(Vec<i64>),
    F32(Vec<f32>),
}

/// A front end's batch from its fields `(name, shape, values)`: every field with the same
/// number of rows (its first dimension).
pub fn batch(fields: Vec<(String, Vec<usize>, Values)>) -> Result<StepBatch> {
    let mut out = Vec::with_capacity(fields.len());
    for (name, shape, values) in fields {
        let n: usize = shape.iter().product();
        let len = match &values {
            Values::I64(v) => v.len(),
            Values::F32(v) => v.len(),
        };
        if len != n {
            anyhow::bail!("data: field `{name}` has {len} values; its shape {shape:?} needs {n}");
        }
        let tensor = match values {
            Values::I64(v) => tessera_runtime::tensor::from_vec(v, &shape)?,
            Values::F32(v) => tessera_runtime::tensor::from_vec(v, &shape)?,
        };
        out.push((name, tensor));
    }
    Ok(StepBatch::new(out)?)
}

/// What a front end says a run does next (the runtime's [`Next`], owned by the front end).
pub enum Request {
    /// Train the next step on this global batch (`input_ids`, `labels`, ...).
    Batch(StepBatch),
    /// Train the next step on the run's own data set's batch (`--data`; needs
    /// [`Hooks::caller_data`] off).
    Data,
    /// Save a checkpoint to `--save` now.
    Save,
    /// Evaluate on these batches now: the result comes as an `eval` event.
    Evaluate(Vec<StepBatch>),
    /// Evaluate on the held-out split of the run's own data set (`--eval-batches` batches).
    EvaluateHeldOut,
    /// End the run here (data exhausted, interrupted): saves if `--save` was given.
    Stop,
}

/// Batches (and saves, evaluations) from the front end, asked for one step at a time.
pub trait BatchSource: Send {
    /// What to do before step `step` (1-based, the run's numbering).
    fn next(&mut self, step: u64) -> Result<Request>;
}

/// Where a command's events go: `step` (one per training step: step, loss, grad_norm, lr,
/// tokens_per_s, peak_bytes), `eval` (loss, accuracy), `token` (generation: step, tokens,
/// text). Called from the command's threads.
pub trait Events: Send + Sync {
    fn event(&self, kind: &str, value: Value);
}

/// A front end's hooks into a command (all optional).
#[derive(Default, Clone)]
pub struct Hooks {
    /// `train`: what each step does (its batch, or a save, an evaluation, the end), asked of
    /// the front end.
    pub steps: Option<Arc<Mutex<Box<dyn BatchSource>>>>,
    /// `train`: the batches come from the front end only (no `--data` set is loaded; the run
    /// has no held-out split of its own).
    pub caller_data: bool,
    /// Progress and tokens; with events, the command draws no progress of its own.
    pub events: Option<Arc<dyn Events>>,
    /// Set to end a training run at the next step boundary (saving if `--save` was given).
    pub stop: Option<Arc<AtomicBool>>,
}

impl Hooks {
    /// Sends an event, if anyone listens.
    pub fn emit(&self, kind: &str, value: Value) {
        if let Some(e) = &self.events {
            e.event(kind, value);
        }
    }

    fn stopped(&self) -> bool {
        self.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst))
    }
}

/// One answer, kept until every device of the process has taken it.
struct Answer {
    next: std::result::Result<SharedNext, String>,
    left: usize,
}

#[derive(Clone)]
enum SharedNext {
    Batch(StepBatch),
    Save,
    Evaluate(Vec<StepBatch>),
    Stop,
}

/// The devices' common source of steps (see the module doc).
pub struct SharedSteps {
    hooks: Hooks,
    devices: usize,
    answers: Mutex<BTreeMap<u64, Answer>>,
}

impl SharedSteps {
    pub fn new(hooks: Hooks, devices: usize) -> SharedSteps {
        SharedSteps { hooks, devices: devices.max(1), answers: Mutex::new(BTreeMap::new()) }
    }

    /// The view the runtime asks, over the run's own data set.
    pub fn source<'a>(&'a self, ctx: &'a RunContext) -> impl StepSource + 'a {
        View { shared: self, ctx }
    }

    fn decide(&self, ctx: &RunContext, step: u64) -> Result<SharedNext> {
        if self.hooks.stopped() {
            return Ok(SharedNext::Stop);
        }
        let own = || {
            ctx.data.as_ref().context(
                "this run's batches come from the caller (data=): it has no data set of its own \
                 to draw a batch or a held-out split from",
            )
        };
        let Some(source) = &self.hooks.steps else {
            let batch = own()?.train_batch(ctx.args.seed, step, ctx.args.batch, ctx.seq)?;
            return Ok(SharedNext::Batch(batch));
        };
        let mut source = source.lock().map_err(|_| anyhow::anyhow!("the data source panicked"))?;
        Ok(match source.next(step)? {
            Request::Batch(b) => SharedNext::Batch(check_batch(b, ctx, step)?),
            Request::Data => SharedNext::Batch(own()?.train_batch(
                ctx.args.seed,
                step,
                ctx.args.batch,
                ctx.seq,
            )?),
            Request::Save => SharedNext::Save,
            Request::Evaluate(bs) => SharedNext::Evaluate(
                bs.into_iter().map(|b| check_batch(b, ctx, step)).collect::<Result<_>>()?,
            ),
            Request::EvaluateHeldOut => {
                let n = ctx.args.eval_batches.max(1);
                let val = own()?.val_batches(ctx.args.seed, ctx.args.batch, ctx.seq, n)?;
                SharedNext::Evaluate(val)
            }
            Request::Stop => SharedNext::Stop,
        })
    }
}

/// A batch from the front end must have the run's shape: `--batch` rows, and token fields
/// `[batch, seq]`.
fn check_batch(b: StepBatch, ctx: &RunContext, step: u64) -> Result<StepBatch> {
    let (batch, seq) = (ctx.args.batch, ctx.seq);
    for name in b.names() {
        let Some(t) = b.get(name) else { continue };
        let dims = t.dims();
        let tokens = matches!(name, "input_ids" | "labels" | "attention_mask");
        let ok = dims.first() == Some(&batch) && (!tokens || dims == [batch, seq]);
        if !ok {
            let want = if tokens { format!("[{batch}, {seq}]") } else { format!("[{batch}, ...]") };
            anyhow::bail!(
                "data: the batch for step {step} has `{name}` of shape {dims:?}; the run's \
                 batch={batch} seq={seq} needs {want} (pass batch= and seq= to match the data)"
            );
        }
    }
    Ok(b)
}

struct View<'a> {
    shared: &'a SharedSteps,
    ctx: &'a RunContext,
}

impl StepSource for View<'_> {
    fn next(&self, _rank: usize, call: u64, step: u64) -> tessera_runtime::Result<Next> {
        let s = self.shared;
        let mut answers = s
            .answers
            .lock()
            .map_err(|_| RuntimeError::Data("a device panicked reading data".into()))?;
        if let std::collections::btree_map::Entry::Vacant(slot) = answers.entry(call) {
            let next = s.decide(self.ctx, step).map_err(|e| crate::message(&e));
            slot.insert(Answer { next, left: s.devices });
        }
        let Some(answer) = answers.get_mut(&call) else {
            return Err(RuntimeError::Data("the step's answer went missing".into()));
        };
        answer.left -= 1;
        let next = answer.next.clone();
        if answer.left == 0 {
            answers.remove(&call);
        }
        match next.map_err(RuntimeError::Data)? {
            SharedNext::Batch(b) => Ok(Next::Batch(b)),
            SharedNext::Save => Ok(Next::Save),
            SharedNext::Evaluate(bs) => Ok(Next::Evaluate(bs)),
            SharedNext::Stop => Ok(Next::Stop),
        }
    }
}
