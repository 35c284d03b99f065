//! Per-rank traffic counters: calls and payload bytes per kind of collective.
//!
//! The payload of a call is the tensor this rank contributes (input length × 4 bytes for f32);
//! for `recv` it is the message received, and a barrier carries none. These are what the
//! planner's cost model predicts per device, so the runtime can compare the two.

use std::collections::BTreeMap;
use std::fmt;

/// The kinds of communication a [`crate::Communicator`] performs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CollectiveKind {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Broadcast,
    Send,
    Recv,
    Barrier,
}

impl CollectiveKind {
    /// Every kind, in declaration order.
    pub const ALL: [CollectiveKind; 8] = [
        CollectiveKind::AllReduce,
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllToAll,
        CollectiveKind::Broadcast,
        CollectiveKind::Send,
        CollectiveKind::Recv,
        CollectiveKind::Barrier,
    ];

    /// The snake_case name used in messages (`all_reduce`, `reduce_scatter`, ...).
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Send => "send",
            CollectiveKind::Recv => "recv",
            CollectiveKind::Barrier => "barrier",
        }
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Calls and payload bytes of one kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KindStats {
    pub calls: u64,
    pub bytes: u64,
}

/// One rank's traffic so far, per kind (only kinds that were called appear in the map).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommStats {
    pub per_kind: BTreeMap<CollectiveKind, KindStats>,
}

impl CommStats {
    /// Counts one successful call of `kind` carrying `bytes` of payload.
    pub fn record(&mut self, kind: CollectiveKind, bytes: u64) {
        let s = self.per_kind.entry(kind).or_default();
        s.calls = s.calls.saturating_add(1);
        s.bytes = s.bytes.saturating_add(bytes);
    }

    /// The counters of one kind (zero if never called).
    pub fn get(&self, kind: CollectiveKind) -> KindStats {
        self.per_kind.get(&kind).copied().unwrap_or_default()
    }

    /// Payload bytes over all kinds.
    pub fn total_bytes(&self) -> u64 {
        self.per_kind.values().fold(0u64, |acc, s| acc.saturating_add(s.bytes))
    }

    /// Calls over all kinds.
    pub fn total_calls(&self) -> u64 {
        self.per_kind.values().fold(0u64, |acc, s| acc.saturating_add(s.calls))
    }

    /// Adds another rank's counters into these (e.g. to total a whole world).
    pub fn merge(&mut self, other: &CommStats) {
        for (kind, s) in &other.per_kind {
            let mine = self.per_kind.entry(*kind).or_default();
            mine.calls = mine.calls.saturating_add(s.calls);
            mine.bytes = mine.bytes.saturating_add(s.bytes);
        }
    }
}

/// Payload bytes of `len` f32 elements (saturating: a count, never a panic).
pub(crate) fn f32_bytes(len: usize) -> u64 {
    (len as u64).saturating_mul(std::mem::size_of::<f32>() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_get_total_and_merge() {
        let mut a = CommStats::default();
        a.record(CollectiveKind::AllReduce, 16);
        a.record(CollectiveKind::AllReduce, 8);
        a.record(CollectiveKind::Barrier, 0);
        assert_eq!(a.get(CollectiveKind::AllReduce), KindStats { calls: 2, bytes: 24 });
        assert_eq!(a.get(CollectiveKind::Send), KindStats::default());
        assert_eq!((a.total_calls(), a.total_bytes()), (3, 24));
        let mut b = CommStats::default();
        b.record(CollectiveKind::AllReduce, 4);
        b.merge(&a);
        assert_eq!(b.get(CollectiveKind::AllReduce), KindStats { calls: 3, bytes: 28 });
        assert_eq!(b.total_bytes(), 28);
    }

    #[test]
    fn names_are_snake_case_and_distinct() {
        let names: std::collections::BTreeSet<_> =
            CollectiveKind::ALL.iter().map(|k| k.to_string()).collect();
        assert_eq!(names.len(), CollectiveKind::ALL.len());
        assert_eq!(CollectiveKind::ReduceScatter.to_string(), "reduce_scatter");
    }
}
