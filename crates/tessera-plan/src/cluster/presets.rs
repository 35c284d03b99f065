//! Device presets from vendor datasheets: the GPU table, each family's interconnect and the
//! name lookup the cluster strings use.

use super::{CpuCalibration, DeviceSpec, Interconnect, Link, GIB, MIB};

/// The preset names [`device_preset`] and the cluster strings accept (case-insensitive; `-`,
/// `_` and spaces are ignored, so `a100_80g` and `RTX 4090` work too).
pub const DEVICE_NAMES: &[&str] = &[
    "H100", "H200", "A100-40G", "A100-80G", "V100", "RTX3050", "RTX3060", "RTX3080", "RTX4090",
    "A6000", "cpu",
];

/// A GPU preset: datasheet figures plus the family's interconnect.
pub(super) struct GpuPreset {
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
    pub(super) links: Interconnect,
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
pub(super) const MEMORY_EFFICIENCY: f64 = 0.8;

/// Between CPU "devices" on different hosts: ~1 GB/s, 50 µs (commodity Ethernet, TCP).
pub(super) const CPU_INTER: Link = Link { latency_s: 50e-6, bandwidth: 1e9 };
/// Between threads of one host when no calibration exists: a copy through shared memory.
pub(super) const CPU_INTRA_DEFAULT: Link = Link { latency_s: 2e-6, bandwidth: 5e9 };

pub(super) fn normalize(name: &str) -> String {
    name.chars().filter(|c| !matches!(c, '-' | '_' | ' ')).collect::<String>().to_lowercase()
}

pub(super) fn gpu_preset(name: &str) -> Option<&'static GpuPreset> {
    let key = normalize(name);
    GPU_PRESETS.iter().find(|p| p.keys.contains(&key.as_str()))
}

pub(super) fn is_cpu(name: &str) -> bool {
    normalize(name) == "cpu"
}

impl GpuPreset {
    pub(super) fn device(&self) -> DeviceSpec {
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
