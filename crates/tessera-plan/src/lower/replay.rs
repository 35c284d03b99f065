//! The replay pass of the lowering (see [`super`]'s module docs, step 3): micro-batches
//! unrolled (gradients accumulate, synchronised once), each gradient's synchronisation moved
//! right after its last contribution, and all-gathered tensors re-gathered in the backward pass
//! instead of saved.

use super::internal;
use crate::{PlanError, Result};
use rustc_hash::FxHashMap as HashMap;
use tessera_ir::dist::{micro_batch_input, ShardOf};
use tessera_ir::Tier;
use tessera_ir::{Builder, Collective, Graph, NodeId, Op, Phase, TensorId, TrainingGraph};

/// `op` as micro-batch `k` of an unrolled step runs it.
fn in_micro_batch(op: &Op, k: usize) -> Op {
    match op {
        Op::Dropout { p, stream, shard: Some(s) } => Op::Dropout {
            p: *p,
            stream: *stream,
            shard: Some(ShardOf { micro_batch: k, ..s.clone() }),
        },
        other => other.clone(),
    }
}

/// Forward values the backward pass makes again rather than keeps: all-gathered tensors
/// (sequence parallel, ZeRO-3) and host-resident parameters fetched to the device.
fn gathers(op: &Op) -> bool {
    match op {
        Op::Reshard(s) => s.forward.iter().any(|c| matches!(c.op, Collective::AllGather { .. })),
        Op::Transfer { from: Tier::Host, to: Tier::Device } => true,
        _ => false,
    }
}

/// Micro-batch unrolling, early gradient synchronisation and backward re-gathers (see the
/// module docs). Returns a new training graph with the same parameters.
pub(crate) fn replay(tg: &TrainingGraph, micro_batches: usize) -> Result<TrainingGraph> {
    replay_tagged(tg, micro_batches).map(|(tg, _)| tg)
}

/// Where a node of a replayed graph comes from: the node it copies (or the node whose
/// processing added it) and its micro-batch; `None` for the nodes after the last micro-batch
/// (the loss sum, the optimizer) and their origin when they copy one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ReplayTag {
    pub origin: Option<NodeId>,
    pub micro_batch: Option<usize>,
}

/// [`replay`], also telling where each node of the result comes from.
pub(crate) fn replay_tagged(
    tg: &TrainingGraph,
    micro_batches: usize,
) -> Result<(TrainingGraph, Vec<ReplayTag>)> {
    let g = &tg.graph;
    let mb = micro_batches.max(1);
    let mut tags: Vec<ReplayTag> = Vec::with_capacity(g.nodes.len() * mb);
    let mut b = Builder::from_graph(Graph::with_capacity(g.nodes.len() * mb, g.tensors.len() * mb));
    for s in 1..g.num_scopes() {
        b.graph.intern_scope(g.scope_name(tessera_ir::ScopeId(s as u32)));
    }
    // Each parameter's gradient and the optimizer-phase nodes that synchronise it: a reshard
    // and, for an offloaded chunk whose gradients leave eagerly, the copy to the host after it
    // (nodes of the synchronisation section, before the gradient norm).
    let grad_slot: HashMap<TensorId, usize> =
        tg.params.iter().enumerate().map(|(i, s)| (s.grad, i)).collect();
    let norm_at = g.tensors[tg.grad_norm.index()].producer.index();
    let mut sync_node: HashMap<TensorId, Vec<NodeId>> = HashMap::default();
    let mut chain_end: HashMap<TensorId, TensorId> = HashMap::default();
    for (i, n) in g.nodes.iter().enumerate().take(norm_at) {
        if n.phase != Phase::Optimizer || !matches!(n.op, Op::Reshard(_) | Op::Transfer { .. }) {
            continue;
        }
        let grad = if grad_slot.contains_key(&n.inputs[0]) {
            Some(n.inputs[0])
        } else if matches!(n.op, Op::Transfer { .. }) {
            chain_end.get(&n.inputs[0]).copied()
        } else {
            None
        };
        if let Some(grad) = grad {
            sync_node.entry(grad).or_default().push(NodeId(i as u32));
            chain_end.insert(n.outputs[0], grad);
        }
    }
    let shared_input = |n: &tessera_ir::Node| {
        g.scope_name(n.scope).starts_with("optimizer") || n.phase == Phase::Optimizer
    };
    let mut shared: HashMap<TensorId, TensorId> = HashMap::default();
    let mut acc: Vec<Option<TensorId>> = vec![None; tg.params.len()];
    let mut losses = Vec::new();
    let mut emitted_sync: HashMap<NodeId, ()> = HashMap::default();

    let push_in = |b: &mut Builder,
                   n: &tessera_ir::Node,
                   inputs: &[TensorId],
                   k: usize|
     -> Result<tessera_ir::TensorIds> {
        b.set_scope_id(n.scope);
        b.set_block(n.block);
        b.set_phase(n.phase);
        b.push_like(g, n, in_micro_batch(&n.op, k), inputs).map_err(internal)
    };
    let push =
        |b: &mut Builder, n: &tessera_ir::Node, inputs: &[TensorId]| push_in(b, n, inputs, 0);

    for k in 0..mb {
        let mut map: HashMap<TensorId, TensorId> = HashMap::default();
        let mut regathered: HashMap<TensorId, TensorId> = HashMap::default();
        for (ni, n) in g.nodes.iter().enumerate() {
            let origin = Some(NodeId(ni as u32));
            if n.phase == Phase::Optimizer {
                continue;
            }
            let look = |t: &TensorId, map: &HashMap<TensorId, TensorId>| -> TensorId {
                map.get(t).or_else(|| shared.get(t)).copied().unwrap_or(*t)
            };
            let outs = match &n.op {
                Op::Parameter { .. } | Op::OptimizerState { .. } => {
                    if k == 0 {
                        let ins: Vec<TensorId> = n.inputs.iter().map(|t| look(t, &map)).collect();
                        let o = push(&mut b, n, &ins)?;
                        shared.insert(n.outputs[0], o[0]);
                    }
                    continue;
                }
                Op::Input(_) if shared_input(n) => {
                    if k == 0 {
                        let o = push(&mut b, n, &[])?;
                        shared.insert(n.outputs[0], o[0]);
                    }
                    continue;
                }
                Op::Input(m) if k > 0 => {
                    // Each micro-batch reads its own data.
                    let name = micro_batch_input(g.scope_name(n.scope), k);
                    b.set_block(n.block);
                    b.set_phase(n.phase);
                    smallvec::smallvec![b.input(&name, m.shape.clone(), m.dtype)]
                }
                _ => {
                    let mut ins = tessera_ir::TensorIds::with_capacity(n.inputs.len());
                    for t in &n.inputs {
                        let p = g.producer(*t);
                        if n.phase == Phase::Backward && p.phase == Phase::Forward && gathers(&p.op)
                        {
                            // Gather again rather than keep the gathered tensor alive.
                            let r = match regathered.get(t) {
                                Some(&r) => r,
                                None => {
                                    let src = look(&p.inputs[0], &map);
                                    b.set_scope_id(p.scope);
                                    b.set_block(p.block);
                                    b.set_phase(Phase::Backward);
                                    let r = b.push1(p.op.clone(), &[src]).map_err(internal)?;
                                    regathered.insert(*t, r);
                                    r
                                }
                            };
                            ins.push(r);
                        } else {
                            ins.push(look(t, &map));
                        }
                    }
                    push_in(&mut b, n, &ins, k)?
                }
            };
            for (o, &lo) in n.outputs.iter().zip(&outs) {
                map.insert(*o, lo);
            }
            // Accumulate gradients across micro-batches as soon as they are complete.
            for o in &n.outputs {
                let Some(&slot) = grad_slot.get(o) else { continue };
                let gk = map[o];
                let total = match acc[slot] {
                    None => gk,
                    Some(prev) => {
                        b.set_phase(Phase::Backward);
                        b.add(prev, gk).map_err(internal)?
                    }
                };
                acc[slot] = Some(total);
                if k + 1 == mb {
                    let mut input = total;
                    for &sn in sync_node.get(o).map_or(&[][..], |v| v.as_slice()) {
                        let node = g.node(sn);
                        let out = push(&mut b, node, &[input])?;
                        shared.insert(node.outputs[0], out[0]);
                        emitted_sync.insert(sn, ());
                        input = out[0];
                    }
                }
            }
            tags.resize(b.graph.nodes.len(), ReplayTag { origin, micro_batch: Some(k) });
        }
        losses.push(
            map.get(&tg.loss)
                .copied()
                .ok_or_else(|| PlanError::Internal("loss lost in replay".into()))?,
        );
    }
    for (slot, s) in tg.params.iter().enumerate() {
        if let Some(a) = acc[slot] {
            shared.insert(s.grad, a);
        }
    }
    let mut loss = losses[0];
    for &l in &losses[1..] {
        b.set_phase(Phase::Forward);
        loss = b.add(loss, l).map_err(internal)?;
    }
    tags.resize(b.graph.nodes.len(), ReplayTag::default());
    for (i, n) in g.nodes.iter().enumerate() {
        if n.phase != Phase::Optimizer || emitted_sync.contains_key(&NodeId(i as u32)) {
            continue;
        }
        let ins: Vec<TensorId> =
            n.inputs.iter().map(|t| shared.get(t).copied().unwrap_or(*t)).collect();
        let outs = push(&mut b, n, &ins)?;
        for (o, lo) in n.outputs.iter().zip(outs) {
            shared.insert(*o, lo);
        }
        tags.resize(
            b.graph.nodes.len(),
            ReplayTag { origin: Some(NodeId(i as u32)), micro_batch: None },
        );
    }
    let m = |t: TensorId| shared.get(&t).copied().unwrap_or(t);
    let params = tg.params.iter().map(|s| s.map(m)).collect();
    let graph = b.finish();
    tags.resize(graph.nodes.len(), ReplayTag::default());
    let out = TrainingGraph {
        graph,
        layout: tessera_ir::LeafLayout::default(),
        loss,
        grad_norm: m(tg.grad_norm),
        lr: m(tg.lr),
        step: m(tg.step),
        loss_scale: tg.loss_scale.map(m),
        params,
    };
    Ok((out, tags))
}
