//! One GPU: its context and stream, the NVRTC-compiled kernel module, cuBLAS and cuBLASLt
//! handles and the caching allocator. Opening it loads the driver at run time, so a machine
//! without one gets an error naming what is missing rather than a crash.

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
    /// cuBLASLt: handle, workspace and a plan per GEMM problem (`gemm.rs`), made on first use.
    pub(crate) lt: Mutex<crate::gemm::LtState>,
    alloc: Mutex<CachingAllocator<DriverMemory>>,
    name: String,
    ordinal: usize,
    /// Compute capability (major, minor): the flash kernels need 8.0 (tensor-core bf16 MMA).
    capability: (i32, i32),
    /// The kernels whose dynamic shared memory was raised past the default (the flash
    /// kernels; the second flash backward only where the device allows its tiles per block).
    shared: Vec<&'static str>,
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
    "dropout_sharded",
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
    "cross_entropy_targets",
    "logsumexp_rows",
    "cross_entropy_backward",
    "adamw",
    "rope",
    "attention_delta",
    "attn_softmax",
    "attn_grad_scores",
    "attn_merge",
    "attn_merge_backward",
    "ring_lse",
    "flash_fwd_32",
    "flash_fwd_64",
    "flash_fwd_128",
    "flash_bwd_32",
    "flash_bwd_64",
    "flash_bwd_128",
    "flash_bwd2_64",
    "flash_bwd2_128",
    "flash_delta",
    "scale_store",
];

/// What the driver says of a GPU, before anything is compiled on it.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuInfo {
    /// The marketing name (`NVIDIA H200`).
    pub name: String,
    pub total_bytes: u64,
    /// Free now: what other processes (and this one) have not taken.
    pub free_bytes: u64,
}

/// The panic hook is global, and cudarc's dynamic loading panics on a missing library: one
/// driver call of this kind at a time (ranks open their GPUs from threads), each run with a
/// silent hook and the hook it found restored.
fn quietly<T>(f: impl FnOnce() -> T) -> T {
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

fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    std::panic::catch_unwind(|| CudaContext::new(ordinal))
        .map_err(|_| no_driver())?
        .map_err(|e| driver_err(&format!("opening GPU {ordinal}"), e))
}

/// Where compiled kernels are kept between processes: `$TESSERA_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/tessera/kernels`, else `~/.cache/tessera/kernels`.
fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
    if let Some(p) = var("TESSERA_KERNEL_CACHE") {
        return Some(p);
    }
    let base = var("XDG_CACHE_HOME")
        .filter(|p| p.is_absolute())
        .or_else(|| var("HOME").map(|h| h.join(".cache")))?;
    Some(base.join("tessera").join("kernels"))
}

/// The PTX file of these options in the kernel cache: named by an FNV-1a hash of the source
/// and the options, so an edited kernel or another architecture never reads a stale file.
fn cached_ptx_path(options: &[String]) -> Option<std::path::PathBuf> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in KERNELS.bytes().chain(options.join(" ").bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    kernel_cache_dir().map(|d| d.join(format!("tessera-{h:016x}.ptx")))
}

/// Writes `text` beside `path` and renames it over, so a reader never sees half a file; a
/// cache that cannot be written is only a cache (the next process compiles again).
fn write_cache(path: &std::path::Path, text: &str) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, text).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// The kernels compiled for one architecture, kept for the process (ranks that share a GPU
/// load the module without compiling it again) and on disk ([`kernel_cache_dir`]: the next
/// process skips NVRTC's seconds). `fresh` ignores the disk (a cached file the driver
/// refused).
fn compiled(major: i32, minor: i32, fresh: bool) -> Result<cudarc::nvrtc::Ptx> {
    type Cache = HashMap<(i32, i32), cudarc::nvrtc::Ptx>;
    static PTX: Mutex<Option<Cache>> = Mutex::new(None);
    let mut cache = PTX.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(ptx) = cache.as_ref().and_then(|c| c.get(&(major, minor))).filter(|_| !fresh) {
        return Ok(ptx.clone());
    }
    let options = vec![format!("--gpu-architecture=compute_{major}{minor}"), "--std=c++17".into()];
    let on_disk = cached_ptx_path(&options);
    if let Some(text) =
        on_disk.as_ref().filter(|_| !fresh).and_then(|p| std::fs::read_to_string(p).ok())
    {
        let ptx = cudarc::nvrtc::Ptx::from_src(text);
        cache.get_or_insert_with(HashMap::new).insert((major, minor), ptx.clone());
        return Ok(ptx);
    }
    let opts = cudarc::nvrtc::CompileOptions { options, ..Default::default() };
    let ptx = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts))
        .map_err(|_| {
            RuntimeError::Binding(
                "cuda: NVRTC (libnvrtc.so) was not found: add the CUDA toolkit's lib64 \
                 directory to LD_LIBRARY_PATH"
                    .into(),
            )
        })?
        .map_err(|e| driver_err("compiling the kernels with NVRTC", format!("{e:?}")))?;
    if let Some(path) = &on_disk {
        write_cache(path, &ptx.to_src());
    }
    cache.get_or_insert_with(HashMap::new).insert((major, minor), ptx.clone());
    Ok(ptx)
}

impl Gpu {
    /// Opens GPU `ordinal`: loads the driver, NVRTC and cuBLAS, compiles the kernels for the
    /// device's architecture. Its work goes to the device's default (legacy) stream.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        quietly(|| Self::open_quiet(ordinal, false))
    }

    /// Opens GPU `ordinal` as one of several devices that share it: a stream of its own (so
    /// the sharers' kernels interleave), its own caching allocator (its own books, as the
    /// memory accountant of its device keeps them), its own cuBLAS handle.
    pub fn open_shared(ordinal: usize) -> Result<Arc<Gpu>> {
        quietly(|| Self::open_quiet(ordinal, true))
    }

    /// The number of GPUs the driver sees (0 without one; an error without a driver).
    pub fn count() -> Result<usize> {
        quietly(|| {
            let n = std::panic::catch_unwind(CudaContext::device_count)
                .map_err(|_| no_driver())?
                .map_err(|e| driver_err("counting the GPUs", e))?;
            Ok(usize::try_from(n).unwrap_or(0))
        })
    }

    /// GPU `ordinal`'s name and memory, from the driver alone (nothing compiled).
    pub fn describe(ordinal: usize) -> Result<GpuInfo> {
        quietly(|| {
            let ctx = context(ordinal)?;
            ctx.bind_to_thread().map_err(|e| driver_err("binding the context", e))?;
            let name = ctx.name().unwrap_or_else(|_| "NVIDIA GPU".into());
            let (free, total) =
                cudarc::driver::result::mem_get_info().map_err(|e| driver_err("memory info", e))?;
            Ok(GpuInfo { name, total_bytes: total as u64, free_bytes: free as u64 })
        })
    }

    fn open_quiet(ordinal: usize, own_stream: bool) -> Result<Arc<Gpu>> {
        let ctx = context(ordinal)?;
        let (major, minor) =
            ctx.compute_capability().map_err(|e| driver_err("compute capability", e))?;
        let module = match ctx.load_module(compiled(major, minor, false)?) {
            Ok(m) => m,
            // A cached file the driver refuses (truncated, another driver's PTX): compile anew.
            Err(_) => ctx
                .load_module(compiled(major, minor, true)?)
                .map_err(|e| driver_err("loading the kernels", e))?,
        };
        let mut funcs = HashMap::new();
        let all = FUNCTIONS
            .iter()
            .chain(crate::vision::FUNCTIONS)
            .chain(crate::infer::FUNCTIONS)
            .chain(crate::moe::FUNCTIONS);
        for &f in all {
            let func = module.load_function(f).map_err(|e| driver_err(f, e))?;
            funcs.insert(f, func);
        }
        let mut shared = Vec::new();
        if major >= 8 {
            // The flash kernels' tiles live in dynamic shared memory, past the default 48 KiB
            // for head dim 128. The second backward's are larger than some devices allow a
            // block (the A100's 163 KiB): those keep the first backward.
            let optin = ctx
                .attribute(
                    cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )
                .map_err(|e| driver_err("shared memory per block", e))?;
            let optional = crate::flash::SHARED_BYTES2.iter().filter(|(_, b)| *b <= optin as usize);
            for &(f, bytes) in crate::flash::SHARED_BYTES.iter().chain(optional) {
                if let Some(func) = funcs.get(f) {
                    func.set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        bytes as i32,
                    )
                    .map_err(|e| driver_err(f, e))?;
                    shared.push(f);
                }
            }
        }
        let stream = if own_stream {
            ctx.new_stream().map_err(|e| driver_err("creating a stream", e))?
        } else {
            ctx.default_stream()
        };
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
            lt: Mutex::new(crate::gemm::LtState::default()),
            name,
            ordinal,
            capability: (major, minor),
            shared,
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

    /// Whether kernel `name`'s dynamic shared memory was set up (see [`Gpu::open`]).
    pub(crate) fn has_shared(&self, name: &str) -> bool {
        self.shared.contains(&name)
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

    /// Products cuBLASLt ran, and the plans (heuristic queries) it made for them: a repeated
    /// step makes no new plan.
    pub fn gemm_lt_counts(&self) -> (u64, u64) {
        self.lt.lock().map(|s| (s.calls, s.plans_made)).unwrap_or_default()
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
