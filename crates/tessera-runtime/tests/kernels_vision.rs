//! The vision kernels (convolution and its backward ops, GroupNorm, pooling, upsampling)
//! against the f64 reference interpreter (`tessera_ir::interp::eval_op`), through one
//! [`check`] helper.
//!
//! Criterion: for every output, the norm-wise relative error ‖got − want‖₂ / ‖want‖₂ must be at
//! most 1e-5 (the kernels_heavy criterion: a convolution is a GEMM); pooling and upsampling
//! only move, compare and add a few values, so their max-pool outputs must match exactly.
//! Inputs include non-contiguous views and a batch larger than one im2col chunk; a counting
//! allocator checks that a convolution allocates no more than its output and its declared
//! workspace (plus the GEMM library's packing buffers, bounded by its cache blocking).

use candle_core::{DType as CDType, Device, Tensor};
use std::sync::{Mutex, MutexGuard};
use tessera_ir::interp::{eval_op, Value};
use tessera_ir::{Conv2dSpec, Op, Pool2dSpec, TensorMeta};
use tessera_runtime::alloc::CountingAlloc;
use tessera_runtime::kernels::execute;
use tessera_runtime::tensor::{meta_of, to_f64_vec};
use tessera_runtime::RuntimeError;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const TOL: f64 = 1e-5;

/// Tests run one at a time so the allocation check sees only its own kernel.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// xorshift64*: deterministic uniform values in [-1, 1).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((r >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn tensor(&mut self, dims: &[usize]) -> Tensor {
        let n: usize = dims.iter().product();
        let data: Vec<f32> = (0..n).map(|_| self.next()).collect();
        Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
    }
    /// Small integers in −2..=2: many ties in every pooling window.
    fn ties(&mut self, dims: &[usize]) -> Tensor {
        let n: usize = dims.iter().product();
        let data: Vec<f32> = (0..n).map(|_| (self.next() * 2.5).round()).collect();
        Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
    }
}

fn value_of(t: &Tensor) -> Value {
    Value::new(t.dims().to_vec(), to_f64_vec(t).unwrap())
}

/// The same values stored with the last two dims swapped, read through a transposed view.
fn transposed_view(t: &Tensor) -> Tensor {
    let r = t.rank();
    let v = t.transpose(r - 2, r - 1).unwrap().contiguous().unwrap().transpose(r - 2, r - 1);
    let v = v.unwrap();
    assert!(!v.is_contiguous() || t.dims()[r - 2] == 1 || t.dims()[r - 1] == 1);
    v
}

fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0.0, 0.0);
    for (&g, &w) in got.iter().zip(want) {
        if w.is_infinite() {
            assert_eq!(g, w, "infinite reference element not matched");
            continue;
        }
        assert!(g.is_finite(), "kernel produced {g} where the reference has {w}");
        num += (g - w) * (g - w);
        den += w * w;
    }
    num.sqrt() / den.sqrt().max(1e-30)
}

fn out_metas(op: &Op, inputs: &[&Tensor]) -> Vec<TensorMeta> {
    let metas: Vec<TensorMeta> = inputs.iter().map(|t| meta_of(t).unwrap()).collect();
    op.infer(&metas.iter().collect::<Vec<_>>()).unwrap_or_else(|e| panic!("{op:?}: infer: {e}"))
}

/// Runs `op` through the runtime's dispatch and through the interpreter on the same values:
/// every output within [`TOL`] norm-wise, or bit-exact when `exact`. Returns the outputs.
fn check(op: &Op, inputs: &[&Tensor], exact: bool) -> Vec<Tensor> {
    let values: Vec<Value> = inputs.iter().map(|t| value_of(t)).collect();
    let metas = out_metas(op, inputs);
    let want = eval_op(op, &values.iter().collect::<Vec<_>>()).unwrap();
    let got = execute(op, inputs, &metas).unwrap_or_else(|e| panic!("{op:?}: kernel: {e}"));
    assert_eq!(got.len(), want.len(), "{op:?}: output count");
    for (i, ((g, w), m)) in got.iter().zip(&want).zip(&metas).enumerate() {
        assert_eq!(&meta_of(g).unwrap(), m, "{op:?}: output {i} meta");
        assert!(g.is_contiguous(), "{op:?}: output {i} must be a fresh contiguous tensor");
        let gv = to_f64_vec(g).unwrap();
        if exact {
            assert_eq!(gv, w.data, "{op:?}: output {i} must match exactly");
        } else {
            let err = rel_err(&gv, &w.data);
            assert!(err <= TOL, "{op:?}: output {i} relative error {err:e} > {TOL:e}");
        }
    }
    got
}

fn spec(
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
) -> Conv2dSpec {
    Conv2dSpec { stride, padding, dilation, groups }
}

/// Forward, backward-data and backward-filter of one convolution against the reference.
fn check_conv(rng: &mut Rng, xd: [usize; 4], wd: [usize; 4], s: Conv2dSpec, views: bool) {
    let (x, w) = (rng.tensor(&xd), rng.tensor(&wd));
    let y = check(&Op::Conv2d(s), &[&x, &w], false).remove(0);
    let dy = rng.tensor(y.dims());
    let bi = Op::Conv2dBackwardInput { spec: s, input_hw: [xd[2], xd[3]] };
    let bw = Op::Conv2dBackwardWeight { spec: s, kernel_hw: [wd[2], wd[3]] };
    check(&bi, &[&w, &dy], false);
    check(&bw, &[&x, &dy], false);
    if views {
        let (xv, wv, dyv) = (transposed_view(&x), transposed_view(&w), transposed_view(&dy));
        check(&Op::Conv2d(s), &[&xv, &wv], false);
        check(&bi, &[&wv, &dyv], false);
        check(&bw, &[&xv, &dyv], false);
    }
}

// ---- convolution ---------------------------------------------------------------------------

#[test]
fn conv_matches_the_reference_across_geometries() {
    let _s = serial();
    let mut rng = Rng::new(1);
    let cases = [
        // Plain 3×3, odd sizes.
        ([2, 3, 7, 9], [5, 3, 3, 3], spec([1, 1], [0, 0], [1, 1], 1), true),
        // Groups 2, stride 2, padding 1, dilation 2 (the brief's variations together).
        ([2, 4, 9, 8], [6, 2, 3, 3], spec([2, 2], [1, 1], [2, 2], 2), true),
        // Mixed per-dim stride / padding / dilation, a non-square kernel.
        ([1, 4, 8, 7], [4, 2, 2, 3], spec([2, 1], [1, 2], [2, 1], 2), false),
        // Depthwise (groups = C).
        ([2, 6, 6, 6], [6, 1, 3, 3], spec([1, 1], [1, 1], [1, 1], 6), true),
        // 1×1 stride 1, no padding: the direct path (x is its own column matrix).
        ([2, 8, 5, 6], [4, 8, 1, 1], spec([1, 1], [0, 0], [1, 1], 1), true),
        // 1×1 grouped, direct.
        ([2, 8, 5, 6], [6, 4, 1, 1], spec([1, 1], [0, 0], [1, 1], 2), false),
        // 1×1 stride 2 (a ResNet downsample): through im2col.
        ([2, 4, 7, 7], [8, 4, 1, 1], spec([2, 2], [0, 0], [1, 1], 1), false),
        // A 7×7 stride-2 stem on a batch of 6 (two im2col chunks, the second one short).
        ([6, 3, 16, 16], [8, 3, 7, 7], spec([2, 2], [3, 3], [1, 1], 1), false),
        // A kernel wider than the image: whole kernel columns fall in the padding.
        ([1, 2, 3, 2], [2, 2, 5, 5], spec([1, 1], [2, 2], [1, 1], 1), false),
        // Stride 3 over padding, dilation 3.
        ([2, 2, 11, 10], [3, 2, 3, 2], spec([3, 3], [2, 1], [3, 3], 1), false),
        // One image: multithreaded GEMMs.
        ([1, 16, 12, 12], [32, 16, 3, 3], spec([1, 1], [1, 1], [1, 1], 1), false),
    ];
    for (xd, wd, s, views) in cases {
        check_conv(&mut rng, xd, wd, s, views);
    }
}

#[test]
fn conv_kernel_matches_a_hand_computed_example() {
    let _s = serial();
    // x = 1..9 as a 3×3 image, w = [[1, 2], [3, 4]]: y[i,j] = x[i,j] + 2x[i,j+1] + 3x[i+1,j] +
    // 4x[i+1,j+1].
    let x = Tensor::from_vec((1..=9).map(|v| v as f32).collect(), (1, 1, 3, 3), &Device::Cpu);
    let w = Tensor::from_vec(vec![1f32, 2.0, 3.0, 4.0], (1, 1, 2, 2), &Device::Cpu);
    let (x, w) = (x.unwrap(), w.unwrap());
    let y = check(&Op::Conv2d(Conv2dSpec::default()), &[&x, &w], false);
    assert_eq!(to_f64_vec(&y[0]).unwrap(), vec![37.0, 47.0, 67.0, 77.0]);
    let padded = spec([2, 2], [1, 1], [1, 1], 1);
    let y = check(&Op::Conv2d(padded), &[&x, &w], false);
    assert_eq!(to_f64_vec(&y[0]).unwrap(), vec![4.0, 18.0, 36.0, 77.0]);
}

/// The `gemm` crate's packing buffers, per thread: sized by its cache blocking, not by the
/// problem (a worker that has not run a GEMM of this shape before allocates its own).
const GEMM_SCRATCH_PER_THREAD: u64 = 1 << 20;

#[test]
fn conv_allocates_only_its_output_and_declared_workspace() {
    let _s = serial();
    let mut rng = Rng::new(2);
    let s = spec([1, 1], [1, 1], [1, 1], 1);
    // 64 images: im2col over the whole batch would take 14.7 MB, the declared chunk 0.9 MB.
    let (x, w) = (rng.tensor(&[64, 16, 20, 20]), rng.tensor(&[32, 16, 3, 3]));
    let dy = rng.tensor(&[64, 32, 20, 20]);
    let scratch = (rayon::current_num_threads() as u64 + 1) * GEMM_SCRATCH_PER_THREAD;
    // A pointwise (1×1, stride 1, unpadded) convolution reads x in place: no workspace.
    let pw = Conv2dSpec::default();
    let w1 = rng.tensor(&[32, 16, 1, 1]);
    let ops = [
        (Op::Conv2d(s), vec![&x, &w], false),
        (Op::Conv2dBackwardInput { spec: s, input_hw: [20, 20] }, vec![&w, &dy], false),
        (Op::Conv2dBackwardWeight { spec: s, kernel_hw: [3, 3] }, vec![&x, &dy], false),
        (Op::Conv2d(pw), vec![&x, &w1], true),
        (Op::Conv2dBackwardInput { spec: pw, input_hw: [20, 20] }, vec![&w1, &dy], true),
        (Op::Conv2dBackwardWeight { spec: pw, kernel_hw: [1, 1] }, vec![&x, &dy], true),
    ];
    for (op, inputs, pointwise) in ops {
        let metas = out_metas(&op, &inputs);
        let in_metas: Vec<TensorMeta> = inputs.iter().map(|t| meta_of(t).unwrap()).collect();
        let workspace = op.workspace_bytes(&in_metas.iter().collect::<Vec<_>>());
        let out_bytes: u64 = metas.iter().map(|m| m.size_bytes()).sum();
        drop(execute(&op, &inputs, &metas).unwrap()); // warm the thread pool
        let before = tessera_runtime::alloc::current_bytes();
        tessera_runtime::alloc::reset_peak();
        let out = execute(&op, &inputs, &metas).unwrap();
        let extra = tessera_runtime::alloc::peak_bytes() - before;
        assert_eq!(workspace == 0, pointwise, "{}: workspace {workspace}", op.name());
        assert!(
            extra <= out_bytes + workspace + scratch,
            "{}: allocated {extra} bytes for a {out_bytes}-byte output and {workspace} bytes of \
             workspace",
            op.name()
        );
        drop(out);
    }
}

// ---- group norm ----------------------------------------------------------------------------

#[test]
fn group_norm_matches_the_reference() {
    let _s = serial();
    let mut rng = Rng::new(3);
    for (xd, groups) in [
        (vec![2, 4, 3, 3], 2),
        (vec![3, 6, 5], 3),
        (vec![2, 4, 2, 3], 1),
        (vec![2, 6, 2, 2], 6),
        (vec![2, 32, 16, 16], 8),
    ] {
        let c = xd[1];
        let x = rng.tensor(&xd);
        let (w, b) = (rng.tensor(&[c]), rng.tensor(&[c]));
        let op = Op::GroupNorm { groups, eps: 1e-5 };
        let y = check(&op, &[&x, &w, &b], false).remove(0);
        let dy = rng.tensor(y.dims());
        check(&Op::GroupNormBackward { groups, eps: 1e-5 }, &[&x, &w, &dy], false);
        let xv = transposed_view(&x);
        check(&op, &[&xv, &w, &b], false);
        check(&Op::GroupNormBackward { groups, eps: 1e-5 }, &[&xv, &w, &dy], false);
    }
}

// ---- pooling and upsampling ----------------------------------------------------------------

#[test]
fn max_pool_matches_the_reference_with_ties() {
    let _s = serial();
    let mut rng = Rng::new(4);
    for (k, s, p) in [([3, 3], [2, 2], [1, 1]), ([2, 2], [2, 2], [0, 0]), ([3, 2], [1, 1], [1, 1])]
    {
        let pool = Pool2dSpec { kernel: k, stride: s, padding: p };
        let x = rng.ties(&[2, 3, 9, 8]);
        let y = check(&Op::MaxPool2d(pool), &[&x], true).remove(0);
        let dy = rng.tensor(y.dims());
        check(&Op::MaxPool2dBackward(pool), &[&x, &dy], false);
        check(&Op::MaxPool2dBackward(pool), &[&transposed_view(&x), &dy], false);
    }
    // All-equal window: the whole gradient goes to its first element.
    let flat = Tensor::ones((1, 1, 2, 2), CDType::F32, &Device::Cpu).unwrap();
    let dy = Tensor::ones((1, 1, 1, 1), CDType::F32, &Device::Cpu).unwrap();
    let whole = Pool2dSpec { kernel: [2, 2], stride: [2, 2], padding: [0, 0] };
    let dx = check(&Op::MaxPool2dBackward(whole), &[&flat, &dy], true);
    assert_eq!(to_f64_vec(&dx[0]).unwrap(), vec![1.0, 0.0, 0.0, 0.0]);
}

#[test]
fn avg_pool_matches_the_reference() {
    let _s = serial();
    let mut rng = Rng::new(5);
    for (k, s, p) in [([3, 3], [2, 2], [1, 1]), ([2, 2], [2, 2], [0, 0]), ([3, 2], [1, 1], [1, 1])]
    {
        let pool = Pool2dSpec { kernel: k, stride: s, padding: p };
        for count_include_pad in [true, false] {
            let x = rng.tensor(&[2, 3, 9, 8]);
            let op = Op::AvgPool2d { pool, count_include_pad };
            let y = check(&op, &[&x], false).remove(0);
            check(&op, &[&transposed_view(&x)], false);
            let dy = rng.tensor(y.dims());
            let back = Op::AvgPool2dBackward { pool, count_include_pad, input_hw: [9, 8] };
            check(&back, &[&dy], false);
        }
    }
    // Global average pooling.
    let x = rng.tensor(&[2, 4, 7, 5]);
    let global = Pool2dSpec { kernel: [7, 5], stride: [1, 1], padding: [0, 0] };
    check(&Op::AvgPool2d { pool: global, count_include_pad: false }, &[&x], false);
}

#[test]
fn upsample_matches_the_reference() {
    let _s = serial();
    let mut rng = Rng::new(6);
    for scale in [[2, 2], [1, 3], [3, 2]] {
        let x = rng.tensor(&[2, 3, 5, 4]);
        let y = check(&Op::Upsample2d { scale }, &[&x], true).remove(0);
        check(&Op::Upsample2d { scale }, &[&transposed_view(&x)], true);
        let dy = rng.tensor(y.dims());
        check(&Op::Upsample2dBackward { scale }, &[&dy], false);
    }
}

#[test]
fn non_f32_inputs_are_unsupported_not_wrong() {
    let _s = serial();
    let mut rng = Rng::new(7);
    let x = rng.tensor(&[1, 2, 4, 4]).to_dtype(CDType::BF16).unwrap();
    let w = rng.tensor(&[2, 2, 3, 3]).to_dtype(CDType::BF16).unwrap();
    let op = Op::Conv2d(Conv2dSpec::default());
    let metas = out_metas(&op, &[&x, &w]);
    match execute(&op, &[&x, &w], &metas) {
        Err(RuntimeError::Unsupported { op, .. }) => assert_eq!(op, "conv2d"),
        other => panic!("bf16 conv2d: {other:?}"),
    }
}
