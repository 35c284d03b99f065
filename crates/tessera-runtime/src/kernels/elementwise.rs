//! Fill, unary, binary (NumPy broadcasting), cast and dropout, plus the helpers the other
//! kernel files of this crate share:
//!
//! - [`View`] and [`walk`] (in `strided.rs`, re-exported here): read candle views
//!   (broadcast, transposed, narrowed, offset) in place through their strides, in parallel
//!   chunks, with no materialising copy;
//! - [`exp_f32`]: a branch-free `exp` (Cody–Waite reduction + Cephes polynomial, ≤ 2 ulp)
//!   that LLVM vectorises, used by every exp-heavy f32 loop (softmax, cross-entropy, GELU);
//! - f64-accumulating sums that vectorise (eight independent lanes).
//!
//! Numerics: f32 in, f32 out (binary ops also bf16 in, bf16 out: computed in f32, rounded
//! once, as the backend's upcast path would). Functions whose textbook form cancels (1 − tanh², σ(1 − σ),
//! 0.5·(1 + tanh)) are rewritten in forms that do not; where terms still cancel (the GELU
//! and SiLU derivatives at their zero crossings) the function is evaluated in f64 with a
//! vectorisable [`exp_f64`]; exact GELU uses an f64 erfc (Cephes' rational approximations).
//! Outputs are within a few f32 ulps of the exact value.

use super::inplace::Elem;
use super::simd::wide;
use super::strided::{fresh, map1_as, map2_as, map3};
pub(super) use super::strided::{walk, View};
use crate::tensor::{candle_dtype, from_vec};
use crate::{Result, RuntimeError};
use candle_core::{DType as CDType, Device, Tensor};
use half::bf16;
use std::mem::MaybeUninit;
use tessera_ir::ops::elementwise::dropout_keep;
use tessera_ir::{BinaryOp, DType, TensorMeta, UnaryOp};

pub(super) use super::strided::{numel, CHUNK};

// ---- shared helpers -----------------------------------------------------------------------

pub(super) fn unsupported(op: &str, reason: impl Into<String>) -> RuntimeError {
    RuntimeError::Unsupported { backend: "cpu".into(), op: op.into(), reason: reason.into() }
}

/// Errors unless `t` is f32 (the only float type the CPU kernels compute in for now).
pub(super) fn expect_f32(t: &Tensor, op: &str, what: &str) -> Result<()> {
    if t.dtype() == CDType::F32 {
        Ok(())
    } else {
        Err(unsupported(
            op,
            format!("{what} is {:?}: f32 only on the CPU backend for now", t.dtype()),
        ))
    }
}

/// Errors unless `t` holds integers as the runtime stores them (i64).
pub(super) fn expect_i64(t: &Tensor, op: &str, what: &str) -> Result<()> {
    if t.dtype() == CDType::I64 {
        Ok(())
    } else {
        Err(unsupported(
            op,
            format!("{what} must be i64 (token ids / targets), got {:?}", t.dtype()),
        ))
    }
}

/// Σ f(x) accumulated in f64 over eight independent lanes (vectorisable, and accurate: each
/// lane sums n/8 terms in f64).
#[inline(always)]
pub(super) fn sum_by<E: Copy>(xs: &[E], f: impl Fn(E) -> f64) -> f64 {
    let mut acc = [0f64; 8];
    let (chunks, rest) = xs.as_chunks::<8>();
    for c in chunks {
        for k in 0..8 {
            acc[k] += f(c[k]);
        }
    }
    let tail: f64 = rest.iter().map(|&v| f(v)).sum();
    acc.iter().sum::<f64>() + tail
}

/// Σ f(x, y) over two equally long slices, accumulated as [`sum_by`].
#[inline(always)]
pub(super) fn sum_by2(xs: &[f32], ys: &[f32], f: impl Fn(f32, f32) -> f64) -> f64 {
    debug_assert_eq!(xs.len(), ys.len());
    let mut acc = [0f64; 8];
    let ((cx, rx), (cy, ry)) = (xs.as_chunks::<8>(), ys.as_chunks::<8>());
    for (a, b) in cx.iter().zip(cy) {
        for k in 0..8 {
            acc[k] += f(a[k], b[k]);
        }
    }
    let tail: f64 = rx.iter().zip(ry).map(|(&x, &y)| f(x, y)).sum();
    acc.iter().sum::<f64>() + tail
}

/// Maximum of a slice (NaN ignored, as `f64::max` folds do; −∞ for an empty slice). A
/// compare-and-select per lane: vectorises to `maxps`, unlike `f32::max`.
#[inline(always)]
pub(super) fn max_f32(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let (chunks, rest) = xs.as_chunks::<8>();
    for c in chunks {
        for k in 0..8 {
            acc[k] = if c[k] > acc[k] { c[k] } else { acc[k] };
        }
    }
    let m = rest.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    acc.iter().fold(m, |m, &v| if v > m { v } else { m })
}

/// Σ e^{x − m} in f64: exponentials of blocks of 512 into a stack buffer (a vectorised map),
/// then an f64 sum of the block — twice as fast as converting inside one fused loop.
#[inline(always)]
pub(super) fn sum_exp(xs: &[f32], m: f32) -> f64 {
    let mut buf = [0f32; 512];
    let mut total = 0.0;
    for c in xs.chunks(512) {
        let b = &mut buf[..c.len()];
        for (o, &v) in b.iter_mut().zip(c) {
            *o = exp_f32(v - m);
        }
        total += sum_by(b, |v| v as f64);
    }
    total
}

/// eˣ in f32, branch-free so that loops calling it vectorise: Cody–Waite reduction
/// x = n·ln2 + r, |r| ≤ ln2/2, Cephes' degree-6 polynomial for eʳ (≤ 2 ulp), and 2ⁿ built
/// from exponent bits as two factors so that results down to the subnormals are right.
/// NaN → NaN, +∞ → +∞, −∞ → 0.
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4; // ln 2 split: C1 + C2, C1 exact in 9 bits
    const C2: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5·2²³: adding it rounds to an integer
    let x = x.clamp(-104.0, 89.0);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let r = x - n * C1 - n * C2;
    let z = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let p = p * z + r + 1.0;
    let n1 = ni >> 1;
    let n2 = ni.wrapping_sub(n1);
    let s1 = f32::from_bits((n1.wrapping_add(127) as u32).wrapping_shl(23));
    let s2 = f32::from_bits((n2.wrapping_add(127) as u32).wrapping_shl(23));
    p * s1 * s2
}

/// eˣ in f64, branch-free like [`exp_f32`] (reduction by ln 2 in two parts, degree-10
/// Taylor polynomial on |r| ≤ ln2/2: relative error < 1e-12, far below f32's 6e-8), for the
/// few f32 functions that need more than f32 in their intermediate terms.
#[inline(always)]
pub(super) fn exp_f64(x: f64) -> f64 {
    const LOG2E: f64 = std::f64::consts::LOG2_E;
    const LN2_HI: f64 = 6.931_471_803_691_238e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5·2⁵²
    let x = x.clamp(-1080.0, 710.0);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let ni = (t.to_bits() as i64).wrapping_sub(MAGIC.to_bits() as i64);
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.0 / 3_628_800.0;
    for c in [
        1.0 / 362_880.0,
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    let n1 = ni >> 1;
    let n2 = ni.wrapping_sub(n1);
    let s1 = f64::from_bits((n1.wrapping_add(1023) as u64).wrapping_shl(52));
    let s2 = f64::from_bits((n2.wrapping_add(1023) as u64).wrapping_shl(52));
    p * s1 * s2
}

/// [`sigmoid_parts`] in f64.
#[inline(always)]
fn sigmoid_parts_f64(x: f64) -> (f64, f64) {
    let e = exp_f64(-x.abs());
    let inv = 1.0 / (1.0 + e);
    let s = if x >= 0.0 { inv } else { e * inv };
    (s, e * inv * inv)
}

/// (σ(x), σ(x)·(1 − σ(x))) without cancellation: with e = e^{−|x|}, σ(|x|) = 1/(1+e),
/// σ(−|x|) = e/(1+e) and σ(x)(1 − σ(x)) = e/(1+e)².
#[inline(always)]
fn sigmoid_parts(x: f32) -> (f32, f32) {
    let e = exp_f32(-x.abs());
    let inv = 1.0 / (1.0 + e);
    let s = if x >= 0.0 { inv } else { e * inv };
    (s, e * inv * inv)
}

/// √(2/π), GPT-2's tanh-GELU constant.
const GELU_TANH_C: f64 = 0.797_884_560_802_865_4;
const GELU_TANH_A: f64 = 0.044_715;

/// GeluTanh: 0.5·x·(1 + tanh(u)) = x·σ(2u), u = √(2/π)(x + 0.044715x³), in f32: no
/// cancellation; the rounding of u (≈ 4ε·|2u| relative in σ) only matters where the output is
/// already below 1e-3 of |x|.
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = GELU_TANH_C as f32;
    const A: f32 = GELU_TANH_A as f32;
    let u2 = 2.0 * C * (x + A * x * x * x);
    x * sigmoid_parts(u2).0
}

/// d/dx of GeluTanh: σ(2u) + x·σ(2u)(1 − σ(2u))·2u'(x) (= 0.5(1+t) + 0.5x(1−t²)u'), in f64:
/// the two terms cancel where the derivative crosses zero (x ≈ −0.75).
#[inline(always)]
fn gelu_tanh_grad(x: f32) -> f32 {
    let x = x as f64;
    let x2 = x * x;
    let u2 = 2.0 * GELU_TANH_C * (x + GELU_TANH_A * x2 * x);
    let (s, ds) = sigmoid_parts_f64(u2);
    (s + x * ds * (2.0 * GELU_TANH_C * (1.0 + 3.0 * GELU_TANH_A * x2))) as f32
}

/// d/dx of SiLU: σ(x) + x·σ(x)(1 − σ(x)), in f64 (the terms cancel near x ≈ −1.28).
#[inline(always)]
fn silu_grad(x: f32) -> f32 {
    let x = x as f64;
    let (s, ds) = sigmoid_parts_f64(x);
    (s + x * ds) as f32
}

/// Σ c_k x^k by Horner, highest power first.
#[inline(always)]
fn polevl(x: f64, c: &[f64]) -> f64 {
    c.iter().fold(0.0, |a, &k| a * x + k)
}

/// Like [`polevl`] with an implicit leading coefficient 1.
#[inline(always)]
fn p1evl(x: f64, c: &[f64]) -> f64 {
    c.iter().fold(1.0, |a, &k| a * x + k)
}

/// erfc(x) in f64 to ~1e-15 relative, without cancellation in either tail: Cephes' rational
/// approximations (erf = x·T(x²)/U(x²) for |x| < 1, erfc = e^{−x²}·P(x)/Q(x) for |x| < 8,
/// e^{−x²}·R(x)/S(x) beyond). Checked against `tessera_ir::interp::erfc` to 3e-12.
fn erfc_f64(x: f64) -> f64 {
    const T: [f64; 5] = [
        9.604_973_739_870_516e0,
        9.002_601_972_038_427e1,
        2.232_005_345_946_843e3,
        7.003_325_141_128_051e3,
        5.559_230_130_103_949e4,
    ];
    const U: [f64; 5] = [
        3.356_171_416_475_031e1,
        5.213_579_497_801_527e2,
        4.594_323_829_709_801e3,
        2.262_900_006_138_909_4e4,
        4.926_739_426_086_359e4,
    ];
    const P: [f64; 9] = [
        2.461_969_814_735_305e-10,
        5.641_895_648_310_688e-1,
        7.463_210_564_422_699e0,
        4.863_719_709_856_814e1,
        1.965_208_329_560_771e2,
        5.264_451_949_954_773e2,
        9.345_285_271_719_576e2,
        1.027_551_886_895_157_1e3,
        5.575_353_353_693_994e2,
    ];
    const Q: [f64; 8] = [
        1.322_819_511_547_45e1,
        8.670_721_408_859_897e1,
        3.549_377_788_878_199e2,
        9.757_085_017_432_055e2,
        1.823_909_166_879_097_4e3,
        2.246_337_608_187_11e3,
        1.656_663_091_941_613_5e3,
        5.575_353_408_177_277e2,
    ];
    const R: [f64; 6] = [
        5.641_895_835_477_551e-1,
        1.275_366_707_599_781e0,
        5.019_050_422_511_805e0,
        6.160_210_979_930_536e0,
        7.409_742_699_504_489e0,
        2.978_866_653_721_002_4e0,
    ];
    const S: [f64; 6] = [
        2.260_528_632_201_172_7e0,
        9.396_035_249_380_015e0,
        1.204_895_398_080_966_5e1,
        1.708_144_507_475_659e1,
        9.608_968_090_632_859e0,
        3.369_076_451_000_815e0,
    ];
    let a = x.abs();
    if a < 1.0 {
        let z = a * a;
        return 1.0 - x * polevl(z, &T) / p1evl(z, &U);
    }
    let e = exp_f64(-a * a);
    let y = if a < 8.0 {
        e * polevl(a, &P) / p1evl(a, &Q)
    } else if a < 27.0 {
        e * polevl(a, &R) / p1evl(a, &S)
    } else {
        0.0 // below the smallest subnormal (and ±∞ → 0 rather than ∞/∞)
    };
    if x < 0.0 {
        2.0 - y
    } else {
        y
    }
}

/// Φ(x) = erfc(−x/√2)/2.
#[inline]
fn normal_cdf(x: f64) -> f64 {
    0.5 * erfc_f64(-x * std::f64::consts::FRAC_1_SQRT_2)
}

fn gelu(x: f32) -> f32 {
    let x = x as f64;
    (x * normal_cdf(x)) as f32
}

fn gelu_grad(x: f32) -> f32 {
    const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;
    let x = x as f64;
    (normal_cdf(x) + x * INV_SQRT_2PI * exp_f64(-0.5 * x * x)) as f32
}

// ---- kernels ------------------------------------------------------------------------------

pub fn fill(value: f64, meta: &TensorMeta) -> Result<Tensor> {
    let dims = meta.shape.dims();
    let cpu = &Device::Cpu;
    let t = match meta.dtype {
        DType::F32 => Tensor::full(value as f32, dims, cpu)?,
        DType::F64 => Tensor::full(value, dims, cpu)?,
        DType::F16 => Tensor::full(half::f16::from_f64(value), dims, cpu)?,
        DType::BF16 => Tensor::full(half::bf16::from_f64(value), dims, cpu)?,
        DType::I32 | DType::I64 => Tensor::full(value.trunc() as i64, dims, cpu)?,
        DType::Bool => Tensor::full(u8::from(value != 0.0), dims, cpu)?,
        DType::U8 => Tensor::full(value.trunc().clamp(0.0, 255.0) as u8, dims, cpu)?,
    };
    debug_assert_eq!(t.dtype(), candle_dtype(meta.dtype));
    Ok(t)
}

/// `f(x)` elementwise; f32, or bf16 computed in f32 and rounded once (the upcast path's bits).
pub fn unary(u: UnaryOp, x: &Tensor) -> Result<Tensor> {
    if x.dtype() == CDType::BF16 {
        return unary_as::<bf16>(u, x);
    }
    expect_f32(x, "unary", "x")?;
    unary_as::<f32>(u, x)
}

fn unary_as<T: Elem>(u: UnaryOp, x: &Tensor) -> Result<Tensor> {
    match u {
        UnaryOp::Neg => map1_as::<T, _>(x, |v| -v),
        UnaryOp::Exp => map1_as::<T, _>(x, exp_f32),
        UnaryOp::Log => map1_as::<T, _>(x, f32::ln),
        UnaryOp::Sqrt => map1_as::<T, _>(x, f32::sqrt),
        UnaryOp::Rsqrt => map1_as::<T, _>(x, |v| 1.0 / v.sqrt()),
        UnaryOp::Tanh => map1_as::<T, _>(x, f32::tanh),
        UnaryOp::Gelu => map1_as::<T, _>(x, gelu),
        UnaryOp::GeluTanh => map1_as::<T, _>(x, gelu_tanh),
        UnaryOp::Silu => map1_as::<T, _>(x, |v| v * sigmoid_parts(v).0),
        UnaryOp::Relu => map1_as::<T, _>(x, |v| if v > 0.0 { v } else { 0.0 }),
        UnaryOp::Sigmoid => map1_as::<T, _>(x, |v| sigmoid_parts(v).0),
        UnaryOp::Sin => map1_as::<T, _>(x, f32::sin),
        UnaryOp::Cos => map1_as::<T, _>(x, f32::cos),
    }
}

/// `dy · f'(x)`; f32, or both bf16 computed in f32 and rounded once.
pub fn unary_backward(u: UnaryOp, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let half = x.dtype() == CDType::BF16 && dy.dtype() == CDType::BF16;
    if !half {
        expect_f32(x, "unary_backward", "x")?;
        expect_f32(dy, "unary_backward", "dy")?;
    }
    if x.dims() != dy.dims() {
        return Err(RuntimeError::Binding(format!(
            "unary_backward: x {:?} and dy {:?} must have one shape",
            x.dims(),
            dy.dims()
        )));
    }
    let dims = x.dims().to_vec();
    if half {
        unary_backward_as::<bf16>(u, x, dy, &dims)
    } else {
        unary_backward_as::<f32>(u, x, dy, &dims)
    }
}

fn unary_backward_as<T: Elem>(u: UnaryOp, x: &Tensor, dy: &Tensor, d: &[usize]) -> Result<Tensor> {
    match u {
        UnaryOp::Neg => map2_as::<T, _>(x, dy, d, |_, g| -g),
        UnaryOp::Exp => map2_as::<T, _>(x, dy, d, |v, g| g * exp_f32(v)),
        UnaryOp::Log => map2_as::<T, _>(x, dy, d, |v, g| g / v),
        UnaryOp::Sqrt => map2_as::<T, _>(x, dy, d, |v, g| g * (0.5 / v.sqrt())),
        UnaryOp::Rsqrt => map2_as::<T, _>(x, dy, d, |v, g| g * (-0.5 / (v * v.sqrt()))),
        // 1 − tanh²(x) = 4e/(1+e)² with e = e^{−2|x|}: no cancellation for large |x|.
        UnaryOp::Tanh => map2_as::<T, _>(x, dy, d, |v, g| g * (4.0 * sigmoid_parts(2.0 * v).1)),
        UnaryOp::Gelu => map2_as::<T, _>(x, dy, d, |v, g| g * gelu_grad(v)),
        UnaryOp::GeluTanh => map2_as::<T, _>(x, dy, d, |v, g| g * gelu_tanh_grad(v)),
        UnaryOp::Silu => map2_as::<T, _>(x, dy, d, |v, g| g * silu_grad(v)),
        UnaryOp::Relu => map2_as::<T, _>(x, dy, d, |v, g| if v > 0.0 { g } else { 0.0 }),
        UnaryOp::Sigmoid => map2_as::<T, _>(x, dy, d, |v, g| g * sigmoid_parts(v).1),
        UnaryOp::Sin => map2_as::<T, _>(x, dy, d, |v, g| g * v.cos()),
        UnaryOp::Cos => map2_as::<T, _>(x, dy, d, |v, g| -g * v.sin()),
    }
}

#[inline(always)]
fn max_nan(p: f32, q: f32) -> f32 {
    if p >= q || p.is_nan() {
        p
    } else {
        q
    }
}

#[inline(always)]
fn min_nan(p: f32, q: f32) -> f32 {
    if p <= q || p.is_nan() {
        p
    } else {
        q
    }
}

/// NumPy-broadcasting binary op. Operands are read in place through their strides: equal
/// shapes and trailing broadcasts (a bias `[N]` against `[.., N]`) become vectorised
/// slice loops, anything else a strided loop.
///
/// Two bf16 operands give a bf16 result computed in f32 and rounded once (the backend's
/// mixed precision, without widening copies of the operands).
pub fn binary(op: BinaryOp, a: &Tensor, b: &Tensor, out: &TensorMeta) -> Result<Tensor> {
    if a.dtype() == CDType::BF16 && b.dtype() == CDType::BF16 {
        return binary_as::<bf16>(op, a, b, out.shape.dims());
    }
    expect_f32(a, "binary", "a")?;
    expect_f32(b, "binary", "b")?;
    binary_as::<f32>(op, a, b, out.shape.dims())
}

fn binary_as<T: Elem>(op: BinaryOp, a: &Tensor, b: &Tensor, dims: &[usize]) -> Result<Tensor> {
    match op {
        BinaryOp::Add => map2_as::<T, _>(a, b, dims, |x, y| x + y),
        BinaryOp::Sub => map2_as::<T, _>(a, b, dims, |x, y| x - y),
        BinaryOp::Mul => map2_as::<T, _>(a, b, dims, |x, y| x * y),
        BinaryOp::Div => map2_as::<T, _>(a, b, dims, |x, y| x / y),
        BinaryOp::Max => map2_as::<T, _>(a, b, dims, max_nan),
        BinaryOp::Min => map2_as::<T, _>(a, b, dims, min_nan),
    }
}

/// Inputs `a, b, dy` → the gradient w.r.t. operand `wrt`, in the broadcast output shape.
/// `Max`/`Min` send the whole gradient to `a` on ties.
pub fn binary_backward(
    op: BinaryOp,
    wrt: u8,
    a: &Tensor,
    b: &Tensor,
    dy: &Tensor,
    out: &TensorMeta,
) -> Result<Tensor> {
    for (t, what) in [(a, "a"), (b, "b"), (dy, "dy")] {
        expect_f32(t, "binary_backward", what)?;
    }
    let dims = out.shape.dims();
    if dy.dims() != dims {
        return Err(RuntimeError::Binding(format!(
            "binary_backward: dy {:?} must have the broadcast shape {dims:?}",
            dy.dims()
        )));
    }
    use BinaryOp::*;
    match (op, wrt) {
        (Add, 0 | 1) | (Sub, 0) => map3(a, b, dy, dims, |_, _, g| g),
        (Sub, 1) => map3(a, b, dy, dims, |_, _, g| -g),
        (Mul, 0) => map3(a, b, dy, dims, |_, q, g| g * q),
        (Mul, 1) => map3(a, b, dy, dims, |p, _, g| g * p),
        (Div, 0) => map3(a, b, dy, dims, |_, q, g| g / q),
        (Div, 1) => map3(a, b, dy, dims, |p, q, g| -g * p / (q * q)),
        (Max, 0) => map3(a, b, dy, dims, |p, q, g| if p >= q { g } else { 0.0 }),
        (Max, 1) => map3(a, b, dy, dims, |p, q, g| if p >= q { 0.0 } else { g }),
        (Min, 0) => map3(a, b, dy, dims, |p, q, g| if p <= q { g } else { 0.0 }),
        (Min, 1) => map3(a, b, dy, dims, |p, q, g| if p <= q { 0.0 } else { g }),
        (_, w) => {
            Err(RuntimeError::Binding(format!("binary_backward: wrt must be 0 or 1, got {w}")))
        }
    }
}

/// Dtype conversion ([`super::convert`] for bf16 ↔ f32, else candle; floats round to nearest, float → int truncates toward zero),
/// except to bool, which is `x != 0` (candle's `as u8` would truncate 0.5 to 0). Always a
/// fresh contiguous tensor, even when the dtype does not change.
pub fn cast(x: &Tensor, to: DType) -> Result<Tensor> {
    let target = candle_dtype(to);
    Ok(if to == DType::Bool {
        x.ne(0f64)? // a fresh contiguous u8 tensor
    } else if x.dtype() == target {
        x.force_contiguous()?
    } else {
        super::convert::to_dtype(x, target)?
    })
}

/// [`dropout_keep`] with its per-call work hoisted: the (seed, stream) part of the hash
/// precomputed and `u ≥ p` decided on the integer `u·2⁵³` against `⌈p·2⁵³⌉` (exact: `u` is
/// a multiple of 2⁻⁵³). Bit-identical to `dropout_keep` (the tests compare whole masks).
struct DropoutMask {
    base: u64,
    threshold: u64,
}

impl DropoutMask {
    fn new(seed: u64, stream: u64, p: f64) -> DropoutMask {
        let base = seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        DropoutMask { base, threshold: (p * (1u64 << 53) as f64).ceil() as u64 }
    }

    #[inline(always)]
    fn keep(&self, index: u64) -> bool {
        let mut z = self.base.wrapping_add(index);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) >= self.threshold
    }
}

/// Zeroes element `k` unless `dropout_keep(seed, stream, g(k), p)`, and scales the kept ones
/// by 1/(1 − p). `g(k)` is the flat row-major index `k` itself, or, for a shard
/// (`index_map` = [`tessera_ir::dist::ShardOf::index_map`] at this device), the element's index
/// in the single-device tensor, so every plan draws the single-device mask. f32, or bf16
/// computed in f32 and rounded once (the upcast path's bits).
pub fn dropout(
    x: &Tensor,
    seed: &Tensor,
    p: f64,
    stream: u64,
    index_map: Option<(u64, Vec<u64>)>,
) -> Result<Tensor> {
    let half = x.dtype() == CDType::BF16;
    if !half {
        expect_f32(x, "dropout", "x")?;
    }
    expect_i64(seed, "dropout", "seed")?;
    if seed.elem_count() != 1 {
        return Err(RuntimeError::Binding(format!(
            "dropout: the seed must be an i64 scalar, got shape {:?}",
            seed.dims()
        )));
    }
    if !(0.0..1.0).contains(&p) {
        return Err(RuntimeError::Binding(format!("dropout: probability {p} must be in [0, 1)")));
    }
    let seed = seed.flatten_all()?.to_vec1::<i64>()?[0] as u64;
    let mask = DropoutMask::new(seed, stream, p);
    debug_assert!((0..64).all(|k| mask.keep(k) == dropout_keep(seed, stream, k, p)));
    let local = tessera_ir::dist::row_major_strides(x.dims());
    // A map that is the identity (one device, or a shard that is the whole tensor) is the
    // flat index itself.
    let index_map = index_map.filter(|(base, strides)| *base != 0 || *strides != local);
    let d = Dropout { p, scale: (1.0 / (1.0 - p)) as f32, mask, local, index_map };
    if half {
        d.run::<bf16>(x)
    } else {
        d.run::<f32>(x)
    }
}

/// One dropout: the mask, the scale of kept elements, and the map to global indices.
struct Dropout {
    p: f64,
    scale: f32,
    mask: DropoutMask,
    /// Row-major strides of the local tensor.
    local: Vec<u64>,
    index_map: Option<(u64, Vec<u64>)>,
}

impl Dropout {
    fn run<T: Elem>(&self, x: &Tensor) -> Result<Tensor> {
        if self.p == 0.0 {
            return map1_as::<T, _>(x, |v| v);
        }
        let dims = x.dims().to_vec();
        // Elements of a local row: along one, the global index grows by the map's last stride.
        let row = dims.last().copied().unwrap_or(1).max(1);
        let vx = View::new(x)?;
        let sx = vx.strides_for(&dims)?;
        let dx = vx.data::<T>()?;
        let (mask, scale) = (&self.mask, self.scale);
        let fill = |out: &mut [MaybeUninit<T>]| {
            walk(out, &dims, [&sx], [vx.offset()], |o, flat, [i], [s]| {
                let Some((base, strides)) = &self.index_map else {
                    wide! {
                        for (k, o) in o.iter_mut().enumerate() {
                            let v = if mask.keep((flat + k) as u64) { dx[i + k * s].get() } else { 0.0 };
                            o.write(T::put(v * scale));
                        }
                    }
                    return;
                };
                let step = strides.last().copied().unwrap_or(1);
                let mut k0 = 0;
                while k0 < o.len() {
                    let f = flat + k0;
                    let len = (row - f % row).min(o.len() - k0);
                    let g0 = tessera_ir::dist::global_index(f as u64, &self.local, *base, strides);
                    wide! {
                        for (j, o) in o[k0..k0 + len].iter_mut().enumerate() {
                            let keep = mask.keep(g0 + j as u64 * step);
                            let v = if keep { dx[i + (k0 + j) * s].get() } else { 0.0 };
                            o.write(T::put(v * scale));
                        }
                    }
                    k0 += len;
                }
            })
        };
        // SAFETY: `walk` visits every output element once.
        let out = unsafe { fresh(numel(&dims), fill) };
        from_vec(out, &dims)
    }
}
