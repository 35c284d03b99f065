//! How far a bf16 training run's loss curve strays from the fp32 run's: the Tessera side of
//! BENCHMARKS.md's "Training: loss curves against the CPU" (the PyTorch side is
//! `scripts/torch-bf16-spread.py`; `scripts/bf16-seeds.sh` runs both). 50 AdamW steps of the
//! shipped corpus; the max |Δloss| and the max relative |Δloss| / |loss_fp32| over the steps.
//!
//! ```sh
//! # the GPU check's curve (init seed 7, data seed 3), and the same with lr one f32 ulp higher
//! cargo run --release -p tessera-cuda --example bf16_spread -- --check
//! # seeds 0..8 (init seed s, data seed s + 100)
//! cargo run --release -p tessera-cuda --example bf16_spread -- --seeds 8
//! # the same as JSON lines (one per model and seed, then a summary per model), on a GPU, both
//! # models, each seed's initial weights (a Hugging Face directory) and batches dumped to DIR
//! # for `torch-bf16-spread.py --from DIR`
//! bf16_spread --model gpt2-tiny,llama-tiny --seeds 8 --device cuda --dump DIR --json
//! # other settings: --model gpt2-tiny, --batch 8, --seq 128, --lr 1e-3, --cosine
//! ```
//!
//! `--dump DIR` writes, per model and seed, `DIR/<model>/seed<s>/`: `config.json` and
//! `model.safetensors` (the fp32 run's exact initial weights, under their Hugging Face names,
//! as `transformers`' `from_pretrained` loads them), `batches.json` (the 50 steps' input ids
//! and targets, `[batch, seq]` each, with the run's learning rate and AdamW settings) and,
//! once trained, `tessera.json` (both loss curves and the device they ran on). With
//! `--dump-only` it writes the first three and trains nothing (the initial weights do not
//! depend on the backend), so the PyTorch side can run beside Tessera's training.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use serde_json::json;
use tessera_ir::{DType, TrainConfig};
use tessera_runtime::checkpoint::{Checkpoint, Manifest};
use tessera_runtime::data::{Batch, Dataset, Tokenizer};
use tessera_runtime::{Backend, CpuBackend, LrSchedule, Trainer};

const STEPS: usize = 50;

struct Setting {
    model: String,
    batch: usize,
    seq: usize,
    lr: f64,
    cosine: bool,
}

impl Setting {
    fn schedule(&self, lr: f64) -> LrSchedule {
        if self.cosine {
            // `tessera train`'s default schedule: 5% warmup, cosine to lr/10.
            let total = STEPS as u64;
            LrSchedule::WarmupCosine { peak: lr, min_lr: lr * 0.1, warmup: total / 20, total }
        } else {
            LrSchedule::Constant { lr }
        }
    }
}

/// Where the runs train.
enum Device {
    Cpu,
    Cuda(Arc<tessera_cuda::Gpu>),
}

impl Device {
    fn name(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
        }
    }
}

/// The `STEPS` batches of data seed `data_seed` (step k's batch is drawn for step k + 1).
fn batches(s: &Setting, data_seed: u64) -> Vec<Batch> {
    let text = include_str!("../../../data/shakespeare.txt");
    let data = Dataset::from_text(text, &Tokenizer::Byte).expect("corpus");
    (0..STEPS)
        .map(|k| data.train_batch(data_seed, k as u64 + 1, s.batch, s.seq).expect("batch"))
        .collect()
}

/// The loss of every step, and with `want_init` the parameters before the first step.
type Curve = (Vec<f64>, Option<Vec<(String, Tensor)>>);

fn train<B: Backend>(mut t: Trainer<B>, data: &[Batch], want_init: bool) -> Curve {
    // `parameters` gives live handles, which AdamW updates in place: copy them.
    let init = want_init.then(|| {
        let live = t.parameters().expect("parameters");
        live.into_iter().map(|(n, v)| (n, v.copy().expect("copy"))).collect()
    });
    let losses = data.iter().map(|b| t.step(&b.inputs, &b.targets).expect("step").loss).collect();
    (losses, init)
}

fn curve(
    s: &Setting,
    device: &Device,
    dtype: DType,
    lr: f64,
    seed: u64,
    data: &[Batch],
    want_init: bool,
) -> Curve {
    let graph = tessera_cuda::fixtures::training_graph(&s.model, s.batch, s.seq, dtype)
        .expect("a language-model preset");
    let schedule = s.schedule(lr);
    match device {
        Device::Cpu => {
            let t = Trainer::single(graph, CpuBackend::new(0), schedule, seed, None);
            train(t.expect("trainer"), data, want_init)
        }
        Device::Cuda(gpu) => {
            let backend = tessera_cuda::CudaBackend::new(gpu.clone());
            let t = Trainer::single(graph, backend, schedule, seed, None);
            train(t.expect("trainer"), data, want_init)
        }
    }
}

/// Seed `seed`'s initial parameters, as a fresh fp32 run on any backend starts from (the init
/// is drawn on the host, keyed by seed, name and element index).
fn initial_params(s: &Setting, seed: u64) -> Vec<(String, Tensor)> {
    let graph = tessera_cuda::fixtures::training_graph(&s.model, s.batch, s.seq, DType::F32)
        .expect("a language-model preset");
    let t = Trainer::single(graph, CpuBackend::new(0), s.schedule(s.lr), seed, None);
    t.expect("trainer").parameters().expect("parameters")
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// `(max_k |a_k − b_k| / |b_k|, its step, 1-based)`.
fn max_rel(a: &[f64], b: &[f64]) -> (f64, usize) {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs())
        .enumerate()
        .fold((0.0, 0), |best, (k, r)| if r > best.0 { (r, k + 1) } else { best })
}

/// The median of `v` (the mean of the middle two for an even count).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn write_json(path: &Path, value: &serde_json::Value) {
    let text = serde_json::to_string(value).expect("json");
    std::fs::write(path, text + "\n").unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Seed `seed`'s initial weights as a Hugging Face directory, and its batches, into `dir`.
fn dump_start(
    s: &Setting,
    dir: &Path,
    seed: u64,
    data_seed: u64,
    params: Vec<(String, Tensor)>,
    data: &[Batch],
) {
    let cfg = tessera_models::ModelConfig::resolve(&s.model).expect("preset");
    let params: HashMap<String, Tensor> = params.into_iter().collect();
    for (name, t) in &params {
        assert_eq!(t.dtype(), candle_core::DType::F32, "{name}: the fp32 run's weights");
    }
    let ckpt = Checkpoint {
        manifest: Manifest::new(0, STEPS as u64, seed, s.model.clone(), s.schedule(s.lr)),
        params,
        optimizer: HashMap::new(),
        config_json: cfg.to_hf_json(),
        // The checkpoint lives in memory only: its directory must not be the export's (the
        // export guard refuses to replace the checkpoint it exports), so name a sibling that
        // is never written.
        dir: dir.with_extension("in-memory"),
    };
    tessera_runtime::dist_checkpoint::export_hf(&ckpt, dir, true).expect("export");
    let tc = TrainConfig::default();
    let rows = |f: fn(&Batch) -> &Vec<i64>| -> Vec<Vec<Vec<i64>>> {
        data.iter().map(|b| f(b).chunks(s.seq).map(<[i64]>::to_vec).collect()).collect()
    };
    write_json(
        &dir.join("batches.json"),
        &json!({
            "model": s.model,
            "seed": seed,
            "data_seed": data_seed,
            "steps": STEPS,
            "batch": s.batch,
            "seq": s.seq,
            "lr": s.lr,
            // What the trainer binds: the learning rate as an f32.
            "lr_f32": s.lr as f32 as f64,
            "schedule": "constant",
            "adamw": {
                "beta1": tc.beta1,
                "beta2": tc.beta2,
                "eps": tc.eps,
                "weight_decay": tc.weight_decay,
                // `build_training_graph`: decay applies to parameters of rank ≥ 2 only.
                "decay_min_rank": 2,
                "max_grad_norm": tc.max_grad_norm,
            },
            "loss": "mean cross-entropy over all targets",
            "inputs": rows(|b| &b.inputs),
            "targets": rows(|b| &b.targets),
        }),
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .map(|i| args.get(i + 1).unwrap_or_else(|| panic!("{flag} needs a value")).clone())
    };
    let num = |flag: &str, default: f64| {
        value(flag).map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{flag}: {v}?")))
    };
    let has = |flag: &str| args.iter().any(|a| a == flag);
    let device = match value("--device").as_deref().unwrap_or("cpu") {
        "cpu" => Device::Cpu,
        "cuda" => match tessera_cuda::Gpu::open(0) {
            Ok(gpu) => Device::Cuda(gpu),
            Err(e) => {
                eprintln!("bf16_spread: --device cuda: {e}");
                std::process::exit(2);
            }
        },
        other => panic!("--device {other}? (cpu or cuda)"),
    };
    let models = value("--model").unwrap_or_else(|| "llama-tiny".into());
    let dump = value("--dump").map(PathBuf::from);
    let json_out = has("--json");
    let cosine = has("--cosine");
    if dump.is_some() && cosine {
        panic!("--dump writes a constant-lr run for torch-bf16-spread.py: drop --cosine");
    }
    for model in models.split(',') {
        let s = Setting {
            model: model.to_string(),
            batch: num("--batch", 4.0) as usize,
            seq: num("--seq", 64.0) as usize,
            lr: num("--lr", 3e-4),
            cosine,
        };
        if has("--check") {
            let data = batches(&s, 3);
            let (f32c, _) = curve(&s, &device, DType::F32, s.lr, 7, &data, false);
            let (bf16, _) = curve(&s, &device, DType::BF16, s.lr, 7, &data, false);
            let lr_ulp = f32::from_bits((s.lr as f32).to_bits() + 1) as f64;
            let (bf16_ulp, _) = curve(&s, &device, DType::BF16, lr_ulp, 7, &data, false);
            println!(
                "{}: bf16 vs fp32 {:.2e}; bf16 with lr + 1 ulp vs bf16 {:.2e}; fp32 loss at step {STEPS}: {:.4}",
                s.model,
                max_diff(&bf16, &f32c),
                max_diff(&bf16_ulp, &bf16),
                f32c[STEPS - 1]
            );
            continue;
        }
        let mut rels = Vec::new();
        let mut abss = Vec::new();
        let seeds = num("--seeds", 8.0) as u64;
        if has("--dump-only") {
            let root = dump.as_ref().expect("--dump-only needs --dump DIR");
            for seed in 0..seeds {
                let data_seed = seed + 100;
                let dir = root.join(&s.model).join(format!("seed{seed}"));
                std::fs::create_dir_all(dir.parent().expect("parent")).expect("dump dir");
                let data = batches(&s, data_seed);
                dump_start(&s, &dir, seed, data_seed, initial_params(&s, seed), &data);
            }
            continue;
        }
        for seed in 0..seeds {
            let data_seed = seed + 100;
            let data = batches(&s, data_seed);
            let started = Instant::now();
            let (f32c, init) = curve(&s, &device, DType::F32, s.lr, seed, &data, dump.is_some());
            let (bf16, _) = curve(&s, &device, DType::BF16, s.lr, seed, &data, false);
            let secs = started.elapsed().as_secs_f64();
            let (rel, rel_step) = max_rel(&bf16, &f32c);
            let abs = max_diff(&bf16, &f32c);
            rels.push(rel);
            abss.push(abs);
            if let (Some(root), Some(init)) = (&dump, init) {
                let dir = root.join(&s.model).join(format!("seed{seed}"));
                std::fs::create_dir_all(dir.parent().expect("parent")).expect("dump dir");
                dump_start(&s, &dir, seed, data_seed, init, &data);
                write_json(
                    &dir.join("tessera.json"),
                    &json!({ "device": device.name(), "fp32": f32c, "bf16": bf16 }),
                );
            }
            if json_out {
                let line = json!({
                    "side": "tessera",
                    "device": device.name(),
                    "model": s.model,
                    "seed": seed,
                    "data_seed": data_seed,
                    "max_rel": rel,
                    "max_rel_step": rel_step,
                    "max_abs": abs,
                    "first_fp32": f32c[0],
                    "first_bf16": bf16[0],
                    "final_fp32": f32c[STEPS - 1],
                    "final_bf16": bf16[STEPS - 1],
                    "secs": secs,
                });
                println!("{line}");
            } else {
                println!(
                    "{} seed {seed}: bf16 vs fp32 {abs:.2e} (relative {rel:.2e}); fp32 loss at step {STEPS}: {:.4}",
                    s.model,
                    f32c[STEPS - 1]
                );
            }
        }
        let worst = (0..rels.len()).max_by(|&a, &b| rels[a].total_cmp(&rels[b]));
        if json_out {
            let line = json!({
                "side": "tessera",
                "summary": true,
                "device": device.name(),
                "model": s.model,
                "seeds": seeds,
                "median_max_rel": median(&rels),
                "worst_seed": worst,
                "worst_max_rel": worst.map(|w| rels[w]),
                "median_max_abs": median(&abss),
                "worst_max_abs": abss.iter().copied().fold(0.0, f64::max),
            });
            println!("{line}");
        } else if let Some(w) = worst {
            println!(
                "{}: median over {seeds} seeds: relative {:.2e}, absolute {:.2e}; worst seed {w} ({:.2e})",
                s.model,
                median(&rels),
                median(&abss),
                rels[w]
            );
        }
    }
}
