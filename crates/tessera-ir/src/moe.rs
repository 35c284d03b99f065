//! Mixture-of-experts graphs built from the routing ops ([`crate::ops::moe`]): the router
//! (softmax or sigmoid scores, optional selection bias, optional group-limited top-k,
//! renormalisation, scaling), the routed SwiGLU experts (dispatch → batched matmuls over the
//! expert dim → weighted combine), the load-balancing auxiliary loss as transformers
//! computes it, and DeepSeek-V3's auxiliary-loss-free bias update. Model families call these.
//!
//! Which router each family is (`transformers` semantics):
//!
//! | family | scoring | bias | groups | normalise | scaling |
//! |---|---|---|---|---|---|
//! | Mixtral | softmax over all experts | — | — | yes (no ε) | 1 |
//! | Qwen2-MoE / Qwen3-MoE | softmax | — | — | `norm_topk_prob` (no ε) | 1 |
//! | DeepSeek-V3 | sigmoid | `e_score_correction_bias`, selection only | `n_group`, `topk_group` | `norm_topk_prob` (ε = 1e-20) | `routed_scaling_factor` |
//!
//! Scores are computed in f32 or wider (a half-precision logit is cast first, as transformers'
//! `softmax(…, dtype=float)` does); the weights are cast back to the logits' dtype.

use crate::{Builder, DType, IrError, Op, ReduceOp, Result, TensorId, UnaryOp};

pub use crate::ops::moe::capacity;

/// How the router turns logits into per-expert scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// Softmax over all experts (Mixtral, Qwen-MoE).
    Softmax,
    /// An independent sigmoid per expert (DeepSeek-V3).
    Sigmoid,
}

/// A router: see the module's table for each family's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterSpec {
    pub experts: usize,
    pub top_k: usize,
    pub scoring: Scoring,
    /// Group-limited top-k: `(n_group, topk_group)`. Each group's score is the sum of its two
    /// best (biased) scores; experts outside the `topk_group` best groups are never chosen
    /// while `top_k` experts remain in the kept groups (transformers 5's
    /// `masked_fill(…, -inf)`; 4.x filled 0, which a negative correction bias can tell apart).
    pub groups: Option<(usize, usize)>,
    /// Renormalise the chosen scores to sum to one, dividing by `sum + ε`; `None` keeps them.
    pub normalize: Option<f64>,
    /// Multiplies the weights (`routed_scaling_factor`; 1 elsewhere).
    pub scaling: f64,
}

impl RouterSpec {
    /// Mixtral: softmax, top-k, renormalised.
    pub fn mixtral(experts: usize, top_k: usize) -> RouterSpec {
        RouterSpec {
            experts,
            top_k,
            scoring: Scoring::Softmax,
            groups: None,
            normalize: Some(0.0),
            scaling: 1.0,
        }
    }

    /// Qwen2-MoE / Qwen3-MoE: softmax, top-k, renormalised iff `norm_topk_prob`.
    pub fn qwen_moe(experts: usize, top_k: usize, norm_topk_prob: bool) -> RouterSpec {
        RouterSpec {
            normalize: norm_topk_prob.then_some(0.0),
            ..RouterSpec::mixtral(experts, top_k)
        }
    }

    /// DeepSeek-V3: sigmoid scores, a selection bias, group-limited top-k, weights normalised
    /// (`norm_topk_prob`) and scaled.
    pub fn deepseek_v3(
        experts: usize,
        top_k: usize,
        groups: (usize, usize),
        norm_topk_prob: bool,
        routed_scaling_factor: f64,
    ) -> RouterSpec {
        RouterSpec {
            experts,
            top_k,
            scoring: Scoring::Sigmoid,
            groups: Some(groups),
            normalize: norm_topk_prob.then_some(1e-20),
            scaling: routed_scaling_factor,
        }
    }
}

/// What a router gives a layer (`..`: the logits' leading dims, e.g. `[N]` or `[G, n]`).
#[derive(Clone, Copy, Debug)]
pub struct Routing {
    /// `[.., E]`, f32 (f64 for f64 logits): the softmax or sigmoid scores (unbiased).
    pub scores: TensorId,
    /// `[.., k]` i64: each token's experts, best first.
    pub indices: TensorId,
    /// `[.., k]` in the logits' dtype: each choice's weight in the combine.
    pub weights: TensorId,
}

impl Builder {
    /// `[.., n]` → (values, i64 indices) `[.., k]`: see [`Op::TopK`].
    pub fn top_k(&mut self, x: TensorId, k: usize) -> Result<(TensorId, TensorId)> {
        let out = self.push(Op::TopK { k }, &[x])?;
        Ok((out[0], out[1]))
    }
    pub fn take_along(&mut self, x: TensorId, indices: TensorId) -> Result<TensorId> {
        self.push1(Op::TakeAlong, &[x, indices])
    }
    pub fn scatter_along(
        &mut self,
        indices: TensorId,
        src: TensorId,
        size: usize,
    ) -> Result<TensorId> {
        self.push1(Op::ScatterAlong { size }, &[indices, src])
    }
    pub fn moe_slots(
        &mut self,
        indices: TensorId,
        experts: usize,
        capacity: usize,
    ) -> Result<TensorId> {
        self.push1(Op::MoeSlots { experts, capacity }, &[indices])
    }
    /// `[N, H]` → `[E, C, H]` (unweighted).
    pub fn moe_dispatch(
        &mut self,
        x: TensorId,
        slots: TensorId,
        experts: usize,
        capacity: usize,
    ) -> Result<TensorId> {
        self.push1(Op::MoeDispatch { experts, capacity }, &[x, slots])
    }
    /// `[E, C, H]` → `[N, H]`, weighted by `weights [N, k]`.
    pub fn moe_combine(
        &mut self,
        y: TensorId,
        slots: TensorId,
        weights: TensorId,
    ) -> Result<TensorId> {
        self.push1(Op::MoeCombine, &[y, slots, weights])
    }
    /// Per-row counts of `indices [.., k]` over `size` classes (one-hot summed).
    pub fn one_hot_counts(
        &mut self,
        indices: TensorId,
        size: usize,
        dtype: DType,
    ) -> Result<TensorId> {
        let ones = self.fill(1.0, self.shape(indices).clone(), dtype)?;
        self.scatter_along(indices, ones, size)
    }
}

/// Half-precision values cast to f32 (f32 and f64 stay).
fn to_f32(b: &mut Builder, x: TensorId) -> Result<TensorId> {
    if matches!(b.dtype(x), DType::BF16 | DType::F16) {
        b.cast(x, DType::F32)
    } else {
        Ok(x)
    }
}

/// `logits [.., E]` (a token per row) → the routing. `bias [E]` (f32) is DeepSeek-V3's
/// `e_score_correction_bias`: added to the scores for choosing only, never to the weights.
pub fn route(
    b: &mut Builder,
    logits: TensorId,
    spec: &RouterSpec,
    bias: Option<TensorId>,
) -> Result<Routing> {
    let (e, rank) = (b.shape(logits).last(), b.shape(logits).rank());
    if rank < 2 {
        return Err(IrError::Graph(format!(
            "router logits {} must be [.., tokens, experts]",
            b.meta(logits)
        )));
    }
    if e != spec.experts {
        return Err(IrError::Graph(format!(
            "router logits have {e} experts, the spec {}",
            spec.experts
        )));
    }
    let dtype = b.dtype(logits);
    let l32 = to_f32(b, logits)?;
    let scores = match spec.scoring {
        Scoring::Softmax => b.softmax(l32)?,
        Scoring::Sigmoid => b.unary(UnaryOp::Sigmoid, l32)?,
    };
    let mut choice = match bias {
        Some(bias) => b.add(scores, bias)?,
        None => scores,
    };
    if let Some((groups, keep)) = spec.groups {
        choice = limit_to_groups(b, choice, groups, keep)?;
    }
    let (_, indices) = b.top_k(choice, spec.top_k)?;
    let mut weights = b.take_along(scores, indices)?;
    if let Some(eps) = spec.normalize {
        let sum = b.reduce(ReduceOp::Sum, weights, &[rank - 1], true)?;
        let sum = if eps == 0.0 {
            sum
        } else {
            let eps = b.scalar_like(eps, sum)?;
            b.add(sum, eps)?
        };
        weights = b.div(weights, sum)?;
    }
    if spec.scaling != 1.0 {
        weights = b.scale(weights, spec.scaling)?;
    }
    if b.dtype(weights) != dtype {
        weights = b.cast(weights, dtype)?;
    }
    Ok(Routing { scores, indices, weights })
}

/// Choice scores `[.., N, E]` with every expert outside each token's `keep` best groups
/// lowered by [`GROUP_MASK_PENALTY`] (kept scores unchanged, exactly); a group's score is the
/// sum of its two best experts' (DeepSeek-V3's `n_group` / `topk_group`). Leading (routing
/// group) dims are flattened into the tokens and restored.
fn limit_to_groups(
    b: &mut Builder,
    choice: TensorId,
    groups: usize,
    keep: usize,
) -> Result<TensorId> {
    let dims = b.shape(choice).dims().to_vec();
    if dims.len() > 2 {
        let (tokens, e) = (dims[..dims.len() - 1].iter().product::<usize>(), dims[dims.len() - 1]);
        let flat = b.reshape(choice, [tokens, e])?;
        let limited = limit_to_groups(b, flat, groups, keep)?;
        return b.reshape(limited, dims);
    }
    let &[n, e] = dims.as_slice() else {
        return Err(IrError::Graph("choice scores must be [tokens, experts]".into()));
    };
    if groups == 0 || e % groups != 0 || keep == 0 || keep > groups || e / groups < 2 {
        return Err(IrError::Graph(format!(
            "group-limited routing needs n_group ({groups}) to divide the {e} experts into \
             groups of at least 2, and 1 ≤ topk_group ({keep}) ≤ n_group"
        )));
    }
    let per = e / groups;
    let grouped = b.reshape(choice, [n, groups, per])?;
    let (best2, _) = b.top_k(grouped, 2)?;
    let group_scores = b.reduce(ReduceOp::Sum, best2, &[2], false)?;
    let (_, group_idx) = b.top_k(group_scores, keep)?;
    let dtype = b.dtype(choice);
    let mask = b.one_hot_counts(group_idx, groups, dtype)?;
    let mask = b.reshape(mask, [n, groups, 1])?;
    let mask = b.expand(mask, [n, groups, per])?;
    let mask = b.reshape(mask, [n, e])?;
    // (mask − 1)·P is 0 for a kept expert and −P for the others: transformers' −inf without
    // the 0·∞ of a multiplied mask.
    let one = b.scalar_like(1.0, mask)?;
    let off = b.sub(mask, one)?;
    let penalty = b.scale(off, GROUP_MASK_PENALTY)?;
    b.add(choice, penalty)
}

/// The scope segment under which a block's stacked expert parameters are named:
/// `<block>.experts.<proj>.weight`, dim 0 the expert.
pub const EXPERTS_SCOPE: &str = "experts";

/// The Hub's name of expert `expert`'s slice (row `expert` of dim 0) of the stacked expert
/// parameter `stacked`: `<block>.experts.<rest>` → `<block>.experts.<expert>.<rest>` (the last
/// `experts` segment followed by a non-index one). `None` when `stacked` is not so named.
///
/// The stacked layout is what the graph holds (`[E, out, in]`, one parameter per projection);
/// the per-expert one is what checkpoints hold (`block_sparse_moe.experts.N.w1.weight`,
/// `mlp.experts.N.gate_proj.weight`). Loaders and writers map one to the other with this and
/// [`stacked_expert_name`].
pub fn per_expert_name(stacked: &str, expert: usize) -> Option<String> {
    let segs: Vec<&str> = stacked.split('.').collect();
    let at = segs.iter().rposition(|s| *s == EXPERTS_SCOPE)?;
    let next = segs.get(at + 1)?;
    if next.is_empty() || next.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let (head, tail) = segs.split_at(at + 1);
    Some(format!("{}.{expert}.{}", head.join("."), tail.join(".")))
}

/// The inverse of [`per_expert_name`]: `<block>.experts.<N>.<rest>` → (the stacked parameter
/// `<block>.experts.<rest>`, `N`). `None` when `name` has no such index segment.
pub fn stacked_expert_name(name: &str) -> Option<(String, usize)> {
    let segs: Vec<&str> = name.split('.').collect();
    let at = segs.iter().rposition(|s| *s == EXPERTS_SCOPE)?;
    let index = segs.get(at + 1)?;
    if index.is_empty() || !index.bytes().all(|c| c.is_ascii_digit()) || segs.len() < at + 3 {
        return None;
    }
    let expert = index.parse().ok()?;
    let mut rest = segs[..=at].to_vec();
    rest.extend_from_slice(&segs[at + 2..]);
    Some((rest.join("."), expert))
}
/// What group-limited routing subtracts from the choice score of an expert outside the kept
/// groups: far below any sigmoid score plus correction bias, and finite in f32.
pub const GROUP_MASK_PENALTY: f64 = 1e30;

/// Stacked SwiGLU expert weights: `gate`, `up` `[E, H, F]`, `down` `[E, F, H]`; or, with
/// `linear_layout`, as `nn.Linear` stores them (out × in: `gate`, `up` `[E, F, H]`, `down`
/// `[E, H, F]`), read transposed by the matmuls (no copy). Dim 0 is the expert (of all `E`,
/// or of a device's share when the caller splits it); models hold them as parameters named
/// under [`EXPERTS_SCOPE`].
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights {
    pub gate: TensorId,
    pub up: TensorId,
    pub down: TensorId,
    pub linear_layout: bool,
}

/// The routed experts on `x [G, n, H]` routed by `routing` (`[G, n, k]`; `x [N, H]` is one
/// group): `G` routing groups of `n` tokens each (GShard's groups; see [`crate::ops::moe`]'s
/// capacity), each dispatched into its own `[E, capacity, H]` buffer; the groups' buffers are
/// laid out expert-major (`[E, G·capacity, H]`, a permute) for the three batched matmuls over
/// the expert dim, and back for the weighted combine to `[G, n, H]`. Assignments past an
/// expert's capacity in their group are dropped; `capacity = n` is dropless. `E` is
/// `w.gate`'s dim 0 and must be the router's expert count; `routing.indices` index it.
///
/// The permutes are where expert parallelism moves tokens: before them a plan splits the
/// groups (the tokens' batch), after them the experts, so the reshard between is an
/// all-to-all whose size is the capacity's.
pub fn routed_experts(
    b: &mut Builder,
    x: TensorId,
    routing: &Routing,
    w: &ExpertWeights,
    capacity: usize,
) -> Result<TensorId> {
    if let &[n, h] = b.shape(x).dims() {
        // One group: `[N, H]` routed by `[N, k]`.
        let k = b.shape(routing.indices).last();
        let one = Routing {
            scores: routing.scores,
            indices: b.reshape(routing.indices, [1, n, k])?,
            weights: b.reshape(routing.weights, [1, n, k])?,
        };
        let x = b.reshape(x, [1, n, h])?;
        let y = routed_experts(b, x, &one, w, capacity)?;
        return b.reshape(y, [n, h]);
    }
    let &[groups, _, h] = b.shape(x).dims() else {
        return Err(IrError::Graph(format!("routed tokens {} must be [G, n, H]", b.meta(x))));
    };
    let experts = b.shape(w.gate).dim(0);
    let slots = b.moe_slots(routing.indices, experts, capacity)?;
    let buf = b.moe_dispatch(x, slots, experts, capacity)?;
    let buf = b.permute(buf, &[1, 0, 2, 3])?;
    let buf = b.reshape(buf, [experts, groups * capacity, h])?;
    let t = w.linear_layout;
    let g = b.matmul(buf, w.gate, false, t)?;
    let u = b.matmul(buf, w.up, false, t)?;
    let g = b.unary(UnaryOp::Silu, g)?;
    let a = b.mul(g, u)?;
    let y = b.matmul(a, w.down, false, t)?;
    let y = b.reshape(y, [experts, groups, capacity, h])?;
    let y = b.permute(y, &[1, 0, 2, 3])?;
    b.moe_combine(y, slots, routing.weights)
}

/// transformers' `load_balancing_loss_func` (no attention mask): the router logits of every
/// layer `[N, E]` are stacked along the tokens, `p = softmax` in f32, each token's top-k
/// experts counted, and the loss is `E · Σ_e f_e · P_e` with `f_e` the number of choices of
/// `e` per token and `P_e` the mean of `p[:, e]` — a scalar f32, to be multiplied by
/// `router_aux_loss_coef` and added to the loss. Only `P` carries gradient.
pub fn load_balancing_loss(b: &mut Builder, logits: &[TensorId], top_k: usize) -> Result<TensorId> {
    let Some(&first) = logits.first() else {
        return Err(IrError::Graph("load-balancing loss of no router logits".into()));
    };
    let e = b.shape(first).last();
    let all = if logits.len() == 1 { first } else { b.concat(logits, 0)? };
    let all = to_f32(b, all)?;
    let p = b.softmax(all)?;
    let (_, idx) = b.top_k(p, top_k)?;
    let dtype = b.dtype(p);
    let counts = b.one_hot_counts(idx, e, dtype)?;
    let f = b.reduce(ReduceOp::Mean, counts, &[0], false)?;
    let pm = b.reduce(ReduceOp::Mean, p, &[0], false)?;
    let fp = b.mul(f, pm)?;
    let s = b.reduce(ReduceOp::Sum, fp, &[0], false)?;
    b.scale(s, e as f64)
}

/// DeepSeek-V3's auxiliary-loss-free balancing: `bias' = bias + γ·sign(mean load − load_e)`,
/// `load_e` the assignments to expert `e` among `indices [N, k]` (a busy expert's bias falls,
/// an idle one's rises). The sign is exact: `E·(mean − load_e) = N·k − E·load_e` is a whole
/// number, clamped to `[−1, 1]`. A graph output for the trainer to write back as the next
/// step's bias (not a parameter: no gradient, no optimizer).
pub fn bias_update(
    b: &mut Builder,
    bias: TensorId,
    indices: TensorId,
    gamma: f64,
) -> Result<TensorId> {
    let e = b.shape(bias).dim(0);
    let dtype = b.dtype(bias);
    let counts = b.one_hot_counts(indices, e, dtype)?;
    let load = b.reduce(ReduceOp::Sum, counts, &[0], false)?;
    let total = b.reduce(ReduceOp::Sum, load, &[0], true)?;
    let scaled = b.scale(load, e as f64)?;
    let d = b.sub(total, scaled)?;
    let lo = b.scalar_like(-1.0, d)?;
    let hi = b.scalar_like(1.0, d)?;
    let d = b.binary(crate::BinaryOp::Max, d, lo)?;
    let sign = b.binary(crate::BinaryOp::Min, d, hi)?;
    let step = b.scale(sign, gamma)?;
    b.add(bias, step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_expert_names_map_to_and_from_the_stacked_parameter() {
        for (stacked, hub) in [
            (
                "model.layers.3.block_sparse_moe.experts.w1.weight",
                "model.layers.3.block_sparse_moe.experts.7.w1.weight",
            ),
            (
                "model.layers.0.mlp.experts.down_proj.weight",
                "model.layers.0.mlp.experts.7.down_proj.weight",
            ),
        ] {
            assert_eq!(per_expert_name(stacked, 7).as_deref(), Some(hub));
            assert_eq!(stacked_expert_name(hub), Some((stacked.to_string(), 7)));
        }
        // Not stacked experts: a per-expert name, shared experts, plain parameters.
        for name in [
            "model.layers.0.mlp.experts.7.down_proj.weight",
            "model.layers.0.mlp.shared_experts.gate_proj.weight",
            "model.layers.0.mlp.shared_expert.gate_proj.weight",
            "model.layers.0.mlp.experts",
            "model.embed_tokens.weight",
        ] {
            assert_eq!(per_expert_name(name, 0), None, "{name}");
        }
        for name in [
            "model.layers.0.mlp.experts.down_proj.weight",
            "model.layers.0.mlp.shared_experts.0.weight",
            "model.layers.0.mlp.experts.3",
        ] {
            assert_eq!(stacked_expert_name(name), None, "{name}");
        }
    }
}
