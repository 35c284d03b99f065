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
//!   sharing a kv head. With a seventh input (the log-sum-exp's cotangent `dlse`, where ring
//!   attention's merge read it) the row term is `D − dlse`. With `ring` set
//!   ([`crate::ops::RingBlock`]), queries and keys sit at their global positions (the mesh
//!   origin's: the interpreter is one device) and the masks and ALiBi read those.
//! - **`AttentionMerge`**: `L = log Σ_r exp(lse_r)`, `o = Σ_r exp(lse_r − L)·o_r`; blocks with
//!   `lse_r = −∞` weigh 0 and a row every block masks is 0. Its backward:
//!   `do_r = w_r·dout`, `dlse_r = w_r·(Σ_d dout·o_r − Σ_d dout·o)`.
//! - **`Rope`**: rotate-half layout, position = sequence index `s`; for pair `i < D/2`,
//!   `θ = s·inv_freq[i]`, `out[i] = x[i]·cos θ − x[i+D/2]·sin θ`,
//!   `out[i+D/2] = x[i+D/2]·cos θ + x[i]·sin θ`; `inverse` uses −θ.
//! - **`Dropout`**: the seed (an i64 scalar) is reinterpreted as `u64`; element `k` (flat
//!   row-major index of the whole tensor) is kept iff [`dropout_keep`]`(seed, stream, k, p)`,
//!   and kept elements are scaled by `1/(1−p)`.
//! - **`Embedding`** gathers table rows by id (an id outside the vocabulary is an error); with
//!   `rows` (a vocabulary shard) the table holds the mesh origin's rows, and ids outside them
//!   read zeros (their gradient adds nothing).
//! - **Layout ops** copy (`Reshape` and `Expand` are views only for memory accounting); `Pad`
//!   fills with zeros; `Permute(perm)` gives output dim `i` the input's dim `perm[i]`.
//! - **Vision ops** (NCHW, [`crate::ops::vision`]): `Conv2d` zero-pads symmetrically and
//!   its two backward ops are its exact adjoints (one shared loop nest); `GroupNorm` takes
//!   biased statistics over each sample's group of channels and all their positions;
//!   `MaxPool2d`'s padding never wins and its backward sends each window's gradient to the
//!   window's *first* maximum in row-major window order (a NaN, the first one, beats numbers);
//!   `AvgPool2d` divides by `kh·kw` (`count_include_pad`) or by the window's elements inside
//!   the input; `Upsample2d` repeats each pixel `scale[0]×scale[1]` times and its backward
//!   sums each block.
//! - **Mixture-of-experts ops** ([`crate::ops::moe`]): `TopK` sorts each row by value,
//!   larger first, NaN above numbers, equal values (±0 included) by lower index; indices,
//!   slots and expert ids must be whole numbers in range (`−1` is a dropped slot); `MoeSlots`
//!   fills each expert's capacity in row-major `(token, choice)` order; `MoeCombine` adds a
//!   token's choices in ascending `j`.
//! - **`AdamW`** implements the formula in the doc comment of [`Op::AdamW`] exactly (the
//!   `grad_scale` input and its skip-on-overflow rule included); `step` must be ≥ 1 (it is
//!   1-based). Outputs are fresh values (the in-place aliasing is a memory
//!   matter the interpreter ignores).

use crate::ops::optim;
use crate::{DType, Graph, IrError, Op, Result, Shape, TensorId, TrainingGraph};
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
        Op::Parameter { .. } | Op::Input(_) | Op::OptimizerState { .. } | Op::KvCache(_) => true,
        Op::Fill { .. }
        | Op::CacheWrite
        | Op::SelectPositions
        | Op::QMatMul(_)
        | Op::QMatMulBackward(_)
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
        | Op::LogSumExp
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
        | Op::LinearCrossEntropy { .. }
        | Op::LinearCrossEntropyBackward { .. }
        | Op::TiledMlp(_)
        | Op::TiledMlpBackward(_)
        | Op::Attention(_)
        | Op::AttentionBackward(_)
        | Op::AttentionMerge
        | Op::AttentionMergeBackward
        | Op::RingMerge(_)
        | Op::Rope { .. }
        | Op::Conv2d(_)
        | Op::Conv2dBackwardInput { .. }
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
    // Frozen parameters carry no state but their value.
    for f in train.graph.frozen_parameters() {
        let p = params.get(&f).ok_or_else(|| {
            IrError::Graph(format!(
                "{}: no initial value for this frozen parameter",
                train.graph.tensor_scope(f)
            ))
        })?;
        state.insert(f, p.clone());
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
        Op::Parameter { .. } | Op::Input(_) | Op::OptimizerState { .. } | Op::KvCache(_) => {
            return Err(format!("{} takes its value from the bindings", op.name()))
        }
        // Optional inputs: a start per row (attention over a cache), positions (RoPE).
        Op::Attention(_) if x.len() == 4 => 4,
        Op::Rope { .. } if x.len() == 2 => 2,
        Op::CacheWrite | Op::QMatMul(_) | Op::QMatMulBackward(_) => 3,
        Op::SelectPositions => 2,
        Op::Fill { .. } => 0,
        Op::Unary(_) | Op::Cast(_) | Op::Reduce { .. } | Op::Softmax | Op::LogSumExp => 1,
        Op::CrossEntropy { classes: Some(_), .. } => 3,
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
        Op::Embedding { .. } | Op::EmbeddingBackward { .. } | Op::CrossEntropy { .. } => 2,
        Op::BinaryBackward { .. } | Op::LayerNorm { .. } | Op::LayerNormBackward { .. } => 3,
        Op::RmsNormBackward { .. } | Op::Attention(_) => 3,
        Op::CrossEntropyBackward { .. } => 4,
        Op::LinearCrossEntropy { .. } => 3,
        Op::LinearCrossEntropyBackward { .. } => 5,
        Op::TiledMlp(spec) => spec.num_inputs(),
        Op::TiledMlpBackward(spec) => spec.num_inputs() + 1,
        Op::MaxPool2d(_) | Op::AvgPool2d { .. } | Op::AvgPool2dBackward { .. } => 1,
        Op::Upsample2d { .. } | Op::Upsample2dBackward { .. } => 1,
        Op::Conv2d(_) | Op::Conv2dBackwardInput { .. } | Op::Conv2dBackwardWeight { .. } => 2,
        Op::MaxPool2dBackward(_) => 2,
        Op::GroupNorm { .. } | Op::GroupNormBackward { .. } => 3,
        Op::AttentionBackward(_) if x.len() == 7 => 7,
        Op::AttentionBackward(_) => 6,
        Op::TopK { .. } | Op::MoeSlots { .. } => 1,
        Op::TakeAlong | Op::ScatterAlong { .. } => 2,
        // Optional weights.
        Op::MoeDispatch { .. } | Op::MoeCombine => x.len().clamp(2, 3),
        Op::MoeSlotDot => 3,
        Op::Concat { .. } => x.len().max(1),
        // (out, logsumexp) pairs, and the gradient last in the backward.
        Op::AttentionMerge => x.len().max(2),
        Op::AttentionMergeBackward => x.len().max(3),
        // Two pairs, and the device's own q, k, v on a ring's last merge.
        Op::RingMerge(m) => {
            if m.backward.is_some() {
                7
            } else {
                4
            }
        }
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
        Op::Parameter { .. }
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
        Op::QMatMulBackward(q) => one(qmatmul_backward(x[0], x[1], x[2], *q)?),
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
        Op::Embedding { rows } => one(embedding(x[0], x[1], rows.as_ref())?),
        Op::EmbeddingBackward { num_embeddings, rows } => {
            one(embedding_backward(x[0], x[1], *num_embeddings, rows.as_ref())?)
        }
        Op::CrossEntropy { ignore_index, sum, classes } => {
            cross_entropy(x[0], x[1], x.get(2).copied(), *ignore_index, *sum, classes.as_ref())
        }
        Op::CrossEntropyBackward { ignore_index, sum, classes } => one(cross_entropy_backward(
            x[0],
            x[1],
            x[2],
            x[3],
            *ignore_index,
            *sum,
            classes.as_ref(),
        )?),
        Op::LogSumExp => one(logsumexp_rows(x[0])?),
        Op::LinearCrossEntropy { chunk_rows, ignore_index } => {
            linear_loss::linear_cross_entropy(x[0], x[1], x[2], *chunk_rows, *ignore_index)
        }
        Op::LinearCrossEntropyBackward { chunk_rows, ignore_index } => {
            linear_loss::linear_cross_entropy_backward(x, *chunk_rows, *ignore_index)
        }
        Op::TiledMlp(spec) => one(tiled_mlp::forward(x, spec)?),
        Op::TiledMlpBackward(spec) => tiled_mlp::backward(x, spec),
        Op::Attention(spec) => attention(x[0], x[1], x[2], x.get(3).copied(), spec),
        Op::AttentionBackward(spec) => attention_backward(x, spec),
        Op::AttentionMerge => one(attention_merge(x)?),
        Op::AttentionMergeBackward => attention_merge_backward(x),
        Op::RingMerge(_) => ring_merge(&x[..4]),
        Op::Rope { inv_freq, inverse } => one(rope(x[0], x.get(1).copied(), inv_freq, *inverse)?),
        Op::AdamW(spec) => adamw(x, spec),
        Op::Conv2d(spec) => one(vision::conv2d(x[0], x[1], spec)?),
        Op::Conv2dBackwardInput { spec, input_hw } => {
            one(vision::conv2d_backward_input(x[0], x[1], spec, *input_hw)?)
        }
        Op::Conv2dBackwardWeight { spec, kernel_hw } => {
            one(vision::conv2d_backward_weight(x[0], x[1], spec, *kernel_hw)?)
        }
        Op::GroupNorm { groups, eps } => one(vision::group_norm(x[0], x[1], x[2], *groups, *eps)?),
        Op::GroupNormBackward { groups, eps } => {
            vision::group_norm_backward(x[0], x[1], x[2], *groups, *eps)
        }
        Op::MaxPool2d(pool) => one(vision::max_pool2d(x[0], pool)?),
        Op::MaxPool2dBackward(pool) => one(vision::max_pool2d_backward(x[0], x[1], pool)?),
        Op::AvgPool2d { pool, count_include_pad } => {
            one(vision::avg_pool2d(x[0], pool, *count_include_pad)?)
        }
        Op::AvgPool2dBackward { pool, count_include_pad, input_hw } => {
            one(vision::avg_pool2d_backward(x[0], pool, *count_include_pad, *input_hw)?)
        }
        Op::Upsample2d { scale } => one(vision::upsample2d(x[0], *scale)?),
        Op::Upsample2dBackward { scale } => one(vision::upsample2d_backward(x[0], *scale)?),
        Op::TopK { k } => moe::top_k(x[0], *k),
        Op::TakeAlong => one(moe::take_along(x[0], x[1])?),
        Op::ScatterAlong { size } => one(moe::scatter_along(x[0], x[1], *size)?),
        Op::MoeSlots { experts, capacity } => one(moe::moe_slots(x[0], *experts, *capacity)?),
        Op::MoeDispatch { experts, capacity } => {
            one(moe::moe_dispatch(x[0], x[1], x.get(2).copied(), *experts, *capacity)?)
        }
        Op::MoeCombine => one(moe::moe_combine(x[0], x[1], x.get(2).copied())?),
        Op::MoeSlotDot => one(moe::moe_slot_dot(x[0], x[1], x[2])?),
    }
}

mod kernels;
mod linear_loss;
mod moe;
mod nn;
mod tiled_mlp;
mod vision;

use kernels::*;
use nn::*;
pub use nn::{dequantize, erf, erfc};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReduceOp;

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
