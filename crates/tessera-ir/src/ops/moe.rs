//! Mixture-of-experts routing: top-k, gathers and scatters along the last dim, and the
//! capacity-bounded dispatch of tokens to experts and their weighted combine — shape
//! inference, FLOPs and VJPs.
//!
//! The experts themselves are no op of their own: expert-batched tokens `[E, C, H]` times
//! stacked expert weights `[E, H, F]` is the batched [`Op::MatMul`] (batch dim E), with its
//! FLOPs (`2·E·C·H·F`, counted on every capacity row, padding included), VJP, kernels and
//! sharding rule (E is a batch label, the expert-parallel split to come).
//!
//! # Capacity and drops
//!
//! Routing is per **group** (GShard's groups): every routing op may carry leading dims
//! `[G.., n, ·]`, each group routed on its own into its own buffer `[G.., E, C, ·]`.
//! [`Op::MoeSlots`] turns each token's chosen experts `[.., n, k]` into slots of its group's
//! expert-batched buffer `[E, C, ·]`: assignment `(n, j)` (token `n`'s `j`-th choice, expert
//! `e`) gets slot `e·C + c`, `c` the number of assignments to `e` in the same group that come
//! before it in row-major `(n, j)` order — so each expert's rows hold its tokens in token
//! order — or `−1` when `c ≥ C`: the expert is full for that group and that assignment is
//! **dropped** (the token gets nothing from that expert; its other choices stand). As top-k
//! picks distinct experts per token, every expert keeps the `C` earliest tokens of each group.
//! Dropless routing is `C = n` ([`capacity`]). Slots of the buffer no token fills are zero
//! padding; the Program holds the whole buffer. A group's slots never depend on another
//! group's tokens, so a plan that splits the groups over devices drops exactly what one
//! device drops.

use super::{expect_float, expect_inputs, expect_int, Flops, Op};
use crate::autodiff::{Grad, VjpCtx};
use crate::{DType, Result, Shape, TensorMeta};

/// The static per-expert capacity for `tokens` tokens each routed to `k` of `experts`
/// experts: `ceil(factor · tokens · k / experts)` capped at `tokens` (an expert receives at
/// most one assignment per token), at least 1; `None` is dropless (`tokens`: every token
/// fits). Megatron-LM's and GShard's capacity factor.
pub fn capacity(tokens: usize, k: usize, experts: usize, factor: Option<f64>) -> usize {
    match factor {
        None => tokens.max(1),
        Some(f) => {
            let per = f * tokens as f64 * k as f64 / experts.max(1) as f64;
            (per.ceil().max(1.0) as usize).min(tokens.max(1))
        }
    }
}

fn leading<'a>(m: &'a TensorMeta, what: &str) -> Result<(&'a [usize], usize), String> {
    let d = m.shape.dims();
    match d.split_last() {
        Some((&last, lead)) => Ok((lead, last)),
        None => Err(format!("{what} {m} needs at least one dim")),
    }
}

/// `[x [.., n]]` → `[values [.., k] (x's dtype), indices [.., k] i64]`.
pub(crate) fn infer_top_k(x: &[&TensorMeta], k: usize) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    expect_float(x[0], "operand")?;
    let (lead, n) = leading(x[0], "operand")?;
    if k == 0 || k > n {
        return Err(format!("k = {k} must be in 1..={n} (the last dim of {})", x[0]));
    }
    let mut dims = lead.to_vec();
    dims.push(k);
    Ok(vec![
        TensorMeta { shape: Shape::from(dims.clone()), dtype: x[0].dtype },
        TensorMeta { shape: Shape::from(dims), dtype: DType::I64 },
    ])
}

/// `[x [.., n], idx [.., k]]` → `[.., k]`.
pub(crate) fn infer_take_along(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    expect_float(x[0], "x")?;
    expect_int(x[1], "indices")?;
    let (lx, _) = leading(x[0], "x")?;
    let (li, _) = leading(x[1], "indices")?;
    if lx != li {
        return Err(format!("x {} and indices {} must agree on all but the last dim", x[0], x[1]));
    }
    Ok(vec![TensorMeta { shape: x[1].shape.clone(), dtype: x[0].dtype }])
}

/// `[idx [.., k], src [.., k]]` → `[.., size]`.
pub(crate) fn infer_scatter_along(
    x: &[&TensorMeta],
    size: usize,
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    expect_int(x[0], "indices")?;
    expect_float(x[1], "src")?;
    if x[0].shape != x[1].shape {
        return Err(format!("indices {} and src {} must have one shape", x[0], x[1]));
    }
    let (lead, _) = leading(x[0], "indices")?;
    let mut dims = lead.to_vec();
    dims.push(size);
    Ok(vec![TensorMeta { shape: Shape::from(dims), dtype: x[1].dtype }])
}

/// Routes `[.., n, k]` (integer): the group dims, `n` and `k`.
fn expect_routes<'a>(m: &'a TensorMeta, what: &str) -> Result<(&'a [usize], usize, usize), String> {
    expect_int(m, what)?;
    let d = m.shape.dims();
    match d.len() {
        r if r >= 2 => Ok((&d[..r - 2], d[r - 2], d[r - 1])),
        _ => Err(format!("{what} {m} must be [.., tokens, k]")),
    }
}

/// `[indices [.., n, k]]` → `[slots [.., n, k] i64]`.
pub(crate) fn infer_slots(
    x: &[&TensorMeta],
    experts: usize,
    capacity: usize,
) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 1)?;
    expect_routes(x[0], "expert indices")?;
    if experts == 0 || capacity == 0 {
        return Err(format!("experts ({experts}) and capacity ({capacity}) must be positive"));
    }
    Ok(vec![TensorMeta { shape: x[0].shape.clone(), dtype: DType::I64 }])
}

/// The optional third input: weights `[.., n, k]` of the rows' dtype.
fn check_weights(x: &[&TensorMeta], slots: &TensorMeta, dtype: DType) -> Result<(), String> {
    if x.len() != 2 && x.len() != 3 {
        return Err(format!("expects 2 or 3 inputs (the third: weights), got {}", x.len()));
    }
    if let Some(w) = x.get(2) {
        if w.shape != slots.shape || w.dtype != dtype {
            return Err(format!("weights {w} must be {dtype} of the slots' shape {}", slots.shape));
        }
    }
    Ok(())
}

/// `[x [.., n, H], slots [.., n, k] (, weights [.., n, k])]` → `[.., E, C, H]`.
pub(crate) fn infer_dispatch(
    x: &[&TensorMeta],
    experts: usize,
    capacity: usize,
) -> Result<Vec<TensorMeta>, String> {
    let Some((&tokens, &slots)) = x.first().zip(x.get(1)) else {
        return Err(format!("expects 2 or 3 inputs, got {}", x.len()));
    };
    expect_float(tokens, "tokens")?;
    let (groups, n, _) = expect_routes(slots, "slots")?;
    let td = tokens.shape.dims();
    if td.len() != groups.len() + 2 || &td[..groups.len()] != groups || td[groups.len()] != n {
        return Err(format!(
            "tokens {tokens} and slots {slots} disagree on the groups or the token count"
        ));
    }
    if experts == 0 || capacity == 0 {
        return Err(format!("experts ({experts}) and capacity ({capacity}) must be positive"));
    }
    check_weights(x, slots, tokens.dtype)?;
    let mut dims = groups.to_vec();
    dims.extend([experts, capacity, td[groups.len() + 1]]);
    Ok(vec![TensorMeta { shape: Shape::from(dims), dtype: tokens.dtype }])
}

/// `[y [.., E, C, H], slots [.., n, k] (, weights [.., n, k])]` → `[.., n, H]`.
pub(crate) fn infer_combine(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    let Some((&y, &slots)) = x.first().zip(x.get(1)) else {
        return Err(format!("expects 2 or 3 inputs, got {}", x.len()));
    };
    expect_float(y, "expert outputs")?;
    let (groups, n, _) = expect_routes(slots, "slots")?;
    let yd = y.shape.dims();
    if yd.len() != groups.len() + 3 || &yd[..groups.len()] != groups {
        return Err(format!(
            "expert outputs {y} must be [.., experts, capacity, hidden] as {slots}"
        ));
    }
    check_weights(x, slots, y.dtype)?;
    let mut dims = groups.to_vec();
    dims.extend([n, yd[groups.len() + 2]]);
    Ok(vec![TensorMeta { shape: Shape::from(dims), dtype: y.dtype }])
}

/// `[buf [.., E, C, H], x [.., n, H], slots [.., n, k]]` → `[.., n, k]`.
pub(crate) fn infer_slot_dot(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 3)?;
    let (groups, n, _) = expect_routes(x[2], "slots")?;
    let (bd, xd) = (x[0].shape.dims(), x[1].shape.dims());
    let g = groups.len();
    let ok = bd.len() == g + 3
        && xd.len() == g + 2
        && &bd[..g] == groups
        && &xd[..g] == groups
        && xd[g] == n
        && bd[g + 2] == xd[g + 1]
        && x[0].dtype == x[1].dtype;
    if !ok {
        return Err(format!(
            "buffer {} must be [.., E, C, H], rows {} [.., n, H] as slots {}",
            x[0], x[1], x[2]
        ));
    }
    Ok(vec![TensorMeta { shape: x[2].shape.clone(), dtype: x[1].dtype }])
}

/// A k-pass selection: one comparison per element per selected value.
pub(crate) fn flops_top_k(x: &[&TensorMeta], k: usize) -> Flops {
    Flops::other(x[0].numel() * k as u64)
}

/// One add per scattered element.
pub(crate) fn flops_scatter(x: &[&TensorMeta]) -> Flops {
    Flops::other(x[1].numel())
}

/// Per assignment (dropped ones included: FLOPs follow shapes), one multiply per hidden
/// element when weighted; a copy otherwise.
pub(crate) fn flops_dispatch(x: &[&TensorMeta]) -> Flops {
    if x.len() == 3 {
        Flops::other(x[1].numel() * x[0].shape.last() as u64)
    } else {
        Flops::default()
    }
}

/// Per assignment and hidden element, a multiply-add when weighted, an add otherwise.
pub(crate) fn flops_combine(x: &[&TensorMeta]) -> Flops {
    let per = if x.len() == 3 { 2 } else { 1 };
    Flops::other(per * x[1].numel() * x[0].shape.last() as u64)
}

/// A dot product of H elements per assignment.
pub(crate) fn flops_slot_dot(x: &[&TensorMeta]) -> Flops {
    Flops::other(2 * x[2].numel() * x[1].shape.last() as u64)
}

/// The values' gradient goes back to the positions they were taken from; indices have none.
pub(crate) fn vjp_top_k(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Grad>>> {
    if cx.dout[0].is_none() {
        return Ok(vec![None]);
    }
    let dy = cx.dy(0)?;
    let size = cx.b.shape(cx.x(0)).last();
    let g = cx.b.push1(Op::ScatterAlong { size }, &[cx.y(1), dy])?;
    Ok(vec![Some(Grad::Full(g))])
}

pub(crate) fn vjp_take_along(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let size = cx.b.shape(cx.x(0)).last();
    let g = cx.b.push1(Op::ScatterAlong { size }, &[cx.x(1), dy])?;
    Ok(vec![Some(Grad::Full(g)), None])
}

pub(crate) fn vjp_scatter_along(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    let g = cx.b.push1(Op::TakeAlong, &[dy, cx.x(0)])?;
    Ok(vec![None, Some(Grad::Full(g))])
}

/// Dispatch and combine are each other's adjoints: the rows' gradient of a dispatch is the
/// combine of the buffer's gradient with the same weights (and vice versa); a weight's is the
/// dot product of its token's row with its slot's row.
pub(crate) fn vjp_dispatch(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Grad>>> {
    let dbuf = cx.dy(0)?;
    let (x, slots) = (cx.x(0), cx.x(1));
    let weighted = cx.node_inputs() == 3;
    let mut grads = vec![None; cx.node_inputs()];
    if cx.needs[0] {
        let mut ins = vec![dbuf, slots];
        if weighted {
            ins.push(cx.x(2));
        }
        grads[0] = Some(Grad::Full(cx.b.push1(Op::MoeCombine, &ins)?));
    }
    if weighted && cx.needs[2] {
        grads[2] = Some(Grad::Full(cx.b.push1(Op::MoeSlotDot, &[dbuf, x, slots])?));
    }
    Ok(grads)
}

pub(crate) fn vjp_combine(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Grad>>> {
    let dout = cx.dy(0)?;
    let (y, slots) = (cx.x(0), cx.x(1));
    let weighted = cx.node_inputs() == 3;
    let mut grads = vec![None; cx.node_inputs()];
    if cx.needs[0] {
        let d = cx.b.shape(y).dims().to_vec();
        let r = d.len();
        let op = Op::MoeDispatch { experts: d[r - 3], capacity: d[r - 2] };
        let mut ins = vec![dout, slots];
        if weighted {
            ins.push(cx.x(2));
        }
        grads[0] = Some(Grad::Full(cx.b.push1(op, &ins)?));
    }
    if weighted && cx.needs[2] {
        grads[2] = Some(Grad::Full(cx.b.push1(Op::MoeSlotDot, &[y, dout, slots])?));
    }
    Ok(grads)
}
