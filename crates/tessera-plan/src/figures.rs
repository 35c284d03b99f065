//! The data the search's phases exchange: the candidates ([`Candidate`], under an
//! [`AxisRule`]), the forward graph they share ([`Forward`]), what lowering one predicts
//! ([`Lowered`]: the Program, its memory, its step time and collectives), an evaluated candidate
//! ([`Evaluated`]), and what a candidate that does not fit reached ([`Miss`], [`LeastPeak`]).
//!
//! It sits below every phase that produces or reads them (`search`, `lower`, `ckpt`,
//! `offload`, the pipeline and the planner), so that those modules depend on this one instead
//! of on each other. Nothing here computes a plan; it only names what one is made of.

pub use crate::cost::StepTime;
use crate::rules::Strategy;
use crate::{Mesh, Spec};
use tessera_ir::{
    Checkpointing, Graph, LeafLayout, ParamSlot, Phase, Program, TensorId, TrainingGraph,
};
use tessera_profile::MemoryReport;

/// Which labels each mesh axis may split.
#[derive(Clone, Debug, PartialEq)]
pub enum AxisRule {
    /// Any axis any label (the automatic search).
    Free,
    /// A fixed `dp × tp` configuration on a `[dp, tp]` mesh: axis 0 must split the batch of
    /// every op that has one; axis 1 splits what Megatron-LM's tensor (and, with `sp`,
    /// sequence) parallelism splits, op by op (see `search/megatron.rs`). With `cp`, the mesh
    /// is `[dp, cp, tp]` and the axis before the tensor axis is context-parallel: it splits
    /// every op's sequence, and attention's heads ([`crate::context`]).
    Megatron { sp: bool, cp: bool },
}

/// One point of the search space.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub mesh: Mesh,
    pub rule: AxisRule,
    pub zero: u8,
    pub micro_batches: usize,
    /// Model state below the device ([`crate::offload`]); `None`: all on the device.
    pub offload: Option<crate::offload::Offload>,
}

impl Candidate {
    /// A total order of candidates, for answers that must not depend on thread timing:
    /// fewer micro-batches, then lower ZeRO stages, then Megatron-style layouts before per-op
    /// ones (a config string reproduces them).
    pub fn order_key(&self) -> (usize, u8, u8, &[usize]) {
        let rule = match self.rule {
            AxisRule::Megatron { sp, .. } => sp as u8,
            AxisRule::Free => 2,
        };
        (self.micro_batches, self.zero, rule, &self.mesh.shape)
    }
}

/// A solved and lowered candidate.
#[derive(Clone, Debug)]
pub struct Evaluated {
    pub candidate: Candidate,
    /// Strategy per node of the forward graph (`None` for leaves).
    pub strategies: Vec<Option<Strategy>>,
    pub lowered: Lowered,
    /// The ILP's own estimate (seconds), before lowering.
    pub ilp_objective_s: f64,
}

impl Evaluated {
    pub fn step_time_s(&self) -> f64 {
        self.lowered.time.step_time_s
    }
    pub fn peak_bytes(&self) -> u64 {
        self.lowered.memory.peak_bytes
    }
}

/// The forward graph of one micro-batch and its loss.
pub struct Forward {
    pub graph: Graph,
    pub loss: TensorId,
}

/// A forward graph with its saved-activation flags, shared by candidates.
pub type SharedForward = std::sync::Arc<(Forward, Vec<bool>)>;

/// The lowered plan and everything predicted from it.
#[derive(Clone, Debug)]
pub struct Lowered {
    /// One device's Program (every device runs the same one on its own shards). Its graph is
    /// the checkpointed training graph: kept once, here ([`Lowered::training_graph`]). A
    /// second copy per lowering was a tenth of the search's time, in copies, frees and
    /// page faults.
    pub program: Program,
    /// The training graph's handles and leaf layout (its graph is the Program's).
    pub handles: StepHandles,
    pub memory: MemoryReport,
    pub time: StepTime,
    pub collectives: Vec<CollectiveRecord>,
    /// The stored spec of each parameter, its optimizer state (`<param>.adam_m`, `.adam_v`,
    /// `.master`) and each input, by name.
    pub leaf_specs: Vec<(String, Spec)>,
    /// The checkpoint decisions the Program carries out.
    pub ckpt: Checkpointing,
    /// `false` when `memory` and `time` are extrapolated to more micro-batches than `program`
    /// holds ([`crate::lower::priced`]): a search figure, lowered exactly before it becomes a plan.
    pub exact: bool,
}

/// A training graph less its graph: the tensors that matter (loss, gradient norm, inputs,
/// parameter slots) and the leaf layout, kept beside the Program that holds the graph.
#[derive(Clone, Debug)]
pub struct StepHandles {
    pub loss: TensorId,
    pub grad_norm: TensorId,
    pub lr: TensorId,
    pub step: TensorId,
    pub loss_scale: Option<TensorId>,
    pub params: Vec<ParamSlot>,
    pub layout: LeafLayout,
}

impl StepHandles {
    /// `tg` split into its graph and its handles.
    pub fn split(tg: TrainingGraph) -> (Graph, StepHandles) {
        let TrainingGraph { graph, loss, grad_norm, lr, step, loss_scale, params, layout } = tg;
        (graph, StepHandles { loss, grad_norm, lr, step, loss_scale, params, layout })
    }

    /// The training graph of these handles over `graph`.
    pub fn join(self, graph: Graph) -> TrainingGraph {
        let StepHandles { loss, grad_norm, lr, step, loss_scale, params, layout } = self;
        TrainingGraph { graph, loss, grad_norm, lr, step, loss_scale, params, layout }
    }
}

impl Lowered {
    /// The training graph the Program runs (a copy of its graph, with the handles).
    pub fn training_graph(&self) -> TrainingGraph {
        self.handles.clone().join(self.program.graph().clone())
    }

    /// [`Lowered::training_graph`], without the copy.
    pub fn into_training_graph(self) -> TrainingGraph {
        self.handles.join(self.program.graph)
    }
}

/// Bytes by role at the peak instruction of a memory simulation (keys: [`tessera_ir::Role::name`]).
pub fn peak_breakdown(m: &MemoryReport) -> std::collections::BTreeMap<String, u64> {
    m.peak_by_role.iter().map(|(r, b)| (r.name().to_string(), *b)).collect()
}

/// One collective step of the Program.
#[derive(Clone, Debug, PartialEq)]
pub struct CollectiveRecord {
    pub scope: String,
    pub phase: Phase,
    pub op: &'static str,
    pub axis: usize,
    pub group: usize,
    /// Bytes this device contributes.
    pub bytes: u64,
}

/// The least per-device peak a candidate reaches under the search's own rules: its most
/// memory-frugal layout (the ILP minimising its memory rows) with the checkpointing the policy
/// accepts that keeps the least — for the joint search the plain Program or full recompute,
/// whichever peaks lower. The search accepts that layout under any budget of at least this
/// (see [`evaluate`]) and, when nothing fits, evaluates every candidate it enumerates (the
/// deferred ones included): a budget of the least over a failed search's candidates finds a
/// plan, and under any smaller one every candidate's most frugal layout misses.
#[derive(Clone, Debug)]
pub struct LeastPeak {
    pub peak_bytes: u64,
    pub candidate: Candidate,
    /// The checkpointing that reaches it.
    pub ckpt: Checkpointing,
}

impl LeastPeak {
    /// A total order (ties broken by the candidate), so that the record does not depend on
    /// which thread finished first.
    pub(crate) fn key(&self) -> (u64, (usize, u8, u8, &[usize])) {
        (self.peak_bytes, self.candidate.order_key())
    }

    /// Keeps `this` in `slot` if it is less than what is there.
    pub(crate) fn record(slot: &std::sync::Mutex<Option<LeastPeak>>, this: LeastPeak) {
        if let Ok(mut least) = slot.lock() {
            if least.as_ref().is_none_or(|l| this.key() < l.key()) {
                *least = Some(this);
            }
        }
    }
}

/// What a candidate that does not fit reached: the least peak of its most frugal layout, and
/// the bytes resting on a device before a step, at `micro_batches` micro-batches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Miss {
    pub micro_batches: usize,
    pub least_peak: u64,
    pub resting: u64,
}

impl Miss {
    /// The least bytes any layout can peak at with `micro_batches` (≥ this miss's count), for
    /// a resting floor `floor` (see the module docs).
    pub fn bound(&self, micro_batches: usize, floor: u64) -> u64 {
        let floor = floor.min(self.resting).min(self.least_peak);
        let above = (self.least_peak - floor) as u128 * self.micro_batches as u128;
        floor + (above / micro_batches.max(1) as u128) as u64
    }

    /// Whether no layout can fit `budget` with `micro_batches` (more than this miss's count).
    pub fn rules_out(&self, micro_batches: usize, floor: u64, budget: u64) -> bool {
        micro_batches > self.micro_batches && self.bound(micro_batches, floor) > budget
    }
}
