//! `tessera`: the command-line front end. Library crates return typed errors; here they
//! become one `error: ...` line on stderr and a non-zero exit (never a panic). Machine-readable
//! output (`--format json`) is the only thing written to stdout.

mod calibrate_cmd;
mod calibrate_gpu;
mod checkpoint_cmd;
mod eval_cmd;
mod export_cmd;
mod export_plan;
mod format;
mod generate_cmd;
mod inference_cmd;
mod pictures;
mod plan_cmd;
mod plan_file;
mod profile_cmd;
mod run_file;
mod tier_args;
mod train_cmd;
mod train_launch;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

/// Counts heap bytes so `train` can compare the real heap with the predicted peak.
#[global_allocator]
static ALLOC: tessera_runtime::alloc::CountingAlloc = tessera_runtime::alloc::CountingAlloc;

#[derive(Parser)]
#[command(name = "tessera", version, about = "Automatic parallel training of large models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// FLOPs and memory of one training step, computed symbolically (no tensor is allocated).
    Profile(profile_cmd::ProfileArgs),
    /// Train a model on text on N devices with a parallel plan (default: gpt2-tiny on the
    /// shipped corpus, 4 simulated devices, automatic plan), or on one with --devices 1.
    Train(Box<train_cmd::TrainArgs>),
    /// Next-token loss (and logits) of a checkpoint directory over given token ids.
    Eval(eval_cmd::EvalArgs),
    /// Generate text from a checkpoint with a KV cache, on one device or a tensor-parallel group.
    Generate(Box<generate_cmd::GenerateArgs>),
    /// Gather a checkpoint (sharded or not) into a Hugging Face model directory.
    Export(export_cmd::ExportArgs),
    /// Check a checkpoint: `tessera checkpoint verify DIR`.
    Checkpoint(checkpoint_cmd::CheckpointArgs),
    /// Find the fastest parallel plan that fits (or evaluate a given one) for a model on a cluster.
    Plan(Box<plan_cmd::PlanArgs>),
    /// Measure this CPU (matmul FLOP/s, memory and thread-to-thread bandwidth) and save it as
    /// the `cpu` device preset used by cluster strings like `4xcpu`.
    Calibrate(calibrate_cmd::CalibrateArgs),
}

fn main() -> ExitCode {
    // `--config FILE`: the run file's flags join the command line's, which win (`run_file`).
    let run = run_file::expand(&Cli::command(), std::env::args_os().collect());
    let matches = Cli::command().get_matches_from(&run.argv);
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // A failure under `--format json` is reported as JSON too (`error_json`).
    let json = matches.subcommand().is_some_and(|(_, sub)| {
        sub.try_get_one::<profile_cmd::OutputFormat>("format").ok().flatten()
            == Some(&profile_cmd::OutputFormat::Json)
    });
    // Which flags the user gave (a run file's count): a plan file supplies the others
    // (`plan_file`).
    if let Some((_, sub)) = matches.subcommand() {
        let given =
            plan_file::Given::from_matches(sub).with_run_file(run.file.as_deref(), &run.ids);
        match &mut cli.command {
            Command::Train(args) => args.given = given,
            Command::Plan(args) => args.given = given,
            _ => {}
        }
    }
    // A run file the command cannot take is its failure (as JSON too under `--format json`).
    let result = run.checked.and_then(|()| match cli.command {
        Command::Profile(args) => profile_cmd::run(&args),
        Command::Train(args) => train_cmd::run(&args),
        Command::Eval(args) => eval_cmd::run(&args),
        Command::Generate(args) => generate_cmd::run(&args),
        Command::Export(args) => export_cmd::run(&args),
        Command::Checkpoint(args) => checkpoint_cmd::run(&args),
        Command::Plan(args) => plan_cmd::run(&args),
        Command::Calibrate(args) => calibrate_cmd::run(&args),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the error and its causes, outermost first.
            let msg = e.chain().map(|c| c.to_string()).collect::<Vec<_>>().join(": ");
            eprintln!("error: {msg}");
            if json {
                // Machine-readable too: one object on stdout, as a success would print.
                println!("{}", error_json(&e, &msg));
            }
            ExitCode::FAILURE
        }
    }
}

/// `{"error": {"kind", "message", ...}}`: `infeasible` (with `needed_bytes`, the least memory
/// per device any plan needs, `budget_bytes`, and the `hint`: what reaches it, what to
/// change), `invalid` (bad input the planner refused), `internal`, or `failed` (anything
/// else: files, data, a run that stopped).
fn error_json(e: &anyhow::Error, message: &str) -> serde_json::Value {
    use tessera_plan::PlanError;
    let planner = e.chain().find_map(|c| c.downcast_ref::<PlanError>());
    let mut error = serde_json::json!({ "message": message });
    match planner {
        Some(PlanError::Infeasible { budget, needed, hint }) => {
            error["kind"] = "infeasible".into();
            error["needed_bytes"] = (*needed).into();
            error["budget_bytes"] = (*budget).into();
            error["hint"] = hint.as_str().into();
        }
        Some(PlanError::TierInfeasible { tier, budget, needed, hint }) => {
            error["kind"] = "infeasible".into();
            error["tier"] = tier.name().into();
            error["needed_bytes"] = (*needed).into();
            error["budget_bytes"] = (*budget).into();
            error["hint"] = hint.as_str().into();
        }
        Some(PlanError::Invalid(_)) => error["kind"] = "invalid".into(),
        Some(PlanError::Internal(_)) => error["kind"] = "internal".into(),
        None => error["kind"] = "failed".into(),
    }
    serde_json::json!({ "error": error })
}
