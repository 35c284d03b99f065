//! Inference kernels: the in-place KV-cache write and the per-row position select. Both work
//! on every float dtype natively (no upcast: the cache is written where it lives).

use super::inplace::{with_slice_mut, Elem};
use crate::tensor::{contiguous, read};
use crate::{Result, RuntimeError};
use candle_core::{DType, Tensor};
use half::{bf16, f16};

fn starts(t: &Tensor, b: usize, what: &str) -> Result<Vec<i64>> {
    let v = contiguous(t)?.flatten_all()?.to_vec1::<i64>()?;
    if v.len() != b {
        return Err(RuntimeError::Binding(format!("{what}: {} entries for {b} rows", v.len())));
    }
    Ok(v)
}

/// Writes `x [B,S,H,D]` into `cache [B,C,H,D]` at positions `start[b]..start[b]+S` of each
/// row, in place; returns a handle to the cache (the IR's alias).
pub fn cache_write(cache: &Tensor, x: &Tensor, start: &Tensor) -> Result<Tensor> {
    let (&[b, c, h, d], &[bx, s, hx, dx]) = (cache.dims(), x.dims()) else {
        return Err(RuntimeError::Binding(format!(
            "cache_write: cache {:?} and x {:?} must be [batch, seq, heads, head_dim]",
            cache.dims(),
            x.dims()
        )));
    };
    if (b, h, d) != (bx, hx, dx) || cache.dtype() != x.dtype() {
        return Err(RuntimeError::Binding(format!(
            "cache_write: x {:?} {:?} does not fit cache {:?} {:?}",
            x.dtype(),
            x.dims(),
            cache.dtype(),
            cache.dims()
        )));
    }
    let st = starts(start, b, "cache_write: start")?;
    if let Some((row, &p)) = st.iter().enumerate().find(|(_, &p)| p < 0 || p as usize + s > c) {
        return Err(RuntimeError::Binding(format!(
            "cache_write: row {row} writes positions {p}..{} beyond the cache's {c}: raise the \
             cache capacity (prompt + new tokens)",
            p + s as i64
        )));
    }
    match cache.dtype() {
        DType::F32 => write::<f32>(cache, x, &st, [b, c, s, h * d])?,
        DType::BF16 => write::<bf16>(cache, x, &st, [b, c, s, h * d])?,
        DType::F16 => write::<f16>(cache, x, &st, [b, c, s, h * d])?,
        other => {
            return Err(RuntimeError::Unsupported {
                backend: "cpu".into(),
                op: "cache_write".into(),
                reason: format!("a {other:?} cache"),
            })
        }
    }
    Ok(cache.clone())
}

fn write<T: Elem>(
    cache: &Tensor,
    x: &Tensor,
    st: &[i64],
    [b, c, s, row]: [usize; 4],
) -> Result<()> {
    let x = contiguous(x)?;
    let xs = read::<T>(&x)?;
    with_slice_mut::<T>(cache, "cache_write: cache", |cs| {
        for (bi, &p) in st.iter().enumerate().take(b) {
            let dst = (bi * c + p as usize) * row;
            let src = bi * s * row;
            cs[dst..dst + s * row].copy_from_slice(&xs[src..src + s * row]);
        }
        Ok(())
    })
}

/// Row `b` of `x [B,S,..]` at position `index[b]`: a fresh `[B,1,..]`.
pub fn select_positions(x: &Tensor, index: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    if dims.len() < 2 {
        return Err(RuntimeError::Binding(format!(
            "select_positions: x {dims:?} must be [batch, seq, ..]"
        )));
    }
    let (b, s) = (dims[0], dims[1]);
    let idx = starts(index, b, "select_positions: index")?;
    let rows = idx
        .iter()
        .enumerate()
        .map(|(bi, &i)| {
            if i < 0 || i as usize >= s {
                return Err(RuntimeError::Binding(format!(
                    "select_positions: row {bi} asks for position {i} of {s}"
                )));
            }
            Ok(x.narrow(0, bi, 1)?.narrow(1, i as usize, 1)?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&rows, 0)?.force_contiguous()?)
}
