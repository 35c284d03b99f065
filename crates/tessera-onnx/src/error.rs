//! The importer's errors: each names the file, the ONNX node (its name and operator) and,
//! for an operator without a mapping, where its output is used, so a user can find it in
//! Netron or in the module that exported it.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum OnnxError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path} is not an ONNX model ({reason}); export one with torch.onnx.export(model, args, \
         \"model.onnx\", opset_version=17)"
    )]
    Parse { path: String, reason: String },
    /// An operator the importer has no mapping for.
    #[error(
        "ONNX operator {op} (node {node}) is not supported; its output is used by {used_by}. \
         Supported operators: {supported}"
    )]
    UnsupportedOp { op: String, node: String, used_by: String, supported: String },
    /// A supported operator used in a way the importer cannot express in the IR.
    #[error("node {node} ({op}): {reason}")]
    Unsupported { node: String, op: String, reason: String },
    /// The model itself is malformed or inconsistent.
    #[error("{path}: {reason}")]
    Model { path: String, reason: String },
    /// A node with too few or too many inputs or outputs for its operator.
    #[error(
        "{path}: node {node} has {found} {what}, but the operator takes {expected}; the file \
         is malformed (onnx.checker.check_model rejects it too): re-export the model"
    )]
    Arity { path: String, node: String, what: &'static str, found: usize, expected: String },
    /// A required input or output left empty (`""` means omitted, for optional ones only).
    #[error(
        "{path}: node {node} leaves its required {what} {position} empty; the file is malformed \
         (onnx.checker.check_model rejects it too): re-export the model"
    )]
    EmptyName { path: String, node: String, what: &'static str, position: usize },
    /// A value written twice: the graph is not in static single assignment form.
    #[error(
        "{path}: value {value} is written by {first} and again by {second}; an ONNX graph \
         assigns each value once (onnx.checker.check_model rejects it too): rename one and \
         re-export the model"
    )]
    Ssa { path: String, value: String, first: String, second: String },
    /// A value read but defined nowhere.
    #[error(
        "{path}: {reader} reads value {value}, which no node, initialiser or graph input \
         defines; re-export the model (onnx.checker.check_model rejects it too)"
    )]
    Undefined { path: String, value: String, reader: String },
    /// A cycle: a node reads (through others) its own output.
    #[error(
        "{path}: the graph has a cycle through node {node} ({nodes} node(s): {chain}); ONNX \
         graphs are acyclic (onnx.checker.check_model rejects it too): re-export the model"
    )]
    Cycle { path: String, node: String, nodes: usize, chain: String },
    /// A chain of nodes longer than the import walk follows.
    #[error(
        "{path}: the graph is more than {limit} nodes deep (at node {node}); the importer \
         follows chains up to {limit} nodes: export a shallower model"
    )]
    TooDeep { path: String, node: String, limit: usize },
    /// An attribute wrong for its operator (a `perm` that is not a permutation, say).
    #[error(
        "{path}: node {node}: attribute {attr} {reason}; the file is malformed \
         (onnx.checker.check_model rejects it too): re-export the model"
    )]
    Attribute { path: String, node: String, attr: String, reason: String },
    /// An initialiser holding NaN or infinite values.
    #[error(
        "{path}: initialiser {tensor} holds {count} non-finite value(s) (NaN or infinite) of \
         {total}, the first at element {first_index} ({first_value}); weights must be finite: \
         fix or re-export the model from finite weights"
    )]
    NonFinite {
        path: String,
        tensor: String,
        count: usize,
        total: usize,
        first_index: usize,
        first_value: f64,
    },
    /// A fractional power of a value that may be negative: NaN on its negative entries.
    #[error(
        "{path}: node {node} raises {base} to the power {exponent}, which is NaN wherever \
         {base} is negative, and nothing in the graph keeps {base} non-negative; apply the \
         power to a value that is (x.abs() ** {exponent}, torch.relu(x) ** {exponent}, or a \
         variance plus epsilon) and re-export the model"
    )]
    NegativeBase { path: String, node: String, base: String, exponent: f64 },
    /// A parameter PyTorch's dynamo exporter folded into a constant it cannot be read back
    /// from (a slice of it computed for the static input shape).
    #[error(
        "{path}: the exporter folded parameter {parameter} into constant {value}: {reason}; \
         export with dynamic_shapes for the batch and sequence axes (as tessera.from_torch \
         does), or with optimize=False, so that the parameter stays an initialiser"
    )]
    FoldedParameter { path: String, parameter: String, value: String, reason: String },
    /// The IR refused a node (shapes or dtypes it cannot accept).
    #[error("node {node} ({op}): {source}")]
    Ir {
        node: String,
        op: String,
        #[source]
        source: Box<tessera_ir::IrError>,
    },
}

pub type Result<T, E = OnnxError> = std::result::Result<T, E>;
