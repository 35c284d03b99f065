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

use crate::{Result, RuntimeError};
use candle_core::{DType, Layout, Storage, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;
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
    let Storage::Cpu(c) = s else {
        return Err(RuntimeError::Binding("the CPU backend got a tensor on another device".into()));
    };
    let data = c.as_slice::<f32>()?;
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
    if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
        return Err(unsupported(format!(
            "only f32 operands are supported on the CPU, got {:?} x {:?} (cast to f32 first)",
            a.dtype(),
            b.dtype()
        )));
    }
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
    let nbatch: usize = batch.iter().product();
    let mut y = vec![0f32; nbatch * m * n];
    if y.is_empty() || k == 0 {
        return crate::tensor::from_vec(y, od);
    }

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
            // SAFETY: every addressed element lies inside the checked layouts; y is fresh.
            unsafe { gemm_f32(nbatch * m, n, k, dst, false, lhs, rhs, 1.0, all_threads()) };
            drop((ga, gb));
            return crate::tensor::from_vec(y, od);
        }
    }

    // One gemm per output batch element.
    let index = |mut flat: usize| {
        let mut idx = vec![0; batch.len()];
        for (i, &d) in batch.iter().enumerate().rev() {
            idx[i] = flat % d;
            flat /= d;
        }
        idx
    };
    let (pa, pb) = (SendConstPtr(pa), SendConstPtr(pb));
    let run = |bi: usize, c: &mut [f32], par: Parallelism| {
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
        let dst = MatMut { ptr: c.as_mut_ptr(), rs: n_i, cs: 1 };
        // SAFETY: in bounds of the checked layouts; `c` is this batch element's own block.
        unsafe { gemm_f32(m, n, k, dst, false, lhs, rhs, 1.0, par) };
    };
    if m * n * k < SMALL_PRODUCT && nbatch > 1 {
        y.par_chunks_mut(m * n).enumerate().for_each(|(bi, c)| run(bi, c, Parallelism::None));
    } else {
        let par = all_threads();
        y.chunks_mut(m * n).enumerate().for_each(|(bi, c)| run(bi, c, par));
    }
    drop((ga, gb));
    crate::tensor::from_vec(y, od)
}
