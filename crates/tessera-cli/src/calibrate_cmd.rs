//! `tessera calibrate`: measure this CPU — f32 matmul FLOP/s (gemm on all threads), memory
//! bandwidth (a parallel 256 MiB copy), thread-to-thread copy bandwidth, our AdamW kernel's
//! parameters/s (16M fp32 parameters) and the sequential write and read bandwidth of the disk
//! under `--offload-dir` (a 256 MiB file, synced, read back uncached) — and write them as the
//! `cpu` device preset (a [`CpuCalibration`] JSON) that `4xcpu` cluster strings read. The
//! AdamW and disk figures are the host and NVMe tiers that `cpu` devices offload to.
//!
//! Each figure is the best of a few runs, so it is an *achieved* rate: the preset's
//! efficiencies are 1.0. The whole run takes a few seconds (`--quick`: smaller AdamW and disk
//! measurements, for tests).

use crate::format::{bytes, count};
use crate::profile_cmd::{print_stdout, OutputFormat};
use crate::train_cmd::DeviceKind;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tessera_plan::cluster::{
    cpu_calibration_path, CpuCalibration, DiskCalibration, CPU_PRESET_ENV,
};
use tessera_plan::{DeviceSpec, Link};

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// What to measure: this machine's CPU (the `cpu` preset), or GPU 0 (`cuda`: its rates and
    /// its kernels timed on training steps, as a cluster file; needs a `tessera` built with
    /// `--features cuda`).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Where to write the preset (default: $TESSERA_CPU_PRESET, else
    /// $XDG_CONFIG_HOME/tessera/cpu.json, else ~/.config/tessera/cpu.json; with `--device
    /// cuda`: $TESSERA_GPU_PRESET, else gpu.json beside it, which `train --device cuda` reads).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Directory on the disk that offloaded state would go to: a 256 MiB file is written,
    /// synced, read back and deleted there (default: the system temp dir).
    #[arg(long, value_name = "DIR")]
    pub offload_dir: Option<PathBuf>,
    /// Smaller AdamW and disk measurements (1M parameters, a 16 MiB file): faster, less
    /// accurate.
    #[arg(long)]
    pub quick: bool,
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
}

/// Latency of a hand-off between two threads through shared memory (a cache-line round trip
/// plus a wake-up), seconds: not measured, a typical figure.
const THREAD_LATENCY_S: f64 = 2e-6;

/// Parameters of the AdamW measurement (16M, fp32 state: 256 MiB touched per step), and under
/// `--quick`.
const ADAM_PARAMS: usize = 16 << 20;
const ADAM_PARAMS_QUICK: usize = 1 << 20;
/// Size of the disk measurement's file, and under `--quick`.
const DISK_BYTES: usize = 256 << 20;
const DISK_BYTES_QUICK: usize = 16 << 20;

pub fn run(args: &CalibrateArgs) -> Result<()> {
    if args.device == DeviceKind::Cuda {
        return crate::calibrate_gpu::run(args);
    }
    let path = match &args.out {
        Some(p) => p.clone(),
        None => cpu_calibration_path().context(format!(
            "no default place for the CPU preset: neither {CPU_PRESET_ENV}, XDG_CONFIG_HOME nor \
             HOME is set; pass --out FILE"
        ))?,
    };
    // Fail before measuring, not after, when the preset cannot be written.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| {
            format!(
                "cannot create the directory of `{}`; choose a writable path with --out",
                path.display()
            )
        })?;
    }
    let offload_dir = args.offload_dir.clone().unwrap_or_else(std::env::temp_dir);
    // First the disk: an unwritable directory fails at once.
    let disk_bytes = if args.quick { DISK_BYTES_QUICK } else { DISK_BYTES };
    let disk = measure_disk(&offload_dir, disk_bytes)?;
    let matmul_flops = measure_matmul_flops();
    let memory_bandwidth = measure_memory_bandwidth();
    let thread_copy_bandwidth = measure_thread_copy_bandwidth();
    let adam_params = if args.quick { ADAM_PARAMS_QUICK } else { ADAM_PARAMS };
    let adam_params_per_s = measure_adam_params_per_s(adam_params)?;
    let memory_bytes = total_memory_bytes().unwrap_or_else(|| {
        let fallback = CpuCalibration::builtin().device.memory_bytes;
        eprintln!("warning: cannot read MemTotal from /proc/meminfo; assuming {}", bytes(fallback));
        fallback
    });
    let cal = CpuCalibration {
        version: CpuCalibration::VERSION,
        device: DeviceSpec {
            name: "cpu".into(),
            memory_bytes,
            reserve_bytes: 0,
            // CPU kernels compute bf16/fp16 in f32.
            fp32_flops: matmul_flops,
            bf16_flops: matmul_flops,
            fp16_flops: matmul_flops,
            memory_bandwidth,
            kernel_overhead_s: 1e-6,
            matmul_efficiency: 1.0,
            memory_efficiency: 1.0,
            kernels: None,
        },
        intra: Link { latency_s: THREAD_LATENCY_S, bandwidth: thread_copy_bandwidth },
        adam_params_per_s: Some(adam_params_per_s),
        disk: Some(disk),
    };
    write(&cal, &path)?;
    report(&cal, &path, args.format)
}

/// Prints what was measured and where it went.
fn report(cal: &CpuCalibration, path: &Path, format: OutputFormat) -> Result<()> {
    let d = &cal.device;
    let adam = cal.adam_params_per_s.unwrap_or(0.0);
    let (dir, read, write) = match &cal.disk {
        Some(k) => (k.dir.display().to_string(), k.read_bandwidth, k.write_bandwidth),
        None => (String::new(), 0.0, 0.0),
    };
    match format {
        OutputFormat::Json => {
            let v = json!({
                "matmul_flops": d.fp32_flops,
                "memory_bandwidth": d.memory_bandwidth,
                "thread_copy_bandwidth": cal.intra.bandwidth,
                "adam_params_per_s": adam,
                "disk_write_bandwidth": write,
                "disk_read_bandwidth": read,
                "offload_dir": dir,
                "memory_bytes": d.memory_bytes,
                "threads": num_threads(),
                "path": path.display().to_string(),
            });
            print_stdout(&format!("{v}\n"))
        }
        OutputFormat::Table => print_stdout(&format!(
            "threads                 {}\n\
             f32 matmul              {}FLOP/s\n\
             memory bandwidth        {}B/s\n\
             thread-to-thread copy   {}B/s\n\
             AdamW (fp32)            {} params/s\n\
             disk write              {}B/s\n\
             disk read               {}B/s ({dir})\n\
             memory                  {}\n\
             written to              {}\n",
            num_threads(),
            count(d.fp32_flops as u64),
            count(d.memory_bandwidth as u64),
            count(cal.intra.bandwidth as u64),
            count(adam as u64),
            count(write as u64),
            count(read as u64),
            bytes(d.memory_bytes),
            path.display()
        )),
    }
}

fn write(cal: &CpuCalibration, path: &Path) -> Result<()> {
    cal.validate().context("the measured CPU figures are unusable")?;
    cal.save(path)?;
    Ok(())
}

fn num_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Seconds of the fastest of `runs` calls of `f`, after one warm-up call.
fn best_of(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
        .max(1e-9)
}

/// f32 `C = A·B`, row-major, on all threads; the best rate over n = 1024 and 2048.
fn measure_matmul_flops() -> f64 {
    [(1024, 5), (2048, 2)]
        .into_iter()
        .map(|(n, runs)| {
            let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 * 0.1).collect();
            let b: Vec<f32> = (0..n * n).map(|i| (i % 5) as f32 * 0.1).collect();
            let mut c = vec![0f32; n * n];
            let ld = n as isize;
            let secs = best_of(runs, || {
                // SAFETY: a, b and c are n×n row-major buffers (column stride 1, row stride n),
                // so gemm reads and writes exactly their elements; c does not alias a or b.
                unsafe {
                    gemm::gemm(
                        n,
                        n,
                        n,
                        c.as_mut_ptr(),
                        1,
                        ld,
                        false,
                        a.as_ptr(),
                        1,
                        ld,
                        b.as_ptr(),
                        1,
                        ld,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::Rayon(0),
                    )
                }
            });
            std::hint::black_box(&c);
            2.0 * (n * n * n) as f64 / secs
        })
        .fold(0.0, f64::max)
}

/// A 256 MiB copy split over all threads; counts bytes read plus bytes written (as STREAM's
/// copy does).
fn measure_memory_bandwidth() -> f64 {
    const LEN: usize = 256 << 20;
    let src = vec![1u8; LEN];
    let mut dst = vec![2u8; LEN];
    let threads = num_threads();
    let chunk = LEN.div_ceil(threads);
    let secs = best_of(3, || {
        std::thread::scope(|s| {
            for (d, from) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(from));
            }
        });
    });
    std::hint::black_box(&dst);
    2.0 * LEN as f64 / secs
}

/// One thread writes a 64 MiB buffer, another copies it into its own: bytes moved per second
/// (the best of 3, after a warm-up), the rate at which one "device" hands a tensor to another
/// on this host.
fn measure_thread_copy_bandwidth() -> f64 {
    const LEN: usize = 64 << 20;
    let mut shared = vec![0u8; LEN];
    let mut own = vec![1u8; LEN];
    let mut best = f64::INFINITY;
    for round in 0..4u8 {
        std::thread::scope(|s| {
            s.spawn(|| shared.fill(round.wrapping_add(7)));
        });
        let secs = std::thread::scope(|s| {
            s.spawn(|| {
                let t = Instant::now();
                own.copy_from_slice(&shared);
                t.elapsed().as_secs_f64()
            })
            .join()
            .unwrap_or(f64::INFINITY)
        });
        if round > 0 {
            best = best.min(secs.max(1e-9));
        }
    }
    std::hint::black_box(&own);
    LEN as f64 / best
}

/// `MemTotal` from /proc/meminfo, bytes.
fn total_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Parameters per second our AdamW kernel updates on all threads: `n` fp32 parameters with
/// fp32 gradient and moments (no master copy), the best of 3 steps after a warm-up.
fn measure_adam_params_per_s(n: usize) -> Result<f64> {
    use candle_core::{Device, Tensor};
    use tessera_ir::{AdamWSpec, Op, TensorMeta};
    let cpu = Device::Cpu;
    // Separate buffers: the kernel refuses operands that share storage.
    let vec = |x: f32| Tensor::from_vec(vec![x; n], n, &cpu);
    let (param, grad, m, v) = (vec(0.5)?, vec(1e-3)?, vec(0.0)?, vec(0.0)?);
    let (lr, step, norm) =
        (Tensor::new(1e-4f32, &cpu)?, Tensor::new(1i64, &cpu)?, Tensor::new(1f32, &cpu)?);
    let op = Op::AdamW(AdamWSpec {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        max_grad_norm: Some(1.0),
        grad_scale: false,
    });
    let meta = TensorMeta::new(vec![n], tessera_ir::DType::F32);
    let out = [meta.clone(), meta.clone(), meta];
    let inputs = [&param, &grad, &m, &v, &lr, &step, &norm];
    let mut failed = None;
    let secs = best_of(3, || {
        if let Err(e) = tessera_runtime::kernels::execute(&op, &inputs, &out) {
            failed.get_or_insert(e);
        }
    });
    if let Some(e) = failed {
        return Err(e).context("timing the AdamW kernel");
    }
    Ok(n as f64 / secs)
}

/// Sequential bandwidths of the disk under `dir`: a file of `len` bytes written in 8 MiB
/// chunks and synced (the write time includes the sync), then read back with the page cache
/// dropped for it, then deleted.
fn measure_disk(dir: &Path, len: usize) -> Result<DiskCalibration> {
    let d = dir.display();
    if !dir.is_dir() {
        bail!(
            "the offload directory `{d}` does not exist or is not a directory; create it or pass \
             another with --offload-dir DIR"
        );
    }
    let file = dir.join(format!(".tessera-calibrate-{}.tmp", std::process::id()));
    let _cleanup = RemoveOnDrop(file.clone());
    let f = file.display();
    let fix = "choose a writable directory with --offload-dir DIR";
    let chunk: Vec<u8> = (0..8usize << 20).map(|i| (i % 251) as u8).collect();
    let t = Instant::now();
    let mut out = std::fs::File::create(&file)
        .with_context(|| format!("cannot create the test file `{f}`; {fix}"))?;
    let mut left = len;
    while left > 0 {
        let n = left.min(chunk.len());
        out.write_all(&chunk[..n])
            .with_context(|| format!("cannot write the test file `{f}` (disk full?); {fix}"))?;
        left -= n;
    }
    out.sync_all().with_context(|| format!("cannot sync the test file `{f}`; {fix}"))?;
    let write_secs = t.elapsed().as_secs_f64().max(1e-9);
    drop(out);

    let mut input =
        std::fs::File::open(&file).with_context(|| format!("cannot reopen the test file `{f}`"))?;
    drop_cached_pages(&input);
    let mut buf = vec![0u8; chunk.len()];
    let (t, mut read) = (Instant::now(), 0usize);
    loop {
        let n = input.read(&mut buf).with_context(|| format!("cannot read the test file `{f}`"))?;
        if n == 0 {
            break;
        }
        read += n;
    }
    let read_secs = t.elapsed().as_secs_f64().max(1e-9);
    if read != len {
        bail!(
            "read {read} bytes of the test file `{f}`, wrote {len}; is another process using it?"
        );
    }
    Ok(DiskCalibration {
        dir: dir.to_path_buf(),
        read_bandwidth: len as f64 / read_secs,
        write_bandwidth: len as f64 / write_secs,
    })
}

/// Deletes the disk measurement's file however the measurement ends.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Asks the kernel to drop `file`'s (clean, just synced) pages from the page cache, so that
/// reading it measures the disk, not memory. Best effort: elsewhere than 64-bit Linux, or on
/// tmpfs (whose pages are the storage), the read comes from memory.
#[cfg(all(target_os = "linux", target_pointer_width = "64", not(target_arch = "s390x")))]
fn drop_cached_pages(file: &std::fs::File) {
    use std::os::fd::AsRawFd;
    extern "C" {
        fn posix_fadvise(fd: i32, offset: i64, len: i64, advice: i32) -> i32;
    }
    /// `POSIX_FADV_DONTNEED` on Linux (all 64-bit targets but s390x).
    const DONTNEED: i32 = 4;
    // SAFETY: posix_fadvise is glibc's/musl's (std links libc), with the 64-bit Linux ABI
    // declared above (off_t is i64); it only reads its integer arguments, and `file` keeps the
    // descriptor open for the call. A failure only leaves the pages cached.
    let _ = unsafe { posix_fadvise(file.as_raw_fd(), 0, 0, DONTNEED) };
}

#[cfg(not(all(target_os = "linux", target_pointer_width = "64", not(target_arch = "s390x"))))]
fn drop_cached_pages(_file: &std::fs::File) {}
