//! Preparing a `tessera train` run: what every device of this process shares ([`RunContext`]),
//! built once by [`prepare`] — the model, the data, the plan and its lowered Programs, where
//! the parameters start, the checkpoint to write, the step log and the progress bar.

use crate::format::bytes;
use crate::plan_cmd::{choose_plan, plan_err, PlanModel};
use crate::train_cmd::{check_resume, check_resumed_model, load_data, make_schedule, run_facts};
use crate::train_cmd::{DeviceKind, TrainArgs};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use tessera_ir::{Graph, TensorId, TrainConfig, TrainingGraph};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::plan::Plan;
use tessera_plan::planner::{self, Executable};
use tessera_plan::Cluster;
use tessera_runtime::checkpoint::Manifest;
use tessera_runtime::hf_weights::open_weights;
use tessera_runtime::init::{init_rules_by_name, InitRule};
use tessera_runtime::mapped::MappedCheckpoint;
use tessera_runtime::run::SaveSpec;
use tessera_runtime::trainer::ShardSource;
use tessera_runtime::{LrSchedule, TrainData};

/// Where a run's parameters come from.
pub enum Start {
    /// A fresh init: the rules by parameter name (each device draws its own shards).
    Fresh(HashMap<String, InitRule>),
    /// A checkpoint to resume, mapped (each device reads only its shards).
    Resume(Box<MappedCheckpoint>),
    /// Fine-tuning: a mapped Hugging Face checkpoint (or a sharded Tessera one), checked
    /// against the model; each device reads only its shards; fresh AdamW state.
    Weights(Box<dyn ShardSource + Send>),
}

impl RunContext {
    /// The training graph rank `rank` runs.
    pub fn training(&self, rank: usize) -> &TrainingGraph {
        &self.stages[rank % self.stages.len().max(1)]
    }
}

/// A resumed run whose `--steps` differs from the saved horizon.
#[derive(Clone, Copy, Debug)]
pub struct Extended {
    pub saved_total: u64,
    pub total: u64,
}

/// Everything a device needs, shared read-only by the threads of a simulated run.
pub struct RunContext {
    pub args: TrainArgs,
    pub cfg: ModelConfig,
    pub plan: Plan,
    /// The training graph of each pipeline device (one without a pipeline): rank r runs
    /// `stages[r % stages.len()]` (the pipeline axis is the mesh's last).
    pub stages: Vec<TrainingGraph>,
    pub mesh_shape: Vec<usize>,
    pub budget: u64,
    pub schedule: LrSchedule,
    /// The run's data set (`--data`), for its batches and the held-out evaluation; none when
    /// the batches come from the front end ([`crate::hooks::Hooks::data`]).
    pub data: Option<TrainData>,
    /// Where every device's steps come from (the data set's batches, or the front end's).
    pub steps: crate::hooks::SharedSteps,
    /// The front end's hooks (events, stop).
    pub hooks: crate::hooks::Hooks,
    /// The model's sequence length (`--seq`, or ViT's patches + 1).
    pub seq: usize,
    /// Until every device of this process holds its shards; then dropped.
    pub start: std::sync::RwLock<Option<Start>>,
    /// Devices of this process that hold their shards, of `local_devices`.
    pub bound: std::sync::atomic::AtomicUsize,
    pub local_devices: usize,
    pub steps_done: u64,
    pub first: u64,
    pub last_step: u64,
    pub extended: Option<Extended>,
    /// Predicted bytes one device contributes to collectives per step, and calls per kind.
    /// Bytes each pipeline device (one without a pipeline) contributes to collectives and
    /// transfers per step; rank r is `[r % len]`.
    pub predicted_comm_bytes: Vec<u64>,
    pub predicted_calls: BTreeMap<String, u64>,
    pub predicted_peak: Vec<u64>,
    /// The single-device model without dropout, for the held-out loss and accuracy: graph,
    /// loss, logits.
    pub eval_model: (Graph, TensorId, TensorId),
    pub save: Option<SaveSpec>,
    /// Rank 0's lock on the `--save` directory, held for the run.
    _save_lock: Option<tessera_runtime::host::DirLock>,
    pub log: Option<Mutex<std::io::BufWriter<std::fs::File>>>,
    pub bar: ProgressBar,
}

/// Plans the run and builds what every device shares, for `local_devices` devices in this
/// process. Only `rank` 0 writes the step log and draws the progress bar.
pub fn prepare(
    args: &TrainArgs,
    devices: usize,
    local_devices: usize,
    rank: usize,
    hooks: &crate::hooks::Hooks,
) -> Result<RunContext> {
    crate::train_guard::check_start(args)?;
    if let Some(q) = args.finetune.quantize_base {
        crate::finetune::check_qlora_run(args, q)?;
    }
    if let Some(dir) = &args.save {
        tessera_runtime::guard::check_save_dest(dir, args.resume.as_deref(), args.overwrite_save)?;
    }
    // The saved run's model first: a checkpoint resumed under another model would otherwise
    // fail later, naming a parameter rather than the flag.
    let resumed = args.resume.as_ref().map(|dir| MappedCheckpoint::open(dir)).transpose()?;
    if let Some(ckpt) = &resumed {
        check_resumed_model(args, &ckpt.manifest.model, &ckpt.dir)?;
    }
    if let Some(dir) = &args.init {
        crate::checkpoint_cmd::check_before_load(dir, "--init")?;
    }
    let cfg = match &args.init {
        Some(dir) => ModelConfig::from_path(dir)
            .with_context(|| format!("--init {}: reading its config.json", dir.display()))?,
        None => ModelConfig::resolve(&args.model)?,
    };
    let dtype = args.dtype.dtype();
    // Batches from the front end take the place of `--data` (and of its held-out split).
    let data = match hooks.caller_data {
        true => None,
        false => Some(load_data(args, &cfg)?),
    };
    let seq = match &data {
        // A text-conditioned UNet's sequence is its tokenizer's length (the captions').
        Some(TrainData::TextDiffusion { data, .. }) => data.seq,
        _ => cfg.effective_seq(args.seq),
    };
    if let Some(data) = data.as_ref().filter(|_| args.eval_batches > 0) {
        // Before training, not after it: a held-out split too small for one batch.
        data.val_batches(args.seed, args.batch, seq, 1)
            .context("the held-out evaluation at the end (--eval-batches 0 skips it)")?;
    }
    let train_cfg = TrainConfig {
        weight_decay: args.weight_decay,
        max_grad_norm: (args.max_grad_norm > 0.0).then_some(args.max_grad_norm),
        ..TrainConfig::default()
    };
    let (cluster, budget) = run_cluster(args, devices, rank)?;
    let tune = args.finetune.resolve()?;
    if (args.save_adapter.is_some() || args.merge_into.is_some()) && tune.lora.is_none() {
        bail!("--save-adapter and --merge-into write a LoRA adapter: train with --lora");
    }
    if tune.adapter.is_some() && args.init.is_none() && args.resume.is_none() {
        bail!(
            "--init-adapter starts LoRA from an adapter trained on a base: give that base with \
             --init DIR"
        );
    }
    let eval_tune = tune.for_eval();
    let lora_start = match (&tune.lora, &args.init) {
        (Some(_), Some(_)) => Some(tune.start_tensors(
            &tune.apply(build(&cfg, &BuildOptions { batch: 1, seq: 1, dtype })?)?.builder.graph,
            args.seed,
        )?),
        _ => None,
    };
    let model = PlanModel::new(&cfg, args.batch, seq, dtype, &train_cfg, tune)?;
    let mut req = model.request(cluster, budget);
    // The CUDA backend has no kernel for the tiled MLP yet: plan its MLPs whole.
    req.search.tiled_mlp = args.device == DeviceKind::Cpu;
    req.search.ring = args.device == DeviceKind::Cpu;
    let plan = choose_plan(&req, &args.plan, None).context("planning the run")?;
    let exe = planner::lower_plan(&req, &plan).map_err(plan_err)?;
    if args.device == DeviceKind::Cpu {
        // Simulated devices hold their tensors in this machine's memory (a GPU's are its own).
        check_host_memory(&plan.predicted.peak_bytes_per_device, rank, local_devices)?;
    }
    let (predicted_comm_bytes, predicted_calls) = predicted_traffic(&exe);

    let (start, steps_done, schedule, extended) = match resumed {
        Some(ckpt) => {
            crate::train_guard::check_resume_settings(args, &ckpt.manifest)?;
            let (schedule, extended) = check_resume(args, &ckpt, data.as_ref())?;
            let step = ckpt.manifest.step;
            (Start::Resume(Box::new(ckpt)), step, schedule, extended)
        }
        None => (first_start(args, &cfg, &model.global, lora_start)?, 0, make_schedule(args), None),
    };
    // One run writes a checkpoint directory at a time: rank 0 holds its lock to the end.
    let save_lock = match (&args.save, rank) {
        (Some(dir), 0) => Some(tessera_runtime::host::lock_dir(dir).context("--save")?),
        _ => None,
    };
    if let Some(dir) = &args.save {
        preflight_save(args, dir, &model.global)?;
    }
    let first = steps_done + 1;
    let last_step = args.stop_after.map_or(args.steps, |k| k.min(args.steps));
    if first > last_step {
        bail!("nothing to do: the run is already at step {steps_done} of {last_step}");
    }
    let eval_opts = BuildOptions { batch: args.batch, seq, dtype };
    let eval = eval_tune.apply(build(&cfg.without_dropout(), &eval_opts)?)?;
    let log = match &args.log_json {
        Some(p) if rank == 0 => Some(Mutex::new(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        ))),
        _ => None,
    };
    let save = save_spec(args, &cfg, &plan, &schedule, data.as_ref());
    let bar = progress_bar(rank, hooks, first, last_step);
    if let (Some(e), 0) = (extended, rank) {
        bar.suspend(|| {
            eprintln!(
                "resuming at step {steps_done} of a run saved with --steps {}: the run now ends \
                 at step {} and the learning-rate schedule follows the new horizon",
                e.saved_total, e.total
            )
        });
    }
    Ok(RunContext {
        args: args.clone(),
        cfg,
        predicted_peak: plan.predicted.peak_bytes_per_device.clone(),
        plan,
        stages: match exe.pipeline {
            Some(p) => p.devices.into_iter().map(|d| d.lowered.into_training_graph()).collect(),
            None => vec![exe.lowered.into_training_graph()],
        },
        mesh_shape: exe.mesh.shape.clone(),
        budget,
        schedule,
        data,
        steps: crate::hooks::SharedSteps::new(hooks.clone(), local_devices),
        hooks: hooks.clone(),
        seq,
        start: std::sync::RwLock::new(Some(start)),
        bound: std::sync::atomic::AtomicUsize::new(0),
        local_devices,
        steps_done,
        first,
        last_step,
        extended,
        predicted_comm_bytes,
        predicted_calls,
        eval_model: (eval.builder.finish(), eval.loss, eval.logits),
        save,
        _save_lock: save_lock,
        log,
        bar,
    })
}

/// The cluster the run is planned for (`--cluster`, or this machine's GPUs or CPU cores, with
/// `--host-memory`/`--nvme` tiers applied) and the per-device memory budget.
fn run_cluster(args: &TrainArgs, devices: usize, rank: usize) -> Result<(Cluster, u64)> {
    let (cluster_str, cluster) = match (&args.cluster, args.device) {
        (Some(c), _) => (c.clone(), Cluster::parse(c).map_err(plan_err)?),
        // This machine's GPUs: their preset or calibration, their free memory as the budget.
        (None, DeviceKind::Cuda) => {
            let g = crate::gpu_plan::local_cluster(devices)?;
            if rank == 0 && args.format == crate::profile_cmd::OutputFormat::Table {
                eprintln!("planning for {} × {} ({})", devices, g.cluster.device.name, g.source);
            }
            (format!("this machine's GPUs ({})", g.source), g.cluster)
        }
        (None, DeviceKind::Cpu) => {
            let c = format!("{devices}xcpu");
            let cluster = Cluster::parse(&c).map_err(plan_err)?;
            (c, cluster)
        }
    };
    let cluster = args.tiers.apply(cluster)?;
    if cluster.num_devices() != devices {
        bail!(
            "--cluster {cluster_str} has {} devices but --devices is {devices}: make them agree",
            cluster.num_devices()
        );
    }
    let budget = args.memory_budget.unwrap_or_else(|| cluster.device.usable_bytes());
    Ok((cluster, budget))
}

/// Bytes each pipeline device (one without a pipeline) contributes to collectives and
/// transfers per step, and the collective calls per kind.
fn predicted_traffic(exe: &Executable) -> (Vec<u64>, BTreeMap<String, u64>) {
    let bytes = match &exe.pipeline {
        Some(p) => {
            p.devices.iter().map(|d| d.lowered.collectives.iter().map(|c| c.bytes).sum()).collect()
        }
        None => vec![exe.lowered.collectives.iter().map(|c| c.bytes).sum()],
    };
    let mut calls = BTreeMap::new();
    for c in &exe.lowered.collectives {
        *calls.entry(c.op.to_string()).or_insert(0) += 1;
    }
    (bytes, calls)
}

/// Where a run that resumes nothing starts: `--init`'s weights (under LoRA, the adapter's
/// fresh tensors over the base's), an ONNX file's initialisers, or a fresh init.
fn first_start(
    args: &TrainArgs,
    cfg: &ModelConfig,
    global_train: &TrainingGraph,
    lora_start: Option<HashMap<String, candle_core::Tensor>>,
) -> Result<Start> {
    let dtype = args.dtype.dtype();
    let weights = match &args.init {
        Some(dir) => match lora_start {
            // The base file holds the base's weights: checked against the base graph.
            Some(first) => {
                let base = build(cfg, &BuildOptions { batch: 1, seq: 1, dtype })?;
                let rest = open_weights(dir, &base.builder.finish())
                    .with_context(|| format!("--init {}", dir.display()))?;
                // QLoRA: the base's linears quantised as they are read.
                let rest: Box<dyn ShardSource + Send> = match args.finetune.quantize_base {
                    Some(_) => {
                        Box::new(crate::finetune::Quantizing::new(&global_train.graph, rest))
                    }
                    None => rest,
                };
                Box::new(crate::finetune::Layered { first, rest })
            }
            None => open_weights(dir, &global_train.graph)
                .with_context(|| format!("--init {}", dir.display()))?,
        },
        // An ONNX file carries its weights: training starts from them.
        None if matches!(cfg, ModelConfig::Onnx(_)) => {
            let file = std::path::Path::new(&args.model);
            open_weights(file, &global_train.graph)
                .with_context(|| format!("--model {}: its initialisers", file.display()))?
        }
        None => return Ok(Start::Fresh(init_rules_by_name(&global_train.graph))),
    };
    Ok(Start::Weights(weights))
}

/// Before step 1: a save that cannot happen must not cost the training it was for. A save
/// writes the new checkpoint beside the previous one: once one exists, every later save needs
/// room for a second.
fn preflight_save(args: &TrainArgs, dir: &std::path::Path, global: &TrainingGraph) -> Result<()> {
    let saves_to_come = args.save_every.is_some_and(|k| k > 0 && k < args.steps);
    let holds_one = dir.join(tessera_runtime::checkpoint::MANIFEST_FILE).is_file();
    let copies = if saves_to_come && !holds_one { 2 } else { 1 };
    let bytes = checkpoint_bytes(global) * copies;
    tessera_runtime::checkpoint::preflight_save(dir, bytes).context("--save")
}

/// What `--save` writes: the directory, how often, the model's config and the manifest.
fn save_spec(
    args: &TrainArgs,
    cfg: &ModelConfig,
    plan: &Plan,
    schedule: &LrSchedule,
    data: Option<&TrainData>,
) -> Option<SaveSpec> {
    args.save.as_ref().map(|dir| {
        let model = args.init.as_ref().map_or(args.model.clone(), |d| d.display().to_string());
        let mut manifest = Manifest::new(0, args.steps, args.seed, model, schedule.clone());
        manifest.extra = run_facts(args, data);
        manifest.extra[crate::train_guard::OPTIMIZER_KEY] =
            crate::train_guard::optimizer_facts(args);
        SaveSpec {
            dir: dir.clone(),
            every: args.save_every,
            config_json: cfg.to_hf_json(),
            manifest,
            layout: json!({"config": plan.config, "mesh": plan.mesh.shape,
                           "zero_stage": plan.zero_stage, "micro_batches": plan.micro_batches}),
        }
    })
}

/// Rank 0's progress bar on a terminal; hidden elsewhere (off a terminal rank 0 prints plain
/// progress lines instead, `train_launch::Watch`, and under a front end's events nothing).
fn progress_bar(
    rank: usize,
    hooks: &crate::hooks::Hooks,
    first: u64,
    last_step: u64,
) -> ProgressBar {
    use std::io::IsTerminal as _;
    let tty = std::io::stderr().is_terminal();
    let quiet = hooks.events.is_some();
    let bar = if rank == 0 && tty && !quiet {
        ProgressBar::new(last_step)
    } else {
        ProgressBar::hidden()
    };
    bar.set_position(first - 1);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// Before any device allocates: the simulated devices of this process (`local` of them from
/// `rank` on) at their predicted peaks, plus what the process already holds, must fit in the
/// host memory the kernel can still give, or the run would be killed by the OOM killer with no
/// message (or abort on a failed allocation) partway through.
fn check_host_memory(peaks: &[u64], rank: usize, local: usize) -> Result<()> {
    let Some(available) = tessera_runtime::host::available_memory() else { return Ok(()) };
    let devices: u64 = peaks.iter().skip(rank).take(local).sum();
    let held = tessera_runtime::alloc::current_bytes();
    let need = devices.saturating_add(held);
    if need > available {
        let fix = "train on fewer devices (--devices), with a smaller --batch or --seq or a \
                   smaller model";
        crate::limits::check_address_space(need, devices, held, fix)?;
        bail!(
            "this run needs about {} of host memory ({local} simulated device(s) at their \
             predicted peaks, {} together, plus {} this process holds) but the machine has {} \
             available: train on fewer devices (--devices), with a smaller --batch or --seq or \
             a smaller model, or free memory",
            bytes(need),
            bytes(devices),
            bytes(held),
            bytes(available)
        );
    }
    Ok(())
}

/// About the bytes one checkpoint of this run takes on disk: every parameter and its AdamW
/// state (moments, and the fp32 master of a low-precision weight), plus headers and JSON.
fn checkpoint_bytes(t: &tessera_ir::TrainingGraph) -> u64 {
    let bytes = |id| t.graph.meta(id).size_bytes();
    let state: u64 = t
        .params
        .iter()
        .map(|s| bytes(s.param) + bytes(s.m) + bytes(s.v) + s.master.map_or(0, bytes))
        .sum();
    state + state / 100 + (1 << 20)
}

/// The progress line's message after a step.
pub fn progress(ctx: &RunContext, stats: &tessera_runtime::StepStats, seconds: f64) -> String {
    let tps = (ctx.args.batch * ctx.seq) as f64 / seconds;
    format!(
        "loss {:.4} | {:.0} tok/s | mem {} (predicted {})",
        stats.loss,
        tps,
        bytes(stats.peak_bytes),
        bytes(ctx.predicted_peak.first().copied().unwrap_or(0))
    )
}
