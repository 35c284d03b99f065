//! Diffusion Transformer (`DiTTransformer2DModel`, class-conditional, adaLN-Zero).
//!
//! Paper: Peebles & Xie 2023, "Scalable Diffusion Models with Transformers". Reference
//! implementation: diffusers `models/transformers/dit_transformer_2d.py` with
//! `BasicTransformerBlock` (`norm_type: ada_norm_zero`), `AdaLayerNormZero`,
//! `CombinedTimestepLabelEmbeddings` and `PatchEmbed`; the parameters carry diffusers' names.
//!
//! ```text
//! x_bnd = patchify(hidden_states) · pos_embed.proj.weightᵀ + bias + pos_nd   # stride-p conv
//! t_bf  = [cos(t·ω), sin(t·ω)]      ω_j = exp(−ln(10⁴)·j/(F/2 − 1)), F = 256 (flip, shift 1)
//! for each block (each has its own timestep and class embedders, as diffusers builds them):
//!     c_bd = linear_2(silu(linear_1(t_bf))) + class_embedder.embedding_table.weight[class_labels]
//!     shift/scale/gate (msa, mlp) = chunk₆(norm1.linear(silu(c_bd)))
//!     x += gate_msa · attn1(LN₁(x)·(1 + scale_msa) + shift_msa)          # LN without affine
//!     x += gate_mlp · ff(LN₃(x)·(1 + scale_mlp) + shift_mlp)             # gelu-tanh MLP, 4d
//! shift, scale = chunk₂(proj_out_1(silu(c_bd of block 0)))
//! out = unpatchify(proj_out_2(LN(x)·(1 + scale) + shift))               # [B, O, H, W]
//! loss = mean((out[:, :C] − target)²)  in f32        (out[:, C:] is the learned variance)
//! ```
//!
//! The fixed 2-D sin-cos position table is diffusers' `get_2d_sincos_pos_embed` (positions
//! `0..G` along each side, the first half of the width from the column index, the second
//! from the row index, each `[sin(p·ω), cos(p·ω)]` with `ω_k = 10⁴^(−k/(d/4))`). It is not a
//! weight (diffusers does not save it): it is computed in the graph from two constant vectors
//! (the positions and `ω`, scalar fills: the IR has no tensor literal) by an f32 outer product
//! and the IR's `sin`/`cos` (diffusers computes it in f64; the difference is below 1e-6).
//! The timestep frequencies `ω` are a constant vector of F/2 scalar fills, computed in f32 the
//! way diffusers computes them; `t·ω` is an f32 product, then `sin`/`cos`.
//!
//! Class labels index a table of `num_embeds_ada_norm + 1` rows: the last is diffusers' "null"
//! class (`class_dropout_prob` 0.1 > 0 always adds it), the condition classifier-free guidance
//! drops to. Dropping happens in the data (the objective), not in the graph.
//!
//! Shape suffixes: `b` batch, `c` channels, `n` patches (`g`×`g`), `d` hidden, `f` timestep
//! frequencies (256), `i` MLP width (4d), `o` output channels.
//!
//! FLOPs (2·m·n·k per matmul; attention as dense N×N products): forward per image =
//! 2·N·C·p²·d (patches) + L·[2·(256·d + d²) + 2·6d² + N·(8d² + 16d² + 4·N·d)] + 2·2d² +
//! 2·N·d·p²·O; training 3× that.

use crate::config::{count, positive};
use crate::error::{ModelError, Result};
use crate::nn::{self, Inputs, IrResult};
use crate::{BuildOptions, ForwardModel, InputKind, ModelConfig};
use serde::Serialize;
use serde_json::{Map, Value};
use tessera_ir::{AttentionSpec, Builder, DType, TensorId, UnaryOp};

/// The `_class_name` this module builds.
pub const DIT_CLASS_NAME: &str = "DiTTransformer2DModel";

/// Width of the sinusoidal timestep features (diffusers fixes it at 256 for DiT).
pub const TIMESTEP_FEATURES: usize = 256;

/// `DiTTransformer2DModel`'s architecture fields (diffusers' names and defaults).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DitParams {
    pub name: String,
    pub num_attention_heads: usize,
    pub attention_head_dim: usize,
    pub in_channels: usize,
    /// `None`: as many as `in_channels`; `2·in_channels` learns the variance (DiT's
    /// `learn_sigma`).
    pub out_channels: Option<usize>,
    pub num_layers: usize,
    /// Side of the (latent) image, square.
    pub sample_size: usize,
    pub patch_size: usize,
    /// Classes of the label embedding (a null class is added for guidance).
    pub num_embeds_ada_norm: usize,
    pub attention_bias: bool,
    /// `gelu-approximate` (tanh) or `gelu`.
    pub activation_fn: String,
    /// Epsilon of the MLP's layer norm (`norm3`); adaLN's own norms use 1e-6 as diffusers.
    pub norm_eps: f64,
    pub dtype: Option<DType>,
}

impl DitParams {
    /// DiT-XL/2 at 256 px (latent 32×32×4, learned sigma, 1000 ImageNet classes).
    pub fn xl_2(name: &str) -> DitParams {
        DitParams {
            name: name.to_string(),
            num_attention_heads: 16,
            attention_head_dim: 72,
            in_channels: 4,
            out_channels: Some(8),
            num_layers: 28,
            sample_size: 32,
            patch_size: 2,
            num_embeds_ada_norm: 1000,
            attention_bias: true,
            activation_fn: "gelu-approximate".into(),
            norm_eps: 1e-5,
            dtype: None,
        }
    }
}

/// A validated DiT configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DitConfig {
    pub name: String,
    pub num_attention_heads: usize,
    pub attention_head_dim: usize,
    pub in_channels: usize,
    pub out_channels: usize,
    pub num_layers: usize,
    pub sample_size: usize,
    pub patch_size: usize,
    pub num_classes: usize,
    pub attention_bias: bool,
    pub activation: UnaryOp,
    pub activation_fn: String,
    pub norm_eps: f64,
    pub dtype: Option<DType>,
}

impl DitConfig {
    pub fn new(p: DitParams) -> Result<DitConfig> {
        positive("num_attention_heads", p.num_attention_heads)?;
        positive("attention_head_dim", p.attention_head_dim)?;
        positive("in_channels", p.in_channels)?;
        positive("num_layers", p.num_layers)?;
        positive("patch_size", p.patch_size)?;
        positive("sample_size", p.sample_size)?;
        positive("num_embeds_ada_norm", p.num_embeds_ada_norm)?;
        if p.num_layers > crate::MAX_LAYERS {
            return Err(ModelError::invalid(
                "num_layers",
                format!("{} layers: at most {}", p.num_layers, crate::MAX_LAYERS),
            ));
        }
        // Sizes far beyond any model, refused before any product of them is taken.
        for (field, v, max) in [
            ("num_attention_heads", p.num_attention_heads, 1 << 16),
            ("attention_head_dim", p.attention_head_dim, 1 << 16),
            ("in_channels", p.in_channels, 1 << 16),
            ("out_channels", p.out_channels.unwrap_or(0), 1 << 17),
            ("sample_size", p.sample_size, 1 << 16),
            ("num_embeds_ada_norm", p.num_embeds_ada_norm, 1 << 30),
        ] {
            if v > max {
                return Err(ModelError::invalid(
                    field,
                    format!("{v} is beyond any model (at most {max}); check for a typo"),
                ));
            }
        }
        if !p.sample_size.is_multiple_of(p.patch_size) {
            return Err(ModelError::invalid(
                "sample_size",
                format!(
                    "sample_size {} is not divisible by patch_size {}; choose a patch size that \
                     divides the image side",
                    p.sample_size, p.patch_size
                ),
            ));
        }
        let inner = p.num_attention_heads * p.attention_head_dim;
        if !inner.is_multiple_of(4) {
            return Err(ModelError::invalid(
                "attention_head_dim",
                format!(
                    "the width heads × head_dim = {inner} must be a multiple of 4 (the 2-D sin-cos \
                     position table gives each axis a sin and a cos half)"
                ),
            ));
        }
        let out = p.out_channels.unwrap_or(p.in_channels);
        if out != p.in_channels && out != 2 * p.in_channels {
            return Err(ModelError::invalid(
                "out_channels",
                format!(
                    "{out} output channels: must be in_channels ({}) or twice that (a learned \
                     variance), so the prediction compares with the target",
                    p.in_channels
                ),
            ));
        }
        let activation = match p.activation_fn.as_str() {
            "gelu-approximate" => UnaryOp::GeluTanh,
            "gelu" => UnaryOp::Gelu,
            other => {
                return Err(ModelError::Unsupported {
                    what: "activation_fn".into(),
                    found: other.into(),
                    supported: "gelu-approximate, gelu".into(),
                })
            }
        };
        if !(p.norm_eps.is_finite() && p.norm_eps > 0.0) {
            return Err(ModelError::invalid("norm_eps", "must be a small positive number"));
        }
        let cfg = DitConfig {
            name: p.name,
            num_attention_heads: p.num_attention_heads,
            attention_head_dim: p.attention_head_dim,
            in_channels: p.in_channels,
            out_channels: out,
            num_layers: p.num_layers,
            sample_size: p.sample_size,
            patch_size: p.patch_size,
            num_classes: p.num_embeds_ada_norm,
            attention_bias: p.attention_bias,
            activation,
            activation_fn: p.activation_fn,
            norm_eps: p.norm_eps,
            dtype: p.dtype,
        };
        match cfg.count() {
            Some(n) if n <= crate::MAX_PARAMETERS => Ok(cfg),
            _ => Err(ModelError::invalid(
                "config",
                "the model would have more than 2^50 parameters; check the sizes for a typo",
            )),
        }
    }

    /// The transformer width, heads × head dim.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }
    /// Patches per side.
    pub fn grid(&self) -> usize {
        self.sample_size / self.patch_size
    }
    /// Tokens per image.
    pub fn num_patches(&self) -> usize {
        self.grid() * self.grid()
    }
    /// Whether the output carries a learned variance beside the prediction.
    pub fn learn_sigma(&self) -> bool {
        self.out_channels == 2 * self.in_channels
    }
    pub fn num_parameters(&self) -> u64 {
        self.count().map_or(u64::MAX, |n| n as u64)
    }

    /// The `config.json` diffusers' `save_pretrained` writes for this model (read back by
    /// [`from_diffusers`]).
    pub fn to_diffusers_json(&self) -> Value {
        let mut map = serde_json::json!({
            "_class_name": DIT_CLASS_NAME,
            "_name_or_path": self.name,
            "num_attention_heads": self.num_attention_heads,
            "attention_head_dim": self.attention_head_dim,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "num_layers": self.num_layers,
            "dropout": 0.0,
            "norm_num_groups": 32,
            "attention_bias": self.attention_bias,
            "sample_size": self.sample_size,
            "patch_size": self.patch_size,
            "activation_fn": self.activation_fn,
            "num_embeds_ada_norm": self.num_classes,
            "upcast_attention": false,
            "norm_type": "ada_norm_zero",
            "norm_elementwise_affine": false,
            "norm_eps": self.norm_eps,
        });
        // diffusers writes no dtype; one a config states is kept.
        let dtype = match self.dtype {
            Some(DType::BF16) => Some("bfloat16"),
            Some(DType::F16) => Some("float16"),
            Some(DType::F32) => Some("float32"),
            _ => None,
        };
        if let Some(d) = dtype {
            map["torch_dtype"] = Value::from(d);
        }
        map
    }

    fn count(&self) -> Option<u128> {
        let (d, c, p, o) = (self.inner_dim(), self.in_channels, self.patch_size, self.out_channels);
        let (f, bias) = (TIMESTEP_FEATURES, usize::from(self.attention_bias));
        let per_block = count(&[
            // norm1.emb: timestep_embedder (linear_1, linear_2), class table (+ null row)
            &[f, d],
            &[d],
            &[d, d],
            &[d],
            &[self.num_classes + 1, d],
            // norm1.linear
            &[d, 6 * d],
            &[6 * d],
            // attn1: q, k, v (bias by attention_bias), to_out.0 (bias)
            &[3, d, d],
            &[3, bias, d],
            &[d, d],
            &[d],
            // ff: net.0.proj, net.2
            &[d, 4 * d],
            &[4 * d],
            &[4 * d, d],
            &[d],
        ])?;
        let blocks = per_block.checked_mul(self.num_layers as u128)?;
        let rest =
            count(&[&[d, c, p, p], &[d], &[d, 2 * d], &[2 * d], &[d, p * p * o], &[p * p * o]])?;
        blocks.checked_add(rest)
    }
}

/// A diffusers `config.json` of `DiTTransformer2DModel` (read by `_class_name`). Settings this
/// module does not build are refused by name when they differ from diffusers' defaults.
pub(crate) fn from_diffusers(map: &Map<String, Value>, name: String) -> Result<ModelConfig> {
    let f = DiffusersFields(map);
    let mut p = DitParams::xl_2(&name);
    p.out_channels = None;
    f.set_usize("num_attention_heads", &mut p.num_attention_heads)?;
    f.set_usize("attention_head_dim", &mut p.attention_head_dim)?;
    f.set_usize("in_channels", &mut p.in_channels)?;
    if let Some(o) = f.usize("out_channels")? {
        p.out_channels = Some(o);
    }
    f.set_usize("num_layers", &mut p.num_layers)?;
    f.set_usize("sample_size", &mut p.sample_size)?;
    f.set_usize("patch_size", &mut p.patch_size)?;
    f.set_usize("num_embeds_ada_norm", &mut p.num_embeds_ada_norm)?;
    if let Some(b) = f.bool("attention_bias")? {
        p.attention_bias = b;
    }
    if let Some(a) = f.str("activation_fn")? {
        p.activation_fn = a.to_string();
    }
    if let Some(e) = f.f64("norm_eps")? {
        p.norm_eps = e;
    }
    // Settings with one supported value.
    if let Some(t) = f.str("norm_type")? {
        if t != "ada_norm_zero" {
            return Err(unsupported("norm_type", t, "ada_norm_zero"));
        }
    }
    if f.bool("norm_elementwise_affine")? == Some(true) {
        return Err(unsupported("norm_elementwise_affine", "true", "false"));
    }
    if let Some(dropout) = f.f64("dropout")? {
        if dropout != 0.0 {
            return Err(unsupported("dropout", &dropout.to_string(), "0.0"));
        }
    }
    p.dtype = match f.str("torch_dtype")? {
        Some("float32") => Some(DType::F32),
        Some("bfloat16") => Some(DType::BF16),
        Some("float16") => Some(DType::F16),
        _ => None,
    };
    Ok(ModelConfig::Dit(DitConfig::new(p)?))
}

fn unsupported(what: &str, found: &str, supported: &str) -> ModelError {
    ModelError::Unsupported { what: what.into(), found: found.into(), supported: supported.into() }
}

/// Typed reads of a diffusers config's fields (`null` reads as absent).
struct DiffusersFields<'a>(&'a Map<String, Value>);

impl DiffusersFields<'_> {
    fn value(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }
    fn wrong(key: &str, expected: &str, v: &Value) -> ModelError {
        ModelError::invalid(key, format!("must be {expected}, got {v}"))
    }
    fn usize(&self, key: &str) -> Result<Option<usize>> {
        self.value(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| Self::wrong(key, "a non-negative integer", v))
            })
            .transpose()
    }
    fn set_usize(&self, key: &str, dst: &mut usize) -> Result<()> {
        if let Some(v) = self.usize(key)? {
            *dst = v;
        }
        Ok(())
    }
    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.value(key)
            .map(|v| v.as_f64().ok_or_else(|| Self::wrong(key, "a number", v)))
            .transpose()
    }
    fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.value(key)
            .map(|v| v.as_bool().ok_or_else(|| Self::wrong(key, "true or false", v)))
            .transpose()
    }
    fn str(&self, key: &str) -> Result<Option<&str>> {
        self.value(key)
            .map(|v| v.as_str().ok_or_else(|| Self::wrong(key, "a string", v)))
            .transpose()
    }
}

// ---- the graph -------------------------------------------------------------------------------

/// The conditioning of one block: `[B, D]` (timestep embedding + class embedding).
struct Condition {
    t_bf: TensorId,
    labels_b: TensorId,
}

pub(crate) fn build(cfg: &DitConfig, opts: &BuildOptions) -> Result<ForwardModel> {
    let (batch, dtype) = (opts.batch, opts.dtype);
    let (c, side, o) = (cfg.in_channels, cfg.sample_size, cfg.out_channels);
    let (p, g, n, d) = (cfg.patch_size, cfg.grid(), cfg.num_patches(), cfg.inner_dim());

    let mut b = Builder::new();
    let mut inputs = Inputs::new();
    let x_bchw =
        inputs.add(&mut b, "hidden_states", [batch, c, side, side], dtype, InputKind::Pixels);
    let kind = InputKind::Timesteps;
    let t_b = inputs.add(&mut b, "timestep", [batch], DType::F32, kind);
    let kind = InputKind::ClassLabels { num_classes: cfg.num_classes };
    let labels_b = inputs.add(&mut b, "class_labels", [batch], DType::I64, kind);
    let target = inputs.add(&mut b, "target", [batch, c, side, side], dtype, InputKind::Targets);

    // Patch embedding (the stride-p conv as a matmul, patches row-major) + position table.
    let x_bnd = b.scoped("pos_embed", |b| {
        b.scoped("proj", |b| {
            let w_dcpp = b.parameter("weight", [d, c, p, p], dtype);
            let bias_d = b.parameter("bias", [d], dtype);
            let x = b.reshape(x_bchw, [batch, c, g, p, g, p])?;
            let x = b.permute(x, &[0, 2, 4, 1, 3, 5])?;
            let x_bnk = b.reshape(x, [batch, n, c * p * p])?;
            let w_dk = b.reshape(w_dcpp, [d, c * p * p])?;
            let y_bnd = b.matmul(x_bnk, w_dk, false, true)?;
            b.add(y_bnd, bias_d)
        })
    })?;
    let pos_1nd = position_table(&mut b, g, d, dtype)?;
    let mut x_bnd = b.add(x_bnd, pos_1nd)?;

    let t_bf = timestep_features(&mut b, t_b, dtype)?;
    let cond = Condition { t_bf, labels_b };
    let mut c0_bd = None;
    for layer in 0..cfg.num_layers {
        b.set_block(Some(layer as u32));
        b.push_scope(format!("transformer_blocks.{layer}"));
        let (x, c_bd) = block(&mut b, cfg, &cond, x_bnd)?;
        x_bnd = x;
        c0_bd.get_or_insert(c_bd);
        b.pop_scope();
    }
    b.set_block(None);
    let c0_bd = c0_bd.ok_or_else(|| ModelError::invalid("num_layers", "must be at least 1"))?;

    // Final adaLN modulation, projection and unpatchify (einsum nhwpqc → nchpwq).
    let s_bd = b.unary(UnaryOp::Silu, c0_bd)?;
    let mod_b2d = nn::linear(&mut b, "proj_out_1", s_bd, 2 * d, true)?;
    let shift = chunk(&mut b, mod_b2d, 0, d)?;
    let scale = chunk(&mut b, mod_b2d, 1, d)?;
    let h_bnd = plain_layer_norm(&mut b, x_bnd, 1e-6)?;
    let h_bnd = modulate(&mut b, h_bnd, shift, scale)?;
    let y_bnk = nn::linear(&mut b, "proj_out_2", h_bnd, p * p * o, true)?;
    let y = b.reshape(y_bnk, [batch, g, g, p, p, o])?;
    let y = b.permute(y, &[0, 5, 1, 3, 2, 4])?;
    let out_bohw = b.reshape(y, [batch, o, side, side])?;

    // The loss: the f32 mean squared error of the prediction (the first C channels).
    let pred = if cfg.learn_sigma() { b.slice(out_bohw, 1, 0, c)? } else { out_bohw };
    let loss = mse(&mut b, pred, target)?;
    Ok(ForwardModel { builder: b, loss, logits: out_bohw, batch, seq: n, inputs: inputs.list })
}

/// `mean((pred − target)²)` in f32.
pub(crate) fn mse(b: &mut Builder, pred: TensorId, target: TensorId) -> IrResult<TensorId> {
    let pred = nn::to(b, pred, DType::F32)?;
    let target = nn::to(b, target, DType::F32)?;
    let diff = b.sub(pred, target)?;
    let sq = b.mul(diff, diff)?;
    let dims: Vec<usize> = (0..b.shape(sq).rank()).collect();
    b.reduce(tessera_ir::ReduceOp::Mean, sq, &dims, false)
}

/// One `BasicTransformerBlock` with adaLN-Zero; returns the new residual stream and the
/// block's conditioning `[B, D]`.
fn block(
    b: &mut Builder,
    cfg: &DitConfig,
    cond: &Condition,
    x_bnd: TensorId,
) -> IrResult<(TensorId, TensorId)> {
    let d = cfg.inner_dim();
    let (c_bd, mod_b6d) = b.scoped("norm1", |b| {
        let c_bd = b.scoped("emb", |b| {
            let te_bd = b.scoped("timestep_embedder", |b| {
                let h = nn::linear(b, "linear_1", cond.t_bf, d, true)?;
                let h = b.unary(UnaryOp::Silu, h)?;
                nn::linear(b, "linear_2", h, d, true)
            })?;
            let ce_bd = b.scoped("class_embedder.embedding_table", |b| {
                let table = b.parameter("weight", [cfg.num_classes + 1, d], b.dtype(te_bd));
                b.embedding(table, cond.labels_b)
            })?;
            b.add(te_bd, ce_bd)
        })?;
        let s_bd = b.unary(UnaryOp::Silu, c_bd)?;
        let mod_b6d = nn::linear(b, "linear", s_bd, 6 * d, true)?;
        Ok::<_, tessera_ir::IrError>((c_bd, mod_b6d))
    })?;
    let [shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp] =
        [0, 1, 2, 3, 4, 5].map(|k| chunk(b, mod_b6d, k, d));
    let h_bnd = plain_layer_norm(b, x_bnd, 1e-6)?;
    let h_bnd = modulate(b, h_bnd, shift_msa?, scale_msa?)?;
    let a_bnd = b.scoped("attn1", |b| {
        let (heads, e) = (cfg.num_attention_heads, cfg.attention_head_dim);
        let q = nn::linear(b, "to_q", h_bnd, d, cfg.attention_bias)?;
        let k = nn::linear(b, "to_k", h_bnd, d, cfg.attention_bias)?;
        let v = nn::linear(b, "to_v", h_bnd, d, cfg.attention_bias)?;
        let q = nn::split_heads(b, q, heads)?;
        let k = nn::split_heads(b, k, heads)?;
        let v = nn::split_heads(b, v, heads)?;
        let spec = AttentionSpec { causal: false, ..AttentionSpec::causal(e) };
        let o = b.attention(q, k, v, spec)?;
        let o = nn::merge_heads(b, o)?;
        nn::linear(b, "to_out.0", o, d, true)
    })?;
    let a_bnd = b.mul(gate_msa?, a_bnd)?;
    let x_bnd = b.add(x_bnd, a_bnd)?;
    let h_bnd = plain_layer_norm(b, x_bnd, cfg.norm_eps)?;
    let h_bnd = modulate(b, h_bnd, shift_mlp?, scale_mlp?)?;
    let f_bnd = b.scoped("ff.net", |b| {
        let u = nn::linear(b, "0.proj", h_bnd, 4 * d, true)?;
        let u = b.unary(cfg.activation, u)?;
        nn::linear(b, "2", u, d, true)
    })?;
    let f_bnd = b.mul(gate_mlp?, f_bnd)?;
    Ok((b.add(x_bnd, f_bnd)?, c_bd))
}

/// Chunk `k` of width `d` of `[B, m·d]`, as `[B, 1, d]` (broadcast over the patches).
fn chunk(b: &mut Builder, x_bm: TensorId, k: usize, d: usize) -> IrResult<TensorId> {
    let batch = b.shape(x_bm).dim(0);
    let s = b.slice(x_bm, 1, k * d, (k + 1) * d)?;
    b.reshape(s, [batch, 1, d])
}

/// `x·(1 + scale) + shift` with per-sample `[B, 1, D]` scale and shift.
fn modulate(b: &mut Builder, x: TensorId, shift: TensorId, scale: TensorId) -> IrResult<TensorId> {
    let one = b.scalar_like(1.0, scale)?;
    let s = b.add(scale, one)?;
    let y = b.mul(x, s)?;
    b.add(y, shift)
}

/// A layer norm over the last dim without affine parameters (`elementwise_affine=False`).
fn plain_layer_norm(b: &mut Builder, x: TensorId, eps: f64) -> IrResult<TensorId> {
    let (dim, dtype) = (b.shape(x).last(), b.dtype(x));
    let w = b.fill(1.0, [dim], dtype)?;
    let bias = b.fill(0.0, [dim], dtype)?;
    b.layer_norm(x, w, bias, eps)
}

/// diffusers' `get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=1)`:
/// `[cos(t·ω), sin(t·ω)]`, in the model dtype. `ω` is computed in f32 as diffusers does
/// (`exp(−ln(10⁴)·j / (F/2 − 1))`) and enters the graph as a constant vector.
fn timestep_features(b: &mut Builder, t_b: TensorId, dtype: DType) -> IrResult<TensorId> {
    let half = TIMESTEP_FEATURES / 2;
    let batch = b.shape(t_b).dim(0);
    let scale = -(10000f64.ln() as f32);
    let freqs: Vec<f64> =
        (0..half).map(|j| f64::from(((scale * j as f32) / (half as f32 - 1.0)).exp())).collect();
    let w_1h = constant_vector(b, &freqs)?;
    let w_1h = b.reshape(w_1h, [1, half])?;
    let t_b1 = b.reshape(t_b, [batch, 1])?;
    let arg_bh = b.matmul(t_b1, w_1h, false, false)?;
    let cos = b.unary(UnaryOp::Cos, arg_bh)?;
    let sin = b.unary(UnaryOp::Sin, arg_bh)?;
    let t_bf = b.concat(&[cos, sin], 1)?;
    nn::to(b, t_bf, dtype)
}

/// A constant f32 vector: a concatenation of scalar fills (the IR has no tensor literal; used
/// once per graph for the timestep frequencies, the positions and the position frequencies).
fn constant_vector(b: &mut Builder, values: &[f64]) -> IrResult<TensorId> {
    let parts = values.iter().map(|&v| b.fill(v, [1], DType::F32)).collect::<IrResult<Vec<_>>>()?;
    b.concat(&parts, 0)
}

/// diffusers' `get_2d_sincos_pos_embed(d, g)` as `[1, g·g, d]` in `dtype`: token `(i, j)`
/// (row, column) holds `[sin(j·ω), cos(j·ω), sin(i·ω), cos(i·ω)]`, `ω_k = 10⁴^(−k/(d/4))`.
fn position_table(b: &mut Builder, g: usize, d: usize, dtype: DType) -> IrResult<TensorId> {
    let quarter = d / 4;
    let omega: Vec<f64> =
        (0..quarter).map(|k| 1.0 / 10000f64.powf(k as f64 / quarter as f64)).collect();
    // [sin(p·ω), cos(p·ω)] at positions p = 0..g: an f32 outer product of two constant
    // vectors, then the IR's sin and cos.
    let positions: Vec<f64> = (0..g).map(|p| p as f64).collect();
    let p_g1 = constant_vector(b, &positions)?;
    let p_g1 = b.reshape(p_g1, [g, 1])?;
    let w_1q = constant_vector(b, &omega)?;
    let w_1q = b.reshape(w_1q, [1, quarter])?;
    let arg_gq = b.matmul(p_g1, w_1q, false, false)?;
    let sin = b.unary(UnaryOp::Sin, arg_gq)?;
    let cos = b.unary(UnaryOp::Cos, arg_gq)?;
    let e = b.concat(&[sin, cos], 1)?;
    let e_gh = b.reshape(e, [g, d / 2])?;
    let cols = b.reshape(e_gh, [1, g, d / 2])?;
    let cols = b.expand(cols, [g, g, d / 2])?;
    let rows = b.reshape(e_gh, [g, 1, d / 2])?;
    let rows = b.expand(rows, [g, g, d / 2])?;
    let table = b.concat(&[cols, rows], 2)?;
    let table = b.reshape(table, [1, g * g, d])?;
    nn::to(b, table, dtype)
}
