//! The `tessera` command as a library. Library crates return typed errors; here they become one
//! `error: ...` line on stderr and a non-zero exit (never a panic). Machine-readable output
//! (`--format json`) is the only thing written to stdout.
//!
//! Two front ends share this code: the binary (`main.rs`: [`main`] under a heap-counting
//! allocator) and the Python package (`crates/tessera-py`), whose `tessera.profile` and
//! `tessera.plan`, `tessera.train`, `tessera.eval` and `tessera.generate` call [`run_json`] —
//! the same parsing, defaults, validation and command code, so their objects are the JSON
//! `tessera ... --format json` prints. A front end's data, events and stop flag come in as
//! [`hooks::Hooks`].

mod calibrate_cmd;
mod calibrate_gpu;
mod checkpoint_cmd;
pub mod denoise_infer;
mod diffusion_args;
mod eval_cmd;
mod eval_io;
mod export_cmd;
mod export_plan;
pub mod finetune;
mod format;
mod generate_cmd;
mod gpu_plan;
pub mod hooks;
mod inference_cmd;
pub mod latent;
mod limits;
mod output;
mod pictures;
mod plan_cmd;
mod plan_file;
mod png;
mod profile_cmd;
mod run_file;
mod sample_cmd;
mod tier_args;
mod train_cmd;
mod train_guard;
mod train_launch;
mod train_prepare;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::ffi::OsString;
use std::process::ExitCode;

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
    /// Draw images from a class-conditional diffusion model (DiT) with DDIM or Euler and
    /// classifier-free guidance, as a PNG grid.
    Sample(Box<sample_cmd::SampleArgs>),
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

/// A command line clap refused, and whether it (with its run file's flags) asked for
/// `--format json`.
struct Refused {
    error: clap::Error,
    json: bool,
}

/// A command line as `tessera` reads it.
struct Parsed {
    command: Command,
    /// `--format json`: a failure is reported as JSON too (`error_json`).
    json: bool,
    /// What is wrong with the run file (`--config`), if anything: the command's failure.
    checked: anyhow::Result<()>,
}

/// Parses `argv` (program name first): a run file's flags join the command line's, which win
/// (`run_file`); the flags the user gave are recorded (a plan file supplies the others,
/// `plan_file`).
fn parse(argv: Vec<OsString>) -> Result<Parsed, Refused> {
    let run = run_file::expand(&Cli::command(), argv);
    let refused = |error| Refused { error, json: argv_wants_json(&run.argv) };
    let matches = Cli::command().try_get_matches_from(&run.argv).map_err(refused)?;
    let mut cli = Cli::from_arg_matches(&matches).map_err(refused)?;
    let json = wants_json(&matches) || (run.checked.is_err() && run_file::says_json(&matches));
    if let Some((_, sub)) = matches.subcommand() {
        let given =
            plan_file::Given::from_matches(sub).with_run_file(run.file.as_deref(), &run.ids);
        match &mut cli.command {
            Command::Train(args) => args.given = given,
            Command::Plan(args) => args.given = given,
            _ => {}
        }
    }
    Ok(Parsed { command: cli.command, json, checked: run.checked })
}

/// Whether the (innermost) subcommand of `matches` was given `--format json`: `checkpoint
/// verify`'s is a level down.
fn wants_json(matches: &clap::ArgMatches) -> bool {
    let Some((_, sub)) = matches.subcommand() else { return false };
    sub.try_get_one::<profile_cmd::OutputFormat>("format").ok().flatten()
        == Some(&profile_cmd::OutputFormat::Json)
        || wants_json(sub)
}

/// Whether a command line clap refused asked for `--format json` (or `--format=json`): its
/// refusal is then reported as JSON too.
fn argv_wants_json(argv: &[OsString]) -> bool {
    argv.iter().zip(argv.iter().skip(1)).any(|(a, b)| a == "--format" && b == "json")
        || argv.iter().any(|a| a == "--format=json")
}

/// A command line clap refused: its text on stderr (usage and all), and under `--format json`
/// the error object `{"error": {"kind": "usage", "message"}}` on stdout; exit status 2.
/// `--help` and `--version` print as clap prints them.
fn refuse_usage(Refused { error: e, json }: Refused) -> ExitCode {
    use clap::error::ErrorKind;
    let informational = matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    );
    if informational || !json {
        e.exit();
    }
    let _ = e.print();
    println!("{}", usage_json(&e));
    ExitCode::from(2)
}

/// `{"error": {"kind": "usage", "message"}}` for a command line clap refused: its text without
/// the usage lines and its own `error: `.
fn usage_json(e: &clap::Error) -> serde_json::Value {
    let text = e.render().to_string();
    let message = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more"))
        .collect::<Vec<_>>()
        .join(" ");
    let message = message.trim_start_matches("error: ").to_string();
    serde_json::json!({ "error": { "kind": "usage", "message": message } })
}

/// The `tessera` binary: parses the process's arguments, runs the command, reports a failure.
pub fn main() -> ExitCode {
    let parsed = match parse(std::env::args_os().collect()) {
        Ok(parsed) => parsed,
        Err(refused) => return refuse_usage(refused),
    };
    let json = parsed.json;
    // A run file the command cannot take is its failure (as JSON too under `--format json`).
    let result = parsed.checked.and_then(|()| match parsed.command {
        Command::Profile(args) => profile_cmd::run(&args),
        Command::Train(args) => train_cmd::run(&args),
        Command::Eval(args) => eval_cmd::run(&args),
        Command::Generate(args) => generate_cmd::run(&args),
        Command::Sample(args) => sample_cmd::run(&args),
        Command::Export(args) => export_cmd::run(&args),
        Command::Checkpoint(args) => checkpoint_cmd::run(&args),
        Command::Plan(args) => plan_cmd::run(&args),
        Command::Calibrate(args) => calibrate_cmd::run(&args),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let msg = message(&e);
            eprintln!("error: {msg}");
            if json {
                // Machine-readable too: one object on stdout, as a success would print.
                println!("{}", error_json(&e, &msg));
            }
            ExitCode::FAILURE
        }
    }
}

/// One line: the error and its causes, outermost first (what follows `error: ` on stderr).
fn message(e: &anyhow::Error) -> String {
    e.chain().map(|c| c.to_string()).collect::<Vec<_>>().join(": ")
}

/// Why [`json_report`] has no report: the message `tessera` prints after `error: `, and the
/// error object it prints under `--format json` (`{"kind", "message", ...}`; kind `usage` for a
/// command line clap refuses, which the binary answers with its usage text instead).
#[derive(Debug)]
pub struct ReportError {
    pub message: String,
    pub error: serde_json::Value,
}

/// What `tessera profile|plan|train|eval|generate ARGS --format json` prints on stdout, as a
/// value: `args` is the command line after the program name (`["plan", "--model",
/// "gpt2-tiny", ...]`), without `--format`. Files the flags name (`--timeline`, `--out`,
/// `--save`, pictures) are written as the command writes them; nothing is printed.
pub fn json_report<I, T>(args: I) -> Result<serde_json::Value, ReportError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    run_json(args, &hooks::Hooks::default())
}

/// The commands a front end runs for their JSON report ([`run_json`]).
const JSON_COMMANDS: [&str; 5] = ["profile", "plan", "train", "eval", "generate"];

/// [`json_report`] with a front end's hooks: `train`'s batches, progress and stop flag,
/// `generate`'s tokens as they come ([`hooks::Hooks`]). The flags are the command line's,
/// parsed by the same parser into the command's own arguments, so every flag a command
/// takes reaches it from here.
pub fn run_json<I, T>(args: I, hooks: &hooks::Hooks) -> Result<serde_json::Value, ReportError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    let usage = |message: String| {
        let error = serde_json::json!({ "kind": "usage", "message": message });
        ReportError { message, error }
    };
    let mut argv = vec![OsString::from("tessera")];
    argv.extend(args.into_iter().map(Into::into));
    let command = argv.get(1).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
    if !JSON_COMMANDS.contains(&command.as_str()) {
        return Err(usage(format!(
            "a JSON report is made by {}, not by `{command}`",
            JSON_COMMANDS.map(|c| format!("`{c}`")).join(", ")
        )));
    }
    argv.extend(["--format", "json"].map(OsString::from));
    // clap's text without its own `error: `.
    let parsed = parse(argv).map_err(|r| {
        let doc = usage_json(&r.error);
        usage(doc["error"]["message"].as_str().unwrap_or_default().to_string())
    })?;
    let result = parsed.checked.and_then(|()| match parsed.command {
        Command::Profile(args) => profile_cmd::report(&args),
        Command::Plan(args) => plan_cmd::report(&args),
        Command::Train(args) => train_cmd::report(&args, hooks),
        Command::Eval(args) => eval_cmd::report(&args),
        Command::Generate(args) => generate_cmd::report_json(&args, hooks),
        Command::Export(_)
        | Command::Checkpoint(_)
        | Command::Calibrate(_)
        | Command::Sample(_) => {
            unreachable!("checked above: one of JSON_COMMANDS")
        }
    });
    result.map_err(|e| {
        let message = message(&e);
        let mut doc = error_json(&e, &message);
        let error = doc["error"].take();
        ReportError { message, error }
    })
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
        Some(PlanError::Config { error: e, .. }) => {
            error["kind"] = "invalid".into();
            error["knob"] = e.knob().into();
        }
        Some(PlanError::Internal(_)) => error["kind"] = "internal".into(),
        None => error["kind"] = "failed".into(),
    }
    serde_json::json!({ "error": error })
}
