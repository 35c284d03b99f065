//! Tessera's intermediate representation: everything about a training step that can be known
//! without a tensor.
//!
//! - [`DType`], [`Shape`], [`TensorMeta`]: what each value is.
//! - [`Op`]: the closed primitive op set; each family's shape inference, FLOPs and VJP live
//!   together in `ops/`.
//! - [`Graph`] + [`Builder`]: models are written against the builder; nodes carry scope paths
//!   (Hugging Face names), repeated-block indices and phases.
//! - [`autodiff`]: forward graph + loss → [`TrainingGraph`] (backward + AdamW).
//! - [`remat`]: activation checkpointing as a rewrite of the training graph (recompute nodes).
//! - [`Program`]: the training graph lowered to ordered instructions with explicit frees —
//!   what the profiler simulates and the runtime executes.
//! - [`Tier`]: the memory tier a node runs on and its buffers live in (device, host, NVMe);
//!   [`Op::Transfer`] moves a value between tiers.
//! - [`dist`]: the distributed-tensor vocabulary (mesh positions, placements, shard math,
//!   leaf names) that the planner and the runtime share.
//! - [`moe`]: mixture-of-experts graphs (routers, routed experts, balancing) on the routing
//!   ops of [`ops::moe`].
//! - [`interp`]: a plain-loop f64 reference interpreter, the oracle for tests.

pub mod autodiff;
mod builder;
pub mod dist;
mod dtype;
mod error;
mod graph;
pub mod interp;
pub mod moe;
pub mod ops;
mod program;
pub mod remat;
pub mod rng;
mod shape;
mod tier;

pub use autodiff::{
    build_training_graph, build_training_graph_with, gradients, LeafLayout, ParamSlot,
    SingleDevice, TrainConfig, TrainingGraph, UpdateHooks,
};
pub use builder::Builder;
pub use dtype::DType;
pub use error::{IrError, Result};
pub use graph::{Graph, Node, NodeId, Phase, ScopeId, Tensor, TensorId, TensorIds};
pub use ops::{
    AdamWSpec, Alibi, AttentionSpec, BinaryOp, Collective, CommStep, Conv2dSpec, Flops, Op, P2p,
    Pool2dSpec, QuantSpec, ReduceOp, ReshardSpec, RingBackward, RingBlock, RingMerge, StateKind,
    UnaryOp, ATTENTION_SCRATCH_ROWS,
};
pub use program::{Instr, Program, Role};
pub use remat::{rematerialize, Checkpointing, CkptMode};
pub use shape::{Shape, TensorMeta};
pub use tier::Tier;
