//! Mixture-of-experts routing kernels: top-k, gathers and scatters along the last dim, slot
//! assignment under a capacity, dispatch into the expert-batched buffer, the weighted combine
//! and the slot dot products (`tessera_ir::ops::moe` defines them).
//!
//! Every kernel is deterministic and race-free without atomics: slot assignment is one serial
//! pass in token order (it defines the drop order); dispatch inverts the slot map first and
//! fills buffer rows in parallel, each from its one owner; combine and the dot products fill
//! token rows in parallel, each summing its `k` choices in order in f64.

use super::elementwise::{expect_f32, expect_i64};
use super::reduce::par_rows;
use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::Tensor;
use std::cmp::Ordering;

fn bad(op: &str, msg: String) -> RuntimeError {
    RuntimeError::Binding(format!("{op}: {msg}"))
}

fn last(t: &Tensor, op: &str) -> Result<usize> {
    t.dims().last().copied().ok_or_else(|| bad(op, "needs at least one dim, got a scalar".into()))
}

/// `i` as an index in `0..bound`, or a data error naming it.
fn index(op: &str, what: &str, i: i64, bound: usize) -> Result<usize> {
    if i >= 0 && (i as u64) < bound as u64 {
        Ok(i as usize)
    } else {
        Err(RuntimeError::Data(format!("{op}: {what} {i} is outside 0..{bound}")))
    }
}

/// Larger first, NaN above every number, equal values equal (a stable sort keeps the lower
/// index first) — the interpreter's order.
fn rank_order(a: f32, b: f32) -> Ordering {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Less,
        (false, true) => Ordering::Greater,
        (false, false) => b.partial_cmp(&a).unwrap_or(Ordering::Equal),
    }
}

/// `[.., n]` → `[values [.., k], indices [.., k] i64]`.
pub fn top_k(x: &Tensor, k: usize) -> Result<Vec<Tensor>> {
    expect_f32(x, "top_k", "x")?;
    let n = last(x, "top_k")?;
    if k == 0 || k > n {
        return Err(bad("top_k", format!("k = {k} must be in 1..={n}")));
    }
    let xc = contiguous(x)?;
    let xs = read::<f32>(&xc)?;
    let rows = xs.len() / n;
    let mut vals = vec![0f32; rows * k];
    let mut idx = vec![0i64; rows * k];
    // Indices first (parallel over rows), values gathered after.
    par_rows(&mut idx, k, |r, out| {
        let row = &xs[r * n..(r + 1) * n];
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&i, &j| rank_order(row[i], row[j]));
        for (o, &i) in out.iter_mut().zip(&order) {
            *o = i as i64;
        }
    });
    for (r, (v, i)) in vals.chunks_mut(k).zip(idx.chunks(k)).enumerate() {
        for (v, &i) in v.iter_mut().zip(i) {
            *v = xs[r * n + i as usize];
        }
    }
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rank checked") = k;
    Ok(vec![from_vec(vals, &dims)?, from_vec(idx, &dims)?])
}

/// `[x [.., n], idx [.., k]]` → `[.., k]`.
pub fn take_along(x: &Tensor, idx: &Tensor) -> Result<Tensor> {
    expect_f32(x, "take_along", "x")?;
    expect_i64(idx, "take_along", "indices")?;
    let (n, k) = (last(x, "take_along")?, last(idx, "take_along")?);
    let (xc, ic) = (contiguous(x)?, contiguous(idx)?);
    let (xs, is) = (read::<f32>(&xc)?, read::<i64>(&ic)?);
    if xs.len() / n.max(1) != is.len() / k.max(1) {
        return Err(bad("take_along", format!("x {:?} vs indices {:?}", x.dims(), idx.dims())));
    }
    let mut out = vec![0f32; is.len()];
    for (a, (o, &i)) in out.iter_mut().zip(is.iter()).enumerate() {
        *o = xs[(a / k) * n + index("take_along", "index", i, n)?];
    }
    from_vec(out, idx.dims())
}

/// `[idx [.., k], src [.., k]]` → `[.., size]`, repeated indices adding in order (in f64).
pub fn scatter_along(idx: &Tensor, src: &Tensor, size: usize) -> Result<Tensor> {
    expect_i64(idx, "scatter_along", "indices")?;
    expect_f32(src, "scatter_along", "src")?;
    if idx.dims() != src.dims() {
        return Err(bad("scatter_along", format!("{:?} vs {:?}", idx.dims(), src.dims())));
    }
    let k = last(idx, "scatter_along")?;
    let (ic, sc) = (contiguous(idx)?, contiguous(src)?);
    let (is, ss) = (read::<i64>(&ic)?, read::<f32>(&sc)?);
    for &i in is.iter() {
        index("scatter_along", "index", i, size)?;
    }
    let rows = is.len().checked_div(k).unwrap_or(0);
    let mut out = vec![0f32; rows * size];
    if size > 0 && k > 0 {
        par_rows(&mut out, size, |r, orow| {
            let mut acc = vec![0f64; size];
            for (&i, &v) in is[r * k..(r + 1) * k].iter().zip(&ss[r * k..(r + 1) * k]) {
                acc[i as usize] += v as f64;
            }
            for (o, a) in orow.iter_mut().zip(&acc) {
                *o = *a as f32;
            }
        });
    }
    let mut dims = idx.dims().to_vec();
    *dims.last_mut().expect("rank checked") = size;
    from_vec(out, &dims)
}

/// `[.., n, k]`: the assignments of one group (`n·k`) and `k`.
fn group_shape(t: &Tensor, op: &str, what: &str) -> Result<(usize, usize)> {
    match t.dims() {
        &[.., n, k] => Ok((n * k, k)),
        d => Err(bad(op, format!("{what} {d:?} must be [.., tokens, k]"))),
    }
}

/// Each expert's first `capacity` assignments of each group (the leading dims) in row-major
/// `(n, j)` order; the rest −1.
pub fn moe_slots(idx: &Tensor, experts: usize, capacity: usize) -> Result<Tensor> {
    expect_i64(idx, "moe_slots", "expert indices")?;
    let (per, _) = group_shape(idx, "moe_slots", "expert indices")?;
    let ic = contiguous(idx)?;
    let is = read::<i64>(&ic)?;
    let mut out = Vec::with_capacity(is.len());
    for group in is.chunks(per.max(1)) {
        let mut used = vec![0usize; experts];
        for &e in group {
            let e = index("moe_slots", "expert index", e, experts)?;
            out.push(if used[e] < capacity { (e * capacity + used[e]) as i64 } else { -1 });
            used[e] += 1;
        }
    }
    from_vec(out, idx.dims())
}

/// The rows of one group's buffer `[.., E, C, H]` (`E·C`).
fn group_rows(buf: &Tensor, op: &str) -> Result<usize> {
    match buf.dims() {
        &[.., e, c, _] => Ok(e * c),
        d => Err(bad(op, format!("buffer {d:?} must be [.., experts, capacity, hidden]"))),
    }
}

/// `slots` as rows of the whole buffer (each group's block of `rows` rows, then the slot), or
/// −1; and `k`.
fn read_slots(slots: &Tensor, rows: usize, op: &str) -> Result<(Vec<i64>, usize)> {
    expect_i64(slots, op, "slots")?;
    let (per, k) = group_shape(slots, op, "slots")?;
    let sc = contiguous(slots)?;
    let mut ss = read::<i64>(&sc)?.to_vec();
    for (a, s) in ss.iter_mut().enumerate() {
        if *s != -1 {
            *s = ((a / per.max(1)) * rows + index(op, "slot", *s, rows)?) as i64;
        }
    }
    Ok((ss, k))
}

/// Token rows `[.., n, H]` must match the slots' `[.., n, k]`.
fn check_rows(x: &Tensor, slots: &Tensor, op: &str) -> Result<()> {
    let (xd, sd) = (x.dims(), slots.dims());
    if xd.len() == sd.len() && xd[..xd.len() - 1] == sd[..sd.len() - 1] {
        Ok(())
    } else {
        Err(bad(op, format!("rows {xd:?} and slots {sd:?} disagree")))
    }
}

fn read_weights(w: Option<&Tensor>, slots: &Tensor, op: &str) -> Result<Option<Vec<f32>>> {
    match w {
        None => Ok(None),
        Some(w) => {
            expect_f32(w, op, "weights")?;
            if w.dims() != slots.dims() {
                return Err(bad(op, format!("weights {:?} vs slots {:?}", w.dims(), slots.dims())));
            }
            let wc = contiguous(w)?;
            let v = read::<f32>(&wc)?.to_vec();
            Ok(Some(v))
        }
    }
}

/// `[x [.., n, H], slots [.., n, k] (, weights)]` → `[.., E, C, H]`.
pub fn moe_dispatch(
    x: &Tensor,
    slots: &Tensor,
    w: Option<&Tensor>,
    experts: usize,
    capacity: usize,
) -> Result<Tensor> {
    expect_f32(x, "moe_dispatch", "x")?;
    let h = last(x, "moe_dispatch")?;
    let sd = slots.dims();
    let lead = &sd[..sd.len().saturating_sub(2)];
    let total = lead.iter().product::<usize>() * experts * capacity;
    let (ss, k) = read_slots(slots, experts * capacity, "moe_dispatch")?;
    check_rows(x, slots, "moe_dispatch")?;
    let ws = read_weights(w, slots, "moe_dispatch")?;
    let mut owner = vec![usize::MAX; total];
    for (a, &s) in ss.iter().enumerate() {
        if s == -1 {
            continue;
        }
        if owner[s as usize] != usize::MAX {
            return Err(RuntimeError::Data(format!(
                "moe_dispatch: slot {s} is assigned twice: slots must come from moe_slots"
            )));
        }
        owner[s as usize] = a;
    }
    let xc = contiguous(x)?;
    let xs = read::<f32>(&xc)?;
    let mut out = vec![0f32; total * h];
    if h > 0 {
        par_rows(&mut out, h, |s, orow| {
            let a = owner[s];
            if a == usize::MAX {
                return;
            }
            let t = a / k;
            let src = &xs[t * h..(t + 1) * h];
            match &ws {
                None => orow.copy_from_slice(src),
                Some(ws) => {
                    for (o, &v) in orow.iter_mut().zip(src) {
                        *o = ws[a] * v;
                    }
                }
            }
        });
    }
    let mut dims = lead.to_vec();
    dims.extend([experts, capacity, h]);
    from_vec(out, &dims)
}

/// `[y [.., E, C, H], slots [.., n, k] (, weights)]` → `[.., n, H]`.
pub fn moe_combine(y: &Tensor, slots: &Tensor, w: Option<&Tensor>) -> Result<Tensor> {
    expect_f32(y, "moe_combine", "y")?;
    let h = last(y, "moe_combine")?;
    let (ss, k) = read_slots(slots, group_rows(y, "moe_combine")?, "moe_combine")?;
    let ws = read_weights(w, slots, "moe_combine")?;
    let n = slots.elem_count().checked_div(k).unwrap_or(0);
    let yc = contiguous(y)?;
    let ys = read::<f32>(&yc)?;
    if ss.iter().any(|&s| s != -1 && (s as usize + 1) * h > ys.len()) {
        return Err(bad("moe_combine", format!("slots past the buffer {:?}", y.dims())));
    }
    let mut out = vec![0f32; n * h];
    if h > 0 {
        par_rows(&mut out, h, |t, orow| {
            let mut acc = vec![0f64; h];
            for j in 0..k {
                let a = t * k + j;
                if ss[a] == -1 {
                    continue;
                }
                let c = ws.as_ref().map_or(1.0, |ws| ws[a] as f64);
                let s = ss[a] as usize;
                for (q, &v) in acc.iter_mut().zip(&ys[s * h..(s + 1) * h]) {
                    *q += c * v as f64;
                }
            }
            for (o, q) in orow.iter_mut().zip(&acc) {
                *o = *q as f32;
            }
        });
    }
    let sd = slots.dims();
    let mut dims = sd[..sd.len() - 1].to_vec();
    dims.push(h);
    from_vec(out, &dims)
}

/// `[buf [.., E, C, H], x [.., n, H], slots [.., n, k]]` → `[.., n, k]`.
pub fn moe_slot_dot(buf: &Tensor, x: &Tensor, slots: &Tensor) -> Result<Tensor> {
    expect_f32(buf, "moe_slot_dot", "buf")?;
    expect_f32(x, "moe_slot_dot", "x")?;
    let h = last(x, "moe_slot_dot")?;
    let (ss, k) = read_slots(slots, group_rows(buf, "moe_slot_dot")?, "moe_slot_dot")?;
    check_rows(x, slots, "moe_slot_dot")?;
    let n = slots.elem_count().checked_div(k).unwrap_or(0);
    let (bc, xc) = (contiguous(buf)?, contiguous(x)?);
    let (bs, xs) = (read::<f32>(&bc)?, read::<f32>(&xc)?);
    if ss.iter().any(|&s| s != -1 && (s as usize + 1) * h > bs.len()) {
        return Err(bad("moe_slot_dot", format!("slots past the buffer {:?}", buf.dims())));
    }
    let mut out = vec![0f32; n * k];
    if k > 0 {
        par_rows(&mut out, k, |t, orow| {
            for (j, o) in orow.iter_mut().enumerate() {
                let s = ss[t * k + j];
                if s == -1 {
                    continue;
                }
                let s = s as usize;
                let dot: f64 = bs[s * h..(s + 1) * h]
                    .iter()
                    .zip(&xs[t * h..(t + 1) * h])
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
                *o = dot as f32;
            }
        });
    }
    from_vec(out, slots.dims())
}
