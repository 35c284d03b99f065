//! Which ILP decisions the blocks of a model share: a repeated block's ops take the decisions
//! of the same ops in an earlier block alike, so the strategy ILP grows with the distinct
//! block structures, not with the depth ([`block_sharing`], used by [`super::space`]).

use std::collections::HashMap;
use tessera_ir::{Graph, TensorId, TensorMeta};

/// The metas of `ts`, in order.
pub(super) fn metas<'a>(g: &'a Graph, ts: &[TensorId]) -> Vec<&'a TensorMeta> {
    ts.iter().map(|&t| g.meta(t)).collect()
}

/// Block sharing: per node, the node whose decision it copies (itself if none). A block whose
/// ops (op, input and output shapes, in order) are those of an earlier block copies the first
/// such block op by op; any other block copies the first block position by position where the
/// k-th ops agree. Models whose blocks are all alike (dense decoders) share every block with
/// the first; a mixture of experts whose first layers are dense (DeepSeek-V3's
/// `first_k_dense_replace`) shares its sparse layers with the first sparse one — not only
/// their attention with the first dense layer, which left ~40 decisions per sparse layer.
pub(super) fn block_sharing(g: &Graph) -> Vec<usize> {
    let n = g.nodes.len();
    let mut rep: Vec<usize> = (0..n).collect();
    // Each block's non-leaf nodes, in order, blocks in order of appearance.
    let mut order: Vec<u32> = Vec::new();
    let mut members: HashMap<u32, Vec<usize>> = HashMap::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let Some(b) = node.block else { continue };
        if node.op.is_leaf() {
            continue;
        }
        members
            .entry(b)
            .or_insert_with(|| {
                order.push(b);
                Vec::new()
            })
            .push(i);
    }
    let same = |r: usize, i: usize| {
        let (a, node) = (&g.nodes[r], &g.nodes[i]);
        a.op == node.op
            && metas(g, &a.inputs) == metas(g, &node.inputs)
            && metas(g, &a.outputs) == metas(g, &node.outputs)
    };
    // Blocks that copy no earlier block whole: the first block, then each new structure.
    let mut leaders: Vec<&[usize]> = Vec::new();
    for b in &order {
        let nodes = &members[b];
        let whole = leaders
            .iter()
            .skip(1)
            .find(|l| l.len() == nodes.len() && l.iter().zip(nodes).all(|(&r, &i)| same(r, i)));
        match (whole, leaders.first()) {
            (Some(l), _) => {
                for (&r, &i) in l.iter().zip(nodes) {
                    rep[i] = rep[r];
                }
            }
            (None, Some(first)) => {
                for (&r, &i) in first.iter().zip(nodes) {
                    if same(r, i) {
                        rep[i] = r;
                    }
                }
                // A block the first copies whole is no new structure.
                let copies_first = first.len() == nodes.len() && nodes.iter().all(|&i| rep[i] != i);
                if !copies_first {
                    leaders.push(nodes);
                }
            }
            (None, None) => leaders.push(nodes),
        }
    }
    rep
}
