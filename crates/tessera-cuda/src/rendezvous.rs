//! A torchrun-style rendezvous: every rank of a job gets the same 128-byte NCCL unique id over
//! TCP, using only the variables `torchrun` sets (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`).
//!
//! Rank 0 makes the id, listens on `MASTER_PORT` (on every interface: `MASTER_ADDR` names the
//! host to reach, which may resolve to an address a socket cannot bind) and answers
//! `WORLD_SIZE − 1` connections, one per other rank. The others connect to
//! `MASTER_ADDR:MASTER_PORT`, retrying until a deadline (rank 0 may start later), and read the
//! id. Each connection carries a small handshake — a magic word, the client's rank and world
//! size — so that a rank of another job, a duplicate rank or a different `WORLD_SIZE` is
//! refused with an error on both sides instead of a silently wrong id. Nothing here needs a
//! GPU, so it is tested on the CPU (`tests/rendezvous.rs`).
//!
//! Every wait is bounded: a rank 0 that never comes, or ranks that never connect, give a
//! [`CommError::Timeout`] naming the missing ranks (reported as a broadcast of the id from
//! rank 0 over the world, which is what the exchange is).

use std::collections::BTreeSet;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use tessera_comm::{CollectiveKind, CommError};

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const ID_BYTES: usize = 128;

/// Opens every message of the exchange ("TSRZ" and a protocol version).
const MAGIC: [u8; 8] = *b"TSRZ\0\0\0\x01";

/// Pause between connection attempts of a non-zero rank, and between accept polls of rank 0.
const RETRY: Duration = Duration::from_millis(50);

/// The variables this module reads, with what each must hold (for error messages).
const VARS: [(&str, &str); 4] = [
    ("RANK", "this process's rank, 0 .. WORLD_SIZE-1"),
    ("WORLD_SIZE", "the number of processes in the job, at least 1"),
    ("MASTER_ADDR", "the host name or IP address of rank 0"),
    ("MASTER_PORT", "a free TCP port on rank 0's host, 1..65535"),
];

/// This process's place in a torchrun-style job and where rank 0 serves the id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvRendezvous {
    pub rank: usize,
    pub world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
}

fn bad_var(name: &str, value: Option<&str>) -> CommError {
    let what = VARS.iter().find(|(n, _)| *n == name).map_or("", |(_, w)| *w);
    let problem = match value {
        None => format!("{name} is not set"),
        Some(v) => format!("{name}={v:?} is malformed"),
    };
    CommError::InvalidArgument(format!(
        "NCCL rendezvous: {problem}; it must hold {what}. Start the job with torchrun (which sets \
         RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), or set all four for every process"
    ))
}

impl EnvRendezvous {
    /// Reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` from this process's environment.
    pub fn from_env() -> Result<EnvRendezvous, CommError> {
        EnvRendezvous::from_lookup(|name| {
            std::env::var_os(name).map(|v| v.into_string().unwrap_or_else(|_| "<not UTF-8>".into()))
        })
    }

    /// As [`EnvRendezvous::from_env`], with the variables read through `get` (for tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<EnvRendezvous, CommError> {
        let read = |name: &str| -> Result<String, CommError> {
            let v = get(name).ok_or_else(|| bad_var(name, None))?;
            if v.trim().is_empty() {
                return Err(bad_var(name, Some(&v)));
            }
            Ok(v.trim().to_string())
        };
        let number = |name: &str| -> Result<usize, CommError> {
            let v = read(name)?;
            v.parse::<usize>().map_err(|_| bad_var(name, Some(&v)))
        };
        let rank = number("RANK")?;
        let world_size = number("WORLD_SIZE")?;
        if world_size == 0 {
            return Err(bad_var("WORLD_SIZE", Some("0")));
        }
        if rank >= world_size {
            return Err(CommError::InvalidArgument(format!(
                "NCCL rendezvous: RANK={rank} is not below WORLD_SIZE={world_size}; every process \
                 needs a distinct RANK in 0..{world_size}"
            )));
        }
        let master_addr = read("MASTER_ADDR")?;
        let port = read("MASTER_PORT")?;
        let master_port = match port.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return Err(bad_var("MASTER_PORT", Some(&port))),
        };
        Ok(EnvRendezvous { rank, world_size, master_addr, master_port })
    }

    /// Rank 0: serves `id` to the other ranks and returns it. Other ranks: fetch it from rank 0
    /// (`make_id` is not called). Every wait gives up after `timeout`.
    pub fn exchange(
        &self,
        make_id: impl FnOnce() -> Result<[u8; ID_BYTES], CommError>,
        timeout: Duration,
    ) -> Result<[u8; ID_BYTES], CommError> {
        if self.rank == 0 {
            let id = make_id()?;
            if self.world_size > 1 {
                let listener = TcpListener::bind(("0.0.0.0", self.master_port)).map_err(|e| {
                    CommError::InvalidArgument(format!(
                        "rank 0: NCCL rendezvous cannot listen on port {} (MASTER_PORT): \
                             {e}; choose a free port",
                        self.master_port
                    ))
                })?;
                serve_id(&listener, self.world_size, &id, timeout)?;
            }
            Ok(id)
        } else {
            fetch_id(&self.master_addr, self.master_port, self.rank, self.world_size, timeout)
        }
    }
}

fn world(n: usize) -> Vec<usize> {
    (0..n).collect()
}

fn timeout_error(
    rank: usize,
    world_size: usize,
    timeout: Duration,
    missing: Vec<usize>,
    detail: String,
) -> CommError {
    CommError::Timeout {
        rank,
        kind: CollectiveKind::Broadcast,
        group: world(world_size),
        timeout,
        missing,
        detail,
    }
}

/// Rank 0's side: answers one connection from each rank `1..world_size` with `id`, refusing
/// (with a reason sent back) any that does not belong to this job. Returns once every rank has
/// its id, or fails after `timeout` naming the ranks that never connected.
pub fn serve_id(
    listener: &TcpListener,
    world_size: usize,
    id: &[u8; ID_BYTES],
    timeout: Duration,
) -> Result<(), CommError> {
    let deadline = Instant::now() + timeout;
    let io = |what: &str, e: std::io::Error| {
        CommError::InvalidArgument(format!("rank 0: NCCL rendezvous: {what}: {e}"))
    };
    listener.set_nonblocking(true).map_err(|e| io("setting up the listener", e))?;
    let mut served = BTreeSet::new();
    while served.len() + 1 < world_size {
        let (mut stream, _) = match listener.accept() {
            Ok(conn) => conn,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> =
                        (1..world_size).filter(|r| !served.contains(r)).collect();
                    return Err(timeout_error(
                        0,
                        world_size,
                        timeout,
                        missing,
                        format!(
                            "rank 0 served the NCCL id on port {} but these ranks never \
                             connected: check they run, with the same MASTER_ADDR/MASTER_PORT",
                            listener.local_addr().map_or(0, |a| a.port())
                        ),
                    ));
                }
                std::thread::sleep(RETRY);
                continue;
            }
            Err(e) => return Err(io("accepting a connection", e)),
        };
        let left = deadline.saturating_duration_since(Instant::now()).max(RETRY);
        // A client that connects and then says nothing must not stall rank 0 past the deadline.
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(left));
        let _ = stream.set_write_timeout(Some(left));
        let mut hello = [0u8; 24];
        if stream.read_exact(&mut hello).is_err() {
            continue; // not one of ours (a port scanner, a client that gave up): ignore it
        }
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&hello[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let (rank, size) = (word(8), word(16));
        let refusal = if hello[..8] != MAGIC {
            Some("it is not a Tessera NCCL rendezvous client".to_string())
        } else if size != world_size as u64 {
            Some(format!("it has WORLD_SIZE={size} but rank 0 has WORLD_SIZE={world_size}"))
        } else if rank == 0 || rank >= world_size as u64 {
            Some(format!("RANK={rank} is not in 1..{world_size}"))
        } else if served.contains(&(rank as usize)) {
            Some(format!("rank {rank} has already connected (two processes with RANK={rank})"))
        } else {
            None
        };
        let mut reply = Vec::with_capacity(9 + ID_BYTES);
        reply.extend_from_slice(&MAGIC);
        match &refusal {
            None => {
                reply.push(0);
                reply.extend_from_slice(id);
            }
            Some(why) => {
                reply.push(1);
                reply.extend_from_slice(&(why.len() as u32).to_le_bytes());
                reply.extend_from_slice(why.as_bytes());
            }
        }
        if stream.write_all(&reply).and_then(|()| stream.flush()).is_ok() && refusal.is_none() {
            served.insert(rank as usize);
        }
    }
    Ok(())
}

/// A non-zero rank's side: connects to rank 0 at `addr:port` (retrying until `timeout`) and
/// returns the id it serves.
pub fn fetch_id(
    addr: &str,
    port: u16,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<[u8; ID_BYTES], CommError> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match try_fetch(addr, port, rank, world_size, deadline) {
            Ok(id) => return Ok(id),
            Err(Attempt::Refused(why)) => {
                return Err(CommError::InvalidArgument(format!(
                    "rank {rank}: rank 0 at {addr}:{port} refused this process's NCCL \
                     rendezvous: {why}"
                )))
            }
            Err(Attempt::Fatal(e)) => return Err(e),
            Err(Attempt::Retry(why)) => why,
        };
        if Instant::now() >= deadline {
            return Err(timeout_error(
                rank,
                world_size,
                timeout,
                vec![0],
                format!(
                    "rank {rank} could not get the NCCL id from rank 0 at {addr}:{port} \
                     (MASTER_ADDR:MASTER_PORT); last attempt: {last}. Check rank 0 runs and \
                     that the address and port are right and reachable"
                ),
            ));
        }
        std::thread::sleep(RETRY);
    }
}

enum Attempt {
    /// Rank 0 is not (yet) reachable: try again until the deadline.
    Retry(String),
    /// Rank 0 answered that this process does not belong to its job.
    Refused(String),
    Fatal(CommError),
}

fn try_fetch(
    addr: &str,
    port: u16,
    rank: usize,
    world_size: usize,
    deadline: Instant,
) -> Result<[u8; ID_BYTES], Attempt> {
    let addrs: Vec<SocketAddr> = match (addr, port).to_socket_addrs() {
        Ok(a) => a.collect(),
        // A name that does not resolve may be a DNS hiccup at start-up: retry until the deadline.
        Err(e) => {
            return Err(Attempt::Retry(format!("MASTER_ADDR {addr:?} does not resolve: {e}")))
        }
    };
    let left = deadline.saturating_duration_since(Instant::now()).max(RETRY);
    let mut stream = None;
    let mut why = format!("MASTER_ADDR {addr:?} resolves to no address");
    for a in &addrs {
        match TcpStream::connect_timeout(a, left.min(Duration::from_secs(2))) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => why = format!("connecting to {a}: {e}"),
        }
    }
    let mut stream = stream.ok_or(Attempt::Retry(why))?;
    let left = deadline.saturating_duration_since(Instant::now()).max(RETRY);
    let _ = stream.set_read_timeout(Some(left));
    let _ = stream.set_write_timeout(Some(left));
    let mut hello = Vec::with_capacity(24);
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&(rank as u64).to_le_bytes());
    hello.extend_from_slice(&(world_size as u64).to_le_bytes());
    let retry = |what: &str, e: std::io::Error| Attempt::Retry(format!("{what}: {e}"));
    stream.write_all(&hello).map_err(|e| retry("sending the handshake", e))?;
    let mut head = [0u8; 9];
    stream.read_exact(&mut head).map_err(|e| retry("reading rank 0's answer", e))?;
    if head[..8] != MAGIC {
        return Err(Attempt::Fatal(CommError::InvalidArgument(format!(
            "rank {rank}: {addr}:{port} (MASTER_ADDR:MASTER_PORT) answered, but not as a Tessera \
             NCCL rendezvous: another service uses that port; choose another MASTER_PORT"
        ))));
    }
    if head[8] == 0 {
        let mut id = [0u8; ID_BYTES];
        stream.read_exact(&mut id).map_err(|e| retry("reading the id", e))?;
        return Ok(id);
    }
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).map_err(|e| retry("reading rank 0's refusal", e))?;
    let len = (u32::from_le_bytes(len) as usize).min(4096);
    let mut why = vec![0u8; len];
    stream.read_exact(&mut why).map_err(|e| retry("reading rank 0's refusal", e))?;
    Err(Attempt::Refused(String::from_utf8_lossy(&why).into_owned()))
}
