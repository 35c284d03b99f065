//! Pipeline parallelism end to end through the binary (issue 18): every pipelined plan trains
//! like one device — per-step loss and gradient norm within 1e-5 relative of the single-device
//! run with the same micro-batches — and each device's measured peak and traffic
//! (point-to-point transfers included) equal the plan's prediction.

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().expect("tessera runs")
}

/// `tessera plan` for gpt2-tiny on 4 simulated devices, batch 8 × 32, and `extra`.
fn plan_tiny(extra: &[&str]) -> Output {
    let mut args =
        vec!["plan", "--model", "gpt2-tiny", "--cluster", "4xcpu", "--batch", "8", "--seq", "32"];
    args.extend(extra);
    tessera(&args)
}

fn temp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("pipeline-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Trains `model` for 3 steps under `plan` on `devices`: the report and `(loss, grad_norm)`
/// per step.
fn train(model: &str, devices: usize, plan: &str) -> (Value, Vec<(f64, f64)>) {
    let dir = temp(&format!("{model}-{devices}-{}", plan.replace([' ', ':', '='], "_")));
    let log = dir.join("steps.jsonl");
    let devices = devices.to_string();
    let args = [
        "train",
        "--model",
        model,
        "--steps",
        "3",
        "--batch",
        "8",
        "--seq",
        "32",
        "--devices",
        &devices,
        "--plan",
        plan,
        "--eval-batches",
        "0",
        "--format",
        "json",
        "--log-json",
        log.to_str().unwrap(),
    ];
    let out = tessera(&args);
    assert!(out.status.success(), "{plan}: {}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    (doc, steps(&log))
}

/// `(loss, grad_norm)` per step of a `--log-json` file.
fn steps(log: &std::path::Path) -> Vec<(f64, f64)> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["loss"].as_f64().unwrap(), v["grad_norm"].as_f64().unwrap())
        })
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    within(a, b, 1e-5)
}

fn within(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs())
}

fn check(model: &str, mb: usize, plans: &[(usize, &str)]) {
    let (_, single) = train(model, 1, &format!("mb{mb}"));
    assert_eq!(single.len(), 3);
    for &(devices, plan) in plans {
        let (doc, steps) = train(model, devices, plan);
        assert_eq!(doc["devices"], devices, "{plan}: {doc}");
        assert!(doc["pipeline"].is_null() || doc["pipeline"].is_object());
        for (k, (s, p)) in single.iter().zip(&steps).enumerate() {
            assert!(close(s.0, p.0), "{model} {plan} step {}: loss {} vs {}", k + 1, p.0, s.0);
            // The gradient norm sums the squares of every gradient: tensor-parallel row
            // layers add their halves in another order, and that rounding (~1e-7 per element
            // in fp32) reaches later steps through Adam's normalised updates.
            let norm_tol = if plan.contains("tp") { 2e-5 } else { 1e-5 };
            assert!(
                within(s.1, p.1, norm_tol),
                "{model} {plan} step {}: norm {} vs {}",
                k + 1,
                p.1,
                s.1
            );
        }
        let m = &doc["memory"];
        assert_eq!(m["measured_peak_bytes"], m["predicted_peak_bytes"], "{plan}: {m}");
        let c = &doc["comm"];
        assert_eq!(c["measured_bytes"], c["predicted_bytes"], "{plan}: {c}");
        let sent = c["measured_calls"]["send"].as_u64().unwrap_or(0);
        assert!(sent > 0, "{plan}: no point-to-point transfer was counted: {c}");
    }
}

#[test]
fn gpt2_pipelines_train_like_one_device() {
    check(
        "gpt2-tiny",
        4,
        &[
            (2, "pp2 mb4"),
            (4, "pp4 mb4"),
            (4, "dp2 pp2 mb4"),
            (4, "tp2 pp2 mb4"),
            (2, "pp2 mb4 sched=interleaved:2"),
            (2, "pp2 mb4 sched=zb-h1"),
            (4, "tp2 pp2 mb4 sched=zb-h1"),
            (8, "dp2 tp2 pp2 mb4 zero1"),
            // Unequal stages, each with its own checkpointing.
            (2, "pp2 mb4 stages=3:full,5"),
        ],
    );
}

#[test]
fn llama_pipelines_train_like_one_device() {
    check(
        "llama-tiny",
        2,
        &[
            (2, "pp2 mb2"),
            (4, "pp4 mb2 sched=gpipe"),
            (4, "dp2 pp2 mb2"),
            (4, "tp2 pp2 mb2"),
            (2, "pp2 mb2 sched=zb-h1"),
            (4, "pp4 mb2 stages=1,3,2:selective,2"),
        ],
    );
}

/// Trains gpt2-tiny (batch 8 × 32, 4 steps) with `extra`: the report and `(loss, grad_norm)`
/// per step run.
fn run_4_steps(dir: &std::path::Path, name: &str, extra: &[&str]) -> (Value, Vec<(f64, f64)>) {
    let log = dir.join(format!("{name}.jsonl"));
    let mut args = vec!["train", "--model", "gpt2-tiny", "--steps", "4", "--batch", "8"];
    args.extend(["--seq", "32", "--format", "json", "--log-json", log.to_str().unwrap()]);
    args.extend(extra);
    let out = tessera(&args);
    assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
    (serde_json::from_slice(&out.stdout).expect("JSON report"), steps(&log))
}

/// Sharded checkpoints under pipelines (issue 18): `dp2 pp2 zero1` on 4 devices saves at step 2
/// (each stage writes its own parameters and optimizer state, GPT-2's tied embedding once), a
/// `tp2` run resumes it to step 3 and saves, and a `pp2` run resumes that to step 4 and
/// evaluates. The chained curve is the uninterrupted single-device one within 1e-5, and the
/// pipelined run's held-out loss (its parameters gathered from both stages) is the
/// single-device run's.
#[test]
fn pipelined_checkpoints_resume_under_any_plan_and_back() {
    let dir = temp("resume");
    let (ck_a, ck_b) = (dir.join("a"), dir.join("b"));
    let (ref_doc, reference) =
        run_4_steps(&dir, "single", &["--devices", "1", "--plan", "mb4", "--eval-batches", "1"]);
    let (_, a) = run_4_steps(
        &dir,
        "a",
        &[
            "--devices",
            "4",
            "--plan",
            "dp2 pp2 mb4 zero1",
            "--eval-batches",
            "0",
            "--stop-after",
            "2",
            "--save",
            ck_a.to_str().unwrap(),
        ],
    );
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(ck_a.join("manifest.json")).unwrap())
            .unwrap();
    let tensors = manifest["sharded"]["tensors"].as_array().expect("a sharded manifest");
    let wte = tensors.iter().find(|t| t["name"] == "transformer.wte.weight").expect("wte saved");
    let last = tensors.iter().find(|t| t["name"] == "transformer.ln_f.weight").expect("ln_f");
    // Written by the stage that holds it: the embedding by stage 0 (pipeline coordinate 0 of
    // mesh [dp, pp]), the final norm by stage 1 (odd ranks).
    let ranks = |t: &Value| -> Vec<u64> {
        t["chunks"].as_array().unwrap().iter().map(|c| c["rank"].as_u64().unwrap()).collect()
    };
    assert!(ranks(wte).iter().all(|r| r % 2 == 0), "{wte}");
    assert!(ranks(last).iter().all(|r| r % 2 == 1), "{last}");
    // Every file and tensor checks out, and the export gathers both stages' parameters.
    let out = tessera(&["checkpoint", "verify", ck_a.to_str().unwrap(), "--format", "json"]);
    assert!(out.status.success(), "verify: {}", String::from_utf8_lossy(&out.stderr));
    let verified: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!((verified["ok"].as_bool(), verified["step"].as_u64()), (Some(true), Some(2)));
    let hf = dir.join("hf");
    let out =
        tessera(&["export", "--checkpoint", ck_a.to_str().unwrap(), "--hf", hf.to_str().unwrap()]);
    assert!(out.status.success(), "export: {}", String::from_utf8_lossy(&out.stderr));
    assert!(hf.join("model.safetensors").is_file());
    let (_, b) = run_4_steps(
        &dir,
        "b",
        &[
            "--devices",
            "2",
            "--plan",
            "tp2",
            "--eval-batches",
            "0",
            "--resume",
            ck_a.to_str().unwrap(),
            "--stop-after",
            "3",
            "--save",
            ck_b.to_str().unwrap(),
        ],
    );
    let (doc, c) = run_4_steps(
        &dir,
        "c",
        &[
            "--devices",
            "2",
            "--plan",
            "pp2 mb4",
            "--eval-batches",
            "1",
            "--resume",
            ck_b.to_str().unwrap(),
        ],
    );
    let chained: Vec<_> = a.iter().chain(&b).chain(&c).collect();
    assert_eq!(chained.len(), 4);
    for (k, (got, want)) in chained.iter().zip(&reference).enumerate() {
        assert!(
            close(got.0, want.0) && close(got.1, want.1),
            "step {}: loss {} norm {} vs one device {} {}",
            k + 1,
            got.0,
            got.1,
            want.0,
            want.1
        );
    }
    let (e, want) = (doc["eval_loss"].as_f64(), ref_doc["eval_loss"].as_f64());
    assert!(e.zip(want).is_some_and(|(e, w)| close(e, w)), "eval {e:?} vs one device {want:?}");
}

#[test]
fn a_pipelined_plan_lists_its_stages_and_bubble() {
    // The schedule written: unwritten, the planner picks the fastest (ZB-H1 here).
    let out = plan_tiny(&["--plan", "dp2 pp2 mb4 sched=1f1b", "--format", "json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON plan");
    assert_eq!(doc["config"], "dp2 tp1 pp2 mb4 sched=1f1b", "{doc}");
    assert_eq!(doc["devices"], 4);
    let p = &doc["pipeline"];
    assert_eq!(p["schedule"], "1f1b", "{p}");
    let stages = p["stages"].as_array().expect("stages");
    assert_eq!(stages.len(), 2);
    // gpt2-tiny's 8 blocks, evenly; the pipeline axis is the mesh's last.
    assert_eq!(stages[0]["blocks"], serde_json::json!([0, 4]));
    assert_eq!(stages[1]["blocks"], serde_json::json!([4, 8]));
    assert_eq!(stages[0]["devices"], serde_json::json!([0, 2]));
    assert_eq!(stages[1]["devices"], serde_json::json!([1, 3]));
    let peaks = doc["predicted"]["peak_bytes_per_device"].as_array().unwrap();
    assert_eq!(peaks[0], stages[0]["peak_bytes"]);
    assert_eq!(peaks[1], stages[1]["peak_bytes"]);
    // 1F1B's bubble with equal stages: (p - 1) / (m + p - 1) = 1/5, give or take the
    // stages' unequal work (embedding, head) and transfers.
    let bubble = doc["predicted"]["bubble_fraction"].as_f64().expect("bubble_fraction");
    assert!((0.1..0.45).contains(&bubble), "bubble {bubble}");
}

#[test]
fn unequal_stages_are_planned_as_written() {
    let cfg = "pp4 mb4 sched=1f1b stages=1:full,3,2:selective,2";
    let out = plan_tiny(&["--plan", cfg, "--format", "json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON plan");
    assert_eq!(doc["config"], "dp1 tp1 pp4 mb4 sched=1f1b stages=1:full,3,2:selective,2", "{doc}");
    let stages = doc["pipeline"]["stages"].as_array().expect("stages");
    let blocks: Vec<&Value> = stages.iter().map(|s| &s["blocks"]).collect();
    assert_eq!(serde_json::json!(blocks), serde_json::json!([[0, 1], [1, 4], [4, 6], [6, 8]]));
    let modes: Vec<&str> =
        doc["checkpoint"].as_array().unwrap().iter().map(|c| c["mode"].as_str().unwrap()).collect();
    let want = ["full", "none", "none", "none", "selective", "selective", "none", "none"];
    assert_eq!(modes, want);
    // --explain: each stage with its blocks and checkpointing.
    let out = plan_tiny(&["--plan", cfg, "--explain"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for (i, (blocks, mode)) in
        [("0..1", "full"), ("1..4", "none"), ("4..6", "selective"), ("6..8", "none")]
            .iter()
            .enumerate()
    {
        let line = text.lines().find(|l| l.trim_start().starts_with(&format!("{i} ")));
        let line = line.unwrap_or_else(|| panic!("no line for stage {i}:\n{text}"));
        assert!(line.contains(blocks) && line.contains(mode), "{line}");
    }
    // Stages that do not match the pipeline or the model: a clear error.
    for (bad, want) in [
        ("pp4 stages=1,2,5", "lists 3 stages but pp4 makes 4"),
        ("dp2 pp2 stages=3,3", "covers 6 blocks but the model has 8"),
    ] {
        let out = plan_tiny(&["--plan", bad]);
        assert!(!out.status.success(), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{bad}: {err}");
    }
}

#[test]
fn explain_lists_stages_and_draws_the_schedule() {
    let dir = temp("explain");
    let svg = dir.join("schedule.svg");
    let svg_arg = svg.to_str().unwrap();
    let out = plan_tiny(&["--plan", "pp4 mb4 sched=1f1b", "--explain", "--schedule-svg", svg_arg]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("pipeline 1f1b over 4 devices, 4 micro-batches, bubble"), "{text}");
    // gpt2-tiny's 8 blocks, two per stage; rank r runs stage r (pp is the only axis).
    for (i, blocks) in ["0..2", "2..4", "4..6", "6..8"].iter().enumerate() {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{i} ")) && l.contains(blocks))
            .unwrap_or_else(|| panic!("no line for stage {i} ({blocks}):\n{text}"));
        assert!(line.contains("MiB") || line.contains("KiB"), "{line}");
    }
    assert!(text.contains("(worst)"), "{text}");
    // The Gantt chart: one row per device, 96 columns. Under 1F1B the first device starts with
    // micro-batch 0's forward; the last waits for it to cross three stages, then starts.
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with('d') && l.contains('|')).collect();
    assert_eq!(rows.len(), 4, "{text}");
    for r in &rows {
        let chart = r.split('|').nth(1).expect("a chart between bars");
        assert_eq!(chart.chars().count(), 96, "{r}");
        assert!(chart.contains('B') && chart.contains('0'), "{r}");
    }
    assert!(rows[0].split('|').nth(1).unwrap().starts_with('0'), "{}", rows[0]);
    assert!(rows[3].split('|').nth(1).unwrap().starts_with('.'), "{}", rows[3]);
    let doc = std::fs::read_to_string(&svg).expect("the SVG was written");
    assert!(doc.contains("<svg"), "not an SVG");
    // A row label per device (plotters writes each text element's content on its own line).
    for d in 0..4 {
        assert!(doc.lines().any(|l| l.trim() == format!("d{d}")), "no row label d{d}");
    }
    // One rectangle per slot: 4 devices × 4 micro-batches × (F, B), plus the background.
    assert!(doc.matches("<rect").count() > 32, "too few rectangles");

    // A plan without a pipeline has no schedule to draw: a clear error, nothing written.
    let flat = dir.join("flat.svg");
    let out = plan_tiny(&["--plan", "dp4", "--schedule-svg", flat.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("has no pipeline") && err.contains("ppN"), "{err}");
    assert!(!flat.exists());
}

/// The automatic search's pipeline phase: on two machines joined by a slow link (20 MB/s),
/// every plan without a pipeline either synchronises gradients or tensor-parallel activations
/// across it or computes everything twice, while a pipeline halves the compute and sends only
/// a micro-batch's boundary activations. The search must find the
/// pipeline, price it at least as fast as each fixed alternative, and the plan must train
/// like one device with its prediction measured exactly.
#[test]
fn the_automatic_plan_pipelines_across_a_slow_link_and_trains_like_one_device() {
    let dir = temp("auto");
    let cluster = dir.join("slow.toml");
    std::fs::write(
        &cluster,
        "nodes = 2\ngpus_per_node = 1\ndevice = \"cpu\"\n[inter]\nlatency_s = 1e-4\nbandwidth = 2e7\n",
    )
    .unwrap();
    let cluster = cluster.to_str().unwrap();
    let plan_file = dir.join("plan.json");
    let common = ["--model", "llama-tiny", "--cluster", cluster, "--batch", "8", "--seq", "32"];
    let plan = |extra: &[&str]| -> Value {
        let mut args = vec!["plan"];
        args.extend(common);
        args.extend(["--dtype", "fp32", "--format", "json"]);
        args.extend(extra);
        let out = tessera(&args);
        assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("JSON plan")
    };
    let auto = plan(&["--out", plan_file.to_str().unwrap()]);
    assert_eq!(auto["source"], "auto", "{auto}");
    assert!(auto["config"].as_str().unwrap().contains("pp2"), "{}", auto["config"]);
    assert_eq!(auto["pipeline"]["devices"], 2, "{auto}");
    let step = auto["predicted"]["step_time_s"].as_f64().unwrap();
    for fixed in ["dp2", "dp2 zero1", "dp2 zero3", "tp2", "dp2 mb4"] {
        let other = plan(&["--plan", fixed]);
        let t = other["predicted"]["step_time_s"].as_f64().unwrap();
        assert!(step <= t, "auto {step} s is slower than `{fixed}` at {t} s");
    }
    // The plan trains as it says.
    let mb = auto["micro_batches"].as_u64().unwrap() as usize;
    let (_, single) = train("llama-tiny", 1, &format!("mb{mb}"));
    let (doc, steps) = {
        let log = dir.join("steps.jsonl");
        let mut args = vec!["train"];
        args.extend(common);
        args.extend(["--devices", "2", "--steps", "3", "--eval-batches", "0", "--format", "json"]);
        args.extend(["--plan", plan_file.to_str().unwrap(), "--log-json", log.to_str().unwrap()]);
        let out = tessera(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
        (doc, steps(&log))
    };
    assert_eq!(steps.len(), single.len());
    for (k, (s, p)) in single.iter().zip(&steps).enumerate() {
        assert!(close(s.0, p.0) && close(s.1, p.1), "step {}: {p:?} vs one device {s:?}", k + 1);
    }
    let m = &doc["memory"];
    assert_eq!(m["measured_peak_bytes"], m["predicted_peak_bytes"], "{m}");
    let c = &doc["comm"];
    assert_eq!(c["measured_bytes"], c["predicted_bytes"], "{c}");
}
