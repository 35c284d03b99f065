//! Flash attention on tensor cores (`flash.cu`): the forward and backward of
//! [`Op::Attention`](tessera_ir::Op) for bf16 operands, fused and tiled, with online softmax,
//! GQA, causal and sliding-window masks, KV-cache starts and ALiBi, never materialising the
//! S×T scores. Taken when the operands are bf16, the head dim is one of [`HEAD_DIMS`] and the GPU has
//! bf16 MMA (compute capability 8.0); anything else falls back to [`crate::attention`] (cuBLAS
//! scores on f32 operands).
//!
//! Numerics: scores, softmax and accumulation in f32, the exponentials as 2^x with log2 e
//! folded into the scale (`ex2.approx`, as FlashAttention takes them); the probabilities (and
//! dS) are rounded to bf16 for the products with V (and Q, K), as FlashAttention does. The forward saves the
//! output and the log-sum-exp, exactly what the CPU kernel saves, so the memory accountant's
//! charge is unchanged; its scratch is none (forward) or the f32 dQ accumulator and the row
//! sums D (backward).
//!
//! Two backwards: the first (`flash_bwd_*`) gives each warp 16 keys of a block of 128 and has
//! every warp read the whole Q and dO tiles of each step; the second (`flash_bwd2_*`, head dims
//! 64 and 128 on devices with 173 KiB of shared memory per block; the default where its
//! geometry was checked on a GPU, see [`backward_version`]) tiles every product over the warps
//! in two dimensions
//! (FlashAttention-2's scheme: P and dS through shared memory, dK and dV in registers, dQ by
//! atomic f32 adds into the same accumulator), so each fragment loaded serves several MMAs.
//! Both compute the same numbers up to the order of f32 sums; the memory they take is the
//! same (the same scratch, the same outputs).

use crate::alloc::Purpose;
use crate::attention::alibi_slopes;
use crate::backend::{geometry, CudaBackend};
use crate::launch::{launch, Arg, Attn};
use crate::source::type_code;
use crate::tensor::CudaTensor;
use cudarc::driver::LaunchConfig;
use tessera_ir::dist::MeshPos;
use tessera_ir::{AttentionSpec, DType, TensorMeta};
use tessera_runtime::Result;

const BC: usize = 64;
const BR: usize = 128;
const BCB: usize = 128;
const BRB: usize = 32;
const THREADS: u32 = 256;
const THREADS_FWD: u32 = 256;

/// Dynamic shared memory of the forward for head dim `d`: two stages (the tile being computed
/// on and the one being copied in) of K and V tiles, rows padded by 8.
const fn fwd_shared(d: usize) -> usize {
    2 * (2 * BC * (d + 8) * 2)
}

/// The backward's: K and V tiles of 128 keys; two stages of Q and dO tiles with, per query
/// row, its lse, D, ALiBi offset and visible key range; the dS tile.
const fn bwd_shared(d: usize) -> usize {
    2 * BCB * (d + 8) * 2 + 2 * (2 * BRB * (d + 8) * 2 + 5 * BRB * 4) + BRB * (BCB + 8) * 2
}

/// The head dims the kernels are instantiated for (`FA_KERNELS` in `flash.cu`).
pub const HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// The second backward's tiles (`FA2_BC`, `FA2_BR`, `FA2_THREADS` in `flash.cu`): a block per
/// 128 keys, query tiles of 64 rows, 8 warps.
const BC2: usize = 128;
const BR2: usize = 64;
const THREADS2: u32 = 256;

/// The second backward's dynamic shared memory: K and V tiles of 128 keys, two stages of Q and
/// dO tiles of 64 rows, the P and dS tiles ([64][136]), two stages of five words per query row.
/// 172.5 KiB at head dim 128: it fits Hopper's 227 KiB per block, not the A100's 163 KiB (where
/// the first kernel runs instead; see [`backward_kernel`]).
const fn bwd2_shared(d: usize) -> usize {
    2 * BC2 * (d + 8) * 2 + 2 * (2 * BR2 * (d + 8) * 2) + 2 * BR2 * (BC2 + 8) * 2 + 2 * 5 * BR2 * 4
}

/// The head dims of the second backward (`FA2_KERNELS` in `flash.cu`); 32 keeps the first.
pub const HEAD_DIMS2: [usize; 2] = [64, 128];

fn kernel2(d: usize) -> Option<&'static str> {
    match d {
        64 => Some("flash_bwd2_64"),
        128 => Some("flash_bwd2_128"),
        _ => None,
    }
}

/// The second backward's kernels and their dynamic shared memory, set as their maximum when
/// the module loads where the device allows that much per block (else they stay unused).
pub const SHARED_BYTES2: [(&str, usize); 2] =
    [("flash_bwd2_64", bwd2_shared(64)), ("flash_bwd2_128", bwd2_shared(128))];

/// Which flash backward runs, from `TESSERA_FLASH_BWD` (read once) unless
/// [`set_backward_version`] chose: 1, the first kernel everywhere; 2, the FlashAttention-2
/// tiling everywhere it is built; unset (0), the second where its geometry was checked on a
/// GPU — causal or full masks over S = T, no sliding window, no ALiBi: 1.39× the first on the
/// 1.3B LLaMA's shape, its dQ/dK/dV within 4e-5 of the first's (BENCHMARKS.md) — and the first
/// elsewhere.
static VERSION: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Chooses the flash backward for the rest of the process (`None`: back to the environment's
/// choice). For A/B measurements in one process; training should set `TESSERA_FLASH_BWD`.
pub fn set_backward_version(v: Option<u8>) {
    VERSION.store(v.map_or(u8::MAX, |v| v), std::sync::atomic::Ordering::Relaxed);
}

/// The flash backward chosen (see [`VERSION`]): 1, 2, or 0 (by geometry).
pub fn backward_version() -> u8 {
    static ENV: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
    match VERSION.load(std::sync::atomic::Ordering::Relaxed) {
        u8::MAX | 0 => {
            *ENV.get_or_init(|| parse_version(std::env::var("TESSERA_FLASH_BWD").ok().as_deref()))
        }
        v => v,
    }
}

fn parse_version(v: Option<&str>) -> u8 {
    match v.map(str::trim) {
        Some("1") => 1,
        Some("2") => 2,
        _ => 0,
    }
}

/// Whether the second backward runs for this geometry under `version` (see [`VERSION`]).
fn second_backward(version: u8, a: &Attn, spec: &AttentionSpec) -> bool {
    match version {
        1 => false,
        2 => true,
        _ => a.s == a.t && spec.window.is_none() && spec.alibi.is_none(),
    }
}

/// The backward kernel for head dim `d` on this GPU: the second where [`second_backward`]
/// picks it, it is built for `d` and its shared memory fits the device; the first otherwise.
/// (name, grid x tile, block threads, dynamic shared bytes).
fn backward_kernel(
    gpu: &crate::gpu::Gpu,
    a: &Attn,
    spec: &AttentionSpec,
) -> Option<(&'static str, usize, u32, usize)> {
    let d = a.d as usize;
    if second_backward(backward_version(), a, spec) {
        if let Some(name) = kernel2(d).filter(|n| gpu.has_shared(n)) {
            return Some((name, BC2, THREADS2, bwd2_shared(d)));
        }
    }
    kernels(d).map(|(_, b)| (b, BCB, THREADS, bwd_shared(d)))
}

/// The forward and backward kernels of head dim `d`.
fn kernels(d: usize) -> Option<(&'static str, &'static str)> {
    match d {
        32 => Some(("flash_fwd_32", "flash_bwd_32")),
        64 => Some(("flash_fwd_64", "flash_bwd_64")),
        128 => Some(("flash_fwd_128", "flash_bwd_128")),
        _ => None,
    }
}

/// Each flash kernel's dynamic shared memory (set as its maximum when the module loads).
pub const SHARED_BYTES: [(&str, usize); 6] = [
    ("flash_fwd_32", fwd_shared(32)),
    ("flash_fwd_64", fwd_shared(64)),
    ("flash_fwd_128", fwd_shared(128)),
    ("flash_bwd_32", bwd_shared(32)),
    ("flash_bwd_64", bwd_shared(64)),
    ("flash_bwd_128", bwd_shared(128)),
];

/// Whether the flash kernels take this attention: bf16 operands (and results), a head dim they
/// are built for, a GPU with bf16 MMA.
fn applies(be: &CudaBackend, x: &[&CudaTensor], out: &[TensorMeta]) -> bool {
    let d = x[0].dims().last().copied().unwrap_or(0);
    be.gpu().capability().0 >= 8
        && kernels(d).is_some()
        && x[..3].iter().all(|t| t.dtype() == DType::BF16 && t.dims().len() == 4)
        && out.iter().all(|m| m.dtype == DType::BF16 || m.shape.rank() == 3)
}

fn ptr(t: &Option<CudaTensor>) -> Arg {
    Arg::Ptr(t.as_ref().map_or(0, |t| t.ptr()))
}

/// `q, k, v [, start]` → `out, lse`, or `None` when the flash kernels do not apply.
pub fn forward(
    be: &CudaBackend,
    x: &[&CudaTensor],
    spec: &AttentionSpec,
    at: &MeshPos,
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Option<Vec<CudaTensor>>> {
    if !applies(be, x, out) {
        return Ok(None);
    }
    let (q, k, v) = (be.dense_pub(x[0])?, be.dense_pub(x[1])?, be.dense_pub(x[2])?);
    let a = geometry(&q, &k, spec)?;
    let start = x.get(3).map(|s| be.dense_pub(s)).transpose()?;
    let sl = alibi_slopes(be, spec, a.h as usize, at)?;
    let o = be.out_f32(&out[0], p)?;
    let lse = be.out_f32(&out[1], p)?;
    let d = a.d as usize;
    let cfg = LaunchConfig {
        grid_dim: ((a.s as usize).div_ceil(BR) as u32, a.h as u32, a.b as u32),
        block_dim: (THREADS_FWD, 1, 1),
        shared_mem_bytes: fwd_shared(d) as u32,
    };
    let Some((name, _)) = kernels(d) else { return Ok(None) };
    launch(
        be.gpu(),
        name,
        cfg,
        &[
            Arg::Ptr(q.ptr()),
            Arg::Ptr(k.ptr()),
            Arg::Ptr(v.ptr()),
            ptr(&start),
            ptr(&sl),
            Arg::Attn(a),
            Arg::Ptr(o.ptr()),
            Arg::Ptr(lse.ptr()),
        ],
    )?;
    Ok(Some(vec![o, lse]))
}

/// `q, k, v, out, lse, dout` → `dq, dk, dv`, or `None` when the flash kernels do not apply.
pub fn backward(
    be: &CudaBackend,
    x: &[&CudaTensor],
    spec: &AttentionSpec,
    at: &MeshPos,
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Option<Vec<CudaTensor>>> {
    let halves = [x[3], x[5]].iter().all(|t| t.dtype() == DType::BF16);
    if !halves || x[4].dtype() != DType::F32 || !applies(be, x, out) {
        return Ok(None);
    }
    let d: Vec<CudaTensor> = x.iter().map(|t| be.dense_pub(t)).collect::<Result<_>>()?;
    let (q, k, v, o, lse, dout) = (&d[0], &d[1], &d[2], &d[3], &d[4], &d[5]);
    let a: Attn = geometry(q, k, spec)?;
    let sl = alibi_slopes(be, spec, a.h as usize, at)?;
    let g = be.gpu();
    let (b, s, h) = (a.b as usize, a.s as usize, a.h as usize);
    let delta = CudaTensor::empty(g, &[b, h, s], DType::F32, Purpose::Scratch)?;
    let rows = b * s * h;
    launch(
        g,
        "flash_delta",
        LaunchConfig {
            grid_dim: (rows.div_ceil(8).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        },
        &[Arg::Ptr(o.ptr()), Arg::Ptr(dout.ptr()), Arg::Ptr(delta.ptr()), Arg::Attn(a)],
    )?;
    let dq_acc = CudaTensor::empty(g, q.dims(), DType::F32, Purpose::Scratch)?;
    be.fill_pub(&dq_acc, 0.0)?;
    let dq = be.out_f32(&out[0], p)?;
    let dk = be.out_f32(&out[1], p)?;
    let dv = be.out_f32(&out[2], p)?;
    let Some((name, keys, threads, shared)) = backward_kernel(g, &a, spec) else {
        return Ok(None);
    };
    let cfg = LaunchConfig {
        grid_dim: ((a.t as usize).div_ceil(keys) as u32, a.hkv as u32, a.b as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    launch(
        g,
        name,
        cfg,
        &[
            Arg::Ptr(q.ptr()),
            Arg::Ptr(k.ptr()),
            Arg::Ptr(v.ptr()),
            Arg::Ptr(dout.ptr()),
            Arg::Ptr(lse.ptr()),
            Arg::Ptr(delta.ptr()),
            ptr(&sl),
            Arg::Attn(a),
            Arg::Ptr(dq_acc.ptr()),
            Arg::Ptr(dk.ptr()),
            Arg::Ptr(dv.ptr()),
        ],
    )?;
    let n = dq.numel();
    launch(
        g,
        "scale_store",
        crate::launch::elementwise(n),
        &[
            Arg::Ptr(dq_acc.ptr()),
            Arg::F32(a.scale),
            Arg::Ptr(dq.ptr()),
            Arg::I32(type_code(dq.dtype())),
            Arg::I64(n as i64),
        ],
    )?;
    Ok(Some(vec![dq, dk, dv]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unset, the second backward runs over the geometries the H200 checked; `1` and `2` force
    /// one.
    #[test]
    fn the_second_backward_is_the_default_where_it_was_checked() {
        let spec = AttentionSpec::causal(128);
        let a = Attn { b: 4, s: 2048, t: 2048, h: 16, hkv: 16, d: 128, ..Default::default() };
        assert!(second_backward(0, &a, &spec), "self-attention over S = T");
        assert!(!second_backward(0, &Attn { t: 2100, ..a }, &spec), "a KV-cache start");
        let window = AttentionSpec { window: Some(512), ..spec.clone() };
        assert!(!second_backward(0, &a, &window), "a sliding window");
        assert!(second_backward(2, &a, &window) && !second_backward(1, &a, &spec), "forced");
    }

    /// `TESSERA_FLASH_BWD=1` or `2` forces a backward; anything else, or nothing, chooses by
    /// geometry.
    #[test]
    fn backward_version_from_the_environment() {
        assert_eq!(parse_version(Some("2")), 2);
        assert_eq!(parse_version(Some(" 2 ")), 2);
        assert_eq!(parse_version(Some("1")), 1);
        assert_eq!(parse_version(Some("")), 0);
        assert_eq!(parse_version(None), 0);
    }

    /// The blocks per SM the test below assumes are the ones `flash.cu` declares.
    fn src_has_launch_bounds() -> bool {
        let src = crate::source::KERNELS;
        src.contains("__launch_bounds__(FA_THREADS_FWD, (D) <= 64 ? 2 : 1)")
            && src.contains("__launch_bounds__(FA_THREADS, (D) <= 64 ? 2 : 1)")
    }

    /// The tiles fit the shared memory of every GPU with bf16 MMA, as many blocks per SM as
    /// the kernels' launch bounds ask for (A100: 164 KiB per SM, 163 KiB per block), and the
    /// sizes match the kernels' carving of it (`flash.cu`: forward two stages of K, V
    /// [64][D+8]; backward K, V [128][D+8], two stages of Q, dO [32][D+8] and five words per
    /// query row, dS [32][136]).
    #[test]
    fn tiles_fit_shared_memory() {
        assert_eq!(fwd_shared(64), 2 * 18_432);
        assert_eq!(bwd_shared(128), 69_632 + 2 * (17_408 + 640) + 8_704);
        for (name, bytes) in SHARED_BYTES {
            // __launch_bounds__ in FA_KERNELS: two blocks per SM up to head dim 64, else one.
            let d: usize = name.rsplit('_').next().and_then(|d| d.parse().ok()).expect("head dim");
            let blocks = if d <= 64 { 2 } else { 1 };
            assert!(
                bytes <= 163 * 1024 && blocks * bytes <= 164 * 1024,
                "{name}: {bytes} B × {blocks}"
            );
        }
        assert!(src_has_launch_bounds());
        let src = crate::source::KERNELS;
        for (tile, value) in [("FA_BC", BC), ("FA_BR", BR), ("FA_BCB", BCB), ("FA_BRB", BRB)] {
            assert!(
                src.contains(&format!("#define {tile} {value} ")),
                "{tile} differs from flash.cu"
            );
        }
        assert!(src.contains(&format!("#define FA_THREADS {THREADS} ")));
        for (tile, value) in [("FA2_BC", BC2), ("FA2_BR", BR2), ("FA2_THREADS", THREADS2 as usize)]
        {
            assert!(
                src.contains(&format!("#define {tile} {value}\n")),
                "{tile} differs from flash.cu"
            );
        }
        // The second backward: within Hopper's 227 KiB per block; at head dim 64 two blocks
        // per SM (its launch bounds) within Hopper's 228 KiB per SM (1 KiB per block reserved),
        // and one within the A100's 163 KiB.
        assert!(src.contains("__launch_bounds__(FA2_THREADS, (D) <= 64 ? 2 : 1)"));
        assert!(2 * (bwd2_shared(64) + 1024) <= 228 * 1024);
        assert_eq!(bwd2_shared(128), 69_632 + 69_632 + 34_816 + 2_560);
        for (name, bytes) in SHARED_BYTES2 {
            assert!(bytes <= 227 * 1024, "{name}: {bytes} B");
            assert!(crate::gpu::FUNCTIONS.contains(&name), "{name} is not loaded");
        }
        assert!(bwd2_shared(64) <= 163 * 1024);
        for d in HEAD_DIMS2 {
            let name = kernel2(d).expect("a second backward per head dim");
            assert!(src.contains(&format!("FA2_KERNELS({d})")), "flash.cu lacks {name}");
            assert!(SHARED_BYTES2.iter().any(|(n, _)| *n == name));
        }
        assert!(src.contains(&format!("#define FA_THREADS_FWD {THREADS_FWD} ")));
        for d in HEAD_DIMS {
            let (f, b) = kernels(d).expect("a kernel pair per head dim");
            assert!(src.contains(&format!("FA_KERNELS({d})")), "flash.cu lacks head dim {d}");
            for name in [f, b] {
                assert!(SHARED_BYTES.iter().any(|(n, _)| *n == name));
                assert!(crate::gpu::FUNCTIONS.contains(&name), "{name} is not loaded");
            }
        }
    }
}
