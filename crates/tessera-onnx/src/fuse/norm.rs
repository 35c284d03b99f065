//! Normalisations written out as formulas, as the IR's fused ops:
//! - RMSNorm (LLaMA): `w · (x · 1/sqrt(mean(x², -1) + eps))`, through `Cast`s, → `RmsNorm`;
//! - GroupNorm as opset 17 writes `nn.GroupNorm`: `Reshape(InstanceNormalization(Reshape(x,
//!   [N, G, -1]), ones, zeros), x.shape) · w + b` (w, b `[C]` unsqueezed to `[C, 1, 1]`) →
//!   `GroupNorm` with the real weights, saving one input instead of four intermediates.

use super::{private_producer, times_const};
use crate::error::Result;
use crate::import::{Importer, Value};
use onnx_protobuf::NodeProto;

/// `name` through private `Cast` nodes.
fn skip_casts(im: &Importer, name: &str) -> String {
    let mut n = name.to_string();
    while let Some(p) = private_producer(im, &n).filter(|p| p.op_type == "Cast") {
        n = p.input[0].clone();
    }
    n
}

/// The weight initialiser behind `name`, through private `Unsqueeze`/`Reshape` nodes.
fn weight_behind(im: &Importer, name: &str) -> Option<String> {
    let mut n = name.to_string();
    loop {
        if im.m.is_weight(&n) {
            return Some(n);
        }
        let p = private_producer(im, &n)
            .filter(|p| matches!(p.op_type.as_str(), "Unsqueeze" | "Reshape"))?;
        n = p.input[0].clone();
    }
}

/// `eps` if `inv` is `1 / sqrt(mean(x², -1, keepdim) + eps)` of `x`.
fn inv_rms(im: &mut Importer, inv: &str, x: &str) -> Result<Option<f64>> {
    let Some(n) = private_producer(im, inv) else { return Ok(None) };
    let sqrt_out = match n.op_type.as_str() {
        "Reciprocal" => n.input[0].clone(),
        "Div" if im.is_static(&n.input[0]) => {
            if im.const_input(&n.input[0])?.and_then(|c| c.scalar()) != Some(1.0) {
                return Ok(None);
            }
            n.input[1].clone()
        }
        _ => return Ok(None),
    };
    let Some(sqrt) = private_producer(im, &sqrt_out).filter(|n| n.op_type == "Sqrt") else {
        return Ok(None);
    };
    let Some((mean, eps)) = times_const(im, &sqrt.input[0], "Add")? else { return Ok(None) };
    let Some(rm) = private_producer(im, &mean).filter(|n| n.op_type == "ReduceMean") else {
        return Ok(None);
    };
    let axes_in = match rm.input.get(1) {
        Some(a) if !a.is_empty() => im.const_input(a)?,
        _ => None,
    };
    let axes = crate::consts::axes_of(rm, axes_in.as_deref()).ok().flatten();
    let x_value = im.value(x)?;
    let rank = im.shape_of(&x_value)?.len() as i64;
    let last = axes.as_deref().is_some_and(|a| a == [-1] || a == [rank - 1]);
    if !last || crate::attrs::int(rm, "keepdims", 1) == 0 {
        return Ok(None);
    }
    let Some(sq) = private_producer(im, &rm.input[0]) else { return Ok(None) };
    let squares_x = match sq.op_type.as_str() {
        "Pow" => {
            sq.input[0] == x && im.const_input(&sq.input[1])?.and_then(|c| c.scalar()) == Some(2.0)
        }
        "Mul" => sq.input[0] == x && sq.input[1] == x,
        _ => false,
    };
    Ok(squares_x.then_some(eps))
}

pub(super) fn rms_norm(im: &mut Importer, root: &NodeProto) -> Result<Option<Value>> {
    if root.input.len() != 2 {
        return Ok(None);
    }
    for (w, n) in [(&root.input[0], &root.input[1]), (&root.input[1], &root.input[0])] {
        if !im.m.is_weight(w) {
            continue;
        }
        let n = skip_casts(im, n);
        let Some(m) = private_producer(im, &n).filter(|m| m.op_type == "Mul" && m.input.len() == 2)
        else {
            continue;
        };
        for (x, inv) in [(&m.input[0], &m.input[1]), (&m.input[1], &m.input[0])] {
            let Some(eps) = inv_rms(im, inv, x)? else { continue };
            let xv = im.value(x)?;
            let d = *im.shape_of(&xv)?.last().unwrap_or(&0);
            let wt = im.parameter(w)?;
            if im.b.shape(wt).dims() != [d] {
                continue;
            }
            let xt = im.tensor(&xv, &root.name, "RMSNorm")?;
            let y = im.b.rms_norm(xt, wt, eps).map_err(|e| im.err_ir(root, e))?;
            return Ok(Some(Value::Tensor { id: y, perm: None }));
        }
    }
    Ok(None)
}

pub(super) fn group_norm(im: &mut Importer, root: &NodeProto) -> Result<Option<Value>> {
    if root.input.len() != 2 {
        return Ok(None);
    }
    for (scaled, shift) in [(&root.input[0], &root.input[1]), (&root.input[1], &root.input[0])] {
        let Some(b) = weight_behind(im, shift) else { continue };
        let Some(mul) =
            private_producer(im, scaled).filter(|m| m.op_type == "Mul" && m.input.len() == 2)
        else {
            continue;
        };
        for (normed, scale) in [(&mul.input[0], &mul.input[1]), (&mul.input[1], &mul.input[0])] {
            let Some(w) = weight_behind(im, scale) else { continue };
            let Some(back) = private_producer(im, normed).filter(|n| n.op_type == "Reshape") else {
                continue;
            };
            let Some(inorm) = private_producer(im, &back.input[0])
                .filter(|n| n.op_type == "InstanceNormalization")
            else {
                continue;
            };
            let Some(there) =
                private_producer(im, &inorm.input[0]).filter(|n| n.op_type == "Reshape")
            else {
                continue;
            };
            // Unit scale and zero bias inside: the affine is the outer w, b.
            let (Some(s), Some(z)) =
                (im.const_input(&inorm.input[1])?, im.const_input(&inorm.input[2])?)
            else {
                continue;
            };
            let groups = s.numel();
            if (0..groups).any(|i| s.f(i) != 1.0)
                || z.numel() != groups
                || (0..groups).any(|i| z.f(i) != 0.0)
            {
                continue;
            }
            let x_name = there.input[0].clone();
            let x = im.value(&x_name)?;
            let shape = im.shape_of(&x)?;
            let (Some(t1), Some(t2)) =
                (im.const_input(&there.input[1])?, im.const_input(&back.input[1])?)
            else {
                continue;
            };
            let (Ok(mid), Ok(out)) = (
                crate::consts::reshape_target(&shape, &t1.to_i64(), 0),
                crate::consts::reshape_target(&[shape.iter().product()], &t2.to_i64(), 0),
            ) else {
                continue;
            };
            let c = shape.get(1).copied().unwrap_or(0);
            if shape.len() < 3
                || mid.len() != 3
                || mid[..2] != [shape[0], groups]
                || out != shape
                || c % groups != 0
            {
                continue;
            }
            let eps = crate::attrs::float(inorm, "epsilon", 1e-5);
            let (wt, bt) = (im.parameter(&w)?, im.parameter(&b)?);
            if im.b.shape(wt).numel() != c as u64 || im.b.shape(bt).numel() != c as u64 {
                continue;
            }
            let err = |im: &Importer, e| im.err_ir(root, e);
            let wt = im.b.reshape(wt, [c]).map_err(|e| err(im, e))?;
            let bt = im.b.reshape(bt, [c]).map_err(|e| err(im, e))?;
            let xt = im.tensor(&x, &root.name, "GroupNorm")?;
            let y = im.b.group_norm(xt, wt, bt, groups, eps).map_err(|e| err(im, e))?;
            return Ok(Some(Value::Tensor { id: y, perm: None }));
        }
    }
    Ok(None)
}
