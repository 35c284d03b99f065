//! Every VJP rule against central finite differences, evaluated by the reference
//! interpreter in f64; plus AdamW and whole training steps through `build_training_graph`.
//!
//! Each case builds a tiny forward graph whose differentiable inputs are `Parameter`s with
//! seeded random values, folds the op's output(s) into a scalar loss `Σ_i sum(out_i ⊙ w_i)`
//! with fixed random weights `w_i` (so no output is summed uniformly, which would hide e.g.
//! softmax and layer-norm gradients), differentiates it with `tessera_ir::gradients` and
//! compares each parameter's gradient with `(L(x+h) − L(x−h)) / 2h` element by element,
//! `h = 1e-5·max(1, |x|)`, by the norm-wise relative error `‖a − n‖ / ‖n‖ < 1e-6`.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use tessera_ir::interp::{self, Value};
use tessera_ir::ops::BinaryOp as B;
use tessera_ir::ops::ReduceOp as R;
use tessera_ir::ops::UnaryOp as U;
use tessera_ir::{
    AttentionSpec, Builder, Conv2dSpec, DType, Graph, Op, Phase, Result, Shape, TensorId,
    TrainConfig,
};

// ---- the harness ---------------------------------------------------------------------------

/// A case under construction: the builder, the random source and the leaf values.
struct Case {
    b: Builder,
    rng: StdRng,
    bindings: HashMap<TensorId, Value>,
}

impl Case {
    fn new(seed: u64) -> Case {
        Case { b: Builder::new(), rng: StdRng::seed_from_u64(seed), bindings: HashMap::new() }
    }

    fn uniform(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.rng.random_range(lo..hi)).collect()
    }

    /// Magnitudes in [lo, hi) with random signs: away from 0 (relu's kink, a divisor's pole).
    fn signed(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                let m = self.rng.random_range(lo..hi);
                if self.rng.random_bool(0.5) {
                    m
                } else {
                    -m
                }
            })
            .collect()
    }

    /// Values within 0.01 of `k/10 + offset`: two tensors with offsets 0 and 0.05 never come
    /// within 0.03 of each other (max/min stay away from their kink).
    fn grid(&mut self, n: usize, offset: f64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                self.rng.random_range(-10..10) as f64 * 0.1
                    + offset
                    + self.rng.random_range(-0.01..0.01)
            })
            .collect()
    }

    /// A shuffled ramp with gaps of 0.1 (no two elements close: a max-reduction's argmax
    /// does not move under a finite-difference step).
    fn distinct(&mut self, n: usize) -> Vec<f64> {
        let mut v: Vec<f64> = (0..n).map(|i| i as f64 * 0.1 - n as f64 * 0.05).collect();
        v.shuffle(&mut self.rng);
        v
    }

    fn param_typed(&mut self, shape: impl Into<Shape>, dtype: DType, data: Vec<f64>) -> TensorId {
        let shape = shape.into();
        let name = format!("p{}", self.bindings.len());
        let t = self.b.parameter(&name, shape.clone(), dtype);
        self.bindings.insert(t, Value::new(shape, data));
        t
    }

    fn param_data(&mut self, shape: impl Into<Shape>, data: Vec<f64>) -> TensorId {
        self.param_typed(shape, DType::F64, data)
    }

    /// An f64 parameter with values uniform in (−1, 1).
    fn param(&mut self, shape: impl Into<Shape>) -> TensorId {
        let shape = shape.into();
        let data = self.uniform(shape.numel() as usize, -1.0, 1.0);
        self.param_data(shape, data)
    }

    fn input(&mut self, shape: impl Into<Shape>, dtype: DType, value: Vec<f64>) -> TensorId {
        let shape = shape.into();
        let name = format!("in{}", self.bindings.len());
        let t = self.b.input(&name, shape.clone(), dtype);
        self.bindings.insert(t, Value::new(shape, value));
        t
    }

    fn ids(&mut self, shape: impl Into<Shape>, ids: &[i64]) -> TensorId {
        self.input(shape, DType::I64, ids.iter().map(|&i| i as f64).collect())
    }
}

fn seed_of(name: &str) -> u64 {
    // FNV-1a: a different, fixed random stream per case.
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, c| (h ^ c as u64).wrapping_mul(0x0100_0000_01b3))
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// Builds the case, differentiates `Σ_i sum(out_i ⊙ w_i)` with respect to every parameter and
/// checks each gradient against central finite differences. Returns the graph (forward and
/// backward) so callers can also check how the gradient was built.
fn check_vjp(name: &str, build: impl FnOnce(&mut Case) -> Result<Vec<TensorId>>) -> Graph {
    let mut cx = Case::new(seed_of(name));
    let outs = build(&mut cx).unwrap_or_else(|e| panic!("{name}: building the case: {e}"));
    // Parameters the case created through the builder directly get (−0.5, 0.5) values.
    let params = cx.b.graph.parameters();
    for &p in &params {
        if !cx.bindings.contains_key(&p) {
            let shape = cx.b.shape(p).clone();
            let data = cx.uniform(shape.numel() as usize, -0.5, 0.5);
            cx.bindings.insert(p, Value::new(shape, data));
        }
    }
    assert!(!params.is_empty(), "{name}: no parameters");

    let mut loss: Option<TensorId> = None;
    for &out in &outs {
        let meta = cx.b.meta(out).clone();
        let w = cx.uniform(meta.numel() as usize, -1.0, 1.0);
        let w = cx.input(meta.shape.clone(), meta.dtype, w);
        let prod = cx.b.mul(out, w).unwrap();
        let all: Vec<usize> = (0..meta.shape.rank()).collect();
        let mut term = cx.b.reduce(R::Sum, prod, &all, false).unwrap();
        if meta.dtype != DType::F64 {
            term = cx.b.cast(term, DType::F64).unwrap();
        }
        loss = Some(match loss {
            Some(l) => cx.b.add(l, term).unwrap(),
            None => term,
        });
    }
    let loss = loss.expect("the case has outputs");
    let grads = tessera_ir::gradients(&mut cx.b, loss, &params)
        .unwrap_or_else(|e| panic!("{name}: autodiff: {e}"));
    let graph = cx.b.finish();
    let mut bindings = cx.bindings;

    let values = interp::eval(&graph, &bindings).unwrap_or_else(|e| panic!("{name}: eval: {e}"));
    let loss_at = |bindings: &HashMap<TensorId, Value>| -> f64 {
        interp::eval_outputs(&graph, bindings, &[loss]).unwrap()[0].item()
    };
    assert!(
        (loss_at(&bindings) - values[loss.index()].item()).abs()
            <= 1e-12 * values[loss.index()].item().abs().max(1.0),
        "{name}: eval and eval_outputs disagree on the loss"
    );

    for (&p, g) in params.iter().zip(&grads) {
        let pname = graph.tensor_scope(p).to_string();
        let g = g.unwrap_or_else(|| panic!("{name}: no gradient for {pname}"));
        let analytic = values[g.index()].clone();
        assert_eq!(analytic.shape, *graph.shape(p), "{name}: gradient shape of {pname}");
        let mut numeric = vec![0.0; analytic.numel()];
        for (k, n) in numeric.iter_mut().enumerate() {
            let x0 = bindings[&p].data[k];
            let h = 1e-5 * x0.abs().max(1.0);
            bindings.get_mut(&p).unwrap().data[k] = x0 + h;
            let up = loss_at(&bindings);
            bindings.get_mut(&p).unwrap().data[k] = x0 - h;
            let down = loss_at(&bindings);
            bindings.get_mut(&p).unwrap().data[k] = x0;
            *n = (up - down) / (2.0 * h);
        }
        let diff: Vec<f64> = analytic.data.iter().zip(&numeric).map(|(a, n)| a - n).collect();
        let nn = norm(&numeric);
        let err = norm(&diff) / nn.max(1e-30);
        assert!(
            nn > 1e-6,
            "{name}: the gradient of {pname} is ~0 ({nn:e}); the check would be vacuous"
        );
        assert!(
            err < 1e-6,
            "{name}: gradient of {pname} off by {err:e} (norm-wise)\n analytic {:?}\n numeric  {:?}",
            analytic.data,
            numeric
        );
    }
    graph
}

fn has_backward(graph: &Graph, pred: impl Fn(&Op) -> bool) -> bool {
    graph.nodes.iter().any(|n| n.phase == Phase::Backward && pred(&n.op))
}

// ---- elementwise ---------------------------------------------------------------------------

#[test]
fn unary_ops() {
    let all = [
        U::Neg,
        U::Exp,
        U::Log,
        U::Sqrt,
        U::Rsqrt,
        U::Tanh,
        U::Gelu,
        U::GeluTanh,
        U::Silu,
        U::Relu,
        U::Sigmoid,
        U::Sin,
        U::Cos,
    ];
    for u in all {
        check_vjp(&format!("unary {u:?}"), |cx| {
            let data = match u {
                U::Log | U::Sqrt | U::Rsqrt => cx.uniform(12, 0.5, 2.0),
                U::Relu => cx.signed(12, 0.1, 1.0),
                U::Neg
                | U::Exp
                | U::Tanh
                | U::Gelu
                | U::GeluTanh
                | U::Silu
                | U::Sigmoid
                | U::Sin
                | U::Cos => cx.uniform(12, -2.0, 2.0),
            };
            let x = cx.param_data([3, 4], data);
            Ok(vec![cx.b.unary(u, x)?])
        });
    }
    // Both branches of erf/erfc (|x|/√2 beyond 2.5) inside exact GELU.
    check_vjp("gelu wide", |cx| {
        let data = cx.signed(12, 0.5, 7.0);
        let x = cx.param_data([12], data);
        Ok(vec![cx.b.unary(U::Gelu, x)?])
    });
}

#[test]
fn binary_ops() {
    let shapes: [(&[usize], &[usize]); 6] = [
        (&[2, 3, 4], &[2, 3, 4]),
        (&[2, 3, 4], &[3, 1]),
        (&[4], &[2, 3, 4]),
        (&[2, 1, 4], &[3, 1]),
        (&[], &[2, 3]),
        (&[2, 3], &[1]),
    ];
    for op in [B::Add, B::Sub, B::Mul, B::Div, B::Max, B::Min] {
        for (sa, sb) in shapes {
            check_vjp(&format!("binary {op:?} {sa:?} {sb:?}"), |cx| {
                let (na, nb) = (Shape::from(sa).numel() as usize, Shape::from(sb).numel() as usize);
                let (a, b) = match op {
                    B::Div => (cx.uniform(na, -1.0, 1.0), cx.signed(nb, 0.5, 1.5)),
                    B::Max | B::Min => (cx.grid(na, 0.05), cx.grid(nb, 0.0)),
                    B::Add | B::Sub | B::Mul => {
                        (cx.uniform(na, -1.0, 1.0), cx.uniform(nb, -1.0, 1.0))
                    }
                };
                let a = cx.param_data(sa, a);
                let b = cx.param_data(sb, b);
                Ok(vec![cx.b.binary(op, a, b)?])
            });
        }
    }
    // One operand reused on both sides and a constant operand (no gradient wanted for it).
    check_vjp("binary x*x/c", |cx| {
        let x = cx.param([3, 4]);
        let c = cx.input([4], DType::F64, vec![1.5, -2.0, 0.7, 3.0]);
        let sq = cx.b.mul(x, x)?;
        Ok(vec![cx.b.div(sq, c)?])
    });
}

#[test]
fn cast_and_dropout() {
    check_vjp("cast f32 -> f64", |cx| {
        let data = cx.uniform(12, -1.0, 1.0);
        let x = cx.param_typed([3, 4], DType::F32, data);
        let y = cx.b.unary(U::Tanh, x)?;
        Ok(vec![cx.b.cast(y, DType::F64)?])
    });
    check_vjp("cast f64 -> f32", |cx| {
        let x = cx.param([3, 4]);
        Ok(vec![cx.b.cast(x, DType::F32)?])
    });
    check_vjp("cast f32 -> f32", |cx| {
        let data = cx.uniform(12, -1.0, 1.0);
        let x = cx.param_typed([3, 4], DType::F32, data);
        Ok(vec![cx.b.cast(x, DType::F32)?])
    });
    let g = check_vjp("dropout p=0.3", |cx| {
        let x = cx.param([6, 7]);
        let seed = cx.ids(Shape::scalar(), &[1234]);
        Ok(vec![cx.b.dropout(x, 0.3, seed, 7)?])
    });
    assert!(has_backward(&g, |op| matches!(op, Op::Dropout { .. })));
    // The mask is not trivial: some elements dropped, most kept.
    let kept =
        (0..42).filter(|&k| tessera_ir::ops::elementwise::dropout_keep(1234, 7, k, 0.3)).count();
    assert!((20..42).contains(&kept), "kept {kept} of 42");
}

// ---- matmul ----------------------------------------------------------------------------------

#[test]
fn matmuls() {
    // (a's stored shape, b's stored shape, trans_a, trans_b)
    let cases: [(&[usize], &[usize], bool, bool); 12] = [
        (&[3, 4], &[4, 5], false, false),
        (&[4, 3], &[4, 5], true, false),
        (&[3, 4], &[5, 4], false, true),
        (&[4, 3], &[5, 4], true, true),
        // A batched activation times a 2-D weight (the flattened weight-gradient path).
        (&[2, 3, 4], &[4, 5], false, false),
        (&[2, 3, 4], &[5, 4], false, true),
        (&[2, 4, 3], &[4, 5], true, false),
        (&[2, 4, 3], &[5, 4], true, true),
        // A 2-D operand times a batched weight.
        (&[3, 4], &[2, 4, 5], false, false),
        (&[4, 3], &[2, 5, 4], true, true),
        // Both batched, and broadcast batch dims.
        (&[2, 3, 4], &[2, 4, 5], false, false),
        (&[2, 1, 3, 4], &[3, 5, 4], false, true),
    ];
    for (sa, sb, ta, tb) in cases {
        check_vjp(&format!("matmul {sa:?} {sb:?} ta={ta} tb={tb}"), |cx| {
            let a = cx.param(sa);
            let b = cx.param(sb);
            Ok(vec![cx.b.matmul(a, b, ta, tb)?])
        });
    }
    // x·xᵀ: one parameter on both sides.
    check_vjp("matmul x xT", |cx| {
        let x = cx.param([3, 4]);
        Ok(vec![cx.b.matmul(x, x, false, true)?])
    });
}

// ---- reductions --------------------------------------------------------------------------------

#[test]
fn reductions() {
    let dim_sets: [&[usize]; 6] = [&[1], &[0, 2], &[2, 0], &[0, 1, 2], &[2], &[]];
    for op in [R::Sum, R::Mean, R::Max, R::SumSquares] {
        for dims in dim_sets {
            for keepdim in [false, true] {
                check_vjp(&format!("reduce {op:?} {dims:?} keepdim={keepdim}"), |cx| {
                    let data = cx.distinct(24);
                    let x = cx.param_data([2, 3, 4], data);
                    Ok(vec![cx.b.reduce(op, x, dims, keepdim)?])
                });
            }
        }
    }
}

#[test]
fn softmaxes() {
    for shape in [vec![5], vec![3, 5], vec![2, 3, 4]] {
        check_vjp(&format!("softmax {shape:?}"), |cx| {
            let x = cx.param(shape.clone());
            let y = cx.b.scale(x, 2.0)?;
            Ok(vec![cx.b.softmax(y)?])
        });
    }
}

// ---- layout ----------------------------------------------------------------------------------

#[test]
fn layout_ops() {
    check_vjp("reshape", |cx| {
        let x = cx.param([2, 3, 4]);
        Ok(vec![cx.b.reshape(x, [6, 4])?])
    });
    check_vjp("permute", |cx| {
        let x = cx.param([2, 3, 4]);
        Ok(vec![cx.b.permute(x, &[2, 0, 1])?])
    });
    check_vjp("slice", |cx| {
        let x = cx.param([2, 5, 3]);
        Ok(vec![cx.b.slice(x, 1, 1, 4)?])
    });
    // Three slices tiling dim 2: autodiff joins their gradients with one concat.
    let g = check_vjp("slices tiling", |cx| {
        let x = cx.param([2, 3, 6]);
        let q = cx.b.slice(x, 2, 0, 2)?;
        let k = cx.b.slice(x, 2, 2, 3)?;
        let v = cx.b.slice(x, 2, 3, 6)?;
        let qk = cx.b.mul(q, q)?;
        Ok(vec![qk, cx.b.unary(U::Tanh, k)?, v])
    });
    assert!(has_backward(&g, |op| matches!(op, Op::Concat { dim: 2 })));
    assert!(!has_backward(&g, |op| matches!(op, Op::Pad { .. })));
    // Overlapping slices: pad and add.
    let g = check_vjp("slices overlapping", |cx| {
        let x = cx.param([4, 5]);
        let a = cx.b.slice(x, 1, 0, 3)?;
        let b = cx.b.slice(x, 1, 2, 5)?;
        let c = cx.b.slice(x, 0, 1, 2)?;
        Ok(vec![a, b, c])
    });
    assert!(has_backward(&g, |op| matches!(op, Op::Pad { .. })));
    assert!(!has_backward(&g, |op| matches!(op, Op::Concat { .. })));
    // A full use next to slices, and a single slice covering everything.
    check_vjp("slice plus full use", |cx| {
        let x = cx.param([3, 4]);
        let a = cx.b.slice(x, 1, 1, 3)?;
        let all = cx.b.slice(x, 0, 0, 3)?;
        let y = cx.b.unary(U::Sigmoid, x)?;
        Ok(vec![a, all, y])
    });
    check_vjp("pad", |cx| {
        let x = cx.param([2, 3]);
        Ok(vec![cx.b.pad(x, 1, 1, 2)?])
    });
    check_vjp("concat", |cx| {
        let a = cx.param([2, 1, 3]);
        let b = cx.param([2, 4, 3]);
        let c = cx.param([2, 2, 3]);
        Ok(vec![cx.b.concat(&[a, b, c, a], 1)?])
    });
    check_vjp("expand [3,1] -> [2,3,4]", |cx| {
        let x = cx.param([3, 1]);
        Ok(vec![cx.b.expand(x, [2, 3, 4])?])
    });
    check_vjp("expand [4] -> [3,4]", |cx| {
        let x = cx.param([4]);
        Ok(vec![cx.b.expand(x, [3, 4])?])
    });
}

// ---- neural-network ops ------------------------------------------------------------------------

#[test]
fn norms() {
    for shape in [vec![3, 5], vec![2, 2, 6]] {
        let d = *shape.last().unwrap();
        check_vjp(&format!("layer_norm {shape:?}"), |cx| {
            let x = cx.param(shape.clone());
            let w = cx.param([d]);
            let b = cx.param([d]);
            Ok(vec![cx.b.layer_norm(x, w, b, 1e-5)?])
        });
        check_vjp(&format!("rms_norm {shape:?}"), |cx| {
            let x = cx.param(shape.clone());
            let w = cx.param([d]);
            Ok(vec![cx.b.rms_norm(x, w, 1e-6)?])
        });
    }
}

// ---- vision ops (NCHW) -------------------------------------------------------------------------

fn conv_spec(
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
) -> Conv2dSpec {
    Conv2dSpec { stride, padding, dilation, groups }
}

#[test]
fn convolutions() {
    // (x dims, w dims, spec): plain; strided, padded, dilated, grouped; depthwise; 1×1.
    let cases = [
        ([2, 3, 5, 4], [4, 3, 3, 2], conv_spec([1, 1], [0, 0], [1, 1], 1)),
        ([1, 4, 7, 6], [6, 2, 2, 3], conv_spec([2, 1], [1, 2], [2, 1], 2)),
        ([2, 4, 5, 5], [4, 2, 3, 3], conv_spec([2, 2], [1, 1], [2, 2], 2)),
        ([1, 3, 4, 5], [3, 1, 3, 3], conv_spec([1, 2], [1, 1], [1, 1], 3)),
        ([2, 3, 3, 3], [2, 3, 1, 1], conv_spec([1, 1], [0, 0], [1, 1], 1)),
    ];
    for (xd, wd, spec) in cases {
        let g = check_vjp(&format!("conv2d {xd:?} * {wd:?} {spec:?}"), |cx| {
            let x = cx.param(xd);
            let w = cx.param(wd);
            Ok(vec![cx.b.conv2d(x, w, spec)?])
        });
        assert!(has_backward(&g, |op| matches!(op, Op::Conv2dBackwardInput { .. })));
        assert!(has_backward(&g, |op| matches!(op, Op::Conv2dBackwardWeight { .. })));
    }
    // Only the weight is trained (an input image): no backward-data op is emitted.
    let g = check_vjp("conv2d weight only", |cx| {
        let data = cx.uniform(2 * 2 * 4 * 4, -1.0, 1.0);
        let x = cx.input([2, 2, 4, 4], DType::F64, data);
        let w = cx.param([3, 2, 3, 3]);
        Ok(vec![cx.b.conv2d(x, w, conv_spec([1, 1], [1, 1], [1, 1], 1))?])
    });
    assert!(!has_backward(&g, |op| matches!(op, Op::Conv2dBackwardInput { .. })));
}

#[test]
fn group_norms() {
    for (shape, groups) in
        [(vec![2, 4, 3, 3], 2), (vec![2, 6, 5], 3), (vec![1, 4, 2, 3], 1), (vec![2, 3, 2, 2], 3)]
    {
        let c = shape[1];
        check_vjp(&format!("group_norm {shape:?} groups {groups}"), |cx| {
            let x = cx.param(shape.clone());
            let w = cx.param([c]);
            let b = cx.param([c]);
            Ok(vec![cx.b.group_norm(x, w, b, groups, 1e-5)?])
        });
    }
}

#[test]
fn poolings_and_upsampling() {
    for (k, s, p) in [([3, 3], [2, 2], [1, 1]), ([2, 2], [2, 2], [0, 0]), ([3, 2], [1, 2], [1, 0])]
    {
        check_vjp(&format!("max_pool2d k{k:?} s{s:?} p{p:?}"), |cx| {
            // Distinct values: no argmax moves under a finite-difference step.
            let data = cx.distinct(2 * 2 * 5 * 6);
            let x = cx.param_data([2, 2, 5, 6], data);
            Ok(vec![cx.b.max_pool2d(x, k, s, p)?])
        });
        for include in [true, false] {
            check_vjp(&format!("avg_pool2d k{k:?} s{s:?} p{p:?} include_pad {include}"), |cx| {
                let x = cx.param([2, 2, 5, 6]);
                Ok(vec![cx.b.avg_pool2d(x, k, s, p, include)?])
            });
        }
    }
    check_vjp("global avg_pool2d", |cx| {
        let x = cx.param([2, 3, 4, 5]);
        Ok(vec![cx.b.avg_pool2d(x, [4, 5], [1, 1], [0, 0], false)?])
    });
    for scale in [[2, 2], [1, 3]] {
        check_vjp(&format!("upsample_nearest2d {scale:?}"), |cx| {
            let x = cx.param([2, 2, 3, 2]);
            Ok(vec![cx.b.upsample_nearest2d(x, scale)?])
        });
    }
}

/// A small UNet-style block: conv, GroupNorm, SiLU, upsample, conv, bias add, pool.
#[test]
fn conv_block_chain() {
    let g = check_vjp("conv block", |cx| {
        let x = cx.param([2, 2, 4, 4]);
        let w1 = cx.param([4, 2, 3, 3]);
        let (gw, gb) = (cx.param([4]), cx.param([4]));
        let w2 = cx.param([2, 2, 3, 3]);
        let bias = cx.param([1, 2, 1, 1]);
        let h = cx.b.conv2d(x, w1, conv_spec([1, 1], [1, 1], [1, 1], 1))?;
        let h = cx.b.group_norm(h, gw, gb, 2, 1e-5)?;
        let h = cx.b.unary(U::Silu, h)?;
        let h = cx.b.upsample_nearest2d(h, [2, 2])?;
        let h = cx.b.conv2d(h, w2, conv_spec([2, 2], [1, 1], [1, 1], 2))?;
        let h = cx.b.add(h, bias)?;
        Ok(vec![cx.b.avg_pool2d(h, [2, 2], [2, 2], [0, 0], true)?])
    });
    assert!(has_backward(&g, |op| matches!(op, Op::GroupNormBackward { .. })));
    assert!(has_backward(&g, |op| matches!(op, Op::Upsample2dBackward { .. })));
}

#[test]
fn vision_shape_errors_are_clear() {
    let mut b = Builder::new();
    let x = b.parameter("x", [1, 3, 4, 4], DType::F32);
    let w = b.parameter("w", [4, 1, 3, 3], DType::F32);
    let e = b.conv2d(x, w, conv_spec([1, 1], [0, 0], [1, 1], 2)).unwrap_err().to_string();
    assert!(e.contains("not divisible by groups 2"), "{e}");
    let w5 = b.parameter("w5", [4, 3, 5, 5], DType::F32);
    let e = b.conv2d(x, w5, Conv2dSpec::default()).unwrap_err().to_string();
    assert!(e.contains("larger than the padded input"), "{e}");
    let e = b.max_pool2d(x, [2, 2], [2, 2], [2, 2]).unwrap_err().to_string();
    assert!(e.contains("at most half the kernel"), "{e}");
    let e = b.max_pool2d(x, [5, 5], [1, 1], [0, 0]).unwrap_err().to_string();
    assert!(e.contains("larger than the padded input"), "{e}");
    let gw = b.parameter("gw", [3], DType::F32);
    let e = b.group_norm(x, gw, gw, 2, 1e-5).unwrap_err().to_string();
    assert!(e.contains("not divisible by groups 2"), "{e}");
    let flat = b.parameter("flat", [3, 16], DType::F32);
    let e = b.upsample_nearest2d(flat, [2, 2]).unwrap_err().to_string();
    assert!(e.contains("must be 4-D"), "{e}");
}

#[test]
fn conv_flops_are_matmul_flops() {
    let x = tessera_ir::TensorMeta::new([2, 4, 8, 8], DType::F32);
    let w = tessera_ir::TensorMeta::new([6, 2, 3, 3], DType::F32);
    let spec = conv_spec([1, 1], [1, 1], [1, 1], 2);
    let op = Op::Conv2d(spec);
    let y = op.infer(&[&x, &w]).unwrap().remove(0);
    assert_eq!(y.shape.dims(), [2, 6, 8, 8]);
    let want = 2 * 2 * 6 * 8 * 8 * 2 * 3 * 3;
    assert_eq!(op.flops(&[&x, &w], &[&y]), tessera_ir::Flops { matmul: want, other: 0 });
    let bi = Op::Conv2dBackwardInput { spec, input_hw: [8, 8] };
    assert_eq!(bi.infer(&[&w, &y]).unwrap()[0], x);
    assert_eq!(bi.flops(&[&w, &y], &[&x]).matmul, want);
    let bw = Op::Conv2dBackwardWeight { spec, kernel_hw: [3, 3] };
    assert_eq!(bw.infer(&[&x, &y]).unwrap()[0], w);
    assert_eq!(bw.flops(&[&x, &y], &[&w]).matmul, want);
}

#[test]
fn embedding_and_cross_entropy() {
    check_vjp("embedding (repeated ids)", |cx| {
        let table = cx.param([6, 4]);
        let ids = cx.ids([2, 3], &[1, 3, 1, 5, 1, 0]);
        Ok(vec![cx.b.embedding(table, ids)?])
    });
    let cases: [(&[usize], &[i64], Option<i64>); 4] = [
        (&[4, 5], &[0, 3, 3, 1], None),
        (&[2, 3, 5], &[4, -100, 0, 2, -100, 2], Some(-100)),
        (&[6, 3], &[2, 0, 2, 1, 1, 0], Some(2)),
        // Ignored rows in the middle of a batch whose every class appears.
        (&[3, 2, 4], &[0, 1, 2, 3, 7, 1], Some(7)),
    ];
    for (logits_shape, targets, ignore) in cases {
        check_vjp(&format!("cross_entropy {logits_shape:?} ignore={ignore:?}"), |cx| {
            let logits = cx.param(logits_shape);
            let t = cx.ids(&logits_shape[..logits_shape.len() - 1], targets);
            let scaled = cx.b.scale(logits, 3.0)?;
            Ok(vec![cx.b.cross_entropy(scaled, t, ignore)?])
        });
        check_vjp(&format!("cross_entropy_sum {logits_shape:?} ignore={ignore:?}"), |cx| {
            let logits = cx.param(logits_shape);
            let t = cx.ids(&logits_shape[..logits_shape.len() - 1], targets);
            let scaled = cx.b.scale(logits, 3.0)?;
            Ok(vec![cx.b.cross_entropy_sum(scaled, t, ignore)?])
        });
    }
}

/// The chunked LM head and loss: chunks that divide the rows, that do not, and one chunk
/// holding every row; ignored rows among them.
#[test]
fn linear_cross_entropy() {
    for chunk_rows in [1usize, 2, 4, 5, 64] {
        check_vjp(&format!("linear_cross_entropy chunk={chunk_rows}"), |cx| {
            let x = cx.param([2, 3, 4]);
            let w = cx.param([5, 4]);
            let t = cx.ids([2, 3], &[4, -100, 0, 2, 1, 3]);
            let xs = cx.b.scale(x, 3.0)?;
            let op = Op::LinearCrossEntropy { chunk_rows, ignore_index: Some(-100) };
            Ok(vec![cx.b.push1(op, &[xs, w, t])?])
        });
    }
}

/// The tiled MLP, gated (SwiGLU, `nn.Linear` weights) and plain (GPT-2's GELU `Conv1D` with
/// the up projection's bias): chunks that divide the rows, that do not, and one chunk holding
/// every row.
#[test]
fn tiled_mlp() {
    use tessera_ir::ops::MlpSpec;
    for chunk_rows in [1usize, 4, 64] {
        for (act, gated) in [(U::Silu, true), (U::GeluTanh, false)] {
            let spec = MlpSpec { act, gated, conv1d: !gated, bias: !gated, chunk_rows };
            check_vjp(&format!("tiled_mlp {spec:?}"), |cx| {
                let (d, f) = (3, 5);
                let x = cx.param([2, 3, d]);
                let mut ins = vec![x];
                let up = if gated { [f, d] } else { [d, f] };
                ins.push(cx.param(up));
                if gated {
                    ins.push(cx.param(up));
                } else {
                    ins.push(cx.param([f]));
                }
                ins.push(cx.param([up[1], up[0]]));
                Ok(vec![cx.b.push1(Op::TiledMlp(spec), &ins)?])
            });
        }
    }
}

#[test]
fn logsumexp() {
    for shape in [&[5usize][..], &[3, 4], &[2, 3, 5]] {
        check_vjp(&format!("logsumexp {shape:?}"), |cx| {
            let x = cx.param(shape);
            let scaled = cx.b.scale(x, 3.0)?;
            Ok(vec![cx.b.push1(Op::LogSumExp, &[scaled])?])
        });
    }
}

#[test]
fn cross_entropy_logsumexp_is_not_differentiable() {
    let mut b = Builder::new();
    let logits = b.parameter("logits", [3, 4], DType::F32);
    let t = b.input("t", [3], DType::I64);
    let out = b
        .push(Op::CrossEntropy { ignore_index: None, sum: false, classes: None }, &[logits, t])
        .unwrap();
    let z = b.reduce(R::SumSquares, out[1], &[0], false).unwrap();
    let loss = b.add(out[0], z).unwrap();
    let err = tessera_ir::gradients(&mut b, loss, &[logits]).unwrap_err();
    assert!(err.to_string().contains("logsumexp"), "{err}");
}

#[test]
fn attentions() {
    // [B, S, T, H, Hkv, D] and the mask.
    let cases: [([usize; 6], bool, Option<usize>); 7] = [
        ([2, 4, 4, 2, 2, 3], true, None),
        ([2, 4, 4, 2, 2, 3], false, None),
        ([1, 5, 5, 2, 2, 3], true, Some(2)),
        ([1, 5, 5, 2, 2, 3], false, Some(3)),
        // Grouped-query attention: 4 query heads over 2 kv heads.
        ([2, 4, 4, 4, 2, 3], true, None),
        ([1, 4, 4, 4, 2, 2], false, None),
        // Fewer queries than keys: the queries are the last S positions.
        ([1, 3, 5, 2, 1, 3], true, None),
    ];
    for ([b, s, t, h, hkv, d], causal, window) in cases {
        let name = format!(
            "attention B{b} S{s} T{t} H{h} Hkv{hkv} D{d} causal={causal} window={window:?}"
        );
        check_vjp(&name, |cx| {
            let q = cx.param([b, s, h, d]);
            let k = cx.param([b, t, hkv, d]);
            let v = cx.param([b, t, hkv, d]);
            let spec = AttentionSpec { causal, window, ..AttentionSpec::causal(d) };
            Ok(vec![cx.b.attention(q, k, v, spec)?])
        });
    }
}

#[test]
fn ropes() {
    let inv_freq = [1.0, 0.37, 0.05];
    check_vjp("rope", |cx| {
        let x = cx.param([2, 3, 2, 6]);
        Ok(vec![cx.b.rope(x, &inv_freq)?])
    });
    check_vjp("rope inverse", |cx| {
        let x = cx.param([1, 4, 1, 6]);
        Ok(vec![cx.b.push1(Op::Rope { inv_freq: inv_freq.to_vec(), inverse: true }, &[x])?])
    });
}

#[test]
fn rope_inverse_undoes_rope() {
    let x = Value::from_fn([1, 5, 2, 4], |k| (k as f64 * 0.37).sin());
    let inv_freq = vec![0.9, 0.11];
    let fwd =
        interp::eval_op(&Op::Rope { inv_freq: inv_freq.clone(), inverse: false }, &[&x]).unwrap();
    let back = interp::eval_op(&Op::Rope { inv_freq, inverse: true }, &[&fwd[0]]).unwrap();
    for (a, b) in back[0].data.iter().zip(&x.data) {
        assert!((a - b).abs() < 1e-14);
    }
    // Position 0 is not rotated.
    assert_eq!(&fwd[0].data[..8], &x.data[..8]);
}

// ---- whole models ------------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct GptCfg {
    batch: usize,
    seq: usize,
    vocab: usize,
    hidden: usize,
    heads: usize,
    layers: usize,
    dropout: f64,
}

/// A GPT-2-style decoder (learned positions, pre-LN, fused qkv, tanh-GELU MLP, tied head)
/// built from parameters named as Hugging Face names them. Returns the loss and the inputs
/// (ids, targets, dropout seed).
fn gpt(b: &mut Builder, c: &GptCfg) -> Result<(TensorId, [TensorId; 3])> {
    let (bs, s, d, nh) = (c.batch, c.seq, c.hidden, c.heads);
    let ids = b.input("input_ids", [bs, s], DType::I64);
    let targets = b.input("labels", [bs, s], DType::I64);
    let seed = b.input("seed", Shape::scalar(), DType::I64);
    let wte = b.scoped("transformer.wte", |b| b.parameter("weight", [c.vocab, d], DType::F32));
    let wpe = b.scoped("transformer.wpe", |b| b.parameter("weight", [s, d], DType::F32));
    let tok = b.embedding(wte, ids)?;
    let mut x = b.add(tok, wpe)?;
    let linear = |b: &mut Builder, name: &str, x: TensorId, din: usize, dout: usize| {
        b.scoped(name, |b| {
            let w = b.parameter("weight", [din, dout], DType::F32);
            let bias = b.parameter("bias", [dout], DType::F32);
            let y = b.matmul(x, w, false, false)?;
            b.add(y, bias)
        })
    };
    let ln = |b: &mut Builder, name: &str, x: TensorId| {
        b.scoped(name, |b| {
            let w = b.parameter("weight", [d], DType::F32);
            let bias = b.parameter("bias", [d], DType::F32);
            b.layer_norm(x, w, bias, 1e-5)
        })
    };
    for l in 0..c.layers {
        b.push_scope(format!("transformer.h.{l}"));
        b.set_block(Some(l as u32));
        let h = ln(b, "ln_1", x)?;
        let qkv = linear(b, "attn.c_attn", h, d, 3 * d)?;
        let split = |b: &mut Builder, i: usize| -> Result<TensorId> {
            let t = b.slice(qkv, 2, i * d, (i + 1) * d)?;
            b.reshape(t, [bs, s, nh, d / nh])
        };
        let (q, k, v) = (split(b, 0)?, split(b, 1)?, split(b, 2)?);
        let spec = AttentionSpec::causal(d / nh);
        let a = b.attention(q, k, v, spec)?;
        let a = b.reshape(a, [bs, s, d])?;
        let mut a = linear(b, "attn.c_proj", a, d, d)?;
        if c.dropout > 0.0 {
            a = b.dropout(a, c.dropout, seed, 2 * l as u64)?;
        }
        x = b.add(x, a)?;
        let h = ln(b, "ln_2", x)?;
        let h = linear(b, "mlp.c_fc", h, d, 4 * d)?;
        let h = b.unary(U::GeluTanh, h)?;
        let mut h = linear(b, "mlp.c_proj", h, 4 * d, d)?;
        if c.dropout > 0.0 {
            h = b.dropout(h, c.dropout, seed, 2 * l as u64 + 1)?;
        }
        x = b.add(x, h)?;
        b.set_block(None);
        b.pop_scope();
    }
    let x = ln(b, "transformer.ln_f", x)?;
    let logits = b.scoped("lm_head", |b| b.matmul(x, wte, false, true))?;
    let loss = b.cross_entropy(logits, targets, Some(-100))?;
    Ok((loss, [ids, targets, seed]))
}

/// A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, untied head.
fn llama(
    b: &mut Builder,
    bs: usize,
    s: usize,
    vocab: usize,
    d: usize,
    nh: usize,
    nkv: usize,
) -> Result<[TensorId; 3]> {
    let hd = d / nh;
    let ids = b.input("input_ids", [bs, s], DType::I64);
    let targets = b.input("labels", [bs, s], DType::I64);
    let embed = b.parameter("model.embed_tokens.weight", [vocab, d], DType::F64);
    let mut x = b.embedding(embed, ids)?;
    let inv_freq: Vec<f64> =
        (0..hd / 2).map(|i| 10000f64.powf(-2.0 * i as f64 / hd as f64)).collect();
    for l in 0..2 {
        b.push_scope(format!("model.layers.{l}"));
        let lin = |b: &mut Builder, name: &str, x: TensorId, din: usize, dout: usize| {
            let w = b.parameter(&format!("{name}.weight"), [dout, din], DType::F64);
            b.matmul(x, w, false, true)
        };
        let norm_w = b.parameter("input_layernorm.weight", [d], DType::F64);
        let h = b.rms_norm(x, norm_w, 1e-6)?;
        let q = lin(b, "self_attn.q_proj", h, d, d)?;
        let k = lin(b, "self_attn.k_proj", h, d, nkv * hd)?;
        let v = lin(b, "self_attn.v_proj", h, d, nkv * hd)?;
        let q = b.reshape(q, [bs, s, nh, hd])?;
        let k = b.reshape(k, [bs, s, nkv, hd])?;
        let v = b.reshape(v, [bs, s, nkv, hd])?;
        let q = b.rope(q, &inv_freq)?;
        let k = b.rope(k, &inv_freq)?;
        let spec = AttentionSpec { window: Some(3), ..AttentionSpec::causal(hd) };
        let a = b.attention(q, k, v, spec)?;
        let a = b.reshape(a, [bs, s, d])?;
        let a = lin(b, "self_attn.o_proj", a, d, d)?;
        x = b.add(x, a)?;
        let norm_w = b.parameter("post_attention_layernorm.weight", [d], DType::F64);
        let h = b.rms_norm(x, norm_w, 1e-6)?;
        let gate = lin(b, "mlp.gate_proj", h, d, 2 * d)?;
        let up = lin(b, "mlp.up_proj", h, d, 2 * d)?;
        let gate = b.unary(U::Silu, gate)?;
        let h = b.mul(gate, up)?;
        let h = lin(b, "mlp.down_proj", h, 2 * d, d)?;
        x = b.add(x, h)?;
        b.pop_scope();
    }
    let norm_w = b.parameter("model.norm.weight", [d], DType::F64);
    let x = b.rms_norm(x, norm_w, 1e-6)?;
    let head = b.parameter("lm_head.weight", [vocab, d], DType::F64);
    let logits = b.matmul(x, head, false, true)?;
    let loss = b.cross_entropy(logits, targets, Some(-100))?;
    Ok([loss, ids, targets])
}

#[test]
fn composite_models() {
    check_vjp("tiny gpt", |cx| {
        let c = GptCfg { batch: 2, seq: 4, vocab: 7, hidden: 8, heads: 2, layers: 2, dropout: 0.2 };
        let (loss, [ids, targets, seed]) = gpt(&mut cx.b, &c)?;
        cx.bindings.insert(ids, Value::from_i64([2, 4], &[1, 5, 5, 0, 6, 2, 3, 3]));
        cx.bindings.insert(targets, Value::from_i64([2, 4], &[5, 5, 0, -100, 2, 3, 3, 4]));
        cx.bindings.insert(seed, Value::from_i64(Shape::scalar(), &[99]));
        Ok(vec![loss])
    });
    check_vjp("tiny llama", |cx| {
        let [loss, ids, targets] = llama(&mut cx.b, 2, 5, 7, 8, 4, 2)?;
        cx.bindings.insert(ids, Value::from_i64([2, 5], &[1, 5, 5, 0, 6, 2, 3, 3, 4, 4]));
        cx.bindings.insert(targets, Value::from_i64([2, 5], &[5, 5, 0, 6, -100, 3, 3, 4, 4, 1]));
        Ok(vec![loss])
    });
}

// ---- training through build_training_graph ------------------------------------------------------

/// A 2-layer MLP classifier: `relu(x·W1 + b1)·W2 + b2` under cross-entropy.
fn mlp(b: &mut Builder, dtype: DType) -> (TensorId, TensorId, TensorId) {
    let x = b.input("x", [8, 6], dtype);
    let targets = b.input("targets", [8], DType::I64);
    let w1 = b.parameter("fc1.weight", [6, 16], dtype);
    let b1 = b.parameter("fc1.bias", [16], dtype);
    let w2 = b.parameter("fc2.weight", [16, 4], dtype);
    let b2 = b.parameter("fc2.bias", [4], dtype);
    let h = b.matmul(x, w1, false, false).unwrap();
    let h = b.add(h, b1).unwrap();
    let h = b.unary(U::Relu, h).unwrap();
    let y = b.matmul(h, w2, false, false).unwrap();
    let logits = b.add(y, b2).unwrap();
    let loss = b.cross_entropy(logits, targets, None).unwrap();
    (loss, x, targets)
}

type Setup = (tessera_ir::TrainingGraph, HashMap<TensorId, Value>, HashMap<TensorId, Value>);

fn mlp_setup(cfg: &TrainConfig) -> Setup {
    mlp_setup_in(cfg, DType::F32)
}

/// The MLP's training graph, state and data with weights and activations in `dtype` (the
/// interpreter computes in f64 whatever the dtype; the same seed gives the same values).
fn mlp_setup_in(cfg: &TrainConfig, dtype: DType) -> Setup {
    let mut b = Builder::new();
    let (loss, x, targets) = mlp(&mut b, dtype);
    let train = tessera_ir::build_training_graph(b, loss, cfg).unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    let mut params = HashMap::new();
    for slot in &train.params {
        let shape = train.graph.shape(slot.param).clone();
        let scale = if shape.rank() == 2 { 0.5 } else { 0.1 };
        params.insert(slot.param, Value::from_fn(shape, |_| rng.random_range(-scale..scale)));
    }
    let mut data = HashMap::new();
    data.insert(x, Value::from_fn([8, 6], |_| rng.random_range(-1.0..1.0)));
    data.insert(targets, Value::from_i64([8], &[0, 1, 2, 3, 3, 2, 1, 0]));
    let state = interp::init_train_state(&train, &params).unwrap();
    (train, state, data)
}

/// The AdamW node updating `param`.
fn adamw_node(graph: &Graph, param: TensorId) -> &tessera_ir::Node {
    graph
        .nodes
        .iter()
        .find(|n| matches!(n.op, Op::AdamW(_)) && n.inputs[0] == param)
        .expect("an AdamW node per parameter")
}

#[test]
fn adamw_step_matches_hand_formula() {
    // A small clip threshold, so the clip coefficient is active.
    let cfg = TrainConfig { max_grad_norm: Some(0.05), ..TrainConfig::default() };
    let (train, mut state, data) = mlp_setup(&cfg);
    let lr = 3e-3;
    for step in 1..=3u64 {
        let mut bindings = state.clone();
        bindings.extend(data.clone());
        bindings.insert(train.lr, Value::scalar(lr));
        bindings.insert(train.step, Value::from_i64(Shape::scalar(), &[step as i64]));
        let vals = interp::eval(&train.graph, &bindings).unwrap();

        // The global norm is the norm of all gradients together.
        let sum_sq: f64 = train
            .params
            .iter()
            .map(|s| vals[s.grad.index()].data.iter().map(|g| g * g).sum::<f64>())
            .sum();
        let grad_norm = vals[train.grad_norm.index()].item();
        assert!((grad_norm - sum_sq.sqrt()).abs() < 1e-12 * grad_norm);
        assert!(grad_norm > 0.05, "clipping should be active, norm {grad_norm}");

        // One element of a weight matrix (decayed) and one of a bias (not decayed).
        for (slot_index, k) in [(0usize, 13usize), (1, 5), (2, 7)] {
            let slot = &train.params[slot_index];
            let decay =
                if train.graph.shape(slot.param).rank() >= 2 { cfg.weight_decay } else { 0.0 };
            let w = state[&slot.param].data[k];
            let m = state[&slot.m].data[k];
            let v = state[&slot.v].data[k];
            let g = vals[slot.grad.index()].data[k] * (0.05 / (grad_norm + 1e-6));
            let m2 = cfg.beta1 * m + (1.0 - cfg.beta1) * g;
            let v2 = cfg.beta2 * v + (1.0 - cfg.beta2) * g * g;
            let m_hat = m2 / (1.0 - cfg.beta1.powi(step as i32));
            let v_hat = v2 / (1.0 - cfg.beta2.powi(step as i32));
            let w2 = w - lr * (m_hat / (v_hat.sqrt() + cfg.eps) + decay * w);
            let node = adamw_node(&train.graph, slot.param);
            let got = |i: usize| vals[node.outputs[i].index()].data[k];
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-14 * b.abs().max(1e-300);
            assert!(close(got(0), w2), "step {step}: param' {} vs {w2}", got(0));
            assert!(close(got(1), m2), "step {step}: m' {} vs {m2}", got(1));
            assert!(close(got(2), v2), "step {step}: v' {} vs {v2}", got(2));
            assert!(got(0) != w, "the parameter moved");
        }

        // Feed the update back (what train_step does), and check train_step agrees.
        let mut via_helper = state.clone();
        interp::train_step(&train, &mut via_helper, &data, lr, step).unwrap();
        for slot in &train.params {
            let node = adamw_node(&train.graph, slot.param);
            state.insert(slot.param, vals[node.outputs[0].index()].clone());
            state.insert(slot.m, vals[node.outputs[1].index()].clone());
            state.insert(slot.v, vals[node.outputs[2].index()].clone());
            for t in [slot.param, slot.m, slot.v] {
                assert_eq!(state[&t], via_helper[&t]);
            }
        }
    }
}

/// AdamW's optional `grad_scale` input: `n = grad_norm·s`, `g = min(1, max/(n+1e-6))·s·grad`,
/// and a non-finite `n` skips the update (every output equals its input).
#[test]
fn adamw_grad_scale_unscales_and_skips_on_overflow() {
    let spec = tessera_ir::AdamWSpec {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        max_grad_norm: Some(1.0),
        grad_scale: true,
    };
    let vals = |xs: &[f64]| Value::from_fn([xs.len()], |i| xs[i]);
    let (w, g, m, v) = (
        vals(&[0.5, -0.25, 1.0]),
        vals(&[64.0, -32.0, 8.0]),
        vals(&[0.01, 0.02, -0.03]),
        vals(&[1e-4, 2e-4, 3e-4]),
    );
    let master = vals(&[0.5001, -0.2501, 1.0001]);
    let (lr, step, s) = (Value::scalar(1e-2), Value::from_i64(Shape::scalar(), &[3]), 1.0 / 16.0);
    for (norm, clip_active) in [(48.0, true), (8.0, false)] {
        let (gn, gs) = (Value::scalar(norm), Value::scalar(s));
        let x = [&w, &g, &m, &v, &lr, &step, &gn, &master, &gs];
        let out = interp::eval_op(&Op::AdamW(spec.clone()), &x).unwrap();
        assert_eq!(out.len(), 4);
        let n = norm * s;
        assert_eq!(n > 1.0, clip_active);
        let c = (1.0 / (n + 1e-6)).min(1.0);
        for k in 0..3 {
            let gk = c * s * g.data[k];
            let m2 = 0.9 * m.data[k] + 0.1 * gk;
            let v2 = 0.95 * v.data[k] + 0.05 * gk * gk;
            let (mh, vh) = (m2 / (1.0 - 0.9f64.powi(3)), v2 / (1.0 - 0.95f64.powi(3)));
            let wk = master.data[k];
            let w2 = wk - 1e-2 * (mh / (vh.sqrt() + 1e-8) + 0.1 * wk);
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-14 * b.abs();
            assert!(close(out[0].data[k], w2) && close(out[3].data[k], w2), "w' {k}");
            assert!(close(out[1].data[k], m2) && close(out[2].data[k], v2), "m', v' {k}");
        }
    }
    // Overflow: inf or NaN norm (or an infinite scale) skips; everything comes back unchanged.
    for (norm, scale) in [(f64::INFINITY, s), (f64::NAN, s), (1e300, 1e300)] {
        let (gn, gs) = (Value::scalar(norm), Value::scalar(scale));
        let x = [&w, &g, &m, &v, &lr, &step, &gn, &master, &gs];
        let out = interp::eval_op(&Op::AdamW(spec.clone()), &x).unwrap();
        assert_eq!(out, vec![w.clone(), m.clone(), v.clone(), master.clone()], "norm {norm}");
    }
    // Without a master copy the scale is the last input too.
    let gn = Value::scalar(f64::INFINITY);
    let gs = Value::scalar(s);
    let out = interp::eval_op(&Op::AdamW(spec), &[&w, &g, &m, &v, &lr, &step, &gn, &gs]).unwrap();
    assert_eq!(out, vec![w.clone(), m.clone(), v.clone()]);
}

/// fp16 graphs differentiate `loss · loss_scale`: scaled gradients and norm, the same
/// unscaled loss and the same AdamW update as fp32; an overflowing scale skips the update.
#[test]
fn fp16_training_graph_scales_the_loss_and_adamw_unscales() {
    let cfg = TrainConfig { max_grad_norm: Some(0.05), ..TrainConfig::default() };
    let (t32, s32, d32) = mlp_setup_in(&cfg, DType::F32);
    let (t16, s16, d16) = mlp_setup_in(&cfg, DType::F16);
    assert!(t32.loss_scale.is_none(), "fp32 graphs take no loss scale");
    let ls = t16.loss_scale.expect("fp16 graphs take a loss scale");
    assert_eq!(t16.graph.tensor_scope(ls), "optimizer.loss_scale");
    assert_eq!(*t16.graph.meta(ls), tessera_ir::TensorMeta::new(Shape::scalar(), DType::F32));
    let run = |t: &tessera_ir::TrainingGraph,
               s: &HashMap<TensorId, Value>,
               d: &HashMap<TensorId, Value>,
               scale: Option<f64>| {
        let mut bindings = s.clone();
        bindings.extend(d.clone());
        bindings.insert(t.lr, Value::scalar(3e-3));
        bindings.insert(t.step, Value::from_i64(Shape::scalar(), &[1]));
        if let (Some(ls), Some(v)) = (t.loss_scale, scale) {
            bindings.insert(ls, Value::scalar(v));
        }
        interp::eval(&t.graph, &bindings).unwrap()
    };
    let scale = 1024.0;
    let (a, b) = (run(&t32, &s32, &d32, None), run(&t16, &s16, &d16, Some(scale)));
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-12 * y.abs().max(1e-300);
    assert!(close(b[t16.loss.index()].item(), a[t32.loss.index()].item()), "loss is unscaled");
    assert!(close(b[t16.grad_norm.index()].item(), scale * a[t32.grad_norm.index()].item()));
    for (p32, p16) in t32.params.iter().zip(&t16.params) {
        let (g32, g16) = (&a[p32.grad.index()].data, &b[p16.grad.index()].data);
        assert!(g32.iter().zip(g16).all(|(x, y)| close(*y, scale * x)), "scaled gradient");
        let (n32, n16) = (adamw_node(&t32.graph, p32.param), adamw_node(&t16.graph, p16.param));
        assert_eq!(n16.outputs.len(), 4, "param, m, v and the fp32 master");
        for k in 0..3 {
            let (x, y) = (&a[n32.outputs[k].index()].data, &b[n16.outputs[k].index()].data);
            assert!(x.iter().zip(y).all(|(x, y)| close(*y, *x)), "AdamW output {k} unscaled");
        }
    }
    // An infinite scale overflows every gradient: the update is skipped.
    let b = run(&t16, &s16, &d16, Some(f64::INFINITY));
    assert!(!b[t16.grad_norm.index()].item().is_finite());
    for p in &t16.params {
        let node = adamw_node(&t16.graph, p.param);
        let olds = [p.param, p.m, p.v, p.master.unwrap()];
        for (o, old) in node.outputs.iter().zip(olds) {
            assert_eq!(b[o.index()], s16[&old], "skipped: {}", t16.graph.tensor_scope(old));
        }
    }
}

#[test]
fn mlp_loss_decreases_over_20_steps() {
    let (train, mut state, data) = mlp_setup(&TrainConfig::default());
    let mut losses = Vec::new();
    for step in 1..=20 {
        let stats = interp::train_step(&train, &mut state, &data, 3e-2, step).unwrap();
        assert!(stats.loss.is_finite() && stats.grad_norm.is_finite());
        losses.push(stats.loss);
    }
    assert!((losses[0] - 4f64.ln()).abs() < 0.5, "initial loss {}", losses[0]);
    assert!(losses[19] < 0.6 * losses[0], "losses {losses:?}");
    assert!(losses.windows(2).filter(|w| w[1] < w[0]).count() >= 15, "losses {losses:?}");
}

/// The size the interpreter must handle quickly: batch 2, seq 8, hidden 256, 8 layers,
/// vocab 256, a few whole training steps (forward, backward, AdamW).
#[test]
fn small_transformer_training_steps() {
    let c = GptCfg { batch: 2, seq: 8, vocab: 256, hidden: 256, heads: 4, layers: 8, dropout: 0.1 };
    let mut b = Builder::new();
    let (loss, [ids, targets, seed]) = gpt(&mut b, &c).unwrap();
    let train = tessera_ir::build_training_graph(b, loss, &TrainConfig::default()).unwrap();
    let mut rng = StdRng::seed_from_u64(3);
    let mut params = HashMap::new();
    for slot in &train.params {
        let name = train.graph.tensor_scope(slot.param);
        let shape = train.graph.shape(slot.param).clone();
        let v = if name.contains("ln_") && name.ends_with("weight") {
            Value::full(shape, 1.0)
        } else if name.ends_with("bias") {
            Value::zeros(shape)
        } else {
            Value::from_fn(shape, |_| rng.random_range(-0.035..0.035))
        };
        params.insert(slot.param, v);
    }
    let mut state = interp::init_train_state(&train, &params).unwrap();
    let tokens: Vec<i64> = (0..c.batch * c.seq).map(|i| (i * 37 % c.vocab) as i64).collect();
    let mut data = HashMap::new();
    data.insert(ids, Value::from_i64([c.batch, c.seq], &tokens));
    let next: Vec<i64> = tokens.iter().map(|&t| (t + 1) % c.vocab as i64).collect();
    data.insert(targets, Value::from_i64([c.batch, c.seq], &next));
    data.insert(seed, Value::from_i64(Shape::scalar(), &[5]));

    let start = std::time::Instant::now();
    let mut losses = Vec::new();
    for step in 1..=3 {
        let stats = interp::train_step(&train, &mut state, &data, 1e-3, step).unwrap();
        losses.push(stats.loss);
    }
    let per_step = start.elapsed() / 3;
    eprintln!("interpreted training step (8 layers, hidden 256): {per_step:?}; losses {losses:?}");
    assert!((losses[0] - (c.vocab as f64).ln()).abs() < 0.3, "initial loss {}", losses[0]);
    assert!(losses[2] < losses[0], "losses {losses:?}");
}

#[test]
fn unbound_leaf_is_named() {
    let mut b = Builder::new();
    let x = b.scoped("encoder", |b| b.parameter("weight", [2, 2], DType::F32));
    let y = b.unary(U::Exp, x).unwrap();
    let err = interp::eval_outputs(&b.graph, &HashMap::new(), &[y]).unwrap_err();
    assert!(err.to_string().contains("encoder.weight"), "{err}");
    let mut bad = HashMap::new();
    bad.insert(x, Value::zeros([4]));
    let err = interp::eval(&b.graph, &bad).unwrap_err();
    assert!(err.to_string().contains("encoder.weight") && err.to_string().contains("[4]"), "{err}");
}
