//! The CUDA [`Backend`]: the executor's values are [`CudaTensor`]s, every IR op a kernel of
//! the `.cu` sources or a cuBLAS GEMM. Program tensors (bound leaves, nodes' fresh outputs) come
//! from the caching allocator as [`Purpose::Program`], so its books match the accountant's;
//! temporaries a kernel needs are [`Purpose::Scratch`] and reported beside.
//!
//! Mixed precision follows the CPU backend: half-precision operands of arithmetic ops are
//! upcast to f32 and the results rounded to their declared dtype; matrix products take bf16
//! and f16 operands natively (fp32 accumulation); layout ops, casts and AdamW handle every
//! dtype.

use crate::alloc::Purpose;
use crate::gpu::Gpu;
use crate::launch::{elementwise, elementwise_ops, launch, per_row, Arg, Attn};
use crate::source::{binary_code, float_code, type_code, unary_code};
use crate::tensor::{elem_size, row_major, CudaTensor, Layout};
use crate::timer::OpTimer;
use candle_core::Tensor;
use std::sync::Arc;
use tessera_ir::dist::{MeshPos, TableRows};
use tessera_ir::{AttentionSpec, DType, Op, TensorMeta};
use tessera_runtime::{Backend, Result, RuntimeError};

/// One GPU as a backend.
#[derive(Clone)]
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    name: String,
    timer: Option<OpTimer>,
    /// Bad cross-entropy targets found on the device (module `fault`).
    fault: Arc<crate::fault::TargetFault>,
    /// Host copies of the generation ops' index tensors, read back once per bound value.
    ints: Arc<crate::infer::HostInts>,
}

impl CudaBackend {
    pub fn new(gpu: Arc<Gpu>) -> CudaBackend {
        let fault = Arc::new(crate::fault::TargetFault::new(gpu.clone()));
        CudaBackend {
            name: format!("cuda:{}", gpu.ordinal()),
            gpu,
            timer: None,
            fault,
            ints: Arc::default(),
        }
    }

    /// Records device time per op kind into `timer` while `timer.on` is set.
    pub fn with_op_timer(mut self, timer: OpTimer) -> CudaBackend {
        self.timer = Some(timer);
        self
    }
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
    pub(crate) fn target_fault(&self) -> &crate::fault::TargetFault {
        &self.fault
    }
    pub(crate) fn host_ints(&self) -> &crate::infer::HostInts {
        &self.ints
    }
}

fn unsupported(op: &str, reason: impl Into<String>) -> RuntimeError {
    RuntimeError::Unsupported { backend: "cuda".into(), op: op.into(), reason: reason.into() }
}

fn bad(msg: String) -> RuntimeError {
    RuntimeError::Binding(msg)
}

fn is_half(d: DType) -> bool {
    matches!(d, DType::BF16 | DType::F16)
}

/// Ops that take half-precision operands natively (the rest run in f32 on upcast operands):
/// those every backend does, GEMMs (bf16 on cuBLAS), copies, the elementwise kernels and the
/// quantised matmul, which load each operand in its own dtype and round the f32 result once
/// (the CPU's upcast-compute-round, without the f32 copies).
fn native_half(op: &Op) -> bool {
    tessera_runtime::backend::takes_any_dtype(op)
        || matches!(
            op,
            Op::MatMul { .. }
                | Op::QMatMul(_)
                | Op::QMatMulBackward(_)
                | Op::Transfer { .. }
                | Op::Reshard(_)
                | Op::Unary(_)
                | Op::UnaryBackward(_)
                | Op::Binary(_)
                | Op::BinaryBackward { .. }
                | Op::Dropout { .. }
                | Op::Rope { .. }
                | Op::Reduce { .. }
                | Op::ReduceBackward { .. }
                | Op::LayerNorm { .. }
                | Op::RmsNorm { .. }
                | Op::LayerNormBackward { .. }
                | Op::RmsNormBackward { .. }
                | Op::CrossEntropy { .. }
                | Op::CrossEntropyBackward { .. }
                | Op::LogSumExp
        )
}

impl Backend for CudaBackend {
    type Value = CudaTensor;

    fn name(&self) -> &str {
        &self.name
    }

    fn upload(&self, t: &Tensor) -> Result<CudaTensor> {
        self.upload_as(t, Purpose::Program)
    }

    /// Also the synchronisation at which a bad cross-entropy target met since the last one
    /// surfaces, with the CPU kernel's error (module `fault`).
    fn download(&self, v: &CudaTensor) -> Result<Tensor> {
        let t = self.download_impl(v)?;
        self.fault.check()?;
        Ok(t)
    }

    fn meta(&self, v: &CudaTensor) -> Result<TensorMeta> {
        Ok(v.meta())
    }

    fn run_started(&self) {
        self.gpu.begin_step();
    }

    fn run_finished(&self) {
        self.gpu.end_step();
    }

    fn allocator_peak_bytes(&self) -> Option<u64> {
        Some(self.gpu.memory().program.peak)
    }

    fn execute(
        &self,
        op: &Op,
        inputs: &[&CudaTensor],
        outputs: &[TensorMeta],
        at: &MeshPos,
    ) -> Result<Vec<CudaTensor>> {
        match &self.timer {
            None => self.execute_impl(op, inputs, outputs, at),
            Some(timer) => self.execute_timed(timer, op, inputs, outputs, at),
        }
    }
}

impl CudaBackend {
    /// A host tensor's copy on the device, charged as `purpose`.
    pub fn upload_as(&self, t: &Tensor, purpose: Purpose) -> Result<CudaTensor> {
        self.gpu.bind()?;
        let meta = tessera_runtime::tensor::meta_of(t)
            .ok_or_else(|| bad(format!("cuda: cannot upload a {:?} tensor", t.dtype())))?;
        let out = CudaTensor::empty(&self.gpu, t.dims(), meta.dtype, purpose)?;
        let t = t.flatten_all()?;
        // Ordered on this GPU's stream (a device sharing the GPU has its own), and waited for
        // before `v` goes: the block may be one the stream's earlier kernels still read.
        let stream = self.gpu.stream.cu_stream();
        macro_rules! put {
            ($ty:ty) => {{
                let v = t.to_vec1::<$ty>()?;
                // SAFETY: `out` holds exactly `v.len()` elements of this type; `v` outlives the
                // copy (the stream is synchronised below).
                unsafe { cudarc::driver::result::memcpy_htod_async(out.ptr(), &v, stream) }
                    .and_then(|()| self.gpu.stream.synchronize())
            }};
        }
        match t.dtype() {
            candle_core::DType::F32 => put!(f32),
            candle_core::DType::F64 => put!(f64),
            candle_core::DType::BF16 => put!(half::bf16),
            candle_core::DType::F16 => put!(half::f16),
            candle_core::DType::I64 => put!(i64),
            candle_core::DType::U8 => put!(u8),
            d => return Err(bad(format!("cuda: cannot upload a {d:?} tensor"))),
        }
        .map_err(|e| bad(format!("cuda: upload: {e}")))?;
        Ok(out)
    }

    fn download_impl(&self, v: &CudaTensor) -> Result<Tensor> {
        self.gpu.bind()?;
        let v = if v.is_contiguous() { v.clone() } else { self.copy(v, Purpose::Scratch)? };
        let n = v.numel();
        let dims = v.dims().to_vec();
        let stream = self.gpu.stream.cu_stream();
        macro_rules! get {
            ($ty:ty, $zero:expr) => {{
                let mut h = vec![$zero; n];
                // SAFETY: `v` is contiguous with `n` elements of this type; the copy is ordered
                // after the stream's kernels that write it and waited for before `h` is read.
                unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut h, v.ptr(), stream) }
                    .and_then(|()| self.gpu.stream.synchronize())
                    .map_err(|e| bad(format!("cuda: download: {e}")))?;
                Tensor::from_vec(h, dims, &candle_core::Device::Cpu)?
            }};
        }
        Ok(match v.dtype() {
            DType::F32 => get!(f32, 0f32),
            DType::F64 => get!(f64, 0f64),
            DType::BF16 => get!(half::bf16, half::bf16::ZERO),
            DType::F16 => get!(half::f16, half::f16::ZERO),
            DType::I32 | DType::I64 => get!(i64, 0i64),
            DType::Bool | DType::U8 => get!(u8, 0u8),
        })
    }

    pub(crate) fn execute_impl(
        &self,
        op: &Op,
        inputs: &[&CudaTensor],
        outputs: &[TensorMeta],
        at: &MeshPos,
    ) -> Result<Vec<CudaTensor>> {
        self.gpu.bind()?;
        if let Some(what) = crate::unverified::kernels(op, inputs.len()) {
            if !crate::unverified::allowed() {
                return Err(unsupported(
                    op.name(),
                    format!(
                        "{what} on CUDA have been compiled (sm_90) but not yet run on a GPU, \
                         so their results are unchecked: use the CPU runtime (--device cpu), or \
                         set {}=1 to run them anyway (`scripts/gpu-check.sh moe ring qlora tp \
                         shared qlora-cli` checks them against the CPU)",
                        crate::unverified::ENV
                    ),
                ));
            }
        }
        let p = Purpose::Program;
        // bf16 attention runs fused on tensor cores where the flash kernels apply: not ring
        // attention (global positions, the log-sum-exp's cotangent) nor tensor parallelism
        // past the KV heads (each query head's KV head by its global index), which the
        // unfused path takes (module `attention`).
        let unfused = |spec: &AttentionSpec| spec.ring.is_some() || spec.kv_whole.is_some();
        let flash = match op {
            Op::Attention(spec) if !unfused(spec) => {
                crate::flash::forward(self, inputs, spec, at, outputs, p)?
            }
            Op::AttentionBackward(spec) if !unfused(spec) && inputs.len() == 6 => {
                crate::flash::backward(self, inputs, spec, at, outputs, p)?
            }
            _ => None,
        };
        if let Some(out) = flash {
            return Ok(out);
        }
        let half = inputs.iter().any(|t| is_half(t.dtype()));
        if !half || native_half(op) {
            return self.run(op, inputs, outputs, at, p);
        }
        // Autocast: f32 copies of the half operands (scratch), f32 results, rounded into the
        // declared outputs.
        let up: Vec<CudaTensor> = inputs
            .iter()
            .map(|t| {
                if is_half(t.dtype()) {
                    self.cast(t, DType::F32, Purpose::Scratch)
                } else {
                    Ok((*t).clone())
                }
            })
            .collect::<Result<_>>()?;
        let refs: Vec<&CudaTensor> = up.iter().collect();
        let f32_out: Vec<TensorMeta> = outputs
            .iter()
            .map(|m| {
                if is_half(m.dtype) {
                    TensorMeta { shape: m.shape.clone(), dtype: DType::F32 }
                } else {
                    m.clone()
                }
            })
            .collect();
        let outs = self.run(op, &refs, &f32_out, at, Purpose::Scratch)?;
        outs.into_iter().zip(outputs).map(|(t, m)| self.cast(&t, m.dtype, p)).collect()
    }
}

impl CudaBackend {
    pub(crate) fn new_out(&self, m: &TensorMeta, p: Purpose) -> Result<CudaTensor> {
        CudaTensor::empty(&self.gpu, m.shape.dims(), m.dtype, p)
    }

    /// A fresh contiguous copy.
    pub fn copy(&self, x: &CudaTensor, p: Purpose) -> Result<CudaTensor> {
        let y = CudaTensor::empty(&self.gpu, x.dims(), x.dtype(), p)?;
        self.copy_into(x, &y, y.layout()?)?;
        Ok(y)
    }

    /// Writes `x` into `y` at layout `ly` (x's dims).
    fn copy_into(&self, x: &CudaTensor, y: &CudaTensor, ly: Layout) -> Result<()> {
        let n = x.numel();
        let dense_dst = ly.offset == 0 && y.is_contiguous() && y.dims() == x.dims();
        if x.is_contiguous() && dense_dst {
            // SAFETY: both buffers hold `n` contiguous elements of this size.
            return unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    y.ptr(),
                    x.ptr(),
                    n * elem_size(x.dtype()),
                    self.gpu.stream.cu_stream(),
                )
            }
            .map_err(|e| bad(format!("cuda: device copy: {e}")));
        }
        let size = elem_size(x.dtype()) as i32;
        launch(
            &self.gpu,
            "copy_strided",
            elementwise(n),
            &[
                Arg::Ptr(x.base()),
                Arg::Layout(x.layout()?),
                Arg::Ptr(y.base()),
                Arg::Layout(ly),
                Arg::I32(size),
                Arg::I64(n as i64),
            ],
        )
    }

    /// `x` itself if contiguous, else a scratch copy.
    pub(crate) fn dense(&self, x: &CudaTensor) -> Result<CudaTensor> {
        if x.is_contiguous() {
            Ok(x.clone())
        } else {
            self.copy(x, Purpose::Scratch)
        }
    }

    pub fn cast(&self, x: &CudaTensor, to: DType, p: Purpose) -> Result<CudaTensor> {
        let y = CudaTensor::empty(&self.gpu, x.dims(), to, p)?;
        let n = x.numel();
        let lx = x.layout()?;
        launch(
            &self.gpu,
            "cast",
            elementwise_ops(n, &[(x.base(), lx, x.dtype())], (y.ptr(), to)),
            &[
                Arg::Ptr(x.base()),
                Arg::Layout(lx),
                Arg::I32(type_code(x.dtype())),
                Arg::Ptr(y.ptr()),
                Arg::I32(type_code(to)),
                Arg::I32(i32::from(to == DType::Bool)),
                Arg::I64(n as i64),
            ],
        )?;
        Ok(y)
    }

    fn fill(&self, y: &CudaTensor, value: f64) -> Result<()> {
        let d = y.dtype();
        let bits: u64 = match d {
            DType::F32 => (value as f32).to_bits() as u64,
            DType::F64 => value.to_bits(),
            DType::F16 => half::f16::from_f64(value).to_bits() as u64,
            DType::BF16 => half::bf16::from_f64(value).to_bits() as u64,
            DType::I32 | DType::I64 => value.trunc() as i64 as u64,
            DType::Bool => u64::from(value != 0.0),
            DType::U8 => value.trunc().clamp(0.0, 255.0) as u64,
        };
        let n = y.numel();
        launch(
            &self.gpu,
            "fill_bits",
            elementwise(n),
            &[Arg::Ptr(y.ptr()), Arg::U64(bits), Arg::I32(elem_size(d) as i32), Arg::I64(n as i64)],
        )
    }

    fn expect_f32(&self, op: &Op, xs: &[&CudaTensor]) -> Result<()> {
        for x in xs {
            if x.dtype() != DType::F32 {
                return Err(unsupported(
                    op.name(),
                    format!("an operand is {:?}; this kernel computes in f32", x.dtype()),
                ));
            }
        }
        Ok(())
    }

    /// Runs `op` with every operand in the dtype its kernel takes; fresh outputs are `p`.
    fn run(
        &self,
        op: &Op,
        x: &[&CudaTensor],
        out: &[TensorMeta],
        at: &MeshPos,
        p: Purpose,
    ) -> Result<Vec<CudaTensor>> {
        let rank = x.iter().map(|t| t.dims().len()).chain(out.iter().map(|m| m.shape.rank()));
        if let Some(r) = rank.max().filter(|&r| r > crate::tensor::MAXD) {
            return Err(unsupported(
                op.name(),
                format!(
                    "a tensor of {r} dims (the CUDA kernels address at most {})",
                    crate::tensor::MAXD
                ),
            ));
        }
        let g = &self.gpu;
        let one = |t: CudaTensor| Ok(vec![t]);
        match op {
            Op::Parameter { .. } | Op::Input(_) | Op::OptimizerState { .. } | Op::KvCache(_) => {
                Err(bad(format!("{} is a leaf: bind it, do not execute it", op.name())))
            }
            Op::Fill { value, meta } => {
                let y = self.new_out(meta, p)?;
                self.fill(&y, *value)?;
                one(y)
            }
            Op::Unary(u) => {
                let y = self.new_out(&out[0], p)?;
                let n = y.numel();
                let lx = x[0].layout()?;
                launch(
                    g,
                    "unary",
                    elementwise_ops(n, &[(x[0].base(), lx, x[0].dtype())], (y.ptr(), y.dtype())),
                    &[
                        Arg::I32(unary_code(*u)),
                        Arg::Ptr(x[0].base()),
                        Arg::Layout(lx),
                        Arg::I32(float_code(op.name(), x[0].dtype())?),
                        Arg::Ptr(y.ptr()),
                        Arg::I32(float_code(op.name(), y.dtype())?),
                        Arg::I64(n as i64),
                    ],
                )?;
                one(y)
            }
            Op::UnaryBackward(u) => {
                let y = self.new_out(&out[0], p)?;
                let n = y.numel();
                let (l0, l1) = (x[0].layout()?, x[1].layout_as(x[0].dims())?);
                let ins = [(x[0].base(), l0, x[0].dtype()), (x[1].base(), l1, x[1].dtype())];
                launch(
                    g,
                    "unary_backward",
                    elementwise_ops(n, &ins, (y.ptr(), y.dtype())),
                    &[
                        Arg::I32(unary_code(*u)),
                        Arg::Ptr(x[0].base()),
                        Arg::Layout(l0),
                        Arg::I32(float_code(op.name(), x[0].dtype())?),
                        Arg::Ptr(x[1].base()),
                        Arg::Layout(l1),
                        Arg::I32(float_code(op.name(), x[1].dtype())?),
                        Arg::Ptr(y.ptr()),
                        Arg::I32(float_code(op.name(), y.dtype())?),
                        Arg::I64(n as i64),
                    ],
                )?;
                one(y)
            }
            Op::Binary(b) => {
                let y = self.new_out(&out[0], p)?;
                let (dims, n) = (out[0].shape.dims(), y.numel());
                let (l0, l1) = (x[0].layout_as(dims)?, x[1].layout_as(dims)?);
                let ins = [(x[0].base(), l0, x[0].dtype()), (x[1].base(), l1, x[1].dtype())];
                launch(
                    g,
                    "binary",
                    elementwise_ops(n, &ins, (y.ptr(), y.dtype())),
                    &[
                        Arg::I32(binary_code(*b)),
                        Arg::Ptr(x[0].base()),
                        Arg::Layout(l0),
                        Arg::I32(float_code(op.name(), x[0].dtype())?),
                        Arg::Ptr(x[1].base()),
                        Arg::Layout(l1),
                        Arg::I32(float_code(op.name(), x[1].dtype())?),
                        Arg::Ptr(y.ptr()),
                        Arg::I32(float_code(op.name(), y.dtype())?),
                        Arg::I64(n as i64),
                    ],
                )?;
                one(y)
            }
            Op::BinaryBackward { op: b, wrt } => {
                if *wrt > 1 {
                    return Err(bad(format!("binary_backward: wrt must be 0 or 1, got {wrt}")));
                }
                let y = self.new_out(&out[0], p)?;
                let (dims, n) = (out[0].shape.dims(), y.numel());
                let ls = [x[0].layout_as(dims)?, x[1].layout_as(dims)?, x[2].layout_as(dims)?];
                let ins: Vec<_> = (0..3).map(|i| (x[i].base(), ls[i], x[i].dtype())).collect();
                launch(
                    g,
                    "binary_backward",
                    elementwise_ops(n, &ins, (y.ptr(), y.dtype())),
                    &[
                        Arg::I32(binary_code(*b)),
                        Arg::I32(*wrt as i32),
                        Arg::Ptr(x[0].base()),
                        Arg::Layout(ls[0]),
                        Arg::I32(float_code(op.name(), x[0].dtype())?),
                        Arg::Ptr(x[1].base()),
                        Arg::Layout(ls[1]),
                        Arg::I32(float_code(op.name(), x[1].dtype())?),
                        Arg::Ptr(x[2].base()),
                        Arg::Layout(ls[2]),
                        Arg::I32(float_code(op.name(), x[2].dtype())?),
                        Arg::Ptr(y.ptr()),
                        Arg::I32(float_code(op.name(), y.dtype())?),
                        Arg::I64(n as i64),
                    ],
                )?;
                one(y)
            }
            Op::Cast(d) => one(self.cast(x[0], *d, p)?),
            Op::Dropout { p: prob, stream, shard } => {
                one(crate::dropout::run(self, x, *prob, *stream, shard.as_ref(), at, &out[0], p)?)
            }
            Op::MatMul { trans_a, trans_b } => {
                one(crate::gemm::matmul(self, x[0], x[1], *trans_a, *trans_b, &out[0], p)?)
            }
            Op::Reduce { op: r, dims, .. } => one(self.reduce(*r, dims, x[0], &out[0], p)?),
            Op::ReduceBackward { op: r, dims, keepdim } => {
                one(self.reduce_backward(*r, dims, *keepdim, x[0], x[1], &out[0], p)?)
            }
            Op::Softmax | Op::SoftmaxBackward => {
                self.expect_f32(op, x)?;
                let xs: Vec<CudaTensor> = x.iter().map(|t| self.dense(t)).collect::<Result<_>>()?;
                let y = self.new_out(&out[0], p)?;
                let cols = *y.dims().last().unwrap_or(&1);
                let rows = y.numel() / cols.max(1);
                if matches!(op, Op::Softmax) {
                    launch(
                        g,
                        "softmax",
                        per_row(rows),
                        &[Arg::Ptr(xs[0].ptr()), Arg::Ptr(y.ptr()), Arg::I64(cols as i64)],
                    )?;
                } else {
                    launch(
                        g,
                        "softmax_backward",
                        per_row(rows),
                        &[
                            Arg::Ptr(xs[0].ptr()),
                            Arg::Ptr(xs[1].ptr()),
                            Arg::Ptr(y.ptr()),
                            Arg::I64(cols as i64),
                        ],
                    )?;
                }
                one(y)
            }
            Op::Reshape(s) => {
                let src = if x[0].is_contiguous() {
                    x[0].clone()
                } else {
                    self.copy(x[0], Purpose::Scratch)?
                };
                one(src.reshaped(s.dims()))
            }
            Op::Expand(s) => one(x[0].broadcast(s.dims())?),
            Op::Permute(perm) => {
                let v = CudaTensor {
                    dims: perm.iter().map(|&i| x[0].dims[i]).collect(),
                    strides: perm.iter().map(|&i| x[0].strides[i]).collect(),
                    ..x[0].clone()
                };
                one(self.copy(&v, p)?)
            }
            Op::Slice { dim, start, end } => {
                let mut v = x[0].clone();
                v.offset += start * v.strides[*dim];
                v.dims[*dim] = end - start;
                one(self.copy(&v, p)?)
            }
            Op::Pad { dim, before, .. } => {
                let y = self.new_out(&out[0], p)?;
                self.fill(&y, 0.0)?;
                let mut ly = Layout { ndim: x[0].dims().len() as i32, ..Default::default() };
                let strides = row_major(y.dims());
                for (i, &d) in x[0].dims().iter().enumerate() {
                    ly.dims[i] = d as i64;
                    ly.strides[i] = strides[i] as i64;
                }
                ly.offset = (before * strides[*dim]) as i64;
                self.copy_into(x[0], &y, ly)?;
                one(y)
            }
            Op::Concat { dim } => {
                let y = self.new_out(&out[0], p)?;
                let strides = row_major(y.dims());
                let mut at_dim = 0;
                for t in x {
                    let mut ly = Layout { ndim: t.dims().len() as i32, ..Default::default() };
                    for (i, &d) in t.dims().iter().enumerate() {
                        ly.dims[i] = d as i64;
                        ly.strides[i] = strides[i] as i64;
                    }
                    ly.offset = (at_dim * strides[*dim]) as i64;
                    self.copy_into(t, &y, ly)?;
                    at_dim += t.dims()[*dim];
                }
                one(y)
            }
            Op::LayerNorm { eps } => one(self.norm(x[0], x[1], Some(x[2]), *eps, &out[0], p)?),
            Op::RmsNorm { eps } => one(self.norm(x[0], x[1], None, *eps, &out[0], p)?),
            Op::LayerNormBackward { eps } => {
                self.norm_backward(x[0], x[1], x[2], *eps, false, out, p)
            }
            Op::RmsNormBackward { eps } => self.norm_backward(x[0], x[1], x[2], *eps, true, out, p),
            Op::Embedding { rows } => {
                self.expect_f32(op, &x[..1])?;
                let (table, ids) = (self.dense(x[0])?, self.dense(x[1])?);
                let local = table.dims().first().copied().unwrap_or(0);
                let r = TableRows::of(rows.as_ref(), local, Some(at))?;
                let y = self.new_out(&out[0], p)?;
                let dim = *table.dims().last().unwrap_or(&1);
                let n = y.numel();
                launch(
                    g,
                    "embedding",
                    elementwise(n),
                    &[
                        Arg::Ptr(table.ptr()),
                        Arg::Ptr(ids.ptr()),
                        Arg::Ptr(y.ptr()),
                        Arg::I64(dim as i64),
                        Arg::I64(r.first as i64),
                        Arg::I64(r.count as i64),
                        Arg::I64(n as i64),
                    ],
                )?;
                one(y)
            }
            Op::EmbeddingBackward { num_embeddings, rows } => {
                self.expect_f32(op, &x[1..2])?;
                let (ids, dy) = (self.dense(x[0])?, self.dense(x[1])?);
                let r = TableRows::of(rows.as_ref(), *num_embeddings, Some(at))?;
                let y = self.new_out(&out[0], p)?;
                self.fill(&y, 0.0)?;
                let dim = *y.dims().last().unwrap_or(&1);
                let n = dy.numel();
                launch(
                    g,
                    "embedding_backward",
                    elementwise(n),
                    &[
                        Arg::Ptr(ids.ptr()),
                        Arg::Ptr(dy.ptr()),
                        Arg::Ptr(y.ptr()),
                        Arg::I64(dim as i64),
                        Arg::I64(r.first as i64),
                        Arg::I64(r.count as i64),
                        Arg::I64(n as i64),
                    ],
                )?;
                one(y)
            }
            Op::CrossEntropy { ignore_index, sum, classes } => crate::loss::cross_entropy(
                self,
                x,
                *ignore_index,
                *sum,
                classes.as_ref(),
                at,
                out,
                p,
            ),
            Op::CrossEntropyBackward { ignore_index, sum, classes } => {
                one(crate::loss::cross_entropy_backward(
                    self,
                    x,
                    *ignore_index,
                    *sum,
                    classes.as_ref(),
                    at,
                    &out[0],
                    p,
                )?)
            }
            Op::LogSumExp => one(crate::loss::logsumexp(self, x[0], &out[0], p)?),
            Op::LinearCrossEntropy { chunk_rows, ignore_index } => {
                crate::linear_loss::forward(self, x, *chunk_rows, *ignore_index, at, out, p)
            }
            Op::LinearCrossEntropyBackward { chunk_rows, ignore_index } => {
                crate::linear_loss::backward(self, x, *chunk_rows, *ignore_index, at, out, p)
            }
            // The tiled MLP has no CUDA composition yet: plans for a GPU keep the MLP whole
            // (`mlp=whole`), which the planner's choice does for CUDA clusters.
            Op::TiledMlp(_) | Op::TiledMlpBackward(_) => Err(unsupported(
                op.name(),
                "the tiled MLP (mlp=tileN) runs on the CPU backend only; plan with mlp=whole",
            )),
            Op::Attention(spec) => crate::attention::forward(self, x, spec, at, out, p),
            Op::AttentionBackward(spec) => crate::attention::backward(self, x, spec, at, out, p),
            Op::AttentionMerge => one(crate::ring::merge(self, x, &out[0], p)?),
            Op::AttentionMergeBackward => crate::ring::merge_backward(self, x, out, p),
            Op::RingMerge(_) => crate::ring::ring_merge(self, x, out, p),
            Op::Rope { inv_freq, inverse } => one(crate::attention::rope(
                self,
                x[0],
                x.get(1).copied(),
                inv_freq,
                *inverse,
                &out[0],
                p,
            )?),
            Op::AdamW(spec) => crate::optim::adamw(self, spec, x),
            Op::Transfer { .. } => one(self.copy(x[0], p)?),
            Op::Reshard(spec) if spec.forward.iter().all(|s| s.size == 1) => one(x[0].clone()),
            Op::CacheWrite | Op::SelectPositions | Op::QMatMul(_) | Op::QMatMulBackward(_) => {
                crate::infer::run(self, op, x, out, p)
            }
            Op::Conv2d(_)
            | Op::Conv2dBackwardInput { .. }
            | Op::Conv2dBackwardWeight { .. }
            | Op::GroupNorm { .. }
            | Op::GroupNormBackward { .. }
            | Op::MaxPool2d(_)
            | Op::MaxPool2dBackward(_)
            | Op::AvgPool2d { .. }
            | Op::AvgPool2dBackward { .. }
            | Op::Upsample2d { .. }
            | Op::Upsample2dBackward { .. } => crate::vision::run(self, op, x, out, p),
            Op::TopK { .. }
            | Op::TakeAlong
            | Op::ScatterAlong { .. }
            | Op::MoeSlots { .. }
            | Op::MoeDispatch { .. }
            | Op::MoeCombine
            | Op::MoeSlotDot => crate::moe::run(self, op, x, out, p),
            Op::Send(_) | Op::Recv(..) | Op::Reshard(_) => Err(bad(
                "a transfer between devices needs a communicator: run the plan with the SPMD \
                 runtime"
                    .into(),
            )),
        }
    }

    pub(crate) fn out_f32(&self, m: &TensorMeta, p: Purpose) -> Result<CudaTensor> {
        self.new_out(m, p)
    }
    pub(crate) fn dense_pub(&self, x: &CudaTensor) -> Result<CudaTensor> {
        self.dense(x)
    }
    pub(crate) fn fill_pub(&self, y: &CudaTensor, v: f64) -> Result<()> {
        self.fill(y, v)
    }
    /// `a op b` into a fresh tensor of `out`'s meta.
    pub(crate) fn binary(
        &self,
        b: tessera_ir::BinaryOp,
        x: &CudaTensor,
        y: &CudaTensor,
        out: &TensorMeta,
        p: Purpose,
    ) -> Result<CudaTensor> {
        let outs = std::slice::from_ref(out);
        let mut r = self.run(&Op::Binary(b), &[x, y], outs, &MeshPos::single(), p)?;
        r.pop().ok_or_else(|| bad("binary: no output".into()))
    }
    /// Copies `x` into `y`, a contiguous view (of x's element count) into a larger tensor.
    pub(crate) fn copy_rows(&self, x: &CudaTensor, y: &CudaTensor) -> Result<()> {
        if x.numel() != y.numel() {
            return Err(bad(format!("copy of {} into {}", x.meta(), y.meta())));
        }
        let y = y.reshaped(x.dims());
        self.copy_into(x, &y, y.layout()?)
    }
}

/// The attention spec's checks shared by forward and backward.
pub(crate) fn geometry(q: &CudaTensor, k: &CudaTensor, spec: &AttentionSpec) -> Result<Attn> {
    let (&[b, s, h, d], &[_, t, hkv, _]) = (q.dims(), k.dims()) else {
        return Err(bad(format!(
            "attention: q {:?} and k {:?} must be [B,S,H,D]",
            q.dims(),
            k.dims()
        )));
    };
    // Past the KV heads, k/v hold every KV head and q some query heads (module `attention`).
    if hkv == 0 || (h % hkv != 0 && spec.kv_whole.is_none()) {
        return Err(bad(format!("attention: {h} query heads over {hkv} kv heads")));
    }
    Ok(Attn {
        b: b as i64,
        s: s as i64,
        t: t as i64,
        h: h as i64,
        hkv: hkv as i64,
        d: d as i64,
        causal: i32::from(spec.causal),
        window: spec.window.unwrap_or(0) as i64,
        scale: spec.scale as f32,
    })
}
