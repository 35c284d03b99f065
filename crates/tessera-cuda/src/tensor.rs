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
    /// 1 when every dim and the element count are below 2^31 (the kernels then index in 32
    /// bits); set by [`Layout::collapsed`], 0 (the general path) otherwise.
    pub small: i32,
    pub offset: i64,
    pub dims: [i64; MAXD],
    pub strides: [i64; MAXD],
}

// SAFETY: plain old data with the C layout the kernels declare.
unsafe impl DeviceRepr for Layout {}

impl Layout {
    /// The same mapping from flat index to element offset with fewer dims: size-1 dims
    /// dropped, and each dim merged into the one before it where they step alike (`stride_outer
    /// == stride_inner · dim_inner`, broadcast runs included), so a dense or broadcast-scalar
    /// operand becomes one dim, which the kernels index with no division.
    pub fn collapsed(self) -> Layout {
        let mut out = Layout { offset: self.offset, ..Default::default() };
        let mut n = 0usize;
        for i in 0..(self.ndim.max(0) as usize).min(MAXD) {
            let (d, s) = (self.dims[i], self.strides[i]);
            if d == 1 {
                continue;
            }
            if n > 0 && out.strides[n - 1] == s * d {
                out.dims[n - 1] *= d;
                out.strides[n - 1] = s;
            } else {
                out.dims[n] = d;
                out.strides[n] = s;
                n += 1;
            }
        }
        out.ndim = n as i32;
        let numel: i64 = out.dims[..n].iter().product();
        out.small = i32::from(numel < i32::MAX as i64 && out.dims[..n].iter().all(|&d| d >= 0));
        out
    }

    /// The element offset of flat index `i` (what `at` in `kernels.cu` computes).
    pub fn offset_of(&self, mut i: i64) -> i64 {
        let mut off = self.offset;
        for d in (0..self.ndim.max(0) as usize).rev() {
            off += (i % self.dims[d]) * self.strides[d];
            i /= self.dims[d];
        }
        off
    }
}

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

    /// Rows `r0..r1` of a contiguous tensor (along its first dim), a view.
    pub fn rows(&self, r0: usize, r1: usize) -> Result<CudaTensor> {
        let n = self.dims.first().copied().unwrap_or(0);
        if !self.is_contiguous() || r0 > r1 || r1 > n {
            return Err(RuntimeError::Binding(format!(
                "rows {r0}..{r1} of a {}tensor of {n} rows",
                if self.is_contiguous() { "" } else { "non-contiguous " }
            )));
        }
        let per: usize = self.dims[1..].iter().product();
        let mut dims = self.dims.clone();
        dims[0] = r1 - r0;
        Ok(CudaTensor {
            buf: self.buf.clone(),
            offset: self.offset + r0 * per,
            strides: row_major(&dims),
            dims,
            dtype: self.dtype,
        })
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

    /// A view with the dims permuted (`perm[i]` is the source dim of dim `i`): no copy, so a
    /// non-contiguous operand (the GPU check feeds kernels such views).
    pub fn permuted(&self, perm: &[usize]) -> Result<CudaTensor> {
        let mut seen = vec![false; self.dims.len()];
        for &p in perm {
            match seen.get_mut(p) {
                Some(s) if !*s => *s = true,
                _ => {
                    return Err(RuntimeError::Binding(format!(
                        "permutation {perm:?} of a tensor of {} dims",
                        self.dims.len()
                    )))
                }
            }
        }
        if perm.len() != self.dims.len() {
            return Err(RuntimeError::Binding(format!(
                "permutation {perm:?} of a tensor of {} dims",
                self.dims.len()
            )));
        }
        Ok(CudaTensor {
            buf: self.buf.clone(),
            offset: self.offset,
            dims: perm.iter().map(|&i| self.dims[i]).collect(),
            strides: perm.iter().map(|&i| self.strides[i]).collect(),
            dtype: self.dtype,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dims: &[i64], strides: &[i64], offset: i64) -> Layout {
        let mut l = Layout { ndim: dims.len() as i32, offset, ..Default::default() };
        l.dims[..dims.len()].copy_from_slice(dims);
        l.strides[..dims.len()].copy_from_slice(strides);
        l
    }

    /// Collapsing keeps every flat index's element offset, and makes dense and fully
    /// broadcast operands one dim.
    #[test]
    fn collapsing_keeps_every_offset() {
        let cases = [
            (layout(&[2, 3, 4], &[12, 4, 1], 5), 1), // dense
            (layout(&[2, 3, 4], &[0, 0, 0], 7), 1),  // a broadcast scalar
            (layout(&[2, 3, 4], &[0, 0, 1], 0), 2),  // a bias over the last dim
            (layout(&[2, 1, 4], &[4, 4, 1], 0), 1),  // a size-1 dim
            (layout(&[3, 2, 4], &[4, 12, 1], 0), 3), // permuted
            (layout(&[2, 3, 4], &[24, 8, 2], 1), 1), // a strided dense slice
            (layout(&[4, 2, 3], &[6, 0, 1], 0), 3),  // broadcast in the middle
        ];
        for (l, ndim) in cases {
            let c = l.collapsed();
            assert_eq!(c.ndim, ndim, "{l:?}");
            assert_eq!(c.small, 1);
            for i in 0..24 {
                assert_eq!(c.offset_of(i), l.offset_of(i), "{l:?} index {i}");
            }
        }
        let huge = layout(&[1 << 20, 1 << 12], &[1 << 13, 1], 0).collapsed();
        assert_eq!((huge.ndim, huge.small), (2, 0), "2^32 elements index in 64 bits");
    }
}
