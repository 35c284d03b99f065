//! Reading a node's attributes by name, with the defaults the ONNX operator specs give.

use onnx_protobuf::{AttributeProto, NodeProto, TensorProto};

pub fn attr<'a>(node: &'a NodeProto, name: &str) -> Option<&'a AttributeProto> {
    node.attribute.iter().find(|a| a.name == name)
}

pub fn int(node: &NodeProto, name: &str, default: i64) -> i64 {
    attr(node, name).map_or(default, |a| a.i)
}

pub fn float(node: &NodeProto, name: &str, default: f64) -> f64 {
    attr(node, name).map_or(default, |a| a.f as f64)
}

pub fn string(node: &NodeProto, name: &str) -> Option<String> {
    attr(node, name).map(|a| String::from_utf8_lossy(&a.s).into_owned())
}

pub fn ints(node: &NodeProto, name: &str) -> Option<Vec<i64>> {
    attr(node, name).map(|a| a.ints.clone())
}

pub fn tensor<'a>(node: &'a NodeProto, name: &str) -> Option<&'a TensorProto> {
    attr(node, name).and_then(|a| a.t.as_ref())
}

/// A possibly negative axis of a rank-`rank` tensor, `None` when out of range.
pub fn axis(a: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let a = if a < 0 { a + r } else { a };
    (0..r).contains(&a).then_some(a as usize)
}

/// [`axis`], or why not: the axis, the rank and the fix.
pub fn axis_in(a: i64, rank: usize) -> Result<usize, String> {
    axis(a, rank).ok_or_else(|| {
        format!(
            "axis {a} is out of range for a rank-{rank} tensor (-{rank}..{rank}); the file is \
             malformed: re-export the model (onnx.checker.check_model(model, full_check=True) \
             rejects it too)"
        )
    })
}
