//! The caching device allocator. Device memory is taken from the driver in blocks and kept
//! when a tensor dies, so the next tensor of the same rounded size reuses it without a
//! driver call (a training step asks for the same sizes every step). Its books are the
//! memory accountant's: `allocated` counts the bytes of live tensors exactly as the Program's
//! accountant charges them (requested bytes, not rounded), split by [`Purpose`] so a
//! kernel's scratch (half-precision upcasts, workspaces) is reported beside, never inside,
//! the Program's figure. `reserved` is what the driver has given (rounded, cached included).
//!
//! The allocator is generic over [`RawMemory`] so its bookkeeping is tested on the CPU.

use std::collections::BTreeMap;

/// Granularity of cached blocks.
pub const ROUND: u64 = 512;

/// What a buffer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// A tensor of the Program (a bound leaf or a node's fresh output): the accountant's.
    Program,
    /// A kernel's temporary (upcast operands, statistics, attention workspace).
    Scratch,
}

/// Where blocks come from: the driver (`cuMemAlloc`) on a GPU, a counter in tests.
pub trait RawMemory {
    type Error;
    /// A block of exactly `bytes` (a multiple of [`ROUND`]); its device address.
    fn alloc(&mut self, bytes: u64) -> Result<u64, Self::Error>;
    fn free(&mut self, addr: u64, bytes: u64);
}

/// Current and peak bytes of one kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gauge {
    pub current: u64,
    pub peak: u64,
}

impl Gauge {
    fn add(&mut self, b: u64) {
        self.current += b;
        self.peak = self.peak.max(self.current);
    }
    fn sub(&mut self, b: u64) {
        self.current -= b;
    }
}

/// The allocator's books.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocStats {
    /// Live Program tensors, requested bytes.
    pub program: Gauge,
    /// Live scratch, requested bytes.
    pub scratch: Gauge,
    /// Bytes held from the driver (live and cached blocks, rounded).
    pub reserved: Gauge,
    /// Requests served from the cache / by the driver.
    pub hits: u64,
    pub misses: u64,
}

/// A block handed out: its address, rounded size, requested size and purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub addr: u64,
    pub rounded: u64,
    pub bytes: u64,
    pub purpose: Purpose,
}

pub struct CachingAllocator<R: RawMemory> {
    raw: R,
    /// Cached free blocks by rounded size.
    free: BTreeMap<u64, Vec<u64>>,
    stats: AllocStats,
}

pub fn rounded(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(ROUND) * ROUND
}

impl<R: RawMemory> CachingAllocator<R> {
    pub fn new(raw: R) -> CachingAllocator<R> {
        CachingAllocator { raw, free: BTreeMap::new(), stats: AllocStats::default() }
    }

    pub fn stats(&self) -> AllocStats {
        self.stats
    }

    /// Restarts the peaks from the current figures (the start of a step).
    pub fn reset_peaks(&mut self) {
        for g in [&mut self.stats.program, &mut self.stats.scratch, &mut self.stats.reserved] {
            g.peak = g.current;
        }
    }

    /// A block of at least `bytes`: a cached one of the same rounded size, else a fresh one
    /// from the driver; when the driver is out of memory, the cache is returned to it and the
    /// request tried once more.
    pub fn alloc(&mut self, bytes: u64, purpose: Purpose) -> Result<Block, R::Error> {
        let size = rounded(bytes);
        let cached = self.free.get_mut(&size).and_then(|v| v.pop());
        let addr = match cached {
            Some(a) => {
                self.stats.hits += 1;
                a
            }
            None => {
                self.stats.misses += 1;
                let a = match self.raw.alloc(size) {
                    Ok(a) => a,
                    Err(_) => {
                        self.empty_cache();
                        self.raw.alloc(size)?
                    }
                };
                self.stats.reserved.add(size);
                a
            }
        };
        match purpose {
            Purpose::Program => self.stats.program.add(bytes),
            Purpose::Scratch => self.stats.scratch.add(bytes),
        }
        Ok(Block { addr, rounded: size, bytes, purpose })
    }

    /// Returns a block to the cache.
    pub fn release(&mut self, b: Block) {
        match b.purpose {
            Purpose::Program => self.stats.program.sub(b.bytes),
            Purpose::Scratch => self.stats.scratch.sub(b.bytes),
        }
        self.free.entry(b.rounded).or_default().push(b.addr);
    }

    /// Gives every cached block back to the driver.
    pub fn empty_cache(&mut self) {
        for (size, addrs) in std::mem::take(&mut self.free) {
            for a in addrs {
                self.raw.free(a, size);
                self.stats.reserved.sub(size);
            }
        }
    }

    /// Bytes held in the cache (reserved but not live).
    pub fn cached_bytes(&self) -> u64 {
        self.free.iter().map(|(s, v)| s * v.len() as u64).sum()
    }

    pub fn raw(&self) -> &R {
        &self.raw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake device: addresses count up, a capacity can run out.
    struct Fake {
        next: u64,
        used: u64,
        cap: u64,
        frees: usize,
    }

    impl RawMemory for Fake {
        type Error = String;
        fn alloc(&mut self, bytes: u64) -> Result<u64, String> {
            if self.used + bytes > self.cap {
                return Err(format!("out of memory: {bytes}"));
            }
            self.used += bytes;
            self.next += bytes;
            Ok(self.next)
        }
        fn free(&mut self, _addr: u64, bytes: u64) {
            self.used -= bytes;
            self.frees += 1;
        }
    }

    fn fake(cap: u64) -> CachingAllocator<Fake> {
        CachingAllocator::new(Fake { next: 0, used: 0, cap, frees: 0 })
    }

    #[test]
    fn program_bytes_are_the_requested_bytes_and_blocks_are_reused() {
        let mut a = fake(1 << 20);
        let x = a.alloc(1000, Purpose::Program).unwrap();
        let y = a.alloc(24, Purpose::Scratch).unwrap();
        assert_eq!((x.rounded, y.rounded), (1024, 512));
        assert_eq!(a.stats().program.current, 1000);
        assert_eq!(a.stats().scratch.current, 24);
        assert_eq!(a.stats().reserved.current, 1536);
        a.release(x);
        assert_eq!(a.stats().program, Gauge { current: 0, peak: 1000 });
        // Same rounded size: the cached block comes back, no driver call.
        let z = a.alloc(1020, Purpose::Program).unwrap();
        assert_eq!(z.addr, x.addr);
        assert_eq!((a.stats().hits, a.stats().misses), (1, 2));
        assert_eq!(a.stats().reserved.current, 1536);
        assert_eq!(a.stats().program.peak, 1020, "the peak is the larger of 1000 and 1020");
        a.release(z);
        a.release(y);
        assert_eq!(a.cached_bytes(), 1536);
        a.reset_peaks();
        assert_eq!(a.stats().program.peak, 0);
    }

    #[test]
    fn out_of_memory_returns_the_cache_and_retries() {
        let mut a = fake(2048);
        let x = a.alloc(1024, Purpose::Program).unwrap();
        let y = a.alloc(1024, Purpose::Program).unwrap();
        a.release(x);
        a.release(y);
        // 2048 needs both cached 1024 blocks back from the cache.
        let z = a.alloc(2048, Purpose::Program).unwrap();
        assert_eq!(a.raw().frees, 2);
        assert_eq!(a.stats().reserved.current, 2048);
        a.release(z);
        // Truly too large: the driver's error comes through.
        assert!(a.alloc(4096, Purpose::Program).is_err());
    }
}
