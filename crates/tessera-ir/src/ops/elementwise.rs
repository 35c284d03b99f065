//! Unary, binary, cast and dropout: shape inference, FLOPs and VJPs.

use super::{expect_float, expect_inputs, expect_same, BinaryOp, Flops, Op, UnaryOp};
use crate::autodiff::{Grad, VjpCtx};
use crate::{Result, Shape, TensorMeta};

pub(crate) fn infer_unary(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    expect_float(x[0], "operand")?;
    Ok(vec![x[0].clone()])
}

pub(crate) fn infer_unary_backward(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    expect_float(x[0], "x")?;
    if x[0].shape != x[1].shape {
        return Err(format!("x {} and dy {} must have one shape", x[0], x[1]));
    }
    Ok(vec![x[1].clone()])
}

pub(crate) fn infer_binary(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    if x[0].dtype != x[1].dtype {
        return Err(format!("dtypes differ: {} vs {} (insert a cast)", x[0].dtype, x[1].dtype));
    }
    let shape = Shape::broadcast(&x[0].shape, &x[1].shape)
        .ok_or_else(|| format!("shapes {} and {} do not broadcast", x[0].shape, x[1].shape))?;
    Ok(vec![TensorMeta { shape, dtype: x[0].dtype }])
}

pub(crate) fn infer_binary_backward(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 3)?;
    let out = infer_binary(&x[..2])?;
    expect_same(&out[0], x[2], "broadcast output and dy")?;
    Ok(out)
}

pub(crate) fn infer_cast(x: &[&TensorMeta], to: crate::DType) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    Ok(vec![TensorMeta { shape: x[0].shape.clone(), dtype: to }])
}

pub(crate) fn infer_dropout(x: &[&TensorMeta], p: f64) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    expect_float(x[0], "x")?;
    if x[1].dtype != crate::DType::I64 || x[1].shape.rank() != 0 {
        return Err(format!("seed must be an i64 scalar, got {}", x[1]));
    }
    if !(0.0..1.0).contains(&p) {
        return Err(format!("dropout probability {p} must be in [0, 1)"));
    }
    Ok(vec![x[0].clone()])
}

/// Per-element FLOPs of a unary function (a documented convention, not a measurement:
/// transcendental functions count as one, GELU as its polynomial/tanh evaluation).
pub fn unary_flops_per_element(u: UnaryOp) -> u64 {
    match u {
        UnaryOp::Neg | UnaryOp::Relu => 1,
        UnaryOp::Exp | UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Tanh => 1,
        UnaryOp::Sin | UnaryOp::Cos => 1,
        UnaryOp::Sigmoid => 3,
        UnaryOp::Silu => 4,
        UnaryOp::Gelu | UnaryOp::GeluTanh => 8,
    }
}

pub(crate) fn flops_unary(u: UnaryOp, y: &[&TensorMeta]) -> Flops {
    Flops::other(unary_flops_per_element(u) * y[0].numel())
}

pub(crate) fn flops_unary_backward(u: UnaryOp, y: &[&TensorMeta]) -> Flops {
    Flops::other((2 * unary_flops_per_element(u) + 1) * y[0].numel())
}

pub(crate) fn flops_binary(y: &[&TensorMeta]) -> Flops {
    Flops::other(y[0].numel())
}

pub(crate) fn flops_binary_backward(y: &[&TensorMeta]) -> Flops {
    Flops::other(3 * y[0].numel())
}

pub(crate) fn flops_dropout(y: &[&TensorMeta]) -> Flops {
    Flops::other(2 * y[0].numel())
}

pub(crate) fn vjp_unary(cx: &mut VjpCtx<'_>, u: UnaryOp) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let dx = match u {
        UnaryOp::Neg => cx.b.unary(UnaryOp::Neg, dy)?,
        _ => cx.b.push1(Op::UnaryBackward(u), &[cx.x(0), dy])?,
    };
    Ok(vec![Some(Grad::Full(dx))])
}

pub(crate) fn vjp_binary(cx: &mut VjpCtx<'_>, op: BinaryOp) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let (a, b) = (cx.x(0), cx.x(1));
    let mut grads = Vec::with_capacity(2);
    for wrt in 0..2usize {
        if !cx.needs[wrt] {
            grads.push(None);
            continue;
        }
        let g = match (op, wrt) {
            (BinaryOp::Add, _) | (BinaryOp::Sub, 0) => dy,
            (BinaryOp::Sub, _) => cx.b.unary(UnaryOp::Neg, dy)?,
            (BinaryOp::Mul, 0) => cx.b.binary(BinaryOp::Mul, dy, b)?,
            (BinaryOp::Mul, _) => cx.b.binary(BinaryOp::Mul, dy, a)?,
            (BinaryOp::Div | BinaryOp::Max | BinaryOp::Min, _) => {
                cx.b.push1(Op::BinaryBackward { op, wrt: wrt as u8 }, &[a, b, dy])?
            }
        };
        let target = cx.b.graph.shape(cx.x(wrt)).clone();
        grads.push(Some(Grad::Full(cx.b.unbroadcast(g, &target)?)));
    }
    Ok(grads)
}

pub(crate) fn vjp_cast(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let to = cx.b.graph.meta(cx.x(0)).dtype;
    let dx = if cx.b.graph.meta(dy).dtype == to { dy } else { cx.b.cast(dy, to)? };
    Ok(vec![Some(Grad::Full(dx))])
}

pub(crate) fn vjp_dropout(
    cx: &mut VjpCtx<'_>,
    p: f64,
    stream: u64,
    shard: &Option<crate::dist::ShardOf>,
) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    // Same (seed, stream, element) → same mask: the gradient passes where the input did (the
    // gradient is laid out as the input is, so the shard's index map is the same).
    let dx = cx.b.push1(Op::Dropout { p, stream, shard: shard.clone() }, &[dy, cx.x(1)])?;
    Ok(vec![Some(Grad::Full(dx)), None])
}

/// The dropout mask, shared by every executor: element `index` (row-major, of the full
/// logical tensor) is kept iff a splitmix64 hash of (seed, stream, index) mapped to [0, 1)
/// is ≥ p. Counter-based, so any device holding any shard regenerates the same mask.
pub fn dropout_keep(seed: u64, stream: u64, index: u64, p: f64) -> bool {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(stream.wrapping_mul(0xD1B5_4A32_D192_ED03))
        .wrapping_add(index);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let u = (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    u >= p
}
