//! The mixture-of-experts routing ops (`tessera_ir::ops::moe`) and the graphs built from them
//! (`tessera_ir::moe`), in the f64 reference interpreter: shape inference and its errors,
//! top-k's tie rule, the capacity's drop order, VJPs against central finite differences,
//! dispatch → expert matmuls → combine against a dense per-token loop (dropless and with
//! drops), FLOP formulas, and the Mixtral and DeepSeek-V3 routers, transformers' load-balancing
//! loss and DeepSeek-V3's bias update against direct Rust computations.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use tessera_ir::interp::{self, Value};
use tessera_ir::moe::{self, ExpertWeights, RouterSpec};
use tessera_ir::ops::ReduceOp as R;
use tessera_ir::{Builder, DType, Op, Result, TensorId, TensorMeta};

// ---- helpers --------------------------------------------------------------------------------

fn meta(dims: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta::new(dims.to_vec(), dtype)
}

fn infer(op: &Op, x: &[TensorMeta]) -> std::result::Result<Vec<TensorMeta>, String> {
    let refs: Vec<&TensorMeta> = x.iter().collect();
    op.infer(&refs)
}

fn eval(op: &Op, x: &[&Value]) -> Vec<Value> {
    interp::eval_op(op, x).unwrap_or_else(|e| panic!("{}: {e}", op.name()))
}

fn ints(dims: &[usize], v: &[i64]) -> Value {
    Value::from_i64(dims.to_vec(), v)
}

fn rand_vec(r: &mut StdRng, n: usize) -> Vec<f64> {
    (0..n).map(|_| r.random_range(-1.0..1.0)).collect()
}

/// The top-k rule: larger first, equal values by lower index.
fn ref_top_k(row: &[f64], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&i, &j| row[j].partial_cmp(&row[i]).unwrap());
    order.truncate(k);
    order
}

fn softmax(row: &[f64]) -> Vec<f64> {
    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = row.iter().map(|v| (v - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

fn sigmoid(v: f64) -> f64 {
    1.0 / (1.0 + (-v).exp())
}

fn assert_close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
    }
}

/// A graph under construction with its leaf values.
struct Case {
    b: Builder,
    rng: StdRng,
    bind: HashMap<TensorId, Value>,
}

impl Case {
    fn new(seed: u64) -> Case {
        Case { b: Builder::new(), rng: StdRng::seed_from_u64(seed), bind: HashMap::new() }
    }
    fn leaf(&mut self, param: bool, dims: &[usize], dtype: DType, v: Value) -> TensorId {
        let name = format!("t{}", self.bind.len());
        let t = if param {
            self.b.parameter(&name, dims.to_vec(), dtype)
        } else {
            self.b.input(&name, dims.to_vec(), dtype)
        };
        self.bind.insert(t, v);
        t
    }
    fn param(&mut self, dims: &[usize]) -> TensorId {
        let v = rand_vec(&mut self.rng, dims.iter().product());
        self.leaf(true, dims, DType::F64, Value::new(dims.to_vec(), v))
    }
    fn input(&mut self, dims: &[usize], v: Vec<f64>) -> TensorId {
        self.leaf(false, dims, DType::F64, Value::new(dims.to_vec(), v))
    }
    fn ids(&mut self, dims: &[usize], v: &[i64]) -> TensorId {
        self.leaf(false, dims, DType::I64, ints(dims, v))
    }
    fn eval(self, outs: &[TensorId]) -> Vec<Value> {
        let g = self.b.finish();
        interp::eval_outputs(&g, &self.bind, outs).unwrap()
    }
}

/// Differentiates `Σ_i sum(out_i ⊙ w_i)` (fixed random `w_i`) with respect to every parameter
/// and checks each gradient against central differences, `‖a − n‖ / ‖n‖ < 1e-6`.
fn check_vjp(name: &str, seed: u64, build: impl FnOnce(&mut Case) -> Result<Vec<TensorId>>) {
    let mut cx = Case::new(seed);
    let outs = build(&mut cx).unwrap_or_else(|e| panic!("{name}: {e}"));
    let params = cx.b.graph.parameters();
    assert!(!params.is_empty(), "{name}: no parameters");
    let mut loss: Option<TensorId> = None;
    for &out in &outs {
        let shape = cx.b.shape(out).clone();
        let w = rand_vec(&mut cx.rng, shape.numel() as usize);
        let w = cx.input(shape.dims(), w);
        let prod = cx.b.mul(out, w).unwrap();
        let all: Vec<usize> = (0..shape.rank()).collect();
        let term = cx.b.reduce(R::Sum, prod, &all, false).unwrap();
        loss = Some(match loss {
            Some(l) => cx.b.add(l, term).unwrap(),
            None => term,
        });
    }
    let loss = loss.expect("outputs");
    let grads = tessera_ir::gradients(&mut cx.b, loss, &params).unwrap();
    let graph = cx.b.finish();
    let mut bind = cx.bind;
    let values = interp::eval(&graph, &bind).unwrap_or_else(|e| panic!("{name}: {e}"));
    let loss_at =
        |b: &HashMap<TensorId, Value>| interp::eval_outputs(&graph, b, &[loss]).unwrap()[0].item();
    for (&p, g) in params.iter().zip(&grads) {
        let g = g.unwrap_or_else(|| panic!("{name}: no gradient for a parameter"));
        let analytic = values[g.index()].data.clone();
        let mut numeric = vec![0.0; analytic.len()];
        for (k, n) in numeric.iter_mut().enumerate() {
            let x0 = bind[&p].data[k];
            let h = 1e-5 * x0.abs().max(1.0);
            bind.get_mut(&p).unwrap().data[k] = x0 + h;
            let up = loss_at(&bind);
            bind.get_mut(&p).unwrap().data[k] = x0 - h;
            let down = loss_at(&bind);
            bind.get_mut(&p).unwrap().data[k] = x0;
            *n = (up - down) / (2.0 * h);
        }
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        let diff: Vec<f64> = analytic.iter().zip(&numeric).map(|(a, n)| a - n).collect();
        let nn = norm(&numeric);
        assert!(nn > 1e-6, "{name}: a gradient is ~0 ({nn:e}); the check would be vacuous");
        let err = norm(&diff) / nn;
        assert!(err < 1e-6, "{name}: off by {err:e}\n{analytic:?}\n{numeric:?}");
    }
}

// ---- shapes ---------------------------------------------------------------------------------

#[test]
fn shape_inference_and_errors() {
    let (f, f32_, i) = (DType::F64, DType::F32, DType::I64);
    let y = infer(&Op::TopK { k: 2 }, &[meta(&[3, 4, 5], f32_)]).unwrap();
    assert_eq!(y, vec![meta(&[3, 4, 2], f32_), meta(&[3, 4, 2], i)]);
    assert!(infer(&Op::TopK { k: 0 }, &[meta(&[3, 5], f)]).is_err());
    assert!(infer(&Op::TopK { k: 6 }, &[meta(&[3, 5], f)]).unwrap_err().contains("1..=5"));
    assert!(infer(&Op::TopK { k: 1 }, &[meta(&[3, 5], i)]).is_err());
    assert!(infer(&Op::TopK { k: 1 }, &[meta(&[], f)]).is_err());

    let y = infer(&Op::TakeAlong, &[meta(&[3, 5], f), meta(&[3, 2], i)]).unwrap();
    assert_eq!(y, vec![meta(&[3, 2], f)]);
    assert!(infer(&Op::TakeAlong, &[meta(&[3, 5], f), meta(&[4, 2], i)]).is_err());
    assert!(infer(&Op::TakeAlong, &[meta(&[3, 5], f), meta(&[3, 2], f)]).is_err());

    let y = infer(&Op::ScatterAlong { size: 7 }, &[meta(&[3, 2], i), meta(&[3, 2], f)]).unwrap();
    assert_eq!(y, vec![meta(&[3, 7], f)]);
    assert!(infer(&Op::ScatterAlong { size: 7 }, &[meta(&[3, 2], i), meta(&[3, 3], f)]).is_err());

    let slots = Op::MoeSlots { experts: 4, capacity: 3 };
    assert_eq!(infer(&slots, &[meta(&[6, 2], i)]).unwrap(), vec![meta(&[6, 2], i)]);
    assert!(infer(&slots, &[meta(&[12], i)]).is_err());
    assert!(infer(&slots, &[meta(&[6, 2], f)]).is_err());
    assert!(infer(&Op::MoeSlots { experts: 4, capacity: 0 }, &[meta(&[6, 2], i)]).is_err());

    let d = Op::MoeDispatch { experts: 4, capacity: 3 };
    let x = meta(&[6, 8], f32_);
    let s = meta(&[6, 2], i);
    assert_eq!(infer(&d, &[x.clone(), s.clone()]).unwrap(), vec![meta(&[4, 3, 8], f32_)]);
    assert!(infer(&d, &[x.clone(), s.clone(), meta(&[6, 2], f32_)]).is_ok());
    assert!(infer(&d, &[x.clone(), s.clone(), meta(&[6, 3], f32_)]).is_err());
    assert!(infer(&d, &[x.clone(), s.clone(), meta(&[6, 2], f)]).is_err());
    assert!(infer(&d, &[meta(&[5, 8], f32_), s.clone()]).unwrap_err().contains("token count"));
    assert!(infer(&d, std::slice::from_ref(&x)).is_err());

    let ybuf = meta(&[4, 3, 8], f32_);
    let w = meta(&[6, 2], f32_);
    assert_eq!(
        infer(&Op::MoeCombine, &[ybuf.clone(), s.clone(), w.clone()]).unwrap(),
        vec![meta(&[6, 8], f32_)]
    );
    assert!(infer(&Op::MoeCombine, &[meta(&[12, 8], f32_), s.clone()]).is_err());
    assert!(infer(&Op::MoeCombine, &[ybuf.clone(), meta(&[6, 2], f32_)]).is_err());

    assert_eq!(
        infer(&Op::MoeSlotDot, &[ybuf.clone(), x.clone(), s.clone()]).unwrap(),
        vec![meta(&[6, 2], f32_)]
    );
    assert!(infer(&Op::MoeSlotDot, &[ybuf, meta(&[6, 7], f32_), s]).is_err());
}

#[test]
fn capacity_from_a_factor() {
    assert_eq!(moe::capacity(8, 2, 4, Some(1.0)), 4);
    assert_eq!(moe::capacity(8, 2, 4, Some(1.25)), 5);
    assert_eq!(moe::capacity(8, 2, 4, Some(0.01)), 1);
    assert_eq!(moe::capacity(8, 2, 4, Some(10.0)), 8, "capped at the token count");
    assert_eq!(moe::capacity(8, 2, 4, None), 8, "dropless: every token fits");
}

// ---- semantics ------------------------------------------------------------------------------

#[test]
fn top_k_breaks_ties_by_expert_index() {
    let x = Value::new(
        [3, 5],
        vec![
            1.0,
            3.0,
            3.0,
            2.0,
            3.0, //
            0.0,
            -0.0,
            0.0,
            -1.0,
            -0.0, //
            2.0,
            f64::NAN,
            5.0,
            5.0,
            1.0,
        ],
    );
    let y = eval(&Op::TopK { k: 3 }, &[&x]);
    assert_eq!(y[1].data, vec![1.0, 2.0, 4.0, 0.0, 1.0, 2.0, 1.0, 2.0, 3.0]);
    assert_eq!(&y[0].data[..6], &[3.0, 3.0, 3.0, 0.0, -0.0, 0.0]);
    assert!(y[0].data[6].is_nan() && y[0].data[7] == 5.0 && y[0].data[8] == 5.0);
}

#[test]
fn gathers_and_scatters_along_the_last_dim() {
    let x = Value::new([2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let idx = ints(&[2, 2], &[2, 0, 1, 1]);
    assert_eq!(eval(&Op::TakeAlong, &[&x, &idx])[0].data, vec![3.0, 1.0, 5.0, 5.0]);
    let src = Value::new([2, 2], vec![1.0, 2.0, 3.0, 4.0]);
    let y = eval(&Op::ScatterAlong { size: 3 }, &[&idx, &src]);
    assert_eq!(y[0].data, vec![2.0, 0.0, 1.0, 0.0, 7.0, 0.0], "repeated indices add");
    assert!(interp::eval_op(&Op::TakeAlong, &[&x, &ints(&[2, 1], &[0, 3])]).is_err());
}

#[test]
fn capacity_drops_assignments_in_token_order() {
    // 5 tokens, top-2 of 3 experts, capacity 2.
    let idx = ints(&[5, 2], &[0, 1, 2, 0, 0, 1, 1, 2, 0, 2]);
    let slots = eval(&Op::MoeSlots { experts: 3, capacity: 2 }, &[&idx])[0].data.clone();
    // Expert 0 takes tokens 0 and 1 (slots 0, 1), drops tokens 2 and 4; expert 1 takes
    // tokens 0 and 2 (slots 2, 3), drops token 3; expert 2 takes tokens 1 and 3 (slots 4, 5),
    // drops token 4.
    assert_eq!(slots, vec![0.0, 2.0, 4.0, 1.0, -1.0, 3.0, -1.0, 5.0, -1.0, -1.0]);
    // Dropless: capacity = tokens keeps every assignment.
    let all = eval(&Op::MoeSlots { experts: 3, capacity: 5 }, &[&idx])[0].data.clone();
    assert!(all.iter().all(|&s| s >= 0.0));
    assert!(interp::eval_op(&Op::MoeSlots { experts: 2, capacity: 2 }, &[&idx]).is_err());

    // Dispatch writes each kept assignment's row; padding stays zero; combine reads them back.
    let x = Value::from_fn([5, 2], |k| k as f64 + 1.0);
    let sv = Value::new([5, 2], slots);
    let buf = eval(&Op::MoeDispatch { experts: 3, capacity: 2 }, &[&x, &sv]);
    assert_eq!(buf[0].data, vec![1., 2., 3., 4., 1., 2., 5., 6., 3., 4., 7., 8.]);
    let w = Value::new([5, 2], vec![0.5, 0.25, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    let out = eval(&Op::MoeCombine, &[&buf[0], &sv, &w]);
    // Token 0: 0.5·x0 + 0.25·x0; token 4: both dropped.
    assert_eq!(out[0].data, vec![0.75, 1.5, 9.0, 12.0, 20.0, 24.0, 42.0, 48.0, 0.0, 0.0]);
    let twice = Value::new([5, 2], vec![0.0, 0.0, -1., -1., -1., -1., -1., -1., -1., -1.]);
    assert!(interp::eval_op(&Op::MoeDispatch { experts: 3, capacity: 2 }, &[&x, &twice]).is_err());
}

// ---- the layer against a dense loop ------------------------------------------------------

struct Layer {
    n: usize,
    h: usize,
    f: usize,
    e: usize,
    k: usize,
    x: Vec<f64>,
    logits: Vec<f64>,
    gate: Vec<f64>,
    up: Vec<f64>,
    down: Vec<f64>,
}

impl Layer {
    fn random(seed: u64, n: usize, h: usize, f: usize, e: usize, k: usize) -> Layer {
        let mut r = StdRng::seed_from_u64(seed);
        Layer {
            n,
            h,
            f,
            e,
            k,
            x: rand_vec(&mut r, n * h),
            logits: rand_vec(&mut r, n * e),
            gate: rand_vec(&mut r, e * h * f),
            up: rand_vec(&mut r, e * h * f),
            down: rand_vec(&mut r, e * f * h),
        }
    }

    /// Token `t` through expert `e`'s SwiGLU.
    fn expert(&self, e: usize, t: usize) -> Vec<f64> {
        let (h, f) = (self.h, self.f);
        let xt = &self.x[t * h..(t + 1) * h];
        let mut a = vec![0.0; f];
        for (j, aj) in a.iter_mut().enumerate() {
            let g: f64 = (0..h).map(|i| xt[i] * self.gate[(e * h + i) * f + j]).sum();
            let u: f64 = (0..h).map(|i| xt[i] * self.up[(e * h + i) * f + j]).sum();
            *aj = g * sigmoid(g) * u;
        }
        (0..h).map(|o| (0..f).map(|j| a[j] * self.down[(e * f + j) * h + o]).sum()).collect()
    }

    /// The dense reference: each token through its top-k experts, weighted, with the stated
    /// drops (an expert takes its first `capacity` tokens in token order).
    fn reference(&self, capacity: usize) -> (Vec<f64>, usize) {
        let mut out = vec![0.0; self.n * self.h];
        let mut used = vec![0usize; self.e];
        let mut dropped = 0;
        for t in 0..self.n {
            let p = softmax(&self.logits[t * self.e..(t + 1) * self.e]);
            let top = ref_top_k(&p, self.k);
            let s: f64 = top.iter().map(|&e| p[e]).sum();
            for &e in &top {
                used[e] += 1;
                if used[e] > capacity {
                    dropped += 1;
                    continue;
                }
                for (o, v) in out[t * self.h..(t + 1) * self.h].iter_mut().zip(self.expert(e, t)) {
                    *o += p[e] / s * v;
                }
            }
        }
        (out, dropped)
    }

    fn graph(&self, capacity: usize) -> Vec<f64> {
        let (n, h, f, e) = (self.n, self.h, self.f, self.e);
        let mut cx = Case::new(0);
        let x = cx.input(&[n, h], self.x.clone());
        let logits = cx.input(&[n, e], self.logits.clone());
        let gate = cx.input(&[e, h, f], self.gate.clone());
        let up = cx.input(&[e, h, f], self.up.clone());
        let down = cx.input(&[e, f, h], self.down.clone());
        let r = moe::route(&mut cx.b, logits, &RouterSpec::mixtral(e, self.k), None).unwrap();
        let w = ExpertWeights { gate, up, down, linear_layout: false };
        let y = moe::routed_experts(&mut cx.b, x, &r, &w, capacity).unwrap();
        cx.eval(&[y]).remove(0).data
    }
}

#[test]
fn dispatch_experts_combine_equal_a_dense_loop() {
    let l = Layer::random(7, 12, 6, 5, 4, 2);
    let (want, dropped) = l.reference(l.n);
    assert_eq!(dropped, 0);
    assert_close(&l.graph(l.n), &want, 1e-12, "dropless");
    // Capacity factor 1.0: 12·2/4 = 6 per expert; random routing overflows some expert.
    let c = moe::capacity(l.n, l.k, l.e, Some(1.0));
    let (want, dropped) = l.reference(c);
    assert!(dropped > 0, "the case must drop something");
    assert_close(&l.graph(c), &want, 1e-12, "capacity 6");
    let (want, dropped) = l.reference(2);
    assert!(dropped > 8);
    assert_close(&l.graph(2), &want, 1e-12, "capacity 2");
}

impl Layer {
    /// The layer on `groups` routing groups of `n / groups` tokens each (`[G, n/G, ·]`).
    fn grouped(&self, groups: usize, capacity: usize) -> Vec<f64> {
        let (n, h, f, e) = (self.n, self.h, self.f, self.e);
        let mut cx = Case::new(0);
        let x = cx.input(&[groups, n / groups, h], self.x.clone());
        let logits = cx.input(&[groups, n / groups, e], self.logits.clone());
        let gate = cx.input(&[e, h, f], self.gate.clone());
        let up = cx.input(&[e, h, f], self.up.clone());
        let down = cx.input(&[e, f, h], self.down.clone());
        let r = moe::route(&mut cx.b, logits, &RouterSpec::mixtral(e, self.k), None).unwrap();
        let w = ExpertWeights { gate, up, down, linear_layout: false };
        let y = moe::routed_experts(&mut cx.b, x, &r, &w, capacity).unwrap();
        cx.eval(&[y]).remove(0).data
    }

    /// Tokens `lo..hi` as a layer of their own.
    fn rows(&self, lo: usize, hi: usize) -> Layer {
        Layer {
            n: hi - lo,
            x: self.x[lo * self.h..hi * self.h].to_vec(),
            logits: self.logits[lo * self.e..hi * self.e].to_vec(),
            gate: self.gate.clone(),
            up: self.up.clone(),
            down: self.down.clone(),
            ..*self
        }
    }
}

/// Routing per group: each group's capacity sees only its own tokens, so the grouped layer
/// equals every group run alone — what lets a plan split the groups over devices and drop
/// exactly what one device drops.
#[test]
fn each_routing_group_drops_as_if_alone() {
    let l = Layer::random(11, 12, 6, 5, 4, 2);
    for capacity in [4usize, 2, 1] {
        let grouped = l.grouped(3, capacity);
        let mut alone = Vec::new();
        for g in 0..3 {
            let part = l.rows(4 * g, 4 * g + 4);
            let (want, _) = part.reference(capacity);
            alone.extend(want);
        }
        assert_close(&grouped, &alone, 1e-12, &format!("3 groups, capacity {capacity}"));
    }
    // One group is the ungrouped layer.
    assert_close(&l.grouped(1, 5), &l.graph(5), 1e-12, "one group");
}

#[test]
fn flops_and_memory_follow_the_capacity() {
    let (n, h, f, e, k, c) = (12usize, 6usize, 5usize, 4usize, 2usize, 5usize);
    let x = meta(&[n, h], DType::F32);
    let s = meta(&[n, k], DType::I64);
    let w = meta(&[n, k], DType::F32);
    let buf = meta(&[e, c, h], DType::F32);
    let fl = |op: &Op, x: &[&TensorMeta]| {
        let y = op.infer(x).unwrap();
        let yr: Vec<&TensorMeta> = y.iter().collect();
        op.flops(x, &yr)
    };
    let lg = meta(&[n, e], DType::F32);
    assert_eq!(fl(&Op::TopK { k }, &[&lg]).other, (n * e * k) as u64);
    assert_eq!(fl(&Op::MoeDispatch { experts: e, capacity: c }, &[&x, &s]).total(), 0);
    let wd = fl(&Op::MoeDispatch { experts: e, capacity: c }, &[&x, &s, &w]);
    assert_eq!(wd.other, (n * k * h) as u64);
    assert_eq!(fl(&Op::MoeCombine, &[&buf, &s, &w]).other, (2 * n * k * h) as u64);
    assert_eq!(fl(&Op::MoeCombine, &[&buf, &s]).other, (n * k * h) as u64);
    assert_eq!(fl(&Op::MoeSlotDot, &[&buf, &x, &s]).other, (2 * n * k * h) as u64);
    assert_eq!(fl(&Op::ScatterAlong { size: e }, &[&s, &w]).other, (n * k) as u64);
    // The experts: a batched matmul over E, counted on every capacity row.
    let wg = meta(&[e, h, f], DType::F32);
    let mm = fl(&Op::MatMul { trans_a: false, trans_b: false }, &[&buf, &wg]);
    assert_eq!(mm.matmul, (2 * e * c * h * f) as u64);
    // The Program holds the whole buffer: its bytes are the capacity's.
    let y = Op::MoeDispatch { experts: e, capacity: c }.infer(&[&x, &s]).unwrap();
    assert_eq!(y[0].size_bytes(), (e * c * h * 4) as u64);
}

// ---- VJPs -----------------------------------------------------------------------------------

#[test]
fn vjps_against_finite_differences() {
    check_vjp("top_k", 1, |c| {
        let x = c.param(&[3, 6]);
        Ok(vec![c.b.top_k(x, 3)?.0])
    });
    check_vjp("take_along", 2, |c| {
        let x = c.param(&[3, 4]);
        let idx = c.ids(&[3, 2], &[3, 0, 1, 1, 2, 0]);
        Ok(vec![c.b.take_along(x, idx)?])
    });
    check_vjp("scatter_along", 3, |c| {
        let src = c.param(&[3, 2]);
        let idx = c.ids(&[3, 2], &[3, 0, 1, 1, 2, 0]);
        Ok(vec![c.b.scatter_along(idx, src, 4)?])
    });
    // 4 tokens, top-2 of 3 experts, capacity 2: tokens 2 and 3 lose a choice each.
    let routes = [0i64, 1, 1, 0, 0, 2, 0, 1];
    for weighted in [false, true] {
        check_vjp(&format!("dispatch weighted={weighted}"), 4, |c| {
            let x = c.param(&[4, 3]);
            let idx = c.ids(&[4, 2], &routes);
            let slots = c.b.moe_slots(idx, 3, 2)?;
            let mut ins = vec![x, slots];
            if weighted {
                ins.push(c.param(&[4, 2]));
            }
            Ok(vec![c.b.push1(Op::MoeDispatch { experts: 3, capacity: 2 }, &ins)?])
        });
        check_vjp(&format!("combine weighted={weighted}"), 5, |c| {
            let y = c.param(&[3, 2, 3]);
            let idx = c.ids(&[4, 2], &routes);
            let slots = c.b.moe_slots(idx, 3, 2)?;
            let mut ins = vec![y, slots];
            if weighted {
                ins.push(c.param(&[4, 2]));
            }
            Ok(vec![c.b.push1(Op::MoeCombine, &ins)?])
        });
    }
    // A whole layer: router weight, tokens, experts; the routing from the tokens themselves.
    check_vjp("moe layer", 6, |c| {
        let (n, h, f, e) = (6, 4, 3, 4);
        let x = c.param(&[n, h]);
        let wr = c.param(&[h, e]);
        let logits = c.b.matmul(x, wr, false, false)?;
        let r = moe::route(&mut c.b, logits, &RouterSpec::mixtral(e, 2), None)?;
        // As nn.Linear stores them (out × in), read transposed.
        let w = ExpertWeights {
            gate: c.param(&[e, f, h]),
            up: c.param(&[e, f, h]),
            down: c.param(&[e, h, f]),
            linear_layout: true,
        };
        Ok(vec![moe::routed_experts(&mut c.b, x, &r, &w, 2)?])
    });
    check_vjp("deepseek router weights", 7, |c| {
        let logits = c.param(&[5, 8]);
        let bias = c.input(&[8], vec![0.05, -0.03, 0.0, 0.02, -0.01, 0.04, -0.02, 0.01]);
        let spec = RouterSpec::deepseek_v3(8, 2, (4, 2), true, 2.5);
        Ok(vec![moe::route(&mut c.b, logits, &spec, Some(bias))?.weights])
    });
    check_vjp("load balancing loss", 8, |c| {
        let a = c.param(&[5, 4]);
        let b2 = c.param(&[5, 4]);
        Ok(vec![moe::load_balancing_loss(&mut c.b, &[a, b2], 2)?])
    });
}

// ---- routers against direct computations ---------------------------------------------------

fn route_values(spec: &RouterSpec, n: usize, logits: &[f64], bias: Option<&[f64]>) -> Vec<Value> {
    let e = spec.experts;
    let mut cx = Case::new(0);
    let l = cx.input(&[n, e], logits.to_vec());
    let b = bias.map(|b| cx.input(&[e], b.to_vec()));
    let r = moe::route(&mut cx.b, l, spec, b).unwrap();
    cx.eval(&[r.indices, r.weights])
}

#[test]
fn mixtral_router_matches_a_direct_computation() {
    let (n, e, k) = (9, 8, 2);
    let mut r = StdRng::seed_from_u64(11);
    let mut logits = rand_vec(&mut r, n * e);
    // A tie: token 0's experts 5 and 2 share the best logit; the lower index comes first.
    logits[5] = 3.0;
    logits[2] = 3.0;
    let got = route_values(&RouterSpec::mixtral(e, k), n, &logits, None);
    for t in 0..n {
        let p = softmax(&logits[t * e..(t + 1) * e]);
        let top = ref_top_k(&p, k);
        let s: f64 = top.iter().map(|&i| p[i]).sum();
        let idx: Vec<f64> = top.iter().map(|&i| i as f64).collect();
        assert_eq!(&got[0].data[t * k..(t + 1) * k], &idx[..], "token {t}");
        let w: Vec<f64> = top.iter().map(|&i| p[i] / s).collect();
        assert_close(&got[1].data[t * k..(t + 1) * k], &w, 1e-14, "weights");
    }
    assert_eq!(&got[0].data[..2], &[2.0, 5.0]);
    // Qwen-MoE without norm_topk_prob: the raw softmax probabilities.
    let spec = RouterSpec::qwen_moe(e, k, false);
    let raw = route_values(&spec, n, &logits, None);
    let p = softmax(&logits[e..2 * e]);
    let top = ref_top_k(&p, k);
    assert_close(&raw[1].data[k..2 * k], &[p[top[0]], p[top[1]]], 1e-14, "raw");
}

/// transformers' DeepseekV3 routing, directly: sigmoid, biased choice scores, each group's
/// top-2 sum, the best `topk_group` groups, −inf elsewhere, top-k, weights from the unbiased
/// scores normalised by `sum + 1e-20` and scaled.
fn deepseek_reference(
    logits: &[f64],
    bias: &[f64],
    (groups, keep): (usize, usize),
    k: usize,
    scale: f64,
) -> (Vec<usize>, Vec<f64>) {
    let e = bias.len();
    let per = e / groups;
    let s: Vec<f64> = logits.iter().map(|&v| sigmoid(v)).collect();
    let choice: Vec<f64> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
    let group_score: Vec<f64> = (0..groups)
        .map(|g| {
            ref_top_k(&choice[g * per..(g + 1) * per], 2).iter().map(|&i| choice[g * per + i]).sum()
        })
        .collect();
    let kept = ref_top_k(&group_score, keep);
    let masked: Vec<f64> = (0..e)
        .map(|i| if kept.contains(&(i / per)) { choice[i] } else { f64::NEG_INFINITY })
        .collect();
    let top = ref_top_k(&masked, k);
    let sum: f64 = top.iter().map(|&i| s[i]).sum::<f64>() + 1e-20;
    let w = top.iter().map(|&i| s[i] / sum * scale).collect();
    (top, w)
}

#[test]
fn deepseek_v3_router_matches_a_direct_computation() {
    let (n, e, k, groups) = (10, 16, 4, (4, 2));
    let mut r = StdRng::seed_from_u64(12);
    let logits: Vec<f64> = (0..n * e).map(|_| r.random_range(-2.0..2.0)).collect();
    let mut bias: Vec<f64> = (0..e).map(|_| r.random_range(-0.1..0.1)).collect();
    // A bias big enough to change selections against the unbiased scores.
    bias[3] = 0.6;
    let spec = RouterSpec::deepseek_v3(e, k, groups, true, 2.5);
    let got = route_values(&spec, n, &logits, Some(&bias));
    let mut bias_mattered = false;
    for t in 0..n {
        let row = &logits[t * e..(t + 1) * e];
        let (top, w) = deepseek_reference(row, &bias, groups, k, 2.5);
        let idx: Vec<f64> = top.iter().map(|&i| i as f64).collect();
        assert_eq!(&got[0].data[t * k..(t + 1) * k], &idx[..], "token {t}");
        assert_close(&got[1].data[t * k..(t + 1) * k], &w, 1e-14, "weights");
        let (plain, _) = deepseek_reference(row, &vec![0.0; e], groups, k, 2.5);
        bias_mattered |= plain != top;
        // Group-limited: at most `topk_group` groups among the choices.
        let mut gs: Vec<usize> = top.iter().map(|&i| i / (e / groups.0)).collect();
        gs.dedup();
        gs.sort();
        gs.dedup();
        assert!(gs.len() <= groups.1);
    }
    assert!(bias_mattered, "the bias must change some selection");
}

/// Experts of the dropped groups are never chosen, even when a kept expert's biased score is
/// negative: transformers 5 masks them with −inf (4.x filled 0, which would pick a dropped
/// group's expert over a negative kept one). Every group has two experts biased below zero, so
/// the fifth choice among the two kept groups' eight is a negative one.
#[test]
fn deepseek_v3_router_never_chooses_a_dropped_group() {
    let (n, e, k, groups) = (6, 16, 5, (4, 2));
    let mut r = StdRng::seed_from_u64(13);
    let logits: Vec<f64> = (0..n * e).map(|_| r.random_range(-2.0..2.0)).collect();
    let bias: Vec<f64> = (0..e).map(|i| if i % 4 < 2 { -1.5 } else { 0.0 }).collect();
    let spec = RouterSpec::deepseek_v3(e, k, groups, true, 2.5);
    let got = route_values(&spec, n, &logits, Some(&bias));
    for t in 0..n {
        let (top, w) = deepseek_reference(&logits[t * e..(t + 1) * e], &bias, groups, k, 2.5);
        let idx: Vec<f64> = top.iter().map(|&i| i as f64).collect();
        assert_eq!(&got[0].data[t * k..(t + 1) * k], &idx[..], "token {t}");
        assert_close(&got[1].data[t * k..(t + 1) * k], &w, 1e-14, "weights");
        let mut gs: Vec<usize> = top.iter().map(|&i| i / 4).collect();
        gs.sort();
        gs.dedup();
        assert_eq!(gs.len(), 2, "token {t}: choices {top:?} span groups {gs:?}");
    }
}

// ---- balancing ------------------------------------------------------------------------------

#[test]
fn load_balancing_loss_matches_transformers_formula() {
    let (n, e, k) = (7, 5, 2);
    let mut r = StdRng::seed_from_u64(13);
    let layers = [rand_vec(&mut r, n * e), rand_vec(&mut r, n * e)];
    let mut cx = Case::new(0);
    let ls: Vec<TensorId> = layers.iter().map(|l| cx.input(&[n, e], l.clone())).collect();
    let loss = moe::load_balancing_loss(&mut cx.b, &ls, k).unwrap();
    let got = cx.eval(&[loss])[0].item();
    // E · Σ_{j,e} tokens_per_expert[j, e] · router_prob_per_expert[e] over the stacked layers.
    let rows: Vec<Vec<f64>> = layers.iter().flat_map(|l| l.chunks(e).map(softmax)).collect();
    let m = rows.len() as f64;
    let mut f = vec![0.0; e];
    let mut p = vec![0.0; e];
    for row in &rows {
        for i in ref_top_k(row, k) {
            f[i] += 1.0 / m;
        }
        for (pi, v) in p.iter_mut().zip(row) {
            *pi += v / m;
        }
    }
    let want = e as f64 * f.iter().zip(&p).map(|(a, b)| a * b).sum::<f64>();
    assert!((got - want).abs() < 1e-14, "{got} vs {want}");
}

#[test]
fn bias_update_matches_a_direct_computation() {
    let (n, e, k) = (6, 4, 2);
    // Loads: expert 0: 4, 1: 3, 2: 3, 3: 2 — mean 3.
    let idx = [0i64, 1, 0, 2, 0, 3, 0, 1, 2, 1, 2, 3];
    let bias = vec![0.1, -0.2, 0.0, 0.3];
    let mut cx = Case::new(0);
    let b = cx.input(&[e], bias.clone());
    let i = cx.ids(&[n, k], &idx);
    let nb = moe::bias_update(&mut cx.b, b, i, 0.001).unwrap();
    let got = cx.eval(&[nb]).remove(0).data;
    let want = [0.1 - 0.001, -0.2, 0.0, 0.3 + 0.001];
    assert_close(&got, &want, 1e-15, "bias");
}
