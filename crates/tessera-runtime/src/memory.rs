//! The per-device memory accountant: live bytes, peak, and an optional budget.
//!
//! The executor charges it exactly what the Program allocates — the fresh outputs of each
//! `Run` (and the kernel's declared workspace while it runs) — and credits it on each `Free`.
//! The profiler's simulation walks the same instructions, so the two peaks agree exactly; the
//! counting allocator ([`crate::alloc`]) checks that the real heap agrees too.

use crate::{Result, RuntimeError};

#[derive(Clone, Debug)]
pub struct MemoryAccountant {
    device: String,
    budget: Option<u64>,
    live: u64,
    peak: u64,
}

impl MemoryAccountant {
    pub fn new(device: impl Into<String>, budget: Option<u64>) -> MemoryAccountant {
        MemoryAccountant { device: device.into(), budget, live: 0, peak: 0 }
    }

    pub fn live_bytes(&self) -> u64 {
        self.live
    }
    pub fn peak_bytes(&self) -> u64 {
        self.peak
    }
    pub fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// Starts a new peak measurement from the current live bytes.
    pub fn reset_peak(&mut self) {
        self.peak = self.live;
    }

    /// Charges `bytes` for tensor `name` (scope `scope`), failing before anything is allocated
    /// if the budget would be exceeded.
    pub fn alloc(&mut self, bytes: u64, name: &str, scope: &str) -> Result<()> {
        let would_be = self.live + bytes;
        if let Some(budget) = self.budget {
            if would_be > budget {
                return Err(RuntimeError::OutOfMemory {
                    device: self.device.clone(),
                    tensor: name.to_string(),
                    scope: scope.to_string(),
                    bytes,
                    would_be,
                    budget,
                });
            }
        }
        self.live = would_be;
        self.peak = self.peak.max(self.live);
        Ok(())
    }

    /// Scratch memory held only while one kernel runs.
    pub fn touch_workspace(&mut self, bytes: u64, name: &str, scope: &str) -> Result<()> {
        self.alloc(bytes, name, scope)?;
        self.free(bytes);
        Ok(())
    }

    pub fn free(&mut self, bytes: u64) {
        debug_assert!(bytes <= self.live, "freeing more than is live");
        self.live -= bytes;
    }
}
