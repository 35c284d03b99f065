//! Reshape and expand (views sharing the input's storage), and permute, slice, pad and
//! concat (fresh contiguous copies, made in parallel). Layout ops move bytes and never look
//! at them, so they accept every dtype the runtime stores (f32/f64/f16/bf16, i64 ids, u8
//! bools): slicing the targets out of a token batch is a layout op on i64.

use super::elementwise::{numel, unsupported, walk, View};
use super::strided::fresh;
use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::{DType as CDType, Tensor, WithDType};
use rayon::prelude::*;
use std::mem::MaybeUninit;
use tessera_ir::Shape;

/// Runs `$body` with `$T` the element type of candle dtype `$dt`.
macro_rules! with_dtype {
    ($op:expr, $dt:expr, $T:ident => $body:expr) => {
        match $dt {
            CDType::F32 => {
                type $T = f32;
                $body
            }
            CDType::F64 => {
                type $T = f64;
                $body
            }
            CDType::F16 => {
                type $T = half::f16;
                $body
            }
            CDType::BF16 => {
                type $T = half::bf16;
                $body
            }
            CDType::I64 => {
                type $T = i64;
                $body
            }
            CDType::U8 => {
                type $T = u8;
                $body
            }
            other => Err(unsupported($op, format!("dtype {other:?} is not stored by the runtime"))),
        }
    };
}

/// Bytes per parallel copy task.
const COPY_CHUNK_BYTES: usize = 1 << 17;

/// A fresh contiguous copy of any view (transposed, narrowed, broadcast), in parallel.
fn copy_strided<T: WithDType>(t: &Tensor) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let v = View::new(t)?;
    let st = v.strides_for(&dims)?;
    let src = v.data::<T>()?;
    let fill = |out: &mut [MaybeUninit<T>]| {
        walk(out, &dims, [&st], [v.offset()], |o, _, [i], [s]| {
            if s == 1 {
                o.write_copy_of_slice(&src[i..i + o.len()]);
            } else {
                for (k, o) in o.iter_mut().enumerate() {
                    o.write(src[i + k * s]);
                }
            }
        })
    };
    // SAFETY: `walk` visits every output element once.
    let out = unsafe { fresh(numel(&dims), fill) };
    from_vec(out, &dims)
}

/// Same elements, new shape: a view sharing `x`'s storage when `x` is contiguous (the usual
/// case); a non-contiguous `x` is materialised first.
pub fn reshape(x: &Tensor, s: &Shape) -> Result<Tensor> {
    if x.elem_count() as u64 != s.numel() {
        return Err(RuntimeError::Binding(format!(
            "reshape: cannot view {:?} ({} elements) as {s}",
            x.dims(),
            x.elem_count()
        )));
    }
    if x.is_contiguous() {
        // candle: a view of the same storage, same start offset; nothing is copied.
        Ok(x.reshape(s.dims())?)
    } else {
        let dense = with_dtype!("reshape", x.dtype(), T => copy_strided::<T>(x))?;
        Ok(dense.reshape(s.dims())?)
    }
}

/// NumPy broadcast to `s` as a view (stride 0 along stretched and new leading dims).
pub fn expand(x: &Tensor, s: &Shape) -> Result<Tensor> {
    x.broadcast_as(s.dims()).map_err(|_| {
        RuntimeError::Binding(format!("expand: cannot broadcast {:?} to {s}", x.dims()))
    })
}

/// Output dim `i` is input dim `perm[i]`; a fresh contiguous copy.
pub fn permute(x: &Tensor, perm: &[usize]) -> Result<Tensor> {
    let r = x.rank();
    let mut seen = vec![false; r];
    if perm.len() != r || perm.iter().any(|&p| p >= r || std::mem::replace(&mut seen[p], true)) {
        return Err(RuntimeError::Binding(format!(
            "permute: {perm:?} is not a permutation of {r} dims"
        )));
    }
    let view = x.permute(perm)?;
    with_dtype!("permute", x.dtype(), T => copy_strided::<T>(&view))
}

/// `start..end` along `dim`; a fresh contiguous copy.
pub fn slice(x: &Tensor, dim: usize, start: usize, end: usize) -> Result<Tensor> {
    if dim >= x.rank() || start > end || end > x.dims()[dim] {
        return Err(RuntimeError::Binding(format!(
            "slice: {start}..{end} of dim {dim} is out of range for {:?}",
            x.dims()
        )));
    }
    let view = x.narrow(dim, start, end - start)?;
    with_dtype!("slice", x.dtype(), T => copy_strided::<T>(&view))
}

fn split_at(dims: &[usize], d: usize) -> (usize, usize, usize) {
    (numel(&dims[..d]), dims[d], numel(&dims[d + 1..]))
}

/// Rows of `row` elements per parallel copy task.
fn rows_per_task<T>(row: usize) -> usize {
    (COPY_CHUNK_BYTES / (row * std::mem::size_of::<T>()).max(1)).max(1)
}

fn pad_t<T: WithDType>(x: &Tensor, dim: usize, before: usize, after: usize) -> Result<Tensor> {
    let xc = contiguous(x)?;
    let xs = read::<T>(&xc)?;
    let (outer, size, inner) = split_at(x.dims(), dim);
    let total = before + size + after;
    let (src_row, dst_row) = (size * inner, total * inner);
    let mut out = vec![T::from_f64(0.0); outer * dst_row];
    if src_row > 0 {
        let per = rows_per_task::<T>(dst_row);
        out.par_chunks_mut(per * dst_row).enumerate().for_each(|(k, chunk)| {
            for (j, row) in chunk.chunks_mut(dst_row).enumerate() {
                let o = k * per + j;
                row[before * inner..before * inner + src_row]
                    .copy_from_slice(&xs[o * src_row..(o + 1) * src_row]);
            }
        });
    }
    let mut dims = x.dims().to_vec();
    dims[dim] = total;
    from_vec(out, &dims)
}

/// Zero padding: `before` and `after` zero slices around `x` along `dim`.
pub fn pad(x: &Tensor, dim: usize, before: usize, after: usize) -> Result<Tensor> {
    if dim >= x.rank() {
        return Err(RuntimeError::Binding(format!(
            "pad: dim {dim} is out of range for {:?}",
            x.dims()
        )));
    }
    with_dtype!("pad", x.dtype(), T => pad_t::<T>(x, dim, before, after))
}

fn concat_t<T: WithDType>(xs: &[&Tensor], dim: usize) -> Result<Tensor> {
    let first = xs[0].dims();
    let conts = xs.iter().map(|t| contiguous(t)).collect::<Result<Vec<_>>>()?;
    let datas = conts.iter().map(|t| read::<T>(t)).collect::<Result<Vec<_>>>()?;
    let srcs: Vec<&[T]> = datas.iter().map(|d| &**d).collect();
    let (outer, _, inner) = split_at(first, dim);
    let widths: Vec<usize> = xs.iter().map(|t| t.dims()[dim] * inner).collect();
    let dst_row: usize = widths.iter().sum();
    let fill = |out: &mut [MaybeUninit<T>]| {
        if dst_row == 0 {
            return;
        }
        let per = rows_per_task::<T>(dst_row);
        out.par_chunks_mut(per * dst_row).enumerate().for_each(|(k, chunk)| {
            for (j, row) in chunk.chunks_mut(dst_row).enumerate() {
                let o = k * per + j;
                let mut at = 0;
                for (src, &w) in srcs.iter().zip(&widths) {
                    row[at..at + w].write_copy_of_slice(&src[o * w..(o + 1) * w]);
                    at += w;
                }
            }
        });
    };
    // SAFETY: every row's `dst_row` elements are written, the inputs' widths side by side
    // (with no elements at all when dst_row is 0).
    let out = unsafe { fresh(outer * dst_row, fill) };
    let mut dims = first.to_vec();
    dims[dim] = xs.iter().map(|t| t.dims()[dim]).sum();
    from_vec(out, &dims)
}

/// Inputs joined along `dim` (all dims but `dim` equal, one dtype).
pub fn concat(xs: &[&Tensor], dim: usize) -> Result<Tensor> {
    let Some(first) = xs.first() else {
        return Err(RuntimeError::Binding("concat needs at least one input".into()));
    };
    let fd = first.dims();
    if dim >= fd.len() {
        return Err(RuntimeError::Binding(format!("concat: dim {dim} is out of range for {fd:?}")));
    }
    for t in xs {
        let d = t.dims();
        let same = d.len() == fd.len() && (0..d.len()).all(|i| i == dim || d[i] == fd[i]);
        if !same || t.dtype() != first.dtype() {
            return Err(RuntimeError::Binding(format!(
                "concat: {:?}{d:?} does not match {:?}{fd:?} outside dim {dim}",
                t.dtype(),
                first.dtype()
            )));
        }
    }
    with_dtype!("concat", first.dtype(), T => concat_t::<T>(xs, dim))
}
