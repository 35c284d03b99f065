//! What PyTorch's dynamo exporter (`torch.onnx.export`, `dynamo=True`, the default since
//! torch 2.9) writes about parameters, read once when a file is opened.
//!
//! - The graph's `pkg.torch.export.ExportedProgram.graph_signature` metadata lists every
//!   parameter (`p_<ident>: PARAMETER target='<name>'`, in `named_parameters()` order, tied
//!   names each). With it, a float initialiser is a weight only if it is such a parameter or a
//!   folded copy of one; the others (masks, rotary tables, scalars, buffers the exporter folded)
//!   are constants.
//! - The exporter's optimizer folds `Transpose(weight)` (a Linear weight of at most 8192
//!   elements) or `Cast(weight)` into a new initialiser `val_N` whose value_info carries
//!   `pkg.onnxscript.optimizer.folded_from = ['<name>']`. Such a copy is read as that parameter:
//!   transposed when a `MatMul`/`Gemm` of `aten.linear` reads it, as is otherwise; checked
//!   against the original's values when the original is an initialiser too (a tied head), so
//!   a tied weight is one parameter.
//! - torch.export reads a tied weight under one name everywhere (GPT-2's and OPT's
//!   `lm_head.weight`, the embedding included); a node's `pkg.torch.onnx.name_scopes` says
//!   which module it is in. An initialiser read inside exactly one module whose same-named
//!   parameter the graph holds nowhere else (`transformer.wte` → `transformer.wte.weight`) is
//!   that tied parameter, named as `named_parameters()` names it (the signature's first name).
//!   A folded copy whose original parameter is gone is kept when a node's
//!   `pkg.torch.onnx.fx_node` (its FX arguments, `%p_<ident>`) shows the node reads that
//!   parameter itself (a cast in the op's own decomposition).
//!
//! Files without the signature (the TorchScript exporter) are read as before: every float
//! initialiser is a weight.

use crate::error::{OnnxError, Result};
use crate::tensor::{decode, elem_of, Elem};
use onnx_protobuf::{GraphProto, NodeProto};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

const SIGNATURE: &str = "pkg.torch.export.ExportedProgram.graph_signature";
const FOLDED_FROM: &str = "pkg.onnxscript.optimizer.folded_from";
const FX_NODE: &str = "pkg.torch.onnx.fx_node";
const SCOPES: &str = "pkg.torch.onnx.name_scopes";

/// How an initialiser is read: as parameter `param`, transposed (a 2-D `param.T`) or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ReadAs {
    pub param: String,
    pub transposed: bool,
}

/// The parameters of a dynamo export.
#[derive(Debug, Default)]
pub(crate) struct TorchParams {
    /// Float initialiser → the parameter it is read as. A float initialiser not here is a
    /// constant.
    pub reads: HashMap<String, ReadAs>,
    /// Parameter → the initialiser holding its value as is (a renamed tied weight, or a cast
    /// copy of a parameter the graph has no other trace of).
    pub aliases: HashMap<String, String>,
    /// Parameter → the initialiser holding its value transposed (the optimizer folded the
    /// Linear's `Transpose` and the original is gone).
    pub transposed: HashMap<String, String>,
    /// The parameters, in the signature's (`named_parameters()`) order, each once.
    pub order: Vec<String>,
}

/// `%ident` tokens of an FX node's text.
fn fx_idents(text: &str) -> BTreeSet<&str> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find('%') {
        rest = &rest[i + 1..];
        let end =
            rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
        out.insert(&rest[..end]);
        rest = &rest[end..];
    }
    out
}

/// The names in a Python list repr `['a', 'b']`.
fn py_list(text: &str) -> Vec<String> {
    text.trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .split(',')
        .map(|s| s.trim().trim_matches(|c| c == '\'' || c == '"').to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

fn meta<'a>(props: &'a [onnx_protobuf::StringStringEntryProto], key: &str) -> Option<&'a str> {
    props.iter().find(|p| p.key == key).map(|p| p.value.as_str())
}

/// Reads the parameters of a dynamo export (`None`: no signature, an older exporter).
pub(crate) fn read(
    graph: &GraphProto,
    inits: &HashMap<String, usize>,
    path: &Path,
) -> Result<Option<TorchParams>> {
    let Some(sig) = meta(&graph.metadata_props, SIGNATURE) else { return Ok(None) };
    let p = path.display().to_string();
    // ident → target, and the targets in order.
    let mut ident: HashMap<String, String> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    for line in sig.lines() {
        let Some((id, rest)) = line.trim().split_once(": PARAMETER target='") else { continue };
        let Some(target) = rest.split('\'').next() else { continue };
        ident.insert(id.trim().to_string(), target.to_string());
        order.push(target.to_string());
    }
    let rank: HashMap<&str, usize> =
        order.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();
    let folded: HashMap<&str, Vec<String>> = graph
        .value_info
        .iter()
        .filter_map(|v| meta(&v.metadata_props, FOLDED_FROM).map(|m| (v.name.as_str(), py_list(m))))
        .collect();
    let mut readers: HashMap<&str, Vec<&NodeProto>> = HashMap::new();
    for n in &graph.node {
        for x in &n.input {
            readers.entry(x.as_str()).or_default().push(n);
        }
    }
    let mentions = |n: &NodeProto| -> BTreeSet<String> {
        meta(&n.metadata_props, FX_NODE)
            .map(|t| fx_idents(t).into_iter().filter_map(|i| ident.get(i).cloned()).collect())
            .unwrap_or_default()
    };
    let is_float = |name: &str| {
        inits
            .get(name)
            .is_some_and(|&i| elem_of(graph.initializer[i].data_type) == Some(Elem::Float))
    };
    let folded_param = |param: &str, value: &str, reason: String| OnnxError::FoldedParameter {
        path: p.clone(),
        parameter: param.to_string(),
        value: value.to_string(),
        reason,
    };
    let mut tp = TorchParams::default();
    for t in &graph.initializer {
        let name = t.name.as_str();
        if !is_float(name) {
            continue;
        }
        if rank.contains_key(name) {
            tp.reads.insert(name.into(), ReadAs { param: name.into(), transposed: false });
            continue;
        }
        // Folded from exactly one parameter (and perhaps constants: an Unsqueeze's axes).
        let Some(from) = folded.get(name) else { continue };
        let from: Vec<&String> = from.iter().filter(|f| rank.contains_key(f.as_str())).collect();
        let [param] = from.as_slice() else { continue };
        let param: &String = param;
        let dims: Vec<i64> = t.dims.clone();
        if let Some(&j) = inits.get(param.as_str()) {
            // A copy of another initialiser: the same parameter if the values say so.
            let orig = &graph.initializer[j];
            let a = decode(orig, path.parent().unwrap_or(Path::new(".")))?;
            let b = decode(t, path.parent().unwrap_or(Path::new(".")))?;
            let same = |x: &crate::tensor::Const| x.to_f64() == b.to_f64();
            let transposed = if orig.dims == dims && same(&a) {
                false
            } else if dims.len() == 2
                && orig.dims == [dims[1], dims[0]]
                && same(&a.permuted(&[1, 0]))
            {
                true
            } else {
                return Err(folded_param(
                    param,
                    name,
                    format!(
                        "its value (shape {dims:?}) is neither a copy nor the transpose of \
                         {param}'s (shape {:?})",
                        orig.dims
                    ),
                ));
            };
            tp.reads.insert(name.into(), ReadAs { param: param.clone(), transposed });
            continue;
        }
        // The original is gone: the readers say how the copy was made.
        let rs = readers.get(name).map(Vec::as_slice).unwrap_or(&[]);
        let linear = dims.len() == 2
            && !rs.is_empty()
            && rs.iter().all(|n| {
                let as_b = n.input.get(1).is_some_and(|x| x == name)
                    && (n.op_type == "MatMul"
                        || (n.op_type == "Gemm" && crate::attrs::int(n, "transB", 0) == 0));
                as_b && meta(&n.metadata_props, FX_NODE).is_some_and(|t| t.contains("aten.linear"))
            });
        if linear {
            tp.transposed.entry(param.clone()).or_insert_with(|| name.to_string());
            tp.reads.insert(name.into(), ReadAs { param: param.clone(), transposed: true });
        } else if !rs.is_empty() && rs.iter().all(|n| mentions(n).contains(param)) {
            tp.aliases.entry(param.clone()).or_insert_with(|| name.to_string());
            tp.reads.insert(name.into(), ReadAs { param: param.clone(), transposed: false });
        } else {
            return Err(folded_param(
                param,
                name,
                format!(
                    "the exporter's optimizer computed a constant of shape {dims:?} from it \
                     (and from the static input shapes) and the parameter itself is gone"
                ),
            ));
        }
    }
    // Tied weights: torch.export reads a tied weight under one of its names everywhere (GPT-2's
    // embedding reads `lm_head.weight`); the readers' module scopes (`pkg.torch.onnx.
    // name_scopes`) say which module each read is in. An initialiser read in a module whose
    // parameter of the same leaf name the graph holds nowhere else, and in exactly one such,
    // is that parameter too, and takes the name `named_parameters()` gives it (the first).
    let held: BTreeSet<String> = tp.reads.values().map(|r| r.param.clone()).collect();
    let mut renames: Vec<(String, String)> = Vec::new();
    for t in &graph.initializer {
        let name = t.name.as_str();
        if tp.reads.get(name).is_none_or(|r| r.param != name) {
            continue;
        }
        let leaf = name.rsplit('.').next().unwrap_or(name);
        let mut others: BTreeSet<String> = BTreeSet::new();
        for (v, r) in &tp.reads {
            if r.param != name {
                continue;
            }
            for n in readers.get(v.as_str()).map(Vec::as_slice).unwrap_or(&[]) {
                let scopes = meta(&n.metadata_props, SCOPES).map(py_list).unwrap_or_default();
                if scopes.len() < 2 {
                    continue;
                }
                let cand = format!("{}.{leaf}", scopes[scopes.len() - 2]);
                if cand != name && rank.contains_key(cand.as_str()) && !held.contains(&cand) {
                    others.insert(cand);
                }
            }
        }
        if others.len() == 1 {
            let other = others.into_iter().next().unwrap_or_default();
            if rank[other.as_str()] < rank[name] {
                renames.push((name.to_string(), other));
            }
        }
    }
    for (from, to) in renames {
        for r in tp.reads.values_mut() {
            if r.param == from {
                r.param = to.clone();
            }
        }
        tp.aliases.insert(to, from);
    }
    let used: BTreeSet<&str> = tp.reads.values().map(|r| r.param.as_str()).collect();
    tp.order = order.iter().filter(|n| used.contains(n.as_str())).cloned().collect();
    Ok(Some(tp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fx_text_and_lists_parse() {
        let t = "%linear : [num_users=1] = call_function[target=torch.ops.aten.linear.default]\
                 (args = (%mul_4, %p_model_q_proj_weight), kwargs = {})";
        let ids = fx_idents(t);
        assert!(ids.contains("p_model_q_proj_weight") && ids.contains("mul_4"), "{ids:?}");
        assert_eq!(py_list("['lm_head.weight']"), vec!["lm_head.weight".to_string()]);
        assert_eq!(py_list("['a', 'b']").len(), 2);
    }
}
