//! Inference ops: the in-place KV-cache write and the per-row position select.

use super::{expect_inputs, expect_int};
use crate::{Shape, TensorMeta};

/// `[cache [B,C,H,D], x [B,S,H,D], start [B]]` → the cache (aliased).
pub(crate) fn infer_cache_write(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 3)?;
    let (c, n) = (x[0].shape.dims(), x[1].shape.dims());
    if c.len() != 4 || n.len() != 4 {
        return Err(format!("cache {} and x {} must be [batch, seq, heads, head_dim]", x[0], x[1]));
    }
    if c[0] != n[0] || c[2] != n[2] || c[3] != n[3] || x[0].dtype != x[1].dtype {
        return Err(format!(
            "x {} does not fit cache {} (batch, heads, head_dim, dtype)",
            x[1], x[0]
        ));
    }
    if n[1] > c[1] {
        return Err(format!("x {} has more positions than the cache {} holds", x[1], x[0]));
    }
    expect_int(x[2], "start")?;
    if x[2].shape.dims() != [c[0]] {
        return Err(format!("start {} must be [batch] = [{}]", x[2], c[0]));
    }
    Ok(vec![x[0].clone()])
}

/// `[x [B,S,..], index [B]]` → `[B,1,..]`.
pub(crate) fn infer_select(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 2)?;
    let d = x[0].shape.dims();
    if d.len() < 2 {
        return Err(format!("x {} must be [batch, seq, ..]", x[0]));
    }
    expect_int(x[1], "index")?;
    if x[1].shape.dims() != [d[0]] {
        return Err(format!("index {} must be [batch] = [{}]", x[1], d[0]));
    }
    let mut out = d.to_vec();
    out[1] = 1;
    Ok(vec![TensorMeta { shape: Shape::from(out), dtype: x[0].dtype }])
}
