//! The memory tiers below the device as flags shared by `plan` and `train`: how much host memory
//! and NVMe a plan may offload to (`--host-memory`, `--nvme-size`) and where NVMe-resident state
//! lives (`--offload-dir`).

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use tessera_plan::tiers::NvmeTier;
use tessera_plan::Cluster;

#[derive(Args, Clone, Debug, Default)]
pub struct TierArgs {
    /// Host memory per device the plan may offload optimizer state and gradients to (e.g.
    /// 64GiB). Default: the cluster preset's share of its host (none for simulated cpu
    /// devices); 0 forbids offloading.
    #[arg(long, value_parser = crate::train_cmd::parse_size, value_name = "SIZE")]
    pub host_memory: Option<u64>,
    /// NVMe per device the plan may offload optimizer state to (e.g. 1TB); 0: no NVMe tier.
    /// Default: the free space of --offload-dir when it is given, else none.
    #[arg(long, value_parser = crate::train_cmd::parse_size, value_name = "SIZE")]
    pub nvme_size: Option<u64>,
    /// Directory for NVMe-resident state (checked before the first step: it must exist, be
    /// writable and hold what the plan puts there).
    #[arg(long, value_name = "DIR")]
    pub offload_dir: Option<PathBuf>,
}

impl TierArgs {
    /// `cluster` with the flags' host memory and NVMe.
    pub fn apply(&self, mut cluster: Cluster) -> Result<Cluster> {
        if let Some(bytes) = self.host_memory {
            cluster = cluster.with_host_memory(bytes);
        }
        let bytes = match (self.nvme_size, &self.offload_dir) {
            (Some(0), _) => return cluster.with_nvme(None).map_err(crate::plan_cmd::plan_err),
            (Some(bytes), _) => bytes,
            (None, Some(dir)) => free_space(dir)?,
            (None, None) => return Ok(cluster),
        };
        // The preset's drive (or, on simulated devices, this machine's calibrated disk) with
        // the capacity given.
        let nvme = match (cluster.nvme, cluster.device.name.as_str()) {
            (Some(n), _) => NvmeTier { capacity_bytes: bytes, ..n },
            (None, "cpu") => {
                tessera_plan::cluster::cpu_nvme(bytes).map_err(crate::plan_cmd::plan_err)?
            }
            (None, _) => NvmeTier::with_capacity(bytes),
        };
        cluster.with_nvme(Some(nvme)).map_err(crate::plan_cmd::plan_err)
    }
}

/// The free bytes under an offload directory, which must exist and be a directory.
fn free_space(dir: &Path) -> Result<u64> {
    if !dir.is_dir() {
        bail!(
            "--offload-dir {}: no such directory; create it (on the NVMe to offload to) or give \
             another",
            dir.display()
        );
    }
    // Writable: a probe file created and removed now, not at the first offloaded step.
    let probe = dir.join(format!(".tessera-offload-probe-{}", std::process::id()));
    std::fs::write(&probe, b"ok").and_then(|()| std::fs::remove_file(&probe)).with_context(
        || {
            format!(
                "--offload-dir {}: cannot write there; give a directory this user can write",
                dir.display()
            )
        },
    )?;
    tessera_runtime::host::available_disk(dir)
        .with_context(|| format!("--offload-dir {}: cannot read its free space", dir.display()))
}
