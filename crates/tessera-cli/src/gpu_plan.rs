//! Planning for the GPUs of this machine (`tessera train --device cuda` without `--cluster`):
//! the cluster is the GPU the driver describes — its preset matched by name, or the file
//! `tessera calibrate --device cuda` measured it into — with its *free* memory as the budget,
//! and, when there are more devices than GPUs, the devices sharing them ([`placement`]).
//!
//! Everything here is a function of a [`GpuDescription`], so it is checked on machines without
//! a GPU by describing one.

#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use tessera_plan::{Cluster, DeviceSpec, Link};

/// The GPUs of this machine, as the driver reports the first one.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuDescription {
    /// The marketing name (`NVIDIA H200`, `NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// How many GPUs the driver sees.
    pub count: usize,
    pub total_bytes: u64,
    /// Free on the first GPU when the run is planned.
    pub free_bytes: u64,
}

/// Where a rank's device runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// A GPU of its own (several: over NCCL).
    Own { ordinal: usize },
    /// One of `sharing` devices on this GPU (their collectives staged through the host).
    Shared { ordinal: usize, sharing: usize },
}

impl Placement {
    pub fn ordinal(&self) -> usize {
        match *self {
            Placement::Own { ordinal } | Placement::Shared { ordinal, .. } => ordinal,
        }
    }
}

/// Where rank `rank` of `devices` devices of this process runs on a machine with `gpus` GPUs:
/// its own GPU while there are enough, else GPU `rank mod gpus`, shared with the devices of
/// the same remainder.
pub fn placement(rank: usize, devices: usize, gpus: usize) -> Result<Placement> {
    if gpus == 0 {
        bail!(
            "--device cuda: the driver sees no GPU on this machine; train on the CPU (drop \
             --device cuda)"
        );
    }
    if devices <= gpus {
        return Ok(Placement::Own { ordinal: rank });
    }
    let ordinal = rank % gpus;
    let sharing = (0..devices).filter(|r| r % gpus == ordinal).count();
    Ok(Placement::Shared { ordinal, sharing })
}

/// Free memory a device's plan leaves unplanned, for what the Program does not hold: kernel
/// scratch (norm partials, the flash backward's f32 dQ), the cuBLAS workspace and the
/// allocator's 2 MiB pages — 1/32 of the free memory, at least 256 MiB.
fn headroom(free: u64) -> u64 {
    (free / 32).max(256 << 20)
}

/// Collectives between devices that share a GPU go through host memory (a copy down, the
/// threads' exchange, a copy up): about a PCIe link's figures.
const STAGED_THROUGH_HOST: Link = Link { latency_s: 20e-6, bandwidth: 10e9 };

/// The preset whose datasheet a GPU of this driver name and memory is, or `None` (a card with
/// no preset, or a variant with other clocks or memory: PCIe and NVL parts).
pub fn preset_for(name: &str, total_bytes: u64) -> Option<&'static str> {
    let n = name.to_ascii_lowercase().replace(['-', '_'], " ");
    let has = |w: &str| n.contains(w);
    if has("pcie") || has("nvl") {
        return None;
    }
    let gib = total_bytes >> 30;
    if has("h200") {
        Some("H200")
    } else if has("h100") {
        Some("H100")
    } else if has("a100") {
        Some(if gib > 48 { "A100-80G" } else { "A100-40G" })
    } else if has("v100") {
        Some("V100")
    } else if has("4090") {
        Some("RTX4090")
    } else if has("3080") && !has("3080 ti") {
        Some("RTX3080")
    } else if has("3060") && !has("3060 ti") {
        Some("RTX3060")
    } else {
        None
    }
}

/// Environment variable naming the GPU calibration file `tessera calibrate --device cuda`
/// writes by default and `--device cuda` reads (overrides the default path).
pub const GPU_PRESET_ENV: &str = "TESSERA_GPU_PRESET";

/// `$TESSERA_GPU_PRESET`, else `$XDG_CONFIG_HOME/tessera/gpu.json`, else
/// `~/.config/tessera/gpu.json`.
pub fn gpu_calibration_path() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = var(GPU_PRESET_ENV) {
        return Some(p);
    }
    let config = var("XDG_CONFIG_HOME")
        .filter(|p| p.is_absolute())
        .or_else(|| var("HOME").map(|h| h.join(".config")))?;
    Some(config.join("tessera").join("gpu.json"))
}

/// The device a calibration file measured, if the file exists and measured a GPU of this name.
pub fn calibrated_device(path: &Path, name: &str) -> Result<Option<DeviceSpec>> {
    if !path.is_file() {
        return Ok(None);
    }
    let c = Cluster::from_file(path).map_err(|e| anyhow::anyhow!(e)).with_context(|| {
        format!(
            "the GPU calibration {} is unreadable; measure again with `tessera calibrate \
             --device cuda`, or delete it",
            path.display()
        )
    })?;
    Ok((c.device.name == name).then_some(c.device))
}

/// This machine's GPUs as a cluster of `devices` devices for the planner, and what its device
/// figures come from.
pub struct GpuCluster {
    pub cluster: Cluster,
    pub source: String,
}

/// The cluster `devices` devices of this process form on the GPUs `d` describes: the device is
/// the calibrated one when `calibrated` measured a GPU of this name, else the preset matched by
/// name; its memory budget is the free memory less [`headroom`], split between the devices
/// that share a GPU, whose compute is split likewise and whose collectives are staged through
/// the host.
pub fn cluster_for(
    d: &GpuDescription,
    devices: usize,
    calibrated: Option<DeviceSpec>,
) -> Result<GpuCluster> {
    let preset = preset_for(&d.name, d.total_bytes);
    let (mut device, source, links) = match (calibrated, preset) {
        (Some(dev), p) => {
            let links = p.and_then(tessera_plan::cluster::interconnect_preset);
            (dev, "measured by `tessera calibrate --device cuda`".to_string(), links)
        }
        (None, Some(p)) => {
            let dev = tessera_plan::cluster::device_preset(p)
                .with_context(|| format!("the {p} preset"))?;
            (
                dev,
                format!("the {p} preset (datasheet)"),
                tessera_plan::cluster::interconnect_preset(p),
            )
        }
        (None, None) => bail!(
            "--device cuda: `{}` has no preset ({}); measure it once with `tessera calibrate \
             --device cuda` (it writes {}), or give --cluster FILE",
            d.name,
            tessera_plan::cluster::DEVICE_NAMES.join(", "),
            gpu_calibration_path().map_or("a cluster file".into(), |p| p.display().to_string())
        ),
    };
    let sharing = devices.div_ceil(d.count.max(1)).max(1);
    let budget = d.free_bytes.saturating_sub(headroom(d.free_bytes)) / sharing as u64;
    if budget == 0 {
        bail!(
            "--device cuda: {} has {} free, too little for {devices} device(s); free GPU \
             memory or train on fewer devices",
            d.name,
            crate::format::bytes(d.free_bytes)
        );
    }
    device.name = d.name.clone();
    device.memory_bytes = (d.total_bytes / sharing as u64).max(budget + 1);
    device.reserve_bytes = device.memory_bytes - budget;
    let (intra, inter) = if sharing > 1 {
        // Devices time-share the GPU: each gets its part of the compute and bandwidth.
        let f = sharing as f64;
        device.fp32_flops /= f;
        device.bf16_flops /= f;
        device.fp16_flops /= f;
        device.memory_bandwidth /= f;
        device.kernels = None;
        (STAGED_THROUGH_HOST, STAGED_THROUGH_HOST)
    } else {
        let l = links.map_or((STAGED_THROUGH_HOST, STAGED_THROUGH_HOST), |l| (l.intra, l.inter));
        (l.0, l.1)
    };
    let cluster = Cluster::new(1, devices, device, intra, inter).map_err(|e| anyhow::anyhow!(e))?;
    let source = if sharing > 1 { format!("{source}, {sharing} devices per GPU") } else { source };
    Ok(GpuCluster { cluster, source })
}

/// This machine's first GPU as the driver describes it.
#[cfg(feature = "cuda")]
pub fn describe() -> Result<GpuDescription> {
    let count = tessera_cuda::Gpu::count().context("--device cuda")?;
    if count == 0 {
        bail!(
            "--device cuda: the driver sees no GPU on this machine; train on the CPU (drop \
             --device cuda)"
        );
    }
    let info = tessera_cuda::Gpu::describe(0).context("--device cuda")?;
    Ok(GpuDescription {
        name: info.name,
        count,
        total_bytes: info.total_bytes,
        free_bytes: info.free_bytes,
    })
}

#[cfg(not(feature = "cuda"))]
pub fn describe() -> Result<GpuDescription> {
    bail!(
        "--device cuda: this tessera was built without CUDA support; rebuild it with \
         `cargo build --release --features cuda` (no CUDA toolkit is needed to build)"
    )
}

/// Where rank `rank` of the `devices` devices this process runs lands ([`placement`]); a
/// process started by a launcher (`mpirun`, `torchrun`) takes the GPU of its local rank, which
/// must exist (one process per GPU).
#[cfg(feature = "cuda")]
pub fn rank_placement(rank: usize, devices: usize) -> Result<Placement> {
    let gpus = tessera_cuda::Gpu::count().context("--device cuda")?;
    match tessera_comm::discover().ok().flatten().filter(|env| env.world_size > 1) {
        Some(env) => {
            let local = env.local_rank.unwrap_or(rank);
            if local >= gpus {
                bail!(
                    "--device cuda: local rank {local} of this node has no GPU of its own (the \
                     node has {gpus}): launch one process per GPU, or run {} devices in one \
                     process (`--devices {}`), which share the GPUs",
                    env.world_size,
                    env.world_size
                );
            }
            Ok(Placement::Own { ordinal: local })
        }
        None => placement(rank, devices, gpus),
    }
}

/// Opens the GPU `place` names: a shared one with a stream and allocator of its own.
#[cfg(feature = "cuda")]
pub fn open(place: Placement, rank: usize) -> Result<std::sync::Arc<tessera_cuda::Gpu>> {
    match place {
        Placement::Own { ordinal } => tessera_cuda::Gpu::open(ordinal),
        Placement::Shared { ordinal, .. } => tessera_cuda::Gpu::open_shared(ordinal),
    }
    .with_context(|| format!("--device cuda: rank {rank} on GPU {}", place.ordinal()))
}

/// The cluster for `devices` devices on this machine's GPUs (see [`cluster_for`]), reading
/// the calibration file when it measured this GPU.
pub fn local_cluster(devices: usize) -> Result<GpuCluster> {
    let d = describe()?;
    let calibrated = match gpu_calibration_path() {
        Some(p) => calibrated_device(&p, &d.name)?,
        None => None,
    };
    cluster_for(&d, devices, calibrated)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn h200(count: usize, free: u64) -> GpuDescription {
        GpuDescription {
            name: "NVIDIA H200".into(),
            count,
            total_bytes: 143_771 << 20,
            free_bytes: free,
        }
    }

    #[test]
    fn driver_names_match_their_presets_and_variants_do_not() {
        assert_eq!(preset_for("NVIDIA H200", 150_000_000_000), Some("H200"));
        assert_eq!(preset_for("NVIDIA H100 80GB HBM3", 85_000_000_000), Some("H100"));
        assert_eq!(preset_for("NVIDIA A100-SXM4-80GB", 85_000_000_000), Some("A100-80G"));
        assert_eq!(preset_for("NVIDIA A100-SXM4-40GB", 42_000_000_000), Some("A100-40G"));
        assert_eq!(preset_for("NVIDIA GeForce RTX 4090", 25_000_000_000), Some("RTX4090"));
        assert_eq!(preset_for("Tesla V100-SXM2-32GB", 34_000_000_000), Some("V100"));
        // Other clocks and memory than the SXM datasheets: measured, not guessed.
        assert_eq!(preset_for("NVIDIA H100 PCIe", 85_000_000_000), None);
        assert_eq!(preset_for("NVIDIA H100 NVL", 100_000_000_000), None);
        assert_eq!(preset_for("NVIDIA L40S", 48_000_000_000), None);
    }

    /// A faked H200 with 100 GiB free: the H200 preset's compute and links, the free memory
    /// less the headroom as the budget of the one device.
    #[test]
    fn one_gpu_is_planned_as_its_preset_with_its_free_memory() {
        let g = cluster_for(&h200(1, 100 * GIB), 1, None).unwrap();
        let c = &g.cluster;
        assert_eq!(c.num_devices(), 1);
        assert!(g.source.contains("H200"), "{}", g.source);
        let preset = Cluster::parse("1xH200").unwrap();
        assert_eq!(c.device.bf16_flops, preset.device.bf16_flops);
        assert_eq!(c.intra, preset.intra);
        assert_eq!(c.device.usable_bytes(), 100 * GIB - 100 * GIB / 32);
        assert_eq!(c.device.name, "NVIDIA H200");
    }

    #[test]
    fn more_devices_than_gpus_share_them() {
        assert_eq!(placement(0, 2, 4).unwrap(), Placement::Own { ordinal: 0 });
        assert_eq!(placement(3, 4, 1).unwrap(), Placement::Shared { ordinal: 0, sharing: 4 });
        // 5 devices on 2 GPUs: GPU 0 takes ranks 0, 2, 4; GPU 1 ranks 1, 3.
        assert_eq!(placement(4, 5, 2).unwrap(), Placement::Shared { ordinal: 0, sharing: 3 });
        assert_eq!(placement(3, 5, 2).unwrap(), Placement::Shared { ordinal: 1, sharing: 2 });
        assert!(placement(0, 1, 0).unwrap_err().to_string().contains("no GPU"));
        let g = cluster_for(&h200(1, 64 * GIB), 4, None).unwrap();
        let one = cluster_for(&h200(1, 64 * GIB), 1, None).unwrap();
        let c = &g.cluster;
        assert_eq!(c.num_devices(), 4);
        assert_eq!(c.device.usable_bytes(), one.cluster.device.usable_bytes() / 4);
        assert_eq!(c.device.bf16_flops, one.cluster.device.bf16_flops / 4.0);
        assert_eq!(c.intra, STAGED_THROUGH_HOST, "collectives go through the host");
        assert!(g.source.contains("4 devices per GPU"), "{}", g.source);
    }

    #[test]
    fn a_gpu_without_preset_asks_for_a_calibration_and_uses_one() {
        let l40 = GpuDescription {
            name: "NVIDIA L40S".into(),
            count: 1,
            total_bytes: 48 * GIB,
            free_bytes: 40 * GIB,
        };
        let err = cluster_for(&l40, 1, None).err().unwrap().to_string();
        assert!(err.contains("tessera calibrate --device cuda"), "{err}");
        let mut measured = tessera_plan::cluster::device_preset("H100").unwrap();
        measured.name = "NVIDIA L40S".into();
        measured.bf16_flops = 360e12;
        let g = cluster_for(&l40, 1, Some(measured)).unwrap();
        assert_eq!(g.cluster.device.bf16_flops, 360e12);
        assert!(g.source.contains("measured"), "{}", g.source);
    }

    #[test]
    fn a_calibration_of_another_gpu_is_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpu.json");
        let mut dev = tessera_plan::cluster::device_preset("H100").unwrap();
        dev.name = "NVIDIA H100 80GB HBM3".into();
        let (file, _) = crate::calibrate_gpu::cluster_file(&dev).unwrap();
        std::fs::write(&path, file.to_string()).unwrap();
        assert!(calibrated_device(&path, "NVIDIA H200").unwrap().is_none());
        let same = calibrated_device(&path, "NVIDIA H100 80GB HBM3").unwrap().unwrap();
        assert_eq!(same.bf16_flops, dev.bf16_flops);
        std::fs::write(&path, "{not json").unwrap();
        let err = calibrated_device(&path, "x").unwrap_err();
        assert!(format!("{err:#}").contains("tessera calibrate --device cuda"), "{err:#}");
    }
}
