//! Fuzzing the importer (issue 43): two small valid models (one plain, one of the patterns
//! the importer fuses: attention, RMSNorm, SiLU) mutated — arities, dropped and
//! duplicated inputs, cycles, values written twice, bad perms and axes, operators swapped,
//! non-finite weights — and their bytes truncated or flipped. Every input must give a model
//! or an error with a message; never a panic (proptest fails on one, and the import thread's
//! caught panic would say "panicked"), never a stack overflow (which would abort the test
//! binary).

use crate::support;

use onnx_protobuf::ModelProto;
use proptest::prelude::*;
use support::*;

/// Operators the mutations swap in: the importer's own, with different arities.
const OPS: &[&str] = &[
    "MatMul",
    "Add",
    "Relu",
    "Transpose",
    "Concat",
    "Where",
    "Gemm",
    "Reshape",
    "Slice",
    "Split",
    "Softmax",
    "LayerNormalization",
    "Gather",
    "Pow",
    "Max",
    "Squeeze",
    "Unsqueeze",
    "ReduceSum",
    "Shape",
    "Constant",
    "Dropout",
    "Expand",
    "Range",
    "Cast",
    "Det",
];

/// One mutation: a kind, a node, a second index and a few integers.
type Mutation = (u8, usize, usize, Vec<i64>);

fn mutation() -> impl Strategy<Value = Mutation> {
    (0u8..12, 0usize..32, 0usize..32, prop::collection::vec(-3i64..5, 0..5))
}

/// Applies `mu` to `m`; indices wrap around what the graph holds.
fn apply(m: &mut ModelProto, (kind, i, j, ints): &Mutation) {
    let Some(g) = m.graph.as_mut() else { return };
    let names: Vec<String> = std::iter::once(String::new())
        .chain(g.input.iter().map(|v| v.name.clone()))
        .chain(g.initializer.iter().map(|t| t.name.clone()))
        .chain(g.node.iter().flat_map(|n| n.output.clone()))
        .collect();
    let pick = |k: usize| names[k % names.len()].clone();
    if g.node.is_empty() {
        return;
    }
    let len = g.node.len();
    let n = &mut g.node[i % len];
    match kind {
        0 => n.input.truncate(j % 4),
        1 => n.input.push(pick(*j)),
        2 => {
            if let Some(x) = n.input.first().cloned() {
                n.input.push(x);
            }
        }
        3 => {
            // Possibly a value downstream of the node: a cycle.
            let x = pick(*j);
            if let Some(slot) = n.input.first_mut() {
                *slot = x;
            }
        }
        4 => {
            let x = pick(*j);
            if let Some(slot) = n.output.first_mut() {
                *slot = x;
            }
        }
        5 => {
            n.attribute.retain(|a| a.name != "perm");
            n.attribute.push(ints_attr("perm", ints));
        }
        6 => {
            n.attribute.retain(|a| a.name != "axes");
            n.attribute.push(ints_attr("axes", ints));
        }
        7 => n.op_type = OPS[j % OPS.len()].to_string(),
        8 => {
            if j % 2 == 0 {
                n.output.clear();
            } else {
                n.output.push(format!("extra{j}"));
            }
        }
        9 => {
            g.node.remove(i % len);
        }
        10 => {
            let k = g.initializer.len();
            let t = &mut g.initializer[j % k];
            let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][i % 3];
            let k = t.float_data.len();
            t.float_data[ints.len() % k] = bad;
        }
        _ => {
            n.attribute.retain(|a| a.name != "axis");
            n.attribute.push(int_attr("axis", ints.first().copied().unwrap_or(7)));
        }
    }
}

/// Loading `bytes` ends in a model or a refusal with a message, not in a panic.
fn check(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Some(msg) = load(bytes) {
        prop_assert!(!msg.trim().is_empty(), "an empty error message");
        prop_assert!(!msg.contains("panicked"), "the importer panicked: {msg}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn mutated_models_load_or_are_refused(
        fused_base in any::<bool>(),
        muts in prop::collection::vec(mutation(), 1..4),
    ) {
        let mut m = if fused_base { fused() } else { base() };
        for mu in &muts {
            apply(&mut m, mu);
        }
        check(&bytes(&m))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    #[test]
    fn truncated_files_are_refused(fused_base in any::<bool>(), cut in 0.0f64..1.0) {
        let b = bytes(&if fused_base { fused() } else { base() });
        let n = (cut * b.len() as f64) as usize;
        check(&b[..n])?;
    }

    #[test]
    fn flipped_bytes_load_or_are_refused(
        fused_base in any::<bool>(),
        flips in prop::collection::vec((0.0f64..1.0, 1u8..=255), 1..6),
    ) {
        let mut b = bytes(&if fused_base { fused() } else { base() });
        for (at, x) in flips {
            let k = ((at * b.len() as f64) as usize).min(b.len() - 1);
            b[k] ^= x;
        }
        check(&b)?;
    }
}
