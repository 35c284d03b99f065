//! The thread backend: N simulated devices in one process, one thread per rank.
//!
//! # Rendezvous
//!
//! All ranks share one `Shared` (a `Mutex<State>` and one `Condvar`). Each communicator keeps,
//! per group, the number of calls it has made on that group; the n-th call of every member of a
//! group is the same call. A call moves its data in *pieces* of at most `piece` elements per
//! member (1 Mi f32, 4 MiB, by default; see [`ThreadComm::world_with_piece`]), and every piece
//! is one rendezvous in its own *slot*, keyed by (group, call number, piece number). A member
//! deposits its part of the piece in the slot (an `Arc`, so nothing is copied under the lock),
//! wakes everyone, and waits until all members have deposited. Each member then takes its share
//! of the result from the shared parts outside the lock and writes it straight into its output
//! buffer; sums run in group order, so every member gets the same bits whatever the arrival
//! order (and the same bits however the call is cut into pieces). The last member to pick up
//! a piece's parts removes its slot. Statistics count the call once, with its whole payload.
//!
//! Streaming bounds what a call holds besides the caller's input and output: a member can be
//! at most one piece ahead of the slowest (it cannot finish piece p before everyone has
//! deposited piece p), so at most about 2 × members × piece elements per group are in flight,
//! however large the tensor. All-reduce, all-gather and broadcast cut their input into
//! consecutive ranges; reduce-scatter and all-to-all cut every member's chunk at the same
//! offsets (piece / members elements of each), so every member has work in every piece. Inputs
//! and outputs whose chunks are interleaved ([`ChunkLayout`]) are read and written where they
//! lie, run by run; an in-place all-gather deposits its pieces from, and writes the others'
//! into, the caller's own buffer. A broadcast's non-roots do not know its length: the root's
//! part of the first piece tells them how many pieces follow.
//!
//! The first member to reach a slot records the call's signature (kind, length, root); a later
//! member whose signature differs marks the slot failed, so every member of that call fails
//! with a [`CommError::Mismatch`] naming both sides instead of hanging or mixing up data. Every
//! piece of a call carries the same signature, so a disagreement shows at the first piece.
//!
//! # Failure detection
//!
//! Every wait (one per piece) is bounded by the world's timeout. Dropping a communicator (the
//! rank returned, or its thread is unwinding from a panic) marks the rank departed and wakes
//! every waiter; a wait that still needs input from a departed rank fails at once with
//! [`CommError::RankDied`]. Inputs a rank deposited before leaving stay valid, and a rank
//! finishes a call only once every member has deposited every piece of it, so a rank that
//! finished normally never fails its peers. Each rank also records which call it is in, so a
//! timeout can say what the missing ranks were doing.
//!
//! One mutex for the whole world is deliberate: it guards only bookkeeping (the data moves
//! outside it), and a single condvar makes "wake every waiter when a rank dies" trivial.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::checks;
use crate::communicator::{check_layout, check_tag, ChunkLayout, Communicator};
use crate::error::{describe_op, CommError, Departure, Result};
use crate::group::Group;
use crate::stats::{f32_bytes, CollectiveKind, CommStats};

/// The default most elements one member moves per rendezvous: 1 Mi f32, 4 MiB.
pub const DEFAULT_PIECE: usize = 1 << 20;

/// State shared by every rank of one world.
struct Shared {
    world_size: usize,
    timeout: Duration,
    /// The most elements one member deposits per rendezvous (at least 1).
    piece: usize,
    state: Mutex<State>,
    /// Notified on every deposit, message, slot failure and departure.
    changed: Condvar,
}

struct State {
    /// Per rank: `Some` once its communicator has been dropped.
    departed: Vec<Option<Departure>>,
    /// Per rank: the call it is in (blocked, or between two of its pieces), for timeout
    /// diagnostics.
    blocked_in: Vec<Option<Activity>>,
    /// Open rendezvous, per group then per (call number, piece number).
    slots: HashMap<Group, HashMap<SlotKey, Slot>>,
    /// Point-to-point messages, per (from, to, tag), oldest first.
    mailboxes: HashMap<(usize, usize, u32), VecDeque<Vec<f32>>>,
}

#[derive(Clone)]
enum Activity {
    Collective { kind: CollectiveKind, group: Group, seq: u64 },
    Recv { from: usize, tag: u32 },
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

/// A slot's key within its group: (call number, piece number).
type SlotKey = (u64, usize);

/// One member's part of one piece of a call.
struct Part {
    data: Vec<f32>,
    /// The length of the depositor's whole input to the call (what a broadcast's non-roots
    /// read from the root's first part: how many pieces follow, how much to reserve).
    len: usize,
}

/// One piece of one collective call of one group: the members' parts, by member index.
struct Slot {
    first_rank: usize,
    first: Signature,
    parts: Vec<Option<Arc<Part>>>,
    arrived: usize,
    taken: usize,
    /// Set when members disagreed: the description of both sides.
    failed: Option<String>,
}

/// What a waiting member should do next.
enum Step {
    Done(Vec<Arc<Part>>),
    Fail(CommError),
    Wait { missing: Vec<usize> },
}

impl State {
    /// Checks the slot `key` of `group` on behalf of member `me`; takes the parts when
    /// everyone is in.
    fn poll_slot(&mut self, group: &Group, key: SlotKey, me: usize, kind: CollectiveKind) -> Step {
        let seq = key.0;
        let Some(slots) = self.slots.get_mut(group) else {
            return Step::Fail(vanished(group, key));
        };
        let Some(slot) = slots.get_mut(&key) else {
            return Step::Fail(vanished(group, key));
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
                    "slot {key:?} of group {group} counts every member but lacks an input"
                )));
            };
            slot.taken += 1;
            if slot.taken == slot.parts.len() {
                slots.remove(&key);
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
            (None, Some(Activity::Recv { from, tag })) => {
                format!("rank {r} is blocked in recv from rank {from} (tag {tag})")
            }
            (None, None) => {
                format!("rank {r} is in no call (still computing, or stuck)")
            }
        });
        each.collect::<Vec<_>>().join("; ")
    }
}

fn vanished(group: &Group, key: SlotKey) -> CommError {
    CommError::Internal(format!(
        "slot (call, piece) {key:?} of group {group} vanished while a member waited"
    ))
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
        ThreadComm::world_with_piece(n, timeout, DEFAULT_PIECE)
    }

    /// [`ThreadComm::world`] whose collectives move at most `piece` elements per member per
    /// rendezvous (see the module docs). Results and statistics do not depend on it; a small
    /// one exercises streaming in tests. Fails if `n == 0` or `piece == 0`.
    pub fn world_with_piece(n: usize, timeout: Duration, piece: usize) -> Result<Vec<ThreadComm>> {
        if n == 0 {
            return Err(CommError::InvalidArgument("a world needs at least one rank".into()));
        }
        if piece == 0 {
            return Err(CommError::InvalidArgument("a piece needs at least one element".into()));
        }
        let shared = Arc::new(Shared {
            world_size: n,
            timeout,
            piece,
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

    /// The most elements one member moves per rendezvous.
    pub fn piece(&self) -> usize {
        self.shared.piece
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
        checks::member_index(self.rank, self.shared.world_size, kind, group)
    }

    /// Checks `data.len()` splits into one equal chunk per member; returns the chunk length.
    fn chunk_len(&self, kind: CollectiveKind, group: &Group, len: usize) -> Result<usize> {
        checks::chunk_len(self.rank, kind, group, len)
    }

    fn check_peer(&self, kind: CollectiveKind, peer: usize) -> Result<()> {
        checks::check_peer(self.rank, self.shared.world_size, kind, peer)
    }

    /// This rank's next call number on `group`.
    fn next_seq(&mut self, group: &Group) -> u64 {
        let next = self.seqs.entry(group.clone()).or_insert(0);
        let seq = *next;
        *next += 1;
        seq
    }

    /// Runs `call` as the next call on its group, piece by piece: `fill(state, p, buf)`
    /// appends this member's part of piece p to the empty `buf`, and `take(state, p, parts)`
    /// reads every member's part of piece p (in group order) once all have deposited. (The
    /// state, typically the output, is passed to both so that both may use it.)
    fn stream<S: ?Sized>(
        &mut self,
        call: Call<'_>,
        state: &mut S,
        mut fill: impl FnMut(&S, usize, &mut Vec<f32>),
        mut take: impl FnMut(&mut S, usize, &[Arc<Part>]),
    ) -> Result<()> {
        let Call { group, idx, sig, pieces } = call;
        let seq = self.next_seq(group);
        let (mut total, len) = match pieces {
            Pieces::Known { len, per } => (piece_count(len, per), len),
            // Told at the first piece; until then this member knows of that one only.
            Pieces::FromMember { .. } => (1, 0),
        };
        let mut p = 0;
        while p < total {
            let mut data = Vec::new();
            fill(state, p, &mut data);
            let parts = self.exchange(group, idx, sig, (seq, p), Arc::new(Part { data, len }))?;
            if let (0, Pieces::FromMember { lead, per }) = (p, pieces) {
                total = parts.get(lead).map_or(1, |part| piece_count(part.len, per));
            }
            take(state, p, &parts);
            p += 1;
        }
        // Out of the call: a timeout elsewhere must not say this rank is still in it.
        self.lock()?.blocked_in[self.rank] = None;
        Ok(())
    }

    /// The all-gather of `chunk` elements per member into `buf`, laid out by `layout` (checked
    /// by the caller), as member `idx`: this member's chunk is `mine`, or (if `None`) already
    /// in `buf`.
    fn gather(
        &mut self,
        group: &Group,
        idx: usize,
        mine: Option<&[f32]>,
        buf: &mut [f32],
        chunk: usize,
        layout: ChunkLayout,
    ) -> Result<()> {
        let kind = CollectiveKind::AllGather;
        let sig = Signature { kind, len: Some(chunk), root: None };
        let (piece, n) = (self.shared.piece, group.len());
        self.stream(
            Call { group, idx, sig, pieces: Pieces::Known { len: chunk, per: piece } },
            buf,
            |buf, p, part| {
                let range = piece_range(p, piece, chunk);
                match mine {
                    Some(data) => part.extend_from_slice(&data[range]),
                    None => layout.for_each_run(n, chunk, idx, range, |_, at, len| {
                        part.extend_from_slice(&buf[at..at + len]);
                    }),
                }
            },
            |buf, p, parts| {
                let range = piece_range(p, piece, chunk);
                for (m, part) in parts.iter().enumerate() {
                    // In place, our own chunk is there already.
                    if m != idx || mine.is_some() {
                        write_chunk_range(buf, &part.data, layout, n, chunk, m, range.clone());
                    }
                }
            },
        )?;
        self.stats.record(kind, f32_bytes(chunk));
        Ok(())
    }

    /// Deposits `part` as member `idx` in slot `key` of `group` and waits for every member's
    /// part; returns all parts in group order. Leaves the rank marked as in the call unless it
    /// fails.
    fn exchange(
        &self,
        group: &Group,
        idx: usize,
        sig: Signature,
        key: SlotKey,
        part: Arc<Part>,
    ) -> Result<Vec<Arc<Part>>> {
        let me = self.rank;
        let kind = sig.kind;
        let seq = key.0;
        let deadline = Instant::now().checked_add(self.shared.timeout);
        let mut st = self.lock()?;
        let disagreement = {
            let slot =
                st.slots.entry(group.clone()).or_default().entry(key).or_insert_with(|| Slot {
                    first_rank: me,
                    first: sig,
                    parts: vec![None; group.len()],
                    arrived: 0,
                    taken: 0,
                    failed: None,
                });
            if let Some(detail) = &slot.failed {
                Some(detail.clone())
            } else if slot.first != sig {
                let detail = format!(
                    "rank {} called {} but rank {me} called {}",
                    slot.first_rank,
                    slot.first.describe(),
                    sig.describe()
                );
                // Fail the slot so the members already waiting in it fail too, now.
                slot.failed = Some(detail.clone());
                Some(detail)
            } else {
                slot.parts[idx] = Some(part);
                slot.arrived += 1;
                None
            }
        };
        self.shared.changed.notify_all();
        if let Some(detail) = disagreement {
            // Out of the call (this rank may have been marked in it at an earlier piece).
            st.blocked_in[me] = None;
            return Err(CommError::Mismatch {
                rank: me,
                kind,
                group: group.ranks().to_vec(),
                seq,
                detail,
            });
        }
        st.blocked_in[me] = Some(Activity::Collective { kind, group: group.clone(), seq });
        loop {
            let missing = match st.poll_slot(group, key, me, kind) {
                Step::Done(parts) => return Ok(parts),
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

/// One streamed call: its group, the caller's index in it, what it asks for, and how it is
/// cut into pieces.
struct Call<'g> {
    group: &'g Group,
    idx: usize,
    sig: Signature,
    pieces: Pieces,
}

/// How a streamed call is cut into pieces: `len` elements, `per` at a time.
#[derive(Clone, Copy)]
enum Pieces {
    /// Every member knows `len` (members agree on it: it is in the signature).
    Known { len: usize, per: usize },
    /// Only member `lead` (a broadcast's root) knows `len`; it tells the others in the first
    /// piece.
    FromMember { lead: usize, per: usize },
}

/// Pieces needed to move `len` elements at most `piece` at a time; at least one, so that
/// every call (even an empty one) meets.
fn piece_count(len: usize, piece: usize) -> usize {
    len.div_ceil(piece.max(1)).max(1)
}

/// Piece `p` of `0..len` cut `piece` elements at a time (empty past the end).
fn piece_range(p: usize, piece: usize, len: usize) -> Range<usize> {
    let start = p.saturating_mul(piece).min(len);
    start..start.saturating_add(piece).min(len)
}

/// Appends to `out` the element-wise sum of the equally long `segments`, in their order (so
/// every member gets the same bits, however the call was cut).
fn push_sum<'a>(out: &mut Vec<f32>, mut segments: impl Iterator<Item = &'a [f32]>) {
    let start = out.len();
    if let Some(first) = segments.next() {
        out.extend_from_slice(first);
    }
    for s in segments {
        for (o, x) in out[start..].iter_mut().zip(s) {
            *o += *x;
        }
    }
}

/// Appends to `buf`, for each of the `members` chunks of `data` (laid out by `layout`, chunks
/// of `chunk` elements), its elements `range`: a member's part of one reduce-scatter or
/// all-to-all piece, destination-major.
fn push_chunk_ranges(
    buf: &mut Vec<f32>,
    data: &[f32],
    layout: ChunkLayout,
    members: usize,
    chunk: usize,
    range: Range<usize>,
) {
    buf.reserve(members * range.len());
    for k in 0..members {
        layout.for_each_run(members, chunk, k, range.clone(), |_, at, len| {
            buf.extend_from_slice(&data[at..at + len]);
        });
    }
}

/// Writes `src` (elements `range` of member `k`'s chunk) into `out`, laid out by `layout`.
fn write_chunk_range(
    out: &mut [f32],
    src: &[f32],
    layout: ChunkLayout,
    members: usize,
    chunk: usize,
    k: usize,
    range: Range<usize>,
) {
    let first = range.start;
    layout.for_each_run(members, chunk, k, range, |j, at, len| {
        out[at..at + len].copy_from_slice(&src[j - first..j - first + len]);
    });
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
        let (piece, len) = (self.shared.piece, data.len());
        let mut out = Vec::with_capacity(len);
        self.stream(
            Call { group, idx, sig, pieces: Pieces::Known { len, per: piece } },
            &mut out,
            |_, p, buf| buf.extend_from_slice(&data[piece_range(p, piece, len)]),
            |out, _, parts| push_sum(out, parts.iter().map(|part| &part.data[..])),
        )?;
        self.stats.record(kind, f32_bytes(len));
        Ok(out)
    }

    fn all_gather(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        let kind = CollectiveKind::AllGather;
        let idx = self.member_index(kind, group)?;
        let mut out = vec![0.0f32; data.len() * group.len()];
        self.gather(group, idx, Some(data), &mut out, data.len(), ChunkLayout::CONTIGUOUS)?;
        Ok(out)
    }

    fn all_gather_in_place(
        &mut self,
        group: &Group,
        buf: &mut [f32],
        chunk: usize,
        layout: ChunkLayout,
    ) -> Result<()> {
        let kind = CollectiveKind::AllGather;
        let idx = self.member_index(kind, group)?;
        check_layout(self.rank, kind, group, layout, chunk, buf.len())?;
        self.gather(group, idx, None, buf, chunk, layout)
    }

    fn reduce_scatter_sum(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        self.reduce_scatter_sum_strided(group, data, ChunkLayout::CONTIGUOUS)
    }

    fn reduce_scatter_sum_strided(
        &mut self,
        group: &Group,
        data: &[f32],
        layout: ChunkLayout,
    ) -> Result<Vec<f32>> {
        let kind = CollectiveKind::ReduceScatter;
        let idx = self.member_index(kind, group)?;
        let chunk = self.chunk_len(kind, group, data.len())?;
        check_layout(self.rank, kind, group, layout, chunk, data.len())?;
        let sig = Signature { kind, len: Some(data.len()), root: None };
        let n = group.len();
        // Each piece takes the same range of every chunk, `piece` elements in all.
        let per = (self.shared.piece / n).max(1);
        let mut out = Vec::with_capacity(chunk);
        self.stream(
            Call { group, idx, sig, pieces: Pieces::Known { len: chunk, per } },
            &mut out,
            |_, p, buf| push_chunk_ranges(buf, data, layout, n, chunk, piece_range(p, per, chunk)),
            |out, p, parts| {
                let w = piece_range(p, per, chunk).len();
                push_sum(out, parts.iter().map(|part| &part.data[idx * w..(idx + 1) * w]));
            },
        )?;
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(out)
    }

    fn all_to_all(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        self.all_to_all_strided(group, data, ChunkLayout::CONTIGUOUS, ChunkLayout::CONTIGUOUS)
    }

    fn all_to_all_strided(
        &mut self,
        group: &Group,
        data: &[f32],
        input: ChunkLayout,
        output: ChunkLayout,
    ) -> Result<Vec<f32>> {
        let kind = CollectiveKind::AllToAll;
        let idx = self.member_index(kind, group)?;
        let chunk = self.chunk_len(kind, group, data.len())?;
        check_layout(self.rank, kind, group, input, chunk, data.len())?;
        check_layout(self.rank, kind, group, output, chunk, data.len())?;
        let sig = Signature { kind, len: Some(data.len()), root: None };
        let n = group.len();
        // Each piece takes the same range of every chunk, `piece` elements in all.
        let per = (self.shared.piece / n).max(1);
        let mut out = vec![0.0f32; data.len()];
        self.stream(
            Call { group, idx, sig, pieces: Pieces::Known { len: chunk, per } },
            &mut out[..],
            |_, p, buf| push_chunk_ranges(buf, data, input, n, chunk, piece_range(p, per, chunk)),
            |out, p, parts| {
                let range = piece_range(p, per, chunk);
                let w = range.len();
                // Member m's part holds its chunk for us at segment `idx`: our chunk m.
                for (m, part) in parts.iter().enumerate() {
                    let src = &part.data[idx * w..(idx + 1) * w];
                    write_chunk_range(out, src, output, n, chunk, m, range.clone());
                }
            },
        )?;
        self.stats.record(kind, f32_bytes(data.len()));
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
        let sig = Signature { kind, len: None, root: Some(root) };
        let piece = self.shared.piece;
        let is_root = idx == root_idx;
        // Only the root's input travels; the others' is ignored (not even copied), and they
        // learn the length (the number of pieces) from the root's first part.
        let pieces = if is_root {
            Pieces::Known { len: data.len(), per: piece }
        } else {
            Pieces::FromMember { lead: root_idx, per: piece }
        };
        let mut out = Vec::new();
        self.stream(
            Call { group, idx, sig, pieces },
            &mut out,
            |_, p, buf| {
                if is_root {
                    buf.extend_from_slice(&data[piece_range(p, piece, data.len())]);
                }
            },
            |out, p, parts| {
                if let Some(part) = parts.get(root_idx) {
                    if p == 0 {
                        out.reserve_exact(part.len);
                    }
                    out.extend_from_slice(&part.data);
                }
            },
        )?;
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(out)
    }

    fn send(&mut self, to: usize, data: &[f32]) -> Result<()> {
        self.send_tagged(to, 0, data)
    }

    fn recv(&mut self, from: usize) -> Result<Vec<f32>> {
        self.recv_tagged(from, 0)
    }

    fn send_tagged(&mut self, to: usize, tag: u32, data: &[f32]) -> Result<()> {
        let kind = CollectiveKind::Send;
        self.check_peer(kind, to)?;
        check_tag(self.rank, kind, to, tag)?;
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
        st.mailboxes.entry((self.rank, to, tag)).or_default().push_back(data.to_vec());
        drop(st);
        self.shared.changed.notify_all();
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(())
    }

    fn recv_tagged(&mut self, from: usize, tag: u32) -> Result<Vec<f32>> {
        let kind = CollectiveKind::Recv;
        let me = self.rank;
        self.check_peer(kind, from)?;
        check_tag(me, kind, from, tag)?;
        let deadline = Instant::now().checked_add(self.shared.timeout);
        let mut st = self.lock()?;
        st.blocked_in[me] = Some(Activity::Recv { from, tag });
        let key = (from, me, tag);
        let outcome = loop {
            if let Some(msg) = st.mailboxes.get_mut(&key).and_then(|q| q.pop_front()) {
                if st.mailboxes.get(&key).is_some_and(VecDeque::is_empty) {
                    // Tags are many and often used once: keep no empty queue behind.
                    st.mailboxes.remove(&key);
                }
                break Ok(msg);
            }
            if from == me {
                break Err(CommError::InvalidArgument(format!(
                    "rank {me}: recv from itself (tag {tag}) with no message queued would wait \
                     forever"
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
                    detail: format!(
                        "no message with tag {tag} from rank {from} arrived; {}",
                        st.describe_missing(&[from])
                    ),
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
        let pieces = Pieces::Known { len: 0, per: 1 };
        self.stream(Call { group, idx, sig, pieces }, &mut (), |_, _, _| {}, |_, _, _| {})?;
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
        st.mailboxes.retain(|&(_, to, _), _| to != me);
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
