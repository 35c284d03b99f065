//! The chunked loss: a causal LM's head and its cross-entropy fused into one op computed in
//! row chunks ([`Op::LinearCrossEntropy`]), so the `[rows, V]` logits — ~100 GB for one
//! 128K-token sequence over Llama 3's 128,256-token vocabulary — never exist beyond one chunk.
//!
//! The rewrite ([`fuse`]) runs on the forward graph before anything else sees it: the
//! sharding search, the lowering, autodiff and the Program all see the fused op, so the
//! chunk's logits are its declared workspace and the profiler's and the accountant's charge
//! alike. It fuses a head matmul `x [.., D] · W [V, D]ᵀ` whose logits feed only a summed,
//! whole-vocabulary `CrossEntropy` (`nn::mean_over_targets`, every token family's loss);
//! anything else reading the logits leaves the pair as it is.
//!
//! The choice ([`choose`]): a config string pins it (`loss=whole`, `loss=chunkN`), a plan
//! file carries it (`loss_chunk_rows`), and otherwise the planner chunks where one device's
//! share of the logits — the whole step's logits over the devices — is at least
//! [`LOGITS_SHARE`] of the memory budget, with chunks of the largest power of two rows whose
//! f32 logits take at most [`CHUNK_SHARE`] of it. Below that the logits barely move the peak
//! and the recomputation (a third more head FLOPs) would only cost time, so plans of short
//! sequences stay exactly as they were.
//!
//! Sharding: the fused op splits its rows only (`rules.rs`), its weight whole. Where the
//! tensor axis would split the vocabulary (Megatron-LM's vocabulary-parallel loss,
//! `lower/loss.rs`) the fused op instead runs its rows on every tensor-parallel device (or,
//! with `sp`, each device its share of the sequence), the head's weight gathered whole.

use crate::config::LossMode;
use crate::search::Forward;
use crate::{PlanError, Result};
use tessera_ir::{Builder, Graph, Op, ScopeId, TensorId};

/// The planner chunks where one device's share of the logits is at least this share of the
/// budget. A quarter keeps every `scripts/bench-plan.sh` row whole (the nearest, llama3-8b on
/// `8xH100` at 32 × 4096 under 30 GiB, has 4.2 GB of logits per device, 13% of its budget):
/// below it the recomputation's time is not weighed against the memory by the search.
pub const LOGITS_SHARE: f64 = 1.0 / 4.0;
/// A chunk's f32 logits take at most this share of the budget.
pub const CHUNK_SHARE: f64 = 1.0 / 32.0;

/// The head and loss the rewrite fuses: the matmul node, the loss node, and the logits'
/// metadata.
#[derive(Clone, Copy, Debug)]
pub struct Site {
    pub matmul: usize,
    pub loss: usize,
    /// Rows (tokens) of the loss: the targets' element count.
    pub rows: u64,
    /// Classes (the vocabulary).
    pub classes: u64,
    /// The whole logits' bytes.
    pub logits_bytes: u64,
}

/// The fusable head-and-loss pairs of `g` (a causal LM has one).
pub fn sites(g: &Graph) -> Vec<Site> {
    let readers = readers(g);
    let mut out = Vec::new();
    for (i, n) in g.nodes.iter().enumerate() {
        let Op::CrossEntropy { sum: true, classes: None, .. } = &n.op else { continue };
        if n.inputs.len() != 2 {
            continue;
        }
        let logits = n.inputs[0];
        let m = g.tensor(logits).producer.index();
        let mm = &g.nodes[m];
        let head = matches!(mm.op, Op::MatMul { trans_a: false, trans_b: true })
            && g.meta(mm.inputs[1]).shape.rank() == 2
            && g.meta(mm.inputs[0]).shape.rank() >= 2;
        if !head || readers[logits.index()] != 1 {
            continue;
        }
        let meta = g.meta(logits);
        out.push(Site {
            matmul: m,
            loss: i,
            rows: g.meta(n.inputs[1]).numel(),
            classes: meta.shape.dims().last().copied().unwrap_or(0) as u64,
            logits_bytes: meta.size_bytes(),
        });
    }
    out
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

/// `fwd` with every fusable head and loss replaced by [`Op::LinearCrossEntropy`] of
/// `chunk_rows` rows per chunk (the same outputs: the loss and each row's log-sum-exp).
/// A graph without such a pair comes back unchanged.
pub fn fuse(fwd: &Forward, chunk_rows: usize) -> Result<Forward> {
    let g = &fwd.graph;
    let found = sites(g);
    if found.is_empty() {
        return Ok(Forward { graph: g.clone(), loss: fwd.loss });
    }
    let internal = |e: tessera_ir::IrError| PlanError::Internal(format!("fusing the loss: {e}"));
    let mut b = Builder::from_graph(Graph::with_capacity(g.nodes.len(), g.tensors.len()));
    for s in 1..g.num_scopes() {
        b.graph.intern_scope(g.scope_name(ScopeId(s as u32)));
    }
    let mut map: Vec<Option<TensorId>> = vec![None; g.tensors.len()];
    let mapped = |map: &[Option<TensorId>], t: TensorId| {
        map[t.index()].ok_or_else(|| PlanError::Internal("fusing the loss: order".into()))
    };
    for (i, node) in g.nodes.iter().enumerate() {
        if found.iter().any(|s| s.matmul == i) {
            continue; // its only reader, the loss, becomes the fused op
        }
        b.set_scope_id(node.scope);
        b.set_block(node.block);
        b.set_phase(node.phase);
        let outs = match (&node.op, found.iter().find(|s| s.loss == i)) {
            (Op::CrossEntropy { ignore_index, .. }, Some(site)) => {
                let head = &g.nodes[site.matmul];
                let ins = [
                    mapped(&map, head.inputs[0])?,
                    mapped(&map, head.inputs[1])?,
                    mapped(&map, node.inputs[1])?,
                ];
                // The head's scope: the fused op is the LM head with its loss.
                b.set_scope_id(head.scope);
                let op = Op::LinearCrossEntropy { chunk_rows, ignore_index: *ignore_index };
                b.push(op, &ins).map_err(internal)?
            }
            _ => {
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

/// A forward graph per micro-batch size (the planner's `Request::build`).
pub type Build<'a> = &'a (dyn Fn(usize) -> Result<Forward> + Sync);

/// What the choice reads of a request: the model, the global batch, the devices and the
/// per-device budget.
#[derive(Clone, Copy)]
pub struct Problem<'a> {
    pub build: Build<'a>,
    pub batch: usize,
    pub devices: usize,
    pub budget: u64,
}

/// The planner's choice for an unpinned config: `Some(rows per chunk)` where the logits
/// matter for the peak (see the module docs), `None` to keep them whole.
pub fn choose(req: Problem<'_>) -> Result<Option<usize>> {
    let fwd = (req.build)(req.batch)?;
    let Some(site) = sites(&fwd.graph).into_iter().max_by_key(|s| s.logits_bytes) else {
        return Ok(None);
    };
    let devices = req.devices.max(1) as f64;
    let share = site.logits_bytes as f64 / devices;
    if share < LOGITS_SHARE * req.budget as f64 || site.rows < 2 {
        return Ok(None);
    }
    let fit = (CHUNK_SHARE * req.budget as f64 / (site.classes.max(1) * 4) as f64) as u64;
    let mut rows = 1u64;
    while rows * 2 <= fit.min(site.rows) {
        rows *= 2;
    }
    Ok(Some(rows as usize))
}

/// The rows per chunk a request runs with: the config's `loss=` when written, else
/// [`choose`]'s.
/// A `loss=chunkN` for a model with no head and loss to fuse (an encoder's classifier, a
/// masked-LM head with a bias) is refused by name rather than ignored.
pub fn resolve(req: Problem<'_>, pinned: Option<LossMode>) -> Result<Option<usize>> {
    match pinned {
        Some(LossMode::Chunk(rows)) => {
            if sites(&(req.build)(req.batch)?.graph).is_empty() {
                return Err(PlanError::Invalid(format!(
                    "loss=chunk{rows} fuses a causal LM's head (a matmul against a [vocab, \
                     hidden] weight) with the summed cross-entropy over its logits, and this \
                     model has no such pair: drop loss="
                )));
            }
            Ok(Some(rows))
        }
        Some(LossMode::Whole) => Ok(None),
        None => choose(req),
    }
}

/// The forward graph of a plan: `build`'s, fused at `chunk_rows` when given.
pub fn build_with(build: Build<'_>, chunk_rows: Option<usize>, mb: usize) -> Result<Forward> {
    let fwd = build(mb)?;
    match chunk_rows {
        Some(rows) => fuse(&fwd, rows),
        None => Ok(fwd),
    }
}
