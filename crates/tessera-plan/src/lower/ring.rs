//! Ring attention's lowering (`cp=ring`, [`crate::context`]): an attention whose q, k and v
//! arrive sequence-split over the cp axis becomes `cp` block attentions and one merge. The
//! device's own K/V block is step 0; before each later step the block it holds goes on to the
//! next device of the ring (`Send`, a peer one place after it) and the previous device's
//! arrives (`Recv`, one place before), so after `cp − 1` steps every device has seen every
//! block. The block attentions read global positions from their [`RingBlock`] (zig-zag
//! chunks: every device the same causal work), and [`Op::AttentionMerge`] combines their
//! partial outputs by log-sum-exp. Only the KV heads travel (k and v as the model's
//! projections make them, before any grouping). The backward is the autodiff's: a `Recv`'s
//! gradient is sent back to its sender and a `Send`'s received, so dK/dV travel the ring the
//! other way. The transfers are Program nodes, so the memory simulation charges the received
//! blocks and `lower/time.rs` counts and prices them.

use crate::{PlanError, Result};
use tessera_ir::{AttentionSpec, Builder, Op, P2p, RingBlock, TensorId};

/// The first tag of ring transfers: above the pipeline's boundary tags (numbered from 1), so
/// a plan with both never mixes their streams.
const FIRST_TAG: u32 = 16_384;

/// Numbers a Program's ring transfers: each has a tag for its value and one for its gradient.
#[derive(Clone, Debug)]
pub(crate) struct RingTags(u32);

impl Default for RingTags {
    fn default() -> Self {
        RingTags(FIRST_TAG)
    }
}

impl RingTags {
    fn next(&mut self, axis: usize, peer: usize) -> Result<P2p> {
        let tag = self.0;
        if tag + 1 > tessera_comm_max_tag() {
            return Err(PlanError::Invalid(format!(
                "ring attention needs more than {} transfers per step: too many layers × cp \
                 steps for the transport's tags; use cp=a2a or a smaller cp",
                (tessera_comm_max_tag() - FIRST_TAG) / 2
            )));
        }
        self.0 += 2;
        Ok(P2p { axis, peer, tag, grad_tag: tag + 1, ring: true })
    }
}

/// The largest message tag every transport accepts (`tessera_comm::communicator::MAX_TAG`;
/// the planner does not depend on the transport crate).
const fn tessera_comm_max_tag() -> u32 {
    32_751
}

/// The ring's lowering of one attention `a` over local `q`, `k`, `v` (`[B, S/cp, H|Hkv, D]`)
/// on cp axis `axis` of `size` devices: the merged output and the first block's log-sum-exp
/// (the attention's second output; nothing in a training forward reads it, which
/// [`check_lse_unread`] makes sure of).
pub(crate) fn attention(
    b: &mut Builder,
    a: &AttentionSpec,
    inputs: &[TensorId],
    axis: usize,
    size: usize,
    tags: &mut RingTags,
) -> Result<Vec<TensorId>> {
    let internal = |e: tessera_ir::IrError| PlanError::Internal(format!("ring attention: {e}"));
    let [q, k, v] = inputs else {
        return Err(PlanError::Internal(format!(
            "ring attention takes q, k, v ({} inputs given)",
            inputs.len()
        )));
    };
    let (mut k, mut v) = (*k, *v);
    let mut parts = Vec::with_capacity(2 * size);
    let mut first_lse = None;
    for step in 0..size {
        if step > 0 {
            // Pass the held block on, then take the previous device's.
            let mut pass = |x: TensorId, b: &mut Builder| -> Result<TensorId> {
                let meta = b.meta(x).clone();
                b.push(Op::Send(tags.next(axis, 1)?), &[x]).map_err(internal)?;
                // The same transfer seen from the receiver: the tag just used, from one
                // place before.
                b.push1(Op::Recv(tags.last(axis, size - 1), meta), &[]).map_err(internal)
            };
            k = pass(k, b)?;
            v = pass(v, b)?;
        }
        let mut spec = a.clone();
        spec.ring = Some(RingBlock { axis, size, step, zigzag: true });
        let out = b.push(Op::Attention(spec), &[*q, k, v]).map_err(internal)?;
        first_lse.get_or_insert(out[1]);
        parts.extend([out[0], out[1]]);
    }
    let o = b.push1(Op::AttentionMerge, &parts).map_err(internal)?;
    let lse = first_lse.ok_or_else(|| PlanError::Internal("a ring of no devices".into()))?;
    Ok(vec![o, lse])
}

impl RingTags {
    /// The transfer [`RingTags::next`] numbered last, addressed to `peer` places after.
    fn last(&self, axis: usize, peer: usize) -> P2p {
        let tag = self.0 - 2;
        P2p { axis, peer, tag, grad_tag: tag + 1, ring: true }
    }
}

/// Errs when a graph reads an attention's log-sum-exp in its forward: the ring's lowering
/// gives only its output exactly.
pub(crate) fn check_lse_unread(
    g: &tessera_ir::Graph,
    node: tessera_ir::NodeId,
    readers: &[Vec<tessera_ir::NodeId>],
) -> Result<()> {
    let n = g.node(node);
    match n.outputs.get(1) {
        Some(lse) if !readers[lse.index()].is_empty() => Err(PlanError::Invalid(format!(
            "{}: cp=ring merges attention's outputs but not its log-sum-exp, which this model \
             reads; use cp=a2a",
            g.scope_name(n.scope)
        ))),
        _ => Ok(()),
    }
}
