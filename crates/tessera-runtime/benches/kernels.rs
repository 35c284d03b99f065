//! Micro benchmarks of the heavy CPU kernels, reported in GFLOP/s.
//!
//! Criterion's throughput is set to the FLOP count of one call, so its `elem/s` figures read
//! as FLOP/s; a short manual timing after each group prints GFLOP/s explicitly. FLOPs follow
//! the IR's conventions: matmul 2·m·n·k; attention forward 4·B·H·S·T·D and backward twice
//! that, with no causal discount (a causal run does about half that work).
//!
//! Weight-only quantised matmul (`QMatMul`, int8 per row and int4 in groups of 128) runs next
//! to the f32 matmul of the same product, `x [M, K] · W [N, K]ᵀ`, at decode shapes (M = 1
//! and 8 rows, GPT-2's MLP up-projection K = 768, N = 3072) and a prefill shape
//! (M = 512, K = N = 768).
//!
//! Convolutions (forward, backward-data, backward-filter) run at a ResNet stage's shape,
//! `[8, 64, 56, 56]` through a 3×3 kernel with padding 1, and a pointwise 1×1 projection
//! `256 → 64`; their FLOPs are the IR's `2·N·O·Ho·Wo·(C/g)·kh·kw`.
//!
//! bf16 matmul (bf16 operands, f32 accumulation, bf16 result: the `--dtype bf16` path on a
//! CPU with AVX512_BF16) runs at the f32 matmul's shapes and at attention's two products
//! (`[B·H, S, D] · [B·H, S, D]ᵀ` and `[B·H, S, S] · [B·H, S, D]`), each printed beside the f32
//! figure of the same product.
//!
//! `cargo bench -p tessera-runtime --bench kernels -- --quick` (a filter such as `bf16` also
//! limits the printed GFLOP/s timings to the cases whose names contain it).

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::time::{Duration, Instant};
use tessera_ir::{AttentionSpec, Conv2dSpec, DType, Op, QuantSpec, Shape, TensorMeta};
use tessera_runtime::kernels::{execute, Bf16Kernel};
use tessera_runtime::quantize::quantize;
use tessera_runtime::tensor::meta_of;

fn rand(dims: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1f32, dims, &Device::Cpu).unwrap()
}

fn metas(op: &Op, x: &[&Tensor]) -> Vec<TensorMeta> {
    let m: Vec<TensorMeta> = x.iter().map(|t| meta_of(t).unwrap()).collect();
    op.infer(&m.iter().collect::<Vec<_>>()).unwrap()
}

/// Whether a timing named `name` is wanted: it contains one of the command line's filters
/// (the arguments that are not flags), or there are none.
fn wanted(name: &str) -> bool {
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()))
}

/// Runs `f` for about a second and prints its GFLOP/s (nothing when filtered out).
fn report(name: &str, flops: u64, f: impl FnMut()) {
    if let Some(gflops) = timed(name, flops, f) {
        println!("{name}: {gflops}");
    }
}

/// Times `f` for about a second: its ms/call, GFLOP/s and threads as text, or `None` when the
/// filters leave `name` out.
fn timed(name: &str, flops: u64, mut f: impl FnMut()) -> Option<String> {
    if !wanted(name) {
        return None;
    }
    f();
    let (start, mut iters) = (Instant::now(), 0u32);
    while start.elapsed() < Duration::from_secs(1) || iters < 3 {
        f();
        iters += 1;
    }
    let secs = start.elapsed().as_secs_f64() / iters as f64;
    Some(format!(
        "{:.2} ms/call, {:.1} GFLOP/s ({} threads)",
        secs * 1e3,
        flops as f64 / secs / 1e9,
        rayon::current_num_threads()
    ))
}

fn bench_matmul(c: &mut Criterion) {
    let (m, k, n) = (1024, 768, 3072);
    let a = rand(&[m, k]);
    let b = rand(&[k, n]);
    let wt = rand(&[n, k]);
    let flops = 2 * (m * k * n) as u64;
    let mut g = c.benchmark_group("matmul");
    g.throughput(Throughput::Elements(flops));
    for (name, op, rhs) in [
        ("1024x768 @ 768x3072", Op::MatMul { trans_a: false, trans_b: false }, &b),
        ("1024x768 @ (3072x768)T", Op::MatMul { trans_a: false, trans_b: true }, &wt),
    ] {
        let out = metas(&op, &[&a, rhs]);
        g.bench_function(name, |bch| bch.iter(|| execute(&op, &[&a, rhs], &out).unwrap()));
        report(&format!("matmul {name}"), flops, || {
            execute(&op, &[&a, rhs], &out).unwrap();
        });
    }
    g.finish();
}

fn bench_matmul_bf16(c: &mut Criterion) {
    if Bf16Kernel::native().is_none() {
        println!("matmul bf16: this CPU has no AVX512_BF16 (bf16 products run on f32 upcasts)");
        return;
    }
    let (bh, s, d) = (4 * 12, 256, 64);
    // (name, [batch, m, k, n], trans_a, trans_b): GPT-2's layer product, attention's two, and
    // gpt2-tiny's narrow ones (k = 256; a weight gradient, whose lhs is read transposed).
    let cases = [
        ("1024x768 @ 768x3072", [1, 1024, 768, 3072], false, false),
        ("1024x768 @ (3072x768)T", [1, 1024, 768, 3072], false, true),
        ("attention 48x[256x64 @ (256x64)T]", [bh, s, d, s], false, true),
        ("attention 48x[256x256 @ 256x64]", [bh, s, s, d], false, false),
        ("2048x256 @ 256x256", [1, 2048, 256, 256], false, false),
        ("(2048x256)T @ 2048x256", [1, 256, 2048, 256], true, false),
    ];
    let mut g = c.benchmark_group("matmul bf16");
    for (name, [batch, m, k, n], ta, tb) in cases {
        let op = Op::MatMul { trans_a: ta, trans_b: tb };
        let a = if ta { rand(&[batch, k, m]) } else { rand(&[batch, m, k]) };
        let b = if tb { rand(&[batch, n, k]) } else { rand(&[batch, k, n]) };
        let (a16, b16) = (
            a.to_dtype(candle_core::DType::BF16).unwrap(),
            b.to_dtype(candle_core::DType::BF16).unwrap(),
        );
        let (out, out16) = (metas(&op, &[&a, &b]), metas(&op, &[&a16, &b16]));
        let flops = 2 * (batch * m * k * n) as u64;
        g.throughput(Throughput::Elements(flops));
        g.bench_function(format!("bf16 {name}"), |bch| {
            bch.iter(|| execute(&op, &[&a16, &b16], &out16).unwrap())
        });
        let label = format!("matmul bf16 {name}");
        if let Some(bf16) = timed(&label, flops, || {
            execute(&op, &[&a16, &b16], &out16).unwrap();
        }) {
            let f32 = timed(&label, flops, || {
                execute(&op, &[&a, &b], &out).unwrap();
            });
            println!("{label}: {bf16}; f32: {}", f32.unwrap_or_default());
        }
    }
    g.finish();
}

fn bench_attention(c: &mut Criterion) {
    let (b, s, h, d) = (4, 256, 12, 64);
    let q = rand(&[b, s, h, d]);
    let k = rand(&[b, s, h, d]);
    let v = rand(&[b, s, h, d]);
    let dout = rand(&[b, s, h, d]);
    let fwd_flops = 4 * (b * h * s * s * d) as u64;
    let mut g = c.benchmark_group("attention B=4 S=256 H=12 D=64");
    for causal in [false, true] {
        let spec = AttentionSpec { causal, ..AttentionSpec::causal(d) };
        let fwd = Op::Attention(spec.clone());
        let bwd = Op::AttentionBackward(spec);
        let fwd_out = metas(&fwd, &[&q, &k, &v]);
        let y = execute(&fwd, &[&q, &k, &v], &fwd_out).unwrap();
        let bwd_in = [&q, &k, &v, &y[0], &y[1], &dout];
        let bwd_out = metas(&bwd, &bwd_in);
        let tag = if causal { "causal" } else { "full" };

        g.throughput(Throughput::Elements(fwd_flops));
        g.bench_function(format!("forward {tag}"), |bch| {
            bch.iter(|| execute(&fwd, &[&q, &k, &v], &fwd_out).unwrap())
        });
        g.throughput(Throughput::Elements(3 * fwd_flops));
        g.bench_function(format!("forward+backward {tag}"), |bch| {
            bch.iter(|| {
                let y = execute(&fwd, &[&q, &k, &v], &fwd_out).unwrap();
                execute(&bwd, &[&q, &k, &v, &y[0], &y[1], &dout], &bwd_out).unwrap()
            })
        });
        report(&format!("attention forward {tag}"), fwd_flops, || {
            execute(&fwd, &[&q, &k, &v], &fwd_out).unwrap();
        });
        report(&format!("attention backward {tag}"), 2 * fwd_flops, || {
            execute(&bwd, &bwd_in, &bwd_out).unwrap();
        });
        report(&format!("attention forward+backward {tag}"), 3 * fwd_flops, || {
            let y = execute(&fwd, &[&q, &k, &v], &fwd_out).unwrap();
            execute(&bwd, &[&q, &k, &v, &y[0], &y[1], &dout], &bwd_out).unwrap();
        });
    }
    g.finish();
}

fn bench_qmatmul(c: &mut Criterion) {
    for (m, k, n) in [(1, 768, 3072), (8, 768, 3072), (512, 768, 768)] {
        let x = rand(&[m, k]);
        let w = rand(&[n, k]);
        let flops = 2 * (m * k * n) as u64;
        let mut g = c.benchmark_group(format!("qmatmul M={m} K={k} N={n}"));
        g.throughput(Throughput::Elements(flops));
        let mm = Op::MatMul { trans_a: false, trans_b: true };
        let out = metas(&mm, &[&x, &w]);
        g.bench_function("f32 matmul", |bch| bch.iter(|| execute(&mm, &[&x, &w], &out).unwrap()));
        report(&format!("f32 matmul M={m} K={k} N={n}"), flops, || {
            execute(&mm, &[&x, &w], &out).unwrap();
        });
        for (name, q) in
            [("int8", QuantSpec { bits: 8, group: k }), ("int4", QuantSpec { bits: 4, group: 128 })]
        {
            let (codes, scales) = quantize(&w, q).unwrap();
            let op = Op::QMatMul(q);
            // (meta_of reads a candle u8 tensor as bool: the codes' meta is made here.)
            let wm = TensorMeta { shape: Shape::from(codes.dims()), dtype: DType::U8 };
            let ins = [meta_of(&x).unwrap(), wm, meta_of(&scales).unwrap()];
            let out = op.infer(&ins.iter().collect::<Vec<_>>()).unwrap();
            let args = [&x, &codes, &scales];
            g.bench_function(format!("qmatmul {name}"), |bch| {
                bch.iter(|| execute(&op, &args, &out).unwrap())
            });
            report(&format!("qmatmul {name} M={m} K={k} N={n}"), flops, || {
                execute(&op, &args, &out).unwrap();
            });
        }
        g.finish();
    }
}

fn bench_conv(c: &mut Criterion) {
    let s = Conv2dSpec { padding: [1, 1], ..Default::default() };
    let (x, w, dy) = (rand(&[8, 64, 56, 56]), rand(&[64, 64, 3, 3]), rand(&[8, 64, 56, 56]));
    let (x1, w1) = (rand(&[8, 256, 56, 56]), rand(&[64, 256, 1, 1]));
    let flops3 = 2 * 8 * 64 * 56 * 56 * 64 * 9;
    let flops1 = 2 * 8 * 64 * 56 * 56 * 256;
    let cases: [(&str, Op, Vec<&Tensor>, u64); 4] = [
        ("3x3 64->64 forward", Op::Conv2d(s), vec![&x, &w], flops3),
        (
            "3x3 64->64 backward-data",
            Op::Conv2dBackwardInput { spec: s, input_hw: [56, 56] },
            vec![&w, &dy],
            flops3,
        ),
        (
            "3x3 64->64 backward-filter",
            Op::Conv2dBackwardWeight { spec: s, kernel_hw: [3, 3] },
            vec![&x, &dy],
            flops3,
        ),
        ("1x1 256->64 forward", Op::Conv2d(Conv2dSpec::default()), vec![&x1, &w1], flops1),
    ];
    let mut g = c.benchmark_group("conv2d");
    for (name, op, args, flops) in cases {
        g.throughput(Throughput::Elements(flops));
        let out = metas(&op, &args);
        g.bench_function(name, |bch| bch.iter(|| execute(&op, &args, &out).unwrap()));
        report(&format!("conv2d {name} [8,C,56,56]"), flops, || {
            execute(&op, &args, &out).unwrap();
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = bench_matmul, bench_matmul_bf16, bench_attention, bench_qmatmul, bench_conv
}
criterion_main!(benches);
