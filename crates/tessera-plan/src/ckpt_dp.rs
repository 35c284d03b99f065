//! Activation checkpointing for a chain of repeated blocks: which blocks keep their forward
//! activations, keep only the cheap-to-store ones, or re-run their forward pass in backward —
//! least recompute time under a per-device memory budget, by dynamic programming.
//!
//! **Model.** A step runs the forward pass of blocks `0..L` and then the backward pass of blocks
//! `L-1..=0`. Block `b` in mode `m` ([`CkptMode`]) keeps `kept[b][m]` bytes from its forward
//! until its backward, re-runs `recompute_s[b][m]` seconds of forward work, and while its
//! backward runs needs `backward_peak[b][m]` bytes on top of `base` and of what blocks `0..b`
//! keep (its own kept bytes, what it recomputes and its temporaries). At the turn from forward
//! to backward everything is kept and `top_extra` more is in use. With `S_b` the bytes kept by
//! blocks `0..b`, an assignment fits when `base + S_b + backward_peak[b][m_b] ≤ budget` for
//! every `b` and `base + S_L + top_extra ≤ budget`.
//!
//! **Why the DP is exact.** Every constraint sees the modes of blocks `0..b` only through one
//! number, `S_b`; the turn sees `S_L`. Two prefixes that keep the same bytes therefore face
//! the same future — any suffix completes both, under the same constraints and at the same
//! added cost — so keeping only the best prefix per value of `S_b` loses nothing. The "best"
//! is lexicographic in (recompute seconds, recompute level = Σ mode index, peak bytes so far):
//! the first two add along the chain and the last is a maximum, so a prefix that is no worse in
//! that order stays no worse after any common suffix, and ties go to less recompute and then
//! less memory, as in [`brute_force`].
//!
//! **Slots.** `S_b` ranges over every byte count up to the budget, far too many states, so
//! [`solve`] buckets it into `slots` equal slots of the memory above `base`, keeping one prefix
//! per bucket *together with its exact kept bytes*. Constraints are always checked on exact
//! bytes, so whatever comes back fits exactly; with one byte per slot (`slots ≥ budget -
//! base`) a bucket is one value of `S_b` and the DP is the exact one above. Rounding each
//! block's bytes up to whole slots instead (the textbook discretisation) also fits exactly but
//! loses up to a slot per block: with 1,000 blocks in 500 slots every assignment whose blocks
//! all keep something rounds to over the budget.
//!
//! Buckets lose less, but which prefix a bucket keeps matters once blocks keep less than a
//! slot: the cheapest keeps the most bytes the bucket allows, its successors do the same, and
//! over many blocks the kept prefixes drift up to a slot per block above what the cheap
//! assignments really need, until none fits. What a prefix's bytes are worth is the recompute
//! time the blocks still to come must spend because of them; to first order that is a price
//! per byte, the slope of the optimal recompute-versus-memory curve. So a bucket keeps the
//! prefix of least `recompute + price · kept`, and [`solve`] runs one pass at price 0 and one
//! per price on a grid spanning the blocks' own trades of memory for time, answering the best
//! assignment any pass finds (all are exact byte counts and fit). On a 1,000-block chain in
//! 500 slots price 0 finds nothing and the priced passes come within 0.2% of the 400,000-slot
//! answer. Should every pass lose every fitting prefix, [`solve`] falls back to the assignment
//! of least peak, so it answers `None` only when nothing fits at all.
//!
//! **Least peak.** Shifting `S` shifts every later constraint by the same amount, so the least
//! memory a suffix from block `b` needs on top of `S_b` is one number, `h_b = min over m of
//! max(backward_peak[b][m], kept[b][m] + h_(b+1))` with `h_L = top_extra`, and
//! [`Chain::min_peak`] is `base + h_0`, exact in O(L).

use std::cmp::Ordering;

/// How much of a block's forward pass is kept for its backward pass.
/// The modes are the IR's (the rewrite that carries them out lives there).
pub use tessera_ir::CkptMode;

/// One block's costs per mode, each array indexed by [`CkptMode::index`].
#[derive(Clone, Debug, PartialEq)]
pub struct BlockCost {
    /// Bytes kept from the block's forward pass until its backward pass.
    pub kept: [u64; 3],
    /// Seconds of forward work re-run during the backward pass.
    pub recompute_s: [f64; 3],
    /// Bytes in use while the block's backward runs, on top of `base` and of what earlier blocks
    /// keep: its own kept bytes, what it recomputes and its temporaries (forward peaks folded in).
    pub backward_peak: [u64; 3],
}

/// The per-device chain of blocks, in forward order.
#[derive(Clone, Debug, PartialEq)]
pub struct Chain {
    pub blocks: Vec<BlockCost>,
    /// Bytes always in use: parameters, gradients, optimizer state, ...
    pub base: u64,
    /// Bytes in use at the turn from forward to backward on top of `base` and all kept bytes.
    pub top_extra: u64,
}

/// A mode per block with what it costs.
#[derive(Clone, Debug, PartialEq)]
pub struct Solution {
    pub modes: Vec<CkptMode>,
    /// Total recompute seconds, summed in block order as [`Chain::evaluate`] does.
    pub recompute_s: f64,
    /// peak memory of the assignment under the chain model, exact bytes
    pub peak_bytes: u64,
}

impl Chain {
    /// Peak memory of an assignment under the model (exact bytes), and its recompute time.
    ///
    /// # Panics
    /// If `modes` does not give exactly one mode per block.
    pub fn evaluate(&self, modes: &[CkptMode]) -> (u64, f64) {
        assert_eq!(modes.len(), self.blocks.len(), "one checkpointing mode per block");
        let mut kept = 0u64;
        let mut peak = 0u64;
        let mut recompute = 0.0;
        for (block, mode) in self.blocks.iter().zip(modes) {
            let m = mode.index();
            peak = peak.max(kept.saturating_add(block.backward_peak[m]));
            kept = kept.saturating_add(block.kept[m]);
            recompute += block.recompute_s[m];
        }
        peak = peak.max(kept.saturating_add(self.top_extra));
        (self.base.saturating_add(peak), recompute)
    }

    /// The smallest peak any assignment reaches, exact (module doc, "Least peak").
    pub fn min_peak(&self) -> u64 {
        self.base.saturating_add(self.least_peak_suffix().0)
    }

    /// `h_0` and an assignment reaching it. Among modes that need equally little, the one with
    /// less recompute: this is the fallback answer of [`solve`], so it should not waste time.
    fn least_peak_suffix(&self) -> (u64, Vec<CkptMode>) {
        let mut need = self.top_extra;
        let mut modes = vec![CkptMode::None; self.blocks.len()];
        for (block, slot) in self.blocks.iter().zip(modes.iter_mut()).rev() {
            let need_with = |m: CkptMode| {
                let i = m.index();
                block.backward_peak[i].max(block.kept[i].saturating_add(need))
            };
            let mut best = CkptMode::None;
            for mode in CkptMode::ALL {
                let order = need_with(mode).cmp(&need_with(best)).then(
                    block.recompute_s[mode.index()].total_cmp(&block.recompute_s[best.index()]),
                );
                if order.is_lt() {
                    best = mode;
                }
            }
            need = need_with(best);
            *slot = best;
        }
        (need, modes)
    }
}

/// The best prefix found for one bucket. Bytes are above `base`.
#[derive(Clone, Copy, Debug)]
struct Prefix {
    recompute: f64,
    /// Σ mode index: breaks recompute-time ties toward re-running less.
    level: u64,
    /// Largest backward need so far, `max over j<b of S_j + backward_peak[j]`.
    peak: u64,
    /// Exact `S_b`: a bucket spans many byte counts, and constraints must hold for the real one.
    kept: u64,
}

impl Prefix {
    /// The DP's order (module doc), after `recompute + price · kept`: the price values the
    /// bytes a prefix keeps, which only matters when a bucket spans several byte counts (it is 0
    /// at one byte per slot, where all prefixes of a bucket keep the same bytes).
    fn order(&self, other: &Prefix, price: f64) -> Ordering {
        let worth = |p: &Prefix| p.recompute + price * p.kept as f64;
        worth(self)
            .total_cmp(&worth(other))
            .then(self.recompute.total_cmp(&other.recompute))
            .then(self.level.cmp(&other.level))
            .then(self.peak.cmp(&other.peak))
            .then(self.kept.cmp(&other.kept))
    }
}

/// Back-pointers are `u32` bucket numbers; halving their memory matters more than grids this
/// fine, whose back-pointers alone would take 20 GB per block.
const MAX_SLOTS: u64 = u32::MAX as u64 - 1;

/// The equal slots of the memory above `base`.
struct Grid {
    avail: u64,
    slots: u64,
}

impl Grid {
    fn new(avail: u64, slots: usize) -> Grid {
        // Finer than a byte only adds empty buckets; at exactly a byte the DP is exact.
        let slots = (slots.max(1) as u64).min(avail).min(MAX_SLOTS);
        Grid { avail, slots }
    }

    fn exact(&self) -> bool {
        self.slots == self.avail
    }

    fn width(&self) -> usize {
        self.slots as usize + 1
    }

    /// The bucket of `bytes ≤ avail`, in `0..=slots`.
    fn bucket(&self, bytes: u64) -> usize {
        if self.exact() {
            return bytes as usize;
        }
        (u128::from(bytes) * u128::from(self.slots) / u128::from(self.avail)) as usize
    }
}

/// The prices of memory the passes of [`solve`] try (module doc, "Slots"): 0 first, then a
/// geometric grid from a quarter of the cheapest per-block trade of memory for recompute
/// time to the dearest, at most 16 steps. The answer's price is the slope of the optimal
/// recompute-versus-memory curve at the budget, which is one of those trades or between them;
/// the quarter covers merges that the cheapest trade alone undervalues.
fn memory_prices(chain: &Chain) -> Vec<f64> {
    let mut lo = f64::INFINITY;
    let mut hi = 0.0f64;
    for block in &chain.blocks {
        for a in 0..3 {
            for b in 0..3 {
                let bytes = block.kept[a].saturating_sub(block.kept[b]) as f64;
                let seconds = block.recompute_s[b] - block.recompute_s[a];
                let price = seconds / bytes;
                if bytes > 0.0 && price.is_finite() && price > 0.0 {
                    lo = lo.min(price);
                    hi = hi.max(price);
                }
            }
        }
    }
    let mut prices = vec![0.0];
    if lo.is_finite() {
        let lo = lo / 4.0;
        let steps = (hi / lo).log2().ceil().clamp(1.0, 16.0);
        let ratio = (hi / lo).powf(1.0 / steps);
        prices.extend((0..=steps as i32).map(|i| lo * ratio.powi(i)));
    }
    prices
}

/// One DP pass's buffers, reused across the passes of [`solve`].
struct Pass {
    width: usize,
    /// Per block and bucket, the bucket of the prefix it extends and the mode it took.
    from: Vec<u32>,
    mode_of: Vec<u8>,
    cur: Vec<Option<Prefix>>,
    next: Vec<Option<Prefix>>,
}

impl Pass {
    fn new(blocks: usize, width: usize) -> Pass {
        Pass {
            width,
            from: vec![u32::MAX; blocks * width],
            mode_of: vec![0; blocks * width],
            cur: vec![None; width],
            next: vec![None; width],
        }
    }

    /// The DP at one price: the best assignment it keeps, or `None` if merging lost every one
    /// that fits.
    fn run(&mut self, chain: &Chain, grid: &Grid, price: f64) -> Option<Vec<CkptMode>> {
        let avail = grid.avail;
        let width = self.width;
        self.cur.fill(None);
        self.cur[0] = Some(Prefix { recompute: 0.0, level: 0, peak: 0, kept: 0 });
        for (b, block) in chain.blocks.iter().enumerate() {
            self.next.fill(None);
            let mut reached = false;
            for (i, prefix) in self.cur.iter().enumerate() {
                let Some(p) = prefix else { continue };
                for mode in CkptMode::ALL {
                    let m = mode.index();
                    let need = p.kept.saturating_add(block.backward_peak[m]);
                    let kept = p.kept.saturating_add(block.kept[m]);
                    // Kept bytes only grow and must still fit at the turn: over `avail` is dead.
                    if need > avail || kept > avail {
                        continue;
                    }
                    let cand = Prefix {
                        recompute: p.recompute + block.recompute_s[m],
                        level: p.level + m as u64,
                        peak: p.peak.max(need),
                        kept,
                    };
                    let j = grid.bucket(kept);
                    if self.next[j].is_none_or(|q| cand.order(&q, price).is_lt()) {
                        self.next[j] = Some(cand);
                        self.from[b * width + j] = i as u32;
                        self.mode_of[b * width + j] = m as u8;
                        reached = true;
                    }
                }
            }
            std::mem::swap(&mut self.cur, &mut self.next);
            if !reached {
                return None;
            }
        }

        let mut best: Option<(usize, Prefix)> = None;
        for (j, prefix) in self.cur.iter().enumerate() {
            let Some(p) = prefix else { continue };
            let turn = p.kept.saturating_add(chain.top_extra);
            if turn > avail {
                continue;
            }
            // At the turn kept bytes have no future left to crowd, so no price.
            let done = Prefix { peak: p.peak.max(turn), ..*p };
            if best.is_none_or(|(_, q)| done.order(&q, 0.0).is_lt()) {
                best = Some((j, done));
            }
        }
        let (mut j, _) = best?;
        let mut modes = vec![CkptMode::None; chain.blocks.len()];
        for (b, mode) in modes.iter_mut().enumerate().rev() {
            *mode = CkptMode::ALL[usize::from(self.mode_of[b * width + j])];
            j = self.from[b * width + j] as usize;
        }
        Some(modes)
    }
}

/// Optimal modes under `budget`, memory discretised into `slots` equal slots of the budget above
/// `base` (module doc, "Slots"): the returned assignment always fits exactly, and is the exact
/// optimum when `slots ≥ budget - base` (one byte per slot). `None` when no assignment fits
/// (`budget < base` included); `slots = 0` counts as 1. O(L · slots · 3) time per pass — one
/// pass at one byte per slot, at most 18 otherwise — and O(L · slots) memory for back-pointers.
pub fn solve(chain: &Chain, budget: u64, slots: usize) -> Option<Solution> {
    let avail = budget.checked_sub(chain.base)?;
    let grid = Grid::new(avail, slots);
    let prices = if grid.exact() { vec![0.0] } else { memory_prices(chain) };
    let mut pass = Pass::new(chain.blocks.len(), grid.width());
    let mut best: Option<Solution> = None;
    let mut best_level = 0;
    for price in prices {
        let Some(modes) = pass.run(chain, &grid, price) else { continue };
        let (peak_bytes, recompute_s) = chain.evaluate(&modes);
        let level = modes.iter().map(|m| m.index() as u64).sum::<u64>();
        let better = best.as_ref().is_none_or(|b| {
            recompute_s
                .total_cmp(&b.recompute_s)
                .then(level.cmp(&best_level))
                .then(peak_bytes.cmp(&b.peak_bytes))
                .is_lt()
        });
        if better {
            best = Some(Solution { modes, recompute_s, peak_bytes });
            best_level = level;
        }
    }
    if best.is_some() {
        return best;
    }
    // Merging prefixes within a slot can lose every one that fits; the least-peak assignment
    // fits whenever anything does.
    let modes = chain.least_peak_suffix().1;
    let (peak_bytes, recompute_s) = chain.evaluate(&modes);
    (peak_bytes <= budget).then_some(Solution { modes, recompute_s, peak_bytes })
}

/// Exhaustive search over all 3^L assignments with exact bytes (the test oracle), with the same
/// order as [`solve`]: least recompute time, then least Σ mode index, then least peak; the first
/// in enumeration order (block 0 varying fastest) on a full tie.
///
/// # Panics
/// If the chain has more than 12 blocks (531,441 assignments).
pub fn brute_force(chain: &Chain, budget: u64) -> Option<Solution> {
    let blocks = chain.blocks.len();
    assert!(blocks <= 12, "brute force over 3^{blocks} assignments is too slow");
    let mut modes = vec![CkptMode::None; blocks];
    let mut best: Option<((f64, u64, u64), Vec<CkptMode>)> = None;
    for code in 0..3usize.pow(blocks as u32) {
        let mut rest = code;
        for mode in modes.iter_mut() {
            *mode = CkptMode::ALL[rest % 3];
            rest /= 3;
        }
        let (peak, recompute) = chain.evaluate(&modes);
        if peak > budget {
            continue;
        }
        let level: u64 = modes.iter().map(|m| m.index() as u64).sum();
        let better = best.as_ref().is_none_or(|((r, l, p), _)| {
            recompute.total_cmp(r).then(level.cmp(l)).then(peak.cmp(p)).is_lt()
        });
        if better {
            best = Some(((recompute, level, peak), modes.clone()));
        }
    }
    best.map(|((recompute_s, _, peak_bytes), modes)| Solution { modes, recompute_s, peak_bytes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn level(modes: &[CkptMode]) -> u64 {
        modes.iter().map(|m| m.index() as u64).sum()
    }

    /// Small integers throughout, so recompute sums are exact in f64 and solve and the oracle
    /// can be compared with `==`.
    fn block() -> impl Strategy<Value = BlockCost> {
        (
            prop::array::uniform3(0u64..50),
            prop::bool::weighted(0.8),
            0u32..5,
            0u32..10,
            prop::array::uniform3(0u64..40),
            prop::bool::weighted(0.9),
        )
            .prop_map(|(mut kept, sorted, selective, full, temps, with_own)| {
                // Usually None ≥ Selective ≥ Full, as in real blocks; sometimes not, since
                // the DP must not rely on it.
                if sorted {
                    kept.sort_unstable_by(|a, b| b.cmp(a));
                }
                let backward_peak =
                    std::array::from_fn(|m| if with_own { kept[m] + temps[m] } else { temps[m] });
                BlockCost {
                    kept,
                    recompute_s: [0.0, f64::from(selective), f64::from(full)],
                    backward_peak,
                }
            })
    }

    fn chain(max_blocks: usize) -> impl Strategy<Value = Chain> {
        (prop::collection::vec(block(), 1..=max_blocks), 0u64..30, 0u64..40)
            .prop_map(|(blocks, base, top_extra)| Chain { blocks, base, top_extra })
    }

    /// A budget from a little under the least peak (so some cases fit nothing, some are even
    /// under `base`) to a little over the peak of keeping everything.
    fn budget_for(chain: &Chain, per_mille: u64) -> u64 {
        let lo = chain.min_peak().saturating_sub(10);
        let hi = [CkptMode::None, CkptMode::Selective, CkptMode::Full]
            .iter()
            .map(|&m| chain.evaluate(&vec![m; chain.blocks.len()]).0)
            .max()
            .unwrap_or(0)
            + 10;
        lo + hi.saturating_sub(lo) * per_mille / 1000
    }

    fn assert_consistent(chain: &Chain, sol: &Solution, budget: u64) {
        let (peak, recompute) = chain.evaluate(&sol.modes);
        assert!(peak <= budget, "peak {peak} over budget {budget}");
        assert_eq!(peak, sol.peak_bytes);
        assert_eq!(recompute, sol.recompute_s);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(5000))]

        #[test]
        fn one_byte_slots_match_brute_force(chain in chain(8), per_mille in 0u64..=1000) {
            let budget = budget_for(&chain, per_mille);
            let dp = solve(&chain, budget, budget as usize);
            let oracle = brute_force(&chain, budget);
            prop_assert_eq!(dp.is_some(), oracle.is_some());
            if let (Some(dp), Some(oracle)) = (dp, oracle) {
                assert_consistent(&chain, &dp, budget);
                prop_assert_eq!(dp.recompute_s, oracle.recompute_s);
                // The tie-break is part of the optimum, not an accident of the search order.
                prop_assert_eq!(level(&dp.modes), level(&oracle.modes));
                prop_assert_eq!(dp.peak_bytes, oracle.peak_bytes);
            }
        }

        #[test]
        fn coarse_slots_fit_and_never_beat_brute_force(
            chain in chain(8),
            per_mille in 0u64..=1000,
            slots in prop_oneof![Just(7usize), 0usize..64],
        ) {
            let budget = budget_for(&chain, per_mille);
            let dp = solve(&chain, budget, slots);
            let oracle = brute_force(&chain, budget);
            // The least-peak fallback makes feasibility exact at any resolution.
            prop_assert_eq!(dp.is_some(), oracle.is_some());
            if let (Some(dp), Some(oracle)) = (dp, oracle) {
                assert_consistent(&chain, &dp, budget);
                prop_assert!(dp.recompute_s >= oracle.recompute_s);
            }
        }

        #[test]
        fn min_peak_is_the_least_peak(chain in chain(7)) {
            let least = (0..3usize.pow(chain.blocks.len() as u32))
                .map(|code| {
                    let modes: Vec<_> = (0..chain.blocks.len())
                        .map(|b| CkptMode::ALL[code / 3usize.pow(b as u32) % 3])
                        .collect();
                    chain.evaluate(&modes).0
                })
                .min()
                .unwrap();
            prop_assert_eq!(chain.min_peak(), least);
            let at_least = solve(&chain, least, usize::MAX).unwrap();
            prop_assert_eq!(at_least.peak_bytes, least);
            if least > 0 {
                prop_assert!(solve(&chain, least - 1, usize::MAX).is_none());
            }
        }
    }

    /// Three equal blocks: keeping everything costs 8 bytes, selective 4, full 1, and
    /// re-running 0, 1 or 4 seconds; every backward step needs 12 bytes (the block's
    /// activations, kept or recomputed, plus temporaries).
    fn equal_blocks(n: usize) -> Vec<BlockCost> {
        vec![BlockCost { kept: [8, 4, 1], recompute_s: [0.0, 1.0, 4.0], backward_peak: [12; 3] }; n]
    }

    /// With 16 bytes above base, block 2's backward step leaves 4 bytes for blocks 0 and 1
    /// together, which only Full (1 + 1) meets; block 2's own kept bytes sit under no later
    /// backward step, only under the turn (2 + 8 ≤ 16), so it keeps everything. A uniform
    /// choice is worse: all Full re-runs 12 s, and all Selective or all None do not fit.
    #[test]
    fn early_blocks_recompute_late_blocks_keep() {
        let chain = Chain { blocks: equal_blocks(3), base: 100, top_extra: 0 };
        let budget = 116;
        let sol = solve(&chain, budget, 16).unwrap();
        assert_eq!(sol.modes, [CkptMode::Full, CkptMode::Full, CkptMode::None]);
        assert_eq!(sol.recompute_s, 8.0);
        assert_eq!(sol.peak_bytes, 114);
        assert_eq!(brute_force(&chain, budget), Some(sol));
        assert_eq!(chain.evaluate(&[CkptMode::Full; 3]), (114, 12.0));
        assert!(chain.evaluate(&[CkptMode::Selective; 3]).0 > budget);
        // The same modes in the reverse order do not fit: position, not count, is what matters.
        assert!(chain.evaluate(&[CkptMode::None, CkptMode::Full, CkptMode::Full]).0 > budget);
    }

    /// Block 1's backward step needs 15 bytes (bigger temporaries), so with 17 bytes above base
    /// block 0 may keep at most 2 (Full); block 2's step then leaves 4 for block 1 (Selective),
    /// and the turn leaves 12 for block 2 (None): each block re-runs the least its position
    /// allows, and all three modes appear.
    #[test]
    fn each_block_recomputes_the_least_its_position_allows() {
        let mut blocks = equal_blocks(3);
        blocks[1].backward_peak = [15; 3];
        let chain = Chain { blocks, base: 100, top_extra: 0 };
        let budget = 117;
        let sol = solve(&chain, budget, 17).unwrap();
        assert_eq!(sol.modes, [CkptMode::Full, CkptMode::Selective, CkptMode::None]);
        assert_eq!((sol.peak_bytes, sol.recompute_s), (117, 5.0));
        assert_eq!(brute_force(&chain, budget), Some(sol));
    }

    #[test]
    fn edge_cases() {
        let empty = Chain { blocks: vec![], base: 10, top_extra: 5 };
        let sol = solve(&empty, 15, 4).unwrap();
        assert_eq!((sol.modes.len(), sol.recompute_s, sol.peak_bytes), (0, 0.0, 15));
        assert_eq!(empty.min_peak(), 15);
        assert!(solve(&empty, 14, 4).is_none());
        assert_eq!(brute_force(&empty, 15), Some(sol));

        let chain = Chain { blocks: equal_blocks(2), base: 100, top_extra: 0 };
        assert!(solve(&chain, 99, 1000).is_none(), "budget under base");
        // One slot for everything: the fallback still finds what fits.
        let one = solve(&chain, 113, 0).unwrap();
        assert_eq!(one.modes, [CkptMode::Full, CkptMode::None]);
        assert_eq!(Some(one), solve(&chain, 113, 1));

        let huge = Chain {
            blocks: vec![
                BlockCost {
                    kept: [u64::MAX, u64::MAX / 2 + 1, 0],
                    recompute_s: [0.0, 1.0, 2.0],
                    backward_peak: [u64::MAX; 3],
                };
                2
            ],
            base: 0,
            top_extra: u64::MAX,
        };
        assert_eq!(huge.evaluate(&[CkptMode::None; 2]).0, u64::MAX);
        assert_eq!(huge.min_peak(), u64::MAX);
        assert!(solve(&huge, u64::MAX - 1, 500).is_none());
        let all = solve(&huge, u64::MAX, 500).unwrap();
        assert_eq!((all.modes, all.peak_bytes), (vec![CkptMode::None; 2], u64::MAX));
    }

    #[test]
    fn mode_names_and_serde() {
        for (i, mode) in CkptMode::ALL.into_iter().enumerate() {
            assert_eq!(mode.index(), i);
            assert_eq!(serde_json::to_string(&mode).unwrap(), format!("\"{}\"", mode.name()));
        }
    }

    /// A 1,000-block chain of blocks a little different each (90..110 % of 24 MiB kept in
    /// full), with a budget halfway between the least peak and the peak of keeping everything.
    fn thousand_blocks() -> (Chain, u64) {
        let mib = 1u64 << 20;
        let blocks = (0..1000u64)
            .map(|b| {
                let size = 90 + (b * 37 % 21);
                let act = 24 * mib * size / 100;
                let fwd_s = 0.003 * size as f64 / 100.0;
                BlockCost {
                    kept: [act, act * 2 / 5, act / 16],
                    recompute_s: [0.0, fwd_s / 8.0, fwd_s],
                    backward_peak: [act + act / 4; 3],
                }
            })
            .collect();
        let chain = Chain { blocks, base: 20 << 30, top_extra: 512 * mib };
        let hi = chain.evaluate(&vec![CkptMode::None; 1000]).0;
        let budget = chain.min_peak() + (hi - chain.min_peak()) / 2;
        (chain, budget)
    }

    /// Every block keeps less than a slot here (a slot is ~26 MiB), the case where price 0
    /// alone drifts out of the budget; the answer must still beat every uniform choice that
    /// fits (all Selective: 0.375 s), not merely fall back to the least peak (all Full: 3 s).
    #[test]
    fn thousand_blocks_in_500_slots() {
        let (chain, budget) = thousand_blocks();
        let sol = solve(&chain, budget, 500).unwrap();
        assert_consistent(&chain, &sol, budget);
        for mode in CkptMode::ALL {
            let (peak, recompute) = chain.evaluate(&vec![mode; 1000]);
            if peak <= budget {
                assert!(
                    sol.recompute_s < recompute,
                    "{} vs all {mode:?} {recompute}",
                    sol.recompute_s
                );
            }
        }
        assert!(sol.modes.contains(&CkptMode::None) && sol.modes.contains(&CkptMode::Selective));
    }
}
