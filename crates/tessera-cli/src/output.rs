//! The one rule every output flag writes by (`plan --out`, `--export --out`, `--plot`,
//! `--timeline`, `--timeline-svg`, `--schedule-svg`, `--memory-svg`, `--logits`,
//! `calibrate --out`, ...):
//!
//! - `-` or `/dev/stdout`: the bytes go to standard output;
//! - a regular file, or no file yet: written atomically — into a uniquely named temporary file
//!   beside it (`.<name>.tessera-tmp-<pid>-<n>`), then renamed over it, so a reader never sees
//!   half a file and a failure leaves the old one whole; the temporary file is removed on
//!   every error path; an existing file keeps its permissions;
//! - a symbolic link: written through — its target (resolved, chains included) is written by
//!   the rule above in the target's directory; the link stays a link;
//! - a FIFO, a character or block device: written in place (opened for writing, never
//!   replaced or truncated by a rename);
//! - a directory or a socket: refused.

use anyhow::{bail, Context, Result};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Symbolic links followed before a chain counts as a loop.
const MAX_LINKS: usize = 40;

/// Writes `data` to the output file `path` by the module's rule.
pub fn write_output(path: &Path, data: &[u8]) -> Result<()> {
    if path == Path::new("-") || path == Path::new("/dev/stdout") {
        let mut out = std::io::stdout().lock();
        return match out.write_all(data).and_then(|()| out.flush()) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                Err(e).context("writing to standard output")
            }
            _ => Ok(()),
        };
    }
    let target = resolve_links(path)?;
    match std::fs::metadata(&target) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => write_atomic(&target, data, None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", target.display())),
        Ok(meta) if meta.is_file() => write_atomic(&target, data, Some(meta.permissions())),
        Ok(meta) if meta.is_dir() => {
            bail!("{} is a directory: give a file name", path.display())
        }
        Ok(meta) => write_in_place(path, &target, data, &meta),
    }
}

/// `path` with its symbolic links followed (a dangling link gives the file it names, which is
/// then created).
fn resolve_links(path: &Path) -> Result<PathBuf> {
    let mut at = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                let next = std::fs::read_link(&at)
                    .with_context(|| format!("cannot read the link {}", at.display()))?;
                at = match at.parent() {
                    Some(dir) if next.is_relative() => dir.join(next),
                    _ => next,
                };
            }
            _ => return Ok(at),
        }
    }
    bail!(
        "{}: more than {MAX_LINKS} symbolic links (a loop?): give the file itself",
        path.display()
    )
}

/// A FIFO or a device: opened for writing, never replaced.
fn write_in_place(
    shown: &Path,
    target: &Path,
    data: &[u8],
    meta: &std::fs::Metadata,
) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt as _;
        if meta.file_type().is_socket() {
            bail!("{} is a socket: give a file name", shown.display());
        }
    }
    let _ = meta;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(target)
        .with_context(|| format!("cannot open {} for writing", shown.display()))?;
    f.write_all(data)
        .and_then(|()| f.flush())
        .with_context(|| format!("writing {}", shown.display()))
}

/// A temporary file removed when dropped unless kept.
struct TempFile(Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Writes `data` into a new temporary file beside `path` and renames it over `path`.
fn write_atomic(path: &Path, data: &[u8], keep: Option<std::fs::Permissions>) -> Result<()> {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .with_context(|| format!("{} names no file: give a file name", path.display()))?;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let (mut file, tmp) = loop {
        let n = COUNT.fetch_add(1, Ordering::Relaxed);
        let tmp =
            dir.join(format!(".{}.tessera-tmp-{}-{n}", name.to_string_lossy(), std::process::id()));
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => break (f, TempFile(Some(tmp))),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("cannot create a file in {} to write {}", dir.display(), path.display())
                })
            }
        }
    };
    let Some(tmp_path) = tmp.0.clone() else { bail!("internal: no temporary file") };
    file.write_all(data)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", path.display()))?;
    drop(file);
    if let Some(perms) = keep {
        std::fs::set_permissions(&tmp_path, perms)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    std::fs::rename(&tmp_path, path).with_context(|| format!("writing {}", path.display()))?;
    // Renamed: nothing left to remove.
    let mut tmp = tmp;
    tmp.0 = None;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tessera-output-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn listing(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_file_is_replaced_and_no_temporary_file_stays() {
        let d = dir("file");
        let f = d.join("out.json");
        write_output(&f, b"one").unwrap();
        write_output(&f, b"two").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"two");
        assert_eq!(listing(&d), ["out.json"]);
    }

    #[cfg(unix)]
    #[test]
    fn a_link_is_written_through_and_stays_a_link() {
        let d = dir("link");
        std::fs::create_dir(d.join("real")).unwrap();
        let target = d.join("real").join("t.json");
        std::fs::write(&target, b"old").unwrap();
        let link = d.join("l.json");
        std::os::unix::fs::symlink("real/t.json", &link).unwrap();
        write_output(&link, b"new").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(listing(&d.join("real")), ["t.json"]);
        // A dangling link creates the file it names.
        let dangling = d.join("d.json");
        std::os::unix::fs::symlink("real/new.json", &dangling).unwrap();
        write_output(&dangling, b"x").unwrap();
        assert_eq!(std::fs::read(d.join("real/new.json")).unwrap(), b"x");
        // A loop is refused by name.
        std::os::unix::fs::symlink("loop2", d.join("loop1")).unwrap();
        std::os::unix::fs::symlink("loop1", d.join("loop2")).unwrap();
        let e = write_output(&d.join("loop1"), b"x").unwrap_err().to_string();
        assert!(e.contains("symbolic links"), "{e}");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary_file() {
        let d = dir("fail");
        let sub = d.join("gone");
        let e = write_output(&sub.join("x.json"), b"x").unwrap_err();
        assert!(format!("{e:#}").contains("cannot create a file in"), "{e:#}");
        let e = write_output(&d, b"x").unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        assert!(listing(&d).is_empty());
    }
}
