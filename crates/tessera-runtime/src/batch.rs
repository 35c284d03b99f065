//! What a training step eats: [`StepBatch`], the model's data inputs by name as global
//! tensors, and [`TrainData`], the data sets that make them — a token stream (causal or
//! masked LM), fine-tuning examples (one padded row each, prompt tokens ignored) or labelled
//! images. The trainer splits a batch into micro-batches along its first dimension and each
//! device binds its shard of each ([`crate::Trainer::step_batch`]), whatever the model family.

use crate::data::{unigram_entropy_nats, Dataset, Objective};
use crate::examples::ExampleSet;
use crate::images::ImageSet;
use crate::tensor::from_vec;
use crate::{Result, RuntimeError};
use candle_core::Tensor;

/// One step's global data: the model's inputs by name (`input_ids`, `pixel_values`,
/// `labels`, ...), each with the batch as its first dimension.
#[derive(Clone, Debug)]
pub struct StepBatch {
    fields: Vec<(String, Tensor)>,
}

impl StepBatch {
    /// A batch of named tensors that agree on their first dimension (≥ 1 row).
    pub fn new(fields: Vec<(String, Tensor)>) -> Result<StepBatch> {
        let rows = fields.first().map(|(_, t)| t.dims().first().copied().unwrap_or(0));
        for (name, t) in &fields {
            if t.dims().first().copied() != rows || rows == Some(0) {
                return Err(RuntimeError::Data(format!(
                    "batch field `{name}` is {:?}; every field needs the same number of rows \
                     (≥ 1) as its first dimension ({rows:?})",
                    t.dims()
                )));
            }
        }
        Ok(StepBatch { fields })
    }

    /// Token rows: `input_ids` and `labels`, both `[batch, seq]` row-major.
    pub fn tokens(inputs: Vec<i64>, labels: Vec<i64>, batch: usize, seq: usize) -> Result<Self> {
        if inputs.len() != batch * seq || labels.len() != batch * seq {
            return Err(RuntimeError::Data(format!(
                "batch has {} inputs and {} labels; [{batch}, {seq}] needs {}",
                inputs.len(),
                labels.len(),
                batch * seq
            )));
        }
        StepBatch::new(vec![
            ("input_ids".into(), from_vec(inputs, &[batch, seq])?),
            ("labels".into(), from_vec(labels, &[batch, seq])?),
        ])
    }

    /// Images `pixel_values [batch, c, h, w]` and their class `labels [batch]`.
    pub fn images(pixels: Vec<f32>, dims: [usize; 4], labels: Vec<i64>) -> Result<StepBatch> {
        StepBatch::new(vec![
            ("pixel_values".into(), from_vec(pixels, &dims)?),
            ("labels".into(), from_vec(labels, &[dims[0]])?),
        ])
    }

    /// A denoising batch: noisy `pixel_values [batch, c, h, w]` and the clean `targets`.
    pub fn denoise(noisy: Vec<f32>, clean: Vec<f32>, dims: [usize; 4]) -> Result<StepBatch> {
        StepBatch::new(vec![
            ("pixel_values".into(), from_vec(noisy, &dims)?),
            ("targets".into(), from_vec(clean, &dims)?),
        ])
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.fields.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// The field names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.fields.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Rows (the first dimension every field shares).
    pub fn rows(&self) -> usize {
        self.fields.first().map_or(0, |(_, t)| t.dims()[0])
    }

    /// The labels, flattened (empty without a `labels` field).
    pub fn labels(&self) -> Result<Vec<i64>> {
        match self.get("labels") {
            Some(t) => Ok(t.flatten_all()?.to_dtype(candle_core::DType::I64)?.to_vec1::<i64>()?),
            None => Ok(Vec::new()),
        }
    }

    /// How many labels count: those below 0 (HF's −100) are ignored. At least 1, so a batch
    /// without targets has loss 0 rather than 0/0.
    pub fn num_targets(&self) -> Result<f32> {
        Ok(self.labels()?.iter().filter(|&&t| t >= 0).count().max(1) as f32)
    }
}

/// Where a run's batches come from.
#[derive(Clone, Debug)]
pub enum TrainData {
    /// A token stream, cut into random windows: the next token (causal LMs) or masked
    /// positions (BERT).
    Stream { data: Dataset, objective: Objective },
    /// Fine-tuning examples (JSONL), one padded row each; the loss counts the completion.
    Examples(ExampleSet),
    /// Labelled images for classification (ViT).
    Images(ImageSet),
    /// Images for a dense model (an imported UNet): noisy images in, clean images as the
    /// targets, Gaussian noise of standard deviation `noise`.
    Denoise { images: ImageSet, noise: f32 },
    /// Labelled images for a class-conditional diffusion model (DiT): noised images, timesteps,
    /// (sometimes dropped) classes and the noise or velocity as the target.
    Diffusion { images: ImageSet, objective: crate::diffusion::DiffusionObjective },
    /// Captioned pictures for a text-conditioned latent diffusion model (Stable Diffusion's
    /// UNet), encoded by its frozen VAE and text encoder before training.
    TextDiffusion {
        data: crate::diffusion_text::TextLatents,
        objective: crate::diffusion::DiffusionObjective,
    },
}

impl TrainData {
    /// The global batch of training step `step` (the same on every device of every plan).
    pub fn train_batch(&self, seed: u64, step: u64, batch: usize, seq: usize) -> Result<StepBatch> {
        match self {
            TrainData::Stream { data, objective } => {
                let (x, y) = objective.train_batch(data, seed, step, batch, seq)?;
                StepBatch::tokens(x, y, batch, seq)
            }
            TrainData::Examples(e) => e.train_batch(seed, step, batch, seq),
            TrainData::Images(i) => i.train_batch(seed, step, batch),
            TrainData::Denoise { images, noise } => {
                images.train_denoise_batch(seed, step, batch, *noise)
            }
            TrainData::Diffusion { images, objective } => {
                objective.train_batch(images, seed, step, batch)
            }
            TrainData::TextDiffusion { data, objective } => {
                data.train_batch(objective, seed, step, batch)
            }
        }
    }

    /// Up to `max_batches` held-out batches, the same on every call.
    pub fn val_batches(
        &self,
        seed: u64,
        batch: usize,
        seq: usize,
        max_batches: usize,
    ) -> Result<Vec<StepBatch>> {
        match self {
            TrainData::Stream { data, objective } => objective
                .val_batches(data, seed, batch, seq, max_batches)?
                .into_iter()
                .map(|(x, y)| StepBatch::tokens(x, y, batch, seq))
                .collect(),
            TrainData::Examples(e) => e.val_batches(batch, seq, max_batches),
            TrainData::Images(i) => i.val_batches(batch, max_batches),
            TrainData::Denoise { images, noise } => {
                images.val_denoise_batches(seed, batch, max_batches, *noise)
            }
            TrainData::Diffusion { images, objective } => {
                objective.val_batches(images, seed, batch, max_batches)
            }
            TrainData::TextDiffusion { data, objective } => {
                data.val_batches(objective, seed, batch, max_batches)
            }
        }
    }

    /// The loss of the best context-free guess, in nats, and what it is: the entropy of the
    /// train split's tokens (or, for examples, of their counted targets), or of its classes.
    /// A model that learnt anything ends below it.
    pub fn baseline(&self) -> (&'static str, f64) {
        match self {
            TrainData::Stream { data, .. } => {
                ("unigram entropy", unigram_entropy_nats(&data.train, data.vocab_size))
            }
            TrainData::Examples(e) => {
                let targets: Vec<u32> = e
                    .train
                    .iter()
                    .flat_map(|x| x.tokens.iter().skip(x.first_target).copied())
                    .collect();
                ("unigram entropy of the targets", unigram_entropy_nats(&targets, 0))
            }
            TrainData::Images(i) => {
                let labels: Vec<u32> = i.train_labels.iter().map(|&l| l as u32).collect();
                ("class entropy", unigram_entropy_nats(&labels, i.num_classes))
            }
            TrainData::Denoise { images, .. } => ("mean-image error", images.pixel_variance()),
            // Predicting zero noise scores E[ε²] = 1 (ε-prediction; about 1 for v too).
            TrainData::Diffusion { .. } | TrainData::TextDiffusion { .. } => {
                ("zero prediction", 1.0)
            }
        }
    }

    /// A fingerprint of the training data (FNV-1a over its split's ids, pixels, labels and
    /// targets), recorded in checkpoints so a resume on other data is caught.
    pub fn fingerprint(&self) -> String {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut eat = |x: u64| {
            for b in x.to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x1000_0000_01b3);
            }
        };
        match self {
            TrainData::Stream { data, .. } => data.train.iter().for_each(|&t| eat(u64::from(t))),
            TrainData::Examples(e) => {
                for x in &e.train {
                    x.tokens.iter().for_each(|&t| eat(u64::from(t)));
                    eat(x.first_target as u64 | 1 << 63);
                }
            }
            TrainData::Images(i) => {
                i.train.iter().for_each(|&p| eat(u64::from(p.to_bits())));
                i.train_labels.iter().for_each(|&l| eat(l as u64));
            }
            TrainData::Denoise { images, noise } => {
                images.train.iter().for_each(|&p| eat(u64::from(p.to_bits())));
                eat(u64::from(noise.to_bits()) | 1 << 62);
            }
            TrainData::Diffusion { images, objective } => {
                images.train.iter().for_each(|&p| eat(u64::from(p.to_bits())));
                images.train_labels.iter().for_each(|&l| eat(l as u64));
                eat(objective.cond_drop_prob.to_bits() | 1 << 61);
            }
            TrainData::TextDiffusion { data, objective } => {
                data.latents.iter().for_each(|&p| eat(u64::from(p.to_bits())));
                data.states.iter().for_each(|&p| eat(u64::from(p.to_bits())));
                eat(objective.cond_drop_prob.to_bits() | 1 << 60);
            }
        }
        format!("{h:016x}")
    }

    /// Where the data came from, for messages.
    pub fn source(&self) -> &str {
        match self {
            TrainData::Stream { data, .. } => &data.source,
            TrainData::Examples(e) => &e.source,
            TrainData::Images(i) => &i.source,
            TrainData::Denoise { images, .. } => &images.source,
            TrainData::Diffusion { images, .. } => &images.source,
            TrainData::TextDiffusion { data, .. } => &data.source,
        }
    }
}

/// `(correct, counted)`: how many of `labels` (≥ 0; the others are ignored) are the argmax of
/// their row of `logits` (`[.., classes]`, one row per label).
pub fn top1_hits(logits: &Tensor, labels: &[i64]) -> Result<(usize, usize)> {
    let classes = logits.dims().last().copied().unwrap_or(1);
    let rows = logits.elem_count() / classes.max(1);
    if rows != labels.len() {
        return Err(RuntimeError::Data(format!(
            "{} labels for logits {:?}: one label per row of classes",
            labels.len(),
            logits.dims()
        )));
    }
    let z = logits.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let (mut hits, mut counted) = (0, 0);
    for (row, &label) in z.chunks(classes).zip(labels) {
        if label < 0 {
            continue;
        }
        counted += 1;
        let best =
            row.iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b });
        hits += usize::from(best.0 as i64 == label);
    }
    Ok((hits, counted))
}
