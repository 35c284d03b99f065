//! Helpers shared by the planner's integration tests: a preset's forward graph per
//! micro-batch size, and the search's problem around it.

use tessera_ir::{DType, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::search::{CkptSearch, Forward, Search, SearchProblem};
use tessera_plan::{Cluster, PlanError};

/// The bf16 forward graph of `preset` (no dropout) at `seq` tokens, per micro-batch size.
pub fn builder(preset: &str, seq: usize) -> impl Fn(usize) -> tessera_plan::Result<Forward> + Sync {
    let cfg = ModelConfig::preset(preset).unwrap().without_dropout();
    move |mb: usize| {
        let m = build(&cfg, &BuildOptions::new(mb, seq, DType::BF16))
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    }
}

/// The joint search's problem for `batch` sequences on `cluster`'s device.
pub fn problem<'a>(
    build: &'a (dyn Fn(usize) -> tessera_plan::Result<Forward> + Sync),
    batch: usize,
    cluster: &Cluster,
) -> Search<'a> {
    Search::new(SearchProblem {
        build,
        batch,
        cost: tessera_plan::cost::CostModel::new(cluster.device.clone()),
        train: TrainConfig::default(),
        knobs: Default::default(),
        ckpt: CkptSearch::Joint,
    })
}
