//! The [`Communicator`] trait: what one rank of an SPMD program can ask of the others.
//!
//! The trait is the seam between the runtime and a transport. The runtime only sees f32
//! slices (it converts other dtypes), so a backend moves one element type and stays small.

use crate::error::Result;
use crate::group::Group;
use crate::stats::CommStats;

/// One rank's handle on the world. Object-safe and `Send`, so the runtime can hold a
/// `Box<dyn Communicator>` and move it to the thread that drives the rank.
///
/// # Contract
///
/// - Every collective takes a [`Group`]: sorted global ranks that include the caller. Every
///   member must call the same collectives on that group in the same order, with consistent
///   sizes (same input length; for broadcast, same root). Calls on different groups are
///   independent: each group has its own sequence of calls.
/// - Results are identical, bit for bit, on every member and across runs: sums are taken in
///   group order (`member0 + member1 + ...`), whatever order the members arrive in.
/// - Inputs and outputs are contiguous f32 buffers; "chunk k" of a buffer of length `n·c` in a
///   group of `n` members is elements `k·c .. (k+1)·c`.
/// - A call that cannot complete fails within the backend's timeout, and promptly if a rank it
///   needs has gone (see [`crate::CommError`]). After such an error the call sequences are out
///   of step: stop the rank.
pub trait Communicator: Send {
    /// This rank's global index, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the world.
    fn world_size(&self) -> usize;

    /// Element-wise sum of every member's `data` (all the same length), on every member.
    fn all_reduce_sum(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>>;

    /// Every member's `data` (all the same length), concatenated in group order.
    fn all_gather(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>>;

    /// Member k gets chunk k of the element-wise sum. `data.len()` must divide by the group
    /// size and be the same on every member.
    fn reduce_scatter_sum(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>>;

    /// `data` is split into group-size equal chunks; member k receives chunk k of every member,
    /// concatenated in group order (a transpose of chunks).
    fn all_to_all(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>>;

    /// The `data` of `root` (a global rank, member of the group), on every member. Non-root
    /// inputs are ignored and may be empty.
    fn broadcast(&mut self, group: &Group, root: usize, data: &[f32]) -> Result<Vec<f32>>;

    /// Queues `data` for rank `to`; does not wait for the receiver. FIFO per (from, to) pair.
    fn send(&mut self, to: usize, data: &[f32]) -> Result<()>;

    /// The oldest message from rank `from` not yet received, waiting for one if needed.
    fn recv(&mut self, from: usize) -> Result<Vec<f32>>;

    /// Returns once every member has called it.
    fn barrier(&mut self, group: &Group) -> Result<()>;

    /// This rank's traffic so far (successful calls only).
    fn stats(&self) -> CommStats;
}
