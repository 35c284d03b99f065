//! AdamW in place on the GPU: the CPU kernel's update (same coefficients, computed on the
//! host from the scalar inputs), f32 state, f32 or half parameters with an f32 master.

use crate::backend::CudaBackend;
use crate::launch::{elementwise, launch, Arg};
use crate::source::type_code;
use crate::tensor::CudaTensor;
use tessera_ir::{AdamWSpec, DType};
use tessera_runtime::{Result, RuntimeError};

const PARAM: usize = 0;
const GRAD: usize = 1;
const M: usize = 2;
const V: usize = 3;
const LR: usize = 4;
const STEP: usize = 5;
const GRAD_NORM: usize = 6;

pub fn adamw(be: &CudaBackend, spec: &AdamWSpec, x: &[&CudaTensor]) -> Result<Vec<CudaTensor>> {
    let base = 7 + usize::from(spec.grad_scale);
    if x.len() != base && x.len() != base + 1 {
        return Err(RuntimeError::Binding(format!(
            "adamw expects {base} or {} inputs, got {}",
            base + 1,
            x.len()
        )));
    }
    let (master_at, scale_at) = spec.optional_inputs(x.len());
    let (param, m, v) = (x[PARAM], x[M], x[V]);
    let master = master_at.map(|i| x[i]);
    let mut written = vec![param.clone(), m.clone(), v.clone()];
    written.extend(master.cloned());
    for t in written.iter().skip(1) {
        if t.dtype() != DType::F32 || !t.is_contiguous() || t.dims() != param.dims() {
            return Err(RuntimeError::Binding(
                "adamw: optimizer state must be contiguous f32 of the parameter's shape".into(),
            ));
        }
    }
    let grad = be.dense_pub(x[GRAD])?;
    let lr = be.scalar_pub(x[LR])?;
    let step = be.scalar_pub(x[STEP])?;
    if step.is_nan() || step < 1.0 {
        return Err(RuntimeError::Binding(format!("adamw: step {step} must be ≥ 1 (it is 1-based)")));
    }
    let scale = match scale_at {
        Some(i) => be.scalar_pub(x[i])?,
        None => 1.0,
    };
    let norm = be.scalar_pub(x[GRAD_NORM])? * scale;
    if scale_at.is_some() && !norm.is_finite() {
        return Ok(written);
    }
    let clip = match spec.max_grad_norm {
        Some(max) => (max / (norm + 1e-6)).min(1.0),
        None => 1.0,
    } * scale;
    let n = param.numel();
    launch(be.gpu(), "adamw", elementwise(n), &[
        Arg::Ptr(param.ptr()),
        Arg::I32(type_code(param.dtype())),
        Arg::Ptr(grad.ptr()),
        Arg::I32(type_code(grad.dtype())),
        Arg::Ptr(m.ptr()),
        Arg::Ptr(v.ptr()),
        Arg::Ptr(master.map_or(0, |t| t.ptr())),
        Arg::F32(clip as f32),
        Arg::F32(spec.beta1 as f32),
        Arg::F32(spec.beta2 as f32),
        Arg::F32((1.0 / (1.0 - spec.beta1.powf(step))) as f32),
        Arg::F32((1.0 / (1.0 - spec.beta2.powf(step))) as f32),
        Arg::F32(spec.eps as f32),
        Arg::F32(lr as f32),
        Arg::F32(spec.weight_decay as f32),
        Arg::I64(n as i64),
    ])?;
    Ok(written)
}
