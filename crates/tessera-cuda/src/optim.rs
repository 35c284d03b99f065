//! AdamW in place on the GPU: the CPU kernel's update (the same coefficients, computed by the
//! kernel from the scalar inputs where they live, so no host round trip), f32 state, f32 or
//! half parameters with an f32 master.

use crate::backend::CudaBackend;
use crate::launch::{elementwise, launch, Arg};
use crate::source::{float_code, type_code};
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

/// Blocks of the AdamW launch at most (a few per SM on current GPUs).
const ADAMW_BLOCKS: u32 = 1024;

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
    let scalar = |t: &CudaTensor| (Arg::Ptr(t.ptr()), Arg::I32(type_code(t.dtype())));
    let (lr, lr_t) = scalar(x[LR]);
    let (step, step_t) = scalar(x[STEP]);
    let (norm, norm_t) = scalar(x[GRAD_NORM]);
    let (scale, scale_t) = match scale_at {
        Some(i) => scalar(x[i]),
        None => (Arg::Ptr(0), Arg::I32(0)),
    };
    let n = param.numel();
    // Each thread first derives the step's coefficients (two `pow`s in double): cap the grid so
    // that prologue is paid per thread over many elements, not per element.
    let mut cfg = elementwise(n);
    cfg.grid_dim.0 = cfg.grid_dim.0.min(ADAMW_BLOCKS);
    launch(
        be.gpu(),
        "adamw",
        cfg,
        &[
            Arg::Ptr(param.ptr()),
            Arg::I32(float_code("adamw", param.dtype())?),
            Arg::Ptr(grad.ptr()),
            Arg::I32(float_code("adamw", grad.dtype())?),
            Arg::Ptr(m.ptr()),
            Arg::Ptr(v.ptr()),
            Arg::Ptr(master.map_or(0, |t| t.ptr())),
            lr,
            lr_t,
            step,
            step_t,
            norm,
            norm_t,
            scale,
            scale_t,
            Arg::F64(spec.beta1),
            Arg::F64(spec.beta2),
            Arg::F64(spec.eps),
            Arg::F64(spec.weight_decay),
            Arg::F64(spec.max_grad_norm.unwrap_or(-1.0)),
            Arg::I64(n as i64),
            // Skips the update after a bad cross-entropy target (module `fault`).
            Arg::Ptr(be.target_fault().for_update()),
        ],
    )?;
    Ok(written)
}
