//! Fused softmax cross-entropy on the GPU: the forward saves each row's log-sum-exp, the
//! backward rebuilds the probabilities from it (as the CPU kernel does). With the classes
//! split over tensor-parallel devices (Megatron-LM's vocabulary-parallel loss) the logits hold
//! classes `first..first + count` of `vocab`, the forward takes the log-sum-exp over every
//! class as a third input, and each shard's loss is its part of the row's: the log-sum-exp
//! where it holds class 0, minus the target's logit where it holds the target.
//!
//! Targets are checked on the device, not downloaded: see [`crate::fault`]. The mean divides
//! by the count of non-ignored targets (at least 1; 1 with `sum`), counted on the device too.

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::fault::{BACKWARD, FORWARD};
use crate::launch::{elementwise, launch, per_row, Arg};
use crate::source::float_code;
use crate::tensor::CudaTensor;
use tessera_ir::dist::{MeshPos, ShardOf, TableRows};
use tessera_ir::{DType, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

fn bad(msg: String) -> RuntimeError {
    RuntimeError::Binding(msg)
}

/// Checks `logits [.., V]` against `targets [..]` (the CPU kernel's check); returns the
/// classes the logits hold.
fn classes_of(
    op: &str,
    logits: &CudaTensor,
    targets: &CudaTensor,
    classes: Option<&ShardOf>,
    at: &MeshPos,
) -> Result<TableRows> {
    if targets.dtype() != DType::I64 {
        return Err(bad(format!("{op}: targets must be i64, got {:?}", targets.dtype())));
    }
    let (l, t) = (logits.dims(), targets.dims());
    if l.len() < 2 || &l[..l.len() - 1] != t {
        return Err(bad(format!(
            "{op}: logits {l:?} must be targets' shape {t:?} plus a class dim"
        )));
    }
    Ok(TableRows::of(classes, l[l.len() - 1], Some(at))?)
}

/// An f32 tensor of the targets' shape (a log-sum-exp per row).
fn per_target(op: &str, what: &str, x: &CudaTensor, targets: &CudaTensor) -> Result<()> {
    if x.dtype() != DType::F32 || x.dims() != targets.dims() {
        return Err(bad(format!(
            "{op}: {what} {} must be f32 of targets' shape {:?}",
            x.meta(),
            targets.dims()
        )));
    }
    Ok(())
}

/// The targets' count and check (`cross_entropy_targets`): with `nll` the forward's loss into
/// `loss`, else the backward's divisor into `div`.
#[allow(clippy::too_many_arguments)]
fn targets_kernel(
    be: &CudaBackend,
    targets: &CudaTensor,
    r: &TableRows,
    ignore: Option<i64>,
    sum: bool,
    op: i32,
    nll: u64,
    loss: u64,
    div: u64,
) -> Result<()> {
    let fault = be.target_fault().for_kernel()?;
    launch(
        be.gpu(),
        "cross_entropy_targets",
        per_row(1),
        &[
            Arg::Ptr(targets.ptr()),
            Arg::I64(targets.numel() as i64),
            Arg::I64(r.vocab as i64),
            Arg::I64(ignore.unwrap_or(0)),
            Arg::I32(i32::from(ignore.is_some())),
            Arg::I32(i32::from(sum)),
            Arg::I32(op),
            Arg::Ptr(fault),
            Arg::Ptr(nll),
            Arg::Ptr(loss),
            Arg::Ptr(div),
        ],
    )
}

/// Inputs `logits, targets[, logsumexp]` → `[loss, logsumexp]`.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy(
    be: &CudaBackend,
    x: &[&CudaTensor],
    ignore: Option<i64>,
    sum: bool,
    classes: Option<&ShardOf>,
    at: &MeshPos,
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    const OP: &str = "cross_entropy";
    let (logits, targets) = (be.dense_pub(x[0])?, be.dense_pub(x[1])?);
    let r = classes_of(OP, &logits, &targets, classes, at)?;
    let given = match x.get(2) {
        Some(l) => {
            per_target(OP, "logsumexp", l, &targets)?;
            Some(be.dense_pub(l)?)
        }
        None => None,
    };
    let rows = targets.numel();
    let loss = be.out_f32(&out[0], p)?;
    let lse = be.out_f32(&out[1], p)?;
    let nll = CudaTensor::empty(be.gpu(), &[rows], DType::F64, Purpose::Scratch)?;
    if rows > 0 {
        launch(
            be.gpu(),
            "cross_entropy_rows",
            per_row(rows),
            &[
                Arg::Ptr(logits.ptr()),
                Arg::I32(float_code(OP, logits.dtype())?),
                Arg::Ptr(targets.ptr()),
                Arg::Ptr(given.as_ref().map_or(0, |g| g.ptr())),
                Arg::Ptr(lse.ptr()),
                Arg::Ptr(nll.ptr()),
                Arg::I64(r.count as i64),
                Arg::I64(r.first as i64),
                Arg::I64(r.vocab as i64),
                Arg::I64(ignore.unwrap_or(0)),
                Arg::I32(i32::from(ignore.is_some())),
            ],
        )?;
    }
    targets_kernel(be, &targets, &r, ignore, sum, FORWARD, nll.ptr(), loss.ptr(), 0)?;
    Ok(vec![loss, lse])
}

/// Inputs `logits, targets, logsumexp, dloss` → `dlogits`.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_backward(
    be: &CudaBackend,
    x: &[&CudaTensor],
    ignore: Option<i64>,
    sum: bool,
    classes: Option<&ShardOf>,
    at: &MeshPos,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    const OP: &str = "cross_entropy_backward";
    let (logits, targets, lse, dloss) =
        (be.dense_pub(x[0])?, be.dense_pub(x[1])?, be.dense_pub(x[2])?, be.dense_pub(x[3])?);
    let r = classes_of(OP, &logits, &targets, classes, at)?;
    per_target(OP, "logsumexp", &lse, &targets)?;
    if dloss.dtype() != DType::F32 || dloss.numel() != 1 {
        return Err(bad(format!("{OP}: dloss {} must be an f32 scalar", dloss.meta())));
    }
    let div = CudaTensor::empty(be.gpu(), &[1], DType::F64, Purpose::Scratch)?;
    targets_kernel(be, &targets, &r, ignore, sum, BACKWARD, 0, 0, div.ptr())?;
    let v = r.count;
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
            Arg::I32(float_code(OP, logits.dtype())?),
            Arg::Ptr(targets.ptr()),
            Arg::Ptr(lse.ptr()),
            Arg::Ptr(dloss.ptr()),
            Arg::Ptr(div.ptr()),
            Arg::Ptr(y.ptr()),
            Arg::I32(float_code(OP, y.dtype())?),
            Arg::I64(v as i64),
            Arg::I64(r.first as i64),
            Arg::I64(ignore.unwrap_or(0)),
            Arg::I32(i32::from(ignore.is_some())),
            Arg::I64(n as i64),
        ],
    )?;
    Ok(y)
}

/// `log Σ exp` over the last dim (f32, bf16 or f16 in; f32 out, −∞ for an empty row).
pub fn logsumexp(
    be: &CudaBackend,
    x: &CudaTensor,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    let Some(&v) = x.dims().last() else {
        return Err(bad("logsumexp: needs at least one dim".into()));
    };
    if out.dtype != DType::F32 {
        return Err(bad(format!("logsumexp: the output must be f32, got {out}")));
    }
    let x = be.dense_pub(x)?;
    let y = be.out_f32(out, p)?;
    let rows = y.numel();
    if rows > 0 {
        launch(
            be.gpu(),
            "logsumexp_rows",
            per_row(rows),
            &[
                Arg::Ptr(x.ptr()),
                Arg::I32(float_code("logsumexp", x.dtype())?),
                Arg::Ptr(y.ptr()),
                Arg::I64(v as i64),
            ],
        )?;
    }
    Ok(y)
}
