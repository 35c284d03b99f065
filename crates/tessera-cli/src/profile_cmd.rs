//! `tessera profile`: build the model's training step, lower it, and profile it.

use crate::format::{bytes, count, grouped};
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use serde_json::json;
use std::time::Instant;
use tessera_ir::{build_training_graph, DType, Program, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_profile::{profile, simulate_memory};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    /// fp32 weights, activations, gradients and AdamW state.
    Fp32,
    /// bf16 weights, activations and gradients; fp32 master weights and AdamW state.
    Bf16,
    /// fp16 weights, activations and gradients; fp32 master weights and AdamW state; dynamic
    /// loss scaling.
    Fp16,
}

impl std::fmt::Display for Precision {
    /// The flag's spelling (`--dtype bf16`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        })
    }
}

impl Precision {
    pub fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        }
    }
}

#[derive(Args, Debug)]
pub struct ProfileArgs {
    /// A preset (gpt2, llama2-7b, ...), a Hugging Face config.json, or a directory holding one.
    #[arg(long, default_value = "gpt2")]
    pub model: String,
    /// Global batch: sequences per training step.
    #[arg(long, default_value_t = 8)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::batch())]
    pub batch: usize,
    /// Sequence length (ignored by ViT, whose length is set by the image and patch size; a
    /// diffusion model's text tokens). Default: 1024, or the model's positions if it has fewer
    /// (gpt2-tiny: 256); 77 text tokens for a diffusion model.
    #[arg(long, allow_negative_numbers = true, value_parser = crate::limits::seq())]
    pub seq: Option<usize>,
    /// A diffusion model's sample side (latents for a latent model, square). Default: the
    /// config's `sample_size`.
    #[arg(long, allow_negative_numbers = true, value_parser = crate::limits::seq())]
    pub image_size: Option<usize>,
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub dtype: Precision,
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
    /// Also write the memory timeline (instruction, live bytes) as CSV to this file.
    #[arg(long)]
    pub timeline: Option<std::path::PathBuf>,
    /// Also draw the memory timeline, its peak marked, as an SVG file.
    #[arg(long, value_name = "FILE")]
    pub timeline_svg: Option<std::path::PathBuf>,
    /// Profile generation instead of a training step.
    #[command(flatten)]
    pub infer: crate::inference_cmd::InferenceArgs,
    #[command(flatten)]
    pub finetune: crate::finetune::FinetuneArgs,
}

/// `writeln!` into a `String` (which cannot fail).
macro_rules! outln {
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}

/// Writes to stdout; a closed pipe (`tessera profile | head`) is not an error.
pub fn print_stdout(text: &str) -> Result<()> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// The sequence length when none is given: a diffusion model's 77 text tokens, else 1024, or
/// the model's learned positions if fewer.
pub fn default_seq(cfg: &ModelConfig) -> usize {
    cfg.default_seq().unwrap_or_else(|| cfg.max_seq().map_or(1024, |m| m.min(1024)))
}

pub fn run(args: &ProfileArgs) -> Result<()> {
    if args.format == OutputFormat::Json {
        return print_stdout(&format!("{}\n", serde_json::to_string_pretty(&report(args)?)?));
    }
    let start = Instant::now();
    let (cfg, seq) = resolve(args)?;
    if args.infer.inference && crate::denoise_infer::is_denoiser(&cfg) {
        let (dtype, q) = (args.dtype.dtype(), args.infer.quantize);
        return print_stdout(&crate::denoise_infer::profile_table(
            &cfg, args.batch, seq, dtype, q,
        )?);
    }
    if args.infer.inference {
        return crate::inference_cmd::profile(args, &cfg, seq);
    }
    let Profiled { seq, program, prof, profile_ms } = profiled(args, &cfg, seq, start)?;
    let m = &prof.memory;
    let f = &prof.flops;
    let mut out = String::new();
    outln!(
        out,
        "{} · batch {} · seq {} · {:?} · {} parameters",
        cfg.name(),
        args.batch,
        seq,
        args.dtype,
        grouped(prof.params)
    );
    if prof.trainable_params != prof.params {
        outln!(out, "{} of them trainable, the rest frozen", grouped(prof.trainable_params));
    }
    out.push('\n');
    outln!(out, "FLOPs per step");
    outln!(out, "  forward    {:>14}", count(f.forward));
    outln!(out, "  backward   {:>14}", count(f.backward));
    outln!(out, "  optimizer  {:>14}", count(f.optimizer));
    outln!(out, "  total      {:>14}", count(f.total));
    outln!(out, "  matmul     {:>14}   (matmuls + attention, fwd + bwd)", count(f.matmul));
    out.push('\n');
    outln!(out, "Memory (one device, no sharding)");
    outln!(out, "  parameters         {:>12}", bytes(m.params_bytes));
    outln!(out, "  gradients          {:>12}", bytes(m.grads_bytes));
    outln!(out, "  optimizer state    {:>12}", bytes(m.optimizer_bytes));
    outln!(out, "  saved activations  {:>12}", bytes(m.activations_bytes));
    outln!(out, "  inputs             {:>12}", bytes(m.inputs_bytes));
    outln!(out, "  peak               {:>12}", bytes(m.peak_bytes));
    out.push('\n');
    outln!(out, "Live at the peak (instruction {} of {}):", m.peak_instr, program.instrs.len());
    for (role, b) in m.peak_by_role.iter().filter(|(_, b)| *b > 0) {
        outln!(out, "  {:<20} {:>12}", role.name(), bytes(*b));
    }
    outln!(out, "Largest groups live at the peak:");
    for grp in m.live_at_peak.iter().take(8) {
        outln!(
            out,
            "  {:>12}  {:<18} {} ({} buffer{})",
            bytes(grp.bytes),
            grp.role.name(),
            if grp.scope.is_empty() { "<root>" } else { &grp.scope },
            grp.buffers,
            if grp.buffers == 1 { "" } else { "s" }
        );
    }
    out.push('\n');
    outln!(out, "profiled in {profile_ms:.1} ms");
    print_stdout(&out)
}

/// What `tessera profile ARGS --format json` prints (whatever `args.format` says), its files
/// (`--timeline`, `--timeline-svg`) written.
pub fn report(args: &ProfileArgs) -> Result<serde_json::Value> {
    let start = Instant::now();
    let (cfg, seq) = resolve(args)?;
    if args.infer.inference && crate::denoise_infer::is_denoiser(&cfg) {
        let (dtype, q) = (args.dtype.dtype(), args.infer.quantize);
        return crate::denoise_infer::profile_report(&cfg, args.batch, seq, dtype, q);
    }
    if args.infer.inference {
        return crate::inference_cmd::profile_report(args, &cfg, seq);
    }
    let Profiled { seq, program, prof, profile_ms } = profiled(args, &cfg, seq, start)?;
    let m = &prof.memory;
    let f = &prof.flops;
    let by_role: serde_json::Map<String, serde_json::Value> =
        m.peak_by_role.iter().map(|(r, b)| (r.name().to_string(), json!(b))).collect();
    Ok(json!({
        "model": cfg.name(),
        "batch": args.batch,
        "seq": seq,
        "dtype": format!("{:?}", args.dtype).to_lowercase(),
        "params": prof.params,
        "trainable_params": prof.trainable_params,
        "flops": f,
        "memory": {
            "params_bytes": m.params_bytes,
            "grads_bytes": m.grads_bytes,
            "optimizer_bytes": m.optimizer_bytes,
            "activations_bytes": m.activations_bytes,
            "inputs_bytes": m.inputs_bytes,
            "peak_bytes": m.peak_bytes,
            "resting_bytes": m.resting_bytes,
            "max_workspace_bytes": m.max_workspace_bytes,
            "peak_by_role": by_role,
            "live_at_peak": m.live_at_peak,
            "activations_by_block": m.activations_by_block,
        },
        "graph": {
            "nodes": program.graph().nodes.len(),
            "tensors": program.graph().tensors.len(),
            "instructions": program.instrs.len(),
        },
        "profile_ms": profile_ms,
    }))
}

/// The model and the sequence length of a profile (`--seq`, else [`default_seq`]).
fn resolve(args: &ProfileArgs) -> Result<(ModelConfig, usize)> {
    let mut cfg = ModelConfig::resolve(&args.model)?;
    if let Some(side) = args.image_size {
        cfg = cfg.with_image_size(side)?;
    }
    let seq = args.seq.unwrap_or_else(|| default_seq(&cfg));
    Ok((cfg, seq))
}

/// A training step, lowered and profiled.
struct Profiled {
    /// The sequence length the model was built with.
    seq: usize,
    program: Program,
    prof: tessera_profile::Profile,
    /// Since `start`: resolving, building, lowering and profiling.
    profile_ms: f64,
}

/// Builds `cfg`'s training step, lowers and profiles it, and writes the timeline files.
fn profiled(args: &ProfileArgs, cfg: &ModelConfig, seq: usize, start: Instant) -> Result<Profiled> {
    let opts = BuildOptions { batch: args.batch, seq, dtype: args.dtype.dtype() };
    let model = args.finetune.resolve()?.apply(build(cfg, &opts)?)?;
    let seq = model.seq;
    let train = build_training_graph(model.builder, model.loss, &TrainConfig::default())
        .context("building the training graph")?;
    let program = Program::lower(train);
    let prof = profile(&program);
    let profile_ms = start.elapsed().as_secs_f64() * 1e3;

    if let Some(path) = &args.timeline {
        let trace = simulate_memory(&program);
        let mut csv = String::from("instr,live_bytes\n");
        for p in &trace.timeline {
            csv.push_str(&format!("{},{}\n", p.instr, p.live_bytes));
        }
        crate::output::write_output(path, csv.as_bytes())?;
    }
    if let Some(path) = &args.timeline_svg {
        let title = format!("{} · batch {} · seq {seq} · {}", cfg.name(), args.batch, args.dtype);
        crate::pictures::write_profile_timeline(path, &program, &title)?;
    }
    Ok(Profiled { seq, program, prof, profile_ms })
}
