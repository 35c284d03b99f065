use candle_core::{DType, Device, Tensor};
use std::time::Instant;
use tessera_ir::{AdamWSpec, Op};
use tessera_runtime::kernels::execute;
use tessera_runtime::tensor::meta_of;
fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = a[0].parse().unwrap();
    let bf = a.get(1).map(|s| s == "bf16").unwrap_or(false);
    let cpu = &Device::Cpu;
    let f = |s: f32| (Tensor::randn(0f32, 1., &[n], cpu).unwrap() * s as f64).unwrap();
    let (p32, g32, m, v) = (f(1.0), f(1.0), f(0.1), f(0.1).sqr().unwrap());
    let (p, g) = if bf {
        (p32.to_dtype(DType::BF16).unwrap(), g32.to_dtype(DType::BF16).unwrap())
    } else {
        (p32.clone(), g32)
    };
    let lr = Tensor::new(1e-3f32, cpu).unwrap();
    let step = Tensor::new(3i64, cpu).unwrap();
    let norm = Tensor::new(5f32, cpu).unwrap();
    let spec = AdamWSpec {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        max_grad_norm: Some(1.0),
        grad_scale: false,
    };
    let op = Op::AdamW(spec);
    let mut ins = vec![&p, &g, &m, &v, &lr, &step, &norm];
    if bf {
        ins.push(&p32);
    }
    let metas: Vec<_> = ins.iter().map(|t| meta_of(t).unwrap()).collect();
    let out = op.infer(&metas.iter().collect::<Vec<_>>()).unwrap();
    execute(&op, &ins, &out).unwrap();
    let t = Instant::now();
    let r = 10;
    for _ in 0..r {
        execute(&op, &ins, &out).unwrap();
    }
    let s = t.elapsed().as_secs_f64() / r as f64;
    let bytes = if bf { 2 + 8 + 8 + 8 + 2 } else { 4 + 4 + 8 + 8 } as f64;
    println!(
        "adamw n={n} bf16={bf}: {:.1} ms, {:.1} GB/s (bytes touched once each way)",
        s * 1e3,
        n as f64 * bytes * 2.0 / s / 1e9 * 0.5 * 2.0
    );
}
