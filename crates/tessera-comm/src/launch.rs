//! Rank and world discovery from the environment a launcher gives each process.
//!
//! A multi-process run is started by a launcher (`mpirun`, `srun`, `torchrun`) that tells every
//! process its rank and the world size through environment variables. [`discover`] reads them so
//! the runtime can pick a backend and print "rank 3 of 8 (srun)" before any communication, and
//! so that a half-configured environment fails at start-up with a message naming the variable,
//! instead of as a hang in the first collective.
//!
//! Launchers are tried in a fixed priority order — OpenMPI, Slurm, torchrun — because their
//! variables can coexist: `mpirun` inside a Slurm allocation still sees the batch step's
//! `SLURM_PROCID=0`, and `RANK`/`WORLD_SIZE` are generic names other tools set too. The first
//! launcher with any of its rank/size variables set decides; if that set is incomplete or
//! malformed it is an error, not a reason to try the next launcher (a typo should not silently
//! turn an 8-process run into 8 single-process runs).
//!
//! Note that a Slurm *batch script* (not an `srun` step) also has `SLURM_PROCID=0` and
//! `SLURM_NTASKS`: start the program with `srun`, or it will believe it is rank 0 of a larger
//! world.

use std::fmt;

use crate::error::{CommError, Result};

/// The program that started this process and set its rank variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// OpenMPI's `mpirun`/`mpiexec`: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`.
    OpenMpi,
    /// Slurm's `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`.
    Slurm,
    /// PyTorch's `torchrun` (or anything using its convention): `RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`.
    Torchrun,
}

impl Launcher {
    /// Every launcher, in the priority order [`discover_from`] tries them.
    pub const ALL: [Launcher; 3] = [Launcher::OpenMpi, Launcher::Slurm, Launcher::Torchrun];

    /// The variables this launcher sets: (rank, world size, local rank).
    pub fn variables(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Launcher::OpenMpi => {
                ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
            }
            Launcher::Slurm => ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
            Launcher::Torchrun => ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::OpenMpi => "mpirun",
            Launcher::Slurm => "srun",
            Launcher::Torchrun => "torchrun",
        })
    }
}

/// What a launcher told this process about its place in the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaunchEnv {
    pub launcher: Launcher,
    /// This process's global rank, `< world_size`.
    pub rank: usize,
    /// Number of processes in the job (at least 1).
    pub world_size: usize,
    /// This process's index among the processes on its node, when the launcher says.
    pub local_rank: Option<usize>,
}

/// Reads the launcher variables of the current process (see [`discover_from`]).
pub fn discover() -> Result<Option<LaunchEnv>> {
    // A variable that is set but not valid Unicode is reported as malformed, not ignored.
    discover_from(|name| {
        std::env::var_os(name).map(|v| v.into_string().unwrap_or_else(|_| "<not UTF-8>".into()))
    })
}

/// Reads rank and world size through `get` (a variable's value, or `None` when unset), trying
/// `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE` (+`OMPI_COMM_WORLD_LOCAL_RANK`), then
/// `SLURM_PROCID`/`SLURM_NTASKS` (+`SLURM_LOCALID`), then `RANK`/`WORLD_SIZE` (+`LOCAL_RANK`).
///
/// Returns `Ok(None)` when none of these rank/size variables is set (a plain single-process
/// run; a local-rank variable alone does not count). Fails with [`CommError::InvalidArgument`],
/// naming the variable and the fix, when the first launcher found has only one of its two
/// variables, a value that is not a non-negative integer, a zero world size, or a rank (or
/// local rank) not below the world size.
pub fn discover_from(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
    for launcher in Launcher::ALL {
        let (rank_var, size_var, local_var) = launcher.variables();
        let (rank, size) = match (get(rank_var), get(size_var)) {
            (None, None) => continue,
            (Some(rank), Some(size)) => (rank, size),
            (Some(_), None) => return Err(partial(launcher, rank_var, size_var)),
            (None, Some(_)) => return Err(partial(launcher, size_var, rank_var)),
        };
        let rank = parse(launcher, rank_var, &rank)?;
        let world_size = parse(launcher, size_var, &size)?;
        if world_size == 0 {
            return Err(CommError::InvalidArgument(format!(
                "{size_var} is 0, but a {launcher} job has at least one process; set it to the \
                 number of processes, or unset {rank_var} and {size_var} for a single-process run"
            )));
        }
        check_below(launcher, rank_var, rank, size_var, world_size)?;
        let local_rank = match get(local_var) {
            None => None,
            Some(v) => {
                let local = parse(launcher, local_var, &v)?;
                check_below(launcher, local_var, local, size_var, world_size)?;
                Some(local)
            }
        };
        return Ok(Some(LaunchEnv { launcher, rank, world_size, local_rank }));
    }
    Ok(None)
}

fn partial(launcher: Launcher, set: &str, unset: &str) -> CommError {
    CommError::InvalidArgument(format!(
        "{set} is set but {unset} is not; {launcher} sets both, so the environment is \
         incomplete: set {unset} too, or unset {set} for a single-process run"
    ))
}

fn parse(launcher: Launcher, var: &str, value: &str) -> Result<usize> {
    // Surrounding whitespace is a harmless artefact of hand-written job scripts; anything else
    // (signs, decimals, words) is a mistake worth stopping for.
    value.trim().parse::<usize>().map_err(|_| {
        CommError::InvalidArgument(format!(
            "{var} is {value:?}, which is not a non-negative integer; {launcher} sets it to a \
             process index or count: fix or unset it"
        ))
    })
}

fn check_below(
    launcher: Launcher,
    var: &str,
    value: usize,
    size_var: &str,
    size: usize,
) -> Result<()> {
    if value >= size {
        return Err(CommError::InvalidArgument(format!(
            "{var} is {value} but {size_var} is {size}: a {launcher} process index must be below \
             the world size; fix the launch command or the variables"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name| map.get(name).cloned()
    }

    fn found(pairs: &[(&str, &str)]) -> LaunchEnv {
        discover_from(env(pairs)).expect("valid environment").expect("a launcher is set")
    }

    fn error(pairs: &[(&str, &str)]) -> String {
        match discover_from(env(pairs)) {
            Err(CommError::InvalidArgument(msg)) => msg,
            other => panic!("expected InvalidArgument for {pairs:?}, got {other:?}"),
        }
    }

    #[test]
    fn no_launcher_is_none() {
        assert_eq!(discover_from(env(&[])).expect("empty env is fine"), None);
        // A local rank alone is not a launch: other tools set LOCAL_RANK too.
        assert_eq!(discover_from(env(&[("LOCAL_RANK", "0")])).expect("fine"), None);
    }

    #[test]
    fn each_launcher_is_read() {
        let e = found(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ]);
        assert_eq!(
            e,
            LaunchEnv { launcher: Launcher::OpenMpi, rank: 3, world_size: 8, local_rank: Some(1) }
        );
        let e = found(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "6"), ("SLURM_LOCALID", "2")]);
        assert_eq!(
            e,
            LaunchEnv { launcher: Launcher::Slurm, rank: 5, world_size: 6, local_rank: Some(2) }
        );
        let e = found(&[("RANK", "0"), ("WORLD_SIZE", "1")]);
        assert_eq!(
            e,
            LaunchEnv { launcher: Launcher::Torchrun, rank: 0, world_size: 1, local_rank: None }
        );
        let e = found(&[("RANK", " 2 "), ("WORLD_SIZE", "4\n"), ("LOCAL_RANK", "2")]);
        assert_eq!((e.rank, e.world_size, e.local_rank), (2, 4, Some(2)));
    }

    #[test]
    fn precedence_is_openmpi_then_slurm_then_torchrun() {
        let all = [
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
        ];
        assert_eq!(found(&all).launcher, Launcher::OpenMpi);
        assert_eq!((found(&all).rank, found(&all).world_size), (1, 2));
        assert_eq!(found(&all[2..]).launcher, Launcher::Slurm);
        assert_eq!(found(&all[4..]).launcher, Launcher::Torchrun);
        // A broken higher-priority set is an error, not a fall-through to the next launcher.
        let msg = error(&[("SLURM_PROCID", "0"), ("RANK", "3"), ("WORLD_SIZE", "8")]);
        assert!(msg.contains("SLURM_PROCID is set but SLURM_NTASKS is not"), "{msg}");
    }

    #[test]
    fn partial_sets_name_the_missing_variable() {
        let msg = error(&[("RANK", "1")]);
        assert!(msg.contains("RANK is set but WORLD_SIZE is not"), "{msg}");
        assert!(msg.contains("torchrun") && msg.contains("set WORLD_SIZE too"), "{msg}");
        let msg = error(&[("WORLD_SIZE", "4")]);
        assert!(msg.contains("WORLD_SIZE is set but RANK is not"), "{msg}");
        let msg = error(&[("OMPI_COMM_WORLD_SIZE", "4")]);
        assert!(msg.contains("OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_RANK"), "{msg}");
        let msg = error(&[("SLURM_NTASKS", "2")]);
        assert!(msg.contains("SLURM_NTASKS is set but SLURM_PROCID is not"), "{msg}");
    }

    #[test]
    fn malformed_values_are_errors() {
        let msg = error(&[("RANK", "one"), ("WORLD_SIZE", "4")]);
        assert!(msg.contains("RANK is \"one\", which is not a non-negative integer"), "{msg}");
        let msg = error(&[("RANK", "1"), ("WORLD_SIZE", "-4")]);
        assert!(msg.contains("WORLD_SIZE is \"-4\""), "{msg}");
        let msg = error(&[("SLURM_PROCID", "1.0"), ("SLURM_NTASKS", "4")]);
        assert!(msg.contains("SLURM_PROCID is \"1.0\""), "{msg}");
        let msg = error(&[("RANK", ""), ("WORLD_SIZE", "4")]);
        assert!(msg.contains("RANK is \"\""), "{msg}");
        let msg = error(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "x")]);
        assert!(msg.contains("LOCAL_RANK is \"x\""), "{msg}");
    }

    #[test]
    fn out_of_range_values_are_errors() {
        let msg = error(&[("OMPI_COMM_WORLD_RANK", "4"), ("OMPI_COMM_WORLD_SIZE", "4")]);
        assert!(
            msg.contains("OMPI_COMM_WORLD_RANK is 4 but OMPI_COMM_WORLD_SIZE is 4")
                && msg.contains("must be below the world size"),
            "{msg}"
        );
        let msg = error(&[("RANK", "0"), ("WORLD_SIZE", "0")]);
        assert!(msg.contains("WORLD_SIZE is 0"), "{msg}");
        let msg = error(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "2")]);
        assert!(msg.contains("SLURM_LOCALID is 2 but SLURM_NTASKS is 2"), "{msg}");
    }

    #[test]
    fn launcher_names_are_the_commands() {
        let names: Vec<String> = Launcher::ALL.iter().map(|l| l.to_string()).collect();
        assert_eq!(names, ["mpirun", "srun", "torchrun"]);
    }
}
