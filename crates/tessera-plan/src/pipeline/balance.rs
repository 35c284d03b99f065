//! The inter-op pass: unequal stages and per-stage checkpointing, chosen jointly.
//!
//! Even stages are rarely balanced: the first stage also runs the embedding and, under 1F1B,
//! holds `p` micro-batches of activations; the last runs the head and the loss (for a large
//! vocabulary, several blocks' worth of compute) and holds one. This pass takes a pipelined
//! plan lowered exactly with even stages and re-cuts the chain of blocks — Alpa's dynamic
//! programme over contiguous block ranges, each stage with its own checkpointing mode — to
//! minimise the slowest stage's time per micro-batch (which paces the steady state), then
//! the sum of the stages' times (warm-up and cool-down), under the memory budget on every
//! device.
//!
//! Each device's figures come from the exact lowering, split by the blocks' tags into what
//! its blocks cost and what it runs besides them (embedding, head, loss); a block's cost
//! under each checkpointing mode (its recomputation, the activations it keeps per micro-batch)
//! comes from the intra-op samples ([`BlockCosts`]). The model is linear in a stage's blocks
//! around the measured split, and the re-cut plan is lowered exactly again: the planner keeps
//! it only when it fits and is faster, so the model only has to point the way.

use super::lower::{node_seconds, PipeLowered};
use super::ScheduleKind;
use crate::config::ParallelConfig;
use crate::Mesh;
use tessera_ir::{CkptMode, Op, Phase};

/// One checkpointing mode's per-block figures on the stage mesh, for one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModeCost {
    pub mode: CkptMode,
    /// Seconds a block spends recomputing.
    pub recompute_s: f64,
    /// Bytes a block keeps from its forward to its backward.
    pub kept_bytes: f64,
}

/// Per-block figures of the modes the pipeline phase sampled, and what a block's weight
/// gradients read (its kept bytes without checkpointing, for split backwards).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockCosts {
    pub modes: Vec<ModeCost>,
    pub weight_inputs_bytes: f64,
}

impl BlockCosts {
    /// The figures of one sampled lowering (one micro-batch of the whole model, `mode` on
    /// every block): the blocks' mean recomputation and kept bytes.
    pub fn mode_cost(mode: CkptMode, l: &crate::lower::Lowered) -> ModeCost {
        let mean =
            |v: &[f64]| if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
        let kept: Vec<f64> = l.memory.activations_by_block.iter().map(|&b| b as f64).collect();
        ModeCost { mode, recompute_s: mean(&l.time.recompute_by_block_s), kept_bytes: mean(&kept) }
    }
}

/// One device's figures for one micro-batch, split by blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DeviceCost {
    /// Blocks it runs.
    pub blocks: usize,
    /// Seconds of its blocks' forward and backward (recomputation apart).
    pub block_s: f64,
    /// Seconds of its blocks' recomputation.
    pub recompute_s: f64,
    /// Seconds of everything else it runs per micro-batch (embedding, head, loss).
    pub extra_s: f64,
    /// Its blocks' share of its parameters, gradients and optimizer state, bytes.
    pub block_state_bytes: f64,
    /// Its peak, bytes.
    pub peak_bytes: f64,
}

/// Splits each device's micro-batch 0 of an exactly lowered pipeline by the blocks' tags.
pub fn device_costs(
    l: &PipeLowered,
    full: &Mesh,
    cost: &crate::cost::CostModel,
) -> Vec<DeviceCost> {
    let ranges = l.options.map.block_ranges();
    l.devices
        .iter()
        .enumerate()
        .map(|(d, dev)| {
            let p = &dev.lowered.program;
            let g = p.graph();
            let mut c = DeviceCost {
                blocks: ranges
                    .iter()
                    .enumerate()
                    .filter(|(vs, _)| l.options.map.device_of(*vs).0 == d)
                    .map(|(_, (a, b))| b.saturating_sub(*a))
                    .sum(),
                peak_bytes: dev.lowered.memory.peak_bytes as f64,
                ..DeviceCost::default()
            };
            let experts = cost.expert_share(g);
            for instr in &p.instrs {
                let tessera_ir::Instr::Run(id) = *instr else { continue };
                let Some(slot) = dev.slot_of.get(id.index()).copied().flatten() else { continue };
                let n = g.node(id);
                if slot.micro_batch != 0 || n.phase == Phase::Optimizer {
                    continue;
                }
                let secs = node_seconds(p, id, full, cost, experts);
                match (n.block, n.phase) {
                    (Some(_), Phase::Recompute) => c.recompute_s += secs,
                    (Some(_), _) => c.block_s += secs,
                    (None, _) => c.extra_s += secs,
                }
            }
            // State scales with the parameters it belongs to (one ZeRO stage for all).
            let (mut in_blocks, mut all) = (0.0, 0.0);
            for n in &g.nodes {
                if let Op::Parameter { .. } = n.op {
                    let b = g.meta(n.outputs[0]).size_bytes() as f64;
                    all += b;
                    if n.block.is_some() {
                        in_blocks += b;
                    }
                }
            }
            let m = &dev.lowered.memory;
            let state = (m.params_bytes + m.grads_bytes + m.optimizer_bytes) as f64;
            c.block_state_bytes = if all > 0.0 { state * in_blocks / all } else { 0.0 };
            c
        })
        .collect()
}

/// A stage of the re-cut pipeline.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Choice {
    blocks: usize,
    mode: usize,
    secs: f64,
}

/// A re-cut pipeline: its config and its modelled step time relative to the even one's.
#[derive(Clone, Debug, PartialEq)]
pub struct Recut {
    pub config: ParallelConfig,
    /// `(m − 1)·slowest + Σ stages` (1F1B's makespan in slot times) over the even split's.
    pub ratio: f64,
}

/// The re-cut layout for `cfg` (even stages, uniform checkpointing, lowered as `l`): `None`
/// when the pass finds no layout under `budget`, or the best one is the even split itself.
/// `costs` must hold the config's own mode. An interleaved pipeline keeps its even chunks (a
/// device's chunks are not adjacent, so block ranges do not form a chain) and chooses each
/// device's checkpointing: the fastest mode that fits it.
pub fn rebalance(
    cfg: &ParallelConfig,
    l: &PipeLowered,
    devices: &[DeviceCost],
    costs: &BlockCosts,
    budget: f64,
) -> Option<Recut> {
    let kind = l.options.schedule;
    if devices.len() < 2 || !cfg.stages.is_empty() {
        return None;
    }
    // A device's chunks split its blocks evenly, and what its order holds is per chunk.
    let v = kind.chunks().max(1) as f64;
    let uniform = cfg.ckpt.unwrap_or(CkptMode::None);
    let here_index = costs.modes.iter().position(|m| m.mode == uniform)?;
    let here = &costs.modes[here_index];
    let nb: usize = devices.iter().map(|d| d.blocks).sum();
    let total_block_s: f64 = devices.iter().map(|d| d.block_s).sum();
    let block_s = total_block_s / nb.max(1) as f64;
    let sched = &l.schedule;
    let held = |d: usize, m: &ModeCost| {
        let wi = if kind == ScheduleKind::ZbH1 {
            m.kept_bytes.max(costs.weight_inputs_bytes)
        } else {
            m.kept_bytes
        };
        sched.peak_held(d, m.kept_bytes, wi) / v
    };
    // Per device and mode: seconds per micro-batch and bytes at the peak, for n blocks.
    let secs = |d: usize, n: usize, m: &ModeCost| {
        devices[d].extra_s + n as f64 * (block_s + m.recompute_s)
    };
    // Per device: its peak without its blocks, and what a block adds under each mode (the
    // schedule walked once per device and mode, not in the DP's inner loop).
    let per_block: Vec<Vec<f64>> = (0..devices.len())
        .map(|d| {
            let sigma = devices[d].block_state_bytes / devices[d].blocks.max(1) as f64;
            costs.modes.iter().map(|m| sigma + held(d, m)).collect()
        })
        .collect();
    let base: Vec<f64> = (0..devices.len())
        .map(|d| devices[d].peak_bytes - devices[d].blocks as f64 * per_block[d][here_index])
        .collect();
    let p = devices.len();
    let secs_of = |d: usize, n: usize, mi: usize| secs(d, n, &costs.modes[mi]);
    let fits = |d: usize, n: usize, mi: usize| base[d] + n as f64 * per_block[d][mi] <= budget;
    let chosen = if kind.chunks() == 1 {
        cut(p, nb, costs.modes.len(), &secs_of, &fits)?
    } else {
        let blocks: Vec<usize> = devices.iter().map(|d| d.blocks).collect();
        modes_per_device(&blocks, costs.modes.len(), &secs_of, &fits)?
    };
    let even = super::split::StageMap::even(nb, p, kind.chunks(), 0).ok()?.block_ranges();
    let even: Vec<usize> = even.iter().map(|(a, b)| b - a).collect();
    // Per virtual stage: its blocks and its device's mode.
    let (sizes, modes): (Vec<usize>, Vec<CkptMode>) = if kind.chunks() == 1 {
        chosen.iter().map(|c| (c.blocks, costs.modes[c.mode].mode)).unzip()
    } else {
        even.iter().enumerate().map(|(vs, &n)| (n, costs.modes[chosen[vs % p].mode].mode)).unzip()
    };
    let one_mode = modes.iter().all(|&m| m == modes[0]);
    if sizes == even && one_mode && modes[0] == uniform {
        return None;
    }
    let ckpt = if one_mode { modes[0] } else { uniform };
    let ckpt = (ckpt != CkptMode::None).then_some(ckpt);
    let stages = if sizes == even && one_mode {
        Vec::new()
    } else {
        super::layout::from_parts(&sizes, &modes, ckpt)
    };
    let m = cfg.micro_batches.max(1) as f64;
    let makespan =
        |t: &[f64]| (m - 1.0) * t.iter().copied().fold(0.0, f64::max) + t.iter().sum::<f64>();
    let before: Vec<f64> = (0..p).map(|d| secs(d, devices[d].blocks, here)).collect();
    let after: Vec<f64> = chosen.iter().map(|c| c.secs).collect();
    let ratio = makespan(&after) / makespan(&before).max(f64::MIN_POSITIVE);
    Some(Recut { config: cfg.clone().with_stages(stages).with_ckpt(ckpt), ratio })
}

/// Each device's fastest mode that fits it, its blocks fixed (`blocks[d]`): `None` when some
/// device fits under none.
fn modes_per_device(
    blocks: &[usize],
    modes: usize,
    secs: &dyn Fn(usize, usize, usize) -> f64,
    fits: &dyn Fn(usize, usize, usize) -> bool,
) -> Option<Vec<Choice>> {
    blocks
        .iter()
        .enumerate()
        .map(|(d, &n)| {
            (0..modes)
                .filter(|&m| fits(d, n, m))
                .map(|mode| Choice { blocks: n, mode, secs: secs(d, n, mode) })
                .min_by(|a, b| a.secs.total_cmp(&b.secs))
        })
        .collect()
}

/// The dynamic programme over contiguous block ranges: `p` stages of at least one block each
/// covering `nb` blocks in order, each with one of `modes` modes, every stage fitting
/// (`fits(stage, blocks, mode)`); the slowest stage (`secs(stage, blocks, mode)`) as fast as
/// possible, then the sum of the stages. `None` when nothing fits.
fn cut(
    p: usize,
    nb: usize,
    modes: usize,
    secs: &dyn Fn(usize, usize, usize) -> f64,
    fits: &dyn Fn(usize, usize, usize) -> bool,
) -> Option<Vec<Choice>> {
    if p == 0 || nb < p {
        return None;
    }
    // best[d][k]: devices 0..d running blocks 0..k — (slowest, sum, last choice), the least
    // by `key`, among stages no slower than `cap`.
    let solve = |cap: f64, sum_first: bool| -> Option<Vec<Choice>> {
        type Cell = Option<(f64, f64, Choice)>;
        let key = |c: &(f64, f64, Choice)| if sum_first { (c.1, c.0) } else { (c.0, c.1) };
        let mut best: Vec<Vec<Cell>> = vec![vec![None; nb + 1]; p + 1];
        best[0][0] = Some((0.0, 0.0, Choice { blocks: 0, mode: 0, secs: 0.0 }));
        for d in 0..p {
            let rest = p - d - 1;
            for k in 0..=nb {
                let Some((worst, sum, _)) = best[d][k] else { continue };
                let left = nb - k;
                // The last stage takes what is left; the others leave a block for each after.
                let range = if rest == 0 { left..=left } else { 1..=left.saturating_sub(rest) };
                for n in range.filter(|&n| n > 0) {
                    for mode in 0..modes {
                        let t = secs(d, n, mode);
                        if t > cap || !fits(d, n, mode) {
                            continue;
                        }
                        let cand = (worst.max(t), sum + t, Choice { blocks: n, mode, secs: t });
                        let cell = &mut best[d + 1][k + n];
                        if cell.as_ref().is_none_or(|c| key(&cand) < key(c)) {
                            *cell = Some(cand);
                        }
                    }
                }
            }
        }
        let mut out = Vec::with_capacity(p);
        let mut k = nb;
        for d in (1..=p).rev() {
            let (_, _, c) = best[d][k]?;
            out.push(c);
            k -= c.blocks;
        }
        out.reverse();
        Some(out)
    };
    let fastest = solve(f64::INFINITY, false)?;
    let cap = fastest.iter().map(|c| c.secs).fold(0.0, f64::max) * (1.0 + 1e-9);
    Some(solve(cap, true).unwrap_or(fastest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cut_balances_a_heavy_last_stage() {
        // 8 blocks of 1 s over 4 stages; the last also runs a head of 2 s: 3,2,2,1 → slowest
        // 3 s (even stages: 4 s).
        let secs = |d: usize, n: usize, _| n as f64 + if d == 3 { 2.0 } else { 0.0 };
        let c = cut(4, 8, 1, &secs, &|_, _, _| true).unwrap();
        let sizes: Vec<usize> = c.iter().map(|c| c.blocks).collect();
        assert_eq!(c.iter().map(|c| c.secs).fold(0.0, f64::max), 3.0);
        assert_eq!(sizes.iter().sum::<usize>(), 8);
        assert_eq!(sizes[3], 1, "{sizes:?}");
    }

    #[test]
    fn interleaved_devices_choose_their_own_mode() {
        // Two devices of 4 blocks; device 0 (the most micro-batches in flight) fits only
        // under mode 1, which recomputes; device 1 keeps everything.
        let secs = |_, n: usize, m: usize| n as f64 * if m == 1 { 1.3 } else { 1.0 };
        let fits = |d: usize, _, m: usize| d == 1 || m == 1;
        let c = modes_per_device(&[4, 4], 2, &secs, &fits).unwrap();
        let got: Vec<(usize, usize)> = c.iter().map(|c| (c.blocks, c.mode)).collect();
        assert_eq!(got, [(4, 1), (4, 0)]);
        assert!(modes_per_device(&[4, 4], 2, &secs, &|_, _, _| false).is_none());
    }

    #[test]
    fn the_cut_checkpoints_only_the_stage_that_needs_it() {
        // 2 stages of 4 blocks; mode 1 recomputes (1.3 s a block instead of 1 s) and keeps a
        // fifth of the memory. Stage 0 holds 2 micro-batches: without checkpointing its
        // blocks need 2 × 10 bytes each, over the budget of 50 for 3 or more blocks.
        let secs = |_, n: usize, m: usize| n as f64 * if m == 1 { 1.3 } else { 1.0 };
        let fits = |d: usize, n: usize, m: usize| {
            let per = if m == 1 { 2.0 } else { 10.0 } * if d == 0 { 2.0 } else { 1.0 };
            n as f64 * per <= 50.0
        };
        let c = cut(2, 8, 2, &secs, &fits).unwrap();
        // Stage 1 keeps at most 5 blocks (50 / 10). Stage 0 keeping 2 leaves stage 1 six, to
        // checkpoint (7.8 s); checkpointing 3 on stage 0 (3.9 s) lets stage 1 keep its 5
        // (5 s), the fastest.
        let got: Vec<(usize, usize)> = c.iter().map(|c| (c.blocks, c.mode)).collect();
        assert_eq!(got, [(3, 1), (5, 0)], "{c:?}");
        assert_eq!(c.iter().map(|c| c.secs).fold(0.0, f64::max), 5.0);
        // Nothing fits: no cut.
        assert!(cut(2, 8, 2, &secs, &|_, _, _| false).is_none());
        assert!(cut(3, 2, 1, &secs, &|_, _, _| true).is_none());
    }
}
