//! Cluster files (`.toml` / `.json`): reading and checking them into a [`Cluster`]. The format
//! is documented on [`Cluster::from_file`]; this module is its parser (the file's tables, sizes
//! such as `"80GiB"`, and the optional `[host]` / `[nvme]` memory tiers).

use super::{
    default_kernel_overhead_s, default_matmul_efficiency, default_memory_efficiency, known_devices,
    named_device, Cluster, CpuCalibration, DeviceSpec, Link,
};
use crate::tiers::{HostTier, NvmeTier};
use crate::units::parse_bytes;
use crate::{PlanError, Result};
use serde::Deserialize;
use std::fmt;
use std::path::Path;

pub(crate) const FILE_KEYS: &str = "nodes, gpus_per_node, device (a preset name or a device \
                                    table), reserve, intra, inter, host, nvme";
const HOST_KEYS: &str = "memory, link, memory_bandwidth, adam_params_per_s (all optional)";
const NVME_KEYS: &str =
    "capacity (required unless the device's preset has an NVMe), read_bandwidth, write_bandwidth";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    #[serde(default = "one")]
    nodes: usize,
    gpus_per_node: usize,
    device: serde_json::Value,
    #[serde(default)]
    reserve: Option<Size>,
    #[serde(default)]
    intra: Option<Link>,
    #[serde(default)]
    inter: Option<Link>,
    /// Read as a value first, so that its errors name the table.
    #[serde(default)]
    host: Option<serde_json::Value>,
    #[serde(default)]
    nvme: Option<serde_json::Value>,
}

fn one() -> usize {
    1
}

/// A device described in full in a cluster file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceTable {
    name: String,
    memory_bytes: Size,
    #[serde(default)]
    reserve_bytes: Option<Size>,
    fp32_flops: f64,
    bf16_flops: f64,
    fp16_flops: f64,
    memory_bandwidth: f64,
    #[serde(default = "default_kernel_overhead_s")]
    kernel_overhead_s: f64,
    #[serde(default = "default_matmul_efficiency")]
    matmul_efficiency: f64,
    #[serde(default = "default_memory_efficiency")]
    memory_efficiency: f64,
    #[serde(default)]
    kernels: Option<tessera_profile::kernels::KernelTable>,
}

/// `[host]`: each key overrides the device family's preset (per device).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostTable {
    #[serde(default)]
    memory: Option<Size>,
    #[serde(default)]
    link: Option<Link>,
    #[serde(default)]
    memory_bandwidth: Option<f64>,
    #[serde(default)]
    adam_params_per_s: Option<f64>,
}

/// `[nvme]`: each key overrides the device family's preset NVMe; without one (a custom or
/// `cpu` device) the capacity is required and the bandwidths default to the calibrated disk
/// (`cpu`) or a PCIe 4.0 SSD.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NvmeTable {
    #[serde(default)]
    capacity: Option<Size>,
    #[serde(default)]
    read_bandwidth: Option<f64>,
    #[serde(default)]
    write_bandwidth: Option<f64>,
}

/// A byte count or a size string (`"80GiB"`).
enum Size {
    Bytes(u64),
    Text(String),
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Size, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Size;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte count or a size string such as \"2GiB\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<Size, E> {
                Ok(Size::Bytes(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<Size, E> {
                u64::try_from(v).map(Size::Bytes).map_err(|_| {
                    E::custom(format!("a size of {v} bytes is negative; write e.g. \"2GiB\""))
                })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<Size, E> {
                Ok(Size::Text(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

impl Size {
    fn bytes(&self, field: &str) -> Result<u64> {
        match self {
            Size::Bytes(b) => Ok(*b),
            Size::Text(t) => {
                parse_bytes(t).map_err(|e| PlanError::Invalid(format!("`{field}`: {e}")))
            }
        }
    }
}

/// Reads a cluster file, TOML or JSON by extension (see [`Cluster::from_file`]).
pub(crate) fn from_file(path: &Path) -> Result<Cluster> {
    let p = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| {
        PlanError::Invalid(format!("cannot read cluster file `{p}`: {e}; check the path"))
    })?;
    let is_toml = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("toml"));
    let value: serde_json::Value = if is_toml {
        let table: toml::Table = toml::from_str(&text).map_err(|e| {
            let line = e.span().map_or(String::new(), |sp| {
                format!(", line {}", text[..sp.start.min(text.len())].lines().count().max(1))
            });
            PlanError::Invalid(format!(
                "cluster file `{p}` is not valid TOML{line}: {}",
                e.message().trim()
            ))
        })?;
        if let Some(key) = non_finite(&table, "") {
            return Err(PlanError::Invalid(format!(
                "cluster file `{p}`: `{key}` is not a finite number (nan and inf are not \
                 allowed): give a number like 5e-6 or 50e9"
            )));
        }
        serde_json::to_value(table).map_err(|e| {
            PlanError::Invalid(format!("cluster file `{p}`: unsupported TOML value: {e}"))
        })?
    } else {
        serde_json::from_str(&text)
            .map_err(|e| PlanError::Invalid(format!("cluster file `{p}` is not valid JSON: {e}")))?
    };
    cluster_from_value(value).map_err(|e| PlanError::Invalid(format!("cluster file `{p}`: {e}")))
}

/// The dotted key of the first NaN or infinite float in `table` (TOML allows `nan` and
/// `inf`; JSON, which the file becomes, would read them as null).
fn non_finite(table: &toml::Table, prefix: &str) -> Option<String> {
    fn walk(v: &toml::Value, key: String) -> Option<String> {
        match v {
            toml::Value::Float(f) if !f.is_finite() => Some(key),
            toml::Value::Table(t) => non_finite(t, &key),
            toml::Value::Array(a) => {
                a.iter().enumerate().find_map(|(i, v)| walk(v, format!("{key}[{i}]")))
            }
            _ => None,
        }
    }
    table.iter().find_map(|(k, v)| {
        walk(v, if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") })
    })
}

fn cluster_from_value(value: serde_json::Value) -> Result<Cluster> {
    let file: ClusterFile = serde_json::from_value(value).map_err(|e| {
        let e = e.to_string();
        if e.contains("expected one of") {
            PlanError::Invalid(e)
        } else {
            PlanError::Invalid(format!("{e}; the keys are {FILE_KEYS}"))
        }
    })?;
    let (mut device, links, cal) = match file.device {
        serde_json::Value::String(name) => {
            let (d, l, cal) = named_device(&name)?;
            (d, Some(l), cal)
        }
        table @ serde_json::Value::Object(_) => (device_from_table(table)?, None, None),
        other => {
            return Err(PlanError::Invalid(format!(
                "`device` is {other}; give a preset name ({}) or a device table",
                known_devices()
            )))
        }
    };
    if let Some(r) = &file.reserve {
        device.reserve_bytes = r.bytes("reserve")?;
    }
    let missing = |which: &str| {
        PlanError::Invalid(format!(
            "a custom device needs an `{which}` link table with latency_s and bandwidth, e.g. \
             {which} = {{ latency_s = 5e-6, bandwidth = 50e9 }}"
        ))
    };
    let intra = match (file.intra, links) {
        (Some(l), _) => l,
        (None, Some(l)) => l.intra,
        (None, None) => return Err(missing("intra")),
    };
    let inter = match (file.inter, links) {
        (Some(l), _) => l,
        (None, Some(l)) => l.inter,
        (None, None) => return Err(missing("inter")),
    };
    let mut cluster = Cluster::new(file.nodes, file.gpus_per_node, device, intra, inter)?;
    if let Some(cal) = &cal {
        cluster = cluster.with_cpu_calibration(cal);
    }
    if let Some(host) = file.host {
        let host = host_from_table(host, &cluster.host)?;
        cluster = cluster
            .with_host(host)
            .map_err(|e| PlanError::Invalid(format!("`host` table: {e}")))?;
    }
    if let Some(nvme) = file.nvme {
        let nvme = nvme_from_table(nvme, cluster.nvme, cal.as_ref())?;
        cluster = cluster
            .with_nvme(Some(nvme))
            .map_err(|e| PlanError::Invalid(format!("`nvme` table: {e}")))?;
    }
    Ok(cluster)
}

fn device_from_table(table: serde_json::Value) -> Result<DeviceSpec> {
    let t: DeviceTable = serde_json::from_value(table).map_err(|e| {
        PlanError::Invalid(format!(
            "device table: {e}; it needs name, memory_bytes, fp32_flops, bf16_flops, \
             fp16_flops, memory_bandwidth (optional: reserve_bytes, kernel_overhead_s, \
             matmul_efficiency, memory_efficiency, kernels)"
        ))
    })?;
    Ok(DeviceSpec {
        name: t.name,
        memory_bytes: t.memory_bytes.bytes("memory_bytes")?,
        reserve_bytes: match &t.reserve_bytes {
            Some(r) => r.bytes("reserve_bytes")?,
            None => 0,
        },
        fp32_flops: t.fp32_flops,
        bf16_flops: t.bf16_flops,
        fp16_flops: t.fp16_flops,
        memory_bandwidth: t.memory_bandwidth,
        kernel_overhead_s: t.kernel_overhead_s,
        matmul_efficiency: t.matmul_efficiency,
        memory_efficiency: t.memory_efficiency,
        kernels: t.kernels,
    })
}

/// Checks `table` (`host` or `nvme`) is a table whose numbers are finite: TOML's `nan` and `inf`
/// become JSON nulls, which an optional key would otherwise read as "not given".
fn check_tier_table(table: &serde_json::Value, name: &str, keys: &str) -> Result<()> {
    let Some(map) = table.as_object() else {
        return Err(PlanError::Invalid(format!(
            "`{name}` is {table}; give a table with the keys {keys}"
        )));
    };
    let bad = |key: &str| {
        PlanError::Invalid(format!(
            "`{name}.{key}` is not a finite number; give a positive number, e.g. 25e9"
        ))
    };
    for (key, v) in map {
        if v.is_null() {
            return Err(bad(key));
        }
        if let Some(inner) = v.as_object() {
            if let Some((k, _)) = inner.iter().find(|(_, x)| x.is_null()) {
                return Err(bad(&format!("{key}.{k}")));
            }
        }
    }
    Ok(())
}

/// Checks a rate the file gives (`key`, in `unit`) is positive and finite.
fn positive(key: &str, v: Option<f64>, unit: &str) -> Result<()> {
    match v {
        Some(v) if !(v.is_finite() && v > 0.0) => {
            Err(PlanError::Invalid(format!("`{key}` = {v} must be a positive number of {unit}")))
        }
        _ => Ok(()),
    }
}

/// The `[host]` table over `preset`: each given key replaces the preset's figure.
fn host_from_table(table: serde_json::Value, preset: &HostTier) -> Result<HostTier> {
    check_tier_table(&table, "host", HOST_KEYS)?;
    let t: HostTable = serde_json::from_value(table)
        .map_err(|e| PlanError::Invalid(format!("`host` table: {e}; the keys are {HOST_KEYS}")))?;
    positive("host.memory_bandwidth", t.memory_bandwidth, "bytes/s, e.g. 77e9")?;
    positive("host.adam_params_per_s", t.adam_params_per_s, "parameters/s, e.g. 5e8")?;
    if let Some(link) = &t.link {
        link.validate("`host.link`")?;
    }
    Ok(HostTier {
        memory_bytes: match &t.memory {
            Some(m) => m.bytes("host.memory")?,
            None => preset.memory_bytes,
        },
        link: t.link.unwrap_or(preset.link),
        memory_bandwidth: t.memory_bandwidth.unwrap_or(preset.memory_bandwidth),
        adam_params_per_s: t.adam_params_per_s.unwrap_or(preset.adam_params_per_s),
    })
}

/// The `[nvme]` table over `preset` (the device family's NVMe, if it has one); without a
/// preset, bandwidths not given come from `cal`'s disk (a `cpu` device), else from
/// [`NvmeTier::with_capacity`].
fn nvme_from_table(
    table: serde_json::Value,
    preset: Option<NvmeTier>,
    cal: Option<&CpuCalibration>,
) -> Result<NvmeTier> {
    check_tier_table(&table, "nvme", NVME_KEYS)?;
    let t: NvmeTable = serde_json::from_value(table)
        .map_err(|e| PlanError::Invalid(format!("`nvme` table: {e}; the keys are {NVME_KEYS}")))?;
    let capacity = match (&t.capacity, &preset) {
        (Some(c), _) => c.bytes("nvme.capacity")?,
        (None, Some(p)) => p.capacity_bytes,
        (None, None) => {
            return Err(PlanError::Invalid(
                "the `nvme` table needs `capacity`: this device has no preset NVMe; give each \
                 device's share, e.g. capacity = \"1TiB\""
                    .into(),
            ))
        }
    };
    if capacity == 0 {
        return Err(PlanError::Invalid(
            "`nvme.capacity` is 0 bytes; give each device's share of the NVMe, e.g. capacity = \
             \"1TiB\""
                .into(),
        ));
    }
    positive("nvme.read_bandwidth", t.read_bandwidth, "bytes/s, e.g. 6e9")?;
    positive("nvme.write_bandwidth", t.write_bandwidth, "bytes/s, e.g. 5e9")?;
    let defaults = match (preset, cal) {
        (Some(p), _) => p,
        (None, Some(cal)) => cal.nvme(capacity),
        (None, None) => NvmeTier::with_capacity(capacity),
    };
    Ok(NvmeTier {
        capacity_bytes: capacity,
        read_bandwidth: t.read_bandwidth.unwrap_or(defaults.read_bandwidth),
        write_bandwidth: t.write_bandwidth.unwrap_or(defaults.write_bandwidth),
    })
}
