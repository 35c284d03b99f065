//! A counting global allocator: current and peak heap bytes of the whole process, used to
//! check the memory accountant against reality. A binary opts in with
//! `#[global_allocator] static A: CountingAlloc = CountingAlloc;`.
//!
//! It also keeps freed large blocks ([`BlockCache`]): a training step frees and allocates
//! the same activation and gradient sizes every step, and a block handed back to the OS and
//! mapped again costs a page fault per 4 KiB page on its first write (plus the kernel's
//! zeroing) — about 650,000 faults per GPT-2 step at batch 4 × 256, a fifth of the step. The
//! counts are unaffected: a cached block is freed as far as [`current_bytes`] and
//! [`peak_bytes`] are concerned.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};

/// Flushed heap bytes: the sum of what every shard has handed on.
static CURRENT: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// Bytes a shard may hold back before handing them on to [`CURRENT`]. One counter shared by
/// every thread made each allocation a contended read-modify-write of one cache line (a
/// quarter of the planner's time on two threads); a shard per thread is touched by its own
/// thread only. The price: the peak is seen at flushes (when it sums every shard), so it may
/// miss an excursion of up to this much per thread between two — nothing next to the tensors
/// it is there to count, which (at this size or more) flush at once. [`current_bytes`] is
/// exact.
const HOLD: isize = 64 << 10;
const SHARDS: usize = 64;

/// One counter per cache line.
#[repr(align(128))]
struct Shard(AtomicIsize);

static SHARD: [Shard; SHARDS] = [const { Shard(AtomicIsize::new(0)) }; SHARDS];
static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    // No destructor: safe to touch from inside the allocator. A shard outlives its thread, so
    // bytes a thread held back are never lost (another thread may reuse the shard later).
    static MY_SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn shard() -> &'static AtomicIsize {
    let i = MY_SHARD
        .try_with(|c| {
            if c.get() == usize::MAX {
                c.set(NEXT_SHARD.fetch_add(1, Ordering::Relaxed) % SHARDS);
            }
            c.get()
        })
        .unwrap_or(0);
    &SHARD[i].0
}

pub struct CountingAlloc;

// SAFETY: forwards to the system allocator; large blocks may be kept on free and handed out
// again for a request of exactly their size and alignment (the block a `System.alloc` of that
// layout returned, so every contract of the layout holds); only adds relaxed counters.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = match BlockCache::take(layout) {
            Some(p) => p,
            None => unsafe { System.alloc(layout) },
        };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = match BlockCache::take(layout) {
            Some(p) => {
                // SAFETY: a live block of `layout.size()` bytes, exclusively ours now.
                unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
                p
            }
            None => unsafe { System.alloc_zeroed(layout) },
        };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !BlockCache::keep(ptr, layout) {
            unsafe { System.dealloc(ptr, layout) };
        }
        count(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size().max(new_size) >= BlockCache::MIN {
            // Through alloc + dealloc, so the cache's books see both blocks.
            // SAFETY: the caller guarantees `new_size`, rounded up to `align`, fits an isize.
            let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
            let p = unsafe { self.alloc(new_layout) };
            if !p.is_null() {
                // SAFETY: both blocks are live and distinct; copy what both hold.
                unsafe { std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size)) };
                unsafe { self.dealloc(ptr, layout) };
            }
            return p;
        }
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// Freed blocks of at least [`BlockCache::MIN`] bytes, kept for the next request of the same
/// size and alignment. Bounded by the allocator's own high-water mark: live large blocks plus
/// cached ones never exceed the most live large-block bytes seen, so the cache holds no more
/// memory than the process has already shown it needs (a request the cache cannot serve
/// first returns cached blocks to the system until that holds again).
pub struct BlockCache {
    /// `(size, align, address)`; `size == 0` marks an empty slot.
    slots: [(usize, usize, usize); BlockCache::SLOTS],
    cached: usize,
    live: usize,
    peak: usize,
}

static CACHE: std::sync::Mutex<BlockCache> = std::sync::Mutex::new(BlockCache {
    slots: [(0, 0, 0); BlockCache::SLOTS],
    cached: 0,
    live: 0,
    peak: 0,
});

impl BlockCache {
    /// Smallest block kept: below this, the system allocator's own free lists serve well.
    pub const MIN: usize = 1 << 20;
    const SLOTS: usize = 1024;

    fn lock() -> Option<std::sync::MutexGuard<'static, BlockCache>> {
        // A poisoned lock (a panic while holding it: none can happen in these few lines) just
        // stops caching.
        CACHE.lock().ok()
    }

    /// A cached block for `layout`, if one is kept; records the request either way.
    fn take(layout: Layout) -> Option<*mut u8> {
        let size = layout.size();
        if size < Self::MIN {
            return None;
        }
        let mut c = Self::lock()?;
        c.live += size;
        if let Some(i) = c.slots.iter().position(|s| s.0 == size && s.1 == layout.align()) {
            let (_, _, addr) = std::mem::take(&mut c.slots[i]);
            c.cached -= size;
            return Some(addr as *mut u8);
        }
        c.peak = c.peak.max(c.live);
        // Make room: live + cached stays within the high-water mark.
        let mut i = 0;
        while c.live + c.cached > c.peak && i < Self::SLOTS {
            let (sz, al, addr) = c.slots[i];
            if sz != 0 {
                c.slots[i] = (0, 0, 0);
                c.cached -= sz;
                if let Ok(l) = Layout::from_size_align(sz, al) {
                    // SAFETY: a block `System.alloc` returned for exactly this layout, freed
                    // by its owner and held only here.
                    unsafe { System.dealloc(addr as *mut u8, l) };
                }
            }
            i += 1;
        }
        None
    }

    /// Keeps a freed block; false when the caller must free it.
    fn keep(ptr: *mut u8, layout: Layout) -> bool {
        let size = layout.size();
        if size < Self::MIN {
            return false;
        }
        let Some(mut c) = Self::lock() else { return false };
        c.live = c.live.saturating_sub(size);
        let Some(i) = c.slots.iter().position(|s| s.0 == 0) else { return false };
        c.slots[i] = (size, layout.align(), ptr as usize);
        c.cached += size;
        true
    }

    /// Bytes held in cached blocks (free as far as the counts go, but resident).
    pub fn cached_bytes() -> u64 {
        Self::lock().map_or(0, |c| c.cached as u64)
    }
}

fn count(delta: isize) {
    let s = shard();
    let held = s.fetch_add(delta, Ordering::Relaxed) + delta;
    if held.abs() < HOLD {
        return;
    }
    let held = s.swap(0, Ordering::Relaxed);
    CURRENT.fetch_add(held, Ordering::Relaxed);
    // The whole count, other shards included: a thread that exited holding bytes back would
    // otherwise skew every later peak. Rare (once per `HOLD` bytes of churn), so affordable.
    let now = current_bytes() as usize;
    // Read before the read-modify-write: the peak rarely moves.
    if now > PEAK.load(Ordering::Relaxed) {
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

/// Heap bytes currently allocated, exactly (0 unless `CountingAlloc` is the global allocator).
pub fn current_bytes() -> u64 {
    let held: isize = SHARD.iter().map(|s| s.0.load(Ordering::Relaxed)).sum();
    (CURRENT.load(Ordering::Relaxed) + held).max(0) as u64
}

/// Highest heap bytes since the last [`reset_peak`].
pub fn peak_bytes() -> u64 {
    PEAK.load(Ordering::Relaxed) as u64
}

/// Restarts peak tracking from the current heap size.
pub fn reset_peak() {
    PEAK.store(current_bytes() as usize, Ordering::Relaxed);
}

/// True when the counting allocator is installed (something is counted).
pub fn is_counting() -> bool {
    current_bytes() > 0
}
