//! Reshape, permute, slice, pad, concat, expand: shape inference and VJPs (they move data
//! but do no arithmetic; reshape and expand are views).

use super::{expect_inputs, Op};
use crate::autodiff::{Grad, VjpCtx};
use crate::{Result, Shape, TensorMeta};

pub(crate) fn infer_reshape(x: &[&TensorMeta], s: &Shape) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    if x[0].shape.numel() != s.numel() {
        return Err(format!(
            "cannot reshape {} ({} elements) to {s} ({} elements)",
            x[0].shape,
            x[0].shape.numel(),
            s.numel()
        ));
    }
    Ok(vec![TensorMeta { shape: s.clone(), dtype: x[0].dtype }])
}

pub(crate) fn infer_permute(x: &[&TensorMeta], perm: &[usize]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    let r = x[0].shape.rank();
    let mut seen = vec![false; r];
    if perm.len() != r || perm.iter().any(|&p| p >= r || std::mem::replace(&mut seen[p], true)) {
        return Err(format!("{perm:?} is not a permutation of {r} dims"));
    }
    let dims = perm.iter().map(|&p| x[0].shape.dim(p)).collect::<Vec<_>>();
    Ok(vec![TensorMeta { shape: Shape::from(dims), dtype: x[0].dtype }])
}

pub(crate) fn infer_slice(
    x: &[&TensorMeta],
    dim: usize,
    start: usize,
    end: usize,
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    let s = &x[0].shape;
    if dim >= s.rank() || start >= end || end > s.dim(dim) {
        return Err(format!("slice {start}..{end} of dim {dim} is out of range for {s}"));
    }
    let mut dims = s.0.clone();
    dims[dim] = end - start;
    Ok(vec![TensorMeta { shape: Shape(dims), dtype: x[0].dtype }])
}

pub(crate) fn infer_pad(
    x: &[&TensorMeta],
    dim: usize,
    before: usize,
    after: usize,
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    let s = &x[0].shape;
    if dim >= s.rank() {
        return Err(format!("pad dim {dim} is out of range for {s}"));
    }
    let mut dims = s.0.clone();
    dims[dim] += before + after;
    Ok(vec![TensorMeta { shape: Shape(dims), dtype: x[0].dtype }])
}

pub(crate) fn infer_concat(x: &[&TensorMeta], dim: usize) -> Result<Vec<TensorMeta>, String> {
    if x.is_empty() {
        return Err("concat needs at least one input".into());
    }
    let first = x[0];
    if dim >= first.shape.rank() {
        return Err(format!("concat dim {dim} is out of range for {}", first.shape));
    }
    let mut dims = first.shape.0.clone();
    dims[dim] = 0;
    for m in x {
        let same_other = m.shape.rank() == first.shape.rank()
            && (0..m.shape.rank()).all(|i| i == dim || m.shape.dim(i) == first.shape.dim(i));
        if !same_other || m.dtype != first.dtype {
            return Err(format!("{m} does not match {first} outside dim {dim}"));
        }
        dims[dim] += m.shape.dim(dim);
    }
    Ok(vec![TensorMeta { shape: Shape(dims), dtype: first.dtype }])
}

pub(crate) fn infer_expand(x: &[&TensorMeta], s: &Shape) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    if !x[0].shape.broadcasts_to(s) {
        return Err(format!("cannot expand {} to {s}", x[0].shape));
    }
    Ok(vec![TensorMeta { shape: s.clone(), dtype: x[0].dtype }])
}

pub(crate) fn vjp_reshape(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let s = cx.b.graph.shape(cx.x(0)).clone();
    Ok(vec![Some(Grad::Full(cx.b.reshape(dy, s)?))])
}

pub(crate) fn vjp_permute(cx: &mut VjpCtx<'_>, perm: &[usize]) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    Ok(vec![Some(Grad::Full(cx.b.push1(Op::Permute(inv), &[dy])?))])
}

pub(crate) fn vjp_slice(
    cx: &mut VjpCtx<'_>,
    dim: usize,
    start: usize,
    end: usize,
) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    // Kept as a slice contribution: when the slices of one tensor tile it (q, k, v out of a
    // fused qkv projection), autodiff concatenates them instead of padding and adding.
    Ok(vec![Some(Grad::Slice { dim, start, end, grad: dy })])
}

pub(crate) fn vjp_pad(cx: &mut VjpCtx<'_>, dim: usize, before: usize) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let len = cx.b.graph.shape(cx.x(0)).dim(dim);
    Ok(vec![Some(Grad::Full(cx.b.slice(dy, dim, before, before + len)?))])
}

pub(crate) fn vjp_concat(cx: &mut VjpCtx<'_>, dim: usize) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let mut start = 0;
    let mut grads = Vec::with_capacity(cx.inputs.len());
    for i in 0..cx.inputs.len() {
        let len = cx.b.graph.shape(cx.x(i)).dim(dim);
        grads.push(if cx.needs[i] {
            Some(Grad::Full(cx.b.slice(dy, dim, start, start + len)?))
        } else {
            None
        });
        start += len;
    }
    Ok(grads)
}

pub(crate) fn vjp_expand(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let s = cx.b.graph.shape(cx.x(0)).clone();
    Ok(vec![Some(Grad::Full(cx.b.unbroadcast(dy, &s)?))])
}
