//! The CPU kernels of the mixture-of-experts routing ops against the f64 reference
//! interpreter (`tessera_ir::interp::eval_op`): each op on hand-made cases (ties, drops,
//! dropless, weighted and not, non-contiguous inputs, bad indices), then every node of a
//! whole routed-experts layer's forward and backward graph (Mixtral router, capacity with
//! drops, the load-balancing loss) fed the interpreter's values rounded to f32.
//!
//! Tolerance: with `b` the reference, `|a − b| ≤ 1e-5 · (|b| + 1e-3 · min(1, max|b|))`
//! elementwise (the MoE kernels accumulate in f64: one f32 rounding) and exact for integer
//! outputs; the dense ops of the layer (matmuls, activations) get a floor of `1e-2·max|b|`
//! for their f32 cancellation near zero.

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use tessera_ir::interp::{self, Value};
use tessera_ir::moe::{self, ExpertWeights, RouterSpec};
use tessera_ir::{Builder, DType, Op, Shape, TensorId, TensorMeta};
use tessera_runtime::kernels;
use tessera_runtime::tensor::{meta_of, to_f64_vec};
use tessera_runtime::RuntimeError;

fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xbf58_476d);
            ((h >> 11) % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn f32t(v: Vec<f32>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn i64t(v: &[i64], dims: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), dims, &Device::Cpu).unwrap()
}

fn value(t: &Tensor) -> Value {
    Value::new(Shape::from(t.dims().to_vec()), to_f64_vec(t).unwrap())
}

fn run(op: &Op, x: &[&Tensor]) -> std::result::Result<Vec<Tensor>, RuntimeError> {
    let metas: Vec<TensorMeta> = x.iter().map(|t| meta_of(t).unwrap()).collect();
    let refs: Vec<&TensorMeta> = metas.iter().collect();
    let out = op.infer(&refs).unwrap();
    kernels::execute(op, x, &out)
}

/// Kernel vs interpreter on the same values: `|a − b| ≤ 1e-5·(|b| + floor)`, with
/// `floor = 1e-3·min(1, max|b|)` for the MoE kernels, `1e-2·max|b|` for dense ones.
fn close(a: &Tensor, b: &Value, dense: bool, what: &str) {
    let av = to_f64_vec(a).unwrap();
    assert_eq!(a.dims(), b.dims(), "{what}: shape");
    let scale = b.data.iter().fold(0f64, |m, x| m.max(x.abs()));
    let integer = matches!(meta_of(a).unwrap().dtype, DType::I64);
    for (k, (x, y)) in av.iter().zip(&b.data).enumerate() {
        if integer || y.is_nan() {
            assert!(x == y || (x.is_nan() && y.is_nan()), "{what}[{k}]: {x} vs {y} (exact)");
        } else {
            let floor = if dense { 1e-2 * scale } else { 1e-3 * scale.min(1.0) };
            let tol = 1e-5 * (y.abs() + floor);
            assert!((x - y).abs() <= tol, "{what}[{k}]: {x} vs {y}");
        }
    }
}

/// Runs `op` on the kernel and the interpreter and compares every output.
fn check(op: &Op, x: &[&Tensor]) -> Vec<Tensor> {
    let got = run(op, x).unwrap_or_else(|e| panic!("{}: {e}", op.name()));
    let vals: Vec<Value> = x.iter().map(|t| value(t)).collect();
    let refs: Vec<&Value> = vals.iter().collect();
    let want = interp::eval_op(op, &refs).unwrap();
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        close(a, b, false, &format!("{} output {i}", op.name()));
    }
    got
}

#[test]
fn top_k_and_the_gathers() {
    // Ties (3.0 three times, ±0) and a NaN; a non-contiguous operand (a transpose).
    let x =
        f32t(vec![1., 3., 3., 2., 3., 0., -0., 0., -1., -0., 2., f32::NAN, 5., 5., 1.], &[3, 5]);
    let y = check(&Op::TopK { k: 3 }, &[&x]);
    assert_eq!(
        y[1].flatten_all().unwrap().to_vec1::<i64>().unwrap(),
        vec![1, 2, 4, 0, 1, 2, 1, 2, 3]
    );
    let big = f32t(values(33 * 40, 1), &[40, 33]).t().unwrap();
    assert!(!big.is_contiguous());
    let y = check(&Op::TopK { k: 4 }, &[&big]);
    check(&Op::TakeAlong, &[&big, &y[1]]);
    let src = f32t(values(33 * 4, 2), &[33, 4]);
    check(&Op::ScatterAlong { size: 40 }, &[&y[1], &src]);
    let rep = i64t(&[1, 1, 0, 2, 2, 2], &[2, 3]);
    check(&Op::ScatterAlong { size: 3 }, &[&rep, &f32t(values(6, 3), &[2, 3])]);
    let bad = i64t(&[0, 5], &[1, 2]);
    assert!(run(&Op::TakeAlong, &[&f32t(values(4, 4), &[1, 4]), &bad]).is_err());
    assert!(run(&Op::ScatterAlong { size: 4 }, &[&bad, &f32t(values(2, 4), &[1, 2])]).is_err());
}

#[test]
fn slots_dispatch_combine_and_dots() {
    let (n, k, e, h) = (37usize, 2usize, 5usize, 9usize);
    let mut ids = Vec::new();
    for t in 0..n {
        let a = (t * 7 + t / 3) % e;
        ids.extend([a as i64, ((a + 1 + t % 3) % e) as i64]);
    }
    let idx = i64t(&ids, &[n, k]);
    let x = f32t(values(n * h, 5), &[n, h]);
    let w = f32t(values(n * k, 6), &[n, k]);
    for cap in [3, moe::capacity(n, k, e, Some(1.25)), n] {
        let op = Op::MoeSlots { experts: e, capacity: cap };
        let slots = check(&op, &[&idx]).remove(0);
        let drops = to_f64_vec(&slots).unwrap().iter().filter(|&&s| s < 0.0).count();
        assert_eq!(drops > 0, cap < n / 2, "capacity {cap}: {drops} drops");
        let d = Op::MoeDispatch { experts: e, capacity: cap };
        let buf = check(&d, &[&x, &slots]).remove(0);
        check(&d, &[&x, &slots, &w]);
        check(&Op::MoeCombine, &[&buf, &slots]);
        check(&Op::MoeCombine, &[&buf, &slots, &w]);
        check(&Op::MoeSlotDot, &[&buf, &x, &slots]);
    }
    // A slot used twice and an expert out of range are errors, not silent overwrites.
    let twice = i64t(&[0, 0], &[2, 1]);
    let d = Op::MoeDispatch { experts: 1, capacity: 2 };
    assert!(run(&d, &[&f32t(values(2, 7), &[2, 1]), &twice]).is_err());
    assert!(run(&Op::MoeSlots { experts: 2, capacity: 2 }, &[&i64t(&[2], &[1, 1])]).is_err());
}

/// A routed-experts layer (Mixtral router from the tokens, capacity factor 1.0, SwiGLU
/// experts) with a sum-of-squares loss plus 0.02 × the load-balancing loss, differentiated:
/// (graph, loss, parameters, their gradients).
fn layer_graph() -> (tessera_ir::Graph, TensorId, Vec<TensorId>, Vec<TensorId>) {
    let (n, h, f, e, k) = (24usize, 8usize, 6usize, 4usize, 2usize);
    let mut b = Builder::new();
    let x = b.parameter("x", [n, h], DType::F32);
    let wr = b.parameter("router", [h, e], DType::F32);
    let gate = b.parameter("gate", [e, h, f], DType::F32);
    let up = b.parameter("up", [e, h, f], DType::F32);
    let down = b.parameter("down", [e, f, h], DType::F32);
    let logits = b.matmul(x, wr, false, false).unwrap();
    let r = moe::route(&mut b, logits, &RouterSpec::mixtral(e, k), None).unwrap();
    let cap = moe::capacity(n, k, e, Some(1.0));
    let y = moe::routed_experts(
        &mut b,
        x,
        &r,
        &ExpertWeights { gate, up, down, linear_layout: false },
        cap,
    )
    .unwrap();
    let sq = b.mul(y, y).unwrap();
    let l = b.reduce(tessera_ir::ReduceOp::Sum, sq, &[0, 1], false).unwrap();
    let aux = moe::load_balancing_loss(&mut b, &[logits], k).unwrap();
    let aux = b.scale(aux, 0.02).unwrap();
    let loss = b.add(l, aux).unwrap();
    let params = vec![x, wr, gate, up, down];
    let grads = tessera_ir::gradients(&mut b, loss, &params).unwrap();
    let grads = grads.into_iter().map(|g| g.expect("every parameter has a gradient")).collect();
    (b.finish(), loss, params, grads)
}

/// Parameter `i`'s values.
fn param_values(shape: &Shape, i: usize) -> Vec<f32> {
    values(shape.numel() as usize, 10 + i as u64)
}

/// Every node of the layer's forward and backward graph: the kernel on the interpreter's
/// values (rounded to f32) against the interpreter on the same values.
#[test]
fn a_whole_layer_node_by_node() {
    let (g, _, params, _) = layer_graph();

    let mut bind: HashMap<TensorId, Value> = HashMap::new();
    for (i, &p) in params.iter().enumerate() {
        let shape = g.shape(p).clone();
        let v: Vec<f64> = param_values(&shape, i).iter().map(|&v| v as f64).collect();
        bind.insert(p, Value::new(shape, v));
    }
    let all = interp::eval(&g, &bind).unwrap();
    let mut moe_nodes = 0;
    let mut dropped = false;
    for node in &g.nodes {
        if node.op.is_leaf() && !matches!(node.op, Op::Fill { .. }) {
            continue;
        }
        // Inputs rounded to f32 (integers stay exact).
        let ins: Vec<Tensor> = node
            .inputs
            .iter()
            .map(|&t| {
                let v = &all[t.index()];
                match g.meta(t).dtype {
                    DType::I64 => {
                        i64t(&v.data.iter().map(|&d| d as i64).collect::<Vec<_>>(), v.dims())
                    }
                    _ => f32t(v.data.iter().map(|&d| d as f32).collect(), v.dims()),
                }
            })
            .collect();
        let refs: Vec<&Tensor> = ins.iter().collect();
        let out: Vec<TensorMeta> = node.outputs.iter().map(|&t| g.meta(t).clone()).collect();
        let got = kernels::execute(&node.op, &refs, &out)
            .unwrap_or_else(|err| panic!("{}: {err}", node.op.name()));
        let vals: Vec<Value> = ins.iter().map(value).collect();
        let vrefs: Vec<&Value> = vals.iter().collect();
        let want = interp::eval_op(&node.op, &vrefs).unwrap();
        let is_moe = matches!(
            node.op,
            Op::TopK { .. }
                | Op::TakeAlong
                | Op::ScatterAlong { .. }
                | Op::MoeSlots { .. }
                | Op::MoeDispatch { .. }
                | Op::MoeCombine
                | Op::MoeSlotDot
        );
        moe_nodes += usize::from(is_moe);
        if let Op::MoeSlots { .. } = node.op {
            dropped = want[0].data.iter().any(|&s| s < 0.0);
        }
        for (i, (a, w)) in got.iter().zip(&want).enumerate() {
            close(a, w, !is_moe, &format!("{} output {i}", node.op.name()));
        }
    }
    assert!(dropped, "capacity factor 1.0 must drop some assignment here");
    // Forward: top-k ×2 (router, aux), take_along, slots, dispatch, combine, scatter (counts);
    // backward: scatter (top-k), dispatch (combine's rows), slot dot (weights), combine.
    assert!(moe_nodes >= 10, "{moe_nodes} MoE nodes");
}

/// The standing promise for the new ops: the executor's measured peak equals the peak the
/// profiler predicts from the same Program, whose dispatch buffers are `[E, C, H]`.
#[test]
fn measured_peak_equals_the_programs() {
    let (g, loss, params, grads) = layer_graph();
    let buffers: u64 = g
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::MoeDispatch { .. }))
        .map(|n| g.meta(n.outputs[0]).size_bytes())
        .sum();
    // Forward: 4 experts × capacity 12 × hidden 8 × 4 bytes; backward: the same again.
    assert_eq!(buffers, 2 * 4 * 12 * 8 * 4);
    let program = tessera_ir::Program::lower_graph(g, vec![loss], &grads);
    let predicted = tessera_profile::simulate_memory(&program).report.peak_bytes;
    let shapes: Vec<Shape> = params.iter().map(|&p| program.graph().shape(p).clone()).collect();
    let backend = tessera_runtime::CpuBackend::default();
    let mut ex = tessera_runtime::Executor::new(program, backend, None);
    for (i, (&p, shape)) in params.iter().zip(&shapes).enumerate() {
        ex.bind(p, f32t(param_values(shape, i), shape.dims())).unwrap();
    }
    ex.run().unwrap();
    assert_eq!(ex.accountant().peak_bytes(), predicted);
    assert!(predicted >= buffers / 2);
}
