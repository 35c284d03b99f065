//! The argument checks every transport makes before it moves anything, written once: a call
//! that fails one is a local error naming the rank, the call and the fix, and it neither
//! communicates nor counts (the conformance suite checks this on every transport). Public, so
//! transports in other crates (NCCL, in tessera-cuda) make the same checks with the same words.

pub use crate::communicator::check_tag;
pub use crate::error::describe_op;

use crate::error::{CommError, Result};
use crate::group::Group;
use crate::stats::CollectiveKind;

/// The member index of `rank` in `group`, after checking the group fits a world of `world`.
pub fn member_index(
    rank: usize,
    world: usize,
    kind: CollectiveKind,
    group: &Group,
) -> Result<usize> {
    if let Some(&bad) = group.ranks().iter().find(|&&r| r >= world) {
        return Err(CommError::InvalidGroup(format!(
            "rank {rank}: {} names rank {bad}, outside a world of {world} ranks",
            describe_op(kind, group.ranks())
        )));
    }
    group.index_of(rank).ok_or_else(|| {
        CommError::InvalidGroup(format!(
            "rank {rank}: {} does not include the calling rank",
            describe_op(kind, group.ranks())
        ))
    })
}

/// Checks `len` splits into one equal chunk per member; returns the chunk length.
pub fn chunk_len(rank: usize, kind: CollectiveKind, group: &Group, len: usize) -> Result<usize> {
    if !len.is_multiple_of(group.len()) {
        return Err(CommError::InvalidArgument(format!(
            "rank {rank}: {} needs an input length divisible by the group size {}, got {len}",
            describe_op(kind, group.ranks()),
            group.len()
        )));
    }
    Ok(len / group.len())
}

/// Checks a point-to-point peer is in the world.
pub fn check_peer(rank: usize, world: usize, kind: CollectiveKind, peer: usize) -> Result<()> {
    if peer >= world {
        return Err(CommError::InvalidArgument(format!(
            "rank {rank}: {} is outside a world of {world} ranks",
            describe_op(kind, &[peer])
        )));
    }
    Ok(())
}
