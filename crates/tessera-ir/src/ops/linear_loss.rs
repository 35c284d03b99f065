//! The LM head and its cross-entropy fused and computed in row chunks
//! ([`Op::LinearCrossEntropy`]): `x [.., D]` against `weight [V, D]` gives each chunk's
//! `[chunk_rows, V]` logits, reduced at once to the rows' log-sum-exp and loss, so the whole
//! `[rows, V]` logits never exist — at 128K tokens × a 128K vocabulary that is the difference
//! between one chunk and ~100 GB. The backward recomputes each chunk's logits from the saved
//! log-sum-exp and turns them into `dx` rows and a `dweight` sum. The chunk's logits are the
//! op's declared workspace, charged by the accountant and the profiler alike.

use super::{expect_float, expect_inputs, expect_int, Flops, Op};
use crate::autodiff::{Grad, VjpCtx};
use crate::{DType, Result, Shape, TensorMeta};

/// `(rows, D, V)` of `[x [.., D], weight [V, D], targets [..]]`, or why they do not fit.
fn dims(x: &[&TensorMeta]) -> Result<(u64, u64, u64), String> {
    expect_float(x[0], "hidden")?;
    expect_float(x[1], "weight")?;
    expect_int(x[2], "targets")?;
    if x[0].dtype != x[1].dtype {
        return Err(format!("hidden {} and weight {} must share a dtype", x[0], x[1]));
    }
    let (h, w) = (x[0].shape.dims(), x[1].shape.dims());
    if h.is_empty() || &h[..h.len() - 1] != x[2].shape.dims() {
        return Err(format!("hidden {} must be targets' shape {} plus a feature dim", x[0], x[2]));
    }
    if w.len() != 2 || w[1] != h[h.len() - 1] {
        return Err(format!("weight {} must be [classes, {}]", x[1], h[h.len() - 1]));
    }
    Ok((x[2].numel(), w[1] as u64, w[0] as u64))
}

fn check_chunk(chunk_rows: usize) -> Result<(), String> {
    if chunk_rows == 0 {
        return Err("chunk_rows must be at least 1".into());
    }
    Ok(())
}

/// `[x, weight, targets]` → `[loss [] f32, logsumexp [..] f32]`.
pub(crate) fn infer(x: &[&TensorMeta], chunk_rows: usize) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 3)?;
    check_chunk(chunk_rows)?;
    dims(x)?;
    Ok(vec![
        TensorMeta::new(Shape::scalar(), DType::F32),
        TensorMeta { shape: x[2].shape.clone(), dtype: DType::F32 },
    ])
}

/// `[x, weight, targets, logsumexp, dloss]` → `[dx, dweight]`.
pub(crate) fn infer_backward(
    x: &[&TensorMeta],
    chunk_rows: usize,
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 5)?;
    check_chunk(chunk_rows)?;
    dims(&x[..3])?;
    if x[3].shape != x[2].shape || x[3].dtype != DType::F32 {
        return Err(format!("logsumexp {} must be f32 of the targets' shape {}", x[3], x[2]));
    }
    if x[4].shape.rank() != 0 || x[4].dtype != DType::F32 {
        return Err(format!("dloss {} must be an f32 scalar", x[4]));
    }
    Ok(vec![x[0].clone(), x[1].clone()])
}

/// The logits' GEMM (`2·rows·D·V`, matmul class) and the cross-entropy over them.
pub(crate) fn flops(x: &[&TensorMeta]) -> Flops {
    let Ok((n, d, v)) = dims(x) else { return Flops::default() };
    Flops { matmul: 2 * n * d * v, other: 4 * n * v + 2 * n }
}

/// The recomputed logits plus the two gradient GEMMs (`dx = G·W`, `dW = Gᵀ·x`), and the
/// softmax-minus-one-hot between them.
pub(crate) fn flops_backward(x: &[&TensorMeta]) -> Flops {
    let Ok((n, d, v)) = dims(&x[..3]) else { return Flops::default() };
    Flops { matmul: 6 * n * d * v, other: 4 * n * v }
}

/// One chunk's f32 logits `[min(chunk_rows, rows), V]`: forward and backward alike (the
/// backward turns them into the chunk's logit gradients in place).
pub(crate) fn workspace_bytes(x: &[&TensorMeta], chunk_rows: usize) -> u64 {
    let Ok((n, _, v)) = dims(&x[..3]) else { return 0 };
    n.min(chunk_rows as u64) * v * 4
}

pub(crate) fn vjp(
    cx: &mut VjpCtx<'_>,
    chunk_rows: usize,
    ignore_index: Option<i64>,
) -> Result<Vec<Option<Grad>>> {
    if cx.dout[1].is_some() {
        return Err(crate::IrError::Graph(
            "linear_cross_entropy's logsumexp output is saved for the backward pass and has no \
             VJP"
            .into(),
        ));
    }
    let dloss = cx.dy(0)?;
    let g = cx.b.push(
        Op::LinearCrossEntropyBackward { chunk_rows, ignore_index },
        &[cx.x(0), cx.x(1), cx.x(2), cx.y(1), dloss],
    )?;
    Ok(vec![Some(Grad::Full(g[0])), Some(Grad::Full(g[1])), None])
}
