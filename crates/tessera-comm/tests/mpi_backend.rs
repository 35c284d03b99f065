//! The MPI backend under a real launcher: runs the `mpi_selftest` example with OpenMPI's
//! `mpirun` on 2 and 4 ranks (every collective, on the world and on mesh rows and columns,
//! checked bit for bit; tagged send/recv; a thousand small calls leaving no messages behind; a
//! recv timing out on a tag nobody sends), and checks that a
//! rank that never joins a collective makes the job end in bounded time with a timeout error
//! naming rank, collective, group and the rank that stalled.
//!
//! Compiled only with the `mpi` feature (`cargo test -p tessera-comm --features mpi`). A
//! missing `mpirun` fails the tests with a pointer to `scripts/setup.sh`; it never skips them.
#![cfg(feature = "mpi")]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long one `mpirun` may take before the test kills it (the correctness runs take about a
/// second; the failure runs about 3 s plus launch).
const JOB_LIMIT: Duration = Duration::from_secs(120);

/// One MPI job at a time: the machine may have only two cores, and four spinning ranks of one
/// job are enough load for the timing assertions of another.
static ONE_JOB: Mutex<()> = Mutex::new(());

/// The `mpi_selftest` binary, built once per test process.
///
/// The example is built by running cargo itself (the `CARGO` it was started by) rather than
/// guessing a path under `target/`: `cargo test --test mpi_backend` does not build examples,
/// a path found by guessing may hold a stale binary, and the target directory and profile
/// depend on `CARGO_TARGET_DIR`, `--release` and `--target`. Cargo rebuilds it only if needed
/// (under `cargo test --workspace` it is already built, so this is a no-op) and reports the
/// executable's path in its JSON messages. The build uses the test binary's own profile so it
/// reuses the same compiled dependencies.
fn selftest_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(env!("CARGO_MANIFEST_DIR")).args([
            "build",
            "-p",
            "tessera-comm",
            "--features",
            "mpi",
            "--example",
            "mpi_selftest",
            "--message-format=json-render-diagnostics",
        ]);
        // Test binaries live in <target>/<profile dir>/deps; "debug" is the dev profile's dir.
        let exe = std::env::current_exe().expect("the test binary's path");
        let profile_dir = exe.parent().and_then(Path::parent).and_then(Path::file_name);
        if let Some(dir) = profile_dir.and_then(|d| d.to_str()) {
            cmd.args(["--profile", if dir == "debug" { "dev" } else { dir }]);
        }
        let out = cmd.stderr(Stdio::inherit()).output().expect("running cargo build");
        assert!(out.status.success(), "building the mpi_selftest example failed: {}", out.status);
        let stdout = String::from_utf8_lossy(&out.stdout);
        stdout
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|msg| msg["reason"] == "compiler-artifact")
            .filter(|msg| msg["target"]["name"] == "mpi_selftest")
            .find_map(|msg| msg["executable"].as_str().map(PathBuf::from))
            .unwrap_or_else(|| panic!("cargo reported no mpi_selftest executable:\n{stdout}"))
    })
}

/// Fails (never skips) when OpenMPI's `mpirun` is not installed.
fn require_openmpi() {
    let version = match Command::new("mpirun").arg("--version").output() {
        Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned(),
        Err(e) => panic!(
            "mpirun could not be run ({e}): the MPI backend's tests need OpenMPI; run \
             scripts/setup.sh (it installs libopenmpi-dev and openmpi-bin)"
        ),
    };
    assert!(
        version.contains("Open MPI"),
        "mpirun is not OpenMPI's (it says {version:?}); these tests use OpenMPI's options: run \
         scripts/setup.sh and put OpenMPI's mpirun first on PATH"
    );
}

/// What one `mpirun` job did.
struct Job {
    status: ExitStatus,
    /// Stdout then stderr, of mpirun and every rank.
    output: String,
    elapsed: Duration,
}

/// Runs `mpirun -n ranks mpi_selftest mode` (`mode` may hold arguments after the mode, separated
/// by spaces), killing it after [`JOB_LIMIT`].
fn mpirun(ranks: usize, mode: &str) -> Job {
    require_openmpi();
    let binary = selftest_binary();
    let _one = ONE_JOB.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let start = Instant::now();
    let mut child = Command::new("mpirun")
        // CI runs as root, which mpirun refuses without both the flag and these variables
        // (older releases want one, newer the other).
        .arg("--allow-run-as-root")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // More ranks than cores, unbound: a 2-core machine runs the 4-rank job.
        .args(["--oversubscribe", "--bind-to", "none"])
        // Containers often forbid the cross-process memory access (CMA) that shared-memory
        // transfers of large messages use by default; plain copies work everywhere.
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        // mpirun's own limit, so a hung job is ended with its ranks, not just mpirun.
        .args(["--timeout", &JOB_LIMIT.as_secs().to_string()])
        .args(["-n", &ranks.to_string()])
        .arg(binary)
        .args(mode.split_whitespace())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting mpirun");
    // Drain both pipes while waiting, or a chatty job could block on a full pipe.
    let readers = [read_all(child.stdout.take()), read_all(child.stderr.take())];
    let status = wait_at_most(&mut child, JOB_LIMIT + Duration::from_secs(30));
    let output: String = readers.into_iter().map(|r| r.join().unwrap_or_default()).collect();
    let elapsed = start.elapsed();
    match status {
        Some(status) => Job { status, output, elapsed },
        None => panic!("mpirun -n {ranks} {mode} did not end within {elapsed:?}:\n{output}"),
    }
}

fn read_all(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut pipe) = pipe {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
        text
    })
}

/// The child's status, or `None` after killing it once `limit` has passed.
fn wait_at_most(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn assert_every_rank_ok(ranks: usize) {
    let job = mpirun(ranks, "check");
    assert!(job.status.success(), "mpirun -n {ranks} failed ({}):\n{}", job.status, job.output);
    for r in 0..ranks {
        let line = format!("mpi_selftest: rank {r} of {ranks}: ok");
        assert!(job.output.lines().any(|l| l == line), "no {line:?} in:\n{}", job.output);
    }
}

#[test]
fn every_collective_on_2_ranks() {
    assert_every_rank_ok(2);
}

#[test]
fn every_collective_on_4_ranks_with_mesh_rows_and_columns() {
    assert_every_rank_ok(4);
}

/// A thousand one-element all-reduces on the world and the mesh columns: the backend's own
/// messages (call announcements) must neither pile up during the run (the example checks its
/// backlog after every call) nor be left unreceived at the end (MPI is finalised cleanly,
/// without the backend's warning).
#[test]
fn a_thousand_small_calls_leave_no_messages_behind() {
    let job = mpirun(4, "many 1000");
    assert!(job.status.success(), "mpirun -n 4 failed ({}):\n{}", job.status, job.output);
    for r in 0..4 {
        let line = format!("mpi_selftest: rank {r} of 4: ok");
        assert!(job.output.lines().any(|l| l == line), "no {line:?} in:\n{}", job.output);
    }
    assert!(!job.output.contains("tessera-comm:"), "a warning at finalisation:\n{}", job.output);
}

/// A recv on a tag the peer never sends on (3 s timeout, while a message on another tag
/// waits) times out naming the peer and the tag, and leaves the rank usable: it then receives
/// the other tag's message, and both ranks end normally.
#[test]
fn a_recv_on_a_tag_nobody_sends_times_out_naming_peer_and_tag() {
    let job = mpirun(2, "tag-timeout");
    assert!(job.status.success(), "mpirun -n 2 failed ({}):\n{}", job.status, job.output);
    assert!(
        job.output.lines().any(|l| l.starts_with(
            "mpi_selftest: rank 0 timed out: rank 0: recv from rank 1 timed out after 3s"
        ) && l.contains("no message with tag 7 from rank 1 arrived")),
        "no timeout naming rank 1 and tag 7 in:\n{}",
        job.output
    );
    for r in 0..2 {
        let line = format!("mpi_selftest: rank {r} of 2: ok");
        assert!(job.output.lines().any(|l| l == line), "no {line:?} in:\n{}", job.output);
    }
    assert!(!job.output.contains("tessera-comm:"), "a warning at finalisation:\n{}", job.output);
}

/// Rank 1 leaves without calling the all-reduce rank 0 waits in (3 s timeout): the job must
/// end well within a minute, failed, with rank 0's timeout error naming the collective and
/// rank 1.
#[test]
fn a_rank_that_never_arrives_ends_the_job_with_a_timeout() {
    let job = mpirun(2, "stuck");
    assert!(job.elapsed < Duration::from_secs(60), "took {:?}:\n{}", job.elapsed, job.output);
    assert!(!job.status.success(), "the job should fail:\n{}", job.output);
    assert!(
        job.output.contains(
            "rank 0: all_reduce over ranks [0, 1] timed out after 3s waiting for ranks [1]"
        ) && job.output.contains("rank 1 (no call here yet) has not entered this call, #0"),
        "no timeout error from rank 0 naming rank 1 in:\n{}",
        job.output
    );
}

/// Rank `stalled` sleeps before an all-reduce on the world that every other rank calls (2 s
/// timeout), after `calls_before` calls there: each other rank's error must name it, and it
/// alone, as missing, with the last call it entered.
fn assert_stalled_rank_is_named(ranks: usize, stalled: usize, calls_before: u64) {
    let job = mpirun(ranks, &format!("stall {stalled}"));
    assert!(job.elapsed < Duration::from_secs(60), "took {:?}:\n{}", job.elapsed, job.output);
    assert!(!job.status.success(), "the job should fail:\n{}", job.output);
    let world: Vec<usize> = (0..ranks).collect();
    for r in (0..ranks).filter(|&r| r != stalled) {
        let error = format!(
            "rank {r} of {ranks}: FAILED: rank {r}: all_reduce over ranks {world:?} timed out \
             after 2s waiting for ranks [{stalled}]"
        );
        let why = format!(
            "rank {stalled} (its last call here was #{}) has not entered this call, \
             #{calls_before} of this group",
            calls_before - 1
        );
        assert!(
            job.output.lines().any(|l| l.contains(&error) && l.contains(&why)),
            "no error from rank {r} naming rank {stalled} ({error:?}, {why:?}) in:\n{}",
            job.output
        );
    }
}

#[test]
fn a_stalled_rank_is_named_by_the_other_of_2() {
    // Six all-reduces (the mesh column is the world) and a barrier before the stall.
    assert_stalled_rank_is_named(2, 0, 7);
}

#[test]
fn a_stalled_middle_rank_is_named_by_every_other_of_4() {
    // Three all-reduces and a barrier on the world before the stall (and three on the columns).
    assert_stalled_rank_is_named(4, 2, 4);
}

/// The same on a sub-group still being set up, where the error can name the missing member.
#[test]
fn a_missing_member_of_a_new_group_is_named() {
    let job = mpirun(3, "stuck-group");
    assert!(job.elapsed < Duration::from_secs(60), "took {:?}:\n{}", job.elapsed, job.output);
    assert!(!job.status.success(), "the job should fail:\n{}", job.output);
    assert!(
        job.output.contains(
            "rank 0: all_reduce over ranks [0, 1] timed out after 3s waiting for ranks [1]"
        ) && job.output.contains("rank 1 has not started a call on this group"),
        "no timeout error naming rank 1 in:\n{}",
        job.output
    );
}
