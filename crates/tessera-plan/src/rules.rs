//! Sharding strategies per op, generated from one rule: describe the op by its iteration dims
//! ("labels", as in an einsum), say which labels may be split, then every assignment of mesh
//! axes to labels is a strategy. Nothing is a hand-written list:
//!
//! - matmul `[.., m, k] x [.., k, n]`: batch dims, m and n are parallel labels, k is a
//!   contraction — splitting it leaves the output a pending sum (Partial);
//! - elementwise ops: every output dim is a label (broadcast inputs stay replicated there), so
//!   norms, dropout and residual adds may split the sequence dim: with tensor parallelism that
//!   is Megatron's sequence parallelism;
//! - sum reductions contract; mean/max reductions, softmax and norms keep their reduced dim whole;
//! - embedding: ids' dims and the hidden dim (hidden-parallel), or the vocabulary (a
//!   contraction: vocabulary-parallel, the output a pending sum);
//! - attention: batch and heads (query and KV heads split together, so the split must divide
//!   the KV heads); sequence and head dim whole. Megatron's `tpN` past the KV heads uses
//!   [`attention_kv_whole_labeling`] instead: query heads split, k and v whole;
//! - cross-entropy: rows and classes split (the vocabulary-parallel loss, see `lower/loss.rs`);
//!   the loss becomes a pending sum; log-sum-exp: its rows; the chunked LM head and loss
//!   (`LinearCrossEntropy`): its rows only, the weight whole, the loss a pending sum.
//! - the tiled MLP (`TiledMlp`): its rows, or its ffn features (the up weights by columns,
//!   the down weight by rows: Megatron's column- and row-parallel MLP), the output then a
//!   pending sum; the hidden features whole.
//! - vision ops (NCHW): the batch N splits everywhere (data parallel, weights replicated);
//!   a convolution with `groups == 1` may also split its output channels (the weight by rows,
//!   dim 0: each device computes its own channels, like a column-parallel matmul) — with groups
//!   the channel blocks of x and w are coupled, so grouped convolutions split the batch only;
//!   pooling and upsampling are per channel, so they also split C; GroupNorm keeps C whole
//!   (its statistics span a group of channels). Spatial dims stay whole (windows overlap).
//! - mixture-of-experts routing: top-k, gathers and scatters split every dim but the last
//!   (per row; of routed tokens `[G.., n, ·]` the groups only); slots, dispatch and combine split their routing groups (the leading dims, a
//!   group's capacity never sees another group's tokens) and dispatch and combine the hidden
//!   dim; a group's tokens and the buffer's experts and capacity stay whole. The experts'
//!   batched matmuls split E as a batch label: the expert-parallel axis ([`crate::expert`]).
//!
//! Ops that only appear after autodiff (backward ops, the optimizer) get no strategies: the
//! lowering differentiates the sharded forward graph instead.

use crate::{Mesh, Spec};
use tessera_ir::{Op, ReduceOp, TensorMeta};

/// One way to run an op on the mesh.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Strategy {
    /// The spec each input must arrive in.
    pub inputs: Vec<Spec>,
    /// The spec each output leaves in.
    pub outputs: Vec<Spec>,
    /// Mesh axes the work is split over (on any other axis every device repeats it). An input
    /// replicated on such an axis gets a gradient that is a pending sum there.
    pub compute_axes: Vec<usize>,
    /// For each mesh axis, the label it splits (None: not used).
    pub axis_labels: Vec<Option<usize>>,
}

/// What a dim of a tensor means to the model, propagated from the token ids: used by fixed
/// configurations ("dp" splits the batch, "sp" the sequence).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DimRole {
    Batch,
    Seq,
    Other,
}

/// Roles of one node's labels from its inputs' dim roles (batch, sequence or other).
pub(crate) fn label_roles(
    n: &tessera_ir::Node,
    l: &Labeling,
    roles: &[Vec<DimRole>],
) -> Vec<DimRole> {
    let mut lab_role = vec![DimRole::Other; l.sizes.len()];
    for (k, &t) in n.inputs.iter().enumerate() {
        for (d, lab) in l.inputs[k].iter().enumerate() {
            if let Some(lab) = lab {
                if roles[t.index()][d] != DimRole::Other {
                    lab_role[*lab] = roles[t.index()][d];
                }
            }
        }
    }
    lab_role
}

/// An op as iteration dims.
#[derive(Clone, Debug, Default)]
pub struct Labeling {
    /// Size of each label (the divisibility bound for splitting it).
    pub sizes: Vec<usize>,
    pub shardable: Vec<bool>,
    /// Per input, per dim: its label, or None (kept whole: broadcast or not splittable).
    pub inputs: Vec<Vec<Option<usize>>>,
    pub outputs: Vec<Vec<Option<usize>>>,
    /// Per output: labels whose split makes this output a pending sum.
    pub partial_from: Vec<Vec<usize>>,
}

impl Labeling {
    fn label(&mut self, size: usize, shardable: bool) -> usize {
        self.sizes.push(size);
        self.shardable.push(shardable && size > 1);
        self.sizes.len() - 1
    }

    /// Every dim of `meta` gets its own label.
    fn fresh_dims(
        &mut self,
        meta: &TensorMeta,
        shardable: impl Fn(usize) -> bool,
    ) -> Vec<Option<usize>> {
        let dims = meta.shape.dims();
        (0..dims.len()).map(|d| Some(self.label(dims[d], shardable(d)))).collect()
    }
}

/// Attention split by its query heads alone, k and v whole (every KV head on every device):
/// tensor parallelism past the KV heads, where each device's heads read the KV heads of
/// their global index (`AttentionSpec::kv_whole`, set by the lowering). Only Megatron's
/// layout uses it, for a `tpN` with more devices than KV heads; the search splits query and
/// KV heads together ([`labeling`]).
pub fn attention_kv_whole_labeling(x: &[&TensorMeta]) -> Labeling {
    let mut l = Labeling::default();
    let q = x[0].shape.dims();
    let b = l.label(q[0], true);
    let h = l.label(q[2], true);
    let q_like = vec![Some(b), None, Some(h), None];
    let kv = vec![Some(b), None, None, None];
    l.inputs = vec![q_like.clone(), kv.clone(), kv];
    if x.len() == 4 {
        l.inputs.push(vec![Some(b)]);
    }
    l.outputs = vec![q_like, vec![Some(b), Some(h), None]];
    l.partial_from = vec![Vec::new(); 2];
    l
}

/// Labels of one op application, or an error for ops that have no forward sharding rule.
pub fn labeling(op: &Op, x: &[&TensorMeta], y: &[&TensorMeta]) -> Result<Labeling, String> {
    let mut l = Labeling::default();
    let rank = |m: &TensorMeta| m.shape.rank();
    let dims = |m: &TensorMeta| m.shape.dims().to_vec();
    match op {
        Op::Unary(_) | Op::Cast(_) => {
            let o = l.fresh_dims(y[0], |_| true);
            l.inputs = vec![o.clone()];
            l.outputs = vec![o];
        }
        Op::Dropout { .. } => {
            let o = l.fresh_dims(y[0], |_| true);
            l.inputs = vec![o.clone(), vec![None; rank(x[1])]];
            l.outputs = vec![o];
        }
        Op::Binary(_) => {
            let o = l.fresh_dims(y[0], |_| true);
            let od = dims(y[0]);
            for m in x {
                // Right-aligned broadcasting: a size-1 dim against a larger one stays whole.
                let r = rank(m);
                let off = od.len() - r;
                let md = dims(m);
                l.inputs.push(
                    (0..r).map(|d| if md[d] == od[off + d] { o[off + d] } else { None }).collect(),
                );
            }
            l.outputs = vec![o];
        }
        Op::MatMul { trans_a, trans_b } => {
            let (a, b) = (dims(x[0]), dims(x[1]));
            let out = dims(y[0]);
            let nb = out.len() - 2;
            let batch: Vec<usize> = (0..nb).map(|d| l.label(out[d], true)).collect();
            let m = l.label(out[nb], true);
            let n = l.label(out[nb + 1], true);
            let k_size = if *trans_a { a[a.len() - 2] } else { a[a.len() - 1] };
            let k = l.label(k_size, true);
            let operand = |d: &[usize], trans: bool, row: usize, col: usize| {
                let r = d.len();
                let off = nb + 2 - r;
                let mut v: Vec<Option<usize>> = (0..r - 2)
                    .map(|i| if d[i] == out[off + i] { Some(batch[off + i]) } else { None })
                    .collect();
                let (p, q) = if trans { (col, row) } else { (row, col) };
                v.push(Some(p));
                v.push(Some(q));
                v
            };
            l.inputs = vec![operand(&a, *trans_a, m, k), operand(&b, *trans_b, k, n)];
            let mut o: Vec<Option<usize>> = batch.iter().map(|&b| Some(b)).collect();
            o.push(Some(m));
            o.push(Some(n));
            l.outputs = vec![o];
            l.partial_from = vec![vec![k]];
        }
        Op::Reduce { op: rop, dims: rdims, keepdim } => {
            let contract = matches!(rop, ReduceOp::Sum | ReduceOp::SumSquares);
            let xi = l.fresh_dims(x[0], |d| !rdims.contains(&d) || contract);
            let mut o = Vec::new();
            for (d, lab) in xi.iter().enumerate() {
                if !rdims.contains(&d) {
                    o.push(*lab);
                } else if *keepdim {
                    o.push(None);
                }
            }
            l.partial_from = vec![rdims.iter().filter_map(|&d| xi[d]).collect()];
            l.inputs = vec![xi];
            l.outputs = vec![o];
        }
        Op::Softmax => {
            let r = rank(x[0]);
            let o = l.fresh_dims(x[0], |d| d + 1 < r);
            l.inputs = vec![o.clone()];
            l.outputs = vec![o];
        }
        Op::Reshape(_) => {
            let (xi, o) = reshape_labels(&mut l, &dims(x[0]), &dims(y[0]));
            l.inputs = vec![xi];
            l.outputs = vec![o];
        }
        Op::Permute(p) => {
            let xi = l.fresh_dims(x[0], |_| true);
            l.outputs = vec![p.iter().map(|&d| xi[d]).collect()];
            l.inputs = vec![xi];
        }
        Op::Slice { dim, .. } | Op::Pad { dim, .. } => {
            let xi = l.fresh_dims(x[0], |d| d != *dim);
            let mut o = xi.clone();
            o[*dim] = None;
            let mut xi = xi;
            xi[*dim] = None;
            l.inputs = vec![xi];
            l.outputs = vec![o];
        }
        Op::Concat { dim } => {
            let mut o = l.fresh_dims(y[0], |d| d != *dim);
            o[*dim] = None;
            l.inputs = vec![o.clone(); x.len()];
            l.outputs = vec![o];
        }
        Op::Expand(_) => {
            let o = l.fresh_dims(y[0], |_| true);
            let (xd, od) = (dims(x[0]), dims(y[0]));
            let off = od.len() - xd.len();
            l.inputs = vec![(0..xd.len())
                .map(|d| if xd[d] == od[off + d] { o[off + d] } else { None })
                .collect()];
            l.outputs = vec![o];
        }
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
            let r = rank(x[0]);
            let mut o = l.fresh_dims(x[0], |d| d + 1 < r);
            o[r - 1] = None;
            l.inputs = vec![o.clone()];
            for m in &x[1..] {
                l.inputs.push(vec![None; rank(m)]);
            }
            l.outputs = vec![o];
        }
        Op::Embedding { .. } => {
            // A lookup is a product with the ids' one-hot rows: the vocabulary is its
            // contraction, so splitting it (Megatron-LM's vocabulary-parallel embedding)
            // leaves the output a pending sum.
            let ids = l.fresh_dims(x[1], |_| true);
            let vocab = l.label(x[0].shape.dims()[0], true);
            let hidden = l.label(x[0].shape.dims()[1], true);
            l.inputs = vec![vec![Some(vocab), Some(hidden)], ids.clone()];
            let mut o = ids;
            o.push(Some(hidden));
            l.outputs = vec![o];
            l.partial_from = vec![vec![vocab]];
        }
        Op::CrossEntropy { .. } => {
            // Rows split freely (each shard's loss a share of the mean, a pending sum); so do
            // the classes: Megatron-LM's vocabulary-parallel loss, whose lowering computes
            // every row's log-sum-exp over all classes from the shards' (an all-gather of one
            // number per row and shard) and leaves each shard's part of the loss pending.
            let rows = l.fresh_dims(x[1], |_| true);
            let classes = l.label(x[0].shape.dims()[rank(x[0]) - 1], true);
            let mut logits = rows.clone();
            logits.push(Some(classes));
            l.inputs = vec![logits, rows.clone()];
            if x.len() == 3 {
                l.inputs.push(rows.clone()); // a lowered loss's log-sum-exp
            }
            l.outputs = vec![vec![], rows.clone()];
            let mut pending: Vec<usize> = rows.iter().flatten().copied().collect();
            pending.push(classes);
            l.partial_from = vec![pending, vec![]];
        }
        Op::LinearCrossEntropy { .. } => {
            // The chunked LM head and loss: rows split freely (each shard's loss a pending
            // sum, the weight's gradient too, as for any replicated input); the hidden
            // features and the classes stay whole — a split of either would need the logits'
            // reduction or the log-sum-exp's exchange inside the op (where the tensor axis
            // splits the vocabulary the planner leaves the pair unfused).
            let rows = l.fresh_dims(x[2], |_| true);
            let mut hidden = rows.clone();
            hidden.push(None);
            l.inputs = vec![hidden, vec![None, None], rows.clone()];
            l.outputs = vec![vec![], rows.clone()];
            l.partial_from = vec![rows.iter().flatten().copied().collect(), vec![]];
        }
        Op::TiledMlp(spec) => {
            // The tiled MLP: rows split freely (its weights' gradients pending sums), and the
            // ffn features — the up projections by columns, the down projection by rows, as
            // Megatron's tensor parallelism splits the unfused MLP — leaving the output a
            // pending sum; the hidden features stay whole.
            let dims = x[0].shape.dims();
            let xi: Vec<Option<usize>> = (0..dims.len())
                .map(|d| (d + 1 < dims.len()).then(|| l.label(dims[d], true)))
                .collect();
            let ffn_size = x[1].shape.dims()[spec.ffn_dim_of_up()];
            let f = Some(l.label(ffn_size, true));
            let up = |ffn_dim: usize| {
                let mut v = vec![None, None];
                v[ffn_dim] = f;
                v
            };
            let mut inputs = vec![xi.clone(), up(spec.ffn_dim_of_up())];
            if spec.gated {
                inputs.push(up(spec.ffn_dim_of_up()));
            }
            if spec.bias {
                inputs.push(vec![f]);
            }
            inputs.push(up(spec.ffn_dim_of_down()));
            l.inputs = inputs;
            l.outputs = vec![xi];
            l.partial_from = vec![f.into_iter().collect()];
        }
        Op::LogSumExp => {
            let r = rank(x[0]);
            let xi = l.fresh_dims(x[0], |d| d + 1 < r);
            l.outputs = vec![xi[..r - 1].to_vec()];
            l.inputs = vec![xi];
        }
        Op::Attention(_) => {
            // q [B,S,H,D], k/v [B,T,Hkv,D] → out [B,S,H,D], lse [B,H,S].
            let (q, k) = (dims(x[0]), dims(x[1]));
            let b = l.label(q[0], true);
            // Heads split together: the bound is the KV head count.
            let h = l.label(k[2], true);
            l.inputs = vec![vec![Some(b), None, Some(h), None]; 3];
            if x.len() == 4 {
                // Over a KV cache: each row's start goes with the row.
                l.inputs.push(vec![Some(b)]);
            }
            l.outputs = vec![vec![Some(b), None, Some(h), None], vec![Some(b), Some(h), None]];
        }
        Op::Rope { .. } => {
            let q = dims(x[0]);
            let b = l.label(q[0], true);
            let h = l.label(q[2], true);
            let o = vec![Some(b), None, Some(h), None];
            l.inputs = vec![o.clone()];
            if x.len() == 2 {
                l.inputs.push(vec![Some(b), None]);
            }
            l.outputs = vec![o];
        }
        Op::CacheWrite => {
            // cache [B,C,Hkv,D], x [B,S,Hkv,D], start [B]: by rows and heads.
            let c = dims(x[0]);
            let b = l.label(c[0], true);
            let h = l.label(c[2], true);
            let o = vec![Some(b), None, Some(h), None];
            l.inputs = vec![o.clone(), o.clone(), vec![Some(b)]];
            l.outputs = vec![o];
        }
        Op::SelectPositions => {
            // x [B,S,..] → [B,1,..]: rows and the trailing dims split, the sequence whole.
            let mut xi = l.fresh_dims(x[0], |d| d != 1);
            xi[1] = None;
            l.inputs = vec![xi.clone(), vec![xi[0]]];
            l.outputs = vec![xi];
        }
        Op::QMatMul(q) => {
            // x [.., K] · w [N, K·bits/8]ᵀ with scales [N, K/group]: like a matmul against a
            // weight. Splitting K must keep whole bytes and whole groups (the label's size is
            // the group count for int4); an int8 row's one scale stays whole.
            let (xd, out) = (dims(x[0]), dims(y[0]));
            let r = out.len();
            let batch: Vec<Option<usize>> =
                (0..r - 1).map(|d| Some(l.label(out[d], true))).collect();
            let n = l.label(out[r - 1], true);
            let k_size = xd[r - 1];
            let groups = k_size / q.group.max(1);
            let k = l.label(if q.bits == 8 { k_size } else { groups }, true);
            let mut xi = batch.clone();
            xi.push(Some(k));
            let scale_k = if q.bits == 8 { None } else { Some(k) };
            l.inputs = vec![xi, vec![Some(n), Some(k)], vec![Some(n), scale_k]];
            let mut o = batch;
            o.push(Some(n));
            l.outputs = vec![o];
            l.partial_from = vec![vec![k]];
        }
        Op::QMatMulBackward(q) => {
            // dy [.., N] · dequant(w [N, K·bits/8]) → dx [.., K]: QMatMul's labels with x and
            // y exchanged; a split N leaves a pending sum, a split K whole bytes and groups.
            let (dy, out) = (dims(x[0]), dims(y[0]));
            let r = out.len();
            let batch: Vec<Option<usize>> =
                (0..r - 1).map(|d| Some(l.label(out[d], true))).collect();
            let n = l.label(dy[r - 1], true);
            let k_size = out[r - 1];
            let groups = k_size / q.group.max(1);
            let k = l.label(if q.bits == 8 { k_size } else { groups }, true);
            let mut dyi = batch.clone();
            dyi.push(Some(n));
            let scale_k = if q.bits == 8 { None } else { Some(k) };
            l.inputs = vec![dyi, vec![Some(n), Some(k)], vec![Some(n), scale_k]];
            let mut o = batch;
            o.push(Some(k));
            l.outputs = vec![o];
            l.partial_from = vec![vec![n]];
        }
        Op::Conv2d(spec) => {
            // x [N,C,H,W] * w [O,C/g,kh,kw] → y [N,O,Ho,Wo].
            let n = l.label(x[0].shape.dim(0), true);
            let o = l.label(x[1].shape.dim(0), spec.groups == 1);
            l.inputs = vec![vec![Some(n), None, None, None], vec![Some(o), None, None, None]];
            l.outputs = vec![vec![Some(n), Some(o), None, None]];
        }
        Op::GroupNorm { .. } => {
            let n = l.label(x[0].shape.dim(0), true);
            let mut xi = vec![None; rank(x[0])];
            xi[0] = Some(n);
            l.inputs = vec![xi.clone(), vec![None], vec![None]];
            l.outputs = vec![xi];
        }
        Op::MaxPool2d(_) | Op::AvgPool2d { .. } | Op::Upsample2d { .. } => {
            let n = l.label(x[0].shape.dim(0), true);
            let c = l.label(x[0].shape.dim(1), true);
            let o = vec![Some(n), Some(c), None, None];
            l.inputs = vec![o.clone()];
            l.outputs = vec![o];
        }
        Op::TopK { .. } | Op::TakeAlong | Op::ScatterAlong { .. } => {
            // Per row: the leading dims split, the last stays whole. Routed tokens
            // `[G.., n, ·]` (rank 3 and up) keep a group's tokens `n` whole as the slots
            // after them do, so a group's integer routes are made where they are used and
            // never travel (collectives carry floats: the router's scores are gathered).
            let r = rank(y[0]);
            let o = l.fresh_dims(y[0], |d| d + 1 < r && (r < 3 || d + 2 < r));
            let mut lead = o.clone();
            lead[r - 1] = None;
            l.inputs = x.iter().map(|_| lead.clone()).collect();
            l.outputs = y.iter().map(|_| lead.clone()).collect();
        }
        Op::MoeSlots { .. } => {
            // Per routing group (the leading dims); a group's tokens and choices stay whole.
            let r = rank(y[0]);
            let mut o = l.fresh_dims(y[0], |d| d + 2 < r);
            o[r - 2] = None;
            o[r - 1] = None;
            l.inputs = vec![o.clone()];
            l.outputs = vec![o];
        }
        Op::MoeDispatch { .. } | Op::MoeCombine => {
            // Tokens `[G.., n, H]` ↔ buffer `[G.., E, C, H]`, slots `[G.., n, k]`: the groups
            // and the hidden dim split; a group's tokens, its experts and capacity stay whole.
            let dispatch = matches!(op, Op::MoeDispatch { .. });
            let tok = if dispatch { x[0] } else { y[0] };
            let g = rank(tok) - 2;
            let groups: Vec<Option<usize>> =
                (0..g).map(|d| Some(l.label(tok.shape.dim(d), true))).collect();
            let h = l.label(tok.shape.dim(g + 1), true);
            let mut t = groups.clone();
            t.extend([None, Some(h)]);
            let mut bf = groups.clone();
            bf.extend([None, None, Some(h)]);
            let mut slots = groups;
            slots.extend([None, None]);
            let (first, out) = if dispatch { (t, bf) } else { (bf, t) };
            l.inputs = vec![first, slots.clone()];
            if x.len() == 3 {
                l.inputs.push(slots);
            }
            l.outputs = vec![out];
        }
        Op::Parameter { .. }
        | Op::Input(_)
        | Op::OptimizerState { .. }
        | Op::KvCache(_)
        | Op::Fill { .. }
        | Op::MoeSlotDot
        | Op::Conv2dBackwardInput { .. }
        | Op::Conv2dBackwardWeight { .. }
        | Op::GroupNormBackward { .. }
        | Op::MaxPool2dBackward(_)
        | Op::AvgPool2dBackward { .. }
        | Op::Upsample2dBackward { .. }
        | Op::UnaryBackward(_)
        | Op::BinaryBackward { .. }
        | Op::ReduceBackward { .. }
        | Op::SoftmaxBackward
        | Op::LayerNormBackward { .. }
        | Op::RmsNormBackward { .. }
        | Op::EmbeddingBackward { .. }
        | Op::CrossEntropyBackward { .. }
        | Op::LinearCrossEntropyBackward { .. }
        | Op::TiledMlpBackward(_)
        | Op::AttentionBackward(_)
        | Op::AttentionMerge
        | Op::AttentionMergeBackward
        | Op::RingMerge(_)
        | Op::AdamW(_)
        | Op::Reshard(_)
        | Op::Send(_)
        | Op::Recv(..)
        | Op::Transfer { .. } => {
            return Err(format!(
                "{} has no sharding rule: the planner shards forward graphs and differentiates \
                 the sharded graph",
                op.name()
            ))
        }
    }
    if l.partial_from.is_empty() {
        l.partial_from = vec![Vec::new(); l.outputs.len()];
    }
    Ok(l)
}

/// Reshape keeps a split only where it survives: dims are grouped into runs of equal product,
/// and a split of a group's leading dim carries over to the other side's leading dim (a block
/// of rows of `[b·s, d]` is a block of `b` in `[b, s, d]` when the split divides `b`).
fn reshape_labels(
    l: &mut Labeling,
    xd: &[usize],
    yd: &[usize],
) -> (Vec<Option<usize>>, Vec<Option<usize>>) {
    let mut xi = vec![None; xd.len()];
    let mut yo = vec![None; yd.len()];
    let (mut i, mut j) = (0, 0);
    while i < xd.len() && j < yd.len() {
        let (gi, gj) = (i, j);
        let (mut px, mut py) = (xd[i] as u64, yd[j] as u64);
        i += 1;
        j += 1;
        while px != py {
            if px < py {
                if i >= xd.len() {
                    break;
                }
                px *= xd[i] as u64;
                i += 1;
            } else {
                if j >= yd.len() {
                    break;
                }
                py *= yd[j] as u64;
                j += 1;
            }
        }
        let lab = l.label(xd[gi].min(yd[gj]), true);
        xi[gi] = Some(lab);
        yo[gj] = Some(lab);
        // Trailing size-1 dims join no group.
        while i < xd.len() && xd[i] == 1 && (j >= yd.len() || yd[j] != 1) {
            i += 1;
        }
        while j < yd.len() && yd[j] == 1 && (i >= xd.len() || xd[i] != 1) {
            j += 1;
        }
    }
    (xi, yo)
}

/// Restricts which labels each mesh axis may split (fixed configurations).
pub type AxisFilter<'a> = &'a dyn Fn(usize, usize) -> bool;

/// Every strategy of a labelled op on `mesh`: each axis splits one shardable label or none,
/// subject to `allow(axis, label)`, and every split must divide its dims evenly.
pub fn strategies(
    l: &Labeling,
    x: &[&TensorMeta],
    y: &[&TensorMeta],
    mesh: &Mesh,
    allow: AxisFilter<'_>,
) -> Vec<Strategy> {
    let na = mesh.ndim();
    let options: Vec<Vec<Option<usize>>> = (0..na)
        .map(|a| {
            let mut o = vec![None];
            o.extend((0..l.sizes.len()).filter(|&lab| l.shardable[lab] && allow(a, lab)).map(Some));
            o
        })
        .collect();
    let mut out = Vec::new();
    let mut pick = vec![0usize; na];
    'outer: loop {
        let assign: Vec<Option<usize>> = (0..na).map(|a| options[a][pick[a]]).collect();
        if let Some(s) = build(l, x, y, mesh, &assign) {
            out.push(s);
        }
        // Odometer over the per-axis options.
        for a in (0..na).rev() {
            pick[a] += 1;
            if pick[a] < options[a].len() {
                continue 'outer;
            }
            pick[a] = 0;
        }
        break;
    }
    out
}

fn build(
    l: &Labeling,
    x: &[&TensorMeta],
    y: &[&TensorMeta],
    mesh: &Mesh,
    assign: &[Option<usize>],
) -> Option<Strategy> {
    let mut axes_of = vec![Vec::new(); l.sizes.len()];
    for (a, lab) in assign.iter().enumerate() {
        if let Some(lab) = lab {
            axes_of[*lab].push(a);
        }
    }
    for (lab, axes) in axes_of.iter().enumerate() {
        let n: usize = axes.iter().map(|&a| mesh.shape[a]).product();
        if !l.sizes[lab].is_multiple_of(n) {
            return None;
        }
    }
    let spec_of = |labels: &[Option<usize>], partial: &[usize]| -> Spec {
        let mut p: Vec<usize> =
            partial.iter().flat_map(|&lab| axes_of[lab].iter().copied()).collect();
        p.sort_unstable();
        Spec {
            dims: labels
                .iter()
                .map(|lab| lab.map_or_else(Vec::new, |lab| axes_of[lab].clone()))
                .collect(),
            partial: p,
        }
    };
    let inputs: Vec<Spec> = l.inputs.iter().map(|labs| spec_of(labs, &[])).collect();
    let outputs: Vec<Spec> =
        l.outputs.iter().zip(&l.partial_from).map(|(labs, p)| spec_of(labs, p)).collect();
    // Every tensor must split evenly (reshape labels bound two dims at once).
    for (spec, meta) in inputs.iter().zip(x).chain(outputs.iter().zip(y)) {
        spec.local_shape(mesh, meta.shape.dims())?;
    }
    let compute_axes = (0..assign.len()).filter(|&a| assign[a].is_some()).collect();
    Some(Strategy { inputs, outputs, compute_axes, axis_labels: assign.to_vec() })
}

/// The local (per-device) meta of a tensor under a spec.
pub fn local_meta(meta: &TensorMeta, spec: &Spec, mesh: &Mesh) -> Option<TensorMeta> {
    let shape = spec.local_shape(mesh, meta.shape.dims())?;
    Some(TensorMeta::new(shape, meta.dtype))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Link;
    use tessera_ir::DType;

    fn mesh(shape: &[usize]) -> Mesh {
        Mesh::with_links(shape, vec![Link { latency_s: 1e-6, bandwidth: 1e11 }; shape.len()])
    }
    fn meta(d: &[usize]) -> TensorMeta {
        TensorMeta::new(d.to_vec(), DType::F32)
    }

    #[test]
    fn matmul_k_split_is_partial_and_n_split_is_column_parallel() {
        let op = Op::MatMul { trans_a: false, trans_b: false };
        let (a, b, c) = (meta(&[8, 16, 32]), meta(&[32, 64]), meta(&[8, 16, 64]));
        let l = labeling(&op, &[&a, &b], &[&c]).unwrap();
        let all = strategies(&l, &[&a, &b], &[&c], &mesh(&[4]), &|_, _| true);
        // none, batch, m, n, k.
        assert_eq!(all.len(), 5);
        let row = all.iter().find(|s| s.outputs[0].partial == vec![0]).unwrap();
        assert_eq!(row.inputs[0].to_string(), "[R, R, S0]");
        assert_eq!(row.inputs[1].to_string(), "[S0, R]");
        let col = all.iter().find(|s| s.inputs[1].to_string() == "[R, S0]").unwrap();
        assert_eq!(col.outputs[0].to_string(), "[R, R, S0]");
        assert_eq!(col.inputs[0].to_string(), "[R, R, R]");
    }

    #[test]
    fn reshape_carries_a_split_of_the_leading_dim_only() {
        let (x, y) = (meta(&[4, 6, 8]), meta(&[24, 8]));
        let l = labeling(&Op::Reshape(y.shape.clone()), &[&x], &[&y]).unwrap();
        let all = strategies(&l, &[&x], &[&y], &mesh(&[2]), &|_, _| true);
        let specs: Vec<String> =
            all.iter().map(|s| format!("{} -> {}", s.inputs[0], s.outputs[0])).collect();
        assert!(specs.contains(&"[S0, R, R] -> [S0, R]".to_string()), "{specs:?}");
        assert!(specs.contains(&"[R, R, S0] -> [R, S0]".to_string()), "{specs:?}");
        assert!(!specs.iter().any(|s| s.starts_with("[R, S0")), "{specs:?}");
    }

    #[test]
    fn attention_splits_heads_only_by_divisors_of_kv_heads() {
        let spec = tessera_ir::AttentionSpec { scale: 1.0, ..tessera_ir::AttentionSpec::causal(1) };
        let (q, kv) = (meta(&[2, 8, 8, 4]), meta(&[2, 8, 2, 4]));
        let (o, lse) = (meta(&[2, 8, 8, 4]), meta(&[2, 8, 8]));
        let l = labeling(&Op::Attention(spec), &[&q, &kv, &kv], &[&o, &lse]).unwrap();
        let four = strategies(&l, &[&q, &kv, &kv], &[&o, &lse], &mesh(&[4]), &|_, _| true);
        // Batch 2 and KV heads 2 do not split 4 ways: only replication remains.
        assert_eq!(four.len(), 1);
        let two = strategies(&l, &[&q, &kv, &kv], &[&o, &lse], &mesh(&[2]), &|_, _| true);
        assert_eq!(two.len(), 3);
    }

    #[test]
    fn conv_splits_batch_and_ungrouped_output_channels() {
        let (x, w, y) = (meta(&[4, 6, 8, 8]), meta(&[8, 6, 3, 3]), meta(&[4, 8, 8, 8]));
        let spec = tessera_ir::Conv2dSpec { padding: [1, 1], ..Default::default() };
        let l = labeling(&Op::Conv2d(spec), &[&x, &w], &[&y]).unwrap();
        let all = strategies(&l, &[&x, &w], &[&y], &mesh(&[2]), &|_, _| true);
        let specs: Vec<String> = all
            .iter()
            .map(|s| format!("{} {} -> {}", s.inputs[0], s.inputs[1], s.outputs[0]))
            .collect();
        // none, batch (weight replicated), output channels (weight by rows).
        assert_eq!(specs.len(), 3, "{specs:?}");
        assert!(specs.contains(&"[S0, R, R, R] [R, R, R, R] -> [S0, R, R, R]".into()), "{specs:?}");
        assert!(specs.contains(&"[R, R, R, R] [S0, R, R, R] -> [R, S0, R, R]".into()), "{specs:?}");
        // Grouped: batch only.
        let (wg, grouped) = (meta(&[8, 3, 3, 3]), tessera_ir::Conv2dSpec { groups: 2, ..spec });
        let l = labeling(&Op::Conv2d(grouped), &[&x, &wg], &[&y]).unwrap();
        assert_eq!(strategies(&l, &[&x, &wg], &[&y], &mesh(&[2]), &|_, _| true).len(), 2);
        // GroupNorm: batch only; pooling: batch and channels.
        let gn = Op::GroupNorm { groups: 2, eps: 1e-5 };
        let c = meta(&[6]);
        let l = labeling(&gn, &[&x, &c, &c], &[&x]).unwrap();
        assert_eq!(strategies(&l, &[&x, &c, &c], &[&x], &mesh(&[2]), &|_, _| true).len(), 2);
        let pool = tessera_ir::Pool2dSpec { kernel: [2, 2], stride: [2, 2], padding: [0, 0] };
        let p = meta(&[4, 6, 4, 4]);
        let l = labeling(&Op::MaxPool2d(pool), &[&x], &[&p]).unwrap();
        assert_eq!(strategies(&l, &[&x], &[&p], &mesh(&[2]), &|_, _| true).len(), 3);
    }

    #[test]
    fn cross_entropy_loss_is_a_pending_sum_over_split_rows_and_classes() {
        let (lg, t) = (meta(&[4, 8, 10]), TensorMeta::new(vec![4, 8], DType::I64));
        let (loss, lse) = (meta(&[]), meta(&[4, 8]));
        let op = Op::CrossEntropy { ignore_index: None, sum: false, classes: None };
        let l = labeling(&op, &[&lg, &t], &[&loss, &lse]).unwrap();
        let all = strategies(&l, &[&lg, &t], &[&loss, &lse], &mesh(&[2, 2]), &|_, _| true);
        let s = all.iter().find(|s| s.inputs[1].to_string() == "[S0, S1]").unwrap();
        assert_eq!(s.outputs[0].partial, vec![0, 1]);
        // The vocabulary-parallel loss: rows over axis 0, classes over axis 1; the targets and
        // the log-sum-exp whole over the class axis, the loss pending over both.
        let v = all.iter().find(|s| s.inputs[0].to_string() == "[S0, R, S1]").unwrap();
        assert_eq!(v.inputs[1].to_string(), "[S0, R]");
        assert_eq!(v.outputs[1].to_string(), "[S0, R]");
        assert_eq!(v.outputs[0].partial, vec![0, 1]);
    }
}
