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

/// `nn.LayerNorm` applied to `x` (the fp32 residual stream), its weight and bias held in `x`'s
/// dtype, its output in `dtype` for the matmuls that follow. In bf16 the weights stay fp32, as
/// autocast keeps them: a bf16 weight near 1 moves only by whole ulps of 2⁻⁸–2⁻⁷, so the
/// forward would not see the first ~10–30 AdamW steps' updates the fp32 masters hold
/// (`scripts/bf16_grad_budget.py`: after 8 steps, the main part of bf16's loss error).
pub(crate) fn layer_norm_to(
    b: &mut Builder,
    name: &str,
    x: TensorId,
    eps: f64,
    dtype: DType,
) -> IrResult<TensorId> {
    let dim = b.shape(x).last();
    let held = b.dtype(x);
    let y = b.scoped(name, |b| {
        let w = b.parameter("weight", [dim], held);
        let bias = b.parameter("bias", [dim], held);
        b.layer_norm(x, w, bias, eps)
    })?;
    to(b, y, dtype)
}

/// `LlamaRMSNorm` on `x` (the residual stream), its weight in `x`'s dtype (fp32 there, as
/// [`layer_norm_to`]'s), output in `dtype`.
pub(crate) fn rms_norm_to(
    b: &mut Builder,
    name: &str,
    x: TensorId,
    eps: f64,
    dtype: DType,
) -> IrResult<TensorId> {
    let dim = b.shape(x).last();
    let held = b.dtype(x);
    let y = b.scoped(name, |b| {
        let w = b.parameter("weight", [dim], held);
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
        // An embedding table held in another dtype than the head's is rounded to it for the
        // product, as autocast rounds it.
        Some(embedding) => b.scoped("lm_head", |b| {
            let dtype = b.dtype(x);
            let e = to(b, embedding, dtype)?;
            b.matmul(x, e, false, true)
        }),
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

/// Weight-only quantisation of a generation graph's linear layers (`--quantize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Quantize {
    /// int8, one scale per output channel.
    Int8,
    /// int4, one scale per group of [`INT4_GROUP`] input features (fewer where a layer's
    /// width is not a multiple of it).
    Int4,
}

/// Input features per int4 scale (GPTQ's and AWQ's usual 128).
pub const INT4_GROUP: usize = 128;

impl Quantize {
    pub fn parse(s: &str) -> Option<Quantize> {
        match s.trim().to_ascii_lowercase().as_str() {
            "int8" | "i8" => Some(Quantize::Int8),
            "int4" | "i4" => Some(Quantize::Int4),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Quantize::Int8 => "int8",
            Quantize::Int4 => "int4",
        }
    }
    /// The spec of a layer with `k` input features: int4 groups of [`INT4_GROUP`], or of the
    /// largest even divisor of `k` below it.
    pub fn spec(self, k: usize) -> tessera_ir::QuantSpec {
        match self {
            Quantize::Int8 => tessera_ir::QuantSpec { bits: 8, group: k.max(1) },
            Quantize::Int4 => {
                let group =
                    (2..=INT4_GROUP.min(k)).rev().find(|g| g % 2 == 0 && k.is_multiple_of(*g));
                tessera_ir::QuantSpec { bits: 4, group: group.unwrap_or(2) }
            }
        }
    }
}

/// A quantised weight of a generation graph: the `u8` weight and its f32 scales, both made at
/// load time from the checkpoint's float tensor `source`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct QuantizedWeight {
    /// The `u8` `[N, K·bits/8]` parameter (named as the float weight it replaces).
    pub weight: TensorId,
    /// The f32 `[N, K/group]` parameter `<source>_scale`.
    pub scales: TensorId,
    /// The checkpoint's tensor (Hugging Face name).
    pub source: String,
    /// Whether the checkpoint stores it `[in, out]` (GPT-2's `Conv1D`), so it is transposed
    /// before quantising to `[out, in]`.
    pub transposed: bool,
    pub spec: tessera_ir::QuantSpec,
}

/// The generation-step inputs of a causal LM, and what the step builds differently: a KV cache
/// per attention layer, positions from the inputs, logits at one position per row.
pub(crate) struct Generation {
    /// `[B]`: the cache position of each row's first token in this step.
    pub(crate) start: TensorId,
    /// `[B, S]`: each token's position (`start[b] + i`).
    pub(crate) positions: TensorId,
    /// `[B]`: the step position whose logits each row wants (its last real token); `None`:
    /// logits at every position.
    pub(crate) last: Option<TensorId>,
    pub(crate) capacity: usize,
    pub(crate) quantize: Option<Quantize>,
    pub(crate) quantized: Vec<QuantizedWeight>,
}

/// What a causal-LM graph computes: a training step (loss over every position) or one step of
/// generation. The family builders call its layers, which differ between the two.
pub(crate) enum Decoder {
    Train { labels: TensorId, num_targets: TensorId },
    Generate(Generation),
}

impl Decoder {
    /// Declares the step's inputs (after `input_ids`) for `opts`.
    fn new(
        b: &mut Builder,
        inputs: &mut Inputs,
        opts: &crate::BuildOptions,
        generate: Option<&crate::GenerateOptions>,
        vocab: usize,
    ) -> Decoder {
        let (batch, seq) = (opts.batch, opts.seq);
        match generate {
            None => {
                let (labels, num_targets) = inputs.counted_targets(b, batch, seq, vocab);
                Decoder::Train { labels, num_targets }
            }
            Some(g) => {
                let start =
                    inputs.add(b, "cache_start", [batch], DType::I64, InputKind::CacheStart);
                let positions =
                    inputs.add(b, "position_ids", [batch, seq], DType::I64, InputKind::Positions);
                let last = (!g.all_logits).then(|| {
                    inputs.add(b, "last_index", [batch], DType::I64, InputKind::LastIndex)
                });
                Decoder::Generate(Generation {
                    start,
                    positions,
                    last,
                    capacity: g.capacity,
                    quantize: g.quantize,
                    quantized: Vec::new(),
                })
            }
        }
    }

    pub(crate) fn generation(&self) -> Option<&Generation> {
        match self {
            Decoder::Generate(g) => Some(g),
            Decoder::Train { .. } => None,
        }
    }

    /// `nn.Linear` (quantised when generating with `--quantize`).
    pub(crate) fn linear(
        &mut self,
        b: &mut Builder,
        name: &str,
        x: TensorId,
        out_dim: usize,
        bias: bool,
    ) -> IrResult<TensorId> {
        match self.quantizer() {
            Some(q) => self.quantized(b, name, x, out_dim, bias, q, false),
            None => linear(b, name, x, out_dim, bias),
        }
    }

    /// GPT-2's `Conv1D` (quantised when generating with `--quantize`).
    pub(crate) fn conv1d(
        &mut self,
        b: &mut Builder,
        name: &str,
        x: TensorId,
        out_dim: usize,
    ) -> IrResult<TensorId> {
        match self.quantizer() {
            Some(q) => self.quantized(b, name, x, out_dim, true, q, true),
            None => conv1d(b, name, x, out_dim),
        }
    }

    fn quantizer(&self) -> Option<Quantize> {
        self.generation().and_then(|g| g.quantize)
    }

    #[allow(clippy::too_many_arguments)]
    fn quantized(
        &mut self,
        b: &mut Builder,
        name: &str,
        x: TensorId,
        out_dim: usize,
        bias: bool,
        q: Quantize,
        transposed: bool,
    ) -> IrResult<TensorId> {
        let (in_dim, dtype) = (b.shape(x).last(), b.dtype(x));
        let spec = q.spec(in_dim);
        let (y, w, s, source) = b.scoped(name, |b| {
            let source = format!("{}.weight", b.scope_path());
            let w = b.parameter("weight", [out_dim, spec.row_bytes(in_dim)], DType::U8);
            let s = b.parameter("weight_scale", [out_dim, in_dim / spec.group], DType::F32);
            let mut y = b.qmatmul(x, w, s, spec)?;
            if bias {
                let bias = b.parameter("bias", [out_dim], dtype);
                y = b.add(y, bias)?;
            }
            Ok::<_, IrError>((y, w, s, source))
        })?;
        if let Decoder::Generate(g) = self {
            g.quantized.push(QuantizedWeight { weight: w, scales: s, source, transposed, spec });
        }
        Ok(y)
    }

    /// Causal self-attention of `q [B,S,H,E]` over `k, v [B,S,Hkv,E]`: over the step alone when
    /// training, over the layer's KV cache (written first) when generating.
    pub(crate) fn attention(
        &self,
        b: &mut Builder,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        spec: tessera_ir::AttentionSpec,
    ) -> IrResult<TensorId> {
        let Some(g) = self.generation() else { return b.attention(q, k, v, spec) };
        let km = b.meta(k).clone();
        let d = km.shape.dims();
        let cache = [d[0], g.capacity, d[2], d[3]];
        let kc = b.kv_cache("k_cache", cache, km.dtype);
        let vc = b.kv_cache("v_cache", cache, km.dtype);
        let kc = b.cache_write(kc, k, g.start)?;
        let vc = b.cache_write(vc, v, g.start)?;
        b.attention_at(q, kc, vc, g.start, spec)
    }

    /// RoPE at the tokens' positions.
    pub(crate) fn rope(
        &self,
        b: &mut Builder,
        x: TensorId,
        inv_freq: &[f64],
    ) -> IrResult<TensorId> {
        match self.generation() {
            Some(g) => b.rope_at(x, g.positions, inv_freq),
            None => b.rope(x, inv_freq),
        }
    }

    /// The rows of `x [B,S,D]` the head reads: every position when training, each row's last
    /// real token (`[B,1,D]`) when generating.
    pub(crate) fn head_rows(&self, b: &mut Builder, x: TensorId) -> IrResult<TensorId> {
        match self.generation().and_then(|g| g.last) {
            Some(last) => b.select_positions(x, last),
            None => Ok(x),
        }
    }

    /// Declares the step's `input_ids [B, S]` and its other inputs: the decoder and the ids.
    pub(crate) fn start(
        b: &mut Builder,
        inputs: &mut Inputs,
        opts: &crate::BuildOptions,
        generate: Option<&crate::GenerateOptions>,
        vocab: usize,
    ) -> (Decoder, TensorId) {
        let kind = InputKind::TokenIds { vocab_size: vocab };
        let ids = inputs.add(b, "input_ids", [opts.batch, opts.seq], DType::I64, kind);
        (Decoder::new(b, inputs, opts, generate, vocab), ids)
    }

    /// The graph's end: the training loss of `logits`, or (generating) the f32 logits
    /// themselves, and the built graph.
    pub(crate) fn finish(
        self,
        b: Builder,
        inputs: Inputs,
        logits: TensorId,
    ) -> IrResult<crate::Built> {
        self.finish_with(b, inputs, logits, None)
    }

    /// [`Decoder::finish`] with a scalar `aux` term added to the training loss (an MoE
    /// model's router auxiliary loss); generation ignores it.
    pub(crate) fn finish_with(
        self,
        mut b: Builder,
        inputs: Inputs,
        logits: TensorId,
        aux: Option<TensorId>,
    ) -> IrResult<crate::Built> {
        let (loss, logits, quantized) = match self {
            Decoder::Train { labels, num_targets } => {
                let mut loss = mean_over_targets(&mut b, logits, labels, num_targets)?;
                if let Some(aux) = aux {
                    loss = b.add(loss, aux)?;
                }
                (Some(loss), logits, Vec::new())
            }
            Decoder::Generate(g) => {
                let l = b.scoped("lm_head", |b| to(b, logits, DType::F32))?;
                (None, l, g.quantized)
            }
        };
        Ok(crate::Built { builder: b, loss, logits, inputs: inputs.list, quantized })
    }
}
