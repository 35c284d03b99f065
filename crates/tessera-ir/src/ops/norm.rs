//! LayerNorm and RMSNorm over the last dim: shape inference, FLOPs and VJPs. Their backward
//! ops recompute the row statistics from `x` (one pass, cheap) rather than saving them.

use super::{expect_float, expect_inputs, Flops, Op};
use crate::autodiff::{Grad, VjpCtx};
use crate::{Result, TensorMeta};

fn check_affine(x: &TensorMeta, w: &TensorMeta, what: &str) -> Result<(), String> {
    expect_float(x, "x")?;
    if x.shape.rank() == 0 || w.shape.dims() != [x.shape.last()] {
        return Err(format!("{what} {} must be [{}] to match x {}", w, x.shape.last(), x));
    }
    Ok(())
}

pub(crate) fn infer_layer_norm(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 3)?;
    check_affine(x[0], x[1], "weight")?;
    check_affine(x[0], x[2], "bias")?;
    Ok(vec![x[0].clone()])
}

pub(crate) fn infer_layer_norm_backward(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 3)?;
    check_affine(x[0], x[1], "weight")?;
    if x[2].shape != x[0].shape {
        return Err(format!("dy {} must have x's shape {}", x[2], x[0].shape));
    }
    // Weight gradients take the weight's dtype (a bf16 norm may normalise an fp32 stream).
    let w = TensorMeta { shape: x[1].shape.clone(), dtype: x[1].dtype };
    Ok(vec![TensorMeta { shape: x[0].shape.clone(), dtype: x[2].dtype }, w.clone(), w])
}

pub(crate) fn infer_rms_norm(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    check_affine(x[0], x[1], "weight")?;
    Ok(vec![x[0].clone()])
}

pub(crate) fn infer_rms_norm_backward(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 3)?;
    check_affine(x[0], x[1], "weight")?;
    if x[2].shape != x[0].shape {
        return Err(format!("dy {} must have x's shape {}", x[2], x[0].shape));
    }
    let w = TensorMeta { shape: x[1].shape.clone(), dtype: x[1].dtype };
    Ok(vec![TensorMeta { shape: x[0].shape.clone(), dtype: x[2].dtype }, w])
}

/// mean, centre, square, variance, normalise, scale, shift.
pub(crate) fn flops_layer_norm(x: &[&TensorMeta]) -> Flops {
    Flops::other(8 * x[0].numel())
}
pub(crate) fn flops_layer_norm_backward(x: &[&TensorMeta]) -> Flops {
    Flops::other(14 * x[0].numel())
}
pub(crate) fn flops_rms_norm(x: &[&TensorMeta]) -> Flops {
    Flops::other(5 * x[0].numel())
}
pub(crate) fn flops_rms_norm_backward(x: &[&TensorMeta]) -> Flops {
    Flops::other(10 * x[0].numel())
}

pub(crate) fn vjp_layer_norm(cx: &mut VjpCtx<'_>, eps: f64) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let g = cx.b.push(Op::LayerNormBackward { eps }, &[cx.x(0), cx.x(1), dy])?;
    Ok(g.into_iter().map(|t| Some(Grad::Full(t))).collect())
}

pub(crate) fn vjp_rms_norm(cx: &mut VjpCtx<'_>, eps: f64) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let g = cx.b.push(Op::RmsNormBackward { eps }, &[cx.x(0), cx.x(1), dy])?;
    Ok(g.into_iter().map(|t| Some(Grad::Full(t))).collect())
}
