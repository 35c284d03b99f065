//! Devices and clusters. (Skeleton: the full preset table, cluster-string grammar and files
//! are being written.)

use crate::Result;
use serde::{Deserialize, Serialize};
use tessera_ir::DType;

/// One level of the interconnect, alpha-beta: a message of B bytes costs
/// `latency_s + B / bandwidth` per ring step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub latency_s: f64,
    /// Bytes per second each device can send (and receive) at once ("bus bandwidth").
    pub bandwidth: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceSpec {
    pub name: String,
    /// Physical memory, bytes.
    pub memory_bytes: u64,
    /// Held back for the runtime context (CUDA context, allocator slack), bytes.
    pub reserve_bytes: u64,
    /// Peak dense FLOP/s by dtype.
    pub fp32_flops: f64,
    pub bf16_flops: f64,
    pub fp16_flops: f64,
    /// Memory bandwidth, bytes/s.
    pub memory_bandwidth: f64,
}

impl DeviceSpec {
    pub fn peak_flops(&self, dtype: DType) -> f64 {
        match dtype {
            DType::BF16 => self.bf16_flops,
            DType::F16 => self.fp16_flops,
            _ => self.fp32_flops,
        }
    }
    /// Memory a plan may use: capacity minus the reserve.
    pub fn usable_bytes(&self) -> u64 {
        self.memory_bytes.saturating_sub(self.reserve_bytes)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub nodes: usize,
    pub gpus_per_node: usize,
    pub device: DeviceSpec,
    /// Between devices of one node.
    pub intra: Link,
    /// Between nodes.
    pub inter: Link,
}

impl Cluster {
    pub fn num_devices(&self) -> usize {
        self.nodes * self.gpus_per_node
    }
    /// `8xH100`, `2x8xH200`, or a path to a `.toml` / `.json` cluster file.
    pub fn parse(_s: &str) -> Result<Cluster> {
        unimplemented!("being written")
    }
}
