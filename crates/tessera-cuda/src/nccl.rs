//! The NCCL transport: [`NcclComm`], one rank per GPU, behind the same
//! [`tessera_comm::Communicator`] trait as the thread and MPI backends, over cudarc's NCCL
//! bindings (`libnccl` loaded at run time, like the rest of this crate).
//!
//! # What has been verified
//!
//! A world of one rank on one GPU ([`NcclComm::single`]): the whole conformance suite
//! ([`tessera_comm::conformance::check_all`]) and a training step with the communicator
//! attached (`nccl_check`). **A world of several GPUs or processes is untested**: it follows
//! the design below, which is the MPI backend's, but no multi-GPU machine has run it. The
//! torchrun-style rendezvous that bootstraps it ([`crate::rendezvous`]) is tested on the CPU.
//!
//! # Design (the MPI backend's, on NCCL)
//!
//! - **Communicators.** The world runs on one NCCL communicator made at construction
//!   (`ncclCommInitRank` from a unique id rank 0 makes: locally for a world of one, over TCP for
//!   torchrun ([`NcclComm::from_env`]), or given by the caller, e.g. broadcast by MPI
//!   ([`NcclComm::from_id`])). A second world communicator, made at construction from an id
//!   rank 0 broadcasts on the first, carries only user messages. A smaller group gets its own
//!   communicator at its first call, cached per group: the group's lowest rank makes an id and
//!   sends it (with a fingerprint of the group) to the other members with `ncclSend`/`ncclRecv`
//!   on the world communicator, which involves only those ranks; a member that was setting up a
//!   different group fails with [`CommError::Mismatch`]. Member k of the group is NCCL rank k.
//! - **One call.** Every collective first all-gathers a small *signature* (kind, call number in
//!   the group, length, root) on the group's communicator: members that disagree all fail with
//!   [`CommError::Mismatch`] naming both sides, and, having all seen the same signatures, all
//!   skip the data phase, so the group stays in step. Then the data moves: all-gather and
//!   broadcast are NCCL's; all-reduce is an all-gather then a sum on the host in group order,
//!   reduce-scatter an all-to-all of chunks (grouped `ncclSend`/`ncclRecv`) then a sum, so every
//!   member gets the thread backend's bits; a barrier is the signature exchange alone. Host
//!   slices are staged through device buffers on a stream of the communicator's own.
//! - **Point to point.** A message is a header (length, tag) then the payload, both sent in one
//!   NCCL group on the user-message communicator. A receive for one tag keeps messages of other
//!   tags that arrive first on the host for their own receives. Messages to self are queued on
//!   the host (an NCCL send to self outside a group with its receive would deadlock).
//!   **Unlike the other backends, a send to another rank waits until that rank receives it**
//!   (NCCL's send blocks the GPU until the matching receive is posted, and this backend waits
//!   for each call to finish): a program in which two ranks both send before receiving (the
//!   conformance suite's ring) times out on several GPUs.
//! - **Timeouts.** Every NCCL operation is enqueued, then its completion is polled (a CUDA
//!   event) until the call's deadline; then the call fails with [`CommError::Timeout`], and
//!   since an enqueued NCCL operation cannot be cancelled, every communicator is aborted
//!   (`ncclCommAbort`) and each later call fails at once: end the rank. NCCL cannot say which
//!   member is missing, so a timeout names every other member of the group as possibly missing.
//!   Not bounded by the timeout: `ncclCommInitRank` (construction, a group's first call),
//!   which waits for every member, and NCCL's lazy connection set-up at the first operation
//!   between two ranks (set `NCCL_RUNTIME_CONNECT=0` to connect at creation instead).
//! - **Counters.** As every backend: the caller's input bytes per call, the received bytes for
//!   a receive, none for a barrier; only successful calls count.
//!
//! # Loading NCCL
//!
//! cudarc looks for `libnccl.so` (and `libnccl.so.<CUDA major>`, `.12`, `.11`, ...), **not**
//! `libnccl.so.2`, the name NCCL's runtime package installs. Where only `libnccl.so.2` exists,
//! put a `libnccl.so` link to it on `LD_LIBRARY_PATH` (or install the development package);
//! the constructors check for the library first and say so, instead of cudarc's panic.

mod call;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::safe::{Comm, Id, NcclType};
use tessera_comm::agreement::{agree, Disagreement};
use tessera_comm::{CollectiveKind, CommError, CommStats, Communicator, Group, Result};

use self::call::{
    describe_op, f32_bytes, fingerprint, grouped, id_bytes, id_from, nccl_text, sum_chunks, Call,
    Signature,
};
use crate::gpu::Gpu;
use crate::rendezvous::{EnvRendezvous, ID_BYTES};

/// How long a call waits for the other members before it fails, unless set otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Bytes of a group set-up message: the id, then the group's fingerprint.
const SETUP_BYTES: usize = ID_BYTES + 8;

/// One rank of an NCCL world on one GPU. See the [module docs](self).
pub struct NcclComm {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    gpu: Arc<Gpu>,
    /// Staging copies and every NCCL operation run here.
    stream: Arc<CudaStream>,
    /// `None` once aborted after an error.
    comms: Option<Comms>,
    /// Why the communicators were aborted (every later call fails with it).
    broken: Option<String>,
    /// Per group: the next call's number.
    seqs: HashMap<Group, u64>,
    /// Messages to self, per tag.
    to_self: HashMap<u32, VecDeque<Vec<f32>>>,
    /// Messages that arrived while a receive waited for another tag, per (sender, tag).
    inbox: HashMap<(usize, u32), VecDeque<Vec<f32>>>,
    stats: CommStats,
}

struct Comms {
    world: Comm,
    /// User messages (send/recv) only.
    p2p: Comm,
    /// Groups smaller than the world, made at their first call.
    groups: HashMap<Group, Comm>,
}

// SAFETY: an NCCL communicator and a CUDA stream may be used from any thread, one thread at a
// time (NCCL forbids concurrent use of one communicator, not migration). `NcclComm` is not
// `Sync`, every use goes through `&mut self` or `&self` of one owner, and each call binds the
// GPU's context to the calling thread first. The runtime moves its communicator to the thread
// that drives the rank, which is what this allows.
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

/// Fails with a clear error (not cudarc's panic) when libnccl cannot be loaded or is too old.
fn check_library() -> Result<i32> {
    // SAFETY: only tries to open the library by the names cudarc would use.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(CommError::InvalidArgument(
            "NCCL: the NCCL library was not found: cudarc loads it as `libnccl.so` (or \
             libnccl.so.<CUDA major>/.12/.11), not `libnccl.so.2`, the name NCCL's runtime \
             package installs. Install NCCL (e.g. the libnccl2 and libnccl-dev packages, or pip \
             nvidia-nccl-cu12), or link it: `ln -s /path/to/libnccl.so.2 DIR/libnccl.so` and put \
             DIR on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let version = cudarc::nccl::result::get_nccl_version().map_err(|e| {
        CommError::InvalidArgument(format!("NCCL: ncclGetVersion: {}", nccl_text(&e)))
    })?;
    // Versions before 2.9 encode as 1000·major + 100·minor + patch (2.7.8 = 2708).
    if version < 2_700 {
        return Err(CommError::InvalidArgument(format!(
            "NCCL: version code {version} is older than 2.7, which has no send/recv; install a \
             newer NCCL"
        )));
    }
    Ok(version)
}

/// A fresh NCCL unique id, as bytes.
pub fn new_id() -> Result<[u8; ID_BYTES]> {
    check_library()?;
    let id = Id::new().map_err(|e| {
        CommError::InvalidArgument(format!("NCCL: ncclGetUniqueId: {}", nccl_text(&e)))
    })?;
    Ok(id_bytes(&id))
}

/// An NCCL id as f32 words for a communicator's broadcast: four bytes per word, carried as bit
/// patterns (transports copy f32 buffers, never compute on a broadcast's, so every bit
/// arrives).
pub fn id_to_words(id: &[u8; ID_BYTES]) -> Vec<f32> {
    id.chunks_exact(4)
        .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect()
}

/// The id [`id_to_words`] encoded, or `None` for words of another length.
pub fn id_from_words(words: &[f32]) -> Option<[u8; ID_BYTES]> {
    if words.len() * 4 != ID_BYTES {
        return None;
    }
    let mut id = [0u8; ID_BYTES];
    for (chunk, w) in id.chunks_exact_mut(4).zip(words) {
        chunk.copy_from_slice(&w.to_bits().to_le_bytes());
    }
    Some(id)
}

impl NcclComm {
    /// A world of one rank on `gpu`, its id made locally.
    pub fn single(gpu: Arc<Gpu>) -> Result<NcclComm> {
        let id = new_id()?;
        NcclComm::from_id(gpu, 0, 1, &id, DEFAULT_TIMEOUT)
    }

    /// A rank of a torchrun-style job: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
    /// from the environment; rank 0 makes the id and serves it over TCP
    /// ([`crate::rendezvous`]). `gpu` should be this process's device (`LOCAL_RANK`).
    pub fn from_env(gpu: Arc<Gpu>) -> Result<NcclComm> {
        let rv = EnvRendezvous::from_env()?;
        check_library()?;
        let id = rv.exchange(new_id, DEFAULT_TIMEOUT)?;
        NcclComm::from_id(gpu, rv.rank, rv.world_size, &id, DEFAULT_TIMEOUT)
    }

    /// Every rank of a world that already has a communicator (MPI's, in practice): rank 0
    /// makes the id and broadcasts it over `bootstrap` ([`id_to_words`]); then each rank joins
    /// with its rank and world size there. `gpu` should be this process's device.
    pub fn over(gpu: Arc<Gpu>, bootstrap: &mut dyn Communicator) -> Result<NcclComm> {
        let (rank, world) = (bootstrap.rank(), bootstrap.world_size());
        let mine = if rank == 0 { id_to_words(&new_id()?) } else { Vec::new() };
        let words = bootstrap.broadcast(&Group::world(world)?, 0, &mine)?;
        let id = id_from_words(&words).ok_or_else(|| {
            CommError::Transport(format!(
                "rank {rank}: NCCL bootstrap: rank 0 broadcast {} words, not an NCCL id",
                words.len()
            ))
        })?;
        NcclComm::from_id(gpu, rank, world, &id, DEFAULT_TIMEOUT)
    }

    /// Rank `rank` of a world of `world_size` whose members all hold `id` (made by one of them
    /// with [`new_id`] and shared by any means: MPI's broadcast, a file). Waits, with no
    /// timeout, until every rank has joined (`ncclCommInitRank`).
    pub fn from_id(
        gpu: Arc<Gpu>,
        rank: usize,
        world_size: usize,
        id: &[u8; ID_BYTES],
        timeout: Duration,
    ) -> Result<NcclComm> {
        check_library()?;
        if rank >= world_size || i32::try_from(world_size).is_err() {
            return Err(CommError::InvalidArgument(format!(
                "NCCL: rank {rank} of a world of {world_size}: the rank must be below the world \
                 size, which must fit an i32"
            )));
        }
        let world_group = Group::world(world_size)?;
        let call = Call {
            rank,
            kind: CollectiveKind::Broadcast,
            group: world_group,
            seq: 0,
            timeout,
            deadline: Instant::now().checked_add(timeout),
        };
        gpu.ctx.bind_to_thread().map_err(|e| call.failed("binding the GPU's context", e))?;
        let stream = gpu.ctx.new_stream().map_err(|e| call.failed("creating a stream", e))?;
        let world = Comm::from_rank(stream.clone(), rank, world_size, id_from(id))
            .map_err(|e| call.nccl("ncclCommInitRank (world)", e))?;
        let mut comm = NcclComm {
            rank,
            world_size,
            timeout,
            gpu,
            stream,
            comms: None,
            broken: None,
            seqs: HashMap::new(),
            to_self: HashMap::new(),
            inbox: HashMap::new(),
            stats: CommStats::default(),
        };
        // The user-message communicator: rank 0's id, broadcast on the world communicator.
        let p2p_id = if rank == 0 { new_id()?.to_vec() } else { vec![0u8; ID_BYTES] };
        let mut buf = comm.upload(&call, &p2p_id)?;
        world.broadcast_in_place(&mut buf, 0).map_err(|e| call.nccl("ncclBroadcast", e))?;
        comm.wait(&call)?;
        let p2p_id = comm.download(&call, &buf)?;
        let p2p = Comm::from_rank(comm.stream.clone(), rank, world_size, id_from(&p2p_id))
            .map_err(|e| call.nccl("ncclCommInitRank (messages)", e))?;
        comm.comms = Some(Comms { world, p2p, groups: HashMap::new() });
        Ok(comm)
    }

    /// Every later call waits at most `timeout` for the other members.
    pub fn with_timeout(mut self, timeout: Duration) -> NcclComm {
        self.timeout = timeout;
        self
    }

    /// The GPU this rank runs on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn open(&mut self, kind: CollectiveKind, group: &Group) -> Result<Call> {
        if let Some(why) = &self.broken {
            return Err(CommError::InvalidArgument(format!(
                "rank {}: {}: this NCCL communicator was aborted after an earlier error ({why}); \
                 end the rank",
                self.rank,
                describe_op(kind, group.ranks())
            )));
        }
        let next = self.seqs.entry(group.clone()).or_insert(0);
        let seq = *next;
        *next += 1;
        Ok(Call {
            rank: self.rank,
            kind,
            group: group.clone(),
            seq,
            timeout: self.timeout,
            deadline: Instant::now().checked_add(self.timeout),
        })
    }

    /// A point-to-point call: its "group" is the peer; not numbered.
    fn open_p2p(&mut self, kind: CollectiveKind, peer: usize) -> Result<Call> {
        let group = Group::new([peer])?;
        let mut call = self.open(kind, &group)?;
        self.seqs.remove(&group);
        call.seq = 0;
        Ok(call)
    }

    /// After an error that leaves NCCL operations pending or the ranks out of step: aborts
    /// every communicator (ending their pending kernels) and refuses every later call.
    fn abort(&mut self, why: String) {
        self.broken = Some(why);
        // Dropping a cudarc `Comm` calls ncclCommAbort.
        self.comms = None;
    }

    /// Runs `f`; on an error other than a local argument error, aborts.
    fn guard<T>(&mut self, f: impl FnOnce(&mut NcclComm) -> Result<T>) -> Result<T> {
        let out = f(self);
        if let Err(e) = &out {
            // A signature mismatch leaves nothing pending and the group in step.
            let local = matches!(
                e,
                CommError::InvalidArgument(_)
                    | CommError::InvalidGroup(_)
                    | CommError::Mismatch { .. }
            );
            if !local && self.broken.is_none() {
                self.abort(e.to_string());
            }
        }
        out
    }

    fn comms(&self, call: &Call) -> Result<&Comms> {
        self.comms.as_ref().ok_or_else(|| call.failed("using the communicators", "aborted"))
    }

    /// The communicator of the call's group (the world's, or the one `ensure_comm` made).
    fn comm_of(&self, call: &Call) -> Result<&Comm> {
        let comms = self.comms(call)?;
        if call.group.len() == self.world_size {
            return Ok(&comms.world);
        }
        comms
            .groups
            .get(&call.group)
            .ok_or_else(|| call.failed("finding the group's communicator", "none was made"))
    }

    fn upload<T: DeviceRepr>(&self, call: &Call, data: &[T]) -> Result<CudaSlice<T>> {
        self.gpu.ctx.bind_to_thread().map_err(|e| call.failed("binding the GPU's context", e))?;
        self.stream.clone_htod(data).map_err(|e| call.failed("copying to the GPU", e))
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        call: &Call,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros(n).map_err(|e| call.failed("allocating a staging buffer", e))
    }

    /// Copies back a buffer whose operations `wait` has seen complete (so this does not block).
    fn download<T: DeviceRepr>(&self, call: &Call, buf: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream.clone_dtoh(buf).map_err(|e| call.failed("copying from the GPU", e))
    }

    /// Waits, until the call's deadline, for everything enqueued on the stream. A timeout
    /// aborts the communicators (an enqueued NCCL operation cannot be cancelled).
    fn wait(&mut self, call: &Call) -> Result<()> {
        let event =
            self.stream.record_event(None).map_err(|e| call.failed("recording an event", e))?;
        let mut polls = 0u32;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(call.failed("waiting for the GPU", e)),
            }
            if call.deadline.is_some_and(|d| Instant::now() >= d) {
                let others: Vec<usize> =
                    call.group.ranks().iter().copied().filter(|&r| r != self.rank).collect();
                let err = CommError::Timeout {
                    rank: self.rank,
                    kind: call.kind,
                    group: call.group.ranks().to_vec(),
                    timeout: call.timeout,
                    missing: others,
                    detail: "NCCL cannot tell which of these members did not arrive (or is in \
                             another call); the pending NCCL operation cannot be cancelled, so \
                             every communicator of this rank was aborted: end the rank"
                        .into(),
                };
                self.abort(err.to_string());
                return Err(err);
            }
            polls = polls.saturating_add(1);
            if polls < 64 {
                std::hint::spin_loop();
            } else if polls < 1024 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Every member's `data` (same length, not empty), concatenated in member order, over the
    /// call's group communicator.
    fn gather_on<T: DeviceRepr + ValidAsZeroBits + NcclType>(
        &mut self,
        call: &Call,
        data: &[T],
    ) -> Result<Vec<T>> {
        let send = self.upload(call, data)?;
        let mut recv = self.zeros::<T>(call, data.len() * call.group.len())?;
        self.comm_of(call)?
            .all_gather(&send, &mut recv)
            .map_err(|e| call.nccl("ncclAllGather", e))?;
        self.wait(call)?;
        self.download(call, &recv)
    }

    /// Chunk k of `data` to member k; member k's chunk for us lands at chunk k (our own is
    /// copied on the host).
    fn all_to_all_on(&mut self, call: &Call, me: usize, data: &[f32]) -> Result<Vec<f32>> {
        let n = call.group.len();
        let c = data.len() / n;
        let mut out = vec![0.0f32; data.len()];
        out[me * c..(me + 1) * c].copy_from_slice(&data[me * c..(me + 1) * c]);
        if n == 1 || c == 0 {
            return Ok(out);
        }
        let send = self.upload(call, data)?;
        let mut recv = self.zeros::<f32>(call, data.len())?;
        let comm = self.comm_of(call)?;
        grouped(call, || {
            for k in (0..n).filter(|&k| k != me) {
                let peer = k as i32;
                comm.send(&send.slice(k * c..(k + 1) * c), peer)
                    .map_err(|e| call.nccl("ncclSend", e))?;
                comm.recv(&mut recv.slice_mut(k * c..(k + 1) * c), peer)
                    .map_err(|e| call.nccl("ncclRecv", e))?;
            }
            Ok(())
        })?;
        self.wait(call)?;
        let got = self.download(call, &recv)?;
        for k in (0..n).filter(|&k| k != me) {
            out[k * c..(k + 1) * c].copy_from_slice(&got[k * c..(k + 1) * c]);
        }
        Ok(out)
    }

    /// Makes the call's group communicator at its first call (see the module docs).
    fn ensure_comm(&mut self, call: &Call) -> Result<()> {
        let group = &call.group;
        let comms = self.comms(call)?;
        if group.len() == self.world_size || comms.groups.contains_key(group) {
            return Ok(());
        }
        let me = group.index_of(self.rank).ok_or_else(|| call.failed("set-up", "not a member"))?;
        let leader = group.ranks()[0];
        let fp = fingerprint(group);
        let id = if group.len() == 1 {
            new_id()?.to_vec()
        } else if self.rank == leader {
            let mut msg = new_id()?.to_vec();
            msg.extend_from_slice(&fp.to_le_bytes());
            let buf = self.upload(call, &msg)?;
            let world = &self.comms(call)?.world;
            grouped(call, || {
                for &r in &group.ranks()[1..] {
                    world.send(&buf, r as i32).map_err(|e| call.nccl("ncclSend (group id)", e))?;
                }
                Ok(())
            })?;
            self.wait(call)?;
            msg.truncate(ID_BYTES);
            msg
        } else {
            let mut buf = self.zeros::<u8>(call, SETUP_BYTES)?;
            let world = &self.comms(call)?.world;
            grouped(call, || {
                world
                    .recv(&mut buf, leader as i32)
                    .map(drop)
                    .map_err(|e| call.nccl("ncclRecv (group id)", e))
            })?;
            self.wait(call)?;
            let mut msg = self.download(call, &buf)?;
            let mut theirs = [0u8; 8];
            theirs.copy_from_slice(&msg[ID_BYTES..SETUP_BYTES]);
            if u64::from_le_bytes(theirs) != fp {
                // The members set up groups in different orders: they are out of step.
                let err = call.mismatch(format!(
                    "rank {leader} was setting up another group (fingerprint {:#x}) when rank {} \
                     set up group {group} (fingerprint {fp:#x}) for its first call",
                    u64::from_le_bytes(theirs),
                    self.rank
                ));
                self.abort(err.to_string());
                return Err(err);
            }
            msg.truncate(ID_BYTES);
            msg
        };
        self.gpu.ctx.bind_to_thread().map_err(|e| call.failed("binding the GPU's context", e))?;
        let comm = Comm::from_rank(self.stream.clone(), me, group.len(), id_from(&id))
            .map_err(|e| call.nccl("ncclCommInitRank (group)", e))?;
        if let Some(c) = self.comms.as_mut() {
            c.groups.insert(group.clone(), comm);
        }
        Ok(())
    }

    /// Set-up and signature exchange of one call; every member's signature once all agree.
    fn agree(&mut self, call: &Call, mine: Signature) -> Result<Vec<Signature>> {
        self.ensure_comm(call)?;
        let words = self.gather_on::<u64>(call, &mine.encode())?;
        agree(self.rank, call.group.ranks(), &mine, &words).map_err(|d| match d {
            Disagreement::Mismatch(detail) => call.mismatch(detail),
            Disagreement::Undecodable => {
                call.failed("decoding the call signatures", format!("{words:?}"))
            }
        })
    }

    /// A collective whose data phase is an all-gather (all-reduce sums it on the host).
    fn gather_call(
        &mut self,
        kind: CollectiveKind,
        group: &Group,
        data: &[f32],
    ) -> Result<Vec<f32>> {
        self.member_index(kind, group)?;
        let call = self.open(kind, group)?;
        let out = self.guard(|c| {
            c.agree(&call, Signature { kind, seq: call.seq, len: data.len(), root: None })?;
            if data.is_empty() {
                return Ok(Vec::new());
            }
            let all = c.gather_on::<f32>(&call, data)?;
            Ok(match kind {
                CollectiveKind::AllReduce => sum_chunks(&all, group.len()),
                _ => all,
            })
        })?;
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(out)
    }

    /// A collective whose data phase is an all-to-all (reduce-scatter sums it on the host).
    fn exchange_call(
        &mut self,
        kind: CollectiveKind,
        group: &Group,
        data: &[f32],
    ) -> Result<Vec<f32>> {
        let me = self.member_index(kind, group)?;
        self.chunk_len(kind, group, data.len())?;
        let call = self.open(kind, group)?;
        let out = self.guard(|c| {
            c.agree(&call, Signature { kind, seq: call.seq, len: data.len(), root: None })?;
            if data.is_empty() {
                return Ok(Vec::new());
            }
            let received = c.all_to_all_on(&call, me, data)?;
            Ok(match kind {
                CollectiveKind::ReduceScatter => sum_chunks(&received, group.len()),
                _ => received,
            })
        })?;
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(out)
    }

    /// Sends one message (header, then payload) to another rank on the message communicator,
    /// waiting until it has been received.
    fn send_remote(&mut self, call: &Call, to: usize, tag: u32, data: &[f32]) -> Result<()> {
        let header = self.upload(call, &[data.len() as u64, u64::from(tag)])?;
        let payload = if data.is_empty() { None } else { Some(self.upload(call, data)?) };
        let p2p = &self.comms(call)?.p2p;
        grouped(call, || {
            p2p.send(&header, to as i32).map_err(|e| call.nccl("ncclSend (header)", e))?;
            if let Some(p) = &payload {
                p2p.send(p, to as i32).map_err(|e| call.nccl("ncclSend", e))?;
            }
            Ok(())
        })?;
        self.wait(call)
    }

    /// Receives the next message from `from` (any tag): its tag and payload.
    fn recv_remote(&mut self, call: &Call, from: usize) -> Result<(u32, Vec<f32>)> {
        let mut header = self.zeros::<u64>(call, 2)?;
        let p2p = &self.comms(call)?.p2p;
        grouped(call, || {
            p2p.recv(&mut header, from as i32)
                .map(drop)
                .map_err(|e| call.nccl("ncclRecv (header)", e))
        })?;
        self.wait(call)?;
        let head = self.download(call, &header)?;
        let (len, tag) = match head[..] {
            [len, tag] => (usize::try_from(len), u32::try_from(tag)),
            _ => return Err(call.failed("reading a message header", format!("{head:?}"))),
        };
        let (Ok(len), Ok(tag)) = (len, tag) else {
            return Err(call.failed("reading a message header", format!("{head:?}")));
        };
        if len == 0 {
            return Ok((tag, Vec::new()));
        }
        let mut payload = self.zeros::<f32>(call, len)?;
        let p2p = &self.comms(call)?.p2p;
        grouped(call, || {
            p2p.recv(&mut payload, from as i32).map(drop).map_err(|e| call.nccl("ncclRecv", e))
        })?;
        self.wait(call)?;
        Ok((tag, self.download(call, &payload)?))
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        self.gather_call(CollectiveKind::AllReduce, group, data)
    }

    fn all_gather(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        self.gather_call(CollectiveKind::AllGather, group, data)
    }

    fn reduce_scatter_sum(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        self.exchange_call(CollectiveKind::ReduceScatter, group, data)
    }

    fn all_to_all(&mut self, group: &Group, data: &[f32]) -> Result<Vec<f32>> {
        self.exchange_call(CollectiveKind::AllToAll, group, data)
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
        let call = self.open(kind, group)?;
        let out = self.guard(|c| {
            let mine = Signature { kind, seq: call.seq, len: data.len(), root: Some(root) };
            let sigs = c.agree(&call, mine)?;
            // Non-roots learn the length from the root's signature; their input is ignored.
            let len = sigs.get(root_idx).map_or(0, |s| s.len);
            if len == 0 {
                return Ok(Vec::new());
            }
            let mut buf =
                if idx == root_idx { c.upload(&call, data)? } else { c.zeros(&call, len)? };
            c.comm_of(&call)?
                .broadcast_in_place(&mut buf, root_idx as i32)
                .map_err(|e| call.nccl("ncclBroadcast", e))?;
            c.wait(&call)?;
            c.download(&call, &buf)
        })?;
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
        self.check_peer(kind, to, tag)?;
        let call = self.open_p2p(kind, to)?;
        if to == self.rank {
            self.to_self.entry(tag).or_default().push_back(data.to_vec());
        } else {
            self.guard(|c| c.send_remote(&call, to, tag, data))?;
        }
        self.stats.record(kind, f32_bytes(data.len()));
        Ok(())
    }

    fn recv_tagged(&mut self, from: usize, tag: u32) -> Result<Vec<f32>> {
        let kind = CollectiveKind::Recv;
        self.check_peer(kind, from, tag)?;
        let call = self.open_p2p(kind, from)?;
        let kept = |q: Option<&mut VecDeque<Vec<f32>>>| q.and_then(|q| q.pop_front());
        let msg = if from == self.rank {
            kept(self.to_self.get_mut(&tag)).ok_or_else(|| {
                CommError::InvalidArgument(format!(
                    "rank {from}: recv from itself (tag {tag}) with no message queued would wait \
                     forever"
                ))
            })?
        } else if let Some(msg) = kept(self.inbox.get_mut(&(from, tag))) {
            msg
        } else {
            self.guard(|c| loop {
                let (got, msg) = c.recv_remote(&call, from)?;
                if got == tag {
                    return Ok(msg);
                }
                // Another tag's stream: keep it for its own receive.
                c.inbox.entry((from, got)).or_default().push_back(msg);
            })?
        };
        self.stats.record(kind, f32_bytes(msg.len()));
        Ok(msg)
    }

    fn barrier(&mut self, group: &Group) -> Result<()> {
        let kind = CollectiveKind::Barrier;
        self.member_index(kind, group)?;
        let call = self.open(kind, group)?;
        // The signature all-gather completes only once every member has entered the call.
        let sig = Signature { kind, seq: call.seq, len: 0, root: None };
        self.guard(|c| c.agree(&call, sig).map(drop))?;
        self.stats.record(kind, 0);
        Ok(())
    }

    fn stats(&self) -> CommStats {
        self.stats.clone()
    }
}
