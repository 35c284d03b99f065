//! The distributed optimizer section of a lowered training graph ([`UpdateHooks`]): gradient
//! synchronisation over data-parallel axes (all-reduce, or reduce-scatter under ZeRO-2),
//! optimizer state on ZeRO shards, the global gradient norm as a pending sum over the mesh,
//! and offload — optimizer state (and gradients, parameters) in a tier below the device, the
//! update on the host, the copies between tiers as `Transfer` nodes.

use super::ParamInfo;
use crate::offload::OffloadKind;
use crate::{Mesh, Spec};
use rustc_hash::FxHashMap as HashMap;
use tessera_ir::{Builder, Collective, CommStep, Op, ReshardSpec, TensorId, Tier, UpdateHooks};

/// Distributed optimizer section: gradient sync, ZeRO shards, global norm.
pub(crate) struct DistHooks<'a> {
    pub(crate) mesh: &'a Mesh,
    /// The pipeline axis: a stage's parameters live on its devices only, so their norm terms
    /// are not shared over it (and the total is summed over it like over any other axis).
    pub(crate) pipeline_axis: Option<usize>,
    pub(crate) zero: u8,
    pub(crate) params: HashMap<TensorId, ParamInfo>,
    /// Spec of each parameter's synchronised gradient.
    pub(crate) synced: HashMap<TensorId, Spec>,
    /// The plan's offload and the (local) parameters of its offloaded chunks, with the tier
    /// their optimizer state rests in.
    pub(crate) offload: Option<(crate::offload::Offload, HashMap<TensorId, Tier>)>,
}

impl DistHooks<'_> {
    fn steps(&self, axes: &[usize], op: Collective) -> Vec<CommStep> {
        axes.iter().map(|&a| CommStep { op, axis: a, size: self.mesh.shape[a] }).collect()
    }
    fn reshard(
        b: &mut Builder,
        x: TensorId,
        forward: Vec<CommStep>,
    ) -> tessera_ir::Result<TensorId> {
        if forward.is_empty() {
            return Ok(x);
        }
        b.push1(Op::Reshard(ReshardSpec { forward, backward: vec![] }), &[x])
    }
    /// ZeRO-1/2: the optimizer works on shards of a replicated parameter.
    fn shards_state(&self, info: &ParamInfo) -> bool {
        matches!(self.zero, 1 | 2) && !info.zero_axes.is_empty()
    }
    /// The offload kind when `param`'s chunk is offloaded.
    fn offloaded(&self, param: TensorId) -> Option<crate::offload::OffloadKind> {
        let (o, params) = self.offload.as_ref()?;
        params.contains_key(&param).then_some(o.kind)
    }
    /// Whether `param`'s optimizer state rests on the NVMe.
    fn on_nvme(&self, param: TensorId) -> bool {
        self.offload.as_ref().is_some_and(|(_, p)| p.get(&param) == Some(&Tier::Nvme))
    }
    fn transfer(
        b: &mut Builder,
        x: TensorId,
        from: Tier,
        to: Tier,
    ) -> tessera_ir::Result<TensorId> {
        b.push1(Op::Transfer { from, to }, &[x])
    }
}

impl UpdateHooks for DistHooks<'_> {
    fn sync_grad(
        &mut self,
        b: &mut Builder,
        param: TensorId,
        grad: TensorId,
    ) -> tessera_ir::Result<TensorId> {
        let Some(info) = self.params.get(&param) else { return Ok(grad) };
        let mut spec = info.stored.clone();
        let steps = if self.shards_state(info) {
            let zd = info.zero_dim;
            spec.dims[zd].extend(info.zero_axes.iter().copied());
            if self.zero == 2 {
                // Reduce-scattered over the ZeRO axes, all-reduced over the replica axes
                // (hybrid sharding) on the shard.
                let mut s = self.steps(&info.zero_axes, Collective::ReduceScatter { dim: zd });
                let rest: Vec<usize> =
                    info.pending.iter().copied().filter(|a| !info.zero_axes.contains(a)).collect();
                s.extend(self.steps(&rest, Collective::AllReduce));
                s
            } else {
                let mut s = self.steps(&info.pending, Collective::AllReduce);
                s.extend(self.steps(&info.zero_axes, Collective::Shard { dim: zd }));
                s
            }
        } else {
            self.steps(&info.pending, Collective::AllReduce)
        };
        self.synced.insert(param, spec);
        let synced = Self::reshard(b, grad, steps)?;
        match self.offloaded(param) {
            // Parameters on the host get their gradients there (the fetch's VJP).
            Some(OffloadKind::All) => Ok(synced),
            // Moved as soon as it is complete (the replay places it after the last
            // contribution), so the device never holds the chunk's gradients together.
            Some(kind) if kind.eager_grads() => Self::transfer(b, synced, Tier::Device, Tier::Host),
            _ => Ok(synced),
        }
    }

    fn update_grad(
        &mut self,
        b: &mut Builder,
        param: TensorId,
        grad: TensorId,
    ) -> tessera_ir::Result<TensorId> {
        match self.offloaded(param) {
            Some(kind) if !kind.eager_grads() => Self::transfer(b, grad, Tier::Device, Tier::Host),
            _ => Ok(grad),
        }
    }

    fn fetch_state(
        &mut self,
        b: &mut Builder,
        param: TensorId,
        state: TensorId,
    ) -> tessera_ir::Result<TensorId> {
        match self.on_nvme(param) {
            true => Self::transfer(b, state, Tier::Nvme, Tier::Host),
            false => Ok(state),
        }
    }

    fn store_state(
        &mut self,
        b: &mut Builder,
        param: TensorId,
        fetched: TensorId,
    ) -> tessera_ir::Result<Option<TensorId>> {
        match self.on_nvme(param) {
            true => Self::transfer(b, fetched, Tier::Host, Tier::Nvme).map(Some),
            false => Ok(None),
        }
    }

    fn state_tier(&mut self, param: TensorId) -> Tier {
        self.offload.as_ref().and_then(|(_, p)| p.get(&param).copied()).unwrap_or_default()
    }

    fn update_target(&mut self, b: &mut Builder, param: TensorId) -> tessera_ir::Result<TensorId> {
        let Some(info) = self.params.get(&param) else { return Ok(param) };
        let sharded = self.shards_state(info);
        if self.offloaded(param).is_some_and(|k| k != OffloadKind::All) {
            let mut shape = b.shape(param).dims().to_vec();
            if sharded {
                let k: usize = info.zero_axes.iter().map(|&a| self.mesh.shape[a]).product();
                shape[info.zero_dim] /= k;
            }
            let dtype = b.dtype(param);
            if dtype == tessera_ir::DType::BF16 {
                // The host AdamW writes the whole weight from its fp32 master and reads
                // nothing of it (bf16 skips no step): a host buffer to write into, and no
                // copy down.
                b.set_leaf_tier(Tier::Host);
                let t = b.fill(0.0, shape, dtype);
                b.set_leaf_tier(Tier::Device);
                return t;
            }
            // fp32 (the weight is the optimizer's state) and fp16 (a skipped step keeps it):
            // the host updates a copy of the weight, or of its ZeRO shard.
            let steps = if sharded {
                self.steps(&info.zero_axes, Collective::Shard { dim: info.zero_dim })
            } else {
                Vec::new()
            };
            let local = Self::reshard(b, param, steps)?;
            return Self::transfer(b, local, Tier::Device, Tier::Host);
        }
        if !sharded {
            return Ok(param);
        }
        let steps = self.steps(&info.zero_axes, Collective::Shard { dim: info.zero_dim });
        Self::reshard(b, param, steps)
    }

    fn norm_term(
        &mut self,
        b: &mut Builder,
        param: TensorId,
        sumsq: TensorId,
    ) -> tessera_ir::Result<TensorId> {
        // Σg² of a shard is a pending sum over the axes the gradient is split on; on the others
        // every device holds the same value: count it once by scaling.
        let Some(spec) = self.synced.get(&param) else { return Ok(sumsq) };
        let k: usize = (0..self.mesh.ndim())
            .filter(|&a| !spec.uses_axis(a) && Some(a) != self.pipeline_axis)
            .map(|a| self.mesh.shape[a])
            .product();
        if k == 1 {
            return Ok(sumsq);
        }
        let s = b.scalar_like(1.0 / k as f64, sumsq)?;
        b.mul(sumsq, s)
    }

    fn norm_total(&mut self, b: &mut Builder, total: TensorId) -> tessera_ir::Result<TensorId> {
        let axes: Vec<usize> = (0..self.mesh.ndim()).filter(|&a| self.mesh.shape[a] > 1).collect();
        let steps = self.steps(&axes, Collective::AllReduce);
        Self::reshard(b, total, steps)
    }

    fn after_update(
        &mut self,
        b: &mut Builder,
        param: TensorId,
        target: TensorId,
    ) -> tessera_ir::Result<Option<TensorId>> {
        let Some(info) = self.params.get(&param) else { return Ok(None) };
        let sharded = self.shards_state(info);
        // An offloaded update comes back to the device (then gathers like any ZeRO shard); a
        // host-resident parameter is updated where it rests.
        let target = match self.offloaded(param) {
            Some(OffloadKind::All) if !sharded => return Ok(None),
            Some(OffloadKind::All) => target,
            Some(_) => Self::transfer(b, target, Tier::Host, Tier::Device)?,
            None if !sharded => return Ok(None),
            None => target,
        };
        if !sharded {
            return Ok(Some(target));
        }
        let mut axes = info.zero_axes.clone();
        axes.reverse();
        let steps = self.steps(&axes, Collective::AllGather { dim: info.zero_dim });
        Self::reshard(b, target, steps).map(Some)
    }
}
