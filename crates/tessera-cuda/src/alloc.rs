//! The caching device allocator. Device memory is taken from the driver in segments and
//! carved into blocks: a request takes the smallest free block that fits (best fit), split
//! when the rest is worth keeping, and a freed block merges with free neighbours of its
//! segment, so a training step — the same sizes every step — runs from the cache without a
//! driver call after the first, and holds little more than its live tensors. Small requests
//! (≤ 1 MiB) share 2 MiB segments; larger ones get a segment of their own, rounded to 2 MiB (the
//! driver's page), which later requests may split.
//!
//! Its books are the memory accountant's: `program` counts the bytes of live tensors exactly as
//! the Program's accountant charges them (requested bytes, not rounded), and a kernel's scratch
//! (half-precision upcasts, workspaces) is reported beside it, never inside ([`Purpose`]).
//! `reserved` is what the driver has given (segments, cached blocks included).
//!
//! The allocator is generic over [`RawMemory`] so its bookkeeping and its packing are tested on
//! the CPU, down to replaying a real training step's allocations.

use std::collections::{BTreeMap, BTreeSet};

/// Granularity of blocks.
pub const ROUND: u64 = 512;
/// Requests up to this size share small segments.
pub const SMALL: u64 = 1 << 20;
/// The size of a small segment, and the rounding of large ones (the driver's page).
pub const SEGMENT: u64 = 2 << 20;

/// What a buffer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// A tensor of the Program (a bound leaf or a node's fresh output): the accountant's.
    Program,
    /// A kernel's temporary (upcast operands, statistics, attention workspace).
    Scratch,
}

/// Where segments come from: the driver (`cuMemAlloc`) on a GPU, a counter in tests.
pub trait RawMemory {
    type Error;
    /// A segment of exactly `bytes` (a multiple of [`ROUND`]); its device address.
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
    /// Bytes held from the driver (segments: live and cached blocks).
    pub reserved: Gauge,
    /// Requests served from the cache / that needed a new segment.
    pub hits: u64,
    pub misses: u64,
}

/// A block handed out: its address, size in its segment, requested size and purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub addr: u64,
    pub rounded: u64,
    pub bytes: u64,
    pub purpose: Purpose,
    /// Served from the step's planned arena (see [`StepPlan`]), not from a segment.
    pub arena: bool,
}

/// One request of a recorded step.
#[derive(Clone, Copy, Debug)]
struct Request {
    size: u64,
    purpose: Purpose,
    /// Events (requests and releases, counted from the step's start) at which it was made and
    /// released; `None`: still live when the step ended (it escapes the step: a step output).
    born: usize,
    died: Option<usize>,
}

/// A step's memory, planned: the requests of the last step, in order, each with an offset in
/// one arena (the lifetimes are known, so buffers whose lives do not overlap share bytes; the
/// greedy packing, largest first at the lowest free offset, lands within a few percent of
/// the step's peak). A step that makes the same requests is served from the arena: no
/// fragmentation, and the same bytes every step. A request that differs ends the plan for the
/// rest of the step (the caching path serves it), and the step is recorded again.
#[derive(Default)]
struct StepPlan {
    /// The step being recorded or served.
    requests: Vec<Request>,
    /// Live requests of the step being recorded: address → request index.
    open: BTreeMap<u64, usize>,
    events: usize,
    recording: bool,
    /// The plan served this step: requests, their offsets (`None`: escaping, from the cache),
    /// the arena's address and size.
    plan: Vec<(Request, Option<u64>)>,
    arena: Option<(u64, u64)>,
    /// The next request of the plan; `None` once the step diverged from it.
    next: Option<usize>,
    /// Arena blocks handed out and not yet released: offset → end. A planned offset is served
    /// only when free, so a step that frees in another order than the recorded one can never
    /// be handed overlapping blocks (it diverges instead).
    live_arena: BTreeMap<u64, u64>,
}

impl StepPlan {
    fn overlaps(&self, off: u64, size: u64) -> bool {
        let before = self.live_arena.range(..=off).next_back().is_some_and(|(_, &end)| end > off);
        let after =
            self.live_arena.range(off..).next().is_some_and(|(&start, _)| start < off + size);
        before || after
    }
}

/// Offsets for `reqs` (their lifetimes in events) packing them into the fewest bytes the
/// greedy order finds; escaping requests get none. Returns the offsets and the arena size.
fn pack(reqs: &[Request], end: usize) -> (Vec<Option<u64>>, u64) {
    let mut order: Vec<usize> = (0..reqs.len()).filter(|&i| reqs[i].died.is_some()).collect();
    order.sort_by(|&a, &b| reqs[b].size.cmp(&reqs[a].size).then(a.cmp(&b)));
    let mut offsets = vec![None; reqs.len()];
    let mut placed: Vec<(usize, u64)> = Vec::new();
    let mut extent = 0u64;
    for i in order {
        let (lo, hi) = (reqs[i].born, reqs[i].died.unwrap_or(end));
        // Placed buffers alive at the same time, by offset.
        let mut busy: Vec<(u64, u64)> = placed
            .iter()
            .filter(|&&(j, _)| reqs[j].born < hi && lo < reqs[j].died.unwrap_or(end))
            .map(|&(j, off)| (off, off + reqs[j].size))
            .collect();
        busy.sort_unstable();
        let mut at = 0u64;
        for (b0, b1) in busy {
            if b0 >= at + reqs[i].size {
                break;
            }
            at = at.max(b1);
        }
        offsets[i] = Some(at);
        extent = extent.max(at + reqs[i].size);
        placed.push((i, at));
    }
    (offsets, extent)
}

/// A block of a segment, live or free.
#[derive(Clone, Copy, Debug)]
struct Piece {
    size: u64,
    free: bool,
    /// The segment's start (blocks merge only within their segment).
    segment: u64,
}

/// The two pools: small requests never split a large segment, so a large segment freed whole
/// can go back to the driver.
#[derive(Default)]
struct Pool {
    /// Free blocks by (size, address): best fit is the first at or above a size.
    free: BTreeSet<(u64, u64)>,
}

pub struct CachingAllocator<R: RawMemory> {
    raw: R,
    step: StepPlan,
    pools: [Pool; 2],
    /// Every block by address.
    pieces: BTreeMap<u64, Piece>,
    /// Segment start → (size, pool).
    segments: BTreeMap<u64, (u64, usize)>,
    stats: AllocStats,
}

pub fn rounded(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(ROUND) * ROUND
}

fn pool_of(size: u64) -> usize {
    usize::from(size > SMALL)
}

impl<R: RawMemory> CachingAllocator<R> {
    pub fn new(raw: R) -> CachingAllocator<R> {
        CachingAllocator {
            raw,
            step: StepPlan::default(),
            pools: Default::default(),
            pieces: BTreeMap::new(),
            segments: BTreeMap::new(),
            stats: AllocStats::default(),
        }
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

    /// A block of at least `bytes`: the best-fitting free block, else a new segment; when the
    /// driver is out of memory, the wholly free segments go back to it and the request is tried
    /// once more.
    pub fn alloc(&mut self, bytes: u64, purpose: Purpose) -> Result<Block, R::Error> {
        let size = rounded(bytes);
        let block = match self.serve_planned(size, bytes, purpose) {
            Some(b) => b,
            None => self.serve_from_segments(size, bytes, purpose)?,
        };
        self.record(block);
        Ok(block)
    }

    /// The planned block of the step's next request, if the step still follows its plan.
    fn serve_planned(&mut self, size: u64, bytes: u64, purpose: Purpose) -> Option<Block> {
        let st = &mut self.step;
        let k = st.next?;
        let Some(&(_, offset)) =
            st.plan.get(k).filter(|(r, _)| r.size == size && r.purpose == purpose)
        else {
            st.next = None; // diverged: the cache serves the rest of the step
            return None;
        };
        let (base, _) = st.arena?;
        let Some(offset) = offset else {
            st.next = Some(k + 1);
            return None; // an escaping request: from the segments
        };
        if st.overlaps(offset, size) {
            st.next = None;
            return None;
        }
        st.next = Some(k + 1);
        st.live_arena.insert(offset, offset + size);
        match purpose {
            Purpose::Program => self.stats.program.add(bytes),
            Purpose::Scratch => self.stats.scratch.add(bytes),
        }
        self.stats.hits += 1;
        Some(Block { addr: base + offset, rounded: size, bytes, purpose, arena: true })
    }

    fn record(&mut self, b: Block) {
        let st = &mut self.step;
        if st.recording {
            st.open.insert(b.addr, st.requests.len());
            let size = rounded(b.bytes);
            st.requests.push(Request { size, purpose: b.purpose, born: st.events, died: None });
            st.events += 1;
        }
    }

    /// The start of a step (a run of the Program): record its requests, and serve them from
    /// the last step's plan while they match it.
    pub fn begin_step(&mut self) {
        let st = &mut self.step;
        st.requests.clear();
        st.open.clear();
        st.events = 0;
        st.recording = true;
        st.next = st.arena.map(|_| 0);
    }

    /// The end of a step: when it was served by its plan throughout, keep the plan; else plan
    /// the recorded step (a new arena, once no arena block is live) and give the segments the
    /// recorded step used back to the driver.
    pub fn end_step(&mut self) {
        let followed = self.step.next == Some(self.step.plan.len()) && self.step.arena.is_some();
        self.step.recording = false;
        if followed {
            self.step.next = None;
            return;
        }
        self.step.next = None;
        if !self.step.live_arena.is_empty() || self.step.requests.is_empty() {
            return;
        }
        let end = self.step.events;
        let reqs = std::mem::take(&mut self.step.requests);
        let (offsets, extent) = pack(&reqs, end);
        if let Some((addr, size)) = self.step.arena.take() {
            self.raw.free(addr, size);
            self.stats.reserved.sub(size);
        }
        self.empty_cache();
        let extent = extent.div_ceil(SEGMENT) * SEGMENT;
        if extent > 0 {
            match self.raw.alloc(extent) {
                Ok(addr) => {
                    self.stats.reserved.add(extent);
                    self.step.arena = Some((addr, extent));
                }
                Err(_) => {
                    self.step.plan.clear();
                    return;
                }
            }
        }
        self.step.plan = reqs.into_iter().zip(offsets).collect();
    }

    fn serve_from_segments(
        &mut self,
        size: u64,
        bytes: u64,
        purpose: Purpose,
    ) -> Result<Block, R::Error> {
        let pool = pool_of(size);
        let found = self.pools[pool].free.range((size, 0)..).next().copied();
        let (avail, addr) = match found {
            Some(f) => {
                self.stats.hits += 1;
                self.pools[pool].free.remove(&f);
                f
            }
            None => {
                self.stats.misses += 1;
                let seg = if pool == 0 { SEGMENT } else { size.div_ceil(SEGMENT) * SEGMENT };
                let a = match self.raw.alloc(seg) {
                    Ok(a) => a,
                    Err(_) => {
                        self.empty_cache();
                        self.raw.alloc(seg)?
                    }
                };
                self.stats.reserved.add(seg);
                self.segments.insert(a, (seg, pool));
                self.pieces.insert(a, Piece { size: seg, free: false, segment: a });
                (seg, a)
            }
        };
        // Split off the rest when it is worth keeping as a block of its own.
        let rest = avail - size;
        let keep = ROUND;
        let segment = self.pieces[&addr].segment;
        let taken = if rest >= keep {
            let at = addr + size;
            self.pieces.insert(at, Piece { size: rest, free: true, segment });
            self.pools[pool].free.insert((rest, at));
            size
        } else {
            avail
        };
        self.pieces.insert(addr, Piece { size: taken, free: false, segment });
        match purpose {
            Purpose::Program => self.stats.program.add(bytes),
            Purpose::Scratch => self.stats.scratch.add(bytes),
        }
        Ok(Block { addr, rounded: taken, bytes, purpose, arena: false })
    }

    /// Returns a block to the cache, merged with its free neighbours.
    pub fn release(&mut self, b: Block) {
        match b.purpose {
            Purpose::Program => self.stats.program.sub(b.bytes),
            Purpose::Scratch => self.stats.scratch.sub(b.bytes),
        }
        let st = &mut self.step;
        if st.recording {
            if let Some(k) = st.open.remove(&b.addr) {
                st.requests[k].died = Some(st.events);
                st.events += 1;
            }
        }
        if b.arena {
            if let Some((base, _)) = st.arena {
                st.live_arena.remove(&(b.addr - base));
            }
            return;
        }
        let Some(&piece) = self.pieces.get(&b.addr) else { return };
        let pool = self.segments.get(&piece.segment).map_or(0, |s| s.1);
        let (mut addr, mut size) = (b.addr, piece.size);
        // The next block, if free and in the same segment.
        let next = addr + size;
        if let Some(&n) = self.pieces.get(&next).filter(|n| n.free && n.segment == piece.segment) {
            self.pools[pool].free.remove(&(n.size, next));
            self.pieces.remove(&next);
            size += n.size;
        }
        // The previous block, likewise.
        if let Some((&pa, &p)) = self.pieces.range(..addr).next_back() {
            if p.free && p.segment == piece.segment && pa + p.size == addr {
                self.pools[pool].free.remove(&(p.size, pa));
                self.pieces.remove(&addr);
                addr = pa;
                size += p.size;
            }
        }
        self.pieces.insert(addr, Piece { size, free: true, segment: piece.segment });
        self.pools[pool].free.insert((size, addr));
    }

    /// Gives every wholly free segment back to the driver, and the step plan's arena when no
    /// block of it is live (the next step is planned afresh).
    pub fn empty_cache(&mut self) {
        if self.step.live_arena.is_empty() {
            if let Some((addr, size)) = self.step.arena.take() {
                self.raw.free(addr, size);
                self.stats.reserved.sub(size);
                self.step.plan.clear();
                self.step.next = None;
            }
        }
        let whole: Vec<(u64, u64, usize)> = self
            .segments
            .iter()
            .filter(|(a, (size, _))| self.pieces.get(a).is_some_and(|p| p.free && p.size == *size))
            .map(|(&a, &(size, pool))| (a, size, pool))
            .collect();
        for (a, size, pool) in whole {
            self.pools[pool].free.remove(&(size, a));
            self.pieces.remove(&a);
            self.segments.remove(&a);
            self.raw.free(a, size);
            self.stats.reserved.sub(size);
        }
    }

    /// Bytes held in the cache (reserved but not live).
    pub fn cached_bytes(&self) -> u64 {
        self.pools.iter().flat_map(|p| p.free.iter()).map(|(s, _)| s).sum()
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
            let a = self.next;
            self.next += bytes;
            Ok(a)
        }
        fn free(&mut self, _addr: u64, bytes: u64) {
            self.used -= bytes;
            self.frees += 1;
        }
    }

    fn fake(cap: u64) -> CachingAllocator<Fake> {
        CachingAllocator::new(Fake { next: 1 << 40, used: 0, cap, frees: 0 })
    }

    #[test]
    fn program_bytes_are_the_requested_bytes_and_small_blocks_share_a_segment() {
        let mut a = fake(1 << 30);
        let x = a.alloc(1000, Purpose::Program).unwrap();
        let y = a.alloc(24, Purpose::Scratch).unwrap();
        assert_eq!((x.rounded, y.rounded), (1024, 512));
        assert_eq!(y.addr, x.addr + 1024, "the second block is split from the same segment");
        assert_eq!(a.stats().program.current, 1000);
        assert_eq!(a.stats().scratch.current, 24);
        assert_eq!(a.stats().reserved.current, SEGMENT);
        a.release(x);
        assert_eq!(a.stats().program, Gauge { current: 0, peak: 1000 });
        // A request that fits the freed block takes it (best fit), no new segment.
        let z = a.alloc(1020, Purpose::Program).unwrap();
        assert_eq!(z.addr, x.addr);
        assert_eq!((a.stats().hits, a.stats().misses), (2, 1));
        assert_eq!(a.stats().program.peak, 1020, "the peak is the larger of 1000 and 1020");
        a.release(z);
        a.release(y);
        // Everything merged back into one free segment.
        assert_eq!(a.cached_bytes(), SEGMENT);
        assert_eq!(a.pieces.len(), 1);
        a.reset_peaks();
        assert_eq!(a.stats().program.peak, 0);
    }

    #[test]
    fn large_blocks_split_and_merge_with_their_neighbours() {
        let mut a = fake(1 << 30);
        let big = a.alloc(6 << 20, Purpose::Program).unwrap();
        assert_eq!(a.stats().reserved.current, 6 << 20);
        a.release(big);
        // Two 3 MiB requests fit the freed 6 MiB segment: split, no driver call.
        let p = a.alloc(3 << 20, Purpose::Program).unwrap();
        let q = a.alloc(3 << 20, Purpose::Program).unwrap();
        assert_eq!(a.stats().misses, 1);
        assert_eq!(q.addr, p.addr + (3 << 20));
        a.release(p);
        a.release(q);
        // Merged again: a 6 MiB request still fits.
        let r = a.alloc(6 << 20, Purpose::Program).unwrap();
        assert_eq!((r.addr, a.stats().misses), (big.addr, 1));
        a.release(r);
    }

    /// One "step": a, b live together, a freed, c (a's size) allocated, then all freed.
    fn step(al: &mut CachingAllocator<Fake>, sizes: [u64; 3], free_b_first: bool) -> [Block; 3] {
        al.begin_step();
        let a = al.alloc(sizes[0], Purpose::Program).unwrap();
        let b = al.alloc(sizes[1], Purpose::Scratch).unwrap();
        al.release(a);
        let c = al.alloc(sizes[2], Purpose::Program).unwrap();
        if free_b_first {
            al.release(b);
            al.release(c);
        } else {
            al.release(c);
            al.release(b);
        }
        al.end_step();
        [a, b, c]
    }

    #[test]
    fn a_repeated_step_is_served_from_its_planned_arena() {
        let mut al = fake(1 << 30);
        step(&mut al, [3 << 20, 5 << 20, 3 << 20], true);
        al.reset_peaks();
        let misses = al.stats().misses;
        let [a, b, c] = step(&mut al, [3 << 20, 5 << 20, 3 << 20], true);
        assert!(a.arena && b.arena && c.arena, "every block from the arena");
        assert_eq!(al.stats().misses, misses, "no new segment");
        // a and c never live together: they share bytes; the arena is 8 MiB, a 2 MiB page
        // multiple of b + a.
        assert_eq!(a.addr, c.addr);
        assert_eq!(al.stats().reserved.current, 8 << 20);
        assert_eq!(al.stats().program, Gauge { current: 0, peak: 3 << 20 });
        assert_eq!(al.stats().scratch, Gauge { current: 0, peak: 5 << 20 });
    }

    #[test]
    fn emptying_the_cache_returns_the_arena_and_the_next_step_plans_again() {
        let mut al = fake(1 << 30);
        step(&mut al, [3 << 20, 5 << 20, 3 << 20], true);
        assert_eq!(al.stats().reserved.current, 8 << 20, "the arena");
        al.empty_cache();
        assert_eq!(al.stats().reserved.current, 0, "nothing is held after the cache is emptied");
        let [a, _, _] = step(&mut al, [3 << 20, 5 << 20, 3 << 20], false);
        assert!(!a.arena, "served from segments, then planned again");
        let [a, b, c] = step(&mut al, [3 << 20, 5 << 20, 3 << 20], true);
        assert!(a.arena && b.arena && c.arena);
    }

    #[test]
    fn a_step_that_differs_leaves_the_plan_and_is_planned_again() {
        let mut al = fake(1 << 30);
        step(&mut al, [3 << 20, 5 << 20, 3 << 20], true);
        // c is larger this time: served from the segments, never overlapping a live block.
        let [a, b, c] = step(&mut al, [3 << 20, 5 << 20, 4 << 20], false);
        assert!(a.arena && b.arena && !c.arena);
        let [a, b, c] = step(&mut al, [3 << 20, 5 << 20, 4 << 20], false);
        assert!(a.arena && b.arena && c.arena, "the new step shape has its own plan");
        assert!(c.addr + c.rounded <= b.addr || b.addr + b.rounded <= c.addr);
    }

    #[test]
    fn out_of_memory_returns_free_segments_and_retries() {
        let mut a = fake(4 << 20);
        let x = a.alloc(2 << 20, Purpose::Program).unwrap();
        let y = a.alloc(2 << 20, Purpose::Program).unwrap();
        a.release(x);
        a.release(y);
        // 4 MiB does not fit a cached 2 MiB segment: both go back, then it fits.
        let z = a.alloc(4 << 20, Purpose::Program).unwrap();
        assert_eq!(a.raw().frees, 2);
        assert_eq!(a.stats().reserved.current, 4 << 20);
        a.release(z);
        // Truly too large: the driver's error comes through.
        assert!(a.alloc(8 << 20, Purpose::Program).is_err());
    }
}
