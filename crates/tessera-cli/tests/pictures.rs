//! The SVG pictures as users ask for them: `profile --timeline-svg`, `plan --memory-svg` and
//! `train --plot`. Each picture is checked against what the same command reports elsewhere:
//! the timeline CSV, the `--format json` peaks, the step log.

use std::path::PathBuf;
use std::process::{Command, Output};
use tessera_plan::units::format_bytes;

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("tessera runs")
}

/// Runs `args`, which must succeed, and returns its stdout.
fn ok(args: &[&str]) -> String {
    let out = tessera(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

fn temp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("pictures-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A written picture: an SVG document, whole.
fn read_svg(path: &std::path::Path) -> String {
    let doc = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(doc.starts_with("<svg") || doc.starts_with("<?xml"), "not an SVG: {}", &doc[..80]);
    assert!(doc.trim_end().ends_with("</svg>"), "the SVG is cut short");
    doc
}

/// The points `(x, y)` of every `<polyline>` of the document, in pixels.
fn polylines(doc: &str) -> Vec<Vec<(f64, f64)>> {
    doc.split("<polyline")
        .skip(1)
        .map(|el| {
            let points = el.split("points=\"").nth(1).and_then(|p| p.split('"').next()).unwrap();
            points
                .split_whitespace()
                .map(|xy| {
                    let (x, y) = xy.split_once(',').unwrap();
                    (x.parse().unwrap(), y.parse().unwrap())
                })
                .collect()
        })
        .collect()
}

/// The data curves: polylines of more than two points (axes, legend samples and peak rules
/// have two).
fn curves(doc: &str) -> Vec<Vec<(f64, f64)>> {
    polylines(doc).into_iter().filter(|p| p.len() > 2).collect()
}

/// The text of every `<text>` element (plotters puts it on its own line).
fn texts(doc: &str) -> Vec<String> {
    doc.split("<text")
        .skip(1)
        .filter_map(|el| Some(el.split_once('>')?.1.split("</text>").next()?.trim().to_string()))
        .collect()
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The profile's timeline drawn: one curve with a point per row of the `--timeline` CSV, and
/// the peak labelled with `--format json`'s `memory.peak_bytes` at the CSV's highest row.
#[test]
fn the_timeline_svg_draws_the_csv_and_labels_the_json_peak() {
    let dir = temp("profile");
    let (csv, svg) = (dir.join("timeline.csv"), dir.join("timeline.svg"));
    let out = ok(&[
        "profile",
        "--model",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "64",
        "--format",
        "json",
        "--timeline",
        csv.to_str().unwrap(),
        "--timeline-svg",
        svg.to_str().unwrap(),
    ]);
    let peak = json(&out)["memory"]["peak_bytes"].as_u64().expect("memory.peak_bytes");
    let rows: Vec<(u64, u64)> = std::fs::read_to_string(&csv)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| {
            let (i, b) = l.split_once(',').unwrap();
            (i.parse().unwrap(), b.parse().unwrap())
        })
        .collect();
    let highest = rows.iter().copied().reduce(|a, r| if r.1 > a.1 { r } else { a }).unwrap();
    assert_eq!(highest.1, peak);
    let doc = read_svg(&svg);
    let lines = curves(&doc);
    assert_eq!(lines.len(), 1, "one curve");
    assert_eq!(lines[0].len(), rows.len(), "a point per CSV row");
    let label = format!("peak {} at instruction {}", format_bytes(peak), highest.0);
    assert!(texts(&doc).contains(&label), "no `{label}` in {:?}", texts(&doc));
    // The peak is the curve's highest point: the smallest pixel y.
    let top = lines[0].iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    assert_eq!(lines[0][highest.0 as usize].1, top);
    std::fs::remove_dir_all(&dir).ok();
}

/// The README's profile picture, as written.
#[test]
fn the_readme_timeline_svg_command_runs() {
    let dir = temp("readme-profile");
    let svg = dir.join("timeline.svg");
    ok(&[
        "profile",
        "--model",
        "gpt2-tiny",
        "--seq",
        "256",
        "--timeline-svg",
        svg.to_str().unwrap(),
    ]);
    let doc = read_svg(&svg);
    assert_eq!(curves(&doc).len(), 1);
    std::fs::remove_dir_all(&dir).ok();
}

/// A plan without a pipeline: every device runs one Program, so one curve, `every device`,
/// its peak the plan's predicted per-device peak.
#[test]
fn a_flat_plan_draws_one_curve_for_every_device() {
    let dir = temp("flat");
    let svg = dir.join("memory.svg");
    let out = ok(&[
        "plan",
        "--model",
        "gpt2-tiny",
        "--cluster",
        "2xcpu",
        "--batch",
        "2",
        "--seq",
        "64",
        "--plan",
        "dp2",
        "--format",
        "json",
        "--memory-svg",
        svg.to_str().unwrap(),
    ]);
    let peaks = json(&out)["predicted"]["peak_bytes_per_device"].clone();
    let peaks: Vec<u64> = peaks.as_array().unwrap().iter().map(|p| p.as_u64().unwrap()).collect();
    assert_eq!(peaks.len(), 2);
    let doc = read_svg(&svg);
    assert_eq!(curves(&doc).len(), 1, "one Program, one curve");
    let t = texts(&doc);
    assert!(t.contains(&"every device".to_string()), "{t:?}");
    let label = format!("predicted peak {} per device", format_bytes(peaks[0]));
    assert!(t.contains(&label), "no `{label}` in {t:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The README's pipelined plan, as written: a curve per pipeline device, each labelled with
/// its stage's `peak_bytes` from `--format json`, the worst marked as the predicted peak.
#[test]
fn the_readme_memory_svg_command_draws_each_pipeline_device() {
    let dir = temp("pipeline");
    let svg = dir.join("memory.svg");
    let run = ["plan", "--model", "gpt2-tiny", "--cluster", "4xcpu", "--batch", "8", "--seq", "32"];
    let args = [&run[..], &["--plan", "pp4 mb4", "--memory-svg", svg.to_str().unwrap()]].concat();
    ok(&args);
    let doc = read_svg(&svg);
    let plan = json(&ok(&[&run[..], &["--plan", "pp4 mb4", "--format", "json"]].concat()));
    let stages = plan["pipeline"]["stages"].as_array().expect("pipeline.stages");
    assert_eq!(stages.len(), 4);
    assert_eq!(curves(&doc).len(), 4, "a curve per pipeline device");
    let t = texts(&doc);
    for (d, stage) in stages.iter().enumerate() {
        let peak = stage["peak_bytes"].as_u64().unwrap();
        let label = format!("pipeline device {d} (rank {d}): peak {}", format_bytes(peak));
        assert!(t.contains(&label), "no `{label}` in {t:?}");
    }
    let peaks = plan["predicted"]["peak_bytes_per_device"].as_array().unwrap();
    let worst = peaks.iter().map(|p| p.as_u64().unwrap()).max().unwrap();
    let first_worst = peaks.iter().position(|p| p.as_u64() == Some(worst)).unwrap();
    let label = format!("predicted peak {} (pipeline device {first_worst})", format_bytes(worst));
    assert!(t.contains(&label), "no `{label}` in {t:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `train --plot`: a point per step, in the order of the step log's losses (a higher loss is
/// higher up, a smaller pixel y), and the held-out loss `--format json` reports.
#[test]
fn the_loss_plot_has_every_step_and_the_held_out_loss() {
    let dir = temp("train");
    let (svg, log) = (dir.join("loss.svg"), dir.join("steps.jsonl"));
    let out = ok(&[
        "train",
        "--devices",
        "2",
        "--steps",
        "3",
        "--batch",
        "2",
        "--seq",
        "64",
        "--format",
        "json",
        "--log-json",
        log.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let report = json(&out);
    let losses: Vec<f64> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| json(l)["loss"].as_f64().unwrap())
        .collect();
    assert_eq!(losses.len(), 3);
    let doc = read_svg(&svg);
    let lines = curves(&doc);
    assert_eq!(lines.len(), 1, "one loss curve");
    let line = &lines[0];
    assert_eq!(line.len(), 3, "a point per step");
    assert!(line.windows(2).all(|w| w[0].0 < w[1].0), "steps left to right: {line:?}");
    for i in 0..3 {
        for j in 0..3 {
            if losses[i] > losses[j] {
                assert!(line[i].1 < line[j].1, "loss {losses:?} drawn at {line:?}");
            }
        }
    }
    let eval = report["eval_loss"].as_f64().expect("the run evaluates");
    let label = format!("held-out {eval:.4}");
    assert!(texts(&doc).contains(&label), "no `{label}` in {:?}", texts(&doc));
    std::fs::remove_dir_all(&dir).ok();
}

/// A destination that cannot be written is one clear error naming the flag — for `train`
/// before the first step — and nothing is left behind.
#[test]
fn bad_destinations_are_one_clear_error() {
    let dir = temp("errors");
    let missing = dir.join("no-such-dir").join("loss.svg");
    let cases: [(Vec<&str>, &str); 3] = [
        (
            vec![
                "train",
                "--devices",
                "1",
                "--steps",
                "2",
                "--batch",
                "2",
                "--seq",
                "64",
                "--plot",
                missing.to_str().unwrap(),
            ],
            "--plot",
        ),
        (
            vec![
                "profile",
                "--model",
                "gpt2-tiny",
                "--batch",
                "2",
                "--seq",
                "64",
                "--timeline-svg",
                dir.to_str().unwrap(),
            ],
            "--timeline-svg",
        ),
        (
            vec![
                "plan",
                "--model",
                "gpt2-tiny",
                "--cluster",
                "2xcpu",
                "--batch",
                "2",
                "--seq",
                "64",
                "--memory-svg",
                missing.to_str().unwrap(),
            ],
            "--memory-svg",
        ),
    ];
    for (args, flag) in cases {
        let out = tessera(&args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{err}");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "one line, before any step: {err}");
        assert!(lines[0].starts_with("error: ") && lines[0].contains(flag), "{err}");
    }
    assert!(!dir.join("no-such-dir").exists());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "nothing written");
    std::fs::remove_dir_all(&dir).ok();
}
