//! The NVMe tier of an offloaded Program: buffers that rest in files under the run's offload
//! directory (one subdirectory per rank, `tessera-offload-rank{r}`), read back by background threads that the executor
//! starts a few transfers ahead of use, and written by background threads so the step goes on
//! while the drive works. A file is the tensor's little-endian f32 elements (the tier holds
//! optimizer state, which is f32); a write lands in a temporary file renamed over the target,
//! so a reader never sees half a tensor, and a read of a path first waits for the write to it.

use crate::{Result, RuntimeError};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use tessera_ir::{TensorId, TensorMeta};

/// One rank's NVMe files and the I/O in flight.
pub struct NvmeStore {
    dir: PathBuf,
    /// The file each resident buffer (by root tensor) lives in.
    files: HashMap<TensorId, PathBuf>,
    writes: HashMap<PathBuf, JoinHandle<Result<()>>>,
    reads: HashMap<TensorId, JoinHandle<Result<Tensor>>>,
}

fn io(what: &str, path: &Path, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Binding(format!(
        "NVMe tier: cannot {what} `{}`: {e}; check --offload-dir is writable and has room",
        path.display()
    ))
}

impl NvmeStore {
    /// Files under `dir/tessera-offload-rank{rank}` (made now, emptied of what a killed run
    /// left: a directory that cannot be made fails here, before the first step).
    pub fn new(dir: &Path, rank: usize) -> Result<NvmeStore> {
        let dir = dir.join(format!("tessera-offload-rank{rank}"));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| io("clear", &dir, e))?;
        }
        std::fs::create_dir_all(&dir).map_err(|e| io("create", &dir, e))?;
        Ok(NvmeStore { dir, files: HashMap::new(), writes: HashMap::new(), reads: HashMap::new() })
    }

    fn path_of(&self, t: TensorId) -> PathBuf {
        self.dir.join(format!("t{}.f32", t.index()))
    }

    /// Whether buffer `root` rests in a file.
    pub fn holds(&self, root: TensorId) -> bool {
        self.files.contains_key(&root)
    }

    /// Starts writing `value` as buffer `root`'s file (replacing what it held).
    pub fn write(&mut self, root: TensorId, value: &Tensor) -> Result<()> {
        let path = self.path_of(root);
        self.wait_write(&path)?;
        self.reads.remove(&root);
        let data = value.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let target = path.clone();
        let handle = std::thread::spawn(move || -> Result<()> {
            let mut bytes = Vec::with_capacity(data.len() * 4);
            for x in data {
                bytes.extend_from_slice(&x.to_le_bytes());
            }
            let tmp = target.with_extension("tmp");
            std::fs::write(&tmp, &bytes).map_err(|e| io("write", &tmp, e))?;
            std::fs::rename(&tmp, &target).map_err(|e| io("write", &target, e))
        });
        self.writes.insert(path.clone(), handle);
        self.files.insert(root, path);
        Ok(())
    }

    /// Starts reading buffer `root` (of meta `meta`) ahead of its use.
    pub fn prefetch(&mut self, root: TensorId, meta: &TensorMeta) -> Result<()> {
        if self.reads.contains_key(&root) {
            return Ok(());
        }
        let Some(path) = self.files.get(&root).cloned() else { return Ok(()) };
        self.wait_write(&path)?;
        let dims = meta.shape.dims().to_vec();
        let handle = std::thread::spawn(move || -> Result<Tensor> {
            let bytes = std::fs::read(&path).map_err(|e| io("read", &path, e))?;
            let data: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Ok(Tensor::from_vec(data, dims, &Device::Cpu)?)
        });
        self.reads.insert(root, handle);
        Ok(())
    }

    /// Buffer `root`'s value read now, between steps (every write has landed: a step ends with
    /// [`NvmeStore::flush`], a bind writes at once).
    pub fn read_now(&self, root: TensorId, meta: &TensorMeta) -> Result<Option<Tensor>> {
        let Some(path) = self.files.get(&root) else { return Ok(None) };
        if self.writes.contains_key(path) {
            return Err(RuntimeError::Binding(format!(
                "NVMe tier: `{}` is being written; read it after the step",
                path.display()
            )));
        }
        let bytes = std::fs::read(path).map_err(|e| io("read", path, e))?;
        let data: Vec<f32> =
            bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let value = Tensor::from_vec(data, meta.shape.dims().to_vec(), &Device::Cpu)?;
        Ok(Some(value.to_dtype(crate::tensor::candle_dtype(meta.dtype))?))
    }

    /// Buffer `root`'s value, from its prefetch or read now.
    pub fn read(&mut self, root: TensorId, meta: &TensorMeta) -> Result<Tensor> {
        self.prefetch(root, meta)?;
        let handle = self.reads.remove(&root).ok_or_else(|| {
            RuntimeError::Binding(format!("NVMe tier: buffer {} has no file", root.index()))
        })?;
        let value = join(handle)?;
        let want = crate::tensor::candle_dtype(meta.dtype);
        Ok(if value.dtype() == want { value } else { value.to_dtype(want)? })
    }

    /// Moves buffer `from`'s file to buffer `to` (a written-back update becomes the state's
    /// value), waiting for its write.
    pub fn rename(&mut self, from: TensorId, to: TensorId) -> Result<()> {
        let Some(src) = self.files.remove(&from) else { return Ok(()) };
        self.wait_write(&src)?;
        let dst = self.path_of(to);
        self.wait_write(&dst)?;
        self.reads.remove(&to);
        std::fs::rename(&src, &dst).map_err(|e| io("write", &dst, e))?;
        self.files.insert(to, dst);
        Ok(())
    }

    /// Drops buffer `root`'s file (a freed buffer).
    pub fn remove(&mut self, root: TensorId) -> Result<()> {
        self.reads.remove(&root);
        if let Some(path) = self.files.remove(&root) {
            self.wait_write(&path)?;
            std::fs::remove_file(&path).map_err(|e| io("remove", &path, e))?;
        }
        Ok(())
    }

    /// Waits for every write in flight (the end of a step: the files are the state).
    pub fn flush(&mut self) -> Result<()> {
        let paths: Vec<PathBuf> = self.writes.keys().cloned().collect();
        for p in paths {
            self.wait_write(&p)?;
        }
        Ok(())
    }

    fn wait_write(&mut self, path: &Path) -> Result<()> {
        match self.writes.remove(path) {
            Some(h) => join(h),
            None => Ok(()),
        }
    }
}

fn join<T>(h: JoinHandle<Result<T>>) -> Result<T> {
    h.join().map_err(|_| RuntimeError::Binding("NVMe tier: an I/O thread panicked".into()))?
}

impl Drop for NvmeStore {
    fn drop(&mut self) {
        let _ = self.flush();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
