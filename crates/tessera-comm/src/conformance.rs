//! One conformance suite for every transport: what any [`Communicator`] must do, checked
//! from one rank's side with nothing but the trait. Every rank of a world runs [`check_all`]
//! at once (threads: `tests/thread_backend.rs`; processes under `mpirun`: the `mpi_selftest`
//! example, which `tests/mpi_backend.rs` runs), so the thread and MPI backends — and any later
//! transport (NCCL) — answer to the same checks:
//!
//! - every collective on the world and on the rows and columns of a `[2, N/2]` mesh
//!   (interleaved, so per-group set-up and call numbering are exercised), each result compared
//!   bit for bit with a reference computed locally from every member's input (inputs are a
//!   pure function of rank and call), all-reduce results all-gathered again to check every
//!   member got the same bits; the layout-aware variants; a broadcast from every member;
//! - a send/recv ring (FIFO, empty and large messages, both neighbours sending before
//!   receiving) and tagged streams (received in another order than sent, FIFO per tag);
//! - argument errors (local, counted nowhere, not desynchronising the group) and a mismatched
//!   call (every member fails naming both sides, and the group stays usable);
//! - the traffic counters, which must equal what the calls moved.

use std::error::Error;

use crate::communicator::ChunkLayout;
use crate::{CollectiveKind, CommError, CommStats, Communicator, Group, MAX_TAG};

/// A check's outcome: what differed, in words.
pub type Res<T = ()> = Result<T, Box<dyn Error>>;

/// Fails the check with a message naming what differed.
macro_rules! check {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+).into());
        }
    };
}

/// A deterministic input of `len` elements for `rank`, distinct per `salt`, with magnitudes from
/// 1e-3 to 1e3 so that the order of a sum changes its rounding.
pub fn input(rank: usize, len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let h = (rank * 7919 + i * 104_729 + salt * 1_299_709) % 10_007;
            let scale = [1e-3f32, 1.0, 1e3][(rank + i + salt) % 3];
            let sign = if (h + i).is_multiple_of(2) { 1.0 } else { -1.0 };
            sign * (h as f32 + 0.5) * scale * 0.1
        })
        .collect()
}

/// Element-wise sum in group order, starting from zero: the reference for reductions.
pub fn reference_sum(members: &[usize], len: usize, salt: usize) -> Vec<f32> {
    let mut acc = vec![0.0f32; len];
    for &m in members {
        for (a, x) in acc.iter_mut().zip(input(m, len, salt)) {
            *a += x;
        }
    }
    acc
}

/// Every element's bit pattern (results are compared bit for bit).
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bytes(len: usize) -> u64 {
    len as u64 * 4
}

/// Every collective once on `group`, checked against local references. `expected` counts what
/// the communicator should count.
pub fn check_group(
    comm: &mut dyn Communicator,
    expected: &mut CommStats,
    group: &Group,
    salt: usize,
) -> Res {
    let me = comm.rank();
    let members = group.ranks();
    let n = group.len();
    let idx = group.index_of(me).ok_or("the group does not contain this rank")?;

    // All-reduce of an odd length, then the same bits on every member.
    let len = 5;
    let got = comm.all_reduce_sum(group, &input(me, len, salt))?;
    expected.record(CollectiveKind::AllReduce, bytes(len));
    let want = reference_sum(members, len, salt);
    check!(bits(&got) == bits(&want), "all_reduce over {group}: got {got:?}, want {want:?}");
    let everyone = comm.all_gather(group, &got)?;
    expected.record(CollectiveKind::AllGather, bytes(len));
    for (k, theirs) in everyone.chunks_exact(len).enumerate() {
        check!(
            bits(theirs) == bits(&got),
            "all_reduce over {group}: member {k} got {theirs:?} but this rank got {got:?}"
        );
    }

    let empty = comm.all_reduce_sum(group, &[])?;
    expected.record(CollectiveKind::AllReduce, 0);
    check!(empty.is_empty(), "empty all_reduce over {group} returned {empty:?}");

    let got = comm.all_gather(group, &input(me, 3, salt + 1))?;
    expected.record(CollectiveKind::AllGather, bytes(3));
    let want: Vec<f32> = members.iter().flat_map(|&m| input(m, 3, salt + 1)).collect();
    check!(bits(&got) == bits(&want), "all_gather over {group}: got {got:?}, want {want:?}");

    let chunk = 3;
    let got = comm.reduce_scatter_sum(group, &input(me, chunk * n, salt + 2))?;
    expected.record(CollectiveKind::ReduceScatter, bytes(chunk * n));
    let want = reference_sum(members, chunk * n, salt + 2)[idx * chunk..(idx + 1) * chunk].to_vec();
    check!(bits(&got) == bits(&want), "reduce_scatter over {group}: got {got:?}, want {want:?}");

    let chunk = 2;
    let got = comm.all_to_all(group, &input(me, chunk * n, salt + 3))?;
    expected.record(CollectiveKind::AllToAll, bytes(chunk * n));
    let want: Vec<f32> = members
        .iter()
        .flat_map(|&m| input(m, chunk * n, salt + 3)[idx * chunk..(idx + 1) * chunk].to_vec())
        .collect();
    check!(bits(&got) == bits(&want), "all_to_all over {group}: got {got:?}, want {want:?}");

    // The layout-aware variants (the trait's default implementations, around the calls above):
    // chunks of 4 in 2 interleaved blocks of 2, member k's block b at (b·n + k)·2.
    let (chunk, inner) = (4, 2);
    let at = |k: usize, j: usize| (j / inner * n + k) * inner + j % inner;
    let layout = ChunkLayout::interleaved(chunk / inner);
    let got = comm.reduce_scatter_sum_strided(group, &input(me, chunk * n, salt + 5), layout)?;
    expected.record(CollectiveKind::ReduceScatter, bytes(chunk * n));
    let sum = reference_sum(members, chunk * n, salt + 5);
    let want: Vec<f32> = (0..chunk).map(|j| sum[at(idx, j)]).collect();
    check!(bits(&got) == bits(&want), "strided reduce_scatter over {group}: got {got:?}");
    let contiguous = ChunkLayout::CONTIGUOUS;
    let data = input(me, chunk * n, salt + 6);
    let got = comm.all_to_all_strided(group, &data, layout, contiguous)?;
    expected.record(CollectiveKind::AllToAll, bytes(chunk * n));
    let want: Vec<f32> = members
        .iter()
        .flat_map(|&m| (0..chunk).map(move |j| input(m, chunk * n, salt + 6)[at(idx, j)]))
        .collect();
    check!(bits(&got) == bits(&want), "strided all_to_all over {group}: got {got:?}");
    let mut buf = vec![f32::NAN; chunk * n];
    for (j, x) in input(me, chunk, salt + 7).into_iter().enumerate() {
        buf[at(idx, j)] = x;
    }
    comm.all_gather_in_place(group, &mut buf, chunk, layout)?;
    expected.record(CollectiveKind::AllGather, bytes(chunk));
    let mut want = vec![0.0; chunk * n];
    for (k, &m) in members.iter().enumerate() {
        for (j, x) in input(m, chunk, salt + 7).into_iter().enumerate() {
            want[at(k, j)] = x;
        }
    }
    check!(bits(&buf) == bits(&want), "in-place all_gather over {group}: got {buf:?}");

    // A broadcast from every member; non-roots pass nothing (their input is ignored).
    for &root in members {
        let data = if root == me { input(root, 4, salt + 4 + root) } else { Vec::new() };
        let got = comm.broadcast(group, root, &data)?;
        expected.record(CollectiveKind::Broadcast, bytes(data.len()));
        let want = input(root, 4, salt + 4 + root);
        check!(
            bits(&got) == bits(&want),
            "broadcast from {root} over {group}: got {got:?}, want {want:?}"
        );
    }

    comm.barrier(group)?;
    expected.record(CollectiveKind::Barrier, 0);
    Ok(())
}

/// Messages around the ring, to self, empty and large (above any eager limit, so the send can
/// only complete once the receiver takes it: a blocking send would deadlock here, since every
/// rank sends before it receives).
fn check_send_recv(comm: &mut dyn Communicator, expected: &mut CommStats) -> Res {
    let (me, n) = (comm.rank(), comm.world_size());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let sizes = [6, 0, 1 << 18, 2];
    for (i, &len) in sizes.iter().enumerate() {
        comm.send(next, &input(me, len, 50 + i))?;
        expected.record(CollectiveKind::Send, bytes(len));
    }
    for (i, &len) in sizes.iter().enumerate() {
        let got = comm.recv(prev)?;
        expected.record(CollectiveKind::Recv, bytes(len));
        check!(
            bits(&got) == bits(&input(prev, len, 50 + i)),
            "message {i} from rank {prev}: got {} elements, want {len} (FIFO order per pair)",
            got.len()
        );
    }
    comm.send(me, &[1.0, 2.0, 3.0])?;
    expected.record(CollectiveKind::Send, bytes(3));
    let got = comm.recv(me)?;
    expected.record(CollectiveKind::Recv, bytes(3));
    check!(got == [1.0, 2.0, 3.0], "message to self: got {got:?}");
    Ok(())
}

/// Tagged streams between ring neighbours: each rank sends on tags 5, 0 (through `send`) and
/// `MAX_TAG`, interleaved, a large message among them, and receives them tag by tag in another
/// order, so every receive passes older messages of other tags (still queued, the large one
/// unfinished on its sender).
fn check_tagged(comm: &mut dyn Communicator, expected: &mut CommStats) -> Res {
    let (me, n) = (comm.rank(), comm.world_size());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let tags = [5, 0, MAX_TAG];
    let len = |msg: usize, t: usize| if msg == 1 && t == 0 { 1 << 18 } else { msg + t + 1 };
    for msg in 0..3 {
        for (t, &tag) in tags.iter().enumerate() {
            let data = input(me, len(msg, t), 70 + 3 * t + msg);
            if tag == 0 {
                comm.send(next, &data)?;
            } else {
                comm.send_tagged(next, tag, &data)?;
            }
            expected.record(CollectiveKind::Send, bytes(data.len()));
        }
    }
    for (t, &tag) in tags.iter().enumerate().rev() {
        for msg in 0..3 {
            let got = comm.recv_tagged(prev, tag)?;
            let want = input(prev, len(msg, t), 70 + 3 * t + msg);
            expected.record(CollectiveKind::Recv, bytes(want.len()));
            check!(
                bits(&got) == bits(&want),
                "message {msg} on tag {tag} from rank {prev}: got {} elements, want {} (FIFO \
                 order per tag, tags independent)",
                got.len(),
                want.len()
            );
        }
    }
    // To self, two tags, received in the opposite order.
    comm.send_tagged(me, 9, &[9.0])?;
    comm.send_tagged(me, 8, &[8.0])?;
    let (eight, nine) = (comm.recv_tagged(me, 8)?, comm.recv_tagged(me, 9)?);
    for (tag, got) in [(8, eight), (9, nine)] {
        expected.record(CollectiveKind::Send, bytes(1));
        expected.record(CollectiveKind::Recv, bytes(1));
        check!(got == [tag as f32], "message to self on tag {tag}: got {got:?}");
    }
    Ok(())
}

/// Calls that must fail; none of them may count or communicate.
fn check_errors(comm: &mut dyn Communicator, expected: &mut CommStats) -> Res {
    let (me, n) = (comm.rank(), comm.world_size());
    let world = Group::world(n)?;
    let outside = Group::new([me, n])?;
    check!(
        matches!(comm.all_reduce_sum(&outside, &[1.0]), Err(CommError::InvalidGroup(_))),
        "a group naming rank {n} in a world of {n} must be InvalidGroup"
    );
    if n > 1 {
        let others = Group::new([(me + 1) % n])?;
        check!(
            matches!(comm.barrier(&others), Err(CommError::InvalidGroup(_))),
            "a group without the caller must be InvalidGroup"
        );
        let lone = Group::new([me])?;
        check!(
            matches!(comm.broadcast(&lone, (me + 1) % n, &[]), Err(CommError::InvalidArgument(_))),
            "a broadcast root outside the group must be InvalidArgument"
        );
        check!(
            matches!(
                comm.reduce_scatter_sum(&world, &vec![0.0; n + 1]),
                Err(CommError::InvalidArgument(_))
            ),
            "a reduce_scatter length not divisible by the group size must be InvalidArgument"
        );
        check!(
            matches!(
                comm.all_to_all(&world, &vec![0.0; n + 1]),
                Err(CommError::InvalidArgument(_))
            ),
            "an all_to_all length not divisible by the group size must be InvalidArgument"
        );
    }
    check!(
        matches!(comm.send(n, &[1.0]), Err(CommError::InvalidArgument(_))),
        "a send to rank {n} must be InvalidArgument"
    );
    check!(
        matches!(comm.recv(me), Err(CommError::InvalidArgument(_))),
        "a recv from self with nothing queued must be InvalidArgument"
    );
    let big = MAX_TAG + 1;
    for (what, result) in [
        ("send", comm.send_tagged((me + 1) % n, big, &[1.0])),
        ("recv", comm.recv_tagged((me + n - 1) % n, big).map(drop)),
    ] {
        match result {
            Err(CommError::InvalidArgument(msg)) => check!(
                msg.contains(&format!("tag {big}")) && msg.contains(&MAX_TAG.to_string()),
                "the refused {what} with tag {big} should name the tag and the limit: {msg}"
            ),
            other => {
                return Err(format!("a {what} with tag {big} must be refused, got {other:?}").into())
            }
        }
    }

    // A mismatched call: every member fails with Mismatch, and the group stays usable.
    if n > 1 {
        let len = if me == 0 { 1 } else { 2 };
        match comm.all_gather(&world, &vec![0.0; len]) {
            Err(e @ CommError::Mismatch { .. }) => {
                let msg = e.to_string();
                check!(
                    msg.contains("all_gather with 1 elements") && msg.contains("with 2 elements"),
                    "the mismatch error should name both sides: {msg}"
                );
            }
            other => {
                return Err(format!("a length mismatch must be Mismatch, got {other:?}").into())
            }
        }
        comm.barrier(&world)?;
        expected.record(CollectiveKind::Barrier, 0);
    }
    Ok(())
}

pub fn check_all(comm: &mut dyn Communicator) -> Res {
    let (me, n) = (comm.rank(), comm.world_size());
    let mut expected = CommStats::default();
    let world = Group::world(n)?;
    let shape = if n.is_multiple_of(2) { vec![2, n / 2] } else { vec![1, n] };
    let row = Group::mesh_axis(&shape, 1, me)?;
    let column = Group::mesh_axis(&shape, 0, me)?;
    // Rows and columns interleaved, each used twice: set-up happens on first use, in an order
    // that differs between groups, and later calls reuse the cached communicators.
    for (i, group) in [&world, &row, &column, &row, &world, &column].into_iter().enumerate() {
        check_group(comm, &mut expected, group, 10 * i)
            .map_err(|e| format!("collectives over {group} (round {i}): {e}"))?;
    }
    check_send_recv(comm, &mut expected).map_err(|e| format!("send/recv: {e}"))?;
    check_tagged(comm, &mut expected).map_err(|e| format!("tagged send/recv: {e}"))?;
    check_errors(comm, &mut expected).map_err(|e| format!("error cases: {e}"))?;
    let stats = comm.stats();
    check!(stats == expected, "stats {stats:?}, want {expected:?}");
    comm.barrier(&world)?;
    Ok(())
}
