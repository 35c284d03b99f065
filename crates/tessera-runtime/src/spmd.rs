//! One device of a parallel plan: the training loop that every rank runs on its own shards.
//!
//! The planner lowers a plan to one Program for all devices (all splits are even); what makes
//! a device *this* device is its mesh coordinate, which picks its shard of every leaf
//! ([`DeviceMesh::shard`]) and its place in every collective ([`CommRunner`]). So a rank:
//!
//! 1. binds its shard of every parameter and optimizer state from *global* tensors (a fresh
//!    init or a checkpoint saved under any plan — resharding on load is just this slicing);
//! 2. per step, cuts the global batch into micro-batches (`input_ids`, `input_ids@mb1`, ..)
//!    and binds its shard of each, binds the scalars (learning rate, AdamW step) and runs the
//!    Program — collectives included;
//! 3. reads the loss and gradient norm, which the Program all-reduces, so every rank reports
//!    the same numbers as a single device would.
//!
//! ZeRO-1/2 parameters are updated on shards and gathered back: the gathered tensor becomes
//! the parameter ([`crate::Executor::write_back`]).

use crate::collective::{CommRunner, DeviceMesh, Placement};
use crate::tensor::{candle_dtype, from_vec};
use crate::trainer::{step_seed, StepStats};
use crate::{Backend, Executor, LrSchedule, Result, RuntimeError};
use candle_core::Tensor;
use std::collections::HashMap;
use tessera_comm::CommStats;
use tessera_ir::{DType, Op, Program, TensorId, TrainingGraph};

/// A micro-batch's data leaves.
#[derive(Clone, Debug)]
struct MicroLeaves {
    ids: TensorId,
    labels: TensorId,
    token_types: Option<TensorId>,
    seed: Option<TensorId>,
}

/// The plan-side facts a device needs besides its Program.
#[derive(Clone, Debug)]
pub struct DeviceSetup {
    pub mesh: DeviceMesh,
    /// Placement of every leaf by name: parameters, their optimizer state
    /// (`<param>.adam_m`, `.adam_v`, `.master`) and the data inputs (`input_ids`, `labels`).
    pub placements: HashMap<String, Placement>,
    pub micro_batches: usize,
    /// This device's memory budget (bytes); exceeding it is a clear error.
    pub budget: Option<u64>,
}

/// Global tensors to start from: parameters by HF name, and optionally optimizer state by
/// `<param>.adam_m` / `.adam_v` / `.master` (absent: zeros, and masters from the parameters).
pub struct GlobalState<'a> {
    pub params: &'a HashMap<String, Tensor>,
    pub optimizer: Option<&'a HashMap<String, Tensor>>,
    pub steps_done: u64,
}

pub struct SpmdTrainer<B: Backend> {
    train: TrainingGraph,
    exec: Executor<B>,
    mesh: DeviceMesh,
    placements: HashMap<String, Placement>,
    micro: Vec<MicroLeaves>,
    /// Global batch and sequence length of a step.
    batch: usize,
    seq: usize,
    schedule: LrSchedule,
    seed: u64,
    step: u64,
}

fn binding(msg: String) -> RuntimeError {
    RuntimeError::Binding(msg)
}

impl<B: Backend> SpmdTrainer<B> {
    pub fn new(
        train: TrainingGraph,
        backend: B,
        runner: CommRunner,
        setup: DeviceSetup,
        schedule: LrSchedule,
        seed: u64,
        state: GlobalState<'_>,
    ) -> Result<SpmdTrainer<B>> {
        check_trainable(&train)?;
        let g = &train.graph;
        if train.loss_scale.is_some() {
            return Err(RuntimeError::Unsupported {
                backend: backend.name().to_string(),
                op: "train".into(),
                reason: "fp16 loss scaling is not supported on several devices yet; use fp32 \
                         or bf16"
                    .into(),
            });
        }
        if let Some(n) = g.nodes.iter().find(|n| matches!(n.op, Op::Dropout { p, .. } if p > 0.0)) {
            if setup.mesh.size() > 1 {
                return Err(RuntimeError::Unsupported {
                    backend: backend.name().to_string(),
                    op: "dropout".into(),
                    reason: format!(
                        "{} uses dropout, whose masks are keyed by local element indices, so \
                         a sharded run would not match one device; train this model with \
                         dropout 0 (set the config's *_pdrop / dropout fields to 0) or on one \
                         device",
                        g.scope_name(n.scope)
                    ),
                });
            }
        }
        let mb = setup.micro_batches.max(1);
        let mut micro = Vec::with_capacity(mb);
        for k in 0..mb {
            let name = |base: &str| if k == 0 { base.to_string() } else { format!("{base}@mb{k}") };
            let find = |base: &str| g.find_leaf(&name(base));
            let ids = find("input_ids").ok_or_else(|| {
                binding(format!(
                    "the program has no `{}` input (token models only)",
                    name("input_ids")
                ))
            })?;
            let labels = find("labels")
                .ok_or_else(|| binding(format!("the program has no `{}` input", name("labels"))))?;
            micro.push(MicroLeaves {
                ids,
                labels,
                token_types: find("token_type_ids"),
                seed: find("seed"),
            });
        }
        if g.find_leaf(&format!("input_ids@mb{mb}")).is_some() {
            return Err(binding(format!(
                "the program has more than {mb} micro-batches: pass the plan's micro-batch count"
            )));
        }
        let (seq, batch) = {
            let ids = micro[0].ids;
            let local = g.shape(ids).dims().to_vec();
            let placement = setup
                .placements
                .get("input_ids")
                .ok_or_else(|| binding("the plan gives no placement for `input_ids`".into()))?;
            let mut global = local.clone();
            for (d, axes) in placement.iter().enumerate() {
                global[d] *= setup.mesh.chunk(axes)?.0;
            }
            if global.len() != 2 {
                return Err(binding(format!("`input_ids` must be [batch, seq], got {global:?}")));
            }
            (global[1], global[0] * mb)
        };

        let program = Program::lower_training(&train);
        let exec = Executor::new(program, backend, setup.budget).with_collectives(Box::new(runner));
        let mut trainer = SpmdTrainer {
            train,
            exec,
            mesh: setup.mesh,
            placements: setup.placements,
            micro,
            batch,
            seq,
            schedule,
            seed,
            step: state.steps_done,
        };
        trainer.bind_state(&state)?;
        Ok(trainer)
    }

    fn placement(&self, name: &str) -> Result<&Placement> {
        self.placements
            .get(name)
            .ok_or_else(|| binding(format!("the plan gives no placement for `{name}`")))
    }

    /// This device's shard of global tensor `value` (named `name`) for leaf `t`.
    fn local(&self, t: TensorId, name: &str, value: &Tensor) -> Result<Tensor> {
        let g = &self.train.graph;
        let want = candle_dtype(g.meta(t).dtype);
        let placement = self.placement(name)?;
        let shard = self.mesh.shard(&value.to_dtype(want)?, placement, name)?;
        if shard.dims() != g.shape(t).dims() {
            return Err(binding(format!(
                "{name}: the global tensor {:?} gives a {:?} shard under {placement:?}, the                  program holds {}",
                value.dims(),
                shard.dims(),
                g.meta(t)
            )));
        }
        Ok(shard)
    }

    /// Binds parameters and optimizer state from global tensors.
    fn bind_state(&mut self, state: &GlobalState<'_>) -> Result<()> {
        let slots = self.train.params.clone();
        for slot in &slots {
            let name = self.train.graph.tensor_scope(slot.param).to_string();
            let global = state.params.get(&name).ok_or_else(|| {
                binding(format!("no value for parameter `{name}` (checkpoint or init)"))
            })?;
            let value = self.local(slot.param, &name, global)?;
            self.exec.bind(slot.param, value)?;
            if let Some(gathered) = slot.gathered {
                self.exec.write_back(gathered, slot.param)?;
            }
            for (t, suffix) in
                [(Some(slot.m), "adam_m"), (Some(slot.v), "adam_v"), (slot.master, "master")]
            {
                let Some(t) = t else { continue };
                let key = format!("{name}.{suffix}");
                let saved = state.optimizer.and_then(|o| o.get(&key));
                let value = match (saved, suffix) {
                    (Some(v), _) => self.local(t, &key, v)?,
                    (None, "master") if state.optimizer.is_none() => {
                        self.local(t, &key, &global.to_dtype(candle_core::DType::F32)?)?
                    }
                    (None, _) if state.optimizer.is_none() => {
                        let dims = self.train.graph.shape(t).dims().to_vec();
                        Tensor::zeros(
                            dims.as_slice(),
                            candle_core::DType::F32,
                            &candle_core::Device::Cpu,
                        )?
                    }
                    (None, _) => {
                        return Err(RuntimeError::Checkpoint(format!(
                            "the checkpoint has no optimizer state `{key}`"
                        )))
                    }
                };
                self.exec.bind(t, value)?;
            }
        }
        Ok(())
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
    /// Global `(batch, seq)` of a step.
    pub fn batch_shape(&self) -> (usize, usize) {
        (self.batch, self.seq)
    }
    /// The accountant's peak during the last step.
    pub fn measured_peak_bytes(&self) -> u64 {
        self.exec.accountant().peak_bytes()
    }
    /// This device's collective traffic so far.
    pub fn comm_stats(&self) -> CommStats {
        self.exec.collectives().map(|r| r.stats()).unwrap_or_default()
    }

    /// The communicator (for barriers around checkpoints).
    pub fn communicator(&mut self) -> Option<&mut dyn tessera_comm::Communicator> {
        self.exec.collectives_mut().map(|r| r.communicator())
    }

    /// Runs one step on the *global* `[batch, seq]` batch (every rank passes the same one).
    pub fn step(&mut self, inputs: &[i64], targets: &[i64]) -> Result<StepStats> {
        let n = self.batch * self.seq;
        if inputs.len() != n || targets.len() != n {
            return Err(RuntimeError::Data(format!(
                "batch has {} inputs and {} targets; the plan expects {} × {} = {n}",
                inputs.len(),
                targets.len(),
                self.batch,
                self.seq
            )));
        }
        let step = self.step + 1;
        let lr = self.schedule.lr_at(step);
        let rows = self.batch / self.micro.len();
        let per = rows * self.seq;
        for (k, leaves) in self.micro.clone().iter().enumerate() {
            let part = |v: &[i64]| from_vec(v[k * per..(k + 1) * per].to_vec(), &[rows, self.seq]);
            let ids = self.local(leaves.ids, "input_ids", &part(inputs)?)?;
            self.exec.bind(leaves.ids, ids)?;
            let labels = self.local(leaves.labels, "labels", &part(targets)?)?;
            self.exec.bind(leaves.labels, labels)?;
            if let Some(tt) = leaves.token_types {
                let zeros = from_vec(vec![0i64; per], &[rows, self.seq])?;
                let local = self.local(tt, "token_type_ids", &zeros)?;
                self.exec.bind(tt, local)?;
            }
            if let Some(s) = leaves.seed {
                self.exec
                    .bind(s, Tensor::new(step_seed(self.seed, step), &candle_core::Device::Cpu)?)?;
            }
        }
        let device = candle_core::Device::Cpu;
        self.exec.bind(self.train.lr, Tensor::new(lr as f32, &device)?)?;
        self.exec.bind(self.train.step, Tensor::new(step as i64, &device)?)?;
        self.exec.run()?;
        let loss = self.scalar(self.train.loss)?;
        let grad_norm = self.scalar(self.train.grad_norm)?;
        if !loss.is_finite() {
            return Err(RuntimeError::Data(format!(
                "step {step}: the loss is {loss}; lower the learning rate (now {lr:.2e})"
            )));
        }
        self.step = step;
        Ok(StepStats {
            step,
            loss,
            grad_norm,
            lr,
            peak_bytes: self.exec.accountant().peak_bytes(),
            skipped: false,
            loss_scale: 1.0,
        })
    }

    fn scalar(&self, t: TensorId) -> Result<f64> {
        let v = self.exec.get(t).ok_or_else(|| binding("step output was not kept".into()))?;
        Ok(v.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?)
    }

    /// This device's parameters and optimizer state: `(name, local tensor, placement)`.
    pub fn local_state(&self) -> Result<Vec<(String, Tensor, Placement)>> {
        let g = &self.train.graph;
        let mut out = Vec::new();
        for slot in &self.train.params {
            let name = g.tensor_scope(slot.param);
            let tensors = [(Some(slot.param), name.to_string())].into_iter().chain(
                [(Some(slot.m), "adam_m"), (Some(slot.v), "adam_v"), (slot.master, "master")]
                    .into_iter()
                    .map(|(t, s)| (t, format!("{name}.{s}"))),
            );
            for (t, key) in tensors {
                let Some(t) = t else { continue };
                let value =
                    self.exec.get(t).ok_or_else(|| binding(format!("{key} is not bound")))?;
                out.push((key.clone(), value.clone(), self.placement(&key)?.clone()));
            }
        }
        Ok(out)
    }
}

/// Every *parameter* (no optimizer state) as a global tensor on `root` only; `None` on the
/// other ranks. Replicated parameters need no traffic; a sharded one travels once per distinct
/// chunk, point to point from its writer to `root`, so the extra memory is one copy of the
/// model on one rank (what evaluation after training needs), not the whole state on every rank.
pub fn gather_params_to<B: Backend>(
    trainer: &mut SpmdTrainer<B>,
    root: usize,
) -> Result<Option<HashMap<String, Tensor>>> {
    let shape = trainer.mesh.shape.clone();
    let n = trainer.mesh.size();
    let me = trainer.mesh.rank;
    let g = &trainer.train.graph;
    let mut params = Vec::with_capacity(trainer.train.params.len());
    for slot in &trainer.train.params {
        let name = g.tensor_scope(slot.param).to_string();
        let value = trainer
            .exec
            .get(slot.param)
            .ok_or_else(|| binding(format!("{name} is not bound")))?
            .clone();
        let placement = trainer.placement(&name)?.clone();
        params.push((name, value, placement));
    }
    let mut out = HashMap::with_capacity(params.len());
    for (name, t, placement) in params {
        if placement.iter().all(|axes| axes.is_empty()) {
            if me == root {
                out.insert(name, t);
            }
            continue;
        }
        let writers: Vec<usize> = (0..n)
            .filter(|&r| DeviceMesh::new(&shape, r).is_ok_and(|m| m.is_writer(&placement)))
            .collect();
        if me != root {
            if writers.contains(&me) {
                let comm = trainer
                    .communicator()
                    .ok_or_else(|| binding("gathering needs a communicator".into()))?;
                let flat = t.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
                comm.send(root, &flat)?;
            }
            continue;
        }
        // `assemble` reads only the writers' parts; the others stand in with root's own shard.
        let mut parts = vec![t.clone(); n];
        for &r in writers.iter().filter(|&&r| r != root) {
            let comm = trainer
                .communicator()
                .ok_or_else(|| binding("gathering needs a communicator".into()))?;
            let flat = comm.recv(r)?;
            parts[r] = from_vec(flat, t.dims())?.to_dtype(t.dtype())?;
        }
        out.insert(name, crate::collective::assemble(&shape, &parts, &placement)?);
    }
    Ok((me == root).then_some(out))
}

/// Whether a graph's parameters are all fp32 or have fp32 masters (what `train` supports).
fn check_trainable(train: &TrainingGraph) -> Result<()> {
    let g = &train.graph;
    for slot in &train.params {
        let dtype = g.meta(slot.param).dtype;
        if !(dtype == DType::F32 || (dtype.is_float() && slot.master.is_some())) {
            return Err(binding(format!(
                "{} is {dtype} without an fp32 master copy; train in fp32 or bf16",
                g.tensor_scope(slot.param)
            )));
        }
    }
    Ok(())
}
