//! The generation ops on the GPU: the KV cache's write, the selection of the positions whose
//! logits are kept, and the weight-only quantised matmuls (kernels of `infer.cu`, each the
//! CPU kernel's arithmetic: `tessera-runtime`'s `kernels/infer.rs` and `kernels/quant.rs`).
//!
//! - **CacheWrite** writes the step's keys or values into the resident cache where it lives and
//!   returns a handle to the same buffer (the IR's alias): no copy of the cache, and the
//!   prefill and decode Programs, which share the cache tensor, see every write.
//! - **SelectPositions** gathers one position per row into a fresh `[B, 1, ..]`.
//! - **QMatMul** dequantises inside the kernel, never as a whole: with few rows of x (decode)
//!   a warp per output feature reads its weight row once, 16 bytes per lane, for every row of
//!   x; with many rows (prefill) 64×64 output tiles stage dequantised 64×32 weight tiles in
//!   shared memory. x is read in its own dtype (f32, bf16, f16), the sums are f32 and the
//!   result is rounded once: the CPU's upcast-compute-round.
//! - **QMatMulBackward** (QLoRA's input gradient `dy · dequant(W)`) is the tiled kernel's
//!   transpose: 64×64 tiles of dx reduce over the weight rows in steps of 32, staging dy and the
//!   dequantised weight rows in shared memory, at any number of rows.
//!
//! Both quantised matmuls hold their declared workspace (the CPU's f32 tile of weight rows) as
//! Program memory while they run, unused, so the allocator's books stay the accountant's.
//!
//! The index tensors (cache starts, selected positions) are checked on the host first, with the
//! CPU kernel's errors. Each is read back once per bound value ([`HostInts`]): every layer's
//! cache write of a step reads the same `cache_start`, so a step synchronises once for it.

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::launch::{elementwise, launch, Arg};
use crate::source::float_code;
use crate::tensor::{elem_size, CudaTensor, DeviceBuffer};
use cudarc::driver::LaunchConfig;
use std::sync::{Arc, Mutex, Weak};
use tessera_ir::{DType, Op, QuantSpec, TensorMeta};
use tessera_runtime::{Backend, Result, RuntimeError};

/// The kernels of `infer.cu` the backend launches.
pub const FUNCTIONS: &[&str] = &[
    "cache_write",
    "select_positions",
    "qmatmul_skinny",
    "qmatmul_tiled",
    "qmatmul_backward_tiled",
];

/// Rows of x up to which the quantised matmul takes the per-feature (decode) kernel, in blocks
/// of 8, 4, 2 and 1 rows; above it, the tiled kernel.
pub const SKINNY_ROWS: usize = 16;

/// Output features (and rows of x) per block of the tiled kernel (`QT_N`, `QT_M`).
const TILE: usize = 64;

fn bad(msg: String) -> RuntimeError {
    RuntimeError::Binding(msg)
}

/// Runs one generation op.
pub(crate) fn run(
    be: &CudaBackend,
    op: &Op,
    x: &[&CudaTensor],
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let want = match op {
        Op::CacheWrite | Op::QMatMul(_) | Op::QMatMulBackward(_) => 3,
        _ => 2,
    };
    if x.len() != want || out.is_empty() {
        return Err(bad(format!(
            "{}: {} inputs and {} outputs (expected {want} and 1)",
            op.name(),
            x.len(),
            out.len()
        )));
    }
    // The quantised matmuls' declared workspace, held while the kernel runs (see `workspace`).
    let _workspace = match op {
        Op::QMatMul(_) | Op::QMatMulBackward(_) => workspace(be, op, x)?,
        _ => None,
    };
    let y = match op {
        Op::CacheWrite => cache_write(be, x[0], x[1], x[2])?,
        Op::SelectPositions => select_positions(be, x[0], x[1], &out[0], p)?,
        Op::QMatMul(q) => qmatmul(be, x[0], x[1], x[2], *q, &out[0], p)?,
        Op::QMatMulBackward(q) => qmatmul_backward(be, x[0], x[1], x[2], *q, &out[0], p)?,
        other => return Err(bad(format!("{} is not a generation op", other.name()))),
    };
    Ok(vec![y])
}

/// The op's declared workspace (`Op::workspace_bytes`: the CPU kernel's tile of dequantised
/// weight rows, which the memory accountant charges while the op runs) as Program memory, so
/// the allocator's Program peak equals the accountant's where a quantised matmul sets the
/// step's peak (as the convolutions' columns do). The kernels stage their tiles in shared
/// memory and do not touch it: it is held, not used.
fn workspace(be: &CudaBackend, op: &Op, x: &[&CudaTensor]) -> Result<Option<CudaTensor>> {
    let metas: Vec<TensorMeta> = x.iter().map(|t| t.meta()).collect();
    let bytes = op.workspace_bytes(&metas.iter().collect::<Vec<_>>()) as usize;
    if bytes == 0 {
        return Ok(None);
    }
    let len = bytes.div_ceil(4);
    Ok(Some(CudaTensor::empty(be.gpu(), &[len], DType::F32, Purpose::Program)?))
}

/// Host copies of small i64 device tensors (cache starts, selected positions), each read back
/// once while its buffer lives. A held [`Weak`] keeps its `Arc`'s allocation, so no other
/// buffer can come to share the address it is compared by.
#[derive(Default)]
pub(crate) struct HostInts {
    seen: Mutex<Vec<Seen>>,
}

struct Seen {
    buf: Weak<DeviceBuffer>,
    offset: usize,
    dims: Vec<usize>,
    strides: Vec<usize>,
    values: Arc<Vec<i64>>,
}

/// Entries kept (a step reads two: `cache_start` and `last_index`).
const SEEN: usize = 8;

impl HostInts {
    /// `t`'s values, read from the device the first time this view of its buffer is asked for.
    fn get(&self, be: &CudaBackend, t: &CudaTensor) -> Result<Arc<Vec<i64>>> {
        let same = |s: &Seen| {
            std::ptr::eq(s.buf.as_ptr(), Arc::as_ptr(&t.buf))
                && s.offset == t.offset
                && s.dims == t.dims
                && s.strides == t.strides
        };
        let poisoned = || bad("cuda: the index cache's lock was poisoned by a panic".into());
        if let Some(s) = self.seen.lock().map_err(|_| poisoned())?.iter().find(|s| same(s)) {
            return Ok(s.values.clone());
        }
        let host = be.download(t)?.flatten_all()?.to_dtype(candle_core::DType::I64)?;
        let values = Arc::new(host.to_vec1::<i64>()?);
        let mut seen = self.seen.lock().map_err(|_| poisoned())?;
        seen.retain(|s| s.buf.strong_count() > 0);
        if seen.len() >= SEEN {
            seen.remove(0);
        }
        seen.push(Seen {
            buf: Arc::downgrade(&t.buf),
            offset: t.offset,
            dims: t.dims.clone(),
            strides: t.strides.clone(),
            values: values.clone(),
        });
        Ok(values)
    }
}

/// The `[B]` entries of an index tensor, checked for count (the CPU kernel's error).
fn row_indices(be: &CudaBackend, t: &CudaTensor, b: usize, what: &str) -> Result<Arc<Vec<i64>>> {
    if !matches!(t.dtype(), DType::I64 | DType::I32) {
        return Err(bad(format!("{what}: a {:?} index (an integer tensor)", t.dtype())));
    }
    let v = be.host_ints().get(be, t)?;
    if v.len() != b {
        return Err(bad(format!("{what}: {} entries for {b} rows", v.len())));
    }
    Ok(v)
}

/// Writes `x [B,S,H,D]` into `cache [B,C,H,D]` at positions `start[b]..start[b]+S` of each row,
/// in place; returns the cache's own handle (the IR's alias).
fn cache_write(
    be: &CudaBackend,
    cache: &CudaTensor,
    x: &CudaTensor,
    start: &CudaTensor,
) -> Result<CudaTensor> {
    let (&[b, c, h, d], &[bx, s, hx, dx]) = (cache.dims(), x.dims()) else {
        return Err(bad(format!(
            "cache_write: cache {:?} and x {:?} must be [batch, seq, heads, head_dim]",
            cache.dims(),
            x.dims()
        )));
    };
    if (b, h, d) != (bx, hx, dx) || cache.dtype() != x.dtype() {
        return Err(bad(format!(
            "cache_write: x {:?} {:?} does not fit cache {:?} {:?}",
            x.dtype(),
            x.dims(),
            cache.dtype(),
            cache.dims()
        )));
    }
    if !matches!(cache.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(RuntimeError::Unsupported {
            backend: "cuda".into(),
            op: "cache_write".into(),
            reason: format!("a {:?} cache (f32, bf16 or f16 only)", cache.dtype()),
        });
    }
    let st = row_indices(be, start, b, "cache_write: start")?;
    if let Some((row, &p)) = st.iter().enumerate().find(|(_, &p)| p < 0 || p as usize + s > c) {
        return Err(bad(format!(
            "cache_write: row {row} writes positions {p}..{} beyond the cache's {c}: raise the \
             cache capacity (prompt + new tokens)",
            p + s as i64
        )));
    }
    let n = b * s * h * d;
    if n > 0 {
        let start = be.dense_pub(start)?;
        launch(
            be.gpu(),
            "cache_write",
            elementwise(n),
            &[
                Arg::Ptr(x.base()),
                Arg::Layout(x.layout()?),
                Arg::Ptr(cache.base()),
                Arg::Layout(cache.layout()?),
                Arg::Ptr(start.ptr()),
                Arg::I64(s as i64),
                Arg::I64(c as i64),
                Arg::I64((h * d) as i64),
                Arg::I32(elem_size(cache.dtype()) as i32),
                Arg::I64(n as i64),
            ],
        )?;
    }
    Ok(cache.clone())
}

/// Row `b` of `x [B,S,..]` at position `index[b]`: a fresh `[B,1,..]`.
fn select_positions(
    be: &CudaBackend,
    x: &CudaTensor,
    index: &CudaTensor,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    let dims = x.dims();
    if dims.len() < 2 {
        return Err(bad(format!("select_positions: x {dims:?} must be [batch, seq, ..]")));
    }
    let (b, s) = (dims[0], dims[1]);
    let idx = row_indices(be, index, b, "select_positions: index")?;
    if let Some((row, &i)) = idx.iter().enumerate().find(|(_, &i)| i < 0 || i as usize >= s) {
        return Err(bad(format!("select_positions: row {row} asks for position {i} of {s}")));
    }
    let y = be.new_out(out, p)?;
    if y.dtype() != x.dtype() || y.numel() * s != x.numel() {
        return Err(bad(format!("select_positions: x {} does not give {out}", x.meta())));
    }
    let inner: usize = dims[2..].iter().product();
    let n = b * inner;
    if n > 0 {
        let index = be.dense_pub(index)?;
        launch(
            be.gpu(),
            "select_positions",
            elementwise(n),
            &[
                Arg::Ptr(x.base()),
                Arg::Layout(x.layout()?),
                Arg::Ptr(index.ptr()),
                Arg::Ptr(y.ptr()),
                Arg::I64(s as i64),
                Arg::I64(inner as i64),
                Arg::I32(elem_size(x.dtype()) as i32),
                Arg::I64(n as i64),
            ],
        )?;
    }
    Ok(y)
}

/// The shapes of a quantised matmul, checked as the CPU kernel checks them.
#[derive(Clone, Copy, Debug)]
struct QShape {
    m: usize,
    n: usize,
    k: usize,
    rb: usize,
    groups: usize,
}

fn qshape(x: &CudaTensor, w: &CudaTensor, scales: &CudaTensor, q: QuantSpec) -> Result<QShape> {
    let qbad = |reason: String| bad(format!("qmatmul: {reason}"));
    // u8 bytes come to the device as the runtime's byte dtype (`Bool`, stored as u8).
    if !matches!(w.dtype(), DType::U8 | DType::Bool) || scales.dtype() != DType::F32 {
        return Err(qbad(format!(
            "x {:?}, weight {:?}, scales {:?}: expected a float x, u8 weight, f32 scales",
            x.dtype(),
            w.dtype(),
            scales.dtype()
        )));
    }
    let Some((&k, lead)) = x.dims().split_last() else {
        return Err(qbad("x has no features".into()));
    };
    let &[n, rb] = w.dims() else {
        return Err(qbad(format!("weight {:?} is not 2-d", w.dims())));
    };
    if !matches!(q.bits, 4 | 8) || q.group == 0 {
        return Err(qbad(format!("{} bits in groups of {}: give 8 or 4 bits", q.bits, q.group)));
    }
    let groups = k / q.group;
    if k % q.group != 0
        || !(k * q.bits as usize).is_multiple_of(8)
        || rb != q.row_bytes(k)
        || scales.dims() != [n, groups]
    {
        return Err(qbad(format!(
            "weight {:?} / scales {:?} do not fit {k} features ({} bits, groups of {})",
            w.dims(),
            scales.dims(),
            q.bits,
            q.group
        )));
    }
    if k > i32::MAX as usize {
        return Err(RuntimeError::Unsupported {
            backend: "cuda".into(),
            op: "qmatmul".into(),
            reason: format!("{k} input features (the kernels index a row in 32 bits)"),
        });
    }
    Ok(QShape { m: lead.iter().product(), n, k, rb, groups })
}

/// `x [.., K] · dequant(w [N, K·bits/8] u8, scales [N, K/group] f32)ᵀ` → `[.., N]` in x's dtype.
fn qmatmul(
    be: &CudaBackend,
    x: &CudaTensor,
    w: &CudaTensor,
    scales: &CudaTensor,
    q: QuantSpec,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    let sh = qshape(x, w, scales, q)?;
    let cx = float_code("qmatmul", x.dtype())?;
    let y = be.new_out(out, p)?;
    let cy = float_code("qmatmul", y.dtype())?;
    let mut want = x.dims().to_vec();
    if let Some(l) = want.last_mut() {
        *l = sh.n;
    }
    if y.dims() != want.as_slice() {
        return Err(bad(format!("qmatmul: x {} does not give {out}", x.meta())));
    }
    if sh.m == 0 || sh.n == 0 {
        return Ok(y);
    }
    if sh.k == 0 {
        be.fill_pub(&y, 0.0)?;
        return Ok(y);
    }
    let (x, w, scales) = (be.dense_pub(x)?, be.dense_pub(w)?, be.dense_pub(scales)?);
    let ops = QOps { x: &x, cx, w: &w, scales: &scales, y: &y, cy, sh, q };
    if sh.m <= SKINNY_ROWS { skinny(be, &ops) } else { tiled(be, &ops) }?;
    Ok(y)
}

/// A quantised matmul's dense operands and type codes.
struct QOps<'a> {
    x: &'a CudaTensor,
    cx: i32,
    w: &'a CudaTensor,
    scales: &'a CudaTensor,
    y: &'a CudaTensor,
    cy: i32,
    sh: QShape,
    q: QuantSpec,
}

/// The per-feature kernel over blocks of 8, 4, 2 and 1 rows of x (each block reads the weights
/// once; at most [`SKINNY_ROWS`] rows, so at most three passes).
fn skinny(be: &CudaBackend, o: &QOps) -> Result<()> {
    let QShape { m, n, k, rb, groups } = o.sh;
    let (xs, ys) = (elem_size(o.x.dtype()), elem_size(o.y.dtype()));
    // 8 warps per block, a warp per output feature.
    let blocks = n.div_ceil(8).clamp(1, 1 << 20) as u32;
    let cfg =
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let mut r0 = 0;
    while r0 < m {
        let rows = [8, 4, 2, 1].into_iter().find(|&r| r <= m - r0).unwrap_or(1);
        let xp = o.x.ptr() + (r0 * k * xs) as u64;
        let yp = o.y.ptr() + (r0 * n * ys) as u64;
        let vec = rb.is_multiple_of(16)
            && o.w.ptr().is_multiple_of(16)
            && xp.is_multiple_of(16)
            && (k * xs).is_multiple_of(16);
        launch(
            be.gpu(),
            "qmatmul_skinny",
            cfg,
            &[
                Arg::Ptr(xp),
                Arg::I32(o.cx),
                Arg::Ptr(o.w.ptr()),
                Arg::Ptr(o.scales.ptr()),
                Arg::Ptr(yp),
                Arg::I32(o.cy),
                Arg::I32(rows as i32),
                Arg::I32(o.q.bits as i32),
                Arg::I64(n as i64),
                Arg::I64(k as i64),
                Arg::I64(rb as i64),
                Arg::I64(groups as i64),
                Arg::I64(o.q.group as i64),
                Arg::I32(i32::from(vec)),
            ],
        )?;
        r0 += rows;
    }
    Ok(())
}

/// The tiled kernel: a block per 64 rows of x × 64 output features (launched in slices of
/// rows where x has more than the grid's 65535 row tiles).
fn tiled(be: &CudaBackend, o: &QOps) -> Result<()> {
    let QShape { m, n, k, rb, groups } = o.sh;
    let (xs, ys) = (elem_size(o.x.dtype()), elem_size(o.y.dtype()));
    let max_rows = 65535 * TILE;
    let cols = n.div_ceil(TILE);
    if cols > i32::MAX as usize {
        return Err(bad(format!("qmatmul: {n} output features are too many for one grid")));
    }
    for r0 in (0..m).step_by(max_rows) {
        let rows = max_rows.min(m - r0);
        let cfg = LaunchConfig {
            grid_dim: (cols as u32, rows.div_ceil(TILE) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch(
            be.gpu(),
            "qmatmul_tiled",
            cfg,
            &[
                Arg::Ptr(o.x.ptr() + (r0 * k * xs) as u64),
                Arg::I32(o.cx),
                Arg::Ptr(o.w.ptr()),
                Arg::Ptr(o.scales.ptr()),
                Arg::Ptr(o.y.ptr() + (r0 * n * ys) as u64),
                Arg::I32(o.cy),
                Arg::I64(rows as i64),
                Arg::I64(n as i64),
                Arg::I64(k as i64),
                Arg::I64(rb as i64),
                Arg::I64(groups as i64),
                Arg::I64(o.q.group as i64),
                Arg::I32(o.q.bits as i32),
            ],
        )?;
    }
    Ok(())
}

/// `dy [.., N] · dequant(w [N, K·bits/8] u8, scales [N, K/group] f32)` → `dx [.., K]` in the
/// output's dtype: the input gradient of [`qmatmul`], checked as the CPU kernel checks it.
fn qmatmul_backward(
    be: &CudaBackend,
    dy: &CudaTensor,
    w: &CudaTensor,
    scales: &CudaTensor,
    q: QuantSpec,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    let qbad = |reason: String| bad(format!("qmatmul_backward: {reason}"));
    if !matches!(w.dtype(), DType::U8 | DType::Bool) || scales.dtype() != DType::F32 {
        return Err(qbad(format!(
            "dy {:?}, weight {:?}, scales {:?}: expected a float dy, u8 weight, f32 scales",
            dy.dtype(),
            w.dtype(),
            scales.dtype()
        )));
    }
    let cdy = float_code("qmatmul_backward", dy.dtype())?;
    let Some((&n, lead)) = dy.dims().split_last() else {
        return Err(qbad("dy has no features".into()));
    };
    let &[wn, rb] = w.dims() else {
        return Err(qbad(format!("weight {:?} is not 2-d", w.dims())));
    };
    if !matches!(q.bits, 4 | 8) || q.group == 0 {
        return Err(qbad(format!("{} bits in groups of {}: give 8 or 4 bits", q.bits, q.group)));
    }
    let k = rb * 8 / q.bits as usize;
    let groups = k / q.group;
    if wn != n || !k.is_multiple_of(q.group) || scales.dims() != [n, groups] {
        return Err(qbad(format!(
            "dy {:?}, weight {:?}, scales {:?} do not fit ({} bits, groups of {})",
            dy.dims(),
            w.dims(),
            scales.dims(),
            q.bits,
            q.group
        )));
    }
    if k > i32::MAX as usize {
        return Err(RuntimeError::Unsupported {
            backend: "cuda".into(),
            op: "qmatmul_backward".into(),
            reason: format!("{k} input features (the kernel indexes a row in 32 bits)"),
        });
    }
    let y = be.new_out(out, p)?;
    let cdx = float_code("qmatmul_backward", y.dtype())?;
    let mut want = dy.dims().to_vec();
    if let Some(l) = want.last_mut() {
        *l = k;
    }
    if y.dims() != want.as_slice() {
        return Err(qbad(format!("dy {} does not give {out}", dy.meta())));
    }
    let m: usize = lead.iter().product();
    if m == 0 || k == 0 {
        return Ok(y);
    }
    if n == 0 {
        be.fill_pub(&y, 0.0)?;
        return Ok(y);
    }
    let (dy, w, scales) = (be.dense_pub(dy)?, be.dense_pub(w)?, be.dense_pub(scales)?);
    let (ys, xs) = (elem_size(dy.dtype()), elem_size(y.dtype()));
    let max_rows = 65535 * TILE;
    let cols = k.div_ceil(TILE);
    for r0 in (0..m).step_by(max_rows) {
        let rows = max_rows.min(m - r0);
        let cfg = LaunchConfig {
            grid_dim: (cols as u32, rows.div_ceil(TILE) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch(
            be.gpu(),
            "qmatmul_backward_tiled",
            cfg,
            &[
                Arg::Ptr(dy.ptr() + (r0 * n * ys) as u64),
                Arg::I32(cdy),
                Arg::Ptr(w.ptr()),
                Arg::Ptr(scales.ptr()),
                Arg::Ptr(y.ptr() + (r0 * k * xs) as u64),
                Arg::I32(cdx),
                Arg::I64(rows as i64),
                Arg::I64(n as i64),
                Arg::I64(k as i64),
                Arg::I64(rb as i64),
                Arg::I64(groups as i64),
                Arg::I64(q.group as i64),
                Arg::I32(q.bits as i32),
            ],
        )?;
    }
    Ok(y)
}
