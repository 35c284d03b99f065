//! `tessera eval --inputs IN.safetensors --outputs OUT.safetensors [--grads]`: any model's
//! forward (and optionally backward) on given named inputs, single-device.
//!
//! The inputs file's tensor names are the model's input names (`input_ids`, `labels`,
//! `pixel_values`, `inputs`, `sample`, `timestep`, ...). The batch is the first dimension of
//! the inputs and the sequence the second dimension of a token input (`input_ids`,
//! `labels`, `token_type_ids`) or of a diffusion model's `encoder_hidden_states`; the model is built at that batch and sequence, and every given
//! tensor must then have exactly the dtype and shape of the built graph's input
//! ([`InputError`]). The inputs the model output needs are required; the loss's own inputs
//! (those the output does not read: `labels`, `target`) are all given or all absent; the
//! bookkeeping inputs are filled when absent (`num_targets`: the labels that are not
//! ignored, as training counts them; `seed`: 0, dropout being off in eval).
//!
//! The outputs file holds `logits` (the model output, whatever the family, in the graph's
//! dtype), `loss` (an f32 scalar) when the loss's inputs were given, and with `--grads`
//! `grad.<Hugging Face weight name>` for every trainable parameter: the gradient of the loss,
//! by the same autodiff and CPU kernels training runs (`tessera_ir::gradients`, the runtime
//! executor on one device). A parameter the loss does not reach gets zeros.

use crate::eval_cmd::{parameter_values, prepare, EvalArgs, Prepared};
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde_json::json;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use tessera_ir::{gradients, DType, Graph, Program, TensorId};
use tessera_models::{build, BuildOptions, ForwardModel, InputKind, ModelConfig};
use tessera_runtime::tensor::{candle_dtype, ir_dtype, to_f64_vec};
use tessera_runtime::{CpuBackend, Executor};

/// What is wrong with an `--inputs` file, against the model built from its shapes.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// A tensor whose name is none of the model's inputs.
    #[error("--inputs: `{name}` is not an input of {model}; it takes {inputs}")]
    Unknown { name: String, model: String, inputs: String },
    /// An input the model output needs is absent.
    #[error(
        "--inputs: missing `{name}` ({expected}), which the model output needs; {model} takes \
         {inputs}"
    )]
    Missing { name: String, expected: String, model: String, inputs: String },
    /// A given tensor of another dtype or shape than the built graph's input.
    #[error(
        "--inputs: `{name}` is {got}, but {model} takes {expected} (batch {batch}, sequence \
         {seq}, from the inputs' shapes)"
    )]
    Mismatch {
        name: String,
        got: String,
        expected: String,
        model: String,
        batch: usize,
        seq: usize,
    },
    /// A token id or class label outside the model's range.
    #[error("--inputs: `{name}` holds {value} at flat index {index}, outside 0..{limit}{ignored}")]
    OutOfRange { name: String, value: i64, index: usize, limit: usize, ignored: String },
    /// Some of the loss's inputs given, others not.
    #[error(
        "--inputs: the loss needs {missing} too (given: {given}); give all of the loss's \
         inputs, or none of them for the model output alone"
    )]
    PartialLoss { given: String, missing: String },
    /// `--grads` without the loss's inputs.
    #[error("--grads: the gradients are of the loss, which needs {missing} in --inputs")]
    GradsNeedLoss { missing: String },
    /// A file without tensors.
    #[error("--inputs {path}: holds no tensor; {model} takes {inputs}")]
    Empty { path: String, model: String, inputs: String },
}

/// What `eval --inputs` wrote: each output's name, shape and dtype, and the loss.
pub(crate) struct Written {
    outputs: Vec<(String, Vec<usize>, String)>,
    loss: Option<f64>,
    grads: usize,
}

impl Written {
    pub(crate) fn doc(&self) -> serde_json::Value {
        let outputs: BTreeMap<&str, serde_json::Value> = self
            .outputs
            .iter()
            .map(|(n, dims, dtype)| (n.as_str(), json!({"shape": dims, "dtype": dtype})))
            .collect();
        json!({"loss": self.loss, "outputs": outputs})
    }

    pub(crate) fn table(&self, cfg: &ModelConfig, path: &Path) -> String {
        let (_, dims, dtype) = &self.outputs[0];
        let loss = self.loss.map_or(String::new(), |l| format!(", loss {l:.6}"));
        let grads = match self.grads {
            0 => String::new(),
            n => format!(", {n} parameter gradients"),
        };
        format!(
            "{}: logits {dtype} {dims:?}{loss}{grads} written to {}\n",
            cfg.name(),
            path.display()
        )
    }
}

/// `dtype [d0, d1, ...]` of a graph tensor.
fn describe(graph: &Graph, t: TensorId) -> String {
    format!("{} {:?}", graph.meta(t).dtype, graph.shape(t).dims())
}

/// The dtype of a given tensor, as the IR names it (`f32`, `i64`, ...).
fn dtype_name(t: &Tensor) -> String {
    ir_dtype(t.dtype()).map_or_else(|| format!("{:?}", t.dtype()).to_lowercase(), |d| d.to_string())
}

/// `dtype [d0, d1, ...]` of a given tensor.
fn describe_value(t: &Tensor) -> String {
    format!("{} {:?}", dtype_name(t), t.dims())
}

/// The model's inputs as `name (dtype [dims])`, comma-separated.
fn listing(model: &ForwardModel) -> String {
    let graph = &model.builder.graph;
    let named =
        model.inputs.iter().map(|i| format!("`{}` ({})", i.name, describe(graph, i.tensor)));
    named.collect::<Vec<_>>().join(", ")
}

fn read_inputs(path: &Path) -> Result<HashMap<String, Tensor>> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .with_context(|| format!("--inputs {}: not a readable safetensors file", path.display()))
}

/// The part `--component` names of a model with several (an AutoencoderKL's).
fn component(cfg: &ModelConfig, part: Option<&str>) -> Result<ModelConfig> {
    use tessera_models::VaePart;
    match (cfg, part) {
        (ModelConfig::Vae(c), Some(name)) => match VaePart::parse(name) {
            Some(p) => Ok(ModelConfig::Vae(c.with_part(p))),
            None => bail!("--component {name}: an AutoencoderKL's parts are {}", VaePart::NAMES),
        },
        (_, Some(name)) => bail!(
            "--component {name}: {} is one model; --component picks an AutoencoderKL's part ({})",
            cfg.name(),
            VaePart::NAMES
        ),
        (_, None) => Ok(cfg.clone()),
    }
}

/// The image side a diffusion model is built at (its config's `sample_size`).
fn image_side(cfg: &ModelConfig) -> Option<usize> {
    match cfg {
        ModelConfig::UNet(c) => Some(c.sample_size),
        ModelConfig::Vae(c) => Some(c.sample_size),
        _ => None,
    }
}

/// The model to build and the batch (first dimension of the given inputs) and sequence
/// (second dimension of a given token input) to build it at, read against a probe build of
/// the model at batch 1, sequence 1. A diffusion model is resized to square images given at
/// another side than its config's (`sample`, `z`: the side scales with the input's).
fn shape_from_inputs(
    cfg: &ModelConfig,
    given: &HashMap<String, Tensor>,
) -> Result<(ModelConfig, usize, usize)> {
    let probe = build(cfg, &BuildOptions::new(1, 1, DType::F32))?;
    let graph = &probe.builder.graph;
    let (mut batch, mut seq, mut sized) = (None, None, None);
    for input in &probe.inputs {
        let Some(t) = given.get(input.name) else { continue };
        let rank = graph.shape(input.tensor).rank();
        if rank == 0 || t.rank() != rank {
            continue; // a scalar, or a mismatch reported against the built graph
        }
        batch.get_or_insert(t.dims()[0]);
        let (want, got) = (graph.shape(input.tensor).dims(), t.dims());
        if let (InputKind::Pixels, Some(side), 4) = (&input.kind, image_side(cfg), rank) {
            if sized.is_none() && got[2] == got[3] && got[2..] != want[2..] && want[2] > 0 {
                let new_side = side * got[2] / want[2];
                if new_side * want[2] == side * got[2] {
                    let what = format!("`{}` {:?}", input.name, got);
                    sized = Some(cfg.with_image_size(new_side).with_context(|| {
                        format!("--inputs: {} asks for {new_side}-pixel images", what)
                    })?);
                }
            }
        }
        // A diffusion model's sequence is its conditioning's tokens (`encoder_hidden_states`).
        let token = matches!(
            input.kind,
            InputKind::TokenIds { .. }
                | InputKind::TokenTypeIds { .. }
                | InputKind::Labels { .. }
                | InputKind::Condition
        );
        if token && rank >= 2 {
            seq.get_or_insert(t.dims()[1]);
        }
    }
    Ok((sized.unwrap_or_else(|| cfg.clone()), batch.unwrap_or(1), seq.unwrap_or(1)))
}

/// Inputs that the model output reads (through any chain of nodes).
fn read_by(graph: &Graph, output: TensorId) -> HashSet<TensorId> {
    let mut seen = HashSet::from([output]);
    let mut stack = vec![output];
    while let Some(t) = stack.pop() {
        for &i in &graph.producer(t).inputs {
            if seen.insert(i) {
                stack.push(i);
            }
        }
    }
    seen
}

/// Token ids, segment ids and class labels within the model's range (labels may also be the
/// ignored value).
fn check_range(input: &tessera_models::ModelInput, t: &Tensor) -> Result<()> {
    let (limit, ignore) = match input.kind {
        InputKind::TokenIds { vocab_size } => (vocab_size, None),
        InputKind::TokenTypeIds { type_vocab_size } => (type_vocab_size, None),
        InputKind::Labels { num_classes, ignore_index } => (num_classes, ignore_index),
        _ => return Ok(()),
    };
    let values = t.flatten_all()?.to_vec1::<i64>()?;
    let bad = values
        .iter()
        .enumerate()
        .find(|&(_, &v)| Some(v) != ignore && (v < 0 || v as usize >= limit));
    match bad {
        Some((index, &value)) => Err(InputError::OutOfRange {
            name: input.name.into(),
            value,
            index,
            limit,
            ignored: ignore.map_or(String::new(), |i| format!(" (or {i}, ignored)")),
        }
        .into()),
        None => Ok(()),
    }
}

/// The value each model input is bound to, and whether the loss's inputs were given.
struct Feed {
    values: Vec<(TensorId, Tensor)>,
    has_loss: bool,
    /// The loss's inputs (for messages).
    loss_inputs: Vec<&'static str>,
}

/// Checks the given tensors against `model`'s inputs (names, dtypes, shapes) and fills the
/// bookkeeping inputs and, without the loss's inputs, placeholders for them.
fn feed(
    model: &ForwardModel,
    cfg: &ModelConfig,
    mut given: HashMap<String, Tensor>,
    (batch, seq): (usize, usize),
) -> Result<Feed> {
    let graph = &model.builder.graph;
    let name = cfg.name().to_string();
    let mut names: Vec<&String> = given.keys().collect();
    names.sort();
    if let Some(unknown) = names.iter().find(|n| model.input(n).is_none()) {
        let model_inputs = listing(model);
        return Err(InputError::Unknown {
            name: unknown.to_string(),
            model: name,
            inputs: model_inputs,
        }
        .into());
    }
    for input in &model.inputs {
        let Some(t) = given.get(input.name) else { continue };
        let meta = graph.meta(input.tensor);
        if ir_dtype(t.dtype()) != Some(meta.dtype) || t.dims() != graph.shape(input.tensor).dims() {
            return Err(InputError::Mismatch {
                name: input.name.into(),
                got: describe_value(t),
                expected: describe(graph, input.tensor),
                model: name,
                batch,
                seq,
            }
            .into());
        }
    }
    for input in &model.inputs {
        if let Some(t) = given.get(input.name) {
            check_range(input, t)?;
        }
    }
    let needed = read_by(graph, model.logits);
    let filled = |k: &InputKind| matches!(k, InputKind::Seed | InputKind::TargetCount);
    let mut loss_inputs = Vec::new();
    for input in model.inputs.iter().filter(|i| !filled(&i.kind)) {
        if !needed.contains(&input.tensor) {
            loss_inputs.push(input.name);
        } else if !given.contains_key(input.name) {
            return Err(InputError::Missing {
                name: input.name.into(),
                expected: describe(graph, input.tensor),
                model: name,
                inputs: listing(model),
            }
            .into());
        }
    }
    let (present, absent): (Vec<&str>, Vec<&str>) =
        loss_inputs.iter().partition(|n| given.contains_key(**n));
    if !present.is_empty() && !absent.is_empty() {
        let quote =
            |ns: &[&str]| ns.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
        return Err(
            InputError::PartialLoss { given: quote(&present), missing: quote(&absent) }.into()
        );
    }
    let has_loss = absent.is_empty();
    // The labels that count, as training counts them (at least 1).
    let counted =
        match model.labels().and_then(|(t, _)| model.inputs.iter().find(|i| i.tensor == t)) {
            Some(labels) if has_loss => {
                let labels = given[labels.name].flatten_all()?.to_vec1::<i64>()?;
                labels.iter().filter(|&&l| l >= 0).count().max(1)
            }
            _ => 1,
        };
    let mut values = Vec::new();
    for input in &model.inputs {
        let meta = graph.meta(input.tensor);
        let value = match (given.remove(input.name), &input.kind) {
            (Some(t), _) => t,
            (None, InputKind::TargetCount) => {
                Tensor::new(counted as f32, &Device::Cpu)?.to_dtype(candle_dtype(meta.dtype))?
            }
            // Placeholders: the seed of a dropout that is off, and the loss's inputs when the
            // loss is not wanted (zeros: valid labels and targets).
            (None, _) => Tensor::zeros(
                graph.shape(input.tensor).dims(),
                candle_dtype(meta.dtype),
                &Device::Cpu,
            )?,
        };
        values.push((input.tensor, value.contiguous()?));
    }
    Ok(Feed { values, has_loss, loss_inputs })
}

/// Runs `eval --inputs IN --outputs OUT` (and `--grads`) on `cfg` with `--model-dir`'s weights.
pub(crate) fn run(
    args: &EvalArgs,
    cfg: &ModelConfig,
    inputs: &Path,
    out: &Path,
) -> Result<Written> {
    let cfg = &component(cfg, args.component.as_deref())?;
    let given = read_inputs(inputs)?;
    if given.is_empty() {
        let probe = build(cfg, &BuildOptions::new(1, 1, DType::F32))?;
        let path = inputs.display().to_string();
        return Err(
            InputError::Empty { path, model: cfg.name().into(), inputs: listing(&probe) }.into()
        );
    }
    let (sized, batch, seq) = shape_from_inputs(cfg, &given)?;
    let cfg = &sized;
    let Prepared { mut model, weights } = prepare(args, cfg, batch, seq).with_context(|| {
        format!("building {} at batch {batch}, sequence {seq} (from --inputs' shapes)", cfg.name())
    })?;
    let fed = feed(&model, cfg, given, (batch, seq))?;
    if args.grads && !fed.has_loss {
        let missing = fed.loss_inputs.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>();
        return Err(InputError::GradsNeedLoss { missing: missing.join(", ") }.into());
    }

    let trainable = model.builder.graph.trainable_parameters();
    let grads = match args.grads {
        true => gradients(&mut model.builder, model.loss, &trainable)?,
        false => Vec::new(),
    };
    let (logits, loss) = (model.logits, model.loss);
    let graph = model.builder.finish();
    let params = parameter_values(&graph, &weights)?;
    let named_grads: Vec<(String, TensorId, Option<TensorId>)> = trainable
        .iter()
        .zip(&grads)
        .map(|(&p, &g)| (format!("grad.{}", graph.tensor_scope(p)), p, g))
        .collect();
    let grad_ids: Vec<TensorId> = grads.iter().flatten().copied().collect();
    let mut kept = vec![logits];
    kept.extend(fed.has_loss.then_some(loss));
    kept.extend(&grad_ids);
    let shapes: HashMap<TensorId, (Vec<usize>, DType)> = trainable
        .iter()
        .map(|&p| (p, (graph.shape(p).dims().to_vec(), graph.meta(p).dtype)))
        .collect();
    let program = Program::lower_graph(graph, kept, &grad_ids);
    let mut exec = Executor::new(program, CpuBackend::new(0), None);
    for (t, value) in params.into_iter().chain(fed.values) {
        exec.bind(t, value)?;
    }
    exec.run()?;

    let kept_value = |t: TensorId| exec.get(t).cloned().context("an output was not kept");
    let mut tensors: Vec<(String, Tensor)> = vec![("logits".into(), kept_value(logits)?)];
    let loss_value = match fed.has_loss {
        true => {
            let l = kept_value(loss)?;
            let value = to_f64_vec(&l)?[0];
            tensors.push(("loss".into(), l));
            Some(value)
        }
        false => None,
    };
    for (name, p, g) in &named_grads {
        let value = match g {
            Some(g) => kept_value(*g)?,
            None => {
                let (dims, dtype) = &shapes[p];
                Tensor::zeros(dims.as_slice(), candle_dtype(*dtype), &Device::Cpu)?
            }
        };
        tensors.push((name.clone(), value));
    }
    let bytes = safetensors::tensor::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), None)
        .context("serializing the outputs")?;
    crate::output::write_output(out, &bytes)?;
    let outputs =
        tensors.iter().map(|(n, t)| (n.clone(), t.dims().to_vec(), dtype_name(t))).collect();
    Ok(Written { outputs, loss: loss_value, grads: named_grads.len() })
}
