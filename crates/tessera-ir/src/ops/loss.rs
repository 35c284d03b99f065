//! Fused softmax cross-entropy: saves only the per-row log-sum-exp (the logits are needed
//! anyway), never a probability matrix.

use super::{expect_float, expect_inputs, expect_int, Flops, Op};
use crate::autodiff::{Grad, VjpCtx};
use crate::{DType, Result, Shape, TensorMeta};

/// `sharded`: the vocabulary-parallel form, whose third input is each row's log-sum-exp over
/// every class.
pub(crate) fn infer(x: &[&TensorMeta], sharded: bool) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, if sharded { 3 } else { 2 })?;
    expect_float(x[0], "logits")?;
    expect_int(x[1], "targets")?;
    let l = x[0].shape.dims();
    if l.len() < 2 || &l[..l.len() - 1] != x[1].shape.dims() {
        return Err(format!("logits {} must be targets' shape {} plus a class dim", x[0], x[1]));
    }
    if sharded && (x[2].shape != x[1].shape || x[2].dtype != DType::F32) {
        return Err(format!("logsumexp {} must be f32 of the targets' shape {}", x[2], x[1]));
    }
    Ok(vec![
        TensorMeta::new(Shape::scalar(), DType::F32),
        TensorMeta { shape: x[1].shape.clone(), dtype: DType::F32 },
    ])
}

pub(crate) fn infer_backward(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 4)?;
    infer(&x[..2], false)?;
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

/// `[x [.., n]]` → `[..] f32`.
pub(crate) fn infer_logsumexp(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    expect_float(x[0], "operand")?;
    let d = x[0].shape.dims();
    if d.is_empty() {
        return Err("logsumexp needs at least one dim".into());
    }
    Ok(vec![TensorMeta::new(Shape::from(d[..d.len() - 1].to_vec()), DType::F32)])
}

/// max, exp, sum per element; a log per row.
pub(crate) fn flops_logsumexp(x: &[&TensorMeta]) -> Flops {
    Flops::other(3 * x[0].numel())
}

/// `dx = exp(x − y) · dy`, the softmax of the row times the row's gradient.
pub(crate) fn vjp_logsumexp(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let x = cx.x(0);
    let dtype = cx.b.dtype(x);
    let shape = cx.b.shape(x).clone();
    let mut keep = shape.dims().to_vec();
    if let Some(last) = keep.last_mut() {
        *last = 1;
    }
    let x32 = if dtype == DType::F32 { x } else { cx.b.cast(x, DType::F32)? };
    let y = cx.b.reshape(cx.y(0), keep.clone())?;
    let y = cx.b.expand(y, shape.clone())?;
    let centred = cx.b.sub(x32, y)?;
    let p = cx.b.unary(crate::UnaryOp::Exp, centred)?;
    let dy = cx.b.reshape(dy, keep)?;
    let dy = cx.b.expand(dy, shape)?;
    let mut dx = cx.b.mul(p, dy)?;
    if dtype != DType::F32 {
        dx = cx.b.cast(dx, dtype)?;
    }
    Ok(vec![Some(Grad::Full(dx))])
}

pub(crate) fn vjp(
    cx: &mut VjpCtx<'_>,
    ignore_index: Option<i64>,
    sum: bool,
    classes: &Option<crate::dist::ShardOf>,
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
        Op::CrossEntropyBackward { ignore_index, sum, classes: classes.clone() },
        &[cx.x(0), cx.x(1), cx.y(1), dloss],
    )?;
    let mut grads = vec![Some(Grad::Full(g)), None];
    if classes.is_some() {
        grads.push(None); // the log-sum-exp: see `Op::CrossEntropy`
    }
    Ok(grads)
}
