//! Strided elementwise maps: [`View`] reads a candle view (broadcast, transposed, narrowed,
//! offset) in place through its strides, [`walk`] runs over an output in parallel chunks, and
//! `map1_as` / `map2_as` / `map3` apply an f32 function to one, two or three such operands
//! into a fresh contiguous tensor (the first two also on bf16 operands, rounding once). Split out of
//! `elementwise.rs`, whose kernels (and layout's, reduce's) use them.

use super::inplace::Elem;
use super::simd::wide;
use crate::tensor::from_vec;
use crate::{Result, RuntimeError};
use candle_core::{Layout, Storage, StorageRef, Tensor, WithDType};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Elements per parallel task: large enough to amortise rayon's scheduling (~1 µs).
pub(super) const CHUNK: usize = 1 << 15;

/// Elements of a tensor of shape `dims`.
pub(super) fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// A vector of `len` elements that `fill` writes, in fresh uninitialised memory: zeroing it
/// first cost a memset per op (the counting allocator hands back cached blocks, so a zeroed
/// request is a `memset`, not fresh zero pages).
///
/// # Safety
/// `fill` writes every one of the `len` elements.
pub(super) unsafe fn fresh<T>(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: every element was written (contract).
    unsafe { out.set_len(len) };
    out
}

/// A tensor's whole storage (read-locked) with its layout: strided reads without a copy.
pub(super) struct View<'a> {
    guard: StorageRef<'a>,
    layout: &'a Layout,
}

impl<'a> View<'a> {
    pub(super) fn new(t: &'a Tensor) -> Result<View<'a>> {
        let (guard, layout) = t.storage_and_layout();
        if !matches!(&*guard, Storage::Cpu(_)) {
            return Err(RuntimeError::Binding(
                "the CPU backend got a tensor on another device".into(),
            ));
        }
        Ok(View { guard, layout })
    }

    /// Every element of the underlying storage (index it with [`View::offset`] and strides).
    pub(super) fn data<T: WithDType>(&self) -> Result<&[T]> {
        match &*self.guard {
            Storage::Cpu(c) => Ok(c.as_slice::<T>()?),
            _ => unreachable!("device checked in View::new"),
        }
    }

    pub(super) fn offset(&self) -> usize {
        self.layout.start_offset()
    }

    /// Strides (in elements) that read this view as if broadcast to `out` (NumPy rules:
    /// right-aligned, size-1 and missing dims get stride 0).
    pub(super) fn strides_for(&self, out: &[usize]) -> Result<Vec<usize>> {
        let (d, s) = (self.layout.dims(), self.layout.stride());
        let bad = || {
            RuntimeError::Binding(format!(
                "an operand of shape {d:?} does not broadcast to {out:?}"
            ))
        };
        if d.len() > out.len() {
            return Err(bad());
        }
        let lead = out.len() - d.len();
        let mut st = vec![0; out.len()];
        for (k, (&dk, &sk)) in d.iter().zip(s).enumerate() {
            if dk == out[lead + k] {
                st[lead + k] = if dk == 1 { 0 } else { sk };
            } else if dk != 1 {
                return Err(bad());
            }
        }
        Ok(st)
    }
}

/// Walks an output of shape `dims` (row-major, `out.len() == numel(dims)`) in parallel chunks
/// of [`CHUNK`] elements. Dims of size 1 are dropped and adjacent dims merged where every
/// operand allows, then for each run along the innermost remaining dim `seg(run, flat, offs,
/// inner)` is called: `run` the output elements, `flat` the flat index of `run[0]`, `offs[k]`
/// operand `k`'s element offset for `run[0]` and `inner[k]` its stride along the run.
pub(super) fn walk<T: Send, const N: usize>(
    out: &mut [T],
    dims: &[usize],
    strides: [&[usize]; N],
    offsets: [usize; N],
    seg: impl Fn(&mut [T], usize, [usize; N], [usize; N]) + Sync,
) {
    debug_assert_eq!(out.len(), numel(dims));
    if out.is_empty() {
        return;
    }
    // Collapse: drop size-1 dims, merge a dim into the previous one when it is contiguous
    // with it for every operand.
    let mut cd: Vec<usize> = Vec::with_capacity(dims.len());
    let mut cs: [Vec<usize>; N] = std::array::from_fn(|_| Vec::with_capacity(dims.len()));
    for (i, &d) in dims.iter().enumerate() {
        if d == 1 {
            continue;
        }
        let merge = !cd.is_empty() && (0..N).all(|k| *cs[k].last().unwrap() == strides[k][i] * d);
        if merge {
            *cd.last_mut().unwrap() *= d;
            for k in 0..N {
                *cs[k].last_mut().unwrap() = strides[k][i];
            }
        } else {
            cd.push(d);
            for k in 0..N {
                cs[k].push(strides[k][i]);
            }
        }
    }
    if cd.is_empty() {
        cd.push(1);
        for s in cs.iter_mut() {
            s.push(0);
        }
    }
    let r = cd.len() - 1;
    let inner = cd[r];
    let inner_st: [usize; N] = std::array::from_fn(|k| cs[k][r]);
    let (od, os) = (&cd[..r], &cs);

    let run_chunk = |start: usize, chunk: &mut [T]| {
        let (mut row, mut col) = (start / inner, start % inner);
        let mut idx = vec![0usize; r];
        for d in (0..r).rev() {
            idx[d] = row % od[d];
            row /= od[d];
        }
        let mut base: [usize; N] =
            std::array::from_fn(|k| offsets[k] + (0..r).map(|d| idx[d] * os[k][d]).sum::<usize>());
        let mut pos = 0;
        while pos < chunk.len() {
            let n = (inner - col).min(chunk.len() - pos);
            let offs: [usize; N] = std::array::from_fn(|k| base[k] + col * inner_st[k]);
            seg(&mut chunk[pos..pos + n], start + pos, offs, inner_st);
            pos += n;
            col = 0;
            if pos == chunk.len() {
                break;
            }
            for d in (0..r).rev() {
                idx[d] += 1;
                for k in 0..N {
                    base[k] += os[k][d];
                }
                if idx[d] < od[d] {
                    break;
                }
                for k in 0..N {
                    base[k] -= os[k][d] * od[d];
                }
                idx[d] = 0;
            }
        }
    };
    if out.len() <= CHUNK {
        run_chunk(0, out);
    } else {
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(ci, c)| run_chunk(ci * CHUNK, c));
    }
}

/// `f` applied to every element of `x` (any layout) of element type `T` (f32, or bf16 read
/// exactly as f32), as a fresh contiguous tensor, the f32 result rounded to `T`: the bits the
/// backend's upcast path gives, without its f32 copies.
pub(super) fn map1_as<T: Elem, F: Fn(f32) -> f32 + Sync>(x: &Tensor, f: F) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let vx = View::new(x)?;
    let sx = vx.strides_for(&dims)?;
    let dx = vx.data::<T>()?;
    let fill = |out: &mut [MaybeUninit<T>]| {
        walk(out, &dims, [&sx], [vx.offset()], |o, _, [i], [s]| {
            wide! {
                if s == 1 {
                    let n = o.len();
                    for (o, &v) in o.iter_mut().zip(&dx[i..i + n]) {
                        o.write(T::put(f(v.get())));
                    }
                } else {
                    for (k, o) in o.iter_mut().enumerate() {
                        o.write(T::put(f(dx[i + k * s].get())));
                    }
                }
            }
        })
    };
    // SAFETY: `walk` visits every output element once.
    let out = unsafe { fresh(numel(&dims), fill) };
    from_vec(out, &dims)
}

/// `f(a, b)` elementwise with both operands read (broadcast, any layout) as `dims`, of
/// element type `T` (f32, or bf16 read exactly as f32), the f32 result rounded to `T`: the
/// bits the backend's upcast path gives, without its f32 copies.
pub(super) fn map2_as<T: Elem, F: Fn(f32, f32) -> f32 + Sync>(
    a: &Tensor,
    b: &Tensor,
    dims: &[usize],
    f: F,
) -> Result<Tensor> {
    let (va, vb) = (View::new(a)?, View::new(b)?);
    let (sa, sb) = (va.strides_for(dims)?, vb.strides_for(dims)?);
    let (da, db) = (va.data::<T>()?, vb.data::<T>()?);
    let offs = [va.offset(), vb.offset()];
    let fill = |out: &mut [MaybeUninit<T>]| {
        walk(out, dims, [&sa, &sb], offs, |o, _, [ia, ib], st| {
            wide! {
                let n = o.len();
                match st {
                    [1, 1] => {
                        let it = o.iter_mut().zip(&da[ia..ia + n]).zip(&db[ib..ib + n]);
                        for ((o, &x), &y) in it {
                            o.write(T::put(f(x.get(), y.get())));
                        }
                    }
                    [1, 0] => {
                        let y = db[ib].get();
                        for (o, &x) in o.iter_mut().zip(&da[ia..ia + n]) {
                            o.write(T::put(f(x.get(), y)));
                        }
                    }
                    [0, 1] => {
                        let x = da[ia].get();
                        for (o, &y) in o.iter_mut().zip(&db[ib..ib + n]) {
                            o.write(T::put(f(x, y.get())));
                        }
                    }
                    [ja, jb] => {
                        for (k, o) in o.iter_mut().enumerate() {
                            o.write(T::put(f(da[ia + k * ja].get(), db[ib + k * jb].get())));
                        }
                    }
                }
            }
        })
    };
    // SAFETY: `walk` visits every output element once.
    let out = unsafe { fresh(numel(dims), fill) };
    from_vec(out, dims)
}

/// `f(a, b, c)` elementwise with all three read (broadcast, any layout) as `dims`.
pub(super) fn map3<F: Fn(f32, f32, f32) -> f32 + Sync>(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    dims: &[usize],
    f: F,
) -> Result<Tensor> {
    let (va, vb, vc) = (View::new(a)?, View::new(b)?, View::new(c)?);
    let (sa, sb, sc) = (va.strides_for(dims)?, vb.strides_for(dims)?, vc.strides_for(dims)?);
    let (da, db, dc) = (va.data::<f32>()?, vb.data::<f32>()?, vc.data::<f32>()?);
    let offs = [va.offset(), vb.offset(), vc.offset()];
    let fill = |out: &mut [MaybeUninit<f32>]| {
        walk(out, dims, [&sa, &sb, &sc], offs, |o, _, [ia, ib, ic], st| {
            wide! {
                let n = o.len();
                if st == [1, 1, 1] {
                    let it = o.iter_mut().zip(&da[ia..ia + n]).zip(&db[ib..ib + n]);
                    for (((o, &x), &y), &z) in it.zip(&dc[ic..ic + n]) {
                        o.write(f(x, y, z));
                    }
                } else {
                    let [ja, jb, jc] = st;
                    for (k, o) in o.iter_mut().enumerate() {
                        o.write(f(da[ia + k * ja], db[ib + k * jb], dc[ic + k * jc]));
                    }
                }
            }
        })
    };
    // SAFETY: `walk` visits every output element once.
    let out = unsafe { fresh(numel(dims), fill) };
    from_vec(out, dims)
}
