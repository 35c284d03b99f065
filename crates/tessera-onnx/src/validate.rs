//! The graph checked before anything is imported: `onnx.checker`'s structural rules as far as
//! they matter for the operators the importer reads, each refusal an [`OnnxError`] variant
//! naming the node, the problem and the fix.
//!
//! - **Arity**: inputs and outputs per operator ([`arity`]), optional ones omitted by count or
//!   by an empty name where the operator spec allows it.
//! - **SSA**: each value is written once (no two nodes, no node and a graph input or an
//!   initialiser); every value read is defined.
//! - **Acyclic**: a topological order is found by Kahn's algorithm (iteratively, so no graph
//!   can overflow the stack here); a cycle is named by the nodes on it. The import walk that
//!   follows recurses along the graph's depth, so the depth is bounded too ([`MAX_DEPTH`]).
//! - **Attributes** that are wrong whatever the shapes: a `perm` that is not a permutation,
//!   repeated `axes`.

use crate::error::{OnnxError, Result};
use onnx_protobuf::{GraphProto, NodeProto};
use std::collections::{HashMap, HashSet};

/// The longest chain of nodes the import walk follows (it recurses once per node along a
/// chain, on a 256 MiB stack). Exported transformers are a few thousand nodes deep.
pub const MAX_DEPTH: usize = 20_000;

/// No upper bound on a variadic operator's inputs or outputs.
const MANY: usize = usize::MAX;

/// (min inputs, max inputs, min outputs, max outputs) of a supported operator, per the ONNX
/// operator specs from opset 13 on (optional inputs and outputs counted in the max).
pub(crate) fn arity(op: &str) -> Option<(usize, usize, usize, usize)> {
    Some(match op {
        "Abs" | "Cast" | "Ceil" | "Cos" | "Erf" | "Exp" | "Flatten" | "Floor"
        | "GlobalAveragePool" | "Identity" | "Log" | "Neg" | "Not" | "Reciprocal" | "Relu"
        | "Shape" | "Sigmoid" | "Sin" | "Size" | "Softmax" | "Sqrt" | "Tanh" | "Transpose"
        | "ConstantOfShape" | "AveragePool" => (1, 1, 1, 1),
        "Add" | "And" | "CumSum" | "Div" | "Equal" | "Expand" | "Gather" | "Greater"
        | "GreaterOrEqual" | "Less" | "LessOrEqual" | "MatMul" | "Mod" | "Mul" | "Or" | "Pow"
        | "Reshape" | "Sub" | "Xor" => (2, 2, 1, 1),
        "InstanceNormalization" | "Range" | "Where" => (3, 3, 1, 1),
        "Constant" => (0, 0, 1, 1),
        "Concat" | "Max" | "Min" => (1, MANY, 1, 1),
        "Conv" | "Gemm" => (2, 3, 1, 1),
        "Dropout" => (1, 3, 1, 2),
        "LayerNormalization" => (2, 3, 1, 3),
        "MaxPool" => (1, 1, 1, 2),
        // Opset 18 moved the reductions' axes to an input; Unsqueeze's moved in 13, but the
        // attribute form is read too.
        "ReduceMean" | "ReduceSum" | "Squeeze" | "Unsqueeze" | "Trilu" => (1, 2, 1, 1),
        "Resize" => (1, 4, 1, 1),
        "Slice" => (3, 5, 1, 1),
        "Split" => (1, 2, 1, MANY),
        _ => return None,
    })
}

/// How a node is named in messages: `"name" (Op, node #i)`.
pub(crate) fn describe(node: &NodeProto, index: usize) -> String {
    let name = if node.name.is_empty() { "<unnamed>" } else { node.name.as_str() };
    format!("\"{name}\" ({}, node #{index})", node.op_type)
}

fn count(n: usize) -> String {
    if n == MANY {
        "any number".into()
    } else {
        n.to_string()
    }
}

fn range(min: usize, max: usize) -> String {
    match (min, max) {
        (a, b) if a == b => a.to_string(),
        (a, MANY) => format!("at least {a}"),
        (a, b) => format!("{a} to {}", count(b)),
    }
}

/// Checks `graph` (the model at `path`): arity, SSA, definitions, acyclicity and depth, and
/// the attributes that are wrong whatever the shapes.
pub(crate) fn validate(path: &str, graph: &GraphProto) -> Result<()> {
    let p = || path.to_string();
    // Arity and attributes, node by node.
    for (i, n) in graph.node.iter().enumerate() {
        if let Some((imin, imax, omin, omax)) = arity(&n.op_type) {
            for (what, found, min, max) in
                [("inputs", n.input.len(), imin, imax), ("outputs", n.output.len(), omin, omax)]
            {
                if found < min || found > max {
                    return Err(OnnxError::Arity {
                        path: p(),
                        node: describe(n, i),
                        what,
                        found,
                        expected: range(min, max),
                    });
                }
            }
            for (what, names, min) in [("input", &n.input, imin), ("output", &n.output, omin)] {
                let variadic =
                    (what == "input" && imax == MANY) || (what == "output" && omax == MANY);
                let required = if variadic { names.len() } else { min };
                if let Some(k) = names.iter().take(required).position(String::is_empty) {
                    return Err(OnnxError::EmptyName {
                        path: p(),
                        node: describe(n, i),
                        what,
                        position: k,
                    });
                }
            }
        }
        check_attributes(path, n, i)?;
    }
    // SSA: every value defined once.
    let mut defined: HashMap<&str, String> = HashMap::new();
    for t in &graph.initializer {
        if let Some(first) = defined.insert(&t.name, format!("initialiser {}", t.name)) {
            return Err(OnnxError::Ssa {
                path: p(),
                value: t.name.clone(),
                first,
                second: "another initialiser".into(),
            });
        }
    }
    for v in &graph.input {
        // An initialiser may also be listed as a graph input (its default value).
        match defined.get(v.name.as_str()) {
            Some(first) if !first.starts_with("initialiser") => {
                return Err(OnnxError::Ssa {
                    path: p(),
                    value: v.name.clone(),
                    first: first.clone(),
                    second: "another graph input".into(),
                });
            }
            Some(_) => {}
            None => {
                defined.insert(&v.name, format!("graph input {}", v.name));
            }
        }
    }
    let mut producer: HashMap<&str, usize> = HashMap::new();
    for (i, n) in graph.node.iter().enumerate() {
        for o in n.output.iter().filter(|o| !o.is_empty()) {
            if let Some(first) = defined.insert(o, format!("node {}", describe(n, i))) {
                return Err(OnnxError::Ssa {
                    path: p(),
                    value: o.clone(),
                    first,
                    second: format!("node {}", describe(n, i)),
                });
            }
            producer.insert(o, i);
        }
    }
    for (i, n) in graph.node.iter().enumerate() {
        if let Some(x) = n.input.iter().find(|x| !x.is_empty() && !defined.contains_key(x.as_str()))
        {
            return Err(OnnxError::Undefined {
                path: p(),
                value: x.clone(),
                reader: format!("node {}", describe(n, i)),
            });
        }
    }
    if let Some(o) = graph.output.iter().find(|o| !defined.contains_key(o.name.as_str())) {
        return Err(OnnxError::Undefined {
            path: p(),
            value: o.name.clone(),
            reader: "the graph's outputs".into(),
        });
    }
    order(path, graph, &producer)
}

/// The predecessors of node `i`: the nodes producing its inputs (repeats kept).
fn preds<'a>(
    graph: &'a GraphProto,
    producer: &'a HashMap<&str, usize>,
    i: usize,
) -> impl Iterator<Item = usize> + 'a {
    graph.node[i].input.iter().filter_map(|x| producer.get(x.as_str()).copied())
}

/// Kahn's algorithm: refuses a cycle (naming the nodes on one) and a graph deeper than
/// [`MAX_DEPTH`].
fn order(path: &str, graph: &GraphProto, producer: &HashMap<&str, usize>) -> Result<()> {
    let n = graph.node.len();
    let mut indegree = vec![0usize; n];
    let mut succs: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, d) in indegree.iter_mut().enumerate() {
        for p in preds(graph, producer, i) {
            *d += 1;
            succs[p].push(i);
        }
    }
    let mut depth = vec![1usize; n];
    let mut ready: Vec<usize> = (0..n).filter(|&i| indegree[i] == 0).collect();
    let mut done = 0;
    while let Some(i) = ready.pop() {
        done += 1;
        if depth[i] > MAX_DEPTH {
            return Err(OnnxError::TooDeep {
                path: path.to_string(),
                node: describe(&graph.node[i], i),
                limit: MAX_DEPTH,
            });
        }
        for &s in &succs[i] {
            depth[s] = depth[s].max(depth[i] + 1);
            indegree[s] -= 1;
            if indegree[s] == 0 {
                ready.push(s);
            }
        }
    }
    if done == n {
        return Ok(());
    }
    // Every node left has a predecessor left: walk back until a node repeats.
    let Some(start) = (0..n).find(|&i| indegree[i] > 0) else { return Ok(()) };
    let mut seen: HashMap<usize, usize> = HashMap::new();
    let mut walk = vec![start];
    let mut at = start;
    loop {
        seen.insert(at, walk.len() - 1);
        let Some(p) = preds(graph, producer, at).find(|&p| indegree[p] > 0) else { break };
        if let Some(&k) = seen.get(&p) {
            // walk[k..] is the cycle, walked backwards.
            let mut cycle: Vec<usize> = walk[k..].to_vec();
            cycle.reverse();
            let first = cycle[0];
            let names: Vec<String> = cycle
                .iter()
                .chain(std::iter::once(&first))
                .take(8)
                .map(|&c| describe(&graph.node[c], c))
                .collect();
            let more = if cycle.len() + 1 > 8 { " → …" } else { "" };
            return Err(OnnxError::Cycle {
                path: path.to_string(),
                node: describe(&graph.node[first], first),
                nodes: cycle.len(),
                chain: format!("{}{more}", names.join(" → ")),
            });
        }
        walk.push(p);
        at = p;
    }
    // Unreachable for a graph whose left-over nodes all have left-over predecessors.
    let node = describe(&graph.node[start], start);
    Err(OnnxError::Cycle { path: path.to_string(), node: node.clone(), nodes: 0, chain: node })
}

/// Attributes wrong whatever the shapes: a `perm` that is not a permutation of `0..len`,
/// `axes` repeated.
fn check_attributes(path: &str, n: &NodeProto, i: usize) -> Result<()> {
    let bad = |attr: &str, reason: String| OnnxError::Attribute {
        path: path.to_string(),
        node: describe(n, i),
        attr: attr.to_string(),
        reason,
    };
    if n.op_type == "Transpose" {
        if let Some(perm) = crate::attrs::ints(n, "perm") {
            if !is_permutation(&perm) {
                return Err(bad(
                    "perm",
                    format!("{perm:?} is not a permutation of 0..{}", perm.len()),
                ));
            }
        }
    }
    if let Some(axes) = crate::attrs::ints(n, "axes") {
        let mut seen = HashSet::new();
        if let Some(a) = axes.iter().find(|&&a| !seen.insert(a)) {
            return Err(bad("axes", format!("{axes:?} names axis {a} twice")));
        }
    }
    Ok(())
}

/// Whether `perm` holds each of `0..len` once.
pub(crate) fn is_permutation(perm: &[i64]) -> bool {
    let mut seen = vec![false; perm.len()];
    perm.iter().all(|&p| {
        usize::try_from(p)
            .ok()
            .filter(|&p| p < seen.len())
            .is_some_and(|p| !std::mem::replace(&mut seen[p], true))
    })
}
