//! Whole-model checks in f64 on the reference interpreter, against independent references.
//!
//! 1. **Gradients of whole training graphs** (the `gpt2-tiny`, `llama-tiny` and `bloom-tiny`
//!    presets as they are, a tiny BERT, a tiny ViT, a tiny GPT-2 with dropout, a 6-head BLOOM
//!    with dropout and an untied head, a tiny diffusers UNet): seeded random parameters and data,
//!    `tessera_ir::gradients` of the loss w.r.t. every parameter, evaluated by
//!    `interp::eval_outputs`. With millions of scalars, gradients are checked through
//!    directional derivatives: for a random direction `d` supported on one parameter tensor
//!    (and once on all of them), `⟨∇L, d⟩` against central differences of `L(θ + h·d)`,
//!    relative error below 1e-6 ([`Model::check`]). The central differences are
//!    Richardson-extrapolated (`D(h)` and `D(2h)` combined to cancel the `h²` term): a plain
//!    `(L(θ+hd) − L(θ−hd))/2h` is off by ~1e-5 relative at an `h` large enough for f64
//!    round-off not to matter, the extrapolated one by ~1e-10.
//! 2. **Forward values against plain-loop references written here**: ViT's patch embeddings
//!    as a strided convolution, BERT's embedding sum, and the logits of small GPT-2, LLaMA
//!    (GQA, RoPE, RMSNorm, SwiGLU) and BLOOM (ALiBi as transformers builds it, per-head fused
//!    q/k/v, embedding LayerNorm) models from a hand-written forward pass.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::time::Instant;
use tessera_ir::interp::{self, Value};
use tessera_ir::{Builder, DType, Graph, Node, Op, Phase, TensorId};
use tessera_models::{build, BuildOptions, InputKind, ModelConfig};

// ---- instantiation -------------------------------------------------------------------------

/// A built f64 model with seeded random parameters and data bound.
struct Model {
    name: String,
    graph: Graph,
    loss: TensorId,
    logits: TensorId,
    bindings: HashMap<TensorId, Value>,
    /// Filled by [`Model::differentiate`].
    grads: HashMap<TensorId, Vec<f64>>,
    rng: StdRng,
}

fn uniform(rng: &mut StdRng, n: usize, a: f64) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(-a..a)).collect()
}

/// Norm weights (`ln_1`, `LayerNorm`, `input_layernorm`, `norm`, ...) start near 1.
fn is_norm_weight(name: &str) -> bool {
    let mut parts = name.rsplit('.');
    let (last, module) = (parts.next(), parts.next().unwrap_or(""));
    last == Some("weight") && (module.to_lowercase().contains("norm") || module.starts_with("ln_"))
}

/// Random values that keep every part of the model in its working regime (attention scores of
/// order 1, so neither uniform nor one-hot; norms away from the identity): weights uniform
/// with std `1/sqrt(fan_in)` clamped to [0.02, 0.2], norm weights `1 ± 0.2`, biases ±0.1.
fn init_param(rng: &mut StdRng, name: &str, dims: &[usize]) -> Vec<f64> {
    let n: usize = dims.iter().product();
    if dims.len() == 1 {
        if is_norm_weight(name) {
            return uniform(rng, n, 0.2).into_iter().map(|x| 1.0 + x).collect();
        }
        return uniform(rng, n, 0.1);
    }
    // GPT-2's Conv1D (`c_attn`, `c_proj`, `c_fc`) stores [in, out]; everything else
    // (BLOOM's `transformer.h.*` linears too) has its fan-in in the trailing dims.
    let module = name.rsplit('.').nth(1).unwrap_or("");
    let fan_in: usize = if module.starts_with("c_") { dims[0] } else { dims[1..].iter().product() };
    let std = (1.0 / (fan_in as f64).sqrt()).clamp(0.02, 0.2);
    uniform(rng, n, std * 3f64.sqrt())
}

impl Model {
    fn new(cfg: &ModelConfig, batch: usize, seq: usize, seed: u64) -> Model {
        let name = cfg.name().to_string();
        let fm = build(cfg, &BuildOptions::new(batch, seq, DType::F64))
            .unwrap_or_else(|e| panic!("{name}: build: {e}"));
        let labels = fm.labels();
        let graph = fm.builder.finish();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut bindings = HashMap::new();
        for p in graph.parameters() {
            let dims = graph.shape(p).dims().to_vec();
            let data = init_param(&mut rng, graph.tensor_scope(p), &dims);
            bindings.insert(p, Value::new(dims, data));
        }
        for input in &fm.inputs {
            let shape = graph.shape(input.tensor).clone();
            let n = shape.numel() as usize;
            let ints = |rng: &mut StdRng, hi: usize| -> Vec<f64> {
                (0..n).map(|_| rng.random_range(0..hi) as f64).collect()
            };
            let data = match &input.kind {
                InputKind::TokenIds { vocab_size } => ints(&mut rng, *vocab_size),
                InputKind::TokenTypeIds { type_vocab_size } => ints(&mut rng, *type_vocab_size),
                InputKind::Labels { num_classes, ignore_index } => {
                    let mut labels = ints(&mut rng, *num_classes);
                    if let Some(ignore) = ignore_index {
                        // About a third ignored; the first target always counts.
                        for l in labels.iter_mut().skip(1) {
                            if rng.random_bool(0.35) {
                                *l = *ignore as f64;
                            }
                        }
                    }
                    labels
                }
                InputKind::Pixels
                | InputKind::Features
                | InputKind::Targets
                | InputKind::Condition => uniform(&mut rng, n, 1.0),
                // Timesteps in 0..1000, as a DDPM schedule draws them.
                InputKind::Timesteps => {
                    uniform(&mut rng, n, 1.0).iter().map(|u| 500.0 * (u + 1.0)).collect()
                }
                // The null class included.
                InputKind::ClassLabels { num_classes } => ints(&mut rng, num_classes + 1),
                InputKind::Seed => vec![0x5eed_1234 as f64],
                // The labels come first: count the ones that are not ignored.
                InputKind::TargetCount => {
                    let (labels, ignore) = labels.expect("a target count needs labels");
                    let n = bindings[&labels].data.iter().filter(|&&l| Some(l as i64) != ignore);
                    vec![n.count() as f64]
                }
                InputKind::CacheStart | InputKind::Positions | InputKind::LastIndex => {
                    panic!("{name}: a training graph has no generation input {}", input.name)
                }
            };
            bindings.insert(input.tensor, Value::new(shape, data));
        }
        Model {
            name,
            graph,
            loss: fm.loss,
            logits: fm.logits,
            bindings,
            grads: HashMap::new(),
            rng,
        }
    }

    fn param(&self, name: &str) -> TensorId {
        let t = self
            .graph
            .find_leaf(name)
            .unwrap_or_else(|| panic!("{}: no parameter named {name}", self.name));
        assert!(self.graph.parameters().contains(&t), "{}: {name} is not a parameter", self.name);
        t
    }

    fn input(&self, name: &str) -> &Value {
        let t = self.graph.find_leaf(name).unwrap_or_else(|| panic!("no input {name}"));
        &self.bindings[&t]
    }

    fn value(&self, name: &str) -> &[f64] {
        &self.bindings[&self.param(name)].data
    }

    fn eval(&self, outputs: &[TensorId]) -> Vec<Value> {
        interp::eval_outputs(&self.graph, &self.bindings, outputs)
            .unwrap_or_else(|e| panic!("{}: eval: {e}", self.name))
    }

    fn loss(&self) -> f64 {
        self.eval(&[self.loss])[0].item()
    }

    /// Appends the backward pass of the loss w.r.t. every parameter and evaluates it.
    fn differentiate(&mut self) {
        let params = self.graph.parameters();
        let mut b = Builder::from_graph(std::mem::take(&mut self.graph));
        let grads = tessera_ir::gradients(&mut b, self.loss, &params)
            .unwrap_or_else(|e| panic!("{}: gradients: {e}", self.name));
        self.graph = b.finish();
        let grads: Vec<TensorId> = params
            .iter()
            .zip(grads)
            .map(|(&p, g)| {
                g.unwrap_or_else(|| {
                    panic!("{}: no gradient for {}", self.name, self.graph.tensor_scope(p))
                })
            })
            .collect();
        let values = self.eval(&grads);
        self.grads = params.into_iter().zip(values).map(|(p, v)| (p, v.data)).collect();
    }

    /// A random direction supported on the named parameters (all of them when empty), each
    /// element uniform in ±(the tensor's RMS value).
    fn direction(&mut self, names: &[&str]) -> Vec<(TensorId, Vec<f64>)> {
        let tensors: Vec<TensorId> = if names.is_empty() {
            self.graph.parameters()
        } else {
            names.iter().map(|n| self.param(n)).collect()
        };
        tensors
            .into_iter()
            .map(|t| {
                let v = &self.bindings[&t].data;
                let rms = (v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64).sqrt();
                (t, uniform(&mut self.rng, v.len(), rms))
            })
            .collect()
    }

    /// Checks `⟨∇L, d⟩` against the central difference `D(h) = (L(θ+hd) − L(θ−hd)) / 2h`,
    /// Richardson-extrapolated: `(4·D(h) − D(2h)) / 3`, whose error is O(h⁴). `d` is scaled
    /// to the parameters' own magnitude, so `h = 1e-3` is a relative step.
    fn check(&mut self, what: &str, dir: &[(TensorId, Vec<f64>)]) {
        const H: f64 = 1e-3;
        let analytic: f64 = dir
            .iter()
            .map(|(t, d)| self.grads[t].iter().zip(d).map(|(g, d)| g * d).sum::<f64>())
            .sum();
        let originals: Vec<Vec<f64>> =
            dir.iter().map(|(t, _)| self.bindings[t].data.clone()).collect();
        let mut loss_at = |s: f64| {
            for ((t, d), orig) in dir.iter().zip(&originals) {
                let v = self.bindings.get_mut(t).expect("bound");
                for ((x, o), d) in v.data.iter_mut().zip(orig).zip(d) {
                    *x = o + s * d;
                }
            }
            self.loss()
        };
        let (p1, m1, p2, m2) = (loss_at(H), loss_at(-H), loss_at(2.0 * H), loss_at(-2.0 * H));
        for ((t, _), orig) in dir.iter().zip(originals) {
            self.bindings.get_mut(t).expect("bound").data = orig;
        }
        let (d_h, d_2h) = ((p1 - m1) / (2.0 * H), (p2 - m2) / (4.0 * H));
        let numeric = (4.0 * d_h - d_2h) / 3.0;
        let rel = (analytic - numeric).abs() / analytic.abs().max(numeric.abs());
        eprintln!(
            "{}: {what}: ⟨∇L, d⟩ {analytic:+.12e}, finite differences {numeric:+.12e}, \
             relative error {rel:.1e}",
            self.name
        );
        // A vanishing derivative would make the relative error meaningless (an attention key
        // bias is such a parameter: softmax ignores a per-row shift of the scores).
        assert!(
            analytic.abs() > 1e-9,
            "{}: {what}: ⟨∇L, d⟩ = {analytic:e} is too small to check",
            self.name
        );
        assert!(
            rel < 1e-6,
            "{}: {what}: ⟨∇L, d⟩ = {analytic:e} but finite differences give {numeric:e} \
             (relative error {rel:e})",
            self.name
        );
    }

    /// One check per named tensor, then one along a direction over all parameters.
    fn gradcheck(&mut self, names: &[&str]) {
        let start = Instant::now();
        self.differentiate();
        eprintln!("{}: gradients in {:.2?}", self.name, start.elapsed());
        for name in names {
            let dir = self.direction(&[name]);
            self.check(name, &dir);
        }
        let dir = self.direction(&[]);
        self.check("all parameters", &dir);
        eprintln!("{}: done in {:.2?}", self.name, start.elapsed());
    }
}

fn preset(name: &str) -> ModelConfig {
    ModelConfig::preset(name).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn hf(json: &str) -> ModelConfig {
    ModelConfig::from_hf_json(json).unwrap_or_else(|e| panic!("{json}: {e}"))
}

// ---- gradient checks -----------------------------------------------------------------------

#[test]
fn gpt2_tiny_gradients() {
    let mut m = Model::new(&preset("gpt2-tiny"), 2, 8, 1);
    m.gradcheck(&[
        "transformer.wte.weight", // embedding and tied lm_head
        "transformer.wpe.weight",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.3.ln_1.weight",
        "transformer.h.3.ln_1.bias",
        "transformer.h.3.attn.c_attn.weight",
        "transformer.h.3.attn.c_attn.bias",
        "transformer.h.3.attn.c_proj.weight",
        "transformer.h.3.attn.c_proj.bias",
        "transformer.h.3.ln_2.weight",
        "transformer.h.3.mlp.c_fc.weight",
        "transformer.h.3.mlp.c_fc.bias",
        "transformer.h.3.mlp.c_proj.weight",
        "transformer.h.7.mlp.c_proj.weight",
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    ]);
}

#[test]
fn llama_tiny_gradients() {
    let mut m = Model::new(&preset("llama-tiny"), 2, 8, 2);
    m.gradcheck(&[
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.3.input_layernorm.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
        "model.layers.3.self_attn.o_proj.weight",
        "model.layers.3.post_attention_layernorm.weight",
        "model.layers.3.mlp.gate_proj.weight",
        "model.layers.3.mlp.up_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.norm.weight",
        "lm_head.weight", // untied
    ]);
}

/// 2 layers, hidden 32, 4 heads, vocabulary 50, HF's default dropout 0.1 (seed bound).
const BERT_TINY: &str = r#"{"model_type": "bert", "_name_or_path": "bert-tiny",
    "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 64, "max_position_embeddings": 16, "type_vocab_size": 2}"#;

#[test]
fn bert_tiny_gradients() {
    let mut m = Model::new(&hf(BERT_TINY), 2, 8, 3);
    let labels = &m.input("labels").data;
    assert!(labels.contains(&-100.0) && labels.iter().any(|&l| l >= 0.0), "{labels:?}");
    m.gradcheck(&[
        "bert.embeddings.word_embeddings.weight", // embedding and tied decoder
        "bert.embeddings.position_embeddings.weight",
        "bert.embeddings.token_type_embeddings.weight",
        "bert.embeddings.LayerNorm.weight",
        "bert.encoder.layer.1.attention.self.query.weight",
        "bert.encoder.layer.1.attention.self.query.bias",
        "bert.encoder.layer.1.attention.self.value.weight",
        "bert.encoder.layer.1.attention.output.dense.weight",
        "bert.encoder.layer.1.attention.output.LayerNorm.bias",
        "bert.encoder.layer.0.intermediate.dense.weight",
        "bert.encoder.layer.0.output.LayerNorm.weight",
        "cls.predictions.transform.dense.weight",
        "cls.predictions.transform.LayerNorm.weight",
        "cls.predictions.bias",
    ]);
}

/// 2 layers, hidden 32, 4 heads, 8×8 RGB images in 4×4 patches, 5 labels, dropout 0.1.
const VIT_TINY: &str = r#"{"model_type": "vit", "_name_or_path": "vit-tiny",
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 64, "image_size": 8, "patch_size": 4, "num_channels": 3,
    "num_labels": 5, "hidden_dropout_prob": 0.1}"#;

#[test]
fn vit_tiny_gradients() {
    let mut m = Model::new(&hf(VIT_TINY), 3, 1, 4);
    m.gradcheck(&[
        "vit.embeddings.patch_embeddings.projection.weight",
        "vit.embeddings.patch_embeddings.projection.bias",
        "vit.embeddings.cls_token",
        "vit.embeddings.position_embeddings",
        "vit.encoder.layer.1.layernorm_before.weight",
        "vit.encoder.layer.1.attention.attention.query.weight",
        "vit.encoder.layer.1.attention.attention.value.bias",
        "vit.encoder.layer.1.attention.output.dense.weight",
        "vit.encoder.layer.0.intermediate.dense.weight",
        "vit.layernorm.weight",
        "classifier.weight",
        "classifier.bias",
    ]);
}

/// diffusers' `DiTTransformer2DModel`: 2 blocks, width 16, 2 channels with a learned sigma.
const DIT_TINY: &str = r#"{"_class_name": "DiTTransformer2DModel", "_name_or_path": "dit-tiny",
    "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 2, "out_channels": 4,
    "num_layers": 2, "sample_size": 8, "patch_size": 2, "num_embeds_ada_norm": 5}"#;

#[test]
fn dit_tiny_gradients() {
    let mut m = Model::new(&hf(DIT_TINY), 2, 1, 8);
    m.gradcheck(&[
        "pos_embed.proj.weight",
        "pos_embed.proj.bias",
        "transformer_blocks.0.norm1.emb.timestep_embedder.linear_1.weight",
        "transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight",
        "transformer_blocks.0.norm1.linear.weight",
        "transformer_blocks.1.norm1.linear.bias",
        "transformer_blocks.1.attn1.to_q.weight",
        "transformer_blocks.1.attn1.to_out.0.weight",
        "transformer_blocks.0.ff.net.0.proj.weight",
        "transformer_blocks.1.ff.net.2.bias",
        "proj_out_1.weight",
        "proj_out_2.weight",
    ]);
}

/// 2 layers, hidden 32, embedding and residual dropout 0.1, untied lm_head.
const GPT2_DROPOUT: &str = r#"{"model_type": "gpt2", "_name_or_path": "gpt2-dropout",
    "vocab_size": 64, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4,
    "embd_pdrop": 0.1, "resid_pdrop": 0.1, "attn_pdrop": 0.1, "tie_word_embeddings": false}"#;

#[test]
fn gpt2_with_dropout_gradients() {
    let mut m = Model::new(&hf(GPT2_DROPOUT), 2, 8, 5);
    // Dropout is really in the graph: embd + attn/mlp residual per layer, and the mask
    // follows the seed.
    let dropouts = m.graph.nodes.iter().filter(|n| matches!(n.op, Op::Dropout { .. })).count();
    assert_eq!(dropouts, 1 + 2 * 2, "dropout call sites");
    let seed = m.graph.find_leaf("seed").expect("a seed input");
    let loss = m.loss();
    let saved = m.bindings.insert(seed, Value::scalar(7.0)).expect("seed bound");
    assert_ne!(m.loss(), loss, "the loss does not depend on the dropout seed");
    m.bindings.insert(seed, saved);
    m.gradcheck(&[
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.1.ln_1.weight",
        "transformer.h.1.attn.c_attn.weight",
        "transformer.h.1.attn.c_proj.bias",
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_proj.weight",
        "transformer.ln_f.bias",
        "lm_head.weight",
    ]);
}

#[test]
fn bloom_tiny_gradients() {
    // ALiBi attention (4 heads: power-of-two slopes), the embedding LayerNorm, per-head fused
    // q/k/v, tied head.
    let mut m = Model::new(&preset("bloom-tiny"), 2, 8, 6);
    m.gradcheck(&[
        "transformer.word_embeddings.weight", // embedding and tied lm_head
        "transformer.word_embeddings_layernorm.weight",
        "transformer.word_embeddings_layernorm.bias",
        "transformer.h.0.input_layernorm.weight",
        "transformer.h.0.self_attention.query_key_value.weight",
        "transformer.h.0.self_attention.query_key_value.bias",
        "transformer.h.1.input_layernorm.bias",
        "transformer.h.1.self_attention.query_key_value.weight",
        "transformer.h.1.self_attention.dense.weight",
        "transformer.h.1.self_attention.dense.bias",
        "transformer.h.1.post_attention_layernorm.weight",
        "transformer.h.1.mlp.dense_h_to_4h.weight",
        "transformer.h.1.mlp.dense_h_to_4h.bias",
        "transformer.h.1.mlp.dense_4h_to_h.weight",
        "transformer.h.1.mlp.dense_4h_to_h.bias",
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    ]);
}

/// 2 layers, hidden 48, 6 heads (ALiBi's non-power-of-two slopes), vocabulary 50,
/// `hidden_dropout` 0.1, untied lm_head.
const BLOOM_6HEADS_DROPOUT: &str = r#"{"model_type": "bloom", "_name_or_path": "bloom-dropout",
    "vocab_size": 50, "hidden_size": 48, "n_layer": 2, "n_head": 6, "hidden_dropout": 0.1,
    "tie_word_embeddings": false}"#;

#[test]
fn bloom_with_six_heads_and_dropout_gradients() {
    let mut m = Model::new(&hf(BLOOM_6HEADS_DROPOUT), 2, 7, 7);
    // hidden_dropout before each residual add: 2 per layer, nothing on the embeddings.
    let dropouts = m.graph.nodes.iter().filter(|n| matches!(n.op, Op::Dropout { .. })).count();
    assert_eq!(dropouts, 2 * 2, "dropout call sites");
    m.gradcheck(&[
        "transformer.word_embeddings.weight",
        "transformer.word_embeddings_layernorm.weight",
        "transformer.h.0.self_attention.query_key_value.weight",
        "transformer.h.1.self_attention.query_key_value.weight",
        "transformer.h.1.self_attention.query_key_value.bias",
        "transformer.h.1.self_attention.dense.weight",
        "transformer.h.0.mlp.dense_h_to_4h.weight",
        "transformer.h.0.mlp.dense_4h_to_h.weight",
        "transformer.ln_f.weight",
        "lm_head.weight",
    ]);
}

// ---- independent forward references --------------------------------------------------------

/// The forward node under `scope` that `is` picks (the first, or the only one).
/// diffusers' `UNet2DConditionModel` in miniature: one cross-attention and one plain block
/// each way, linear projections, SD 2's per-block head counts, a 4×4 sample, 3 text tokens.
const UNET_TINY: &str = r#"{"_class_name": "UNet2DConditionModel", "_name_or_path": "unet-tiny",
    "sample_size": 4, "block_out_channels": [4, 8], "layers_per_block": 1,
    "norm_num_groups": 2, "cross_attention_dim": 4, "attention_head_dim": [1, 2],
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "use_linear_projection": true}"#;

#[test]
fn unet_tiny_gradients() {
    let mut m = Model::new(&hf(UNET_TINY), 2, 3, 8);
    m.gradcheck(&[
        "time_embedding.linear_1.weight",
        "conv_in.weight",
        "down_blocks.0.resnets.0.conv1.weight",
        "down_blocks.0.resnets.0.time_emb_proj.weight",
        "down_blocks.0.attentions.0.norm.weight",
        "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight",
        "down_blocks.0.attentions.0.transformer_blocks.0.ff.net.0.proj.weight",
        "down_blocks.0.downsamplers.0.conv.weight",
        "mid_block.attentions.0.proj_in.weight",
        "up_blocks.0.resnets.0.conv_shortcut.weight",
        "up_blocks.0.upsamplers.0.conv.weight",
        "up_blocks.1.attentions.1.transformer_blocks.0.attn1.to_q.weight",
        "conv_norm_out.weight",
        "conv_out.bias",
    ]);
}

fn node_in<'a>(m: &'a Model, scope: &str, is: impl Fn(&Op) -> bool) -> &'a Node {
    m.graph
        .nodes
        .iter()
        .find(|n| n.phase == Phase::Forward && m.graph.scope_name(n.scope) == scope && is(&n.op))
        .unwrap_or_else(|| panic!("{}: no such node in scope {scope}", m.name))
}

/// Max |a − b| over elements, after checking the shapes agree.
fn assert_close(what: &str, got: &Value, want_dims: &[usize], want: &[f64], tol: f64) {
    assert_eq!(got.dims(), want_dims, "{what}: shape");
    assert_eq!(want.len(), got.numel(), "{what}: reference size");
    let (mut worst, mut at) = (0.0f64, 0);
    for (k, (g, w)) in got.data.iter().zip(want).enumerate() {
        let err = (g - w).abs() / w.abs().max(1.0);
        if err > worst || err.is_nan() {
            (worst, at) = (err, k);
        }
    }
    eprintln!("{what}: max error {worst:.1e}");
    assert!(
        worst <= tol,
        "{what}: element {at} is {} but the reference gives {} (error {worst:e} > {tol:e})",
        got.data[at],
        want[at]
    );
}

#[test]
fn vit_patch_embeddings_are_the_strided_convolution() {
    // The square config of the gradient check, and a non-square image in non-square patches
    // (rows ≠ columns catches a transposed patch order).
    let rect = VIT_TINY
        .replace(r#""image_size": 8"#, r#""image_size": [8, 12]"#)
        .replace(r#""patch_size": 4"#, r#""patch_size": [4, 2]"#);
    for (k, json) in [VIT_TINY.to_string(), rect].iter().enumerate() {
        let ModelConfig::Vit(cfg) = hf(json) else { unreachable!("a ViT config") };
        let m = Model::new(&ModelConfig::Vit(cfg.clone()), 2, 1, 10 + k as u64);
        let (batch, c, dim) = (2, cfg.num_channels, cfg.hidden_size);
        let [img_h, img_w] = cfg.image_size;
        let [ph, pw] = cfg.patch_size;
        let (rows, cols) = (img_h / ph, img_w / pw);
        let img = &m.input("pixel_values").data;
        let w = m.value("vit.embeddings.patch_embeddings.projection.weight"); // [D, C, ph, pw]
        let bias = m.value("vit.embeddings.patch_embeddings.projection.bias");
        let mut want = vec![0.0; batch * rows * cols * dim];
        for b in 0..batch {
            for py in 0..rows {
                for px in 0..cols {
                    let p = py * cols + px;
                    for d in 0..dim {
                        let mut acc = bias[d];
                        for ch in 0..c {
                            for i in 0..ph {
                                for j in 0..pw {
                                    let wv = w[((d * c + ch) * ph + i) * pw + j];
                                    let y = py * ph + i;
                                    let x = px * pw + j;
                                    acc += wv * img[((b * c + ch) * img_h + y) * img_w + x];
                                }
                            }
                        }
                        want[(b * rows * cols + p) * dim + d] = acc;
                    }
                }
            }
        }
        // The patch half of `concat([cls, patches], 1)`.
        let concat = node_in(&m, "vit.embeddings", |op| matches!(op, Op::Concat { .. }));
        let t = concat.inputs[1];
        assert_eq!(m.graph.tensor_scope(t), "vit.embeddings.patch_embeddings.projection");
        let got = &m.eval(&[t])[0];
        assert_close(
            &format!("vit patch embeddings {img_h}x{img_w}/{ph}x{pw}"),
            got,
            &[batch, rows * cols, dim],
            &want,
            1e-12,
        );
    }
}

#[test]
fn bert_embeddings_are_word_plus_position_plus_token_type() {
    let m = Model::new(&hf(BERT_TINY), 3, 7, 11);
    let (batch, seq, dim) = (3, 7, 32);
    let ids = &m.input("input_ids").data;
    let types = &m.input("token_type_ids").data;
    assert!(types.contains(&0.0) && types.contains(&1.0), "both segments occur");
    let word = m.value("bert.embeddings.word_embeddings.weight");
    let pos = m.value("bert.embeddings.position_embeddings.weight");
    let typ = m.value("bert.embeddings.token_type_embeddings.weight");
    let mut want = vec![0.0; batch * seq * dim];
    for b in 0..batch {
        for s in 0..seq {
            let (id, tt) = (ids[b * seq + s] as usize, types[b * seq + s] as usize);
            for d in 0..dim {
                want[(b * seq + s) * dim + d] =
                    word[id * dim + d] + pos[s * dim + d] + typ[tt * dim + d];
            }
        }
    }
    // The LayerNorm's input.
    let ln = node_in(&m, "bert.embeddings.LayerNorm", |op| matches!(op, Op::LayerNorm { .. }));
    let got = &m.eval(&[ln.inputs[0]])[0];
    assert_close("bert embeddings", got, &[batch, seq, dim], &want, 1e-12);
}

// Plain-loop building blocks of the hand-written forward passes. Activations are row-major
// `[rows, width]`.

/// `x·W + b` with `W` given as `[in, out]` (`out_in == false`, GPT-2's Conv1D) or `[out, in]`
/// (`out_in == true`, nn.Linear).
fn dense(
    x: &[f64],
    w: &[f64],
    bias: Option<&[f64]>,
    n_in: usize,
    n_out: usize,
    out_in: bool,
) -> Vec<f64> {
    let rows = x.len() / n_in;
    let mut y = vec![0.0; rows * n_out];
    for r in 0..rows {
        for o in 0..n_out {
            let mut acc = bias.map_or(0.0, |b| b[o]);
            for i in 0..n_in {
                let wv = if out_in { w[o * n_in + i] } else { w[i * n_out + o] };
                acc += x[r * n_in + i] * wv;
            }
            y[r * n_out + o] = acc;
        }
    }
    y
}

fn layer_norm(x: &[f64], w: &[f64], b: &[f64], eps: f64) -> Vec<f64> {
    let n = w.len();
    let mut y = vec![0.0; x.len()];
    for (row, out) in x.chunks(n).zip(y.chunks_mut(n)) {
        let mean = row.iter().sum::<f64>() / n as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        for i in 0..n {
            out[i] = (row[i] - mean) / (var + eps).sqrt() * w[i] + b[i];
        }
    }
    y
}

fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let n = w.len();
    let mut y = vec![0.0; x.len()];
    for (row, out) in x.chunks(n).zip(y.chunks_mut(n)) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / n as f64;
        for i in 0..n {
            out[i] = row[i] / (ms + eps).sqrt() * w[i];
        }
    }
    y
}

/// Attention geometry: batch, sequence, query heads, key/value heads, head dim.
struct Dims {
    batch: usize,
    seq: usize,
    heads: usize,
    kv_heads: usize,
    e: usize,
}

/// Causal softmax attention on `q [B·S, H·E]`, `k`/`v [B·S, KV·E]`, scores scaled by
/// `1/sqrt(E)`; query head `h` reads kv head `h / (H / KV)` (HF's `repeat_kv`). Returns
/// `[B·S, H·E]`.
fn causal_attention(q: &[f64], k: &[f64], v: &[f64], dims: &Dims) -> Vec<f64> {
    let Dims { batch, seq, heads, kv_heads, e } = *dims;
    let (qw, kw) = (heads * e, kv_heads * e);
    let mut out = vec![0.0; batch * seq * qw];
    for b in 0..batch {
        for h in 0..heads {
            let kh = h / (heads / kv_heads);
            for i in 0..seq {
                let qi = &q[(b * seq + i) * qw + h * e..][..e];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let kj = &k[(b * seq + j) * kw + kh * e..][..e];
                        qi.iter().zip(kj).map(|(a, c)| a * c).sum::<f64>() / (e as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = exps.iter().sum();
                for (j, p) in exps.iter().enumerate() {
                    for d in 0..e {
                        out[(b * seq + i) * qw + h * e + d] +=
                            p / total * v[(b * seq + j) * kw + kh * e + d];
                    }
                }
            }
        }
    }
    out
}

fn add_into(x: &mut [f64], y: &[f64]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn gelu_new(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

#[test]
fn gpt2_logits_match_a_hand_written_forward_pass() {
    let cfg = hf(r#"{"model_type": "gpt2", "_name_or_path": "gpt2-ref", "vocab_size": 40,
        "n_positions": 16, "n_embd": 24, "n_layer": 2, "n_head": 3, "embd_pdrop": 0.0,
        "resid_pdrop": 0.0, "attn_pdrop": 0.0}"#);
    let (batch, seq, d, heads, v, inner) = (2, 6, 24, 3, 40, 96);
    let m = Model::new(&cfg, batch, seq, 12);
    let ids = &m.input("input_ids").data;
    let p = |name: &str| m.value(name);
    let (wte, wpe) = (p("transformer.wte.weight"), p("transformer.wpe.weight"));
    let mut x = vec![0.0; batch * seq * d];
    for b in 0..batch {
        for s in 0..seq {
            let id = ids[b * seq + s] as usize;
            for i in 0..d {
                x[(b * seq + s) * d + i] = wte[id * d + i] + wpe[s * d + i];
            }
        }
    }
    for layer in 0..2 {
        let w = |suffix: &str| p(&format!("transformer.h.{layer}.{suffix}"));
        let h = layer_norm(&x, w("ln_1.weight"), w("ln_1.bias"), 1e-5);
        let qkv = dense(&h, w("attn.c_attn.weight"), Some(w("attn.c_attn.bias")), d, 3 * d, false);
        let (mut q, mut k, mut vv) = (Vec::new(), Vec::new(), Vec::new());
        for row in qkv.chunks(3 * d) {
            q.extend_from_slice(&row[..d]);
            k.extend_from_slice(&row[d..2 * d]);
            vv.extend_from_slice(&row[2 * d..]);
        }
        let o = causal_attention(
            &q,
            &k,
            &vv,
            &Dims { batch, seq, heads, kv_heads: heads, e: d / heads },
        );
        let a = dense(&o, w("attn.c_proj.weight"), Some(w("attn.c_proj.bias")), d, d, false);
        add_into(&mut x, &a);
        let h = layer_norm(&x, w("ln_2.weight"), w("ln_2.bias"), 1e-5);
        let u = dense(&h, w("mlp.c_fc.weight"), Some(w("mlp.c_fc.bias")), d, inner, false);
        let u: Vec<f64> = u.into_iter().map(gelu_new).collect();
        let mo = dense(&u, w("mlp.c_proj.weight"), Some(w("mlp.c_proj.bias")), inner, d, false);
        add_into(&mut x, &mo);
    }
    let x = layer_norm(&x, p("transformer.ln_f.weight"), p("transformer.ln_f.bias"), 1e-5);
    let want = dense(&x, wte, None, d, v, true); // tied head: x·wteᵀ
    let got = &m.eval(&[m.logits])[0];
    assert_close("gpt2 logits", got, &[batch, seq, v], &want, 1e-10);
}

#[test]
fn llama_logits_match_a_hand_written_forward_pass() {
    let cfg = hf(r#"{"model_type": "llama", "_name_or_path": "llama-ref", "vocab_size": 40,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 500.0}"#);
    let (batch, seq, d, heads, kv, e, v, inner) = (2, 7, 32, 4, 2, 8, 40, 48);
    let theta: f64 = 500.0;
    let m = Model::new(&cfg, batch, seq, 13);
    let ids = &m.input("input_ids").data;
    let p = |name: &str| m.value(name);
    let embed = p("model.embed_tokens.weight");
    let mut x = vec![0.0; batch * seq * d];
    for (r, &id) in ids.iter().enumerate() {
        x[r * d..(r + 1) * d].copy_from_slice(&embed[id as usize * d..(id as usize + 1) * d]);
    }
    // HF rotate_half on each head of `t [B·S, n·E]`, position = sequence index.
    let rope = |t: &[f64], n: usize| -> Vec<f64> {
        let mut out = t.to_vec();
        for b in 0..batch {
            for s in 0..seq {
                for h in 0..n {
                    let base = (b * seq + s) * n * e + h * e;
                    for i in 0..e / 2 {
                        let angle = s as f64 * theta.powf(-((2 * i) as f64) / e as f64);
                        let (lo, hi) = (t[base + i], t[base + i + e / 2]);
                        out[base + i] = lo * angle.cos() - hi * angle.sin();
                        out[base + i + e / 2] = hi * angle.cos() + lo * angle.sin();
                    }
                }
            }
        }
        out
    };
    for layer in 0..2 {
        let w = |suffix: &str| p(&format!("model.layers.{layer}.{suffix}"));
        let h = rms_norm(&x, w("input_layernorm.weight"), 1e-6);
        let q = dense(&h, w("self_attn.q_proj.weight"), None, d, heads * e, true);
        let k = dense(&h, w("self_attn.k_proj.weight"), None, d, kv * e, true);
        let vv = dense(&h, w("self_attn.v_proj.weight"), None, d, kv * e, true);
        let (q, k) = (rope(&q, heads), rope(&k, kv));
        let o = causal_attention(&q, &k, &vv, &Dims { batch, seq, heads, kv_heads: kv, e });
        let a = dense(&o, w("self_attn.o_proj.weight"), None, heads * e, d, true);
        add_into(&mut x, &a);
        let h = rms_norm(&x, w("post_attention_layernorm.weight"), 1e-6);
        let gate = dense(&h, w("mlp.gate_proj.weight"), None, d, inner, true);
        let up = dense(&h, w("mlp.up_proj.weight"), None, d, inner, true);
        let g: Vec<f64> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
        let mo = dense(&g, w("mlp.down_proj.weight"), None, inner, d, true);
        add_into(&mut x, &mo);
    }
    let x = rms_norm(&x, p("model.norm.weight"), 1e-6);
    let want = dense(&x, p("lm_head.weight"), None, d, v, true);
    let got = &m.eval(&[m.logits])[0];
    assert_close("llama logits", got, &[batch, seq, v], &want, 1e-10);
}

/// ALiBi slopes as transformers' `build_alibi_tensor` computes them, transcribed here
/// independently of `tessera_ir::Alibi`.
fn hf_alibi_slopes(num_heads: usize) -> Vec<f64> {
    let closest = 2f64.powf((num_heads as f64).log2().floor());
    let base = 2f64.powf(-(2f64.powf(-(closest.log2() - 3.0))));
    let mut slopes: Vec<f64> = (1..=closest as usize).map(|p| base.powi(p as i32)).collect();
    if closest as usize != num_heads {
        let extra_base = 2f64.powf(-(2f64.powf(-((2.0 * closest).log2() - 3.0))));
        let remaining = (closest as usize).min(num_heads - closest as usize);
        // torch.arange(1, 1 + 2 * remaining, 2): the odd powers.
        slopes.extend((0..remaining).map(|i| extra_base.powi(2 * i as i32 + 1)));
    }
    slopes
}

/// `bloom_gelu_forward`, with BLOOM's truncated sqrt(2/π).
fn bloom_gelu(x: f64) -> f64 {
    x * 0.5 * (1.0 + (0.79788456 * x * (1.0 + 0.044715 * x * x)).tanh())
}

#[test]
fn hf_alibi_slopes_are_the_documented_ones() {
    // README of the HF fixtures: 4 heads 1/4, 1/16, 1/64, 1/256; 6 heads those, then 1/2, 1/8.
    assert_eq!(hf_alibi_slopes(4), [0.25, 0.0625, 0.015625, 0.00390625]);
    assert_eq!(hf_alibi_slopes(6), [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]);
    for n in 1..=130 {
        let (ours, hf) = (tessera_ir::Alibi::slopes(n), hf_alibi_slopes(n));
        assert_eq!(ours.len(), n, "{n} heads");
        for (h, (a, b)) in ours.iter().zip(&hf).enumerate() {
            assert!((a - b).abs() <= 1e-15 * b, "{n} heads, head {h}: {a} vs {b}");
        }
    }
}

#[test]
fn bloom_logits_match_a_hand_written_forward_pass() {
    // 6 heads: the non-power-of-two slopes; head dim 5 is odd (ALiBi needs no pairs).
    let cfg = hf(r#"{"model_type": "bloom", "_name_or_path": "bloom-ref", "vocab_size": 40,
        "hidden_size": 30, "n_layer": 2, "n_head": 6, "layer_norm_epsilon": 1e-5}"#);
    let (batch, seq, d, heads, v) = (2, 7, 30, 6, 40);
    let (e, inner, eps) = (d / heads, 4 * d, 1e-5);
    let m = Model::new(&cfg, batch, seq, 14);
    let ids = &m.input("input_ids").data;
    let p = |name: &str| m.value(name);
    let wte = p("transformer.word_embeddings.weight");
    let mut x = vec![0.0; batch * seq * d];
    for (r, &id) in ids.iter().enumerate() {
        x[r * d..(r + 1) * d].copy_from_slice(&wte[id as usize * d..(id as usize + 1) * d]);
    }
    let mut x = layer_norm(
        &x,
        p("transformer.word_embeddings_layernorm.weight"),
        p("transformer.word_embeddings_layernorm.bias"),
        eps,
    );
    let slopes = hf_alibi_slopes(heads);
    for layer in 0..2 {
        let w = |suffix: &str| p(&format!("transformer.h.{layer}.{suffix}"));
        let h = layer_norm(&x, w("input_layernorm.weight"), w("input_layernorm.bias"), eps);
        let qkv = dense(
            &h,
            w("self_attention.query_key_value.weight"),
            Some(w("self_attention.query_key_value.bias")),
            d,
            3 * d,
            true,
        );
        // view(B, S, H, 3, E): head hh's q, k, v are consecutive E-wide slices of its 3E.
        let at = |r: usize, hh: usize, which: usize, i: usize| {
            qkv[r * 3 * d + hh * 3 * e + which * e + i]
        };
        let mut o = vec![0.0; batch * seq * d];
        for b in 0..batch {
            for hh in 0..heads {
                for i in 0..seq {
                    // HF: alibi[h, j] = slope_h · j (the key's position), added unscaled.
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| {
                            let dot: f64 = (0..e)
                                .map(|c| at(b * seq + i, hh, 0, c) * at(b * seq + j, hh, 1, c))
                                .sum();
                            slopes[hh] * j as f64 + dot / (e as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = exps.iter().sum();
                    for (j, pj) in exps.iter().enumerate() {
                        for c in 0..e {
                            o[(b * seq + i) * d + hh * e + c] +=
                                pj / total * at(b * seq + j, hh, 2, c);
                        }
                    }
                }
            }
        }
        let a = dense(
            &o,
            w("self_attention.dense.weight"),
            Some(w("self_attention.dense.bias")),
            d,
            d,
            true,
        );
        add_into(&mut x, &a);
        let h = layer_norm(
            &x,
            w("post_attention_layernorm.weight"),
            w("post_attention_layernorm.bias"),
            eps,
        );
        let u = dense(
            &h,
            w("mlp.dense_h_to_4h.weight"),
            Some(w("mlp.dense_h_to_4h.bias")),
            d,
            inner,
            true,
        );
        let u: Vec<f64> = u.into_iter().map(bloom_gelu).collect();
        let mo = dense(
            &u,
            w("mlp.dense_4h_to_h.weight"),
            Some(w("mlp.dense_4h_to_h.bias")),
            inner,
            d,
            true,
        );
        add_into(&mut x, &mo);
    }
    let x = layer_norm(&x, p("transformer.ln_f.weight"), p("transformer.ln_f.bias"), eps);
    let want = dense(&x, wte, None, d, v, true); // tied head: x·word_embeddingsᵀ
    let got = &m.eval(&[m.logits])[0];
    // 1e-8, not 1e-10: BLOOM's gelu truncates sqrt(2/π) to 0.79788456 (6e-11 relative), the
    // IR's GeluTanh does not.
    assert_close("bloom logits", got, &[batch, seq, v], &want, 1e-8);
}
