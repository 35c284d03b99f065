//! A single-device training loop over a [`TrainingGraph`]: initialise parameters and AdamW
//! state, then per step bind the batch, learning rate, step counter and dropout seed and run
//! the Program. Evaluation runs a forward-only Program that shares the parameter tensors.
//!
//! The trainer finds the model's data inputs by their names (`input_ids`, `labels`, optional
//! `seed` and `token_type_ids`), so it needs no knowledge of model families.
//!
//! **fp16 dynamic loss scaling** (graphs with [`TrainingGraph::loss_scale`]) follows PyTorch's
//! `GradScaler`: the scale starts at [`LossScaleConfig::init_scale`] (2^16); a step whose
//! unscaled gradient norm is not finite is *skipped* (the AdamW nodes leave parameters and
//! state untouched) and halves the scale; [`LossScaleConfig::growth_interval`] (2000)
//! consecutive good steps double it. As in PyTorch, a skipped step still counts as an
//! iteration — the step counter, learning-rate schedule, batch order and dropout seed advance
//! — but not as an optimizer step: AdamW's bias-correction `step` input is the number of
//! updates actually applied plus one (PyTorch's Adam does not advance its `step` state when
//! `GradScaler` skips `optimizer.step()`).

use crate::init::init_parameters;
use crate::schedule::LrSchedule;
use crate::tensor::{candle_dtype, from_vec};
use crate::{Backend, Executor, Result, RuntimeError};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use tessera_ir::{DType, Graph, Program, TensorId, TrainingGraph};

/// What one step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    pub step: u64,
    /// The unscaled loss.
    pub loss: f64,
    /// The unscaled global gradient norm (not finite on a skipped step).
    pub grad_norm: f64,
    pub lr: f64,
    /// Peak bytes the accountant saw during this step.
    pub peak_bytes: u64,
    /// fp16: the gradients overflowed and the update was skipped. Always false otherwise.
    pub skipped: bool,
    /// fp16: the loss scale this step ran with. 1 without loss scaling.
    pub loss_scale: f64,
}

/// Dynamic loss scaling settings (PyTorch `GradScaler`'s defaults).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaleConfig {
    pub init_scale: f64,
    /// Multiplies the scale after `growth_interval` consecutive good steps.
    pub growth_factor: f64,
    /// Multiplies the scale after a step whose gradients overflowed.
    pub backoff_factor: f64,
    pub growth_interval: u64,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        LossScaleConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// The loss scaler's state, saved with a checkpoint to resume exactly.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaleState {
    /// The scale the next step runs with.
    pub scale: f64,
    /// Consecutive good steps since the last growth or backoff.
    pub good_steps: u64,
    /// Skipped steps since the start of the run (AdamW's step is `steps − skipped + 1`).
    pub skipped_steps: u64,
}

/// The scaler of an fp16 training graph: its input, settings and state.
#[derive(Clone, Copy, Debug)]
struct LossScaler {
    input: TensorId,
    cfg: LossScaleConfig,
    state: LossScaleState,
}

impl LossScaler {
    fn new(input: TensorId, cfg: LossScaleConfig) -> LossScaler {
        let state = LossScaleState { scale: cfg.init_scale, good_steps: 0, skipped_steps: 0 };
        LossScaler { input, cfg, state }
    }

    /// Records a step's outcome and adjusts the scale.
    fn update(&mut self, overflow: bool) {
        let s = &mut self.state;
        if overflow {
            s.scale *= self.cfg.backoff_factor;
            s.good_steps = 0;
            s.skipped_steps += 1;
        } else {
            s.good_steps += 1;
            if s.good_steps >= self.cfg.growth_interval {
                s.scale *= self.cfg.growth_factor;
                s.good_steps = 0;
            }
        }
    }
}

fn check_scale_config(cfg: &LossScaleConfig) -> Result<()> {
    let ok = cfg.init_scale.is_finite()
        && cfg.init_scale > 0.0
        && cfg.init_scale <= f64::from(f32::MAX)
        && cfg.growth_factor >= 1.0
        && cfg.growth_factor.is_finite()
        && cfg.backoff_factor > 0.0
        && cfg.backoff_factor < 1.0
        && cfg.growth_interval >= 1;
    if ok {
        Ok(())
    } else {
        Err(RuntimeError::Binding(format!(
            "invalid loss scaling {cfg:?}: need 0 < init_scale ≤ f32::MAX, growth_factor ≥ 1, \
             0 < backoff_factor < 1 and growth_interval ≥ 1"
        )))
    }
}

/// Leaves that carry a step's data.
#[derive(Clone, Copy, Debug)]
struct DataLeaves {
    ids: TensorId,
    labels: TensorId,
    token_types: Option<TensorId>,
    seed: Option<TensorId>,
    batch: usize,
    seq: usize,
}

impl DataLeaves {
    fn find(graph: &Graph) -> Result<DataLeaves> {
        let ids = graph.find_leaf("input_ids").ok_or_else(|| {
            RuntimeError::Binding(
                "the model has no `input_ids` input: `train` supports token models".into(),
            )
        })?;
        let labels = graph
            .find_leaf("labels")
            .ok_or_else(|| RuntimeError::Binding("the model has no `labels` input".into()))?;
        let dims = graph.shape(ids).dims();
        if dims.len() != 2 || graph.shape(labels).dims() != dims {
            return Err(RuntimeError::Binding(format!(
                "`train` needs causal-LM inputs `input_ids` and `labels` of shape [batch, seq], \
                 got {} and {}",
                graph.meta(ids),
                graph.meta(labels)
            )));
        }
        Ok(DataLeaves {
            ids,
            labels,
            token_types: graph.find_leaf("token_type_ids"),
            seed: graph.find_leaf("seed"),
            batch: dims[0],
            seq: dims[1],
        })
    }
}

/// The dropout seed of a step: distinct per (run seed, step), identical on every device.
pub fn step_seed(seed: u64, step: u64) -> i64 {
    (tessera_ir::rng::splitmix64(seed ^ tessera_ir::rng::splitmix64(step)) >> 1) as i64
}

pub struct Trainer<B: Backend> {
    train: TrainingGraph,
    exec: Executor<B>,
    eval: Option<(Executor<B>, DataLeaves, TensorId)>,
    leaves: DataLeaves,
    schedule: LrSchedule,
    seed: u64,
    /// Steps completed.
    step: u64,
    /// Parameter tensors by name, shared with the eval program.
    params_by_name: HashMap<String, Tensor>,
    /// fp16 graphs only.
    scaler: Option<LossScaler>,
}

impl<B: Backend> Trainer<B> {
    /// Lowers `train`, initialises parameters from `seed` and zeroes the AdamW state.
    /// `budget` limits the device's live bytes (a clear error names the tensor that breaks it).
    pub fn new(
        train: TrainingGraph,
        backend: B,
        schedule: LrSchedule,
        seed: u64,
        budget: Option<u64>,
    ) -> Result<Trainer<B>> {
        let g = &train.graph;
        for slot in &train.params {
            let dtype = g.meta(slot.param).dtype;
            let ok = dtype == DType::F32 || (dtype.is_float() && slot.master.is_some());
            if !ok {
                return Err(RuntimeError::Unsupported {
                    backend: backend.name().to_string(),
                    op: "train".into(),
                    reason: format!(
                        "{} is {dtype} without an fp32 master copy; train in fp32 or bf16",
                        g.tensor_scope(slot.param),
                    ),
                });
            }
        }
        let leaves = DataLeaves::find(g)?;
        let program = Program::lower_training(&train);
        let mut exec = Executor::new(program, backend, budget);
        let mut params_by_name = HashMap::new();
        let initial: HashMap<TensorId, Tensor> =
            init_parameters(&train.graph, seed)?.into_iter().collect();
        for slot in &train.params {
            let f32_init = &initial[&slot.param];
            // Low-precision weights are the rounded fp32 master copy.
            let value = f32_init.to_dtype(candle_dtype(train.graph.meta(slot.param).dtype))?;
            params_by_name.insert(train.graph.tensor_scope(slot.param).to_string(), value.clone());
            exec.bind(slot.param, value)?;
            if let Some(master) = slot.master {
                exec.bind(master, f32_init.copy()?)?;
            }
            let dims = train.graph.shape(slot.param).dims().to_vec();
            for s in [slot.m, slot.v] {
                let device = exec.backend().device();
                let zeros = Tensor::zeros(dims.as_slice(), candle_core::DType::F32, device)?;
                exec.bind(s, zeros)?;
            }
        }
        let scaler = train.loss_scale.map(|t| LossScaler::new(t, LossScaleConfig::default()));
        Ok(Trainer {
            train,
            exec,
            eval: None,
            leaves,
            schedule,
            seed,
            step: 0,
            params_by_name,
            scaler,
        })
    }

    /// Sets the dynamic loss scaling of an fp16 graph (and restarts its state from
    /// `cfg.init_scale`); an error for a graph without loss scaling.
    pub fn with_loss_scale(mut self, cfg: LossScaleConfig) -> Result<Trainer<B>> {
        check_scale_config(&cfg)?;
        let Some(input) = self.train.loss_scale else {
            return Err(RuntimeError::Binding(
                "the training graph has no loss scale (only fp16 parameters use one)".into(),
            ));
        };
        let skipped_steps = self.scaler.map_or(0, |s| s.state.skipped_steps);
        let mut scaler = LossScaler::new(input, cfg);
        scaler.state.skipped_steps = skipped_steps;
        self.scaler = Some(scaler);
        Ok(self)
    }

    /// The loss scaler's state (`None` without loss scaling).
    pub fn loss_scale_state(&self) -> Option<LossScaleState> {
        self.scaler.map(|s| s.state)
    }

    /// Restores the loss scaler's state from a checkpoint (after [`Trainer::restore`], which
    /// leaves the scaler alone).
    pub fn set_loss_scale_state(&mut self, state: LossScaleState) -> Result<()> {
        let steps = self.step;
        let Some(scaler) = self.scaler.as_mut() else {
            return Err(RuntimeError::Binding(
                "the training graph has no loss scale (only fp16 parameters use one)".into(),
            ));
        };
        check_scale_config(&LossScaleConfig { init_scale: state.scale, ..scaler.cfg })?;
        if state.skipped_steps > steps {
            return Err(RuntimeError::Binding(format!(
                "{} skipped steps, but only {steps} steps are done",
                state.skipped_steps
            )));
        }
        scaler.state = state;
        Ok(())
    }

    /// Adds a forward-only evaluation graph (same model, same parameter names) with scalar
    /// `loss`; its parameters are the training tensors themselves, not copies.
    pub fn with_eval(mut self, graph: Graph, loss: TensorId, backend: B) -> Result<Trainer<B>> {
        let leaves = DataLeaves::find(&graph)?;
        let params = graph.parameters();
        let program = Program::lower_graph(graph, vec![loss], &[]);
        let mut exec = Executor::new(program, backend, None);
        for p in params {
            let name = exec.program().graph.tensor_scope(p).to_string();
            let value = self.params_by_name.get(&name).ok_or_else(|| {
                RuntimeError::Binding(format!("eval graph parameter {name} is not trained"))
            })?;
            exec.bind(p, value.clone())?;
        }
        self.eval = Some((exec, leaves, loss));
        Ok(self)
    }

    pub fn training_graph(&self) -> &TrainingGraph {
        &self.train
    }
    pub fn program(&self) -> &Program {
        self.exec.program()
    }
    pub fn steps_done(&self) -> u64 {
        self.step
    }
    pub fn batch_shape(&self) -> (usize, usize) {
        (self.leaves.batch, self.leaves.seq)
    }
    /// The current value of a named parameter.
    pub fn parameter(&self, name: &str) -> Option<&Tensor> {
        self.params_by_name.get(name)
    }

    fn bind_batch(
        exec: &mut Executor<B>,
        leaves: &DataLeaves,
        inputs: &[i64],
        targets: &[i64],
    ) -> Result<()> {
        let n = leaves.batch * leaves.seq;
        if inputs.len() != n || targets.len() != n {
            return Err(RuntimeError::Data(format!(
                "batch has {} inputs and {} targets; the program expects {} × {} = {n}",
                inputs.len(),
                targets.len(),
                leaves.batch,
                leaves.seq
            )));
        }
        let dims = [leaves.batch, leaves.seq];
        exec.bind(leaves.ids, from_vec(inputs.to_vec(), &dims)?)?;
        exec.bind(leaves.labels, from_vec(targets.to_vec(), &dims)?)?;
        if let Some(tt) = leaves.token_types {
            exec.bind(tt, from_vec(vec![0i64; n], &dims)?)?;
        }
        Ok(())
    }

    /// Runs one optimizer step on a `[batch, seq]` batch of inputs and next-token targets.
    pub fn step(&mut self, inputs: &[i64], targets: &[i64]) -> Result<StepStats> {
        let step = self.step + 1;
        let lr = self.schedule.lr_at(step);
        Self::bind_batch(&mut self.exec, &self.leaves, inputs, targets)?;
        if let Some(s) = self.leaves.seed {
            self.exec
                .bind(s, Tensor::new(step_seed(self.seed, step), self.exec.backend().device())?)?;
        }
        let device = self.exec.backend().device().clone();
        self.exec.bind(self.train.lr, Tensor::new(lr as f32, &device)?)?;
        // AdamW's step counts applied updates (skipped fp16 steps excluded), 1-based.
        let skipped = self.scaler.map_or(0, |s| s.state.skipped_steps);
        let adam_step = step - skipped;
        self.exec.bind(self.train.step, Tensor::new(adam_step as i64, &device)?)?;
        let loss_scale = self.scaler.map_or(1.0, |s| s.state.scale);
        if let Some(scaler) = &self.scaler {
            self.exec.bind(scaler.input, Tensor::new(loss_scale as f32, &device)?)?;
        }
        self.exec.run()?;
        let loss = scalar(&self.exec, self.train.loss)?;
        let mut grad_norm = scalar(&self.exec, self.train.grad_norm)?;
        if !loss.is_finite() {
            return Err(RuntimeError::Data(format!(
                "step {step}: the loss is {loss}; lower the learning rate (now {lr:.2e})"
            )));
        }
        let mut overflow = false;
        if let Some(scaler) = self.scaler.as_mut() {
            // The AdamW nodes' rule: skip iff grad_norm · (1/scale in f32) is not finite.
            grad_norm *= f64::from(1.0 / loss_scale as f32);
            overflow = !grad_norm.is_finite();
            scaler.update(overflow);
        }
        self.step = step;
        Ok(StepStats {
            step,
            loss,
            grad_norm,
            lr,
            peak_bytes: self.exec.accountant().peak_bytes(),
            skipped: overflow,
            loss_scale,
        })
    }

    /// Mean loss of the eval program over the given batches. Callers build the eval graph
    /// without dropout (`ModelConfig::without_dropout`); if it has a seed input anyway, each
    /// batch gets a fixed one so evaluation stays deterministic.
    pub fn eval(&mut self, batches: &[(Vec<i64>, Vec<i64>)]) -> Result<f64> {
        let seed = self.seed;
        let Some((exec, leaves, loss)) = self.eval.as_mut() else {
            return Err(RuntimeError::Binding("no eval graph was given (with_eval)".into()));
        };
        if batches.is_empty() {
            return Err(RuntimeError::Data("no held-out batches to evaluate".into()));
        }
        let mut total = 0.0;
        for (i, (x, y)) in batches.iter().enumerate() {
            Self::bind_batch(exec, leaves, x, y)?;
            if let Some(s) = leaves.seed {
                exec.bind(
                    s,
                    Tensor::new(step_seed(seed, u64::MAX - i as u64), exec.backend().device())?,
                )?;
            }
            exec.run()?;
            total += scalar(exec, *loss)?;
        }
        Ok(total / batches.len() as f64)
    }

    /// Parameters by Hugging Face name, in graph order (live handles: copy before mutating).
    pub fn parameters(&self) -> Vec<(String, Tensor)> {
        let g = &self.train.graph;
        self.train
            .params
            .iter()
            .map(|s| {
                let name = g.tensor_scope(s.param).to_string();
                let t = self.params_by_name[&name].clone();
                (name, t)
            })
            .collect()
    }

    /// AdamW state keyed `<parameter>.adam_m`, `.adam_v` and (mixed precision) `.master`.
    pub fn optimizer_state(&self) -> Result<Vec<(String, Tensor)>> {
        let g = &self.train.graph;
        let mut out = Vec::new();
        for slot in &self.train.params {
            for t in [Some(slot.m), Some(slot.v), slot.master].into_iter().flatten() {
                let value = self.exec.get(t).ok_or_else(|| {
                    RuntimeError::Binding(format!("{} is not bound", g.tensor_scope(t)))
                })?;
                out.push((g.tensor_scope(t).to_string(), value.clone()));
            }
        }
        Ok(out)
    }

    /// Restores parameters, optimizer state and the step counter (from a checkpoint), so the
    /// next [`Trainer::step`] continues exactly where the saved run stopped (for fp16, after
    /// [`Trainer::set_loss_scale_state`] too: this leaves the loss scaler alone). Every tensor must
    /// be present with the right shape; values are copied into fresh buffers.
    pub fn restore(
        &mut self,
        params: &HashMap<String, Tensor>,
        optimizer: &HashMap<String, Tensor>,
        steps_done: u64,
    ) -> Result<()> {
        let g = self.train.graph.clone();
        let fetch = |map: &HashMap<String, Tensor>, name: &str, what: &str| {
            map.get(name).cloned().ok_or_else(|| {
                RuntimeError::Binding(format!("the checkpoint has no {what} `{name}`"))
            })
        };
        for slot in &self.train.params {
            let name = g.tensor_scope(slot.param).to_string();
            let want = candle_dtype(g.meta(slot.param).dtype);
            let value = fetch(params, &name, "parameter")?.to_dtype(want)?.copy()?;
            self.exec.bind(slot.param, value.clone())?;
            if let Some((eval, _, _)) = self.eval.as_mut() {
                if let Some(p) = eval.program().graph.find_leaf(&name) {
                    eval.bind(p, value.clone())?;
                }
            }
            self.params_by_name.insert(name, value);
            for t in [Some(slot.m), Some(slot.v), slot.master].into_iter().flatten() {
                let state_name = g.tensor_scope(t);
                let value = fetch(optimizer, state_name, "optimizer state")?
                    .to_dtype(candle_core::DType::F32)?
                    .copy()?;
                self.exec.bind(t, value)?;
            }
        }
        self.step = steps_done;
        Ok(())
    }

    /// Records wall time per op kind in the training step from now on.
    pub fn record_timings(&mut self, on: bool) {
        self.exec.record_timings(on);
    }

    /// Wall time per op kind of the training steps since recording started.
    pub fn timings(
        &self,
    ) -> Option<&std::collections::BTreeMap<&'static str, crate::executor::OpTime>> {
        self.exec.timings()
    }

    /// The accountant's peak during the last step.
    pub fn measured_peak_bytes(&self) -> u64 {
        self.exec.accountant().peak_bytes()
    }
}

fn scalar<B: Backend>(exec: &Executor<B>, t: TensorId) -> Result<f64> {
    let v = exec.get(t).ok_or_else(|| RuntimeError::Binding("step output was not kept".into()))?;
    Ok(v.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?)
}
