//! Layers shared by the model files: each is a few IR ops under its Hugging Face module name,
//! so parameters come out as `<scope>.<name>.weight`.

use crate::{InputKind, ModelInput};
use tessera_ir::{Builder, DType, IrError, Shape, TensorId};

pub(crate) type IrResult<T> = std::result::Result<T, IrError>;

/// `nn.Linear` named `name`: weight `[out, in]` (PyTorch layout), `y = x·Wᵀ (+ b)`.
pub(crate) fn linear(
    b: &mut Builder,
    name: &str,
    x: TensorId,
    out_dim: usize,
    bias: bool,
) -> IrResult<TensorId> {
    let (in_dim, dtype) = (b.shape(x).last(), b.dtype(x));
    b.scoped(name, |b| {
        let w = b.parameter("weight", [out_dim, in_dim], dtype);
        let y = b.matmul(x, w, false, true)?;
        if bias {
            let bias = b.parameter("bias", [out_dim], dtype);
            b.add(y, bias)
        } else {
            Ok(y)
        }
    })
}

/// GPT-2's `Conv1D` named `name`: weight `[in, out]`, `y = x·W + b`.
pub(crate) fn conv1d(
    b: &mut Builder,
    name: &str,
    x: TensorId,
    out_dim: usize,
) -> IrResult<TensorId> {
    let (in_dim, dtype) = (b.shape(x).last(), b.dtype(x));
    b.scoped(name, |b| {
        let w = b.parameter("weight", [in_dim, out_dim], dtype);
        let bias = b.parameter("bias", [out_dim], dtype);
        let y = b.matmul(x, w, false, false)?;
        b.add(y, bias)
    })
}

/// `nn.LayerNorm` over the last dim, named `name`.
pub(crate) fn layer_norm(b: &mut Builder, name: &str, x: TensorId, eps: f64) -> IrResult<TensorId> {
    let (dim, dtype) = (b.shape(x).last(), b.dtype(x));
    b.scoped(name, |b| {
        let w = b.parameter("weight", [dim], dtype);
        let bias = b.parameter("bias", [dim], dtype);
        b.layer_norm(x, w, bias, eps)
    })
}

/// The residual stream's dtype, whatever the compute dtype (Megatron's
/// `--fp32-residual-connection`, and what autocast does implicitly): in bf16, each block's
/// small update to the stream would be rounded away.
pub(crate) const RESIDUAL_DTYPE: DType = DType::F32;

/// `x` in `dtype` (a cast only when it differs).
pub(crate) fn to(b: &mut Builder, x: TensorId, dtype: DType) -> IrResult<TensorId> {
    if b.dtype(x) == dtype {
        Ok(x)
    } else {
        b.cast(x, dtype)
    }
}

/// `nn.LayerNorm` with `dtype` weights applied to the (fp32) residual stream, its output in
/// `dtype` for the matmuls that follow.
pub(crate) fn layer_norm_to(
    b: &mut Builder,
    name: &str,
    x: TensorId,
    eps: f64,
    dtype: DType,
) -> IrResult<TensorId> {
    let dim = b.shape(x).last();
    let y = b.scoped(name, |b| {
        let w = b.parameter("weight", [dim], dtype);
        let bias = b.parameter("bias", [dim], dtype);
        b.layer_norm(x, w, bias, eps)
    })?;
    to(b, y, dtype)
}

/// `LlamaRMSNorm` with `dtype` weights on the residual stream, output in `dtype`.
pub(crate) fn rms_norm_to(
    b: &mut Builder,
    name: &str,
    x: TensorId,
    eps: f64,
    dtype: DType,
) -> IrResult<TensorId> {
    let dim = b.shape(x).last();
    let y = b.scoped(name, |b| {
        let w = b.parameter("weight", [dim], dtype);
        b.rms_norm(x, w, eps)
    })?;
    to(b, y, dtype)
}

/// The causal-LM head: logits over `vocab` from `x`, through the token embedding `tied` when
/// the head shares it (`x·Eᵀ`), else through its own `lm_head` linear layer.
pub(crate) fn lm_head(
    b: &mut Builder,
    x: TensorId,
    tied: Option<TensorId>,
    vocab: usize,
) -> IrResult<TensorId> {
    match tied {
        Some(embedding) => b.scoped("lm_head", |b| b.matmul(x, embedding, false, true)),
        None => linear(b, "lm_head", x, vocab, false),
    }
}

/// `[B, S, H·D]` → `[B, S, H, D]`.
pub(crate) fn split_heads(b: &mut Builder, x: TensorId, heads: usize) -> IrResult<TensorId> {
    let d = b.shape(x).dims().to_vec();
    match d.as_slice() {
        &[batch, seq, width] => b.reshape(x, [batch, seq, heads, width / heads]),
        _ => Err(IrError::Graph(format!("split_heads expects [B, S, H·D], got {}", b.meta(x)))),
    }
}

/// `[B, S, H, D]` → `[B, S, H·D]`.
pub(crate) fn merge_heads(b: &mut Builder, x: TensorId) -> IrResult<TensorId> {
    let d = b.shape(x).dims().to_vec();
    match d.as_slice() {
        &[batch, seq, heads, head_dim] => b.reshape(x, [batch, seq, heads * head_dim]),
        _ => Err(IrError::Graph(format!("merge_heads expects [B, S, H, D], got {}", b.meta(x)))),
    }
}

/// The step's data inputs, declared at the root scope so they carry their plain names.
pub(crate) struct Inputs {
    pub(crate) list: Vec<ModelInput>,
}

impl Inputs {
    pub(crate) fn new() -> Inputs {
        Inputs { list: Vec::new() }
    }

    pub(crate) fn add(
        &mut self,
        b: &mut Builder,
        name: &'static str,
        shape: impl Into<Shape>,
        dtype: DType,
        kind: InputKind,
    ) -> TensorId {
        let tensor = b.input(name, shape, dtype);
        self.list.push(ModelInput { name, tensor, kind });
        tensor
    }

    /// Token targets `labels [batch, seq]` (HF's −100 ignored) and the step's count of the
    /// targets that are not, `num_targets` (f32 scalar): the inputs of [`mean_over_targets`].
    pub(crate) fn counted_targets(
        &mut self,
        b: &mut Builder,
        batch: usize,
        seq: usize,
        vocab: usize,
    ) -> (TensorId, TensorId) {
        let kind = InputKind::Labels { num_classes: vocab, ignore_index: Some(IGNORE_INDEX) };
        let labels = self.add(b, "labels", [batch, seq], DType::I64, kind);
        let count = self.add(b, "num_targets", Shape::scalar(), DType::F32, InputKind::TargetCount);
        (labels, count)
    }

    /// Declares the dropout `seed` (an i64 scalar) when any dropout probability is positive.
    pub(crate) fn dropout(&mut self, b: &mut Builder, probs: &[f64]) -> Dropout {
        let seed = probs
            .iter()
            .any(|&p| p > 0.0)
            .then(|| self.add(b, "seed", Shape::scalar(), DType::I64, InputKind::Seed));
        Dropout { seed, next_stream: 0 }
    }
}

/// Dropout call sites: each gets its own RNG stream of the step's seed.
pub(crate) struct Dropout {
    seed: Option<TensorId>,
    next_stream: u64,
}

impl Dropout {
    /// `x` with dropout `p` under scope `name`; the identity when `p` is 0.
    pub(crate) fn apply(
        &mut self,
        b: &mut Builder,
        name: &str,
        x: TensorId,
        p: f64,
    ) -> IrResult<TensorId> {
        if p <= 0.0 {
            return Ok(x);
        }
        let Some(seed) = self.seed else {
            return Err(IrError::Graph(format!(
                "{}: dropout {p} without a declared seed input",
                b.scope_path()
            )));
        };
        let stream = self.next_stream;
        self.next_stream += 1;
        b.scoped(name, |b| b.dropout(x, p, seed, stream))
    }
}

/// HF's `CrossEntropyLoss` default `ignore_index`: a target the loss skips (prompt tokens,
/// padding, unmasked positions).
pub const IGNORE_INDEX: i64 = -100;

/// The mean cross-entropy over a step's counted targets ([`Inputs::counted_targets`]): the
/// sum over this graph's targets divided by the count over the whole step (an input), so
/// every micro-batch and shard of every plan adds up to exactly the single-device mean, and
/// ignored targets (−100) count nowhere.
pub(crate) fn mean_over_targets(
    b: &mut Builder,
    logits: TensorId,
    labels: TensorId,
    num_targets: TensorId,
) -> IrResult<TensorId> {
    let sum = b.cross_entropy_sum(logits, labels, Some(IGNORE_INDEX))?;
    b.div(sum, num_targets)
}
