//! Fused softmax cross-entropy on the GPU: the forward saves each row's log-sum-exp, the
//! backward rebuilds the probabilities from it (as the CPU kernel does). Targets are checked
//! on the host first, with the CPU kernel's error for an out-of-range class.

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::launch::{elementwise, launch, per_row, Arg};
use crate::source::float_code;
use crate::tensor::CudaTensor;
use tessera_ir::{DType, TensorMeta};
use tessera_runtime::{Backend, Result};

/// The non-ignored target count, or the CPU kernel's error for the first bad target.
fn check_targets(
    be: &CudaBackend,
    t: &CudaTensor,
    classes: usize,
    ignore: Option<i64>,
) -> Result<usize> {
    let host = be.download(t)?.flatten_all()?.to_vec1::<i64>()?;
    tessera_runtime::kernels::check_targets("cross_entropy", &host, classes, ignore)
}

pub fn cross_entropy(
    be: &CudaBackend,
    logits: &CudaTensor,
    targets: &CudaTensor,
    ignore: Option<i64>,
    sum: bool,
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let (logits, targets) = (be.dense_pub(logits)?, be.dense_pub(targets)?);
    let v = *logits.dims().last().unwrap_or(&1);
    let rows = logits.numel() / v.max(1);
    let count = check_targets(be, &targets, v, ignore)?;
    let loss = be.out_f32(&out[0], p)?;
    let lse = be.out_f32(&out[1], p)?;
    let nll = CudaTensor::empty(be.gpu(), &[rows], DType::F32, Purpose::Scratch)?;
    launch(
        be.gpu(),
        "cross_entropy_rows",
        per_row(rows),
        &[
            Arg::Ptr(logits.ptr()),
            Arg::I32(float_code("cross_entropy", logits.dtype())?),
            Arg::Ptr(targets.ptr()),
            Arg::Ptr(lse.ptr()),
            Arg::Ptr(nll.ptr()),
            Arg::I64(v as i64),
            Arg::I64(ignore.unwrap_or(0)),
            Arg::I32(i32::from(ignore.is_some())),
        ],
    )?;
    let div = if sum { 1.0 } else { count.max(1) as f64 };
    launch(
        be.gpu(),
        "sum_to_scalar",
        per_row(1),
        &[Arg::Ptr(nll.ptr()), Arg::I64(rows as i64), Arg::F64(div), Arg::Ptr(loss.ptr())],
    )?;
    Ok(vec![loss, lse])
}

pub fn cross_entropy_backward(
    be: &CudaBackend,
    x: &[&CudaTensor],
    ignore: Option<i64>,
    sum: bool,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    let (logits, targets, lse, dloss) =
        (be.dense_pub(x[0])?, be.dense_pub(x[1])?, be.dense_pub(x[2])?, be.dense_pub(x[3])?);
    let v = *logits.dims().last().unwrap_or(&1);
    let count = check_targets(be, &targets, v, ignore)?;
    let div = if sum { 1.0 } else { count.max(1) as f64 };
    let y = be.out_f32(out, p)?;
    let n = y.numel();
    // A thread per eight logits where the kernel's vector path applies (rows of a multiple of
    // 8, both tensors 16-byte aligned; it decides for itself, this sizes the grid).
    let vec = v % 8 == 0 && logits.ptr() % 16 == 0 && y.ptr() % 16 == 0;
    launch(
        be.gpu(),
        "cross_entropy_backward",
        elementwise(if vec { n.div_ceil(8) } else { n }),
        &[
            Arg::Ptr(logits.ptr()),
            Arg::I32(float_code("cross_entropy_backward", logits.dtype())?),
            Arg::Ptr(targets.ptr()),
            Arg::Ptr(lse.ptr()),
            Arg::Ptr(dloss.ptr()),
            Arg::F64(div),
            Arg::Ptr(y.ptr()),
            Arg::I32(float_code("cross_entropy_backward", y.dtype())?),
            Arg::I64(v as i64),
            Arg::I64(ignore.unwrap_or(0)),
            Arg::I32(i32::from(ignore.is_some())),
            Arg::I64(n as i64),
        ],
    )?;
    Ok(y)
}
