//! `tessera plan` as users run it: the JSON contract, fixed configurations, plan files, and one
//! clear error line (no panic) for each kind of bad input.

use std::process::Command;

fn tessera(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const SMALL: &[&str] = &["plan", "--model", "gpt2-tiny", "--batch", "8", "--seq", "64"];

fn plan(extra: &[&str]) -> serde_json::Value {
    let args: Vec<&str> = SMALL.iter().chain(extra).copied().collect();
    let (ok, out, err) = tessera(&args);
    assert!(ok, "{err}");
    serde_json::from_str(&out).unwrap()
}

fn fails(extra: &[&str], needle: &str) {
    let args: Vec<&str> = SMALL.iter().chain(extra).copied().collect();
    let (ok, _, err) = tessera(&args);
    assert!(!ok, "{args:?} should fail");
    assert!(err.starts_with("error: "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains(needle), "{args:?}: `{err}` should mention `{needle}`");
}

#[test]
fn json_has_the_promised_keys_and_the_baseline_is_no_faster() {
    let v = plan(&["--cluster", "4xH100", "--baseline", "megatron", "--format", "json"]);
    // The layout says whether the config string reproduces the plan.
    assert!(matches!(v["layout"].as_str(), Some("megatron" | "per-op")), "{}", v["layout"]);
    // A pipelined plan's mesh is one stage's; the pipeline multiplies it.
    let stages = v["pipeline"]["devices"].as_u64().unwrap_or(1);
    assert_eq!(
        v["mesh"]["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).product::<u64>()
            * stages,
        4
    );
    let peaks = v["predicted"]["peak_bytes_per_device"].as_array().unwrap();
    assert_eq!(peaks.len(), 4);
    assert!(v["predicted"]["mfu"].as_f64().unwrap() > 0.0);
    assert!(v["search_ms"].as_f64().unwrap() >= 0.0);
    let t = v["predicted"]["step_time_s"].as_f64().unwrap();
    let m = v["baselines"]["megatron"]["step_time_s"].as_f64().unwrap();
    assert!(t <= m * (1.0 + 1e-9), "auto {t} vs megatron {m}");
    assert!(v["config"].as_str().unwrap().starts_with("dp"));
}

#[test]
fn fixed_configurations_and_plan_files_round_trip() {
    let v = plan(&["--cluster", "4xH100", "--plan", "tp2+dp2 zero1", "--format", "json"]);
    assert_eq!(v["config"], "dp2 tp2 zero1");
    assert_eq!(v["zero_stage"], 1);
    let dir = std::env::temp_dir().join(format!("tessera-plan-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("plan.json");
    std::fs::write(&file, serde_json::to_string(&v).unwrap()).unwrap();
    let again =
        plan(&["--cluster", "4xH100", "--plan", file.to_str().unwrap(), "--format", "json"]);
    assert_eq!(again["predicted"]["step_time_s"], v["predicted"]["step_time_s"]);
    assert_eq!(
        again["predicted"]["peak_bytes_per_device"],
        v["predicted"]["peak_bytes_per_device"]
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_input_is_one_clear_error() {
    fails(&["--cluster", "8xH1000"], "H100");
    fails(&["--cluster", "4xH100", "--plan", "dp2 tq2"], "tq2");
    fails(&["--cluster", "4xH100", "--plan", "dp2 tp4"], "8");
    fails(&["--cluster", "4xH100", "--plan", "dp2 pp4"], "8 devices");
    fails(&["--cluster", "4xH100", "--plan", "dp4 mb4"], "batch");
    // Device memory alone (no host to offload to: `tests/offload.rs` has that case).
    let device_only = ["--host-memory", "0"];
    fails(
        &["--cluster", "4xH100", "--memory-budget", "1MiB", device_only[0], device_only[1]],
        "least any plan needs",
    );
    fails(&["--cluster", "4xH100", "--memory-budget", "lots"], "invalid memory size");
}

/// A plan file is made for one run (model, batch, sequence, precision): `train --plan FILE`
/// and `plan --plan FILE` take it from the file, and refuse a flag that disagrees, naming both
/// values (issue 20: a bf16 plan used to fail under train's fp32 default, and a plan for one
/// batch to run silently at another).
#[test]
fn a_plan_file_carries_its_run() {
    let dir = std::env::temp_dir().join(format!("tessera-plan-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("plan.json");
    let f = file.to_str().unwrap();
    let made = ["--model", "llama-tiny", "--cluster", "2xcpu", "--batch", "4", "--seq", "32"];
    let args: Vec<&str> = ["plan"].iter().chain(&made).copied().chain(["--out", f]).collect();
    let (ok, _, err) = tessera(&[&args[..], &["--format", "json"]].concat());
    assert!(ok, "{err}");
    let planned: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(planned["dtype"], "bf16", "plan's default precision");

    // None of the run's flags given: train runs the planned one (bf16, 4 × 32, llama-tiny).
    let run = ["train", "--plan", f, "--devices", "2", "--steps", "1", "--eval-batches", "1"];
    let (ok, out, err) = tessera(&[&run[..], &["--format", "json"]].concat());
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["model"].as_str(), v["batch"].as_u64(), v["seq"].as_u64()),
        (Some("llama-tiny"), Some(4), Some(32))
    );
    // The plan's own memory figures, so its precision too (fp32 would double the weights).
    let peaks = &planned["predicted"]["peak_bytes_per_device"];
    assert_eq!(&v["memory"]["predicted_peak_bytes"], peaks);
    assert_eq!(v["memory"]["measured_peak_bytes"], v["memory"]["predicted_peak_bytes"]);

    // Given and equal to the file's: accepted (plan re-evaluates the file).
    let again = ["plan", "--plan", f, "--cluster", "2xcpu", "--batch", "4", "--format", "json"];
    let (ok, out, err) = tessera(&again);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["predicted"]["peak_bytes_per_device"], *peaks);

    // Given and different: one error naming the flag, both values and the way out.
    for (cmd, flag, value, planned) in [
        ("train", "--batch", "8", "batch 4"),
        ("train", "--seq", "64", "seq 32"),
        ("train", "--dtype", "fp32", "dtype bf16"),
        ("train", "--model", "gpt2-tiny", "model llama-tiny"),
        ("plan", "--dtype", "fp16", "dtype bf16"),
    ] {
        let mut args = vec![cmd, "--plan", f, flag, value];
        if cmd == "train" {
            args.extend(["--devices", "2", "--steps", "1"]);
        }
        let (ok, _, err) = tessera(&args);
        assert!(!ok, "{args:?} should be refused");
        assert!(err.starts_with("error: ") && !err.contains("panicked"), "{err}");
        let given = format!("{flag} {value}");
        for needle in [given.as_str(), planned, f] {
            assert!(err.contains(needle), "{args:?}: `{err}` should mention `{needle}`");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// With `--format json` a failure is data too: one `{"error": {...}}` object on stdout (the
/// human line still on stderr) and a non-zero exit. `infeasible` carries the least memory per
/// device any plan needs, and a budget of exactly that plans (issue 20).
#[test]
fn errors_are_json_under_format_json() {
    let error = |args: &[&str]| -> serde_json::Value {
        let (ok, out, err) = tessera(args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.starts_with("error: "), "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim())
            .unwrap_or_else(|e| panic!("{args:?}: stdout is not one JSON object ({e}): {out}"));
        let message = v["error"]["message"].as_str().unwrap();
        assert_eq!(format!("error: {message}"), err.trim_end(), "the same message on both");
        v["error"].clone()
    };
    // Device memory alone: with host memory 1 MiB plans by offloading everything.
    let base = [SMALL, &["--cluster", "4xH100", "--format", "json", "--host-memory", "0"]].concat();
    let e = error(&[&base[..], &["--memory-budget", "1MiB"]].concat());
    assert_eq!(e["kind"], "infeasible");
    let (needed, budget) =
        (e["needed_bytes"].as_u64().unwrap(), e["budget_bytes"].as_u64().unwrap());
    assert_eq!(budget, 1 << 20);
    assert!(needed > budget && e["hint"].as_str().is_some_and(|h| !h.is_empty()), "{e}");
    let exactly = needed.to_string();
    let (ok, out, err) = tessera(&[&base[..], &["--memory-budget", &exactly]].concat());
    assert!(ok, "a budget of the reported {needed} B must plan: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["predicted"]["peak_bytes_per_device"][0].as_u64().unwrap() <= needed);

    assert_eq!(
        error(&[SMALL, &["--cluster", "8xH1000", "--format", "json"]].concat())["kind"],
        "invalid"
    );
    // A value the parser refuses is a usage error, on stdout as JSON too (issue 43).
    let (ok, out, err) = tessera(&["train", "--steps", "0", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert!(!ok && v["error"]["kind"] == "usage", "{out}");
    assert!(err.contains("--steps") && err.contains("1..="), "{err}");
    // One device has no data-parallel replicas: the advice does not suggest ZeRO.
    let one =
        [SMALL, &["--cluster", "1xH100", "--plan", "dp1", "--memory-budget", "1MiB"]].concat();
    let (ok, _, err) = tessera(&one);
    assert!(!ok && !err.contains("ZeRO"), "{err}");
}

/// A size as `format_bytes` prints it (`31.62 MiB`, `384 B`): bytes, and how far the printed
/// figure may be from the exact one (half its last digit).
fn printed_bytes(s: &str) -> (f64, f64) {
    let (num, unit) = s.trim().split_once(' ').unwrap_or_else(|| panic!("not a size: `{s}`"));
    let scale = match unit {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024f64.powi(4),
        _ => panic!("unknown unit in `{s}`"),
    };
    let v: f64 = num.parse().unwrap_or_else(|_| panic!("not a number: `{s}`"));
    (v * scale, if unit == "B" { 0.0 } else { 0.005 * scale })
}

#[test]
fn explain_has_a_legend_every_block_and_a_peak_made_of_its_parts() {
    let args = [SMALL, &["--cluster", "4xcpu"]].concat();
    let v = plan(&["--cluster", "4xcpu", "--format", "json"]);
    let blocks = v["checkpoint"].as_array().unwrap().len();
    assert_eq!(blocks, 8, "gpt2-tiny has 8 blocks");
    let (ok, text, err) = tessera(&[&args[..], &["--explain"]].concat());
    assert!(ok, "{err}");

    // The legend: the notation and the columns.
    for want in ["    R     replicated", "    S0    split into", "    P0    after the brackets"] {
        assert!(text.lines().any(|l| l.starts_with(want)), "no `{want}`:\n{text}");
    }
    assert!(text.contains("  columns: op"), "{text}");

    // Every block is in some section: `blocks 0–7 (..)`, or `blocks 0–2, 4–7 (..)` and
    // `block 3 (..)`.
    let mut covered = vec![false; blocks];
    for header in text.lines().filter(|l| l.starts_with("block ") || l.starts_with("blocks ")) {
        let list = header.split_once(' ').unwrap().1;
        let list = list.split(" (").next().unwrap();
        for range in list.split(", ") {
            let (a, b) = range.split_once('–').unwrap_or((range, range));
            let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
            for c in &mut covered[a..=b] {
                *c = true;
            }
        }
    }
    assert!(covered.iter().all(|&c| c), "blocks without a section {covered:?}:\n{text}");
    assert!(text.contains("before the blocks") && text.contains("after the blocks"), "{text}");

    // The memory line: the peak, then what is live at it; the parts add up to the peak
    // (within the rounding of the printed figures).
    let start = text.lines().position(|l| l.starts_with("memory    peak ")).expect("memory line");
    let mut memory: Vec<&str> = vec![text.lines().nth(start).unwrap()];
    memory.extend(text.lines().skip(start + 1).take_while(|l| l.starts_with("          ")));
    let memory = memory.join(" ");
    let (head, live) = memory.split_once(" = live at the peak: ").expect("a breakdown");
    let peak = head.strip_prefix("memory    peak ").unwrap().split(" per device").next().unwrap();
    let (peak, peak_err) = printed_bytes(peak);
    let (mut sum, mut err) = (0.0, peak_err);
    let mut names = Vec::new();
    for part in live.split(" + ") {
        let part = part.split_whitespace().collect::<Vec<_>>();
        let (name, size) = part.split_at(part.len() - 2);
        let (b, e) = printed_bytes(&size.join(" "));
        names.push(name.join(" "));
        sum += b;
        err += e;
    }
    assert!((sum - peak).abs() <= err, "parts {sum} vs peak {peak} (±{err}): {memory}");
    for want in ["params", "optimizer", "saved activations"] {
        assert!(names.iter().any(|n| n == want), "no {want} in {names:?}");
    }
    // `--explain`'s table of the same: its rows add up to its `= peak` row.
    let rows: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("memory live at the peak instruction"))
        .skip(1)
        .take_while(|l| l.starts_with("  ") && !l.starts_with("  totals"))
        .collect();
    let size = |l: &str| {
        let w: Vec<&str> = l.split_whitespace().collect();
        let at = w.iter().position(|x| x.ends_with('%')).unwrap();
        printed_bytes(&w[at - 2..at].join(" "))
    };
    let (total, total_err) = size(rows.last().unwrap());
    assert!(rows.last().unwrap().trim_start().starts_with("= peak"), "{rows:?}");
    let parts: Vec<(f64, f64)> = rows[..rows.len() - 1].iter().map(|l| size(l)).collect();
    let sum: f64 = parts.iter().map(|p| p.0).sum();
    let err: f64 = parts.iter().map(|p| p.1).sum::<f64>() + total_err;
    assert!((sum - total).abs() <= err, "{rows:?}");
    assert_eq!(total, peak, "the same peak in the table and the memory line");
}

/// Hybrid sharding (`shard=N`, HSDP) on two 8-GPU nodes: ZeRO-3 shards every parameter over
/// the 8 GPUs of a node only (the mesh `[2, 8, 1]`, its first axis the replicas), so the
/// parameter gathers stay on that axis and the gradients are all-reduced over the other; each
/// device holds 8x less than a replica but 2x more than FSDP over all 16, and the plan file
/// carries the replica axis (lowered again, the same prediction).
#[test]
fn hybrid_sharding_gathers_within_a_node_and_replicates_across() {
    let plan = |config: &str, extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--model",
            "gpt2",
            "--cluster",
            "2x8xH100",
            "--batch",
            "16",
            "--seq",
            "256",
            "--plan",
            config,
        ];
        args.extend_from_slice(extra);
        tessera(&args)
    };
    let run = |config: &str| {
        let (ok, out, err) = plan(config, &["--format", "json"]);
        assert!(ok, "{config}: {err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let hsdp = run("dp16 zero3 shard=8");
    assert_eq!(hsdp["config"], "dp16 tp1 zero3 shard=8");
    assert_eq!(hsdp["mesh"]["shape"], serde_json::json!([2, 8, 1]));
    assert_eq!(hsdp["mesh"]["replicas"], serde_json::json!([0]));
    let param_elems = |v: &serde_json::Value| -> u64 {
        v["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["name"].as_str().unwrap().ends_with(".weight"))
            .map(|t| {
                t["local_shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap())
                    .product::<u64>()
            })
            .sum()
    };
    let (fsdp, ddp) = (run("dp16 zero3"), run("dp16"));
    let (h, f, d) = (param_elems(&hsdp), param_elems(&fsdp), param_elems(&ddp));
    // Weights whose leading dim 8 (or 16) does not divide stay whole in both; the rest split.
    assert!(h > f && h < d, "per-device weight elements: hsdp {h}, fsdp {f}, ddp {d}");
    // Parameters and their optimizer state never split over the replica axis (the batch does).
    for t in hsdp["tensors"].as_array().unwrap() {
        let (name, spec) = (t["name"].as_str().unwrap(), t["spec"].as_str().unwrap());
        if name.contains(".weight") || name.contains(".bias") {
            assert!(!spec.contains('0'), "{name}: {spec} splits over the replica axis");
        }
    }
    let collectives = hsdp["collectives"].as_array().unwrap();
    for c in collectives {
        if c["op"] == "all_gather" {
            assert_eq!(c["axis"], 1, "a parameter gather leaves the node: {c}");
        }
    }
    assert!(
        collectives.iter().any(|c| c["op"] == "all_reduce" && c["axis"] == 0),
        "no gradient all-reduce across the replicas"
    );
    // The plan file keeps the replica axis: lowered again, the same figures.
    let dir = std::env::temp_dir().join(format!("tessera-hsdp-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("plan.json");
    std::fs::write(&file, serde_json::to_string(&hsdp).unwrap()).unwrap();
    let again = run(file.to_str().unwrap());
    assert_eq!(again["predicted"]["step_time_s"], hsdp["predicted"]["step_time_s"]);
    assert_eq!(
        again["predicted"]["peak_bytes_per_device"],
        hsdp["predicted"]["peak_bytes_per_device"]
    );
    // A hand-edited replica axis the mesh lacks: named, not a panic.
    let mut bad = hsdp.clone();
    bad["mesh"]["replicas"] = serde_json::json!([7]);
    std::fs::write(&file, serde_json::to_string(&bad).unwrap()).unwrap();
    let (ok, _, err) = tessera(&[
        "plan",
        "--model",
        "gpt2",
        "--cluster",
        "2x8xH100",
        "--plan",
        file.to_str().unwrap(),
    ]);
    assert!(
        !ok && err.contains("mesh.replicas names axis 7") && !err.contains("panicked"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
    // Said in the human-readable plan.
    let (ok, out, err) = plan("dp16 zero3 shard=8", &[]);
    assert!(ok && out.contains("ZeRO shards within groups of 8 devices; 2 groups"), "{out}{err}");
    // The automatic search tries HSDP among the Megatron configurations: on llama3-8b it is
    // their fastest, ahead of FSDP over all 16 (whose gathers cross the nodes).
    let llama = |extra: &[&str]| -> serde_json::Value {
        let base = ["plan", "--model", "llama3-8b", "--cluster", "2x8xH100", "--batch", "32"];
        let args: Vec<&str> = base
            .iter()
            .chain(&["--seq", "2048", "--format", "json"])
            .chain(extra)
            .copied()
            .collect();
        let (ok, out, err) = tessera(&args);
        assert!(ok, "{extra:?}: {err}");
        serde_json::from_str(&out).unwrap()
    };
    let v = llama(&["--baseline", "megatron"]);
    let best = &v["baselines"]["megatron"];
    assert_eq!(best["config"], "dp16 tp1 zero3 shard=8", "{best}");
    let fsdp = llama(&["--plan", "dp16 zero3"]);
    let (h, f) =
        (best["step_time_s"].as_f64().unwrap(), fsdp["predicted"]["step_time_s"].as_f64().unwrap());
    assert!(h < f, "HSDP {h} s vs FSDP {f} s");
}

/// The step time and worst peak of a JSON plan.
fn step_and_peak(v: &serde_json::Value) -> (f64, u64) {
    let peaks = v["predicted"]["peak_bytes_per_device"].as_array().unwrap();
    let peak = peaks.iter().filter_map(|p| p.as_u64()).max().unwrap();
    (v["predicted"]["step_time_s"].as_f64().unwrap(), peak)
}

/// A config string pins what it writes and the search chooses what it does not (issue 44),
/// each knob against the same config with the knob written: micro-batches, offload, `sp` and
/// the pipeline schedule.
#[test]
fn a_config_string_pins_what_it_writes_and_searches_the_rest() {
    let on = |cluster: &str, config: &str, extra: &[&str]| {
        plan(&[&["--cluster", cluster, "--plan", config, "--format", "json"], extra].concat())
    };
    // Micro-batches: under a budget one micro-batch misses, `dp2 ckpt=none` finds the count
    // that fits — the plan of that count written out.
    let long = |config: &str, budget: &str| {
        let args = ["plan", "--model", "gpt2-tiny", "--batch", "8", "--seq", "256"];
        let args = [&args[..], &["--cluster", "2xH100", "--plan", config, "--format", "json"]];
        tessera(&[&args.concat()[..], &["--memory-budget", budget]].concat())
    };
    let (ok, one, err) = long("dp2 mb1 ckpt=none", "80GiB");
    assert!(ok, "{err}");
    let one: serde_json::Value = serde_json::from_str(&one).unwrap();
    let budget = (step_and_peak(&one).1 * 95 / 100).to_string();
    let (ok, _, err) = long("dp2 mb1 ckpt=none offload=none", &budget);
    assert!(!ok && err.contains("no plan fits"), "{err}");
    let (ok, free, err) = long("dp2 ckpt=none", &budget);
    assert!(ok, "{err}");
    let free: serde_json::Value = serde_json::from_str(&free).unwrap();
    let config = free["config"].as_str().unwrap();
    assert!(config.contains(" mb"), "{config}");
    let (ok, written, err) = long(config, &budget);
    assert!(ok, "{err}");
    let written: serde_json::Value = serde_json::from_str(&written).unwrap();
    assert_eq!(step_and_peak(&written), step_and_peak(&free), "{config}");
    // Offload: where nothing fits on the device, `dp2 mb1 ckpt=none` offloads (the plan of
    // that offload written out); `offload=none` pins it off.
    let one = on("2xH100", "dp2 mb1 ckpt=none", &[]);
    let budget = (step_and_peak(&one).1 * 9 / 10).to_string();
    let b = ["--memory-budget", budget.as_str()];
    let off = [&["--cluster", "2xH100", "--plan", "dp2 mb1 ckpt=none offload=none"], &b[..]];
    fails(&off.concat(), "no plan fits");
    let free = on("2xH100", "dp2 mb1 ckpt=none", &b);
    let config = free["config"].as_str().unwrap();
    assert!(config.contains("offload="), "{config}");
    let written = on("2xH100", &format!("{config} mb1"), &b);
    assert_eq!(step_and_peak(&written), step_and_peak(&free), "{config}");
    // sp: the faster of on and off, each as written.
    let free = on("2xH100", "tp2 mb1", &[]);
    let off = on("2xH100", "tp2 mb1 sp=off", &[]);
    let sp = on("2xH100", "tp2 mb1 sp", &[]);
    assert_eq!(
        (off["config"].as_str(), sp["config"].as_str()),
        (Some("dp1 tp2"), Some("dp1 tp2 sp"))
    );
    let fastest = step_and_peak(&off).0.min(step_and_peak(&sp).0);
    assert_eq!(step_and_peak(&free).0, fastest, "{}", free["config"]);
    // The schedule: no slower than each one searched, written out.
    let free = on("2xH100", "pp2 mb4 ckpt=none", &[]);
    for sched in ["1f1b", "zb-h1", "interleaved:2"] {
        let written = on("2xH100", &format!("pp2 mb4 ckpt=none sched={sched}"), &[]);
        assert!(written["config"].as_str().unwrap().contains(sched), "{}", written["config"]);
        assert!(
            step_and_peak(&free).0 <= step_and_peak(&written).0,
            "{} vs {sched}",
            free["config"]
        );
    }
}

/// Issue 44's example: the seeds' `dp2 tp2 pp4 zero1` for llama2-70b on two 8-H200 nodes was
/// refused (one micro-batch needs 2.33 TiB per device); with its micro-batches, `sp`, schedule
/// and checkpointing searched it plans at least as fast as the automatic plan's form of it,
/// `dp2 tp2 pp4 sp zero1 mb128 sched=zb-h1`, written out.
#[test]
fn a_partial_pipelined_config_plans_as_fast_as_the_automatic_form_of_it() {
    let run = |config: &str| {
        let args = [
            "plan",
            "--model",
            "llama2-70b",
            "--cluster",
            "2x8xH200",
            "--batch",
            "256",
            "--seq",
            "4096",
            "--plan",
            config,
            "--format",
            "json",
        ];
        let (ok, out, err) = tessera(&args);
        assert!(ok, "{config}: {err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let partial = run("dp2 tp2 pp4 zero1");
    let auto_form = run("dp2 tp2 pp4 sp zero1 mb128 sched=zb-h1 ckpt=none");
    let config = partial["config"].as_str().unwrap();
    assert!(config.starts_with("dp2 tp2 pp4") && config.contains("zero1"), "{config}");
    let (t, a) = (step_and_peak(&partial).0, step_and_peak(&auto_form).0);
    assert!(t <= a * (1.0 + 1e-9), "`{config}` {t} s vs the automatic form's {a} s");
}
