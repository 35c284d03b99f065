//! The elementwise, reduction, layout, normalisation, embedding and loss kernels against the
//! f64 reference interpreter (`tessera_ir::interp::eval_op`), data-driven in the style of
//! candle's grad tests: every case goes through one [`check_kernel`], which infers the output
//! metas from the IR, runs `kernels::execute`, runs the interpreter on the same values
//! (exactly converted to f64) and compares every output.
//!
//! Tolerance ([`assert_close`]): with `b` the reference and `a` the kernel's output,
//!
//! - elementwise `|a − b| ≤ 1e-5 · (|b| + 1e-3 · min(1, max|b|))`: 1e-5 relative, with an
//!   absolute floor for elements near zero of 1e-8 (or 1e-8·max|b| for tensors whose scale
//!   is below 1) — under one f32 ulp at the tensor's scale, so near-zero elements pass only
//!   if the kernel is accurate to f32 rounding there (no cancellation left unhandled);
//! - and norm-wise `‖a − b‖₂ ≤ 1e-5 · ‖b‖₂`;
//! - NaN and ±∞ must match exactly; integer and bool outputs must be exact.
//!
//! (Measured margins: the worst elementwise error of any case is under 0.1 of this
//! tolerance; for most kernels it is 0.006, i.e. the single rounding of an f64 result.)
//!
//! Inputs are random (seeded), of ranks 1 to 4, with odd sizes (7, 33), one case of ≥ 100K
//! elements per kernel so that the parallel paths run, and every float/int input is also fed
//! as non-contiguous views holding the same values (stored transposed, offset into a larger
//! buffer, row-strided) and as a broadcast view (stride 0): see [`check_layouts`].

use candle_core::{DType as CDType, Device, Storage, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_ir::interp::{self, Value};
use tessera_ir::{BinaryOp, DType, Op, ReduceOp, Shape, TensorMeta, UnaryOp};
use tessera_runtime::kernels;
use tessera_runtime::tensor::{check_meta, meta_of, to_f64_vec};
use tessera_runtime::RuntimeError;

const RTOL: f64 = 1e-5;
const FLOOR: f64 = 1e-3;

// ---- inputs ---------------------------------------------------------------------------------

fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

fn tensor_f32(data: Vec<f32>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
}

fn normal(r: &mut StdRng) -> f32 {
    let u1: f64 = r.random::<f64>().max(1e-300);
    let u2: f64 = r.random();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

fn randn(r: &mut StdRng, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    tensor_f32((0..n).map(|_| normal(r)).collect(), dims)
}

fn uniform(r: &mut StdRng, dims: &[usize], lo: f32, hi: f32) -> Tensor {
    let n = dims.iter().product();
    tensor_f32((0..n).map(|_| r.random_range(lo..hi)).collect(), dims)
}

/// Magnitudes in [0.5, 2] with random signs (safe divisors).
fn nonzero(r: &mut StdRng, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    let v = (0..n)
        .map(|_| {
            let m: f32 = r.random_range(0.5..2.0);
            if r.random::<bool>() {
                m
            } else {
                -m
            }
        })
        .collect();
    tensor_f32(v, dims)
}

/// Small integers as floats: many ties (for max / min and first-argmax).
fn ties(r: &mut StdRng, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    tensor_f32((0..n).map(|_| r.random_range(-3i32..=3) as f32).collect(), dims)
}

fn ids(r: &mut StdRng, dims: &[usize], vocab: i64) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<i64> = (0..n).map(|_| r.random_range(0..vocab)).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn ids_from(v: Vec<i64>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn seed(s: i64) -> Tensor {
    Tensor::new(s, &Device::Cpu).unwrap()
}

fn value_of(t: &Tensor) -> Value {
    Value::new(t.dims().to_vec(), to_f64_vec(t).unwrap())
}

/// Other layouts holding `t`'s values: stored transposed and read through a transposed
/// view; offset into a larger buffer; every other row of a wider buffer (row-strided); and
/// a broadcast view (stride 0 along dim 0) — the last one repeats `t`'s first slice, so its
/// values differ, but it is still a valid input of the same shape.
fn layouts(t: &Tensor) -> Vec<(&'static str, Tensor)> {
    let r = t.rank();
    let mut v = Vec::new();
    if r == 0 || t.elem_count() == 0 {
        return v;
    }
    if r >= 2 {
        let tt = t.transpose(r - 2, r - 1).unwrap().contiguous().unwrap();
        let view = tt.transpose(r - 2, r - 1).unwrap();
        assert!(!view.is_contiguous() || t.dims()[r - 2] == 1 || t.dims()[r - 1] == 1);
        v.push(("transposed", view));
    }
    let n0 = t.dims()[0];
    let off = Tensor::cat(&[t, t], 0).unwrap().narrow(0, n0, n0).unwrap();
    assert!(off.layout().start_offset() > 0);
    v.push(("offset", off));
    let last = r - 1;
    let nl = t.dims()[last];
    v.push(("row-strided", Tensor::cat(&[t, t], last).unwrap().narrow(last, 0, nl).unwrap()));
    if n0 > 1 {
        let b = t.narrow(0, 0, 1).unwrap().broadcast_as(t.dims()).unwrap();
        assert_eq!(b.stride()[0], 0);
        v.push(("broadcast", b));
    }
    v
}

// ---- comparison -----------------------------------------------------------------------------

/// The criterion stated in the module docs; returns the worst elementwise
/// `|a − b| / (RTOL·(|b| + FLOOR·max|b|))` (≤ 1 when passing).
fn assert_close(what: &str, got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let scale = want.iter().filter(|v| v.is_finite()).fold(0f64, |m, v| m.max(v.abs()));
    let (mut err2, mut norm2, mut worst) = (0f64, 0f64, 0f64);
    for (k, (&a, &b)) in got.iter().zip(want).enumerate() {
        if b.is_nan() {
            assert!(a.is_nan(), "{what}: element {k}: got {a}, want NaN");
            continue;
        }
        if b.is_infinite() {
            assert_eq!(a, b, "{what}: element {k}");
            continue;
        }
        let tol = RTOL * (b.abs() + FLOOR * scale.min(1.0));
        let d = (a - b).abs();
        assert!(
            d <= tol || (d == 0.0 && tol == 0.0),
            "{what}: element {k} of {}: got {a}, want {b} (|diff| {d:e} > tol {tol:e})",
            got.len()
        );
        if tol > 0.0 {
            worst = worst.max(d / tol);
        }
        err2 += d * d;
        norm2 += b * b;
    }
    assert!(
        err2.sqrt() <= RTOL * norm2.sqrt().max(1e-30),
        "{what}: norm-wise error {:e} > {RTOL:e} · {:e}",
        err2.sqrt(),
        norm2.sqrt()
    );
    worst
}

fn is_view_op(op: &Op) -> bool {
    matches!(op, Op::Reshape(_) | Op::Expand(_))
}

/// Runs `op` on `inputs` with the runtime kernel and with the interpreter and compares every
/// output (metas, values); returns the kernel's outputs.
fn check_kernel(op: &Op, inputs: &[Tensor], what: &str) -> Vec<Tensor> {
    let metas: Vec<TensorMeta> = inputs.iter().map(|t| meta_of(t).unwrap()).collect();
    let meta_refs: Vec<&TensorMeta> = metas.iter().collect();
    let out_metas = op.infer(&meta_refs).unwrap_or_else(|e| panic!("{what}: infer: {e}"));
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let got = kernels::execute(op, &refs, &out_metas)
        .unwrap_or_else(|e| panic!("{what}: {} kernel failed: {e}", op.name()));
    let values: Vec<Value> = inputs.iter().map(value_of).collect();
    let value_refs: Vec<&Value> = values.iter().collect();
    let want = interp::eval_op(op, &value_refs).unwrap_or_else(|e| panic!("{what}: interp: {e}"));
    assert_eq!(got.len(), want.len(), "{what}: output count");
    for (i, ((g, w), m)) in got.iter().zip(&want).zip(&out_metas).enumerate() {
        let label = format!("{what}: {} output {i}", op.name());
        check_meta(g, m, &label).unwrap();
        assert_eq!(g.dims(), w.dims(), "{label}: shape");
        if !is_view_op(op) {
            assert!(g.is_contiguous(), "{label}: outputs must be fresh contiguous tensors");
        }
        let gv = to_f64_vec(g).unwrap();
        if matches!(m.dtype, DType::I32 | DType::I64 | DType::Bool) {
            assert_eq!(gv, w.data, "{label}: integer outputs must be exact");
        } else {
            assert_close(&label, &gv, &w.data);
        }
    }
    got
}

/// [`check_kernel`] on `inputs`, then again with each non-scalar input replaced by each of
/// its [`layouts`].
fn check_layouts(op: &Op, inputs: &[Tensor], what: &str) -> Vec<Tensor> {
    let out = check_kernel(op, inputs, what);
    for i in 0..inputs.len() {
        for (name, v) in layouts(&inputs[i]) {
            let mut alt = inputs.to_vec();
            alt[i] = v;
            check_kernel(op, &alt, &format!("{what} [input {i} {name}]"));
        }
    }
    out
}

const SHAPES: &[&[usize]] = &[&[7], &[3, 33], &[2, 3, 5, 7], &[4, 1, 9], &[64, 33, 50]];

// ---- elementwise ----------------------------------------------------------------------------

/// Every unary op (also read by `kernels_bf16`).
pub(crate) const UNARY: [UnaryOp; 13] = [
    UnaryOp::Neg,
    UnaryOp::Exp,
    UnaryOp::Log,
    UnaryOp::Sqrt,
    UnaryOp::Rsqrt,
    UnaryOp::Tanh,
    UnaryOp::Gelu,
    UnaryOp::GeluTanh,
    UnaryOp::Silu,
    UnaryOp::Relu,
    UnaryOp::Sigmoid,
    UnaryOp::Sin,
    UnaryOp::Cos,
];

fn unary_input(r: &mut StdRng, u: UnaryOp, dims: &[usize]) -> Tensor {
    match u {
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt => uniform(r, dims, 0.05, 5.0),
        _ => (randn(r, dims) * 2.0).unwrap(),
    }
}

#[test]
fn fill_every_dtype() {
    for (value, dtype) in [
        (1.5, DType::F32),
        (-2.25, DType::F64),
        (3.0, DType::BF16),
        (0.5, DType::F16),
        (7.0, DType::I64),
        (1.0, DType::Bool),
    ] {
        for dims in [&[][..], &[7], &[3, 33]] {
            let op = Op::Fill { value, meta: TensorMeta::new(dims.to_vec(), dtype) };
            check_kernel(&op, &[], &format!("fill {value} {dtype} {dims:?}"));
        }
    }
}

#[test]
fn unary_forward_and_backward() {
    let mut r = rng(1);
    for u in UNARY {
        for dims in SHAPES {
            let x = unary_input(&mut r, u, dims);
            let dy = randn(&mut r, dims);
            let what = format!("{u:?} {dims:?}");
            check_layouts(&Op::Unary(u), std::slice::from_ref(&x), &what);
            check_layouts(&Op::UnaryBackward(u), &[x, dy], &what);
        }
    }
}

/// Infinities, NaN, signed zeros, tiny and large (f32-finite) values.
#[test]
fn unary_special_values() {
    let v = vec![0.0, -0.0, 1e-6, -1e-6, 80.0, -80.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
    let n = v.len();
    let x = tensor_f32(v, &[n]);
    let dy = tensor_f32(vec![1.0; n], &[n]);
    for u in UNARY {
        let what = format!("{u:?} on special values");
        check_kernel(&Op::Unary(u), std::slice::from_ref(&x), &what);
        check_kernel(&Op::UnaryBackward(u), &[x.clone(), dy.clone()], &what);
    }
}

/// A dense grid over a wide range: the tails of exp, sigmoid, tanh and both GELUs (where
/// naive formulas cancel or overflow), and exactly 0 (Relu's kink).
#[test]
fn unary_wide_range_grid() {
    let n = 120_001;
    let grid: Vec<f32> = (0..n).map(|k| -30.0 + 60.0 * k as f32 / (n - 1) as f32).collect();
    let x = tensor_f32(grid, &[n]);
    let dy = tensor_f32(vec![1.0; n], &[n]);
    for u in UNARY {
        let x = match u {
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt => (x.abs().unwrap() + 1e-3).unwrap(),
            _ => x.clone(),
        };
        let what = format!("{u:?} on [-30, 30]");
        check_kernel(&Op::Unary(u), std::slice::from_ref(&x), &what);
        check_kernel(&Op::UnaryBackward(u), &[x, dy.clone()], &what);
    }
}

const BINARY: [BinaryOp; 6] =
    [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Max, BinaryOp::Min];

/// Operand shape pairs: scalars, equal, trailing (bias) broadcast both ways, both broadcast, scalar,
/// column broadcast, rank 1, and a large bias add.
const BINARY_SHAPES: &[(&[usize], &[usize])] = &[
    (&[], &[]),
    (&[7], &[7]),
    (&[3, 33], &[3, 33]),
    (&[4, 7, 33], &[33]),
    (&[33], &[4, 7, 33]),
    (&[4, 1, 33], &[7, 1]),
    (&[], &[5, 7]),
    (&[5, 7], &[]),
    (&[5, 1], &[5, 7]),
    (&[2, 3, 5, 7], &[3, 1, 7]),
    (&[300, 400], &[400]),
    (&[300, 400], &[300, 400]),
];

fn binary_operands(r: &mut StdRng, op: BinaryOp, da: &[usize], db: &[usize]) -> (Tensor, Tensor) {
    match op {
        BinaryOp::Div => (randn(r, da), nonzero(r, db)),
        // Integer-valued operands tie often: ties must go to `a`.
        BinaryOp::Max | BinaryOp::Min => (ties(r, da), ties(r, db)),
        _ => (randn(r, da), randn(r, db)),
    }
}

#[test]
fn binary_forward_broadcasting() {
    let mut r = rng(2);
    for op in BINARY {
        for &(da, db) in BINARY_SHAPES {
            let (a, b) = binary_operands(&mut r, op, da, db);
            check_layouts(&Op::Binary(op), &[a, b], &format!("{op:?} {da:?} {db:?}"));
        }
    }
}

#[test]
fn binary_backward_every_operand() {
    let mut r = rng(3);
    for op in BINARY {
        for &(da, db) in BINARY_SHAPES {
            let (a, b) = binary_operands(&mut r, op, da, db);
            let out = Shape::broadcast(&Shape::from(da), &Shape::from(db)).unwrap();
            let dy = randn(&mut r, out.dims());
            for wrt in 0..2u8 {
                let what = format!("{op:?} wrt {wrt} {da:?} {db:?}");
                check_layouts(
                    &Op::BinaryBackward { op, wrt },
                    &[a.clone(), b.clone(), dy.clone()],
                    &what,
                );
            }
        }
    }
}

#[test]
fn binary_max_min_propagate_nan() {
    let a = tensor_f32(vec![f32::NAN, 1.0, 2.0, f32::NAN], &[4]);
    let b = tensor_f32(vec![0.0, f32::NAN, 2.0, 5.0], &[4]);
    for op in [BinaryOp::Max, BinaryOp::Min] {
        check_kernel(&Op::Binary(op), &[a.clone(), b.clone()], &format!("{op:?} with NaN"));
    }
}

#[test]
fn cast_between_dtypes() {
    let mut r = rng(4);
    for dims in SHAPES {
        let x = (randn(&mut r, dims) * 3.0).unwrap();
        for to in [DType::F32, DType::F64, DType::I64, DType::I32, DType::Bool] {
            check_layouts(
                &Op::Cast(to),
                std::slice::from_ref(&x),
                &format!("cast {dims:?} to {to}"),
            );
        }
        let i = ids(&mut r, dims, 1000);
        for to in [DType::F32, DType::F64, DType::Bool] {
            check_layouts(
                &Op::Cast(to),
                std::slice::from_ref(&i),
                &format!("cast i64 {dims:?} to {to}"),
            );
        }
        // Rounding casts: the interpreter does not round, so compare within the format's
        // half-ulp.
        for (to, rel) in [(DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
            let op = Op::Cast(to);
            let m = op.infer(&[&meta_of(&x).unwrap()]).unwrap();
            let y = kernels::execute(&op, &[&x], &m).unwrap();
            check_meta(&y[0], &m[0], "rounding cast").unwrap();
            let (got, want) = (to_f64_vec(&y[0]).unwrap(), to_f64_vec(&x).unwrap());
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= rel * w.abs() + 1e-7, "cast to {to}: {g} vs {w}");
            }
        }
    }
    // Zeros (and only zeros) become false.
    let x = tensor_f32(vec![0.0, -0.0, 0.25, -3.0, f32::NAN], &[5]);
    check_kernel(&Op::Cast(DType::Bool), &[x], "cast to bool");
}

#[test]
fn dropout_matches_the_shared_mask() {
    let mut r = rng(5);
    for dims in SHAPES {
        let x = randn(&mut r, dims);
        for (p, s) in [(0.0, 7), (0.1, 1234), (0.5, -5)] {
            for stream in [0u64, 3] {
                let op = Op::Dropout { p, stream, shard: None };
                let what = format!("dropout p={p} seed={s} stream={stream} {dims:?}");
                check_layouts(&op, &[x.clone(), seed(s)], &what);
            }
        }
    }
    // The kept fraction is about 1 − p.
    let x = tensor_f32(vec![1.0; 200_000], &[200_000]);
    let op = Op::Dropout { p: 0.25, stream: 1, shard: None };
    let m = op.infer(&[&meta_of(&x).unwrap(), &meta_of(&seed(9)).unwrap()]).unwrap();
    let y = kernels::execute(&op, &[&x, &seed(9)], &m).unwrap();
    let kept = to_f64_vec(&y[0]).unwrap().iter().filter(|&&v| v != 0.0).count();
    let frac = kept as f64 / 200_000.0;
    assert!((frac - 0.75).abs() < 0.01, "kept fraction {frac}");
}

/// A shard's mask is its slice of the single-device mask: on a 2×2 mesh, for a tensor split
/// over both axes (and for a second micro-batch of it), every device's dropout output equals
/// the matching block of the whole tensor's output, so every plan drops what one device drops.
#[test]
fn sharded_dropout_is_the_slice_of_the_single_device_mask() {
    use tessera_ir::dist::{MeshPos, ShardOf};
    let mut r = rng(11);
    let global = [2 * 4, 6, 2 * 5];
    // Two micro-batches: the second one's rows follow the first's in the whole batch.
    let whole = randn(&mut r, &[2 * global[0], global[1], global[2]]);
    let op = Op::Dropout { p: 0.3, stream: 2, shard: None };
    let m = op.infer(&[&meta_of(&whole).unwrap(), &meta_of(&seed(4)).unwrap()]).unwrap();
    let want = kernels::execute(&op, &[&whole, &seed(4)], &m).unwrap().remove(0);
    let placement = vec![vec![0], vec![], vec![1]];
    for micro_batch in 0..2 {
        let shard = ShardOf { global: global.to_vec(), placement: placement.clone(), micro_batch };
        let op = Op::Dropout { p: 0.3, stream: 2, shard: Some(shard) };
        for rank in 0..4 {
            let at = MeshPos::new(&[2, 2], rank).unwrap();
            let (r0, c0) = (at.coords[0] * 4 + micro_batch * global[0], at.coords[1] * 5);
            let x = whole.narrow(0, r0, 4).unwrap().narrow(2, c0, 5).unwrap().contiguous().unwrap();
            let m = op.infer(&[&meta_of(&x).unwrap(), &meta_of(&seed(4)).unwrap()]).unwrap();
            let got = kernels::execute_at(&op, &[&x, &seed(4)], &m, &at).unwrap().remove(0);
            let expect = want.narrow(0, r0, 4).unwrap().narrow(2, c0, 5).unwrap();
            assert_eq!(
                to_f64_vec(&got).unwrap(),
                to_f64_vec(&expect.contiguous().unwrap()).unwrap(),
                "micro-batch {micro_batch}, rank {rank}"
            );
        }
    }
}

// ---- reductions -----------------------------------------------------------------------------

const REDUCE: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::SumSquares];

/// (shape, dim sets): small ranks 1–4 with every kind of dim set, and large shapes that take
/// both parallel strategies (split outputs / split the reduction) with the innermost dim kept
/// or reduced.
const REDUCE_CASES: &[(&[usize], &[&[usize]])] = &[
    (&[7], &[&[0], &[]]),
    (&[3, 33], &[&[0], &[1], &[0, 1]]),
    (&[2, 3, 5, 7], &[&[1], &[0, 2], &[3], &[1, 2], &[2, 0], &[0, 1, 2, 3], &[0, 3]]),
    (&[4, 1, 9], &[&[1], &[0, 1], &[2]]),
    (&[64, 33, 50], &[&[2], &[0], &[0, 1], &[1], &[0, 1, 2]]),
    (&[8, 50, 300], &[&[0], &[2], &[0, 2]]),
    (&[300, 50, 8], &[&[2], &[1], &[0, 2]]),
];

#[test]
fn reduce_forward() {
    let mut r = rng(6);
    for op in REDUCE {
        for &(dims, sets) in REDUCE_CASES {
            for &set in sets {
                for keepdim in [false, true] {
                    let x =
                        if op == ReduceOp::Max { ties(&mut r, dims) } else { randn(&mut r, dims) };
                    let rop = Op::Reduce { op, dims: set.to_vec(), keepdim };
                    let what = format!("{op:?} {dims:?} over {set:?} keepdim={keepdim}");
                    check_layouts(&rop, &[x], &what);
                }
            }
        }
    }
}

fn reduced_dims(dims: &[usize], set: &[usize], keepdim: bool) -> Vec<usize> {
    (0..dims.len())
        .filter(|i| keepdim || !set.contains(i))
        .map(|i| if set.contains(&i) { 1 } else { dims[i] })
        .collect()
}

#[test]
fn reduce_backward() {
    let mut r = rng(7);
    for op in REDUCE {
        for &(dims, sets) in REDUCE_CASES {
            for &set in sets {
                for keepdim in [false, true] {
                    let x =
                        if op == ReduceOp::Max { ties(&mut r, dims) } else { randn(&mut r, dims) };
                    let rs = reduced_dims(dims, set, keepdim);
                    let dy = randn(&mut r, &rs);
                    let rop = Op::ReduceBackward { op, dims: set.to_vec(), keepdim };
                    let what = format!("{op:?} backward {dims:?} over {set:?} keepdim={keepdim}");
                    check_layouts(&rop, &[x, dy], &what);
                }
            }
        }
    }
}

/// A global sum of squares (a gradient norm) over 2M elements of mixed magnitudes: f64
/// accumulation keeps it within 1e-5 (f32 accumulation would not).
#[test]
fn reduce_sum_squares_large_is_accurate() {
    let mut r = rng(8);
    let n = 1 << 21;
    let v: Vec<f32> =
        (0..n).map(|k| normal(&mut r) * if k % 3 == 0 { 1e-3 } else { 10.0 }).collect();
    let x = tensor_f32(v, &[n]);
    for op in [ReduceOp::SumSquares, ReduceOp::Sum, ReduceOp::Max] {
        check_kernel(
            &Op::Reduce { op, dims: vec![0], keepdim: false },
            std::slice::from_ref(&x),
            "2M reduce",
        );
    }
    let x2 = x.reshape((1024, 2048)).unwrap();
    check_kernel(
        &Op::Reduce { op: ReduceOp::SumSquares, dims: vec![0, 1], keepdim: true },
        &[x2],
        "2M reduce 2-d",
    );
}

#[test]
fn softmax_forward_and_backward() {
    let mut r = rng(9);
    for dims in SHAPES.iter().copied().chain([&[2112, 50][..], &[3, 1]]) {
        for scale in [1.0, 10.0] {
            let x = (randn(&mut r, dims) * scale).unwrap();
            let what = format!("softmax {dims:?} ×{scale}");
            let y = check_layouts(&Op::Softmax, std::slice::from_ref(&x), &what);
            let dy = randn(&mut r, dims);
            check_layouts(&Op::SoftmaxBackward, &[y[0].clone(), dy], &what);
            check_layouts(
                &Op::LogSumExp,
                std::slice::from_ref(&x),
                &format!("logsumexp of {what}"),
            );
        }
    }
}

// ---- layout ---------------------------------------------------------------------------------

/// The address of a CPU tensor's storage buffer and its start offset.
fn storage_addr(t: &Tensor) -> (usize, usize) {
    let (s, l) = t.storage_and_layout();
    let addr = match &*s {
        Storage::Cpu(c) => match t.dtype() {
            CDType::F32 => c.as_slice::<f32>().unwrap().as_ptr() as usize,
            CDType::I64 => c.as_slice::<i64>().unwrap().as_ptr() as usize,
            d => panic!("unexpected dtype {d:?}"),
        },
        _ => panic!("not a CPU tensor"),
    };
    (addr, l.start_offset())
}

#[test]
fn reshape_is_a_view() {
    let mut r = rng(10);
    for (from, to) in [
        (&[2, 3, 5, 7][..], &[6, 35][..]),
        (&[2, 3, 5, 7], &[210]),
        (&[7], &[7, 1]),
        (&[64, 33, 50], &[2112, 50]),
        (&[1], &[]),
    ] {
        let x = randn(&mut r, from);
        let op = Op::Reshape(Shape::from(to));
        let y = check_kernel(&op, std::slice::from_ref(&x), &format!("reshape {from:?} → {to:?}"));
        // Same buffer, same offset: no copy was made.
        assert_eq!(storage_addr(&y[0]), storage_addr(&x), "reshape {from:?} copied");
        // An offset (contiguous) view stays a view too.
        if let Some((_, off)) = layouts(&x).into_iter().find(|(n, _)| *n == "offset") {
            let y = check_kernel(&op, std::slice::from_ref(&off), "reshape of an offset view");
            assert_eq!(storage_addr(&y[0]), storage_addr(&off));
        }
        // Non-contiguous inputs are materialised, then viewed.
        for (name, v) in layouts(&x) {
            let y = check_kernel(&op, &[v], &format!("reshape {from:?} [{name}]"));
            assert!(y[0].is_contiguous());
        }
    }
}

#[test]
fn expand_is_a_view() {
    let mut r = rng(11);
    for (from, to) in [
        (&[33][..], &[4, 7, 33][..]),
        (&[4, 1, 33], &[4, 7, 33]),
        (&[], &[3, 2]),
        (&[1], &[5]),
        (&[7, 1], &[2, 7, 9]),
        (&[3, 33], &[3, 33]),
        (&[400], &[300, 400]),
    ] {
        let x = randn(&mut r, from);
        let op = Op::Expand(Shape::from(to));
        let y = check_kernel(&op, std::slice::from_ref(&x), &format!("expand {from:?} → {to:?}"));
        assert_eq!(storage_addr(&y[0]), storage_addr(&x), "expand {from:?} copied");
        if to.iter().product::<usize>() > x.elem_count() {
            assert!(y[0].stride().contains(&0), "expand must broadcast with stride 0");
        }
        for (name, v) in layouts(&x) {
            let y =
                check_kernel(&op, std::slice::from_ref(&v), &format!("expand {from:?} [{name}]"));
            assert_eq!(storage_addr(&y[0]), storage_addr(&v), "expand of a view copied");
        }
    }
}

#[test]
fn permute_slice_pad_concat() {
    let mut r = rng(12);
    let perms: &[(&[usize], &[usize])] = &[
        (&[7], &[0]),
        (&[3, 33], &[1, 0]),
        (&[2, 3, 5, 7], &[0, 2, 1, 3]),
        (&[2, 3, 5, 7], &[3, 2, 1, 0]),
        (&[2, 3, 5, 7], &[1, 3, 0, 2]),
        (&[8, 64, 12, 17], &[0, 2, 1, 3]),
    ];
    for &(dims, perm) in perms {
        let x = randn(&mut r, dims);
        check_layouts(&Op::Permute(perm.to_vec()), &[x], &format!("permute {dims:?} {perm:?}"));
        let i = ids(&mut r, dims, 100);
        check_layouts(&Op::Permute(perm.to_vec()), &[i], &format!("permute i64 {dims:?} {perm:?}"));
    }
    let slices: &[(&[usize], usize, usize, usize)] = &[
        (&[7], 0, 2, 5),
        (&[3, 33], 1, 0, 32),
        (&[3, 33], 0, 1, 3),
        (&[2, 3, 5, 7], 2, 1, 4),
        (&[2, 3, 5, 7], 3, 6, 7),
        (&[64, 33, 50], 1, 3, 30),
    ];
    for &(dims, dim, start, end) in slices {
        let op = Op::Slice { dim, start, end };
        let what = format!("slice {dims:?} dim {dim} {start}..{end}");
        check_layouts(&op, &[randn(&mut r, dims)], &what);
        check_layouts(&op, &[ids(&mut r, dims, 50)], &format!("{what} i64"));
    }
    let pads: &[(&[usize], usize, usize, usize)] = &[
        (&[7], 0, 2, 3),
        (&[3, 33], 1, 0, 4),
        (&[3, 33], 0, 1, 0),
        (&[2, 3, 5, 7], 2, 1, 1),
        (&[2, 3, 5, 7], 3, 0, 0),
        (&[64, 33, 50], 1, 3, 5),
    ];
    for &(dims, dim, before, after) in pads {
        let op = Op::Pad { dim, before, after };
        check_layouts(
            &op,
            &[randn(&mut r, dims)],
            &format!("pad {dims:?} dim {dim} {before}+{after}"),
        );
    }
    let concats: &[(&[&[usize]], usize)] = &[
        (&[&[7], &[3]], 0),
        (&[&[3, 33], &[3, 1], &[3, 4]], 1),
        (&[&[3, 33], &[2, 33]], 0),
        (&[&[2, 3, 5, 7], &[2, 3, 2, 7], &[2, 3, 1, 7]], 2),
        (&[&[2, 3, 5, 7]], 3),
        (&[&[64, 33, 20], &[64, 33, 30]], 2),
    ];
    for &(shapes, dim) in concats {
        let xs: Vec<Tensor> = shapes.iter().map(|s| randn(&mut r, s)).collect();
        check_layouts(&Op::Concat { dim }, &xs, &format!("concat {shapes:?} dim {dim}"));
        let is: Vec<Tensor> = shapes.iter().map(|s| ids(&mut r, s, 9)).collect();
        check_kernel(&Op::Concat { dim }, &is, &format!("concat i64 {shapes:?} dim {dim}"));
    }
}

// ---- normalisation --------------------------------------------------------------------------

const NORM_SHAPES: &[&[usize]] = &[&[7], &[3, 33], &[2, 3, 5, 7], &[136, 768], &[4, 1, 1]];

#[test]
fn layer_norm_forward_and_backward() {
    let mut r = rng(13);
    for dims in NORM_SHAPES {
        let d = *dims.last().unwrap();
        for shift in [0.0, 5.0] {
            let x = (randn(&mut r, dims) + shift).unwrap();
            let (w, b, dy) = (randn(&mut r, &[d]), randn(&mut r, &[d]), randn(&mut r, dims));
            let what = format!("layer_norm {dims:?} +{shift}");
            check_layouts(&Op::LayerNorm { eps: 1e-5 }, &[x.clone(), w.clone(), b], &what);
            check_layouts(&Op::LayerNormBackward { eps: 1e-5 }, &[x, w, dy], &what);
        }
    }
}

#[test]
fn rms_norm_forward_and_backward() {
    let mut r = rng(14);
    for dims in NORM_SHAPES {
        let d = *dims.last().unwrap();
        let x = randn(&mut r, dims);
        let (w, dy) = (randn(&mut r, &[d]), randn(&mut r, dims));
        let what = format!("rms_norm {dims:?}");
        check_layouts(&Op::RmsNorm { eps: 1e-6 }, &[x.clone(), w.clone()], &what);
        check_layouts(&Op::RmsNormBackward { eps: 1e-6 }, &[x, w, dy], &what);
    }
}

// ---- embedding and loss ---------------------------------------------------------------------

/// Megatron-LM's vocabulary-parallel embedding: a table split by rows over a mesh axis. Each
/// device's lookup on its rows (ids another device holds read zeros) sums over the devices to
/// the whole table's lookup, and each device's gradient is its rows of the whole gradient.
#[test]
fn vocabulary_shards_sum_to_the_whole_lookup() {
    use tessera_ir::dist::{MeshPos, ShardOf};
    let mut r = rng(16);
    let (v, d, shards) = (12usize, 5usize, 3usize);
    let table = randn(&mut r, &[v, d]);
    let i = ids(&mut r, &[4, 7], v as i64);
    let dy = randn(&mut r, &[4, 7, d]);
    let values = |t: &Tensor| to_f64_vec(t).unwrap();
    let run = |op: &Op, x: &[&Tensor], at: &MeshPos| {
        let metas: Vec<TensorMeta> = x.iter().map(|t| meta_of(t).unwrap()).collect();
        let refs: Vec<&TensorMeta> = metas.iter().collect();
        let out = op.infer(&refs).unwrap();
        kernels::execute_at(op, x, &out, at).unwrap().remove(0)
    };
    let whole = run(&Op::Embedding { rows: None }, &[&table, &i], &MeshPos::single());
    let whole_grad = run(
        &Op::EmbeddingBackward { num_embeddings: v, rows: None },
        &[&i, &dy],
        &MeshPos::single(),
    );
    // Rows split over axis 1 of a [2, 3] mesh (the tensor-parallel axis of `dp2 tp3`).
    let rows =
        Some(ShardOf { global: vec![v, d], placement: vec![vec![1], vec![]], micro_batch: 0 });
    let n = v / shards;
    let mut sum = whole.zeros_like().unwrap();
    for k in 0..shards {
        let at = MeshPos::new(&[2, shards], shards + k).unwrap();
        let part = table.narrow(0, k * n, n).unwrap();
        let y = run(&Op::Embedding { rows: rows.clone() }, &[&part, &i], &at);
        sum = (sum + y).unwrap();
        let g =
            run(&Op::EmbeddingBackward { num_embeddings: n, rows: rows.clone() }, &[&i, &dy], &at);
        let want = whole_grad.narrow(0, k * n, n).unwrap();
        assert_eq!(values(&g), values(&want), "shard {k}: its rows of the gradient");
    }
    // Each output row is one shard's row plus zeros: exact.
    assert_eq!(values(&sum), values(&whole), "the shards' lookups sum to the whole");
}

/// Megatron-LM's vocabulary-parallel loss: logits split by classes over a mesh axis. Each
/// shard's log-sum-exp, combined ([`Op::LogSumExp`] over the gathered values), is the whole
/// row's; the shards' losses sum to the whole loss; each shard's gradient is its columns of
/// the whole gradient. With and without an ignored target, mean and sum.
#[test]
fn vocabulary_parallel_loss_shards_sum_to_the_whole_loss() {
    use tessera_ir::dist::{MeshPos, ShardOf};
    let mut r = rng(17);
    let (rows, v, shards) = (9usize, 12usize, 3usize);
    let logits = (randn(&mut r, &[rows, v]) * 3.0).unwrap();
    let values = |t: &Tensor| to_f64_vec(t).unwrap();
    let run = |op: &Op, x: &[&Tensor], at: &MeshPos| {
        let metas: Vec<TensorMeta> = x.iter().map(|t| meta_of(t).unwrap()).collect();
        let refs: Vec<&TensorMeta> = metas.iter().collect();
        let out = op.infer(&refs).unwrap();
        kernels::execute_at(op, x, &out, at).unwrap()
    };
    let one = MeshPos::single();
    let n = v / shards;
    let at = |k: usize| MeshPos::new(&[2, shards], shards + k).unwrap();
    let part = |k: usize| logits.narrow(1, k * n, n).unwrap();
    // The global log-sum-exp from the shards' (each shard's column of a [rows, shards]).
    let locals: Vec<Tensor> = (0..shards)
        .map(|k| run(&Op::LogSumExp, &[&part(k)], &one).remove(0).reshape((rows, 1)).unwrap())
        .collect();
    let gathered = Tensor::cat(&locals, 1).unwrap();
    let lse = run(&Op::LogSumExp, &[&gathered], &one).remove(0);
    let whole_lse = run(&Op::LogSumExp, &[&logits], &one).remove(0);
    for (a, b) in values(&lse).iter().zip(values(&whole_lse)) {
        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "log-sum-exp {a} vs {b}");
    }
    let classes = Some(ShardOf { global: vec![v], placement: vec![vec![1]], micro_batch: 0 });
    let dloss = Tensor::new(1.3f32, &Device::Cpu).unwrap();
    for ignore in [None, Some(-100i64)] {
        let t: Vec<i64> = (0..rows)
            .map(
                |k| if ignore.is_some() && k % 4 == 2 { -100 } else { r.random_range(0..v as i64) },
            )
            .collect();
        let targets = ids_from(t, &[rows]);
        for sum in [false, true] {
            let what = format!("ignore={ignore:?} sum={sum}");
            let whole_op = Op::CrossEntropy { ignore_index: ignore, sum, classes: None };
            let whole = run(&whole_op, &[&logits, &targets], &one);
            let back = Op::CrossEntropyBackward { ignore_index: ignore, sum, classes: None };
            let whole_grad = run(&back, &[&logits, &targets, &whole[1], &dloss], &one).remove(0);
            let mut loss = 0.0;
            for k in 0..shards {
                let op = Op::CrossEntropy { ignore_index: ignore, sum, classes: classes.clone() };
                let out = run(&op, &[&part(k), &targets, &lse], &at(k));
                loss += values(&out[0])[0];
                assert_eq!(values(&out[1]), values(&lse), "{what}: the log-sum-exp passes through");
                let back = Op::CrossEntropyBackward {
                    ignore_index: ignore,
                    sum,
                    classes: classes.clone(),
                };
                let g = run(&back, &[&part(k), &targets, &lse, &dloss], &at(k)).remove(0);
                let want = values(&whole_grad.narrow(1, k * n, n).unwrap());
                for (a, b) in values(&g).iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-6, "{what}: shard {k} gradient {a} vs {b}");
                }
            }
            let want = values(&whole[0])[0];
            assert!((loss - want).abs() <= 1e-5 * want.abs(), "{what}: loss {loss} vs {want}");
        }
    }
    // A target past the whole vocabulary is named against it, not against the shard's.
    let bad = ids_from(vec![v as i64; rows], &[rows]);
    let op = Op::CrossEntropy { ignore_index: None, sum: false, classes };
    let metas: Vec<TensorMeta> =
        [&part(0), &bad, &lse].iter().map(|t| meta_of(t).unwrap()).collect();
    let refs: Vec<&TensorMeta> = metas.iter().collect();
    let out = op.infer(&refs).unwrap();
    let e = kernels::execute_at(&op, &[&part(0), &bad, &lse], &out, &at(0)).unwrap_err();
    assert!(e.to_string().contains(&format!("out of range for {v} classes")), "{e}");
}

#[test]
fn embedding_forward_and_backward() {
    let mut r = rng(15);
    let cases: &[(usize, usize, &[usize])] =
        &[(50, 16, &[7]), (50, 16, &[3, 5]), (11, 33, &[2, 3, 4]), (1000, 128, &[4, 256])];
    for &(v, d, idims) in cases {
        let table = randn(&mut r, &[v, d]);
        let i = ids(&mut r, idims, v as i64);
        let what = format!("embedding [{v}, {d}] ids {idims:?}");
        check_layouts(&Op::Embedding { rows: None }, &[table, i.clone()], &what);
        let mut dyd = idims.to_vec();
        dyd.push(d);
        let dy = randn(&mut r, &dyd);
        check_layouts(&Op::EmbeddingBackward { num_embeddings: v, rows: None }, &[i, dy], &what);
    }
    // Heavily repeated ids (a few tokens dominate, as in text).
    let i = ids(&mut r, &[64, 40], 3);
    let dy = randn(&mut r, &[64, 40, 768]);
    check_kernel(
        &Op::EmbeddingBackward { num_embeddings: 5, rows: None },
        &[i, dy],
        "repeated ids",
    );
}

#[test]
fn cross_entropy_forward_and_backward() {
    let mut r = rng(16);
    let cases: &[(&[usize], usize)] = &[(&[7], 11), (&[2, 3], 33), (&[2, 2, 3], 5), (&[64], 2000)];
    for &(tdims, v) in cases {
        let mut ldims = tdims.to_vec();
        ldims.push(v);
        for ignore in [None, Some(-100i64)] {
            let logits = (randn(&mut r, &ldims) * 3.0).unwrap();
            let n: usize = tdims.iter().product();
            let t: Vec<i64> = (0..n)
                .map(|k| {
                    if ignore.is_some() && k % 3 == 1 {
                        -100
                    } else {
                        r.random_range(0..v as i64)
                    }
                })
                .collect();
            let targets = ids_from(t, tdims);
            for sum in [false, true] {
                let what = format!("cross_entropy {ldims:?} ignore={ignore:?} sum={sum}");
                let out = check_layouts(
                    &Op::CrossEntropy { ignore_index: ignore, sum, classes: None },
                    &[logits.clone(), targets.clone()],
                    &what,
                );
                let dloss = Tensor::new(1.7f32, &Device::Cpu).unwrap();
                let op = Op::CrossEntropyBackward { ignore_index: ignore, sum, classes: None };
                let inputs = [logits.clone(), targets.clone(), out[1].clone(), dloss];
                check_layouts(&op, &inputs, &what);
            }
        }
    }
    // Every row ignored: the loss and its gradient are 0.
    let logits = randn(&mut r, &[4, 6]);
    let targets = ids_from(vec![-1; 4], &[4]);
    let out = check_kernel(
        &Op::CrossEntropy { ignore_index: Some(-1), sum: false, classes: None },
        &[logits.clone(), targets.clone()],
        "all ignored",
    );
    assert_eq!(out[0].to_scalar::<f32>().unwrap(), 0.0);
    let dloss = Tensor::new(1f32, &Device::Cpu).unwrap();
    let op = Op::CrossEntropyBackward { ignore_index: Some(-1), sum: false, classes: None };
    let g = check_kernel(&op, &[logits, targets, out[1].clone(), dloss], "all ignored backward");
    assert!(to_f64_vec(&g[0]).unwrap().iter().all(|&v| v == 0.0));
}

// ---- bad inputs -----------------------------------------------------------------------------

fn run_err(op: &Op, inputs: &[&Tensor]) -> RuntimeError {
    let metas: Vec<TensorMeta> = inputs.iter().map(|t| meta_of(t).unwrap()).collect();
    let meta_refs: Vec<&TensorMeta> = metas.iter().collect();
    let out = op.infer(&meta_refs).unwrap();
    match kernels::execute(op, inputs, &out) {
        Ok(_) => panic!("{} accepted bad input", op.name()),
        Err(e) => e,
    }
}

#[test]
fn out_of_range_ids_and_targets_are_clear_errors() {
    let mut r = rng(17);
    let table = randn(&mut r, &[10, 4]);
    for bad in [10i64, -1, 1 << 40] {
        let i = ids_from(vec![1, 2, bad, 3], &[2, 2]);
        let e = run_err(&Op::Embedding { rows: None }, &[&table, &i]);
        let msg = e.to_string();
        assert!(matches!(e, RuntimeError::Data(_)), "{msg}");
        assert!(msg.contains(&format!("id {bad}")) && msg.contains("vocabulary of 10"), "{msg}");
        let dy = randn(&mut r, &[2, 2, 4]);
        let e = run_err(&Op::EmbeddingBackward { num_embeddings: 10, rows: None }, &[&i, &dy]);
        assert!(
            matches!(e, RuntimeError::Data(_)) && e.to_string().contains(&format!("id {bad}")),
            "{e}"
        );
    }
    let logits = randn(&mut r, &[3, 5]);
    for (bad, ignore) in [(5i64, None), (-100, None), (-1, Some(-100)), (7, Some(-100))] {
        let t = ids_from(vec![0, bad, 4], &[3]);
        let e = run_err(
            &Op::CrossEntropy { ignore_index: ignore, sum: false, classes: None },
            &[&logits, &t],
        );
        let msg = e.to_string();
        assert!(matches!(e, RuntimeError::Data(_)), "{msg}");
        assert!(msg.contains(&format!("target {bad}")) && msg.contains("5 classes"), "{msg}");
        let lse = randn(&mut r, &[3]);
        let dloss = Tensor::new(1f32, &Device::Cpu).unwrap();
        let e = run_err(
            &Op::CrossEntropyBackward { ignore_index: ignore, sum: false, classes: None },
            &[&logits, &t, &lse, &dloss],
        );
        assert!(
            matches!(e, RuntimeError::Data(_)) && e.to_string().contains(&format!("target {bad}")),
            "{e}"
        );
    }
}

#[test]
fn non_f32_floats_are_unsupported_not_wrong() {
    let x = Tensor::new(&[1.0f64, 2.0], &Device::Cpu).unwrap();
    let e = run_err(&Op::Unary(UnaryOp::Exp), &[&x]);
    assert!(matches!(e, RuntimeError::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("f32 only"), "{e}");
    let e = run_err(&Op::Softmax, &[&x]);
    assert!(e.to_string().contains("F64") && e.to_string().contains("f32 only"), "{e}");
}
