//! The distributed-tensor vocabulary shared by the planner and the runtime (tensor-free):
//! a device's position in a mesh, placements and the shard layout math, and the names of the
//! leaves a lowered Program carries (optimizer state, micro-batch inputs).
//!
//! Layout convention (the one every crate uses): a *placement* lists, per tensor dim, the mesh
//! axes that split it, major to minor. The device's chunk of that dim is the mixed-radix number
//! of its coordinates on those axes (the last axis varies fastest); mesh ranks are row-major
//! (the last axis fastest). A value replicated over an axis is *written* (checkpoints,
//! gathers) by the device with coordinate 0 on it.

use crate::ops::StateKind;
use crate::{IrError, Result};
use serde::{Deserialize, Serialize};

/// Per tensor dim, the mesh axes it is split over (major to minor); `[]` for a replicated dim.
pub type Placement = Vec<Vec<usize>>;

/// A device's rank and coordinates in a row-major mesh (last axis fastest).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshPos {
    pub shape: Vec<usize>,
    pub rank: usize,
    pub coords: Vec<usize>,
}

impl MeshPos {
    /// Position `rank` of a mesh of `shape`; an error names a rank outside the mesh or an
    /// empty axis.
    pub fn new(shape: &[usize], rank: usize) -> Result<MeshPos> {
        let size: usize = shape.iter().product();
        if shape.contains(&0) {
            return Err(IrError::Layout(format!("mesh {shape:?} has an axis of size 0")));
        }
        if rank >= size {
            return Err(IrError::Layout(format!(
                "rank {rank} is outside mesh {shape:?} ({size} devices)"
            )));
        }
        let mut coords = vec![0; shape.len()];
        let mut r = rank;
        for (c, &n) in coords.iter_mut().zip(shape).rev() {
            *c = r % n;
            r /= n;
        }
        Ok(MeshPos { shape: shape.to_vec(), rank, coords })
    }

    /// The only device of a 1-device mesh (what a single-device run is).
    pub fn single() -> MeshPos {
        MeshPos { shape: vec![1], rank: 0, coords: vec![0] }
    }

    pub fn size(&self) -> usize {
        self.shape.iter().product()
    }

    /// How many chunks `axes` cut a dim into, and which one this device holds; an error names
    /// an axis outside the mesh.
    pub fn chunk(&self, axes: &[usize]) -> Result<(usize, usize)> {
        let (mut n, mut index) = (1, 0);
        for &a in axes {
            let size = *self.shape.get(a).ok_or_else(|| {
                IrError::Layout(format!("mesh axis {a} is not in mesh {:?}", self.shape))
            })?;
            n *= size;
            index = index * size + self.coords[a];
        }
        Ok((n, index))
    }

    /// Whether this device's copy of a tensor under `placement` is the one to write when
    /// replicas are deduplicated: coordinate 0 on every axis the placement does not split.
    pub fn is_writer(&self, placement: &[Vec<usize>]) -> bool {
        (0..self.shape.len())
            .all(|a| placement.iter().any(|d| d.contains(&a)) || self.coords[a] == 0)
    }

    /// Where this device's shard of a `global`-shaped tensor under `placement` starts, per dim;
    /// an error names a dim that does not split evenly.
    pub fn shard_origin(&self, global: &[usize], placement: &[Vec<usize>]) -> Result<Vec<usize>> {
        if placement.len() != global.len() {
            return Err(IrError::Layout(format!(
                "placement {placement:?} has {} dims, the tensor {global:?} has {}",
                placement.len(),
                global.len()
            )));
        }
        global
            .iter()
            .zip(placement)
            .enumerate()
            .map(|(d, (&n, axes))| {
                let (k, i) = self.chunk(axes)?;
                if !n.is_multiple_of(k) {
                    return Err(IrError::Layout(format!(
                        "dim {d} of {global:?} does not split into {k} shards"
                    )));
                }
                Ok(i * (n / k))
            })
            .collect()
    }
}

/// Where a dropout's (local) tensor sits in the tensor one device would hold, so that every
/// shard regenerates its slice of the single-device mask: masks are keyed by the *global*
/// element index. Set by the planner's lowering; absent on a single-device graph, where the
/// local index is the global one.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShardOf {
    /// The un-sharded shape of one micro-batch's tensor.
    pub global: Vec<usize>,
    /// Per dim, the mesh axes splitting it.
    pub placement: Placement,
    /// The micro-batch: its rows follow those of the earlier micro-batches, so its indices
    /// start at `micro_batch · numel(global)` (the leading dim is the batch).
    pub micro_batch: usize,
}

impl ShardOf {
    /// The global index of the device's first element and the global strides of its dims:
    /// local element `i` has global index `base + Σ_d i_d · strides[d]` ([`global_index`]).
    /// `at: None` is the device at the mesh origin (coordinate 0 on every axis).
    pub fn index_map(&self, at: Option<&MeshPos>) -> Result<(u64, Vec<u64>)> {
        let origin = match at {
            Some(at) => at.shard_origin(&self.global, &self.placement)?,
            None => vec![0; self.global.len()],
        };
        let strides = row_major_strides(&self.global);
        let numel: u64 = self.global.iter().map(|&d| d as u64).product();
        let base = self.micro_batch as u64 * numel
            + origin.iter().zip(&strides).map(|(&o, &st)| o as u64 * st).sum::<u64>();
        Ok((base, strides))
    }
}

/// The rows of an embedding table one device holds: ids `first .. first + count` of a
/// `vocab`-row table (all of it unless the table is split by rows: Megatron-LM's
/// vocabulary-parallel embedding, [`crate::Op::Embedding`]'s `rows`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableRows {
    pub first: usize,
    pub count: usize,
    pub vocab: usize,
}

impl TableRows {
    /// The rows of a local table of `count` rows with shard `rows` on the device at `at`
    /// (`None`: the mesh origin).
    pub fn of(rows: Option<&ShardOf>, count: usize, at: Option<&MeshPos>) -> Result<TableRows> {
        let Some(s) = rows else { return Ok(TableRows { first: 0, count, vocab: count }) };
        let first = match at {
            Some(at) => at.shard_origin(&s.global, &s.placement)?.first().copied().unwrap_or(0),
            None => 0,
        };
        let vocab = s.global.first().copied().unwrap_or(count);
        if first + count > vocab {
            return Err(IrError::Layout(format!(
                "table rows {first}..{} beyond the vocabulary's {vocab}",
                first + count
            )));
        }
        Ok(TableRows { first, count, vocab })
    }

    /// The local row of global id `id`: `None` when another shard holds it.
    pub fn local(&self, id: usize) -> Option<usize> {
        id.checked_sub(self.first).filter(|&r| r < self.count)
    }
}

/// Row-major strides (in elements) of a shape.
pub fn row_major_strides(dims: &[usize]) -> Vec<u64> {
    let mut strides = vec![0u64; dims.len()];
    let mut s = 1u64;
    for d in (0..dims.len()).rev() {
        strides[d] = s;
        s *= dims[d] as u64;
    }
    strides
}

/// The global index of local element `flat` (row-major, `local` its shape's strides) under
/// the index map `(base, strides)` of [`ShardOf::index_map`].
pub fn global_index(flat: u64, local: &[u64], base: u64, strides: &[u64]) -> u64 {
    let mut rest = flat;
    let mut g = base;
    for (&l, &s) in local.iter().zip(strides) {
        g += (rest / l) * s;
        rest %= l;
    }
    g
}

/// The name of a parameter's optimizer state: `<param>.adam_m`, `.adam_v`, `.master`.
pub fn state_key(param: &str, kind: StateKind) -> String {
    format!("{param}.{}", kind.suffix())
}

/// The parameter and state kind of an optimizer-state key (the inverse of [`state_key`]).
pub fn split_state_key(key: &str) -> Option<(&str, StateKind)> {
    StateKind::ALL.iter().find_map(|&k| {
        key.strip_suffix(k.suffix()).and_then(|p| p.strip_suffix('.')).map(|p| (p, k))
    })
}

/// The name of data input `base` in micro-batch `k` of an unrolled Program: `base` itself for
/// the first, `base@mb<k>` for the others.
pub fn micro_batch_input(base: &str, k: usize) -> String {
    if k == 0 {
        base.to_string()
    } else {
        format!("{base}@mb{k}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coords_are_row_major_and_chunks_mixed_radix() {
        let p = MeshPos::new(&[2, 3], 5).unwrap();
        assert_eq!(p.coords, vec![1, 2]);
        assert_eq!(p.chunk(&[0, 1]).unwrap(), (6, 5));
        assert_eq!(p.chunk(&[1, 0]).unwrap(), (6, 2 * 2 + 1));
        assert!(MeshPos::new(&[2, 3], 6).is_err());
        assert!(p.chunk(&[2]).is_err());
        assert!(!p.is_writer(&[vec![0], vec![]]));
        assert!(MeshPos::new(&[2, 3], 3).unwrap().is_writer(&[vec![0], vec![]]));
    }

    /// Every element of every shard maps to a distinct global index, and together the shards
    /// cover the global tensor exactly once per replica group.
    #[test]
    fn shard_index_maps_tile_the_global_tensor() {
        let global = vec![4, 6, 2];
        let placement = vec![vec![0], vec![1], vec![]];
        let local = [2, 3, 2];
        let mut seen = std::collections::BTreeSet::new();
        for rank in 0..4 {
            let at = MeshPos::new(&[2, 2], rank).unwrap();
            let s =
                ShardOf { global: global.clone(), placement: placement.clone(), micro_batch: 1 };
            let (base, strides) = s.index_map(Some(&at)).unwrap();
            let lstrides = row_major_strides(&local);
            for flat in 0..12u64 {
                let idx = global_index(flat, &lstrides, base, &strides);
                assert!(seen.insert(idx), "rank {rank} repeats index {idx}");
            }
        }
        let numel = 48u64;
        assert_eq!(
            seen.iter().copied().collect::<Vec<_>>(),
            (numel..2 * numel).collect::<Vec<_>>()
        );
    }

    #[test]
    fn state_keys_round_trip() {
        for k in StateKind::ALL {
            let key = state_key("h.0.w", k);
            assert_eq!(split_state_key(&key), Some(("h.0.w", k)));
        }
        assert_eq!(split_state_key("h.0.w"), None);
        assert_eq!(micro_batch_input("input_ids", 0), "input_ids");
        assert_eq!(micro_batch_input("input_ids", 2), "input_ids@mb2");
    }
}
