//! `decode_speed`: tokens/s of greedy decoding with the KV cache on the GPU (fresh weights,
//! batch 1, a 128-token prompt, 128 new tokens, after a warm-up generation), and where a
//! shorter run's GPU time goes per op kind (CUDA events, no synchronisation). The PyTorch
//! figure for the same models, prompt and new tokens is `scripts/torch-generate-bench.py`'s.

use super::{fresh_weights, guarded, json_str, s, steps, token_ids, R};
use std::sync::Arc;
use std::time::Instant;
use tessera_cuda::{CudaBackend, Gpu, OpTimer};
use tessera_ir::DType;
use tessera_models::{ModelConfig, Quantize};
use tessera_runtime::collective::DeviceMesh;
use tessera_runtime::generate::Generator;
use tessera_runtime::sampling::Sampling;

/// Prompt tokens and new tokens of the measured generation (the PyTorch script's defaults).
pub const PROMPT: usize = 128;
pub const NEW: usize = 128;

/// The measured configurations: (model, weights dtype, quantisation).
const CASES: [(&str, DType, Option<Quantize>); 3] = [
    ("gpt2-medium", DType::BF16, None),
    ("gpt2-medium", DType::BF16, Some(Quantize::Int8)),
    ("llama-1.3b", DType::BF16, None),
];

pub fn run(gpu: &Arc<Gpu>, fails: &mut Vec<String>) {
    // Fresh weights are made once per model (the host's initialisation takes seconds).
    let mut weights: Option<(&str, std::collections::HashMap<String, candle_core::Tensor>)> = None;
    for (model, dtype, quant) in CASES {
        let what = format!("{model} {dtype:?} {}", quant.map_or("float", Quantize::name));
        guarded("decode_speed", &what, fails, || {
            let cfg = ModelConfig::resolve(model).map_err(s)?.without_dropout();
            let t0 = Instant::now();
            if weights.as_ref().is_none_or(|(m, _)| *m != model) {
                drop(weights.take()); // the last model's host copy goes first
                weights = Some((model, fresh_weights(&cfg, 7)?));
            }
            let init_s = t0.elapsed().as_secs_f64();
            let w = &weights.as_ref().ok_or("no weights")?.1;
            measure(gpu, model, &cfg, dtype, quant, w, init_s)
        });
    }
}

fn measure(
    gpu: &Arc<Gpu>,
    model: &str,
    cfg: &ModelConfig,
    dtype: DType,
    quant: Option<Quantize>,
    weights: &std::collections::HashMap<String, candle_core::Tensor>,
    init_s: f64,
) -> R<()> {
    let vocab = cfg.vocab_size().ok_or("not a language model")?;
    let plan = steps(cfg, 1, PROMPT, PROMPT + NEW - 1, dtype, quant)?;
    let pg = &plan.prefill.program.graph;
    let weights_bytes: u64 = pg.parameters().into_iter().map(|p| pg.meta(p).size_bytes()).sum();
    let timer = OpTimer::default();
    let be = CudaBackend::new(gpu.clone()).with_op_timer(timer.clone());
    let t0 = Instant::now();
    let mesh = DeviceMesh::new(&[1, 1], 0).map_err(s)?;
    let mut g = Generator::new(
        plan.prefill,
        plan.decode,
        (be.clone(), be),
        None,
        mesh,
        None,
        weights,
        &plan.quantized,
    )
    .map_err(s)?;
    gpu.synchronize().map_err(s)?;
    let load_s = t0.elapsed().as_secs_f64();
    let mut st = 0xDEC0_DE00_0000_0128u64;
    let prompt = vec![token_ids(&mut st, PROMPT, vocab)];
    let greedy = Sampling::default();
    // Warm-up: the allocator plans both Programs' memory, the first launches load the kernels.
    g.generate(&prompt, 8, &greedy, None, |_, _| {}).map_err(s)?;
    gpu.synchronize().map_err(s)?;
    let out = g.generate(&prompt, NEW, &greedy, None, |_, _| {}).map_err(s)?;
    let steps = out.decode_steps;
    let tokens_per_s = steps as f64 / out.decode_s.max(1e-9);
    let total_per_s = out.new_tokens[0].len() as f64 / (out.time_to_first_token_s + out.decode_s);
    // 16 decode steps (and their prefill) with CUDA events around every op: the GPU's own time
    // per op kind, and the span the steps took on the GPU.
    timer.events.store(true, std::sync::atomic::Ordering::Relaxed);
    let timed = g.generate(&prompt, 17, &greedy, None, |_, _| {});
    timer.events.store(false, std::sync::atomic::Ordering::Relaxed);
    timed.map_err(s)?;
    gpu.synchronize().map_err(s)?;
    let (kinds, span) = timer.event_times().map_err(s)?;
    let busy: f64 = kinds.values().map(|v| v.1).sum();
    let mut kinds: Vec<_> = kinds.into_iter().collect();
    kinds.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    let by_op: Vec<String> = kinds
        .iter()
        .map(|(k, (c, secs, _, host))| format!("\"{k}\":[{c},{:.3},{:.3}]", secs * 1e3, host * 1e3))
        .collect();
    let ok = steps + 1 == NEW && tokens_per_s.is_finite() && tokens_per_s > 0.0;
    let quant = quant.map_or("null".to_string(), |q| json_str(q.name()));
    println!(
        "{{\"check\":\"decode_speed\",\"model\":\"{model}\",\"dtype\":\"{dtype:?}\",\"quantize\":{quant},\"batch\":1,\"prompt\":{PROMPT},\"new_tokens\":{NEW},\"decode_steps\":{steps},\"decode_s\":{:.4},\"tokens_per_s\":{tokens_per_s:.1},\"ms_per_token\":{:.3},\"time_to_first_token_s\":{:.4},\"tokens_per_s_with_prefill\":{total_per_s:.1},\"weights_bytes\":{weights_bytes},\"prefill_peak\":{},\"decode_peak\":{},\"init_s\":{init_s:.1},\"load_s\":{load_s:.1},\"events_gpu_busy_s\":{busy:.4},\"events_gpu_span_s\":{span:.4},\"events_by_op_calls_ms_hostms\":{{{}}},\"ok\":{ok}}}",
        out.decode_s,
        1e3 / tokens_per_s,
        out.time_to_first_token_s,
        out.prefill_peak_bytes,
        out.decode_peak_bytes,
        by_op.join(",")
    );
    if ok {
        Ok(())
    } else {
        Err(format!("{steps} decode steps at {tokens_per_s} tokens/s"))
    }
}
