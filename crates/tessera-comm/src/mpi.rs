//! The MPI backend: one rank per process, started by `mpirun` (or `srun`), over rsmpi.
//!
//! [`MpiComm`] keeps the thread backend's guarantees — results in group order and identical
//! bits on every member, each group its own call sequence, every call bounded by a timeout,
//! clear errors naming rank, collective and group — on top of MPI's non-blocking operations.
//!
//! # Communicators
//!
//! - A collective over the whole world runs on `MPI_COMM_WORLD`. A collective over a smaller
//!   group runs on a sub-communicator made at the group's first call and cached per group; its
//!   member order is the group's (ascending global ranks).
//! - The sub-communicator is made with `MPI_Comm_create_group`, which only the group's members
//!   call (unlike `MPI_Comm_split`/`MPI_Comm_create`, which every rank of the parent must call
//!   together, in one order: impossible when rows and columns of a mesh are first used by
//!   different ranks at different times). It is blocking and cannot time out, so it is preceded
//!   by a *hello* exchange with the other members (non-blocking, on a private duplicate of the
//!   world): only once every member has said it is setting up this same group is it called, so
//!   a missing member gives a [`CommError::Timeout`] naming it, and a member setting up a
//!   different group gives a [`CommError::Mismatch`], instead of a hang.
//! - `send`/`recv` use another private duplicate of the world, so user messages never match
//!   anything else and keep MPI's per-pair FIFO order. A user tag t (`send_tagged`) travels as
//!   MPI tag `USER_TAG_BASE + t`: above every tag the backend uses for itself, and at most
//!   32767 (the upper bound MPI guarantees) for every tag up to [`MAX_TAG`]. MPI orders
//!   messages per (source, tag), and a receive probes for its own tag only, so each user tag is
//!   an independent FIFO stream; `send`/`recv` are tag 0.
//!
//! # One call
//!
//! Every collective first *announces* itself: it sends its number in the group's call sequence
//! to each other member, as one word on the group's communicator (tag of its own, used for
//! nothing else), without waiting. Each call then receives, again without waiting, the
//! announcements that have arrived for it, so a rank knows, per group and member, the last
//! call that member has entered (see [Timeouts and failure](#timeouts-and-failure)). The
//! queue stays short: a member can be at most one call ahead of another on a group, so once
//! they have arrived at most two of its announcements are waiting, and the sends (tiny, so
//! complete at once) are freed at the next call. This costs n − 1 one-word sends and receives
//! per call and no wait; dropping the communicator receives the last ones before finalising
//! MPI.
//!
//! Then every collective all-gathers a small *signature* (kind, the call's number in this
//! group, length, root) on the group's communicator. Members whose calls disagree all fail
//! with [`CommError::Mismatch`] naming both sides, and since they all saw the same signatures
//! they all skip the data phase together, so the group stays in step. The signature also tells
//! non-roots the length of a broadcast. Then the data moves with one non-blocking MPI
//! collective, and sums are taken locally in group order so every member gets the same bits as
//! the thread backend: all-reduce is an all-gather then a sum, reduce-scatter an all-to-all of
//! chunks then a sum, all-to-all and broadcast map directly, and a barrier is the signature
//! exchange alone. This costs a second (tiny) collective per call and, for all-reduce, n times
//! the traffic of a reducing all-reduce; the runtime's groups are small, and exactness is the
//! point.
//!
//! # Timeouts and failure
//!
//! Every operation is started non-blocking and polled until it completes or the call's
//! deadline passes; then the call fails with [`CommError::Timeout`]. MPI itself does not tell
//! which members have not arrived at a collective, so `missing` comes from the announcements:
//! a collective whose signature exchange times out receives the announcements that have
//! arrived (the members that entered sent theirs before entering, long before the deadline)
//! and names as missing every member that has not announced this call (`waiting for ranks
//! [2]`, with the last call each was seen to enter on the group): a rank still computing,
//! stuck, or waiting in a call on another group. As with the thread backend, a one-rank stall
//! is named by every other member. A data phase that times out (every member
//! had entered: their signatures arrived) has nothing to name and leaves `missing` empty.
//! While a group's communicator is being set up, the hellos name the missing members, and for
//! `recv` it is the sender.
//!
//! An MPI collective cannot be cancelled: the timed-out request and its buffers are
//! abandoned (leaked; MPI may still write to them), and the rank's MPI state is no longer
//! usable. **After a `Timeout` the program must end the job**: print the error and call
//! [`MpiComm::abort`], which calls `MPI_Abort` on the world and ends every rank (what the
//! runtime's driver is meant to do with any error of this backend). A rank that drops its
//! communicator after an abandoned operation skips `MPI_Finalize` (which could hang), so the
//! launcher sees it exit without finalising and ends the job.
//!
//! Unlike the thread backend, a rank that has returned is not detected as "gone" (no
//! [`CommError::RankDied`]): its peers' calls time out instead, or the launcher ends the job when
//! the rank exits.

use std::collections::HashMap;
use std::fmt;
use std::mem::ManuallyDrop;
use std::time::{Duration, Instant};

use ::mpi::datatype::Equivalence;
use ::mpi::point_to_point::{Message, Status};
use ::mpi::request::{Request, Scope, StaticScope};
use ::mpi::topology::{Rank, SimpleCommunicator};
use ::mpi::traits::{
    Communicator as _, CommunicatorCollectives as _, Destination as _, Group as _, Root as _,
    Source as _,
};
use ::mpi::{Tag, Threading};

use crate::agreement::{agree, Disagreement, Signature};
use crate::checks;
use crate::communicator::{check_tag, sum_chunks, Communicator, MAX_TAG};
use crate::error::{describe_op, CommError, Result};
use crate::group::Group;
use crate::stats::{f32_bytes, CollectiveKind, CommStats};

/// Tag of set-up hellos, on the `hello` communicator.
const HELLO_TAG: Tag = 1;
/// Tag given to `MPI_Comm_create_group` on the `create` communicator (only one set-up runs at a
/// time per rank, so one tag suffices).
const CREATE_TAG: Tag = 2;
/// Tag of call announcements, on each group's own communicator (the world's for the world),
/// where nothing else is sent point to point.
const ANNOUNCE_TAG: Tag = 3;
/// MPI tag of user tag 0, on the `p2p` communicator; user tag t is `USER_TAG_BASE + t`. User
/// messages are alone on `p2p`, but their range is kept clear of the backend's own tags anyway
/// (with room for more of those), so no user tag can ever match an internal message.
const USER_TAG_BASE: Tag = 16;
/// The largest tag every MPI library must accept (the least `MPI_TAG_UB` the standard allows).
const MPI_GUARANTEED_TAG_UB: Tag = 32_767;

// The user range lies above every internal tag and within MPI's guaranteed bound.
const _: () = assert!(USER_TAG_BASE > ANNOUNCE_TAG && USER_TAG_BASE > CREATE_TAG);
const _: () = assert!(USER_TAG_BASE > HELLO_TAG);
const _: () = assert!(MAX_TAG as i64 + USER_TAG_BASE as i64 == MPI_GUARANTEED_TAG_UB as i64);

/// The MPI tag of user tag `tag` (at most [`MAX_TAG`], checked by the caller with `check_tag`).
fn user_tag(tag: u32) -> Tag {
    USER_TAG_BASE + tag.min(MAX_TAG) as Tag
}

/// How long a timed-out call may spend receiving the announcements already queued for it
/// (each is one word that has arrived, so receiving it takes microseconds).
const ANNOUNCE_GRACE: Duration = Duration::from_secs(1);

/// The end of every error after which an MPI operation was abandoned.
const END_THE_JOB: &str = "the timed-out MPI operation cannot be cancelled: end the job now \
     (print this error and call MpiComm::abort)";

/// One rank of an MPI job. Create it once per process with [`MpiComm::init`]; dropping it
/// finalises MPI, which waits for every other rank to finalise too.
///
/// It may be moved to another thread (MPI runs at `MPI_THREAD_SERIALIZED`), but MPI wants
/// `MPI_Finalize` on the thread that initialised it: prefer dropping it on the thread that
/// called `init` (OpenMPI tolerates another thread in practice).
///
/// MPI errors the backend does not catch first (a library or network failure) keep MPI's
/// default handler, which aborts the whole job with MPI's own message.
pub struct MpiComm {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// Per group: how many calls this rank has made on it (the next call's number).
    seqs: HashMap<Group, u64>,
    /// Per group: the calls this rank has announced there and heard announced by the others.
    tallies: HashMap<Group, Tally>,
    stats: CommStats,
    /// Set once an operation was abandoned after a timeout: MPI may still use its buffers and
    /// its request is never completed, so MPI must not be finalised (see `Drop`).
    abandoned: bool,
    /// Everything that holds MPI handles, dropped (or deliberately not) in `Drop`.
    mpi: ManuallyDrop<MpiState>,
}

/// What a rank knows of one group's progress from the announcements: every member announces
/// each of its calls on the group to the others as it enters it.
struct Tally {
    /// How many calls this rank has announced here (its last announced call's number + 1).
    announced: u64,
    /// Per member, in group order: how many of its calls it has announced to this rank (the
    /// number of the next call it will enter). This rank's own entry stays 0.
    heard: Vec<u64>,
}

/// How much of the backend's own traffic is outstanding on one rank (see
/// [`MpiComm::backlog`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Sends (user messages, set-up hellos, call announcements) MPI has not completed yet.
    pub sends_in_flight: usize,
    /// Announcements of the calls this rank has entered that it has not yet received from the
    /// other members (not yet sent, in flight, or waiting to be received), summed over groups
    /// and members.
    pub announcements_unheard: u64,
}

/// MPI objects, in the order they must be released: communicators before the universe, whose
/// drop calls `MPI_Finalize`.
struct MpiState {
    /// Sends not yet known to be complete; their buffers are freed when they are.
    pending: Vec<Box<dyn PendingSend>>,
    /// Sub-communicators per group (not the world, which uses `world`).
    groups: HashMap<Group, SimpleCommunicator>,
    /// Duplicate of the world for `send`/`recv`.
    p2p: SimpleCommunicator,
    /// Duplicate of the world for set-up hellos.
    hello: SimpleCommunicator,
    /// Duplicate of the world, parent of every `MPI_Comm_create_group`.
    create: SimpleCommunicator,
    /// `MPI_COMM_WORLD`: whole-world collectives and `MPI_Abort`.
    world: SimpleCommunicator,
    #[expect(dead_code, reason = "held only for its Drop, which calls MPI_Finalize")]
    universe: ::mpi::environment::Universe,
}

impl MpiState {
    /// The communicator of `group`: the world's, or the one `ensure_comm` made (`None` before).
    fn comm(&self, group: &Group, world_size: usize) -> Option<&SimpleCommunicator> {
        if group.len() == world_size {
            Some(&self.world)
        } else {
            self.groups.get(group)
        }
    }
}

// SAFETY: MPI handles are plain integers or pointers that MPI allows any thread to use as long
// as MPI was initialised with at least `MPI_THREAD_SERIALIZED` and no two threads call MPI at
// once. `init` refuses a lower thread level, and `MpiComm` is not `Sync`, so one thread at a
// time owns it and makes all of its MPI calls; moving it between threads is what the runtime
// does (it owns a `Box<dyn Communicator>` and hands it to the thread that drives the rank).
unsafe impl Send for MpiComm {}

impl fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .field("abandoned", &self.abandoned)
            .finish_non_exhaustive()
    }
}

/// The operation did not complete by the deadline and was abandoned (its buffers leaked).
struct Abandoned;

/// One collective call in progress: what its errors must name.
struct Call<'g> {
    rank: usize,
    kind: CollectiveKind,
    group: &'g Group,
    seq: u64,
    timeout: Duration,
    /// `None` when the timeout is too large to add to now: no deadline.
    deadline: Option<Instant>,
}

impl Call<'_> {
    fn timed_out(&self, missing: Vec<usize>, detail: String) -> CommError {
        CommError::Timeout {
            rank: self.rank,
            kind: self.kind,
            group: self.group.ranks().to_vec(),
            timeout: self.timeout,
            missing,
            detail,
        }
    }

    fn mismatch(&self, detail: String) -> CommError {
        CommError::Mismatch {
            rank: self.rank,
            kind: self.kind,
            group: self.group.ranks().to_vec(),
            seq: self.seq,
            detail,
        }
    }
}

fn past(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

/// Polling pace: spin briefly (completions are often microseconds away), then yield, then
/// sleep, so a long wait does not burn a core that another rank on the node may need.
struct Backoff(u32);

impl Backoff {
    fn pause(&mut self) {
        self.0 = self.0.saturating_add(1);
        if self.0 < 64 {
            std::hint::spin_loop();
        } else if self.0 < 1024 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Polls `request` until it completes (`true`) or `deadline` passes (`false`). Each test also
/// drives MPI's progress engine, which moves this rank's other pending operations along.
///
/// On `false` the request has been abandoned: unregistered from its scope without completing,
/// so MPI may still read or write its buffers. The caller must then leak every buffer the
/// request uses (never free or reuse them).
fn finish<'a, D: ?Sized, S: Scope<'a>>(
    request: Request<'a, D, S>,
    deadline: Option<Instant>,
) -> bool {
    let mut request = request;
    let mut backoff = Backoff(0);
    loop {
        request = match request.test() {
            Ok(_) => return true,
            Err(pending) => pending,
        };
        if past(deadline) {
            // SAFETY: `into_raw` asks that the request be completed while its buffers live; it
            // never will be, so instead every caller leaks the buffers (see above), which keeps
            // them valid for as long as MPI might touch them. The raw request handle is leaked
            // too: MPI cannot cancel a collective, and the rank must end the job anyway.
            let _ = unsafe { request.into_raw() };
            return false;
        }
        backoff.pause();
    }
}

/// Every member's `send`, concatenated in member order (`n` members).
fn all_gather_on<T: Equivalence + Copy + Default>(
    comm: &SimpleCommunicator,
    send: Vec<T>,
    n: usize,
    deadline: Option<Instant>,
) -> std::result::Result<Vec<T>, Abandoned> {
    let mut recv = vec![T::default(); send.len() * n];
    let done = ::mpi::request::scope(|scope| {
        finish(comm.immediate_all_gather_into(scope, &send[..], &mut recv[..]), deadline)
    });
    if done {
        Ok(recv)
    } else {
        // MPI may still use both buffers: leak them (see `finish`).
        Vec::leak(send);
        Vec::leak(recv);
        Err(Abandoned)
    }
}

/// Chunk k of `send` to member k; the result holds member k's chunk for us at chunk k.
fn all_to_all_on(
    comm: &SimpleCommunicator,
    send: Vec<f32>,
    deadline: Option<Instant>,
) -> std::result::Result<Vec<f32>, Abandoned> {
    let mut recv = vec![0.0f32; send.len()];
    let done = ::mpi::request::scope(|scope| {
        finish(comm.immediate_all_to_all_into(scope, &send[..], &mut recv[..]), deadline)
    });
    if done {
        Ok(recv)
    } else {
        Vec::leak(send);
        Vec::leak(recv);
        Err(Abandoned)
    }
}

/// `buf` of member `root_idx` on every member (`buf` has the root's length everywhere).
fn broadcast_on(
    comm: &SimpleCommunicator,
    root_idx: Rank,
    mut buf: Vec<f32>,
    deadline: Option<Instant>,
) -> std::result::Result<Vec<f32>, Abandoned> {
    let root = comm.process_at_rank(root_idx);
    let done = ::mpi::request::scope(|scope| {
        finish(root.immediate_broadcast_into(scope, &mut buf[..]), deadline)
    });
    if done {
        Ok(buf)
    } else {
        Vec::leak(buf);
        Err(Abandoned)
    }
}

/// Receives a message found by a matched probe (so no other receive can take it).
fn receive_matched<T: Equivalence + Copy + Default>(
    (message, status): (Message, Status),
    deadline: Option<Instant>,
) -> std::result::Result<Vec<T>, Abandoned> {
    // MPI_Get_count is negative (MPI_UNDEFINED) only for a message that is not whole `T`s,
    // which cannot happen on our private communicators where each tag carries one type; an
    // empty buffer would then make MPI report the truncation rather than us guessing.
    let len = usize::try_from(status.count(T::equivalent_datatype())).unwrap_or(0);
    let mut buf = vec![T::default(); len];
    let done = ::mpi::request::scope(|scope| {
        finish(message.immediate_matched_receive_into(scope, &mut buf[..]), deadline)
    });
    if done {
        Ok(buf)
    } else {
        Vec::leak(buf);
        Err(Abandoned)
    }
}

/// A send MPI may still be reading from: its request and the heap buffer it reads.
trait PendingSend {
    /// Tests the send; `None` once it has completed (and its buffer was freed).
    fn poll(self: Box<Self>) -> Option<Box<dyn PendingSend>>;
}

struct LentSend<T: Equivalence + 'static> {
    request: Request<'static, [T]>,
    /// Allocated by `Box::into_raw` in `start_send`; freed in `poll` once the request is done.
    buf: *mut [T],
}

impl<T: Equivalence + 'static> PendingSend for LentSend<T> {
    fn poll(self: Box<Self>) -> Option<Box<dyn PendingSend>> {
        let LentSend { request, buf } = *self;
        match request.test() {
            Ok(_) => {
                // SAFETY: `buf` came from `Box::into_raw` and was only lent to MPI through the
                // request, which is complete: nothing references the buffer any more.
                drop(unsafe { Box::from_raw(buf) });
                None
            }
            Err(request) => Some(Box::new(LentSend { request, buf })),
        }
    }
}

/// Starts sending `data` to rank `to` of `comm` with `tag`, without waiting for the receiver.
/// The buffer lives on the heap until the send completes (see [`PendingSend`]).
fn start_send<T: Equivalence + 'static>(
    comm: &SimpleCommunicator,
    to: Rank,
    tag: Tag,
    data: Vec<T>,
) -> Box<dyn PendingSend> {
    let buf: *mut [T] = Box::into_raw(data.into_boxed_slice());
    // SAFETY: `buf` is a live, unaliased allocation that is freed only after the request has
    // completed (`LentSend::poll`) or never (a send still pending when the rank ends is leaked), so
    // the `'static` borrow MPI gets never dangles.
    let view: &'static [T] = unsafe { &*buf };
    let request = comm.process_at_rank(to).immediate_send_with_tag(StaticScope, view, tag);
    Box::new(LentSend { request, buf })
}

/// Receives every announcement already on `comm` into `tally` (see [`MpiComm::drain`]).
fn drain_on(
    comm: &SimpleCommunicator,
    tally: &mut Tally,
    deadline: Option<Instant>,
) -> std::result::Result<(), Abandoned> {
    while let Some(found) = comm.any_process().immediate_matched_probe_with_tag(ANNOUNCE_TAG) {
        let from = usize::try_from(found.1.source_rank()).ok();
        let words = receive_matched::<u64>(found, deadline)?;
        let heard = from.and_then(|idx| tally.heard.get_mut(idx));
        if let (Some(heard), Some(&seq)) = (heard, words.first()) {
            // Announcements from one member arrive in order (same communicator and tag).
            *heard = (*heard).max(seq.saturating_add(1));
        }
    }
    Ok(())
}

fn to_rank(r: usize) -> Result<Rank> {
    Rank::try_from(r).map_err(|_| CommError::Internal(format!("rank {r} does not fit an MPI rank")))
}

impl MpiComm {
    /// Initialises MPI (thread level `MPI_THREAD_SERIALIZED`, so the communicator may move to
    /// another thread) and returns this process's rank of `MPI_COMM_WORLD`; every wait of
    /// every later call gives up after `timeout`. Every process of the job must call it: like
    /// `MPI_Init` itself, it waits (without a timeout) for every rank to arrive, since it
    /// duplicates the world communicator; a rank that exits before calling it makes the
    /// launcher end the job.
    ///
    /// Fails if MPI was already initialised in this process (MPI can be initialised only once,
    /// even after finalising) or provides no thread support beyond `MPI_THREAD_FUNNELED`.
    pub fn init(timeout: Duration) -> Result<MpiComm> {
        let Some((universe, provided)) = ::mpi::initialize_with_threading(Threading::Serialized)
        else {
            return Err(CommError::InvalidArgument(
                "MPI is already initialised in this process: create one MpiComm per process \
                 (MPI cannot be initialised twice, not even after finalising)"
                    .into(),
            ));
        };
        if provided < Threading::Serialized {
            return Err(CommError::InvalidArgument(format!(
                "the MPI library offers only thread level {provided:?}, but MpiComm needs \
                 Serialized (the runtime drives a rank from a thread other than main); use an MPI \
                 built with thread support (OpenMPI's packages are)"
            )));
        }
        let world = universe.world();
        let (rank, world_size) = (usize::try_from(world.rank()), usize::try_from(world.size()));
        let (Ok(rank), Ok(world_size)) = (rank, world_size) else {
            return Err(CommError::Internal("MPI returned a negative rank or world size".into()));
        };
        // Each duplicate gets its own matching context, so hellos, user messages and the
        // traffic of MPI_Comm_create_group can never be confused with one another.
        let (p2p, hello, create) = (world.duplicate(), world.duplicate(), world.duplicate());
        Ok(MpiComm {
            rank,
            world_size,
            timeout,
            seqs: HashMap::new(),
            tallies: HashMap::new(),
            stats: CommStats::default(),
            abandoned: false,
            mpi: ManuallyDrop::new(MpiState {
                pending: Vec::new(),
                groups: HashMap::new(),
                p2p,
                hello,
                create,
                world,
                universe,
            }),
        })
    }

    /// How long any one call may wait before it fails.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Ends the whole job now: `MPI_Abort` on the world, which makes the launcher kill every
    /// rank and exit with a non-zero status (`code`, where the launcher passes it on). The way
    /// to stop after a [`CommError::Timeout`] (or any error that leaves ranks out of step),
    /// since the other ranks may be blocked in MPI where no error can reach them.
    pub fn abort(&self, code: i32) -> ! {
        self.mpi.world.abort(code)
    }

    /// Frees the buffers of sends that have completed.
    fn reap(&mut self) {
        let pending = std::mem::take(&mut self.mpi.pending);
        self.mpi.pending = pending.into_iter().filter_map(|p| p.poll()).collect();
    }

    /// The member index of the caller in `group`, after checking the group fits the world.
    fn member_index(&self, kind: CollectiveKind, group: &Group) -> Result<usize> {
        checks::member_index(self.rank, self.world_size, kind, group)
    }

    /// Checks `len` splits into one equal chunk per member; returns the chunk length.
    fn chunk_len(&self, kind: CollectiveKind, group: &Group, len: usize) -> Result<usize> {
        checks::chunk_len(self.rank, kind, group, len)
    }

    /// MPI counts are 32-bit: refuse a buffer of `len` elements MPI could not describe.
    fn check_count(&self, kind: CollectiveKind, group: &[usize], len: Option<usize>) -> Result<()> {
        match len {
            Some(len) if i32::try_from(len).is_ok() => Ok(()),
            _ => Err(CommError::InvalidArgument(format!(
                "rank {}: {} would move more than {} elements in one MPI buffer; split the tensor",
                self.rank,
                describe_op(kind, group),
                i32::MAX
            ))),
        }
    }

    fn check_peer(&self, kind: CollectiveKind, peer: usize) -> Result<()> {
        checks::check_peer(self.rank, self.world_size, kind, peer)
    }

    /// Opens call `kind` on `group`: numbers it, sets its deadline.
    fn open<'g>(&mut self, kind: CollectiveKind, group: &'g Group) -> Call<'g> {
        let next = self.seqs.entry(group.clone()).or_insert(0);
        let seq = *next;
        *next += 1;
        Call {
            rank: self.rank,
            kind,
            group,
            seq,
            timeout: self.timeout,
            deadline: Instant::now().checked_add(self.timeout),
        }
    }

    /// The communicator of `group` (made by `ensure_comm`).
    fn comm(&self, group: &Group) -> Result<&SimpleCommunicator> {
        self.mpi.comm(group, self.world_size).ok_or_else(|| {
            CommError::Internal(format!("group {group} has no MPI communicator after set-up"))
        })
    }

    /// Tells the other members of the call's group that this rank has entered the call: one
    /// word (the call's number) to each on the group's communicator, sent without waiting and
    /// freed by `reap` once MPI is done with it.
    fn announce(&mut self, call: &Call<'_>) -> Result<()> {
        let group = call.group;
        let comm = self.comm(group)?;
        let mut sends = Vec::with_capacity(group.len().saturating_sub(1));
        for (idx, &r) in group.ranks().iter().enumerate() {
            if r != self.rank {
                sends.push(start_send(comm, to_rank(idx)?, ANNOUNCE_TAG, vec![call.seq]));
            }
        }
        self.mpi.pending.append(&mut sends);
        let announced = call.seq.saturating_add(1);
        match self.tallies.get_mut(group) {
            Some(tally) => tally.announced = announced,
            None => {
                let heard = vec![0; group.len()];
                self.tallies.insert(group.clone(), Tally { announced, heard });
            }
        }
        Ok(())
    }

    /// Receives the announcements that have arrived on `group`'s communicator, without waiting
    /// for more. Every call does this, so only a few per member are ever queued.
    fn drain(&mut self, group: &Group, deadline: Option<Instant>) -> Result<(), Abandoned> {
        let comm = self.mpi.comm(group, self.world_size);
        let (Some(comm), Some(tally)) = (comm, self.tallies.get_mut(group)) else { return Ok(()) };
        drain_on(comm, tally, deadline)
    }

    /// The error for a call whose signature exchange timed out: the members that have not
    /// announced entering the call are the missing ones.
    fn stalled(&mut self, call: &Call<'_>) -> CommError {
        self.abandoned = true;
        // The announcements of members that did enter were sent before they did, seconds ago:
        // they have arrived, and receiving them takes no wait.
        let grace = Instant::now().checked_add(ANNOUNCE_GRACE.min(self.timeout));
        let drained = self.drain(call.group, grace).is_ok();
        let heard = self.tallies.get(call.group).map_or(&[][..], |t| &t.heard[..]);
        let behind: Vec<(usize, u64)> = call
            .group
            .ranks()
            .iter()
            .zip(heard)
            .filter(|&(&r, &h)| r != self.rank && h <= call.seq)
            .map(|(&r, &h)| (r, h))
            .collect();
        if behind.is_empty() {
            return call.timed_out(
                Vec::new(),
                format!(
                    "every member announced entering this call, yet the exchange of call \
                     signatures did not finish (a member may have failed inside MPI); {END_THE_JOB}"
                ),
            );
        }
        let each = behind.iter().map(|&(r, h)| match h.checked_sub(1) {
            Some(last) => format!("rank {r} (its last call here was #{last})"),
            None => format!("rank {r} (no call here yet)"),
        });
        let mut detail = format!(
            "{} {} not entered this call, #{} of this group: still computing, stuck, or waiting \
             in a call on another group",
            each.collect::<Vec<_>>().join(", "),
            if behind.len() == 1 { "has" } else { "have" },
            call.seq,
        );
        if !drained {
            detail.push_str(
                " (an announcement could not be received, so a rank named here may have entered)",
            );
        }
        call.timed_out(behind.iter().map(|&(r, _)| r).collect(), format!("{detail}; {END_THE_JOB}"))
    }

    /// What of the backend's own traffic is outstanding on this rank, as the calls made so far
    /// left it (a snapshot: it completes nothing). For tests and diagnostics: every call frees
    /// the sends MPI has finished and receives the announcements that have arrived, so both
    /// counts stay within a few per member of each group however many calls are made; growth
    /// with the number of calls would mean messages accumulating.
    pub fn backlog(&self) -> Backlog {
        let unheard = self.tallies.iter().map(|(group, tally)| {
            let others = group.ranks().iter().zip(&tally.heard).filter(|&(&r, _)| r != self.rank);
            others.map(|(_, &h)| tally.announced.saturating_sub(h)).sum::<u64>()
        });
        Backlog { sends_in_flight: self.mpi.pending.len(), announcements_unheard: unheard.sum() }
    }

    /// Frees finished sends and receives every announcement that has arrived, on every group;
    /// whether nothing is outstanding any more (false too once an operation is abandoned).
    fn settle(&mut self) -> bool {
        if self.abandoned {
            return false;
        }
        self.reap();
        let deadline = Instant::now().checked_add(self.timeout);
        for (group, tally) in &mut self.tallies {
            let Some(comm) = self.mpi.comm(group, self.world_size) else { continue };
            if drain_on(comm, tally, deadline).is_err() {
                self.abandoned = true;
                return false;
            }
        }
        self.backlog() == Backlog::default()
    }

    /// Makes the sub-communicator of the call's group if this is the rank's first call there:
    /// hellos with every other member (bounded by the deadline), then `MPI_Comm_create_group`.
    fn ensure_comm(&mut self, call: &Call<'_>) -> Result<()> {
        let group = call.group;
        if group.len() == self.world_size || self.mpi.groups.contains_key(group) {
            return Ok(());
        }
        let me = self.rank;
        // The hello names the group, so a member setting up another group is caught here.
        let hello: Vec<u64> = group.ranks().iter().map(|&r| r as u64).collect();
        let mut missing: Vec<usize> = group.ranks().iter().copied().filter(|&r| r != me).collect();
        for &peer in &missing {
            let send = start_send(&self.mpi.hello, to_rank(peer)?, HELLO_TAG, hello.clone());
            self.mpi.pending.push(send);
        }
        let mut backoff = Backoff(0);
        while !missing.is_empty() {
            let mut i = 0;
            while i < missing.len() {
                let peer = missing[i];
                let source = self.mpi.hello.process_at_rank(to_rank(peer)?);
                let Some(found) = source.immediate_matched_probe_with_tag(HELLO_TAG) else {
                    i += 1;
                    continue;
                };
                let Ok(theirs) = receive_matched::<u64>(found, call.deadline) else {
                    self.abandoned = true;
                    return Err(call.timed_out(
                        vec![peer],
                        format!(
                            "the hello from rank {peer} did not finish arriving; {END_THE_JOB}"
                        ),
                    ));
                };
                if theirs != hello {
                    return Err(call.mismatch(format!(
                        "rank {me} is setting up group {group} for its first call there, but rank \
                         {peer}'s next new group is {theirs:?}: members must first use shared \
                         groups in the same order"
                    )));
                }
                missing.remove(i);
            }
            if missing.is_empty() {
                break;
            }
            if past(call.deadline) {
                let who = missing.iter().map(|r| format!("rank {r}")).collect::<Vec<_>>();
                let detail = format!(
                    "{} {} not started a call on this group yet (MPI sets up the group's \
                     communicator at its first call, with every member present)",
                    who.join(", "),
                    if who.len() == 1 { "has" } else { "have" }
                );
                return Err(call.timed_out(missing, detail));
            }
            self.reap();
            backoff.pause();
        }
        let ranks = group.ranks().iter().map(|&r| to_rank(r)).collect::<Result<Vec<_>>>()?;
        let mpi_group = self.mpi.world.group().include(&ranks);
        // Every member has said hello, so every member is about to make this same call: it
        // completes promptly. Its member order is `ranks`' order, the group's.
        let comm = self.mpi.create.split_by_subgroup_with_tag(&mpi_group, CREATE_TAG).ok_or_else(
            || {
                CommError::Internal(format!(
                    "rank {me}: MPI_Comm_create_group for group {group} returned no communicator"
                ))
            },
        )?;
        self.mpi.groups.insert(group.clone(), comm);
        Ok(())
    }

    /// Set-up and signature exchange of one call; returns every member's signature in group
    /// order once all agree with `mine`.
    fn agree(&mut self, call: &Call<'_>, mine: Signature) -> Result<Vec<Signature>> {
        self.reap();
        self.ensure_comm(call)?;
        self.announce(call)?;
        if self.drain(call.group, call.deadline).is_err() {
            return Err(self.stalled(call));
        }
        let n = call.group.len();
        let gathered =
            match all_gather_on(self.comm(call.group)?, mine.encode().to_vec(), n, call.deadline) {
                Ok(words) => words,
                Err(Abandoned) => return Err(self.stalled(call)),
            };
        // Every member sees the same signatures, so either all go on to the data phase or all
        // fail here, and the group stays in step either way.
        let sigs = agree(self.rank, call.group.ranks(), &mine, &gathered).map_err(|d| match d {
            Disagreement::Mismatch(detail) => call.mismatch(detail),
            Disagreement::Undecodable => CommError::Internal(format!(
                "rank {}: undecodable call signatures {gathered:?} from group {}",
                self.rank, call.group
            )),
        })?;
        Ok(sigs)
    }

    /// The error for a data phase that timed out (after the signatures were exchanged).
    fn data_timeout(&mut self, call: &Call<'_>) -> CommError {
        self.abandoned = true;
        call.timed_out(
            Vec::new(),
            format!(
                "every member had entered the call (their signatures arrived), but the data did \
                 not finish moving; {END_THE_JOB}"
            ),
        )
    }

    /// All-gather of the f32 payload over the call's group (the data phase of all-reduce and
    /// all-gather).
    fn gather_data(&mut self, call: &Call<'_>, data: &[f32]) -> Result<Vec<f32>> {
        let gathered =
            all_gather_on(self.comm(call.group)?, data.to_vec(), call.group.len(), call.deadline);
        gathered.map_err(|Abandoned| self.data_timeout(call))
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        let kind = CollectiveKind::AllReduce;
        self.member_index(kind, group)?;
        self.check_count(kind, group.ranks(), data.len().checked_mul(group.len()))?;
        let call = self.open(kind, group);
        let sig = Signature { kind, seq: call.seq, len: data.len(), root: None };
        self.agree(&call, sig)?;
        let out = if data.is_empty() {
            Vec::new()
        } else {
            sum_chunks(&self.gather_data(&call, data)?, group.len())
        };
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(out)
    }

    fn all_gather(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        let kind = CollectiveKind::AllGather;
        self.member_index(kind, group)?;
        self.check_count(kind, group.ranks(), data.len().checked_mul(group.len()))?;
        let call = self.open(kind, group);
        let sig = Signature { kind, seq: call.seq, len: data.len(), root: None };
        self.agree(&call, sig)?;
        let out = if data.is_empty() { Vec::new() } else { self.gather_data(&call, data)? };
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(out)
    }

    fn reduce_scatter_sum(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        let kind = CollectiveKind::ReduceScatter;
        self.member_index(kind, group)?;
        self.chunk_len(kind, group, data.len())?;
        self.check_count(kind, group.ranks(), Some(data.len()))?;
        let call = self.open(kind, group);
        let sig = Signature { kind, seq: call.seq, len: data.len(), root: None };
        self.agree(&call, sig)?;
        let out = if data.is_empty() {
            Vec::new()
        } else {
            // Member k's chunk for us lands at chunk k: sum them in member order.
            let received = all_to_all_on(self.comm(group)?, data.to_vec(), call.deadline);
            let received = received.map_err(|Abandoned| self.data_timeout(&call))?;
            sum_chunks(&received, group.len())
        };
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(out)
    }

    fn all_to_all(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        let kind = CollectiveKind::AllToAll;
        self.member_index(kind, group)?;
        self.chunk_len(kind, group, data.len())?;
        self.check_count(kind, group.ranks(), Some(data.len()))?;
        let call = self.open(kind, group);
        let sig = Signature { kind, seq: call.seq, len: data.len(), root: None };
        self.agree(&call, sig)?;
        let out = if data.is_empty() {
            Vec::new()
        } else {
            let received = all_to_all_on(self.comm(group)?, data.to_vec(), call.deadline);
            received.map_err(|Abandoned| self.data_timeout(&call))?
        };
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
        self.check_count(kind, group.ranks(), Some(data.len()))?;
        let call = self.open(kind, group);
        let sig = Signature { kind, seq: call.seq, len: data.len(), root: Some(root) };
        let sigs = self.agree(&call, sig)?;
        // Non-roots learn the length from the root's signature; their own input is ignored.
        let len = sigs.get(root_idx).map_or(0, |s| s.len);
        let out = if len == 0 {
            Vec::new()
        } else {
            let buf = if idx == root_idx { data.to_vec() } else { vec![0.0; len] };
            let received = broadcast_on(self.comm(group)?, to_rank(root_idx)?, buf, call.deadline);
            received.map_err(|Abandoned| self.data_timeout(&call))?
        };
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
        self.check_count(kind, &[to], Some(data.len()))?;
        self.reap();
        // Non-blocking: the copy stays with MPI until the receiver has taken it (`reap`).
        let send = start_send(&self.mpi.p2p, to_rank(to)?, user_tag(tag), data.to_vec());
        self.mpi.pending.push(send);
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(())
    }

    fn recv_tagged(&mut self, from: usize, tag: u32) -> Result<Vec<f32>> {
        let kind = CollectiveKind::Recv;
        let me = self.rank;
        self.check_peer(kind, from)?;
        check_tag(me, kind, from, tag)?;
        // Completing our own sends first makes a message to ourselves visible to the probe.
        self.reap();
        let deadline = Instant::now().checked_add(self.timeout);
        let timed_out = |detail: String| CommError::Timeout {
            rank: me,
            kind,
            group: vec![from],
            timeout: self.timeout,
            missing: vec![from],
            detail,
        };
        let source = self.mpi.p2p.process_at_rank(to_rank(from)?);
        let mut backoff = Backoff(0);
        loop {
            // Only this tag matches: messages of other tags stay queued for their own recvs.
            if let Some(found) = source.immediate_matched_probe_with_tag(user_tag(tag)) {
                let Ok(msg) = receive_matched::<f32>(found, deadline) else {
                    self.abandoned = true;
                    return Err(timed_out(format!(
                        "a message with tag {tag} from rank {from} started arriving but did not \
                         finish; {END_THE_JOB}"
                    )));
                };
                self.stats.record(kind, f32_bytes(msg.len()));
                return Ok(msg);
            }
            if from == me {
                return Err(CommError::InvalidArgument(format!(
                    "rank {me}: recv from itself (tag {tag}) with no message queued would wait \
                     forever"
                )));
            }
            if past(deadline) {
                return Err(timed_out(format!(
                    "no message with tag {tag} from rank {from} arrived; MPI cannot tell whether \
                     rank {from} is gone, stuck, or not sending (nothing was abandoned: this rank \
                     may go on)"
                )));
            }
            backoff.pause();
        }
    }

    fn barrier(&mut self, group: &Group) -> Result<()> {
        let kind = CollectiveKind::Barrier;
        self.member_index(kind, group)?;
        let call = self.open(kind, group);
        let sig = Signature { kind, seq: call.seq, len: 0, root: None };
        // The signature all-gather completes only once every member has entered the call.
        self.agree(&call, sig)?;
        self.stats.record(kind, 0);
        Ok(())
    }

    fn stats(&self) -> CommStats {
        self.stats.clone()
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // Give queued sends up to one timeout to be received, and the other members' last
        // call announcements as long to arrive: MPI_Finalize with sends still pending or
        // messages unreceived is erroneous, and freeing send buffers early would be unsound.
        let deadline = Instant::now().checked_add(self.timeout);
        let mut backoff = Backoff(0);
        while !self.settle() && !self.abandoned && !past(deadline) {
            backoff.pause();
        }
        if self.abandoned || !self.mpi.pending.is_empty() {
            // An abandoned operation can never complete, and MPI_Finalize could wait on it
            // forever: leave MPI unfinalised (and every buffer leaked). The launcher then sees
            // this rank exit without finalising and ends the job, which is what we want.
            eprintln!(
                "tessera-comm: rank {}: leaving MPI unfinalised because {}; the launcher will end \
                 the job",
                self.rank,
                if self.abandoned {
                    "an operation was abandoned after a timeout"
                } else {
                    "sends were never received"
                }
            );
            return;
        }
        let unheard = self.backlog().announcements_unheard;
        if unheard > 0 {
            // Other members made fewer calls on a shared group than this rank (after an error):
            // finalise anyway, as MPI_Finalize waits for them.
            eprintln!(
                "tessera-comm: rank {}: finalising MPI with {unheard} call announcements of other \
                 ranks never received (they made fewer calls on a shared group)",
                self.rank
            );
        }
        // SAFETY: `self.mpi` is dropped exactly once, here, and not used afterwards. Its fields
        // drop in declaration order: communicators are freed before the universe finalises MPI.
        unsafe { ManuallyDrop::drop(&mut self.mpi) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_tags_map_above_internal_tags_and_within_the_guaranteed_bound() {
        assert_eq!(user_tag(0), USER_TAG_BASE);
        assert_eq!(user_tag(7), USER_TAG_BASE + 7);
        assert_eq!(user_tag(MAX_TAG), MPI_GUARANTEED_TAG_UB);
        for internal in [HELLO_TAG, CREATE_TAG, ANNOUNCE_TAG] {
            assert!(internal < user_tag(0));
        }
    }
}
