//! The torchrun-style id exchange of the NCCL transport, with threads as ranks on localhost:
//! no GPU involved.

use std::collections::HashMap;
use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

use tessera_comm::CommError;
use tessera_cuda::rendezvous::{fetch_id, serve_id, EnvRendezvous, ID_BYTES};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("address").port()
}

fn rv(rank: usize, world_size: usize, port: u16) -> EnvRendezvous {
    EnvRendezvous { rank, world_size, master_addr: "127.0.0.1".into(), master_port: port }
}

fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> =
        vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |name| map.get(name).cloned()
}

#[test]
fn every_rank_gets_rank_zeros_id_even_when_rank_zero_starts_last() {
    let (n, port) = (4, free_port());
    let id: [u8; ID_BYTES] = std::array::from_fn(|i| (i * 31 + 5) as u8);
    let clients: Vec<_> = (1..n)
        .map(|r| {
            thread::spawn(move || {
                rv(r, n, port)
                    .exchange(|| panic!("only rank 0 makes the id"), Duration::from_secs(10))
            })
        })
        .collect();
    // The others are already retrying when rank 0 starts listening.
    thread::sleep(Duration::from_millis(200));
    let served = rv(0, n, port).exchange(|| Ok(id), Duration::from_secs(10)).expect("rank 0");
    assert_eq!(served, id);
    for c in clients {
        assert_eq!(c.join().expect("no panic").expect("a client gets the id"), id);
    }
}

#[test]
fn a_world_of_one_needs_no_network() {
    let id = [7u8; ID_BYTES];
    // Port 1 would need privileges to bind: rank 0 of a world of one must not try.
    let got = rv(0, 1, 1).exchange(|| Ok(id), Duration::from_secs(1)).expect("no listening");
    assert_eq!(got, id);
}

#[test]
fn variables_are_read_and_errors_name_the_variable_and_the_fix() {
    let good =
        [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500")];
    let r = EnvRendezvous::from_lookup(lookup(&good)).expect("valid");
    assert_eq!(
        r,
        EnvRendezvous { rank: 1, world_size: 2, master_addr: "node0".into(), master_port: 29500 }
    );

    let cases: [(&[(&str, &str)], &str); 5] = [
        (&good[..3], "MASTER_PORT is not set"),
        (&[("RANK", "x"), good[1], good[2], good[3]], "RANK=\"x\" is malformed"),
        (&[good[0], ("WORLD_SIZE", "0"), good[2], good[3]], "WORLD_SIZE=\"0\" is malformed"),
        (&[good[0], good[1], good[2], ("MASTER_PORT", "70000")], "MASTER_PORT=\"70000\""),
        (&[("RANK", "2"), good[1], good[2], good[3]], "RANK=2 is not below WORLD_SIZE=2"),
    ];
    for (vars, want) in cases {
        match EnvRendezvous::from_lookup(lookup(vars)) {
            Err(CommError::InvalidArgument(msg)) => {
                assert!(msg.contains(want), "{msg:?} should contain {want:?}");
                assert!(msg.contains("RANK"), "{msg}");
            }
            other => panic!("{vars:?}: expected InvalidArgument, got {other:?}"),
        }
    }
    let missing = EnvRendezvous::from_lookup(lookup(&[])).expect_err("nothing set").to_string();
    assert!(missing.contains("RANK is not set") && missing.contains("torchrun"), "{missing}");
}

#[test]
fn a_rank_times_out_naming_rank_zero_when_it_never_comes() {
    let port = free_port();
    let start = Instant::now();
    let err = fetch_id("127.0.0.1", port, 1, 2, Duration::from_secs(2)).expect_err("no rank 0");
    let took = start.elapsed();
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(6), "{took:?}");
    match &err {
        CommError::Timeout { rank: 1, missing, .. } => assert_eq!(missing, &vec![0]),
        other => panic!("expected a timeout, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(&format!("127.0.0.1:{port}")) && msg.contains("MASTER_ADDR"), "{msg}");
}

#[test]
fn rank_zero_times_out_naming_the_ranks_that_never_connected() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("listener");
    let port = listener.local_addr().expect("address").port();
    let client = thread::spawn(move || fetch_id("127.0.0.1", port, 2, 3, Duration::from_secs(5)));
    let err = serve_id(&listener, 3, &[1; ID_BYTES], Duration::from_secs(2))
        .expect_err("rank 1 never comes");
    match err {
        CommError::Timeout { rank: 0, missing, .. } => assert_eq!(missing, vec![1]),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_eq!(client.join().expect("no panic").expect("rank 2 was served"), [1; ID_BYTES]);
}

#[test]
fn a_rank_of_another_world_size_is_refused_with_the_reason() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("listener");
    let port = listener.local_addr().expect("address").port();
    let server =
        thread::spawn(move || serve_id(&listener, 2, &[0; ID_BYTES], Duration::from_secs(2)));
    match fetch_id("127.0.0.1", port, 1, 3, Duration::from_secs(5)) {
        Err(CommError::InvalidArgument(msg)) => {
            assert!(msg.contains("WORLD_SIZE=3") && msg.contains("WORLD_SIZE=2"), "{msg}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let served = server.join().expect("no panic");
    assert!(matches!(served, Err(CommError::Timeout { .. })), "{served:?}");
}

#[test]
fn a_new_id_works_or_names_the_missing_library() {
    // With NCCL installed (a GPU machine) an id is made; without it (CI), the error says which
    // file cudarc looks for and how to provide it, instead of cudarc's panic.
    match tessera_cuda::nccl::new_id() {
        Ok(id) => assert!(id.iter().any(|&b| b != 0), "an NCCL id is not all zeros"),
        Err(CommError::InvalidArgument(msg)) => {
            assert!(msg.contains("libnccl.so") && msg.contains("LD_LIBRARY_PATH"), "{msg}")
        }
        Err(other) => panic!("expected an id or a missing-library error, got {other:?}"),
    }
}

/// `NcclComm::over` shares rank 0's NCCL id through an existing communicator's broadcast (MPI's,
/// in practice) as f32 bit patterns: every byte arrives, NaN and subnormal patterns included,
/// on every rank (here over the thread transport), and a wrong length is refused.
#[test]
fn an_nccl_id_survives_a_communicators_broadcast_bit_for_bit() {
    use tessera_comm::{run_on_threads, Group};
    use tessera_cuda::nccl::{id_from_words, id_to_words};
    let mut id = [0u8; ID_BYTES];
    for (i, b) in id.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(37) ^ 0xA5;
    }
    // A quiet NaN with a payload, a signalling NaN, and a subnormal, as words 0..3.
    id[..12].copy_from_slice(&[0x01, 0x00, 0xC0, 0x7F, 0x01, 0x00, 0x80, 0x7F, 0x01, 0, 0, 0]);
    let got = run_on_threads(3, Duration::from_secs(10), |c| {
        let mine = if c.rank() == 0 { id_to_words(&id) } else { Vec::new() };
        let words = c.broadcast(&Group::world(3)?, 0, &mine)?;
        Ok(id_from_words(&words))
    });
    assert_eq!(got.len(), 3);
    for (rank, r) in got.into_iter().enumerate() {
        assert_eq!(r.expect("broadcast"), Some(id), "rank {rank}");
    }
    assert_eq!(id_from_words(&[0.0; 31]), None);
}
