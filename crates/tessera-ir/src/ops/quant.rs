//! Weight-only quantised matmul ([`super::QuantSpec`]).

use super::{expect_float, expect_inputs, Flops};
use crate::{DType, Shape, TensorMeta};
use serde::{Deserialize, Serialize};

/// `[x [.., K], weight [N, K·bits/8] u8, scales [N, K/group] f32]` → `[.., N]`.
pub(crate) fn infer(x: &[&TensorMeta], q: QuantSpec) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 3)?;
    expect_float(x[0], "x")?;
    if !matches!(q.bits, 4 | 8) || q.group == 0 {
        return Err(format!(
            "quantisation of {} bits in groups of {}: give 8 or 4 bits",
            q.bits, q.group
        ));
    }
    let xd = x[0].shape.dims();
    let Some(&k) = xd.last() else { return Err(format!("x {} has no features", x[0])) };
    let (w, s) = (x[1].shape.dims(), x[2].shape.dims());
    if x[1].dtype != DType::U8 || x[2].dtype != DType::F32 {
        return Err(format!("weight {} must be u8 and scales {} f32", x[1], x[2]));
    }
    if !k.is_multiple_of(q.group) || !(k * q.bits as usize).is_multiple_of(8) {
        return Err(format!("{k} input features do not split into groups of {}", q.group));
    }
    if w.len() != 2 || s.len() != 2 || w[1] != q.row_bytes(k) || s[0] != w[0] || s[1] != k / q.group
    {
        return Err(format!(
            "weight {} and scales {} must be [N, {}] and [N, {}] for {k} input features",
            x[1],
            x[2],
            q.row_bytes(k),
            k / q.group
        ));
    }
    let mut out = xd.to_vec();
    *out.last_mut().unwrap_or(&mut 0) = w[0];
    Ok(vec![TensorMeta { shape: Shape::from(out), dtype: x[0].dtype }])
}

/// 2·M·N·K as a dense matmul, plus the dequantisation (one multiply per weight element).
pub(crate) fn flops(x: &[&TensorMeta], y: &[&TensorMeta]) -> Flops {
    let k = x[0].shape.dims().last().copied().unwrap_or(0) as u64;
    let n = x[1].shape.dim(0) as u64;
    Flops { matmul: 2 * y[0].numel() * k, other: n * k }
}

/// `[dy [.., N], weight [N, K·bits/8] u8, scales [N, K/group] f32]` → `dx [.., K]` in dy's
/// dtype: `dy · dequant(weight)`, the input gradient of [`Op::QMatMul`](super::Op::QMatMul).
pub(crate) fn infer_backward(x: &[&TensorMeta], q: QuantSpec) -> Result<Vec<TensorMeta>, String> {
    expect_inputs(x, 3)?;
    expect_float(x[0], "dy")?;
    if !matches!(q.bits, 4 | 8) || q.group == 0 {
        return Err(format!(
            "quantisation of {} bits in groups of {}: give 8 or 4 bits",
            q.bits, q.group
        ));
    }
    let (w, s) = (x[1].shape.dims(), x[2].shape.dims());
    if x[1].dtype != DType::U8 || x[2].dtype != DType::F32 || w.len() != 2 || s.len() != 2 {
        return Err(format!("weight {} must be u8 [N, ·] and scales {} f32 [N, ·]", x[1], x[2]));
    }
    let k = w[1] * 8 / q.bits as usize;
    let dy = x[0].shape.dims();
    if dy.last() != Some(&w[0]) || s[0] != w[0] || !k.is_multiple_of(q.group) || s[1] != k / q.group
    {
        return Err(format!(
            "dy {} must end in the weight's {} output features, scales {} be [{}, {}]",
            x[0],
            w[0],
            x[2],
            w[0],
            k / q.group.max(1)
        ));
    }
    let mut out = dy.to_vec();
    *out.last_mut().unwrap_or(&mut 0) = k;
    Ok(vec![TensorMeta { shape: Shape::from(out), dtype: x[0].dtype }])
}

/// 2·M·N·K as a dense matmul, plus the dequantisation.
pub(crate) fn flops_backward(x: &[&TensorMeta], y: &[&TensorMeta]) -> Flops {
    let n = x[1].shape.dim(0) as u64;
    let k = y[0].shape.dims().last().copied().unwrap_or(0) as u64;
    Flops { matmul: 2 * x[0].numel() * k, other: n * k }
}

/// One tile of dequantised weight rows (f32), as the forward kernel.
pub(crate) fn workspace_bytes_backward(x: &[&TensorMeta], q: QuantSpec) -> u64 {
    let n = x[1].shape.dim(0) as u64;
    let k = (x[1].shape.dim(1) * 8 / q.bits.max(1) as usize) as u64;
    n.min(QMATMUL_TILE_ROWS) * k * 4
}

/// The VJP of `y = x · dequant(w)ᵀ`: `dx = dy · dequant(w)` ([`Op::QMatMulBackward`]); the
/// weight and its scales take no gradient (a quantised weight is frozen).
pub(crate) fn vjp(
    cx: &mut crate::autodiff::VjpCtx<'_>,
    q: QuantSpec,
) -> crate::Result<Vec<Option<crate::autodiff::Grad>>> {
    let mut grads = vec![None, None, None];
    if cx.needs[0] {
        let dy = cx.dy(0)?;
        let (w, s) = (cx.x(1), cx.x(2));
        let dx = cx.b.push1(super::Op::QMatMulBackward(q), &[dy, w, s])?;
        grads[0] = Some(crate::autodiff::Grad::Full(dx));
    }
    Ok(grads)
}

/// One tile of dequantised weight rows (f32) per worker: at most 64 rows of K.
pub(crate) fn workspace_bytes(x: &[&TensorMeta], _q: QuantSpec) -> u64 {
    let k = x[0].shape.dims().last().copied().unwrap_or(0) as u64;
    let n = x[1].shape.dim(0) as u64;
    n.min(QMATMUL_TILE_ROWS) * k * 4
}

/// Weight rows a worker dequantises at once (the runtime's tile).
pub const QMATMUL_TILE_ROWS: u64 = 64;

/// Weight-only quantisation of a matmul weight ([`Op::QMatMul`]): symmetric, round to
/// nearest. The weight `[N, K]` (output features × input features) is stored as `u8`
/// `[N, K·bits/8]` with one f32 scale per `group` consecutive input features of each output
/// feature (`[N, K/group]`): int8 keeps `q + 128` per byte (one group per row: per output
/// channel), int4 two nibbles `q + 8` per byte, the even feature in the low nibble. The
/// weight is `scale · q`, `q = round(w / scale)` with `scale = max|w| / 127` (int8) or
/// `/ 7` (int4, `q` clamped to −8..7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct QuantSpec {
    /// 8 or 4.
    pub bits: u8,
    /// Input features per scale.
    pub group: usize,
}

impl QuantSpec {
    /// The largest |q|.
    pub fn qmax(self) -> f64 {
        if self.bits == 8 {
            127.0
        } else {
            7.0
        }
    }
    /// The zero point added to q in storage.
    pub fn offset(self) -> i32 {
        if self.bits == 8 {
            128
        } else {
            8
        }
    }
    /// Stored bytes per row of `k` input features.
    pub fn row_bytes(self, k: usize) -> usize {
        k * self.bits as usize / 8
    }
}
