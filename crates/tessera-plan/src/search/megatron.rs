//! Megatron-LM's tensor-parallel layout, op by op: what a config string's `tpN` (and `sp`)
//! means. The tensor-parallel axis splits
//!
//! - a matmul against a weight whose activation input is whole on that axis by the weight's
//!   output features (column-parallel: q/k/v, gate/up, fc, the LM head over the vocabulary),
//!   and one whose input arrives split on the contracted features by the weight's input
//!   features (row-parallel: the attention output and down/fc2 projections; the output is a
//!   pending sum, reduced by the next op's layout). Output features that tp does not divide
//!   (a 50257-token vocabulary, which Megatron-LM pads to a multiple of 128·tp) split the
//!   input features instead;
//! - what lies between the two by the split that flows from the column-parallel output:
//!   biases, activations, gating products, the head reshapes, RoPE and attention (by heads);
//! - the embedding table by vocabulary rows (its output a pending sum), or by its hidden
//!   features where tp does not divide the vocabulary;
//! - the loss by vocabulary where the logits arrive so split (Megatron-LM's vocabulary-parallel
//!   cross-entropy: the logits are never gathered, see `lower/loss.rs`);
//! - a mixture of experts' experts by their features (column-parallel gate/up, row-parallel
//!   down, batched over the expert dim; the combine reads their reduced output), while its
//!   router — a weight matmul whose output a softmax or top-k reads — stays whole (replicated,
//!   as Megatron-LM's);
//! - nothing else: norms, residual adds and a loss over whole logits see whole tensors on the
//!   tensor axis — or, with `sp` (Megatron's sequence parallelism), their sequence split over
//!   it.
//!
//! One rule decides column or row: which split the matmul's input arrives in. No op is
//! recognised by its name, so every model family built from the IR's ops gets the layout.
//! Where Megatron-LM differs:
//! - it pads a vocabulary tp does not divide, where here the table splits by its hidden
//!   features and the head by its input features instead (the same bytes per device), and
//!   the loss then reads logits reduced whole (or, with `sp`, its share of the sequence);
//! - a fused q/k/v weight in Hugging Face's `[q | k | v]` column order (GPT-2's `c_attn`)
//!   splits by contiguous columns, the same bytes per device, where Megatron-LM stores it
//!   interleaved per head: q, k and v are gathered after it, and each device takes its heads;
//! - where tp exceeds the KV heads (Megatron-LM divides the query groups by tp, so refuses),
//!   the KV heads are replicated: attention splits its query heads alone, and the k/v
//!   projections and what lies between them and attention stay whole on the tensor axis, so
//!   every device holds every KV head and its heads read theirs (`AttentionSpec::kv_whole`).
//!   vLLM keeps one KV head per device instead; that needs a spec splitting a dim over part
//!   of an axis, which specs cannot say.

use super::space::dim_roles;
use crate::rules::label_roles;
use crate::rules::{
    attention_kv_whole_labeling, labeling, strategies, DimRole, Labeling, Strategy,
};
use crate::{Mesh, PlanError, Result};
use tessera_ir::{Graph, Op, TensorMeta};

/// Megatron-LM's tensor-parallel layout on a `[1, tp]` mesh as one strategy per node: with no
/// data-parallel axis, each op has exactly one strategy that splits the label
/// [`tp_labels`] pins (and none elsewhere). For graphs run without a search: generation
/// steps. Errs, naming the op and the dim, where `tp` does not divide what the layout splits.
pub fn tp_strategies(g: &Graph, mesh: &Mesh) -> Result<Vec<Option<Strategy>>> {
    if mesh.ndim() != 2 || mesh.shape[0] != 1 {
        return Err(PlanError::Invalid(format!(
            "tensor-parallel layouts run on a [1, tp] mesh, not {:?}",
            mesh.shape
        )));
    }
    let tp = mesh.shape[1];
    let metas = |ts: &[tessera_ir::TensorId]| -> Vec<&TensorMeta> {
        ts.iter().map(|&t| g.meta(t)).collect()
    };
    let mut labels = Vec::with_capacity(g.nodes.len());
    for n in &g.nodes {
        if n.op.is_leaf() {
            labels.push(None);
            continue;
        }
        let l = labeling(&n.op, &metas(&n.inputs), &metas(&n.outputs))
            .map_err(|e| PlanError::Invalid(format!("{}: {e}", g.scope_name(n.scope))))?;
        labels.push(Some(l));
    }
    let roles = dim_roles(g, &labels);
    let pins = if tp > 1 {
        tp_labels(g, &mut labels, &roles, false, tp, true).map_err(PlanError::Invalid)?
    } else {
        vec![None; g.nodes.len()]
    };
    let mut out = Vec::with_capacity(g.nodes.len());
    for (i, n) in g.nodes.iter().enumerate() {
        let Some(l) = &labels[i] else {
            out.push(None);
            continue;
        };
        let pin = pins[i];
        let allow = |a: usize, lab: usize| a == 1 && tp > 1 && pin == Some(lab);
        let all = strategies(l, &metas(&n.inputs), &metas(&n.outputs), mesh, &allow);
        let pick = all.into_iter().find(|s| s.axis_labels[1] == pin && s.axis_labels[0].is_none());
        match pick {
            Some(s) => out.push(Some(s)),
            None => {
                return Err(PlanError::Invalid(format!(
                    "{} ({}) cannot be split over {tp} devices as Megatron-LM's layout splits it",
                    g.scope_name(n.scope),
                    n.op.name()
                )))
            }
        }
    }
    Ok(out)
}

/// The label the tensor-parallel axis splits at each node (`None`: no split), for a `[dp, tp]`
/// mesh with `tp` devices on the tensor axis. Errs, saying why, when Megatron's layout needs
/// a split that `tp` does not divide (heads, KV heads, features): that config does not exist
/// for the model.
pub(super) fn tp_labels(
    g: &Graph,
    labels: &mut [Option<Labeling>],
    roles: &[Vec<DimRole>],
    sp: bool,
    tp: usize,
    tied_head_rows: bool,
) -> Result<Vec<Option<usize>>, String> {
    let tables = embedding_tables(g);
    let router = normalised_over_last_dim(g);
    // Past the KV heads: attention splits its query heads alone and what makes k and v
    // stays whole on the tensor axis.
    let kv_whole = kv_whole_side(g, labels, tp);
    // Per tensor: the dim Megatron's layout splits over the tensor axis as it leaves its
    // producer (`None`: whole, or a pending sum its consumer reduces).
    let mut split: Vec<Option<usize>> = vec![None; g.tensors.len()];
    let mut pins: Vec<Option<usize>> = vec![None; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        if kv_whole[i] {
            continue; // whole on the tensor axis, even with `sp`: attention reads all of k, v
        }
        let Some(l) = &labels[i] else { continue };
        let at = |k: usize| {
            let d = split[n.inputs[k].index()]?;
            l.inputs[k].get(d).copied().flatten()
        };
        let (pin, out_split) = match &n.op {
            // (A MoE router is not: it is replicated, as Megatron-LM's, its logits whole, and
            // falls to the last arm.)
            Op::MatMul { .. } | Op::QMatMul(_) | Op::QMatMulBackward(_)
                if (matches!(n.op, Op::QMatMul(_) | Op::QMatMulBackward(_))
                    || is_weight(g, n.inputs[1]))
                    && !router[n.outputs[0].index()] =>
            {
                let x = g.meta(n.inputs[0]);
                let trans_a = matches!(n.op, Op::MatMul { trans_a: true, .. });
                let k_dim = if trans_a { x.shape.rank() - 2 } else { x.shape.rank() - 1 };
                let row = l.inputs[0][k_dim];
                let column = l.outputs[0].last().copied().flatten();
                let divides =
                    |lab: Option<usize>| lab.is_some_and(|x| l.sizes[x].is_multiple_of(tp));
                // A table split by its hidden features (a vocabulary tp does not divide).
                let tied = tied_head_rows
                    && weight_param(g, n.inputs[1])
                        .is_some_and(|p| tables.contains(&p) && !splits_vocabulary(g.meta(p), tp));
                if split[n.inputs[0].index()] == Some(k_dim) || (tied && row.is_some()) {
                    // Row-parallel: a pending sum leaves. (A head tied to an embedding table
                    // split by its hidden features, when generating, splits as the table is
                    // stored, so each step all-reduces [B, 1, V] logits instead of moving the
                    // table; a table split by vocabulary rows is already the column split.)
                    (row, false)
                } else if divides(column) || !divides(row) {
                    (column, true) // column-parallel
                } else {
                    // Output features tp does not divide (GPT-2's 50257-token vocabulary,
                    // which Megatron-LM pads): split the input features instead, the same
                    // bytes per device.
                    (row, false)
                }
            }
            // Vocabulary-parallel: the table by rows, its output a pending sum reduced to
            // whole (or, with `sp`, scattered over the sequence). A vocabulary tp does not
            // divide (GPT-2's 50257, which Megatron-LM pads) splits the hidden features
            // instead, the same bytes per device.
            Op::Embedding { .. } => {
                let (vocab, hidden) = (l.inputs[0][0], l.inputs[0][1]);
                if splits_vocabulary(g.meta(n.inputs[0]), tp) {
                    (vocab, false)
                } else {
                    (hidden, false)
                }
            }
            // Attention (and RoPE before it) by heads, whatever split arrives: where q, k and v
            // come whole (GPT-2's fused c_attn, sliced), each device takes its heads locally.
            Op::Attention(_) | Op::Rope { .. } | Op::CacheWrite => (l.inputs[0][2], true),
            // The loss over logits split by vocabulary (the column-parallel head's output) is
            // vocabulary-parallel, as Megatron-LM's: the logits are never gathered.
            Op::CrossEntropy { .. } => match at(0) {
                Some(lab) if l.inputs[0].last().copied().flatten() == Some(lab) => {
                    (Some(lab), false)
                }
                _ => (None, false),
            },
            // The tiled MLP as Megatron's MLP: the up projections column-parallel, the down
            // projection row-parallel — its ffn features split, a pending sum leaving.
            Op::TiledMlp(spec) => (l.inputs[1][spec.ffn_dim_of_up()], false),
            Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::GroupNorm { .. } => (None, false),
            // Everything else carries the split it receives — where it can: an op that needs
            // that dim whole (the MoE router's softmax over the experts a column-parallel gate
            // splits) gathers it.
            _ => match (0..n.inputs.len()).find_map(at) {
                Some(lab) if l.shardable[lab] => (Some(lab), true),
                _ => (None, false),
            },
        };
        if let Some(lab) = pin {
            if !l.sizes[lab].is_multiple_of(tp) {
                return Err(format!(
                    "tp{tp} splits {} ({}) over a dim of {}, which {tp} does not divide: \
                     Megatron-LM's layout needs the heads and features divisible by the \
                     tensor-parallel degree (the KV heads too, unless tp exceeds them); use a \
                     tp that divides {}",
                    g.scope_name(n.scope),
                    n.op.name(),
                    l.sizes[lab],
                    l.sizes[lab]
                ));
            }
        }
        pins[i] = match pin {
            Some(lab) => Some(lab),
            // Sequence parallelism: what is whole on the tensor axis splits its sequence.
            None if sp => {
                let role = label_roles(n, l, roles);
                (0..l.sizes.len()).find(|&lab| role[lab] == DimRole::Seq && l.shardable[lab])
            }
            None => None,
        };
        if let (true, Some(lab)) = (out_split, pin) {
            for (k, &o) in n.outputs.iter().enumerate() {
                split[o.index()] = l.outputs[k].iter().position(|&x| x == Some(lab));
            }
        }
    }
    Ok(pins)
}

/// Per node, whether it makes the k or v of an attention whose KV heads `tp` exceeds
/// (Megatron-LM refuses; the KV heads are replicated here, as vLLM does for inference): such
/// an attention gets [`attention_kv_whole_labeling`] in `labels`, splitting its query heads
/// alone, and the ops making its k and v — back to and including the projections against a
/// weight — stay whole on the tensor axis, so every device holds every KV head.
fn kv_whole_side(g: &Graph, labels: &mut [Option<Labeling>], tp: usize) -> Vec<bool> {
    let mut side = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        if !matches!(n.op, Op::Attention(_)) {
            continue;
        }
        let (q, k) = (g.meta(n.inputs[0]).shape.dims(), g.meta(n.inputs[1]).shape.dims());
        let (heads, kv_heads) = (q[2], k[2]);
        if kv_heads >= tp || !heads.is_multiple_of(tp) {
            continue; // split together, or refused naming the heads tp does not divide
        }
        let x: Vec<&TensorMeta> = n.inputs.iter().map(|&t| g.meta(t)).collect();
        labels[i] = Some(attention_kv_whole_labeling(&x));
        let mut todo = vec![n.inputs[1], n.inputs[2]];
        while let Some(t) = todo.pop() {
            let p = g.tensor(t).producer.index();
            let node = &g.nodes[p];
            if node.op.is_leaf() || side[p] {
                continue;
            }
            side[p] = true;
            match &node.op {
                // The projection: its weight stays whole; nothing before it is k's alone.
                Op::MatMul { .. } | Op::QMatMul(_) => {}
                // Rotary embeddings: the rotated tensor (not the positions).
                Op::Rope { .. } => todo.push(node.inputs[0]),
                // Otherwise follow the one activation input (a bias add's other input is a
                // weight; a cache write's others are the cache and the starts).
                _ => {
                    let acts: Vec<_> = node
                        .inputs
                        .iter()
                        .copied()
                        .filter(|&t| {
                            !g.nodes[g.tensor(t).producer.index()].op.is_leaf() && !is_weight(g, t)
                        })
                        .collect();
                    if let [one] = acts[..] {
                        todo.push(one);
                    }
                }
            }
        }
    }
    side
}

/// Per tensor, whether a `Softmax` or a `TopK` reads it (through casts and reshapes): a MoE
/// router's logits, whose normalisation and top-k read every expert. Megatron-LM replicates
/// the router, so the matmul making them keeps its weight and output whole.
fn normalised_over_last_dim(g: &Graph) -> Vec<bool> {
    let consumers = g.consumers();
    let mut out = vec![false; g.tensors.len()];
    // Reverse program order: a tensor's consumers are decided before it.
    for n in g.nodes.iter().rev() {
        for &t in &n.outputs {
            out[t.index()] = consumers[t.index()].iter().any(|c| {
                let c = &g.nodes[c.index()];
                match c.op {
                    Op::Softmax | Op::TopK { .. } => true,
                    Op::Cast(_) | Op::Reshape(_) => out[c.outputs[0].index()],
                    _ => false,
                }
            });
        }
    }
    out
}

/// Whether `tpN` splits an embedding table `[vocab, hidden]` by vocabulary rows: where tp
/// divides the vocabulary (else by its hidden features).
fn splits_vocabulary(table: &TensorMeta, tp: usize) -> bool {
    table.shape.dims().first().is_some_and(|v| v.is_multiple_of(tp))
}

/// A matmul operand that is a parameter, possibly through casts and layout changes.
fn is_weight(g: &Graph, t: tessera_ir::TensorId) -> bool {
    weight_param(g, t).is_some()
}

/// The parameter a matmul operand is, through casts and layout changes.
fn weight_param(g: &Graph, t: tessera_ir::TensorId) -> Option<tessera_ir::TensorId> {
    let mut t = t;
    loop {
        let p = &g.nodes[g.tensor(t).producer.index()];
        match &p.op {
            Op::Parameter { .. } => return Some(t),
            Op::Cast(_) | Op::Reshape(_) | Op::Permute(_) if p.inputs.len() == 1 => t = p.inputs[0],
            _ => return None,
        }
    }
}

/// The parameters embedding lookups read as their tables.
fn embedding_tables(g: &Graph) -> Vec<tessera_ir::TensorId> {
    g.nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Embedding { .. }))
        .filter_map(|n| weight_param(g, n.inputs[0]))
        .collect()
}
