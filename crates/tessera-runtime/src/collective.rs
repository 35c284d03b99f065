//! One device's place in a device mesh, and the two things that place decides: which shard of
//! a global tensor the device holds ([`DeviceMesh::shard`]) and what a [`Op::Reshard`] step
//! does on it ([`CommRunner`], through a [`Communicator`]).
//!
//! Layout conventions (the planner's, see `tessera-plan`'s `spec` and `reshard` modules):
//! a *placement* lists, per tensor dim, the mesh axes that split it, major to minor. The
//! device's chunk of that dim is the mixed-radix number of its coordinates on those axes (the
//! last axis varies fastest), so a `Shard`/`ReduceScatter` that appends an axis and an
//! `AllGather` that removes the last one are exact inverses. Collective groups are the devices
//! that differ only in one axis' coordinate, in coordinate order ([`Group::mesh_axis`]).
//!
//! Memory: the Program charges a reshard for its result only (nothing for a view), so a step
//! allocates its result and no other buffer the size of a tensor. The input of a contiguous
//! f32 tensor is lent to the communicator as it is (other dtypes and strided views are
//! converted into one f32 copy); a cut or join along a dim that is not the leading one is
//! expressed as a [`ChunkLayout`] instead of a reordering copy, so the communicator reads the
//! members' chunks from, and writes them into, the tensors' own row-major buffers; and
//! consecutive all-gathers along one dim fill the final result in place, with no intermediate
//! result. (The thread backend also streams a call in bounded pieces, so its transient memory
//! does not grow with the tensor.) What remains uncounted is the intermediate result of other
//! multi-step reshards (an all-reduce then a shard, say).
//!
//! [`Op::Reshard`]: tessera_ir::Op::Reshard

use crate::tensor::{from_vec, read, HostSlice};
use crate::{Result, RuntimeError};
use candle_core::{DType, Tensor};
use std::collections::HashMap;
use std::ops::Deref;
use tessera_comm::communicator::ChunkLayout;
use tessera_comm::{CommStats, Communicator, Group};
use tessera_ir::{Collective, CommStep, P2p, ReshardSpec, TensorMeta};

/// A device's place in its mesh: the planner's and the runtime's one type
/// ([`tessera_ir::dist::MeshPos`]).
pub use tessera_ir::dist::{MeshPos as DeviceMesh, Placement};

/// This device's shard of global tensor `global` under `placement` (a fresh contiguous tensor;
/// `what` names it in errors).
pub fn shard(
    at: &DeviceMesh,
    global: &Tensor,
    placement: &[Vec<usize>],
    what: &str,
) -> Result<Tensor> {
    let dims = global.dims().to_vec();
    let origin = at
        .shard_origin(&dims, placement)
        .map_err(|e| RuntimeError::Binding(format!("{what}: {e}")))?;
    let mut t = global.clone();
    for (d, axes) in placement.iter().enumerate() {
        let (n, _) = at.chunk(axes)?;
        if n > 1 {
            t = t.narrow(d, origin[d], dims[d] / n)?;
        }
    }
    // Always a fresh buffer: a shard must never alias the global tensor (in-place updates).
    Ok(t.force_contiguous()?)
}

/// The global tensor from every rank's shard (`parts[r]` from rank `r` of a mesh of `shape`):
/// each distinct chunk is taken once, from the rank with coordinate 0 on the axes the
/// placement does not split.
pub fn assemble(shape: &[usize], parts: &[Tensor], placement: &[Vec<usize>]) -> Result<Tensor> {
    let first =
        parts.first().ok_or_else(|| RuntimeError::Binding("no shards to assemble".into()))?;
    let local = first.dims().to_vec();
    let mut global = local.clone();
    let mesh0 = DeviceMesh::new(shape, 0)?;
    for (d, axes) in placement.iter().enumerate() {
        global[d] *= mesh0.chunk(axes)?.0;
    }
    let mut out = Tensor::zeros(global.as_slice(), first.dtype(), first.device())?;
    for (r, part) in parts.iter().enumerate() {
        let m = DeviceMesh::new(shape, r)?;
        if !m.is_writer(placement) {
            continue;
        }
        if part.dims() != local.as_slice() {
            return Err(RuntimeError::Binding(format!(
                "shard of rank {r} is {:?}, rank 0's is {local:?}",
                part.dims()
            )));
        }
        let mut ranges = Vec::with_capacity(local.len());
        for (d, axes) in placement.iter().enumerate() {
            let (_, index) = m.chunk(axes)?;
            ranges.push(index * local[d]..(index + 1) * local[d]);
        }
        out = out.slice_assign(&ranges, part)?;
    }
    Ok(out)
}

/// Executes [`Op::Reshard`](tessera_ir::Op::Reshard) nodes for the executor.
pub trait ReshardRunner: Send {
    fn reshard(&mut self, spec: &ReshardSpec, x: &Tensor) -> Result<Tensor>;
    /// The device this runner moves data for.
    fn mesh(&self) -> &DeviceMesh;
    /// Traffic so far.
    fn stats(&self) -> CommStats;
    /// Sends `x` to the pipeline peer `p` names ([`Op::Send`](tessera_ir::Op::Send)).
    fn send(&mut self, p: &P2p, x: &Tensor) -> Result<()>;
    /// Receives a tensor of `meta` from the pipeline peer `p` names.
    fn recv(&mut self, p: &P2p, meta: &TensorMeta) -> Result<Tensor>;
    /// The transport, for calls outside the Program (barriers around checkpoints).
    fn communicator(&mut self) -> &mut dyn Communicator;
}

/// Runs reshard steps through a [`Communicator`], one collective per step over the step's
/// mesh axis. Tensors travel as f32 (bf16/fp16 exactly; integer ids up to 2^24).
pub struct CommRunner {
    comm: Box<dyn Communicator>,
    mesh: DeviceMesh,
    groups: HashMap<usize, Group>,
}

impl CommRunner {
    pub fn new(comm: Box<dyn Communicator>, mesh: DeviceMesh) -> Result<CommRunner> {
        if comm.world_size() != mesh.size() || comm.rank() != mesh.rank {
            return Err(RuntimeError::Binding(format!(
                "communicator rank {} of {} does not match mesh {:?} rank {}",
                comm.rank(),
                comm.world_size(),
                mesh.shape,
                mesh.rank
            )));
        }
        Ok(CommRunner { comm, mesh, groups: HashMap::new() })
    }

    /// The rank at coordinate `p.peer` along `p.axis` (with `p.ring`, `p.peer` places after
    /// this device's coordinate, around the axis), every other coordinate this device's.
    fn peer(&self, p: &P2p) -> Result<usize> {
        let shape = &self.mesh.shape;
        if p.axis >= shape.len() || p.peer >= shape[p.axis] {
            return Err(RuntimeError::Binding(format!(
                "a transfer to coordinate {} of axis {}, but the mesh is {shape:?}",
                p.peer, p.axis
            )));
        }
        let mut coords = self.mesh.coords.clone();
        coords[p.axis] = if p.ring { (coords[p.axis] + p.peer) % shape[p.axis] } else { p.peer };
        Ok(coords.iter().zip(shape).fold(0, |r, (&c, &n)| r * n + c))
    }

    fn group(&mut self, axis: usize) -> Result<Group> {
        if let Some(g) = self.groups.get(&axis) {
            return Ok(g.clone());
        }
        let g = Group::mesh_axis(&self.mesh.shape, axis, self.mesh.rank)?;
        self.groups.insert(axis, g.clone());
        Ok(g)
    }

    /// Checks that step `s` spans a mesh axis of its size.
    fn check_axis(&self, s: &CommStep) -> Result<()> {
        if self.mesh.shape.get(s.axis) != Some(&s.size) {
            return Err(RuntimeError::Binding(format!(
                "reshard step {} over axis {} of {} devices, but the mesh is {:?}",
                s.name(),
                s.axis,
                s.size,
                self.mesh.shape
            )));
        }
        Ok(())
    }

    /// One step on the local tensor `x`.
    fn step(&mut self, s: &CommStep, x: &Tensor) -> Result<Tensor> {
        let n = s.size;
        if n == 1 {
            return Ok(x.clone());
        }
        self.check_axis(s)?;
        let dims = x.dims().to_vec();
        let dtype = x.dtype();
        match s.op {
            Collective::Shard { dim } => {
                let len = cut(&dims, n, dim)?[dim];
                let index = self.mesh.coords[s.axis];
                Ok(x.narrow(dim, index * len, len)?.force_contiguous()?)
            }
            Collective::AllReduce => {
                let g = self.group(s.axis)?;
                let sum = self.comm.all_reduce_sum(&g, &F32Data::of(x)?)?;
                from_f32(sum, &dims, dtype)
            }
            Collective::AllGather { dim } => self.gather_chain(std::slice::from_ref(s), dim, x),
            Collective::ReduceScatter { dim } => {
                let g = self.group(s.axis)?;
                let piece = cut(&dims, n, dim)?;
                // Chunk k (block k of `dim`) is summed onto member k.
                let layout = ChunkLayout::interleaved(outer(&dims, dim));
                let mine = self.comm.reduce_scatter_sum_strided(&g, &F32Data::of(x)?, layout)?;
                from_f32(mine, &piece, dtype)
            }
            Collective::AllToAll { split_dim, concat_dim } => {
                let g = self.group(s.axis)?;
                let piece = cut(&dims, n, split_dim)?;
                let whole = joined(&piece, n, concat_dim)?;
                let input = ChunkLayout::interleaved(outer(&dims, split_dim));
                let output = ChunkLayout::interleaved(outer(&piece, concat_dim));
                let received = self.comm.all_to_all_strided(&g, &F32Data::of(x)?, input, output)?;
                from_f32(received, &whole, dtype)
            }
        }
    }

    /// Consecutive all-gathers along one `dim` (over mesh axes of more than one device, minor
    /// first, as a placement's axes are removed), straight into the final result: it is
    /// allocated once, this device's tensor is copied into its place, and each step fills in
    /// its group's part in place ([`Communicator::all_gather_in_place`]). A step-by-step run
    /// would also allocate every intermediate result, which the Program does not count.
    ///
    /// The result's chunks of `dim` are numbered in mixed radix over the steps' coordinates,
    /// the last step's most significant (what step-by-step concatenation gives). Before step
    /// i, the filled part of each result row is the block of this device's coordinates on the
    /// steps after i, `block_i` elements long (the tensor's own block of `dim` times the sizes
    /// of the steps before i); step i's group fills the `size_i` such blocks that differ in its
    /// coordinate.
    fn gather_chain(&mut self, steps: &[CommStep], dim: usize, x: &Tensor) -> Result<Tensor> {
        let Some(first) = steps.first() else {
            return Ok(x.clone());
        };
        let dims = x.dims().to_vec();
        let total: usize = steps.iter().map(|s| s.size).product();
        let whole = joined(&dims, total, dim)?;
        for s in steps {
            self.check_axis(s)?;
        }
        let outer = outer(&dims, dim);
        // One row (one index of the dims before `dim`) of the tensor, and of the result.
        let block: usize = dims[dim..].iter().product();
        let row = block * total;
        let mut buf = vec![0.0f32; outer * row];
        // This device's block within a result row, per step: the offset of the blocks it
        // shares its coordinates on the later steps with.
        let mut bases = Vec::with_capacity(steps.len());
        let mut span = block;
        for (i, s) in steps.iter().enumerate() {
            let mut base = 0;
            let mut scale = span * s.size;
            for later in &steps[i + 1..] {
                base += self.mesh.coords[later.axis] * scale;
                scale *= later.size;
            }
            bases.push((base, span));
            span *= s.size;
        }
        {
            // This device's tensor, into its place (the first step's chunk of this member).
            let data = F32Data::of(x)?;
            let k = self.mesh.coords[first.axis];
            let layout = ChunkLayout::placed(outer, row, bases.first().map_or(0, |b| b.0));
            layout.for_each_run(first.size, data.len(), k, 0..data.len(), |j, at, len| {
                buf[at..at + len].copy_from_slice(&data[j..j + len]);
            });
        }
        for (s, &(base, span)) in steps.iter().zip(&bases) {
            let g = self.group(s.axis)?;
            let layout = ChunkLayout::placed(outer, row, base);
            self.comm.all_gather_in_place(&g, &mut buf, outer * span, layout)?;
        }
        from_f32(buf, &whole, x.dtype())
    }
}

impl ReshardRunner for CommRunner {
    fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    fn reshard(&mut self, spec: &ReshardSpec, x: &Tensor) -> Result<Tensor> {
        if spec.is_view() {
            // The Program aliases the output to the input (`Op::output_alias`) and charges no
            // buffer for it: a copy here would be memory nobody accounts for.
            return Ok(x.clone());
        }
        let mut t = x.clone();
        let steps = &spec.forward;
        let mut i = 0;
        while i < steps.len() {
            if let (Collective::AllGather { dim }, true) = (steps[i].op, steps[i].size > 1) {
                // The whole run of all-gathers along `dim` at once: no intermediate results.
                let run =
                    steps[i..].iter().take_while(|s| s.op == steps[i].op && s.size > 1).count();
                t = self.gather_chain(&steps[i..i + run], dim, &t)?;
                i += run;
            } else {
                t = self.step(&steps[i], &t)?;
                i += 1;
            }
        }
        if steps.iter().all(|s| s.size == 1) {
            // Nothing moved, but the Program allocated a fresh buffer: give it one.
            t = t.force_contiguous()?;
        }
        Ok(t)
    }

    fn stats(&self) -> CommStats {
        self.comm.stats()
    }

    fn send(&mut self, p: &P2p, x: &Tensor) -> Result<()> {
        let to = self.peer(p)?;
        let data = F32Data::of(x)?;
        Ok(self.comm.send_tagged(to, p.tag, &data)?)
    }

    fn recv(&mut self, p: &P2p, meta: &TensorMeta) -> Result<Tensor> {
        let from = self.peer(p)?;
        let v = self.comm.recv_tagged(from, p.tag)?;
        let n = meta.shape.numel();
        if v.len() as u64 != n {
            return Err(RuntimeError::Binding(format!(
                "received {} values from rank {from} on tag {}, expected {} ({meta}): the \
                 stages' Programs disagree (a planner bug)",
                v.len(),
                p.tag,
                n
            )));
        }
        from_f32(v, meta.shape.dims(), crate::tensor::candle_dtype(meta.dtype))
    }

    fn communicator(&mut self) -> &mut dyn Communicator {
        self.comm.as_mut()
    }
}

/// Largest integer f32 represents exactly; ids beyond it cannot travel as f32.
const F32_EXACT_INT: f64 = 16_777_216.0;

fn to_f32(x: &Tensor) -> Result<Vec<f32>> {
    if !x.dtype().is_float() {
        let v = x.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        if v.iter().any(|a| a.abs() > F32_EXACT_INT) {
            return Err(RuntimeError::Unsupported {
                backend: "communicator".into(),
                op: "reshard".into(),
                reason: "integer values above 2^24 cannot be moved exactly as f32".into(),
            });
        }
        return Ok(v.into_iter().map(|a| a as f32).collect());
    }
    Ok(x.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

fn from_f32(v: Vec<f32>, dims: &[usize], dtype: DType) -> Result<Tensor> {
    let t = from_vec(v, dims)?;
    Ok(if dtype == DType::F32 { t } else { t.to_dtype(dtype)? })
}

/// A tensor's elements as f32, for the communicator: borrowed from a contiguous f32 CPU tensor
/// (no copy), converted into a fresh buffer otherwise.
///
/// The borrow holds the storage's read lock while the collective runs. That cannot deadlock:
/// each device's tensors are its own buffers (shards are always fresh), so no other rank of
/// the call ever waits for a write lock on this storage.
enum F32Data<'a> {
    Borrowed(HostSlice<'a, f32>),
    Owned(Vec<f32>),
}

impl<'a> F32Data<'a> {
    fn of(x: &'a Tensor) -> Result<F32Data<'a>> {
        if x.dtype() == DType::F32 && x.is_contiguous() && x.device().is_cpu() {
            return Ok(F32Data::Borrowed(read::<f32>(x)?));
        }
        Ok(F32Data::Owned(to_f32(x)?))
    }
}

impl Deref for F32Data<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            F32Data::Borrowed(s) => s,
            F32Data::Owned(v) => v,
        }
    }
}

/// Elements before one index of `dim`: the product of the dims before it (the number of
/// blocks a cut along `dim` splits each chunk into).
fn outer(dims: &[usize], dim: usize) -> usize {
    dims[..dim.min(dims.len())].iter().product()
}

/// The shape of one of `n` chunks of `dims` cut along `dim`.
fn cut(dims: &[usize], n: usize, dim: usize) -> Result<Vec<usize>> {
    if dim >= dims.len() || !dims[dim].is_multiple_of(n) {
        return Err(RuntimeError::Binding(format!(
            "cannot cut {dims:?} into {n} chunks along dim {dim}"
        )));
    }
    let mut piece = dims.to_vec();
    piece[dim] /= n;
    Ok(piece)
}

/// The shape of `n` tensors of `dims` joined along `dim`.
fn joined(dims: &[usize], n: usize, dim: usize) -> Result<Vec<usize>> {
    let mut whole = dims.to_vec();
    match whole.get_mut(dim) {
        Some(d) => *d *= n,
        None => {
            return Err(RuntimeError::Binding(format!(
                "cannot join {n} tensors of {dims:?} along dim {dim}"
            )))
        }
    }
    Ok(whole)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use std::time::Duration;
    use tessera_comm::ThreadComm;

    const MESH: [usize; 2] = [2, 3];

    /// Rank `r`'s local tensor: distinct per rank, with magnitudes from 1e-3 to 1e3 so that
    /// the order of a sum changes its rounding.
    fn local(r: usize, dims: &[usize]) -> Tensor {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| {
                let h = ((r * 7919 + i * 104_729) % 10_007) as f32;
                let sign = if (i + r).is_multiple_of(2) { 1.0 } else { -1.0 };
                sign * (h + 0.5) * [1e-3f32, 1.0, 1e3][(r + i) % 3]
            })
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).expect("valid shape")
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        let t = t.flatten_all().expect("flatten").to_dtype(DType::F32).expect("f32");
        t.to_vec1::<f32>().expect("f32 vector").iter().map(|x| x.to_bits()).collect()
    }

    /// What `op` over mesh axis `axis` must give rank `r`, from every rank's input, with
    /// tensor ops (sums in group order).
    fn reference(op: Collective, axis: usize, r: usize, inputs: &[Tensor]) -> Tensor {
        let g = Group::mesh_axis(&MESH, axis, r).expect("valid");
        // In f32, as the values travel (a bf16 sum would round differently).
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32).expect("f32");
        let xs: Vec<Tensor> = g.ranks().iter().map(|&m| f32_of(&inputs[m])).collect();
        let k = g.index_of(r).expect("member");
        let n = xs.len();
        let sum = || xs[1..].iter().fold(xs[0].clone(), |acc, x| (acc + x).expect("same shapes"));
        let chunk = |t: &Tensor, dim: usize, k: usize| {
            let len = t.dims()[dim] / n;
            t.narrow(dim, k * len, len).expect("in range")
        };
        let out = match op {
            Collective::AllReduce => sum(),
            Collective::AllGather { dim } => Tensor::cat(&xs, dim).expect("cat"),
            Collective::ReduceScatter { dim } => chunk(&sum(), dim, k),
            Collective::AllToAll { split_dim, concat_dim } => {
                let parts: Vec<Tensor> = xs.iter().map(|x| chunk(x, split_dim, k)).collect();
                Tensor::cat(&parts, concat_dim).expect("cat")
            }
            Collective::Shard { dim } => chunk(&f32_of(&inputs[r]), dim, k),
        };
        out.to_dtype(inputs[r].dtype()).expect("back to the input's dtype")
    }

    /// Runs a reshard of `steps` on every rank of the mesh (inputs made by `make`), through
    /// [`CommRunner`] on the thread backend with a small piece, and checks each rank's result
    /// bit for bit against [`reference`] applied step by step.
    fn check_steps(steps: &[CommStep], make: &(dyn Fn(usize) -> Tensor + Sync)) {
        let spec = ReshardSpec { forward: steps.to_vec(), backward: Vec::new() };
        let inputs: Vec<Tensor> = (0..6).map(make).collect();
        let comms = ThreadComm::world_with_piece(6, Duration::from_secs(5), 7).expect("world");
        let results: Vec<(Tensor, CommStats)> = std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    let (x, spec) = (make(c.rank()), &spec);
                    scope.spawn(move || {
                        let mesh = DeviceMesh::new(&MESH, c.rank()).expect("valid");
                        let mut runner = CommRunner::new(Box::new(c), mesh).expect("matches");
                        (runner.reshard(spec, &x).expect("reshard"), runner.stats())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("no panic")).collect()
        });
        let mut want = inputs.clone();
        let mut bytes = 0;
        // Steps over one device do nothing (and do not communicate).
        let steps: Vec<CommStep> = steps.iter().copied().filter(|s| s.size > 1).collect();
        for s in &steps {
            if !matches!(s.op, Collective::Shard { .. }) {
                // Each collective step counts once, with this device's input (f32 on the wire).
                bytes += 4 * want[0].elem_count() as u64;
            }
            want = (0..6).map(|r| reference(s.op, s.axis, r, &want)).collect();
        }
        for (r, (got, stats)) in results.iter().enumerate() {
            assert_eq!(got.dims(), want[r].dims(), "{steps:?} rank {r}");
            assert_eq!(got.dtype(), inputs[r].dtype(), "{steps:?} rank {r}");
            assert_eq!(bits(got), bits(&want[r]), "{steps:?} rank {r}");
            let moving = steps.iter().filter(|s| !matches!(s.op, Collective::Shard { .. }));
            assert_eq!(stats.total_calls(), moving.count() as u64, "{steps:?} rank {r}");
            assert_eq!(stats.total_bytes(), bytes, "{steps:?} rank {r}");
        }
    }

    /// [`check_steps`] of one step.
    fn check(op: Collective, axis: usize, make: &(dyn Fn(usize) -> Tensor + Sync)) {
        check_steps(&[CommStep { op, axis, size: MESH[axis] }], make);
    }

    #[test]
    fn every_step_matches_tensor_ops_along_every_dim() {
        let dims = [6, 4, 3, 6];
        let plain = |r: usize| local(r, &dims);
        for (axis, &n) in MESH.iter().enumerate() {
            check(Collective::AllReduce, axis, &plain);
            for (d, &len) in dims.iter().enumerate() {
                check(Collective::AllGather { dim: d }, axis, &plain);
                if len.is_multiple_of(n) {
                    check(Collective::Shard { dim: d }, axis, &plain);
                    check(Collective::ReduceScatter { dim: d }, axis, &plain);
                    for c in 0..dims.len() {
                        check(Collective::AllToAll { split_dim: d, concat_dim: c }, axis, &plain);
                    }
                }
            }
        }
    }

    #[test]
    fn strided_and_converted_inputs_take_the_copying_path_with_the_same_results() {
        // A transposed view (not contiguous) and a narrowed one (contiguous, offset storage).
        let transposed = |r: usize| local(r, &[6, 6, 4]).transpose(0, 2).expect("transpose");
        let narrowed = |r: usize| local(r, &[8, 6, 6]).narrow(0, 2, 6).expect("narrow");
        // bf16 travels as f32 exactly, and comes back as bf16.
        let half = |r: usize| local(r, &[6, 6]).to_dtype(DType::BF16).expect("bf16");
        for make in [&transposed as &(dyn Fn(usize) -> Tensor + Sync), &narrowed, &half] {
            check(Collective::AllGather { dim: 1 }, 1, make);
            check(Collective::ReduceScatter { dim: 1 }, 1, make);
            check(Collective::AllToAll { split_dim: 1, concat_dim: 0 }, 0, make);
        }
    }

    #[test]
    fn chains_of_all_gathers_match_step_by_step_concatenation() {
        let dims = [2, 4, 3];
        let plain = |r: usize| local(r, &dims);
        let half = |r: usize| local(r, &dims).to_dtype(DType::BF16).expect("bf16");
        let step = |op, axis: usize| CommStep { op, axis, size: MESH[axis] };
        for d in 0..dims.len() {
            let gather = Collective::AllGather { dim: d };
            // Minor axis first (how a placement's axes come off), and the other way round.
            check_steps(&[step(gather, 1), step(gather, 0)], &plain);
            check_steps(&[step(gather, 0), step(gather, 1)], &plain);
            check_steps(&[step(gather, 1), step(gather, 0)], &half);
            // A chain between other steps, and chains along different dims back to back.
            let other = Collective::AllGather { dim: (d + 1) % dims.len() };
            check_steps(
                &[
                    step(Collective::AllReduce, 0),
                    step(gather, 1),
                    step(gather, 0),
                    step(other, 1),
                    step(Collective::Shard { dim: d }, 0),
                ],
                &plain,
            );
        }
        // Size-1 steps are no-ops and a view moves nothing.
        let one = CommStep { op: Collective::AllGather { dim: 0 }, axis: 0, size: 1 };
        check_steps(&[one], &plain);
        check_steps(&[], &plain);
    }
}
