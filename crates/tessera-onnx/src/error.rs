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
