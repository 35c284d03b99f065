//! The diffusion objective's flags (`train` on a DiT) and their resolution: a diffusers
//! `scheduler_config.json` (given, or found beside the model), then the flags that override it.
//!
//! Defaults are diffusers' `DDPMScheduler`'s (1000 timesteps, `linear` betas 1e-4 → 0.02,
//! `epsilon` prediction) and DiT's condition drop (10%).

use anyhow::{Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use tessera_runtime::diffusion::{Prediction, ScheduleConfig};

#[derive(Args, Clone, Debug)]
pub struct DiffusionArgs {
    /// Diffusion models: a diffusers `scheduler_config.json` (betas, timesteps, prediction
    /// type). Default: `scheduler/scheduler_config.json` or `scheduler_config.json` in or beside
    /// the model's directory, else DDPMScheduler's defaults (1000 steps, linear 1e-4 → 0.02,
    /// epsilon).
    #[arg(long, value_name = "FILE")]
    pub scheduler_config: Option<PathBuf>,
    /// Diffusion models: what the model predicts, `epsilon` (the noise) or `v_prediction`
    /// (overrides the scheduler config).
    #[arg(long, value_name = "TYPE")]
    pub prediction_type: Option<String>,
    /// Diffusion models: the probability of training a row unconditionally (its class replaced
    /// by the null class), for classifier-free guidance.
    #[arg(long, default_value_t = 0.1, value_name = "P")]
    pub cond_drop_prob: f64,
}

impl DiffusionArgs {
    /// The schedule settings for a model given as `model` (a preset or a path).
    pub fn schedule(&self, model: &str) -> Result<ScheduleConfig> {
        let found = self.scheduler_config.clone().or_else(|| beside(Path::new(model)));
        let mut c = match &found {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                ScheduleConfig::from_json(&text).with_context(|| path.display().to_string())?
            }
            None => ScheduleConfig::default(),
        };
        if let Some(p) = &self.prediction_type {
            c.prediction = Prediction::parse(p)?;
        }
        Ok(c)
    }
}

/// A scheduler config in or beside a model directory (diffusers' pipeline layout puts it in
/// `scheduler/`).
fn beside(model: &Path) -> Option<PathBuf> {
    let dir = if model.is_dir() { model.to_path_buf() } else { model.parent()?.to_path_buf() };
    let candidates = [
        dir.join("scheduler_config.json"),
        dir.join("scheduler/scheduler_config.json"),
        dir.parent().map_or_else(PathBuf::new, |p| p.join("scheduler/scheduler_config.json")),
    ];
    candidates.into_iter().find(|p| p.is_file())
}
