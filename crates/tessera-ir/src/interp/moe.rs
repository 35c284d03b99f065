//! The reference interpreter's mixture-of-experts ops: top-k, gathers and scatters along the
//! last dim, slot assignment under a capacity, dispatch, combine and the slot dot products.

use super::kernels::*;
use super::Value;
use crate::Shape;
use std::cmp::Ordering;

/// The ranking order of top-k: larger first, a NaN above every number; equal values compare
/// equal, so a stable sort keeps the lower index first.
pub(super) fn rank_order(a: f64, b: f64) -> Ordering {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Less,
        (false, true) => Ordering::Greater,
        (false, false) => b.partial_cmp(&a).unwrap_or(Ordering::Equal),
    }
}

pub(super) fn top_k(x: &Value, k: usize) -> Result<Vec<Value>, String> {
    let n = last_dim(x)?;
    ensure!(k >= 1 && k <= n, "k = {k} must be in 1..={n}");
    let rows = x.numel() / n;
    let (mut vals, mut idx) = (Vec::with_capacity(rows * k), Vec::with_capacity(rows * k));
    for row in x.data.chunks(n) {
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&i, &j| rank_order(row[i], row[j]));
        for &i in &order[..k] {
            vals.push(row[i]);
            idx.push(i as f64);
        }
    }
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rank checked") = k;
    Ok(vec![Value { shape: Shape::from(dims.clone()), data: vals }, Value::new(dims, idx)])
}

pub(super) fn take_along(x: &Value, idx: &Value) -> Result<Value, String> {
    let (n, k) = (last_dim(x)?, last_dim(idx)?);
    ensure!(
        x.numel() / n.max(1) == idx.numel() / k.max(1),
        "x {} vs indices {}",
        x.shape,
        idx.shape
    );
    let mut data = Vec::with_capacity(idx.numel());
    if k > 0 {
        for (r, row) in idx.data.chunks(k).enumerate() {
            for &i in row {
                data.push(x.data[r * n + index_in(i, n, "index")?]);
            }
        }
    }
    Ok(Value { shape: idx.shape.clone(), data })
}

pub(super) fn scatter_along(idx: &Value, src: &Value, size: usize) -> Result<Value, String> {
    ensure!(idx.shape == src.shape, "indices {} vs src {}", idx.shape, src.shape);
    let k = last_dim(idx)?;
    let mut dims = idx.dims().to_vec();
    *dims.last_mut().expect("rank checked") = size;
    let mut out = Value::zeros(dims);
    if k > 0 {
        for (r, (row, s)) in idx.data.chunks(k).zip(src.data.chunks(k)).enumerate() {
            for (&i, &v) in row.iter().zip(s) {
                out.data[r * size + index_in(i, size, "index")?] += v;
            }
        }
    }
    Ok(out)
}

/// `slots [.., n, k]`: the assignments per group (`n·k`).
fn per_group(slots: &Value) -> Result<usize, String> {
    let d = slots.dims();
    ensure!(d.len() >= 2, "slots {} must be [.., tokens, k]", slots.shape);
    Ok(d[d.len() - 2] * d[d.len() - 1])
}

/// Slots in row-major `(n, j)` order within each group (the leading dims): each expert's
/// first `capacity` assignments of the group, the rest −1.
pub(super) fn moe_slots(idx: &Value, experts: usize, capacity: usize) -> Result<Value, String> {
    let per = per_group(idx)?;
    let mut data = Vec::with_capacity(idx.numel());
    for group in idx.data.chunks(per.max(1)) {
        let mut used = vec![0usize; experts];
        for &e in group {
            let e = index_in(e, experts, "expert index")?;
            data.push(if used[e] < capacity { (e * capacity + used[e]) as f64 } else { -1.0 });
            used[e] += 1;
        }
    }
    Ok(Value { shape: idx.shape.clone(), data })
}

/// Assignment `a`'s row of the buffer: its group's block of `rows` rows, then its slot.
fn buffer_row(a: usize, s: f64, per: usize, rows: usize) -> Result<usize, String> {
    Ok((a / per.max(1)) * rows + index_in(s, rows, "slot")?)
}

/// Each buffer row's assignment (None: padding); a slot used twice is an error. `rows`: the
/// rows of one group's buffer (`E·C`).
fn slot_owners(slots: &Value, rows: usize, total: usize) -> Result<Vec<Option<usize>>, String> {
    let per = per_group(slots)?;
    let mut owner = vec![None; total];
    for (a, &s) in slots.data.iter().enumerate() {
        if s == -1.0 {
            continue;
        }
        let r = buffer_row(a, s, per, rows)?;
        ensure!(r < total, "slot {s} of assignment {a} is past the buffer");
        ensure!(owner[r].is_none(), "slot {s} is assigned twice: slots must come from moe_slots");
        owner[r] = Some(a);
    }
    Ok(owner)
}

fn weight(w: Option<&Value>, a: usize) -> f64 {
    w.map_or(1.0, |w| w.data[a])
}

/// The rows of one group's buffer `[.., E, C, H]`: `E·C`.
fn group_rows(buf_dims: &[usize]) -> usize {
    let r = buf_dims.len();
    buf_dims[r - 3] * buf_dims[r - 2]
}

pub(super) fn moe_dispatch(
    x: &Value,
    slots: &Value,
    w: Option<&Value>,
    experts: usize,
    capacity: usize,
) -> Result<Value, String> {
    let (h, k) = (last_dim(x)?, last_dim(slots)?);
    let sd = slots.dims();
    let mut dims = sd[..sd.len() - 2].to_vec();
    dims.extend([experts, capacity, h]);
    let mut out = Value::zeros(dims);
    let rows = experts * capacity;
    let owners = slot_owners(slots, rows, out.numel() / h.max(1))?;
    for (s, owner) in owners.iter().enumerate() {
        if let Some(a) = *owner {
            let (n, c) = (a / k.max(1), weight(w, a));
            for (o, &v) in out.data[s * h..(s + 1) * h].iter_mut().zip(&x.data[n * h..]) {
                *o = c * v;
            }
        }
    }
    Ok(out)
}

pub(super) fn moe_combine(y: &Value, slots: &Value, w: Option<&Value>) -> Result<Value, String> {
    let (h, k) = (last_dim(y)?, last_dim(slots)?);
    ensure!(y.dims().len() >= 3, "expert outputs {} must be [.., E, C, H]", y.shape);
    let (rows, per) = (group_rows(y.dims()), per_group(slots)?);
    let sd = slots.dims();
    let mut dims = sd[..sd.len() - 1].to_vec();
    dims.push(h);
    let mut out = Value::zeros(dims);
    for (a, &s) in slots.data.iter().enumerate() {
        if s == -1.0 {
            continue;
        }
        let (s, c) = (buffer_row(a, s, per, rows)?, weight(w, a));
        let t = a / k;
        for (o, &v) in out.data[t * h..(t + 1) * h].iter_mut().zip(&y.data[s * h..]) {
            *o += c * v;
        }
    }
    Ok(out)
}

pub(super) fn moe_slot_dot(buf: &Value, x: &Value, slots: &Value) -> Result<Value, String> {
    let (h, k) = (last_dim(x)?, last_dim(slots)?);
    ensure!(buf.dims().len() >= 3, "buffer {} must be [.., E, C, H]", buf.shape);
    let (rows, per) = (group_rows(buf.dims()), per_group(slots)?);
    let mut data = vec![0.0; slots.numel()];
    for (a, &s) in slots.data.iter().enumerate() {
        if s == -1.0 {
            continue;
        }
        let (s, t) = (buffer_row(a, s, per, rows)?, a / k);
        data[a] = (0..h).map(|i| buf.data[s * h + i] * x.data[t * h + i]).sum();
    }
    Ok(Value { shape: slots.shape.clone(), data })
}
