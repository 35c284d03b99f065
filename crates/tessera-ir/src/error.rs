//! The IR's one error type. Shape errors name the node's scope, the op and the shapes.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum IrError {
    /// An op was given inputs whose shapes/dtypes it cannot accept.
    #[error("{scope}: {op} {inputs}: {reason}")]
    Shape {
        scope: String,
        op: String,
        /// The input metas, e.g. `f32[4,128,768] x f32[3072,768]`.
        inputs: String,
        reason: String,
    },
    /// A graph-level problem (unknown tensor, non-scalar loss, ...).
    #[error("{0}")]
    Graph(String),
    /// A mesh position or placement that does not fit a mesh or a tensor ([`crate::dist`]).
    #[error("{0}")]
    Layout(String),
}

pub type Result<T, E = IrError> = std::result::Result<T, E>;
