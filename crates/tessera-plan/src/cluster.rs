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
use std::path::{Path, PathBuf};
use std::str::FromStr;
use tessera_ir::DType;
use tessera_profile::kernels::KernelTable;

mod file;

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

/// The preset names [`device_preset`] and the cluster strings accept (case-insensitive; `-`,
/// `_` and spaces are ignored, so `a100_80g` and `RTX 4090` work too).
pub const DEVICE_NAMES: &[&str] = &[
    "H100", "H200", "A100-40G", "A100-80G", "V100", "RTX3050", "RTX3060", "RTX3080", "RTX4090",
    "A6000", "cpu",
];

/// A GPU preset: datasheet figures plus the family's interconnect.
struct GpuPreset {
    name: &'static str,
    /// Accepted spellings after normalisation (lowercase, no `-`, `_`, spaces).
    keys: &'static [&'static str],
    /// As `nvidia-smi` reports it.
    memory_mib: u64,
    fp32_flops: f64,
    bf16_flops: f64,
    fp16_flops: f64,
    memory_bandwidth: f64,
    matmul_efficiency: f64,
    links: Interconnect,
}

/// NVLink 4 (H100/H200 SXM): 18 links × 25 GB/s = 450 GB/s per direction. nccl-tests
/// all-reduce on a DGX H100 reports a bus bandwidth of about 360–480 GB/s; we model 360 GB/s.
/// Between nodes: 8 × 400 Gb/s InfiniBand NDR per node (one ConnectX-7 per GPU) = 50 GB/s per
/// GPU nominal, 40 GB/s achieved.
const HOPPER_LINKS: Interconnect = Interconnect {
    intra: Link { latency_s: 5e-6, bandwidth: 360e9 },
    inter: Link { latency_s: 10e-6, bandwidth: 40e9 },
};
/// NVLink 3 (A100 SXM): 12 links × 25 GB/s = 300 GB/s per direction; we model 240 GB/s
/// achieved. Between nodes: a DGX A100 has 8 × 200 Gb/s InfiniBand HDR (one ConnectX-6 per
/// GPU) = 25 GB/s per GPU nominal, 20 GB/s achieved (not the 400 Gb/s of Hopper-era nodes).
const AMPERE_LINKS: Interconnect = Interconnect {
    intra: Link { latency_s: 5e-6, bandwidth: 240e9 },
    inter: Link { latency_s: 10e-6, bandwidth: 20e9 },
};
/// NVLink 2 through the DGX-2's NVSwitches (V100 SXM3): 6 links × 25 GB/s = 150 GB/s per
/// direction; we model 120 GB/s achieved. Between nodes: 8 × 100 Gb/s InfiniBand EDR per
/// 16-GPU DGX-2 = 6.25 GB/s per GPU nominal, 5 GB/s achieved.
const VOLTA_LINKS: Interconnect = Interconnect {
    intra: Link { latency_s: 5e-6, bandwidth: 120e9 },
    inter: Link { latency_s: 10e-6, bandwidth: 5e9 },
};
/// GeForce cards talk over PCIe 4.0 x16 (32 GB/s per direction nominal, ~20 GB/s achieved
/// through the host bridge, no NVLink). Between nodes: 100 Gb/s Ethernet = 12.5 GB/s per node,
/// ~10 GB/s achieved, shared by 8 GPUs ≈ 1.2 GB/s per GPU.
const GEFORCE_LINKS: Interconnect = Interconnect {
    intra: Link { latency_s: 10e-6, bandwidth: 20e9 },
    inter: Link { latency_s: 30e-6, bandwidth: 1.2e9 },
};

/// Datasheet figures, dense (no sparsity). `fp32_flops` of data-centre parts is dense TF32
/// tensor-core throughput (what fp32 matmuls run at with TF32 enabled); of GeForce parts it is
/// the non-tensor FP32 rate. GeForce bf16/fp16 figures are tensor-core rates with FP32
/// accumulation (half the FP16-accumulate rate on the 3060/3080/4090).
const GPU_PRESETS: &[GpuPreset] = &[
    // NVIDIA H100 Tensor Core GPU datasheet, SXM5 80 GB: BF16/FP16 1,979 TFLOPS with sparsity →
    // 989.4 dense; TF32 989 with sparsity → 494.7 dense; HBM3 3.35 TB/s. 81,559 MiB usable as
    // reported by nvidia-smi.
    GpuPreset {
        name: "H100",
        keys: &["h100", "h100sxm", "h100sxm5", "h10080g", "h10080gb"],
        memory_mib: 81_559,
        fp32_flops: 494.7e12,
        bf16_flops: 989.4e12,
        fp16_flops: 989.4e12,
        memory_bandwidth: 3.35e12,
        matmul_efficiency: HOPPER_MATMUL_EFFICIENCY,
        links: HOPPER_LINKS,
    },
    // NVIDIA H200 datasheet, SXM 141 GB: same tensor cores as H100 SXM; HBM3e 4.8 TB/s.
    // 143,771 MiB as reported by nvidia-smi.
    GpuPreset {
        name: "H200",
        keys: &["h200", "h200sxm", "h200141g", "h200141gb"],
        memory_mib: 143_771,
        fp32_flops: 494.7e12,
        bf16_flops: 989.4e12,
        fp16_flops: 989.4e12,
        memory_bandwidth: 4.8e12,
        matmul_efficiency: HOPPER_MATMUL_EFFICIENCY,
        links: HOPPER_LINKS,
    },
    // NVIDIA A100 Tensor Core GPU datasheet / Ampere architecture whitepaper, 40 GB SXM:
    // BF16/FP16 312 TFLOPS dense, TF32 156 dense; HBM2 1,555 GB/s.
    GpuPreset {
        name: "A100-40G",
        keys: &["a10040g", "a10040gb", "a100sxm40g", "a100sxm40gb"],
        memory_mib: 40_960,
        fp32_flops: 156e12,
        bf16_flops: 312e12,
        fp16_flops: 312e12,
        memory_bandwidth: 1.555e12,
        matmul_efficiency: AMPERE_MATMUL_EFFICIENCY,
        links: AMPERE_LINKS,
    },
    // NVIDIA A100 datasheet, 80 GB SXM: same FLOPs as 40 GB; HBM2e 2,039 GB/s.
    GpuPreset {
        name: "A100-80G",
        keys: &["a10080g", "a10080gb", "a100sxm80g", "a100sxm80gb"],
        memory_mib: 81_920,
        fp32_flops: 156e12,
        bf16_flops: 312e12,
        fp16_flops: 312e12,
        memory_bandwidth: 2.039e12,
        matmul_efficiency: AMPERE_MATMUL_EFFICIENCY,
        links: AMPERE_LINKS,
    },
    // NVIDIA Tesla V100 datasheet, SXM2/SXM3 32 GB (the DGX-2's, ZeRO-Offload's GPU): FP16
    // tensor 125 TFLOPS with FP32 accumulate, FP32 15.7 TFLOPS, HBM2 900 GB/s. No bf16 tensor
    // cores: bf16 runs at the FP32 rate (train it in fp16). 32,510 MiB as nvidia-smi reports
    // a V100-SXM2-32GB.
    GpuPreset {
        name: "V100",
        keys: &["v100", "v10032g", "v10032gb", "v100sxm", "v100sxm2", "v100sxm3"],
        memory_mib: 32_510,
        fp32_flops: 15.7e12,
        bf16_flops: 15.7e12,
        fp16_flops: 125e12,
        memory_bandwidth: 900e9,
        matmul_efficiency: VOLTA_MATMUL_EFFICIENCY,
        links: VOLTA_LINKS,
    },
    // NVIDIA GeForce RTX 3050 (desktop, 8 GB, GA106; the 8 GB card of Colossal-AI's Stable
    // Diffusion fine-tuning blog): NVIDIA's specifications page, 2,560 CUDA cores (20 SMs) at
    // 1.78 GHz boost, FP32 9.1 TFLOPS; 8 GB GDDR6 at 14 Gbps on 128 bits, 224 GB/s. Tensor
    // rate from the GA102 whitepaper's per-SM figure (1,024 dense FP16 FLOPs per SM per clock
    // with FP16 accumulate, half with FP32): 36.4 dense, 18.2 with FP32 accumulate.
    GpuPreset {
        name: "RTX3050",
        keys: &["rtx3050", "3050", "rtx30508g", "rtx30508gb"],
        memory_mib: 8_192,
        fp32_flops: 9.1e12,
        bf16_flops: 18.2e12,
        fp16_flops: 18.2e12,
        memory_bandwidth: 224e9,
        matmul_efficiency: GEFORCE_MATMUL_EFFICIENCY,
        links: GEFORCE_LINKS,
    },
    // NVIDIA Ampere GA102 whitepaper (GA106 figures), RTX 3060 12 GB: FP16/BF16 tensor
    // 51.2 TFLOPS dense with FP16 accumulate, 25.6 with FP32 accumulate; FP32 12.7; 360 GB/s.
    GpuPreset {
        name: "RTX3060",
        keys: &["rtx3060", "3060", "rtx306012g", "rtx306012gb"],
        memory_mib: 12_288,
        fp32_flops: 12.7e12,
        bf16_flops: 25.6e12,
        fp16_flops: 25.6e12,
        memory_bandwidth: 360e9,
        matmul_efficiency: GEFORCE_MATMUL_EFFICIENCY,
        links: GEFORCE_LINKS,
    },
    // NVIDIA Ampere GA102 whitepaper, RTX 3080 10 GB: FP16/BF16 tensor 59.5 TFLOPS dense with
    // FP32 accumulate; FP32 29.8; GDDR6X 760 GB/s.
    GpuPreset {
        name: "RTX3080",
        keys: &["rtx3080", "3080", "rtx308010g", "rtx308010gb"],
        memory_mib: 10_240,
        fp32_flops: 29.8e12,
        bf16_flops: 59.5e12,
        fp16_flops: 59.5e12,
        memory_bandwidth: 760e9,
        matmul_efficiency: GEFORCE_MATMUL_EFFICIENCY,
        links: GEFORCE_LINKS,
    },
    // NVIDIA Ada Lovelace architecture whitepaper, RTX 4090 24 GB: FP16/BF16 tensor
    // 165.2 TFLOPS dense with FP32 accumulate; FP32 82.6; GDDR6X 1,008 GB/s. 24,564 MiB as
    // reported by nvidia-smi.
    GpuPreset {
        name: "RTX4090",
        keys: &["rtx4090", "4090", "rtx409024g", "rtx409024gb"],
        memory_mib: 24_564,
        fp32_flops: 82.6e12,
        bf16_flops: 165.2e12,
        fp16_flops: 165.2e12,
        memory_bandwidth: 1.008e12,
        matmul_efficiency: GEFORCE_MATMUL_EFFICIENCY,
        links: GEFORCE_LINKS,
    },
    // NVIDIA RTX A6000 datasheet (GA102, 48 GB GDDR6 with ECC): tensor 309.7 TFLOPS with
    // sparsity → 154.8 dense (workstation parts run FP32 accumulate at the full rate); FP32
    // 38.7; 768 GB/s; PCIe 4.0 x16 (the optional NVLink bridge is not modelled). 49,140 MiB as
    // reported by nvidia-smi. The QLoRA paper's 48 GB GPU (65B on one card).
    GpuPreset {
        name: "A6000",
        keys: &["a6000", "rtxa6000", "a600048g", "a600048gb", "rtxa600048gb"],
        memory_mib: 49_140,
        fp32_flops: 38.7e12,
        bf16_flops: 154.8e12,
        fp16_flops: 154.8e12,
        memory_bandwidth: 768e9,
        matmul_efficiency: GEFORCE_MATMUL_EFFICIENCY,
        links: GEFORCE_LINKS,
    },
];

/// Share of the dense bf16 peak that a large matmul reaches, measured: the "Maximum Achievable
/// Matmul FLOPS" table of Stas Bekman's *Machine Learning Engineering* (github.com/stas00/
/// ml-engineering, compute/accelerator/README.md; best shape over a sweep, torch 2.6/2.7):
/// H100 SXM 794.5 of 989 TFLOPS (80.3%), A100 SXM 271.2 of 312 (86.9%). Training matmuls are
/// not all of the best shape; the per-kernel overhead and the roofline's memory bound cover
/// part of that, the rest is the error BENCHMARKS.md measures against published runs.
const HOPPER_MATMUL_EFFICIENCY: f64 = 0.80;
const AMPERE_MATMUL_EFFICIENCY: f64 = 0.87;
/// V100: cuBLAS fp16 GEMMs reach about 100–110 of 125 TFLOPS on large shapes (NVIDIA's
/// published DGX-1/DGX-2 GEMM figures); we use 0.8.
const VOLTA_MATMUL_EFFICIENCY: f64 = 0.8;
/// No measurement found for GeForce parts: an estimate below the data-centre figures (smaller
/// caches, clocks that drop under sustained tensor load).
const GEFORCE_MATMUL_EFFICIENCY: f64 = 0.7;

/// Every GPU preset holds back 1 GiB for the CUDA context and allocator slack.
const GPU_RESERVE_BYTES: u64 = GIB;
/// CUDA kernel launch overhead, seconds (a few µs per launch).
const GPU_KERNEL_OVERHEAD_S: f64 = 5e-6;
/// Streaming kernels reach about 80% of the datasheet memory bandwidth.
const MEMORY_EFFICIENCY: f64 = 0.8;

/// Between CPU "devices" on different hosts: ~1 GB/s, 50 µs (commodity Ethernet, TCP).
const CPU_INTER: Link = Link { latency_s: 50e-6, bandwidth: 1e9 };
/// Between threads of one host when no calibration exists: a copy through shared memory.
const CPU_INTRA_DEFAULT: Link = Link { latency_s: 2e-6, bandwidth: 5e9 };

fn normalize(name: &str) -> String {
    name.chars().filter(|c| !matches!(c, '-' | '_' | ' ')).collect::<String>().to_lowercase()
}

fn gpu_preset(name: &str) -> Option<&'static GpuPreset> {
    let key = normalize(name);
    GPU_PRESETS.iter().find(|p| p.keys.contains(&key.as_str()))
}

fn is_cpu(name: &str) -> bool {
    normalize(name) == "cpu"
}

impl GpuPreset {
    fn device(&self) -> DeviceSpec {
        DeviceSpec {
            name: self.name.to_string(),
            memory_bytes: self.memory_mib * MIB,
            reserve_bytes: GPU_RESERVE_BYTES,
            fp32_flops: self.fp32_flops,
            bf16_flops: self.bf16_flops,
            fp16_flops: self.fp16_flops,
            memory_bandwidth: self.memory_bandwidth,
            kernel_overhead_s: GPU_KERNEL_OVERHEAD_S,
            matmul_efficiency: self.matmul_efficiency,
            memory_efficiency: MEMORY_EFFICIENCY,
            kernels: None,
        }
    }
}

/// A preset device by name (see [`DEVICE_NAMES`]), or `None`. `cpu` gives the built-in CPU
/// figures; [`cpu_preset`] prefers this machine's calibration.
pub fn device_preset(name: &str) -> Option<DeviceSpec> {
    if is_cpu(name) {
        return Some(CpuCalibration::builtin().device);
    }
    gpu_preset(name).map(GpuPreset::device)
}

/// A preset device family's interconnect, or `None`. `cpu` gives the built-in figures;
/// [`cpu_calibration`] prefers this machine's measured thread-to-thread bandwidth.
pub fn interconnect_preset(name: &str) -> Option<Interconnect> {
    if is_cpu(name) {
        return Some(CpuCalibration::builtin().interconnect());
    }
    gpu_preset(name).map(|p| p.links)
}

pub(crate) fn known_devices() -> String {
    DEVICE_NAMES.join(", ")
}

/// Environment variable naming the CPU calibration file (overrides the default path).
pub const CPU_PRESET_ENV: &str = "TESSERA_CPU_PRESET";

/// This machine's CPU as `tessera calibrate` measured it, stored as JSON:
/// `{"version": 1, "device": {DeviceSpec}, "intra": {"latency_s", "bandwidth"},
/// "adam_params_per_s": f64, "disk": {"dir", "read_bandwidth", "write_bandwidth"}}`, where
/// `intra` is the thread-to-thread copy bandwidth. `adam_params_per_s` and `disk` are optional
/// (files of older builds lack them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuCalibration {
    pub version: u32,
    pub device: DeviceSpec,
    pub intra: Link,
    /// Parameters per second our AdamW kernel updates on all threads (fp32 parameter,
    /// gradient and moments): the host tier's optimizer throughput of `cpu` devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adam_params_per_s: Option<f64>,
    /// Sequential bandwidths of the disk under the offload directory: the NVMe tier of `cpu`
    /// devices (see [`cpu_nvme`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskCalibration>,
}

/// A disk's measured sequential bandwidths, bytes/s (a 256 MiB file written, synced and read
/// back uncached).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskCalibration {
    /// The directory the file was written in.
    pub dir: PathBuf,
    pub read_bandwidth: f64,
    pub write_bandwidth: f64,
}

impl CpuCalibration {
    pub const VERSION: u32 = 1;

    /// Figures measured on a 2-core x86 machine: gemm peaks near 200 GFLOP/s on 2 cores, we
    /// use 150 GFLOP/s for every dtype (CPU kernels compute in f32); 10 GB/s memory bandwidth;
    /// 16 GiB of memory, no reserve.
    pub fn builtin() -> CpuCalibration {
        CpuCalibration {
            version: Self::VERSION,
            device: DeviceSpec {
                name: "cpu".into(),
                memory_bytes: 16 * GIB,
                reserve_bytes: 0,
                fp32_flops: 150e9,
                bf16_flops: 150e9,
                fp16_flops: 150e9,
                memory_bandwidth: 10e9,
                kernel_overhead_s: 1e-6,
                matmul_efficiency: 0.8,
                memory_efficiency: MEMORY_EFFICIENCY,
                kernels: None,
            },
            intra: CPU_INTRA_DEFAULT,
            adam_params_per_s: None,
            disk: None,
        }
    }

    /// An NVMe tier of `capacity_bytes` at the calibrated disk's bandwidths, or at
    /// [`NvmeTier::with_capacity`]'s when the disk was not measured.
    pub fn nvme(&self, capacity_bytes: u64) -> NvmeTier {
        match &self.disk {
            Some(d) => NvmeTier {
                capacity_bytes,
                read_bandwidth: d.read_bandwidth,
                write_bandwidth: d.write_bandwidth,
            },
            None => NvmeTier::with_capacity(capacity_bytes),
        }
    }

    /// Checks every figure is usable: the device, the link, and the optional host figures
    /// positive and finite.
    pub fn validate(&self) -> Result<()> {
        self.device.validate()?;
        self.intra.validate("intra-node link")?;
        let mut rates = vec![("adam_params_per_s", self.adam_params_per_s)];
        if let Some(d) = &self.disk {
            rates.push(("disk.read_bandwidth", Some(d.read_bandwidth)));
            rates.push(("disk.write_bandwidth", Some(d.write_bandwidth)));
        }
        for (field, v) in rates {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(PlanError::Invalid(format!(
                    "{field} = {v} must be a positive finite number (per second)"
                )));
            }
        }
        Ok(())
    }

    pub fn interconnect(&self) -> Interconnect {
        Interconnect { intra: self.intra, inter: CPU_INTER }
    }

    /// Reads and checks a calibration file.
    pub fn load(path: &Path) -> Result<CpuCalibration> {
        let p = path.display();
        let fix = "rerun `tessera calibrate` to rewrite it, or delete it to use the built-in CPU \
                   figures";
        let text = std::fs::read_to_string(path).map_err(|e| {
            PlanError::Invalid(format!("cannot read CPU calibration file `{p}`: {e}; {fix}"))
        })?;
        let cal: CpuCalibration = serde_json::from_str(&text).map_err(|e| {
            PlanError::Invalid(format!("CPU calibration file `{p}` is malformed: {e}; {fix}"))
        })?;
        if cal.version != Self::VERSION {
            return Err(PlanError::Invalid(format!(
                "CPU calibration file `{p}` has version {}, this build reads version {}; {fix}",
                cal.version,
                Self::VERSION
            )));
        }
        cal.validate()
            .map_err(|e| PlanError::Invalid(format!("CPU calibration file `{p}`: {e}; {fix}")))?;
        Ok(cal)
    }

    /// Writes the calibration atomically (a temporary file renamed over `path`), creating the
    /// parent directories.
    pub fn save(&self, path: &Path) -> Result<()> {
        let p = path.display();
        let io = |what: &str, e: std::io::Error| {
            PlanError::Invalid(format!(
                "cannot {what} `{p}`: {e}; check the directory is writable or choose another path"
            ))
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| io("create the directory of", e))?;
        }
        let json = serde_json::to_string_pretty(self)
            .map_err(|e| PlanError::Internal(format!("serialising the CPU calibration: {e}")))?;
        let file_name = path
            .file_name()
            .map_or_else(|| "cpu.json".into(), |n| n.to_string_lossy().into_owned());
        let tmp = path.with_file_name(format!(".{file_name}.tmp{}", std::process::id()));
        std::fs::write(&tmp, json + "\n").map_err(|e| io("write", e))?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io("write", e)
        })
    }
}

/// Where the CPU calibration lives: `$TESSERA_CPU_PRESET` if set, else
/// `$XDG_CONFIG_HOME/tessera/cpu.json`, else `$HOME/.config/tessera/cpu.json`; `None` when
/// neither variable is set.
pub fn cpu_calibration_path() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = var(CPU_PRESET_ENV) {
        return Some(p);
    }
    let config = var("XDG_CONFIG_HOME")
        .filter(|p| p.is_absolute())
        .or_else(|| var("HOME").map(|h| h.join(".config")))?;
    Some(config.join("tessera").join("cpu.json"))
}

/// This machine's CPU: the calibration file if there is one (a malformed one is an error,
/// never silently ignored), else [`CpuCalibration::builtin`]. A `TESSERA_CPU_PRESET` that names
/// a missing file is an error too.
pub fn cpu_calibration() -> Result<CpuCalibration> {
    let explicit = std::env::var_os(CPU_PRESET_ENV).is_some_and(|v| !v.is_empty());
    match cpu_calibration_path() {
        Some(path) if path.try_exists().unwrap_or(true) => CpuCalibration::load(&path),
        Some(path) if explicit => Err(PlanError::Invalid(format!(
            "{CPU_PRESET_ENV} names `{}`, which does not exist; run `tessera calibrate --out {}` \
             or unset {CPU_PRESET_ENV}",
            path.display(),
            path.display()
        ))),
        _ => Ok(CpuCalibration::builtin()),
    }
}

/// This machine's CPU as a device (see [`cpu_calibration`]).
pub fn cpu_preset() -> Result<DeviceSpec> {
    Ok(cpu_calibration()?.device)
}

/// An NVMe tier of `capacity_bytes` for `cpu` devices: this machine's calibrated disk
/// bandwidths (see [`cpu_calibration`]), else [`NvmeTier::with_capacity`]'s. Checked.
pub fn cpu_nvme(capacity_bytes: u64) -> Result<NvmeTier> {
    let nvme = cpu_calibration()?.nvme(capacity_bytes);
    nvme.validate()?;
    Ok(nvme)
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
