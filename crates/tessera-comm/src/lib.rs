//! Collectives between devices (the SPMD runtime's communication layer).
//!
//! Every device (a *rank*) runs the same program and, at the points the plan says so, calls a
//! collective over a *group* of ranks — usually one axis of the device mesh (the data-parallel
//! replicas of a shard, the tensor-parallel shards of a layer). This crate provides:
//!
//! - [`Communicator`]: the object-safe trait one rank uses — all-reduce, all-gather,
//!   reduce-scatter, all-to-all, broadcast, barrier, send/recv (tagged: independent streams
//!   per pair of ranks) — on f32 buffers (the runtime converts other dtypes), plus per-kind
//!   traffic counters ([`CommStats`]).
//! - [`Group`]: sorted sets of global ranks, including the group along one or more axes of a
//!   row-major mesh ([`Group::mesh_axis`], [`Group::mesh_axes`]).
//! - [`ThreadComm`] and [`run_on_threads`]: a backend where each rank is a thread of this
//!   process, for running and testing a parallel plan on one machine.
//! - `MpiComm` (cargo feature `mpi`): a backend where each rank is a process started by
//!   `mpirun`/`srun`, over an MPI library (see the `mpi` module).
//! - [`discover`] / [`LaunchEnv`]: the rank and world size a launcher (`mpirun`, `srun`,
//!   `torchrun`) gave this process, read from its environment.
//! - [`CommError`]: timeouts, dead ranks and mismatched calls, each naming the rank, the
//!   collective, the group and the culprit.
//!
//! # Design
//!
//! - **Determinism.** Reductions sum in group order (member 0 + member 1 + ...), never in
//!   arrival order, so every member gets the same bits, run after run. A parallel run can then
//!   be compared exactly with itself and, op by op, with a single-device reference.
//! - **Sequencing per group.** Each rank numbers its calls per group; the n-th call of every
//!   member of a group meets in one place. Collectives on disjoint or overlapping groups
//!   (rows and columns of a mesh) therefore never interfere, provided each group's members
//!   agree on that group's call order — the SPMD contract.
//! - **Bounded failure.** No call blocks forever: every wait has a timeout, and a rank that
//!   leaves (returns early or panics, dropping its communicator) makes every call that still
//!   needs it fail at once. Members that disagree on a call (kind, length, root) all fail with
//!   an error naming both sides, instead of hanging or exchanging wrong data.
//!
//! See the [`thread`] module for how the rendezvous works, and the `mpi` module for how the MPI
//! backend keeps the same guarantees on top of MPI's collectives.

pub mod agreement;
pub mod checks;
pub mod communicator;
pub mod conformance;
pub mod error;
pub mod group;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod stats;
pub mod thread;

#[cfg(feature = "mpi")]
pub use crate::mpi::MpiComm;
pub use communicator::{Communicator, MAX_TAG};
pub use error::{CommError, Departure, Result};
pub use group::{mesh_coords, mesh_rank, mesh_size, Group};
pub use launch::{discover, discover_from, LaunchEnv, Launcher};
pub use stats::{CollectiveKind, CommStats, KindStats};
pub use thread::{run_on_threads, ThreadComm};
