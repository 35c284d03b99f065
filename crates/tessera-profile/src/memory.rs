//! Memory simulation over the Program: liveness, peak, what is live at the peak, timeline.

use rustc_hash::FxHashMap as HashMap;
use serde::Serialize;
use tessera_ir::{Instr, Program, Role, TensorId, TensorMeta, Tier};

/// Live bytes right after one instruction (workspace of a `Run` included at its instant).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TimelinePoint {
    pub instr: u32,
    pub live_bytes: u64,
}

/// Buffers live at the peak, grouped by producing scope and role.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LiveGroup {
    pub scope: String,
    pub role: Role,
    pub bytes: u64,
    pub buffers: u32,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct MemoryReport {
    /// Trainable weights as stored for compute (bf16 under mixed precision).
    pub params_bytes: u64,
    /// Accumulated parameter gradients.
    pub grads_bytes: u64,
    /// Adam moments and fp32 master weights.
    pub optimizer_bytes: u64,
    /// All forward values read by the backward pass (each buffer once).
    pub activations_bytes: u64,
    /// Per-step data (token ids, labels, scalars).
    pub inputs_bytes: u64,
    /// Generation's key/value caches (resident across its steps).
    pub kv_cache_bytes: u64,
    /// Saved activations produced by each repeated block, indexed by block.
    pub activations_by_block: Vec<u64>,
    /// The largest kernel workspace requested by any instruction.
    pub max_workspace_bytes: u64,
    /// Peak of live bytes on the device over the step (what the device budget bounds).
    pub peak_bytes: u64,
    /// Peak of live bytes in the host's memory (offloaded gradients, optimizer state, the
    /// host optimizer's copies); 0 without offload.
    pub host_peak_bytes: u64,
    /// Peak of bytes on the NVMe tier (offloaded state files); 0 without NVMe offload.
    pub nvme_peak_bytes: u64,
    /// Index of the instruction at which the peak is first reached.
    pub peak_instr: u32,
    /// Live bytes at the peak split by role (workspace counted as temporaries).
    pub peak_by_role: Vec<(Role, u64)>,
    /// Largest groups of live buffers at the peak.
    pub live_at_peak: Vec<LiveGroup>,
    /// Bytes live on the device before the step begins (parameters, optimizer state,
    /// inputs).
    pub resting_bytes: u64,
}

/// A full simulation: the report and the timeline.
#[derive(Clone, Debug)]
pub struct MemoryTrace {
    pub report: MemoryReport,
    pub timeline: Vec<TimelinePoint>,
}

/// Walks the Program as the runtime does and records live bytes.
pub fn simulate_memory(p: &Program) -> MemoryTrace {
    let g = p.graph();
    let bytes = |t: TensorId| g.meta(t).size_bytes();
    let tier = |t: TensorId| p.tier_of(t).index();
    const DEVICE: usize = 0;
    // Live bytes and peaks per tier ([`Tier::ALL`] order); the timeline and the breakdown at
    // the peak are the device's.
    let mut live = [0u64; 3];
    for &t in &p.live_in {
        live[tier(t)] += bytes(t);
    }
    let resting = live[DEVICE];
    let mut peaks = live;
    let mut peak_instr = 0u32;
    let mut peak_workspace = 0u64;
    let mut max_workspace = 0u64;
    let mut timeline = Vec::with_capacity(p.instrs.len());
    let mut metas: Vec<&TensorMeta> = Vec::with_capacity(8);
    for (i, instr) in p.instrs.iter().enumerate() {
        match *instr {
            Instr::Run(n) => {
                for t in p.allocations(n) {
                    live[tier(t)] += bytes(t);
                }
                let node = g.node(n);
                metas.clear();
                metas.extend(node.inputs.iter().map(|&t| g.meta(t)));
                let ws = node.op.workspace_bytes(&metas);
                max_workspace = max_workspace.max(ws);
                let at = node.tier.index();
                for (k, (peak, &now)) in peaks.iter_mut().zip(&live).enumerate() {
                    let now = now + if k == at { ws } else { 0 };
                    if now > *peak {
                        *peak = now;
                        if k == DEVICE {
                            peak_instr = i as u32;
                            peak_workspace = ws;
                        }
                    }
                }
                let device_ws = if at == DEVICE { ws } else { 0 };
                timeline
                    .push(TimelinePoint { instr: i as u32, live_bytes: live[DEVICE] + device_ws });
            }
            Instr::Free(t) => {
                live[tier(t)] -= bytes(t);
                timeline.push(TimelinePoint { instr: i as u32, live_bytes: live[DEVICE] });
            }
        }
    }
    let peak = peaks[DEVICE];

    // Totals by role, over every buffer of the step in any tier (a copy moved to another tier
    // is the same state: counted once).
    let mut report = MemoryReport { resting_bytes: resting, ..Default::default() };
    let num_blocks = g.nodes.iter().filter_map(|n| n.block).max().map_or(0, |b| b as usize + 1);
    report.activations_by_block = vec![0; num_blocks];
    for (t, &root) in p.buffer_of.iter().enumerate() {
        if root.index() != t || matches!(g.producer(root).op, tessera_ir::Op::Transfer { .. }) {
            continue;
        }
        let b = bytes(root);
        match p.role[t] {
            Role::Parameter => report.params_bytes += b,
            Role::Gradient => report.grads_bytes += b,
            Role::OptimizerState => report.optimizer_bytes += b,
            Role::Input => report.inputs_bytes += b,
            Role::SavedActivation => {
                report.activations_bytes += b;
                if let Some(k) = g.producer(root).block {
                    report.activations_by_block[k as usize] += b;
                }
            }
            Role::KvCache => report.kv_cache_bytes += b,
            Role::Temporary => {}
        }
    }
    report.peak_bytes = peak;
    report.host_peak_bytes = peaks[Tier::Host.index()];
    report.nvme_peak_bytes = peaks[Tier::Nvme.index()];
    report.peak_instr = peak_instr;
    report.max_workspace_bytes = max_workspace;
    let (by_role, groups) = live_at(p, peak_instr as usize, peak_workspace);
    report.peak_by_role = by_role;
    report.live_at_peak = groups;
    MemoryTrace { report, timeline }
}

/// Replays the Program up to and including instruction `at` and groups what is live.
fn live_at(p: &Program, at: usize, workspace: u64) -> (Vec<(Role, u64)>, Vec<LiveGroup>) {
    let g = p.graph();
    let mut live: Vec<TensorId> = p.live_in.clone();
    let mut alive = vec![false; g.tensors.len()];
    for &t in &live {
        alive[t.index()] = true;
    }
    for instr in &p.instrs[..=at.min(p.instrs.len().saturating_sub(1))] {
        match *instr {
            Instr::Run(n) => {
                for t in p.allocations(n) {
                    alive[t.index()] = true;
                    live.push(t);
                }
            }
            Instr::Free(t) => alive[t.index()] = false,
        }
    }
    let mut by_role: HashMap<Role, u64> = HashMap::default();
    // By the producer's scope first (ids: thousands of live tensors at a large model's peak),
    // then by module name, one string per distinct scope.
    let mut by_scope: HashMap<(tessera_ir::ScopeId, Role), (u64, u32)> = HashMap::default();
    for t in live.into_iter().filter(|t| alive[t.index()] && p.tier_of(*t).is_device()) {
        let b = g.meta(t).size_bytes();
        let role = p.role[t.index()];
        *by_role.entry(role).or_default() += b;
        let e = by_scope.entry((g.producer(t).scope, role)).or_default();
        e.0 += b;
        e.1 += 1;
    }
    let mut groups: HashMap<(String, Role), (u64, u32)> = HashMap::default();
    for ((scope, role), (bytes, buffers)) in by_scope {
        let e = groups.entry((group_scope(g.scope_name(scope), role), role)).or_default();
        e.0 += bytes;
        e.1 += buffers;
    }
    *by_role.entry(Role::Temporary).or_default() += workspace;
    let by_role = Role::ALL.iter().map(|r| (*r, by_role.get(r).copied().unwrap_or(0))).collect();
    let mut groups: Vec<LiveGroup> = groups
        .into_iter()
        .map(|((scope, role), (bytes, buffers))| LiveGroup { scope, role, bytes, buffers })
        .collect();
    // A total order (a parameter and its gradient tie on bytes and scope): the same report on
    // every run, whatever the hash map's order.
    groups.sort_by(|a, b| {
        b.bytes.cmp(&a.bytes).then_with(|| a.scope.cmp(&b.scope)).then_with(|| a.role.cmp(&b.role))
    });
    groups.truncate(16);
    (by_role, groups)
}

/// Model state is grouped by module (`transformer.h.3.attn.c_attn.weight.adam_m` →
/// `transformer.h.3.attn.c_attn`) so a layer's weights, grads and moments line up.
fn group_scope(scope: &str, role: Role) -> String {
    match role {
        Role::Parameter | Role::Gradient | Role::OptimizerState => {
            let s = tessera_ir::dist::split_state_key(scope).map_or(scope, |(param, _)| param);
            s.rsplit_once('.').map_or(s, |(head, _)| head).to_string()
        }
        Role::Input | Role::SavedActivation | Role::Temporary | Role::KvCache => scope.to_string(),
    }
}
