//! Matrix products on cuBLAS: f32 operands in f32, bf16/f16 operands natively with f32
//! accumulation. Row-major `C = op(A)·op(B)` is column-major `Cᵀ = op(B)ᵀ·op(A)ᵀ`, so B goes
//! first and nothing is transposed in memory. A batch of products against one matrix (a
//! weight) folds into a single GEMM.
//!
//! Two ways to call cuBLAS ([`GemmPath`], `TESSERA_GEMM`): `lt` (the default) keeps, per
//! problem — shapes, transposes, dtypes, leading dims, batch strides and the operands'
//! alignment — a cuBLASLt matmul descriptor, its three layouts and the algorithm the
//! heuristic chose, and runs every product with one `cublasLtMatmul` on a workspace
//! allocated once: a training step repeats the same few dozen problems hundreds of times, and
//! the heuristic query and the descriptors are then built once per problem, not once per call.
//! `legacy` calls `cublasGemmStridedBatchedEx` every time (which does that work inside cuBLAS
//! on each call). A problem cuBLASLt refuses, or a batch with a shared operand (batch stride
//! 0), takes the legacy call. Either way an algorithm, once chosen, is kept, so the products
//! are the same bits every step.

use crate::alloc::Purpose;
use crate::backend::CudaBackend;
use crate::tensor::CudaTensor;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublaslt::sys as lt;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, Ordering};
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
    let g = Gemm {
        trans_a: trans_b,
        trans_b: trans_a,
        m: n as i32,
        n: m_rows as i32,
        k: k as i32,
        a: b.ptr(),
        type_a: tb,
        lda: bc as i32,
        stride_a: sb,
        b: a.ptr(),
        type_b: ta,
        ldb: ac as i32,
        stride_b: sa,
        c: y.ptr(),
        type_c: tc,
        ldc: n as i32,
        stride_c: sc,
        count: count as i32,
    };
    run_gemm(be, &g).map_err(|e| {
        RuntimeError::Binding(format!("cuda: cuBLAS GEMM {m}x{k}x{n} (batch {nbatch}): {e}"))
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

/// How the products call cuBLAS (see the module's doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// cuBLASLt with a descriptor, layouts and algorithm kept per problem.
    Lt,
    /// `cublasGemmStridedBatchedEx` on every call.
    Legacy,
}

static PATH: AtomicU8 = AtomicU8::new(0);

/// Chooses the GEMM path for the rest of the process (`None`: back to `TESSERA_GEMM`'s
/// choice); for A/B measurements in one process.
pub fn set_gemm_path(p: Option<GemmPath>) {
    PATH.store(
        match p {
            None => 0,
            Some(GemmPath::Lt) => 1,
            Some(GemmPath::Legacy) => 2,
        },
        Ordering::Relaxed,
    );
}

/// The GEMM path in use: [`set_gemm_path`]'s choice, else `TESSERA_GEMM` (`legacy` or `lt`,
/// read once), else [`GemmPath::Lt`].
pub fn gemm_path() -> GemmPath {
    static ENV: std::sync::OnceLock<GemmPath> = std::sync::OnceLock::new();
    match PATH.load(Ordering::Relaxed) {
        1 => GemmPath::Lt,
        2 => GemmPath::Legacy,
        _ => *ENV.get_or_init(|| parse_path(std::env::var("TESSERA_GEMM").ok().as_deref())),
    }
}

fn parse_path(v: Option<&str>) -> GemmPath {
    match v.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
        Some("legacy") => GemmPath::Legacy,
        _ => GemmPath::Lt,
    }
}

/// One strided-batched product in cuBLAS's column-major terms: `C = op(A)·op(B)` (`m × n`,
/// inner `k`), `count` products `stride_*` elements apart (alpha 1, beta 0, f32 compute).
#[derive(Clone, Copy, Debug)]
struct Gemm {
    trans_a: bool,
    trans_b: bool,
    m: i32,
    n: i32,
    k: i32,
    a: u64,
    type_a: cudaDataType,
    lda: i32,
    stride_a: i64,
    b: u64,
    type_b: cudaDataType,
    ldb: i32,
    stride_b: i64,
    c: u64,
    type_c: cudaDataType,
    ldc: i32,
    stride_c: i64,
    count: i32,
}

/// What selects a cuBLASLt plan: everything of a [`Gemm`] but its addresses, which count
/// only by their alignment (the heuristic picks among the algorithms those alignments allow).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct LtKey {
    trans: (bool, bool),
    mnk: (i32, i32, i32),
    types: (u32, u32, u32),
    ld: (i32, i32, i32),
    strides: (i64, i64, i64),
    count: i32,
    align: (u32, u32, u32),
}

/// The alignment cuBLASLt may assume of an address: its largest power of two, up to 256.
fn alignment(addr: u64) -> u32 {
    if addr == 0 {
        256
    } else {
        1u32 << addr.trailing_zeros().min(8)
    }
}

impl Gemm {
    fn key(&self) -> LtKey {
        LtKey {
            trans: (self.trans_a, self.trans_b),
            mnk: (self.m, self.n, self.k),
            types: (self.type_a as u32, self.type_b as u32, self.type_c as u32),
            ld: (self.lda, self.ldb, self.ldc),
            strides: (self.stride_a, self.stride_b, self.stride_c),
            count: self.count,
            align: (alignment(self.a), alignment(self.b), alignment(self.c)),
        }
    }

    /// Whether cuBLASLt is asked for this product: a batch whose operands all step through
    /// memory (a shared operand, batch stride 0, stays on the legacy call).
    fn lt_eligible(&self) -> bool {
        self.count == 1 || (self.stride_a != 0 && self.stride_b != 0 && self.stride_c != 0)
    }
}

fn run_gemm(be: &CudaBackend, g: &Gemm) -> std::result::Result<(), String> {
    if gemm_path() == GemmPath::Lt && g.lt_eligible() {
        let gpu = be.gpu();
        let mut state = gpu.lt.lock().map_err(|_| "cuBLASLt lock poisoned".to_string())?;
        if let Some(done) = state.run(gpu, g)? {
            return Ok(done);
        }
    }
    legacy(be, g)
}

fn legacy(be: &CudaBackend, g: &Gemm) -> std::result::Result<(), String> {
    let op =
        |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
    let (alpha, beta) = (1f32, 0f32);
    let blas = be.gpu().blas.lock().map_err(|_| "cuBLAS lock poisoned".to_string())?;
    // SAFETY: the pointers are live device buffers holding the dims the caller checked; alpha
    // and beta are host f32 (compute type 32F).
    unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            blas.0,
            op(g.trans_a),
            op(g.trans_b),
            g.m,
            g.n,
            g.k,
            &alpha as *const f32 as *const c_void,
            g.a as *const c_void,
            g.type_a,
            g.lda,
            g.stride_a,
            g.b as *const c_void,
            g.type_b,
            g.ldb,
            g.stride_b,
            &beta as *const f32 as *const c_void,
            g.c as *mut c_void,
            g.type_c,
            g.ldc,
            g.stride_c,
            g.count,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| format!("{e:?}"))
}

/// The cuBLASLt workspace: what cuBLAS itself gives a handle by default (32 MiB on Hopper and
/// later, 4 MiB before), so the heuristic sees the same room.
fn workspace_bytes(major: i32) -> usize {
    if major >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

/// One problem's cuBLASLt plan: descriptor, layouts of A, B and C (= D), the algorithm; or
/// `None` when cuBLASLt offered none (the legacy call then runs it).
struct LtPlan {
    desc: lt::cublasLtMatmulDesc_t,
    layouts: [lt::cublasLtMatrixLayout_t; 3],
    algo: Option<lt::cublasLtMatmulAlgo_t>,
}

/// The GPU's cuBLASLt state (in [`crate::gpu::Gpu`], under its lock): created on the first
/// product, with the workspace taken from the driver (outside the caching allocator's books,
/// as cuBLAS's own workspace is) and the plans by problem.
#[derive(Default)]
pub(crate) struct LtState {
    inner: Option<LtInner>,
    /// Creation failed (no libcublasLt, or no memory for the workspace): legacy calls only.
    unavailable: bool,
    /// Products run by cuBLASLt, heuristic queries made (one per new problem).
    pub(crate) calls: u64,
    pub(crate) plans_made: u64,
}

struct LtInner {
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    handle: lt::cublasLtHandle_t,
    workspace: u64,
    workspace_bytes: usize,
    plans: HashMap<LtKey, LtPlan>,
}

// SAFETY: the handle, descriptors and layouts are used only under the GPU's `lt` mutex.
unsafe impl Send for LtState {}

fn lt_type(t: cudaDataType) -> lt::cudaDataType {
    match t {
        cudaDataType::CUDA_R_16BF => lt::cudaDataType::CUDA_R_16BF,
        cudaDataType::CUDA_R_16F => lt::cudaDataType::CUDA_R_16F,
        _ => lt::cudaDataType::CUDA_R_32F,
    }
}

fn lt_err(what: &str, e: impl std::fmt::Debug) -> String {
    format!("cuBLASLt {what}: {e:?}")
}

impl LtState {
    /// Runs `g` through its plan, making the plan first if new. `Ok(None)`: cuBLASLt does not
    /// take it (the caller runs the legacy call).
    fn run(&mut self, gpu: &crate::gpu::Gpu, g: &Gemm) -> std::result::Result<Option<()>, String> {
        if self.unavailable {
            return Ok(None);
        }
        if self.inner.is_none() {
            match LtInner::create(gpu) {
                Ok(inner) => self.inner = Some(inner),
                Err(_) => {
                    self.unavailable = true;
                    return Ok(None);
                }
            }
        }
        let Some(inner) = self.inner.as_mut() else { return Ok(None) };
        let key = g.key();
        if !inner.plans.contains_key(&key) {
            let plan = inner.plan(g)?;
            self.plans_made += 1;
            inner.plans.insert(key, plan);
        }
        let plan = &inner.plans[&key];
        let Some(algo) = plan.algo.as_ref() else { return Ok(None) };
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the descriptor and layouts describe `g`'s live device buffers (checked by
        // the caller); the workspace is this state's, used on the GPU's one stream.
        unsafe {
            cudarc::cublaslt::result::matmul(
                inner.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                g.a as *const c_void,
                plan.layouts[0],
                g.b as *const c_void,
                plan.layouts[1],
                g.c as *const c_void,
                plan.layouts[2],
                g.c as *mut c_void,
                plan.layouts[2],
                algo,
                inner.workspace as *mut c_void,
                inner.workspace_bytes,
                gpu.stream.cu_stream() as lt::cudaStream_t,
            )
        }
        .map_err(|e| lt_err("matmul", e))?;
        self.calls += 1;
        Ok(Some(()))
    }
}

impl LtInner {
    fn create(gpu: &crate::gpu::Gpu) -> std::result::Result<LtInner, String> {
        gpu.bind().map_err(|e| e.to_string())?;
        // With dynamic loading a missing library is a panic inside cudarc.
        let handle = std::panic::catch_unwind(cudarc::cublaslt::result::create_handle)
            .map_err(|_| "libcublasLt not found".to_string())?
            .map_err(|e| lt_err("handle", e))?;
        let bytes = workspace_bytes(gpu.capability().0);
        // SAFETY: a plain allocation in the bound context, freed in `drop`.
        let workspace = match unsafe { cudarc::driver::result::malloc_sync(bytes) } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: the handle was just created.
                let _ = unsafe { cudarc::cublaslt::result::destroy_handle(handle) };
                return Err(format!("cuBLASLt workspace: {e}"));
            }
        };
        Ok(LtInner {
            ctx: gpu.ctx.clone(),
            handle,
            workspace,
            workspace_bytes: bytes,
            plans: HashMap::new(),
        })
    }

    /// The descriptor, layouts and algorithm of `g`'s problem.
    fn plan(&self, g: &Gemm) -> std::result::Result<LtPlan, String> {
        let desc = cudarc::cublaslt::result::create_matmul_desc(
            lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt::cudaDataType::CUDA_R_32F,
        )
        .map_err(|e| lt_err("descriptor", e))?;
        let mut plan = LtPlan { desc, layouts: [std::ptr::null_mut(); 3], algo: None };
        // The plan owns what is made from here on: dropped (and destroyed) on an error.
        let set_desc = |attr, v: i32| {
            // SAFETY: a live descriptor; the attribute takes an int32 (cublasOperation_t).
            unsafe {
                cudarc::cublaslt::result::set_matmul_desc_attribute(
                    desc,
                    attr,
                    &v as *const i32 as *const c_void,
                    std::mem::size_of::<i32>(),
                )
            }
            .map_err(|e| lt_err("descriptor attribute", e))
        };
        set_desc(
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            i32::from(g.trans_a),
        )?;
        set_desc(
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            i32::from(g.trans_b),
        )?;
        // Stored shapes (column-major rows × cols): op(A) is m × k, op(B) k × n, C m × n.
        let (m, n, k) = (g.m as u64, g.n as u64, g.k as u64);
        let dims = [
            if g.trans_a { (k, m) } else { (m, k) },
            if g.trans_b { (n, k) } else { (k, n) },
            (m, n),
        ];
        let types = [g.type_a, g.type_b, g.type_c];
        let lds = [g.lda, g.ldb, g.ldc];
        let strides = [g.stride_a, g.stride_b, g.stride_c];
        for i in 0..3 {
            let l = cudarc::cublaslt::result::create_matrix_layout(
                lt_type(types[i]),
                dims[i].0,
                dims[i].1,
                lds[i] as i64,
            )
            .map_err(|e| lt_err("layout", e))?;
            plan.layouts[i] = l;
            if g.count > 1 {
                let count = g.count;
                let stride = strides[i];
                // SAFETY: a live layout; the attributes take an int32 and an int64.
                unsafe {
                    cudarc::cublaslt::result::set_matrix_layout_attribute(
                        l,
                        lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        &count as *const i32 as *const c_void,
                        std::mem::size_of::<i32>(),
                    )
                    .and_then(|_| {
                        cudarc::cublaslt::result::set_matrix_layout_attribute(
                            l,
                            lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                            &stride as *const i64 as *const c_void,
                            std::mem::size_of::<i64>(),
                        )
                    })
                }
                .map_err(|e| lt_err("layout attribute", e))?;
            }
        }
        let pref =
            cudarc::cublaslt::result::create_matmul_pref().map_err(|e| lt_err("preference", e))?;
        let ws = self.workspace_bytes as u64;
        let align = [alignment(g.a), alignment(g.b), alignment(g.c), alignment(g.c)];
        use lt::cublasLtMatmulPreferenceAttributes_t as P;
        // SAFETY: a live preference; the attributes take a u64 (workspace) and u32s (alignments).
        let heuristic = unsafe {
            let mut r = cudarc::cublaslt::result::set_matmul_pref_attribute(
                pref,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            );
            for (attr, v) in [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ]
            .into_iter()
            .zip(align)
            {
                r = r.and_then(|_| {
                    cudarc::cublaslt::result::set_matmul_pref_attribute(
                        pref,
                        attr,
                        &v as *const u32 as *const c_void,
                        std::mem::size_of::<u32>(),
                    )
                });
            }
            let h = r.and_then(|_| {
                cudarc::cublaslt::result::get_matmul_algo_heuristic(
                    self.handle,
                    desc,
                    plan.layouts[0],
                    plan.layouts[1],
                    plan.layouts[2],
                    plan.layouts[2],
                    pref,
                )
            });
            let _ = cudarc::cublaslt::result::destroy_matmul_pref(pref);
            h
        };
        // No algorithm for this problem: kept as such, the legacy call runs it.
        plan.algo =
            heuristic.ok().filter(|h| h.workspaceSize <= self.workspace_bytes).map(|h| h.algo);
        Ok(plan)
    }
}

impl Drop for LtPlan {
    fn drop(&mut self) {
        // SAFETY: made by `LtInner::plan`, destroyed once; null layouts were never made.
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    let _ = cudarc::cublaslt::result::destroy_matrix_layout(l);
                }
            }
            let _ = cudarc::cublaslt::result::destroy_matmul_desc(self.desc);
        }
    }
}

impl Drop for LtInner {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: the handle and workspace were made by `create` and are released once, with
        // their context bound.
        unsafe {
            let _ = cudarc::cublaslt::result::destroy_handle(self.handle);
            if self.ctx.bind_to_thread().is_ok() {
                let _ = cudarc::driver::result::free_sync(self.workspace);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_path_from_the_environment() {
        assert_eq!(parse_path(None), GemmPath::Lt);
        assert_eq!(parse_path(Some("lt")), GemmPath::Lt);
        assert_eq!(parse_path(Some("legacy")), GemmPath::Legacy);
        assert_eq!(parse_path(Some(" Legacy ")), GemmPath::Legacy);
    }

    fn gemm(a: u64, count: i32, stride_b: i64) -> Gemm {
        Gemm {
            trans_a: false,
            trans_b: true,
            m: 2048,
            n: 8192,
            k: 5504,
            a,
            type_a: cudaDataType::CUDA_R_16BF,
            lda: 2048,
            stride_a: 2048 * 5504,
            b: 1 << 30,
            type_b: cudaDataType::CUDA_R_16BF,
            ldb: 8192,
            stride_b,
            c: 1 << 31,
            type_c: cudaDataType::CUDA_R_16BF,
            ldc: 2048,
            stride_c: 2048 * 8192,
            count,
        }
    }

    /// A plan serves every call of its problem wherever the buffers are, as long as they are
    /// as aligned; an operand less aligned is another problem (the heuristic may pick
    /// differently).
    #[test]
    fn plans_are_keyed_by_problem_and_alignment() {
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0200), 256);
        assert_eq!(alignment(0x7f00_0000_0010), 16);
        assert_eq!(alignment(0x7f00_0000_0002), 2);
        let base = gemm(1 << 29, 1, 0);
        assert_eq!(base.key(), gemm((1 << 29) + 4096, 1, 0).key());
        assert_ne!(base.key(), gemm((1 << 29) + 16, 1, 0).key());
        assert_ne!(base.key(), gemm(1 << 29, 4, 8192 * 5504).key());
        // A batch with a shared operand stays on the legacy call; a single product or a batch
        // that steps through every operand goes to cuBLASLt.
        assert!(base.lt_eligible());
        assert!(gemm(1 << 29, 4, 8192 * 5504).lt_eligible());
        assert!(!gemm(1 << 29, 4, 0).lt_eligible());
    }
}
