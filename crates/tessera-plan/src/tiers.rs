//! The memory tiers below a device: its share of the host's memory (with the host↔device link
//! and the CPU that runs the optimizer of offloaded chunks) and, optionally, of the host's NVMe.
//!
//! Figures are per device: a node's host memory, memory bandwidth and optimizer throughput are
//! split evenly among its GPUs; each GPU has its own PCIe link. Presets carry their sources;
//! cluster files and the `--host-memory` / `--nvme-size` flags override them.

use crate::link::Link;
use crate::units::format_bytes;
use crate::{PlanError, Result};
use serde::{Deserialize, Serialize};

const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// One device's share of its host: memory, the link to it, and the CPU that runs offloaded
/// optimizer steps.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostTier {
    /// Host memory a plan may use for this device's offloaded state, bytes.
    pub memory_bytes: u64,
    /// Host↔device copies (each direction has this bandwidth; PCIe is full duplex).
    pub link: Link,
    /// Host memory bandwidth available to this device's host work, bytes/s (prices the host
    /// op's other than AdamW: gradient-norm terms, casts, fills).
    pub memory_bandwidth: f64,
    /// Parameters per second the host's AdamW updates for this device (fused CPU AdamW, fp32
    /// state).
    pub adam_params_per_s: f64,
}

/// One device's share of the host's NVMe: capacity and sequential bandwidths.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct NvmeTier {
    pub capacity_bytes: u64,
    /// Bytes/s read into host memory.
    pub read_bandwidth: f64,
    /// Bytes/s written from host memory.
    pub write_bandwidth: f64,
}

/// PCIe 5.0 x16 (H100/H200 SXM hosts): 64 GB/s per direction nominal; `bandwidthTest` with
/// pinned memory reports ~50–55 GB/s. We model 50 GB/s, 10 µs per copy.
const PCIE5: Link = Link { latency_s: 10e-6, bandwidth: 50e9 };
/// PCIe 3.0 x16 (V100 hosts): 16 GB/s nominal, ~12 GB/s pinned.
const PCIE3: Link = Link { latency_s: 10e-6, bandwidth: 12e9 };
/// PCIe 4.0 x16 (A100 hosts, RTX 3060/3080/4090): 32 GB/s nominal, ~25 GB/s pinned.
const PCIE4: Link = Link { latency_s: 10e-6, bandwidth: 25e9 };

/// Fused CPU AdamW on a two-socket data-centre host: ZeRO-Offload (Ren et al., USENIX ATC
/// 2021, its CPU-Adam latency table) updates a billion parameters in about 0.2 s on its
/// DGX-2 host, ≈ 4.5e9 parameters/s per node (our reading of the table; `tessera calibrate`
/// measures a machine's own).
const SERVER_ADAM_PARAMS_PER_S: f64 = 4.5e9;
/// A desktop CPU (8–16 cores, two DDR4/DDR5 channels ≈ 50–80 GB/s): AdamW touches ~30 bytes
/// per parameter (fp32 master, moments and gradient read and written, the half-precision
/// weight written), so memory bounds it near 2e9/s; we model 1.5e9.
const DESKTOP_ADAM_PARAMS_PER_S: f64 = 1.5e9;

impl HostTier {
    /// The host tier of a preset device family, per device of a node of `gpus_per_node`:
    /// DGX H100/H200 (2 TiB, 2 × 8-channel DDR5-4800 ≈ 614 GB/s, PCIe 5.0), DGX A100 (1 TiB,
    /// 2 × 8-channel DDR4-3200 ≈ 410 GB/s, PCIe 4.0), a GeForce desktop (32 GiB, two channels
    /// ≈ 60 GB/s, PCIe 4.0, not shared: one such host per GPU).
    pub fn preset(device: &str, gpus_per_node: usize) -> HostTier {
        let share = gpus_per_node.max(1) as f64;
        let server = |memory: u64, link: Link, bandwidth: f64| HostTier {
            memory_bytes: memory / gpus_per_node.max(1) as u64,
            link,
            memory_bandwidth: bandwidth / share,
            adam_params_per_s: SERVER_ADAM_PARAMS_PER_S / share,
        };
        match device {
            "H100" | "H200" => server(2 * TIB, PCIE5, 614e9),
            "A100-40G" | "A100-80G" => server(TIB, PCIE4, 410e9),
            // DGX-2: 1.5 TB for 16 V100s, 2 × Xeon Platinum 8168 (6-channel DDR4-2666,
            // ≈ 256 GB/s), PCIe 3.0 x16 (16 GB/s nominal, ~12 GB/s pinned) — the machine of
            // ZeRO-Offload's single-GPU runs.
            "V100" => HostTier {
                memory_bytes: 1536 * GIB / gpus_per_node.max(1) as u64,
                link: PCIE3,
                memory_bandwidth: 256e9 / share,
                adam_params_per_s: SERVER_ADAM_PARAMS_PER_S / share,
            },
            _ => HostTier {
                memory_bytes: 32 * GIB,
                link: PCIE4,
                memory_bandwidth: 60e9,
                adam_params_per_s: DESKTOP_ADAM_PARAMS_PER_S,
            },
        }
    }

    /// Simulated CPU devices: the "host" is the same memory, a copy runs at the machine's
    /// memcpy speed (`copy`), and the optimizer at `adam_params_per_s`.
    pub fn cpu(memory_bytes: u64, copy: Link, memory_bandwidth: f64) -> HostTier {
        HostTier {
            memory_bytes,
            link: copy,
            memory_bandwidth,
            // ~30 bytes touched per parameter (see DESKTOP_ADAM_PARAMS_PER_S).
            adam_params_per_s: memory_bandwidth / 30.0,
        }
    }

    pub fn validate(&self) -> Result<()> {
        self.link.validate("host link")?;
        for (field, v) in [
            ("host memory_bandwidth", self.memory_bandwidth),
            ("host adam_params_per_s", self.adam_params_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(PlanError::Invalid(format!(
                    "{field} = {v} must be a positive finite number (per second)"
                )));
            }
        }
        Ok(())
    }
}

impl NvmeTier {
    /// A PCIe 4.0 NVMe SSD of `capacity_bytes`: Samsung 990 PRO datasheet, 7,450 MB/s
    /// sequential read and 6,900 MB/s write; we model what large asynchronous transfers reach,
    /// 6 GB/s read and 5 GB/s write.
    pub fn with_capacity(capacity_bytes: u64) -> NvmeTier {
        NvmeTier { capacity_bytes, read_bandwidth: 6e9, write_bandwidth: 5e9 }
    }

    /// The NVMe of a preset device family's host, per device: DGX H100/H200 datasheets, 8 ×
    /// 3.84 TB U.2 NVMe data drives per node (one per GPU; a PM1733-class drive reads
    /// 7 GB/s and writes 3.8 GB/s sequentially, we model 6 and 3.5); DGX A100, 4 × 3.84 TB
    /// per node (1.92 TB per GPU); a GeForce desktop, one 1 TB PCIe 4.0 drive
    /// ([`NvmeTier::with_capacity`]). `None` for unknown devices and simulated cpu devices.
    pub fn preset(device: &str, gpus_per_node: usize) -> Option<NvmeTier> {
        let dc = |per_node: u64| NvmeTier {
            capacity_bytes: per_node / gpus_per_node.max(1) as u64,
            read_bandwidth: 6e9 * (per_node as f64 / 3.84e12) / gpus_per_node.max(1) as f64,
            write_bandwidth: 3.5e9 * (per_node as f64 / 3.84e12) / gpus_per_node.max(1) as f64,
        };
        match device {
            "H100" | "H200" => Some(dc(8 * 3_840_000_000_000)),
            "A100-40G" | "A100-80G" => Some(dc(4 * 3_840_000_000_000)),
            // DGX-2: 8 × 3.84 TB NVMe per 16 GPUs.
            "V100" => Some(dc(8 * 3_840_000_000_000)),
            "RTX3050" | "RTX3060" | "RTX3080" | "RTX4090" => {
                Some(NvmeTier::with_capacity(1_000_000_000_000))
            }
            _ => None,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.capacity_bytes == 0 {
            return Err(PlanError::Invalid(
                "the NVMe tier has 0 bytes; give its size, e.g. --nvme-size 1TB".into(),
            ));
        }
        for (field, v) in [
            ("nvme read_bandwidth", self.read_bandwidth),
            ("nvme write_bandwidth", self.write_bandwidth),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(PlanError::Invalid(format!(
                    "{field} = {v} must be a positive finite number of bytes/s, e.g. 5e9"
                )));
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for HostTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} host memory, {:.0} GB/s link, {:.1}e9 AdamW params/s",
            format_bytes(self.memory_bytes),
            self.link.bandwidth / 1e9,
            self.adam_params_per_s / 1e9
        )
    }
}
