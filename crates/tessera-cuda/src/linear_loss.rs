//! The chunked LM head and loss ([`tessera_ir::Op::LinearCrossEntropy`]) on the GPU, composed
//! chunk by chunk from the existing pieces: a cuBLAS f32 GEMM writes the chunk's logits into
//! one `[chunk, V]` buffer (the op's declared workspace, taken as Program memory so the
//! allocator's books stay the accountant's), the fused cross-entropy kernels of [`crate::loss`]
//! reduce it (forward) or turn it into its gradient (backward, into scratch), and two more
//! GEMMs give the chunk's `dx` rows and add its term to `dweight`. The operands arrive in f32
//! (the op is not one of the backend's native half-precision ops: the backend's autocast
//! upcasts them).
//!
//! Unverified on a GPU: written and compiled on a machine without one; the CPU kernel and the
//! f64 interpreter are what the tests check.

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::gemm::{gemm_f32, ColMat};
use crate::tensor::CudaTensor;
use tessera_ir::dist::MeshPos;
use tessera_ir::{BinaryOp, DType, Shape, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

const OP: &str = "linear_cross_entropy";

/// `(rows, D, V)` of hidden `[.., D]`, weight `[V, D]` and targets `[..]`, all dense.
fn dims(h: &CudaTensor, w: &CudaTensor, t: &CudaTensor) -> Result<(usize, usize, usize)> {
    let (hd, wd) = (h.dims(), w.dims());
    let d = hd.last().copied().unwrap_or(0);
    if h.dtype() != DType::F32 || w.dtype() != DType::F32 || t.dtype() != DType::I64 {
        return Err(RuntimeError::Binding(format!(
            "{OP}: hidden {}, weight {} and targets {} must be f32, f32 and i64 here",
            h.meta(),
            w.meta(),
            t.meta()
        )));
    }
    if hd.is_empty() || &hd[..hd.len() - 1] != t.dims() || wd.len() != 2 || wd[1] != d {
        return Err(RuntimeError::Binding(format!(
            "{OP}: hidden {hd:?}, weight {wd:?} and targets {:?} must be [.., D], [V, D] and [..]",
            t.dims()
        )));
    }
    Ok((t.numel(), d, wd[0]))
}

/// A row-major `[rows, cols]` matrix at `ptr` in cuBLAS's column-major terms (read as its
/// transpose), transposed again when `trans`.
fn mat(ptr: u64, cols: usize, trans: bool) -> ColMat {
    ColMat { ptr, ld: cols as i64, stride: 0, trans }
}

/// `logits[0..c, :] = h[r0..r0 + c, :] · wᵀ`.
fn chunk_logits(
    be: &CudaBackend,
    h: &CudaTensor,
    w: &CudaTensor,
    logits: &CudaTensor,
    (r0, c): (usize, usize),
    (d, v): (usize, usize),
) -> Result<()> {
    let rows = h.rows(r0, r0 + c)?;
    gemm_f32(
        be,
        (v, c, d),
        1.0,
        mat(w.ptr(), d, true),
        mat(rows.ptr(), d, false),
        0.0,
        mat(logits.ptr(), v, false),
        1,
    )
}

/// Inputs `hidden, weight, targets` → `[loss (the sum), logsumexp]`.
pub fn forward(
    be: &CudaBackend,
    x: &[&CudaTensor],
    chunk_rows: usize,
    ignore: Option<i64>,
    at: &MeshPos,
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let (h, w, t) = (be.dense_pub(x[0])?, be.dense_pub(x[1])?, be.dense_pub(x[2])?);
    let (n, d, v) = dims(&h, &w, &t)?;
    let (h, t) = (h.reshaped(&[n, d]), t.reshaped(&[n]));
    let lse = be.out_f32(&out[1], p)?;
    let loss = be.out_f32(&out[0], p)?;
    let scalar = TensorMeta::new(Shape::scalar(), DType::F32);
    let mut total = be.out_f32(&scalar, Purpose::Scratch)?;
    be.fill_pub(&total, 0.0)?;
    let chunk = chunk_rows.clamp(1, n.max(1));
    let logits = CudaTensor::empty(be.gpu(), &[chunk, v], DType::F32, Purpose::Program)?;
    let lse_rows = lse.reshaped(&[n]);
    let mut r0 = 0;
    while r0 < n && v > 0 {
        let c = chunk.min(n - r0);
        chunk_logits(be, &h, &w, &logits, (r0, c), (d, v))?;
        let metas = [scalar.clone(), TensorMeta::new(Shape::from(vec![c]), DType::F32)];
        let lc = logits.rows(0, c)?;
        let tc = t.rows(r0, r0 + c)?;
        let part = crate::loss::cross_entropy(
            be,
            &[&lc, &tc],
            ignore,
            true,
            None,
            at,
            &metas,
            Purpose::Scratch,
        )?;
        be.copy_rows(&part[1], &lse_rows.rows(r0, r0 + c)?)?;
        total = be.binary(BinaryOp::Add, &total, &part[0], &scalar, Purpose::Scratch)?;
        r0 += c;
    }
    be.copy_rows(&total, &loss)?;
    Ok(vec![loss, lse])
}

/// Inputs `hidden, weight, targets, logsumexp, dloss` → `[dx, dweight]`.
pub fn backward(
    be: &CudaBackend,
    x: &[&CudaTensor],
    chunk_rows: usize,
    ignore: Option<i64>,
    at: &MeshPos,
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let (h, w, t) = (be.dense_pub(x[0])?, be.dense_pub(x[1])?, be.dense_pub(x[2])?);
    let (lse, dloss) = (be.dense_pub(x[3])?, be.dense_pub(x[4])?);
    let (n, d, v) = dims(&h, &w, &t)?;
    let (h, t, lse) = (h.reshaped(&[n, d]), t.reshaped(&[n]), lse.reshaped(&[n]));
    let dx = be.out_f32(&out[0], p)?;
    let dw = be.out_f32(&out[1], p)?;
    be.fill_pub(&dw, 0.0)?;
    if v == 0 {
        be.fill_pub(&dx, 0.0)?;
    }
    let dx_rows = dx.reshaped(&[n, d]);
    let chunk = chunk_rows.clamp(1, n.max(1));
    let logits = CudaTensor::empty(be.gpu(), &[chunk, v], DType::F32, Purpose::Program)?;
    let mut r0 = 0;
    while r0 < n && v > 0 {
        let c = chunk.min(n - r0);
        chunk_logits(be, &h, &w, &logits, (r0, c), (d, v))?;
        let meta = TensorMeta::new(Shape::from(vec![c, v]), DType::F32);
        let (lc, tc, sc) = (logits.rows(0, c)?, t.rows(r0, r0 + c)?, lse.rows(r0, r0 + c)?);
        let g = crate::loss::cross_entropy_backward(
            be,
            &[&lc, &tc, &sc, &dloss],
            ignore,
            true,
            None,
            at,
            &meta,
            Purpose::Scratch,
        )?;
        // dx rows = G · w.
        let xr = dx_rows.rows(r0, r0 + c)?;
        gemm_f32(
            be,
            (d, c, v),
            1.0,
            mat(w.ptr(), d, false),
            mat(g.ptr(), v, false),
            0.0,
            mat(xr.ptr(), d, false),
            1,
        )?;
        // dweight += Gᵀ · h rows.
        let hr = h.rows(r0, r0 + c)?;
        gemm_f32(
            be,
            (d, v, c),
            1.0,
            mat(hr.ptr(), d, false),
            mat(g.ptr(), v, true),
            1.0,
            mat(dw.ptr(), d, false),
            1,
        )?;
        r0 += c;
    }
    Ok(vec![dx, dw])
}
