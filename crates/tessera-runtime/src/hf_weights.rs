//! Hugging Face weights: [`load_hf_weights`] reads `model.safetensors`, a sharded
//! `model.safetensors.index.json` (+ its shards), diffusers' `diffusion_pytorch_model.safetensors`
//! (or its index) or one `.safetensors` file, and maps every
//! tensor to the graph parameter of the same name (parameters carry their Hugging Face names).
//! It also accepts:
//! - base-model checkpoints whose names lack the head model's prefix (`transformer.`,
//!   `model.`, `bert.`, `vit.`), such as the original `gpt2` one (`h.0.attn.c_attn.weight`);
//! - legacy LayerNorm names `*.gamma` / `*.beta` (old BERT checkpoints);
//! - for tied weights, the redundant second name `transformers` may store (`lm_head.weight`,
//!   `cls.predictions.decoder.weight`, `cls.predictions.decoder.bias`): it fills the tied
//!   parameter when that is absent, and must equal it when both are present (a difference
//!   means the weights were not tied: `tie_word_embeddings` in config.json is wrong);
//! - the Hub's per-expert tensors of a mixture of experts (`…experts.{e}.w1.weight [f, d]`)
//!   as the rows of the model's stacked parameter (`…experts.w1.weight [E, f, d]`,
//!   [`crate::expert_layout`]), each read in place; every expert must be there;
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

use crate::checkpoint::{checksum_of, err, io_err, MODEL_FILE, MODEL_INDEX_FILE};
use crate::collective::{DeviceMesh, Placement};
use crate::mapped::{MappedFile, MappedTensors};
use crate::tensor::candle_dtype;
use crate::{Result, RuntimeError};
use candle_core::Tensor;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use tessera_ir::moe::{per_expert_name, stacked_expert_name};
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

/// diffusers' names for a model's weights and their shard index (`save_pretrained` of a
/// `ModelMixin`), read where `model.safetensors` is absent.
const DIFFUSERS_FILES: (&str, &str) =
    ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json");

/// The safetensors files of the weights at `path` (`model.safetensors`, else diffusers'
/// `diffusion_pytorch_model.safetensors`, or their shard indexes), and the index file if
/// sharded.
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
    for (file, index_file) in [(MODEL_FILE, MODEL_INDEX_FILE), DIFFUSERS_FILES] {
        let single = path.join(file);
        if single.is_file() {
            return Ok((vec![single], None));
        }
        let index = path.join(index_file);
        if index.is_file() {
            return Ok((index_shards(&index)?, Some(index)));
        }
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

/// A per-expert tensor `name` of `shape` (`…experts.{e}.w1.weight`) as row `e` of the graph's
/// stacked parameter: `None` when the graph has no such parameter, an error text when the
/// expert or its shape does not fit it.
fn expert_row(
    name: &str,
    shape: &[usize],
    by_name: &HashMap<&str, TensorId>,
    graph: &Graph,
) -> Option<std::result::Result<(TensorId, usize), String>> {
    let (stacked, e) = stacked_expert_name(name)?;
    let Target::Param(p) = resolve(&stacked, by_name) else { return None };
    let dims = graph.shape(p).dims();
    if dims.first().is_none_or(|&n| e >= n) || &dims[1..] != shape {
        let param = graph.tensor_scope(p);
        return Some(Err(format!(
            "{name}: checkpoint {shape:?}, model expert row of {param} {dims:?}"
        )));
    }
    Some(Ok((p, e)))
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

/// A checkpoint's weights, mapped and checked against a graph, read slice by slice.
#[derive(Debug)]
pub struct HfWeights {
    /// By parameter name (each stored whole under the checkpoint's name for it).
    params: MappedTensors,
    /// A tied alias stored besides its parameter, by the parameter's name: the two must agree.
    aliases: MappedTensors,
    /// The checkpoint's name of each alias, for messages.
    alias_names: HashMap<String, String>,
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
        // Parameter → (file, checkpoint name), for the parameter itself and for an alias.
        let mut supplied: HashMap<TensorId, (usize, String)> = HashMap::new();
        let mut aliases: BTreeMap<String, (TensorId, usize)> = BTreeMap::new();
        // Stacked expert parameter → expert → (file, per-expert name).
        let mut experts: HashMap<TensorId, BTreeMap<usize, (usize, String)>> = HashMap::new();
        let sharded = paths.len() > 1;
        // A Tessera checkpoint's weights are checked against its manifest's checksums.
        let manifest = crate::integrity::tessera_manifest(path)?;
        if let Some(m) = &manifest {
            crate::checkpoint::read_config(path, m)?;
        }
        let digest = |p: &Path| manifest.as_ref().and_then(|m| checksum_of(p, m));
        let files =
            paths.iter().map(|p| MappedFile::open(p, digest(p))).collect::<Result<Vec<_>>>()?;
        for (k, file) in files.iter().enumerate() {
            let shard = file.path.file_name().map(|f| f.to_string_lossy().into_owned());
            let at = |name: &str| match (&shard, sharded) {
                (Some(shard), true) => format!("{name} (in {shard})"),
                _ => name.to_string(),
            };
            let mut names: Vec<&String> = file.tensors.keys().collect();
            names.sort();
            for name in names {
                let (dtype, shape, _) = &file.tensors[name];
                let (p, alias) = match resolve(name, &by_name) {
                    Target::Skipped => continue,
                    Target::Unexpected => {
                        match expert_row(name, shape, &by_name, graph) {
                            Some(Ok((p, e))) => {
                                let rows = experts.entry(p).or_default();
                                if let Some((_, first)) = rows.insert(e, (k, name.clone())) {
                                    let param = graph.tensor_scope(p);
                                    problems.duplicate.push(format!(
                                        "{param} expert {e}: as {first} and as {name}"
                                    ));
                                }
                            }
                            Some(Err(wrong)) => problems.shape.push(at(&wrong)),
                            None => problems.unexpected.push(format!("{} {shape:?}", at(name))),
                        }
                        continue;
                    }
                    Target::Param(p) => (p, false),
                    Target::Alias(p) => (p, true),
                };
                let param = graph.tensor_scope(p);
                let shown =
                    if name == param { at(name) } else { at(&format!("{name} (as {param})")) };
                if !dtype.is_ok_and(|d| d.is_float()) {
                    let d = match dtype {
                        Ok(d) => format!("{d:?}"),
                        Err(raw) => format!("{raw:?}"),
                    };
                    problems.dtype.push(format!("{shown}: {d}"));
                } else if shape.as_slice() != graph.shape(p).dims() {
                    let want = graph.shape(p).dims();
                    problems.shape.push(format!("{shown}: checkpoint {shape:?}, model {want:?}"));
                }
                // Registered even when wrong, so a tensor of the wrong shape or dtype is
                // reported as such, not also as missing.
                if alias {
                    aliases.insert(name.clone(), (p, k));
                } else if let Some((_, first)) = supplied.get(&p) {
                    problems.duplicate.push(format!("{param}: as {first} and as {name}"));
                } else {
                    supplied.insert(p, (k, name.clone()));
                }
            }
        }
        let mut alias_of: Vec<(String, usize, String)> = Vec::new();
        for (name, (p, k)) in aliases {
            match supplied.entry(p) {
                // Only the alias was stored: it is the parameter.
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert((k, name));
                }
                std::collections::hash_map::Entry::Occupied(_) => {
                    alias_of.push((graph.tensor_scope(p).to_string(), k, name));
                }
            }
        }
        let mut stacked = Vec::new();
        for (p, rows) in experts {
            let param = graph.tensor_scope(p).to_string();
            if let Some((_, name)) = supplied.get(&p) {
                problems.duplicate.push(format!("{param}: as {name} and per expert"));
                continue;
            }
            let n = graph.shape(p).dim(0);
            let absent: Vec<String> = (0..n)
                .filter(|e| !rows.contains_key(e))
                .map(|e| per_expert_name(&param, e).unwrap_or_else(|| format!("{param}[{e}]")))
                .collect();
            if !absent.is_empty() {
                problems.missing.extend(absent);
                continue;
            }
            stacked.push((param, rows.into_values().collect::<Vec<_>>()));
        }
        for &p in &params {
            let param = graph.tensor_scope(p);
            if !supplied.contains_key(&p) && !stacked.iter().any(|(n, _)| n == param) {
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
        let files = std::sync::Arc::new(files);
        let entries = supplied
            .into_iter()
            .map(|(p, (k, name))| (graph.tensor_scope(p).to_string(), k, name))
            .collect();
        let alias_names =
            alias_of.iter().map(|(param, _, name)| (param.clone(), name.clone())).collect();
        Ok(HfWeights {
            params: MappedTensors::renamed(files.clone(), entries)?.with_stacked(stacked)?,
            aliases: MappedTensors::renamed(files, alias_of)?,
            alias_names,
        })
    }

    /// Whether parameter `name` is in the checkpoint.
    pub fn contains(&self, name: &str) -> bool {
        self.params.contains(name)
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
        let value = self.params.shard(name, placement, mesh, dtype)?;
        if let Some(alias) = self.alias_names.get(name) {
            let other = self.aliases.shard(name, placement, mesh, dtype)?;
            if !same_values(&value, &other)? {
                return Err(err(format!(
                    "the weights do not fit the model: {alias} differs from {name}; if the \
                     checkpoint's head is its own matrix, set \"tie_word_embeddings\": false \
                     in config.json"
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

/// A mapped Hugging Face checkpoint: each device reads only its shard's elements.
impl crate::mapped::ShardSource for HfWeights {
    fn shard_of(
        &self,
        name: &str,
        placement: &Placement,
        mesh: &DeviceMesh,
        dtype: candle_core::DType,
    ) -> Result<Option<Tensor>> {
        if !self.contains(name) {
            return Ok(None);
        }
        Ok(Some(self.shard(name, placement, mesh, dtype)?))
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

/// The initialisers of an ONNX file (`torch.onnx.export` writes a model's weights into it)
/// as whole tensors by name, each checked against `graph`'s parameter of that name.
pub fn onnx_weights(path: &Path, graph: &Graph) -> Result<HashMap<String, Tensor>> {
    let model = tessera_onnx::OnnxModel::open(path).map_err(|e| err(e.to_string()))?;
    let mut out = HashMap::new();
    let mut problems = Problems::default();
    for p in graph.parameters() {
        let (name, want) = (graph.tensor_scope(p), graph.shape(p).dims());
        match model.weights_f32(name).map_err(|e| err(e.to_string()))? {
            None => problems.missing.push(format!("{name} {want:?}")),
            Some((shape, _)) if shape != want => {
                problems.shape.push(format!("{name}: file {shape:?}, model {want:?}"))
            }
            Some((shape, data)) => {
                out.insert(
                    name.to_string(),
                    Tensor::from_vec(data, shape, &candle_core::Device::Cpu)?,
                );
            }
        }
    }
    if problems.count() > 0 {
        return Err(problems.into_error(path));
    }
    Ok(out)
}

/// The model weights in any directory `train` or `transformers` writes, as a source each
/// device reads its shards from: Hugging Face weights (`model.safetensors` or an index) or a
/// sharded Tessera checkpoint, mapped and checked against `graph` by name and shape; or an
/// ONNX file's initialisers ([`onnx_weights`]).
pub fn open_weights(
    dir: &Path,
    graph: &Graph,
) -> Result<Box<dyn crate::mapped::ShardSource + Send>> {
    if dir.extension().is_some_and(|e| e.eq_ignore_ascii_case("onnx")) {
        return Ok(Box::new(onnx_weights(dir, graph)?));
    }
    if !crate::dist_checkpoint::is_sharded(dir) {
        return Ok(Box::new(HfWeights::open(dir, graph)?));
    }
    let ckpt = crate::mapped::MappedCheckpoint::open(dir)?;
    let shapes: HashMap<&str, &[usize]> = ckpt.params.shapes().map(|(n, s, _)| (n, s)).collect();
    let mut problems = Problems::default();
    for p in graph.parameters() {
        let (name, want) = (graph.tensor_scope(p), graph.shape(p).dims());
        match shapes.get(name) {
            None => problems.missing.push(format!("{name} {want:?}")),
            Some(&got) if got != want => {
                problems.shape.push(format!("{name}: checkpoint {got:?}, model {want:?}"))
            }
            Some(_) => {}
        }
    }
    if problems.count() > 0 {
        return Err(problems.into_error(dir));
    }
    Ok(Box::new(ckpt.params))
}
