//! The calibrated CPU preset: what `tessera calibrate` measured on this machine, where the file
//! lives, and the built-in figures used without one.

use super::presets::{CPU_INTER, CPU_INTRA_DEFAULT, MEMORY_EFFICIENCY};
use super::{DeviceSpec, Interconnect, Link, GIB};
use crate::tiers::NvmeTier;
use crate::{PlanError, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

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
