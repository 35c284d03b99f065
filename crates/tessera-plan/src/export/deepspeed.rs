//! DeepSpeed: the `ds_config.json` that `deepspeed.initialize` reads — batch sizes, precision,
//! gradient clipping, the ZeRO stage and, with a pipeline, its stage count — and the
//! `deepspeed` launcher line.
//!
//! What DeepSpeed expresses from a config: data parallelism with ZeRO 0–3 over every
//! data-parallel rank (its hybrid sharding, MiCS, was removed in 0.19, so `shard=N` is
//! refused), gradient accumulation, its pipeline engine (its own 1F1B-like schedule, even
//! stages, ZeRO-0/1 only),
//! full recomputation of every block (the training script wraps each block in
//! `deepspeed.checkpointing.checkpoint`; the config's `activation_checkpointing` section
//! configures that call), and ZeRO-Offload / ZeRO-Infinity: `offload_optimizer` (optimizer
//! state and its step on the host, each gradient partition moved there as the backward
//! reduces it: Tessera's `offload=grads+opt`) with ZeRO-1 and above, `offload_param` (the
//! parameters too: `offload=all`) and the NVMe (`nvme`) with ZeRO-3 only, for every
//! parameter of a rank. Tensor and sequence parallelism are not DeepSpeed's own: export them
//! to Megatron-LM (Megatron-DeepSpeed combines the two) or torchtitan.

use super::{micro_batch_size, summary, CkptPattern, Export, Framework, Target};
use crate::config::ParallelConfig;
use crate::offload::{Offload, OffloadKind, CHUNKS};
use crate::pipeline::ScheduleKind;
use crate::plan::Plan;
use serde_json::json;

/// `cfg` mapped onto DeepSpeed: the tensor-parallel devices become data-parallel replicas; a
/// pipeline keeps ZeRO-0/1 or gives way to data parallelism.
pub(super) fn expressible(cfg: &ParallelConfig) -> Vec<ParallelConfig> {
    let flat = cfg
        .clone()
        .with_dp(cfg.dp * cfg.tp)
        .with_tp(1)
        .with_sp(false)
        .with_schedule(None)
        .with_stages(Vec::new())
        .with_offload(None)
        // ZeRO over every rank: DeepSpeed has no hybrid sharding (see `problem`).
        .with_shard(None);
    if let Some(o) = cfg.offload.filter(|o| o.moves_state()) {
        // The offload DeepSpeed has nearest to `o` (a plan with offload has no pipeline), and
        // the plan without offload.
        let kind = o.kind.max(OffloadKind::GradsOpt);
        let zero = if kind == OffloadKind::All { 3 } else { flat.zero.max(1) };
        let nvme = if o.nvme > 0 && zero == 3 { CHUNKS } else { 0 };
        let offload = Some(Offload { kind, chunks: CHUNKS, nvme, act: false });
        return vec![flat.clone().with_zero(zero).with_offload(offload), flat];
    }
    if cfg.pp == 1 {
        return vec![flat];
    }
    let mut out = vec![flat.clone().with_zero(flat.zero.min(1))];
    if flat.zero >= 2 {
        out.push(flat.clone().with_dp(flat.dp * flat.pp).with_pp(1));
    }
    out
}

/// Why DeepSpeed cannot run the plan as it is (`None`: it can).
pub(super) fn problem(cfg: &ParallelConfig, ckpt: CkptPattern, blocks: usize) -> Option<String> {
    if let Some(o) = cfg.offload.filter(|o| o.act) {
        return Some(format!(
            "`{o}`: activation offload (full blocks' kept inputs in host memory): this export does not write DeepSpeed's activation_checkpointing.cpu_checkpointing (which moves every checkpoint to the host, not only full blocks' inputs); plan without offload=act"
        ));
    }
    if cfg.tp > 1 {
        return Some(format!(
            "tensor parallelism (tp{}) is not DeepSpeed's own; export to Megatron-LM \
             (Megatron-DeepSpeed) or torchtitan, or plan without it",
            cfg.tp
        ));
    }
    if let Some(n) = cfg.shard {
        return Some(format!(
            "shard={n}: DeepSpeed partitions ZeRO state over every data-parallel rank; its \
             hybrid sharding (MiCS) was removed in 0.19 (`mics_shard_size` is refused, \
             deepspeedai/DeepSpeed#8489)"
        ));
    }
    if cfg.pp > 1 && cfg.zero >= 2 {
        return Some(format!(
            "DeepSpeed's pipeline engine refuses ZeRO-{} (ZeRO-2 and -3 shard what the pipeline \
             accumulates over micro-batches)",
            cfg.zero
        ));
    }
    if let Some(o) = cfg.offload {
        if let Some(why) = offload_problem(o, cfg) {
            return Some(format!("`{o}`: {why}"));
        }
    }
    if let Some(s) = cfg.schedule.filter(|&s| s != ScheduleKind::OneFOneB) {
        return Some(format!("DeepSpeed's pipeline engine runs its own 1F1B schedule, not {s}"));
    }
    if !cfg.stages.is_empty() {
        return Some(
            "stage sizes of their own: DeepSpeed's PipelineModule partitions layers itself".into(),
        );
    }
    match ckpt {
        CkptPattern::None | CkptPattern::Full => None,
        other => Some(format!(
            "{}: a DeepSpeed training script checkpoints every block or none",
            other.describe(blocks)
        )),
    }
}

/// Why DeepSpeed's offload settings cannot say what `o` does (`None`: they can).
fn offload_problem(o: Offload, cfg: &ParallelConfig) -> Option<String> {
    if o.chunks < CHUNKS {
        return Some(format!(
            "the plan offloads {} of the {CHUNKS} parameter chunks; DeepSpeed offloads the \
             state of every parameter of a rank (ZeRO-3's `ratio` picks its own share)",
            o.chunks
        ));
    }
    if o.kind == OffloadKind::Opt {
        return Some(
            "the plan keeps gradients on the GPU until the optimizer step; DeepSpeed's \
             offload_optimizer moves each gradient partition to the host as the backward \
             reduces it, which is offload=grads+opt"
                .into(),
        );
    }
    if o.kind == OffloadKind::All && cfg.zero < 3 {
        return Some(format!(
            "DeepSpeed offloads parameters (offload_param) under ZeRO-3 only, not ZeRO-{}",
            cfg.zero
        ));
    }
    // (Tensor parallelism is refused before: the replicas are `dp`.)
    if cfg.zero == 0 && cfg.dp > 1 {
        return Some(
            "DeepSpeed's offload_optimizer runs under ZeRO-1 and above; without ZeRO every \
             replica would hold and step the whole optimizer state on its host"
                .into(),
        );
    }
    if o.nvme > 0 && (o.nvme < o.chunks || cfg.zero < 3) {
        return Some(format!(
            "DeepSpeed puts optimizer state on the NVMe (ZeRO-Infinity) under ZeRO-3 and for \
             every parameter or none, not {} of {} offloaded chunks under ZeRO-{}",
            o.nvme.min(o.chunks),
            o.chunks,
            cfg.zero
        ));
    }
    None
}

/// The `zero_optimization` entries of an offload `problem` admitted.
fn write_offload(ds: &mut serde_json::Value, o: Offload) {
    let z = &mut ds["zero_optimization"];
    if z["stage"].as_u64() == Some(0) {
        // One data-parallel rank (`offload_problem`): ZeRO-1 partitions nothing there.
        z["stage"] = 1.into();
    }
    z["offload_optimizer"] = if o.nvme > 0 {
        json!({ "device": "nvme", "nvme_path": NVME_PATH, "pin_memory": true })
    } else {
        json!({ "device": "cpu", "pin_memory": true })
    };
    if o.kind == OffloadKind::All {
        z["offload_param"] = json!({ "device": "cpu", "pin_memory": true });
    }
}

/// Where the exported config points ZeRO-Infinity's NVMe files (the note says to change it).
const NVME_PATH: &str = "/local_nvme";

pub(super) fn export(
    plan: &Plan,
    cfg: &ParallelConfig,
    ckpt: CkptPattern,
    target: &Target,
) -> Result<Export, String> {
    if let Some(why) = problem(cfg, ckpt, plan.checkpoint.len()) {
        return Err(why);
    }
    let mut ds = cfg.deepspeed_config();
    ds["train_batch_size"] = plan.batch.into();
    ds["train_micro_batch_size_per_gpu"] = micro_batch_size(plan, cfg).into();
    match plan.dtype.as_str() {
        "bf16" => ds["bf16"] = json!({ "enabled": true }),
        "f16" => {
            ds["fp16"] = json!({ "enabled": true, "loss_scale": 0, "initial_scale_power": 16 })
        }
        _ => {}
    }
    if let Some(clip) = target.max_grad_norm {
        ds["gradient_clipping"] = clip.into();
    }
    if let Some(o) = cfg.offload {
        write_offload(&mut ds, o);
    }
    if ds["zero_optimization"]["stage"].as_u64().unwrap_or(0) >= 1 {
        ds["zero_optimization"]["overlap_comm"] = true.into();
        ds["zero_optimization"]["contiguous_gradients"] = true.into();
    }
    if ckpt == CkptPattern::Full {
        ds["activation_checkpointing"] = json!({
            "partition_activations": false,
            "cpu_checkpointing": false,
            "contiguous_memory_optimization": false,
            "synchronize_checkpoint_boundary": false,
        });
    }
    ds["steps_per_print"] = 10.into();
    // A note for readers; DeepSpeed ignores keys it does not know at the top level.
    let mut note = summary(plan, cfg);
    if ckpt == CkptPattern::Full {
        note += "; wrap each block in deepspeed.checkpointing.checkpoint";
    }
    if cfg.offload.is_some_and(|o| o.nvme > 0) {
        note += &format!("; set nvme_path ({NVME_PATH}) to a directory on the node's NVMe");
    }
    ds["comment"] = note.into();
    let text = serde_json::to_string_pretty(&ds).map_err(|e| format!("writing JSON: {e}"))? + "\n";
    Ok(Export {
        framework: Framework::DeepSpeed,
        text,
        launch: format!(
            "deepspeed --num_nodes {} --num_gpus {} <your_train.py> --deepspeed --deepspeed_config \
             FILE{}",
            target.nodes,
            target.gpus_per_node,
            if target.nodes > 1 { " --hostfile <hostfile>" } else { "" }
        ),
    })
}
