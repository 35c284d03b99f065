//! Lowering a pipelined plan: one Program per pipeline device, in its schedule's order.
//!
//! 1. The forward graph is sharded for the stage's data/tensor-parallel mesh as usual
//!    ([`LocalForward`]) and cut into per-device forward graphs ([`split::cut`]): transfers
//!    are `Send`/`Recv` nodes.
//! 2. Each device's graph is differentiated by the ordinary autodiff from its stand-in loss
//!    (the transfers' VJPs are the gradient transfers) with the distributed optimizer hooks
//!    over the full mesh (the gradient norm is summed over the pipeline axis too), then the
//!    micro-batch replay unrolls it.
//! 3. The loss, which only the last stage computes, is summed over the pipeline axis (every
//!    other stage contributes its zero tokens), so every device reports the step's loss.
//! 4. The nodes are reordered into the schedule's slots ([`Slot`]: micro-batch, chunk,
//!    F/B/W), so the Program *is* the schedule: the memory simulation counts exactly the
//!    micro-batches in flight, and the runtime executes the order as it is.

use super::schedule::{self, Schedule, Timeline};
use super::split::{self, Boundary, StageMap};
use super::{Pass, ScheduleKind, Slot};
use crate::cost::CostModel;
use crate::lower::{
    finish, replay_tagged, DistHooks, LocalForward, LowerOptions, Lowered, ReplayTag, Unfinished,
};
use crate::rules::Strategy;
use crate::{Mesh, PlanError, Result};
use std::collections::HashMap;
use tessera_ir::{
    build_training_graph_with, Builder, Checkpointing, Collective, CommStep, Graph, NodeId, Op,
    Phase, ReshardSpec, TensorId, TrainingGraph,
};

/// How a plan is pipelined.
#[derive(Clone, Debug)]
pub struct PipelineOptions {
    pub map: StageMap,
    pub schedule: ScheduleKind,
}

/// One pipeline device's training graph, before checkpointing, with each node's slot.
#[derive(Clone, Debug)]
pub struct DeviceUnfinished {
    pub unfinished: Unfinished,
    /// The slot of each node (`None`: leaves, and the step's tail after the last slot).
    pub slot_of: Vec<Option<Slot>>,
    pub boundaries: Vec<Boundary>,
}

/// A pipelined plan before checkpointing.
#[derive(Clone, Debug)]
pub struct PipeUnfinished {
    pub devices: Vec<DeviceUnfinished>,
    pub schedule: Schedule,
    pub options: PipelineOptions,
}

/// The full mesh: the stage's mesh with the pipeline axis appended (last, so the stage's axes
/// keep their indices; a device's stage is its last coordinate).
pub fn full_mesh(stage_mesh: &Mesh, devices: usize, link: crate::AxisLink) -> Mesh {
    let mut shape = stage_mesh.shape.clone();
    let mut links = stage_mesh.links.clone();
    shape.push(devices);
    links.push(link);
    Mesh::with_axis_links(&shape, links)
}

/// Steps 1–4 (see the module docs).
pub fn lower_unfinished(
    forward: &Graph,
    loss: TensorId,
    strategy: &[Option<Strategy>],
    stage_mesh: &Mesh,
    full: &Mesh,
    opts: &LowerOptions,
    pipe: &PipelineOptions,
) -> Result<PipeUnfinished> {
    let cut = Cutting::new(forward, loss, strategy, stage_mesh, full, opts, pipe)?;
    let forwards = cut.forwards()?;
    let devices = cut.lower_devices(forwards.into_iter().enumerate().collect())?;
    Ok(PipeUnfinished { devices, schedule: cut.schedule, options: pipe.clone() })
}

/// [`lower_unfinished`] and [`finish_pipeline`] under `budget`: the devices likeliest to peak
/// highest ([`probes`]) are lowered and finished first, and when one of them misses the
/// budget the rest are not lowered: the answer is that device's exact peak (each device's
/// Program is lowered on its own, so the probe's is the one the whole lowering would give;
/// the plan's worst stage peaks at least as high). A miss the probes do not catch is found
/// by the whole lowering, as without them, whose devices include the probes' (not lowered
/// twice).
///
/// The exact check of a screened pipeline when no re-cut will read the devices' figures (a
/// config string's pipeline with its unwritten knobs searched, `planner::pinned`): a
/// DeepSeek-V3 `pp32` candidate on 256 GPUs whose estimate fitted and whose worst stage did
/// not lowered 32 devices of 128 micro-batches (six seconds) to learn it.
#[allow(clippy::too_many_arguments)]
pub fn lower_within(
    forward: &Graph,
    loss: TensorId,
    strategy: &[Option<Strategy>],
    stage_mesh: &Mesh,
    full: &Mesh,
    opts: &LowerOptions,
    pipe: &PipelineOptions,
    ckpt: &Checkpointing,
    cost: &CostModel,
    budget: u64,
) -> Result<std::result::Result<PipeLowered, u64>> {
    let cut = Cutting::new(forward, loss, strategy, stage_mesh, full, opts, pipe)?;
    let forwards = cut.forwards()?;
    let probes = probes(&cut.lw.b.graph, &forwards);
    let (first, rest): (Vec<_>, Vec<_>) =
        forwards.into_iter().enumerate().partition(|(d, _)| probes.contains(d));
    let order: Vec<usize> = first.iter().chain(&rest).map(|(d, _)| *d).collect();
    let probed = cut.lower_devices(first)?;
    let mut finished = finish_devices(&probed, ckpt, full, cost)?;
    let worst = finished.iter().map(|(d, _)| d.lowered.memory.peak_bytes).max().unwrap_or(0);
    if worst > budget {
        return Ok(Err(worst));
    }
    let others = cut.lower_devices(rest)?;
    finished.extend(finish_devices(&others, ckpt, full, cost)?);
    // Back in device order.
    let mut by_device: Vec<_> =
        order.into_iter().zip(probed.into_iter().chain(others).zip(finished)).collect();
    by_device.sort_by_key(|(d, _)| *d);
    let (devices, finished): (Vec<_>, Vec<_>) = by_device.into_iter().map(|(_, x)| x).unzip();
    let u = PipeUnfinished { devices, schedule: cut.schedule, options: pipe.clone() };
    Ok(Ok(assemble(&u, finished, full)?))
}

/// The devices [`lower_within`] lowers first: the one holding the most parameter bytes (its
/// state is the most; on a tie the earliest, which holds the most micro-batches in flight),
/// and the first device (the most in flight under every schedule here) — two, one per thread
/// of a 2-core pool.
fn probes(g: &Graph, forwards: &[split::DeviceForward]) -> Vec<usize> {
    let bytes = |f: &split::DeviceForward| -> u64 {
        f.params.keys().map(|&p| g.meta(p).size_bytes()).sum()
    };
    let heaviest = (0..forwards.len())
        .max_by_key(|&d| (bytes(&forwards[d]), std::cmp::Reverse(d)))
        .unwrap_or(0);
    let mut out = vec![heaviest];
    if heaviest != 0 {
        out.push(0);
    }
    out
}

/// Step 1 and what each device's steps 2–4 share.
struct Cutting<'a> {
    lw: LocalForward<'a>,
    local_loss: TensorId,
    leaf_specs: Vec<(String, crate::spec::Spec)>,
    schedule: Schedule,
    full: &'a Mesh,
    opts: &'a LowerOptions,
    pipe: &'a PipelineOptions,
}

impl<'a> Cutting<'a> {
    fn new(
        forward: &'a Graph,
        loss: TensorId,
        strategy: &'a [Option<Strategy>],
        stage_mesh: &'a Mesh,
        full: &'a Mesh,
        opts: &'a LowerOptions,
        pipe: &'a PipelineOptions,
    ) -> Result<Cutting<'a>> {
        let mb = opts.micro_batches.max(1);
        let schedule = schedule::build(pipe.schedule, pipe.map.devices, mb)
            .map_err(|e| PlanError::Invalid(format!("pipeline schedule {}: {e}", pipe.schedule)))?;
        let mut lw = LocalForward::new(forward, strategy, stage_mesh, opts)?;
        let local_loss = lw.build(loss)?;
        let leaf_specs = lw.leaf_specs.clone();
        Ok(Cutting { lw, local_loss, leaf_specs, schedule, full, opts, pipe })
    }

    /// The per-device forward graphs.
    fn forwards(&self) -> Result<Vec<split::DeviceForward>> {
        split::cut(&self.lw.b.graph, self.local_loss, &self.pipe.map)
    }

    /// Steps 2–4 of each `(device, forward)`, in parallel: the devices are independent.
    fn lower_devices(
        &self,
        forwards: Vec<(usize, split::DeviceForward)>,
    ) -> Result<Vec<DeviceUnfinished>> {
        crate::par::map_owned(forwards, |_, (d, fwd)| self.lower_device(d, fwd))
            .into_iter()
            .collect()
    }

    fn lower_device(&self, d: usize, fwd: split::DeviceForward) -> Result<DeviceUnfinished> {
        let (opts, pipe, full) = (self.opts, self.pipe, self.full);
        let mb = opts.micro_batches.max(1);
        let params = fwd
            .params
            .iter()
            .filter_map(|(old, new)| self.lw.local_params.get(old).map(|i| (*new, i.clone())))
            .collect();
        let mut hooks = DistHooks {
            mesh: full,
            pipeline_axis: Some(pipe.map.axis),
            zero: opts.zero,
            params,
            synced: Default::default(),
            offload: None,
        };
        let tg = build_training_graph_with(fwd.builder, fwd.loss, &opts.train, &mut hooks)
            .map_err(|e| internal(format!("differentiating pipeline device {d}: {e}")))?;
        let chunk_fwd = fwd.chunk_of;
        let chunks = chunks_of(&tg.graph, &chunk_fwd, &pipe.map, d);
        let (tg, tags) = replay_tagged(&tg, mb)?;
        let tg = loss_over_pipeline(tg, full, pipe.map.axis)?;
        let slot_of = slots_of(&tg.graph, &tags, &chunks, pipe.schedule);
        let (training, slot_of) = reorder(&tg, &slot_of, &self.schedule.slots[d])?;
        Ok(DeviceUnfinished {
            unfinished: Unfinished {
                training,
                leaf_specs: self.leaf_specs.clone(),
                micro_batches: mb,
                priced: None,
                // Offload with a pipeline is refused (`ParallelConfig::validate`).
                act_offload: false,
            },
            slot_of,
            boundaries: fwd.boundaries,
        })
    }
}

/// The chunk of every node of a device's training graph: forward nodes as cut; a block's
/// nodes its block's chunk; others the latest chunk among their inputs, or the earliest
/// among their readers.
fn chunks_of(g: &Graph, forward: &[usize], map: &StageMap, device: usize) -> Vec<usize> {
    let n = g.nodes.len();
    let mut chunk: Vec<Option<usize>> = vec![None; n];
    for (i, node) in g.nodes.iter().enumerate() {
        if i < forward.len() && node.phase == Phase::Forward {
            chunk[i] = Some(forward[i]);
            continue;
        }
        if let Some(b) = node.block {
            if let Some(&vs) = map.stage_of_block.get(b as usize) {
                if map.device_of(vs).0 == device {
                    chunk[i] = Some(map.device_of(vs).1);
                    continue;
                }
            }
        }
        chunk[i] = node
            .inputs
            .iter()
            .filter_map(|t| {
                let p = g.tensor(*t).producer.index();
                (!g.nodes[p].op.is_leaf()).then_some(chunk[p]).flatten()
            })
            .max();
    }
    let consumers = g.consumers();
    for i in (0..n).rev() {
        if chunk[i].is_some() {
            continue;
        }
        chunk[i] = g.nodes[i]
            .outputs
            .iter()
            .flat_map(|t| &consumers[t.index()])
            .filter_map(|c| chunk[c.index()])
            .min();
    }
    chunk.into_iter().map(|c| c.unwrap_or(0)).collect()
}

/// The slot of each node of a replayed graph.
fn slots_of(
    g: &Graph,
    tags: &[ReplayTag],
    chunks: &[usize],
    kind: ScheduleKind,
) -> Vec<Option<Slot>> {
    let n = g.nodes.len();
    let mut slot = vec![None; n];
    for (i, node) in g.nodes.iter().enumerate() {
        let tag = tags.get(i).copied().unwrap_or_default();
        let Some(k) = tag.micro_batch else { continue };
        if matches!(node.op, Op::Parameter { .. } | Op::Input(_) | Op::OptimizerState { .. }) {
            continue;
        }
        let chunk = tag.origin.map_or(0, |o| chunks.get(o.index()).copied().unwrap_or(0));
        let pass = if node.phase == Phase::Forward { Pass::F } else { Pass::B };
        slot[i] = Some(Slot { micro_batch: k, chunk, pass });
    }
    if kind.splits_backward() {
        split_weight_gradients(g, &mut slot);
    }
    slot
}

/// ZB-H1: a backward node that no gradient send of its slot depends on computes weight
/// gradients only (W); the rest (B) is the critical path to the previous stage.
fn split_weight_gradients(g: &Graph, slot: &mut [Option<Slot>]) {
    let mut to_send = vec![false; g.nodes.len()];
    for i in (0..g.nodes.len()).rev() {
        let node = &g.nodes[i];
        let Some(s) = slot[i] else { continue };
        if s.pass != Pass::B {
            continue;
        }
        if matches!(node.op, Op::Send(_)) {
            to_send[i] = true;
        }
        if to_send[i] {
            for t in &node.inputs {
                let p = g.tensor(*t).producer.index();
                if slot[p] == Some(s) {
                    to_send[p] = true;
                }
            }
        }
    }
    for (i, s) in slot.iter_mut().enumerate() {
        if let Some(s) = s.as_mut() {
            if s.pass == Pass::B && !to_send[i] {
                s.pass = Pass::W;
            }
        }
    }
}

/// Sums the loss over the pipeline axis: only the last stage holds it, the others add zeros.
fn loss_over_pipeline(tg: TrainingGraph, full: &Mesh, axis: usize) -> Result<TrainingGraph> {
    let size = full.shape[axis];
    let mut b = Builder::from_graph(tg.graph);
    b.set_phase(Phase::Optimizer);
    b.set_block(None);
    b.set_scope_id(tessera_ir::ScopeId(0));
    let step = CommStep { op: Collective::AllReduce, axis, size };
    let spec = ReshardSpec { forward: vec![step], backward: vec![] };
    let loss = b.push1(Op::Reshard(spec), &[tg.loss]).map_err(internal)?;
    Ok(TrainingGraph { graph: b.finish(), loss, ..tg })
}

/// Rebuilds `tg` with its nodes in schedule order: leaves, then each slot's nodes (in their
/// order), then the untagged tail (loss sum, optimizer). Fails if the order breaks a
/// dependency (a schedule that does not fit the graph).
fn reorder(
    tg: &TrainingGraph,
    slot_of: &[Option<Slot>],
    order: &[Slot],
) -> Result<(TrainingGraph, Vec<Option<Slot>>)> {
    let g = &tg.graph;
    let position: HashMap<Slot, usize> = order.iter().enumerate().map(|(i, s)| (*s, i)).collect();
    let mut groups: Vec<Vec<usize>> = vec![Vec::new(); order.len() + 2];
    for (i, node) in g.nodes.iter().enumerate() {
        let group = match slot_of[i] {
            _ if matches!(
                node.op,
                Op::Parameter { .. } | Op::Input(_) | Op::OptimizerState { .. }
            ) =>
            {
                0
            }
            Some(s) => {
                1 + *position.get(&s).ok_or_else(|| {
                    internal(format!("slot {s:?} of {} is not in the schedule", node.op.name()))
                })?
            }
            None => order.len() + 1,
        };
        groups[group].push(i);
    }
    let mut b = Builder::from_graph(Graph::with_capacity(g.nodes.len(), g.tensors.len()));
    for s in 1..g.num_scopes() {
        b.graph.intern_scope(g.scope_name(tessera_ir::ScopeId(s as u32)));
    }
    let mut map: Vec<Option<TensorId>> = vec![None; g.tensors.len()];
    let mut slots = Vec::with_capacity(g.nodes.len());
    for (gi, group) in groups.iter().enumerate() {
        for &i in group {
            let node = &g.nodes[i];
            let mut ins = Vec::with_capacity(node.inputs.len());
            for t in &node.inputs {
                ins.push(map[t.index()].ok_or_else(|| {
                    let slot = if gi == 0 || gi > order.len() { None } else { Some(order[gi - 1]) };
                    internal(format!(
                        "the schedule runs {} ({}, slot {slot:?}) before its input {} is made",
                        node.op.name(),
                        g.scope_name(node.scope),
                        g.tensor_scope(*t)
                    ))
                })?);
            }
            b.set_scope_id(node.scope);
            b.set_block(node.block);
            b.set_phase(node.phase);
            let outs = b.push(node.op.clone(), &ins).map_err(internal)?;
            for (o, n) in node.outputs.iter().zip(outs) {
                map[o.index()] = Some(n);
            }
            slots.push(slot_of[i]);
        }
    }
    let m = |t: TensorId| map[t.index()].ok_or_else(|| internal("a step tensor was lost"));
    let params = tg.params.iter().map(|s| s.try_map(m)).collect::<Result<Vec<_>>>()?;
    let out = TrainingGraph {
        graph: b.finish(),
        layout: tessera_ir::LeafLayout::default(),
        loss: m(tg.loss)?,
        grad_norm: m(tg.grad_norm)?,
        lr: m(tg.lr)?,
        step: m(tg.step)?,
        loss_scale: tg.loss_scale.map(m).transpose()?,
        params,
    };
    Ok((out, slots))
}

/// One pipeline device, lowered and predicted.
#[derive(Clone, Debug)]
pub struct DeviceLowered {
    pub lowered: Lowered,
    /// The slot of each node of `lowered.training` (recomputation joins the slot it feeds).
    pub slot_of: Vec<Option<Slot>>,
}

/// A pipelined plan, lowered: each device's Program and the schedule's timeline.
#[derive(Clone, Debug)]
pub struct PipeLowered {
    pub devices: Vec<DeviceLowered>,
    pub schedule: Schedule,
    pub timeline: Timeline,
    pub options: PipelineOptions,
    /// Seconds of one step: the schedule's makespan, then the slowest device's optimizer and
    /// the gradient synchronisation its compute does not hide.
    pub step_time_s: f64,
}

impl PipeLowered {
    /// The worst device's peak (a plan fits when its worst stage fits).
    pub fn peak_bytes(&self) -> u64 {
        self.devices.iter().map(|d| d.lowered.memory.peak_bytes).max().unwrap_or(0)
    }
}

/// Checkpoints each device's graph, lowers it to its Program and simulates the schedule.
pub fn finish_pipeline(
    u: &PipeUnfinished,
    ckpt: &Checkpointing,
    full: &Mesh,
    cost: &CostModel,
) -> Result<PipeLowered> {
    let finished = finish_devices(&u.devices, ckpt, full, cost)?;
    assemble(u, finished, full)
}

/// A device's Program and the seconds of each of its slots.
type Finished = (DeviceLowered, HashMap<Slot, f64>);

/// Each device on its own, in parallel: checkpointed, lowered, simulated and its slots timed.
fn finish_devices(
    devices: &[DeviceUnfinished],
    ckpt: &Checkpointing,
    full: &Mesh,
    cost: &CostModel,
) -> Result<Vec<Finished>> {
    crate::par::map(devices, |d| -> Result<Finished> {
        let lowered = finish(&d.unfinished, ckpt, full, cost)?;
        let slot_of = follow_recompute(lowered.program.graph(), &d.slot_of);
        let seconds = slot_seconds(&lowered, &slot_of, full, cost);
        Ok((DeviceLowered { lowered, slot_of }, seconds))
    })
    .into_iter()
    .collect()
}

/// The schedule simulated on the finished devices' slot times (`finished` in `u`'s device
/// order).
fn assemble(u: &PipeUnfinished, finished: Vec<Finished>, full: &Mesh) -> Result<PipeLowered> {
    let mut devices = Vec::with_capacity(finished.len());
    let mut durations: Vec<HashMap<Slot, f64>> = Vec::with_capacity(finished.len());
    for (device, seconds) in finished {
        devices.push(device);
        durations.push(seconds);
    }
    let map = &u.options.map;
    let link = full.links[map.axis].p2p(full.shape[map.axis]);
    let bytes: HashMap<(usize, usize), u64> =
        u.devices.iter().flat_map(|d| &d.boundaries).fold(HashMap::new(), |mut acc, b| {
            *acc.entry((b.from, b.to)).or_default() += b.bytes;
            acc
        });
    let p2p = |from: usize, to: usize| {
        let (a, b) = (from.min(to), from.max(to));
        let n = bytes.get(&(a, b)).copied().unwrap_or(0);
        if n == 0 {
            0.0
        } else {
            link.latency_s + n as f64 / link.bandwidth
        }
    };
    let duration = |d: usize, s: Slot| durations[d].get(&s).copied().unwrap_or(0.0);
    let timeline = u.schedule.simulate(&duration, &p2p).map_err(internal)?;
    let tail = devices
        .iter()
        .map(|d| d.lowered.time.optimizer_compute_s + d.lowered.time.exposed_comm_s)
        .fold(0.0, f64::max);
    let step_time_s = timeline.makespan_s + tail;
    Ok(PipeLowered {
        devices,
        schedule: u.schedule.clone(),
        timeline,
        options: u.options.clone(),
        step_time_s,
    })
}

/// Slots of a checkpointed graph: the rewrite keeps every node in order and inserts
/// recomputation right before the node that reads it, so a recomputed node joins the slot of
/// the next original node.
fn follow_recompute(g: &Graph, before: &[Option<Slot>]) -> Vec<Option<Slot>> {
    let mut out = vec![None; g.nodes.len()];
    let mut k = 0;
    let mut waiting = Vec::new();
    for (i, node) in g.nodes.iter().enumerate() {
        if node.phase == Phase::Recompute {
            waiting.push(i);
            continue;
        }
        let s = before.get(k).copied().flatten();
        k += 1;
        out[i] = s;
        for w in waiting.drain(..) {
            out[w] = s;
        }
    }
    out
}

/// Seconds of each slot on one device: its compute and the collectives on its critical path
/// (tensor and sequence parallel ones; parameter and gradient collectives overlap the compute).
fn slot_seconds(
    l: &Lowered,
    slot_of: &[Option<Slot>],
    full: &Mesh,
    cost: &CostModel,
) -> HashMap<Slot, f64> {
    let p = &l.program;
    let g = p.graph();
    let experts = cost.expert_share(g);
    let mut out: HashMap<Slot, f64> = HashMap::new();
    for instr in &p.instrs {
        let tessera_ir::Instr::Run(id) = *instr else { continue };
        let Some(s) = slot_of.get(id.index()).copied().flatten() else { continue };
        if g.node(id).phase == Phase::Optimizer {
            continue;
        }
        *out.entry(s).or_default() += node_seconds(p, id, full, cost, experts);
    }
    out
}

/// Seconds of one node of a device's Program on its critical path (see [`slot_seconds`]);
/// `experts`: the Program's [`CostModel::expert_share`].
pub(crate) fn node_seconds(
    p: &tessera_ir::Program,
    id: NodeId,
    full: &Mesh,
    cost: &CostModel,
    experts: Option<f64>,
) -> f64 {
    let g = p.graph();
    let n = g.node(id);
    match &n.op {
        Op::Send(_) | Op::Recv(..) => 0.0,
        Op::Reshard(spec) => {
            let input = g.meta(n.inputs[0]);
            let is_grad =
                |t: TensorId| p.role[p.buffer_of[t.index()].index()] == tessera_ir::Role::Gradient;
            let on_param = matches!(g.producer(n.inputs[0]).op, Op::Parameter { .. })
                || is_grad(n.inputs[0])
                || is_grad(n.outputs[0]);
            if on_param {
                return 0.0;
            }
            let mut shape = input.shape.clone();
            let mut secs = 0.0;
            for s in &spec.forward {
                let here = tessera_ir::TensorMeta::new(shape.clone(), input.dtype);
                secs += crate::cost::collective_time(
                    full.links[s.axis],
                    s.size,
                    s.op,
                    here.size_bytes(),
                );
                shape = s.apply(&shape).unwrap_or(shape);
            }
            secs
        }
        op => {
            let x: Vec<_> = n.inputs.iter().map(|&i| g.meta(i)).collect();
            let y: Vec<_> = n.outputs.iter().map(|&o| g.meta(o)).collect();
            cost.node_time(op, &x, &y, experts)
        }
    }
}

fn internal(e: impl std::fmt::Display) -> PlanError {
    PlanError::Internal(format!("lowering the pipeline: {e}"))
}
