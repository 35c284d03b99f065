//! The bf16 GEMM (f32 accumulation) against an f64 reference on the same bf16 values, through
//! every kernel (AMX tiles and `vdpbf16ps` where the CPU has them, and the portable one), then
//! the `MatMul` op on bf16 tensors (transposes, batch broadcasts, views) and a short bf16
//! training run against fp32 and against the f32-upcast path.
//!
//! Products of two bf16 values are exact in f32, so the kernel differs from exact arithmetic
//! only by the f32 rounding of its running sums: element-wise within `k · 2⁻²⁴ · Σ|a·b|`.

use candle_core::{DType, Device, Tensor};
use half::bf16;
use tessera_ir::dist::MeshPos;
use tessera_ir::interp::{eval_op, Value};
use tessera_ir::{build_training_graph, Op, TensorMeta, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_runtime::kernels::{execute, gemm_bf16_dense, Bf16Kernel};
use tessera_runtime::tensor::{meta_of, to_f64_vec};
use tessera_runtime::{Backend, CpuBackend, LrSchedule, Trainer};

/// xorshift64*: deterministic values in [-1, 1), rounded to bf16.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> bf16 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        bf16::from_f32(((r >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
    }
    fn vec(&mut self, n: usize) -> Vec<bf16> {
        (0..n).map(|_| self.next()).collect()
    }
    fn tensor(&mut self, dims: &[usize]) -> Tensor {
        let n = dims.iter().product();
        Tensor::from_vec(self.vec(n), dims, &Device::Cpu).unwrap()
    }
}

/// Every kernel this CPU runs; the native one must be there when the CPU says so (AMX first).
fn kernels() -> Vec<Bf16Kernel> {
    #[cfg(target_arch = "x86_64")]
    let (dp, amx) = (
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16"),
        // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE (std's detection of AMX is
        // unstable).
        std::arch::x86_64::__cpuid_count(7, 0).edx & (5 << 22) == 5 << 22,
    );
    #[cfg(not(target_arch = "x86_64"))]
    let (dp, amx) = (false, false);
    // Linux may refuse the tile state (an old kernel); then AMX is not offered.
    let amx = amx && Bf16Kernel::Amx.available();
    let want = if amx {
        Some(Bf16Kernel::Amx)
    } else if dp {
        Some(Bf16Kernel::Avx512Bf16)
    } else {
        None
    };
    assert_eq!(Bf16Kernel::native(), want, "dispatch follows the CPU's features");
    let mut k = vec![Bf16Kernel::Portable];
    if dp {
        k.push(Bf16Kernel::Avx512Bf16);
    }
    if amx {
        k.push(Bf16Kernel::Amx);
    }
    k
}

/// The kernel on every layout (each operand row- or column-major, with padded leading
/// dimensions), on tails of the 12 × 32 tile and of k's pairs, and on a k long enough to cut
/// m into several row blocks and n into several packed panels: f32 output within the
/// summation bound of the f64 reference, bf16 output its exact rounding, and the portable and
/// `vdpbf16ps` micro-kernels the same bits (`vdpbf16ps` adds the high products, then the low,
/// like the portable one; AMX's tiles add in the hardware's own order, held to the bound).
#[test]
fn gemm_bf16_matches_f64_on_every_layout_and_tail() {
    let mut rng = Rng::new(1);
    let mut shapes = Vec::new();
    for m in [1, 17, 33] {
        for n in [1, 33, 129] {
            for k in [1, 2, 17, 129] {
                shapes.push((m, n, k));
            }
        }
    }
    shapes.extend([(13, 31, 64), (40, 129, 4097), (97, 70, 100), (64, 64, 96)]);
    for (m, n, k) in shapes {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            // Stored with a padded leading dimension, so strides are not the shape.
            let (pad_a, pad_b) = (3, 5);
            let (ar, ac) = if ta { (k, m) } else { (m, k) };
            let (br, bc) = if tb { (n, k) } else { (k, n) };
            let a = rng.vec(ar * (ac + pad_a));
            let b = rng.vec(br * (bc + pad_b));
            let (lda, ldb) = ((ac + pad_a) as isize, (bc + pad_b) as isize);
            let lhs = if ta { (&a[..], 1, lda) } else { (&a[..], lda, 1) };
            let rhs = if tb { (&b[..], 1, ldb) } else { (&b[..], ldb, 1) };
            let at = |i: usize, p: usize| a[(i as isize * lhs.1 + p as isize * lhs.2) as usize];
            let bt = |p: usize, j: usize| b[(p as isize * rhs.1 + j as isize * rhs.2) as usize];
            let scale = 0.5f32;
            let mut bits: Option<Vec<u32>> = None;
            for kernel in kernels() {
                let (y32, y16) = gemm_bf16_dense(m, n, k, lhs, rhs, scale, kernel).unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let (mut want, mut mag) = (0f64, 0f64);
                        for p in 0..k {
                            let prod = at(i, p).to_f64() * bt(p, j).to_f64();
                            want += prod;
                            mag += prod.abs();
                        }
                        let (want, mag) = (want * scale as f64, mag * scale as f64);
                        let got = y32[i * n + j];
                        let bound = (k as f64 + 1.0) * 2f64.powi(-24) * mag + 1e-30;
                        assert!(
                            (got as f64 - want).abs() <= bound,
                            "{kernel:?} m{m} n{n} k{k} ta{ta} tb{tb} ({i},{j}): {got} vs {want}"
                        );
                        assert_eq!(y16[i * n + j].to_bits(), bf16::from_f32(got).to_bits());
                    }
                }
                if kernel == Bf16Kernel::Amx {
                    // AMX adds in its own order (within the bound above, not bit for bit).
                    continue;
                }
                let these: Vec<u32> = y32.iter().map(|x| x.to_bits()).collect();
                match &bits {
                    Some(prev) => assert!(prev == &these, "kernels differ at m{m} n{n} k{k}"),
                    None => bits = Some(these),
                }
            }
        }
    }
}

fn value_of(t: &Tensor) -> Value {
    Value::new(t.dims().to_vec(), to_f64_vec(t).unwrap())
}

/// ‖got − want‖ / ‖want‖.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    num.sqrt() / den.sqrt().max(1e-30)
}

/// The op on bf16 tensors against the f64 interpreter on the same values: bf16 output (the
/// IR's) within its rounding, an f32 output within f32 summation error. Where the CPU lacks
/// AVX512_BF16 the kernel refuses bf16 and says so.
fn check_matmul(ta: bool, tb: bool, a: &Tensor, b: &Tensor) {
    let op = Op::MatMul { trans_a: ta, trans_b: tb };
    let metas = [meta_of(a).unwrap(), meta_of(b).unwrap()];
    let out = op.infer(&[&metas[0], &metas[1]]).unwrap();
    assert_eq!(out[0].dtype, tessera_ir::DType::BF16);
    let want = eval_op(&op, &[&value_of(a), &value_of(b)]).unwrap().remove(0).data;
    let got = match execute(&op, &[a, b], &out) {
        Ok(got) => got,
        Err(e) => {
            assert!(Bf16Kernel::native().is_none(), "{e}");
            assert!(e.to_string().contains("AVX512_BF16"), "{e}");
            return;
        }
    };
    assert_eq!(meta_of(&got[0]).unwrap(), out[0]);
    let err = rel_err(&to_f64_vec(&got[0]).unwrap(), &want);
    assert!(err <= 4e-3, "{op:?} {:?} x {:?}: bf16 output off by {err:e}", a.dims(), b.dims());
    let out32 = [TensorMeta { shape: out[0].shape.clone(), dtype: tessera_ir::DType::F32 }];
    let got32 = execute(&op, &[a, b], &out32).unwrap();
    assert_eq!(got32[0].dtype(), DType::F32);
    let err = rel_err(&to_f64_vec(&got32[0]).unwrap(), &want);
    assert!(err <= 1e-5, "{op:?} {:?} x {:?}: f32 output off by {err:e}", a.dims(), b.dims());
}

fn stored(batch: &[usize], r: usize, c: usize, trans: bool) -> Vec<usize> {
    let mut d = batch.to_vec();
    d.extend(if trans { [c, r] } else { [r, c] });
    d
}

#[test]
fn matmul_op_on_bf16_transposes_batches_and_views() {
    let mut rng = Rng::new(2);
    for (m, k, n) in [(7, 33, 65), (33, 65, 7), (1, 5, 3)] {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for batch in [&[][..], &[2][..], &[2, 3][..]] {
                let a = rng.tensor(&stored(batch, m, k, ta));
                let b = rng.tensor(&stored(batch, k, n, tb));
                check_matmul(ta, tb, &a, &b);
            }
        }
    }
    // Folded: [B,S,K] x [K,N] and x [N,K]ᵀ; per batch: [B,K,S]ᵀ x [K,N].
    for tb in [false, true] {
        check_matmul(false, tb, &rng.tensor(&[3, 13, 33]), &rng.tensor(&stored(&[], 33, 65, tb)));
    }
    check_matmul(true, false, &rng.tensor(&[3, 33, 13]), &rng.tensor(&[33, 7]));
    // Broadcast batch dims: [B,1,m,k] x [1,H,k,n], a 2-D left operand, an expanded one.
    check_matmul(false, false, &rng.tensor(&[2, 1, 7, 33]), &rng.tensor(&[1, 3, 33, 9]));
    check_matmul(false, false, &rng.tensor(&[7, 33]), &rng.tensor(&[4, 33, 9]));
    let w = rng.tensor(&[33, 9]).broadcast_as((4, 33, 9)).unwrap();
    check_matmul(false, false, &rng.tensor(&[4, 7, 33]), &w);
    // Views read in place: a transposed operand and a narrowed one.
    let a = rng.tensor(&[40, 50]).t().unwrap().narrow(0, 3, 17).unwrap().narrow(1, 0, 33).unwrap();
    let b = rng.tensor(&[50, 20]).narrow(1, 3, 11).unwrap().narrow(0, 0, 33).unwrap();
    check_matmul(false, false, &a, &b);
    check_matmul(true, true, &a.t().unwrap(), &b.t().unwrap());
}

/// The backend runs a bf16 `MatMul` on the bf16 kernel, or on f32 upcasts when asked; the
/// two differ by at most one rounding of the bf16 result.
#[test]
fn backend_bf16_matmul_native_and_upcast_agree() {
    let mut rng = Rng::new(3);
    let (a, b) = (rng.tensor(&[2, 19, 70]), rng.tensor(&[45, 70]));
    let op = Op::MatMul { trans_a: false, trans_b: true };
    let out = op.infer(&[&meta_of(&a).unwrap(), &meta_of(&b).unwrap()]).unwrap();
    assert_eq!(
        CpuBackend::new(0).native_bf16_gemm(),
        Bf16Kernel::native() == Some(Bf16Kernel::Amx),
        "the native kernel is the default where it is AMX, opt-in where it is vdpbf16ps"
    );
    let native = CpuBackend::new(0).with_native_bf16();
    assert_eq!(native.native_bf16_gemm(), Bf16Kernel::native().is_some());
    let up = CpuBackend::new(0).upcasting_bf16();
    let at = MeshPos::single();
    let x = native.execute(&op, &[&a, &b], &out, &at).unwrap().remove(0);
    let y = up.execute(&op, &[&a, &b], &out, &at).unwrap().remove(0);
    assert_eq!(x.dtype(), DType::BF16);
    assert_eq!(y.dtype(), DType::BF16);
    let (x, y) = (to_f64_vec(&x).unwrap(), to_f64_vec(&y).unwrap());
    for (p, q) in x.iter().zip(&y) {
        assert!((p - q).abs() <= q.abs() * 2f64.powi(-7) + 1e-30, "{p} vs {q}");
    }
}

/// Per-step losses of gpt2-tiny (b2 × s32, seeded batches) on `backend` in `dtype`, with the
/// accountant's peak checked against the profiler's prediction every step.
fn losses(dtype: tessera_ir::DType, backend: CpuBackend, steps: u64) -> Vec<f64> {
    let (batch, seq) = (2, 32);
    let cfg = ModelConfig::resolve("gpt2-tiny").unwrap();
    let fm = build(&cfg, &BuildOptions { batch, seq, dtype }).unwrap();
    let tg = build_training_graph(fm.builder, fm.loss, &TrainConfig::default()).unwrap();
    let schedule = LrSchedule::WarmupCosine { peak: 1e-3, min_lr: 1e-4, warmup: 5, total: steps };
    let mut t = Trainer::single(tg, backend, schedule, 7, None).unwrap();
    let predicted = tessera_profile::simulate_memory(t.program()).report.peak_bytes;
    let tokens = |salt: u64| -> Vec<i64> {
        (0..(batch * seq) as u64)
            .map(|i| (((i * 2_654_435_761) ^ (salt * 40_503)) % 61) as i64)
            .collect()
    };
    (1..=steps)
        .map(|step| {
            let x = tokens(step);
            let y: Vec<i64> = x.iter().skip(1).chain(&x[..1]).copied().collect();
            let s = t.step(&x, &y).unwrap();
            assert_eq!(s.peak_bytes, predicted, "{dtype} step {step}: measured vs predicted peak");
            s.loss
        })
        .collect()
}

/// bf16 training on the native kernel tracks fp32 within the bound the 200-step fidelity
/// test uses (2% on 10-step means), and the f32-upcast path within the same.
#[test]
fn bf16_training_on_the_native_gemm_tracks_fp32() {
    let steps = 10;
    let fp32 = losses(tessera_ir::DType::F32, CpuBackend::new(0), steps);
    let native = losses(tessera_ir::DType::BF16, CpuBackend::new(0).with_native_bf16(), steps);
    let upcast = losses(tessera_ir::DType::BF16, CpuBackend::new(0).upcasting_bf16(), steps);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    for (name, run) in [("native", &native), ("upcast", &upcast)] {
        for (a, b) in fp32.chunks(10).zip(run.chunks(10)) {
            let gap = (mean(b) - mean(a)).abs() / mean(a);
            assert!(
                gap < 0.02,
                "bf16 {name} strays {:.2}% from fp32: {run:?} vs {fp32:?}",
                gap * 100.0
            );
        }
    }
    assert!(fp32[steps as usize - 1] < fp32[0] * 0.95, "the run must learn: {fp32:?}");
}

/// The backend's bf16 ↔ f32 conversions (`kernels::convert_dtype`, every upcast op's inputs and
/// outputs) give `half`'s bits: f32 → bf16 rounds to nearest even (NaN stays NaN), bf16 → f32
/// is exact; on a tensor long enough for the parallel chunks and on a short one, and on a
/// strided view (candle's path).
#[test]
fn conversions_give_halfs_bits() {
    let mut x = 0x2545_F491u32;
    let specials = [0.0f32, -0.0, 1.0, -1.5, f32::MAX, f32::MIN_POSITIVE, 1e-40, f32::INFINITY];
    for n in [7usize, 70_001] {
        let vals: Vec<f32> = specials
            .into_iter()
            .chain((0..n).map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                f32::from_bits(x)
            }))
            .collect();
        let t = Tensor::from_vec(vals.clone(), vals.len(), &Device::Cpu).unwrap();
        let narrow = tessera_runtime::kernels::convert_dtype(&t, DType::BF16).unwrap();
        assert_eq!(narrow.dtype(), DType::BF16);
        let got = narrow.to_vec1::<bf16>().unwrap();
        for (v, g) in vals.iter().zip(&got) {
            if v.is_nan() {
                assert!(g.is_nan(), "{v:?} gave {g:?}");
            } else {
                assert_eq!(g.to_bits(), bf16::from_f32(*v).to_bits(), "{v:e}");
            }
        }
        let wide = tessera_runtime::kernels::convert_dtype(&narrow, DType::F32).unwrap();
        let back = wide.to_vec1::<f32>().unwrap();
        for (g, b) in got.iter().zip(&back) {
            assert_eq!(b.to_bits(), g.to_f32().to_bits());
        }
    }
    // A transposed view: not contiguous, converted element for element all the same.
    let m =
        Tensor::from_vec((0..12).map(|i| i as f32 * 0.3).collect::<Vec<_>>(), (3, 4), &Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
    let got = tessera_runtime::kernels::convert_dtype(&m, DType::BF16).unwrap();
    let want = m.to_dtype(DType::BF16).unwrap();
    assert_eq!(got.to_vec2::<bf16>().unwrap(), want.to_vec2::<bf16>().unwrap());
}

/// Binary, unary, unary-backward, reduction and dropout ops on bf16 operands compute in f32
/// (reductions in f64) and round once: the
/// same bits as the backend's upcast path (widen, the f32 kernel, round to bf16), for every
/// op, on contiguous operands long enough for the parallel chunks, a broadcast one and a
/// transposed view.
#[test]
fn elementwise_and_reduce_ops_on_bf16_give_the_upcast_paths_bits() {
    use tessera_ir::{BinaryOp, ReduceOp};
    let mut rng = Rng::new(11);
    // Positive values as well (log, sqrt, rsqrt), and a spread past [-1, 1).
    let wide = |t: &Tensor, by: f32| {
        let v: Vec<bf16> = t
            .flatten_all()
            .unwrap()
            .to_vec1::<bf16>()
            .unwrap()
            .iter()
            .map(|x| bf16::from_f32(x.to_f32() * by))
            .collect();
        Tensor::from_vec(v, t.dims(), &Device::Cpu).unwrap()
    };
    let x = wide(&rng.tensor(&[70_003]), 4.0);
    let dy = rng.tensor(&[70_003]);
    let xt = wide(&rng.tensor(&[33, 47]), 3.0).t().unwrap();
    let dyt = rng.tensor(&[47, 33]);
    let row = rng.tensor(&[33]);
    let same = |op: &Op, inputs: &[&Tensor]| {
        let metas: Vec<TensorMeta> = inputs.iter().map(|t| meta_of(t).unwrap()).collect();
        let out = op.infer(&metas.iter().collect::<Vec<_>>()).unwrap();
        let got = execute(op, inputs, &out).unwrap().remove(0);
        assert_eq!(got.dtype(), DType::BF16, "{op:?}");
        let widen = |t: &&Tensor| match t.dtype() {
            DType::BF16 => t.to_dtype(DType::F32).unwrap(),
            _ => (*t).clone(),
        };
        let up: Vec<Tensor> = inputs.iter().map(widen).collect();
        let up_refs: Vec<&Tensor> = up.iter().collect();
        let up_metas: Vec<TensorMeta> = up.iter().map(|t| meta_of(t).unwrap()).collect();
        let up_out = op.infer(&up_metas.iter().collect::<Vec<_>>()).unwrap();
        let want = execute(op, &up_refs, &up_out).unwrap().remove(0).to_dtype(DType::BF16).unwrap();
        let (g, w) = (
            got.flatten_all().unwrap().to_vec1::<bf16>().unwrap(),
            want.flatten_all().unwrap().to_vec1::<bf16>().unwrap(),
        );
        assert_eq!(g.len(), w.len());
        for (i, (p, q)) in g.iter().zip(&w).enumerate() {
            assert!(
                p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()),
                "{op:?} [{i}]: {p} vs {q}"
            );
        }
    };
    for u in crate::kernels_basic::UNARY {
        same(&Op::Unary(u), &[&x]);
        same(&Op::Unary(u), &[&xt]);
        same(&Op::UnaryBackward(u), &[&x, &dy]);
        same(&Op::UnaryBackward(u), &[&xt, &dyt]);
    }
    let binary =
        [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Max, BinaryOp::Min];
    for b in binary {
        same(&Op::Binary(b), &[&x, &dy]);
        same(&Op::Binary(b), &[&xt, &row]);
    }
    // Reductions: a global one over a long vector (split over threads), rows, columns (a bias
    // gradient) and a transposed view.
    let x3 = rng.tensor(&[6, 37, 301]);
    let reductions = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::SumSquares, ReduceOp::Max];
    for op in reductions {
        let red = |dims: &[usize], keepdim: bool| Op::Reduce { op, dims: dims.to_vec(), keepdim };
        same(&red(&[0], false), &[&x]);
        same(&red(&[2], false), &[&x3]);
        same(&red(&[0, 1], true), &[&x3]);
        same(&red(&[0, 1, 2], false), &[&x3]);
        same(&red(&[1], false), &[&xt]);
    }
    // Cross-entropy over bf16 logits (targets i64; the loss and log-sum-exp are f32, dlogits
    // bf16), with an ignored row.
    let logits = wide(&rng.tensor(&[3, 5, 301]), 6.0);
    let targets = Tensor::from_vec(
        (0..15).map(|i| if i == 4 { -100 } else { (i * 37) % 301 }).collect::<Vec<i64>>(),
        (3, 5),
        &Device::Cpu,
    )
    .unwrap();
    let ce = Op::CrossEntropy { ignore_index: Some(-100), sum: false, classes: None };
    let metas = [meta_of(&logits).unwrap(), meta_of(&targets).unwrap()];
    let out = ce.infer(&metas.iter().collect::<Vec<_>>()).unwrap();
    let got = execute(&ce, &[&logits, &targets], &out).unwrap();
    let up = logits.to_dtype(DType::F32).unwrap();
    let want = execute(&ce, &[&up, &targets], &out).unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(to_f64_vec(g).unwrap(), to_f64_vec(w).unwrap(), "cross-entropy outputs");
    }
    let dloss = Tensor::new(0.7f32, &Device::Cpu).unwrap();
    let ceb = Op::CrossEntropyBackward { ignore_index: Some(-100), sum: false, classes: None };
    same(&ceb, &[&logits, &targets, &got[1], &dloss]);
    // Dropout (its seed is an i64 scalar), on a long tensor and a transposed view.
    let seed = Tensor::new(1234i64, &Device::Cpu).unwrap();
    for p in [0.0, 0.1, 0.5] {
        let drop = Op::Dropout { p, stream: 7, shard: None };
        same(&drop, &[&x, &seed]);
        same(&drop, &[&xt, &seed]);
    }
}
