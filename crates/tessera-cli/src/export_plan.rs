//! `tessera plan --export megatron|deepspeed|torchtitan`: the plan as the file another engine
//! runs ([`tessera_plan::export`]), or — when that engine cannot express it — an error naming
//! why and the fastest nearby configuration that it can, with its predicted step time.

use crate::plan_cmd::plan_err;
use anyhow::{Context, Result};
use clap::ValueEnum;
use std::path::Path;
use tessera_models::{Activation, ModelConfig};
use tessera_plan::export::{
    self, Export, Family, Framework, ModelExperts, ModelShape, Refusal, Target,
};
use tessera_plan::plan::Plan;
use tessera_plan::planner::{self, Request};
use tessera_plan::PlanError;

/// The engines `--export` writes for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExportTo {
    /// Megatron-LM: a bash script launching pretrain_gpt.py with torchrun.
    Megatron,
    /// DeepSpeed: a ds_config.json.
    Deepspeed,
    /// torchtitan: a job TOML.
    Torchtitan,
}

impl ExportTo {
    pub fn framework(self) -> Framework {
        match self {
            ExportTo::Megatron => Framework::Megatron,
            ExportTo::Deepspeed => Framework::DeepSpeed,
            ExportTo::Torchtitan => Framework::Torchtitan,
        }
    }
}

/// The architecture as the export's model arguments name it. Attention dropout is 0 for every
/// family: Tessera's attention is one fused op and applies none, so the exported run matches
/// the planned one.
pub fn model_shape(cfg: &ModelConfig) -> ModelShape {
    let name = cfg.name().to_string();
    match cfg {
        ModelConfig::Gpt2(c) => ModelShape {
            name,
            family: Family::Gpt2,
            layers: c.n_layer,
            hidden: c.n_embd,
            heads: c.n_head,
            kv_heads: c.n_head,
            head_dim: c.n_embd / c.n_head,
            ffn_hidden: c.n_inner,
            vocab: c.vocab_size,
            max_positions: c.n_positions,
            rope_theta: None,
            norm_eps: c.layer_norm_epsilon,
            linear_bias: true,
            qkv_bias: false,
            gelu_tanh: c.activation_function == Activation::GeluTanh,
            tied_embeddings: c.tie_word_embeddings,
            hidden_dropout: c.resid_pdrop,
            attention_dropout: 0.0,
            experts: None,
        },
        // Multi-head latent attention (DeepSeek-V3): no engine's LLaMA model has it, so it
        // exports as a model-agnostic one, as BLOOM does.
        ModelConfig::Llama(c) => ModelShape {
            name,
            family: if c.mla.is_some() { Family::Other } else { Family::Llama },
            layers: c.num_hidden_layers,
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim(),
            ffn_hidden: c.intermediate_size,
            vocab: c.vocab_size,
            max_positions: c.max_position_embeddings,
            rope_theta: Some(c.rope_theta),
            norm_eps: c.rms_norm_eps,
            linear_bias: c.mlp_bias && c.o_bias,
            qkv_bias: c.qkv_bias,
            gelu_tanh: false,
            tied_embeddings: c.tie_word_embeddings,
            hidden_dropout: 0.0,
            attention_dropout: 0.0,
            experts: c.moe.as_ref().map(|m| model_experts(m, c.num_hidden_layers)),
        },
        ModelConfig::Bert(c) => ModelShape {
            name,
            family: Family::Bert,
            layers: c.num_hidden_layers,
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_attention_heads,
            head_dim: c.hidden_size / c.num_attention_heads,
            ffn_hidden: c.intermediate_size,
            vocab: c.vocab_size,
            max_positions: c.max_position_embeddings,
            rope_theta: None,
            norm_eps: c.layer_norm_eps,
            linear_bias: true,
            qkv_bias: false,
            gelu_tanh: c.hidden_act == Activation::GeluTanh,
            tied_embeddings: c.tie_word_embeddings,
            hidden_dropout: c.hidden_dropout_prob,
            attention_dropout: 0.0,
            experts: None,
        },
        // ALiBi positions: no engine's GPT or LLaMA model takes them (Megatron-LM has no
        // `--position-embedding-type alibi`, torchtitan trains LLaMA only), so BLOOM exports
        // as a model-agnostic one, with its real dims.
        ModelConfig::Bloom(c) => ModelShape {
            name,
            family: Family::Other,
            layers: c.n_layer,
            hidden: c.hidden_size,
            heads: c.n_head,
            kv_heads: c.n_head,
            head_dim: c.head_dim(),
            ffn_hidden: c.mlp_width(),
            vocab: c.vocab_size,
            max_positions: 0,
            rope_theta: None,
            norm_eps: c.layer_norm_epsilon,
            linear_bias: true,
            qkv_bias: true,
            gelu_tanh: true,
            tied_embeddings: c.tie_word_embeddings,
            hidden_dropout: c.hidden_dropout,
            attention_dropout: 0.0,
            experts: None,
        },
        // An imported graph names no architecture an engine would rebuild.
        ModelConfig::Vit(_)
        | ModelConfig::Mlp(_)
        | ModelConfig::Onnx(_)
        | ModelConfig::UNet(_)
        | ModelConfig::ClipText(_)
        | ModelConfig::Vae(_)
        | ModelConfig::Dit(_) => ModelShape {
            name,
            family: Family::Other,
            layers: 0,
            hidden: 0,
            heads: 0,
            kv_heads: 0,
            head_dim: 0,
            ffn_hidden: 0,
            vocab: 0,
            max_positions: 0,
            rope_theta: None,
            norm_eps: 0.0,
            linear_bias: true,
            qkv_bias: false,
            gelu_tanh: false,
            tied_embeddings: false,
            hidden_dropout: 0.0,
            attention_dropout: 0.0,
            experts: None,
        },
    }
}

/// A mixture of experts' routed experts as the exports name them.
fn model_experts(m: &tessera_models::MoeParams, layers: usize) -> ModelExperts {
    ModelExperts {
        experts: m.num_experts,
        top_k: m.num_experts_per_tok,
        ffn_hidden: m.expert_intermediate_size,
        sparse_layers: (0..layers).map(|l| m.is_sparse(l)).collect(),
        capacity_factor: m.capacity_factor,
        renormalise: m.norm_topk_prob,
        aux_loss_coeff: m.output_router_logits.then_some(m.router_aux_loss_coef),
        shared_expert: m.shared_expert_intermediate_size.map(|w| (w, true)),
    }
}

/// Exports `plan`, or errs naming why not and the fastest nearby plan the engine runs.
pub fn export_plan(
    req: &Request<'_>,
    plan: &Plan,
    to: ExportTo,
    model: &ModelConfig,
) -> Result<Export> {
    let target = Target {
        model: model_shape(model),
        nodes: req.cluster.nodes,
        gpus_per_node: req.cluster.gpus_per_node,
        max_grad_norm: req.train.max_grad_norm,
    };
    let refusal = match export::export(to.framework(), plan, &target) {
        Ok(e) => return Ok(e),
        Err(r) => r,
    };
    let Refusal { framework, why, nearest } = refusal;
    // The fastest candidate that fits the budget and exports.
    let mut best: Option<(Plan, Export)> = None;
    for cfg in &nearest {
        let Ok(p) = planner::plan_fixed(req, cfg) else { continue };
        if best.as_ref().is_some_and(|(b, _)| b.predicted.step_time_s <= p.predicted.step_time_s) {
            continue;
        }
        if let Ok(e) = export::export(framework, &p, &target) {
            best = Some((p, e));
        }
    }
    let advice = match best {
        _ if nearest.is_empty() => String::new(),
        Some((p, _)) => format!(
            "; the nearest plan {framework} runs is `{}` at {:.4} s per step ({:+.1}% against \
             this plan's {:.4} s, peak {} per device): export it with --plan \"{}\"",
            p.config,
            p.predicted.step_time_s,
            (p.predicted.step_time_s / plan.predicted.step_time_s - 1.0) * 100.0,
            plan.predicted.step_time_s,
            tessera_plan::units::format_bytes(
                p.predicted.peak_bytes_per_device.iter().copied().max().unwrap_or(0)
            ),
            p.config
        ),
        None => format!(
            "; no configuration near it that {framework} runs fits the budget on this cluster"
        ),
    };
    Err(plan_err(PlanError::Invalid(format!(
        "cannot export `{}` to {framework}: {why}{advice}",
        plan.config
    ))))
}

/// Writes the export to `out` (atomically) or stdout, and the launch command to stderr.
pub fn write(e: &Export, out: Option<&Path>) -> Result<()> {
    match out {
        Some(path) => {
            crate::output::write_output(path, e.text.as_bytes())
                .with_context(|| format!("writing the {} export", e.framework))?;
            eprintln!("wrote {} ({})", path.display(), e.framework);
            eprintln!("launch: {}", e.launch.replace("FILE", &path.display().to_string()));
        }
        None => {
            crate::profile_cmd::print_stdout(&e.text)?;
            eprintln!("launch: {}", e.launch);
        }
    }
    Ok(())
}
