//! Stable Diffusion's frozen components around the UNet: a diffusers pipeline directory
//! (`unet/`, `vae/`, `text_encoder/`, `tokenizer/`, `scheduler/`) gives `train --model
//! PIPE/unet` its data and `sample --model-dir PIPE/unet` its pictures.
//!
//! - Training ([`text_latents`]): the `--data` folder's pictures ([`PictureFolder`], prepared
//!   at the VAE's image side: the UNet's `sample_size` × the VAE's downscale factor) are
//!   encoded by the VAE's encoder to the latent mean × `scaling_factor`, and their captions
//!   (and the empty caption, for classifier-free guidance) tokenized and encoded by the CLIP
//!   text encoder, once, before the first step. Both run as forward Programs of their own on
//!   this process (as `eval` runs them), so they are no part of the training Program: no
//!   gradients, no optimizer state, no memory in the plan — the profiler counts the UNet.
//! - Sampling ([`Frozen`], used by `sample`): prompts to text states the same way, the UNet's
//!   loop, then latents ÷ `scaling_factor` through the VAE's decoder to RGB pictures.
//!
//! A UNet without a `vae/` beside it trains on the pictures themselves (pixel space; its
//! `in_channels` must be 3). A text encoder and tokenizer are required: this UNet family is
//! text-conditioned.

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use std::path::{Path, PathBuf};
use tessera_ir::{DType, Graph, Program, TensorId};
use tessera_models::{
    build, BuildOptions, ClipTextConfig, ModelConfig, UNetConfig, VaeConfig, VaePart,
};
use tessera_runtime::collective::DeviceMesh;
use tessera_runtime::diffusion_text::{CaptionTokenizer, TextLatents};
use tessera_runtime::hf_weights::open_weights;
use tessera_runtime::picture_folder::{Needs, PictureFolder};
use tessera_runtime::tensor::{candle_dtype, from_vec, to_f64_vec};
use tessera_runtime::{CpuBackend, Executor};

/// Rows per frozen forward pass (the last pass is padded by repeating its first row).
const CHUNK: usize = 4;

/// The pipeline components beside a UNet's directory.
pub struct Pipeline {
    pub vae: Option<(PathBuf, VaeConfig)>,
    pub text_encoder: (PathBuf, ClipTextConfig),
    pub tokenizer: CaptionTokenizer,
}

impl Pipeline {
    /// The components in `unet_dir`'s parent (diffusers' layout).
    pub fn beside(unet_dir: &Path) -> Result<Pipeline> {
        let root =
            unet_dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let te_dir = root.join("text_encoder");
        if !te_dir.join("config.json").is_file() {
            bail!(
                "{}: a UNet2DConditionModel is text-conditioned, and there is no \
                 text_encoder/config.json beside it; pass the `unet/` folder of a diffusers \
                 pipeline (with text_encoder/, tokenizer/ and, for a latent model, vae/)",
                unet_dir.display()
            );
        }
        let text = match ModelConfig::from_path(&te_dir)? {
            ModelConfig::ClipText(c) => c,
            other => bail!("{}: a {}, not CLIP's text encoder", te_dir.display(), other.family()),
        };
        let tokenizer =
            CaptionTokenizer::open(&root.join("tokenizer"), text.max_position_embeddings)?;
        let vae_dir = root.join("vae");
        let vae = match vae_dir.join("config.json").is_file() {
            true => match ModelConfig::from_path(&vae_dir)? {
                ModelConfig::Vae(c) => Some((vae_dir, c)),
                other => bail!("{}: a {}, not an AutoencoderKL", vae_dir.display(), other.family()),
            },
            false => None,
        };
        Ok(Pipeline { vae, text_encoder: (te_dir, text), tokenizer })
    }

    /// Checks the components fit `unet`; returns the picture side.
    pub fn picture_side(&self, unet: &UNetConfig) -> Result<usize> {
        let (_, text) = &self.text_encoder;
        if text.hidden_size != unet.cross_attention_dim {
            bail!(
                "the text encoder's states are {} wide, but the UNet's cross_attention_dim is {}",
                text.hidden_size,
                unet.cross_attention_dim
            );
        }
        match &self.vae {
            Some((dir, vae)) => {
                if vae.latent_channels != unet.in_channels {
                    bail!(
                        "{}: latent_channels {} but the UNet takes {} channels",
                        dir.display(),
                        vae.latent_channels,
                        unet.in_channels
                    );
                }
                Ok(unet.sample_size * vae.downscale())
            }
            None if unet.in_channels == 3 => Ok(unet.sample_size),
            None => bail!(
                "the UNet takes {} channels and there is no vae/ beside it to encode pictures to \
                 latents (a pixel-space UNet takes 3)",
                unet.in_channels
            ),
        }
    }

    /// `texts`' CLIP states, `[texts.len(), L, hidden]` flat.
    pub fn encode_text(&self, texts: &[&str]) -> Result<Vec<f32>> {
        let (dir, text) = &self.text_encoder;
        let l = self.tokenizer.max_length;
        let ids = self.tokenizer.encode(texts)?;
        let cfg = ModelConfig::ClipText(text.clone());
        let mut frozen = Frozen::new(&cfg, dir, texts.len().min(CHUNK), l)?;
        frozen.map_rows(texts.len(), |rows| Ok(vec![("input_ids", rows_i64(&ids, rows, l)?)]))
    }

    /// `pixels` (`[n, 3, side, side]` in `[-1, 1]`) to the UNet's inputs: latent mean ×
    /// `scaling_factor`, or the pixels themselves without a VAE.
    pub fn encode_pictures(&self, pixels: &[f32], n: usize, side: usize) -> Result<Vec<f32>> {
        let Some((dir, vae)) = &self.vae else { return Ok(pixels.to_vec()) };
        let cfg = ModelConfig::Vae(vae.with_part(VaePart::Encoder).with_sample_size(side)?);
        let mut frozen = Frozen::new(&cfg, dir, n.min(CHUNK), 1)?;
        let k = 3 * side * side;
        let dims = |b: usize| vec![b, 3, side, side];
        let mean = frozen.map_rows(n, |rows| {
            let v: Vec<f32> =
                rows.iter().flat_map(|&r| pixels[r * k..(r + 1) * k].to_vec()).collect();
            Ok(vec![("sample", from_vec(v, &dims(rows.len()))?)])
        })?;
        let s = vae.scaling_factor as f32;
        Ok(mean.into_iter().map(|v| v * s).collect())
    }

    /// Latents (`[n, C, h, w]`, scaled) to pictures `[n, 3, h·f, w·f]` in the VAE's units.
    pub fn decode(&self, latents: &[f32], n: usize, latent_side: usize) -> Result<Vec<f32>> {
        let Some((dir, vae)) = &self.vae else { return Ok(latents.to_vec()) };
        let side = latent_side * vae.downscale();
        let cfg = ModelConfig::Vae(vae.with_part(VaePart::Decoder).with_sample_size(side)?);
        let mut frozen = Frozen::new(&cfg, dir, n.min(CHUNK), 1)?;
        let c = vae.latent_channels;
        let k = c * latent_side * latent_side;
        let s = vae.scaling_factor as f32;
        frozen.map_rows(n, |rows| {
            let v: Vec<f32> = rows
                .iter()
                .flat_map(|&r| latents[r * k..(r + 1) * k].iter().map(|x| x / s))
                .collect();
            Ok(vec![("z", from_vec(v, &[rows.len(), c, latent_side, latent_side])?)])
        })
    }
}

fn rows_i64(ids: &[i64], rows: &[usize], l: usize) -> Result<Tensor> {
    let v: Vec<i64> = rows.iter().flat_map(|&r| ids[r * l..(r + 1) * l].to_vec()).collect();
    Ok(from_vec(v, &[rows.len(), l])?)
}

/// A frozen module's forward Program on one device, weights bound from its directory.
pub struct Frozen {
    exec: Executor<CpuBackend>,
    graph: Graph,
    inputs: Vec<(String, TensorId)>,
    output: TensorId,
    batch: usize,
}

impl Frozen {
    pub fn new(cfg: &ModelConfig, dir: &Path, batch: usize, seq: usize) -> Result<Frozen> {
        let fm = build(cfg, &BuildOptions::new(batch, seq, DType::F32))?;
        let inputs = fm.inputs.iter().map(|i| (i.name.to_string(), i.tensor)).collect();
        let output = fm.logits;
        let graph = fm.builder.finish();
        // The checkpoint holds the whole autoencoder: a VAE's part is checked against both.
        let base = match cfg {
            ModelConfig::Vae(c) if c.part != VaePart::Autoencoder => {
                let whole = ModelConfig::Vae(c.with_part(VaePart::Autoencoder));
                build(&whole, &BuildOptions::new(batch, seq, DType::F32))?.builder.finish()
            }
            _ => graph.clone(),
        };
        let weights = open_weights(dir, &base)
            .with_context(|| format!("{}: the weights of {}", dir.display(), cfg.name()))?;
        let program = Program::lower_graph(graph.clone(), vec![output], &[]);
        let mut exec = Executor::new(program, CpuBackend::new(0), None);
        let mesh = DeviceMesh::single();
        for p in graph.parameters() {
            let name = graph.tensor_scope(p);
            let whole = vec![Vec::new(); graph.shape(p).rank()];
            let dtype = candle_dtype(graph.meta(p).dtype);
            let v = weights.shard_of(name, &whole, &mesh, dtype)?;
            exec.bind(p, v.with_context(|| format!("{}: no value for {name}", dir.display()))?)?;
        }
        Ok(Frozen { exec, graph, inputs, output, batch })
    }

    /// The output on `feeds` (the inputs not fed are zeros: the loss's).
    pub fn run(&mut self, feeds: Vec<(&str, Tensor)>) -> Result<Vec<f32>> {
        for (name, t) in &self.inputs {
            let value = match feeds.iter().find(|(n, _)| n == name) {
                Some((_, v)) => v.clone(),
                None => {
                    let dtype = candle_dtype(self.graph.meta(*t).dtype);
                    Tensor::zeros(self.graph.shape(*t).dims(), dtype, &Device::Cpu)?
                }
            };
            self.exec.bind(*t, value)?;
        }
        self.exec.run()?;
        let out = self.exec.get(self.output).context("the output was not kept")?;
        Ok(to_f64_vec(out)?.into_iter().map(|v| v as f32).collect())
    }

    /// The outputs of `n` rows (`k` output values each), `self.batch` rows a pass: `feed` makes
    /// a pass's inputs from its row indices.
    fn map_rows(
        &mut self,
        n: usize,
        mut feed: impl FnMut(&[usize]) -> Result<Vec<(&'static str, Tensor)>>,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        for start in (0..n).step_by(self.batch) {
            let real = (n - start).min(self.batch);
            let rows: Vec<usize> = (0..self.batch).map(|i| start + i.min(real - 1)).collect();
            let values = self.run(feed(&rows)?)?;
            let per = values.len() / self.batch;
            out.extend_from_slice(&values[..real * per]);
        }
        Ok(out)
    }
}

/// `--data DIR` for a text-conditioned UNet: the folder's pictures and captions encoded by
/// the frozen components beside `unet_dir`.
pub fn text_latents(unet_dir: &Path, unet: &UNetConfig, data: &Path) -> Result<TextLatents> {
    let pipe = Pipeline::beside(unet_dir)?;
    let side = pipe.picture_side(unet)?;
    let folder = PictureFolder::load(data, side, Needs::Captions)?;
    let n = folder.len();
    let latents = pipe.encode_pictures(&folder.pixels, n, side)?;
    let captions: Vec<&str> = folder.captions.iter().map(|c| c.as_deref().unwrap_or("")).collect();
    let states = pipe.encode_text(&captions)?;
    let null_states = pipe.encode_text(&[""])?;
    let s = unet.sample_size;
    let data = TextLatents {
        source: folder.source,
        latents,
        shape: [unet.in_channels, s, s],
        states,
        null_states,
        seq: pipe.tokenizer.max_length,
        dim: unet.cross_attention_dim,
    };
    data.validate()?;
    Ok(data)
}
