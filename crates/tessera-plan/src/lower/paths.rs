//! Collective paths remembered over one lowering: a model's blocks repeat the same moves
//! (the same shapes between the same specs), and each search of the cheapest path
//! ([`cheapest_path`], Dijkstra over specs) was a tenth of a DeepSeek-V3 lowering. The path
//! depends on the mesh, the global shape, the element size and the two specs alone, so the
//! remembered answer is the one the search would give again.

use crate::reshard::{cheapest_path, ReshardPath};
use crate::{Mesh, Spec};
use std::collections::HashMap;

/// Paths found on one mesh, by (global shape, element bytes, from, to).
#[derive(Default)]
pub(crate) struct Paths(HashMap<(Vec<usize>, u64, Spec, Spec), Option<ReshardPath>>);

impl Paths {
    /// [`cheapest_path`] on `mesh` (the same mesh at every call on one `Paths`).
    pub(crate) fn get(
        &mut self,
        mesh: &Mesh,
        shape: &[usize],
        elem_bytes: u64,
        from: &Spec,
        to: &Spec,
    ) -> Option<ReshardPath> {
        let key = (shape.to_vec(), elem_bytes, from.clone(), to.clone());
        if let Some(p) = self.0.get(&key) {
            return p.clone();
        }
        let p = cheapest_path(mesh, shape, elem_bytes, from, to);
        self.0.insert(key, p.clone());
        p
    }
}
