//! The step time of a lowered Program: compute per phase from the cost model, collectives
//! split into blocking ones and parameter/gradient ones that overlap the compute of their
//! pass, and what an offloaded Program's copies and host work add (an event simulation over
//! the device, the host and their links).

use super::{CollectiveRecord, StepTime};
use crate::cost::CostModel;
use crate::Mesh;
use tessera_ir::{Collective, Instr, Op, Phase, Program, TensorId, TensorMeta, Tier};

fn recompute(t: &mut StepTime, block: Option<u32>, secs: f64) {
    t.recompute_s += secs;
    if let Some(b) = block {
        let b = b as usize;
        if t.recompute_by_block_s.len() <= b {
            t.recompute_by_block_s.resize(b + 1, 0.0);
        }
        t.recompute_by_block_s[b] += secs;
    }
}

/// Walks the Program with the cost model: compute per phase, collectives split into blocking
/// ones and parameter/gradient ones that overlap the compute of their pass.
pub fn simulate_time(
    p: &Program,
    mesh: &Mesh,
    cost: &CostModel,
) -> (StepTime, Vec<CollectiveRecord>) {
    let g = p.graph();
    let experts = cost.expert_share(g);
    let mut t = StepTime::default();
    let (mut ov_fwd, mut ov_bwd) = (0.0, 0.0);
    let mut records = Vec::new();
    // Ring attention's transfers not yet hidden behind a block attention.
    let mut ring_pending = 0.0;
    let mut x: Vec<&TensorMeta> = Vec::new();
    let mut y: Vec<&TensorMeta> = Vec::new();
    for instr in &p.instrs {
        let Instr::Run(id) = *instr else { continue };
        let n = g.node(id);
        if let Op::Reshard(spec) = &n.op {
            let input = g.meta(n.inputs[0]);
            // Parameter gathers, gradient reductions (early ones in backward included) and the
            // optimizer's collectives run beside the compute, as DDP/FSDP buckets do.
            let is_grad =
                |t: TensorId| p.role[p.buffer_of[t.index()].index()] == tessera_ir::Role::Gradient;
            let on_param = matches!(g.producer(n.inputs[0]).op, Op::Parameter { .. })
                || n.phase == Phase::Optimizer
                || is_grad(n.inputs[0])
                || is_grad(n.outputs[0]);
            let mut secs = 0.0;
            let mut shape = input.shape.clone();
            for s in &spec.forward {
                let here = TensorMeta::new(shape.clone(), input.dtype);
                let bytes = s.payload_bytes(&here);
                let link = mesh.links[s.axis];
                let full = here.size_bytes();
                secs += if on_param {
                    crate::cost::bucketed_time(link, s.size, s.op, full)
                } else {
                    crate::cost::collective_time(link, s.size, s.op, full)
                };
                if !matches!(s.op, Collective::Shard { .. }) && s.size > 1 {
                    records.push(CollectiveRecord {
                        scope: g.scope_name(n.scope).to_string(),
                        phase: n.phase,
                        op: s.name(),
                        axis: s.axis,
                        group: s.size,
                        bytes,
                    });
                }
                shape = s.apply(&shape).unwrap_or(shape);
            }
            match (n.phase, on_param) {
                (Phase::Forward, true) => ov_fwd += secs,
                (Phase::Backward, true) | (Phase::Optimizer, _) => ov_bwd += secs,
                // A recomputed block repeats its activation collectives on the critical path.
                (Phase::Recompute, _) => recompute(&mut t, n.block, secs),
                _ => t.blocking_comm_s += secs,
            }
            continue;
        }
        if let Op::Send(pp) | Op::Recv(pp, _) = &n.op {
            // A pipeline's are priced on the schedule's critical path (`pipeline::lower`),
            // counted here.
            let meta = match &n.op {
                Op::Recv(_, m) => m,
                _ => g.meta(n.inputs[0]),
            };
            if let (true, Op::Send(_)) = (pp.ring, &n.op) {
                // Ring attention's: a 2-device transfer over the cp axis (every device sends
                // and receives one block at a time; priced once, at the send), overlapping
                // the next block attention: each ring step costs the longer of the two.
                let link = mesh.links[pp.axis].p2p(mesh.shape[pp.axis]);
                ring_pending += link.latency_s + meta.size_bytes() as f64 / link.bandwidth;
            }
            records.push(CollectiveRecord {
                scope: g.scope_name(n.scope).to_string(),
                phase: n.phase,
                op: n.op.name(),
                axis: pp.axis,
                group: 2,
                bytes: meta.size_bytes(),
            });
            continue;
        }
        x.clear();
        y.clear();
        x.extend(n.inputs.iter().map(|&i| g.meta(i)));
        y.extend(n.outputs.iter().map(|&o| g.meta(o)));
        if let Op::Transfer { from, to } = n.op {
            let bytes = g.meta(n.inputs[0]).size_bytes();
            t.transfer_s += cost.transfer_time(from, to, bytes);
            t.moved_bytes += bytes;
            continue;
        }
        if n.tier != Tier::Device {
            t.host_compute_s += cost.op_time_in(n.tier, &n.op, &x, &y);
            continue;
        }
        let secs = cost.node_time(&n.op, &x, &y, experts);
        if secs > 0.0 {
            *t.compute_by_op_s.entry(n.op.name()).or_default() += secs;
        }
        if let Op::Attention(a) | Op::AttentionBackward(a) = &n.op {
            if a.ring.is_some() && ring_pending > 0.0 {
                t.blocking_comm_s += (ring_pending - secs).max(0.0);
                ring_pending = 0.0;
            }
        }
        match n.phase {
            Phase::Forward => t.forward_compute_s += secs,
            Phase::Backward => t.backward_compute_s += secs,
            Phase::Recompute => recompute(&mut t, n.block, secs),
            Phase::Optimizer => t.optimizer_compute_s += secs,
        }
    }
    t.blocking_comm_s += ring_pending;
    t.overlapped_comm_s = ov_fwd + ov_bwd;
    t.overlapped_forward_comm_s = ov_fwd;
    t.exposed_comm_s = exposed_comm(&t);
    if p.offloads() {
        t.offload_exposed_s = offload_delay(p, cost);
    }
    if !p.offloads() {
        t.issue_wait_s = issue_wait(p, cost);
    }
    t.step_time_s = step_of_parts(&t);
    (t, records)
}

/// The part of the overlapped collectives that the compute of their pass does not hide:
/// parameter gathers behind the forward compute, the rest (gradient reductions, the
/// optimizer's collectives) behind the backward compute — recomputation runs inside the
/// backward pass, so they hide behind it too. Not linear in the micro-batch count (a fixed
/// gradient reduction hides once the backward passes outgrow it), so priced Programs
/// recompute it from their extrapolated parts ([`super::priced`]).
pub(crate) fn exposed_comm(t: &StepTime) -> f64 {
    let ov_fwd = t.overlapped_forward_comm_s;
    let ov_bwd = t.overlapped_comm_s - ov_fwd;
    (ov_fwd - t.forward_compute_s).max(0.0)
        + (ov_bwd - t.backward_compute_s - t.recompute_s).max(0.0)
}

/// The step time of `t`'s parts: compute, the collectives on the critical path and what the
/// overlapped ones, the offload copies and the host's issue leave exposed.
pub(crate) fn step_of_parts(t: &StepTime) -> f64 {
    t.forward_compute_s
        + t.backward_compute_s
        + t.recompute_s
        + t.optimizer_compute_s
        + t.blocking_comm_s
        + t.exposed_comm_s
        + t.offload_exposed_s
        + t.issue_wait_s
}

/// How long the device waits for its host over one step, on a device whose kernels were
/// measured (0 otherwise): one host thread issues the Program's ops in order into the GPU's
/// in-order queue, op i costing the host `h_i` (its dispatch) and the device `d_i`, so op i
/// starts at `max(issued_i, end_{i-1})`. A collective or transfer between devices is a
/// synchronisation (the host copies its operand down), after which the host issues from the
/// device's end; their own time is priced apart. The wait is the replay's end less the
/// device's busy time.
fn issue_wait(p: &Program, cost: &CostModel) -> f64 {
    if cost.device.kernels.is_none() {
        return 0.0;
    }
    let g = p.graph();
    let experts = cost.expert_share(g);
    let (mut issued, mut end, mut busy) = (0.0f64, 0.0f64, 0.0f64);
    let mut x: Vec<&TensorMeta> = Vec::new();
    let mut y: Vec<&TensorMeta> = Vec::new();
    for instr in &p.instrs {
        let Instr::Run(id) = *instr else { continue };
        let n = g.node(id);
        // Leaves are bound, not run; host-tier ops run on the host beside the device.
        if n.tier != Tier::Device || (n.op.is_leaf() && !matches!(n.op, Op::Fill { .. })) {
            continue;
        }
        if matches!(n.op, Op::Reshard(_) | Op::Send(_) | Op::Recv(..) | Op::Transfer { .. }) {
            issued = issued.max(end);
            continue;
        }
        x.clear();
        y.clear();
        x.extend(n.inputs.iter().map(|&i| g.meta(i)));
        y.extend(n.outputs.iter().map(|&o| g.meta(o)));
        issued += cost.issue_time(&n.op).unwrap_or(0.0);
        let d = cost.node_time(&n.op, &x, &y, experts);
        end = end.max(issued) + d;
        busy += d;
    }
    (end - busy).max(0.0)
}

/// What an offloaded Program's copies and host work add to its step: an event simulation in
/// instruction order over five resources — the device's compute stream, the host's CPU, the
/// host link's two directions (PCIe is full duplex) and the NVMe (reads and writes share the
/// drive) — where a node starts when its
/// resource is free and its inputs are ready, and a copy or host op no earlier than the device
/// op before it in the Program starts (it is issued when the Program reaches it: a prefetch is
/// as early as its place in the Program, where the memory simulation charges its buffer).
/// Collectives take no time here (the step prices them apart); the delay is the makespan less
/// the device's busy time, i.e. the time the device waits for a copy or the host (a prefetch
/// not yet arrived, the host's AdamW still running after the backward pass).
fn offload_delay(p: &Program, cost: &CostModel) -> f64 {
    #[derive(Clone, Copy)]
    enum Res {
        Device,
        Host,
        Down,
        Up,
        Nvme,
    }
    let g = p.graph();
    let experts = cost.expert_share(g);
    let mut ready = vec![0.0f64; g.tensors.len()];
    let mut free = [0.0f64; 5];
    let (mut device_busy, mut end, mut issued) = (0.0f64, 0.0f64, 0.0f64);
    let mut x: Vec<&TensorMeta> = Vec::new();
    let mut y: Vec<&TensorMeta> = Vec::new();
    for instr in &p.instrs {
        let Instr::Run(id) = *instr else { continue };
        let n = g.node(id);
        x.clear();
        y.clear();
        x.extend(n.inputs.iter().map(|&i| g.meta(i)));
        y.extend(n.outputs.iter().map(|&o| g.meta(o)));
        let (res, secs) = match n.op {
            Op::Transfer { from, to } => {
                let res = match (from, to) {
                    (Tier::Device, _) => Res::Down,
                    (_, Tier::Device) => Res::Up,
                    _ => Res::Nvme,
                };
                (res, cost.transfer_time(from, to, x[0].size_bytes()))
            }
            Op::Reshard(_) | Op::Send(_) | Op::Recv(..) => (Res::Device, 0.0),
            _ if n.tier != Tier::Device => (Res::Host, cost.op_time_in(n.tier, &n.op, &x, &y)),
            _ => (Res::Device, cost.node_time(&n.op, &x, &y, experts)),
        };
        let inputs = n.inputs.iter().map(|&i| ready[i.index()]).fold(0.0, f64::max);
        let start = free[res as usize].max(inputs).max(issued);
        let done = start + secs;
        free[res as usize] = done;
        if matches!(res, Res::Device) {
            device_busy += secs;
            issued = start;
        }
        for &o in &n.outputs {
            ready[o.index()] = done;
        }
        end = end.max(done);
    }
    (end - device_busy).max(0.0)
}
