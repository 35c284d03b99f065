//! Ring attention's online merge ([`Op::RingMerge`]): the running output and log-sum-exp of a
//! device's queries, merged block by block as K/V blocks arrive around the ring, and — on the
//! last merge of a ring — the whole ring's backward as its VJP.
//!
//! Forward (the planner's `lower/ring.rs`): step 0 is the device's own block (`Attention`
//! with `RingBlock::step` 0); before each later step the held K/V block goes to the next
//! device and the previous one's arrives (ring `Send`/`Recv`), its block attention runs and
//! one `RingMerge` folds it into the running pair, so one block's partials are live at a time.
//! Ring transfers are outside the autodiff (`P2p::ring`): nothing differentiates through the
//! chain, whose merges take no gradient.
//!
//! Backward (the last merge's VJP, FlashAttention's backward over blocks): with the final
//! output `O` and log-sum-exp `L` (the merge's own outputs, saved), every block's share of
//! the gradient is `AttentionBackward(q, k_s, v_s, O, L, dO)` — its probabilities are
//! `exp(S_s − L)`, the final softmax's. The K/V blocks go around the ring again; dQ sums
//! locally, and each block's dK/dV accumulators (started by the first device after its
//! owner) travel with it, one more step at the end to reach their owner, who adds its own
//! share. Transfers: `2·(cp − 1)` forward and `4·(cp − 1)` backward (Megatron-LM's count),
//! each on its own tag from [`RingBackward::first_tag`].

use super::{attention, Op, P2p};
use crate::autodiff::{Grad, VjpCtx};
use crate::{AttentionSpec, IrError, Result, RingBlock, TensorId, TensorMeta};
use serde::{Deserialize, Serialize};

/// A ring merge's parameters: `backward` on a ring's last merge only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RingMerge {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward: Option<RingBackward>,
}

/// What the last merge of a ring needs to run the ring's backward.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RingBackward {
    /// The attention of the device's own block (its `ring` at step 0): mask, scale, window.
    pub attention: AttentionSpec,
    /// The first of the [`RingBackward::transfers`] tags the backward's transfers use.
    pub first_tag: u32,
}

impl RingBackward {
    /// The backward's transfers of a ring of `size` devices: K, V, dK and dV `size − 1`
    /// times each.
    pub fn transfers(size: usize) -> u32 {
        (4 * size.saturating_sub(1)) as u32
    }
}

/// `[o_run, lse_run, o_s, lse_s]`, then `q, k, v` (the device's own) on a last merge →
/// `[o, lse]`.
pub(crate) fn infer(x: &[&TensorMeta], m: &RingMerge) -> Result<Vec<TensorMeta>, String> {
    let want = if m.backward.is_some() { 7 } else { 4 };
    super::expect_inputs(x, want)?;
    let o = attention::infer_merge(&x[..4])?.remove(0);
    if let Some(bw) = &m.backward {
        let fwd = attention::infer(&x[4..7], &bw.attention)?;
        if fwd[0] != o || &fwd[1] != x[1] {
            return Err(format!("ring_merge: q {} does not match the merged output {o}", x[4]));
        }
    }
    Ok(vec![o, x[1].clone()])
}

/// One two-pair merge and the log-sum-exp's update.
pub(crate) fn flops(x: &[&TensorMeta]) -> super::Flops {
    let mut f = attention::flops_merge(&x[..4.min(x.len())], false);
    f.other += 3 * x.get(1).map_or(0, |l| l.numel());
    f
}

/// The ring's backward (see the module doc).
pub(crate) fn vjp(cx: &mut VjpCtx<'_>, m: &RingMerge) -> Result<Vec<Option<Grad>>> {
    let n = cx.node_inputs();
    let Some(bw) = &m.backward else { return Ok(vec![None; n]) };
    if cx.dout[1].is_some() {
        return Err(IrError::Graph(
            "ring attention's log-sum-exp takes no gradient (nothing may read it)".into(),
        ));
    }
    let r = bw.attention.ring.ok_or_else(|| {
        IrError::Graph("ring_merge's backward attention has no ring block".into())
    })?;
    let dout = cx.dy(0)?;
    let (q, o, l) = (cx.x(4), cx.y(0), cx.y(1));
    let mut tag = bw.first_tag;
    // The held value goes to the next device; the previous device's arrives (one tag).
    let mut pass = |cx: &mut VjpCtx<'_>, x: TensorId| -> Result<TensorId> {
        let p = P2p { axis: r.axis, peer: 1, tag, grad_tag: tag, ring: true };
        tag += 1;
        let meta = cx.b.meta(x).clone();
        cx.b.push(Op::Send(p), &[x])?;
        cx.b.push1(Op::Recv(P2p { peer: r.size - 1, ..p }, meta), &[])
    };
    let (k, v) = (cx.x(5), cx.x(6));
    let spec = |step| AttentionSpec { ring: Some(RingBlock { step, ..r }), ..bw.attention.clone() };
    let own = cx.b.push(Op::AttentionBackward(spec(0)), &[q, k, v, o, l, dout])?;
    let (mut dq, mut kb, mut vb) = (own[0], k, v);
    // The accumulators of the block held: started by the first device after its owner.
    let mut acc: Option<(TensorId, TensorId)> = None;
    for step in 1..r.size {
        kb = pass(cx, kb)?;
        vb = pass(cx, vb)?;
        if let Some((dk, dv)) = acc {
            acc = Some((pass(cx, dk)?, pass(cx, dv)?));
        }
        let g = cx.b.push(Op::AttentionBackward(spec(step)), &[q, kb, vb, o, l, dout])?;
        dq = cx.b.add(dq, g[0])?;
        acc = Some(match acc {
            None => (g[1], g[2]),
            Some((dk, dv)) => (cx.b.add(dk, g[1])?, cx.b.add(dv, g[2])?),
        });
    }
    let (dk, dv) =
        acc.ok_or_else(|| IrError::Graph("ring attention over a ring of one device".into()))?;
    // The last block's accumulators belong to the next device: home, beside the own share.
    let (dk, dv) = (pass(cx, dk)?, pass(cx, dv)?);
    let (dk, dv) = (cx.b.add(own[1], dk)?, cx.b.add(own[2], dv)?);
    let mut grads = vec![None; n];
    grads[4] = Some(Grad::Full(dq));
    grads[5] = Some(Grad::Full(dk));
    grads[6] = Some(Grad::Full(dv));
    Ok(grads)
}
