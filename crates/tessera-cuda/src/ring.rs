//! Ring attention's log-sum-exp merges on the GPU (`cp=ring`), the CPU's
//! `kernels/attention_merge.rs` kernel for kernel: `Op::AttentionMerge` (n partial `(out,
//! lse)` pairs into one output), its backward (each pair's `do_r`, `dlse_r`) and
//! `Op::RingMerge` (two pairs into the merged output and `log(exp(lse_run) + exp(lse_s))`;
//! a ring's last merge carries q, k, v for its VJP, which this op does not read). The block
//! attentions themselves (global positions, the log-sum-exp's cotangent) are the unfused
//! attention's (module `attention`). Operands are f32 (the backend's autocast upcasts bf16
//! outputs); the pairs' addresses travel by value in the launch parameters.

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::launch::{elementwise, launch, launch_then, per_row, Arg};
use crate::tensor::CudaTensor;
use cudarc::driver::DeviceRepr;
use tessera_ir::{DType, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

/// The most pairs one merge takes (`MERGE_MAX_PAIRS` in `ring.cu`).
pub const MERGE_MAX_PAIRS: usize = 32;

/// The pairs' device addresses (matches `struct MergePtrs` in `ring.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct MergePtrs {
    os: [u64; MERGE_MAX_PAIRS],
    ls: [u64; MERGE_MAX_PAIRS],
    dos: [u64; MERGE_MAX_PAIRS],
    dls: [u64; MERGE_MAX_PAIRS],
}

// SAFETY: plain old data with the C layout the kernels declare.
unsafe impl DeviceRepr for MergePtrs {}

impl MergePtrs {
    fn new() -> MergePtrs {
        MergePtrs {
            os: [0; MERGE_MAX_PAIRS],
            ls: [0; MERGE_MAX_PAIRS],
            dos: [0; MERGE_MAX_PAIRS],
            dls: [0; MERGE_MAX_PAIRS],
        }
    }
}

fn bad(op: &str, why: String) -> RuntimeError {
    RuntimeError::Binding(format!("{op}: {why}"))
}

/// The `(out, lse)` pairs made dense (out, lse, out, …), checked: `[B,S,H,D]` and `[B,H,S]`
/// f32, at most [`MERGE_MAX_PAIRS`].
fn pairs(be: &CudaBackend, op: &str, x: &[&CudaTensor]) -> Result<(Vec<CudaTensor>, [usize; 4])> {
    if x.len() < 2 || !x.len().is_multiple_of(2) {
        return Err(bad(op, format!("takes (out, logsumexp) pairs, got {} inputs", x.len())));
    }
    if x.len() / 2 > MERGE_MAX_PAIRS {
        return Err(RuntimeError::Unsupported {
            backend: "cuda".into(),
            op: op.into(),
            reason: format!(
                "{} partial attentions (the CUDA merge takes at most {MERGE_MAX_PAIRS}); \
                 use a smaller cp, or the CPU runtime",
                x.len() / 2
            ),
        });
    }
    let &[b, s, h, d] = x[0].dims() else {
        return Err(bad(op, format!("out {:?} must be [B,S,H,D]", x[0].dims())));
    };
    let mut ts = Vec::with_capacity(x.len());
    for p in x.chunks(2) {
        if p[0].dims() != [b, s, h, d] || p[1].dims() != [b, h, s] {
            return Err(bad(
                op,
                format!("operands {:?} and {:?} differ", p[0].dims(), p[1].dims()),
            ));
        }
        if p[0].dtype() != DType::F32 || p[1].dtype() != DType::F32 {
            return Err(bad(op, "the merge's operands must be f32".into()));
        }
        ts.push(be.dense_pub(p[0])?);
        ts.push(be.dense_pub(p[1])?);
    }
    Ok((ts, [b, s, h, d]))
}

/// The pairs' addresses.
fn table(ts: &[CudaTensor]) -> MergePtrs {
    let mut t = MergePtrs::new();
    for (r, p) in ts.chunks(2).enumerate() {
        t.os[r] = p[0].ptr();
        t.ls[r] = p[1].ptr();
    }
    t
}

/// `Op::AttentionMerge`: `x` is `[o_0, lse_0, o_1, lse_1, …]`.
pub fn merge(
    be: &CudaBackend,
    x: &[&CudaTensor],
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    let (ts, [b, s, h, d]) = pairs(be, "attention_merge", x)?;
    let o = be.out_f32(out, p)?;
    launch_then(
        be.gpu(),
        "attn_merge",
        per_row(b * s * h),
        &[
            Arg::I32((ts.len() / 2) as i32),
            Arg::Ptr(o.ptr()),
            Arg::I64(s as i64),
            Arg::I64(h as i64),
            Arg::I64(d as i64),
        ],
        Some(&table(&ts)),
    )?;
    Ok(o)
}

/// `Op::AttentionMergeBackward`: `x` is `[o_0, lse_0, …, dout]` → `[do_0, dlse_0, …]`.
pub fn merge_backward(
    be: &CudaBackend,
    x: &[&CudaTensor],
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let op = "attention_merge_backward";
    let Some((dout, rest)) = x.split_last() else {
        return Err(bad(op, "takes inputs".into()));
    };
    let (ts, [b, s, h, d]) = pairs(be, op, rest)?;
    if dout.dims() != [b, s, h, d] || dout.dtype() != DType::F32 {
        return Err(bad(op, format!("dout {:?} must match out (f32)", dout.dims())));
    }
    if out.len() != ts.len() {
        return Err(bad(op, format!("{} outputs for {} pairs", out.len(), ts.len() / 2)));
    }
    let dout = be.dense_pub(dout)?;
    let grads: Vec<CudaTensor> = out.iter().map(|m| be.out_f32(m, p)).collect::<Result<_>>()?;
    let mut t = table(&ts);
    for (r, g) in grads.chunks(2).enumerate() {
        t.dos[r] = g[0].ptr();
        t.dls[r] = g[1].ptr();
    }
    launch_then(
        be.gpu(),
        "attn_merge_backward",
        per_row(b * s * h),
        &[
            Arg::I32((ts.len() / 2) as i32),
            Arg::Ptr(dout.ptr()),
            Arg::I64(s as i64),
            Arg::I64(h as i64),
            Arg::I64(d as i64),
        ],
        Some(&t),
    )?;
    Ok(grads)
}

/// `Op::RingMerge`: `x` is `[o_run, lse_run, o_s, lse_s, ..]` → `[o, lse]` (a last merge's
/// further inputs, its own q, k, v, feed only its backward).
pub fn ring_merge(
    be: &CudaBackend,
    x: &[&CudaTensor],
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let Some(pair) = x.get(..4) else {
        return Err(bad("ring_merge", format!("takes 4 or 7 inputs, got {}", x.len())));
    };
    let o = merge(be, pair, &out[0], p)?;
    let (l0, l1) = (be.dense_pub(pair[1])?, be.dense_pub(pair[3])?);
    let lse = be.out_f32(&out[1], p)?;
    let n = l0.numel();
    launch(
        be.gpu(),
        "ring_lse",
        elementwise(n),
        &[Arg::Ptr(l0.ptr()), Arg::Ptr(l1.ptr()), Arg::Ptr(lse.ptr()), Arg::I64(n as i64)],
    )?;
    Ok(vec![o, lse])
}
