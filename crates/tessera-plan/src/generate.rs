//! Generation planned like training: a prefill or decode step of a causal LM (built by
//! `tessera_models::build_generation`) lowered to the Program one device of a tensor-parallel
//! group runs, with its memory (weights, KV cache, activations) and time predicted from that
//! Program — the same Program the runtime executes, so the measured peak is the predicted one.
//!
//! The layout is Megatron-LM's ([`crate::search::tp_strategies`]): q/k/v and the MLP's first
//! projections column-parallel, attention and the KV cache split by heads, the output and
//! second projections row-parallel with an all-reduce; the logits are gathered whole on every
//! device (each samples the same token from them).

use crate::cost::CostModel;
use crate::lower::{
    leaf_layout, simulate_time, CollectiveRecord, LocalForward, LowerOptions, StepTime,
};
use crate::{Mesh, PlanError, Result, Spec};
use tessera_ir::{Checkpointing, Graph, LeafLayout, Program, TensorId, TrainConfig};
use tessera_profile::{simulate_memory, MemoryReport};

/// One lowered generation step of a device.
#[derive(Clone, Debug)]
pub struct GenerationStep {
    pub program: Program,
    /// The logits every device reads (whole), in `program`.
    pub logits: TensorId,
    pub memory: MemoryReport,
    pub time: StepTime,
    pub collectives: Vec<CollectiveRecord>,
    /// Each leaf's stored spec, by name.
    pub leaf_specs: Vec<(String, Spec)>,
    /// Placements of the sharded leaves (parameters, caches, inputs) in `program`.
    pub layout: LeafLayout,
}

/// Lowers the generation step `g` (logits `logits`) for one device of a `tp`-way tensor
/// parallel group on `mesh` (shape `[1, tp]`).
pub fn lower_step(
    g: &Graph,
    logits: TensorId,
    mesh: &Mesh,
    cost: &CostModel,
) -> Result<GenerationStep> {
    let strategies = crate::search::tp_strategies(g, mesh)?;
    let opts = LowerOptions {
        zero: 0,
        micro_batches: 1,
        train: TrainConfig::default(),
        ckpt: Checkpointing::default(),
        offload: None,
    };
    let mut lw = LocalForward::new(g, &strategies, mesh, &opts)?;
    lw.lower_nodes()?;
    let local_logits = lw.replicated(logits)?;
    let leaf_specs = lw.leaf_specs.clone();
    let graph = std::mem::take(&mut lw.b).finish();
    let layout = leaf_layout(&graph, &leaf_specs, 1);
    let program = Program::lower_graph(graph, vec![local_logits], &[]);
    if program.graph.nodes.iter().any(|n| n.op.name() == "adamw") {
        return Err(PlanError::Internal("a generation step holds an optimizer".into()));
    }
    let memory = simulate_memory(&program).report;
    let (time, collectives) = simulate_time(&program, mesh, cost);
    Ok(GenerationStep {
        program,
        logits: local_logits,
        memory,
        time,
        collectives,
        leaf_specs,
        layout,
    })
}
