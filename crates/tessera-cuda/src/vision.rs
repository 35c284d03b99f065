//! The vision ops on the GPU (convolution, GroupNorm, pooling, upsampling and their
//! backwards): kernels of `vision.cu` and cuBLAS GEMMs, each the CPU kernel's arithmetic
//! (`tessera-runtime`'s `kernels/vision.rs`), on f32 operands (the backend upcasts bf16 and f16
//! ones first, as it does for norms).
//!
//! - **Convolutions** ([`conv`]) are the CPU's lowering: im2col columns of at most
//!   `CONV_IMAGES_PER_CHUNK` images in one scratch buffer (exactly the op's declared workspace,
//!   none for a pointwise kernel) and cuBLAS f32 GEMMs (fp32 compute, no TF32). cuBLAS rather
//!   than a hand-written implicit GEMM: its f32 GEMMs run near the device's f32 peak, and the
//!   columns are the workspace the planner already charges, so the extra memory is predicted.
//!   The backward-data op gathers the column gradients (col2im without atomics); the
//!   backward-filter op accumulates image after image in a fixed order.
//! - **GroupNorm**: one block per (sample, group), statistics in f64 in two passes as the
//!   CPU; its backward writes each sample's per-channel (Σ dy·x̂, Σ dy) partials (f64 scratch,
//!   `[N, C, 2]`), summed over the samples in order by a second kernel.
//! - **Pooling and upsampling**: a thread per output (forward) or per input element (backward:
//!   it gathers the outputs that read it in row-major order, the order the CPU adds them), so
//!   max pooling routes ties exactly as the CPU (each window's first maximum) and the results
//!   are the CPU's bits.
//!
//! Deterministic throughout: no float atomics anywhere, and every sum has a fixed order (cuBLAS
//! GEMMs are run-to-run reproducible on one GPU model).

mod conv;

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::launch::{elementwise, launch, launch_then, per_row, Arg};
use crate::tensor::CudaTensor;
use cudarc::driver::DeviceRepr;
use tessera_ir::{DType, Op, Pool2dSpec, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

/// The kernels of `vision.cu` the backend launches.
pub const FUNCTIONS: &[&str] = &[
    "vision_im2col",
    "vision_col2im",
    "vision_group_norm",
    "vision_group_norm_backward",
    "vision_group_norm_dwdb",
    "vision_max_pool",
    "vision_max_pool_backward",
    "vision_avg_pool",
    "vision_avg_pool_backward",
    "vision_upsample",
    "vision_upsample_backward",
];

/// Bytes of an f32.
const F32: usize = 4;

pub(crate) fn bad(msg: String) -> RuntimeError {
    RuntimeError::Binding(msg)
}

fn unsupported(op: &str, reason: String) -> RuntimeError {
    RuntimeError::Unsupported { backend: "cuda".into(), op: op.into(), reason }
}

/// `[N, C, H, W]` of a 4-D operand.
pub(crate) fn dims4(d: &[usize], op: &str, what: &str) -> Result<[usize; 4]> {
    match d {
        &[a, b, c, e] => Ok([a, b, c, e]),
        _ => Err(bad(format!("{op}: {what} {d:?} must be 4-D [N, C, H, W]"))),
    }
}

/// Every operand and result is f32: the kernels compute in f32 on upcast operands.
fn expect_f32(op: &Op, x: &[&CudaTensor], out: &[TensorMeta]) -> Result<()> {
    let dtypes = x.iter().map(|t| t.dtype()).chain(out.iter().map(|m| m.dtype));
    match dtypes.into_iter().find(|&d| d != DType::F32) {
        None => Ok(()),
        Some(d) => Err(unsupported(
            op.name(),
            format!(
                "a {d:?} operand or result: the vision kernels compute in f32 (the backend \
                 upcasts bf16 and f16 operands to f32 first)"
            ),
        )),
    }
}

/// Runs one vision op.
pub(crate) fn run(
    be: &CudaBackend,
    op: &Op,
    x: &[&CudaTensor],
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let inputs = match op {
        Op::Conv2d(_)
        | Op::Conv2dBackwardInput { .. }
        | Op::Conv2dBackwardWeight { .. }
        | Op::MaxPool2dBackward(_) => 2,
        Op::GroupNorm { .. } | Op::GroupNormBackward { .. } => 3,
        _ => 1,
    };
    let outputs = if matches!(op, Op::GroupNormBackward { .. }) { 3 } else { 1 };
    if x.len() != inputs || out.len() != outputs {
        return Err(bad(format!(
            "{}: {} inputs and {} outputs (it takes {inputs} and gives {outputs})",
            op.name(),
            x.len(),
            out.len()
        )));
    }
    expect_f32(op, x, out)?;
    let one = |t: CudaTensor| Ok(vec![t]);
    match op {
        Op::Conv2d(spec) => one(conv::forward(be, x[0], x[1], spec, &out[0], p)?),
        Op::Conv2dBackwardInput { spec, .. } => {
            one(conv::backward_input(be, x[0], x[1], spec, &out[0], p)?)
        }
        Op::Conv2dBackwardWeight { spec, .. } => {
            one(conv::backward_weight(be, x[0], x[1], spec, &out[0], p)?)
        }
        Op::GroupNorm { groups, eps } => {
            one(group_norm(be, [x[0], x[1], x[2]], *groups, *eps, &out[0], p)?)
        }
        Op::GroupNormBackward { groups, eps } => {
            group_norm_backward(be, [x[0], x[1], x[2]], *groups, *eps, out, p)
        }
        Op::MaxPool2d(pool) => {
            one(pool_forward(be, "vision_max_pool", x[0], pool, false, &out[0], p)?)
        }
        Op::MaxPool2dBackward(pool) => one(max_pool_backward(be, x[0], x[1], pool, &out[0], p)?),
        Op::AvgPool2d { pool, count_include_pad } => {
            one(pool_forward(be, "vision_avg_pool", x[0], pool, *count_include_pad, &out[0], p)?)
        }
        Op::AvgPool2dBackward { pool, count_include_pad, .. } => {
            one(avg_pool_backward(be, x[0], pool, *count_include_pad, &out[0], p)?)
        }
        Op::Upsample2d { scale } => one(upsample(be, x[0], *scale, false, &out[0], p)?),
        Op::Upsample2dBackward { scale } => one(upsample(be, x[0], *scale, true, &out[0], p)?),
        other => Err(bad(format!("{} is not a vision op", other.name()))),
    }
}

// ---- GroupNorm -----------------------------------------------------------------------------

/// (N, C, spatial size) of `x [N, C, ..]` against the per-channel `ws` (the CPU's checks).
fn group_dims(op: &str, x: &CudaTensor, ws: &[&CudaTensor], groups: usize) -> Result<[usize; 3]> {
    let d = x.dims();
    if d.len() < 2 {
        return Err(bad(format!("{op}: x {d:?} must be [N, C, ..]")));
    }
    let c = d[1];
    if groups == 0 || !c.is_multiple_of(groups) {
        return Err(bad(format!("{op}: channels {c} not divisible by groups {groups}")));
    }
    if let Some(w) = ws.iter().find(|w| w.dims() != [c]) {
        return Err(bad(format!("{op}: weight/bias {:?} must be [{c}]", w.dims())));
    }
    if d[0] * groups > i32::MAX as usize {
        return Err(unsupported(
            op,
            format!("{} groups of samples (one block each)", d[0] * groups),
        ));
    }
    Ok([d[0], c, d[2..].iter().product()])
}

fn same_shape(op: &str, what: &str, got: &[usize], want: &[usize]) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(bad(format!("{op}: {what} {got:?} must be {want:?}")))
    }
}

/// Inputs `[x, weight, bias]`.
fn group_norm(
    be: &CudaBackend,
    x: [&CudaTensor; 3],
    groups: usize,
    eps: f64,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "group_norm";
    let [n, c, s] = group_dims(OP, x[0], &x[1..], groups)?;
    same_shape(OP, "output", out.shape.dims(), x[0].dims())?;
    let y = be.new_out(out, p)?;
    if y.numel() == 0 {
        return Ok(y);
    }
    let (xs, w, b) = (be.dense_pub(x[0])?, be.dense_pub(x[1])?, be.dense_pub(x[2])?);
    launch(
        be.gpu(),
        "vision_group_norm",
        per_row(n * groups),
        &[
            Arg::Ptr(xs.ptr()),
            Arg::Ptr(w.ptr()),
            Arg::Ptr(b.ptr()),
            Arg::Ptr(y.ptr()),
            Arg::I64(groups as i64),
            Arg::I64((c / groups) as i64),
            Arg::I64(s as i64),
            Arg::F64(eps),
        ],
    )?;
    Ok(y)
}

/// Inputs `[x, weight, dy]` → `[dx, dweight, dbias]`.
fn group_norm_backward(
    be: &CudaBackend,
    x: [&CudaTensor; 3],
    groups: usize,
    eps: f64,
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    const OP: &str = "group_norm_backward";
    let [n, c, s] = group_dims(OP, x[0], &x[1..2], groups)?;
    same_shape(OP, "dy", x[2].dims(), x[0].dims())?;
    same_shape(OP, "dx", out[0].shape.dims(), x[0].dims())?;
    same_shape(OP, "dweight", out[1].shape.dims(), &[c])?;
    same_shape(OP, "dbias", out[2].shape.dims(), &[c])?;
    let (dx, dw, db) = (be.new_out(&out[0], p)?, be.new_out(&out[1], p)?, be.new_out(&out[2], p)?);
    if c == 0 {
        return Ok(vec![dx, dw, db]);
    }
    if dx.numel() == 0 {
        be.fill_pub(&dw, 0.0)?;
        be.fill_pub(&db, 0.0)?;
        return Ok(vec![dx, dw, db]);
    }
    let (xs, w, dy) = (be.dense_pub(x[0])?, be.dense_pub(x[1])?, be.dense_pub(x[2])?);
    let part = CudaTensor::empty(be.gpu(), &[n, c, 2], DType::F64, Purpose::Scratch)?;
    launch(
        be.gpu(),
        "vision_group_norm_backward",
        per_row(n * groups),
        &[
            Arg::Ptr(xs.ptr()),
            Arg::Ptr(w.ptr()),
            Arg::Ptr(dy.ptr()),
            Arg::Ptr(dx.ptr()),
            Arg::Ptr(part.ptr()),
            Arg::I64(groups as i64),
            Arg::I64((c / groups) as i64),
            Arg::I64(s as i64),
            Arg::F64(eps),
        ],
    )?;
    launch(
        be.gpu(),
        "vision_group_norm_dwdb",
        elementwise(c),
        &[
            Arg::Ptr(part.ptr()),
            Arg::Ptr(dw.ptr()),
            Arg::Ptr(db.ptr()),
            Arg::I64(n as i64),
            Arg::I64(c as i64),
        ],
    )?;
    Ok(vec![dx, dw, db])
}

// ---- pooling -------------------------------------------------------------------------------

/// A pooling's sizes (`struct PoolGeom` in `vision.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PoolGeom {
    planes: i64,
    h: i64,
    w: i64,
    ho: i64,
    wo: i64,
    kh: i64,
    kw: i64,
    sh: i64,
    sw: i64,
    ph: i64,
    pw: i64,
    include_pad: i64,
}

// SAFETY: plain old data with the C layout the kernels declare (twelve i64).
unsafe impl DeviceRepr for PoolGeom {}

/// The CPU's checks (`pool_dims`): `y` is the pooling of `x`, both `[N, C, H, W]`.
fn pool_geom(
    op: &str,
    x: [usize; 4],
    pool: &Pool2dSpec,
    y: [usize; 4],
    pad: bool,
) -> Result<PoolGeom> {
    let hw = pool.out_hw([x[2], x[3]]).map_err(|e| bad(format!("{op}: {e}")))?;
    if y != [x[0], x[1], hw[0], hw[1]] {
        return Err(bad(format!("{op}: output {y:?} is not the pooling of {x:?}")));
    }
    let i = |v: usize| v as i64;
    Ok(PoolGeom {
        planes: i(x[0] * x[1]),
        h: i(x[2]),
        w: i(x[3]),
        ho: i(y[2]),
        wo: i(y[3]),
        kh: i(pool.kernel[0]),
        kw: i(pool.kernel[1]),
        sh: i(pool.stride[0]),
        sw: i(pool.stride[1]),
        ph: i(pool.padding[0]),
        pw: i(pool.padding[1]),
        include_pad: i64::from(pad),
    })
}

/// Max or average pooling (`kernel`), `pad` the average's `count_include_pad`.
fn pool_forward(
    be: &CudaBackend,
    kernel: &'static str,
    x: &CudaTensor,
    pool: &Pool2dSpec,
    pad: bool,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    let op = if kernel == "vision_max_pool" { "max_pool2d" } else { "avg_pool2d" };
    let g = pool_geom(
        op,
        dims4(x.dims(), op, "x")?,
        pool,
        dims4(out.shape.dims(), op, "output")?,
        pad,
    )?;
    let y = be.new_out(out, p)?;
    if y.numel() == 0 {
        return Ok(y);
    }
    let xs = be.dense_pub(x)?;
    launch_then(
        be.gpu(),
        kernel,
        elementwise(y.numel()),
        &[Arg::Ptr(xs.ptr()), Arg::Ptr(y.ptr())],
        Some(&g),
    )?;
    Ok(y)
}

/// Inputs `[x, dy]`.
fn max_pool_backward(
    be: &CudaBackend,
    x: &CudaTensor,
    dy: &CudaTensor,
    pool: &Pool2dSpec,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "max_pool2d_backward";
    let xd = dims4(x.dims(), OP, "x")?;
    let g = pool_geom(OP, xd, pool, dims4(dy.dims(), OP, "dy")?, false)?;
    same_shape(OP, "output", out.shape.dims(), &xd)?;
    let dx = be.new_out(out, p)?;
    if dx.numel() == 0 {
        return Ok(dx);
    }
    let (xs, dys) = (be.dense_pub(x)?, be.dense_pub(dy)?);
    let args = [Arg::Ptr(xs.ptr()), Arg::Ptr(dys.ptr()), Arg::Ptr(dx.ptr())];
    launch_then(be.gpu(), "vision_max_pool_backward", elementwise(dx.numel()), &args, Some(&g))?;
    Ok(dx)
}

/// Inputs `[dy]`.
fn avg_pool_backward(
    be: &CudaBackend,
    dy: &CudaTensor,
    pool: &Pool2dSpec,
    pad: bool,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "avg_pool2d_backward";
    let xd = dims4(out.shape.dims(), OP, "output")?;
    let g = pool_geom(OP, xd, pool, dims4(dy.dims(), OP, "dy")?, pad)?;
    let dx = be.new_out(out, p)?;
    if dx.numel() == 0 {
        return Ok(dx);
    }
    let dys = be.dense_pub(dy)?;
    let args = [Arg::Ptr(dys.ptr()), Arg::Ptr(dx.ptr())];
    launch_then(be.gpu(), "vision_avg_pool_backward", elementwise(dx.numel()), &args, Some(&g))?;
    Ok(dx)
}

// ---- upsampling ----------------------------------------------------------------------------

/// Nearest upsampling of `x` by `scale`, or (`backward`) the block sums of `dy`.
fn upsample(
    be: &CudaBackend,
    x: &CudaTensor,
    scale: [usize; 2],
    backward: bool,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    let op = if backward { "upsample2d_backward" } else { "upsample2d" };
    let xd = dims4(x.dims(), op, if backward { "dy" } else { "x" })?;
    let yd = dims4(out.shape.dims(), op, "output")?;
    // The small side (x forward, dx backward) and the large one.
    let (small, large) = if backward { (yd, xd) } else { (xd, yd) };
    if [small[0], small[1], small[2] * scale[0], small[3] * scale[1]] != large {
        return Err(bad(format!("{op}: {large:?} is not {small:?} scaled by {scale:?}")));
    }
    let y = be.new_out(out, p)?;
    if y.numel() == 0 {
        return Ok(y);
    }
    let xs = be.dense_pub(x)?;
    let (kernel, n) = if backward {
        ("vision_upsample_backward", small.iter().product())
    } else {
        ("vision_upsample", large.iter().product())
    };
    launch(
        be.gpu(),
        kernel,
        elementwise(n),
        &[
            Arg::Ptr(xs.ptr()),
            Arg::Ptr(y.ptr()),
            Arg::I64((small[0] * small[1]) as i64),
            Arg::I64(small[2] as i64),
            Arg::I64(small[3] as i64),
            Arg::I64(scale[0] as i64),
            Arg::I64(scale[1] as i64),
        ],
    )?;
    Ok(y)
}
