//! The memory tiers below the device in cluster files (`[host]`, `[nvme]`) and in the CPU
//! calibration (`adam_params_per_s`, `disk`), through the public API of `tessera-plan`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use tessera_plan::cluster::{cpu_nvme, CpuCalibration, DiskCalibration, CPU_PRESET_ENV};
use tessera_plan::tiers::{HostTier, NvmeTier};
use tessera_plan::{Cluster, Link};

const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// A device without presets: 4 per node, its links given.
const CUSTOM: &str = r#"gpus_per_node = 4
intra = { latency_s = 3e-6, bandwidth = 100e9 }
inter = { latency_s = 2e-5, bandwidth = 5e9 }
[device]
name = "MI300X"
memory_bytes = "192GiB"
fp32_flops = 1.6e14
bf16_flops = 1.3e15
fp16_flops = 1.3e15
memory_bandwidth = 5.3e12
"#;

/// A fresh file path under the system temp dir, unique per process and call.
fn temp_path(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tessera-host-tiers-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn cluster_file(name: &str, text: &str) -> Cluster {
    let path = temp_path(name);
    std::fs::write(&path, text).unwrap();
    Cluster::parse(path.to_str().unwrap()).unwrap_or_else(|e| panic!("{text}: {e}"))
}

/// A cluster file that fails with a message naming the file and containing every needle.
fn check_file_err(name: &str, text: &str, needles: &[&str]) {
    let path = temp_path(name);
    std::fs::write(&path, text).unwrap();
    let e = Cluster::parse(path.to_str().unwrap()).expect_err(text).to_string();
    assert!(e.contains(&path.display().to_string()), "{e} lacks the file name");
    for n in needles {
        assert!(e.contains(n), "{name}: `{e}` lacks `{n}`");
    }
}

#[test]
fn host_and_nvme_tables_set_the_tiers() {
    let c = cluster_file(
        "tiers.toml",
        r#"
gpus_per_node = 8
device = "H100"

[host]
memory = "192GiB"
link = { latency_s = 8e-6, bandwidth = 40e9 }
memory_bandwidth = 70e9
adam_params_per_s = 6e8

[nvme]
capacity = "2TiB"
read_bandwidth = 3e9
write_bandwidth = 2.5e9
"#,
    );
    let want = HostTier {
        memory_bytes: 192 * GIB,
        link: Link { latency_s: 8e-6, bandwidth: 40e9 },
        memory_bandwidth: 70e9,
        adam_params_per_s: 6e8,
    };
    assert_eq!(c.host, want);
    let nvme = NvmeTier { capacity_bytes: 2 * TIB, read_bandwidth: 3e9, write_bandwidth: 2.5e9 };
    assert_eq!(c.nvme, Some(nvme));
    assert_eq!(c.to_string(), "8xH100");

    // JSON, with a byte count.
    let path = temp_path("tiers.json");
    std::fs::write(
        &path,
        r#"{"gpus_per_node": 1, "device": "RTX4090", "host": {"memory": 68719476736},
            "nvme": {"capacity": "500GB"}}"#,
    )
    .unwrap();
    let c = Cluster::parse(path.to_str().unwrap()).unwrap();
    assert_eq!(c.host.memory_bytes, 64 * GIB);
    assert_eq!(c.nvme, Some(NvmeTier::with_capacity(500_000_000_000)));
}

#[test]
fn omitted_keys_keep_the_preset() {
    // A GeForce desktop: 32 GiB of host memory for its one GPU.
    let c = cluster_file("4090.toml", "gpus_per_node = 1\ndevice = \"RTX4090\"\n");
    assert_eq!(c.host, HostTier::preset("RTX4090", 1));
    assert_eq!(c.host.memory_bytes, 32 * GIB);
    assert_eq!(c.nvme, NvmeTier::preset("RTX4090", 1), "the preset's NVMe");
    let c = cluster_file(
        "4090-adam.toml",
        "gpus_per_node = 1\ndevice = \"RTX4090\"\n[host]\nadam_params_per_s = 2e9\n",
    );
    assert_eq!(c.host, HostTier { adam_params_per_s: 2e9, ..HostTier::preset("RTX4090", 1) });

    // A DGX H100: 2 TiB of host memory, 614 GB/s and the CPU optimizer shared by 8 GPUs.
    let c = cluster_file(
        "dgx.toml",
        "nodes = 2\ngpus_per_node = 8\ndevice = \"H100\"\n\
         [host]\nlink = { latency_s = 1e-5, bandwidth = 45e9 }\n",
    );
    let preset = HostTier::preset("H100", 8);
    assert_eq!(preset.memory_bytes, 2 * TIB / 8);
    assert_eq!(c.host, HostTier { link: Link { latency_s: 1e-5, bandwidth: 45e9 }, ..preset });
    assert_eq!(c.host.memory_bytes, 256 * GIB);
    assert_eq!(c.host.memory_bandwidth, 614e9 / 8.0);
    assert_eq!(c.host.adam_params_per_s, 4.5e9 / 8.0);
    // An empty table is the preset, as is the cluster string.
    let c = cluster_file("empty.toml", "gpus_per_node = 8\ndevice = \"H100\"\n[host]\n");
    assert_eq!(c.host, Cluster::parse("8xH100").unwrap().host);

    // NVMe keys left out keep the preset's figures, the capacity too.
    let c = cluster_file(
        "nvme.toml",
        "gpus_per_node = 8\ndevice = \"A100-80G\"\n[nvme]\ncapacity = \"1TiB\"\n\
         write_bandwidth = 3e9\n",
    );
    let preset = NvmeTier::preset("A100-80G", 8).expect("DGX A100 NVMe");
    assert_eq!(c.nvme, Some(NvmeTier { capacity_bytes: TIB, write_bandwidth: 3e9, ..preset }));
    assert_eq!(c.host, HostTier::preset("A100-80G", 8));
    let c = cluster_file(
        "nvme-bw.toml",
        "gpus_per_node = 8\ndevice = \"H100\"\n[nvme]\nread_bandwidth = 4e9\n",
    );
    let preset = NvmeTier::preset("H100", 8).expect("DGX H100 NVMe");
    assert_eq!(c.nvme, Some(NvmeTier { read_bandwidth: 4e9, ..preset }));

    // A custom device has no preset NVMe: the capacity is required, the bandwidths default to
    // a PCIe 4.0 SSD.
    let c = cluster_file("custom.toml", &format!("{CUSTOM}[nvme]\ncapacity = \"2TB\"\n"));
    assert_eq!(c.nvme, Some(NvmeTier::with_capacity(2_000_000_000_000)));
    assert_eq!(c.host, HostTier::preset("MI300X", 4));
}

#[test]
fn bad_tier_values_name_the_key() {
    let head = "gpus_per_node = 8\ndevice = \"H100\"\n";
    let bad = |name: &str, tail: &str, needles: &[&str]| {
        check_file_err(name, &format!("{head}{tail}"), needles)
    };
    bad("neg-bw.toml", "[host]\nmemory_bandwidth = -1e9\n", &["`host.memory_bandwidth`", "77e9"]);
    bad(
        "neg-adam.toml",
        "[host]\nadam_params_per_s = 0\n",
        &["`host.adam_params_per_s`", "positive"],
    );
    bad(
        "neg-link.toml",
        "[host]\nlink = { latency_s = 1e-5, bandwidth = -5 }\n",
        &["`host.link`", "bandwidth = -5", "e.g."],
    );
    bad("link-part.toml", "[host]\nlink = { bandwidth = 5e9 }\n", &["latency_s", "host"]);
    bad("nan.toml", "[host]\nmemory_bandwidth = nan\n", &["host.memory_bandwidth", "finite"]);
    bad(
        "inf.toml",
        "[nvme]\ncapacity = \"1TiB\"\nread_bandwidth = inf\n",
        &["nvme.read_bandwidth"],
    );
    bad("mem.toml", "[host]\nmemory = \"lots\"\n", &["host.memory", "GiB"]);
    bad("mem-neg.toml", "[host]\nmemory = -1\n", &["negative"]);
    bad(
        "typo.toml",
        "[host]\nmemroy = \"64GiB\"\n",
        &["`host` table", "unknown field `memroy`", "memory"],
    );
    bad("not-table.toml", "host = 5\n", &["`host`", "memory_bandwidth"]);
    bad(
        "nvme-typo.toml",
        "[nvme]\ncapacity = \"1TiB\"\nread_bw = 5e9\n",
        &["`nvme` table", "unknown field `read_bw`", "read_bandwidth"],
    );
    bad("nvme-zero.toml", "[nvme]\ncapacity = 0\n", &["nvme.capacity", "0 bytes", "1TiB"]);
    check_file_err(
        "nvme-none.toml",
        &format!("{CUSTOM}[nvme]\nread_bandwidth = 5e9\n"),
        &["`nvme` table needs `capacity`", "no preset NVMe", "1TiB"],
    );
    bad(
        "nvme-neg.toml",
        "[nvme]\ncapacity = \"1TiB\"\nwrite_bandwidth = -2e9\n",
        &["`nvme.write_bandwidth`", "positive"],
    );
    check_file_err(
        "top-typo.toml",
        "gpus_per_node = 8\ndevice = \"H100\"\n[hosts]\nmemory = 1\n",
        &["unknown field `hosts`", "host", "nvme"],
    );
}

/// The only test here that touches the environment (tests run in parallel threads): the CPU
/// calibration through `TESSERA_CPU_PRESET`.
#[test]
fn calibration_sets_the_cpu_tiers_and_old_files_still_load() {
    // A file of a build before the host figures were measured.
    let old = temp_path("old-cpu.json");
    std::fs::write(
        &old,
        r#"{"version": 1,
            "device": {"name": "cpu", "memory_bytes": 8589934592, "reserve_bytes": 0,
                       "fp32_flops": 1e11, "bf16_flops": 1e11, "fp16_flops": 1e11,
                       "memory_bandwidth": 2e10, "kernel_overhead_s": 1e-6,
                       "matmul_efficiency": 1.0, "memory_efficiency": 1.0},
            "intra": {"latency_s": 2e-6, "bandwidth": 8e9}}"#,
    )
    .unwrap();
    let cal = CpuCalibration::load(&old).expect("an old calibration loads");
    assert_eq!((cal.adam_params_per_s, &cal.disk), (None, &None));
    assert_eq!(cal.nvme(TIB), NvmeTier::with_capacity(TIB));

    std::env::set_var(CPU_PRESET_ENV, &old);
    let c = Cluster::parse("2xcpu").unwrap();
    // Without a measurement: memory-bound AdamW, ~30 bytes per parameter.
    assert_eq!(c.host.adam_params_per_s, 2e10 / 30.0);
    assert_eq!(cpu_nvme(TIB).unwrap(), NvmeTier::with_capacity(TIB));

    // A new calibration: the measured AdamW rate and disk.
    let mut cal = cal;
    cal.adam_params_per_s = Some(7e8);
    let disk =
        DiskCalibration { dir: "/scratch".into(), read_bandwidth: 2e9, write_bandwidth: 4e8 };
    cal.disk = Some(disk);
    let new = temp_path("cpu.json");
    cal.save(&new).unwrap();
    assert_eq!(CpuCalibration::load(&new).unwrap(), cal);
    std::env::set_var(CPU_PRESET_ENV, &new);
    let c = Cluster::parse("2xcpu").unwrap();
    assert_eq!(c.host.adam_params_per_s, 7e8);
    let want = NvmeTier { capacity_bytes: TIB, read_bandwidth: 2e9, write_bandwidth: 4e8 };
    assert_eq!(cpu_nvme(TIB).unwrap(), want);
    let c = c.with_nvme(Some(cpu_nvme(TIB).unwrap())).unwrap();
    assert_eq!(c.nvme, Some(want));
    // A cpu cluster file: the calibration's figures under what the file gives.
    let c = cluster_file(
        "cpu.toml",
        "gpus_per_node = 2\ndevice = \"cpu\"\n[nvme]\ncapacity = \"1TiB\"\nread_bandwidth = 1e9\n",
    );
    assert_eq!(c.host.adam_params_per_s, 7e8);
    assert_eq!(c.nvme, Some(NvmeTier { read_bandwidth: 1e9, ..want }));
    assert!(cpu_nvme(0).unwrap_err().to_string().contains("0 bytes"));

    // Unusable measured figures are refused on load, naming the field.
    let mut bad = cal.clone();
    bad.adam_params_per_s = Some(-1.0);
    let text = serde_json::to_string(&bad).unwrap();
    std::fs::write(&new, text).unwrap();
    let e = Cluster::parse("2xcpu").unwrap_err().to_string();
    assert!(e.contains("adam_params_per_s") && e.contains("tessera calibrate"), "{e}");
    let mut bad = cal;
    bad.disk.as_mut().unwrap().write_bandwidth = 0.0;
    std::fs::write(&new, serde_json::to_string(&bad).unwrap()).unwrap();
    let e = CpuCalibration::load(&new).unwrap_err().to_string();
    assert!(e.contains("disk.write_bandwidth"), "{e}");
    std::fs::write(&new, r#"{"version": 1, "device": {}, "intra": {}, "disk_speed": 1}"#).unwrap();
    let e = CpuCalibration::load(&new).unwrap_err().to_string();
    assert!(e.contains("malformed"), "{e}");
    std::env::remove_var(CPU_PRESET_ENV);
}
