//! Running a planned `tessera train` on its devices: N simulated devices as threads (one
//! [`ThreadComm`] each; a single device needs none) or, under `mpirun`/`srun`/`torchrun`, one
//! process per rank. Every device runs [`run_rank`]: the one [`Trainer`] on its shards and the
//! runtime's one loop ([`run_device`]). Rank 0 reports; at the end every rank's peak memory
//! and traffic are gathered so the summary shows, per device, predicted against measured.

use crate::format::bytes;
use crate::hooks::Hooks;
use crate::profile_cmd::{print_stdout, OutputFormat};
use crate::train_cmd::{DeviceKind, TrainArgs};
use crate::train_prepare::{prepare, progress, RunContext, Start};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::json;
use std::time::Duration;
use tessera_comm::{CommError, Communicator, ThreadComm};
use tessera_ir::CkptMode;
use tessera_runtime::collective::{CommRunner, DeviceMesh};
use tessera_runtime::executor::OpTimeRow;
use tessera_runtime::run::{restore_extra, run_device, Observer, RankOutcome, RunSpec};
use tessera_runtime::{
    alloc, Backend, CpuBackend, DeviceSetup, LossScaleConfig, RuntimeError, StartState, StepStats,
    Trainer,
};

/// Plans the run and trains on `devices` devices of this process, then prints the summary.
pub fn run_local(args: &TrainArgs, devices: usize) -> Result<()> {
    let done = train_local(args, devices, &Hooks::default())?;
    report(&done.ctx, &done.outcome, done.heap_peak)
}

/// A finished run of this process's devices: its context, rank 0's outcome and the heap peak
/// (where the allocator counts).
pub struct Finished {
    pub ctx: RunContext,
    pub outcome: RankOutcome,
    pub heap_peak: Option<u64>,
}

/// Plans the run and trains on `devices` devices of this process: one device directly, more as
/// threads with a communicator each. `hooks`: the front end's data, events and stop flag.
pub fn train_local(args: &TrainArgs, devices: usize, hooks: &Hooks) -> Result<Finished> {
    // The run's heap: what the devices hold, and what loading their state holds (a checkpoint
    // read in `prepare` counts), but not the planner's scratch, freed by then.
    let heap_baseline = alloc::current_bytes();
    let ctx = prepare(args, devices, devices, 0, hooks)?;
    alloc::reset_peak();
    // Only an allocator that counts (the binary's) measures the heap.
    let heap_peak =
        || alloc::is_counting().then(|| alloc::peak_bytes().saturating_sub(heap_baseline));
    if devices == 1 {
        let outcome = run_rank(&ctx, None, 0)?;
        let heap_peak = heap_peak();
        ctx.bar.finish_and_clear();
        crate::finetune::after_run(&ctx)?;
        return Ok(Finished { ctx, outcome, heap_peak });
    }
    let timeout = Duration::from_secs_f64(args.comm_timeout);
    let comms = ThreadComm::world(devices, timeout).map_err(|e| anyhow!(e))?;
    let outcomes: Vec<Result<RankOutcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let ctx = &ctx;
                std::thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(s, move || run_rank(ctx, Some(Box::new(comm)), rank))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|_| Err(anyhow!("rank {rank} panicked"))),
                Err(e) => Err(anyhow!("starting the thread of rank {rank}: {e}")),
            })
            .collect()
    });
    let heap_peak = heap_peak();
    let outcome = first_failure(outcomes)?;
    ctx.bar.finish_and_clear();
    crate::finetune::after_run(&ctx)?;
    Ok(Finished { ctx, outcome, heap_peak })
}

/// Under `mpirun`/`srun`/`torchrun`: this process is one rank of the launcher's world.
/// Every rank plans (the planner is deterministic; the ranks check they agree), trains its
/// shards through MPI, and rank 0 reports. A failing rank prints its error and exits non-zero,
/// which makes the launcher end the others; a rank stuck past `--comm-timeout` does the same.
#[cfg(feature = "mpi")]
pub fn run_launched(args: &TrainArgs, env: &tessera_comm::LaunchEnv) -> Result<()> {
    let timeout = Duration::from_secs_f64(args.comm_timeout);
    let mut comm = tessera_comm::MpiComm::init(timeout).map_err(|e| anyhow!(e))?;
    let rank = comm.rank();
    if comm.world_size() != env.world_size || rank != env.rank {
        bail!(
            "{} says rank {} of {}, MPI says rank {rank} of {}: launch with mpirun, or unset \
             the other launchers' variables",
            env.launcher,
            env.rank,
            env.world_size,
            comm.world_size()
        );
    }
    let result = (|| -> Result<Option<RankOutcome>> {
        let ctx = prepare(args, env.world_size, 1, rank, &Hooks::default())?;
        // Every rank must run the same Program: compare a fingerprint of the plan.
        let fp = fingerprint(&serde_json::to_string(&ctx.plan.strategies)?);
        let world = tessera_comm::Group::world(env.world_size)?;
        use tessera_runtime::run::{pack, unpack};
        let all = unpack(&comm.all_gather(&world, &pack(&[fp, ctx.plan.zero_stage as u64]))?);
        if all.chunks(2).any(|c| c != [fp, ctx.plan.zero_stage as u64]) {
            bail!("the ranks planned different runs (a time-limited search?): pass --plan");
        }
        let outcome = run_rank(&ctx, Some(Box::new(comm)), rank)?;
        if rank == 0 {
            ctx.bar.finish_and_clear();
            crate::finetune::after_run(&ctx)?;
            report(&ctx, &outcome, None)?;
        }
        Ok(Some(outcome))
    })();
    match result {
        Ok(_) => Ok(()),
        Err(e) => {
            // The other ranks are blocked in a collective: end the job now, with the reason.
            let msg = e.chain().map(|c| c.to_string()).collect::<Vec<_>>().join(": ");
            eprintln!("error: rank {rank}: {msg}");
            std::process::exit(1);
        }
    }
}

#[cfg(not(feature = "mpi"))]
pub fn run_launched(_args: &TrainArgs, env: &tessera_comm::LaunchEnv) -> Result<()> {
    bail!(
        "launched by {} as rank {} of {}, but this tessera was built without MPI: rebuild with \
         `cargo build --release --features mpi` (scripts/setup.sh installs OpenMPI), or run \
         `tessera train --devices N` for simulated devices",
        env.launcher,
        env.rank,
        env.world_size
    )
}

/// FNV-1a of a string (the plan's identity across ranks).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
fn fingerprint(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// The root cause among the ranks' results: a rank's own error before the "peer died" errors
/// it caused elsewhere.
fn first_failure(outcomes: Vec<Result<RankOutcome>>) -> Result<RankOutcome> {
    let mut errors = Vec::new();
    let mut zero = None;
    for (rank, o) in outcomes.into_iter().enumerate() {
        match o {
            Ok(o) if rank == 0 => zero = Some(o),
            Ok(_) => {}
            Err(e) => errors.push((rank, e)),
        }
    }
    let secondary = |e: &anyhow::Error| {
        e.chain().any(|c| {
            matches!(
                c.downcast_ref::<RuntimeError>(),
                Some(RuntimeError::Comm(CommError::RankDied { .. } | CommError::Poisoned { .. }))
            ) || matches!(
                c.downcast_ref::<CommError>(),
                Some(CommError::RankDied { .. } | CommError::Poisoned { .. })
            )
        })
    };
    let pick = errors.iter().position(|(_, e)| !secondary(e)).or(if errors.is_empty() {
        None
    } else {
        Some(0)
    });
    if let Some(i) = pick {
        let (rank, e) = errors.swap_remove(i);
        return Err(e.context(format!("rank {rank} failed")));
    }
    zero.ok_or_else(|| anyhow!("rank 0 returned nothing"))
}

/// One device's whole run on the backend `--device` names.
pub fn run_rank(
    ctx: &RunContext,
    comm: Option<Box<dyn Communicator>>,
    rank: usize,
) -> Result<RankOutcome> {
    match ctx.args.device {
        DeviceKind::Cpu => run_rank_on(ctx, comm, rank, CpuBackend::new(rank)),
        DeviceKind::Cuda => run_rank_cuda(ctx, comm, rank),
    }
}

/// One rank on its GPU. Under a launcher (a process per GPU) the launcher's local rank picks
/// the GPU and the ranks talk over NCCL, bootstrapped by the launcher's communicator. As
/// threads (`--devices N`): with a GPU per device, rank i takes GPU i and NCCL likewise; with
/// fewer GPUs than devices, the devices share them ([`crate::gpu_plan::placement`]): each
/// opens GPU `rank mod count` with its own stream and caching allocator, and the threads'
/// communicator carries the collectives, staged through the host by the executor — so every
/// plan runs its GPU kernels, and is checked against one device, on a one-GPU machine.
#[cfg(feature = "cuda")]
fn run_rank_cuda(
    ctx: &RunContext,
    comm: Option<Box<dyn Communicator>>,
    rank: usize,
) -> Result<RankOutcome> {
    use crate::gpu_plan::Placement;
    let place = crate::gpu_plan::rank_placement(rank, ctx.local_devices)?;
    let gpu = crate::gpu_plan::open(place, rank)?;
    let backend = tessera_cuda::CudaBackend::new(gpu.clone());
    let Some(mut bootstrap) = comm else {
        return run_rank_on(ctx, None, rank, backend);
    };
    if let Placement::Shared { .. } = place {
        return run_rank_on(ctx, Some(bootstrap), rank, backend);
    }
    let timeout = Duration::from_secs_f64(ctx.args.comm_timeout);
    let nccl = tessera_cuda::NcclComm::over(gpu, bootstrap.as_mut())
        .map_err(|e| anyhow!(e))
        .with_context(|| format!("rank {rank}: setting up NCCL on GPU {}", place.ordinal()))?
        .with_timeout(timeout);
    let outcome = run_rank_on(ctx, Some(Box::new(nccl)), rank, backend);
    // The bootstrap communicator (MPI's, under mpirun) lives until every rank is done.
    drop(bootstrap);
    outcome
}

#[cfg(not(feature = "cuda"))]
fn run_rank_cuda(
    _ctx: &RunContext,
    _comm: Option<Box<dyn Communicator>>,
    _rank: usize,
) -> Result<RankOutcome> {
    bail!(
        "--device cuda: this tessera was built without CUDA support; rebuild it with \
         `cargo build --release --features cuda` (no CUDA toolkit is needed to build)"
    )
}

/// One device's whole run: its trainer on its shards, the runtime's loop, the report.
fn run_rank_on<B: Backend>(
    ctx: &RunContext,
    comm: Option<Box<dyn Communicator>>,
    rank: usize,
    backend: B,
) -> Result<RankOutcome> {
    let mesh = DeviceMesh::new(&ctx.mesh_shape, rank)?;
    let runner = match comm {
        Some(c) => Some(CommRunner::new(c, mesh.clone())?),
        None => None,
    };
    // An offloaded plan's host tier is bounded by the host memory it was planned for.
    let host_budget = ctx.plan.offload.as_ref().map(|o| o.host_memory_bytes);
    let offload_dir = ctx.args.tiers.offload_dir.clone();
    let setup = DeviceSetup { mesh, budget: Some(ctx.budget), host_budget, offload_dir };
    let args = &ctx.args;
    let mut trainer = {
        let guard = ctx.start.read().map_err(|_| anyhow!("a rank panicked while binding"))?;
        let start = guard.as_ref().ok_or_else(|| anyhow!("the starting state was dropped"))?;
        let state = match start {
            Start::Fresh(rules) => StartState::Fresh { rules },
            Start::Resume(ckpt) => StartState::Global {
                params: &ckpt.params,
                optimizer: Some(&ckpt.optimizer),
                steps_done: ckpt.manifest.step,
            },
            Start::Weights(weights) => {
                StartState::Global { params: weights.as_ref(), optimizer: None, steps_done: 0 }
            }
        };
        let mut trainer = Trainer::new(
            ctx.training(rank).clone(),
            backend,
            runner,
            setup,
            ctx.schedule.clone(),
            args.seed,
            state,
        )?;
        if ctx.training(rank).loss_scale.is_some() {
            let cfg = LossScaleConfig {
                init_scale: args.loss_scale,
                growth_interval: args.loss_scale_window,
                ..LossScaleConfig::default()
            };
            trainer = trainer.with_loss_scale(cfg).context("--loss-scale")?;
        }
        if let Start::Resume(ckpt) = start {
            restore_extra(&mut trainer, &ckpt.manifest)
                .with_context(|| format!("resuming from {}", ckpt.dir.display()))?;
        }
        trainer
    };
    // The global tensors (a checkpoint, --init weights) go once this process's devices hold
    // their shards: no device keeps a whole model the plan does not give it.
    if ctx.bound.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == ctx.local_devices {
        if let Ok(mut start) = ctx.start.write() {
            *start = None;
        }
    }
    // The held-out evaluation at the end, or one a front end asks for (Trainer.evaluate).
    if args.eval_batches > 0 || ctx.hooks.steps.is_some() {
        let (graph, loss, logits) = &ctx.eval_model;
        trainer = trainer.with_eval(graph.clone(), *loss, *logits)?;
    }
    trainer.record_timings(args.op_times && rank == 0);
    let steps = ctx.steps.source(ctx);
    let spec = RunSpec {
        steps: &steps,
        data: ctx.data.as_ref(),
        batch: args.batch,
        seq: ctx.seq,
        seed: args.seed,
        first: ctx.first,
        last: ctx.last_step,
        save: ctx.save.clone(),
        eval_batches: args.eval_batches,
        log: ctx.log.as_ref(),
    };
    use std::io::IsTerminal as _;
    let quiet = ctx.hooks.events.is_some();
    let plain = (rank == 0 && !quiet && !std::io::stderr().is_terminal()).then(Default::default);
    let started = std::time::Instant::now();
    let watch = Watch { ctx, fault: Fault::from_env()?, plain, started };
    let mut outcome = run_device(&mut trainer, &spec, &watch)?;
    if rank == 0 {
        outcome.op_times = trainer
            .timings()
            .map(|t| t.iter().map(|(k, o)| OpTimeRow { kind: k.to_string(), time: *o }).collect())
            .unwrap_or_default();
        outcome.loss_scale = trainer.loss_scale_state().map(|s| s.scale);
    }
    Ok(outcome)
}

/// The run's observer: the progress bar (rank 0) and `TESSERA_FAULT` injection.
struct Watch<'a> {
    ctx: &'a RunContext,
    fault: Option<Fault>,
    /// When stderr is not a terminal (the bar draws nothing): when the last progress line was
    /// printed, so a log gets one every few seconds.
    plain: Option<std::sync::Mutex<Option<std::time::Instant>>>,
    /// When the steps began: the progress lines' elapsed time.
    started: std::time::Instant,
}

/// Seconds between progress lines when stderr is not a terminal.
const PLAIN_PROGRESS_EVERY_S: f64 = 5.0;

impl Observer for Watch<'_> {
    fn before_step(&self, rank: usize, step: u64) -> tessera_runtime::Result<()> {
        match self.fault.filter(|f| f.rank == rank && f.step == step) {
            Some(f) => Err(RuntimeError::Data(f.trigger(self.ctx.args.comm_timeout))),
            None => Ok(()),
        }
    }

    fn after_step(&self, stats: &StepStats, seconds: f64) {
        let msg = progress(self.ctx, stats, seconds);
        if let Some(Ok(mut last)) = self.plain.as_ref().map(|m| m.lock()) {
            let due = last.is_none_or(|t| t.elapsed().as_secs_f64() >= PLAIN_PROGRESS_EVERY_S);
            if due || stats.step == self.ctx.last_step {
                let (step, total) = (stats.step, self.ctx.last_step);
                let elapsed = self.started.elapsed().as_secs_f64();
                eprintln!("step {step}/{total} | {msg} | elapsed {elapsed:.1}s");
                *last = Some(std::time::Instant::now());
            }
        }
        self.ctx.bar.set_position(stats.step);
        self.ctx.bar.set_message(msg);
        let tps = (self.ctx.args.batch * self.ctx.seq) as f64 / seconds;
        // A skipped fp16 step's norm is not finite, which JSON cannot hold: null.
        let grad_norm = stats.grad_norm.is_finite().then_some(stats.grad_norm);
        self.ctx.hooks.emit(
            "step",
            json!({"step": stats.step, "last_step": self.ctx.last_step, "loss": stats.loss,
                   "grad_norm": grad_norm, "lr": stats.lr, "tokens_per_s": tps,
                   "peak_bytes": stats.peak_bytes}),
        );
    }

    fn after_eval(&self, stats: Option<&tessera_runtime::EvalStats>) {
        let value = stats.map_or(json!(null), |e| json!({"loss": e.loss, "accuracy": e.accuracy}));
        self.ctx.hooks.emit("eval", value);
    }
}

/// Fault injection for the failure tests: `TESSERA_FAULT=rank=R,step=S,kind=K` makes rank R,
/// before step S, fail with an error (`error`), stall for three collective timeouts (`hang`,
/// what a stuck device looks like to its peers) or end its process at once (`kill`).
#[derive(Clone, Copy, Debug)]
struct Fault {
    rank: usize,
    step: u64,
    kind: FaultKind,
}

#[derive(Clone, Copy, Debug)]
enum FaultKind {
    Error,
    Hang,
    Kill,
}

impl Fault {
    fn from_env() -> Result<Option<Fault>> {
        let Ok(spec) = std::env::var("TESSERA_FAULT") else { return Ok(None) };
        let bad = || anyhow!("TESSERA_FAULT={spec}: expected rank=R,step=S,kind=error|hang|kill");
        let (mut rank, mut step, mut kind) = (None, None, None);
        for part in spec.split(',') {
            let (k, v) = part.split_once('=').ok_or_else(bad)?;
            match k.trim() {
                "rank" => rank = Some(v.trim().parse().map_err(|_| bad())?),
                "step" => step = Some(v.trim().parse().map_err(|_| bad())?),
                "kind" => {
                    kind = Some(match v.trim() {
                        "error" => FaultKind::Error,
                        "hang" => FaultKind::Hang,
                        "kill" => FaultKind::Kill,
                        _ => return Err(bad()),
                    })
                }
                _ => return Err(bad()),
            }
        }
        match (rank, step, kind) {
            (Some(rank), Some(step), Some(kind)) => Ok(Some(Fault { rank, step, kind })),
            _ => Err(bad()),
        }
    }

    /// Carries the fault out; the error to end the rank with.
    fn trigger(self, timeout_s: f64) -> String {
        match self.kind {
            FaultKind::Error => {}
            FaultKind::Hang => std::thread::sleep(Duration::from_secs_f64(3.0 * timeout_s)),
            FaultKind::Kill => std::process::exit(137),
        }
        format!("fault injected by TESSERA_FAULT before step {}", self.step)
    }
}

/// Prints the run's summary (rank 0): losses, speed, and per device the predicted against the
/// measured peak memory and collective traffic; `--format json` prints [`report_json`].
pub fn report(ctx: &RunContext, o: &RankOutcome, heap_peak: Option<u64>) -> Result<()> {
    match render(ctx, o, heap_peak, ctx.args.format)? {
        Rendered::Json(doc) => print_stdout(&format!("{}\n", serde_json::to_string_pretty(&doc)?)),
        Rendered::Table(s) => print_stdout(&s),
    }
}

/// The run's report as `--format json` prints it (the `--plot` picture drawn).
pub fn report_json(
    ctx: &RunContext,
    o: &RankOutcome,
    heap_peak: Option<u64>,
) -> Result<serde_json::Value> {
    match render(ctx, o, heap_peak, OutputFormat::Json)? {
        Rendered::Json(doc) => Ok(doc),
        Rendered::Table(_) => bail!("the JSON report came out as a table"),
    }
}

/// A run's summary in one of the output formats.
enum Rendered {
    Json(serde_json::Value),
    Table(String),
}

/// The run's summary in `format` (the `--plot` picture drawn).
fn render(
    ctx: &RunContext,
    o: &RankOutcome,
    heap_peak: Option<u64>,
    format: OutputFormat,
) -> Result<Rendered> {
    let args = &ctx.args;
    let n = o.measured_peak.len();
    let (first, last) = match (o.steps.first(), o.steps.last()) {
        (Some(f), Some(l)) => (f.0, l.0),
        _ => bail!("no step ran"),
    };
    let steps_run = o.steps.len() as u64;
    let tokens_per_s = (args.batch * ctx.seq) as f64 * steps_run as f64 / o.elapsed_s;
    let pc = &ctx.predicted_comm_bytes;
    let predicted_comm: Vec<u64> = (0..n).map(|r| pc[r % pc.len().max(1)]).collect();
    let skipped: u64 = o.steps.iter().map(|(s, _)| u64::from(s.skipped)).sum();
    let (baseline, unigram) = match &ctx.data {
        Some(d) => {
            let (b, u) = d.baseline();
            (Some(b), Some(u))
        }
        None => (None, None),
    };
    let mut op_times = o.op_times.clone();
    op_times.sort_by(|a, b| b.time.seconds.total_cmp(&a.time.seconds));
    let plan = &ctx.plan;
    if let Some(path) = &args.plot {
        crate::pictures::write_train_plot(path, ctx, o)?;
    }
    match format {
        OutputFormat::Json => {
            let mut doc = json!({
                "model": ctx.cfg.name(),
                "device": match args.device {
                    DeviceKind::Cpu => "cpu",
                    DeviceKind::Cuda => "cuda",
                },
                "devices": n,
                "config": plan.config,
                "layout": plan.layout,
                "mesh": plan.mesh.shape,
                "zero_stage": plan.zero_stage,
                "micro_batches": plan.micro_batches,
                "checkpoint": plan.checkpoint,
                "recompute_s": plan.predicted.recompute_s,
                "steps": steps_run,
                "last_step": last.step,
                "total_steps": args.steps,
                "batch": args.batch,
                "seq": ctx.seq,
                "initial_loss": first.loss,
                "final_loss": last.loss,
                "final_grad_norm": last.grad_norm.is_finite().then_some(last.grad_norm),
                "eval_loss": o.eval.map(|e| e.loss),
                "eval_accuracy": o.eval.and_then(|e| e.accuracy),
                "unigram_entropy": unigram,
                "tokens_per_s": tokens_per_s,
                "elapsed_s": o.elapsed_s,
                "parameters": {
                    "total": ctx.eval_model.0.num_parameters(),
                    "trainable": ctx.eval_model.0.num_trainable_parameters(),
                },
                "memory": {
                    "predicted_state_bytes": {
                        "params": plan.predicted.params_bytes,
                        "grads": plan.predicted.grads_bytes,
                        "optimizer": plan.predicted.optimizer_bytes,
                    },
                    "predicted_peak_bytes": ctx.predicted_peak,
                    "measured_peak_bytes": o.measured_peak,
                },
                "comm": {
                    "predicted_bytes": predicted_comm,
                    "measured_bytes": o.measured_comm,
                    "predicted_calls": ctx.predicted_calls,
                    "measured_calls": o.calls,
                },
            });
            if let Some(h) = heap_peak {
                doc["memory"]["heap_peak_bytes"] = json!(h);
            }
            if !o.allocator_peak.is_empty() {
                // The GPU allocator's own books (Program tensors), beside the accountant's.
                doc["memory"]["allocator_peak_bytes"] = json!(o.allocator_peak);
            }
            if let Some(off) = &plan.offload {
                // Every device runs the same offloaded Program: one prediction for each.
                doc["memory"]["host_peak_bytes"] = json!({
                    "predicted": vec![off.host_peak_bytes; n],
                    "measured": o.measured_host_peak,
                });
                doc["offload"] = json!({
                    "config": off.config,
                    "moved_bytes_per_step": off.moved_bytes_per_step,
                    "host_memory_bytes": off.host_memory_bytes,
                });
            }
            if let Some(e) = ctx.extended {
                doc["resumed"] = json!({"from_step": ctx.steps_done,
                                        "saved_total_steps": e.saved_total});
            }
            if let Some(scale) = o.loss_scale {
                doc["skipped_steps"] = json!(skipped);
                doc["loss_scale"] = json!(scale);
            }
            if args.op_times {
                doc["op_times"] = op_times
                    .iter()
                    .map(|o| {
                        let t = o.time;
                        let mut v =
                            json!({"calls": t.calls, "seconds": t.seconds, "flops": t.flops});
                        if let Some(g) = o.gflop_per_s() {
                            v["gflop_per_s"] = json!(g);
                        }
                        (o.kind.clone(), v)
                    })
                    .collect::<serde_json::Map<_, _>>()
                    .into();
            }
            if let Some(step) = o.stopped_before {
                doc["stopped_before_step"] = json!(step);
            }
            Ok(Rendered::Json(doc))
        }
        OutputFormat::Table => {
            let mut s = format!(
                "{} · {} device{} · plan {} (mesh {:?}, {} layout) · {} steps · batch {} × seq {} \
                 · {:.0} tokens/s\n",
                ctx.cfg.name(),
                n,
                if n == 1 { "" } else { "s" },
                plan.config,
                plan.mesh.shape,
                plan.layout,
                steps_run,
                args.batch,
                ctx.seq,
                tokens_per_s
            );
            s += &format!("loss      {:.4} → {:.4} (train)", first.loss, last.loss);
            if let Some(e) = o.eval {
                s += &format!(", {:.4} (held-out)", e.loss);
            }
            match (baseline, unigram) {
                (Some(b), Some(u)) => s += &format!("; {b} {u:.4}\n"),
                _ => s += "\n",
            }
            if let Some(a) = o.eval.and_then(|e| e.accuracy) {
                s += &format!("accuracy  {:.2}% top-1 (held-out)\n", 100.0 * a);
            }
            let recomputed = plan.checkpoint.iter().filter(|c| c.mode != CkptMode::None).count();
            if recomputed > 0 {
                let mode = |m: CkptMode| plan.checkpoint.iter().filter(|c| c.mode == m).count();
                s += &format!(
                    "checkpoint {} selective, {} full of {} blocks (recompute {:.4} s predicted)\n",
                    mode(CkptMode::Selective),
                    mode(CkptMode::Full),
                    plan.checkpoint.len(),
                    plan.predicted.recompute_s
                );
            }
            if let Some(scale) = o.loss_scale {
                s += &format!(
                    "fp16      {skipped} skipped steps (overflow); loss scale now {scale}\n"
                );
            }
            let pc = &ctx.predicted_comm_bytes;
            s += "device    peak predicted   peak measured   comm/step predicted   measured\n";
            for (d, (measured, comm)) in o.measured_peak.iter().zip(&o.measured_comm).enumerate() {
                s += &format!(
                    "{d:>6}    {:>14}   {:>13}   {:>19}   {:>8}\n",
                    bytes(ctx.predicted_peak.get(d).copied().unwrap_or(0)),
                    bytes(*measured),
                    bytes(pc.get(d % pc.len().max(1)).copied().unwrap_or(0)),
                    bytes(*comm)
                );
            }
            if let Some(h) = heap_peak {
                s += &format!("process heap peak {} (all devices)\n", bytes(h));
            }
            if let Some(off) = &plan.offload {
                let measured = o.measured_host_peak.iter().copied().max().unwrap_or(0);
                s += &format!(
                    "offload   {}: host peak {} predicted, {} measured (of {}); {} moved per step\n",
                    off.config,
                    bytes(off.host_peak_bytes),
                    bytes(measured),
                    bytes(off.host_memory_bytes),
                    bytes(off.moved_bytes_per_step)
                );
            }
            if args.op_times {
                let total: f64 = op_times.iter().map(|o| o.time.seconds).sum();
                s += "where the time goes (rank 0, all steps):\n";
                for o in &op_times {
                    let (k, calls, secs) = (&o.kind, o.time.calls, o.time.seconds);
                    let rate =
                        o.gflop_per_s().map(|g| format!("  {g:.1} GFLOP/s")).unwrap_or_default();
                    s += &format!(
                        "  {k:<24} {secs:>8.2} s  {:>5.1}%  {calls} calls{rate}\n",
                        100.0 * secs / total.max(1e-12)
                    );
                }
            }
            Ok(Rendered::Table(s))
        }
    }
}
