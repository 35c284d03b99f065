//! Ring attention's lowering (`cp=ring`, [`crate::context`]) with an online merge: an
//! attention whose q, k and v arrive sequence-split over the cp axis becomes `cp` block
//! attentions, each folded into a running output and log-sum-exp as its K/V block arrives
//! ([`Op::RingMerge`]), so one block's partials are live at a time. The device's own K/V block
//! is step 0; before each later step the block it holds goes on to the next device of the
//! ring (`Send`, a peer one place after it) and the previous device's arrives (`Recv`, one
//! place before). The block attentions read global positions from their [`RingBlock`]
//! (zig-zag chunks: every device the same causal work). Only the KV heads travel (k and v as
//! the model's projections make them, before any grouping).
//!
//! The backward is the last merge's VJP (`tessera_ir::ops::ring`), FlashAttention's over
//! blocks: from the saved final output and log-sum-exp it recomputes each block's share as
//! the K/V blocks go around the ring again, dQ summed locally and dK/dV travelling with their
//! blocks back to their owners. Nothing of the chain is saved for the backward: the received
//! blocks and partial outputs die within the forward. Every transfer is a Program node on its
//! own tag (reserved here for both passes), so the memory simulation charges the received
//! blocks and `lower/time.rs` counts and prices them.

use crate::{PlanError, Result};
use tessera_ir::{AttentionSpec, Builder, Op, P2p, RingBackward, RingBlock, RingMerge, TensorId};

/// The first tag of ring transfers: above the pipeline's boundary tags (numbered from 1), so
/// a plan with both never mixes their streams.
const FIRST_TAG: u32 = 16_384;

/// Numbers a Program's ring transfers: one tag each (ring transfers are not differentiated).
#[derive(Clone, Debug)]
pub(crate) struct RingTags(u32);

impl Default for RingTags {
    fn default() -> Self {
        RingTags(FIRST_TAG)
    }
}

impl RingTags {
    /// The first of `n` fresh tags.
    fn reserve(&mut self, n: u32) -> Result<u32> {
        let tag = self.0;
        if tag + n > tessera_comm_max_tag() + 1 {
            return Err(PlanError::Invalid(format!(
                "ring attention needs more than {} transfers per step: too many layers × cp \
                 steps for the transport's tags; use cp=a2a or a smaller cp",
                tessera_comm_max_tag() + 1 - FIRST_TAG
            )));
        }
        self.0 += n;
        Ok(tag)
    }
}

/// The largest message tag every transport accepts (`tessera_comm::communicator::MAX_TAG`;
/// the planner does not depend on the transport crate).
const fn tessera_comm_max_tag() -> u32 {
    32_751
}

/// The ring's lowering of one attention `a` over local `q`, `k`, `v` (`[B, S/cp, H|Hkv, D]`)
/// on cp axis `axis` of `size` devices: the merged output and log-sum-exp (the attention's
/// second output; nothing in a training forward reads it, which [`check_lse_unread`] makes
/// sure of: its backward takes no gradient).
pub(crate) fn attention(
    b: &mut Builder,
    a: &AttentionSpec,
    inputs: &[TensorId],
    axis: usize,
    size: usize,
    tags: &mut RingTags,
) -> Result<Vec<TensorId>> {
    let internal = |e: tessera_ir::IrError| PlanError::Internal(format!("ring attention: {e}"));
    let [q, k, v] = *inputs else {
        return Err(PlanError::Internal(format!(
            "ring attention takes q, k, v ({} inputs given)",
            inputs.len()
        )));
    };
    if size < 2 {
        return Err(PlanError::Internal("ring attention over a ring of one device".into()));
    }
    let block = |step| AttentionSpec {
        ring: Some(RingBlock { axis, size, step, zigzag: true }),
        ..a.clone()
    };
    let first = b.push(Op::Attention(block(0)), &[q, k, v]).map_err(internal)?;
    let (mut o, mut lse) = (first[0], first[1]);
    let (mut kb, mut vb) = (k, v);
    for step in 1..size {
        // Pass the held block on, then take the previous device's (the same transfer seen
        // from the receiver: one tag, from one place before).
        let mut pass = |x: TensorId, b: &mut Builder| -> Result<TensorId> {
            let tag = tags.reserve(1)?;
            let p = P2p { axis, peer: 1, tag, grad_tag: tag, ring: true };
            let meta = b.meta(x).clone();
            b.push(Op::Send(p), &[x]).map_err(internal)?;
            b.push1(Op::Recv(P2p { peer: size - 1, ..p }, meta), &[]).map_err(internal)
        };
        kb = pass(kb, b)?;
        vb = pass(vb, b)?;
        let part = b.push(Op::Attention(block(step)), &[q, kb, vb]).map_err(internal)?;
        let mut merge_in = vec![o, lse, part[0], part[1]];
        let backward = if step + 1 == size {
            merge_in.extend([q, k, v]);
            let first_tag = tags.reserve(RingBackward::transfers(size))?;
            Some(RingBackward { attention: block(0), first_tag })
        } else {
            None
        };
        let merged = b.push(Op::RingMerge(RingMerge { backward }), &merge_in).map_err(internal)?;
        (o, lse) = (merged[0], merged[1]);
    }
    Ok(vec![o, lse])
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
            "{}: cp=ring's backward takes no gradient through attention's log-sum-exp, which \
             this model reads; use cp=a2a",
            g.scope_name(n.scope)
        ))),
        _ => Ok(()),
    }
}
