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
//! - **Activations**: GPT-2's tanh GELU `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, the
//!   exact GELU `0.5·x·(1 + erf(x/√2))` and SiLU `x · sigmoid(x)` become the IR's `GeluTanh`,
//!   `Gelu` and `Silu` (one saved input instead of every intermediate of the formula).
//! - **Normalisations**: LLaMA's RMSNorm formula → `RmsNorm`; opset 17's `nn.GroupNorm`
//!   (`InstanceNormalization` between two reshapes, then the affine) → `GroupNorm`.
//!
//! A pattern that does not match leaves the nodes to the generic lowering. Matching is done
//! on the ONNX graph and on constants only ([`Importer::is_static`]), so a failed match emits
//! nothing.

mod activation;
mod attention;
mod norm;
mod rope;

use crate::error::Result;
use crate::import::{Importer, Value};
use onnx_protobuf::NodeProto;

/// Tries every fusion rooted at node `i`.
pub(crate) fn try_fuse(im: &mut Importer, i: usize) -> Result<Option<Value>> {
    let node = im.node(i);
    match node.op_type.as_str() {
        "MatMul" => attention::attention(im, node),
        "Add" => match rope::rope(im, node)? {
            Some(v) => Ok(Some(v)),
            None => norm::group_norm(im, node),
        },
        "Mul" => match activation::activation(im, node)? {
            Some(v) => Ok(Some(v)),
            None => norm::rms_norm(im, node),
        },
        _ => Ok(None),
    }
}

/// The single node producing `name`, read by nobody else.
pub(super) fn private_producer<'m>(im: &Importer<'m>, name: &str) -> Option<&'m NodeProto> {
    let p = im.producer_of(name)?;
    (im.readers(name) == 1).then(|| im.node(p))
}

/// The inputs of a binary node as (dynamic, static), if exactly one is static.
pub(super) fn split_static(im: &mut Importer, n: &NodeProto) -> Option<(String, String)> {
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

/// `x.permute(r)` of a logical value, as a physical IR tensor (no op when it composes to
/// the identity with the value's pending permutation).
pub(super) fn view(
    im: &mut Importer,
    x: &Value,
    r: &[usize],
) -> tessera_ir::Result<tessera_ir::TensorId> {
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

/// `name` = `Mul(dynamic, c)` (either order) for a scalar constant `c`: (dynamic, c).
pub(super) fn times_const(
    im: &mut Importer,
    name: &str,
    op: &str,
) -> Result<Option<(String, f64)>> {
    let Some(n) = private_producer(im, name).filter(|n| n.op_type == op) else { return Ok(None) };
    let Some((dynamic, fixed)) = split_static(im, n) else { return Ok(None) };
    Ok(im.const_input(&fixed)?.and_then(|c| c.scalar()).map(|c| (dynamic, c)))
}

/// The single dynamic input of `name`'s producer if it is a private `op` node.
pub(super) fn unary_of(im: &Importer, name: &str, op: &str) -> Option<String> {
    private_producer(im, name).filter(|n| n.op_type == op).map(|n| n.input[0].clone())
}

pub(super) fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

/// A unary IR op on `x`, keeping its pending permutation.
pub(super) fn apply(
    im: &mut Importer,
    root: &NodeProto,
    x: &Value,
    op: tessera_ir::UnaryOp,
) -> Result<Value> {
    let (id, perm) = match x {
        Value::Tensor { id, perm } => (*id, perm.clone()),
        other => (im.tensor(other, &root.name, &root.op_type)?, None),
    };
    let y = im.b.unary(op, id).map_err(|e| im.err_ir(root, e))?;
    Ok(Value::Tensor { id: y, perm })
}
