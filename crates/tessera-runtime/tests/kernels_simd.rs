//! The kernels compiled for the CPU's widest vector ISA (`kernels::simd`, AVX-512 or AVX2
//! chosen at run time) against the same kernels on the baseline x86-64 path: every output bit
//! for bit (any NaN equal to any NaN), on inputs with NaN, ±∞, subnormals and large magnitudes, big enough (> 2¹⁵
//! elements) that the parallel paths run, contiguous and strided.
//!
//! One test in this binary on purpose: `simd::plain` switches the whole process to the
//! baseline path while it runs. On a CPU without AVX2 both paths are the baseline and the
//! comparison is trivially equal; the test prints which ISA it compared.

use candle_core::{DType as CDType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_ir::{AdamWSpec, BinaryOp, Op, TensorMeta, UnaryOp};
use tessera_runtime::kernels::{self, simd};
use tessera_runtime::tensor::meta_of;

const ROWS: usize = 389;
const D: usize = 257;

fn tensor(data: Vec<f32>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
}

/// Normal-ish values times `scale`, with every 97th element a special value.
fn values(r: &mut StdRng, n: usize, scale: f32, specials: bool) -> Vec<f32> {
    const SPECIAL: [f32; 8] =
        [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, -1e-40, 0.0, -0.0, 88.5];
    (0..n)
        .map(|k| {
            if specials && k % 97 == 13 {
                SPECIAL[(k / 97) % SPECIAL.len()]
            } else {
                (r.random::<f32>() - 0.5) * 2.0 * scale
            }
        })
        .collect()
}

fn randn(r: &mut StdRng, dims: &[usize], scale: f32, specials: bool) -> Tensor {
    tensor(values(r, dims.iter().product(), scale, specials), dims)
}

/// An f32's bits, every NaN as the canonical quiet NaN: the sign and payload of a NaN made by
/// arithmetic are not specified, and vector and scalar instructions differ in them.
fn canon(v: f32) -> u32 {
    if v.is_nan() {
        f32::NAN.to_bits()
    } else {
        v.to_bits()
    }
}

/// Every output's raw bits (NaNs canonical) (f32, bf16, i64 and u8 outputs alike).
fn bits(outs: &[Tensor]) -> Vec<Vec<u64>> {
    outs.iter()
        .map(|t| {
            let t = t.flatten_all().unwrap();
            match t.dtype() {
                CDType::F32 => {
                    t.to_vec1::<f32>().unwrap().iter().map(|v| canon(*v) as u64).collect()
                }
                CDType::BF16 => {
                    t.to_vec1::<half::bf16>().unwrap().iter().map(|v| v.to_bits() as u64).collect()
                }
                CDType::I64 => t.to_vec1::<i64>().unwrap().iter().map(|&v| v as u64).collect(),
                _ => t
                    .to_dtype(CDType::F64)
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect(),
            }
        })
        .collect()
}

fn run(op: &Op, inputs: &[&Tensor]) -> Vec<Tensor> {
    let metas: Vec<TensorMeta> = inputs.iter().map(|t| meta_of(t).unwrap()).collect();
    let out = op.infer(&metas.iter().collect::<Vec<_>>()).unwrap();
    kernels::execute(op, inputs, &out).unwrap()
}

/// The op's outputs on the wide path equal those on the baseline path, bit for bit. `fresh`
/// makes the inputs (called once per path: AdamW updates its inputs in place).
fn same(what: &str, op: &Op, fresh: &dyn Fn() -> Vec<Tensor>) {
    let a = fresh();
    let wide = bits(&run(op, &a.iter().collect::<Vec<_>>()));
    let b = fresh();
    let plain = bits(&simd::plain(|| run(op, &b.iter().collect::<Vec<_>>())));
    for (k, (w, p)) in wide.iter().zip(&plain).enumerate() {
        if let Some(i) = (0..w.len()).find(|&i| w[i] != p[i]) {
            panic!("{what}: output {k} element {i}: wide bits {:#x}, baseline {:#x}", w[i], p[i]);
        }
    }
    assert_eq!(wide.len(), plain.len(), "{what}: output count");
}

#[test]
fn wide_kernels_equal_the_baseline_bit_for_bit() {
    eprintln!("vector ISA compared with the baseline: {}", simd::isa());
    let mut r = StdRng::seed_from_u64(48);
    let x = randn(&mut r, &[ROWS, D], 4.0, true);
    let xt = randn(&mut r, &[D, ROWS], 4.0, true).t().unwrap(); // a strided view
    let pos = tensor(
        values(&mut r, ROWS * D, 4.0, false).iter().map(|v| v.abs() + 0.1).collect(),
        &[ROWS, D],
    );
    let dy = randn(&mut r, &[ROWS, D], 1.0, false);
    let bias = randn(&mut r, &[D], 1.0, false);
    let y = randn(&mut r, &[ROWS, D], 2.0, false);

    use UnaryOp::*;
    for u in [Neg, Exp, Log, Sqrt, Rsqrt, Tanh, Gelu, GeluTanh, Silu, Relu, Sigmoid, Sin, Cos] {
        let arg = if matches!(u, Log | Sqrt | Rsqrt) { &pos } else { &x };
        same(&format!("{u:?}"), &Op::Unary(u), &|| vec![arg.clone()]);
        same(&format!("{u:?} strided"), &Op::Unary(u), &|| vec![xt.clone()]);
        same(&format!("{u:?} backward"), &Op::UnaryBackward(u), &|| vec![arg.clone(), dy.clone()]);
    }
    use BinaryOp::*;
    for b in [Add, Sub, Mul, Div, Max, Min] {
        same(&format!("{b:?}"), &Op::Binary(b), &|| vec![x.clone(), y.clone()]);
        same(&format!("{b:?} bias"), &Op::Binary(b), &|| vec![x.clone(), bias.clone()]);
        for wrt in [0, 1] {
            let op = Op::BinaryBackward { op: b, wrt };
            same(&format!("{b:?} backward {wrt}"), &op, &|| vec![x.clone(), y.clone(), dy.clone()]);
        }
    }
    same("softmax", &Op::Softmax, &|| vec![x.clone()]);
    same("softmax backward", &Op::SoftmaxBackward, &|| vec![y.clone(), dy.clone()]);
    let (w, b) = (randn(&mut r, &[D], 1.0, false), randn(&mut r, &[D], 1.0, false));
    let xn = randn(&mut r, &[ROWS, D], 3.0, false);
    same("layer_norm", &Op::LayerNorm { eps: 1e-5 }, &|| vec![xn.clone(), w.clone(), b.clone()]);
    same("layer_norm backward", &Op::LayerNormBackward { eps: 1e-5 }, &|| {
        vec![xn.clone(), w.clone(), dy.clone()]
    });
    same("rms_norm", &Op::RmsNorm { eps: 1e-6 }, &|| vec![xn.clone(), w.clone()]);
    same("rms_norm backward", &Op::RmsNormBackward { eps: 1e-6 }, &|| {
        vec![xn.clone(), w.clone(), dy.clone()]
    });

    // Cross-entropy over 257 classes, one ignored row in ten.
    let targets: Vec<i64> =
        (0..ROWS).map(|k| if k % 10 == 3 { -100 } else { r.random_range(0..D as i64) }).collect();
    let targets = Tensor::from_vec(targets, &[ROWS], &Device::Cpu).unwrap();
    let ce = Op::CrossEntropy { ignore_index: Some(-100), sum: false, classes: None };
    same("cross_entropy", &ce, &|| vec![xn.clone(), targets.clone()]);
    let lse = run(&ce, &[&xn, &targets])[1].clone();
    let dloss = Tensor::new(0.5f32, &Device::Cpu).unwrap();
    let ceb = Op::CrossEntropyBackward { ignore_index: Some(-100), sum: false, classes: None };
    same("cross_entropy backward", &ceb, &|| {
        vec![xn.clone(), targets.clone(), lse.clone(), dloss.clone()]
    });
    same("logsumexp", &Op::LogSumExp, &|| vec![xn.clone()]);

    let seed = Tensor::new(1234i64, &Device::Cpu).unwrap();
    same("dropout", &Op::Dropout { p: 0.1, stream: 7, shard: None }, &|| {
        vec![x.clone(), seed.clone()]
    });

    // AdamW, f32 parameter, and bf16 parameter with its f32 master; clipped.
    let spec = AdamWSpec {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        max_grad_norm: Some(1.0),
        grad_scale: false,
    };
    let (lr, step, norm) = (
        Tensor::new(3e-3f32, &Device::Cpu).unwrap(),
        Tensor::new(3i64, &Device::Cpu).unwrap(),
        Tensor::new(5.0f32, &Device::Cpu).unwrap(),
    );
    let vv =
        tensor(values(&mut r, ROWS * D, 0.1, false).iter().map(|v| v * v).collect(), &[ROWS, D]);
    let state = |bf16: bool| {
        let mut s = vec![
            if bf16 { xn.to_dtype(CDType::BF16).unwrap() } else { xn.copy().unwrap() },
            dy.copy().unwrap(),
            (y.copy().unwrap() * 0.1).unwrap(),
            vv.copy().unwrap(),
            lr.clone(),
            step.clone(),
            norm.clone(),
        ];
        if bf16 {
            s.push(xn.copy().unwrap());
        }
        s
    };
    same("adamw f32", &Op::AdamW(spec.clone()), &|| state(false));
    same("adamw bf16 + master", &Op::AdamW(spec), &|| state(true));
}
