//! The static graph: tensors (values) produced by nodes (op applications).
//!
//! Tensors are first-class: a node may produce several (attention yields its output and the
//! log-sum-exp it saves for backward). Every node carries an interned scope path (the Hugging
//! Face module or weight name where one exists), the index of the repeated block it belongs to,
//! and its phase. Nodes are stored in a topological order: a node's inputs are always produced
//! by earlier nodes, so program order is simply node order.

use crate::{Op, Shape, TensorMeta, Tier};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TensorId(pub u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ScopeId(pub u32);

impl TensorId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Which part of a training step a node belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Forward,
    Backward,
    /// Forward work re-run during the backward pass (activation checkpointing, see
    /// [`crate::remat`]): the values it produces replace saved activations.
    Recompute,
    Optimizer,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Recompute => "recompute",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// A node's inputs or outputs: inline up to four (almost every op), so that building,
/// cloning and dropping graphs of a hundred thousand nodes — what the planner does for every
/// candidate it lowers — does not allocate per node.
pub type TensorIds = smallvec::SmallVec<[TensorId; 4]>;

/// One op application.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Node {
    pub op: Op,
    pub inputs: TensorIds,
    pub outputs: TensorIds,
    pub scope: ScopeId,
    /// Index of the repeated block (transformer layer) this node belongs to, if any.
    pub block: Option<u32>,
    pub phase: Phase,
    /// Where the node runs and its fresh outputs live (a transfer: its destination).
    #[serde(default, skip_serializing_if = "Tier::is_device")]
    pub tier: Tier,
}

/// What the builder stamps on a node besides its op and tensors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stamp {
    pub scope: ScopeId,
    pub block: Option<u32>,
    pub phase: Phase,
    pub tier: Tier,
}

/// A value in the graph.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Tensor {
    pub meta: TensorMeta,
    pub producer: NodeId,
    /// Which of the producer's outputs this is.
    pub output_index: u32,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Graph {
    pub nodes: Vec<Node>,
    pub tensors: Vec<Tensor>,
    scopes: Vec<String>,
    #[serde(skip)]
    scope_index: rustc_hash::FxHashMap<String, ScopeId>,
}

impl Graph {
    pub fn new() -> Graph {
        let mut g = Graph::default();
        g.intern_scope("");
        g
    }

    /// An empty graph with room for about `nodes` nodes and `tensors` tensors: a rewrite of a
    /// large graph (the planner replays, rematerialises and splits graphs of a hundred
    /// thousand nodes per candidate) then never copies its node list to grow it.
    pub fn with_capacity(nodes: usize, tensors: usize) -> Graph {
        let mut g = Graph::new();
        g.nodes.reserve(nodes);
        g.tensors.reserve(tensors);
        g
    }

    pub fn intern_scope(&mut self, path: &str) -> ScopeId {
        if let Some(&id) = self.scope_index.get(path) {
            return id;
        }
        let id = ScopeId(self.scopes.len() as u32);
        self.scopes.push(path.to_string());
        self.scope_index.insert(path.to_string(), id);
        id
    }

    /// Number of interned scopes (ids are `0..num_scopes()`).
    pub fn num_scopes(&self) -> usize {
        self.scopes.len()
    }

    pub fn scope_name(&self, id: ScopeId) -> &str {
        &self.scopes[id.0 as usize]
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }
    pub fn tensor(&self, id: TensorId) -> &Tensor {
        &self.tensors[id.index()]
    }
    pub fn meta(&self, id: TensorId) -> &TensorMeta {
        &self.tensors[id.index()].meta
    }
    pub fn shape(&self, id: TensorId) -> &Shape {
        &self.tensors[id.index()].meta.shape
    }
    pub fn producer(&self, id: TensorId) -> &Node {
        self.node(self.tensor(id).producer)
    }
    /// The scope path of the node producing `id` (for a parameter: its full weight name).
    pub fn tensor_scope(&self, id: TensorId) -> &str {
        self.scope_name(self.producer(id).scope)
    }

    /// Appends a node whose output metas were already inferred. Callers go through
    /// [`crate::Builder`], which checks shapes first.
    pub(crate) fn push_node(
        &mut self,
        op: Op,
        inputs: &[TensorId],
        output_metas: Vec<TensorMeta>,
        stamp: Stamp,
    ) -> NodeId {
        let Stamp { scope, block, phase, tier } = stamp;
        let node_id = NodeId(self.nodes.len() as u32);
        let mut outputs = TensorIds::with_capacity(output_metas.len());
        for (i, meta) in output_metas.into_iter().enumerate() {
            let t = TensorId(self.tensors.len() as u32);
            self.tensors.push(Tensor { meta, producer: node_id, output_index: i as u32 });
            outputs.push(t);
        }
        self.nodes.push(Node {
            op,
            inputs: TensorIds::from_slice(inputs),
            outputs,
            scope,
            block,
            phase,
            tier,
        });
        node_id
    }

    /// All parameters (weights), trainable or frozen, in creation order: what is loaded,
    /// initialised and saved.
    pub fn parameters(&self) -> Vec<TensorId> {
        self.nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Parameter { .. }))
            .map(|n| n.outputs[0])
            .collect()
    }

    /// The parameters that train (get a gradient and optimizer state), in creation order.
    pub fn trainable_parameters(&self) -> Vec<TensorId> {
        self.nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Parameter { frozen: false, .. }))
            .map(|n| n.outputs[0])
            .collect()
    }

    /// The frozen parameters (see [`Op::Parameter`]), in creation order.
    pub fn frozen_parameters(&self) -> Vec<TensorId> {
        self.nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Parameter { frozen: true, .. }))
            .map(|n| n.outputs[0])
            .collect()
    }

    /// Whether `t` is a frozen parameter.
    pub fn is_frozen(&self, t: TensorId) -> bool {
        matches!(self.producer(t).op, Op::Parameter { frozen: true, .. })
    }

    /// Freezes every parameter whose name `freeze` accepts (and no other); returns how many
    /// it froze.
    pub fn freeze_where(&mut self, freeze: impl Fn(&str) -> bool) -> usize {
        let mut count = 0;
        for n in &mut self.nodes {
            let name = &self.scopes[n.scope.0 as usize];
            if let Op::Parameter { frozen, .. } = &mut n.op {
                if !*frozen && freeze(name) {
                    *frozen = true;
                    count += 1;
                }
            }
        }
        count
    }

    /// All data inputs in creation order.
    pub fn inputs(&self) -> Vec<TensorId> {
        self.nodes.iter().filter(|n| matches!(n.op, Op::Input(_))).map(|n| n.outputs[0]).collect()
    }

    /// Number of parameter scalars, frozen ones included (tied tensors are one parameter, so
    /// counted once).
    pub fn num_parameters(&self) -> u64 {
        self.parameters().iter().map(|&p| self.meta(p).numel()).sum()
    }

    /// Number of trainable scalars (those [`Graph::trainable_parameters`] holds).
    pub fn num_trainable_parameters(&self) -> u64 {
        self.trainable_parameters().iter().map(|&p| self.meta(p).numel()).sum()
    }

    /// Finds a leaf (parameter or input) by its full name.
    pub fn find_leaf(&self, name: &str) -> Option<TensorId> {
        let scope = *self.scope_index.get(name)?;
        self.nodes.iter().find(|n| n.scope == scope && n.op.is_leaf()).map(|n| n.outputs[0])
    }

    /// Every leaf (parameter or input) by its full name, in one pass over the nodes: for
    /// callers that look up many leaves ([`Graph::find_leaf`] scans the nodes each time).
    pub fn leaf_index(&self) -> rustc_hash::FxHashMap<&str, TensorId> {
        let mut index = rustc_hash::FxHashMap::default();
        for n in self.nodes.iter().filter(|n| n.op.is_leaf()) {
            index.entry(self.scopes[n.scope.0 as usize].as_str()).or_insert(n.outputs[0]);
        }
        index
    }

    /// Rebuilds the scope lookup table after deserialisation.
    pub fn reindex(&mut self) {
        self.scope_index =
            self.scopes.iter().enumerate().map(|(i, s)| (s.clone(), ScopeId(i as u32))).collect();
    }

    /// For each tensor, the nodes that read it, in program order.
    pub fn consumers(&self) -> Vec<Vec<NodeId>> {
        let mut c = vec![Vec::new(); self.tensors.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for &t in &n.inputs {
                let list: &mut Vec<NodeId> = &mut c[t.index()];
                if list.last() != Some(&NodeId(i as u32)) {
                    list.push(NodeId(i as u32));
                }
            }
        }
        c
    }
}
