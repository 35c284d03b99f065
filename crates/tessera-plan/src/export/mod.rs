//! Plans handed to the engines people run on GPUs: Megatron-LM arguments with their `torchrun`
//! launch ([`megatron`]), a DeepSpeed config JSON ([`deepspeed`]) and a torchtitan job TOML
//! ([`torchtitan`]).
//!
//! An export writes exactly what the plan does, or nothing: a plan the framework cannot
//! express (a per-op layout other than data parallelism over every device, a ZeRO stage or
//! schedule it lacks, a checkpointing pattern it
//! cannot name, an offload it has no setting for) is a [`Refusal`] naming why and the
//! configurations nearest to it that the framework can express. Which of those fits and is fastest is the planner's business: the
//! caller evaluates them ([`crate::planner::plan_fixed`]) and exports the winner again, so a
//! suggested plan is always one that exports.
//!
//! What is read from the plan: its config (dp, tp, cp, pp, sp, ZeRO, micro-batches, schedule,
//! stages), per-block checkpointing, batch, sequence, precision and predictions; the model's
//! architecture comes as a [`ModelShape`] and the machines as a [`Target`].

pub mod deepspeed;
pub mod megatron;
pub mod torchtitan;

use crate::axis::{Engine, ExportFields};
use crate::config::ParallelConfig;
use crate::plan::{BlockCkpt, Plan};
use crate::units::format_bytes;
use std::fmt;
use tessera_ir::CkptMode;

/// The engines a plan exports to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framework {
    /// Megatron-LM (`pretrain_gpt.py` / `pretrain_bert.py` arguments and a `torchrun` launch).
    Megatron,
    /// DeepSpeed (a `ds_config.json` for `deepspeed.initialize`).
    DeepSpeed,
    /// torchtitan (a job TOML for `torchtitan.train`).
    Torchtitan,
}

impl Framework {
    pub fn name(self) -> &'static str {
        match self {
            Framework::Megatron => "Megatron-LM",
            Framework::DeepSpeed => "DeepSpeed",
            Framework::Torchtitan => "torchtitan",
        }
    }
}

impl fmt::Display for Framework {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A model family as the frameworks name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// GPT-2: learned positions, LayerNorm, GELU MLP, biases.
    Gpt2,
    /// LLaMA-shaped: RoPE, RMSNorm, SwiGLU (LLaMA, Mistral, Qwen2).
    Llama,
    /// BERT: bidirectional encoder.
    Bert,
    /// Anything else (ViT, MLP): only model-agnostic engines take it.
    Other,
}

/// The architecture an export's model arguments describe.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    /// The model's name (a preset like `llama3-8b`, or the config's `_name_or_path`).
    pub name: String,
    pub family: Family,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    /// Key/value heads (= heads without grouped-query attention).
    pub kv_heads: usize,
    /// Width of one attention head (usually hidden / heads).
    pub head_dim: usize,
    pub ffn_hidden: usize,
    pub vocab: usize,
    pub max_positions: usize,
    /// RoPE base (`None`: learned or no positions).
    pub rope_theta: Option<f64>,
    pub norm_eps: f64,
    /// Bias on the attention and MLP linears.
    pub linear_bias: bool,
    /// Bias on q/k/v only (Qwen2).
    pub qkv_bias: bool,
    /// GPT-2's tanh-approximated GELU.
    pub gelu_tanh: bool,
    pub tied_embeddings: bool,
    /// Dropout probability of the residual stream (0 for LLaMA).
    pub hidden_dropout: f64,
    /// Dropout probability of the attention weights.
    pub attention_dropout: f64,
    /// The routed experts of a mixture of experts (`None`: a dense model).
    pub experts: Option<ModelExperts>,
}

/// A mixture of experts' routed experts (defined beside the expert axis, which writes their
/// Megatron-LM arguments).
pub use crate::axis::expert::ModelExperts;

/// Where and how the exported job runs.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    pub model: ModelShape,
    pub nodes: usize,
    pub gpus_per_node: usize,
    /// Gradient clipping by global norm (Tessera's training default is 1.0).
    pub max_grad_norm: Option<f64>,
}

/// An exported plan: the file's text and the command that launches it.
#[derive(Clone, Debug, PartialEq)]
pub struct Export {
    pub framework: Framework,
    /// The file: a shell script (Megatron-LM), JSON (DeepSpeed) or TOML (torchtitan).
    pub text: String,
    /// The launch command, `FILE` standing for where the text is saved.
    pub launch: String,
}

/// Why a plan does not export, and configurations near it that the framework expresses
/// (none when the framework cannot take the model at all).
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    pub framework: Framework,
    pub why: String,
    pub nearest: Vec<ParallelConfig>,
}

/// Exports `plan` to `framework`, or refuses with the reason and the nearest candidates.
pub fn export(framework: Framework, plan: &Plan, target: &Target) -> Result<Export, Refusal> {
    let cfg = ParallelConfig::parse(&plan.config).map_err(|e| Refusal {
        framework,
        why: format!("the plan's config `{}` does not parse: {e}", plan.config),
        nearest: Vec::new(),
    })?;
    let refuse = |why: String, nearest: Vec<ParallelConfig>| Refusal { framework, why, nearest };
    let model_problem = match framework {
        Framework::Megatron => megatron::model_problem(&target.model),
        Framework::DeepSpeed => None,
        Framework::Torchtitan => torchtitan::model_problem(&target.model),
    };
    if let Some(why) = model_problem {
        return Err(refuse(why, Vec::new()));
    }
    let engine = match framework {
        Framework::Megatron => Engine::Megatron,
        Framework::DeepSpeed => Engine::DeepSpeed,
        Framework::Torchtitan => Engine::Torchtitan,
    };
    // An axis the engine cannot run refuses, with the nearest config it can.
    if let ExportFields::Refused { why, nearest: near } = crate::axis::export_fields(engine, &cfg) {
        return Err(refuse(why, nearest(framework, &near, plan.batch)));
    }
    if let Some((why, fitted)) = kv_heads_problem(framework, &cfg, &target.model) {
        return Err(refuse(why, nearest(framework, &fitted, plan.batch)));
    }
    if plan.layout == "per-op" && !data_parallel_layout(plan, &cfg) {
        return Err(refuse(
            format!(
                "the plan is a per-op layout (the search chose each op's sharding, which `{}` \
                 only approximates), and {framework} runs its own tensor-parallel layout",
                plan.config
            ),
            nearest(framework, &cfg, plan.batch),
        ));
    }
    let ckpt = CkptPattern::of(&plan.checkpoint);
    match framework {
        Framework::Megatron => megatron::export(plan, &cfg, ckpt, target),
        Framework::DeepSpeed => deepspeed::export(plan, &cfg, ckpt, target),
        Framework::Torchtitan => torchtitan::export(plan, &cfg, ckpt, target),
    }
    .map_err(|why| refuse(why, nearest(framework, &cfg, plan.batch)))
}

/// Why `framework` cannot run `cfg` checkpointed as `ckpt` on a model of `blocks` blocks
/// (`None`: it can), whatever the model. The constraint the planner's search of a config
/// string's free knobs reads when the plan is to be exported ([`crate::planner::plan_config`]):
/// each engine's rules live here, in its module, and nowhere in the search.
pub fn runs(
    framework: Framework,
    cfg: &ParallelConfig,
    ckpt: CkptPattern,
    blocks: usize,
) -> Option<String> {
    match framework {
        Framework::Megatron => megatron::problem(cfg, ckpt, blocks),
        Framework::DeepSpeed => deepspeed::problem(cfg, ckpt, blocks),
        Framework::Torchtitan => torchtitan::problem(cfg, ckpt, blocks),
    }
}

/// Why `framework` cannot take `cfg`'s tensor parallelism past the model's KV heads (Tessera
/// replicates them; Megatron-LM divides the query groups by tp, torchtitan splits `wk`/`wv`
/// column-wise), and the config it can: tp cut to the largest degree dividing both tp and
/// the KV heads, the rest of the devices to data parallelism.
fn kv_heads_problem(
    framework: Framework,
    cfg: &ParallelConfig,
    model: &ModelShape,
) -> Option<(String, ParallelConfig)> {
    let kv = model.kv_heads;
    if cfg.tp <= kv || kv == 0 || framework == Framework::DeepSpeed {
        return None;
    }
    let how = match framework {
        Framework::Megatron => "Megatron-LM divides the query groups by the tensor-parallel size",
        _ => "torchtitan splits wk and wv column-wise over the tensor-parallel ranks",
    };
    let mut t = cfg.tp;
    let mut k = kv;
    while k != 0 {
        (t, k) = (k, t % k);
    }
    let fitted = cfg.clone().with_tp(t).with_dp(cfg.dp * cfg.tp / t);
    Some((
        format!(
            "tp{} exceeds {}'s {kv} KV heads, which Tessera replicates, but {how}, so each rank \
             needs whole KV heads",
            cfg.tp, model.name
        ),
        fitted,
    ))
}

/// Whether a per-op plan is data parallelism over every device, which `cfg` (`dpN tp1 zeroK`)
/// then says exactly: every forward op's tensors whole or split by their leading (batch) dim
/// over all of the mesh's axes — parameters whole where they are read, their ZeRO shards over
/// every device. The search lays such a plan on a mesh of several axes (`[2, 8]` on two nodes)
/// to price its collectives in two levels, but the sharding is the frameworks' FSDP (ZeRO-3)
/// or DDP with ZeRO-1/2 over all N ranks, whose collectives NCCL runs over the same two levels
/// by itself. (HSDP — a replica per node — is not this: the search shards ZeRO state over
/// every data-parallel axis.)
fn data_parallel_layout(plan: &Plan, cfg: &ParallelConfig) -> bool {
    if cfg.tp != 1 || cfg.dp != plan.devices || cfg.pp != 1 || plan.pipeline.is_some() {
        return false;
    }
    let live: Vec<usize> = (0..plan.mesh.shape.len()).filter(|&a| plan.mesh.shape[a] > 1).collect();
    let batch_split = |spec: &str| -> bool {
        let Some(s) = crate::Spec::parse(spec) else { return false };
        let leading_ok = s.dims.first().is_none_or(|d| {
            let mut d = d.clone();
            d.sort_unstable();
            d.is_empty() || d == live
        });
        leading_ok && s.dims.iter().skip(1).all(|d| d.is_empty())
    };
    plan.strategies
        .iter()
        .all(|st| st.inputs.iter().chain(&st.outputs).all(|spec| batch_split(spec)))
}

/// Configurations near `cfg` that `framework` expresses: its parallelism mapped onto what the
/// framework has, with none or full checkpointing (no framework's `selective` keeps what
/// Tessera's keeps; see the framework modules), and every micro-batch count (a power of two up
/// to 64, or `cfg`'s own) that splits `batch` over the data-parallel replicas.
pub fn nearest(framework: Framework, cfg: &ParallelConfig, batch: usize) -> Vec<ParallelConfig> {
    let bases = match framework {
        Framework::Megatron => megatron::expressible(cfg),
        Framework::DeepSpeed => deepspeed::expressible(cfg),
        Framework::Torchtitan => torchtitan::expressible(cfg),
    };
    let mut out: Vec<ParallelConfig> = Vec::new();
    for base in bases {
        let counts = std::iter::once(base.micro_batches).chain((0..7).map(|k| 1usize << k));
        for mb in counts {
            if !batch.is_multiple_of(base.dp * mb) {
                continue;
            }
            for m in [CkptMode::None, CkptMode::Full] {
                let c = base.clone().with_ckpt(Some(m)).with_micro_batches(mb);
                if !out.contains(&c) {
                    out.push(c);
                }
            }
        }
    }
    out
}

/// Per-block activation checkpointing as the frameworks can name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CkptPattern {
    /// No block recomputes (or the model has no blocks).
    None,
    /// Every block `selective`.
    Selective,
    /// Every block `full`.
    Full,
    /// `full` on the first `k` blocks (0 < k < blocks), none after.
    FullFirst(usize),
    /// `full` on every `n`-th block (blocks n-1, 2n-1, ...; 1 < n < blocks), none elsewhere.
    FullEvery(usize),
    /// Anything else.
    Mixed,
}

impl CkptPattern {
    /// One mode on every block (`None`: no checkpointing).
    pub fn uniform(mode: Option<CkptMode>) -> CkptPattern {
        match mode {
            None | Some(CkptMode::None) => CkptPattern::None,
            Some(CkptMode::Selective) => CkptPattern::Selective,
            Some(CkptMode::Full) => CkptPattern::Full,
        }
    }

    pub fn of(blocks: &[BlockCkpt]) -> CkptPattern {
        let modes: Vec<CkptMode> = blocks.iter().map(|b| b.mode).collect();
        let all = |m: CkptMode| modes.iter().all(|&x| x == m);
        if all(CkptMode::None) {
            return CkptPattern::None;
        }
        if all(CkptMode::Selective) {
            return CkptPattern::Selective;
        }
        if all(CkptMode::Full) {
            return CkptPattern::Full;
        }
        if modes.contains(&CkptMode::Selective) {
            return CkptPattern::Mixed;
        }
        let full: Vec<usize> = (0..modes.len()).filter(|&b| modes[b] == CkptMode::Full).collect();
        if full.iter().enumerate().all(|(i, &b)| i == b) {
            return CkptPattern::FullFirst(full.len());
        }
        let Some(&first) = full.first() else { return CkptPattern::None };
        let n = first + 1;
        let every: Vec<usize> = (0..modes.len()).filter(|b| (b + 1) % n == 0).collect();
        if n > 1 && every == full {
            return CkptPattern::FullEvery(n);
        }
        CkptPattern::Mixed
    }

    /// How the plan checkpoints, for messages.
    pub fn describe(self, blocks: usize) -> String {
        match self {
            CkptPattern::None => "no checkpointing".into(),
            CkptPattern::Selective => "selective checkpointing on every block".into(),
            CkptPattern::Full => "full checkpointing on every block".into(),
            CkptPattern::FullFirst(k) => {
                format!("full checkpointing on the first {k} of {blocks} blocks")
            }
            CkptPattern::FullEvery(n) => format!("full checkpointing on every {n}th block"),
            CkptPattern::Mixed => "a per-block mix of checkpoint modes".into(),
        }
    }
}

/// Sequences per micro-batch on one data-parallel replica (the frameworks' micro-batch size).
fn micro_batch_size(plan: &Plan, cfg: &ParallelConfig) -> usize {
    plan.batch / (cfg.dp * cfg.micro_batches).max(1)
}

/// One header line: what the file holds and what Tessera predicts for it.
fn summary(plan: &Plan, cfg: &ParallelConfig) -> String {
    let per_op = if plan.layout == "per-op" {
        format!(
            " (its per-op layout on a {:?} mesh: data parallelism over every device)",
            plan.mesh.shape
        )
    } else {
        String::new()
    };
    format!(
        "Tessera plan `{}`{per_op} for {} on {} (batch {} x seq {}, {}): predicted {:.4} s per \
         step, peak {} per device",
        cfg.canonical(),
        plan.model,
        plan.cluster,
        plan.batch,
        plan.seq,
        plan.dtype,
        plan.predicted.step_time_s,
        format_bytes(plan.predicted.peak_bytes_per_device.iter().copied().max().unwrap_or(0))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(modes: &[CkptMode]) -> Vec<BlockCkpt> {
        modes.iter().enumerate().map(|(b, &mode)| BlockCkpt { block: b as u32, mode }).collect()
    }

    #[test]
    fn checkpoint_patterns_are_named_exactly() {
        use CkptMode::{Full as F, None as N, Selective as S};
        assert_eq!(CkptPattern::of(&[]), CkptPattern::None);
        assert_eq!(CkptPattern::of(&blocks(&[N, N])), CkptPattern::None);
        assert_eq!(CkptPattern::of(&blocks(&[S, S])), CkptPattern::Selective);
        assert_eq!(CkptPattern::of(&blocks(&[F, F, F])), CkptPattern::Full);
        assert_eq!(CkptPattern::of(&blocks(&[F, F, N, N])), CkptPattern::FullFirst(2));
        assert_eq!(CkptPattern::of(&blocks(&[N, F, N, F])), CkptPattern::FullEvery(2));
        assert_eq!(CkptPattern::of(&blocks(&[N, N, F, N, N, F])), CkptPattern::FullEvery(3));
        assert_eq!(CkptPattern::of(&blocks(&[N, F, F, N])), CkptPattern::Mixed);
        assert_eq!(CkptPattern::of(&blocks(&[S, N])), CkptPattern::Mixed);
        assert_eq!(CkptPattern::of(&blocks(&[N, F, N, F, N])), CkptPattern::FullEvery(2));
        assert_eq!(CkptPattern::of(&blocks(&[N, F, N, N])), CkptPattern::Mixed);
    }

    #[test]
    fn nearest_configs_are_what_each_framework_has() {
        let cfg = ParallelConfig::parse("dp2 tp4 zero2 mb2").unwrap();
        let m = nearest(Framework::Megatron, &cfg, 16);
        assert!(m.iter().all(|c| c.zero <= 1 && c.tp == 4 && c.dp == 2 && c.ckpt.is_some()));
        let d = nearest(Framework::DeepSpeed, &cfg, 16);
        assert!(d.iter().all(|c| c.tp == 1 && c.dp == 8 && !c.sp), "{d:?}");
        let t = nearest(Framework::Torchtitan, &cfg, 16);
        assert!(t.iter().all(|c| c.sp && matches!(c.zero, 0 | 3)), "{t:?}");
        for (fw, list) in
            [(Framework::Megatron, &m), (Framework::DeepSpeed, &d), (Framework::Torchtitan, &t)]
        {
            assert!(!list.is_empty(), "{fw}");
            for c in list.iter() {
                assert_eq!(c.devices(), cfg.devices(), "{fw}: {c}");
                c.validate().unwrap();
                assert!(16 % (c.dp * c.micro_batches) == 0, "{fw}: {c}");
            }
        }
    }
}
