//! Text-conditioned diffusion data (Stable Diffusion's UNet): pictures already encoded to
//! latents by the frozen VAE (`mean × scaling_factor`) and captions already encoded to text
//! states by the frozen CLIP text encoder, both once before training, so the training Program
//! is the UNet alone: its parameters are the only ones with gradients and optimizer state.
//!
//! Row `r` of step `s` takes picture `draw(seed, s, r)`, and its timestep, noise and condition
//! drop come from [`DiffusionObjective::draws`] keyed by `(seed, s, r)` as for DiT; a dropped
//! row's text states are the empty caption's (classifier-free guidance). The batch is the UNet's
//! inputs: `sample` (the noised latents), `timestep`, `encoder_hidden_states` and `target`.
//!
//! A picture folder is small (a few to a few thousand pictures) and has no held-out split: the
//! evaluation batches are the first pictures at fixed draws, keyed apart from training's.

use crate::batch::StepBatch;
use crate::diffusion::DiffusionObjective;
use crate::tensor::from_vec;
use crate::{Result, RuntimeError};

/// Encoded pictures and captions.
#[derive(Clone, Debug)]
pub struct TextLatents {
    /// Where they came from, for messages.
    pub source: String,
    /// `[n, C, H, W]` latents (already scaled), row-major.
    pub latents: Vec<f32>,
    /// `[C, H, W]`.
    pub shape: [usize; 3],
    /// `[n, seq, dim]` text states of each picture's caption.
    pub states: Vec<f32>,
    /// `[seq, dim]`: the empty caption's.
    pub null_states: Vec<f32>,
    pub seq: usize,
    pub dim: usize,
}

impl TextLatents {
    pub fn len(&self) -> usize {
        self.latents.len() / self.shape.iter().product::<usize>().max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks the sizes agree.
    pub fn validate(&self) -> Result<()> {
        let n = self.len();
        let k: usize = self.shape.iter().product();
        if n == 0
            || self.latents.len() != n * k
            || self.states.len() != n * self.seq * self.dim
            || self.null_states.len() != self.seq * self.dim
        {
            return Err(RuntimeError::Data(format!(
                "{}: {} latent values of {:?}, {} state values, {} null-state values for seq {} \
                 and width {}: sizes disagree",
                self.source,
                self.latents.len(),
                self.shape,
                self.states.len(),
                self.null_states.len(),
                self.seq,
                self.dim
            )));
        }
        Ok(())
    }

    /// Training step `step`'s batch.
    pub fn train_batch(
        &self,
        objective: &DiffusionObjective,
        seed: u64,
        step: u64,
        batch: usize,
    ) -> Result<StepBatch> {
        let n = self.len();
        let rows: Vec<usize> =
            (0..batch).map(|r| crate::data::counter_draw(seed, step, r as u64, n)).collect();
        self.batch_of(objective, &rows, seed, step)
    }

    /// Up to `max_batches` evaluation batches: pictures `0..batch`, `batch..2·batch`, ...
    /// (wrapping round a folder smaller than a batch), at draws keyed apart from training's.
    pub fn val_batches(
        &self,
        objective: &DiffusionObjective,
        seed: u64,
        batch: usize,
        max_batches: usize,
    ) -> Result<Vec<StepBatch>> {
        let n = self.len();
        let count = (n / batch).clamp(1, max_batches.max(1)).min(max_batches);
        (0..count)
            .map(|k| {
                let rows: Vec<usize> = (k * batch..(k + 1) * batch).map(|i| i % n).collect();
                self.batch_of(objective, &rows, seed, u64::MAX - k as u64)
            })
            .collect()
    }

    fn batch_of(
        &self,
        objective: &DiffusionObjective,
        rows: &[usize],
        seed: u64,
        step: u64,
    ) -> Result<StepBatch> {
        let k: usize = self.shape.iter().product();
        let sd = self.seq * self.dim;
        let (mut xs, mut ts, mut ctx, mut targets) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (r, &pic) in rows.iter().enumerate() {
            let (t, noise, dropped) = objective.draws(seed, step, r as u64, k);
            let (x, target) = objective.noised(&self.latents[pic * k..(pic + 1) * k], &noise, t);
            xs.extend(x);
            targets.extend(target);
            ts.push(t as f32);
            ctx.extend_from_slice(match dropped {
                true => &self.null_states,
                false => &self.states[pic * sd..(pic + 1) * sd],
            });
        }
        let [c, h, w] = self.shape;
        let b = rows.len();
        StepBatch::new(vec![
            ("sample".into(), from_vec(xs, &[b, c, h, w])?),
            ("timestep".into(), from_vec(ts, &[b])?),
            ("encoder_hidden_states".into(), from_vec(ctx, &[b, self.seq, self.dim])?),
            ("target".into(), from_vec(targets, &[b, c, h, w])?),
        ])
    }
}

/// A CLIP tokenizer as Stable Diffusion's training and pipelines call it: `tokenizer(texts,
/// padding="max_length", max_length=L, truncation=True)`. Read from a diffusers pipeline's
/// `tokenizer/` folder: its `tokenizer.json` (the fast tokenizer's file; a folder holding only
/// `vocab.json`/`merges.txt` is refused by name) and `tokenizer_config.json`
/// (`model_max_length`, `pad_token`).
pub struct CaptionTokenizer {
    inner: tokenizers::Tokenizer,
    /// L: every caption becomes this many ids.
    pub max_length: usize,
    pub pad_id: u32,
}

fn token_name(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(m) => m.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

impl CaptionTokenizer {
    /// The tokenizer of `dir`, its length capped at `max_positions` (the text encoder's).
    pub fn open(dir: &std::path::Path, max_positions: usize) -> Result<CaptionTokenizer> {
        let file = dir.join("tokenizer.json");
        if !file.is_file() {
            return Err(RuntimeError::Data(format!(
                "{}: no tokenizer.json; write one with transformers: \
                 `CLIPTokenizerFast.from_pretrained(DIR).save_pretrained(DIR)`",
                dir.display()
            )));
        }
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| RuntimeError::Data(format!("{}: not a tokenizer: {e}", file.display())))?;
        let config: serde_json::Value =
            match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
                Ok(text) => serde_json::from_str(&text).map_err(|e| {
                    RuntimeError::Data(format!("{}/tokenizer_config.json: {e}", dir.display()))
                })?,
                Err(_) => serde_json::Value::Null,
            };
        let max_length = config
            .get("model_max_length")
            .and_then(|v| v.as_u64())
            .map_or(max_positions, |l| (l as usize).min(max_positions));
        let pad = config.get("pad_token").and_then(token_name).unwrap_or("<|endoftext|>".into());
        let pad_id = inner.token_to_id(&pad).ok_or_else(|| {
            RuntimeError::Data(format!(
                "{}: the pad token `{pad}` is not in the vocabulary",
                dir.display()
            ))
        })?;
        if max_length < 2 {
            return Err(RuntimeError::Data(format!(
                "{}: captions of {max_length} tokens leave no room for the start and end tokens",
                dir.display()
            )));
        }
        Ok(CaptionTokenizer { inner, max_length, pad_id })
    }

    /// `texts` as `[texts.len(), max_length]` ids: the start and end tokens added, the middle
    /// truncated to fit, padded with the pad token.
    pub fn encode(&self, texts: &[&str]) -> Result<Vec<i64>> {
        let l = self.max_length;
        let mut out = Vec::with_capacity(texts.len() * l);
        for text in texts {
            let enc = self.inner.encode(*text, true).map_err(|e| {
                RuntimeError::Data(format!("cannot tokenize caption {text:?}: {e}"))
            })?;
            let mut ids: Vec<i64> = enc.get_ids().iter().map(|&i| i64::from(i)).collect();
            if ids.len() > l {
                let end = ids[ids.len() - 1];
                ids.truncate(l - 1);
                ids.push(end);
            }
            ids.resize(l, i64::from(self.pad_id));
            out.extend(ids);
        }
        Ok(out)
    }
}
