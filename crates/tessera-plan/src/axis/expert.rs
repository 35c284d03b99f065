//! Expert parallelism (`epN`, GShard; Megatron-LM's `--expert-model-parallel-size`): a mesh
//! axis `ep` inside the data-parallel group. Every op outside the experts splits its batch
//! over dp × ep (the tokens of dp · ep data-parallel shards), and the experts' ops — from the
//! permute after each dispatch to the permute before its combine: the batched matmuls over
//! the expert dim E and the stacked expert weights they read — split E over ep instead (each
//! device runs `E / ep` experts on every token of its dp group routed to them). The reshard
//! between a batch-split dispatch buffer `[G, E, C, H]` and its expert-split permute is an
//! all-to-all over the ep axis, found by the reshard search like any other move: one before
//! the experts and one after (and their gradients the other way in the backward), each moving
//! the capacity's buffer, padding included.
//!
//! Everything of the axis lives here: its config token ([`parse_token`]), its rules
//! ([`validate`]), its mesh ([`mesh_shape`]), its sharding pins for the search ([`ep_pins`]),
//! the config a plan describes ([`describe_ep`]), its `--explain` lines ([`explain_lines`])
//! and its export fields ([`megatron_args`], [`torchtitan_degree`], [`refuse_export`]). The
//! rest of the planner calls in:
//! - routing is per group, one sequence a group (`tessera_ir::ops::moe`, the model's
//!   `sparse_block`): a split of the batch never changes which tokens drop, so every plan
//!   drops what one device drops with the same capacity;
//! - non-expert weights are not split over ep, so their gradients are pending sums over it and
//!   reduce over dp × ep; the expert matmuls split E over ep, and the stacked expert
//!   parameters `[E, out, in]` are stored split over ep (each device holds its `E / ep`
//!   experts), so their gradients reduce over dp only and ZeRO shards them over the dp ranks
//!   that hold the same experts (generic parameter planning, `lower.rs`: every live axis a
//!   weight is not split on is pending);
//! - with `ppN` each stage's mesh is `[dp, ep, tp]` ([`crate::axis::stage_mesh`]): a stage
//!   holds its own layers' experts split over its ep group, and a plan file names the axes
//!   (`pipeline::plan::file_stage_names`; a plan *file* with ep still trains off the config
//!   string's run, see ARCHITECTURE.md);
//! - with `cpN` the routing ops keep the sequence whole (a group is a sequence), so the
//!   tokens are gathered over cp before the router's top-k and sliced after the combine.

use super::{
    Axis, ConfigError, Engine, ExplainContext, ExportFields, GridContext, Parsed, PinContext, Slot,
    Token,
};
use crate::config::ParallelConfig;
use crate::mesh::AxisName;
use crate::rules::{DimRole, Labeling, Strategy};
use crate::Mesh;
use tessera_ir::{Graph, Op};

/// An ep token of a config string (lower-cased `tok`, as written `raw`): `Some(Ok("ep"))` for
/// `epN` (its degree written into `degree`), `Some(Err)` when it is one but malformed, `None`
/// otherwise.
pub fn parse_token(
    raw: &str,
    tok: &str,
    degree: &mut usize,
) -> Option<Result<&'static str, String>> {
    if tok == "ep" {
        return Some(Err(format!("`{raw}`: give the expert-parallel degree, e.g. ep2")));
    }
    let digits = tok.strip_prefix("ep")?;
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    Some(match digits.parse::<usize>() {
        Ok(0) => Err(format!("`{raw}`: ep must be at least 1 (1 means not split)")),
        Ok(n) => {
            *degree = n;
            Ok("ep")
        }
        Err(_) => Err(format!("`{raw}`: the number is too large")),
    })
}

/// The config rules of the axis: hybrid sharding (`shard=`) and model-state offload
/// (`offload` says whether the config moves model state) do not compose with it yet.
pub fn validate(ep: usize, shard: bool, offload: bool) -> Result<(), ConfigError> {
    if ep == 0 {
        let message = "ep must be at least 1 (1 means not split)".into();
        return Err(ConfigError::Zero { knob: "ep", message });
    }
    let why = if ep == 1 {
        None
    } else if shard {
        Some((
            "shard",
            "hybrid sharding (shard=) with expert parallelism is not supported yet: drop one",
        ))
    } else if offload {
        Some((
            "offload",
            "model-state offload (offload=opt, grads+opt, all) with expert parallelism is not \
             supported yet: drop one of them, or offload activations only (offload=act)",
        ))
    } else {
        None
    };
    match why {
        Some((with, why)) => {
            Err(ConfigError::Unsupported { knob: "ep", with, message: format!("ep{ep}: {why}") })
        }
        None => Ok(()),
    }
}

/// The canonical token of the axis (after `dpN`): ` epN` when ep > 1, else nothing.
pub fn canonical(ep: usize) -> String {
    if ep > 1 {
        format!(" ep{ep}")
    } else {
        String::new()
    }
}

/// A config's stage mesh and its axis names: context parallelism's
/// ([`crate::context::mesh_shape`]) with an `ep` axis right after `dp` when ep > 1 — inside
/// the data-parallel group, as Megatron-LM carves its expert-parallel groups from the
/// data-parallel ranks (tp, cp fastest over the devices, then ep, then dp).
pub fn mesh_shape(dp: usize, ep: usize, cp: usize, tp: usize) -> (Vec<usize>, Vec<AxisName>) {
    let (mut shape, mut names) = crate::context::mesh_shape(dp, cp, tp);
    if ep > 1 {
        shape.insert(1, ep);
        names.insert(1, AxisName::Expert);
    }
    (shape, names)
}

/// For every tensor dim, whether it is an expert dim: the `E` of each dispatch buffer
/// `[.., E, C, H]`, carried forward through the ops whose labelings keep it (the permute, the
/// reshape, the batched matmuls, their activation) up to the combine, which sums it away.
pub fn expert_dims(g: &Graph, labels: &[Option<Labeling>]) -> Vec<Vec<bool>> {
    let mut dims: Vec<Vec<bool>> =
        g.tensors.iter().map(|t| vec![false; t.meta.shape.rank()]).collect();
    for (i, n) in g.nodes.iter().enumerate() {
        if let Op::MoeDispatch { .. } = n.op {
            let r = g.meta(n.outputs[0]).shape.rank();
            dims[n.outputs[0].index()][r - 3] = true;
            continue;
        }
        let Some(l) = &labels[i] else { continue };
        let expert = expert_labels(n, l, &dims);
        for (k, &o) in n.outputs.iter().enumerate() {
            for (d, lab) in l.outputs[k].iter().enumerate() {
                if lab.is_some_and(|lab| expert[lab]) {
                    dims[o.index()][d] = true;
                }
            }
        }
    }
    dims
}

/// A node's labels that carry an expert dim of one of its inputs.
fn expert_labels(n: &tessera_ir::Node, l: &Labeling, dims: &[Vec<bool>]) -> Vec<bool> {
    let mut out = vec![false; l.sizes.len()];
    for (k, &t) in n.inputs.iter().enumerate() {
        for (d, lab) in l.inputs[k].iter().enumerate() {
            if let Some(lab) = lab {
                if dims[t.index()][d] {
                    out[*lab] = true;
                }
            }
        }
    }
    out
}

/// The label the ep axis splits at each node (`None`: none — a weight's own ops, a scalar's):
/// the expert label of the experts' ops, the batch label everywhere else (as dp splits it).
/// `roles` are the dim roles from the token ids (`search::space::dim_roles`). Errs, naming
/// the numbers and the fix, where ep does not divide the experts or a batch.
pub fn ep_pins(
    g: &Graph,
    labels: &[Option<Labeling>],
    roles: &[Vec<DimRole>],
    ep: usize,
    dp: usize,
) -> Result<Vec<Option<usize>>, String> {
    let experts = expert_dims(g, labels);
    if !g.nodes.iter().any(|n| matches!(n.op, Op::MoeDispatch { .. })) {
        return Err(format!(
            "ep{ep} splits the experts of a mixture of experts, but the model has none: drop \
             epN (use dpN for data parallelism)"
        ));
    }
    let mut pins = vec![None; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        let Some(l) = &labels[i] else { continue };
        let expert = expert_labels(n, l, &experts);
        let pin = match (0..l.sizes.len()).find(|&lab| expert[lab]) {
            Some(lab) => {
                let e = l.sizes[lab];
                if !e.is_multiple_of(ep) {
                    let fits: Vec<String> = (2..=e)
                        .filter(|c| e.is_multiple_of(*c))
                        .map(|c| format!("ep{c}"))
                        .collect();
                    return Err(format!(
                        "ep{ep} splits the {e} experts of {} over {ep} devices, which {ep} does \
                         not divide: use {}",
                        g.scope_name(n.scope),
                        if fits.is_empty() { "no epN".to_string() } else { fits.join(" or ") }
                    ));
                }
                Some(lab)
            }
            None => {
                let role = crate::rules::label_roles(n, l, roles);
                let lab =
                    (0..l.sizes.len()).find(|&lab| role[lab] == DimRole::Batch && l.shardable[lab]);
                if let Some(lab) = lab {
                    if !l.sizes[lab].is_multiple_of(ep * dp) {
                        return Err(format!(
                            "dp{dp} × ep{ep} splits the batch of {} ({}) of {} sequences, which \
                             {} does not divide: use a (micro-)batch that is a multiple of {}",
                            g.scope_name(n.scope),
                            n.op.name(),
                            l.sizes[lab],
                            dp * ep,
                            dp * ep
                        ));
                    }
                }
                lab
            }
        };
        pins[i] = pin;
    }
    Ok(pins)
}

/// The automatic search's expert-parallel layouts `(dp, ep, tp)` on `n` devices for a model
/// with `experts` experts per layer (none without experts): every tensor-parallel degree that
/// divides a node (as the dp × tp grid's), and every ep > 1 that divides both the experts and
/// the data-parallel ranks left (ep is carved from them, Megatron-LM's
/// `--expert-model-parallel-size`). Within a node or across nodes alike: the all-to-alls are
/// priced on the links they cross (`reshard::collective_time`).
pub fn grid(n: usize, gpus_per_node: usize, experts: usize) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    if experts < 2 {
        return out;
    }
    for tp in (1..=gpus_per_node.min(n)).filter(|&t| n.is_multiple_of(t)) {
        let rest = n / tp;
        for ep in (2..=rest).filter(|&e| rest.is_multiple_of(e) && experts.is_multiple_of(e)) {
            out.push((rest / ep, ep, tp));
        }
    }
    out
}

/// Whether the strategy splits exactly the pinned label over the ep axis.
pub fn keeps_pin(s: &Strategy, axis: usize, pin: usize) -> bool {
    s.axis_labels[axis] == Some(pin)
}

/// The expert-parallel degree a plan's layout shows: the size of the mesh axis named `ep`
/// when some expert matmul (a batched `MatMul` whose batch dim 0 is an expert dim) splits E
/// over it. Only meshes with an axis named `ep` (a config's) have one.
pub fn describe_ep(g: &Graph, strategies: &[Option<Strategy>], mesh: &Mesh) -> usize {
    let Some(axis) = mesh.axis(AxisName::Expert) else { return 1 };
    if mesh.shape[axis] < 2 {
        return 1;
    }
    let splits = g.nodes.iter().enumerate().any(|(i, n)| {
        matches!(n.op, Op::MatMul { .. })
            && g.meta(n.inputs[0]).shape.rank() == 3
            && strategies[i]
                .as_ref()
                .is_some_and(|s| s.inputs[0].dims.first().is_some_and(|d| d.contains(&axis)))
    });
    if splits {
        mesh.shape[axis]
    } else {
        1
    }
}

/// What `--explain` says about the experts: their count and the capacity per group.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExpertFacts {
    /// Experts per MoE layer.
    pub experts: usize,
    /// MoE layers (dispatches in the forward graph).
    pub layers: usize,
    /// Tokens per routing group and the capacity per expert and group.
    pub group_tokens: usize,
    pub capacity: usize,
    /// Experts each token is routed to (0 in plan files written before it was recorded).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub top_k: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The experts of a forward graph: from its first dispatch (`[G.., n, H]` tokens into
/// `[G.., E, C, H]`) and its slots (`[G.., n, k]` choices). `None` without experts.
pub fn expert_facts(g: &Graph) -> Option<ExpertFacts> {
    let dispatches: Vec<&tessera_ir::Node> =
        g.nodes.iter().filter(|n| matches!(n.op, Op::MoeDispatch { .. })).collect();
    let first = dispatches.first()?;
    let Op::MoeDispatch { experts, capacity } = first.op else { return None };
    let x = g.meta(first.inputs[0]).shape.dims().to_vec();
    let top_k = g
        .nodes
        .iter()
        .find(|n| matches!(n.op, Op::MoeSlots { .. }))
        .and_then(|n| g.meta(n.inputs[0]).shape.dims().last().copied())
        .unwrap_or(0);
    Some(ExpertFacts {
        experts,
        layers: dispatches.len(),
        group_tokens: x.get(x.len().wrapping_sub(2)).copied().unwrap_or(0),
        capacity,
        top_k,
    })
}

/// `--explain`'s lines about the experts: experts per device, the capacity and the routed
/// tokens the grouped GEMMs are priced at, and under expert parallelism the all-to-all
/// traffic around the experts per step and device (`a2a_bytes`: the plan's all-to-all bytes
/// over the ep axis).
pub fn explain_lines(
    ep: usize,
    facts: &ExpertFacts,
    a2a_calls: usize,
    a2a_bytes: u64,
) -> Vec<String> {
    let dropless = facts.capacity >= facts.group_tokens;
    let mut out = vec![if ep < 2 {
        format!(
            "experts: {} per device, not split ({} MoE layers; epN splits them)",
            facts.experts, facts.layers
        )
    } else {
        format!(
            "expert parallel: ep{ep}, {} experts per device ({} per MoE layer, {} layers)",
            facts.experts / ep.max(1),
            facts.experts,
            facts.layers
        )
    }];
    out.push(format!(
        "  capacity {} tokens per expert and sequence of {} ({}); tokens split over dp x ep",
        facts.capacity,
        facts.group_tokens,
        if dropless { "dropless" } else { "later tokens past it dropped" }
    ));
    if facts.top_k > 0 {
        let balanced = (facts.top_k * facts.group_tokens) as f64 / facts.experts.max(1) as f64;
        out.push(format!(
            "  routed: top-{} of {}, {balanced:.1} tokens per expert and sequence when balanced; \
             the grouped GEMMs run the busiest expert's (x --moe-imbalance, at most the capacity)",
            facts.top_k, facts.experts
        ));
    }
    if ep >= 2 {
        out.push(format!(
            "  {a2a_calls} all-to-alls per step around the experts (dispatch and combine, \
             forward, recompute and backward),"
        ));
        out.push(format!(
            "  {} per device; expert gradients reduce over dp, the rest over dp x ep",
            crate::units::format_bytes(a2a_bytes)
        ));
    }
    out
}

/// Megatron-LM's flag for the axis: `--expert-model-parallel-size N` when ep > 1.
pub fn megatron_args(ep: usize) -> Vec<String> {
    if ep < 2 {
        return Vec::new();
    }
    vec![format!("--expert-model-parallel-size {ep}")]
}

/// A mixture of experts' routed experts, as the export's MoE arguments name them.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelExperts {
    /// Experts per MoE layer and experts each token is routed to.
    pub experts: usize,
    pub top_k: usize,
    /// Each expert's SwiGLU width.
    pub ffn_hidden: usize,
    /// Whether each layer is an MoE layer (the others are dense).
    pub sparse_layers: Vec<bool>,
    /// The capacity factor (`None`: dropless).
    pub capacity_factor: Option<f64>,
    /// Top-k weights renormalised to sum to one (softmax over the chosen logits); else the
    /// softmax over every expert before top-k.
    pub renormalise: bool,
    /// The auxiliary load-balancing loss's coefficient, when the loss includes it.
    pub aux_loss_coeff: Option<f64>,
    /// A shared expert's width and whether a sigmoid gate scales it (Qwen2-MoE).
    pub shared_expert: Option<(usize, bool)>,
}

/// Megatron-LM's flags for a model's routed experts (its MoE README, "MoE Related
/// Arguments"): `--num-experts`, `--moe-router-topk`, `--moe-ffn-hidden-size`, the MoE layers
/// (`--moe-layer-freq` as a Python list expression when some layers are dense), the router
/// (Megatron's default softmax over the chosen logits is the renormalised top-k; without
/// renormalisation `--moe-router-pre-softmax`), the auxiliary loss as the model's loss has it
/// (else `--moe-router-load-balancing-type none`), a shared expert, the all-to-all dispatcher
/// when ep > 1, and the capacity: `--moe-expert-capacity-factor f --moe-token-drop-policy
/// position --moe-pad-expert-input-to-capacity` (tessera keeps each expert's earliest tokens
/// and holds the capacity's buffer). Megatron's capacity is per rank's micro-batch tokens,
/// tessera's per sequence: the same when a rank's micro-batch is one sequence.
pub fn megatron_model_args(m: &ModelExperts, ep: usize) -> Vec<String> {
    let mut out = vec![
        format!("--num-experts {}", m.experts),
        format!("--moe-router-topk {}", m.top_k),
        format!("--moe-ffn-hidden-size {}", m.ffn_hidden),
    ];
    if m.sparse_layers.iter().any(|s| !s) {
        out.push(format!("--moe-layer-freq \"{}\"", layer_pattern(&m.sparse_layers)));
    }
    if !m.renormalise {
        out.push("--moe-router-pre-softmax".into());
    }
    match m.aux_loss_coeff {
        Some(c) => {
            out.push(format!("--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff {c}"))
        }
        None => out.push("--moe-router-load-balancing-type none".into()),
    }
    if let Some((width, gated)) = m.shared_expert {
        out.push(format!("--moe-shared-expert-intermediate-size {width}"));
        if gated {
            out.push("--moe-shared-expert-gate".into());
        }
    }
    if ep > 1 {
        out.push("--moe-token-dispatcher-type alltoall".into());
    }
    if let Some(f) = m.capacity_factor {
        out.push(format!("--moe-expert-capacity-factor {f}"));
        out.push("--moe-token-drop-policy position --moe-pad-expert-input-to-capacity".into());
    }
    out
}

/// The MoE layers as Megatron-LM's `--moe-layer-freq` list expression, run-length coded:
/// `([0]*1+[1]*26)`.
fn layer_pattern(sparse: &[bool]) -> String {
    let mut runs: Vec<(bool, usize)> = Vec::new();
    for &s in sparse {
        match runs.last_mut() {
            Some((v, n)) if *v == s => *n += 1,
            _ => runs.push((s, 1)),
        }
    }
    let parts: Vec<String> = runs.iter().map(|(v, n)| format!("[{}]*{n}", u8::from(*v))).collect();
    format!("({})", parts.join("+"))
}

/// torchtitan's `[parallelism]` degree for the axis: `expert_parallel_degree = N`.
pub fn torchtitan_degree(ep: usize) -> Option<String> {
    (ep > 1).then(|| format!("expert_parallel_degree = {ep}"))
}

/// Why an engine cannot run an expert-parallel plan (`None`: it can, or ep is 1).
pub fn refuse_export(engine: &str, ep: usize) -> Option<String> {
    if ep < 2 {
        return None;
    }
    match engine {
        "deepspeed" => Some(format!(
            "DeepSpeed cannot say ep{ep} in ds_config.json: its expert parallelism is set in \
             the model code (deepspeed.moe.layer.MoE(ep_size={ep})); export to Megatron-LM \
             (--expert-model-parallel-size {ep}) or torchtitan (expert_parallel_degree = {ep})"
        )),
        _ => None,
    }
}

/// The expert-parallel axis in the registry ([`super::AXES`]): every method is one of the
/// functions above.
pub struct ExpertAxis;

impl Axis for ExpertAxis {
    fn name(&self) -> &'static str {
        "ep"
    }

    fn parse_token(&self, t: Token<'_>, cfg: &mut ParallelConfig) -> Parsed {
        parse_token(t.raw, t.lower, &mut cfg.ep)
    }

    /// Right after `dpN`.
    fn canonical(&self, cfg: &ParallelConfig) -> Vec<(Slot, String)> {
        let s = canonical(cfg.ep);
        let s = s.trim();
        (!s.is_empty()).then(|| (15, s.to_string())).into_iter().collect()
    }

    fn validate(&self, cfg: &ParallelConfig) -> Result<(), ConfigError> {
        validate(cfg.ep, cfg.shard.is_some(), cfg.offload.is_some_and(|o| o.moves_state()))
    }

    /// Inside the data-parallel group: after dp, before cp and tp (see [`mesh_shape`]).
    fn mesh_axes(&self, cfg: &ParallelConfig) -> Vec<(Slot, AxisName, usize)> {
        if cfg.ep > 1 {
            vec![(20, AxisName::Expert, cfg.ep)]
        } else {
            Vec::new()
        }
    }

    fn grid(&self, cx: &GridContext) -> Vec<ParallelConfig> {
        grid(cx.devices, cx.gpus_per_node, cx.experts)
            .into_iter()
            .map(|(dp, ep, tp)| ParallelConfig::new(dp, tp).with_ep(ep))
            .collect()
    }

    fn pinned_axis(&self) -> Option<AxisName> {
        Some(AxisName::Expert)
    }

    fn pins(&self, cx: &mut PinContext<'_>) -> Result<Vec<Option<usize>>, String> {
        let mesh = cx.mesh;
        let dp: usize = [AxisName::Replica, AxisName::Data]
            .iter()
            .filter_map(|&n| mesh.axis(n))
            .map(|a| mesh.shape[a])
            .product();
        ep_pins(cx.graph, cx.labels, cx.roles, mesh.shape[cx.axis], dp)
    }

    fn pin_miss(&self) -> &'static str {
        "the expert-parallel axis"
    }

    fn explain_lines(&self, cx: &ExplainContext<'_>) -> Vec<String> {
        let Some(facts) = cx.experts else { return Vec::new() };
        let Some(axis) = cx.axis(AxisName::Expert) else {
            return explain_lines(1, facts, 0, 0);
        };
        let a2a = cx.traffic.iter().filter(|c| {
            let op: String =
                c.op.to_ascii_lowercase().chars().filter(char::is_ascii_alphabetic).collect();
            c.axis == axis && op.contains("alltoall")
        });
        let (calls, bytes) = a2a.fold((0, 0), |(n, b), c| (n + 1, b + c.bytes));
        explain_lines(cx.shape[axis], facts, calls, bytes)
    }

    fn export(&self, engine: Engine, cfg: &ParallelConfig) -> ExportFields {
        let name = match engine {
            Engine::Megatron => {
                let args = megatron_args(cfg.ep);
                return ExportFields::Args(args.into_iter().map(|a| (25, a)).collect());
            }
            Engine::DeepSpeed => "deepspeed",
            Engine::Torchtitan => "torchtitan",
        };
        match refuse_export(name, cfg.ep) {
            // The nearest: the expert-parallel devices as data-parallel replicas.
            Some(why) => ExportFields::Refused {
                why,
                nearest: cfg.clone().with_dp(cfg.dp * cfg.ep).with_ep(1),
            },
            None => ExportFields::Args(Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ep_tokens_parse_and_print() {
        let mut n = 1;
        assert_eq!(parse_token("ep4", "ep4", &mut n), Some(Ok("ep")));
        assert_eq!(n, 4);
        assert!(parse_token("ep0", "ep0", &mut n).unwrap().is_err());
        assert!(parse_token("ep", "ep", &mut n).unwrap().is_err());
        assert!(parse_token("epoch", "epoch", &mut n).is_none());
        assert_eq!(canonical(4), " ep4");
        assert_eq!(canonical(1), "");
        let (shape, names) = mesh_shape(2, 2, 1, 2);
        assert_eq!(shape, vec![2, 2, 2]);
        assert_eq!(names, vec![AxisName::Data, AxisName::Expert, AxisName::Tensor]);
        assert!(validate(2, true, false).is_err());
        assert!(validate(2, false, false).is_ok());
    }

    #[test]
    fn the_grid_carves_ep_from_the_data_parallel_ranks() {
        // 8 devices, 8 experts: ep 2, 4, 8 at tp 1; ep 2, 4 at tp 2; ep 2 at tp 4.
        let g = grid(8, 8, 8);
        assert!(
            g.contains(&(1, 8, 1)) && g.contains(&(2, 2, 2)) && g.contains(&(1, 2, 4)),
            "{g:?}"
        );
        assert_eq!(g.len(), 6, "{g:?}");
        assert!(g.iter().all(|&(dp, ep, tp)| dp * ep * tp == 8 && 8 % ep == 0));
        // Six experts: ep never 4 or 8.
        assert!(grid(8, 8, 6).iter().all(|&(_, ep, _)| ep == 2), "{:?}", grid(8, 8, 6));
        // No experts, no grid.
        assert!(grid(8, 8, 0).is_empty());
    }

    #[test]
    fn megatron_flags_name_experts_topk_and_capacity() {
        assert_eq!(megatron_args(8), vec!["--expert-model-parallel-size 8".to_string()]);
        let mut m = ModelExperts {
            experts: 8,
            top_k: 2,
            ffn_hidden: 14336,
            sparse_layers: vec![true; 4],
            capacity_factor: Some(1.25),
            renormalise: true,
            aux_loss_coeff: Some(0.02),
            shared_expert: None,
        };
        let a = megatron_model_args(&m, 8).join(" ");
        for flag in [
            "--num-experts 8",
            "--moe-router-topk 2",
            "--moe-ffn-hidden-size 14336",
            "--moe-expert-capacity-factor 1.25",
            "--moe-token-drop-policy position",
            "--moe-pad-expert-input-to-capacity",
            "--moe-aux-loss-coeff 0.02",
            "--moe-token-dispatcher-type alltoall",
        ] {
            assert!(a.contains(flag), "{flag}: {a}");
        }
        assert!(!a.contains("--moe-layer-freq") && !a.contains("pre-softmax"), "{a}");
        // Dropless, a dense first layer, no renormalisation, no aux loss, ep 1.
        m.capacity_factor = None;
        m.sparse_layers = vec![false, true, true];
        m.renormalise = false;
        m.aux_loss_coeff = None;
        let a = megatron_model_args(&m, 1).join(" ");
        assert!(a.contains("--moe-layer-freq \"([0]*1+[1]*2)\""), "{a}");
        assert!(a.contains("--moe-router-pre-softmax"), "{a}");
        assert!(a.contains("--moe-router-load-balancing-type none"), "{a}");
        assert!(!a.contains("capacity") && !a.contains("dispatcher"), "{a}");
        assert!(megatron_args(1).is_empty());
    }
}
