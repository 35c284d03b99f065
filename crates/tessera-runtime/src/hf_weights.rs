//! Hugging Face weights: [`load_hf_weights`] reads `model.safetensors`, a sharded
//! `model.safetensors.index.json` (+ its shards) or one `.safetensors` file, and maps every
//! tensor to the graph parameter of the same name (parameters carry their Hugging Face names).
//! It also accepts:
//! - base-model checkpoints whose names lack the head model's prefix (`transformer.`,
//!   `model.`, `bert.`, `vit.`), such as the original `gpt2` one (`h.0.attn.c_attn.weight`);
//! - legacy LayerNorm names `*.gamma` / `*.beta` (old BERT checkpoints);
//! - for tied weights, the redundant second name `transformers` may store (`lm_head.weight`,
//!   `cls.predictions.decoder.weight`, `cls.predictions.decoder.bias`): it fills the tied
//!   parameter when that is absent, and must equal it when both are present (a difference
//!   means the weights were not tied: `tie_word_embeddings` in config.json is wrong);
//! - and skips non-parameter buffers (`.attn.bias`, `.attn.masked_bias`,
//!   `rotary_emb.inv_freq`, `position_ids`) and the heads our models do not build, which
//!   `transformers`' own `BertForMaskedLM` / `ViTForImageClassification` drop as well
//!   (`bert.pooler.*`, `cls.seq_relationship.*`, `vit.pooler.*`).
//!
//! f16 / bf16 / f32 / f64 tensors are converted to the parameter's dtype (bit-exact when
//! they already have it). Every mismatch — missing, unexpected or duplicated tensors, wrong
//! shapes (both shown), non-float dtypes — is reported by name in one
//! [`RuntimeError::Checkpoint`].
//!
//! # Reading only a device's slices
//! [`HfWeights::open`] maps the files into memory and checks every header, name, shape and
//! dtype without reading a tensor; [`HfWeights::shard`] then copies out exactly the elements
//! of one device's shard (converted to the parameter's dtype), so a rank's heap holds its own
//! slices and never a whole parameter the plan does not give it. [`load_hf_weights`] is the
//! whole-tensor case (one device).
//!

use crate::checkpoint::{err, io_err, MODEL_FILE, MODEL_INDEX_FILE};
use crate::collective::{DeviceMesh, Placement};
use crate::tensor::candle_dtype;
use crate::{Result, RuntimeError};
use candle_core::{Device, Tensor};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use tessera_ir::{Graph, TensorId};

/// Prefixes of the head models' base model (`GPT2LMHeadModel.transformer`, ...), absent from
/// base-model checkpoints.
const BASE_PREFIXES: &[&str] = &["transformer.", "model.", "bert.", "vit."];

/// `(alias, parameter)`: names `transformers` may store for a tied parameter.
const TIED_ALIASES: &[(&str, &str)] = &[
    ("lm_head.weight", "transformer.wte.weight"),
    ("lm_head.weight", "model.embed_tokens.weight"),
    ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
    ("cls.predictions.decoder.bias", "cls.predictions.bias"),
];

/// Suffixes of buffers that are not parameters (causal masks, RoPE tables, position ids).
const BUFFER_SUFFIXES: &[&str] =
    &[".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq", "position_ids"];

/// Prefixes of heads our models do not build (transformers' MaskedLM / classifier drop them).
const UNBUILT_HEADS: &[&str] = &["bert.pooler.", "pooler.", "cls.seq_relationship.", "vit.pooler."];

/// The safetensors files of the weights at `path`, and the index file if sharded.
fn weight_files(path: &Path) -> Result<(Vec<PathBuf>, Option<PathBuf>)> {
    let is_index = |p: &Path| p.to_string_lossy().ends_with(".index.json");
    if path.is_file() {
        if is_index(path) {
            return Ok((index_shards(path)?, Some(path.to_path_buf())));
        }
        return Ok((vec![path.to_path_buf()], None));
    }
    if !path.is_dir() {
        return Err(err(format!(
            "{}: no such file or directory; pass a directory holding {MODEL_FILE} (or \
             {MODEL_INDEX_FILE} and its shards), or a .safetensors file",
            path.display()
        )));
    }
    let single = path.join(MODEL_FILE);
    if single.is_file() {
        return Ok((vec![single], None));
    }
    let index = path.join(MODEL_INDEX_FILE);
    if index.is_file() {
        return Ok((index_shards(&index)?, Some(index)));
    }
    let hint = if path.join("pytorch_model.bin").exists()
        || path.join("pytorch_model.bin.index.json").exists()
    {
        " (it has PyTorch .bin weights only: convert them with transformers' \
         `model.save_pretrained(dir, safe_serialization=True)`)"
    } else {
        ""
    };
    Err(err(format!(
        "{}: no {MODEL_FILE} or {MODEL_INDEX_FILE} in this directory{hint}",
        path.display()
    )))
}

/// The distinct shard files an index's `weight_map` names, each of which must exist.
fn index_shards(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(io_err(index))?;
    let value: Value = serde_json::from_str(&text).map_err(|e| {
        err(format!("{}: malformed JSON ({e}); re-download the index", index.display()))
    })?;
    let Some(map) = value.get("weight_map").and_then(Value::as_object) else {
        return Err(err(format!(
            "{}: no \"weight_map\" object; a safetensors index maps tensor names to shard files",
            index.display()
        )));
    };
    if map.is_empty() {
        return Err(err(format!(
            "{}: the weight_map is empty; re-download the index",
            index.display()
        )));
    }
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut shards = BTreeSet::new();
    for (name, file) in map {
        let Some(file) = file.as_str() else {
            return Err(err(format!(
                "{}: weight_map[\"{name}\"] must be a file name, got {file}",
                index.display()
            )));
        };
        shards.insert(file.to_string());
    }
    let mut files = Vec::new();
    let mut absent = Vec::new();
    for s in shards {
        let p = dir.join(&s);
        if p.is_file() {
            files.push(p);
        } else {
            absent.push(s);
        }
    }
    if !absent.is_empty() {
        return Err(err(format!(
            "{}: shard(s) {} listed in the index are missing from {}; the download is \
             incomplete",
            index.display(),
            absent.join(", "),
            dir.display()
        )));
    }
    Ok(files)
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64)
}

/// What a checkpoint name refers to.
enum Target {
    Param(TensorId),
    /// A redundant name of a tied parameter.
    Alias(TensorId),
    Skipped,
    Unexpected,
}

fn resolve(name: &str, by_name: &HashMap<&str, TensorId>) -> Target {
    let legacy = name
        .strip_suffix(".gamma")
        .map(|s| format!("{s}.weight"))
        .or_else(|| name.strip_suffix(".beta").map(|s| format!("{s}.bias")));
    for n in std::iter::once(name.to_string()).chain(legacy) {
        if let Some(&p) = by_name.get(n.as_str()) {
            return Target::Param(p);
        }
        for prefix in BASE_PREFIXES {
            if let Some(&p) = by_name.get(format!("{prefix}{n}").as_str()) {
                return Target::Param(p);
            }
        }
    }
    for (alias, param) in TIED_ALIASES {
        if name == *alias {
            if let Some(&p) = by_name.get(param) {
                return Target::Alias(p);
            }
        }
    }
    if BUFFER_SUFFIXES.iter().any(|s| name.ends_with(s))
        || UNBUILT_HEADS.iter().any(|h| name.starts_with(h))
    {
        return Target::Skipped;
    }
    Target::Unexpected
}

/// Everything wrong with a set of weights, reported at once.
#[derive(Default)]
struct Problems {
    missing: Vec<String>,
    unexpected: Vec<String>,
    duplicate: Vec<String>,
    shape: Vec<String>,
    dtype: Vec<String>,
    tied: Vec<String>,
}

impl Problems {
    fn count(&self) -> usize {
        [&self.missing, &self.unexpected, &self.duplicate, &self.shape, &self.dtype, &self.tied]
            .iter()
            .map(|v| v.len())
            .sum()
    }

    fn into_error(self, path: &Path) -> RuntimeError {
        let n = self.count();
        let mut msg = format!(
            "{}: the weights do not fit the model ({n} problem{}):",
            path.display(),
            if n == 1 { "" } else { "s" }
        );
        let sections = [
            ("missing from the checkpoint", self.missing),
            ("in the checkpoint but not in the model", self.unexpected),
            ("given twice", self.duplicate),
            ("wrong shape", self.shape),
            ("unsupported dtype (f16, bf16, f32 or f64 only)", self.dtype),
            ("tied in the model but different in the checkpoint", self.tied),
        ];
        for (title, mut items) in sections {
            if items.is_empty() {
                continue;
            }
            items.sort();
            msg.push_str(&format!("\n  {title} ({}):", items.len()));
            for i in items {
                msg.push_str(&format!("\n    {i}"));
            }
        }
        msg.push_str(
            "\ndoes config.json match these weights? The model is built from the config: a \
             different family, size, vocabulary or tie_word_embeddings gives these errors",
        );
        err(msg)
    }
}

/// Where one tensor lies in a mapped file.
#[derive(Clone, Debug)]
struct Located {
    file: usize,
    /// The checkpoint's name for it.
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte offset of its data in the file.
    start: usize,
}

/// A checkpoint's weights, mapped and checked against a graph, read slice by slice.
pub struct HfWeights {
    files: Vec<(PathBuf, memmap2::Mmap)>,
    /// Parameter name → where its value lies, and where a tied alias of it lies too (the two
    /// must agree).
    entries: HashMap<String, (Located, Option<Located>)>,
}

impl std::fmt::Debug for HfWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let files: Vec<_> = self.files.iter().map(|(p, _)| p).collect();
        f.debug_struct("HfWeights").field("files", &files).finish_non_exhaustive()
    }
}

/// Maps one safetensors file and checks its header; corruption is named with the file.
fn map_file(path: &Path) -> Result<(memmap2::Mmap, Vec<Located>, usize)> {
    let file = std::fs::File::open(path).map_err(io_err(path))?;
    // SAFETY: the map is read-only; a checkpoint rewritten while it is read is the same
    // hazard as for `std::fs::read` of a file being written, and saves replace directories
    // by rename rather than rewrite files in place.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(path))?;
    let (header, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
        err(format!(
            "{}: not a valid safetensors file ({e}); it is corrupt or truncated: re-download or \
             re-save it",
            path.display()
        ))
    })?;
    let base = 8 + header;
    let mut tensors: Vec<Located> = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| Located {
            file: 0,
            name,
            dtype: info.dtype,
            shape: info.shape.clone(),
            start: base + info.data_offsets.0,
        })
        .collect();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let len = map.len();
    Ok((map, tensors, len))
}

impl HfWeights {
    /// Maps the weights at `path` (see [`load_hf_weights`]) and checks them against `graph`'s
    /// parameters: every problem but untied values (found as slices are read) is reported
    /// at once, by name.
    pub fn open(path: &Path, graph: &Graph) -> Result<HfWeights> {
        let (paths, index) = weight_files(path)?;
        // Errors name the file read (the index when sharded), not just the directory.
        let source = index.unwrap_or_else(|| paths[0].clone());
        let params = graph.parameters();
        let by_name: HashMap<&str, TensorId> =
            params.iter().map(|&p| (graph.tensor_scope(p), p)).collect();
        let mut problems = Problems::default();
        let mut supplied: HashMap<TensorId, Located> = HashMap::new();
        let mut aliases: BTreeMap<String, (TensorId, Located)> = BTreeMap::new();
        let sharded = paths.len() > 1;
        let mut files = Vec::new();
        for (k, path) in paths.iter().enumerate() {
            let (map, tensors, _) = map_file(path)?;
            files.push((path.clone(), map));
            let shard =
                path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            let at = |name: &str| {
                if sharded {
                    format!("{name} (in {shard})")
                } else {
                    name.to_string()
                }
            };
            for mut t in tensors {
                t.file = k;
                let (p, alias) = match resolve(&t.name, &by_name) {
                    Target::Skipped => continue,
                    Target::Unexpected => {
                        problems.unexpected.push(format!("{} {:?}", at(&t.name), t.shape));
                        continue;
                    }
                    Target::Param(p) => (p, false),
                    Target::Alias(p) => (p, true),
                };
                let param = graph.tensor_scope(p);
                let shown = if t.name == param {
                    at(&t.name)
                } else {
                    at(&format!("{} (as {param})", t.name))
                };
                if !is_float(t.dtype) {
                    problems.dtype.push(format!("{shown}: {:?}", t.dtype));
                } else if t.shape != graph.shape(p).dims() {
                    let want = graph.shape(p).dims();
                    problems
                        .shape
                        .push(format!("{shown}: checkpoint {:?}, model {want:?}", t.shape));
                }
                // Registered even when wrong, so a tensor of the wrong shape or dtype is
                // reported as such, not also as missing.
                if alias {
                    aliases.insert(t.name.clone(), (p, t));
                } else if let Some(first) = supplied.get(&p) {
                    problems
                        .duplicate
                        .push(format!("{param}: as {} and as {}", first.name, t.name));
                } else {
                    supplied.insert(p, t);
                }
            }
        }
        let mut entries = HashMap::new();
        for (p, t) in supplied {
            entries.insert(graph.tensor_scope(p).to_string(), (t, None));
        }
        for (_, (p, t)) in aliases {
            let param = graph.tensor_scope(p).to_string();
            match entries.get_mut(&param) {
                // Only the alias was stored: it is the parameter.
                None => {
                    entries.insert(param, (t, None));
                }
                Some(entry) => entry.1 = Some(t),
            }
        }
        for &p in &params {
            if !entries.contains_key(graph.tensor_scope(p)) {
                problems.missing.push(format!(
                    "{} {:?}",
                    graph.tensor_scope(p),
                    graph.shape(p).dims()
                ));
            }
        }
        if problems.count() > 0 {
            return Err(problems.into_error(&source));
        }
        Ok(HfWeights { files, entries })
    }

    /// The checkpoint's files.
    pub fn files(&self) -> Vec<&Path> {
        self.files.iter().map(|(p, _)| p.as_path()).collect()
    }

    /// Whether parameter `name` is in the checkpoint.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The elements of `t` in the block starting at `origin` of extent `extent`, as a tensor
    /// of `dtype`: only those bytes are read from the file.
    fn read_block(
        &self,
        t: &Located,
        origin: &[usize],
        extent: &[usize],
        dtype: candle_core::DType,
    ) -> Result<Tensor> {
        let bytes = &self.files[t.file].1;
        let width = t.dtype.bitsize() / 8;
        let strides = tessera_ir::dist::row_major_strides(&t.shape);
        let rank = t.shape.len();
        // The innermost dimension's run is contiguous; iterate over the outer indices.
        let run = extent.last().copied().unwrap_or(1) * width;
        let outer: usize = extent[..rank.saturating_sub(1)].iter().product();
        let mut out = Vec::with_capacity(outer * run);
        let mut index = vec![0usize; rank.saturating_sub(1)];
        for _ in 0..outer {
            let mut offset = 0;
            for d in 0..rank {
                let i = origin[d] + if d + 1 < rank { index[d] } else { 0 };
                offset += i * strides[d] as usize;
            }
            let at = t.start + offset * width;
            out.extend_from_slice(&bytes[at..at + run]);
            for d in (0..index.len()).rev() {
                index[d] += 1;
                if index[d] < extent[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        let src = match t.dtype {
            Dtype::F16 => candle_core::DType::F16,
            Dtype::BF16 => candle_core::DType::BF16,
            Dtype::F32 => candle_core::DType::F32,
            Dtype::F64 => candle_core::DType::F64,
            other => return Err(err(format!("{}: unsupported dtype {other:?}", t.name))),
        };
        let value = Tensor::from_raw_buffer(&out, src, extent, &Device::Cpu)?;
        Ok(if src == dtype { value } else { value.to_dtype(dtype)? })
    }

    /// This device's shard of parameter `name` under `placement`, as `dtype`, reading only
    /// its elements (and the same elements of a tied alias, which must be equal).
    pub fn shard(
        &self,
        name: &str,
        placement: &Placement,
        mesh: &DeviceMesh,
        dtype: candle_core::DType,
    ) -> Result<Tensor> {
        let (t, alias) = self
            .entries
            .get(name)
            .ok_or_else(|| err(format!("no tensor for parameter `{name}` in the checkpoint")))?;
        let layout = |e: tessera_ir::IrError| RuntimeError::Binding(format!("{name}: {e}"));
        let origin = if placement.is_empty() {
            vec![0; t.shape.len()]
        } else {
            mesh.shard_origin(&t.shape, placement).map_err(layout)?
        };
        let mut extent = t.shape.clone();
        for (d, axes) in placement.iter().enumerate() {
            extent[d] /= mesh.chunk(axes).map_err(layout)?.0;
        }
        let value = self.read_block(t, &origin, &extent, dtype)?;
        if let Some(a) = alias {
            let other = self.read_block(a, &origin, &extent, dtype)?;
            if !same_values(&value, &other)? {
                return Err(err(format!(
                    "{}: the weights do not fit the model: {} differs from {name}; if the \
                     checkpoint's head is its own matrix, set \"tie_word_embeddings\": false \
                     in config.json",
                    self.files[t.file].0.display(),
                    a.name
                )));
            }
        }
        Ok(value)
    }

    /// The whole parameter `name`, as `dtype`.
    pub fn global(&self, name: &str, dtype: candle_core::DType) -> Result<Tensor> {
        self.shard(name, &Vec::new(), &DeviceMesh::single(), dtype)
    }
}

/// Whether two tensors of one dtype hold the same elements.
fn same_values(a: &Tensor, b: &Tensor) -> Result<bool> {
    if a.dims() != b.dims() || a.dtype() != b.dtype() {
        return Ok(false);
    }
    if a.elem_count() == 0 {
        return Ok(true);
    }
    Ok(a.flatten_all()?.eq(&b.flatten_all()?)?.min(0)?.to_scalar::<u8>()? == 1)
}

/// Loads Hugging Face weights for `graph`'s parameters: `path` is a directory holding
/// `model.safetensors` or `model.safetensors.index.json` + shards, an index file, or one
/// `.safetensors` file. Returns one whole tensor per parameter, in `graph.parameters()`
/// order, in the parameter's dtype (bit-exact when the file has it). See the module docs for
/// the names accepted; [`HfWeights`] reads slices instead.
pub fn load_hf_weights(path: &Path, graph: &Graph) -> Result<Vec<(TensorId, Tensor)>> {
    let weights = HfWeights::open(path, graph)?;
    graph
        .parameters()
        .into_iter()
        .map(|p| {
            let dtype = candle_dtype(graph.meta(p).dtype);
            Ok((p, weights.global(graph.tensor_scope(p), dtype)?))
        })
        .collect()
}

/// The model weights in any directory `train` or `transformers` writes, as a source each
/// device reads its shards from: Hugging Face weights (`model.safetensors` or an index,
/// mapped and checked against `graph`), or a sharded Tessera checkpoint (its parameters
/// assembled whole, checked by name and shape against `graph`).
pub fn open_weights(
    dir: &Path,
    graph: &Graph,
) -> Result<Box<dyn crate::trainer::ShardSource + Send>> {
    if !crate::dist_checkpoint::is_sharded(dir) {
        return Ok(Box::new(HfWeights::open(dir, graph)?));
    }
    let ckpt = crate::checkpoint::load_checkpoint(dir)?;
    let mut problems = Problems::default();
    for p in graph.parameters() {
        let name = graph.tensor_scope(p);
        match ckpt.params.get(name) {
            None => problems.missing.push(format!("{name} {:?}", graph.shape(p).dims())),
            Some(t) if t.dims() != graph.shape(p).dims() => problems.shape.push(format!(
                "{name}: checkpoint {:?}, model {:?}",
                t.dims(),
                graph.shape(p).dims()
            )),
            Some(_) => {}
        }
    }
    if problems.count() > 0 {
        return Err(problems.into_error(dir));
    }
    Ok(Box::new(ckpt.params))
}
