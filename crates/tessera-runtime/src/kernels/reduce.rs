//! Reductions over any set of dims (f64 accumulation), their backward, and softmax over the
//! last dim.
//!
//! A reduction is planned once: size-1 dims dropped, adjacent dims of the same kind (kept or
//! reduced) merged, the innermost group either reduced (row sums: each output folds
//! contiguous runs) or kept (column sums such as a bias gradient: each reduced index adds a
//! contiguous row into a row of accumulators). Work is split across threads either over the
//! outputs or, when there are few outputs (a global norm, a bias gradient), over the reduced
//! index space with per-part partial accumulators merged in a fixed order — so results are
//! deterministic and depend only on the shape.

use super::elementwise::{
    exp_f32, expect_f32, max_f32, numel, sum_by, sum_by2, unsupported, walk, View, CHUNK,
};
use super::inplace::Elem;
use super::simd::wide;
use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::Tensor;
use half::bf16;
use rayon::prelude::*;
use tessera_ir::{ReduceOp, TensorMeta};

/// Kept and reduced dims of a contiguous input, collapsed.
struct Plan {
    /// Length of the innermost group (stride 1).
    inner: usize,
    inner_reduced: bool,
    /// Kept groups other than the innermost: (size, stride).
    kept: Vec<(usize, usize)>,
    /// Reduced groups other than the innermost: (size, stride).
    red: Vec<(usize, usize)>,
    /// Elements folded into each output.
    count: usize,
}

impl Plan {
    fn new(xd: &[usize], dims: &[usize]) -> Plan {
        let mut groups: Vec<(usize, usize, bool)> = Vec::new();
        let mut stride = numel(xd);
        for (i, &d) in xd.iter().enumerate() {
            stride /= d.max(1);
            if d == 1 {
                continue;
            }
            let r = dims.contains(&i);
            match groups.last_mut() {
                Some(g) if g.2 == r => {
                    g.0 *= d;
                    g.1 = stride;
                }
                _ => groups.push((d, stride, r)),
            }
        }
        let count = dims.iter().map(|&d| xd[d]).product();
        let (inner, inner_reduced) = match groups.pop() {
            Some((n, _, r)) => (n, r),
            None => (1, false),
        };
        let kept = groups.iter().filter(|g| !g.2).map(|g| (g.0, g.1)).collect();
        let red = groups.iter().filter(|g| g.2).map(|g| (g.0, g.1)).collect();
        Plan { inner, inner_reduced, kept, red, count }
    }

    /// Outputs per kept row.
    fn width(&self) -> usize {
        if self.inner_reduced {
            1
        } else {
            self.inner
        }
    }

    fn n_out(&self) -> usize {
        self.kept.iter().map(|g| g.0).product::<usize>() * self.width()
    }

    /// Size of the flat reduced index space walked per output.
    fn r_flat(&self) -> usize {
        let outer: usize = self.red.iter().map(|g| g.0).product();
        if self.inner_reduced {
            outer * self.inner
        } else {
            outer
        }
    }
}

/// Element offsets of a row-major walk over (size, stride) dims, advanced one step at a time.
struct Odometer<'a> {
    dims: &'a [(usize, usize)],
    idx: Vec<usize>,
    off: usize,
}

impl<'a> Odometer<'a> {
    fn new(dims: &'a [(usize, usize)], mut flat: usize) -> Odometer<'a> {
        let mut idx = vec![0; dims.len()];
        let mut off = 0;
        for (k, &(n, s)) in dims.iter().enumerate().rev() {
            idx[k] = flat % n;
            off += idx[k] * s;
            flat /= n;
        }
        Odometer { dims, idx, off }
    }

    fn step(&mut self) {
        for (k, &(n, s)) in self.dims.iter().enumerate().rev() {
            self.idx[k] += 1;
            self.off += s;
            if self.idx[k] < n {
                return;
            }
            self.off -= n * s;
            self.idx[k] = 0;
        }
    }
}

/// A reduction accumulator. `push_*` see elements in row-major order of the input; `merge`
/// folds in the accumulator of a *later* part of the reduced index space.
trait Acc: Copy + Send + Sync {
    const INIT: Self;
    /// Folds a contiguous run whose first element has flat index `base`.
    fn push_run<E: Elem>(&mut self, run: &[E], base: usize);
    /// Element `j` of `row` (flat index `base + j`) into `accs[j]`.
    fn push_col<E: Elem>(accs: &mut [Self], row: &[E], base: usize);
    fn merge(&mut self, later: &Self);
}

#[derive(Clone, Copy)]
struct SumAcc(f64);

impl Acc for SumAcc {
    const INIT: Self = SumAcc(0.0);
    fn push_run<E: Elem>(&mut self, run: &[E], _: usize) {
        self.0 += wide! { sum_by(run, |v| v.get() as f64) };
    }
    fn push_col<E: Elem>(accs: &mut [Self], row: &[E], _: usize) {
        wide! {
            for (a, &v) in accs.iter_mut().zip(row) {
                a.0 += v.get() as f64;
            }
        }
    }
    fn merge(&mut self, later: &Self) {
        self.0 += later.0;
    }
}

#[derive(Clone, Copy)]
struct SqAcc(f64);

impl Acc for SqAcc {
    const INIT: Self = SqAcc(0.0);
    fn push_run<E: Elem>(&mut self, run: &[E], _: usize) {
        self.0 += wide! { sum_by(run, |v| (v.get() as f64) * (v.get() as f64)) };
    }
    fn push_col<E: Elem>(accs: &mut [Self], row: &[E], _: usize) {
        wide! {
            for (a, &v) in accs.iter_mut().zip(row) {
                a.0 += (v.get() as f64) * (v.get() as f64);
            }
        }
    }
    fn merge(&mut self, later: &Self) {
        self.0 += later.0;
    }
}

/// The first maximal element (the first NaN wins, as in the reference interpreter).
#[derive(Clone, Copy)]
struct MaxAcc {
    v: f32,
    /// Flat index, `usize::MAX` while empty.
    i: usize,
}

impl MaxAcc {
    #[inline(always)]
    fn offer(&mut self, v: f32, i: usize) {
        if self.i == usize::MAX || (!self.v.is_nan() && (v > self.v || v.is_nan())) {
            self.v = v;
            self.i = i;
        }
    }
}

impl Acc for MaxAcc {
    const INIT: Self = MaxAcc { v: f32::NEG_INFINITY, i: usize::MAX };
    fn push_run<E: Elem>(&mut self, run: &[E], base: usize) {
        for (j, &v) in run.iter().enumerate() {
            self.offer(v.get(), base + j);
        }
    }
    fn push_col<E: Elem>(accs: &mut [Self], row: &[E], base: usize) {
        for (j, (a, &v)) in accs.iter_mut().zip(row).enumerate() {
            a.offer(v.get(), base + j);
        }
    }
    fn merge(&mut self, later: &Self) {
        if later.i != usize::MAX {
            self.offer(later.v, later.i);
        }
    }
}

/// Accumulates outputs `o_lo..o_lo + accs.len()` over the reduced flat range `r_lo..r_hi`.
fn run_block<A: Acc, E: Elem>(
    p: &Plan,
    data: &[E],
    o_lo: usize,
    r_lo: usize,
    r_hi: usize,
    accs: &mut [A],
) {
    let l = p.inner;
    if p.inner_reduced {
        let mut kept = Odometer::new(&p.kept, o_lo);
        for a in accs.iter_mut() {
            let mut red = Odometer::new(&p.red, r_lo / l);
            let (mut r, mut c) = (r_lo, r_lo % l);
            while r < r_hi {
                let n = (l - c).min(r_hi - r);
                let b = kept.off + red.off + c;
                a.push_run(&data[b..b + n], b);
                r += n;
                c = 0;
                red.step();
            }
            kept.step();
        }
    } else {
        let o_hi = o_lo + accs.len();
        let mut kept = Odometer::new(&p.kept, o_lo / l);
        let (mut o, mut col) = (o_lo, o_lo % l);
        while o < o_hi {
            let n = (l - col).min(o_hi - o);
            let seg = &mut accs[o - o_lo..o - o_lo + n];
            let mut red = Odometer::new(&p.red, r_lo);
            for _ in r_lo..r_hi {
                let b = kept.off + red.off + col;
                A::push_col(seg, &data[b..b + n], b);
                red.step();
            }
            o += n;
            col = 0;
            kept.step();
        }
    }
}

/// Runs the reduction planned by `p` over `data` (the contiguous input) and writes
/// `finish(acc)` for every output, in row-major order of the reduced shape.
fn reduce_into<A: Acc, E: Elem, T: Send>(
    p: &Plan,
    data: &[E],
    out: &mut [T],
    finish: impl Fn(&A) -> T + Sync,
) {
    let n_out = p.n_out();
    debug_assert_eq!(out.len(), n_out);
    if data.is_empty() {
        // Nothing to fold (a reduced dim of size 0): every output is the empty reduction.
        for o in out.iter_mut() {
            *o = finish(&A::INIT);
        }
        return;
    }
    let r_flat = p.r_flat();
    // Outputs per task when splitting the outputs (each task folds about CHUNK elements).
    let per = (CHUNK / p.count.max(1)).max(1);
    // Splitting the reduced index space instead (partial accumulators merged in order) pays
    // when splitting the outputs gives too few tasks (a global norm, a few long rows), and
    // for column reductions (a bias gradient), where it reads whole contiguous rows instead
    // of narrow strided columns. Partials are bounded to 2¹⁸ accumulators.
    let parts = (data.len() / CHUNK).min(64).min((1 << 18) / n_out).min(r_flat);
    let few_tasks = n_out.div_ceil(per) < 16;
    if parts >= 2 && (few_tasks || !p.inner_reduced) {
        let partials: Vec<Vec<A>> = (0..parts)
            .into_par_iter()
            .map(|k| {
                let mut accs = vec![A::INIT; n_out];
                run_block(p, data, 0, r_flat * k / parts, r_flat * (k + 1) / parts, &mut accs);
                accs
            })
            .collect();
        let mut it = partials.into_iter();
        let mut total = it.next().expect("parts >= 2");
        for part in it {
            for (a, b) in total.iter_mut().zip(&part) {
                a.merge(b);
            }
        }
        for (o, a) in out.iter_mut().zip(&total) {
            *o = finish(a);
        }
        return;
    }
    // Otherwise split the outputs.
    let task = |o_lo: usize, oc: &mut [T]| {
        let mut accs = vec![A::INIT; oc.len()];
        run_block(p, data, o_lo, 0, r_flat, &mut accs);
        for (o, a) in oc.iter_mut().zip(&accs) {
            *o = finish(a);
        }
    };
    if n_out <= per {
        task(0, out);
    } else {
        out.par_chunks_mut(per).enumerate().for_each(|(k, oc)| task(k * per, oc));
    }
}

fn check_dims(op: &str, rank: usize, dims: &[usize]) -> Result<()> {
    for (i, &d) in dims.iter().enumerate() {
        if d >= rank || dims[..i].contains(&d) {
            return Err(RuntimeError::Binding(format!(
                "{op}: reduce dims {dims:?} are not distinct dims of a rank-{rank} tensor"
            )));
        }
    }
    Ok(())
}

/// Sum, Mean, Max or Σx² over `dims` (empty `dims`: the identity), accumulated in f64; on f32,
/// or on bf16 read exactly as f32 with the f32 result rounded once (the upcast path's bits,
/// without its f32 copy of the input: a 39 M-element gradient's norm made one of 154 MB).
pub fn reduce(
    op: ReduceOp,
    dims: &[usize],
    _keepdim: bool,
    x: &Tensor,
    out: &TensorMeta,
) -> Result<Tensor> {
    if x.dtype() == candle_core::DType::BF16 {
        return reduce_as::<bf16>(op, dims, x, out);
    }
    expect_f32(x, "reduce", "x")?;
    reduce_as::<f32>(op, dims, x, out)
}

fn reduce_as<E: Elem>(
    op: ReduceOp,
    dims: &[usize],
    x: &Tensor,
    out: &TensorMeta,
) -> Result<Tensor> {
    check_dims("reduce", x.rank(), dims)?;
    let xc = contiguous(x)?;
    let data = read::<E>(&xc)?;
    let p = Plan::new(x.dims(), dims);
    let odims = out.shape.dims();
    let mut o = vec![E::put(0.0); numel(odims)];
    if o.len() != p.n_out() {
        return Err(RuntimeError::Binding(format!(
            "reduce: output {:?} does not match reducing {dims:?} of {:?}",
            odims,
            x.dims()
        )));
    }
    let count = p.count as f64;
    match op {
        ReduceOp::Sum => reduce_into(&p, &data, &mut o, |a: &SumAcc| E::put(a.0 as f32)),
        ReduceOp::Mean => reduce_into(&p, &data, &mut o, |a: &SumAcc| E::put((a.0 / count) as f32)),
        ReduceOp::SumSquares => reduce_into(&p, &data, &mut o, |a: &SqAcc| E::put(a.0 as f32)),
        ReduceOp::Max => reduce_into(&p, &data, &mut o, |a: &MaxAcc| E::put(a.v)),
    }
    from_vec(o, odims)
}

/// dx for the matching [`reduce`]: Sum/Mean broadcast dy back (÷ count for Mean), Σx²
/// gives 2x·dy, Max sends each dy to the first maximal element.
pub fn reduce_backward(
    op: ReduceOp,
    dims: &[usize],
    keepdim: bool,
    x: &Tensor,
    dy: &Tensor,
    out: &TensorMeta,
) -> Result<Tensor> {
    expect_f32(x, "reduce_backward", "x")?;
    expect_f32(dy, "reduce_backward", "dy")?;
    let xd = x.dims();
    check_dims("reduce_backward", xd.len(), dims)?;
    let want: Vec<usize> = (0..xd.len())
        .filter(|i| keepdim || !dims.contains(i))
        .map(|i| if dims.contains(&i) { 1 } else { xd[i] })
        .collect();
    if dy.dims() != want || out.shape.dims() != xd {
        return Err(RuntimeError::Binding(format!(
            "reduce_backward: dy {:?} must be {want:?} and the output {:?} must be x's shape {xd:?}",
            dy.dims(),
            out.shape.dims()
        )));
    }
    let n = numel(xd);
    let mut o = vec![0f32; n];
    if op == ReduceOp::Max {
        let xc = contiguous(x)?;
        let data = read::<f32>(&xc)?;
        let p = Plan::new(xd, dims);
        let mut idx = vec![usize::MAX; p.n_out()];
        reduce_into(&p, &data, &mut idx, |a: &MaxAcc| a.i);
        let dyc = contiguous(dy)?;
        let g = read::<f32>(&dyc)?;
        for (&i, &g) in idx.iter().zip(g.iter()) {
            if i != usize::MAX {
                o[i] = g;
            }
        }
        return from_vec(o, xd);
    }
    // dy read in place as if broadcast to x's shape: stride 0 along the reduced dims.
    let vdy = View::new(dy)?;
    let dys = dy.stride();
    let mut sdy = vec![0; xd.len()];
    let mut j = 0;
    for (i, s) in sdy.iter_mut().enumerate() {
        if dims.contains(&i) {
            j += usize::from(keepdim);
        } else {
            *s = dys[j];
            j += 1;
        }
    }
    let g = vdy.data::<f32>()?;
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            let count = dims.iter().map(|&d| xd[d]).product::<usize>() as f32;
            let mean = op == ReduceOp::Mean;
            walk(&mut o, xd, [&sdy], [vdy.offset()], |o, _, [i], [s]| {
                for (k, o) in o.iter_mut().enumerate() {
                    let v = g[i + k * s];
                    *o = if mean { v / count } else { v };
                }
            });
        }
        ReduceOp::SumSquares => {
            let vx = View::new(x)?;
            let sx = vx.strides_for(xd)?;
            let xs = vx.data::<f32>()?;
            walk(&mut o, xd, [&sx, &sdy], [vx.offset(), vdy.offset()], |o, _, [ix, ig], st| {
                let n = o.len();
                if st == [1, 0] {
                    let gv = g[ig];
                    for (o, &v) in o.iter_mut().zip(&xs[ix..ix + n]) {
                        *o = 2.0 * v * gv;
                    }
                } else {
                    let [jx, jg] = st;
                    for (k, o) in o.iter_mut().enumerate() {
                        *o = 2.0 * xs[ix + k * jx] * g[ig + k * jg];
                    }
                }
            });
        }
        ReduceOp::Max => unreachable!("handled above"),
    }
    from_vec(o, xd)
}

/// Calls `f(row, out_row)` for every row of width `d` of `out`, rows in parallel groups of
/// about [`CHUNK`] elements. `d` must be non-zero.
pub(super) fn par_rows<T: Send>(out: &mut [T], d: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let per = (CHUNK / d).max(1);
    let task = |r0: usize, chunk: &mut [T]| {
        for (k, row) in chunk.chunks_mut(d).enumerate() {
            f(r0 + k, row);
        }
    };
    if out.len() <= per * d {
        task(0, out);
    } else {
        out.par_chunks_mut(per * d).enumerate().for_each(|(k, c)| task(k * per, c));
    }
}

fn last_dim(x: &Tensor, op: &str) -> Result<usize> {
    x.dims().last().copied().ok_or_else(|| unsupported(op, "needs at least one dim, got a scalar"))
}

/// Softmax over the last dim: max-shifted, exponentials summed in f64.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    expect_f32(x, "softmax", "x")?;
    let d = last_dim(x, "softmax")?;
    let xc = contiguous(x)?;
    let xs = read::<f32>(&xc)?;
    let mut out = vec![0f32; xs.len()];
    if d > 0 {
        par_rows(&mut out, d, |r, orow| {
            wide! {
                let xr = &xs[r * d..(r + 1) * d];
                let m = max_f32(xr);
                for (o, &v) in orow.iter_mut().zip(xr) {
                    *o = exp_f32(v - m);
                }
                let inv = (1.0 / sum_by(orow, |v| v as f64)) as f32;
                for o in orow.iter_mut() {
                    *o *= inv;
                }
            }
        });
    }
    from_vec(out, x.dims())
}

/// dx = y·(dy − Σ y·dy) over the last dim (the row term in f64).
pub fn softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    expect_f32(y, "softmax_backward", "y")?;
    expect_f32(dy, "softmax_backward", "dy")?;
    if y.dims() != dy.dims() {
        return Err(RuntimeError::Binding(format!(
            "softmax_backward: y {:?} and dy {:?} must have one shape",
            y.dims(),
            dy.dims()
        )));
    }
    let d = last_dim(y, "softmax_backward")?;
    let (yc, gc) = (contiguous(y)?, contiguous(dy)?);
    let (ys, gs) = (read::<f32>(&yc)?, read::<f32>(&gc)?);
    let mut out = vec![0f32; ys.len()];
    if d > 0 {
        par_rows(&mut out, d, |r, orow| {
            wide! {
                let (yr, gr) = (&ys[r * d..(r + 1) * d], &gs[r * d..(r + 1) * d]);
                let s = sum_by2(yr, gr, |y, g| y as f64 * g as f64);
                for ((o, &y), &g) in orow.iter_mut().zip(yr).zip(gr) {
                    *o = (y as f64 * (g as f64 - s)) as f32;
                }
            }
        });
    }
    from_vec(out, y.dims())
}
