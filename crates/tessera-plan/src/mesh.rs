//! Logical N-D device meshes. Devices are numbered node-major (`node · gpus_per_node + local`)
//! and a mesh of shape `[a0, a1, .., ak]` lays them out row-major, so the last axes vary
//! fastest and stay inside a node: an axis whose span (stride × size) fits in a node talks over
//! the intra-node link, any other over the inter-node link.

use crate::{Cluster, Link, PlanError, Result};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Mesh {
    pub shape: Vec<usize>,
    /// Axis names (`dp`, `tp`, or `a0`, `a1`, ..): for display only.
    pub axes: Vec<String>,
    /// The link each axis' collectives run over.
    pub links: Vec<Link>,
}

impl Mesh {
    /// Lays `shape` over the cluster. The product must equal the device count.
    pub fn new(cluster: &Cluster, shape: &[usize], names: &[&str]) -> Result<Mesh> {
        let n = shape.iter().try_fold(1usize, |n, &s| n.checked_mul(s));
        if n != Some(cluster.num_devices()) {
            let n = n.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string());
            return Err(PlanError::Invalid(format!(
                "mesh {shape:?} has {n} devices but the cluster has {}: the degrees must \
                 multiply to the device count",
                cluster.num_devices()
            )));
        }
        if shape.contains(&0) {
            return Err(PlanError::Invalid(format!("mesh {shape:?} has an axis of size 0")));
        }
        let mut links = Vec::with_capacity(shape.len());
        for i in 0..shape.len() {
            let stride: usize = shape[i + 1..].iter().product();
            let span = stride * shape[i];
            let intra = span <= cluster.gpus_per_node && cluster.gpus_per_node.is_multiple_of(span);
            links.push(if intra || cluster.nodes == 1 { cluster.intra } else { cluster.inter });
        }
        let axes = (0..shape.len())
            .map(|i| names.get(i).map_or_else(|| format!("a{i}"), |s| s.to_string()))
            .collect();
        Ok(Mesh { shape: shape.to_vec(), axes, links })
    }

    /// A mesh with explicit links (tests, hand-built meshes).
    pub fn with_links(shape: &[usize], links: Vec<Link>) -> Mesh {
        let axes = (0..shape.len()).map(|i| format!("a{i}")).collect();
        Mesh { shape: shape.to_vec(), axes, links }
    }

    /// Whether the two meshes are the same up to the order of their axes (same sizes over the
    /// same links): plans on one map onto the other by renaming axes.
    pub fn equivalent(&self, other: &Mesh) -> bool {
        let key = |m: &Mesh| {
            let mut k: Vec<(usize, u64, u64)> = m
                .shape
                .iter()
                .zip(&m.links)
                .map(|(&s, l)| (s, l.latency_s.to_bits(), l.bandwidth.to_bits()))
                .collect();
            k.sort_unstable();
            k
        };
        key(self) == key(other)
    }

    pub fn ndim(&self) -> usize {
        self.shape.len()
    }
    pub fn num_devices(&self) -> usize {
        self.shape.iter().product()
    }

    /// The mesh coordinate of a device (row-major).
    pub fn coords(&self, device: usize) -> Vec<usize> {
        let mut c = vec![0; self.shape.len()];
        let mut rest = device;
        for i in (0..self.shape.len()).rev() {
            c[i] = rest % self.shape[i];
            rest /= self.shape[i];
        }
        c
    }

    /// Every way to write `n` as an ordered product of at most `max_axes` factors > 1
    /// (`[n]` itself included; `[1]` for one device).
    pub fn factorizations(n: usize, max_axes: usize) -> Vec<Vec<usize>> {
        fn go(n: usize, left: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
            if n == 1 {
                if !cur.is_empty() {
                    out.push(cur.clone());
                }
                return;
            }
            if left == 0 {
                return;
            }
            for f in 2..=n {
                if n.is_multiple_of(f) {
                    cur.push(f);
                    go(n / f, left - 1, cur, out);
                    cur.pop();
                }
            }
        }
        if n == 1 {
            return vec![vec![1]];
        }
        let mut out = Vec::new();
        go(n, max_axes, &mut Vec::new(), &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meshes_equal_up_to_axis_order_only_within_a_node() {
        let node = Cluster::parse("8xH100").unwrap();
        let a = Mesh::new(&node, &[2, 4], &[]).unwrap();
        let b = Mesh::new(&node, &[4, 2], &[]).unwrap();
        assert!(a.equivalent(&b) && b.equivalent(&a));
        assert!(!a.equivalent(&Mesh::new(&node, &[8], &[]).unwrap()));
        // Across nodes the outer axis runs over the slower link: [2, 8] is not [8, 2].
        let two = Cluster::parse("2x8xH100").unwrap();
        let c = Mesh::new(&two, &[2, 8], &[]).unwrap();
        let d = Mesh::new(&two, &[8, 2], &[]).unwrap();
        assert!(!c.equivalent(&d));
    }
}
