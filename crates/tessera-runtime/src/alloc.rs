//! A counting global allocator: current and peak heap bytes of the whole process, used to
//! check the memory accountant against reality. A binary opts in with
//! `#[global_allocator] static A: CountingAlloc = CountingAlloc;`.

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

// SAFETY: forwards to the system allocator unchanged; only adds relaxed counters.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
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
