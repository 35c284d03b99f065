//! Activation checkpointing as a graph → graph rewrite of the training graph.
//!
//! A block (transformer layer, `Node::block`) in a checkpoint mode *drops* some of the forward
//! values its backward pass reads: they are freed after their last forward use, and the
//! backward pass reads copies recomputed from the values that were kept. The rewrite inserts
//! those copies as ordinary nodes in phase [`Phase::Recompute`], so the [`crate::Program`]
//! built from the result frees, recomputes and re-allocates exactly what the profiler
//! simulates and the runtime executes — checkpointing needs no runtime support and keeps the
//! "predicted peak == measured peak" promise by construction.
//!
//! Modes, on our ops (attention is fused, so no S×S scores exist to drop):
//! - [`CkptMode::None`]: keep every saved value.
//! - [`CkptMode::Selective`]: keep the outputs of matmuls, attention and collectives
//!   ([`crate::Op::kept_by_selective`]); recompute the cheap norms, activation functions,
//!   elementwise and layout values from them.
//! - [`CkptMode::Full`]: keep only what crosses the block's boundary (its input, i.e. the
//!   previous block's output); re-run its forward before its backward.
//!
//! What is dropped is decided per *buffer* (a view shares its base's buffer): a buffer made by
//! a block's forward pass is dropped when the mode allows it and every backward reader of the
//! buffer (through any view) belongs to the same recompute *segment* — by default the block
//! itself; Chen's √n baseline groups several blocks into one segment, so the outputs of the
//! inner blocks are dropped too. A value another segment's backward reads (a block's output,
//! read by the next block's norm backward) is always kept: it is the next block's input. A
//! value no backward node reads (a matmul output before its bias add) is dropped as well, so a
//! recomputation that passes through it recomputes it instead of keeping it alive.
//!
//! Recomputation is lazy: at the first backward node that reads a dropped value, the value is
//! rebuilt from kept values by cloning its producers (depth first, each clone once per
//! forward instance, so micro-batch replays recompute separately). Values are recomputed as
//! late as possible and freed after their last reader. Dropout re-draws the same mask (it is
//! keyed by seed, stream and element index) and every kernel is deterministic, so recomputed
//! values equal the originals bit for bit.

use crate::{Builder, Graph, IrError, Phase, Result, ScopeId, TensorId};
use crate::{Node, TensorIds, TrainingGraph};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How much of a block's forward pass is kept for its backward pass.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum CkptMode {
    /// Keep every value the backward pass reads.
    #[default]
    None,
    /// Keep matmul, attention and collective outputs; recompute the cheap ops.
    Selective,
    /// Keep only the block's input; re-run its forward pass before its backward pass.
    Full,
}

impl CkptMode {
    pub const ALL: [CkptMode; 3] = [CkptMode::None, CkptMode::Selective, CkptMode::Full];

    pub fn name(self) -> &'static str {
        match self {
            CkptMode::None => "none",
            CkptMode::Selective => "selective",
            CkptMode::Full => "full",
        }
    }

    /// Position in [`CkptMode::ALL`] (for per-mode arrays).
    pub fn index(self) -> usize {
        match self {
            CkptMode::None => 0,
            CkptMode::Selective => 1,
            CkptMode::Full => 2,
        }
    }

    pub fn parse(s: &str) -> Option<CkptMode> {
        CkptMode::ALL.into_iter().find(|m| m.name() == s)
    }
}

impl std::fmt::Display for CkptMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Checkpoint decisions for a training graph.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Checkpointing {
    /// Mode per block index; blocks not listed keep everything.
    pub modes: BTreeMap<u32, CkptMode>,
    /// Blocks recomputed as one segment (Chen's √n schedule): block → segment id. Blocks not
    /// listed are their own segment.
    pub segments: BTreeMap<u32, u32>,
}

impl Checkpointing {
    /// The same mode on blocks `0..num_blocks`.
    pub fn uniform(num_blocks: u32, mode: CkptMode) -> Checkpointing {
        Checkpointing {
            modes: (0..num_blocks).map(|b| (b, mode)).collect(),
            segments: BTreeMap::new(),
        }
    }

    /// One mode per block, in block order.
    pub fn per_block(modes: &[CkptMode]) -> Checkpointing {
        Checkpointing {
            modes: modes.iter().enumerate().map(|(b, &m)| (b as u32, m)).collect(),
            segments: BTreeMap::new(),
        }
    }

    /// Chen et al.'s √n schedule: segments of `k` consecutive blocks, each keeping only its
    /// input and re-running its whole forward pass before its backward pass.
    pub fn chen(num_blocks: u32, k: u32) -> Checkpointing {
        let k = k.max(1);
        Checkpointing {
            modes: (0..num_blocks).map(|b| (b, CkptMode::Full)).collect(),
            segments: (0..num_blocks).map(|b| (b, b / k)).collect(),
        }
    }

    pub fn mode(&self, block: u32) -> CkptMode {
        self.modes.get(&block).copied().unwrap_or_default()
    }

    fn segment(&self, block: u32) -> (bool, u32) {
        match self.segments.get(&block) {
            Some(&s) => (true, s),
            None => (false, block),
        }
    }

    /// Whether anything is dropped at all.
    pub fn is_none(&self) -> bool {
        self.modes.values().all(|&m| m == CkptMode::None)
    }
}

/// The number of repeated blocks of a graph (1 + the largest block index).
pub fn num_blocks(g: &Graph) -> u32 {
    g.nodes.iter().filter_map(|n| n.block).max().map_or(0, |b| b + 1)
}

/// The root of each tensor's buffer (views and in-place updates share their input's).
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

/// Which buffers (by root tensor) the checkpoint decisions drop.
pub fn dropped_buffers(g: &Graph, ckpt: &Checkpointing) -> Vec<bool> {
    let root = buffer_roots(g);
    let nt = g.tensors.len();
    // Per buffer: the segment of its producer, and whether every backward reader is in it.
    let mut droppable = vec![false; nt];
    let mut seg_of: Vec<Option<(bool, u32)>> = vec![None; nt];
    for node in &g.nodes {
        if node.phase != Phase::Forward || node.op.is_leaf() {
            continue;
        }
        let Some(b) = node.block else { continue };
        let mode = ckpt.mode(b);
        // A received value is kept: recomputing it would need its sender to send it again.
        // So is ring attention's output and log-sum-exp (its last merge): recomputing them
        // would run the ring again.
        let ring_out = matches!(&node.op, crate::Op::RingMerge(m) if m.backward.is_some());
        let allowed = match mode {
            _ if matches!(node.op, crate::Op::Recv(..)) || ring_out => false,
            CkptMode::None => false,
            CkptMode::Selective => !node.op.kept_by_selective(),
            CkptMode::Full => true,
        };
        for (k, &o) in node.outputs.iter().enumerate() {
            if node.op.output_alias(k).is_some() {
                continue; // a view: its base's buffer decides
            }
            droppable[o.index()] = allowed;
            seg_of[o.index()] = Some(ckpt.segment(b));
        }
    }
    // A value no backward node reads is dropped too: it dies after the forward pass anyway,
    // and if a recomputation needs it, it must be recomputed rather than kept alive for it.
    for node in &g.nodes {
        if node.phase != Phase::Backward {
            continue;
        }
        for &t in &node.inputs {
            let r = root[t.index()].index();
            let same = match (seg_of[r], node.block) {
                (Some(s), Some(b)) => s == ckpt.segment(b),
                _ => false,
            };
            if !same {
                droppable[r] = false;
            }
        }
    }
    (0..nt).map(|t| droppable[t] && root[t].index() == t).collect()
}

/// Rewrites `tg` so the blocks checkpoint as `ckpt` says. With nothing to drop the graph is
/// returned unchanged (cloned).
pub fn rematerialize(tg: &TrainingGraph, ckpt: &Checkpointing) -> Result<TrainingGraph> {
    if ckpt.is_none() {
        return Ok(tg.clone());
    }
    let g = &tg.graph;
    let root = buffer_roots(g);
    let dropped = dropped_buffers(g, ckpt);
    let is_dropped = |t: TensorId| dropped[root[t.index()].index()];

    // Room for the recomputed forward too: each forward node is recomputed at most once (its
    // outputs are memoised), so the forward's size bounds the copies. Reserving the bound is
    // free (untouched capacity is never faulted in); growing past a smaller guess copied the
    // whole node list and faulted in its new pages (7% of the planner's samples on
    // DeepSeek-V3, a third of its system time).
    let (fwd_nodes, fwd_tensors) = g
        .nodes
        .iter()
        .filter(|n| matches!(n.phase, Phase::Forward | Phase::Recompute))
        .fold((0, 0), |(n, t), node| (n + 1, t + node.outputs.len()));
    let mut r = Rewriter {
        g,
        b: Builder::from_graph(Graph::with_capacity(
            g.nodes.len() + fwd_nodes,
            g.tensors.len() + fwd_tensors,
        )),
        map: vec![None; g.tensors.len()],
        memo: vec![None; g.tensors.len()],
    };
    for s in 1..g.num_scopes() {
        r.b.graph.intern_scope(g.scope_name(ScopeId(s as u32)));
    }
    for node in &g.nodes {
        let mut ins = Vec::with_capacity(node.inputs.len());
        for &t in &node.inputs {
            ins.push(if node.phase == Phase::Backward && is_dropped(t) {
                r.recompute(t, &is_dropped)?
            } else {
                r.mapped(t)?
            });
        }
        let outs = r.push(node, node.phase, &ins)?;
        for (&o, n) in node.outputs.iter().zip(outs) {
            r.map[o.index()] = Some(n);
        }
    }
    let Rewriter { b, map, .. } = r;
    tg.try_remap(b.finish(), |t| mapped_in(&map, t))
}

/// `t`'s copy in the rewritten graph.
fn mapped_in(map: &[Option<TensorId>], t: TensorId) -> Result<TensorId> {
    map[t.index()].ok_or_else(|| {
        IrError::Graph(format!("checkpointing: {} is read before it is made", t.index()))
    })
}

struct Rewriter<'a> {
    g: &'a Graph,
    b: Builder,
    /// Old tensor → its copy in the new graph (as first computed).
    map: Vec<Option<TensorId>>,
    /// Old tensor → its recomputed copy (dropped values only).
    memo: Vec<Option<TensorId>>,
}

impl Rewriter<'_> {
    fn mapped(&self, t: TensorId) -> Result<TensorId> {
        mapped_in(&self.map, t)
    }

    fn push(&mut self, node: &Node, phase: Phase, ins: &[TensorId]) -> Result<TensorIds> {
        self.b.set_scope_id(node.scope);
        self.b.set_block(node.block);
        self.b.set_phase(phase);
        self.b.push_like(self.g, node, node.op.clone(), ins)
    }

    /// The recomputed copy of dropped value `t`, cloning its producers back to kept values.
    fn recompute(
        &mut self,
        t: TensorId,
        is_dropped: &dyn Fn(TensorId) -> bool,
    ) -> Result<TensorId> {
        if let Some(c) = self.memo[t.index()] {
            return Ok(c);
        }
        let producer = self.g.tensor(t).producer;
        let node = self.g.node(producer);
        let mut ins = Vec::with_capacity(node.inputs.len());
        for &u in &node.inputs {
            ins.push(if is_dropped(u) { self.recompute(u, is_dropped)? } else { self.mapped(u)? });
        }
        let outs = self.push(node, Phase::Recompute, &ins)?;
        for (&o, n) in node.outputs.iter().zip(outs) {
            self.memo[o.index()] = Some(n);
        }
        self.memo[t.index()]
            .ok_or_else(|| IrError::Graph("checkpointing: a recomputed node lost an output".into()))
    }
}
