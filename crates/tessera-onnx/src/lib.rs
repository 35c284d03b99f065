//! Tessera's ONNX importer: a model written by `torch.onnx.export` (opset ≥ 13, 17 advised)
//! becomes a forward graph of the IR, its initialisers the parameters under their ONNX names.
//!
//! - [`OnnxModel::open`] reads and checks the file once ([`model`]): `onnx.checker`'s
//!   structural rules as far as the supported operators go — arity, each value written once,
//!   no cycle, a bounded depth ([`MAX_DEPTH`]), well-formed `perm`/`axes` — each refusal an
//!   [`OnnxError`] variant naming the node. [`OnnxModel::weights_f32`] refuses NaN or
//!   infinite initialisers by name.
//! - [`import`] binds the dynamic axes (`--batch`, `--seq`) and walks the graph from its
//!   outputs: shape arithmetic, masks and position tables fold into constants ([`consts`]),
//!   attention and rotary embeddings become the IR's fused ops ([`fuse`]), the rest maps
//!   operator by operator ([`lower`]; the list is [`SUPPORTED_OPS`]).
//! - An operator without a mapping is an [`OnnxError::UnsupportedOp`] naming it, its node and
//!   the nodes that read it.
//!
//! Invariant: this crate depends on the IR only (no tensor library): it builds graphs, the
//! runtime executes them.

mod attrs;
pub mod consts;
mod error;
mod fuse;
mod import;
mod lower;
pub mod model;
mod sign;
pub mod tensor;
mod torch_meta;
mod validate;
mod vision;

pub use error::{OnnxError, Result};
pub use import::{block_of, import, Bind, Imported, ImportedInput};
pub use lower::SUPPORTED_OPS;
pub use model::{Dim, OnnxModel, Port};
pub use tensor::Elem;
pub use validate::MAX_DEPTH;
