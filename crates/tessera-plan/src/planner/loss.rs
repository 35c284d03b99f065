//! The chunked loss's hook into the planner's entry points ([`crate::loss_chunk`]): a request
//! whose graph builder fuses the LM head and its loss, so every phase — the flat search, the
//! pipeline phase, the plan's lowering — builds the fused graph.

use super::Request;
use crate::search::Forward;
use crate::Result;

impl Request<'_> {
    /// This request with another forward graph builder (the chunked loss's, [`with_loss`]).
    pub fn with_build<'b>(
        &self,
        build: &'b (dyn Fn(usize) -> Result<Forward> + Sync),
    ) -> Request<'b> {
        Request {
            build,
            model: self.model.clone(),
            batch: self.batch,
            seq: self.seq,
            dtype: self.dtype,
            cluster: self.cluster.clone(),
            budget: self.budget,
            train: self.train.clone(),
            model_flops: self.model_flops,
            ckpt: self.ckpt.clone(),
            pipeline: self.pipeline.clone(),
            search: self.search.clone(),
        }
    }

    /// What the chunked loss's choice reads ([`crate::loss_chunk::choose`]).
    pub(super) fn loss_problem(&self) -> crate::loss_chunk::Problem<'_> {
        crate::loss_chunk::Problem {
            build: self.build,
            batch: self.batch,
            devices: self.cluster.num_devices(),
            budget: self.budget,
        }
    }
}

/// Runs `f` on `req` with its forward graphs' head and loss fused in chunks of `rows`
/// ([`crate::loss_chunk`]), or on `req` itself when `rows` is `None`.
pub fn with_loss<T>(
    req: &Request<'_>,
    rows: Option<usize>,
    f: impl FnOnce(&Request<'_>) -> Result<T>,
) -> Result<T> {
    match rows {
        None => f(req),
        Some(rows) => {
            let build = |mb: usize| crate::loss_chunk::build_with(req.build, Some(rows), mb);
            f(&req.with_build(&build))
        }
    }
}
