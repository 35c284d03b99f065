//! Context parallelism (`cpN`), the all-to-all variant (DeepSpeed-Ulysses; Megatron-LM's
//! `--cp-comm-type a2a`): a mesh axis `cp` splits the sequence of every activation through the
//! whole step — embedding, norms, projections, MLP, loss — and, around attention, the heads
//! instead. Attention and RoPE see whole sequences (their labelings have no sequence label)
//! but split by heads, so the reshard between a sequence-split tensor and a head-split one is
//! an all-to-all over the cp axis, found by the reshard search like any other move: q, k and
//! v go sequence-split → head-split before RoPE and attention, the output head-split →
//! sequence-split after it (and their gradients the other way in the backward).
//!
//! Everything of the axis lives here: its config tokens ([`parse_token`], [`CpComm`]), its
//! mesh ([`mesh_shape`]), its sharding pins for the search ([`cp_pins`], [`order_heads`]), the
//! config a plan describes ([`describe_cp`]), its `--explain` lines ([`explain_lines`]) and its
//! export fields ([`megatron_args`], [`refuse_export`]); [`ContextAxis`] registers them as the
//! cp axis of [`super::AXES`], through which the grammar, the mesh, the search space,
//! `--explain` and the exports reach them. The rest of the planner calls in:
//! - weights are never split over cp, so their gradients are pending sums over it and the
//!   lowering reduces them over dp × cp, and ZeRO shards over dp × cp (Megatron-LM's
//!   distributed optimizer shards over its data-parallel-and-context group) — both fall out of
//!   the generic parameter planning (`lower.rs`, `plan_params`: every live axis a weight is
//!   not split on is pending);
//! - with `tpN`, attention's heads split over tp and cp together, tp-major (each tensor rank's
//!   heads split further over cp), so the all-to-all stays inside each tensor-parallel group's
//!   heads ([`order_heads`]); the KV heads must divide by cp · tp;
//! - with `sp`, the norms' sequence splits over cp then tp (cp-major), so `sp`'s gathers stay
//!   inside each cp rank's chunk.
//!
//! # Ring attention (`cp=ring`)
//!
//! The cp axis splits the sequence everywhere, attention and RoPE included, and K/V blocks
//! travel around the cp ring (Megatron-LM's `--cp-comm-type p2p`, torchtitan's context
//! parallelism). A config's mesh says so ([`crate::Mesh::ring`], recorded in the plan file).
//! - IR (`tessera-ir`, interpreter and CPU kernels; CUDA refuses by name):
//!   `AttentionSpec::ring` ([`tessera_ir::RingBlock`] `{ axis, size, step, zigzag }`) is the
//!   device's queries against the key block of the device `step` places before it on the
//!   ring, at global positions from the device's cp coordinate (one Program for every
//!   device); the log-sum-exp output is differentiable (`AttentionBackward`'s seventh input);
//!   `Op::RingMerge` folds a block's partial output into the running output and log-sum-exp
//!   (the online merge), the last merge of a ring carrying the ring's backward as its VJP;
//!   `AttentionSpec::visible_pairs` measures each device's causal work.
//! - Pins ([`cp_pins`] with `ring`): no heads pin, so the KV-heads bound is tp's alone; the
//!   sequence must divide into 2·cp zig-zag chunks. [`ring_strategies`] splits attention's and
//!   RoPE's sequence over cp (a dim their labelings do not name).
//! - Lowering (`lower/ring.rs`): each such attention becomes `cp` block attentions (`step`
//!   0..cp), each later one folded into the running output and log-sum-exp by a
//!   `RingMerge` as its block arrives (the online merge: one block's partials live at a
//!   time); before each later step the held K/V block (`[B, S/cp, Hkv, D]`: only the KV heads
//!   travel) goes to the next device by `Send` and the previous device's arrives by `Recv`.
//!   `P2p::ring` makes the peer an offset from the device's cp coordinate (resolved by the
//!   runtime's `CommRunner::peer`); each transfer of a ring has its own tag, above the
//!   pipeline's, and every ring of the Program reuses them (per-tag FIFO streams, checked to
//!   pair in Program order: `lower/ring.rs`), so a Program needs `6·(cp − 1)` tags whatever
//!   its layers: up to cp 2,729.
//!   Ring transfers are outside the autodiff: the backward is the last merge's VJP
//!   (`tessera_ir::ops::ring`), FlashAttention's over blocks — from the saved final output
//!   and log-sum-exp it recomputes each block's share as K/V go around the ring again, dQ
//!   summed locally and dK/dV travelling with their blocks home (`4·(cp − 1)` sends per
//!   attention, Megatron-LM's count). Sends are non-blocking on every transport (threads,
//!   MPI), so the ring never waits on itself. The trainer's "a Program with a Send is a
//!   pipeline stage" test ignores ring sends. Under checkpointing the ring's output and
//!   log-sum-exp are kept, never recomputed (`remat::dropped_buffers`: that would run the
//!   ring again), and a received block dies within the forward.
//! - Zig-zag: the trainer reorders the sequence of every `[B, S, ..]` data input into 2·cp
//!   chunks, device c's shard being chunks c and 2·cp−1−c (`LeafLayout::zigzag`, set by the
//!   lowering when an attention is a ring block); RoPE reads a `position_ids` input the
//!   lowering adds (filled by the trainer with `0..S` in the same order), so it rotates each
//!   chunk by its global position. Every device does the same causal work.
//! - Memory and traffic stay exact because the transfers are Program nodes: the memory
//!   simulation charges the received blocks, `lower/time.rs` counts each transfer and
//!   prices each send as a 2-device transfer over the cp axis' link.
//! - `--explain` shows the blocks sent per step and their bytes per device
//!   ([`explain_lines`]); exports say Megatron-LM `--context-parallel-size N --cp-comm-type
//!   p2p` and torchtitan `context_parallel_degree = N`; DeepSpeed refuses by name.
//! - Pricing (`lower/time.rs`): each ring transfer overlaps the next block attention, so a
//!   ring step costs the longer of its transfer and its block's compute.
//! - Search: the automatic search tries ring attention beside the all-to-all variant where
//!   the latter cannot go — cp × tp past the KV heads (`planner::rounds::megatron_jobs`);
//!   `tessera train --device cuda` turns it off (`SearchKnobs::ring`: the CUDA backend runs
//!   ring attention on its unfused attention, not the flash kernels), and a model ring
//!   refuses (learned positions) is the candidate's own miss.
//! - Not yet: learned position tables (GPT-2's `wpe[0:S]` slice would have to gather each
//!   device's zig-zag rows) and pipelines (a stage's mesh does not carry the ring) are refused
//!   by name.

use super::{Axis, ConfigError, Engine, ExplainContext, ExportFields, GridContext, Parsed};
use super::{PinContext, Slot, Token};
use crate::config::ParallelConfig;
use crate::mesh::AxisName;
use crate::rules::{DimRole, Labeling, Strategy};
use crate::{Mesh, Result, Spec};
use tessera_ir::{Graph, Op};

/// How the cp axis exchanges what attention needs (a config value, so defined with the
/// config).
pub use crate::config::CpComm;

/// The message for `cp=ring` with a pipeline: the gap and the fix.
pub const RING_PIPELINE_REFUSED: &str = "cp=ring (ring attention) with a pipeline (ppN) is not \
     supported yet: a pipeline stage's mesh does not carry the ring; use cp=a2a with ppN, or \
     drop ppN";

/// A cp token of a config string (lower-cased `tok`, as written `raw`): `Some(Ok(kind))` when
/// it is one — `"cp"` for `cpN` (its degree written into `degree`), `"cp="` for `cp=a2a`
/// (into `comm`) — `Some(Err)` when it is one but malformed or refused, `None` otherwise.
pub fn parse_token(
    raw: &str,
    tok: &str,
    degree: &mut usize,
    comm: &mut Option<CpComm>,
) -> Option<Result<&'static str, String>> {
    if let Some(kind) = tok.strip_prefix("cp=") {
        return Some(match kind {
            "a2a" | "ulysses" | "all-to-all" => {
                *comm = Some(CpComm::A2a);
                Ok("cp=")
            }
            "ring" | "p2p" => {
                *comm = Some(CpComm::Ring);
                Ok("cp=")
            }
            _ => Err(format!("`{raw}`: context-parallel kinds are a2a and ring")),
        });
    }
    if tok == "cp" {
        return Some(Err(format!(
            "`{raw}`: give the context-parallel degree, e.g. cp2 (and optionally cp=a2a)"
        )));
    }
    let digits = tok.strip_prefix("cp")?;
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    Some(match digits.parse::<usize>() {
        Ok(0) => Err(format!("`{raw}`: cp must be at least 1 (1 means not split)")),
        Ok(n) => {
            *degree = n;
            Ok("cp")
        }
        Err(_) => Err(format!("`{raw}`: the number is too large")),
    })
}

/// The config rules of the axis: `cp=` needs cp > 1, and hybrid sharding (`shard=`) and
/// model-state offload (`offload` says whether the config moves model state) do not compose
/// with it yet; activation offload (`offload=act`) does; ring attention does not compose with
/// a pipeline (`pp` > 1) yet.
pub fn validate(
    cp: usize,
    comm: Option<CpComm>,
    shard: bool,
    offload: bool,
    pp: usize,
) -> Result<(), ConfigError> {
    if cp == 0 {
        let message = "cp must be at least 1 (1 means not split)".into();
        return Err(ConfigError::Zero { knob: "cp", message });
    }
    if cp == 1 {
        if let Some(c) = comm {
            return Err(ConfigError::Requires {
                knob: "cp=",
                needs: "cp",
                message: format!(
                    "cp={c} chooses how a context-parallel axis exchanges keys and values: add \
                     cpN with N > 1, e.g. `cp2 cp={c}`"
                ),
            });
        }
        return Ok(());
    }
    let why = if comm == Some(CpComm::Ring) && pp > 1 {
        Some(("pp", RING_PIPELINE_REFUSED))
    } else if shard {
        Some((
            "shard",
            "hybrid sharding (shard=) with context parallelism is not supported yet: drop one",
        ))
    } else if offload {
        Some((
            "offload",
            "model-state offload (offload=opt, grads+opt, all) with context parallelism is not \
             supported yet: drop one of them, or offload activations only (offload=act)",
        ))
    } else {
        None
    };
    match why {
        Some((with, why)) => {
            Err(ConfigError::Unsupported { knob: "cp", with, message: format!("cp{cp}: {why}") })
        }
        None => Ok(()),
    }
}

/// The canonical tokens of the axis (after `tpN`): `cpN cp=a2a` when cp > 1, else nothing.
pub fn canonical(cp: usize, comm: Option<CpComm>) -> String {
    if cp > 1 {
        format!(" cp{cp} cp={}", comm.unwrap_or_default())
    } else {
        String::new()
    }
}

/// A config's stage mesh (everything but the pipeline axis) and its axis names: `[dp, tp]`,
/// or `[dp, cp, tp]` with context parallelism — cp between dp and tp, as Megatron-LM orders
/// its groups (tp fastest over the devices, then cp, then dp), so cp's all-to-alls stay
/// inside a node before dp's gradient reductions do.
pub fn mesh_shape(dp: usize, cp: usize, tp: usize) -> (Vec<usize>, Vec<AxisName>) {
    use AxisName::{Context, Data, Tensor};
    if cp > 1 {
        (vec![dp, cp, tp], vec![Data, Context, Tensor])
    } else {
        (vec![dp, tp], vec![Data, Tensor])
    }
}

/// The shortest sequence the automatic search tries context parallelism for: below it the
/// activations a sequence split saves are small beside the model state, and the Megatron
/// grid stays as fast as before.
pub const GRID_MIN_SEQ: usize = 8192;

/// The automatic search's context-parallel candidates on `n` devices (`gpus_per_node` per
/// node) for a sequence of `seq`: every `(dp, cp, tp)` with cp > 1 dividing the sequence, tp
/// dividing a node and dp × cp × tp = n — none below [`GRID_MIN_SEQ`]. Heads cp × tp does not
/// divide are the candidate's own miss (`cp_pins` says why), as tp's are.
pub fn grid(n: usize, gpus_per_node: usize, seq: usize) -> Vec<(usize, usize, usize)> {
    if seq < GRID_MIN_SEQ {
        return Vec::new();
    }
    let mut out = Vec::new();
    for tp in (1..=gpus_per_node.min(n)).filter(|&t| n.is_multiple_of(t)) {
        let rest = n / tp;
        for cp in (2..=rest).filter(|&c| rest.is_multiple_of(c) && seq.is_multiple_of(c)) {
            out.push((rest / cp, cp, tp));
        }
    }
    out
}

/// The context-parallel axis of a Megatron-rule mesh with a cp axis: the one before the
/// tensor axis.
pub fn cp_axis(mesh: &Mesh) -> usize {
    mesh.ndim().saturating_sub(2)
}

/// The label the cp axis splits at each node (`None`: none — a weight's own ops, a scalar's):
/// the sequence label wherever a node has one, the heads of attention, RoPE (and a cache
/// write). `roles` are the dim roles propagated through attention (see
/// `search::space::context_roles`). Errs, naming the numbers and the fix, where cp (with tp)
/// does not divide the KV heads or the sequence.
pub fn cp_pins(
    g: &Graph,
    labels: &[Option<Labeling>],
    roles: &[Vec<DimRole>],
    cp: usize,
    tp: usize,
    ring: bool,
) -> Result<Vec<Option<usize>>, String> {
    // The heads first: RoPE comes before the attention whose KV heads bound the split. Ring
    // attention splits no heads over cp: the bound is tp's alone (`search/megatron.rs`).
    let split = cp.saturating_mul(tp);
    if ring {
        // Learned positions (GPT-2's `wpe[0:S]`): a slice of a parameter by the sequence,
        // which zig-zag chunks would have to gather at each device's positions instead.
        let learned = g.nodes.iter().find(|n| {
            matches!(n.op, Op::Slice { .. })
                && n.inputs
                    .first()
                    .is_some_and(|&t| matches!(g.producer(t).op, Op::Parameter { .. }))
        });
        if let Some(n) = learned {
            return Err(format!(
                "cp{cp} cp=ring: {} is a learned position table sliced by the sequence, which \
                 ring attention's zig-zag chunks do not read yet; use cp{cp} cp=a2a",
                g.scope_name(n.scope)
            ));
        }
    }
    for (i, n) in g.nodes.iter().enumerate().filter(|_| !ring) {
        if let (Op::Attention(_), Some(l)) = (&n.op, &labels[i]) {
            let (heads, kv) = (g.meta(n.inputs[0]).shape.dims()[2], l.sizes[heads_label(l)?]);
            if !kv.is_multiple_of(split) || !heads.is_multiple_of(split) {
                return Err(kv_heads_message(g, i, heads, kv, cp, tp));
            }
        }
    }
    let mut pins = vec![None; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        let Some(l) = &labels[i] else { continue };
        let pin = match &n.op {
            // Under ring attention their sequence splits, a dim their labelings do not name
            // ([`ring_strategies`]).
            Op::Attention(_) | Op::Rope { .. } | Op::CacheWrite if ring => None,
            Op::Attention(_) | Op::Rope { .. } | Op::CacheWrite => Some(heads_label(l)?),
            _ => {
                let role = crate::rules::label_roles(&g.nodes[i], l, roles);
                (0..l.sizes.len()).find(|&lab| role[lab] == DimRole::Seq && l.shardable[lab])
            }
        };
        if let Some(lab) = pin {
            let heads = matches!(n.op, Op::Attention(_) | Op::Rope { .. } | Op::CacheWrite);
            // Ring attention's zig-zag cuts the sequence into 2·cp chunks.
            let unit = if ring { 2 * cp } else { cp };
            if !heads && !l.sizes[lab].is_multiple_of(unit) {
                let chunks = if ring {
                    format!(" (ring attention's {unit} zig-zag chunks)")
                } else {
                    String::new()
                };
                return Err(format!(
                    "cp{cp} splits the sequence of {} ({}) of length {}{chunks}, which {unit} \
                     does not divide: use a sequence that is a multiple of {unit}, or a cp \
                     dividing {}",
                    g.scope_name(n.scope),
                    n.op.name(),
                    l.sizes[lab],
                    l.sizes[lab]
                ));
            }
        }
        pins[i] = pin;
    }
    Ok(pins)
}

/// The heads label of an attention-like labeling (q's dim 2).
fn heads_label(l: &Labeling) -> Result<usize, String> {
    l.inputs
        .first()
        .and_then(|q| q.get(2).copied().flatten())
        .ok_or_else(|| "an attention without a heads label".to_string())
}

fn kv_heads_message(g: &Graph, i: usize, heads: usize, kv: usize, cp: usize, tp: usize) -> String {
    let n = &g.nodes[i];
    let per_tp = if kv.is_multiple_of(tp) { kv / tp } else { 0 };
    let fits: Vec<String> =
        (2..=per_tp).filter(|c| per_tp.is_multiple_of(*c)).map(|c| format!("cp{c}")).collect();
    let fix = if fits.is_empty() {
        "drop cpN (no context parallelism) or lower tp".to_string()
    } else {
        format!("use {} (dividing {kv} KV heads / tp{tp})", fits.join(" or "))
    };
    format!(
        "cp{cp} × tp{tp} = {} splits {} ({})'s heads, but the model has {heads} query and {kv} \
         KV heads, which {} does not divide: the all-to-all variant gives each device whole \
         heads; {fix}",
        cp * tp,
        g.scope_name(n.scope),
        n.op.name(),
        cp * tp
    )
}

/// Puts the tensor axis before the cp axis wherever a strategy splits one dim over both
/// (attention's and RoPE's heads): each tensor rank keeps its heads, and the all-to-all splits
/// them further over cp within it. A sequence split over both (`sp`) stays cp-major.
pub fn order_heads(s: &mut Strategy, n: &tessera_ir::Node, cp_axis: usize, tp_axis: usize) {
    if !matches!(n.op, Op::Attention(_) | Op::Rope { .. } | Op::CacheWrite) {
        return;
    }
    let fix = |spec: &mut Spec| {
        for d in &mut spec.dims {
            if d[..] == [cp_axis, tp_axis] {
                *d = vec![tp_axis, cp_axis];
            }
        }
    };
    s.inputs.iter_mut().for_each(fix);
    s.outputs.iter_mut().for_each(fix);
}

/// Ring attention's layouts of attention and RoPE (`cp=ring`): each strategy `all` holds (none
/// splits over the cp axis `a`) with the sequence split over `a` — q, k, v, the output, its
/// log-sum-exp, RoPE's input, positions and output — and the work split over it. The
/// lowering ([`crate::lower`]'s ring pass) turns such an attention into the ring's block
/// attentions, transfers and merge, and such a RoPE into one at the global positions.
pub fn ring_strategies(all: &mut [Strategy], n: &tessera_ir::Node, a: usize) {
    let split = |spec: &mut Spec, dim: usize| {
        if let Some(d) = spec.dims.get_mut(dim) {
            d.insert(0, a);
        }
    };
    for s in all.iter_mut() {
        match &n.op {
            Op::Attention(_) if n.inputs.len() == 3 => {
                s.inputs.iter_mut().for_each(|x| split(x, 1));
                split(&mut s.outputs[0], 1);
                if let Some(lse) = s.outputs.get_mut(1) {
                    split(lse, 2);
                }
            }
            Op::Rope { .. } => {
                s.inputs.iter_mut().for_each(|x| split(x, 1));
                split(&mut s.outputs[0], 1);
            }
            _ => continue,
        }
        if !s.compute_axes.contains(&a) {
            s.compute_axes.push(a);
            s.compute_axes.sort_unstable();
        }
    }
}

/// The context-parallel degree a plan's layout shows: the product of the mesh axes named `cp`
/// that split the sequence (dim 1) of the matmuls' activations. Only meshes with an axis
/// named `cp` (a config's) have one: a per-op layout that splits a sequence is described as it
/// was before context parallelism existed.
pub fn describe_cp(
    g: &Graph,
    strategies: &[Option<Strategy>],
    mesh: &Mesh,
    dp_axes: &[usize],
) -> usize {
    let Some(axis) = mesh.axis(AxisName::Context) else { return 1 };
    if dp_axes.contains(&axis) || mesh.shape[axis] < 2 {
        return 1;
    }
    let splits = g.nodes.iter().enumerate().any(|(i, n)| {
        matches!(n.op, Op::MatMul { .. })
            && g.meta(n.inputs[0]).shape.rank() >= 3
            && strategies[i]
                .as_ref()
                .is_some_and(|s| s.inputs[0].dims.get(1).is_some_and(|d| d.contains(&axis)))
    });
    if splits {
        mesh.shape[axis]
    } else {
        1
    }
}

/// `--explain`'s lines about context parallelism: which tensors the cp axis splits by their
/// sequence and by heads, and the traffic around attention, per step and device — `calls`
/// and `bytes` are the plan's all-to-alls over the cp axis, or under ring attention its sends
/// (K/V blocks forward, their gradients backward). Empty when cp is 1.
pub fn explain_lines(cp: usize, seq: usize, comm: CpComm, calls: usize, bytes: u64) -> Vec<String> {
    if cp < 2 {
        return Vec::new();
    }
    let split = format!(
        "  every activation's sequence of {seq} splits into {cp} chunks of {} tokens (embedding, \
         norms,",
        seq / cp
    );
    let per_device = format!(
        "  {} per device; weight gradients reduce over dp x cp",
        crate::units::format_bytes(bytes)
    );
    match comm {
        CpComm::A2a => vec![
            format!("context parallel: cp{cp}, all-to-all (DeepSpeed-Ulysses)"),
            split,
            "  projections, MLP, loss); q, k, v and attention's output split by heads instead"
                .to_string(),
            format!(
                "  {calls} all-to-alls per step around attention (sequence <-> heads, forward \
                 and backward),"
            ),
            per_device,
        ],
        CpComm::Ring => vec![
            format!("context parallel: cp{cp}, ring attention (zig-zag chunks)"),
            split,
            format!(
                "  projections, attention, MLP, loss); device c holds chunks c and {} - c of {}",
                2 * cp - 1,
                2 * cp
            ),
            format!(
                "  {calls} K/V blocks sent per step around the ring ({} ring step{} per \
                 attention; K/V again with dK/dV in the backward),",
                cp - 1,
                if cp > 2 { "s" } else { "" }
            ),
            per_device,
        ],
    }
}

/// Megatron-LM's flags for the axis: `--context-parallel-size N --cp-comm-type a2a` (or
/// `p2p`, its ring attention).
pub fn megatron_args(cp: usize, comm: Option<CpComm>) -> Vec<String> {
    if cp < 2 {
        return Vec::new();
    }
    vec![
        format!("--context-parallel-size {cp}"),
        format!("--cp-comm-type {}", megatron_comm(comm.unwrap_or_default())),
    ]
}

/// Why an engine cannot run a context-parallel plan (`None`: it can, or cp is 1): torchtitan
/// runs ring attention only, DeepSpeed neither variant from its config.
pub fn refuse_export(engine: &str, cp: usize, comm: Option<CpComm>) -> Option<String> {
    if cp < 2 {
        return None;
    }
    let comm = comm.unwrap_or_default();
    let megatron = format!(
        "export to Megatron-LM (--context-parallel-size {cp} --cp-comm-type {})",
        megatron_comm(comm)
    );
    match (engine, comm) {
        ("torchtitan", CpComm::Ring) => None,
        ("torchtitan", CpComm::A2a) => Some(format!(
            "torchtitan cannot run cp{cp} cp=a2a: its context_parallel_degree is ring attention \
             only (no all-to-all variant); use cp{cp} cp=ring, {megatron}, or drop cpN"
        )),
        ("deepspeed", CpComm::A2a) => Some(format!(
            "DeepSpeed cannot say cp{cp} in its config: Ulysses sequence parallelism lives in \
             the model code (deepspeed.sequence.layer.DistributedAttention), not in \
             ds_config.json; {megatron}, or drop cpN"
        )),
        ("deepspeed", CpComm::Ring) => Some(format!(
            "DeepSpeed cannot say cp{cp} cp=ring: it has no ring attention; {megatron}, or \
             drop cpN"
        )),
        _ => None,
    }
}

/// The context-parallel axis in the registry ([`super::AXES`]): every method is one of the
/// functions above.
pub struct ContextAxis;

impl Axis for ContextAxis {
    fn name(&self) -> &'static str {
        "cp"
    }

    fn parse_token(&self, t: Token<'_>, cfg: &mut ParallelConfig) -> Parsed {
        parse_token(t.raw, t.lower, &mut cfg.cp, &mut cfg.cp_comm)
    }

    fn canonical(&self, cfg: &ParallelConfig) -> Vec<(Slot, String)> {
        let s = canonical(cfg.cp, cfg.cp_comm);
        let s = s.trim();
        (!s.is_empty()).then(|| (30, s.to_string())).into_iter().collect()
    }

    fn validate(&self, cfg: &ParallelConfig) -> Result<(), ConfigError> {
        // Activation offload alone composes (a rewrite of the checkpointed Program); model
        // state offload's chunks are laid out on a `[dp, tp]` mesh.
        let state_offload = cfg.offload.is_some_and(|o| o.moves_state());
        validate(cfg.cp, cfg.cp_comm, cfg.shard.is_some(), state_offload, cfg.pp)
    }

    /// Between the data axes and the tensor axis (see [`mesh_shape`]).
    fn mesh_axes(&self, cfg: &ParallelConfig) -> Vec<(Slot, AxisName, usize)> {
        if cfg.cp > 1 {
            vec![(30, AxisName::Context, cfg.cp)]
        } else {
            Vec::new()
        }
    }

    fn grid(&self, cx: &GridContext) -> Vec<ParallelConfig> {
        grid(cx.devices, cx.gpus_per_node, cx.seq)
            .into_iter()
            .map(|(dp, cp, tp)| ParallelConfig::new(dp, tp).with_cp(cp))
            .collect()
    }

    fn pinned_axis(&self) -> Option<AxisName> {
        Some(AxisName::Context)
    }

    fn pins(&self, cx: &mut PinContext<'_>) -> Result<Vec<Option<usize>>, String> {
        let tp = cx.mesh.axis(AxisName::Tensor).map_or(1, |a| cx.mesh.shape[a]);
        cp_pins(cx.graph, cx.labels, cx.seq_roles, cx.mesh.shape[cx.axis], tp, cx.mesh.ring)
    }

    fn pin_miss(&self) -> &'static str {
        "the context-parallel axis"
    }

    fn order_strategy(&self, s: &mut Strategy, node: &tessera_ir::Node, mesh: &Mesh, axis: usize) {
        if let Some(tp_axis) = mesh.axis(AxisName::Tensor) {
            order_heads(s, node, axis, tp_axis);
        }
    }

    /// Under ring attention, attention's and RoPE's sequence splits over the axis too.
    fn adjust_strategies(
        &self,
        all: &mut [Strategy],
        node: &tessera_ir::Node,
        mesh: &Mesh,
        axis: usize,
    ) {
        if mesh.ring {
            ring_strategies(all, node, axis);
        }
    }

    fn explain_lines(&self, cx: &ExplainContext<'_>) -> Vec<String> {
        let Some(axis) = cx.axis(AxisName::Context) else { return Vec::new() };
        // The ring's traffic is its block sends; the all-to-all variant's its all-to-alls.
        let ours = |c: &&super::Traffic<'_>| {
            let op: String =
                c.op.to_ascii_lowercase().chars().filter(char::is_ascii_alphabetic).collect();
            c.axis == axis && if cx.ring { op == "send" } else { op.contains("alltoall") }
        };
        let comm = if cx.ring { CpComm::Ring } else { CpComm::A2a };
        let (calls, bytes) =
            cx.traffic.iter().filter(ours).fold((0, 0), |(n, b), c| (n + 1, b + c.bytes));
        explain_lines(cx.shape[axis], cx.seq, comm, calls, bytes)
    }

    fn export(&self, engine: Engine, cfg: &ParallelConfig) -> ExportFields {
        let name = match engine {
            Engine::Megatron => {
                let args = megatron_args(cfg.cp, cfg.cp_comm);
                return ExportFields::Args(args.into_iter().map(|a| (20, a)).collect());
            }
            Engine::DeepSpeed => "deepspeed",
            Engine::Torchtitan => "torchtitan",
        };
        match refuse_export(name, cfg.cp, cfg.cp_comm) {
            // The nearest: the context-parallel devices as data-parallel replicas.
            Some(why) => ExportFields::Refused {
                why,
                nearest: cfg.clone().with_dp(cfg.dp * cfg.cp).with_cp(1).with_cp_comm(None),
            },
            None => ExportFields::Args(Vec::new()),
        }
    }
}

/// Megatron-LM's `--cp-comm-type` for a variant: `a2a`, or `p2p` for the ring.
fn megatron_comm(comm: CpComm) -> &'static str {
    match comm {
        CpComm::A2a => "a2a",
        CpComm::Ring => "p2p",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_search_grid_tries_cp_for_long_sequences_only() {
        assert!(grid(8, 8, GRID_MIN_SEQ - 1).is_empty(), "short sequences keep the old grid");
        let g = grid(8, 8, 65536);
        assert!(g.iter().all(|&(dp, cp, tp)| dp * cp * tp == 8 && cp > 1), "{g:?}");
        for want in [(4, 2, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)] {
            assert!(g.contains(&want), "{want:?} missing from {g:?}");
        }
        assert!(g.iter().all(|&(_, _, tp)| tp <= 4), "tp8 leaves no device for cp: {g:?}");
        // cp divides the sequence.
        assert!(grid(8, 8, 3 * 4096).iter().all(|&(_, cp, _)| (3 * 4096) % cp == 0));
        assert_eq!(grid(4, 4, 10_002), vec![(2, 2, 1), (1, 2, 2)]);
    }

    #[test]
    fn ring_parses_and_a2a_is_the_default() {
        let (mut n, mut comm) = (1, None);
        assert_eq!(parse_token("cp=ring", "cp=ring", &mut n, &mut comm), Some(Ok("cp=")));
        assert_eq!(comm, Some(CpComm::Ring));
        assert_eq!(parse_token("cp4", "cp4", &mut n, &mut comm), Some(Ok("cp")));
        assert_eq!(n, 4);
        assert!(parse_token("cpu", "cpu", &mut n, &mut comm).is_none());
        assert_eq!(canonical(4, None), " cp4 cp=a2a");
        assert_eq!(canonical(4, Some(CpComm::Ring)), " cp4 cp=ring");
        assert_eq!(canonical(1, None), "");
        let e = validate(2, Some(CpComm::Ring), false, false, 2).unwrap_err().to_string();
        assert!(e.contains("pipeline") && e.contains("cp=a2a"), "{e}");
        assert_eq!(megatron_args(2, Some(CpComm::Ring))[1], "--cp-comm-type p2p");
        assert!(refuse_export("torchtitan", 2, Some(CpComm::Ring)).is_none());
        assert!(refuse_export("torchtitan", 2, None).is_some_and(|e| e.contains("cp=ring")));
    }
}
