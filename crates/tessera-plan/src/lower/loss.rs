//! The loss in the local forward graph: Megatron-LM's vocabulary-parallel cross-entropy, and
//! a row-split loss's share of the mean.
//!
//! When a strategy splits the logits' classes, no device sees a whole row, and a row's loss
//! `logsumexp(row) − row[target]` needs the log-sum-exp over every class. Each device takes
//! its shard's log-sum-exp per row ([`Op::LogSumExp`]), the shards all-gather them (one f32 per
//! row and shard — the logits never move) and every device combines the same numbers in the
//! same order into the row's log-sum-exp, bit for bit alike. The loss op then adds
//! `−row[target]` on the shard holding the target and the log-sum-exp on the shard holding
//! class 0 ([`Op::CrossEntropy`]'s `classes`): the shards' losses are a pending sum, which the
//! strategy's output spec already says. Its backward (`softmax − onehot` of the local
//! columns, from the global log-sum-exp) is the whole derivative, so no gradient flows back
//! through the gather.

use super::{internal, LocalForward};
use crate::reshard::cheapest_path;
use crate::rules::Strategy;
use crate::{PlanError, Result, Spec};
use tessera_ir::dist::ShardOf;
use tessera_ir::{Node, Op, ReshardSpec, TensorId};

impl LocalForward<'_> {
    /// Completes a cross-entropy's local op and inputs for its strategy: with its classes
    /// split, the shard's `classes` and the global log-sum-exp as a third input.
    pub(super) fn vocab_parallel_loss(
        &mut self,
        node: &Node,
        st: &Strategy,
        op: &mut Op,
        inputs: &mut Vec<TensorId>,
    ) -> Result<()> {
        let Op::CrossEntropy { classes, .. } = op else { return Ok(()) };
        let class_axes = st.inputs[0].dims.last().cloned().unwrap_or_default();
        if class_axes.iter().all(|&a| self.mesh.shape[a] == 1) {
            return Ok(());
        }
        let logits = self.g.meta(node.inputs[0]);
        let vocab = logits.shape.dims().last().copied().unwrap_or(0);
        *classes = Some(ShardOf {
            global: vec![vocab],
            placement: vec![class_axes.clone()],
            micro_batch: 0,
        });
        // Each shard's log-sum-exp per row, as [rows.., 1] split over the class axes.
        let local = self.b.push1(Op::LogSumExp, &[inputs[0]]).map_err(internal)?;
        let mut keep = self.b.shape(local).dims().to_vec();
        keep.push(1);
        let local = self.b.reshape(local, keep).map_err(internal)?;
        // Gathered whole over the class axes (the rows stay as the targets are split).
        let rows = &st.inputs[1];
        let shards: usize = class_axes.iter().map(|&a| self.mesh.shape[a]).product();
        let mut global = self.g.meta(node.inputs[1]).shape.dims().to_vec();
        global.push(shards);
        let mut have = Spec { dims: rows.dims.clone(), partial: Vec::new() };
        have.dims.push(class_axes);
        let mut want = have.clone();
        if let Some(last) = want.dims.last_mut() {
            last.clear();
        }
        let path = cheapest_path(self.mesh, &global, 4, &have, &want).ok_or_else(|| {
            PlanError::Internal(format!(
                "no collective path from {have} to {want} for the loss's log-sum-exp"
            ))
        })?;
        let spec = ReshardSpec { forward: path.steps, backward: Vec::new() };
        let gathered = self.b.push1(Op::Reshard(spec), &[local]).map_err(internal)?;
        let lse = self.b.push1(Op::LogSumExp, &[gathered]).map_err(internal)?;
        inputs.push(lse);
        Ok(())
    }

    /// The factor that turns a cross-entropy mean over this device's rows into its share of
    /// the global mean over all rows of all micro-batches (1 for a sum, whose shards and
    /// micro-batches add up to the whole): the shards splitting the rows, times the
    /// micro-batches. (Shards of the classes hold the same rows: their losses add up.)
    pub(super) fn loss_share(&self, op: &Op, st: &Strategy) -> usize {
        if !matches!(op, Op::CrossEntropy { sum: false, .. }) {
            return 1;
        }
        let row_shards: usize =
            st.inputs[1].dims.iter().flatten().map(|&a| self.mesh.shape[a]).product();
        row_shards * self.micro_batches
    }
}
