//! The inter-op phase of the automatic search: pipelined candidates, screened cheaply and
//! verified exactly.
//!
//! A candidate is a [`Shape`] (`pp × dp × tp`, sequence parallel, ZeRO inside the data-parallel
//! groups), a micro-batch size, a uniform checkpointing mode and a schedule. Repeated blocks
//! make stages alike, so the screen lowers **one micro-batch of the whole model on the stage's
//! mesh** per (shape, micro-batch size, mode) — the intra-op search's own layout — and scales
//! it to a stage: `1/pp` of its compute, state and saved activations per chunk, its
//! activations times the schedule's micro-batches in flight on the first device, the
//! schedule's makespan simulated on those slot times ([`super::schedule::Schedule::simulate`]).
//! The fastest estimates are then lowered exactly, every device's Program under its schedule
//! (the fixed-config path), and a plan fits only when its worst device fits.
//!
//! The screen is an estimate (each device's memory from its own blocks' shares of the sample
//! — blocks may differ, as DeepSeek-V3's dense and sparse layers do — and the embedding's and
//! head's parameters on the first and last; its time from the average block; transfers are
//! not priced); the verification is not. The knobs say how wide
//! each step looks ([`PipelineKnobs`]).

use super::balance::BlockCosts;
use super::schedule;
use super::{Pass, ScheduleKind, Slot};
use crate::config::ParallelConfig;
use crate::lower::{finish, lower_unfinished, Fidelity, LowerOptions, Lowered};
use crate::search::{self, AxisRule, Candidate, Search};
use crate::{Cluster, Mesh, PlanError, Result};
use std::sync::Arc;
use tessera_ir::{Checkpointing, CkptMode};

/// How wide the pipeline phase looks.
#[derive(Clone, Debug)]
pub struct PipelineKnobs {
    /// Search pipelined plans at all.
    pub enabled: bool,
    /// Sequences per micro-batch per data-parallel replica (the micro-batch count follows).
    pub micro_batch_sizes: Vec<usize>,
    /// Schedules priced for each shape.
    pub schedules: Vec<ScheduleKind>,
    /// Uniform checkpointing modes priced for each shape.
    pub ckpt_modes: Vec<CkptMode>,
    /// Candidates lowered exactly, fastest estimate first.
    pub verify: usize,
    /// A candidate whose estimated peak exceeds the budget by more than this factor is not
    /// verified. The estimate takes each device's own blocks, embedding and head, and runs
    /// under the exact worst device: 1–2% on llama2-70b, 8–11% on DeepSeek-V3's `pp32` (the
    /// backward's expert buffers), within 1% either way on tiny models. A candidate
    /// estimated over the budget does not fit, and a small margin covers the rest.
    pub memory_slack: f64,
    /// The phase runs before the phases without a pipeline (its plan bounding them, in one
    /// round) when the model state alone — parameters and their AdamW state spread over every
    /// device ([`crate::search::resting_floor`]) — takes at least this share of the budget:
    /// there a flat plan must shard and recompute heavily, and pipelines tend to win.
    /// Otherwise it runs between the flat search's two rounds, bounded by the first. Either
    /// order finds the same plan; the order only decides which bound prunes which phase.
    pub first_over_state_share: f64,
}

impl Default for PipelineKnobs {
    fn default() -> Self {
        PipelineKnobs {
            enabled: true,
            micro_batch_sizes: vec![1, 2],
            schedules: vec![
                ScheduleKind::OneFOneB,
                ScheduleKind::Interleaved { v: 2 },
                ScheduleKind::ZbH1,
            ],
            ckpt_modes: vec![CkptMode::None, CkptMode::Selective, CkptMode::Full],
            verify: 3,
            memory_slack: 1.02,
            first_over_state_share: 0.5,
        }
    }
}

impl PipelineKnobs {
    /// No pipelines (a run that must save, resume or evaluate: not supported under a pipeline
    /// yet).
    pub fn off() -> Self {
        PipelineKnobs { enabled: false, ..PipelineKnobs::default() }
    }
}

/// A pipelined layout without its micro-batching.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub pp: usize,
    pub dp: usize,
    pub tp: usize,
    pub sp: bool,
    /// ZeRO inside each stage's data-parallel group: 0 or 1 (stages 2 and 3 shard gradients or
    /// parameters that every micro-batch of the pipeline needs again, as in DeepSpeed, which
    /// refuses them with pipelines).
    pub zero: u8,
}

/// Every shape of `cluster` for a model of `num_blocks` blocks: `pp ≥ 2` dividing the devices
/// and at most the blocks, the tensor axis within a node, always with sequence parallelism
/// (Megatron's practice: the same traffic as without, a tp-th of the norms' activations), and
/// ZeRO-1 whenever there is a data-parallel group (the optimizer state and step shrink by dp
/// for the same traffic as an all-reduce).
pub fn shapes(cluster: &Cluster, num_blocks: usize) -> Vec<Shape> {
    let n = cluster.num_devices();
    let node = cluster.gpus_per_node.max(1);
    let mut out = Vec::new();
    for pp in (2..=n.min(num_blocks)).filter(|p| n.is_multiple_of(*p)) {
        let stage = n / pp;
        for tp in (1..=stage.min(node)).filter(|t| stage.is_multiple_of(*t)) {
            if !node.is_multiple_of(tp) {
                continue;
            }
            let dp = stage / tp;
            out.push(Shape { pp, dp, tp, sp: tp > 1, zero: u8::from(dp > 1) });
        }
    }
    out
}

/// One micro-batch of the whole model on a stage's mesh, under one checkpointing mode.
pub struct StageSample {
    pub mode: CkptMode,
    pub lowered: Lowered,
    /// Bytes one device sends to the next stage per micro-batch: what block 1 reads of block
    /// 0's outputs, over the data-parallel replicas (tensor parallelism may split it further).
    pub hop_bytes: u64,
    /// The saved activations of the same micro-batch without checkpointing: what a split
    /// backward's weight-gradient pass may still read (checkpointed blocks recompute their
    /// internals for `B`, and `W` reads them later), so what a pending `W` holds at most.
    pub weight_inputs_bytes: u64,
    /// Where the parameters' bytes sit (the same under every mode of one layout).
    pub params: Arc<ParamShares>,
}

/// A sampled layout's parameter bytes per device: in each block, and outside them on the
/// first stage (those a node before the first block reads: the embedding) or the last (the
/// final norm, the head); and the largest block parameter.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParamShares {
    pub per_block: Vec<f64>,
    pub first: f64,
    pub last: f64,
    pub all: f64,
    pub largest: f64,
}

impl ParamShares {
    /// The shares of `l`'s Program, a model of `num_blocks` blocks.
    pub fn of(l: &Lowered, num_blocks: usize) -> ParamShares {
        let g = l.program.graph();
        let first_block = g.nodes.iter().position(|n| n.block.is_some()).unwrap_or(0);
        let mut read_early = vec![false; g.tensors.len()];
        for n in &g.nodes[..first_block] {
            for t in &n.inputs {
                read_early[t.index()] = true;
            }
        }
        let mut out = ParamShares { per_block: vec![0.0; num_blocks], ..ParamShares::default() };
        for n in &g.nodes {
            if let tessera_ir::Op::Parameter { .. } = n.op {
                let b = g.meta(n.outputs[0]).size_bytes() as f64;
                out.all += b;
                match n.block.map(|k| k as usize).filter(|&k| k < num_blocks) {
                    Some(k) => {
                        out.per_block[k] += b;
                        out.largest = out.largest.max(b);
                    }
                    None if read_early[n.outputs[0].index()] => out.first += b,
                    None => out.last += b,
                }
            }
        }
        out
    }
}

/// Bytes of the tensors block 1 reads from block 0 (the activations crossing a stage
/// boundary between two repeated blocks), whole batch.
pub fn hop_bytes(g: &tessera_ir::Graph) -> u64 {
    let mut seen = std::collections::HashSet::new();
    let mut bytes = 0u64;
    for n in g.nodes.iter().filter(|n| n.block == Some(1)) {
        for &t in &n.inputs {
            if g.producer(t).block == Some(0) && seen.insert(t) {
                bytes += g.meta(t).size_bytes();
            }
        }
    }
    bytes
}

/// Samples and screens one (shape, micro-batch count): lowers one micro-batch (`p.problem.batch`
/// sequences over the stage's data-parallel replicas) on the stage mesh — the intra-op search's
/// layout under Megatron's rule for the shape — then each checkpointing mode of the knobs in
/// order of more recomputation, lazily: a heavier mode is lowered only while the lighter one
/// leaves a schedule over the memory slack and its fastest estimate beats `bound`
/// (recomputation only adds time). Returns the candidates the screen passes ([`screen`]).
pub fn sample_and_screen(
    p: &Search<'_>,
    stage_mesh: &Mesh,
    at: &ScreenAt<'_>,
) -> Result<Vec<Screened>> {
    let shape = &at.shape;
    let cand = Candidate {
        mesh: stage_mesh.clone(),
        rule: AxisRule::Megatron { sp: shape.sp, cp: false },
        zero: shape.zero,
        micro_batches: 1,
        offload: None,
    };
    let Some(e) = search::evaluate(p, &cand, None)? else {
        return Ok(Vec::new());
    };
    let fwd = p.forward(p.problem.batch)?;
    let g = &fwd.0.graph;
    let nb = tessera_ir::remat::num_blocks(g);
    let hop = hop_bytes(g) / shape.dp.max(1) as u64;
    let params = Arc::new(ParamShares::of(&e.lowered, nb as usize));
    let mut out = Vec::new();
    let mut costs = BlockCosts {
        modes: Vec::new(),
        weight_inputs_bytes: BlockCosts::mode_cost(CkptMode::None, &e.lowered).kept_bytes,
    };
    // The stage's layout lowered once, before checkpointing: every mode sampled finishes it.
    let mut unfinished = None;
    for &mode in &at.knobs.ckpt_modes {
        let lowered = if mode == CkptMode::None {
            e.lowered.clone()
        } else {
            if unfinished.is_none() {
                let opts = LowerOptions {
                    zero: shape.zero,
                    micro_batches: 1,
                    train: p.problem.train.clone(),
                    ckpt: Checkpointing::default(),
                    offload: None,
                };
                let (loss, strategies) = (fwd.0.loss, &e.strategies);
                let u = lower_unfinished(g, loss, strategies, stage_mesh, &opts, Fidelity::Exact)?;
                unfinished = Some(u);
            }
            let Some(u) = &unfinished else {
                return Err(crate::PlanError::Internal("the stage was not lowered".into()));
            };
            finish(u, &Checkpointing::uniform(nb, mode), stage_mesh, &p.problem.cost)?
        };
        let weight_inputs_bytes = e.lowered.memory.activations_bytes;
        costs.modes.push(BlockCosts::mode_cost(mode, &lowered));
        let params = Arc::clone(&params);
        let sample = StageSample { mode, lowered, hop_bytes: hop, weight_inputs_bytes, params };
        let unbounded = ScreenAt { budget: f64::INFINITY, bound: f64::INFINITY, ..*at };
        let all = screen(&[sample], &unbounded)?;
        let fastest = all.iter().map(|c| c.estimate.step_time_s).fold(f64::INFINITY, f64::min);
        let limit = at.budget * at.knobs.memory_slack;
        let all_fit = all.iter().all(|c| c.estimate.peak_bytes <= limit);
        out.extend(
            all.into_iter()
                .filter(|c| c.estimate.peak_bytes <= limit && c.estimate.step_time_s < at.bound),
        );
        if all_fit || fastest >= at.bound {
            break;
        }
    }
    // Every candidate of the shape may re-cut its stages with any mode sampled for it.
    let costs = Arc::new(costs);
    for c in &mut out {
        c.costs = Arc::clone(&costs);
    }
    Ok(out)
}

/// The screen's figures for one candidate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    pub step_time_s: f64,
    /// The worst device's.
    pub peak_bytes: f64,
}

/// Scales a whole-model sample to `pp` stages under `kind` with `m` micro-batches: each chunk
/// gets the largest chunk's share of the `num_blocks` blocks (`1/(pp·v)` when they split
/// evenly) of the forward, backward, recomputation and tensor-parallel traffic (a
/// third of it in the forward), the schedule is simulated on those slot times, and the
/// optimizer and exposed gradient synchronisation (`1/pp` each) follow the flush. Memory: the
/// worst device's of the even split, from its own blocks ([`worst_device`]); without per-block
/// figures, a chunk's average share of the state, plus what the order holds at once of a
/// chunk's saved activations and, under a split backward, of the weight-gradient inputs
/// pending `W` (see [`super::schedule::Schedule::peak_held`]), plus the sample's transient
/// peak. Each transfer between stages takes `hop_s`.
pub fn estimate(
    sample: &StageSample,
    pp: usize,
    m: usize,
    kind: ScheduleKind,
    hop_s: f64,
    num_blocks: usize,
) -> Result<Estimate> {
    let s = &sample.lowered;
    let t = &s.time;
    // A chunk's share: the largest chunk's blocks (when the blocks do not split evenly, the
    // slowest stage paces the pipeline and the fullest one holds the most).
    let chunks = pp * kind.chunks();
    let parts = match num_blocks {
        0 => chunks as f64,
        nb => nb as f64 / nb.div_ceil(chunks) as f64,
    };
    let comm = t.blocking_comm_s;
    let f = (t.forward_compute_s + comm / 3.0) / parts;
    let b = (t.backward_compute_s + t.recompute_s + 2.0 * comm / 3.0) / parts;
    let sched = schedule::build(kind, pp, m).map_err(PlanError::Invalid)?;
    let split = kind.splits_backward();
    let duration = |_: usize, slot: Slot| match slot.pass {
        Pass::F => f,
        Pass::B if split => b / 2.0,
        Pass::B => b,
        Pass::W => b / 2.0,
    };
    let timeline = sched.simulate(&duration, &|_, _| hop_s).map_err(PlanError::Internal)?;
    let tail = (t.optimizer_compute_s + t.exposed_comm_s) / pp as f64;
    let mem = &s.memory;
    let state = (mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes) as f64
        * kind.chunks() as f64
        / parts;
    let kept = mem.activations_bytes as f64 / parts;
    let weight_inputs = kept.max(sample.weight_inputs_bytes as f64 / parts);
    let transient =
        mem.peak_bytes.saturating_sub(mem.resting_bytes + mem.grads_bytes + mem.activations_bytes)
            as f64;
    let held = (0..pp).map(|d| sched.peak_held(d, kept, weight_inputs)).fold(0.0, f64::max);
    let averaged = state + held + transient;
    let per_device = worst_device(sample, &sched, pp, m, kind.chunks(), num_blocks, transient);
    // The average over blocks where the blocks do not split evenly into stages.
    let peak_bytes = if per_device > 0.0 { per_device } else { averaged };
    Ok(Estimate { step_time_s: timeline.makespan_s + tail, peak_bytes })
}

/// The worst device's peak with each device's own blocks of an even split: their share of the
/// model state (parameters, gradients, optimizer state, by their parameters' bytes) and of the
/// saved activations (by the sample's per-block figures), what its order holds of those at
/// once, and, with more than one micro-batch, a freshly computed gradient beside the
/// accumulated ones (the largest block parameter's: each micro-batch's gradient is added to
/// the running sum after it is made). Blocks that differ — DeepSeek-V3's dense first layers
/// and its mixture-of-experts ones — make the average over blocks low for the heavy stages;
/// this is not. 0 when the blocks do not split into `pp · chunks` stages.
fn worst_device(
    sample: &StageSample,
    sched: &schedule::Schedule,
    pp: usize,
    m: usize,
    chunks: usize,
    num_blocks: usize,
    transient: f64,
) -> f64 {
    let s = &sample.lowered;
    let Ok(map) = super::split::StageMap::even(num_blocks, pp, chunks, 0) else { return 0.0 };
    let by_block = &s.memory.activations_by_block;
    if by_block.len() != num_blocks {
        return 0.0;
    }
    let sh = &*sample.params;
    let (param_bytes, all) = (&sh.per_block, sh.all);
    if param_bytes.len() != num_blocks || all <= 0.0 {
        return 0.0;
    }
    let mem = &s.memory;
    let state_total = (mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes) as f64;
    // A gradient in its own dtype: the largest parameter's bytes scaled as the gradients are.
    let fresh = match (m > 1, mem.params_bytes) {
        (true, p) if p > 0 => sh.largest * mem.grads_bytes as f64 / p as f64,
        _ => 0.0,
    };
    let parts = num_blocks as f64 / num_blocks.div_ceil(pp * chunks.max(1)) as f64;
    let ranges = map.block_ranges();
    (0..pp)
        .map(|d| {
            let mut share = (if d == 0 { sh.first } else { 0.0 }
                + if d + 1 == pp { sh.last } else { 0.0 })
                / all;
            let mut kept = 0.0f64;
            for (vs, &(a, b)) in ranges.iter().enumerate() {
                if map.device_of(vs).0 != d || a >= b {
                    continue;
                }
                share += param_bytes[a..b].iter().sum::<f64>() / all;
                kept = kept.max(by_block[a..b].iter().map(|&x| x as f64).sum::<f64>());
            }
            let weight_inputs = kept.max(sample.weight_inputs_bytes as f64 / parts);
            state_total * share + sched.peak_held(d, kept, weight_inputs) + transient.max(fresh)
        })
        .fold(0.0, f64::max)
}

/// Where a screen looks: one shape at `m` micro-batches of a model of `num_blocks` blocks,
/// transfers between stages on `link`, against the per-device `budget` (bytes) and the `bound`
/// (seconds) a candidate must beat.
#[derive(Clone, Copy)]
pub struct ScreenAt<'k> {
    pub shape: Shape,
    pub m: usize,
    pub num_blocks: usize,
    pub knobs: &'k PipelineKnobs,
    pub link: crate::Link,
    pub budget: f64,
    pub bound: f64,
}

/// A screened candidate: its config string and estimate, and the per-block figures of its
/// shape's samples (for [`super::balance`]).
#[derive(Clone, Debug)]
pub struct Screened {
    pub config: ParallelConfig,
    pub estimate: Estimate,
    pub costs: Arc<BlockCosts>,
}

/// The config of `shape` with `m` micro-batches, `mode` and `kind`, if the model's blocks
/// allow it.
pub fn config(
    shape: &Shape,
    m: usize,
    mode: CkptMode,
    kind: ScheduleKind,
    num_blocks: usize,
) -> Option<ParallelConfig> {
    let cfg = ParallelConfig::new(shape.dp, shape.tp)
        .with_zero(shape.zero)
        .with_micro_batches(m)
        .with_sp(shape.sp)
        .with_ckpt((mode != CkptMode::None).then_some(mode))
        .with_pp(shape.pp)
        .with_schedule(Some(kind));
    // Interleaving needs the blocks to split into pp × V chunks; Megatron also wants the
    // micro-batches a multiple of pp.
    cfg.check_pipeline(num_blocks, Some(m)).ok()?;
    if let ScheduleKind::Interleaved { v } = kind {
        if !num_blocks.is_multiple_of(shape.pp * v) {
            return None;
        }
    }
    Some(cfg)
}

/// Screens every (mode, schedule) of one (shape, micro-batch count) sample set: candidates
/// whose estimated peak is within the knobs' slack of `budget` and whose estimated step beats
/// `bound`. Transfers between stages cross `link`.
pub fn screen(samples: &[StageSample], at: &ScreenAt<'_>) -> Result<Vec<Screened>> {
    let ScreenAt { ref shape, m, num_blocks, knobs, link, budget, bound } = *at;
    let mut out = Vec::new();
    for s in samples {
        let hop_s = match s.hop_bytes {
            0 => 0.0,
            b => link.latency_s + b as f64 / link.bandwidth,
        };
        for &kind in &knobs.schedules {
            let Some(config) = config(shape, m, s.mode, kind, num_blocks) else { continue };
            let e = estimate(s, shape.pp, m, kind, hop_s, num_blocks)?;
            if e.peak_bytes <= budget * knobs.memory_slack && e.step_time_s < bound {
                out.push(Screened { config, estimate: e, costs: Arc::default() });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_cover_pp_dp_tp_within_a_node() {
        let c = Cluster::parse("2x4xH100").unwrap();
        let s = shapes(&c, 4);
        // pp ∈ {2, 4} (8 exceeds the blocks); tp within a node of 4: pp2 × tp{1,2,4},
        // pp4 × tp{1,2}.
        assert!(s.iter().all(|x| x.pp * x.dp * x.tp == 8 && x.pp <= 4 && x.tp <= 4));
        assert_eq!(s.len(), 5, "{s:?}");
        assert!(s.contains(&Shape { pp: 2, dp: 1, tp: 4, sp: true, zero: 0 }));
        assert!(s.contains(&Shape { pp: 4, dp: 2, tp: 1, sp: false, zero: 1 }));
        assert!(!s.iter().any(|x| x.pp == 8));
        // ZeRO-1 exactly with a data-parallel group, sequence parallelism exactly with tp.
        assert!(s.iter().all(|x| (x.dp > 1) == (x.zero == 1) && (x.tp > 1) == x.sp));
        assert!(shapes(&Cluster::parse("1xH100").unwrap(), 8).is_empty());
    }

    #[test]
    fn interleaving_needs_blocks_that_split_into_chunks() {
        let shape = Shape { pp: 2, dp: 1, tp: 1, sp: false, zero: 0 };
        let il = ScheduleKind::Interleaved { v: 2 };
        assert!(config(&shape, 4, CkptMode::None, il, 8).is_some());
        assert!(config(&shape, 4, CkptMode::None, il, 6).is_none());
        let c = config(&shape, 4, CkptMode::Full, ScheduleKind::ZbH1, 6).unwrap();
        assert_eq!(c.canonical(), ParallelConfig::parse(&c.canonical()).unwrap().canonical());
        assert_eq!(c.ckpt, Some(CkptMode::Full));
    }
}
