//! Matrix products on cuBLAS (`cublasGemmStridedBatchedEx`): f32 operands in f32, bf16/f16
//! operands natively with f32 accumulation. Row-major `C = op(A)·op(B)` is column-major
//! `Cᵀ = op(B)ᵀ·op(A)ᵀ`, so B goes first and nothing is transposed in memory. A batch of
//! products against one matrix (a weight) folds into a single GEMM.

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::tensor::CudaTensor;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use std::ffi::c_void;
use tessera_ir::{DType, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

fn cuda_type(d: DType) -> Option<cudaDataType> {
    match d {
        DType::F32 => Some(cudaDataType::CUDA_R_32F),
        DType::BF16 => Some(cudaDataType::CUDA_R_16BF),
        DType::F16 => Some(cudaDataType::CUDA_R_16F),
        _ => None,
    }
}

/// An operand as (contiguous tensor, batch stride in elements: 0 when shared by the batch).
fn operand(be: &CudaBackend, x: &CudaTensor, batch: &[usize]) -> Result<(CudaTensor, i64)> {
    let r = x.dims().len();
    let (rows, cols) = (x.dims()[r - 2], x.dims()[r - 1]);
    let x_batch = &x.dims()[..r - 2];
    let shared = x_batch.iter().all(|&d| d == 1);
    if shared {
        let d = be.dense_pub(x)?;
        return Ok((d.reshaped(&[rows, cols]), 0));
    }
    let full = if x_batch == batch {
        x.clone()
    } else {
        let mut dims = batch.to_vec();
        dims.extend([rows, cols]);
        x.broadcast(&dims)?
    };
    let d = be.dense_pub(&full)?;
    Ok((d, (rows * cols) as i64))
}

pub fn matmul(
    be: &CudaBackend,
    a: &CudaTensor,
    b: &CudaTensor,
    trans_a: bool,
    trans_b: bool,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    let (ad, bd, od) = (a.dims().to_vec(), b.dims().to_vec(), out.shape.dims().to_vec());
    if ad.len() < 2 || bd.len() < 2 || od.len() < 2 {
        return Err(RuntimeError::Binding(format!("matmul operands {ad:?} x {bd:?} need 2 dims")));
    }
    let (ar, ac) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (br, bc) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    let (m, k) = if trans_a { (ac, ar) } else { (ar, ac) };
    let (k2, n) = if trans_b { (bc, br) } else { (br, bc) };
    if k != k2 || od[od.len() - 2] != m || od[od.len() - 1] != n {
        return Err(RuntimeError::Binding(format!("matmul {ad:?} x {bd:?} does not give {od:?}")));
    }
    let (Some(ta), Some(tb), Some(tc)) =
        (cuda_type(a.dtype()), cuda_type(b.dtype()), cuda_type(out.dtype))
    else {
        return Err(RuntimeError::Unsupported {
            backend: "cuda".into(),
            op: "matmul".into(),
            reason: format!("operands {:?} x {:?} → {:?}", a.dtype(), b.dtype(), out.dtype),
        });
    };
    if a.dtype() != b.dtype() {
        // Mixed operands: both in f32.
        let a32 = be.cast(a, DType::F32, Purpose::Scratch)?;
        let b32 = be.cast(b, DType::F32, Purpose::Scratch)?;
        return matmul(be, &a32, &b32, trans_a, trans_b, out, p);
    }
    let batch = &od[..od.len() - 2];
    let nbatch: usize = batch.iter().product();
    let y = CudaTensor::empty(be.gpu(), &od, out.dtype, p)?;
    if y.numel() == 0 {
        return Ok(y);
    }
    if k == 0 {
        be.fill_pub(&y, 0.0)?;
        return Ok(y);
    }
    let (a, sa) = operand(be, a, batch)?;
    let (b, sb) = operand(be, b, batch)?;
    // A weight shared by the batch against an untransposed batched A: one tall product.
    let (m_rows, count, sa, sc) = if sb == 0 && !trans_a && sa != 0 {
        (nbatch * m, 1, 0, 0)
    } else {
        (m, nbatch, sa, (m * n) as i64)
    };
    let op =
        |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
    let (alpha, beta) = (1f32, 0f32);
    let gpu = be.gpu();
    let blas =
        gpu.blas.lock().map_err(|_| RuntimeError::Binding("cuda: cuBLAS lock poisoned".into()))?;
    // SAFETY: the pointers are live device buffers holding the dims checked above; alpha and
    // beta are host f32 (compute type 32F).
    unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            blas.0,
            op(trans_b),
            op(trans_a),
            n as i32,
            m_rows as i32,
            k as i32,
            &alpha as *const f32 as *const c_void,
            b.ptr() as *const c_void,
            tb,
            bc as i32,
            sb,
            a.ptr() as *const c_void,
            ta,
            ac as i32,
            sa,
            &beta as *const f32 as *const c_void,
            y.ptr() as *mut c_void,
            tc,
            n as i32,
            sc,
            count as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| {
        RuntimeError::Binding(format!("cuda: cuBLAS GEMM {m}x{k}x{n} (batch {nbatch}): {e:?}"))
    })?;
    Ok(y)
}

/// One operand of [`gemm_f32`] in cuBLAS's column-major terms.
#[derive(Clone, Copy)]
pub(crate) struct ColMat {
    pub ptr: u64,
    pub ld: i64,
    pub stride: i64,
    pub trans: bool,
}

/// `C = alpha·op(A)·op(B) + beta·C` on f32, column-major (`m × n`, inner `k`), `count`
/// strided products.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_f32(
    be: &CudaBackend,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: ColMat,
    b: ColMat,
    beta: f32,
    c: ColMat,
    count: usize,
) -> Result<()> {
    let op =
        |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
    let f32t = cudaDataType::CUDA_R_32F;
    let blas = be
        .gpu()
        .blas
        .lock()
        .map_err(|_| RuntimeError::Binding("cuda: cuBLAS lock poisoned".into()))?;
    // SAFETY: the callers pass live device buffers large enough for these dims and strides.
    unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            blas.0,
            op(a.trans),
            op(b.trans),
            m as i32,
            n as i32,
            k as i32,
            &alpha as *const f32 as *const c_void,
            a.ptr as *const c_void,
            f32t,
            a.ld as i32,
            a.stride,
            b.ptr as *const c_void,
            f32t,
            b.ld as i32,
            b.stride,
            &beta as *const f32 as *const c_void,
            c.ptr as *mut c_void,
            f32t,
            c.ld as i32,
            c.stride,
            count as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| RuntimeError::Binding(format!("cuda: cuBLAS GEMM {m}x{n}x{k} (x{count}): {e:?}")))
}
