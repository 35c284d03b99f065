//! `tessera eval`: a checkpoint (a directory with `config.json` and safetensors weights with
//! Hugging Face names) on data, single-device: a language model's mean next-token
//! cross-entropy and top-1 accuracy over given token ids, with the per-position logits on
//! request (the parity check against `transformers`); a ViT's cross-entropy and top-1
//! accuracy over the held-out images of a data set (the split `train` holds out).

use crate::profile_cmd::{print_stdout, OutputFormat};
use crate::train_cmd::DEFAULT_IMAGES;
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use tessera_ir::{DType, Graph, Program, TensorId};
use tessera_models::{build, BuildOptions, ForwardModel, ModelConfig};
use tessera_runtime::collective::DeviceMesh;
use tessera_runtime::hf_weights::open_weights;
use tessera_runtime::images::ImageSet;
use tessera_runtime::mapped::ShardSource;
use tessera_runtime::tensor::{candle_dtype, from_vec, to_f64_vec};
use tessera_runtime::trainer::top1_hits;
use tessera_runtime::{CpuBackend, Executor};

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Directory with config.json and model.safetensors (or a sharded index), or a sharded
    /// checkpoint `train` saved on several devices.
    #[arg(long)]
    pub model_dir: PathBuf,
    /// Language models: comma-separated token ids; the loss predicts ids[1..] from ids[..n-1].
    #[arg(long)]
    pub tokens: Option<String>,
    /// ViT: a CSV of images (pixels, then the class), evaluated on its held-out split (the
    /// last 20%, as `train` holds out). Default: data/digits.csv.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Write the per-position logits ([n-1, vocab], JSON) to this file.
    #[arg(long)]
    pub logits: Option<PathBuf>,
    /// Language models: evaluate with a PEFT LoRA adapter (a directory with
    /// adapter_config.json and adapter_model.safetensors) on the model.
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// Language models: evaluate with the linear layers' weights quantised as `generate
    /// --quantize` runs them (int8 or int4).
    #[arg(long, value_parser = crate::generate_cmd::parse_quantize)]
    pub quantize: Option<tessera_models::Quantize>,
    /// Any model: a safetensors file of the model's named inputs (`input_ids`, `labels`,
    /// `pixel_values`, `sample`, `timestep`, ...), each of the dtype and shape the model
    /// takes; batch and sequence come from their shapes. The loss's inputs (`labels`,
    /// `target`) are optional: without them no `loss` is written.
    #[arg(long, value_name = "IN.safetensors", requires = "outputs",
          conflicts_with_all = ["tokens", "data", "logits", "quantize"])]
    pub inputs: Option<PathBuf>,
    /// With --inputs: write the model's named outputs here (safetensors): `logits` (the model
    /// output, whatever the family) and `loss` (an f32 scalar) when the loss's inputs are
    /// given.
    #[arg(long, value_name = "OUT.safetensors", requires = "inputs")]
    pub outputs: Option<PathBuf>,
    /// With --inputs: the part of a model that has several — an AutoencoderKL's `encoder`
    /// (`sample` → latent mean), `decoder` (`z` → image) or `autoencoder` (`sample` →
    /// reconstruction; the default).
    #[arg(long, value_name = "PART", requires = "inputs")]
    pub component: Option<String>,
    /// With --outputs: also write each trainable parameter's gradient of the loss, as
    /// `grad.<Hugging Face weight name>` (needs the loss's inputs).
    #[arg(long, requires = "outputs")]
    pub grads: bool,
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
}

fn parse_tokens(s: &str) -> Result<Vec<i64>> {
    let ids = crate::limits::token_ids(s)?;
    if ids.len() < 2 {
        bail!("--tokens needs at least two ids (the loss predicts each id from those before it)");
    }
    Ok(ids)
}

/// What `eval` prints: the JSON document and the table line.
pub(crate) struct Scored {
    doc: serde_json::Value,
    table: String,
}

pub fn run(args: &EvalArgs) -> Result<()> {
    let scored = score(args)?;
    match args.format {
        OutputFormat::Json => print_stdout(&format!("{}\n", scored.doc)),
        OutputFormat::Table => print_stdout(&scored.table),
    }
}

/// What `eval --format json` prints, as a value (the `--logits` file written).
pub fn report(args: &EvalArgs) -> Result<serde_json::Value> {
    Ok(score(args)?.doc)
}

fn score(args: &EvalArgs) -> Result<Scored> {
    let cfg = if args.model_dir.extension().is_some_and(|e| e.eq_ignore_ascii_case("onnx")) {
        ModelConfig::resolve(&args.model_dir.display().to_string())?
    } else {
        crate::checkpoint_cmd::check_before_load(&args.model_dir, "--model-dir")?;
        ModelConfig::from_path(&args.model_dir)?.without_dropout()
    };
    if let (Some(inputs), Some(outputs)) = (&args.inputs, &args.outputs) {
        let written = crate::eval_io::run(args, &cfg, inputs, outputs)?;
        return Ok(Scored { doc: written.doc(), table: written.table(&cfg, outputs) });
    }
    if args.adapter.is_some() && (args.quantize.is_some() || args.tokens.is_none()) {
        bail!(
            "--adapter evaluates a language model's LoRA adapter on --tokens, unquantised (drop \
             --quantize)"
        );
    }
    match (&cfg, &args.tokens) {
        (ModelConfig::Vit(_), _) => eval_images(args, &cfg),
        (ModelConfig::Bert(_), _) => bail!(
            "eval computes the next-token loss of causal language models (gpt2, llama, mistral, \
             qwen2) and the accuracy of image classifiers (vit); a masked LM's held-out loss is \
             in `tessera train`'s report (eval_loss)"
        ),
        (ModelConfig::Mlp(_), _) => bail!(
            "eval has no data loader for the mlp model: give its named inputs with --inputs \
             IN.safetensors --outputs OUT.safetensors"
        ),
        (ModelConfig::ClipText(_) | ModelConfig::Vae(_) | ModelConfig::UNet(_), _) => bail!(
            "{} has no next-token loss or accuracy: run it on named inputs with --inputs \
             IN.safetensors --outputs OUT.safetensors",
            cfg.name()
        ),
        (_, None) => bail!("--tokens is required for a language model: comma-separated ids"),
        (_, Some(tokens)) => eval_tokens(args, &cfg, &parse_tokens(tokens)?),
    }
}

/// A model built for eval at a batch and sequence (with `--adapter`'s LoRA applied), and the
/// source of its weights (the adapter's first, then the checkpoint's).
pub(crate) struct Prepared {
    pub model: ForwardModel,
    pub weights: crate::finetune::Layered,
}

/// Builds `cfg` at `batch` x `seq` (f32) and opens `--model-dir`'s weights for it.
pub(crate) fn prepare(
    args: &EvalArgs,
    cfg: &ModelConfig,
    batch: usize,
    seq: usize,
) -> Result<Prepared> {
    let opts = BuildOptions { batch, seq, dtype: DType::F32 };
    let model = build(cfg, &opts)?;
    // The checkpoint holds the whole model: a VAE's part is checked against both parts.
    let base = match cfg {
        ModelConfig::Vae(c) if c.part != tessera_models::VaePart::Autoencoder => {
            let whole = ModelConfig::Vae(c.with_part(tessera_models::VaePart::Autoencoder));
            build(&whole, &opts)?.builder.graph
        }
        _ => model.builder.graph.clone(),
    };
    let (model, adapter) = match &args.adapter {
        Some(dir) => {
            let a = crate::finetune::read_adapter(dir)?;
            let spec = tessera_models::lora::LoraSpec { dropout: 0.0, ..a.spec.clone() };
            (tessera_models::lora::apply_lora(model, &spec)?.0, a.tensors)
        }
        None => (model, Default::default()),
    };
    let weights =
        crate::finetune::Layered { first: adapter, rest: open_weights(&args.model_dir, &base)? };
    Ok(Prepared { model, weights })
}

/// Every parameter of `graph` (whole, on one device) read from `weights`, in its dtype.
pub(crate) fn parameter_values(
    graph: &Graph,
    weights: &dyn ShardSource,
) -> Result<Vec<(TensorId, Tensor)>> {
    let whole = |t: TensorId| vec![Vec::new(); graph.shape(t).rank()];
    let mut values = Vec::new();
    for p in graph.parameters() {
        let name = graph.tensor_scope(p);
        let dtype = candle_dtype(graph.meta(p).dtype);
        let v = weights.shard_of(name, &whole(p), &DeviceMesh::single(), dtype)?;
        values.push((p, v.with_context(|| format!("no value for parameter {name}"))?));
    }
    Ok(values)
}

/// A forward graph with its checkpoint weights bound, ready for its inputs.
struct Loaded {
    exec: Executor<CpuBackend>,
    loss: TensorId,
    logits: TensorId,
    inputs: Vec<(&'static str, TensorId)>,
}

impl Loaded {
    fn new(args: &EvalArgs, cfg: &ModelConfig, batch: usize, seq: usize) -> Result<Loaded> {
        let Prepared { model, weights } = prepare(args, cfg, batch, seq)?;
        let (loss, logits) = (model.loss, model.logits);
        let inputs = model.inputs.iter().map(|i| (i.name, i.tensor)).collect();
        let graph = model.builder.finish();
        let values = parameter_values(&graph, &weights)?;
        let program = Program::lower_graph(graph, vec![loss, logits], &[]);
        let mut exec = Executor::new(program, CpuBackend::new(0), None);
        for (t, value) in values {
            exec.bind(t, value)?;
        }
        Ok(Loaded { exec, loss, logits, inputs })
    }

    /// Binds the named inputs (the target count from `labels`), runs, and returns the loss
    /// and `(correct, counted)` top-1 hits.
    fn run(&mut self, values: &[(&str, Tensor)], labels: &[i64]) -> Result<(f64, (usize, usize))> {
        for (name, t) in self.inputs.clone() {
            let value = match (name, values.iter().find(|(n, _)| *n == name)) {
                (_, Some((_, v))) => v.clone(),
                ("num_targets", None) => {
                    let n = labels.iter().filter(|&&l| l >= 0).count().max(1);
                    Tensor::new(n as f32, &candle_core::Device::Cpu)?
                }
                (other, None) => bail!("the model takes input `{other}`, which eval cannot fill"),
            };
            self.exec.bind(t, value)?;
        }
        self.exec.run()?;
        let loss = to_f64_vec(self.exec.get(self.loss).context("loss was not kept")?)?[0];
        let logits = self.exec.get(self.logits).context("logits were not kept")?;
        Ok((loss, top1_hits(logits, labels)?))
    }
}

fn eval_tokens(args: &EvalArgs, cfg: &ModelConfig, ids: &[i64]) -> Result<Scored> {
    let vocab = cfg.vocab_size().context("eval needs a language model (one with a vocabulary)")?;
    if let Some((pos, id)) = ids.iter().enumerate().find(|(_, &id)| id < 0 || id as usize >= vocab)
    {
        bail!("token id {id} at position {pos} is outside the model's vocabulary of {vocab}");
    }
    let n = ids.len() - 1;
    let (loss_value, accuracy, flat) = match args.quantize {
        Some(q) => quantized_scores(args, cfg, ids, q)?,
        None => {
            let mut m = Loaded::new(args, cfg, 1, n)?;
            let x = from_vec(ids[..n].to_vec(), &[1, n])?;
            let y = from_vec(ids[1..].to_vec(), &[1, n])?;
            let (loss, (hits, _)) = m.run(&[("input_ids", x), ("labels", y)], &ids[1..])?;
            let flat = to_f64_vec(m.exec.get(m.logits).context("logits were not kept")?)?;
            (loss, hits as f64 / n as f64, flat)
        }
    };

    if let Some(path) = &args.logits {
        let rows: Vec<&[f64]> = flat.chunks(vocab).collect();
        let doc = json!({"shape": [n, vocab], "tokens": ids, "logits": rows});
        crate::output::write_output(path, serde_json::to_string(&doc)?.as_bytes())?;
    }
    Ok(Scored {
        doc: json!({"loss": loss_value, "accuracy": accuracy}),
        table: format!(
            "{}: mean next-token cross-entropy {loss_value:.6}, top-1 accuracy {:.2}% over {n} \
             predictions\n",
            cfg.name(),
            100.0 * accuracy
        ),
    })
}

/// Loss, top-1 accuracy and logits `[n, V]` of `ids` with quantised linear layers: the
/// generation graph over the whole sequence (every position's logits), its weights
/// quantised as they are loaded, the loss taken here in f64.
fn quantized_scores(
    args: &EvalArgs,
    cfg: &ModelConfig,
    ids: &[i64],
    q: tessera_models::Quantize,
) -> Result<(f64, f64, Vec<f64>)> {
    use tessera_runtime::generate::{resident_values, StepProgram};
    let n = ids.len() - 1;
    let opts = tessera_models::GenerateOptions {
        batch: 1,
        seq: n,
        capacity: n,
        dtype: DType::F32,
        quantize: Some(q),
        all_logits: true,
    };
    let m = tessera_models::build_generation(cfg, &opts)?;
    let quantized = crate::generate_cmd::quantized_leaves(&m);
    let (logits, inputs) = (m.logits, m.inputs.clone());
    let program = Program::lower_graph(m.builder.finish(), vec![logits], &[]);
    let reference = build(cfg, &BuildOptions { batch: 1, seq: 1, dtype: DType::F32 })?;
    let weights = open_weights(&args.model_dir, &reference.builder.finish())?;
    let step = StepProgram { program: program.clone(), layout: Default::default(), logits };
    let values = resident_values(&step, &DeviceMesh::single(), weights.as_ref(), &quantized)?;
    let mut exec = Executor::new(program, CpuBackend::new(0), None);
    for (t, v) in values {
        exec.bind(t, v)?;
    }
    for input in &inputs {
        let value = match input.name {
            "input_ids" => from_vec(ids[..n].to_vec(), &[1, n])?,
            "cache_start" => from_vec(vec![0i64], &[1])?,
            "position_ids" => from_vec((0..n as i64).collect(), &[1, n])?,
            other => bail!("the quantised model takes input `{other}`, which eval cannot fill"),
        };
        exec.bind(input.tensor, value)?;
    }
    exec.run()?;
    let flat = to_f64_vec(exec.get(logits).context("logits were not kept")?)?;
    let vocab = flat.len() / n.max(1);
    let (mut loss, mut hits) = (0.0, 0usize);
    for (row, &target) in flat.chunks(vocab).zip(&ids[1..]) {
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
        loss += lse - row[target as usize];
        let best = row.iter().enumerate().fold(0, |b, (i, &x)| if x > row[b] { i } else { b });
        hits += usize::from(best == target as usize);
    }
    Ok((loss / n as f64, hits as f64 / n as f64, flat))
}

fn eval_images(args: &EvalArgs, cfg: &ModelConfig) -> Result<Scored> {
    let ModelConfig::Vit(c) = cfg else { bail!("not an image classifier") };
    let path = args.data.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_IMAGES));
    let shape = [c.num_channels, c.image_size[0], c.image_size[1]];
    let images = ImageSet::load_csv(&path, shape, 0.2)?;
    images.validate(c.num_labels)?;
    let n = images.val_labels.len();
    let mut m = Loaded::new(args, cfg, n, 1)?;
    let x = from_vec(images.val.clone(), &[n, shape[0], shape[1], shape[2]])?;
    let y = from_vec(images.val_labels.clone(), &[n])?;
    let (loss, (hits, _)) = m.run(&[("pixel_values", x), ("labels", y)], &images.val_labels)?;
    let accuracy = hits as f64 / n as f64;
    Ok(Scored {
        doc: json!({"loss": loss, "accuracy": accuracy, "examples": n}),
        table: format!(
            "{}: cross-entropy {loss:.6}, top-1 accuracy {:.2}% over the {n} held-out images of \
             {}\n",
            cfg.name(),
            100.0 * accuracy,
            path.display()
        ),
    })
}
