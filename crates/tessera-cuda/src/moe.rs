//! The mixture-of-experts routing ops on the GPU (kernels of `moe.cu`, each the CPU kernel's
//! arithmetic: `tessera-runtime`'s `kernels/moe.rs`), on f32 values and i64 indices (the
//! backend upcasts bf16 and f16 operands first and rounds the results to their declared
//! dtype, as the CPU backend does).
//!
//! - **TopK**: a thread per row, `k` selection passes in the CPU's order (NaN first, larger
//!   first, ties by the lower index).
//! - **TakeAlong / ScatterAlong**: a thread per output element; the scatter gathers the
//!   sources aimed at its element in order and sums them in f64, as the CPU.
//! - **MoeSlots**: a thread per (group, expert) walks the group's assignments in row-major
//!   order, so each expert keeps its first `capacity` assignments, the CPU's drop order.
//! - **MoeDispatch**: the slot map is inverted first (an integer minimum per buffer row, which
//!   is deterministic), then every buffer element is filled from its one owner, or zero.
//! - **MoeCombine / MoeSlotDot**: a thread per output element summing its token's `k` choices
//!   (or the dot product's terms) in order in f64.
//!
//! No float atomics anywhere: every result is deterministic and, as each f64 sum adds exact
//! products in the CPU's order, the CPU's bits. Indices are not read back to the host: one
//! outside its range (the CPU reports it as a data error) reads as nothing here.

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::launch::{elementwise, launch, Arg};
use crate::tensor::CudaTensor;
use tessera_ir::{DType, Op, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

/// The kernels of `moe.cu` the backend launches.
pub const FUNCTIONS: &[&str] = &[
    "moe_top_k",
    "moe_take_along",
    "moe_scatter_along",
    "moe_slots",
    "moe_dispatch_owner",
    "moe_dispatch",
    "moe_combine",
    "moe_slot_dot",
];

fn bad(op: &str, msg: String) -> RuntimeError {
    RuntimeError::Binding(format!("{op}: {msg}"))
}

fn unsupported(op: &str, reason: String) -> RuntimeError {
    RuntimeError::Unsupported { backend: "cuda".into(), op: op.into(), reason }
}

/// A value operand: f32 (the backend has upcast half ones).
fn values(op: &str, what: &str, t: &CudaTensor) -> Result<()> {
    match t.dtype() {
        DType::F32 => Ok(()),
        d => Err(unsupported(
            op,
            format!(
                "{what} is {d:?}: the routing kernels compute in f32 (half operands are upcast)"
            ),
        )),
    }
}

/// An index operand: i64 (i32 is stored as i64).
fn indices(op: &str, what: &str, t: &CudaTensor) -> Result<()> {
    match t.dtype() {
        DType::I64 | DType::I32 => Ok(()),
        d => Err(bad(op, format!("{what} must be i64, got {d:?}"))),
    }
}

fn last(t: &CudaTensor, op: &str) -> Result<usize> {
    t.dims().last().copied().ok_or_else(|| bad(op, "needs at least one dim, got a scalar".into()))
}

/// `[.., n, k]`: the assignments of one group (`n·k`) and `k`.
fn group_shape(t: &CudaTensor, op: &str, what: &str) -> Result<(usize, usize)> {
    match t.dims() {
        &[.., n, k] => Ok((n * k, k)),
        d => Err(bad(op, format!("{what} {d:?} must be [.., tokens, k]"))),
    }
}

/// The rows of one group's buffer `[.., E, C, H]` (`E·C`), and its groups must be the slots'.
fn group_rows(buf: &CudaTensor, slots: &CudaTensor, op: &str) -> Result<usize> {
    let (bd, sd) = (buf.dims(), slots.dims());
    match bd {
        &[.., e, c, _] if bd.len() == sd.len() + 1 && bd[..bd.len() - 3] == sd[..sd.len() - 2] => {
            Ok(e * c)
        }
        d => {
            Err(bad(op, format!("buffer {d:?} must be [.., experts, capacity, hidden] as {sd:?}")))
        }
    }
}

/// Token rows `[.., n, H]` must match the slots' `[.., n, k]`.
fn check_rows(x: &CudaTensor, slots: &CudaTensor, op: &str) -> Result<()> {
    let (xd, sd) = (x.dims(), slots.dims());
    if xd.len() == sd.len() && xd[..xd.len() - 1] == sd[..sd.len() - 1] {
        Ok(())
    } else {
        Err(bad(op, format!("rows {xd:?} and slots {sd:?} disagree")))
    }
}

/// The optional weights `[.., n, k]` (f32, the slots' shape) as a dense operand.
fn weights(
    be: &CudaBackend,
    w: Option<&CudaTensor>,
    slots: &CudaTensor,
    op: &str,
) -> Result<Option<CudaTensor>> {
    let Some(w) = w else { return Ok(None) };
    values(op, "weights", w)?;
    if w.dims() != slots.dims() {
        return Err(bad(op, format!("weights {:?} vs slots {:?}", w.dims(), slots.dims())));
    }
    Ok(Some(be.dense_pub(w)?))
}

/// A fresh output of `m`, which must have the dims the kernel writes.
fn output(
    be: &CudaBackend,
    m: &TensorMeta,
    dims: &[usize],
    op: &str,
    p: Purpose,
) -> Result<CudaTensor> {
    if m.shape.dims() != dims {
        return Err(bad(op, format!("output {} must have dims {dims:?}", m.shape)));
    }
    be.new_out(m, p)
}

fn i(v: usize) -> Arg {
    Arg::I64(v as i64)
}

/// Runs one routing op.
pub(crate) fn run(
    be: &CudaBackend,
    op: &Op,
    x: &[&CudaTensor],
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let (lo, hi, outs) = match op {
        Op::TopK { .. } => (1, 1, 2),
        Op::MoeSlots { .. } => (1, 1, 1),
        Op::TakeAlong | Op::ScatterAlong { .. } => (2, 2, 1),
        Op::MoeDispatch { .. } | Op::MoeCombine => (2, 3, 1),
        Op::MoeSlotDot => (3, 3, 1),
        other => return Err(bad(other.name(), "is not a routing op".into())),
    };
    let name = op.name();
    if x.len() < lo || x.len() > hi || out.len() != outs {
        return Err(bad(
            name,
            format!(
                "{} inputs and {} outputs (it takes {lo}..={hi} and gives {outs})",
                x.len(),
                out.len()
            ),
        ));
    }
    let one = |t: CudaTensor| Ok(vec![t]);
    match op {
        Op::TopK { k } => top_k(be, x[0], *k, out, p),
        Op::TakeAlong => one(take_along(be, x[0], x[1], &out[0], p)?),
        Op::ScatterAlong { size } => one(scatter_along(be, x[0], x[1], *size, &out[0], p)?),
        Op::MoeSlots { experts, capacity } => {
            one(slots(be, x[0], *experts, *capacity, &out[0], p)?)
        }
        Op::MoeDispatch { experts, capacity } => {
            one(dispatch(be, x[0], x[1], x.get(2).copied(), [*experts, *capacity], &out[0], p)?)
        }
        Op::MoeCombine => one(combine(be, x[0], x[1], x.get(2).copied(), &out[0], p)?),
        _ => one(slot_dot(be, x[0], x[1], x[2], &out[0], p)?),
    }
}

/// `[.., n]` → `[values [.., k], indices [.., k] i64]`.
fn top_k(
    be: &CudaBackend,
    x: &CudaTensor,
    k: usize,
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    const OP: &str = "top_k";
    values(OP, "x", x)?;
    let n = last(x, OP)?;
    if k == 0 || k > n {
        return Err(bad(OP, format!("k = {k} must be in 1..={n}")));
    }
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rank checked") = k;
    let (vals, idx) = (output(be, &out[0], &dims, OP, p)?, output(be, &out[1], &dims, OP, p)?);
    let rows = x.numel() / n;
    if rows > 0 {
        let xs = be.dense_pub(x)?;
        let args =
            [Arg::Ptr(xs.ptr()), Arg::Ptr(vals.ptr()), Arg::Ptr(idx.ptr()), i(rows), i(n), i(k)];
        launch(be.gpu(), "moe_top_k", elementwise(rows), &args)?;
    }
    Ok(vec![vals, idx])
}

/// `[x [.., n], idx [.., k]]` → `[.., k]`.
fn take_along(
    be: &CudaBackend,
    x: &CudaTensor,
    idx: &CudaTensor,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "take_along";
    values(OP, "x", x)?;
    indices(OP, "indices", idx)?;
    let (n, k) = (last(x, OP)?, last(idx, OP)?);
    if x.numel() / n.max(1) != idx.numel() / k.max(1) {
        return Err(bad(OP, format!("x {:?} vs indices {:?}", x.dims(), idx.dims())));
    }
    let y = output(be, out, idx.dims(), OP, p)?;
    let total = y.numel();
    if total > 0 {
        let (xs, is) = (be.dense_pub(x)?, be.dense_pub(idx)?);
        let args =
            [Arg::Ptr(xs.ptr()), Arg::Ptr(is.ptr()), Arg::Ptr(y.ptr()), i(n), i(k), i(total)];
        launch(be.gpu(), "moe_take_along", elementwise(total), &args)?;
    }
    Ok(y)
}

/// `[idx [.., k], src [.., k]]` → `[.., size]`, repeated indices adding in order (in f64).
fn scatter_along(
    be: &CudaBackend,
    idx: &CudaTensor,
    src: &CudaTensor,
    size: usize,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "scatter_along";
    indices(OP, "indices", idx)?;
    values(OP, "src", src)?;
    if idx.dims() != src.dims() {
        return Err(bad(OP, format!("{:?} vs {:?}", idx.dims(), src.dims())));
    }
    let k = last(idx, OP)?;
    let mut dims = idx.dims().to_vec();
    *dims.last_mut().expect("rank checked") = size;
    let y = output(be, out, &dims, OP, p)?;
    let total = y.numel();
    if total > 0 {
        if k == 0 {
            be.fill_pub(&y, 0.0)?;
            return Ok(y);
        }
        let (is, ss) = (be.dense_pub(idx)?, be.dense_pub(src)?);
        let args =
            [Arg::Ptr(is.ptr()), Arg::Ptr(ss.ptr()), Arg::Ptr(y.ptr()), i(k), i(size), i(total)];
        launch(be.gpu(), "moe_scatter_along", elementwise(total), &args)?;
    }
    Ok(y)
}

/// Each expert's first `capacity` assignments of each group in row-major `(n, j)` order; the
/// rest −1.
fn slots(
    be: &CudaBackend,
    idx: &CudaTensor,
    experts: usize,
    capacity: usize,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "moe_slots";
    indices(OP, "expert indices", idx)?;
    let (per, _) = group_shape(idx, OP, "expert indices")?;
    let y = output(be, out, idx.dims(), OP, p)?;
    let total = y.numel();
    if total == 0 {
        return Ok(y);
    }
    be.fill_pub(&y, -1.0)?;
    let groups = total / per;
    if experts > 0 {
        let is = be.dense_pub(idx)?;
        let args =
            [Arg::Ptr(is.ptr()), Arg::Ptr(y.ptr()), i(groups), i(per), i(experts), i(capacity)];
        launch(be.gpu(), "moe_slots", elementwise(groups * experts), &args)?;
    }
    Ok(y)
}

/// `[x [.., n, H], slots [.., n, k] (, weights)]` → `[.., E, C, H]`.
fn dispatch(
    be: &CudaBackend,
    x: &CudaTensor,
    slots: &CudaTensor,
    w: Option<&CudaTensor>,
    [experts, capacity]: [usize; 2],
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "moe_dispatch";
    values(OP, "x", x)?;
    indices(OP, "slots", slots)?;
    let h = last(x, OP)?;
    let (per, k) = group_shape(slots, OP, "slots")?;
    check_rows(x, slots, OP)?;
    let w = weights(be, w, slots, OP)?;
    let sd = slots.dims();
    let mut dims = sd[..sd.len() - 2].to_vec();
    dims.extend([experts, capacity, h]);
    let y = output(be, out, &dims, OP, p)?;
    let (rows, total) = (experts * capacity, y.numel());
    if total == 0 {
        return Ok(y);
    }
    // Buffer row → its assignment (all ones: none), i64 scratch.
    let owner = CudaTensor::empty(be.gpu(), &[total / h], DType::I64, Purpose::Scratch)?;
    be.fill_pub(&owner, -1.0)?;
    let assignments = slots.numel();
    if assignments > 0 && per > 0 {
        let ss = be.dense_pub(slots)?;
        let args = [Arg::Ptr(ss.ptr()), Arg::Ptr(owner.ptr()), i(per), i(rows), i(assignments)];
        launch(be.gpu(), "moe_dispatch_owner", elementwise(assignments), &args)?;
    }
    let xs = be.dense_pub(x)?;
    let wp = w.as_ref().map_or(0, |w| w.ptr());
    let args = [
        Arg::Ptr(xs.ptr()),
        Arg::Ptr(wp),
        Arg::Ptr(owner.ptr()),
        Arg::Ptr(y.ptr()),
        i(k.max(1)),
        i(h),
        i(total),
    ];
    launch(be.gpu(), "moe_dispatch", elementwise(total), &args)?;
    Ok(y)
}

/// `[y [.., E, C, H], slots [.., n, k] (, weights)]` → `[.., n, H]`.
fn combine(
    be: &CudaBackend,
    y: &CudaTensor,
    slots: &CudaTensor,
    w: Option<&CudaTensor>,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "moe_combine";
    values(OP, "y", y)?;
    indices(OP, "slots", slots)?;
    let h = last(y, OP)?;
    let (per, k) = group_shape(slots, OP, "slots")?;
    let rows = group_rows(y, slots, OP)?;
    let w = weights(be, w, slots, OP)?;
    let sd = slots.dims();
    let mut dims = sd[..sd.len() - 1].to_vec();
    dims.push(h);
    let o = output(be, out, &dims, OP, p)?;
    let total = o.numel();
    if total == 0 {
        return Ok(o);
    }
    if k == 0 {
        be.fill_pub(&o, 0.0)?;
        return Ok(o);
    }
    let (ys, ss) = (be.dense_pub(y)?, be.dense_pub(slots)?);
    let wp = w.as_ref().map_or(0, |w| w.ptr());
    let args = [
        Arg::Ptr(ys.ptr()),
        Arg::Ptr(ss.ptr()),
        Arg::Ptr(wp),
        Arg::Ptr(o.ptr()),
        i(per),
        i(rows),
        i(k),
        i(h),
        i(total),
    ];
    launch(be.gpu(), "moe_combine", elementwise(total), &args)?;
    Ok(o)
}

/// `[buf [.., E, C, H], x [.., n, H], slots [.., n, k]]` → `[.., n, k]`.
fn slot_dot(
    be: &CudaBackend,
    buf: &CudaTensor,
    x: &CudaTensor,
    slots: &CudaTensor,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "moe_slot_dot";
    values(OP, "buf", buf)?;
    values(OP, "x", x)?;
    indices(OP, "slots", slots)?;
    let h = last(x, OP)?;
    let (per, k) = group_shape(slots, OP, "slots")?;
    let rows = group_rows(buf, slots, OP)?;
    check_rows(x, slots, OP)?;
    if last(buf, OP)? != h {
        return Err(bad(OP, format!("buffer {:?} vs rows {:?}", buf.dims(), x.dims())));
    }
    let o = output(be, out, slots.dims(), OP, p)?;
    let total = o.numel();
    if total == 0 {
        return Ok(o);
    }
    let (bs, xs, ss) = (be.dense_pub(buf)?, be.dense_pub(x)?, be.dense_pub(slots)?);
    let args = [
        Arg::Ptr(bs.ptr()),
        Arg::Ptr(xs.ptr()),
        Arg::Ptr(ss.ptr()),
        Arg::Ptr(o.ptr()),
        i(per),
        i(rows),
        i(k),
        i(h),
        i(total),
    ];
    launch(be.gpu(), "moe_slot_dot", elementwise(total), &args)?;
    Ok(o)
}
