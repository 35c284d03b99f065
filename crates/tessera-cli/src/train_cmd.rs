//! `tessera train`: one path for every model, precision and plan. The command parses, plans —
//! a single device is a 1-device mesh, planned like any other (its `--memory-budget` is the
//! planner's joint checkpointing search) — and hands the plan's Program to the runtime's one
//! training loop ([`tessera_runtime::run`]) on every device: simulated devices as threads
//! ([`crate::train_launch`]), or one rank per process under `mpirun`/`srun`/`torchrun`. It
//! then reports, per device, the predicted against the measured memory and traffic.

use crate::format::bytes;
use crate::plan_cmd::{choose_plan, plan_err, PlanModel};
use crate::profile_cmd::{OutputFormat, Precision};
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;
use tessera_ir::{Graph, TensorId, TrainConfig, TrainingGraph};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::plan::Plan;
use tessera_plan::planner;
use tessera_plan::Cluster;
use tessera_runtime::checkpoint::Manifest;
use tessera_runtime::data::{DataOptions, Dataset, MaskedLm, Objective, TokenDType, Tokenizer};
use tessera_runtime::diffusion::DiffusionObjective;
use tessera_runtime::examples::{is_jsonl, ExampleSet};
use tessera_runtime::hf_weights::open_weights;
use tessera_runtime::images::ImageSet;
use tessera_runtime::init::{init_rules_by_name, InitRule};
use tessera_runtime::mapped::MappedCheckpoint;
use tessera_runtime::run::SaveSpec;
use tessera_runtime::trainer::ShardSource;
use tessera_runtime::LrSchedule;
use tessera_runtime::TrainData;

/// The shipped corpus (public-domain Shakespeare, see data/README.md), embedded so the default
/// run works from any directory.
const DEFAULT_CORPUS: &str = include_str!("../../../data/shakespeare.txt");

/// Where the devices' kernels run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// This machine's CPU cores (every device of the plan a thread or an MPI rank).
    Cpu,
    /// NVIDIA GPUs through CUDA: one unless `--devices N` (GPU i for device i, over NCCL; several
    /// GPUs are untested); needs a `tessera` built with `--features cuda` and an NVIDIA driver.
    Cuda,
}

#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// Devices to train on: simulated devices (threads) in this process, each with its own
    /// memory accountant and budget. Under mpirun/srun/torchrun, the launcher's world instead.
    #[arg(long, default_value_t = 4)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::devices())]
    pub devices: usize,
    /// Where the kernels run: `cpu`, or `cuda` (GPU i for device i; several over NCCL, untested).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// The cluster the plan is made for (default: `<devices>xcpu`, the calibrated CPU preset;
    /// with `--device cuda`, this machine's GPUs: their preset matched by name or their
    /// `tessera calibrate --device cuda` figures, their free memory as the budget).
    #[arg(long)]
    pub cluster: Option<String>,
    /// `auto`, a config string (`"dp2 tp2 zero1"`), or a plan JSON file (`tessera plan --out`).
    #[arg(long, default_value = "auto")]
    pub plan: String,
    /// Seconds a rank waits in a collective for its peers before the run ends with an error
    /// naming the rank and the collective.
    #[arg(long, default_value_t = 30.0)]
    #[arg(allow_hyphen_values = true, value_parser = crate::limits::comm_timeout)]
    pub comm_timeout: f64,
    /// A preset, a Hugging Face config.json, or a directory holding one: causal LMs learn the
    /// next token, BERT masked positions.
    #[arg(long, default_value = "gpt2-tiny")]
    pub model: String,
    /// Fine-tune: start from the weights of a Hugging Face checkpoint directory (its
    /// config.json is the model; `model.safetensors` or a sharded index; or a sharded
    /// checkpoint of `train`), with fresh optimizer state, on any plan; each device reads only
    /// its slices of the files. Takes the place of --model (a --model naming another model is
    /// refused); not with --resume, which continues a saved run instead.
    #[arg(long, value_name = "DIR")]
    pub init: Option<PathBuf>,
    /// Language models: a text file (byte-level tokens, or --tokenizer), a nanoGPT token file
    /// (.bin), a directory with train.bin and val.bin, or fine-tuning examples (.jsonl: one
    /// {"text"} or {"prompt", "completion"} object per line; the loss counts completion tokens
    /// only). Default: the shipped Shakespeare corpus. ViT: a CSV of images (pixels, then the
    /// class); default data/digits.csv, which scripts/setup.sh installs. A diffusers UNet
    /// (`--model PIPE/unet`): a folder of PNG/JPEG pictures with captions (a .txt of the same
    /// stem, or metadata.jsonl lines {"file_name", "text"}), encoded by the pipeline's frozen
    /// VAE and CLIP text encoder.
    #[arg(long)]
    pub data: Option<PathBuf>,
    #[command(flatten)]
    pub diffusion: crate::diffusion_args::DiffusionArgs,
    /// Hugging Face tokenizer.json to encode a text corpus (default: bytes).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Element type of .bin token files.
    #[arg(long, value_enum, default_value_t = TokenBits::U16)]
    pub token_dtype: TokenBits,
    /// Optimizer steps; also the horizon of the learning-rate schedule.
    #[arg(long, default_value_t = 150)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::steps())]
    pub steps: u64,
    /// Global batch: sequences per step.
    #[arg(long, default_value_t = 8)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::batch())]
    pub batch: usize,
    #[arg(long, default_value_t = 128)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::seq())]
    pub seq: usize,
    /// fp32, or bf16 / fp16 mixed precision (half-precision weights, activations and
    /// gradients; fp32 master weights and AdamW state; arithmetic in f32). fp16 adds dynamic
    /// loss scaling: overflowing steps are skipped and halve the scale.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub dtype: Precision,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    #[arg(allow_hyphen_values = true, value_parser = crate::limits::lr)]
    pub lr: f64,
    /// Learning-rate schedule over the run's --steps.
    #[arg(long, value_enum, default_value_t = ScheduleKind::Cosine)]
    pub schedule: ScheduleKind,
    /// Warmup steps of the cosine schedule (default: 5% of --steps).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::limits::warmup())]
    pub warmup: Option<u64>,
    #[arg(long, default_value_t = 1337)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::seed())]
    pub seed: u64,
    /// AdamW weight decay (matrices only).
    #[arg(long, default_value_t = 0.1)]
    #[arg(allow_hyphen_values = true, value_parser = crate::limits::weight_decay)]
    pub weight_decay: f64,
    /// Clip gradients to this global norm (0 disables).
    #[arg(long, default_value_t = 1.0)]
    #[arg(allow_hyphen_values = true, value_parser = crate::limits::max_grad_norm)]
    pub max_grad_norm: f64,
    /// Device memory budget, e.g. `512MiB`, `2GiB`: exceeding it is a clear error.
    #[arg(long, value_parser = parse_size)]
    pub memory_budget: Option<u64>,
    #[command(flatten)]
    pub tiers: crate::tier_args::TierArgs,
    /// Held-out batches for the final eval loss.
    #[arg(long, default_value_t = 8)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::eval_batches())]
    pub eval_batches: usize,
    /// Write one JSON object per step (step, loss, grad_norm, lr, tokens_per_s; with fp16
    /// also loss_scale and skipped) to this file.
    #[arg(long)]
    pub log_json: Option<PathBuf>,
    /// Draw the loss per step (and the held-out loss) as an SVG file at the end of the run.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
    /// Report where the step time goes, per op kind (adds `op_times` to the JSON).
    #[arg(long)]
    pub op_times: bool,
    /// Save a checkpoint (HF config.json + model.safetensors, optimizer state, manifest) to
    /// this directory at the end of the run (atomically: an interrupted save keeps the old one).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Also save every N steps (at least 1; without it, only at the end).
    #[arg(long, requires = "save")]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::steps())]
    pub save_every: Option<u64>,
    /// Replace the checkpoint `--save` names although this run does not continue it (without
    /// this flag, a `--save` directory holding a checkpoint must be the one `--resume` names).
    #[arg(long, requires = "save")]
    pub overwrite_save: bool,
    #[command(flatten)]
    pub finetune: crate::finetune::FinetuneArgs,
    /// LoRA: also write the trained adapter in PEFT's format (adapter_config.json,
    /// adapter_model.safetensors) to this directory, from the checkpoint --save writes.
    #[arg(long, value_name = "DIR", requires = "save")]
    pub save_adapter: Option<PathBuf>,
    /// LoRA: also write the base with the trained adapter merged in (W + alpha/r·B·A) as a
    /// Hugging Face directory, from the checkpoint --save writes.
    #[arg(long, value_name = "DIR", requires = "save")]
    pub merge_into: Option<PathBuf>,
    /// Resume from a checkpoint saved by `--save` (under any plan or device count). A
    /// `--steps` other than the saved run's extends it, the learning-rate schedule following
    /// the new horizon from the saved step.
    /// The saved run's --lr, --schedule, --warmup, --weight-decay and --max-grad-norm are
    /// kept: a different value is refused, naming the saved one.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Stop after this step (the schedule still spans --steps); for tests and preemption.
    #[arg(long, allow_negative_numbers = true, value_parser = crate::limits::steps())]
    pub stop_after: Option<u64>,
    /// fp16: the initial loss scale.
    #[arg(long, default_value_t = 65536.0)]
    #[arg(allow_hyphen_values = true, value_parser = crate::limits::loss_scale)]
    pub loss_scale: f64,
    /// fp16: double the loss scale after this many consecutive steps without overflow.
    #[arg(long, default_value_t = 2000)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::steps())]
    pub loss_scale_window: u64,
    /// A TOML run file holding any of these flags by their long names (`model = "gpt2-tiny"`,
    /// `batch = 8`, `memory-budget = "20GiB"`, `explain = true`, lists for repeatable flags);
    /// flags on the command line override it. examples/ has some.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The flags given on the command line (a plan file supplies the run's others).
    #[arg(skip)]
    pub given: crate::plan_file::Given,
}

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

/// The tokenizer `--tokenizer` names (default: bytes).
fn tokenizer(args: &TrainArgs) -> Result<Tokenizer> {
    Ok(match &args.tokenizer {
        Some(path) => Tokenizer::from_file(path)?,
        None => Tokenizer::Byte,
    })
}

/// What the model learns from the corpus: BERT masked positions (15%), the others the next
/// token.
pub fn objective(args: &TrainArgs, cfg: &ModelConfig) -> Result<Objective> {
    Ok(match cfg {
        ModelConfig::Bert(c) => Objective::MaskedLm(MaskedLm {
            mask_id: tokenizer(args)?.mask_id(c.vocab_size)?,
            vocab_size: c.vocab_size,
            prob: 0.15,
        }),
        _ => Objective::CausalLm,
    })
}

/// The noise a dense image model (an imported UNet) learns to remove, in the normalised
/// pixels' units (`[-1, 1]`).
pub const DENOISE_STD: f32 = 0.5;

/// Where ViT's images are when `--data` is not given (installed by scripts/setup.sh).
pub const DEFAULT_IMAGES: &str = "data/digits.csv";

/// The corpus `--data`/`--tokenizer` name (default: the shipped one), validated for the model.
pub fn load_dataset(args: &TrainArgs, vocab: usize) -> Result<Dataset> {
    let tokenizer = tokenizer(args)?;
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

/// What the model trains on, by family: images for ViT, fine-tuning examples for a `.jsonl`
/// file, otherwise a token stream (next tokens, or BERT's masked positions).
pub fn load_data(args: &TrainArgs, cfg: &ModelConfig) -> Result<TrainData> {
    match cfg {
        ModelConfig::Vit(c) => {
            let path = args.data.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_IMAGES));
            let shape = [c.num_channels, c.image_size[0], c.image_size[1]];
            let images = ImageSet::load_csv(&path, shape, 0.2)?;
            images.validate(c.num_labels)?;
            return Ok(TrainData::Images(images));
        }
        ModelConfig::Onnx(c) if c.vocab_size().is_none() => {
            let shape = c.image_shape().with_context(|| {
                format!(
                    "{}: `train` reads images, and the model's input is not [batch, C, H, W]",
                    c.path
                )
            })?;
            let path = args.data.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_IMAGES));
            let images = ImageSet::load_csv(&path, shape, 0.2)?;
            return Ok(match &c.task {
                tessera_models::OnnxTask::ImageClassifier { num_classes } => {
                    images.validate(*num_classes)?;
                    TrainData::Images(images)
                }
                // A dense model whose output is its input's shape learns to denoise the images.
                tessera_models::OnnxTask::Regression { output } if output[..] == shape[..] => {
                    TrainData::Denoise { images, noise: DENOISE_STD }
                }
                _ => bail!(
                    "{}: `train` trains dense models whose output has the input's shape (as \
                     denoisers); this one maps {shape:?} to another shape",
                    c.path
                ),
            });
        }
        ModelConfig::Dit(c) => {
            let path = args.data.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_IMAGES));
            let shape = [c.in_channels, c.sample_size, c.sample_size];
            let images = ImageSet::load_csv(&path, shape, 0.2)?;
            images.validate(c.num_classes)?;
            let schedule = args.diffusion.schedule(&args.model)?;
            let objective =
                DiffusionObjective::new(schedule, args.diffusion.cond_drop_prob, c.num_classes)?;
            return Ok(TrainData::Diffusion { images, objective });
        }
        ModelConfig::UNet(c) => {
            let Some(data) = &args.data else {
                bail!(
                    "a UNet2DConditionModel trains on captioned pictures: pass --data DIR (PNG/JPEG \
                     files, each with a caption in a .txt of the same stem or in metadata.jsonl)"
                )
            };
            let unet_dir = args.init.clone().unwrap_or_else(|| PathBuf::from(&args.model));
            let latents = crate::latent::text_latents(&unet_dir, c, data)?;
            let schedule = args.diffusion.schedule(&unet_dir.display().to_string())?;
            let objective = DiffusionObjective::new(schedule, args.diffusion.cond_drop_prob, 0)?;
            return Ok(TrainData::TextDiffusion { data: latents, objective });
        }
        ModelConfig::Mlp(_) => bail!(
            "`train` has no data loader for the mlp model's feature vectors; train a language \
             model or ViT, or profile and plan the mlp"
        ),
        ModelConfig::ClipText(_) | ModelConfig::Vae(_) => bail!(
            "`train` has no data for {} (Stable Diffusion keeps its text encoder and VAE \
             frozen); run it with `tessera eval --inputs/--outputs`, or profile and plan it",
            cfg.name()
        ),
        _ => {}
    }
    let vocab = cfg.vocab_size().unwrap_or(0);
    if let Some(path) = args.data.as_ref().filter(|p| is_jsonl(p)) {
        if matches!(cfg, ModelConfig::Bert(_)) {
            bail!(
                "{}: JSONL examples fine-tune causal language models; BERT trains masked-LM on a \
                 text corpus (pass a .txt file)",
                path.display()
            );
        }
        let examples = ExampleSet::load(path, &tokenizer(args)?)?;
        examples.validate(vocab, args.seq)?;
        return Ok(TrainData::Examples(examples));
    }
    let data = load_dataset(args, vocab)?;
    Ok(TrainData::Stream { data, objective: objective(args, cfg)? })
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

/// The settings a resumed run must share with the saved one (besides the seed and the
/// learning rate): batch, sequence, precision and a fingerprint of the training data (data
/// from a front end, a Python iterable, is recorded as such: it cannot be fingerprinted).
pub fn run_facts(args: &TrainArgs, data: Option<&TrainData>) -> serde_json::Value {
    let fingerprint = data.map_or_else(|| json!(EXTERNAL_DATA), |d| json!(d.fingerprint()));
    json!({"batch": args.batch, "seq": args.seq,
           "dtype": format!("{:?}", args.dtype).to_lowercase(),
           "data": fingerprint})
}

/// A run's data fingerprint when its batches come from the front end (Python).
const EXTERNAL_DATA: &str = "batches from the caller";

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

/// Checks the numeric flags before anything is built.
fn validate(args: &TrainArgs) -> Result<()> {
    if args.devices == 0 {
        bail!("--devices must be at least 1");
    }
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if args.batch == 0 || args.seq == 0 {
        bail!("--batch and --seq must be at least 1");
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        bail!("--lr {} must be a positive number, like 1e-3", args.lr);
    }
    if !(args.weight_decay.is_finite() && args.weight_decay >= 0.0) {
        bail!("--weight-decay {} must be 0 or more", args.weight_decay);
    }
    if !(args.max_grad_norm.is_finite() && args.max_grad_norm >= 0.0) {
        bail!("--max-grad-norm {} must be 0 (off) or more", args.max_grad_norm);
    }
    if let Some(w) = args.warmup.filter(|&w| w > args.steps) {
        bail!("--warmup {w} is longer than the run (--steps {}): lower it", args.steps);
    }
    if !(args.comm_timeout.is_finite() && args.comm_timeout > 0.0) {
        bail!("--comm-timeout {} must be a positive number of seconds", args.comm_timeout);
    }
    if let Some(path) = &args.plot {
        crate::pictures::check_destination(path, "--plot")?;
    }
    crate::limits::check_train(args.steps, args.stop_after, args.lr, args.weight_decay)
}

/// `args` as the run reads them: a plan file's settings adopted, `--device cuda`'s device
/// count, the numbers checked.
fn settled(args: &TrainArgs) -> Result<TrainArgs> {
    let mut args = adopt_plan_file(args)?;
    if args.device == DeviceKind::Cuda && !args.given.gave("devices") {
        // On GPUs, a device is a GPU: one unless asked for more (not 4 simulated ones).
        args.devices = 1;
    }
    validate(&args)?;
    Ok(args)
}

/// `tessera train` for a front end (Python): the run on this process's devices with the
/// front end's hooks, and the report `--format json` prints.
pub fn report(args: &TrainArgs, hooks: &crate::hooks::Hooks) -> Result<serde_json::Value> {
    let args = settled(args)?;
    if tessera_comm::discover().map_err(|e| anyhow::anyhow!(e))?.is_some_and(|e| e.world_size > 1) {
        bail!(
            "train from Python runs its devices as threads of this process; under              mpirun/srun/torchrun, run the `tessera train` command on every rank"
        );
    }
    let done = crate::train_launch::train_local(&args, args.devices, hooks)?;
    crate::train_launch::report_json(&done.ctx, &done.outcome, done.heap_peak)
}

pub fn run(args: &TrainArgs) -> Result<()> {
    let args = &settled(args)?;
    let launched = tessera_comm::discover().map_err(|e| anyhow::anyhow!(e))?;
    if let Some(env) = launched {
        if env.world_size > 1 {
            return crate::train_launch::run_launched(args, &env);
        }
    }
    crate::train_launch::run_local(args, args.devices)
}

/// `args` with the model (unless `--init` names one), batch, sequence length and precision of
/// the plan file `--plan` names, where not given ([`crate::plan_file`]).
fn adopt_plan_file(args: &TrainArgs) -> Result<TrainArgs> {
    let mut a = args.clone();
    let (plan, given) = (a.plan.clone(), a.given.clone());
    let model = a.init.is_none().then(|| given.flag("model", &mut a.model));
    crate::plan_file::adopt_run(
        &plan,
        model,
        given.flag("batch", &mut a.batch),
        given.flag("seq", &mut a.seq),
        given.flag("dtype", &mut a.dtype),
    )?;
    Ok(a)
}

/// The resumed checkpoint's steps, schedule and horizon: the seed, batch, sequence length and
/// precision must be the saved run's; a different `--steps` extends (or shortens) the run, the
/// learning-rate schedule following the new horizon from the saved step.
fn check_resume(
    args: &TrainArgs,
    ckpt: &MappedCheckpoint,
    data: Option<&TrainData>,
) -> Result<(LrSchedule, Option<Extended>)> {
    let m = &ckpt.manifest;
    let mut facts = m.extra.clone();
    if let Some(map) = facts.as_object_mut() {
        map.remove(tessera_runtime::loss_scale::SCALER_KEY);
        map.remove(crate::train_guard::OPTIMIZER_KEY);
    }
    let mut want = run_facts(args, data);
    // Checkpoints saved before the data fingerprint was recorded are compared without it.
    if facts.get("data").is_none() {
        if let Some(map) = want.as_object_mut() {
            map.remove("data");
        }
    }
    if m.seed != args.seed || facts != want {
        let data_differs = facts.get("data").is_some() && facts.get("data") != want.get("data");
        bail!(
            "{} was saved by a run with --seed {} {}; resume with the same settings (got --seed \
             {} {want}){}",
            ckpt.dir.display(),
            m.seed,
            facts,
            args.seed,
            if data_differs { "; the training data differs (--data, --tokenizer)" } else { "" }
        );
    }
    let saved_peak = match m.schedule {
        LrSchedule::Constant { lr } => lr,
        LrSchedule::WarmupCosine { peak, .. } => peak,
    };
    if args.lr != saved_peak {
        bail!(
            "--lr {} differs from the learning rate {} of the run saved in {}; a resumed run \
             keeps its schedule: resume with --lr {saved_peak}",
            args.lr,
            saved_peak,
            ckpt.dir.display()
        );
    }
    if args.steps <= m.step {
        bail!(
            "{} is at step {} already; to train on, resume with --steps above {} (it was saved \
             by a run of --steps {})",
            ckpt.dir.display(),
            m.step,
            m.step,
            m.total_steps
        );
    }
    if args.steps == m.total_steps {
        return Ok((m.schedule.clone(), None));
    }
    let extended = Extended { saved_total: m.total_steps, total: args.steps };
    Ok((m.schedule.with_horizon(args.steps), Some(extended)))
}

/// The model of the run being resumed must be the saved run's: `--model` (or `--init`) as
/// the manifest records it, the same preset name or a path to the same file or folder.
/// Manifests that record none (older checkpoints) are not checked.
fn check_resumed_model(args: &TrainArgs, saved: &str, dir: &std::path::Path) -> Result<()> {
    let got = args.init.as_ref().map_or(args.model.clone(), |d| d.display().to_string());
    let same_path = |a: &str, b: &str| match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    };
    if saved.is_empty() || saved == got || same_path(saved, &got) {
        return Ok(());
    }
    let flag = if std::path::Path::new(saved).is_dir() { "--init" } else { "--model" };
    bail!(
        "{} was saved by a run of {flag} {saved}, and this run's model is {got}: resume with \
         {flag} {saved}",
        dir.display()
    )
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
    let global_train = &model.global;
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
    let predicted_comm_bytes: Vec<u64> = match &exe.pipeline {
        Some(p) => {
            p.devices.iter().map(|d| d.lowered.collectives.iter().map(|c| c.bytes).sum()).collect()
        }
        None => vec![exe.lowered.collectives.iter().map(|c| c.bytes).sum()],
    };
    let mut predicted_calls = BTreeMap::new();
    for c in &exe.lowered.collectives {
        *predicted_calls.entry(c.op.to_string()).or_insert(0) += 1;
    }

    let (start, steps_done, schedule, extended) = match resumed {
        Some(ckpt) => {
            crate::train_guard::check_resume_settings(args, &ckpt.manifest)?;
            let (schedule, extended) = check_resume(args, &ckpt, data.as_ref())?;
            let step = ckpt.manifest.step;
            (Start::Resume(Box::new(ckpt)), step, schedule, extended)
        }
        None => match &args.init {
            Some(dir) => {
                let weights = match lora_start {
                    // The base file holds the base's weights: checked against the base graph.
                    Some(first) => {
                        let base = build(&cfg, &BuildOptions { batch: 1, seq: 1, dtype })?;
                        let rest = open_weights(dir, &base.builder.finish())
                            .with_context(|| format!("--init {}", dir.display()))?;
                        // QLoRA: the base's linears quantised as they are read.
                        let rest: Box<dyn ShardSource + Send> = match args.finetune.quantize_base {
                            Some(_) => Box::new(crate::finetune::Quantizing::new(
                                &global_train.graph,
                                rest,
                            )),
                            None => rest,
                        };
                        Box::new(crate::finetune::Layered { first, rest })
                    }
                    None => open_weights(dir, &global_train.graph)
                        .with_context(|| format!("--init {}", dir.display()))?,
                };
                (Start::Weights(weights), 0, make_schedule(args), None)
            }
            // An ONNX file carries its weights: training starts from them.
            None if matches!(cfg, ModelConfig::Onnx(_)) => {
                let file = std::path::Path::new(&args.model);
                let weights = open_weights(file, &global_train.graph)
                    .with_context(|| format!("--model {}: its initialisers", file.display()))?;
                (Start::Weights(weights), 0, make_schedule(args), None)
            }
            None => {
                let rules = init_rules_by_name(&global_train.graph);
                (Start::Fresh(rules), 0, make_schedule(args), None)
            }
        },
    };
    // One run writes a checkpoint directory at a time: rank 0 holds its lock to the end.
    let save_lock = match (&args.save, rank) {
        (Some(dir), 0) => Some(tessera_runtime::host::lock_dir(dir).context("--save")?),
        _ => None,
    };
    if let Some(dir) = &args.save {
        // Before step 1: a save that cannot happen must not cost the training it was for.
        // A save writes the new checkpoint beside the previous one: once one exists, every
        // later save needs room for a second.
        let saves_to_come = args.save_every.is_some_and(|k| k > 0 && k < args.steps);
        let holds_one = dir.join(tessera_runtime::checkpoint::MANIFEST_FILE).is_file();
        let copies = if saves_to_come && !holds_one { 2 } else { 1 };
        let bytes = checkpoint_bytes(global_train) * copies;
        tessera_runtime::checkpoint::preflight_save(dir, bytes).context("--save")?;
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
    let save = args.save.as_ref().map(|dir| {
        let model = args.init.as_ref().map_or(args.model.clone(), |d| d.display().to_string());
        let mut manifest = Manifest::new(0, args.steps, args.seed, model, schedule.clone());
        manifest.extra = run_facts(args, data.as_ref());
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
    });
    // Off a terminal the bar is hidden (no escape codes): rank 0 prints plain progress lines
    // instead (`train_launch::Watch`).
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
            Some(p) => p.devices.into_iter().map(|d| d.lowered.training).collect(),
            None => vec![exe.lowered.training],
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
