//! Labelled images for classification (ViT): a CSV file of one image per row — its
//! `channels · height · width` pixel values (row-major, channel first), then its class — as
//! scikit-learn's `digits.csv` (the data set `data/fetch_digits.sh` installs) and the common
//! MNIST CSV exports lay them out, minus any header.
//!
//! Pixels are scaled by the file's largest value to `[0, 1]` and normalised as Hugging Face's
//! `ViTImageProcessor` does by default (mean 0.5, std 0.5), to `[-1, 1]`. The last
//! `val_fraction` of the rows (rounded up: 360 of the 1,797 digits) is held out. A training step's row `r` is image
//! `draw(seed, step, r)` of the train split, so every device of every plan builds the same
//! batch; held-out batches are the split's images in order, full batches only.

use crate::batch::StepBatch;
use crate::data::counter_draw;
use crate::{Result, RuntimeError};
use std::path::Path;

/// A labelled image data set, split into train and held-out images.
#[derive(Clone, Debug)]
pub struct ImageSet {
    /// `[n, c, h, w]` pixels, normalised to `[-1, 1]`.
    pub train: Vec<f32>,
    pub train_labels: Vec<i64>,
    pub val: Vec<f32>,
    pub val_labels: Vec<i64>,
    /// `[channels, height, width]` of one image.
    pub shape: [usize; 3],
    /// One more than the largest class seen.
    pub num_classes: usize,
    pub source: String,
}

fn err(msg: String) -> RuntimeError {
    RuntimeError::Data(msg)
}

impl ImageSet {
    /// Reads a CSV of images of `shape` (`[channels, height, width]`, the model's) and holds
    /// out the last `val_fraction` of them (rounded up).
    pub fn load_csv(path: &Path, shape: [usize; 3], val_fraction: f64) -> Result<ImageSet> {
        let io = |e| {
            let hint = if path.ends_with("digits.csv") {
                " (scripts/setup.sh installs data/digits.csv; or run data/fetch_digits.sh)"
            } else {
                ""
            };
            err(format!("cannot read image data {}: {e}{hint}", path.display()))
        };
        // The text, then an f32 per pixel (a few bytes of text each), then the split's copy.
        let bytes = crate::data::read_bounded(path, 5, io)?;
        let text = String::from_utf8(bytes)
            .map_err(|e| err(format!("image data {} is not UTF-8 text: {e}", path.display())))?;
        ImageSet::parse_csv(&text, shape, val_fraction, &path.display().to_string())
    }

    /// [`ImageSet::load_csv`] on text already read; `source` names it in messages.
    pub fn parse_csv(
        text: &str,
        shape: [usize; 3],
        val_fraction: f64,
        source: &str,
    ) -> Result<ImageSet> {
        let pixels_per_image: usize = shape.iter().product();
        let (mut pixels, mut labels) = (Vec::new(), Vec::new());
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            if fields.len() != pixels_per_image + 1 {
                return Err(err(format!(
                    "{source} line {}: {} values, but a {}×{}×{} image needs {} pixels and a \
                     label ({} values); is this the model's image size?",
                    i + 1,
                    fields.len(),
                    shape[0],
                    shape[1],
                    shape[2],
                    pixels_per_image,
                    pixels_per_image + 1
                )));
            }
            for f in &fields[..pixels_per_image] {
                let v: f32 =
                    f.parse().ok().filter(|v: &f32| v.is_finite() && *v >= 0.0).ok_or_else(
                        || err(format!("{source} line {}: pixel `{f}` is not a number ≥ 0", i + 1)),
                    )?;
                pixels.push(v);
            }
            let label = fields[pixels_per_image];
            labels.push(label.parse::<i64>().ok().filter(|&l| l >= 0).ok_or_else(|| {
                err(format!("{source} line {}: label `{label}` is not a class id ≥ 0", i + 1))
            })?);
        }
        let n = labels.len();
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(err(format!("held-out fraction {val_fraction} is not in (0, 1)")));
        }
        // Rounded up (a hair below, so an exact product stays itself).
        let n_val = ((n as f64 * val_fraction - 1e-9).ceil() as usize).max(1);
        if n < n_val + 1 {
            return Err(err(format!(
                "{source} has {n} images; training and a held-out split need at least 2"
            )));
        }
        let max = pixels.iter().copied().fold(0.0f32, f32::max);
        let scale = if max > 0.0 { 2.0 / max } else { 0.0 };
        for p in &mut pixels {
            *p = *p * scale - 1.0;
        }
        let split = (n - n_val) * pixels_per_image;
        let val = pixels.split_off(split);
        let val_labels = labels.split_off(n - n_val);
        let num_classes = labels.iter().chain(&val_labels).max().map_or(0, |&m| m as usize + 1);
        Ok(ImageSet {
            train: pixels,
            train_labels: labels,
            val,
            val_labels,
            shape,
            num_classes,
            source: source.to_string(),
        })
    }

    /// Checks the labels against a classifier of `num_labels` classes.
    pub fn validate(&self, num_labels: usize) -> Result<()> {
        if self.num_classes > num_labels {
            return Err(err(format!(
                "{} has class ids up to {}, but the model classifies {num_labels} classes; use \
                 a model with num_labels ≥ {}",
                self.source,
                self.num_classes - 1,
                self.num_classes
            )));
        }
        Ok(())
    }

    fn pixels_per_image(&self) -> usize {
        self.shape.iter().product()
    }

    fn batch_of(&self, pixels: &[f32], labels: &[i64], rows: &[usize]) -> Result<StepBatch> {
        let k = self.pixels_per_image();
        let mut x = Vec::with_capacity(rows.len() * k);
        for &r in rows {
            x.extend_from_slice(&pixels[r * k..(r + 1) * k]);
        }
        let y = rows.iter().map(|&r| labels[r]).collect();
        let [c, h, w] = self.shape;
        StepBatch::images(x, [rows.len(), c, h, w], y)
    }

    /// `rows` of `pixels` as a denoising batch: `pixel_values` with Gaussian noise of standard
    /// deviation `noise` added (keyed by `(seed, key)`, the same on every plan) and the clean
    /// images as `targets`.
    fn denoise_of(
        &self,
        pixels: &[f32],
        rows: &[usize],
        noise: f32,
        seed: u64,
        key: u64,
    ) -> Result<StepBatch> {
        let k = self.pixels_per_image();
        let mut clean = Vec::with_capacity(rows.len() * k);
        for &r in rows {
            clean.extend_from_slice(&pixels[r * k..(r + 1) * k]);
        }
        let noisy = clean
            .iter()
            .enumerate()
            .map(|(i, &x)| x + noise * crate::init::normal(seed, key, i as u64) as f32)
            .collect();
        let [c, h, w] = self.shape;
        StepBatch::denoise(noisy, clean, [rows.len(), c, h, w])
    }

    /// Training step `step`'s denoising batch (the rows of [`ImageSet::train_batch`]).
    pub fn train_denoise_batch(
        &self,
        seed: u64,
        step: u64,
        batch: usize,
        noise: f32,
    ) -> Result<StepBatch> {
        let n = self.train_labels.len();
        let rows: Vec<usize> = (0..batch).map(|r| counter_draw(seed, step, r as u64, n)).collect();
        self.denoise_of(&self.train, &rows, noise, seed, step)
    }

    /// The held-out images as denoising batches (the rows of [`ImageSet::val_batches`]; the
    /// noise keyed apart from training's).
    pub fn val_denoise_batches(
        &self,
        seed: u64,
        batch: usize,
        max_batches: usize,
        noise: f32,
    ) -> Result<Vec<StepBatch>> {
        self.val_rows(batch, max_batches)?
            .into_iter()
            .enumerate()
            .map(|(i, rows)| self.denoise_of(&self.val, &rows, noise, seed, u64::MAX - i as u64))
            .collect()
    }

    /// The rows of the held-out batches in order, `batch` per batch, full batches only, at
    /// most `max_batches` (an error if not even one batch fits).
    fn val_rows(&self, batch: usize, max_batches: usize) -> Result<Vec<Vec<usize>>> {
        let n = self.val_labels.len();
        if batch == 0 || n < batch {
            return Err(err(format!(
                "the held-out split of {} has {n} images, fewer than one batch of {batch}; use \
                 a smaller --batch",
                self.source
            )));
        }
        Ok((0..n / batch)
            .take(max_batches)
            .map(|i| (i * batch..(i + 1) * batch).collect())
            .collect())
    }

    /// The mean squared error of the best context-free guess of a clean image: each pixel's
    /// mean over the training split.
    pub fn pixel_variance(&self) -> f64 {
        let k = self.pixels_per_image();
        let n = self.train.len() / k.max(1);
        let mut mean = vec![0.0f64; k];
        for img in self.train.chunks(k) {
            img.iter().zip(mean.iter_mut()).for_each(|(&x, m)| *m += x as f64 / n as f64);
        }
        let sq: f64 = self
            .train
            .chunks(k)
            .flat_map(|img| img.iter().zip(&mean).map(|(&x, &m)| (x as f64 - m).powi(2)))
            .sum();
        sq / self.train.len().max(1) as f64
    }

    /// Training step `step`'s `batch` images, each a uniform draw keyed by (seed, step, row).
    pub fn train_batch(&self, seed: u64, step: u64, batch: usize) -> Result<StepBatch> {
        let n = self.train_labels.len();
        let rows: Vec<usize> = (0..batch).map(|r| counter_draw(seed, step, r as u64, n)).collect();
        self.batch_of(&self.train, &self.train_labels, &rows)
    }

    /// The held-out images in order, `batch` per batch, full batches only, at most
    /// `max_batches` (an error if not even one batch fits).
    pub fn val_batches(&self, batch: usize, max_batches: usize) -> Result<Vec<StepBatch>> {
        self.val_rows(batch, max_batches)?
            .into_iter()
            .map(|rows| self.batch_of(&self.val, &self.val_labels, &rows))
            .collect()
    }
}
