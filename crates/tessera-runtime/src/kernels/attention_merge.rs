//! Ring attention's log-sum-exp merge of partial attentions (`Op::AttentionMerge`) and its
//! backward: per row `(b, s, h)`, `L = log Σ_r exp(lse_r)`, `w_r = exp(lse_r − L)` (0 for a
//! block that masked the row, `lse_r = −∞`), `o = Σ_r w_r·o_r`; backward
//! `do_r = w_r·dout`, `dlse_r = w_r·(Σ_d dout·o_r − Σ_d dout·o)`. f32 throughout, O(pairs)
//! scratch per row.

use crate::tensor::{contiguous, from_vec, read, HostSlice};
use crate::{Result, RuntimeError};
use candle_core::{DType, Tensor};

/// The `(out, lse)` pairs made contiguous (out, lse, out, …) and `[B,S,H,D]`, checked.
fn pairs(op: &str, x: &[&Tensor]) -> Result<(Vec<Tensor>, [usize; 4])> {
    let bad = |why: String| RuntimeError::Binding(format!("{op}: {why}"));
    if x.len() < 2 || !x.len().is_multiple_of(2) {
        return Err(bad(format!("takes (out, logsumexp) pairs, got {} inputs", x.len())));
    }
    let &[b, s, h, d] = x[0].dims() else {
        return Err(bad(format!("out {:?} must be [B,S,H,D]", x[0].dims())));
    };
    let mut ts = Vec::with_capacity(x.len());
    for p in x.chunks(2) {
        if p[0].dims() != [b, s, h, d] || p[1].dims() != [b, h, s] {
            return Err(bad(format!("operands {:?} and {:?} differ", p[0].dims(), p[1].dims())));
        }
        if p[0].dtype() != DType::F32 || p[1].dtype() != DType::F32 {
            return Err(RuntimeError::Unsupported {
                backend: "cpu".into(),
                op: op.into(),
                reason: "only f32 is supported on the CPU".into(),
            });
        }
        ts.push(contiguous(p[0])?);
        ts.push(contiguous(p[1])?);
    }
    Ok((ts, [b, s, h, d]))
}

/// Views of the pairs' elements: the outputs and the log-sum-exps.
fn split<'a>(views: &'a [HostSlice<'_, f32>]) -> (Vec<&'a [f32]>, Vec<&'a [f32]>) {
    let all: Vec<&[f32]> = views.iter().map(|v| &**v).collect();
    (all.iter().step_by(2).copied().collect(), all.iter().skip(1).step_by(2).copied().collect())
}

/// The weights of every pair at lse index `at` into `w`.
fn weights(ls: &[&[f32]], at: usize, w: &mut [f32]) {
    let m = ls.iter().map(|l| l[at]).fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        w.fill(0.0);
        return;
    }
    let sum: f32 = ls.iter().map(|l| (l[at] - m).exp()).sum();
    for (w, l) in w.iter_mut().zip(ls) {
        *w = (l[at] - m).exp() / sum;
    }
}

/// Every row `(b, s, h)` with its output offset and its lse index.
fn rows(b: usize, s: usize, h: usize, d: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..b * s * h).map(move |r| {
        let (bi, si, hi) = (r / (s * h), (r / h) % s, r % h);
        (r * d, (bi * h + hi) * s + si)
    })
}

/// `Op::AttentionMerge`: `x` is `[o_0, lse_0, o_1, lse_1, …]`.
pub fn merge(x: &[&Tensor]) -> Result<Tensor> {
    let (ts, [b, s, h, d]) = pairs("attention_merge", x)?;
    let views = ts.iter().map(read::<f32>).collect::<Result<Vec<_>>>()?;
    let (os, ls) = split(&views);
    let mut out = vec![0f32; b * s * h * d];
    let mut w = vec![0f32; os.len()];
    for (o, li) in rows(b, s, h, d) {
        weights(&ls, li, &mut w);
        let orow = &mut out[o..o + d];
        for (wr, or) in w.iter().zip(&os) {
            if *wr != 0.0 {
                orow.iter_mut().zip(&or[o..o + d]).for_each(|(a, v)| *a += wr * v);
            }
        }
    }
    from_vec(out, &[b, s, h, d])
}

/// `Op::AttentionMergeBackward`: `x` is `[o_0, lse_0, …, dout]` → `[do_0, dlse_0, …]`.
pub fn merge_backward(x: &[&Tensor]) -> Result<Vec<Tensor>> {
    let op = "attention_merge_backward";
    let Some((dout, rest)) = x.split_last() else {
        return Err(RuntimeError::Binding(format!("{op} takes inputs")));
    };
    let (ts, [b, s, h, d]) = pairs(op, rest)?;
    let views = ts.iter().map(read::<f32>).collect::<Result<Vec<_>>>()?;
    let (os, ls) = split(&views);
    if dout.dims() != [b, s, h, d] {
        return Err(RuntimeError::Binding(format!("{op}: dout {:?} must match out", dout.dims())));
    }
    let (dout, merged) = (contiguous(dout)?, merge(rest)?);
    let (g, merged) = (read::<f32>(&dout)?, read::<f32>(&merged)?);
    let (g, merged): (&[f32], &[f32]) = (&g, &merged);
    let mut dos = vec![vec![0f32; g.len()]; os.len()];
    let mut dls = vec![vec![0f32; b * h * s]; os.len()];
    let mut w = vec![0f32; os.len()];
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    for (o, li) in rows(b, s, h, d) {
        weights(&ls, li, &mut w);
        let grow = &g[o..o + d];
        let whole = dot(grow, &merged[o..o + d]);
        for (r, &wr) in w.iter().enumerate() {
            if wr == 0.0 {
                continue;
            }
            dos[r][o..o + d].iter_mut().zip(grow).for_each(|(a, v)| *a = wr * v);
            dls[r][li] = wr * (dot(grow, &os[r][o..o + d]) - whole);
        }
    }
    let mut out = Vec::with_capacity(2 * os.len());
    for (o, l) in dos.into_iter().zip(dls) {
        out.push(from_vec(o, &[b, s, h, d])?);
        out.push(from_vec(l, &[b, h, s])?);
    }
    Ok(out)
}

/// `Op::RingMerge`: `x` is `[o_run, lse_run, o_s, lse_s, ..]` → `[o, lse]`, the two pairs'
/// merge and `log(exp(lse_run) + exp(lse_s))` (a last merge's further inputs, its own q, k,
/// v, feed only its backward).
pub fn ring_merge(x: &[&Tensor]) -> Result<Vec<Tensor>> {
    let Some(pair) = x.get(..4) else {
        return Err(RuntimeError::Binding(format!(
            "ring_merge takes 4 or 7 inputs, got {}",
            x.len()
        )));
    };
    let o = merge(pair)?;
    let (l0, l1) = (contiguous(pair[1])?, contiguous(pair[3])?);
    let (a, b) = (read::<f32>(&l0)?, read::<f32>(&l1)?);
    let lse: Vec<f32> = a
        .iter()
        .zip(b.iter())
        .map(|(&a, &b)| {
            let m = a.max(b);
            if m == f32::NEG_INFINITY {
                m
            } else {
                m + ((a - m).exp() + (b - m).exp()).ln()
            }
        })
        .collect();
    let dims = pair[1].dims().to_vec();
    Ok(vec![o, from_vec(lse, &dims)?])
}
