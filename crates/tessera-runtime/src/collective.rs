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
//! [`Op::Reshard`]: tessera_ir::Op::Reshard

use crate::tensor::from_vec;
use crate::{Result, RuntimeError};
use candle_core::{DType, Tensor};
use std::collections::HashMap;
use tessera_comm::{CommStats, Communicator, Group};
use tessera_ir::{Collective, CommStep, ReshardSpec};

/// Per-dim mesh axes (major to minor) a tensor is split over; `[]` for a replicated dim.
pub type Placement = Vec<Vec<usize>>;

/// A device's rank and coordinates in a row-major mesh (last axis fastest).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMesh {
    pub shape: Vec<usize>,
    pub rank: usize,
    pub coords: Vec<usize>,
}

impl DeviceMesh {
    pub fn new(shape: &[usize], rank: usize) -> Result<DeviceMesh> {
        let coords = tessera_comm::mesh_coords(shape, rank)?;
        Ok(DeviceMesh { shape: shape.to_vec(), rank, coords })
    }

    pub fn size(&self) -> usize {
        self.shape.iter().product()
    }

    /// How many chunks `axes` cut a dim into, and which one this device holds.
    pub fn chunk(&self, axes: &[usize]) -> Result<(usize, usize)> {
        let (mut n, mut index) = (1, 0);
        for &a in axes {
            let size = *self.shape.get(a).ok_or_else(|| {
                RuntimeError::Binding(format!("mesh axis {a} is not in mesh {:?}", self.shape))
            })?;
            n *= size;
            index = index * size + self.coords[a];
        }
        Ok((n, index))
    }

    /// This device's shard of `global` under `placement` (a fresh contiguous tensor).
    pub fn shard(&self, global: &Tensor, placement: &[Vec<usize>], what: &str) -> Result<Tensor> {
        let dims = global.dims().to_vec();
        if placement.len() != dims.len() {
            return Err(RuntimeError::Binding(format!(
                "{what}: placement has {} dims, the tensor {:?} has {}",
                placement.len(),
                dims,
                dims.len()
            )));
        }
        let mut t = global.clone();
        for (d, axes) in placement.iter().enumerate() {
            let (n, index) = self.chunk(axes)?;
            if n == 1 {
                continue;
            }
            if !dims[d].is_multiple_of(n) {
                return Err(RuntimeError::Binding(format!(
                    "{what}: dim {d} of {dims:?} does not split into {n} shards"
                )));
            }
            let len = dims[d] / n;
            t = t.narrow(d, index * len, len)?;
        }
        // Always a fresh buffer: a shard must never alias the global tensor (in-place updates).
        Ok(t.force_contiguous()?)
    }

    /// Whether this device's copy of a tensor under `placement` is the one to write when
    /// replicas are deduplicated: coordinate 0 on every axis the placement does not split.
    pub fn is_writer(&self, placement: &[Vec<usize>]) -> bool {
        (0..self.shape.len())
            .all(|a| placement.iter().any(|d| d.contains(&a)) || self.coords[a] == 0)
    }
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
    /// Traffic so far.
    fn stats(&self) -> CommStats;
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

    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    fn group(&mut self, axis: usize) -> Result<Group> {
        if let Some(g) = self.groups.get(&axis) {
            return Ok(g.clone());
        }
        let g = Group::mesh_axis(&self.mesh.shape, axis, self.mesh.rank)?;
        self.groups.insert(axis, g.clone());
        Ok(g)
    }

    /// One step on the local tensor `x`.
    fn step(&mut self, s: &CommStep, x: &Tensor) -> Result<Tensor> {
        let n = s.size;
        if n == 1 {
            return Ok(x.clone());
        }
        if self.mesh.shape.get(s.axis) != Some(&n) {
            return Err(RuntimeError::Binding(format!(
                "reshard step {} over axis {} of {n} devices, but the mesh is {:?}",
                s.name(),
                s.axis,
                self.mesh.shape
            )));
        }
        let dims = x.dims().to_vec();
        let dtype = x.dtype();
        match s.op {
            Collective::Shard { dim } => {
                let len = dims[dim] / n;
                let index = self.mesh.coords[s.axis];
                Ok(x.narrow(dim, index * len, len)?.force_contiguous()?)
            }
            Collective::AllReduce => {
                let g = self.group(s.axis)?;
                let sum = self.comm.all_reduce_sum(&g, &to_f32(x)?)?;
                from_f32(sum, &dims, dtype)
            }
            Collective::AllGather { dim } => {
                let g = self.group(s.axis)?;
                let all = self.comm.all_gather(&g, &to_f32(x)?)?;
                let parts = split_chunks(all, n, &dims, dtype)?;
                Ok(Tensor::cat(&parts, dim)?)
            }
            Collective::ReduceScatter { dim } => {
                let g = self.group(s.axis)?;
                let (flat, piece) = chunks_along(x, n, dim)?;
                let mine = self.comm.reduce_scatter_sum(&g, &flat)?;
                from_f32(mine, &piece, dtype)
            }
            Collective::AllToAll { split_dim, concat_dim } => {
                let g = self.group(s.axis)?;
                let (flat, piece) = chunks_along(x, n, split_dim)?;
                let received = self.comm.all_to_all(&g, &flat)?;
                let parts = split_chunks(received, n, &piece, dtype)?;
                Ok(Tensor::cat(&parts, concat_dim)?)
            }
        }
    }
}

impl ReshardRunner for CommRunner {
    fn reshard(&mut self, spec: &ReshardSpec, x: &Tensor) -> Result<Tensor> {
        let mut t = x.clone();
        for s in &spec.forward {
            t = self.step(s, &t)?;
        }
        if spec.forward.iter().all(|s| s.size == 1) {
            // Nothing moved, but the Program allocated a fresh buffer: give it one.
            t = t.force_contiguous()?;
        }
        Ok(t)
    }

    fn stats(&self) -> CommStats {
        self.comm.stats()
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

/// `x` cut into `n` chunks along `dim`, laid end to end (chunk k contiguous), and the chunk's
/// shape.
fn chunks_along(x: &Tensor, n: usize, dim: usize) -> Result<(Vec<f32>, Vec<usize>)> {
    let mut piece = x.dims().to_vec();
    if dim >= piece.len() || !piece[dim].is_multiple_of(n) {
        return Err(RuntimeError::Binding(format!(
            "cannot cut {:?} into {n} chunks along dim {dim}",
            x.dims()
        )));
    }
    piece[dim] /= n;
    let mut flat = Vec::with_capacity(x.elem_count());
    for k in 0..n {
        flat.extend(to_f32(&x.narrow(dim, k * piece[dim], piece[dim])?)?);
    }
    Ok((flat, piece))
}

/// A buffer of `n` equal chunks, each a tensor of `dims`.
fn split_chunks(v: Vec<f32>, n: usize, dims: &[usize], dtype: DType) -> Result<Vec<Tensor>> {
    let c: usize = dims.iter().product();
    if v.len() != n * c {
        return Err(RuntimeError::Binding(format!(
            "collective returned {} values, expected {n} × {c}",
            v.len()
        )));
    }
    v.chunks(c.max(1)).take(n).map(|chunk| from_f32(chunk.to_vec(), dims, dtype)).collect()
}
