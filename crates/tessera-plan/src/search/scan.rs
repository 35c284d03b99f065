//! The micro-batch scan's bound: which micro-batch counts a miss already rules out.
//!
//! The planner scans each (mesh, rule, ZeRO stage) over growing micro-batch counts until one
//! fits ([`crate::planner`]); on a large model most counts miss, and every miss costs a
//! lowering. A miss at `m` micro-batches says more than "not `m`": its most frugal layout
//! peaks at `P(m)`, and every device holds at least `F` bytes before a step whatever the
//! layout — its share of the parameters and their optimizer state, all sharded `N` ways
//! ([`resting_floor`]). What lies above `F` is activations, which shrink with the
//! micro-batch (at most in proportion: gathered weights, buffers and workspace do not
//! shrink), and state above the floor, which does not shrink at all. So at `m' > m`
//! micro-batches no layout peaks under
//!
//! `F + (P(m) − F) · m / m'`,
//!
//! and the counts whose bound misses the budget are skipped without a lowering ([`Miss`]).
//! Like the least-peak report ([`super::LeastPeak`]), it trusts the ILP's most frugal layout
//! to be the least a count reaches. Skipped candidates join [`super::SearchState::deferred`], so
//! a search where nothing fits still evaluates them and reports its least peak exactly.

use super::space::{optimizer_bytes_per_elem, Space};
use super::Search;
#[cfg(test)]
use crate::figures::Miss;
use crate::rules::local_meta;
use crate::Mesh;
use crate::Result;
use tessera_ir::{Graph, Op};

/// The least bytes resting on any one of `devices` devices before a step, whatever the
/// layout: the parameters and the AdamW state of the trained ones (moments, and the f32 master
/// copy of a parameter stored in lower precision; a frozen one, LoRA's base, has none), spread
/// evenly over every device. Each element is held somewhere, so the busiest device holds at
/// least the average. (Counting optimizer state for frozen weights would overstate the floor,
/// and with it the scan's bound: a count that fits could be skipped.)
pub fn resting_floor(p: &Search<'_>, micro_batch: usize, devices: usize) -> Result<u64> {
    let shared = p.forward(micro_batch)?;
    let g = &shared.0.graph;
    let total: f64 = g
        .nodes
        .iter()
        .filter_map(|n| match n.op {
            Op::Parameter { frozen, .. } => Some(n.outputs.iter().map(move |&t| (t, frozen))),
            _ => None,
        })
        .flatten()
        .map(|(t, frozen)| {
            let meta = g.meta(t);
            let state = match frozen {
                true => 0.0,
                false => meta.numel() as f64 * optimizer_bytes_per_elem(meta.dtype),
            };
            meta.size_bytes() as f64 + state
        })
        .sum();
    Ok((total / devices.max(1) as f64).floor() as u64)
}

/// The least bytes any layout in `space` rests on each device before a step at ZeRO stage
/// `zero`, without offload: per parameter, the least over the specs its first reader may ask
/// for (the lowering stores a parameter as its first reader wants it, `lower.rs`
/// `plan_params`) of its local bytes and its AdamW state's. ZeRO splits the state (and at
/// stage 3 the parameter) over the live mesh axes the stored spec leaves free but a hybrid
/// group's replica axes, or over fewer (an axis with no gradient pending, a dim they do not
/// divide); the floor divides by all of them. When it misses the budget, so does every
/// micro-batch count of the (mesh, rule, ZeRO stage), under any checkpointing: DeepSeek-V3's
/// ZeRO-0 Megatron layouts (and many of its ZeRO-1 and -2 ones), whose replicated weights
/// and state rest at hundreds of GiB a device, each cost a lowering and two finishes before
/// the lowered Program said so.
pub(super) fn layout_floor(g: &Graph, mesh: &Mesh, space: &Space, zero: u8) -> u64 {
    let consumers = g.consumers();
    let mut total = 0.0;
    for n in &g.nodes {
        let Op::Parameter { frozen, .. } = n.op else { continue };
        for &p in &n.outputs {
            let Some(&reader) = consumers[p.index()].first() else { continue };
            let node = g.node(reader);
            let Some(k) = node.inputs.iter().position(|&x| x == p) else { continue };
            let meta = g.meta(p);
            let state_per_elem = if frozen { 0.0 } else { optimizer_bytes_per_elem(meta.dtype) };
            let least = space
                .input_specs(reader.index(), k)
                .filter_map(|spec| {
                    let local = local_meta(meta, spec, mesh)?;
                    // Hybrid sharding's replica axes keep whole copies.
                    let free: usize = (0..mesh.ndim())
                        .filter(|&a| mesh.shape[a] > 1 && !spec.uses_axis(a))
                        .filter(|a| !mesh.replicas.contains(a))
                        .map(|a| mesh.shape[a])
                        .product();
                    let (param_div, state_div) = match zero {
                        0 => (1.0, 1.0),
                        1 | 2 => (1.0, free as f64),
                        _ => (free as f64, free as f64),
                    };
                    let elems = local.numel() as f64;
                    Some(local.size_bytes() as f64 / param_div + elems * state_per_elem / state_div)
                })
                .fold(f64::INFINITY, f64::min);
            if least.is_finite() {
                total += least;
            }
        }
    }
    total.floor() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_shrinks_only_what_lies_above_the_floor() {
        let miss = Miss { micro_batches: 2, least_peak: 100, resting: 60 };
        // Floor 40: 40 + 60 · 2/8 = 55.
        assert_eq!(miss.bound(8, 40), 55);
        // The floor never exceeds what the miss itself rested at.
        assert_eq!(miss.bound(4, 90), 60 + 40 * 2 / 4);
        assert!(miss.rules_out(4, 40, 69));
        assert!(!miss.rules_out(4, 40, 70));
        // A count no larger than the miss's is never ruled out by it.
        assert!(!miss.rules_out(2, 40, 0));
    }
}
