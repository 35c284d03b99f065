//! One NCCL call's bookkeeping, apart from the transport itself: the call's signature (what
//! members must agree on), what its errors name, the argument checks (tessera-comm's shared
//! checks), NCCL ids as bytes, group fingerprints and the host-side sums in group order.

use std::ffi::{c_char, CStr};
use std::fmt::Display;
use std::time::{Duration, Instant};

use cudarc::nccl::result::NcclError;
use cudarc::nccl::safe::Id;
use tessera_comm::{checks, CollectiveKind, CommError, Group, Result};

use super::NcclComm;
use crate::rendezvous::ID_BYTES;

pub(super) use tessera_comm::checks::describe_op;

pub(super) fn f32_bytes(len: usize) -> u64 {
    (len as u64).saturating_mul(4)
}

/// NCCL's name and text for an error.
pub(super) fn nccl_text(e: &NcclError) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any result code.
    let text = unsafe {
        let p = cudarc::nccl::sys::ncclGetErrorString(e.0);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    format!("{:?} ({text})", e.0)
}

pub(super) fn id_bytes(id: &Id) -> [u8; ID_BYTES] {
    let mut out = [0u8; ID_BYTES];
    for (o, &c) in out.iter_mut().zip(id.internal()) {
        *o = c as u8;
    }
    out
}

pub(super) fn id_from(bytes: &[u8]) -> Id {
    let mut internal = [0 as c_char; ID_BYTES];
    for (o, &b) in internal.iter_mut().zip(bytes) {
        *o = b as c_char;
    }
    Id::uninit(internal)
}

/// A stable fingerprint of a group's ranks (FNV-1a), sent with its id at set-up.
pub(super) fn fingerprint(group: &Group) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &r in group.ranks() {
        for b in (r as u64).to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

pub(super) use tessera_comm::agreement::Signature;

/// One call in progress: what its errors must name.
pub(super) struct Call {
    pub(super) rank: usize,
    pub(super) kind: CollectiveKind,
    /// The group (for send/recv: the peer).
    pub(super) group: Group,
    pub(super) seq: u64,
    pub(super) timeout: Duration,
    pub(super) deadline: Option<Instant>,
}

impl Call {
    pub(super) fn op(&self) -> String {
        describe_op(self.kind, self.group.ranks())
    }

    /// An NCCL or CUDA failure during the call.
    pub(super) fn failed(&self, what: &str, e: impl Display) -> CommError {
        CommError::Transport(format!(
            "rank {}: {} (call #{} in this group): NCCL transport: {what} failed: {e}",
            self.rank,
            self.op(),
            self.seq
        ))
    }

    pub(super) fn nccl(&self, what: &str, e: NcclError) -> CommError {
        self.failed(what, nccl_text(&e))
    }

    pub(super) fn mismatch(&self, detail: String) -> CommError {
        CommError::Mismatch {
            rank: self.rank,
            kind: self.kind,
            group: self.group.ranks().to_vec(),
            seq: self.seq,
            detail,
        }
    }
}

pub(super) use tessera_comm::communicator::sum_chunks;

/// Runs `ops` between `ncclGroupStart` and `ncclGroupEnd`, ending the group even if an
/// operation fails (NCCL's group depth must stay balanced).
pub(super) fn grouped(call: &Call, ops: impl FnOnce() -> Result<()>) -> Result<()> {
    cudarc::nccl::result::group_start().map_err(|e| call.nccl("ncclGroupStart", e))?;
    let inner = ops();
    let end = cudarc::nccl::result::group_end().map(drop).map_err(|e| call.nccl("ncclGroupEnd", e));
    inner.and(end)
}

/// tessera-comm's shared argument checks (the other transports' words), for this rank.
impl NcclComm {
    pub(super) fn member_index(&self, kind: CollectiveKind, group: &Group) -> Result<usize> {
        checks::member_index(self.rank, self.world_size, kind, group)
    }

    pub(super) fn chunk_len(
        &self,
        kind: CollectiveKind,
        group: &Group,
        len: usize,
    ) -> Result<usize> {
        checks::chunk_len(self.rank, kind, group, len)
    }

    pub(super) fn check_peer(&self, kind: CollectiveKind, peer: usize, tag: u32) -> Result<()> {
        checks::check_peer(self.rank, self.world_size, kind, peer)?;
        checks::check_tag(self.rank, kind, peer, tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_groups_have_distinct_fingerprints() {
        let bytes: [u8; ID_BYTES] = std::array::from_fn(|i| (i * 7 + 200) as u8);
        assert_eq!(id_bytes(&id_from(&bytes)), bytes);
        let (a, b) = (Group::new([0, 1]).unwrap(), Group::new([0, 2]).unwrap());
        assert_ne!(fingerprint(&a), fingerprint(&b));
        assert_eq!(fingerprint(&a), fingerprint(&Group::new([1, 0]).unwrap()));
        assert_eq!(describe_op(CollectiveKind::Recv, &[4]), "recv from rank 4");
    }
}
