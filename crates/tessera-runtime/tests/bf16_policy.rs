//! bf16 mixed precision holds the norms' weights in fp32, as autocast does: a change to a norm weight smaller than a bf16 ulp at 1 (what ~10 AdamW steps
//! at lr 3e-4 make) must reach the bf16 forward as it reaches the fp32 one. Held in bf16, the
//! weight rounds back to 1 and the loss does not move at all (`scripts/bf16_grad_budget.py`
//! found this the main part of bf16's extra loss error over autocast's).

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_ir::{DType, Program};
use tessera_models::{
    build, BuildOptions, Gpt2Params, InputKind, LlamaParams, LlamaVariant, ModelConfig,
};
use tessera_runtime::tensor::{candle_dtype, to_f64_vec};
use tessera_runtime::{CpuBackend, Executor};

const BATCH: usize = 8;
const SEQ: usize = 16;

fn gpt2() -> ModelConfig {
    let p = Gpt2Params::new("gpt2-policy-test", 64, 16, 32, 2, 4);
    ModelConfig::Gpt2(tessera_models::Gpt2Config::new(p).unwrap())
}

fn llama() -> ModelConfig {
    let mut p = LlamaParams::new(LlamaVariant::Llama, "llama-policy-test", 64, 32, 48, 2, 4);
    p.num_key_value_heads = 2;
    ModelConfig::Llama(tessera_models::LlamaConfig::new(p).unwrap())
}

fn is_norm(name: &str) -> bool {
    name.contains("ln_") || name.contains("norm")
}

/// The mean next-token loss of `cfg` in `dtype` on fixed tokens, every parameter drawn from one
/// seeded generator (by name order, so both dtypes get the same values before rounding) and
/// each norm weight set to `norm_weight`.
fn loss(cfg: &ModelConfig, dtype: DType, norm_weight: f32) -> f64 {
    let model = build(cfg, &BuildOptions::new(BATCH, SEQ, dtype)).unwrap();
    let graph = model.builder.finish();
    let mut params: Vec<_> = graph.parameters();
    params.sort_by_key(|&p| graph.tensor_scope(p).to_string());
    let mut rng = StdRng::seed_from_u64(7);
    let mut values = Vec::new();
    for &p in &params {
        let name = graph.tensor_scope(p).to_string();
        let dims = graph.shape(p).dims().to_vec();
        let n: usize = dims.iter().product();
        let data: Vec<f32> = if is_norm(&name) && name.ends_with("weight") {
            vec![norm_weight; n]
        } else {
            // Large enough for logits far from uniform (the loss then depends on their scale).
            (0..n).map(|_| rng.random_range(-0.5f32..0.5)).collect()
        };
        let t = Tensor::from_vec(data, dims.as_slice(), &Device::Cpu).unwrap();
        values.push((p, t.to_dtype(candle_dtype(graph.meta(p).dtype)).unwrap()));
    }
    for input in &model.inputs {
        let dims = graph.shape(input.tensor).dims().to_vec();
        let d = candle_dtype(graph.meta(input.tensor).dtype);
        let n: usize = dims.iter().product();
        let t = match input.kind {
            InputKind::TokenIds { .. } | InputKind::Labels { .. } => {
                let ids: Vec<i64> = (0..n as i64).map(|i| (i * 37 + 11) % 64).collect();
                Tensor::from_vec(ids, dims.as_slice(), &Device::Cpu).unwrap()
            }
            InputKind::TargetCount => Tensor::new(n.max(BATCH * SEQ) as f32, &Device::Cpu).unwrap(),
            _ => Tensor::zeros(dims.as_slice(), d, &Device::Cpu).unwrap(),
        };
        values.push((input.tensor, t.to_dtype(d).unwrap()));
    }
    let program = Program::lower_graph(graph, vec![model.loss], &[]);
    let mut exec = Executor::new(program, CpuBackend::new(0), None);
    for (t, v) in values {
        exec.bind(t, v).unwrap();
    }
    exec.run().unwrap();
    to_f64_vec(exec.get(model.loss).unwrap()).unwrap()[0]
}

fn check(cfg: &ModelConfig) {
    // 1 + 3.5e-3 rounds to 1 in bf16 (the ulp above 1 is 2⁻⁷ ≈ 7.8e-3).
    let w = 1.0 + 3.5e-3f32;
    assert_eq!(half::bf16::from_f32(w).to_f32(), 1.0);
    let d32 = loss(cfg, DType::F32, w) - loss(cfg, DType::F32, 1.0);
    let d16 = loss(cfg, DType::BF16, w) - loss(cfg, DType::BF16, 1.0);
    assert!(d32.abs() > 1e-4, "{}: the fp32 loss barely moves ({d32:e}): no test", cfg.name());
    // Held in bf16 the weights round to 1 and `d16` is exactly 0; held in fp32 it follows
    // `d32` up to the bf16 forward's own rounding, which 128 tokens average down.
    assert!(
        (d16 - d32).abs() <= 0.5 * d32.abs(),
        "{}: scaling the norm weights by 1 + 3.5e-3 moves the fp32 loss by {d32:e} but the bf16 \
         loss by {d16:e}",
        cfg.name()
    );
}

#[test]
fn bf16_forward_sees_sub_ulp_norm_updates_gpt2() {
    check(&gpt2());
}

#[test]
fn bf16_forward_sees_sub_ulp_norm_updates_llama() {
    check(&llama());
}

#[test]
fn bf16_holds_the_norms_in_fp32_and_the_rest_in_bf16() {
    for cfg in [gpt2(), llama()] {
        let graph = build(&cfg, &BuildOptions::new(BATCH, SEQ, DType::BF16)).unwrap().builder.graph;
        for p in graph.parameters() {
            let name = graph.tensor_scope(p);
            let want = if is_norm(name) { DType::F32 } else { DType::BF16 };
            assert_eq!(graph.meta(p).dtype, want, "{}: {name}", cfg.name());
        }
    }
}
