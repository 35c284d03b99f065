//! One level of an interconnect as an alpha-beta link (latency, bandwidth): what clusters,
//! meshes and memory tiers each describe their links with.

use crate::{PlanError, Result};
use serde::{Deserialize, Serialize};

/// One level of the interconnect, alpha-beta: a message of B bytes costs
/// `latency_s + B / bandwidth` per ring step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub latency_s: f64,
    /// Bytes per second each device can send (and receive) at once ("bus bandwidth").
    pub bandwidth: f64,
}

impl Link {
    /// `what` names the link in the error (`intra-node link`).
    pub fn validate(&self, what: &str) -> Result<()> {
        if !(self.latency_s.is_finite() && self.latency_s >= 0.0) {
            return Err(PlanError::Invalid(format!(
                "{what}: latency_s = {} must be a finite number of seconds >= 0, e.g. 5e-6",
                self.latency_s
            )));
        }
        if !(self.bandwidth.is_finite() && self.bandwidth > 0.0) {
            return Err(PlanError::Invalid(format!(
                "{what}: bandwidth = {} must be a positive number of bytes/s, e.g. 50e9",
                self.bandwidth
            )));
        }
        Ok(())
    }
}
