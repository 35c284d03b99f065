//! Embedding lookup (gather) and its scatter-add backward.

use super::{expect_float, expect_inputs, expect_int, Flops, Op};
use crate::autodiff::{Grad, VjpCtx};
use crate::dist::ShardOf;
use crate::{Result, Shape, TensorMeta};

pub(crate) fn infer(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    expect_float(x[0], "table")?;
    expect_int(x[1], "ids")?;
    if x[0].shape.rank() != 2 {
        return Err(format!("table {} must be [num_embeddings, dim]", x[0]));
    }
    let mut dims = x[1].shape.0.clone();
    dims.push(x[0].shape.dim(1));
    Ok(vec![TensorMeta { shape: Shape(dims), dtype: x[0].dtype }])
}

pub(crate) fn infer_backward(
    x: &[&TensorMeta],
    num_embeddings: usize,
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    expect_int(x[0], "ids")?;
    let ids = x[0].shape.dims();
    let dy = x[1].shape.dims();
    if dy.len() != ids.len() + 1 || &dy[..ids.len()] != ids {
        return Err(format!("dy {} must be ids' shape {} plus one dim", x[1], x[0].shape));
    }
    Ok(vec![TensorMeta::new([num_embeddings, x[1].shape.last()], x[1].dtype)])
}

/// One add per gathered element.
pub(crate) fn flops_backward(x: &[&TensorMeta]) -> Flops {
    Flops::other(x[1].numel())
}

/// The table's gradient: this device's rows of it when the table is a vocabulary shard.
pub(crate) fn vjp(cx: &mut VjpCtx<'_>, rows: Option<ShardOf>) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let num_embeddings = cx.b.graph.shape(cx.x(0)).dim(0);
    let g = cx.b.push1(Op::EmbeddingBackward { num_embeddings, rows }, &[cx.x(1), dy])?;
    Ok(vec![Some(Grad::Full(g)), None])
}
