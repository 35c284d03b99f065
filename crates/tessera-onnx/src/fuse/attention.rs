//! Causal (or unmasked) attention: `MatMul(Softmax(mask(scale · MatMul(q, kᵀ))), v)` as the
//! IR's fused `Attention`, the mask checked against its values (module docs of `fuse`).

use super::{private_producer, split_static, view};
use crate::error::Result;
use crate::import::{Importer, Value};
use crate::tensor::Const;
use onnx_protobuf::NodeProto;
use std::rc::Rc;
use tessera_ir::AttentionSpec;

/// A score below this is a masked position (HF uses the dtype's minimum or -inf).
const MASKED: f64 = -1.0e30;

/// A mask in the chain, by the name of its constant (read only when needed).
enum MaskRef {
    Add(String),
    Keep(String),
}

enum Mask {
    /// Added to the scores: 0 where allowed, very negative where not.
    Add(Rc<Const>),
    /// `Where(cond, scores, fill)`: allowed where `cond`.
    Keep(Rc<Const>),
}

pub(super) fn attention(im: &mut Importer, root: &NodeProto) -> Result<Option<Value>> {
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
    let Some((q_name, kt_name, scale, masks)) = score_chain(im, &softmax.input[0])? else {
        return Ok(None);
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
    let Some(verdict) = mask_verdict(im, &root.output[0], &masks, sq, t)? else { return Ok(None) };
    let causal = match verdict.map(|c| if c { Allowed::Causal } else { Allowed::All }) {
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
    let spec = AttentionSpec { causal, scale, ..AttentionSpec::causal(1) };
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
        // The mask's [S, T] plane (either axis may be broadcast); every leading slice (batch,
        // heads) must hold the same plane.
        let r = c.shape.len();
        let (ms, mt) = if r >= 2 { (c.shape[r - 2], c.shape[r - 1]) } else { (1, 1) };
        if r < 2 && c.numel() != 1 || !(ms == s || ms == 1) || !(mt == t || mt == 1) {
            return None;
        }
        if ms * mt == 0 {
            return None;
        }
        // The first [S, T] plane; every other leading index (unless broadcast) must match it.
        let lead = r.saturating_sub(2);
        let plane_of = |idx: &[usize]| -> Vec<f64> {
            let mut p: Vec<(usize, i64, usize)> = idx.iter().map(|&i| (i, 1, 1)).collect();
            p.extend([(0, 1, ms), (0, 1, mt)]);
            c.sliced(&p).to_f64()
        };
        let first = if r < 2 { vec![c.f(0)] } else { plane_of(&vec![0; lead]) };
        let varying: Vec<usize> =
            (0..lead).filter(|&d| !c.is_broadcast(d) && c.shape[d] > 1).collect();
        let n_var: usize = varying.iter().map(|&d| c.shape[d]).product();
        for k in 1..n_var {
            let mut idx = vec![0; lead];
            let mut rest = k;
            for &d in varying.iter().rev() {
                idx[d] = rest % c.shape[d];
                rest /= c.shape[d];
            }
            if plane_of(&idx) != first {
                return None;
            }
        }
        for i in 0..s {
            let row = if ms > 1 { i * mt } else { 0 };
            for j in 0..t {
                let x = first[row + if mt > 1 { j } else { 0 }];
                let ok = match m {
                    Mask::Add(_) if x == 0.0 => true,
                    Mask::Add(_) if x <= MASKED => false,
                    Mask::Add(_) => return None,
                    Mask::Keep(_) => x != 0.0,
                };
                keep[i * t + j] &= ok;
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

/// The scores' chain back from a softmax: `MatMul(q, kᵀ)` under scalar scales, masks, clamps,
/// casts and reshapes. `None` if it is anything else.
#[allow(clippy::type_complexity)]
fn score_chain(
    im: &mut Importer,
    from: &str,
) -> Result<Option<(String, String, f64, Vec<MaskRef>)>> {
    let mut s = from.to_string();
    let (mut scale, mut masks) = (1.0, Vec::new());
    let (q_name, kt_name) = loop {
        let Some(n) = private_producer(im, &s) else { return Ok(None) };
        match n.op_type.as_str() {
            "Cast" | "Reshape" => s = n.input[0].clone(),
            "MatMul" => break (n.input[0].clone(), n.input[1].clone()),
            "Add" => {
                // A mask's values are read only if this attention's verdict is not known.
                let Some((dynamic, fixed)) = split_static(im, n) else { return Ok(None) };
                masks.push(MaskRef::Add(fixed));
                s = dynamic;
            }
            "Mul" | "Div" | "Max" => {
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
                let Some(fill) = im.const_input(no)? else { return Ok(None) };
                if !fill.scalar().is_some_and(|x| x <= MASKED) {
                    return Ok(None);
                }
                masks.push(MaskRef::Keep(cond.clone()));
                s = yes;
            }
            _ => return Ok(None),
        }
    };
    Ok(Some((q_name, kt_name, scale, masks)))
}

/// Whether the masks leave causal (`Some(true)`) or all (`Some(false)`) scores visible; the
/// outer `None` when a mask is not a constant (no fusion), the inner when neither. `root` is
/// the attention's output value: unique in a graph, where node names may be empty.
fn mask_verdict(
    im: &mut Importer,
    root: &str,
    masks: &[MaskRef],
    sq: usize,
    t: usize,
) -> Result<Option<Option<bool>>> {
    // Judged once per model, sequence and key length (the file's cache), else once per import
    // for the same mask constants (every layer shares them); only then are masks folded.
    let verdict = match im.m.attention_verdict(root, sq, t) {
        Some(v) => v,
        None => {
            let mut values = Vec::with_capacity(masks.len());
            for m in masks {
                values.push(match m {
                    MaskRef::Add(name) => im.const_input(name)?.map(Mask::Add),
                    MaskRef::Keep(name) => im.const_input(name)?.map(Mask::Keep),
                });
            }
            let Some(values) = values.into_iter().collect::<Option<Vec<Mask>>>() else {
                return Ok(None);
            };
            let key = (
                values
                    .iter()
                    .map(|m| match m {
                        Mask::Add(c) | Mask::Keep(c) => Rc::as_ptr(c) as usize,
                    })
                    .collect::<Vec<usize>>(),
                sq,
                t,
            );
            let v = match im.verdicts.get(&key) {
                Some(v) => *v,
                None => {
                    let v = allowed(&values, sq, t).map(|a| matches!(a, Allowed::Causal));
                    im.verdicts.insert(key, v);
                    v
                }
            };
            im.m.remember_attention_verdict(root, sq, t, v);
            v
        }
    };
    Ok(Some(verdict))
}
