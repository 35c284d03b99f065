//! The closed set of primitive ops.
//!
//! Every op family keeps its shape inference, FLOP count and VJP rule in one module below; the
//! dispatch here is by exhaustive `match` (no `_ =>` arm), so adding a variant does not compile
//! until each family function — and, in later crates, the sharding rule and the kernel — exists.
//!
//! Conventions: matmuls count 2·m·n·k FLOPs; fused attention counts its QK^T and AV as dense
//! matmuls (no causal discount) and its backward as twice its forward; a 2-D convolution and
//! each of its two backward ops count `2·N·O·Ho·Wo·(C/g)·kh·kw` (the GEMM they lower to); all
//! of these land in the "matmul" FLOP class, everything else in "other".

pub(crate) mod attention;
pub mod comm;
pub mod elementwise;
pub(crate) mod embedding;
pub(crate) mod infer;
pub(crate) mod layout;
pub(crate) mod leaf;
pub mod linear_loss;
pub(crate) mod loss;
pub(crate) mod matmul;
pub mod moe;
pub(crate) mod norm;
pub(crate) mod optim;
pub(crate) mod quant;
pub(crate) mod reduce;
pub mod ring;
pub mod tiled_mlp;
pub mod vision;

use crate::autodiff::{Grad, VjpCtx};
use crate::{DType, Result, Shape, TensorMeta};
pub use attention::{Alibi, AttentionSpec, RingBlock, ATTENTION_SCRATCH_ROWS};
pub use comm::{Collective, CommStep, P2p, ReshardSpec};
pub use quant::QuantSpec;
pub use ring::{RingBackward, RingMerge};
use serde::{Deserialize, Serialize};
pub use tiled_mlp::MlpSpec;
pub use vision::{Conv2dSpec, Pool2dSpec};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Tanh,
    /// Exact GELU, x·Φ(x) (BERT, ViT).
    Gelu,
    /// GELU with the tanh approximation (GPT-2's `gelu_new`).
    GeluTanh,
    Silu,
    Relu,
    Sigmoid,
    /// sin x (the diffusion models' sinusoidal timestep embedding).
    Sin,
    /// cos x.
    Cos,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
    /// Σ x², used for gradient norms.
    SumSquares,
}

/// Optimizer-owned state tensors; explicit so that memory accounting and ZeRO see them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateKind {
    /// Adam first moment.
    AdamM,
    /// Adam second moment.
    AdamV,
    /// fp32 master copy of a low-precision weight.
    Master,
}

impl StateKind {
    pub const ALL: [StateKind; 3] = [StateKind::AdamM, StateKind::AdamV, StateKind::Master];

    /// The suffix of the state's name (`<param>.<suffix>`, [`crate::dist::state_key`]).
    pub fn suffix(self) -> &'static str {
        match self {
            StateKind::AdamM => "adam_m",
            StateKind::AdamV => "adam_v",
            StateKind::Master => "master",
        }
    }
}

/// Hyper-parameters of AdamW. The learning rate and step arrive as scalar inputs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWSpec {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Clip gradients by global norm to this value (the norm is an input).
    pub max_grad_norm: Option<f64>,
    /// Loss scaling (fp16): the op takes a last input `grad_scale` (an f32 scalar,
    /// 1 / loss_scale) that unscales the gradient and its norm, and skips the update when the
    /// unscaled norm is not finite. See [`Op::AdamW`].
    #[serde(default)]
    pub grad_scale: bool,
}

impl AdamWSpec {
    /// Positions of the optional `master` and `grad_scale` inputs of an AdamW node with
    /// `n_inputs` inputs: `[param, grad, m, v, lr, step, grad_norm, (master), (grad_scale)]`,
    /// `grad_scale` present iff [`AdamWSpec::grad_scale`], and always last.
    pub fn optional_inputs(&self, n_inputs: usize) -> (Option<usize>, Option<usize>) {
        let base = 7;
        let scale = self.grad_scale.then(|| n_inputs.saturating_sub(1));
        let master = (n_inputs == base + 1 + usize::from(self.grad_scale)).then_some(base);
        (master, scale)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    // ---- leaves -------------------------------------------------------------------------
    /// A weight. Its node's scope is its full (Hugging Face) name. A `frozen` one (a LoRA
    /// base, `--freeze`) is read like any other but never trained: autodiff computes no
    /// gradient for it and the training graph gives it no optimizer state.
    Parameter {
        meta: TensorMeta,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        frozen: bool,
    },
    /// Data fed each step: token ids, labels, pixels, the learning rate, the RNG seed.
    Input(TensorMeta),
    /// Optimizer state of the parameter given as the node's only input.
    OptimizerState {
        kind: StateKind,
        meta: TensorMeta,
    },
    /// A constant tensor with every element equal to `value`.
    Fill {
        value: f64,
        meta: TensorMeta,
    },
    /// A key or value cache of inference (`[B, capacity, Hkv, D]`): resident across the steps
    /// of a generation, written in place by [`Op::CacheWrite`]. Its scope names its layer.
    KvCache(TensorMeta),

    // ---- elementwise --------------------------------------------------------------------
    Unary(UnaryOp),
    /// Inputs `[x, dy]` → `dy · f'(x)`.
    UnaryBackward(UnaryOp),
    /// NumPy broadcasting; both operands of one dtype.
    Binary(BinaryOp),
    /// Inputs `[a, b, dy]` → gradient w.r.t. operand `wrt` (0 = a, 1 = b), in the broadcast
    /// output shape. Used where the rule needs the operands (div, max, min).
    BinaryBackward {
        op: BinaryOp,
        wrt: u8,
    },
    Cast(DType),
    /// Inputs `[x, seed]` (seed an i64 scalar). Zeroes each element with probability `p` by a
    /// counter-based hash of (seed, stream, element index), scaling the rest by 1/(1-p): nothing
    /// is stored for backward, which re-applies the same mask to the gradient. `shard` says
    /// where a sharded tensor sits in the single-device one, so the index is the global one
    /// and every plan draws the single-device mask (`None`: the local index is global).
    Dropout {
        p: f64,
        stream: u64,
        shard: Option<crate::dist::ShardOf>,
    },

    // ---- linear algebra -----------------------------------------------------------------
    /// Batched matmul `[.., m, k] x [.., k, n]` with broadcast batch dims; `trans_*` reads an
    /// operand as its last two dims swapped (no transpose is materialised).
    MatMul {
        trans_a: bool,
        trans_b: bool,
    },

    // ---- reductions ---------------------------------------------------------------------
    Reduce {
        op: ReduceOp,
        dims: Vec<usize>,
        keepdim: bool,
    },
    /// Inputs `[x, dy]` → dx for the matching `Reduce`.
    ReduceBackward {
        op: ReduceOp,
        dims: Vec<usize>,
        keepdim: bool,
    },
    /// Softmax over the last dim.
    Softmax,
    /// Inputs `[y, dy]` → dx.
    SoftmaxBackward,

    // ---- layout -------------------------------------------------------------------------
    /// Same elements, new shape (a view: no new buffer).
    Reshape(Shape),
    Permute(Vec<usize>),
    Slice {
        dim: usize,
        start: usize,
        end: usize,
    },
    /// Zero padding along one dim (the VJP of `Slice`).
    Pad {
        dim: usize,
        before: usize,
        after: usize,
    },
    Concat {
        dim: usize,
    },
    /// Broadcast to a larger shape (a view: no new buffer).
    Expand(Shape),

    // ---- neural-network ops -------------------------------------------------------------
    /// Inputs `[x, weight, bias]`, normalises the last dim.
    LayerNorm {
        eps: f64,
    },
    /// Inputs `[x, weight, dy]` → `[dx, dweight, dbias]`.
    LayerNormBackward {
        eps: f64,
    },
    /// Inputs `[x, weight]`, normalises the last dim.
    RmsNorm {
        eps: f64,
    },
    /// Inputs `[x, weight, dy]` → `[dx, dweight]`.
    RmsNormBackward {
        eps: f64,
    },
    /// Inputs `[table [V, D], ids [..]]` → `[.., D]`. With `rows`, the table is this device's
    /// share of the vocabulary's rows (Megatron-LM's vocabulary-parallel embedding; set by the
    /// planner's lowering): an id outside it reads a zero row, so the output is this device's
    /// term of a pending sum over the shards.
    Embedding {
        #[serde(default)]
        rows: Option<crate::dist::ShardOf>,
    },
    /// Inputs `[ids, dy]` → scatter-add into `[num_embeddings, D]`; with `rows`, into this
    /// device's rows of the table only (ids outside them add nothing).
    EmbeddingBackward {
        num_embeddings: usize,
        #[serde(default)]
        rows: Option<crate::dist::ShardOf>,
    },
    /// Inputs `[logits [.., V], targets [..]]` → `[loss [] f32, logsumexp [..] f32]`: the mean
    /// over the rows whose target is not `ignore_index`, or with `sum` their sum (a loss
    /// normalised by a count the caller supplies, the same on every shard of every plan).
    ///
    /// With `classes` (set by the planner's lowering: Megatron-LM's vocabulary-parallel loss)
    /// the logits are one device's share of the classes and a third input gives each row's
    /// log-sum-exp over all of them (`[logits, targets, logsumexp]`, see [`Op::LogSumExp`]): a
    /// row adds `−logit[target]` on the shard holding its target and its log-sum-exp on the
    /// shard holding class 0, so the shards' losses add up to the loss (a pending sum); the
    /// second output is the log-sum-exp input. The logsumexp input takes no gradient: the
    /// backward's `softmax − onehot` is the whole derivative.
    CrossEntropy {
        ignore_index: Option<i64>,
        #[serde(default)]
        sum: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        classes: Option<crate::dist::ShardOf>,
    },
    /// Inputs `[logits, targets, logsumexp, dloss]` → dlogits (with `classes`, of this
    /// device's classes, from the log-sum-exp over all of them).
    CrossEntropyBackward {
        ignore_index: Option<i64>,
        #[serde(default)]
        sum: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        classes: Option<crate::dist::ShardOf>,
    },
    /// Inputs `[x [.., n]]` → `[..] f32`: `log Σ exp` over the last dim, computed stably (the
    /// row's maximum factored out). The vocabulary-parallel loss's per-shard and global
    /// normalisers.
    LogSumExp,
    /// Inputs `[x [.., D], weight [V, D], targets [..]]` → `[loss [] f32, logsumexp [..] f32]`:
    /// `CrossEntropy { ignore_index, sum: true }` over the logits `x · weightᵀ` (an LM head
    /// and its loss), computed `chunk_rows` rows at a time so at most one chunk's
    /// `[chunk_rows, V]` logits exist — the op's workspace — and the whole `[rows, V]` logits
    /// never do. The planner's fusion of the pair (`tessera-plan`'s `loss_chunk`); the mean is
    /// the caller's division, as for the summed `CrossEntropy`. See [`linear_loss`].
    LinearCrossEntropy {
        chunk_rows: usize,
        ignore_index: Option<i64>,
    },
    /// Inputs `[x, weight, targets, logsumexp, dloss]` → `[dx, dweight]`, each chunk's logits
    /// recomputed from `x` and `weight` and turned into its gradient with the saved
    /// log-sum-exp.
    LinearCrossEntropyBackward {
        chunk_rows: usize,
        ignore_index: Option<i64>,
    },
    /// Inputs `[x [.., D], up weight(s), (bias), down weight]` → `[y [.., D]]`: a block's MLP
    /// (SwiGLU or GPT-2's GELU MLP, [`MlpSpec`]) computed `chunk_rows` rows at a time so at
    /// most one chunk's `[chunk_rows, F]` intermediates exist — the op's workspace. The
    /// planner's fusion of the unfused ops (`tessera-plan`'s `mlp_tile`). See [`tiled_mlp`].
    TiledMlp(MlpSpec),
    /// Inputs `[x, weights.., dy]` → the gradient of each forward input, each chunk's
    /// intermediates recomputed from `x` and the weights, the weights' gradients accumulated.
    TiledMlpBackward(MlpSpec),
    /// Fused attention. Inputs `q [B,S,H,D], k [B,T,Hkv,D], v [B,T,Hkv,D]` with H a multiple
    /// of Hkv (GQA) → `[out [B,S,H,D], logsumexp [B,H,S] f32]`. No S×T matrix is saved.
    /// Query `i` sits at position `i + T − S` (the last S of T positions), or, with a fourth
    /// input `start [B] i64` (inference over a KV cache), at `start[b] + i`: causally it sees
    /// the keys at positions `≤` its own.
    Attention(AttentionSpec),
    /// Inputs `[q, k, v, out, logsumexp, dout]`, and `dlogsumexp` seventh where the
    /// log-sum-exp was read (ring attention's merge) → `[dq, dk, dv]`. With `D = Σ_d dout·out`
    /// per row, `dS = P∘(dP − (D − dlogsumexp))`.
    AttentionBackward(AttentionSpec),
    /// Ring attention's merge of partial attentions over blocks of keys: inputs
    /// `[o_0, lse_0, o_1, lse_1, …]` (each an [`Op::Attention`]'s outputs, `o [B,S,H,D]`,
    /// `lse [B,H,S] f32`) → `o = Σ_r w_r·o_r` with `w_r = exp(lse_r − L)`,
    /// `L = log Σ_r exp(lse_r)` (a row every block masks stays zero).
    AttentionMerge,
    /// Inputs `[o_0, lse_0, …, dout]` → `[do_0, dlse_0, …]`: `do_r = w_r·dout`,
    /// `dlse_r = w_r·(Σ_d dout·o_r − Σ_d dout·o)`.
    AttentionMergeBackward,
    /// Ring attention's online merge ([`ring`]): `[o_run, lse_run, o_s, lse_s]` → the merged
    /// `[o, lse]`; on a ring's last merge (`backward`) also the device's own `q, k, v`, and
    /// its VJP is the whole ring's backward (K/V around the ring again, dK/dV home).
    RingMerge(RingMerge),
    /// Rotary position embedding on `[B,S,H,D]` (rotate-half layout, positions 0..S, or those of
    /// a second input `positions [B,S] i64`), with one inverse frequency per pair; `inverse`
    /// rotates by −θ (its VJP).
    Rope {
        inv_freq: Vec<f64>,
        inverse: bool,
    },

    // ---- vision / diffusion (NCHW; see [`vision`]) ----------------------------------------
    /// Inputs `[x [N,C,H,W], w [O,C/groups,kh,kw]]` → `[N,O,Ho,Wo]`, no bias.
    Conv2d(Conv2dSpec),
    /// Backward-data: inputs `[w, dy]` → dx `[N,C,input_hw]`.
    Conv2dBackwardInput {
        spec: Conv2dSpec,
        input_hw: [usize; 2],
    },
    /// Backward-filter: inputs `[x, dy]` → dw `[O,C/groups,kernel_hw]`.
    Conv2dBackwardWeight {
        spec: Conv2dSpec,
        kernel_hw: [usize; 2],
    },
    /// Inputs `[x [N,C,..], weight [C], bias [C]]`: normalises each sample's groups of
    /// `C/groups` channels (biased variance), then a per-channel affine (PyTorch's GroupNorm).
    GroupNorm {
        groups: usize,
        eps: f64,
    },
    /// Inputs `[x, weight, dy]` → `[dx, dweight, dbias]`.
    GroupNormBackward {
        groups: usize,
        eps: f64,
    },
    /// Inputs `[x [N,C,H,W]]` → the maximum of each window (padding never wins).
    MaxPool2d(Pool2dSpec),
    /// Inputs `[x, dy]` → dx: each window's gradient goes to its first maximum.
    MaxPool2dBackward(Pool2dSpec),
    /// Inputs `[x [N,C,H,W]]` → the mean of each window, over the whole window
    /// (`count_include_pad`) or over its elements inside the input.
    AvgPool2d {
        pool: Pool2dSpec,
        count_include_pad: bool,
    },
    /// Inputs `[dy]` → dx `[N,C,input_hw]`.
    AvgPool2dBackward {
        pool: Pool2dSpec,
        count_include_pad: bool,
        input_hw: [usize; 2],
    },
    /// Inputs `[x [N,C,H,W]]` → `[N,C,H·scale[0],W·scale[1]]`, nearest neighbour.
    Upsample2d {
        scale: [usize; 2],
    },
    /// Inputs `[dy]` → dx: the sum of each `scale[0]×scale[1]` block.
    Upsample2dBackward {
        scale: [usize; 2],
    },

    // ---- inference ----------------------------------------------------------------------
    /// Inputs `[cache [B,C,H,D], x [B,S,H,D], start [B] i64]`: writes `x[b, i]` into
    /// `cache[b, start[b] + i]` in place; the output aliases the cache. Inference only.
    CacheWrite,
    /// Inputs `[x [B,S,..], index [B] i64]` → `[B,1,..]`, row `b` of the output is
    /// `x[b, index[b]]` (the last prompt position of each sequence). Inference only.
    SelectPositions,
    /// Inputs `[x [.., K], weight [N, K·bits/8] u8, scales [N, K/group] f32]` → `[.., N]` in
    /// x's dtype: `x · dequant(weight)ᵀ`, dequantised inside the kernel ([`QuantSpec`]). In
    /// generation, and as a frozen base's linear when training (QLoRA): the weight and scales
    /// take no gradient, x's is [`Op::QMatMulBackward`].
    QMatMul(QuantSpec),
    /// Inputs `[dy [.., N], weight [N, K·bits/8] u8, scales [N, K/group] f32]` → `dx [.., K]`
    /// in dy's dtype: `dy · dequant(weight)`, the input gradient of [`Op::QMatMul`].
    QMatMulBackward(QuantSpec),

    // ---- mixture of experts (see [`moe`]) ------------------------------------------------
    /// Inputs `[x [.., n]]` → `[values [.., k], indices [.., k] i64]`: the `k` largest of each
    /// row in descending order, equal values by lower index first (a NaN ranks above every
    /// number). The values' gradient scatters back to their positions.
    TopK {
        k: usize,
    },
    /// Inputs `[x [.., n], indices [.., k]]` → `[.., k]`, `out[.., j] = x[.., indices[.., j]]`
    /// (PyTorch's `gather` along the last dim); an index outside `0..n` is an error.
    TakeAlong,
    /// Inputs `[indices [.., k], src [.., k]]` → `[.., size]`: zeros, plus `src[.., j]` added
    /// at `indices[.., j]` (repeated indices add). The adjoint of [`Op::TakeAlong`]; with a
    /// `src` of ones, per-row one-hot counts.
    ScatterAlong {
        size: usize,
    },
    /// Inputs `[indices [N, k]]` (each token's experts) → `[slots [N, k] i64]`: assignment
    /// `(n, j)` to expert `e` takes slot `e·capacity + c`, `c` its rank among the assignments
    /// to `e` in row-major `(n, j)` order, or `−1` (dropped) when `c ≥ capacity`. See
    /// [`moe`] for the drop order.
    MoeSlots {
        experts: usize,
        capacity: usize,
    },
    /// Inputs `[x [N, H], slots [N, k]]` plus optional `weights [N, k]` → `[E, C, H]`: row
    /// `slot[n, j]` is `x[n]` (times `weights[n, j]`); dropped assignments (`−1`) write
    /// nothing, unfilled rows are zero. A slot used twice is an error.
    MoeDispatch {
        experts: usize,
        capacity: usize,
    },
    /// Inputs `[y [E, C, H], slots [N, k]]` plus optional `weights [N, k]` → `[N, H]`:
    /// `out[n] = Σ_j weights[n, j] · y[slot[n, j]]` over the assignments not dropped, `j`
    /// ascending (a dropped one adds nothing). The adjoint of [`Op::MoeDispatch`].
    MoeCombine,
    /// Inputs `[buf [E, C, H], x [N, H], slots [N, k]]` → `[N, k]`: `⟨buf[slot[n, j]], x[n]⟩`,
    /// 0 for a dropped assignment — the weights' gradient of dispatch and combine.
    MoeSlotDot,

    // ---- optimizer ----------------------------------------------------------------------
    /// Inputs `[param, grad, m, v, lr, step, grad_norm]` plus `master` under mixed precision,
    /// plus `grad_scale` (last) when the spec's `grad_scale` is set (fp16 loss scaling);
    /// updates in place, outputs `[param', m', v']` (+ `master'`) alias their inputs.
    ///
    /// Per element, with `step` 1-based and all arithmetic in f32 or wider; `s = grad_scale`
    /// (an f32 scalar, 1 / loss_scale) when present, else 1; `grad` and `grad_norm` are the
    /// scaled gradient and its global norm:
    ///
    /// ```text
    /// n  = grad_norm · s                                 (the unscaled global norm)
    /// if grad_scale is present and n is not finite (inf or NaN):
    ///     skip: param' = param, m' = m, v' = v, master' = master   (nothing is written)
    /// c  = min(1, max_grad_norm / (n + 1e-6))            if max_grad_norm is Some, else 1
    /// g  = c · s · grad
    /// w  = master if present, else param
    /// m' = β1·m + (1 − β1)·g
    /// v' = β2·v + (1 − β2)·g²
    /// m̂  = m' / (1 − β1^step)
    /// v̂  = v' / (1 − β2^step)
    /// w' = w − lr·(m̂ / (sqrt(v̂) + eps) + weight_decay·w)
    /// param' = w'   (rounded to param's dtype);   master' = w'   when present
    /// ```
    AdamW(AdamWSpec),

    // ---- communication (only in lowered per-device graphs) -------------------------------
    /// Collectives that move a value between shardings; see [`comm`]. A forward with no steps
    /// is a view (Megatron's "f": identity now, all-reduce of the gradient later).
    Reshard(ReshardSpec),
    /// Sends its input to another pipeline stage ([`P2p`]); outputs a scalar f32 zero token,
    /// the stand-in loss of a stage whose backward starts from received gradients. Its VJP
    /// receives the input's gradient from the peer.
    Send(P2p),
    /// Receives a tensor of the given meta from another pipeline stage; its VJP sends the
    /// gradient back.
    Recv(P2p, TensorMeta),
    /// Copies its input from tier `from` to tier `to` (device ↔ host ↔ NVMe): offloaded
    /// gradients and optimizer state, prefetched parameters. Its VJP is the copy back.
    Transfer {
        from: crate::Tier,
        to: crate::Tier,
    },
}

/// FLOPs of one node, split as the profiler reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flops {
    /// Matmuls and fused attention's QK^T / AV products.
    pub matmul: u64,
    /// Everything else.
    pub other: u64,
}

impl Flops {
    pub fn total(self) -> u64 {
        self.matmul + self.other
    }
    pub(crate) fn other(n: u64) -> Flops {
        Flops { matmul: 0, other: n }
    }
}

impl Op {
    /// Short name used in errors and printed graphs.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Parameter { .. } => "parameter",
            Op::Input(_) => "input",
            Op::OptimizerState { .. } => "optimizer_state",
            Op::Fill { .. } => "fill",
            Op::KvCache(_) => "kv_cache",
            Op::CacheWrite => "cache_write",
            Op::SelectPositions => "select_positions",
            Op::QMatMul(_) => "qmatmul",
            Op::QMatMulBackward(_) => "qmatmul_backward",
            Op::Unary(_) => "unary",
            Op::UnaryBackward(_) => "unary_backward",
            Op::Binary(_) => "binary",
            Op::BinaryBackward { .. } => "binary_backward",
            Op::Cast(_) => "cast",
            Op::Dropout { .. } => "dropout",
            Op::MatMul { .. } => "matmul",
            Op::Reduce { .. } => "reduce",
            Op::ReduceBackward { .. } => "reduce_backward",
            Op::Softmax => "softmax",
            Op::SoftmaxBackward => "softmax_backward",
            Op::Reshape(_) => "reshape",
            Op::Permute(_) => "permute",
            Op::Slice { .. } => "slice",
            Op::Pad { .. } => "pad",
            Op::Concat { .. } => "concat",
            Op::Expand(_) => "expand",
            Op::LayerNorm { .. } => "layer_norm",
            Op::LayerNormBackward { .. } => "layer_norm_backward",
            Op::RmsNorm { .. } => "rms_norm",
            Op::RmsNormBackward { .. } => "rms_norm_backward",
            Op::Embedding { .. } => "embedding",
            Op::EmbeddingBackward { .. } => "embedding_backward",
            Op::CrossEntropy { .. } => "cross_entropy",
            Op::LogSumExp => "logsumexp",
            Op::CrossEntropyBackward { .. } => "cross_entropy_backward",
            Op::LinearCrossEntropy { .. } => "linear_cross_entropy",
            Op::LinearCrossEntropyBackward { .. } => "linear_cross_entropy_backward",
            Op::TiledMlp(_) => "tiled_mlp",
            Op::TiledMlpBackward(_) => "tiled_mlp_backward",
            Op::Attention(_) => "attention",
            Op::AttentionBackward(_) => "attention_backward",
            Op::AttentionMerge => "attention_merge",
            Op::AttentionMergeBackward => "attention_merge_backward",
            Op::RingMerge(_) => "ring_merge",
            Op::Rope { .. } => "rope",
            Op::Conv2d(_) => "conv2d",
            Op::Conv2dBackwardInput { .. } => "conv2d_backward_input",
            Op::Conv2dBackwardWeight { .. } => "conv2d_backward_weight",
            Op::GroupNorm { .. } => "group_norm",
            Op::GroupNormBackward { .. } => "group_norm_backward",
            Op::MaxPool2d(_) => "max_pool2d",
            Op::MaxPool2dBackward(_) => "max_pool2d_backward",
            Op::AvgPool2d { .. } => "avg_pool2d",
            Op::AvgPool2dBackward { .. } => "avg_pool2d_backward",
            Op::Upsample2d { .. } => "upsample2d",
            Op::Upsample2dBackward { .. } => "upsample2d_backward",
            Op::AdamW(_) => "adamw",
            Op::TopK { .. } => "top_k",
            Op::TakeAlong => "take_along",
            Op::ScatterAlong { .. } => "scatter_along",
            Op::MoeSlots { .. } => "moe_slots",
            Op::MoeDispatch { .. } => "moe_dispatch",
            Op::MoeCombine => "moe_combine",
            Op::MoeSlotDot => "moe_slot_dot",
            Op::Reshard(_) => "reshard",
            Op::Send(_) => "send",
            Op::Recv(..) => "recv",
            Op::Transfer { .. } => "transfer",
        }
    }

    pub fn is_leaf(&self) -> bool {
        self.is_bound() || matches!(self, Op::Fill { .. })
    }

    /// Leaves whose values the caller binds (everything but constants).
    pub fn is_bound(&self) -> bool {
        matches!(
            self,
            Op::Parameter { .. } | Op::Input(_) | Op::OptimizerState { .. } | Op::KvCache(_)
        )
    }

    /// Ops of inference Programs only (no VJP, no training use).
    pub fn inference_only(&self) -> bool {
        matches!(self, Op::KvCache(_) | Op::CacheWrite | Op::SelectPositions)
    }

    /// Whether `selective` activation checkpointing keeps this op's outputs: matmuls, fused
    /// attention and collectives are expensive to re-run (FLOPs or a network round), so their
    /// outputs stay saved; elementwise ops, norms, activation functions and layout copies are
    /// cheap and are recomputed from them in the backward pass.
    pub fn kept_by_selective(&self) -> bool {
        match self {
            Op::MatMul { .. }
            | Op::Attention(_)
            | Op::RingMerge(_)
            | Op::Reshard(_)
            | Op::Send(_)
            | Op::Recv(..)
            | Op::Transfer { .. }
            | Op::Embedding { .. }
            | Op::CrossEntropy { .. }
            | Op::LinearCrossEntropy { .. }
            | Op::TiledMlp(_)
            | Op::Parameter { .. }
            | Op::Input(_)
            | Op::OptimizerState { .. }
            | Op::KvCache(_)
            | Op::CacheWrite
            | Op::QMatMul(_)
            | Op::Conv2d(_)
            | Op::AdamW(_) => true,
            Op::Fill { .. }
            | Op::Unary(_)
            | Op::UnaryBackward(_)
            | Op::Binary(_)
            | Op::BinaryBackward { .. }
            | Op::Cast(_)
            | Op::Dropout { .. }
            | Op::Reduce { .. }
            | Op::ReduceBackward { .. }
            | Op::Softmax
            | Op::LogSumExp
            | Op::SoftmaxBackward
            | Op::Reshape(_)
            | Op::Permute(_)
            | Op::Slice { .. }
            | Op::Pad { .. }
            | Op::Concat { .. }
            | Op::Expand(_)
            | Op::LayerNorm { .. }
            | Op::LayerNormBackward { .. }
            | Op::RmsNorm { .. }
            | Op::RmsNormBackward { .. }
            | Op::EmbeddingBackward { .. }
            | Op::CrossEntropyBackward { .. }
            | Op::LinearCrossEntropyBackward { .. }
            | Op::TiledMlpBackward(_)
            | Op::AttentionBackward(_)
            | Op::AttentionMerge
            | Op::AttentionMergeBackward
            | Op::SelectPositions
            | Op::Rope { .. }
            | Op::Conv2dBackwardInput { .. }
            | Op::QMatMulBackward(_)
            | Op::Conv2dBackwardWeight { .. }
            | Op::GroupNorm { .. }
            | Op::GroupNormBackward { .. }
            | Op::MaxPool2d(_)
            | Op::MaxPool2dBackward(_)
            | Op::AvgPool2d { .. }
            | Op::AvgPool2dBackward { .. }
            | Op::Upsample2d { .. }
            | Op::Upsample2dBackward { .. }
            | Op::TopK { .. }
            | Op::TakeAlong
            | Op::ScatterAlong { .. }
            | Op::MoeSlots { .. }
            | Op::MoeDispatch { .. }
            | Op::MoeCombine
            | Op::MoeSlotDot => false,
        }
    }

    /// Output metas for the given input metas, or the reason they do not fit.
    pub fn infer(&self, x: &[&TensorMeta]) -> Result<Vec<TensorMeta>, String> {
        match self {
            Op::Parameter { meta: m, .. } | Op::Input(m) | Op::Fill { meta: m, .. } => {
                leaf::infer(x, m, 0)
            }
            Op::OptimizerState { meta, .. } => leaf::infer(x, meta, 1),
            Op::KvCache(m) => leaf::infer(x, m, 0),
            Op::CacheWrite => infer::infer_cache_write(x),
            Op::SelectPositions => infer::infer_select(x),
            Op::QMatMul(q) => quant::infer(x, *q),
            Op::QMatMulBackward(q) => quant::infer_backward(x, *q),
            Op::Unary(_) => elementwise::infer_unary(x),
            Op::UnaryBackward(_) => elementwise::infer_unary_backward(x),
            Op::Binary(_) => elementwise::infer_binary(x),
            Op::BinaryBackward { .. } => elementwise::infer_binary_backward(x),
            Op::Cast(d) => elementwise::infer_cast(x, *d),
            Op::Dropout { p, .. } => elementwise::infer_dropout(x, *p),
            Op::MatMul { trans_a, trans_b } => matmul::infer(x, *trans_a, *trans_b),
            Op::Reduce { op, dims, keepdim } => reduce::infer_reduce(x, *op, dims, *keepdim),
            Op::ReduceBackward { op, dims, keepdim } => {
                reduce::infer_reduce_backward(x, *op, dims, *keepdim)
            }
            Op::Softmax => reduce::infer_softmax(x),
            Op::SoftmaxBackward => reduce::infer_softmax_backward(x),
            Op::Reshape(s) => layout::infer_reshape(x, s),
            Op::Permute(p) => layout::infer_permute(x, p),
            Op::Slice { dim, start, end } => layout::infer_slice(x, *dim, *start, *end),
            Op::Pad { dim, before, after } => layout::infer_pad(x, *dim, *before, *after),
            Op::Concat { dim } => layout::infer_concat(x, *dim),
            Op::Expand(s) => layout::infer_expand(x, s),
            Op::LayerNorm { .. } => norm::infer_layer_norm(x),
            Op::LayerNormBackward { .. } => norm::infer_layer_norm_backward(x),
            Op::RmsNorm { .. } => norm::infer_rms_norm(x),
            Op::RmsNormBackward { .. } => norm::infer_rms_norm_backward(x),
            Op::Embedding { .. } => embedding::infer(x),
            Op::EmbeddingBackward { num_embeddings, .. } => {
                embedding::infer_backward(x, *num_embeddings)
            }
            Op::CrossEntropy { classes, .. } => loss::infer(x, classes.is_some()),
            Op::CrossEntropyBackward { .. } => loss::infer_backward(x),
            Op::LinearCrossEntropy { chunk_rows, .. } => linear_loss::infer(x, *chunk_rows),
            Op::TiledMlp(spec) => tiled_mlp::infer(x, spec),
            Op::TiledMlpBackward(spec) => tiled_mlp::infer_backward(x, spec),
            Op::LinearCrossEntropyBackward { chunk_rows, .. } => {
                linear_loss::infer_backward(x, *chunk_rows)
            }
            Op::LogSumExp => loss::infer_logsumexp(x),
            Op::Attention(spec) => attention::infer(x, spec),
            Op::AttentionBackward(spec) => attention::infer_backward(x, spec),
            Op::AttentionMerge => attention::infer_merge(x),
            Op::AttentionMergeBackward => attention::infer_merge_backward(x),
            Op::RingMerge(m) => ring::infer(x, m),
            Op::Rope { inv_freq, .. } => attention::infer_rope(x, inv_freq),
            Op::Conv2d(spec) => vision::infer_conv(x, spec),
            Op::Conv2dBackwardInput { spec, input_hw } => {
                vision::infer_conv_backward_input(x, spec, *input_hw)
            }
            Op::Conv2dBackwardWeight { spec, kernel_hw } => {
                vision::infer_conv_backward_weight(x, spec, *kernel_hw)
            }
            Op::GroupNorm { groups, .. } => vision::infer_group_norm(x, *groups),
            Op::GroupNormBackward { groups, .. } => vision::infer_group_norm_backward(x, *groups),
            Op::MaxPool2d(pool) | Op::AvgPool2d { pool, .. } => vision::infer_pool(x, pool),
            Op::MaxPool2dBackward(pool) => vision::infer_max_pool_backward(x, pool),
            Op::AvgPool2dBackward { pool, input_hw, .. } => {
                vision::infer_avg_pool_backward(x, pool, *input_hw)
            }
            Op::Upsample2d { scale } => vision::infer_upsample(x, *scale),
            Op::Upsample2dBackward { scale } => vision::infer_upsample_backward(x, *scale),
            Op::AdamW(spec) => optim::infer(spec, x),
            Op::TopK { k } => moe::infer_top_k(x, *k),
            Op::TakeAlong => moe::infer_take_along(x),
            Op::ScatterAlong { size } => moe::infer_scatter_along(x, *size),
            Op::MoeSlots { experts, capacity } => moe::infer_slots(x, *experts, *capacity),
            Op::MoeDispatch { experts, capacity } => moe::infer_dispatch(x, *experts, *capacity),
            Op::MoeCombine => moe::infer_combine(x),
            Op::MoeSlotDot => moe::infer_slot_dot(x),
            Op::Reshard(spec) => comm::infer(x, spec),
            Op::Send(_) => comm::infer_send(x),
            Op::Recv(_, meta) => comm::infer_recv(x, meta),
            Op::Transfer { .. } => comm::infer_transfer(x),
        }
    }

    /// FLOPs of one application with these input and output metas.
    pub fn flops(&self, x: &[&TensorMeta], y: &[&TensorMeta]) -> Flops {
        match self {
            Op::Parameter { .. }
            | Op::Input(_)
            | Op::OptimizerState { .. }
            | Op::Fill { .. }
            | Op::KvCache(_)
            | Op::CacheWrite
            | Op::SelectPositions => Flops::default(),
            Op::QMatMul(_) => quant::flops(x, y),
            Op::QMatMulBackward(_) => quant::flops_backward(x, y),
            Op::Unary(u) => elementwise::flops_unary(*u, y),
            Op::UnaryBackward(u) => elementwise::flops_unary_backward(*u, y),
            Op::Binary(_) => elementwise::flops_binary(y),
            Op::BinaryBackward { .. } => elementwise::flops_binary_backward(y),
            Op::Cast(_) => Flops::default(),
            Op::Dropout { .. } => elementwise::flops_dropout(y),
            Op::MatMul { trans_a, .. } => matmul::flops(x, y, *trans_a),
            Op::Reduce { .. } => reduce::flops_reduce(x),
            Op::ReduceBackward { .. } => reduce::flops_reduce_backward(y),
            Op::Softmax => reduce::flops_softmax(y),
            Op::SoftmaxBackward => reduce::flops_softmax_backward(y),
            Op::Reshape(_)
            | Op::Permute(_)
            | Op::Slice { .. }
            | Op::Pad { .. }
            | Op::Concat { .. }
            | Op::Expand(_) => Flops::default(),
            Op::LayerNorm { .. } => norm::flops_layer_norm(x),
            Op::LayerNormBackward { .. } => norm::flops_layer_norm_backward(x),
            Op::RmsNorm { .. } => norm::flops_rms_norm(x),
            Op::RmsNormBackward { .. } => norm::flops_rms_norm_backward(x),
            Op::Embedding { .. } => Flops::default(),
            Op::EmbeddingBackward { .. } => embedding::flops_backward(x),
            Op::CrossEntropy { .. } => loss::flops(x),
            Op::CrossEntropyBackward { .. } => loss::flops_backward(x),
            Op::LinearCrossEntropy { .. } => linear_loss::flops(x),
            Op::LinearCrossEntropyBackward { .. } => linear_loss::flops_backward(x),
            Op::TiledMlp(spec) => tiled_mlp::flops(x, spec),
            Op::TiledMlpBackward(spec) => tiled_mlp::flops_backward(x, spec),
            Op::LogSumExp => loss::flops_logsumexp(x),
            Op::Attention(_) => attention::flops(x),
            Op::AttentionBackward(_) => attention::flops_backward(x),
            Op::AttentionMerge => attention::flops_merge(x, false),
            Op::AttentionMergeBackward => attention::flops_merge(x, true),
            Op::RingMerge(_) => ring::flops(x),
            Op::Rope { .. } => attention::flops_rope(y),
            Op::Conv2d(_) => vision::flops_conv(x, y),
            Op::Conv2dBackwardInput { .. } => vision::flops_conv_backward_input(x),
            Op::Conv2dBackwardWeight { .. } => vision::flops_conv_backward_weight(x, y),
            Op::GroupNorm { .. } => vision::flops_group_norm(x),
            Op::GroupNormBackward { .. } => vision::flops_group_norm_backward(x),
            Op::MaxPool2d(pool) | Op::AvgPool2d { pool, .. } => vision::flops_pool(y[0], pool),
            Op::MaxPool2dBackward(pool) => vision::flops_pool(x[1], pool),
            Op::AvgPool2dBackward { pool, .. } => vision::flops_pool(x[0], pool),
            Op::Upsample2d { .. } => Flops::default(),
            Op::Upsample2dBackward { .. } => vision::flops_upsample_backward(x),
            Op::AdamW(_) => optim::flops(x),
            Op::TopK { k } => moe::flops_top_k(x, *k),
            Op::TakeAlong | Op::MoeSlots { .. } => Flops::default(),
            Op::ScatterAlong { .. } => moe::flops_scatter(x),
            Op::MoeDispatch { .. } => moe::flops_dispatch(x),
            Op::MoeCombine => moe::flops_combine(x),
            Op::MoeSlotDot => moe::flops_slot_dot(x),
            Op::Reshard(spec) => comm::flops(spec, x),
            Op::Send(_) | Op::Recv(..) | Op::Transfer { .. } => Flops::default(),
        }
    }

    /// Bytes read and written by one application (for the roofline cost model). Views move
    /// nothing; in-place updates read and write their state once.
    pub fn bytes_accessed(&self, x: &[&TensorMeta], y: &[&TensorMeta]) -> u64 {
        let read: u64 = x.iter().map(|m| m.size_bytes()).sum();
        let written: u64 = y.iter().map(|m| m.size_bytes()).sum();
        match self {
            Op::Reshape(_) | Op::Expand(_) => 0,
            Op::Parameter { .. } | Op::Input(_) | Op::OptimizerState { .. } | Op::KvCache(_) => 0,
            // Reads the new rows and writes them into the cache.
            Op::CacheWrite => 2 * x[1].size_bytes(),
            Op::SelectPositions => 2 * written,
            // Priced on their link by the pipeline's time simulation.
            Op::Send(_) | Op::Recv(..) => 0,
            // Priced on the host link (or the NVMe) by the cost model.
            Op::Transfer { .. } => 0,
            Op::Fill { .. } => written,
            Op::Unary(_)
            | Op::UnaryBackward(_)
            | Op::Binary(_)
            | Op::BinaryBackward { .. }
            | Op::Cast(_)
            | Op::Dropout { .. }
            | Op::MatMul { .. }
            | Op::Reduce { .. }
            | Op::ReduceBackward { .. }
            | Op::Softmax
            | Op::LogSumExp
            | Op::SoftmaxBackward
            | Op::Permute(_)
            | Op::Slice { .. }
            | Op::Pad { .. }
            | Op::Concat { .. }
            | Op::LayerNorm { .. }
            | Op::LayerNormBackward { .. }
            | Op::RmsNorm { .. }
            | Op::RmsNormBackward { .. }
            | Op::Embedding { .. }
            | Op::EmbeddingBackward { .. }
            | Op::CrossEntropy { .. }
            | Op::CrossEntropyBackward { .. }
            | Op::LinearCrossEntropy { .. }
            | Op::LinearCrossEntropyBackward { .. }
            | Op::TiledMlp(_)
            | Op::TiledMlpBackward(_)
            | Op::Attention(_)
            | Op::AttentionBackward(_)
            | Op::AttentionMerge
            | Op::RingMerge(_)
            | Op::AttentionMergeBackward
            | Op::Rope { .. }
            | Op::QMatMul(_)
            | Op::Conv2d(_)
            | Op::Conv2dBackwardInput { .. }
            | Op::QMatMulBackward(_)
            | Op::Conv2dBackwardWeight { .. }
            | Op::GroupNorm { .. }
            | Op::GroupNormBackward { .. }
            | Op::MaxPool2d(_)
            | Op::MaxPool2dBackward(_)
            | Op::AvgPool2d { .. }
            | Op::AvgPool2dBackward { .. }
            | Op::Upsample2d { .. }
            | Op::Upsample2dBackward { .. }
            | Op::TopK { .. }
            | Op::TakeAlong
            | Op::ScatterAlong { .. }
            | Op::MoeSlots { .. }
            | Op::MoeDispatch { .. }
            | Op::MoeCombine
            | Op::MoeSlotDot
            | Op::AdamW(_) => read + written,
            Op::Reshard(spec) => {
                if spec.is_view() {
                    0
                } else {
                    read + written
                }
            }
        }
    }

    /// If output `out` shares its buffer with an input (a view or an in-place update), that
    /// input's index. The Program's memory accounting and the runtime both follow this.
    pub fn output_alias(&self, out: usize) -> Option<usize> {
        match self {
            Op::Reshape(_) | Op::Expand(_) => Some(0),
            Op::AdamW(_) => Some(optim::alias(out)),
            Op::CacheWrite => Some(0),
            Op::Reshard(spec) => spec.is_view().then_some(0),
            Op::Send(_) | Op::Recv(..) | Op::Transfer { .. } => None,
            Op::Parameter { .. }
            | Op::Input(_)
            | Op::OptimizerState { .. }
            | Op::Fill { .. }
            | Op::Unary(_)
            | Op::UnaryBackward(_)
            | Op::Binary(_)
            | Op::BinaryBackward { .. }
            | Op::Cast(_)
            | Op::Dropout { .. }
            | Op::MatMul { .. }
            | Op::Reduce { .. }
            | Op::ReduceBackward { .. }
            | Op::Softmax
            | Op::LogSumExp
            | Op::SoftmaxBackward
            | Op::Permute(_)
            | Op::Slice { .. }
            | Op::Pad { .. }
            | Op::Concat { .. }
            | Op::LayerNorm { .. }
            | Op::LayerNormBackward { .. }
            | Op::RmsNorm { .. }
            | Op::RmsNormBackward { .. }
            | Op::Embedding { .. }
            | Op::EmbeddingBackward { .. }
            | Op::CrossEntropy { .. }
            | Op::CrossEntropyBackward { .. }
            | Op::LinearCrossEntropy { .. }
            | Op::LinearCrossEntropyBackward { .. }
            | Op::TiledMlp(_)
            | Op::TiledMlpBackward(_)
            | Op::Attention(_)
            | Op::AttentionBackward(_)
            | Op::AttentionMerge
            | Op::RingMerge(_)
            | Op::AttentionMergeBackward
            | Op::KvCache(_)
            | Op::SelectPositions
            | Op::QMatMul(_)
            | Op::Rope { .. }
            | Op::Conv2d(_)
            | Op::Conv2dBackwardInput { .. }
            | Op::QMatMulBackward(_)
            | Op::Conv2dBackwardWeight { .. }
            | Op::GroupNorm { .. }
            | Op::GroupNormBackward { .. }
            | Op::MaxPool2d(_)
            | Op::MaxPool2dBackward(_)
            | Op::AvgPool2d { .. }
            | Op::AvgPool2dBackward { .. }
            | Op::Upsample2d { .. }
            | Op::Upsample2dBackward { .. }
            | Op::TopK { .. }
            | Op::TakeAlong
            | Op::ScatterAlong { .. }
            | Op::MoeSlots { .. }
            | Op::MoeDispatch { .. }
            | Op::MoeCombine
            | Op::MoeSlotDot => None,
        }
    }

    /// Scratch memory the kernel holds while it runs (freed when it returns).
    pub fn workspace_bytes(&self, x: &[&TensorMeta]) -> u64 {
        match self {
            Op::LinearCrossEntropy { chunk_rows, .. }
            | Op::LinearCrossEntropyBackward { chunk_rows, .. } => {
                linear_loss::workspace_bytes(x, *chunk_rows)
            }
            Op::TiledMlp(spec) => tiled_mlp::workspace_bytes(x, spec, false),
            Op::TiledMlpBackward(spec) => tiled_mlp::workspace_bytes(x, spec, true),
            Op::Attention(_) | Op::AttentionBackward(_) => attention::workspace_bytes(x),
            Op::QMatMul(q) => quant::workspace_bytes(x, *q),
            Op::QMatMulBackward(q) => quant::workspace_bytes_backward(x, *q),
            Op::Conv2d(spec) => vision::workspace_conv(x, spec),
            Op::Conv2dBackwardInput { spec, .. } => vision::workspace_conv_backward_input(x, spec),
            Op::Conv2dBackwardWeight { spec, kernel_hw } => {
                vision::workspace_conv_backward_weight(x, spec, *kernel_hw)
            }
            Op::GroupNorm { .. }
            | Op::GroupNormBackward { .. }
            | Op::MaxPool2d(_)
            | Op::MaxPool2dBackward(_)
            | Op::AvgPool2d { .. }
            | Op::AvgPool2dBackward { .. }
            | Op::Upsample2d { .. }
            | Op::Upsample2dBackward { .. } => 0,
            Op::KvCache(_) | Op::CacheWrite | Op::SelectPositions => 0,
            Op::AttentionMerge | Op::AttentionMergeBackward | Op::RingMerge(_) => 0,
            Op::Send(_)
            | Op::Recv(..)
            | Op::Transfer { .. }
            | Op::Parameter { .. }
            | Op::Input(_)
            | Op::OptimizerState { .. }
            | Op::Fill { .. }
            | Op::Unary(_)
            | Op::UnaryBackward(_)
            | Op::Binary(_)
            | Op::BinaryBackward { .. }
            | Op::Cast(_)
            | Op::Dropout { .. }
            | Op::MatMul { .. }
            | Op::Reduce { .. }
            | Op::ReduceBackward { .. }
            | Op::Softmax
            | Op::LogSumExp
            | Op::SoftmaxBackward
            | Op::Reshape(_)
            | Op::Permute(_)
            | Op::Slice { .. }
            | Op::Pad { .. }
            | Op::Concat { .. }
            | Op::Expand(_)
            | Op::LayerNorm { .. }
            | Op::LayerNormBackward { .. }
            | Op::RmsNorm { .. }
            | Op::RmsNormBackward { .. }
            | Op::Embedding { .. }
            | Op::EmbeddingBackward { .. }
            | Op::CrossEntropy { .. }
            | Op::CrossEntropyBackward { .. }
            | Op::Rope { .. }
            | Op::AdamW(_)
            | Op::TopK { .. }
            | Op::TakeAlong
            | Op::ScatterAlong { .. }
            | Op::MoeSlots { .. }
            | Op::MoeDispatch { .. }
            | Op::MoeCombine
            | Op::MoeSlotDot
            | Op::Reshard(_) => 0,
        }
    }

    /// Which inputs can carry a gradient (token ids, targets and seeds cannot).
    pub fn differentiable_inputs(&self, num_inputs: usize) -> Vec<bool> {
        let all = |b: bool| vec![b; num_inputs];
        match self {
            Op::Parameter { .. } | Op::Input(_) | Op::OptimizerState { .. } | Op::Fill { .. } => {
                all(false)
            }
            // Inference ops are never differentiated.
            Op::KvCache(_) | Op::CacheWrite | Op::SelectPositions => all(false),
            // A quantised weight is frozen: only x carries a gradient.
            Op::QMatMul(_) => vec![true, false, false],
            // Positions and starts carry no gradient.
            Op::Attention(_) if num_inputs == 4 => vec![true, true, true, false],
            Op::Rope { .. } if num_inputs == 2 => vec![true, false],
            Op::Embedding { .. } => vec![true, false],
            // The vocabulary-parallel loss's log-sum-exp input takes no gradient (see the op).
            // Targets take no gradient.
            Op::LinearCrossEntropy { .. } => vec![true, true, false],
            Op::CrossEntropy { .. } => {
                let mut d = all(false);
                d[0] = true;
                d
            }
            Op::Dropout { .. } => vec![true, false],
            // Indices and slots carry no gradient; rows and weights do.
            Op::TopK { .. } => vec![true],
            Op::TakeAlong => vec![true, false],
            Op::ScatterAlong { .. } => vec![false, true],
            Op::MoeSlots { .. } => vec![false],
            Op::MoeDispatch { .. } | Op::MoeCombine => {
                let mut d = all(false);
                d[0] = true;
                if let Some(w) = d.get_mut(2) {
                    *w = true;
                }
                d
            }
            Op::Unary(_)
            | Op::Binary(_)
            | Op::Cast(_)
            | Op::MatMul { .. }
            | Op::Reduce { .. }
            | Op::Softmax
            | Op::LogSumExp
            | Op::Reshape(_)
            | Op::Permute(_)
            | Op::Slice { .. }
            | Op::Pad { .. }
            | Op::Concat { .. }
            | Op::Expand(_)
            | Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::Attention(_)
            | Op::AttentionMerge
            | Op::Rope { .. }
            | Op::Reshard(_)
            | Op::Transfer { .. }
            | Op::Send(_)
            | Op::Conv2d(_)
            | Op::GroupNorm { .. }
            | Op::MaxPool2d(_)
            | Op::AvgPool2d { .. }
            | Op::TiledMlp(_)
            | Op::Upsample2d { .. } => all(true),
            Op::Recv(..) => all(false),
            // Only a last merge's own q, k, v: the chain before it takes no gradient.
            Op::RingMerge(m) => {
                let mut d = all(false);
                if m.backward.is_some() {
                    d.iter_mut().skip(4).for_each(|x| *x = true);
                }
                d
            }
            // Backward ops and the optimizer are not differentiated again.
            Op::UnaryBackward(_)
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
            | Op::AttentionMergeBackward
            | Op::Conv2dBackwardInput { .. }
            | Op::QMatMulBackward(_)
            | Op::Conv2dBackwardWeight { .. }
            | Op::GroupNormBackward { .. }
            | Op::MaxPool2dBackward(_)
            | Op::AvgPool2dBackward { .. }
            | Op::Upsample2dBackward { .. }
            | Op::MoeSlotDot
            | Op::AdamW(_) => all(false),
        }
    }

    /// Emits the backward nodes of one forward node: the gradient of each input (or `None`)
    /// given the gradients reaching its outputs.
    pub(crate) fn vjp(&self, cx: &mut VjpCtx<'_>) -> Result<Vec<Option<Grad>>> {
        match self {
            Op::Parameter { .. }
            | Op::Input(_)
            | Op::OptimizerState { .. }
            | Op::Fill { .. }
            | Op::KvCache(_) => Ok(vec![]),
            Op::Unary(u) => elementwise::vjp_unary(cx, *u),
            Op::Binary(b) => elementwise::vjp_binary(cx, *b),
            Op::Cast(_) => elementwise::vjp_cast(cx),
            Op::Dropout { p, stream, shard } => elementwise::vjp_dropout(cx, *p, *stream, shard),
            Op::MatMul { trans_a, trans_b } => matmul::vjp(cx, *trans_a, *trans_b),
            Op::Reduce { op, dims, keepdim } => reduce::vjp_reduce(cx, *op, dims, *keepdim),
            Op::Softmax => reduce::vjp_softmax(cx),
            Op::Reshape(_) => layout::vjp_reshape(cx),
            Op::Permute(p) => layout::vjp_permute(cx, p),
            Op::Slice { dim, start, end } => layout::vjp_slice(cx, *dim, *start, *end),
            Op::Pad { dim, before, .. } => layout::vjp_pad(cx, *dim, *before),
            Op::Concat { dim } => layout::vjp_concat(cx, *dim),
            Op::Expand(_) => layout::vjp_expand(cx),
            Op::LayerNorm { eps } => norm::vjp_layer_norm(cx, *eps),
            Op::RmsNorm { eps } => norm::vjp_rms_norm(cx, *eps),
            Op::Embedding { rows } => embedding::vjp(cx, rows.clone()),
            Op::LinearCrossEntropy { chunk_rows, ignore_index } => {
                linear_loss::vjp(cx, *chunk_rows, *ignore_index)
            }
            Op::TiledMlp(spec) => tiled_mlp::vjp(cx, spec),
            Op::CrossEntropy { ignore_index, sum, classes } => {
                loss::vjp(cx, *ignore_index, *sum, classes)
            }
            Op::LogSumExp => loss::vjp_logsumexp(cx),
            Op::Attention(spec) => attention::vjp(cx, spec),
            Op::AttentionMerge => attention::vjp_merge(cx),
            Op::RingMerge(m) => ring::vjp(cx, m),
            Op::Rope { inv_freq, inverse } => attention::vjp_rope(cx, inv_freq, *inverse),
            Op::Reshard(spec) => comm::vjp(cx, spec),
            Op::Send(p) => comm::vjp_send(cx, *p),
            Op::Recv(p, _) => comm::vjp_recv(cx, *p),
            Op::Transfer { from, to } => comm::vjp_transfer(cx, *from, *to),
            Op::Conv2d(spec) => vision::vjp_conv(cx, spec),
            Op::GroupNorm { groups, eps } => vision::vjp_group_norm(cx, *groups, *eps),
            Op::MaxPool2d(pool) => vision::vjp_max_pool(cx, pool),
            Op::AvgPool2d { pool, count_include_pad } => {
                vision::vjp_avg_pool(cx, pool, *count_include_pad)
            }
            Op::Upsample2d { scale } => vision::vjp_upsample(cx, *scale),
            Op::TopK { .. } => moe::vjp_top_k(cx),
            Op::TakeAlong => moe::vjp_take_along(cx),
            Op::ScatterAlong { .. } => moe::vjp_scatter_along(cx),
            Op::MoeSlots { .. } => Ok(vec![None]),
            Op::MoeDispatch { .. } => moe::vjp_dispatch(cx),
            Op::MoeCombine => moe::vjp_combine(cx),
            Op::UnaryBackward(_)
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
            | Op::AttentionMergeBackward
            | Op::Conv2dBackwardInput { .. }
            | Op::QMatMulBackward(_)
            | Op::Conv2dBackwardWeight { .. }
            | Op::GroupNormBackward { .. }
            | Op::MaxPool2dBackward(_)
            | Op::AvgPool2dBackward { .. }
            | Op::Upsample2dBackward { .. }
            | Op::MoeSlotDot
            | Op::AdamW(_) => Err(crate::IrError::Graph(format!(
                "{} has no VJP: backward and optimizer ops are not differentiated again",
                self.name()
            ))),
            Op::QMatMul(q) => quant::vjp(cx, *q),
            Op::CacheWrite | Op::SelectPositions => Err(crate::IrError::Graph(format!(
                "{} is an inference op: inference Programs are not differentiated",
                self.name()
            ))),
        }
    }
}

/// Shared checks used by the family modules.
pub(crate) fn expect_inputs(x: &[&TensorMeta], n: usize) -> Result<(), String> {
    if x.len() == n {
        Ok(())
    } else {
        Err(format!("expects {n} input(s), got {}", x.len()))
    }
}

pub(crate) fn expect_float(m: &TensorMeta, what: &str) -> Result<(), String> {
    if m.dtype.is_float() {
        Ok(())
    } else {
        Err(format!("{what} must be a float tensor, got {}", m.dtype))
    }
}

pub(crate) fn expect_int(m: &TensorMeta, what: &str) -> Result<(), String> {
    if m.dtype.is_int() {
        Ok(())
    } else {
        Err(format!("{what} must be an integer tensor, got {}", m.dtype))
    }
}

pub(crate) fn expect_same(a: &TensorMeta, b: &TensorMeta, what: &str) -> Result<(), String> {
    if a == b {
        Ok(())
    } else {
        Err(format!("{what}: {a} vs {b} must match"))
    }
}
