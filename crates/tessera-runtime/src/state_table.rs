//! Who holds which chunk of the run's state: every rank's table of its own tensors (names,
//! global shapes, dtypes, placements), exchanged over the communicator and merged into one
//! table of global tensors, each chunk with the rank that writes it.
//!
//! Under a plain SPMD plan every rank names every tensor, and the writer of a chunk is the
//! rank with coordinate 0 on every axis the placement does not split
//! ([`DeviceMesh::is_writer`]). Under a pipelined plan a rank holds only its stage's
//! parameters and optimizer state, so no rank can derive the whole table from its own: the
//! table is the union of what the ranks hold, and the writer of a chunk is the lowest rank
//! holding it — which, on an SPMD plan, is exactly the `is_writer` rank, so the files of a
//! checkpoint do not depend on which rule wrote them. The sharded save
//! ([`crate::dist_checkpoint::save_sharded`]) and the gathering of parameters for the
//! held-out evaluation ([`crate::trainer::gather_params_to`]) both read this table.

use crate::collective::DeviceMesh;
use crate::dist_checkpoint::{ChunkLocation, ShardedTensor};
use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use tessera_comm::{Communicator, Group};

fn err(msg: String) -> RuntimeError {
    RuntimeError::Checkpoint(msg)
}

/// What one rank says it holds, as exchanged: the mesh it runs on, the step of its state and
/// its tensors (each with the one chunk it holds, `chunks[0]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankTable {
    pub mesh: Vec<usize>,
    pub step: u64,
    pub tensors: Vec<ShardedTensor>,
}

impl RankTable {
    /// The table as 16-bit pieces in f32 (exact), for a communicator of f32; and its length
    /// in bytes.
    pub fn encode(&self) -> Result<(Vec<f32>, usize)> {
        let bytes = serde_json::to_vec(self)
            .map_err(|e| err(format!("cannot serialise the tensor table: {e}")))?;
        let words = bytes.chunks(2).map(|c| {
            let lo = u16::from(c[0]);
            let hi = c.get(1).map_or(0, |&b| u16::from(b));
            f32::from(lo | (hi << 8))
        });
        Ok((words.collect(), bytes.len()))
    }

    /// The inverse of [`RankTable::encode`]: `len` bytes from `words` (padding ignored).
    pub fn decode(words: &[f32], len: usize, rank: usize) -> Result<RankTable> {
        let mut bytes = Vec::with_capacity(words.len() * 2);
        for &w in words {
            let v = w as u16;
            bytes.extend([(v & 0xff) as u8, (v >> 8) as u8]);
        }
        if len > bytes.len() {
            return Err(err(format!(
                "rank {rank}'s tensor table is {len} bytes, {} arrived",
                bytes.len()
            )));
        }
        serde_json::from_slice(&bytes[..len])
            .map_err(|e| err(format!("rank {rank}'s tensor table does not parse: {e}")))
    }
}

/// Every rank's table, on every rank: `lens[r]` is rank `r`'s encoded length in bytes (known
/// from an earlier gather), `mine` this rank's encoding. One all-gather of the longest
/// encoding (the others padded).
pub fn gather_tables(
    comm: &mut dyn Communicator,
    mine: &[f32],
    lens: &[usize],
) -> Result<Vec<RankTable>> {
    let n = lens.len();
    let width = lens.iter().map(|l| l.div_ceil(2)).max().unwrap_or(0).max(1);
    let mut padded = mine.to_vec();
    padded.resize(width, 0.0);
    let all = comm.all_gather(&Group::world(n)?, &padded)?;
    if all.len() != n * width {
        return Err(err(format!(
            "the tensor tables' all-gather returned {} values, expected {}",
            all.len(),
            n * width
        )));
    }
    all.chunks(width).zip(lens).enumerate().map(|(r, (w, &l))| RankTable::decode(w, l, r)).collect()
}

/// This rank's table sent to every rank, and every rank's table back (two all-gathers: the
/// lengths, then the tables).
pub fn exchange(comm: &mut dyn Communicator, mine: &RankTable) -> Result<Vec<RankTable>> {
    let n = comm.world_size();
    let (words, len) = mine.encode()?;
    let lens = comm.all_gather(&Group::world(n)?, &crate::run::pack(&[len as u64]))?;
    let lens: Vec<usize> = crate::run::unpack(&lens).into_iter().map(|l| l as usize).collect();
    gather_tables(comm, &words, &lens)
}

/// A tensor's chunk indices, each with the rank that writes it.
type Writers = BTreeMap<Vec<usize>, usize>;

/// The global tensors the ranks' tables describe, sorted by name, each chunk once with its
/// writer (the lowest rank holding it). Every rank computes the same answer from the same
/// tables, so an error here is the same error on every rank. Errors: ranks on different
/// meshes or steps, a tensor two ranks describe differently, a rank claiming a chunk its
/// coordinates do not give it, and a chunk no rank holds.
pub fn merge(tables: &[RankTable]) -> Result<Vec<ShardedTensor>> {
    let Some(first) = tables.first() else { return Ok(Vec::new()) };
    let differing = |f: &dyn Fn(&RankTable) -> bool| -> Vec<String> {
        tables.iter().enumerate().filter(|(_, t)| f(t)).map(|(r, _)| r.to_string()).collect()
    };
    let other_step = differing(&|t| t.step != first.step);
    if !other_step.is_empty() {
        return Err(err(format!(
            "rank(s) {} disagree with rank 0 on the step (rank 0 is at step {}); every rank \
             must save the same state of the same step",
            other_step.join(", "),
            first.step
        )));
    }
    let other_mesh = differing(&|t| t.mesh != first.mesh);
    if !other_mesh.is_empty() {
        return Err(err(format!(
            "rank(s) {} disagree with rank 0 on the mesh (rank 0's is {:?})",
            other_mesh.join(", "),
            first.mesh
        )));
    }
    let world: usize = first.mesh.iter().product();
    if world != tables.len() {
        return Err(err(format!(
            "{} ranks sent tables for mesh {:?} of {world} devices",
            tables.len(),
            first.mesh
        )));
    }
    // name → (description, first holder, chunk index → writer)
    let mut merged: BTreeMap<&str, (ShardedTensor, usize, Writers)> = BTreeMap::new();
    for (rank, table) in tables.iter().enumerate() {
        let at = DeviceMesh::new(&first.mesh, rank)?;
        for t in &table.tensors {
            let index = t
                .placement
                .iter()
                .map(|axes| Ok(at.chunk(axes)?.1))
                .collect::<Result<Vec<usize>>>()
                .map_err(|e| err(format!("rank {rank}: tensor {}: {e}", t.name)))?;
            if t.chunks.len() != 1 || t.chunks[0].index != index || t.chunks[0].rank != rank {
                return Err(err(format!(
                    "rank {rank}: tensor {} claims chunk(s) {:?}; under placement {:?} on mesh \
                     {:?} it holds chunk {index:?}",
                    t.name,
                    t.chunks.iter().map(|c| (&c.index, c.rank)).collect::<Vec<_>>(),
                    t.placement,
                    first.mesh
                )));
            }
            let entry = merged.entry(t.name.as_str()).or_insert_with(|| {
                let mut desc = t.clone();
                desc.chunks.clear();
                (desc, rank, BTreeMap::new())
            });
            let (desc, holder, writers) = entry;
            if (&desc.role, &desc.shape, &desc.dtype, &desc.placement)
                != (&t.role, &t.shape, &t.dtype, &t.placement)
            {
                return Err(err(format!(
                    "rank {rank} disagrees with rank {holder} on tensor {}: {:?} {:?} {} under \
                     {:?} there, {:?} {:?} {} under {:?} here",
                    t.name,
                    desc.role,
                    desc.shape,
                    desc.dtype,
                    desc.placement,
                    t.role,
                    t.shape,
                    t.dtype,
                    t.placement
                )));
            }
            // Ranks come in order: the first holder of a chunk is its lowest.
            writers.entry(index).or_insert(rank);
        }
    }
    let mut out = Vec::with_capacity(merged.len());
    let at = DeviceMesh::new(&first.mesh, 0)?;
    for (name, (mut desc, _, writers)) in merged {
        let grid: Vec<usize> =
            desc.placement.iter().map(|axes| Ok(at.chunk(axes)?.0)).collect::<Result<_>>()?;
        let want: usize = grid.iter().product();
        if writers.len() != want {
            let held: BTreeSet<&Vec<usize>> = writers.keys().collect();
            let missing: Vec<Vec<usize>> = odometer(&grid).filter(|i| !held.contains(i)).collect();
            return Err(err(format!(
                "tensor {name}: chunk(s) {missing:?} of its {grid:?} grid are held by no rank; \
                 the ranks' state is incomplete"
            )));
        }
        desc.chunks =
            writers.into_iter().map(|(index, rank)| ChunkLocation { index, rank }).collect();
        out.push(desc);
    }
    Ok(out)
}

/// Every index of a grid, last dim fastest.
fn odometer(grid: &[usize]) -> impl Iterator<Item = Vec<usize>> + '_ {
    let total: usize = grid.iter().product();
    (0..total).map(move |mut k| {
        let mut index = vec![0; grid.len()];
        for d in (0..grid.len()).rev() {
            index[d] = k % grid[d].max(1);
            k /= grid[d].max(1);
        }
        index
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist_checkpoint::TensorRole;

    fn held(name: &str, mesh: &[usize], rank: usize, placement: Vec<Vec<usize>>) -> ShardedTensor {
        let at = DeviceMesh::new(mesh, rank).unwrap();
        let index = placement.iter().map(|a| at.chunk(a).unwrap().1).collect();
        ShardedTensor {
            name: name.into(),
            role: TensorRole::Param,
            shape: vec![4, 6],
            dtype: "f32".into(),
            placement,
            chunks: vec![ChunkLocation { index, rank }],
        }
    }

    fn table(mesh: &[usize], tensors: Vec<ShardedTensor>) -> RankTable {
        RankTable { mesh: mesh.to_vec(), step: 7, tensors }
    }

    #[test]
    fn encoding_round_trips_odd_lengths() {
        let t = table(&[2], vec![held("a.weight", &[2], 1, vec![vec![0], vec![]])]);
        let (words, len) = t.encode().unwrap();
        let mut padded = words.clone();
        padded.extend([0.0; 3]);
        assert_eq!(RankTable::decode(&padded, len, 1).unwrap(), t);
    }

    /// On an SPMD mesh the merged writers are `is_writer`'s; under a pipeline (the last axis)
    /// each stage's tensors are written by their own stage.
    #[test]
    fn writers_are_the_lowest_holders() {
        let mesh = [2, 2]; // dp2 × pp2: ranks 0,1 are dp 0 (stages 0,1), 2,3 dp 1
        let tables: Vec<RankTable> = (0..4)
            .map(|r| {
                let stage = r % 2;
                let name = if stage == 0 { "first.weight" } else { "last.weight" };
                // ZeRO-style: the optimizer's copy split over dp (axis 0).
                table(&mesh, vec![held(name, &mesh, r, vec![vec![0], vec![]])])
            })
            .collect();
        let merged = merge(&tables).unwrap();
        let chunks = |i: usize| -> Vec<(Vec<usize>, usize)> {
            merged[i].chunks.iter().map(|c| (c.index.clone(), c.rank)).collect()
        };
        assert_eq!(merged[0].name, "first.weight");
        assert_eq!(chunks(0), vec![(vec![0, 0], 0), (vec![1, 0], 2)]);
        assert_eq!(chunks(1), vec![(vec![0, 0], 1), (vec![1, 0], 3)]);
        // Replicated everywhere: rank 0, as `is_writer` says.
        let all: Vec<RankTable> = (0..4)
            .map(|r| table(&mesh, vec![held("w", &mesh, r, vec![vec![], vec![1]])]))
            .collect();
        let merged = merge(&all).unwrap();
        for c in &merged[0].chunks {
            let m = DeviceMesh::new(&mesh, c.rank).unwrap();
            assert!(m.is_writer(&merged[0].placement), "{c:?}");
        }
        assert_eq!(merged[0].chunks.len(), 2);
    }

    #[test]
    fn gaps_and_disagreements_are_named() {
        let mesh = [2];
        let only_rank0 = vec![
            table(&mesh, vec![held("a", &mesh, 0, vec![vec![0], vec![]])]),
            table(&mesh, vec![]),
        ];
        let e = merge(&only_rank0).unwrap_err().to_string();
        assert!(e.contains("tensor a") && e.contains("[[1, 0]]") && e.contains("no rank"), "{e}");
        let mut other = held("a", &mesh, 1, vec![vec![], vec![]]);
        other.dtype = "bf16".into();
        let clash = vec![
            table(&mesh, vec![held("a", &mesh, 0, vec![vec![], vec![]])]),
            table(&mesh, vec![other]),
        ];
        let e = merge(&clash).unwrap_err().to_string();
        assert!(e.contains("rank 1 disagrees with rank 0 on tensor a"), "{e}");
        let mut late = table(&mesh, vec![]);
        late.step = 8;
        let e = merge(&[table(&mesh, vec![]), late]).unwrap_err().to_string();
        assert!(e.contains("rank(s) 1 disagree with rank 0 on the step"), "{e}");
        let lying = vec![
            table(&mesh, vec![held("a", &mesh, 1, vec![vec![0], vec![]])]),
            table(&mesh, vec![held("a", &mesh, 1, vec![vec![0], vec![]])]),
        ];
        let e = merge(&lying).unwrap_err().to_string();
        assert!(e.contains("rank 0: tensor a claims"), "{e}");
    }
}
