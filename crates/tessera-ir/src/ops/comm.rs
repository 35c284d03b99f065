//! Collective communication steps. They enter a graph only when a plan is lowered to per-device
//! Programs (`tessera-plan`): a [`Op::Reshard`](super::Op::Reshard) node runs a sequence of
//! steps in the forward pass and, as its VJP, another sequence chosen by the planner for the
//! gradient (which may be a pending sum where the value was replicated).
//!
//! Shapes here are *local* (per device). A step acts over one mesh axis of `size` devices.

use super::{expect_inputs, Flops};
use crate::autodiff::{Grad, VjpCtx};
use crate::{Result, Shape, TensorMeta};
use serde::{Deserialize, Serialize};

/// What one step does to the local tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Collective {
    /// Sum a pending-sum (Partial) value over the axis; every device gets the total.
    AllReduce,
    /// Concatenate the axis' shards along `dim` (the local dim grows `size`×).
    AllGather { dim: usize },
    /// Sum a Partial value and keep this device's chunk of `dim` (shrinks `size`×).
    ReduceScatter { dim: usize },
    /// Re-split: chunk `split_dim` across the axis, concatenate received chunks on `concat_dim`.
    AllToAll { split_dim: usize, concat_dim: usize },
    /// Keep this device's chunk of `dim` of a replicated value (no communication).
    Shard { dim: usize },
}

/// One collective over one mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CommStep {
    #[serde(flatten)]
    pub op: Collective,
    /// Mesh axis the group spans.
    pub axis: usize,
    /// Devices in the group (the axis' size).
    pub size: usize,
}

impl CommStep {
    /// The local shape after this step.
    pub fn apply(&self, shape: &Shape) -> Result<Shape, String> {
        let mut d = shape.dims().to_vec();
        let n = self.size;
        let check = |d: &[usize], dim: usize| -> Result<(), String> {
            if dim >= d.len() {
                return Err(format!("{self:?}: dim {dim} out of range for {shape}"));
            }
            Ok(())
        };
        match self.op {
            Collective::AllReduce => {}
            Collective::AllGather { dim } => {
                check(&d, dim)?;
                d[dim] *= n;
            }
            Collective::ReduceScatter { dim } | Collective::Shard { dim } => {
                check(&d, dim)?;
                if !d[dim].is_multiple_of(n) {
                    return Err(format!("{self:?}: dim {dim} of {shape} not divisible by {n}"));
                }
                d[dim] /= n;
            }
            Collective::AllToAll { split_dim, concat_dim } => {
                check(&d, split_dim)?;
                check(&d, concat_dim)?;
                if !d[split_dim].is_multiple_of(n) {
                    return Err(format!(
                        "{self:?}: dim {split_dim} of {shape} not divisible by {n}"
                    ));
                }
                d[split_dim] /= n;
                d[concat_dim] *= n;
            }
        }
        Ok(Shape::new(d))
    }

    /// Bytes this device contributes (the size of its local input), the unit in which
    /// collectives are counted.
    pub fn payload_bytes(&self, input: &TensorMeta) -> u64 {
        match self.op {
            Collective::Shard { .. } => 0,
            Collective::AllReduce
            | Collective::AllGather { .. }
            | Collective::ReduceScatter { .. }
            | Collective::AllToAll { .. } => input.size_bytes(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self.op {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather { .. } => "all_gather",
            Collective::ReduceScatter { .. } => "reduce_scatter",
            Collective::AllToAll { .. } => "all_to_all",
            Collective::Shard { .. } => "shard",
        }
    }
}

/// A [`Op::Reshard`](super::Op::Reshard): `forward` steps now, `backward` steps on the gradient.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReshardSpec {
    pub forward: Vec<CommStep>,
    pub backward: Vec<CommStep>,
}

impl ReshardSpec {
    /// A forward pass that moves nothing is a view of its input.
    pub fn is_view(&self) -> bool {
        self.forward.is_empty()
    }
}

pub(crate) fn infer(x: &[&TensorMeta], spec: &ReshardSpec) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    let mut shape = x[0].shape.clone();
    for s in &spec.forward {
        shape = s.apply(&shape)?;
    }
    Ok(vec![TensorMeta { shape, dtype: x[0].dtype }])
}

pub(crate) fn flops(spec: &ReshardSpec, x: &[&TensorMeta]) -> Flops {
    // Reductions add one value per element received.
    let adds = spec
        .forward
        .iter()
        .filter(|s| matches!(s.op, Collective::AllReduce | Collective::ReduceScatter { .. }))
        .count() as u64;
    Flops::other(adds * x[0].numel())
}

pub(crate) fn vjp(cx: &mut VjpCtx<'_>, spec: &ReshardSpec) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let back = ReshardSpec { forward: spec.backward.clone(), backward: spec.forward.clone() };
    let g = cx.b.push1(super::Op::Reshard(back), &[dy])?;
    Ok(vec![Some(Grad::Full(g))])
}

/// A point-to-point transfer between pipeline stages: an [`Op::Send`](super::Op::Send) or
/// [`Op::Recv`](super::Op::Recv). The peer is the device at coordinate `peer` along mesh axis
/// `axis` (the pipeline axis), every other coordinate being this device's. Messages of one
/// `tag` between one pair arrive in the order sent; a boundary tensor has one tag for its
/// value and one (`grad_tag`) for its gradient going back, so the streams sharing a pair of
/// devices (several boundaries under interleaving, a parameter read by a later stage) never
/// have to agree on an order.
///
/// With `ring` (ring attention's neighbours, context parallelism's `cp=ring`), `peer` is an
/// offset instead: the device at coordinate `(c + peer) mod size` along `axis`, `c` this
/// device's — one Program for every device of the ring. Ring transfers are not
/// differentiated (the ring's lowering places the backward's own, see
/// [`super::ring`]); their `grad_tag` is unused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct P2p {
    pub axis: usize,
    pub peer: usize,
    pub tag: u32,
    pub grad_tag: u32,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ring: bool,
}

impl P2p {
    /// The transfer the gradient takes: the other way, on the gradient's tag.
    pub fn reversed(self) -> P2p {
        P2p { tag: self.grad_tag, grad_tag: self.tag, ..self }
    }
}

/// A send's output: a scalar f32 zero, the stand-in loss of a stage that ends in sends (its
/// backward pass starts from the gradients it receives, see [`vjp_send`]).
pub(crate) fn infer_send(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    Ok(vec![TensorMeta::new(Shape::scalar(), crate::DType::F32)])
}

pub(crate) fn infer_recv(x: &[&TensorMeta], meta: &TensorMeta) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 0)?;
    Ok(vec![meta.clone()])
}

/// The gradient of a sent value is received from the peer.
pub(crate) fn vjp_send(cx: &mut VjpCtx<'_>, p: P2p) -> Result<Vec<Option<Grad>>> {
    let meta = cx.b.meta(cx.inputs[0]).clone();
    let g = cx.b.push1(super::Op::Recv(p.reversed(), meta), &[])?;
    Ok(vec![Some(Grad::Full(g))])
}

/// The gradient of a received value goes back to the peer (zeros if nothing here used it).
pub(crate) fn vjp_recv(cx: &mut VjpCtx<'_>, p: P2p) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    cx.b.push(super::Op::Send(p.reversed()), &[dy])?;
    Ok(vec![])
}

/// A transfer between tiers keeps the value's meta.
pub(crate) fn infer_transfer(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    Ok(vec![x[0].clone()])
}

/// The gradient of a value moved to tier `to` goes back to tier `from`.
pub(crate) fn vjp_transfer(
    cx: &mut VjpCtx<'_>,
    from: crate::Tier,
    to: crate::Tier,
) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let g = cx.b.push1(super::Op::Transfer { from: to, to: from }, &[dy])?;
    Ok(vec![Some(Grad::Full(g))])
}
