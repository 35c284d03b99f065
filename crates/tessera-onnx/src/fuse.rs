//! Patterns recognised in the ONNX graph and emitted as the IR's fused operators.
//!
//! - **Attention**: `MatMul(Softmax(mask(scale · MatMul(q, kᵀ))), v)`, where the mask is a
//!   constant — `Where(cond, s, very negative)`, `Add(s, 0 / very negative)`, optionally
//!   clamped by `Max(s, very negative)` — that must be causal or empty, and the chain may hold
//!   `Cast`s and `Reshape`s between `[B·H, S, T]` and `[B, H, S, T]`. Grouped-query attention's
//!   `repeat_kv` (`Unsqueeze → Expand → Reshape` of the keys and values) is looked through, so
//!   the IR's attention reads the `Hkv` heads. The IR has no data constants: without this
//!   fusion a causal mask could not be expressed at all; with it, no `S×T` matrix is stored.
//! - **Rotary embeddings**: `x · cos + rotate_half(x) · sin` with constant tables, where
//!   `rotate_half(x) = Concat(-x[.., D/2:], x[.., :D/2])`; the inverse frequencies are read
//!   back from the tables and checked against every position.
//!
//! - **Activations**: GPT-2's tanh GELU `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` and
//!   SiLU `x · sigmoid(x)` become the IR's `GeluTanh` and `Silu` (one saved input instead of
//!   every intermediate of the formula).
//!
//! A pattern that does not match leaves the nodes to the generic lowering. Matching is done
//! on the ONNX graph and on constants only ([`Importer::is_static`]), so a failed match emits
//! nothing.

use crate::error::Result;
use crate::import::{Importer, Value};
use crate::tensor::{broadcast_index, Const};
use onnx_protobuf::NodeProto;
use std::rc::Rc;
use tessera_ir::AttentionSpec;

/// A score below this is a masked position (HF uses the dtype's minimum or -inf).
const MASKED: f64 = -1.0e30;

/// Tries every fusion rooted at node `i`.
pub(crate) fn try_fuse(im: &mut Importer, i: usize) -> Result<Option<Value>> {
    let node = im.node(i);
    match node.op_type.as_str() {
        "MatMul" => attention(im, node),
        "Add" => rope(im, node),
        "Mul" => activation(im, node),
        _ => Ok(None),
    }
}

/// The single node producing `name`, read by nobody else.
fn private_producer<'m>(im: &Importer<'m>, name: &str) -> Option<&'m NodeProto> {
    let p = im.producer_of(name)?;
    (im.readers(name) == 1).then(|| im.node(p))
}

/// The inputs of a binary node as (dynamic, static), if exactly one is static.
fn split_static(im: &mut Importer, n: &NodeProto) -> Option<(String, String)> {
    if n.input.len() != 2 {
        return None;
    }
    let (a, b) = (n.input[0].clone(), n.input[1].clone());
    match (im.is_static(&a), im.is_static(&b)) {
        (false, true) => Some((a, b)),
        (true, false) => Some((b, a)),
        _ => None,
    }
}

enum Mask {
    /// Added to the scores: 0 where allowed, very negative where not.
    Add(Rc<Const>),
    /// `Where(cond, scores, fill)`: allowed where `cond`.
    Keep(Rc<Const>),
}

fn attention(im: &mut Importer, root: &NodeProto) -> Result<Option<Value>> {
    // MatMul(P, V): P from a Softmax over the last axis, through Casts.
    let (mut p, v_name) = (root.input[0].clone(), root.input[1].clone());
    let softmax = loop {
        let Some(n) = private_producer(im, &p) else { return Ok(None) };
        match n.op_type.as_str() {
            "Cast" => p = n.input[0].clone(),
            "Softmax" => break n,
            _ => return Ok(None),
        }
    };
    if im.is_static(&v_name) {
        return Ok(None);
    }
    let axis = crate::attrs::int(softmax, "axis", -1);
    let mut s = softmax.input[0].clone();
    let (mut scale, mut masks) = (1.0, Vec::new());
    let (q_name, kt_name) = loop {
        let Some(n) = private_producer(im, &s) else { return Ok(None) };
        match n.op_type.as_str() {
            "Cast" | "Reshape" => s = n.input[0].clone(),
            "MatMul" => break (n.input[0].clone(), n.input[1].clone()),
            "Mul" | "Div" | "Add" | "Max" => {
                let Some((dynamic, fixed)) = split_static(im, n) else { return Ok(None) };
                let Some(c) = im.const_input(&fixed)? else { return Ok(None) };
                match n.op_type.as_str() {
                    "Mul" => match c.scalar() {
                        Some(x) => scale *= x,
                        None => return Ok(None),
                    },
                    "Div" if n.input[0] == dynamic => match c.scalar() {
                        Some(x) => scale /= x,
                        None => return Ok(None),
                    },
                    "Add" => masks.push(Mask::Add(c)),
                    "Max" if c.scalar().is_some_and(|x| x <= MASKED) => {}
                    _ => return Ok(None),
                }
                s = dynamic;
            }
            "Where" => {
                let (cond, yes, no) = (&n.input[0], n.input[1].clone(), &n.input[2]);
                if !im.is_static(cond) || !im.is_static(no) || im.is_static(&yes) {
                    return Ok(None);
                }
                let (Some(c), Some(fill)) = (im.const_input(cond)?, im.const_input(no)?) else {
                    return Ok(None);
                };
                if !fill.scalar().is_some_and(|x| x <= MASKED) {
                    return Ok(None);
                }
                masks.push(Mask::Keep(c));
                s = yes;
            }
            _ => return Ok(None),
        }
    };
    let q = im.value(&q_name)?;
    let q_shape = im.shape_of(&q)?;
    let rank = q_shape.len();
    if !(rank == 3 || rank == 4) || !(axis == -1 || axis == rank as i64 - 1) {
        return Ok(None);
    }
    let swap_last: Vec<usize> = (0..rank - 2).chain([rank - 1, rank - 2]).collect();
    // The keys: kᵀ is usually a Transpose of k; grouped-query attention repeats k and v.
    let kt_node = private_producer(im, &kt_name).filter(|n| {
        n.op_type == "Transpose"
            && crate::attrs::ints(n, "perm")
                .is_some_and(|p| p.iter().map(|&x| x as usize).eq(swap_last.iter().copied()))
    });
    let (k, v) = match kt_node.map(|n| n.input[0].clone()) {
        Some(k_name) => match (repeat_kv_source(im, &k_name), repeat_kv_source(im, &v_name)) {
            (Some(k), Some(v)) => (im.value(&k)?, im.value(&v)?),
            _ => (im.value(&k_name)?, im.value(&v_name)?),
        },
        None => {
            let kt = im.value(&kt_name)?;
            let Value::Tensor { id, perm } = kt else { return Ok(None) };
            let composed: Vec<usize> = match perm {
                Some(p) => swap_last.iter().map(|&i| p[i]).collect(),
                None => swap_last.clone(),
            };
            let identity = composed.iter().enumerate().all(|(i, &p)| i == p);
            (Value::Tensor { id, perm: (!identity).then_some(composed) }, im.value(&v_name)?)
        }
    };
    let (k_shape, v_shape) = (im.shape_of(&k)?, im.shape_of(&v)?);
    if k_shape.len() != rank || v_shape != k_shape {
        return Ok(None);
    }
    let (sq, t) = (q_shape[rank - 2], k_shape[rank - 2]);
    let causal = match allowed(&masks, sq, t) {
        Some(Allowed::All) => false,
        Some(Allowed::Causal) => true,
        None => {
            return Err(im.unsupported(
                root,
                "the attention mask is neither causal nor empty (padding masks and position \
                 biases are not supported yet); export without an attention_mask",
            ))
        }
    };
    let spec = AttentionSpec { causal, window: None, scale, alibi: None };
    let node_name = root.name.clone();
    let err = |im: &Importer, e| im.err_ir(root, e);
    let out = if rank == 4 {
        // Logical [B, H, S, D] → the IR's [B, S, H, D].
        let qb = view(im, &q, &[0, 2, 1, 3]).map_err(|e| err(im, e))?;
        let kb = view(im, &k, &[0, 2, 1, 3]).map_err(|e| err(im, e))?;
        let vb = view(im, &v, &[0, 2, 1, 3]).map_err(|e| err(im, e))?;
        let o = im.b.attention(qb, kb, vb, spec).map_err(|e| err(im, e))?;
        Value::Tensor { id: o, perm: Some(vec![0, 2, 1, 3]) }
    } else {
        // [N, S, D] (heads folded into the batch): one head per row of N.
        let mut four = |x: &Value, shape: &[usize]| -> Result<tessera_ir::TensorId> {
            let t = im.tensor(x, &node_name, "MatMul")?;
            im.b.reshape(t, [shape[0], shape[1], 1, shape[2]]).map_err(|e| err(im, e))
        };
        let (qb, kb, vb) = (four(&q, &q_shape)?, four(&k, &k_shape)?, four(&v, &v_shape)?);
        let o = im.b.attention(qb, kb, vb, spec).map_err(|e| err(im, e))?;
        let o = im.b.reshape(o, [q_shape[0], sq, q_shape[2]]).map_err(|e| err(im, e))?;
        Value::Tensor { id: o, perm: None }
    };
    Ok(Some(out))
}

/// `x.permute(r)` of a logical value, as a physical IR tensor (no op when it composes to
/// the identity with the value's pending permutation).
fn view(im: &mut Importer, x: &Value, r: &[usize]) -> tessera_ir::Result<tessera_ir::TensorId> {
    let Value::Tensor { id, perm } = x else {
        return Err(tessera_ir::IrError::Graph("attention on a constant".into()));
    };
    let composed: Vec<usize> = match perm {
        Some(p) => r.iter().map(|&i| p[i]).collect(),
        None => r.to_vec(),
    };
    if composed.iter().enumerate().all(|(i, &p)| i == p) {
        Ok(*id)
    } else {
        im.b.permute(*id, &composed)
    }
}

/// The `[B, Hkv, T, D]` keys behind `repeat_kv`'s `Reshape(Expand(Unsqueeze(k, 2)))` to
/// `[B, Hkv·n, T, D]`, if `name` is that. (Its `Shape` readers do not matter: what they
/// demand is pruned.)
fn repeat_kv_source(im: &mut Importer, name: &str) -> Option<String> {
    let r = im.producer_of(name).map(|i| im.node(i)).filter(|n| n.op_type == "Reshape")?;
    let e = private_producer(im, &r.input[0]).filter(|n| n.op_type == "Expand")?;
    let u = private_producer(im, &e.input[0]).filter(|n| n.op_type == "Unsqueeze")?;
    let axes = if u.input.len() > 1 {
        im.const_input(&u.input[1]).ok()??.to_i64()
    } else {
        crate::attrs::ints(u, "axes")?
    };
    (axes == [2]).then(|| u.input[0].clone())
}

enum Allowed {
    All,
    Causal,
}

/// What the masks leave visible of the `[S, T]` scores, if it is all or causal.
fn allowed(masks: &[Mask], s: usize, t: usize) -> Option<Allowed> {
    let mut keep = vec![true; s * t];
    for m in masks {
        let c = match m {
            Mask::Add(c) | Mask::Keep(c) => c,
        };
        let r = c.shape.len();
        // Broadcast the mask to [.., S, T]; every leading slice must be the same.
        let mut lead = c.shape[..r.saturating_sub(2)].to_vec();
        lead.iter_mut().for_each(|d| *d = (*d).max(1));
        let mut full = lead.clone();
        full.extend([s, t]);
        let shape_ok = c.shape.len() >= 2 || c.numel() == 1;
        if !shape_ok || crate::tensor::broadcast_shape(&c.shape, &full).as_deref() != Some(&full) {
            return None;
        }
        let idx = broadcast_index(&c.shape, &full);
        let n_lead: usize = lead.iter().product();
        for k in 0..s * t {
            let x = c.f(idx[k]);
            let ok = match m {
                Mask::Add(_) if x == 0.0 => true,
                Mask::Add(_) if x <= MASKED => false,
                Mask::Add(_) => return None,
                Mask::Keep(_) => x != 0.0,
            };
            keep[k] &= ok;
        }
        // Every leading slice equal to the first.
        for l in 1..n_lead {
            for k in 0..s * t {
                if c.f(idx[l * s * t + k]) != c.f(idx[k]) {
                    return None;
                }
            }
        }
    }
    if keep.iter().all(|&k| k) {
        return Some(Allowed::All);
    }
    let causal = (0..s * t).all(|k| {
        let (i, j) = (k / t, k % t);
        keep[k] == (j + s <= i + t)
    });
    causal.then_some(Allowed::Causal)
}

fn rope(im: &mut Importer, root: &NodeProto) -> Result<Option<Value>> {
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
    let rotated = |im: &Importer, name: &str| -> Option<(String, String, String)> {
        let c =
            private_producer(im, name).filter(|n| n.op_type == "Concat" && n.input.len() == 2)?;
        let neg = private_producer(im, &c.input[0]).filter(|n| n.op_type == "Neg")?;
        let hi =
            im.producer_of(&neg.input[0]).map(|i| im.node(i)).filter(|n| n.op_type == "Slice")?;
        let lo =
            im.producer_of(&c.input[1]).map(|i| im.node(i)).filter(|n| n.op_type == "Slice")?;
        (hi.input[0] == lo.input[0])
            .then(|| (hi.input[0].clone(), hi.name.clone(), lo.name.clone()))
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
    let half_ok = |im: &mut Importer, slice_name: &str, from: usize, to: usize| -> Result<bool> {
        let Some(i) = im.m.graph.node.iter().position(|n| n.name == slice_name) else {
            return Ok(false);
        };
        let n = im.node(i);
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
    if !half_ok(im, &hi, d / 2, d)? || !half_ok(im, &lo, 0, d / 2)? {
        return Ok(None);
    }
    let (Some(cos), Some(sin)) = (im.const_input(&cos_name)?, im.const_input(&sin_name)?) else {
        return Ok(None);
    };
    // The tables: [.., S, D] broadcast over x's batch and head axes; the sequence axis is the
    // table's one other axis longer than 1 (or x's axis 2 when S = 1).
    let Some(seq_axis) = seq_axis(&cos, &shape) else { return Ok(None) };
    let Some(inv_freq) = inv_freq_of(&cos, &sin, &shape, seq_axis) else { return Ok(None) };
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

/// `name` = `Mul(dynamic, c)` (either order) for a scalar constant `c`: (dynamic, c).
fn times_const(im: &mut Importer, name: &str, op: &str) -> Result<Option<(String, f64)>> {
    let Some(n) = private_producer(im, name).filter(|n| n.op_type == op) else { return Ok(None) };
    let Some((dynamic, fixed)) = split_static(im, n) else { return Ok(None) };
    Ok(im.const_input(&fixed)?.and_then(|c| c.scalar()).map(|c| (dynamic, c)))
}

/// The single dynamic input of `name`'s producer if it is a private `op` node.
fn unary_of(im: &Importer, name: &str, op: &str) -> Option<String> {
    private_producer(im, name).filter(|n| n.op_type == op).map(|n| n.input[0].clone())
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

fn activation(im: &mut Importer, root: &NodeProto) -> Result<Option<Value>> {
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
    Ok(None)
}

/// A unary IR op on `x`, keeping its pending permutation.
fn apply(im: &mut Importer, root: &NodeProto, x: &Value, op: tessera_ir::UnaryOp) -> Result<Value> {
    let (id, perm) = match x {
        Value::Tensor { id, perm } => (*id, perm.clone()),
        other => (im.tensor(other, &root.name, &root.op_type)?, None),
    };
    let y = im.b.unary(op, id).map_err(|e| im.err_ir(root, e))?;
    Ok(Value::Tensor { id: y, perm })
}
