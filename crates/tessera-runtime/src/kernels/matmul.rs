//! Batched matmul on the `gemm` crate, reading both operands in place through their strides.
//!
//! Every operand is described by its layout (start offset, strides), so transposed reads
//! (`trans_*`), `.t()` / `narrow` views and broadcast (`Expand`, stride 0) batch dims cost no
//! copy. When the right operand is the same matrix for every batch element (a 2-D weight, or a
//! broadcast one) and the left operand's batch and row dims fold into one strided dim, the
//! whole product is a single `[batch·m, k] x [k, n]` gemm (`[B,S,D]x[D,N]`, `[B,S,D]x[N,D]ᵀ`);
//! otherwise it loops over the output batch — in parallel over batch elements when each
//! product is small, one multithreaded gemm after another when they are large.
//!
//! The helpers [`gemm_f32`], [`MatRef`] and [`MatMut`] are shared with the attention kernels.

use super::gemm_bf16::{gemm_bf16, Bf16Dst, Bf16Kernel, Bf16Ref};
use crate::{Result, RuntimeError};
use candle_core::{DType, Layout, Storage, Tensor};
use gemm::Parallelism;
use half::bf16;
use rayon::prelude::*;
use std::mem::MaybeUninit;
use tessera_ir::TensorMeta;

/// Below this many multiply-adds per product, batches run in parallel with one thread each.
const SMALL_PRODUCT: usize = 1 << 21;

/// A read-only strided matrix: element (i, j) at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy)]
pub(super) struct MatRef {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}

/// A writable strided matrix: element (i, j) at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy)]
pub(super) struct MatMut {
    pub ptr: *mut f32,
    pub rs: isize,
    pub cs: isize,
}

impl MatRef {
    /// The same matrix read transposed (no data moves).
    pub fn t(self) -> MatRef {
        MatRef { ptr: self.ptr, rs: self.cs, cs: self.rs }
    }
}

/// The gemm parallelism for a call that may use every rayon thread.
pub(super) fn all_threads() -> Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// `dst[m×n] = (dst if accumulate) + scale · lhs[m×k] · rhs[k×n]`.
///
/// # Safety
/// Every element the strides address (m×k of `lhs`, k×n of `rhs`, m×n of `dst`) must be
/// in bounds of a live allocation, `dst` must not overlap `lhs` or `rhs`, and no other thread
/// may access `dst`'s elements during the call.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_f32(
    m: usize,
    n: usize,
    k: usize,
    dst: MatMut,
    accumulate: bool,
    lhs: MatRef,
    rhs: MatRef,
    scale: f32,
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m as isize {
                for j in 0..n as isize {
                    // SAFETY: in bounds by the caller's contract.
                    unsafe { *dst.ptr.offset(i * dst.rs + j * dst.cs) = 0.0 };
                }
            }
        }
        return;
    }
    let threads = match par {
        Parallelism::Rayon(t) if m * n * k >= SPLIT_PRODUCT => t.min(m.max(n) / SPLIT_ALIGN),
        _ => 1,
    };
    if threads < 2 {
        // SAFETY: forwarded from the caller.
        return unsafe { gemm_f32_serial(m, n, k, dst, accumulate, lhs, rhs, scale, par) };
    }
    // One serial gemm per thread over its own band of output rows (or columns, when there are
    // more columns): the gemm crate's own threading splits the output into blocks far more
    // finely, and on a weight gradient (m, n small, k the tokens) its threads spent a quarter
    // of the product waiting on one another (`BENCHMARKS.md`). Every output element is still one
    // gemm's sum over the whole k, in the same order.
    let by_rows = m >= n;
    let len = if by_rows { m } else { n };
    let band = len.div_ceil(threads).next_multiple_of(SPLIT_ALIGN);
    let (dp, lp, rp) = (SendPtr(dst.ptr), SendConstPtr(lhs.ptr), SendConstPtr(rhs.ptr));
    let ([drs, dcs], [lrs, lcs], [rrs, rcs]) =
        ([dst.rs, dst.cs], [lhs.rs, lhs.cs], [rhs.rs, rhs.cs]);
    (0..len.div_ceil(band)).into_par_iter().for_each(|b| {
        let (start, width) = (b * band, band.min(len - b * band));
        let off = start as isize;
        let mut d = MatMut { ptr: dp.get(), rs: drs, cs: dcs };
        let mut l = MatRef { ptr: lp.get(), rs: lrs, cs: lcs };
        let mut r = MatRef { ptr: rp.get(), rs: rrs, cs: rcs };
        let (bm, bn) = if by_rows {
            d.ptr = d.ptr.wrapping_offset(off * drs);
            l.ptr = l.ptr.wrapping_offset(off * lrs);
            (width, n)
        } else {
            d.ptr = d.ptr.wrapping_offset(off * dcs);
            r.ptr = r.ptr.wrapping_offset(off * rcs);
            (m, width)
        };
        // SAFETY: the band's rows (columns) of `dst` and `lhs` (`rhs`) lie inside the caller's
        // m×k, k×n and m×n elements; the bands of `dst` are disjoint, so no two threads write
        // one element.
        unsafe { gemm_f32_serial(bm, bn, k, d, accumulate, l, r, scale, Parallelism::None) };
    });
}

/// At or above this many multiply-adds, [`gemm_f32`] splits the output between threads itself.
const SPLIT_PRODUCT: usize = 1 << 22;
/// A thread's band of output rows or columns is a multiple of this (the f32 kernels' widths).
const SPLIT_ALIGN: usize = 16;

/// `gemm_f32` on the gemm crate, with its own threading (`par`).
///
/// # Safety
/// As [`gemm_f32`].
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_f32_serial(
    m: usize,
    n: usize,
    k: usize,
    dst: MatMut,
    accumulate: bool,
    lhs: MatRef,
    rhs: MatRef,
    scale: f32,
    par: Parallelism,
) {
    // SAFETY: forwarded from the caller; gemm reads/writes exactly the addressed elements.
    unsafe {
        gemm::gemm(
            m, n, k, dst.ptr, dst.cs, dst.rs, accumulate, lhs.ptr, lhs.cs, lhs.rs, rhs.ptr, rhs.cs,
            rhs.rs, 1.0, scale, false, false, false, par,
        )
    }
}

fn unsupported(reason: String) -> RuntimeError {
    RuntimeError::Unsupported { backend: "cpu".into(), op: "matmul".into(), reason }
}

/// An operand as the matmul reads it: batch dims and strides (aligned to the output batch,
/// 0 where broadcast), then the logical (rows, cols) matrix with its strides.
struct Operand {
    batch_strides: Vec<usize>,
    rs: usize,
    cs: usize,
    offset: usize,
}

impl Operand {
    /// `layout` read as `[.., r, c]` (or its last two dims swapped when `trans`), with batch
    /// dims broadcast to `batch`.
    fn new(layout: &Layout, trans: bool, batch: &[usize], what: &str) -> Result<Operand> {
        let dims = layout.dims();
        let st = layout.stride();
        let r = dims.len();
        let (rs, cs) = (st[r - 2], st[r - 1]);
        let (rs, cs) = if trans { (cs, rs) } else { (rs, cs) };
        let own = &dims[..r - 2];
        if own.len() > batch.len() {
            return Err(RuntimeError::Binding(format!(
                "matmul: {what} has more batch dims than the output"
            )));
        }
        let lead = batch.len() - own.len();
        let mut batch_strides = vec![0; batch.len()];
        for (i, &d) in own.iter().enumerate() {
            if d == batch[lead + i] {
                batch_strides[lead + i] = if d == 1 { 0 } else { st[i] };
            } else if d != 1 {
                return Err(RuntimeError::Binding(format!(
                    "matmul: {what} batch dims {own:?} do not broadcast to {batch:?}"
                )));
            }
        }
        Ok(Operand { batch_strides, rs, cs, offset: layout.start_offset() })
    }

    /// Offset of batch element `idx` (a multi-index of the output batch).
    fn at(&self, idx: &[usize]) -> usize {
        self.offset + idx.iter().zip(&self.batch_strides).map(|(i, s)| i * s).sum::<usize>()
    }

    fn batch_invariant(&self) -> bool {
        self.batch_strides.iter().all(|&s| s == 0)
    }

    /// The single row stride under which `batch` × `m` rows fold into one dim, if any.
    fn folded_row_stride(&self, batch: &[usize], m: usize) -> Option<usize> {
        let mut stride = self.rs;
        let mut extent = m;
        for (&d, &s) in batch.iter().zip(&self.batch_strides).rev() {
            if d == 1 {
                continue;
            }
            if extent == 1 {
                stride = s;
            } else if s != stride * extent {
                return None;
            }
            extent *= d;
        }
        Some(stride)
    }
}

/// Highest element index a layout addresses (None when it addresses nothing).
fn max_index(layout: &Layout) -> Option<usize> {
    let dims = layout.dims();
    if dims.contains(&0) {
        return None;
    }
    Some(
        layout.start_offset()
            + dims.iter().zip(layout.stride()).map(|(d, s)| (d - 1) * s).sum::<usize>(),
    )
}

fn f32_slice<'a>(s: &'a Storage, layout: &Layout, what: &str) -> Result<&'a [f32]> {
    host_slice::<f32>(s, layout, what)
}

/// The elements of a CPU storage as `T`, checked to hold everything `layout` addresses.
fn host_slice<'a, T: candle_core::WithDType>(
    s: &'a Storage,
    layout: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    let Storage::Cpu(c) = s else {
        return Err(RuntimeError::Binding("the CPU backend got a tensor on another device".into()));
    };
    let data = c.as_slice::<T>()?;
    if let Some(hi) = max_index(layout) {
        if hi >= data.len() {
            return Err(RuntimeError::Binding(format!(
                "{what}: layout addresses past its storage"
            )));
        }
    }
    Ok(data)
}

/// A raw pointer that may cross threads (each thread touches disjoint elements).
#[derive(Clone, Copy)]
pub(super) struct SendPtr<T>(pub *mut T);
// SAFETY: only used to hand disjoint regions of one buffer to rayon workers.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    pub fn get(self) -> *mut T {
        self.0
    }
}

/// A read-only raw pointer that may cross threads.
#[derive(Clone, Copy)]
pub(super) struct SendConstPtr<T>(pub *const T);
// SAFETY: the pointee is only read while its storage guard is held by the spawning thread.
unsafe impl<T> Send for SendConstPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendConstPtr<T> {}

impl<T> SendConstPtr<T> {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    pub fn get(self) -> *const T {
        self.0
    }
}

/// `op(a) · op(b)` with broadcast batch dims; `out` is the IR's output meta.
pub fn matmul(
    a: &Tensor,
    b: &Tensor,
    trans_a: bool,
    trans_b: bool,
    out: &TensorMeta,
) -> Result<Tensor> {
    let bf16_kernel =
        match (a.dtype(), b.dtype()) {
            (DType::F32, DType::F32) => None,
            (DType::BF16, DType::BF16) => match Bf16Kernel::native() {
                Some(kernel) => Some(kernel),
                None => return Err(unsupported(
                    "bf16 operands need AMX-BF16 or AVX512_BF16 on the CPU (the backend upcasts them to f32 \
                     elsewhere)"
                        .into(),
                )),
            },
            (da, db) => {
                return Err(unsupported(format!(
                    "only f32 (and bf16 with AMX-BF16 or AVX512_BF16) operands are supported on the CPU, got \
                 {da:?} x {db:?} (cast to f32 first)"
                )))
            }
        };
    let (ad, bd) = (a.dims(), b.dims());
    if ad.len() < 2 || bd.len() < 2 {
        return Err(RuntimeError::Binding(format!("matmul operands {ad:?} x {bd:?} need 2 dims")));
    }
    let od = out.shape.dims();
    if od.len() < 2 {
        return Err(RuntimeError::Binding(format!("matmul output {out} needs 2 dims")));
    }
    let (ar, ac) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (br, bc) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    let (m, k) = if trans_a { (ac, ar) } else { (ar, ac) };
    let (k2, n) = if trans_b { (bc, br) } else { (br, bc) };
    let batch = &od[..od.len() - 2];
    if k != k2 || od[od.len() - 2] != m || od[od.len() - 1] != n {
        return Err(RuntimeError::Binding(format!(
            "matmul {ad:?}{} x {bd:?}{} does not give {out}",
            if trans_a { "ᵀ" } else { "" },
            if trans_b { "ᵀ" } else { "" }
        )));
    }
    if let Some(kernel) = bf16_kernel {
        return matmul_bf16(a, b, trans_a, trans_b, out, [m, n, k], kernel);
    }
    let nbatch: usize = batch.iter().product();
    let len = nbatch * m * n;
    if len == 0 || k == 0 {
        // Nothing, or an empty sum: zeros.
        return crate::tensor::from_vec(vec![0f32; len], od);
    }
    // Uninitialised: gemm overwrites every element without reading it (`accumulate` off).
    let mut y: Vec<f32> = Vec::with_capacity(len);

    let (ga, la) = a.storage_and_layout();
    let (gb, lb) = b.storage_and_layout();
    let opa = Operand::new(la, trans_a, batch, "a")?;
    let opb = Operand::new(lb, trans_b, batch, "b")?;
    let pa = f32_slice(&ga, la, "a")?.as_ptr();
    let pb = f32_slice(&gb, lb, "b")?.as_ptr();
    let n_i = n as isize;

    // One big gemm: B is the same matrix for every batch element and A's rows fold.
    if opb.batch_invariant() {
        if let Some(rs) = opa.folded_row_stride(batch, m) {
            let lhs =
                MatRef { ptr: pa.wrapping_add(opa.offset), rs: rs as isize, cs: opa.cs as isize };
            let rhs = MatRef {
                ptr: pb.wrapping_add(opb.offset),
                rs: opb.rs as isize,
                cs: opb.cs as isize,
            };
            let dst = MatMut { ptr: y.as_mut_ptr(), rs: n_i, cs: 1 };
            // SAFETY: every addressed element lies inside the checked layouts; y has room
            // for all `len`, which gemm writes (k > 0, not accumulating).
            unsafe {
                gemm_f32(nbatch * m, n, k, dst, false, lhs, rhs, 1.0, all_threads());
                y.set_len(len);
            }
            drop((ga, gb));
            return crate::tensor::from_vec(y, od);
        }
    }

    // One gemm per output batch element.
    let index = |flat: usize| batch_index(batch, flat);
    let (pa, pb) = (SendConstPtr(pa), SendConstPtr(pb));
    let run = |bi: usize, c: &mut [MaybeUninit<f32>], par: Parallelism| {
        let idx = index(bi);
        let lhs = MatRef {
            ptr: pa.get().wrapping_add(opa.at(&idx)),
            rs: opa.rs as isize,
            cs: opa.cs as isize,
        };
        let rhs = MatRef {
            ptr: pb.get().wrapping_add(opb.at(&idx)),
            rs: opb.rs as isize,
            cs: opb.cs as isize,
        };
        let dst = MatMut { ptr: c.as_mut_ptr().cast(), rs: n_i, cs: 1 };
        // SAFETY: in bounds of the checked layouts; `c` is this batch element's own block,
        // which gemm writes whole (k > 0, not accumulating).
        unsafe { gemm_f32(m, n, k, dst, false, lhs, rhs, 1.0, par) };
    };
    let blocks = &mut y.spare_capacity_mut()[..len];
    if m * n * k < SMALL_PRODUCT && nbatch > 1 {
        blocks.par_chunks_mut(m * n).enumerate().for_each(|(bi, c)| run(bi, c, Parallelism::None));
    } else {
        let par = all_threads();
        blocks.chunks_mut(m * n).enumerate().for_each(|(bi, c)| run(bi, c, par));
    }
    // SAFETY: every batch element's block was written above.
    unsafe { y.set_len(len) };
    drop((ga, gb));
    crate::tensor::from_vec(y, od)
}

/// The multi-index of flat output batch element `flat`.
fn batch_index(batch: &[usize], mut flat: usize) -> Vec<usize> {
    let mut idx = vec![0; batch.len()];
    for (i, &d) in batch.iter().enumerate().rev() {
        idx[i] = flat % d;
        flat /= d;
    }
    idx
}

/// [`matmul`] on bf16 operands with f32 accumulation ([`gemm_bf16`]): the result is written
/// in the IR's output dtype (bf16, rounded once, or f32) and nothing else is allocated beyond
/// the kernel's bounded packing panels. The same folding and batch split as the f32 path.
fn matmul_bf16(
    a: &Tensor,
    b: &Tensor,
    trans_a: bool,
    trans_b: bool,
    out: &TensorMeta,
    [m, n, k]: [usize; 3],
    kernel: Bf16Kernel,
) -> Result<Tensor> {
    let od = out.shape.dims();
    let batch = &od[..od.len() - 2];
    let nbatch: usize = batch.iter().product();
    let len = nbatch * m * n;
    // Uninitialised: the kernel writes every element when k > 0 (zeroing first was a memset
    // per product); an empty sum fills zeros below.
    let f32_out = match out.dtype {
        tessera_ir::DType::F32 => true,
        tessera_ir::DType::BF16 => false,
        other => {
            return Err(unsupported(format!("bf16 operands give bf16 or f32, not {other}")));
        }
    };
    let (mut y32, mut y16): (Vec<f32>, Vec<bf16>) = if f32_out {
        (Vec::with_capacity(len), Vec::new())
    } else {
        (Vec::new(), Vec::with_capacity(len))
    };
    // SAFETY (of every call): `written` only once the kernel wrote all `len` elements.
    let finish = |mut y32: Vec<f32>, mut y16: Vec<bf16>, written: bool| {
        if f32_out {
            if written {
                unsafe { y32.set_len(len) };
            } else {
                y32.resize(len, 0.0);
            }
            crate::tensor::from_vec(y32, od)
        } else {
            if written {
                unsafe { y16.set_len(len) };
            } else {
                y16.resize(len, bf16::ZERO);
            }
            crate::tensor::from_vec(y16, od)
        }
    };
    if len == 0 || k == 0 {
        // Nothing, or an empty sum: zeros.
        return finish(y32, y16, false);
    }
    // The output's base pointer as a `Bf16Dst` of row stride n (offset per product below).
    let base = if f32_out {
        Bf16Dst::F32 { ptr: y32.as_mut_ptr(), rs: n as isize, cs: 1 }
    } else {
        Bf16Dst::Bf16 { ptr: y16.as_mut_ptr().cast(), rs: n as isize, cs: 1 }
    };
    let offset = |d: Bf16Dst, by: usize| match d {
        Bf16Dst::F32 { ptr, rs, cs } => Bf16Dst::F32 { ptr: ptr.wrapping_add(by), rs, cs },
        Bf16Dst::Bf16 { ptr, rs, cs } => Bf16Dst::Bf16 { ptr: ptr.wrapping_add(by), rs, cs },
    };

    let (ga, la) = a.storage_and_layout();
    let (gb, lb) = b.storage_and_layout();
    let opa = Operand::new(la, trans_a, batch, "a")?;
    let opb = Operand::new(lb, trans_b, batch, "b")?;
    let pa = SendConstPtr(host_slice::<bf16>(&ga, la, "a")?.as_ptr().cast::<u16>());
    let pb = SendConstPtr(host_slice::<bf16>(&gb, lb, "b")?.as_ptr().cast::<u16>());
    let rhs_at = |off: usize| Bf16Ref {
        ptr: pb.get().wrapping_add(off),
        rs: opb.rs as isize,
        cs: opb.cs as isize,
    };

    // One big gemm: B is the same matrix for every batch element and A's rows fold.
    if opb.batch_invariant() {
        if let Some(rs) = opa.folded_row_stride(batch, m) {
            let lhs = Bf16Ref {
                ptr: pa.get().wrapping_add(opa.offset),
                rs: rs as isize,
                cs: opa.cs as isize,
            };
            // SAFETY: every addressed element lies inside the checked layouts; y is fresh;
            // the kernel is native to this CPU.
            unsafe {
                gemm_bf16(nbatch * m, n, k, base, lhs, rhs_at(opb.offset), 1.0, kernel, true)
            };
            drop((ga, gb));
            return finish(y32, y16, true);
        }
    }

    // One gemm per output batch element, in parallel over small ones.
    let run = |bi: usize, parallel: bool| {
        let idx = batch_index(batch, bi);
        let lhs = Bf16Ref {
            ptr: pa.get().wrapping_add(opa.at(&idx)),
            rs: opa.rs as isize,
            cs: opa.cs as isize,
        };
        // SAFETY: in bounds of the checked layouts; the m×n block at bi·m·n is this batch
        // element's own; the kernel is native to this CPU.
        unsafe {
            gemm_bf16(
                m,
                n,
                k,
                offset(base, bi * m * n),
                lhs,
                rhs_at(opb.at(&idx)),
                1.0,
                kernel,
                parallel,
            )
        };
    };
    if m * n * k < SMALL_PRODUCT && nbatch > 1 {
        (0..nbatch).into_par_iter().for_each(|bi| run(bi, false));
    } else {
        (0..nbatch).for_each(|bi| run(bi, true));
    }
    drop((ga, gb));
    finish(y32, y16, true)
}
