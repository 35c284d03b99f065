//! Rotary position embeddings: `x · cos + rotate_half(x) · sin` with constant tables as the
//! IR's `Rope`, the frequencies read back from the tables and checked at every position.

use super::{private_producer, split_static, view};
use crate::error::Result;
use crate::import::{Importer, Value};
use crate::tensor::Const;
use onnx_protobuf::NodeProto;

pub(super) fn rope(im: &mut Importer, root: &NodeProto) -> Result<Option<Value>> {
    if root.input.len() != 2 || im.is_static(&root.input[0]) || im.is_static(&root.input[1]) {
        return Ok(None);
    }
    // Add(Mul(x, cos), Mul(rotate_half(x), sin)), in either order.
    let muls: Vec<&NodeProto> = root
        .input
        .iter()
        .filter_map(|x| private_producer(im, x))
        .filter(|n| n.op_type == "Mul")
        .collect();
    if muls.len() != 2 {
        return Ok(None);
    }
    let mut parts = Vec::new();
    for m in &muls {
        let Some((dynamic, fixed)) = split_static(im, m) else { return Ok(None) };
        parts.push((dynamic, fixed));
    }
    // Which product holds rotate_half?
    // (x, the high-half slice node, the low-half slice node), by node index: exporters may
    // leave node names empty.
    let rotated = |im: &Importer, name: &str| -> Option<(String, usize, usize)> {
        let c =
            private_producer(im, name).filter(|n| n.op_type == "Concat" && n.input.len() == 2)?;
        let neg = private_producer(im, &c.input[0]).filter(|n| n.op_type == "Neg")?;
        let hi = im.producer_of(&neg.input[0]).filter(|&i| im.node(i).op_type == "Slice")?;
        let lo = im.producer_of(&c.input[1]).filter(|&i| im.node(i).op_type == "Slice")?;
        let x = &im.node(hi).input[0];
        (*x == im.node(lo).input[0]).then(|| (x.clone(), hi, lo))
    };
    let (x_name, cos_name, sin_name, hi, lo) =
        match (rotated(im, &parts[0].0), rotated(im, &parts[1].0)) {
            (None, Some((x, hi, lo))) if parts[0].0 == x => {
                (x, parts[0].1.clone(), parts[1].1.clone(), hi, lo)
            }
            (Some((x, hi, lo)), None) if parts[1].0 == x => {
                (x, parts[1].1.clone(), parts[0].1.clone(), hi, lo)
            }
            _ => return Ok(None),
        };
    // The two slices must be the halves of the last axis.
    let x = im.value(&x_name)?;
    let shape = im.shape_of(&x)?;
    let (rank, d) = (shape.len(), *shape.last().unwrap_or(&0));
    if rank != 4 || d % 2 != 0 {
        return Ok(None);
    }
    let half_ok = |im: &mut Importer, slice: usize, from: usize, to: usize| -> Result<bool> {
        let n = im.node(slice);
        let mut args = Vec::new();
        for a in n.input.iter().skip(1) {
            if !a.is_empty() && !im.is_static(a) {
                return Ok(false);
            }
            args.push(im.const_input(a)?);
        }
        let refs: Vec<Option<&Const>> = args.iter().map(|c| c.as_deref()).collect();
        let Ok(p) = crate::consts::slice_params(&shape, &refs) else { return Ok(false) };
        let last_ok = p[rank - 1] == (from, 1, to - from);
        let rest_ok = (0..rank - 1).all(|a| p[a] == (0, 1, shape[a]));
        Ok(last_ok && rest_ok)
    };
    if !half_ok(im, hi, d / 2, d)? || !half_ok(im, lo, 0, d / 2)? {
        return Ok(None);
    }
    // Read once per file for these tables at this shape (later imports fold no table), else
    // once per import for the same table constants (every layer's q and k share them).
    let file_key = format!("{cos_name}|{sin_name}|{shape:?}");
    let found = match im.m.cached_rope(&file_key) {
        Some(f) => f,
        None => {
            let (Some(cos), Some(sin)) = (im.const_input(&cos_name)?, im.const_input(&sin_name)?)
            else {
                return Ok(None);
            };
            // The tables: [.., S, D] broadcast over x's batch and head axes; the sequence axis
            // is the table's one other axis longer than 1 (or x's axis 2 when S = 1).
            let key = (
                std::rc::Rc::as_ptr(&cos) as usize,
                std::rc::Rc::as_ptr(&sin) as usize,
                shape.clone(),
            );
            let f = match im.rope_tables.get(&key) {
                Some(f) => f.clone(),
                None => {
                    let f = seq_axis(&cos, &shape)
                        .and_then(|a| inv_freq_of(&cos, &sin, &shape, a).map(|f| (a, f)));
                    im.rope_tables.insert(key, f.clone());
                    f
                }
            };
            im.m.remember_rope(&file_key, f.clone());
            f
        }
    };
    let Some((seq_axis, inv_freq)) = found else { return Ok(None) };
    // The IR's Rope works on [B, S, H, D].
    let to_bshd: Vec<usize> = if seq_axis == 2 { vec![0, 2, 1, 3] } else { vec![0, 1, 2, 3] };
    let xb = view(im, &x, &to_bshd).map_err(|e| im.err_ir(root, e))?;
    let r = im.b.rope(xb, &inv_freq).map_err(|e| im.err_ir(root, e))?;
    Ok(Some(Value::Tensor { id: r, perm: (seq_axis == 2).then(|| vec![0, 2, 1, 3]) }))
}

/// The axis of `x` (rank 4) the rotary table runs along: 1 or 2.
fn seq_axis(table: &Const, x: &[usize]) -> Option<usize> {
    let r = table.shape.len();
    if !(2..=4).contains(&r) {
        return None;
    }
    let full: Vec<usize> =
        std::iter::repeat_n(1, 4 - r).chain(table.shape.iter().copied()).collect();
    if full[3] != x[3] {
        return None;
    }
    let long: Vec<usize> = (0..3).filter(|&a| full[a] > 1).collect();
    match long.as_slice() {
        [a] if (*a == 1 || *a == 2) && full[*a] == x[*a] => Some(*a),
        [] if x[2] == 1 => Some(2),
        _ => None,
    }
}

/// The inverse frequencies the tables were made of (`cos[p, j] = cos(p · f[j mod D/2])`),
/// checked at every position; `None` if the tables are anything else.
fn inv_freq_of(cos: &Const, sin: &Const, x: &[usize], seq_axis: usize) -> Option<Vec<f64>> {
    if cos.shape != sin.shape {
        return None;
    }
    let (s, d) = (x[seq_axis], x[3]);
    let full: Vec<usize> =
        std::iter::repeat_n(1, 4 - cos.shape.len()).chain(cos.shape.iter().copied()).collect();
    let stride_s = if full[seq_axis] > 1 { d } else { 0 };
    // Row p of the table (every other axis is 1, so the data is [S, D] row-major).
    let at = |c: &Const, p: usize, j: usize| c.f(p * stride_s + j);
    if s < 2 {
        return None;
    }
    let freq: Vec<f64> = (0..d / 2).map(|j| at(sin, 1, j).atan2(at(cos, 1, j))).collect();
    let ok = (0..s).all(|p| {
        let tol = 1e-5 + 2e-7 * p as f64;
        (0..d).all(|j| {
            let a = p as f64 * freq[j % (d / 2)];
            (at(cos, p, j) - a.cos()).abs() <= tol && (at(sin, p, j) - a.sin()).abs() <= tol
        })
    });
    ok.then_some(freq)
}
