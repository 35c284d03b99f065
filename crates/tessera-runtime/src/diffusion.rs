//! The diffusion objective and samplers, data-side: the training Program stays the model and
//! its mean squared error against `target`; this module makes each step's `hidden_states`,
//! `timestep`, `class_labels` and `target`, and steps a sample during generation.
//!
//! - [`NoiseSchedule`]: diffusers' `DDPMScheduler` betas and `alphas_cumprod` for
//!   `beta_schedule` `linear`, `scaled_linear` and `squaredcos_cap_v2`, rounded to f32 where
//!   diffusers holds f32 (so the schedule and Euler's σ near t = 0, where `1 − ᾱ` cancels,
//!   are diffusers' own values).
//! - [`DiffusionObjective`]: row `r` of training step `s` takes image `draw(seed, s, r)` (the
//!   image set's own draw), timestep `t ~ U{0..T}` and noise `ε ~ N(0, I)` keyed by
//!   `(seed, s, r)` with the counter-based generator — the same values on every device of
//!   every plan, whatever the micro-batching — and drops its class label to the null class
//!   (`num_classes`) with probability `cond_drop_prob`, keyed the same way. Then
//!   `hidden_states = √ᾱ_t·x₀ + √(1−ᾱ_t)·ε` (diffusers' `add_noise`) and `target = ε`
//!   (`epsilon`) or `v = √ᾱ_t·ε − √(1−ᾱ_t)·x₀` (`v_prediction`, diffusers' `get_velocity`).
//! - [`Sampler`]: diffusers' `DDIMScheduler` (η = 0, `leading` spacing, `clip_sample` to ±1 by
//!   default) and `EulerDiscreteScheduler` (`linspace` spacing, linear sigma interpolation,
//!   final sigma 0, no churn) steps, with classifier-free guidance combined by the caller
//!   (`uncond + scale·(cond − uncond)`).
//!
//! Defaults (diffusers' `DDPMScheduler`): 1000 training timesteps, `linear` betas from 1e-4 to
//! 0.02, `epsilon` prediction; the condition is dropped 10% of the time (DiT's
//! `class_dropout_prob`). A `scheduler_config.json` in diffusers' layout sets them
//! ([`ScheduleConfig::from_json`]).

use crate::batch::StepBatch;
use crate::images::ImageSet;
use crate::tensor::from_vec;
use crate::{Result, RuntimeError};
use serde::Serialize;

fn err(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Data(msg.into())
}

/// diffusers' `beta_schedule`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BetaSchedule {
    Linear,
    ScaledLinear,
    SquaredcosCapV2,
}

impl BetaSchedule {
    pub fn parse(s: &str) -> Result<BetaSchedule> {
        match s {
            "linear" => Ok(BetaSchedule::Linear),
            "scaled_linear" => Ok(BetaSchedule::ScaledLinear),
            "squaredcos_cap_v2" => Ok(BetaSchedule::SquaredcosCapV2),
            other => Err(err(format!(
                "beta_schedule `{other}` is not supported; use linear, scaled_linear or \
                 squaredcos_cap_v2"
            ))),
        }
    }
}

/// What the model predicts (diffusers' `prediction_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Prediction {
    /// The noise ε.
    Epsilon,
    /// The velocity `v = √ᾱ·ε − √(1−ᾱ)·x₀`.
    VPrediction,
}

impl Prediction {
    pub fn parse(s: &str) -> Result<Prediction> {
        match s {
            "epsilon" => Ok(Prediction::Epsilon),
            "v_prediction" => Ok(Prediction::VPrediction),
            other => Err(err(format!(
                "prediction_type `{other}` is not supported; use epsilon or v_prediction"
            ))),
        }
    }
}

/// The settings of a diffusers scheduler config that the objective and samplers read.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScheduleConfig {
    pub num_train_timesteps: usize,
    pub beta_start: f64,
    pub beta_end: f64,
    pub beta_schedule: BetaSchedule,
    pub prediction: Prediction,
    /// DDIM's `clip_sample` (x₀ clamped to ±`clip_sample_range`, 1).
    pub clip_sample: bool,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig {
            num_train_timesteps: 1000,
            beta_start: 1e-4,
            beta_end: 0.02,
            beta_schedule: BetaSchedule::Linear,
            prediction: Prediction::Epsilon,
            clip_sample: true,
        }
    }
}

impl ScheduleConfig {
    /// A diffusers `scheduler_config.json`'s text: absent keys keep the defaults; a setting
    /// this module does not implement (`trained_betas`, thresholding, `rescale_betas_zero_snr`,
    /// other spacings) is refused by name.
    pub fn from_json(text: &str) -> Result<ScheduleConfig> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| err(format!("scheduler config is not JSON: {e}")))?;
        let map = v.as_object().ok_or_else(|| err("scheduler config must be a JSON object"))?;
        let mut c = ScheduleConfig::default();
        let get = |k: &str| map.get(k).filter(|v| !v.is_null());
        if let Some(n) = get("num_train_timesteps") {
            c.num_train_timesteps = n.as_u64().filter(|&n| n >= 2).ok_or_else(|| {
                err(format!("num_train_timesteps must be an integer ≥ 2, got {n}"))
            })? as usize;
        }
        for (key, dst) in [("beta_start", &mut c.beta_start), ("beta_end", &mut c.beta_end)] {
            if let Some(x) = get(key) {
                *dst = x.as_f64().ok_or_else(|| err(format!("{key} must be a number")))?;
            }
        }
        if let Some(s) = get("beta_schedule") {
            c.beta_schedule = BetaSchedule::parse(s.as_str().unwrap_or("?"))?;
        }
        if let Some(s) = get("prediction_type") {
            c.prediction = Prediction::parse(s.as_str().unwrap_or("?"))?;
        }
        if let Some(b) = get("clip_sample") {
            c.clip_sample = b.as_bool().ok_or_else(|| err("clip_sample must be true or false"))?;
        }
        for key in ["trained_betas", "thresholding", "rescale_betas_zero_snr"] {
            if get(key).is_some_and(|v| v != &serde_json::Value::Bool(false)) {
                return Err(err(format!("scheduler config: `{key}` is not supported")));
            }
        }
        if get("clip_sample_range").and_then(|v| v.as_f64()).is_some_and(|r| r != 1.0) {
            return Err(err("scheduler config: only clip_sample_range 1.0 is supported"));
        }
        Ok(c)
    }
}

/// β_t and ᾱ_t = Π(1 − β) for t in `0..num_train_timesteps`.
#[derive(Clone, Debug, PartialEq)]
pub struct NoiseSchedule {
    pub betas: Vec<f64>,
    pub alphas_cumprod: Vec<f64>,
}

impl NoiseSchedule {
    pub fn new(c: &ScheduleConfig) -> NoiseSchedule {
        let n = c.num_train_timesteps;
        let lin = |a: f64, b: f64, i: usize| a + (b - a) * i as f64 / (n - 1) as f64;
        let betas: Vec<f64> = match c.beta_schedule {
            BetaSchedule::Linear => (0..n).map(|i| lin(c.beta_start, c.beta_end, i)).collect(),
            BetaSchedule::ScaledLinear => {
                (0..n).map(|i| lin(c.beta_start.sqrt(), c.beta_end.sqrt(), i).powi(2)).collect()
            }
            BetaSchedule::SquaredcosCapV2 => {
                let alpha_bar =
                    |t: f64| ((t + 0.008) / 1.008 * std::f64::consts::PI / 2.0).cos().powi(2);
                (0..n)
                    .map(|i| {
                        let (t1, t2) = (i as f64 / n as f64, (i + 1) as f64 / n as f64);
                        (1.0 - alpha_bar(t2) / alpha_bar(t1)).min(0.999)
                    })
                    .collect()
            }
        };
        // As diffusers holds them: f32 betas, f32 alphas `1 − β`, their running product
        // accumulated wider (torch's CPU cumprod) and stored as f32.
        let betas: Vec<f64> = betas.iter().map(|&b| f64::from(b as f32)).collect();
        let mut acc = 1.0f64;
        let alphas_cumprod = betas
            .iter()
            .map(|&b| {
                acc *= f64::from(1.0f32 - b as f32);
                f64::from(acc as f32)
            })
            .collect();
        NoiseSchedule { betas, alphas_cumprod }
    }

    pub fn len(&self) -> usize {
        self.betas.len()
    }

    pub fn is_empty(&self) -> bool {
        self.betas.is_empty()
    }
}

/// Stream keys of the objective's draws (apart from the image draw's and dropout's).
const TIMESTEP_STREAM: u64 = 0xd1ff_0001;
const NOISE_STREAM: u64 = 0xd1ff_0002;
const DROP_STREAM: u64 = 0xd1ff_0003;

/// A uniform draw in `[0, 1)` keyed by `(seed, stream, step, row)`.
fn unit(seed: u64, stream: u64, step: u64, row: u64) -> f64 {
    crate::data::counter_draw(seed ^ stream, step, row, 1 << 53) as f64 / (1u64 << 53) as f64
}

/// The class-conditional denoising objective on a labelled image set.
#[derive(Clone, Debug)]
pub struct DiffusionObjective {
    pub config: ScheduleConfig,
    pub schedule: NoiseSchedule,
    /// Probability of replacing a row's class by the null class (classifier-free guidance).
    pub cond_drop_prob: f64,
    /// The null class's id: the model's class count.
    pub num_classes: usize,
}

impl DiffusionObjective {
    pub fn new(config: ScheduleConfig, cond_drop_prob: f64, num_classes: usize) -> Result<Self> {
        if !(0.0..=1.0).contains(&cond_drop_prob) {
            return Err(err(format!(
                "the condition drop probability {cond_drop_prob} must be in [0, 1]"
            )));
        }
        let schedule = NoiseSchedule::new(&config);
        Ok(DiffusionObjective { config, schedule, cond_drop_prob, num_classes })
    }

    /// Row `row` of step `step`: its timestep, its noise (`k` values) and whether its
    /// condition is dropped.
    pub fn draws(&self, seed: u64, step: u64, row: u64, k: usize) -> (usize, Vec<f32>, bool) {
        let t = crate::data::counter_draw(seed ^ TIMESTEP_STREAM, step, row, self.schedule.len());
        let key = NOISE_STREAM ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ row;
        let noise = (0..k as u64).map(|i| crate::init::normal(seed, key, i) as f32).collect();
        let dropped = unit(seed, DROP_STREAM, step, row) < self.cond_drop_prob;
        (t, noise, dropped)
    }

    /// `(hidden_states, target)` of clean `x0` at timestep `t` with `noise`.
    pub fn noised(&self, x0: &[f32], noise: &[f32], t: usize) -> (Vec<f32>, Vec<f32>) {
        let a = self.schedule.alphas_cumprod[t];
        let (sa, sb) = (a.sqrt() as f32, (1.0 - a).sqrt() as f32);
        let noisy = x0.iter().zip(noise).map(|(&x, &e)| sa * x + sb * e).collect();
        let target = match self.config.prediction {
            Prediction::Epsilon => noise.to_vec(),
            Prediction::VPrediction => {
                x0.iter().zip(noise).map(|(&x, &e)| sa * e - sb * x).collect()
            }
        };
        (noisy, target)
    }

    /// Training step `step`'s batch of `batch` rows from the images' train split.
    pub fn train_batch(
        &self,
        images: &ImageSet,
        seed: u64,
        step: u64,
        batch: usize,
    ) -> Result<StepBatch> {
        let n = images.train_labels.len();
        let rows: Vec<usize> =
            (0..batch).map(|r| crate::data::counter_draw(seed, step, r as u64, n)).collect();
        self.batch_of(&images.train, &images.train_labels, images.shape, &rows, seed, step)
    }

    /// The held-out images as batches (full batches only, at most `max_batches`), keyed apart
    /// from training's draws.
    pub fn val_batches(
        &self,
        images: &ImageSet,
        seed: u64,
        batch: usize,
        max_batches: usize,
    ) -> Result<Vec<StepBatch>> {
        let n = images.val_labels.len();
        (0..(n / batch).min(max_batches))
            .map(|k| {
                let rows: Vec<usize> = (k * batch..(k + 1) * batch).collect();
                let key = u64::MAX - k as u64;
                self.batch_of(&images.val, &images.val_labels, images.shape, &rows, seed, key)
            })
            .collect()
    }

    fn batch_of(
        &self,
        pixels: &[f32],
        labels: &[i64],
        shape: [usize; 3],
        rows: &[usize],
        seed: u64,
        step: u64,
    ) -> Result<StepBatch> {
        let k: usize = shape.iter().product();
        let (mut xs, mut ts, mut ys, mut targets) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (r, &img) in rows.iter().enumerate() {
            let (t, noise, dropped) = self.draws(seed, step, r as u64, k);
            let label = labels[img];
            if label < 0 || label as usize >= self.num_classes {
                return Err(err(format!(
                    "image {img} has class {label}, but the model has {} classes",
                    self.num_classes
                )));
            }
            let (x, target) = self.noised(&pixels[img * k..(img + 1) * k], &noise, t);
            xs.extend(x);
            targets.extend(target);
            ts.push(t as f32);
            ys.push(if dropped { self.num_classes as i64 } else { label });
        }
        let [c, h, w] = shape;
        let dims = [rows.len(), c, h, w];
        StepBatch::new(vec![
            ("hidden_states".into(), from_vec(xs, &dims)?),
            ("timestep".into(), from_vec(ts, &[rows.len()])?),
            ("class_labels".into(), from_vec(ys, &[rows.len()])?),
            ("target".into(), from_vec(targets, &dims)?),
        ])
    }
}

/// A sampler of diffusers' discrete schedulers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SamplerKind {
    Ddim,
    Euler,
}

/// A sampling schedule: the timesteps (and Euler's sigmas) of `num_inference_steps` steps.
#[derive(Clone, Debug)]
pub struct Sampler {
    pub kind: SamplerKind,
    pub config: ScheduleConfig,
    pub schedule: NoiseSchedule,
    /// The model's timestep at each step (DDIM's integers, Euler's fractional ones).
    pub timesteps: Vec<f64>,
    /// Euler: σ at each step, then 0.
    pub sigmas: Vec<f64>,
}

impl Sampler {
    pub fn new(kind: SamplerKind, config: ScheduleConfig, steps: usize) -> Result<Sampler> {
        let n = config.num_train_timesteps;
        if steps == 0 || steps > n {
            return Err(err(format!("sampling steps must be in 1..={n}, got {steps}")));
        }
        let schedule = NoiseSchedule::new(&config);
        let (timesteps, sigmas) = match kind {
            // `leading`: t = i·(T / steps), descending.
            SamplerKind::Ddim => {
                let ratio = n / steps;
                ((0..steps).rev().map(|i| (i * ratio) as f64).collect(), Vec::new())
            }
            // `linspace` from T−1 down to 0, σ interpolated linearly in t, then 0.
            SamplerKind::Euler => {
                // σ_t = √((1 − ᾱ_t)/ᾱ_t) in f32, as diffusers computes it from its f32 ᾱ.
                let full: Vec<f64> = schedule
                    .alphas_cumprod
                    .iter()
                    .map(|&a| {
                        let a = a as f32;
                        f64::from(((1.0 - a) / a).sqrt())
                    })
                    .collect();
                let ts: Vec<f64> = (0..steps)
                    .rev()
                    .map(|i| {
                        if steps == 1 {
                            0.0
                        } else {
                            (n - 1) as f64 * i as f64 / (steps - 1) as f64
                        }
                    })
                    .collect();
                let mut sig: Vec<f64> = ts
                    .iter()
                    .map(|&t| {
                        let lo = t.floor() as usize;
                        let hi = (lo + 1).min(n - 1);
                        full[lo] + (full[hi] - full[lo]) * (t - lo as f64)
                    })
                    .collect();
                sig.push(0.0);
                (ts, sig)
            }
        };
        Ok(Sampler { kind, config, schedule, timesteps, sigmas })
    }

    /// The standard deviation of the initial noise.
    pub fn init_noise_sigma(&self) -> f64 {
        match self.kind {
            SamplerKind::Ddim => 1.0,
            SamplerKind::Euler => self.sigmas.iter().copied().fold(0.0, f64::max),
        }
    }

    /// The model input at step `i` for `sample` (Euler divides by √(σ² + 1)).
    pub fn scale_model_input(&self, i: usize, sample: &[f32]) -> Vec<f32> {
        match self.kind {
            SamplerKind::Ddim => sample.to_vec(),
            SamplerKind::Euler => {
                let s = (self.sigmas[i].powi(2) + 1.0).sqrt();
                sample.iter().map(|&x| (f64::from(x) / s) as f32).collect()
            }
        }
    }

    /// One step from `sample` at step `i` given the (guided) model output: the next sample.
    pub fn step(&self, i: usize, model_output: &[f32], sample: &[f32]) -> Vec<f32> {
        let pred = self.config.prediction;
        match self.kind {
            SamplerKind::Ddim => {
                let t = self.timesteps[i] as usize;
                let ratio = self.config.num_train_timesteps / self.timesteps.len();
                let a = self.schedule.alphas_cumprod[t];
                let a_prev = t.checked_sub(ratio).map_or(1.0, |p| self.schedule.alphas_cumprod[p]);
                let (sa, sb) = (a.sqrt(), (1.0 - a).sqrt());
                sample
                    .iter()
                    .zip(model_output)
                    .map(|(&x, &m)| {
                        let (x, m) = (f64::from(x), f64::from(m));
                        let (mut x0, eps) = match pred {
                            Prediction::Epsilon => ((x - sb * m) / sa, m),
                            Prediction::VPrediction => (sa * x - sb * m, sa * m + sb * x),
                        };
                        if self.config.clip_sample {
                            x0 = x0.clamp(-1.0, 1.0);
                        }
                        (a_prev.sqrt() * x0 + (1.0 - a_prev).sqrt() * eps) as f32
                    })
                    .collect()
            }
            SamplerKind::Euler => {
                let (s, s_next) = (self.sigmas[i], self.sigmas[i + 1]);
                sample
                    .iter()
                    .zip(model_output)
                    .map(|(&x, &m)| {
                        let (x, m) = (f64::from(x), f64::from(m));
                        let x0 = match pred {
                            Prediction::Epsilon => x - s * m,
                            Prediction::VPrediction => {
                                m * (-s / (s * s + 1.0).sqrt()) + x / (s * s + 1.0)
                            }
                        };
                        let derivative = (x - x0) / s;
                        (x + derivative * (s_next - s)) as f32
                    })
                    .collect()
            }
        }
    }
}
