//! Groups of ranks: the participants of one collective.
//!
//! A group is a sorted, duplicate-free, non-empty list of global ranks. Its order is the order
//! collectives use: member `k` (the k-th smallest rank) owns chunk `k` of a reduce-scatter, is
//! the k-th block of an all-gather, and is the k-th term of every sum.
//!
//! Meshes are laid out row-major (last axis fastest), so the group along one axis of a
//! `[2, 4]` mesh is a row (`[4, 5, 6, 7]`, axis 1) or a column (`[1, 5]`, axis 0).

use std::fmt;
use std::sync::Arc;

use crate::error::{CommError, Result};

/// A sorted, duplicate-free, non-empty set of global ranks. Cheap to clone (shared storage).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Group {
    ranks: Arc<[usize]>,
}

impl Group {
    /// A group of `ranks`, in any order; sorted and deduplicated. Fails if empty.
    pub fn new(ranks: impl IntoIterator<Item = usize>) -> Result<Group> {
        let mut ranks: Vec<usize> = ranks.into_iter().collect();
        ranks.sort_unstable();
        ranks.dedup();
        if ranks.is_empty() {
            return Err(CommError::InvalidGroup("a group needs at least one rank".into()));
        }
        Ok(Group { ranks: ranks.into() })
    }

    /// All ranks `0..n`. Fails if `n == 0`.
    pub fn world(n: usize) -> Result<Group> {
        if n == 0 {
            return Err(CommError::InvalidGroup("a world needs at least one rank".into()));
        }
        Group::new(0..n)
    }

    /// The ranks that share every mesh coordinate of `rank` except the one along `axis`
    /// (row-major layout, last axis fastest). Includes `rank`; has `shape[axis]` members.
    pub fn mesh_axis(shape: &[usize], axis: usize, rank: usize) -> Result<Group> {
        Group::mesh_axes(shape, &[axis], rank)
    }

    /// The ranks that share every mesh coordinate of `rank` except those along `axes`: the group
    /// of a collective over several mesh axes at once (e.g. data parallelism over two axes).
    /// Group order is rank order, which is row-major over the chosen axes in mesh order. An
    /// empty `axes` gives the singleton group of `rank`.
    pub fn mesh_axes(shape: &[usize], axes: &[usize], rank: usize) -> Result<Group> {
        let coords = mesh_coords(shape, rank)?;
        for (i, &a) in axes.iter().enumerate() {
            if a >= shape.len() {
                return Err(CommError::InvalidArgument(format!(
                    "mesh axis {a} is out of range for a mesh of shape {shape:?} ({} axes)",
                    shape.len()
                )));
            }
            if axes[..i].contains(&a) {
                return Err(CommError::InvalidArgument(format!(
                    "mesh axis {a} is listed twice in {axes:?}"
                )));
            }
        }
        let strides = mesh_strides(shape);
        // Start from `rank` with its coordinate zeroed along every chosen axis, then fan out
        // along each axis in turn; coordinates < shape[a], so nothing leaves the mesh.
        let mut base = rank;
        for &a in axes {
            base -= coords[a] * strides[a];
        }
        let mut ranks = vec![base];
        for &a in axes {
            let (size, stride) = (shape[a], strides[a]);
            ranks = ranks.iter().flat_map(|&r| (0..size).map(move |j| r + j * stride)).collect();
        }
        Group::new(ranks)
    }

    /// The member ranks, ascending.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// Number of members (at least 1).
    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    /// Always false (groups are non-empty); present because `len` is.
    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    /// Whether `rank` is a member.
    pub fn contains(&self, rank: usize) -> bool {
        self.index_of(rank).is_some()
    }

    /// The position of `rank` in the group (its chunk index), if it is a member.
    pub fn index_of(&self, rank: usize) -> Option<usize> {
        self.ranks.binary_search(&rank).ok()
    }
}

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.ranks())
    }
}

/// Row-major strides of `shape` (last axis has stride 1). Assumes a validated shape.
fn mesh_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

/// Number of devices in a mesh of `shape`, after checking the shape is usable.
pub fn mesh_size(shape: &[usize]) -> Result<usize> {
    if shape.is_empty() || shape.contains(&0) {
        return Err(CommError::InvalidArgument(format!(
            "mesh shape {shape:?} must have at least one axis and no zero-sized axis"
        )));
    }
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| {
        CommError::InvalidArgument(format!("mesh shape {shape:?} has too many devices"))
    })
}

/// The mesh coordinates of `rank` (row-major, last axis fastest).
pub fn mesh_coords(shape: &[usize], rank: usize) -> Result<Vec<usize>> {
    let size = mesh_size(shape)?;
    if rank >= size {
        return Err(CommError::InvalidArgument(format!(
            "rank {rank} is outside a mesh of shape {shape:?} ({size} devices)"
        )));
    }
    let mut rest = rank;
    let mut coords = vec![0; shape.len()];
    for i in (0..shape.len()).rev() {
        coords[i] = rest % shape[i];
        rest /= shape[i];
    }
    Ok(coords)
}

/// The rank at mesh coordinates `coords` (row-major, last axis fastest).
pub fn mesh_rank(shape: &[usize], coords: &[usize]) -> Result<usize> {
    mesh_size(shape)?;
    if coords.len() != shape.len() || coords.iter().zip(shape).any(|(c, d)| c >= d) {
        return Err(CommError::InvalidArgument(format!(
            "coordinates {coords:?} are outside a mesh of shape {shape:?}"
        )));
    }
    Ok(coords.iter().zip(mesh_strides(shape)).map(|(c, s)| c * s).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn axis(shape: &[usize], axis: usize, rank: usize) -> Vec<usize> {
        Group::mesh_axis(shape, axis, rank).expect("valid mesh axis").ranks().to_vec()
    }

    #[test]
    fn new_sorts_dedups_and_rejects_empty() {
        let g = Group::new([3, 1, 3, 0]).expect("non-empty");
        assert_eq!(g.ranks(), &[0, 1, 3]);
        assert_eq!((g.len(), g.is_empty()), (3, false));
        assert_eq!(g.index_of(3), Some(2));
        assert_eq!(g.index_of(2), None);
        assert!(g.contains(1) && !g.contains(2));
        assert_eq!(g.to_string(), "[0, 1, 3]");
        assert!(matches!(Group::new([]), Err(CommError::InvalidGroup(_))));
        assert!(matches!(Group::world(0), Err(CommError::InvalidGroup(_))));
        assert_eq!(Group::world(3).expect("n > 0").ranks(), &[0, 1, 2]);
    }

    #[test]
    fn mesh_axis_of_a_line_is_the_world() {
        for r in 0..4 {
            assert_eq!(axis(&[4], 0, r), vec![0, 1, 2, 3]);
        }
    }

    #[test]
    fn mesh_axis_of_2x4_gives_rows_and_columns() {
        // Layout: row 0 = ranks 0..4, row 1 = ranks 4..8.
        for r in 0..8 {
            let row = if r < 4 { vec![0, 1, 2, 3] } else { vec![4, 5, 6, 7] };
            assert_eq!(axis(&[2, 4], 1, r), row, "row of rank {r}");
            assert_eq!(axis(&[2, 4], 0, r), vec![r % 4, r % 4 + 4], "column of rank {r}");
        }
    }

    #[test]
    fn mesh_axis_of_2x2x2_varies_one_coordinate() {
        // rank = 4*x + 2*y + z.
        assert_eq!(axis(&[2, 2, 2], 0, 0), vec![0, 4]);
        assert_eq!(axis(&[2, 2, 2], 1, 0), vec![0, 2]);
        assert_eq!(axis(&[2, 2, 2], 2, 0), vec![0, 1]);
        assert_eq!(axis(&[2, 2, 2], 0, 7), vec![3, 7]);
        assert_eq!(axis(&[2, 2, 2], 1, 7), vec![5, 7]);
        assert_eq!(axis(&[2, 2, 2], 2, 7), vec![6, 7]);
        assert_eq!(axis(&[2, 2, 2], 1, 5), vec![5, 7]);
        // Every rank is in exactly one group per axis, and groups along an axis partition the
        // world: check against a brute-force definition through coordinates.
        for a in 0..3 {
            for r in 0..8 {
                let cr = mesh_coords(&[2, 2, 2], r).expect("in mesh");
                let expected: Vec<usize> = (0..8)
                    .filter(|&q| {
                        let cq = mesh_coords(&[2, 2, 2], q).expect("in mesh");
                        (0..3).all(|i| i == a || cq[i] == cr[i])
                    })
                    .collect();
                assert_eq!(axis(&[2, 2, 2], a, r), expected, "axis {a}, rank {r}");
            }
        }
    }

    #[test]
    fn mesh_axes_spans_several_axes() {
        let g = Group::mesh_axes(&[2, 2, 2], &[0, 2], 2).expect("valid");
        assert_eq!(g.ranks(), &[2, 3, 6, 7]);
        let g = Group::mesh_axes(&[2, 4], &[], 5).expect("valid");
        assert_eq!(g.ranks(), &[5]);
        let g = Group::mesh_axes(&[2, 4], &[1, 0], 5).expect("valid");
        assert_eq!(g.ranks(), &[0, 1, 2, 3, 4, 5, 6, 7]);
    }

    #[test]
    fn coords_and_rank_round_trip() {
        for r in 0..24 {
            let c = mesh_coords(&[2, 3, 4], r).expect("in mesh");
            assert_eq!(mesh_rank(&[2, 3, 4], &c).expect("in mesh"), r);
        }
        assert_eq!(mesh_coords(&[2, 3, 4], 23).expect("in mesh"), vec![1, 2, 3]);
    }

    #[test]
    fn bad_meshes_are_errors_not_panics() {
        assert!(Group::mesh_axis(&[], 0, 0).is_err());
        assert!(Group::mesh_axis(&[2, 0], 0, 0).is_err());
        assert!(Group::mesh_axis(&[2, 4], 2, 0).is_err());
        assert!(Group::mesh_axis(&[2, 4], 0, 8).is_err());
        assert!(Group::mesh_axes(&[2, 4], &[1, 1], 0).is_err());
        assert!(Group::mesh_axis(&[usize::MAX, 3], 0, 0).is_err());
        assert!(mesh_rank(&[2, 4], &[1, 4]).is_err());
        assert!(mesh_rank(&[2, 4], &[1]).is_err());
    }
}
