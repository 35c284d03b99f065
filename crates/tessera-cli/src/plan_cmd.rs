//! `tessera plan`: find (or evaluate) a parallel plan for a model on a cluster.

use crate::profile_cmd::{print_stdout, OutputFormat, Precision};
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use tessera_ir::CkptMode;
use tessera_ir::{build_training_graph, DType, TrainConfig, TrainingGraph};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::config::ParallelConfig;
use tessera_plan::plan::Plan;
use tessera_plan::planner::{self, Request};
use tessera_plan::search::Forward;
use tessera_plan::units::parse_bytes;
use tessera_plan::{Cluster, PlanError};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Baseline {
    /// Megatron-LM-style configurations: dp × tp, sequence parallel, ZeRO, micro-batches.
    Megatron,
    /// Chen et al.'s √n checkpoint segments on every block, with the best sharding for them.
    Chen,
    /// `full` recompute on every block, with the best sharding for it.
    FullRecompute,
    /// No checkpointing: the best sharding alone (what checkpointing buys).
    ShardingOnly,
    /// All of the above.
    All,
}

#[derive(Args, Clone, Debug)]
pub struct PlanArgs {
    /// A preset (gpt2, llama2-7b, ...), a Hugging Face config.json, or a directory holding one.
    #[arg(long, default_value = "gpt2")]
    pub model: String,
    /// `[NODES x] GPUS x DEVICE` (8xH100, 2x8xH200, 4xcpu) or a cluster .toml/.json file.
    #[arg(long, default_value = "8xH100")]
    pub cluster: String,
    /// Global batch: sequences per training step.
    #[arg(long, default_value_t = 8)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::batch())]
    pub batch: usize,
    /// Sequence length (a diffusion model's text tokens). Default: 1024, or the model's
    /// positions if it has fewer; 77 text tokens for a diffusion model.
    #[arg(long, default_value_t = 1024)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::seq())]
    pub seq: usize,
    /// A diffusion model's sample side (latents for a latent model, square). Default: the
    /// config's `sample_size`. Not recorded in a plan file: to train at another size, set
    /// `sample_size` in the config.
    #[arg(long, allow_negative_numbers = true, value_parser = crate::limits::seq())]
    pub image_size: Option<usize>,
    #[arg(long, value_enum, default_value_t = Precision::Bf16)]
    pub dtype: Precision,
    /// Per-device memory budget (512MiB, 20GiB); default: the device's memory minus its reserve.
    #[arg(long)]
    pub memory_budget: Option<String>,
    /// Memory held back per device for the runtime context (default 1GiB on GPUs).
    #[arg(long)]
    pub reserve: Option<String>,
    #[command(flatten)]
    pub tiers: crate::tier_args::TierArgs,
    #[command(flatten)]
    pub finetune: crate::finetune::FinetuneArgs,
    /// `auto`, a config string (`"dp2 tp4 sp zero1 mb2"`), or a plan JSON file.
    #[arg(long, default_value = "auto")]
    pub plan: String,
    /// Compare with a baseline search (repeatable: `--baseline chen --baseline megatron`).
    #[arg(long, value_enum)]
    pub baseline: Vec<Baseline>,
    /// Routing imbalance of a mixture of experts: the busiest expert's tokens over the
    /// balanced share, which prices the grouped expert GEMMs. Default 1.0: balanced routing,
    /// as published MoE throughput is measured (Megatron-LM's MoE benchmarks force or await
    /// balanced routing).
    #[arg(long, default_value_t = 1.0, value_name = "F", value_parser = parse_imbalance)]
    pub moe_imbalance: f64,
    /// A mixture of experts' capacity factor: `model` (the config's `capacity_factor`; none:
    /// dropless), `dropless`, a number (each expert holds `ceil(F · seq · k / E)` tokens of a
    /// sequence), or `auto`: the smallest of 1, 1.25, 1.5, 2 that holds the busiest expert's
    /// tokens at --moe-imbalance (dropless past 2) — a smaller capacity is never slower nor
    /// larger, so that is the fastest that drops no token at the stated imbalance.
    #[arg(long, default_value = "model", value_name = "F", value_parser = parse_capacity)]
    pub capacity_factor: CapacityArg,
    /// Print the per-op strategies of one block and the collectives of a step.
    #[arg(long)]
    pub explain: bool,
    /// Draw a pipelined plan's schedule (one row per pipeline device) as an SVG file.
    #[arg(long, value_name = "FILE")]
    pub schedule_svg: Option<PathBuf>,
    /// Draw each device's memory timeline under the plan (one line per distinct device
    /// Program), its predicted peak marked, as an SVG file.
    #[arg(long, value_name = "FILE")]
    pub memory_svg: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
    /// Also write the plan JSON here (atomically); with --export, the exported file instead.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write the plan for another engine: a Megatron-LM launch script, a DeepSpeed config JSON
    /// or a torchtitan job TOML (to --out FILE, else stdout; the launch command on stderr). A
    /// plan the engine cannot express is refused, naming the nearest one it can.
    #[arg(long, value_enum, value_name = "ENGINE")]
    pub export: Option<crate::export_plan::ExportTo>,
    /// A TOML run file holding any of these flags by their long names (`model = "gpt2-tiny"`,
    /// `batch = 8`, `memory-budget = "20GiB"`, `explain = true`, lists for repeatable flags);
    /// flags on the command line override it. examples/ has some.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Plan generation instead of training (--plan is then auto or `tpN ppN`).
    #[command(flatten)]
    pub infer: crate::inference_cmd::InferenceArgs,
    /// Inference: what the plan optimises (latency or throughput).
    #[arg(long, default_value = "latency", value_parser = crate::inference_cmd::parse_objective)]
    pub objective: tessera_plan::generate::Objective,
    /// The flags given on the command line (a plan file supplies the run's others).
    #[arg(skip)]
    pub given: crate::plan_file::Given,
}

/// The planner's error, kept typed under its context so `--format json` can report its kind
/// and figures (`main`'s error object).
pub fn plan_err(e: PlanError) -> anyhow::Error {
    anyhow::Error::new(e)
}

pub fn run(args: &PlanArgs) -> Result<()> {
    let (args, cfg) = &resolve(args)?;
    if args.infer.inference {
        if args.format == OutputFormat::Json {
            let doc = crate::inference_cmd::plan_report(args, cfg)?;
            return print_stdout(&(serde_json::to_string_pretty(&doc)? + "\n"));
        }
        return crate::inference_cmd::plan(args, cfg);
    }
    let Some((plan, timeline)) = planned(args, cfg)? else {
        // The exported file was the output.
        return Ok(());
    };
    let explains = args.explain && args.format == OutputFormat::Table;
    match args.format {
        OutputFormat::Json => print_stdout(&(serde_json::to_string_pretty(&plan)? + "\n")),
        OutputFormat::Table => {
            let mut s = table(&plan, args.explain);
            if let (true, Some(t)) = (explains, &timeline) {
                s += &format!(
                    "schedule ({:.4} s; a digit: a forward of that micro-batch, B backward, W \
                     weight gradient, . idle)\n",
                    t.makespan_s
                );
                s += &t.gantt_text(96);
            }
            print_stdout(&s)
        }
    }
}

/// What `tessera plan ARGS --format json` prints, as a value (whatever `args.format` says), its
/// files (`--out`, pictures, an export) written.
pub fn report(args: &PlanArgs) -> Result<serde_json::Value> {
    let (args, cfg) = &resolve(args)?;
    if args.infer.inference {
        return crate::inference_cmd::plan_report(args, cfg);
    }
    let Some((plan, _)) = planned(args, cfg)? else {
        bail!("--export without --out writes the exported file on stdout, not a plan: give --out FILE");
    };
    Ok(serde_json::to_value(&plan)?)
}

/// The run `args` describe: a plan file's model, batch, sequence length and precision adopted,
/// the default sequence length applied; and its model.
fn resolve(args: &PlanArgs) -> Result<(PlanArgs, ModelConfig)> {
    // A plan file's run: its model, batch, sequence length and precision ([`crate::plan_file`]).
    let mut a = args.clone();
    let given = &args.given;
    crate::plan_file::adopt_run(
        &args.plan,
        Some(given.flag("model", &mut a.model)),
        given.flag("batch", &mut a.batch),
        given.flag("seq", &mut a.seq),
        given.flag("dtype", &mut a.dtype),
    )?;
    let args = &a;
    let mut cfg = ModelConfig::resolve(&args.model)?;
    if let Some(side) = args.image_size {
        if args.out.is_some() {
            bail!(
                "--image-size is not recorded in a plan file, so a run of it would build the \
                 config's sample_size: set sample_size in {} instead of passing --image-size",
                args.model
            );
        }
        cfg = cfg.with_image_size(side)?;
    }
    // No --seq (and no plan file's): 1024, or the model's positions if it has fewer.
    let mut a = args.clone();
    if !args.given.has("seq") && !std::path::Path::new(&args.plan).is_file() {
        a.seq = crate::profile_cmd::default_seq(&cfg);
    }
    Ok((a, cfg))
}

/// `--capacity-factor`: what sets a mixture of experts' capacity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CapacityArg {
    /// The model config's own `capacity_factor` (none: dropless).
    Model,
    Dropless,
    /// The smallest candidate factor at least the routing imbalance.
    Auto,
    Factor(f64),
}

fn parse_capacity(s: &str) -> std::result::Result<CapacityArg, String> {
    match s {
        "model" => Ok(CapacityArg::Model),
        "dropless" => Ok(CapacityArg::Dropless),
        "auto" => Ok(CapacityArg::Auto),
        _ => match s.parse::<f64>() {
            Ok(f) if f.is_finite() && f > 0.0 => Ok(CapacityArg::Factor(f)),
            _ => Err(format!(
                "`{s}`: give model, dropless, auto or a positive capacity factor like 1.25"
            )),
        },
    }
}

/// The capacity factors `--capacity-factor auto` takes from (Switch Transformer's and
/// GShard's range; Megatron-LM's token-drop examples use 1.0).
const AUTO_CAPACITY: [f64; 4] = [1.0, 1.25, 1.5, 2.0];

/// `cfg` with its experts' capacity as `arg` says (`imbalance`: --moe-imbalance); a model
/// without experts refuses any but `model`.
pub fn with_capacity(cfg: &ModelConfig, arg: CapacityArg, imbalance: f64) -> Result<ModelConfig> {
    let factor = match arg {
        CapacityArg::Model => return Ok(cfg.clone()),
        CapacityArg::Dropless => None,
        CapacityArg::Factor(f) => Some(f),
        CapacityArg::Auto => AUTO_CAPACITY.iter().copied().find(|&f| f >= imbalance),
    };
    let ModelConfig::Llama(c) = cfg else {
        bail!(
            "--capacity-factor sets a mixture of experts' capacity, but {} has no experts: drop it",
            cfg.name()
        );
    };
    if c.moe.is_none() {
        bail!(
            "--capacity-factor sets a mixture of experts' capacity, but {} has no experts: drop it",
            cfg.name()
        );
    }
    let mut p = c.clone().into_params();
    if let Some(m) = p.moe.as_mut() {
        m.capacity_factor = factor;
    }
    Ok(ModelConfig::Llama(tessera_models::LlamaConfig::new(p)?))
}

/// `--moe-imbalance F`: a finite number ≥ 1 (1: balanced routing).
fn parse_imbalance(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f.is_finite() && f >= 1.0 => Ok(f),
        _ => Err(format!(
            "`{s}`: give the busiest expert's tokens over the balanced share, a number >= 1 \
             (1.0: balanced routing; 1.5: the busiest expert gets 50% more)"
        )),
    }
}

/// Plans `args`' training run and writes the files its flags name; `None` when the plan was
/// exported to stdout (`--export` without `--out`). With the plan, a pipeline's simulated
/// schedule when a picture or `--explain` needs it.
fn planned(
    args: &PlanArgs,
    cfg: &ModelConfig,
) -> Result<Option<(Plan, Option<tessera_plan::pipeline::schedule::Timeline>)>> {
    let cfg = &with_capacity(cfg, args.capacity_factor, args.moe_imbalance)?;
    let mut cluster = Cluster::parse(&args.cluster).map_err(plan_err)?;
    if let Some(r) = &args.reserve {
        let reserve = parse_bytes(r).map_err(plan_err)?;
        let memory = cluster.device.memory_bytes;
        if reserve >= memory && args.memory_budget.is_none() {
            bail!(
                "--reserve {r} leaves nothing of the {} device's {} of memory to plan with: give \
                 a smaller --reserve (the memory a device keeps for itself)",
                cluster.device.name,
                crate::format::bytes(memory)
            );
        }
        cluster = cluster.with_reserve(reserve);
    }
    let cluster = args.tiers.apply(cluster)?;
    let budget = match &args.memory_budget {
        Some(s) => parse_bytes(s).map_err(plan_err)?,
        None => cluster.device.usable_bytes(),
    };
    if budget == 0 {
        bail!("the memory budget is 0 bytes: give --memory-budget a size like 20GiB");
    }
    if args.batch == 0 || args.seq == 0 {
        bail!("--batch and --seq must be at least 1");
    }
    if args.export.is_some() && args.out.is_none() && args.format == OutputFormat::Json {
        bail!(
            "--export prints the exported file on stdout, where --format json prints the plan: \
             give --out FILE for the export, or drop --format json"
        );
    }
    let dtype = args.dtype.dtype();
    let seq = cfg.effective_seq(args.seq);
    let tune = args.finetune.resolve()?;
    let model = PlanModel::new(cfg, args.batch, seq, dtype, &TrainConfig::default(), tune)?;
    let mut req = model.request(cluster, budget);
    req.search.moe_imbalance = args.moe_imbalance;
    let engine = args.export.map(crate::export_plan::ExportTo::framework);
    let mut plan = choose_plan(&req, &args.plan, engine)?;
    let wants = |b: Baseline| args.baseline.contains(&b) || args.baseline.contains(&Baseline::All);
    if wants(Baseline::Megatron) {
        planner::attach_megatron(&req, &mut plan).map_err(plan_err)?;
    } else {
        plan.baselines.megatron = None;
    }
    let ckpt = planner::CkptBaselines {
        chen: wants(Baseline::Chen),
        full_recompute: wants(Baseline::FullRecompute),
        sharding_only: wants(Baseline::ShardingOnly),
    };
    if ckpt.chen || ckpt.full_recompute || ckpt.sharding_only {
        planner::attach_ckpt_baselines(&req, &mut plan, ckpt).map_err(plan_err)?;
    }
    let json = serde_json::to_string_pretty(&plan)?;
    // The schedule's timeline, simulated on the plan's own Programs, for the pictures.
    let explains = args.explain && args.format == OutputFormat::Table;
    let wants_timeline = args.schedule_svg.is_some() || (explains && plan.pipeline.is_some());
    let timeline = if wants_timeline { schedule_timeline(&req, &plan)? } else { None };
    if let Some(path) = &args.schedule_svg {
        let Some(t) = &timeline else {
            bail!(
                "--schedule-svg draws a pipeline schedule, but the plan `{}` has no pipeline: \
                 give --plan a config with ppN (\"dp2 pp4\") or drop --schedule-svg",
                plan.config
            );
        };
        let title = format!("{} on {}: `{}`", plan.model, plan.cluster, plan.config);
        let svg = t.svg(&title).map_err(|e| anyhow::anyhow!(e))?;
        crate::output::write_output(path, svg.as_bytes())?;
    }
    if let Some(path) = &args.memory_svg {
        crate::pictures::write_plan_memory(path, &req, &plan)?;
    }
    if let Some(to) = args.export {
        let e = crate::export_plan::export_plan(&req, &plan, to, cfg)?;
        crate::export_plan::write(&e, args.out.as_deref())?;
        if args.out.is_none() {
            // The exported file is the output.
            return Ok(None);
        }
    } else if let Some(out) = &args.out {
        crate::output::write_output(out, json.as_bytes())?;
    }
    Ok(Some((plan, timeline)))
}

/// A pipelined plan's schedule as simulated on its lowered Programs (`None`: no pipeline).
fn schedule_timeline(
    req: &Request<'_>,
    plan: &Plan,
) -> Result<Option<tessera_plan::pipeline::schedule::Timeline>> {
    if plan.pipeline.is_none() {
        return Ok(None);
    }
    let exe = planner::lower_plan(req, plan).map_err(plan_err)?;
    Ok(exe.pipeline.map(|p| p.timeline))
}

/// A model as the planner needs it: its forward graph for any micro-batch size, and the
/// single-device training graph of one global step (its FLOPs are the MFU numerator). `plan`
/// and `train` both plan through it.
pub struct PlanModel {
    name: String,
    batch: usize,
    seq: usize,
    dtype: DType,
    train: TrainConfig,
    build: Box<dyn Fn(usize) -> tessera_plan::Result<Forward> + Sync>,
    /// The single-device training graph of one global step.
    pub global: TrainingGraph,
    model_flops: f64,
}

impl PlanModel {
    pub fn new(
        cfg: &ModelConfig,
        batch: usize,
        seq: usize,
        dtype: DType,
        train: &TrainConfig,
        tune: crate::finetune::FineTune,
    ) -> Result<PlanModel> {
        let full = tune.apply(build(cfg, &BuildOptions { batch, seq, dtype })?)?;
        let global = build_training_graph(full.builder, full.loss, train)?;
        let model_flops = tessera_profile::count_flops(&global.graph).matmul as f64;
        let model_cfg = cfg.clone();
        let forward = move |mb: usize| -> tessera_plan::Result<Forward> {
            let m = build(&model_cfg, &BuildOptions { batch: mb, seq, dtype })
                .and_then(|m| tune.apply(m))
                .map_err(|e| PlanError::Invalid(e.to_string()))?;
            Ok(Forward { graph: m.builder.finish(), loss: m.loss })
        };
        Ok(PlanModel {
            name: cfg.name().to_string(),
            batch,
            seq,
            dtype,
            train: train.clone(),
            build: Box::new(forward),
            global,
            model_flops,
        })
    }

    /// The planner's request for this model on `cluster` under a per-device `budget`, with
    /// activation checkpointing searched jointly.
    pub fn request(&self, cluster: Cluster, budget: u64) -> Request<'_> {
        Request {
            build: &*self.build,
            model: self.name.clone(),
            batch: self.batch,
            seq: self.seq,
            dtype: self.dtype,
            cluster,
            budget,
            train: self.train.clone(),
            model_flops: self.model_flops,
            ckpt: tessera_plan::search::CkptSearch::Joint,
            pipeline: Default::default(),
            search: Default::default(),
        }
    }
}

/// `auto`, a plan JSON file, or a config string (`"dp2 tp2 zero1"`: what it does not write
/// is searched, within what `engine` runs when the plan is to be exported there).
pub fn choose_plan(
    req: &Request<'_>,
    plan: &str,
    engine: Option<tessera_plan::export::Framework>,
) -> Result<Plan> {
    if plan == "auto" {
        planner::plan_auto(req).map_err(plan_err)
    } else if std::path::Path::new(plan).is_file() {
        let text =
            std::fs::read_to_string(plan).with_context(|| format!("reading plan file {plan}"))?;
        let file: Plan = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("plan file {plan} is not a plan: {e}"))?;
        let lowered = planner::plan_from_file(req, &file).map_err(plan_err)?;
        for d in planner::derived_differences(&file, &lowered) {
            eprintln!(
                "note: plan file {plan}: {d}; `config` and `tensors` report what `mesh` and \
                 `strategies` lower to, so the run uses the layout's (edit `strategies` to change \
                 them)"
            );
        }
        Ok(lowered)
    } else {
        let (pc, pins) = ParallelConfig::parse_pinned(plan).map_err(plan_err)?;
        planner::plan_config(req, &pc, pins, engine).map_err(plan_err)
    }
}

/// What a reader of the config string would not guess: hybrid sharding's replicas, and KV
/// heads replicated where the tensor axis splits more query heads than there are KV heads.
fn layout_notes(p: &Plan) -> String {
    let mut s = String::new();
    let replicas: usize = p.mesh.replicas.iter().filter_map(|&a| p.mesh.shape.get(a)).product();
    if replicas > 1 {
        let devices: usize = p.mesh.shape.iter().product();
        s += &format!(
            "          hybrid sharding: ZeRO shards within groups of {} devices; {replicas} \
             groups, each a whole replica\n",
            devices / replicas
        );
    }
    let heads = |spec: &str| tessera_plan::Spec::parse(spec).and_then(|s| s.dims.get(2).cloned());
    let kv_whole = p.strategies.iter().any(|st| {
        st.op == "attention"
            && st.inputs.len() >= 2
            && heads(&st.inputs[0]).is_some_and(|q| !q.is_empty())
            && heads(&st.inputs[1]).is_some_and(|k| k.is_empty())
    });
    if kv_whole {
        s += "          KV heads replicated: tp splits the query heads past the KV heads, so \
              every device\n          holds every KV head (k/v projections whole)\n";
    }
    s
}

fn table(p: &Plan, explain: bool) -> String {
    let pr = &p.predicted;
    let mut s = String::new();
    s += &format!(
        "{} on {} ({} devices), batch {} × seq {}, {}\n",
        p.model, p.cluster, p.devices, p.batch, p.seq, p.dtype
    );
    let stages =
        p.pipeline.as_ref().map_or(String::new(), |pp| format!(" × {} stages", pp.devices));
    let mesh = format!("mesh {:?}{stages}   (found in {:.0} ms)", p.mesh.shape, p.search_ms);
    // A long config string (unequal stages) puts the mesh on a line of its own.
    let joint =
        if 10 + p.config.len() + 3 + mesh.chars().count() > 100 { "\n          " } else { "   " };
    s += &format!("plan      {}{joint}{mesh}\n", p.config);
    if p.layout == "per-op" && p.source != "file" {
        s +=
            "          per-op layout: the config above is its closest Megatron-style description;\n          \
              save the plan with --out FILE and pass --plan FILE to reuse it exactly\n";
    }
    s += &layout_notes(p);
    s += &format!(
        "step      {:.4} s   {:.0} tokens/s   MFU {:.1}%\n",
        pr.step_time_s,
        pr.tokens_per_s,
        pr.mfu * 100.0
    );
    s += &format!(
        "  compute {:.4} s fwd + {:.4} s bwd + {:.4} s optimizer\n  comm    {:.4} s blocking, \
         {:.4} s overlapped ({:.4} s exposed)\n",
        pr.forward_compute_s,
        pr.backward_compute_s,
        pr.optimizer_compute_s,
        pr.blocking_comm_s,
        pr.overlapped_comm_s,
        pr.exposed_comm_s
    );
    // The peak and what is live at it (the parts sum to the peak).
    s += &p.memory_summary();
    if let Some(m) = &p.baselines.megatron {
        s += &format!(
            "megatron  best {} at {:.4} s ({} of {} configurations fit): plan is {:.2}× its speed\n",
            m.config,
            m.step_time_s,
            m.configurations_fitting,
            m.configurations_tried,
            m.step_time_s / pr.step_time_s
        );
    }
    if let Some(first) = p.checkpoint.first() {
        let count = |m: CkptMode| p.checkpoint.iter().filter(|c| c.mode == m).count();
        let all_same = p.checkpoint.iter().all(|c| c.mode == first.mode);
        let modes = if all_same {
            format!("{} on all {} blocks", first.mode, p.checkpoint.len())
        } else {
            CkptMode::ALL
                .iter()
                .map(|&m| format!("{} {}", count(m), m))
                .collect::<Vec<_>>()
                .join(", ")
        };
        s += &format!("checkpoint {modes}; recompute {:.4} s per step\n", pr.recompute_s);
    }
    if let Some(o) = &p.offload {
        s += &o.summary(explain);
    }
    for (name, b) in [
        ("chen", &p.baselines.chen),
        ("full recompute", &p.baselines.full_recompute),
        ("sharding only", &p.baselines.sharding_only),
    ] {
        if let Some(b) = b {
            s += &match b.step_time_s {
                Some(t) => format!(
                    "{name:<9} best {t:.4} s (recompute {:.4} s): plan is {:.2}× its speed",
                    b.recompute_s,
                    t / pr.step_time_s
                ),
                None => format!("{name:<9} does not fit the budget"),
            };
            if let Some(t) = b.same_sharding_step_time_s {
                s += &format!("; on the plan's sharding {t:.4} s");
            }
            s += "\n";
        }
    }
    if explain {
        s += &p.explain();
    }
    s
}
