//! Resharding: the cheapest way, in seconds, to turn a tensor laid out by one [`Spec`] into
//! another, as a sequence of collective steps over single mesh axes.
//!
//! The moves are the IR's [`CommStep`]s, each over one mesh axis `a` of `n = mesh.shape[a]`
//! devices:
//!
//! - `AllReduce`: `a` must be pending (in `partial`); drops it.
//! - `ReduceScatter { dim }`: `a` must be pending; moves it to the minor end of `dims[dim]`.
//! - `AllGather { dim }`: `a` must be the last (minor-most) axis of `dims[dim]`; removes it.
//! - `AllToAll { split_dim, concat_dim }`: `a` must be the last axis of `dims[concat_dim]`
//!   (the local dim that grows `n`×) and `split_dim != concat_dim`; moves `a` to the minor end
//!   of `dims[split_dim]` (the local dim that shrinks `n`×).
//! - `Shard { dim }` (a local slice, no communication): `a` must be unused by the spec;
//!   appends it to `dims[dim]`.
//!
//! Every spec along a path is valid and divides the global shape evenly. No move creates a
//! pending sum, so a target pending over an axis the source is not pending over is
//! unreachable.
//!
//! Costs follow the alpha-beta ring model per axis ([`collective_time`]; an axis spanning nodes
//! pays the network's latency on its steps between nodes only) with `B` the local
//! bytes before the move; every move also pays [`MOVE_TIE_BREAK_S`] so that, among paths of
//! equal time, the shortest is preferred. [`cheapest_path`] is Dijkstra over specs (packed
//! into a `u128`, one byte per mesh axis, so the search allocates little); [`ReshardCache`]
//! memoises it for one mesh, one complete search per source; [`brute_force_path`] and
//! [`brute_force_all`] are exhaustive oracles for tests, built on [`apply_move`] and
//! [`moves_from`] and so independent of the search.

use crate::{AxisLink, Link, Mesh, Spec};
use rustc_hash::FxHashMap as HashMap;
use serde::{Deserialize, Serialize};
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
pub use tessera_ir::{Collective, CommStep};

/// Seconds charged to every move on top of its communication time, so that among paths of
/// equal time the one with fewer moves wins (a local slice is otherwise free).
pub const MOVE_TIE_BREAK_S: f64 = 1e-12;

/// Applies one move to a spec, or `None` when its precondition does not hold (see the module
/// docs). Only the structure is checked: divisibility needs the mesh and shape, which
/// [`moves_from`] checks.
pub fn apply_move(spec: &Spec, step: &CommStep) -> Option<Spec> {
    let a = step.axis;
    let rank = spec.rank();
    let mut out = spec.clone();
    match step.op {
        Collective::AllReduce => {
            let i = out.partial.iter().position(|&p| p == a)?;
            out.partial.remove(i);
        }
        Collective::ReduceScatter { dim } => {
            if dim >= rank {
                return None;
            }
            let i = out.partial.iter().position(|&p| p == a)?;
            out.partial.remove(i);
            out.dims[dim].push(a);
        }
        Collective::AllGather { dim } => {
            if out.dims.get(dim)?.last() != Some(&a) {
                return None;
            }
            out.dims[dim].pop();
        }
        Collective::AllToAll { split_dim, concat_dim } => {
            if split_dim >= rank || split_dim == concat_dim {
                return None;
            }
            if out.dims.get(concat_dim)?.last() != Some(&a) {
                return None;
            }
            out.dims[concat_dim].pop();
            out.dims[split_dim].push(a);
        }
        Collective::Shard { dim } => {
            if dim >= rank || spec.uses_axis(a) {
                return None;
            }
            out.dims[dim].push(a);
        }
    }
    Some(out)
}

/// Every move valid from `spec` (itself valid and evenly dividing `shape`, else none) whose
/// result is valid and divides evenly, with that result. The order is deterministic: by axis,
/// then by op and dims.
pub fn moves_from(mesh: &Mesh, shape: &[usize], spec: &Spec) -> Vec<(CommStep, Spec)> {
    let mut out = Vec::new();
    if spec.local_shape(mesh, shape).is_none() {
        return out;
    }
    let rank = spec.rank();
    for (axis, &size) in mesh.shape.iter().enumerate() {
        let mut ops = Vec::new();
        if spec.partial.contains(&axis) {
            ops.push(Collective::AllReduce);
            ops.extend((0..rank).map(|dim| Collective::ReduceScatter { dim }));
        } else if let Some(d) = spec.dim_of_axis(axis) {
            if spec.dims[d].last() == Some(&axis) {
                ops.push(Collective::AllGather { dim: d });
                ops.extend(
                    (0..rank)
                        .filter(|&s| s != d)
                        .map(|s| Collective::AllToAll { split_dim: s, concat_dim: d }),
                );
            }
        } else {
            ops.extend((0..rank).map(|dim| Collective::Shard { dim }));
        }
        for op in ops {
            let step = CommStep { op, axis, size };
            if let Some(next) = apply_move(spec, &step) {
                if next.local_shape(mesh, shape).is_some() {
                    out.push((step, next));
                }
            }
        }
    }
    out
}

/// Communication time in seconds of one collective over `n` devices on `link`, with
/// `local_bytes` the bytes each device holds before it (ring algorithms, alpha-beta):
///
/// - all-gather: `(n−1)·α + (n−1)·B/bw` (the output is `n·B`; a ring moves `(n−1)/n` of it)
/// - reduce-scatter: `(n−1)·α + (n−1)/n·B/bw`
/// - all-reduce: `2(n−1)·α + 2(n−1)/n·B/bw`
/// - all-to-all: `(n−1)·α + (n−1)/n·B/bw`
/// - shard (a local slice): 0
///
/// [`MOVE_TIE_BREAK_S`] is not included.
pub fn ring_time(op: Collective, n: usize, local_bytes: f64, link: &Link) -> f64 {
    let m = n.saturating_sub(1) as f64;
    let n = n.max(1) as f64;
    let (alpha, bw) = (link.latency_s, link.bandwidth);
    match op {
        Collective::AllGather { .. } => m * alpha + m * local_bytes / bw,
        Collective::ReduceScatter { .. } | Collective::AllToAll { .. } => {
            m * alpha + m / n * local_bytes / bw
        }
        Collective::AllReduce => 2.0 * m * alpha + 2.0 * m / n * local_bytes / bw,
        Collective::Shard { .. } => 0.0,
    }
}

/// Communication time in seconds of one collective over the `n` devices of a mesh axis, with
/// `local_bytes` the bytes each device holds before it: a ring ([`ring_time`]). Within a node
/// the ring runs over the intra-node link. Across nodes its bandwidth is the inter-node link's
/// per device (the published runs of `scripts/published-runs.tsv` are priced with it), and its
/// latency is NCCL's own model of a ring (`ncclTopoTuneModel`, `src/graph/tuning.cc`): of the
/// ring's steps (`n−1`, twice that for an all-reduce) only those between the `m` nodes the
/// group spans (`m−1`, twice for an all-reduce) wait on the network; the others hop between
/// members on one node, at the intra-node link's latency. An all-to-all's `n−1` messages go to
/// `k−1` members on the node and `n−k` on other nodes (`k` members per node), and so do its
/// bytes: `(k−1)/n·B` over the intra-node link beside `(n−k)/n·B` over the network, the slower
/// of the two setting the time (expert parallelism's dispatch and combine across nodes move
/// part of their tokens over NVLink; a ring's steps all wait on its slowest link).
pub fn collective_time(op: Collective, n: usize, local_bytes: f64, link: &AxisLink) -> f64 {
    let k = link.per_node.clamp(1, n.max(1));
    if k == n {
        return ring_time(op, n, local_bytes, &link.intra);
    }
    let bandwidth_only = Link { latency_s: 0.0, bandwidth: link.inter.bandwidth };
    let transfer = match op {
        Collective::AllToAll { .. } => {
            let share = |members: usize| members as f64 / n as f64 * local_bytes;
            (share(k - 1) / link.intra.bandwidth).max(share(n - k) / link.inter.bandwidth)
        }
        _ => ring_time(op, n, local_bytes, &bandwidth_only),
    };
    // Steps of the ring (messages of an all-to-all) over the network and within a node.
    let nodes = n.div_ceil(k);
    let (inter, all) = match op {
        Collective::AllReduce => (2 * (nodes - 1), 2 * (n - 1)),
        Collective::ReduceScatter { .. } | Collective::AllGather { .. } => (nodes - 1, n - 1),
        Collective::AllToAll { .. } => (n - k, n - 1),
        Collective::Shard { .. } => return 0.0,
    };
    transfer + inter as f64 * link.inter.latency_s + (all - inter) as f64 * link.intra.latency_s
}

/// The cost in seconds of `step` applied to a tensor of global `shape` laid out as `from`:
/// [`collective_time`] over the step's mesh axis (its size and link come from `mesh`), with
/// `B` = local elements of `from` × `elem_bytes`, plus [`MOVE_TIE_BREAK_S`].
pub fn move_cost(
    mesh: &Mesh,
    shape: &[usize],
    elem_bytes: u64,
    from: &Spec,
    step: &CommStep,
) -> f64 {
    let bytes = from.local_numel(mesh, shape) as f64 * elem_bytes as f64;
    step_cost(mesh, bytes, step)
}

fn step_cost(mesh: &Mesh, local_bytes: f64, step: &CommStep) -> f64 {
    collective_time(step.op, mesh.shape[step.axis], local_bytes, &mesh.links[step.axis])
        + MOVE_TIE_BREAK_S
}

/// A sequence of moves and its total cost (sum of [`move_cost`]s), seconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReshardPath {
    pub steps: Vec<CommStep>,
    pub cost_s: f64,
}

impl ReshardPath {
    /// The specs visited, `from` first and the target last (`None` if a step does not apply).
    pub fn specs(&self, from: &Spec) -> Option<Vec<Spec>> {
        let mut out = vec![from.clone()];
        for s in &self.steps {
            let next = apply_move(out.last().expect("non-empty"), s)?;
            out.push(next);
        }
        Some(out)
    }
}

/// An f64 with a total order, for the heap.
#[derive(Clone, Copy, PartialEq)]
struct Cost(f64);
impl Eq for Cost {}
impl PartialOrd for Cost {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Cost {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// The cheapest sequence of moves from `from` to `to` for a tensor of global `shape` with
/// elements of `elem_bytes` (Dijkstra over the valid, evenly dividing specs). `None` when
/// either spec is invalid or does not divide `shape`, or `to` is unreachable (pending over an
/// axis `from` is not pending over). `from == to` gives the empty path of cost 0.
pub fn cheapest_path(
    mesh: &Mesh,
    shape: &[usize],
    elem_bytes: u64,
    from: &Spec,
    to: &Spec,
) -> Option<ReshardPath> {
    from.local_shape(mesh, shape)?;
    to.local_shape(mesh, shape)?;
    if from == to {
        return Some(ReshardPath { steps: Vec::new(), cost_s: 0.0 });
    }
    // No move adds a pending sum.
    if !to.partial.iter().all(|a| from.partial.contains(a)) {
        return None;
    }
    match Packer::new(mesh, shape.len()) {
        Some(pk) => {
            let (f, t) = (pk.encode(from), pk.encode(to));
            let (tree, found) = Tree::search(&pk, mesh, shape, elem_bytes, f, Some(t));
            tree.path(found?)
        }
        None => cheapest_path_generic(mesh, shape, elem_bytes, from, to),
    }
}

/// Dijkstra on [`Spec`]s themselves, for meshes or ranks too large to pack (more than
/// [`MAX_PACKED_AXES`] axes or [`MAX_PACKED_RANK`] dims). Endpoints already checked.
fn cheapest_path_generic(
    mesh: &Mesh,
    shape: &[usize],
    elem_bytes: u64,
    from: &Spec,
    to: &Spec,
) -> Option<ReshardPath> {
    let mut states: Vec<Spec> = vec![from.clone()];
    let mut index: HashMap<Spec, usize> = HashMap::from_iter([(from.clone(), 0)]);
    let mut dist: Vec<f64> = vec![0.0];
    let mut prev: Vec<Option<(usize, CommStep)>> = vec![None];
    let mut done: Vec<bool> = vec![false];
    let mut heap = BinaryHeap::from([Reverse((Cost(0.0), 0usize))]);
    while let Some(Reverse((Cost(d), u))) = heap.pop() {
        if done[u] {
            continue;
        }
        done[u] = true;
        if states[u] == *to {
            let mut steps = Vec::new();
            let mut v = u;
            while let Some((p, step)) = prev[v] {
                steps.push(step);
                v = p;
            }
            steps.reverse();
            return Some(ReshardPath { steps, cost_s: d });
        }
        let bytes = states[u].local_numel(mesh, shape) as f64 * elem_bytes as f64;
        for (step, next) in moves_from(mesh, shape, &states[u]) {
            let nd = d + step_cost(mesh, bytes, &step);
            let v = match index.get(&next) {
                Some(&v) => v,
                None => {
                    let v = states.len();
                    index.insert(next.clone(), v);
                    states.push(next);
                    dist.push(f64::INFINITY);
                    prev.push(None);
                    done.push(false);
                    v
                }
            };
            if !done[v] && nd < dist[v] {
                dist[v] = nd;
                prev[v] = Some((u, step));
                heap.push(Reverse((Cost(nd), v)));
            }
        }
    }
    None
}

/// Most mesh axes a packed spec holds (one byte each in a `u128`).
pub const MAX_PACKED_AXES: usize = 16;
/// Most tensor dims a packed spec holds.
pub const MAX_PACKED_RANK: usize = 15;

/// A spec packed one byte per mesh axis: 0 unused, 1 pending, `2 + 16·dim + pos` for
/// position `pos` (major to minor) in the axes of `dim`. Valid specs only.
type Code = u128;

/// Packs and unpacks specs, and enumerates moves on packed specs without allocating.
struct Packer {
    sizes: Vec<usize>,
    rank: usize,
}

impl Packer {
    fn new(mesh: &Mesh, rank: usize) -> Option<Packer> {
        (mesh.ndim() <= MAX_PACKED_AXES && rank <= MAX_PACKED_RANK)
            .then(|| Packer { sizes: mesh.shape.clone(), rank })
    }

    fn byte(code: Code, axis: usize) -> u8 {
        (code >> (8 * axis)) as u8
    }

    fn with(code: Code, axis: usize, b: u8) -> Code {
        (code & !(0xff << (8 * axis))) | (Code::from(b) << (8 * axis))
    }

    fn split(dim: usize, pos: usize) -> u8 {
        (2 + 16 * dim + pos) as u8
    }

    /// A valid spec (checked by the caller) as a code.
    fn encode(&self, spec: &Spec) -> Code {
        let mut c: Code = 0;
        for &a in &spec.partial {
            c = Self::with(c, a, 1);
        }
        for (d, axes) in spec.dims.iter().enumerate() {
            for (p, &a) in axes.iter().enumerate() {
                c = Self::with(c, a, Self::split(d, p));
            }
        }
        c
    }

    #[cfg(test)]
    fn decode(&self, code: Code) -> Spec {
        let mut s = Spec::replicated(self.rank);
        let mut placed: Vec<(usize, usize, usize)> = Vec::new();
        for a in 0..self.sizes.len() {
            match Self::byte(code, a) {
                0 => {}
                1 => s.partial.push(a),
                b => placed.push((usize::from(b - 2) / 16, usize::from(b - 2) % 16, a)),
            }
        }
        placed.sort_unstable();
        for (d, _, a) in placed {
            s.dims[d].push(a);
        }
        s
    }

    /// Per dim, the number of axes and the number of shards.
    fn layout(&self, code: Code) -> ([u8; MAX_PACKED_RANK], [usize; MAX_PACKED_RANK]) {
        let mut len = [0u8; MAX_PACKED_RANK];
        let mut shards = [1usize; MAX_PACKED_RANK];
        for (a, &n) in self.sizes.iter().enumerate() {
            let b = Self::byte(code, a);
            if b >= 2 {
                let d = usize::from(b - 2) / 16;
                len[d] += 1;
                shards[d] *= n;
            }
        }
        (len, shards)
    }

    fn local_numel(&self, shape: &[usize], code: Code) -> u64 {
        let (_, shards) = self.layout(code);
        shape.iter().zip(shards).map(|(&n, k)| (n / k) as u64).product()
    }

    /// Calls `f(step, next)` for every move valid from `code`, in [`moves_from`]'s order.
    fn moves(&self, shape: &[usize], code: Code, mut f: impl FnMut(CommStep, Code)) {
        let (len, shards) = self.layout(code);
        let fits = |d: usize, n: usize| shape[d].is_multiple_of(shards[d] * n);
        let append = |d: usize| Self::split(d, usize::from(len[d]));
        for (axis, &size) in self.sizes.iter().enumerate() {
            let step = |op| CommStep { op, axis, size };
            match Self::byte(code, axis) {
                0 => {
                    for dim in (0..self.rank).filter(|&d| fits(d, size)) {
                        f(step(Collective::Shard { dim }), Self::with(code, axis, append(dim)));
                    }
                }
                1 => {
                    f(step(Collective::AllReduce), Self::with(code, axis, 0));
                    for dim in (0..self.rank).filter(|&d| fits(d, size)) {
                        let next = Self::with(code, axis, append(dim));
                        f(step(Collective::ReduceScatter { dim }), next);
                    }
                }
                b => {
                    let (d, p) = (usize::from(b - 2) / 16, usize::from(b - 2) % 16);
                    if p + 1 != usize::from(len[d]) {
                        continue;
                    }
                    f(step(Collective::AllGather { dim: d }), Self::with(code, axis, 0));
                    for s in (0..self.rank).filter(|&s| s != d && fits(s, size)) {
                        let op = Collective::AllToAll { split_dim: s, concat_dim: d };
                        f(step(op), Self::with(code, axis, append(s)));
                    }
                }
            }
        }
    }
}

/// A shortest-path tree over packed specs from one source (complete, or up to a target).
#[derive(Debug)]
struct Tree {
    index: HashMap<Code, u32>,
    dist: Vec<f64>,
    prev: Vec<Option<(u32, CommStep)>>,
}

impl Tree {
    /// Dijkstra from `from`, stopping when `target` is settled (then also returning its
    /// index). Ties pop in order of discovery, so a stopped search agrees with a full one.
    fn search(
        pk: &Packer,
        mesh: &Mesh,
        shape: &[usize],
        elem_bytes: u64,
        from: Code,
        target: Option<Code>,
    ) -> (Tree, Option<u32>) {
        let mut t =
            Tree { index: HashMap::from_iter([(from, 0)]), dist: vec![0.0], prev: vec![None] };
        let mut codes: Vec<Code> = vec![from];
        let mut done: Vec<bool> = vec![false];
        let mut heap = BinaryHeap::from([Reverse((Cost(0.0), 0u32))]);
        while let Some(Reverse((Cost(d), u))) = heap.pop() {
            if done[u as usize] {
                continue;
            }
            done[u as usize] = true;
            let code = codes[u as usize];
            if Some(code) == target {
                return (t, Some(u));
            }
            let bytes = pk.local_numel(shape, code) as f64 * elem_bytes as f64;
            pk.moves(shape, code, |step, next| {
                let nd = d + step_cost(mesh, bytes, &step);
                let v = *t.index.entry(next).or_insert_with(|| {
                    codes.push(next);
                    t.dist.push(f64::INFINITY);
                    t.prev.push(None);
                    done.push(false);
                    (codes.len() - 1) as u32
                });
                if !done[v as usize] && nd < t.dist[v as usize] {
                    t.dist[v as usize] = nd;
                    t.prev[v as usize] = Some((u, step));
                    heap.push(Reverse((Cost(nd), v)));
                }
            });
        }
        (t, None)
    }

    fn cost(&self, code: Code) -> Option<f64> {
        self.index.get(&code).map(|&i| self.dist[i as usize])
    }

    /// The path to a settled state (every state of a complete search is settled).
    fn path(&self, i: u32) -> Option<ReshardPath> {
        let cost_s = *self.dist.get(i as usize)?;
        let mut steps = Vec::new();
        let mut v = i;
        while let Some((p, step)) = self.prev[v as usize] {
            steps.push(step);
            v = p;
        }
        steps.reverse();
        Some(ReshardPath { steps, cost_s })
    }
}

/// Test oracle: the cheapest path from `from` to `to` among ALL move sequences of at most
/// `max_len` moves, found by plain depth-first enumeration (no pruning, no memo), so it is
/// independent of [`cheapest_path`]. Exponential in `max_len`: for tests only.
pub fn brute_force_path(
    mesh: &Mesh,
    shape: &[usize],
    elem_bytes: u64,
    from: &Spec,
    to: &Spec,
    max_len: usize,
) -> Option<ReshardPath> {
    let mut best: Option<ReshardPath> = None;
    enumerate_paths(mesh, shape, elem_bytes, from, max_len, &mut |spec, steps, cost| {
        if spec == to && best.as_ref().is_none_or(|b| cost < b.cost_s) {
            best = Some(ReshardPath { steps: steps.to_vec(), cost_s: cost });
        }
    });
    best
}

/// Test oracle: like [`brute_force_path`] for every target at once — the cheapest path among
/// all sequences of at most `max_len` moves to each spec reachable that way (`from` itself
/// with the empty path).
pub fn brute_force_all(
    mesh: &Mesh,
    shape: &[usize],
    elem_bytes: u64,
    from: &Spec,
    max_len: usize,
) -> HashMap<Spec, ReshardPath> {
    let mut best: HashMap<Spec, ReshardPath> = HashMap::default();
    enumerate_paths(mesh, shape, elem_bytes, from, max_len, &mut |spec, steps, cost| {
        if best.get(spec).is_none_or(|b| cost < b.cost_s) {
            best.insert(spec.clone(), ReshardPath { steps: steps.to_vec(), cost_s: cost });
        }
    });
    best
}

/// Calls `visit(spec, steps, cost)` for every sequence of at most `max_len` valid moves from
/// `from` (a valid, dividing spec; none otherwise), the empty one included.
fn enumerate_paths(
    mesh: &Mesh,
    shape: &[usize],
    elem_bytes: u64,
    from: &Spec,
    max_len: usize,
    visit: &mut dyn FnMut(&Spec, &[CommStep], f64),
) {
    struct Walk<'a> {
        mesh: &'a Mesh,
        shape: &'a [usize],
        elem_bytes: u64,
        steps: Vec<CommStep>,
    }
    impl Walk<'_> {
        fn go(
            &mut self,
            spec: &Spec,
            left: usize,
            cost: f64,
            visit: &mut dyn FnMut(&Spec, &[CommStep], f64),
        ) {
            visit(spec, &self.steps, cost);
            if left == 0 {
                return;
            }
            for (step, next) in moves_from(self.mesh, self.shape, spec) {
                let c = cost + move_cost(self.mesh, self.shape, self.elem_bytes, spec, &step);
                self.steps.push(step);
                self.go(&next, left - 1, c, visit);
                self.steps.pop();
            }
        }
    }
    if from.local_shape(mesh, shape).is_some() {
        Walk { mesh, shape, elem_bytes, steps: Vec::new() }.go(from, max_len, 0.0, visit);
    }
}

/// Memoised [`cheapest_path`] for one mesh. Each (shape, elem_bytes, from) gets one complete
/// Dijkstra search, which then answers every target; paths are kept per (shape, elem_bytes,
/// from, to). A repeated query runs no search (about 0.25 µs in release). Paths and costs
/// equal [`cheapest_path`]'s exactly (ties broken the same way).
#[derive(Debug)]
pub struct ReshardCache {
    mesh: Mesh,
    /// Global shapes seen, numbered.
    shapes: HashMap<Vec<usize>, u32>,
    trees: HashMap<(u32, u64, Code), Tree>,
    paths: HashMap<(u32, u64, Code, Code), Option<ReshardPath>>,
    /// For tensors too large to pack (see [`MAX_PACKED_RANK`]) or meshes of too many axes.
    generic: HashMap<(Vec<usize>, u64, Spec, Spec), Option<ReshardPath>>,
    queries: u64,
    searches: u64,
}

/// Where a query's answer lives.
enum Slot {
    /// An endpoint is invalid or does not divide, or `to` is pending where `from` is not.
    Never,
    Same,
    Packed(u32, u64, Code, Code),
    Generic,
}

impl ReshardCache {
    pub fn new(mesh: Mesh) -> ReshardCache {
        ReshardCache {
            mesh,
            shapes: HashMap::default(),
            trees: HashMap::default(),
            paths: HashMap::default(),
            generic: HashMap::default(),
            queries: 0,
            searches: 0,
        }
    }

    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// Checks the endpoints, and makes sure the search from `from` is done.
    fn slot(&mut self, shape: &[usize], elem_bytes: u64, from: &Spec, to: &Spec) -> Slot {
        self.queries += 1;
        if from.local_shape(&self.mesh, shape).is_none()
            || to.local_shape(&self.mesh, shape).is_none()
            || !to.partial.iter().all(|a| from.partial.contains(a))
        {
            return Slot::Never;
        }
        if from == to {
            return Slot::Same;
        }
        let Some(pk) = Packer::new(&self.mesh, shape.len()) else {
            return Slot::Generic;
        };
        let next_id = self.shapes.len() as u32;
        let sid = match self.shapes.get(shape) {
            Some(&id) => id,
            None => *self.shapes.entry(shape.to_vec()).or_insert(next_id),
        };
        let (f, t) = (pk.encode(from), pk.encode(to));
        if !self.trees.contains_key(&(sid, elem_bytes, f)) {
            self.searches += 1;
            let (tree, _) = Tree::search(&pk, &self.mesh, shape, elem_bytes, f, None);
            self.trees.insert((sid, elem_bytes, f), tree);
        }
        Slot::Packed(sid, elem_bytes, f, t)
    }

    /// The cheapest path (as [`cheapest_path`]), computed once per key.
    pub fn path(
        &mut self,
        shape: &[usize],
        elem_bytes: u64,
        from: &Spec,
        to: &Spec,
    ) -> Option<&ReshardPath> {
        const EMPTY: &ReshardPath = &ReshardPath { steps: Vec::new(), cost_s: 0.0 };
        match self.slot(shape, elem_bytes, from, to) {
            Slot::Never => None,
            Slot::Same => Some(EMPTY),
            Slot::Packed(sid, eb, f, t) => {
                let tree = &self.trees[&(sid, eb, f)];
                self.paths
                    .entry((sid, eb, f, t))
                    .or_insert_with(|| tree.path(*tree.index.get(&t)?))
                    .as_ref()
            }
            Slot::Generic => {
                let key = (shape.to_vec(), elem_bytes, from.clone(), to.clone());
                if !self.generic.contains_key(&key) {
                    self.searches += 1;
                    let p = cheapest_path_generic(&self.mesh, shape, elem_bytes, from, to);
                    self.generic.insert(key.clone(), p);
                }
                self.generic[&key].as_ref()
            }
        }
    }

    /// The cost in seconds of the cheapest path, `None` when unreachable.
    pub fn cost(
        &mut self,
        shape: &[usize],
        elem_bytes: u64,
        from: &Spec,
        to: &Spec,
    ) -> Option<f64> {
        match self.slot(shape, elem_bytes, from, to) {
            Slot::Never => None,
            Slot::Same => Some(0.0),
            Slot::Packed(sid, eb, f, t) => self.trees[&(sid, eb, f)].cost(t),
            Slot::Generic => {
                self.queries -= 1;
                self.path(shape, elem_bytes, from, to).map(|p| p.cost_s)
            }
        }
    }

    /// Queries answered so far.
    pub fn queries(&self) -> u64 {
        self.queries
    }

    /// Dijkstra searches run so far (one per distinct (shape, elem_bytes, from), for packable
    /// ones).
    pub fn searches(&self) -> u64 {
        self.searches
    }

    pub fn clear(&mut self) {
        self.shapes.clear();
        self.trees.clear();
        self.paths.clear();
        self.generic.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every spec of a rank-`rank` tensor over `ndim` axes.
    fn all_specs(ndim: usize, rank: usize) -> Vec<Spec> {
        fn go(axis: usize, ndim: usize, cur: &mut Spec, out: &mut Vec<Spec>) {
            if axis == ndim {
                out.push(cur.clone());
                return;
            }
            go(axis + 1, ndim, cur, out);
            cur.partial.push(axis);
            go(axis + 1, ndim, cur, out);
            cur.partial.pop();
            for d in 0..cur.dims.len() {
                for pos in 0..=cur.dims[d].len() {
                    cur.dims[d].insert(pos, axis);
                    go(axis + 1, ndim, cur, out);
                    cur.dims[d].remove(pos);
                }
            }
        }
        let mut out = Vec::new();
        go(0, ndim, &mut Spec::replicated(rank), &mut out);
        out
    }

    fn mesh(shape: &[usize]) -> Mesh {
        let links = (0..shape.len())
            .map(|i| Link {
                latency_s: 1e-6 * (i + 1) as f64,
                bandwidth: 1e10 * (3 * i + 1) as f64,
            })
            .collect();
        Mesh::with_links(shape, links)
    }

    #[test]
    fn packing_round_trips_and_moves_agree() {
        for (m, shape) in [(mesh(&[2, 2, 2]), vec![8, 4, 2]), (mesh(&[4, 2]), vec![16, 4, 8, 2])] {
            let pk = Packer::new(&m, shape.len()).unwrap();
            for s in all_specs(m.ndim(), shape.len()) {
                let c = pk.encode(&s);
                assert_eq!(pk.decode(c), s);
                if s.local_shape(&m, &shape).is_none() {
                    continue;
                }
                assert_eq!(pk.local_numel(&shape, c), s.local_numel(&m, &shape));
                let mut packed = Vec::new();
                pk.moves(&shape, c, |st, n| packed.push((st, pk.decode(n))));
                assert_eq!(packed, moves_from(&m, &shape, &s), "{s}");
            }
        }
    }

    #[test]
    fn packed_and_generic_searches_agree() {
        let m = mesh(&[2, 2, 2]);
        let shape = [16, 8];
        let specs = all_specs(3, 2);
        for from in &specs {
            for to in &specs {
                let a = cheapest_path(&m, &shape, 4, from, to);
                let b = if a.is_none() || from == to {
                    a.clone()
                } else {
                    cheapest_path_generic(&m, &shape, 4, from, to)
                };
                assert_eq!(a, b, "{from} -> {to}");
            }
        }
    }

    #[test]
    fn rings_across_nodes_pay_the_network_latency_between_nodes_only() {
        let intra = Link { latency_s: 2e-6, bandwidth: 300e9 };
        let inter = Link { latency_s: 10e-6, bandwidth: 40e9 };
        let b = 64e6;
        let rs = Collective::ReduceScatter { dim: 0 };
        let ag = Collective::AllGather { dim: 0 };
        let a2a = Collective::AllToAll { split_dim: 0, concat_dim: 1 };
        // Within a node: the intra-node ring; one member per node: the inter-node ring.
        let node = AxisLink { intra, inter, per_node: 8 };
        assert_eq!(collective_time(rs, 8, b, &node), ring_time(rs, 8, b, &intra));
        let spread = AxisLink { intra, inter, per_node: 1 };
        for op in [rs, ag, Collective::AllReduce, a2a] {
            assert_eq!(collective_time(op, 16, b, &spread), ring_time(op, 16, b, &inter));
        }
        // 64 members, 8 on each of 8 nodes (NCCL's tuning model): bytes at the inter-node
        // bandwidth, 7 network steps and 56 on-node steps (twice each for an all-reduce).
        let dgx = AxisLink { intra, inter, per_node: 8 };
        let n = 64.0;
        let bytes = (n - 1.0) / n * b / inter.bandwidth;
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b;
        let t = collective_time(rs, 64, b, &dgx);
        assert!(close(t, bytes + 7.0 * 10e-6 + 56.0 * 2e-6), "{t}");
        let t = collective_time(ag, 64, b / n, &dgx);
        assert!(close(t, bytes + 7.0 * 10e-6 + 56.0 * 2e-6), "{t}");
        let t = collective_time(Collective::AllReduce, 64, b, &dgx);
        assert!(close(t, 2.0 * bytes + 14.0 * 10e-6 + 112.0 * 2e-6), "{t}");
        // An all-to-all: 7 messages stay on the node, 56 leave it, and so do their bytes:
        // 7/64 of them over NVLink beside 56/64 over the network, the slower setting the time.
        let t = collective_time(a2a, 64, b, &dgx);
        let network = 56.0 / n * b / inter.bandwidth;
        assert!(network > 7.0 / n * b / intra.bandwidth);
        assert!(close(t, network + 56.0 * 10e-6 + 7.0 * 2e-6), "{t}");
        // Two nodes of 8 (ep16 on 2x8xH100): half the bytes stay on the node.
        let t = collective_time(a2a, 16, b, &dgx);
        assert!(close(t, 8.0 / 16.0 * b / inter.bandwidth + 8.0 * 10e-6 + 7.0 * 2e-6), "{t}");
        assert_eq!(collective_time(Collective::Shard { dim: 0 }, 64, b, &dgx), 0.0);
        // Never cheaper than the same bytes within one node, never dearer than the flat ring.
        for op in [rs, ag, Collective::AllReduce, a2a] {
            let t = collective_time(op, 64, b, &dgx);
            assert!(t > ring_time(op, 64, b, &intra) && t < ring_time(op, 64, b, &inter));
        }
    }
}
