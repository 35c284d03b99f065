//! Built graphs: every preset builds and differentiates, parameters carry their Hugging Face
//! names and shapes, blocks are tagged, dropout and inputs are as documented, dtypes follow
//! the options, and the training FLOPs equal the reference figures.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use tessera_ir::{build_training_graph, DType, Graph, Op, TensorMeta, TrainConfig};
use tessera_models::{build, BuildOptions, ForwardModel, InputKind, ModelConfig, PRESETS};

fn model(name: &str, batch: usize, seq: usize, dtype: DType) -> ForwardModel {
    let cfg = ModelConfig::preset(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    build(&cfg, &BuildOptions::new(batch, seq, dtype)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Parameter name → shape.
fn params(g: &Graph) -> BTreeMap<String, Vec<usize>> {
    g.parameters()
        .into_iter()
        .map(|p| (g.tensor_scope(p).to_string(), g.shape(p).dims().to_vec()))
        .collect()
}

fn ops_named<'a>(g: &'a Graph, name: &'a str) -> impl Iterator<Item = &'a tessera_ir::Node> + 'a {
    g.nodes.iter().filter(move |n| n.op.name() == name)
}

#[test]
fn every_preset_builds_and_differentiates() {
    for &name in PRESETS {
        let cfg = ModelConfig::preset(name).unwrap();
        let m = build(&cfg, &BuildOptions::new(1, 16, DType::F32))
            .unwrap_or_else(|e| panic!("{name}: build: {e}"));
        let expected_seq = match name {
            "vit-base" => 197, // 14·14 patches + [CLS]
            "vit-tiny" => 17,  // 4·4 patches + [CLS]
            "dit-xl-2" => 256, // 16·16 patches
            "dit-tiny" => 16,  // 4·4 patches
            "mlp" => 1,
            _ => 16,
        };
        assert_eq!(m.seq, expected_seq, "{name}: effective seq");
        let g = &m.builder.graph;
        assert_eq!(g.meta(m.loss), &TensorMeta::new([], DType::F32), "{name}: loss");
        let declared: Vec<_> = m.inputs.iter().map(|i| i.tensor).collect();
        assert_eq!(declared, g.inputs(), "{name}: ForwardModel.inputs lists every graph input");
        let num_params = g.parameters().len();
        let t = build_training_graph(m.builder, m.loss, &TrainConfig::default())
            .unwrap_or_else(|e| panic!("{name}: training graph: {e}"));
        assert_eq!(t.params.len(), num_params, "{name}: one optimizer slot per parameter");
        assert!(t.params.iter().all(|s| s.master.is_none()), "{name}: f32 needs no master copy");
    }
}

#[test]
fn bf16_build_has_bf16_parameters_and_an_f32_loss() {
    for &name in PRESETS {
        let m = model(name, 2, 8, DType::BF16);
        let g = &m.builder.graph;
        let consumers = g.consumers();
        // The norms on the fp32 residual stream hold fp32 weights (autocast's policy): a
        // parameter read only by a LayerNorm/RMSNorm whose input is f32.
        let fp32_norm = |p: tessera_ir::TensorId| {
            let uses = &consumers[p.index()];
            !uses.is_empty()
                && uses.iter().all(|&u| {
                    let n = g.node(u);
                    matches!(n.op, Op::LayerNorm { .. } | Op::RmsNorm { .. })
                        && g.meta(n.inputs[0]).dtype == DType::F32
                })
        };
        let not_bf16: Vec<String> = g
            .parameters()
            .into_iter()
            .filter(|&p| g.meta(p).dtype != DType::BF16)
            .filter(|&p| !(g.meta(p).dtype == DType::F32 && fp32_norm(p)))
            // DeepSeek-V3's router correction bias stays f32, as in the Hub's checkpoints.
            .filter(|&p| !g.tensor_scope(p).ends_with("e_score_correction_bias"))
            .map(|p| g.tensor_scope(p).to_string())
            .collect();
        assert!(not_bf16.is_empty(), "{name}: parameters not bf16: {not_bf16:?}");
        let bf16_norms = g
            .parameters()
            .into_iter()
            .filter(|&p| g.meta(p).dtype == DType::BF16 && fp32_norm(p))
            .map(|p| g.tensor_scope(p).to_string())
            .collect::<Vec<_>>();
        assert!(bf16_norms.is_empty(), "{name}: bf16 norms on the fp32 stream: {bf16_norms:?}");
        assert_eq!(g.meta(m.logits).dtype, DType::BF16, "{name}: logits");
        assert_eq!(g.meta(m.loss).dtype, DType::F32, "{name}: loss");
        let t = build_training_graph(m.builder, m.loss, &TrainConfig::default()).unwrap();
        let f32_params = t.params.iter().filter(|s| t.graph.meta(s.param).dtype == DType::F32);
        assert!(f32_params.clone().all(|s| s.master.is_none()), "{name}: f32 needs no master");
        let low = t.params.iter().filter(|s| t.graph.meta(s.param).dtype == DType::BF16);
        assert!(low.clone().all(|s| s.master.is_some()), "{name}: fp32 master weights");
        assert!(low.count() > f32_params.count(), "{name}: mostly bf16 parameters");
    }
}

/// Every node whose scope lies under `prefix(i)` has block `Some(i)`, and every node with a
/// block lies under its layer's prefix.
fn check_blocks(name: &str, prefix: impl Fn(usize) -> String) {
    let cfg = ModelConfig::preset(name).unwrap();
    let m = build(&cfg, &BuildOptions::new(1, 16, DType::F32)).unwrap();
    let g = &m.builder.graph;
    let under = |scope: &str, i: usize| {
        let p = prefix(i);
        scope == p || scope.strip_prefix(&p).is_some_and(|rest| rest.starts_with('.'))
    };
    let mut per_block = vec![0usize; cfg.num_blocks()];
    for n in &g.nodes {
        let scope = g.scope_name(n.scope);
        let layer = (0..cfg.num_blocks()).find(|&i| under(scope, i));
        assert_eq!(
            n.block,
            layer.map(|i| i as u32),
            "{name}: {} node in scope {scope}",
            n.op.name()
        );
        if let Some(i) = layer {
            per_block[i] += 1;
        }
    }
    assert!(per_block.iter().all(|&c| c > 0 && c == per_block[0]), "{name}: {per_block:?}");
}

#[test]
fn gpt2_layer_3_nodes_are_block_3() {
    let m = model("gpt2", 1, 16, DType::F32);
    let g = &m.builder.graph;
    let in_layer_3: Vec<_> = g
        .nodes
        .iter()
        .filter(|n| {
            let s = g.scope_name(n.scope);
            s == "transformer.h.3" || s.starts_with("transformer.h.3.")
        })
        .collect();
    assert!(in_layer_3.len() > 20, "{}", in_layer_3.len());
    assert!(in_layer_3.iter().all(|n| n.block == Some(3)));
    let block_3 = g.nodes.iter().filter(|n| n.block == Some(3)).count();
    assert_eq!(block_3, in_layer_3.len(), "no node outside transformer.h.3 is block 3");
}

#[test]
fn every_family_tags_exactly_its_layer_nodes() {
    check_blocks("gpt2", |i| format!("transformer.h.{i}"));
    check_blocks("llama-tiny", |i| format!("model.layers.{i}"));
    check_blocks("bert-large", |i| format!("bert.encoder.layer.{i}"));
    check_blocks("vit-base", |i| format!("vit.encoder.layer.{i}"));
    check_blocks("mlp", |i| format!("layers.{i}"));
    check_blocks("bloom-tiny", |i| format!("transformer.h.{i}"));
}

/// `expected` as a name → shape map.
fn table(entries: Vec<(String, Vec<usize>)>) -> BTreeMap<String, Vec<usize>> {
    let len = entries.len();
    let map: BTreeMap<_, _> = entries.into_iter().collect();
    assert_eq!(map.len(), len, "duplicate names in the expected table");
    map
}

#[test]
fn gpt2_parameters_have_hf_names_and_conv1d_shapes() {
    let (v, p, d, l) = (50257, 1024, 768, 12);
    let mut want = vec![
        ("transformer.wte.weight".to_string(), vec![v, d]),
        ("transformer.wpe.weight".to_string(), vec![p, d]),
        ("transformer.ln_f.weight".to_string(), vec![d]),
        ("transformer.ln_f.bias".to_string(), vec![d]),
    ];
    for i in 0..l {
        let h = format!("transformer.h.{i}");
        want.extend([
            (format!("{h}.ln_1.weight"), vec![d]),
            (format!("{h}.ln_1.bias"), vec![d]),
            (format!("{h}.attn.c_attn.weight"), vec![d, 3 * d]),
            (format!("{h}.attn.c_attn.bias"), vec![3 * d]),
            (format!("{h}.attn.c_proj.weight"), vec![d, d]),
            (format!("{h}.attn.c_proj.bias"), vec![d]),
            (format!("{h}.ln_2.weight"), vec![d]),
            (format!("{h}.ln_2.bias"), vec![d]),
            (format!("{h}.mlp.c_fc.weight"), vec![d, 4 * d]),
            (format!("{h}.mlp.c_fc.bias"), vec![4 * d]),
            (format!("{h}.mlp.c_proj.weight"), vec![4 * d, d]),
            (format!("{h}.mlp.c_proj.bias"), vec![d]),
        ]);
    }
    let m = model("gpt2", 1, 16, DType::F32);
    assert_eq!(params(&m.builder.graph), table(want));
    // lm_head is the tied wte: a matmul against it with trans_b.
    let g = &m.builder.graph;
    let head = g.producer(m.logits);
    assert_eq!(head.op, Op::MatMul { trans_a: false, trans_b: true });
    assert_eq!(g.tensor_scope(head.inputs[1]), "transformer.wte.weight");
}

#[test]
fn llama2_70b_parameters_have_hf_names_and_gqa_shapes() {
    let (v, d, i, kv) = (32000, 8192, 28672, 8 * 128);
    let mut want = vec![
        ("model.embed_tokens.weight".to_string(), vec![v, d]),
        ("model.norm.weight".to_string(), vec![d]),
        ("lm_head.weight".to_string(), vec![v, d]),
    ];
    for layer in 0..80 {
        let p = format!("model.layers.{layer}");
        want.extend([
            (format!("{p}.input_layernorm.weight"), vec![d]),
            (format!("{p}.self_attn.q_proj.weight"), vec![d, d]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, d]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, d]),
            (format!("{p}.self_attn.o_proj.weight"), vec![d, d]),
            (format!("{p}.post_attention_layernorm.weight"), vec![d]),
            (format!("{p}.mlp.gate_proj.weight"), vec![i, d]),
            (format!("{p}.mlp.up_proj.weight"), vec![i, d]),
            (format!("{p}.mlp.down_proj.weight"), vec![d, i]),
        ]);
    }
    let m = model("llama2-70b", 1, 16, DType::BF16);
    let g = &m.builder.graph;
    assert_eq!(params(g), table(want));
    // GQA: k and v enter attention with 8 heads of 128, q with 64; RoPE on q and k only.
    let attn = ops_named(g, "attention").next().unwrap();
    let dims = |t| g.shape(t).dims().to_vec();
    assert_eq!(dims(attn.inputs[0]), vec![1, 16, 64, 128]);
    assert_eq!(dims(attn.inputs[1]), vec![1, 16, 8, 128]);
    assert_eq!(ops_named(g, "rope").count(), 2 * 80);
    let Op::Attention(spec) = &attn.op else { unreachable!() };
    assert!(spec.causal && spec.window.is_none());
    assert!((spec.scale - 1.0 / 128f64.sqrt()).abs() < 1e-15);
}

#[test]
fn bert_large_parameters_have_hf_names() {
    let (v, p, t, d, i) = (30522, 512, 2, 1024, 4096);
    let mut want = vec![
        ("bert.embeddings.word_embeddings.weight".to_string(), vec![v, d]),
        ("bert.embeddings.position_embeddings.weight".to_string(), vec![p, d]),
        ("bert.embeddings.token_type_embeddings.weight".to_string(), vec![t, d]),
        ("bert.embeddings.LayerNorm.weight".to_string(), vec![d]),
        ("bert.embeddings.LayerNorm.bias".to_string(), vec![d]),
        ("cls.predictions.transform.dense.weight".to_string(), vec![d, d]),
        ("cls.predictions.transform.dense.bias".to_string(), vec![d]),
        ("cls.predictions.transform.LayerNorm.weight".to_string(), vec![d]),
        ("cls.predictions.transform.LayerNorm.bias".to_string(), vec![d]),
        ("cls.predictions.bias".to_string(), vec![v]),
    ];
    for layer in 0..24 {
        let l = format!("bert.encoder.layer.{layer}");
        for (name, shape) in [
            ("attention.self.query.weight", vec![d, d]),
            ("attention.self.query.bias", vec![d]),
            ("attention.self.key.weight", vec![d, d]),
            ("attention.self.key.bias", vec![d]),
            ("attention.self.value.weight", vec![d, d]),
            ("attention.self.value.bias", vec![d]),
            ("attention.output.dense.weight", vec![d, d]),
            ("attention.output.dense.bias", vec![d]),
            ("attention.output.LayerNorm.weight", vec![d]),
            ("attention.output.LayerNorm.bias", vec![d]),
            ("intermediate.dense.weight", vec![i, d]),
            ("intermediate.dense.bias", vec![i]),
            ("output.dense.weight", vec![d, i]),
            ("output.dense.bias", vec![d]),
            ("output.LayerNorm.weight", vec![d]),
            ("output.LayerNorm.bias", vec![d]),
        ] {
            want.push((format!("{l}.{name}"), shape));
        }
    }
    let m = model("bert-large", 1, 16, DType::F32);
    let g = &m.builder.graph;
    assert_eq!(params(g), table(want));
    assert!(ops_named(g, "attention").all(|n| matches!(&n.op, Op::Attention(s) if !s.causal)));
    // The mean over the step's targets: their summed cross-entropy over `num_targets`.
    let loss = g.producer(m.loss);
    assert_eq!(loss.op, Op::Binary(tessera_ir::BinaryOp::Div));
    let sum = g.producer(loss.inputs[0]);
    assert_eq!(sum.op, Op::CrossEntropy { ignore_index: Some(-100), sum: true, classes: None });
    assert_eq!(g.find_leaf("num_targets"), Some(loss.inputs[1]));
}

#[test]
fn vit_base_parameters_inputs_and_sequence() {
    let (d, i, n) = (768, 3072, 196);
    let mut want = vec![
        ("vit.embeddings.cls_token".to_string(), vec![1, 1, d]),
        ("vit.embeddings.position_embeddings".to_string(), vec![1, n + 1, d]),
        ("vit.embeddings.patch_embeddings.projection.weight".to_string(), vec![d, 3, 16, 16]),
        ("vit.embeddings.patch_embeddings.projection.bias".to_string(), vec![d]),
        ("vit.layernorm.weight".to_string(), vec![d]),
        ("vit.layernorm.bias".to_string(), vec![d]),
        ("classifier.weight".to_string(), vec![1000, d]),
        ("classifier.bias".to_string(), vec![1000]),
    ];
    for layer in 0..12 {
        let l = format!("vit.encoder.layer.{layer}");
        for (name, shape) in [
            ("layernorm_before.weight", vec![d]),
            ("layernorm_before.bias", vec![d]),
            ("attention.attention.query.weight", vec![d, d]),
            ("attention.attention.query.bias", vec![d]),
            ("attention.attention.key.weight", vec![d, d]),
            ("attention.attention.key.bias", vec![d]),
            ("attention.attention.value.weight", vec![d, d]),
            ("attention.attention.value.bias", vec![d]),
            ("attention.output.dense.weight", vec![d, d]),
            ("attention.output.dense.bias", vec![d]),
            ("layernorm_after.weight", vec![d]),
            ("layernorm_after.bias", vec![d]),
            ("intermediate.dense.weight", vec![i, d]),
            ("intermediate.dense.bias", vec![i]),
            ("output.dense.weight", vec![d, i]),
            ("output.dense.bias", vec![d]),
        ] {
            want.push((format!("{l}.{name}"), shape));
        }
    }
    // --seq does not apply: 5 is ignored.
    let m = model("vit-base", 2, 5, DType::F32);
    let g = &m.builder.graph;
    assert_eq!(params(g), table(want));
    assert_eq!(m.seq, 197);
    let pixels = m.input("pixel_values").unwrap();
    assert_eq!(g.meta(pixels), &TensorMeta::new([2, 3, 224, 224], DType::F32));
    assert_eq!(g.meta(m.input("labels").unwrap()), &TensorMeta::new([2], DType::I64));
    assert_eq!(g.shape(m.logits).dims(), &[2, 1000]);
    let attn = ops_named(g, "attention").next().unwrap();
    assert_eq!(g.shape(attn.inputs[0]).dims(), &[2, 197, 12, 64]);
}

#[test]
fn inputs_are_named_and_described() {
    let names = |m: &ForwardModel| m.inputs.iter().map(|i| i.name).collect::<Vec<_>>();
    // Causal LMs count their targets as BERT does: prompt tokens and padding are ignored
    // (−100) in fine-tuning data, and the mean stays the single-device one on every plan.
    let lm = ["input_ids", "labels", "num_targets"];
    assert_eq!(names(&model("gpt2", 1, 8, DType::F32)), [&lm[..], &["seed"]].concat());
    assert_eq!(names(&model("gpt2-tiny", 1, 8, DType::F32)), lm);
    assert_eq!(names(&model("llama-tiny", 1, 8, DType::F32)), lm);
    assert_eq!(names(&model("bloom-tiny", 1, 8, DType::F32)), lm);
    let bert = model("bert-large", 1, 8, DType::F32);
    assert_eq!(names(&bert), ["input_ids", "token_type_ids", "labels", "num_targets", "seed"]);
    assert_eq!(bert.inputs[1].kind, InputKind::TokenTypeIds { type_vocab_size: 2 });
    assert_eq!(
        bert.inputs[2].kind,
        InputKind::Labels { num_classes: 30522, ignore_index: Some(-100) }
    );
    assert_eq!(bert.inputs[3].kind, InputKind::TargetCount);
    assert_eq!(names(&model("vit-base", 1, 8, DType::F32)), ["pixel_values", "labels"]);
    let mlp = model("mlp", 4, 8, DType::F32);
    assert_eq!(names(&mlp), ["inputs", "labels"]);
    assert_eq!(mlp.builder.graph.shape(mlp.inputs[0].tensor).dims(), &[4, 784]);
    let seed = model("gpt2", 1, 8, DType::F32);
    let seed = seed.builder.graph.meta(seed.input("seed").unwrap()).clone();
    assert_eq!(seed, TensorMeta::new([], DType::I64));
}

#[test]
fn dropout_only_where_probability_is_positive_each_site_its_own_stream() {
    let count = |name: &str, expected_sites: usize| {
        let m = model(name, 1, 8, DType::F32);
        let streams: Vec<(u64, f64)> = ops_named(&m.builder.graph, "dropout")
            .map(|n| match n.op {
                Op::Dropout { p, stream, .. } => (stream, p),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(streams.len(), expected_sites, "{name}: dropout sites");
        let distinct: BTreeSet<u64> = streams.iter().map(|s| s.0).collect();
        assert_eq!(distinct.len(), streams.len(), "{name}: streams must differ");
        assert!(streams.iter().all(|s| s.1 == 0.1), "{name}: {streams:?}");
    };
    count("gpt2", 1 + 2 * 12); // embd + (attn resid, mlp resid) per layer
    count("bert-large", 1 + 2 * 24);
    count("gpt2-tiny", 0);
    count("llama2-7b", 0);
    count("vit-base", 0); // hidden_dropout_prob 0.0
    count("bloom-560m", 0); // hidden_dropout 0.0
}

/// Sum of the matmul-class FLOPs of a graph, as the IR counts them.
fn matmul_flops(g: &Graph) -> u64 {
    g.nodes
        .iter()
        .map(|n| {
            let x: Vec<&TensorMeta> = n.inputs.iter().map(|&t| g.meta(t)).collect();
            let y: Vec<&TensorMeta> = n.outputs.iter().map(|&t| g.meta(t)).collect();
            n.op.flops(&x, &y).matmul
        })
        .sum()
}

#[test]
fn training_flops_match_reference_figures() {
    // DESIGN.md §6 (PyTorch FlopCounterMode, transformers 4.46, eager attention): matmuls and
    // attention, batch 1, seq 1024, forward + backward.
    for (name, expected) in [("gpt2", 874_944_921_600u64), ("gpt2-xl", 10_520_110_694_400)] {
        let m = model(name, 1, 1024, DType::F32);
        let t = build_training_graph(m.builder, m.loss, &TrainConfig::default()).unwrap();
        assert_eq!(matmul_flops(&t.graph), expected, "{name}");
    }
}

#[test]
fn bloom_training_flops_are_three_forwards() {
    // bloom-560m at B=1, S=1024 (d = 1024, L = 24, v = 250880), by hand: per layer
    // query_key_value 6·S·d², dense 2·S·d², dense_h_to_4h and dense_4h_to_h 8·S·d² each, so
    // 24·S·d² = 25,769,803,776, plus attention's QKᵀ and AV 4·S²·d = 4,294,967,296:
    // 30,064,771,072 × 24 = 721,554,505,728; the tied head 2·S·d·v = 526,133,493,760.
    // Forward 1,247,687,999,488; a training step 3× that (dX and dW of every matmul).
    let m = model("bloom-560m", 1, 1024, DType::F32);
    let t = build_training_graph(m.builder, m.loss, &TrainConfig::default()).unwrap();
    assert_eq!(matmul_flops(&t.graph), 3 * 1_247_687_999_488);
}

#[test]
fn building_the_largest_graphs_takes_milliseconds() {
    let cfg = ModelConfig::preset("llama2-70b").unwrap();
    let start = Instant::now();
    let m = build(&cfg, &BuildOptions::new(8, 4096, DType::BF16)).unwrap();
    let elapsed = start.elapsed();
    assert!(m.builder.graph.nodes.len() > 2000);
    // ~2 ms on a laptop core; the bound leaves room for a loaded CI machine but catches
    // anything quadratic or per-node string churn.
    assert!(elapsed < Duration::from_millis(500), "llama2-70b took {elapsed:?}");
}

#[test]
fn build_options_are_validated() {
    let cfg = ModelConfig::preset("gpt2-tiny").unwrap();
    for (opts, needle) in [
        (BuildOptions::new(0, 8, DType::F32), "batch"),
        (BuildOptions::new(1, 0, DType::F32), "seq"),
        (BuildOptions::new(1, 8, DType::I32), "i32"),
    ] {
        let err = build(&cfg, &opts).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(needle), "{opts:?}: {err}");
    }
}
