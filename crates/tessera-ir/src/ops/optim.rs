//! AdamW, updating parameter and state in place.

use super::{expect_inputs, Flops};
use crate::{DType, Result, TensorMeta};

/// Input positions of the AdamW op.
pub const PARAM: usize = 0;
pub const GRAD: usize = 1;
pub const M: usize = 2;
pub const V: usize = 3;
pub const LR: usize = 4;
pub const STEP: usize = 5;
pub const GRAD_NORM: usize = 6;
pub const MASTER: usize = 7;

pub(crate) fn infer(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    if x.len() != 7 && x.len() != 8 {
        expect_inputs(x, 7)?;
    }
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
    if x[STEP].shape.rank() != 0 || x[STEP].dtype != DType::I64 {
        return Err(format!("step must be an i64 scalar, got {}", x[STEP]));
    }
    let mut out = vec![x[PARAM].clone(), x[M].clone(), x[V].clone()];
    if x.len() == 8 {
        if &x[MASTER].shape != p {
            return Err(format!("master {} must have the parameter's shape {p}", x[MASTER]));
        }
        out.push(x[MASTER].clone());
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
