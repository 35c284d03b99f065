//! The communication layer's one error type. Every message names the rank that saw the problem,
//! the collective, the group of ranks, and what to look at, so that a failed SPMD step can be
//! diagnosed from any one rank's error alone.

use std::fmt;
use std::time::Duration;

use crate::stats::CollectiveKind;

/// How a rank left the world (recorded when its communicator is dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Departure {
    /// Its communicator was dropped while its thread was unwinding from a panic.
    Panicked,
    /// Its communicator was dropped normally: the rank returned (early, or after an error).
    Dropped,
}

impl fmt::Display for Departure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Departure::Panicked => "its thread panicked",
            Departure::Dropped => {
                "its communicator was dropped: the rank returned or stopped early"
            }
        })
    }
}

/// Everything that can go wrong in a collective or a point-to-point transfer.
///
/// After any error other than [`CommError::InvalidGroup`] / [`CommError::InvalidArgument`] the
/// ranks' call sequences are out of step; the SPMD program should stop (return the error), which
/// drops its communicator and lets the other ranks fail promptly with [`CommError::RankDied`].
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// Some members did not arrive within the timeout.
    #[error(
        "rank {rank}: {op} timed out after {timeout:?} waiting for ranks {missing:?}; a rank \
         died, is stuck, or called a different collective: {detail}",
        op = describe_op(*kind, group)
    )]
    Timeout {
        rank: usize,
        kind: CollectiveKind,
        /// The group's ranks (for send/recv: the peer).
        group: Vec<usize>,
        timeout: Duration,
        /// Members that had not arrived when the wait gave up (empty only where every member
        /// had arrived but the exchange itself did not finish: the data phase of an MPI call).
        missing: Vec<usize>,
        /// What each missing rank was doing at that moment (blocked in which call, or not).
        detail: String,
    },
    /// A rank this call needs has left the world (its thread panicked or returned).
    #[error(
        "rank {rank}: {op} failed: rank {dead} is gone ({how}), so the call can never complete",
        op = describe_op(*kind, group)
    )]
    RankDied {
        rank: usize,
        kind: CollectiveKind,
        /// The group's ranks (for send/recv: the peer).
        group: Vec<usize>,
        dead: usize,
        how: Departure,
    },
    /// Members called different collectives (or the same one with inconsistent sizes or roots)
    /// as the same call of a group.
    #[error(
        "rank {rank}: {op} (call #{seq} in this group) does not match the other members: \
         {detail}; every member must call the same collectives in the same order with the same \
         sizes",
        op = describe_op(*kind, group)
    )]
    Mismatch {
        rank: usize,
        kind: CollectiveKind,
        group: Vec<usize>,
        /// The call's index among this group's calls (0-based).
        seq: u64,
        /// Both sides: which rank called what.
        detail: String,
    },
    /// A group that is empty, does not contain the caller, or names ranks outside the world.
    #[error("invalid group: {0}")]
    InvalidGroup(String),
    /// Any other bad argument: a size that does not divide, a root outside the group, a peer
    /// outside the world, a mesh axis out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The shared state's lock was poisoned by a thread that panicked while holding it.
    #[error(
        "rank {rank}: the shared communicator state is poisoned (a thread panicked while holding \
         its lock); the world cannot be used any more"
    )]
    Poisoned { rank: usize },
    /// The rank's own thread panicked (reported by [`crate::run_on_threads`]).
    #[error("rank {rank}: its thread panicked: {message}")]
    Panicked { rank: usize, message: String },
    /// The rank's thread could not be started (reported by [`crate::run_on_threads`]).
    #[error("rank {rank}: could not start its thread: {message}")]
    Spawn { rank: usize, message: String },
    /// The library under a transport failed (NCCL, CUDA): the message names the rank, the
    /// call and the library's own error.
    #[error("transport failure: {0}")]
    Transport(String),
    /// A broken invariant of this crate (a bug here, not in the caller).
    #[error("internal error in tessera-comm: {0}")]
    Internal(String),
}

/// `Result` with [`CommError`].
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// "all_reduce over ranks [0, 1]", "send to rank 3", "recv from rank 2".
pub fn describe_op(kind: CollectiveKind, group: &[usize]) -> String {
    let peer = || group.first().map_or_else(|| "?".to_string(), |r| r.to_string());
    match kind {
        CollectiveKind::Send => format!("send to rank {}", peer()),
        CollectiveKind::Recv => format!("recv from rank {}", peer()),
        _ => format!("{kind} over ranks {group:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_message_names_rank_kind_group_and_missing() {
        let e = CommError::Timeout {
            rank: 2,
            kind: CollectiveKind::AllReduce,
            group: vec![0, 1, 2, 3],
            timeout: Duration::from_secs(5),
            missing: vec![3],
            detail: "rank 3 is in no call (still computing, or stuck)".into(),
        };
        let msg = e.to_string();
        assert!(
            msg.starts_with("rank 2: all_reduce over ranks [0, 1, 2, 3] timed out after 5s"),
            "{msg}"
        );
        assert!(msg.contains("waiting for ranks [3]"), "{msg}");
        assert!(msg.ends_with("collective: rank 3 is in no call (still computing, or stuck)"));
    }

    #[test]
    fn point_to_point_ops_name_the_peer() {
        assert_eq!(describe_op(CollectiveKind::Recv, &[4]), "recv from rank 4");
        assert_eq!(describe_op(CollectiveKind::Send, &[1]), "send to rank 1");
    }
}
