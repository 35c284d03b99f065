//! What the machine a run is on has left: disk room where checkpoints go, host memory for the
//! simulated devices, and a lock so that one run at a time writes a checkpoint directory.

use crate::checkpoint::{err, split_dir};
use crate::Result;
use std::io::{Read as _, Seek as _, Write as _};
use std::path::{Path, PathBuf};

/// Bytes an unprivileged process can still write on the file system holding `path` (its
/// nearest existing ancestor); `None` where the platform cannot tell.
pub fn available_disk(path: &Path) -> Option<u64> {
    let mut at = path;
    while !at.exists() {
        at = at.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    }
    statvfs_available(at)
}

#[cfg(unix)]
fn statvfs_available(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `st` a buffer statvfs fills on success.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

#[cfg(not(unix))]
fn statvfs_available(_: &Path) -> Option<u64> {
    None
}

/// The host memory the kernel can still give processes without swapping (Linux'
/// `MemAvailable`, capped by a cgroup v2 `memory.max` when one is set, and by the address
/// space this process may still map under an `ulimit -v` ([`address_space_room`])); `None`
/// elsewhere.
pub fn available_memory() -> Option<u64> {
    let avail = machine_available_memory()?;
    Some(address_space_room().map_or(avail, |room| avail.min(room)))
}

/// The address space this process may still map under its `RLIMIT_AS` (`ulimit -v`): the
/// limit less what is mapped now (`VmSize`). `None` without a limit or where it cannot be
/// read. Past it an allocation fails, and Rust aborts the process on a failed allocation.
pub fn address_space_room() -> Option<u64> {
    let limit = address_space_limit()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(limit.saturating_sub(kib.saturating_mul(1024)))
}

/// The soft `RLIMIT_AS` of this process, in bytes; `None` when unlimited.
#[cfg(unix)]
pub fn address_space_limit() -> Option<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given, which lives for the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) };
    #[allow(clippy::unnecessary_cast)] // rlim_t differs between platforms
    (rc == 0 && lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur as u64)
}

#[cfg(not(unix))]
pub fn address_space_limit() -> Option<u64> {
    None
}

fn machine_available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    let mut avail = kib.saturating_mul(1024);
    let cg = |f: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{f}")).ok()?.trim().parse().ok()
    };
    if let (Some(max), Some(used)) = (cg("memory.max"), cg("memory.current")) {
        avail = avail.min(max.saturating_sub(used));
    }
    Some(avail)
}

/// An exclusive lock on a checkpoint directory, held while a run may write it; released when
/// dropped (or when the process ends, however it ends). The lock file `.NAME.lock` beside
/// `NAME` stays and records the holder's pid.
#[derive(Debug)]
pub struct DirLock {
    _file: std::fs::File,
    pub path: PathBuf,
}

/// Takes the lock of checkpoint directory `dir`, or names the process holding it.
pub fn lock_dir(dir: &Path) -> Result<DirLock> {
    let (parent, name) = split_dir(dir)?;
    std::fs::create_dir_all(&parent)
        .map_err(|e| err(format!("cannot create {}: {e}", parent.display())))?;
    let path = parent.join(format!(".{name}.lock"));
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| err(format!("cannot create the lock file {}: {e}", path.display())))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let who = if holder.is_empty() { String::new() } else { format!(" (pid {holder})") };
            return Err(err(format!(
                "{} is being written by another run{who}: two runs saving to one directory \
                 would destroy each other's checkpoints; wait for it to end or choose another \
                 --save",
                dir.display()
            )));
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(err(format!("cannot lock {}: {e}", path.display())))
        }
    }
    // Best effort: the pid is only for the message above.
    let _ = file.set_len(0).and_then(|()| file.rewind());
    let _ = write!(file, "{}", std::process::id()).and_then(|()| file.flush());
    Ok(DirLock { _file: file, path })
}

/// Gives `path` the mode a newly created file gets (0666 less the umask), as for every file
/// Tessera writes: `safetensors` writes through a temporary file created 0600.
pub fn follow_umask(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = 0o666 & !process_umask();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(crate::checkpoint::io_err(path))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// The process's umask, read without changing it (Linux' `/proc/self/status`; 022 where it
/// cannot be read).
#[cfg(unix)]
fn process_umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find_map(|l| l.strip_prefix("Umask:"))?;
            u32::from_str_radix(line.trim(), 8).ok()
        })
        .unwrap_or(0o022)
}

/// `b` bytes in binary units, for messages.
pub(crate) fn human(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}
