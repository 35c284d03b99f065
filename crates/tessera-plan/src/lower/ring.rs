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
//! own tag ([`RingTags`]: the same tags for every ring of a Program), so the memory
//! simulation charges the received blocks and `lower/time.rs` counts and prices them.

use crate::{PlanError, Result};
use tessera_ir::{AttentionSpec, Builder, Op, P2p, RingBackward, RingBlock, RingMerge, TensorId};

/// The first tag of ring transfers: above the pipeline's boundary tags (numbered from 1), so
/// a plan with both never mixes their streams.
const FIRST_TAG: u32 = 16_384;

/// The ring's tags, the same for every ring of a Program: forward transfer `j` (K then V at
/// each later step) on tag `FIRST_TAG + j`, the backward's from `FIRST_TAG + 2·(cp − 1)` on.
///
/// Reusing them from one ring (layer, micro-batch) to the next cannot mix two transfers up:
/// every transport keeps one FIFO stream per (sender, receiver, tag); every device of a
/// ring runs the same Program in order; and on each tag a ring's `Send` is followed by its
/// own `Recv` before the tag's next `Send` ([`check_streams`] verifies this on every lowered
/// Program). So the k-th message a device receives on a tag is the k-th its ring predecessor
/// sent on it: the transfer the Program pairs it with. The tags a Program needs are those
/// of one ring, whatever its layers and micro-batches.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingTags {
    size: usize,
}

impl RingTags {
    /// The tags of a ring of `size` devices, or an error when one ring needs more than the
    /// transport's tags above [`FIRST_TAG`] (past [`MAX_RING`] devices).
    pub(crate) fn new(size: usize) -> Result<RingTags> {
        if size > MAX_RING {
            return Err(PlanError::Invalid(format!(
                "ring attention over {size} devices needs 6·(cp − 1) = {} message tags per \
                 attention, more than the transport's {} above the pipeline's; use cp=a2a or \
                 cp ≤ {MAX_RING}",
                6 * (size - 1),
                tessera_comm_max_tag() + 1 - FIRST_TAG
            )));
        }
        Ok(RingTags { size })
    }

    /// The tag of the forward's `j`-th transfer (`j < 2·(cp − 1)`).
    fn forward(self, j: usize) -> u32 {
        FIRST_TAG + j as u32
    }

    /// The first of the backward's [`RingBackward::transfers`] tags.
    fn backward(self) -> u32 {
        FIRST_TAG + 2 * self.size.saturating_sub(1) as u32
    }
}

/// The largest ring whose `6·(cp − 1)` tags per attention (forward and backward) fit the
/// transport's tags above [`FIRST_TAG`]: 2,729 devices. The search tries ring attention only
/// up to it ([`supports`]).
pub const MAX_RING: usize = ((tessera_comm_max_tag() + 1 - FIRST_TAG) / 6) as usize + 1;

/// Whether ring attention can run over `cp` devices (its tags fit the transport's).
pub fn supports(cp: usize) -> bool {
    cp <= MAX_RING
}

/// The largest message tag every transport accepts (`tessera_comm::communicator::MAX_TAG`;
/// the planner does not depend on the transport crate).
const fn tessera_comm_max_tag() -> u32 {
    32_751
}

/// Errs unless every ring transfer of `g` pairs in Program order: on each (mesh axis, tag),
/// ring `Send`s and `Recv`s alternate, each `Recv` from the device one place before and of
/// the shape and type its `Send` passed on (see [`RingTags`]: what makes reused tags safe).
pub(crate) fn check_streams(g: &tessera_ir::Graph) -> Result<()> {
    let mut open: std::collections::HashMap<(usize, u32), tessera_ir::NodeId> = Default::default();
    for (i, n) in g.nodes.iter().enumerate() {
        let bad = |why: &str| {
            Err(PlanError::Internal(format!(
                "ring transfers out of order at node {i} ({}): {why}",
                g.scope_name(n.scope)
            )))
        };
        match &n.op {
            Op::Send(p) if p.ring => {
                let waiting = open.insert((p.axis, p.tag), tessera_ir::NodeId(i as u32));
                if waiting.is_some() {
                    return bad(&format!("a second send on tag {} before a receive", p.tag));
                }
            }
            Op::Recv(p, meta) if p.ring => match open.remove(&(p.axis, p.tag)) {
                Some(s) if g.meta(g.node(s).inputs[0]) == meta => {}
                Some(_) => return bad(&format!("tag {} receives another shape", p.tag)),
                None => return bad(&format!("a receive on tag {} with no send", p.tag)),
            },
            _ => {}
        }
    }
    match open.keys().next() {
        Some((_, tag)) => Err(PlanError::Internal(format!(
            "ring transfers out of order: a send on tag {tag} is never received"
        ))),
        None => Ok(()),
    }
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
    tags: RingTags,
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
    let mut transfer = 0;
    for step in 1..size {
        // Pass the held block on, then take the previous device's (the same transfer seen
        // from the receiver: one tag, from one place before).
        let mut pass = |x: TensorId, b: &mut Builder| -> Result<TensorId> {
            let tag = tags.forward(transfer);
            transfer += 1;
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
            Some(RingBackward { attention: block(0), first_tag: tags.backward() })
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

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_ir::DType;

    /// Ring transfers of `x` on `tags`, each a `Send` then its `Recv` unless `split` (every
    /// send first, then every receive).
    fn ring_graph(tags: &[u32], split: bool) -> tessera_ir::Graph {
        let mut b = Builder::new();
        let x = b.input("x", [2, 4], DType::F32);
        let meta = b.meta(x).clone();
        let p = |tag| P2p { axis: 0, peer: 1, tag, grad_tag: tag, ring: true };
        let recv = |b: &mut Builder, tag| {
            b.push1(Op::Recv(P2p { peer: 3, ..p(tag) }, meta.clone()), &[]).unwrap();
        };
        for &tag in tags {
            b.push(Op::Send(p(tag)), &[x]).unwrap();
            if !split {
                recv(&mut b, tag);
            }
        }
        if split {
            tags.iter().for_each(|&tag| recv(&mut b, tag));
        }
        b.finish()
    }

    #[test]
    fn reused_tags_pass_only_when_each_send_meets_its_receive_first() {
        // Two rings on the same two tags, each transfer received before the tag's next send.
        assert!(check_streams(&ring_graph(
            &[FIRST_TAG, FIRST_TAG + 1, FIRST_TAG, FIRST_TAG + 1],
            false
        ))
        .is_ok());
        // Distinct tags may wait: every stream has one message in flight.
        assert!(check_streams(&ring_graph(&[FIRST_TAG, FIRST_TAG + 1], true)).is_ok());
        // A tag sent twice before its first receive could hand the receiver the wrong block.
        let e = check_streams(&ring_graph(&[FIRST_TAG, FIRST_TAG], true)).unwrap_err();
        assert!(e.to_string().contains("a second send on tag 16384"), "{e}");
    }

    #[test]
    fn one_ring_fits_the_transports_tags_up_to_max_ring() {
        // The last tag of a ring of `cp` (its backward's last), for the largest ring and one more.
        let last = |cp: usize| FIRST_TAG + 6 * (cp as u32 - 1) - 1;
        assert_eq!(MAX_RING, 2729);
        assert!(
            last(MAX_RING) <= tessera_comm_max_tag() && last(MAX_RING + 1) > tessera_comm_max_tag()
        );
        let t = RingTags::new(MAX_RING).unwrap();
        assert_eq!(t.backward() + RingBackward::transfers(MAX_RING) - 1, last(MAX_RING));
        assert!(supports(128) && !supports(MAX_RING + 1));
        let e = RingTags::new(MAX_RING + 1).unwrap_err().to_string();
        assert!(e.contains("use cp=a2a or cp ≤ 2729"), "{e}");
    }
}
