//! What a writer of a whole directory may replace. An export and a checkpoint save both swap
//! a new directory in for the old one, so the old one's every file goes:
//!
//! - an export ([`check_export_dest`]) replaces only an empty directory or an earlier export
//!   (marked by [`EXPORT_MARKER`], which `export_hf` writes); with `force`, also a directory
//!   holding nothing but `config.json` and `model.safetensors` (an unmarked export, from an
//!   older Tessera or `save_pretrained`). Never — `force` or not — a checkpoint, a directory
//!   with other files, a file or link, the checkpoint being exported, a directory inside it,
//!   the working directory, or a directory holding any of these (paths compared
//!   canonicalized);
//! - a save ([`check_save_dest`]) replaces a checkpoint only when the run continues it
//!   (`--resume` names the same directory) or the caller says so (`--overwrite-save`).

use crate::checkpoint::{err, io_err, CONFIG_FILE, MANIFEST_FILE, MODEL_FILE, OPTIMIZER_FILE};
use crate::Result;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// The file `export_hf` writes into every export, so a later export knows what it replaces.
pub const EXPORT_MARKER: &str = "tessera-export.json";

/// The marker's contents: what was exported, at which step.
pub(crate) fn export_marker(source: &Path, step: u64) -> Value {
    json!({"tessera_export": 1, "checkpoint": source.display().to_string(), "step": step,
           "files": [CONFIG_FILE, MODEL_FILE]})
}

/// `path` canonicalized, or — when it does not exist — its nearest existing ancestor
/// canonicalized with the rest of the path appended.
fn canonical(path: &Path) -> PathBuf {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().map(|d| d.join(path)).unwrap_or_else(|_| path.to_path_buf())
    };
    let mut rest = Vec::new();
    let mut at = abs.as_path();
    loop {
        if let Ok(c) = std::fs::canonicalize(at) {
            return rest.iter().rev().fold(c, |acc: PathBuf, part| match part {
                std::path::Component::ParentDir => {
                    acc.parent().map(Path::to_path_buf).unwrap_or(acc)
                }
                std::path::Component::CurDir => acc,
                p => acc.join(p),
            });
        }
        match (at.parent(), at.components().next_back()) {
            (Some(parent), Some(last)) => {
                rest.push(last);
                at = parent;
            }
            _ => return abs,
        }
    }
}

/// The entries of directory `dir`, by name.
fn names(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io_err(dir))? {
        names.push(e.map_err(io_err(dir))?.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(names)
}

/// Whether `names` are a Tessera checkpoint's (single-device or sharded).
fn is_checkpoint(names: &[String]) -> bool {
    names.iter().any(|n| {
        n == MANIFEST_FILE || n == OPTIMIZER_FILE || n == crate::dist_checkpoint::SHARDS_DIR
    })
}

/// Refuses an export to `out` of the checkpoint at `source` unless `out` is what an export
/// may replace (module docs); `force` also lets it replace an unmarked export.
pub fn check_export_dest(source: &Path, out: &Path, force: bool) -> Result<()> {
    let refuse = |what: String, fix: &str| {
        Err(err(format!(
            "--hf {} {what}; an export replaces its directory whole, so nothing there would \
             survive: {fix}",
            out.display()
        )))
    };
    let new_path = "give a new or empty directory, such as --hf runs/model-hf";
    let (target, src) = (canonical(out), canonical(source));
    let cwd = std::env::current_dir().map(|d| canonical(&d)).ok();
    if src.starts_with(&target) {
        let what = if src == target {
            "is the checkpoint being exported: a Tessera checkpoint".to_string()
        } else {
            format!("holds the checkpoint being exported ({})", source.display())
        };
        return refuse(what + " (--force never replaces it)", new_path);
    }
    if target.starts_with(&src) {
        return refuse(
            format!("lies inside the checkpoint being exported ({})", source.display()),
            "the checkpoint's next save would delete it; give a directory outside it",
        );
    }
    if cwd.as_ref().is_some_and(|c| c.starts_with(&target)) {
        return refuse(
            "is the working directory or holds it (--force never replaces it)".to_string(),
            new_path,
        );
    }
    let meta = match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(out)(e)),
        Ok(m) => m,
    };
    if meta.file_type().is_symlink() {
        return refuse(
            "is a symbolic link (the export would replace the link)".to_string(),
            "give the directory it points to, or a new path",
        );
    }
    if !meta.is_dir() {
        return refuse("is a file, not a directory".to_string(), new_path);
    }
    let names = names(out)?;
    if names.is_empty() {
        return Ok(());
    }
    if is_checkpoint(&names) {
        return refuse(
            "is a Tessera checkpoint (manifest, optimizer state or shards), which an export \
             would destroy (--force never replaces a checkpoint)"
                .to_string(),
            new_path,
        );
    }
    let export_file = |n: &String| n == CONFIG_FILE || n == MODEL_FILE;
    if names.iter().all(|n| export_file(n) || n == EXPORT_MARKER) {
        if names.iter().any(|n| n == EXPORT_MARKER) || force {
            return Ok(());
        }
        return refuse(
            format!(
                "holds {} but no {EXPORT_MARKER}, so it is not known to be an export of \
                 Tessera",
                names.join(" and ")
            ),
            "pass --force to replace it (it holds nothing else), or give a new path",
        );
    }
    let others: Vec<&String> =
        names.iter().filter(|n| !export_file(n) && *n != EXPORT_MARKER).take(5).collect();
    let shown = others.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
    refuse(
        format!(
            "holds files an export did not write ({shown}{}) (--force never replaces them)",
            if others.len() < names.len() { ", ..." } else { "" }
        ),
        new_path,
    )
}

/// Refuses a save to `save` that would replace a checkpoint this run does not continue: one
/// is there, `resume` does not name the same directory, and `overwrite` is not set. Runs
/// before step 1, so the refusal costs no training.
pub fn check_save_dest(save: &Path, resume: Option<&Path>, overwrite: bool) -> Result<()> {
    if overwrite || !save.join(MANIFEST_FILE).is_file() {
        return Ok(());
    }
    if resume.is_some_and(|r| canonical(r) == canonical(save)) {
        return Ok(());
    }
    let what = match crate::checkpoint::read_manifest(&save.join(MANIFEST_FILE)) {
        Ok(m) => {
            format!("the checkpoint of a run of {} at step {} (seed {})", m.model, m.step, m.seed)
        }
        Err(_) => "a checkpoint".to_string(),
    };
    let s = save.display();
    Err(err(format!(
        "--save {s} holds {what}, which this run's first save would replace{}: continue that \
         run with --resume {s}, save to a new path, or pass --overwrite-save to replace it",
        match resume {
            Some(r) => format!(" (this run resumes {}, not {s})", r.display()),
            None => String::new(),
        }
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_paths_of_missing_files_keep_their_tail() {
        let d = std::env::temp_dir().join(format!("tessera-guard-{}", std::process::id()));
        std::fs::create_dir_all(d.join("a")).unwrap();
        let c = canonical(&d.join("a/../a/b/c"));
        assert_eq!(c, std::fs::canonicalize(&d).unwrap().join("a/b/c"));
        let _ = std::fs::remove_dir_all(&d);
    }
}
