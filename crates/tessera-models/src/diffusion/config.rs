//! The validated configuration of diffusers' `UNet2DConditionModel` (the fields of its
//! `config.json` that shape the network), and its parsing from that file.
//!
//! Settings this crate does not build (class or addition embeddings, dual or cross-only
//! attention, other block types, scale-shift time conditioning, ...) are refused by name when
//! they differ from diffusers' defaults, so a config is either built exactly or not at all.

use crate::config::positive;
use crate::error::{ModelError, Result};
use serde::Serialize;
use serde_json::{Map, Value};
use tessera_ir::DType;

/// The `_class_name`s of diffusers models this crate builds.
pub const SUPPORTED_CLASS_NAMES: &[&str] =
    &["UNet2DConditionModel", "AutoencoderKL", "DiTTransformer2DModel"];

/// One of the down path's blocks (`down_block_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum DownBlock {
    /// `CrossAttnDownBlock2D`: resnets, each followed by a `Transformer2DModel`.
    CrossAttn,
    /// `DownBlock2D`: resnets only.
    Plain,
}

/// One of the up path's blocks (`up_block_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum UpBlock {
    /// `CrossAttnUpBlock2D`.
    CrossAttn,
    /// `UpBlock2D`.
    Plain,
}

/// `UNet2DConditionModel`'s architecture fields (diffusers' names).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UNetParams {
    pub name: String,
    /// Latent side the model was trained at (`sample_size`, square); the graph's default.
    pub sample_size: usize,
    pub in_channels: usize,
    pub out_channels: usize,
    pub center_input_sample: bool,
    pub flip_sin_to_cos: bool,
    pub freq_shift: f64,
    pub down_block_types: Vec<DownBlock>,
    pub up_block_types: Vec<UpBlock>,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: usize,
    pub downsample_padding: usize,
    pub mid_block_scale_factor: f64,
    pub norm_num_groups: usize,
    pub norm_eps: f64,
    /// Width of the text states (`encoder_hidden_states`' last dim).
    pub cross_attention_dim: usize,
    /// Attention heads per down block (diffusers' `attention_head_dim`, which is the head
    /// count: an int for every block, or one per block as SD 2 writes it). The up path uses
    /// them reversed, the mid block the last.
    pub heads: Vec<usize>,
    pub transformer_layers_per_block: usize,
    /// `proj_in`/`proj_out` are `nn.Linear` (SD 2) rather than 1×1 convolutions (SD 1.x).
    pub use_linear_projection: bool,
    /// Width of the time embedding (`time_embedding_dim`, default 4 · block_out_channels[0]).
    pub time_embed_dim: usize,
    pub dtype: Option<DType>,
}

/// A validated `UNet2DConditionModel` configuration, with its parameter count.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UNetConfig {
    #[serde(flatten)]
    params: UNetParams,
    num_parameters: u64,
}

impl std::ops::Deref for UNetConfig {
    type Target = UNetParams;
    fn deref(&self) -> &UNetParams {
        &self.params
    }
}

impl UNetConfig {
    /// Validates `params` (and builds the smallest graph once, which counts the parameters):
    /// the only way to obtain this type.
    pub fn new(params: UNetParams) -> Result<UNetConfig> {
        params.validate()?;
        let mut cfg = UNetConfig { params, num_parameters: 0 };
        let n = super::unet_parameters(&cfg)?;
        crate::config::within_bound(Some(u128::from(n)))?;
        cfg.num_parameters = n;
        Ok(cfg)
    }
    pub fn params(&self) -> &UNetParams {
        &self.params
    }
    pub fn into_params(self) -> UNetParams {
        self.params
    }
    /// Trainable parameters (diffusers' `sum(p.numel() for p in unet.parameters())`).
    pub fn num_parameters(&self) -> u64 {
        self.num_parameters
    }

    /// The same model on `side × side` samples (`--image-size`): a multiple of
    /// 2^(down blocks − 1).
    pub fn with_sample_size(&self, side: usize) -> Result<UNetConfig> {
        let mut params = self.params.clone();
        params.sample_size = side;
        params.validate()?;
        Ok(UNetConfig { params, num_parameters: self.num_parameters })
    }

    /// Repeated blocks (each resnet with its attention, the mid block as one): the graph's
    /// block indices.
    pub fn num_blocks(&self) -> usize {
        let n = self.block_out_channels.len();
        n * self.layers_per_block + 1 + n * (self.layers_per_block + 1)
    }

    /// How much the down path shrinks the sample: 2^(downsamplers).
    pub fn downscale(&self) -> usize {
        1 << (self.block_out_channels.len() - 1)
    }
}

impl UNetConfig {
    /// The diffusers `config.json` of this UNet (what `save_pretrained` writes, the keys that
    /// shape the network).
    pub fn to_diffusers_json(&self) -> Value {
        let down: Vec<&str> = self
            .down_block_types
            .iter()
            .map(|k| match k {
                DownBlock::CrossAttn => "CrossAttnDownBlock2D",
                DownBlock::Plain => "DownBlock2D",
            })
            .collect();
        let up: Vec<&str> = self
            .up_block_types
            .iter()
            .map(|k| match k {
                UpBlock::CrossAttn => "CrossAttnUpBlock2D",
                UpBlock::Plain => "UpBlock2D",
            })
            .collect();
        let dtype = match self.dtype {
            Some(DType::BF16) => "bfloat16",
            Some(DType::F16) => "float16",
            _ => "float32",
        };
        serde_json::json!({
            "_class_name": "UNet2DConditionModel",
            "_name_or_path": self.name,
            "sample_size": self.sample_size,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "center_input_sample": self.center_input_sample,
            "flip_sin_to_cos": self.flip_sin_to_cos,
            "freq_shift": self.freq_shift,
            "down_block_types": down,
            "up_block_types": up,
            "block_out_channels": self.block_out_channels,
            "layers_per_block": self.layers_per_block,
            "downsample_padding": self.downsample_padding,
            "mid_block_scale_factor": self.mid_block_scale_factor,
            "act_fn": "silu",
            "norm_num_groups": self.norm_num_groups,
            "norm_eps": self.norm_eps,
            "cross_attention_dim": self.cross_attention_dim,
            "attention_head_dim": self.heads,
            "transformer_layers_per_block": self.transformer_layers_per_block,
            "use_linear_projection": self.use_linear_projection,
            "time_embedding_dim": self.time_embed_dim,
            "torch_dtype": dtype,
        })
    }
}

impl UNetParams {
    fn validate(&self) -> Result<()> {
        positive("sample_size", self.sample_size)?;
        positive("in_channels", self.in_channels)?;
        positive("out_channels", self.out_channels)?;
        positive("layers_per_block", self.layers_per_block)?;
        positive("norm_num_groups", self.norm_num_groups)?;
        positive("cross_attention_dim", self.cross_attention_dim)?;
        positive("transformer_layers_per_block", self.transformer_layers_per_block)?;
        positive("time_embedding_dim", self.time_embed_dim)?;
        // Bounds that keep the counting graph's shapes far from overflow.
        const MAX_WIDTH: usize = 1 << 20;
        let widths = self.block_out_channels.iter().chain([
            &self.cross_attention_dim,
            &self.time_embed_dim,
            &self.in_channels,
            &self.out_channels,
        ]);
        if let Some(w) = widths.into_iter().find(|&&w| w > MAX_WIDTH) {
            return Err(ModelError::invalid(
                "config",
                format!("a width of {w}: at most {MAX_WIDTH}"),
            ));
        }
        if self.layers_per_block > 64 || self.transformer_layers_per_block > 64 {
            return Err(ModelError::invalid(
                "layers_per_block",
                "more than 64 layers per block: check the config for a typo",
            ));
        }
        let n = self.block_out_channels.len();
        if n == 0 || n > 8 {
            return Err(ModelError::invalid(
                "block_out_channels",
                format!("{n} blocks: give between 1 and 8 block widths"),
            ));
        }
        for (what, len) in [
            ("down_block_types", self.down_block_types.len()),
            ("up_block_types", self.up_block_types.len()),
            ("attention_head_dim", self.heads.len()),
        ] {
            if len != n {
                return Err(ModelError::invalid(
                    what,
                    format!("{len} entries for {n} block_out_channels: give one per block"),
                ));
            }
        }
        if self.block_out_channels[0] < 2 {
            return Err(ModelError::invalid(
                "block_out_channels",
                "the first width is the timestep embedding's, which needs at least 2",
            ));
        }
        for (i, (&c, &h)) in self.block_out_channels.iter().zip(&self.heads).enumerate() {
            positive("block_out_channels", c)?;
            positive("attention_head_dim", h)?;
            if c % self.norm_num_groups != 0 {
                return Err(ModelError::invalid(
                    "norm_num_groups",
                    format!(
                        "{} groups do not divide block {i}'s {c} channels",
                        self.norm_num_groups
                    ),
                ));
            }
            if c % h != 0 {
                return Err(ModelError::invalid(
                    "attention_head_dim",
                    format!("{h} heads do not divide block {i}'s {c} channels"),
                ));
            }
        }
        if !self.sample_size.is_multiple_of(1 << (n - 1)) {
            return Err(ModelError::invalid(
                "sample_size",
                format!(
                    "{} is not a multiple of 2^{} (the down path halves it {} times)",
                    self.sample_size,
                    n - 1,
                    n - 1
                ),
            ));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return Err(ModelError::invalid(
                "norm_eps",
                format!("{} must be positive", self.norm_eps),
            ));
        }
        if !(self.mid_block_scale_factor > 0.0 && self.mid_block_scale_factor.is_finite()) {
            return Err(ModelError::invalid(
                "mid_block_scale_factor",
                format!("{} must be positive", self.mid_block_scale_factor),
            ));
        }
        Ok(())
    }
}

/// Parses a diffusers `UNet2DConditionModel` config.json (its top-level object).
pub(crate) fn parse_unet(map: &Map<String, Value>, name: String) -> Result<UNetConfig> {
    let f = Fields(map);
    // Settings whose non-default values change the network in ways not built here.
    for (key, default) in [
        ("act_fn", Value::from("silu")),
        ("time_embedding_type", Value::from("positional")),
        ("resnet_time_scale_shift", Value::from("default")),
        ("mid_block_type", Value::from("UNetMidBlock2DCrossAttn")),
        ("attention_type", Value::from("default")),
        ("conv_in_kernel", Value::from(3)),
        ("conv_out_kernel", Value::from(3)),
        ("only_cross_attention", Value::from(false)),
        ("dual_cross_attention", Value::from(false)),
        ("class_embeddings_concat", Value::from(false)),
    ] {
        if let Some(v) = map.get(key) {
            if !v.is_null() && *v != default {
                return Err(ModelError::Unsupported {
                    what: format!("UNet2DConditionModel setting `{key}`"),
                    found: v.to_string(),
                    supported: format!("{default} (diffusers' default)"),
                });
            }
        }
    }
    for key in [
        "num_attention_heads",
        "class_embed_type",
        "num_class_embeds",
        "addition_embed_type",
        "addition_time_embed_dim",
        "encoder_hid_dim",
        "encoder_hid_dim_type",
        "time_cond_proj_dim",
        "timestep_post_act",
        "time_embedding_act_fn",
        "projection_class_embeddings_input_dim",
        "cross_attention_norm",
        "reverse_transformer_layers_per_block",
        "mid_block_only_cross_attention",
    ] {
        if let Some(v) = map.get(key).filter(|v| !v.is_null()) {
            return Err(ModelError::Unsupported {
                what: format!("UNet2DConditionModel setting `{key}`"),
                found: v.to_string(),
                supported: "null (absent)".into(),
            });
        }
    }
    if let Some(p) = f.f64("dropout")? {
        if p != 0.0 {
            return Err(ModelError::Unsupported {
                what: "UNet2DConditionModel `dropout`".into(),
                found: p.to_string(),
                supported: "0.0".into(),
            });
        }
    }
    let block_out_channels =
        f.usize_list("block_out_channels")?.unwrap_or_else(|| vec![320, 640, 1280, 1280]);
    let n = block_out_channels.len();
    let down_block_types = f
        .str_list("down_block_types")?
        .unwrap_or_else(|| {
            ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"]
                .map(String::from)
                .to_vec()
        })
        .iter()
        .map(|s| match s.as_str() {
            "CrossAttnDownBlock2D" => Ok(DownBlock::CrossAttn),
            "DownBlock2D" => Ok(DownBlock::Plain),
            other => Err(ModelError::Unsupported {
                what: "down block type".into(),
                found: other.into(),
                supported: "CrossAttnDownBlock2D, DownBlock2D".into(),
            }),
        })
        .collect::<Result<Vec<_>>>()?;
    let up_block_types = f
        .str_list("up_block_types")?
        .unwrap_or_else(|| {
            ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]
                .map(String::from)
                .to_vec()
        })
        .iter()
        .map(|s| match s.as_str() {
            "CrossAttnUpBlock2D" => Ok(UpBlock::CrossAttn),
            "UpBlock2D" => Ok(UpBlock::Plain),
            other => Err(ModelError::Unsupported {
                what: "up block type".into(),
                found: other.into(),
                supported: "CrossAttnUpBlock2D, UpBlock2D".into(),
            }),
        })
        .collect::<Result<Vec<_>>>()?;
    let heads = match map.get("attention_head_dim") {
        None | Some(Value::Null) => vec![8; n],
        Some(Value::Array(_)) => f.usize_list("attention_head_dim")?.unwrap_or_default(),
        Some(_) => vec![f.usize("attention_head_dim")?.unwrap_or(8); n],
    };
    let transformer_layers_per_block = match map.get("transformer_layers_per_block") {
        Some(Value::Array(_)) => {
            let l = f.usize_list("transformer_layers_per_block")?.unwrap_or_default();
            match l.split_first() {
                Some((&first, rest)) if rest.iter().all(|&x| x == first) => first,
                _ => {
                    return Err(ModelError::Unsupported {
                        what: "`transformer_layers_per_block` list".into(),
                        found: format!("{l:?}"),
                        supported: "one count for every block".into(),
                    })
                }
            }
        }
        _ => f.usize("transformer_layers_per_block")?.unwrap_or(1),
    };
    let cross_attention_dim = match map.get("cross_attention_dim") {
        Some(Value::Array(_)) => {
            let l = f.usize_list("cross_attention_dim")?.unwrap_or_default();
            match l.split_first() {
                Some((&first, rest)) if rest.iter().all(|&x| x == first) => first,
                _ => {
                    return Err(ModelError::Unsupported {
                        what: "`cross_attention_dim` list".into(),
                        found: format!("{l:?}"),
                        supported: "one width for every block".into(),
                    })
                }
            }
        }
        _ => f.usize("cross_attention_dim")?.unwrap_or(1280),
    };
    let first = block_out_channels.first().copied().unwrap_or(0);
    let params = UNetParams {
        name,
        sample_size: f.usize("sample_size")?.unwrap_or(64),
        in_channels: f.usize("in_channels")?.unwrap_or(4),
        out_channels: f.usize("out_channels")?.unwrap_or(4),
        center_input_sample: f.bool("center_input_sample")?.unwrap_or(false),
        flip_sin_to_cos: f.bool("flip_sin_to_cos")?.unwrap_or(true),
        freq_shift: f.f64("freq_shift")?.unwrap_or(0.0),
        down_block_types,
        up_block_types,
        block_out_channels,
        layers_per_block: f.usize("layers_per_block")?.unwrap_or(2),
        downsample_padding: f.usize("downsample_padding")?.unwrap_or(1),
        mid_block_scale_factor: f.f64("mid_block_scale_factor")?.unwrap_or(1.0),
        norm_num_groups: f.usize("norm_num_groups")?.unwrap_or(32),
        norm_eps: f.f64("norm_eps")?.unwrap_or(1e-5),
        cross_attention_dim,
        heads,
        transformer_layers_per_block,
        use_linear_projection: f.bool("use_linear_projection")?.unwrap_or(false),
        time_embed_dim: f.usize("time_embedding_dim")?.unwrap_or(first.saturating_mul(4)),
        dtype: match f.str("torch_dtype")? {
            Some("float32") => Some(DType::F32),
            Some("bfloat16") => Some(DType::BF16),
            Some("float16") => Some(DType::F16),
            _ => None,
        },
    };
    UNetConfig::new(params)
}

/// Typed reads of a diffusers config's fields (absent or null → `None`).
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }
    fn wrong(key: &str, expected: &str, v: &Value) -> ModelError {
        ModelError::invalid(key, format!("must be {expected}, got {v}"))
    }
    fn usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| Self::wrong(key, "a non-negative integer", v))
            })
            .transpose()
    }
    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|v| v.as_f64().ok_or_else(|| Self::wrong(key, "a number", v))).transpose()
    }
    fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| Self::wrong(key, "true or false", v)))
            .transpose()
    }
    fn str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key).map(|v| v.as_str().ok_or_else(|| Self::wrong(key, "a string", v))).transpose()
    }
    fn list(&self, key: &str) -> Result<Option<&Vec<Value>>> {
        self.get(key).map(|v| v.as_array().ok_or_else(|| Self::wrong(key, "a list", v))).transpose()
    }
    fn usize_list(&self, key: &str) -> Result<Option<Vec<usize>>> {
        let Some(l) = self.list(key)? else { return Ok(None) };
        l.iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| Self::wrong(key, "a list of non-negative integers", v))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
    fn str_list(&self, key: &str) -> Result<Option<Vec<String>>> {
        let Some(l) = self.list(key)? else { return Ok(None) };
        l.iter()
            .map(|v| {
                v.as_str().map(String::from).ok_or_else(|| Self::wrong(key, "a list of strings", v))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}
