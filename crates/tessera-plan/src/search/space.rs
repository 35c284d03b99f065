//! Building the strategy ILP of one candidate: the space of strategies per forward node on a
//! mesh under an axis rule ([`Space`]) and the problem over it ([`build_problem`]). The
//! search's policy — which candidates, budgets, slacks and checkpointing — is the parent
//! module's; nothing here decides.
//!
//! ILP shape (Alpa's, with the fixes DESIGN §4 asks for):
//! - one decision per forward node, except that nodes of repeated blocks share the decision of
//!   the same node in the first block (their costs add up), and single-input elementwise and
//!   layout followers (activation functions, casts, dropout, reshapes) ride on their producer's
//!   decision: given the producer's strategy the follower's best one is fixed;
//! - node cost: the op's forward and backward time on local shapes (backward ≈ 2× forward for
//!   matmuls and attention, 1× for the rest), times the micro-batch count, plus the gradient
//!   synchronisation (and ZeRO-3 gathers) of the parameters it reads first;
//! - edge cost: the resharding between producer and consumer, forward and the gradient's way
//!   back, from the reshard search;
//! - memory rows, liveness-aware: the peak of a step sits where the forward pass ends and the
//!   backward pass begins (model states + every saved activation) plus whatever one op holds
//!   at that moment; one row per decision adds that decision's transient outputs to the saved
//!   activations of all. The exact peak comes from simulating the lowered Program; if it
//!   misses the budget the ILP is solved again under a tighter one.

use super::sharing::metas;
use super::{AxisRule, Candidate, Forward, Search};
use crate::axis::{Axis, PinContext, AXES};
use crate::ilp::{Choice, Edge, MemRow, Problem};
use crate::reshard::ReshardCache;
use crate::rules::{label_roles, labeling, local_meta, strategies, DimRole, Labeling, Strategy};
use crate::{Mesh, PlanError, Result, Spec};
use std::collections::HashMap;
use tessera_ir::{DType, Graph, NodeId, Op, TensorId, TensorMeta};

/// Per-strategy node cost, saved, static and transient bytes (memoised per representative).
type NodeCosts = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// Everything about one forward graph on one mesh that does not depend on the ILP's picks
/// (nor on the ZeRO stage, the offload or the budget: built once per micro-batch size, mesh and
/// axis rule of a search, [`SpaceCache`]).
pub(super) struct Space {
    /// Nodes of the graph it was built on.
    nodes: usize,
    /// Decision index per node (None: leaf).
    var_of: Vec<Option<usize>>,
    /// Per decision: its head node and its number of strategies.
    heads: Vec<NodeId>,
    pub(super) options: Vec<usize>,
    /// Per representative node, per pick of its decision: the node's strategy (followers
    /// derive theirs); empty for nodes that copy a representative (see [`Space::chosen`]).
    chosen: Vec<Vec<Strategy>>,
    /// Node whose strategies it copies (block sharing), or itself.
    rep: Vec<usize>,
    /// Why the rule cannot split this graph on this mesh (then `options` holds one 0: no
    /// candidate); `None`: it can.
    pub(super) unsplittable: Option<String>,
}

/// Roles of every tensor dim: batch and sequence from the data inputs, carried by labels.
pub(super) fn dim_roles(g: &Graph, labels: &[Option<Labeling>]) -> Vec<Vec<DimRole>> {
    roles_with(g, labels, false)
}

/// [`dim_roles`], with the sequence carried through attention and RoPE (whose labelings have
/// no sequence label: they see whole sequences) from q to the output, so the ops after
/// attention keep their sequence role: what context parallelism splits ([`crate::context`]).
pub(super) fn context_roles(g: &Graph, labels: &[Option<Labeling>]) -> Vec<Vec<DimRole>> {
    roles_with(g, labels, true)
}

fn roles_with(
    g: &Graph,
    labels: &[Option<Labeling>],
    through_attention: bool,
) -> Vec<Vec<DimRole>> {
    let mut roles: Vec<Vec<DimRole>> =
        g.tensors.iter().map(|t| vec![DimRole::Other; t.meta.shape.rank()]).collect();
    for (i, n) in g.nodes.iter().enumerate() {
        if let Op::Input(m) = &n.op {
            let r = &mut roles[n.outputs[0].index()];
            if m.dtype.is_int() && m.shape.rank() == 2 {
                r[0] = DimRole::Batch;
                r[1] = DimRole::Seq;
            } else if m.shape.rank() >= 2 {
                r[0] = DimRole::Batch;
            }
            continue;
        }
        let Some(l) = &labels[i] else { continue };
        let lab_role = label_roles(n, l, &roles);
        for (k, &o) in n.outputs.iter().enumerate() {
            for (d, lab) in l.outputs[k].iter().enumerate() {
                if let Some(lab) = lab {
                    roles[o.index()][d] = lab_role[*lab];
                }
            }
        }
        if through_attention && matches!(n.op, Op::Attention(_) | Op::Rope { .. }) {
            // q [B,S,H,D] → out [B,S,H,D] (and attention's lse [B,H,S]).
            let seq = roles[n.inputs[0].index()][1];
            roles[n.outputs[0].index()][1] = seq;
            if let Some(lse) = n.outputs.get(1) {
                roles[lse.index()][2] = seq;
            }
        }
    }
    roles
}

fn is_follower_op(op: &Op) -> bool {
    matches!(op, Op::Unary(_) | Op::Cast(_) | Op::Dropout { .. } | Op::Reshape(_) | Op::Permute(_))
}

/// Bytes of a tensor under a spec on this mesh.
fn local_bytes(meta: &TensorMeta, spec: &Spec, mesh: &Mesh) -> f64 {
    local_meta(meta, spec, mesh).map_or(f64::INFINITY, |m| m.size_bytes() as f64)
}

impl Space {
    pub(super) fn new(g: &Graph, mesh: &Mesh, rule: &AxisRule) -> Result<Space> {
        let n = g.nodes.len();
        let mut labels: Vec<Option<Labeling>> = Vec::with_capacity(n);
        for node in &g.nodes {
            if node.op.is_leaf() {
                labels.push(None);
                continue;
            }
            let l = labeling(&node.op, &metas(g, &node.inputs), &metas(g, &node.outputs))
                .map_err(|e| PlanError::Invalid(format!("{}: {e}", g.scope_name(node.scope))))?;
            labels.push(Some(l));
        }
        let roles = dim_roles(g, &labels);

        let rep = super::sharing::block_sharing(g);

        let live_axes: Vec<usize> = (0..mesh.ndim()).filter(|&a| mesh.shape[a] > 1).collect();
        // A config's mesh: data-parallel axes, then the axes that pin what they split (the
        // context-parallel axis with `cpN`), then the tensor axis last.
        let tp_axis = mesh.ndim().saturating_sub(1);
        // Each registered axis that pins ([`crate::axis::Axis::pins`]) and has a mesh axis
        // here, in registry order: (the axis, its mesh axis, its label per node).
        let mut pinned: Vec<(&dyn Axis, usize, Vec<Option<usize>>)> = Vec::new();
        if let AxisRule::Megatron { sp, .. } = rule {
            let seq_roles = context_roles(g, &labels);
            for &axis in AXES {
                let Some(a) = axis.pinned_axis().and_then(|name| mesh.axis(name)) else {
                    continue;
                };
                if a == tp_axis {
                    continue;
                }
                let mut cx = PinContext {
                    graph: g,
                    labels: &mut labels,
                    roles: &roles,
                    seq_roles: &seq_roles,
                    mesh,
                    axis: a,
                    sp: *sp,
                };
                match axis.pins(&mut cx) {
                    Ok(pins) => pinned.push((axis, a, pins)),
                    Err(why) => return Ok(Space::unsplittable(g, why)),
                }
            }
        }
        let data_axes: Vec<usize> = live_axes
            .iter()
            .copied()
            .filter(|&a| a != tp_axis && pinned.iter().all(|p| p.1 != a))
            .collect();
        // A config string's tensor axis splits what Megatron-LM's layout splits, op by op.
        let tp_pins = match rule {
            AxisRule::Megatron { sp, .. } if live_axes.contains(&tp_axis) => {
                let tp = mesh.shape[tp_axis];
                match super::megatron::tp_labels(g, &mut labels, &roles, *sp, tp, false) {
                    Ok(pins) => Some(pins),
                    Err(why) => return Ok(Space::unsplittable(g, why)),
                }
            }
            _ => None,
        };
        let mut var_of = vec![None; n];
        let mut heads = Vec::new();
        let mut options: Vec<usize> = Vec::new();
        let mut chosen: Vec<Vec<Strategy>> = vec![Vec::new(); n];
        for i in 0..n {
            let node = &g.nodes[i];
            let Some(l) = &labels[i] else { continue };
            if rep[i] != i {
                var_of[i] = var_of[rep[i]];
                continue;
            }
            let x = metas(g, &node.inputs);
            let y = metas(g, &node.outputs);
            // A follower: one input from a non-leaf producer, all others leaves.
            let producers: Vec<usize> = node
                .inputs
                .iter()
                .map(|&t| g.tensor(t).producer.index())
                .filter(|&p| !g.nodes[p].op.is_leaf())
                .collect();
            let follower = is_follower_op(&node.op)
                && producers.len() == 1
                && var_of[producers[0]].is_some()
                && rep[producers[0]] == producers[0]
                && g.nodes[producers[0]].block == node.block;
            let lab_role = label_roles(node, l, &roles);
            let allow = |a: usize, lab: usize| -> bool {
                if !live_axes.contains(&a) {
                    return false;
                }
                match rule {
                    AxisRule::Free => true,
                    AxisRule::Megatron { .. } if a == tp_axis => {
                        tp_pins.as_ref().is_some_and(|p| p[i] == Some(lab))
                    }
                    AxisRule::Megatron { .. } => match pinned.iter().find(|p| p.1 == a) {
                        Some((_, _, pins)) => pins[i] == Some(lab),
                        None => lab_role[lab] == DimRole::Batch,
                    },
                }
            };
            let mut all = strategies(l, &x, &y, mesh, &allow);
            if let AxisRule::Megatron { .. } = rule {
                // Data parallel splits the batch of every op that has one.
                let has_batch = (0..l.sizes.len())
                    .any(|lab| lab_role[lab] == DimRole::Batch && l.shardable[lab]);
                if has_batch {
                    all.retain(|s| data_axes.iter().all(|&a| s.axis_labels[a].is_some()));
                }
                // A pinning axis splits exactly its pinned label (the context-parallel axis:
                // heads tp-major, its `order_strategy`).
                for (axis, a, pins) in &pinned {
                    let Some(lab) = pins[i] else { continue };
                    all.retain(|s| s.axis_labels[*a] == Some(lab));
                    if all.is_empty() {
                        let why = format!(
                            "{} ({}) cannot be split over {} on the mesh {:?}",
                            g.scope_name(node.scope),
                            node.op.name(),
                            axis.pin_miss(),
                            mesh.shape
                        );
                        return Ok(Space::unsplittable(g, why));
                    }
                    for s in &mut all {
                        axis.order_strategy(s, node, mesh, *a);
                    }
                }
                // An axis may widen what its strategies split (ring attention: attention's
                // and RoPE's sequence), pinned label or not.
                for (axis, a, _) in &pinned {
                    axis.adjust_strategies(&mut all, node, mesh, *a);
                }
                // The tensor axis splits exactly Megatron's label.
                if let Some(lab) = tp_pins.as_ref().and_then(|p| p[i]) {
                    all.retain(|s| s.axis_labels[tp_axis] == Some(lab));
                    if all.is_empty() {
                        let why = format!(
                            "{} ({}) cannot be split over the tensor-parallel axis as \
                             Megatron-LM's layout splits it on the mesh {:?}",
                            g.scope_name(node.scope),
                            node.op.name(),
                            mesh.shape
                        );
                        return Ok(Space::unsplittable(g, why));
                    }
                }
            }
            if all.is_empty() {
                all = strategies(l, &x, &y, mesh, &|_, _| false);
            }
            if follower {
                let p = producers[0];
                let v = var_of[p].expect("checked");
                let k = node
                    .inputs
                    .iter()
                    .position(|&t| g.tensor(t).producer.index() == p)
                    .unwrap_or(0);
                let t = node.inputs[k];
                let oi = g.tensor(t).output_index as usize;
                let mut mine: Vec<Strategy> = Vec::with_capacity(chosen[p].len());
                for ps in &chosen[p] {
                    let have = &ps.outputs[oi];
                    let pick = all
                        .iter()
                        .filter(|s| &s.inputs[k] == have)
                        // Same input layout: keep the output as split as possible.
                        .min_by(|a, b| {
                            local_bytes(y[0], &a.outputs[0], mesh).total_cmp(&local_bytes(
                                y[0],
                                &b.outputs[0],
                                mesh,
                            ))
                        })
                        .or_else(|| all.first());
                    mine.push(
                        pick.cloned().ok_or_else(|| PlanError::Internal("no strategy".into()))?,
                    );
                }
                var_of[i] = Some(v);
                chosen[i] = mine;
            } else {
                var_of[i] = Some(heads.len());
                heads.push(NodeId(i as u32));
                options.push(all.len());
                chosen[i] = all;
            }
        }
        Ok(Space { nodes: n, var_of, heads, options, chosen, rep, unsplittable: None })
    }

    /// A space with no candidate, and why.
    fn unsplittable(g: &Graph, why: String) -> Space {
        Space {
            nodes: g.nodes.len(),
            var_of: Vec::new(),
            heads: Vec::new(),
            options: vec![0],
            chosen: Vec::new(),
            rep: Vec::new(),
            unsplittable: Some(why),
        }
    }

    /// The per-node strategies of a set of picks.
    pub(super) fn assignment(&self, picks: &[usize]) -> Vec<Option<Strategy>> {
        (0..self.nodes).map(|i| self.var_of[i].map(|v| self.chosen(i)[picks[v]].clone())).collect()
    }

    /// Whether the space holds one layout: every decision has one option (a Megatron-style
    /// rule that pins every op).
    pub(super) fn single_layout(&self) -> bool {
        self.options.iter().all(|&o| o == 1)
    }

    /// The spec node `i`'s strategies ask of its input `k`, one per pick of its decision (none
    /// for a node without one).
    pub(super) fn input_specs(&self, i: usize, k: usize) -> impl Iterator<Item = &Spec> + '_ {
        let options = match self.var_of.get(i) {
            Some(Some(_)) => self.chosen(i),
            _ => &[],
        };
        options.iter().filter_map(move |s| s.inputs.get(k))
    }

    /// Node `i`'s strategy per pick of its decision.
    fn chosen(&self, i: usize) -> &[Strategy] {
        &self.chosen[self.rep[i]]
    }
}

/// Optimizer bytes per parameter element: Adam m and v in f32, plus an f32 master copy when
/// the parameter is stored in lower precision.
pub(super) fn optimizer_bytes_per_elem(dtype: DType) -> f64 {
    if dtype == DType::F32 {
        8.0
    } else {
        12.0
    }
}

pub(super) fn build_problem(
    p: &Search<'_>,
    cand: &Candidate,
    fwd: &Forward,
    space: &Space,
    saved: &[bool],
    budget: f64,
) -> Result<Problem> {
    let g = &fwd.graph;
    let mesh = &cand.mesh;
    let mbf = cand.micro_batches.max(1) as f64;
    let experts = p.problem.cost.expert_share(g);
    let nv = space.heads.len();
    let mut node_cost: Vec<Vec<f64>> = space.options.iter().map(|&o| vec![0.0; o]).collect();
    let mut saved_bytes: Vec<Vec<f64>> = node_cost.clone();
    let mut static_bytes: Vec<Vec<f64>> = node_cost.clone();
    let mut temp_bytes: Vec<Vec<f64>> = node_cost.clone();
    let consumers = g.consumers();
    let live = |a: usize| mesh.shape[a] > 1;
    let group = |axes: &[usize]| -> f64 { axes.iter().map(|&a| mesh.shape[a] as f64).product() };

    // Parameters of offloaded chunks: their optimizer state (and, moved eagerly, their
    // gradients) rest on the host, and the host runs their update.
    let offloaded: HashMap<TensorId, tessera_ir::Tier> =
        cand.offload.map(|o| o.offloaded(g).into_iter().collect()).unwrap_or_default();
    let eager_grads = cand.offload.is_some_and(|o| o.kind.eager_grads());

    // Node costs, memory, parameters (memoised per representative).
    let mut memo: HashMap<usize, NodeCosts> = HashMap::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let Some(v) = space.var_of[i] else { continue };
        let r = space.rep[i];
        if let std::collections::hash_map::Entry::Vacant(slot) = memo.entry(r) {
            let nopt = space.options[v];
            let (mut c, mut sv, mut st, mut tp) =
                (vec![0.0; nopt], vec![0.0; nopt], vec![0.0; nopt], vec![0.0; nopt]);
            for s in 0..nopt {
                let strat = &space.chosen(i)[s];
                let x: Option<Vec<TensorMeta>> = node
                    .inputs
                    .iter()
                    .zip(&strat.inputs)
                    .map(|(&t, sp)| local_meta(g.meta(t), sp, mesh))
                    .collect();
                let y: Option<Vec<TensorMeta>> = node
                    .outputs
                    .iter()
                    .zip(&strat.outputs)
                    .map(|(&t, sp)| local_meta(g.meta(t), sp, mesh))
                    .collect();
                let (Some(x), Some(y)) = (x, y) else {
                    c[s] = f64::INFINITY;
                    continue;
                };
                let xr: Vec<&TensorMeta> = x.iter().collect();
                let yr: Vec<&TensorMeta> = y.iter().collect();
                let fwd_t = p.problem.cost.node_time(&node.op, &xr, &yr, experts);
                let bwd =
                    if matches!(node.op, Op::MatMul { .. } | Op::Attention(_)) { 2.0 } else { 1.0 };
                c[s] += fwd_t * (1.0 + bwd) * mbf;
                for (k, &o) in node.outputs.iter().enumerate() {
                    let b = y[k].size_bytes() as f64;
                    if saved[o.index()] {
                        sv[s] += b;
                    } else {
                        tp[s] += b;
                    }
                }
                tp[s] += node.op.workspace_bytes(&xr) as f64;
                // Parameters this node reads first: their states, and their gradient traffic.
                for (k, &t) in node.inputs.iter().enumerate() {
                    if !matches!(g.producer(t).op, Op::Parameter { .. })
                        || consumers[t.index()].first() != Some(&NodeId(i as u32))
                    {
                        continue;
                    }
                    let meta = g.meta(t);
                    let want = &strat.inputs[k];
                    let elems = x[k].numel() as f64;
                    let pending: Vec<usize> = strat
                        .compute_axes
                        .iter()
                        .copied()
                        .filter(|&a| live(a) && !want.uses_axis(a))
                        .collect();
                    let n = group(&pending);
                    let z = cand.zero;
                    let eb = meta.dtype.size_bytes() as f64;
                    let (pdiv, gdiv, odiv) = match z {
                        0 => (1.0, 1.0, 1.0),
                        1 => (1.0, 1.0, n),
                        2 => (1.0, n, n),
                        _ => (n, n, n),
                    };
                    let share = (elems / odiv).ceil() as usize;
                    if offloaded.contains_key(&t) {
                        let grads = if eager_grads { 0.0 } else { eb / gdiv };
                        st[s] += elems * (eb / pdiv + grads);
                        let moved = (share as f64 * eb) as u64;
                        c[s] += p.problem.cost.offloaded_step_time(share, moved, moved);
                    } else {
                        st[s] += elems
                            * (eb / pdiv + eb / gdiv + optimizer_bytes_per_elem(meta.dtype) / odiv);
                        // The update runs on this device's share of the optimizer state.
                        c[s] += p.problem.cost.optimizer_step_time(share, meta.dtype);
                    }
                    // Gradient sync over the pending axes (ring all-reduce ≈ reduce-scatter +
                    // all-gather); ZeRO-3 also gathers the weight in forward and backward.
                    let bytes = elems * eb;
                    for &a in &pending {
                        let link = mesh.links[a];
                        let m = mesh.shape[a];
                        c[s] += crate::cost::bucketed_time(
                            link,
                            m,
                            tessera_ir::Collective::AllReduce,
                            bytes as u64,
                        );
                        if z == 3 {
                            c[s] += 2.0
                                * mbf
                                * crate::cost::bucketed_time(
                                    link,
                                    m,
                                    tessera_ir::Collective::AllGather { dim: 0 },
                                    (bytes / m as f64) as u64,
                                );
                        }
                    }
                }
            }
            slot.insert((c, sv, st, tp));
        }
        let (c, sv, st, tp) = &memo[&r];
        for s in 0..c.len() {
            node_cost[v][s] += c[s];
            saved_bytes[v][s] += sv[s];
            static_bytes[v][s] += st[s];
            temp_bytes[v][s] = temp_bytes[v][s].max(tp[s]);
        }
    }

    // Edges: resharding between producer and consumer, forward and backward. They depend on
    // the mesh, the rule and the micro-batch count only (not the ZeRO stage, the offload or
    // the budget), so the candidates that differ in those share them ([`EdgeCache`]).
    let key = (mesh.clone(), cand.rule.clone(), cand.micro_batches);
    let edges = match p.state.graphs.edges.get(&key) {
        Some(edges) => edges,
        None => {
            let mut reshard = ReshardCache::new(mesh.clone());
            p.state.graphs.edges.insert(key, edge_costs(g, mesh, space, &mut reshard, mbf))
        }
    };
    let mut edge_list = Vec::new();
    for (&(a, b), cost) in edges.iter() {
        if a == b {
            for (s, row) in cost.iter().enumerate() {
                node_cost[a][s] += row[s];
            }
        } else {
            edge_list.push(Edge { from: a, to: b, cost: cost.clone() });
        }
    }
    edge_list.sort_by_key(|e| (e.from, e.to));

    // Memory rows: inputs + states + all saved activations + one decision's transients.
    let inputs: f64 = g
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Input(_)))
        .map(|n| g.meta(n.outputs[0]).size_bytes() as f64 / mesh.num_devices() as f64)
        .sum();
    // A decision with one strategy is a constant: its bytes go into the rows' constant instead
    // of a term. Every row holds every decision's resident bytes, so the rows are quadratic in
    // the decisions: a model without repeated blocks (a UNet: ~800 decisions) on one device,
    // where every decision has one strategy, made ~700,000 terms per ILP that the ILP's own
    // reductions then folded into the same constants.
    let resident = |v: usize| -> Vec<f64> {
        saved_bytes[v].iter().zip(&static_bytes[v]).map(|(a, b)| a + b).collect()
    };
    let single = |v: usize| space.options[v] == 1;
    let mut constant = inputs;
    let mut base: Vec<(usize, Vec<f64>)> = Vec::new();
    for v in 0..nv {
        match single(v) {
            true => constant += resident(v)[0],
            false => base.push((v, resident(v))),
        }
    }
    let memory: Vec<MemRow> = (0..nv)
        .filter(|&v| temp_bytes[v].iter().any(|&b| b > 0.0))
        .map(|v| match single(v) {
            true => MemRow { constant: constant + temp_bytes[v][0], terms: base.clone() },
            false => {
                let mut terms = base.clone();
                terms.push((v, temp_bytes[v].clone()));
                MemRow { constant, terms }
            }
        })
        .collect();
    Ok(Problem {
        choices: node_cost.into_iter().map(|cost| Choice { cost }).collect(),
        edges: edge_list,
        memory,
        budget,
    })
}

/// Pairwise costs by (producer decision, consumer decision): the resharding between producer
/// and consumer, forward and backward, summed over the tensors between them.
pub(super) type EdgeCosts = HashMap<(usize, usize), Vec<Vec<f64>>>;

/// Edge costs already built, per (mesh, axis rule, micro-batch count) of one search
/// ([`Search`]'s graphs are fixed): a job's ZeRO stages, and the most frugal layout's ILP,
/// build the same edges, the costliest part of a 2-D mesh's ILP (every reshard path).
#[derive(Default)]
pub struct EdgeCache(std::sync::Mutex<Vec<(EdgeKey, std::sync::Arc<EdgeCosts>)>>);

type EdgeKey = (Mesh, AxisRule, usize);

impl EdgeCache {
    fn get(&self, key: &EdgeKey) -> Option<std::sync::Arc<EdgeCosts>> {
        let entries = self.0.lock().ok()?;
        entries.iter().find(|(k, _)| k == key).map(|(_, e)| e.clone())
    }

    /// Keeps `edges` under `key` (a thread that built them meanwhile built the same).
    fn insert(&self, key: EdgeKey, edges: EdgeCosts) -> std::sync::Arc<EdgeCosts> {
        let edges = std::sync::Arc::new(edges);
        if let Ok(mut entries) = self.0.lock() {
            if !entries.iter().any(|(k, _)| *k == key) {
                entries.push((key, edges.clone()));
            }
        }
        edges
    }
}

/// Spaces already built, per (micro-batch size, mesh, axis rule) of one search: a job's ZeRO
/// stages, its deferred candidates and the offload phase's probes solve ILPs over the same
/// space.
#[derive(Default)]
pub struct SpaceCache(std::sync::Mutex<Vec<(SpaceKey, std::sync::Arc<Space>)>>);

type SpaceKey = (usize, Mesh, AxisRule);

impl SpaceCache {
    /// The space of `g` (the forward graph of `micro_batch` samples) on `mesh` under `rule`.
    pub(super) fn get(
        &self,
        micro_batch: usize,
        g: &Graph,
        mesh: &Mesh,
        rule: &AxisRule,
    ) -> Result<std::sync::Arc<Space>> {
        let found = |entries: &[(SpaceKey, std::sync::Arc<Space>)]| {
            entries
                .iter()
                .find(|((b, m, r), _)| *b == micro_batch && m == mesh && r == rule)
                .map(|(_, s)| s.clone())
        };
        if let Some(s) = self.0.lock().ok().and_then(|e| found(&e)) {
            return Ok(s);
        }
        let space = std::sync::Arc::new(Space::new(g, mesh, rule)?);
        if let Ok(mut entries) = self.0.lock() {
            // A thread that built it meanwhile built the same.
            if found(&entries).is_none() {
                entries.push(((micro_batch, mesh.clone(), rule.clone()), space.clone()));
            }
        }
        Ok(space)
    }
}

fn edge_costs(
    g: &Graph,
    mesh: &Mesh,
    space: &Space,
    reshard: &mut ReshardCache,
    mbf: f64,
) -> EdgeCosts {
    let live = |a: usize| mesh.shape[a] > 1;
    let mut edge_memo: HashMap<(usize, usize, usize, usize), Vec<Vec<f64>>> = HashMap::new();
    let mut edges: HashMap<(usize, usize), Vec<Vec<f64>>> = HashMap::new();
    for (ci, node) in g.nodes.iter().enumerate() {
        let Some(cv) = space.var_of[ci] else { continue };
        for (k, &t) in node.inputs.iter().enumerate() {
            let pi = g.tensor(t).producer.index();
            let Some(pv) = space.var_of[pi] else { continue };
            let oi = g.tensor(t).output_index as usize;
            let key = (space.rep[pi], space.rep[ci], oi, k);
            let meta = g.meta(t);
            let m = edge_memo.entry(key).or_insert_with(|| {
                let (np, nc) = (space.options[pv], space.options[cv]);
                let mut m = vec![vec![0.0; nc]; np];
                let dims = meta.shape.dims();
                let eb = meta.dtype.size_bytes();
                for (s, row) in m.iter_mut().enumerate() {
                    let have = &space.chosen(pi)[s].outputs[oi];
                    for (u, cell) in row.iter_mut().enumerate() {
                        if pv == cv && s != u {
                            continue;
                        }
                        let cs = &space.chosen(ci)[u];
                        let want = &cs.inputs[k];
                        let f = reshard.cost(dims, eb, have, want).unwrap_or(f64::INFINITY);
                        let b = if meta.dtype.is_float() {
                            let pend: Vec<usize> = cs
                                .compute_axes
                                .iter()
                                .copied()
                                .filter(|&a| live(a) && !want.uses_axis(a))
                                .collect();
                            let mut at = want.clone();
                            at.partial = pend;
                            let to = Spec { dims: have.dims.clone(), partial: vec![] };
                            reshard.cost(dims, eb, &at, &to).unwrap_or(f64::INFINITY)
                        } else {
                            0.0
                        };
                        *cell = (f + b) * mbf;
                    }
                }
                m
            });
            let e = edges.entry((pv, cv)).or_insert_with(|| vec![vec![0.0; m[0].len()]; m.len()]);
            for (s, row) in m.iter().enumerate() {
                for (u, c) in row.iter().enumerate() {
                    e[s][u] += c;
                }
            }
        }
    }
    edges
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::search::{CkptSearch, SearchKnobs, SearchProblem};
    use crate::Cluster;

    /// A tiny diffusers UNet: no repeated blocks, so a decision per op.
    const UNET: &str = r#"{"_class_name": "UNet2DConditionModel", "sample_size": 4,
        "block_out_channels": [4, 8], "layers_per_block": 1, "norm_num_groups": 2,
        "cross_attention_dim": 4, "attention_head_dim": [2, 2],
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "use_linear_projection": true}"#;

    fn unet(mb: usize) -> Result<Forward> {
        let cfg = tessera_models::ModelConfig::from_hf_json(UNET).unwrap();
        let opts = tessera_models::BuildOptions::new(mb, 3, DType::F32);
        let fm = tessera_models::build(&cfg, &opts).unwrap();
        Ok(Forward { graph: fm.builder.finish(), loss: fm.loss })
    }

    /// The ILP of the tiny UNet on `devices` CPU devices (a 1-D mesh, per-op rule).
    fn search(cluster: &Cluster) -> Search<'static> {
        Search::new(SearchProblem {
            build: &unet,
            batch: 2,
            cost: crate::cost::CostModel::for_cluster(cluster),
            train: tessera_ir::TrainConfig::default(),
            knobs: SearchKnobs::default(),
            ckpt: CkptSearch::Joint,
        })
    }

    fn problem(devices: usize) -> (Problem, Vec<usize>) {
        let cluster = Cluster::parse(&format!("{devices}xcpu")).unwrap();
        let search = search(&cluster);
        let shared = search.forward(2).unwrap();
        let (fwd, saved) = (&shared.0, &shared.1);
        let mesh = Mesh::new(&cluster, &[devices], &["dp"]).unwrap();
        let cand = Candidate {
            mesh: mesh.clone(),
            rule: AxisRule::Free,
            zero: 0,
            micro_batches: 1,
            offload: None,
        };
        let space = Space::new(&fwd.graph, &mesh, &cand.rule).unwrap();
        let p = build_problem(&search, &cand, fwd, &space, saved, 1e12).unwrap();
        (p, space.options.clone())
    }

    /// The space a search shares between candidates ([`SpaceCache`]) is built once per
    /// (micro-batch size, mesh, rule) and gives each ZeRO stage the ILP a fresh search builds.
    #[test]
    fn a_shared_space_builds_the_same_problem() {
        let cluster = Cluster::parse("2xcpu").unwrap();
        let mesh = Mesh::new(&cluster, &[2], &["dp"]).unwrap();
        let shared = search(&cluster);
        let spaces = &shared.state.graphs.spaces;
        let fwd = shared.forward(2).unwrap();
        let first = spaces.get(2, &fwd.0.graph, &mesh, &AxisRule::Free).unwrap();
        for zero in [3, 0] {
            let rule = AxisRule::Free;
            let cand =
                Candidate { mesh: mesh.clone(), rule, zero, micro_batches: 1, offload: None };
            let space = spaces.get(2, &fwd.0.graph, &mesh, &cand.rule).unwrap();
            assert!(std::sync::Arc::ptr_eq(&first, &space), "built again");
            let a = build_problem(&shared, &cand, &fwd.0, &space, &fwd.1, 1e12).unwrap();
            let fresh = search(&cluster);
            let f = fresh.forward(2).unwrap();
            let space = Space::new(&f.0.graph, &mesh, &cand.rule).unwrap();
            let b = build_problem(&fresh, &cand, &f.0, &space, &f.1, 1e12).unwrap();
            assert!(a.choices.iter().any(|c| c.cost.len() > 1), "no choice to compare");
            assert_eq!(a, b, "zero {zero}");
        }
    }

    /// DeepSeek-V3's tiny preset (one dense layer, then sparse ones) with `layers` layers: the
    /// decisions with a choice of a 2-device free ILP (each layer's scalar auxiliary-loss ops,
    /// outside the blocks, are decisions of one strategy: constants to the ILP).
    fn deepseek_decisions(layers: usize) -> usize {
        let mut cfg = tessera_models::ModelConfig::preset("deepseek-v3-tiny").unwrap();
        if let tessera_models::ModelConfig::Llama(c) = &mut cfg {
            let mut p = c.params().clone();
            p.num_hidden_layers = layers;
            *c = tessera_models::LlamaConfig::new(p).unwrap();
        }
        let opts = tessera_models::BuildOptions::new(2, 16, DType::F32);
        let fm = tessera_models::build(&cfg, &opts).unwrap();
        let g = fm.builder.finish();
        let cluster = Cluster::parse("2xcpu").unwrap();
        let mesh = Mesh::new(&cluster, &[2], &["dp"]).unwrap();
        let space = Space::new(&g, &mesh, &AxisRule::Free).unwrap();
        space.options.iter().filter(|&&o| o > 1).count()
    }

    /// Sparse layers after dense ones share the decisions of the first sparse layer alike
    /// (before, each kept the decisions of its experts, router and MLP: dozens): each more
    /// adds at most one, its auxiliary loss's per-expert statistics outside the blocks.
    #[test]
    fn sparse_layers_after_dense_ones_share_decisions() {
        let counts: Vec<usize> = [3, 4, 6].into_iter().map(deepseek_decisions).collect();
        assert!(counts[0] > 20, "{counts:?}");
        assert!(counts[1] <= counts[0] + 1 && counts[2] <= counts[1] + 2, "{counts:?}");
    }

    /// Memory rows name only decisions with a choice: on one device, where every decision has
    /// one strategy, they are constants (the rows cost O(decisions), not O(decisions²)); on two,
    /// no row names a decision with one strategy.
    #[test]
    fn rows_name_only_decisions_with_a_choice() {
        let (one, options) = problem(1);
        assert!(one.choices.len() > 100, "a decision per op: {}", one.choices.len());
        assert!(options.iter().all(|&o| o == 1));
        assert!(one.memory.iter().all(|r| r.terms.is_empty()));
        let (_, peak) = crate::ilp::evaluate(&one, &vec![0; one.choices.len()]);
        let most = one.memory.iter().map(|r| r.constant).fold(0.0, f64::max);
        assert!(peak > 0.0 && peak == most);

        let (two, options) = problem(2);
        assert!(options.iter().any(|&o| o > 1) && options.contains(&1));
        for row in &two.memory {
            assert!(row.terms.iter().all(|(v, _)| options[*v] > 1), "a single-strategy term");
        }
    }
}
