//! Devices and clusters: device presets from vendor datasheets, the cluster-string grammar
//! (`8xH100`, `2x8xH200`, `4xRTX4090`, `4xcpu`), cluster files (`.toml` / `.json`) and the
//! calibrated CPU preset written by `tessera calibrate`.
//!
//! Figures are peak and dense (no 2:4 sparsity); what a kernel reaches is modelled by
//! [`DeviceSpec::matmul_efficiency`] and [`DeviceSpec::memory_efficiency`]. Link bandwidths are
//! *achieved* bus bandwidths (what nccl-tests reports as `busbw`), not the nominal line rate.
//! Seconds (f64) and bytes (u64) throughout.

pub use crate::link::Link;
use crate::tiers::{HostTier, NvmeTier};
use crate::units::format_bytes;
use crate::{PlanError, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use tessera_ir::DType;
use tessera_profile::kernels::KernelTable;

mod cpu;
mod file;
mod presets;

pub use cpu::{
    cpu_calibration, cpu_calibration_path, cpu_nvme, cpu_preset, CpuCalibration, DiskCalibration,
    CPU_PRESET_ENV,
};
pub(crate) use presets::known_devices;
pub use presets::{device_preset, interconnect_preset, DEVICE_NAMES};
use presets::{gpu_preset, is_cpu};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The two levels of a device family's interconnect.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Interconnect {
    /// Between devices of one node.
    pub intra: Link,
    /// Between nodes, per device.
    pub inter: Link,
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
    /// Fixed cost of launching one kernel, seconds.
    #[serde(default = "default_kernel_overhead_s")]
    pub kernel_overhead_s: f64,
    /// Fraction of the peak FLOP/s that large matmuls reach (0, 1].
    #[serde(default = "default_matmul_efficiency")]
    pub matmul_efficiency: f64,
    /// Fraction of the memory bandwidth that streaming kernels reach (0, 1].
    #[serde(default = "default_memory_efficiency")]
    pub memory_efficiency: f64,
    /// The runtime's own kernels as `tessera calibrate --device cuda` timed them: where an
    /// op's kind was measured, the cost model prices it by this table instead of the
    /// roofline above, and replays the host's issue of the step (see
    /// [`tessera_profile::kernels`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels: Option<KernelTable>,
}

/// Defaults for files written before these fields existed: typical GPU figures.
pub(crate) fn default_kernel_overhead_s() -> f64 {
    5e-6
}
pub(crate) fn default_matmul_efficiency() -> f64 {
    0.7
}
pub(crate) fn default_memory_efficiency() -> f64 {
    0.8
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
    /// FLOP/s a large matmul reaches: peak × `matmul_efficiency`.
    pub fn achieved_flops(&self, dtype: DType) -> f64 {
        self.peak_flops(dtype) * self.matmul_efficiency
    }
    /// Bytes/s a streaming kernel reaches: bandwidth × `memory_efficiency`.
    pub fn achieved_memory_bandwidth(&self) -> f64 {
        self.memory_bandwidth * self.memory_efficiency
    }

    /// Checks every figure is usable (positive, finite, efficiencies in (0, 1], the reserve
    /// below the memory).
    pub fn validate(&self) -> Result<()> {
        let name = &self.name;
        if name.trim().is_empty() {
            return Err(PlanError::Invalid(
                "a device needs a non-empty `name`, e.g. \"my-gpu\"".into(),
            ));
        }
        if self.memory_bytes == 0 {
            return Err(PlanError::Invalid(format!(
                "device `{name}`: memory_bytes is 0; give its memory, e.g. \"80GiB\""
            )));
        }
        if self.reserve_bytes >= self.memory_bytes {
            return Err(PlanError::Invalid(format!(
                "device `{name}`: the reserve ({}) leaves nothing of its {} memory; lower the \
                 reserve",
                format_bytes(self.reserve_bytes),
                format_bytes(self.memory_bytes)
            )));
        }
        for (field, v) in [
            ("fp32_flops", self.fp32_flops),
            ("bf16_flops", self.bf16_flops),
            ("fp16_flops", self.fp16_flops),
            ("memory_bandwidth", self.memory_bandwidth),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(PlanError::Invalid(format!(
                    "device `{name}`: {field} = {v} must be a positive finite number (per second)"
                )));
            }
        }
        if !(self.kernel_overhead_s.is_finite() && self.kernel_overhead_s >= 0.0) {
            return Err(PlanError::Invalid(format!(
                "device `{name}`: kernel_overhead_s = {} must be seconds >= 0, e.g. 5e-6",
                self.kernel_overhead_s
            )));
        }
        if let Some(k) = &self.kernels {
            k.validate().map_err(|e| {
                PlanError::Invalid(format!(
                    "device `{name}`: its measured kernels: {e}; measure the GPU again with \
                     `tessera calibrate --device cuda`"
                ))
            })?;
        }
        for (field, v) in [
            ("matmul_efficiency", self.matmul_efficiency),
            ("memory_efficiency", self.memory_efficiency),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(PlanError::Invalid(format!(
                    "device `{name}`: {field} = {v} must be a fraction in (0, 1], e.g. 0.7"
                )));
            }
        }
        Ok(())
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
    /// Each device's share of its host: memory, link and CPU optimizer (offload).
    #[serde(default = "default_host")]
    pub host: HostTier,
    /// Each device's share of the host's NVMe, when there is one to offload to.
    #[serde(default)]
    pub nvme: Option<NvmeTier>,
}

fn default_host() -> HostTier {
    HostTier::preset("", 1)
}

/// The most nodes a cluster may have: the planner's search grows with the device count, and
/// a count past these is a typo, not a machine (`99999999999xH100` ran for minutes).
pub const MAX_NODES: usize = 1 << 16;
/// The most devices one node may have (a single count, `256xH100`, is one node's).
pub const MAX_DEVICES_PER_NODE: usize = 1 << 12;
/// The most devices a cluster may have in all.
pub const MAX_DEVICES: usize = 1 << 16;

const GRAMMAR: &str = "write [NODES x] GPUS x DEVICE, e.g. 8xH100 or 2x8xH100, or a path to a \
                       .toml/.json cluster file";

impl Cluster {
    /// A checked cluster: at least one node and one device per node (at most [`MAX_NODES`]
    /// of at most [`MAX_DEVICES_PER_NODE`], [`MAX_DEVICES`] in all), a valid device and links.
    pub fn new(
        nodes: usize,
        gpus_per_node: usize,
        device: DeviceSpec,
        intra: Link,
        inter: Link,
    ) -> Result<Cluster> {
        if nodes == 0 {
            return Err(PlanError::Invalid("a cluster needs at least 1 node".into()));
        }
        if gpus_per_node == 0 {
            return Err(PlanError::Invalid("a cluster needs at least 1 device per node".into()));
        }
        if nodes > MAX_NODES || gpus_per_node > MAX_DEVICES_PER_NODE {
            return Err(PlanError::Invalid(format!(
                "a cluster of {nodes} node(s) × {gpus_per_node} device(s) per node is past what \
                 the planner searches (at most {MAX_NODES} nodes of at most \
                 {MAX_DEVICES_PER_NODE} devices): give smaller counts, e.g. 16x8xH100"
            )));
        }
        let total = nodes.saturating_mul(gpus_per_node);
        if total > MAX_DEVICES {
            return Err(PlanError::Invalid(format!(
                "a cluster of {nodes} nodes × {gpus_per_node} devices is {total} devices, past \
                 the {MAX_DEVICES} the planner searches: give smaller counts"
            )));
        }
        device.validate()?;
        intra.validate("intra-node link")?;
        inter.validate("inter-node link")?;
        let host = if is_cpu(&device.name) {
            // Simulated devices share this machine's memory: none is set aside for offload
            // unless asked (`--host-memory`).
            HostTier::cpu(0, intra, device.achieved_memory_bandwidth())
        } else {
            HostTier::preset(&device.name, gpus_per_node)
        };
        let nvme = NvmeTier::preset(&device.name, gpus_per_node);
        Ok(Cluster { nodes, gpus_per_node, device, intra, inter, host, nvme })
    }

    pub fn num_devices(&self) -> usize {
        self.nodes * self.gpus_per_node
    }

    /// `8xH100`, `2x8xH200`, `4xRTX4090`, `4xcpu` (spaces around `x` allowed), or a path to a
    /// `.toml` / `.json` cluster file (see [`Cluster::from_file`]).
    pub fn parse(s: &str) -> Result<Cluster> {
        let t = s.trim();
        let lower = t.to_ascii_lowercase();
        if lower.ends_with(".toml") || lower.ends_with(".json") {
            return Cluster::from_file(Path::new(t));
        }
        if t.is_empty() {
            return Err(PlanError::Invalid(format!("empty cluster string: {GRAMMAR}")));
        }
        let mut counts: Vec<usize> = Vec::new();
        let mut rest = t;
        loop {
            let r = rest.trim_start();
            let digits = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
            if digits == 0 {
                break;
            }
            let Some(after) = r[digits..].trim_start().strip_prefix(['x', 'X', '×']) else {
                break;
            };
            let n: usize = r[..digits].parse().map_err(|_| {
                PlanError::Invalid(format!(
                    "cluster `{s}`: the count `{}` is too large",
                    &r[..digits]
                ))
            })?;
            counts.push(n);
            rest = after;
        }
        let device_name = rest.trim();
        let (nodes, gpus_per_node) = match counts[..] {
            [] => {
                return Err(PlanError::Invalid(format!(
                    "cluster `{s}`: missing the device count; {GRAMMAR}"
                )))
            }
            [g] => (1, g),
            [n, g] => (n, g),
            _ => {
                return Err(PlanError::Invalid(format!(
                    "cluster `{s}` has {} counts; give at most two (nodes x GPUs per node), e.g. \
                     2x8xH100",
                    counts.len()
                )))
            }
        };
        if device_name.is_empty() {
            return Err(PlanError::Invalid(format!(
                "cluster `{s}`: missing the device after the count; {GRAMMAR} (devices: {})",
                known_devices()
            )));
        }
        if nodes == 0 {
            return Err(PlanError::Invalid(format!(
                "cluster `{s}`: 0 nodes; the node count must be at least 1"
            )));
        }
        if gpus_per_node == 0 {
            return Err(PlanError::Invalid(format!(
                "cluster `{s}`: 0 devices; the device count must be at least 1, e.g. 8xH100"
            )));
        }
        let (mut device, links, cal) = named_device(device_name)
            .map_err(|e| PlanError::Invalid(format!("cluster `{s}`: {e}")))?;
        if is_cpu(device_name) {
            // Simulated devices share this machine's memory: each gets its share at most.
            let share = host_memory_total().map(|m| cpu_share(m, gpus_per_node));
            device.memory_bytes = device.memory_bytes.min(share.unwrap_or(u64::MAX));
        }
        let cluster = Cluster::new(nodes, gpus_per_node, device, links.intra, links.inter)?;
        Ok(match &cal {
            Some(cal) => cluster.with_cpu_calibration(cal),
            None => cluster,
        })
    }

    /// Reads a cluster file, TOML or JSON by extension:
    ///
    /// ```toml
    /// nodes = 2               # optional, default 1
    /// gpus_per_node = 8
    /// device = "H100"         # a preset name, or a table with every DeviceSpec field
    /// reserve = "2GiB"        # optional: overrides the device's reserve
    /// [intra]                 # optional for presets, required for a custom device
    /// latency_s = 5e-6
    /// bandwidth = 360e9
    /// [inter]                 # likewise
    /// latency_s = 10e-6
    /// bandwidth = 40e9
    /// [host]                  # optional, per device; each key overrides the preset
    /// memory = "256GiB"       # host memory for offloaded state
    /// link = { latency_s = 10e-6, bandwidth = 50e9 }   # host <-> device copies
    /// memory_bandwidth = 77e9 # bytes/s
    /// adam_params_per_s = 5e8 # CPU AdamW throughput
    /// [nvme]                  # optional, per device: the NVMe tier below the host
    /// capacity = "1TiB"       # required unless the preset has an NVMe
    /// read_bandwidth = 6e9    # optional, bytes/s
    /// write_bandwidth = 5e9   # optional, bytes/s
    /// ```
    ///
    /// In a device table `memory_bytes` and `reserve_bytes` may be sizes (`"80GiB"`);
    /// `reserve_bytes`, `kernel_overhead_s`, `matmul_efficiency` and `memory_efficiency` are
    /// optional. Keys left out of `[host]` keep the device family's preset
    /// ([`HostTier::preset`], or for `cpu` this machine's calibration); so do keys left out
    /// of `[nvme]` ([`NvmeTier::preset`]). A device without a preset NVMe (a custom device,
    /// `cpu`) needs `capacity`; its bandwidths default to the calibrated disk's (`cpu`), else
    /// to [`NvmeTier::with_capacity`]'s.
    pub fn from_file(path: &Path) -> Result<Cluster> {
        file::from_file(path)
    }

    /// The same cluster with the measured host figures of `cal` (the CPU that simulated `cpu`
    /// devices run on): its AdamW throughput, when `tessera calibrate` measured one.
    pub(crate) fn with_cpu_calibration(mut self, cal: &CpuCalibration) -> Cluster {
        if let Some(rate) = cal.adam_params_per_s {
            self.host.adam_params_per_s = rate;
        }
        self
    }

    /// The same cluster with each device's host tier replaced.
    pub fn with_host(mut self, host: HostTier) -> Result<Cluster> {
        host.validate()?;
        self.host = host;
        Ok(self)
    }

    /// The same cluster with `bytes` of host memory per device for offloaded state.
    pub fn with_host_memory(mut self, bytes: u64) -> Cluster {
        self.host.memory_bytes = bytes;
        self
    }

    /// The same cluster with (or without) an NVMe tier per device.
    pub fn with_nvme(mut self, nvme: Option<NvmeTier>) -> Result<Cluster> {
        if let Some(n) = &nvme {
            n.validate()?;
        }
        self.nvme = nvme;
        Ok(self)
    }

    /// The same cluster with `bytes` held back per device.
    pub fn with_reserve(mut self, bytes: u64) -> Cluster {
        self.device.reserve_bytes = bytes;
        self
    }
}

/// The part of a machine of `total` bytes of memory each of `devices` simulated devices gets:
/// the machine less a tenth (the OS and the process: data, code, the planner) split evenly.
/// From the total, not what is free now, so that a plan does not change with the machine's
/// load; `tessera train` checks the plan's footprint against the free memory before step 1.
pub fn cpu_share(total: u64, devices: usize) -> u64 {
    (total - total / 10) / devices.max(1) as u64
}

/// This machine's memory (Linux `MemTotal`, capped by a cgroup v2 `memory.max`); `None`
/// where it cannot be read.
pub fn host_memory_total() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:"))?;
    let kib: u64 = line.trim().trim_end_matches("kB").trim().parse().ok()?;
    let limit = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok());
    Some(kib.saturating_mul(1024).min(limit.unwrap_or(u64::MAX)))
}

/// A preset device and its links; `cpu` reads the calibration, returned too (its host and disk
/// figures set the cluster's tiers).
pub(crate) fn named_device(
    name: &str,
) -> Result<(DeviceSpec, Interconnect, Option<CpuCalibration>)> {
    if is_cpu(name) {
        let cal = cpu_calibration()?;
        return Ok((cal.device.clone(), cal.interconnect(), Some(cal)));
    }
    match gpu_preset(name) {
        Some(p) => Ok((p.device(), p.links, None)),
        None => Err(PlanError::Invalid(format!(
            "unknown device `{name}`; known devices are {}, or describe it in a cluster file \
             (.toml/.json) with a device table",
            known_devices()
        ))),
    }
}

/// `2x8xH100`, or `8xH100` on one node (the device's name; a custom device prints its own).
impl fmt::Display for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.nodes > 1 {
            write!(f, "{}x", self.nodes)?;
        }
        write!(f, "{}x{}", self.gpus_per_node, self.device.name)
    }
}

impl FromStr for Cluster {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Cluster> {
        Cluster::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_valid_and_named() {
        for name in DEVICE_NAMES {
            let d = device_preset(name).expect(name);
            d.validate().expect(name);
            assert!(d.name.eq_ignore_ascii_case(name));
            let l = interconnect_preset(name).expect(name);
            l.intra.validate("intra").expect(name);
            l.inter.validate("inter").expect(name);
            assert!(l.intra.bandwidth > l.inter.bandwidth, "{name}");
        }
    }

    #[test]
    fn names_are_case_and_dash_insensitive() {
        assert_eq!(device_preset("a100_80g").unwrap().name, "A100-80G");
        assert_eq!(device_preset("RTX 4090").unwrap().name, "RTX4090");
        assert_eq!(device_preset("h100-sxm").unwrap().name, "H100");
        assert!(device_preset("A100").is_none(), "ambiguous: 40G or 80G");
    }

    #[test]
    fn builtin_cpu_round_trips_through_json() {
        let cal = CpuCalibration::builtin();
        let back: CpuCalibration =
            serde_json::from_str(&serde_json::to_string(&cal).unwrap()).unwrap();
        assert_eq!(back, cal);
    }

    #[test]
    fn older_device_json_gets_defaults() {
        let d: DeviceSpec = serde_json::from_str(
            r#"{"name":"x","memory_bytes":1024,"reserve_bytes":0,"fp32_flops":1.0,
                "bf16_flops":1.0,"fp16_flops":1.0,"memory_bandwidth":1.0}"#,
        )
        .unwrap();
        assert_eq!(d.kernel_overhead_s, 5e-6);
        assert_eq!(d.matmul_efficiency, 0.7);
        assert_eq!(d.memory_efficiency, 0.8);
    }
}
