//! `tessera plan --explain`: a plan as a person reads it, in 100 columns.
//!
//! - A legend of the spec notation, with the plan's own mesh axes and their sizes.
//! - Every distinct block's per-op strategies: a block whose strategies equal an earlier
//!   block's folds into that block's section, headed by the blocks it covers; the ops before
//!   and after the blocks (embedding, final norm, head, loss) have their own sections.
//! - Ops named by their scope within the block and by what they do (`self_attn.q_proj
//!   matmul`, `residual add`, `cast bf16→f32 of o_proj`): [`op_details`], recorded in the plan
//!   when it is made ([`crate::plan::NodeStrategy::detail`]).
//! - The step time and its parts, compute by op kind, the collectives of one step.
//! - Memory live at the peak instruction, by role ([`crate::plan::Predicted::peak_breakdown`]):
//!   the parts sum to the peak; totals over the step are labelled as such.

use crate::plan::{NodeStrategy, Plan};
use crate::units::format_bytes;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use tessera_ir::Role;

/// The columns the explanation keeps to.
pub const WIDTH: usize = 100;

mod table;

// What each op does in words is recorded in the plan when it is made ([`crate::plan`]).
pub use crate::figures::peak_breakdown;
pub use crate::plan::ops::op_details;
use crate::plan::ops::{in_block, split_at_block};
use table::{ranges, wrap, Columns, Row};

// ---- memory at the peak ------------------------------------------------------------------

/// The roles in the order they are printed, with their short names and what they hold.
const ROLES: [(Role, &str, &str); 6] = [
    (Role::Parameter, "params", "weights as stored for compute"),
    (Role::Gradient, "grads", "accumulated parameter gradients"),
    (Role::OptimizerState, "optimizer", "AdamW moments, fp32 master weights"),
    (Role::SavedActivation, "saved activations", "forward values kept for the backward"),
    (Role::Temporary, "temporaries", "activation grads, unsaved values, workspace"),
    (Role::Input, "inputs", "token ids, labels, scalars"),
];

/// The non-zero parts of a breakdown, in print order, with their short names and meanings
/// (roles this build does not know last, under their own names).
fn parts(breakdown: &BTreeMap<String, u64>) -> Vec<(&str, &str, u64)> {
    let mut out: Vec<(&str, &str, u64)> = ROLES
        .iter()
        .filter_map(|&(r, short, what)| Some((short, what, *breakdown.get(r.name())?)))
        .collect();
    for (k, &b) in breakdown {
        if !ROLES.iter().any(|(r, ..)| r.name() == k) {
            out.push((k.as_str(), "", b));
        }
    }
    out.retain(|p| p.2 > 0);
    out
}

/// `first` and the breakdown's non-zero parts joined by ` + `, wrapped (continuation lines
/// indented by `indent`); `None` for an empty breakdown.
pub(crate) fn live_parts(
    first: &str,
    breakdown: &BTreeMap<String, u64>,
    indent: usize,
) -> Option<String> {
    let items: Vec<String> = parts(breakdown)
        .iter()
        .map(|(name, _, b)| format!("{name} {}", format_bytes(*b)))
        .collect();
    (!items.is_empty()).then(|| wrap(first, &items, " + ", indent))
}

/// The pipeline's section of `--explain`.
impl crate::pipeline::plan::PipelineJson {
    /// The `--explain` section: schedule, bubble, and per stage its blocks, their
    /// checkpointing (from the plan's per-block `checkpoint`), ranks and the peak of the device
    /// that runs it (a plan fits when the worst of these fits).
    pub fn explain(
        &self,
        micro_batches: usize,
        bubble: Option<f64>,
        checkpoint: &[crate::plan::BlockCkpt],
    ) -> String {
        let mut s = format!(
            "pipeline {} over {} devices, {micro_batches} micro-batches",
            self.schedule, self.devices
        );
        if let Some(b) = bubble {
            s += &format!(", bubble {:.1}% of device time", 100.0 * b);
        }
        s += "\n";
        s += &format!(
            "  {:<6} {:<10} {:<10} {:<24} {:>12}\n",
            "stage", "blocks", "ckpt", "ranks", "peak"
        );
        let worst = self.stages.iter().map(|st| st.peak_bytes).max().unwrap_or(0);
        for (i, st) in self.stages.iter().enumerate() {
            let ranks: Vec<String> = st.devices.iter().map(usize::to_string).collect();
            let mut ranks = ranks.join(",");
            if ranks.len() > 24 {
                ranks = format!("{} ranks", st.devices.len());
            }
            let modes: std::collections::BTreeSet<tessera_ir::CkptMode> = checkpoint
                .iter()
                .filter(|c| (st.blocks[0]..st.blocks[1]).contains(&(c.block as usize)))
                .map(|c| c.mode)
                .collect();
            let ckpt = match modes.len() {
                0 => "none".to_string(),
                1 => modes.iter().map(|m| m.to_string()).collect(),
                _ => "mixed".to_string(),
            };
            s += &format!(
                "  {i:<6} {:<10} {ckpt:<10} {ranks:<24} {:>12}{}\n",
                format!("{}..{}", st.blocks[0], st.blocks[1]),
                crate::units::format_bytes(st.peak_bytes),
                if st.peak_bytes == worst { "  (worst)" } else { "" }
            );
        }
        // What is live at each stage's peak: the parts sum to the peak above.
        for (i, st) in self.stages.iter().enumerate() {
            let first = format!("  stage {i} at its peak: ");
            s += &live_parts(&first, &st.peak_breakdown, 4).unwrap_or_default();
        }
        s
    }
}

impl Plan {
    /// The plan's memory line: the peak and, when the plan records it, what is live at the
    /// peak instruction by role (the parts sum to the peak). A pipelined plan's is its worst
    /// device's.
    pub fn memory_summary(&self) -> String {
        let peaks = &self.predicted.peak_bytes_per_device;
        let peak = peaks.iter().copied().max().unwrap_or(0);
        let who =
            if peaks.iter().all(|&p| p == peak) { "per device" } else { "on the worst device" };
        let head = format!(
            "memory    peak {} {who} (budget {})",
            format_bytes(peak),
            format_bytes(self.memory_budget_bytes)
        );
        live_parts(&format!("{head} = live at the peak: "), &self.predicted.peak_breakdown, 10)
            .unwrap_or(head + "\n")
    }

    /// `--explain`: the notation, every distinct block's strategies, the step time, compute by
    /// op, the collectives, memory at the peak and (pipelines) the stages.
    pub(crate) fn explain_text(&self) -> String {
        let mut s = String::new();
        let mb = self.micro_batches;
        let stages = self
            .pipeline
            .as_ref()
            .map_or(String::new(), |p| format!(" per pipeline stage, {} stages", p.devices));
        let _ = writeln!(
            s,
            "mesh {:?} ({}){stages}, ZeRO-{}, {mb} micro-batch{}",
            self.mesh.shape,
            self.axes_named(),
            self.zero_stage,
            if mb == 1 { "" } else { "es" }
        );
        s += &self.legend();
        s += &self.strategy_sections();
        s += &self.step_time();
        s += &self.compute_by_op();
        s += &self.collectives_text();
        s += &self.axes_text();
        s += &self.memory_at_peak();
        if let Some(pipe) = &self.pipeline {
            s += &pipe.explain(mb, self.predicted.bubble_fraction, &self.checkpoint);
        }
        s
    }

    /// `dp=4 × tp=2`.
    fn axes_named(&self) -> String {
        let named: Vec<String> = (0..self.mesh.shape.len())
            .map(|a| format!("{}={}", self.axis(a), self.mesh.shape[a]))
            .collect();
        named.join(" × ")
    }

    fn axis(&self, a: usize) -> String {
        self.mesh.axes.get(a).cloned().unwrap_or_else(|| format!("axis{a}"))
    }

    fn legend(&self) -> String {
        let mut s = String::from(
            "strategies: how each forward op's tensors are laid out over the mesh\n  a spec \
             such as [S0, R, R] gives each dim of a tensor its layout:\n    R     replicated: \
             every device holds the whole dim\n",
        );
        let shape = &self.mesh.shape;
        let parts = |n: usize| if n == 1 { "1 part".to_string() } else { format!("{n} parts") };
        for (a, &n) in shape.iter().enumerate() {
            let _ = writeln!(
                s,
                "    S{a:<4} split into {} over mesh axis {a} ({})",
                parts(n),
                self.axis(a)
            );
        }
        if shape.len() >= 2 {
            let _ = writeln!(
                s,
                "    S01   split into {} over axes 0 and 1 together ({} × {}, axis 0 major)",
                parts(shape[0] * shape[1]),
                self.axis(0),
                self.axis(1)
            );
        }
        let others = if shape.len() >= 2 {
            format!("; P1: over axis 1 ({}), P01: over both", self.axis(1))
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            "    P0    after the brackets: a pending sum over mesh axis 0 ({}): each device \
             holds a\n          partial value, which a collective adds up later{others}",
            self.axis(0)
        );
        s += "  columns: op (its scope within the block and what it does), the specs of its \
              inputs and of\n  its outputs, and split: the mesh axes its work is divided \
              over (on any other axis every\n  device repeats it; - for none)\n";
        s
    }

    /// One section per distinct block (alike blocks folded), and the ops before and after
    /// the blocks.
    fn strategy_sections(&self) -> String {
        let mut before = Vec::new();
        let mut after = Vec::new();
        let mut blocks: BTreeMap<u32, Vec<Row>> = BTreeMap::new();
        let mut prefix: BTreeMap<u32, String> = BTreeMap::new();
        for n in &self.strategies {
            let row = self.row(n);
            match n.block {
                Some(b) => {
                    if let Some((head, _)) = split_at_block(&n.scope, b) {
                        prefix.entry(b).or_insert_with(|| head.to_string());
                    }
                    blocks.entry(b).or_default().push(row);
                }
                None if blocks.is_empty() => before.push(row),
                None => after.push(row),
            }
        }
        // Alike blocks, in order of their first block.
        let mut groups: Vec<(Vec<u32>, &Vec<Row>)> = Vec::new();
        for (&b, rows) in &blocks {
            match groups.iter_mut().find(|(_, r)| *r == rows) {
                Some((members, _)) => members.push(b),
                None => groups.push((vec![b], rows)),
            }
        }
        let all: Vec<&Row> = before.iter().chain(blocks.values().flatten()).chain(&after).collect();
        let cols = Columns::fit(&all);
        let mut s = cols.header();
        if !before.is_empty() {
            s += if blocks.is_empty() {
                "ops (the model has no repeated blocks)\n"
            } else {
                "before the blocks\n"
            };
            s += &cols.table(&before, None);
        }
        for (i, (members, rows)) in groups.iter().enumerate() {
            let mut notes = Vec::new();
            match members.len() {
                1 => {}
                n if groups.len() == 1 => notes.push(format!("all {n} alike")),
                n => notes.push(format!("{n} alike")),
            }
            if let Some(p) = prefix.get(&members[0]).filter(|p| !p.is_empty()) {
                notes.push(format!("scopes under {p}.<block>"));
            }
            let first = groups[0].1.as_slice();
            if i > 0 {
                let them = ranges(&groups[0].0);
                notes.push(if first.len() == rows.len() {
                    format!("* marks the ops that differ from {them}")
                } else {
                    format!("other ops than {them}")
                });
            }
            let note =
                if notes.is_empty() { String::new() } else { format!(" ({})", notes.join("; ")) };
            let _ = writeln!(s, "{}{note}", ranges(members));
            s += &cols.table(rows, (i > 0).then_some(first));
        }
        if !after.is_empty() {
            s += "after the blocks\n";
            s += &cols.table(&after, None);
        }
        s
    }

    fn row(&self, n: &NodeStrategy) -> Row {
        let scope = in_block(&n.scope, n.block);
        let what = n.detail.as_deref().unwrap_or(&n.op);
        let label = [scope].into_iter().chain(what.split(' ')).filter(|w| !w.is_empty());
        let split = if n.compute_axes.is_empty() {
            "-".to_string()
        } else {
            n.compute_axes.iter().map(|&a| self.axis(a)).collect::<Vec<_>>().join(",")
        };
        Row {
            label: label.map(str::to_string).collect(),
            inputs: n.inputs.clone(),
            outputs: n.outputs.clone(),
            split: vec![split],
        }
    }

    fn step_time(&self) -> String {
        let p = &self.predicted;
        let mut s = String::new();
        let compute =
            p.forward_compute_s + p.backward_compute_s + p.recompute_s + p.optimizer_compute_s;
        if self.pipeline.is_none() {
            let _ = writeln!(
                s,
                "step time {:.4} s = compute {compute:.4} s + blocking comm {:.4} s + exposed comm \
                 {:.4} s",
                p.step_time_s, p.blocking_comm_s, p.exposed_comm_s
            );
        } else {
            let _ = writeln!(
                s,
                "step time {:.4} s: the pipeline schedule (below); the figures here are the \
                 Program of the\n  device with the highest peak",
                p.step_time_s
            );
        }
        let _ = writeln!(
            s,
            "  compute: forward {:.4} s + backward {:.4} s + recompute {:.4} s + optimizer {:.4} s",
            p.forward_compute_s, p.backward_compute_s, p.recompute_s, p.optimizer_compute_s
        );
        let _ = writeln!(
            s,
            "  comm: blocking {:.4} s (on the critical path); overlapped {:.4} s (beside the \
             compute),\n  of which exposed {:.4} s (not hidden by it)",
            p.blocking_comm_s, p.overlapped_comm_s, p.exposed_comm_s
        );
        s
    }

    fn compute_by_op(&self) -> String {
        let p = &self.predicted;
        let mut ops: Vec<(&String, &f64)> = p.compute_by_op_s.iter().collect();
        ops.sort_by(|a, b| b.1.total_cmp(a.1).then_with(|| a.0.cmp(b.0)));
        let mut s = String::from(
            "compute by op kind (forward, backward and optimizer; share of the step):\n",
        );
        for (op, secs) in ops {
            let share = if p.step_time_s > 0.0 { 100.0 * secs / p.step_time_s } else { 0.0 };
            let _ = writeln!(s, "  {op:<24} {secs:>9.4} s  {share:>5.1}%");
        }
        s
    }

    fn collectives_text(&self) -> String {
        let mut by_kind: BTreeMap<(&str, &str), (usize, u64)> = BTreeMap::new();
        for c in &self.collectives {
            let e = by_kind.entry((c.phase.as_str(), c.op.as_str())).or_default();
            e.0 += 1;
            e.1 += c.bytes;
        }
        if by_kind.is_empty() {
            return "collectives: none in one step\n".into();
        }
        let mut s = String::from(
            "collectives in one step, per device (calls: how many run; bytes: this device's \
             share, all calls)\n",
        );
        let _ =
            writeln!(s, "  {:<10} {:<18} {:>8} {:>14}", "phase", "collective", "calls", "bytes");
        for ((phase, op), (count, bytes)) in by_kind {
            let _ = writeln!(s, "  {phase:<10} {op:<18} {count:>8} {:>14}", format_bytes(bytes));
        }
        s
    }

    /// The axes' lines ([`crate::axis::Axis::explain_lines`]; context parallelism: what the
    /// cp axis splits and its all-to-all traffic). Empty when no axis has any.
    fn axes_text(&self) -> String {
        let traffic: Vec<crate::axis::Traffic<'_>> = self
            .collectives
            .iter()
            .map(|c| crate::axis::Traffic { axis: c.axis, op: &c.op, bytes: c.bytes })
            .collect();
        let cx = crate::axis::ExplainContext {
            shape: &self.mesh.shape,
            axes: &self.mesh.axes,
            seq: self.seq,
            traffic: &traffic,
            ring: self.mesh.ring,
            experts: self.experts.as_ref(),
        };
        let mut s = String::new();
        for line in crate::axis::explain_lines(&cx) {
            s += &line;
            s.push('\n');
        }
        s
    }

    fn memory_at_peak(&self) -> String {
        let p = &self.predicted;
        let peak = p.peak_bytes_per_device.iter().copied().max().unwrap_or(0);
        let parts = parts(&p.peak_breakdown);
        let who = if self.pipeline.is_some() { "on the worst device" } else { "per device" };
        let mut s = String::new();
        if parts.is_empty() {
            let _ = writeln!(
                s,
                "memory: peak {} {who} (this plan file does not record what is live at it)",
                format_bytes(peak)
            );
        } else {
            let _ = writeln!(s, "memory live at the peak instruction, {who}:");
            let share = |b: u64| if peak > 0 { 100.0 * b as f64 / peak as f64 } else { 0.0 };
            for (name, what, b) in &parts {
                let _ = writeln!(
                    s,
                    "  {name:<18} {:>12} {:>6.1}%   {what}",
                    format_bytes(*b),
                    share(*b)
                );
            }
            let _ = writeln!(s, "  {:<18} {:>12} {:>6.1}%", "= peak", format_bytes(peak), 100.0);
        }
        // Totals over the step that exceed what is live at the peak, labelled as such.
        let totals = [
            ("params", Role::Parameter, p.params_bytes),
            ("grads", Role::Gradient, p.grads_bytes),
            ("optimizer", Role::OptimizerState, p.optimizer_bytes),
            ("saved activations", Role::SavedActivation, p.activations_bytes),
        ];
        let items: Vec<String> = totals
            .iter()
            .filter_map(|&(name, role, total)| {
                let all = format_bytes(total);
                match p.peak_breakdown.get(role.name()) {
                    Some(&at) if at >= total || format_bytes(at) == all => None,
                    Some(&at) => Some(format!("{name} {all} ({} at the peak)", format_bytes(at))),
                    None if parts.is_empty() => Some(format!("{name} {all}")),
                    None => Some(format!("{name} {all} (none at the peak)")),
                }
            })
            .collect();
        let head = if parts.is_empty() {
            "  totals over the step (not the peak's parts): "
        } else {
            "  totals over the step, not all live at the peak: "
        };
        if !items.is_empty() {
            s += &wrap(head, &items, ", ", 4);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ParallelConfig;
    use crate::planner::{plan_fixed, plan_from_file, Request};
    use crate::search::{CkptSearch, Forward};
    use crate::{Cluster, PlanError};
    use tessera_ir::{DType, TrainConfig};
    use tessera_models::{build, BuildOptions, ModelConfig};

    type Build = Box<dyn Fn(usize) -> crate::Result<Forward> + Sync>;

    fn builder(preset: &str, seq: usize) -> Build {
        let cfg = ModelConfig::preset(preset).unwrap().without_dropout();
        Box::new(move |mb: usize| {
            let m = build(&cfg, &BuildOptions::new(mb, seq, DType::BF16))
                .map_err(|e| PlanError::Invalid(e.to_string()))?;
            Ok(Forward { graph: m.builder.finish(), loss: m.loss })
        })
    }

    fn request<'a>(build: &'a Build, model: &str, batch: usize, seq: usize) -> Request<'a> {
        Request {
            build: &**build,
            model: model.into(),
            batch,
            seq,
            dtype: DType::BF16,
            budget: u64::MAX,
            cluster: Cluster::parse("4xcpu").unwrap(),
            train: TrainConfig::default(),
            model_flops: 1e12,
            ckpt: CkptSearch::Off,
            pipeline: Default::default(),
            search: Default::default(),
        }
    }

    fn plan(req: &Request<'_>, config: &str) -> Plan {
        plan_fixed(req, &ParallelConfig::parse(config).unwrap()).unwrap()
    }

    /// The section headers of the strategies (`blocks 0–7 (..)`, `block 3 (..)`).
    fn block_headers(text: &str) -> Vec<&str> {
        text.lines().filter(|l| l.starts_with("block ") || l.starts_with("blocks ")).collect()
    }

    fn total(breakdown: &BTreeMap<String, u64>) -> u64 {
        breakdown.values().sum()
    }

    #[test]
    fn alike_blocks_fold_into_one_section() {
        let b = builder("gpt2-tiny", 32);
        let p = plan(&request(&b, "gpt2-tiny", 8, 32), "dp2 tp2 sp");
        let text = p.explain();
        assert_eq!(
            block_headers(&text),
            ["blocks 0–7 (all 8 alike; scopes under transformer.h.<block>)"],
            "{text}"
        );
        for want in ["before the blocks", "after the blocks", "    R     replicated"] {
            assert!(text.lines().any(|l| l.starts_with(want)), "no `{want}`:\n{text}");
        }
        // The legend names the plan's own axes and sizes.
        assert!(text.contains("S0    split into 2 parts over mesh axis 0 (dp)"), "{text}");
        assert!(text.contains("S1    split into 2 parts over mesh axis 1 (tp)"), "{text}");
        // Ops read by what they do, never by their bare kind.
        for want in ["residual add", "attn.c_attn bias add", "mlp gelu_tanh", "cast f32→bf16"] {
            assert!(text.contains(want), "no `{want}`:\n{text}");
        }
        let strategies = &text[..text.find("step time").unwrap()];
        assert!(!strategies.contains(" binary ") && !strategies.contains(" unary "), "{text}");
        // Every line fits 100 columns.
        for l in text.lines() {
            assert!(l.chars().count() <= WIDTH, "{} columns: {l}", l.chars().count());
        }
    }

    #[test]
    fn a_plan_file_with_one_block_edited_shows_two_sections() {
        let b = builder("gpt2-tiny", 32);
        let req = request(&b, "gpt2-tiny", 8, 32);
        let p = plan(&req, "dp2 tp2");
        // Block 3's first norm, edited by hand in the plan file: computed replicated.
        let mut doc: serde_json::Value = serde_json::to_value(&p).unwrap();
        let strategies = doc["strategies"].as_array_mut().unwrap();
        let ln = strategies
            .iter_mut()
            .find(|s| s["block"] == 3 && s["op"] == "layer_norm")
            .expect("block 3 has a layer norm");
        for key in ["inputs", "outputs"] {
            for spec in ln[key].as_array_mut().unwrap() {
                let rank = spec.as_str().unwrap().matches(['R', 'S']).count();
                *spec = format!("[{}]", vec!["R"; rank].join(", ")).into();
            }
        }
        ln["compute_axes"] = serde_json::json!([]);
        let file: Plan = serde_json::from_value(doc).unwrap();
        let again = plan_from_file(&req, &file).unwrap();
        let text = again.explain();
        let headers = block_headers(&text);
        assert_eq!(headers.len(), 2, "{text}");
        assert!(headers[0].starts_with("blocks 0–2, 4–7 (7 alike;"), "{}", headers[0]);
        assert!(headers[1].starts_with("block 3 (") && headers[1].contains("* marks"), "{text}");
        let marked: Vec<&str> = text.lines().filter(|l| l.starts_with("  * ")).collect();
        assert_eq!(marked.len(), 1, "{text}");
        assert!(marked[0].contains("ln_1 layer_norm") && marked[0].contains("[R, R, R]"));
    }

    #[test]
    fn what_is_live_at_the_peak_sums_to_the_peak() {
        let b = builder("gpt2-tiny", 32);
        let req = request(&b, "gpt2-tiny", 8, 32);
        for config in ["dp4", "dp2 tp2 zero1 mb2", "tp4 zero3"] {
            let p = plan(&req, config);
            let peak = p.predicted.peak_bytes_per_device[0];
            assert!(p.predicted.peak_breakdown.len() >= 5, "{config}");
            assert_eq!(total(&p.predicted.peak_breakdown), peak, "{config}");
        }
        for config in ["pp4 mb4", "dp2 pp2 mb4 sched=gpipe", "dp2 pp2 mb4 sched=interleaved:2"] {
            let p = plan(&req, config);
            let pipe = p.pipeline.as_ref().unwrap();
            for (i, st) in pipe.stages.iter().enumerate() {
                assert_eq!(total(&st.peak_breakdown), st.peak_bytes, "{config}: stage {i}");
            }
            let worst = *p.predicted.peak_bytes_per_device.iter().max().unwrap();
            assert_eq!(total(&p.predicted.peak_breakdown), worst, "{config}");
            let text = p.explain();
            assert!(text.contains("stage 0 at its peak: params"), "{text}");
        }
    }

    #[test]
    fn plan_files_without_the_new_fields_still_load_and_explain() {
        let b = builder("gpt2-tiny", 32);
        let p = plan(&request(&b, "gpt2-tiny", 8, 32), "dp2 pp2 mb2");
        let mut doc = serde_json::to_value(&p).unwrap();
        doc["predicted"].as_object_mut().unwrap().remove("peak_breakdown");
        for s in doc["pipeline"]["stages"].as_array_mut().unwrap() {
            s.as_object_mut().unwrap().remove("peak_breakdown");
        }
        for s in doc["strategies"].as_array_mut().unwrap() {
            s.as_object_mut().unwrap().remove("detail");
        }
        let old: Plan = serde_json::from_value(doc).unwrap();
        assert!(old.predicted.peak_breakdown.is_empty());
        let text = old.explain();
        assert!(text.contains("does not record what is live at it"), "{text}");
        assert!(text.contains("ln_1 layer_norm"), "{text}");
        let line = old.memory_summary();
        assert!(line.starts_with("memory    peak ") && !line.contains("live at"), "{line}");
    }

    #[test]
    fn ops_are_named_by_what_they_do() {
        let f = builder("llama-tiny", 16)(2).unwrap();
        let g = &f.graph;
        let details = op_details(g);
        let blocks = tessera_ir::remat::num_blocks(g);
        for b in 0..blocks {
            let of_block: Vec<&str> = g
                .nodes
                .iter()
                .zip(&details)
                .filter(|(n, _)| n.block == Some(b))
                .map(|(_, d)| d.as_str())
                .collect();
            assert_eq!(of_block.iter().filter(|d| **d == "residual add").count(), 2, "block {b}");
            assert!(of_block.contains(&"silu") && of_block.contains(&"attention causal"));
            assert!(of_block.iter().any(|d| d.starts_with("cast f32→bf16 of")), "{of_block:?}");
            assert!(of_block.contains(&"rope of q_proj"), "{of_block:?}");
        }
        // BERT is post-LN: its second residual add takes the first one's norm.
        let f = builder("bert-tiny", 16)(2).unwrap();
        let details = op_details(&f.graph);
        let residual = details.iter().filter(|d| *d == "residual add").count();
        assert_eq!(residual, 2 * tessera_ir::remat::num_blocks(&f.graph) as usize);
    }

    #[test]
    fn scopes_within_blocks_and_block_ranges() {
        assert_eq!(in_block("model.layers.12.mlp.up_proj", Some(12)), "mlp.up_proj");
        assert_eq!(in_block("model.layers.1", Some(1)), "");
        assert_eq!(in_block("model.norm", None), "model.norm");
        assert_eq!(
            crate::plan::ops::relative(
                "model.layers.0.self_attn",
                "model.layers.0.self_attn.q_proj"
            ),
            "q_proj"
        );
        assert_eq!(
            crate::plan::ops::relative("model.layers.0", "model.layers.0.mlp.down_proj"),
            "mlp.down_proj"
        );
        assert_eq!(ranges(&[0, 1, 2, 4, 5, 7]), "blocks 0–2, 4–5, 7");
        assert_eq!(ranges(&[3]), "block 3");
        let w = wrap("memory: ", &["a".repeat(60), "b".repeat(60)], " + ", 4);
        assert_eq!(w, format!("memory: {}\n    + {}\n", "a".repeat(60), "b".repeat(60)));
    }
}
