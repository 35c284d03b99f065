//! One GPU: its context and stream, the NVRTC-compiled kernel module, a cuBLAS handle and the
//! caching allocator. Opening it loads the driver at run time, so a machine without one gets
//! an error naming what is missing rather than a crash.

use crate::alloc::{AllocStats, Block, CachingAllocator, Purpose, RawMemory};
use crate::source::KERNELS;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DriverError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tessera_runtime::{Result, RuntimeError};

/// Device memory from the driver (`cuMemAlloc` / `cuMemFree`).
pub struct DriverMemory {
    ctx: Arc<CudaContext>,
}

impl RawMemory for DriverMemory {
    type Error = DriverError;
    fn alloc(&mut self, bytes: u64) -> std::result::Result<u64, DriverError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: a plain allocation in the bound context; freed in `free`.
        unsafe { cudarc::driver::result::malloc_sync(bytes as usize) }
    }
    fn free(&mut self, addr: u64, _bytes: u64) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `addr` came from `alloc` and no tensor refers to it any more.
            let _ = unsafe { cudarc::driver::result::free_sync(addr) };
        }
    }
}

/// A cuBLAS handle (a raw pointer, used from one thread at a time under the GPU's lock).
pub(crate) struct Blas(pub cudarc::cublas::sys::cublasHandle_t);
// SAFETY: the handle is only used while holding `Gpu::blas`'s mutex.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `create_handle` and is dropped once.
        let _ = unsafe { cudarc::cublas::result::destroy_handle(self.0) };
    }
}

pub struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: HashMap<&'static str, CudaFunction>,
    pub(crate) blas: Mutex<Blas>,
    alloc: Mutex<CachingAllocator<DriverMemory>>,
    name: String,
    ordinal: usize,
    /// Compute capability (major, minor): the flash kernels need 8.0 (tensor-core bf16 MMA).
    capability: (i32, i32),
}

/// Runs `f`, which may load the driver: with dynamic loading a missing library is a panic
/// inside cudarc, which `f` turns into an error; the default hook is kept from printing it
/// meanwhile. The panic hook is global: one such call at a time (ranks open their GPUs from
/// threads), each restoring the hook it found.
fn quietly<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    static OPENING: Mutex<()> = Mutex::new(());
    let _one = OPENING.lock().unwrap_or_else(|p| p.into_inner());
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let out = f();
    std::panic::set_hook(hook);
    out
}

fn no_driver() -> RuntimeError {
    RuntimeError::Binding(
        "cuda: the NVIDIA driver library (libcuda.so) was not found: run on a machine with an \
         NVIDIA GPU and driver, or use the CPU (drop --device cuda)"
            .into(),
    )
}

fn driver_err(what: &str, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Binding(format!("cuda: {what}: {e}"))
}

/// The kernels the backend launches (each an `extern "C"` function of the `.cu` sources, `source::KERNELS`).
pub const FUNCTIONS: &[&str] = &[
    "cast",
    "copy_strided",
    "fill_bits",
    "unary",
    "unary_backward",
    "binary",
    "binary_backward",
    "dropout",
    "reduce",
    "reduce_backward",
    "softmax",
    "softmax_backward",
    "norm_forward",
    "norm_backward_dx",
    "norm_backward_dx1",
    "norm_dw_partial",
    "norm_dw_partial8",
    "reduce_cols_partial",
    "reduce_partial",
    "reduce_partials",
    "reduce_partials_block",
    "embedding",
    "embedding_backward",
    "cross_entropy_rows",
    "sum_to_scalar",
    "cross_entropy_backward",
    "adamw",
    "rope",
    "attention_delta",
    "attn_softmax",
    "attn_grad_scores",
    "flash_fwd_32",
    "flash_fwd_64",
    "flash_fwd_128",
    "flash_bwd_32",
    "flash_bwd_64",
    "flash_bwd_128",
    "flash_delta",
    "scale_store",
];

impl Gpu {
    /// Opens GPU `ordinal`: loads the driver, NVRTC and cuBLAS, compiles the kernels for the
    /// device's architecture.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        quietly(|| Self::open_quiet(ordinal))
    }

    /// The number of GPUs the driver sees (an error naming the missing driver where there is
    /// none): what ranks sharing GPUs are spread over.
    pub fn count() -> Result<usize> {
        quietly(|| {
            std::panic::catch_unwind(CudaContext::device_count)
                .map_err(|_| no_driver())?
                .map(|n| n.max(0) as usize)
                .map_err(|e| driver_err("counting the GPUs", e))
        })
    }

    fn open_quiet(ordinal: usize) -> Result<Arc<Gpu>> {
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| no_driver())?
            .map_err(|e| driver_err(&format!("opening GPU {ordinal}"), e))?;
        let (major, minor) =
            ctx.compute_capability().map_err(|e| driver_err("compute capability", e))?;
        let opts = cudarc::nvrtc::CompileOptions {
            options: vec![
                format!("--gpu-architecture=compute_{major}{minor}"),
                "--std=c++17".into(),
            ],
            ..Default::default()
        };
        let ptx = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts))
            .map_err(|_| {
                RuntimeError::Binding(
                    "cuda: NVRTC (libnvrtc.so) was not found: add the CUDA toolkit's lib64 \
                     directory to LD_LIBRARY_PATH"
                        .into(),
                )
            })?
            .map_err(|e| driver_err("compiling the kernels with NVRTC", format!("{e:?}")))?;
        let module = ctx.load_module(ptx).map_err(|e| driver_err("loading the kernels", e))?;
        let mut funcs = HashMap::new();
        for &f in FUNCTIONS.iter().chain(crate::vision::FUNCTIONS).chain(crate::infer::FUNCTIONS) {
            let func = module.load_function(f).map_err(|e| driver_err(f, e))?;
            funcs.insert(f, func);
        }
        if major >= 8 {
            // The flash kernels' tiles live in dynamic shared memory, past the default 48 KiB
            // for head dim 128.
            for (f, bytes) in crate::flash::SHARED_BYTES {
                if let Some(func) = funcs.get(f) {
                    func.set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        bytes as i32,
                    )
                    .map_err(|e| driver_err(f, e))?;
                }
            }
        }
        let stream = ctx.default_stream();
        let blas = std::panic::catch_unwind(cudarc::cublas::result::create_handle)
            .map_err(|_| {
                RuntimeError::Binding(
                    "cuda: cuBLAS (libcublas.so) was not found: add the CUDA toolkit's lib64 \
                     directory to LD_LIBRARY_PATH"
                        .into(),
                )
            })?
            .map_err(|e| driver_err("creating a cuBLAS handle", format!("{e:?}")))?;
        // SAFETY: a fresh handle and the context's stream.
        unsafe { cudarc::cublas::result::set_stream(blas, stream.cu_stream() as _) }
            .map_err(|e| driver_err("cuBLAS stream", format!("{e:?}")))?;
        let name = ctx.name().unwrap_or_else(|_| "NVIDIA GPU".into());
        Ok(Arc::new(Gpu {
            alloc: Mutex::new(CachingAllocator::new(DriverMemory { ctx: ctx.clone() })),
            ctx,
            stream,
            _module: module,
            funcs,
            blas: Mutex::new(Blas(blas)),
            name,
            ordinal,
            capability: (major, minor),
        }))
    }

    /// The device's marketing name (`NVIDIA H100 80GB HBM3`).
    pub fn device_name(&self) -> &str {
        &self.name
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Compute capability (major, minor).
    pub fn capability(&self) -> (i32, i32) {
        self.capability
    }

    pub(crate) fn func(&self, name: &'static str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| RuntimeError::Binding(format!("cuda: kernel {name} is not loaded")))
    }

    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| driver_err("binding the context", e))
    }

    pub(crate) fn alloc(&self, bytes: u64, purpose: Purpose) -> Result<Block> {
        self.bind()?;
        let mut a = self.alloc.lock().map_err(|_| poisoned())?;
        a.alloc(bytes, purpose).map_err(|e| {
            let s = a.stats();
            RuntimeError::Binding(format!(
                "cuda: out of device memory allocating {bytes} bytes on {} ({} bytes of tensors \
                 live, {} reserved): {e}",
                self.name,
                s.program.current + s.scratch.current,
                s.reserved.current
            ))
        })
    }

    pub(crate) fn release(&self, b: Block) {
        if let Ok(mut a) = self.alloc.lock() {
            a.release(b);
        }
    }

    /// The allocator's books (live, peak and reserved bytes).
    pub fn memory(&self) -> AllocStats {
        self.alloc.lock().map(|a| a.stats()).unwrap_or_default()
    }

    /// A run of a Program starts: the allocator records it and serves it from the last run's
    /// plan while it matches ([`crate::alloc::CachingAllocator::begin_step`]).
    pub fn begin_step(&self) {
        if let Ok(mut a) = self.alloc.lock() {
            a.begin_step();
        }
    }

    /// A run has ended: the allocator keeps or makes its plan.
    pub fn end_step(&self) {
        if let Ok(mut a) = self.alloc.lock() {
            a.end_step();
        }
    }

    /// Restarts the allocator's peaks.
    pub fn reset_peaks(&self) {
        if let Ok(mut a) = self.alloc.lock() {
            a.reset_peaks();
        }
    }

    /// Returns cached blocks to the driver.
    pub fn empty_cache(&self) {
        if let Ok(mut a) = self.alloc.lock() {
            a.empty_cache();
        }
    }

    /// Waits for all queued work (and reports an asynchronous kernel error).
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.stream.synchronize().map_err(|e| driver_err("synchronize", e))
    }

    /// Free and total device memory, as the driver reports it.
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        self.bind()?;
        let (f, t) =
            cudarc::driver::result::mem_get_info().map_err(|e| driver_err("memory info", e))?;
        Ok((f as u64, t as u64))
    }
}

fn poisoned() -> RuntimeError {
    RuntimeError::Binding("cuda: the allocator's lock was poisoned by a panic".into())
}
