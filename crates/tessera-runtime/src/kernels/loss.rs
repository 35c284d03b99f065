//! Fused softmax cross-entropy. The forward saves only each row's log-sum-exp; the backward
//! rebuilds the probabilities from it. Rows run in parallel, exponentials are the vectorised
//! [`exp_f32`], row sums and the loss accumulate in f64 (the loss from per-task partials
//! summed in task order: deterministic). No `[rows, V]` buffer exists besides dlogits.

use super::elementwise::{exp_f32, expect_f32, expect_i64, max_f32, sum_exp, CHUNK};
use super::inplace::Elem;
use super::reduce::par_rows;
use super::simd::wide;
use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::{DType, Tensor};
use half::bf16;
use rayon::prelude::*;
use tessera_ir::dist::TableRows;

/// Checks `logits [.., V]` (f32 or bf16) against `targets [..]`; returns V.
fn check(op: &str, logits: &Tensor, targets: &Tensor) -> Result<usize> {
    if logits.dtype() != DType::BF16 {
        expect_f32(logits, op, "logits")?;
    }
    expect_i64(targets, op, "targets")?;
    let (l, t) = (logits.dims(), targets.dims());
    if l.len() < 2 || &l[..l.len() - 1] != t {
        return Err(RuntimeError::Binding(format!(
            "{op}: logits {l:?} must be targets' shape {t:?} plus a class dim"
        )));
    }
    Ok(l[l.len() - 1])
}

/// The class of every row (`None` when ignored), or a clear error for the first target
/// that is neither a class in `0..classes` nor `ignore_index`. Returns the non-ignored count.
pub fn check_targets(
    op: &str,
    targets: &[i64],
    classes: usize,
    ignore: Option<i64>,
) -> Result<usize> {
    let mut count = 0;
    for (k, &t) in targets.iter().enumerate() {
        if Some(t) == ignore {
            continue;
        }
        if t < 0 || t as u64 >= classes as u64 {
            let ig = match ignore {
                Some(i) => format!("the ignore_index is {i}"),
                None => "no ignore_index is set".into(),
            };
            return Err(RuntimeError::Data(format!(
                "{op}: target {t} (at flat position {k}) is out of range for {classes} classes \
                 (valid targets are 0..{classes}; {ig})"
            )));
        }
        count += 1;
    }
    Ok(count)
}

/// log Σ exp over a row (−∞ for a row of −∞).
#[inline(always)]
pub(super) fn logsumexp(row: &[f32]) -> f64 {
    let m = max_f32(row);
    if m == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    m as f64 + sum_exp(row, m).ln()
}

/// `[mean loss over non-ignored rows (0 if none) — or with `sum` their sum —, logsumexp per
/// row]`, both f32. With `lse` (each row's log-sum-exp over every class) and `classes` (the
/// share of the vocabulary these logits are): this shard's part of the loss — `−logit[target]`
/// where it holds the target, the log-sum-exp where it holds class 0 — and `lse` again.
/// bf16 logits are read a row at a time, widened exactly into an f32 row (the upcast path's
/// arithmetic and bits, without its f32 copy of the whole `[rows, V]` tensor).
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    lse: Option<&Tensor>,
    ignore_index: Option<i64>,
    sum: bool,
    classes: &TableRows,
) -> Result<Vec<Tensor>> {
    if logits.dtype() == DType::BF16 {
        cross_entropy_as::<bf16>(logits, targets, lse, ignore_index, sum, classes)
    } else {
        cross_entropy_as::<f32>(logits, targets, lse, ignore_index, sum, classes)
    }
}

/// A logits element type: rows are read as f32 (bf16 widened exactly into a buffer).
trait Logit: Elem {
    fn row<'b>(r: &'b [Self], buf: &'b mut Vec<f32>) -> &'b [f32];
}

impl Logit for f32 {
    fn row<'b>(r: &'b [f32], _: &'b mut Vec<f32>) -> &'b [f32] {
        r
    }
}

impl Logit for bf16 {
    fn row<'b>(r: &'b [bf16], buf: &'b mut Vec<f32>) -> &'b [f32] {
        buf.clear();
        buf.extend(r.iter().map(|x| x.to_f32()));
        buf
    }
}

fn cross_entropy_as<E: Logit>(
    logits: &Tensor,
    targets: &Tensor,
    lse: Option<&Tensor>,
    ignore_index: Option<i64>,
    sum: bool,
    classes: &TableRows,
) -> Result<Vec<Tensor>> {
    let v = check("cross_entropy", logits, targets)?;
    let (lc, tc) = (contiguous(logits)?, contiguous(targets)?);
    let (ls, ts) = (read::<E>(&lc)?, read::<i64>(&tc)?);
    let count = check_targets("cross_entropy", &ts, classes.vocab, ignore_index)?;
    let given_c = match lse {
        Some(l) => {
            expect_f32(l, "cross_entropy", "logsumexp")?;
            if l.dims() != targets.dims() {
                return Err(RuntimeError::Binding(format!(
                    "cross_entropy: logsumexp {:?} must be targets' shape {:?}",
                    l.dims(),
                    targets.dims()
                )));
            }
            Some(contiguous(l)?)
        }
        None => None,
    };
    let given = given_c.as_ref().map(read::<f32>).transpose()?;
    let rows = ts.len();
    let mut out_lse = vec![0f32; rows];
    let total: f64 = if v == 0 || rows == 0 {
        out_lse.fill(f32::NEG_INFINITY);
        0.0
    } else {
        let per = (CHUNK / v).max(1);
        let task = |r0: usize, out: &mut [f32]| -> f64 {
            let mut buf = Vec::new();
            wide! {
            let mut loss = 0.0;
            for (j, o) in out.iter_mut().enumerate() {
                let r = r0 + j;
                let row = E::row(&ls[r * v..(r + 1) * v], &mut buf);
                let l = match &given {
                    Some(g) => g[r] as f64,
                    None => logsumexp(row),
                };
                *o = l as f32;
                let t = ts[r];
                if Some(t) == ignore_index {
                    continue;
                }
                if classes.first == 0 {
                    loss += l;
                }
                if let Some(k) = classes.local(t as usize) {
                    loss -= row[k] as f64;
                }
            }
            loss
            }
        };
        let partials: Vec<f64> = if rows <= per {
            vec![task(0, &mut out_lse)]
        } else {
            out_lse.par_chunks_mut(per).enumerate().map(|(k, c)| task(k * per, c)).collect()
        };
        partials.iter().sum()
    };
    let loss = (total / if sum { 1 } else { count.max(1) } as f64) as f32;
    Ok(vec![from_vec(vec![loss], &[])?, from_vec(out_lse, targets.dims())?])
}

/// dlogits = dloss/N · (softmax(logits) − onehot(target)) on non-ignored rows, 0 on ignored
/// ones, with N the number of non-ignored rows (at least 1), or 1 with `sum`. With `classes`
/// a shard of the vocabulary: its columns, from the log-sum-exp over every class.
/// bf16 logits give bf16 dlogits, each element computed in f32 and rounded once.
pub fn cross_entropy_backward(
    logits: &Tensor,
    targets: &Tensor,
    lse: &Tensor,
    dloss: &Tensor,
    ignore_index: Option<i64>,
    sum: bool,
    classes: &TableRows,
) -> Result<Tensor> {
    if logits.dtype() == DType::BF16 {
        cross_entropy_backward_as::<bf16>(logits, targets, lse, dloss, ignore_index, sum, classes)
    } else {
        cross_entropy_backward_as::<f32>(logits, targets, lse, dloss, ignore_index, sum, classes)
    }
}

fn cross_entropy_backward_as<E: Logit>(
    logits: &Tensor,
    targets: &Tensor,
    lse: &Tensor,
    dloss: &Tensor,
    ignore_index: Option<i64>,
    sum: bool,
    classes: &TableRows,
) -> Result<Tensor> {
    let v = check("cross_entropy_backward", logits, targets)?;
    expect_f32(lse, "cross_entropy_backward", "logsumexp")?;
    expect_f32(dloss, "cross_entropy_backward", "dloss")?;
    if lse.dims() != targets.dims() || dloss.elem_count() != 1 {
        return Err(RuntimeError::Binding(format!(
            "cross_entropy_backward: logsumexp {:?} must be targets' shape {:?} and dloss {:?} a \
             scalar",
            lse.dims(),
            targets.dims(),
            dloss.dims()
        )));
    }
    let (lc, tc, sc) = (contiguous(logits)?, contiguous(targets)?, contiguous(lse)?);
    let (ls, ts, ss) = (read::<E>(&lc)?, read::<i64>(&tc)?, read::<f32>(&sc)?);
    let count = check_targets("cross_entropy_backward", &ts, classes.vocab, ignore_index)?;
    let dl = dloss.flatten_all()?.to_vec1::<f32>()?[0];
    let g = (dl as f64 / if sum { 1 } else { count.max(1) } as f64) as f32;
    let mut out = vec![E::put(0.0); ls.len()];
    if v > 0 {
        par_rows(&mut out, v, |r, orow| {
            let t = ts[r];
            if Some(t) == ignore_index {
                return;
            }
            let row = &ls[r * v..(r + 1) * v];
            let m = ss[r];
            wide! {
                for (o, &l) in orow.iter_mut().zip(row) {
                    *o = E::put(g * exp_f32(l.get() - m));
                }
            }
            if let Some(k) = classes.local(t as usize) {
                // The f32 value minus g, rounded once.
                orow[k] = E::put(g * exp_f32(row[k].get() - m) - g);
            }
        });
    }
    from_vec(out, logits.dims())
}

/// `log Σ exp` over the last dim of an f32 tensor, f32 out (−∞ for an empty or all −∞ row).
pub fn logsumexp_rows(x: &Tensor) -> Result<Tensor> {
    expect_f32(x, "logsumexp", "operand")?;
    let dims = x.dims();
    let Some((&v, rest)) = dims.split_last() else {
        return Err(RuntimeError::Binding("logsumexp: needs at least one dim".into()));
    };
    let xc = contiguous(x)?;
    let xs = read::<f32>(&xc)?;
    let rows: usize = rest.iter().product();
    let mut out = vec![f32::NEG_INFINITY; rows];
    if let Some(per) = CHUNK.checked_div(v) {
        let per = per.max(1);
        out.par_chunks_mut(per).enumerate().for_each(|(k, c)| {
            wide! {
                for (j, o) in c.iter_mut().enumerate() {
                    let r = k * per + j;
                    *o = logsumexp(&xs[r * v..(r + 1) * v]) as f32;
                }
            }
        });
    }
    from_vec(out, rest)
}
