//! FLOP accounting per phase.

use serde::Serialize;
use tessera_ir::{Graph, Phase, TensorMeta};

/// FLOPs of one training step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FlopReport {
    /// Every forward op.
    pub forward: u64,
    /// Every backward op.
    pub backward: u64,
    /// Forward ops re-run in the backward pass (activation checkpointing).
    pub recompute: u64,
    /// Gradient norm, clipping and AdamW.
    pub optimizer: u64,
    /// forward + backward + recompute + optimizer.
    pub total: u64,
    /// Matmuls and attention products, forward + backward (the MFU numerator: recomputation
    /// is overhead, not model FLOPs).
    pub matmul: u64,
    pub matmul_forward: u64,
    pub matmul_backward: u64,
}

/// Sums each node's FLOPs into its phase.
pub fn count_flops(graph: &Graph) -> FlopReport {
    let mut r = FlopReport::default();
    let mut x: Vec<&TensorMeta> = Vec::with_capacity(8);
    let mut y: Vec<&TensorMeta> = Vec::with_capacity(4);
    for node in &graph.nodes {
        x.clear();
        y.clear();
        x.extend(node.inputs.iter().map(|&t| graph.meta(t)));
        y.extend(node.outputs.iter().map(|&t| graph.meta(t)));
        let f = node.op.flops(&x, &y);
        // Saturating: a multi-million-token step's attention alone nears u64's 1.8e19.
        let add = |a: &mut u64, b: u64| *a = a.saturating_add(b);
        match node.phase {
            Phase::Forward => {
                add(&mut r.forward, f.total());
                add(&mut r.matmul_forward, f.matmul);
            }
            Phase::Backward => {
                add(&mut r.backward, f.total());
                add(&mut r.matmul_backward, f.matmul);
            }
            Phase::Recompute => add(&mut r.recompute, f.total()),
            Phase::Optimizer => add(&mut r.optimizer, f.total()),
        }
    }
    r.total =
        [r.backward, r.recompute, r.optimizer].iter().fold(r.forward, |t, &x| t.saturating_add(x));
    r.matmul = r.matmul_forward.saturating_add(r.matmul_backward);
    r
}
