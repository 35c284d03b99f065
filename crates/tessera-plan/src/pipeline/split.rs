//! Cutting a local forward graph into pipeline stages.
//!
//! Every node gets a *virtual stage*: a block's nodes its block's stage; a node outside the
//! blocks the latest stage among its inputs (the final norm, the head, the loss) or, when it
//! reads only leaves, the earliest stage among its readers (the embedding, and a ZeRO-3 gather
//! of a parameter) — unless it reads no parameter at all (position tables, masks made from
//! constants), in which case every stage that needs it computes its own copy. A parameter
//! lives on the earliest stage that reads it; a later stage that reads it too (GPT-2's tied
//! head) receives it, and sends its gradient back, like any other value crossing a boundary.
//!
//! Each device's forward graph holds its chunks' nodes in the original order; a value made on
//! another stage arrives through an [`Op::Recv`] and leaves through an [`Op::Send`], each
//! boundary with its own tags. A device's stand-in loss is the sum of its sends' zero tokens
//! (plus the real loss on the device with the last stage), so the ordinary autodiff starts
//! its backward pass from the received gradients (the VJPs of the transfers).

use crate::{PlanError, Result};
use std::collections::HashMap;
use tessera_ir::{Builder, Graph, NodeId, Op, P2p, Phase, TensorId};

/// Where a node of the local forward graph runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// A parameter, optimizer state or data input (bound, not computed).
    Leaf,
    /// Recomputed by every stage that reads it (no parameter upstream, no block).
    Everywhere,
    /// On this virtual stage.
    Stage(usize),
}

/// Which virtual stage each block belongs to, and where the devices are.
#[derive(Clone, Debug)]
pub struct StageMap {
    /// The virtual stage of each block (index = block).
    pub stage_of_block: Vec<usize>,
    /// Devices along the pipeline axis.
    pub devices: usize,
    /// Chunks per device (interleaving); virtual stages = devices · chunks.
    pub chunks: usize,
    /// The pipeline axis of the full mesh.
    pub axis: usize,
}

impl StageMap {
    /// Contiguous stages of `sizes[i]` blocks each, in order.
    pub fn from_sizes(sizes: &[usize], devices: usize, axis: usize) -> Result<StageMap> {
        if devices == 0 || sizes.is_empty() || !sizes.len().is_multiple_of(devices) {
            return Err(PlanError::Invalid(format!(
                "{} pipeline stages cannot be spread over {devices} devices",
                sizes.len()
            )));
        }
        if let Some(i) = sizes.iter().position(|&s| s == 0) {
            return Err(PlanError::Invalid(format!("pipeline stage {i} has no block")));
        }
        let stage_of_block =
            sizes.iter().enumerate().flat_map(|(s, &n)| std::iter::repeat_n(s, n)).collect();
        Ok(StageMap { stage_of_block, devices, chunks: sizes.len() / devices, axis })
    }

    /// Blocks split as evenly as they go (earlier stages take the remainder).
    pub fn even(num_blocks: usize, devices: usize, chunks: usize, axis: usize) -> Result<StageMap> {
        let stages = devices * chunks.max(1);
        if stages == 0 || num_blocks < stages {
            return Err(PlanError::Invalid(format!(
                "{stages} pipeline stages need at least {stages} blocks; the model has \
                 {num_blocks}: use fewer stages"
            )));
        }
        let sizes: Vec<usize> = (0..stages)
            .map(|s| num_blocks / stages + usize::from(s < num_blocks % stages))
            .collect();
        StageMap::from_sizes(&sizes, devices, axis)
    }

    pub fn stages(&self) -> usize {
        self.devices * self.chunks
    }

    /// The device and chunk of virtual stage `vs`.
    pub fn device_of(&self, vs: usize) -> (usize, usize) {
        (vs % self.devices, vs / self.devices)
    }

    /// Blocks of each virtual stage, as `[first, end)`.
    pub fn block_ranges(&self) -> Vec<(usize, usize)> {
        let mut out = vec![(usize::MAX, 0); self.stages()];
        for (b, &s) in self.stage_of_block.iter().enumerate() {
            out[s].0 = out[s].0.min(b);
            out[s].1 = out[s].1.max(b + 1);
        }
        out
    }
}

/// The place of every node of `g` (see the module docs).
pub(crate) fn assign(g: &Graph, map: &StageMap) -> Result<Vec<Place>> {
    let n = g.nodes.len();
    let mut place = vec![Place::Everywhere; n];
    // Whether a parameter is upstream of the node (through non-leaf nodes).
    let mut has_param = vec![false; n];
    let mut pending = vec![false; n];
    for (i, node) in g.nodes.iter().enumerate() {
        if node.op.is_leaf() && !matches!(node.op, Op::Fill { .. }) {
            place[i] = Place::Leaf;
            has_param[i] = matches!(node.op, Op::Parameter { .. });
            continue;
        }
        let mut latest: Option<usize> = None;
        for &t in &node.inputs {
            let p = g.tensor(t).producer.index();
            has_param[i] |= has_param[p] || pending[p];
            if let Place::Stage(s) = place[p] {
                latest = Some(latest.map_or(s, |l: usize| l.max(s)));
            }
        }
        if let Some(b) = node.block {
            let s = *map
                .stage_of_block
                .get(b as usize)
                .ok_or_else(|| PlanError::Internal(format!("block {b} is beyond the stage map")))?;
            place[i] = Place::Stage(latest.map_or(s, |l| l.max(s)));
        } else if let Some(l) = latest {
            place[i] = Place::Stage(l);
        } else if has_param[i] {
            pending[i] = true;
        }
    }
    // Nodes fed only by leaves (with a parameter among them) join their earliest reader.
    let consumers = g.consumers();
    for i in (0..n).rev() {
        if !pending[i] {
            continue;
        }
        let earliest = g.nodes[i]
            .outputs
            .iter()
            .flat_map(|t| &consumers[t.index()])
            .filter_map(|c| match place[c.index()] {
                Place::Stage(s) => Some(s),
                Place::Leaf | Place::Everywhere => None,
            })
            .min();
        place[i] = Place::Stage(earliest.unwrap_or(0));
    }
    Ok(place)
}

/// The earliest stage reading each parameter leaf (its home).
fn param_homes(g: &Graph, place: &[Place]) -> HashMap<TensorId, usize> {
    let mut home = HashMap::new();
    for (node, &at) in g.nodes.iter().zip(place) {
        let Place::Stage(s) = at else { continue };
        for &t in &node.inputs {
            if matches!(g.producer(t).op, Op::Parameter { .. }) {
                let e = home.entry(t).or_insert(s);
                *e = (*e).min(s);
            }
        }
    }
    home
}

/// One device's forward graph.
pub(crate) struct DeviceForward {
    pub builder: Builder,
    /// The device's stand-in loss (see the module docs).
    pub loss: TensorId,
    /// Local-forward parameter → this graph's parameter (parameters homed here).
    pub params: HashMap<TensorId, TensorId>,
    /// The chunk of each forward node of `builder` (indexed by node; leaves 0).
    pub chunk_of: Vec<usize>,
    /// Bytes this device sends per micro-batch to each later virtual stage, forward values only
    /// (by `(from stage, to stage)`).
    pub boundaries: Vec<Boundary>,
}

/// A value crossing from one virtual stage to another.
#[derive(Clone, Debug, PartialEq)]
pub struct Boundary {
    pub from: usize,
    pub to: usize,
    pub bytes: u64,
}

struct Cut<'a> {
    g: &'a Graph,
    map: &'a StageMap,
    place: &'a [Place],
    home: HashMap<TensorId, usize>,
    /// Tags of each (tensor, receiving stage).
    tags: HashMap<(TensorId, usize), u32>,
}

impl Cut<'_> {
    fn stage_of_value(&self, t: TensorId) -> Option<usize> {
        let p = self.g.tensor(t).producer.index();
        match self.place[p] {
            Place::Stage(s) => Some(s),
            Place::Leaf => self.home.get(&t).copied(),
            Place::Everywhere => None,
        }
    }

    fn p2p(&self, t: TensorId, to_stage: usize, peer_stage: usize) -> Result<P2p> {
        let tag = *self.tags.get(&(t, to_stage)).ok_or_else(|| {
            PlanError::Internal(format!("no tag for a value crossing into stage {to_stage}"))
        })?;
        Ok(P2p {
            axis: self.map.axis,
            peer: self.map.device_of(peer_stage).0,
            tag,
            grad_tag: tag + 1,
            ring: false,
        })
    }
}

/// Cuts `g` (loss `loss`) into one forward graph per device.
pub(crate) fn cut(g: &Graph, loss: TensorId, map: &StageMap) -> Result<Vec<DeviceForward>> {
    let place = assign(g, map)?;
    let home = param_homes(g, &place);
    let mut cut = Cut { g, map, place: &place, home, tags: HashMap::new() };
    // Number the crossings: tag 0 is the untagged stream, value and gradient tags pair up.
    let mut next = 1u32;
    let mut crossings: Vec<(TensorId, usize, usize)> = Vec::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let Place::Stage(s) = place[i] else { continue };
        for &t in &node.inputs {
            let Some(from) = cut.stage_of_value(t) else { continue };
            if from != s && !cut.tags.contains_key(&(t, s)) {
                if from > s {
                    return Err(PlanError::Internal(format!(
                        "{} flows from pipeline stage {from} back to stage {s}",
                        g.tensor_scope(t)
                    )));
                }
                cut.tags.insert((t, s), next);
                crossings.push((t, from, s));
                next += 2;
            }
        }
    }
    let last = map.stages() - 1;
    let loss_stage = cut.stage_of_value(loss).unwrap_or(last);
    (0..map.devices).map(|d| device_forward(&cut, d, loss, loss_stage, &crossings)).collect()
}

fn device_forward(
    cut: &Cut<'_>,
    device: usize,
    loss: TensorId,
    loss_stage: usize,
    crossings: &[(TensorId, usize, usize)],
) -> Result<DeviceForward> {
    let (g, map) = (cut.g, cut.map);
    let mine = |s: usize| map.device_of(s).0 == device;
    let mut b = Builder::from_graph(Graph::new());
    for s in 1..g.num_scopes() {
        b.graph.intern_scope(g.scope_name(tessera_ir::ScopeId(s as u32)));
    }
    b.set_phase(Phase::Forward);
    let mut chunk_of: Vec<usize> = Vec::new();
    // Values of this device: leaves by tensor, computed values by (tensor, stage).
    let mut leaves: HashMap<TensorId, TensorId> = HashMap::new();
    let mut vals: HashMap<(TensorId, usize), TensorId> = HashMap::new();
    let mut params = HashMap::new();
    let mut tokens: Vec<(TensorId, usize)> = Vec::new();
    let mut boundaries = Vec::new();

    let push = |b: &mut Builder, chunk_of: &mut Vec<usize>, n: NodeId, ins: &[TensorId], chunk| {
        let node = g.node(n);
        b.set_scope_id(node.scope);
        b.set_block(node.block);
        let outs = b.push(node.op.clone(), ins).map_err(internal)?;
        chunk_of.resize(b.graph.nodes.len(), chunk);
        Ok::<_, PlanError>(outs)
    };

    // `get` resolves an input of a node on stage `s`.
    #[allow(clippy::too_many_arguments)]
    fn get(
        cut: &Cut<'_>,
        b: &mut Builder,
        chunk_of: &mut Vec<usize>,
        leaves: &mut HashMap<TensorId, TensorId>,
        vals: &mut HashMap<(TensorId, usize), TensorId>,
        params: &mut HashMap<TensorId, TensorId>,
        t: TensorId,
        s: usize,
    ) -> Result<TensorId> {
        let g = cut.g;
        let pid = g.tensor(t).producer;
        let chunk = cut.map.device_of(s).1;
        if let Some(from) = cut.stage_of_value(t).filter(|&f| f != s) {
            if let Some(&v) = vals.get(&(t, s)) {
                return Ok(v);
            }
            let p = cut.p2p(t, s, from)?;
            b.set_scope_id(g.node(pid).scope);
            b.set_block(None);
            let v = b.push1(Op::Recv(p, g.meta(t).clone()), &[]).map_err(internal)?;
            chunk_of.resize(b.graph.nodes.len(), chunk);
            vals.insert((t, s), v);
            return Ok(v);
        }
        let node = g.node(pid);
        match cut.place[pid.index()] {
            Place::Leaf => {
                if let Some(&v) = leaves.get(&t) {
                    return Ok(v);
                }
                b.set_scope_id(node.scope);
                b.set_block(node.block);
                let v = b.push1(node.op.clone(), &[]).map_err(internal)?;
                chunk_of.resize(b.graph.nodes.len(), 0);
                if matches!(node.op, Op::Parameter { .. }) {
                    params.insert(t, v);
                }
                leaves.insert(t, v);
                Ok(v)
            }
            Place::Stage(_) => vals.get(&(t, s)).copied().ok_or_else(|| {
                PlanError::Internal(format!("{} is read before it is made", g.tensor_scope(t)))
            }),
            Place::Everywhere => {
                if let Some(&v) = vals.get(&(t, s)) {
                    return Ok(v);
                }
                let mut ins = Vec::with_capacity(node.inputs.len());
                for &u in &node.inputs {
                    ins.push(get(cut, b, chunk_of, leaves, vals, params, u, s)?);
                }
                b.set_scope_id(node.scope);
                b.set_block(node.block);
                let outs = b.push(node.op.clone(), &ins).map_err(internal)?;
                chunk_of.resize(b.graph.nodes.len(), chunk);
                for (&o, &lo) in node.outputs.iter().zip(&outs) {
                    vals.insert((o, s), lo);
                }
                vals.get(&(t, s)).copied().ok_or_else(|| internal("lost output"))
            }
        }
    }

    for (i, node) in g.nodes.iter().enumerate() {
        let id = NodeId(i as u32);
        let s = match cut.place[i] {
            Place::Stage(s) if mine(s) => s,
            Place::Stage(_) | Place::Everywhere => continue,
            Place::Leaf => {
                // A parameter homed here is sent to every later stage that reads it.
                let t = node.outputs[0];
                if let Some(&h) = cut.home.get(&t) {
                    if mine(h) {
                        get(cut, &mut b, &mut chunk_of, &mut leaves, &mut vals, &mut params, t, h)?;
                        send_crossings(
                            cut,
                            &mut b,
                            &mut chunk_of,
                            t,
                            h,
                            leaves[&t],
                            crossings,
                            &mut tokens,
                            &mut boundaries,
                        )?;
                    }
                }
                continue;
            }
        };
        let mut ins = Vec::with_capacity(node.inputs.len());
        for &t in &node.inputs {
            ins.push(get(cut, &mut b, &mut chunk_of, &mut leaves, &mut vals, &mut params, t, s)?);
        }
        let chunk = map.device_of(s).1;
        let outs = push(&mut b, &mut chunk_of, id, &ins, chunk)?;
        for (&o, &lo) in node.outputs.iter().zip(&outs) {
            vals.insert((o, s), lo);
            send_crossings(
                cut,
                &mut b,
                &mut chunk_of,
                o,
                s,
                lo,
                crossings,
                &mut tokens,
                &mut boundaries,
            )?;
        }
    }
    // The stand-in loss: the real one where it is, plus every send's zero token.
    let mut terms: Vec<(TensorId, usize)> = tokens;
    if mine(loss_stage) {
        let l = *vals.get(&(loss, loss_stage)).ok_or_else(|| internal("the loss was not made"))?;
        terms.push((l, map.device_of(loss_stage).1));
    }
    let Some(&(first, c0)) = terms.first() else {
        return Err(PlanError::Internal(format!("pipeline device {device} has nothing to do")));
    };
    let dtype = b.dtype(first);
    b.set_scope_id(tessera_ir::ScopeId(0));
    b.set_block(None);
    let (mut total, mut chunk) = (first, c0);
    for &(t, c) in &terms[1..] {
        let t = if b.dtype(t) != dtype { b.cast(t, dtype).map_err(internal)? } else { t };
        chunk = chunk.max(c);
        total = b.add(t, total).map_err(internal)?;
        chunk_of.resize(b.graph.nodes.len(), chunk);
    }
    chunk_of.resize(b.graph.nodes.len(), chunk);
    Ok(DeviceForward { builder: b, loss: total, params, chunk_of, boundaries })
}

#[allow(clippy::too_many_arguments)]
fn send_crossings(
    cut: &Cut<'_>,
    b: &mut Builder,
    chunk_of: &mut Vec<usize>,
    t: TensorId,
    from: usize,
    local: TensorId,
    crossings: &[(TensorId, usize, usize)],
    tokens: &mut Vec<(TensorId, usize)>,
    boundaries: &mut Vec<Boundary>,
) -> Result<()> {
    let chunk = cut.map.device_of(from).1;
    for &(x, f, to) in crossings {
        if x != t || f != from {
            continue;
        }
        // The receiver's tags: the value on `tag`, its gradient back on `grad_tag`.
        let p = cut.p2p(t, to, to)?;
        b.set_scope_id(cut.g.producer(t).scope);
        b.set_block(None);
        let token = b.push1(Op::Send(p), &[local]).map_err(internal)?;
        chunk_of.resize(b.graph.nodes.len(), chunk);
        tokens.push((token, chunk));
        boundaries.push(Boundary { from, to, bytes: cut.g.meta(t).size_bytes() });
    }
    Ok(())
}

fn internal(e: impl std::fmt::Display) -> PlanError {
    PlanError::Internal(format!("cutting the pipeline stages: {e}"))
}
