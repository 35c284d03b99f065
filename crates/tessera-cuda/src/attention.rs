//! Attention and rotary embeddings on the GPU. The forward saves what the CPU kernel saves
//! (the output and the log-sum-exp `[B,H,S]`); the backward recomputes the probabilities.
//! This first version runs one block per (query, head, batch) with the scores in shared
//! memory and accumulates dk, dv atomically: correct for every mask the IR has (causal,
//! sliding window, KV-cache starts, ALiBi, GQA), not yet the tiled flash kernel.

use crate::alloc::Purpose;
use crate::backend::{geometry, CudaBackend};
use crate::launch::{launch, Arg, THREADS};
use crate::tensor::CudaTensor;
use cudarc::driver::LaunchConfig;
use tessera_ir::dist::MeshPos;
use tessera_ir::{AttentionSpec, DType, TensorMeta};
use tessera_runtime::Result;

fn rows(a: &crate::launch::Attn, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (a.s as u32, a.h as u32, a.b as u32),
        block_dim: (THREADS / 2, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

/// The per-head ALiBi slopes on the device (null without ALiBi) and the per-row starts.
fn extras(
    be: &CudaBackend,
    spec: &AttentionSpec,
    h: usize,
    start: Option<&CudaTensor>,
    at: &MeshPos,
) -> Result<(Option<CudaTensor>, Option<CudaTensor>)> {
    let slopes = match &spec.alibi {
        Some(a) => {
            let s: Vec<f32> = a.local_slopes(h, Some(at))?.into_iter().map(|x| x as f32).collect();
            Some(be.upload_as(&candle_core::Tensor::from_vec(s, h, &candle_core::Device::Cpu)?, Purpose::Scratch)?)
        }
        None => None,
    };
    let start = start.map(|s| be.dense_pub(s)).transpose()?;
    Ok((slopes, start))
}

pub fn forward(
    be: &CudaBackend,
    x: &[&CudaTensor],
    spec: &AttentionSpec,
    at: &MeshPos,
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let (q, k, v) = (be.dense_pub(x[0])?, be.dense_pub(x[1])?, be.dense_pub(x[2])?);
    let a = geometry(&q, &k, spec)?;
    let (slopes, start) = extras(be, spec, a.h as usize, x.get(3).copied(), at)?;
    let o = be.out_f32(&out[0], p)?;
    let lse = be.out_f32(&out[1], p)?;
    launch(be.gpu(), "attention_forward", rows(&a, a.t as usize * 4), &[
        Arg::Ptr(q.ptr()),
        Arg::Ptr(k.ptr()),
        Arg::Ptr(v.ptr()),
        Arg::Ptr(start.as_ref().map_or(0, |t| t.ptr())),
        Arg::Ptr(slopes.as_ref().map_or(0, |t| t.ptr())),
        Arg::Attn(a),
        Arg::Ptr(o.ptr()),
        Arg::Ptr(lse.ptr()),
    ])?;
    Ok(vec![o, lse])
}

/// Inputs `q, k, v, out, lse, dout` → `dq, dk, dv`.
pub fn backward(
    be: &CudaBackend,
    x: &[&CudaTensor],
    spec: &AttentionSpec,
    at: &MeshPos,
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let d: Vec<CudaTensor> = x.iter().map(|t| be.dense_pub(t)).collect::<Result<_>>()?;
    let (q, k, v, o, lse, dout) = (&d[0], &d[1], &d[2], &d[3], &d[4], &d[5]);
    let a = geometry(q, k, spec)?;
    let (slopes, start) = extras(be, spec, a.h as usize, None, at)?;
    let delta = CudaTensor::empty(be.gpu(), &[a.b as usize, a.h as usize, a.s as usize], DType::F32, Purpose::Scratch)?;
    launch(be.gpu(), "attention_delta", rows(&a, 0), &[
        Arg::Ptr(o.ptr()),
        Arg::Ptr(dout.ptr()),
        Arg::Ptr(delta.ptr()),
        Arg::Attn(a),
    ])?;
    let dq = be.out_f32(&out[0], p)?;
    let dk = be.out_f32(&out[1], p)?;
    let dv = be.out_f32(&out[2], p)?;
    be.fill_pub(&dk, 0.0)?;
    be.fill_pub(&dv, 0.0)?;
    launch(be.gpu(), "attention_backward", rows(&a, a.t as usize * 4), &[
        Arg::Ptr(q.ptr()),
        Arg::Ptr(k.ptr()),
        Arg::Ptr(v.ptr()),
        Arg::Ptr(lse.ptr()),
        Arg::Ptr(dout.ptr()),
        Arg::Ptr(delta.ptr()),
        Arg::Ptr(start.as_ref().map_or(0, |t| t.ptr())),
        Arg::Ptr(slopes.as_ref().map_or(0, |t| t.ptr())),
        Arg::Attn(a),
        Arg::Ptr(dq.ptr()),
        Arg::Ptr(dk.ptr()),
        Arg::Ptr(dv.ptr()),
    ])?;
    Ok(vec![dq, dk, dv])
}

pub fn rope(
    be: &CudaBackend,
    x: &CudaTensor,
    positions: Option<&CudaTensor>,
    inv_freq: &[f64],
    inverse: bool,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    let x = be.dense_pub(x)?;
    let &[_, s, h, d] = x.dims() else {
        return Err(tessera_runtime::RuntimeError::Binding(format!("rope: x {:?} must be [B,S,H,D]", x.dims())));
    };
    let f: Vec<f32> = inv_freq.iter().map(|&v| v as f32).collect();
    let freq = be.upload_as(&candle_core::Tensor::from_vec(f, inv_freq.len(), &candle_core::Device::Cpu)?, Purpose::Scratch)?;
    let pos = positions.map(|t| be.dense_pub(t)).transpose()?;
    let y = be.out_f32(out, p)?;
    let n = x.numel() / 2;
    launch(be.gpu(), "rope", crate::launch::elementwise(n), &[
        Arg::Ptr(x.ptr()),
        Arg::Ptr(pos.as_ref().map_or(0, |t| t.ptr())),
        Arg::Ptr(freq.ptr()),
        Arg::Ptr(y.ptr()),
        Arg::I64(s as i64),
        Arg::I64(h as i64),
        Arg::I64(d as i64),
        Arg::F32(if inverse { -1.0 } else { 1.0 }),
        Arg::I64(n as i64),
    ])?;
    Ok(y)
}
