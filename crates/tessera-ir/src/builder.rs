//! The builder in which models are written.
//!
//! It appends nodes to a [`Graph`], checking each op's shapes as it goes, and stamps every node
//! with the current scope path, repeated-block index and phase. A shape error names the scope,
//! the op and the input shapes: `h.3.mlp.c_fc: matmul f32[4,128,768] x f32[3072,768]: inner
//! dims 768 vs 3072`.

use crate::ops::{BinaryOp, Conv2dSpec, Pool2dSpec, ReduceOp, UnaryOp};
use crate::{
    AttentionSpec, DType, Graph, IrError, NodeId, Op, Phase, Result, ScopeId, Shape, TensorId,
    TensorIds, TensorMeta, Tier,
};

pub struct Builder {
    pub graph: Graph,
    scope_stack: Vec<String>,
    scope: ScopeId,
    block: Option<u32>,
    phase: Phase,
    /// The tier of leaves created next (computed nodes take theirs from their inputs).
    leaf_tier: Tier,
}

impl Default for Builder {
    fn default() -> Self {
        Builder::new()
    }
}

impl Builder {
    pub fn new() -> Builder {
        let graph = Graph::new();
        Builder {
            graph,
            scope_stack: Vec::new(),
            scope: ScopeId(0),
            block: None,
            phase: Phase::Forward,
            leaf_tier: Tier::Device,
        }
    }

    /// Continues building on an existing graph (autodiff appends the backward pass this way).
    pub fn from_graph(graph: Graph) -> Builder {
        Builder {
            graph,
            scope_stack: Vec::new(),
            scope: ScopeId(0),
            block: None,
            phase: Phase::Forward,
            leaf_tier: Tier::Device,
        }
    }

    pub fn finish(self) -> Graph {
        self.graph
    }

    // ---- context ------------------------------------------------------------------------

    /// The current scope path, components joined by `.`.
    pub fn scope_path(&self) -> String {
        self.scope_stack.join(".")
    }

    pub fn push_scope(&mut self, name: impl AsRef<str>) {
        self.scope_stack.push(name.as_ref().to_string());
        self.scope = self.graph.intern_scope(&self.scope_path());
    }

    pub fn pop_scope(&mut self) {
        self.scope_stack.pop();
        self.scope = self.graph.intern_scope(&self.scope_path());
    }

    /// Runs `f` inside scope `name` (appended to the current path).
    pub fn scoped<R>(&mut self, name: impl AsRef<str>, f: impl FnOnce(&mut Self) -> R) -> R {
        self.push_scope(name);
        let r = f(self);
        self.pop_scope();
        r
    }

    /// Marks subsequent nodes as belonging to repeated block `block`.
    pub fn set_block(&mut self, block: Option<u32>) {
        self.block = block;
    }
    pub fn block(&self) -> Option<u32> {
        self.block
    }
    pub fn set_phase(&mut self, phase: Phase) {
        self.phase = phase;
    }
    pub fn phase(&self) -> Phase {
        self.phase
    }
    fn stamp(&self, scope: ScopeId, tier: Tier) -> crate::graph::Stamp {
        crate::graph::Stamp { scope, block: self.block, phase: self.phase, tier }
    }

    /// Puts subsequent leaves (parameters, optimizer state, inputs) in `tier`.
    pub fn set_leaf_tier(&mut self, tier: Tier) {
        self.leaf_tier = tier;
    }
    pub fn leaf_tier(&self) -> Tier {
        self.leaf_tier
    }

    /// The tier a node of `op` on `inputs` runs in: a transfer's destination; otherwise the
    /// lowest tier among its non-scalar inputs (a host-resident operand makes the op a host
    /// op: the optimizer of an offloaded chunk); scalars (learning rate, gradient norm) are
    /// read across tiers; no input (a fill): the leaf tier; only scalars: the device.
    fn tier_of(&self, op: &Op, inputs: &[TensorId]) -> Tier {
        if let Op::Transfer { to, .. } = op {
            return *to;
        }
        if inputs.is_empty() {
            return self.leaf_tier;
        }
        inputs
            .iter()
            .filter(|&&t| self.graph.meta(t).shape.rank() > 0)
            .map(|&t| self.graph.producer(t).tier)
            .max()
            .unwrap_or_default()
    }
    /// Stamps subsequent nodes with an already interned scope (autodiff reuses the forward
    /// node's scope for its backward nodes).
    pub fn set_scope_id(&mut self, scope: ScopeId) {
        self.scope = scope;
    }
    /// Stamps subsequent nodes with the scope `path` (interned here).
    pub fn set_scope_path(&mut self, path: &str) {
        self.scope = self.graph.intern_scope(path);
    }
    pub fn scope_id(&self) -> ScopeId {
        self.scope
    }

    pub fn meta(&self, t: TensorId) -> &TensorMeta {
        self.graph.meta(t)
    }
    pub fn shape(&self, t: TensorId) -> &Shape {
        self.graph.shape(t)
    }
    pub fn dtype(&self, t: TensorId) -> DType {
        self.graph.meta(t).dtype
    }

    // ---- generic op ---------------------------------------------------------------------

    /// Appends `op` applied to `inputs`, returning its outputs; shape errors carry context.
    pub fn push(&mut self, op: Op, inputs: &[TensorId]) -> Result<TensorIds> {
        let metas: smallvec::SmallVec<[&TensorMeta; 4]> =
            inputs.iter().map(|&t| self.graph.meta(t)).collect();
        let out = match op.infer(&metas) {
            Ok(out) => out,
            Err(reason) => {
                let inputs = metas.iter().map(|m| m.to_string()).collect::<Vec<_>>().join(" x ");
                return Err(IrError::Shape {
                    scope: self.graph.scope_name(self.scope).to_string(),
                    op: op.name().to_string(),
                    inputs,
                    reason,
                });
            }
        };
        drop(metas);
        let tier = self.tier_of(&op, inputs);
        let id = self.graph.push_node(op, inputs, out, self.stamp(self.scope, tier));
        Ok(self.graph.node(id).outputs.clone())
    }

    /// [`Builder::push`] for a copy of a node of `from` (same op, inputs of the same metas as
    /// the original's): the outputs take the original's metas instead of being inferred again.
    /// Rewrites that copy whole graphs (the micro-batch replay, checkpointing) push every node
    /// this way; debug builds check the metas against inference.
    pub fn push_like(
        &mut self,
        from: &Graph,
        original: &crate::graph::Node,
        op: Op,
        inputs: &[TensorId],
    ) -> Result<TensorIds> {
        debug_assert!(
            inputs.len() == original.inputs.len()
                && inputs
                    .iter()
                    .zip(&original.inputs)
                    .all(|(&a, &b)| self.graph.meta(a) == from.meta(b)),
            "push_like: inputs' metas differ from the original node's"
        );
        let out: Vec<TensorMeta> = original.outputs.iter().map(|&t| from.meta(t).clone()).collect();
        #[cfg(debug_assertions)]
        {
            let metas: Vec<&TensorMeta> = inputs.iter().map(|&t| self.graph.meta(t)).collect();
            debug_assert_eq!(op.infer(&metas).as_ref().ok(), Some(&out), "push_like: metas");
        }
        let id = self.graph.push_node(op, inputs, out, self.stamp(self.scope, original.tier));
        Ok(self.graph.node(id).outputs.clone())
    }

    /// [`Builder::push`] for single-output ops.
    pub fn push1(&mut self, op: Op, inputs: &[TensorId]) -> Result<TensorId> {
        let out = self.push(op, inputs)?;
        Ok(out[0])
    }

    fn leaf(&mut self, name: &str, op: Op, inputs: &[TensorId]) -> TensorId {
        let path = if self.scope_stack.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.scope_path())
        };
        let scope = self.graph.intern_scope(&path);
        let metas: Vec<&TensorMeta> = inputs.iter().map(|&t| self.graph.meta(t)).collect();
        let out = op.infer(&metas).expect("leaf metas are given, not inferred");
        let id: NodeId = self.graph.push_node(op, inputs, out, self.stamp(scope, self.leaf_tier));
        self.graph.node(id).outputs[0]
    }

    // ---- leaves -------------------------------------------------------------------------

    /// A trainable weight named `<scope>.<name>` (its Hugging Face name).
    pub fn parameter(&mut self, name: &str, shape: impl Into<Shape>, dtype: DType) -> TensorId {
        let meta = TensorMeta::new(shape, dtype);
        self.leaf(name, Op::Parameter { meta, frozen: false }, &[])
    }

    /// A weight named like [`Builder::parameter`] that is never trained (see
    /// [`Op::Parameter`]).
    pub fn frozen_parameter(
        &mut self,
        name: &str,
        shape: impl Into<Shape>,
        dtype: DType,
    ) -> TensorId {
        let meta = TensorMeta::new(shape, dtype);
        self.leaf(name, Op::Parameter { meta, frozen: true }, &[])
    }

    /// Per-step data named `<scope>.<name>`.
    pub fn input(&mut self, name: &str, shape: impl Into<Shape>, dtype: DType) -> TensorId {
        self.leaf(name, Op::Input(TensorMeta::new(shape, dtype)), &[])
    }

    pub(crate) fn optimizer_state(
        &mut self,
        name: &str,
        kind: crate::StateKind,
        param: TensorId,
        like: TensorId,
        dtype: DType,
    ) -> TensorId {
        let meta = TensorMeta { shape: self.shape(like).clone(), dtype };
        self.leaf(name, Op::OptimizerState { kind, meta }, &[param])
    }

    pub fn fill(&mut self, value: f64, shape: impl Into<Shape>, dtype: DType) -> Result<TensorId> {
        self.push1(Op::Fill { value, meta: TensorMeta::new(shape, dtype) }, &[])
    }

    /// A scalar constant of `like`'s dtype, broadcastable against it.
    pub fn scalar_like(&mut self, value: f64, like: TensorId) -> Result<TensorId> {
        let dtype = self.dtype(like);
        self.fill(value, Shape::scalar(), dtype)
    }

    // ---- elementwise --------------------------------------------------------------------

    pub fn unary(&mut self, op: UnaryOp, x: TensorId) -> Result<TensorId> {
        self.push1(Op::Unary(op), &[x])
    }
    pub fn binary(&mut self, op: BinaryOp, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.push1(Op::Binary(op), &[a, b])
    }
    pub fn add(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(BinaryOp::Add, a, b)
    }
    pub fn sub(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(BinaryOp::Sub, a, b)
    }
    pub fn mul(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(BinaryOp::Mul, a, b)
    }
    pub fn div(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(BinaryOp::Div, a, b)
    }
    /// x · c for a constant c.
    pub fn scale(&mut self, x: TensorId, c: f64) -> Result<TensorId> {
        let s = self.scalar_like(c, x)?;
        self.mul(x, s)
    }
    pub fn cast(&mut self, x: TensorId, dtype: DType) -> Result<TensorId> {
        self.push1(Op::Cast(dtype), &[x])
    }
    /// Dropout keyed by the step's `seed` input; `stream` must differ between call sites.
    pub fn dropout(
        &mut self,
        x: TensorId,
        p: f64,
        seed: TensorId,
        stream: u64,
    ) -> Result<TensorId> {
        self.push1(Op::Dropout { p, stream, shard: None }, &[x, seed])
    }

    // ---- linear algebra -----------------------------------------------------------------

    pub fn matmul(
        &mut self,
        a: TensorId,
        b: TensorId,
        trans_a: bool,
        trans_b: bool,
    ) -> Result<TensorId> {
        self.push1(Op::MatMul { trans_a, trans_b }, &[a, b])
    }

    // ---- reductions ---------------------------------------------------------------------

    pub fn reduce(
        &mut self,
        op: ReduceOp,
        x: TensorId,
        dims: &[usize],
        keepdim: bool,
    ) -> Result<TensorId> {
        self.push1(Op::Reduce { op, dims: dims.to_vec(), keepdim }, &[x])
    }
    pub fn softmax(&mut self, x: TensorId) -> Result<TensorId> {
        self.push1(Op::Softmax, &[x])
    }

    /// Sums `g` down to `target` (the inverse of broadcasting), once, generically: dims that
    /// were added on the left are reduced away, dims that were 1 are reduced with keepdim.
    pub fn unbroadcast(&mut self, g: TensorId, target: &Shape) -> Result<TensorId> {
        let gs = self.shape(g).clone();
        if &gs == target {
            return Ok(g);
        }
        let lead = gs.rank() - target.rank();
        let dims: Vec<usize> = (0..gs.rank())
            .filter(|&i| i < lead || (target.dim(i - lead) == 1 && gs.dim(i) != 1))
            .collect();
        let r = if dims.is_empty() { g } else { self.reduce(ReduceOp::Sum, g, &dims, true)? };
        self.reshape(r, target.clone())
    }

    // ---- layout -------------------------------------------------------------------------

    pub fn reshape(&mut self, x: TensorId, shape: impl Into<Shape>) -> Result<TensorId> {
        let shape = shape.into();
        if self.shape(x) == &shape {
            return Ok(x);
        }
        self.push1(Op::Reshape(shape), &[x])
    }
    pub fn permute(&mut self, x: TensorId, perm: &[usize]) -> Result<TensorId> {
        self.push1(Op::Permute(perm.to_vec()), &[x])
    }
    pub fn slice(&mut self, x: TensorId, dim: usize, start: usize, end: usize) -> Result<TensorId> {
        self.push1(Op::Slice { dim, start, end }, &[x])
    }
    pub fn pad(
        &mut self,
        x: TensorId,
        dim: usize,
        before: usize,
        after: usize,
    ) -> Result<TensorId> {
        self.push1(Op::Pad { dim, before, after }, &[x])
    }
    pub fn concat(&mut self, xs: &[TensorId], dim: usize) -> Result<TensorId> {
        self.push1(Op::Concat { dim }, xs)
    }
    pub fn expand(&mut self, x: TensorId, shape: impl Into<Shape>) -> Result<TensorId> {
        self.push1(Op::Expand(shape.into()), &[x])
    }

    // ---- neural-network ops -------------------------------------------------------------

    pub fn layer_norm(
        &mut self,
        x: TensorId,
        w: TensorId,
        b: TensorId,
        eps: f64,
    ) -> Result<TensorId> {
        self.push1(Op::LayerNorm { eps }, &[x, w, b])
    }
    pub fn rms_norm(&mut self, x: TensorId, w: TensorId, eps: f64) -> Result<TensorId> {
        self.push1(Op::RmsNorm { eps }, &[x, w])
    }
    pub fn embedding(&mut self, table: TensorId, ids: TensorId) -> Result<TensorId> {
        self.push1(Op::Embedding { rows: None }, &[table, ids])
    }
    /// Mean cross-entropy of `logits [.., V]` against `targets [..]`; returns the scalar loss.
    pub fn cross_entropy(
        &mut self,
        logits: TensorId,
        targets: TensorId,
        ignore_index: Option<i64>,
    ) -> Result<TensorId> {
        Ok(self.push(
            Op::CrossEntropy { ignore_index, sum: false, classes: None },
            &[logits, targets],
        )?[0])
    }
    /// Cross-entropy summed over the rows whose target is not `ignore_index` (divide by a
    /// count of those rows over the whole step for a mean that no plan changes).
    pub fn cross_entropy_sum(
        &mut self,
        logits: TensorId,
        targets: TensorId,
        ignore_index: Option<i64>,
    ) -> Result<TensorId> {
        Ok(self.push(
            Op::CrossEntropy { ignore_index, sum: true, classes: None },
            &[logits, targets],
        )?[0])
    }
    /// Fused attention on `[B,S,H,D]` operands; returns the output.
    pub fn attention(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        spec: AttentionSpec,
    ) -> Result<TensorId> {
        Ok(self.push(Op::Attention(spec), &[q, k, v])?[0])
    }
    pub fn rope(&mut self, x: TensorId, inv_freq: &[f64]) -> Result<TensorId> {
        self.push1(Op::Rope { inv_freq: inv_freq.to_vec(), inverse: false }, &[x])
    }
    /// RoPE at explicit `positions [B,S]` (inference: each row's own offsets).
    pub fn rope_at(
        &mut self,
        x: TensorId,
        positions: TensorId,
        inv_freq: &[f64],
    ) -> Result<TensorId> {
        self.push1(Op::Rope { inv_freq: inv_freq.to_vec(), inverse: false }, &[x, positions])
    }

    // ---- vision / diffusion (NCHW) -------------------------------------------------------

    /// 2-D convolution of `x [N,C,H,W]` with `w [O,C/groups,kh,kw]` (no bias: add one with a
    /// broadcast [`Builder::add`] of a `[1,O,1,1]` reshape).
    pub fn conv2d(&mut self, x: TensorId, w: TensorId, spec: Conv2dSpec) -> Result<TensorId> {
        self.push1(Op::Conv2d(spec), &[x, w])
    }
    /// PyTorch's `GroupNorm(groups, C, eps)` on `x [N,C,..]` with per-channel `w`, `b` `[C]`.
    pub fn group_norm(
        &mut self,
        x: TensorId,
        w: TensorId,
        b: TensorId,
        groups: usize,
        eps: f64,
    ) -> Result<TensorId> {
        self.push1(Op::GroupNorm { groups, eps }, &[x, w, b])
    }
    /// Max pooling of `x [N,C,H,W]` (floor mode; `padding ≤ kernel/2`).
    pub fn max_pool2d(
        &mut self,
        x: TensorId,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Result<TensorId> {
        self.push1(Op::MaxPool2d(Pool2dSpec { kernel, stride, padding }), &[x])
    }
    /// Average pooling of `x [N,C,H,W]` (floor mode; `padding ≤ kernel/2`). Global average
    /// pooling is `kernel = [H, W]`, stride 1, no padding.
    pub fn avg_pool2d(
        &mut self,
        x: TensorId,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        count_include_pad: bool,
    ) -> Result<TensorId> {
        let pool = Pool2dSpec { kernel, stride, padding };
        self.push1(Op::AvgPool2d { pool, count_include_pad }, &[x])
    }
    /// Nearest-neighbour upsampling of `x [N,C,H,W]` by integer factors (`[2, 2]` doubles).
    pub fn upsample_nearest2d(&mut self, x: TensorId, scale: [usize; 2]) -> Result<TensorId> {
        self.push1(Op::Upsample2d { scale }, &[x])
    }

    // ---- inference ----------------------------------------------------------------------

    /// A key or value cache `<scope>.<name>` (resident across the steps of a generation).
    pub fn kv_cache(&mut self, name: &str, shape: impl Into<Shape>, dtype: DType) -> TensorId {
        self.leaf(name, Op::KvCache(TensorMeta::new(shape, dtype)), &[])
    }
    /// Writes `x [B,S,H,D]` into `cache` at each row's `start`; returns the updated cache.
    pub fn cache_write(
        &mut self,
        cache: TensorId,
        x: TensorId,
        start: TensorId,
    ) -> Result<TensorId> {
        self.push1(Op::CacheWrite, &[cache, x, start])
    }
    /// Attention of queries at positions `start[b] + i` over cached keys and values.
    pub fn attention_at(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        start: TensorId,
        spec: AttentionSpec,
    ) -> Result<TensorId> {
        Ok(self.push(Op::Attention(spec), &[q, k, v, start])?[0])
    }
    /// Row `b` of `x [B,S,..]` at position `index[b]`: `[B,1,..]`.
    pub fn select_positions(&mut self, x: TensorId, index: TensorId) -> Result<TensorId> {
        self.push1(Op::SelectPositions, &[x, index])
    }
    /// `x · dequant(weight)ᵀ` for a quantised weight and its scales.
    pub fn qmatmul(
        &mut self,
        x: TensorId,
        weight: TensorId,
        scales: TensorId,
        q: crate::QuantSpec,
    ) -> Result<TensorId> {
        self.push1(Op::QMatMul(q), &[x, weight, scales])
    }
}
