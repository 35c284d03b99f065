//! Activation checkpointing on a lowered (sharded, replayed) training graph: the per-block
//! costs the dynamic program needs, the choice under a budget, and the baselines.
//!
//! The costs are *measured on Programs*, not modelled: the graph is lowered three times with
//! one mode on every block (`none`, `selective`, `full`), and each Program's memory timeline
//! and cost-model walk give, per block and mode,
//! - `kept`: the saved-activation bytes the block's forward pass leaves on the device for its
//!   backward pass (per micro-batch: micro-batches run one after another; under activation
//!   offload a full block's input rests on the host and counts nowhere here — its copy back
//!   is in the backward peaks);
//! - `recompute_s`: the seconds its recomputation costs (compute and repeated collectives);
//! - `backward_peak`: the highest live bytes while any of the block's instructions run, minus
//!   the kept bytes of the blocks before it — so parameters, gradients, optimizer state,
//!   workspace and the block's own recomputed values are all in it, exactly as simulated.
//!
//! The DP ([`crate::ckpt_dp`]) combines these per block; the combination it picks is lowered
//! and simulated once more, and if the exact peak still misses the budget (a block's peak
//! moved with its neighbours' modes), the DP is re-run with the budget lowered by the miss.
//! So a returned plan always fits by simulation, never by estimate alone.

use crate::ckpt_dp::{self, BlockCost, Chain};
use crate::cost::CostModel;
use crate::lower::{finish, Lowered, Unfinished};
use crate::{Mesh, Result};
use tessera_ir::{Checkpointing, CkptMode, Instr, Phase, Role, Tier};
use tessera_profile::simulate_memory;

/// Memory resolution of the DP: buckets of the budget. Constraints are checked on exact bytes
/// (see [`crate::ckpt_dp::solve`]), so the resolution only limits how many distinct prefixes
/// the DP keeps; 4096 is within 0.1% of a 16× finer grid on 96-block chains.
const SLOTS: usize = 4096;

/// The chain model of a lowered graph and its three uniform lowerings (`none`, `selective`,
/// `full`, by [`CkptMode::index`]).
pub struct Measured {
    pub chain: Chain,
    pub uniform: Vec<Lowered>,
    /// The highest live bytes outside every block and the forward→backward turn (embedding,
    /// loss head before the first block, optimizer): no checkpoint decision changes it.
    pub floor: u64,
}

/// Measures the chain of `u`'s repeated blocks. `None` when the graph has no blocks.
pub fn measure(u: &Unfinished, mesh: &Mesh, cost: &CostModel) -> Result<Option<Measured>> {
    let nb = tessera_ir::remat::num_blocks(&u.training.graph);
    if nb == 0 {
        return Ok(None);
    }
    let uniform = CkptMode::ALL
        .iter()
        .map(|&mode| finish(u, &Checkpointing::uniform(nb, mode), mesh, cost))
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(measure_lowered(u, uniform)))
}

/// The chain model from the three uniform lowerings of `u` (by [`CkptMode::index`]).
fn measure_lowered(u: &Unfinished, uniform: Vec<Lowered>) -> Measured {
    let l = tessera_ir::remat::num_blocks(&u.training.graph) as usize;
    let mb = u.micro_batches.max(1) as u64;
    let mut blocks =
        vec![BlockCost { kept: [0; 3], recompute_s: [0.0; 3], backward_peak: [0; 3] }; l];
    let mut top_extra = 0u64;
    let mut floor = 0u64;
    for (m, lowered) in uniform.iter().enumerate() {
        let p = &lowered.program;
        let g = p.graph();
        // Kept bytes per block: saved activations made by the block's forward pass.
        let mut kept = vec![0u64; l];
        for (t, &root) in p.buffer_of.iter().enumerate() {
            // Only what rests on the device: activation offload's host copies take none.
            if root.index() != t || p.role[t] != Role::SavedActivation || p.tier[t] != Tier::Device
            {
                continue;
            }
            let n = g.producer(root);
            if let (Phase::Forward, Some(b)) = (n.phase, n.block) {
                kept[b as usize] += g.meta(root).size_bytes();
            }
        }
        for (b, k) in kept.iter().enumerate() {
            blocks[b].kept[m] = k / mb;
        }
        let mut prefix = vec![0u64; l + 1];
        for b in 0..l {
            prefix[b + 1] = prefix[b] + blocks[b].kept[m];
        }
        for (b, s) in lowered.time.recompute_by_block_s.iter().enumerate().take(l) {
            blocks[b].recompute_s[m] = *s;
        }
        // Peaks by region of the timeline.
        let trace = simulate_memory(p);
        let mut current: Option<u32> = None;
        let mut after_forward_block = false;
        for point in &trace.timeline {
            let live = point.live_bytes;
            if let Instr::Run(n) = p.instrs[point.instr as usize] {
                let node = g.node(n);
                current = node.block;
                if node.block.is_some() {
                    after_forward_block = node.phase == Phase::Forward;
                }
            }
            match current {
                Some(b) => {
                    let b = b as usize;
                    let over = live.saturating_sub(prefix[b]);
                    blocks[b].backward_peak[m] = blocks[b].backward_peak[m].max(over);
                }
                None if after_forward_block => {
                    top_extra = top_extra.max(live.saturating_sub(prefix[l]));
                }
                None => floor = floor.max(live),
            }
        }
    }
    // Selective or full may keep *more* on a block than none where a recomputed value's
    // sibling output stays saved; the DP needs no monotonicity, so the measured values stand.
    Measured { chain: Chain { blocks, base: 0, top_extra }, uniform, floor }
}

/// The fastest checkpointing of `u` whose simulated peak fits `budget`, lowered; `None` when
/// even recomputing every block does not fit.
///
/// `bound_s` is the step time of the fastest plan found elsewhere (`f64::INFINITY` for
/// none). When no checkpointing of `u` can beat it, the answer is full recompute: a plan
/// that fits, so callers still learn that the layout fits, but without the DP's cost.
///
/// Lowerings are the search's main cost, so the cheap verdicts come first: the plain
/// Program (returned when it fits; recomputation only adds time, so its step time bounds
/// every checkpointed one from below), then full recompute on every block (the least memory
/// the chain reaches: when it misses the budget no per-block mix fits), and only then the
/// selective lowering and the DP.
pub fn choose(
    u: &Unfinished,
    mesh: &Mesh,
    cost: &CostModel,
    budget: u64,
    bound_s: f64,
) -> Result<Option<Lowered>> {
    Ok(choose_or_resting(u, mesh, cost, budget, bound_s)?.ok())
}

/// [`choose`], saying on a miss how many bytes rest on each device before a step begins
/// (parameters, optimizer state): when those alone exceed the budget, no micro-batching or
/// checkpointing of this layout can fit.
pub fn choose_or_resting(
    u: &Unfinished,
    mesh: &Mesh,
    cost: &CostModel,
    budget: u64,
    bound_s: f64,
) -> Result<std::result::Result<Lowered, u64>> {
    let nb = tessera_ir::remat::num_blocks(&u.training.graph);
    let none = finish(u, &Checkpointing::uniform(nb, CkptMode::None), mesh, cost)?;
    if none.memory.peak_bytes <= budget {
        return Ok(Ok(none));
    }
    if nb == 0 {
        return Ok(Err(none.memory.resting_bytes));
    }
    let full = finish(u, &Checkpointing::uniform(nb, CkptMode::Full), mesh, cost)?;
    choose_after(u, mesh, cost, budget, bound_s, none, full)
}

/// [`choose_or_resting`] past its first two lowerings: `none` and `full` are `u` lowered with
/// no checkpointing and with full recompute on every block.
pub fn choose_after(
    u: &Unfinished,
    mesh: &Mesh,
    cost: &CostModel,
    budget: u64,
    bound_s: f64,
    none: Lowered,
    full: Lowered,
) -> Result<std::result::Result<Lowered, u64>> {
    let nb = tessera_ir::remat::num_blocks(&u.training.graph);
    if none.memory.peak_bytes <= budget {
        return Ok(Ok(none));
    }
    if full.memory.peak_bytes > budget {
        return Ok(Err(full.memory.resting_bytes));
    }
    if none.time.step_time_s > bound_s {
        // A fitting plan, but none of this layout's checkpointings can win: skip the DP.
        return Ok(Ok(full));
    }
    let selective = finish(u, &Checkpointing::uniform(nb, CkptMode::Selective), mesh, cost)?;
    // In [`CkptMode::ALL`]'s order, which [`CkptMode::index`] follows.
    let uniform = vec![none, selective, full];
    let measured = measure_lowered(u, uniform);
    // Full recompute fits, so the DP (or full itself) always finds a plan.
    let resting = measured.uniform[0].memory.resting_bytes;
    Ok(choose_measured(u, mesh, cost, budget, &measured)?.ok_or(resting))
}

/// [`choose`] with the chain already measured.
pub fn choose_measured(
    u: &Unfinished,
    mesh: &Mesh,
    cost: &CostModel,
    budget: u64,
    measured: &Measured,
) -> Result<Option<Lowered>> {
    let none = &measured.uniform[CkptMode::None.index()];
    if none.memory.peak_bytes <= budget {
        return Ok(Some(none.clone()));
    }
    if measured.floor > budget {
        return Ok(None);
    }
    let mut best: Option<Lowered> = None;
    let mut target = budget;
    for _ in 0..4 {
        let Some(sol) = ckpt_dp::solve(&measured.chain, target, SLOTS) else { break };
        let modes: Vec<CkptMode> = sol.modes.clone();
        let lowered = finish(u, &Checkpointing::per_block(&modes), mesh, cost)?;
        let peak = lowered.memory.peak_bytes;
        if peak <= budget {
            best = Some(lowered);
            break;
        }
        // The exact peak missed: ask the DP for the miss (and a little) less.
        target = target.saturating_sub(peak - budget + budget / 512);
    }
    // Uniform choices the DP may have ruled out by rounding: keep the fastest that fits.
    for l in &measured.uniform[1..] {
        if l.memory.peak_bytes <= budget
            && best.as_ref().is_none_or(|b| l.time.step_time_s < b.time.step_time_s)
        {
            best = Some(l.clone());
        }
    }
    Ok(best)
}

/// Smallest peak any per-block choice reaches on `u` (by simulation of full recompute, and
/// of the DP's own minimum).
pub fn min_peak(measured: &Measured) -> u64 {
    measured.uniform.iter().map(|l| l.memory.peak_bytes).min().unwrap_or(u64::MAX)
}
