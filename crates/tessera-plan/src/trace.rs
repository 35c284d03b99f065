//! What a search spent its time on, for `TESSERA_TRACE=1`: how many ILP bounds, LP
//! relaxations, MIPs, lowerings and finishes ran, and their seconds summed over threads (so
//! they may exceed the wall time). Counted always (a relaxed add per call, next to
//! milliseconds of work); `tessera plan` prints them under trace. A process's whole life is
//! counted: the figures of one `tessera plan` are its search's.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// A kind of work the search does many times.
#[derive(Clone, Copy, Debug)]
pub enum Work {
    /// Min-sum diffusion's bound and plan (`ilp/diffusion.rs`).
    Diffusion,
    /// An LP relaxation HiGHS solved (a bound, or the first plan's rounding).
    Relaxation,
    /// A MIP HiGHS solved (RENS, the full cost MIP, or the least-peak one).
    Mip,
    /// Steps 1–3 of a lowering (`lower::lower_unfinished`): the sharded, differentiated,
    /// replayed graph.
    Lowering,
    /// Checkpointing, the Program and its simulation (`lower::finish`).
    Finish,
}

const KINDS: usize = 5;
const NAMES: [&str; KINDS] = ["diffusion", "LP relaxations", "MIPs", "lowerings", "finishes"];
static CALLS: [AtomicU64; KINDS] = [const { AtomicU64::new(0) }; KINDS];
static NANOS: [AtomicU64; KINDS] = [const { AtomicU64::new(0) }; KINDS];

thread_local! {
    /// This thread's calls per kind: what one evaluation ran ([`on_this_thread`]).
    static LOCAL: [std::cell::Cell<u64>; KINDS] = const { [const { std::cell::Cell::new(0) }; KINDS] };
}

/// Runs `f`, counting it as `work`.
pub fn timed<T>(work: Work, f: impl FnOnce() -> T) -> T {
    let t0 = Instant::now();
    let out = f();
    let i = work as usize;
    LOCAL.with(|l| l[i].set(l[i].get() + 1));
    CALLS[i].fetch_add(1, Relaxed);
    NANOS[i].fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
    out
}

/// How many times `work` ran so far in this process.
pub fn calls(work: Work) -> u64 {
    CALLS[work as usize].load(Relaxed)
}

/// How many times `work` ran on this thread so far (an evaluation runs on one thread: the
/// difference across it is its own count).
pub fn on_this_thread(work: Work) -> u64 {
    LOCAL.with(|l| l[work as usize].get())
}

/// One line: each kind's count and seconds so far.
pub fn summary() -> String {
    let parts: Vec<String> = (0..KINDS)
        .map(|i| {
            let s = NANOS[i].load(Relaxed) as f64 * 1e-9;
            format!("{} {} ({s:.2} s)", CALLS[i].load(Relaxed), NAMES[i])
        })
        .collect();
    parts.join(", ")
}
