//! Attention and rotary embeddings on the GPU. The forward saves what the CPU kernel saves
//! (the output and the log-sum-exp `[B,H,S]`); the backward recomputes the probabilities.
//! Per batch element, the scores of every head come from cuBLAS (`scale·Q·Kᵀ`, strided over
//! the kv heads, so GQA needs no copy of K or V), a row kernel applies the masks (causal,
//! sliding window, KV-cache starts) and ALiBi and takes the softmax, and the products with V
//! (and, backward, dP, dQ, dK, dV) are GEMMs again: an [H, S, T] f32 scratch per batch
//! element, reused. Not yet the fused flash kernel (see BENCHMARKS.md). That scratch is
//! [`Purpose::Scratch`], reported beside the Program's bytes, not the op's declared workspace
//! (`min(S, ATTENTION_SCRATCH_ROWS) × T × 4`, which the Program charges and the flash kernels
//! never use): at long context (H·S·T·4 bytes) this fallback is for short sequences only.
//!
//! Ring attention (`AttentionSpec::ring`, `cp=ring`) runs here (the flash kernels do not take
//! it): the row kernels compute the queries' and keys' global positions from the ring's
//! coordinates (passed by value; binary search for the visible key range, as the CPU's
//! `Geom::visible`), and the backward's seventh input, the
//! log-sum-exp's cotangent, lowers the row term D by it. The merges are in module `ring`.

use crate::alloc::Purpose;
use crate::backend::{geometry, CudaBackend};
use crate::gemm::{gemm_f32, ColMat};
use crate::launch::{launch, launch_then, Arg, Attn, THREADS};
use crate::source::float_code;
use crate::tensor::CudaTensor;
use cudarc::driver::{DeviceRepr, LaunchConfig};
use tessera_ir::dist::MeshPos;
use tessera_ir::{AttentionSpec, DType, TensorMeta};
use tessera_runtime::Result;

fn rows(a: &Attn, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (a.s as u32, a.h as u32, a.b as u32),
        block_dim: (THREADS / 2, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

/// Ring attention's positions (matches `struct RingPos` in `layers.cu`): this device's cp
/// coordinate, the key block owner's, the ring's size and the zig-zag chunking, from which
/// the kernels compute `RingBlock::positions`; `on` 0 without a ring.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RingPos {
    on: i64,
    qc: i64,
    kc: i64,
    size: i64,
    zigzag: i64,
}

// SAFETY: plain old data with the C layout the kernels declare.
unsafe impl DeviceRepr for RingPos {}

impl RingPos {
    fn of(spec: &AttentionSpec, at: &MeshPos) -> RingPos {
        let Some(r) = &spec.ring else { return RingPos::default() };
        let (c, n) = (r.coord(Some(at)), r.size.max(1));
        let src = (c + n - r.step % n) % n;
        RingPos { on: 1, qc: c as i64, kc: src as i64, size: n as i64, zigzag: i64::from(r.zigzag) }
    }
}

/// What the row kernels read besides the scores: the per-head ALiBi slopes (null without
/// ALiBi), the per-row starts (a KV cache) and ring attention's positions.
struct Extras {
    slopes: Option<CudaTensor>,
    start: Option<CudaTensor>,
    ring: RingPos,
}

fn addr(t: &Option<CudaTensor>) -> Arg {
    Arg::Ptr(t.as_ref().map_or(0, |t| t.ptr()))
}

fn extras(
    be: &CudaBackend,
    spec: &AttentionSpec,
    a: &Attn,
    start: Option<&CudaTensor>,
    at: &MeshPos,
) -> Result<Extras> {
    let start = start.map(|s| be.dense_pub(s)).transpose()?;
    let slopes = alibi_slopes(be, spec, a.h as usize, at)?;
    Ok(Extras { slopes, start, ring: RingPos::of(spec, at) })
}

/// This device's ALiBi slope per query head, on the device (scratch); `None` without ALiBi.
pub(crate) fn alibi_slopes(
    be: &CudaBackend,
    spec: &AttentionSpec,
    h: usize,
    at: &MeshPos,
) -> Result<Option<CudaTensor>> {
    let Some(alibi) = &spec.alibi else { return Ok(None) };
    let s: Vec<f32> = alibi.local_slopes(h, Some(at))?.into_iter().map(|x| x as f32).collect();
    let t = candle_core::Tensor::from_vec(s, h, &candle_core::Device::Cpu)?;
    Ok(Some(be.upload_as(&t, Purpose::Scratch)?))
}

/// Byte offsets are element offsets × 4 (every operand here is f32).
const F: u64 = 4;

/// The products of one batch element `bi`, per query head `h = g·group + r`: the strided
/// batch runs over the kv heads `g` for each `r`, so a batch never writes one output twice.
/// With `kv_of` (tensor parallelism past the KV heads: k/v hold every KV head, q some of the
/// query heads), one product per local query head `r`, reading KV head `kv_of[r]`.
struct Heads<'a> {
    a: &'a Attn,
    bi: usize,
    kv_of: Option<&'a [usize]>,
}

impl Heads<'_> {
    fn group(&self) -> usize {
        (self.a.h / self.a.hkv) as usize
    }
    /// How many strided batches cover the heads (`r` runs over them).
    fn launches(&self) -> usize {
        self.kv_of.map_or(self.group(), <[usize]>::len)
    }
    /// Each strided batch's count.
    fn count(&self) -> usize {
        if self.kv_of.is_some() {
            1
        } else {
            self.a.hkv as usize
        }
    }
    /// Whether batch `r` is the first to write its kv heads' dK/dV (β = 0); with `kv_of`,
    /// they are zeroed first and every batch adds.
    fn first(&self, r: usize) -> bool {
        self.kv_of.is_none() && r == 0
    }
    /// q/out/dout rows of head `g·group + r`: [S, D] with row stride H·D.
    fn q(&self, t: &CudaTensor, r: usize) -> ColMat {
        let a = self.a;
        let off = (self.bi as i64 * a.s * a.h * a.d + r as i64 * a.d) as u64;
        ColMat {
            ptr: t.ptr() + off * F,
            ld: a.h * a.d,
            stride: self.group().max(1) as i64 * a.d,
            trans: false,
        }
    }
    /// k/v rows of kv head g (batch `r`'s first): [T, D] with row stride Hkv·D.
    fn kv(&self, t: &CudaTensor, r: usize) -> ColMat {
        let a = self.a;
        let g = self.kv_of.map_or(0, |k| k[r]) as i64;
        let off = (self.bi as i64 * a.t * a.hkv * a.d + g * a.d) as u64;
        ColMat { ptr: t.ptr() + off * F, ld: a.hkv * a.d, stride: a.d, trans: false }
    }
    /// Scores of head `g·group + r` in a per-batch-element [H, S, T] buffer.
    fn scores(&self, t: &CudaTensor, r: usize) -> ColMat {
        let a = self.a;
        ColMat {
            ptr: t.ptr() + (r as i64 * a.s * a.t) as u64 * F,
            ld: a.t,
            stride: self.group().max(1) as i64 * a.s * a.t,
            trans: false,
        }
    }
}

/// `scores = scale · Q Kᵀ` for every head of batch element `bi` (row-major S×T, computed as
/// the column-major T×S product `K·Qᵀ`).
fn scores(
    be: &CudaBackend,
    hd: &Heads,
    q: &CudaTensor,
    k: &CudaTensor,
    sc: &CudaTensor,
) -> Result<()> {
    let a = hd.a;
    for r in 0..hd.launches() {
        let kt = ColMat { trans: true, ..hd.kv(k, r) };
        gemm_f32(
            be,
            (a.t as usize, a.s as usize, a.d as usize),
            a.scale,
            kt,
            hd.q(q, r),
            0.0,
            hd.scores(sc, r),
            hd.count(),
        )?;
    }
    Ok(())
}

/// Each local query head's KV head under tensor parallelism past the KV heads (`None`
/// otherwise: the strided batches of `Heads`).
fn kv_of(spec: &AttentionSpec, a: &Attn, at: &MeshPos) -> Result<Option<Vec<usize>>> {
    if spec.kv_whole.is_none() {
        return Ok(None);
    }
    let k = spec
        .kv_heads_of(a.h as usize, a.hkv as usize, Some(at))
        .map_err(|e| tessera_runtime::RuntimeError::Binding(format!("attention: {e}")))?;
    Ok(Some(k))
}

fn row_grid(a: &Attn) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (a.s as u32, a.h as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Scores scratch for one batch element: [H, S, T] f32.
fn scratch(be: &CudaBackend, a: &Attn) -> Result<CudaTensor> {
    CudaTensor::empty(
        be.gpu(),
        &[a.h as usize, a.s as usize, a.t as usize],
        DType::F32,
        Purpose::Scratch,
    )
}

pub fn forward(
    be: &CudaBackend,
    x: &[&CudaTensor],
    spec: &AttentionSpec,
    at: &MeshPos,
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let (q, k, v) = (be.dense_pub(x[0])?, be.dense_pub(x[1])?, be.dense_pub(x[2])?);
    let a = geometry(&q, &k, spec)?;
    let ex = extras(be, spec, &a, x.get(3).copied(), at)?;
    let o = be.out_f32(&out[0], p)?;
    let lse = be.out_f32(&out[1], p)?;
    let sc = scratch(be, &a)?;
    let kv = kv_of(spec, &a, at)?;
    for bi in 0..a.b as usize {
        let hd = Heads { a: &a, bi, kv_of: kv.as_deref() };
        scores(be, &hd, &q, &k, &sc)?;
        launch_then(
            be.gpu(),
            "attn_softmax",
            row_grid(&a),
            &[
                Arg::Ptr(sc.ptr()),
                addr(&ex.start),
                addr(&ex.slopes),
                Arg::Attn(a),
                Arg::I64(bi as i64),
                Arg::Ptr(lse.ptr()),
            ],
            Some(&ex.ring),
        )?;
        // out = P·V: row-major S×D as the column-major D×S product Vᵀ·Pᵀ.
        for r in 0..hd.launches() {
            gemm_f32(
                be,
                (a.d as usize, a.s as usize, a.t as usize),
                1.0,
                hd.kv(&v, r),
                hd.scores(&sc, r),
                0.0,
                hd.q(&o, r),
                hd.count(),
            )?;
        }
    }
    Ok(vec![o, lse])
}

/// Inputs `q, k, v, out, lse, dout` and, under ring attention's merge, `dlse` (the
/// log-sum-exp's cotangent, lowering the row term D by it) → `dq, dk, dv`.
pub fn backward(
    be: &CudaBackend,
    x: &[&CudaTensor],
    spec: &AttentionSpec,
    at: &MeshPos,
    out: &[TensorMeta],
    p: Purpose,
) -> Result<Vec<CudaTensor>> {
    let d: Vec<CudaTensor> = x.iter().map(|t| be.dense_pub(t)).collect::<Result<_>>()?;
    let (q, k, v, o, lse, dout) = (&d[0], &d[1], &d[2], &d[3], &d[4], &d[5]);
    let a = geometry(q, k, spec)?;
    let ex = extras(be, spec, &a, None, at)?;
    let dlse = d.get(6);
    let delta = CudaTensor::empty(
        be.gpu(),
        &[a.b as usize, a.h as usize, a.s as usize],
        DType::F32,
        Purpose::Scratch,
    )?;
    launch(
        be.gpu(),
        "attention_delta",
        rows(&a, 0),
        &[
            Arg::Ptr(o.ptr()),
            Arg::Ptr(dout.ptr()),
            Arg::Ptr(delta.ptr()),
            Arg::Attn(a),
            Arg::Ptr(dlse.map_or(0, |t| t.ptr())),
        ],
    )?;
    let dq = be.out_f32(&out[0], p)?;
    let dk = be.out_f32(&out[1], p)?;
    let dv = be.out_f32(&out[2], p)?;
    let sc = scratch(be, &a)?;
    let dp = scratch(be, &a)?;
    let (s, t, dd) = (a.s as usize, a.t as usize, a.d as usize);
    let kv = kv_of(spec, &a, at)?;
    if kv.is_some() {
        // KV heads no local query head reads get no gradient; the others sum over batches.
        be.fill_pub(&dk, 0.0)?;
        be.fill_pub(&dv, 0.0)?;
    }
    for bi in 0..a.b as usize {
        let hd = Heads { a: &a, bi, kv_of: kv.as_deref() };
        let count = hd.count();
        scores(be, &hd, q, k, &sc)?;
        // dP = dO·Vᵀ (the scores' shape).
        for r in 0..hd.launches() {
            let vt = ColMat { trans: true, ..hd.kv(v, r) };
            gemm_f32(be, (t, s, dd), 1.0, vt, hd.q(dout, r), 0.0, hd.scores(&dp, r), count)?;
        }
        launch_then(
            be.gpu(),
            "attn_grad_scores",
            row_grid(&a),
            &[
                Arg::Ptr(sc.ptr()),
                Arg::Ptr(dp.ptr()),
                Arg::Ptr(lse.ptr()),
                Arg::Ptr(delta.ptr()),
                addr(&ex.start),
                addr(&ex.slopes),
                Arg::Attn(a),
                Arg::I64(bi as i64),
            ],
            Some(&ex.ring),
        )?;
        for r in 0..hd.launches() {
            let beta = if hd.first(r) { 0.0 } else { 1.0 };
            // dQ = scale·dS·K: row-major S×D = column-major Kᵀ(D×T)·dSᵀ.
            gemm_f32(
                be,
                (dd, s, t),
                a.scale,
                hd.kv(k, r),
                hd.scores(&dp, r),
                0.0,
                hd.q(&dq, r),
                count,
            )?;
            // dK += scale·dSᵀ·Q: row-major T×D = column-major Qᵀ(D×S)·dS.
            let ds_t = ColMat { trans: true, ..hd.scores(&dp, r) };
            gemm_f32(be, (dd, t, s), a.scale, hd.q(q, r), ds_t, beta, hd.kv(&dk, r), count)?;
            // dV += Pᵀ·dO: row-major T×D = column-major dOᵀ(D×S)·P.
            let p_t = ColMat { trans: true, ..hd.scores(&sc, r) };
            gemm_f32(be, (dd, t, s), 1.0, hd.q(dout, r), p_t, beta, hd.kv(&dv, r), count)?;
        }
    }
    Ok(vec![dq, dk, dv])
}

/// The largest half head dim of the `rope` kernel's angle table (`ROPE_MAX_HALF` in layers.cu).
pub const ROPE_MAX_HALF: usize = 512;

pub fn rope(
    be: &CudaBackend,
    x: &CudaTensor,
    positions: Option<&CudaTensor>,
    inv_freq: &[f64],
    inverse: bool,
    out: &TensorMeta,
    p: Purpose,
) -> Result<CudaTensor> {
    let x = be.dense_pub(x)?;
    let &[_, s, h, d] = x.dims() else {
        return Err(tessera_runtime::RuntimeError::Binding(format!(
            "rope: x {:?} must be [B,S,H,D]",
            x.dims()
        )));
    };
    if d / 2 > ROPE_MAX_HALF || inv_freq.len() > ROPE_MAX_HALF || h * d > i32::MAX as usize {
        return Err(tessera_runtime::RuntimeError::Unsupported {
            backend: "cuda".into(),
            op: "rope".into(),
            reason: format!(
                "head dim {d} over {heads} heads (the kernel takes head dims up to {})",
                2 * ROPE_MAX_HALF,
                heads = h
            ),
        });
    }
    let pos = positions.map(|t| be.dense_pub(t)).transpose()?;
    let y = be.out_f32(out, p)?;
    // One block per token with positions given, else one per sequence position over the
    // batch rows sharing its angles: the angles once per block, then every head's pairs.
    let tokens = x.numel() / (h * d).max(1);
    let (blocks, batch) = match pos {
        Some(_) => (tokens, 1),
        None => (s.min(tokens), tokens / s.max(1)),
    };
    let mut freq = crate::launch::RopeFreq { f: [0.0; ROPE_MAX_HALF] };
    for (f, &v) in freq.f.iter_mut().zip(inv_freq) {
        *f = v as f32;
    }
    crate::launch::launch_then(
        be.gpu(),
        "rope",
        crate::launch::per_row(blocks),
        &[
            Arg::Ptr(x.ptr()),
            Arg::I32(float_code("rope", x.dtype())?),
            Arg::Ptr(pos.as_ref().map_or(0, |t| t.ptr())),
            Arg::Ptr(y.ptr()),
            Arg::I32(float_code("rope", y.dtype())?),
            Arg::I64(s as i64),
            Arg::I64(h as i64),
            Arg::I64(d as i64),
            Arg::F32(if inverse { -1.0 } else { 1.0 }),
            Arg::I64(batch as i64),
        ],
        Some(&freq),
    )?;
    Ok(y)
}
