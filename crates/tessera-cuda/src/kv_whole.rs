//! Tensor parallelism past the KV heads on the GPU ([`AttentionSpec::kv_whole`]): q holds some
//! of the model's query heads, k and v every KV head. The local query heads read a contiguous
//! run of KV heads (usually one: more devices than KV heads leave each device fewer query heads
//! than a KV head's group), so the op is the ordinary grouped-query attention on that run,
//! sliced out of k and v (scratch copies): the forward's output and log-sum-exp are the inner
//! attention's; the backward's dq is too, and dk and dv are zero but on the run, where they are
//! the inner attention's (the CPU kernel's result: the planner's all-reduce over the tensor
//! axis sums the devices' runs into the whole gradient). The inner backward's results are
//! scratch and are copied into the declared outputs (Program memory), so the allocator's books
//! stay the accountant's. Local heads that straddle KV heads unevenly are refused by name.

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::tensor::CudaTensor;
use tessera_ir::dist::MeshPos;
use tessera_ir::{AttentionSpec, Op, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

fn bad(msg: String) -> RuntimeError {
    RuntimeError::Binding(msg)
}

/// Runs `op` (an attention or its backward whose spec has `kv_whole`) on the KV heads its
/// query heads read; outputs of purpose `p`.
pub(crate) fn run(
    be: &CudaBackend,
    op: &Op,
    spec: &AttentionSpec,
    x: &[&CudaTensor],
    out: &[TensorMeta],
    at: &MeshPos,
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let backward = matches!(op, Op::AttentionBackward(_));
    let want = if backward { 6 } else { 3 };
    let (Some(q), Some(k)) = (x.first(), x.get(1)) else {
        return Err(bad(format!("{}: {} inputs", op.name(), x.len())));
    };
    if x.len() < want || q.dims().len() != 4 || k.dims().len() != 4 || out.len() < 2 {
        return Err(bad(format!(
            "{}: q {} and k {} must be [B,S,H,D], with {want} inputs and {} outputs",
            op.name(),
            q.meta(),
            k.meta(),
            if backward { 3 } else { 2 }
        )));
    }
    let (h, hkv) = (q.dims()[2], k.dims()[2]);
    let kv = spec.kv_heads_of(h, hkv, Some(at)).map_err(|e| bad(e.to_string()))?;
    let (lo, hi) = match (kv.first(), kv.last()) {
        (Some(&lo), Some(&hi)) => (lo, hi),
        _ => return Err(bad(format!("{}: no query heads", op.name()))),
    };
    let n = hi + 1 - lo;
    // The inner attention maps local head i to KV head i / (h / n): the run must group evenly.
    if !h.is_multiple_of(n) || kv.iter().enumerate().any(|(i, &j)| j != lo + i / (h / n)) {
        return Err(RuntimeError::Unsupported {
            backend: "cuda".into(),
            op: op.name().into(),
            reason: format!(
                "query heads reading KV heads {kv:?} unevenly (tensor parallelism past the KV \
                 heads whose shards straddle KV heads); use a tp that divides the query heads \
                 per KV head, or the CPU runtime"
            ),
        });
    }
    let inner = AttentionSpec { kv_whole: None, ..spec.clone() };
    let (ks, vs) = (heads(be, x[1], lo, n)?, heads(be, x[2], lo, n)?);
    let mut xs: Vec<&CudaTensor> = vec![x[0], &ks, &vs];
    xs.extend_from_slice(&x[3..]);
    if !backward {
        return be.execute_as(&Op::Attention(inner), &xs, out, at, p);
    }
    if out.len() != 3 {
        return Err(bad(format!("{}: {} outputs (dq, dk, dv)", op.name(), out.len())));
    }
    let metas = [out[0].clone(), ks.meta(), vs.meta()];
    let g = be.execute_as(&Op::AttentionBackward(inner), &xs, &metas, at, Purpose::Scratch)?;
    let [dq, dk, dv] = g.as_slice() else {
        return Err(bad(format!("{}: the inner backward gave {} outputs", op.name(), g.len())));
    };
    let dq_out = be.copy(dq, p)?;
    let mut res = vec![dq_out];
    for (part, m) in [(dk, &out[1]), (dv, &out[2])] {
        let whole = be.new_out(m, p)?;
        if whole.dims() != x[1].dims() || whole.dtype() != part.dtype() {
            return Err(bad(format!("{}: {} for k {}", op.name(), m, x[1].meta())));
        }
        be.fill_pub(&whole, 0.0)?;
        be.copy_into_view(part, &heads_view(&whole, lo, n))?;
        res.push(whole);
    }
    Ok(res)
}

/// KV heads `lo..lo + n` of `t [B,T,Hkv,D]`, a view.
fn heads_view(t: &CudaTensor, lo: usize, n: usize) -> CudaTensor {
    let mut v = t.clone();
    v.offset += lo * v.strides[2];
    v.dims[2] = n;
    v
}

/// KV heads `lo..lo + n` of `t`, a contiguous scratch copy.
fn heads(be: &CudaBackend, t: &CudaTensor, lo: usize, n: usize) -> Result<CudaTensor> {
    be.copy(&heads_view(t, lo, n), Purpose::Scratch)
}
