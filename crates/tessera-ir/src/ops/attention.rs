//! Fused attention (causal or not, sliding window, GQA) and rotary position embeddings.
//!
//! Attention saves its output and a per-row log-sum-exp `[B,H,S]`; the backward recomputes
//! the probabilities from them, FlashAttention-style, so no S×T matrix outlives a kernel. The
//! kernel may hold the f32 scores of at most [`ATTENTION_SCRATCH_ROWS`] query rows (all of
//! one head's S×T block when S is shorter) as workspace while it runs.

use super::{expect_float, expect_inputs, Flops, Op};
use crate::autodiff::{Grad, VjpCtx};
use crate::{DType, Result, TensorMeta};
use serde::{Deserialize, Serialize};

/// (B, S, H, D) of a `[B,S,H,D]` operand.
fn bshd(m: &TensorMeta, what: &str) -> Result<(usize, usize, usize, usize), String> {
    match m.shape.dims() {
        &[b, s, h, d] => Ok((b, s, h, d)),
        _ => Err(format!("{what} {m} must be [batch, seq, heads, head_dim]")),
    }
}

pub(crate) fn infer(x: &[&TensorMeta], spec: &AttentionSpec) -> Result<Vec<TensorMeta>, String> {
    if x.len() == 4 {
        if spec.ring.is_some() {
            return Err("ring attention over a KV cache (a start input) is not defined".into());
        }
        super::expect_int(x[3], "start")?;
        let b = x[0].shape.dims().first().copied().unwrap_or(0);
        if x[3].shape.dims() != [b] {
            return Err(format!("start {} must be [batch] = [{b}]", x[3]));
        }
        return infer(&x[..3], spec);
    }
    expect_inputs(x, 3)?;
    expect_float(x[0], "q")?;
    let (b, s, h, d) = bshd(x[0], "q")?;
    let (bk, t, hk, dk) = bshd(x[1], "k")?;
    if let Some(r) = &spec.ring {
        if r.size == 0 || r.step >= r.size || (r.zigzag && (s % 2 != 0 || t % 2 != 0)) {
            return Err(format!(
                "ring block {r:?} does not fit q {} and k {} (zig-zag halves need even lengths)",
                x[0], x[1]
            ));
        }
    }
    if x[2] != x[1] {
        return Err(format!("v {} must match k {}", x[2], x[1]));
    }
    if x[1].dtype != x[0].dtype {
        return Err(format!("q {} and k {} dtypes differ", x[0], x[1]));
    }
    if bk != b || dk != d {
        return Err(format!("k {} must share batch and head_dim with q {}", x[1], x[0]));
    }
    match &spec.kv_whole {
        None if hk == 0 || h % hk != 0 => {
            return Err(format!("query heads {h} must be a multiple of key/value heads {hk}"));
        }
        // Some of the model's query heads against all its KV heads: checked against the
        // global head count (where the local heads sit needs the device).
        Some(q) if q.global.get(2).is_none_or(|&g| hk == 0 || g % hk != 0 || h > g) => {
            return Err(format!(
                "query heads {h} (of {:?}) do not group onto key/value heads {hk}",
                q.global
            ));
        }
        _ => {}
    }
    let _ = t;
    Ok(vec![x[0].clone(), TensorMeta::new([b, h, s], DType::F32)])
}

pub(crate) fn infer_backward(
    x: &[&TensorMeta],
    spec: &AttentionSpec,
) -> Result<Vec<TensorMeta>, String> {
    if x.len() != 7 {
        expect_inputs(x, 6)?;
    }
    let fwd = infer(&x[..3], spec)?;
    if x[3] != &fwd[0] || x[5].shape != fwd[0].shape || x[4] != &fwd[1] {
        return Err("out, logsumexp and dout must match the forward's outputs".into());
    }
    if x.get(6).is_some_and(|&dlse| dlse != &fwd[1]) {
        return Err(format!("dlogsumexp {} must match logsumexp {}", x[6], fwd[1]));
    }
    let g = |m: &TensorMeta| TensorMeta { shape: m.shape.clone(), dtype: x[5].dtype };
    Ok(vec![g(x[0]), g(x[1]), g(x[2])])
}

/// (B·H·S·T·D, B·H·S·T) — the dense product volume and the score count.
fn volume(x: &[&TensorMeta]) -> (u64, u64) {
    let d = x[0].shape.dims();
    let t = x[1].shape.dim(1) as u64;
    let scores = d[0] as u64 * d[2] as u64 * d[1] as u64 * t;
    (scores * d[3] as u64, scores)
}

/// QK^T and AV: 2·(2·B·H·S·T·D) as dense matmuls; the softmax on the scores is "other".
pub(crate) fn flops(x: &[&TensorMeta]) -> Flops {
    let (v, scores) = volume(x);
    Flops { matmul: 4 * v, other: 5 * scores }
}

/// By convention twice the forward's matmul FLOPs (dQ, dK, dV, dP), plus the softmax backward.
pub(crate) fn flops_backward(x: &[&TensorMeta]) -> Flops {
    let (v, scores) = volume(x);
    Flops { matmul: 8 * v, other: 4 * scores }
}

/// Query rows whose f32 scores (× every key T) an attention kernel holds at once: the
/// declared workspace of `Attention` and `AttentionBackward` is `min(S, this) × T × 4` bytes.
///
/// One head's whole S×T block grows quadratically (256 GiB at 256K tokens) although a
/// blocked kernel never needs it: the CPU kernels run their query blocks in at most
/// `this / rows-per-block` concurrent lanes, so their scratch stays within the bound whatever
/// the thread count, and FlashAttention holds no score block at all. 4096 keeps every plan
/// with S ≤ 4096 exactly as it was (there the bound is the whole block).
pub const ATTENTION_SCRATCH_ROWS: usize = 4096;

/// The f32 scores of `min(S, ATTENTION_SCRATCH_ROWS)` query rows against all T keys (the
/// backward's two buffers, P and dP, are half as many rows each).
pub(crate) fn workspace_bytes(x: &[&TensorMeta]) -> u64 {
    let s = x[0].shape.dim(1).min(ATTENTION_SCRATCH_ROWS) as u64;
    let t = x[1].shape.dim(1) as u64;
    s * t * DType::F32.size_bytes()
}

pub(crate) fn vjp(cx: &mut VjpCtx<'_>, spec: &AttentionSpec) -> Result<Vec<Option<Grad>>> {
    if cx.node_inputs() == 4 {
        return Err(crate::IrError::Graph(
            "attention over a KV cache (with a start input) is inference only".into(),
        ));
    }
    let dout = cx.dy(0)?;
    let mut x = vec![cx.x(0), cx.x(1), cx.x(2), cx.y(0), cx.y(1), dout];
    // A log-sum-exp that something read (ring attention's merge): its cotangent too.
    if cx.dout[1].is_some() {
        x.push(cx.dy(1)?);
    }
    let g = cx.b.push(Op::AttentionBackward(spec.clone()), &x)?;
    Ok(g.into_iter().map(|t| Some(Grad::Full(t))).collect())
}

/// `[o_0, lse_0, o_1, lse_1, …]` → the (o, lse) pairs, checked alike.
fn merge_pairs<'a>(x: &[&'a TensorMeta]) -> Result<Vec<(&'a TensorMeta, &'a TensorMeta)>, String> {
    if x.len() < 2 || !x.len().is_multiple_of(2) {
        return Err(format!(
            "attention_merge takes (out, logsumexp) pairs, got {} inputs",
            x.len()
        ));
    }
    let pairs: Vec<_> = x.chunks(2).map(|p| (p[0], p[1])).collect();
    let (o, l) = pairs[0];
    expect_float(o, "out")?;
    let (b, s, h, _) = bshd(o, "out")?;
    let want = TensorMeta::new([b, h, s], DType::F32);
    for &(oi, li) in &pairs {
        if oi != o || li != &want || l != &want {
            return Err(format!(
                "attention_merge: every out must be {o} and every logsumexp {want} (got {oi}, {li})"
            ));
        }
    }
    Ok(pairs)
}

/// [`Op::AttentionMerge`]: the partial outputs' merge has their shape.
pub(crate) fn infer_merge(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    Ok(vec![merge_pairs(x)?[0].0.clone()])
}

/// [`Op::AttentionMergeBackward`]: `[pairs…, dout]` → a gradient per pair member.
pub(crate) fn infer_merge_backward(x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
    let (last, pairs) = x.split_last().ok_or("attention_merge_backward takes inputs")?;
    let pairs = merge_pairs(pairs)?;
    if last.shape != pairs[0].0.shape {
        return Err(format!("dout {last} must match out {}", pairs[0].0));
    }
    let d = TensorMeta { shape: last.shape.clone(), dtype: last.dtype };
    Ok(pairs.iter().flat_map(|(_, l)| [d.clone(), (*l).clone()]).collect())
}

/// Per output element and pair: a weight and a multiply-add (forward); a dot, two products
/// (backward).
pub(crate) fn flops_merge(x: &[&TensorMeta], backward: bool) -> Flops {
    let pairs = (x.len() / 2) as u64;
    let numel = x.first().map_or(0, |o| o.numel());
    Flops::other(if backward { 4 } else { 2 } * pairs * numel)
}

/// The merge's gradient: every pair's (see [`Op::AttentionMergeBackward`]).
pub(crate) fn vjp_merge(cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Grad>>> {
    let dout = cx.dy(0)?;
    let mut x: Vec<_> = (0..cx.node_inputs()).map(|i| cx.x(i)).collect();
    x.push(dout);
    let g = cx.b.push(Op::AttentionMergeBackward, &x)?;
    Ok(g.into_iter().map(|t| Some(Grad::Full(t))).collect())
}

pub(crate) fn infer_rope(x: &[&TensorMeta], inv_freq: &[f64]) -> Result<Vec<TensorMeta>, String> {
    if x.len() == 2 {
        super::expect_int(x[1], "positions")?;
        let d = x[0].shape.dims();
        if d.len() < 2 || x[1].shape.dims() != &d[..2] {
            return Err(format!("positions {} must be [batch, seq] of x {}", x[1], x[0]));
        }
        return infer_rope(&x[..1], inv_freq);
    }
    expect_inputs(x, 1)?;
    expect_float(x[0], "x")?;
    let (_, _, _, d) = bshd(x[0], "x")?;
    if d % 2 != 0 || inv_freq.len() != d / 2 {
        return Err(format!(
            "head_dim {d} must be even with one frequency per pair ({} given)",
            inv_freq.len()
        ));
    }
    Ok(vec![x[0].clone()])
}

/// x·cos + rotate_half(x)·sin.
pub(crate) fn flops_rope(y: &[&TensorMeta]) -> Flops {
    Flops::other(3 * y[0].numel())
}

pub(crate) fn vjp_rope(
    cx: &mut VjpCtx<'_>,
    inv_freq: &[f64],
    inverse: bool,
) -> Result<Vec<Option<Grad>>> {
    let dy = cx.dy(0)?;
    // A rotation's transpose is the rotation by −θ (at the same positions).
    let op = Op::Rope { inv_freq: inv_freq.to_vec(), inverse: !inverse };
    if cx.node_inputs() == 2 {
        let g = cx.b.push1(op, &[dy, cx.x(1)])?;
        return Ok(vec![Some(Grad::Full(g)), None]);
    }
    let g = cx.b.push1(op, &[dy])?;
    Ok(vec![Some(Grad::Full(g))])
}

/// Hyper-parameters of the attention op.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionSpec {
    pub causal: bool,
    /// Sliding window (Mistral): query i sees keys in (i - window, i].
    pub window: Option<usize>,
    /// Multiplier of QK^T, usually 1/sqrt(head_dim).
    pub scale: f64,
    /// ALiBi position biases (BLOOM; Press et al. 2022): head `h`'s score of key `j` for the
    /// query at position `p` gains `slope_h · (j − p)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alibi: Option<Alibi>,
    /// Tensor parallelism past the KV heads (more devices on the tensor axis than KV heads):
    /// q holds some of the model's query heads and k/v hold every KV head, so each local
    /// head reads the KV head of its global index. Set by the planner's lowering: where the
    /// local q `[B,S,H,D]` sits in the global one. `None`: q's heads map onto k's as
    /// grouped-query attention does (`h / (H/Hkv)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_whole: Option<crate::dist::ShardOf>,
    /// Ring attention (context parallelism, `cp=ring`): q holds this device's part of the
    /// sequence and k/v the part of the device `step` places before it on the ring, at their
    /// global positions (set by the planner's lowering). `None`: q and k are whole sequences.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ring: Option<RingBlock>,
}

/// Where a device's rows sit in the global sequence under ring attention, and which device's
/// keys an attention reads. The sequence of `size · len` tokens is cut into chunks: with
/// `zigzag` false, `size` chunks and the device at cp coordinate `c` holds chunk `c`; with
/// `zigzag`, `2 · size` chunks and it holds chunks `c` and `2·size − 1 − c` (in that order),
/// so every device has as many early as late tokens and causal masking leaves each the same
/// work. Local positions increase with the local index either way, so a causal or
/// sliding-window mask leaves each query a contiguous range of local keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RingBlock {
    /// The cp mesh axis.
    pub axis: usize,
    /// Devices on the ring (the axis' size).
    pub size: usize,
    /// The keys are those of the device at coordinate `(c − step) mod size`.
    pub step: usize,
    pub zigzag: bool,
}

impl RingBlock {
    /// The global positions of the `len` local rows of the device at cp coordinate `c`.
    pub fn positions_of(&self, len: usize, c: usize) -> Vec<i64> {
        if !self.zigzag {
            return (0..len).map(|i| (c * len + i) as i64).collect();
        }
        let half = len / 2;
        let second = 2 * self.size - 1 - c;
        (0..len)
            .map(|i| if i < half { c * half + i } else { second * half + i - half } as i64)
            .collect()
    }

    /// This device's cp coordinate (`None`: the mesh origin's, 0).
    pub fn coord(&self, at: Option<&crate::dist::MeshPos>) -> usize {
        at.and_then(|a| a.coords.get(self.axis).copied()).unwrap_or(0) % self.size.max(1)
    }

    /// The global positions of the device's `s` queries and of the `t` keys it reads.
    pub fn positions(
        &self,
        s: usize,
        t: usize,
        at: Option<&crate::dist::MeshPos>,
    ) -> (Vec<i64>, Vec<i64>) {
        let c = self.coord(at);
        let n = self.size.max(1);
        let src = (c + n - self.step % n) % n;
        (self.positions_of(s, c), self.positions_of(t, src))
    }
}

impl AttentionSpec {
    /// Causal attention scaled by `1/sqrt(head_dim)`, no window, no position bias.
    pub fn causal(head_dim: usize) -> AttentionSpec {
        AttentionSpec {
            causal: true,
            window: None,
            scale: 1.0 / (head_dim as f64).sqrt(),
            alibi: None,
            kv_whole: None,
            ring: None,
        }
    }

    /// The (query, key) pairs this attention's mask leaves visible for `s` queries against
    /// `t` keys on the device at `at` (per batch row and head): the scores a blocked kernel
    /// computes, up to its block edges. Under ring attention it measures the balance of the
    /// work between the devices (zig-zag chunks give each the same).
    pub fn visible_pairs(&self, s: usize, t: usize, at: Option<&crate::dist::MeshPos>) -> u64 {
        let (qp, kp): (Vec<i64>, Vec<i64>) = match &self.ring {
            Some(r) => r.positions(s, t, at),
            None => ((0..s).map(|i| (i + t - s.min(t)) as i64).collect(), (0..t as i64).collect()),
        };
        let before = |p: i64| kp.partition_point(|&x| x < p) as u64;
        qp.iter()
            .map(|&p| {
                let hi = if self.causal { before(p + 1) } else { t as u64 };
                let lo = self.window.map_or(0, |w| before(p - w as i64 + 1));
                hi.saturating_sub(lo)
            })
            .sum()
    }

    /// For each of the `heads` local query heads, the local KV head (of `kv_heads`) it reads,
    /// on the device at `at` (`None`: the mesh origin). Errs when the heads do not group.
    pub fn kv_heads_of(
        &self,
        heads: usize,
        kv_heads: usize,
        at: Option<&crate::dist::MeshPos>,
    ) -> Result<Vec<usize>> {
        let bad = |why: String| crate::IrError::Graph(why);
        let (first, global) = match &self.kv_whole {
            None => (0, heads),
            Some(s) => {
                let global = s.global.get(2).copied().ok_or_else(|| {
                    bad(format!("attention's q shard {:?} is not [B,S,H,D]", s.global))
                })?;
                let first = match at {
                    Some(at) => at.shard_origin(&s.global, &s.placement)?[2],
                    None => 0,
                };
                (first, global)
            }
        };
        if kv_heads == 0 || !global.is_multiple_of(kv_heads) || first + heads > global {
            return Err(bad(format!(
                "query heads {first}..{} of {global} do not group onto {kv_heads} key/value \
                 heads (the query heads must be a multiple of the key/value heads)",
                first + heads
            )));
        }
        let group = global / kv_heads;
        Ok((first..first + heads).map(|h| h / group).collect())
    }
}

/// ALiBi's per-head slopes: a function of the model's query-head count. Under tensor
/// parallelism a device holds some of the heads; `shard` (set by the planner's lowering, as
/// for dropout) says which, so each device biases its heads with their own slopes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Alibi {
    /// Query heads of the whole model.
    pub heads: usize,
    /// Where the local q `[B,S,H,D]` sits in the global one (`None`: it is the global one).
    #[serde(default)]
    pub shard: Option<crate::dist::ShardOf>,
}

impl Alibi {
    /// The slope of every head of the model, as BLOOM defines them (`build_alibi_tensor` in
    /// transformers): `2^(-8i/n)` for `i = 1..=n` when `n` is a power of two; otherwise those
    /// of the largest power of two `m < n`, then the odd powers of `2^(-4/m)` for the rest.
    pub fn slopes(heads: usize) -> Vec<f64> {
        if heads == 0 {
            return Vec::new();
        }
        let m = 1usize << (usize::BITS - 1 - heads.leading_zeros());
        let base = 2f64.powf(-8.0 / m as f64);
        let mut s: Vec<f64> = (1..=m).map(|i| base.powi(i as i32)).collect();
        if m != heads {
            let extra = 2f64.powf(-4.0 / m as f64);
            let rest = (heads - m).min(m);
            s.extend((0..rest).map(|i| extra.powi(2 * i as i32 + 1)));
        }
        s
    }

    /// The slopes of the local heads of a device at `at` (`None`: the mesh origin).
    pub fn local_slopes(
        &self,
        local_heads: usize,
        at: Option<&crate::dist::MeshPos>,
    ) -> crate::Result<Vec<f64>> {
        let first = match (&self.shard, at) {
            (Some(s), Some(at)) => at.shard_origin(&s.global, &s.placement)?.get(2).copied(),
            (None, _) | (Some(_), None) => Some(0),
        }
        .unwrap_or(0);
        let all = Alibi::slopes(self.heads);
        all.get(first..first + local_heads).map(<[f64]>::to_vec).ok_or_else(|| {
            crate::IrError::Graph(format!(
                "ALiBi heads {first}..{} beyond the model's {}",
                first + local_heads,
                self.heads
            ))
        })
    }
}
