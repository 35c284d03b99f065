//! Logical N-D device meshes. Devices are numbered node-major (`node · gpus_per_node + local`)
//! and a mesh of shape `[a0, a1, .., ak]` lays them out row-major, so the last axes vary
//! fastest and stay inside a node: an axis whose span (stride × size) fits in a node talks over
//! the intra-node link only. An axis that spans nodes has its members on several nodes, `k` of
//! them on each ([`AxisLink::per_node`]): its collectives move bytes at the inter-node link's
//! bandwidth per device, and pay the network's latency only for the ring steps between nodes,
//! the intra-node link's for the others, as NCCL's own tuning model counts them (see
//! [`crate::reshard::collective_time`]). Charging every one of a 512-member ring's 511 steps
//! the network's latency made a data-parallel step on 64 nodes slower than measured.

use crate::{Cluster, Link, PlanError, Result};
use serde::{Deserialize, Serialize};

/// The links one mesh axis's collectives run over.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AxisLink {
    /// Between members of the axis on one node.
    pub intra: Link,
    /// Between nodes, per device.
    pub inter: Link,
    /// Members of one group on each node: the axis size when the axis fits in a node (only
    /// `intra` is used), 1 when every member sits on its own node, in between for an axis that
    /// spans nodes with several members on each.
    pub per_node: usize,
}

impl AxisLink {
    /// One level: every member talks to the others over `link`.
    pub fn uniform(link: Link) -> AxisLink {
        AxisLink { intra: link, inter: link, per_node: 1 }
    }

    /// The link a point-to-point message between two members may cross: the slowest of the
    /// axis (a pipeline's stages exchange activations with their neighbours one at a time).
    pub fn p2p(&self, size: usize) -> Link {
        if self.per_node >= size {
            self.intra
        } else {
            self.inter
        }
    }
}

/// An axis the planner lays out, by what it splits. Its spelling (`dp`, `tp`, ..) is the
/// axis's name in [`Mesh::axes`], plan files and `--explain`; a mesh may also have unnamed
/// axes (`a0`, `a1`, ..: the automatic search's) or names read from a plan file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AxisName {
    /// Hybrid sharding's replica groups (`shard=N`): data-parallel, ZeRO replicated across.
    Replica,
    /// Data parallelism: the batch.
    Data,
    /// Context parallelism: the sequence (and attention's heads, [`crate::context`]).
    Context,
    /// Expert parallelism: the batch, and the experts of the experts' ops
    /// ([`crate::expert`]).
    Expert,
    /// Tensor parallelism: Megatron-style column and row splits.
    Tensor,
    /// Pipeline parallelism: the stages.
    Pipeline,
}

impl AxisName {
    /// The name as a mesh spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            AxisName::Replica => "replica",
            AxisName::Data => "dp",
            AxisName::Context => "cp",
            AxisName::Expert => "ep",
            AxisName::Tensor => "tp",
            AxisName::Pipeline => "pp",
        }
    }
}

impl std::fmt::Display for AxisName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Mesh {
    pub shape: Vec<usize>,
    /// Axis names (`dp`, `tp`, or `a0`, `a1`, ..): for display only.
    pub axes: Vec<String>,
    /// The links each axis' collectives run over.
    pub links: Vec<AxisLink>,
    /// Data-parallel axes whose groups each hold a whole replica of the ZeRO-sharded state
    /// (hybrid sharding's replicate axis, `shard=N`): ZeRO shards over the other
    /// data-parallel axes only, and gradients are all-reduced over these. Empty: ZeRO shards
    /// over every data-parallel axis.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<usize>,
    /// Whether the context-parallel axis (`cp`) runs ring attention (`cp=ring`: K/V blocks
    /// passed around the axis, [`crate::context`]) rather than the all-to-all.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ring: bool,
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
        let gpn = cluster.gpus_per_node;
        let mut links = Vec::with_capacity(shape.len());
        for i in 0..shape.len() {
            let stride: usize = shape[i + 1..].iter().product();
            let span = stride * shape[i];
            let intra = span <= gpn && gpn.is_multiple_of(span);
            // Members per node of an axis spanning nodes: a group's members sit `stride`
            // apart, so `gpn / stride` of them share a node when the stride divides the node
            // (and that count divides the axis); otherwise price the axis as one member per
            // node (a flat ring over the inter-node link, the slower bound).
            let per_node = if intra || cluster.nodes == 1 {
                shape[i]
            } else if stride < gpn
                && gpn.is_multiple_of(stride)
                && shape[i].is_multiple_of(gpn / stride)
            {
                gpn / stride
            } else {
                1
            };
            links.push(AxisLink { intra: cluster.intra, inter: cluster.inter, per_node });
        }
        let axes = (0..shape.len())
            .map(|i| names.get(i).map_or_else(|| format!("a{i}"), |s| s.to_string()))
            .collect();
        Ok(Mesh { shape: shape.to_vec(), axes, links, replicas: Vec::new(), ring: false })
    }

    /// [`Mesh::new`] with the planner's axis names.
    pub fn named(cluster: &Cluster, shape: &[usize], names: &[AxisName]) -> Result<Mesh> {
        let names: Vec<&str> = names.iter().map(|n| n.as_str()).collect();
        Mesh::new(cluster, shape, &names)
    }

    /// The axis named `name`, if the mesh has one.
    pub fn axis(&self, name: AxisName) -> Option<usize> {
        self.axes.iter().position(|a| a == name.as_str())
    }

    /// A mesh with one explicit link per axis (tests, hand-built meshes).
    pub fn with_links(shape: &[usize], links: Vec<Link>) -> Mesh {
        Mesh::with_axis_links(shape, links.into_iter().map(AxisLink::uniform).collect())
    }

    /// A mesh with explicit axis links.
    pub fn with_axis_links(shape: &[usize], links: Vec<AxisLink>) -> Mesh {
        let axes = (0..shape.len()).map(|i| format!("a{i}")).collect();
        Mesh { shape: shape.to_vec(), axes, links, replicas: Vec::new(), ring: false }
    }

    /// The mesh with `axes` as replica axes (see [`Mesh::replicas`]).
    pub fn with_replicas(mut self, axes: &[usize]) -> Mesh {
        self.replicas = axes.to_vec();
        self
    }

    /// The mesh with its context-parallel axis running ring attention when `ring`.
    pub fn with_ring(mut self, ring: bool) -> Mesh {
        self.ring = ring;
        self
    }

    /// Whether the two meshes are the same up to the order of their axes (same sizes over the
    /// same links): plans on one map onto the other by renaming axes.
    pub fn equivalent(&self, other: &Mesh) -> bool {
        let key = |m: &Mesh| {
            let bits = |l: &Link| [l.latency_s.to_bits(), l.bandwidth.to_bits()];
            let mut k: Vec<[u64; 7]> = m
                .shape
                .iter()
                .zip(&m.links)
                .enumerate()
                .map(|(i, (&s, l))| {
                    let [a, b] = bits(&l.intra);
                    let [c, d] = bits(&l.inter);
                    let replica = m.replicas.contains(&i) as u64;
                    [s as u64, l.per_node.min(s) as u64, a, b, c, d, replica]
                })
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

    #[test]
    fn an_axis_spanning_nodes_knows_its_members_per_node() {
        let two = Cluster::parse("2x8xH100").unwrap();
        let per_node = |shape: &[usize]| -> Vec<usize> {
            Mesh::new(&two, shape, &[]).unwrap().links.iter().map(|l| l.per_node).collect()
        };
        // 16 data-parallel ranks: 8 on each node. [2, 8]: one per node, then 8 in a node.
        assert_eq!(per_node(&[16, 1]), vec![8, 1]);
        assert_eq!(per_node(&[2, 8]), vec![1, 8]);
        // dp4 × tp4: a dp group's members sit 4 apart, 2 on each node.
        assert_eq!(per_node(&[4, 4]), vec![2, 4]);
        // A stride the node size does not divide: priced as one member per node.
        let three = Cluster::parse("2x6xH100").unwrap();
        let m = Mesh::new(&three, &[3, 4], &[]).unwrap();
        assert_eq!(m.links[0].per_node, 1);
        // One node: everything intra.
        let one = Cluster::parse("8xH100").unwrap();
        let m = Mesh::new(&one, &[8], &[]).unwrap();
        assert_eq!((m.links[0].per_node, m.links[0].p2p(8)), (8, one.intra));
        assert_eq!(Mesh::new(&two, &[16, 1], &[]).unwrap().links[0].p2p(16), two.inter);
    }
}
