//! Tessera's runtime: executes a [`tessera_ir::Program`] on real tensors.
//!
//! The runtime decides nothing. It binds the Program's leaves (parameters, optimizer state,
//! the step's data), runs its instructions in order on a [`Backend`], frees what the Program
//! frees, and charges every allocation to a [`MemoryAccountant`] — the same allocations the
//! profiler simulated, so predicted and measured peaks agree exactly.
//!
//! - [`backend`]: the device seam ([`CpuBackend`]: candle tensors + host kernels);
//! - [`kernels`]: one module per op family, an exhaustive dispatch over `Op`;
//! - [`executor`]: the Program interpreter;
//! - [`memory`] / [`alloc`]: the accountant and a counting global allocator to check it;
//! - [`init`], [`schedule`], [`loss_scale`]: what a training run needs; [`batch`]: a step's
//!   data by input name and the data sets that make it ([`data`] token streams, [`examples`]
//!   JSONL fine-tuning examples, [`images`] labelled images);
//! - [`trainer`]: the one trainer — a device of a mesh (a single device is a 1-device mesh)
//!   running the plan's Program on its shards; [`collective`]: its shards and collectives
//!   (through a `tessera_comm::Communicator`); [`run`]: the one training loop (steps, logs,
//!   checkpoints, evaluation) that every device of every plan runs.
//! - [`checkpoint`]: Hugging Face weight import and atomic save/resume checkpoints;
//!   [`integrity`]: their checksums and the refusal of non-finite weights; [`host`]: disk
//!   room, host memory and the lock a run takes on its checkpoint directory;
//!   [`expert_layout`]: stacked expert parameters saved and loaded as the Hub's per-expert
//!   tensors.
//! - [`dist_checkpoint`]: sharded checkpoints of a parallel run (one file per rank, loaded
//!   back as global tensors under any device count) and Hugging Face export; [`state_table`]:
//!   which rank holds and writes which chunk of the run's state (stage-local under pipelines).

pub mod alloc;
pub mod backend;
pub mod batch;
pub mod checkpoint;
pub mod collective;
pub mod data;
pub mod diffusion;
pub mod diffusion_text;
pub mod dist_checkpoint;
mod error;
pub mod examples;
pub mod executor;
pub mod expert_layout;
pub mod generate;
pub mod guard;
pub mod hf_weights;
pub mod host;
pub mod images;
pub mod init;
pub mod integrity;
pub mod kernels;
pub mod loss_scale;
pub mod mapped;
pub mod memory;
pub mod nvme;
pub mod picture_folder;
pub mod quantize;
pub mod run;
pub mod sampling;
pub mod schedule;
pub mod state_table;
pub mod tensor;
pub mod trainer;

pub use backend::{Backend, CpuBackend};
pub use batch::{StepBatch, TrainData};
pub use error::{Result, RuntimeError};
pub use executor::Executor;
pub use loss_scale::{LossScaleConfig, LossScaleState};
pub use mapped::ShardSource;
pub use memory::MemoryAccountant;
pub use schedule::LrSchedule;
pub use trainer::{DeviceSetup, EvalStats, StartState, StepStats, Trainer};
