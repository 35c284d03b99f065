//! The sparse mixture-of-experts block of the MoE decoder families — `MixtralForCausalLM`
//! (`block_sparse_moe`), `Qwen2MoeForCausalLM` and `Qwen3MoeForCausalLM` (`mlp`) — and its
//! configuration.
//!
//! Papers: Jiang et al. 2024, "Mixtral of Experts"; Qwen2 technical report (Yang et al. 2024,
//! the shared expert); Qwen3 technical report (Yang et al. 2025). Reference implementation:
//! Hugging Face `transformers`, `models/mixtral/modeling_mixtral.py`,
//! `models/qwen2_moe/modeling_qwen2_moe.py` and `models/qwen3_moe/modeling_qwen3_moe.py`. The
//! rest of the layer is the LLaMA family's (`llama.rs`).
//!
//! ```text
//! x_nd = h_bsd as [b·s, d]
//! logits_ne = gate(x_nd)                                   # router, no bias
//! p = softmax(logits, f32); top-k; renormalise (Mixtral always, Qwen iff norm_topk_prob)
//! y_nd = Σ_j w_nj · down_e(silu(gate_e x) · up_e x),  e = choice j of token n
//! y_nd += sigmoid(shared_expert_gate(x_nd)) · shared_expert(x_nd)      # Qwen2-MoE only
//! ```
//! The experts run through [`tessera_ir::moe::routed_experts`]: dispatch into `[E, C, d]`,
//! three batched matmuls over the expert dim, weighted combine. The capacity `C` is dropless
//! (`C = b·s`: every choice is kept, so the result equals transformers') unless the config
//! sets `capacity_factor` (a tessera key, absent from Hugging Face configs), which gives
//! `C = ceil(factor · b·s · k / E)` and drops the choices past an expert's capacity.
//!
//! Weights: each projection of a layer's experts is one stacked parameter in `nn.Linear`'s
//! layout, `…experts.w1.weight [E, f, d]` (gate), `w3` (up) `[E, f, d]`, `w2` (down)
//! `[E, d, f]` (Qwen: `gate_proj`, `up_proj`, `down_proj`), read transposed by the batched
//! matmuls (no copy per step). Checkpoints keep the Hub's per-expert names
//! (`…experts.{e}.w1.weight [f, d]`): the loader and the checkpoint writer map row `e` of the
//! stacked parameter to and from them ([`tessera_ir::moe::per_expert_name`]).
//!
//! FLOPs: the expert matmuls are counted on every capacity row, padding included
//! (`3 · 2·E·C·d·f` per layer forward): with the dropless capacity that is `E/k` times the
//! work of the tokens' active experts.
//!
//! Loss: transformers adds `router_aux_loss_coef · load_balancing_loss` to the loss whenever
//! `output_router_logits` is true (config.json; default false) and labels are given — so the
//! training step, and `eval`, add it exactly when the config says `output_router_logits: true`.

use crate::config::{count, positive, LlamaConfig, LlamaVariant};
use crate::error::{ModelError, Result};
use crate::nn::IrResult;
use serde::Serialize;
use tessera_ir::moe::{
    capacity, load_balancing_loss, route, routed_experts, ExpertWeights, RouterSpec, EXPERTS_SCOPE,
};
use tessera_ir::{Builder, TensorId, UnaryOp};

/// Upper bound on experts per layer.
pub const MAX_EXPERTS: usize = 1 << 12;

/// Upper bound on experts summed over the layers.
pub const MAX_EXPERT_LAYERS: usize = 1 << 17;

/// The MoE fields of `MixtralConfig` / `Qwen2MoeConfig` / `Qwen3MoeConfig`, normalised.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MoeParams {
    /// `num_local_experts` (Mixtral), `num_experts` (Qwen).
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    /// Each expert's SwiGLU width: Mixtral's `intermediate_size`, Qwen's
    /// `moe_intermediate_size`.
    pub expert_intermediate_size: usize,
    /// Renormalise the top-k weights to sum to one (Mixtral always).
    pub norm_topk_prob: bool,
    pub router_aux_loss_coef: f64,
    /// Adds `router_aux_loss_coef · load_balancing_loss` to the loss.
    pub output_router_logits: bool,
    /// Qwen: layer `l` is sparse iff `(l + 1) % decoder_sparse_step == 0` and `l` is not in
    /// `mlp_only_layers` (Mixtral: 1 and none).
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    /// `None`: dropless. Else each expert takes `ceil(factor · tokens · k / E)` tokens.
    pub capacity_factor: Option<f64>,
    /// Qwen2-MoE's shared expert (`shared_expert_intermediate_size`): a SwiGLU MLP of this
    /// width that every token goes through, scaled by `sigmoid(shared_expert_gate(x))`;
    /// `None` elsewhere.
    pub shared_expert_intermediate_size: Option<usize>,
}

impl MoeParams {
    /// `MixtralConfig`'s defaults (8 experts, top 2), experts `intermediate` wide.
    pub fn mixtral(intermediate: usize) -> MoeParams {
        MoeParams {
            num_experts: 8,
            num_experts_per_tok: 2,
            expert_intermediate_size: intermediate,
            norm_topk_prob: true,
            router_aux_loss_coef: 0.001,
            output_router_logits: false,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
            capacity_factor: None,
            shared_expert_intermediate_size: None,
        }
    }

    /// `Qwen2MoeConfig`'s defaults (those of Qwen1.5-MoE-A2.7B): 60 experts, top 4, 1408
    /// wide, no renormalisation, a shared expert 5632 wide.
    pub fn qwen2_moe() -> MoeParams {
        MoeParams {
            num_experts: 60,
            num_experts_per_tok: 4,
            expert_intermediate_size: 1408,
            norm_topk_prob: false,
            shared_expert_intermediate_size: Some(5632),
            ..MoeParams::mixtral(1408)
        }
    }

    /// `Qwen3MoeConfig`'s defaults: 128 experts, top 8, 768 wide, no renormalisation.
    pub fn qwen3_moe() -> MoeParams {
        MoeParams {
            num_experts: 128,
            num_experts_per_tok: 8,
            expert_intermediate_size: 768,
            norm_topk_prob: false,
            ..MoeParams::mixtral(768)
        }
    }

    /// Whether layer `layer` has the sparse block.
    pub fn is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }

    /// The router of this block.
    pub fn router(&self) -> RouterSpec {
        RouterSpec::qwen_moe(self.num_experts, self.num_experts_per_tok, self.norm_topk_prob)
    }

    pub(crate) fn validate(&self, layers: usize) -> Result<()> {
        positive("num_experts", self.num_experts)?;
        // Bounds the per-expert tensors a checkpoint holds (and the loader maps).
        if self.num_experts > MAX_EXPERTS || self.num_experts * layers > MAX_EXPERT_LAYERS {
            return Err(ModelError::invalid(
                "num_experts",
                format!(
                    "{} experts in {layers} layers: at most {MAX_EXPERTS} experts and \
                     {MAX_EXPERT_LAYERS} experts over all layers are supported (released \
                     models have up to 384)",
                    self.num_experts
                ),
            ));
        }
        positive("num_experts_per_tok", self.num_experts_per_tok)?;
        positive("moe_intermediate_size", self.expert_intermediate_size)?;
        positive("decoder_sparse_step", self.decoder_sparse_step)?;
        if let Some(s) = self.shared_expert_intermediate_size {
            positive("shared_expert_intermediate_size", s)?;
        }
        if self.num_experts_per_tok > self.num_experts {
            return Err(ModelError::invalid(
                "num_experts_per_tok",
                format!(
                    "{} experts per token, but only {} experts",
                    self.num_experts_per_tok, self.num_experts
                ),
            ));
        }
        if let Some(&l) = self.mlp_only_layers.iter().find(|&&l| l >= layers) {
            return Err(ModelError::invalid(
                "mlp_only_layers",
                format!("layer {l} does not exist: the model has {layers} layers"),
            ));
        }
        if !(self.router_aux_loss_coef.is_finite() && self.router_aux_loss_coef >= 0.0) {
            return Err(ModelError::invalid(
                "router_aux_loss_coef",
                format!("{} must be a number ≥ 0", self.router_aux_loss_coef),
            ));
        }
        if let Some(f) = self.capacity_factor {
            if !(f.is_finite() && f > 0.0) {
                return Err(ModelError::invalid(
                    "capacity_factor",
                    format!("{f} must be a positive number (such as 1.25), or null for dropless"),
                ));
            }
        }
        Ok(())
    }

    /// Parameters of one sparse block: the experts, the router, and the shared expert with
    /// its gate.
    pub(crate) fn count(&self, hidden: usize) -> Option<u128> {
        let (e, f) = (self.num_experts, self.expert_intermediate_size);
        let (s, g) = match self.shared_expert_intermediate_size {
            Some(s) => (s, 1),
            None => (0, 0),
        };
        count(&[&[e, 3, hidden, f], &[e, hidden], &[3, hidden, s], &[g, hidden]])
    }
}

/// The Hub's names of a family's block and of its experts' three projections (gate, up,
/// down).
fn names(variant: LlamaVariant) -> (&'static str, [&'static str; 3]) {
    match variant {
        LlamaVariant::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
        LlamaVariant::Qwen2Moe
        | LlamaVariant::Qwen3Moe
        | LlamaVariant::Llama
        | LlamaVariant::Mistral
        | LlamaVariant::Qwen2 => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    }
}

/// The sparse block on `h_bsd` (after `post_attention_layernorm`), inside the layer's scope;
/// its router logits `[b·s, E]` are pushed to `router_logits` (for the auxiliary loss).
pub(crate) fn sparse_block(
    b: &mut Builder,
    cfg: &LlamaConfig,
    moe: &MoeParams,
    h_bsd: TensorId,
    router_logits: &mut Vec<TensorId>,
) -> IrResult<TensorId> {
    let dims = b.shape(h_bsd).dims().to_vec();
    let (tokens, d) = (dims[..dims.len() - 1].iter().product::<usize>(), cfg.hidden_size);
    let (e, f) = (moe.num_experts, moe.expert_intermediate_size);
    let dtype = b.dtype(h_bsd);
    let (scope, [gate, up, down]) = names(cfg.variant);
    let y_nd = b.scoped(scope, |b| {
        let x_nd = b.reshape(h_bsd, [tokens, d])?;
        let logits_ne = crate::nn::linear(b, "gate", x_nd, e, false)?;
        router_logits.push(logits_ne);
        let routing = route(b, logits_ne, &moe.router(), None)?;
        let w = b.scoped(EXPERTS_SCOPE, |b| {
            let mut stacked = |name: &str, shape: [usize; 3]| {
                b.scoped(name, |b| b.parameter("weight", shape, dtype))
            };
            ExpertWeights {
                gate: stacked(gate, [e, f, d]),
                up: stacked(up, [e, f, d]),
                down: stacked(down, [e, d, f]),
                linear_layout: true,
            }
        });
        let c = capacity(tokens, moe.num_experts_per_tok, e, moe.capacity_factor);
        let y_nd = routed_experts(b, x_nd, &routing, &w, c)?;
        match moe.shared_expert_intermediate_size {
            Some(width) => {
                let s_nd = shared_expert(b, x_nd, width, cfg)?;
                b.add(y_nd, s_nd)
            }
            None => Ok(y_nd),
        }
    })?;
    b.reshape(y_nd, dims)
}

/// Qwen2-MoE's shared expert on `x_nd`: `sigmoid(shared_expert_gate(x)) ·
/// down(act(gate(x)) · up(x))`, every projection without bias.
fn shared_expert(
    b: &mut Builder,
    x_nd: TensorId,
    width: usize,
    cfg: &LlamaConfig,
) -> IrResult<TensorId> {
    let d = cfg.hidden_size;
    let y_nd = b.scoped("shared_expert", |b| {
        let g = crate::nn::linear(b, "gate_proj", x_nd, width, false)?;
        let g = b.unary(cfg.hidden_act.unary_op(), g)?;
        let u = crate::nn::linear(b, "up_proj", x_nd, width, false)?;
        let a = b.mul(g, u)?;
        crate::nn::linear(b, "down_proj", a, d, false)
    })?;
    let gate_n1 = crate::nn::linear(b, "shared_expert_gate", x_nd, 1, false)?;
    let gate_n1 = b.unary(UnaryOp::Sigmoid, gate_n1)?;
    let tokens = b.shape(x_nd).dim(0);
    let gate_nd = b.expand(gate_n1, [tokens, d])?;
    b.mul(y_nd, gate_nd)
}

/// `router_aux_loss_coef · load_balancing_loss` over the layers' router logits, when the
/// config asks for it (`output_router_logits`) and there are sparse layers.
pub(crate) fn aux_loss(
    b: &mut Builder,
    moe: &MoeParams,
    router_logits: &[TensorId],
) -> IrResult<Option<TensorId>> {
    if !moe.output_router_logits || router_logits.is_empty() {
        return Ok(None);
    }
    let l = b.scoped("router_aux_loss", |b| {
        let l = load_balancing_loss(b, router_logits, moe.num_experts_per_tok)?;
        b.scale(l, moe.router_aux_loss_coef)
    })?;
    Ok(Some(l))
}
