//! `tessera profile --inference` and `tessera plan --inference`: a generation request (batch,
//! prompt length, new tokens, weight quantisation) profiled on one device, or planned over a
//! cluster: its weights, KV cache and activations per device and the tensor/pipeline split
//! that fits, fastest for latency or throughput. The Programs are the ones `tessera generate`
//! runs (the same builders and lowering), so a tensor-parallel plan's per-device peak is the
//! one the runtime measures.

use crate::plan_cmd::{plan_err, PlanArgs};
use crate::profile_cmd::{print_stdout, ProfileArgs};
use anyhow::{bail, Result};
use serde_json::json;
use tessera_ir::{DType, Graph, TensorId};
use tessera_models::{build_generation, GenerateOptions, ModelConfig, Quantize};
use tessera_plan::generate::{plan_inference, InferenceCandidate, InferenceProblem, Objective};
use tessera_plan::units::{format_bytes, parse_bytes};
use tessera_plan::Cluster;

/// A generation request: `--inference` with the prompt's `--seq` tokens, then `--new-tokens`,
/// with a KV cache (weights, cache and activations; prefill and decode).
#[derive(clap::Args, Clone, Debug)]
pub struct InferenceArgs {
    /// Profile or plan generation instead of a training step.
    #[arg(long)]
    pub inference: bool,
    /// Inference: tokens generated per prompt.
    #[arg(long, default_value_t = 128)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::seq())]
    pub new_tokens: usize,
    /// Inference: weight-only quantisation of the linear layers (int8 or int4).
    #[arg(long, value_parser = crate::generate_cmd::parse_quantize)]
    pub quantize: Option<Quantize>,
}

/// The prefill (`prompt` tokens) and decode (one token) steps of the request, as graphs.
fn steps(
    cfg: &ModelConfig,
    batch: usize,
    prompt: usize,
    new_tokens: usize,
    dtype: DType,
    quantize: Option<Quantize>,
) -> Result<((Graph, TensorId), (Graph, TensorId))> {
    if batch == 0 || prompt == 0 || new_tokens == 0 {
        bail!("--batch, --seq (the prompt) and --new-tokens must be at least 1");
    }
    let capacity = crate::limits::kv_capacity(cfg, prompt, new_tokens, "--seq", "--new-tokens")?;
    let opts = |seq| GenerateOptions { batch, seq, capacity, dtype, quantize, all_logits: false };
    let pre = build_generation(cfg, &opts(prompt))?;
    let dec = build_generation(cfg, &opts(1))?;
    Ok(((pre.builder.finish(), pre.logits), (dec.builder.finish(), dec.logits)))
}

/// One device's prefill and decode steps of a generation request, profiled.
struct Profiled {
    /// The prefill's memory (weights, KV cache, activations) and FLOPs.
    pm: tessera_profile::MemoryReport,
    pf: tessera_profile::FlopReport,
    /// One decode step's.
    dm: tessera_profile::MemoryReport,
    df: tessera_profile::FlopReport,
    ms: f64,
    peak: u64,
}

fn profiled(args: &ProfileArgs, cfg: &ModelConfig, prompt: usize) -> Result<Profiled> {
    let t0 = std::time::Instant::now();
    let dtype = args.dtype.dtype();
    let ((pg, pl), (dg, dl)) =
        steps(cfg, args.batch, prompt, args.infer.new_tokens, dtype, args.infer.quantize)?;
    let lower = |g: Graph, l: TensorId| tessera_ir::Program::lower_graph(g, vec![l], &[]);
    let (pp, dp) = (lower(pg, pl), lower(dg, dl));
    let (pm, dm) = (
        tessera_profile::simulate_memory(&pp).report,
        tessera_profile::simulate_memory(&dp).report,
    );
    let (pf, df) =
        (tessera_profile::count_flops(&pp.graph), tessera_profile::count_flops(&dp.graph));
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let peak = pm.peak_bytes.max(dm.peak_bytes);
    Ok(Profiled { pm, pf, dm, df, ms, peak })
}

/// What `tessera profile --inference --format json` prints.
pub fn profile_report(
    args: &ProfileArgs,
    cfg: &ModelConfig,
    prompt: usize,
) -> Result<serde_json::Value> {
    let Profiled { pm, pf, dm, df, ms, peak } = profiled(args, cfg, prompt)?;
    Ok(json!({
        "model": cfg.name(),
        "params": cfg.num_parameters(),
        "batch": args.batch,
        "prompt_len": prompt,
        "new_tokens": args.infer.new_tokens,
        "quantize": args.infer.quantize.map(Quantize::name),
        "memory": {
            "weights_bytes": pm.params_bytes,
            "kv_cache_bytes": pm.kv_cache_bytes,
            "prefill_activations_bytes": pm.peak_bytes - pm.params_bytes - pm.kv_cache_bytes,
            "decode_activations_bytes": dm.peak_bytes - dm.params_bytes - dm.kv_cache_bytes,
            "peak_bytes": peak,
        },
        "flops": {"prefill": pf.total, "decode_per_token": df.total},
        "profile_ms": ms,
    }))
}

/// `tessera profile --inference`: one device's prefill and decode steps, as a table (JSON:
/// [`profile_report`]).
pub fn profile(args: &ProfileArgs, cfg: &ModelConfig, prompt: usize) -> Result<()> {
    let Profiled { pm, pf, dm, df, ms, peak } = profiled(args, cfg, prompt)?;
    let f = |b: u64| format_bytes(b);
    print_stdout(&format!(
        "{} generation, batch {} × prompt {} + {} new tokens{} ({:.1} ms)\n\
         weights   {}\nKV cache  {} (capacity {} positions)\n\
         prefill   peak {}  ({:.3e} FLOPs)\ndecode    peak {}  ({:.3e} FLOPs per step)\n\
         peak      {}\n",
        cfg.name(),
        args.batch,
        prompt,
        args.infer.new_tokens,
        args.infer.quantize.map_or(String::new(), |q| format!(", {} weights", q.name())),
        ms,
        f(pm.params_bytes),
        f(pm.kv_cache_bytes),
        prompt + args.infer.new_tokens - 1,
        f(pm.peak_bytes),
        pf.total as f64,
        f(dm.peak_bytes),
        df.total as f64,
        f(peak),
    ))
}

/// `(tp, pp)` of an inference `--plan` string (`auto`: search).
fn fixed(plan: &str) -> Result<Option<(usize, usize)>> {
    if plan == "auto" {
        return Ok(None);
    }
    let (mut tp, mut pp) = (1, 1);
    for part in plan.split([' ', '+']).filter(|p| !p.is_empty()) {
        let num = |p: &str, pre: &str| p.strip_prefix(pre).and_then(|n| n.parse::<usize>().ok());
        match (num(part, "tp"), num(part, "pp"), num(part, "dp")) {
            (Some(t), _, _) if t > 0 => tp = t,
            (_, Some(q), _) if q > 0 => pp = q,
            (_, _, Some(_)) => {}
            _ => bail!(
                "--plan `{plan}`: an inference plan is `tpN`, `ppN` and `dpN` (e.g. \"tp4 pp2\"), \
                 or auto"
            ),
        }
    }
    Ok(Some((tp, pp)))
}

/// A generation request planned: the plan, the per-device budget, the search's time.
fn planned(
    args: &PlanArgs,
    cfg: &ModelConfig,
) -> Result<(tessera_plan::generate::InferencePlan, u64, f64)> {
    let t0 = std::time::Instant::now();
    let cluster = args.tiers.apply(Cluster::parse(&args.cluster).map_err(plan_err)?)?;
    let budget = match &args.memory_budget {
        Some(s) => parse_bytes(s).map_err(plan_err)?,
        None => cluster.device.usable_bytes(),
    };
    let dtype = args.dtype.dtype();
    let ((pg, pl), (dg, dl)) =
        steps(cfg, args.batch, args.seq, args.infer.new_tokens, dtype, args.infer.quantize)?;
    let problem = InferenceProblem {
        prefill: (&pg, pl),
        decode: (&dg, dl),
        cluster: &cluster,
        budget,
        batch: args.batch,
        new_tokens: args.infer.new_tokens,
        stage_bytes_per_token: cfg.hidden_size() as u64 * 4,
        objective: args.objective,
        fixed: fixed(&args.plan)?,
    };
    let plan = plan_inference(&problem).map_err(plan_err)?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    Ok((plan, budget, ms))
}

/// What `tessera plan --inference --format json` prints.
pub fn plan_report(args: &PlanArgs, cfg: &ModelConfig) -> Result<serde_json::Value> {
    let (plan, _, ms) = planned(args, cfg)?;
    let mut doc = serde_json::to_value(&plan)?;
    doc["model"] = cfg.name().into();
    doc["params"] = cfg.num_parameters().into();
    doc["cluster"] = args.cluster.clone().into();
    doc["config"] = plan.best.config.clone().into();
    doc["quantize"] = json!(args.infer.quantize.map(Quantize::name));
    doc["batch"] = args.batch.into();
    doc["prompt_len"] = args.seq.into();
    doc["new_tokens"] = args.infer.new_tokens.into();
    doc["search_ms"] = ms.into();
    Ok(doc)
}

/// `tessera plan --inference`, as a table (JSON: [`plan_report`]).
pub fn plan(args: &PlanArgs, cfg: &ModelConfig) -> Result<()> {
    let (plan, budget, ms) = planned(args, cfg)?;
    let mut s = format!(
        "{} ({:.1} B parameters{}) on {} for batch {} × prompt {} + {} new tokens, {:?}; \
         budget {} per device ({:.0} ms)\n",
        cfg.name(),
        cfg.num_parameters() as f64 / 1e9,
        args.infer.quantize.map_or(String::new(), |q| format!(", {} weights", q.name())),
        args.cluster,
        args.batch,
        args.seq,
        args.infer.new_tokens,
        args.objective,
        format_bytes(budget),
        ms
    );
    s += &format!(
        "{:<14} {:>10} {:>10} {:>10} {:>10} {:>9} {:>10} {:>11}\n",
        "config", "peak/dev", "weights", "KV cache", "activ.", "TTFT s", "token ms", "tok/s"
    );
    let row = |c: &InferenceCandidate| {
        if let Some(why) = &c.refused {
            return format!("{:<14} refused: {why}\n", c.config);
        }
        format!(
            "{:<14} {:>10} {:>10} {:>10} {:>10} {:>9.3} {:>10.2} {:>11.1}{}\n",
            c.config,
            format_bytes(c.peak_bytes_per_device),
            format_bytes(c.weights_bytes_per_device),
            format_bytes(c.kv_cache_bytes_per_device),
            format_bytes(c.activation_bytes),
            c.time_to_first_token_s,
            c.decode_token_s * 1e3,
            c.throughput_tokens_per_s,
            if c.fits { "" } else { "  (does not fit)" }
        )
    };
    for c in &plan.candidates {
        s += &row(c);
    }
    s += &format!("best: {}\n", plan.best.config);
    print_stdout(&s)
}

/// The objective flag.
pub fn parse_objective(s: &str) -> Result<Objective, String> {
    match s {
        "latency" => Ok(Objective::Latency),
        "throughput" => Ok(Objective::Throughput),
        _ => Err(format!("`{s}`: give latency or throughput")),
    }
}
