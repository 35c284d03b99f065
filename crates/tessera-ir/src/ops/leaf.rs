//! Leaves: parameters, inputs, optimizer state and constants.

use crate::TensorMeta;

/// Leaves take no inputs, except optimizer state which names its parameter. The state has the
/// parameter's shape, or under ZeRO that of an even shard of it.
pub(crate) fn infer(
    x: &[&TensorMeta],
    meta: &TensorMeta,
    num_inputs: usize,
) -> Result<Vec<TensorMeta>, String> {
    super::expect_inputs(x, num_inputs)?;
    if num_inputs == 1 {
        let (p, s) = (x[0].shape.dims(), meta.shape.dims());
        let shard = p.len() == s.len() && p.iter().zip(s).all(|(&p, &s)| s > 0 && p % s == 0);
        if !shard {
            return Err(format!(
                "optimizer state {meta} must have its parameter's shape {} or a shard of it",
                x[0]
            ));
        }
    }
    Ok(vec![meta.clone()])
}
