//! The crate's one error type. Every message names the problem and the fix.

use tessera_ir::IrError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    /// The config file is not valid JSON.
    #[error(
        "{path}:{line}:{column}: malformed JSON: {message}; fix the file (a Hugging Face \
         config.json is a single JSON object)"
    )]
    Json { path: String, line: usize, column: usize, message: String },

    /// `model_type` names an architecture this crate does not build.
    #[error(
        "model_type \"{found}\" is not supported; use a config whose model_type is one of: \
         {supported}"
    )]
    UnknownModelType { found: String, supported: String },

    /// A required field is absent (or null). `model_type` is empty when it is the one missing.
    #[error("{}", missing_field_message(.model_type, .field))]
    MissingField { model_type: String, field: String },

    /// A field has the wrong JSON type or a value that cannot describe a model.
    #[error("invalid `{field}`: {reason}")]
    Invalid { field: String, reason: String },

    /// `preset` / `resolve` got a name that is neither a preset nor an existing path.
    #[error(
        "unknown model \"{name}\": it is not a preset and no such file exists; use one of the \
         presets {presets}, or the path of a Hugging Face config.json (or of a directory \
         holding one)"
    )]
    UnknownPreset { name: String, presets: String },

    /// Reading a config file failed.
    #[error(
        "cannot read {path}: {source}; give the path of a config.json, or of a directory \
         holding one"
    )]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },

    /// A recognised setting with a value this crate does not implement.
    #[error("{what} \"{found}\" is not supported; supported: {supported}")]
    Unsupported { what: String, found: String, supported: String },

    /// The requested sequence does not fit a learned position table.
    #[error(
        "sequence length {seq} exceeds {model}'s learned position table ({field} = {max}); \
         use a sequence length of at most {max}"
    )]
    SequenceTooLong { seq: usize, max: usize, field: &'static str, model: String },

    /// The IR rejected a node. Configs are validated before building, so this is a bug in a
    /// model file, reported rather than panicking.
    #[error("building the graph failed: {0}")]
    Ir(#[from] IrError),

    /// An ONNX model that cannot be read or imported.
    #[error(transparent)]
    Onnx(#[from] tessera_onnx::OnnxError),
}

fn missing_field_message(model_type: &str, field: &str) -> String {
    if model_type.is_empty() {
        format!(
            "the config has no `{field}`; add one of: {}",
            crate::hf::SUPPORTED_MODEL_TYPES.join(", ")
        )
    } else {
        format!(
            "config for model_type \"{model_type}\" lacks the required field `{field}`; add it \
             (copy it from the model's Hugging Face config.json)"
        )
    }
}

impl ModelError {
    pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ModelError {
        ModelError::Invalid { field: field.into(), reason: reason.into() }
    }
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
