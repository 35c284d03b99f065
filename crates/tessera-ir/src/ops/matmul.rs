//! Batched matmul with transposed-operand flags: shape inference, FLOPs (2·m·n·k) and VJP.

use super::{expect_float, expect_inputs, Flops};
use crate::autodiff::{Grad, VjpCtx};
use crate::{Result, Shape, TensorId, TensorMeta};

/// (batch dims, rows, cols) of an operand as the matmul reads it.
fn as_matrix(m: &TensorMeta, trans: bool) -> Result<(&[usize], usize, usize), String> {
    let d = m.shape.dims();
    if d.len() < 2 {
        return Err(format!("operand {m} must have at least 2 dims"));
    }
    let (r, c) = (d[d.len() - 2], d[d.len() - 1]);
    Ok((&d[..d.len() - 2], if trans { c } else { r }, if trans { r } else { c }))
}

pub(crate) fn infer(
    x: &[&TensorMeta],
    trans_a: bool,
    trans_b: bool,
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    expect_float(x[0], "a")?;
    if x[0].dtype != x[1].dtype {
        return Err(format!("dtypes differ: {} vs {}", x[0].dtype, x[1].dtype));
    }
    let (ba, m, ka) = as_matrix(x[0], trans_a)?;
    let (bb, kb, n) = as_matrix(x[1], trans_b)?;
    if ka != kb {
        return Err(format!("inner dims {ka} vs {kb}"));
    }
    let batch = Shape::broadcast(&Shape::from(ba), &Shape::from(bb))
        .ok_or_else(|| format!("batch dims {:?} and {:?} do not broadcast", ba, bb))?;
    let mut dims = batch.0;
    dims.push(m);
    dims.push(n);
    Ok(vec![TensorMeta { shape: Shape(dims), dtype: x[0].dtype }])
}

pub(crate) fn flops(x: &[&TensorMeta], y: &[&TensorMeta], trans_a: bool) -> Flops {
    let d = x[0].shape.dims();
    let k = if trans_a { d[d.len() - 2] } else { d[d.len() - 1] } as u64;
    Flops { matmul: 2 * y[0].numel() * k, other: 0 }
}

/// C = op(A)·op(B): dop(A) = dC·op(B)ᵀ and dop(B) = op(A)ᵀ·dC, written as matmuls with
/// flipped flags so no transpose is ever materialised. When B is a 2-D weight broadcast over
/// A's batch dims (`[B, S, D] x [D, N]`), A and dC are flattened to 2-D first, so the weight
/// gradient is one `[D, N]` matmul rather than a `[B, D, N]` tensor summed afterwards.
pub(crate) fn vjp(cx: &mut VjpCtx<'_>, ta: bool, tb: bool) -> Result<Vec<Option<Grad>>> {
    let dc = cx.dy(0)?;
    let (a, b) = (cx.x(0), cx.x(1));
    let rank_a = cx.b.graph.shape(a).rank();
    let rank_b = cx.b.graph.shape(b).rank();
    let mut grads = vec![None, None];
    if cx.needs[0] {
        let g = if ta { cx.b.matmul(b, dc, tb, true)? } else { cx.b.matmul(dc, b, false, !tb)? };
        let target = cx.b.graph.shape(a).clone();
        grads[0] = Some(Grad::Full(cx.b.unbroadcast(g, &target)?));
    }
    if cx.needs[1] {
        let g = if rank_b == 2 && rank_a > 2 && !ta {
            let a2 = flatten_rows(cx, a)?;
            let dc2 = flatten_rows(cx, dc)?;
            if tb {
                cx.b.matmul(dc2, a2, true, false)?
            } else {
                cx.b.matmul(a2, dc2, true, false)?
            }
        } else if tb {
            cx.b.matmul(dc, a, true, ta)?
        } else {
            cx.b.matmul(a, dc, !ta, false)?
        };
        let target = cx.b.graph.shape(b).clone();
        grads[1] = Some(Grad::Full(cx.b.unbroadcast(g, &target)?));
    }
    Ok(grads)
}

/// `[.., r, c]` → `[N, c]` (a view).
fn flatten_rows(cx: &mut VjpCtx<'_>, t: TensorId) -> Result<TensorId> {
    let s = cx.b.graph.shape(t).clone();
    let c = s.last();
    let rows = (s.numel() / c as u64) as usize;
    cx.b.reshape(t, [rows, c])
}
