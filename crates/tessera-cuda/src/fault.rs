//! Bad cross-entropy targets, found on the device without a host round trip.
//!
//! The CPU kernel checks every target before it computes (`tessera_runtime::kernels::
//! check_targets`). Doing the same on the GPU meant downloading the targets: a synchronous
//! copy that drains the queue, twice per training step (forward and backward). Instead the
//! loss kernels check the targets where they are:
//!
//! - every kernel that indexes by a target bounds it first (a bad one is never read through:
//!   its row's loss is NaN, its gradient row has no one-hot term), and the count of
//!   non-ignored targets the loss divides by is taken on the device;
//! - the first bad target of the first op that meets one is recorded in this backend's
//!   *fault word*, a few integers of device memory: `[op, flat position, target, classes,
//!   has_ignore, ignore]` (`op` 0: none);
//! - AdamW reads the word and leaves the parameters and optimizer state untouched while it is
//!   set, so a step with a bad target is never applied (the fp16 overflow skip's mechanism);
//! - the host reads the word at its next synchronisation anyway — [`CudaBackend::download`],
//!   which the trainer does for the loss right after the step's run, and the executor for any
//!   value it fetches mid-run — and returns the CPU's error, word for word, then clears it.
//!
//! So the error surfaces at the end of the step that met the bad target (or earlier), and the
//! step is not applied. The read costs one 48-byte copy after a download that has already
//! drained the queue, and only when a loss kernel ran since the last read.
//!
//! [`CudaBackend::download`]: tessera_runtime::Backend::download

use crate::gpu::Gpu;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tessera_runtime::{Result, RuntimeError};

/// i64 words of the fault record (`cross_entropy_targets` in `layers.cu`).
const WORDS: usize = 6;

/// The op codes the kernels record.
pub(crate) const FORWARD: i32 = 1;
pub(crate) const BACKWARD: i32 = 2;

/// One backend's fault word: allocated (zeroed) on first use, straight from the driver (it
/// outlives every step, so it stays out of the caching allocator's per-step books).
pub(crate) struct TargetFault {
    gpu: Arc<Gpu>,
    addr: Mutex<u64>,
    /// A loss kernel ran since the word was last read.
    armed: AtomicBool,
}

fn driver(what: &str, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Binding(format!("cuda: {what}: {e}"))
}

impl TargetFault {
    pub(crate) fn new(gpu: Arc<Gpu>) -> TargetFault {
        TargetFault { gpu, addr: Mutex::new(0), armed: AtomicBool::new(false) }
    }

    /// The word's device address for a loss kernel (allocating it the first time); the next
    /// [`TargetFault::check`] reads it.
    pub(crate) fn for_kernel(&self) -> Result<u64> {
        let mut addr = self.addr.lock().map_err(|_| poisoned())?;
        if *addr == 0 {
            self.gpu.bind()?;
            let bytes = WORDS * 8;
            // SAFETY: a plain allocation in the bound context, zeroed in stream order before
            // any kernel can read it; freed in `drop`.
            let a = unsafe { cudarc::driver::result::malloc_sync(bytes) }
                .map_err(|e| driver("allocating the cross-entropy fault word", e))?;
            // SAFETY: `a` holds `bytes` bytes.
            unsafe {
                cudarc::driver::result::memset_d8_async(a, 0, bytes, self.gpu.stream.cu_stream())
            }
            .map_err(|e| driver("clearing the cross-entropy fault word", e))?;
            *addr = a;
        }
        self.armed.store(true, Ordering::Release);
        Ok(*addr)
    }

    /// The word's address for AdamW to skip on (0, no check, before any loss kernel ran).
    pub(crate) fn for_update(&self) -> u64 {
        self.addr.lock().map_or(0, |a| *a)
    }

    /// After a synchronisation: the CPU's error for a recorded bad target (clearing the word),
    /// or nothing. Reads the device only when a loss kernel ran since the last check.
    pub(crate) fn check(&self) -> Result<()> {
        if !self.armed.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let addr = *self.addr.lock().map_err(|_| poisoned())?;
        if addr == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let mut w = [0i64; WORDS];
        // SAFETY: the word holds `WORDS` i64s; the copy waits for the kernels before it.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut w, addr) }
            .map_err(|e| driver("reading the cross-entropy fault word", e))?;
        if w[0] == 0 {
            return Ok(());
        }
        // SAFETY: as in `for_kernel`.
        unsafe {
            cudarc::driver::result::memset_d8_async(addr, 0, WORDS * 8, self.gpu.stream.cu_stream())
        }
        .map_err(|e| driver("clearing the cross-entropy fault word", e))?;
        Err(error(&w))
    }
}

/// The CPU kernel's error for a record.
fn error(w: &[i64; WORDS]) -> RuntimeError {
    let op = if w[0] == BACKWARD as i64 { "cross_entropy_backward" } else { "cross_entropy" };
    let classes = usize::try_from(w[3]).unwrap_or(0);
    let ignore = (w[4] != 0).then_some(w[5]);
    // The CPU's check on the one bad target gives its message, word for word.
    match tessera_runtime::kernels::check_targets(op, &[w[2]], classes, ignore) {
        Err(RuntimeError::Data(m)) => RuntimeError::Data(m.replacen(
            "(at flat position 0)",
            &format!("(at flat position {})", w[1]),
            1,
        )),
        Err(e) => e,
        Ok(_) => RuntimeError::Data(format!(
            "{op}: target {} (at flat position {}) is out of range for {classes} classes",
            w[2], w[1]
        )),
    }
}

fn poisoned() -> RuntimeError {
    RuntimeError::Binding("cuda: the cross-entropy fault word's lock was poisoned".into())
}

impl Drop for TargetFault {
    fn drop(&mut self) {
        let addr = self.addr.get_mut().map_or(0, |a| *a);
        if addr != 0 && self.gpu.bind().is_ok() {
            // SAFETY: allocated by `for_kernel`; no kernel refers to it once the backend is
            // gone (the free waits for the device).
            let _ = unsafe { cudarc::driver::result::free_sync(addr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record gives the CPU kernel's message for the same target and position.
    #[test]
    fn the_record_gives_the_cpus_message() {
        let targets = [3i64, -100, 7, 12, 2];
        for (ignore, op, code) in
            [(Some(-100), "cross_entropy", FORWARD), (None, "cross_entropy_backward", BACKWARD)]
        {
            let want = tessera_runtime::kernels::check_targets(op, &targets, 10, ignore);
            let (pos, t) = if ignore.is_some() { (3, 12) } else { (1, -100) };
            let w = [code as i64, pos, t, 10, i64::from(ignore.is_some()), ignore.unwrap_or(0)];
            assert_eq!(error(&w).to_string(), want.unwrap_err().to_string());
        }
    }
}
