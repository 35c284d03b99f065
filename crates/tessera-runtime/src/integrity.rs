//! Checkpoint integrity: every file a save writes has an xxh3-64 checksum in the manifest, and
//! every safetensors file also one per tensor and one for its header, so a reader names the
//! tensor whose bytes changed; the manifest carries a checksum of its own text. Every reader
//! checks what it reads (module docs of [`crate::checkpoint`]); [`verify_checkpoint`] checks a
//! whole directory (`tessera checkpoint verify`). Weights that are not finite are refused
//! wherever they are read, with or without checksums.
//!
//! # In the manifest
//! ```text
//! "checksums": {
//!   "config.json":       {"bytes": 612, "xxh3": "5f0c…"},
//!   "model.safetensors": {"bytes": 1712, "xxh3": "…", "header_xxh3": "…",
//!                         "tensors": {"lm_head.weight": "…", ...}},
//!   ...                                       (sharded: "shards/rank-00000.safetensors", ...)
//! },
//! ...
//! "manifest_xxh3": "…"                        the last key: xxh3 of the manifest's text
//!                                             without this line (see [`seal`])
//! ```
//! A manifest without `checksums` (written before they existed) is read unchecked; one with
//! `checksums` but no valid seal is corrupt.
//!
//! The hash is xxh3-64 (the `xxhash-rust` crate): tens of GB/s, so checking a checkpoint
//! costs far less than reading it from disk. It detects accidental corruption (flipped bits,
//! truncation, a file from another save), not tampering.

use crate::{Result, RuntimeError};
use candle_core::DType;
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use xxhash_rust::xxh3::xxh3_64;

/// The manifest's key for the checksum of its own text.
pub const SEAL_KEY: &str = "manifest_xxh3";

/// Checksums of one file of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    /// The file's length.
    pub bytes: u64,
    /// xxh3-64 of the whole file, 16 hex digits.
    pub xxh3: String,
    /// A safetensors file's header (length prefix and JSON).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header_xxh3: Option<String>,
    /// A safetensors file's tensors: name → xxh3-64 of its data bytes.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tensors: BTreeMap<String, String>,
}

/// Checksums by path relative to the checkpoint directory (`model.safetensors`,
/// `shards/rank-00000.safetensors`, ...).
pub type Checksums = BTreeMap<String, FileDigest>;

fn hex(h: u64) -> String {
    format!("{h:016x}")
}

fn corrupt(msg: String) -> RuntimeError {
    RuntimeError::Checkpoint(msg)
}

/// A safetensors file's header end and its tensors' dtypes and byte ranges, bounds-checked.
type Layout = (usize, Vec<(String, safetensors::Dtype, std::ops::Range<usize>)>);

fn layout(bytes: &[u8]) -> std::result::Result<Layout, String> {
    crate::checkpoint::check_header(bytes)?;
    let (n, meta) = SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
    let start = 8usize.checked_add(n).filter(|&s| s <= bytes.len()).ok_or("header too long")?;
    let mut tensors = Vec::new();
    for (name, info) in meta.tensors() {
        let (a, b) = info.data_offsets;
        let range = start.checked_add(a).zip(start.checked_add(b));
        match range {
            Some((a, b)) if a <= b && b <= bytes.len() => {
                tensors.push((name, info.dtype, a..b));
            }
            _ => return Err(format!("tensor {name}'s bytes lie outside the file")),
        }
    }
    Ok((start, tensors))
}

/// The checksums of a file's bytes; `safetensors` adds the header's and every tensor's.
pub fn digest_bytes(bytes: &[u8], safetensors: bool) -> std::result::Result<FileDigest, String> {
    let mut d = FileDigest {
        bytes: bytes.len() as u64,
        xxh3: hex(xxh3_64(bytes)),
        header_xxh3: None,
        tensors: BTreeMap::new(),
    };
    if safetensors {
        let (header_end, tensors) = layout(bytes)?;
        d.header_xxh3 = Some(hex(xxh3_64(&bytes[..header_end])));
        d.tensors = tensors.into_iter().map(|(n, _, r)| (n, hex(xxh3_64(&bytes[r])))).collect();
    }
    Ok(d)
}

/// Maps a file read-only (an empty file needs no map).
pub(crate) fn map_file(path: &Path) -> Result<Option<memmap2::Mmap>> {
    let file = std::fs::File::open(path).map_err(crate::checkpoint::io_err(path))?;
    let len = file.metadata().map_err(crate::checkpoint::io_err(path))?.len();
    if len == 0 {
        return Ok(None);
    }
    // SAFETY: read-only map of a file that saves replace by rename, never rewrite in place.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(crate::checkpoint::io_err(path))?;
    Ok(Some(map))
}

/// The checksums of the file at `path`; `safetensors` adds its header's and tensors'.
pub fn digest_file(path: &Path, safetensors: bool) -> Result<FileDigest> {
    let map = map_file(path)?;
    let bytes = map.as_deref().unwrap_or(&[]);
    digest_bytes(bytes, safetensors).map_err(|e| {
        corrupt(format!(
            "{}: not a valid safetensors file ({e}); cannot checksum it",
            path.display()
        ))
    })
}

/// Checks `bytes` (the file `label`) against `expected`; a mismatch names the header or the
/// tensors whose bytes changed.
pub fn verify_bytes(label: &str, bytes: &[u8], expected: &FileDigest) -> Result<()> {
    if bytes.len() as u64 != expected.bytes {
        return Err(corrupt(format!(
            "{label}: {} bytes, but {} were saved: the file is truncated or was replaced; \
             resume from another checkpoint or re-save it",
            bytes.len(),
            expected.bytes
        )));
    }
    if hex(xxh3_64(bytes)) == expected.xxh3 {
        return Ok(());
    }
    let mut parts = Vec::new();
    if let (Some(want), Ok((header_end, tensors))) = (&expected.header_xxh3, layout(bytes)) {
        if hex(xxh3_64(&bytes[..header_end])) != *want {
            parts.push("its header".to_string());
        }
        for (name, _, range) in tensors {
            if expected.tensors.get(&name).is_some_and(|h| *h != hex(xxh3_64(&bytes[range]))) {
                parts.push(format!("tensor {name}"));
            }
        }
    }
    let what = if parts.is_empty() { "its bytes".to_string() } else { parts.join(", ") };
    Err(mismatch(label, &what))
}

/// Checks one part of a file (`what`: "tensor NAME", "its header") against its saved
/// checksum.
pub(crate) fn verify_part(label: &str, what: &str, data: &[u8], expected: &str) -> Result<()> {
    if hex(xxh3_64(data)) == expected {
        return Ok(());
    }
    Err(mismatch(label, what))
}

fn mismatch(label: &str, what: &str) -> RuntimeError {
    corrupt(format!(
        "{label}: checksum mismatch in {what}: its bytes changed since they were saved (disk \
         or copy corruption); resume from another checkpoint or re-save it"
    ))
}

/// The first element of `data` (little-endian `dtype`) that is NaN or infinite, with its
/// value; `None` when all are finite or the dtype is not a float.
pub fn first_non_finite(data: &[u8], dtype: DType) -> Option<(usize, f64)> {
    fn scan<const W: usize>(data: &[u8], f: impl Fn([u8; W]) -> f64) -> Option<(usize, f64)> {
        data.chunks_exact(W).enumerate().find_map(|(i, c)| {
            let v = f(c.try_into().unwrap_or([0; W]));
            (!v.is_finite()).then_some((i, v))
        })
    }
    match dtype {
        DType::F32 => scan::<4>(data, |b| f64::from(f32::from_le_bytes(b))),
        DType::F64 => scan::<8>(data, f64::from_le_bytes),
        DType::BF16 => scan::<2>(data, |b| half::bf16::from_le_bytes(b).to_f64()),
        DType::F16 => scan::<2>(data, |b| half::f16::from_le_bytes(b).to_f64()),
        _ => None,
    }
}

/// Refuses a tensor holding NaN or infinity, naming it and the first such element.
pub(crate) fn check_finite(label: &str, name: &str, data: &[u8], dtype: DType) -> Result<()> {
    match first_non_finite(data, dtype) {
        None => Ok(()),
        Some((i, v)) => Err(corrupt(format!(
            "{label}: tensor {name} holds {v} (element {i}): weights must be finite; the run \
             that saved it diverged, or the file is corrupt: resume from an earlier checkpoint"
        ))),
    }
}

/// The manifest text `text` (pretty JSON of an object, ending in `}` and a newline) with its
/// checksum added as the last key.
pub(crate) fn seal(text: &str) -> Result<String> {
    let body = text.trim_end().strip_suffix('}').map(str::trim_end).filter(|b| b.len() > 1);
    let body =
        body.ok_or_else(|| corrupt("the manifest must be a non-empty JSON object".into()))?;
    // What `check_seal` hashes: the text up to the seal, closed as the writer closes it.
    let original = format!("{body}\n}}\n");
    Ok(format!("{body},\n  \"{SEAL_KEY}\": \"{}\"\n}}\n", hex(xxh3_64(original.as_bytes()))))
}

/// Checks a manifest's seal: `Ok` for a sealed manifest whose text matches, or an unsealed one
/// without checksums (written before them); an error naming the file otherwise.
pub(crate) fn check_seal(path: &Path, text: &str) -> Result<()> {
    let bad = |why: &str| {
        corrupt(format!(
            "{}: {why}: the manifest changed since it was saved (disk or copy corruption); \
             resume from another checkpoint or re-save it",
            path.display()
        ))
    };
    let key = format!(",\n  \"{SEAL_KEY}\": \"");
    let Some(at) = text.rfind(&key) else {
        return if text.contains("\"checksums\"") {
            Err(bad("it lists checksums but has no valid manifest_xxh3"))
        } else {
            Ok(())
        };
    };
    let rest = &text[at + key.len()..];
    let sealed = rest.len() == 16 + 4 && rest.ends_with("\"\n}\n");
    if !sealed {
        return Err(bad("its manifest_xxh3 line is malformed"));
    }
    let original = format!("{}\n}}\n", &text[..at]);
    if hex(xxh3_64(original.as_bytes())) != rest[..16] {
        return Err(bad("checksum mismatch"));
    }
    Ok(())
}

/// The manifest of the Tessera checkpoint at `path`, read as strictly as a resume reads it;
/// `None` for a directory that is not one (Hugging Face weights, whose `manifest.json`, if
/// any, is another tool's: a non-empty JSON object without Tessera's keys, in a directory
/// without optimizer state or shards) and for a file.
pub(crate) fn tessera_manifest(path: &Path) -> Result<Option<crate::checkpoint::Manifest>> {
    use crate::checkpoint::{MANIFEST_FILE, OPTIMIZER_FILE};
    if !path.is_dir() {
        return Ok(None);
    }
    let file = path.join(MANIFEST_FILE);
    let ours_beside = path.join(OPTIMIZER_FILE).is_file()
        || path.join(crate::dist_checkpoint::SHARDS_DIR).is_dir();
    let unreadable = |why: String| {
        corrupt(format!(
            "{}: {why}; the checksums of the checkpoint's files are in it, so it cannot be \
             loaded unchecked: restore the manifest from a copy or re-save the checkpoint \
             (`tessera checkpoint verify {}` lists every problem)",
            file.display(),
            path.display()
        ))
    };
    if !file.exists() {
        if ours_beside {
            return Err(unreadable(format!(
                "missing, but {} holds a Tessera checkpoint's optimizer state or shards",
                path.display()
            )));
        }
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(&file).map_err(|e| unreadable(format!("unreadable ({e})")))?;
    let value: Option<serde_json::Value> = serde_json::from_str(&text).ok();
    let foreign_object = value.as_ref().and_then(|v| v.as_object()).is_some_and(|o| {
        !o.is_empty()
            && !["format_version", "checksums", SEAL_KEY, "step", "seed"]
                .iter()
                .any(|k| o.contains_key(*k))
    });
    if foreign_object && !ours_beside {
        return Ok(None);
    }
    match crate::checkpoint::read_manifest(&file) {
        Ok(m) => Ok(Some(m)),
        Err(e) => Err(unreadable(format!("not a sound Tessera manifest ({e})"))),
    }
}

/// What [`check_weights_dir`] could check of a directory of weights before they are loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirCheck {
    /// Not a Tessera checkpoint (Hugging Face weights, an export, an ONNX file): no checksums;
    /// weights are still checked for NaN and infinity as they are read.
    NotACheckpoint,
    /// A Tessera checkpoint saved before checksums: its manifest is read, its config and
    /// weights cannot be checked against it (weights are checked for NaN and infinity).
    NoChecksums,
    /// The manifest's seal and `config.json` match; each tensor is checked when read.
    Checked,
}

/// Checks, before a model is built from it, what a load of `path` reads first: a Tessera
/// checkpoint's manifest (an unreadable, empty or altered one is refused, as a resume refuses
/// it) and its `config.json` against the manifest's checksum.
pub fn check_weights_dir(path: &Path) -> Result<DirCheck> {
    let Some(m) = tessera_manifest(path)? else { return Ok(DirCheck::NotACheckpoint) };
    if m.checksums.is_empty() {
        return Ok(DirCheck::NoChecksums);
    }
    crate::checkpoint::read_config(path, &m)?;
    Ok(DirCheck::Checked)
}

/// What [`verify_checkpoint`] found in a sound checkpoint.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    pub step: u64,
    /// Files checked against a checksum (0 for a checkpoint written before checksums).
    pub files_checked: usize,
    /// Bytes hashed.
    pub bytes: u64,
    /// Tensors read and found finite.
    pub tensors: usize,
    /// Whether the manifest listed checksums.
    pub checksums: bool,
}

/// Checks a whole checkpoint directory: the manifest's seal, every listed file's checksum
/// (each mismatch naming the file and the tensors), the tensor table (as a resume opens it),
/// and that every tensor is finite. Reports every problem found, not just the first.
pub fn verify_checkpoint(dir: &Path) -> Result<VerifyReport> {
    let ckpt = crate::mapped::MappedCheckpoint::open(dir)?;
    let dir = ckpt.dir.clone();
    let mut problems = Vec::new();
    let mut report = VerifyReport {
        step: ckpt.manifest.step,
        files_checked: 0,
        bytes: 0,
        tensors: 0,
        checksums: !ckpt.manifest.checksums.is_empty(),
    };
    for (rel, want) in &ckpt.manifest.checksums {
        let path = dir.join(rel);
        let checked = map_file(&path).and_then(|m| {
            verify_bytes(&path.display().to_string(), m.as_deref().unwrap_or(&[]), want)
        });
        match checked {
            Ok(()) => {
                report.files_checked += 1;
                report.bytes += want.bytes;
            }
            Err(e) => problems.push(e.to_string()),
        }
    }
    for tensors in [&ckpt.params, &ckpt.optimizer] {
        let mut names: Vec<(String, Vec<usize>, DType)> =
            tensors.shapes().map(|(n, s, d)| (n.to_string(), s.to_vec(), d)).collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, shape, dtype) in names {
            let zeros = vec![0; shape.len()];
            match tensors.read(&name, &zeros, &shape, dtype) {
                Ok(_) => report.tensors += 1,
                Err(e) => problems.push(e.to_string()),
            }
        }
    }
    // A file's mismatch and its tensor's, found again when the tensor is read, are one.
    let mut seen = std::collections::HashSet::new();
    problems.retain(|p| seen.insert(p.clone()));
    if problems.is_empty() {
        return Ok(report);
    }
    Err(corrupt(format!(
        "{}: {} problem(s):\n  {}",
        dir.display(),
        problems.len(),
        problems.join("\n  ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_round_trips_and_catches_a_flipped_byte() {
        let text = "{\n  \"step\": 12,\n  \"checksums\": {}\n}\n";
        let sealed = seal(text).unwrap();
        assert!(sealed.ends_with("\"\n}\n"), "{sealed}");
        let v: serde_json::Value = serde_json::from_str(&sealed).unwrap();
        assert_eq!(v["step"], 12);
        check_seal(Path::new("m.json"), &sealed).unwrap();
        let flipped = sealed.replacen("12", "13", 1);
        let e = check_seal(Path::new("m.json"), &flipped).unwrap_err().to_string();
        assert!(e.contains("m.json") && e.contains("checksum mismatch"), "{e}");
        // Checksums without a seal: the seal's key itself was damaged.
        let e = check_seal(Path::new("m.json"), text).unwrap_err().to_string();
        assert!(e.contains("no valid manifest_xxh3"), "{e}");
        // A manifest from before checksums is accepted.
        check_seal(Path::new("m.json"), "{\n  \"step\": 1\n}\n").unwrap();
    }

    #[test]
    fn non_finite_values_are_found_in_every_float_dtype() {
        let f32s: Vec<u8> = [1.0f32, f32::NAN].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(first_non_finite(&f32s, DType::F32).map(|p| p.0), Some(1));
        let bf: Vec<u8> =
            [half::bf16::ONE, half::bf16::INFINITY].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(first_non_finite(&bf, DType::BF16).map(|p| p.0), Some(1));
        let f16: Vec<u8> = [half::f16::NEG_INFINITY].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(first_non_finite(&f16, DType::F16).map(|p| p.0), Some(0));
        let ok: Vec<u8> = [0.5f64, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(first_non_finite(&ok, DType::F64), None);
        assert_eq!(first_non_finite(&[0xff; 8], DType::U8), None);
    }
}
