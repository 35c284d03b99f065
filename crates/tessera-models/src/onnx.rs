//! Models imported from ONNX files (`--model model.onnx`): the importer (`tessera-onnx`)
//! builds the forward graph, this module adds the task's inputs and loss the way the
//! hand-written families do, so profile, plan, train and eval treat it like a built-in one.
//!
//! Tasks, read off the graph's first input and output:
//! - causal language model: int64 `[batch, seq]` → `[batch, seq, vocab]`, trained on
//!   next-token `labels` like GPT-2 (mean over the step's targets);
//! - image classifier: float `[batch, C, H, W]` → `[batch, classes]`, cross-entropy on `labels`;
//! - dense regression: float `[batch, C, H, W]` → float `[batch, ..]` (a UNet), the mean squared
//!   error against `targets` of the output's shape.

use crate::error::{ModelError, Result};
use crate::nn::{self, Inputs};
use crate::{BuildOptions, ForwardModel, InputKind, ModelInput};
use serde::Serialize;
use std::path::Path;
use std::sync::Arc;
use tessera_ir::DType;
use tessera_onnx::{Bind, Dim, Elem, OnnxModel};

/// What an imported model is trained to do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "task", rename_all = "snake_case")]
pub enum OnnxTask {
    CausalLm {
        vocab_size: usize,
    },
    ImageClassifier {
        num_classes: usize,
    },
    /// Output dims after the batch (fixed).
    Regression {
        output: Vec<usize>,
    },
}

/// A model read from an ONNX file.
#[derive(Clone, Debug, Serialize)]
pub struct OnnxConfig {
    pub name: String,
    pub path: String,
    pub opset: i64,
    #[serde(flatten)]
    pub task: OnnxTask,
    pub num_parameters: u64,
    /// Layers, from the parameters' names (`h.3`, `layers.3`); 0 when none are numbered.
    pub num_blocks: usize,
    /// The largest dimension of any weight (the size guard's widest row).
    pub widest: usize,
    #[serde(skip)]
    pub model: Arc<OnnxModel>,
}

impl PartialEq for OnnxConfig {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path && self.name == other.name && self.task == other.task
    }
}

impl OnnxConfig {
    /// Reads `path` and recognises its task.
    pub fn open(path: &Path) -> Result<OnnxConfig> {
        let model = OnnxModel::open(path)?;
        model.check_operators()?;
        let unsupported = |found: String| ModelError::Unsupported {
            what: "ONNX model signature".into(),
            found,
            supported: "int64 [batch, seq] → [batch, seq, vocab] (causal language models), \
                        float [batch, C, H, W] → [batch, classes] (image classifiers) and \
                        float [batch, C, H, W] → [batch, ...] with fixed dims (dense regression)"
                .into(),
        };
        let (x, y) = (&model.inputs[0], &model.outputs[0]);
        let fixed = |d: Option<&Dim>| match d {
            Some(Dim::Fixed(n)) => Some(*n),
            _ => None,
        };
        let task = match (x.elem, x.dims.len(), y.dims.len(), fixed(y.dims.last())) {
            (Elem::Int, 2, 3, Some(v)) => OnnxTask::CausalLm { vocab_size: v },
            (Elem::Float, 4, 2, Some(c)) => OnnxTask::ImageClassifier { num_classes: c },
            (Elem::Float, 4, r, _) if r > 2 && y.elem == Elem::Float => {
                let output = y.dims[1..]
                    .iter()
                    .map(|d| fixed(Some(d)))
                    .collect::<Option<Vec<usize>>>()
                    .ok_or_else(|| {
                        unsupported(format!("{} {:?}: dynamic output dims", y.name, y.dims))
                    })?;
                OnnxTask::Regression { output }
            }
            _ => {
                return Err(unsupported(format!(
                    "{} {:?} {:?} → {} {:?}",
                    x.name, x.elem, x.dims, y.name, y.dims
                )))
            }
        };
        let weights = model.weight_shapes();
        let num_parameters = weights.iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum();
        let num_blocks = weights
            .iter()
            .filter_map(|(n, _)| tessera_onnx::block_of(n))
            .max()
            .map_or(0, |b| b as usize + 1);
        let widest = weights.iter().flat_map(|(_, s)| s.iter().copied()).max().unwrap_or(1);
        Ok(OnnxConfig {
            name: model.name(),
            path: path.display().to_string(),
            opset: model.opset,
            task,
            num_parameters,
            num_blocks,
            widest,
            model: Arc::new(model),
        })
    }

    pub fn vocab_size(&self) -> Option<usize> {
        match self.task {
            OnnxTask::CausalLm { vocab_size } => Some(vocab_size),
            OnnxTask::ImageClassifier { .. } | OnnxTask::Regression { .. } => None,
        }
    }

    /// `[C, H, W]` of an image model's input.
    pub fn image_shape(&self) -> Option<[usize; 3]> {
        match self.model.inputs[0].dims.as_slice() {
            [_, Dim::Fixed(c), Dim::Fixed(h), Dim::Fixed(w)] => Some([*c, *h, *w]),
            _ => None,
        }
    }

    /// The fixed sequence length of a model whose input has no dynamic sequence axis.
    pub fn fixed_seq(&self) -> Option<usize> {
        match (&self.task, self.model.inputs[0].dims.get(1)) {
            (OnnxTask::CausalLm { .. }, Some(Dim::Fixed(s))) => Some(*s),
            _ => None,
        }
    }
}

/// The forward graph of `cfg` with its loss.
pub(crate) fn build(cfg: &OnnxConfig, opts: &BuildOptions) -> Result<ForwardModel> {
    let bind = Bind { batch: opts.batch, seq: opts.seq, dtype: opts.dtype };
    let imported = tessera_onnx::import(&cfg.model, &bind)?;
    let mut b = imported.builder;
    let logits = imported.outputs[0];
    b.set_block(None);
    b.set_scope_path("");
    let x = &imported.inputs[0];
    let mut inputs = Inputs::new();
    let (name, kind) = match cfg.task {
        OnnxTask::CausalLm { vocab_size } => ("input_ids", InputKind::TokenIds { vocab_size }),
        OnnxTask::ImageClassifier { .. } | OnnxTask::Regression { .. } => {
            ("pixel_values", InputKind::Pixels)
        }
    };
    inputs.list.push(ModelInput { name, tensor: x.tensor, kind });
    if let Some(extra) = imported.inputs.get(1) {
        return Err(ModelError::Unsupported {
            what: "ONNX graph input".into(),
            found: extra.name.clone(),
            supported: "one data input (export without attention_mask or position_ids)".into(),
        });
    }
    // The loss in f32, like the built-in families.
    let logits_f32 =
        if b.dtype(logits) == DType::F32 { logits } else { b.cast(logits, DType::F32)? };
    let loss = match cfg.task {
        OnnxTask::CausalLm { vocab_size } => {
            let (labels, count) = inputs.counted_targets(&mut b, opts.batch, opts.seq, vocab_size);
            nn::mean_over_targets(&mut b, logits_f32, labels, count)?
        }
        OnnxTask::ImageClassifier { num_classes } => {
            let kind = InputKind::Labels { num_classes, ignore_index: None };
            let labels = inputs.add(&mut b, "labels", [opts.batch], DType::I64, kind);
            b.cross_entropy(logits_f32, labels, None)?
        }
        OnnxTask::Regression { ref output } => {
            let mut shape = vec![opts.batch];
            shape.extend(output);
            let t = inputs.add(&mut b, "targets", shape.clone(), opts.dtype, InputKind::Targets);
            let t = if opts.dtype == DType::F32 { t } else { b.cast(t, DType::F32)? };
            let d = b.sub(logits_f32, t)?;
            let sq = b.mul(d, d)?;
            let dims: Vec<usize> = (0..shape.len()).collect();
            b.reduce(tessera_ir::ReduceOp::Mean, sq, &dims, false)?
        }
    };
    Ok(ForwardModel {
        builder: b,
        loss,
        logits,
        batch: opts.batch,
        seq: opts.seq,
        inputs: inputs.list,
    })
}
