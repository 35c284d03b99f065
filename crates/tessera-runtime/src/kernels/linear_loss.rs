//! The chunked LM head and loss ([`tessera_ir::Op::LinearCrossEntropy`]) on the CPU: each chunk
//! of rows is one `gemm` into a `[chunk, V]` f32 buffer — the op's declared workspace, the only
//! buffer of logits that ever exists — reduced row by row to its log-sum-exp and loss (rows in
//! parallel, sums in f64 in row order, as [`super::loss`] does). The backward refills the buffer
//! with the chunk's logits, turns them into their gradient in place
//! (`dloss · (softmax − onehot)`, zero on ignored rows) and takes two more GEMMs from it: the
//! chunk's `dx` rows and its term of `dweight`, accumulated chunk after chunk in a fixed order.

use super::elementwise::{exp_f32, expect_f32, expect_i64, CHUNK};
use super::loss::{check_targets, logsumexp};
use super::matmul::{all_threads, gemm_f32, MatMut, MatRef};
use super::reduce::par_rows;
use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::Tensor;
use rayon::prelude::*;

const OP: &str = "linear_cross_entropy";

/// `(rows, D, V)` of hidden `[.., D]`, weight `[V, D]` and targets `[..]`.
fn dims(x: &Tensor, w: &Tensor, targets: &Tensor) -> Result<(usize, usize, usize)> {
    expect_f32(x, OP, "hidden")?;
    expect_f32(w, OP, "weight")?;
    expect_i64(targets, OP, "targets")?;
    let (h, wd) = (x.dims(), w.dims());
    let d = h.last().copied().unwrap_or(0);
    if h.is_empty() || &h[..h.len() - 1] != targets.dims() || wd.len() != 2 || wd[1] != d {
        return Err(RuntimeError::Binding(format!(
            "{OP}: hidden {h:?}, weight {wd:?} and targets {:?} must be [.., D], [V, D] and [..]",
            targets.dims()
        )));
    }
    Ok((targets.elem_count(), d, wd[0]))
}

/// `buf[0..r1−r0, :] = x[r0..r1, :] · wᵀ`.
fn chunk_logits(xs: &[f32], ws: &[f32], buf: &mut [f32], r0: usize, r1: usize, d: usize, v: usize) {
    let c = r1 - r0;
    let lhs = MatRef { ptr: xs[r0 * d..].as_ptr(), rs: d as isize, cs: 1 };
    // wᵀ as a [D, V] matrix: element (k, j) is w[j, k].
    let rhs = MatRef { ptr: ws.as_ptr(), rs: 1, cs: d as isize };
    let dst = MatMut { ptr: buf.as_mut_ptr(), rs: v as isize, cs: 1 };
    // SAFETY: x holds rows r0..r1 of d elements, w holds v·d, buf holds at least c·v; the
    // destination is this function's exclusive borrow.
    unsafe { gemm_f32(c, v, d, dst, false, lhs, rhs, 1.0, all_threads()) };
}

/// `[loss (the sum over non-ignored rows), logsumexp per row]`, both f32.
pub fn linear_cross_entropy(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    ignore_index: Option<i64>,
) -> Result<Vec<Tensor>> {
    let (n, d, v) = dims(x, w, targets)?;
    let (xc, wc, tc) = (contiguous(x)?, contiguous(w)?, contiguous(targets)?);
    let (xs, ws, ts) = (read::<f32>(&xc)?, read::<f32>(&wc)?, read::<i64>(&tc)?);
    check_targets(OP, &ts, v, ignore_index)?;
    let chunk = chunk_rows.max(1).min(n.max(1));
    let mut buf = vec![0f32; chunk * v];
    let mut lse = vec![f32::NEG_INFINITY; n];
    let mut total = 0f64;
    let mut r0 = 0;
    while r0 < n && v > 0 {
        let r1 = (r0 + chunk).min(n);
        chunk_logits(&xs, &ws, &mut buf, r0, r1, d, v);
        let rows = &buf[..(r1 - r0) * v];
        let mut row_lse = vec![0f64; r1 - r0];
        let per = (CHUNK / v).max(1);
        row_lse.par_chunks_mut(per).enumerate().for_each(|(j, out)| {
            for (k, o) in out.iter_mut().enumerate() {
                let r = j * per + k;
                *o = logsumexp(&rows[r * v..(r + 1) * v]);
            }
        });
        for (k, (o, &l)) in lse[r0..r1].iter_mut().zip(&row_lse).enumerate() {
            *o = l as f32;
            let t = ts[r0 + k];
            if Some(t) != ignore_index {
                total += l - rows[k * v + t as usize] as f64;
            }
        }
        r0 = r1;
    }
    Ok(vec![from_vec(vec![total as f32], &[])?, from_vec(lse, targets.dims())?])
}

/// `[dx, dweight]` of the summed loss scaled by `dloss`, each chunk's logits recomputed.
pub fn linear_cross_entropy_backward(
    x: &[&Tensor],
    chunk_rows: usize,
    ignore_index: Option<i64>,
) -> Result<Vec<Tensor>> {
    let (xt, w, targets, lse, dloss) = (x[0], x[1], x[2], x[3], x[4]);
    let (n, d, v) = dims(xt, w, targets)?;
    expect_f32(lse, OP, "logsumexp")?;
    expect_f32(dloss, OP, "dloss")?;
    if lse.dims() != targets.dims() || dloss.elem_count() != 1 {
        return Err(RuntimeError::Binding(format!(
            "{OP}: logsumexp {:?} must be targets' shape {:?} and dloss {:?} a scalar",
            lse.dims(),
            targets.dims(),
            dloss.dims()
        )));
    }
    let (xc, wc, tc, sc) =
        (contiguous(xt)?, contiguous(w)?, contiguous(targets)?, contiguous(lse)?);
    let (xs, ws, ts, ss) =
        (read::<f32>(&xc)?, read::<f32>(&wc)?, read::<i64>(&tc)?, read::<f32>(&sc)?);
    check_targets(OP, &ts, v, ignore_index)?;
    let g = dloss.flatten_all()?.to_vec1::<f32>()?[0];
    let chunk = chunk_rows.max(1).min(n.max(1));
    let mut buf = vec![0f32; chunk * v];
    let mut dx = vec![0f32; n * d];
    let mut dw = vec![0f32; v * d];
    let mut r0 = 0;
    while r0 < n && v > 0 {
        let r1 = (r0 + chunk).min(n);
        let c = r1 - r0;
        chunk_logits(&xs, &ws, &mut buf, r0, r1, d, v);
        par_rows(&mut buf[..c * v], v, |k, row| {
            let t = ts[r0 + k];
            if Some(t) == ignore_index {
                row.fill(0.0);
                return;
            }
            let m = ss[r0 + k];
            for o in row.iter_mut() {
                *o = g * exp_f32(*o - m);
            }
            row[t as usize] -= g;
        });
        let gm = MatRef { ptr: buf.as_ptr(), rs: v as isize, cs: 1 };
        // dx[r0..r1] = G · w  ([c, V] · [V, D]).
        let wm = MatRef { ptr: ws.as_ptr(), rs: d as isize, cs: 1 };
        let dxm = MatMut { ptr: dx[r0 * d..].as_mut_ptr(), rs: d as isize, cs: 1 };
        // dweight += Gᵀ · x[r0..r1]  ([V, c] · [c, D]).
        let xm = MatRef { ptr: xs[r0 * d..].as_ptr(), rs: d as isize, cs: 1 };
        let dwm = MatMut { ptr: dw.as_mut_ptr(), rs: d as isize, cs: 1 };
        // SAFETY: every operand addresses elements of live buffers of the sizes above; the
        // destinations are exclusively borrowed and overlap no operand.
        unsafe {
            gemm_f32(c, d, v, dxm, false, gm, wm, 1.0, all_threads());
            gemm_f32(v, d, c, dwm, r0 > 0, gm.t(), xm, 1.0, all_threads());
        }
        r0 = r1;
    }
    Ok(vec![from_vec(dx, xt.dims())?, from_vec(dw, w.dims())?])
}
