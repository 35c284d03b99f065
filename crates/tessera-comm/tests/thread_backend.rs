//! The thread backend against independent references: every collective's result is compared,
//! bit for bit, with a sequential computation done here from every member's input (which each
//! test can recompute, since inputs are a pure function of rank and call). Failure tests check
//! that timeouts, dead ranks and mismatched calls give clear errors in bounded time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tessera_comm::{
    conformance, run_on_threads, CollectiveKind, CommError, Communicator, Departure, Group,
    KindStats, ThreadComm,
};

/// Generous for correctness tests: nothing should ever wait this long.
const SLOW: Duration = Duration::from_secs(2);

// Inputs (a pure function of rank, length and call), the group-order sum and bit patterns are
// the conformance suite's, so these tests and it agree on what "the reference" is.
use tessera_comm::conformance::{bits, input, reference_sum};

/// Every result of one rank's run of [`all_collectives`].
#[derive(Debug, Clone, PartialEq)]
struct Outputs {
    group: Vec<usize>,
    all_reduce: Vec<f32>,
    all_reduce_odd: Vec<f32>,
    all_reduce_empty: Vec<f32>,
    all_gather: Vec<f32>,
    reduce_scatter: Vec<f32>,
    all_to_all: Vec<f32>,
    /// One broadcast per member as root, in group order.
    broadcasts: Vec<Vec<f32>>,
}

const CHUNK: usize = 3;

/// Runs every collective once over `group` (each with its own salt, so results cannot be
/// confused with one another).
fn all_collectives(c: &mut dyn Communicator, group: &Group) -> tessera_comm::Result<Outputs> {
    let r = c.rank();
    let g = group.len();
    let len = g * CHUNK;
    let all_reduce = c.all_reduce_sum(group, &input(r, len, 1))?;
    let all_reduce_odd = c.all_reduce_sum(group, &input(r, 7, 2))?;
    let all_reduce_empty = c.all_reduce_sum(group, &[])?;
    let all_gather = c.all_gather(group, &input(r, 5, 3))?;
    let reduce_scatter = c.reduce_scatter_sum(group, &input(r, len, 4))?;
    let all_to_all = c.all_to_all(group, &input(r, len, 5))?;
    c.barrier(group)?;
    let mut broadcasts = Vec::new();
    for (k, &root) in group.ranks().iter().enumerate() {
        // Non-roots pass garbage of another length: it must be ignored.
        let data = if r == root { input(r, 4, 6 + k) } else { vec![f32::NAN; r % 3] };
        broadcasts.push(c.broadcast(group, root, &data)?);
    }
    Ok(Outputs {
        group: group.ranks().to_vec(),
        all_reduce,
        all_reduce_odd,
        all_reduce_empty,
        all_gather,
        reduce_scatter,
        all_to_all,
        broadcasts,
    })
}

/// What rank `r` must get from [`all_collectives`] over `members`, computed sequentially.
fn expected_outputs(r: usize, members: &[usize]) -> Outputs {
    let g = members.len();
    let k = members.iter().position(|&m| m == r).expect("rank is a member");
    let len = g * CHUNK;
    Outputs {
        group: members.to_vec(),
        all_reduce: reference_sum(members, len, 1),
        all_reduce_odd: reference_sum(members, 7, 2),
        all_reduce_empty: Vec::new(),
        all_gather: members.iter().flat_map(|&m| input(m, 5, 3)).collect(),
        reduce_scatter: reference_sum(members, len, 4)[k * CHUNK..(k + 1) * CHUNK].to_vec(),
        all_to_all: members
            .iter()
            .flat_map(|&m| input(m, len, 5)[k * CHUNK..(k + 1) * CHUNK].to_vec())
            .collect(),
        broadcasts: members.iter().enumerate().map(|(j, &root)| input(root, 4, 6 + j)).collect(),
    }
}

fn assert_bitwise_eq(got: &Outputs, want: &Outputs, ctx: &str) {
    assert_eq!(got.group, want.group, "{ctx}: group");
    let pairs = [
        ("all_reduce", &got.all_reduce, &want.all_reduce),
        ("all_reduce_odd", &got.all_reduce_odd, &want.all_reduce_odd),
        ("all_reduce_empty", &got.all_reduce_empty, &want.all_reduce_empty),
        ("all_gather", &got.all_gather, &want.all_gather),
        ("reduce_scatter", &got.reduce_scatter, &want.reduce_scatter),
        ("all_to_all", &got.all_to_all, &want.all_to_all),
    ];
    for (name, g, w) in pairs {
        assert_eq!(bits(g), bits(w), "{ctx}: {name}: got {g:?}, want {w:?}");
    }
    assert_eq!(got.broadcasts.len(), want.broadcasts.len(), "{ctx}: broadcasts");
    for (j, (g, w)) in got.broadcasts.iter().zip(&want.broadcasts).enumerate() {
        assert_eq!(bits(g), bits(w), "{ctx}: broadcast from member {j}");
    }
}

/// The groups to test in a world of `n`: the world, and for n = 8 both axes of a [2, 4] mesh.
/// A rank's group, by rank.
type GroupOf = Box<dyn Fn(usize) -> Group + Sync>;

fn group_choices(n: usize) -> Vec<(String, GroupOf)> {
    let mut choices: Vec<(String, GroupOf)> =
        vec![("world".into(), Box::new(move |_| Group::world(n).expect("n > 0")))];
    if n == 8 {
        for axis in 0..2 {
            choices.push((
                format!("[2, 4] axis {axis}"),
                Box::new(move |r| Group::mesh_axis(&[2, 4], axis, r).expect("valid")),
            ));
        }
    }
    choices
}

#[test]
fn every_collective_matches_a_sequential_reference() {
    for n in [1, 2, 3, 4, 8] {
        for (name, group_of) in group_choices(n) {
            let results = run_on_threads(n, SLOW, |c| {
                let group = group_of(c.rank());
                all_collectives(c, &group)
            });
            assert_eq!(results.len(), n);
            for (r, res) in results.into_iter().enumerate() {
                let got = res.unwrap_or_else(|e| panic!("n={n}, {name}, rank {r}: {e}"));
                let want = expected_outputs(r, group_of(r).ranks());
                assert_bitwise_eq(&got, &want, &format!("n={n}, {name}, rank {r}"));
            }
        }
    }
}

#[test]
fn results_are_bit_identical_across_members_and_runs() {
    let run = || {
        run_on_threads(8, SLOW, |c| {
            // Stagger arrivals so members reach each call in different orders.
            std::thread::sleep(Duration::from_millis((7 - c.rank() as u64) * 3));
            let row = Group::mesh_axis(&[2, 4], 1, c.rank())?;
            let a = c.all_reduce_sum(&row, &input(c.rank(), 64, 9))?;
            let w = c.all_reduce_sum(&Group::world(8)?, &input(c.rank(), 64, 10))?;
            Ok((a, w))
        })
        .into_iter()
        .collect::<tessera_comm::Result<Vec<_>>>()
        .expect("all ranks succeed")
    };
    let first = run();
    for r in 0..8 {
        let row_leader = if r < 4 { 0 } else { 4 };
        assert_eq!(bits(&first[r].0), bits(&first[row_leader].0), "row sum, rank {r}");
        assert_eq!(bits(&first[r].1), bits(&first[0].1), "world sum, rank {r}");
    }
    assert_eq!(run(), first, "a second run gives the same bits");
}

#[test]
fn sums_run_in_group_order_not_arrival_order() {
    // In f32, (1e8 + 1) + -1e8 + 1 == 1 but other orders give 0 or 2: only the group order
    // (member 0 first) gives exactly 1, whichever member arrives first.
    let values = [1e8f32, 1.0, -1e8, 1.0];
    let results = run_on_threads(4, SLOW, |c| {
        std::thread::sleep(Duration::from_millis((3 - c.rank() as u64) * 5));
        c.all_reduce_sum(&Group::world(4)?, &[values[c.rank()]])
    });
    for res in results {
        assert_eq!(res.expect("ok"), vec![1.0f32]);
    }
}

#[test]
fn interleaved_mesh_groups_do_not_interfere() {
    // Rows and columns of a [2, 4] mesh, several rounds, mixed with world calls: each group
    // keeps its own call sequence, so both rows can run call #0 at the same time.
    let rounds = 4;
    let results = run_on_threads(8, SLOW, |c| {
        let r = c.rank();
        let row = Group::mesh_axis(&[2, 4], 1, r)?;
        let col = Group::mesh_axis(&[2, 4], 0, r)?;
        let world = Group::world(8)?;
        let mut out = Vec::new();
        for round in 0..rounds {
            out.push(c.all_reduce_sum(&row, &input(r, 6, 100 + round))?);
            out.push(c.all_gather(&col, &input(r, 2, 200 + round))?);
            out.push(c.reduce_scatter_sum(&world, &input(r, 16, 300 + round))?);
        }
        Ok(out)
    });
    for (r, res) in results.into_iter().enumerate() {
        let got = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        let row: Vec<usize> = if r < 4 { (0..4).collect() } else { (4..8).collect() };
        let col = [r % 4, r % 4 + 4];
        let world: Vec<usize> = (0..8).collect();
        for round in 0..rounds {
            let want_row = reference_sum(&row, 6, 100 + round);
            let want_col: Vec<f32> = col.iter().flat_map(|&m| input(m, 2, 200 + round)).collect();
            let want_world = reference_sum(&world, 16, 300 + round)[2 * r..2 * r + 2].to_vec();
            assert_eq!(bits(&got[3 * round]), bits(&want_row), "rank {r} round {round} row");
            assert_eq!(bits(&got[3 * round + 1]), bits(&want_col), "rank {r} round {round} col");
            assert_eq!(bits(&got[3 * round + 2]), bits(&want_world), "rank {r} round {round}");
        }
    }
}

#[test]
fn send_recv_ring_is_fifo_per_pair() {
    for n in [1, 2, 3, 4, 8] {
        let results = run_on_threads(n, SLOW, |c| {
            let r = c.rank();
            let next = (r + 1) % n;
            let prev = (r + n - 1) % n;
            for msg in 0..3 {
                c.send(next, &input(r, msg + 1, 400 + msg))?;
            }
            (0..3).map(|_| c.recv(prev)).collect::<tessera_comm::Result<Vec<_>>>()
        });
        for (r, res) in results.into_iter().enumerate() {
            let got = res.unwrap_or_else(|e| panic!("n={n}, rank {r}: {e}"));
            let prev = (r + n - 1) % n;
            let want: Vec<Vec<f32>> = (0..3).map(|m| input(prev, m + 1, 400 + m)).collect();
            assert_eq!(got, want, "n={n}, rank {r}: messages from {prev} in order");
        }
    }
}

#[test]
fn barrier_orders_side_effects() {
    let counter = AtomicUsize::new(0);
    let results = run_on_threads(8, SLOW, |c| {
        std::thread::sleep(Duration::from_millis(c.rank() as u64 * 2));
        counter.fetch_add(1, Ordering::SeqCst);
        c.barrier(&Group::world(8)?)?;
        Ok(counter.load(Ordering::SeqCst))
    });
    for res in results {
        assert_eq!(res.expect("ok"), 8, "every increment happened before anyone left the barrier");
    }
}

#[test]
fn stats_count_calls_and_input_bytes() {
    let results = run_on_threads(4, SLOW, |c| {
        let r = c.rank();
        let world = Group::world(4)?;
        let pair = Group::new([r - r % 2, r - r % 2 + 1])?;
        for _ in 0..3 {
            c.all_reduce_sum(&world, &[1.0; 10])?;
        }
        c.all_gather(&pair, &[1.0; 5])?;
        c.reduce_scatter_sum(&world, &[1.0; 8])?;
        c.all_to_all(&pair, &[1.0; 6])?;
        c.broadcast(&world, 0, &vec![1.0; if r == 0 { 7 } else { 0 }])?;
        c.send((r + 1) % 4, &[1.0; 3])?;
        c.recv((r + 3) % 4)?;
        c.barrier(&world)?;
        Ok(c.stats())
    });
    for (r, res) in results.into_iter().enumerate() {
        let s = res.expect("ok");
        let k = |calls, elems: u64| KindStats { calls, bytes: elems * 4 };
        assert_eq!(s.get(CollectiveKind::AllReduce), k(3, 30), "rank {r}");
        assert_eq!(s.get(CollectiveKind::AllGather), k(1, 5));
        assert_eq!(s.get(CollectiveKind::ReduceScatter), k(1, 8));
        assert_eq!(s.get(CollectiveKind::AllToAll), k(1, 6));
        assert_eq!(s.get(CollectiveKind::Broadcast), k(1, if r == 0 { 7 } else { 0 }));
        assert_eq!(s.get(CollectiveKind::Send), k(1, 3));
        assert_eq!(s.get(CollectiveKind::Recv), k(1, 3));
        assert_eq!(s.get(CollectiveKind::Barrier), k(1, 0));
        assert_eq!(s.total_calls(), 10);
        assert_eq!(s.total_bytes(), 4 * (30 + 5 + 8 + 6 + 3 + 3 + if r == 0 { 7 } else { 0 }));
    }
}

#[test]
fn a_rank_that_skips_a_collective_times_out_the_others_naming_it() {
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let results = run_on_threads(4, timeout, |c| {
        if c.rank() == 3 {
            // Alive but absent: longer than the timeout, so the others must time out (not see
            // a departure).
            std::thread::sleep(Duration::from_millis(900));
            return Ok(());
        }
        c.all_reduce_sum(&Group::world(4)?, &[1.0, 2.0]).map(drop)
    });
    let elapsed = start.elapsed();
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    assert!(results[3].is_ok());
    for (r, res) in results.iter().enumerate().take(3) {
        match res {
            Err(e @ CommError::Timeout { rank, kind, group, missing, .. }) => {
                assert_eq!(*rank, r);
                assert_eq!(*kind, CollectiveKind::AllReduce);
                assert_eq!(group, &vec![0, 1, 2, 3]);
                assert_eq!(missing, &vec![3]);
                let msg = e.to_string();
                assert!(msg.contains(&format!("rank {r}: all_reduce over ranks [0, 1, 2, 3]")));
                assert!(msg.contains("waiting for ranks [3]"), "{msg}");
                assert!(msg.contains("rank 3 is in no call"), "{msg}");
            }
            other => panic!("rank {r}: expected a timeout, got {other:?}"),
        }
    }
}

#[test]
fn a_timeout_says_what_the_missing_rank_is_doing() {
    // Rank 1 waits in a barrier of its own group while rank 0 waits for it elsewhere. Rank 1
    // starts waiting later than rank 0, so it is still blocked when rank 0 gives up.
    let results = run_on_threads(3, Duration::from_millis(300), |c| match c.rank() {
        0 => c.all_gather(&Group::new([0, 1])?, &[1.0]).map(drop),
        1 => {
            std::thread::sleep(Duration::from_millis(150));
            c.barrier(&Group::new([1, 2])?)
        }
        _ => {
            std::thread::sleep(Duration::from_millis(900));
            Ok(())
        }
    });
    let msg = results[0].as_ref().expect_err("rank 0 times out").to_string();
    assert!(msg.contains("rank 1 is blocked in barrier over ranks [1, 2]"), "{msg}");
    let msg = results[1].as_ref().expect_err("rank 1 times out").to_string();
    assert!(msg.contains("waiting for ranks [2]"), "{msg}");
}

#[test]
fn a_rank_that_returns_early_fails_the_others_promptly() {
    let start = Instant::now();
    let results = run_on_threads(4, SLOW, |c| {
        if c.rank() == 2 {
            return Ok(()); // drops its communicator without calling the collective
        }
        c.all_reduce_sum(&Group::world(4)?, &[1.0]).map(drop)
    });
    // RankDied (not Timeout) already shows the wait did not run to the timeout.
    assert!(start.elapsed() < SLOW, "took {:?}", start.elapsed());
    assert!(results[2].is_ok());
    for r in [0, 1, 3] {
        match &results[r] {
            Err(e @ CommError::RankDied { rank, dead: 2, how: Departure::Dropped, .. }) => {
                assert_eq!(*rank, r);
                let msg = e.to_string();
                assert!(msg.contains("rank 2 is gone"), "{msg}");
            }
            other => panic!("rank {r}: expected RankDied(2), got {other:?}"),
        }
    }
}

#[test]
fn a_panicking_rank_fails_the_others_promptly() {
    let start = Instant::now();
    let results = run_on_threads(4, SLOW, |c| {
        let world = Group::world(4)?;
        c.barrier(&world)?;
        if c.rank() == 1 {
            panic!("rank 1 exploded");
        }
        c.all_gather(&world, &[1.0]).map(drop)
    });
    assert!(start.elapsed() < SLOW, "took {:?}", start.elapsed());
    match &results[1] {
        Err(CommError::Panicked { rank: 1, message }) => assert!(message.contains("exploded")),
        other => panic!("rank 1: expected Panicked, got {other:?}"),
    }
    for r in [0, 2, 3] {
        assert!(
            matches!(
                &results[r],
                Err(CommError::RankDied { dead: 1, how: Departure::Panicked, .. })
            ),
            "rank {r}: {:?}",
            results[r]
        );
    }
}

#[test]
fn a_rank_that_finished_does_not_fail_a_call_it_already_joined() {
    // Rank 0 deposits, completes and leaves while the others may still be picking up results.
    for _ in 0..20 {
        let results = run_on_threads(4, SLOW, |c| {
            let out = c.all_reduce_sum(&Group::world(4)?, &[c.rank() as f32])?;
            if c.rank() != 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(out)
        });
        for res in results {
            assert_eq!(res.expect("ok"), vec![6.0]);
        }
    }
}

#[test]
fn different_collectives_in_the_same_call_are_a_mismatch_for_everyone() {
    let start = Instant::now();
    let results = run_on_threads(4, SLOW, |c| {
        let world = Group::world(4)?;
        if c.rank() == 0 {
            c.all_gather(&world, &[1.0, 2.0])
        } else {
            c.all_reduce_sum(&world, &[1.0, 2.0])
        }
    });
    assert!(start.elapsed() < SLOW, "a mismatch must not wait for the timeout");
    let mut saw_both = false;
    for (r, res) in results.iter().enumerate() {
        match res {
            Err(e @ CommError::Mismatch { rank, seq: 0, detail, .. }) => {
                assert_eq!(*rank, r);
                assert!(detail.contains("all_gather with 2 elements"), "{e}");
                assert!(detail.contains("all_reduce with 2 elements"), "{e}");
                saw_both |= detail.contains("rank 0");
            }
            other => panic!("rank {r}: expected Mismatch, got {other:?}"),
        }
    }
    assert!(saw_both, "the mismatch names rank 0, the odd one out");
}

#[test]
fn unequal_lengths_are_a_mismatch_naming_ranks_and_lengths() {
    let results = run_on_threads(2, SLOW, |c| {
        let len = if c.rank() == 1 { 5 } else { 4 };
        c.all_gather(&Group::world(2)?, &vec![0.0; len])
    });
    for (r, res) in results.iter().enumerate() {
        let msg = res.as_ref().expect_err("mismatch").to_string();
        assert!(msg.contains("all_gather with 4 elements"), "rank {r}: {msg}");
        assert!(msg.contains("all_gather with 5 elements"), "rank {r}: {msg}");
        assert!(msg.contains("rank 0") && msg.contains("rank 1"), "rank {r}: {msg}");
    }
}

#[test]
fn different_broadcast_roots_are_a_mismatch() {
    let results = run_on_threads(3, SLOW, |c| {
        let root = if c.rank() == 2 { 1 } else { 0 };
        c.broadcast(&Group::world(3)?, root, &[1.0])
    });
    for res in &results {
        let msg = res.as_ref().expect_err("mismatch").to_string();
        assert!(msg.contains("broadcast from root 0") && msg.contains("broadcast from root 1"));
    }
}

#[test]
fn bad_arguments_are_local_errors_and_do_not_desynchronise() {
    let results = run_on_threads(2, SLOW, |c| {
        let r = c.rank();
        let world = Group::world(2)?;
        let errors = vec![
            c.all_reduce_sum(&Group::new([1 - r])?, &[1.0]).map(drop),
            c.all_reduce_sum(&Group::new([0, 1, 2])?, &[1.0]).map(drop),
            c.reduce_scatter_sum(&world, &[1.0; 3]).map(drop),
            c.all_to_all(&world, &[1.0; 5]).map(drop),
            c.broadcast(&Group::new([r])?, 1 - r, &[1.0]).map(drop),
            c.send(2, &[1.0]),
            c.recv(9).map(drop),
            c.recv(r).map(drop),
        ];
        let kinds: Vec<String> = errors
            .into_iter()
            .map(|e| match e {
                Err(CommError::InvalidGroup(_)) => "group".to_string(),
                Err(CommError::InvalidArgument(_)) => "argument".to_string(),
                other => format!("{other:?}"),
            })
            .collect();
        // None of the above took a call number: the next real call still lines up.
        let sum = c.all_reduce_sum(&world, &[r as f32 + 1.0])?;
        Ok((kinds, sum))
    });
    for res in results {
        let (kinds, sum) = res.expect("the valid call succeeds");
        assert_eq!(
            kinds,
            [
                "group", "group", "argument", "argument", "argument", "argument", "argument",
                "argument"
            ]
        );
        assert_eq!(sum, vec![3.0]);
    }
}

#[test]
fn recv_gets_messages_sent_before_the_sender_left_then_fails_promptly() {
    let start = Instant::now();
    let results = run_on_threads(2, SLOW, |c| {
        if c.rank() == 0 {
            c.send(1, &[4.0, 2.0])?;
            return Ok(Vec::new());
        }
        let first = c.recv(0)?;
        match c.recv(0) {
            Err(CommError::RankDied { dead: 0, kind: CollectiveKind::Recv, .. }) => Ok(first),
            other => panic!("expected RankDied from the second recv, got {other:?}"),
        }
    });
    assert!(start.elapsed() < SLOW);
    assert_eq!(results[1].as_ref().expect("ok"), &vec![4.0, 2.0]);
}

#[test]
fn send_to_a_departed_rank_fails() {
    let results = run_on_threads(2, SLOW, |c| {
        if c.rank() == 1 {
            return Ok(());
        }
        // The recv fails once rank 1 is gone; then a send to it must fail too.
        assert!(matches!(c.recv(1), Err(CommError::RankDied { dead: 1, .. })));
        c.send(1, &[1.0])
    });
    assert!(matches!(
        &results[0],
        Err(CommError::RankDied { dead: 1, kind: CollectiveKind::Send, .. })
    ));
}

#[test]
fn recv_times_out_naming_the_sender() {
    let results = run_on_threads(2, Duration::from_millis(200), |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(600));
            return Ok(Vec::new());
        }
        c.recv(1)
    });
    let msg = results[0].as_ref().expect_err("timeout").to_string();
    assert!(msg.starts_with("rank 0: recv from rank 1 timed out"), "{msg}");
}

#[test]
fn tagged_streams_on_one_pair_are_received_in_the_opposite_order_of_sending() {
    let results = run_on_threads(2, SLOW, |c| {
        if c.rank() == 0 {
            // Two messages of stream 3, then two of stream 7, then one untagged (tag 0).
            c.send_tagged(1, 3, &[3.0, 0.0])?;
            c.send_tagged(1, 3, &[3.0, 1.0])?;
            c.send_tagged(1, 7, &[7.0, 0.0])?;
            c.send_tagged(1, 7, &[7.0, 1.0])?;
            c.send(1, &[0.5])?;
            return Ok(Vec::new());
        }
        // Wait until everything is queued, so that the later streams are behind the earlier.
        std::thread::sleep(Duration::from_millis(50));
        Ok(vec![
            c.recv(0)?,
            c.recv_tagged(0, 7)?,
            c.recv_tagged(0, 7)?,
            c.recv_tagged(0, 3)?,
            c.recv_tagged(0, 3)?,
        ])
    });
    let got = results[1].as_ref().expect("rank 1 receives every stream");
    let want = vec![vec![0.5], vec![7.0, 0.0], vec![7.0, 1.0], vec![3.0, 0.0], vec![3.0, 1.0]];
    assert_eq!(got, &want);
}

#[test]
fn a_recv_on_a_later_stream_is_not_blocked_by_an_unreceived_earlier_one() {
    // Rank 0 sends on tag 5, then on tag 1, and waits for rank 1's answer to the tag-1 message
    // before sending on tag 6: rank 1 can only answer (and get tag 6) by receiving tag 1 past
    // the older tag-5 message, which it takes last.
    let results = run_on_threads(2, SLOW, |c| {
        if c.rank() == 0 {
            c.send_tagged(1, 5, &[5.0])?;
            c.send_tagged(1, 1, &[1.0])?;
            let answer = c.recv_tagged(1, 2)?;
            c.send_tagged(1, 6, &answer)?;
            return Ok(Vec::new());
        }
        let one = c.recv_tagged(0, 1)?;
        c.send_tagged(0, 2, &[one[0] + 1.0])?;
        let six = c.recv_tagged(0, 6)?;
        let five = c.recv_tagged(0, 5)?;
        Ok(vec![one, six, five])
    });
    assert!(results[0].is_ok(), "{:?}", results[0]);
    assert_eq!(results[1].as_ref().expect("ok"), &vec![vec![1.0], vec![2.0], vec![5.0]]);
}

#[test]
fn each_tag_is_fifo_per_pair_and_counts_like_send_and_recv() {
    // Every rank sends three messages on each of tags 0, 1 and MAX_TAG to the next rank,
    // interleaving the tags, and receives them tag by tag, the tags in reverse order.
    let tags = [0, 1, tessera_comm::MAX_TAG];
    let results = run_on_threads(3, SLOW, |c| {
        let (r, n) = (c.rank(), c.world_size());
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        for msg in 0..3 {
            for (t, &tag) in tags.iter().enumerate() {
                c.send_tagged(next, tag, &input(r, msg + 1, 10 * t + msg))?;
            }
        }
        let mut got = Vec::new();
        for &tag in tags.iter().rev() {
            for _ in 0..3 {
                got.push(c.recv_tagged(prev, tag)?);
            }
        }
        Ok((got, c.stats()))
    });
    for (r, res) in results.into_iter().enumerate() {
        let (got, stats) = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        let prev = (r + 2) % 3;
        let want: Vec<Vec<f32>> = (0..tags.len())
            .rev()
            .flat_map(|t| (0..3).map(move |msg| input(prev, msg + 1, 10 * t + msg)))
            .collect();
        assert_eq!(got, want, "rank {r}: each tag's messages from {prev} in send order");
        // 9 messages of 1, 2 and 3 elements (three of each) each way.
        let k = KindStats { calls: 9, bytes: 4 * 3 * (1 + 2 + 3) };
        assert_eq!(stats.get(CollectiveKind::Send), k, "rank {r}");
        assert_eq!(stats.get(CollectiveKind::Recv), k, "rank {r}");
    }
}

#[test]
fn a_recv_on_a_tag_nobody_sends_times_out_naming_peer_and_tag() {
    let results = run_on_threads(2, Duration::from_millis(200), |c| {
        if c.rank() == 1 {
            c.send_tagged(0, 3, &[1.0])?;
            std::thread::sleep(Duration::from_millis(600));
            return Ok(Vec::<f32>::new());
        }
        match c.recv_tagged(1, 7) {
            Err(e @ CommError::Timeout { .. }) => {
                // Nothing is out of step after a recv timeout: the other stream still works.
                let three = c.recv_tagged(1, 3)?;
                assert_eq!(three, vec![1.0]);
                Err(e)
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    });
    match &results[0] {
        Err(e @ CommError::Timeout { rank: 0, kind: CollectiveKind::Recv, group, missing, .. }) => {
            assert_eq!((group, missing), (&vec![1], &vec![1]));
            let msg = e.to_string();
            assert!(msg.starts_with("rank 0: recv from rank 1 timed out"), "{msg}");
            assert!(msg.contains("no message with tag 7 from rank 1 arrived"), "{msg}");
        }
        other => panic!("rank 0: expected a timeout, got {other:?}"),
    }
}

#[test]
fn a_timeout_names_the_tag_the_missing_rank_waits_on() {
    // Rank 1 waits for tag 4 from rank 0 while rank 0 waits for tag 9 from rank 1; rank 1
    // starts later, so it is still blocked when rank 0 gives up.
    let results = run_on_threads(2, Duration::from_millis(300), |c| {
        if c.rank() == 0 {
            return c.recv_tagged(1, 9);
        }
        std::thread::sleep(Duration::from_millis(150));
        c.recv_tagged(0, 4)
    });
    let msg = results[0].as_ref().expect_err("rank 0 times out").to_string();
    assert!(msg.contains("no message with tag 9 from rank 1"), "{msg}");
    assert!(msg.contains("rank 1 is blocked in recv from rank 0 (tag 4)"), "{msg}");
    // Rank 0 left after its timeout: rank 1's recv fails promptly rather than timing out.
    assert!(
        matches!(&results[1], Err(CommError::RankDied { dead: 0, kind: CollectiveKind::Recv, .. })),
        "{:?}",
        results[1]
    );
}

#[test]
fn tagged_messages_sent_before_the_sender_left_are_still_received() {
    let results = run_on_threads(2, SLOW, |c| {
        if c.rank() == 0 {
            c.send_tagged(1, 2, &[2.0])?;
            c.send_tagged(1, 1, &[1.0])?;
            return Ok(Vec::new());
        }
        std::thread::sleep(Duration::from_millis(50));
        let got = vec![c.recv_tagged(0, 1)?, c.recv_tagged(0, 2)?];
        match c.recv_tagged(0, 1) {
            Err(CommError::RankDied { dead: 0, .. }) => Ok(got),
            other => panic!("expected RankDied, got {other:?}"),
        }
    });
    assert_eq!(results[1].as_ref().expect("ok"), &vec![vec![1.0], vec![2.0]]);
}

#[test]
fn a_tag_above_the_limit_is_refused_naming_it() {
    let results = run_on_threads(2, SLOW, |c| {
        let (r, big) = (c.rank(), tessera_comm::MAX_TAG + 1);
        for e in [c.send_tagged(1 - r, big, &[1.0]), c.recv_tagged(1 - r, big).map(drop)] {
            match e {
                Err(CommError::InvalidArgument(msg)) => {
                    assert!(msg.contains(&tessera_comm::MAX_TAG.to_string()), "{msg}");
                    assert!(msg.contains(&format!("tag {big}")), "{msg}");
                }
                other => panic!("expected InvalidArgument, got {other:?}"),
            }
        }
        // Nothing was sent or counted: the pair's streams are untouched.
        c.send_tagged(1 - r, 0, &[r as f32])?;
        let got = c.recv(1 - r)?;
        Ok((got, c.stats().total_calls()))
    });
    for (r, res) in results.into_iter().enumerate() {
        assert_eq!(res.expect("ok"), (vec![(1 - r) as f32], 2), "rank {r}");
    }
}

#[test]
fn the_default_tagged_calls_serve_tag_0_and_refuse_others() {
    let results = run_with_piece_as(2, 1 << 20, true, |c| {
        let r = c.rank();
        c.send_tagged(1 - r, 0, &[r as f32])?;
        let got = c.recv_tagged(1 - r, 0)?;
        assert!(matches!(c.send_tagged(1 - r, 1, &[1.0]), Err(CommError::InvalidArgument(_))));
        assert!(matches!(c.recv_tagged(1 - r, 1), Err(CommError::InvalidArgument(_))));
        Ok(got)
    });
    for (r, res) in results.into_iter().enumerate() {
        assert_eq!(res.expect("ok"), vec![(1 - r) as f32]);
    }
}

#[test]
fn communicators_work_as_boxed_trait_objects_on_plain_threads() {
    let comms = ThreadComm::world(3, SLOW).expect("n > 0");
    let boxed: Vec<Box<dyn Communicator>> =
        comms.into_iter().map(|c| Box::new(c) as Box<dyn Communicator>).collect();
    let handles: Vec<_> = boxed
        .into_iter()
        .map(|mut c| {
            std::thread::spawn(move || {
                assert_eq!(c.world_size(), 3);
                c.all_gather(&Group::world(3)?, &[c.rank() as f32])
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().expect("no panic").expect("ok"), vec![0.0, 1.0, 2.0]);
    }
    assert!(ThreadComm::world(0, SLOW).is_err());
    assert!(run_on_threads(0, SLOW, |_| Ok(())).is_empty());
}

#[test]
fn large_all_reduce_on_eight_ranks() {
    let len = 1 << 18;
    let results = run_on_threads(8, SLOW, |c| {
        let data: Vec<f32> = (0..len).map(|i| (i % 97) as f32 + c.rank() as f32).collect();
        c.all_reduce_sum(&Group::world(8)?, &data)
    });
    for res in results {
        let got = res.expect("ok");
        // Small integers: the sum is exact in any order, so a closed form is a fair reference.
        assert!(got.iter().enumerate().all(|(i, &x)| x == 8.0 * (i % 97) as f32 + 28.0));
    }
}

// ---------------------------------------------------------------------------------------------
// Streaming: a call cut into many pieces, and chunks laid out interleaved (`ChunkLayout`).

/// Runs `f` on one thread per rank of a world of `n` whose calls move at most `piece` elements
/// per member per rendezvous.
fn run_with_piece<F, R>(n: usize, piece: usize, f: F) -> Vec<tessera_comm::Result<R>>
where
    F: Fn(&mut dyn Communicator) -> tessera_comm::Result<R> + Sync,
    R: Send,
{
    run_with_piece_as(n, piece, false, f)
}

/// [`run_with_piece`], each communicator wrapped in [`PlainOnly`] if `plain`.
fn run_with_piece_as<F, R>(
    n: usize,
    piece: usize,
    plain: bool,
    f: F,
) -> Vec<tessera_comm::Result<R>>
where
    F: Fn(&mut dyn Communicator) -> tessera_comm::Result<R> + Sync,
    R: Send,
{
    let comms = ThreadComm::world_with_piece(n, SLOW, piece).expect("n > 0, piece > 0");
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let mut c: Box<dyn Communicator> =
                    if plain { Box::new(PlainOnly(c)) } else { Box::new(c) };
                scope.spawn(move || f(c.as_mut()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("no panic")).collect()
    })
}

#[test]
fn streamed_calls_match_the_sequential_reference_bit_for_bit() {
    for n in [2, 3, 4] {
        for piece in [1, 2, 5, 7] {
            let results = run_with_piece(n, piece, |c| all_collectives(c, &Group::world(n)?));
            let members: Vec<usize> = (0..n).collect();
            for (r, res) in results.into_iter().enumerate() {
                let got = res.unwrap_or_else(|e| panic!("n {n} piece {piece} rank {r}: {e}"));
                assert_bitwise_eq(
                    &got,
                    &expected_outputs(r, &members),
                    &format!("n {n}, piece {piece}, rank {r}"),
                );
            }
        }
    }
    assert!(ThreadComm::world_with_piece(2, SLOW, 0).is_err());
}

#[test]
fn a_streamed_call_counts_once_with_its_whole_payload() {
    let (n, piece) = (4, 3);
    let results = run_with_piece(n, piece, |c| {
        let r = c.rank();
        let world = Group::world(n)?;
        let all_reduce = c.all_reduce_sum(&world, &input(r, 1000, 20))?;
        let all_gather = c.all_gather(&world, &input(r, 101, 21))?;
        let reduce_scatter = c.reduce_scatter_sum(&world, &input(r, 4 * 53, 22))?;
        let all_to_all = c.all_to_all(&world, &input(r, 4 * 37, 23))?;
        let data = if r == 2 { input(r, 29, 24) } else { vec![f32::NAN; r] };
        let broadcast = c.broadcast(&world, 2, &data)?;
        c.barrier(&world)?;
        Ok((c.stats(), [all_reduce, all_gather, reduce_scatter, all_to_all, broadcast]))
    });
    let members: Vec<usize> = (0..n).collect();
    for (r, res) in results.into_iter().enumerate() {
        let (s, got) = res.expect("ok");
        let want = [
            reference_sum(&members, 1000, 20),
            members.iter().flat_map(|&m| input(m, 101, 21)).collect(),
            reference_sum(&members, 4 * 53, 22)[r * 53..(r + 1) * 53].to_vec(),
            members
                .iter()
                .flat_map(|&m| input(m, 4 * 37, 23)[r * 37..(r + 1) * 37].to_vec())
                .collect(),
            input(2, 29, 24),
        ];
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(bits(g), bits(w), "rank {r}, result {i}");
        }
        let k = |calls, elems: u64| KindStats { calls, bytes: elems * 4 };
        assert_eq!(s.get(CollectiveKind::AllReduce), k(1, 1000), "rank {r}");
        assert_eq!(s.get(CollectiveKind::AllGather), k(1, 101), "rank {r}");
        assert_eq!(s.get(CollectiveKind::ReduceScatter), k(1, 4 * 53), "rank {r}");
        assert_eq!(s.get(CollectiveKind::AllToAll), k(1, 4 * 37), "rank {r}");
        assert_eq!(s.get(CollectiveKind::Broadcast), k(1, if r == 2 { 29 } else { r as u64 }));
        assert_eq!(s.get(CollectiveKind::Barrier), k(1, 0), "rank {r}");
        assert_eq!(s.total_calls(), 6, "rank {r}");
    }
}

/// Delegates the plain collectives only, so the strided ones are the trait's defaults (what
/// the MPI backend gets).
struct PlainOnly(ThreadComm);

impl Communicator for PlainOnly {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce_sum(&mut self, g: &Group, d: &[f32]) -> tessera_comm::Result<Vec<f32>> {
        self.0.all_reduce_sum(g, d)
    }
    fn all_gather(&mut self, g: &Group, d: &[f32]) -> tessera_comm::Result<Vec<f32>> {
        self.0.all_gather(g, d)
    }
    fn reduce_scatter_sum(&mut self, g: &Group, d: &[f32]) -> tessera_comm::Result<Vec<f32>> {
        self.0.reduce_scatter_sum(g, d)
    }
    fn all_to_all(&mut self, g: &Group, d: &[f32]) -> tessera_comm::Result<Vec<f32>> {
        self.0.all_to_all(g, d)
    }
    fn broadcast(&mut self, g: &Group, root: usize, d: &[f32]) -> tessera_comm::Result<Vec<f32>> {
        self.0.broadcast(g, root, d)
    }
    fn send(&mut self, to: usize, d: &[f32]) -> tessera_comm::Result<()> {
        self.0.send(to, d)
    }
    fn recv(&mut self, from: usize) -> tessera_comm::Result<Vec<f32>> {
        self.0.recv(from)
    }
    fn barrier(&mut self, g: &Group) -> tessera_comm::Result<()> {
        self.0.barrier(g)
    }
    fn stats(&self) -> tessera_comm::CommStats {
        self.0.stats()
    }
}

/// Index in a `[outer, n, chunk / outer]` buffer of element `j` of chunk `k`.
fn interleaved_index(n: usize, chunk: usize, outer: usize, k: usize, j: usize) -> usize {
    let inner = chunk / outer;
    (j / inner) * n * inner + k * inner + j % inner
}

/// An all-gather of `data` (chunks cut into `outer` blocks) through
/// [`Communicator::all_gather_in_place`], in a packed buffer or (if `padded`) one with room
/// around and between the blocks, whose padding must be left alone; returns the packed result.
fn gather_in_place(
    c: &mut dyn Communicator,
    group: &Group,
    data: &[f32],
    outer: usize,
    padded: bool,
) -> tessera_comm::Result<Vec<f32>> {
    use tessera_comm::communicator::ChunkLayout;
    const PAD: f32 = -7.0;
    let (n, chunk) = (group.len(), data.len());
    let me = group.index_of(c.rank()).expect("member");
    let packed = ChunkLayout::interleaved(outer);
    let layout = if padded { ChunkLayout::placed(outer, n * chunk / outer + 3, 2) } else { packed };
    let span = layout.span(n, chunk).expect("fits");
    let mut buf = vec![PAD; span + usize::from(padded)];
    layout.for_each_run(n, chunk, me, 0..chunk, |j, at, len| {
        buf[at..at + len].copy_from_slice(&data[j..j + len]);
    });
    c.all_gather_in_place(group, &mut buf, chunk, layout)?;
    let mut out = vec![0.0; n * chunk];
    let mut covered = vec![false; buf.len()];
    for m in 0..n {
        layout.for_each_run(n, chunk, m, 0..chunk, |j, at, len| {
            covered[at..at + len].iter_mut().for_each(|x| *x = true);
            packed.for_each_run(n, chunk, m, j..j + len, |j2, to, len2| {
                let from = at + (j2 - j);
                out[to..to + len2].copy_from_slice(&buf[from..from + len2]);
            });
        });
    }
    let untouched = buf.iter().zip(&covered).all(|(x, &c)| c || x.to_bits() == PAD.to_bits());
    assert!(untouched, "the padding of the buffer was written");
    Ok(out)
}

#[test]
fn strided_collectives_match_a_direct_reference_natively_and_by_default() {
    use tessera_comm::communicator::ChunkLayout;
    let n = 3;
    // Chunks of 12 elements, cut into 1, 2, 3, 4 and 12 blocks.
    let chunk = 12;
    let outers = [1, 2, 3, 4, 12];
    for piece in [2, 5, 1 << 20] {
        for plain in [false, true] {
            let results = run_with_piece_as(n, piece, plain, |c| {
                let r = c.rank();
                let world = Group::world(n)?;
                let mut out = Vec::new();
                for (i, &o) in outers.iter().enumerate() {
                    let o2 = outers[(i + 1) % outers.len()];
                    let (a, b) = (ChunkLayout::interleaved(o), ChunkLayout::interleaved(o2));
                    // Every other one inside a larger buffer (ChunkLayout::placed).
                    let d = input(r, chunk, 30 + i);
                    out.push(gather_in_place(c, &world, &d, o, i % 2 == 1)?);
                    let d = input(r, n * chunk, 40 + i);
                    out.push(c.reduce_scatter_sum_strided(&world, &d, a)?);
                    let d = input(r, n * chunk, 50 + i);
                    out.push(c.all_to_all_strided(&world, &d, a, b)?);
                }
                Ok((out, c.stats()))
            });
            for (r, res) in results.into_iter().enumerate() {
                let (got, stats) = res.expect("ok");
                let mut want = Vec::new();
                for (i, &o) in outers.iter().enumerate() {
                    let o2 = outers[(i + 1) % outers.len()];
                    let mut gathered = vec![0.0; n * chunk];
                    for m in 0..n {
                        for (j, x) in input(m, chunk, 30 + i).into_iter().enumerate() {
                            gathered[interleaved_index(n, chunk, o, m, j)] = x;
                        }
                    }
                    want.push(gathered);
                    let mut sum = vec![0.0f32; chunk];
                    for (j, s) in sum.iter_mut().enumerate() {
                        let at = interleaved_index(n, chunk, o, r, j);
                        let mut acc = input(0, n * chunk, 40 + i)[at];
                        for m in 1..n {
                            acc += input(m, n * chunk, 40 + i)[at];
                        }
                        *s = acc;
                    }
                    want.push(sum);
                    let mut received = vec![0.0; n * chunk];
                    for m in 0..n {
                        let data = input(m, n * chunk, 50 + i);
                        for j in 0..chunk {
                            received[interleaved_index(n, chunk, o2, m, j)] =
                                data[interleaved_index(n, chunk, o, r, j)];
                        }
                    }
                    want.push(received);
                }
                assert_eq!(got.len(), want.len());
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(bits(g), bits(w), "piece {piece}, plain {plain}, rank {r}, #{i}");
                }
                let calls = outers.len() as u64;
                assert_eq!(stats.get(CollectiveKind::AllGather).calls, calls);
                assert_eq!(stats.get(CollectiveKind::ReduceScatter).calls, calls);
                assert_eq!(stats.get(CollectiveKind::AllToAll).calls, calls);
                assert_eq!(stats.total_bytes(), calls * 4 * (chunk + 2 * n * chunk) as u64);
            }
        }
    }
}

#[test]
fn a_layout_that_does_not_fit_is_a_local_error() {
    use tessera_comm::communicator::ChunkLayout;
    for plain in [false, true] {
        let comms = ThreadComm::world(2, SLOW).expect("n > 0");
        for c in comms {
            let mut c: Box<dyn Communicator> =
                if plain { Box::new(PlainOnly(c)) } else { Box::new(c) };
            let world = Group::world(2).expect("n > 0");
            let bad = ChunkLayout::interleaved(3);
            let errs = [
                c.all_gather_in_place(&world, &mut [0.0; 8], 4, bad),
                c.reduce_scatter_sum_strided(&world, &[0.0; 8], bad).map(drop),
                c.all_to_all_strided(&world, &[0.0; 8], bad, ChunkLayout::CONTIGUOUS).map(drop),
                c.all_to_all_strided(&world, &[0.0; 8], ChunkLayout::CONTIGUOUS, bad).map(drop),
                c.all_gather_in_place(&world, &mut [0.0; 8], 4, ChunkLayout::interleaved(0)),
                // Does not fit in the buffer, or blocks would overlap.
                c.all_gather_in_place(&world, &mut [0.0; 7], 4, ChunkLayout::CONTIGUOUS),
                c.all_gather_in_place(&world, &mut [0.0; 9], 4, ChunkLayout::placed(1, 8, 2)),
                c.all_gather_in_place(&world, &mut [0.0; 16], 4, ChunkLayout::placed(2, 3, 0)),
            ];
            for (i, e) in errs.into_iter().enumerate() {
                assert!(
                    matches!(e, Err(CommError::InvalidArgument(_))),
                    "plain {plain} #{i}: {e:?}"
                );
            }
            // Nothing was sent: no call counted.
            assert_eq!(c.stats().total_calls(), 0);
        }
    }
}

#[test]
fn a_rank_that_finished_a_streamed_call_does_not_fail_the_others() {
    for _ in 0..20 {
        let results = run_with_piece(4, 2, |c| {
            let out = c.all_reduce_sum(&Group::world(4)?, &[c.rank() as f32; 9])?;
            if c.rank() != 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(out)
        });
        for res in results {
            assert_eq!(res.expect("ok"), vec![6.0; 9]);
        }
    }
}

#[test]
fn a_rank_that_leaves_fails_a_streamed_call_promptly() {
    let start = Instant::now();
    let results = run_with_piece(3, 2, |c| {
        if c.rank() == 1 {
            return Ok(Vec::new());
        }
        c.all_gather(&Group::world(3)?, &[1.0; 11])
    });
    assert!(start.elapsed() < SLOW, "a departure must not wait for the timeout");
    for r in [0, 2] {
        assert!(
            matches!(&results[r], Err(CommError::RankDied { dead: 1, .. })),
            "rank {r}: {:?}",
            results[r]
        );
    }
}

/// The conformance suite every transport answers to (`tessera_comm::conformance`, which the
/// MPI backend runs under `mpirun` too), on 1, 2, 3 and 4 thread ranks.
#[test]
fn the_shared_conformance_suite_passes_on_threads() {
    for n in 1..=4 {
        let results = run_on_threads(n, SLOW, |comm| {
            conformance::check_all(comm).map_err(|e| CommError::Internal(e.to_string()))
        });
        assert_eq!(results.len(), n);
        for (rank, r) in results.into_iter().enumerate() {
            if let Err(e) = r {
                panic!("{n} ranks, rank {rank}: {e}");
            }
        }
    }
}
