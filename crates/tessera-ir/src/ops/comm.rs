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
