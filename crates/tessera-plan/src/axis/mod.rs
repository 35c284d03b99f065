//! The planner's axes: one interface ([`Axis`]) that every parallel axis and step knob
//! implements in its own module, and the registry ([`AXES`]) that the config grammar, the
//! config's mesh, the search space, `--explain` and the exports iterate instead of naming each
//! axis.
//!
//! An axis owns, in its module:
//! - its config tokens: parsing ([`Axis::parse_token`], [`Axis::finish`]), the message for its
//!   keywords written without a value ([`Axis::bare_keyword`]) and its canonical spelling
//!   ([`Axis::canonical`], placed by [`Slot`]s so that no axis needs to know the others'
//!   order);
//! - its rules ([`Axis::validate`]: typed [`ConfigError`]s naming the problem and the fix);
//! - its axes of a config's stage mesh ([`Axis::mesh_axes`], ordered by slot: Megatron-LM's
//!   group order, the data axes first and the tensor axis last);
//! - the automatic search's candidate degrees for a model and a cluster ([`Axis::grid`]);
//! - what its mesh axis splits at each op under a config's (Megatron) rule ([`Axis::pins`],
//!   [`Axis::order_strategy`]): an axis without pins splits the batch (data parallelism);
//! - its `--explain` lines ([`Axis::explain_lines`]) and its export fields per engine
//!   ([`Axis::export`]: arguments, or a typed refusal with the nearest config the engine runs).
//!
//! The string grammar itself ([`ParallelConfig::parse`], `canonical`, `validate`, the Megatron
//! flags) is [`grammar`]'s, a loop over the registry; the config type is `crate::config`'s.
//! Rewrites of the lowered Program (checkpointing, activation offload, loss chunks, MLP
//! tiles) are not behind this interface yet: they stay the lowering's (`lower/`, `ckpt.rs`,
//! `offload.rs`), which the axes' modules do not import back.
//!
//! Adding an axis: ARCHITECTURE.md, "Recipes".

pub mod context;
mod data;
mod error;
pub mod expert;
mod grammar;
#[cfg(test)]
mod grammar_tests;
mod pipeline;
mod state;
mod step;
mod tensor;

pub use error::ConfigError;

use crate::config::ParallelConfig;
use crate::rules::{DimRole, Labeling, Strategy};
use crate::{AxisName, Mesh};
use tessera_ir::{Graph, Node};

/// Where a token or a flag goes among the others' (ascending): each axis places its own, with
/// gaps left for new axes. The canonical config string: `dp` 10, `ep` 15, `tp` 20, `cp` 30, `pp` 40,
/// `sp` 50, `zero` 60, `shard=` 70, `mb` 80, `sched=` 90, `stages=` 100, `ckpt=` 110,
/// `offload=` 120, `loss=` 130, `mlp=` 140. The stage mesh: `replica` 0, `dp` 10, `ep` 20, `cp` 30,
/// `tp` 90. Megatron-LM's flags: tp 10, cp 20, ep 25, pp 30, sp 40, the distributed optimizer 50.
pub type Slot = u16;

/// One token of a config string: as written (`raw`, for messages) and lower-cased (`lower`,
/// what is matched).
#[derive(Clone, Copy, Debug)]
pub struct Token<'a> {
    pub raw: &'a str,
    pub lower: &'a str,
}

/// What a token is to an axis: `Some(Ok(kind))` when the axis owns it (`kind` names the token
/// kind, given at most once per config: `"cp"`, `"cp="`), `Some(Err(message))` when it owns
/// it but it is malformed or refused, `None` when it is another axis's.
pub type Parsed = Option<Result<&'static str, String>>;

/// The engines a plan exports to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    Megatron,
    DeepSpeed,
    Torchtitan,
}

/// An axis's part of an export.
#[derive(Clone, Debug, PartialEq)]
pub enum ExportFields {
    /// Command-line arguments (Megatron-LM's flags, each with its value), placed by slot.
    Args(Vec<(Slot, String)>),
    /// The engine cannot run the axis as configured: why (naming the fix), and the nearest
    /// config it can run.
    Refused { why: String, nearest: ParallelConfig },
}

/// What [`Axis::pins`] reads: one forward graph on a config's mesh.
pub struct PinContext<'a> {
    pub graph: &'a Graph,
    /// Each node's labeling (`None`: a leaf). An axis may rewrite its node's labels (tensor
    /// parallelism marks the KV projections it keeps whole); the axes run in registry order.
    pub labels: &'a mut [Option<Labeling>],
    /// Every tensor dim's role (batch, sequence) from the data inputs.
    pub roles: &'a [Vec<DimRole>],
    /// The same, with the sequence carried through attention and RoPE to their outputs.
    pub seq_roles: &'a [Vec<DimRole>],
    pub mesh: &'a Mesh,
    /// The axis's index in `mesh`.
    pub axis: usize,
    /// The rule's sequence parallelism (`sp`).
    pub sp: bool,
}

/// What [`Axis::explain_lines`] reads: a plan's mesh, sequence and collectives.
pub struct ExplainContext<'a> {
    /// The plan's mesh: its shape and axis names (as a plan file spells them).
    pub shape: &'a [usize],
    pub axes: &'a [String],
    /// Tokens per sequence.
    pub seq: usize,
    /// The step's collectives per device: mesh axis, collective name, bytes.
    pub traffic: &'a [Traffic<'a>],
    /// The mesh's cp axis is a ring (ring attention's sends, not all-to-alls).
    pub ring: bool,
    /// The model's experts (count, capacity), when it has any.
    pub experts: Option<&'a expert::ExpertFacts>,
}

impl ExplainContext<'_> {
    /// The mesh axis named `name`, if the plan's mesh has one.
    pub fn axis(&self, name: AxisName) -> Option<usize> {
        self.axes.iter().position(|a| a == name.as_str())
    }
}

/// One collective of a plan, as [`ExplainContext`] lists it.
#[derive(Clone, Copy, Debug)]
pub struct Traffic<'a> {
    pub axis: usize,
    pub op: &'a str,
    pub bytes: u64,
}

/// What the automatic search tries: the cluster and the model's sequence and experts.
#[derive(Clone, Copy, Debug)]
pub struct GridContext {
    pub devices: usize,
    pub gpus_per_node: usize,
    pub nodes: usize,
    pub seq: usize,
    /// Experts per MoE layer of the model (0: it has none).
    pub experts: usize,
}

/// One parallel axis or step knob of the planner (see the module docs). Every method but
/// [`Axis::name`], [`Axis::parse_token`] and [`Axis::canonical`] has a default that does
/// nothing, so an axis implements what it has.
pub trait Axis: Sync {
    /// The axis's short name (`"cp"`), for messages and tests.
    fn name(&self) -> &'static str;

    /// Reads one token into `cfg` (see [`Parsed`]).
    fn parse_token(&self, token: Token<'_>, cfg: &mut ParallelConfig) -> Parsed;

    /// After every token: settles what depends on other tokens (`nvme` on `offload=`), given
    /// the kinds seen with their lower-cased tokens.
    fn finish(
        &self,
        _cfg: &mut ParallelConfig,
        _seen: &[(&'static str, String)],
    ) -> Result<(), String> {
        Ok(())
    }

    /// The message for one of the axis's keywords written without its value (`ckpt`).
    fn bare_keyword(&self, _token: Token<'_>) -> Option<String> {
        None
    }

    /// The axis's canonical tokens (each with its leading space), placed by slot; none at the
    /// defaults (except `dpN tpN`, always written).
    fn canonical(&self, cfg: &ParallelConfig) -> Vec<(Slot, String)>;

    /// The config rules of the axis (those that need no model).
    fn validate(&self, _cfg: &ParallelConfig) -> Result<(), ConfigError> {
        Ok(())
    }

    /// Its axes of the config's stage mesh (the pipeline axis is not one), placed by slot.
    fn mesh_axes(&self, _cfg: &ParallelConfig) -> Vec<(Slot, AxisName, usize)> {
        Vec::new()
    }

    /// The automatic search's extra configs for this axis (degrees > 1) on a cluster and a
    /// model's sequence, beside the dp × tp grid; empty: none.
    fn grid(&self, _cx: &GridContext) -> Vec<ParallelConfig> {
        Vec::new()
    }

    /// The mesh axes this axis pins in the search, by name: [`Axis::pins`] is asked for each
    /// one the mesh has.
    fn pinned_axis(&self) -> Option<AxisName> {
        None
    }

    /// What the axis's mesh axis splits at each node under a config's rule (the label, `None`:
    /// nothing), or why the graph cannot be split so (naming the fix).
    fn pins(&self, _cx: &mut PinContext<'_>) -> Result<Vec<Option<usize>>, String> {
        Err(format!("the {} axis has no pins", self.name()))
    }

    /// What its axis is called where a node cannot be split over it as pinned.
    fn pin_miss(&self) -> &'static str {
        "its mesh axis"
    }

    /// Adjusts a strategy that splits a node over the axis (axis order within a dim).
    fn order_strategy(&self, _s: &mut Strategy, _node: &Node, _mesh: &Mesh, _axis: usize) {}

    /// Adjusts every strategy of a node (pinned or not) once the pins have filtered them: an
    /// axis that splits more than its pinned label (ring attention splits attention's
    /// sequence) adds it here.
    fn adjust_strategies(&self, _all: &mut [Strategy], _node: &Node, _mesh: &Mesh, _axis: usize) {}

    /// Its lines in `--explain` (none: empty).
    fn explain_lines(&self, _cx: &ExplainContext<'_>) -> Vec<String> {
        Vec::new()
    }

    /// Its part of an export to `engine`.
    fn export(&self, _engine: Engine, _cfg: &ParallelConfig) -> ExportFields {
        ExportFields::Args(Vec::new())
    }
}

/// Every axis, in the order the search pins them (the mesh order: data, context, tensor),
/// then the axes and knobs that have no mesh axis of the stage. The grammar, the mesh, the
/// search space, `--explain` and the exports iterate this list.
pub static AXES: &[&dyn Axis] = &[
    &data::DataAxis,
    &expert::ExpertAxis,
    &context::ContextAxis,
    &tensor::TensorAxis,
    &pipeline::PipelineAxis,
    &state::CheckpointAxis,
    &state::OffloadAxis,
    &step::StepKnobs,
];

/// A config's stage mesh (every axis but the pipeline's): shape and names in slot order.
pub fn stage_mesh(cfg: &ParallelConfig) -> (Vec<usize>, Vec<AxisName>) {
    let mut axes: Vec<(Slot, AxisName, usize)> =
        AXES.iter().flat_map(|a| a.mesh_axes(cfg)).collect();
    axes.sort_by_key(|&(slot, ..)| slot);
    axes.into_iter().map(|(_, name, n)| (n, name)).unzip()
}

/// The config's Megatron-LM flags, one argument each, in slot order; or the first axis's
/// refusal.
pub fn export_fields(engine: Engine, cfg: &ParallelConfig) -> ExportFields {
    let mut args = Vec::new();
    for a in AXES {
        match a.export(engine, cfg) {
            ExportFields::Args(mine) => args.extend(mine),
            refused @ ExportFields::Refused { .. } => return refused,
        }
    }
    args.sort_by_key(|&(slot, _)| slot);
    ExportFields::Args(args)
}

/// Every axis's `--explain` lines, in registry order.
pub fn explain_lines(cx: &ExplainContext<'_>) -> Vec<String> {
    AXES.iter().flat_map(|a| a.explain_lines(cx)).collect()
}

/// The automatic search's extra configs, every axis's.
pub fn grid(cx: &GridContext) -> Vec<ParallelConfig> {
    AXES.iter().flat_map(|a| a.grid(cx)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_do_not_collide() {
        // Every knob set (the config need not be valid: canonical spelling does not check).
        // Two axes writing one slot would make the order depend on the registry's.
        let offload = ParallelConfig::parse("offload=act+opt nvme").map(|c| c.offload);
        let cfg = ParallelConfig::new(4, 2)
            .with_cp(2)
            .with_sp(true)
            .with_zero(1)
            .with_shard(Some(2))
            .with_micro_batches(2)
            .with_pp(2)
            .with_schedule(Some(crate::config::layout::ScheduleKind::OneFOneB))
            .with_ckpt(Some(tessera_ir::CkptMode::Full))
            .with_offload(offload.ok().flatten())
            .with_loss(Some(crate::config::LossMode::Chunk(64)))
            .with_mlp(Some(crate::config::MlpMode::Tile(64)));
        let mut slots: Vec<Slot> =
            AXES.iter().flat_map(|a| a.canonical(&cfg)).map(|(s, _)| s).collect();
        assert_eq!(slots.len(), 13, "{}", cfg.canonical());
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots.len(), 13, "{slots:?}");
        assert_eq!(
            cfg.canonical(),
            "dp4 tp2 cp2 cp=a2a pp2 sp zero1 shard=2 mb2 sched=1f1b ckpt=full offload=act+opt \
             nvme loss=chunk64 mlp=tile64"
        );
    }

    #[test]
    fn the_stage_mesh_orders_data_context_tensor() {
        let cfg = ParallelConfig::new(2, 4).with_cp(2);
        assert_eq!(
            stage_mesh(&cfg),
            (vec![2, 2, 4], vec![AxisName::Data, AxisName::Context, AxisName::Tensor])
        );
        let (shape, names) =
            stage_mesh(&ParallelConfig::new(8, 1).with_zero(1).with_shard(Some(4)));
        assert_eq!(
            (shape, names),
            (vec![2, 4, 1], vec![AxisName::Replica, AxisName::Data, AxisName::Tensor])
        );
        assert_eq!(
            stage_mesh(&ParallelConfig::new(8, 1)),
            (vec![8, 1], vec![AxisName::Data, AxisName::Tensor])
        );
    }
}
