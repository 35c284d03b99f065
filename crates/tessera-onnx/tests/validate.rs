//! Malformed graphs refused before import, each naming its node, the problem and the fix
//! (issue 43): arity, SSA, cycles and depth (iteratively: no stack overflow), attributes,
//! and NaN or infinite initialisers by name.

use crate::support;

use support::*;
use tessera_onnx::{OnnxError, OnnxModel, MAX_DEPTH};

fn open(m: &onnx_protobuf::ModelProto) -> Result<OnnxModel, OnnxError> {
    OnnxModel::from_bytes(&bytes(m), std::path::Path::new("mem/model.onnx"))
}

fn graph(m: &mut onnx_protobuf::ModelProto) -> &mut onnx_protobuf::GraphProto {
    m.graph.as_mut().expect("the base model has a graph")
}

#[test]
fn the_base_models_load() {
    assert_eq!(load(&bytes(&base())), None);
    assert_eq!(load(&bytes(&fused())), None);
}

#[test]
fn a_matmul_with_one_input_is_refused_by_name() {
    let mut m = base();
    graph(&mut m).node[0].input.truncate(1);
    let err = open(&m).unwrap_err();
    assert!(matches!(err, OnnxError::Arity { found: 1, what: "inputs", .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("\"mm1\" (MatMul, node #0)") && msg.contains("has 1 inputs"), "{msg}");
    assert!(msg.contains("takes 2") && msg.contains("onnx.checker"), "{msg}");
}

#[test]
fn a_matmul_with_three_inputs_is_refused() {
    let mut m = base();
    graph(&mut m).node[7].input.push("b".into());
    let msg = refusal(&m);
    assert!(msg.contains("\"mm2\" (MatMul, node #7) has 3 inputs"), "{msg}");
}

#[test]
fn an_empty_required_input_is_refused_but_an_omitted_optional_one_is_not() {
    let mut m = base();
    graph(&mut m).node[4].input[1] = String::new();
    let msg = refusal(&m);
    assert!(msg.contains("\"add\" (Add, node #4) leaves its required input 1 empty"), "{msg}");
    // Gemm's C is optional: an empty name omits it.
    let mut m = base();
    let g = graph(&mut m);
    g.node[7] = node("mm2", "Gemm", &["z", "w2", ""], &["y"]);
    assert_eq!(load(&bytes(&m)), None);
}

#[test]
fn a_two_node_cycle_is_named() {
    let mut m = base();
    // relu reads tr2's output, which depends on relu.
    graph(&mut m).node[1].input[0] = "u".into();
    let err = open(&m).unwrap_err();
    assert!(matches!(err, OnnxError::Cycle { nodes: 3, .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("cycle through node") && msg.contains("\"relu\" (Relu"), "{msg}");
    assert!(msg.contains("\"tr2\" (Transpose, node #3)") && !msg.contains("deeper"), "{msg}");
}

#[test]
fn a_one_node_cycle_says_so() {
    let mut m = base();
    graph(&mut m).node[1].input[0] = "r".into();
    let msg = refusal(&m);
    assert!(msg.contains("cycle through node \"relu\" (Relu, node #1) (1 node(s)"), "{msg}");
    assert!(!msg.contains("deeper"), "{msg}");
}

/// A cycle of 300 000 nodes: found by Kahn's algorithm and named without recursion.
#[test]
fn a_huge_cycle_does_not_overflow_the_stack() {
    let mut m = base();
    let g = graph(&mut m);
    let n = 300_000;
    for i in 0..n {
        let (a, b) = (format!("c{i}"), format!("c{}", (i + 1) % n));
        g.node.push(node(&format!("neg{i}"), "Neg", &[&a], &[&b]));
    }
    let err = open(&m).unwrap_err();
    assert!(matches!(err, OnnxError::Cycle { nodes, .. } if nodes == n), "{err}");
}

fn chain(len: usize) -> onnx_protobuf::ModelProto {
    let mut m = base();
    let g = graph(&mut m);
    g.node.truncate(7);
    let mut prev = "z".to_string();
    for i in 0..len {
        let next = format!("n{i}");
        g.node.push(node(&format!("neg{i}"), "Neg", &[&prev], &[&next]));
        prev = next;
    }
    g.node.push(node("mm2", "MatMul", &[&prev, "w2"], &["y"]));
    m
}

/// The deepest graph the validation lets through imports (the walk's stack holds it); one
/// deeper is refused by name, not by a stack overflow.
#[test]
fn depth_is_bounded_and_the_bound_fits_the_stack() {
    let ok = chain(MAX_DEPTH - 8);
    assert_eq!(load(&bytes(&ok)), None);
    let err = open(&chain(MAX_DEPTH)).unwrap_err();
    assert!(matches!(err, OnnxError::TooDeep { .. }), "{err}");
    assert!(err.to_string().contains(&format!("more than {MAX_DEPTH} nodes deep")), "{err}");
}

#[test]
fn a_transpose_perm_too_short_is_refused() {
    let mut m = base();
    graph(&mut m).node[2].attribute[0] = ints_attr("perm", &[0]);
    let msg = refusal(&m);
    assert!(msg.contains("node tr (Transpose)") && msg.contains("perm [0]"), "{msg}");
    assert!(msg.contains("not a permutation of the input's 2 axes"), "{msg}");
}

#[test]
fn a_transpose_perm_that_is_not_a_permutation_is_refused() {
    for perm in [vec![0, 0], vec![1, 2], vec![-1, 0]] {
        let mut m = base();
        graph(&mut m).node[2].attribute[0] = ints_attr("perm", &perm);
        let err = open(&m).unwrap_err();
        assert!(matches!(&err, OnnxError::Attribute { attr, .. } if attr == "perm"), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("\"tr\" (Transpose, node #2): attribute perm"), "{msg}");
        assert!(msg.contains("is not a permutation of 0..2"), "{msg}");
    }
}

#[test]
fn repeated_axes_are_refused() {
    let mut m = base();
    graph(&mut m).node[5].attribute[0] = ints_attr("axes", &[1, 1]);
    let msg = refusal(&m);
    assert!(msg.contains("\"mean\" (ReduceMean, node #5): attribute axes"), "{msg}");
    assert!(msg.contains("names axis 1 twice"), "{msg}");
}

#[test]
fn an_axis_out_of_range_is_refused() {
    let mut m = base();
    graph(&mut m).node[5].attribute[0] = ints_attr("axes", &[5]);
    let msg = refusal(&m);
    assert!(msg.contains("node mean (ReduceMean): axis 5 is out of range for a rank-2"), "{msg}");
    assert!(msg.contains("re-export the model"), "{msg}");
}

#[test]
fn two_nodes_writing_one_value_are_refused() {
    let mut m = base();
    graph(&mut m).node[3].output[0] = "r".into();
    let err = open(&m).unwrap_err();
    assert!(matches!(&err, OnnxError::Ssa { value, .. } if value == "r"), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("value r is written by node \"relu\" (Relu, node #1)"), "{msg}");
    assert!(msg.contains("again by node \"tr2\" (Transpose, node #3)"), "{msg}");
}

#[test]
fn a_node_overwriting_an_initialiser_or_input_is_refused() {
    let mut m = base();
    graph(&mut m).node[1].output[0] = "w2".into();
    let msg = refusal(&m);
    assert!(msg.contains("value w2 is written by initialiser w2 and again by node"), "{msg}");
    let mut m = base();
    graph(&mut m).node[1].output[0] = "x".into();
    let msg = refusal(&m);
    assert!(msg.contains("value x is written by graph input x"), "{msg}");
}

#[test]
fn an_undefined_value_is_refused() {
    let mut m = base();
    graph(&mut m).node[4].input[1] = "nowhere".into();
    let msg = refusal(&m);
    assert!(msg.contains("node \"add\" (Add, node #4) reads value nowhere"), "{msg}");
}

#[test]
fn nan_and_infinite_initialisers_are_refused_by_name() {
    for (bad, shown) in [(f32::NAN, "NaN"), (f32::INFINITY, "inf"), (f32::NEG_INFINITY, "-inf")] {
        let mut m = base();
        let w = &mut graph(&mut m).initializer[0];
        w.float_data[5] = bad;
        w.float_data[9] = bad;
        let model = open(&m).unwrap();
        let err = model.weights_f32("w1").unwrap_err();
        assert!(
            matches!(err, OnnxError::NonFinite { count: 2, first_index: 5, total: 24, .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("initialiser w1 holds 2 non-finite value(s)"), "{msg}");
        assert!(msg.contains(&format!("first at element 5 ({shown})")), "{msg}");
        // The finite ones still read.
        assert!(model.weights_f32("w2").is_ok());
    }
}

#[test]
fn max_of_three_inputs_is_refused_not_truncated() {
    let mut m = base();
    graph(&mut m).node[4] = node("add", "Max", &["u", "b", "b"], &["v"]);
    let msg = refusal(&m);
    assert!(msg.contains("node add (Max)") && msg.contains("Max of 3 inputs"), "{msg}");
}

/// The base model with `p = Pow(base, exponent)` (a `Constant` exponent) added before the
/// last MatMul, which then reads `p`; `extra` nodes come first (they may define `base`).
fn with_pow(base_name: &str, exponent: f32, extra: Vec<onnx_protobuf::NodeProto>) -> String {
    let mut m = base();
    let g = graph(&mut m);
    let last = g.node.pop().expect("the base model's last node");
    g.node.extend(extra);
    let mut c = node("exp", "Constant", &[], &["e"]);
    c.attribute.push(float_attr("value_float", exponent));
    g.node.push(c);
    g.node.push(node("pow", "Pow", &[base_name, "e"], &["p"]));
    g.node.push(node(&last.name, "MatMul", &["p", "w2"], &["y"]));
    load(&bytes(&m)).unwrap_or_default()
}

#[test]
fn a_fractional_power_of_a_value_that_may_be_negative_is_named() {
    // z = v - mean(v) is negative somewhere: z ** 0.5 is NaN there.
    let msg = with_pow("z", 0.5, vec![]);
    assert!(msg.contains("node \"pow\" (Pow, node #"), "{msg}");
    assert!(
        msg.contains("raises z to the power 0.5, which is NaN wherever z is negative"),
        "{msg}"
    );
    assert!(!msg.contains("learning rate"), "{msg}");
    // The same power of a square plus a positive constant, of a Relu, and an integer power of
    // z all import.
    let sq = vec![
        node("sq", "Mul", &["z", "z"], &["zz"]),
        {
            let mut c = node("eps", "Constant", &[], &["eps"]);
            c.attribute.push(float_attr("value_float", 1e-5));
            c
        },
        node("plus", "Add", &["zz", "eps"], &["var"]),
    ];
    assert_eq!(with_pow("var", 0.5, sq), "");
    assert_eq!(with_pow("var2", -0.5, vec![node("r", "Relu", &["z"], &["var2"])]), "");
    assert_eq!(with_pow("z", 2.0, vec![]), "");
}
