//! Reverse-mode autodiff as a graph → graph transformation, and the training graph.
//!
//! [`gradients`] walks the forward nodes in reverse, asks each op's VJP rule (in `ops/`) for
//! the gradients of its inputs, and accumulates contributions as they arrive (eagerly, so at
//! most one running sum per tensor is live). Slices of one tensor whose gradients tile it — q,
//! k and v cut from a fused projection — are joined by one concat instead of pad-and-add.
//! Backward nodes inherit the scope and block of the forward node they differentiate.
//!
//! [`build_training_graph`] adds the loss seed, the backward pass, the global gradient norm
//! and one AdamW update per parameter whose state (m, v and, for low-precision weights, an
//! fp32 master copy) are explicit tensors. With fp16 weights it adds loss scaling: a scalar
//! input `optimizer.loss_scale` seeds the backward pass and AdamW unscales (see
//! [`TrainingGraph::loss_scale`]).

use crate::ops::{optim, ReduceOp, UnaryOp};
use crate::{AdamWSpec, Builder, DType, IrError, Op, Phase, Result, Shape, StateKind, TensorId};
use serde::{Deserialize, Serialize};

/// A gradient contribution to one input.
#[derive(Clone, Copy, Debug)]
pub enum Grad {
    /// The gradient of the whole input.
    Full(TensorId),
    /// The gradient of `input[.., start..end, ..]` along `dim`; zero elsewhere.
    Slice { dim: usize, start: usize, end: usize, grad: TensorId },
}

/// What a VJP rule sees of the forward node it differentiates.
pub struct VjpCtx<'a> {
    pub(crate) b: &'a mut Builder,
    pub inputs: &'a [TensorId],
    pub outputs: &'a [TensorId],
    pub(crate) dout: &'a [Option<TensorId>],
    /// Which inputs need a gradient.
    pub needs: &'a [bool],
}

impl VjpCtx<'_> {
    pub fn x(&self, i: usize) -> TensorId {
        self.inputs[i]
    }
    pub fn y(&self, i: usize) -> TensorId {
        self.outputs[i]
    }
    /// How many inputs the node has (some ops take optional ones).
    pub fn node_inputs(&self) -> usize {
        self.inputs.len()
    }
    /// The gradient reaching output `i` (zeros if none does).
    pub fn dy(&mut self, i: usize) -> Result<TensorId> {
        match self.dout[i] {
            Some(t) => Ok(t),
            None => {
                let m = self.b.meta(self.outputs[i]).clone();
                self.b.fill(0.0, m.shape, m.dtype)
            }
        }
    }
}

/// Pending contributions of one tensor: at most one full running sum plus slices.
#[derive(Default, Clone)]
struct Pending {
    full: Option<TensorId>,
    slices: Vec<(usize, usize, usize, TensorId)>,
}

fn contribute(b: &mut Builder, p: &mut Pending, g: Grad) -> Result<()> {
    match g {
        Grad::Full(t) => {
            p.full = Some(match p.full {
                Some(acc) => b.add(acc, t)?,
                None => t,
            })
        }
        Grad::Slice { dim, start, end, grad } => p.slices.push((dim, start, end, grad)),
    }
    Ok(())
}

/// Sums the contributions of tensor `t` into one gradient tensor.
fn finish(b: &mut Builder, t: TensorId, mut p: Pending) -> Result<Option<TensorId>> {
    if p.slices.is_empty() {
        return Ok(p.full);
    }
    let shape = b.shape(t).clone();
    p.slices.sort_by_key(|s| (s.0, s.1));
    let dim = p.slices[0].0;
    let tiles = p.full.is_none()
        && p.slices.iter().all(|s| s.0 == dim)
        && p.slices.windows(2).all(|w| w[0].2 == w[1].1)
        && p.slices[0].1 == 0
        && p.slices.last().map(|s| s.2) == Some(shape.dim(dim));
    if tiles {
        let parts: Vec<TensorId> = p.slices.iter().map(|s| s.3).collect();
        return Ok(Some(if parts.len() == 1 { parts[0] } else { b.concat(&parts, dim)? }));
    }
    let mut acc = p.full;
    for (dim, start, end, g) in p.slices {
        let padded = b.pad(g, dim, start, shape.dim(dim) - end)?;
        acc = Some(match acc {
            Some(a) => b.add(a, padded)?,
            None => padded,
        });
    }
    Ok(acc)
}

/// Appends the backward pass of `loss` (a scalar) to the builder's graph and returns the
/// gradient of each tensor in `wrt` (`None` where the loss does not depend on it).
pub fn gradients(
    b: &mut Builder,
    loss: TensorId,
    wrt: &[TensorId],
) -> Result<Vec<Option<TensorId>>> {
    gradients_seeded(b, loss, None, wrt)
}

/// [`gradients`] of `seed · loss`: the backward pass starts from the scalar `seed` (cast to
/// the loss's dtype if needed) instead of 1. Loss scaling seeds with the loss scale.
pub fn gradients_seeded(
    b: &mut Builder,
    loss: TensorId,
    seed: Option<TensorId>,
    wrt: &[TensorId],
) -> Result<Vec<Option<TensorId>>> {
    if b.shape(loss).rank() != 0 || !b.dtype(loss).is_float() {
        return Err(IrError::Graph(format!(
            "the loss must be a float scalar, got {}",
            b.meta(loss)
        )));
    }
    let num_forward = b.graph.nodes.len();
    // requires_grad: reachable from a `wrt` tensor through differentiable inputs.
    let mut requires = vec![false; b.graph.tensors.len()];
    for &w in wrt {
        requires[w.index()] = true;
    }
    for node in &b.graph.nodes {
        let diff = node.op.differentiable_inputs(node.inputs.len());
        // A pipeline transfer pairs with its peer's: its gradient transfer always runs, or the
        // peer would wait for it.
        let pairs =
            is_transfer(&node.op) && node.outputs.iter().all(|&o| b.graph.meta(o).dtype.is_float());
        if pairs || node.inputs.iter().zip(&diff).any(|(t, &d)| d && requires[t.index()]) {
            for &o in &node.outputs {
                requires[o.index()] = true;
            }
        }
    }
    if !requires[loss.index()] {
        return Err(IrError::Graph("the loss does not depend on any parameter".into()));
    }

    let saved_phase = b.phase();
    let saved_scope = b.scope_id();
    let saved_block = b.block();
    b.set_phase(Phase::Backward);

    let mut pending: Vec<Pending> = vec![Pending::default(); b.graph.tensors.len()];
    let seed = match seed {
        None => b.fill(1.0, Shape::scalar(), b.dtype(loss))?,
        Some(s) if b.shape(s).rank() != 0 || !b.dtype(s).is_float() => {
            return Err(IrError::Graph(format!(
                "the backward seed must be a float scalar, got {}",
                b.meta(s)
            )))
        }
        Some(s) if b.dtype(s) != b.dtype(loss) => b.cast(s, b.dtype(loss))?,
        Some(s) => s,
    };
    if pending.len() < b.graph.tensors.len() {
        pending.resize(b.graph.tensors.len(), Pending::default());
    }
    pending[loss.index()].full = Some(seed);

    for n in (0..num_forward).rev() {
        let node = b.graph.nodes[n].clone();
        if node.op.is_leaf() || !node.outputs.iter().any(|o| requires[o.index()]) {
            continue;
        }
        b.set_scope_id(node.scope);
        b.set_block(node.block);
        let mut dout = Vec::with_capacity(node.outputs.len());
        for &o in &node.outputs {
            let p = std::mem::take(&mut pending[o.index()]);
            dout.push(finish(b, o, p)?);
        }
        let transfer = is_transfer(&node.op);
        if dout.iter().all(Option::is_none) && !transfer {
            continue;
        }
        let diff = node.op.differentiable_inputs(node.inputs.len());
        let needs: Vec<bool> =
            node.inputs.iter().zip(&diff).map(|(t, &d)| d && requires[t.index()]).collect();
        if !needs.iter().any(|&x| x) && !transfer {
            continue;
        }
        let grads = {
            let mut cx = VjpCtx {
                b,
                inputs: &node.inputs,
                outputs: &node.outputs,
                dout: &dout,
                needs: &needs,
            };
            node.op.vjp(&mut cx)?
        };
        for (i, g) in grads.into_iter().enumerate() {
            if let (Some(g), true) = (g, needs[i]) {
                if pending.len() < b.graph.tensors.len() {
                    pending.resize(b.graph.tensors.len(), Pending::default());
                }
                let t = node.inputs[i];
                let mut p = std::mem::take(&mut pending[t.index()]);
                contribute(b, &mut p, g)?;
                pending[t.index()] = p;
            }
        }
    }

    let mut out = Vec::with_capacity(wrt.len());
    for &w in wrt {
        let producer = b.graph.producer(w);
        let (scope, block) = (producer.scope, producer.block);
        b.set_scope_id(scope);
        b.set_block(block);
        let p = std::mem::take(&mut pending[w.index()]);
        out.push(finish(b, w, p)?);
    }
    b.set_phase(saved_phase);
    b.set_scope_id(saved_scope);
    b.set_block(saved_block);
    Ok(out)
}

/// Sends and receives between pipeline stages: differentiated even where no gradient reaches
/// them (the gradient transfer is the peer's counterpart and must happen). Ring attention's
/// transfers (`P2p::ring`) are not: its lowering places them in both passes (the backward's
/// in [`Op::RingMerge`]'s VJP), so the autodiff leaves them alone.
fn is_transfer(op: &Op) -> bool {
    matches!(op, Op::Send(p) | Op::Recv(p, _) if !p.ring)
}

/// Optimizer settings baked into the training graph. The learning rate and step counter are
/// per-step inputs, so schedules need no graph change.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Applied to weights of rank ≥ 2 only (not biases, norms), as nanoGPT and HF do.
    pub weight_decay: f64,
    pub max_grad_norm: Option<f64>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            max_grad_norm: Some(1.0),
        }
    }
}

/// One parameter's tensors in the training graph.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ParamSlot {
    pub param: TensorId,
    pub grad: TensorId,
    pub m: TensorId,
    pub v: TensorId,
    /// fp32 master weights when the parameter is stored in lower precision.
    pub master: Option<TensorId>,
    /// What AdamW updates in place: the parameter itself, or this device's shard of it when
    /// optimizer state is sharded (ZeRO-1/2).
    #[serde(default)]
    pub update: Option<TensorId>,
    /// ZeRO-1/2: the updated shards gathered into a full parameter, which the runtime copies
    /// into `param` at the end of the step.
    #[serde(default)]
    pub gathered: Option<TensorId>,
    /// Optimizer state resting below the host (NVMe): each updated copy and the state leaf
    /// whose value it becomes when produced (the runtime writes it back, like `gathered`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stored: Vec<(TensorId, TensorId)>,
}

impl ParamSlot {
    /// The slot with every tensor mapped by `f` (a graph rewrite renumbering tensors).
    pub fn try_map<E>(
        &self,
        mut f: impl FnMut(TensorId) -> Result<TensorId, E>,
    ) -> Result<ParamSlot, E> {
        Ok(ParamSlot {
            param: f(self.param)?,
            grad: f(self.grad)?,
            m: f(self.m)?,
            v: f(self.v)?,
            master: self.master.map(&mut f).transpose()?,
            update: self.update.map(&mut f).transpose()?,
            gathered: self.gathered.map(&mut f).transpose()?,
            stored: self
                .stored
                .iter()
                .map(|&(a, b)| Ok((f(a)?, f(b)?)))
                .collect::<Result<Vec<_>, E>>()?,
        })
    }

    /// [`ParamSlot::try_map`] with a mapping that cannot fail.
    pub fn map(&self, mut f: impl FnMut(TensorId) -> TensorId) -> ParamSlot {
        match self.try_map(|t| Ok::<_, std::convert::Infallible>(f(t))) {
            Ok(s) => s,
            Err(never) => match never {},
        }
    }
}

/// How the optimizer section treats each parameter. The defaults are one device: the gradient
/// is already complete, AdamW updates the parameter itself, the norm is a plain sum. The
/// planner's lowering overrides them to synchronise gradients, shard optimizer state (ZeRO) and
/// sum gradient norms across devices.
pub trait UpdateHooks {
    /// The gradient to update with (e.g. after an all-reduce over data-parallel devices).
    fn sync_grad(
        &mut self,
        _b: &mut Builder,
        _param: TensorId,
        grad: TensorId,
    ) -> Result<TensorId> {
        Ok(grad)
    }
    /// The tensor AdamW updates in place for `param`; its shape is the optimizer state's.
    fn update_target(&mut self, _b: &mut Builder, param: TensorId) -> Result<TensorId> {
        Ok(param)
    }
    /// The memory tier `param`'s optimizer state rests in (offload: the host).
    fn state_tier(&mut self, _param: TensorId) -> crate::Tier {
        crate::Tier::Device
    }
    /// The value AdamW updates in place for optimizer state `state` of `param` (NVMe offload:
    /// a copy read into host memory).
    fn fetch_state(
        &mut self,
        _b: &mut Builder,
        _param: TensorId,
        state: TensorId,
    ) -> Result<TensorId> {
        Ok(state)
    }
    /// After the update of a fetched state (see [`UpdateHooks::fetch_state`]): the copy that
    /// becomes the state's new value (NVMe offload: written back), if any.
    fn store_state(
        &mut self,
        _b: &mut Builder,
        _param: TensorId,
        _fetched: TensorId,
    ) -> Result<Option<TensorId>> {
        Ok(None)
    }
    /// The gradient AdamW reads, given the synchronised one (offload: moved to the host right
    /// before the update).
    fn update_grad(
        &mut self,
        _b: &mut Builder,
        _param: TensorId,
        grad: TensorId,
    ) -> Result<TensorId> {
        Ok(grad)
    }
    /// One parameter's Σg² (f32 scalar) as a term of the global sum.
    fn norm_term(
        &mut self,
        _b: &mut Builder,
        _param: TensorId,
        sumsq: TensorId,
    ) -> Result<TensorId> {
        Ok(sumsq)
    }
    /// The sum of all terms, before the square root.
    fn norm_total(&mut self, _b: &mut Builder, total: TensorId) -> Result<TensorId> {
        Ok(total)
    }
    /// After the update of `target` (see [`UpdateHooks::update_target`]): e.g. gather the
    /// updated shards of `param`. Returns the full updated parameter when it is a new tensor.
    fn after_update(
        &mut self,
        _b: &mut Builder,
        _param: TensorId,
        _target: TensorId,
    ) -> Result<Option<TensorId>> {
        Ok(None)
    }
}

/// One device: every hook is the identity.
pub struct SingleDevice;
impl UpdateHooks for SingleDevice {}

/// Forward + backward + optimizer for one step, with handles to the tensors that matter.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainingGraph {
    pub graph: crate::Graph,
    pub loss: TensorId,
    pub grad_norm: TensorId,
    /// Learning-rate input (f32 scalar) and 1-based step input (i64 scalar).
    pub lr: TensorId,
    pub step: TensorId,
    /// fp16 parameters only: the loss-scale input `optimizer.loss_scale` (f32 scalar). The
    /// backward pass differentiates `loss · loss_scale` (`loss` itself stays unscaled),
    /// `grad_norm` is the norm of those scaled gradients, and every AdamW node reads
    /// `grad_scale = 1 / loss_scale` (computed in the graph) to unscale them and to skip the
    /// update when the unscaled norm is not finite.
    #[serde(default)]
    pub loss_scale: Option<TensorId>,
    pub params: Vec<ParamSlot>,
    /// How a device's leaves lie in the global tensors and which inputs feed which
    /// micro-batch: set by the planner's lowering, empty on a single-device graph.
    #[serde(default)]
    pub layout: LeafLayout,
}

/// The plan's facts about a per-device training graph's leaves, as data the runtime reads
/// (no name is parsed on the way): set by the planner's lowering.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LeafLayout {
    /// Each sharded leaf's placement (parameters, optimizer state, data inputs); a leaf not
    /// listed is whole on every device.
    pub placements: std::collections::BTreeMap<TensorId, crate::dist::Placement>,
    /// Per micro-batch of an unrolled step, its data inputs by base name (`input_ids`,
    /// `labels`, `seed`, ...). Empty: one micro-batch whose inputs carry the base names.
    pub micro_batches: Vec<std::collections::BTreeMap<String, TensorId>>,
    /// Ring attention's zig-zag chunks (`Some(n)`: `n` devices on the ring): the runtime
    /// reorders the sequence (dim 1) of every `[batch, seq, ..]` data input into `2·n` chunks,
    /// chunk `c` then chunk `2·n − 1 − c` for each `c`, before cutting it as usual, so device
    /// `c`'s contiguous shard is its two chunks ([`crate::RingBlock`]). A missing
    /// `position_ids` input is the positions `0..seq` of every row, reordered alike.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zigzag: Option<usize>,
}

impl TrainingGraph {
    /// This step's handles and leaf layout carried onto `graph`, a rewrite of `self.graph`,
    /// through `f` (each old tensor id to its new one): what a rewrite of a training graph
    /// (recomputation, activation offload) returns.
    pub fn try_remap<E>(
        &self,
        graph: crate::Graph,
        mut f: impl FnMut(TensorId) -> std::result::Result<TensorId, E>,
    ) -> std::result::Result<TrainingGraph, E> {
        let params = self.params.iter().map(|s| s.try_map(&mut f)).collect::<Result<_, _>>()?;
        let placements = self
            .layout
            .placements
            .iter()
            .map(|(&t, p)| Ok((f(t)?, p.clone())))
            .collect::<Result<_, E>>()?;
        let micro_batches = self
            .layout
            .micro_batches
            .iter()
            .map(|g| g.iter().map(|(k, &t)| Ok((k.clone(), f(t)?))).collect::<Result<_, E>>())
            .collect::<Result<_, E>>()?;
        Ok(TrainingGraph {
            loss: f(self.loss)?,
            grad_norm: f(self.grad_norm)?,
            lr: f(self.lr)?,
            step: f(self.step)?,
            loss_scale: self.loss_scale.map(&mut f).transpose()?,
            params,
            layout: LeafLayout { placements, micro_batches, zigzag: self.layout.zigzag },
            graph,
        })
    }
}

/// Builds the training graph of a forward graph whose scalar `loss` is given.
pub fn build_training_graph(
    b: Builder,
    loss: TensorId,
    cfg: &TrainConfig,
) -> Result<TrainingGraph> {
    build_training_graph_with(b, loss, cfg, &mut SingleDevice)
}

/// [`build_training_graph`] with the optimizer section shaped by `hooks` (distributed
/// lowering).
pub fn build_training_graph_with(
    mut b: Builder,
    loss: TensorId,
    cfg: &TrainConfig,
    hooks: &mut dyn UpdateHooks,
) -> Result<TrainingGraph> {
    // Frozen parameters are no `wrt`: no gradient reaches them, and a VJP computes an
    // input's gradient only where that input needs one (`VjpCtx::needs`).
    let params = b.graph.trainable_parameters();
    if params.is_empty() {
        let what = if b.graph.parameters().is_empty() {
            "no parameters"
        } else {
            "every parameter frozen"
        };
        return Err(IrError::Graph(format!(
            "the model has {what}: nothing to train (unfreeze some: check --freeze and --lora)"
        )));
    }
    // Loss scaling for fp16 weights (bf16 has fp32's range and needs none).
    let scaled = params.iter().any(|&p| b.dtype(p) == DType::F16);
    let loss_scale = scaled.then(|| {
        b.set_scope_id(crate::ScopeId(0));
        b.set_block(None);
        b.push_scope("optimizer");
        let t = b.input("loss_scale", Shape::scalar(), DType::F32);
        b.pop_scope();
        t
    });
    let grads = gradients_seeded(&mut b, loss, loss_scale, &params)?;

    b.set_phase(Phase::Optimizer);
    b.set_block(None);
    b.set_scope_id(crate::ScopeId(0));
    b.push_scope("optimizer");
    let lr = b.input("lr", Shape::scalar(), DType::F32);
    let step = b.input("step", Shape::scalar(), DType::I64);
    let grad_scale = match loss_scale {
        Some(s) => {
            let one = b.fill(1.0, Shape::scalar(), DType::F32)?;
            Some(b.div(one, s)?)
        }
        None => None,
    };
    b.pop_scope();

    // Global gradient norm: Σ‖g‖² over parameters, in f32.
    let mut sum_sq: Option<TensorId> = None;
    let mut slots = Vec::with_capacity(params.len());
    let mut synced = Vec::with_capacity(params.len());
    for (&p, g) in params.iter().zip(&grads) {
        let g = g.ok_or_else(|| {
            IrError::Graph(format!(
                "parameter {} does not affect the loss (remove it or freeze it)",
                b.graph.tensor_scope(p)
            ))
        })?;
        let node = b.graph.producer(p);
        let (scope, block) = (node.scope, node.block);
        b.set_scope_id(scope);
        b.set_block(block);
        let raw = g;
        let g = hooks.sync_grad(&mut b, p, raw)?;
        let rank = b.shape(g).rank();
        // Scaled fp16 gradients square past fp16's range: reduce them in f32.
        let g32 = if scaled && b.dtype(g) == DType::F16 { b.cast(g, DType::F32)? } else { g };
        let mut s = b.reduce(ReduceOp::SumSquares, g32, &(0..rank).collect::<Vec<_>>(), false)?;
        if b.dtype(s) != DType::F32 {
            s = b.cast(s, DType::F32)?;
        }
        let s = hooks.norm_term(&mut b, p, s)?;
        sum_sq = Some(match sum_sq {
            Some(acc) => b.add(acc, s)?,
            None => s,
        });
        synced.push(g);
        slots.push(ParamSlot {
            param: p,
            grad: raw,
            m: p,
            v: p,
            master: None,
            update: None,
            gathered: None,
            stored: Vec::new(),
        });
    }
    b.set_scope_id(crate::ScopeId(0));
    b.set_block(None);
    b.push_scope("optimizer");
    let total = hooks.norm_total(&mut b, sum_sq.expect("at least one parameter"))?;
    let grad_norm = b.unary(UnaryOp::Sqrt, total)?;
    b.pop_scope();

    for (slot, &grad) in slots.iter_mut().zip(&synced) {
        let p = slot.param;
        let node = b.graph.producer(p);
        let (scope, block) = (node.scope, node.block);
        let name = b.graph.scope_name(scope).to_string();
        b.set_block(block);
        b.set_scope_id(scope);
        let target = hooks.update_target(&mut b, p)?;
        let state = |b: &mut Builder, kind| {
            b.optimizer_state(&crate::dist::state_key(&name, kind), kind, p, target, DType::F32)
        };
        b.set_leaf_tier(hooks.state_tier(p));
        slot.m = state(&mut b, StateKind::AdamM);
        slot.v = state(&mut b, StateKind::AdamV);
        if b.dtype(p) != DType::F32 {
            slot.master = Some(state(&mut b, StateKind::Master));
        }
        b.set_leaf_tier(crate::Tier::Device);
        let grad = hooks.update_grad(&mut b, p, grad)?;
        b.set_scope_id(scope);
        let weight_decay = if b.shape(p).rank() >= 2 { cfg.weight_decay } else { 0.0 };
        let spec = AdamWSpec {
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay,
            max_grad_norm: cfg.max_grad_norm,
            grad_scale: grad_scale.is_some(),
        };
        let states: Vec<TensorId> = [slot.m, slot.v].into_iter().chain(slot.master).collect();
        let mut fetched: Vec<TensorId> = Vec::with_capacity(states.len());
        for &s in &states {
            fetched.push(hooks.fetch_state(&mut b, p, s)?);
        }
        let mut inputs = vec![target, grad, fetched[0], fetched[1], lr, step, grad_norm];
        inputs.extend(fetched.get(2));
        inputs.extend(grad_scale);
        debug_assert_eq!(inputs[optim::GRAD_NORM], grad_norm);
        let updated = b.push(Op::AdamW(spec), &inputs)?;
        // Outputs: the target, then m, v and the master as updated (in place).
        for (&s, &u) in states.iter().zip(&updated[1..]) {
            if let Some(back) = hooks.store_state(&mut b, p, u)? {
                slot.stored.push((back, s));
            }
        }
        slot.update = (target != p).then_some(target);
        slot.gathered = hooks.after_update(&mut b, p, target)?;
    }
    b.set_phase(Phase::Forward);
    Ok(TrainingGraph {
        graph: b.finish(),
        loss,
        grad_norm,
        lr,
        step,
        loss_scale,
        params: slots,
        layout: LeafLayout::default(),
    })
}
