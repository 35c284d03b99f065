//! The Program: a training graph lowered to an ordered list of instructions with explicit
//! frees. It is tensor-free; the profiler's memory simulation walks it and the runtime
//! executes it, so both see the same allocations in the same order.
//!
//! Buffers: each tensor lives in a buffer. A view (reshape, expand) or an in-place update
//! (AdamW) shares its input's buffer; every other output gets a fresh one. A buffer is freed
//! right after the last instruction that reads any tensor in it, except resident buffers
//! (parameters, optimizer state), which outlive the step, and the step's outputs (loss,
//! gradient norm), which the caller reads after it.

use crate::{Graph, NodeId, Op, Phase, TensorId, Tier, TrainingGraph};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Instr {
    /// Execute a node: allocate its non-aliased outputs, compute.
    Run(NodeId),
    /// Release a buffer (named by its root tensor).
    Free(TensorId),
}

/// What a buffer holds, for memory breakdowns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Parameter,
    Gradient,
    OptimizerState,
    /// Per-step data (ids, labels, lr, step, seed).
    Input,
    /// Produced in the forward pass and read by the backward pass.
    SavedActivation,
    /// Everything else: forward values not saved, activation gradients, scratch scalars.
    Temporary,
    /// Inference's key/value caches: resident across the steps of a generation.
    KvCache,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Parameter => "parameters",
            Role::Gradient => "gradients",
            Role::OptimizerState => "optimizer_state",
            Role::Input => "inputs",
            Role::SavedActivation => "saved_activations",
            Role::Temporary => "temporaries",
            Role::KvCache => "kv_cache",
        }
    }
    pub const ALL: [Role; 7] = [
        Role::Parameter,
        Role::Gradient,
        Role::OptimizerState,
        Role::Input,
        Role::SavedActivation,
        Role::Temporary,
        Role::KvCache,
    ];
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Program {
    pub graph: Graph,
    /// Values the caller reads after the program ends (kept, never freed).
    pub outputs: Vec<TensorId>,
    pub instrs: Vec<Instr>,
    /// The root tensor of each tensor's buffer.
    pub buffer_of: Vec<TensorId>,
    /// Role of each buffer (indexed by root tensor; meaningful for roots only).
    pub role: Vec<Role>,
    /// Buffers live before the first instruction: parameters, optimizer state, inputs.
    pub live_in: Vec<TensorId>,
    /// Buffers live after the last instruction: parameters, optimizer state, outputs.
    pub live_out: Vec<TensorId>,
    /// The memory tier of each buffer (indexed by root tensor): its producer's tier.
    #[serde(default)]
    pub tier: Vec<Tier>,
}

impl Program {
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Lowers a training step: its outputs are the loss and the gradient norm, and the
    /// parameters' accumulated gradients get the gradient role.
    pub fn lower(train: TrainingGraph) -> Program {
        let grads: Vec<TensorId> = train.params.iter().map(|s| s.grad).collect();
        Program::lower_graph(train.graph, vec![train.loss, train.grad_norm], &grads)
    }

    /// [`Program::lower`] without giving up the training graph (the runtime keeps both).
    pub fn lower_training(train: &TrainingGraph) -> Program {
        Program::lower(train.clone())
    }

    /// Lowers any graph in node order (already topological), keeping `outputs` alive at the
    /// end; `grads` are the tensors to account as parameter gradients.
    pub fn lower_graph(graph: Graph, outputs: Vec<TensorId>, grads: &[TensorId]) -> Program {
        let g = &graph;
        let nt = g.tensors.len();
        let mut buffer_of: Vec<TensorId> = (0..nt as u32).map(TensorId).collect();
        for node in &g.nodes {
            for (k, &o) in node.outputs.iter().enumerate() {
                if let Some(i) = node.op.output_alias(k) {
                    buffer_of[o.index()] = buffer_of[node.inputs[i].index()];
                }
            }
        }

        // Roles, by buffer.
        let mut role = vec![Role::Temporary; nt];
        let mut resident = vec![false; nt];
        let mut is_input = vec![false; nt];
        for node in &g.nodes {
            let out = node.outputs.first().copied();
            match (&node.op, out) {
                (Op::Parameter { .. }, Some(o)) => {
                    role[o.index()] = Role::Parameter;
                    resident[o.index()] = true;
                }
                (Op::OptimizerState { .. }, Some(o)) => {
                    role[o.index()] = Role::OptimizerState;
                    resident[o.index()] = true;
                }
                (Op::KvCache(_), Some(o)) => {
                    role[o.index()] = Role::KvCache;
                    resident[o.index()] = true;
                }
                (Op::Input(_), Some(o)) => {
                    role[o.index()] = Role::Input;
                    is_input[o.index()] = true;
                }
                _ => {}
            }
        }
        for node in &g.nodes {
            // Recomputation reads the kept values it starts from, like the backward pass.
            if !matches!(node.phase, Phase::Backward | Phase::Recompute) {
                continue;
            }
            for &t in &node.inputs {
                let buf = buffer_of[t.index()];
                let producer = g.producer(buf);
                if producer.phase == Phase::Forward && !producer.op.is_leaf() {
                    role[buf.index()] = Role::SavedActivation;
                }
            }
        }
        for &grad in grads {
            let buf = buffer_of[grad.index()];
            if role[buf.index()] == Role::Temporary {
                role[buf.index()] = Role::Gradient;
            }
        }
        // A gradient or state moved to another tier keeps its role there.
        for node in &g.nodes {
            if let (Op::Transfer { .. }, [x], [y]) =
                (&node.op, node.inputs.as_slice(), node.outputs.as_slice())
            {
                let from = role[buffer_of[x.index()].index()];
                if matches!(from, Role::Gradient | Role::OptimizerState | Role::Parameter)
                    && role[y.index()] == Role::Temporary
                {
                    role[y.index()] = from;
                }
            }
        }
        let tier: Vec<Tier> = (0..nt).map(|t| g.producer(buffer_of[t]).tier).collect();

        // Last reader of each buffer.
        let mut last_use: Vec<Option<usize>> = vec![None; nt];
        for (i, node) in g.nodes.iter().enumerate() {
            for &t in node.inputs.iter().chain(&node.outputs) {
                let b = buffer_of[t.index()].index();
                last_use[b] = Some(last_use[b].map_or(i, |u: usize| u.max(i)));
            }
        }
        let mut keep = resident.clone();
        for &t in &outputs {
            keep[buffer_of[t.index()].index()] = true;
        }
        let mut frees_after: Vec<Vec<TensorId>> = vec![Vec::new(); g.nodes.len()];
        for b in 0..nt {
            if buffer_of[b].index() != b || keep[b] {
                continue;
            }
            if let Some(u) = last_use[b] {
                frees_after[u].push(TensorId(b as u32));
            }
        }

        let mut instrs = Vec::with_capacity(g.nodes.len() * 2);
        for (i, node) in g.nodes.iter().enumerate() {
            if !node.op.is_bound() {
                instrs.push(Instr::Run(NodeId(i as u32)));
            }
            for &b in &frees_after[i] {
                instrs.push(Instr::Free(b));
            }
        }
        let live_in: Vec<TensorId> =
            (0..nt).filter(|&t| resident[t] || is_input[t]).map(|t| TensorId(t as u32)).collect();
        let live_out: Vec<TensorId> = (0..nt)
            .filter(|&t| keep[t] && buffer_of[t].index() == t)
            .map(|t| TensorId(t as u32))
            .collect();
        Program { graph, outputs, instrs, buffer_of, role, live_in, live_out, tier }
    }

    /// The tier of `t`'s buffer.
    pub fn tier_of(&self, t: TensorId) -> Tier {
        self.tier.get(self.buffer_of[t.index()].index()).copied().unwrap_or_default()
    }

    /// Whether any buffer lives below the device (an offloaded plan).
    pub fn offloads(&self) -> bool {
        self.tier.iter().any(|t| !t.is_device())
    }

    /// Bytes of the buffer rooted at `t`.
    pub fn buffer_bytes(&self, t: TensorId) -> u64 {
        self.graph().meta(t).size_bytes()
    }

    /// The buffers a `Run` of `node` allocates (its outputs that alias no input).
    pub fn allocations(&self, node: NodeId) -> impl Iterator<Item = TensorId> + '_ {
        self.graph()
            .node(node)
            .outputs
            .iter()
            .copied()
            .filter(move |&o| self.buffer_of[o.index()] == o)
    }
}
