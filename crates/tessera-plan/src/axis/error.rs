//! Typed config errors: what [`crate::config::ParallelConfig::validate`] and the axes' rules
//! return, by kind, so a caller can act on the kind (drop a knob, add the one it needs, pick
//! another value) and a user reads the message, which names the problem and the fix.

use std::fmt;

/// Why a config breaks a rule. Every variant carries the message a user sees (the problem
/// and the fix); the fields say what a program can act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigError {
    /// A degree or count of 0 (`knob`: the first one, e.g. `"dp"`).
    Zero { knob: &'static str, message: String },
    /// The degrees multiply past `usize`.
    Overflow { message: String },
    /// A value outside the knob's range (`zero4`, `sched=interleaved:1`, `shard=` not
    /// dividing dp, `stages=` of the wrong length).
    OutOfRange { knob: &'static str, message: String },
    /// A knob that needs another one written (`sp` needs tpN, `sched=` needs ppN): add
    /// `needs`.
    Requires { knob: &'static str, needs: &'static str, message: String },
    /// Two knobs that do not compose (yet): drop one of them.
    Unsupported { knob: &'static str, with: &'static str, message: String },
}

impl ConfigError {
    /// The knob the error is about (`"cp"`, `"sp"`, `"shard"`; `"degrees"` for an overflow).
    pub fn knob(&self) -> &'static str {
        match self {
            ConfigError::Zero { knob, .. }
            | ConfigError::OutOfRange { knob, .. }
            | ConfigError::Requires { knob, .. }
            | ConfigError::Unsupported { knob, .. } => knob,
            ConfigError::Overflow { .. } => "degrees",
        }
    }

    /// What a user reads.
    pub fn message(&self) -> &str {
        match self {
            ConfigError::Zero { message, .. }
            | ConfigError::Overflow { message }
            | ConfigError::OutOfRange { message, .. }
            | ConfigError::Requires { message, .. }
            | ConfigError::Unsupported { message, .. } => message,
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for ConfigError {}
