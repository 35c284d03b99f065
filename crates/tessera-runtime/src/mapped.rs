//! Where a device's starting state comes from ([`ShardSource`]: global tensors by name, of
//! which a device asks only its shard), and checkpoints read slice by slice: safetensors files
//! mapped into memory, and tensors stored whole or as chunks across files, from which a device
//! copies out exactly the elements of its own shard ([`MappedTensors`], a [`ShardSource`]). [`MappedCheckpoint`] opens either kind of
//! checkpoint `train` saves — the single-device directory (`model.safetensors` +
//! `optimizer.safetensors`) or the sharded one (`shards/rank-*.safetensors`, any mesh) — so a
//! run resumes under any plan without any process holding a global copy of the state.
//! [`crate::hf_weights::HfWeights`] reads Hugging Face weights the same way.
//!
//! Opening checks every header (corruption, names, shapes, dtypes, which rank and step wrote
//! a rank file) and reads no tensor data; a read copies the intersection of the wanted block
//! with each stored piece, converted to the wanted dtype (bit-exact when it is the stored
//! one).

use crate::checkpoint::{
    checksum_of, err, io_err, read_config, read_manifest, recover_dir, Manifest, MANIFEST_FILE,
    MODEL_FILE, OPTIMIZER_FILE,
};
use crate::collective::{DeviceMesh, Placement};
use crate::dist_checkpoint::{
    is_sharded, rank_file_name, read_sharded_manifest, TensorRole, SHARDS_DIR,
};
use crate::integrity::{check_finite, verify_part, FileDigest};
use crate::{Result, RuntimeError};
use candle_core::{DType, Device, Tensor};
use safetensors::SafeTensors;
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Global tensors by name that a device takes its shards from.
pub trait ShardSource: Sync {
    /// This device's shard of tensor `name` under `placement` as `dtype`; `None` when the
    /// source has no tensor of that name.
    fn shard_of(
        &self,
        name: &str,
        placement: &Placement,
        mesh: &DeviceMesh,
        dtype: candle_core::DType,
    ) -> Result<Option<Tensor>>;
}

/// Whole tensors in memory: each device slices its shard out of them.
impl ShardSource for HashMap<String, Tensor> {
    fn shard_of(
        &self,
        name: &str,
        placement: &Placement,
        mesh: &DeviceMesh,
        dtype: candle_core::DType,
    ) -> Result<Option<Tensor>> {
        let Some(global) = self.get(name) else { return Ok(None) };
        Ok(Some(crate::collective::shard(mesh, global, placement, name)?.to_dtype(dtype)?))
    }
}

/// A tensor's dtype in a file: candle's, or the file's own when candle has no such dtype (an
/// error only if the tensor is read).
pub(crate) type FileDtype = std::result::Result<DType, safetensors::Dtype>;

/// One mapped safetensors file: its tensors (name → dtype, shape, byte range of the data),
/// its header metadata, and the checksums it was saved with, if known.
pub(crate) struct MappedFile {
    pub(crate) path: PathBuf,
    map: memmap2::Mmap,
    pub(crate) tensors: HashMap<String, (FileDtype, Vec<usize>, std::ops::Range<usize>)>,
    pub(crate) metadata: HashMap<String, String>,
    digest: Option<FileDigest>,
    /// Tensors already checked (checksum, finite values) by a read.
    checked: Mutex<HashSet<String>>,
}

impl MappedFile {
    /// Maps `path` and parses its header; corruption and unsupported dtypes are named with
    /// the file. With `digest` (the manifest's checksums of the file), the length and header
    /// are checked now and each tensor's bytes when it is first read.
    pub(crate) fn open(path: &Path, digest: Option<&FileDigest>) -> Result<MappedFile> {
        let file = std::fs::File::open(path).map_err(io_err(path))?;
        // SAFETY: the map is read-only; saves replace checkpoint directories by rename and
        // never rewrite a file in place, so a mapped file does not change under the reader.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(path))?;
        let checked = crate::checkpoint::check_header(&map)
            .and_then(|()| SafeTensors::read_metadata(&map).map_err(|e| e.to_string()));
        let (header, metadata) = checked.map_err(|e| {
            err(format!(
                "{}: not a valid safetensors file ({e}); it is corrupt or truncated: \
                 re-download or re-save it",
                path.display()
            ))
        })?;
        let label = path.display().to_string();
        if let Some(d) = digest {
            if map.len() as u64 != d.bytes {
                return Err(err(format!(
                    "{label}: {} bytes, but {} were saved: the file is truncated or was \
                     replaced; resume from another checkpoint or re-save it",
                    map.len(),
                    d.bytes
                )));
            }
            if let Some(want) = &d.header_xxh3 {
                verify_part(&label, "its header", &map[..8 + header], want)?;
            }
        }
        let mut tensors = HashMap::new();
        for (name, info) in metadata.tensors() {
            // A dtype candle lacks (bool masks, 8-bit floats) is an error only if it is read.
            let dtype = DType::try_from(info.dtype).map_err(|_| info.dtype);
            let (a, b) = info.data_offsets;
            let range = (8 + header + a)..(8 + header + b);
            if range.end > map.len() {
                return Err(err(format!(
                    "{label}: tensor {name}'s bytes lie beyond the end of the file: it is \
                     truncated; re-download or re-save it"
                )));
            }
            tensors.insert(name, (dtype, info.shape.clone(), range));
        }
        let meta = metadata.metadata().clone().unwrap_or_default();
        Ok(MappedFile {
            path: path.to_path_buf(),
            map,
            tensors,
            metadata: meta,
            digest: digest.cloned(),
            checked: Mutex::new(HashSet::new()),
        })
    }

    /// Checks tensor `name` before its first read: its checksum (when the file's are known)
    /// and that it holds no NaN or infinity.
    fn check(&self, name: &str) -> Result<()> {
        let seen = |c: &Mutex<HashSet<String>>| c.lock().map(|s| s.contains(name)).unwrap_or(false);
        if seen(&self.checked) {
            return Ok(());
        }
        let Some((dtype, _, range)) = self.tensors.get(name) else { return Ok(()) };
        let label = self.path.display().to_string();
        let data = &self.bytes()[range.clone()];
        if let Some(d) = &self.digest {
            let want = d.tensors.get(name).ok_or_else(|| {
                err(format!("{label}: tensor {name} has no saved checksum: the file was replaced"))
            })?;
            verify_part(&label, &format!("tensor {name}"), data, want)?;
        }
        if let Ok(dtype) = dtype {
            check_finite(&label, name, data, *dtype)?;
        }
        if let Ok(mut c) = self.checked.lock() {
            c.insert(name.to_string());
        }
        Ok(())
    }

    fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// Copies the block of `extent` at `src_origin` of a row-major `src` of shape `src_shape` to
/// `dst_origin` of a row-major `dst` of shape `dst_shape` (`width` bytes per element).
#[allow(clippy::too_many_arguments)]
fn copy_block(
    src: &[u8],
    src_shape: &[usize],
    src_origin: &[usize],
    dst: &mut [u8],
    dst_shape: &[usize],
    dst_origin: &[usize],
    extent: &[usize],
    width: usize,
) {
    let k = extent.len();
    if extent.contains(&0) {
        return;
    }
    if k == 0 {
        dst[..width].copy_from_slice(&src[..width]);
        return;
    }
    let strides = |shape: &[usize]| {
        let mut s = vec![width; k];
        for d in (0..k - 1).rev() {
            s[d] = s[d + 1] * shape[d + 1];
        }
        s
    };
    let (ss, ds) = (strides(src_shape), strides(dst_shape));
    let run = extent[k - 1] * width;
    let rows: usize = extent[..k - 1].iter().product();
    let mut pos = vec![0usize; k - 1];
    for _ in 0..rows {
        let (mut s, mut d) = (src_origin[k - 1] * width, dst_origin[k - 1] * width);
        for i in 0..k - 1 {
            s += (src_origin[i] + pos[i]) * ss[i];
            d += (dst_origin[i] + pos[i]) * ds[i];
        }
        dst[d..d + run].copy_from_slice(&src[s..s + run]);
        for i in (0..k - 1).rev() {
            pos[i] += 1;
            if pos[i] < extent[i] {
                break;
            }
            pos[i] = 0;
        }
    }
}

/// A stored block of a global tensor: tensor `name` of file `file`, at `origin`.
#[derive(Clone, Debug)]
struct Piece {
    file: usize,
    name: String,
    origin: Vec<usize>,
    shape: Vec<usize>,
}

/// A global tensor stored as pieces that tile it.
#[derive(Clone, Debug)]
pub(crate) struct Stored {
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    pieces: Vec<Piece>,
}

/// Global tensors by name, each stored whole or in pieces across mapped files.
#[derive(Clone)]
pub struct MappedTensors {
    files: Arc<Vec<MappedFile>>,
    tensors: HashMap<String, Stored>,
}

impl std::fmt::Debug for MappedTensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let files: Vec<_> = self.files.iter().map(|m| &m.path).collect();
        f.debug_struct("MappedTensors")
            .field("files", &files)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl MappedTensors {
    /// Every tensor of `file` (index `k` of `files`), stored whole, by its name.
    pub(crate) fn whole(files: Arc<Vec<MappedFile>>, k: usize) -> Result<MappedTensors> {
        let names: Vec<String> = files[k].tensors.keys().cloned().collect();
        let entries = names.into_iter().map(|n| (n.clone(), k, n)).collect();
        MappedTensors::renamed(files, entries)
    }

    /// Tensors stored whole under another name: `(key, file, name in the file)`.
    pub(crate) fn renamed(
        files: Arc<Vec<MappedFile>>,
        entries: Vec<(String, usize, String)>,
    ) -> Result<MappedTensors> {
        let mut tensors = HashMap::with_capacity(entries.len());
        for (key, k, name) in entries {
            let (dtype, shape, _) = files[k].tensors[&name].clone();
            let dtype = dtype.map_err(|d| {
                err(format!(
                    "{}: {name} has dtype {d:?}, which Tessera cannot read",
                    files[k].path.display()
                ))
            })?;
            let piece = Piece { file: k, name, origin: vec![0; shape.len()], shape: shape.clone() };
            tensors.insert(key, Stored { shape, dtype, pieces: vec![piece] });
        }
        Ok(MappedTensors { files, tensors })
    }

    /// Every tensor of `file` `k` by its name, the Hub's per-expert tensors
    /// (`…experts.{e}.w1.weight`) stacked into their parameter (`…experts.w1.weight`, dim 0
    /// the expert: [`crate::expert_layout`]).
    pub(crate) fn whole_stacking_experts(
        files: Arc<Vec<MappedFile>>,
        k: usize,
    ) -> Result<MappedTensors> {
        let names = files[k].tensors.keys().map(|n| (n.clone(), k));
        let (plain, stacked) = crate::expert_layout::group_per_expert(names)?;
        let entries = plain.into_iter().map(|(n, k)| (n.clone(), k, n)).collect();
        let stacked = stacked
            .into_iter()
            .map(|(key, rows)| (key, rows.into_iter().map(|(n, k)| (k, n)).collect()))
            .collect();
        MappedTensors::renamed(files, entries)?.with_stacked(stacked)
    }

    /// Adds tensors stacked along a new dim 0 from whole tensors of one shape and dtype:
    /// `(key, [(file, name in the file)] in row order)`, each row read as a piece in place.
    pub(crate) fn with_stacked(
        mut self,
        entries: Vec<(String, Vec<(usize, String)>)>,
    ) -> Result<MappedTensors> {
        for (key, rows) in entries {
            let mut pieces = Vec::with_capacity(rows.len());
            let mut first: Option<(DType, Vec<usize>, String)> = None;
            for (e, (k, name)) in rows.into_iter().enumerate() {
                let (dtype, shape, _) = self.files[k].tensors[&name].clone();
                let dtype = dtype.map_err(|d| {
                    err(format!(
                        "{}: {name} has dtype {d:?}, which Tessera cannot read",
                        self.files[k].path.display()
                    ))
                })?;
                match &first {
                    None => first = Some((dtype, shape.clone(), name.clone())),
                    Some((d, s, n)) if *d != dtype || *s != shape => {
                        return Err(err(format!(
                            "{key}: {name} is {dtype:?} {shape:?} but {n} is {d:?} {s:?}; \
                             every expert of a layer must have one shape and dtype"
                        )))
                    }
                    Some(_) => {}
                }
                let mut origin = vec![0; shape.len() + 1];
                origin[0] = e;
                let piece_shape = std::iter::once(1).chain(shape).collect();
                pieces.push(Piece { file: k, name, origin, shape: piece_shape });
            }
            let Some((dtype, row, _)) = first else { continue };
            let shape = std::iter::once(pieces.len()).chain(row).collect();
            if self.tensors.insert(key.clone(), Stored { shape, dtype, pieces }).is_some() {
                return Err(err(format!("{key} is given both stacked and per expert")));
            }
        }
        Ok(self)
    }

    /// The names and (shape, dtype) of the tensors.
    pub fn shapes(&self) -> impl Iterator<Item = (&str, &[usize], DType)> {
        self.tensors.iter().map(|(n, s)| (n.as_str(), s.shape.as_slice(), s.dtype))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The block of tensor `name` at `origin` of `extent`, as `dtype`.
    pub fn read(
        &self,
        name: &str,
        origin: &[usize],
        extent: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| err(format!("no tensor `{name}` in the checkpoint")))?;
        let width = t.dtype.size_in_bytes();
        let mut out = vec![0u8; extent.iter().product::<usize>() * width];
        for p in &t.pieces {
            // The intersection of the wanted block with this piece.
            let lo: Vec<usize> = (0..extent.len()).map(|d| origin[d].max(p.origin[d])).collect();
            let hi: Vec<usize> = (0..extent.len())
                .map(|d| (origin[d] + extent[d]).min(p.origin[d] + p.shape[d]))
                .collect();
            if lo.iter().zip(&hi).any(|(l, h)| l >= h) {
                continue;
            }
            let file = &self.files[p.file];
            file.check(&p.name)?;
            let start = file.tensors[&p.name].2.start;
            let src = &file.bytes()[start..];
            let inter: Vec<usize> = lo.iter().zip(&hi).map(|(l, h)| h - l).collect();
            let src_origin: Vec<usize> = lo.iter().zip(&p.origin).map(|(l, o)| l - o).collect();
            let dst_origin: Vec<usize> = lo.iter().zip(origin).map(|(l, o)| l - o).collect();
            copy_block(src, &p.shape, &src_origin, &mut out, extent, &dst_origin, &inter, width);
        }
        let value = Tensor::from_raw_buffer(&out, t.dtype, extent, &Device::Cpu)?;
        Ok(if t.dtype == dtype { value } else { value.to_dtype(dtype)? })
    }

    /// This device's shard of `name` under `placement`, as `dtype`.
    pub fn shard(
        &self,
        name: &str,
        placement: &Placement,
        mesh: &DeviceMesh,
        dtype: DType,
    ) -> Result<Tensor> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| err(format!("no tensor `{name}` in the checkpoint")))?;
        let layout = |e: tessera_ir::IrError| RuntimeError::Binding(format!("{name}: {e}"));
        let whole = placement.iter().all(|axes| axes.is_empty());
        let origin = if whole {
            vec![0; t.shape.len()]
        } else {
            mesh.shard_origin(&t.shape, placement).map_err(layout)?
        };
        let mut extent = t.shape.clone();
        for (d, axes) in placement.iter().enumerate() {
            extent[d] /= mesh.chunk(axes).map_err(layout)?.0;
        }
        self.read(name, &origin, &extent, dtype)
    }
}

impl ShardSource for MappedTensors {
    fn shard_of(
        &self,
        name: &str,
        placement: &Placement,
        mesh: &DeviceMesh,
        dtype: DType,
    ) -> Result<Option<Tensor>> {
        if !self.contains(name) {
            return Ok(None);
        }
        Ok(Some(self.shard(name, placement, mesh, dtype)?))
    }
}

/// A checkpoint `train` saved, opened for slice reads.
#[derive(Debug)]
pub struct MappedCheckpoint {
    pub manifest: Manifest,
    pub config_json: Value,
    /// Parameters by HF name.
    pub params: MappedTensors,
    /// AdamW state by `<param>.adam_m|adam_v|master`.
    pub optimizer: MappedTensors,
    /// Where it was read from (after recovery of an interrupted save, as `load_checkpoint`).
    pub dir: PathBuf,
}

impl MappedCheckpoint {
    /// Opens the checkpoint at `dir` (single-device or sharded), checking every header.
    pub fn open(dir: &Path) -> Result<MappedCheckpoint> {
        let dir = recover_dir(dir)?;
        if is_sharded(&dir) {
            return open_sharded(dir.clone());
        }
        let manifest_path = dir.join(MANIFEST_FILE);
        if !manifest_path.is_file() {
            return Err(err(format!(
                "{}: no {MANIFEST_FILE}, so this is not a Tessera checkpoint; to start from \
                 Hugging Face weights use --init",
                dir.display()
            )));
        }
        let manifest = read_manifest(&manifest_path)?;
        let config_json = read_config(&dir, &manifest)?;
        let open = |name: &str| {
            let path = dir.join(name);
            MappedFile::open(&path, checksum_of(&path, &manifest))
        };
        let files = Arc::new(vec![open(MODEL_FILE)?, open(OPTIMIZER_FILE)?]);
        let params = MappedTensors::whole_stacking_experts(files.clone(), 0)?;
        let optimizer = MappedTensors::whole(files, 1)?;
        check_optimizer(&params, &optimizer, &dir)?;
        Ok(MappedCheckpoint { manifest, config_json, params, optimizer, dir })
    }
}

/// Optimizer state `<param>.<kind>` has its parameter's shape (a missing state is named by the
/// trainer when it binds it).
fn check_optimizer(params: &MappedTensors, optimizer: &MappedTensors, dir: &Path) -> Result<()> {
    for (key, shape, _) in optimizer.shapes() {
        let Some((param, _)) = key.rsplit_once('.') else { continue };
        if let Some(p) = params.tensors.get(param) {
            if p.shape != shape {
                return Err(err(format!(
                    "{}: inconsistent checkpoint: {key} is {shape:?}, its parameter {:?}",
                    dir.display(),
                    p.shape
                )));
            }
        }
    }
    Ok(())
}

/// A sharded checkpoint: every rank file mapped, every chunk checked against its header.
fn open_sharded(dir: PathBuf) -> Result<MappedCheckpoint> {
    let (manifest, section) = read_sharded_manifest(&dir)?;
    let config_json = read_config(&dir, &manifest)?;
    // Not `with_capacity(world_size)`: a corrupt count must fail on its first missing file.
    let mut files = Vec::new();
    for rank in 0..section.world_size {
        let path = dir.join(SHARDS_DIR).join(rank_file_name(rank));
        let file = MappedFile::open(&path, checksum_of(&path, &manifest))?;
        let said = |k: &str| file.metadata.get(k).cloned().unwrap_or_default();
        if said("rank") != rank.to_string() || said("step") != manifest.step.to_string() {
            return Err(err(format!(
                "{}: written by rank {} at step {}, but the manifest expects rank {rank} at \
                 step {}: the directory mixes checkpoints; re-save it",
                path.display(),
                said("rank"),
                said("step"),
                manifest.step
            )));
        }
        files.push(file);
    }
    let mut params = HashMap::new();
    let mut optimizer = HashMap::new();
    for t in &section.tensors {
        let dtype: DType = t.dtype.parse().map_err(|_| {
            err(format!("{}: {} has unknown dtype {}", dir.display(), t.name, t.dtype))
        })?;
        let mut local = t.shape.clone();
        for (d, axes) in t.placement.iter().enumerate() {
            let n: usize =
                axes.iter().map(|&a| section.mesh.get(a).copied().unwrap_or(0)).product();
            if n == 0 || local[d] % n != 0 {
                return Err(err(format!(
                    "{}: {} {:?} cannot split as {:?} over mesh {:?}",
                    dir.display(),
                    t.name,
                    t.shape,
                    t.placement,
                    section.mesh
                )));
            }
            local[d] /= n;
        }
        let grid: usize = t.shape.iter().zip(&local).map(|(g, l)| g / l.max(&1)).product();
        let distinct: std::collections::BTreeSet<&Vec<usize>> =
            t.chunks.iter().map(|c| &c.index).collect();
        if t.chunks.len() != grid || distinct.len() != grid {
            return Err(err(format!(
                "{}: {} lists {} chunks ({} distinct), its placement makes {grid}",
                dir.display(),
                t.name,
                t.chunks.len(),
                distinct.len()
            )));
        }
        let mut pieces = Vec::with_capacity(t.chunks.len());
        for c in &t.chunks {
            let file = files.get(c.rank).ok_or_else(|| {
                err(format!(
                    "{}: {} names rank {}, beyond the world",
                    dir.display(),
                    t.name,
                    c.rank
                ))
            })?;
            match file.tensors.get(&t.name) {
                Some((d, s, _)) if *d == Ok(dtype) && *s == local => {}
                got => {
                    return Err(err(format!(
                        "{}: {} should be a {dtype:?} chunk {local:?}, found {:?}",
                        file.path.display(),
                        t.name,
                        got.map(|(d, s, _)| (d, s))
                    )))
                }
            }
            let origin = c.index.iter().zip(&local).map(|(i, l)| i * l).collect();
            pieces.push(Piece { file: c.rank, name: t.name.clone(), origin, shape: local.clone() });
        }
        let stored = Stored { shape: t.shape.clone(), dtype, pieces };
        match t.role {
            TensorRole::Param => params.insert(t.name.clone(), stored),
            TensorRole::Optimizer => optimizer.insert(t.name.clone(), stored),
        };
    }
    let files = Arc::new(files);
    let params = MappedTensors { files: files.clone(), tensors: params };
    let optimizer = MappedTensors { files, tensors: optimizer };
    check_optimizer(&params, &optimizer, &dir)?;
    Ok(MappedCheckpoint { manifest, config_json, params, optimizer, dir })
}
