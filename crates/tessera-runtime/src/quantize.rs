//! Weight-only quantisation at load time ([`tessera_ir::QuantSpec`]): a float weight `[N, K]`
//! (output features × input features) becomes `u8` codes `[N, K·bits/8]` and f32 scales
//! `[N, K/group]`, symmetric and rounded to nearest — what `Op::QMatMul` dequantises inside
//! its kernel.

use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::{DType, Tensor};
use rayon::prelude::*;
use tessera_ir::QuantSpec;

/// The codes and scales of weight `w [N, K]` (any float dtype).
pub fn quantize(w: &Tensor, q: QuantSpec) -> Result<(Tensor, Tensor)> {
    let &[n, k] = w.dims() else {
        return Err(RuntimeError::Binding(format!("quantize: weight {:?} is not 2-d", w.dims())));
    };
    if !matches!(q.bits, 4 | 8)
        || q.group == 0
        || k % q.group != 0
        || (q.bits == 4 && !q.group.is_multiple_of(2))
    {
        return Err(RuntimeError::Binding(format!(
            "quantize: {} bits in groups of {} do not fit {k} input features",
            q.bits, q.group
        )));
    }
    let w = contiguous(&w.to_dtype(DType::F32)?)?;
    let ws = read::<f32>(&w)?;
    let (rb, groups) = (q.row_bytes(k), k / q.group);
    let mut codes = vec![0u8; n * rb];
    let mut scales = vec![0f32; n * groups];
    let qmax = q.qmax() as f32;
    let off = q.offset();
    codes.par_chunks_mut(rb.max(1)).zip(scales.par_chunks_mut(groups.max(1))).enumerate().for_each(
        |(r, (crow, srow))| {
            let row = &ws[r * k..(r + 1) * k];
            for (g, s) in srow.iter_mut().enumerate() {
                let part = &row[g * q.group..(g + 1) * q.group];
                let amax = part.iter().fold(0f32, |m, x| m.max(x.abs()));
                // (At least the least subnormal: amax / qmax of a subnormal group may
                // underflow to 0.)
                *s = if amax > 0.0 { (amax / qmax).max(f32::from_bits(1)) } else { 1.0 };
                // A division, not a product with 1/s: exact round(x / s), and no overflow of
                // 1/s when the group's values are subnormal.
                let s = *s;
                let code =
                    |x: f32| (round_half_away(x / s).clamp(-qmax - 1.0, qmax) as i32 + off) as u8;
                if q.bits == 8 {
                    for (c, &x) in crow[g * q.group..(g + 1) * q.group].iter_mut().zip(part) {
                        *c = code(x);
                    }
                } else {
                    // Two features a byte, the even one in the low nibble (groups are even).
                    let bytes = &mut crow[g * q.group / 2..(g + 1) * q.group / 2];
                    for (c, pair) in bytes.iter_mut().zip(part.chunks_exact(2)) {
                        *c = code(pair[0]) | (code(pair[1]) << 4);
                    }
                }
            }
        },
    );
    drop(ws);
    Ok((from_vec(codes, &[n, rb])?, from_vec(scales, &[n, groups])?))
}

/// `v.round()` (half away from zero) for |v| < 2^23, in plain arithmetic: `f32::round` is a
/// libm call on the baseline x86-64 target, which keeps the quantising loop from vectorising.
#[inline(always)]
fn round_half_away(v: f32) -> f32 {
    let a = v.abs();
    let t = a as i32 as f32; // trunc(a), exact below 2^23
    let r = if a - t >= 0.5 { t + 1.0 } else { t }; // a − t is exact
    r.copysign(v)
}

#[cfg(test)]
mod tests {
    use super::round_half_away;

    #[test]
    fn round_half_away_is_f32_round() {
        // Every quarter and tie in ±200, the neighbours of each tie, and a spread of others.
        let mut vs: Vec<f32> = (-800..=800).map(|i| i as f32 / 4.0).collect();
        for i in -400..=400 {
            let tie = i as f32 + 0.5;
            vs.extend([tie.next_down(), tie.next_up(), -tie.next_down(), -tie.next_up()]);
        }
        vs.extend((0..10_000).map(|i| ((i as f32) * 0.618_034).sin() * 130.0));
        vs.extend([0.0, -0.0, 0.499_999_97, -0.499_999_97, 127.0, -128.0]);
        for v in vs {
            assert_eq!(round_half_away(v).to_bits(), v.round().to_bits(), "{v}");
        }
    }
}
