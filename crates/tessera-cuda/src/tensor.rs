//! Device tensors: a buffer from the caching allocator (returned to it when the last handle
//! drops) seen through a strided view, so `Reshape` and `Expand` share storage as the IR
//! declares and every other op writes a fresh buffer.

use crate::alloc::{Block, Purpose};
use crate::gpu::Gpu;
use cudarc::driver::DeviceRepr;
use std::sync::Arc;
use tessera_ir::{DType, Shape, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

/// Dims of a kernel's `Layout` (`MAXD` in `kernels.cu`).
pub const MAXD: usize = 8;

/// A kernel's view of a tensor: element offset, dims and element strides (matches
/// `struct Layout` in `kernels.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Layout {
    pub ndim: i32,
    pub offset: i64,
    pub dims: [i64; MAXD],
    pub strides: [i64; MAXD],
}

// SAFETY: plain old data with the C layout the kernels declare.
unsafe impl DeviceRepr for Layout {}

/// A buffer handed out by the allocator.
pub struct DeviceBuffer {
    gpu: Arc<Gpu>,
    block: Block,
}

impl DeviceBuffer {
    pub fn new(gpu: &Arc<Gpu>, bytes: u64, purpose: Purpose) -> Result<DeviceBuffer> {
        Ok(DeviceBuffer { gpu: gpu.clone(), block: gpu.alloc(bytes, purpose)? })
    }
    pub fn addr(&self) -> u64 {
        self.block.addr
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        self.gpu.release(self.block);
    }
}

/// A tensor on the GPU.
#[derive(Clone)]
pub struct CudaTensor {
    pub(crate) buf: Arc<DeviceBuffer>,
    /// In elements.
    pub(crate) offset: usize,
    pub(crate) dims: Vec<usize>,
    pub(crate) strides: Vec<usize>,
    /// The stored dtype (ints as i64, bools as u8, as on the CPU).
    pub(crate) dtype: DType,
}

pub fn elem_size(d: DType) -> usize {
    match d {
        DType::F64 | DType::I32 | DType::I64 => 8,
        DType::F32 => 4,
        DType::F16 | DType::BF16 => 2,
        DType::Bool | DType::U8 => 1,
    }
}

/// The dtype a value of IR dtype `d` is stored in.
pub fn stored(d: DType) -> DType {
    match d {
        DType::I32 => DType::I64,
        other => other,
    }
}

pub fn row_major(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

impl CudaTensor {
    /// A fresh contiguous tensor (contents undefined).
    pub fn empty(gpu: &Arc<Gpu>, dims: &[usize], dtype: DType, purpose: Purpose) -> Result<Self> {
        let dtype = stored(dtype);
        let bytes = (dims.iter().product::<usize>() * elem_size(dtype)) as u64;
        Ok(CudaTensor {
            buf: Arc::new(DeviceBuffer::new(gpu, bytes, purpose)?),
            offset: 0,
            dims: dims.to_vec(),
            strides: row_major(dims),
            dtype,
        })
    }

    pub fn dims(&self) -> &[usize] {
        &self.dims
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }
    pub fn meta(&self) -> TensorMeta {
        TensorMeta { shape: Shape::from(&self.dims[..]), dtype: self.dtype }
    }

    /// Device address of the first element.
    pub fn ptr(&self) -> u64 {
        self.buf.addr() + (self.offset * elem_size(self.dtype)) as u64
    }

    /// Address of the buffer start (kernels add the layout's offset themselves).
    pub fn base(&self) -> u64 {
        self.buf.addr()
    }

    pub fn is_contiguous(&self) -> bool {
        let want = row_major(&self.dims);
        self.dims.iter().zip(&self.strides).zip(&want).all(|((&d, &s), &w)| d <= 1 || s == w)
    }

    /// Whether two handles share a buffer.
    pub fn same_buffer(&self, other: &CudaTensor) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
    }

    /// The layout reading this tensor as `out` dims with NumPy broadcasting (missing leading
    /// dims and size-1 dims repeat with stride 0).
    pub fn layout_as(&self, out: &[usize]) -> Result<Layout> {
        if out.len() > MAXD {
            return Err(RuntimeError::Unsupported {
                backend: "cuda".into(),
                op: "elementwise".into(),
                reason: format!("tensors of {} dims (at most {MAXD})", out.len()),
            });
        }
        let lead = out.len().checked_sub(self.dims.len()).ok_or_else(|| {
            RuntimeError::Binding(format!("cannot broadcast {:?} to {out:?}", self.dims))
        })?;
        let mut l =
            Layout { ndim: out.len() as i32, offset: self.offset as i64, ..Default::default() };
        for (i, &o) in out.iter().enumerate() {
            l.dims[i] = o as i64;
            l.strides[i] = if i < lead {
                0
            } else {
                let (d, s) = (self.dims[i - lead], self.strides[i - lead]);
                if d == o {
                    s as i64
                } else if d == 1 {
                    0
                } else {
                    return Err(RuntimeError::Binding(format!(
                        "cannot broadcast {:?} to {out:?}",
                        self.dims
                    )));
                }
            };
        }
        Ok(l)
    }

    /// The layout of this tensor as it is (an error for more than [`MAXD`] dims).
    pub fn layout(&self) -> Result<Layout> {
        self.layout_as(&self.dims)
    }

    /// A view with new dims (contiguous tensors only).
    pub fn reshaped(&self, dims: &[usize]) -> CudaTensor {
        CudaTensor {
            buf: self.buf.clone(),
            offset: self.offset,
            dims: dims.to_vec(),
            strides: row_major(dims),
            dtype: self.dtype,
        }
    }

    /// A broadcast view (stride 0 along stretched and new leading dims).
    pub fn broadcast(&self, dims: &[usize]) -> Result<CudaTensor> {
        let l = self.layout_as(dims)?;
        Ok(CudaTensor {
            buf: self.buf.clone(),
            offset: self.offset,
            dims: dims.to_vec(),
            strides: (0..dims.len()).map(|i| l.strides[i] as usize).collect(),
            dtype: self.dtype,
        })
    }
}
