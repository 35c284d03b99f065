//! The auto-parallel planner: given a training graph and a cluster, find how to split the step
//! across devices — fastest under a per-device memory budget — and lower that plan to one
//! Program per device.
//!
//! - [`cluster`]: device presets, cluster strings (`2x8xH100`) and files; [`units`]: sizes.
//! - [`mesh`]: logical N-D device meshes over a cluster, with a link (latency, bandwidth) per axis.
//! - [`spec`]: sharding specs (each dim over mesh axes, or a pending sum).
//! - [`reshard`]: cheapest path between two specs over collective moves, in seconds.
//! - [`config`]: the parallelism config-string grammar (`dp2 tp4 zero1 mb2 sp`).
//! - [`axis`]: the planner's axes behind one interface ([`axis::Axis`], [`axis::AXES`]): each
//!   axis's tokens, rules, mesh axes, search pins, `--explain` lines and export fields;
//!   [`context`] (`cpN`, all-to-all) is the context-parallel one.
//! - [`export`]: plans as Megatron-LM launches, DeepSpeed configs and torchtitan job files.
//! - [`ilp`]: the one-hot strategy ILP (HiGHS), with a brute-force oracle for tests.
//!
//! One time unit (seconds, f64) and one memory unit (bytes, u64) everywhere.

pub mod axis;
pub mod ckpt;
pub mod ckpt_dp;
pub mod cluster;
pub mod config;
pub mod cost;
pub mod explain;
pub mod export;
pub mod figures;
pub mod generate;
pub mod ilp;
pub mod link;
pub mod loss_chunk;
pub mod lower;
pub mod mesh;
pub mod mlp_tile;
pub mod offload;
pub mod par;
pub mod pipeline;
pub mod plan;
pub mod planner;
pub mod reshard;
pub mod rules;
pub mod search;
pub mod spec;
pub mod tiers;
pub mod trace;
pub mod units;

pub use axis::{context, expert, ConfigError};
pub use cluster::{Cluster, DeviceSpec};
pub use link::Link;
pub use mesh::{AxisLink, AxisName, Mesh};
pub use spec::Spec;

/// Everything that can go wrong while planning, each naming the problem and the fix.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// Bad user input: a cluster string, a config string, a size, a file.
    #[error("{0}")]
    Invalid(String),
    /// No plan fits the memory budget.
    #[error(
        "no plan fits in {budget} per device; the least any plan needs is {needed} per device \
         ({hint})",
        budget = units::format_bytes(*budget),
        needed = units::format_bytes(*needed)
    )]
    Infeasible { budget: u64, needed: u64, hint: String },
    /// An offloaded plan fits the device but not a tier below it (host memory, NVMe).
    #[error(
        "the plan needs {needed} of {tier} per device, which has {budget} ({hint})",
        tier = match tier { tessera_ir::Tier::Nvme => "NVMe", _ => "host memory" },
        budget = units::format_bytes(*budget),
        needed = units::format_bytes(*needed)
    )]
    TierInfeasible { tier: tessera_ir::Tier, budget: u64, needed: u64, hint: String },
    /// A config that breaks a rule, by kind ([`ConfigError`]); `config`: the string it was
    /// parsed from, quoted in the message.
    #[error("{}", match config {
        Some(c) => format!("config `{c}`: {error}"),
        None => error.to_string(),
    })]
    Config { config: Option<String>, error: ConfigError },
    /// An internal failure (the solver, a lowering that does not type-check).
    #[error("{0}")]
    Internal(String),
}

impl From<ConfigError> for PlanError {
    fn from(error: ConfigError) -> PlanError {
        PlanError::Config { config: None, error }
    }
}

pub type Result<T, E = PlanError> = std::result::Result<T, E>;
