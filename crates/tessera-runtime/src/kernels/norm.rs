//! LayerNorm and RMSNorm over the last dim, forward and backward.
//!
//! Rows run in parallel; row statistics and row sums are computed in f64 (and the per-element
//! formulas too: it removes the cancellation in `g − mean(g) − x̂·mean(g·x̂)` and in `x̂·w + b`;
//! f32 arithmetic there missed the kernel tests' bound near zero). The row sums keep
//! [`LANES`] independent f64 lanes, and outputs are written into uninitialised memory. The
//! backward passes recompute the
//! statistics from `x`, and accumulate dweight / dbias per group of rows into f64 partials
//! that are summed in group order: at most 64 groups, fixed by the shape, so results do not
//! depend on the thread count and no `[rows, D]` temporary exists.

use super::elementwise::{expect_f32, unsupported, CHUNK};
use super::reduce::par_rows;
use super::simd::wide;
use super::strided::fresh;
use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::Tensor;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Checks `x [.., D]`, `w [D]` (and `dy` like `x`); returns D.
fn check(op: &str, x: &Tensor, ws: &[(&Tensor, &str)], dy: Option<&Tensor>) -> Result<usize> {
    expect_f32(x, op, "x")?;
    let d = *x.dims().last().ok_or_else(|| unsupported(op, "x must have at least one dim"))?;
    for &(w, what) in ws {
        expect_f32(w, op, what)?;
        if w.dims() != [d] {
            return Err(RuntimeError::Binding(format!(
                "{op}: {what} {:?} must be [{d}] to match x {:?}",
                w.dims(),
                x.dims()
            )));
        }
    }
    if let Some(dy) = dy {
        expect_f32(dy, op, "dy")?;
        if dy.dims() != x.dims() {
            return Err(RuntimeError::Binding(format!(
                "{op}: dy {:?} must have x's shape {:?}",
                dy.dims(),
                x.dims()
            )));
        }
    }
    Ok(d)
}

/// (mean, 1/sqrt(var + eps)) of a row, biased variance, two passes in f64.
#[inline(always)]
fn row_stats(xr: &[f32], eps: f64) -> (f64, f64) {
    let n = xr.len() as f64;
    let mean = sum_by3(xr, xr, xr, |v, _, _| v as f64) / n;
    let var = sum_by3(xr, xr, xr, |v, _, _| {
        let c = v as f64 - mean;
        c * c
    }) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// 1/sqrt(mean(x²) + eps) of a row.
#[inline(always)]
fn rms_rstd(xr: &[f32], eps: f64) -> f64 {
    let ms = sum_by3(xr, xr, xr, |v, _, _| (v as f64) * (v as f64)) / xr.len() as f64;
    1.0 / (ms + eps).sqrt()
}

/// f64 lanes of [`sum_by3`]: four vectors of eight, so four additions are in flight at a time
/// (one chain of dependent vector additions made a row's sum wait on the adder's latency).
const LANES: usize = 32;

/// Σ f(a, b, c) over three equally long slices in [`LANES`] f64 lanes.
#[inline(always)]
fn sum_by3(a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f64) -> f64 {
    let mut acc = [0f64; LANES];
    let (mut ia, mut ib, mut ic) =
        (a.chunks_exact(LANES), b.chunks_exact(LANES), c.chunks_exact(LANES));
    for ((ca, cb), cc) in (&mut ia).zip(&mut ib).zip(&mut ic) {
        for (((s, &x), &y), &z) in acc.iter_mut().zip(ca).zip(cb).zip(cc) {
            *s += f(x, y, z);
        }
    }
    let tail: f64 = ia
        .remainder()
        .iter()
        .zip(ib.remainder())
        .zip(ic.remainder())
        .map(|((&x, &y), &z)| f(x, y, z))
        .sum();
    acc.iter().sum::<f64>() + tail
}

/// Rows per group for the backward passes: at most 64 groups of about [`CHUNK`] elements or
/// more, a function of the shape only.
fn rows_per_group(rows: usize, d: usize) -> usize {
    let groups = (rows * d / CHUNK).clamp(1, 64).min(rows.max(1));
    rows.div_ceil(groups).max(1)
}

/// Runs `row(r, dx_row, partials)` over every row, in groups with `k` f64 partial vectors of
/// length `d` each, and returns the partials summed in group order.
fn rows_with_partials(
    dx: &mut [MaybeUninit<f32>],
    d: usize,
    k: usize,
    row: impl Fn(usize, &mut [MaybeUninit<f32>], &mut [Vec<f64>]) + Sync,
) -> Vec<Vec<f64>> {
    let rows = dx.len() / d;
    let per = rows_per_group(rows, d);
    let group = |g: usize, chunk: &mut [MaybeUninit<f32>]| {
        let mut parts = vec![vec![0f64; d]; k];
        for (j, dxr) in chunk.chunks_mut(d).enumerate() {
            row(g * per + j, dxr, &mut parts);
        }
        parts
    };
    let partials: Vec<Vec<Vec<f64>>> = if rows <= per {
        vec![group(0, dx)]
    } else {
        dx.par_chunks_mut(per * d).enumerate().map(|(g, c)| group(g, c)).collect()
    };
    let mut it = partials.into_iter();
    let mut total = it.next().unwrap_or_else(|| vec![vec![0f64; d]; k]);
    for parts in it {
        for (t, p) in total.iter_mut().zip(&parts) {
            for (a, b) in t.iter_mut().zip(p) {
                *a += b;
            }
        }
    }
    total
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// y = (x − mean)/sqrt(var + eps)·w + b over the last dim (biased variance).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let d = check("layer_norm", x, &[(w, "weight"), (b, "bias")], None)?;
    let (xc, wc, bc) = (contiguous(x)?, contiguous(w)?, contiguous(b)?);
    let (xs, ws, bs) = (read::<f32>(&xc)?, read::<f32>(&wc)?, read::<f32>(&bc)?);
    let fill = |out: &mut [MaybeUninit<f32>]| {
        if d == 0 {
            return;
        }
        par_rows(out, d, |r, orow| {
            wide! {
                let xr = &xs[r * d..(r + 1) * d];
                let (mean, rstd) = row_stats(xr, eps);
                for (((o, &v), &w), &b) in orow.iter_mut().zip(xr).zip(ws.iter()).zip(bs.iter()) {
                    o.write(((v as f64 - mean) * rstd * w as f64 + b as f64) as f32);
                }
            }
        });
    };
    // SAFETY: `par_rows` hands every row of `out` to the closure, which writes all of it.
    let out = unsafe { fresh(xs.len(), fill) };
    from_vec(out, x.dims())
}

/// `[dx, dw, db]`. With x̂ = (x − mean)·rstd and g = dy·w:
/// dx = rstd·(g − mean(g) − x̂·mean(g·x̂)), dw = Σ_rows dy·x̂, db = Σ_rows dy.
pub fn layer_norm_backward(x: &Tensor, w: &Tensor, dy: &Tensor, eps: f64) -> Result<Vec<Tensor>> {
    let d = check("layer_norm_backward", x, &[(w, "weight")], Some(dy))?;
    let (xc, wc, gc) = (contiguous(x)?, contiguous(w)?, contiguous(dy)?);
    let (xs, ws, gs) = (read::<f32>(&xc)?, read::<f32>(&wc)?, read::<f32>(&gc)?);
    let mut sums = vec![vec![]; 2];
    let ws: &[f32] = &ws;
    let fill = |dx: &mut [MaybeUninit<f32>]| {
        if d == 0 {
            return;
        }
        sums = rows_with_partials(dx, d, 2, |r, dxr, parts| {
            wide! {
                let (xr, gr) = (&xs[r * d..(r + 1) * d], &gs[r * d..(r + 1) * d]);
                let (mean, rstd) = row_stats(xr, eps);
                let (dw, db) = parts.split_at_mut(1);
                for (((aw, ab), &v), &g) in dw[0].iter_mut().zip(db[0].iter_mut()).zip(xr).zip(gr) {
                    *aw += g as f64 * ((v as f64 - mean) * rstd);
                    *ab += g as f64;
                }
                let n = d as f64;
                let mean_g = sum_by3(gr, ws, ws, |g, w, _| g as f64 * w as f64) / n;
                let mean_gx =
                    sum_by3(gr, ws, xr, |g, w, v| g as f64 * w as f64 * ((v as f64 - mean) * rstd)) / n;
                for (((o, &v), &g), &w) in dxr.iter_mut().zip(xr).zip(gr).zip(ws) {
                    let xhat = (v as f64 - mean) * rstd;
                    o.write((rstd * (g as f64 * w as f64 - mean_g - xhat * mean_gx)) as f32);
                }
            }
        });
    };
    // SAFETY: `rows_with_partials` hands every row of `dx` to the closure, which writes all of it.
    let dx = unsafe { fresh(xs.len(), fill) };
    Ok(vec![
        from_vec(dx, x.dims())?,
        from_vec(to_f32(&sums[0]), &[d])?,
        from_vec(to_f32(&sums[1]), &[d])?,
    ])
}

/// y = x/sqrt(mean(x²) + eps)·w over the last dim.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let d = check("rms_norm", x, &[(w, "weight")], None)?;
    let (xc, wc) = (contiguous(x)?, contiguous(w)?);
    let (xs, ws) = (read::<f32>(&xc)?, read::<f32>(&wc)?);
    let fill = |out: &mut [MaybeUninit<f32>]| {
        if d == 0 {
            return;
        }
        par_rows(out, d, |r, orow| {
            wide! {
                let xr = &xs[r * d..(r + 1) * d];
                let rs = rms_rstd(xr, eps);
                for ((o, &v), &w) in orow.iter_mut().zip(xr).zip(ws.iter()) {
                    o.write((v as f64 * rs * w as f64) as f32);
                }
            }
        });
    };
    // SAFETY: `par_rows` hands every row of `out` to the closure, which writes all of it.
    let out = unsafe { fresh(xs.len(), fill) };
    from_vec(out, x.dims())
}

/// `[dx, dw]`. With r = 1/sqrt(mean(x²) + eps) and g = dy·w:
/// dx = r·g − x·r³·mean(g·x), dw = Σ_rows dy·x·r.
pub fn rms_norm_backward(x: &Tensor, w: &Tensor, dy: &Tensor, eps: f64) -> Result<Vec<Tensor>> {
    let d = check("rms_norm_backward", x, &[(w, "weight")], Some(dy))?;
    let (xc, wc, gc) = (contiguous(x)?, contiguous(w)?, contiguous(dy)?);
    let (xs, ws, gs) = (read::<f32>(&xc)?, read::<f32>(&wc)?, read::<f32>(&gc)?);
    let mut sums = vec![vec![]];
    let ws: &[f32] = &ws;
    let fill = |dx: &mut [MaybeUninit<f32>]| {
        if d == 0 {
            return;
        }
        sums = rows_with_partials(dx, d, 1, |r, dxr, parts| {
            wide! {
                let (xr, gr) = (&xs[r * d..(r + 1) * d], &gs[r * d..(r + 1) * d]);
                let rs = rms_rstd(xr, eps);
                for ((aw, &v), &g) in parts[0].iter_mut().zip(xr).zip(gr) {
                    *aw += g as f64 * v as f64 * rs;
                }
                let mean_gx = sum_by3(gr, ws, xr, |g, w, v| g as f64 * w as f64 * v as f64) / d as f64;
                let r3 = rs * rs * rs * mean_gx;
                for (((o, &v), &g), &w) in dxr.iter_mut().zip(xr).zip(gr).zip(ws) {
                    o.write((rs * (g as f64 * w as f64) - v as f64 * r3) as f32);
                }
            }
        });
    };
    // SAFETY: `rows_with_partials` hands every row of `dx` to the closure, which writes all of it.
    let dx = unsafe { fresh(xs.len(), fill) };
    Ok(vec![from_vec(dx, x.dims())?, from_vec(to_f32(&sums[0]), &[d])?])
}
