//! Activation offload ([`crate::offload`]'s `act`): a rewrite of the checkpointed training
//! graph that keeps the inputs of fully checkpointed blocks in host memory between the passes.
//!
//! A *kept input* is a buffer a forward node outside block `c` makes on the device and only
//! the recomputation and backward pass of blocks under [`CkptMode::Full`] read (each read of
//! the buffer itself, not of a view of it): with full checkpointing, the block's input — the
//! residual stream the block before it produced. For each one the rewrite
//! - copies it to the host right after its producer (`Transfer{Device→Host}`, phase forward,
//!   the producer's block): its device buffer now dies after its last *forward* reader;
//! - copies it back (`Transfer{Host→Device}`, phase backward, tagged with the reader's block)
//!   one block ahead: before the first backward node of block `c + 1` that precedes the
//!   reader (for the last block, where the backward pass begins), so the copy overlaps that
//!   block's backward compute; the backward readers read the copy.
//!
//! Both copies are ordinary Program instructions, so the device and host peaks the memory
//! simulation predicts are what the runtime's accountants measure, and the cost model prices
//! them on the host link as every offload copy is (the event simulation overlaps them with the
//! device's compute). The rewrite runs after checkpointing and the micro-batch replay, so
//! every micro-batch moves its own inputs.

use super::internal;
use crate::Result;
use std::collections::BTreeMap;
use tessera_ir::{
    Builder, Checkpointing, CkptMode, Graph, Op, Phase, ScopeId, TensorId, Tier, TrainingGraph,
};

/// The buffer root of each tensor (views and in-place outputs share their input's).
fn buffer_roots(g: &Graph) -> Vec<TensorId> {
    let mut root: Vec<TensorId> = (0..g.tensors.len() as u32).map(TensorId).collect();
    for node in &g.nodes {
        for (k, &o) in node.outputs.iter().enumerate() {
            if let Some(i) = node.op.output_alias(k) {
                root[o.index()] = root[node.inputs[i].index()];
            }
        }
    }
    root
}

/// The kept inputs of `g` under `ckpt`, each with the node its first backward reader is and
/// that reader's block (see the module docs).
fn kept_inputs(g: &Graph, ckpt: &Checkpointing, outputs: &[TensorId]) -> Vec<(TensorId, usize)> {
    let root = buffer_roots(g);
    let nt = g.tensors.len();
    // A device buffer a non-leaf forward node makes (not a view).
    let mut candidate = vec![false; nt];
    for node in &g.nodes {
        if node.phase != Phase::Forward || node.op.is_leaf() || node.tier != Tier::Device {
            continue;
        }
        for (k, &o) in node.outputs.iter().enumerate() {
            candidate[o.index()] = node.op.output_alias(k).is_none();
        }
    }
    for &t in outputs {
        candidate[root[t.index()].index()] = false;
    }
    let mut first: Vec<Option<usize>> = vec![None; nt];
    for (i, node) in g.nodes.iter().enumerate() {
        if !matches!(node.phase, Phase::Backward | Phase::Recompute) {
            continue;
        }
        for &t in &node.inputs {
            let r = root[t.index()];
            if !candidate[r.index()] {
                continue;
            }
            let producer_block = g.producer(r).block;
            let ok = t == r
                && node.block.is_some_and(|b| ckpt.mode(b) == CkptMode::Full)
                && producer_block != node.block;
            if ok {
                first[r.index()].get_or_insert(i);
            } else {
                candidate[r.index()] = false;
            }
        }
    }
    (0..nt)
        .filter(|&t| candidate[t])
        .filter_map(|t| first[t].map(|i| (TensorId(t as u32), i)))
        .collect()
}

/// Where the copy back of a kept input first read at node `reader` is issued: before the
/// first node of the backward pass of the block after the reader's (`c + 1`) that precedes the
/// reader with only backward nodes of blocks `c`, `c + 1` and of no block between; for the
/// last block, where the backward pass begins.
fn fetch_at(g: &Graph, reader: usize) -> usize {
    let Some(c) = g.nodes[reader].block else { return reader };
    let (mut ahead, mut start) = (None, reader);
    for j in (0..reader).rev() {
        let n = &g.nodes[j];
        if n.phase == Phase::Forward {
            break;
        }
        match n.block {
            Some(b) if b == c + 1 => ahead = Some(j),
            Some(b) if b == c => {}
            Some(_) => break,
            None if ahead.is_none() => start = j,
            None => {}
        }
    }
    ahead.unwrap_or(start)
}

/// `tg` with the kept inputs of its fully checkpointed blocks resting on the host (see the
/// module docs). Unchanged (cloned) when no block keeps one.
pub(crate) fn apply(tg: &TrainingGraph, ckpt: &Checkpointing) -> Result<TrainingGraph> {
    let g = &tg.graph;
    let mut outputs = vec![tg.loss, tg.grad_norm];
    outputs.extend(tg.params.iter().map(|s| s.grad));
    let kept = kept_inputs(g, ckpt, &outputs);
    if kept.is_empty() {
        return Ok(tg.clone());
    }
    let mut offload_after = vec![false; g.tensors.len()];
    // Node index → the kept inputs fetched before it, in order of first reader.
    let mut fetches: BTreeMap<usize, Vec<(usize, TensorId)>> = BTreeMap::new();
    for &(t, reader) in &kept {
        offload_after[t.index()] = true;
        fetches.entry(fetch_at(g, reader)).or_default().push((reader, t));
    }
    let mut b = Builder::from_graph(Graph::with_capacity(
        g.nodes.len() + 2 * kept.len(),
        g.tensors.len() + 2 * kept.len(),
    ));
    for s in 1..g.num_scopes() {
        b.graph.intern_scope(g.scope_name(ScopeId(s as u32)));
    }
    let mut map: Vec<Option<TensorId>> = vec![None; g.tensors.len()];
    let mut host: Vec<Option<TensorId>> = vec![None; g.tensors.len()];
    let mut fetched: Vec<Option<TensorId>> = vec![None; g.tensors.len()];
    let mapped = |map: &[Option<TensorId>], t: TensorId| {
        map[t.index()].ok_or_else(|| internal(format!("activation offload: {t:?} read unmade")))
    };
    for (i, node) in g.nodes.iter().enumerate() {
        if let Some(due) = fetches.get_mut(&i) {
            due.sort();
            for &(reader, t) in due.iter() {
                let src = mapped(&host, t)?;
                let r = g.node(tessera_ir::NodeId(reader as u32));
                b.set_scope_id(r.scope);
                b.set_block(r.block);
                b.set_phase(Phase::Backward);
                let copy = b.push1(Op::Transfer { from: Tier::Host, to: Tier::Device }, &[src]);
                fetched[t.index()] = Some(copy.map_err(internal)?);
            }
        }
        let backward = matches!(node.phase, Phase::Backward | Phase::Recompute);
        let mut ins = Vec::with_capacity(node.inputs.len());
        for &t in &node.inputs {
            ins.push(match fetched[t.index()] {
                Some(f) if backward => f,
                _ => mapped(&map, t)?,
            });
        }
        b.set_scope_id(node.scope);
        b.set_block(node.block);
        b.set_phase(node.phase);
        let outs = b.push_like(g, node, node.op.clone(), &ins).map_err(internal)?;
        for (&o, &n) in node.outputs.iter().zip(&outs) {
            map[o.index()] = Some(n);
            if offload_after[o.index()] {
                let copy = b.push1(Op::Transfer { from: Tier::Device, to: Tier::Host }, &[n]);
                host[o.index()] = Some(copy.map_err(internal)?);
            }
        }
    }
    tg.try_remap(b.finish(), |t| mapped(&map, t))
}

/// The activations a Program moves to the host in one step (kept in [`crate::offload`], which
/// reports them, below the lowering).
pub use crate::offload::activations_moved as moved;
