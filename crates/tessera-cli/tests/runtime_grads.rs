//! Whole-model gradients computed by the runtime (f32 CPU kernels) against the f64 reference
//! interpreter on the same graph and the same values: gpt2-tiny, llama-tiny and a tiny BERT
//! (with dropout and ignored labels).

use std::collections::HashMap;
use tessera_ir::interp::{eval_outputs, Value};
use tessera_ir::{gradients, DType, Op, Program, TensorId};
use tessera_models::{build, BuildOptions, InputKind, ModelConfig};
use tessera_runtime::tensor::{from_vec, to_f64_vec};
use tessera_runtime::{CpuBackend, Executor};

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [-1, 1).
fn uniform(seed: u64, i: u64) -> f64 {
    (mix(seed ^ mix(i)) >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

fn check(name: &str, cfg: &ModelConfig, batch: usize, seq: usize) {
    let fm = build(cfg, &BuildOptions { batch, seq, dtype: DType::F32 }).expect("builds");
    let labels = fm.labels();
    let mut b = fm.builder;
    let params = b.graph.parameters();
    let grads: Vec<TensorId> = gradients(&mut b, fm.loss, &params)
        .expect("autodiff")
        .into_iter()
        .map(|g| g.expect("every parameter has a gradient"))
        .collect();
    let graph = b.finish();

    // Values: parameters near a trained model's scale, valid data.
    let mut f32_values: HashMap<TensorId, Vec<f32>> = HashMap::new();
    let mut int_values: HashMap<TensorId, Vec<i64>> = HashMap::new();
    for (k, &p) in params.iter().enumerate() {
        let n = graph.meta(p).numel();
        let is_norm_weight = graph.consumers()[p.index()].iter().any(|&c| {
            let c = graph.node(c);
            matches!(c.op, Op::LayerNorm { .. } | Op::RmsNorm { .. }) && c.inputs[1] == p
        });
        let scale = if graph.shape(p).rank() >= 2 { 0.08 } else { 0.1 };
        let v: Vec<f32> = (0..n)
            .map(|i| {
                let u = uniform(k as u64 + 17, i);
                (if is_norm_weight { 1.0 + 0.2 * u } else { scale * u }) as f32
            })
            .collect();
        f32_values.insert(p, v);
    }
    for input in &fm.inputs {
        let n = graph.meta(input.tensor).numel() as usize;
        let data: Vec<i64> = match input.kind {
            InputKind::TokenIds { vocab_size } => {
                (0..n).map(|i| (mix(i as u64 + 5) % vocab_size as u64) as i64).collect()
            }
            InputKind::TokenTypeIds { type_vocab_size } => {
                (0..n).map(|i| (i % type_vocab_size) as i64).collect()
            }
            InputKind::Labels { num_classes, ignore_index } => (0..n)
                .map(|i| match ignore_index {
                    Some(ig) if i % 3 == 0 => ig,
                    _ => (mix(i as u64 + 99) % num_classes as u64) as i64,
                })
                .collect(),
            InputKind::Seed => vec![12345],
            // An f32 scalar: the labels (bound before it) that are not ignored.
            InputKind::TargetCount => {
                let (labels, ignore) = labels.expect("a target count needs labels");
                let n = int_values[&labels].iter().filter(|&&l| Some(l) != ignore).count();
                f32_values.insert(input.tensor, vec![n as f32]);
                continue;
            }
            InputKind::Pixels
            | InputKind::Features
            | InputKind::Targets
            | InputKind::Timesteps
            | InputKind::Condition
            | InputKind::ClassLabels { .. } => panic!("{name}: token models only"),
            InputKind::CacheStart | InputKind::Positions | InputKind::LastIndex => {
                panic!("{name}: a training graph has no generation inputs")
            }
        };
        int_values.insert(input.tensor, data);
    }

    // Reference: the f64 interpreter on the f32-rounded values.
    let mut bindings = HashMap::new();
    for (&t, v) in &f32_values {
        bindings
            .insert(t, Value::new(graph.shape(t).clone(), v.iter().map(|&x| x as f64).collect()));
    }
    for (&t, v) in &int_values {
        bindings.insert(t, Value::from_i64(graph.shape(t).clone(), v));
    }
    let mut wanted = vec![fm.loss];
    wanted.extend(&grads);
    let reference = eval_outputs(&graph, &bindings, &wanted).expect("interpreter runs");

    // Runtime: the same graph lowered to a Program.
    let program = Program::lower_graph(graph.clone(), wanted.clone(), &grads);
    let mut exec = Executor::new(program, CpuBackend::new(0), None);
    for (&t, v) in &f32_values {
        exec.bind(t, from_vec(v.clone(), graph.shape(t).dims()).unwrap()).unwrap();
    }
    for (&t, v) in &int_values {
        let dims = graph.shape(t).dims();
        exec.bind(t, from_vec(v.clone(), dims).unwrap()).unwrap();
    }
    exec.run().expect("runtime runs");

    // A key bias has an exactly zero gradient (softmax ignores a constant shift of a row), so
    // relative error is measured against max(‖reference‖, 1e-3 · ‖all gradients‖).
    let total: f64 = reference[1..].iter().flat_map(|v| &v.data).map(|x| x * x).sum::<f64>().sqrt();
    for (k, (&t, want)) in wanted.iter().zip(&reference).enumerate() {
        let got = to_f64_vec(exec.get(t).expect("output kept")).unwrap();
        let diff: f64 =
            got.iter().zip(&want.data).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
        let norm: f64 = want.data.iter().map(|b| b * b).sum::<f64>().sqrt();
        let floor = if k == 0 { 0.0 } else { 1e-3 * total };
        assert!(norm.max(floor) > 0.0, "{name}: output {k} is identically zero");
        let rel = diff / norm.max(floor);
        let what = if k == 0 {
            "loss".to_string()
        } else {
            format!("grad of {}", graph.tensor_scope(params[k - 1]))
        };
        assert!(rel < 1e-4, "{name}: {what}: relative error {rel:.2e}");
    }
}

#[test]
fn gpt2_tiny_gradients_match_the_interpreter() {
    check("gpt2-tiny", &ModelConfig::preset("gpt2-tiny").unwrap(), 2, 16);
}

#[test]
fn llama_tiny_gradients_match_the_interpreter() {
    check("llama-tiny", &ModelConfig::preset("llama-tiny").unwrap(), 2, 16);
}

#[test]
fn tiny_bert_gradients_match_the_interpreter() {
    let cfg = ModelConfig::from_hf_json(
        r#"{"model_type": "bert", "vocab_size": 120, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 32,
            "hidden_dropout_prob": 0.1}"#,
    )
    .unwrap();
    check("tiny bert", &cfg, 2, 16);
}
