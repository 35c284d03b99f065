//! The thread backend: N simulated devices in one process, one thread per rank.
//!
//! # Rendezvous
//!
//! All ranks share one `Shared` (a `Mutex<State>` and one `Condvar`). Each communicator keeps,
//! per group, the number of calls it has made on that group; the n-th call of every member of a
//! group meets in the same *slot*, keyed by (group, n). A member deposits its input in the slot
//! (an `Arc<[f32]>`, so nothing is copied under the lock), wakes everyone, and waits until all
//! members have deposited. Each member then computes its own result from the shared inputs
//! outside the lock; sums run in group order, so every member gets the same bits whatever the
//! arrival order. The last member to pick up the inputs removes the slot.
//!
//! The first member to reach a slot records the call's signature (kind, length, root); a later
//! member whose signature differs marks the slot failed, so every member of that call fails
//! with a [`CommError::Mismatch`] naming both sides instead of hanging or mixing up data.
//!
//! # Failure detection
//!
//! Every wait is bounded by the world's timeout. Dropping a communicator (the rank returned, or
//! its thread is unwinding from a panic) marks the rank departed and wakes every waiter; a wait
//! that still needs input from a departed rank fails at once with [`CommError::RankDied`].
//! Inputs a rank deposited before leaving stay valid, so a rank that finished normally never
//! fails its peers. Each rank also records which call it is blocked in, so a timeout can say
//! what the missing ranks were doing.
//!
//! One mutex for the whole world is deliberate: it guards only bookkeeping (the data moves
//! outside it), and a single condvar makes "wake every waiter when a rank dies" trivial.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::communicator::Communicator;
use crate::error::{describe_op, CommError, Departure, Result};
use crate::group::Group;
use crate::stats::{f32_bytes, CollectiveKind, CommStats};

/// State shared by every rank of one world.
struct Shared {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    /// Notified on every deposit, message, slot failure and departure.
    changed: Condvar,
}

struct State {
    /// Per rank: `Some` once its communicator has been dropped.
    departed: Vec<Option<Departure>>,
    /// Per rank: the call it is blocked in, for timeout diagnostics.
    blocked_in: Vec<Option<Activity>>,
    /// Open collective calls, per group then per call number.
    slots: HashMap<Group, HashMap<u64, Slot>>,
    /// Point-to-point messages, per (from, to), oldest first.
    mailboxes: HashMap<(usize, usize), VecDeque<Vec<f32>>>,
}

#[derive(Clone)]
enum Activity {
    Collective { kind: CollectiveKind, group: Group, seq: u64 },
    Recv { from: usize },
}

/// What a member asked for in one call; members of one call must agree on it.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Signature {
    kind: CollectiveKind,
    /// Input length, where all members must agree on it (not broadcast or barrier).
    len: Option<usize>,
    /// Root rank (broadcast only).
    root: Option<usize>,
}

impl Signature {
    fn describe(&self) -> String {
        match (self.kind, self.len, self.root) {
            (kind, _, Some(root)) => format!("{kind} from root {root}"),
            (kind, Some(len), None) => format!("{kind} with {len} elements"),
            (kind, None, None) => kind.to_string(),
        }
    }
}

/// One collective call of one group: the members' inputs, by member index.
struct Slot {
    first_rank: usize,
    first: Signature,
    parts: Vec<Option<Arc<[f32]>>>,
    arrived: usize,
    taken: usize,
    /// Set when members disagreed: the description of both sides.
    failed: Option<String>,
}

/// What a waiting member should do next.
enum Step {
    Done(Vec<Arc<[f32]>>),
    Fail(CommError),
    Wait { missing: Vec<usize> },
}

impl State {
    /// Checks the slot of call `seq` of `group` on behalf of member `me`; takes the inputs
    /// when everyone is in.
    fn poll_slot(&mut self, group: &Group, seq: u64, me: usize, kind: CollectiveKind) -> Step {
        let Some(slots) = self.slots.get_mut(group) else {
            return Step::Fail(vanished(group, seq));
        };
        let Some(slot) = slots.get_mut(&seq) else {
            return Step::Fail(vanished(group, seq));
        };
        if let Some(detail) = &slot.failed {
            return Step::Fail(CommError::Mismatch {
                rank: me,
                kind,
                group: group.ranks().to_vec(),
                seq,
                detail: detail.clone(),
            });
        }
        if slot.arrived == slot.parts.len() {
            let Some(parts) = slot.parts.iter().cloned().collect::<Option<Vec<_>>>() else {
                return Step::Fail(CommError::Internal(format!(
                    "slot {seq} of group {group} counts every member but lacks an input"
                )));
            };
            slot.taken += 1;
            if slot.taken == slot.parts.len() {
                slots.remove(&seq);
                if slots.is_empty() {
                    self.slots.remove(group);
                }
            }
            return Step::Done(parts);
        }
        let missing: Vec<usize> = group
            .ranks()
            .iter()
            .zip(&slot.parts)
            .filter(|(_, p)| p.is_none())
            .map(|(&r, _)| r)
            .collect();
        // Only a departed rank whose input is still missing matters: what it deposited before
        // leaving is as good as if it were still here.
        if let Some((dead, how)) = missing.iter().find_map(|&r| self.departed[r].map(|h| (r, h))) {
            return Step::Fail(CommError::RankDied {
                rank: me,
                kind,
                group: group.ranks().to_vec(),
                dead,
                how,
            });
        }
        Step::Wait { missing }
    }

    /// "rank 3 is blocked in barrier over ranks [0, 1, 2, 3], its call #2 there" for each.
    fn describe_missing(&self, missing: &[usize]) -> String {
        let each = missing.iter().map(|&r| match (&self.departed[r], &self.blocked_in[r]) {
            (Some(how), _) => format!("rank {r} is gone: {how}"),
            (None, Some(Activity::Collective { kind, group, seq })) => format!(
                "rank {r} is blocked in {}, its call #{seq} there",
                describe_op(*kind, group.ranks())
            ),
            (None, Some(Activity::Recv { from })) => {
                format!("rank {r} is blocked in recv from rank {from}")
            }
            (None, None) => {
                format!("rank {r} is in no call (still computing, or stuck)")
            }
        });
        each.collect::<Vec<_>>().join("; ")
    }
}

fn vanished(group: &Group, seq: u64) -> CommError {
    CommError::Internal(format!("slot {seq} of group {group} vanished while a member waited"))
}

/// One rank's communicator in a thread world. Dropping it tells the other ranks this rank is
/// gone, so their waits on it fail promptly.
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    /// Per group: how many calls this rank has made on it (the next call's slot number).
    seqs: HashMap<Group, u64>,
    stats: CommStats,
}

impl std::fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadComm")
            .field("rank", &self.rank)
            .field("world_size", &self.shared.world_size)
            .field("timeout", &self.shared.timeout)
            .finish_non_exhaustive()
    }
}

impl ThreadComm {
    /// A world of `n` ranks whose every wait gives up after `timeout`: one communicator per
    /// rank, index = rank. Move each to its own thread. Fails if `n == 0`.
    pub fn world(n: usize, timeout: Duration) -> Result<Vec<ThreadComm>> {
        if n == 0 {
            return Err(CommError::InvalidArgument("a world needs at least one rank".into()));
        }
        let shared = Arc::new(Shared {
            world_size: n,
            timeout,
            state: Mutex::new(State {
                departed: vec![None; n],
                blocked_in: vec![None; n],
                slots: HashMap::new(),
                mailboxes: HashMap::new(),
            }),
            changed: Condvar::new(),
        });
        Ok((0..n)
            .map(|rank| ThreadComm {
                rank,
                shared: Arc::clone(&shared),
                seqs: HashMap::new(),
                stats: CommStats::default(),
            })
            .collect())
    }

    /// How long any one wait may take before it fails.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.shared.state.lock().map_err(|_| CommError::Poisoned { rank: self.rank })
    }

    /// Sleeps until something changes or `deadline` passes; `false` if the deadline had passed.
    fn wait<'a>(
        &'a self,
        guard: MutexGuard<'a, State>,
        deadline: Option<Instant>,
    ) -> Result<(MutexGuard<'a, State>, bool)> {
        let rank = self.rank;
        match deadline {
            // A timeout too large to add to `now` means "no timeout".
            None => Ok((
                self.shared.changed.wait(guard).map_err(|_| CommError::Poisoned { rank })?,
                true,
            )),
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    return Ok((guard, false));
                }
                let (g, _) = self
                    .shared
                    .changed
                    .wait_timeout(guard, d - now)
                    .map_err(|_| CommError::Poisoned { rank })?;
                Ok((g, true))
            }
        }
    }

    /// The member index of the caller in `group`, after checking the group fits the world.
    fn member_index(&self, kind: CollectiveKind, group: &Group) -> Result<usize> {
        let n = self.shared.world_size;
        if let Some(&bad) = group.ranks().iter().find(|&&r| r >= n) {
            return Err(CommError::InvalidGroup(format!(
                "rank {}: {} names rank {bad}, outside a world of {n} ranks",
                self.rank,
                describe_op(kind, group.ranks())
            )));
        }
        group.index_of(self.rank).ok_or_else(|| {
            CommError::InvalidGroup(format!(
                "rank {}: {} does not include the calling rank",
                self.rank,
                describe_op(kind, group.ranks())
            ))
        })
    }

    /// Checks `data.len()` splits into one equal chunk per member; returns the chunk length.
    fn chunk_len(&self, kind: CollectiveKind, group: &Group, len: usize) -> Result<usize> {
        if !len.is_multiple_of(group.len()) {
            return Err(CommError::InvalidArgument(format!(
                "rank {}: {} needs an input length divisible by the group size {}, got {len}",
                self.rank,
                describe_op(kind, group.ranks()),
                group.len()
            )));
        }
        Ok(len / group.len())
    }

    fn check_peer(&self, kind: CollectiveKind, peer: usize) -> Result<()> {
        if peer >= self.shared.world_size {
            return Err(CommError::InvalidArgument(format!(
                "rank {}: {} is outside a world of {} ranks",
                self.rank,
                describe_op(kind, &[peer]),
                self.shared.world_size
            )));
        }
        Ok(())
    }

    /// Deposits `part` as member `idx` of the next call on `group` and waits for every
    /// member's input; returns all inputs in group order.
    fn rendezvous(
        &mut self,
        group: &Group,
        idx: usize,
        sig: Signature,
        part: Arc<[f32]>,
    ) -> Result<Vec<Arc<[f32]>>> {
        let me = self.rank;
        let kind = sig.kind;
        let seq = {
            let next = self.seqs.entry(group.clone()).or_insert(0);
            let seq = *next;
            *next += 1;
            seq
        };
        let deadline = Instant::now().checked_add(self.shared.timeout);
        let mut st = self.lock()?;
        {
            let slot =
                st.slots.entry(group.clone()).or_default().entry(seq).or_insert_with(|| Slot {
                    first_rank: me,
                    first: sig,
                    parts: vec![None; group.len()],
                    arrived: 0,
                    taken: 0,
                    failed: None,
                });
            let mismatch = |detail: String| CommError::Mismatch {
                rank: me,
                kind,
                group: group.ranks().to_vec(),
                seq,
                detail,
            };
            if let Some(detail) = &slot.failed {
                return Err(mismatch(detail.clone()));
            }
            if slot.first != sig {
                let detail = format!(
                    "rank {} called {} but rank {me} called {}",
                    slot.first_rank,
                    slot.first.describe(),
                    sig.describe()
                );
                // Fail the slot so the members already waiting in it fail too, now.
                slot.failed = Some(detail.clone());
                self.shared.changed.notify_all();
                return Err(mismatch(detail));
            }
            slot.parts[idx] = Some(part);
            slot.arrived += 1;
        }
        self.shared.changed.notify_all();
        st.blocked_in[me] = Some(Activity::Collective { kind, group: group.clone(), seq });
        loop {
            let missing = match st.poll_slot(group, seq, me, kind) {
                Step::Done(parts) => {
                    st.blocked_in[me] = None;
                    return Ok(parts);
                }
                Step::Fail(e) => {
                    st.blocked_in[me] = None;
                    return Err(e);
                }
                Step::Wait { missing } => missing,
            };
            let (guard, in_time) = self.wait(st, deadline)?;
            st = guard;
            if !in_time {
                st.blocked_in[me] = None;
                return Err(CommError::Timeout {
                    rank: me,
                    kind,
                    group: group.ranks().to_vec(),
                    timeout: self.shared.timeout,
                    detail: st.describe_missing(&missing),
                    missing,
                });
            }
        }
    }
}

/// Element-wise sum of `parts[..][range]`, in part order (so every caller gets the same bits).
fn sum_in_order(parts: &[Arc<[f32]>], range: std::ops::Range<usize>) -> Vec<f32> {
    let mut iter = parts.iter();
    let mut out = iter.next().map(|p| p[range.clone()].to_vec()).unwrap_or_default();
    for p in iter {
        for (o, x) in out.iter_mut().zip(&p[range.clone()]) {
            *o += *x;
        }
    }
    out
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce_sum(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        let kind = CollectiveKind::AllReduce;
        let idx = self.member_index(kind, group)?;
        let sig = Signature { kind, len: Some(data.len()), root: None };
        let parts = self.rendezvous(group, idx, sig, data.into())?;
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(sum_in_order(&parts, 0..data.len()))
    }

    fn all_gather(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        let kind = CollectiveKind::AllGather;
        let idx = self.member_index(kind, group)?;
        let sig = Signature { kind, len: Some(data.len()), root: None };
        let parts = self.rendezvous(group, idx, sig, data.into())?;
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(parts.concat())
    }

    fn reduce_scatter_sum(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        let kind = CollectiveKind::ReduceScatter;
        let idx = self.member_index(kind, group)?;
        let chunk = self.chunk_len(kind, group, data.len())?;
        let sig = Signature { kind, len: Some(data.len()), root: None };
        let parts = self.rendezvous(group, idx, sig, data.into())?;
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(sum_in_order(&parts, idx * chunk..(idx + 1) * chunk))
    }

    fn all_to_all(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        let kind = CollectiveKind::AllToAll;
        let idx = self.member_index(kind, group)?;
        let chunk = self.chunk_len(kind, group, data.len())?;
        let sig = Signature { kind, len: Some(data.len()), root: None };
        let parts = self.rendezvous(group, idx, sig, data.into())?;
        self.stats.record(kind, f32_bytes(data.len()));
        let mut out = Vec::with_capacity(data.len());
        for p in &parts {
            out.extend_from_slice(&p[idx * chunk..(idx + 1) * chunk]);
        }
        Ok(out)
    }

    fn broadcast(&mut self, group: &Group, root: usize, data: &[f32]) -> Result<Vec<f32>> {
        let kind = CollectiveKind::Broadcast;
        let idx = self.member_index(kind, group)?;
        let root_idx = group.index_of(root).ok_or_else(|| {
            CommError::InvalidArgument(format!(
                "rank {}: {} has root {root}, which is not a member",
                self.rank,
                describe_op(kind, group.ranks())
            ))
        })?;
        // Only the root's input travels; the others' is ignored (not even copied).
        let part: Arc<[f32]> = if idx == root_idx { data.into() } else { Arc::from([]) };
        let sig = Signature { kind, len: None, root: Some(root) };
        let parts = self.rendezvous(group, idx, sig, part)?;
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(parts[root_idx].to_vec())
    }

    fn send(&mut self, to: usize, data: &[f32]) -> Result<()> {
        let kind = CollectiveKind::Send;
        self.check_peer(kind, to)?;
        let mut st = self.lock()?;
        // A message to a departed rank could never be received: say so now, not never.
        if let Some(how) = st.departed[to] {
            return Err(CommError::RankDied {
                rank: self.rank,
                kind,
                group: vec![to],
                dead: to,
                how,
            });
        }
        st.mailboxes.entry((self.rank, to)).or_default().push_back(data.to_vec());
        drop(st);
        self.shared.changed.notify_all();
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(())
    }

    fn recv(&mut self, from: usize) -> Result<Vec<f32>> {
        let kind = CollectiveKind::Recv;
        let me = self.rank;
        self.check_peer(kind, from)?;
        let deadline = Instant::now().checked_add(self.shared.timeout);
        let mut st = self.lock()?;
        st.blocked_in[me] = Some(Activity::Recv { from });
        let outcome = loop {
            if let Some(msg) = st.mailboxes.get_mut(&(from, me)).and_then(|q| q.pop_front()) {
                break Ok(msg);
            }
            if from == me {
                break Err(CommError::InvalidArgument(format!(
                    "rank {me}: recv from itself with no message queued would wait forever"
                )));
            }
            // Messages sent before the sender left were delivered above; none can come now.
            if let Some(how) = st.departed[from] {
                break Err(CommError::RankDied {
                    rank: me,
                    kind,
                    group: vec![from],
                    dead: from,
                    how,
                });
            }
            let (guard, in_time) = self.wait(st, deadline)?;
            st = guard;
            if !in_time {
                break Err(CommError::Timeout {
                    rank: me,
                    kind,
                    group: vec![from],
                    timeout: self.shared.timeout,
                    missing: vec![from],
                    detail: st.describe_missing(&[from]),
                });
            }
        };
        st.blocked_in[me] = None;
        drop(st);
        let msg = outcome?;
        self.stats.record(kind, f32_bytes(msg.len()));
        Ok(msg)
    }

    fn barrier(&mut self, group: &Group) -> Result<()> {
        let kind = CollectiveKind::Barrier;
        let idx = self.member_index(kind, group)?;
        let sig = Signature { kind, len: None, root: None };
        self.rendezvous(group, idx, sig, Arc::from([]))?;
        self.stats.record(kind, 0);
        Ok(())
    }

    fn stats(&self) -> CommStats {
        self.stats.clone()
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        let how = if std::thread::panicking() { Departure::Panicked } else { Departure::Dropped };
        // Even a poisoned lock must record the departure: the flag is all the others need to
        // stop waiting, and setting it cannot break any invariant.
        let mut st = self.shared.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        st.departed[self.rank] = Some(how);
        st.blocked_in[self.rank] = None;
        // Nobody can receive these any more; free them.
        let me = self.rank;
        st.mailboxes.retain(|&(_, to), _| to != me);
        drop(st);
        self.shared.changed.notify_all();
    }
}

/// Runs `f` on `n` scoped threads (named `rank-<r>`), one per rank of a fresh thread world
/// whose waits time out after `timeout`; returns each rank's result, index = rank.
///
/// A rank whose thread panics yields [`CommError::Panicked`]; its communicator is dropped while
/// unwinding, so the other ranks' calls that need it fail promptly with
/// [`CommError::RankDied`]. Returns an empty vector when `n == 0`.
pub fn run_on_threads<F, R>(n: usize, timeout: Duration, f: F) -> Vec<Result<R>>
where
    F: Fn(&mut dyn Communicator) -> Result<R> + Sync,
    R: Send,
{
    let Ok(comms) = ThreadComm::world(n, timeout) else {
        return Vec::new();
    };
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                let rank = comm.rank;
                // The closure owns `comm`, so it is dropped when the rank returns or unwinds,
                // and also if the thread cannot be spawned: the others never wait on it.
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || f(&mut comm))
                    .map_err(|e| CommError::Spawn { rank, message: e.to_string() })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, handle)| match handle {
                Ok(h) => h.join().unwrap_or_else(|payload| {
                    Err(CommError::Panicked { rank, message: panic_message(payload.as_ref()) })
                }),
                Err(e) => Err(e),
            })
            .collect()
    })
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}
