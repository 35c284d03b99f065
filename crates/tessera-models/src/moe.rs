//! The sparse mixture-of-experts block of the MoE decoder families — `MixtralForCausalLM`
//! (`block_sparse_moe`) and `Qwen3MoeForCausalLM` (`mlp`) — and its configuration.
//!
//! Papers: Jiang et al. 2024, "Mixtral of Experts"; Qwen3 technical report (Yang et al. 2025).
//! Reference implementation: Hugging Face `transformers`, `models/mixtral/modeling_mixtral.py`
//! and `models/qwen3_moe/modeling_qwen3_moe.py`. The rest of the layer is the LLaMA family's
//! (`llama.rs`).
//!
//! ```text
//! x_nd = h_bsd as [b·s, d]
//! logits_ne = gate(x_nd)                                   # router, no bias
//! p = softmax(logits, f32); top-k; renormalise (Mixtral always, Qwen iff norm_topk_prob)
//! y_nd = Σ_j w_nj · down_e(silu(gate_e x) · up_e x),  e = choice j of token n
//! ```
//! The experts run through [`tessera_ir::moe::routed_experts`]: each sequence is one routing
//! group (GShard's groups), dispatched into its own `[E, C, d]` buffer; the groups' buffers
//! go expert-major for the three batched matmuls over the expert dim, and back for the
//! weighted combine.
//!
//! # Capacity: which tokens drop
//!
//! The capacity `C` is per expert **and per sequence**. Without `capacity_factor` it is
//! dropless (`C = s`: every choice is kept, so the result equals transformers', whose Mixtral
//! and Qwen-MoE never drop). With `capacity_factor` (a tessera key, absent from Hugging Face
//! configs) `C = min(s, ceil(factor · s · k / E))`, and within each sequence every expert
//! keeps the choices of its `C` earliest tokens (token order, then choice order): a later
//! token routed to a full expert gets nothing from that expert, keeps its other choices, and
//! its weights are not renormalised. Because a sequence's drops depend on that sequence
//! alone, the batch size, micro-batching and every plan (dp, ep, tp, pp, cp, ZeRO) drop
//! exactly the same tokens as one device. (Before expert parallelism the capacity was over
//! the whole micro-batch, `ceil(factor · b·s · k / E)`, so a micro-batch's split changed what
//! dropped.)
//!
//! Weights keep the Hub's per-expert names and `nn.Linear` layouts
//! (`…experts.{e}.w1.weight [f, d]`), so checkpoints load one to one; the graph stacks them
//! into `[E, f, d]` per step (a copy of the layer's expert weights, counted in the Program).
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
use tessera_ir::moe::RouterSpec;
use tessera_ir::moe::{capacity, load_balancing_loss, route, routed_experts, ExpertWeights};
use tessera_ir::{Builder, DType, TensorId};

/// Upper bound on experts per layer.
pub const MAX_EXPERTS: usize = 1 << 12;

/// Upper bound on experts summed over the layers (each is three parameters of the graph).
pub const MAX_EXPERT_LAYERS: usize = 1 << 17;

/// The MoE fields of `MixtralConfig` / `Qwen3MoeConfig`, normalised.
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
        // Each expert is its own parameters (the Hub's names): bound the graph's size.
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

    /// Parameters of one sparse block: the experts and the router.
    pub(crate) fn count(&self, hidden: usize) -> Option<u128> {
        let (e, f) = (self.num_experts, self.expert_intermediate_size);
        count(&[&[e, 3, hidden, f], &[e, hidden]])
    }
}

/// The Hub's names of a family's block and of its experts' three projections (gate, up,
/// down).
fn names(variant: LlamaVariant) -> (&'static str, [&'static str; 3]) {
    match variant {
        LlamaVariant::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
        LlamaVariant::Qwen3Moe
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
    let tokens = dims[..dims.len() - 1].iter().product::<usize>();
    // One routing group per sequence (the capacity's group, see the module doc).
    let groups = if dims.len() >= 3 { dims[0] } else { 1 };
    let (n, d) = (tokens / groups.max(1), cfg.hidden_size);
    let (e, f) = (moe.num_experts, moe.expert_intermediate_size);
    let dtype = b.dtype(h_bsd);
    let (scope, [gate, up, down]) = names(cfg.variant);
    let y_nd = b.scoped(scope, |b| {
        let x_gnd = b.reshape(h_bsd, [groups, n, d])?;
        let logits_gne = crate::nn::linear(b, "gate", x_gnd, e, false)?;
        let logits_ne = b.reshape(logits_gne, [tokens, e])?;
        router_logits.push(logits_ne);
        let routing = route(b, logits_gne, &moe.router(), None)?;
        let w = ExpertWeights {
            gate: stacked(b, gate, e, [f, d], dtype)?,
            up: stacked(b, up, e, [f, d], dtype)?,
            down: stacked(b, down, e, [d, f], dtype)?,
            linear_layout: true,
        };
        let c = capacity(n, moe.num_experts_per_tok, e, moe.capacity_factor);
        routed_experts(b, x_gnd, &routing, &w, c)
    })?;
    b.reshape(y_nd, dims)
}

/// The `experts.{i}.{name}.weight` `[out, in]` parameters stacked into `[E, out, in]`.
fn stacked(
    b: &mut Builder,
    name: &str,
    experts: usize,
    [out, inp]: [usize; 2],
    dtype: DType,
) -> IrResult<TensorId> {
    let mut ws = Vec::with_capacity(experts);
    for i in 0..experts {
        let w = b.scoped(format!("experts.{i}"), |b| {
            b.scoped(name, |b| b.parameter("weight", [out, inp], dtype))
        });
        ws.push(b.reshape(w, [1, out, inp])?);
    }
    if ws.len() == 1 {
        Ok(ws[0])
    } else {
        b.concat(&ws, 0)
    }
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
