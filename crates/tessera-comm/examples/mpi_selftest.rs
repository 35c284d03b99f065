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

use std::io::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tessera_comm::conformance::{check_all, Res};
use tessera_comm::{CommError, Communicator, Group, MpiComm};

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
