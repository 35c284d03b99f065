//! Fused softmax cross-entropy: saves only the per-row log-sum-exp (the logits are needed
//! anyway), never a probability matrix.

use super::{expect_float, expect_inputs, expect_int, Flops, Op};
use crate::autodiff::{Grad, VjpCtx};
use crate::{DType, Result, Shape, TensorMeta};

pub(crate) fn infer(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    expect_float(x[0], "logits")?;
    expect_int(x[1], "targets")?;
    let l = x[0].shape.dims();
    if l.len() < 2 || &l[..l.len() - 1] != x[1].shape.dims() {
        return Err(format!("logits {} must be targets' shape {} plus a class dim", x[0], x[1]));
    }
    Ok(vec![
        TensorMeta::new(Shape::scalar(), DType::F32),
        TensorMeta { shape: x[1].shape.clone(), dtype: DType::F32 },
    ])
}

pub(crate) fn infer_backward(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 4)?;
    infer(&x[..2])?;
    if x[2].shape != x[1].shape || x[3].shape.rank() != 0 {
        return Err(format!("logsumexp {} / dloss {} have wrong shapes", x[2], x[3]));
    }
    Ok(vec![x[0].clone()])
}

/// max, exp, sum, log per logit, plus the pick and mean.
pub(crate) fn flops(x: &[&TensorMeta]) -> Flops {
    Flops::other(4 * x[0].numel() + 2 * x[1].numel())
}
/// softmax from the saved logsumexp, minus one-hot, times dloss/N.
pub(crate) fn flops_backward(x: &[&TensorMeta]) -> Flops {
    Flops::other(4 * x[0].numel())
}

pub(crate) fn vjp(
    cx: &mut VjpCtx<'_>,
    ignore_index: Option<i64>,
    sum: bool,
) -> Result<Vec<Option<Grad>>> {
    if cx.dout[1].is_some() {
        return Err(crate::IrError::Graph(
            "cross_entropy's logsumexp output is saved for the backward pass and has no VJP; \
             a loss that uses it (e.g. a z-loss) needs its own logsumexp"
                .into(),
        ));
    }
    let dloss = cx.dy(0)?;
    let g = cx.b.push1(
        Op::CrossEntropyBackward { ignore_index, sum },
        &[cx.x(0), cx.x(1), cx.y(1), dloss],
    )?;
    Ok(vec![Some(Grad::Full(g)), None])
}
