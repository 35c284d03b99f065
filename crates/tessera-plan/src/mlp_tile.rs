//! The tiled MLP: each transformer block's MLP fused into one op computed in row tiles
//! ([`Op::TiledMlp`], ALST's sequence tiling), so its `[rows, ffn]` intermediates — gate, up,
//! the activation and their product, 3.5× the hidden size each in Llama — never exist beyond
//! one tile, in the forward or in the backward (where a checkpointed block's recomputation
//! would otherwise hold them all at once).
//!
//! The rewrite ([`fuse`]) runs on the forward graph before anything else sees it, as the
//! chunked loss's does ([`crate::loss_chunk`]): the sharding search, the lowering, autodiff
//! and the Program all see the fused op, whose tile of intermediates is its declared
//! workspace, so the profiler's and the accountant's charges stay one. It fuses:
//! - SwiGLU (Llama): `down(act(gate(x)) ⊙ up(x))`, three bias-free `nn.Linear` matmuls
//!   (`trans_b`, 2-D weights) — a model with `mlp_bias` keeps its MLPs whole;
//! - GPT-2's MLP: `c_proj(act(c_fc(x) + b_fc))`, `Conv1D` matmuls; `c_proj`'s bias add stays
//!   after the op, as after the unfused matmul.
//!
//! Every intermediate must have no other reader; anything else leaves the ops as they are.
//!
//! The choice ([`choose`]): a config string pins it (`mlp=whole`, `mlp=tileN`), a plan file
//! carries it (`mlp_tile_rows`), and otherwise the planner tiles where one sequence's
//! `[seq, ffn]` intermediate, split as far as one node's devices split it (tensor or context
//! parallelism within a node), is at least [`FFN_SHARE`] of the memory budget, with tiles of
//! the largest power of two rows whose whole-ffn intermediate takes at most [`TILE_SHARE`] of
//! it (and never one under [`FFN_FLOOR_BYTES`]). One sequence, not the step's batch: the search's micro-batches and data parallelism
//! shrink a batch's share at will, but nothing short of cross-node context parallelism splits
//! one sequence further. Below the threshold the intermediates barely move the peak and the
//! recomputation (one more MLP forward per step) would only cost time.
//!
//! Sharding (`rules.rs`): the fused op splits its rows (data, sequence, context parallelism)
//! or its ffn features — the column-parallel up projections and the row-parallel down
//! projection of Megatron's tensor parallelism, the output a pending sum — never the hidden
//! features.

use crate::config::MlpMode;
use crate::loss_chunk::Build;
use crate::search::Forward;
use crate::{PlanError, Result};
use tessera_ir::ops::{BinaryOp, MlpSpec};
use tessera_ir::{Builder, Graph, Op, ScopeId, TensorId};

/// The planner tiles where one sequence's `[seq, ffn]` intermediate over a node's devices is at
/// least this share of the budget. 1/64 keeps every `scripts/bench-plan.sh` row (at most
/// 4096 tokens: 15 MB for llama3-8b over 8 H100s) and every published run
/// (`scripts/published-runs*.tsv`, up to llama3-8b's 256K tokens over 8 H100s: 0.94 GB, 1.1%
/// of an H100's budget) whole, and tiles llama3-8b from 512K tokens over 8 H100s (1.9 GB,
/// 2.2%) or 64K on one, whose backward would hold four to six such intermediates at once.
pub const FFN_SHARE: f64 = 1.0 / 64.0;
/// Nor does it tile an intermediate under this many bytes (per device), whatever the budget:
/// one that small never sets a training peak worth a recomputation, and a choice that
/// flipped with the budget would make the least memory a search reports (planned again under
/// that figure as its budget) inexact for small models.
pub const FFN_FLOOR_BYTES: f64 = (64u64 << 20) as f64;
/// A tile's `[rows, ffn]` intermediate takes at most this share of the budget.
pub const TILE_SHARE: f64 = 1.0 / 256.0;

/// An MLP the rewrite fuses: its nodes (the last the down projection, whose output the fused
/// op's replaces), the spec, and its input and weights.
#[derive(Clone, Debug)]
pub struct Site {
    /// Every node the fused op replaces, in graph order; the last is the down projection.
    pub nodes: Vec<usize>,
    pub spec: MlpSpec,
    /// `[x, weights..]` as [`Op::TiledMlp`] takes them.
    pub inputs: Vec<TensorId>,
    /// Rows (tokens) and ffn features.
    pub rows: u64,
    pub ffn: u64,
    /// One whole `[rows, ffn]` intermediate's bytes.
    pub intermediate_bytes: u64,
}

/// How many nodes read each tensor (a node reading it twice counts twice).
fn readers(g: &Graph) -> Vec<u32> {
    let mut r = vec![0u32; g.tensors.len()];
    for n in &g.nodes {
        for &t in &n.inputs {
            r[t.index()] += 1;
        }
    }
    r
}

/// The node producing `t` when it is `op`-like (`pred`) and `t` has a single reader.
fn sole<'g>(
    g: &'g Graph,
    readers: &[u32],
    t: TensorId,
    pred: impl Fn(&Op) -> bool,
) -> Option<(usize, &'g tessera_ir::Node)> {
    let p = g.tensor(t).producer.index();
    let n = &g.nodes[p];
    (readers[t.index()] == 1 && pred(&n.op)).then_some((p, n))
}

fn is_2d(g: &Graph, t: TensorId) -> bool {
    g.meta(t).shape.rank() == 2
}

/// The site whose down projection is node `i`, if the MLP above it has a fusable shape.
fn site_at(g: &Graph, readers: &[u32], i: usize) -> Option<Site> {
    let down = &g.nodes[i];
    let Op::MatMul { trans_a: false, trans_b } = down.op else { return None };
    if !is_2d(g, down.inputs[1]) || g.meta(down.inputs[0]).shape.rank() < 2 {
        return None;
    }
    let conv1d = !trans_b;
    let proj = |op: &Op| *op == Op::MatMul { trans_a: false, trans_b };
    let unary = |op: &Op| matches!(op, Op::Unary(_));
    let (mut nodes, spec, inputs) = if conv1d {
        // GPT-2: c_proj(act(c_fc(x) + b_fc)).
        let (ia, act) = sole(g, readers, down.inputs[0], unary)?;
        let Op::Unary(u) = act.op else { return None };
        let (ib, add) = sole(g, readers, act.inputs[0], |op| *op == Op::Binary(BinaryOp::Add))?;
        let (ifc, fc) = sole(g, readers, add.inputs[0], proj)?;
        let bias = add.inputs[1];
        if !is_2d(g, fc.inputs[1]) || g.meta(bias).shape.rank() != 1 {
            return None;
        }
        let spec = MlpSpec { act: u, gated: false, conv1d, bias: true, chunk_rows: 1 };
        (vec![ifc, ib, ia], spec, vec![fc.inputs[0], fc.inputs[1], bias, down.inputs[1]])
    } else {
        // SwiGLU: down(act(gate(x)) ⊙ up(x)).
        let (im, mul) = sole(g, readers, down.inputs[0], |op| *op == Op::Binary(BinaryOp::Mul))?;
        let (ia, act, iu, up) =
            match (sole(g, readers, mul.inputs[0], unary), sole(g, readers, mul.inputs[1], proj)) {
                (Some((ia, act)), Some((iu, up))) => (ia, act, iu, up),
                _ => {
                    let (ia, act) = sole(g, readers, mul.inputs[1], unary)?;
                    let (iu, up) = sole(g, readers, mul.inputs[0], proj)?;
                    (ia, act, iu, up)
                }
            };
        let Op::Unary(u) = act.op else { return None };
        let (ig, gate) = sole(g, readers, act.inputs[0], proj)?;
        if gate.inputs[0] != up.inputs[0] || !is_2d(g, gate.inputs[1]) || !is_2d(g, up.inputs[1]) {
            return None;
        }
        let spec = MlpSpec { act: u, gated: true, conv1d, bias: false, chunk_rows: 1 };
        let inputs = vec![gate.inputs[0], gate.inputs[1], up.inputs[1], down.inputs[1]];
        (vec![ig, ia, iu, im], spec, inputs)
    };
    nodes.push(i);
    nodes.sort_unstable();
    let metas: Vec<_> = inputs.iter().map(|&t| g.meta(t)).collect();
    // The op's own checks: shapes and dtypes that fit (a cast between the ops, say, does not).
    Op::TiledMlp(spec).infer(&metas).ok()?;
    let x = g.meta(inputs[0]);
    let d = x.shape.dims().last().copied().unwrap_or(1).max(1) as u64;
    let ffn = g.meta(inputs[1]).shape.dims()[spec.ffn_dim_of_up()] as u64;
    let rows = x.numel() / d;
    let intermediate_bytes = rows * ffn * x.dtype.size_bytes();
    Some(Site { nodes, spec, inputs, rows, ffn, intermediate_bytes })
}

/// The fusable MLPs of `g` (a transformer has one per block).
pub fn sites(g: &Graph) -> Vec<Site> {
    let readers = readers(g);
    (0..g.nodes.len()).filter_map(|i| site_at(g, &readers, i)).collect()
}

/// `fwd` with every fusable MLP replaced by [`Op::TiledMlp`] of `tile_rows` rows per tile
/// (the same output: the down projection's). A graph without one comes back unchanged.
pub fn fuse(fwd: &Forward, tile_rows: usize) -> Result<Forward> {
    let g = &fwd.graph;
    let found = sites(g);
    if found.is_empty() {
        return Ok(Forward { graph: g.clone(), loss: fwd.loss });
    }
    let internal = |e: tessera_ir::IrError| PlanError::Internal(format!("tiling the MLP: {e}"));
    // Per node: the site it belongs to (the fused op is pushed at the site's last node).
    let mut site_of: Vec<Option<usize>> = vec![None; g.nodes.len()];
    for (k, s) in found.iter().enumerate() {
        for &n in &s.nodes {
            site_of[n] = Some(k);
        }
    }
    let mut b = Builder::from_graph(Graph::with_capacity(g.nodes.len(), g.tensors.len()));
    for s in 1..g.num_scopes() {
        b.graph.intern_scope(g.scope_name(ScopeId(s as u32)));
    }
    let mut map: Vec<Option<TensorId>> = vec![None; g.tensors.len()];
    let mapped = |map: &[Option<TensorId>], t: TensorId| {
        map[t.index()].ok_or_else(|| PlanError::Internal("tiling the MLP: order".into()))
    };
    for (i, node) in g.nodes.iter().enumerate() {
        b.set_block(node.block);
        b.set_phase(node.phase);
        let outs = match site_of[i].map(|k| &found[k]) {
            Some(site) if site.nodes.last() == Some(&i) => {
                let ins =
                    site.inputs.iter().map(|&t| mapped(&map, t)).collect::<Result<Vec<_>>>()?;
                // The MLP's scope: the activation's (inside `mlp`, outside its projections).
                let act = site.nodes.iter().find(|&&n| matches!(g.nodes[n].op, Op::Unary(_)));
                b.set_scope_id(g.nodes[*act.unwrap_or(&i)].scope);
                let spec = MlpSpec { chunk_rows: tile_rows, ..site.spec };
                b.push(Op::TiledMlp(spec), &ins).map_err(internal)?
            }
            Some(_) => continue, // an intermediate only the site reads
            None => {
                b.set_scope_id(node.scope);
                let ins =
                    node.inputs.iter().map(|&t| mapped(&map, t)).collect::<Result<Vec<_>>>()?;
                b.push_like(g, node, node.op.clone(), &ins).map_err(internal)?
            }
        };
        for (&o, n) in node.outputs.iter().zip(outs) {
            map[o.index()] = Some(n);
        }
    }
    let loss = mapped(&map, fwd.loss)?;
    Ok(Forward { graph: b.finish(), loss })
}

/// What the choice reads of a request: the model, the devices of a node (or of the cluster,
/// when fewer) and the per-device budget.
#[derive(Clone, Copy)]
pub struct Problem<'a> {
    pub build: Build<'a>,
    pub node_devices: usize,
    pub budget: u64,
    /// The runtime has the fused op's kernel ([`crate::search::SearchKnobs::tiled_mlp`]);
    /// without it the choice keeps MLPs whole and a written `mlp=tileN` is refused.
    pub runnable: bool,
}

/// The planner's choice for an unpinned config: `Some(rows per tile)` where the MLP's
/// intermediates matter for the peak (see the module docs), `None` to keep them whole.
pub fn choose(req: Problem<'_>) -> Result<Option<usize>> {
    if !req.runnable {
        return Ok(None);
    }
    // One sequence: a micro-batch of one.
    let fwd = (req.build)(1)?;
    let Some(site) = sites(&fwd.graph).into_iter().max_by_key(|s| s.intermediate_bytes) else {
        return Ok(None);
    };
    let share = site.intermediate_bytes as f64 / req.node_devices.max(1) as f64;
    if share < FFN_SHARE * req.budget as f64 || share < FFN_FLOOR_BYTES || site.rows < 2 {
        return Ok(None);
    }
    let elem = (site.intermediate_bytes / (site.rows * site.ffn).max(1)).max(1);
    let fit = (TILE_SHARE * req.budget as f64 / (site.ffn.max(1) * elem) as f64) as u64;
    let mut rows = 1u64;
    while rows * 2 <= fit.min(site.rows) {
        rows *= 2;
    }
    Ok(Some(rows as usize))
}

/// The rows per tile a request runs with: the config's `mlp=` when written, else
/// [`choose`]'s. An `mlp=tileN` for a model with no MLP to fuse (a vision model, a Llama with
/// `mlp_bias`) is refused by name rather than ignored.
pub fn resolve(req: Problem<'_>, pinned: Option<MlpMode>) -> Result<Option<usize>> {
    match pinned {
        Some(MlpMode::Tile(rows)) => {
            if !req.runnable {
                return Err(PlanError::Invalid(format!(
                    "mlp=tile{rows}: the tiled MLP runs on the CPU backend only so far (no CUDA \
                     kernel yet): write mlp=whole, or drop mlp= and the planner keeps MLPs whole"
                )));
            }
            if sites(&(req.build)(1)?.graph).is_empty() {
                return Err(PlanError::Invalid(format!(
                    "mlp=tile{rows} fuses a transformer block's MLP (SwiGLU without biases, or \
                     GPT-2's GELU MLP) into one op, and this model has no such MLP: drop mlp="
                )));
            }
            Ok(Some(rows))
        }
        Some(MlpMode::Whole) => Ok(None),
        None => choose(req),
    }
}

/// The forward graph of a plan: `build`'s, its MLPs tiled at `tile_rows` when given.
pub fn build_with(build: Build<'_>, tile_rows: Option<usize>, mb: usize) -> Result<Forward> {
    let fwd = build(mb)?;
    match tile_rows {
        Some(rows) => fuse(&fwd, rows),
        None => Ok(fwd),
    }
}
