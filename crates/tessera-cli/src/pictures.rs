//! SVG pictures, drawn with plotters: the memory timeline of one training step
//! (`profile --timeline-svg`), each distinct device Program's timeline under a plan
//! (`plan --memory-svg`) and a run's loss curve (`train --plot`).
//!
//! The drawing functions return the SVG document; the `write_*` functions give each command
//! its picture in one call, written atomically ([`write_output`]) with errors naming the flag
//! and the file. The memory pictures draw the same simulation the predictions come from
//! ([`simulate_memory`] over the Program the runtime executes), so the peak they mark is the
//! maximum of the curve they draw — `plan --memory-svg` refuses to draw a plan whose
//! predicted peaks its Programs do not reach exactly.

use crate::format::bytes;
use crate::output::write_output;
use crate::plan_cmd::plan_err;
use crate::train_prepare::RunContext;
use anyhow::{anyhow, bail, Context, Result};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;
use tessera_ir::Program;
use tessera_plan::plan::Plan;
use tessera_plan::planner::{self, Request};
use tessera_profile::simulate_memory;
use tessera_runtime::run::RankOutcome;

/// Width and height of every picture, in pixels.
const SIZE: (u32, u32) = (1000, 560);

/// Curve colours, in order (Tableau 10, less its red, which marks the peaks).
const COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(23, 190, 207),
];

/// The colour of peak lines and their labels.
const PEAK: RGBColor = RGBColor(214, 39, 40);

/// A plotters error as ours.
fn drawing(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("drawing the SVG failed: {e}")
}

/// Refuses a destination that cannot become a file — a directory, a path without a file
/// name, a parent directory that does not exist — naming `flag` and the path. `train` checks
/// `--plot` before its first step, so a bad path does not cost the run.
pub fn check_destination(path: &Path, flag: &str) -> Result<()> {
    let shown = path.display();
    if path.is_dir() {
        bail!("{flag} {shown} is a directory: give a file name, like {flag} picture.svg");
    }
    if path.file_name().is_none() {
        bail!("{flag} {shown:?} names no file: give a file name, like {flag} picture.svg");
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !parent.is_dir() {
        bail!("{flag} {shown}: the directory {} does not exist", parent.display());
    }
    Ok(())
}

/// Writes the SVG document `svg` to `path` atomically; errors name `flag` and the file.
fn write_svg(path: &Path, flag: &str, svg: &str) -> Result<()> {
    check_destination(path, flag)?;
    write_output(path, svg.as_bytes()).with_context(|| format!("{flag} {}", path.display()))
}

/// The binary unit a memory picture's axis counts in: the largest of B, KiB, MiB, GiB, TiB
/// and PiB not above `max` bytes, as `(bytes, name)`.
fn byte_unit(max: f64) -> (f64, &'static str) {
    let mut unit = (1.0, "B");
    for (i, name) in ["KiB", "MiB", "GiB", "TiB", "PiB"].into_iter().enumerate() {
        let size = 1024f64.powi(i as i32 + 1);
        if max >= size {
            unit = (size, name);
        }
    }
    unit
}

/// Live bytes over the instructions of one Program, as the runtime runs it.
pub struct MemoryCurve {
    /// The legend's name for the devices that run the Program.
    pub label: String,
    /// `(instruction, live bytes)` after each instruction ([`simulate_memory`]'s timeline).
    pub points: Vec<(u32, u64)>,
}

impl MemoryCurve {
    /// Simulates `program`.
    pub fn of(label: String, program: &Program) -> MemoryCurve {
        let trace = simulate_memory(program);
        MemoryCurve {
            label,
            points: trace.timeline.iter().map(|p| (p.instr, p.live_bytes)).collect(),
        }
    }

    /// The curve's highest point `(instruction, bytes)`: the first, if several tie.
    pub fn peak(&self) -> Option<(u32, u64)> {
        self.points.iter().copied().reduce(|best, p| if p.1 > best.1 { p } else { best })
    }

    /// The curve's highest live bytes (0 for an empty curve).
    pub fn peak_bytes(&self) -> u64 {
        self.peak().map_or(0, |p| p.1)
    }
}

/// Memory timelines as an SVG document: one line per curve (a legend when there are several
/// or a curve's label says something), each curve's highest point circled, and a horizontal
/// line at `peak` labelled `peak_label`. Axes: instruction, memory.
pub fn memory_svg(
    title: &str,
    curves: &[MemoryCurve],
    peak: u64,
    peak_label: &str,
) -> Result<String> {
    let x_max = curves.iter().map(|c| c.points.len()).max().unwrap_or(0).max(1) as f64;
    let highest = curves.iter().map(MemoryCurve::peak_bytes).max().unwrap_or(0);
    // Headroom above the peak for its label and the legend.
    let (unit, unit_name) = byte_unit(highest.max(peak) as f64);
    let top = highest.max(peak).max(1) as f64 / unit * (1.12 + 0.05 * curves.len().min(8) as f64);
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(drawing)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(96)
            .build_cartesian_2d(0f64..x_max, 0f64..top)
            .map_err(drawing)?;
        chart
            .configure_mesh()
            .x_desc("instruction")
            .y_desc(format!("live memory ({unit_name})"))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{}", (y * 1000.0).round() / 1000.0))
            .draw()
            .map_err(drawing)?;
        for (i, c) in curves.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            let line: Vec<(f64, f64)> =
                c.points.iter().map(|&(x, y)| (x as f64, y as f64 / unit)).collect();
            chart
                .draw_series(std::iter::once(PathElement::new(line, colour.stroke_width(2))))
                .map_err(drawing)?
                .label(c.label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 24, y)], colour.stroke_width(2))
                });
            if let Some((x, y)) = c.peak() {
                let mark = Circle::new((x as f64, y as f64 / unit), 4, colour.filled());
                chart.draw_series(std::iter::once(mark)).map_err(drawing)?;
            }
        }
        let level = peak as f64 / unit;
        let rule = PathElement::new([(0.0, level), (x_max, level)], PEAK.stroke_width(1));
        chart.draw_series(std::iter::once(rule)).map_err(drawing)?;
        let font =
            ("sans-serif", 14).into_font().color(&PEAK).pos(Pos::new(HPos::Left, VPos::Bottom));
        let label = Text::new(peak_label.to_string(), (x_max * 0.01, level), font);
        chart.draw_series(std::iter::once(label)).map_err(drawing)?;
        if curves.iter().any(|c| !c.label.is_empty()) {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(drawing)?;
        }
        root.present().map_err(drawing)?;
    }
    Ok(buf)
}

/// `profile --timeline-svg`: `program`'s memory timeline, its peak marked and labelled
/// `peak <size> at instruction <i>` (the size `--format json` reports as `memory.peak_bytes`).
pub fn write_profile_timeline(path: &Path, program: &Program, title: &str) -> Result<()> {
    let trace = simulate_memory(program);
    let peak = trace.report.peak_bytes;
    let label = format!("peak {} at instruction {}", bytes(peak), trace.report.peak_instr);
    let points = trace.timeline.iter().map(|p| (p.instr, p.live_bytes)).collect();
    let curve = MemoryCurve { label: String::new(), points };
    let title = format!("{title}: memory over one training step");
    write_svg(path, "--timeline-svg", &memory_svg(&title, &[curve], peak, &label)?)
}

/// `plan --memory-svg`: the memory timeline of each distinct device Program of `plan`
/// (lowered again, as `train` lowers it) — one line for a flat plan, whose devices all run the
/// same Program, one per pipeline device otherwise — with the plan's predicted per-device peak
/// marked. Every rank's predicted peak must be its Program's highest point.
pub fn write_plan_memory(path: &Path, req: &Request<'_>, plan: &Plan) -> Result<()> {
    let exe = planner::lower_plan(req, plan).map_err(plan_err)?;
    let pipelined = exe.pipeline.is_some();
    let lowered = exe.per_device();
    let (pp, ranks) = (lowered.len(), plan.predicted.peak_bytes_per_device.len());
    let mut curves = Vec::with_capacity(pp);
    for (d, l) in lowered.iter().enumerate() {
        let mut c = MemoryCurve::of(String::new(), &l.program);
        c.label = device_label(pipelined, d, pp, ranks, c.peak_bytes());
        curves.push(c);
    }
    for (r, &predicted) in plan.predicted.peak_bytes_per_device.iter().enumerate() {
        let drawn = curves.get(r % pp.max(1)).map_or(0, MemoryCurve::peak_bytes);
        if drawn != predicted {
            bail!(
                "internal: the plan predicts a peak of {predicted} bytes on rank {r}, but the \
                 timeline of its lowered Program peaks at {drawn} bytes"
            );
        }
    }
    // The worst device: the first of the highest.
    let (worst, peak) = curves
        .iter()
        .enumerate()
        .map(|(d, c)| (d, c.peak_bytes()))
        .fold((0, 0), |best, x| if x.1 > best.1 { x } else { best });
    let label = if pipelined {
        format!("predicted peak {} (pipeline device {worst})", bytes(peak))
    } else {
        format!("predicted peak {} per device", bytes(peak))
    };
    let title = format!(
        "{} on {}: `{}` · batch {} × seq {} · {}",
        plan.model, plan.cluster, plan.config, plan.batch, plan.seq, plan.dtype
    );
    write_svg(path, "--memory-svg", &memory_svg(&title, &curves, peak, &label)?)
}

/// The legend's name for pipeline device `d` of `pp` over `ranks` ranks (rank r runs device
/// r mod pp) with its `peak`, or `every device` without a pipeline.
fn device_label(pipelined: bool, d: usize, pp: usize, ranks: usize, peak: u64) -> String {
    if !pipelined {
        return "every device".to_string();
    }
    let mine: Vec<String> = (d..ranks).step_by(pp.max(1)).map(|r| r.to_string()).collect();
    let who = match mine.len() {
        1 => format!("rank {}", mine[0]),
        2..=4 => format!("ranks {}", mine.join(", ")),
        n => format!("{n} ranks"),
    };
    format!("pipeline device {d} ({who}): peak {}", bytes(peak))
}

/// A loss curve as an SVG document: `losses` as `(step, loss)` on a line (its points circled
/// on short runs), and the held-out loss `eval` as a point labelled with its value. Non-finite
/// losses (an fp16 overflow) are left out.
pub fn loss_svg(title: &str, losses: &[(u64, f64)], eval: Option<(u64, f64)>) -> Result<String> {
    let finite: Vec<(f64, f64)> =
        losses.iter().filter(|p| p.1.is_finite()).map(|&(s, l)| (s as f64, l)).collect();
    let eval = eval.filter(|e| e.1.is_finite()).map(|(s, l)| (s as f64, l));
    let all = || finite.iter().chain(eval.iter());
    let (Some(lo), Some(hi)) =
        (all().map(|p| p.1).reduce(f64::min), all().map(|p| p.1).reduce(f64::max))
    else {
        bail!("the run has no finite loss to plot");
    };
    let (x0, x1) = (
        all().map(|p| p.0).fold(f64::INFINITY, f64::min),
        all().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max),
    );
    let (x0, x1) = if x1 > x0 { (x0, x1) } else { (x0 - 0.5, x1 + 0.5) };
    let pad = if hi > lo { 0.08 * (hi - lo) } else { 0.5 };
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(drawing)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(x0..x1, (lo - pad)..(hi + 2.0 * pad))
            .map_err(drawing)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss")
            // At most one label per step: whole steps only.
            .x_labels(((x1 - x0) as usize + 1).min(11))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{}", (y * 1000.0).round() / 1000.0))
            .draw()
            .map_err(drawing)?;
        let colour = COLOURS[0];
        chart
            .draw_series(std::iter::once(PathElement::new(finite.clone(), colour.stroke_width(2))))
            .map_err(drawing)?
            .label("train loss")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], colour.stroke_width(2)));
        if finite.len() <= 50 {
            let dots = finite.iter().map(|&p| Circle::new(p, 3, colour.filled()));
            chart.draw_series(dots).map_err(drawing)?;
        }
        if let Some(e) = eval {
            let held = COLOURS[1];
            chart
                .draw_series(std::iter::once(Circle::new(e, 6, held.filled())))
                .map_err(drawing)?
                .label("held-out loss")
                .legend(move |(x, y)| Circle::new((x + 12, y), 5, held.filled()));
            let font = ("sans-serif", 14)
                .into_font()
                .color(&held)
                .pos(Pos::new(HPos::Right, VPos::Bottom));
            // Left of the point and above it, clear of its circle.
            let text =
                EmptyElement::at(e) + Text::new(format!("held-out {:.4}", e.1), (-9, -5), font);
            chart.draw_series(std::iter::once(text)).map_err(drawing)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(drawing)?;
        root.present().map_err(drawing)?;
    }
    Ok(buf)
}

/// `train --plot`: the run's loss per step and its held-out loss (at the last step), written
/// at the end of the run.
pub fn write_train_plot(path: &Path, ctx: &RunContext, o: &RankOutcome) -> Result<()> {
    let losses: Vec<(u64, f64)> = o.steps.iter().map(|(s, _)| (s.step, s.loss)).collect();
    let last = losses.last().map_or(ctx.last_step, |p| p.0);
    let n = o.measured_peak.len();
    let title = format!(
        "{} · {n} device{} · plan {} · batch {} × seq {}",
        ctx.cfg.name(),
        if n == 1 { "" } else { "s" },
        ctx.plan.config,
        ctx.args.batch,
        ctx.seq
    );
    let svg = loss_svg(&title, &losses, o.eval.map(|e| (last, e.loss)))?;
    write_svg(path, "--plot", &svg)
}
