//! Reference interpreter: evaluates a [`Graph`] on plain `f64` data.
//!
//! This is the oracle the rest of Tessera is checked against: the finite-difference tests of
//! every VJP rule run on it today, and the fast runtime's kernels are compared with it later.
//! It is written for clarity — plain loops over row-major `Vec<f64>`, one function per op —
//! with only as much care for speed as keeps whole small training graphs (an 8-layer,
//! 256-wide transformer on 16 tokens) well under a second in the dev profile: matmuls copy a
//! transposed operand once and then run a contiguous `i-k-j` loop, broadcasts and reductions
//! precompute their index maps, nothing is quadratic in the tensor size.
//!
//! # API
//!
//! - [`Value`]: a shape and row-major `f64` data. Every dtype is held as `f64` (integer and
//!   bool tensors hold whole numbers).
//! - [`eval`]: runs every node of a graph and returns the value of every tensor.
//! - [`eval_outputs`]: runs only the nodes the requested tensors depend on, dropping each
//!   intermediate after its last reader (cheap re-evaluation of a loss for finite differences,
//!   or of a training step's outputs).
//! - [`eval_op`]: one op on concrete inputs (for kernel tests).
//! - [`init_train_state`] and [`train_step`]: run a [`TrainingGraph`] step by step, feeding the
//!   AdamW outputs back as the next step's parameters and optimizer state.
//! - [`erf`] and [`erfc`], accurate to about 1e-15, as exact GELU needs.
//!
//! Leaves: `Parameter`, `Input` and `OptimizerState` tensors must be bound by the caller (an
//! error names the leaf's scope otherwise); their shapes are checked against the graph's
//! metas, and integer / bool leaves must hold whole numbers. `Fill` is materialised. Every
//! computed output is checked against the meta the graph inferred for it.
//!
//! # Semantic conventions
//!
//! The op comments in [`crate::ops`] define each op; where they leave a choice open, this
//! interpreter (and therefore every runtime that matches it) does the following.
//!
//! - **Precision.** Everything is computed in `f64` whatever the dtype says: a cast to a float
//!   type leaves values unchanged (no rounding to f32/bf16), a cast to `i32`/`i64` truncates
//!   toward zero (as Rust `as` and `torch` do), a cast to `bool` gives 1 for non-zero.
//! - **Broadcasting** is NumPy's (right-aligned, size-1 dims stretch) for `Binary`, `Expand`
//!   and the batch dims of `MatMul`, where either operand may have fewer batch dims.
//! - **`BinaryBackward`** returns the gradient in the broadcast *output* shape (autodiff
//!   unbroadcasts it). `Max`/`Min` send the whole gradient to `a` on ties (`a >= b` for max,
//!   `a <= b` for min); forward `Max`/`Min` propagate NaN.
//! - **Unary ops**: `Relu`'s derivative at exactly 0 is 0. **`Gelu`** is `x·Φ(x)` with
//!   `Φ(x) = erfc(−x/√2)/2` ([`erfc`] here, not an approximation); **`GeluTanh`** is
//!   `0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))`. `UnaryBackward` is `dy·f'(x)`.
//! - **`Reduce` `Max`** returns the maximum (NaN propagates); its backward sends each output's
//!   gradient to the *first* maximal element in row-major order of the input, the rest get 0.
//!   `Mean` divides by the number of reduced elements; an empty `dims` list is the identity;
//!   `SumSquares` is `Σ x²` with backward `2x·dy`.
//! - **`Softmax`** and its backward (`dx = y·(dy − Σ y·dy)`) work over the last dim.
//! - **`LayerNorm`** uses the biased variance: `y = (x − mean)/sqrt(var + eps)·w + b`; its
//!   backward recomputes the row statistics from `x`. **`RmsNorm`** is
//!   `y = x/sqrt(mean(x²) + eps)·w`.
//! - **`Embedding`** and **`CrossEntropy`** reject ids / targets that are not whole numbers in
//!   range (a target equal to `ignore_index` excepted). `CrossEntropy` computes the
//!   log-sum-exp of every row, ignored ones included; the loss is the mean over non-ignored
//!   rows, and **0 when every row is ignored** (the divisor is `max(count, 1)`), so the
//!   gradient is 0 then too. `CrossEntropyBackward` gives ignored rows a zero gradient.
//! - **`Attention`**: head `h` reads kv head `h / (H / Hkv)`; scores are `scale·q·kᵀ`. Query
//!   `i` sits at position `p = i + (T − S)` of the key sequence (the queries are the *last* S
//!   positions; `p = i` when `T == S`, the usual case). `causal` masks keys `j > p`;
//!   `window: Some(w)` masks keys `j ≤ p − w` (with or without `causal`). A query with every
//!   key masked gets a zero output, a log-sum-exp of −∞ and zero gradients. The backward
//!   recomputes the probabilities from the saved log-sum-exp and uses `Σ_d dout·out` as the
//!   softmax-backward row term (FlashAttention's `D`); dk and dv sum over the query heads
//!   sharing a kv head.
//! - **`Rope`**: rotate-half layout, position = sequence index `s`; for pair `i < D/2`,
//!   `θ = s·inv_freq[i]`, `out[i] = x[i]·cos θ − x[i+D/2]·sin θ`,
//!   `out[i+D/2] = x[i+D/2]·cos θ + x[i]·sin θ`; `inverse` uses −θ.
//! - **`Dropout`**: the seed (an i64 scalar) is reinterpreted as `u64`; element `k` (flat
//!   row-major index of the whole tensor) is kept iff [`dropout_keep`]`(seed, stream, k, p)`,
//!   and kept elements are scaled by `1/(1−p)`.
//! - **Layout ops** copy (`Reshape` and `Expand` are views only for memory accounting); `Pad`
//!   fills with zeros; `Permute(perm)` gives output dim `i` the input's dim `perm[i]`.
//! - **`AdamW`** implements the formula in the doc comment of [`Op::AdamW`] exactly (the
//!   `grad_scale` input and its skip-on-overflow rule included); `step` must be ≥ 1 (it is
//!   1-based). Outputs are fresh values (the in-place aliasing is a memory
//!   matter the interpreter ignores).

use crate::ops::elementwise::dropout_keep;
use crate::ops::optim;
use crate::ops::reduce::reduced_shape;
use crate::{
    AdamWSpec, AttentionSpec, BinaryOp, DType, Graph, IrError, Op, ReduceOp, Result, Shape,
    TensorId, TrainingGraph, UnaryOp,
};
use std::borrow::Cow;
use std::collections::HashMap;

/// A concrete tensor: a shape and its elements in row-major order, all as `f64`.
#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    pub shape: Shape,
    pub data: Vec<f64>,
}

impl Value {
    /// Panics when `data` does not have `shape`'s element count.
    pub fn new(shape: impl Into<Shape>, data: Vec<f64>) -> Value {
        let shape = shape.into();
        assert_eq!(
            shape.numel() as usize,
            data.len(),
            "a value of shape {shape} needs {} elements",
            shape.numel()
        );
        Value { shape, data }
    }

    /// A rank-0 value.
    pub fn scalar(x: f64) -> Value {
        Value { shape: Shape::scalar(), data: vec![x] }
    }

    /// Every element equal to `x`.
    pub fn full(shape: impl Into<Shape>, x: f64) -> Value {
        let shape = shape.into();
        let n = shape.numel() as usize;
        Value { shape, data: vec![x; n] }
    }

    pub fn zeros(shape: impl Into<Shape>) -> Value {
        Value::full(shape, 0.0)
    }

    /// Element `k` (flat row-major index) is `f(k)`.
    pub fn from_fn(shape: impl Into<Shape>, f: impl FnMut(usize) -> f64) -> Value {
        let shape = shape.into();
        let data = (0..shape.numel() as usize).map(f).collect();
        Value { shape, data }
    }

    /// An integer tensor (token ids, targets, a seed or step) from `i64`s.
    pub fn from_i64(shape: impl Into<Shape>, ids: &[i64]) -> Value {
        Value::new(shape, ids.iter().map(|&i| i as f64).collect())
    }

    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// The only element of a one-element value (a scalar). Panics otherwise.
    pub fn item(&self) -> f64 {
        assert_eq!(self.data.len(), 1, "item() of a value of shape {}", self.shape);
        self.data[0]
    }
}

// ---- graph evaluation ---------------------------------------------------------------------

/// Evaluates every node of `graph` in order and returns the value of every tensor, indexed by
/// [`TensorId::index`]. Every `Parameter`, `Input` and `OptimizerState` must be bound.
pub fn eval(graph: &Graph, bindings: &HashMap<TensorId, Value>) -> Result<Vec<Value>> {
    let env = run(graph, bindings, None)?;
    Ok(env.into_iter().map(|v| v.expect("eval runs every node").into_owned()).collect())
}

/// Evaluates only the nodes that `outputs` depend on and returns their values, in order.
/// Only the leaves those nodes read need to be bound; each intermediate is dropped after its
/// last reader.
pub fn eval_outputs(
    graph: &Graph,
    bindings: &HashMap<TensorId, Value>,
    outputs: &[TensorId],
) -> Result<Vec<Value>> {
    let mut env = run(graph, bindings, Some(outputs))?;
    let mut values = Vec::with_capacity(outputs.len());
    for (k, t) in outputs.iter().enumerate() {
        let slot = &mut env[t.index()];
        let v = if outputs[k + 1..].contains(t) { slot.clone() } else { slot.take() };
        values.push(v.expect("requested outputs are evaluated").into_owned());
    }
    Ok(values)
}

/// Leaves whose values the caller provides (`Fill` is the one leaf the interpreter makes).
fn is_bound_leaf(op: &Op) -> bool {
    match op {
        Op::Parameter(_) | Op::Input(_) | Op::OptimizerState { .. } | Op::KvCache(_) => true,
        Op::Fill { .. }
        | Op::CacheWrite
        | Op::SelectPositions
        | Op::QMatMul(_)
        | Op::Reshard(_)
        | Op::Send(_)
        | Op::Recv(..)
        | Op::Transfer { .. }
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
        | Op::Embedding
        | Op::EmbeddingBackward { .. }
        | Op::CrossEntropy { .. }
        | Op::CrossEntropyBackward { .. }
        | Op::Attention(_)
        | Op::AttentionBackward(_)
        | Op::Rope { .. }
        | Op::AdamW(_) => false,
    }
}

/// Checks one binding against the graph: a bound leaf, the right shape, whole numbers for
/// integer dtypes.
fn check_binding(graph: &Graph, t: TensorId, v: &Value) -> Result<()> {
    if t.index() >= graph.tensors.len() {
        return Err(IrError::Graph(format!(
            "binding for tensor {} but the graph has {} tensors",
            t.0,
            graph.tensors.len()
        )));
    }
    let node = graph.producer(t);
    let scope = graph.tensor_scope(t);
    let meta = graph.meta(t);
    if !is_bound_leaf(&node.op) {
        return Err(IrError::Graph(format!(
            "{scope}: tensor {} is computed by a {} node; only parameters, inputs and \
             optimizer state are bound",
            t.0,
            node.op.name()
        )));
    }
    if v.shape != meta.shape || v.data.len() != meta.shape.numel() as usize {
        return Err(IrError::Graph(format!(
            "{scope}: bound value has shape {} ({} elements) but the {} is {meta}",
            v.shape,
            v.data.len(),
            node.op.name()
        )));
    }
    let whole = match meta.dtype {
        DType::I32 | DType::I64 | DType::Bool | DType::U8 => true,
        DType::F64 | DType::F32 | DType::F16 | DType::BF16 => false,
    };
    if whole {
        if let Some(x) = v.data.iter().find(|x| x.fract() != 0.0) {
            return Err(IrError::Graph(format!(
                "{scope}: the {} is {meta} but its bound value holds {x}",
                node.op.name()
            )));
        }
    }
    Ok(())
}

/// Evaluates the graph. With `wanted`, only the nodes those tensors depend on run and each
/// other value is dropped after its last reader.
fn run<'a>(
    graph: &Graph,
    bindings: &'a HashMap<TensorId, Value>,
    wanted: Option<&[TensorId]>,
) -> Result<Vec<Option<Cow<'a, Value>>>> {
    let nt = graph.tensors.len();
    let nn = graph.nodes.len();
    for (&t, v) in bindings {
        check_binding(graph, t, v)?;
    }
    for &t in wanted.unwrap_or(&[]) {
        if t.index() >= nt {
            return Err(IrError::Graph(format!("requested tensor {} is not in the graph", t.0)));
        }
    }

    // Which nodes run, and (when pruning) where each value is last read.
    let mut needed = vec![wanted.is_none(); nn];
    let mut keep = vec![wanted.is_none(); nt];
    let mut last_use: Vec<Option<usize>> = vec![None; nt];
    if let Some(wanted) = wanted {
        let mut live = vec![false; nt];
        for &t in wanted {
            live[t.index()] = true;
            keep[t.index()] = true;
        }
        for i in (0..nn).rev() {
            let node = &graph.nodes[i];
            if !node.outputs.iter().any(|o| live[o.index()]) {
                continue;
            }
            needed[i] = true;
            // A bound leaf's inputs (an optimizer state's parameter) are not read.
            if !is_bound_leaf(&node.op) {
                for &t in &node.inputs {
                    live[t.index()] = true;
                    if last_use[t.index()].is_none() {
                        last_use[t.index()] = Some(i);
                    }
                }
            }
        }
    }

    let mut env: Vec<Option<Cow<'a, Value>>> = vec![None; nt];
    for (i, node) in graph.nodes.iter().enumerate() {
        if !needed[i] {
            continue;
        }
        let scope = graph.scope_name(node.scope);
        if is_bound_leaf(&node.op) {
            let t = node.outputs[0];
            let v = bindings.get(&t).ok_or_else(|| {
                IrError::Graph(format!(
                    "{scope}: {} {} is not bound (every parameter, input and optimizer state \
                     that the evaluated nodes read needs a value)",
                    node.op.name(),
                    graph.meta(t)
                ))
            })?;
            env[t.index()] = Some(Cow::Borrowed(v));
            continue;
        }
        let inputs: Vec<&Value> = node
            .inputs
            .iter()
            .map(|t| env[t.index()].as_deref().expect("inputs are evaluated before readers"))
            .collect();
        let outs = eval_op(&node.op, &inputs).map_err(|reason| {
            IrError::Graph(format!("{scope}: {} (node {i}): {reason}", node.op.name()))
        })?;
        if outs.len() != node.outputs.len() {
            return Err(IrError::Graph(format!(
                "{scope}: {} (node {i}): interpreter produced {} outputs, the graph has {}",
                node.op.name(),
                outs.len(),
                node.outputs.len()
            )));
        }
        for (&t, v) in node.outputs.iter().zip(outs) {
            let meta = graph.meta(t);
            if v.shape != meta.shape {
                return Err(IrError::Graph(format!(
                    "{scope}: {} (node {i}): interpreter produced shape {} but the graph says {meta}",
                    node.op.name(),
                    v.shape
                )));
            }
            env[t.index()] = Some(Cow::Owned(v));
        }
        if wanted.is_some() {
            for &t in node.inputs.iter().chain(&node.outputs) {
                let dead = last_use[t.index()].is_none_or(|u| u <= i);
                if dead && !keep[t.index()] {
                    env[t.index()] = None;
                }
            }
        }
    }
    Ok(env)
}

// ---- training helpers ---------------------------------------------------------------------

/// The state a [`TrainingGraph`] carries from step to step, for given initial parameter
/// values: the parameters themselves, zero Adam moments and (for low-precision weights)
/// master copies equal to the parameters.
pub fn init_train_state(
    train: &TrainingGraph,
    params: &HashMap<TensorId, Value>,
) -> Result<HashMap<TensorId, Value>> {
    let mut state = HashMap::new();
    for slot in &train.params {
        let p = params.get(&slot.param).ok_or_else(|| {
            IrError::Graph(format!(
                "{}: no initial value for this parameter",
                train.graph.tensor_scope(slot.param)
            ))
        })?;
        state.insert(slot.param, p.clone());
        state.insert(slot.m, Value::zeros(p.shape.clone()));
        state.insert(slot.v, Value::zeros(p.shape.clone()));
        if let Some(master) = slot.master {
            state.insert(master, p.clone());
        }
    }
    Ok(state)
}

/// What one interpreted training step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    pub loss: f64,
    pub grad_norm: f64,
}

/// Runs one training step: binds `state` (parameters and optimizer state), `data` (the other
/// inputs: ids, labels, seeds), the learning rate and the 1-based `step`, then replaces the
/// parameters and optimizer state in `state` with the AdamW outputs.
pub fn train_step(
    train: &TrainingGraph,
    state: &mut HashMap<TensorId, Value>,
    data: &HashMap<TensorId, Value>,
    lr: f64,
    step: u64,
) -> Result<StepStats> {
    // (tensor in state, AdamW output replacing it)
    let mut updates: Vec<(TensorId, TensorId)> = Vec::new();
    for slot in &train.params {
        let node = train
            .graph
            .nodes
            .iter()
            .find(|n| matches!(n.op, Op::AdamW(_)) && n.inputs[optim::PARAM] == slot.param)
            .ok_or_else(|| {
                IrError::Graph(format!(
                    "{}: no AdamW update for this parameter",
                    train.graph.tensor_scope(slot.param)
                ))
            })?;
        let mut olds = vec![slot.param, slot.m, slot.v];
        olds.extend(slot.master);
        updates.extend(olds.into_iter().zip(node.outputs.iter().copied()));
    }

    for &t in data.keys() {
        if state.contains_key(&t) || t == train.lr || t == train.step {
            return Err(IrError::Graph(format!(
                "{}: given as data but it is training state, the learning rate or the step",
                train.graph.tensor_scope(t)
            )));
        }
    }
    let mut bound: Vec<TensorId> = vec![train.lr, train.step];
    state.insert(train.lr, Value::scalar(lr));
    state.insert(train.step, Value::scalar(step as f64));
    for (&t, v) in data {
        state.insert(t, v.clone());
        bound.push(t);
    }
    let mut wanted = vec![train.loss, train.grad_norm];
    wanted.extend(updates.iter().map(|u| u.1));
    let result = eval_outputs(&train.graph, state, &wanted);
    for t in bound {
        state.remove(&t);
    }
    let mut values = result?.into_iter();
    let loss = values.next().expect("loss").item();
    let grad_norm = values.next().expect("grad norm").item();
    for ((old, _), v) in updates.iter().zip(values) {
        state.insert(*old, v);
    }
    Ok(StepStats { loss, grad_norm })
}

// ---- one op ----------------------------------------------------------------------------------

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

/// Evaluates one op on concrete inputs (in the order the op documents) and returns its
/// outputs. Leaves other than `Fill` have no inputs to compute from and are an error. Shapes
/// are expected to be ones [`Op::infer`] accepts; the checks here are only those the loops
/// need to stay in bounds.
pub fn eval_op(op: &Op, x: &[&Value]) -> Result<Vec<Value>, String> {
    let n_inputs = match op {
        Op::Parameter(_) | Op::Input(_) | Op::OptimizerState { .. } | Op::KvCache(_) => {
            return Err(format!("{} takes its value from the bindings", op.name()))
        }
        // Optional inputs: a start per row (attention over a cache), positions (RoPE).
        Op::Attention(_) if x.len() == 4 => 4,
        Op::Rope { .. } if x.len() == 2 => 2,
        Op::CacheWrite | Op::QMatMul(_) => 3,
        Op::SelectPositions => 2,
        Op::Fill { .. } => 0,
        Op::Unary(_) | Op::Cast(_) | Op::Reduce { .. } | Op::Softmax => 1,
        Op::Reshape(_) | Op::Permute(_) | Op::Slice { .. } | Op::Pad { .. } | Op::Expand(_) => 1,
        Op::Rope { .. } | Op::Reshard(_) | Op::Transfer { .. } => 1,
        Op::Send(_) | Op::Recv(..) => {
            return Err(format!(
                "{} moves a value between pipeline stages: it runs on a device mesh (the SPMD \
                 runtime), not in the one-device interpreter",
                op.name()
            ))
        }
        Op::UnaryBackward(_) | Op::Binary(_) | Op::Dropout { .. } | Op::MatMul { .. } => 2,
        Op::ReduceBackward { .. } | Op::SoftmaxBackward | Op::RmsNorm { .. } => 2,
        Op::Embedding | Op::EmbeddingBackward { .. } | Op::CrossEntropy { .. } => 2,
        Op::BinaryBackward { .. } | Op::LayerNorm { .. } | Op::LayerNormBackward { .. } => 3,
        Op::RmsNormBackward { .. } | Op::Attention(_) => 3,
        Op::CrossEntropyBackward { .. } => 4,
        Op::AttentionBackward(_) => 6,
        Op::Concat { .. } => x.len().max(1),
        Op::AdamW(spec) => {
            let base = 7 + usize::from(spec.grad_scale);
            if x.len() == base + 1 {
                base + 1
            } else {
                base
            }
        }
    };
    ensure!(x.len() == n_inputs, "expects {n_inputs} input(s), got {}", x.len());
    let one = |v: Value| Ok(vec![v]);
    match op {
        Op::Parameter(_)
        | Op::Input(_)
        | Op::OptimizerState { .. }
        | Op::KvCache(_)
        | Op::Send(_)
        | Op::Recv(..) => {
            unreachable!("returned above")
        }
        Op::CacheWrite => one(cache_write(x[0], x[1], x[2])?),
        Op::SelectPositions => one(select_positions(x[0], x[1])?),
        Op::QMatMul(q) => one(qmatmul(x[0], x[1], x[2], *q)?),
        Op::Fill { value, meta } => one(Value::full(meta.shape.clone(), *value)),
        // A copy between memory tiers: the same value.
        Op::Transfer { .. } => one(x[0].clone()),
        Op::Reshard(spec) => {
            // One device: groups of one move nothing. Larger groups need a communicator.
            ensure!(
                spec.forward.iter().all(|s| s.size == 1),
                "reshard over more than one device needs a communicator (the SPMD runtime)"
            );
            one(x[0].clone())
        }
        Op::Unary(u) => one(map(x[0], |v| unary(*u, v))),
        Op::UnaryBackward(u) => {
            ensure!(x[0].shape == x[1].shape, "x {} and dy {} differ", x[0].shape, x[1].shape);
            one(zip(x[0], x[1], |v, dy| dy * unary_derivative(*u, v)))
        }
        Op::Binary(b) => one(broadcast_binary(x[0], x[1], |p, q| binary(*b, p, q))?),
        Op::BinaryBackward { op, wrt } => one(binary_backward(*op, *wrt, x[0], x[1], x[2])?),
        Op::Cast(to) => one(map(x[0], |v| cast(*to, v))),
        Op::Dropout { p, stream, shard } => one(dropout(x[0], x[1], *p, *stream, shard.as_ref())?),
        Op::MatMul { trans_a, trans_b } => one(matmul(x[0], x[1], *trans_a, *trans_b)?),
        Op::Reduce { op, dims, keepdim } => one(reduce(x[0], *op, dims, *keepdim)?),
        Op::ReduceBackward { op, dims, keepdim } => {
            one(reduce_backward(x[0], x[1], *op, dims, *keepdim)?)
        }
        Op::Softmax => one(softmax(x[0])?),
        Op::SoftmaxBackward => one(softmax_backward(x[0], x[1])?),
        Op::Reshape(s) => {
            ensure!(s.numel() as usize == x[0].numel(), "cannot reshape {} to {s}", x[0].shape);
            one(Value { shape: s.clone(), data: x[0].data.clone() })
        }
        Op::Permute(perm) => one(permute(x[0], perm)?),
        Op::Slice { dim, start, end } => one(slice(x[0], *dim, *start, *end)?),
        Op::Pad { dim, before, after } => one(pad(x[0], *dim, *before, *after)?),
        Op::Concat { dim } => one(concat(x, *dim)?),
        Op::Expand(s) => one(expand(x[0], s)?),
        Op::LayerNorm { eps } => one(layer_norm(x[0], x[1], x[2], *eps)?),
        Op::LayerNormBackward { eps } => layer_norm_backward(x[0], x[1], x[2], *eps),
        Op::RmsNorm { eps } => one(rms_norm(x[0], x[1], *eps)?),
        Op::RmsNormBackward { eps } => rms_norm_backward(x[0], x[1], x[2], *eps),
        Op::Embedding => one(embedding(x[0], x[1])?),
        Op::EmbeddingBackward { num_embeddings } => {
            one(embedding_backward(x[0], x[1], *num_embeddings)?)
        }
        Op::CrossEntropy { ignore_index, sum } => cross_entropy(x[0], x[1], *ignore_index, *sum),
        Op::CrossEntropyBackward { ignore_index, sum } => {
            one(cross_entropy_backward(x[0], x[1], x[2], x[3], *ignore_index, *sum)?)
        }
        Op::Attention(spec) => attention(x[0], x[1], x[2], x.get(3).copied(), spec),
        Op::AttentionBackward(spec) => attention_backward(x, spec),
        Op::Rope { inv_freq, inverse } => one(rope(x[0], x.get(1).copied(), inv_freq, *inverse)?),
        Op::AdamW(spec) => adamw(x, spec),
    }
}

// ---- index helpers ---------------------------------------------------------------------------

fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

fn strides(dims: &[usize]) -> Vec<usize> {
    Shape::from(dims).strides()
}

/// `Σ_k idx_k·strides[k]` for every multi-index `idx` of `dims`, in row-major order.
fn strided_offsets(dims: &[usize], strides: &[usize]) -> Vec<usize> {
    let n = numel(dims);
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let mut idx = vec![0; dims.len()];
    let mut off = 0;
    for _ in 0..n {
        out.push(off);
        for k in (0..dims.len()).rev() {
            idx[k] += 1;
            off += strides[k];
            if idx[k] < dims[k] {
                break;
            }
            off -= strides[k] * dims[k];
            idx[k] = 0;
        }
    }
    out
}

/// Strides that read a row-major tensor of shape `from` as if broadcast to `to` (0 along
/// stretched and missing dims). `None` when `from` does not broadcast to `to`.
fn broadcast_strides(from: &[usize], to: &[usize]) -> Option<Vec<usize>> {
    if from.len() > to.len() {
        return None;
    }
    let lead = to.len() - from.len();
    let own = strides(from);
    let mut out = vec![0; to.len()];
    for (k, &d) in from.iter().enumerate() {
        if d == to[lead + k] {
            out[lead + k] = if d == 1 { 0 } else { own[k] };
        } else if d != 1 {
            return None;
        }
    }
    Some(out)
}

/// For every element of `to`, the flat index of the element of `from` it reads.
fn broadcast_offsets(from: &[usize], to: &[usize]) -> Result<Vec<usize>, String> {
    let st = broadcast_strides(from, to)
        .ok_or_else(|| format!("{from:?} does not broadcast to {to:?}"))?;
    Ok(strided_offsets(to, &st))
}

fn broadcast_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>, String> {
    Shape::broadcast(&Shape::from(a), &Shape::from(b))
        .map(|s| s.0.into_vec())
        .ok_or_else(|| format!("shapes {a:?} and {b:?} do not broadcast"))
}

/// (outer, size, inner) of `dims` around dim `d`.
fn split_at(dims: &[usize], d: usize) -> (usize, usize, usize) {
    (numel(&dims[..d]), dims[d], numel(&dims[d + 1..]))
}

fn check_dim(dims: &[usize], d: usize) -> Result<(), String> {
    ensure!(d < dims.len(), "dim {d} out of range for rank {}", dims.len());
    Ok(())
}

/// A whole number in `0..bound`, as an index.
fn index_in(x: f64, bound: usize, what: &str) -> Result<usize, String> {
    ensure!(
        x.fract() == 0.0 && x >= 0.0 && x < bound as f64,
        "{what} {x} is not an index in 0..{bound}"
    );
    Ok(x as usize)
}

fn map(x: &Value, f: impl Fn(f64) -> f64) -> Value {
    Value { shape: x.shape.clone(), data: x.data.iter().map(|&v| f(v)).collect() }
}

fn zip(a: &Value, b: &Value, f: impl Fn(f64, f64) -> f64) -> Value {
    Value {
        shape: a.shape.clone(),
        data: a.data.iter().zip(&b.data).map(|(&p, &q)| f(p, q)).collect(),
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(p, q)| p * q).sum()
}

/// `acc += c·x`.
fn axpy(acc: &mut [f64], c: f64, x: &[f64]) {
    for (a, v) in acc.iter_mut().zip(x) {
        *a += c * v;
    }
}

// ---- elementwise -----------------------------------------------------------------------------

const SQRT_2: f64 = std::f64::consts::SQRT_2;
/// √(2/π), GPT-2's tanh-GELU constant.
const GELU_TANH_C: f64 = 0.797_884_560_802_865_4;
/// 1/√(2π).
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;
/// 1/√π.
const INV_SQRT_PI: f64 = 0.564_189_583_547_756_3;

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// Φ(x), the standard normal CDF.
fn normal_cdf(x: f64) -> f64 {
    0.5 * erfc(-x / SQRT_2)
}

fn unary(u: UnaryOp, x: f64) -> f64 {
    match u {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Gelu => x * normal_cdf(x),
        UnaryOp::GeluTanh => 0.5 * x * (1.0 + (GELU_TANH_C * (x + 0.044715 * x * x * x)).tanh()),
        UnaryOp::Silu => x * sigmoid(x),
        UnaryOp::Relu => {
            if x > 0.0 {
                x
            } else {
                0.0
            }
        }
        UnaryOp::Sigmoid => sigmoid(x),
    }
}

/// f'(x).
fn unary_derivative(u: UnaryOp, x: f64) -> f64 {
    match u {
        UnaryOp::Neg => -1.0,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => 1.0 / x,
        UnaryOp::Sqrt => 0.5 / x.sqrt(),
        UnaryOp::Rsqrt => -0.5 / (x * x.sqrt()),
        UnaryOp::Tanh => {
            let t = x.tanh();
            1.0 - t * t
        }
        UnaryOp::Gelu => normal_cdf(x) + x * INV_SQRT_2PI * (-0.5 * x * x).exp(),
        UnaryOp::GeluTanh => {
            let t = (GELU_TANH_C * (x + 0.044715 * x * x * x)).tanh();
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_TANH_C * (1.0 + 3.0 * 0.044715 * x * x)
        }
        UnaryOp::Silu => {
            let s = sigmoid(x);
            s * (1.0 + x * (1.0 - s))
        }
        UnaryOp::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        UnaryOp::Sigmoid => {
            let s = sigmoid(x);
            s * (1.0 - s)
        }
    }
}

fn binary(b: BinaryOp, p: f64, q: f64) -> f64 {
    match b {
        BinaryOp::Add => p + q,
        BinaryOp::Sub => p - q,
        BinaryOp::Mul => p * q,
        BinaryOp::Div => p / q,
        // NaN propagates (f64::max would drop it).
        BinaryOp::Max => {
            if p >= q || p.is_nan() {
                p
            } else {
                q
            }
        }
        BinaryOp::Min => {
            if p <= q || p.is_nan() {
                p
            } else {
                q
            }
        }
    }
}

/// `f(a, b)` elementwise with NumPy broadcasting.
fn broadcast_binary(a: &Value, b: &Value, f: impl Fn(f64, f64) -> f64) -> Result<Value, String> {
    if a.shape == b.shape {
        return Ok(zip(a, b, f));
    }
    let out = broadcast_shape(a.dims(), b.dims())?;
    let ia = broadcast_offsets(a.dims(), &out)?;
    let ib = broadcast_offsets(b.dims(), &out)?;
    let data = ia.iter().zip(&ib).map(|(&i, &j)| f(a.data[i], b.data[j])).collect();
    Ok(Value { shape: Shape::from(out), data })
}

fn binary_backward(
    op: BinaryOp,
    wrt: u8,
    a: &Value,
    b: &Value,
    dy: &Value,
) -> Result<Value, String> {
    let out = broadcast_shape(a.dims(), b.dims())?;
    ensure!(dy.dims() == out.as_slice(), "dy {} must have the broadcast shape {out:?}", dy.shape);
    ensure!(wrt < 2, "wrt must be 0 or 1, got {wrt}");
    let ia = broadcast_offsets(a.dims(), &out)?;
    let ib = broadcast_offsets(b.dims(), &out)?;
    let grad = |p: f64, q: f64, g: f64| -> f64 {
        match (op, wrt) {
            (BinaryOp::Add, _) | (BinaryOp::Sub, 0) => g,
            (BinaryOp::Sub, _) => -g,
            (BinaryOp::Mul, 0) => g * q,
            (BinaryOp::Mul, _) => g * p,
            (BinaryOp::Div, 0) => g / q,
            (BinaryOp::Div, _) => -g * p / (q * q),
            (BinaryOp::Max, 0) => {
                if p >= q {
                    g
                } else {
                    0.0
                }
            }
            (BinaryOp::Max, _) => {
                if p >= q {
                    0.0
                } else {
                    g
                }
            }
            (BinaryOp::Min, 0) => {
                if p <= q {
                    g
                } else {
                    0.0
                }
            }
            (BinaryOp::Min, _) => {
                if p <= q {
                    0.0
                } else {
                    g
                }
            }
        }
    };
    let data = (0..dy.numel()).map(|k| grad(a.data[ia[k]], b.data[ib[k]], dy.data[k])).collect();
    Ok(Value { shape: Shape::from(out), data })
}

fn cast(to: DType, x: f64) -> f64 {
    match to {
        DType::F64 | DType::F32 | DType::F16 | DType::BF16 => x,
        DType::I32 | DType::I64 => x.trunc(),
        DType::U8 => x.trunc().clamp(0.0, 255.0),
        DType::Bool => {
            if x != 0.0 {
                1.0
            } else {
                0.0
            }
        }
    }
}

fn dropout(
    x: &Value,
    seed: &Value,
    p: f64,
    stream: u64,
    shard: Option<&crate::dist::ShardOf>,
) -> Result<Value, String> {
    ensure!(seed.numel() == 1, "seed must be a scalar, got {}", seed.shape);
    ensure!((0.0..1.0).contains(&p), "dropout probability {p} must be in [0, 1)");
    let seed = seed.data[0] as i64 as u64;
    let scale = 1.0 / (1.0 - p);
    // The interpreter is one device at the mesh origin (coordinate 0 on every axis).
    let dims = x.shape.dims().to_vec();
    let (base, strides) = match shard {
        Some(s) => s.index_map(None).map_err(|e| e.to_string())?,
        None => (0, crate::dist::row_major_strides(&dims)),
    };
    let local = crate::dist::row_major_strides(&dims);
    let data = x
        .data
        .iter()
        .enumerate()
        .map(|(k, &v)| {
            let g = crate::dist::global_index(k as u64, &local, base, &strides);
            if dropout_keep(seed, stream, g, p) {
                v * scale
            } else {
                0.0
            }
        })
        .collect();
    Ok(Value { shape: x.shape.clone(), data })
}

// ---- matmul ----------------------------------------------------------------------------------

/// Swaps the last two dims of every matrix of a `[.., r, c]` buffer.
fn transpose_last2(data: &[f64], r: usize, c: usize) -> Vec<f64> {
    let mut out = vec![0.0; data.len()];
    if r * c == 0 {
        return out;
    }
    for (src, dst) in data.chunks(r * c).zip(out.chunks_mut(r * c)) {
        for i in 0..r {
            for j in 0..c {
                dst[j * r + i] = src[i * c + j];
            }
        }
    }
    out
}

fn matmul(a: &Value, b: &Value, ta: bool, tb: bool) -> Result<Value, String> {
    let (ad, bd) = (a.dims(), b.dims());
    ensure!(ad.len() >= 2 && bd.len() >= 2, "operands {} and {} need 2 dims", a.shape, b.shape);
    let (ar, ac) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (br, bc) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    let (m, k) = if ta { (ac, ar) } else { (ar, ac) };
    let (k2, n) = if tb { (bc, br) } else { (br, bc) };
    ensure!(k == k2, "inner dims {k} vs {k2}");
    let (batch_a, batch_b) = (&ad[..ad.len() - 2], &bd[..bd.len() - 2]);
    let batch = broadcast_shape(batch_a, batch_b)?;
    // Canonical layouts: A as [.., m, k], B as [.., k, n], each matrix row-major.
    let a_c: Cow<'_, [f64]> =
        if ta { Cow::Owned(transpose_last2(&a.data, ar, ac)) } else { Cow::Borrowed(&a.data) };
    let b_c: Cow<'_, [f64]> =
        if tb { Cow::Owned(transpose_last2(&b.data, br, bc)) } else { Cow::Borrowed(&b.data) };
    let off_a = broadcast_offsets(batch_a, &batch)?;
    let off_b = broadcast_offsets(batch_b, &batch)?;
    let mut out = vec![0.0; numel(&batch) * m * n];
    if m * n > 0 {
        for ((&oa, &ob), c) in off_a.iter().zip(&off_b).zip(out.chunks_mut(m * n)) {
            let am = &a_c[oa * m * k..(oa + 1) * m * k];
            let bm = &b_c[ob * k * n..(ob + 1) * k * n];
            for i in 0..m {
                let crow = &mut c[i * n..(i + 1) * n];
                for p in 0..k {
                    axpy(crow, am[i * k + p], &bm[p * n..(p + 1) * n]);
                }
            }
        }
    }
    let mut dims = batch;
    dims.extend([m, n]);
    Ok(Value { shape: Shape::from(dims), data: out })
}

// ---- reductions ------------------------------------------------------------------------------

fn check_reduce_dims(x: &Value, dims: &[usize]) -> Result<(), String> {
    for (i, &d) in dims.iter().enumerate() {
        check_dim(x.dims(), d)?;
        ensure!(!dims[..i].contains(&d), "reduce dim {d} given twice");
    }
    Ok(())
}

/// For every element of `x`, the flat index of the output element it reduces into.
fn reduce_map(xd: &[usize], dims: &[usize]) -> Vec<usize> {
    let mut st = vec![0; xd.len()];
    let mut acc = 1;
    for i in (0..xd.len()).rev() {
        if !dims.contains(&i) {
            st[i] = acc;
            acc *= xd[i];
        }
    }
    strided_offsets(xd, &st)
}

/// For each output of a max-reduction, the flat index of its first maximal input (NaN wins).
fn argmax(x: &Value, map: &[usize], n_out: usize) -> Vec<Option<usize>> {
    let mut best: Vec<Option<usize>> = vec![None; n_out];
    for (i, &o) in map.iter().enumerate() {
        let v = x.data[i];
        let better = match best[o] {
            None => true,
            Some(j) => {
                let b = x.data[j];
                !b.is_nan() && (v > b || v.is_nan())
            }
        };
        if better {
            best[o] = Some(i);
        }
    }
    best
}

fn reduce(x: &Value, op: ReduceOp, dims: &[usize], keepdim: bool) -> Result<Value, String> {
    check_reduce_dims(x, dims)?;
    let shape = reduced_shape(&x.shape, dims, keepdim);
    let n_out = shape.numel() as usize;
    let map = reduce_map(x.dims(), dims);
    let count: usize = dims.iter().map(|&d| x.dims()[d]).product();
    let mut out = vec![0.0; n_out];
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            for (&o, &v) in map.iter().zip(&x.data) {
                out[o] += v;
            }
            if op == ReduceOp::Mean {
                for v in &mut out {
                    *v /= count as f64;
                }
            }
        }
        ReduceOp::SumSquares => {
            for (&o, &v) in map.iter().zip(&x.data) {
                out[o] += v * v;
            }
        }
        ReduceOp::Max => {
            for (o, i) in argmax(x, &map, n_out).into_iter().enumerate() {
                out[o] = i.map_or(f64::NEG_INFINITY, |i| x.data[i]);
            }
        }
    }
    Ok(Value { shape, data: out })
}

fn reduce_backward(
    x: &Value,
    dy: &Value,
    op: ReduceOp,
    dims: &[usize],
    keepdim: bool,
) -> Result<Value, String> {
    check_reduce_dims(x, dims)?;
    let shape = reduced_shape(&x.shape, dims, keepdim);
    ensure!(dy.shape == shape, "dy {} must have the reduced shape {shape}", dy.shape);
    let map = reduce_map(x.dims(), dims);
    let count: usize = dims.iter().map(|&d| x.dims()[d]).product();
    let data = match op {
        ReduceOp::Sum => map.iter().map(|&o| dy.data[o]).collect(),
        ReduceOp::Mean => map.iter().map(|&o| dy.data[o] / count as f64).collect(),
        ReduceOp::SumSquares => {
            map.iter().zip(&x.data).map(|(&o, &v)| 2.0 * v * dy.data[o]).collect()
        }
        ReduceOp::Max => {
            let mut dx = vec![0.0; x.numel()];
            for (o, i) in argmax(x, &map, dy.numel()).into_iter().enumerate() {
                if let Some(i) = i {
                    dx[i] = dy.data[o];
                }
            }
            dx
        }
    };
    Ok(Value { shape: x.shape.clone(), data })
}

/// The size of the last dim (softmax, norms and losses work on its rows); rank 0 is an error.
fn last_dim(x: &Value) -> Result<usize, String> {
    ensure!(x.shape.rank() > 0, "needs at least one dim, got {}", x.shape);
    Ok(x.shape.last())
}

fn softmax(x: &Value) -> Result<Value, String> {
    let d = last_dim(x)?;
    let mut out = x.data.clone();
    if d > 0 {
        for row in out.chunks_mut(d) {
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut s = 0.0;
            for v in row.iter_mut() {
                *v = (*v - m).exp();
                s += *v;
            }
            for v in row.iter_mut() {
                *v /= s;
            }
        }
    }
    Ok(Value { shape: x.shape.clone(), data: out })
}

fn softmax_backward(y: &Value, dy: &Value) -> Result<Value, String> {
    ensure!(y.shape == dy.shape, "y {} and dy {} differ", y.shape, dy.shape);
    let d = last_dim(y)?;
    let mut out = vec![0.0; y.numel()];
    if d > 0 {
        for ((yr, gr), or) in y.data.chunks(d).zip(dy.data.chunks(d)).zip(out.chunks_mut(d)) {
            let s = dot(yr, gr);
            for ((o, &yv), &g) in or.iter_mut().zip(yr).zip(gr) {
                *o = yv * (g - s);
            }
        }
    }
    Ok(Value { shape: y.shape.clone(), data: out })
}

// ---- layout ----------------------------------------------------------------------------------

fn permute(x: &Value, perm: &[usize]) -> Result<Value, String> {
    let xd = x.dims();
    let mut seen = vec![false; xd.len()];
    ensure!(
        perm.len() == xd.len()
            && perm.iter().all(|&p| p < xd.len() && !std::mem::replace(&mut seen[p], true)),
        "{perm:?} is not a permutation of {} dims",
        xd.len()
    );
    let st = strides(xd);
    let dims: Vec<usize> = perm.iter().map(|&p| xd[p]).collect();
    let gather: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
    let data = strided_offsets(&dims, &gather).into_iter().map(|i| x.data[i]).collect();
    Ok(Value { shape: Shape::from(dims), data })
}

fn slice(x: &Value, dim: usize, start: usize, end: usize) -> Result<Value, String> {
    check_dim(x.dims(), dim)?;
    let (outer, size, inner) = split_at(x.dims(), dim);
    ensure!(start <= end && end <= size, "slice {start}..{end} out of range for size {size}");
    let mut data = Vec::with_capacity(outer * (end - start) * inner);
    for o in 0..outer {
        data.extend_from_slice(&x.data[(o * size + start) * inner..(o * size + end) * inner]);
    }
    let mut dims = x.dims().to_vec();
    dims[dim] = end - start;
    Ok(Value { shape: Shape::from(dims), data })
}

fn pad(x: &Value, dim: usize, before: usize, after: usize) -> Result<Value, String> {
    check_dim(x.dims(), dim)?;
    let (outer, size, inner) = split_at(x.dims(), dim);
    let total = before + size + after;
    let mut data = vec![0.0; outer * total * inner];
    for o in 0..outer {
        let dst = (o * total + before) * inner;
        data[dst..dst + size * inner]
            .copy_from_slice(&x.data[o * size * inner..(o + 1) * size * inner]);
    }
    let mut dims = x.dims().to_vec();
    dims[dim] = total;
    Ok(Value { shape: Shape::from(dims), data })
}

fn concat(xs: &[&Value], dim: usize) -> Result<Value, String> {
    let first = xs[0].dims();
    check_dim(first, dim)?;
    for v in xs {
        let d = v.dims();
        ensure!(
            d.len() == first.len() && (0..d.len()).all(|i| i == dim || d[i] == first[i]),
            "{} does not match {:?} outside dim {dim}",
            v.shape,
            first
        );
    }
    let (outer, _, inner) = split_at(first, dim);
    let total: usize = xs.iter().map(|v| v.dims()[dim]).sum();
    let mut data = Vec::with_capacity(outer * total * inner);
    for o in 0..outer {
        for v in xs {
            let chunk = v.dims()[dim] * inner;
            data.extend_from_slice(&v.data[o * chunk..(o + 1) * chunk]);
        }
    }
    let mut dims = first.to_vec();
    dims[dim] = total;
    Ok(Value { shape: Shape::from(dims), data })
}

fn expand(x: &Value, to: &Shape) -> Result<Value, String> {
    let data = broadcast_offsets(x.dims(), to.dims())?.into_iter().map(|i| x.data[i]).collect();
    Ok(Value { shape: to.clone(), data })
}

// ---- normalisation ---------------------------------------------------------------------------

fn check_affine(x: &Value, w: &Value, what: &str) -> Result<usize, String> {
    let d = last_dim(x)?;
    ensure!(w.dims() == [d], "{what} {} must be [{d}]", w.shape);
    Ok(d)
}

/// (mean, 1/sqrt(var + eps)) of one row, biased variance.
fn row_stats(row: &[f64], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

fn layer_norm(x: &Value, w: &Value, b: &Value, eps: f64) -> Result<Value, String> {
    let d = check_affine(x, w, "weight")?;
    check_affine(x, b, "bias")?;
    let mut out = vec![0.0; x.numel()];
    if d > 0 {
        for (xr, or) in x.data.chunks(d).zip(out.chunks_mut(d)) {
            let (mean, rstd) = row_stats(xr, eps);
            for i in 0..d {
                or[i] = (xr[i] - mean) * rstd * w.data[i] + b.data[i];
            }
        }
    }
    Ok(Value { shape: x.shape.clone(), data: out })
}

/// With x̂ = (x − mean)·rstd and g = dy·w: dx = rstd·(g − mean(g) − x̂·mean(g·x̂)),
/// dw = Σ_rows dy·x̂, db = Σ_rows dy.
fn layer_norm_backward(x: &Value, w: &Value, dy: &Value, eps: f64) -> Result<Vec<Value>, String> {
    let d = check_affine(x, w, "weight")?;
    ensure!(dy.shape == x.shape, "dy {} must have x's shape {}", dy.shape, x.shape);
    let mut dx = vec![0.0; x.numel()];
    let mut dw = vec![0.0; d];
    let mut db = vec![0.0; d];
    if d > 0 {
        let mut xhat = vec![0.0; d];
        let mut g = vec![0.0; d];
        for ((xr, gr), dxr) in x.data.chunks(d).zip(dy.data.chunks(d)).zip(dx.chunks_mut(d)) {
            let (mean, rstd) = row_stats(xr, eps);
            for i in 0..d {
                xhat[i] = (xr[i] - mean) * rstd;
                g[i] = gr[i] * w.data[i];
                dw[i] += gr[i] * xhat[i];
                db[i] += gr[i];
            }
            let mean_g = g.iter().sum::<f64>() / d as f64;
            let mean_gx = dot(&g, &xhat) / d as f64;
            for i in 0..d {
                dxr[i] = rstd * (g[i] - mean_g - xhat[i] * mean_gx);
            }
        }
    }
    Ok(vec![
        Value { shape: x.shape.clone(), data: dx },
        Value { shape: w.shape.clone(), data: dw },
        Value { shape: w.shape.clone(), data: db },
    ])
}

/// 1/sqrt(mean(x²) + eps) of one row.
fn rms_rstd(row: &[f64], eps: f64) -> f64 {
    1.0 / (row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64 + eps).sqrt()
}

fn rms_norm(x: &Value, w: &Value, eps: f64) -> Result<Value, String> {
    let d = check_affine(x, w, "weight")?;
    let mut out = vec![0.0; x.numel()];
    if d > 0 {
        for (xr, or) in x.data.chunks(d).zip(out.chunks_mut(d)) {
            let r = rms_rstd(xr, eps);
            for i in 0..d {
                or[i] = xr[i] * r * w.data[i];
            }
        }
    }
    Ok(Value { shape: x.shape.clone(), data: out })
}

/// With r = 1/sqrt(mean(x²) + eps) and g = dy·w: dx = r·g − x·r³·mean(g·x), dw = Σ_rows dy·x·r.
fn rms_norm_backward(x: &Value, w: &Value, dy: &Value, eps: f64) -> Result<Vec<Value>, String> {
    let d = check_affine(x, w, "weight")?;
    ensure!(dy.shape == x.shape, "dy {} must have x's shape {}", dy.shape, x.shape);
    let mut dx = vec![0.0; x.numel()];
    let mut dw = vec![0.0; d];
    if d > 0 {
        let mut g = vec![0.0; d];
        for ((xr, gr), dxr) in x.data.chunks(d).zip(dy.data.chunks(d)).zip(dx.chunks_mut(d)) {
            let r = rms_rstd(xr, eps);
            for i in 0..d {
                g[i] = gr[i] * w.data[i];
                dw[i] += gr[i] * xr[i] * r;
            }
            let mean_gx = dot(&g, xr) / d as f64;
            for i in 0..d {
                dxr[i] = r * g[i] - xr[i] * r * r * r * mean_gx;
            }
        }
    }
    Ok(vec![Value { shape: x.shape.clone(), data: dx }, Value { shape: w.shape.clone(), data: dw }])
}

// ---- embedding and loss ----------------------------------------------------------------------

fn embedding(table: &Value, ids: &Value) -> Result<Value, String> {
    ensure!(table.shape.rank() == 2, "table {} must be [num_embeddings, dim]", table.shape);
    let (v, d) = (table.dims()[0], table.dims()[1]);
    let mut data = Vec::with_capacity(ids.numel() * d);
    for &id in &ids.data {
        let r = index_in(id, v, "id")?;
        data.extend_from_slice(&table.data[r * d..(r + 1) * d]);
    }
    let mut dims = ids.dims().to_vec();
    dims.push(d);
    Ok(Value { shape: Shape::from(dims), data })
}

fn embedding_backward(ids: &Value, dy: &Value, num_embeddings: usize) -> Result<Value, String> {
    let d = last_dim(dy)?;
    ensure!(
        dy.numel() == ids.numel() * d,
        "dy {} must be ids' shape {} plus one dim",
        dy.shape,
        ids.shape
    );
    let mut out = vec![0.0; num_embeddings * d];
    for (k, &id) in ids.data.iter().enumerate() {
        let r = index_in(id, num_embeddings, "id")?;
        axpy(&mut out[r * d..(r + 1) * d], 1.0, &dy.data[k * d..(k + 1) * d]);
    }
    Ok(Value { shape: Shape::from(vec![num_embeddings, d]), data: out })
}

/// The class of a target row, or `None` when it is ignored.
fn target_class(
    t: f64,
    classes: usize,
    ignore_index: Option<i64>,
) -> Result<Option<usize>, String> {
    if ignore_index.is_some_and(|ig| t == ig as f64) {
        return Ok(None);
    }
    index_in(t, classes, "target").map(Some)
}

fn check_logits(logits: &Value, targets: &Value) -> Result<usize, String> {
    let v = last_dim(logits)?;
    let ld = logits.dims();
    ensure!(
        ld.len() >= 2 && &ld[..ld.len() - 1] == targets.dims(),
        "logits {} must be targets' shape {} plus a class dim",
        logits.shape,
        targets.shape
    );
    Ok(v)
}

fn logsumexp(row: &[f64]) -> f64 {
    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln()
}

/// The mean (or, `sum`, the sum) over the non-ignored rows.
fn cross_entropy(
    logits: &Value,
    targets: &Value,
    ignore_index: Option<i64>,
    sum: bool,
) -> Result<Vec<Value>, String> {
    let v = check_logits(logits, targets)?;
    let mut lse = vec![0.0; targets.numel()];
    let (mut total, mut count) = (0.0, 0usize);
    for (r, (&t, l)) in targets.data.iter().zip(&mut lse).enumerate() {
        let row = &logits.data[r * v..(r + 1) * v];
        *l = logsumexp(row);
        if let Some(c) = target_class(t, v, ignore_index)? {
            total += *l - row[c];
            count += 1;
        }
    }
    let denominator = if sum { 1 } else { count.max(1) };
    Ok(vec![
        Value::scalar(total / denominator as f64),
        Value { shape: targets.shape.clone(), data: lse },
    ])
}

fn cross_entropy_backward(
    logits: &Value,
    targets: &Value,
    lse: &Value,
    dloss: &Value,
    ignore_index: Option<i64>,
    sum: bool,
) -> Result<Value, String> {
    let v = check_logits(logits, targets)?;
    ensure!(lse.shape == targets.shape, "logsumexp {} must have targets' shape", lse.shape);
    ensure!(dloss.numel() == 1, "dloss must be a scalar, got {}", dloss.shape);
    let mut classes = Vec::with_capacity(targets.numel());
    for &t in &targets.data {
        classes.push(target_class(t, v, ignore_index)?);
    }
    let count = classes.iter().filter(|c| c.is_some()).count();
    let g = dloss.data[0] / if sum { 1 } else { count.max(1) } as f64;
    let mut out = vec![0.0; logits.numel()];
    for (r, c) in classes.into_iter().enumerate() {
        let Some(c) = c else { continue };
        let row = &logits.data[r * v..(r + 1) * v];
        let orow = &mut out[r * v..(r + 1) * v];
        for (o, &l) in orow.iter_mut().zip(row) {
            *o = g * (l - lse.data[r]).exp();
        }
        orow[c] -= g;
    }
    Ok(Value { shape: logits.shape.clone(), data: out })
}

// ---- attention and rope ----------------------------------------------------------------------

/// Dims of a q/k/v operand and the attention geometry.
struct AttnDims {
    b: usize,
    s: usize,
    t: usize,
    h: usize,
    hkv: usize,
    d: usize,
}

impl AttnDims {
    fn new(q: &Value, k: &Value, v: &Value) -> Result<AttnDims, String> {
        let (&[b, s, h, d], &[bk, t, hkv, dk]) = (q.dims(), k.dims()) else {
            return Err(format!(
                "q {} and k {} must be [batch, seq, heads, head_dim]",
                q.shape, k.shape
            ));
        };
        ensure!(v.shape == k.shape, "v {} must match k {}", v.shape, k.shape);
        ensure!(
            bk == b && dk == d,
            "k {} must share batch and head_dim with q {}",
            k.shape,
            q.shape
        );
        ensure!(hkv > 0 && h % hkv == 0, "query heads {h} must be a multiple of kv heads {hkv}");
        Ok(AttnDims { b, s, t, h, hkv, d })
    }
    fn q_at(&self, b: usize, i: usize, h: usize) -> usize {
        ((b * self.s + i) * self.h + h) * self.d
    }
    fn kv_at(&self, b: usize, j: usize, h: usize) -> usize {
        ((b * self.t + j) * self.hkv + h / (self.h / self.hkv)) * self.d
    }
    fn lse_at(&self, b: usize, h: usize, i: usize) -> usize {
        (b * self.h + h) * self.s + i
    }
    /// The position of query `i` of row `b`: `start[b] + i` with a start input, else the
    /// last S of T positions.
    fn pos(&self, start: Option<&Value>, b: usize, i: usize) -> i64 {
        match start {
            Some(st) => st.data[b] as i64 + i as i64,
            None => i as i64 + self.t as i64 - self.s as i64,
        }
    }
    /// Whether the query at position `p` may attend to key `j`.
    fn visible(&self, spec: &AttentionSpec, p: i64, j: usize) -> bool {
        let j = j as i64;
        (!spec.causal || j <= p) && spec.window.is_none_or(|w| j > p - w as i64)
    }
}

/// Per local head, the ALiBi slope (0 without ALiBi).
fn head_slopes(spec: &AttentionSpec, heads: usize) -> Result<Vec<f64>, String> {
    match &spec.alibi {
        Some(a) => a.local_slopes(heads, None).map_err(|e| e.to_string()),
        None => Ok(vec![0.0; heads]),
    }
}

fn attention(
    q: &Value,
    k: &Value,
    v: &Value,
    start: Option<&Value>,
    spec: &AttentionSpec,
) -> Result<Vec<Value>, String> {
    let a = AttnDims::new(q, k, v)?;
    if let Some(st) = start {
        ensure!(st.dims() == [a.b], "start {} must be [batch]", st.shape);
    }
    let slopes = head_slopes(spec, a.h)?;
    let mut out = vec![0.0; q.numel()];
    let mut lse = vec![0.0; a.b * a.h * a.s];
    let mut scores = vec![f64::NEG_INFINITY; a.t];
    for b in 0..a.b {
        for h in 0..a.h {
            for i in 0..a.s {
                let qo = a.q_at(b, i, h);
                let qi = &q.data[qo..qo + a.d];
                let p = a.pos(start, b, i);
                for (j, s) in scores.iter_mut().enumerate() {
                    *s = if a.visible(spec, p, j) {
                        let ko = a.kv_at(b, j, h);
                        spec.scale * dot(qi, &k.data[ko..ko + a.d])
                            + slopes[h] * (j as i64 - p) as f64
                    } else {
                        f64::NEG_INFINITY
                    };
                }
                let l = logsumexp(&scores);
                lse[a.lse_at(b, h, i)] = l;
                if l == f64::NEG_INFINITY {
                    continue;
                }
                let orow = &mut out[qo..qo + a.d];
                for (j, &s) in scores.iter().enumerate() {
                    if s != f64::NEG_INFINITY {
                        let vo = a.kv_at(b, j, h);
                        axpy(orow, (s - l).exp(), &v.data[vo..vo + a.d]);
                    }
                }
            }
        }
    }
    Ok(vec![
        Value { shape: q.shape.clone(), data: out },
        Value { shape: Shape::from(vec![a.b, a.h, a.s]), data: lse },
    ])
}

/// p = exp(s − lse), dP = dout·v, D = dout·out, dS = p·(dP − D);
/// dq = scale·Σ_j dS·k_j, dk_j += scale·dS·q, dv_j += p·dout.
fn attention_backward(x: &[&Value], spec: &AttentionSpec) -> Result<Vec<Value>, String> {
    let (q, k, v, out, lse, dout) = (x[0], x[1], x[2], x[3], x[4], x[5]);
    let a = AttnDims::new(q, k, v)?;
    ensure!(out.shape == q.shape && dout.shape == q.shape, "out and dout must have q's shape");
    ensure!(lse.dims() == [a.b, a.h, a.s], "logsumexp {} must be [B,H,S]", lse.shape);
    let slopes = head_slopes(spec, a.h)?;
    let mut dq = vec![0.0; q.numel()];
    let mut dk = vec![0.0; k.numel()];
    let mut dv = vec![0.0; v.numel()];
    for b in 0..a.b {
        for (h, &slope) in slopes.iter().enumerate() {
            for i in 0..a.s {
                let l = lse.data[a.lse_at(b, h, i)];
                if l == f64::NEG_INFINITY {
                    continue;
                }
                let qo = a.q_at(b, i, h);
                let qi = &q.data[qo..qo + a.d];
                let gi = &dout.data[qo..qo + a.d];
                let big_d = dot(gi, &out.data[qo..qo + a.d]);
                let pos = a.pos(None, b, i);
                for j in 0..a.t {
                    if !a.visible(spec, pos, j) {
                        continue;
                    }
                    let ko = a.kv_at(b, j, h);
                    let kj = &k.data[ko..ko + a.d];
                    let bias = slope * (j as i64 - pos) as f64;
                    let p = (spec.scale * dot(qi, kj) + bias - l).exp();
                    let dp = dot(gi, &v.data[ko..ko + a.d]);
                    let ds = p * (dp - big_d);
                    axpy(&mut dq[qo..qo + a.d], spec.scale * ds, kj);
                    axpy(&mut dk[ko..ko + a.d], spec.scale * ds, qi);
                    axpy(&mut dv[ko..ko + a.d], p, gi);
                }
            }
        }
    }
    Ok(vec![
        Value { shape: q.shape.clone(), data: dq },
        Value { shape: k.shape.clone(), data: dk },
        Value { shape: v.shape.clone(), data: dv },
    ])
}

fn rope(
    x: &Value,
    positions: Option<&Value>,
    inv_freq: &[f64],
    inverse: bool,
) -> Result<Value, String> {
    let &[b, s, h, d] = x.dims() else {
        return Err(format!("x {} must be [batch, seq, heads, head_dim]", x.shape));
    };
    if let Some(ps) = positions {
        ensure!(ps.dims() == [b, s], "positions {} must be [batch, seq]", ps.shape);
    }
    let half = d / 2;
    ensure!(
        d % 2 == 0 && inv_freq.len() == half,
        "head_dim {d} needs {half} frequencies, got {}",
        inv_freq.len()
    );
    let sign = if inverse { -1.0 } else { 1.0 };
    let mut out = vec![0.0; x.numel()];
    for pos in 0..s {
        for bi in 0..b {
            let at = positions.map_or(pos as f64, |ps| ps.data[bi * s + pos]);
            let (sin, cos): (Vec<f64>, Vec<f64>) =
                inv_freq.iter().map(|f| (sign * at * f).sin_cos()).unzip();
            for hi in 0..h {
                let o = ((bi * s + pos) * h + hi) * d;
                let (xr, or) = (&x.data[o..o + d], &mut out[o..o + d]);
                for i in 0..half {
                    or[i] = xr[i] * cos[i] - xr[i + half] * sin[i];
                    or[i + half] = xr[i + half] * cos[i] + xr[i] * sin[i];
                }
            }
        }
    }
    Ok(Value { shape: x.shape.clone(), data: out })
}

// ---- inference -------------------------------------------------------------------------------

fn cache_write(cache: &Value, x: &Value, start: &Value) -> Result<Value, String> {
    let (&[b, c, h, d], &[bx, s, hx, dx]) = (cache.dims(), x.dims()) else {
        return Err(format!("cache {} and x {} must be 4-d", cache.shape, x.shape));
    };
    ensure!(b == bx && h == hx && d == dx, "x {} does not fit cache {}", x.shape, cache.shape);
    let mut out = cache.clone();
    let row = h * d;
    for bi in 0..b {
        let st = start.data[bi];
        ensure!(
            st >= 0.0 && st as usize + s <= c,
            "row {bi}: positions {st}..{} beyond the cache's {c}",
            st as usize + s
        );
        for i in 0..s {
            let dst = (bi * c + st as usize + i) * row;
            let src = (bi * s + i) * row;
            out.data[dst..dst + row].copy_from_slice(&x.data[src..src + row]);
        }
    }
    Ok(out)
}

fn select_positions(x: &Value, index: &Value) -> Result<Value, String> {
    let dims = x.dims();
    ensure!(dims.len() >= 2, "x {} must be [batch, seq, ..]", x.shape);
    let (b, s) = (dims[0], dims[1]);
    let row: usize = dims[2..].iter().product();
    let mut data = Vec::with_capacity(b * row);
    for bi in 0..b {
        let i = index.data[bi];
        ensure!(i >= 0.0 && (i as usize) < s, "row {bi}: position {i} beyond {s}");
        let o = (bi * s + i as usize) * row;
        data.extend_from_slice(&x.data[o..o + row]);
    }
    let mut out = dims.to_vec();
    out[1] = 1;
    Ok(Value { shape: Shape::from(out), data })
}

/// The dequantised weight `[N, K]` of a [`QuantSpec`] weight and its scales.
pub fn dequantize(w: &Value, scales: &Value, q: crate::QuantSpec, k: usize) -> Vec<f64> {
    let n = w.dims()[0];
    let rb = q.row_bytes(k);
    let groups = k / q.group;
    let mut out = vec![0.0; n * k];
    for r in 0..n {
        for f in 0..k {
            let raw = if q.bits == 8 {
                w.data[r * rb + f] as i64 - 128
            } else {
                let byte = w.data[r * rb + f / 2] as i64;
                let nib = if f % 2 == 0 { byte & 15 } else { byte >> 4 };
                nib - 8
            };
            out[r * k + f] = raw as f64 * scales.data[r * groups + f / q.group];
        }
    }
    out
}

fn qmatmul(x: &Value, w: &Value, scales: &Value, q: crate::QuantSpec) -> Result<Value, String> {
    let k = *x.dims().last().ok_or("x has no features")?;
    let n = w.dims()[0];
    ensure!(w.dims() == [n, q.row_bytes(k)], "weight {} does not fit {k} features", w.shape);
    let wf = dequantize(w, scales, q, k);
    let m = x.numel() / k.max(1);
    let mut data = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            data[i * n + j] = dot(&x.data[i * k..(i + 1) * k], &wf[j * k..(j + 1) * k]);
        }
    }
    let mut out = x.dims().to_vec();
    *out.last_mut().unwrap_or(&mut 0) = n;
    Ok(Value { shape: Shape::from(out), data })
}

// ---- optimizer -------------------------------------------------------------------------------

fn adamw(x: &[&Value], spec: &AdamWSpec) -> Result<Vec<Value>, String> {
    let p = x[optim::PARAM];
    for (i, what) in [(optim::GRAD, "grad"), (optim::M, "m"), (optim::V, "v")] {
        ensure!(
            x[i].shape == p.shape,
            "{what} {} must have the parameter's shape {}",
            x[i].shape,
            p.shape
        );
    }
    let (master_at, scale_at) = spec.optional_inputs(x.len());
    let master = master_at.map(|i| x[i]);
    if let Some(mw) = master {
        ensure!(
            mw.shape == p.shape,
            "master {} must have the parameter's shape {}",
            mw.shape,
            p.shape
        );
    }
    for (i, what) in [(optim::LR, "lr"), (optim::STEP, "step"), (optim::GRAD_NORM, "grad_norm")] {
        ensure!(x[i].numel() == 1, "{what} must be a scalar, got {}", x[i].shape);
    }
    if let Some(i) = scale_at {
        ensure!(x[i].numel() == 1, "grad_scale must be a scalar, got {}", x[i].shape);
    }
    let lr = x[optim::LR].data[0];
    let step = x[optim::STEP].data[0];
    if step.is_nan() || step < 1.0 {
        return Err(format!("step {step} must be ≥ 1 (it is 1-based)"));
    }
    let scale = scale_at.map_or(1.0, |i| x[i].data[0]);
    let norm = x[optim::GRAD_NORM].data[0] * scale;
    if scale_at.is_some() && !norm.is_finite() {
        // Overflow under loss scaling: skip the update, every state unchanged.
        let mut outs = vec![p.clone(), x[optim::M].clone(), x[optim::V].clone()];
        outs.extend(master.cloned());
        return Ok(outs);
    }
    let clip = match spec.max_grad_norm {
        Some(max) => (max / (norm + 1e-6)).min(1.0),
        None => 1.0,
    } * scale;
    let bc1 = 1.0 - spec.beta1.powf(step);
    let bc2 = 1.0 - spec.beta2.powf(step);
    let w = master.unwrap_or(p);
    let n = p.numel();
    let (mut w2, mut m2, mut v2) =
        (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let (grad, m, v) = (&x[optim::GRAD].data, &x[optim::M].data, &x[optim::V].data);
    for (((&wi, &gi), &mi), &vi) in w.data.iter().zip(grad).zip(m).zip(v) {
        let g = clip * gi;
        let m = spec.beta1 * mi + (1.0 - spec.beta1) * g;
        let v = spec.beta2 * vi + (1.0 - spec.beta2) * g * g;
        let (m_hat, v_hat) = (m / bc1, v / bc2);
        w2.push(wi - lr * (m_hat / (v_hat.sqrt() + spec.eps) + spec.weight_decay * wi));
        m2.push(m);
        v2.push(v);
    }
    let shape = p.shape.clone();
    let master2 = master.map(|_| Value { shape: shape.clone(), data: w2.clone() });
    let mut outs = vec![
        Value { shape: shape.clone(), data: w2 },
        Value { shape: shape.clone(), data: m2 },
        Value { shape, data: v2 },
    ];
    outs.extend(master2);
    Ok(outs)
}

// ---- special functions -----------------------------------------------------------------------

/// The error function, to about 1e-15 relative accuracy.
pub fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let ax = x.abs();
    let r = if ax < 2.5 { erf_series(ax) } else { 1.0 - erfc_continued_fraction(ax) };
    r.copysign(x)
}

/// The complementary error function 1 − erf(x), accurate in relative terms for large x
/// (where 1 − erf(x) would cancel).
pub fn erfc(x: f64) -> f64 {
    if x.is_nan() {
        x
    } else if x >= 2.5 {
        erfc_continued_fraction(x)
    } else {
        1.0 - erf(x)
    }
}

/// erf(x) = (2/√π)·e^{−x²}·Σ_n 2ⁿ x^{2n+1} / (1·3·…·(2n+1)), for 0 ≤ x < 2.5. Every term is
/// positive, so the sum does not cancel (about 35 terms at x = 2.5).
fn erf_series(x: f64) -> f64 {
    let x2 = x * x;
    let (mut term, mut sum) = (x, x);
    let mut n = 0.0;
    while term > 1e-17 * sum {
        n += 1.0;
        term *= 2.0 * x2 / (2.0 * n + 1.0);
        sum += term;
    }
    2.0 * INV_SQRT_PI * (-x2).exp() * sum
}

/// erfc(x) = e^{−x²}/√π · 1/(x + ½/(x + 1/(x + (3/2)/(x + …)))) for x ≥ 2.5, evaluated from
/// 60 levels down (converged to machine precision there).
fn erfc_continued_fraction(x: f64) -> f64 {
    if x > 27.3 {
        return 0.0; // below the smallest subnormal
    }
    let mut t = x;
    for n in (1..=60).rev() {
        t = x + 0.5 * n as f64 / t;
    }
    (-x * x).exp() * INV_SQRT_PI / t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_reference_values() {
        // Reference values from libm (CPython's math.erf / math.erfc).
        let cases = [
            (0.3, 0.3286267594591274),
            (0.5, 0.5204998778130465),
            (1.0, 0.8427007929497149),
            (1.7, 0.9837904585907745),
            (2.0, 0.9953222650189527),
            (2.4999, 0.9995928300996666),
            (-1.2, -0.9103139782296353),
        ];
        for (x, want) in cases {
            assert!((erf(x) - want).abs() <= 1e-15 * want.abs(), "erf({x}) = {}", erf(x));
        }
        let tails = [
            (3.0, 2.209049699858544e-05),
            (3.3, 3.0577097964381654e-06),
            (4.7, 2.9952597863796555e-11),
            (5.4999, 7.36607575847486e-15),
            (4.2, 2.8554941795921843e-09),
        ];
        for (x, want) in tails {
            assert!((erfc(x) - want).abs() <= 1e-14 * want, "erfc({x}) = {}", erfc(x));
        }
        assert_eq!(erf(0.0), 0.0);
        assert_eq!(erf(30.0), 1.0);
        assert_eq!(erfc(-30.0), 2.0);
    }

    #[test]
    fn strided_offsets_and_broadcast() {
        assert_eq!(strided_offsets(&[2, 3], &[3, 1]), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(strided_offsets(&[2, 3], &[1, 2]), vec![0, 2, 4, 1, 3, 5]);
        assert_eq!(
            broadcast_offsets(&[3, 1], &[2, 3, 2]).unwrap(),
            vec![0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]
        );
        assert!(broadcast_offsets(&[3], &[2, 2]).is_err());
    }

    #[test]
    fn small_ops_by_hand() {
        let a = Value::new([2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let b = Value::new([3, 2], vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        let c = eval_op(&Op::MatMul { trans_a: false, trans_b: false }, &[&a, &b]).unwrap();
        assert_eq!(c[0].data, vec![4.0, 5.0, 10.0, 11.0]);
        // aᵀ·aᵀᵀ = aᵀ·a, [3,3].
        let c = eval_op(&Op::MatMul { trans_a: true, trans_b: false }, &[&a, &a]).unwrap();
        assert_eq!(c[0].dims(), &[3, 3]);
        assert_eq!(c[0].data[0], 1.0 + 16.0);
        let m = eval_op(&Op::Reduce { op: ReduceOp::Max, dims: vec![0], keepdim: false }, &[&a])
            .unwrap();
        assert_eq!(m[0].data, vec![4.0, 5.0, 6.0]);
        let p = eval_op(&Op::Permute(vec![1, 0]), &[&a]).unwrap();
        assert_eq!(p[0].data, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        let s = eval_op(&Op::Slice { dim: 1, start: 1, end: 3 }, &[&a]).unwrap();
        assert_eq!(s[0].data, vec![2.0, 3.0, 5.0, 6.0]);
        let pd = eval_op(&Op::Pad { dim: 0, before: 1, after: 0 }, &[&s[0]]).unwrap();
        assert_eq!(pd[0].data, vec![0.0, 0.0, 2.0, 3.0, 5.0, 6.0]);
        let cc = eval_op(&Op::Concat { dim: 1 }, &[&a, &s[0]]).unwrap();
        assert_eq!(cc[0].data, vec![1.0, 2.0, 3.0, 2.0, 3.0, 4.0, 5.0, 6.0, 5.0, 6.0]);
        // Ties in max: the gradient goes to the first maximal element.
        let t = Value::new([3], vec![2.0, 5.0, 5.0]);
        let dy = Value::scalar(1.0);
        let op = Op::ReduceBackward { op: ReduceOp::Max, dims: vec![0], keepdim: false };
        assert_eq!(eval_op(&op, &[&t, &dy]).unwrap()[0].data, vec![0.0, 1.0, 0.0]);
    }
}
