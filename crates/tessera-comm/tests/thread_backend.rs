//! The thread backend against independent references: every collective's result is compared,
//! bit for bit, with a sequential computation done here from every member's input (which each
//! test can recompute, since inputs are a pure function of rank and call). Failure tests check
//! that timeouts, dead ranks and mismatched calls give clear errors in bounded time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tessera_comm::{
    run_on_threads, CollectiveKind, CommError, Communicator, Departure, Group, KindStats,
    ThreadComm,
};

/// Generous for correctness tests: nothing should ever wait this long.
const SLOW: Duration = Duration::from_secs(2);

/// A deterministic input of `len` elements for `rank`, distinct per `salt`, with magnitudes from
/// 1e-3 to 1e3 so that the order of a sum changes its rounding.
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

/// Element-wise sum in group order, starting from zero: the reference for reductions.
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
