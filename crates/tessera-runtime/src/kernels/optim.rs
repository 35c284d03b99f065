//! AdamW, updating the parameter, its moments and its master copy in place.
//!
//! The update is one fused pass over the elements (rayon over chunks): the storages of m, v,
//! the master weight (when present) and the parameter are borrowed mutably through nested
//! candle in-place ops ([`Tensor::inplace_op1`]), the gradient is read through a shared borrow,
//! and no parameter-sized buffer is allocated. The outputs are handles to the input tensors
//! (`Tensor::clone` shares storage), as the IR's aliasing declares.
//!
//! Arithmetic is f32 per element; the bias corrections and the clip factor are computed in
//! f64 once (the clip factor includes the loss-scaling `grad_scale`, when present). Under
//! mixed precision (`master` present) the f32 master is updated and the parameter (bf16 /
//! f16 / f32) is overwritten with its rounded value.

use super::inplace::{with_slice_mut, Elem};
use super::simd::wide;
use crate::tensor::{contiguous, read};
use crate::{Result, RuntimeError};
use candle_core::{CpuStorage, DType, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;
use tessera_ir::AdamWSpec;

// Input positions, as `tessera_ir::ops::optim` defines them (that module is crate-private).
const PARAM: usize = 0;
const GRAD: usize = 1;
const M: usize = 2;
const V: usize = 3;
const LR: usize = 4;
const STEP: usize = 5;
const GRAD_NORM: usize = 6;

/// Elements per rayon task.
const CHUNK: usize = 1 << 14;

fn unsupported(reason: String) -> RuntimeError {
    RuntimeError::Unsupported { backend: "cpu".into(), op: "adamw".into(), reason }
}

/// Per-step constants of the update.
#[derive(Clone, Copy)]
struct Coef {
    clip: f32,
    b1: f32,
    b2: f32,
    inv_bc1: f32,
    inv_bc2: f32,
    eps: f32,
    lr: f32,
    wd: f32,
}

/// The updated (w, m, v) of one element.
#[inline(always)]
fn update(c: &Coef, w: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
    let g = c.clip * g;
    let m = c.b1 * m + (1.0 - c.b1) * g;
    let v = c.b2 * v + (1.0 - c.b2) * g * g;
    let (m_hat, v_hat) = (m * c.inv_bc1, v * c.inv_bc2);
    (w - c.lr * (m_hat / (v_hat.sqrt() + c.eps) + c.wd * w), m, v)
}

/// Scalar value of a 0-d (or one-element) tensor.
fn scalar(t: &Tensor, what: &str) -> Result<f64> {
    let v = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    match v[..] {
        [x] => Ok(x),
        _ => Err(RuntimeError::Binding(format!(
            "adamw: {what} must be a scalar, got {:?}",
            t.dims()
        ))),
    }
}

/// Address of a tensor's storage (to reject aliased operands before locking them).
fn storage_addr(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    match &*s {
        candle_core::Storage::Cpu(c) => match c {
            CpuStorage::F32(v) => v.as_ptr() as usize,
            CpuStorage::BF16(v) => v.as_ptr() as usize,
            CpuStorage::F16(v) => v.as_ptr() as usize,
            CpuStorage::F64(v) => v.as_ptr() as usize,
            _ => 0,
        },
        _ => 0,
    }
}

/// AdamW on inputs `[param, grad, m, v, lr, step, grad_norm, (master), (grad_scale)]`, in
/// place; returns `[param', m', v', (master')]` sharing storage with the inputs. With
/// `grad_scale` (loss scaling) a non-finite unscaled norm skips the update: nothing is written.
pub fn adamw(spec: &AdamWSpec, x: &[&Tensor]) -> Result<Vec<Tensor>> {
    let base = 7 + usize::from(spec.grad_scale);
    if x.len() != base && x.len() != base + 1 {
        return Err(RuntimeError::Binding(format!(
            "adamw expects {base} or {} inputs, got {}",
            base + 1,
            x.len()
        )));
    }
    let (master_at, scale_at) = spec.optional_inputs(x.len());
    let (param, grad, m, v) = (x[PARAM], x[GRAD], x[M], x[V]);
    let master = master_at.map(|i| x[i]);
    let mut state = vec![(grad, "grad"), (m, "m"), (v, "v")];
    state.extend(master.map(|t| (t, "master")));
    for (t, what) in &state {
        if t.dims() != param.dims() {
            return Err(RuntimeError::Binding(format!(
                "adamw: {what} {:?} must have the parameter's shape {:?}",
                t.dims(),
                param.dims()
            )));
        }
    }
    for (t, what) in state.iter().skip(1) {
        if t.dtype() != DType::F32 {
            return Err(unsupported(format!(
                "{what} is {:?}; optimizer state must be f32",
                t.dtype()
            )));
        }
    }
    let mut written = vec![param, m, v];
    written.extend(master);
    let addrs: Vec<usize> = written.iter().chain([&grad]).map(|t| storage_addr(t)).collect();
    for i in 0..addrs.len() {
        for j in 0..i {
            if addrs[i] != 0 && addrs[i] == addrs[j] && param.elem_count() > 0 {
                return Err(RuntimeError::Binding(
                    "adamw: parameter, gradient and optimizer state must not share storage".into(),
                ));
            }
        }
    }

    let lr = scalar(x[LR], "lr")?;
    if x[STEP].dtype() != DType::I64 {
        return Err(RuntimeError::Binding(format!(
            "adamw: step must be i64, got {:?}",
            x[STEP].dtype()
        )));
    }
    let step = scalar(x[STEP], "step")?;
    if step.is_nan() || step < 1.0 {
        return Err(RuntimeError::Binding(format!(
            "adamw: step {step} must be ≥ 1 (it is 1-based)"
        )));
    }
    let scale = match scale_at {
        Some(i) => scalar(x[i], "grad_scale")?,
        None => 1.0,
    };
    let norm = scalar(x[GRAD_NORM], "grad_norm")? * scale;
    if scale_at.is_some() && !norm.is_finite() {
        // Overflow under loss scaling: skip the step, leaving every state untouched.
        return Ok(written.into_iter().cloned().collect());
    }
    let clip = match spec.max_grad_norm {
        Some(max) => (max / (norm + 1e-6)).min(1.0),
        None => 1.0,
    } * scale;
    let c = Coef {
        clip: clip as f32,
        b1: spec.beta1 as f32,
        b2: spec.beta2 as f32,
        inv_bc1: (1.0 / (1.0 - spec.beta1.powf(step))) as f32,
        inv_bc2: (1.0 / (1.0 - spec.beta2.powf(step))) as f32,
        eps: spec.eps as f32,
        lr: lr as f32,
        wd: spec.weight_decay as f32,
    };

    let grad = contiguous(grad)?; // a copy only for a broadcast / strided gradient view
    match param.dtype() {
        DType::F32 => by_grad::<f32>(&c, param, &grad, m, v, master)?,
        DType::BF16 => by_grad::<bf16>(&c, param, &grad, m, v, master)?,
        DType::F16 => by_grad::<f16>(&c, param, &grad, m, v, master)?,
        d => return Err(unsupported(format!("parameter dtype {d:?} (f32, bf16 or f16 only)"))),
    }
    Ok(written.into_iter().cloned().collect())
}

fn by_grad<P: Elem>(
    c: &Coef,
    param: &Tensor,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    master: Option<&Tensor>,
) -> Result<()> {
    match grad.dtype() {
        DType::F32 => run::<P, f32>(c, param, grad, m, v, master),
        DType::BF16 => run::<P, bf16>(c, param, grad, m, v, master),
        DType::F16 => run::<P, f16>(c, param, grad, m, v, master),
        d => Err(unsupported(format!("gradient dtype {d:?} (f32, bf16 or f16 only)"))),
    }
}

fn run<P: Elem, G: Elem>(
    c: &Coef,
    param: &Tensor,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    master: Option<&Tensor>,
) -> Result<()> {
    let g = read::<G>(grad)?;
    let g: &[G] = &g;
    with_slice_mut::<f32>(m, "adamw: m", |ms| {
        with_slice_mut::<f32>(v, "adamw: v", |vs| match master {
            None => with_slice_mut::<P>(param, "adamw: param", |ps| {
                ps.par_chunks_mut(CHUNK)
                    .zip(g.par_chunks(CHUNK))
                    .zip(ms.par_chunks_mut(CHUNK))
                    .zip(vs.par_chunks_mut(CHUNK))
                    .for_each(|(((ps, gs), ms), vs)| {
                        wide! {
                            for (((p, g), m), v) in ps.iter_mut().zip(gs).zip(ms).zip(vs) {
                                let (w, m2, v2) = update(c, p.get(), g.get(), *m, *v);
                                (*p, *m, *v) = (P::put(w), m2, v2);
                            }
                        }
                    });
                Ok(())
            }),
            Some(master) => with_slice_mut::<f32>(master, "adamw: master", |ws| {
                with_slice_mut::<P>(param, "adamw: param", |ps| {
                    ps.par_chunks_mut(CHUNK)
                        .zip(ws.par_chunks_mut(CHUNK))
                        .zip(g.par_chunks(CHUNK))
                        .zip(ms.par_chunks_mut(CHUNK))
                        .zip(vs.par_chunks_mut(CHUNK))
                        .for_each(|((((ps, ws), gs), ms), vs)| {
                            wide! {
                                for ((((p, w), g), m), v) in
                                    ps.iter_mut().zip(ws).zip(gs).zip(ms).zip(vs)
                                {
                                    let (w2, m2, v2) = update(c, *w, g.get(), *m, *v);
                                    (*p, *w, *m, *v) = (P::put(w2), w2, m2, v2);
                                }
                            }
                        });
                    Ok(())
                })
            }),
        })
    })
}
