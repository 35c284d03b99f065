//! Reference semantics of the chunked LM head and loss ([`crate::Op::LinearCrossEntropy`]):
//! chunk by chunk, the reference matmul and cross-entropy of the pair it fuses, so the fused
//! op equals the pair by construction here and the kernels are tested against it.

use super::kernels::matmul;
use super::nn::{cross_entropy, cross_entropy_backward};
use super::Value;
use crate::Shape;

/// `(rows, D)` of `x [.., D]` against `targets [..]`.
fn rows_of(x: &Value, targets: &Value) -> Result<(usize, usize), String> {
    let d = *x.shape.dims().last().ok_or("hidden needs a feature dim")?;
    let rows = targets.numel();
    if rows * d != x.numel() {
        return Err(format!(
            "hidden {} must be targets' shape {} plus a feature dim",
            x.shape, targets.shape
        ));
    }
    Ok((rows, d))
}

/// Rows `r0..r1` of a `[rows, width]` value, as `[r1 − r0, width]`.
fn rows(v: &Value, width: usize, r0: usize, r1: usize) -> Value {
    Value::new(Shape::from(vec![r1 - r0, width]), v.data[r0 * width..r1 * width].to_vec())
}

/// `[loss, logsumexp]`.
pub(super) fn linear_cross_entropy(
    x: &Value,
    w: &Value,
    targets: &Value,
    chunk_rows: usize,
    ignore_index: Option<i64>,
) -> Result<Vec<Value>, String> {
    let (n, d) = rows_of(x, targets)?;
    let (mut loss, mut lse) = (0.0, Vec::with_capacity(n));
    let mut r0 = 0;
    while r0 < n {
        let r1 = (r0 + chunk_rows.max(1)).min(n);
        let xc = rows(x, d, r0, r1);
        let tc = Value::new(Shape::from(vec![r1 - r0]), targets.data[r0..r1].to_vec());
        let logits = matmul(&xc, w, false, true)?;
        let out = cross_entropy(&logits, &tc, None, ignore_index, true, None)?;
        loss += out[0].data[0];
        lse.extend_from_slice(&out[1].data);
        r0 = r1;
    }
    Ok(vec![Value::scalar(loss), Value { shape: targets.shape.clone(), data: lse }])
}

/// `[dx, dweight]`.
pub(super) fn linear_cross_entropy_backward(
    x: &[&Value],
    chunk_rows: usize,
    ignore_index: Option<i64>,
) -> Result<Vec<Value>, String> {
    let (xv, w, targets, lse, dloss) = (x[0], x[1], x[2], x[3], x[4]);
    let (n, d) = rows_of(xv, targets)?;
    let mut dx = Vec::with_capacity(xv.numel());
    let mut dw = vec![0.0; w.numel()];
    let mut r0 = 0;
    while r0 < n {
        let r1 = (r0 + chunk_rows.max(1)).min(n);
        let xc = rows(xv, d, r0, r1);
        let tc = Value::new(Shape::from(vec![r1 - r0]), targets.data[r0..r1].to_vec());
        let lc = Value::new(Shape::from(vec![r1 - r0]), lse.data[r0..r1].to_vec());
        let logits = matmul(&xc, w, false, true)?;
        let g = cross_entropy_backward(&logits, &tc, &lc, dloss, ignore_index, true, None)?;
        dx.extend_from_slice(&matmul(&g, w, false, false)?.data);
        for (a, b) in dw.iter_mut().zip(&matmul(&g, &xc, true, false)?.data) {
            *a += b;
        }
        r0 = r1;
    }
    Ok(vec![
        Value { shape: xv.shape.clone(), data: dx },
        Value { shape: w.shape.clone(), data: dw },
    ])
}
