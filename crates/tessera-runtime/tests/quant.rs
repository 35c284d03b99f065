//! Weight-only quantisation: `quantize` (load time) and the `QMatMul` kernel.
//!
//! - The kernel against the f64 interpreter (`tessera_ir::interp::eval_op`) on the same codes
//!   and scales, int8 and int4, on both of its paths (≤ 16 rows of x: per output feature;
//!   more: dequantised tiles of 64 weight rows and gemm), with M = 1, N not a multiple of the
//!   tile, K with tails past the kernel's lane widths, several groups, int4 in odd groups
//!   (which the IR allows though `quantize` never makes them), and a non-contiguous x.
//!   Tolerance: per element `|a − b| ≤ 1e-5 · Σ_f |x_f · w_f|` (the scale of a dot product's
//!   rounding; elementwise relative error means nothing for a sum that cancels to near 0),
//!   and norm-wise `‖a − b‖ ≤ 1e-5 · ‖b‖`.
//! - `quantize`'s rounding: within half a scale of the weight, codes checked by hand (int8
//!   `round(w / scale) + 128`, int4 nibble order), zero / huge / subnormal rows without NaN.
//! - Memory: the kernel's heap peak stays within its output, its declared workspace (one tile
//!   of 64 f32 weight rows) and a copy of x — never a whole f32 weight.
//!
//! The tests share one lock: the memory test reads the process's heap peak.

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::{Mutex, MutexGuard};
use tessera_ir::interp::{self, Value};
use tessera_ir::{DType, Op, QuantSpec, Shape, TensorMeta};
use tessera_runtime::alloc::{current_bytes, peak_bytes, reset_peak, CountingAlloc};
use tessera_runtime::kernels::execute;
use tessera_runtime::quantize::quantize;
use tessera_runtime::tensor::{meta_of, to_f64_vec};

#[global_allocator]
static A: CountingAlloc = CountingAlloc;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const RTOL: f64 = 1e-5;

fn randn(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    // Sum of uniforms: roughly normal, deterministic across rand versions.
    (0..n).map(|_| scale * ((0..4).map(|_| rng.random::<f32>()).sum::<f32>() - 2.0)).collect()
}

fn tensor<T: candle_core::WithDType>(data: Vec<T>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
}

fn value(t: &Tensor) -> Value {
    Value::new(t.dims().to_vec(), to_f64_vec(t).unwrap())
}

fn run_kernel(x: &Tensor, w: &Tensor, s: &Tensor, q: QuantSpec) -> Tensor {
    let op = Op::QMatMul(q);
    // (meta_of reads a candle u8 tensor as bool: the weight's meta is made here.)
    let w_meta = TensorMeta { shape: Shape::from(w.dims()), dtype: DType::U8 };
    let metas = [meta_of(x).unwrap(), w_meta, meta_of(s).unwrap()];
    let out = op.infer(&metas.iter().collect::<Vec<_>>()).unwrap();
    execute(&op, &[x, w, s], &out).unwrap().remove(0)
}

/// The kernel's `x · dequant(w)ᵀ` against the interpreter's, within [`RTOL`] of each element's
/// `Σ|x·w|` and of the norm.
fn check(x: &Tensor, w: &Tensor, s: &Tensor, q: QuantSpec, what: &str) {
    let got = run_kernel(x, w, s, q);
    let (xv, wv, sv) = (value(x), value(w), value(s));
    let want = interp::eval_op(&Op::QMatMul(q), &[&xv, &wv, &sv]).unwrap().remove(0);
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let got = to_f64_vec(&got).unwrap();
    let k = *x.dims().last().unwrap();
    let n = w.dims()[0];
    let wf = interp::dequantize(&wv, &sv, q, k);
    let (mut err2, mut ref2) = (0f64, 0f64);
    for (e, (&a, &b)) in got.iter().zip(&want.data).enumerate() {
        let (i, j) = (e / n, e % n);
        let scale: f64 =
            (0..k).map(|f| (xv.data[i * k + f] * wf[j * k + f]).abs()).sum::<f64>().max(1e-30);
        assert!(
            (a - b).abs() <= RTOL * scale,
            "{what}: out[{i}, {j}] = {a}, reference {b} (|diff| {:e} > {RTOL} · {scale:e})",
            (a - b).abs()
        );
        err2 += (a - b) * (a - b);
        ref2 += b * b;
    }
    assert!(err2.sqrt() <= RTOL * ref2.sqrt(), "{what}: ‖diff‖ {} vs ‖ref‖ {}", err2, ref2);
}

/// Random weight `[n, k]` quantised with `q`.
fn quantized(rng: &mut StdRng, n: usize, k: usize, q: QuantSpec) -> (Tensor, Tensor) {
    let w = tensor(randn(rng, n * k, 0.05), &[n, k]);
    quantize(&w, q).unwrap()
}

#[test]
fn qmatmul_matches_the_interpreter_int8_and_int4() {
    let _g = serial();
    let mut rng = StdRng::seed_from_u64(7);
    let int8 = |k: usize| QuantSpec { bits: 8, group: k };
    let int4 = |g: usize| QuantSpec { bits: 4, group: g };
    // (rows of x, K, N, spec): small (≤ 16, per-feature path) and large (tiles + gemm) M;
    // N below, at, and past multiples of the 64-row tile; K with tails past 8/16/32 lanes.
    let cases = [
        (1, 8, 1, int8(8)),
        (1, 768, 200, int8(768)),
        (1, 770, 65, int8(770)),
        (2, 96, 37, int8(96)),
        (3, 96, 37, QuantSpec { bits: 8, group: 32 }),
        (5, 100, 9, QuantSpec { bits: 8, group: 25 }),
        (8, 768, 70, int8(768)),
        (13, 200, 33, int8(200)),
        (16, 96, 64, int8(96)),
        (17, 96, 130, int8(96)),
        (40, 770, 129, int8(770)),
        (24, 64, 64, QuantSpec { bits: 8, group: 16 }),
        (1, 256, 200, int4(128)),
        (1, 100, 65, int4(50)),
        (1, 30, 7, int4(2)),
        (2, 768, 70, int4(128)),
        (3, 40, 17, int4(40)),
        (4, 264, 70, int4(88)),
        (7, 36, 12, int4(6)),
        (9, 256, 130, int4(128)),
        (16, 128, 64, int4(64)),
        (17, 256, 130, int4(128)),
        (33, 100, 65, int4(50)),
        (20, 30, 5, int4(2)),
    ];
    for (m, k, n, q) in cases {
        let (w, s) = quantized(&mut rng, n, k, q);
        let x = tensor(randn(&mut rng, m * k, 1.0), &[m, k]);
        check(&x, &w, &s, q, &format!("{}-bit group {} M={m} K={k} N={n}", q.bits, q.group));
    }
    // Batch dims before the features, and a non-contiguous x (a transposed view).
    let q = int4(64);
    let (w, s) = quantized(&mut rng, 50, 128, q);
    let x = tensor(randn(&mut rng, 2 * 3 * 128, 1.0), &[2, 3, 128]);
    check(&x, &w, &s, q, "x [2, 3, 128]");
    let q = int8(128);
    let (w, s) = quantized(&mut rng, 50, 128, q);
    let xt = tensor(randn(&mut rng, 128 * 20, 1.0), &[128, 20]).t().unwrap();
    check(&xt, &w, &s, q, "x transposed [20, 128]");
    // A mean far from zero (GELU-like activations): no cancellation.
    let x = tensor(randn(&mut rng, 4 * 768, 0.3).iter().map(|v| v + 1.0).collect(), &[4, 768]);
    let (w, s) = quantized(&mut rng, 70, 768, int8(768));
    check(&x, &w, &s, int8(768), "x with mean 1");
}

#[test]
fn qmatmul_int4_in_odd_groups_and_arbitrary_codes() {
    // The IR allows int4 groups that split a byte (quantize never makes them): random codes.
    let _g = serial();
    let mut rng = StdRng::seed_from_u64(11);
    for (m, k, n, g) in [(1, 6, 5, 3), (3, 30, 9, 5), (17, 30, 70, 15), (2, 14, 66, 7)] {
        let q = QuantSpec { bits: 4, group: g };
        let w = tensor((0..n * k / 2).map(|_| rng.random::<u8>()).collect(), &[n, k / 2]);
        let s = tensor(randn(&mut rng, n * (k / g), 0.1), &[n, k / g]);
        let x = tensor(randn(&mut rng, m * k, 1.0), &[m, k]);
        check(&x, &w, &s, q, &format!("int4 group {g} M={m} K={k} N={n}"));
    }
    // Every int8 code, 0 and 255 included.
    let q = QuantSpec { bits: 8, group: 256 };
    let w = tensor((0..3 * 256).map(|i| (i % 256) as u8).collect(), &[3, 256]);
    let s = tensor(vec![0.5f32, -1.0, 3.0], &[3, 1]);
    for m in [1, 20] {
        let x = tensor(randn(&mut rng, m * 256, 1.0), &[m, 256]);
        check(&x, &w, &s, q, &format!("every int8 code, M={m}"));
    }
}

#[test]
fn qmatmul_of_nothing() {
    let _g = serial();
    let q = QuantSpec { bits: 8, group: 4 };
    let (w, s) = quantize(&tensor(vec![1f32; 12], &[3, 4]), q).unwrap();
    let y = run_kernel(&tensor(Vec::<f32>::new(), &[0, 4]), &w, &s, q);
    assert_eq!(y.dims(), [0, 3]);
    let (w0, s0) = quantize(&tensor(Vec::<f32>::new(), &[0, 4]), q).unwrap();
    let y = run_kernel(&tensor(vec![1f32; 8], &[2, 4]), &w0, &s0, q);
    assert_eq!(y.dims(), [2, 0]);
}

/// Dequantised codes (f64) of `quantize(w)`.
fn roundtrip(w: &[f32], n: usize, k: usize, q: QuantSpec) -> (Vec<f64>, Vec<f64>, Tensor) {
    let (codes, scales) = quantize(&tensor(w.to_vec(), &[n, k]), q).unwrap();
    let deq = interp::dequantize(&value(&codes), &value(&scales), q, k);
    (deq, to_f64_vec(&scales).unwrap(), codes)
}

#[test]
fn quantize_rounds_to_nearest() {
    let _g = serial();
    let mut rng = StdRng::seed_from_u64(3);
    for q in [
        QuantSpec { bits: 8, group: 96 },
        QuantSpec { bits: 8, group: 32 },
        QuantSpec { bits: 4, group: 32 },
        QuantSpec { bits: 4, group: 2 },
    ] {
        let (n, k) = (33, 96);
        let w = randn(&mut rng, n * k, 0.7);
        let (deq, scales, _) = roundtrip(&w, n, k, q);
        let groups = k / q.group;
        for (e, (&d, &x)) in deq.iter().zip(&w).enumerate() {
            let s = scales[(e / k) * groups + (e % k) / q.group];
            assert!(s > 0.0 && s.is_finite());
            assert!(
                (d - x as f64).abs() <= s / 2.0 * (1.0 + 1e-6),
                "{}-bit: w {x} became {d} (scale {s})",
                q.bits
            );
        }
        // The group's largest |w| is exact (± f32 rounding of the scale): the full range used.
        for (g, &s) in scales.iter().enumerate() {
            let (r, c) = (g / groups, (g % groups) * q.group);
            let amax = w[r * k + c..r * k + c + q.group].iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!((s * q.qmax() - amax as f64).abs() <= 1e-6 * amax as f64);
        }
    }
}

#[test]
fn quantize_codes_by_hand() {
    let _g = serial();
    // int8, one scale per row: scale = 12.7 / 127; codes = round(w / scale) + 128.
    let w = [12.7f32, -5.0, 0.26, 0.0, -12.7, 3.04];
    let q = QuantSpec { bits: 8, group: 6 };
    let (codes, scales) = quantize(&tensor(w.to_vec(), &[1, 6]), q).unwrap();
    let s = 12.7f32 / 127.0;
    assert_eq!(scales.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [s]);
    let want: Vec<u8> = w.iter().map(|&x| ((x / s).round() as i32 + 128) as u8).collect();
    assert_eq!(want, [255, 78, 131, 128, 1, 158]);
    assert_eq!(codes.flatten_all().unwrap().to_vec1::<u8>().unwrap(), want);

    // int8 in groups of 2: a scale per group.
    let q = QuantSpec { bits: 8, group: 2 };
    let (codes, scales) = quantize(&tensor(vec![1.0f32, -0.25, 0.0, 0.0], &[1, 4]), q).unwrap();
    assert_eq!(scales.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [1.0 / 127.0, 1.0]);
    assert_eq!(codes.flatten_all().unwrap().to_vec1::<u8>().unwrap(), [255, 96, 128, 128]);

    // int4 on a 1×4 weight: scale 0.7 / 7; q = [7, −7, 3, −1], stored q + 8 = [15, 1, 11, 7],
    // the even feature in the low nibble: bytes [1·16 + 15, 7·16 + 11].
    let q = QuantSpec { bits: 4, group: 4 };
    let (codes, scales) = quantize(&tensor(vec![0.7f32, -0.7, 0.3, -0.1], &[1, 4]), q).unwrap();
    assert_eq!(scales.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [0.7f32 / 7.0]);
    assert_eq!(codes.flatten_all().unwrap().to_vec1::<u8>().unwrap(), [0x1F, 0x7B]);
    // ... and the kernel reads them so: x = e_f picks dequantised feature f.
    let x =
        tensor((0..16).map(|i| if i % 5 == 0 { 1f32 } else { 0.0 }).collect::<Vec<_>>(), &[4, 4]);
    let y = run_kernel(&x, &codes, &scales, q).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let s = 0.7f32 / 7.0;
    assert_eq!(y, [7.0 * s, -7.0 * s, 3.0 * s, -s]);
}

#[test]
fn quantize_degenerate_rows_without_nan() {
    let _g = serial();
    let k = 64;
    let mut w = vec![0f32; 4 * k];
    // Row 0: zeros; row 1: one huge value; row 2: f32::MAX; row 3: subnormal values only
    // (whose scales are subnormal, so coarse: checked for finiteness only).
    w[k + 5] = 1e30;
    w[k + 6] = 1.0;
    w[2 * k] = f32::MAX;
    w[2 * k + 1] = -3.0;
    for (f, v) in w[3 * k..].iter_mut().enumerate() {
        *v = f32::from_bits(1 + f as u32) * if f % 2 == 0 { 1.0 } else { -1.0 };
    }
    for q in [QuantSpec { bits: 8, group: k }, QuantSpec { bits: 4, group: 16 }] {
        let (deq, scales, codes) = roundtrip(&w, 4, k, q);
        assert!(scales.iter().all(|s| s.is_finite() && *s > 0.0), "{scales:?}");
        assert!(deq.iter().all(|d| d.is_finite()));
        let groups = k / q.group;
        for (e, (&d, &x)) in deq.iter().zip(&w).enumerate().take(3 * k) {
            let s = scales[(e / k) * groups + (e % k) / q.group];
            assert!((d - x as f64).abs() <= s / 2.0 * (1.0 + 1e-6), "w {x} became {d}");
        }
        let tiny = f32::from_bits(k as u32) as f64;
        assert!(deq[3 * k..].iter().zip(&w[3 * k..]).all(|(&d, &x)| (d - x as f64).abs() <= tiny));
        // The zero row dequantises to exact zeros; the huge one keeps its value.
        assert!(deq[..k].iter().all(|&d| d == 0.0));
        assert!((deq[k + 5] - 1e30).abs() <= 1e30 * 1e-6);
        // The kernel on the zero, huge and subnormal rows: finite, the zero row's outputs 0.
        let x = tensor(vec![1f32; 2 * k], &[2, k]);
        let rows = [0, 1, 3].map(|r| w[r * k..(r + 1) * k].to_vec()).concat();
        let (wq, sq) = quantize(&tensor(rows, &[3, k]), q).unwrap();
        let y = to_f64_vec(&run_kernel(&x, &wq, &sq, q)).unwrap();
        assert!(y.iter().all(|v| v.is_finite()), "{y:?}");
        assert_eq!((y[0], y[3]), (0.0, 0.0));
        assert!(codes.dims()[0] == 4);
    }
}

#[test]
fn qmatmul_scratch_is_one_tile_never_the_weight() {
    let _g = serial();
    let mut rng = StdRng::seed_from_u64(5);
    let (k, n) = (768, 3072);
    for q in [QuantSpec { bits: 8, group: k }, QuantSpec { bits: 4, group: 128 }] {
        let (w, s) = quantized(&mut rng, n, k, q);
        for m in [1, 8, 16, 64] {
            let x = tensor(randn(&mut rng, m * k, 1.0), &[m, k]);
            let _ = run_kernel(&x, &w, &s, q); // warm: rayon's threads, lazily made statics
            let base = current_bytes();
            reset_peak();
            let y = run_kernel(&x, &w, &s, q);
            let rose = peak_bytes().saturating_sub(base);
            drop(y);
            let (out, tile, xcopy) = (m * n * 4, 64 * k * 4, m * k * 4);
            let allowed = (out + tile + xcopy + (256 << 10)) as u64;
            assert!(
                rose <= allowed,
                "{}-bit M={m}: heap rose {rose} bytes, allowed {allowed} (output {out}, tile \
                 {tile}); an f32 weight is {}",
                q.bits,
                n * k * 4
            );
        }
    }
}

/// The input gradient `dy · dequant(w)` (QLoRA's backward through the frozen base) against the
/// interpreter, int8 and int4, on one tile and on several (N past 64 weight rows), within
/// [`RTOL`] of each element's `Σ_j |dy_j · w_jf|` and norm-wise.
#[test]
fn qmatmul_backward_matches_the_interpreter() {
    let _g = serial();
    let mut rng = StdRng::seed_from_u64(11);
    let cases = [
        (1, 8, 3, QuantSpec { bits: 8, group: 8 }),
        (5, 96, 37, QuantSpec { bits: 8, group: 96 }),
        (7, 64, 130, QuantSpec { bits: 4, group: 32 }),
        (20, 256, 70, QuantSpec { bits: 4, group: 128 }),
        (3, 30, 5, QuantSpec { bits: 4, group: 2 }),
    ];
    for (m, k, n, q) in cases {
        let what = format!("m={m} k={k} n={n} bits={} group={}", q.bits, q.group);
        let (w, s) = quantized(&mut rng, n, k, q);
        let dy = tensor(randn(&mut rng, m * n, 1.0), &[m, n]);
        let op = Op::QMatMulBackward(q);
        let w_meta = TensorMeta { shape: Shape::from(w.dims()), dtype: DType::U8 };
        let metas = [meta_of(&dy).unwrap(), w_meta, meta_of(&s).unwrap()];
        let out = op.infer(&metas.iter().collect::<Vec<_>>()).unwrap();
        let got = execute(&op, &[&dy, &w, &s], &out).unwrap().remove(0);
        assert_eq!(got.dims(), [m, k], "{what}");
        let (dv, wv, sv) = (value(&dy), value(&w), value(&s));
        let want = interp::eval_op(&op, &[&dv, &wv, &sv]).unwrap().remove(0);
        let got = to_f64_vec(&got).unwrap();
        let wf = interp::dequantize(&wv, &sv, q, k);
        let (mut err2, mut ref2) = (0f64, 0f64);
        for (e, (&a, &b)) in got.iter().zip(&want.data).enumerate() {
            let (i, f) = (e / k, e % k);
            let scale: f64 =
                (0..n).map(|j| (dv.data[i * n + j] * wf[j * k + f]).abs()).sum::<f64>().max(1e-30);
            assert!((a - b).abs() <= RTOL * scale, "{what}: dx[{i}, {f}] = {a}, reference {b}");
            err2 += (a - b) * (a - b);
            ref2 += b * b;
        }
        assert!(err2.sqrt() <= RTOL * ref2.sqrt(), "{what}: ‖diff‖ {err2} vs ‖ref‖ {ref2}");
    }
}
