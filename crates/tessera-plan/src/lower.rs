//! Lowering a plan to per-device Programs (tensor-free).
//!
//! 1. The *forward* graph is rewritten with local shapes: every node runs its chosen strategy,
//!    and where a consumer needs an input in another spec a [`Op::Reshard`] node moves it (the
//!    cheapest collective path). Each reshard also carries the path its *gradient* takes back:
//!    from the spec the consumer's backward produces (a pending sum on axes where the consumer
//!    splits work the input does not) to the producer's spec. Megatron's f/g pairs, sequence
//!    parallel's all-gather/reduce-scatter and ZeRO-3's gather/reduce-scatter all fall out of
//!    this one rule.
//! 2. The local forward graph is differentiated by the ordinary autodiff; the optimizer section
//!    is shaped by [`UpdateHooks`]: gradient synchronisation over data-parallel axes (all-reduce
//!    or, under ZeRO-2, reduce-scatter), optimizer state on shards (ZeRO-1/2/3), the global
//!    gradient norm as a pending sum over the mesh.
//! 3. A replay pass unrolls micro-batches (gradients accumulate, synchronised once), moves each
//!    gradient's synchronisation right after its last contribution (so ZeRO-2 frees full
//!    gradients early) and re-gathers all-gathered tensors in the backward pass instead of
//!    saving them (sequence parallel and ZeRO-3 keep only shards between passes).
//!
//! Every device runs the same Program (all splits are even), so the per-device Programs are
//! one Program and N peaks; the device's mesh coordinate selects its shards at run time.

pub mod act_offload;
mod hooks;
mod loss;
pub mod priced;
mod replay;
pub mod ring;
mod time;

pub(crate) use hooks::DistHooks;
pub(crate) use replay::{replay, replay_tagged, ReplayTag};
pub use time::simulate_time;
// The lowering's figures live with the rest of the search's data ([`crate::figures`]).
pub use crate::cost::StepTime;
pub use crate::figures::{CollectiveRecord, Lowered, StepHandles};

use crate::cost::CostModel;
use crate::reshard::{ReshardCache, ReshardPath};
use crate::rules::{local_meta, Strategy};
use crate::{Mesh, PlanError, Result, Spec};
use rustc_hash::{FxHashMap as HashMap, FxHashSet};
use std::collections::BTreeSet;
use tessera_ir::dist::{micro_batch_input, state_key, ShardOf};
use tessera_ir::{
    build_training_graph_with, rematerialize, Builder, Checkpointing, Collective, CommStep, Graph,
    LeafLayout, NodeId, Op, Phase, Program, ReshardSpec, TensorId, TensorMeta, TrainConfig,
    TrainingGraph,
};
use tessera_ir::{StateKind, Tier};
use tessera_profile::simulate_memory;

#[derive(Clone, Debug)]
pub struct LowerOptions {
    pub zero: u8,
    pub micro_batches: usize,
    pub train: TrainConfig,
    /// Activation checkpointing of the repeated blocks (applied after the micro-batch replay,
    /// so every micro-batch recomputes its own blocks).
    pub ckpt: Checkpointing,
    /// Chunks whose state rests below the device ([`crate::offload`]).
    pub offload: Option<crate::offload::Offload>,
}

/// A lowered training graph before checkpointing: what [`finish`] turns into Programs, once
/// per checkpoint choice, without re-running the sharding, autodiff and replay passes.
#[derive(Clone, Debug)]
pub struct Unfinished {
    pub training: TrainingGraph,
    pub leaf_specs: Vec<(String, Spec)>,
    /// Micro-batches `training` replays.
    pub micro_batches: usize,
    /// Figures priced for more micro-batches than `training` holds ([`crate::lower::priced`]).
    pub priced: Option<priced::Twin>,
    /// Activation offload ([`act_offload`]): applied after each checkpointing.
    pub act_offload: bool,
}

#[derive(Clone, Debug)]
pub(crate) struct ParamInfo {
    /// Spec the parameter is stored in (includes the ZeRO-3 split).
    stored: Spec,
    /// Axes over which its accumulated gradient is a pending sum (data-parallel axes).
    pending: Vec<usize>,
    /// ZeRO: axes the optimizer state (and under ZeRO-3 the parameter) is split over, and the
    /// dim split.
    zero_axes: Vec<usize>,
    zero_dim: usize,
}

fn axes_minus(a: &[usize], b: &Spec) -> Vec<usize> {
    a.iter().copied().filter(|&x| !b.uses_axis(x)).collect()
}

/// The ascending union of two lists of mesh axes.
fn union_axes(a: &[usize], b: &[usize]) -> smallvec::SmallVec<[usize; 4]> {
    let mut u: smallvec::SmallVec<[usize; 4]> = a.iter().chain(b).copied().collect();
    u.sort_unstable();
    u.dedup();
    u
}

fn with_partial(spec: &Spec, extra: &[usize]) -> Spec {
    Spec { dims: spec.dims.clone(), partial: union_axes(&spec.partial, extra).into_vec() }
}

fn without_partial(spec: &Spec) -> Spec {
    Spec { dims: spec.dims.clone(), partial: Vec::new() }
}

/// How many micro-batches a lowering replays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fidelity {
    /// Every micro-batch: the plan's own Program, the figures its runtime measures.
    Exact,
    /// Past [`priced::EXACT_UP_TO`] micro-batches, the Programs of [`priced::REPLICAS`] and one
    /// fewer, with the figures extrapolated and marked inexact ([`priced`]): what the search
    /// compares candidates by. The plan it picks is lowered exactly.
    Priced,
}

/// Lowers `forward` (loss `loss`) under `strategy` (one per node; `None` for leaves).
pub fn lower(
    forward: &Graph,
    loss: TensorId,
    strategy: &[Option<Strategy>],
    mesh: &Mesh,
    cost: &CostModel,
    opts: &LowerOptions,
    fidelity: Fidelity,
) -> Result<Lowered> {
    let u = lower_unfinished(forward, loss, strategy, mesh, opts, fidelity)?;
    finish(&u, &opts.ckpt, mesh, cost)
}

/// Steps 1–3 of the lowering: the replayed per-device training graph, not yet checkpointed.
pub fn lower_unfinished(
    forward: &Graph,
    loss: TensorId,
    strategy: &[Option<Strategy>],
    mesh: &Mesh,
    opts: &LowerOptions,
    fidelity: Fidelity,
) -> Result<Unfinished> {
    if fidelity == Fidelity::Priced && opts.micro_batches.max(1) > priced::EXACT_UP_TO {
        return priced::lower_unfinished(forward, loss, strategy, mesh, opts);
    }
    let (leaf_specs, training) = crate::trace::timed(crate::trace::Work::Lowering, || {
        let (tg, leaf_specs) = differentiate(forward, loss, strategy, mesh, opts)?;
        let training = replay(&tg, opts.micro_batches)?;
        Ok::<_, PlanError>((leaf_specs, training))
    })?;
    Ok(Unfinished {
        training,
        leaf_specs,
        micro_batches: opts.micro_batches.max(1),
        priced: None,
        act_offload: opts.offload.is_some_and(|o| o.act),
    })
}

/// Steps 1–2 of the lowering: the per-device training graph of one micro-batch, before the
/// micro-batch replay, with each leaf's stored spec.
pub(crate) fn differentiate(
    forward: &Graph,
    loss: TensorId,
    strategy: &[Option<Strategy>],
    mesh: &Mesh,
    opts: &LowerOptions,
) -> Result<(TrainingGraph, Vec<(String, Spec)>)> {
    let mut lw = LocalForward::new(forward, strategy, mesh, opts)?;
    let local_loss = lw.build(loss)?;
    let leaf_specs = lw.leaf_specs.clone();
    if let Some(o) = &opts.offload {
        crate::offload::check(o)?;
    }
    // Offloaded chunks are cut from the global graph, so every device (and the plan file)
    // agrees on them whatever the sharding.
    let offloaded = match &opts.offload {
        Some(o) => o
            .offloaded(forward)
            .into_iter()
            .filter_map(|(p, tier)| lw.home[p.index()].as_ref().map(|(t, _)| (*t, tier)))
            .collect(),
        None => HashMap::default(),
    };
    let mut hooks = DistHooks {
        mesh,
        pipeline_axis: None,
        zero: opts.zero,
        params: lw.local_params,
        synced: HashMap::default(),
        offload: opts.offload.map(|o| (o, offloaded)),
    };
    let tg = build_training_graph_with(lw.b, local_loss, &opts.train, &mut hooks)
        .map_err(|e| PlanError::Internal(format!("differentiating the sharded graph: {e}")))?;
    Ok((tg, leaf_specs))
}

/// Applies checkpoint decisions, lowers to the Program and predicts its memory and time.
pub fn finish(
    u: &Unfinished,
    ckpt: &Checkpointing,
    mesh: &Mesh,
    cost: &CostModel,
) -> Result<Lowered> {
    crate::trace::timed(crate::trace::Work::Finish, || finish_untimed(u, ckpt, mesh, cost))
}

fn finish_untimed(
    u: &Unfinished,
    ckpt: &Checkpointing,
    mesh: &Mesh,
    cost: &CostModel,
) -> Result<Lowered> {
    let mut tg = rematerialize(&u.training, ckpt)
        .map_err(|e| PlanError::Internal(format!("checkpointing the sharded graph: {e}")))?;
    if u.act_offload {
        tg = act_offload::apply(&tg, ckpt)?;
    }
    tg.layout = leaf_layout(&tg.graph, &u.leaf_specs, u.micro_batches);
    if tg.layout.zigzag.is_some() {
        ring::check_streams(&tg.graph)?;
    }
    let grads: Vec<TensorId> = tg.params.iter().map(|s| s.grad).collect();
    let (graph, handles) = StepHandles::split(tg);
    let program = Program::lower_graph(graph, vec![handles.loss, handles.grad_norm], &grads);
    let memory = simulate_memory(&program).report;
    let (time, collectives) = simulate_time(&program, mesh, cost);
    let lowered = Lowered {
        program,
        handles,
        memory,
        time,
        collectives,
        leaf_specs: u.leaf_specs.clone(),
        ckpt: ckpt.clone(),
        exact: true,
    };
    match &u.priced {
        Some(twin) => twin.extend(lowered, u.micro_batches, mesh, cost),
        None => Ok(lowered),
    }
}

/// The leaf layout the runtime reads: each named leaf's placement (by tensor) and each
/// micro-batch's data inputs. The one place where a leaf's name is looked up for the runtime.
pub(crate) fn leaf_layout(
    g: &Graph,
    leaf_specs: &[(String, Spec)],
    micro_batches: usize,
) -> LeafLayout {
    // Ring attention's zig-zag chunks reorder the sequence of the data inputs.
    let zigzag = g.nodes.iter().find_map(|n| match &n.op {
        Op::Attention(a) => a.ring.filter(|r| r.zigzag).map(|r| r.size),
        _ => None,
    });
    let mut layout = LeafLayout { zigzag, ..LeafLayout::default() };
    let mut data = Vec::new();
    let leaves = g.leaf_index();
    for (name, spec) in leaf_specs {
        // fp32 parameters have no master: its spec names no leaf.
        let Some(&t) = leaves.get(name.as_str()) else { continue };
        if spec.dims.iter().any(|axes| !axes.is_empty()) {
            layout.placements.insert(t, spec.dims.clone());
        }
        if matches!(g.producer(t).op, Op::Input(_)) {
            data.push(name.as_str());
        }
    }
    for k in 0..micro_batches.max(1) {
        let mut group = std::collections::BTreeMap::new();
        for &base in &data {
            let Some(&t) = leaves.get(micro_batch_input(base, k).as_str()) else { continue };
            if k > 0 {
                // Micro-batch k's copy of an input is laid out as the first one.
                let first = leaves.get(base).copied().unwrap_or(t);
                if let Some(p) = layout.placements.get(&first).cloned() {
                    layout.placements.insert(t, p);
                }
            }
            group.insert(base.to_string(), t);
        }
        layout.micro_batches.push(group);
    }
    layout
}

/// Builds the local forward graph.
pub(crate) struct LocalForward<'a> {
    g: &'a Graph,
    strategy: &'a [Option<Strategy>],
    mesh: &'a Mesh,
    micro_batches: usize,
    zero: u8,
    pub(crate) b: Builder,
    /// Each global tensor's local tensor, in its producer's spec.
    home: Vec<Option<(TensorId, Spec)>>,
    /// Reshards already emitted: (tensor, spec, gradient pending axes) → local tensor.
    moved: HashMap<(TensorId, Spec, Vec<usize>), TensorId>,
    /// Collective paths found so far: a model's blocks repeat the same moves, and each
    /// Dijkstra over specs was a tenth of a DeepSeek-V3 lowering.
    paths: ReshardCache,
    params: HashMap<TensorId, ParamInfo>,
    /// Local parameter → its info (for the optimizer hooks).
    pub(crate) local_params: HashMap<TensorId, ParamInfo>,
    pub(crate) leaf_specs: Vec<(String, Spec)>,
    /// `offload=all`: the (global) parameters that rest on the host, fetched to the device
    /// before each use.
    on_host: FxHashSet<TensorId>,
    /// Host parameters fetched ahead of their reader: at node → (parameter, reader) pairs,
    /// and the device copies made so far, by (parameter, reader).
    prefetch_at: HashMap<NodeId, Vec<(TensorId, NodeId)>>,
    prefetched: HashMap<(TensorId, NodeId), TensorId>,
    /// The forward node being lowered (whose inputs [`LocalForward::fetch`] brings).
    current: NodeId,
    /// Ring attention's `position_ids` input (RoPE at the global positions), once made.
    ring_positions: Option<TensorId>,
}

impl<'a> LocalForward<'a> {
    pub(crate) fn new(
        g: &'a Graph,
        strategy: &'a [Option<Strategy>],
        mesh: &'a Mesh,
        opts: &LowerOptions,
    ) -> Result<LocalForward<'a>> {
        let mut lw = LocalForward {
            g,
            strategy,
            mesh,
            micro_batches: opts.micro_batches.max(1),
            zero: opts.zero,
            // Room for the whole training graph autodiff appends to this one (the backward
            // pass and the optimizer section, about twice the forward's nodes), so its node
            // list (256-byte nodes) is not copied as it grows; room never touched costs no
            // page faults.
            b: Builder::from_graph(Graph::with_capacity(4 * g.nodes.len(), 4 * g.tensors.len())),
            home: vec![None; g.tensors.len()],
            moved: HashMap::default(),
            paths: ReshardCache::new(mesh.clone()),
            params: HashMap::default(),
            local_params: HashMap::default(),
            leaf_specs: Vec::new(),
            on_host: match &opts.offload {
                Some(o) if o.kind == crate::offload::OffloadKind::All => {
                    o.offloaded(g).into_iter().map(|(p, _)| p).collect()
                }
                _ => Default::default(),
            },
            prefetch_at: HashMap::default(),
            prefetched: HashMap::default(),
            current: NodeId(0),
            ring_positions: None,
        };
        lw.plan_params(opts.zero)?;
        lw.plan_prefetch();
        Ok(lw)
    }

    /// Where each host parameter's copy for a reader is fetched: when the block before the
    /// reader's begins (one block of compute to hide the copy behind), or at the reader when
    /// nothing precedes it in another block.
    fn plan_prefetch(&mut self) {
        if self.on_host.is_empty() {
            return;
        }
        let g = self.g;
        let mut first_of: HashMap<u32, usize> = HashMap::default();
        for (i, n) in g.nodes.iter().enumerate() {
            if let Some(b) = n.block {
                first_of.entry(b).or_insert(i);
            }
        }
        let consumers = g.consumers();
        // In the graph's parameter order, not the set's: fetches due at one node are emitted
        // in this order, and the Program (its host peak among them) must be the same at every
        // lowering of the plan — the search's and the runtime's.
        for p in g.parameters().into_iter().filter(|p| self.on_host.contains(p)) {
            for &c in &consumers[p.index()] {
                let here = g.node(c).block;
                let before = (0..c.index())
                    .rev()
                    .find_map(|j| g.nodes[j].block.filter(|&b| Some(b) != here));
                let at = before.and_then(|b| first_of.get(&b).copied()).unwrap_or(c.index());
                self.prefetch_at.entry(NodeId(at as u32)).or_default().push((p, c));
            }
        }
    }

    fn strat(&self, n: NodeId) -> Result<&'a Strategy> {
        self.strategy.get(n.index()).and_then(|s| s.as_ref()).ok_or_else(|| {
            PlanError::Internal(format!(
                "node {} ({}) has no strategy",
                n.index(),
                self.g.node(n).op.name()
            ))
        })
    }

    /// The spec each leaf is needed in by its first reader.
    fn first_use(&self, t: TensorId, consumers: &[Vec<NodeId>]) -> Result<Spec> {
        match consumers[t.index()].first() {
            Some(&c) => {
                let node = self.g.node(c);
                let i = node.inputs.iter().position(|&x| x == t).unwrap_or(0);
                Ok(self.strat(c)?.inputs[i].clone())
            }
            None => Ok(Spec::replicated(self.g.meta(t).shape.rank())),
        }
    }

    /// Stored spec, pending gradient axes and ZeRO split of every parameter.
    fn plan_params(&mut self, zero: u8) -> Result<()> {
        let consumers = self.g.consumers();
        let live = |a: &usize| self.mesh.shape[*a] > 1;
        for p in self.g.parameters() {
            let stored = self.first_use(p, &consumers)?;
            let mut pending: Option<BTreeSet<usize>> = None;
            for &c in &consumers[p.index()] {
                let st = self.strat(c)?;
                for (i, &x) in self.g.node(c).inputs.iter().enumerate() {
                    if x != p {
                        continue;
                    }
                    let d: BTreeSet<usize> = axes_minus(&st.compute_axes, &st.inputs[i])
                        .into_iter()
                        .filter(|a| !stored.uses_axis(*a))
                        .filter(live)
                        .collect();
                    pending = Some(match pending {
                        Some(acc) => acc.intersection(&d).copied().collect(),
                        None => d,
                    });
                }
            }
            let pending: Vec<usize> = pending.unwrap_or_default().into_iter().collect();
            // Hybrid sharding: ZeRO shards over the pending axes that are not replica axes;
            // over those the gradient is all-reduced and every group keeps its whole copy.
            let shardable: Vec<usize> =
                pending.iter().copied().filter(|a| !self.mesh.replicas.contains(a)).collect();
            let meta = self.g.meta(p);
            let local = stored.local_shape(self.mesh, meta.shape.dims()).ok_or_else(|| {
                PlanError::Internal(format!(
                    "parameter {} cannot be stored as {stored}",
                    self.g.tensor_scope(p)
                ))
            })?;
            let n: usize = shardable.iter().map(|&a| self.mesh.shape[a]).product();
            let zero_dim = (0..local.len()).find(|&d| local[d] % n == 0 && local[d] >= n);
            let (zero_axes, zero_dim) = match (zero, zero_dim) {
                (1..=3, Some(d)) if n > 1 => (shardable, d),
                _ => (Vec::new(), 0),
            };
            let (stored, pending) = if zero == 3 && !zero_axes.is_empty() {
                let mut s = stored.clone();
                s.dims[zero_dim].extend(zero_axes.iter().copied());
                // The gradient arrives reduce-scattered over the ZeRO axes (the gather's
                // transpose); what is left pends over the replica axes.
                let rest = pending.iter().copied().filter(|a| !zero_axes.contains(a)).collect();
                (s, rest)
            } else {
                (stored, pending)
            };
            self.params.insert(p, ParamInfo { stored, pending, zero_axes, zero_dim });
        }
        Ok(())
    }

    fn local(&self, t: TensorId, spec: &Spec) -> Result<TensorMeta> {
        local_meta(self.g.meta(t), spec, self.mesh).ok_or_else(|| {
            PlanError::Internal(format!(
                "{} ({}) does not split as {spec}",
                self.g.tensor_scope(t),
                self.g.meta(t)
            ))
        })
    }

    pub(crate) fn build(&mut self, loss: TensorId) -> Result<TensorId> {
        self.lower_nodes()?;
        // The loss every device reports: sum the pending shares.
        let (l, spec) = self.home[loss.index()]
            .clone()
            .ok_or_else(|| PlanError::Internal("loss not lowered".into()))?;
        if spec.partial.is_empty() {
            return Ok(l);
        }
        let steps: Vec<CommStep> = spec
            .partial
            .iter()
            .map(|&a| CommStep { op: Collective::AllReduce, axis: a, size: self.mesh.shape[a] })
            .collect();
        self.b.set_scope_path("loss");
        self.b
            .push1(Op::Reshard(ReshardSpec { forward: steps, backward: vec![] }), &[l])
            .map_err(internal)
    }

    /// The local value of `t` whole on every device (an output every device reads, such as
    /// generation's logits): its pending sums reduced and its splits gathered.
    pub(crate) fn replicated(&mut self, t: TensorId) -> Result<TensorId> {
        let (src, have) = self.home[t.index()].clone().ok_or_else(|| {
            PlanError::Internal(format!("{} not lowered", self.g.tensor_scope(t)))
        })?;
        let meta = self.g.meta(t).clone();
        let want = Spec::replicated(meta.shape.rank());
        if have == want {
            return Ok(src);
        }
        let dims = meta.shape.dims();
        let path = self.path(dims, meta.dtype.size_bytes(), &have, &want).ok_or_else(|| {
            PlanError::Internal(format!(
                "no collective path from {have} to whole for {}",
                self.g.tensor_scope(t)
            ))
        })?;
        let spec = ReshardSpec { forward: path.steps, backward: vec![] };
        self.b.push1(Op::Reshard(spec), &[src]).map_err(internal)
    }

    /// Lowers every node of the forward graph to its local form.
    pub(crate) fn lower_nodes(&mut self) -> Result<()> {
        let consumers = self.g.consumers();
        for (i, node) in self.g.nodes.iter().enumerate() {
            let id = NodeId(i as u32);
            self.b.set_block(node.block);
            self.b.set_phase(Phase::Forward);
            let name = self.g.scope_name(node.scope).to_string();
            self.current = id;
            self.prefetch(id)?;
            match &node.op {
                // (A prefetched host parameter was made earlier.)
                Op::Parameter { .. } if self.home[node.outputs[0].index()].is_some() => {}
                Op::Parameter { .. } => self.make_param(node.outputs[0])?,
                Op::Input(_) => {
                    let t = node.outputs[0];
                    let spec = self.first_use(t, &consumers)?;
                    let m = self.local(t, &spec)?;
                    let lt = self.b.input(&name, m.shape.clone(), m.dtype);
                    self.leaf_specs.push((name, spec.clone()));
                    self.home[t.index()] = Some((lt, spec));
                }
                // A KV cache is stored as its writer splits it (by heads under tp).
                Op::KvCache(_) => {
                    let t = node.outputs[0];
                    let spec = self.first_use(t, &consumers)?;
                    let m = self.local(t, &spec)?;
                    let lt = self.b.kv_cache(&name, m.shape.clone(), m.dtype);
                    self.leaf_specs.push((name, spec.clone()));
                    self.home[t.index()] = Some((lt, spec));
                }
                // Made where they are read, in the spec the reader needs.
                Op::Fill { .. } => {}
                Op::OptimizerState { .. } => {
                    return Err(PlanError::Internal("optimizer state in a forward graph".into()))
                }
                op => {
                    let st = self.strat(id)?;
                    self.b.set_scope_path(&name);
                    let mut inputs = Vec::with_capacity(node.inputs.len());
                    for (k, &t) in node.inputs.iter().enumerate() {
                        inputs.push(self.fetch(t, &st.inputs[k], &st.compute_axes)?);
                    }
                    self.b.set_scope_path(&name);
                    let want: Vec<TensorMeta> = node
                        .outputs
                        .iter()
                        .zip(&st.outputs)
                        .map(|(&o, s)| self.local(o, s))
                        .collect::<Result<_>>()?;
                    let mut local_op =
                        localize(op, &want, self.g.meta(node.outputs[0]), &st.outputs[0]);
                    if let Op::Embedding { rows } = &mut local_op {
                        // A table split by rows (vocabulary-parallel): record where each
                        // device's rows sit, so ids outside them read zeros.
                        if !st.inputs[0].dims[0].is_empty() {
                            *rows = Some(ShardOf {
                                global: self.g.meta(node.inputs[0]).shape.dims().to_vec(),
                                placement: st.inputs[0].dims.clone(),
                                micro_batch: 0,
                            });
                        }
                    }
                    if let Op::Attention(a) = &mut local_op {
                        // Query heads split past the KV heads (k and v whole): each device's
                        // heads read the KV heads of their global index.
                        let (q, k) = (&st.inputs[0], &st.inputs[1]);
                        if !q.dims[2].is_empty() && k.dims[2].is_empty() {
                            a.kv_whole = Some(ShardOf {
                                global: self.g.meta(node.inputs[0]).shape.dims().to_vec(),
                                placement: q.dims.clone(),
                                micro_batch: 0,
                            });
                        }
                    }
                    // An int8 row has one scale whatever share of it a device holds.
                    if let Op::QMatMul(q) = &mut local_op {
                        if q.bits == 8 {
                            q.group = self.b.shape(inputs[0]).last();
                        }
                    }
                    if let Op::QMatMulBackward(q) = &mut local_op {
                        if q.bits == 8 {
                            q.group = self.b.shape(inputs[1]).dim(1);
                        }
                    }
                    self.vocab_parallel_loss(node, st, &mut local_op, &mut inputs)?;
                    let ring = self.ring_split(node, st);
                    let outs = match (&local_op, ring) {
                        (Op::Attention(a), Some(axis)) => {
                            ring::check_lse_unread(self.g, id, &consumers)?;
                            let size = self.mesh.shape[axis];
                            ring::attention(
                                &mut self.b,
                                a,
                                &inputs,
                                axis,
                                size,
                                ring::RingTags::new(size)?,
                            )?
                        }
                        _ => {
                            if let (Op::Rope { .. }, Some(_), 1) = (&local_op, ring, inputs.len()) {
                                inputs.push(self.ring_positions(&st.inputs[0], &name)?);
                            }
                            self.b
                                .push(local_op, &inputs)
                                .map_err(|e| {
                                    PlanError::Internal(format!(
                                        "{name}: sharded {} does not type-check: {e}",
                                        op.name()
                                    ))
                                })?
                                .to_vec()
                        }
                    };
                    for (k, &o) in outs.iter().enumerate() {
                        if self.b.meta(o) != &want[k] {
                            return Err(PlanError::Internal(format!(
                                "{name}: {} output {k} is {} locally, the strategy says {}",
                                op.name(),
                                self.b.meta(o),
                                want[k]
                            )));
                        }
                    }
                    let mut outs = outs;
                    // A loss's mean over local rows: scaled to this device's share of the
                    // global mean, a pending sum.
                    let share = self.loss_share(op, st);
                    if share > 1 {
                        let s =
                            self.b.scalar_like(1.0 / share as f64, outs[0]).map_err(internal)?;
                        outs[0] = self.b.mul(outs[0], s).map_err(internal)?;
                    }
                    for (k, &o) in node.outputs.iter().enumerate() {
                        self.home[o.index()] = Some((outs[k], st.outputs[k].clone()));
                    }
                }
            }
        }
        Ok(())
    }

    /// The cp axis an attention or RoPE splits its sequence over under ring attention
    /// ([`crate::context::ring_strategies`]); `None` for every other node.
    fn ring_split(&self, node: &tessera_ir::Node, st: &Strategy) -> Option<usize> {
        if !self.mesh.ring || !matches!(node.op, Op::Attention(_) | Op::Rope { .. }) {
            return None;
        }
        let axis = self.mesh.axis(crate::mesh::AxisName::Context)?;
        let seq = st.inputs.first()?.dims.get(1)?;
        seq.contains(&axis).then_some(axis)
    }

    /// Ring attention's `position_ids` (`[B, S]` of int64, laid out as RoPE's input `x` lays
    /// out its batch and sequence): the trainer fills it with each token's global position
    /// (`0..S`, in zig-zag order like the tokens), so RoPE rotates each device's chunks by
    /// where they sit in the sequence. One input for every RoPE of the graph.
    fn ring_positions(&mut self, x: &Spec, scope: &str) -> Result<TensorId> {
        if let Some(t) = self.ring_positions {
            return Ok(t);
        }
        let spec = Spec { dims: x.dims[..2].to_vec(), partial: vec![] };
        let global = self.g.meta(self.g.node(self.current).inputs[0]).shape.dims()[..2].to_vec();
        let local = spec.local_shape(self.mesh, &global).ok_or_else(|| {
            PlanError::Internal(format!("positions {global:?} do not split as {spec}"))
        })?;
        let name = "position_ids";
        self.b.set_scope_path("");
        let t = self.b.input(name, local, tessera_ir::DType::I64);
        self.b.set_scope_path(scope);
        self.leaf_specs.push((name.to_string(), spec));
        self.ring_positions = Some(t);
        Ok(t)
    }

    /// The local leaf of parameter `p` (in the host tier when it rests there), its stored spec
    /// and its optimizer state's.
    fn make_param(&mut self, p: TensorId) -> Result<()> {
        let node = self.g.producer(p);
        let name = self.g.scope_name(node.scope).to_string();
        let info = &self.params[&p];
        let spec = info.stored.clone();
        let m = self.local(p, &spec)?;
        let block = self.b.block();
        self.b.set_block(node.block);
        if self.on_host.contains(&p) {
            self.b.set_leaf_tier(Tier::Host);
        }
        let lp = if self.g.is_frozen(p) {
            self.b.frozen_parameter(&name, m.shape.clone(), m.dtype)
        } else {
            self.b.parameter(&name, m.shape.clone(), m.dtype)
        };
        self.b.set_leaf_tier(Tier::Device);
        self.b.set_block(block);
        // Optimizer state lives on the ZeRO-1/2 shard of the stored parameter.
        let mut state = spec.clone();
        if matches!(self.zero, 1 | 2) && !info.zero_axes.is_empty() {
            state.dims[info.zero_dim].extend(info.zero_axes.iter().copied());
        }
        if !self.g.is_frozen(p) {
            for kind in StateKind::ALL {
                self.leaf_specs.push((state_key(&name, kind), state.clone()));
            }
        }
        self.leaf_specs.push((name, spec.clone()));
        self.local_params.insert(lp, self.params[&p].clone());
        self.home[p.index()] = Some((lp, spec));
        Ok(())
    }

    fn copy_to_device(&mut self, src: TensorId) -> Result<TensorId> {
        self.b.push1(Op::Transfer { from: Tier::Host, to: Tier::Device }, &[src]).map_err(internal)
    }

    /// Starts the host parameter copies due at node `at` (see [`LocalForward::plan_prefetch`]).
    fn prefetch(&mut self, at: NodeId) -> Result<()> {
        let Some(due) = self.prefetch_at.remove(&at) else { return Ok(()) };
        for (p, reader) in due {
            if self.home[p.index()].is_none() {
                self.make_param(p)?;
            }
            let Some((src, _)) = self.home[p.index()].clone() else { continue };
            // The copy is the reader's block's (its checkpointing and accounting), issued
            // during the block before.
            let block = self.b.block();
            self.b.set_block(self.g.node(reader).block);
            let copy = self.copy_to_device(src);
            self.b.set_block(block);
            self.prefetched.insert((p, reader), copy?);
        }
        Ok(())
    }

    /// The cheapest path on this lowering's mesh ([`ReshardCache::path`]), remembered.
    fn path(&mut self, dims: &[usize], elem: u64, from: &Spec, to: &Spec) -> Option<ReshardPath> {
        self.paths.path(dims, elem, from, to).cloned()
    }

    /// `t` in spec `want` for a reader that splits its work over `compute`.
    fn fetch(&mut self, t: TensorId, want: &Spec, compute: &[usize]) -> Result<TensorId> {
        let producer = self.g.producer(t);
        if let Op::Fill { value, .. } = producer.op {
            let m = self.local(t, want)?;
            return self.b.fill(value, m.shape.clone(), m.dtype).map_err(internal);
        }
        let Some((mut src, _)) = self.home[t.index()] else {
            return Err(PlanError::Internal(format!(
                "{} used before it is made",
                self.g.tensor_scope(t)
            )));
        };
        if self.on_host.contains(&t) {
            // A host-resident parameter comes to the device for each reader, prefetched (the
            // replay fetches it again for the backward pass); its gradient goes back by the
            // copy's VJP.
            src = match self.prefetched.remove(&(t, self.current)) {
                Some(copy) => copy,
                None => self.copy_to_device(src)?,
            };
        }
        let g = self.g;
        let meta = g.meta(t);
        let differentiable = meta.dtype.is_float();
        let live: smallvec::SmallVec<[usize; 4]> =
            compute.iter().copied().filter(|&a| self.mesh.shape[a] > 1).collect();
        let pending = if differentiable { axes_minus(&live, want) } else { Vec::new() };
        let have = match &self.home[t.index()] {
            Some((_, have)) => have,
            None => return Err(PlanError::Internal("a tensor's home was lost".into())),
        };
        // Most reads need no collective: the same spec, and a gradient that arrives as its
        // producer (or the parameter's store) wants it. Checked without building either
        // gradient spec (a lowering asks this for every input of every node).
        if have == want {
            let grad_at = union_axes(&want.partial, &pending);
            let same_grad = match self.params.get(&t) {
                Some(info) => {
                    want.dims == info.stored.dims
                        && grad_at == union_axes(&info.stored.partial, &info.pending)
                }
                None => grad_at.is_empty(),
            };
            if same_grad {
                return Ok(src);
            }
        }
        let have = have.clone();
        let grad_at = with_partial(want, &pending);
        let grad_to = match self.params.get(&t) {
            Some(info) => with_partial(&info.stored, &info.pending),
            None => without_partial(&have),
        };
        let key = (t, want.clone(), pending.clone());
        if let Some(&m) = self.moved.get(&key) {
            return Ok(m);
        }
        let elem = meta.dtype.size_bytes();
        let dims = meta.shape.dims();
        let fwd = self.path(dims, elem, &have, want).ok_or_else(|| {
            PlanError::Internal(format!(
                "no collective path from {have} to {want} for {}",
                self.g.tensor_scope(t)
            ))
        })?;
        let bwd = if differentiable {
            self.path(dims, elem, &grad_at, &grad_to).ok_or_else(|| {
                PlanError::Internal(format!(
                    "no collective path for the gradient of {} from {grad_at} to {grad_to}",
                    self.g.tensor_scope(t)
                ))
            })?
        } else {
            ReshardPath { steps: vec![], cost_s: 0.0 }
        };
        let spec = ReshardSpec { forward: fwd.steps, backward: bwd.steps };
        let out = self.b.push1(Op::Reshard(spec), &[src]).map_err(internal)?;
        self.moved.insert(key, out);
        Ok(out)
    }
}

fn internal(e: impl std::fmt::Display) -> PlanError {
    PlanError::Internal(e.to_string())
}

/// The op with attributes that name global sizes rewritten to local ones.
/// The op a device runs for `op` with local outputs `out`; `global` and `spec` are the
/// first output's single-device meta and its spec (a dropout keys its mask by the global
/// element index, so it records where its shard sits; the replay sets the micro-batch).
fn localize(op: &Op, out: &[TensorMeta], global: &TensorMeta, spec: &Spec) -> Op {
    match op {
        Op::Reshape(_) => Op::Reshape(out[0].shape.clone()),
        Op::Expand(_) => Op::Expand(out[0].shape.clone()),
        Op::Dropout { p, stream, .. } => Op::Dropout {
            p: *p,
            stream: *stream,
            shard: Some(ShardOf {
                global: global.shape.dims().to_vec(),
                placement: spec.dims.clone(),
                micro_batch: 0,
            }),
        },
        // ALiBi's slopes follow the global head index: record where the local heads sit.
        Op::Attention(a) if a.alibi.is_some() => {
            let mut a = a.clone();
            if let Some(al) = a.alibi.as_mut() {
                al.shard = Some(ShardOf {
                    global: global.shape.dims().to_vec(),
                    placement: spec.dims.clone(),
                    micro_batch: 0,
                });
            }
            Op::Attention(a)
        }
        other => other.clone(),
    }
}
