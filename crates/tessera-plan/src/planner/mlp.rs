//! The tiled MLP's hook into the planner's entry points ([`crate::mlp_tile`]): a request
//! whose graph builder tiles each block's MLP, so every phase — the flat search, the pipeline
//! phase, the plan's lowering — builds the tiled graph. Applied inside the chunked loss's
//! hook ([`super::with_loss`]); the two rewrites touch disjoint ops.

use super::Request;
use crate::config::{MlpMode, ParallelConfig};
use crate::plan::Plan;
use crate::Result;

impl Request<'_> {
    /// What the tiled MLP's choice reads ([`crate::mlp_tile::choose`]).
    pub(super) fn mlp_problem(&self) -> crate::mlp_tile::Problem<'_> {
        let devices = self.cluster.num_devices().min(self.cluster.gpus_per_node);
        crate::mlp_tile::Problem {
            build: self.build,
            node_devices: devices,
            budget: self.budget,
            runnable: self.search.tiled_mlp,
        }
    }
}

/// Runs `f` on `req` with its forward graphs' MLPs tiled at `rows` rows per tile
/// ([`crate::mlp_tile`]), or on `req` itself when `rows` is `None`.
pub fn with_mlp<T>(
    req: &Request<'_>,
    rows: Option<usize>,
    f: impl FnOnce(&Request<'_>) -> Result<T>,
) -> Result<T> {
    match rows {
        None => f(req),
        Some(rows) => {
            let build = |mb: usize| crate::mlp_tile::build_with(req.build, Some(rows), mb);
            f(&req.with_build(&build))
        }
    }
}

/// `plan` with its config naming the tiling the planner chose (`mlp=` unwritten in `cfg`);
/// a pinned or whole MLP leaves the config as it is.
pub(super) fn name_choice(
    mut plan: Plan,
    pinned: Option<MlpMode>,
    rows: Option<usize>,
) -> Result<Plan> {
    if let (None, Some(rows)) = (pinned, rows) {
        let mut chosen = ParallelConfig::parse(&plan.config)?;
        chosen.mlp = Some(MlpMode::Tile(rows));
        plan.config = chosen.canonical();
    }
    Ok(plan)
}
