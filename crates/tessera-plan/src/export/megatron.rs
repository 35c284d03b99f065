//! Megatron-LM: a shell script that launches `pretrain_gpt.py` (or `pretrain_bert.py`) with
//! `torchrun` on every node, with the model's architecture, the batch and the plan's
//! parallelism and recomputation as Megatron-LM arguments. Data and tokenizer arguments are
//! the user's: they follow as the script's own arguments (`"$@"`).
//!
//! What Megatron-LM expresses: tensor, sequence and pipeline parallelism (1F1B, interleaved
//! 1F1B, first and last stages of their own size), ZeRO-1 as the distributed optimizer (with
//! `shard=N`, `dp/N` instances of it: `--num-distributed-optimizer-instances`), and
//! full recomputation of every block (`uniform`) or of the first blocks (`block`, without a
//! pipeline). Its `selective` recomputes core attention, while Tessera's `selective` keeps
//! attention outputs and recomputes norms and activations: the two do not match, so a plan
//! with `selective` blocks is refused.

use super::{
    micro_batch_size, summary, CkptPattern, Export, Family, Framework, ModelShape, Target,
};
use crate::config::ParallelConfig;
use crate::pipeline::{layout, ScheduleKind};
use crate::plan::Plan;

/// `cfg` mapped onto what Megatron-LM has (ZeRO-1 at most, 1F1B or interleaving, even
/// middle stages), with and without the distributed optimizer.
pub(super) fn expressible(cfg: &ParallelConfig) -> Vec<ParallelConfig> {
    let mut base = cfg.clone();
    if matches!(base.schedule, Some(ScheduleKind::Gpipe | ScheduleKind::ZbH1)) {
        base.schedule = None;
    }
    if stages_problem(&base).is_some() {
        base.stages.clear();
    }
    base.offload = None;
    // Hybrid sharding of the distributed optimizer is its instances; ZeRO-0 has no shards.
    let shard = |zero: u8| if zero == 1 { cfg.shard } else { None };
    (0..=cfg.zero.min(1))
        .rev()
        .map(|zero| base.clone().with_zero(zero).with_shard(shard(zero)))
        .collect()
}

/// Why Megatron-LM cannot take the stage layout (`None`: it can).
fn stages_problem(cfg: &ParallelConfig) -> Option<String> {
    let sizes = layout::sizes(&cfg.stages);
    if sizes.is_empty() {
        return None;
    }
    if cfg.stages.iter().any(|s| s.ckpt.is_some()) {
        return Some("checkpoint modes per pipeline stage have no Megatron-LM flag".into());
    }
    let interleaved = cfg.schedule.is_some_and(|s| s.chunks() > 1);
    let middle = &sizes[1..sizes.len().saturating_sub(1)];
    let even = middle.first().is_none_or(|m| middle.iter().all(|x| x == m));
    if interleaved || !even {
        return Some(format!(
            "stages of {sizes:?} blocks: Megatron-LM sizes only the first and last stages on \
             their own (--decoder-first/last-pipeline-num-layers), without interleaving"
        ));
    }
    None
}

/// Why Megatron-LM cannot train the model at all (`None`: it can).
pub(super) fn model_problem(model: &ModelShape) -> Option<String> {
    (model.family == Family::Other).then(|| {
        format!(
            "Megatron-LM's training scripts take GPT-, LLaMA- and BERT-shaped models; {} is none \
             of them",
            model.name
        )
    })
}

/// Why Megatron-LM cannot run the plan as it is (`None`: it can).
pub(super) fn problem(cfg: &ParallelConfig, ckpt: CkptPattern, blocks: usize) -> Option<String> {
    if let Some(o) = cfg.offload.filter(|o| o.act) {
        return Some(format!(
            "`{o}`: activation offload (full blocks' kept inputs in host memory): this export does not write Megatron-LM's activation CPU offloading; plan without offload=act"
        ));
    }
    if let Some(o) = cfg.offload {
        return Some(format!(
            "the plan offloads model state to the host (`{o}`), which this export does not \
             write for Megatron-LM (export it to DeepSpeed or torchtitan, which have offload \
             settings, or plan without offload)"
        ));
    }
    if cfg.zero >= 2 {
        return Some(format!(
            "ZeRO-{} shards gradients{}, but Megatron-LM's distributed optimizer \
             (--use-distributed-optimizer) shards the optimizer state only, as ZeRO-1 does",
            cfg.zero,
            if cfg.zero == 3 { " and parameters" } else { "" }
        ));
    }
    if let Some(s @ (ScheduleKind::Gpipe | ScheduleKind::ZbH1)) = cfg.schedule {
        return Some(format!("Megatron-LM runs 1F1B and interleaved 1F1B, not the {s} schedule"));
    }
    if let Some(p) = stages_problem(cfg) {
        return Some(p);
    }
    match ckpt {
        CkptPattern::None | CkptPattern::Full => None,
        CkptPattern::FullFirst(_) if cfg.pp == 1 => None,
        CkptPattern::Selective => Some(
            "Tessera's selective checkpointing (keep matmul and attention outputs, recompute \
             norms and activations) is not Megatron-LM's (recompute core attention)"
                .into(),
        ),
        other => Some(format!(
            "{} has no Megatron-LM recompute flags (it recomputes every block, or the first \
             blocks without a pipeline)",
            other.describe(blocks)
        )),
    }
}

/// The recompute arguments of a checkpointing pattern Megatron-LM expresses.
fn recompute_flags(ckpt: CkptPattern) -> Vec<String> {
    match ckpt {
        CkptPattern::Full => vec![
            "--recompute-granularity full".into(),
            "--recompute-method uniform".into(),
            "--recompute-num-layers 1".into(),
        ],
        CkptPattern::FullFirst(k) => vec![
            "--recompute-granularity full".into(),
            "--recompute-method block".into(),
            format!("--recompute-num-layers {k}"),
        ],
        _ => Vec::new(),
    }
}

/// The architecture arguments.
fn model_flags(target: &Target, seq: usize) -> Vec<String> {
    let m = &target.model;
    let mut f = vec![
        format!("--num-layers {}", m.layers),
        format!("--hidden-size {}", m.hidden),
        format!("--ffn-hidden-size {}", m.ffn_hidden),
        format!("--num-attention-heads {}", m.heads),
    ];
    if m.head_dim * m.heads != m.hidden {
        f.push(format!("--kv-channels {}", m.head_dim));
    }
    if m.kv_heads != m.heads {
        f.push(format!("--group-query-attention --num-query-groups {}", m.kv_heads));
    }
    f.push(format!("--seq-length {seq}"));
    f.push(format!("--max-position-embeddings {}", m.max_positions.max(seq)));
    if let Some(theta) = m.rope_theta {
        f.push(format!("--position-embedding-type rope --rotary-base {theta}"));
        f.push("--normalization RMSNorm --swiglu".into());
    }
    f.push(format!("--norm-epsilon {}", m.norm_eps));
    if !m.linear_bias {
        f.push("--disable-bias-linear".into());
        if m.qkv_bias {
            f.push("--add-qkv-bias".into());
        }
    }
    if m.gelu_tanh {
        f.push("--openai-gelu".into());
    }
    if !m.tied_embeddings {
        f.push("--untie-embeddings-and-output-weights".into());
    }
    f.push(format!(
        "--hidden-dropout {} --attention-dropout {}",
        m.hidden_dropout, m.attention_dropout
    ));
    f
}

pub(super) fn export(
    plan: &Plan,
    cfg: &ParallelConfig,
    ckpt: CkptPattern,
    target: &Target,
) -> Result<Export, String> {
    if let Some(why) = problem(cfg, ckpt, plan.checkpoint.len()) {
        return Err(why);
    }
    let script =
        if target.model.family == Family::Bert { "pretrain_bert.py" } else { "pretrain_gpt.py" };
    let mut groups: Vec<Vec<String>> = vec![model_flags(target, plan.seq)];
    let mut batch = vec![
        format!("--micro-batch-size {}", micro_batch_size(plan, cfg)),
        format!("--global-batch-size {}", plan.batch),
    ];
    match plan.dtype.as_str() {
        "bf16" => batch.push("--bf16".into()),
        "f16" => batch.push("--fp16".into()),
        _ => {}
    }
    if let Some(clip) = target.max_grad_norm {
        batch.push(format!("--clip-grad {clip:?}"));
    }
    groups.push(batch);
    if let Some(m) = &target.model.experts {
        groups.push(crate::expert::megatron_model_args(m, cfg.ep));
    }
    groups.push(cfg.megatron_args());
    let recompute = recompute_flags(ckpt);
    if !recompute.is_empty() {
        groups.push(recompute);
    }
    let mut text = String::from("#!/usr/bin/env bash\n");
    text += &format!("# {}\n", summary(plan, cfg));
    if target.nodes > 1 {
        text += &format!(
            "# Run it on each of the {} nodes with NODE_RANK (0 to {}) and MASTER_ADDR (node 0's \
             address) set.\n",
            target.nodes,
            target.nodes - 1
        );
    }
    text += "# Run it from a Megatron-LM checkout; data and tokenizer arguments (--data-path, \
             --tokenizer-type, ...) follow as this script's arguments.\n";
    text += &format!(
        "# The vocabulary ({} tokens) comes from the tokenizer; Megatron-LM pads it to a \
         multiple of 128 x tensor-parallel size.\n",
        target.model.vocab
    );
    text += "set -euo pipefail\n";
    text += &format!(
        "torchrun --nnodes {} --nproc-per-node {} --node-rank \"${{NODE_RANK:-0}}\" \\\n    \
         --master-addr \"${{MASTER_ADDR:-localhost}}\" --master-port \"${{MASTER_PORT:-6000}}\" \\\n    \
         {script} \\\n",
        target.nodes, target.gpus_per_node
    );
    for g in &groups {
        for line in g.chunks(4) {
            text += &format!("    {} \\\n", line.join(" "));
        }
    }
    text += "    \"$@\"\n";
    Ok(Export {
        framework: Framework::Megatron,
        text,
        launch: format!(
            "{}bash FILE --data-path ... --tokenizer-type ...",
            if target.nodes > 1 { "NODE_RANK=<0..> MASTER_ADDR=<node 0> " } else { "" }
        ),
    })
}
