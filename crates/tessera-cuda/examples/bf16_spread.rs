//! How far a CPU bf16 training run's loss curve strays from the fp32 run's: the Tessera side
//! of BENCHMARKS.md's "Training: loss curves against the CPU" (the PyTorch side is
//! `scripts/torch-bf16-spread.py`). 50 AdamW steps of the shipped corpus, max |Δloss|.
//!
//! ```sh
//! # the GPU check's curve (init seed 7, data seed 3), and the same with lr one f32 ulp higher
//! cargo run --release -p tessera-cuda --example bf16_spread -- --check
//! # seeds 0..8 (init seed s, data seed s + 100)
//! cargo run --release -p tessera-cuda --example bf16_spread -- --seeds 8
//! # other settings: --model gpt2-tiny, --batch 8, --seq 128, --lr 1e-3, --cosine
//! ```

use tessera_ir::DType;
use tessera_runtime::data::{Dataset, Tokenizer};
use tessera_runtime::{CpuBackend, LrSchedule, Trainer};

const STEPS: usize = 50;

struct Setting {
    model: String,
    batch: usize,
    seq: usize,
    lr: f64,
    cosine: bool,
}

fn curve(s: &Setting, dtype: DType, lr: f64, seed: u64, data_seed: u64) -> Vec<f64> {
    let graph = tessera_cuda::fixtures::training_graph(&s.model, s.batch, s.seq, dtype)
        .expect("a language-model preset");
    let schedule = if s.cosine {
        // `tessera train`'s default schedule: 5% warmup, cosine to lr/10.
        let total = STEPS as u64;
        LrSchedule::WarmupCosine { peak: lr, min_lr: lr * 0.1, warmup: total / 20, total }
    } else {
        LrSchedule::Constant { lr }
    };
    let mut t = Trainer::single(graph, CpuBackend::new(0), schedule, seed, None).expect("trainer");
    let text = include_str!("../../../data/shakespeare.txt");
    let data = Dataset::from_text(text, &Tokenizer::Byte).expect("corpus");
    (0..STEPS)
        .map(|k| {
            let b = data.train_batch(data_seed, k as u64 + 1, s.batch, s.seq).expect("batch");
            t.step(&b.inputs, &b.targets).expect("step").loss
        })
        .collect()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
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
    let s = Setting {
        model: value("--model").unwrap_or_else(|| "llama-tiny".into()),
        batch: num("--batch", 4.0) as usize,
        seq: num("--seq", 64.0) as usize,
        lr: num("--lr", 3e-4),
        cosine: args.iter().any(|a| a == "--cosine"),
    };
    if args.iter().any(|a| a == "--check") {
        let f32c = curve(&s, DType::F32, s.lr, 7, 3);
        let bf16 = curve(&s, DType::BF16, s.lr, 7, 3);
        let lr_ulp = f32::from_bits((s.lr as f32).to_bits() + 1) as f64;
        let bf16_ulp = curve(&s, DType::BF16, lr_ulp, 7, 3);
        println!(
            "{}: bf16 vs fp32 {:.2e}; bf16 with lr + 1 ulp vs bf16 {:.2e}; fp32 loss at step {STEPS}: {:.4}",
            s.model,
            max_diff(&bf16, &f32c),
            max_diff(&bf16_ulp, &bf16),
            f32c[STEPS - 1]
        );
        return;
    }
    for seed in 0..num("--seeds", 8.0) as u64 {
        let f32c = curve(&s, DType::F32, s.lr, seed, seed + 100);
        let bf16 = curve(&s, DType::BF16, s.lr, seed, seed + 100);
        println!(
            "{} seed {seed}: bf16 vs fp32 {:.2e}; fp32 loss at step {STEPS}: {:.4}",
            s.model,
            max_diff(&bf16, &f32c),
            f32c[STEPS - 1]
        );
    }
}
