//! Sharding specs: how one tensor is laid out over a mesh.
//!
//! Each tensor dim is split over an ordered list of mesh axes (major to minor: with axes
//! `[0, 1]` the shard index is `c0 · n1 + c1`), or over none (replicated). Axes in `partial`
//! hold a pending sum: the true value is the sum over that axis of the local values. An axis
//! appears at most once in a spec. Written like the literature: `[R, S01, R]`, with a pending
//! sum as a suffix, `[S0, R] P1`.

use crate::Mesh;
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Spec {
    /// Per tensor dim, the mesh axes it is split over (major to minor).
    pub dims: Vec<Vec<usize>>,
    /// Mesh axes over which the value is a pending sum, ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partial: Vec<usize>,
}

impl Spec {
    /// Fully replicated, for a tensor of `rank` dims.
    pub fn replicated(rank: usize) -> Spec {
        Spec { dims: vec![Vec::new(); rank], partial: Vec::new() }
    }

    /// Replicated except `dim`, split over `axes`.
    pub fn sharded(rank: usize, dim: usize, axes: &[usize]) -> Spec {
        let mut s = Spec::replicated(rank);
        s.dims[dim] = axes.to_vec();
        s
    }

    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// Every mesh axis this spec uses (for a dim or a pending sum).
    pub fn used_axes(&self) -> impl Iterator<Item = usize> + '_ {
        self.dims.iter().flatten().copied().chain(self.partial.iter().copied())
    }

    pub fn uses_axis(&self, axis: usize) -> bool {
        self.used_axes().any(|a| a == axis)
    }

    /// The dim split over `axis`, if any.
    pub fn dim_of_axis(&self, axis: usize) -> Option<usize> {
        self.dims.iter().position(|d| d.contains(&axis))
    }

    pub fn is_replicated(&self) -> bool {
        self.used_axes().next().is_none()
    }

    /// Number of shards of `dim`.
    pub fn shards(&self, mesh: &Mesh, dim: usize) -> usize {
        self.dims[dim].iter().map(|&a| mesh.shape[a]).product()
    }

    /// The per-device shape, or `None` when a dim does not divide evenly or the spec is not
    /// valid on this mesh and shape (wrong rank, an axis out of range or used twice).
    pub fn local_shape(&self, mesh: &Mesh, shape: &[usize]) -> Option<Vec<usize>> {
        if !self.is_valid(mesh, shape.len()) {
            return None;
        }
        let mut out = Vec::with_capacity(shape.len());
        for (d, &n) in shape.iter().enumerate() {
            let k = self.shards(mesh, d);
            if n % k != 0 {
                return None;
            }
            out.push(n / k);
        }
        Some(out)
    }

    /// Elements each device holds (0 when the layout is impossible).
    pub fn local_numel(&self, mesh: &Mesh, shape: &[usize]) -> u64 {
        self.local_shape(mesh, shape).map_or(0, |s| s.iter().map(|&d| d as u64).product())
    }

    pub fn is_valid(&self, mesh: &Mesh, rank: usize) -> bool {
        if self.dims.len() != rank {
            return false;
        }
        let mut seen = vec![false; mesh.ndim()];
        for a in self.used_axes() {
            if a >= mesh.ndim() || seen[a] {
                return false;
            }
            seen[a] = true;
        }
        self.partial.windows(2).all(|w| w[0] < w[1])
    }

    /// Parses the printed form, e.g. `[R, S01, R]` or `[S0, R] P1` (axes are single digits).
    pub fn parse(s: &str) -> Option<Spec> {
        let s = s.trim();
        let (body, rest) = s.strip_prefix('[')?.split_once(']')?;
        let mut dims = Vec::new();
        for tok in body.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            if tok == "R" {
                dims.push(Vec::new());
            } else {
                let axes = tok.strip_prefix('S')?;
                dims.push(
                    axes.chars()
                        .map(|c| c.to_digit(10).map(|d| d as usize))
                        .collect::<Option<_>>()?,
                );
            }
        }
        let rest = rest.trim();
        let partial = if rest.is_empty() {
            Vec::new()
        } else {
            let mut p: Vec<usize> = rest
                .strip_prefix('P')?
                .chars()
                .map(|c| c.to_digit(10).map(|d| d as usize))
                .collect::<Option<_>>()?;
            p.sort_unstable();
            p
        };
        Some(Spec { dims, partial })
    }
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            if d.is_empty() {
                write!(f, "R")?;
            } else {
                write!(f, "S")?;
                for a in d {
                    write!(f, "{a}")?;
                }
            }
        }
        write!(f, "]")?;
        if !self.partial.is_empty() {
            write!(f, " P")?;
            for a in &self.partial {
                write!(f, "{a}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Link;

    fn mesh(shape: &[usize]) -> Mesh {
        Mesh::with_links(shape, vec![Link { latency_s: 1e-6, bandwidth: 1e11 }; shape.len()])
    }

    #[test]
    fn print_parse_round_trip() {
        for s in ["[R, S01, R]", "[S0, R] P1", "[R]", "[S10, S2] P3"] {
            assert_eq!(Spec::parse(s).unwrap().to_string(), s);
        }
        assert!(Spec::parse("[X]").is_none());
    }

    #[test]
    fn local_shapes_divide_or_fail() {
        let m = mesh(&[2, 4]);
        let s = Spec::parse("[S01, R]").unwrap();
        assert_eq!(s.local_shape(&m, &[16, 3]), Some(vec![2, 3]));
        assert_eq!(s.local_shape(&m, &[12, 3]), None);
        // An axis used twice is not a layout.
        assert_eq!(Spec::parse("[S0, S0]").unwrap().local_shape(&m, &[4, 4]), None);
        assert_eq!(Spec::parse("[S0, R] P0").unwrap().local_shape(&m, &[4, 4]), None);
    }
}
