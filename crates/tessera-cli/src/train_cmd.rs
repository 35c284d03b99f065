//! `tessera train`: train a model on real text — on N simulated devices under a parallel plan
//! (the default: 4, automatic plan; see [`crate::spmd_train`]) or on one device — and check the
//! predicted memory (and traffic) against the runtime's accountant and the process heap.

use crate::format::bytes;
use crate::profile_cmd::{print_stdout, OutputFormat, Precision};
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;
use tessera_ir::{build_training_graph, Program, TrainConfig, TrainingGraph};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_profile::simulate_memory;
use tessera_runtime::checkpoint::{load_checkpoint, save_checkpoint, Manifest};
use tessera_runtime::data::{DataOptions, Dataset, TokenDType, Tokenizer};
use tessera_runtime::{alloc, CpuBackend, LossScaleConfig, LossScaleState, LrSchedule, Trainer};

/// The shipped corpus (public-domain Shakespeare, see data/README.md), embedded so the default
/// run works from any directory.
const DEFAULT_CORPUS: &str = include_str!("../../../data/shakespeare.txt");

#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// Devices to train on: simulated devices (threads) in this process, each with its own
    /// memory accountant and budget. Under mpirun/srun/torchrun, the launcher's world instead.
    #[arg(long, default_value_t = 4)]
    pub devices: usize,
    /// The cluster the plan is made for (default `<devices>xcpu`, the calibrated CPU preset).
    #[arg(long)]
    pub cluster: Option<String>,
    /// `auto`, a config string (`"dp2 tp2 zero1"`), or a plan JSON file (`tessera plan --out`).
    #[arg(long, default_value = "auto")]
    pub plan: String,
    /// Seconds a rank waits in a collective for its peers before the run ends with an error
    /// naming the rank and the collective.
    #[arg(long, default_value_t = 30.0)]
    pub comm_timeout: f64,
    /// A preset, a Hugging Face config.json, or a directory holding one (causal LMs).
    #[arg(long, default_value = "gpt2-tiny")]
    pub model: String,
    /// Text file (byte-level tokens, or --tokenizer), nanoGPT token file (.bin), or a directory
    /// with train.bin and val.bin. Default: the shipped Shakespeare corpus.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Hugging Face tokenizer.json to encode a text corpus (default: bytes).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Element type of .bin token files.
    #[arg(long, value_enum, default_value_t = TokenBits::U16)]
    pub token_dtype: TokenBits,
    /// Optimizer steps; also the horizon of the learning-rate schedule.
    #[arg(long, default_value_t = 150)]
    pub steps: u64,
    /// Global batch: sequences per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// fp32, or bf16 / fp16 mixed precision (half-precision weights, activations and
    /// gradients; fp32 master weights and AdamW state; arithmetic in f32). fp16 adds dynamic
    /// loss scaling: overflowing steps are skipped and halve the scale.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub dtype: Precision,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Learning-rate schedule over the run's --steps.
    #[arg(long, value_enum, default_value_t = ScheduleKind::Cosine)]
    pub schedule: ScheduleKind,
    /// Warmup steps of the cosine schedule (default: 5% of --steps).
    #[arg(long)]
    pub warmup: Option<u64>,
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// AdamW weight decay (matrices only).
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// Clip gradients to this global norm (0 disables).
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Device memory budget, e.g. `512MiB`, `2GiB`: exceeding it is a clear error.
    #[arg(long, value_parser = parse_size)]
    pub memory_budget: Option<u64>,
    /// Held-out batches for the final eval loss.
    #[arg(long, default_value_t = 8)]
    pub eval_batches: usize,
    /// Write one JSON object per step (step, loss, grad_norm, lr, tokens_per_s; with fp16
    /// also loss_scale and skipped) to this file.
    #[arg(long)]
    pub log_json: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
    /// Report where the step time goes, per op kind (adds `op_times` to the JSON).
    #[arg(long)]
    pub op_times: bool,
    /// Save a checkpoint (HF config.json + model.safetensors, optimizer state, manifest) to
    /// this directory at the end of the run (atomically: an interrupted save keeps the old one).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Also save every N steps.
    #[arg(long, requires = "save")]
    pub save_every: Option<u64>,
    /// Resume from a checkpoint saved by `--save`, continuing to the same --steps horizon.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Stop after this step (the schedule still spans --steps); for tests and preemption.
    #[arg(long)]
    pub stop_after: Option<u64>,
    /// fp16: the initial loss scale.
    #[arg(long, default_value_t = 65536.0)]
    pub loss_scale: f64,
    /// fp16: double the loss scale after this many consecutive steps without overflow.
    #[arg(long, default_value_t = 2000)]
    pub loss_scale_window: u64,
}

/// Key of the loss scaler's state in a checkpoint manifest's `extra`.
pub const SCALER_KEY: &str = "loss_scaler";

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TokenBits {
    U16,
    U32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ScheduleKind {
    Constant,
    Cosine,
}

/// `512MiB`, `20GiB`, `1.5GB`, `4096` (bytes) → bytes ([`tessera_plan::units::parse_bytes`]).
pub fn parse_size(s: &str) -> Result<u64, String> {
    tessera_plan::units::parse_bytes(s).map_err(|e| e.to_string())
}

/// The corpus `--data`/`--tokenizer` name (default: the shipped one), validated for the model.
pub fn load_dataset(args: &TrainArgs, vocab: usize) -> Result<Dataset> {
    let tokenizer = match &args.tokenizer {
        Some(path) => Tokenizer::from_file(path)?,
        None => Tokenizer::Byte,
    };
    let dataset = match &args.data {
        Some(path) => {
            let data_opts = DataOptions {
                tokenizer,
                token_dtype: match args.token_dtype {
                    TokenBits::U16 => TokenDType::U16,
                    TokenBits::U32 => TokenDType::U32,
                },
                ..DataOptions::default()
            };
            Dataset::load(path, &data_opts)?
        }
        None => Dataset::from_text(DEFAULT_CORPUS, &tokenizer)?,
    };
    dataset.validate(vocab, args.seq)?;
    Ok(dataset)
}

/// The learning-rate schedule of `--schedule` over `--steps`.
pub fn make_schedule(args: &TrainArgs) -> LrSchedule {
    match args.schedule {
        ScheduleKind::Constant => LrSchedule::Constant { lr: args.lr },
        ScheduleKind::Cosine => LrSchedule::WarmupCosine {
            peak: args.lr,
            min_lr: args.lr * 0.1,
            warmup: args.warmup.unwrap_or(args.steps / 20),
            total: args.steps,
        },
    }
}

/// The settings a resumed run must share with the saved one (besides steps and seed).
pub fn run_facts(args: &TrainArgs) -> serde_json::Value {
    json!({"batch": args.batch, "seq": args.seq,
           "dtype": format!("{:?}", args.dtype).to_lowercase()})
}

/// On one device: the training graph checkpointed (modes chosen per block by the planner's
/// DP) so its Program fits `budget`; unchanged when it fits as it is.
pub fn checkpoint_to_fit(train: TrainingGraph, budget: u64) -> Result<TrainingGraph> {
    let peak = simulate_memory(&Program::lower_training(&train)).report.peak_bytes;
    if peak <= budget {
        return Ok(train);
    }
    let cluster = tessera_plan::Cluster::parse("1xcpu").map_err(crate::plan_cmd::plan_err)?;
    let mesh = tessera_plan::Mesh::new(&cluster, &[1], &[]).map_err(crate::plan_cmd::plan_err)?;
    let cost = tessera_plan::cost::CostModel::new(cluster.device.clone());
    let u = tessera_plan::lower::Unfinished {
        training: train,
        leaf_specs: Vec::new(),
        micro_batches: 1,
    };
    let Some(measured) =
        tessera_plan::ckpt::measure(&u, &mesh, &cost).map_err(crate::plan_cmd::plan_err)?
    else {
        bail!(
            "the step needs {} but --memory-budget is {}, and the model has no repeated blocks \
             to checkpoint: raise the budget or lower --batch/--seq",
            bytes(peak),
            bytes(budget)
        );
    };
    match tessera_plan::ckpt::choose_measured(&u, &mesh, &cost, budget, &measured)
        .map_err(crate::plan_cmd::plan_err)?
    {
        Some(l) => Ok(l.training),
        None => bail!(
            "the step needs at least {} even recomputing every block, but --memory-budget is {}: \
             raise the budget to at least that, or lower --batch/--seq",
            bytes(tessera_plan::ckpt::min_peak(&measured)),
            bytes(budget)
        ),
    }
}

pub fn run(args: &TrainArgs) -> Result<()> {
    if args.devices == 0 {
        bail!("--devices must be at least 1");
    }
    if let Some(env) = tessera_comm::discover().map_err(|e| anyhow::anyhow!(e))? {
        if env.world_size > 1 {
            return crate::spmd_train::run_launched(args, &env);
        }
    }
    if args.devices > 1 {
        return crate::spmd_train::run(args, args.devices);
    }
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let cfg = ModelConfig::resolve(&args.model)?;
    let opts = BuildOptions { batch: args.batch, seq: args.seq, dtype: args.dtype.dtype() };
    let model = build(&cfg, &opts)?;
    let eval_model = build(&cfg.without_dropout(), &opts)?;
    let vocab = cfg.vocab_size().unwrap_or(0);
    let dataset = load_dataset(args, vocab)?;

    let train_cfg = TrainConfig {
        weight_decay: args.weight_decay,
        max_grad_norm: (args.max_grad_norm > 0.0).then_some(args.max_grad_norm),
        ..TrainConfig::default()
    };
    let train = build_training_graph(model.builder, model.loss, &train_cfg)
        .context("building the training graph")?;
    let train = match args.memory_budget {
        Some(budget) => checkpoint_to_fit(train, budget)?,
        None => train,
    };
    let schedule = make_schedule(args);
    let run_facts = run_facts(args);
    let resume = match &args.resume {
        Some(dir) => {
            let ckpt = load_checkpoint(dir)?;
            let m = &ckpt.manifest;
            let mut facts = m.extra.clone();
            if let Some(map) = facts.as_object_mut() {
                map.remove(SCALER_KEY);
            }
            if m.total_steps != args.steps || m.seed != args.seed || facts != run_facts {
                bail!(
                    "{} was saved by a run with --steps {} --seed {} {}; resume with the same \
                     settings (got --steps {} --seed {} {run_facts})",
                    dir.display(),
                    m.total_steps,
                    m.seed,
                    m.extra,
                    args.steps,
                    args.seed
                );
            }
            Some(ckpt)
        }
        None => None,
    };

    let heap_baseline = alloc::current_bytes();
    let scaled = train.loss_scale.is_some();
    let mut trainer =
        Trainer::new(train, CpuBackend::new(0), schedule.clone(), args.seed, args.memory_budget)?
            .with_eval(eval_model.builder.finish(), eval_model.loss, CpuBackend::new(0))?;
    if scaled {
        let scale_cfg = LossScaleConfig {
            init_scale: args.loss_scale,
            growth_interval: args.loss_scale_window,
            ..LossScaleConfig::default()
        };
        trainer = trainer.with_loss_scale(scale_cfg).context("--loss-scale")?;
    }
    if let Some(ckpt) = &resume {
        trainer
            .restore(&ckpt.params, &ckpt.optimizer, ckpt.manifest.step)
            .with_context(|| format!("resuming from {}", ckpt.dir.display()))?;
        if let Some(state) = ckpt.manifest.extra.get(SCALER_KEY) {
            let state: LossScaleState = serde_json::from_value(state.clone())
                .with_context(|| format!("{}: bad {SCALER_KEY}", ckpt.dir.display()))?;
            trainer.set_loss_scale_state(state)?;
        }
    }
    let first = trainer.steps_done() + 1;
    let last_step = args.stop_after.map_or(args.steps, |k| k.min(args.steps));
    if first > last_step {
        bail!("nothing to do: the run is already at step {} of {last_step}", first - 1);
    }
    let save = |trainer: &Trainer<CpuBackend>| -> Result<()> {
        let Some(dir) = &args.save else { return Ok(()) };
        let mut manifest = Manifest::new(
            trainer.steps_done(),
            args.steps,
            args.seed,
            &args.model,
            schedule.clone(),
        );
        manifest.extra = run_facts.clone();
        if let Some(state) = trainer.loss_scale_state() {
            manifest.extra[SCALER_KEY] = serde_json::to_value(state)?;
        }
        save_checkpoint(
            dir,
            &cfg.to_hf_json(),
            &trainer.parameters(),
            &trainer.optimizer_state()?,
            &manifest,
        )
        .with_context(|| format!("saving a checkpoint to {}", dir.display()))?;
        Ok(())
    };
    let predicted = simulate_memory(trainer.program()).report.peak_bytes;
    trainer.record_timings(args.op_times);

    let mut log = match &args.log_json {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let bar = ProgressBar::new(last_step);
    bar.set_position(first - 1);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let tokens_per_step = (args.batch * args.seq) as f64;
    let mut initial_loss = f64::NAN;
    let mut last = None;
    let mut measured = 0u64;
    let mut skipped_steps = 0u64;
    alloc::reset_peak();
    let start = Instant::now();
    for step in first..=last_step {
        let b = dataset.train_batch(args.seed, step, args.batch, args.seq)?;
        let t0 = Instant::now();
        let stats = trainer.step(&b.inputs, &b.targets)?;
        let dt = t0.elapsed().as_secs_f64();
        if step == first {
            initial_loss = stats.loss;
        }
        measured = measured.max(stats.peak_bytes);
        skipped_steps += u64::from(stats.skipped);
        let tps = tokens_per_step / dt;
        if let Some(w) = log.as_mut() {
            // A skipped step's norm is inf or NaN, which JSON cannot hold: it is written null.
            let grad_norm = stats.grad_norm.is_finite().then_some(stats.grad_norm);
            let mut line = json!({"step": step, "loss": stats.loss, "grad_norm": grad_norm,
                              "lr": stats.lr, "tokens_per_s": tps, "peak_bytes": stats.peak_bytes});
            if scaled {
                line["loss_scale"] = json!(stats.loss_scale);
                line["skipped"] = json!(stats.skipped);
            }
            writeln!(w, "{line}").context("writing the step log")?;
        }
        bar.set_position(step);
        bar.set_message(format!(
            "loss {:.4} | {:.0} tok/s | mem {} (predicted {})",
            stats.loss,
            tps,
            bytes(stats.peak_bytes),
            bytes(predicted)
        ));
        last = Some(stats);
        if args.save_every.is_some_and(|n| n > 0 && step % n == 0) && step != last_step {
            save(&trainer)?;
        }
    }
    save(&trainer)?;
    let elapsed = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    if let Some(mut w) = log {
        w.flush().context("writing the step log")?;
    }
    let heap_peak = alloc::peak_bytes().saturating_sub(heap_baseline);
    let last = last.context("no step ran")?;
    let val: Vec<(Vec<i64>, Vec<i64>)> = if args.eval_batches == 0 {
        Vec::new()
    } else {
        dataset
            .val_batches(args.batch, args.seq, args.eval_batches)?
            .into_iter()
            .map(|b| (b.inputs, b.targets))
            .collect()
    };
    // `--eval-batches 0` skips the held-out evaluation.
    let eval_loss = if val.is_empty() { None } else { Some(trainer.eval(&val)?) };
    let steps_run = last_step + 1 - first;
    let tokens_per_s = tokens_per_step * steps_run as f64 / elapsed;
    let unigram = tessera_runtime::data::unigram_entropy_nats(&dataset.train, dataset.vocab_size);

    let op_times: Vec<(&str, u64, f64)> = {
        let mut v: Vec<_> = trainer
            .timings()
            .map(|t| t.iter().map(|(k, o)| (*k, o.calls, o.seconds)).collect())
            .unwrap_or_default();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        v
    };
    let op_total: f64 = op_times.iter().map(|o| o.2).sum();
    match args.format {
        OutputFormat::Json => {
            let mut doc = json!({
                "model": cfg.name(),
                "devices": 1,
                "steps": steps_run,
                "last_step": last_step,
                "batch": args.batch,
                "seq": args.seq,
                "initial_loss": initial_loss,
                "final_loss": last.loss,
                "eval_loss": eval_loss,
                "unigram_entropy": unigram,
                "tokens_per_s": tokens_per_s,
                "elapsed_s": elapsed,
                "memory": {
                    "predicted_peak_bytes": [predicted],
                    "measured_peak_bytes": [measured],
                    "heap_peak_bytes": heap_peak,
                },
            });
            if scaled {
                doc["skipped_steps"] = json!(skipped_steps);
                doc["loss_scale"] = json!(trainer.loss_scale_state().map(|s| s.scale));
            }
            if args.op_times {
                doc["op_times"] = op_times
                    .iter()
                    .map(|(k, calls, s)| (k.to_string(), json!({"calls": calls, "seconds": s})))
                    .collect::<serde_json::Map<_, _>>()
                    .into();
            }
            print_stdout(&format!("{}\n", serde_json::to_string_pretty(&doc)?))?;
        }
        OutputFormat::Table => {
            let text = format!(
                "{model} · {steps} steps · batch {b} × seq {s} · {tps:.0} tokens/s\n\
                 loss        {l0:.4} → {l1:.4} (train), {le} (held-out); unigram entropy {u:.4}\n\
                 memory      predicted peak {p}, measured peak {m}, process heap peak {h}\n",
                model = cfg.name(),
                steps = steps_run,
                b = args.batch,
                s = args.seq,
                tps = tokens_per_s,
                l0 = initial_loss,
                l1 = last.loss,
                le = eval_loss.map_or("not evaluated".to_string(), |e| format!("{e:.4}")),
                u = unigram,
                p = bytes(predicted),
                m = bytes(measured),
                h = bytes(heap_peak),
            );
            let mut text = text;
            if let (true, Some(state)) = (scaled, trainer.loss_scale_state()) {
                text.push_str(&format!(
                    "fp16        {skipped_steps} skipped steps (overflow); loss scale now {}\n",
                    state.scale
                ));
            }
            if args.op_times {
                text.push_str("where the time goes (all steps):\n");
                for (k, calls, secs) in &op_times {
                    text.push_str(&format!(
                        "  {k:<24} {secs:>8.2} s  {:>5.1}%  {calls} calls\n",
                        100.0 * secs / op_total.max(1e-12)
                    ));
                }
            }
            print_stdout(&text)?;
        }
    }
    Ok(())
}
