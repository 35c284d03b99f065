//! Plans as data: the versioned JSON a search produces, a human can edit, and the runtime
//! executes. A plan records the mesh, every forward op's strategy (so it can be lowered again
//! exactly), the collectives of one step, and the predictions taken from the lowered Program.

pub mod ops;

use crate::config::ParallelConfig;
use crate::lower::CollectiveRecord;
use crate::pipeline::lower::PipeLowered;
use crate::pipeline::plan as pipeline_plan;
use crate::rules::Strategy;
use crate::search::Evaluated;
use crate::{Mesh, PlanError, Result, Spec};
use serde::{Deserialize, Serialize};
use tessera_ir::{Checkpointing, CkptMode, Graph, Op};

pub const PLAN_VERSION: u32 = 1;

fn default_layout() -> String {
    "per-op".into()
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct MeshJson {
    pub shape: Vec<usize>,
    pub axes: Vec<String>,
    /// Replica axes of hybrid sharding ([`crate::Mesh::replicas`]); absent: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<usize>,
    /// Whether the cp axis runs ring attention ([`crate::Mesh::ring`]); absent: no.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ring: bool,
}

impl MeshJson {
    /// The axis named `name`, if the plan's mesh has one ([`crate::Mesh::axis`]).
    pub fn axis(&self, name: crate::mesh::AxisName) -> Option<usize> {
        self.axes.iter().position(|a| a == name.as_str())
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TensorPlacement {
    pub name: String,
    pub spec: String,
    pub local_shape: Vec<usize>,
}

/// One forward op's strategy, by node index (checked against the op name on load).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NodeStrategy {
    pub node: usize,
    pub scope: String,
    pub op: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block: Option<u32>,
    /// What the op does, in a few words (`silu`, `residual add`, `cast bf16→f32 of o_proj`):
    /// [`ops::op_details`]. Informative only: a plan file is read without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    pub compute_axes: Vec<usize>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CollectiveJson {
    pub scope: String,
    pub phase: String,
    pub op: String,
    pub axis: usize,
    pub group: usize,
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Predicted {
    pub step_time_s: f64,
    pub peak_bytes_per_device: Vec<u64>,
    /// Model FLOPs utilisation: matmul FLOPs of the step / (time × devices × peak).
    pub mfu: f64,
    pub tokens_per_s: f64,
    pub forward_compute_s: f64,
    pub backward_compute_s: f64,
    pub optimizer_compute_s: f64,
    pub blocking_comm_s: f64,
    pub overlapped_comm_s: f64,
    pub exposed_comm_s: f64,
    /// Forward work re-run in the backward pass by activation checkpointing (compute and the
    /// collectives it repeats); part of `step_time_s`.
    #[serde(default)]
    pub recompute_s: f64,
    /// Bytes each device contributes to collectives in one step.
    pub comm_bytes_per_device: u64,
    pub params_bytes: u64,
    pub grads_bytes: u64,
    pub optimizer_bytes: u64,
    /// Saved activations produced over the whole step (each buffer once): not all live at
    /// once, so not a part of the peak; [`Predicted::peak_breakdown`] has those.
    pub activations_bytes: u64,
    /// Bytes live at the peak instruction by role (`parameters`, `gradients`,
    /// `optimizer_state`, `saved_activations`, `temporaries` — kernel workspace included —
    /// and `inputs`), from the memory simulation that found the peak: they sum to the highest
    /// of `peak_bytes_per_device` (a pipelined plan's worst device). Empty in older plan files.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub peak_breakdown: std::collections::BTreeMap<String, u64>,
    /// Compute seconds per op kind over the whole step (forward, backward, optimizer).
    #[serde(default)]
    pub compute_by_op_s: std::collections::BTreeMap<String, f64>,
    /// Pipelined plans: the share of the devices' time the schedule leaves idle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bubble_fraction: Option<f64>,
    /// On a GPU whose kernels were measured: the time the device waits for its host to issue
    /// the step (part of `step_time_s`).
    #[serde(default)]
    pub issue_wait_s: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BaselineJson {
    pub config: String,
    pub step_time_s: f64,
    pub peak_bytes_per_device: Vec<u64>,
    pub configurations_tried: usize,
    pub configurations_fitting: usize,
}

/// A checkpointing baseline: the automatic search with one fixed checkpointing policy (and
/// the best sharding for it).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CkptBaselineJson {
    /// `None` (JSON null) when no sharding fits the budget under this policy.
    pub step_time_s: Option<f64>,
    pub peak_bytes_per_device: Vec<u64>,
    pub recompute_s: f64,
    /// The best plan's step time over this baseline's (≤ 1: the plan is no slower).
    pub plan_over_baseline: Option<f64>,
    /// The policy applied to the plan's own sharding instead (`None`: it does not fit the
    /// budget there, or the policy is the sharding-only one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_sharding_step_time_s: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Baselines {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub megatron: Option<BaselineJson>,
    /// Chen et al.'s √n segments (keep every k-th block input, k ≈ √L).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chen: Option<CkptBaselineJson>,
    /// `full` recompute on every block.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub full_recompute: Option<CkptBaselineJson>,
    /// No checkpointing: the best sharding alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharding_only: Option<CkptBaselineJson>,
}

/// One block's checkpoint mode.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BlockCkpt {
    pub block: u32,
    pub mode: CkptMode,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Plan {
    pub version: u32,
    pub model: String,
    pub cluster: String,
    pub devices: usize,
    pub batch: usize,
    pub seq: usize,
    pub dtype: String,
    pub memory_budget_bytes: u64,
    pub mesh: MeshJson,
    /// Canonical config string (`dp2 tp4 sp zero1 mb2`). For a `per-op` layout it is the
    /// closest Megatron-style description, not an equivalent: reuse such a plan as a file.
    pub config: String,
    /// `megatron`: a Megatron-style layout that `--plan "<config>"` reproduces; `per-op`: the
    /// free search chose each op's sharding (the strategies below are the plan).
    #[serde(default = "default_layout")]
    pub layout: String,
    pub zero_stage: u8,
    pub micro_batches: usize,
    /// Activation checkpointing, one entry per repeated block (empty for a model without
    /// blocks). Chosen with the sharding; a hand edit is carried out as written.
    #[serde(default)]
    pub checkpoint: Vec<BlockCkpt>,
    /// How the plan was found: `auto`, `fixed`, `file`.
    pub source: String,
    pub predicted: Predicted,
    pub search_ms: f64,
    #[serde(default)]
    pub baselines: Baselines,
    pub tensors: Vec<TensorPlacement>,
    pub collectives: Vec<CollectiveJson>,
    pub strategies: Vec<NodeStrategy>,
    /// Pipeline parallelism: stages, schedule. Absent: one stage. `mesh` is then one stage's
    /// mesh (the strategies' axes); the devices are `mesh × pipeline.devices`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<crate::pipeline::plan::PipelineJson>,
    /// Offload: the chunks whose state rests below the device, and what moves each step.
    /// Absent: everything on the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload: Option<crate::offload::OffloadJson>,
    /// The LM head and its loss fused and computed this many rows at a time
    /// (`Op::LinearCrossEntropy`, [`crate::loss_chunk`]); absent: the logits whole. The
    /// forward graph the strategies name is the fused one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_chunk_rows: Option<usize>,
    /// Each block's MLP fused and computed this many rows at a time (`Op::TiledMlp`,
    /// [`crate::mlp_tile`]); absent: the MLPs whole. The forward graph the strategies name is
    /// the fused one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_tile_rows: Option<usize>,
    /// The model's routed experts ([`crate::expert::expert_facts`]); absent: no MoE layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<crate::expert::ExpertFacts>,
}

/// The tiled MLP's rows per tile in a forward graph (`None`: the MLPs whole).
pub fn mlp_tile_rows(g: &Graph) -> Option<usize> {
    g.nodes.iter().find_map(|n| match n.op {
        Op::TiledMlp(spec) => Some(spec.chunk_rows),
        _ => None,
    })
}

/// The chunked loss's rows per chunk in a forward graph (`None`: the logits whole).
pub fn loss_chunk_rows(g: &Graph) -> Option<usize> {
    g.nodes.iter().find_map(|n| match n.op {
        Op::LinearCrossEntropy { chunk_rows, .. } => Some(chunk_rows),
        _ => None,
    })
}

/// What the plan does, as a config string: the axes that split the token ids' batch are data
/// parallel, the others tensor parallel; `sp` when a norm's rows split over a tensor axis.
pub fn describe(
    g: &Graph,
    strategies: &[Option<Strategy>],
    mesh: &Mesh,
    zero: u8,
    mb: usize,
) -> ParallelConfig {
    // Data-parallel axes: those splitting the batch (first) dim of most matmuls' activations.
    let mut votes: std::collections::BTreeMap<Vec<usize>, usize> = Default::default();
    for (i, n) in g.nodes.iter().enumerate() {
        if let (Op::MatMul { .. }, Some(s)) = (&n.op, &strategies[i]) {
            let x = g.meta(n.inputs[0]);
            if x.shape.rank() >= 3 {
                *votes.entry(s.inputs[0].dims.first().cloned().unwrap_or_default()).or_default() +=
                    1;
            }
        }
    }
    let mut dp_axes: Vec<usize> =
        votes.into_iter().max_by_key(|(_, n)| *n).map(|(axes, _)| axes).unwrap_or_default();
    if dp_axes.is_empty() {
        if let Some((i, _)) =
            g.nodes.iter().enumerate().find(|(i, n)| !n.op.is_leaf() && strategies[*i].is_some())
        {
            if let Some(s) = &strategies[i] {
                dp_axes = s.outputs[0].dims.first().cloned().unwrap_or_default();
            }
        }
    }
    let dp: usize = dp_axes.iter().map(|&a| mesh.shape[a]).product();
    let cp = crate::context::describe_cp(g, strategies, mesh, &dp_axes);
    let tp = mesh.num_devices() / dp.max(1) / cp;
    // The ep axis splits the batch with dp (one of `dp_axes`) and the experts.
    let ep = crate::expert::describe_ep(g, strategies, mesh);
    let dp = if dp.is_multiple_of(ep) { dp / ep } else { dp };
    let cp_axis = (cp > 1).then(|| mesh.axis(crate::mesh::AxisName::Context)).flatten();
    let sp = tp > 1
        && g.nodes.iter().enumerate().any(|(i, n)| {
            matches!(n.op, Op::LayerNorm { .. } | Op::RmsNorm { .. })
                && strategies[i].as_ref().is_some_and(|s| {
                    s.inputs[0].dims.get(1).is_some_and(|d| {
                        d.iter().any(|a| !dp_axes.contains(a) && Some(*a) != cp_axis)
                    })
                })
        });
    // Hybrid sharding: the replica axes' groups each hold a whole copy of the ZeRO state.
    let replicas: usize = mesh.replicas.iter().map(|&a| mesh.shape[a]).product();
    let shard = (zero > 0 && replicas > 1 && dp > replicas).then(|| dp / replicas);
    ParallelConfig::new(dp.max(1), tp.max(1))
        .with_zero(zero)
        .with_micro_batches(mb)
        .with_sp(sp)
        .with_shard(shard)
        .with_cp(cp)
        .with_cp_comm((cp > 1 && mesh.ring).then_some(crate::context::CpComm::Ring))
        .with_ep(ep)
        .with_loss(loss_chunk_rows(g).map(crate::config::LossMode::Chunk))
        .with_mlp(mlp_tile_rows(g).map(crate::config::MlpMode::Tile))
}

pub struct PlanContext<'a> {
    pub model: String,
    pub cluster: String,
    pub batch: usize,
    pub seq: usize,
    pub dtype: String,
    pub budget: u64,
    /// Host memory per device for offloaded state.
    pub host_memory_bytes: u64,
    /// Matmul FLOPs of one global step (the MFU numerator).
    pub model_flops: f64,
    /// Peak dense FLOP/s of one device in the plan's dtype.
    pub peak_flops: f64,
    pub forward: &'a Graph,
}

impl Plan {
    pub fn from_evaluated(
        cx: &PlanContext<'_>,
        e: &Evaluated,
        source: &str,
        search_ms: f64,
    ) -> Plan {
        let mesh = &e.candidate.mesh;
        let n = mesh.num_devices();
        let t = &e.lowered.time;
        let peak = e.lowered.memory.peak_bytes;
        let g = cx.forward;
        let mut cfg = describe(g, &e.strategies, mesh, e.candidate.zero, e.candidate.micro_batches);
        cfg.offload = e.candidate.offload;
        let nb = tessera_ir::remat::num_blocks(g);
        let checkpoint: Vec<BlockCkpt> =
            (0..nb).map(|b| BlockCkpt { block: b, mode: e.lowered.ckpt.mode(b) }).collect();
        // The config string names a checkpoint mode when every block has the same one.
        cfg.ckpt = match checkpoint.first() {
            Some(first)
                if first.mode != CkptMode::None
                    && checkpoint.iter().all(|c| c.mode == first.mode) =>
            {
                Some(first.mode)
            }
            _ => None,
        };
        let comm: u64 = e.lowered.collectives.iter().map(|c| c.bytes).sum();
        let m = &e.lowered.memory;
        let predicted = Predicted {
            step_time_s: t.step_time_s,
            peak_bytes_per_device: vec![peak; n],
            mfu: cx.model_flops / (t.step_time_s * n as f64 * cx.peak_flops),
            tokens_per_s: (cx.batch * cx.seq) as f64 / t.step_time_s,
            forward_compute_s: t.forward_compute_s,
            backward_compute_s: t.backward_compute_s,
            optimizer_compute_s: t.optimizer_compute_s,
            blocking_comm_s: t.blocking_comm_s,
            overlapped_comm_s: t.overlapped_comm_s,
            exposed_comm_s: t.exposed_comm_s,
            recompute_s: t.recompute_s,
            comm_bytes_per_device: comm,
            params_bytes: m.params_bytes,
            grads_bytes: m.grads_bytes,
            optimizer_bytes: m.optimizer_bytes,
            activations_bytes: m.activations_bytes,
            peak_breakdown: crate::figures::peak_breakdown(m),
            compute_by_op_s: t.compute_by_op_s.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            bubble_fraction: None,
            issue_wait_s: t.issue_wait_s,
        };
        let lg = e.lowered.program.graph();
        let leaves = lg.leaf_index();
        let tensors = e
            .lowered
            .leaf_specs
            .iter()
            .filter_map(|(name, spec)| {
                // Leaves the Program holds (no `.master` entries in fp32).
                let t = *leaves.get(name.as_str())?;
                Some(TensorPlacement {
                    name: name.clone(),
                    spec: spec.to_string(),
                    local_shape: lg.meta(t).shape.dims().to_vec(),
                })
            })
            .collect();
        let details = ops::op_details(g);
        let strategies = g
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, node)| {
                let s = e.strategies.get(i)?.as_ref()?;
                Some(NodeStrategy {
                    node: i,
                    scope: g.scope_name(node.scope).to_string(),
                    op: node.op.name().to_string(),
                    block: node.block,
                    detail: Some(details[i].clone()),
                    inputs: s.inputs.iter().map(Spec::to_string).collect(),
                    outputs: s.outputs.iter().map(Spec::to_string).collect(),
                    compute_axes: s.compute_axes.clone(),
                })
            })
            .collect();
        Plan {
            version: PLAN_VERSION,
            model: cx.model.clone(),
            cluster: cx.cluster.clone(),
            devices: n,
            batch: cx.batch,
            seq: cx.seq,
            dtype: cx.dtype.clone(),
            memory_budget_bytes: cx.budget,
            mesh: MeshJson {
                shape: mesh.shape.clone(),
                axes: mesh.axes.clone(),
                replicas: mesh.replicas.clone(),
                ring: mesh.ring,
            },
            config: cfg.canonical(),
            layout: match e.candidate.rule {
                crate::search::AxisRule::Megatron { .. } => "megatron".into(),
                crate::search::AxisRule::Free => "per-op".into(),
            },
            zero_stage: e.candidate.zero,
            micro_batches: e.candidate.micro_batches,
            checkpoint,
            source: source.to_string(),
            predicted,
            search_ms,
            baselines: Baselines::default(),
            tensors,
            collectives: e.lowered.collectives.iter().map(collective_json).collect(),
            strategies,
            pipeline: None,
            offload: e.candidate.offload.map(|o| {
                crate::offload::OffloadJson::new(
                    &o,
                    g,
                    &e.lowered.program,
                    &e.lowered.memory,
                    &e.lowered.time,
                    cx.host_memory_bytes,
                )
            }),
            loss_chunk_rows: loss_chunk_rows(g),
            mlp_tile_rows: mlp_tile_rows(g),
            experts: crate::expert::expert_facts(g),
        }
    }

    /// The offload the plan records (`None`: everything on the device).
    pub fn offload_choice(&self) -> Option<crate::offload::Offload> {
        self.offload.as_ref().map(crate::offload::OffloadJson::choice)
    }

    /// The checkpoint decisions as written (blocks not listed keep everything).
    pub fn checkpointing(&self) -> Checkpointing {
        Checkpointing {
            modes: self.checkpoint.iter().map(|c| (c.block, c.mode)).collect(),
            segments: Default::default(),
        }
    }

    /// Reads the per-node strategies back (for lowering a plan file again).
    pub fn node_strategies(&self, g: &Graph, mesh: &Mesh) -> Result<Vec<Option<Strategy>>> {
        if self.zero_stage > 3 {
            return Err(PlanError::Invalid(format!(
                "plan file: zero_stage {}: ZeRO has stages 0 to 3",
                self.zero_stage
            )));
        }
        let mut out: Vec<Option<Strategy>> = vec![None; g.nodes.len()];
        let parse = |s: &str| {
            Spec::parse(s).ok_or_else(|| {
                PlanError::Invalid(format!(
                    "plan file: `{s}` is not a sharding spec (write e.g. [S0, R])"
                ))
            })
        };
        for ns in &self.strategies {
            let node = g.nodes.get(ns.node).ok_or_else(|| {
                PlanError::Invalid(format!("plan file: node {} does not exist in this model (was the plan made for another model or batch?)", ns.node))
            })?;
            if node.op.name() != ns.op {
                return Err(PlanError::Invalid(format!(
                    "plan file: node {} is a {} in this model, the plan says {} (was the plan made for another model?)",
                    ns.node,
                    node.op.name(),
                    ns.op
                )));
            }
            let inputs = ns.inputs.iter().map(|s| parse(s)).collect::<Result<Vec<_>>>()?;
            let outputs = ns.outputs.iter().map(|s| parse(s)).collect::<Result<Vec<_>>>()?;
            if inputs.len() != node.inputs.len() || outputs.len() != node.outputs.len() {
                return Err(PlanError::Invalid(format!(
                    "plan file: node {} ({} {}) has {} input(s) and {} output(s), the plan \
                     gives {} input and {} output spec(s); give one spec per tensor",
                    ns.node,
                    ns.op,
                    ns.scope,
                    node.inputs.len(),
                    node.outputs.len(),
                    inputs.len(),
                    outputs.len()
                )));
            }
            let mut seen = vec![false; mesh.ndim()];
            for &a in &ns.compute_axes {
                if a >= mesh.ndim() || std::mem::replace(&mut seen[a], true) {
                    return Err(PlanError::Invalid(format!(
                        "plan file: node {} ({}) computes over mesh axes {:?}, but the mesh \
                         has axes 0..{} and each may appear once",
                        ns.node,
                        ns.scope,
                        ns.compute_axes,
                        mesh.ndim()
                    )));
                }
            }
            for (spec, &t) in
                inputs.iter().zip(&node.inputs).chain(outputs.iter().zip(&node.outputs))
            {
                if spec.local_shape(mesh, g.meta(t).shape.dims()).is_none() {
                    return Err(PlanError::Invalid(format!(
                        "plan file: {} ({}) cannot be split as {spec} on mesh {:?}",
                        ns.scope,
                        g.meta(t),
                        mesh.shape
                    )));
                }
            }
            out[ns.node] = Some(Strategy {
                inputs,
                outputs,
                compute_axes: ns.compute_axes.clone(),
                axis_labels: vec![None; mesh.ndim()],
            });
        }
        for (i, n) in g.nodes.iter().enumerate() {
            if !n.op.is_leaf() && out[i].is_none() {
                return Err(PlanError::Invalid(format!(
                    "plan file: no strategy for node {i} ({} {})",
                    n.op.name(),
                    g.scope_name(n.scope)
                )));
            }
        }
        Ok(out)
    }

    /// `--explain`: the spec notation, every distinct block's strategies (alike blocks
    /// folded), step time, compute by op, collectives, memory at the peak, pipeline stages
    /// ([`crate::explain`]).
    pub fn explain(&self) -> String {
        self.explain_text()
    }
}

fn collective_json(c: &CollectiveRecord) -> CollectiveJson {
    CollectiveJson {
        scope: c.scope.clone(),
        phase: c.phase.name().to_string(),
        op: c.op.to_string(),
        axis: c.axis,
        group: c.group,
        bytes: c.bytes,
    }
}
/// Rewrites a plan made from one pipeline device's lowering ([`Plan::from_evaluated`])
/// into the pipelined plan's: every device, the schedule's step time and bubble, the per-rank
/// peaks, the `pipeline` section.
pub fn attach_pipeline(plan: &mut Plan, l: &PipeLowered, full: &Mesh, tokens: usize) {
    let ranks = full.num_devices();
    let p = &mut plan.predicted;
    let (old_t, old_n) = (p.step_time_s, plan.devices as f64);
    p.step_time_s = l.step_time_s;
    if l.step_time_s > 0.0 {
        p.mfu *= old_t * old_n / (l.step_time_s * ranks as f64);
        p.tokens_per_s = tokens as f64 / l.step_time_s;
    }
    p.peak_bytes_per_device = pipeline_plan::peaks_per_rank(l, ranks);
    // What is live at the worst device's peak (the device the plan's other figures are of).
    if let Some(worst) = l.devices.iter().max_by_key(|d| d.lowered.memory.peak_bytes) {
        p.peak_breakdown = crate::figures::peak_breakdown(&worst.lowered.memory);
    }
    p.bubble_fraction = Some(l.timeline.bubble_fraction());
    p.comm_bytes_per_device = l
        .devices
        .iter()
        .map(|d| d.lowered.collectives.iter().map(|c| c.bytes).sum::<u64>())
        .max()
        .unwrap_or(0);
    plan.devices = ranks;
    plan.pipeline = Some(pipeline_plan::pipeline_json(l, full));
}
