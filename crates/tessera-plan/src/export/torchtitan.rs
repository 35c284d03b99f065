//! torchtitan: a job TOML for `torchtitan.train` — the model and flavor, batch and sequence,
//! FSDP/DDP degrees, tensor and pipeline parallelism, and the activation-checkpoint policy —
//! with the `torchrun` line in its header.
//!
//! What torchtitan expresses: ZeRO-0 as DDP (`data_parallel_replicate_degree`), ZeRO-3 as
//! FSDP2 (`data_parallel_shard_degree`), and hybrid sharding (`zero3 shard=N`) as HSDP (both
//! degrees: dp/N replicas of N-way FSDP); tensor parallelism, which in torchtitan always
//! shards the norms' sequence (Megatron's sequence parallelism, so `tpN` needs `sp`); pipeline
//! parallelism with even stages under GPipe or 1F1B; full recomputation of every block, or of
//! every n-th block (`selective_ac_option = "n"`); FSDP2's CPU offload of parameters,
//! gradients and optimizer state (`enable_cpu_offload`: Tessera's `zero3 offload=all`). Its
//! op-level selective policy saves other tensors than Tessera's `selective`, and it trains the
//! LLaMA family only.

use super::{
    micro_batch_size, summary, CkptPattern, Export, Family, Framework, ModelShape, Target,
};
use crate::config::ParallelConfig;
use crate::offload::{Offload, OffloadKind, CHUNKS};
use crate::pipeline::ScheduleKind;
use crate::plan::Plan;

/// `cfg` mapped onto torchtitan: `sp` with tensor parallelism, ZeRO-1/2 as either DDP or
/// FSDP, GPipe or 1F1B on even stages.
pub(super) fn expressible(cfg: &ParallelConfig) -> Vec<ParallelConfig> {
    let mut base = cfg.clone().with_sp(cfg.tp > 1).with_stages(Vec::new());
    if !matches!(base.schedule, None | Some(ScheduleKind::Gpipe | ScheduleKind::OneFOneB)) {
        base.schedule = None;
    }
    // FSDP2's CPU offload (`enable_cpu_offload`) moves parameters, gradients and optimizer
    // state of every unit: offload=all, every chunk, under full sharding.
    if cfg.offload.is_some_and(|o| o.moves_state()) {
        let on_host =
            base.clone().with_zero(3).with_offload(Some(Offload::all_chunks(OffloadKind::All)));
        return vec![on_host, base.with_zero(3).with_offload(None)];
    }
    let zeros: &[u8] = match cfg.zero {
        0 => &[0],
        3 => &[3],
        _ => &[3, 0],
    };
    // Hybrid sharding is HSDP under FSDP2; DDP (ZeRO-0) has nothing to shard.
    let shard = |zero: u8| if zero == 3 { cfg.shard } else { None };
    zeros.iter().map(|&zero| base.clone().with_zero(zero).with_shard(shard(zero))).collect()
}

/// Why torchtitan cannot train the model at all (`None`: it can).
pub(super) fn model_problem(model: &ModelShape) -> Option<String> {
    (model.family != Family::Llama)
        .then(|| format!("torchtitan trains LLaMA-family models; {} is not one", model.name))
}

/// Why torchtitan cannot run the plan as it is (`None`: it can).
pub(super) fn problem(cfg: &ParallelConfig, ckpt: CkptPattern, blocks: usize) -> Option<String> {
    if let Some(o) = cfg.offload.filter(|o| o.act) {
        return Some(format!(
            "`{o}`: activation offload (full blocks' kept inputs in host memory): torchtitan has no setting that keeps checkpointed blocks' inputs in host memory; plan without offload=act"
        ));
    }
    if let Some(o) = cfg.offload {
        let every = Offload::all_chunks(OffloadKind::All);
        if o != every || cfg.zero != 3 {
            return Some(format!(
                "`{o}`{}: torchtitan's enable_cpu_offload (FSDP2's CPU offload) moves the \
                 parameters, gradients and optimizer state of every fully sharded unit to host \
                 memory, which is `zero3 {every}` (all {CHUNKS} chunks, no NVMe)",
                if cfg.zero != 3 { format!(" with ZeRO-{}", cfg.zero) } else { String::new() }
            ));
        }
    }
    if matches!(cfg.zero, 1 | 2) {
        return Some(format!(
            "ZeRO-{}: torchtitan replicates (DDP, ZeRO-0) or fully shards (FSDP2, ZeRO-3)",
            cfg.zero
        ));
    }
    if cfg.tp > 1 && !cfg.sp {
        return Some(
            "torchtitan's tensor parallelism always shards the norms' sequence (add `sp`)".into(),
        );
    }
    if let Some(s) =
        cfg.schedule.filter(|s| !matches!(s, ScheduleKind::Gpipe | ScheduleKind::OneFOneB))
    {
        return Some(format!("the {s} schedule has no torchtitan equivalent here (GPipe, 1F1B)"));
    }
    if !cfg.stages.is_empty() {
        return Some("stages of their own sizes: this export splits layers evenly".into());
    }
    match ckpt {
        CkptPattern::None | CkptPattern::Full | CkptPattern::FullEvery(_) => None,
        CkptPattern::Selective => Some(
            "Tessera's selective checkpointing is not torchtitan's op-level policy (which keeps \
             every other matmul output)"
                .into(),
        ),
        other => Some(format!(
            "{} has no torchtitan activation-checkpoint option",
            other.describe(blocks)
        )),
    }
}

/// torchtitan's flavor for a Tessera preset, if it has one.
fn flavor(name: &str) -> Option<&'static str> {
    match name {
        "llama3-8b" => Some("8B"),
        "llama3-70b" => Some("70B"),
        "llama3-405b" => Some("405B"),
        _ => None,
    }
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
    if plan.dtype == "f16" {
        return Err("torchtitan trains in bf16 or fp32, not fp16".into());
    }
    let m = &target.model;
    let devices = target.nodes * target.gpus_per_node;
    let rendezvous = match target.nodes {
        1 => String::new(),
        _ => " --rdzv-backend c10d --rdzv-endpoint <node 0>:29500".into(),
    };
    let launch = format!(
        "torchrun --nnodes {} --nproc-per-node {}{rendezvous} -m torchtitan.train \
         --job.config_file FILE",
        target.nodes, target.gpus_per_node
    );
    let mut t = format!("# {}\n# launch: {launch}\n", summary(plan, cfg));
    let flavor = match flavor(&m.name) {
        Some(f) => f.to_string(),
        None => {
            t += &format!(
                "# torchtitan has no flavor for {}: register one in torchtitan/models/llama3 \
                 with dim {}, n_layers {}, n_heads {}, n_kv_heads {}, vocab_size {}, \
                 rope_theta {}, norm_eps {}, and an FFN of {}\n",
                m.name,
                m.hidden,
                m.layers,
                m.heads,
                m.kv_heads,
                m.vocab,
                m.rope_theta.unwrap_or(10000.0),
                m.norm_eps,
                m.ffn_hidden
            );
            m.name.clone()
        }
    };
    t += &format!(
        "\n[job]\ndescription = \"{} on {} devices (exported by Tessera)\"\n",
        m.name, devices
    );
    t += &format!("\n[model]\nname = \"llama3\"\nflavor = \"{flavor}\"\n");
    // Gradient accumulation is global / (local × data-parallel degree); a pipeline splits
    // its local batch into micro-batches of its own.
    let local = if cfg.pp > 1 { plan.batch / cfg.dp.max(1) } else { micro_batch_size(plan, cfg) };
    t += &format!(
        "\n[training]\nlocal_batch_size = {local}\nglobal_batch_size = {}\nseq_len = {}\n",
        plan.batch, plan.seq
    );
    if let Some(clip) = target.max_grad_norm {
        t += &format!("max_norm = {clip:?}\n");
    }
    if cfg.offload.is_some() {
        // `problem` admitted only offload=all of every chunk under FSDP.
        t += "enable_cpu_offload = true\n";
    }
    t += &format!(
        "mixed_precision_param = \"{}\"\n",
        if plan.dtype == "f32" { "float32" } else { "bfloat16" }
    );
    // FSDP2 over every data-parallel rank, or HSDP: shards within groups of `shard=N`,
    // replicated across them.
    // Expert parallelism borrows its ranks from the data-parallel ones (dp × ep of them).
    let dp = cfg.dp * cfg.ep;
    let (replicate, shard) = match cfg.zero {
        3 => (cfg.replicas(), dp / cfg.replicas()),
        _ => (dp, 1),
    };
    t += &format!(
        "\n[parallelism]\ndata_parallel_replicate_degree = {replicate}\n\
         data_parallel_shard_degree = {shard}\ntensor_parallel_degree = {}\n\
         pipeline_parallel_degree = {}\n",
        cfg.tp, cfg.pp
    );
    if let Some(line) = crate::expert::torchtitan_degree(cfg.ep) {
        t += &line;
        t.push('\n');
    }
    if cfg.cp > 1 {
        // torchtitan's context parallelism is ring attention (`cp=ring`; the others are
        // refused by `context::refuse_export`).
        t += &format!("context_parallel_degree = {}\n", cfg.cp);
    }
    if cfg.pp > 1 {
        let schedule = match cfg.schedule {
            Some(ScheduleKind::Gpipe) => "GPipe",
            _ => "1F1B",
        };
        t += &format!(
            "pipeline_parallel_schedule = \"{schedule}\"\npipeline_parallel_microbatch_size = {}\n",
            micro_batch_size(plan, cfg)
        );
    }
    let (mode, option) = match ckpt {
        CkptPattern::Full => ("full", None),
        CkptPattern::FullEvery(n) => ("selective", Some(n.to_string())),
        _ => ("none", None),
    };
    t += &format!("\n[activation_checkpoint]\nmode = \"{mode}\"\n");
    if let Some(n) = option {
        t += &format!("selective_ac_option = \"{n}\"\n");
    }
    Ok(Export { framework: Framework::Torchtitan, text: t, launch })
}
