//! `tessera calibrate`: measure this CPU — f32 matmul FLOP/s (gemm on all threads), memory
//! bandwidth (a parallel 256 MiB copy) and thread-to-thread copy bandwidth — and write them as
//! the `cpu` device preset (a [`CpuCalibration`] JSON) that `4xcpu` cluster strings read.
//!
//! Each figure is the best of a few runs, so it is an *achieved* rate: the preset's
//! efficiencies are 1.0. The whole run takes a few seconds.

use crate::format::{bytes, count};
use crate::profile_cmd::{print_stdout, OutputFormat};
use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tessera_plan::cluster::{cpu_calibration_path, CpuCalibration, CPU_PRESET_ENV};
use tessera_plan::{DeviceSpec, Link};

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// Where to write the preset (default: $TESSERA_CPU_PRESET, else
    /// $XDG_CONFIG_HOME/tessera/cpu.json, else ~/.config/tessera/cpu.json).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
}

/// Latency of a hand-off between two threads through shared memory (a cache-line round trip
/// plus a wake-up), seconds: not measured, a typical figure.
const THREAD_LATENCY_S: f64 = 2e-6;

pub fn run(args: &CalibrateArgs) -> Result<()> {
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
    let matmul_flops = measure_matmul_flops();
    let memory_bandwidth = measure_memory_bandwidth();
    let thread_copy_bandwidth = measure_thread_copy_bandwidth();
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
        },
        intra: Link { latency_s: THREAD_LATENCY_S, bandwidth: thread_copy_bandwidth },
    };
    write(&cal, &path)?;
    match args.format {
        OutputFormat::Json => {
            let v = json!({
                "matmul_flops": matmul_flops,
                "memory_bandwidth": memory_bandwidth,
                "thread_copy_bandwidth": thread_copy_bandwidth,
                "memory_bytes": memory_bytes,
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
             memory                  {}\n\
             written to              {}\n",
            num_threads(),
            count(matmul_flops as u64),
            count(memory_bandwidth as u64),
            count(thread_copy_bandwidth as u64),
            bytes(memory_bytes),
            path.display()
        )),
    }
}

fn write(cal: &CpuCalibration, path: &Path) -> Result<()> {
    cal.device.validate().context("the measured CPU figures are unusable")?;
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
