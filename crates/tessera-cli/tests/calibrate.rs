//! `tessera calibrate` end to end: the JSON it prints, and the preset file it writes, read back
//! through the planner's cluster API (`4xcpu` with `TESSERA_CPU_PRESET` pointing at it).

use std::process::Command;
use tessera_plan::cluster::{CpuCalibration, CPU_PRESET_ENV};
use tessera_plan::Cluster;

#[test]
fn calibrate_writes_a_cpu_preset_the_planner_reads() {
    let dir = std::env::temp_dir().join(format!("tessera-calibrate-{}", std::process::id()));
    let path = dir.join("nested").join("cpu.json");
    let offload = dir.join("offload");
    std::fs::create_dir_all(&offload).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["calibrate", "--out", path.to_str().unwrap(), "--format", "json", "--quick"])
        .args(["--offload-dir", offload.to_str().unwrap()])
        .output()
        .expect("tessera runs");
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is only JSON");
    for key in [
        "matmul_flops",
        "memory_bandwidth",
        "thread_copy_bandwidth",
        "adam_params_per_s",
        "disk_write_bandwidth",
        "disk_read_bandwidth",
    ] {
        let x = v[key].as_f64().unwrap_or_else(|| panic!("{key} missing or not a number: {v}"));
        assert!(x.is_finite() && x > 1e6, "{key} = {x}");
    }
    assert_eq!(v["path"].as_str(), Some(path.to_str().unwrap()));
    assert_eq!(v["offload_dir"].as_str(), Some(offload.to_str().unwrap()));
    let left: Vec<_> = std::fs::read_dir(&offload).unwrap().collect();
    assert!(left.is_empty(), "the disk measurement left {left:?}");

    let cal = CpuCalibration::load(&path).expect("the written preset parses");
    assert_eq!(cal.device.name, "cpu");
    assert_eq!(cal.device.fp32_flops, v["matmul_flops"].as_f64().unwrap());
    assert_eq!(cal.device.memory_bandwidth, v["memory_bandwidth"].as_f64().unwrap());
    assert_eq!(cal.intra.bandwidth, v["thread_copy_bandwidth"].as_f64().unwrap());
    assert_eq!((cal.device.matmul_efficiency, cal.device.reserve_bytes), (1.0, 0));
    assert!(cal.device.memory_bytes > 0);
    assert_eq!(cal.adam_params_per_s, v["adam_params_per_s"].as_f64());
    let disk = cal.disk.clone().expect("the disk figures are written");
    assert_eq!(disk.dir, offload);
    assert_eq!(disk.read_bandwidth, v["disk_read_bandwidth"].as_f64().unwrap());
    assert_eq!(disk.write_bandwidth, v["disk_write_bandwidth"].as_f64().unwrap());

    // Only this test reads the variable (the other one passes --out), and std serialises
    // environment access.
    std::env::set_var(CPU_PRESET_ENV, &path);
    let c = Cluster::parse("4xcpu").expect("4xcpu reads the calibration");
    std::env::remove_var(CPU_PRESET_ENV);
    assert_eq!(c.num_devices(), 4);
    // The calibration's figures, with each simulated device's share of the machine's memory.
    let total = tessera_plan::cluster::host_memory_total().expect("/proc/meminfo");
    let share = tessera_plan::cluster::cpu_share(total, 4);
    let mut want = cal.device.clone();
    want.memory_bytes = want.memory_bytes.min(share);
    assert_eq!(c.device, want);
    assert_eq!(c.intra, cal.intra);
    // The host tier of `cpu` devices: the measured AdamW rate; NVMe at the measured disk.
    assert_eq!(Some(c.host.adam_params_per_s), cal.adam_params_per_s);
    std::env::set_var(CPU_PRESET_ENV, &path);
    let nvme = tessera_plan::cluster::cpu_nvme(1 << 40);
    std::env::remove_var(CPU_PRESET_ENV);
    let nvme = nvme.expect("an NVMe tier from the calibration");
    assert_eq!(
        (nvme.read_bandwidth, nvme.write_bandwidth),
        (disk.read_bandwidth, disk.write_bandwidth)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn calibrate_names_an_unusable_offload_dir() {
    let dir = std::env::temp_dir().join(format!("tessera-calibrate-off-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out_path = dir.join("cpu.json");
    let mut cases = vec![
        (dir.join("missing"), "does not exist"),
        // A regular file is not a directory.
        (out_path.with_file_name("file"), "not a directory"),
    ];
    if std::path::Path::new("/proc/self").exists() {
        // procfs refuses new files, even to root.
        cases.push(("/proc".into(), "cannot create the test file `/proc/"));
    }
    for (offload, want) in cases {
        std::fs::write(dir.join("file"), "x").unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["calibrate", "--quick", "--out", out_path.to_str().unwrap()])
            .args(["--offload-dir", offload.to_str().unwrap()])
            .output()
            .expect("tessera runs");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(offload.to_str().unwrap()), "{err}");
        assert!(err.contains(want) && err.contains("--offload-dir"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(!out_path.exists(), "nothing is written when a measurement fails");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn calibrate_rejects_an_unwritable_path() {
    // A path under a regular file cannot be created.
    let dir = std::env::temp_dir().join(format!("tessera-calibrate-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("file");
    std::fs::write(&file, "x").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["calibrate", "--out", file.join("cpu.json").to_str().unwrap()])
        .output()
        .expect("tessera runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: cannot create the directory of"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `calibrate --device cuda` writes a GPU cluster file where there is a GPU; here (no driver)
/// it stops before measuring, naming the missing driver, and writes nothing. Without `--out`
/// it writes where `train --device cuda` looks (`$TESSERA_GPU_PRESET`), or, without a GPU,
/// nothing there either.
#[test]
fn calibrate_on_cuda_measures_or_names_the_missing_driver() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpu.json");
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["calibrate", "--device", "cuda", "--out", path.to_str().unwrap()])
        .output()
        .expect("tessera runs");
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        let c = Cluster::from_file(&path).expect("the GPU cluster file parses");
        assert!(c.device.bf16_flops > 1e12, "{:?}", c.device);
    } else {
        assert!(err.contains("libcuda.so") || err.contains("built without CUDA"), "{err}");
        assert!(!path.exists(), "nothing is written when nothing was measured");
    }
    let default = dir.path().join("default-gpu.json");
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["calibrate", "--device", "cuda"])
        .env("TESSERA_GPU_PRESET", &default)
        .output()
        .expect("tessera runs");
    if out.status.success() {
        let c = Cluster::from_file(&default).expect("the default GPU calibration parses");
        assert!(c.device.kernels.is_some(), "the kernels were timed: {:?}", c.device.name);
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("libcuda.so") || err.contains("built without CUDA"), "{err}");
        assert!(!default.exists(), "nothing is written when nothing was measured");
    }
}
