//! `tessera calibrate --device cuda [--out FILE]`: measure GPU 0 (`tessera_cuda::calibrate`:
//! GEMM FLOP/s per dtype, device-memory bandwidth, launch cost, and every kernel of real
//! training steps timed for the cost model) and write a one-GPU cluster file whose device table
//! is the measurement — by default where `tessera train --device cuda` looks for this GPU's
//! figures ([`crate::gpu_plan::gpu_calibration_path`]); any file works with `--cluster FILE`. The
//! links between GPUs are not measured on one GPU: the file carries the preset's links when the
//! device is a known one (H100, H200, A100), else PCIe and 100 Gb/s figures, and says so.

use crate::calibrate_cmd::CalibrateArgs;
use crate::format::bytes;
use crate::profile_cmd::{print_stdout, OutputFormat};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tessera_plan::{DeviceSpec, Link};

/// A PCIe 4.0 ×16 link, for devices without a preset (not measured on one GPU).
const PCIE: Link = Link { latency_s: 10e-6, bandwidth: 25e9 };
/// A 100 Gb/s network between nodes, likewise.
const NETWORK: Link = Link { latency_s: 10e-6, bandwidth: 12.5e9 };

/// The links (within a node, between nodes) of the known device whose name `name` contains.
fn preset_links(name: &str) -> Option<(String, Link, Link)> {
    let upper = name.to_uppercase();
    ["H200", "H100", "A100-80G", "A100-40G"].into_iter().find_map(|p| {
        let family = p.split('-').next().unwrap_or(p);
        if !upper.contains(family) {
            return None;
        }
        let c = tessera_plan::Cluster::parse(&format!("2x{p}")).ok()?;
        Some((p.to_string(), c.intra, c.inter))
    })
}

/// The cluster file (JSON) of one GPU: the measured device and the links chosen for it.
pub fn cluster_file(f: &DeviceSpec) -> Result<(Value, String)> {
    let (intra, inter, source) = match preset_links(&f.name) {
        Some((p, intra, inter)) => {
            (intra, inter, format!("the {p} preset's links (not measured on one GPU)"))
        }
        None => (
            PCIE,
            NETWORK,
            "PCIe 4.0 x16 and 100 Gb/s figures (not measured on one GPU; edit them)".into(),
        ),
    };
    let v = json!({
        "gpus_per_node": 1,
        "device": serde_json::to_value(f)?,
        "intra": { "latency_s": intra.latency_s, "bandwidth": intra.bandwidth },
        "inter": { "latency_s": inter.latency_s, "bandwidth": inter.bandwidth },
    });
    Ok((v, source))
}

/// The measured device: achieved rates, so its efficiencies are 1.0, and the runtime's own
/// kernels timed on training steps (the cost model's measured kernels).
#[cfg(feature = "cuda")]
fn measure() -> Result<DeviceSpec> {
    let gpu = tessera_cuda::Gpu::open(0).context("--device cuda")?;
    let m = tessera_cuda::calibrate::measure(&gpu).context("measuring the GPU")?;
    let (runs, sweep) =
        tessera_cuda::calibrate::measure_kernels(&gpu).context("timing the kernels")?;
    let kernels = tessera_cuda::calibrate::kernel_table(&runs, &sweep);
    Ok(DeviceSpec {
        name: m.name,
        memory_bytes: m.memory_bytes,
        reserve_bytes: 0,
        fp32_flops: m.fp32_flops,
        bf16_flops: m.bf16_flops,
        fp16_flops: m.fp16_flops,
        memory_bandwidth: m.memory_bandwidth,
        kernel_overhead_s: m.kernel_overhead_s,
        matmul_efficiency: 1.0,
        memory_efficiency: 1.0,
        kernels: Some(kernels),
    })
}

#[cfg(not(feature = "cuda"))]
fn measure() -> Result<DeviceSpec> {
    bail!(
        "--device cuda: this tessera was built without CUDA support; rebuild it with \
         `cargo build --release --features tessera-cli/cuda` (no CUDA toolkit is needed to build)"
    )
}

pub fn run(args: &CalibrateArgs) -> Result<()> {
    let Some(path) = args.out.clone().or_else(crate::gpu_plan::gpu_calibration_path) else {
        bail!(
            "no default place for the GPU calibration: neither {}, XDG_CONFIG_HOME nor HOME is \
             set; pass --out FILE",
            crate::gpu_plan::GPU_PRESET_ENV
        );
    };
    // Fail before measuring when the file cannot be written.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| {
            format!("cannot create the directory of `{}`; choose a writable --out", path.display())
        })?;
    }
    let figures = measure()?;
    let (file, link) = cluster_file(&figures)?;
    let text = serde_json::to_string_pretty(&file)? + "\n";
    crate::output::write_output(&path, text.as_bytes())?;
    let f = &figures;
    match args.format {
        OutputFormat::Json => {
            let mut v = file;
            v["path"] = json!(path.display().to_string());
            v["intra_source"] = json!(link);
            print_stdout(&format!("{v}\n"))
        }
        OutputFormat::Table => print_stdout(&format!(
            "device                  {}\n\
             memory                  {}\n\
             bf16 matmul             {:.1} TFLOP/s\n\
             fp16 matmul             {:.1} TFLOP/s\n\
             fp32 matmul             {:.1} TFLOP/s\n\
             memory bandwidth        {:.2} TB/s (read + write)\n\
             kernel launch           {:.2} µs\n\
             kernels timed           {}\n\
             link between GPUs       {link}\n\
             written to {} (`--device cuda` reads it for this GPU; or use it with --cluster)\n",
            f.name,
            bytes(f.memory_bytes),
            f.bf16_flops / 1e12,
            f.fp16_flops / 1e12,
            f.fp32_flops / 1e12,
            f.memory_bandwidth / 1e12,
            f.kernel_overhead_s * 1e6,
            f.kernels.as_ref().map_or("none".to_string(), |k| format!(
                "{} kinds of op ({})",
                k.curves.len(),
                k.source
            )),
            path.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(name: &str) -> DeviceSpec {
        DeviceSpec {
            name: name.into(),
            memory_bytes: 85_017_493_504,
            reserve_bytes: 0,
            fp32_flops: 51e12,
            bf16_flops: 810e12,
            fp16_flops: 805e12,
            memory_bandwidth: 3.03e12,
            kernel_overhead_s: 4e-6,
            matmul_efficiency: 1.0,
            memory_efficiency: 1.0,
            kernels: None,
        }
    }

    /// The file the GPU calibration writes is a cluster file the planner reads back into the
    /// measured device, with the known device's link.
    #[test]
    fn the_gpu_cluster_file_reads_back_as_the_measured_device() {
        let f = figures("NVIDIA H100 80GB HBM3");
        let (v, source) = cluster_file(&f).unwrap();
        assert!(source.contains("H100"), "{source}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpu.json");
        std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
        let c = tessera_plan::Cluster::from_file(&path).unwrap();
        assert_eq!(c.device, f, "the planner reads back the measured device");
        let h100 = tessera_plan::Cluster::parse("2xH100").unwrap();
        assert_eq!(v["intra"]["bandwidth"], json!(h100.intra.bandwidth));
    }

    #[test]
    fn an_unknown_gpu_gets_a_pcie_link_and_says_so() {
        let (v, source) = cluster_file(&figures("Some Future GPU")).unwrap();
        assert!(source.contains("PCIe"), "{source}");
        assert_eq!(v["intra"]["bandwidth"], json!(25e9));
    }
}
