//! Weight-only quantised matmul ([`tessera_ir::QuantSpec`]): `x · dequant(w)ᵀ`, the weight
//! dequantised inside the kernel, never as a whole.

use crate::tensor::{contiguous, from_vec, read};
use crate::{Result, RuntimeError};
use candle_core::{DType, Tensor};
use rayon::prelude::*;
use tessera_ir::QuantSpec;

fn bad(reason: String) -> RuntimeError {
    RuntimeError::Binding(format!("qmatmul: {reason}"))
}

/// `x [.., K] f32 · dequant(w [N, K·bits/8] u8, scales [N, K/group] f32)ᵀ` → `[.., N] f32`.
pub fn qmatmul(x: &Tensor, w: &Tensor, scales: &Tensor, q: QuantSpec) -> Result<Tensor> {
    if x.dtype() != DType::F32 || w.dtype() != DType::U8 || scales.dtype() != DType::F32 {
        return Err(bad(format!(
            "x {:?}, weight {:?}, scales {:?}: expected f32, u8, f32",
            x.dtype(),
            w.dtype(),
            scales.dtype()
        )));
    }
    let k = *x.dims().last().ok_or_else(|| bad("x has no features".into()))?;
    let &[n, rb] = w.dims() else { return Err(bad(format!("weight {:?} is not 2-d", w.dims()))) };
    let groups = k / q.group.max(1);
    if rb != q.row_bytes(k) || scales.dims() != [n, groups] || k % q.group.max(1) != 0 {
        return Err(bad(format!(
            "weight {:?} / scales {:?} do not fit {k} features ({} bits, groups of {})",
            w.dims(),
            scales.dims(),
            q.bits,
            q.group
        )));
    }
    let (x, w, scales) = (contiguous(x)?, contiguous(w)?, contiguous(scales)?);
    let (xs, ws, ss) = (read::<f32>(&x)?, read::<u8>(&w)?, read::<f32>(&scales)?);
    let m = if k == 0 { 0 } else { xs.len() / k };
    let mut out = vec![0f32; m * n];
    // Output feature j of every row, from weight row j alone.
    let mut cols = vec![0f32; n * m];
    cols.par_chunks_mut(m.max(1)).enumerate().for_each(|(j, col)| {
        let wrow = &ws[j * rb..(j + 1) * rb];
        let srow = &ss[j * groups..(j + 1) * groups];
        for (i, c) in col.iter_mut().enumerate() {
            *c = dot_row(&xs[i * k..(i + 1) * k], wrow, srow, q);
        }
    });
    for j in 0..n {
        for i in 0..m {
            out[i * n + j] = cols[j * m + i];
        }
    }
    drop((xs, ws, ss));
    let mut dims = x.dims().to_vec();
    if let Some(l) = dims.last_mut() {
        *l = n;
    }
    from_vec(out, &dims)
}

/// `Σ_f x[f] · scale[f / group] · (q[f] − offset)` over one weight row.
fn dot_row(x: &[f32], w: &[u8], scales: &[f32], q: QuantSpec) -> f32 {
    let g = q.group;
    let off = q.offset() as f32;
    let mut acc = 0f32;
    for (gi, &s) in scales.iter().enumerate() {
        let xg = &x[gi * g..(gi + 1) * g];
        let mut sum = 0f32;
        if q.bits == 8 {
            for (xv, &b) in xg.iter().zip(&w[gi * g..(gi + 1) * g]) {
                sum += xv * (b as f32 - off);
            }
        } else {
            for (pair, &b) in xg.chunks_exact(2).zip(&w[gi * g / 2..(gi + 1) * g / 2]) {
                sum += pair[0] * ((b & 15) as f32 - off) + pair[1] * ((b >> 4) as f32 - off);
            }
        }
        acc += s * sum;
    }
    acc
}
