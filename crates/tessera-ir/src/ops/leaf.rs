//! Leaves: parameters, inputs, optimizer state and constants.

use crate::TensorMeta;

/// Leaves take no inputs, except optimizer state which names its parameter.
pub(crate) fn infer(
    x: &[&TensorMeta],
    meta: &TensorMeta,
    num_inputs: usize,
) -> Result<Vec<TensorMeta>, String> {
    super::expect_inputs(x, num_inputs)?;
    if num_inputs == 1 && x[0].shape != meta.shape {
        return Err(format!("optimizer state {meta} must have its parameter's shape {}", x[0]));
    }
    Ok(vec![meta.clone()])
}
