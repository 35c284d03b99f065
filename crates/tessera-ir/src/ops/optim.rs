//! AdamW, updating parameter and state in place.

use super::{expect_inputs, Flops};
use crate::{AdamWSpec, DType, Result, TensorMeta};

/// Input positions of the AdamW op.
pub const PARAM: usize = 0;
pub const GRAD: usize = 1;
pub const M: usize = 2;
pub const V: usize = 3;
pub const LR: usize = 4;
pub const STEP: usize = 5;
pub const GRAD_NORM: usize = 6;
pub const MASTER: usize = 7;

pub(crate) fn infer(spec: &AdamWSpec, x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    let base = 7 + usize::from(spec.grad_scale);
    if x.len() != base && x.len() != base + 1 {
        expect_inputs(x, base)?;
    }
    let (master, grad_scale) = spec.optional_inputs(x.len());
    let p = &x[PARAM].shape;
    for (i, what) in [(GRAD, "grad"), (M, "m"), (V, "v")] {
        if &x[i].shape != p {
            return Err(format!("{what} {} must have the parameter's shape {p}", x[i]));
        }
    }
    for (i, what) in [(LR, "lr"), (GRAD_NORM, "grad_norm")] {
        if x[i].shape.rank() != 0 || !x[i].dtype.is_float() {
            return Err(format!("{what} must be a float scalar, got {}", x[i]));
        }
    }
    if let Some(i) = grad_scale {
        if x[i].shape.rank() != 0 || x[i].dtype != DType::F32 {
            return Err(format!("grad_scale must be an f32 scalar, got {}", x[i]));
        }
    }
    if x[STEP].shape.rank() != 0 || x[STEP].dtype != DType::I64 {
        return Err(format!("step must be an i64 scalar, got {}", x[STEP]));
    }
    let mut out = vec![x[PARAM].clone(), x[M].clone(), x[V].clone()];
    if let Some(i) = master {
        if &x[i].shape != p {
            return Err(format!("master {} must have the parameter's shape {p}", x[i]));
        }
        out.push(x[i].clone());
    }
    Ok(out)
}

/// Per element: decay, two moment updates, bias corrections, sqrt, divide, step, clip scale.
pub(crate) fn flops(x: &[&TensorMeta]) -> Flops {
    Flops::other(16 * x[PARAM].numel())
}

/// Outputs `[param', m', v', master']` alias inputs `[param, m, v, master]`.
pub(crate) fn alias(out: usize) -> usize {
    [PARAM, M, V, MASTER][out]
}
