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
        || (q.bits == 4 && q.group % 2 != 0)
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
                for (f, &x) in part.iter().enumerate() {
                    let c = ((x / s).round().clamp(-qmax - 1.0, qmax) as i32 + off) as u8;
                    let at = g * q.group + f;
                    if q.bits == 8 {
                        crow[at] = c;
                    } else if at % 2 == 0 {
                        crow[at / 2] = c;
                    } else {
                        crow[at / 2] |= c << 4;
                    }
                }
            }
        },
    );
    drop(ws);
    Ok((from_vec(codes, &[n, rb])?, from_vec(scales, &[n, groups])?))
}
