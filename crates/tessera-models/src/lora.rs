//! LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; reference:
//! PEFT's `LoraModel` / `lora.Linear`) as a rewrite of a built forward graph, and `--freeze`.
//!
//! [`apply_lora`] copies the graph node by node; after each `nn.Linear` product whose weight's
//! module is a target (`y_bso = x_bsi · Wᵀ`, `W [out, in]`) it adds
//!
//! ```text
//! y_bso += (alpha / r) · (dropout(x_bsi) · Aᵀ) · Bᵀ      A [r, in], B [out, r]
//! ```
//!
//! with `A` and `B` new parameters named `<module>.lora_A.weight` / `<module>.lora_B.weight`
//! (PEFT's names inside `base_model.model.`), in the linear's block, and freezes every other
//! parameter. The bias (if any) is added after, as before: the same sum as PEFT's
//! `base_layer(x) + lora_B(lora_A(dropout(x))) · scaling`. Everything downstream (autodiff,
//! the planner's sharding rules, the profiler) sees ordinary matmuls and parameters.
//!
//! Targets match a module name as PEFT's list form does: the name itself or its last
//! components (`q_proj` matches `model.layers.0.self_attn.q_proj`).

use crate::{ForwardModel, InputKind, ModelError, ModelInput, Result};
use tessera_ir::{Builder, DType, Graph, Op, ScopeId, Shape, TensorId};

/// What `--lora` asks for: rank, alpha, dropout and target modules.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub targets: Vec<String>,
}

/// The dropout stream of LoRA site `i` (far from the model's own streams, which count up
/// from 0).
const DROPOUT_STREAM_BASE: u64 = 1 << 40;

impl LoraSpec {
    /// `r=8,alpha=16,dropout=0.05,targets=q_proj,v_proj` (a value without `=` continues the
    /// list of `targets`). Defaults: PEFT's `r=8`, `alpha=8`, `dropout=0`, `targets=q_proj,v_proj`.
    pub fn parse(s: &str) -> std::result::Result<LoraSpec, String> {
        let mut spec = LoraSpec {
            rank: 8,
            alpha: 8.0,
            dropout: 0.0,
            targets: vec!["q_proj".into(), "v_proj".into()],
        };
        let mut given_targets: Option<Vec<String>> = None;
        let mut in_targets = false;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((key, value)) = part.split_once('=') else {
                match (&mut given_targets, in_targets) {
                    (Some(t), true) => t.push(part.to_string()),
                    _ => {
                        return Err(format!(
                            "`{part}` is not key=value; write --lora \
                             r=8,alpha=16,dropout=0,targets=q_proj,v_proj"
                        ))
                    }
                }
                continue;
            };
            in_targets = false;
            let bad = |what: &str| format!("--lora {key}={value}: {what}");
            match key.trim() {
                "r" | "rank" => {
                    spec.rank = value
                        .parse()
                        .ok()
                        .filter(|&r| r > 0)
                        .ok_or_else(|| bad("the rank must be a positive integer"))?
                }
                "alpha" | "lora_alpha" => {
                    spec.alpha = value
                        .parse()
                        .ok()
                        .filter(|a: &f64| a.is_finite() && *a > 0.0)
                        .ok_or_else(|| bad("alpha must be a positive number"))?
                }
                "dropout" | "lora_dropout" => {
                    spec.dropout = value
                        .parse()
                        .ok()
                        .filter(|p: &f64| (0.0..1.0).contains(p))
                        .ok_or_else(|| bad("dropout must be in [0, 1)"))?
                }
                "targets" | "target_modules" => {
                    given_targets = Some(vec![value.trim().to_string()]);
                    in_targets = true;
                }
                other => {
                    return Err(format!(
                        "--lora: unknown key `{other}`; the keys are r, alpha, dropout, targets"
                    ))
                }
            }
        }
        if let Some(t) = given_targets {
            if t.iter().any(|t| t.is_empty()) {
                return Err("--lora targets: an empty module name".into());
            }
            spec.targets = t;
        }
        Ok(spec)
    }

    /// PEFT's `scaling = lora_alpha / r`.
    pub fn scaling(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Whether module `name` is a target.
    pub fn targets_module(&self, name: &str) -> bool {
        self.targets.iter().any(|t| name == t || name.ends_with(&format!(".{t}")))
    }
}

/// One adapted linear: its module name and sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSite {
    pub module: String,
    pub in_features: usize,
    pub out_features: usize,
}

/// `<module>.lora_A.weight`, `A [r, in]`.
pub fn lora_a_name(module: &str) -> String {
    format!("{module}.lora_A.weight")
}

/// `<module>.lora_B.weight`, `B [out, r]`.
pub fn lora_b_name(module: &str) -> String {
    format!("{module}.lora_B.weight")
}

/// Whether `name` is a LoRA parameter.
pub fn is_lora_name(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// The `nn.Linear` module a node reads, if the node is a linear's product `x · Wᵀ` with a
/// rank-2 weight parameter named `<module>.weight`.
fn linear_module(g: &Graph, node: &tessera_ir::Node) -> Option<(String, usize, usize)> {
    if !matches!(node.op, Op::MatMul { trans_a: false, trans_b: true }) {
        return None;
    }
    let w = node.inputs[1];
    if !matches!(g.producer(w).op, Op::Parameter { .. }) || g.shape(w).rank() != 2 {
        return None;
    }
    let module = g.tensor_scope(w).strip_suffix(".weight")?;
    let (out, inp) = (g.shape(w).dim(0), g.shape(w).dim(1));
    Some((module.to_string(), inp, out))
}

/// `model` with LoRA adapters beside every target linear and every other parameter frozen;
/// returns the sites adapted, in graph order. An error if a target matches no linear.
pub fn apply_lora(model: ForwardModel, spec: &LoraSpec) -> Result<(ForwardModel, Vec<LoraSite>)> {
    let ForwardModel { builder, loss, logits, batch, seq, mut inputs } = model;
    let g = builder.finish();
    let internal = |e: tessera_ir::IrError| ModelError::Invalid {
        field: "--lora".into(),
        reason: format!("the LoRA rewrite failed: {e}"),
    };
    let mut b = Builder::from_graph(Graph::with_capacity(g.nodes.len() + 64, g.tensors.len() + 64));
    for s in 1..g.num_scopes() {
        b.graph.intern_scope(g.scope_name(ScopeId(s as u32)));
    }
    let mut map: Vec<Option<TensorId>> = vec![None; g.tensors.len()];
    let mut sites = Vec::new();
    let mut seed = inputs.iter().find(|i| i.kind == InputKind::Seed).map(|i| i.tensor);
    let mut new_seed = None;
    for node in &g.nodes {
        b.set_scope_id(node.scope);
        b.set_block(node.block);
        b.set_phase(node.phase);
        let ins = node
            .inputs
            .iter()
            .map(|&t| {
                map[t.index()].ok_or_else(|| internal(tessera_ir::IrError::Graph("order".into())))
            })
            .collect::<Result<Vec<_>>>()?;
        let op = match &node.op {
            Op::Parameter { meta, .. } => Op::Parameter { meta: meta.clone(), frozen: true },
            other => other.clone(),
        };
        let mut outs = b.push_like(&g, node, op, &ins).map_err(internal)?;
        let site = linear_module(&g, node).filter(|(m, ..)| spec.targets_module(m));
        if let Some((module, in_features, out_features)) = site {
            let x = ins[0];
            let dtype = b.dtype(x);
            let r = spec.rank;
            let a = b.parameter(&lora_a_name(&module), [r, in_features], dtype);
            let bw = b.parameter(&lora_b_name(&module), [out_features, r], dtype);
            b.set_scope_id(node.scope);
            let x = if spec.dropout > 0.0 {
                let s = match seed {
                    Some(s) => s,
                    None => {
                        let s = b.input("seed", Shape::scalar(), DType::I64);
                        b.set_scope_id(node.scope);
                        seed = Some(s);
                        new_seed = Some(s);
                        s
                    }
                };
                let stream = DROPOUT_STREAM_BASE + sites.len() as u64;
                b.dropout(x, spec.dropout, s, stream).map_err(internal)?
            } else {
                x
            };
            let h = b.matmul(x, a, false, true).map_err(internal)?;
            let d = b.matmul(h, bw, false, true).map_err(internal)?;
            let d = b.scale(d, spec.scaling()).map_err(internal)?;
            outs[0] = b.add(outs[0], d).map_err(internal)?;
            sites.push(LoraSite { module, in_features, out_features });
        }
        for (&o, n) in node.outputs.iter().zip(outs) {
            map[o.index()] = Some(n);
        }
    }
    let unmatched: Vec<&String> = spec
        .targets
        .iter()
        .filter(|t| !sites.iter().any(|s| s.module == **t || s.module.ends_with(&format!(".{t}"))))
        .collect();
    if !unmatched.is_empty() {
        let mut linears: Vec<String> = g
            .nodes
            .iter()
            .filter_map(|n| linear_module(&g, n))
            .map(|(m, ..)| m.rsplit('.').next().unwrap_or(&m).to_string())
            .collect();
        linears.sort();
        linears.dedup();
        return Err(ModelError::Invalid {
            field: "--lora targets".into(),
            reason: format!(
                "{unmatched:?} match no linear layer of this model; its linear modules are {}",
                linears.join(", ")
            ),
        });
    }
    let remap = |t: TensorId| map[t.index()].expect("every tensor is copied");
    for i in &mut inputs {
        i.tensor = remap(i.tensor);
    }
    if let Some(s) = new_seed {
        inputs.push(ModelInput { name: "seed", tensor: s, kind: InputKind::Seed });
    }
    let model =
        ForwardModel { builder: b, loss: remap(loss), logits: remap(logits), batch, seq, inputs };
    Ok((model, sites))
}

/// A `--freeze` pattern: `*` matches any run of characters (dots included), `?` one.
pub fn glob_matches(pattern: &str, name: &str) -> bool {
    fn go(p: &[u8], n: &[u8]) -> bool {
        match (p.first(), n.first()) {
            (None, None) => true,
            (Some(b'*'), _) => go(&p[1..], n) || (!n.is_empty() && go(p, &n[1..])),
            (Some(b'?'), Some(_)) => go(&p[1..], &n[1..]),
            (Some(a), Some(b)) if a == b => go(&p[1..], &n[1..]),
            _ => false,
        }
    }
    go(pattern.as_bytes(), name.as_bytes())
}

/// Freezes the parameters of `graph` whose names match any of `patterns`; an error naming a
/// pattern that matches no parameter (a typo would otherwise train everything).
pub fn freeze(graph: &mut Graph, patterns: &[String]) -> Result<usize> {
    let names: Vec<String> =
        graph.parameters().iter().map(|&p| graph.tensor_scope(p).to_string()).collect();
    for pat in patterns {
        if !names.iter().any(|n| glob_matches(pat, n)) {
            let example = names.first().map_or(String::new(), |n| format!(" (e.g. {n})"));
            return Err(ModelError::Invalid {
                field: "--freeze".into(),
                reason: format!(
                    "`{pat}` matches no parameter; patterns match Hugging Face names{example}, \
                     `*` any run of characters"
                ),
            });
        }
    }
    Ok(graph.freeze_where(|name| patterns.iter().any(|p| glob_matches(p, name))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_with_peft_defaults_and_target_lists() {
        let s = LoraSpec::parse("r=4,alpha=16,dropout=0,targets=q_proj,v_proj,o_proj").unwrap();
        assert_eq!((s.rank, s.alpha, s.dropout), (4, 16.0, 0.0));
        assert_eq!(s.targets, ["q_proj", "v_proj", "o_proj"]);
        assert_eq!(s.scaling(), 4.0);
        assert_eq!(LoraSpec::parse("").unwrap().targets, ["q_proj", "v_proj"]);
        assert!(LoraSpec::parse("r=0").unwrap_err().contains("positive"));
        assert!(LoraSpec::parse("q_proj").is_err());
        assert!(LoraSpec::parse("rank=2,bogus=1").unwrap_err().contains("unknown key"));
        assert!(s.targets_module("model.layers.0.self_attn.q_proj"));
        assert!(!s.targets_module("model.layers.0.self_attn.qq_proj"));
    }

    fn backward_matmuls(g: &Graph) -> usize {
        g.nodes
            .iter()
            .filter(|n| n.phase == tessera_ir::Phase::Backward && matches!(n.op, Op::MatMul { .. }))
            .count()
    }

    /// LoRA on llama-tiny: only A and B train, and the backward pass computes no weight
    /// gradient of a frozen linear (at least one product fewer per frozen linear weight).
    #[test]
    fn lora_trains_only_its_adapters_and_skips_frozen_weight_gradients() {
        let cfg = crate::ModelConfig::resolve("llama-tiny").unwrap();
        let opts = crate::BuildOptions { batch: 1, seq: 8, dtype: DType::F32 };
        let train = |m: ForwardModel| {
            tessera_ir::build_training_graph(m.builder, m.loss, &Default::default()).unwrap()
        };
        let full = train(crate::build(&cfg, &opts).unwrap());
        let spec = LoraSpec::parse("r=2,alpha=4,targets=q_proj,v_proj").unwrap();
        let (m, sites) = apply_lora(crate::build(&cfg, &opts).unwrap(), &spec).unwrap();
        let lora = train(m);
        let layers = full
            .graph
            .parameters()
            .iter()
            .filter(|&&p| full.graph.tensor_scope(p).ends_with(".input_layernorm.weight"))
            .count();
        assert!(layers > 0);
        assert_eq!(sites.len(), 2 * layers);
        let trained: Vec<&str> =
            lora.params.iter().map(|s| lora.graph.tensor_scope(s.param)).collect();
        assert_eq!(trained.len(), 4 * layers, "{trained:?}");
        assert!(trained.iter().all(|n| is_lora_name(n)), "{trained:?}");
        let frozen_linears = lora
            .graph
            .frozen_parameters()
            .into_iter()
            .filter(|&p| lora.graph.shape(p).rank() == 2)
            .count();
        // Full training: one dW per linear weight. LoRA adds four products per site forward
        // (two) and backward (at most four), and drops every frozen weight's dW.
        assert!(
            backward_matmuls(&lora.graph) + frozen_linears
                <= backward_matmuls(&full.graph) + 4 * sites.len(),
            "{} backward products with LoRA, {} without, {frozen_linears} frozen",
            backward_matmuls(&lora.graph),
            backward_matmuls(&full.graph)
        );
        let err = apply_lora(
            crate::build(&cfg, &opts).unwrap(),
            &LoraSpec::parse("targets=qkv").unwrap(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("qkv") && err.contains("q_proj"), "{err}");
    }

    #[test]
    fn globs_match_hf_names() {
        assert!(glob_matches("model.embed_tokens.*", "model.embed_tokens.weight"));
        assert!(glob_matches("*.mlp.*", "model.layers.1.mlp.up_proj.weight"));
        assert!(glob_matches(
            "model.layers.?.self_attn.*",
            "model.layers.3.self_attn.q_proj.weight"
        ));
        assert!(!glob_matches("model.layers.?.mlp.*", "model.layers.10.mlp.up_proj.weight"));
    }
}
