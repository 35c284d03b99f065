//! Agreement on the call, written once for the transports that exchange a signature before
//! moving data (MPI, NCCL): each member all-gathers what it is asking for ([`Signature`]), and
//! [`agree`] checks every member's against its own. Since every member sees the same
//! signatures, either all go on to the data phase or all fail with the same mismatch, naming
//! both sides, and the group stays in step either way. (The thread backend agrees by its
//! rendezvous, which sees every member's call directly.)

use crate::stats::CollectiveKind;

/// What each member asks for in one call; the members of a call must agree on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signature {
    pub kind: CollectiveKind,
    /// The call's number among this group's calls on the calling rank.
    pub seq: u64,
    /// Input length (for broadcast, only the root's matters).
    pub len: usize,
    /// Root rank (broadcast only).
    pub root: Option<usize>,
}

/// Why a group's signatures do not let the call go on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Disagreement {
    /// The gathered words are not signatures (a transport fault).
    Undecodable,
    /// A member called something else: the detail names it and both calls.
    Mismatch(String),
}

impl Signature {
    /// The words one signature takes on the wire.
    pub const WORDS: usize = 4;

    pub fn encode(&self) -> [u64; Signature::WORDS] {
        let kind = CollectiveKind::ALL.iter().position(|&k| k == self.kind).unwrap_or(usize::MAX);
        [kind as u64, self.seq, self.len as u64, self.root.map_or(u64::MAX, |r| r as u64)]
    }

    pub fn decode(words: &[u64]) -> Option<Signature> {
        let [kind, seq, len, root] = *words else { return None };
        Some(Signature {
            kind: *CollectiveKind::ALL.get(usize::try_from(kind).ok()?)?,
            seq,
            len: usize::try_from(len).ok()?,
            root: if root == u64::MAX { None } else { Some(usize::try_from(root).ok()?) },
        })
    }

    /// Whether two members' calls can be the same call.
    pub fn agrees(&self, other: &Signature) -> bool {
        let len_matters = !matches!(self.kind, CollectiveKind::Broadcast | CollectiveKind::Barrier);
        self.kind == other.kind
            && self.seq == other.seq
            && self.root == other.root
            && (!len_matters || self.len == other.len)
    }

    /// "all_reduce with 5 elements as its call #0 in this group" (the conformance suite looks
    /// for these words in a mismatch).
    pub fn describe(&self) -> String {
        let what = match (self.kind, self.root) {
            (kind, Some(root)) => format!("{kind} from root {root}"),
            (CollectiveKind::Barrier, None) => "barrier".to_string(),
            (kind, None) => format!("{kind} with {} elements", self.len),
        };
        format!("{what} as its call #{} in this group", self.seq)
    }
}

/// Every member's signature, in group order, decoded from the all-gathered `gathered` words of
/// the group `ranks`, once all agree with `mine` (the calling rank's, `rank`).
pub fn agree(
    rank: usize,
    ranks: &[usize],
    mine: &Signature,
    gathered: &[u64],
) -> Result<Vec<Signature>, Disagreement> {
    let sigs = gathered
        .chunks_exact(Signature::WORDS)
        .map(Signature::decode)
        .collect::<Option<Vec<_>>>()
        .filter(|s| s.len() == ranks.len())
        .ok_or(Disagreement::Undecodable)?;
    if let Some((&other, theirs)) = ranks.iter().zip(&sigs).find(|(_, s)| !s.agrees(mine)) {
        return Err(Disagreement::Mismatch(format!(
            "rank {other} called {} but rank {rank} called {}",
            theirs.describe(),
            mine.describe()
        )));
    }
    Ok(sigs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_round_trip_and_compare() {
        let s = Signature { kind: CollectiveKind::Broadcast, seq: 7, len: 3, root: Some(2) };
        assert_eq!(Signature::decode(&s.encode()), Some(s));
        let t = Signature { kind: CollectiveKind::AllReduce, seq: 0, len: 5, root: None };
        assert_eq!(Signature::decode(&t.encode()), Some(t));
        // A broadcast's length only matters at the root; other kinds must agree on it.
        assert!(s.agrees(&Signature { len: 0, ..s }));
        assert!(!s.agrees(&Signature { root: Some(1), ..s }));
        assert!(!t.agrees(&Signature { len: 4, ..t }));
        assert!(!t.agrees(&Signature { seq: 1, ..t }));
        assert!(!t.agrees(&Signature { kind: CollectiveKind::AllGather, ..t }));
        assert_eq!(t.describe(), "all_reduce with 5 elements as its call #0 in this group");
        assert_eq!(Signature::decode(&[99, 0, 0, 0]), None);
        assert_eq!(Signature::decode(&[0, 0, 0]), None);
    }

    #[test]
    fn agreement_names_the_first_member_that_differs() {
        let mine = Signature { kind: CollectiveKind::AllReduce, seq: 3, len: 8, root: None };
        let other = Signature { len: 6, ..mine };
        let words: Vec<u64> = [mine, other, mine].iter().flat_map(|s| s.encode()).collect();
        assert_eq!(
            agree(0, &[0, 2, 5], &mine, &words),
            Err(Disagreement::Mismatch(
                "rank 2 called all_reduce with 6 elements as its call #3 in this group but \
                 rank 0 called all_reduce with 8 elements as its call #3 in this group"
                    .into()
            ))
        );
        let same: Vec<u64> = [mine, mine].iter().flat_map(|s| s.encode()).collect();
        assert_eq!(agree(1, &[1, 4], &mine, &same), Ok(vec![mine, mine]));
        assert_eq!(agree(1, &[1, 4, 7], &mine, &same), Err(Disagreement::Undecodable));
        assert_eq!(agree(1, &[1, 4], &mine, &[u64::MAX; 8]), Err(Disagreement::Undecodable));
    }
}
