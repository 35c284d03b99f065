//! The offload phase of the automatic search: when nothing fits on the devices, the fastest
//! plan that keeps some chunks' state on the host (or the NVMe) and fits every tier.
//!
//! Over every Megatron-style `dp × tp (sp)` layout and ZeRO stage (0 on one replica; 1 and 3
//! with data parallelism), each offload kind (`opt`, `grads+opt`, `all`), and micro-batch counts from
//! the fewest: the first count at which offloading every chunk fits the device is taken, the
//! fewest chunks that still fit are found by bisection (the device peak only falls as chunks
//! leave it; the host's only rises; the step only slows, the host's AdamW being slower than the
//! device's), and when the host cannot hold their state, the fewest of them whose state on the
//! NVMe lets it (bisection again: each chunk moved to the NVMe lowers the host peak and adds
//! NVMe traffic). Each probe is the ordinary candidate evaluation — sharding ILP, joint
//! checkpointing, the Program lowered and simulated — with the offload in its lowering, so a
//! plan's host and NVMe peaks are its Program's. A fit whose host (or NVMe) peak misses its
//! tier is kept aside for the error, which then names the least memory per tier that would do.
//!
//! Activation offload (`offload=act`, [`crate::lower::act_offload`]) is tried only when none of
//! those fits every tier — so a plan that fits without it is unchanged: the same lines again
//! with the kept inputs of fully checkpointed blocks on the host, plus a line offloading
//! activations alone (no model state: probed once per micro-batch count). The joint
//! checkpointing of each probe sees what it frees: a full block's input no longer counts as
//! kept on the device, its copy back is in the block's backward peak. On the grid's
//! context-parallel layouts (`dp × cp × tp`) only that last line is tried: activation offload
//! is the one offload cp composes with.

use super::rounds::{megatron_jobs, parallel_map, Job};
use super::Request;
use crate::config::ParallelConfig;
use crate::mesh::AxisName;
use crate::offload::{Offload, OffloadKind, CHUNKS};
use crate::search::{self, AxisRule, Candidate, Evaluated, Search};
use crate::{Mesh, PlanError, Result};
use tessera_ir::Tier;

/// What the phase found: the fastest fit of every tier, or what the tiers missed by.
pub(super) struct OffloadPhase {
    pub(super) fit: Option<Evaluated>,
    /// Least host memory (and NVMe) a device-fitting offloaded plan needs, with its config.
    pub(super) least_tiers: Option<(u64, u64, String)>,
}

/// One (layout, ZeRO stage, kind) line of the phase.
struct Line {
    mesh: Mesh,
    sp: bool,
    zero: u8,
    /// The model state offloaded (`None`: none, only activations).
    kind: Option<OffloadKind>,
    /// Activation offload.
    act: bool,
    /// The micro-batch counts tried, fewest first.
    mbs: Vec<usize>,
    /// Context-parallel degree (the mesh's middle axis when > 1).
    cp: usize,
}

/// A layout the phase offloads on: mesh, sp, ZeRO stage, micro-batch counts, cp degree.
type Layout = (Mesh, bool, u8, Vec<usize>, usize);

#[derive(Default)]
struct LineResult {
    fit: Option<Evaluated>,
    least_tiers: Option<(u64, u64, String)>,
}

pub(super) fn run(req: &Request<'_>) -> Result<OffloadPhase> {
    if req.cluster.host.memory_bytes == 0 {
        return Ok(OffloadPhase { fit: None, least_tiers: None });
    }
    let mut lines = Vec::new();
    // No expert-parallel lines: `epN` refuses model-state offload (`axis/expert.rs`).
    for job in megatron_jobs(req, 0) {
        // Offload with hybrid sharding is not supported (`shard=` refuses `offload=`); with
        // context parallelism only activations are offloaded (`cpN` refuses model state).
        // (Ring attention's jobs too: their mesh says so.)
        let Job::Megatron { dp, tp, sp, shard: None, cp, ep: 1, ring } = job else { continue };
        let (shape, names) = crate::axis::stage_mesh(&ParallelConfig::new(dp, tp).with_cp(cp));
        let mesh = Mesh::named(&req.cluster, &shape, &names)?.with_ring(ring);
        let zeros: &[u8] = if dp * cp > 1 { &[1, 3] } else { &[0] };
        for &zero in zeros {
            lines.push((mesh.clone(), sp, zero, req.micro_batch_options(), cp));
        }
    }
    run_both(req, &lines)
}

/// The lines of model-state offload over `(mesh, sp, zero, mbs, cp)`, and, when none fits,
/// the same with activation offload and activation offload alone (the only kind a
/// context-parallel layout, cp > 1, is tried with).
fn run_both(req: &Request<'_>, layouts: &[Layout]) -> Result<OffloadPhase> {
    let kinds = [OffloadKind::Opt, OffloadKind::GradsOpt, OffloadKind::All];
    let lines_of = |act: bool| {
        let mut lines = Vec::new();
        for (mesh, sp, zero, mbs, cp) in layouts {
            let kinds = kinds.iter().map(|&k| Some(k)).filter(|_| *cp == 1);
            for kind in act.then_some(None).into_iter().chain(kinds) {
                let (mesh, sp, zero, mbs, cp) = (mesh.clone(), *sp, *zero, mbs.clone(), *cp);
                lines.push(Line { mesh, sp, zero, kind, act, mbs, cp });
            }
        }
        lines
    };
    let state = run_lines(req, &lines_of(false))?;
    if state.fit.is_some() {
        return Ok(state);
    }
    let act = run_lines(req, &lines_of(true))?;
    // The error names model-state offload's least tiers as before when it has them.
    Ok(OffloadPhase { fit: act.fit, least_tiers: state.least_tiers.or(act.least_tiers) })
}

/// Whether no plan can fit the devices without offload, whatever its layout: right before
/// the optimizer step every parameter, its gradient (the gradient-norm clip reads them all
/// before any update) and its AdamW state are each held somewhere, so the busiest device holds
/// at least their average over every device. Mixtral-8x7B on `8xH100` (46.7 B parameters ×
/// 16 bytes over 8 devices: 87 GiB of a 78.6 GiB budget) is such a case: the flat search and
/// the pipeline phase would lower every candidate to learn it. Without the clip (or without
/// host memory to offload to) the answer is no.
pub(super) fn device_state_cannot_fit(req: &Request<'_>, p: &Search<'_>) -> Result<bool> {
    if req.cluster.host.memory_bytes == 0 || req.train.max_grad_norm.is_none() {
        return Ok(false);
    }
    let n = req.cluster.num_devices().max(1);
    let shared = p.forward(req.batch)?;
    let g = &shared.0.graph;
    // A trained parameter: itself, its gradient (one element of its dtype each) and its AdamW
    // state; a frozen one (LoRA's base weights): itself only.
    let total: f64 = g
        .nodes
        .iter()
        .filter_map(|node| match node.op {
            tessera_ir::Op::Parameter { frozen, .. } => Some((node, frozen)),
            _ => None,
        })
        .flat_map(|(node, frozen)| node.outputs.iter().map(move |&t| (t, frozen)))
        .map(|(t, frozen)| {
            let meta = g.meta(t);
            let bytes = meta.size_bytes() as f64;
            match frozen {
                true => bytes,
                false => {
                    // Adam's moments, and the f32 master copy of a lower-precision one.
                    let opt = if meta.dtype == tessera_ir::DType::F32 { 8.0 } else { 12.0 };
                    2.0 * bytes + meta.numel() as f64 * opt
                }
            }
        })
        .sum();
    Ok(total / n as f64 > req.budget as f64)
}

/// The phase on one `dp × tp` layout of a config string, its ZeRO stage fixed, `sp` as `sps`
/// allows and the micro-batch counts `mbs` ([`super::plan_config`], offload not written; the
/// request's checkpointing search is the config's).
pub(super) fn run_layout(
    req: &Request<'_>,
    (dp, tp): (usize, usize),
    sps: &[bool],
    zero: u8,
    mbs: &[usize],
) -> Result<OffloadPhase> {
    if req.cluster.host.memory_bytes == 0 {
        return Ok(OffloadPhase { fit: None, least_tiers: None });
    }
    let mesh = Mesh::named(&req.cluster, &[dp, tp], &[AxisName::Data, AxisName::Tensor])?;
    let layouts: Vec<_> = sps.iter().map(|&sp| (mesh.clone(), sp, zero, mbs.to_vec(), 1)).collect();
    run_both(req, &layouts)
}

fn run_lines(req: &Request<'_>, lines: &[Line]) -> Result<OffloadPhase> {
    // Every probe shares the forward graphs and edge costs (`Search::sharing_graphs`).
    let base = req.problem();
    let results = parallel_map(lines, |line| run_line(req, &base, line));
    let mut phase = OffloadPhase { fit: None, least_tiers: None };
    for r in results {
        let r = r?;
        if let Some(e) = r.fit {
            if phase.fit.as_ref().is_none_or(|b| e.step_time_s() < b.step_time_s()) {
                phase.fit = Some(e);
            }
        }
        if let Some(t) = r.least_tiers {
            if phase.least_tiers.as_ref().is_none_or(|b| (t.0, t.1) < (b.0, b.1)) {
                phase.least_tiers = Some(t);
            }
        }
    }
    Ok(phase)
}

fn run_line(req: &Request<'_>, base: &Search<'_>, line: &Line) -> Result<LineResult> {
    let mut out = LineResult::default();
    let cand = |mb: usize, chunks: u32, nvme: u32| Candidate {
        mesh: line.mesh.clone(),
        rule: AxisRule::Megatron { sp: line.sp, cp: line.cp > 1 },
        zero: line.zero,
        micro_batches: mb,
        offload: Some(offload_of(line, chunks, nvme)),
    };
    let has_nvme = req.cluster.nvme.is_some_and(|n| n.capacity_bytes > 0);
    let dp = line.mesh.shape[0];
    for &mb in &line.mbs {
        if !req.batch.is_multiple_of(dp * mb) {
            continue;
        }
        if line.kind.is_none() {
            // Activations alone: one probe, no chunks to count.
            let Some(e) = probe(base, &cand(mb, 0, 0), req.budget)? else { continue };
            let m = &e.lowered.memory;
            if crate::offload::check_tiers(&req.cluster, m, "").is_ok() {
                out.fit = Some(e);
            } else {
                let config = describe(line, mb, 0, 0);
                out.least_tiers = Some((m.host_peak_bytes, m.nvme_peak_bytes, config));
            }
            break;
        }
        let Some(all) = probe(base, &cand(mb, CHUNKS, 0), req.budget)? else { continue };
        // The fewest chunks that still fit the device.
        let (mut lo, mut hi, mut best) = (0u32, CHUNKS, all);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            match probe(base, &cand(mb, mid, 0), req.budget)? {
                Some(e) => {
                    hi = mid;
                    best = e;
                }
                None => lo = mid,
            }
        }
        let chunks = hi;
        let host_fits =
            |e: &Evaluated| e.lowered.memory.host_peak_bytes <= req.cluster.host.memory_bytes;
        let mut nvme = 0;
        if !host_fits(&best) && has_nvme {
            // The fewest of them whose state on the NVMe lets the host hold the rest: every
            // one first (the least the host can need), then bisection.
            if let Some(e) = probe(base, &cand(mb, chunks, chunks), req.budget)? {
                let fits = host_fits(&e);
                (best, nvme) = (e, chunks);
                let mut lo = 0u32;
                while fits && nvme - lo > 1 {
                    let mid = (lo + nvme) / 2;
                    match probe(base, &cand(mb, chunks, mid), req.budget)?.filter(|e| host_fits(e))
                    {
                        Some(e) => (best, nvme) = (e, mid),
                        None => lo = mid,
                    }
                }
            }
        }
        let m = &best.lowered.memory;
        if crate::offload::check_tiers(&req.cluster, m, "").is_ok() {
            out.fit = Some(best);
        } else {
            let config = describe(line, mb, chunks, nvme);
            out.least_tiers = Some((m.host_peak_bytes, m.nvme_peak_bytes, config));
        }
        break;
    }
    Ok(out)
}

/// A candidate's fastest fit on the device (`None`: nothing fits it). Each probe has a search
/// state of its own: the search's per-problem memory (a layout's state marked hopeless, the
/// least peaks) is keyed without the offload, which changes what a layout holds. The forward
/// graphs and edge costs, which the offload does not change, are `base`'s.
fn probe(base: &Search<'_>, cand: &Candidate, budget: u64) -> Result<Option<Evaluated>> {
    let p = base.sharing_graphs();
    match search::evaluate(&p, cand, Some(budget)) {
        Ok(e) => Ok(e.filter(|e| e.peak_bytes() <= budget)),
        // One candidate the lowering cannot carry out does not end the search: it is a miss.
        Err(PlanError::Internal(why)) => {
            if std::env::var_os("TESSERA_TRACE").is_some() {
                eprintln!("trace: offload candidate {:?} failed: {why}", cand.offload);
            }
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

fn describe(line: &Line, mb: usize, chunks: u32, nvme: u32) -> String {
    let tp = *line.mesh.shape.last().unwrap_or(&1);
    let cfg = crate::config::ParallelConfig::new(line.mesh.shape[0], tp)
        .with_cp(line.cp)
        .with_zero(line.zero)
        .with_micro_batches(mb)
        .with_sp(line.sp)
        .with_offload(Some(offload_of(line, chunks, nvme)));
    cfg.canonical()
}

/// The offload a line probes with `chunks` offloaded, the last `nvme` of them on the NVMe.
fn offload_of(line: &Line, chunks: u32, nvme: u32) -> Offload {
    match line.kind {
        Some(kind) => Offload { kind, chunks, nvme, act: line.act },
        None => Offload::activations(),
    }
}

/// The error when not even offloading fits: the device's least peak, or the least host memory
/// (and NVMe) a device-fitting offloaded plan needs.
pub(super) fn infeasible(req: &Request<'_>, phase: &OffloadPhase, device: PlanError) -> PlanError {
    let Some((host, nvme, config)) = &phase.least_tiers else {
        return match device {
            // No host memory to offload to: say that one could.
            PlanError::Infeasible { budget, needed, hint }
                if req.cluster.host.memory_bytes == 0 =>
            {
                PlanError::Infeasible {
                    budget,
                    needed,
                    hint: format!(
                        "{hint}; or let the plan offload optimizer state to host memory \
                         (--host-memory SIZE)"
                    ),
                }
            }
            other => other,
        };
    };
    let (tier, budget, needed) = if *host > req.cluster.host.memory_bytes {
        (Tier::Host, req.cluster.host.memory_bytes, *host)
    } else {
        (Tier::Nvme, req.cluster.nvme.map_or(0, |n| n.capacity_bytes), *nvme)
    };
    PlanError::TierInfeasible {
        tier,
        budget,
        needed,
        hint: format!(
            "nothing fits the device's {} without offload; `{config}` fits it and needs {} of \
             host memory{}: give --host-memory or --nvme-size that large, or add devices",
            crate::units::format_bytes(req.budget),
            crate::units::format_bytes(*host),
            if *nvme > 0 {
                format!(" and {} of NVMe", crate::units::format_bytes(*nvme))
            } else {
                String::new()
            }
        ),
    }
}
