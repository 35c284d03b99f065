//! The one trainer: a device of a mesh running a training Program on its shards. A single
//! device is the only device of a 1-device mesh ([`DeviceSetup::single`]); nothing below
//! distinguishes it.
//!
//! The planner lowers a plan to one Program for all devices (all splits are even); what makes
//! a device *this* device is its mesh coordinate, which picks its shard of every leaf
//! ([`crate::collective::shard`]), its place in every collective ([`CommRunner`]) and its slice
//! of every dropout mask. So a device:
//!
//! 1. binds its shard of every parameter and optimizer state ([`StartState`]): a fresh init
//!    draws only the shard's elements, keyed by their global index; a checkpoint saved under
//!    any plan is sliced (resharding on load is just this slicing);
//! 2. per step, cuts the global batch into micro-batches (`input_ids`, `input_ids@mb1`, ..)
//!    and binds its shard of each, binds the scalars (learning rate, AdamW step, dropout seed,
//!    fp16 loss scale) and runs the Program — collectives included;
//! 3. reads the loss and gradient norm, which the Program all-reduces, so every rank reports
//!    the same numbers as a single device would.
//!
//! ZeRO-1/2 parameters are updated on shards and gathered back: the gathered tensor becomes
//! the parameter ([`crate::Executor::write_back`]). fp16 loss scaling: [`crate::loss_scale`].

pub use crate::batch::top1_hits;
use crate::batch::StepBatch;
use crate::collective::{shard, CommRunner, DeviceMesh, Placement, ReshardRunner};
use crate::dist_checkpoint::{ChunkLocation, ShardedTensor, TensorRole};
use crate::init::{init_shard, InitRule};
use crate::loss_scale::{check_scale_config, LossScaleConfig, LossScaleState, LossScaler};
pub use crate::mapped::ShardSource;
use crate::state_table::{self, RankTable};
use crate::tensor::{candle_dtype, from_vec};
use crate::{Backend, Executor, LrSchedule, Result, RuntimeError};
use candle_core::Tensor;
use std::collections::HashMap;
use tessera_comm::CommStats;
use tessera_ir::dist::state_key;
use tessera_ir::{DType, Graph, LeafLayout, Program, StateKind, TensorId, TrainingGraph};

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
    /// Peak bytes the host tier's accountant saw (offloaded state and copies; 0 without).
    pub host_peak_bytes: u64,
    /// fp16: the gradients overflowed and the update was skipped. Always false otherwise.
    pub skipped: bool,
    /// fp16: the loss scale this step ran with. 1 without loss scaling.
    pub loss_scale: f64,
}

/// The dropout seed of a step: distinct per (run seed, step), identical on every device.
pub fn step_seed(seed: u64, step: u64) -> i64 {
    (tessera_ir::rng::splitmix64(seed ^ tessera_ir::rng::splitmix64(step)) >> 1) as i64
}

/// A micro-batch's data leaves.
#[derive(Clone, Debug)]
struct MicroLeaves {
    /// The data inputs a [`StepBatch`] fills, by name (`input_ids`, `labels`,
    /// `pixel_values`, `token_type_ids`, ...): every micro-batch input but the two below.
    data: Vec<(String, TensorId)>,
    seed: Option<TensorId>,
    /// The count of the step's targets that are not ignored (a mean-over-targets loss).
    num_targets: Option<TensorId>,
}

impl MicroLeaves {
    /// Micro-batch `k`'s leaves: from the plan's layout, or on a single-device graph its
    /// inputs but `scalars` (the learning rate, AdamW step and loss scale) by name.
    fn find(g: &Graph, layout: &LeafLayout, k: usize, scalars: &[TensorId]) -> Result<MicroLeaves> {
        let group: Vec<(String, TensorId)> = match layout.micro_batches.get(k) {
            Some(group) => group.iter().map(|(n, &t)| (n.clone(), t)).collect(),
            None if k == 0 && layout.micro_batches.is_empty() => g
                .inputs()
                .into_iter()
                .filter(|t| !scalars.contains(t))
                .map(|t| (g.tensor_scope(t).to_string(), t))
                .collect(),
            None => return Err(binding(format!("the program has no inputs for micro-batch {k}"))),
        };
        let mut leaves = MicroLeaves { data: Vec::new(), seed: None, num_targets: None };
        for (name, t) in group {
            match name.as_str() {
                "seed" => leaves.seed = Some(t),
                "num_targets" => leaves.num_targets = Some(t),
                _ => leaves.data.push((name, t)),
            }
        }
        // A pipeline stage before the last has no loss, hence no labels.
        // (Ring attention's sends pass K/V blocks between the devices of one stage.)
        let stage = g.nodes.iter().any(|n| matches!(n.op, tessera_ir::Op::Send(p) if !p.ring));
        // The loss's target: class or token `labels`, a dense model's `targets`, or a
        // diffusion model's `target` (diffusers' name).
        let is_target = |n: &str| matches!(n, "labels" | "targets" | "target");
        if !stage && !leaves.data.iter().any(|(n, _)| is_target(n)) {
            return Err(binding(format!(
                "the program has no `labels`, `targets` or `target` input for micro-batch {k}: \
                 `train` needs a model with a loss over them"
            )));
        }
        Ok(leaves)
    }

    fn get(&self, name: &str) -> Option<TensorId> {
        self.data.iter().find(|(n, _)| n == name).map(|(_, t)| *t)
    }
}

/// What [`Trainer::eval`] reports: the mean loss over the held-out batches and the top-1
/// accuracy over their labels that count (class for classifiers, next or masked token for
/// language models).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalStats {
    pub loss: f64,
    /// Top-1 accuracy over the labelled rows; `None` when the data has no labels (denoising).
    pub accuracy: Option<f64>,
}

/// Which device this is and what it may hold (the plan's leaf placements and micro-batches
/// travel in the training graph's [`LeafLayout`]).
#[derive(Clone, Debug)]
pub struct DeviceSetup {
    pub mesh: DeviceMesh,
    /// This device's memory budget (bytes); exceeding it is a clear error.
    pub budget: Option<u64>,
    /// The host memory this device's offloaded state may take (bytes); `None`: unbounded.
    pub host_budget: Option<u64>,
    /// Where the plan's NVMe-resident state lives (a subdirectory per rank); required when the
    /// plan puts state on the NVMe.
    pub offload_dir: Option<std::path::PathBuf>,
}

impl DeviceSetup {
    /// One device: the only device of a 1-device mesh.
    pub fn single(budget: Option<u64>) -> DeviceSetup {
        DeviceSetup { mesh: DeviceMesh::single(), budget, host_budget: None, offload_dir: None }
    }
}

/// Where the parameters and optimizer state come from.
pub enum StartState<'a> {
    /// A fresh run: each device draws only its shards of the initial parameters (keyed by
    /// element index, [`init_shard`]) and zeroes its AdamW state; masters are the fp32 draws.
    /// Rules by parameter name, computed on the single-device graph
    /// ([`crate::init::init_rules_by_name`]).
    Fresh { rules: &'a HashMap<String, InitRule> },
    /// Global tensors to slice: parameters by HF name and optionally optimizer state by
    /// `<param>.adam_m` / `.adam_v` / `.master` (absent: zeros, and masters from the
    /// parameters); `steps_done` steps are done. Each device reads only its shards from the
    /// sources ([`ShardSource`]: tensors in memory, or a mapped Hugging Face checkpoint).
    Global { params: &'a dyn ShardSource, optimizer: Option<&'a dyn ShardSource>, steps_done: u64 },
}

pub struct Trainer<B: Backend> {
    train: TrainingGraph,
    exec: Executor<B>,
    mesh: DeviceMesh,
    micro: Vec<MicroLeaves>,
    /// Global batch (rows) of a step, and the token models' sequence length (1 otherwise).
    batch: usize,
    seq: usize,
    schedule: LrSchedule,
    seed: u64,
    /// Steps completed.
    step: u64,
    /// Steps completed when this trainer started (0, or the resumed checkpoint's).
    started_at: u64,
    /// fp16 graphs only.
    scaler: Option<LossScaler>,
    /// The forward-only graph `eval` runs (on rank 0, on gathered parameters): graph, loss,
    /// logits.
    eval: Option<(Graph, TensorId, TensorId)>,
}

fn binding(msg: String) -> RuntimeError {
    RuntimeError::Binding(msg)
}

impl<B: Backend> Trainer<B> {
    /// A device of a plan: `train` is the plan's per-device training graph, `runner` its
    /// communicator (`None` only on a 1-device mesh).
    pub fn new(
        train: TrainingGraph,
        backend: B,
        runner: Option<CommRunner>,
        setup: DeviceSetup,
        schedule: LrSchedule,
        seed: u64,
        state: StartState<'_>,
    ) -> Result<Trainer<B>> {
        check_trainable(&train, backend.name())?;
        let g = &train.graph;
        let layout = &train.layout;
        let mb = layout.micro_batches.len().max(1);
        let scalars: Vec<TensorId> =
            [train.lr, train.step].into_iter().chain(train.loss_scale).collect();
        let micro = (0..mb)
            .map(|k| MicroLeaves::find(g, layout, k, &scalars))
            .collect::<Result<Vec<_>>>()?;
        let global = |t: TensorId| -> Result<Vec<usize>> {
            let mut dims = g.shape(t).dims().to_vec();
            if let Some(placement) = layout.placements.get(&t) {
                for (d, axes) in placement.iter().enumerate() {
                    dims[d] *= setup.mesh.chunk(axes)?.0;
                }
            }
            Ok(dims)
        };
        // The global batch from any data input (all have the batch first); a pipeline stage
        // in the middle reads none (0: whatever the step brings).
        let batch = match micro[0].get("labels").or_else(|| micro[0].data.first().map(|d| d.1)) {
            Some(first) => global(first)?.first().copied().unwrap_or(1) * mb,
            None => 0,
        };
        let seq = match micro[0].get("input_ids") {
            Some(ids) => global(ids)?.get(1).copied().unwrap_or(1),
            None => 1,
        };

        let program = Program::lower_training(&train);
        let mut exec =
            Executor::new(program, backend, setup.budget).with_host_budget(setup.host_budget);
        if exec.needs_nvme() {
            let Some(dir) = &setup.offload_dir else {
                return Err(binding(
                    "the plan keeps optimizer state on the NVMe: give --offload-dir DIR, a \
                     directory on the NVMe, for its files"
                        .into(),
                ));
            };
            exec = exec.with_nvme_dir(dir, setup.mesh.rank)?;
        }
        match runner {
            Some(r) => {
                if r.mesh() != &setup.mesh {
                    return Err(binding(format!(
                        "the communicator is for {:?} rank {}, the setup for {:?} rank {}",
                        r.mesh().shape,
                        r.mesh().rank,
                        setup.mesh.shape,
                        setup.mesh.rank
                    )));
                }
                exec = exec.with_collectives(Box::new(r));
            }
            None if setup.mesh.size() > 1 => {
                return Err(binding(format!(
                    "a device of mesh {:?} needs a communicator",
                    setup.mesh.shape
                )))
            }
            None => {}
        }
        let steps_done = match state {
            StartState::Global { steps_done, .. } => steps_done,
            StartState::Fresh { .. } => 0,
        };
        let scaler = train.loss_scale.map(|t| LossScaler::new(t, LossScaleConfig::default()));
        let mut trainer = Trainer {
            train,
            exec,
            mesh: setup.mesh,
            micro,
            batch,
            seq,
            schedule,
            seed,
            step: steps_done,
            started_at: steps_done,
            scaler,
            eval: None,
        };
        trainer.bind_state(&state)?;
        Ok(trainer)
    }

    /// A single device training `train` from a fresh init of `seed` (the rules read from
    /// `train`'s own graph).
    pub fn single(
        train: TrainingGraph,
        backend: B,
        schedule: LrSchedule,
        seed: u64,
        budget: Option<u64>,
    ) -> Result<Trainer<B>> {
        let rules = crate::init::init_rules_by_name(&train.graph);
        let state = StartState::Fresh { rules: &rules };
        Trainer::new(train, backend, None, DeviceSetup::single(budget), schedule, seed, state)
    }

    /// Leaf `t`'s placement (whole when the layout does not list it).
    fn placement(&self, t: TensorId) -> Placement {
        match self.train.layout.placements.get(&t) {
            Some(p) => p.clone(),
            None => vec![Vec::new(); self.train.graph.shape(t).rank()],
        }
    }

    /// This device's shard of global tensor `value` (named `name`) for leaf `t`.
    fn local(&self, t: TensorId, name: &str, value: &Tensor) -> Result<Tensor> {
        let g = &self.train.graph;
        let want = candle_dtype(g.meta(t).dtype);
        let placement = self.placement(t);
        let local = shard(&self.mesh, &value.to_dtype(want)?, &placement, name)?;
        if local.dims() != g.shape(t).dims() {
            return Err(binding(format!(
                "{name}: the global tensor {:?} gives a {:?} shard under {placement:?}, the \
                 program holds {}",
                value.dims(),
                local.dims(),
                g.meta(t)
            )));
        }
        Ok(local)
    }

    /// This device's shard of `name` from `source` for leaf `t` (its placement and dtype),
    /// checked against the leaf's local shape.
    fn source_shard(
        &self,
        source: &dyn ShardSource,
        name: &str,
        t: TensorId,
    ) -> Result<Option<Tensor>> {
        let g = &self.train.graph;
        let placement = self.placement(t);
        let dtype = candle_dtype(g.meta(t).dtype);
        let Some(local) = source.shard_of(name, &placement, &self.mesh, dtype)? else {
            return Ok(None);
        };
        if local.dims() != g.shape(t).dims() {
            return Err(binding(format!(
                "{name}: the source gives a {:?} shard under {placement:?}, the program holds {}",
                local.dims(),
                g.meta(t)
            )));
        }
        Ok(Some(local))
    }

    /// The global shape of leaf `t` (its local shape times the chunks of its placement).
    fn global_dims(&self, t: TensorId) -> Result<Vec<usize>> {
        let mut dims = self.train.graph.shape(t).dims().to_vec();
        for (d, axes) in self.placement(t).iter().enumerate() {
            dims[d] *= self.mesh.chunk(axes)?.0;
        }
        Ok(dims)
    }

    /// Binds parameters and optimizer state.
    fn bind_state(&mut self, state: &StartState<'_>) -> Result<()> {
        let slots = self.train.params.clone();
        let zeros = |dims: &[usize]| from_vec(written_zeros(dims.iter().product()), dims);
        for slot in &slots {
            let name = self.train.graph.tensor_scope(slot.param).to_string();
            let states = [(Some(slot.m), StateKind::AdamM), (Some(slot.v), StateKind::AdamV)]
                .into_iter()
                .chain([(slot.master, StateKind::Master)]);
            match state {
                StartState::Fresh { rules } => {
                    let rule = *rules
                        .get(&name)
                        .ok_or_else(|| binding(format!("no init rule for parameter `{name}`")))?;
                    let placement = self.placement(slot.param);
                    let global = self.global_dims(slot.param)?;
                    let draw = init_shard(&name, rule, &global, &placement, &self.mesh, self.seed)?;
                    let want = candle_dtype(self.train.graph.meta(slot.param).dtype);
                    self.exec.bind(slot.param, draw.to_dtype(want)?)?;
                    for (t, kind) in states {
                        let Some(t) = t else { continue };
                        let value = if kind == StateKind::Master {
                            // The master is the fp32 draw, on the optimizer's (ZeRO) shard.
                            let (p, g) = (self.placement(t), self.global_dims(t)?);
                            init_shard(&name, rule, &g, &p, &self.mesh, self.seed)?
                        } else {
                            zeros(self.train.graph.shape(t).dims())?
                        };
                        self.exec.bind(t, value)?;
                    }
                }
                StartState::Global { params, optimizer, .. } => {
                    let value =
                        self.source_shard(*params, &name, slot.param)?.ok_or_else(|| {
                            binding(format!("no value for parameter `{name}` (checkpoint or init)"))
                        })?;
                    self.exec.bind(slot.param, value)?;
                    for (t, kind) in states {
                        let Some(t) = t else { continue };
                        let key = state_key(&name, kind);
                        let value = match optimizer {
                            Some(o) => self.source_shard(*o, &key, t)?.ok_or_else(|| {
                                RuntimeError::Checkpoint(format!(
                                    "the checkpoint has no optimizer state `{key}`"
                                ))
                            })?,
                            // The master is the parameter in fp32, on the optimizer's shard.
                            None if kind == StateKind::Master => {
                                self.source_shard(*params, &name, t)?.ok_or_else(|| {
                                    binding(format!("no value for parameter `{name}`"))
                                })?
                            }
                            None => zeros(self.train.graph.shape(t).dims())?,
                        };
                        self.exec.bind(t, value)?;
                    }
                }
            }
            if let Some(gathered) = slot.gathered {
                self.exec.write_back(gathered, slot.param)?;
            }
            for &(stored, state) in &slot.stored {
                self.exec.write_back(stored, state)?;
            }
        }
        // Frozen parameters: their value only (no optimizer state, never updated).
        for p in self.train.graph.frozen_parameters() {
            let name = self.train.graph.tensor_scope(p).to_string();
            let value = match state {
                StartState::Fresh { rules } => {
                    let rule = *rules
                        .get(&name)
                        .ok_or_else(|| binding(format!("no init rule for parameter `{name}`")))?;
                    let (placement, global) = (self.placement(p), self.global_dims(p)?);
                    let draw = init_shard(&name, rule, &global, &placement, &self.mesh, self.seed)?;
                    draw.to_dtype(candle_dtype(self.train.graph.meta(p).dtype))?
                }
                StartState::Global { params, .. } => {
                    self.source_shard(*params, &name, p)?.ok_or_else(|| {
                        binding(format!(
                            "no value for frozen parameter `{name}` (checkpoint or init)"
                        ))
                    })?
                }
            };
            self.exec.bind(p, value)?;
        }
        Ok(())
    }

    /// Sets the dynamic loss scaling of an fp16 graph (and restarts its state from
    /// `cfg.init_scale`); an error for a graph without loss scaling.
    pub fn with_loss_scale(mut self, cfg: LossScaleConfig) -> Result<Trainer<B>> {
        check_scale_config(&cfg)?;
        let Some(input) = self.train.loss_scale else {
            return Err(binding(
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

    /// Restores the loss scaler's state from a checkpoint.
    pub fn set_loss_scale_state(&mut self, state: LossScaleState) -> Result<()> {
        let steps = self.step;
        let Some(scaler) = self.scaler.as_mut() else {
            return Err(binding(
                "the training graph has no loss scale (only fp16 parameters use one)".into(),
            ));
        };
        check_scale_config(&LossScaleConfig { init_scale: state.scale, ..scaler.cfg })?;
        if state.skipped_steps > steps {
            return Err(binding(format!(
                "{} skipped steps, but only {steps} steps are done",
                state.skipped_steps
            )));
        }
        scaler.state = state;
        Ok(())
    }

    /// Adds the forward-only evaluation graph [`Trainer::eval`] runs: the single-device model
    /// (same parameter names) with a scalar `loss` and its `logits`, built without dropout.
    pub fn with_eval(
        mut self,
        graph: Graph,
        loss: TensorId,
        logits: TensorId,
    ) -> Result<Trainer<B>> {
        MicroLeaves::find(&graph, &LeafLayout::default(), 0, &[])?;
        self.eval = Some((graph, loss, logits));
        Ok(self)
    }

    pub fn training_graph(&self) -> &TrainingGraph {
        &self.train
    }
    pub fn program(&self) -> &Program {
        self.exec.program()
    }
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }
    pub fn steps_done(&self) -> u64 {
        self.step
    }
    /// Global `(batch, seq)` of a step (`seq` 1 for models without token inputs).
    pub fn batch_shape(&self) -> (usize, usize) {
        (self.batch, self.seq)
    }
    /// The accountant's peak during the last step.
    pub fn measured_peak_bytes(&self) -> u64 {
        self.exec.accountant().peak_bytes()
    }
    /// This device's collective traffic so far.
    /// The backend's own allocator's peak of Program bytes ([`Backend::allocator_peak_bytes`]).
    pub fn allocator_peak_bytes(&self) -> Option<u64> {
        self.exec.backend().allocator_peak_bytes()
    }

    pub fn comm_stats(&self) -> CommStats {
        self.exec.collectives().map(|r| r.stats()).unwrap_or_default()
    }
    /// The communicator (for barriers around checkpoints; `None` on a lone device).
    pub fn communicator(&mut self) -> Option<&mut dyn tessera_comm::Communicator> {
        self.exec.collectives_mut().map(|r| r.communicator())
    }
    /// This device's value of a named parameter (the whole parameter on one device).
    pub fn parameter(&self, name: &str) -> Result<Option<Tensor>> {
        match self.train.graph.find_leaf(name) {
            Some(t) => self.exec.fetch(t),
            None => Ok(None),
        }
    }

    /// Runs one step of a token model on the *global* `[batch, seq]` inputs and labels (every
    /// rank passes the same ones): [`Trainer::step_batch`] on [`StepBatch::tokens`].
    pub fn step(&mut self, inputs: &[i64], targets: &[i64]) -> Result<StepStats> {
        let batch = StepBatch::tokens(inputs.to_vec(), targets.to_vec(), self.batch, self.seq)?;
        self.step_batch(&batch)
    }

    /// Runs one step on the *global* batch (every rank passes the same one): each micro-batch's
    /// rows of every field, this device's shard of them.
    pub fn step_batch(&mut self, batch: &StepBatch) -> Result<StepStats> {
        if self.batch != 0 && batch.rows() != self.batch {
            return Err(RuntimeError::Data(format!(
                "the batch has {} rows; the program takes {} per step",
                batch.rows(),
                self.batch
            )));
        }
        let step = self.step + 1;
        let lr = self.schedule.lr_at(step);
        let rows = batch.rows() / self.micro.len();
        let device = candle_core::Device::Cpu;
        // Over the whole step, so every micro-batch and shard divides alike.
        let num_targets = batch.num_targets()?;
        for (k, leaves) in self.micro.clone().iter().enumerate() {
            for (name, t) in &leaves.data {
                let part = field(batch, name)?.narrow(0, k * rows, rows)?;
                let part = zigzag(part, self.train.layout.zigzag)?;
                let local = self.local(*t, name, &part)?;
                self.exec.bind(*t, local)?;
            }
            if let Some(s) = leaves.seed {
                self.exec.bind(s, Tensor::new(step_seed(self.seed, step), &device)?)?;
            }
            if let Some(n) = leaves.num_targets {
                self.exec.bind(n, Tensor::new(num_targets, &device)?)?;
            }
        }
        self.exec.bind(self.train.lr, Tensor::new(lr as f32, &device)?)?;
        // AdamW's step counts applied updates (skipped fp16 steps excluded), 1-based.
        let skipped = self.scaler.map_or(0, |s| s.state.skipped_steps);
        self.exec.bind(self.train.step, Tensor::new((step - skipped) as i64, &device)?)?;
        let loss_scale = self.scaler.map_or(1.0, |s| s.state.scale);
        if let Some(scaler) = &self.scaler {
            self.exec.bind(scaler.input, Tensor::new(loss_scale as f32, &device)?)?;
        }
        self.exec.run()?;
        let loss = self.scalar(self.train.loss)?;
        let mut grad_norm = self.scalar(self.train.grad_norm)?;
        if !loss.is_finite() {
            return Err(RuntimeError::Data(non_finite_loss(
                step,
                loss,
                lr,
                step == self.started_at + 1,
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
            host_peak_bytes: self.exec.tier_accountant(tessera_ir::Tier::Host).peak_bytes(),
            skipped: overflow,
            loss_scale,
        })
    }

    fn scalar(&self, t: TensorId) -> Result<f64> {
        let v = self.exec.fetch(t)?.ok_or_else(|| binding("step output was not kept".into()))?;
        Ok(v.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?)
    }

    /// Loss and top-1 accuracy of the eval graph ([`Trainer::with_eval`]) over batches of the
    /// eval graph's shape, on parameters gathered to rank 0: `Some` there, `None` on the other
    /// ranks (every rank must call it). The loss is the mean of the batches' losses; the
    /// accuracy is over every label that counts. A seed input, if any, gets a fixed value per
    /// batch so evaluation stays deterministic.
    pub fn eval(&mut self, batches: &[StepBatch]) -> Result<Option<EvalStats>> {
        let Some((graph, loss, logits)) = self.eval.clone() else {
            return Err(binding("no eval graph was given (with_eval)".into()));
        };
        if batches.is_empty() {
            return Err(RuntimeError::Data("no held-out batches to evaluate".into()));
        }
        let Some(params) = gather_params_to(self, 0)? else { return Ok(None) };
        let leaves = MicroLeaves::find(&graph, &LeafLayout::default(), 0, &[])?;
        let program = Program::lower_graph(graph.clone(), vec![loss, logits], &[]);
        let mut exec = Executor::new(program, crate::CpuBackend::new(0), None);
        for p in graph.parameters() {
            let name = graph.tensor_scope(p);
            let v = params
                .get(name)
                .ok_or_else(|| binding(format!("eval graph parameter {name} is not trained")))?;
            exec.bind(p, v.clone())?;
        }
        let device = candle_core::Device::Cpu;
        let (mut total, mut hits, mut counted) = (0.0, 0usize, 0usize);
        for (i, batch) in batches.iter().enumerate() {
            for (name, t) in &leaves.data {
                let value = field(batch, name)?;
                let want = graph.meta(*t);
                if value.dims() != want.shape.dims() {
                    return Err(RuntimeError::Data(format!(
                        "eval batch field `{name}` is {:?}; the eval graph takes {want}",
                        value.dims()
                    )));
                }
                exec.bind(*t, value.to_dtype(candle_dtype(want.dtype))?)?;
            }
            if let Some(s) = leaves.seed {
                exec.bind(s, Tensor::new(step_seed(self.seed, u64::MAX - i as u64), &device)?)?;
            }
            if let Some(t) = leaves.num_targets {
                exec.bind(t, Tensor::new(batch.num_targets()?, &device)?)?;
            }
            exec.run()?;
            let v = exec.get(loss).ok_or_else(|| binding("eval loss not kept".into()))?;
            total += v.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
            let labels = batch.labels()?;
            if !labels.is_empty() {
                let z = exec.get(logits).ok_or_else(|| binding("eval logits not kept".into()))?;
                let (h, c) = top1_hits(z, &labels)?;
                hits += h;
                counted += c;
            }
        }
        let accuracy = (counted > 0).then(|| hits as f64 / counted as f64);
        Ok(Some(EvalStats { loss: total / batches.len() as f64, accuracy }))
    }

    /// This device's parameters by Hugging Face name, in graph order (live handles: copy
    /// before mutating); on one device these are the whole parameters.
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.state_of(false)
    }

    /// This device's AdamW state keyed `<parameter>.adam_m`, `.adam_v` and (mixed precision)
    /// `.master`.
    pub fn optimizer_state(&self) -> Result<Vec<(String, Tensor)>> {
        self.state_of(true)
    }

    /// The parameters (`optimizer: false`) or the optimizer state of [`Trainer::local_state`].
    fn state_of(&self, optimizer: bool) -> Result<Vec<(String, Tensor)>> {
        let state = self.local_state()?.into_iter();
        Ok(state.filter(|s| s.3.is_some() == optimizer).map(|(name, t, _, _)| (name, t)).collect())
    }

    /// This device's parameters and optimizer state: `(name, local tensor, placement, state
    /// kind)` (`None` for a parameter).
    #[allow(clippy::type_complexity)]
    pub fn local_state(&self) -> Result<Vec<(String, Tensor, Placement, Option<StateKind>)>> {
        let g = &self.train.graph;
        let mut out = Vec::new();
        for slot in &self.train.params {
            let name = g.tensor_scope(slot.param);
            let tensors = [(Some(slot.param), name.to_string(), None)].into_iter().chain(
                [(Some(slot.m), StateKind::AdamM), (Some(slot.v), StateKind::AdamV)]
                    .into_iter()
                    .chain([(slot.master, StateKind::Master)])
                    .map(|(t, k)| (t, state_key(name, k), Some(k))),
            );
            for (t, key, kind) in tensors {
                let Some(t) = t else { continue };
                // Offloaded state is read from its tier (the NVMe's files included).
                let value =
                    self.exec.value(t)?.ok_or_else(|| binding(format!("{key} is not bound")))?;
                out.push((key, value, self.placement(t), kind));
            }
        }
        for p in g.frozen_parameters() {
            let name = g.tensor_scope(p).to_string();
            let value =
                self.exec.value(p)?.ok_or_else(|| binding(format!("{name} is not bound")))?;
            out.push((name, value, self.placement(p), None));
        }
        Ok(out)
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
}

/// `n` f32 zeros, written (in parallel) rather than `calloc`ed: an optimizer moment is read
/// and then written on the first step, and on a lazily mapped zero page that made each page
/// two faults, the second a copy-on-write with a TLB shootdown to every other core (~2.9 s of
/// GPT-2's first step, three quarters of the step, on two cores). Written here, each page
/// faults once, at start-up.
fn written_zeros(n: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let mut v: Vec<f32> = Vec::with_capacity(n);
    v.spare_capacity_mut().par_chunks_mut(1 << 16).for_each(|c| {
        for x in c {
            x.write(0.0);
        }
    });
    // SAFETY: all n elements were written above.
    unsafe { v.set_len(n) };
    v
}

/// Batch field `name`; BERT's `token_type_ids` default to zeros (one segment), the
/// `position_ids` a plan adds (ring attention's RoPE, [`LeafLayout::zigzag`]) to `0..seq` in
/// every row.
fn field(batch: &StepBatch, name: &str) -> Result<Tensor> {
    match (batch.get(name), batch.get("input_ids")) {
        (Some(v), _) => Ok(v.clone()),
        (None, Some(ids)) if name == "token_type_ids" => Ok(ids.zeros_like()?),
        (None, Some(ids)) if name == "position_ids" && ids.rank() == 2 => {
            let (rows, seq) = ids.dims2()?;
            let pos = Tensor::arange(0i64, seq as i64, ids.device())?;
            Ok(pos.unsqueeze(0)?.broadcast_as((rows, seq))?.contiguous()?)
        }
        (None, _) => Err(RuntimeError::Data(format!(
            "the model takes input `{name}`, the batch has {:?}: the data does not fit this \
             model (images for ViT, tokens for language models)",
            batch.names()
        ))),
    }
}

/// A `[batch, seq, ..]` data input reordered into ring attention's zig-zag chunks (`n`
/// devices: `2·n` chunks, chunk `c` then `2·n − 1 − c` for each `c`, see
/// [`LeafLayout::zigzag`]); unchanged without zig-zag or for a tensor of rank < 2.
fn zigzag(x: Tensor, n: Option<usize>) -> Result<Tensor> {
    let Some(n) = n.filter(|&n| n > 1) else { return Ok(x) };
    if x.rank() < 2 {
        return Ok(x);
    }
    let seq = x.dims()[1];
    if !seq.is_multiple_of(2 * n) {
        return Err(RuntimeError::Data(format!(
            "ring attention cuts the sequence into {} zig-zag chunks, which {seq} tokens do \
             not divide into",
            2 * n
        )));
    }
    let len = seq / (2 * n);
    let order: Vec<u32> = (0..n)
        .flat_map(|c| [c, 2 * n - 1 - c])
        .flat_map(|chunk| (chunk * len..(chunk + 1) * len).map(|i| i as u32))
        .collect();
    let idx = Tensor::new(order.as_slice(), x.device())?;
    Ok(x.index_select(&idx, 1)?)
}

/// Every *parameter* (no optimizer state) as a global tensor on `root` only; `None` on the
/// other ranks (every rank must call it). The ranks first exchange what they hold
/// ([`crate::state_table`]: under a pipeline each stage holds only its own parameters); then
/// each distinct chunk travels once, point to point from its writer to `root`, so the extra
/// memory is one copy of the model on one rank (what evaluation after training needs), not
/// the whole state on every rank.
pub fn gather_params_to<B: Backend>(
    trainer: &mut Trainer<B>,
    root: usize,
) -> Result<Option<HashMap<String, Tensor>>> {
    let me = trainer.mesh.rank;
    let params = trainer.parameters()?;
    if trainer.mesh.size() == 1 {
        return Ok(Some(params.into_iter().collect()));
    }
    let leaves: HashMap<&str, TensorId> = trainer.train.graph.leaf_index().into_iter().collect();
    let mut mine =
        RankTable { mesh: trainer.mesh.shape.clone(), step: trainer.step, tensors: vec![] };
    let mut local = HashMap::with_capacity(params.len());
    for (name, t) in params {
        let leaf = leaves
            .get(name.as_str())
            .copied()
            .ok_or_else(|| binding(format!("parameter {name} is not a leaf of the program")))?;
        let placement = trainer.placement(leaf);
        let index =
            placement.iter().map(|axes| Ok(trainer.mesh.chunk(axes)?.1)).collect::<Result<_>>()?;
        mine.tensors.push(ShardedTensor {
            name: name.clone(),
            role: TensorRole::Param,
            shape: trainer.global_dims(leaf)?,
            dtype: t.dtype().as_str().to_string(),
            placement,
            chunks: vec![ChunkLocation { index, rank: me }],
        });
        local.insert(name, t);
    }
    let comm = trainer
        .communicator()
        .ok_or_else(|| binding("gathering parameters needs a communicator".into()))?;
    let table = state_table::merge(&state_table::exchange(comm, &mine)?)?;
    let mut out = HashMap::with_capacity(table.len());
    // Chunk counts per dim do not depend on the rank.
    let origin = DeviceMesh::new(&mine.mesh, 0)?;
    for t in &table {
        let placement = &t.placement;
        let grid: Vec<usize> =
            placement.iter().map(|axes| Ok(origin.chunk(axes)?.0)).collect::<Result<_>>()?;
        let chunk: Vec<usize> = t.shape.iter().zip(&grid).map(|(s, n)| s / n).collect();
        if me != root {
            if t.chunks.iter().any(|c| c.rank == me) {
                let part =
                    local.get(&t.name).ok_or_else(|| binding(format!("{} vanished", t.name)))?;
                let flat =
                    part.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
                comm.send(root, &flat)?;
            }
            continue;
        }
        let dtype: candle_core::DType = t
            .dtype
            .parse()
            .map_err(|_| binding(format!("{}: unknown dtype {}", t.name, t.dtype)))?;
        let mut whole = Tensor::zeros(t.shape.as_slice(), dtype, &candle_core::Device::Cpu)?;
        for c in &t.chunks {
            let part = if c.rank == root {
                local
                    .get(&t.name)
                    .cloned()
                    .ok_or_else(|| binding(format!("{} vanished", t.name)))?
            } else {
                from_vec(comm.recv(c.rank)?, &chunk)?.to_dtype(dtype)?
            };
            if part.dims() != chunk.as_slice() {
                return Err(binding(format!(
                    "{}: rank {}'s chunk is {:?}, expected {chunk:?}",
                    t.name,
                    c.rank,
                    part.dims()
                )));
            }
            let ranges: Vec<_> =
                c.index.iter().zip(&chunk).map(|(&i, &n)| i * n..(i + 1) * n).collect();
            whole = whole.slice_assign(&ranges, &part)?;
        }
        out.insert(t.name.clone(), whole);
    }
    Ok((me == root).then_some(out))
}

/// Whether a graph's parameters are all fp32 or have fp32 masters (what `train` supports).
fn check_trainable(train: &TrainingGraph, backend: &str) -> Result<()> {
    let g = &train.graph;
    for slot in &train.params {
        let dtype = g.meta(slot.param).dtype;
        if !(dtype == DType::F32 || (dtype.is_float() && slot.master.is_some())) {
            return Err(RuntimeError::Unsupported {
                backend: backend.to_string(),
                op: "train".into(),
                reason: format!(
                    "{} is {dtype} without an fp32 master copy; train in fp32, bf16 or fp16",
                    g.tensor_scope(slot.param)
                ),
            });
        }
    }
    Ok(())
}

/// Why the loss of `step` is `loss`: before any update (`first`) the weights are the finite ones
/// loaded or initialised, so no learning rate made it; after updates, the step size did.
fn non_finite_loss(step: u64, loss: f64, lr: f64, first: bool) -> String {
    if first {
        format!(
            "step {step}: the loss is {loss} before any update of this run, from weights checked \
             finite: an operation of the model made it (an overflow of --dtype bf16/fp16, or an \
             op undefined on these inputs, e.g. the log or square root of a negative); run with \
             --dtype f32 to tell the two apart, and check the model's inputs"
        )
    } else {
        format!(
            "step {step}: the loss is {loss}; the updates diverged: lower the learning rate \
             (now {lr:.2e}), or check --weight-decay and --max-grad-norm"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::non_finite_loss;

    #[test]
    fn a_non_finite_loss_before_any_update_is_not_blamed_on_the_learning_rate() {
        let first = non_finite_loss(1, f64::NAN, 1e-3, true);
        assert!(!first.contains("learning rate"), "{first}");
        assert!(first.contains("before any update") && first.contains("--dtype f32"), "{first}");
        let later = non_finite_loss(7, f64::INFINITY, 1e-3, false);
        assert!(later.contains("lower the learning rate (now 1.00e-3)"), "{later}");
    }
}
