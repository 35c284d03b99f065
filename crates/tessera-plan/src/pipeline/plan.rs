//! Planning a fixed pipelined configuration (`--plan "dp2 tp2 pp4 zero1"`) and the plan
//! file's `pipeline` section.
//!
//! The stage's layout is the Megatron one on the stage's `dp × tp` mesh (found by the
//! ordinary evaluation, unbounded); the blocks split as evenly as they go; the stages are
//! lowered, checkpointed as the config says (or not), and priced by simulating the schedule.
//! A plan fits when its worst device fits.

use super::lower::{
    finish_pipeline, full_mesh, lower_unfinished, lower_within, PipeLowered, PipelineOptions,
};
use super::split::StageMap;
use super::ScheduleKind;
use crate::cost::CostModel;
use crate::lower::LowerOptions;
use crate::mesh::AxisName;
use crate::rules::Strategy;
use crate::{Cluster, Mesh, PlanError, Result};
use serde::{Deserialize, Serialize};
use tessera_ir::{Checkpointing, Graph, TensorId, TrainConfig};

/// The plan file's `pipeline` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PipelineJson {
    /// `gpipe`, `1f1b`, `interleaved:V` or `zb-h1`.
    pub schedule: String,
    /// Devices along the pipeline axis.
    pub devices: usize,
    /// One entry per virtual stage, in pipeline order.
    pub stages: Vec<StageJson>,
}

/// One (virtual) stage.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StageJson {
    /// The blocks it runs, `[first, end)`.
    pub blocks: [usize; 2],
    /// The ranks that run it (its data/tensor-parallel group).
    pub devices: Vec<usize>,
    /// The peak of its devices' Program (under interleaving, of the device holding it).
    pub peak_bytes: u64,
    /// What is live at that peak, by role (as [`crate::plan::Predicted::peak_breakdown`]):
    /// sums to `peak_bytes`. Empty in older plan files.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub peak_breakdown: std::collections::BTreeMap<String, u64>,
}

impl PipelineJson {
    /// The schedule named by `schedule`.
    pub fn kind(&self) -> Result<ScheduleKind> {
        parse_schedule(&self.schedule)
    }

    /// Blocks per virtual stage.
    pub fn sizes(&self) -> Vec<usize> {
        self.stages.iter().map(|s| s.blocks[1].saturating_sub(s.blocks[0])).collect()
    }
}

/// `gpipe`, `1f1b`, `interleaved:V`, `zb-h1`.
pub fn parse_schedule(s: &str) -> Result<ScheduleKind> {
    let cfg = crate::config::ParallelConfig::parse(&format!("pp2 sched={s}"))?;
    cfg.schedule.ok_or_else(|| PlanError::Invalid(format!("unknown pipeline schedule `{s}`")))
}

/// The axis names of a stage mesh read from a plan file: the file's own names when every one
/// is an axis the planner lays out (`dp`, `ep`, `cp`, `tp`: a stage `[dp, ep, tp]` of expert
/// parallelism has three axes as `[dp, cp, tp]` has), else by rank — a three-axis stage is
/// `[dp, cp, tp]` (hybrid sharding, the other three-axis stage mesh, is refused with a
/// pipeline), a two-axis one `[dp, tp]`.
pub fn file_stage_names(axes: &[String], rank: usize) -> Vec<AxisName> {
    use AxisName::{Context, Data, Expert, Tensor};
    let named: Option<Vec<AxisName>> = axes
        .iter()
        .map(|a| [Data, Expert, Context, Tensor].into_iter().find(|n| n.as_str() == a))
        .collect();
    match named {
        Some(n) if n.len() == rank => n,
        _ if rank == 3 => vec![Data, Context, Tensor],
        _ => vec![Data, Tensor],
    }
}

/// The full mesh `[stage axes.., pp]`, with links laid out Megatron's way: the pipeline axis
/// varies slowest over the devices (across nodes first), the tensor axis fastest.
pub fn meshes(
    cluster: &Cluster,
    stage_shape: &[usize],
    stage_names: &[AxisName],
    pp: usize,
) -> Result<(Mesh, Mesh)> {
    let mut physical = vec![pp];
    physical.extend_from_slice(stage_shape);
    use AxisName::Pipeline;
    let names: Vec<AxisName> =
        std::iter::once(Pipeline).chain(stage_names.iter().copied()).take(physical.len()).collect();
    let laid = Mesh::named(cluster, &physical, &names)?;
    let stage = Mesh {
        shape: stage_shape.to_vec(),
        axes: laid.axes[1..].to_vec(),
        links: laid.links[1..].to_vec(),
        replicas: Vec::new(),
        ring: false,
    };
    let mut full = full_mesh(&stage, pp, laid.links[0]);
    full.axes = stage.axes.iter().cloned().chain([Pipeline.to_string()]).collect();
    Ok((stage, full))
}

/// Everything a pipelined lowering needs.
pub struct PipelineRequest<'a> {
    pub forward: &'a Graph,
    pub loss: TensorId,
    pub strategies: &'a [Option<Strategy>],
    pub stage_mesh: &'a Mesh,
    pub full: &'a Mesh,
    pub zero: u8,
    pub micro_batches: usize,
    pub train: &'a TrainConfig,
    pub ckpt: Checkpointing,
    pub map: StageMap,
    pub schedule: ScheduleKind,
}

/// Lowers and prices a pipelined plan.
pub fn lower_pipelined(r: &PipelineRequest<'_>, cost: &CostModel) -> Result<PipeLowered> {
    let (opts, pipe) = r.options();
    let u = lower_unfinished(r.forward, r.loss, r.strategies, r.stage_mesh, r.full, &opts, &pipe)?;
    finish_pipeline(&u, &r.ckpt, r.full, cost)
}

/// [`lower_pipelined`] under `budget`, stopping at the first device found to miss it: its
/// peak ([`crate::pipeline::lower::lower_within`]).
pub fn lower_pipelined_within(
    r: &PipelineRequest<'_>,
    cost: &CostModel,
    budget: u64,
) -> Result<std::result::Result<PipeLowered, u64>> {
    let (opts, pipe) = r.options();
    let (fwd, mesh) = (r.forward, r.stage_mesh);
    lower_within(fwd, r.loss, r.strategies, mesh, r.full, &opts, &pipe, &r.ckpt, cost, budget)
}

impl PipelineRequest<'_> {
    fn options(&self) -> (LowerOptions, PipelineOptions) {
        let opts = LowerOptions {
            zero: self.zero,
            micro_batches: self.micro_batches,
            train: self.train.clone(),
            ckpt: self.ckpt.clone(),
            offload: None,
        };
        (opts, PipelineOptions { map: self.map.clone(), schedule: self.schedule })
    }
}

/// The plan file's section for a lowered pipeline.
pub fn pipeline_json(l: &PipeLowered, full: &Mesh) -> PipelineJson {
    let map = &l.options.map;
    let ranks = full.num_devices();
    let stages = map
        .block_ranges()
        .into_iter()
        .enumerate()
        .map(|(vs, (first, end))| {
            let (d, _) = map.device_of(vs);
            StageJson {
                blocks: [first, end],
                // The pipeline axis is the mesh's last: rank r runs pipeline device r mod pp.
                devices: (0..ranks).filter(|r| r % map.devices == d).collect(),
                peak_bytes: l.devices[d].lowered.memory.peak_bytes,
                peak_breakdown: crate::figures::peak_breakdown(&l.devices[d].lowered.memory),
            }
        })
        .collect();
    PipelineJson { schedule: l.options.schedule.to_string(), devices: map.devices, stages }
}

/// Per-rank peaks (rank r runs pipeline device r mod pp).
pub fn peaks_per_rank(l: &PipeLowered, ranks: usize) -> Vec<u64> {
    let p = l.devices.len().max(1);
    (0..ranks).map(|r| l.devices[r % p].lowered.memory.peak_bytes).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan file's stage mesh as `file_stage_names` reads it: its axis names and rank.
    fn mesh(shape: &[usize], axes: &[&str]) -> (Vec<String>, usize) {
        (axes.iter().map(|a| a.to_string()).collect(), shape.len())
    }

    fn file_stage_names(m: &(Vec<String>, usize)) -> Vec<AxisName> {
        super::file_stage_names(&m.0, m.1)
    }

    /// A plan file's stage keeps its own axis names (ep's stage is `[dp, ep, tp]`, as long as
    /// cp's); names it does not lay out fall back to the stage's rank.
    #[test]
    fn a_file_stage_keeps_its_axis_names() {
        use AxisName::{Context, Data, Expert, Tensor};
        assert_eq!(
            file_stage_names(&mesh(&[1, 2, 1], &["dp", "ep", "tp"])),
            [Data, Expert, Tensor]
        );
        assert_eq!(
            file_stage_names(&mesh(&[2, 2, 1], &["dp", "cp", "tp"])),
            [Data, Context, Tensor]
        );
        assert_eq!(
            file_stage_names(&mesh(&[2, 2, 1], &["a0", "a1", "a2"])),
            [Data, Context, Tensor]
        );
        assert_eq!(file_stage_names(&mesh(&[2, 2], &["dp", "tp"])), [Data, Tensor]);
        assert_eq!(file_stage_names(&mesh(&[2, 2], &[])), [Data, Tensor]);
    }
}
