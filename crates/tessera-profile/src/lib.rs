//! The symbolic profiler: what one training step costs, computed from the [`Program`] alone.
//!
//! - [`count_flops`]: FLOPs per phase (forward, backward, optimizer) and the matmul + attention
//!   subtotal, from each op's own count (`Op::flops`).
//! - [`simulate_memory`]: walks the Program's instructions exactly as the runtime executes
//!   them — allocate a `Run`'s fresh outputs, hold its workspace while it runs, release on
//!   `Free` — giving the peak, what is live at the peak, and a timeline.
//! - [`profile`]: both, plus the model-state totals, in one [`Profile`].
//! - [`kernels`]: a device's measured kernel speeds per op kind, the cost model's alternative
//!   to a roofline with constant efficiencies.
//!
//! Units: FLOPs as `u64` counts, memory in bytes (`u64`), time in seconds (`f64`).

mod flops;
pub mod kernels;
mod memory;

pub use flops::{count_flops, FlopReport};
pub use memory::{simulate_memory, LiveGroup, MemoryReport, MemoryTrace, TimelinePoint};

use serde::Serialize;
use tessera_ir::Program;

/// Everything the profiler knows about one training step.
#[derive(Clone, Debug, Serialize)]
pub struct Profile {
    /// Parameters, frozen ones included (tied tensors once).
    pub params: u64,
    /// The parameters that train (no frozen base): what has gradients and optimizer state.
    pub trainable_params: u64,
    pub flops: FlopReport,
    pub memory: MemoryReport,
}

/// Profiles a lowered training step.
pub fn profile(program: &Program) -> Profile {
    let flops = count_flops(program.graph());
    let trace = simulate_memory(program);
    let g = program.graph();
    Profile {
        params: g.num_parameters(),
        trainable_params: g.num_trainable_parameters(),
        flops,
        memory: trace.report,
    }
}
