//! Sharded checkpoints of a parallel run: every rank writes its own shards
//! ([`save_sharded`]), any number of devices reads them back as global tensors
//! ([`load_sharded`], also reached through [`load_checkpoint`]), and [`export_hf`] turns a
//! checkpoint into a directory `transformers` loads with `from_pretrained`.
//!
//! # Directory (format_version 1, sharded)
//! ```text
//! DIR/config.json                      the model's HF config, torch_dtype set (as in
//!                                      checkpoint.rs)
//! DIR/manifest.json                    the [`Manifest`] fields, plus "sharded": a
//!                                      [`ShardedSection`]
//! DIR/shards/rank-00000.safetensors    rank 0's shards, one per tensor it writes, under the
//! DIR/shards/rank-00001.safetensors    tensor's name, in the tensor's dtype; header
//! ...                                  metadata {"format": "pt", "rank", "world_size",
//!                                      "step"}
//! ```
//! Every rank writes one file (possibly holding no tensor). A rank writes a tensor only when
//! it is the *writer* of its chunk: the lowest rank holding that chunk ([`crate::state_table`];
//! on an SPMD plan [`DeviceMesh::is_writer`]'s rank, coordinate 0 on every mesh axis the
//! placement does not split; under a pipeline a rank of the stage holding the tensor), so
//! replicas are stored once and every chunk exactly once. The manifest's `sharded` section
//! records the mesh shape, the world size, the
//! caller's `layout` (the plan, verbatim) and, for every tensor (sorted by name): its name,
//! role (`param` or `optimizer`: `<param>.adam_m|adam_v|master` of a saved parameter),
//! global shape, dtype (candle's name: `f32`, `bf16`, ...), placement, and its chunks, each
//! a per-dim chunk index and the rank whose file holds it. A chunk's extent along dim `d` is
//! `shape[d] / n_d`, `n_d` being the product of the mesh sizes of `placement[d]`'s axes.
//!
//! The directory is not a Hugging Face model directory (there is no `model.safetensors`):
//! [`export_hf`] writes one.
//!
//! # Save protocol
//! [`save_sharded`] is called by every rank with the same `dir` and step; the ranks must
//! share the file system `dir` is on. The ranks move in four rounds; each ends with an
//! all-gather over the world of (failed?, a number), which is both the barrier and the
//! way every rank learns whether any other failed, so that they all stop together after the
//! same round instead of waiting for a rank that gave up:
//! 1. each rank checks its tensors (placements, dtypes, names) and reports the length of its
//!    table (each tensor with the chunk it holds, and the step); then the tables travel in one
//!    all-gather and every rank merges them into the checkpoint's ([`crate::state_table`]):
//!    ranks at different steps, two ranks describing a tensor differently, or a chunk no rank
//!    holds fail the save on all;
//! 2. rank 0 refuses a `DIR` that is neither empty nor a checkpoint, removes leftovers of
//!    interrupted saves (`DIR.tmp-*`, and `DIR.old-*` when `DIR` exists), and creates the
//!    sibling `DIR.tmp-<step>/shards` (a name every rank computes; digits only, so that
//!    [`save_checkpoint`] and [`load_checkpoint`] also recognise it as a leftover);
//! 3. each rank writes `shards/rank-<rank:05>.safetensors` through a temporary file, fsynced,
//!    then renamed;
//! 4. rank 0 checks that every rank file is there (a rank writing to another file system
//!    shows up here), writes `config.json` and `manifest.json` (last), fsyncs, and swaps the
//!    directory in as [`save_checkpoint`] does: `DIR` → `DIR.old-<pid>`,
//!    `DIR.tmp-<step>` → `DIR`, fsync the parent, remove `DIR.old-*`.
//!
//! No rank returns `Ok` before the checkpoint is in place. When a round fails, every rank
//! returns an error (the failing rank its own, the others one naming it), rank 0 removes the
//! temporary directory, and `DIR` still holds the previous checkpoint (or, if the swap itself
//! failed between its renames, `DIR.old-<pid>` holds it and [`load_checkpoint`] recovers it).
//! A rank that dies or hangs is bounded by the communicator's timeout (its departure is
//! noticed at once where the transport can tell); that timeout must therefore exceed the
//! spread between the ranks' write times (round 3), or a slow file system fails the save. A killed save leaves at most a
//! `DIR.tmp-<step>` that is never loaded and is removed by the next save.
//!
//! # Loading
//! [`load_sharded`] (and [`load_checkpoint`], which dispatches to it when the manifest has a
//! `sharded` section or `DIR/shards` exists, after the same `DIR.old-*` recovery) checks the
//! section, then reads the rank files one at a time, copying each chunk's bytes into its
//! global tensor: bit-exact, in the saved dtype, whatever mesh wrote it. Missing or corrupt
//! rank files, missing or unexpected tensors, wrong shapes or dtypes and files written by
//! another rank or step are errors naming the file and the tensor. The peak is the global
//! tensors plus the largest rank file (`export` uses it). A run resuming under another plan
//! or device count reads only its shards instead, through
//! [`crate::mapped::MappedCheckpoint`].
//!
//! [`load_checkpoint`]: crate::checkpoint::load_checkpoint
//! [`save_checkpoint`]: crate::checkpoint::save_checkpoint

use crate::checkpoint::{
    check_tensor_sets, checksum_of, err, io_err, leftovers, read_config, read_manifest_value,
    read_safetensors, recover_dir, split_dir, sync_dir, torch_dtype, write_json, write_manifest,
    write_safetensors, Checkpoint, Manifest, CONFIG_FILE, FORMAT_VERSION, MANIFEST_FILE,
    MODEL_FILE,
};
use crate::collective::{DeviceMesh, Placement};
use crate::integrity::{check_finite, digest_file, verify_bytes, Checksums, FileDigest};
use crate::state_table::{gather_tables, merge, RankTable};
use crate::{Result, RuntimeError};
use candle_core::{DType, Device, Tensor};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use tessera_comm::{Communicator, Group};

/// The sub-directory of a sharded checkpoint holding the rank files.
pub const SHARDS_DIR: &str = "shards";

/// The file name (under [`SHARDS_DIR`]) of rank `rank`'s shards.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// Whether a tensor is a model parameter or optimizer state; decides whether a loaded tensor
/// goes to [`Checkpoint::params`] or [`Checkpoint::optimizer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TensorRole {
    Param,
    Optimizer,
}

/// Where one chunk of a tensor is stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkLocation {
    /// The chunk's index along every dim (0 along dims the placement does not split).
    pub index: Vec<usize>,
    /// The rank whose file holds it.
    pub rank: usize,
}

/// One global tensor of a sharded checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardedTensor {
    pub name: String,
    pub role: TensorRole,
    /// The global shape.
    pub shape: Vec<usize>,
    /// candle's dtype name (`f32`, `bf16`, ...).
    pub dtype: String,
    pub placement: Placement,
    /// Every chunk once.
    pub chunks: Vec<ChunkLocation>,
}

/// The `sharded` section of a sharded checkpoint's `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardedSection {
    /// The mesh that wrote the checkpoint.
    pub mesh: Vec<usize>,
    pub world_size: usize,
    /// Sorted by name.
    pub tensors: Vec<ShardedTensor>,
    /// The caller's description of the parallel layout (plan), stored verbatim.
    #[serde(default)]
    pub layout: Value,
}

/// Whether `dir` holds a sharded checkpoint: a `shards/` directory, or a manifest with a
/// `sharded` section. An unreadable manifest counts as not sharded, so that the caller's
/// ordinary loading reports it.
pub fn is_sharded(dir: &Path) -> bool {
    if dir.join(SHARDS_DIR).is_dir() {
        return true;
    }
    std::fs::read_to_string(dir.join(MANIFEST_FILE))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .is_some_and(|v| v.get("sharded").is_some())
}

/// The manifest and the sharded section of the checkpoint at `dir` (no recovery, no tensors
/// read): for a caller that wants the saved `layout` or the writing mesh.
pub fn read_sharded_manifest(dir: &Path) -> Result<(Manifest, ShardedSection)> {
    let path = dir.join(MANIFEST_FILE);
    let (manifest, value) = read_manifest_value(&path)?;
    let Some(section_value) = value.get("sharded") else {
        return Err(err(format!(
            "{}: no \"sharded\" section: {} is a single-device checkpoint; load it with \
             load_checkpoint",
            path.display(),
            dir.display()
        )));
    };
    let section: ShardedSection = serde_json::from_value(section_value.clone())
        .map_err(|e| err(format!("{}: invalid \"sharded\" section: {e}", path.display())))?;
    check_section(&section, &path)?;
    Ok((manifest, section))
}

// ---- placements --------------------------------------------------------------------------------

/// Chunks per dim of `placement` on a mesh of `shape`, checking that every axis exists and
/// splits at most one dim (otherwise some chunks would have no writer and others two).
fn chunk_grid(
    shape: &[usize],
    placement: &[Vec<usize>],
) -> std::result::Result<Vec<usize>, String> {
    let mut seen = BTreeSet::new();
    let mut grid = Vec::with_capacity(placement.len());
    for axes in placement {
        let mut n = 1usize;
        for &a in axes {
            let Some(&size) = shape.get(a) else {
                return Err(format!("mesh axis {a} is not in mesh {shape:?}"));
            };
            if !seen.insert(a) {
                return Err(format!("mesh axis {a} splits more than one dim"));
            }
            n = n.saturating_mul(size);
        }
        grid.push(n);
    }
    Ok(grid)
}

/// `param` when `name` is `<param>.adam_m|adam_v|master` of a name in `names`.
fn optimizer_base<'a>(name: &'a str, names: &BTreeSet<&str>) -> Option<&'a str> {
    tessera_ir::dist::split_state_key(name).map(|(base, _)| base).filter(|b| names.contains(b))
}

// ---- save ------------------------------------------------------------------------------------------

/// One tensor this rank passes to [`save_sharded`], checked.
struct Entry<'a> {
    local: &'a Tensor,
    table: ShardedTensor,
    writer: bool,
}

/// Round 1: this rank's tensors checked, and its table (each tensor with the one chunk this
/// rank holds) encoded for the exchange; `section` gets the merged table after it.
struct Prepared<'a> {
    entries: Vec<Entry<'a>>,
    section: ShardedSection,
    encoded: (Vec<f32>, usize),
}

fn prepare<'a>(
    mesh: &DeviceMesh,
    local: &'a [(String, Tensor, Placement)],
    manifest: &Manifest,
    layout: Value,
) -> Result<Prepared<'a>> {
    if manifest.format_version != FORMAT_VERSION {
        return Err(err(format!(
            "cannot save a manifest of format_version {}: this build writes version \
             {FORMAT_VERSION} (use Manifest::new)",
            manifest.format_version
        )));
    }
    let names: BTreeSet<&str> = local.iter().map(|(n, _, _)| n.as_str()).collect();
    let mut problems = Vec::new();
    if names.len() != local.len() {
        let mut seen = BTreeSet::new();
        for (n, _, _) in local {
            if !seen.insert(n.as_str()) {
                problems.push(format!("{n} is given twice"));
            }
        }
    }
    let mut entries = Vec::with_capacity(local.len());
    for (name, t, placement) in local {
        let dtype = t.dtype();
        if dtype.size_in_bytes() == 0 {
            problems.push(format!("{name}: dtype {} is not byte-sized", dtype.as_str()));
            continue;
        }
        if placement.len() != t.rank() {
            problems.push(format!(
                "{name}: placement {placement:?} has {} dims, the tensor {:?} has {}",
                placement.len(),
                t.dims(),
                t.rank()
            ));
            continue;
        }
        let grid = match chunk_grid(&mesh.shape, placement) {
            Ok(g) => g,
            Err(e) => {
                problems.push(format!("{name}: placement {placement:?}: {e}"));
                continue;
            }
        };
        let shape: Vec<usize> = t.dims().iter().zip(&grid).map(|(l, n)| l * n).collect();
        let role = if optimizer_base(name, &names).is_some() {
            TensorRole::Optimizer
        } else {
            TensorRole::Param
        };
        let index = placement.iter().map(|axes| Ok(mesh.chunk(axes)?.1)).collect::<Result<_>>()?;
        entries.push(Entry {
            local: t,
            // Known once the tables are merged.
            writer: false,
            table: ShardedTensor {
                name: name.clone(),
                role,
                shape,
                dtype: dtype.as_str().to_string(),
                placement: placement.clone(),
                chunks: vec![ChunkLocation { index, rank: mesh.rank }],
            },
        });
    }
    // The rule `check_tensor_sets` applies on load, on the global shapes (an optimizer state
    // may be placed differently from its parameter, so local shapes need not agree).
    let shapes: HashMap<&str, &[usize]> =
        entries.iter().map(|e| (e.table.name.as_str(), e.table.shape.as_slice())).collect();
    for e in &entries {
        if let Some(base) = optimizer_base(&e.table.name, &names) {
            if let Some(&want) = shapes.get(base) {
                if want != e.table.shape.as_slice() {
                    problems.push(format!(
                        "optimizer state {} has global shape {:?} but parameter {base} has \
                         {want:?}",
                        e.table.name, e.table.shape
                    ));
                }
            }
        }
    }
    if !problems.is_empty() {
        return Err(err(format!(
            "rank {}: cannot save these tensors:\n  {}",
            mesh.rank,
            problems.join("\n  ")
        )));
    }
    entries.sort_by(|a, b| a.table.name.cmp(&b.table.name));
    let section = ShardedSection {
        mesh: mesh.shape.clone(),
        world_size: mesh.size(),
        tensors: Vec::new(),
        layout,
    };
    let mine = RankTable {
        mesh: mesh.shape.clone(),
        step: manifest.step,
        tensors: entries.iter().map(|e| e.table.clone()).collect(),
    };
    Ok(Prepared { encoded: mine.encode()?, entries, section })
}

/// Values per rank in a round's all-gather: a failure flag and a number (round 1: the length
/// of the rank's table) as four 16-bit pieces (f32 holds them exactly).
const ROUND_LEN: usize = 5;

/// Ends a round of the save: every rank reports whether its part succeeded (with a number);
/// returns this rank's result if it failed, an error naming the ranks that did
/// otherwise, else the values by rank. The all-gather is also the round's barrier.
fn round<T>(
    comm: &mut dyn Communicator,
    world: &Group,
    dir: &Path,
    what: &str,
    mine: Result<T>,
    value: u64,
) -> Result<(T, Vec<u64>)> {
    let mut status = vec![if mine.is_err() { 1.0f32 } else { 0.0 }];
    status.extend((0..4).map(|k| ((value >> (16 * k)) & 0xffff) as f32));
    let gathered = comm.all_gather(world, &status);
    // Our own error explains the most; the others learn of it from the gather.
    let mine = mine?;
    let all = gathered.map_err(|e| {
        err(format!(
            "saving sharded checkpoint {} ({what}): {e}; the previous checkpoint is kept",
            dir.display()
        ))
    })?;
    if all.len() != world.len() * ROUND_LEN {
        return Err(err(format!(
            "saving sharded checkpoint {} ({what}): the all-gather returned {} values, \
             expected {}",
            dir.display(),
            all.len(),
            world.len() * ROUND_LEN
        )));
    }
    let failed: Vec<String> = all
        .chunks(ROUND_LEN)
        .enumerate()
        .filter(|(_, c)| c[0] != 0.0)
        .map(|(r, _)| r.to_string())
        .collect();
    if !failed.is_empty() {
        return Err(err(format!(
            "saving sharded checkpoint {} failed on rank(s) {} ({what}; their errors say why); \
             nothing was committed: the previous checkpoint is kept",
            dir.display(),
            failed.join(", ")
        )));
    }
    let values = all
        .chunks(ROUND_LEN)
        .map(|c| (0..4).fold(0u64, |h, k| h | ((c[1 + k] as u64) << (16 * k))))
        .collect();
    Ok((mine, values))
}

/// Refuses to replace an existing `dir` that is neither empty nor a Tessera checkpoint: the
/// swap replaces `dir` whole. (An export's destination: [`crate::guard::check_export_dest`].)
fn refuse_foreign(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    if dir.is_dir() {
        let mut names = Vec::new();
        for e in std::fs::read_dir(dir).map_err(io_err(dir))? {
            names.push(e.map_err(io_err(dir))?.file_name().to_string_lossy().into_owned());
        }
        if names.is_empty() || names.iter().any(|n| n == MANIFEST_FILE) {
            return Ok(());
        }
    }
    Err(err(format!(
        "{} exists and is not a Tessera checkpoint (no {MANIFEST_FILE}); writing would replace \
         it: choose another path",
        dir.display()
    )))
}

/// Round 2 (rank 0): a clean `DIR.tmp-<step>/shards`.
fn create_tmp(dir: &Path, parent: &Path, name: &str, tmp: &Path) -> Result<()> {
    refuse_foreign(dir)?;
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    for stale in leftovers(parent, name, "tmp") {
        let _ = std::fs::remove_dir_all(stale);
    }
    // Only when DIR is complete: otherwise a `DIR.old-*` is the last checkpoint.
    if dir.is_dir() {
        for stale in leftovers(parent, name, "old") {
            let _ = std::fs::remove_dir_all(stale);
        }
    }
    if tmp.exists() {
        std::fs::remove_dir_all(tmp).map_err(io_err(tmp))?;
    }
    let shards = tmp.join(SHARDS_DIR);
    std::fs::create_dir_all(&shards).map_err(io_err(&shards))
}

/// Round 3: this rank's file, through a temporary name so that a file under the final name
/// is always complete.
fn write_rank_file(tmp: &Path, mesh: &DeviceMesh, step: u64, entries: &[Entry<'_>]) -> Result<()> {
    let shards = tmp.join(SHARDS_DIR);
    let path = shards.join(rank_file_name(mesh.rank));
    let partial = shards.join(format!("{}.partial", rank_file_name(mesh.rank)));
    let tensors = entries
        .iter()
        .filter(|e| e.writer)
        .map(|e| Ok((e.table.name.as_str(), e.local.contiguous()?)))
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("rank".to_string(), mesh.rank.to_string()),
        ("world_size".to_string(), mesh.size().to_string()),
        ("step".to_string(), step.to_string()),
    ]);
    safetensors::serialize_to_file(tensors, Some(metadata), &partial)
        .map_err(|e| err(format!("{}: cannot write safetensors: {e}", partial.display())))?;
    crate::host::follow_umask(&partial)?;
    std::fs::File::open(&partial).and_then(|f| f.sync_all()).map_err(io_err(&partial))?;
    // The file's checksums, for rank 0 to put in the manifest (and remove).
    write_json(&digest_path(&shards, mesh.rank), &digest_file(&partial, true)?)?;
    std::fs::rename(&partial, &path).map_err(|e| {
        err(format!("{}: cannot rename into {}: {e}", partial.display(), path.display()))
    })
}

/// Where rank `rank` leaves its file's checksums for rank 0 during a save.
fn digest_path(shards: &Path, rank: usize) -> PathBuf {
    shards.join(format!("{}.xxh3.json", rank_file_name(rank)))
}

/// Rank 0: every rank's checksums (removing the files they came in) and `config.json`'s.
fn gather_digests(tmp: &Path, world_size: usize) -> Result<Checksums> {
    let shards = tmp.join(SHARDS_DIR);
    let mut sums = Checksums::new();
    for rank in 0..world_size {
        let path = digest_path(&shards, rank);
        let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
        let digest: FileDigest = serde_json::from_str(&text)
            .map_err(|e| err(format!("{}: malformed checksums ({e})", path.display())))?;
        sums.insert(format!("{SHARDS_DIR}/{}", rank_file_name(rank)), digest);
        std::fs::remove_file(&path).map_err(io_err(&path))?;
    }
    sums.insert(CONFIG_FILE.to_string(), digest_file(&tmp.join(CONFIG_FILE), false)?);
    Ok(sums)
}

/// The config `checkpoint::save_checkpoint` writes: `torch_dtype` (and `dtype`, if present)
/// set to the parameters' dtype when they share one (the half-precision one beside f32 ones).
fn config_with_dtype<'a>(
    config_json: &Value,
    param_dtypes: impl Iterator<Item = &'a str>,
) -> Result<Map<String, Value>> {
    let Value::Object(mut config) = config_json.clone() else {
        return Err(err(
            "the checkpoint's config.json must be a JSON object (ModelConfig::to_hf_json)",
        ));
    };
    // As `save_checkpoint`: the half-precision dtype beside f32 parameters (norms, embeddings).
    let dtypes: Vec<DType> = param_dtypes.filter_map(|d| d.parse::<DType>().ok()).collect();
    let mut halves = dtypes.iter().copied().filter(|&d| d != DType::F32);
    let common = match halves.next() {
        Some(d) => Some(d).filter(|&d| halves.all(|h| h == d)),
        None => dtypes.first().copied(),
    };
    if let Some(name) = common.and_then(torch_dtype) {
        config.insert("torch_dtype".into(), Value::from(name));
        if config.contains_key("dtype") {
            config.insert("dtype".into(), Value::from(name));
        }
    }
    Ok(config)
}

/// Moves the complete directory `tmp` to `dir` as `checkpoint::save_checkpoint` does: the
/// previous `dir` is renamed aside first and removed only once the new one is in place.
fn swap_in(tmp: &Path, dir: &Path, parent: &Path, name: &str) -> Result<()> {
    sync_dir(tmp)?;
    let old = parent.join(format!("{name}.old-{}", std::process::id()));
    if dir.exists() {
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(io_err(&old))?;
        }
        std::fs::rename(dir, &old).map_err(io_err(dir))?;
    }
    std::fs::rename(tmp, dir).map_err(io_err(tmp))?;
    sync_dir(parent)?;
    // The previous copy, and any older one an earlier crash left behind; a failure here is
    // harmless (the next save removes them, and `DIR` wins over them on load).
    for stale in leftovers(parent, name, "old") {
        let _ = std::fs::remove_dir_all(stale);
    }
    Ok(())
}

/// Round 4 (rank 0): checks the rank files, writes config and manifest, swaps `tmp` in.
fn commit(
    dir: &Path,
    tmp: &Path,
    parent: &Path,
    name: &str,
    prepared: &Prepared<'_>,
    config_json: &Value,
    manifest: &Manifest,
) -> Result<()> {
    let shards = tmp.join(SHARDS_DIR);
    let absent: Vec<String> = (0..prepared.section.world_size)
        .map(rank_file_name)
        .filter(|f| !shards.join(f).is_file())
        .collect();
    if !absent.is_empty() {
        return Err(err(format!(
            "{}: rank file(s) {} are missing although their ranks reported success; do all \
             ranks see the same file system at {}?",
            shards.display(),
            absent.join(", "),
            parent.display()
        )));
    }
    sync_dir(&shards)?;
    let config = config_with_dtype(
        config_json,
        prepared
            .section
            .tensors
            .iter()
            .filter(|t| t.role == TensorRole::Param)
            .map(|t| t.dtype.as_str()),
    )?;
    write_json(&tmp.join(CONFIG_FILE), &config)?;
    let mut manifest = manifest.clone();
    manifest.checksums = gather_digests(tmp, prepared.section.world_size)?;
    let Value::Object(mut doc) = serde_json::to_value(&manifest)
        .map_err(|e| err(format!("cannot serialise the manifest: {e}")))?
    else {
        return Err(err("the manifest does not serialise to a JSON object"));
    };
    doc.insert(
        "sharded".into(),
        serde_json::to_value(&prepared.section)
            .map_err(|e| err(format!("cannot serialise the sharded section: {e}")))?,
    );
    write_manifest(&tmp.join(MANIFEST_FILE), &doc)?;
    swap_in(tmp, dir, parent, name)
}

/// Saves this rank's part of a sharded checkpoint; every rank calls it with the same `dir`
/// and `manifest` (module docs: format and protocol). `local` is this rank's
/// `(name, local shard, placement)` for every parameter (HF names) and optimizer state
/// (`<param>.adam_m`, ...), as `SpmdTrainer::local_state` returns them. Rank 0's
/// `config_json` (the model's HF config), `manifest` and `layout` (the plan, stored verbatim)
/// are written. Returns once the checkpoint is in place, or an error on every rank.
pub fn save_sharded(
    dir: &Path,
    mesh: &DeviceMesh,
    local: &[(String, Tensor, Placement)],
    comm: &mut dyn Communicator,
    config_json: &Value,
    manifest: &Manifest,
    layout: Value,
) -> Result<()> {
    let n = mesh.size();
    // Without a matching communicator no round can be agreed on; the other ranks' next
    // collective fails (or times out) instead.
    if comm.world_size() != n || comm.rank() != mesh.rank {
        return Err(err(format!(
            "saving {}: the communicator is rank {} of {}, the mesh {:?} rank {}",
            dir.display(),
            comm.rank(),
            comm.world_size(),
            mesh.shape,
            mesh.rank
        )));
    }
    let world = Group::world(n)?;
    let lead = mesh.rank == 0;

    // Round 1: every rank's tensors, and agreement on the table.
    let checked =
        DeviceMesh::new(&mesh.shape, mesh.rank).map_err(RuntimeError::from).and_then(|m| {
            if m.coords != mesh.coords {
                return Err(err(format!(
                    "mesh {:?}: rank {} has coordinates {:?}, not {:?}",
                    mesh.shape, mesh.rank, m.coords, mesh.coords
                )));
            }
            if !config_json.is_object() {
                return Err(err(
                    "the checkpoint's config.json must be a JSON object (ModelConfig::to_hf_json)",
                ));
            }
            // Every rank needs the temporary directory's name: a bad path fails all of them.
            let (parent, name) = split_dir(dir)?;
            Ok((prepare(mesh, local, manifest, layout)?, parent, name))
        });
    // Every rank's table length rides on the round; then the tables themselves, merged into
    // the checkpoint's (the same on every rank, so a failure here fails every rank alike).
    let len = checked.as_ref().map(|(p, _, _)| p.encoded.1 as u64).unwrap_or(0);
    let ((mut prepared, parent, name), lens) =
        round(comm, &world, dir, "checking the tensors", checked, len)?;
    let lens: Vec<usize> = lens.into_iter().map(|l| l as usize).collect();
    let context =
        |e: RuntimeError| err(format!("saving sharded checkpoint {}: {e}", dir.display()));
    let tables = gather_tables(comm, &prepared.encoded.0, &lens).map_err(context)?;
    prepared.section.tensors = merge(&tables).map_err(context)?;
    let writes: BTreeSet<(&str, &[usize])> = prepared
        .section
        .tensors
        .iter()
        .flat_map(|t| {
            let me = t.chunks.iter().filter(|c| c.rank == mesh.rank);
            me.map(|c| (t.name.as_str(), c.index.as_slice()))
        })
        .collect();
    let mut entries = std::mem::take(&mut prepared.entries);
    for e in &mut entries {
        e.writer = writes.contains(&(e.table.name.as_str(), e.table.chunks[0].index.as_slice()));
    }
    prepared.entries = entries;

    // Round 2: rank 0 prepares the temporary directory.
    let tmp = parent.join(format!("{name}.tmp-{}", manifest.step));
    let created = if lead { create_tmp(dir, &parent, &name, &tmp) } else { Ok(()) };
    let created_ok = created.is_ok();
    let result = round(comm, &world, dir, "creating the temporary directory", created, 0)
        .and_then(|_| {
            // Round 3: every rank's file.
            let written = write_rank_file(&tmp, mesh, manifest.step, &prepared.entries);
            round(comm, &world, dir, "writing the rank files", written, 0)
        })
        .and_then(|_| {
            // Round 4: rank 0 commits; the others wait for it.
            let committed = if lead {
                commit(dir, &tmp, &parent, &name, &prepared, config_json, manifest)
            } else {
                Ok(())
            };
            round(comm, &world, dir, "committing", committed, 0)
        });
    if result.is_err() && lead && created_ok && tmp.exists() {
        // The save is abandoned on every rank (or a peer is gone): nobody writes here any
        // more. Best effort: the next save removes it anyway.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result.map(|_| ())
}

// ---- load --------------------------------------------------------------------------------------

/// One global tensor being assembled from its chunks.
struct Assembly {
    dtype: DType,
    chunk: Vec<usize>,
    bytes: Vec<u8>,
}

/// Copies one chunk (row-major bytes of shape `chunk`) at chunk position `index` into the
/// row-major bytes of the global tensor of shape `global`.
fn copy_chunk(
    dst: &mut [u8],
    global: &[usize],
    src: &[u8],
    chunk: &[usize],
    index: &[usize],
    elem: usize,
) {
    let k = global.len();
    if k == 0 {
        dst.copy_from_slice(src);
        return;
    }
    if chunk.contains(&0) {
        return;
    }
    // Byte strides of the global tensor.
    let mut stride = vec![elem; k];
    for d in (0..k - 1).rev() {
        stride[d] = stride[d + 1] * global[d + 1];
    }
    let row = chunk[k - 1] * elem;
    let rows: usize = chunk[..k - 1].iter().product();
    let mut pos = vec![0usize; k - 1];
    for r in 0..rows {
        let mut at = index[k - 1] * chunk[k - 1] * elem;
        for d in 0..k - 1 {
            at += (index[d] * chunk[d] + pos[d]) * stride[d];
        }
        dst[at..at + row].copy_from_slice(&src[r * row..(r + 1) * row]);
        // Odometer over the chunk's leading dims, last fastest.
        for d in (0..k - 1).rev() {
            pos[d] += 1;
            if pos[d] < chunk[d] {
                break;
            }
            pos[d] = 0;
        }
    }
}

/// A tensor's dtype and the shape of each of its chunks.
type ChunkShape = (DType, Vec<usize>);

/// The chunks to read from each rank's file: `(tensor index in the section, chunk index)`.
type ChunksByRank = BTreeMap<usize, Vec<(usize, Vec<usize>)>>;

/// Checks the section (every count, shape, placement and chunk index in range, no product
/// overflowing) and lists, per tensor, its dtype and chunk shape, and the chunks to read from
/// each rank's file. Every reader of a sharded checkpoint calls it before using the section.
pub(crate) fn check_section(
    section: &ShardedSection,
    manifest_path: &Path,
) -> Result<(Vec<ChunkShape>, ChunksByRank)> {
    let bad = |msg: String| err(format!("{}: {msg}", manifest_path.display()));
    let world = section.mesh.iter().try_fold(1usize, |a, &b| a.checked_mul(b)).unwrap_or(0);
    if section.mesh.is_empty() || world == 0 || world != section.world_size {
        return Err(bad(format!(
            "sharded.mesh {:?} does not match world_size {}",
            section.mesh, section.world_size
        )));
    }
    let mut names = BTreeSet::new();
    let mut tensors = Vec::with_capacity(section.tensors.len());
    let mut by_rank = ChunksByRank::new();
    for (i, t) in section.tensors.iter().enumerate() {
        let name = &t.name;
        if !names.insert(name.as_str()) {
            return Err(bad(format!("tensor {name} is listed twice")));
        }
        let dtype: DType = t
            .dtype
            .parse()
            .map_err(|_| bad(format!("tensor {name}: unknown dtype {:?}", t.dtype)))?;
        let elem = dtype.size_in_bytes();
        if elem == 0 {
            return Err(bad(format!("tensor {name}: dtype {} is not byte-sized", t.dtype)));
        }
        if t.placement.len() != t.shape.len() {
            return Err(bad(format!(
                "tensor {name}: placement {:?} has {} dims, its shape {:?} has {}",
                t.placement,
                t.placement.len(),
                t.shape,
                t.shape.len()
            )));
        }
        let grid = chunk_grid(&section.mesh, &t.placement)
            .map_err(|e| bad(format!("tensor {name}: placement {:?}: {e}", t.placement)))?;
        if t.shape.iter().zip(&grid).any(|(s, n)| !s.is_multiple_of(*n)) {
            return Err(bad(format!(
                "tensor {name}: shape {:?} does not split into {grid:?} chunks",
                t.shape
            )));
        }
        let chunk: Vec<usize> = t.shape.iter().zip(&grid).map(|(s, n)| s / n).collect();
        // Every chunk index in the grid exactly once, from a rank of the mesh.
        let mut seen = BTreeSet::new();
        for c in &t.chunks {
            if c.rank >= world {
                return Err(bad(format!(
                    "tensor {name}: a chunk is on rank {}, the mesh has {world} ranks",
                    c.rank
                )));
            }
            if c.index.len() != grid.len() || c.index.iter().zip(&grid).any(|(i, n)| i >= n) {
                return Err(bad(format!(
                    "tensor {name}: chunk index {:?} is outside the chunk grid {grid:?}",
                    c.index
                )));
            }
            if !seen.insert(c.index.clone()) {
                return Err(bad(format!("tensor {name}: chunk {:?} is listed twice", c.index)));
            }
            by_rank.entry(c.rank).or_default().push((i, c.index.clone()));
        }
        let want: usize = grid.iter().product();
        if seen.len() != want {
            return Err(bad(format!(
                "tensor {name}: {} chunk(s) listed, its placement {:?} on mesh {:?} makes \
                 {want}; the manifest is incomplete",
                seen.len(),
                t.placement,
                section.mesh
            )));
        }
        let size = t.shape.iter().try_fold(elem, |a, &b| a.checked_mul(b.max(1)));
        if size.is_none_or(|s| s > isize::MAX as usize) {
            return Err(bad(format!("tensor {name}: shape {:?} is too large", t.shape)));
        }
        tensors.push((dtype, chunk));
    }
    Ok((tensors, by_rank))
}

/// One empty global buffer per tensor (allocated when its first chunk is read, so a manifest
/// claiming more than its files hold fails on the files, not on the allocation), and the
/// chunks to read.
fn plan_assembly(
    section: &ShardedSection,
    manifest_path: &Path,
) -> Result<(Vec<Assembly>, ChunksByRank)> {
    let (tensors, by_rank) = check_section(section, manifest_path)?;
    let assemblies =
        tensors.into_iter().map(|(dtype, chunk)| Assembly { dtype, chunk, bytes: Vec::new() });
    Ok((assemblies.collect(), by_rank))
}

/// Reads one rank file and copies the chunks the manifest assigns to it.
fn read_rank_file(
    path: &Path,
    rank: usize,
    manifest: &Manifest,
    wanted: &[(usize, Vec<usize>)],
    section: &ShardedSection,
    assemblies: &mut [Assembly],
) -> Result<()> {
    if !path.is_file() {
        let names: Vec<&str> =
            wanted.iter().take(3).map(|(i, _)| section.tensors[*i].name.as_str()).collect();
        return Err(err(format!(
            "{}: rank file missing: it holds {} chunk(s) (of {}{}); the checkpoint is \
             incomplete, so resume from another one",
            path.display(),
            wanted.len(),
            names.join(", "),
            if wanted.len() > names.len() { ", ..." } else { "" }
        )));
    }
    let bytes = read_safetensors(path)?;
    if let Some(want) = checksum_of(path, manifest) {
        verify_bytes(&path.display().to_string(), &bytes, want)?;
    }
    let step = manifest.step;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| err(format!("{}: not a valid safetensors file ({e})", path.display())))?;
    // A file copied from another rank or save would pass the shape checks: its header says
    // which rank and step wrote it.
    if let Ok((_, meta)) = SafeTensors::read_metadata(&bytes) {
        let info = meta.metadata().clone().unwrap_or_default();
        for (key, want) in [("rank", rank.to_string()), ("step", step.to_string())] {
            if let Some(got) = info.get(key) {
                if *got != want {
                    return Err(err(format!(
                        "{}: written for {key} {got}, but the manifest expects {key} {want}: \
                         the directory mixes files of different saves or ranks",
                        path.display()
                    )));
                }
            }
        }
    }
    let expected: BTreeSet<&str> =
        wanted.iter().map(|(i, _)| section.tensors[*i].name.as_str()).collect();
    let mut extra: Vec<&str> = st.names().into_iter().filter(|n| !expected.contains(n)).collect();
    if !extra.is_empty() {
        extra.sort();
        return Err(err(format!(
            "{}: holds tensor(s) {} that the manifest does not assign to rank {rank}: the \
             directory mixes files of different saves",
            path.display(),
            extra.join(", ")
        )));
    }
    for (i, index) in wanted {
        let t = &section.tensors[*i];
        let a = &mut assemblies[*i];
        let view = st.tensor(&t.name).map_err(|_| {
            err(format!(
                "{}: tensor {} (chunk {index:?}) is missing from this rank file",
                path.display(),
                t.name
            ))
        })?;
        let got = DType::try_from(view.dtype()).ok();
        if got != Some(a.dtype) {
            return Err(err(format!(
                "{}: tensor {} is {:?}, the manifest says {}",
                path.display(),
                t.name,
                view.dtype(),
                t.dtype
            )));
        }
        if view.shape() != a.chunk.as_slice() {
            return Err(err(format!(
                "{}: tensor {} (chunk {index:?}) has shape {:?}, expected {:?} (global {:?} \
                 under placement {:?} on mesh {:?})",
                path.display(),
                t.name,
                view.shape(),
                a.chunk,
                t.shape,
                t.placement,
                section.mesh
            )));
        }
        let elem = a.dtype.size_in_bytes();
        if view.data().len() != a.chunk.iter().product::<usize>() * elem {
            return Err(err(format!(
                "{}: tensor {} holds {} bytes, its shape needs {}",
                path.display(),
                t.name,
                view.data().len(),
                a.chunk.iter().product::<usize>() * elem
            )));
        }
        check_finite(&path.display().to_string(), &t.name, view.data(), a.dtype)?;
        if a.bytes.is_empty() {
            // Checked by `check_section` not to overflow.
            let size: usize = t.shape.iter().product::<usize>() * elem;
            a.bytes.try_reserve_exact(size).map_err(|_| {
                err(format!(
                    "{}: not enough memory for tensor {} {:?} ({} bytes): load it on a machine \
                     with more memory, or resume on more devices, which read only their shards",
                    path.display(),
                    t.name,
                    t.shape,
                    size
                ))
            })?;
            a.bytes.resize(size, 0);
        }
        copy_chunk(&mut a.bytes, &t.shape, view.data(), &a.chunk, index, elem);
    }
    Ok(())
}

/// Loads a sharded checkpoint written by [`save_sharded`] as global tensors, recovering the
/// previous checkpoint if a save was killed between its renames (module docs).
pub fn load_sharded(dir: &Path) -> Result<Checkpoint> {
    let dir = recover_dir(dir)?;
    load_sharded_from(dir)
}

/// [`load_sharded`] of a directory already recovered (`load_checkpoint`'s dispatch).
pub(crate) fn load_sharded_from(dir: PathBuf) -> Result<Checkpoint> {
    let manifest_path = dir.join(MANIFEST_FILE);
    if !manifest_path.is_file() {
        return Err(err(format!(
            "{}: no {MANIFEST_FILE}, so this is not a complete Tessera checkpoint",
            dir.display()
        )));
    }
    let (manifest, section) = read_sharded_manifest(&dir)?;
    let config_json = read_config(&dir, &manifest)?;

    let (mut assemblies, by_rank) = plan_assembly(&section, &manifest_path)?;
    let shards = dir.join(SHARDS_DIR);
    for (rank, wanted) in &by_rank {
        let path = shards.join(rank_file_name(*rank));
        read_rank_file(&path, *rank, &manifest, wanted, &section, &mut assemblies)?;
    }
    let mut params = HashMap::new();
    let mut optimizer = HashMap::new();
    for (t, a) in section.tensors.iter().zip(assemblies) {
        let value = Tensor::from_raw_buffer(&a.bytes, a.dtype, &t.shape, &Device::Cpu)?;
        match t.role {
            TensorRole::Param => params.insert(t.name.clone(), value),
            TensorRole::Optimizer => optimizer.insert(t.name.clone(), value),
        };
    }
    check_tensor_sets(
        params.iter().map(|(n, t)| (n.as_str(), t)),
        optimizer.iter().map(|(n, t)| (n.as_str(), t)),
        &format!("{}: inconsistent checkpoint", dir.display()),
    )?;
    Ok(Checkpoint { manifest, params, optimizer, config_json, dir })
}

// ---- export --------------------------------------------------------------------------------------

/// Writes `ckpt`'s model as a Hugging Face directory at `out`: `config.json` (torch_dtype set)
/// and `model.safetensors` (the global parameters under their HF names, tied tensors once,
/// experts per expert, `{"format": "pt"}`: what `save_checkpoint` writes there and
/// `save_pretrained` would), so
/// `AutoModelFor*.from_pretrained(out)` loads it. Atomic like a checkpoint save (a sibling
/// `out.tmp-<pid>` swapped in), with [`crate::guard::EXPORT_MARKER`]; `out` must be what
/// [`crate::guard::check_export_dest`] lets an export replace (`replace`: its `force`). The
/// optimizer state is not exported.
pub fn export_hf(ckpt: &Checkpoint, out: &Path, replace: bool) -> Result<()> {
    let mut params: Vec<(String, Tensor)> =
        ckpt.params.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
    if params.is_empty() {
        return Err(err(format!(
            "cannot export {} to {}: the checkpoint has no parameters",
            ckpt.dir.display(),
            out.display()
        )));
    }
    params.sort_by(|a, b| a.0.cmp(&b.0));
    let config =
        config_with_dtype(&ckpt.config_json, params.iter().map(|(_, t)| t.dtype().as_str()))?;
    crate::guard::check_export_dest(&ckpt.dir, out, replace)?;
    let (parent, name) = split_dir(out)?;
    std::fs::create_dir_all(&parent).map_err(io_err(&parent))?;
    for stale in leftovers(&parent, &name, "tmp") {
        let _ = std::fs::remove_dir_all(stale);
    }
    if out.is_dir() {
        for stale in leftovers(&parent, &name, "old") {
            let _ = std::fs::remove_dir_all(stale);
        }
    }
    let tmp = parent.join(format!("{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    let params = crate::expert_layout::to_hub_layout(&params)?;
    let written = write_safetensors(&tmp.join(MODEL_FILE), &params)
        .and_then(|()| write_json(&tmp.join(CONFIG_FILE), &config))
        .and_then(|()| {
            let marker = crate::guard::export_marker(&ckpt.dir, ckpt.manifest.step);
            write_json(&tmp.join(crate::guard::EXPORT_MARKER), &marker)
        })
        .and_then(|()| swap_in(&tmp, out, &parent, &name));
    if written.is_err() && tmp.exists() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written
}
