//! Activation formulas as the IR's unary ops: tanh GELU, exact (erf) GELU and SiLU. `Erf`
//! is imported only inside GELU.

use super::{apply, close, private_producer, split_static, times_const, unary_of};
use crate::error::Result;
use crate::import::{Importer, Value};
use onnx_protobuf::NodeProto;

pub(super) fn activation(im: &mut Importer, root: &NodeProto) -> Result<Option<Value>> {
    if root.input.len() != 2 {
        return Ok(None);
    }
    let (a, b) = (root.input[0].clone(), root.input[1].clone());
    // SiLU: x · sigmoid(x).
    for (x, s) in [(&a, &b), (&b, &a)] {
        if unary_of(im, s, "Sigmoid").as_deref() == Some(x.as_str()) && !im.is_static(x) {
            let v = im.value(x)?;
            return apply(im, root, &v, tessera_ir::UnaryOp::Silu).map(Some);
        }
    }
    // GELU (tanh): (0.5 · x) · (tanh(c · (x + 0.044715 · x³)) + 1).
    for (h, t) in [(&a, &b), (&b, &a)] {
        let Some((x, half)) = times_const(im, h, "Mul")? else { continue };
        let Some((tanh_out, one)) = times_const(im, t, "Add")? else { continue };
        if !close(half, 0.5) || !close(one, 1.0) {
            continue;
        }
        let Some(u) = unary_of(im, &tanh_out, "Tanh") else { continue };
        let Some((v, c)) = times_const(im, &u, "Mul")? else { continue };
        if !close(c, (2.0 / std::f64::consts::PI).sqrt()) {
            continue;
        }
        let Some(add) =
            private_producer(im, &v).filter(|n| n.op_type == "Add" && n.input.len() == 2)
        else {
            continue;
        };
        let cube_term = if add.input[0] == x {
            add.input[1].clone()
        } else if add.input[1] == x {
            add.input[0].clone()
        } else {
            continue;
        };
        let Some((p, k)) = times_const(im, &cube_term, "Mul")? else { continue };
        if !close(k, 0.044715) {
            continue;
        }
        let Some(pow) = private_producer(im, &p).filter(|n| n.op_type == "Pow" && n.input[0] == x)
        else {
            continue;
        };
        if im.const_input(&pow.input[1])?.and_then(|e| e.scalar()) != Some(3.0) {
            continue;
        }
        let v = im.value(&x)?;
        return apply(im, root, &v, tessera_ir::UnaryOp::GeluTanh).map(Some);
    }
    // GELU (erf), as `nn.GELU()` exports: (x · (erf(x / √2) + 1)) · 0.5, or (0.5 · x) · (..).
    if let Some((m, half)) = split_static(im, root) {
        let half = im.const_input(&half)?.and_then(|c| c.scalar());
        if half.is_some_and(|h| close(h, 0.5)) {
            if let Some(inner) =
                private_producer(im, &m).filter(|n| n.op_type == "Mul" && n.input.len() == 2)
            {
                for (x, e) in
                    [(&inner.input[0], &inner.input[1]), (&inner.input[1], &inner.input[0])]
                {
                    if erf_term(im, e, x)? {
                        let v = im.value(x)?;
                        return apply(im, root, &v, tessera_ir::UnaryOp::Gelu).map(Some);
                    }
                }
            }
        }
    }
    for (h, e) in [(&a, &b), (&b, &a)] {
        let Some((x, half)) = times_const(im, h, "Mul")? else { continue };
        if close(half, 0.5) && erf_term(im, e, &x)? {
            let v = im.value(&x)?;
            return apply(im, root, &v, tessera_ir::UnaryOp::Gelu).map(Some);
        }
    }
    Ok(None)
}

/// Whether `name` is `erf(x / √2) + 1` (or `erf(x · 1/√2) + 1`).
fn erf_term(im: &mut Importer, name: &str, x: &str) -> Result<bool> {
    let Some((e, one)) = times_const(im, name, "Add")? else { return Ok(false) };
    let Some(d) = unary_of(im, &e, "Erf") else { return Ok(false) };
    let r2 = std::f64::consts::SQRT_2;
    if let Some((x2, c)) = times_const(im, &d, "Div")? {
        return Ok(close(one, 1.0) && x2 == x && close(c, r2));
    }
    if let Some((x2, c)) = times_const(im, &d, "Mul")? {
        return Ok(close(one, 1.0) && x2 == x && close(c, 1.0 / r2));
    }
    Ok(false)
}
