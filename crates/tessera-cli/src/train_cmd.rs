//! `tessera train`: one path for every model, precision and plan. The command parses, plans —
//! a single device is a 1-device mesh, planned like any other (its `--memory-budget` is the
//! planner's joint checkpointing search) — and hands the plan's Program to the runtime's one
//! training loop ([`tessera_runtime::run`]) on every device: simulated devices as threads
//! ([`crate::train_launch`]), or one rank per process under `mpirun`/`srun`/`torchrun`. It
//! then reports, per device, the predicted against the measured memory and traffic.

use crate::profile_cmd::{OutputFormat, Precision};
use crate::train_prepare::Extended;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use tessera_models::ModelConfig;
use tessera_runtime::data::{DataOptions, Dataset, MaskedLm, Objective, TokenDType, Tokenizer};
use tessera_runtime::diffusion::DiffusionObjective;
use tessera_runtime::examples::{is_jsonl, ExampleSet};
use tessera_runtime::images::ImageSet;
use tessera_runtime::mapped::MappedCheckpoint;
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
pub(crate) fn check_resume(
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
pub(crate) fn check_resumed_model(
    args: &TrainArgs,
    saved: &str,
    dir: &std::path::Path,
) -> Result<()> {
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
