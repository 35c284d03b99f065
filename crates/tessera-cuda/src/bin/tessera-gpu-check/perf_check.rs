//! `host` and `flash-bench`: measurements that A/B the GEMM paths and the flash backwards in
//! one process, on the shapes of the 1.3B LLaMA's step.
//!
//! - `host`: what a matmul costs the host with an empty launch queue (so no launch waits for
//!   room in it), on each GEMM path (`TESSERA_GEMM`: cuBLASLt with plans kept, or
//!   `cublasGemmStridedBatchedEx` every call), beside a plain kernel's; each path's GPU time,
//!   and whether the two paths' products are the same bits.
//! - `flash-bench`: each flash backward's time on the LLaMA's attention (and GPT-2-medium's
//!   head dim 64, and a GQA, bidirectional case), and how far the second's gradients are from
//!   the first's at those sizes.

use candle_core::Tensor;
use std::sync::Arc;
use std::time::Instant;
use tessera_cuda::alloc::Purpose;
use tessera_cuda::{CudaBackend, CudaTensor, GemmPath, Gpu};
use tessera_ir::dist::MeshPos;
use tessera_ir::{AttentionSpec, DType, Op, Shape, TensorMeta};
use tessera_runtime::Backend;

fn meta(dims: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta { shape: Shape::from(dims), dtype }
}

/// A random bf16 tensor on the GPU (values uniform in [-1, 1)).
fn random(be: &CudaBackend, dims: &[usize], seed: u64) -> CudaTensor {
    let mut st = seed | 1;
    let v = crate::uniform(&mut st, dims.iter().product());
    let t = Tensor::from_vec(v, dims, &candle_core::Device::Cpu)
        .and_then(|t| t.to_dtype(candle_core::DType::BF16))
        .expect("random tensor");
    be.upload_as(&t, Purpose::Scratch).expect("upload")
}

fn bits(be: &CudaBackend, t: &CudaTensor) -> Vec<u16> {
    let h = be.download(t).expect("download").flatten_all().expect("flatten");
    h.to_vec1::<half::bf16>().expect("bf16").iter().map(|x| x.to_bits()).collect()
}

fn rel(a: &[u16], b: &[u16]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (half::bf16::from_bits(x).to_f64(), half::bf16::from_bits(y).to_f64());
        num += (x - y) * (x - y);
        den += y * y;
    }
    if num.is_nan() {
        return f64::INFINITY;
    }
    (num / den.max(1e-30)).sqrt()
}

/// Host seconds per call of `f` from an empty queue: `rounds` rounds of `per` calls, each
/// round after a synchronisation (the calls' own launches never fill the queue).
fn host_per_call(gpu: &Gpu, rounds: usize, per: usize, f: &mut dyn FnMut()) -> f64 {
    let mut host = 0.0;
    for _ in 0..rounds {
        gpu.synchronize().expect("sync");
        let t0 = Instant::now();
        for _ in 0..per {
            f();
        }
        host += t0.elapsed().as_secs_f64();
    }
    gpu.synchronize().expect("sync");
    host / (rounds * per) as f64
}

/// Wall seconds per call of `f`, queued back to back and synchronised at the end: its GPU time
/// when that is longer than its host time.
fn gpu_per_call(gpu: &Gpu, n: usize, f: &mut dyn FnMut()) -> f64 {
    gpu.synchronize().expect("sync");
    let t0 = Instant::now();
    for _ in 0..n {
        f();
    }
    gpu.synchronize().expect("sync");
    t0.elapsed().as_secs_f64() / n as f64
}

pub fn host(gpu: &Arc<Gpu>) {
    let be = CudaBackend::new(gpu.clone());
    let at = MeshPos::single();
    // The LLaMA 1.3B step's matmul kinds at 4 × 2048 tokens (hidden 2048, MLP 5504).
    let shapes = [
        ("x.Wt 8192x2048 2048x2048", [8192, 2048], [2048, 2048], false, true),
        ("x.Wt 8192x2048 5504x2048", [8192, 2048], [5504, 2048], false, true),
        ("dy.W 8192x5504 5504x2048", [8192, 5504], [5504, 2048], false, false),
        ("xt.dy 8192x2048 8192x5504", [8192, 2048], [8192, 5504], true, false),
    ];
    for (i, (name, ad, bd, ta, tb)) in shapes.into_iter().enumerate() {
        let a = random(&be, &ad, 11 + i as u64);
        let b = random(&be, &bd, 101 + i as u64);
        let m = if ta { ad[1] } else { ad[0] };
        let n = if tb { bd[0] } else { bd[1] };
        let out = [meta(&[m, n], DType::BF16)];
        let op = Op::MatMul { trans_a: ta, trans_b: tb };
        let mut row = Vec::new();
        let mut results = Vec::new();
        for path in [GemmPath::Legacy, GemmPath::Lt] {
            tessera_cuda::set_gemm_path(Some(path));
            let mut call = || {
                be.execute(&op, &[&a, &b], &out, &at).expect("matmul");
            };
            call(); // the plan, on the cuBLASLt path
            let host = host_per_call(gpu, 20, 10, &mut call);
            let dev = gpu_per_call(gpu, 20, &mut call);
            let y = be.execute(&op, &[&a, &b], &out, &at).expect("matmul");
            results.push(bits(&be, &y[0]));
            let tflops = 2.0 * (m * n) as f64 * ad[if ta { 0 } else { 1 }] as f64 / dev / 1e12;
            row.push(format!(
                "\"{path:?}\":{{\"host_us\":{:.2},\"gpu_us\":{:.1},\"tflops\":{tflops:.0}}}",
                host * 1e6,
                dev * 1e6
            ));
        }
        tessera_cuda::set_gemm_path(None);
        let differing = results[0].iter().zip(&results[1]).filter(|(x, y)| x != y).count();
        println!(
            "{{\"check\":\"host_matmul\",\"shape\":\"{name}\",{},\"bit_equal\":{},\"differing\":{differing},\"rel_diff\":{:e}}}",
            row.join(","),
            differing == 0,
            rel(&results[1], &results[0])
        );
    }
    let (calls, plans) = gpu.gemm_lt_counts();
    // A plain op for comparison: an elementwise kernel on a small tensor (allocation + launch).
    let x = random(&be, &[1024], 7);
    let op = Op::Unary(tessera_ir::UnaryOp::Silu);
    let out = [meta(&[1024], DType::BF16)];
    let unary = host_per_call(gpu, 20, 10, &mut || {
        be.execute(&op, &[&x], &out, &at).expect("unary");
    });
    println!(
        "{{\"check\":\"host_op\",\"unary_small_host_us\":{:.2},\"lt_calls\":{calls},\"lt_plans\":{plans}}}",
        unary * 1e6
    );
}

pub fn flash_bench(gpu: &Arc<Gpu>, fails: &mut Vec<String>) {
    let be = CudaBackend::new(gpu.clone());
    let at = MeshPos::single();
    // (name, b, s, h, hkv, d, causal): the LLaMA 1.3B's attention, GPT-2-medium's, and GQA
    // without the causal mask.
    let cases = [
        ("llama-1.3b", 4, 2048, 16, 16, 128, true),
        ("gpt2-medium", 4, 1024, 16, 16, 64, true),
        ("gqa-bidirectional", 2, 1024, 16, 4, 128, false),
    ];
    for (i, (name, b, s, h, hkv, d, causal)) in cases.into_iter().enumerate() {
        let spec = AttentionSpec { causal, ..AttentionSpec::causal(d) };
        let seed = 1000 * (i as u64 + 1);
        let q = random(&be, &[b, s, h, d], seed + 1);
        let k = random(&be, &[b, s, hkv, d], seed + 2);
        let v = random(&be, &[b, s, hkv, d], seed + 3);
        let dout = random(&be, &[b, s, h, d], seed + 4);
        let fwd = be
            .execute(
                &Op::Attention(spec.clone()),
                &[&q, &k, &v],
                &[meta(&[b, s, h, d], DType::BF16), meta(&[b, h, s], DType::F32)],
                &at,
            )
            .expect("attention");
        let outs = [
            meta(&[b, s, h, d], DType::BF16),
            meta(&[b, s, hkv, d], DType::BF16),
            meta(&[b, s, hkv, d], DType::BF16),
        ];
        let op = Op::AttentionBackward(spec.clone());
        let x = [&q, &k, &v, &fwd[0], &fwd[1], &dout];
        // The products the backward computes (S, dP, dV, dK, dQ), halved by the causal mask.
        let flops = 5.0 * 2.0 * (b * h * s * s * d) as f64 * if causal { 0.5 } else { 1.0 };
        let mut grads = Vec::new();
        let mut row = Vec::new();
        for version in [1u8, 2] {
            tessera_cuda::flash::set_backward_version(Some(version));
            let mut call = || {
                be.execute(&op, &x, &outs, &at).expect("attention backward");
            };
            call();
            let secs = gpu_per_call(gpu, 5, &mut call);
            let g = be.execute(&op, &x, &outs, &at).expect("attention backward");
            grads.push(g.iter().map(|t| bits(&be, t)).collect::<Vec<_>>());
            row.push(format!(
                "\"v{version}\":{{\"ms\":{:.3},\"tflops\":{:.0}}}",
                secs * 1e3,
                flops / secs / 1e12
            ));
        }
        tessera_cuda::flash::set_backward_version(None);
        let errs: Vec<f64> = (0..3).map(|j| rel(&grads[1][j], &grads[0][j])).collect();
        // Both round P and dS to bf16 the same way; they differ by the order of f32 sums.
        let ok = errs.iter().all(|e| *e <= 1e-2);
        println!(
            "{{\"check\":\"flash_bench\",\"case\":\"{name}\",\"b\":{b},\"s\":{s},\"h\":{h},\"hkv\":{hkv},\"d\":{d},\"causal\":{causal},{},\"v2_vs_v1_rel\":{{\"dq\":{:e},\"dk\":{:e},\"dv\":{:e}}},\"ok\":{ok}}}",
            row.join(","),
            errs[0],
            errs[1],
            errs[2]
        );
        if !ok {
            fails.push(format!("flash backward 2 against 1, {name}: {errs:?}"));
        }
    }
}
