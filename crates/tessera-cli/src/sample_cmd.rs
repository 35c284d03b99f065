//! `tessera sample`: images from a class-conditional diffusion model (DiT), written as a PNG
//! grid — one row per requested class, `--per-class` samples each.
//!
//! A loop of forward Programs on one device (as decoding is): each step runs the model on the
//! conditional rows and, with a guidance scale ≠ 1, on the same samples with the null class,
//! combines them as `uncond + scale·(cond − uncond)` and takes one step of diffusers' DDIM or
//! Euler (discrete) scheduler ([`tessera_runtime::diffusion::Sampler`]). The initial noise of
//! row `r` is keyed by `(seed, r)` with the counter-based generator, so a run is reproducible.
//! Pixels are mapped from `[-1, 1]` to 0..255 and clamped; channel 0 is drawn in grey.
//!
//! A text-conditioned UNet (`--model-dir PIPE/unet` of a diffusers pipeline) draws one row per
//! `--prompt` instead: the prompts and the empty prompt are encoded by the pipeline's frozen
//! CLIP text encoder, the loop runs the UNet with those states, and the final latents ÷
//! `scaling_factor` go through the VAE's decoder ([`crate::latent::Pipeline`]); the grid is RGB.

use crate::diffusion_args::DiffusionArgs;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use tessera_ir::{DType, Program, TensorId};
use tessera_models::{build, BuildOptions, ModelConfig, UNetConfig};
use tessera_runtime::collective::DeviceMesh;
use tessera_runtime::diffusion::{Sampler, SamplerKind};
use tessera_runtime::hf_weights::open_weights;
use tessera_runtime::tensor::{candle_dtype, from_vec, to_f64_vec};
use tessera_runtime::{CpuBackend, Executor};

#[derive(Args, Clone, Debug)]
pub struct SampleArgs {
    /// A trained DiT: a checkpoint of `train --save` or a diffusers model directory.
    #[arg(long, value_name = "DIR")]
    pub model_dir: PathBuf,
    /// A text-conditioned UNet: a prompt to draw (one grid row each; repeat the flag).
    #[arg(long = "prompt", value_name = "TEXT")]
    pub prompts: Vec<String>,
    /// The classes to draw, comma-separated (one grid row each).
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,3,4,5,6,7,8,9")]
    pub classes: Vec<i64>,
    /// Samples per class (grid columns).
    #[arg(long, default_value_t = 8)]
    pub per_class: usize,
    /// Denoising steps.
    #[arg(long, default_value_t = 50)]
    pub steps: usize,
    /// `ddim` (η = 0) or `euler` (EulerDiscreteScheduler).
    #[arg(long, value_enum, default_value_t = SamplerChoice::Ddim)]
    pub sampler: SamplerChoice,
    /// Classifier-free guidance scale (1: conditional only).
    #[arg(long, default_value_t = 4.0)]
    pub guidance_scale: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The PNG grid to write.
    #[arg(long, value_name = "FILE.png")]
    pub out: PathBuf,
    /// Also write the samples as safetensors: `samples` `[N, C, H, W]` f32 (the model's units,
    /// `[-1, 1]` for the digits) and their `class_labels` `[N]` i64, rows in grid order.
    #[arg(long, value_name = "FILE.safetensors")]
    pub tensors: Option<PathBuf>,
    /// Each pixel drawn as a square of this many pixels.
    #[arg(long, default_value_t = 4)]
    pub zoom: usize,
    #[command(flatten)]
    pub diffusion: DiffusionArgs,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplerChoice {
    Ddim,
    Euler,
}

/// Samples for `classes`, `per_class` each: `[rows, C, H, W]` values in the model's units.
pub struct Samples {
    pub images: Vec<f32>,
    pub shape: [usize; 3],
    pub labels: Vec<i64>,
}

pub fn run(args: &SampleArgs) -> Result<()> {
    let s = sample(args)?;
    let rows = if args.prompts.is_empty() { args.classes.len() } else { args.prompts.len() };
    let png = png_grid(&s.images, s.shape, rows, args.per_class, args.zoom.max(1));
    std::fs::write(&args.out, png)
        .with_context(|| format!("cannot write {}", args.out.display()))?;
    if let Some(path) = &args.tensors {
        let [c, h, w] = s.shape;
        let n = s.labels.len();
        let tensors = std::collections::HashMap::from([
            ("samples".to_string(), from_vec(s.images.clone(), &[n, c, h, w])?),
            ("class_labels".to_string(), from_vec(s.labels.clone(), &[n])?),
        ]);
        candle_core::safetensors::save(&tensors, path)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    println!(
        "wrote {} samples ({} classes × {}) to {}",
        s.labels.len(),
        rows,
        args.per_class,
        args.out.display()
    );
    Ok(())
}

/// Runs the sampler (see the module docs).
pub fn sample(args: &SampleArgs) -> Result<Samples> {
    let cfg = ModelConfig::from_path(&args.model_dir)?;
    if let ModelConfig::UNet(unet) = &cfg {
        return sample_text(args, &cfg, unet);
    }
    let ModelConfig::Dit(dit) = &cfg else {
        bail!("`sample` draws from diffusion models (DiT); {} is a {}", cfg.name(), cfg.family())
    };
    if args.per_class == 0 || args.classes.is_empty() {
        bail!("nothing to draw: give --classes and --per-class ≥ 1");
    }
    if let Some(&bad) = args.classes.iter().find(|&&c| c < 0 || c as usize >= dit.num_classes) {
        bail!("class {bad} is not one of the model's 0..{}", dit.num_classes);
    }
    let kind = match args.sampler {
        SamplerChoice::Ddim => SamplerKind::Ddim,
        SamplerChoice::Euler => SamplerKind::Euler,
    };
    let model = args.model_dir.display().to_string();
    let sampler = Sampler::new(kind, args.diffusion.schedule(&model)?, args.steps)?;
    let labels: Vec<i64> =
        args.classes.iter().flat_map(|&c| std::iter::repeat_n(c, args.per_class)).collect();
    let n = labels.len();
    let guided = args.guidance_scale != 1.0;
    let batch = if guided { 2 * n } else { n };
    let (c, side) = (dit.in_channels, dit.sample_size);
    let k = c * side * side;

    let fm = build(&cfg, &BuildOptions::new(batch, 1, DType::F32))?;
    let inputs: Vec<(&str, TensorId)> = fm.inputs.iter().map(|i| (i.name, i.tensor)).collect();
    let logits = fm.logits;
    let graph = fm.builder.finish();
    let weights = open_weights(&args.model_dir, &graph)?;
    let program = Program::lower_graph(graph.clone(), vec![logits], &[]);
    let mut exec = Executor::new(program, CpuBackend::new(0), None);
    let whole = |t: TensorId| vec![Vec::new(); graph.shape(t).rank()];
    let mesh = DeviceMesh::single();
    for p in graph.parameters() {
        let name = graph.tensor_scope(p);
        let dtype = candle_dtype(graph.meta(p).dtype);
        let v = weights.shard_of(name, &whole(p), &mesh, dtype)?;
        exec.bind(p, v.with_context(|| format!("no value for parameter {name}"))?)?;
    }

    let mut class_in = labels.clone();
    if guided {
        class_in.extend(std::iter::repeat_n(dit.num_classes as i64, n));
    }
    let dims = [batch, c, side, side];
    // The prediction is the first C channels of each row (a learned sigma follows).
    let o = dit.out_channels * side * side;
    let x = denoise(&sampler, args.seed, n, k, args.guidance_scale, |model_in, t| {
        for &(name, tensor) in &inputs {
            let value = match name {
                "hidden_states" => from_vec(model_in.clone(), &dims)?,
                "timestep" => from_vec(vec![t; batch], &[batch])?,
                "class_labels" => from_vec(class_in.clone(), &[batch])?,
                // The loss's input: not read by the output.
                "target" => from_vec(vec![0f32; batch * k], &dims)?,
                other => bail!("the model takes input `{other}`, which sampling cannot fill"),
            };
            exec.bind(tensor, value)?;
        }
        exec.run()?;
        let out = to_f64_vec(exec.get(logits).context("the model output was not kept")?)?;
        Ok((0..batch).flat_map(|row| out[row * o..row * o + k].iter().map(|&v| v as f32)).collect())
    })?;
    Ok(Samples { images: x, shape: [c, side, side], labels })
}

/// Samples of a text-conditioned UNet, one row of `--per-class` per prompt (module docs).
fn sample_text(args: &SampleArgs, cfg: &ModelConfig, unet: &UNetConfig) -> Result<Samples> {
    if args.per_class == 0 || args.prompts.is_empty() {
        bail!("nothing to draw: give --prompt TEXT (one or more) and --per-class ≥ 1");
    }
    let pipe = crate::latent::Pipeline::beside(&args.model_dir)?;
    pipe.picture_side(unet)?;
    let kind = match args.sampler {
        SamplerChoice::Ddim => SamplerKind::Ddim,
        SamplerChoice::Euler => SamplerKind::Euler,
    };
    let model = args.model_dir.display().to_string();
    let sampler = Sampler::new(kind, args.diffusion.schedule(&model)?, args.steps)?;
    let n = args.prompts.len() * args.per_class;
    let labels: Vec<i64> = (0..args.prompts.len() as i64)
        .flat_map(|p| std::iter::repeat_n(p, args.per_class))
        .collect();
    let texts: Vec<&str> = args.prompts.iter().map(String::as_str).collect();
    let prompt_states = pipe.encode_text(&texts)?;
    let null_states = pipe.encode_text(&[""])?;
    let (l, d) = (pipe.tokenizer.max_length, unet.cross_attention_dim);
    let guided = args.guidance_scale != 1.0;
    let batch = if guided { 2 * n } else { n };
    let mut states = Vec::with_capacity(batch * l * d);
    for &p in &labels {
        let p = p as usize;
        states.extend_from_slice(&prompt_states[p * l * d..(p + 1) * l * d]);
    }
    if guided {
        for _ in 0..n {
            states.extend_from_slice(&null_states);
        }
    }
    let (c, side) = (unet.in_channels, unet.sample_size);
    let k = c * side * side;
    let mut frozen = crate::latent::Frozen::new(cfg, &args.model_dir, batch, l)?;
    let dims = [batch, c, side, side];
    let states = from_vec(states, &[batch, l, d])?;
    let x = denoise(&sampler, args.seed, n, k, args.guidance_scale, |model_in, t| {
        frozen.run(vec![
            ("sample", from_vec(model_in, &dims)?),
            ("timestep", from_vec(vec![t; batch], &[batch])?),
            ("encoder_hidden_states", states.clone()),
        ])
    })?;
    let images = pipe.decode(&x, n, side)?;
    let out_side = (images.len() / n / 3).isqrt();
    Ok(Samples { images, shape: [3, out_side, out_side], labels })
}

/// The sampling loop DiT and the UNet share: `n` samples of `k` values from seeded noise; each
/// timestep gives `model` the scaled samples (twice under guidance: the conditioned rows, then
/// the unconditioned) and the timestep, and wants `k` predicted values per row back; guided
/// predictions are `u + s·(c − u)`.
fn denoise(
    sampler: &Sampler,
    seed: u64,
    n: usize,
    k: usize,
    guidance_scale: f64,
    mut model: impl FnMut(Vec<f32>, f32) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    let guided = guidance_scale != 1.0;
    let sigma0 = sampler.init_noise_sigma();
    let mut x: Vec<f32> = (0..n * k)
        .map(|i| (sigma0 * tessera_runtime::init::normal(seed, 0x5a3_91e, i as u64)) as f32)
        .collect();
    for i in 0..sampler.timesteps.len() {
        let scaled = sampler.scale_model_input(i, &x);
        let mut model_in = scaled.clone();
        if guided {
            model_in.extend_from_slice(&scaled);
        }
        let out = model(model_in, sampler.timesteps[i] as f32)?;
        let pred: Vec<f32> = match guided {
            true => (0..n * k)
                .map(|j| {
                    let (c, u) = (f64::from(out[j]), f64::from(out[n * k + j]));
                    (u + guidance_scale * (c - u)) as f32
                })
                .collect(),
            false => out,
        };
        x = sampler.step(i, &pred, &x);
    }
    Ok(x)
}

/// A PNG of `rows × cols` images, `[-1, 1]` → 0..255, each pixel a `zoom × zoom` square, one
/// pixel of black between images: RGB for 3-channel images, else channel 0 in grey.
pub fn png_grid(
    images: &[f32],
    shape: [usize; 3],
    rows: usize,
    cols: usize,
    zoom: usize,
) -> Vec<u8> {
    let [c, h, w] = shape;
    let k: usize = shape.iter().product();
    let ch = if c == 3 { 3 } else { 1 };
    let (cell_h, cell_w) = (h * zoom + 1, w * zoom + 1);
    let (height, width) = (rows * cell_h + 1, cols * cell_w + 1);
    let mut pixels = vec![0u8; height * width * ch];
    for r in 0..rows {
        for col in 0..cols {
            let img = &images[(r * cols + col) * k..][..k];
            for y in 0..h * zoom {
                for xx in 0..w * zoom {
                    for q in 0..ch {
                        let v = img[(q * h + y / zoom) * w + xx / zoom];
                        let g = ((f64::from(v) + 1.0) * 127.5).round().clamp(0.0, 255.0) as u8;
                        let at = (r * cell_h + 1 + y) * width + col * cell_w + 1 + xx;
                        pixels[at * ch + q] = g;
                    }
                }
            }
        }
    }
    match ch {
        3 => crate::png::encode_rgb(&pixels, width, height),
        _ => crate::png::encode_grey(&pixels, width, height),
    }
}
