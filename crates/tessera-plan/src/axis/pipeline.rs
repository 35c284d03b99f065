//! The pipeline axis: `ppN` stages, their schedule (`sched=`) and their blocks (`stages=`).
//! It is not an axis of the stage mesh (each stage's mesh is the others'; `pipeline::plan`
//! lays the pipeline axis before them), and its search is its own phase (`pipeline/`), so it
//! has no pins. Its rules that need the model are [`ParallelConfig::check_pipeline`].

use super::{Axis, ConfigError, Engine, ExportFields, Parsed, Slot, Token};
use crate::config::layout::{self, ScheduleKind};
use crate::config::{count, positive, ParallelConfig};
use crate::{PlanError, Result};

/// The schedules' spellings, for messages.
const SCHEDULES: &str = "gpipe, 1f1b, interleaved:V (V >= 2 chunks per device) and zb-h1";

/// `ppN`, `sched=`, `stages=`.
pub(super) struct PipelineAxis;

impl Axis for PipelineAxis {
    fn name(&self) -> &'static str {
        "pp"
    }

    fn parse_token(&self, t: Token<'_>, cfg: &mut ParallelConfig) -> Parsed {
        let (raw, tok) = (t.raw, t.lower);
        if let Some(list) = tok.strip_prefix("stages=") {
            return Some(layout::parse_stages(raw, list).map(|s| {
                cfg.stages = s;
                "stages"
            }));
        }
        if let Some(name) = tok.strip_prefix("sched=") {
            return Some(schedule(raw, name).map(|s| {
                cfg.schedule = Some(s);
                "sched"
            }));
        }
        let n = tok.strip_prefix("pp")?;
        Some(positive(raw, n, "pp", "pp4").map(|n| {
            cfg.pp = n;
            "pp"
        }))
    }

    fn bare_keyword(&self, t: Token<'_>) -> Option<String> {
        let raw = t.raw;
        match t.lower {
            "stages" => Some(format!(
                "`{raw}`: give the blocks of each virtual stage, e.g. stages=7:full,8,9,8 (with ppN)"
            )),
            "sched" => Some(format!(
                "`{raw}`: write sched=gpipe, sched=1f1b, sched=interleaved:V or sched=zb-h1 (with \
                 ppN)"
            )),
            _ => None,
        }
    }

    fn canonical(&self, cfg: &ParallelConfig) -> Vec<(Slot, String)> {
        let mut out = Vec::new();
        if cfg.pp > 1 {
            out.push((40, format!("pp{}", cfg.pp)));
        }
        if let Some(sched) = cfg.schedule {
            out.push((90, format!("sched={sched}")));
        }
        if !cfg.stages.is_empty() {
            out.push((100, format!("stages={}", layout::format_stages(&cfg.stages))));
        }
        out
    }

    fn validate(&self, cfg: &ParallelConfig) -> Result<(), ConfigError> {
        if let Some(sched) = cfg.schedule {
            if let ScheduleKind::Interleaved { v } = sched {
                if v < 2 {
                    return Err(ConfigError::OutOfRange {
                        knob: "sched",
                        message: format!(
                            "sched=interleaved:{v}: interleaving needs at least 2 chunks per \
                             device (V >= 2), e.g. sched=interleaved:2; with one chunk write \
                             sched=1f1b"
                        ),
                    });
                }
            }
            if cfg.pp < 2 {
                return Err(ConfigError::Requires {
                    knob: "sched",
                    needs: "pp",
                    message: format!(
                        "sched={sched}: a schedule needs pp >= 2; add ppN, e.g. `pp2 sched={sched}`"
                    ),
                });
            }
        }
        if !cfg.stages.is_empty() {
            let list = layout::format_stages(&cfg.stages);
            if cfg.pp < 2 {
                return Err(ConfigError::Requires {
                    knob: "stages",
                    needs: "pp",
                    message: format!(
                        "stages={list}: stages need a pipeline; add ppN with N = the number of \
                         stages, e.g. `pp{} stages={list}`",
                        cfg.stages.len().max(2)
                    ),
                });
            }
            let chunks = cfg.schedule.map_or(1, ScheduleKind::chunks);
            let want = cfg.pp.saturating_mul(chunks);
            if cfg.stages.len() != want {
                return Err(ConfigError::OutOfRange {
                    knob: "stages",
                    message: format!(
                        "stages={list} lists {} stages but pp{} makes {want} virtual stages: give \
                         one block count per virtual stage",
                        cfg.stages.len(),
                        cfg.pp
                    ),
                });
            }
        }
        Ok(())
    }

    /// Megatron-LM: `--pipeline-model-parallel-size`, interleaving's virtual stages, and
    /// unequal first and last stages when the middle ones are equal.
    fn export(&self, engine: Engine, cfg: &ParallelConfig) -> ExportFields {
        let mut flags = Vec::new();
        if engine == Engine::Megatron && cfg.pp > 1 {
            flags.push(format!("--pipeline-model-parallel-size {}", cfg.pp));
            if let Some(ScheduleKind::Interleaved { v }) = cfg.schedule {
                flags.push(format!("--num-virtual-stages-per-pipeline-rank {v}"));
            }
            let sizes = layout::sizes(&cfg.stages);
            if let [first, middle @ .., last] = sizes.as_slice() {
                let even = middle.first().is_none_or(|m| middle.iter().all(|x| x == m));
                if cfg.schedule.map_or(1, ScheduleKind::chunks) == 1 && even {
                    flags.push(format!("--decoder-first-pipeline-num-layers {first}"));
                    flags.push(format!("--decoder-last-pipeline-num-layers {last}"));
                }
            }
        }
        ExportFields::Args(flags.into_iter().map(|f| (30, f)).collect())
    }
}

impl ParallelConfig {
    /// Checks the config against a model of `num_blocks` repeated blocks (the chain that
    /// pipeline stages cut): every stage needs a block (pp <= blocks). `interleaved:V` needs a
    /// block for each of its pp·V virtual stages, V must divide the blocks per stage when the
    /// blocks split evenly over the stages, and the micro-batch count must be a multiple of pp
    /// (Megatron's rule for the interleaved schedule). The micro-batch count is the config's
    /// `mbN` when N > 1, else `micro_batches_hint` (e.g. the count a planner is trying); with
    /// neither, that rule is not checked. GPipe, 1F1B and ZB-H1 need nothing more.
    pub fn check_pipeline(
        &self,
        num_blocks: usize,
        micro_batches_hint: Option<usize>,
    ) -> Result<()> {
        self.validate()?;
        let pp = self.pp;
        if pp == 1 {
            return Ok(());
        }
        if pp > num_blocks {
            let fix = if num_blocks >= 2 {
                format!("use pp{num_blocks} or fewer")
            } else {
                "drop ppN (no pipeline)".to_string()
            };
            return Err(PlanError::Invalid(format!(
                "pp{pp} needs at least {pp} blocks; the model has {num_blocks}: {fix}"
            )));
        }
        if !self.stages.is_empty() {
            let chunks = self.schedule.map_or(1, ScheduleKind::chunks);
            layout::check(&self.stages, pp, chunks, num_blocks)?;
        }
        let Some(ScheduleKind::Interleaved { v }) = self.schedule else {
            return Ok(());
        };
        let sched = format!("sched=interleaved:{v}");
        if pp.checked_mul(v).is_none_or(|stages| stages > num_blocks) {
            let most = num_blocks / pp;
            let fix = if most >= 2 {
                format!("use sched=interleaved:{most} or fewer chunks, or sched=1f1b")
            } else {
                "use sched=1f1b (no interleaving)".to_string()
            };
            return Err(PlanError::Invalid(format!(
                "{sched} on pp{pp} makes pp × V = {pp} × {v} virtual stages, each needing a \
                 block, but the model has {num_blocks} blocks: {fix}"
            )));
        }
        if num_blocks.is_multiple_of(pp) && self.stages.is_empty() {
            let per_stage = num_blocks / pp;
            if !per_stage.is_multiple_of(v) {
                let fits: Vec<String> = (2..=per_stage)
                    .filter(|w| per_stage.is_multiple_of(*w))
                    .map(|w| format!("interleaved:{w}"))
                    .collect();
                return Err(PlanError::Invalid(format!(
                    "{sched} on pp{pp}: each stage's {per_stage} blocks ({num_blocks} blocks / \
                     pp{pp}) do not split into {v} chunks: use V dividing {per_stage} ({}), or \
                     sched=1f1b",
                    fits.join(", ")
                )));
            }
        }
        let mb = if self.micro_batches > 1 { Some(self.micro_batches) } else { micro_batches_hint };
        if let Some(mb) = mb.filter(|mb| !mb.is_multiple_of(pp)) {
            let up = mb.div_ceil(pp).saturating_mul(pp);
            let down = mb / pp * pp;
            let fix =
                if down >= pp { format!("use mb{down} or mb{up}") } else { format!("use mb{up}") };
            return Err(PlanError::Invalid(format!(
                "{sched} on pp{pp} needs a micro-batch count that is a multiple of pp = {pp} \
                 (Megatron's interleaved schedule), but it is {mb}: {fix}, or sched=1f1b"
            )));
        }
        Ok(())
    }
}

/// A schedule's name after `sched=` (lower-cased): see [`SCHEDULES`].
fn schedule(raw: &str, name: &str) -> Result<ScheduleKind, String> {
    match name {
        "gpipe" => Ok(ScheduleKind::Gpipe),
        "1f1b" => Ok(ScheduleKind::OneFOneB),
        "zb-h1" => Ok(ScheduleKind::ZbH1),
        "interleaved" => Err(format!(
            "`{raw}`: give the chunks per device as interleaved:V with V >= 2, e.g. \
             sched=interleaved:2"
        )),
        _ => {
            let Some(v) = name.strip_prefix("interleaved:") else {
                return Err(format!("`{raw}`: schedules are {SCHEDULES}, e.g. sched=1f1b"));
            };
            let v = count(raw, v, "interleaved:", "interleaved:2")?;
            if v < 2 {
                return Err(format!(
                    "`{raw}`: interleaving needs at least 2 chunks per device (V >= 2), e.g. \
                     sched=interleaved:2; with one chunk write sched=1f1b"
                ));
            }
            Ok(ScheduleKind::Interleaved { v })
        }
    }
}
