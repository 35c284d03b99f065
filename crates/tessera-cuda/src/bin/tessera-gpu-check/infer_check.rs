//! `generate`: the generation ops' kernels (KV-cache write, position selection, quantised
//! matmuls) against the CPU kernels, greedy generation on the GPU against the CPU's, and the
//! GPU's decode speed.
//!
//! 1. `infer_kernel`: each op on random inputs, GPU against CPU: the cache write at several
//!    positions (f32, bf16, a broadcast x), checked to write the cache's own buffer; the
//!    position select (f32, bf16); int8 and int4 matmuls of every kernel path (per-feature:
//!    vector and scalar loads, groups inside and across 16-byte chunks, odd int4 groups; tiled)
//!    in f32 and bf16; and out-of-range indices refused with the CPU's error.
//! 2. `greedy`: gpt2-tiny and llama-tiny (fresh weights, seed 7), two prompts of different
//!    lengths generated together, 24 new tokens: the CUDA backend's tokens against the CPU
//!    backend's, f32 with float, int8 and int4 weights (gated), and bf16 (reported: bf16 roundings
//!    differ between the backends, so its tokens may part).
//! 3. `decode_speed`: greedy decoding with the KV cache of gpt2-medium (bf16 and int8 weights)
//!    and llama-1.3b (bf16), fresh weights, batch 1, a 128-token prompt, 128 new tokens, after a
//!    warm-up; then the GPU time per op kind of a shorter run (CUDA events).
//!
//! Every sub-check turns an error (or a panic) into a failure line; none stops the others.

#[path = "infer_speed.rs"]
mod infer_speed;

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::sync::Arc;
use tessera_cuda::alloc::Purpose;
use tessera_cuda::{CudaBackend, CudaTensor, Gpu};
use tessera_ir::dist::MeshPos;
use tessera_ir::{DType, LeafLayout, Op, Program, QuantSpec, Shape, TensorMeta};
use tessera_models::{
    build, build_generation, BuildOptions, GenerateOptions, ModelConfig, Quantize,
};
use tessera_runtime::collective::DeviceMesh;
use tessera_runtime::generate::{Generated, Generator, QuantizedLeaf, StepProgram};
use tessera_runtime::sampling::Sampling;
use tessera_runtime::{Backend, CpuBackend};

/// The checks' error: a message.
pub(crate) type R<T> = std::result::Result<T, String>;

pub(crate) fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// `v` as a JSON string.
pub(crate) fn json_str(v: &str) -> String {
    let mut o = String::from("\"");
    for c in v.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// Runs `f`, turning an error or a panic into a failure line of check `check` (`what` names
/// the case).
pub(crate) fn guarded(check: &str, what: &str, fails: &mut Vec<String>, f: impl FnOnce() -> R<()>) {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        Err(format!("panicked: {msg}"))
    });
    if let Err(e) = r {
        println!(
            "{{\"check\":\"{check}\",\"case\":{},\"error\":{},\"ok\":false}}",
            json_str(what),
            json_str(&e)
        );
        fails.push(format!("{check} {what}: {e}"));
    }
}

/// Runs the generation checks, printing one JSON line per check and pushing failures to
/// `fails`.
pub fn run(gpu: &Arc<Gpu>, fails: &mut Vec<String>) {
    guarded("infer_kernel", "cache_write", fails, || cache_write(gpu));
    guarded("infer_kernel", "select_positions", fails, || select_positions(gpu));
    guarded("infer_kernel", "qmatmul", fails, || qmatmul(gpu));
    for model in ["gpt2-tiny", "llama-tiny"] {
        let cases = [
            (DType::F32, None),
            (DType::F32, Some(Quantize::Int8)),
            (DType::F32, Some(Quantize::Int4)),
            (DType::BF16, None),
        ];
        for (dtype, quant) in cases {
            let what = format!("{model} {dtype:?} {}", quant.map_or("float", Quantize::name));
            guarded("greedy", &what, fails, || greedy(gpu, model, dtype, quant));
        }
    }
    infer_speed::run(gpu, fails);
}

/// The CPU and the GPU backends, and where they run.
struct Pair {
    cpu: CpuBackend,
    gpu: CudaBackend,
    at: MeshPos,
}

impl Pair {
    fn new(gpu: &Arc<Gpu>) -> Pair {
        Pair { cpu: CpuBackend::new(0), gpu: CudaBackend::new(gpu.clone()), at: MeshPos::single() }
    }
    fn up(&self, t: &Tensor) -> R<CudaTensor> {
        self.gpu.upload_as(t, Purpose::Scratch).map_err(s)
    }
    fn down(&self, t: &CudaTensor) -> R<Tensor> {
        self.gpu.download(t).map_err(s)
    }
}

/// One `infer_kernel` line; a failure when `rel_err` exceeds `bound`.
fn report(op: &str, case: &str, err: f64, bound: f64, fails: &mut Vec<String>) {
    let ok = err <= bound;
    println!(
        "{{\"check\":\"infer_kernel\",\"op\":\"{op}\",\"case\":{},\"rel_err\":{err:e},\"bound\":{bound},\"ok\":{ok}}}",
        json_str(case)
    );
    if !ok {
        fails.push(format!("infer_kernel {op} {case}: rel err {err:e} (bound {bound})"));
    }
}

fn meta(dims: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta { shape: Shape::from(dims), dtype }
}

fn cpu_dtype(d: DType) -> candle_core::DType {
    tessera_runtime::tensor::candle_dtype(d)
}

/// Uniform values in [-1, 1) of `dims` as `dtype`, from the xorshift state `st`.
fn rand(st: &mut u64, dims: &[usize], dtype: DType) -> R<Tensor> {
    let v = crate::uniform(st, dims.iter().product());
    Tensor::from_vec(v, dims, &Device::Cpu).and_then(|t| t.to_dtype(cpu_dtype(dtype))).map_err(s)
}

fn ints(v: Vec<i64>) -> R<Tensor> {
    let n = v.len();
    Tensor::from_vec(v, n, &Device::Cpu).map_err(s)
}

/// The cache write at several positions, in place: the GPU's op returns the cache's own
/// buffer, and that buffer then holds what the CPU kernel wrote into its cache.
fn cache_write(gpu: &Arc<Gpu>) -> R<()> {
    let p = Pair::new(gpu);
    let mut st = 0x0CAC_4E00_57A7_1234u64;
    let (b, c, h, d) = (2, 20, 3, 8);
    // (positions per step, starts, x broadcast along its positions)
    let cases: [(usize, [i64; 2], bool); 5] = [
        (1, [0, 7], false),
        (1, [19, 3], false),
        (5, [15, 0], false),
        (20, [0, 0], false),
        (4, [2, 16], true),
    ];
    let mut fails = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        for (sn, starts, expand) in cases {
            let cache = rand(&mut st, &[b, c, h, d], dtype)?;
            let small = rand(&mut st, &[b, if expand { 1 } else { sn }, h, d], dtype)?;
            let x =
                if expand { small.broadcast_as((b, sn, h, d)).map_err(s)? } else { small.clone() };
            let start = ints(starts.to_vec())?;
            let (dc, ds) = (p.up(&cache)?, p.up(&start)?);
            let dx = if expand {
                // A stride-0 view on the GPU too (the kernel reads x through its layout).
                let op = Op::Expand(Shape::from(&[b, sn, h, d][..]));
                let small_dev = p.up(&small)?;
                let out = [meta(&[b, sn, h, d], dtype)];
                p.gpu.execute(&op, &[&small_dev], &out, &p.at).map_err(s)?.remove(0)
            } else {
                p.up(&x)?
            };
            let out = [meta(&[b, c, h, d], dtype)];
            let want =
                p.cpu.execute(&Op::CacheWrite, &[&cache, &x, &start], &out, &p.at).map_err(s)?;
            let got = p.gpu.execute(&Op::CacheWrite, &[&dc, &dx, &ds], &out, &p.at).map_err(s)?;
            let case = format!(
                "{dtype:?} S={sn} starts={starts:?}{}",
                if expand { " broadcast x" } else { "" }
            );
            if !got[0].same_buffer(&dc) {
                return Err(format!("{case}: the output is not the cache's buffer (a copy)"));
            }
            // The cache input's own handle, read back: written in place.
            let err = crate::rel_err(&p.down(&dc)?, &want[0]).map_err(s)?;
            report("cache_write", &case, err, 0.0, &mut fails);
        }
    }
    // A write past the capacity is refused, as on the CPU.
    let cache = p.up(&rand(&mut st, &[b, c, h, d], DType::F32)?)?;
    let x = p.up(&rand(&mut st, &[b, 3, h, d], DType::F32)?)?;
    let start = p.up(&ints(vec![0, 18])?)?;
    let out = [meta(&[b, c, h, d], DType::F32)];
    let refused = match p.gpu.execute(&Op::CacheWrite, &[&cache, &x, &start], &out, &p.at) {
        Err(e) => e.to_string().contains("beyond the cache"),
        Ok(_) => false,
    };
    report(
        "cache_write",
        "start past the capacity refused",
        if refused { 0.0 } else { 1.0 },
        0.0,
        &mut fails,
    );
    finish(fails)
}

/// Failures of a sub-check's lines, as its error.
fn finish(fails: Vec<String>) -> R<()> {
    if fails.is_empty() {
        Ok(())
    } else {
        Err(fails.join("; "))
    }
}

fn select_positions(gpu: &Arc<Gpu>) -> R<()> {
    let p = Pair::new(gpu);
    let mut st = 0x5E1E_C700_0000_0001u64;
    let mut fails = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        for (dims, idx) in [(vec![3, 7, 5, 4], vec![6i64, 0, 3]), (vec![2, 9, 33], vec![8, 4])] {
            let x = rand(&mut st, &dims, dtype)?;
            let index = ints(idx.clone())?;
            let mut od = dims.clone();
            od[1] = 1;
            let out = [meta(&od, dtype)];
            let want =
                p.cpu.execute(&Op::SelectPositions, &[&x, &index], &out, &p.at).map_err(s)?;
            let (dx, di) = (p.up(&x)?, p.up(&index)?);
            let got = p.gpu.execute(&Op::SelectPositions, &[&dx, &di], &out, &p.at).map_err(s)?;
            let err = crate::rel_err(&p.down(&got[0])?, &want[0]).map_err(s)?;
            report(
                "select_positions",
                &format!("{dtype:?} {dims:?} index {idx:?}"),
                err,
                0.0,
                &mut fails,
            );
        }
    }
    let x = p.up(&rand(&mut st, &[2, 4, 8], DType::F32)?)?;
    let index = p.up(&ints(vec![1, 4])?)?;
    let out = [meta(&[2, 1, 8], DType::F32)];
    let refused = match p.gpu.execute(&Op::SelectPositions, &[&x, &index], &out, &p.at) {
        Err(e) => e.to_string().contains("asks for position 4 of 4"),
        Ok(_) => false,
    };
    report(
        "select_positions",
        "index past the sequence refused",
        if refused { 0.0 } else { 1.0 },
        0.0,
        &mut fails,
    );
    finish(fails)
}

/// Every path of the quantised matmul: (bits, K, group, N, rows of x). Rows ≤ 16 take the
/// per-feature kernel (blocks of 8/4/2/1 rows), more the tiled one; rows of a multiple of 16
/// bytes its vector loads, others the scalar loop; int4 groups of 48 cross 32-feature chunks,
/// odd groups split bytes.
const QCASES: [(u8, usize, usize, usize, usize); 14] = [
    (8, 256, 256, 96, 1),
    (8, 1024, 1024, 130, 3),
    (8, 100, 25, 40, 5),
    (8, 72, 72, 33, 13),
    (4, 256, 128, 96, 1),
    (4, 1024, 128, 200, 8),
    (4, 96, 48, 50, 2),
    (4, 36, 6, 10, 15),
    (4, 18, 3, 7, 4),
    (8, 256, 256, 96, 40),
    (8, 100, 25, 70, 17),
    (4, 512, 128, 130, 100),
    (4, 96, 48, 65, 70),
    (4, 18, 3, 7, 33),
];

fn qmatmul(gpu: &Arc<Gpu>) -> R<()> {
    let p = Pair::new(gpu);
    let mut st = 0x0A11_7E57_0000_0042u64;
    let mut byte = {
        let mut z = 0x1234_5678_9ABC_DEF0u64;
        move || {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            (z >> 56) as u8
        }
    };
    let mut fails = Vec::new();
    for (i, &(bits, k, group, n, m)) in QCASES.iter().enumerate() {
        let q = QuantSpec { bits, group };
        let rb = q.row_bytes(k);
        let codes: Vec<u8> = (0..n * rb).map(|_| byte()).collect();
        let w = Tensor::from_vec(codes, (n, rb), &Device::Cpu).map_err(s)?;
        let sv: Vec<f32> = crate::uniform(&mut st, n * (k / group))
            .iter()
            .map(|u| 0.001 + 0.02 * (u + 1.0))
            .collect();
        let scales = Tensor::from_vec(sv, (n, k / group), &Device::Cpu).map_err(s)?;
        // bf16 x on some cases; a 3-d x on others.
        let dtypes: &[DType] = if i % 3 == 0 { &[DType::F32, DType::BF16] } else { &[DType::F32] };
        for &dtype in dtypes {
            let xd = if i % 2 == 0 && m % 2 == 0 { vec![2, m / 2, k] } else { vec![m, k] };
            let x = rand(&mut st, &xd, dtype)?;
            let mut od = xd.clone();
            *od.last_mut().unwrap_or(&mut 0) = n;
            let out = [meta(&od, dtype)];
            let op = Op::QMatMul(q);
            let want = p.cpu.execute(&op, &[&x, &w, &scales], &out, &p.at).map_err(s)?;
            let (dx, dw, ds) = (p.up(&x)?, p.up(&w)?, p.up(&scales)?);
            let got = p.gpu.execute(&op, &[&dx, &dw, &ds], &out, &p.at).map_err(s)?;
            if got[0].dims() != od.as_slice() || got[0].dtype() != dtype {
                return Err(format!("qmatmul: the GPU gave {} for {}", got[0].meta(), out[0]));
            }
            let err = crate::rel_err(&p.down(&got[0])?, &want[0]).map_err(s)?;
            let path = if m <= 16 { "per-feature" } else { "tiled" };
            let case = format!("int{bits} K={k} group={group} N={n} x={xd:?} {dtype:?} ({path})");
            let bound = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
            report("qmatmul", &case, err, bound, &mut fails);
        }
    }
    finish(fails)
}

/// A generation request's prefill and decode steps for one device, and its quantised weights.
pub(crate) struct Steps {
    pub prefill: StepProgram,
    pub decode: StepProgram,
    pub quantized: Vec<QuantizedLeaf>,
}

pub(crate) fn steps(
    cfg: &ModelConfig,
    batch: usize,
    prompt: usize,
    capacity: usize,
    dtype: DType,
    quantize: Option<Quantize>,
) -> R<Steps> {
    let opts = |seq| GenerateOptions { batch, seq, capacity, dtype, quantize, all_logits: false };
    let pre = build_generation(cfg, &opts(prompt)).map_err(s)?;
    let name = |t| pre.builder.graph.tensor_scope(t).to_string();
    let quantized = pre
        .quantized
        .iter()
        .map(|q| QuantizedLeaf {
            weight: name(q.weight),
            scales: name(q.scales),
            source: q.source.clone(),
            transposed: q.transposed,
            spec: q.spec,
        })
        .collect();
    let dec = build_generation(cfg, &opts(1)).map_err(s)?;
    let step = |m: tessera_models::GenerationModel| {
        let logits = m.logits;
        let program = Program::lower_graph(m.builder.finish(), vec![logits], &[]);
        StepProgram { program, layout: LeafLayout::default(), logits }
    };
    Ok(Steps { prefill: step(pre), decode: step(dec), quantized })
}

/// Fresh weights of `cfg` (the trainer's initialisation from `seed`), by checkpoint name.
pub(crate) fn fresh_weights(cfg: &ModelConfig, seed: u64) -> R<HashMap<String, Tensor>> {
    let g = build(cfg, &BuildOptions::new(1, 1, DType::F32)).map_err(s)?.builder.finish();
    let params = tessera_runtime::init::init_parameters(&g, seed).map_err(s)?;
    Ok(params.into_iter().map(|(t, v)| (g.tensor_scope(t).to_string(), v)).collect())
}

/// `n` token ids below `vocab` from the xorshift state `st`.
pub(crate) fn token_ids(st: &mut u64, n: usize, vocab: usize) -> Vec<i64> {
    (0..n)
        .map(|_| {
            *st ^= *st << 13;
            *st ^= *st >> 7;
            *st ^= *st << 17;
            (*st % vocab.max(1) as u64) as i64
        })
        .collect()
}

/// Greedy generation of `model` (fresh weights) on the GPU against the CPU: two prompts of 9
/// and 5 tokens together, 24 new tokens each, the logits of every step kept.
fn greedy(gpu: &Arc<Gpu>, model: &str, dtype: DType, quant: Option<Quantize>) -> R<()> {
    let cfg = ModelConfig::resolve(model).map_err(s)?.without_dropout();
    let vocab = cfg.vocab_size().ok_or("not a language model")?;
    let mut st = 0x9EED_7000_0000_0007u64;
    let prompts = vec![token_ids(&mut st, 9, vocab), token_ids(&mut st, 5, vocab)];
    let new = 24;
    let plan = steps(&cfg, 2, 9, 9 + new - 1, dtype, quant)?;
    let weights = fresh_weights(&cfg, 7)?;
    let mesh = DeviceMesh::new(&[1, 1], 0).map_err(s)?;
    let cpu = (CpuBackend::new(0), CpuBackend::new(0));
    let want = generate_on(&plan, &weights, &mesh, &prompts, new, cpu)?;
    let be = CudaBackend::new(gpu.clone());
    let got = generate_on(&plan, &weights, &mesh, &prompts, new, (be.clone(), be))?;
    let equal = got.new_tokens == want.new_tokens;
    // The first step whose token differs, per prompt; the logits compared up to there.
    let first: Vec<Option<usize>> = want
        .new_tokens
        .iter()
        .zip(&got.new_tokens)
        .map(|(a, b)| a.iter().zip(b).position(|(x, y)| x != y))
        .collect();
    let same_until = first.iter().map(|f| f.unwrap_or(new)).min().unwrap_or(0);
    let mut worst = 0f64;
    for (sw, sg) in want.step_logits.iter().zip(&got.step_logits).take(same_until + 1) {
        let (a, b): (Vec<f32>, Vec<f32>) = (sg.concat(), sw.concat());
        let n = a.len();
        let ta = Tensor::from_vec(a, n, &Device::Cpu).map_err(s)?;
        let tb = Tensor::from_vec(b, n, &Device::Cpu).map_err(s)?;
        worst = worst.max(crate::rel_err(&ta, &tb).map_err(s)?);
    }
    let gated = dtype == DType::F32;
    let ok = equal || !gated;
    let quant = quant.map_or("null".to_string(), |q| format!("\"{}\"", q.name()));
    let first: Vec<String> =
        first.iter().map(|f| f.map_or("null".to_string(), |i| i.to_string())).collect();
    println!(
        "{{\"check\":\"greedy\",\"model\":\"{model}\",\"dtype\":\"{dtype:?}\",\"quantize\":{quant},\"prompts\":2,\"new_tokens\":{new},\"tokens_equal\":{equal},\"first_difference\":[{}],\"logits_rel_err\":{worst:e},\"gated\":{gated},\"ok\":{ok}}}",
        first.join(",")
    );
    if ok {
        Ok(())
    } else {
        Err(format!(
            "the GPU's tokens {:?} differ from the CPU's {:?}",
            got.new_tokens, want.new_tokens
        ))
    }
}

/// A generation of `prompts` (`new` tokens each, greedy, every step's logits kept) over
/// `backends`.
fn generate_on<B: Backend>(
    plan: &Steps,
    weights: &HashMap<String, Tensor>,
    mesh: &DeviceMesh,
    prompts: &[Vec<i64>],
    new: usize,
    backends: (B, B),
) -> R<Generated> {
    let mut g = Generator::new(
        plan.prefill.clone(),
        plan.decode.clone(),
        backends,
        None,
        mesh.clone(),
        None,
        weights,
        &plan.quantized,
    )
    .map_err(s)?;
    g.keep_logits(true);
    g.generate(prompts, new, &Sampling::default(), None, |_, _| {}).map_err(s)
}
