//! `tp`: the kernels a tensor-parallel plan adds, against the CPU kernels on random inputs —
//! the sharded dropout mask (bit for bit, several placements and mesh positions, contiguous,
//! transposed and broadcast inputs), the per-row log-sum-exp, and the vocabulary-parallel
//! cross-entropy forward and backward (shards holding class 0 or not, targets inside and
//! outside the shard, ignored rows, f32 and bf16 logits, a given log-sum-exp, mean and sum).
//! Attention under tensor parallelism past the KV heads (`kv_whole`: each device's query heads
//! against every KV head), forward and backward, at every rank of tp4 and tp8 over 2 KV heads.
//! A bad target must give the CPU's error text (at the next download, the targets being
//! checked on the device) and AdamW must skip its update until it is reported.
//!
//! One JSON line per comparison: `{"check":"tp_kernel","op":..,"case":..,"rel_err":..,
//! "bound":..,"ok":..}`. A kernel error is a failed line, never a panic.

use candle_core::{Device, Tensor};
use std::sync::Arc;
use tessera_cuda::{CudaBackend, CudaTensor, Gpu};
use tessera_ir::dist::{MeshPos, ShardOf};
use tessera_ir::{AdamWSpec, AttentionSpec, DType, Op, TensorMeta};
use tessera_runtime::{Backend, CpuBackend, Result, RuntimeError};

/// f32 results against the CPU's (the kernels' other checks hold f32 to the same bound).
const F32_BOUND: f64 = 1e-4;
/// Results rounded to bf16.
const BF16_BOUND: f64 = 1e-2;

/// The device under test: a backend whose values can also be viewed without a copy (the
/// CUDA backend; the CPU backend in this module's test, a dry run of the harness).
pub trait UnderTest: Backend {
    fn permuted(&self, v: &Self::Value, perm: &[usize]) -> Result<Self::Value>;
    fn broadcast(&self, v: &Self::Value, dims: &[usize]) -> Result<Self::Value>;
}

impl UnderTest for CudaBackend {
    fn permuted(&self, v: &CudaTensor, perm: &[usize]) -> Result<CudaTensor> {
        v.permuted(perm)
    }
    fn broadcast(&self, v: &CudaTensor, dims: &[usize]) -> Result<CudaTensor> {
        v.broadcast(dims)
    }
}

impl UnderTest for CpuBackend {
    fn permuted(&self, v: &Tensor, perm: &[usize]) -> Result<Tensor> {
        Ok(v.permute(perm)?)
    }
    fn broadcast(&self, v: &Tensor, dims: &[usize]) -> Result<Tensor> {
        Ok(v.broadcast_as(dims)?)
    }
}

struct Tp<'a, B: UnderTest> {
    cpu: CpuBackend,
    gpu: B,
    fails: &'a mut Vec<String>,
}

fn err(msg: String) -> RuntimeError {
    RuntimeError::Binding(msg)
}

fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn cdt(d: DType) -> candle_core::DType {
    tessera_runtime::tensor::candle_dtype(d)
}

/// `n` values uniform in [-scale, scale), as `dims` in `dtype`.
fn random(st: &mut u64, dims: &[usize], scale: f32, dtype: DType) -> Result<Tensor> {
    let v: Vec<f32> = super::uniform(st, dims.iter().product()).iter().map(|x| x * scale).collect();
    Ok(Tensor::from_vec(v, dims, &Device::Cpu)?.to_dtype(cdt(dtype))?)
}

impl<B: UnderTest> Tp<'_, B> {
    /// Prints one comparison's line; `Err` (a kernel or setup error) is a failure.
    fn record(&mut self, op: &str, case: &str, bound: f64, got: Result<f64>) {
        let (rel, ok, extra) = match got {
            Ok(e) => (e, e <= bound, String::new()),
            Err(e) => (f64::INFINITY, false, format!(",\"error\":{}", json_str(&e.to_string()))),
        };
        let rel_json = if rel.is_finite() { format!("{rel:e}") } else { "null".into() };
        println!(
            "{{\"check\":\"tp_kernel\",\"op\":\"{op}\",\"case\":{},\"rel_err\":{rel_json},\"bound\":{bound:e},\"ok\":{ok}{extra}}}",
            json_str(case)
        );
        if !ok {
            let why = if extra.is_empty() { format!("rel err {rel:e}") } else { extra };
            self.fails.push(format!("tp {op} {case}: {why}"));
        }
    }

    fn up(&self, t: &Tensor) -> Result<B::Value> {
        self.gpu.upload(t)
    }

    /// `op` on the CPU (from `cpu_in`) and the GPU (from `gpu_in`, the same values), at `at`:
    /// both results, the GPU's downloaded.
    fn both(
        &self,
        op: &Op,
        cpu_in: &[&Tensor],
        gpu_in: &[&B::Value],
        at: &MeshPos,
    ) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let metas: Vec<TensorMeta> = cpu_in
            .iter()
            .map(|t| tessera_runtime::tensor::meta_of(t).ok_or_else(|| err("input dtype".into())))
            .collect::<Result<_>>()?;
        let refs: Vec<&TensorMeta> = metas.iter().collect();
        let out = op.infer(&refs).map_err(|e| err(format!("{}: {e}", op.name())))?;
        let want = self.cpu.execute(op, cpu_in, &out, at)?;
        let got = self.gpu.execute(op, gpu_in, &out, at)?;
        let got = got.iter().map(|t| self.gpu.download(t)).collect::<Result<Vec<_>>>()?;
        Ok((want, got))
    }
}

/// Runs the checks, printing one JSON line per comparison and pushing failures to `fails`.
pub fn run(gpu: &Arc<Gpu>, fails: &mut Vec<String>) {
    let mut tp = Tp { cpu: CpuBackend::new(0), gpu: CudaBackend::new(gpu.clone()), fails };
    dropout(&mut tp);
    logsumexp(&mut tp);
    cross_entropy(&mut tp);
    shards_add_up(&mut tp);
    bad_targets(&mut tp);
    kv_whole(&mut tp);
    let mut st = 0xADA3_5C1B_0000_0001u64;
    let got = adamw_skips(&tp, &mut st);
    tp.record("bad_target", "adamw skips the step, then applies the next", 0.0, got);
}

// ---- dropout ----

/// How a dropout's input reaches the GPU kernel.
#[derive(Clone, Copy, Debug)]
enum View {
    Dense,
    /// Stored with its last two dims swapped, read through a permuted view.
    Transposed,
    /// One row repeated down the leading dims (stride 0).
    Broadcast,
}

fn dropout<B: UnderTest>(tp: &mut Tp<B>) {
    // (global shape, placement, mesh, rank, micro-batch)
    type Case = (&'static str, Vec<usize>, Vec<Vec<usize>>, Vec<usize>, usize, usize);
    let cases: Vec<Case> = vec![
        ("batch_dp2_r1", vec![4, 6, 16], vec![vec![0], vec![], vec![]], vec![2], 1, 0),
        ("hidden_tp2_r3_mb1", vec![4, 6, 16], vec![vec![], vec![], vec![1]], vec![2, 2], 3, 1),
        ("2d_dp2xtp3_r4", vec![4, 6, 16], vec![vec![0], vec![1], vec![]], vec![2, 3], 4, 0),
        // The last dim in four: runs of 4, the kernel's one-at-a-time path.
        ("minor_split4_r2", vec![4, 6, 16], vec![vec![], vec![], vec![0, 1]], vec![2, 2], 2, 0),
        ("seq_sp3_r2_mb2", vec![2, 12, 24], vec![vec![], vec![0], vec![]], vec![3], 2, 2),
        // Many blocks (131,072 elements), rows split and the hidden dim in two.
        ("large_2x2_r1", vec![8, 64, 256], vec![vec![0], vec![], vec![1]], vec![2, 2], 1, 0),
    ];
    let mut st = 0x7E55_E4A7_D00D_F00Du64;
    for (name, global, placement, mesh, rank, mb) in cases {
        for (dtype, view) in [
            (DType::F32, View::Dense),
            (DType::BF16, View::Dense),
            (DType::F32, View::Transposed),
            (DType::BF16, View::Broadcast),
        ] {
            let case = format!("{name} {dtype:?} {view:?}");
            let shard =
                ShardOf { global: global.clone(), placement: placement.clone(), micro_batch: mb };
            let got = dropout_case(tp, &mut st, shard, &mesh, rank, dtype, view);
            tp.record("dropout", &case, 0.0, got);
        }
    }
}

fn dropout_case<B: UnderTest>(
    tp: &Tp<B>,
    st: &mut u64,
    shard: ShardOf,
    mesh: &[usize],
    rank: usize,
    dtype: DType,
    view: View,
) -> Result<f64> {
    let at = MeshPos::new(mesh, rank)?;
    let local: Vec<usize> = shard
        .global
        .iter()
        .zip(&shard.placement)
        .map(|(&g, axes)| Ok(g / at.chunk(axes)?.0))
        .collect::<Result<_>>()?;
    let r = local.len();
    let (x, gx) = match view {
        View::Dense => {
            let x = random(st, &local, 1.0, dtype)?;
            let gx = tp.up(&x)?;
            (x, gx)
        }
        View::Transposed => {
            let x = random(st, &local, 1.0, dtype)?;
            let stored = x.transpose(r - 2, r - 1)?.contiguous()?;
            let mut perm: Vec<usize> = (0..r).collect();
            perm.swap(r - 2, r - 1);
            let gx = tp.gpu.permuted(&tp.up(&stored)?, &perm)?;
            (x, gx)
        }
        View::Broadcast => {
            let row = random(st, &local[r - 1..], 1.0, dtype)?;
            let gx = tp.gpu.broadcast(&tp.up(&row)?, &local)?;
            (row.broadcast_as(local.as_slice())?.contiguous()?, gx)
        }
    };
    let seed = Tensor::new(987_654_321i64, &Device::Cpu)?;
    let gseed = tp.up(&seed)?;
    let op = Op::Dropout { p: 0.3, stream: 5, shard: Some(shard) };
    let (want, got) = tp.both(&op, &[&x, &seed], &[&gx, &gseed], &at)?;
    super::rel_err(&got[0], &want[0])
}

// ---- log-sum-exp ----

fn logsumexp<B: UnderTest>(tp: &mut Tp<B>) {
    let mut st = 0x1057_5E4D_0000_0001u64;
    // (case, dims, dtype, transposed, a row of −∞)
    let cases = [
        ("rows96_vec", vec![3, 5, 96], DType::F32, false, false),
        ("rows96_vec", vec![3, 5, 96], DType::BF16, false, false),
        ("rows13", vec![7, 13], DType::F32, false, false),
        ("gathered_2_shards", vec![40, 2], DType::F32, false, false),
        ("neg_inf_row", vec![4, 16], DType::F32, false, true),
        ("transposed", vec![6, 96], DType::F32, true, false),
        ("vector", vec![50], DType::F32, false, false),
    ];
    for (name, dims, dtype, transposed, inf_row) in cases {
        let got = (|| -> Result<f64> {
            let mut x = random(&mut st, &dims, 6.0, DType::F32)?;
            if inf_row {
                let c = dims[1];
                let mut v = x.flatten_all()?.to_vec1::<f32>()?;
                v[2 * c..3 * c].fill(f32::NEG_INFINITY);
                x = Tensor::from_vec(v, dims.as_slice(), &Device::Cpu)?;
            }
            let x = x.to_dtype(cdt(dtype))?;
            let gx = if transposed {
                tp.gpu.permuted(&tp.up(&x.t()?.contiguous()?)?, &[1, 0])?
            } else {
                tp.up(&x)?
            };
            let (want, got) = tp.both(&Op::LogSumExp, &[&x], &[&gx], &MeshPos::single())?;
            super::rel_err(&got[0], &want[0])
        })();
        tp.record("logsumexp", &format!("{name} {dtype:?}"), F32_BOUND, got);
    }
}

// ---- the vocabulary-parallel cross-entropy ----

struct Ce {
    name: &'static str,
    vocab: usize,
    rows: Vec<usize>,
    /// (mesh, rank, the axes splitting the classes); `None`: every class.
    tp: Option<(Vec<usize>, usize, Vec<usize>)>,
    dtype: DType,
    ignore: Option<i64>,
    sum: bool,
    /// The log-sum-exp over every class as the forward's third input (what a plan with the
    /// classes split gives, and only it: the IR takes it with `classes` alone).
    given: bool,
    /// Every target ignored.
    all_ignored: bool,
    /// The logits reach the GPU through a transposed view (rows of one dim only).
    transposed: bool,
}

impl Ce {
    fn new(name: &'static str, vocab: usize, rows: &[usize], dtype: DType) -> Ce {
        Ce {
            name,
            vocab,
            rows: rows.to_vec(),
            tp: None,
            dtype,
            ignore: Some(-100),
            sum: false,
            given: false,
            all_ignored: false,
            transposed: false,
        }
    }
    fn tp(mut self, mesh: &[usize], rank: usize, axes: &[usize]) -> Ce {
        self.tp = Some((mesh.to_vec(), rank, axes.to_vec()));
        self.given = true;
        self
    }
}

/// The full logits `[rows.., vocab]` and targets (in `0..vocab`, every seventh row ignored
/// when an ignore index is set).
fn ce_inputs(st: &mut u64, c: &Ce) -> Result<(Tensor, Tensor)> {
    let mut dims = c.rows.clone();
    dims.push(c.vocab);
    let logits = random(st, &dims, 4.0, c.dtype)?;
    let n: usize = c.rows.iter().product();
    let u = super::uniform(st, n);
    let targets: Vec<i64> = u
        .iter()
        .enumerate()
        .map(|(k, x)| match c.ignore {
            Some(ig) if c.all_ignored || k % 7 == 3 => ig,
            _ => (((x + 1.0) / 2.0 * c.vocab as f32) as i64).clamp(0, c.vocab as i64 - 1),
        })
        .collect();
    Ok((logits, Tensor::from_vec(targets, c.rows.as_slice(), &Device::Cpu)?))
}

/// This device's classes of `logits` and its mesh position and shard.
fn ce_shard(c: &Ce, logits: &Tensor) -> Result<(Tensor, MeshPos, Option<ShardOf>)> {
    let Some((mesh, rank, axes)) = &c.tp else {
        return Ok((logits.clone(), MeshPos::single(), None));
    };
    let at = MeshPos::new(mesh, *rank)?;
    let (n, idx) = at.chunk(axes)?;
    let count = c.vocab / n;
    let local = logits.narrow(logits.rank() - 1, idx * count, count)?.contiguous()?;
    let shard = ShardOf { global: vec![c.vocab], placement: vec![axes.clone()], micro_batch: 0 };
    Ok((local, at, Some(shard)))
}

fn cross_entropy<B: UnderTest>(tp: &mut Tp<B>) {
    let (f32_, bf16) = (DType::F32, DType::BF16);
    let cases = vec![
        Ce::new("whole", 256, &[4, 33], f32_),
        Ce::new("whole", 256, &[4, 33], bf16),
        Ce { ignore: None, sum: true, ..Ce::new("whole_sum", 256, &[2, 17], f32_) },
        Ce { transposed: true, ..Ce::new("whole_transposed", 96, &[40], f32_) },
        Ce::new("tp2_r0_first0", 256, &[4, 33], f32_).tp(&[2], 0, &[0]),
        Ce::new("tp2_r1", 256, &[4, 33], f32_).tp(&[2], 1, &[0]),
        Ce::new("tp2_r1", 256, &[4, 33], bf16).tp(&[2], 1, &[0]),
        Ce::new("tp4_axis1_r6", 256, &[4, 33], bf16).tp(&[2, 4], 6, &[1]),
        Ce::new("tp4_axis1_r4_first0", 256, &[4, 33], f32_).tp(&[2, 4], 4, &[1]),
        Ce {
            ignore: None,
            sum: true,
            ..Ce::new("tp2_r1_sum", 256, &[3, 20], f32_).tp(&[2], 1, &[0])
        },
        Ce::new("tp2_r1_v100", 100, &[5, 9], f32_).tp(&[2], 1, &[0]),
        Ce { ignore: Some(-1), ..Ce::new("tp4_r0_v100", 100, &[5, 9], bf16).tp(&[4], 0, &[0]) },
        Ce {
            all_ignored: true,
            ..Ce::new("tp2_r0_all_ignored", 256, &[2, 5], f32_).tp(&[2], 0, &[0])
        },
    ];
    let mut st = 0xCE0C_E0CE_0123_4567u64;
    for c in &cases {
        let case = format!("{} {:?}", c.name, c.dtype);
        match ce_case(tp, &mut st, c) {
            Ok([loss, lse, dx]) => {
                tp.record("cross_entropy", &format!("{case} loss"), F32_BOUND, Ok(loss));
                tp.record("cross_entropy", &format!("{case} lse"), F32_BOUND, Ok(lse));
                let bound = if c.dtype == DType::F32 { F32_BOUND } else { BF16_BOUND };
                tp.record("cross_entropy_backward", &case, bound, Ok(dx));
            }
            Err(e) => tp.record("cross_entropy", &case, F32_BOUND, Err(e)),
        }
    }
}

/// One case's relative errors: the loss, the log-sum-exp, dlogits.
fn ce_case<B: UnderTest>(tp: &Tp<B>, st: &mut u64, c: &Ce) -> Result<[f64; 3]> {
    let (logits, targets) = ce_inputs(st, c)?;
    let (local, at, classes) = ce_shard(c, &logits)?;
    let gl = if c.transposed {
        tp.gpu.permuted(&tp.up(&local.t()?.contiguous()?)?, &[1, 0])?
    } else {
        tp.up(&local)?
    };
    let gt = tp.up(&targets)?;
    // The log-sum-exp over every class (the CPU's): the forward's given input, and what the
    // backward reads.
    let lse = tp.cpu.execute(
        &Op::LogSumExp,
        &[&logits],
        &[TensorMeta::new(c.rows.clone(), DType::F32)],
        &MeshPos::single(),
    )?;
    let glse = tp.up(&lse[0])?;
    let (ig, sum) = (c.ignore, c.sum);
    let fwd = Op::CrossEntropy { ignore_index: ig, sum, classes: classes.clone() };
    let (mut cin, mut gin) = (vec![&local, &targets], vec![&gl, &gt]);
    if c.given {
        cin.push(&lse[0]);
        gin.push(&glse);
    }
    let (want, got) = tp.both(&fwd, &cin, &gin, &at)?;
    let loss = super::rel_err(&got[0], &want[0])?;
    let lse_err = super::rel_err(&got[1], &want[1])?;
    let dloss = Tensor::new(0.75f32, &Device::Cpu)?;
    let gd = tp.up(&dloss)?;
    let bwd = Op::CrossEntropyBackward { ignore_index: ig, sum, classes };
    let (want, got) =
        tp.both(&bwd, &[&local, &targets, &lse[0], &dloss], &[&gl, &gt, &glse, &gd], &at)?;
    Ok([loss, lse_err, super::rel_err(&got[0], &want[0])?])
}

/// The shards' losses (on the GPU, from the given log-sum-exp) add up to the whole loss.
fn shards_add_up<B: UnderTest>(tp: &mut Tp<B>) {
    let got = (|| -> Result<f64> {
        let mut st = 0xADD5_0000_0000_0001u64;
        let whole = Ce::new("whole", 256, &[4, 33], DType::F32);
        let (logits, targets) = ce_inputs(&mut st, &whole)?;
        let gt = tp.up(&targets)?;
        let at1 = MeshPos::single();
        let loss_meta = TensorMeta::new(Vec::<usize>::new(), DType::F32);
        let lse_meta = TensorMeta::new(whole.rows.clone(), DType::F32);
        let metas = [loss_meta, lse_meta];
        let ce = |classes| Op::CrossEntropy { ignore_index: Some(-100), sum: false, classes };
        let gl = tp.up(&logits)?;
        let out = tp.gpu.execute(&ce(None), &[&gl, &gt], &metas, &at1)?;
        let glse = out[1].clone();
        let want = tp.gpu.download(&out[0])?.to_scalar::<f32>()? as f64;
        let mut total = 0.0;
        for rank in 0..4 {
            let shard = Ce::new("shard", 256, &[4, 33], DType::F32).tp(&[4], rank, &[0]);
            let (local, at, classes) = ce_shard(&shard, &logits)?;
            let gl = tp.up(&local)?;
            let out = tp.gpu.execute(&ce(classes), &[&gl, &gt, &glse], &metas, &at)?;
            total += tp.gpu.download(&out[0])?.to_scalar::<f32>()? as f64;
        }
        Ok((total - want).abs() / want.abs().max(1e-30))
    })();
    tp.record("cross_entropy", "tp4 shards add up to the whole loss", F32_BOUND, got);
}

// ---- bad targets ----

/// The GPU's error (at the download after the op) against the CPU's, for a bad target; then
/// the backend works again, and AdamW skips its update while the error is pending.
fn bad_targets<B: UnderTest>(tp: &mut Tp<B>) {
    let mut st = 0xBAD7_A26E_7000_0001u64;
    // (case, backward, tp, ignore, targets' bad entries (position, value))
    type Case = (&'static str, bool, bool, Option<i64>, Vec<(usize, i64)>);
    let cases: Vec<Case> = vec![
        ("forward above vocab", false, false, Some(-100), vec![(9, 256), (20, 300)]),
        ("forward negative, ignore set", false, false, Some(-100), vec![(4, -7)]),
        ("backward no ignore_index", true, false, None, vec![(11, -100)]),
        ("tp2_r1 forward", false, true, Some(-100), vec![(30, 1000)]),
        ("tp2_r1 backward", true, true, None, vec![(2, 256), (3, -1)]),
    ];
    for (name, backward, sharded, ignore, bad) in cases {
        let got = bad_target_case(tp, &mut st, backward, sharded, ignore, &bad);
        match got {
            Ok((cpu, gpu)) => {
                let ok = cpu == gpu;
                println!(
                    "{{\"check\":\"tp_kernel\",\"op\":\"bad_target\",\"case\":{},\"rel_err\":{},\"bound\":0,\"ok\":{ok},\"cpu_error\":{},\"gpu_error\":{}}}",
                    json_str(name),
                    if ok { 0 } else { 1 },
                    json_str(&cpu),
                    json_str(&gpu)
                );
                if !ok {
                    tp.fails.push(format!("tp bad_target {name}: GPU `{gpu}`, CPU `{cpu}`"));
                }
            }
            Err(e) => tp.record("bad_target", name, 0.0, Err(e)),
        }
    }
}

/// The CPU's and the GPU's error texts for one bad-target case (after which a good op's
/// download must succeed).
fn bad_target_case<B: UnderTest>(
    tp: &Tp<B>,
    st: &mut u64,
    backward: bool,
    sharded: bool,
    ignore: Option<i64>,
    bad: &[(usize, i64)],
) -> Result<(String, String)> {
    let mut c = Ce { ignore, ..Ce::new("bad", 256, &[4, 10], DType::F32) };
    if sharded {
        c = c.tp(&[2], 1, &[0]);
    }
    let (logits, targets) = ce_inputs(st, &c)?;
    let mut t = targets.flatten_all()?.to_vec1::<i64>()?;
    for &(k, v) in bad {
        t[k] = v;
    }
    let targets = Tensor::from_vec(t, c.rows.as_slice(), &Device::Cpu)?;
    let (local, at, classes) = ce_shard(&c, &logits)?;
    let lse = Tensor::zeros(c.rows.as_slice(), candle_core::DType::F32, &Device::Cpu)?;
    let (gl, gt, glse) = (tp.up(&local)?, tp.up(&targets)?, tp.up(&lse)?);
    let dloss = Tensor::new(1.0f32, &Device::Cpu)?;
    let gd = tp.up(&dloss)?;
    let (op, cin, gin): (Op, Vec<&Tensor>, Vec<&B::Value>) = if backward {
        let op = Op::CrossEntropyBackward { ignore_index: ignore, sum: false, classes };
        (op, vec![&local, &targets, &lse, &dloss], vec![&gl, &gt, &glse, &gd])
    } else {
        let op = Op::CrossEntropy { ignore_index: ignore, sum: false, classes };
        let (mut ci, mut gi) = (vec![&local, &targets], vec![&gl, &gt]);
        if sharded {
            ci.push(&lse);
            gi.push(&glse);
        }
        (op, ci, gi)
    };
    let metas: Vec<TensorMeta> = cin
        .iter()
        .map(|t| tessera_runtime::tensor::meta_of(t).ok_or_else(|| err("dtype".into())))
        .collect::<Result<_>>()?;
    let refs: Vec<&TensorMeta> = metas.iter().collect();
    let out = op.infer(&refs).map_err(err)?;
    let cpu = match tp.cpu.execute(&op, &cin, &out, &at) {
        Err(e) => e.to_string(),
        Ok(_) => return Err(err("the CPU kernel accepted the bad target".into())),
    };
    // The GPU queues the op; the error surfaces at the next download.
    let y = tp.gpu.execute(&op, &gin, &out, &at);
    let gpu = match y
        .as_ref()
        .map_err(|e| e.to_string())
        .and_then(|y| tp.gpu.download(&y[0]).map_err(|e| e.to_string()))
    {
        Err(e) => e,
        Ok(_) => "(no error: the download succeeded)".into(),
    };
    // Reported once: the backend is usable again.
    if let Ok(y) = y {
        tp.gpu.download(&y[0])?;
    }
    Ok((cpu, gpu))
}

/// After a bad target, AdamW leaves the parameter alone (the download reports the target);
/// once reported, the next update applies.
fn adamw_skips(tp: &Tp<CudaBackend>, st: &mut u64) -> Result<f64> {
    let n = 1000;
    let param = random(st, &[n], 1.0, DType::F32)?;
    let grad = random(st, &[n], 1.0, DType::F32)?;
    // Separate moments: the CPU's AdamW writes them in place.
    let m0 = Tensor::zeros(n, candle_core::DType::F32, &Device::Cpu)?;
    let v0 = Tensor::zeros(n, candle_core::DType::F32, &Device::Cpu)?;
    let scalar = |v: f32| Tensor::new(v, &Device::Cpu);
    let (lr, norm) = (scalar(1e-2)?, scalar(1.0)?);
    let step = Tensor::new(1i64, &Device::Cpu)?;
    let spec = AdamWSpec {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        max_grad_norm: None,
        grad_scale: false,
    };
    let op = Op::AdamW(spec);
    let host = [&param, &grad, &m0, &v0, &lr, &step, &norm];
    let dev: Vec<CudaTensor> = host.iter().map(|t| tp.up(t)).collect::<Result<_>>()?;
    let refs: Vec<&CudaTensor> = dev.iter().collect();
    let metas: Vec<TensorMeta> = host
        .iter()
        .map(|t| tessera_runtime::tensor::meta_of(t).ok_or_else(|| err("dtype".into())))
        .collect::<Result<_>>()?;
    let mrefs: Vec<&TensorMeta> = metas.iter().collect();
    let out = op.infer(&mrefs).map_err(err)?;
    let at = MeshPos::single();
    // A forward with a bad target, not yet downloaded.
    let c = Ce::new("bad", 64, &[8], DType::F32);
    let (logits, targets) = ce_inputs(st, &c)?;
    let mut t = targets.to_vec1::<i64>()?;
    t[5] = 64;
    let targets = Tensor::from_vec(t, 8, &Device::Cpu)?;
    let ce = Op::CrossEntropy { ignore_index: None, sum: false, classes: None };
    let ce_out =
        [TensorMeta::new(Vec::<usize>::new(), DType::F32), TensorMeta::new(vec![8], DType::F32)];
    let (gl, gt) = (tp.up(&logits)?, tp.up(&targets)?);
    tp.gpu.execute(&ce, &[&gl, &gt], &ce_out, &at)?;
    let written = tp.gpu.execute(&op, &refs, &out, &at)?;
    if tp.gpu.download(&written[0]).is_ok() {
        return Err(err("the download after a bad target succeeded".into()));
    }
    let skipped = super::rel_err(&tp.gpu.download(&written[0])?, &param)?;
    if skipped != 0.0 {
        return Err(err(format!("AdamW changed the parameter after a bad target ({skipped:e})")));
    }
    // Reported: the next update applies, as the CPU's does.
    let written = tp.gpu.execute(&op, &refs, &out, &at)?;
    let got = tp.gpu.download(&written[0])?;
    let want = tp.cpu.execute(&op, &host, &out, &at)?;
    let e = super::rel_err(&got, &want[0])?;
    Ok(if e <= F32_BOUND { 0.0 } else { e })
}

// ---- attention past the KV heads ----

/// Each rank's attention over its query heads and every KV head (`kv_whole`), forward (output,
/// log-sum-exp) and backward (dq, and dk, dv non-zero on the KV head read), against the CPU's.
fn kv_whole<B: UnderTest>(tp: &mut Tp<B>) {
    let mut st = 0x4B57_0000_0000_0001u64;
    // (batch, seq, query heads, KV heads, head dim, devices on the tensor axis, dtype)
    let cases = [
        (2, 9, 8, 2, 16, 8, DType::F32),
        (2, 9, 8, 2, 16, 4, DType::F32),
        (1, 40, 8, 2, 64, 4, DType::BF16),
    ];
    for (b, s, h, hkv, d, n, dtype) in cases {
        for r in 0..n {
            let got = (|| -> Result<f64> {
                let q = random(&mut st, &[b, s, h / n, d], 1.0, dtype)?;
                let k = random(&mut st, &[b, s, hkv, d], 1.0, dtype)?;
                let v = random(&mut st, &[b, s, hkv, d], 1.0, dtype)?;
                let dout = random(&mut st, &[b, s, h / n, d], 1.0, dtype)?;
                let spec = AttentionSpec {
                    kv_whole: Some(ShardOf {
                        global: vec![b, s, h, d],
                        placement: vec![vec![], vec![], vec![1], vec![]],
                        micro_batch: 0,
                    }),
                    ..AttentionSpec::causal(d)
                };
                let at = MeshPos::new(&[1, n], r).map_err(|e| err(e.to_string()))?;
                let (gq, gk, gv) = (tp.up(&q)?, tp.up(&k)?, tp.up(&v)?);
                let fwd = Op::Attention(spec.clone());
                let (want, got) = tp.both(&fwd, &[&q, &k, &v], &[&gq, &gk, &gv], &at)?;
                let mut worst = 0f64;
                for (g, w) in got.iter().zip(&want) {
                    worst = worst.max(super::rel_err(g, w)?);
                }
                let (go, gl, gd) = (tp.up(&want[0])?, tp.up(&want[1])?, tp.up(&dout)?);
                let bwd = Op::AttentionBackward(spec);
                let cpu_in = [&q, &k, &v, &want[0], &want[1], &dout];
                let (want, got) = tp.both(&bwd, &cpu_in, &[&gq, &gk, &gv, &go, &gl, &gd], &at)?;
                if got.len() != 3 {
                    return Err(err(format!("the backward gave {} outputs", got.len())));
                }
                for (g, w) in got.iter().zip(&want) {
                    worst = worst.max(super::rel_err(g, w)?);
                }
                Ok(worst)
            })();
            let case = format!("B={b} S={s} H={h} Hkv={hkv} D={d} tp{n} rank {r} {dtype:?}");
            let bound = if dtype == DType::F32 { F32_BOUND } else { BF16_BOUND };
            tp.record("attention_kv_whole", &case, bound, got);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The harness with the CPU as the device under test: every case sets up, runs and agrees
    /// (a dry run of what the GPU run does, minus AdamW's deferred skip), and the shards'
    /// losses add up on the CPU's kernels too.
    #[test]
    fn the_harness_runs_clean_with_the_cpu_as_the_device() {
        let mut fails = Vec::new();
        let mut tp = Tp { cpu: CpuBackend::new(0), gpu: CpuBackend::new(0), fails: &mut fails };
        dropout(&mut tp);
        logsumexp(&mut tp);
        cross_entropy(&mut tp);
        shards_add_up(&mut tp);
        bad_targets(&mut tp);
        kv_whole(&mut tp);
        assert!(fails.is_empty(), "{fails:#?}");
    }
}
