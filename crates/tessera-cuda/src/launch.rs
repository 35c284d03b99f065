//! Kernel launches: arguments collected as values on the stack (so none is a dangling
//! temporary), then one `cuLaunchKernel`; every launch's error is checked.

use crate::gpu::Gpu;
use crate::tensor::Layout;
use cudarc::driver::{DeviceRepr, LaunchConfig};
use std::ffi::c_void;
use tessera_ir::DType;
use tessera_runtime::{Result, RuntimeError};

/// Attention geometry (matches `struct Attn` in `layers.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Attn {
    pub b: i64,
    pub s: i64,
    pub t: i64,
    pub h: i64,
    pub hkv: i64,
    pub d: i64,
    pub causal: i32,
    pub window: i64,
    pub scale: f32,
}

// SAFETY: plain old data with the C layout the kernels declare.
unsafe impl DeviceRepr for Attn {}

/// The dtype codes of a norm kernel's operands (matches `struct NormCodes` in `reduce.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct NormCodes {
    pub x: i32,
    pub w: i32,
    pub b: i32,
    pub y: i32,
    pub dy: i32,
}

// SAFETY: plain old data with the C layout the kernels declare.
unsafe impl DeviceRepr for NormCodes {}

/// One kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device address (0: a null pointer).
    Ptr(u64),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
    F64(f64),
    Layout(Layout),
    Attn(Attn),
    Norm(NormCodes),
}

/// Threads per block of the elementwise and row kernels.
pub const THREADS: u32 = 256;

/// A grid-stride launch over `n` elements.
pub fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 20) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// Whether an operand at `addr` seen through `layout` takes the elementwise kernels' dense
/// fast path (`vec8_ok` in `kernels.cu`): f32, bf16 or f16, 16-byte aligned at its first
/// element, dense or a row repeated down the rows with a multiple of 8 columns.
pub fn dense8(addr: u64, layout: &Layout, dtype: DType) -> bool {
    let size = match dtype {
        DType::F32 => 4,
        DType::BF16 | DType::F16 => 2,
        _ => return false,
    };
    let l = layout.collapsed();
    let dense = l.ndim == 1 && l.strides[0] == 1;
    let rows = l.ndim == 2 && l.strides[0] == 0 && l.strides[1] == 1 && l.dims[1] % 8 == 0;
    (dense || rows) && (addr as i64 + l.offset * size) % 16 == 0
}

/// The launch of an elementwise kernel over `n` outputs at `out` whose operands are `ins`
/// (address, layout, dtype): a thread per eight elements when every operand and the output
/// take the dense fast path, a thread per element otherwise. The kernel decides the path for
/// itself (its grid-stride loops cover any grid), so this only sizes the grid.
pub fn elementwise_ops(n: usize, ins: &[(u64, Layout, DType)], out: (u64, DType)) -> LaunchConfig {
    let fast = ins.iter().all(|(a, l, d)| dense8(*a, l, *d))
        && matches!(out.1, DType::F32 | DType::BF16 | DType::F16)
        && out.0.is_multiple_of(16);
    if fast {
        elementwise(n.div_ceil(8))
    } else {
        elementwise(n)
    }
}

/// One block per row (or output element).
pub fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub fn launch(gpu: &Gpu, name: &'static str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
    launch_then(gpu, name, cfg, args, None::<&i32>)
}

/// The rotary kernel's inverse frequencies, passed by value in the launch's parameters
/// (`struct RopeFreq` in `layers.cu`): no upload, which would be a synchronous copy that
/// drains the GPU's queue in the middle of a step.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RopeFreq {
    pub f: [f32; crate::attention::ROPE_MAX_HALF],
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for RopeFreq {}

/// The most arguments a launch takes (the longest kernel signature, `adamw`, has 21).
pub const MAX_ARGS: usize = 24;

/// [`launch`] with one more argument after `args`, of any kernel-parameter type.
///
/// The arguments are held on the stack and handed to one `cuLaunchKernel`: no allocation per
/// launch (cudarc's launch builder collects its parameter pointers in a `Vec` and walks its
/// event lists each time). The context is bound as cudarc's launch binds it.
pub fn launch_then<T: DeviceRepr>(
    gpu: &Gpu,
    name: &'static str,
    cfg: LaunchConfig,
    args: &[Arg],
    last: Option<&T>,
) -> Result<()> {
    if cfg.grid_dim.0 == 0 {
        return Ok(());
    }
    if args.len() >= MAX_ARGS {
        return Err(RuntimeError::Binding(format!(
            "cuda: launching {name}: {} arguments (at most {})",
            args.len(),
            MAX_ARGS - 1
        )));
    }
    let f = gpu.func(name)?;
    let mut vals = [Arg::I32(0); MAX_ARGS];
    for (v, a) in vals.iter_mut().zip(args) {
        *v = match a {
            Arg::Layout(l) => Arg::Layout(l.collapsed()),
            other => *other,
        };
    }
    let mut params = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
    for (p, v) in params.iter_mut().zip(&vals[..args.len()]) {
        *p = param(v);
    }
    let mut n = args.len();
    if let Some(v) = last {
        params[n] = v as *const T as *mut c_void;
        n += 1;
    }
    let bound = gpu.ctx.bind_to_thread();
    // SAFETY: the arguments match the kernel's signature in the `.cu` sources (one call site per
    // kernel, each checked by the GPU parity run); pointers are live device buffers; `params`
    // points into `vals` and `last`, which outlive the call (the driver copies the values).
    bound
        .and_then(|_| unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                gpu.stream.cu_stream(),
                &mut params[..n],
            )
        })
        .map_err(|e| RuntimeError::Binding(format!("cuda: launching {name}: {e}")))
}

/// The kernel-parameter pointer of an argument: the address of its value.
fn param(a: &Arg) -> *mut c_void {
    match a {
        Arg::Ptr(v) | Arg::U64(v) => v as *const u64 as *mut c_void,
        Arg::I32(v) => v as *const i32 as *mut c_void,
        Arg::I64(v) => v as *const i64 as *mut c_void,
        Arg::F32(v) => v as *const f32 as *mut c_void,
        Arg::F64(v) => v as *const f64 as *mut c_void,
        Arg::Layout(v) => v as *const Layout as *mut c_void,
        Arg::Attn(v) => v as *const Attn as *mut c_void,
        Arg::Norm(v) => v as *const NormCodes as *mut c_void,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(offset: i64, dims: &[i64], strides: &[i64]) -> Layout {
        let mut l = Layout { ndim: dims.len() as i32, offset, ..Default::default() };
        l.dims[..dims.len()].copy_from_slice(dims);
        l.strides[..strides.len()].copy_from_slice(strides);
        l
    }

    /// Each argument's parameter pointer is the address of its value, of the value's size.
    #[test]
    fn parameters_point_at_the_values() {
        let attn =
            Attn { b: 2, s: 100, t: 130, h: 8, hkv: 2, d: 64, causal: 1, window: 7, scale: 0.5 };
        let vals = [
            Arg::Ptr(0xdead_beef_0000),
            Arg::I32(-7),
            Arg::I64(-(1 << 40)),
            Arg::F32(1.5),
            Arg::F64(-2.25),
            Arg::Attn(attn),
        ];
        // SAFETY: each pointer is read as the type of the value it points at, while `vals` lives.
        unsafe {
            assert_eq!(*(param(&vals[0]) as *const u64), 0xdead_beef_0000);
            assert_eq!(*(param(&vals[1]) as *const i32), -7);
            assert_eq!(*(param(&vals[2]) as *const i64), -(1 << 40));
            assert_eq!(*(param(&vals[3]) as *const f32), 1.5);
            assert_eq!(*(param(&vals[4]) as *const f64), -2.25);
            let a = &*(param(&vals[5]) as *const Attn);
            assert_eq!((a.b, a.t, a.window, a.scale), (2, 130, 7, 0.5));
        }
    }

    /// The grid-sizing predicate takes what the kernels' `vec8_ok` takes: dense or
    /// row-repeated float operands, 16-byte aligned at their first element.
    #[test]
    fn dense_fast_path_predicate() {
        let dense = layout(0, &[4, 64], &[64, 1]);
        assert!(dense8(256, &dense, DType::BF16));
        assert!(dense8(256, &dense, DType::F32));
        // Aligned base, first element 1 or 4 bf16 elements in: 2 and 8 bytes off.
        assert!(!dense8(256, &layout(1, &[4, 64], &[64, 1]), DType::BF16));
        assert!(!dense8(256, &layout(4, &[4, 64], &[64, 1]), DType::BF16));
        assert!(dense8(256, &layout(8, &[4, 64], &[64, 1]), DType::BF16));
        assert!(dense8(256, &layout(4, &[4, 64], &[64, 1]), DType::F32));
        assert!(!dense8(258, &dense, DType::BF16));
        // A bias repeated down the rows: columns a multiple of 8.
        assert!(dense8(256, &layout(0, &[4, 64], &[0, 1]), DType::BF16));
        assert!(!dense8(256, &layout(0, &[4, 12], &[0, 1]), DType::BF16));
        // Transposed, broadcast scalars and integers take the general path.
        assert!(!dense8(256, &layout(0, &[64, 4], &[1, 64]), DType::F32));
        assert!(!dense8(256, &layout(0, &[64], &[0]), DType::F32));
        assert!(!dense8(256, &dense, DType::I64));
        // The grid: a thread per eight elements only when every operand and the output qualify.
        let n = 4 * 64 * 256;
        let fast = elementwise_ops(n, &[(256, dense, DType::BF16)], (512, DType::BF16));
        assert_eq!(fast.grid_dim.0 as usize, n / 8 / THREADS as usize);
        let slow = elementwise_ops(n, &[(256, dense, DType::BF16)], (520, DType::BF16));
        assert_eq!(slow.grid_dim.0 as usize, n / THREADS as usize);
    }
}
