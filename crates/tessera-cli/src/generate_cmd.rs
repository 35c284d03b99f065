//! `tessera generate`: text from a checkpoint, with a KV cache, on one device or a
//! tensor-parallel group of simulated devices (threads).
//!
//! The CLI parses and reports only: the model builds one prefill and one decode step
//! (`tessera_models::build_generation`), the planner lowers them to the Program each device
//! runs and predicts its memory (`tessera_plan::generate`), and the runtime executes them
//! (`tessera_runtime::generate`). Each device reads only its slices of the checkpoint
//! (quantising its rows as it reads them with `--quantize`); every device samples the same
//! token from the same gathered logits, and rank 0 streams them.
//!
//! `--device cuda` runs each device on a GPU (the same Programs, on the CUDA backend): GPU i for
//! device i, or GPUs shared round-robin when there are fewer than devices
//! ([`crate::gpu_plan::rank_placement`]); the devices' collectives go through the host as on the CPU.

use crate::profile_cmd::{print_stdout, OutputFormat};
use crate::train_cmd::{parse_size, DeviceKind};
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tessera_ir::DType;
use tessera_models::{
    build, build_generation, BuildOptions, GenerateOptions, GenerationModel, ModelConfig, Quantize,
};
use tessera_plan::cost::CostModel;
use tessera_plan::generate::{lower_step, GenerationStep};
use tessera_plan::{Cluster, Mesh};
use tessera_runtime::collective::{CommRunner, DeviceMesh, ReshardRunner};
use tessera_runtime::data::Tokenizer;
use tessera_runtime::generate::{Generated, Generator, QuantizedLeaf, StepProgram};
use tessera_runtime::hf_weights::open_weights;
use tessera_runtime::sampling::Sampling;
use tessera_runtime::{Backend, CpuBackend};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Directory with config.json and model.safetensors (or a sharded index), or a checkpoint
    /// `train` saved (sharded or not).
    #[arg(long)]
    pub model_dir: PathBuf,
    /// A prompt as text (repeat for a batch of prompts, generated together).
    #[arg(long)]
    pub prompt: Vec<String>,
    /// A prompt as comma-separated token ids (repeatable, instead of --prompt).
    #[arg(long)]
    pub tokens: Vec<String>,
    /// New tokens per prompt.
    #[arg(long, default_value_t = 32)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::seq())]
    pub max_new_tokens: usize,
    /// An HF tokenizer.json (default: the model directory's, else bytes when the vocabulary
    /// holds them).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Devices, one tensor-parallel group: threads of this process (simulated devices on the
    /// CPU; with --device cuda, a GPU each, shared round-robin when there are fewer GPUs).
    #[arg(long, default_value_t = 1)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::devices())]
    pub devices: usize,
    /// Where the kernels run: `cpu`, or `cuda` (NVIDIA GPUs; needs a `tessera` built with
    /// `--features cuda` and an NVIDIA driver).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// The parallel layout: `tpN` (Megatron-LM's tensor parallelism over N devices; default
    /// `tp<devices>`).
    #[arg(long)]
    pub plan: Option<String>,
    /// Weight-only quantisation of the linear layers: int8 (per output channel) or int4
    /// (groups of 128 input features).
    #[arg(long, value_parser = parse_quantize)]
    pub quantize: Option<Quantize>,
    /// 0: greedy; otherwise sample with this temperature.
    #[arg(long, default_value_t = 0.0)]
    #[arg(allow_hyphen_values = true, value_parser = crate::limits::temperature)]
    pub temperature: f64,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::top_k())]
    pub top_k: usize,
    /// Sample among the most likely tokens whose probability reaches p.
    #[arg(long, default_value_t = 1.0)]
    #[arg(allow_hyphen_values = true, value_parser = crate::limits::top_p)]
    pub top_p: f64,
    #[arg(long, default_value_t = 0)]
    #[arg(allow_negative_numbers = true, value_parser = crate::limits::seed())]
    pub seed: u64,
    /// Stop a prompt at this token (default: config.json's eos_token_id, if any; -1: never).
    #[arg(long, allow_hyphen_values = true, value_parser = crate::limits::eos())]
    pub eos: Option<i64>,
    /// Weights, caches and activations dtype.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: DType,
    /// Memory budget per device (e.g. 200MiB): a step that would exceed it stops with the
    /// tensor it could not allocate.
    #[arg(long, value_parser = parse_size)]
    pub memory_budget: Option<u64>,
    /// Seconds a device waits for the others in a collective before giving up.
    #[arg(long, default_value_t = 30.0)]
    #[arg(allow_hyphen_values = true, value_parser = crate::limits::comm_timeout)]
    pub comm_timeout: f64,
    /// Write the logits each new token was chosen from (JSON: per step, per prompt, the
    /// vocabulary's logits) to this file.
    #[arg(long)]
    pub logits: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
}

pub fn parse_quantize(s: &str) -> Result<Quantize, String> {
    Quantize::parse(s).ok_or_else(|| format!("`{s}`: give int8 or int4"))
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    match DType::parse(s) {
        Some(d) if d.is_float() => Ok(d),
        _ => Err(format!("`{s}`: give f32, bf16 or f16")),
    }
}

/// The tensor-parallel degree a `--plan` names (`tpN`), for `devices` devices.
fn tp_degree(plan: Option<&str>, devices: usize) -> Result<usize> {
    let Some(plan) = plan else { return Ok(devices) };
    let tp = plan
        .split([' ', '+'])
        .filter(|p| !p.is_empty())
        .map(|p| match p.strip_prefix("tp").and_then(|n| n.parse::<usize>().ok()) {
            Some(n) if n > 0 => Ok(n),
            _ => Err(anyhow!(
                "--plan `{plan}`: generation runs tensor parallelism only, as `tpN` (e.g. \
                 --plan tp{devices}); `{p}` is not that"
            )),
        })
        .collect::<Result<Vec<usize>>>()?;
    match tp.as_slice() {
        [n] if *n == devices => Ok(*n),
        [n] => bail!("--plan tp{n} needs --devices {n} (got --devices {devices})"),
        _ => bail!("--plan `{plan}`: give one `tpN`"),
    }
}

/// The prompts as token ids, and the tokenizer to show new tokens with.
fn prompts(args: &GenerateArgs, vocab: usize) -> Result<(Vec<Vec<i64>>, Option<Tokenizer>)> {
    let tokenizer = match &args.tokenizer {
        Some(path) => Some(Tokenizer::from_file(path)?),
        None if args.model_dir.join("tokenizer.json").is_file() => {
            Some(Tokenizer::from_file(args.model_dir.join("tokenizer.json"))?)
        }
        None if vocab >= 256 => Some(Tokenizer::Byte),
        None => None,
    };
    let mut out = Vec::new();
    for t in &args.tokens {
        out.push(crate::limits::token_ids(t)?);
    }
    for p in &args.prompt {
        let Some(tk) = &tokenizer else {
            bail!(
                "--prompt needs a tokenizer: the vocabulary of {vocab} holds no bytes; give \
                 --tokenizer tokenizer.json or --tokens IDS"
            );
        };
        out.push(tk.encode(p)?.into_iter().map(i64::from).collect());
    }
    if out.is_empty() {
        bail!("give a prompt: --prompt TEXT or --tokens IDS (repeat either for a batch)");
    }
    for (i, ids) in out.iter().enumerate() {
        if ids.is_empty() {
            bail!("prompt {i} has no tokens");
        }
        if let Some(id) = ids.iter().find(|&&id| id < 0 || id as usize >= vocab) {
            bail!("token id {id} in prompt {i} is outside the model's vocabulary of {vocab}");
        }
    }
    Ok((out, tokenizer))
}

/// config.json's `eos_token_id` (a number, or the first of a list).
fn config_eos(dir: &Path) -> Option<i64> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    match &v["eos_token_id"] {
        serde_json::Value::Number(n) => n.as_i64(),
        serde_json::Value::Array(a) => a.first().and_then(serde_json::Value::as_i64),
        _ => None,
    }
}

/// The planned prefill and decode steps of one device, and the quantised weights' sources.
struct Planned {
    prefill: GenerationStep,
    decode: GenerationStep,
    quantized: Vec<QuantizedLeaf>,
    /// A float forward graph of the model: what the checkpoint is checked against.
    reference: tessera_ir::Graph,
}

fn plan(
    cfg: &ModelConfig,
    args: &GenerateArgs,
    batch: usize,
    prompt: usize,
    tp: usize,
) -> Result<Planned> {
    let capacity = crate::limits::kv_capacity(
        cfg,
        prompt,
        args.max_new_tokens,
        "the longest --prompt/--tokens",
        "--max-new-tokens",
    )?;
    let step = |seq: usize| GenerateOptions {
        batch,
        seq,
        capacity,
        dtype: args.dtype,
        quantize: args.quantize,
        all_logits: false,
    };
    let cluster = Cluster::parse(&format!("{tp}xcpu"))?;
    let mesh = Mesh::new(&cluster, &[1, tp], &["dp", "tp"])?;
    let cost = CostModel::for_cluster(&cluster);
    let pre = build_generation(cfg, &step(prompt))?;
    let quantized = quantized_leaves(&pre);
    let logits = pre.logits;
    let prefill = lower_step(&pre.builder.finish(), logits, &mesh, &cost)?;
    let dec = build_generation(cfg, &step(1))?;
    let logits = dec.logits;
    let decode = lower_step(&dec.builder.finish(), logits, &mesh, &cost)?;
    let reference = build(cfg, &BuildOptions::new(1, 1, DType::F32))?.builder.finish();
    Ok(Planned { prefill, decode, quantized, reference })
}

/// The quantised weights of a generation step, by name, for the runtime's loader.
pub fn quantized_leaves(m: &GenerationModel) -> Vec<QuantizedLeaf> {
    let name = |t| m.builder.graph.tensor_scope(t).to_string();
    m.quantized
        .iter()
        .map(|q| QuantizedLeaf {
            weight: name(q.weight),
            scales: name(q.scales),
            source: q.source.clone(),
            transposed: q.transposed,
            spec: q.spec,
        })
        .collect()
}

fn step_program(s: &GenerationStep) -> StepProgram {
    StepProgram { program: s.program.clone(), layout: s.layout.clone(), logits: s.logits }
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    generate(args, &crate::hooks::Hooks::default(), true).map(|_| ())
}

/// `generate` for a front end (Python): what `--format json` prints, as a value; each new
/// token goes to the hooks' events as it comes (`token`: step, tokens (one per prompt), and
/// with a tokenizer and one prompt the text it adds).
pub fn report_json(args: &GenerateArgs, hooks: &crate::hooks::Hooks) -> Result<serde_json::Value> {
    generate(args, hooks, false)?.context(
        "generate from Python runs on this process's devices; under mpirun/srun/torchrun, run \
         the `tessera generate` command on every rank",
    )
}

/// The generation `args` ask for: the text streamed to stdout and the report printed when
/// `print`; the report (none on ranks other than 0 under a launcher).
fn generate(
    args: &GenerateArgs,
    hooks: &crate::hooks::Hooks,
    print: bool,
) -> Result<Option<serde_json::Value>> {
    if args.model_dir.extension().is_some_and(|e| e.eq_ignore_ascii_case("onnx")) {
        bail!(
            "--model-dir {}: generate needs a Hugging Face model directory (config.json and \
             model.safetensors) or a checkpoint directory `train --save` wrote; an ONNX file \
             is for profile, plan, train (--model) and eval (--model-dir)",
            args.model_dir.display()
        );
    }
    crate::checkpoint_cmd::check_before_load(&args.model_dir, "--model-dir")?;
    let cfg = ModelConfig::from_path(&args.model_dir)?.without_dropout();
    let vocab =
        cfg.vocab_size().context("generate needs a language model (one with a vocabulary)")?;
    if cfg.family() == "bert" {
        bail!("generate runs causal language models (gpt2, llama, mistral, qwen2, bloom); bert is a masked LM");
    }
    if args.devices == 0 {
        bail!("--devices must be at least 1");
    }
    if args.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    if !(args.comm_timeout.is_finite() && args.comm_timeout > 0.0) {
        bail!("--comm-timeout {} must be a positive number of seconds", args.comm_timeout);
    }
    let valid = args.top_p > 0.0 && args.top_p <= 1.0 && args.temperature >= 0.0;
    if !valid {
        bail!("--top-p must be in (0, 1] and --temperature at least 0");
    }
    let tp = tp_degree(args.plan.as_deref(), args.devices)?;
    let (prompts, tokenizer) = prompts(args, vocab)?;
    let batch = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
    let planned = plan(&cfg, args, batch, longest, tp)?;
    let eos = match args.eos {
        Some(e) if e < 0 => None,
        Some(e) if e as u64 >= vocab as u64 => bail!(
            "--eos {e} is outside the model's vocabulary of {vocab} (ids 0 to {}): give an id \
             below {vocab}, or -1 to never stop early",
            vocab - 1
        ),
        Some(e) => Some(e),
        None => config_eos(&args.model_dir),
    };
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    let source = open_weights(&args.model_dir, &planned.reference)?;
    let stream = print && args.format == OutputFormat::Table && batch == 1;
    let shown = std::sync::Mutex::new(Vec::<i64>::new());
    let show = |step: usize, tokens: &[i64]| {
        // The text the new token adds (decoding the whole tail keeps multi-byte characters
        // and merges whole).
        let added = match (&tokenizer, batch, shown.lock()) {
            (Some(tk), 1, Ok(mut seen)) => {
                let before = decode(tk, &seen);
                seen.push(tokens[0]);
                let after = decode(tk, &seen);
                Some(after.strip_prefix(before.as_str()).unwrap_or(&after).to_string())
            }
            _ => None,
        };
        hooks.emit("token", json!({"step": step, "tokens": tokens, "text": added}));
        let (true, Some(tk), Some(added)) = (stream, &tokenizer, added) else { return };
        let mut out = std::io::stdout().lock();
        if step == 0 {
            let _ = write!(out, "{}", decode(tk, &prompts[0]));
        }
        let _ = write!(out, "{added}");
        let _ = out.flush();
    };
    let job = Job {
        args,
        planned: &planned,
        source: source.as_ref(),
        prompts: &prompts,
        sampling: &sampling,
        eos,
        tp,
    };
    let launched = tessera_comm::discover().map_err(|e| anyhow!(e))?.filter(|e| e.world_size > 1);
    if args.device == DeviceKind::Cpu {
        // Simulated devices hold their tensors in this process: one under a launcher, else tp.
        let here = if launched.is_some() { 1 } else { tp as u64 };
        let peak = planned.prefill.memory.peak_bytes.max(planned.decode.memory.peak_bytes);
        crate::limits::check_generation_memory(peak.saturating_mul(here))?;
    }
    let outcomes: Vec<Result<Generated>> = if let Some(env) = launched {
        match run_launched(&job, &env, &show)? {
            Some(outs) => outs.into_iter().map(Ok).collect(),
            // Ranks other than 0 report nothing.
            None => return Ok(None),
        }
    } else if tp == 1 {
        vec![job.device(0, None, &show).map(|(o, _)| o)]
    } else {
        let comms = tessera_comm::ThreadComm::world(tp, Duration::from_secs_f64(args.comm_timeout))
            .map_err(|e| anyhow!(e))?;
        let (job, show) = (&job, &show);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    s.spawn(move || job.device(rank, Some(Box::new(comm)), show).map(|(o, _)| o))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a device thread panicked"))))
                .collect::<Vec<_>>()
        })
    };
    let outs: Vec<Generated> = outcomes.into_iter().collect::<Result<_>>()?;
    if outs.iter().any(|o| o.new_tokens != outs[0].new_tokens) {
        bail!("the devices chose different tokens (a collective returned different logits)");
    }
    if stream {
        println!();
    }
    if let Some(path) = &args.logits {
        let doc = json!({
            "prompts": prompts,
            "new_tokens": outs[0].new_tokens,
            "logits": outs[0].step_logits,
        });
        crate::output::write_output(path, serde_json::to_string(&doc)?.as_bytes())?;
    }
    let doc = report(args, &cfg, &planned, &outs, &prompts, tokenizer.as_ref(), tp, print)?;
    Ok(Some(doc))
}

/// What every device of a generation runs.
struct Job<'a> {
    args: &'a GenerateArgs,
    planned: &'a Planned,
    source: &'a dyn tessera_runtime::ShardSource,
    prompts: &'a [Vec<i64>],
    sampling: &'a Sampling,
    eos: Option<i64>,
    tp: usize,
}

/// A device's generator on the backend `--device` names (launched ranks use its communicator
/// after the Programs).
enum DeviceGenerator {
    Cpu(Generator<CpuBackend>),
    #[cfg(feature = "cuda")]
    Cuda(Generator<tessera_cuda::CudaBackend>),
}

impl DeviceGenerator {
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    fn communicator(&mut self) -> Option<&mut dyn tessera_comm::Communicator> {
        match self {
            DeviceGenerator::Cpu(g) => g.communicator(),
            #[cfg(feature = "cuda")]
            DeviceGenerator::Cuda(g) => g.communicator(),
        }
    }
}

impl Job<'_> {
    /// Device `rank` of the group (its communicator `None` on one device) on the backend
    /// `--device` names: loads its shards, generates (rank 0 streams through `show`), and
    /// returns what it generated and measured, with the generator (its communicator, for calls
    /// after the Programs).
    fn device(
        &self,
        rank: usize,
        comm: Option<Box<dyn tessera_comm::Communicator>>,
        show: &(dyn Fn(usize, &[i64]) + Sync),
    ) -> Result<(Generated, DeviceGenerator)> {
        match self.args.device {
            DeviceKind::Cpu => {
                let backends = (CpuBackend::new(rank), CpuBackend::new(rank));
                let (out, g) = self.device_on(rank, comm, show, backends)?;
                Ok((out, DeviceGenerator::Cpu(g)))
            }
            DeviceKind::Cuda => self.device_cuda(rank, comm, show),
        }
    }

    /// Device `rank` on its GPU ([`crate::gpu_plan::rank_placement`]).
    #[cfg(feature = "cuda")]
    fn device_cuda(
        &self,
        rank: usize,
        comm: Option<Box<dyn tessera_comm::Communicator>>,
        show: &(dyn Fn(usize, &[i64]) + Sync),
    ) -> Result<(Generated, DeviceGenerator)> {
        let place = crate::gpu_plan::rank_placement(rank, self.tp)?;
        let gpu = crate::gpu_plan::open(place, rank)?;
        let be = tessera_cuda::CudaBackend::new(gpu);
        let (out, g) = self.device_on(rank, comm, show, (be.clone(), be))?;
        Ok((out, DeviceGenerator::Cuda(g)))
    }

    #[cfg(not(feature = "cuda"))]
    fn device_cuda(
        &self,
        _rank: usize,
        _comm: Option<Box<dyn tessera_comm::Communicator>>,
        _show: &(dyn Fn(usize, &[i64]) + Sync),
    ) -> Result<(Generated, DeviceGenerator)> {
        bail!(
            "--device cuda: this tessera was built without CUDA support; rebuild it with \
             `cargo build --release --features cuda` (no CUDA toolkit is needed to build)"
        )
    }

    /// Device `rank` on `backends` (its prefill's and decode's: handles of one device).
    fn device_on<B: Backend>(
        &self,
        rank: usize,
        comm: Option<Box<dyn tessera_comm::Communicator>>,
        show: &(dyn Fn(usize, &[i64]) + Sync),
        backends: (B, B),
    ) -> Result<(Generated, Generator<B>)> {
        let mesh = DeviceMesh::new(&[1, self.tp], rank)?;
        let runner: Option<Box<dyn ReshardRunner>> = match comm {
            Some(c) => Some(Box::new(CommRunner::new(c, mesh.clone())?)),
            None => None,
        };
        let mut g = Generator::new(
            step_program(&self.planned.prefill),
            step_program(&self.planned.decode),
            backends,
            runner,
            mesh,
            self.args.memory_budget,
            self.source,
            &self.planned.quantized,
        )
        .with_context(|| format!("device {rank}"))?;
        g.keep_logits(rank == 0 && self.args.logits.is_some());
        let quiet = |_: usize, _: &[i64]| {};
        let a = self.args;
        let out = if rank == 0 {
            g.generate(self.prompts, a.max_new_tokens, self.sampling, self.eos, show)
        } else {
            g.generate(self.prompts, a.max_new_tokens, self.sampling, self.eos, quiet)
        };
        Ok((out.with_context(|| format!("device {rank}"))?, g))
    }
}

/// Under `mpirun`/`srun`/`torchrun`: this process is one device of a tensor-parallel group of
/// the launcher's world size. Every rank plans alike and generates; rank 0 gathers each
/// rank's peaks and tokens (`None` on the other ranks).
#[cfg(feature = "mpi")]
fn run_launched(
    job: &Job<'_>,
    env: &tessera_comm::LaunchEnv,
    show: &(dyn Fn(usize, &[i64]) + Sync),
) -> Result<Option<Vec<Generated>>> {
    use tessera_comm::Communicator;
    use tessera_runtime::run::{pack, unpack};
    if env.world_size != job.tp {
        bail!(
            "launched as {} ranks: give --devices {} (a tp{} group)",
            env.world_size,
            env.world_size,
            env.world_size
        );
    }
    let timeout = Duration::from_secs_f64(job.args.comm_timeout);
    let comm = tessera_comm::MpiComm::init(timeout).map_err(|e| anyhow!(e))?;
    let rank = comm.rank();
    let result = (|| -> Result<Option<Vec<Generated>>> {
        let (mine, mut g) = job.device(rank, Some(Box::new(comm)), show)?;
        let tokens: Vec<i64> = mine.new_tokens.concat();
        let digest = tokens
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, &t| (h ^ t as u64).wrapping_mul(0x100_0000_01b3));
        let comm = g.communicator().context("a launched rank has a communicator")?;
        let world = tessera_comm::Group::world(job.tp)?;
        let mine_packed = pack(&[mine.prefill_peak_bytes, mine.decode_peak_bytes, digest]);
        let all = unpack(&comm.all_gather(&world, &mine_packed)?);
        if rank != 0 {
            return Ok(None);
        }
        if all.chunks(3).any(|c| c[2] != digest) {
            bail!("the ranks chose different tokens (a collective returned different logits)");
        }
        Ok(Some(
            all.chunks(3)
                .map(|c| Generated {
                    prefill_peak_bytes: c[0],
                    decode_peak_bytes: c[1],
                    ..mine.clone()
                })
                .collect(),
        ))
    })();
    match result {
        Ok(r) => Ok(r),
        Err(e) => {
            let msg = e.chain().map(|c| c.to_string()).collect::<Vec<_>>().join(": ");
            eprintln!("error: rank {rank}: {msg}");
            std::process::exit(1);
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn run_launched(
    _job: &Job<'_>,
    env: &tessera_comm::LaunchEnv,
    _show: &(dyn Fn(usize, &[i64]) + Sync),
) -> Result<Option<Vec<Generated>>> {
    bail!(
        "launched by {} as rank {} of {}, but this tessera was built without MPI: rebuild with \
         `cargo build --release --features mpi`, or run `tessera generate --devices N`",
        env.launcher,
        env.rank,
        env.world_size
    )
}

fn device_name(d: DeviceKind) -> &'static str {
    match d {
        DeviceKind::Cpu => "cpu",
        DeviceKind::Cuda => "cuda",
    }
}

fn decode(tk: &Tokenizer, ids: &[i64]) -> String {
    let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    tk.decode(&ids).unwrap_or_default()
}

/// The generation's report (what `--format json` prints), printed in `--format` when `print`.
#[allow(clippy::too_many_arguments)]
fn report(
    args: &GenerateArgs,
    cfg: &ModelConfig,
    planned: &Planned,
    outs: &[Generated],
    prompts: &[Vec<i64>],
    tokenizer: Option<&Tokenizer>,
    tp: usize,
    print: bool,
) -> Result<serde_json::Value> {
    let first = &outs[0];
    let generated: usize = first.new_tokens.iter().map(Vec::len).sum();
    let total_s = first.time_to_first_token_s + first.decode_s;
    let tokens_per_s = generated as f64 / total_s.max(1e-9);
    let decode_tokens = first.decode_steps * prompts.len();
    let decode_tokens_per_s = decode_tokens as f64 / first.decode_s.max(1e-9);
    let (pm, dm) = (&planned.prefill.memory, &planned.decode.memory);
    let predicted = pm.peak_bytes.max(dm.peak_bytes);
    let measured: Vec<u64> =
        outs.iter().map(|o| o.prefill_peak_bytes.max(o.decode_peak_bytes)).collect();
    let texts: Vec<String> = match tokenizer {
        Some(tk) => first.new_tokens.iter().map(|t| decode(tk, t)).collect(),
        None => vec![String::new(); first.new_tokens.len()],
    };
    let config = format!("tp{tp}");
    let one = prompts.len() == 1;
    let doc = json!({
        "model": cfg.name(),
        "device": device_name(args.device),
        "devices": tp,
        "config": config,
        "quantize": args.quantize.map(Quantize::name),
        "prompt_tokens": if one { json!(prompts[0]) } else { json!(prompts) },
        "new_tokens": if one { json!(first.new_tokens[0]) } else { json!(first.new_tokens) },
        "text": if one { json!(texts[0]) } else { json!(texts) },
        "time_to_first_token_s": first.time_to_first_token_s,
        "decode_s": first.decode_s,
        "tokens_per_s": tokens_per_s,
        "decode_tokens_per_s": decode_tokens_per_s,
        "memory": {
            "predicted_peak_bytes": vec![predicted; tp],
            "measured_peak_bytes": measured,
            "prefill": {"predicted_peak_bytes": pm.peak_bytes,
                        "measured_peak_bytes": outs.iter().map(|o| o.prefill_peak_bytes).collect::<Vec<_>>()},
            "decode": {"predicted_peak_bytes": dm.peak_bytes,
                       "measured_peak_bytes": outs.iter().map(|o| o.decode_peak_bytes).collect::<Vec<_>>()},
            "weights_bytes": pm.params_bytes,
            "kv_cache_bytes": pm.kv_cache_bytes,
        },
    });
    if !print {
        return Ok(doc);
    }
    if args.format == OutputFormat::Json {
        print_stdout(&serde_json::to_string_pretty(&doc)?)?;
        return Ok(doc);
    }
    if prompts.len() > 1 {
        for (i, t) in texts.iter().enumerate() {
            println!("[{i}] {t}");
        }
    } else if tokenizer.is_none() {
        let ids: Vec<String> = first.new_tokens[0].iter().map(i64::to_string).collect();
        println!("{}", ids.join(","));
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    eprintln!(
        "{} new tokens in {:.2} s ({:.1} tok/s; first token after {:.3} s) on {tp} {} device(s), {config}{}",
        generated,
        total_s,
        tokens_per_s,
        first.time_to_first_token_s,
        device_name(args.device),
        args.quantize.map_or(String::new(), |q| format!(", {}", q.name()))
    );
    eprintln!(
        "memory per device: predicted peak {:.2} MiB (weights {:.2} MiB, KV cache {:.2} MiB), measured {}",
        mib(predicted),
        mib(pm.params_bytes),
        mib(pm.kv_cache_bytes),
        measured.iter().map(|&b| format!("{:.2} MiB", mib(b))).collect::<Vec<_>>().join(", ")
    );
    Ok(doc)
}
