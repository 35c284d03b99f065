//! `tessera checkpoint verify DIR`: checks a checkpoint (single-device or sharded) the way a
//! resume would and more: the manifest's seal, every file's checksum (naming the file and the
//! tensors whose bytes changed), the tensor table, and that every weight and optimizer
//! moment is finite. Exits non-zero, listing every problem, when any is found.

use crate::profile_cmd::{print_stdout, OutputFormat};
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::json;
use std::path::{Path, PathBuf};
use tessera_runtime::integrity::{check_weights_dir, verify_checkpoint, DirCheck};

#[derive(Args, Debug)]
pub struct CheckpointArgs {
    #[command(subcommand)]
    pub command: CheckpointCommand,
}

#[derive(Subcommand, Debug)]
pub enum CheckpointCommand {
    /// Check a checkpoint's bytes against the checksums saved with it, and its weights for
    /// NaN or infinity, without loading it into a model.
    Verify(VerifyArgs),
}

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// Checkpoint directory written by `tessera train --save`.
    pub dir: PathBuf,
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
}

pub fn run(args: &CheckpointArgs) -> Result<()> {
    match &args.command {
        CheckpointCommand::Verify(v) => verify(v),
    }
}

fn verify(args: &VerifyArgs) -> Result<()> {
    let report = verify_checkpoint(&args.dir)
        .with_context(|| format!("verifying checkpoint {}", args.dir.display()))?;
    match args.format {
        OutputFormat::Json => print_stdout(&format!(
            "{}\n",
            json!({"dir": args.dir.display().to_string(), "ok": true, "step": report.step,
                   "files_checked": report.files_checked, "bytes_checked": report.bytes,
                   "tensors": report.tensors, "checksums": report.checksums})
        )),
        OutputFormat::Table => {
            let sums = if report.checksums {
                format!(
                    "{} files ({}) match their checksums",
                    report.files_checked,
                    crate::format::bytes(report.bytes)
                )
            } else {
                "no checksums (saved by an older Tessera): headers and values checked only"
                    .to_string()
            };
            print_stdout(&format!(
                "{}: ok at step {}; {sums}; {} tensors finite\n",
                args.dir.display(),
                report.step,
                report.tensors
            ))
        }
    }
}

/// Checks a directory of weights before a command builds a model from it (`eval`, `generate`,
/// `train --init`), as `verify` and `--resume` do: a Tessera checkpoint's unreadable, empty or
/// altered manifest is refused, and its `config.json` must match the manifest's checksum; a
/// checkpoint saved before checksums is loaded with a note saying what was not checked.
pub fn check_before_load(dir: &Path, flag: &str) -> Result<()> {
    let checked = check_weights_dir(dir).with_context(|| format!("{flag} {}", dir.display()))?;
    if checked == DirCheck::NoChecksums {
        eprintln!(
            "note: {flag} {}: saved before checkpoints carried checksums; its config.json and \
             weights cannot be checked against them (weights are still checked for NaN and \
             infinity); re-save it to add them",
            dir.display()
        );
    }
    Ok(())
}
