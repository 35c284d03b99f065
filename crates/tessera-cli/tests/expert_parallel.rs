//! Expert parallelism (`epN`, issue 45) end to end through the binary: a tiny Mixtral (two
//! layers, four experts, top-2, fp32, the router's auxiliary loss on) trains under every plan
//! like one device — per-step loss and gradient norm within 1e-5 relative of the
//! single-device run with the same capacity and micro-batches — dropless and with a capacity
//! factor that drops tokens; each device's measured peak memory and collective bytes equal
//! the plan's prediction, and the dispatch and combine all-to-alls ran. `ep2` under `mpirun`
//! equals the same plan on threads bit for bit. The planner takes `ep8` for Mixtral-8x7B on
//! 8 H100s, says it in `--explain` and exports it to Megatron-LM.

use crate::support;

use serde_json::Value;
use std::path::{Path, PathBuf};
use support::axis_runs::{
    self, assert_accounted, assert_follows, model_file, mpirun, run_args, steps_of, tessera,
    within, Shape,
};

const STEPS: usize = 10;

/// Two layers, hidden 32, 4 query and 2 KV heads, 4 experts of width 48, top-2, the router's
/// auxiliary loss added; `capacity_factor` (tessera's key) when given.
fn mixtral(capacity_factor: Option<f64>) -> String {
    let mut j = serde_json::json!({
        "model_type": "mixtral", "_name_or_path": "mixtral-ep-tiny", "vocab_size": 128,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "output_router_logits": true, "router_aux_loss_coef": 0.02,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": false
    });
    if let Some(f) = capacity_factor {
        j["capacity_factor"] = serde_json::json!(f);
    }
    j.to_string()
}

const SHAPE: Shape = Shape { batch: 8, seq: 16, steps: STEPS };

fn temp(name: &str) -> PathBuf {
    axis_runs::temp("expert-parallel", name)
}

/// Trains `model` under `plan` on `devices` threads ([`axis_runs::train`]).
fn train(dir: &Path, model: &str, devices: usize, plan: &str) -> (Value, Vec<(f64, f64)>) {
    axis_runs::train(dir, model, devices, plan, SHAPE)
}

/// The run against one device's, step by step, and every device's measured peak and
/// collective bytes against the plan's prediction; the experts' all-to-alls ran.
fn check_run(what: &str, doc: &Value, steps: &[(f64, f64)], single: &[(f64, f64)]) {
    assert_follows(what, steps, single, 1);
    assert_accounted(what, doc);
    let c = &doc["comm"];
    let a2a = c["measured_calls"]["all_to_all"].as_u64().unwrap_or(0);
    assert!(a2a > 0, "{what}: no all-to-all was counted: {c}");
    assert!(doc["config"].as_str().is_some_and(|s| s.contains("ep")), "{what}: {doc}");
}

/// Each `(devices, plan)` against the single-device run with the same capacity and `mb2`.
fn fidelity(name: &str, json: &str, plans: &[(usize, &str)]) -> Vec<(f64, f64)> {
    let dir = temp(name);
    let model = model_file(&dir, name, json);
    let (_, single) = train(&dir, &model, 1, "mb2");
    for &(devices, plan) in plans {
        let (doc, steps) = train(&dir, &model, devices, plan);
        check_run(&format!("{name} `{plan}` on {devices}"), &doc, &steps, &single);
    }
    single
}

const PLANS: [(usize, &str); 7] = [
    (2, "ep2 mb2"),
    (4, "ep4 mb2"),
    (4, "dp2 ep2 mb2"),
    (4, "tp2 ep2 mb2"),
    (4, "ep2 pp2 mb2"),
    (2, "ep2 zero3 mb2"),
    (4, "cp2 ep2 mb2"),
];

#[test]
fn dropless_expert_parallel_trains_like_one_device() {
    fidelity("dropless", &mixtral(None), &PLANS);
}

/// Capacity factor 0.5: each expert takes 4 of a sequence's 32 choices, so tokens drop — the
/// same ones on every plan, as routing is per sequence.
#[test]
fn dropping_expert_parallel_trains_like_one_device() {
    let dropping = fidelity("dropping", &mixtral(Some(0.5)), &PLANS);
    // The capacity really drops: the run is not the dropless one.
    let dir = temp("dropless-ref");
    let model = model_file(&dir, "dropless-ref", &mixtral(None));
    let (_, dropless) = train(&dir, &model, 1, "mb2");
    assert!(
        dropping.iter().zip(&dropless).any(|(a, b)| !within(a.0, b.0, 1e-4)),
        "capacity 0.5 trained as dropless: {dropping:?}"
    );
}

fn plan_args<'a>(model: &'a str, cluster: &'a str, plan: &'a str) -> Vec<&'a str> {
    vec![
        "plan",
        "--model",
        model,
        "--cluster",
        cluster,
        "--batch",
        "8",
        "--seq",
        "16",
        "--plan",
        plan,
    ]
}

/// What does not compose is refused by name: experts ep does not divide, a model without
/// experts, engines that cannot say it.
#[test]
fn expert_parallel_refusals_name_the_fix() {
    let dir = temp("refusals");
    let model = model_file(&dir, "mixtral", &mixtral(None));
    // 4 experts over ep8.
    let out = tessera(&plan_args(&model, "8xcpu", "ep8"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("4 experts"), "{err}");
    assert!(err.contains("ep2 or ep4"), "{err}");
    // A dense model has no experts.
    let out = tessera(&[
        "plan",
        "--model",
        "gpt2",
        "--cluster",
        "2xcpu",
        "--batch",
        "8",
        "--seq",
        "64",
        "--plan",
        "ep2",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("drop epN"), "{err}");
}

/// Mixtral-8x7B on 8 H100s under `ep8`: planned, explained (experts per device, capacity,
/// all-to-all bytes) and exported to Megatron-LM and torchtitan with the expert-parallel
/// degree. The budget is raised: on 8 devices every layout holds an eighth of the model
/// state at best (`ep8 zero3 mb8 ckpt=full` needs 90.6 GiB per device), and expert
/// parallelism does not compose with optimizer offload yet.
#[test]
fn mixtral_8x7b_plans_with_ep8_on_8xh100() {
    let base = [
        "plan",
        "--model",
        "mixtral-8x7b",
        "--cluster",
        "8xH100",
        "--batch",
        "8",
        "--seq",
        "4096",
        "--dtype",
        "bf16",
        "--memory-budget",
        "2TiB",
        "--plan",
        "ep8 zero1 ckpt=full",
    ];
    let out = tessera(&[&base[..], &["--explain"]].concat());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("expert parallel: ep8, 1 experts per device"), "{text}");
    assert!(text.contains("capacity 4096 tokens per expert and sequence"), "{text}");
    // 32 layers × (dispatch, combine) × (forward, recompute, backward).
    assert!(text.contains("192 all-to-alls per step"), "{text}");
    let out = tessera(&[&base[..], &["--export", "megatron"]].concat());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("--expert-model-parallel-size 8"), "{text}");
}

/// `mpirun -n 2 tessera train --plan ep2` (one process per rank): equal to the same plan on
/// two threads bit for bit, and so to one device within 1e-5.
#[cfg(feature = "mpi")]
#[test]
fn mpi_expert_parallel_equals_threads() {
    let dir = temp("mpi");
    let model = model_file(&dir, "mpi", &mixtral(Some(0.5)));
    let (_, single) = train(&dir, &model, 1, "mb2");
    let plan = "ep2 mb2";
    let log = dir.join("mpi2.jsonl");
    let args = run_args(&model, plan, log.to_str().unwrap(), SHAPE, STEPS);
    let doc = mpirun(2, &args);
    let mpi = steps_of(&log);
    check_run(&format!("mpirun -n 2 `{plan}`"), &doc, &mpi, &single);
    let (_, threads) = train(&dir, &model, 2, plan);
    assert_eq!(mpi, threads, "{plan}: MPI and threads must agree bit for bit");
}

/// A tiny Mixtral with wide experts (8 of width 1024 over hidden 64, top-2): its expert
/// gradients dwarf its few tokens, so splitting the experts (their gradients then reduce over
/// nothing) beats replicating them.
fn wide_experts() -> String {
    serde_json::json!({
        "model_type": "mixtral", "_name_or_path": "mixtral-wide-experts", "vocab_size": 128,
        "hidden_size": 64, "intermediate_size": 1024, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": false
    })
    .to_string()
}

/// `tessera plan --format json` of `model` on 8 H100s, batch 8 × 16, with `extra` flags.
fn plan_json(model: &str, extra: &[&str]) -> Value {
    let mut args =
        vec!["plan", "--model", model, "--cluster", "8xH100", "--batch", "8", "--seq", "16"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--format", "json"]);
    let out = tessera(&args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("plan JSON")
}

fn step_of(plan: &Value) -> f64 {
    plan["predicted"]["step_time_s"].as_f64().expect("step time")
}

/// The automatic search, with expert parallelism in its grid, is at least as fast as every
/// configuration priced one by one (`--plan CONFIG`, each the best plan within it), with ep
/// and without, and its own config string re-plans to its step. (On this tiny model the
/// search keeps `dp8 zero1`: ep does not win here; a model where it does is still to find.)
#[test]
fn the_search_is_at_least_as_fast_as_every_fixed_config() {
    let dir = temp("search");
    let model = model_file(&dir, "wide", &wide_experts());
    let auto = plan_json(&model, &[]);
    let config = auto["config"].as_str().expect("config").to_string();
    let t = step_of(&auto);
    let fixed = |cfg: &str| step_of(&plan_json(&model, &["--plan", cfg]));
    let again = fixed(&config);
    assert!((again - t).abs() <= 1e-9 * t, "`{config}`: {again} s fixed, {t} s searched");
    let configs = ["dp8", "dp8 zero1", "dp8 zero3", "dp4 tp2 sp", "ep8", "dp2 ep4", "dp4 ep2"];
    for cfg in configs {
        let s = fixed(cfg);
        assert!(t <= s * (1.0 + 1e-9), "searched `{config}` {t} s, `{cfg}` {s} s");
    }
}

/// The routing imbalance prices the grouped GEMMs (a busier expert, a slower step); the
/// capacity factor flag reaches the model (`auto`: the smallest factor holding the busiest
/// expert), and `--explain` names the experts per device, the capacity, the routed tokens and
/// the all-to-all bytes.
#[test]
fn imbalance_and_capacity_reach_the_plan() {
    let dir = temp("imbalance");
    let model = model_file(&dir, "wide", &wide_experts());
    let plan = ["--plan", "ep8"];
    let balanced = step_of(&plan_json(&model, &plan));
    let skewed = step_of(&plan_json(&model, &[&plan[..], &["--moe-imbalance", "3"]].concat()));
    assert!(skewed > balanced, "imbalance 3: {skewed} s, balanced {balanced} s");
    let base = [
        "plan",
        "--model",
        model.as_str(),
        "--cluster",
        "8xH100",
        "--batch",
        "8",
        "--seq",
        "16",
        "--plan",
        "ep8",
        "--explain",
    ];
    let explain = |extra: &[&str]| {
        let out = tessera(&[&base[..], extra].concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let text = explain(&[]);
    assert!(text.contains("expert parallel: ep8, 1 experts per device"), "{text}");
    assert!(text.contains("capacity 16 tokens per expert and sequence of 16 (dropless)"), "{text}");
    assert!(text.contains("routed: top-2 of 8, 4.0 tokens per expert"), "{text}");
    assert!(text.contains("all-to-alls per step around the experts"), "{text}");
    // auto at imbalance 1.5: factor 1.5, ceil(1.5 · 16 · 2 / 8) = 6 tokens.
    let text = explain(&["--capacity-factor", "auto", "--moe-imbalance", "1.5"]);
    assert!(text.contains("capacity 6 tokens per expert"), "{text}");
    let text = explain(&["--capacity-factor", "1"]);
    assert!(text.contains("capacity 4 tokens per expert"), "{text}");
    // A dense model has no capacity to set.
    let out =
        tessera(&["plan", "--model", "gpt2-tiny", "--cluster", "2xcpu", "--capacity-factor", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("has no experts"), "{err}");
}

/// The Megatron-LM export names the experts, top-k, their width, the dispatcher and the
/// capacity with Megatron's drop policy; DeepSpeed refuses expert parallelism by name.
#[test]
fn exports_name_the_experts() {
    let dir = temp("exports");
    let model = model_file(&dir, "wide", &wide_experts());
    let export = |engine: &str, extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--model",
            model.as_str(),
            "--cluster",
            "8xH100",
            "--batch",
            "8",
            "--seq",
            "16",
            "--plan",
            "ep8",
            "--export",
            engine,
        ];
        args.extend_from_slice(extra);
        tessera(&args)
    };
    let out = export("megatron", &["--capacity-factor", "1.25"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for flag in [
        "--num-experts 8",
        "--moe-router-topk 2",
        "--moe-ffn-hidden-size 1024",
        "--expert-model-parallel-size 8",
        "--moe-token-dispatcher-type alltoall",
        "--moe-expert-capacity-factor 1.25",
        "--moe-token-drop-policy position",
        "--moe-pad-expert-input-to-capacity",
    ] {
        assert!(text.contains(flag), "{flag}: {text}");
    }
    let out = export("torchtitan", &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("expert_parallel_degree = 8"), "{text}");
    let out = export("deepspeed", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("DeepSpeed cannot say ep8"), "{err}");
}
