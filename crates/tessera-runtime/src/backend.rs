//! The seam between "what to compute" and "where": a [`Backend`] runs one IR op on tensors of
//! its device. A backend's tensors are its own type ([`Backend::Value`]): the CPU backend's are
//! candle tensors with kernels written on host slices (rayon for threads, gemm for matrix
//! products); the CUDA backend (crate `tessera-cuda`) keeps device buffers from its caching
//! allocator. Values cross to and from the host only through [`Backend::upload`] and
//! [`Backend::download`] (binding leaves, reading the loss, saving checkpoints), so the
//! executor, the trainer and the generator are one code path for every device. The trait is
//! deliberately small: one entry point per node.

use crate::kernels;
use crate::tensor::candle_dtype;
use crate::Result;
use candle_core::{DType, Device, Tensor};
use tessera_ir::dist::MeshPos;
use tessera_ir::{DType as IrDType, Op, TensorMeta};

pub trait Backend: Send + Sync {
    /// A tensor resident on this backend's device. Clones share storage (a handle).
    type Value: Clone + Send + Sync;
    /// Human-readable device name used in errors (`cpu:0`, `cuda:0`).
    fn name(&self) -> &str;
    /// A host tensor's copy on the device (the same handle on the CPU).
    fn upload(&self, t: &Tensor) -> Result<Self::Value>;
    /// A device value's copy on the host (the same handle on the CPU).
    fn download(&self, v: &Self::Value) -> Result<Tensor>;
    /// The shape and dtype of a value.
    fn meta(&self, v: &Self::Value) -> Result<TensorMeta>;
    /// Executes `op` on `inputs`, returning one tensor per output with exactly the metas
    /// `outputs`. Outputs the IR declares as aliases (views, in-place updates) share their
    /// input's storage. `at` is the device's place in its mesh (a single device: the only
    /// device of a 1-device mesh).
    fn execute(
        &self,
        op: &Op,
        inputs: &[&Self::Value],
        outputs: &[TensorMeta],
        at: &MeshPos,
    ) -> Result<Vec<Self::Value>>;
    /// Called by the executor as a run of its Program starts and when it has ended: a backend
    /// may plan its memory from what a run asks for (the CUDA allocator packs a step's buffers
    /// into one arena after the first step). Nothing by default.
    fn run_started(&self) {}
    fn run_finished(&self) {}
    /// The most bytes of Program tensors the device's own allocator has held at once, where
    /// the backend keeps such books apart from the memory accountant (the CUDA caching
    /// allocator): the runtime reports it beside the accountant's peak, which it must equal.
    /// `None` where the accountant's books are the allocations (the CPU).
    fn allocator_peak_bytes(&self) -> Option<u64> {
        None
    }
}

/// Host CPU: candle tensors on `Device::Cpu`, kernels in [`crate::kernels`].
pub struct CpuBackend {
    name: String,
    device: Device,
    /// bf16 matrix products run on their bf16 operands (AMX tiles or `vdpbf16ps`, f32
    /// accumulation) rather than on f32 upcasts: the default where the CPU has AMX-BF16,
    /// opt-in ([`CpuBackend::with_native_bf16`]) where it has only AVX512_BF16.
    bf16_gemm: bool,
}

impl CpuBackend {
    pub fn new(index: usize) -> CpuBackend {
        CpuBackend {
            name: format!("cpu:{index}"),
            device: Device::Cpu,
            // On by default where the CPU has AMX tiles (several times the f32 GEMM); off where
            // it has only `vdpbf16ps`: `gemm`'s AVX-512 f32 kernels on upcast operands
            // (104–132 GFLOP/s at 1024×768×3072 on 2 cores) beat that kernel (60 GFLOP/s) —
            // BENCHMARKS.md, CPU training throughput.
            bf16_gemm: kernels::Bf16Kernel::native().is_some_and(|k| k.beats_upcasting()),
        }
    }

    /// The same backend running bf16 matrix products on the bf16 kernel
    /// (`kernels::gemm_bf16`: AMX or `vdpbf16ps`) where the CPU has one (unchanged where it
    /// has not).
    pub fn with_native_bf16(self) -> CpuBackend {
        CpuBackend { bf16_gemm: kernels::Bf16Kernel::native().is_some(), ..self }
    }

    /// The same backend running bf16 matrix products like every other half-precision op:
    /// f32 upcasts of the operands, the f32 GEMM, the result rounded (what a CPU without
    /// AVX512_BF16 does; tests compare the two).
    pub fn upcasting_bf16(self) -> CpuBackend {
        CpuBackend { bf16_gemm: false, ..self }
    }

    /// Whether bf16 matrix products run natively on bf16 operands.
    pub fn native_bf16_gemm(&self) -> bool {
        self.bf16_gemm
    }

    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new(0)
    }
}

impl Backend for CpuBackend {
    type Value = Tensor;
    fn name(&self) -> &str {
        &self.name
    }
    fn upload(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn download(&self, v: &Tensor) -> Result<Tensor> {
        Ok(v.clone())
    }
    fn meta(&self, v: &Tensor) -> Result<TensorMeta> {
        crate::tensor::meta_of(v).ok_or_else(|| {
            crate::RuntimeError::Binding(format!("a {:?} tensor has no IR dtype", v.dtype()))
        })
    }
    fn execute(
        &self,
        op: &Op,
        inputs: &[&Tensor],
        outputs: &[TensorMeta],
        at: &MeshPos,
    ) -> Result<Vec<Tensor>> {
        if !needs_upcast(op, inputs)
            || (self.bf16_gemm && native_bf16(op, inputs))
            || computes_on_bf16(op, inputs, outputs)
        {
            return kernels::execute_at(op, inputs, outputs, at);
        }
        // Mixed precision on the CPU: bf16/f16 tensors are stored as such, and arithmetic
        // runs in f32 (the usual autocast semantics): upcast the inputs, compute, round the
        // outputs to their declared dtype.
        let up: Vec<Tensor> = inputs
            .iter()
            .map(|t| match t.dtype() {
                DType::BF16 | DType::F16 => kernels::convert_dtype(t, DType::F32),
                _ => Ok((*t).clone()),
            })
            .collect::<Result<_, _>>()?;
        let up_refs: Vec<&Tensor> = up.iter().collect();
        let f32_outputs: Vec<TensorMeta> = outputs
            .iter()
            .map(|m| match m.dtype {
                IrDType::BF16 | IrDType::F16 => {
                    TensorMeta { shape: m.shape.clone(), dtype: IrDType::F32 }
                }
                _ => m.clone(),
            })
            .collect();
        let outs = kernels::execute_at(op, &up_refs, &f32_outputs, at)?;
        outs.into_iter()
            .zip(outputs)
            .map(|(t, m)| {
                let want = candle_dtype(m.dtype);
                Ok(if t.dtype() == want { t } else { kernels::convert_dtype(&t, want)? })
            })
            .collect()
    }
}

/// Whether `op` must run through the f32 upcast path: it computes on a half-precision input.
fn needs_upcast(op: &Op, inputs: &[&Tensor]) -> bool {
    let half = inputs.iter().any(|t| matches!(t.dtype(), DType::BF16 | DType::F16));
    half && !takes_any_dtype(op)
}

/// Whether the CPU's bf16 kernels run `op` on these inputs as they are: a matrix product of
/// two bf16 operands (its output is the IR's declared dtype, written by the kernel).
fn native_bf16(op: &Op, inputs: &[&Tensor]) -> bool {
    matches!(op, Op::MatMul { .. }) && inputs.iter().all(|t| t.dtype() == DType::BF16)
}

/// Whether the CPU kernels compute `op` on these bf16 inputs into bf16 outputs as they are
/// (reading them exactly as f32 and rounding the result once, the bits of the upcast path):
/// binary and unary ops, the unary ops' backward, reductions, dropout, cross-entropy (bf16
/// logits).
fn computes_on_bf16(op: &Op, inputs: &[&Tensor], outputs: &[TensorMeta]) -> bool {
    let bf16 = |t: &&Tensor| t.dtype() == DType::BF16;
    let bf16_out = outputs.iter().all(|m| m.dtype == IrDType::BF16);
    match op {
        Op::Binary(_) | Op::Unary(_) | Op::UnaryBackward(_) | Op::Reduce { .. } => {
            inputs.iter().all(bf16) && bf16_out
        }
        // Its second input is the i64 seed.
        Op::Dropout { .. } => inputs.first().is_some_and(bf16) && bf16_out,
        // bf16 logits; targets are integers, a given log-sum-exp and dloss f32. The loss and
        // log-sum-exp come out f32, dlogits in the logits' dtype.
        Op::CrossEntropy { .. } | Op::CrossEntropyBackward { .. } => {
            let others_full =
                inputs.iter().skip(1).all(|t| !matches!(t.dtype(), DType::BF16 | DType::F16));
            inputs.first().is_some_and(bf16)
                && others_full
                && (matches!(op, Op::CrossEntropy { .. }) || bf16_out)
        }
        _ => false,
    }
}

/// The ops every backend runs on half-precision operands as they are, without the f32 upcast
/// of mixed precision: layout ops, fills and casts handle every dtype (and views must stay
/// views); AdamW updates bf16 parameters in place from its f32 master. A backend may add its
/// own (the CUDA backend's GEMMs take bf16).
pub fn takes_any_dtype(op: &Op) -> bool {
    matches!(
        op,
        Op::Reshape(_)
            | Op::Expand(_)
            | Op::Permute(_)
            | Op::Slice { .. }
            | Op::Pad { .. }
            | Op::Concat { .. }
            | Op::Fill { .. }
            | Op::Cast(_)
            | Op::AdamW(_)
            | Op::CacheWrite
            | Op::SelectPositions
    )
}
