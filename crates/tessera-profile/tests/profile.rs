//! The profiler against independent references: the published FLOP figures (DESIGN.md §6),
//! closed-form FLOP and activation formulas written from the model dimensions (not from the
//! graph), and the 16 bytes/parameter of AdamW model state.

use tessera_ir::{build_training_graph, DType, Instr, Program, Role, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_profile::{count_flops, profile, simulate_memory, Profile};

fn program(model: &str, batch: usize, seq: usize, dtype: DType) -> Program {
    let cfg = ModelConfig::resolve(model).expect("preset");
    let fm = build(&cfg, &BuildOptions { batch, seq, dtype }).expect("builds");
    let tg = build_training_graph(fm.builder, fm.loss, &TrainConfig::default()).expect("trains");
    Program::lower(tg)
}

fn prof(model: &str, batch: usize, seq: usize, dtype: DType) -> Profile {
    profile(&program(model, batch, seq, dtype))
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

#[test]
fn matmul_flops_match_published_figures() {
    // DESIGN.md §6: batch 1, seq 1024, forward + backward, 2·m·n·k, dense attention.
    for (model, want) in [("gpt2", 874_944_921_600u64), ("gpt2-xl", 10_520_110_694_400)] {
        let got = count_flops(program(model, 1, 1024, DType::F32).graph()).matmul;
        let e = rel(got as f64, want as f64);
        assert!(e < 0.01, "{model}: flops.matmul {got} vs published {want} ({:.3}%)", e * 100.0);
    }
}

/// 6·N_matmul·tokens + 12·L·h·s·tokens with N_matmul written from the dimensions.
fn analytic_matmul_flops(
    n_matmul: u64,
    layers: u64,
    attn_width: u64,
    seq: u64,
    tokens: u64,
) -> u64 {
    6 * n_matmul * tokens + 12 * layers * attn_width * seq * tokens
}

#[test]
fn matmul_flops_match_the_6n_plus_attention_formula() {
    struct Case {
        model: &'static str,
        batch: u64,
        seq: u64,
        n_matmul: u64,
        layers: u64,
        attn_width: u64,
    }
    // GPT-2 family: per layer c_attn D·3D, c_proj D·D, c_fc D·4D, mlp c_proj 4D·D; lm_head V·D.
    let gpt = |l: u64, d: u64, v: u64| l * (3 * d * d + d * d + 8 * d * d) + v * d;
    // LLaMA: q D·H·Dh, k and v D·Hkv·Dh each, o H·Dh·D, gate/up/down 3·D·I; lm_head V·D.
    let llama =
        |l: u64, d: u64, kv: u64, i: u64, v: u64| l * (2 * d * d + 2 * d * kv + 3 * d * i) + v * d;
    let cases = [
        Case {
            model: "gpt2",
            batch: 2,
            seq: 256,
            n_matmul: gpt(12, 768, 50257),
            layers: 12,
            attn_width: 768,
        },
        Case {
            model: "gpt2-medium",
            batch: 1,
            seq: 512,
            n_matmul: gpt(24, 1024, 50257),
            layers: 24,
            attn_width: 1024,
        },
        Case {
            model: "llama2-7b",
            batch: 1,
            seq: 512,
            n_matmul: llama(32, 4096, 4096, 11008, 32000),
            layers: 32,
            attn_width: 4096,
        },
        // Llama-3-8B: GQA with 8 KV heads of 128 → k/v width 1024.
        Case {
            model: "llama3-8b",
            batch: 2,
            seq: 256,
            n_matmul: llama(32, 4096, 1024, 14336, 128256),
            layers: 32,
            attn_width: 4096,
        },
        Case {
            model: "llama-tiny",
            batch: 4,
            seq: 64,
            n_matmul: llama(8, 256, 128, 688, 256),
            layers: 8,
            attn_width: 256,
        },
    ];
    for c in cases {
        let got =
            count_flops(program(c.model, c.batch as usize, c.seq as usize, DType::F32).graph())
                .matmul;
        let want =
            analytic_matmul_flops(c.n_matmul, c.layers, c.attn_width, c.seq, c.batch * c.seq);
        let e = rel(got as f64, want as f64);
        assert!(e < 0.005, "{}: {got} vs formula {want} ({:.3}%)", c.model, e * 100.0);
    }
}

#[test]
fn gpt_block_saved_activations_match_closed_form() {
    // Per GPT-2 block, with our fused attention (no s×s scores) and counter-based dropout (no
    // masks), the backward pass reads these forward values, each B·S wide:
    //   the block's two residual-stream values — ln_1's and ln_2's inputs (D each), kept in
    //   fp32 whatever the compute dtype (an fp32 residual connection) —
    //   and, in the compute dtype: ln_1 output / c_attn input (D), q, k, v (3·D), attention
    //   output / c_proj input (D), ln_2 output / c_fc input (D), GELU input (4·D), GELU output /
    //   mlp c_proj input (4·D) → 14·D elements per token,
    // plus the attention's log-sum-exp, H per token in f32.
    for (model, d, h, dtype) in [
        ("gpt2", 768u64, 12u64, DType::F32),
        ("gpt2", 768, 12, DType::BF16),
        ("gpt2-tiny", 256, 8, DType::F32),
    ] {
        for (batch, seq) in [(1u64, 128u64), (4, 64)] {
            let p = prof(model, batch as usize, seq as usize, dtype);
            let tokens = batch * seq;
            let want = (2 * 4 + 14 * dtype.size_bytes()) * d * tokens + h * tokens * 4;
            let blocks = &p.memory.activations_by_block;
            assert!(blocks.len() > 2, "{model}: no blocks tagged");
            for (i, &got) in blocks.iter().enumerate() {
                assert_eq!(
                    got, want,
                    "{model} {dtype} b{batch} s{seq}: block {i} saves {got} B, formula {want} B"
                );
            }
        }
    }
}

/// How many of `model`'s parameters bf16 mixed precision holds in fp32: the norms' weights
/// and biases (autocast's policy), counted by name.
fn held_in_fp32(model: &str) -> u64 {
    let cfg = ModelConfig::resolve(model).expect("preset");
    let g =
        build(&cfg, &BuildOptions { batch: 1, seq: 32, dtype: DType::F32 }).unwrap().builder.graph;
    let fp32 = |n: &str| ["ln_", "norm"].iter().any(|k| n.contains(k));
    g.parameters()
        .into_iter()
        .filter(|&p| fp32(g.tensor_scope(p)))
        .map(|p| g.shape(p).numel() as u64)
        .sum()
}

#[test]
fn model_state_is_sixteen_bytes_per_parameter() {
    for dtype in [DType::F32, DType::BF16] {
        for model in ["gpt2-tiny", "llama-tiny", "gpt2"] {
            let p = prof(model, 1, 32, dtype);
            let m = &p.memory;
            let per = dtype.size_bytes();
            // fp32 parameters: weight, grad, m, v (16 bytes); half ones: weight, grad, m, v,
            // fp32 master (2 + 2 + 12 bytes).
            let full = if dtype == DType::F32 { p.params } else { held_in_fp32(model) };
            assert!(full > 0 && full < p.params || dtype == DType::F32, "{model}: {full}");
            let half = p.params - full;
            assert_eq!(m.params_bytes, per * half + 4 * full, "{model} {dtype} weights");
            assert_eq!(m.grads_bytes, per * half + 4 * full, "{model} {dtype} grads");
            let state = 8 + if dtype == DType::F32 { 0 } else { 4 };
            assert_eq!(
                m.optimizer_bytes,
                state * half + 8 * full,
                "{model} {dtype} optimizer state"
            );
            assert_eq!(m.params_bytes + m.grads_bytes + m.optimizer_bytes, 16 * p.params);
        }
    }
}

#[test]
fn program_frees_every_step_buffer_exactly_once() {
    let prog = program("llama-tiny", 2, 32, DType::F32);
    let g = prog.graph();
    let mut freed = vec![0u32; g.tensors.len()];
    for i in &prog.instrs {
        if let Instr::Free(t) = *i {
            assert_eq!(prog.buffer_of[t.index()], t, "only buffer roots are freed");
            freed[t.index()] += 1;
        }
    }
    let out: std::collections::HashSet<_> = prog.live_out.iter().copied().collect();
    for (t, &root) in prog.buffer_of.iter().enumerate() {
        if root.index() != t {
            continue;
        }
        let keeps = out.contains(&root);
        let expected = if keeps { 0 } else { 1 };
        assert_eq!(freed[t], expected, "buffer {} ({:?})", g.tensor_scope(root), prog.role[t]);
    }
    // After the step exactly parameters, optimizer state, loss and grad norm remain.
    let trace = simulate_memory(&prog);
    let end = trace.timeline.last().expect("non-empty").live_bytes;
    let resident: u64 = prog.live_out.iter().map(|&t| g.meta(t).size_bytes()).sum();
    assert_eq!(end, resident);
    let model_state: u64 = prog
        .live_out
        .iter()
        .filter(|t| matches!(prog.role[t.index()], Role::Parameter | Role::OptimizerState))
        .map(|&t| g.meta(t).size_bytes())
        .sum();
    assert_eq!(resident - model_state, 8, "loss and grad norm: two f32 scalars");
}

#[test]
fn peak_covers_model_state_and_saved_activations() {
    // At the start of the backward pass every saved activation and all model state except
    // gradients are live; the peak cannot be lower than that.
    let p = prof("gpt2-tiny", 4, 128, DType::F32);
    let m = &p.memory;
    assert!(m.peak_bytes >= m.params_bytes + m.optimizer_bytes + m.activations_bytes);
    // ... and cannot exceed everything ever allocated at once.
    let by_role: u64 = m.peak_by_role.iter().map(|(_, b)| b).sum();
    assert_eq!(by_role, m.peak_bytes, "the peak's breakdown adds up");
}
