//! Self-test of the MPI backend, one process per rank: `mpirun -n N mpi_selftest [MODE]`.
//!
//! `tests/mpi_backend.rs` runs it under `mpirun`; it can also be run by hand after
//! `cargo build -p tessera-comm --features mpi --example mpi_selftest`.
//!
//! Modes:
//! - `check` (default): every collective on the world and on the rows and columns of a
//!   `[2, N/2]` mesh (interleaved, so cached sub-communicators and per-group call numbers are
//!   exercised), each result compared bit for bit with a reference computed locally from every
//!   member's input (inputs are a pure function of rank and call); all-reduce results are
//!   all-gathered again to check every member got the same bits. Then a send/recv ring (FIFO,
//!   empty and large messages, both neighbours sending before receiving), tagged streams
//!   (received in another order than sent, FIFO per tag, tag 0 being send/recv's), a mismatched
//!   call, argument errors (a tag above `MAX_TAG` among them), and the traffic counters. Each rank prints `rank R of N: ok` and exits 0,
//!   or prints what failed and ends the whole job with a non-zero status.
//! - `stuck`: rank 0 calls an all-reduce over the world with a 3 s timeout while every other
//!   rank leaves without calling it; rank 0 must report the timeout and end the job.
//! - `stuck-group`: the same over the group `[0, 1]` (needs 3 or more ranks, so the group is a
//!   sub-communicator still being set up): the timeout must name rank 1 as missing.
//! - `stall R`: a few calls on the world and on the mesh columns, then rank R sleeps while every
//!   other rank calls an all-reduce on the world with a 2 s timeout; each of them must fail
//!   with a timeout naming rank R alone, print it, and (after a second, so that all of them
//!   print) end the job.
//! - `tag-timeout`: rank 1 sends rank 0 a message on tag 3; rank 0 receives on tag 7 (3 s
//!   timeout), which must time out naming rank 1 and tag 7 (printed as `rank 0 timed out: ...`),
//!   then receives the tag-3 message (a recv timeout leaves the rank usable) and acknowledges it
//!   on tag 1, which rank 1 waits for (retrying its own recv's timeouts); both end `ok`.
//! - `many K`: K one-element all-reduces alternating between the world and the mesh columns,
//!   checking after each that the backend's own traffic (`MpiComm::backlog`) stays bounded;
//!   prints the time taken and ends like `check` (the finalisation must be clean).

use std::error::Error;
use std::io::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tessera_comm::communicator::ChunkLayout;
use tessera_comm::{CollectiveKind, CommError, CommStats, Communicator, Group, MpiComm, MAX_TAG};

type Res<T = ()> = Result<T, Box<dyn Error>>;

/// Fails the check with a message naming what differed.
macro_rules! check {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+).into());
        }
    };
}

/// Generous: a correctness run never waits this long unless something is broken.
const CHECK_TIMEOUT: Duration = Duration::from_secs(60);
/// Short, so that the failure modes end quickly.
const STUCK_TIMEOUT: Duration = Duration::from_secs(3);
/// Shorter still for `stall`, whose ranks are in step when the stall begins.
const STALL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long `stall`'s ranks wait after their error before aborting, so that every one of them
/// prints its error before the first abort ends the job.
const STALL_GRACE: Duration = Duration::from_secs(1);

/// A deterministic input of `len` elements for `rank`, distinct per `salt`, with magnitudes from
/// 1e-3 to 1e3 so that the order of a sum changes its rounding (same as the thread tests).
fn input(rank: usize, len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let h = (rank * 7919 + i * 104_729 + salt * 1_299_709) % 10_007;
            let scale = [1e-3f32, 1.0, 1e3][(rank + i + salt) % 3];
            let sign = if (h + i).is_multiple_of(2) { 1.0 } else { -1.0 };
            sign * (h as f32 + 0.5) * scale * 0.1
        })
        .collect()
}

/// Element-wise sum in group order: the reference for reductions.
fn reference_sum(members: &[usize], len: usize, salt: usize) -> Vec<f32> {
    let mut acc = vec![0.0f32; len];
    for &m in members {
        for (a, x) in acc.iter_mut().zip(input(m, len, salt)) {
            *a += x;
        }
    }
    acc
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bytes(len: usize) -> u64 {
    len as u64 * 4
}

/// Every collective once on `group`, checked against local references. `expected` counts what
/// the communicator should count.
fn check_group(comm: &mut MpiComm, expected: &mut CommStats, group: &Group, salt: usize) -> Res {
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
fn check_send_recv(comm: &mut MpiComm, expected: &mut CommStats) -> Res {
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
fn check_tagged(comm: &mut MpiComm, expected: &mut CommStats) -> Res {
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
fn check_errors(comm: &mut MpiComm, expected: &mut CommStats) -> Res {
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

fn check_all(comm: &mut MpiComm) -> Res {
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

/// Rank 0 calls a collective the others never call; returns the error rank 0 got (other ranks
/// return at once).
fn stuck(comm: &mut MpiComm, group: &Group) -> Res {
    if comm.rank() != 0 {
        return Ok(());
    }
    match comm.all_reduce_sum(group, &[1.0, 2.0]) {
        Ok(v) => Err(format!("the all_reduce should have timed out, returned {v:?}").into()),
        Err(e) => Err(e.into()),
    }
}

/// Rank 0 receives on a tag rank 1 never sends on (see the module docs); needs 2 ranks.
fn tag_timeout(comm: &mut MpiComm) -> Res {
    check!(comm.world_size() == 2, "tag-timeout needs exactly 2 ranks");
    if comm.rank() == 1 {
        comm.send_tagged(0, 3, &[3.0, 1.0])?;
        // Rank 0 acknowledges only after its own timeout: retry ours until it does.
        for _ in 0..10 {
            match comm.recv_tagged(0, 1) {
                Ok(ack) => {
                    check!(ack == [1.0], "acknowledgement {ack:?}");
                    return Ok(());
                }
                Err(CommError::Timeout { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        return Err("rank 0 never acknowledged".into());
    }
    match comm.recv_tagged(1, 7) {
        Err(e @ CommError::Timeout { .. }) => println!("mpi_selftest: rank 0 timed out: {e}"),
        other => return Err(format!("the recv on tag 7 should time out, got {other:?}").into()),
    }
    let three = comm.recv_tagged(1, 3)?;
    check!(three == [3.0, 1.0], "message on tag 3: {three:?}");
    comm.send_tagged(1, 1, &[1.0])?;
    Ok(())
}

/// The world and this rank's column of a `[2, N/2]` mesh (the world too when N is 2).
fn world_and_column(comm: &MpiComm) -> Res<(Group, Group)> {
    let (me, n) = (comm.rank(), comm.world_size());
    let shape = if n.is_multiple_of(2) { vec![2, n / 2] } else { vec![1, n] };
    Ok((Group::world(n)?, Group::mesh_axis(&shape, 0, me)?))
}

/// `iterations` one-element all-reduces, alternating between the world and the column; the
/// backend's own traffic (sends in flight, announcements not yet received) must stay within a
/// few per member throughout, then drain before finalising (checked by the test: no warning).
fn many(comm: &mut MpiComm, iterations: usize) -> Res {
    let (me, n) = (comm.rank(), comm.world_size());
    let (world, column) = world_and_column(comm)?;
    // Per group, each other member has at most this call and the next one outstanding.
    let bound = 2 * (n - 1) + 2 * (column.len() - 1);
    let (mut most_sends, mut most_unheard) = (0, 0);
    let start = Instant::now();
    for i in 0..iterations {
        let group = if i % 2 == 0 { &world } else { &column };
        let got = comm.all_reduce_sum(group, &[1.0])?;
        check!(got == [group.len() as f32], "call {i} over {group}: got {got:?}");
        let backlog = comm.backlog();
        most_sends = most_sends.max(backlog.sends_in_flight);
        most_unheard = most_unheard.max(backlog.announcements_unheard);
        check!(
            backlog.sends_in_flight <= bound && backlog.announcements_unheard <= bound as u64,
            "after call {i} over {group} the backlog is {backlog:?}, over {bound}: messages are \
             accumulating"
        );
    }
    let elapsed = start.elapsed();
    comm.barrier(&world)?;
    println!(
        "mpi_selftest: rank {me}: {iterations} all_reduces in {elapsed:?}, at most \
         {most_sends} sends in flight and {most_unheard} announcements unheard"
    );
    Ok(())
}

/// Every rank but `stalled` calls an all-reduce on the world after some calls on the world and
/// the column, while `stalled` sleeps (never calling it); returns the error each other rank
/// got, which must name `stalled` alone. `stalled` returns after a while (the job should have
/// been aborted by then).
fn stall(comm: &mut MpiComm, stalled: usize) -> Res {
    let (world, column) = world_and_column(comm)?;
    check!(stalled < comm.world_size(), "no rank {stalled} to stall");
    for _ in 0..3 {
        comm.all_reduce_sum(&world, &[1.0])?;
        comm.all_reduce_sum(&column, &[1.0])?;
    }
    comm.barrier(&world)?;
    if comm.rank() == stalled {
        std::thread::sleep(10 * STALL_TIMEOUT);
        return Err("the stalled rank was not ended by its peers' abort".into());
    }
    match comm.all_reduce_sum(&world, &[1.0]) {
        Ok(v) => Err(format!("the all_reduce should have timed out, returned {v:?}").into()),
        Err(CommError::Timeout { missing, .. }) if missing != [stalled] => {
            Err(format!("the timeout names ranks {missing:?}, not rank {stalled} alone").into())
        }
        Err(e) => Err(e.into()),
    }
}

fn main() -> ExitCode {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "check".to_string());
    let timeout = match mode.as_str() {
        "check" | "many" => CHECK_TIMEOUT,
        "stall" => STALL_TIMEOUT,
        _ => STUCK_TIMEOUT,
    };
    let mut comm = match MpiComm::init(timeout) {
        Ok(comm) => comm,
        Err(e) => {
            eprintln!("mpi_selftest: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (me, n) = (comm.rank(), comm.world_size());
    let result = match mode.as_str() {
        "check" => check_all(&mut comm),
        "many" => match std::env::args().nth(2).map(|a| a.parse::<usize>()) {
            Some(Ok(iterations)) => many(&mut comm, iterations),
            _ => Err("many needs a number of iterations".into()),
        },
        "stall" => match std::env::args().nth(2).map(|a| a.parse::<usize>()) {
            Some(Ok(stalled)) => stall(&mut comm, stalled),
            _ => Err("stall needs the rank to stall".into()),
        },
        "tag-timeout" => tag_timeout(&mut comm),
        "stuck" => Group::world(n).map_err(Into::into).and_then(|g| stuck(&mut comm, &g)),
        "stuck-group" if n >= 3 => {
            Group::new([0, 1]).map_err(Into::into).and_then(|g| stuck(&mut comm, &g))
        }
        "stuck-group" => Err("stuck-group needs at least 3 ranks".into()),
        other => Err(format!(
            "unknown mode {other:?} (check, many, tag-timeout, stuck, stuck-group, stall)"
        )
        .into()),
    };
    match result {
        Ok(()) if matches!(mode.as_str(), "check" | "many" | "tag-timeout") => {
            println!("mpi_selftest: rank {me} of {n}: ok");
            ExitCode::SUCCESS
        }
        Ok(()) => {
            // Dropping the communicator finalises MPI, which waits for the other ranks: this
            // rank stays there until rank 0's abort ends the job.
            println!("mpi_selftest: rank {me} of {n}: leaving without calling the collective");
            ExitCode::SUCCESS
        }
        Err(e) => {
            // Other ranks may be blocked in MPI where no error reaches them: end the whole job.
            // One write, so that mpirun does not interleave it with other ranks' errors.
            let line = format!("mpi_selftest: rank {me} of {n}: FAILED: {e}\n");
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
            if mode == "stall" {
                std::thread::sleep(STALL_GRACE);
            }
            comm.abort(1)
        }
    }
}
