//! Small ONNX models built in memory (the crate's own protobuf types), for the validation
//! tests and the fuzzing: a valid base model to mutate, and helpers to write nodes.

#![allow(dead_code)]

pub mod pytorch;

use onnx_protobuf::{
    attribute_proto::AttributeType, tensor_proto::DataType, tensor_shape_proto, AttributeProto,
    GraphProto, Message, ModelProto, NodeProto, OperatorSetIdProto, TensorProto, TensorShapeProto,
    TypeProto, ValueInfoProto,
};
use std::path::Path;
use tessera_onnx::{Bind, OnnxModel};

pub fn node(name: &str, op: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
    let mut n = NodeProto::new();
    n.name = name.into();
    n.op_type = op.into();
    n.input = inputs.iter().map(|s| s.to_string()).collect();
    n.output = outputs.iter().map(|s| s.to_string()).collect();
    n
}

pub fn ints_attr(name: &str, v: &[i64]) -> AttributeProto {
    let mut a = AttributeProto::new();
    a.name = name.into();
    a.type_ = AttributeType::INTS.into();
    a.ints = v.to_vec();
    a
}

pub fn int_attr(name: &str, v: i64) -> AttributeProto {
    let mut a = AttributeProto::new();
    a.name = name.into();
    a.type_ = AttributeType::INT.into();
    a.i = v;
    a
}

pub fn float_attr(name: &str, v: f32) -> AttributeProto {
    let mut a = AttributeProto::new();
    a.name = name.into();
    a.type_ = AttributeType::FLOAT.into();
    a.f = v;
    a
}

pub fn floats(name: &str, dims: &[i64], v: Vec<f32>) -> TensorProto {
    let mut t = TensorProto::new();
    t.name = name.into();
    t.dims = dims.to_vec();
    t.data_type = DataType::FLOAT as i32;
    t.float_data = v;
    t
}

/// A graph input or output of element type `elem` (ONNX's code) and dims (a name: dynamic).
pub fn port(name: &str, elem: DataType, dims: &[&str]) -> ValueInfoProto {
    let mut shape = TensorShapeProto::new();
    for d in dims {
        let mut dim = tensor_shape_proto::Dimension::new();
        dim.value = Some(match d.parse::<i64>() {
            Ok(n) => tensor_shape_proto::dimension::Value::DimValue(n),
            Err(_) => tensor_shape_proto::dimension::Value::DimParam(d.to_string()),
        });
        shape.dim.push(dim);
    }
    let mut ty = TypeProto::new();
    let t = ty.mut_tensor_type();
    t.elem_type = elem as i32;
    t.shape = Some(shape).into();
    let mut v = ValueInfoProto::new();
    v.name = name.into();
    v.type_ = Some(ty).into();
    v
}

pub fn model(graph: GraphProto) -> ModelProto {
    let mut m = ModelProto::new();
    m.ir_version = 8;
    let mut op = OperatorSetIdProto::new();
    op.version = 17;
    m.opset_import.push(op);
    m.graph = Some(graph).into();
    m
}

/// The base model: `x [batch, 4]` → MatMul → Relu → Transpose → Transpose → Add → ReduceMean
/// → Sub → MatMul → `y [batch, 3]`. Valid: it imports.
pub fn base() -> ModelProto {
    let mut g = GraphProto::new();
    g.name = "base".into();
    g.input.push(port("x", DataType::FLOAT, &["batch", "4"]));
    g.output.push(port("y", DataType::FLOAT, &["batch", "3"]));
    g.initializer.push(floats("w1", &[4, 6], (0..24).map(|i| i as f32 / 24.0 - 0.5).collect()));
    g.initializer.push(floats("b", &[6], vec![0.1; 6]));
    g.initializer.push(floats("w2", &[6, 3], (0..18).map(|i| i as f32 / 18.0).collect()));
    g.node.push(node("mm1", "MatMul", &["x", "w1"], &["h"]));
    g.node.push(node("relu", "Relu", &["h"], &["r"]));
    let mut t = node("tr", "Transpose", &["r"], &["t"]);
    t.attribute.push(ints_attr("perm", &[1, 0]));
    g.node.push(t);
    let mut t = node("tr2", "Transpose", &["t"], &["u"]);
    t.attribute.push(ints_attr("perm", &[1, 0]));
    g.node.push(t);
    g.node.push(node("add", "Add", &["u", "b"], &["v"]));
    let mut m = node("mean", "ReduceMean", &["v"], &["s"]);
    m.attribute.push(ints_attr("axes", &[1]));
    m.attribute.push(int_attr("keepdims", 1));
    g.node.push(m);
    g.node.push(node("sub", "Sub", &["v", "s"], &["z"]));
    g.node.push(node("mm2", "MatMul", &["z", "w2"], &["y"]));
    model(g)
}

pub fn bytes(m: &ModelProto) -> Vec<u8> {
    m.write_to_bytes().expect("a model in memory encodes")
}

pub fn bind() -> Bind {
    Bind { batch: 2, seq: 1, dtype: tessera_ir::DType::F32 }
}

/// Opens `bytes`, imports the model and reads every weight, as the CLI does: the first
/// error's message, or `None` when all of it succeeds.
pub fn load(bytes: &[u8]) -> Option<String> {
    let m = match OnnxModel::from_bytes(bytes, Path::new("mem/model.onnx")) {
        Ok(m) => m,
        Err(e) => return Some(e.to_string()),
    };
    if let Err(e) = m.check_operators() {
        return Some(e.to_string());
    }
    if let Err(e) = tessera_onnx::import(&m, &bind()) {
        return Some(e.to_string());
    }
    for (name, _) in m.weight_shapes() {
        if let Err(e) = m.weights_f32(&name) {
            return Some(e.to_string());
        }
    }
    None
}

/// The message of the error `m` gives (panics, failing the test, if it loads).
pub fn refusal(m: &ModelProto) -> String {
    load(&bytes(m)).unwrap_or_else(|| panic!("the model loaded: {m:?}"))
}

fn constant(name: &str, out: &str, v: f32) -> NodeProto {
    let mut c = node(name, "Constant", &[], &[out]);
    c.attribute.push(float_attr("value_float", v));
    c
}

/// A second base model, made of the patterns the importer fuses: single-head attention
/// (`MatMul(Softmax(scale · q kᵀ), v)`), LLaMA's RMSNorm formula and SiLU. `x [batch, 4, 8]`
/// → `y [batch, 4, 3]`. Valid: it imports.
pub fn fused() -> ModelProto {
    let mut g = GraphProto::new();
    g.name = "fused".into();
    g.input.push(port("x", DataType::FLOAT, &["batch", "4", "8"]));
    g.output.push(port("y", DataType::FLOAT, &["batch", "4", "3"]));
    for (i, w) in ["wq", "wk", "wv"].iter().enumerate() {
        let v = (0..64).map(|k| ((k * (i + 3)) as f32 * 0.37).sin() * 0.3).collect();
        g.initializer.push(floats(w, &[8, 8], v));
    }
    g.initializer.push(floats("gamma", &[8], vec![1.0; 8]));
    g.initializer.push(floats("wo", &[8, 3], (0..24).map(|k| k as f32 / 24.0 - 0.5).collect()));
    g.node.push(node("q", "MatMul", &["x", "wq"], &["q"]));
    g.node.push(node("k", "MatMul", &["x", "wk"], &["k"]));
    g.node.push(node("v", "MatMul", &["x", "wv"], &["v"]));
    let mut t = node("kt", "Transpose", &["k"], &["kt"]);
    t.attribute.push(ints_attr("perm", &[0, 2, 1]));
    g.node.push(t);
    g.node.push(node("scores", "MatMul", &["q", "kt"], &["s"]));
    g.node.push(constant("c_scale", "scale", 0.35));
    g.node.push(node("scaled", "Mul", &["s", "scale"], &["sc"]));
    let mut sm = node("softmax", "Softmax", &["sc"], &["p"]);
    sm.attribute.push(int_attr("axis", -1));
    g.node.push(sm);
    g.node.push(node("attn", "MatMul", &["p", "v"], &["a"]));
    g.node.push(constant("c_two", "two", 2.0));
    g.node.push(node("sq", "Pow", &["a", "two"], &["a2"]));
    let mut m = node("ms", "ReduceMean", &["a2"], &["ms"]);
    m.attribute.push(ints_attr("axes", &[-1]));
    g.node.push(m);
    g.node.push(constant("c_eps", "eps", 1e-5));
    g.node.push(node("plus_eps", "Add", &["ms", "eps"], &["var"]));
    g.node.push(node("rms", "Sqrt", &["var"], &["rms"]));
    g.node.push(node("normed", "Div", &["a", "rms"], &["n"]));
    g.node.push(node("affine", "Mul", &["n", "gamma"], &["gn"]));
    g.node.push(node("sig", "Sigmoid", &["gn"], &["sg"]));
    g.node.push(node("silu", "Mul", &["gn", "sg"], &["act"]));
    g.node.push(node("out", "MatMul", &["act", "wo"], &["y"]));
    model(g)
}
