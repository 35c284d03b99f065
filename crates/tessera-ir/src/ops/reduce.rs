//! Reductions and softmax: shape inference, FLOPs and VJPs.

use super::{expect_float, expect_inputs, expect_same, Flops, Op, ReduceOp};
use crate::autodiff::{Grad, VjpCtx};
use crate::{Result, Shape, TensorMeta};

/// Output shape of reducing `dims` of `shape`.
pub fn reduced_shape(shape: &Shape, dims: &[usize], keepdim: bool) -> Shape {
    let mut out = Vec::with_capacity(shape.rank());
    for (i, &d) in shape.dims().iter().enumerate() {
        if dims.contains(&i) {
            if keepdim {
                out.push(1);
            }
        } else {
            out.push(d);
        }
    }
    Shape::from(out)
}

fn check_dims(m: &TensorMeta, dims: &[usize]) -> Result<(), String> {
    for (i, &d) in dims.iter().enumerate() {
        if d >= m.shape.rank() {
            return Err(format!("reduce dim {d} out of range for rank {}", m.shape.rank()));
        }
        if dims[..i].contains(&d) {
            return Err(format!("reduce dim {d} given twice"));
        }
    }
    Ok(())
}

pub(crate) fn infer_reduce(
    x: &[&TensorMeta],
    _op: ReduceOp,
    dims: &[usize],
    keepdim: bool,
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    expect_float(x[0], "operand")?;
    check_dims(x[0], dims)?;
    Ok(vec![TensorMeta { shape: reduced_shape(&x[0].shape, dims, keepdim), dtype: x[0].dtype }])
}

pub(crate) fn infer_reduce_backward(
    x: &[&TensorMeta],
    _op: ReduceOp,
    dims: &[usize],
    keepdim: bool,
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    check_dims(x[0], dims)?;
    let want = reduced_shape(&x[0].shape, dims, keepdim);
    if x[1].shape != want {
        return Err(format!("dy {} must have the reduced shape {want}", x[1]));
    }
    Ok(vec![TensorMeta { shape: x[0].shape.clone(), dtype: x[1].dtype }])
}

pub(crate) fn infer_softmax(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    expect_float(x[0], "operand")?;
    if x[0].shape.rank() == 0 {
        return Err("softmax needs at least one dim".into());
    }
    Ok(vec![x[0].clone()])
}

pub(crate) fn infer_softmax_backward(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    expect_same(x[0], x[1], "y and dy")?;
    Ok(vec![x[0].clone()])
}

pub(crate) fn flops_reduce(x: &[&TensorMeta]) -> Flops {
    Flops::other(x[0].numel())
}
pub(crate) fn flops_reduce_backward(y: &[&TensorMeta]) -> Flops {
    Flops::other(y[0].numel())
}
/// max, subtract, exp, sum, divide.
pub(crate) fn flops_softmax(y: &[&TensorMeta]) -> Flops {
    Flops::other(5 * y[0].numel())
}
/// dx = y·(dy − Σ y·dy).
pub(crate) fn flops_softmax_backward(y: &[&TensorMeta]) -> Flops {
    Flops::other(4 * y[0].numel())
}

pub(crate) fn vjp_reduce(
    cx: &mut VjpCtx<'_>,
    op: ReduceOp,
    dims: &[usize],
    keepdim: bool,
) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let dx = cx.b.push1(Op::ReduceBackward { op, dims: dims.to_vec(), keepdim }, &[cx.x(0), dy])?;
    Ok(vec![Some(Grad::Full(dx))])
}

pub(crate) fn vjp_softmax(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let dx = cx.b.push1(Op::SoftmaxBackward, &[cx.y(0), dy])?;
    Ok(vec![Some(Grad::Full(dx))])
}
