//! The runtime's one error type. Messages name the problem and the fix.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum RuntimeError {
    /// The memory budget of a device would be exceeded.
    #[error(
        "out of memory on {device}: allocating {tensor} ({scope}, {bytes} bytes) would bring live \
         memory to {would_be} bytes, over the budget of {budget} bytes; raise the budget, lower \
         the batch or sequence length, or let the planner shard or checkpoint (`tessera plan`)"
    )]
    OutOfMemory {
        device: String,
        tensor: String,
        scope: String,
        bytes: u64,
        would_be: u64,
        budget: u64,
    },
    /// The machine cannot give a tensor's memory: the run would be killed by the kernel's OOM
    /// killer (or abort on a failed allocation) without a word.
    #[error(
        "out of host memory on {device}: {tensor} ({op}) needs {bytes} bytes but the machine \
         has {available} bytes available; free memory (other processes), or train with a \
         smaller --batch or --seq, fewer simulated devices or a smaller model"
    )]
    OutOfHostMemory { device: String, tensor: String, op: String, bytes: u64, available: u64 },
    /// A leaf was not bound, or bound to a value of the wrong shape or dtype.
    #[error("{0}")]
    Binding(String),
    /// The Program asked for something this backend cannot do (e.g. an unsupported dtype).
    #[error("{op} on {backend}: {reason}")]
    Unsupported { backend: String, op: String, reason: String },
    /// Bad data: unreadable file, empty corpus, out-of-range token id, ...
    #[error("{0}")]
    Data(String),
    /// A checkpoint that cannot be read or does not fit the model; names the file and tensors.
    #[error("{0}")]
    Checkpoint(String),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error(transparent)]
    Ir(#[from] tessera_ir::IrError),
    /// A collective failed: a timeout, a rank that died, a mismatched call (names them).
    #[error(transparent)]
    Comm(#[from] tessera_comm::CommError),
    #[error("tensor library: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
