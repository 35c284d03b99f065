//! Pricing many micro-batches from a few.
//!
//! Gradient accumulation replays one micro-batch's graph `m` times ([`crate::lower`]): the
//! first micro-batch starts the accumulators, the last one synchronises gradients early, and
//! every one between runs the same instructions on the same state. So once there is a
//! micro-batch between the first and the last, every figure the lowering predicts — the parts
//! of the step time, each byte count, the peak — grows by the same amount per micro-batch
//! (the step time's parts already from two; the peak may sit in the last micro-batch with two
//! and in a middle one from three on, so it needs three):
//!
//! `x(m) = x(4) + (m − 4) · (x(4) − x(3))`.
//!
//! All but one: the collectives the compute does not hide are a difference clamped at zero,
//! not linear in `m` (a gradient reduction exposed under four micro-batches' backward passes
//! hides under thirty-two), so they — and the step time that sums them — are recomputed from
//! the extrapolated parts.
//!
//! The search lowers a candidate of `m > 7` micro-batches as the Programs of 4 and 3 and
//! extrapolates ([`Twin`]): seven replays of the graph instead of `m`, which is what made
//! large models' searches slow (llama2-70b lowers 16–64 micro-batches of 80 blocks). Its
//! figures are marked inexact ([`Lowered::exact`]); the plan the search picks
//! is lowered exactly ([`crate::search::exactly`]) and checked against the budget again, so what a plan
//! predicts is always its own Program's. `tests/priced.rs` checks that the two agree.

use super::{differentiate, finish, replay, LowerOptions, Lowered, StepTime, Unfinished};
use crate::cost::CostModel;
use crate::rules::Strategy;
use crate::{Mesh, Result};
use tessera_ir::{Graph, TensorId};
use tessera_profile::MemoryReport;

/// Micro-batches the longer of the two priced Programs holds.
pub const REPLICAS: usize = 4;

/// Up to this many micro-batches a candidate is lowered as it is (its replays cost no more
/// than the two priced Programs').
pub const EXACT_UP_TO: usize = 2 * REPLICAS - 1;

/// The shorter Program of a priced pair, and the micro-batch count the figures are for.
#[derive(Clone, Debug)]
pub struct Twin {
    pub target: usize,
    pub fewer: Box<Unfinished>,
}

impl Twin {
    /// `longer` (the Program of `replicas` micro-batches) with its memory and time extended to
    /// [`Twin::target`] micro-batches by the difference to the shorter Program under the same
    /// checkpointing.
    pub fn extend(
        &self,
        longer: Lowered,
        replicas: usize,
        mesh: &Mesh,
        cost: &CostModel,
    ) -> Result<Lowered> {
        let shorter = finish(&self.fewer, &longer.ckpt, mesh, cost)?;
        let steps = self.target.saturating_sub(replicas) as f64;
        Ok(Lowered {
            memory: extend_memory(&longer.memory, &shorter.memory, steps),
            time: extend_time(&longer.time, &shorter.time, steps),
            exact: false,
            ..longer
        })
    }
}

fn bytes(long: u64, short: u64, steps: f64) -> u64 {
    let per = long as f64 - short as f64;
    (long as f64 + steps * per).max(0.0).round() as u64
}

fn secs(long: f64, short: f64, steps: f64) -> f64 {
    long + steps * (long - short)
}

fn extend_memory(long: &MemoryReport, short: &MemoryReport, steps: f64) -> MemoryReport {
    let b = |l: u64, s: u64| bytes(l, s, steps);
    MemoryReport {
        params_bytes: b(long.params_bytes, short.params_bytes),
        grads_bytes: b(long.grads_bytes, short.grads_bytes),
        optimizer_bytes: b(long.optimizer_bytes, short.optimizer_bytes),
        activations_bytes: b(long.activations_bytes, short.activations_bytes),
        inputs_bytes: b(long.inputs_bytes, short.inputs_bytes),
        kv_cache_bytes: b(long.kv_cache_bytes, short.kv_cache_bytes),
        activations_by_block: long
            .activations_by_block
            .iter()
            .enumerate()
            .map(|(i, &l)| b(l, short.activations_by_block.get(i).copied().unwrap_or(l)))
            .collect(),
        max_workspace_bytes: b(long.max_workspace_bytes, short.max_workspace_bytes),
        peak_bytes: b(long.peak_bytes, short.peak_bytes),
        host_peak_bytes: b(long.host_peak_bytes, short.host_peak_bytes),
        nvme_peak_bytes: b(long.nvme_peak_bytes, short.nvme_peak_bytes),
        peak_instr: long.peak_instr,
        peak_by_role: long
            .peak_by_role
            .iter()
            .map(|&(role, l)| {
                let s = short.peak_by_role.iter().find(|(r, _)| *r == role).map_or(l, |x| x.1);
                (role, b(l, s))
            })
            .collect(),
        live_at_peak: long.live_at_peak.clone(),
        resting_bytes: b(long.resting_bytes, short.resting_bytes),
    }
}

/// Every part of the step that grows by the same amount per micro-batch, extrapolated; the
/// exposed collectives and the step recomputed from them. The exposed part is a difference
/// clamped at zero (collectives less the compute that hides them): a gradient reduction that
/// four micro-batches' backward passes do not hide is hidden by thirty-two, so extrapolating
/// it (or the step that holds it) would price the step below its own Program's.
fn extend_time(long: &StepTime, short: &StepTime, steps: f64) -> StepTime {
    let s = |l: f64, sh: f64| secs(l, sh, steps);
    let mut t = StepTime {
        forward_compute_s: s(long.forward_compute_s, short.forward_compute_s),
        backward_compute_s: s(long.backward_compute_s, short.backward_compute_s),
        optimizer_compute_s: s(long.optimizer_compute_s, short.optimizer_compute_s),
        recompute_s: s(long.recompute_s, short.recompute_s),
        recompute_by_block_s: long
            .recompute_by_block_s
            .iter()
            .enumerate()
            .map(|(i, &l)| s(l, short.recompute_by_block_s.get(i).copied().unwrap_or(l)))
            .collect(),
        blocking_comm_s: s(long.blocking_comm_s, short.blocking_comm_s),
        overlapped_comm_s: s(long.overlapped_comm_s, short.overlapped_comm_s),
        overlapped_forward_comm_s: s(
            long.overlapped_forward_comm_s,
            short.overlapped_forward_comm_s,
        ),
        exposed_comm_s: 0.0,
        step_time_s: 0.0,
        compute_by_op_s: long
            .compute_by_op_s
            .iter()
            .map(|(&k, &l)| (k, s(l, short.compute_by_op_s.get(k).copied().unwrap_or(l))))
            .collect(),
        transfer_s: s(long.transfer_s, short.transfer_s),
        host_compute_s: s(long.host_compute_s, short.host_compute_s),
        offload_exposed_s: s(long.offload_exposed_s, short.offload_exposed_s),
        moved_bytes: bytes(long.moved_bytes, short.moved_bytes, steps),
        issue_wait_s: s(long.issue_wait_s, short.issue_wait_s),
    };
    t.exposed_comm_s = super::time::exposed_comm(&t);
    t.step_time_s = super::time::step_of_parts(&t);
    t
}

/// [`super::lower_unfinished`] of more than [`EXACT_UP_TO`] micro-batches, priced: the pair of
/// [`REPLICAS`] and one fewer micro-batches, sharing one differentiation.
pub(super) fn lower_unfinished(
    forward: &Graph,
    loss: TensorId,
    strategy: &[Option<Strategy>],
    mesh: &Mesh,
    opts: &LowerOptions,
) -> Result<Unfinished> {
    let m = opts.micro_batches.max(1);
    let (tg, leaf_specs) = differentiate(forward, loss, strategy, mesh, opts)?;
    let fewer = Unfinished {
        training: replay(&tg, REPLICAS - 1)?,
        leaf_specs: leaf_specs.clone(),
        micro_batches: REPLICAS - 1,
        priced: None,
        act_offload: opts.offload.is_some_and(|o| o.act),
    };
    Ok(Unfinished {
        training: replay(&tg, REPLICAS)?,
        leaf_specs,
        micro_batches: REPLICAS,
        priced: Some(Twin { target: m, fewer: Box::new(fewer) }),
        act_offload: opts.offload.is_some_and(|o| o.act),
    })
}
