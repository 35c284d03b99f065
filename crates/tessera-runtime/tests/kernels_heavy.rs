//! The heavy kernels (matmul, fused attention, rope, AdamW) against the f64 reference
//! interpreter.
//!
//! Criterion: for every output, the norm-wise relative error ‖got − want‖₂ / max(‖want‖₂, 1e-30)
//! must be at most 1e-5, where `want` is `interp::eval_op` on the very same (f32) input values
//! in f64. Infinite reference elements (attention's log-sum-exp of a fully masked query) must
//! be matched exactly and are left out of the norms.
//!
//! Inputs include non-contiguous views (`.t()`, `narrow`, `transpose`) and broadcast views
//! (`broadcast_as`, stride 0), which the matmul reads in place.

use candle_core::{DType, Device, Storage, Tensor};
use half::bf16;
use std::sync::{Mutex, MutexGuard};
use tessera_ir::interp::{eval_op, Value};
use tessera_ir::{AdamWSpec, AttentionSpec, Op, TensorMeta};
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
}

fn value_of(t: &Tensor) -> Value {
    Value::new(t.dims().to_vec(), to_f64_vec(t).unwrap())
}

/// ‖got − want‖ / max(‖want‖, tiny), with infinities required to match exactly.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    rel_err_floor(got, want, 1e-30)
}

/// ‖got − want‖ / max(‖want‖, floor).
fn rel_err_floor(got: &[f64], want: &[f64], floor: f64) -> f64 {
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
    num.sqrt() / den.sqrt().max(floor)
}

/// Runs `op` through the runtime's dispatch and through the interpreter on the same values;
/// each output must agree within `tols[i]` (norm-wise relative). Returns the runtime outputs.
fn check_kernel_tol(op: &Op, inputs: &[&Tensor], tols: &[f64]) -> Vec<Tensor> {
    check_kernel_floor(op, inputs, tols, 1e-30)
}

/// As [`check_kernel_tol`], with the reference norm floored at `floor` (for outputs that are
/// exactly zero in exact arithmetic and rounding noise in f32).
fn check_kernel_floor(op: &Op, inputs: &[&Tensor], tols: &[f64], floor: f64) -> Vec<Tensor> {
    // Values first: AdamW updates its inputs in place.
    let values: Vec<Value> = inputs.iter().map(|t| value_of(t)).collect();
    let metas: Vec<TensorMeta> = inputs.iter().map(|t| meta_of(t).unwrap()).collect();
    let out_metas = op.infer(&metas.iter().collect::<Vec<_>>()).unwrap();
    let want = eval_op(op, &values.iter().collect::<Vec<_>>()).unwrap();
    let got = execute(op, inputs, &out_metas).unwrap();
    assert_eq!(got.len(), want.len(), "{op:?}: output count");
    for (i, ((g, w), m)) in got.iter().zip(&want).zip(&out_metas).enumerate() {
        assert_eq!(&meta_of(g).unwrap(), m, "{op:?}: output {i} meta");
        let err = rel_err_floor(&to_f64_vec(g).unwrap(), &w.data, floor);
        assert!(err <= tols[i], "{op:?}: output {i} relative error {err:e} > {:e}", tols[i]);
    }
    got
}

fn check_kernel(op: &Op, inputs: &[&Tensor]) -> Vec<Tensor> {
    check_kernel_tol(op, inputs, &[TOL; 4])
}

fn mm(ta: bool, tb: bool) -> Op {
    Op::MatMul { trans_a: ta, trans_b: tb }
}

/// Stored dims of an `[.., m, k]` operand read with `trans`.
fn stored(batch: &[usize], r: usize, c: usize, trans: bool) -> Vec<usize> {
    let mut d = batch.to_vec();
    d.extend(if trans { [c, r] } else { [r, c] });
    d
}

// ---- matmul ----------------------------------------------------------------------------------

#[test]
fn matmul_transpose_combos_odd_sizes() {
    let _s = serial();
    let mut rng = Rng::new(1);
    for (m, k, n) in [(7, 33, 65), (65, 7, 33), (33, 65, 7), (1, 5, 3)] {
        for ta in [false, true] {
            for tb in [false, true] {
                for batch in [&[][..], &[2][..], &[2, 3][..]] {
                    let a = rng.tensor(&stored(batch, m, k, ta));
                    let b = rng.tensor(&stored(batch, k, n, tb));
                    check_kernel(&mm(ta, tb), &[&a, &b]);
                }
            }
        }
    }
}

#[test]
fn matmul_broadcast_batches() {
    let _s = serial();
    let mut rng = Rng::new(2);
    // [B,S,K] x [K,N] and x [N,K]ᵀ: one folded gemm.
    for tb in [false, true] {
        let a = rng.tensor(&[3, 13, 33]);
        let b = rng.tensor(&stored(&[], 33, 65, tb));
        check_kernel(&mm(false, tb), &[&a, &b]);
    }
    // [B,K,S]ᵀ x [K,N]: rows do not fold, one gemm per batch.
    let a = rng.tensor(&[3, 33, 13]);
    let b = rng.tensor(&[33, 7]);
    check_kernel(&mm(true, false), &[&a, &b]);
    // A 2-D left operand with a batched right one.
    for ta in [false, true] {
        let a = rng.tensor(&stored(&[], 7, 33, ta));
        let b = rng.tensor(&[4, 33, 9]);
        check_kernel(&mm(ta, false), &[&a, &b]);
    }
    // [B,1,m,k] x [1,H,k,n] → [B,H,m,n].
    let a = rng.tensor(&[2, 1, 7, 33]);
    let b = rng.tensor(&[1, 3, 33, 9]);
    check_kernel(&mm(false, false), &[&a, &b]);
    // Fewer batch dims on the left, with size-1 dims: [H,m,k] x [B,1,k,n]ᵀ.
    let a = rng.tensor(&[3, 7, 33]);
    let b = rng.tensor(&[2, 1, 9, 33]);
    check_kernel(&mm(false, true), &[&a, &b]);
    // Weight gradient of a flattened linear layer: [N,D]ᵀ x [N,K].
    let x = rng.tensor(&[39, 33]);
    let dy = rng.tensor(&[39, 65]);
    check_kernel(&mm(true, false), &[&x, &dy]);
}

#[test]
fn matmul_non_contiguous_and_broadcast_views() {
    let _s = serial();
    let mut rng = Rng::new(3);
    let (m, k, n) = (33, 65, 7);
    // A made as its transpose, then `.t()`: strides (1, m).
    let at = rng.tensor(&[k, m]).t().unwrap();
    assert!(!at.is_contiguous());
    let b = rng.tensor(&[k, n]);
    check_kernel(&mm(false, false), &[&at, &b]);
    // Non-contiguous views read transposed: [m,n] x ([k,n] view)ᵀ and ([m,k] view)ᵀ x ([n,m] view)ᵀ.
    let bt = rng.tensor(&[n, k]).t().unwrap(); // [k, n] view
    check_kernel(&mm(false, true), &[&rng.tensor(&[m, n]), &bt]);
    let bt2 = rng.tensor(&[m, n]).t().unwrap(); // [n, m] view
    check_kernel(&mm(true, true), &[&at, &bt2]);
    check_kernel(&mm(true, false), &[&at, &rng.tensor(&[m, n])]);
    // Narrowed views: column window (rows still fold) and row window (they do not).
    let wide = rng.tensor(&[3, 13, k + 5]).narrow(2, 2, k).unwrap();
    assert!(!wide.is_contiguous());
    check_kernel(&mm(false, false), &[&wide, &b]);
    let tall = rng.tensor(&[3, 13 + 4, k]).narrow(1, 3, 13).unwrap();
    check_kernel(&mm(false, false), &[&tall, &b]);
    check_kernel(&mm(false, true), &[&tall, &rng.tensor(&[n, k])]);
    // Batched transposed views.
    let bat = rng.tensor(&[2, k, m]).transpose(1, 2).unwrap(); // [2, m, k] view
    check_kernel(&mm(false, false), &[&bat, &rng.tensor(&[2, k, n])]);
    check_kernel(&mm(true, false), &[&bat.transpose(1, 2).unwrap(), &rng.tensor(&[2, k, n])]);
    // Broadcast views (stride 0): a weight expanded over the batch, and an expanded left side.
    let wb = rng.tensor(&[k, n]).broadcast_as((4, k, n)).unwrap();
    check_kernel(&mm(false, false), &[&rng.tensor(&[4, m, k]), &wb]);
    let ab = rng.tensor(&[1, m, k]).broadcast_as((4, m, k)).unwrap();
    check_kernel(&mm(false, false), &[&ab, &rng.tensor(&[4, k, n])]);
    check_kernel(&mm(false, true), &[&ab, &rng.tensor(&[4, n, k])]);
    // A row-broadcast left operand (every row the same, row stride 0).
    let rows = rng.tensor(&[1, k]).broadcast_as((m, k)).unwrap();
    check_kernel(&mm(false, false), &[&rows, &b]);
}

#[test]
fn matmul_large() {
    let _s = serial();
    let mut rng = Rng::new(4);
    let a = rng.tensor(&[2, 256, 300]);
    let b = rng.tensor(&[260, 300]);
    check_kernel(&mm(false, true), &[&a, &b]);
    let a = rng.tensor(&[257, 256]);
    let b = rng.tensor(&[256, 255]).t().unwrap().contiguous().unwrap().t().unwrap();
    check_kernel(&mm(false, false), &[&a, &b]);
    let a = rng.tensor(&[256, 300]).t().unwrap(); // [300, 256] view
    check_kernel(&mm(true, false), &[&a, &rng.tensor(&[300, 260])]);
    // Several large batch elements (one multithreaded gemm each).
    let a = rng.tensor(&[2, 1, 128, 160]);
    let b = rng.tensor(&[1, 2, 160, 150]);
    check_kernel(&mm(false, false), &[&a, &b]);
}

#[test]
fn matmul_edge_shapes_and_dtypes() {
    let _s = serial();
    let mut rng = Rng::new(5);
    // k = 0: zeros.
    let a = rng.tensor(&[2, 3, 0]);
    let b = rng.tensor(&[0, 4]);
    let y = check_kernel(&mm(false, false), &[&a, &b]);
    assert!(to_f64_vec(&y[0]).unwrap().iter().all(|&v| v == 0.0));
    // Non-f32 operands are a clear Unsupported error.
    let a = rng.tensor(&[3, 4]).to_dtype(DType::F64).unwrap();
    let meta = op_meta(&mm(false, true), &[&a, &a]);
    match execute(&mm(false, true), &[&a, &a], &meta) {
        Err(RuntimeError::Unsupported { op, .. }) => assert_eq!(op, "matmul"),
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

fn op_meta(op: &Op, inputs: &[&Tensor]) -> Vec<TensorMeta> {
    let metas: Vec<TensorMeta> = inputs.iter().map(|t| meta_of(t).unwrap()).collect();
    op.infer(&metas.iter().collect::<Vec<_>>()).unwrap()
}

// ---- attention and rope ----------------------------------------------------------------------

/// Forward and backward of one attention configuration.
#[allow(clippy::too_many_arguments)]
fn check_attention(
    seed: u64,
    b: usize,
    s: usize,
    t: usize,
    h: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    window: Option<usize>,
) {
    let mut rng = Rng::new(seed);
    let spec = AttentionSpec { causal, window, ..AttentionSpec::causal(d) };
    // Larger logits than uniform [-1, 1) so the softmax is far from flat.
    let q = (rng.tensor(&[b, s, h, d]) * 2.0).unwrap();
    let k = (rng.tensor(&[b, t, hkv, d]) * 2.0).unwrap();
    let v = rng.tensor(&[b, t, hkv, d]);
    let fwd = check_kernel(&Op::Attention(spec.clone()), &[&q, &k, &v]);
    let dout = rng.tensor(&[b, s, h, d]);
    // With a window of 1 every probability is 1 and dq, dk are exactly 0 (dS = dP − D = 0):
    // measure their f32 rounding noise against the gradient scale ‖dout‖ instead.
    let floor = if window == Some(1) {
        dout.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt() as f64
    } else {
        1e-30
    };
    let inputs = [&q, &k, &v, &fwd[0], &fwd[1], &dout];
    check_kernel_floor(&Op::AttentionBackward(spec), &inputs, &[TOL; 3], floor);
}

#[test]
fn attention_causal_and_full() {
    let _s = serial();
    for causal in [true, false] {
        check_attention(10, 2, 13, 13, 4, 2, 8, causal, None);
        check_attention(11, 1, 16, 16, 2, 2, 16, causal, None);
        // Several query blocks (64 rows each), odd length.
        check_attention(12, 1, 150, 150, 2, 1, 16, causal, None);
    }
}

/// Past the cap on live score rows (scaled down to 128 so that S = 3·cap stays small): on a
/// pool of more threads than the cap has blocks, the forward and backward keep their scratch
/// within what `min(S, cap) × T × 4` declares (counted by the global allocator), give the
/// uncapped kernels' bits, and match the f64 interpreter.
#[test]
fn attention_past_the_scratch_cap_keeps_its_declared_workspace() {
    use tessera_ir::dist::MeshPos;
    use tessera_runtime::alloc::{current_bytes, peak_bytes, reset_peak};
    use tessera_runtime::kernels::{attention_backward_within, attention_within};
    let _s = serial();
    // Two lanes of one 64-row block forward, one lane of two 64-row buffers backward (the
    // blocks of the uncapped kernels, so the bits can be compared): on two cores or more,
    // two backward tasks alive at once would break the bound. T > S (the queries are the
    // last S of T) so a block's scratch (256 KiB) is well above the allocator's batching.
    let (cap, b, t, h, hkv, d) = (128usize, 2usize, 1024usize, 4usize, 2usize, 8usize);
    let s = 3 * cap;
    let mut rng = Rng::new(13);
    let spec = AttentionSpec::causal(d);
    let q = (rng.tensor(&[b, s, h, d]) * 2.0).unwrap();
    let k = (rng.tensor(&[b, t, hkv, d]) * 2.0).unwrap();
    let v = rng.tensor(&[b, t, hkv, d]);
    let dout = rng.tensor(&[b, s, h, d]);
    let at = MeshPos::single();
    // The declared bytes at this cap: the IR's formula with `cap` for ATTENTION_SCRATCH_ROWS.
    let declared = (s.min(cap) * t * 4) as u64;
    let outputs_fwd = ((b * s * h * d + b * h * s) * 4) as u64;
    let outputs_bwd = ((b * s * h * d + 2 * b * t * hkv * d) * 4) as u64;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(8).build().unwrap();
    // gemm keeps a thread-local packing slab (the L2's size), made on a thread's first
    // product: make every thread's before measuring.
    let (a, w) = (rng.tensor(&[64, 64]), rng.tensor(&[64, 64]));
    let mm_meta = op_meta(&mm(false, false), &[&a, &w]);
    pool.broadcast(|_| execute(&mm(false, false), &[&a, &w], &mm_meta).unwrap());
    // Within 8 KiB of small bookkeeping (rayon jobs, tensor headers), plus gemm's own packing
    // per lane: the forward held 248 KiB more once gemm's AVX-512 kernels (`x86-v4`) were
    // switched on, which we attribute to their packing buffers (bounded by gemm's blocking,
    // not by the tensors); 128 KiB per lane allowed.
    let slack = (8 << 10) + 2 * (128 << 10);
    let measured = |f: &(dyn Fn() -> Vec<Tensor> + Sync)| -> (Vec<Tensor>, u64) {
        pool.install(f);
        let before = current_bytes();
        reset_peak();
        let got = pool.install(f);
        (got, peak_bytes() - before)
    };
    let (fwd, extra) = measured(&|| attention_within(&q, &k, &v, None, &spec, &at, cap).unwrap());
    assert!(
        extra <= declared + outputs_fwd + slack,
        "forward held {extra} bytes: declared {declared} + outputs {outputs_fwd}"
    );
    let (bwd, extra) = measured(&|| {
        attention_backward_within(&[&q, &k, &v, &fwd[0], &fwd[1], &dout], &spec, &at, cap).unwrap()
    });
    assert!(
        extra <= declared + outputs_bwd + slack,
        "backward held {extra} bytes: declared {declared} + outputs {outputs_bwd}"
    );
    // The declared workspace is the IR's: min(S, cap) rows; S ≤ the real cap, so the whole block.
    let metas: Vec<TensorMeta> = [&q, &k, &v].iter().map(|t| meta_of(t).unwrap()).collect();
    let refs: Vec<&TensorMeta> = metas.iter().collect();
    assert_eq!(Op::Attention(spec.clone()).workspace_bytes(&refs), (s * t * 4) as u64);
    // The same bits as the kernels at the real cap, and the interpreter's values.
    let whole_fwd = check_kernel(&Op::Attention(spec.clone()), &[&q, &k, &v]);
    let inputs = [&q, &k, &v, &fwd[0], &fwd[1], &dout];
    let whole_bwd = check_kernel(&Op::AttentionBackward(spec), &inputs);
    for (got, want) in fwd.iter().chain(&bwd).zip(whole_fwd.iter().chain(&whole_bwd)) {
        let (got, want) = (to_f64_vec(got).unwrap(), to_f64_vec(want).unwrap());
        assert!(got == want, "the capped kernels' bits differ from the uncapped ones'");
    }
}

#[test]
fn attention_sliding_window() {
    let _s = serial();
    for causal in [true, false] {
        check_attention(20, 2, 13, 13, 4, 2, 8, causal, Some(4));
        check_attention(21, 1, 150, 150, 2, 2, 8, causal, Some(40));
    }
    // A window of 1: each query sees only itself.
    check_attention(22, 1, 9, 9, 2, 1, 4, true, Some(1));
}

#[test]
fn attention_gqa() {
    let _s = serial();
    check_attention(30, 2, 13, 13, 4, 2, 8, true, None);
    check_attention(31, 2, 13, 13, 8, 1, 8, true, None);
    check_attention(32, 1, 33, 33, 8, 1, 16, false, Some(7));
    check_attention(33, 3, 7, 7, 8, 4, 4, false, None);
}

#[test]
fn attention_unequal_lengths() {
    let _s = serial();
    // Queries are the last S of T positions.
    check_attention(40, 2, 5, 13, 4, 2, 8, true, None);
    check_attention(41, 1, 5, 13, 2, 1, 8, true, Some(3));
    // T < S with causal: the first queries see no key (zero output, lse −∞, zero gradient).
    check_attention(42, 2, 13, 5, 4, 2, 8, true, None);
    check_attention(43, 1, 13, 20, 2, 2, 8, false, None);
}

#[test]
fn attention_fully_masked_rows() {
    let _s = serial();
    let mut rng = Rng::new(50);
    let spec = AttentionSpec { scale: 0.5, ..AttentionSpec::causal(1) };
    let q = rng.tensor(&[1, 6, 2, 4]);
    let k = rng.tensor(&[1, 3, 1, 4]);
    let v = rng.tensor(&[1, 3, 1, 4]);
    let fwd = check_kernel(&Op::Attention(spec), &[&q, &k, &v]);
    let lse = to_f64_vec(&fwd[1]).unwrap();
    // Query i sits at position i − 3: queries 0..3 see nothing.
    for h in 0..2 {
        for i in 0..6 {
            assert_eq!(
                lse[h * 6 + i] == f64::NEG_INFINITY,
                i < 3,
                "lse[{h},{i}] = {}",
                lse[h * 6 + i]
            );
        }
    }
}

#[test]
fn rope_forward_and_inverse() {
    let _s = serial();
    let mut rng = Rng::new(60);
    let (b, s, h, d) = (2, 13, 3, 16);
    let inv_freq: Vec<f64> =
        (0..d / 2).map(|i| 10000f64.powf(-2.0 * i as f64 / d as f64)).collect();
    let x = rng.tensor(&[b, s, h, d]);
    let y = check_kernel(&Op::Rope { inv_freq: inv_freq.clone(), inverse: false }, &[&x]);
    let back = check_kernel(&Op::Rope { inv_freq, inverse: true }, &[&y[0]]);
    let err = rel_err(&to_f64_vec(&back[0]).unwrap(), &to_f64_vec(&x).unwrap());
    assert!(err < 1e-6, "inverse rope does not undo rope: {err:e}");
    // Long sequences: large angles stay accurate (computed in f64).
    let x = rng.tensor(&[1, 300, 2, 8]);
    let inv_freq: Vec<f64> = (0..4).map(|i| 10000f64.powf(-2.0 * i as f64 / 8.0)).collect();
    check_kernel(&Op::Rope { inv_freq, inverse: true }, &[&x]);
}

// ---- inference: caches, positions, ALiBi -----------------------------------------------------

fn ids(v: Vec<i64>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

#[test]
fn attention_over_a_cache_with_per_row_starts() {
    let _s = serial();
    let mut rng = Rng::new(70);
    // Rows at different positions of an 11-slot cache, 3 new queries each, GQA and a window.
    let (b, s, t, h, hkv, d) = (3, 3, 11, 4, 2, 8);
    for window in [None, Some(4)] {
        let spec = AttentionSpec { window, ..AttentionSpec::causal(d) };
        let q = (rng.tensor(&[b, s, h, d]) * 2.0).unwrap();
        let k = (rng.tensor(&[b, t, hkv, d]) * 2.0).unwrap();
        let v = rng.tensor(&[b, t, hkv, d]);
        let start = ids(vec![0, 5, 8], &[b]);
        check_kernel(&Op::Attention(spec), &[&q, &k, &v, &start]);
    }
}

#[test]
fn alibi_attention_forward_and_backward() {
    let _s = serial();
    let mut rng = Rng::new(71);
    // 6 heads: the slopes of a non-power-of-two count.
    let (b, s, h, d) = (2, 70, 6, 8);
    let spec = AttentionSpec {
        alibi: Some(tessera_ir::Alibi { heads: h, shard: None }),
        ..AttentionSpec::causal(d)
    };
    let q = (rng.tensor(&[b, s, h, d]) * 2.0).unwrap();
    let k = (rng.tensor(&[b, s, h, d]) * 2.0).unwrap();
    let v = rng.tensor(&[b, s, h, d]);
    let fwd = check_kernel(&Op::Attention(spec.clone()), &[&q, &k, &v]);
    let dout = rng.tensor(&[b, s, h, d]);
    let inputs = [&q, &k, &v, &fwd[0], &fwd[1], &dout];
    check_kernel_floor(&Op::AttentionBackward(spec.clone()), &inputs, &[TOL; 3], 1e-30);
    // Over a cache.
    let start = ids(vec![10, 0], &[b]);
    let q1 = rng.tensor(&[b, 1, h, d]);
    check_kernel(&Op::Attention(spec), &[&q1, &k, &v, &start]);
}

/// Tensor parallelism past the KV heads: 8 query heads over 8 devices against 2 KV heads that
/// every device holds whole (`AttentionSpec::kv_whole`). Each device's output and dq are its
/// heads of the single-device attention's, and the devices' dk and dv (each non-zero on the
/// KV head its query heads read) sum to the whole dk and dv; the f64 reference interpreter
/// agrees at the mesh origin.
#[test]
fn attention_past_the_kv_heads_is_the_slice_of_the_whole() {
    use tessera_ir::dist::{MeshPos, ShardOf};
    use tessera_runtime::kernels::execute_at;
    let _s = serial();
    let mut rng = Rng::new(73);
    let (b, s, h, hkv, d, n) = (2, 9, 8, 2, 4, 8);
    let whole_spec = AttentionSpec::causal(d);
    let q = rng.tensor(&[b, s, h, d]);
    let k = rng.tensor(&[b, s, hkv, d]);
    let v = rng.tensor(&[b, s, hkv, d]);
    let dout = rng.tensor(&[b, s, h, d]);
    let fwd = check_kernel(&Op::Attention(whole_spec.clone()), &[&q, &k, &v]);
    let bwd = execute(
        &Op::AttentionBackward(whole_spec.clone()),
        &[&q, &k, &v, &fwd[0], &fwd[1], &dout],
        &op_meta(
            &Op::AttentionBackward(whole_spec.clone()),
            &[&q, &k, &v, &fwd[0], &fwd[1], &dout],
        ),
    )
    .unwrap();
    let placement = vec![vec![], vec![], vec![1], vec![]];
    let spec = AttentionSpec {
        kv_whole: Some(ShardOf { global: vec![b, s, h, d], placement, micro_batch: 0 }),
        ..whole_spec
    };
    let local = h / n;
    let heads = |t: &Tensor, dim: usize, r: usize| {
        t.narrow(dim, r * local, local).unwrap().contiguous().unwrap()
    };
    let (mut dk, mut dv) = (k.zeros_like().unwrap(), v.zeros_like().unwrap());
    for r in 0..n {
        let at = MeshPos::new(&[1, n], r).unwrap();
        let ql = heads(&q, 2, r);
        let x = [&ql, &k, &v];
        let out = execute_at(
            &Op::Attention(spec.clone()),
            &x,
            &op_meta(&Op::Attention(spec.clone()), &x),
            &at,
        )
        .unwrap();
        assert!(
            rel_err(&to_f64_vec(&out[0]).unwrap(), &to_f64_vec(&heads(&fwd[0], 2, r)).unwrap())
                < 1e-6,
            "rank {r}: out"
        );
        assert!(
            rel_err(&to_f64_vec(&out[1]).unwrap(), &to_f64_vec(&heads(&fwd[1], 1, r)).unwrap())
                < 1e-6,
            "rank {r}: lse"
        );
        let dol = heads(&dout, 2, r);
        let x = [&ql, &k, &v, &out[0], &out[1], &dol];
        let op = Op::AttentionBackward(spec.clone());
        let g = execute_at(&op, &x, &op_meta(&op, &x), &at).unwrap();
        assert!(
            rel_err(&to_f64_vec(&g[0]).unwrap(), &to_f64_vec(&heads(&bwd[0], 2, r)).unwrap())
                < 1e-5,
            "rank {r}: dq"
        );
        dk = (dk + &g[1]).unwrap();
        dv = (dv + &g[2]).unwrap();
        if r == 0 {
            // The reference interpreter places its heads at the origin.
            let want = eval_op(
                &Op::Attention(spec.clone()),
                &[&value_of(&ql), &value_of(&k), &value_of(&v)],
            )
            .unwrap();
            assert!(rel_err(&to_f64_vec(&out[0]).unwrap(), &want[0].data) < 1e-5, "interpreter");
        }
    }
    assert!(rel_err(&to_f64_vec(&dk).unwrap(), &to_f64_vec(&bwd[1]).unwrap()) < 1e-5, "dk");
    assert!(rel_err(&to_f64_vec(&dv).unwrap(), &to_f64_vec(&bwd[2]).unwrap()) < 1e-5, "dv");
    // Heads that do not group onto the KV heads are refused by name.
    let bad = AttentionSpec {
        kv_whole: Some(ShardOf {
            global: vec![b, s, 7, d],
            placement: vec![vec![]; 4],
            micro_batch: 0,
        }),
        ..AttentionSpec::causal(d)
    };
    let x = [&q, &k, &v];
    let metas: Vec<TensorMeta> = x.iter().map(|t| meta_of(t).unwrap()).collect();
    let refs: Vec<&TensorMeta> = metas.iter().collect();
    let err = Op::Attention(bad).infer(&refs).unwrap_err();
    assert!(err.to_string().contains("do not group onto key/value heads 2"), "{err}");
}

#[test]
fn rope_at_positions_cache_write_and_select() {
    let _s = serial();
    let mut rng = Rng::new(72);
    let (b, s, h, d) = (2, 3, 2, 8);
    let inv_freq: Vec<f64> =
        (0..d / 2).map(|i| 10000f64.powf(-2.0 * i as f64 / d as f64)).collect();
    let x = rng.tensor(&[b, s, h, d]);
    let pos = ids(vec![4, 5, 6, 0, 1, 2], &[b, s]);
    check_kernel(&Op::Rope { inv_freq, inverse: false }, &[&x, &pos]);
    // The cache write, in place: the returned tensor is the cache, rows written at the starts.
    let cache = rng.tensor(&[b, 7, h, d]);
    let start = ids(vec![2, 4], &[b]);
    let want =
        eval_op(&Op::CacheWrite, &[&value_of(&cache), &value_of(&x), &value_of(&start)]).unwrap();
    let got = execute(
        &Op::CacheWrite,
        &[&cache, &x, &start],
        &op_meta(&Op::CacheWrite, &[&cache, &x, &start]),
    )
    .unwrap();
    assert_eq!(to_f64_vec(&got[0]).unwrap(), want[0].data);
    assert_eq!(to_f64_vec(&cache).unwrap(), want[0].data, "written in place");
    // Past the cache's end: refused, naming the capacity.
    let late = ids(vec![5, 0], &[b]);
    let err = execute(
        &Op::CacheWrite,
        &[&cache, &x, &late],
        &op_meta(&Op::CacheWrite, &[&cache, &x, &late]),
    )
    .unwrap_err();
    assert!(err.to_string().contains("beyond the cache's 7"), "{err}");
    let last = ids(vec![2, 0], &[b]);
    check_kernel(&Op::SelectPositions, &[&x, &last]);
}

// ---- AdamW -----------------------------------------------------------------------------------

fn spec(clip: Option<f64>) -> AdamWSpec {
    AdamWSpec {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        max_grad_norm: clip,
        grad_scale: false,
    }
}

/// With the loss-scaling `grad_scale` input (last).
fn scaled_spec(clip: Option<f64>) -> AdamWSpec {
    AdamWSpec { grad_scale: true, ..spec(clip) }
}

fn scalar_f32(x: f32) -> Tensor {
    Tensor::new(x, &Device::Cpu).unwrap()
}

fn scalar_i64(x: i64) -> Tensor {
    Tensor::new(x, &Device::Cpu).unwrap()
}

/// Address of a tensor's storage.
fn storage_ptr(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(c) => match t.dtype() {
            DType::BF16 => c.as_slice::<bf16>().unwrap().as_ptr() as usize,
            DType::F16 => c.as_slice::<half::f16>().unwrap().as_ptr() as usize,
            _ => c.as_slice::<f32>().unwrap().as_ptr() as usize,
        },
        _ => unreachable!(),
    }
}

/// AdamW state for a `dims` parameter: (param, grad, m, v) with v ≥ 0.
fn adam_state(rng: &mut Rng, dims: &[usize]) -> (Tensor, Tensor, Tensor, Tensor) {
    let p = rng.tensor(dims);
    let g = (rng.tensor(dims) * 3.0).unwrap();
    let m = (rng.tensor(dims) * 0.1).unwrap();
    let v = (rng.tensor(dims).sqr().unwrap() * 0.01).unwrap();
    (p, g, m, v)
}

/// Checks values against the interpreter, that outputs alias inputs, and that the inputs
/// themselves now hold the updated values. The weight update `w' − w` (small next to `w`) is
/// also compared on its own, within 1e-4 norm-wise (f32 rounding of `w'` over the step size),
/// for every f32 weight output (the master, and the parameter when it is f32).
fn check_adamw(inputs: &[&Tensor], spec: AdamWSpec, tols: &[f64]) {
    let op = Op::AdamW(spec);
    let values: Vec<Value> = inputs.iter().map(|t| value_of(t)).collect();
    let want = eval_op(&op, &values.iter().collect::<Vec<_>>()).unwrap();
    let out = check_kernel_tol(&op, inputs, tols);
    let aliased = [0, 2, 3, 7];
    for (o, &i) in out.iter().zip(&aliased) {
        assert_eq!(storage_ptr(o), storage_ptr(inputs[i]), "output for input {i} is not in place");
        // The input handle itself sees the update.
        assert_eq!(to_f64_vec(o).unwrap(), to_f64_vec(inputs[i]).unwrap());
    }
    for (o, &i) in out.iter().zip(&aliased) {
        if (i == 0 || i == 7) && o.dtype() == DType::F32 {
            let got = to_f64_vec(o).unwrap();
            let before = &values[i].data;
            let dgot: Vec<f64> = got.iter().zip(before).map(|(a, b)| a - b).collect();
            let j = if i == 0 { 0 } else { 3 };
            let dwant: Vec<f64> = want[j].data.iter().zip(before).map(|(a, b)| a - b).collect();
            let err = rel_err(&dgot, &dwant);
            assert!(err < 1e-4, "weight update of input {i}: relative error {err:e}");
        }
    }
}

#[test]
fn adamw_f32_in_place() {
    let _s = serial();
    let mut rng = Rng::new(70);
    for (clip, norm) in [(None, 5.0), (Some(1.0), 5.0), (Some(10.0), 5.0)] {
        for step in [1, 3, 1000] {
            let (p, g, m, v) = adam_state(&mut rng, &[37, 65]);
            let before = to_f64_vec(&p).unwrap();
            let (lr, st, gn) = (scalar_f32(3e-3), scalar_i64(step), scalar_f32(norm));
            check_adamw(&[&p, &g, &m, &v, &lr, &st, &gn], spec(clip), &[TOL; 3]);
            assert_ne!(before, to_f64_vec(&p).unwrap(), "parameter not updated");
        }
    }
}

#[test]
fn adamw_f32_master_in_place() {
    let _s = serial();
    let mut rng = Rng::new(71);
    for clip in [None, Some(0.5)] {
        let (p, g, m, v) = adam_state(&mut rng, &[1000]);
        let master = p.copy().unwrap();
        let (lr, st, gn) = (scalar_f32(1e-2), scalar_i64(7), scalar_f32(2.0));
        check_adamw(&[&p, &g, &m, &v, &lr, &st, &gn, &master], spec(clip), &[TOL; 4]);
    }
}

#[test]
fn adamw_bf16_param_f32_master() {
    let _s = serial();
    let mut rng = Rng::new(72);
    for clip in [None, Some(1.0)] {
        let (p32, g32, m, v) = adam_state(&mut rng, &[129, 33]);
        let p = p32.to_dtype(DType::BF16).unwrap();
        let g = g32.to_dtype(DType::BF16).unwrap();
        // The master holds more precision than the bf16 weight.
        let master =
            (p.to_dtype(DType::F32).unwrap() + (rng.tensor(&[129, 33]) * 1e-3).unwrap()).unwrap();
        let (lr, st, gn) = (scalar_f32(1e-3), scalar_i64(2), scalar_f32(3.0));
        // param' is bf16(master'): within bf16 rounding (2⁻⁸ relative) of the f64 update.
        let inputs = [&p, &g, &m, &v, &lr, &st, &gn, &master];
        check_adamw(&inputs, spec(clip), &[2f64.powi(-8), TOL, TOL, TOL]);
        // And exactly the rounding of the updated master.
        let rounded = master.to_dtype(DType::BF16).unwrap();
        assert_eq!(to_f64_vec(&p).unwrap(), to_f64_vec(&rounded).unwrap());
    }
}

#[test]
fn adamw_f16_param_with_grad_scale() {
    let _s = serial();
    let mut rng = Rng::new(75);
    for clip in [None, Some(1.0)] {
        let (p32, g32, m, v) = adam_state(&mut rng, &[129, 33]);
        let p = p32.to_dtype(DType::F16).unwrap();
        // Scaled fp16 gradients (loss scale 2^10); the norm input is the scaled norm.
        let scale = 1024.0f32;
        let g = (g32 * f64::from(scale)).unwrap().to_dtype(DType::F16).unwrap();
        let master =
            (p.to_dtype(DType::F32).unwrap() + (rng.tensor(&[129, 33]) * 1e-3).unwrap()).unwrap();
        let (lr, st, gn, gs) =
            (scalar_f32(1e-3), scalar_i64(2), scalar_f32(3.0 * scale), scalar_f32(1.0 / scale));
        let inputs = [&p, &g, &m, &v, &lr, &st, &gn, &master, &gs];
        // param' is f16(master'): within f16 rounding (2⁻¹¹ relative) of the f64 update.
        check_adamw(&inputs, scaled_spec(clip), &[2f64.powi(-11), TOL, TOL, TOL]);
        let rounded = master.to_dtype(DType::F16).unwrap();
        assert_eq!(to_f64_vec(&p).unwrap(), to_f64_vec(&rounded).unwrap());
    }
    // Without a master copy (f32 parameter) the scale is the last input too.
    let (p, g, m, v) = adam_state(&mut rng, &[300]);
    let (lr, st, gn, gs) = (scalar_f32(1e-3), scalar_i64(5), scalar_f32(40.0), scalar_f32(0.125));
    check_adamw(&[&p, &g, &m, &v, &lr, &st, &gn, &gs], scaled_spec(Some(1.0)), &[TOL; 3]);
}

#[test]
fn adamw_skips_the_update_when_the_unscaled_norm_overflows() {
    let _s = serial();
    let mut rng = Rng::new(76);
    for (norm, scale) in [(f32::INFINITY, 2f32.powi(-16)), (f32::NAN, 2f32.powi(-16))] {
        let (p32, g32, m, v) = adam_state(&mut rng, &[1000]);
        let p = p32.to_dtype(DType::F16).unwrap();
        let g = g32.to_dtype(DType::F16).unwrap();
        let master = p.to_dtype(DType::F32).unwrap();
        let (lr, st, gn, gs) =
            (scalar_f32(1e-2), scalar_i64(3), scalar_f32(norm), scalar_f32(scale));
        let inputs = [&p, &g, &m, &v, &lr, &st, &gn, &master, &gs];
        let before: Vec<Vec<f64>> = inputs.iter().map(|t| to_f64_vec(t).unwrap()).collect();
        // The interpreter agrees (values, in-place aliasing) ...
        check_adamw(&inputs, scaled_spec(Some(1.0)), &[0.0; 4]);
        // ... and nothing was written.
        for (i, t) in inputs.iter().enumerate().filter(|(i, _)| *i != 6) {
            let after = to_f64_vec(t).unwrap();
            let same =
                after.iter().zip(&before[i]).all(|(a, b)| a == b || (a.is_nan() && b.is_nan()));
            assert!(same, "input {i} changed on a skipped step (norm {norm})");
        }
    }
    // Without grad_scale there is no skip rule (fp32 / bf16 graphs are unchanged): an
    // infinite norm still updates, as it always has.
    let (p, g, m, v) = adam_state(&mut rng, &[10]);
    let before = to_f64_vec(&p).unwrap();
    let (lr, st, gn) = (scalar_f32(1e-2), scalar_i64(3), scalar_f32(f32::INFINITY));
    check_adamw(&[&p, &g, &m, &v, &lr, &st, &gn], spec(Some(1.0)), &[TOL; 3]);
    assert_ne!(before, to_f64_vec(&p).unwrap());
}

#[test]
fn adamw_allocates_no_parameter_sized_buffer() {
    let _s = serial();
    let mut rng = Rng::new(73);
    let n = 1 << 20; // 4 MiB per f32 tensor
    let (p, g, m, v) = adam_state(&mut rng, &[n]);
    let master = p.copy().unwrap();
    let (lr, st, gn) = (scalar_f32(1e-3), scalar_i64(1), scalar_f32(1.0));
    let inputs = [&p, &g, &m, &v, &lr, &st, &gn, &master];
    let metas = op_meta(&Op::AdamW(spec(Some(1.0))), &inputs);
    let before = tessera_runtime::alloc::current_bytes();
    tessera_runtime::alloc::reset_peak();
    let out = execute(&Op::AdamW(spec(Some(1.0))), &inputs, &metas).unwrap();
    let extra = tessera_runtime::alloc::peak_bytes() - before;
    assert!(extra < (n as u64) / 4, "AdamW allocated {extra} bytes for a {n}-element parameter");
    assert_eq!(out.len(), 4);
}

#[test]
fn adamw_rejects_step_zero() {
    let _s = serial();
    let mut rng = Rng::new(74);
    let (p, g, m, v) = adam_state(&mut rng, &[4]);
    let (lr, st, gn) = (scalar_f32(1e-3), scalar_i64(0), scalar_f32(1.0));
    let inputs = [&p, &g, &m, &v, &lr, &st, &gn];
    let metas = op_meta(&Op::AdamW(spec(None)), &inputs);
    assert!(execute(&Op::AdamW(spec(None)), &inputs, &metas).is_err());
}

/// Ring attention on the CPU: on every device of a cp ring, the device's queries against each
/// device's key block (`AttentionSpec::ring`, positions from the mesh coordinate), merged by
/// log-sum-exp, equal the whole attention's rows; the backward through the merge and the
/// blocks (with the log-sum-exp's cotangent) gives the whole backward's dq rows, and dk/dv
/// summed over the devices give the whole dk/dv. At the origin every kernel also matches
/// the interpreter.
#[test]
fn ring_attention_blocks_merged_are_the_whole_on_every_device() {
    use tessera_ir::dist::MeshPos;
    use tessera_ir::RingBlock;
    use tessera_runtime::kernels::execute_at;
    let _s = serial();
    let mut rng = Rng::new(91);
    let (b, h, hkv, d, local) = (2, 4, 2, 4, 6);
    let run =
        |op: &Op, x: &[&Tensor], at: &MeshPos| execute_at(op, x, &op_meta(op, x), at).unwrap();
    let close = |got: &Tensor, want: &Tensor, what: &str| {
        let e = rel_err(&to_f64_vec(got).unwrap(), &to_f64_vec(want).unwrap());
        assert!(e < 1e-5, "{what}: relative error {e:e}");
    };
    for (cp, zigzag, window) in [(2, true, None), (3, false, None), (4, true, Some(9))] {
        let n = cp * local;
        let base = AttentionSpec { window, ..AttentionSpec::causal(d) };
        let (q, k, v) =
            (rng.tensor(&[b, n, h, d]), rng.tensor(&[b, n, hkv, d]), rng.tensor(&[b, n, hkv, d]));
        let dout = rng.tensor(&[b, n, h, d]);
        let whole = run(&Op::Attention(base.clone()), &[&q, &k, &v], &MeshPos::single());
        let x = [&q, &k, &v, &whole[0], &whole[1], &dout];
        let wb = run(&Op::AttentionBackward(base.clone()), &x, &MeshPos::single());
        let (mut dk, mut dv) = (k.zeros_like().unwrap(), v.zeros_like().unwrap());
        let ring = |step| RingBlock { axis: 0, size: cp, step, zigzag };
        let rows = |t: &Tensor, pos: &[i64]| {
            let ids: Vec<u32> = pos.iter().map(|&p| p as u32).collect();
            let ids = Tensor::from_vec(ids, &[pos.len()], &Device::Cpu).unwrap();
            (t.index_select(&ids, 1).unwrap().contiguous().unwrap(), ids)
        };
        for c in 0..cp {
            let at = MeshPos::new(&[cp], c).unwrap();
            let what = format!("cp{cp} zigzag={zigzag} window={window:?} device {c}");
            let (ql, _) = rows(&q, &ring(0).positions_of(local, c));
            let (dl, _) = rows(&dout, &ring(0).positions_of(local, c));
            let mut blocks = Vec::new();
            for step in 0..cp {
                let spec = AttentionSpec { ring: Some(ring(step)), ..base.clone() };
                let (_, kp) = ring(step).positions(local, local, Some(&at));
                let ((kb, ids), (vb, _)) = (rows(&k, &kp), rows(&v, &kp));
                let out = if c == 0 {
                    check_kernel_floor(
                        &Op::Attention(spec.clone()),
                        &[&ql, &kb, &vb],
                        &[TOL; 2],
                        1e-30,
                    )
                } else {
                    run(&Op::Attention(spec.clone()), &[&ql, &kb, &vb], &at)
                };
                blocks.push((spec, kb, vb, ids, out));
            }
            let pairs: Vec<&Tensor> = blocks.iter().flat_map(|b| [&b.4[0], &b.4[1]]).collect();
            let merged = check_kernel(&Op::AttentionMerge, &pairs).remove(0);
            close(
                &merged,
                &rows(&whole[0], &ring(0).positions_of(local, c)).0,
                &format!("{what}: out"),
            );
            let mut x = pairs.clone();
            x.push(&dl);
            let gm = check_kernel_tol(&Op::AttentionMergeBackward, &x, &vec![TOL; 2 * cp]);
            let mut dq = ql.zeros_like().unwrap();
            for (r, (spec, kb, vb, ids, out)) in blocks.iter().enumerate() {
                let x = [&ql, kb, vb, &out[0], &out[1], &gm[2 * r], &gm[2 * r + 1]];
                let op = Op::AttentionBackward(spec.clone());
                let g = if c == 0 {
                    check_kernel_floor(&op, &x, &[TOL; 3], 1e-3)
                } else {
                    run(&op, &x, &at)
                };
                dq = (dq + &g[0]).unwrap();
                dk = dk.index_add(ids, &g[1], 1).unwrap();
                dv = dv.index_add(ids, &g[2], 1).unwrap();
            }
            close(&dq, &rows(&wb[0], &ring(0).positions_of(local, c)).0, &format!("{what}: dq"));
        }
        close(&dk, &wb[1], &format!("cp{cp}: dk"));
        close(&dv, &wb[2], &format!("cp{cp}: dv"));
    }
}
