//! Generation planned like training: a prefill or decode step of a causal LM (built by
//! `tessera_models::build_generation`) lowered to the Program one device of a tensor-parallel
//! group runs, with its memory (weights, KV cache, activations) and time predicted from that
//! Program — the same Program the runtime executes, so the measured peak is the predicted one.
//!
//! The layout is Megatron-LM's ([`crate::search::tp_strategies`]): q/k/v and the MLP's first
//! projections column-parallel, attention and the KV cache split by heads, the output and
//! second projections row-parallel with an all-reduce; the logits are gathered whole on every
//! device (each samples the same token from them).

use crate::cost::CostModel;
use crate::lower::{
    leaf_layout, simulate_time, CollectiveRecord, LocalForward, LowerOptions, StepTime,
};
use crate::{Cluster, Mesh, PlanError, Result, Spec};
use serde::{Deserialize, Serialize};
use tessera_ir::{Checkpointing, Graph, LeafLayout, Program, TensorId, TrainConfig};
use tessera_profile::{simulate_memory, MemoryReport};

/// One lowered generation step of a device.
#[derive(Clone, Debug)]
pub struct GenerationStep {
    pub program: Program,
    /// The logits every device reads (whole), in `program`.
    pub logits: TensorId,
    pub memory: MemoryReport,
    pub time: StepTime,
    pub collectives: Vec<CollectiveRecord>,
    /// Each leaf's stored spec, by name.
    pub leaf_specs: Vec<(String, Spec)>,
    /// Placements of the sharded leaves (parameters, caches, inputs) in `program`.
    pub layout: LeafLayout,
}

/// Lowers the generation step `g` (logits `logits`) for one device of a `tp`-way tensor
/// parallel group on `mesh` (shape `[1, tp]`).
pub fn lower_step(
    g: &Graph,
    logits: TensorId,
    mesh: &Mesh,
    cost: &CostModel,
) -> Result<GenerationStep> {
    let strategies = crate::search::tp_strategies(g, mesh)?;
    let opts = LowerOptions {
        zero: 0,
        micro_batches: 1,
        train: TrainConfig::default(),
        ckpt: Checkpointing::default(),
        offload: None,
    };
    let mut lw = LocalForward::new(g, &strategies, mesh, &opts)?;
    lw.lower_nodes()?;
    let local_logits = lw.replicated(logits)?;
    let leaf_specs = lw.leaf_specs.clone();
    let graph = std::mem::take(&mut lw.b).finish();
    let layout = leaf_layout(&graph, &leaf_specs, 1);
    let program = Program::lower_graph(graph, vec![local_logits], &[]);
    if program.graph.nodes.iter().any(|n| n.op.name() == "adamw") {
        return Err(PlanError::Internal("a generation step holds an optimizer".into()));
    }
    let memory = simulate_memory(&program).report;
    let (time, collectives) = simulate_time(&program, mesh, cost);
    Ok(GenerationStep {
        program,
        logits: local_logits,
        memory,
        time,
        collectives,
        leaf_specs,
        layout,
    })
}

/// What a generation plan optimises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// The shortest time for the request: the first token, then every decode step.
    Latency,
    /// The most tokens per second over the cluster: replicas, and pipeline stages each
    /// working on its own group of sequences (each group's KV cache held).
    Throughput,
}

/// A generation request to plan: the prefill and decode steps of the whole model (one
/// device's graphs, as `tessera_models::build_generation` makes them) on a cluster.
pub struct InferenceProblem<'a> {
    pub prefill: (&'a Graph, TensorId),
    pub decode: (&'a Graph, TensorId),
    pub cluster: &'a Cluster,
    /// Memory per device.
    pub budget: u64,
    pub batch: usize,
    pub new_tokens: usize,
    /// Bytes per token passed between pipeline stages (the residual stream's row).
    pub stage_bytes_per_token: u64,
    pub objective: Objective,
    /// `(tp, pp)` of a config string; `None`: search every split of the devices.
    pub fixed: Option<(usize, usize)>,
}

/// One way to lay the model over the cluster, with what it is predicted to take.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct InferenceCandidate {
    /// `tp8`, `tp4 pp2`, `dp2 tp4`.
    pub config: String,
    pub tp: usize,
    pub pp: usize,
    /// Model replicas serving side by side.
    pub replicas: usize,
    pub fits: bool,
    /// Why the layout does not exist for the model (a degree that does not divide the heads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// The fullest device's peak (the Program's exactly when `pp` is 1; otherwise its stage's
    /// weights and caches plus the whole model's step activations, an upper bound).
    pub peak_bytes_per_device: u64,
    pub weights_bytes_per_device: u64,
    pub kv_cache_bytes_per_device: u64,
    /// The rest of the peak: the step's activations, inputs and kernel workspace.
    pub activation_bytes: u64,
    pub time_to_first_token_s: f64,
    /// One decode step of one group of `batch` sequences through every stage.
    pub decode_token_s: f64,
    /// First token plus `new_tokens − 1` decode steps.
    pub request_s: f64,
    /// Tokens per second the whole cluster generates.
    pub throughput_tokens_per_s: f64,
}

/// The plan: the best candidate for the objective and every candidate considered.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct InferencePlan {
    pub devices: usize,
    pub objective: Objective,
    pub budget_bytes: u64,
    pub best: InferenceCandidate,
    pub candidates: Vec<InferenceCandidate>,
}

/// A step lowered for `tp` devices, or why it cannot be.
fn lowered(g: &Graph, logits: TensorId, tp: usize, c: &Cluster) -> Result<GenerationStep> {
    let link = if tp <= c.gpus_per_node { c.intra } else { c.inter };
    let mesh = Mesh::with_links(&[1, tp], vec![c.intra, link]);
    lower_step(g, logits, &mesh, &CostModel::for_cluster(c))
}

/// Resident bytes (weights and caches) of a lowered step by block, and those outside the
/// blocks read before them (embeddings) and after them (final norm, head; a tied embedding
/// counts in both).
struct Resident {
    blocks: Vec<(u64, u64)>,
    first: u64,
    last: u64,
}

fn resident(step: &GenerationStep) -> Resident {
    let g = &step.program.graph;
    let nb = g.nodes.iter().filter_map(|n| n.block).max().map_or(0, |b| b as usize + 1);
    let mut r = Resident { blocks: vec![(0, 0); nb], first: 0, last: 0 };
    let consumers = g.consumers();
    let first_block_node = g.nodes.iter().position(|n| n.block.is_some()).unwrap_or(0);
    let last_block_node = g.nodes.iter().rposition(|n| n.block.is_some()).unwrap_or(0);
    for n in &g.nodes {
        let (is_cache, bytes) = match &n.op {
            tessera_ir::Op::Parameter { meta: m, .. } => (false, m.size_bytes()),
            tessera_ir::Op::KvCache(m) => (true, m.size_bytes()),
            _ => continue,
        };
        let readers = &consumers[n.outputs[0].index()];
        let block = readers.iter().find_map(|&c| g.node(c).block);
        match block {
            Some(b) if is_cache => r.blocks[b as usize].1 += bytes,
            Some(b) => r.blocks[b as usize].0 += bytes,
            None => {
                if readers.iter().any(|c| c.index() < first_block_node) {
                    r.first += bytes;
                }
                if readers.iter().any(|c| c.index() > last_block_node) || readers.is_empty() {
                    r.last += bytes;
                }
            }
        }
    }
    r
}

/// Plans a generation request: every `dp × tp × pp` split of the devices (or the fixed one),
/// each tensor-parallel degree lowered exactly, and the fastest that fits the budget.
pub fn plan_inference(p: &InferenceProblem<'_>) -> Result<InferencePlan> {
    let n = p.cluster.num_devices();
    let divisors = |x: usize| (1..=x).filter(move |d| x.is_multiple_of(*d));
    let mut candidates = Vec::new();
    for tp in divisors(n) {
        if p.fixed.is_some_and(|(t, _)| t != tp) {
            continue;
        }
        let steps = lowered(p.prefill.0, p.prefill.1, tp, p.cluster)
            .and_then(|pre| Ok((pre, lowered(p.decode.0, p.decode.1, tp, p.cluster)?)));
        let (pre, dec) = match steps {
            Ok(s) => s,
            Err(e) => {
                candidates.push(refused(tp, e.to_string()));
                continue;
            }
        };
        let res = resident(&dec);
        let nb = res.blocks.len().max(1);
        for pp in divisors(n / tp).filter(|&pp| pp <= nb) {
            if p.fixed.is_some_and(|(_, q)| q != pp) {
                continue;
            }
            candidates.push(candidate(p, &pre, &dec, &res, tp, pp, n / (tp * pp)));
        }
    }
    let fits = candidates.iter().filter(|c| c.fits);
    let best = match p.objective {
        Objective::Latency => fits.min_by(|a, b| a.request_s.total_cmp(&b.request_s)),
        Objective::Throughput => {
            fits.max_by(|a, b| a.throughput_tokens_per_s.total_cmp(&b.throughput_tokens_per_s))
        }
    };
    let Some(best) = best.cloned() else {
        if let Some(why) = candidates
            .iter()
            .find_map(|c| c.refused.clone())
            .filter(|_| candidates.iter().all(|c| c.refused.is_some()))
        {
            return Err(PlanError::Invalid(why));
        }
        let least = candidates
            .iter()
            .filter(|c| c.refused.is_none())
            .map(|c| c.peak_bytes_per_device)
            .min()
            .unwrap_or(0);
        return Err(PlanError::Infeasible {
            budget: p.budget,
            needed: least,
            hint: format!(
                "no split of the {n} devices fits: quantise the weights (--quantize int8 or \
                 int4), shorten the prompt or the generation, lower the batch, or add devices"
            ),
        });
    };
    Ok(InferencePlan {
        devices: n,
        objective: p.objective,
        budget_bytes: p.budget,
        best,
        candidates,
    })
}

fn refused(tp: usize, why: String) -> InferenceCandidate {
    InferenceCandidate {
        config: format!("tp{tp}"),
        tp,
        pp: 1,
        replicas: 0,
        fits: false,
        refused: Some(why),
        peak_bytes_per_device: 0,
        weights_bytes_per_device: 0,
        kv_cache_bytes_per_device: 0,
        activation_bytes: 0,
        time_to_first_token_s: 0.0,
        decode_token_s: 0.0,
        request_s: 0.0,
        throughput_tokens_per_s: 0.0,
    }
}

#[allow(clippy::too_many_arguments)]
fn candidate(
    p: &InferenceProblem<'_>,
    pre: &GenerationStep,
    dec: &GenerationStep,
    res: &Resident,
    tp: usize,
    pp: usize,
    replicas: usize,
) -> InferenceCandidate {
    let (pm, dm) = (&pre.memory, &dec.memory);
    // What is not resident: activations, inputs, workspace (the larger of the two steps).
    let transient =
        |m: &MemoryReport| m.peak_bytes.saturating_sub(m.params_bytes + m.kv_cache_bytes);
    let activation = transient(pm).max(transient(dm));
    // Stage s holds blocks [s·L/pp, (s+1)·L/pp); throughput keeps pp groups in flight.
    let groups = if p.objective == Objective::Throughput { pp as u64 } else { 1 };
    let nb = res.blocks.len();
    let (mut weights, mut cache) = (0u64, 0u64);
    for s in 0..pp {
        let (lo, hi) = (s * nb / pp, (s + 1) * nb / pp);
        let w: u64 = res.blocks[lo..hi].iter().map(|b| b.0).sum::<u64>()
            + if s == 0 { res.first } else { 0 }
            + if s + 1 == pp { res.last } else { 0 };
        let c: u64 = res.blocks[lo..hi].iter().map(|b| b.1).sum::<u64>() * groups;
        if w + c > weights + cache {
            (weights, cache) = (w, c);
        }
    }
    let peak =
        if pp == 1 { pm.peak_bytes.max(dm.peak_bytes) } else { weights + cache + activation };
    let link = p.cluster.inter;
    let hop = |tokens: u64| {
        (pp - 1) as f64
            * (link.latency_s + (tokens * p.stage_bytes_per_token) as f64 / link.bandwidth)
    };
    let b = p.batch as u64;
    let prompt = pre.program.graph.nodes.iter().find_map(|n| match &n.op {
        tessera_ir::Op::Input(m) if m.shape.rank() == 2 => Some(m.shape.dim(1) as u64),
        _ => None,
    });
    let ttft = pre.time.step_time_s + hop(b * prompt.unwrap_or(1));
    let decode = dec.time.step_time_s + hop(b);
    let request = ttft + p.new_tokens.saturating_sub(1) as f64 * decode;
    let throughput = (replicas as u64 * groups * b) as f64 / decode;
    let mut config = format!("tp{tp}");
    if pp > 1 {
        config = format!("{config} pp{pp}");
    }
    if replicas > 1 {
        config = format!("dp{replicas} {config}");
    }
    InferenceCandidate {
        config,
        tp,
        pp,
        replicas,
        fits: peak <= p.budget,
        refused: None,
        peak_bytes_per_device: peak,
        weights_bytes_per_device: if pp == 1 { pm.params_bytes } else { weights },
        kv_cache_bytes_per_device: if pp == 1 { pm.kv_cache_bytes } else { cache },
        activation_bytes: activation,
        time_to_first_token_s: ttft,
        decode_token_s: decode,
        request_s: request,
        throughput_tokens_per_s: throughput,
    }
}
