//! Checkpoints: Tessera's own save/resume directory ([`save_checkpoint`],
//! [`load_checkpoint`]); Hugging Face weight import is [`crate::hf_weights`].
//!
//! # Checkpoint directory (format_version 1)
//! ```text
//! DIR/config.json            the model's Hugging Face config (ModelConfig::to_hf_json), with
//!                            torch_dtype set to the saved weights' dtype
//! DIR/model.safetensors      parameters under their HF names, tied tensors once, stacked
//!                            expert parameters as the Hub's per-expert tensors
//!                            ([`crate::expert_layout`]), header metadata {"format": "pt"}:
//!                            what `save_pretrained` writes
//! DIR/optimizer.safetensors  AdamW state keyed `<param>.adam_m`, `<param>.adam_v` and, for
//!                            low-precision weights, `<param>.master` (see [`optimizer_key`])
//! DIR/manifest.json          [`Manifest`]: format_version, step, total_steps, seed, model,
//!                            schedule, extra (arbitrary JSON for the caller)
//! ```
//! `DIR` is laid out as a Hugging Face model directory (what `save_pretrained` writes, plus
//! two files `transformers` ignores), so `AutoModelForCausalLM.from_pretrained(DIR)` (or
//! `AutoModelForMaskedLM` / `AutoModelForImageClassification`) can load it, and so does
//! [`crate::hf_weights::load_hf_weights`].
//!
//! # Atomicity
//! A save never modifies the previous checkpoint in place. [`save_checkpoint`]:
//! 1. removes leftovers of interrupted saves of `DIR` (`DIR.tmp-*`; `DIR.old-*` only when
//!    `DIR` exists, i.e. when they are not the last complete checkpoint);
//! 2. writes every file into the sibling `DIR.tmp-<pid>`, `manifest.json` last, fsyncing each
//!    file and then the directory;
//! 3. renames `DIR` → `DIR.old-<pid>` (if `DIR` exists), then `DIR.tmp-<pid>` → `DIR`, and
//!    fsyncs the parent directory;
//! 4. removes `DIR.old-<pid>` (a failure there is ignored: the next save removes it).
//!
//! Killed during 1–2, `DIR` is untouched. Killed between the two renames of 3, `DIR` is
//! missing and `DIR.old-<pid>` holds the previous checkpoint: [`load_checkpoint`] renames it
//! back to `DIR` (or reads it in place if it cannot) and loads it, and the next save
//! completes the rotation. Killed during 4, `DIR` is already the new checkpoint. A `DIR.tmp-*`
//! is never loaded. One writer per checkpoint directory at a time. `DIR` is replaced whole
//! (files added to it by hand are not kept), so a save refuses an existing `DIR` that is
//! neither empty nor a checkpoint.

pub use crate::hf_weights::load_hf_weights;
use crate::integrity::{check_finite, check_seal, digest_file, seal, verify_bytes, Checksums};
use crate::schedule::LrSchedule;
use crate::{Result, RuntimeError};
use candle_core::safetensors::Load;
use candle_core::{Device, Tensor};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use tessera_ir::StateKind;

/// The checkpoint format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
pub const CONFIG_FILE: &str = "config.json";
pub const MODEL_FILE: &str = "model.safetensors";
pub const MODEL_INDEX_FILE: &str = "model.safetensors.index.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const MANIFEST_FILE: &str = "manifest.json";

/// What a training run needs besides the tensors to resume exactly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] when written by this build.
    pub format_version: u32,
    /// Optimizer steps completed.
    pub step: u64,
    /// The run's horizon (the schedule's `total`).
    pub total_steps: u64,
    /// The run seed (parameter init, batch order, dropout).
    pub seed: u64,
    /// The model as the user named it: a preset or a config path.
    pub model: String,
    pub schedule: LrSchedule,
    /// Anything else the caller wants back (data position, CLI flags, metrics).
    #[serde(default)]
    pub extra: Value,
    /// Checksums of the checkpoint's files ([`crate::integrity`]); a save fills them in.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub checksums: Checksums,
}

impl Manifest {
    /// A manifest of the current format with `extra` null.
    pub fn new(
        step: u64,
        total_steps: u64,
        seed: u64,
        model: impl Into<String>,
        schedule: LrSchedule,
    ) -> Manifest {
        Manifest {
            format_version: FORMAT_VERSION,
            step,
            total_steps,
            seed,
            model: model.into(),
            schedule,
            extra: Value::Null,
            checksums: Checksums::new(),
        }
    }
}

/// A loaded checkpoint directory.
#[derive(Debug)]
pub struct Checkpoint {
    pub manifest: Manifest,
    /// Parameters by HF name, dtypes as saved.
    pub params: HashMap<String, Tensor>,
    /// Optimizer state by [`optimizer_key`].
    pub optimizer: HashMap<String, Tensor>,
    pub config_json: Value,
    /// Where it was read from (`DIR`, also after recovery from `DIR.old-*`, unless the
    /// rename back failed).
    pub dir: PathBuf,
}

/// The key of a parameter's optimizer state: `<param>.adam_m`, `.adam_v`, `.master` (the
/// scope names `build_training_graph` gives these tensors).
pub fn optimizer_key(param: &str, kind: StateKind) -> String {
    tessera_ir::dist::state_key(param, kind)
}

pub(crate) fn err(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Checkpoint(msg.into())
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::Io { path: path.display().to_string(), source }
}

/// Checks what the `safetensors` crate and candle take on trust in a file's header: every
/// tensor's byte range lies inside the file and its shape's element count fits in memory
/// (they would otherwise overflow, in debug builds a panic).
pub(crate) fn check_header(bytes: &[u8]) -> std::result::Result<(), String> {
    let n = bytes.get(..8).ok_or("shorter than its 8-byte header length")?;
    let n = u64::from_le_bytes(n.try_into().map_err(|_| "no header length")?);
    let data = (bytes.len() as u64).saturating_sub(8);
    if n > data {
        return Err(format!("its header length {n} exceeds the file"));
    }
    let header: Value = serde_json::from_slice(&bytes[8..8 + n as usize])
        .map_err(|e| format!("its header is not JSON ({e})"))?;
    let entries = header.as_object().ok_or("its header is not a JSON object")?;
    for (name, t) in entries.iter().filter(|(k, _)| *k != "__metadata__") {
        let offsets = t.get("data_offsets").and_then(Value::as_array);
        let in_file = offsets.is_some_and(|o| {
            o.len() == 2 && o.iter().all(|v| v.as_u64().is_some_and(|x| x <= data - n))
        });
        if !in_file {
            return Err(format!("tensor {name}'s data_offsets lie outside the file"));
        }
        let dims =
            t.get("shape").and_then(Value::as_array).ok_or(format!("tensor {name}: no shape"))?;
        let fits = dims.iter().try_fold(1u64, |a, d| a.checked_mul(d.as_u64()?.max(1)));
        if fits.is_none_or(|c| c > isize::MAX as u64 / 8) {
            return Err(format!("tensor {name}: shape {dims:?} is too large"));
        }
    }
    Ok(())
}

/// Reads and parses one safetensors file; corruption is reported with the file's name.
pub(crate) fn read_safetensors(path: &Path) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    let valid = check_header(&bytes)
        .and_then(|()| SafeTensors::deserialize(&bytes).map(|_| ()).map_err(|e| e.to_string()));
    if let Err(e) = valid {
        return Err(err(format!(
            "{}: not a valid safetensors file ({e}); it is corrupt or truncated: re-download \
             or re-save it",
            path.display()
        )));
    }
    Ok(bytes)
}

/// The manifest's checksums of the file at `path` (named relative to the checkpoint: its
/// file name, or `shards/<name>` for a rank file).
pub(crate) fn checksum_of<'a>(
    path: &Path,
    manifest: &'a Manifest,
) -> Option<&'a crate::integrity::FileDigest> {
    let name = path.file_name()?.to_string_lossy();
    let shards = crate::dist_checkpoint::SHARDS_DIR;
    let in_shards = path.parent()?.file_name().is_some_and(|p| p == shards);
    let key = if in_shards { format!("{shards}/{name}") } else { name.into_owned() };
    manifest.checksums.get(&key)
}

// ---- checkpoint directories ----------------------------------------------------------------

/// `(parent, file name)` of a checkpoint directory path.
pub(crate) fn split_dir(dir: &Path) -> Result<(PathBuf, String)> {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).ok_or_else(|| {
        err(format!(
            "{}: a checkpoint path must end in a directory name (such as runs/ckpt)",
            dir.display()
        ))
    })?;
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

/// Siblings of `DIR` named `DIR.<kind>-<digits>` (leftovers of interrupted saves).
pub(crate) fn leftovers(parent: &Path, name: &str, kind: &str) -> Vec<PathBuf> {
    let prefix = format!("{name}.{kind}-");
    let Ok(entries) = std::fs::read_dir(parent) else { return Vec::new() };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.strip_prefix(&prefix)
                .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

/// fsync a directory so that renames and new entries in it are durable (no-op off Unix).
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    std::fs::File::open(dir).and_then(|f| f.sync_all()).map_err(io_err(dir))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(io_err(path))
}

pub(crate) fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value)
        .map_err(|e| err(format!("{}: cannot serialise: {e}", path.display())))?;
    text.push('\n');
    write_synced(path, text.as_bytes())
}

/// Writes a manifest (`doc`: a [`Manifest`], possibly with more keys) sealed with the
/// checksum of its text ([`crate::integrity`]).
pub(crate) fn write_manifest(path: &Path, doc: &impl Serialize) -> Result<()> {
    let mut text = serde_json::to_string_pretty(doc)
        .map_err(|e| err(format!("{}: cannot serialise: {e}", path.display())))?;
    text.push('\n');
    write_synced(path, seal(&text)?.as_bytes())
}

/// The checksums of the files `names` of directory `dir`, keyed by name.
pub(crate) fn digest_files(dir: &Path, names: &[String]) -> Result<Checksums> {
    let digest = |n: &String| digest_file(&dir.join(n), n.ends_with(".safetensors"));
    names.iter().map(|n| Ok((n.clone(), digest(n)?))).collect()
}

/// Writes `tensors` as a safetensors file with transformers' `{"format": "pt"}` metadata.
pub(crate) fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let contiguous = tensors
        .iter()
        .map(|(n, t)| Ok((n.as_str(), t.contiguous()?)))
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(contiguous, Some(metadata), path)
        .map_err(|e| err(format!("{}: cannot write safetensors: {e}", path.display())))?;
    crate::host::follow_umask(path)?;
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(io_err(path))
}

/// Names must be unique; optimizer keys must be `<param>.adam_m|adam_v|master` of a given
/// parameter with its shape.
pub(crate) fn check_tensor_sets<'a>(
    params: impl Iterator<Item = (&'a str, &'a Tensor)>,
    optimizer: impl Iterator<Item = (&'a str, &'a Tensor)>,
    what: &str,
) -> Result<()> {
    let mut problems = Vec::new();
    let mut shapes: HashMap<&str, &[usize]> = HashMap::new();
    for (name, t) in params {
        if shapes.insert(name, t.dims()).is_some() {
            problems.push(format!("parameter {name} is given twice"));
        }
    }
    let mut seen = BTreeSet::new();
    for (key, t) in optimizer {
        if !seen.insert(key) {
            problems.push(format!("optimizer state {key} is given twice"));
            continue;
        }
        let Some((param, _)) = tessera_ir::dist::split_state_key(key) else {
            problems.push(format!(
                "optimizer state {key}: the key must be <parameter>.adam_m, .adam_v or .master"
            ));
            continue;
        };
        match shapes.get(param) {
            None => problems.push(format!("optimizer state {key}: no parameter {param}")),
            Some(&dims) if dims != t.dims() => problems.push(format!(
                "optimizer state {key} has shape {:?} but parameter {param} has {dims:?}",
                t.dims()
            )),
            Some(_) => {}
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(err(format!("{what}:\n  {}", problems.join("\n  "))))
}

/// The dtype name transformers writes as `torch_dtype`.
pub(crate) fn torch_dtype(d: candle_core::DType) -> Option<&'static str> {
    Some(match d {
        candle_core::DType::F32 => "float32",
        candle_core::DType::F16 => "float16",
        candle_core::DType::BF16 => "bfloat16",
        candle_core::DType::F64 => "float64",
        _ => return None,
    })
}

/// Saves a checkpoint directory atomically (module docs: format and protocol). `config_json`
/// is the model's HF config (`ModelConfig::to_hf_json`); its `torch_dtype` (and `dtype`, if
/// present) is set to the parameters' dtype when they share one (the half-precision one
/// beside f32 ones). `params` are named by
/// their HF names; `optimizer` keys are [`optimizer_key`]s of those parameters.
pub fn save_checkpoint(
    dir: &Path,
    config_json: &Value,
    params: &[(String, Tensor)],
    optimizer: &[(String, Tensor)],
    manifest: &Manifest,
) -> Result<()> {
    if manifest.format_version != FORMAT_VERSION {
        return Err(err(format!(
            "cannot save a manifest of format_version {}: this build writes version \
             {FORMAT_VERSION} (use Manifest::new)",
            manifest.format_version
        )));
    }
    let Value::Object(mut config) = config_json.clone() else {
        return Err(err(
            "the checkpoint's config.json must be a JSON object (ModelConfig::to_hf_json)",
        ));
    };
    check_tensor_sets(
        params.iter().map(|(n, t)| (n.as_str(), t)),
        optimizer.iter().map(|(n, t)| (n.as_str(), t)),
        &format!("cannot save checkpoint {}", dir.display()),
    )?;
    // Mixed precision holds some parameters (norms, embeddings) in f32 beside the half
    // precision ones: the config states the half dtype, as transformers does for models that
    // keep modules in fp32.
    let mut halves =
        params.iter().map(|(_, t)| t.dtype()).filter(|&d| d != candle_core::DType::F32);
    let common = match halves.next() {
        Some(d) => Some(d).filter(|&d| halves.all(|h| h == d)),
        None => params.first().map(|(_, t)| t.dtype()),
    };
    if let Some(name) = common.and_then(torch_dtype) {
        config.insert("torch_dtype".into(), Value::from(name));
        if config.contains_key("dtype") {
            config.insert("dtype".into(), Value::from(name));
        }
    }

    let (parent, name) = split_dir(dir)?;
    refuse_non_checkpoint(dir)?;
    std::fs::create_dir_all(&parent).map_err(io_err(&parent))?;
    // 1. Leftovers of interrupted saves; `DIR.old-*` only when DIR is complete.
    for stale in leftovers(&parent, &name, "tmp") {
        let _ = std::fs::remove_dir_all(stale);
    }
    if dir.is_dir() {
        for stale in leftovers(&parent, &name, "old") {
            let _ = std::fs::remove_dir_all(stale);
        }
    }
    // 2. Everything into DIR.tmp-<pid>, the manifest last.
    let pid = std::process::id();
    let tmp = parent.join(format!("{name}.tmp-{pid}"));
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    let written = (|| {
        write_safetensors(&tmp.join(MODEL_FILE), &crate::expert_layout::to_hub_layout(params)?)?;
        write_safetensors(&tmp.join(OPTIMIZER_FILE), optimizer)?;
        write_json(&tmp.join(CONFIG_FILE), &config)?;
        let mut manifest = manifest.clone();
        let files = [MODEL_FILE, OPTIMIZER_FILE, CONFIG_FILE].map(String::from);
        manifest.checksums = digest_files(&tmp, &files)?;
        write_manifest(&tmp.join(MANIFEST_FILE), &manifest)?;
        sync_dir(&tmp)
    })();
    if let Err(e) = written {
        // A full disk must not stay full of a half-written save.
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    // 3. Swap: DIR → DIR.old-<pid>, DIR.tmp-<pid> → DIR.
    let old = parent.join(format!("{name}.old-{pid}"));
    let had_previous = dir.exists();
    if had_previous {
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(io_err(&old))?;
        }
        std::fs::rename(dir, &old).map_err(io_err(dir))?;
    }
    std::fs::rename(&tmp, dir).map_err(io_err(&tmp))?;
    sync_dir(&parent)?;
    // 4. The previous checkpoint, and any older one an earlier crash left behind.
    for stale in leftovers(&parent, &name, "old") {
        let _ = std::fs::remove_dir_all(stale);
    }
    Ok(())
}

/// Reads a manifest, checking its seal, then its version before its fields.
pub(crate) fn read_manifest(path: &Path) -> Result<Manifest> {
    Ok(read_manifest_value(path)?.0)
}

/// [`read_manifest`], with the whole document (a sharded manifest has more keys).
pub(crate) fn read_manifest_value(path: &Path) -> Result<(Manifest, Value)> {
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| err(format!("{}: malformed JSON ({e})", path.display())))?;
    match value.get("format_version").and_then(Value::as_u64) {
        Some(v) if v == u64::from(FORMAT_VERSION) => {}
        Some(v) => {
            return Err(err(format!(
                "{}: checkpoint format_version {v} is not supported: this build reads version \
                 {FORMAT_VERSION}; load it with the Tessera version that wrote it",
                path.display()
            )))
        }
        None => {
            return Err(err(format!(
                "{}: no integer \"format_version\"; not a Tessera checkpoint manifest",
                path.display()
            )))
        }
    }
    // After the version: a manifest of another format is named as such, not as corrupt.
    check_seal(path, &text)?;
    let manifest = serde_json::from_value(value.clone())
        .map_err(|e| err(format!("{}: invalid manifest: {e}", path.display())))?;
    Ok((manifest, value))
}

/// A checkpoint's `config.json`, checked against the manifest's checksum when it has one.
pub(crate) fn read_config(dir: &Path, manifest: &Manifest) -> Result<Value> {
    let path = dir.join(CONFIG_FILE);
    let bytes = std::fs::read(&path).map_err(io_err(&path))?;
    if let Some(want) = manifest.checksums.get(CONFIG_FILE) {
        verify_bytes(&path.display().to_string(), &bytes, want)?;
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| err(format!("{}: malformed JSON ({e})", path.display())))
}

/// All tensors of one safetensors file, as stored, checked against its checksums (when the
/// manifest has them) and for non-finite values.
pub(crate) fn read_all_tensors(
    path: &Path,
    manifest: &Manifest,
) -> Result<HashMap<String, Tensor>> {
    let bytes = read_safetensors(path)?;
    let label = path.display().to_string();
    if let Some(want) = checksum_of(path, manifest) {
        verify_bytes(&label, &bytes, want)?;
    }
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| err(format!("{label}: not a valid safetensors file ({e})")))?;
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            if let Ok(dtype) = candle_core::DType::try_from(view.dtype()) {
                check_finite(&label, &name, view.data(), dtype)?;
            }
            let t = view.load(&Device::Cpu).map_err(|e| {
                err(format!("{}: tensor {name} cannot be read: {e}", path.display()))
            })?;
            Ok((name, t))
        })
        .collect()
}

/// The directory to read for checkpoint `dir`: itself, or the previous checkpoint a save
/// killed between its two renames left as `DIR.old-<pid>` (renamed back to `DIR` when
/// possible).
pub(crate) fn recover_dir(dir: &Path) -> Result<PathBuf> {
    if dir.is_dir() {
        return Ok(dir.to_path_buf());
    }
    let (parent, name) = split_dir(dir)?;
    let mut best: Option<(u64, PathBuf)> = None;
    for old in leftovers(&parent, &name, "old") {
        if let Ok(m) = read_manifest(&old.join(MANIFEST_FILE)) {
            if best.as_ref().is_none_or(|(step, _)| m.step > *step) {
                best = Some((m.step, old));
            }
        }
    }
    match best {
        Some((_, old)) => {
            if std::fs::rename(&old, dir).is_ok() {
                sync_dir(&parent)?;
                Ok(dir.to_path_buf())
            } else {
                Ok(old)
            }
        }
        None => {
            let tmp = leftovers(&parent, &name, "tmp");
            let note = if tmp.is_empty() {
                String::new()
            } else {
                format!(
                    " ({} is an interrupted save and is never loaded)",
                    tmp.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
                )
            };
            Err(err(format!(
                "checkpoint directory {} does not exist{note}; check the path, or start \
                 without resuming",
                dir.display()
            )))
        }
    }
}

/// DIR is replaced whole by a save, so it must be a checkpoint (or empty, or absent): never
/// another directory or a file.
fn refuse_non_checkpoint(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    let foreign = if dir.is_dir() {
        let empty = std::fs::read_dir(dir).map_err(io_err(dir))?.next().is_none();
        !empty && !dir.join(MANIFEST_FILE).is_file()
    } else {
        true
    };
    if foreign {
        return Err(err(format!(
            "{} exists and is not a Tessera checkpoint (no {MANIFEST_FILE}); saving would \
             replace it: choose another checkpoint path",
            dir.display()
        )));
    }
    Ok(())
}

/// Checks, before any training, that a checkpoint of about `bytes` can be saved at `dir`
/// (the run should also hold the directory's [`crate::host::lock_dir`]). `dir` must be absent, empty or a
/// checkpoint (what a save may replace); its parent must exist or be creatable and writable
/// (a read-only file system fails here, not when the first save is due); and its file system
/// must have room for one more checkpoint, since a save writes the new one beside the old
/// before replacing it.
pub fn preflight_save(dir: &Path, bytes: u64) -> Result<()> {
    refuse_non_checkpoint(dir)?;
    let (parent, name) = split_dir(dir)?;
    std::fs::create_dir_all(&parent).map_err(|e| {
        err(format!("cannot create {} to save checkpoints in: {e}", parent.display()))
    })?;
    let probe = parent.join(format!(".{name}.probe-{}", std::process::id()));
    let written = std::fs::write(&probe, b"tessera");
    let _ = std::fs::remove_file(&probe);
    written.map_err(|e| {
        err(format!(
            "cannot write in {} to save checkpoints there: {e}; choose a writable path",
            parent.display()
        ))
    })?;
    // Leftovers of killed saves are removed by the next save; they do not count against it.
    let stale: u64 = leftovers(&parent, &name, "tmp").iter().map(|p| tree_bytes(p)).sum();
    if let Some(free) = crate::host::available_disk(&parent) {
        if free.saturating_add(stale) < bytes {
            return Err(err(format!(
                "{} has {} free but one checkpoint of this run needs about {}: free space \
                 there or choose another --save",
                parent.display(),
                crate::host::human(free),
                crate::host::human(bytes)
            )));
        }
    }
    Ok(())
}

/// Bytes of the files under `path`.
fn tree_bytes(path: &Path) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else { return 0 };
    if !meta.is_dir() {
        return meta.len();
    }
    std::fs::read_dir(path)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| tree_bytes(&e.path())).sum())
        .unwrap_or(0)
}

/// Loads a checkpoint directory written by [`save_checkpoint`], recovering the previous
/// checkpoint if a save was killed between its renames (module docs). Tensors come back
/// bit-exact, in their saved dtypes. A sharded checkpoint (`dist_checkpoint::save_sharded`)
/// is assembled into global tensors by `dist_checkpoint::load_sharded`.
pub fn load_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let dir = recover_dir(dir)?;
    // A checkpoint written by `dist_checkpoint::save_sharded` (after the same recovery):
    // its tensors are assembled from the per-rank files.
    if crate::dist_checkpoint::is_sharded(&dir) {
        return crate::dist_checkpoint::load_sharded_from(dir);
    }
    let manifest_path = dir.join(MANIFEST_FILE);
    if !manifest_path.is_file() {
        let hint = if dir.join(MODEL_FILE).is_file() || dir.join(MODEL_INDEX_FILE).is_file() {
            " It holds Hugging Face weights: load those with load_hf_weights (initialise from \
             them) instead of resuming"
        } else {
            ""
        };
        return Err(err(format!(
            "{}: no {MANIFEST_FILE}, so this is not a Tessera checkpoint.{hint}",
            dir.display()
        )));
    }
    let manifest = read_manifest(&manifest_path)?;
    let config_json = read_config(&dir, &manifest)?;
    let params = read_all_tensors(&dir.join(MODEL_FILE), &manifest)?;
    let params = crate::expert_layout::from_hub_layout(params)?;
    let optimizer = read_all_tensors(&dir.join(OPTIMIZER_FILE), &manifest)?;
    check_tensor_sets(
        params.iter().map(|(n, t)| (n.as_str(), t)),
        optimizer.iter().map(|(n, t)| (n.as_str(), t)),
        &format!("{}: inconsistent checkpoint", dir.display()),
    )?;
    Ok(Checkpoint { manifest, params, optimizer, config_json, dir })
}
