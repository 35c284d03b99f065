//! `tessera train --devices N`: plan the run (automatic, a config string or a plan file),
//! lower it to the Program every device runs, and train on N simulated devices (threads, one
//! [`ThreadComm`] each) or, under `mpirun`/`srun`/`torchrun`, one process per rank.
//!
//! Every rank runs [`run_rank`]: the same steps on its own shards, the Program's collectives
//! through its communicator. Rank 0 reports; at the end every rank's peak memory and traffic
//! are gathered so the summary shows, per device, predicted against measured.

use crate::format::bytes;
use crate::plan_cmd::{choose_plan, plan_err};
use crate::profile_cmd::{print_stdout, OutputFormat};
use crate::train_cmd::{load_dataset, make_schedule, run_facts, TrainArgs, SCALER_KEY};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::Tensor;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tessera_comm::{CommError, CommStats, Communicator, Group, ThreadComm};
use tessera_ir::CkptMode;
use tessera_ir::{build_training_graph, Op, TrainConfig, TrainingGraph};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::plan::Plan;
use tessera_plan::planner::{self, Request};
use tessera_plan::search::Forward;
use tessera_plan::{Cluster, PlanError};
use tessera_runtime::checkpoint::{load_checkpoint, Checkpoint, Manifest};
use tessera_runtime::collective::{CommRunner, DeviceMesh, Placement};
use tessera_runtime::data::Dataset;
use tessera_runtime::dist_checkpoint::save_sharded;
use tessera_runtime::spmd::{gather_params_to, DeviceSetup, GlobalState, SpmdTrainer};
use tessera_runtime::{
    alloc, init::init_parameters, CpuBackend, LrSchedule, RuntimeError, StepStats,
};

/// Everything a rank needs, shared read-only by the threads of a simulated run.
pub struct RunContext {
    pub args: TrainArgs,
    pub cfg: ModelConfig,
    pub plan: Plan,
    pub training: TrainingGraph,
    pub setup_placements: HashMap<String, Placement>,
    pub mesh_shape: Vec<usize>,
    pub micro_batches: usize,
    pub budget: Option<u64>,
    pub schedule: LrSchedule,
    pub dataset: Dataset,
    /// Global starting state: a fresh init or a checkpoint (any plan, any device count).
    pub params: HashMap<String, Tensor>,
    pub optimizer: Option<HashMap<String, Tensor>>,
    pub steps_done: u64,
    pub first: u64,
    pub last_step: u64,
    /// Predicted bytes one device contributes to collectives per step.
    pub predicted_comm_bytes: u64,
    pub predicted_calls: BTreeMap<String, u64>,
    pub predicted_peak: Vec<u64>,
    pub eval_model: (tessera_ir::Graph, tessera_ir::TensorId),
    pub log: Mutex<Option<std::io::BufWriter<std::fs::File>>>,
    pub bar: ProgressBar,
}

/// What a rank reports when done.
pub struct RankOutcome {
    /// Rank 0 only: every step's stats and wall time.
    pub steps: Vec<(StepStats, f64)>,
    /// Every rank's measured peak and last-step collective bytes (gathered on every rank).
    pub measured_peak: Vec<u64>,
    pub measured_comm: Vec<u64>,
    /// This rank's collective calls per kind in the last step.
    pub calls: BTreeMap<String, u64>,
    pub eval_loss: Option<f64>,
    pub elapsed_s: f64,
}

/// Builds the plan and the per-device training graph and starts the threads (or, under a
/// launcher, this process's rank).
pub fn run(args: &TrainArgs, devices: usize) -> Result<()> {
    let ctx = prepare(args, devices, 0)?;
    let timeout = Duration::from_secs_f64(args.comm_timeout);
    let comms = ThreadComm::world(devices, timeout).map_err(|e| anyhow!(e))?;
    alloc::reset_peak();
    let heap_baseline = alloc::current_bytes();
    let outcomes: Vec<Result<RankOutcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let ctx = &ctx;
                std::thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(s, move || run_rank(ctx, Box::new(comm), rank))
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
    let heap_peak = alloc::peak_bytes().saturating_sub(heap_baseline);
    let outcome = first_failure(outcomes)?;
    ctx.bar.finish_and_clear();
    report(&ctx, &outcome, Some(heap_peak))
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
        let ctx = prepare(args, env.world_size, rank)?;
        // Every rank must run the same Program: compare a fingerprint of the plan.
        let fp = fingerprint(&serde_json::to_string(&ctx.plan.strategies)?);
        let world = Group::world(env.world_size)?;
        let all = unpack(&comm.all_gather(&world, &pack(&[fp, ctx.plan.zero_stage as u64]))?);
        if all.chunks(2).any(|c| c != [fp, ctx.plan.zero_stage as u64]) {
            bail!("the ranks planned different runs (a time-limited search?): pass --plan");
        }
        let outcome = run_rank(&ctx, Box::new(comm), rank)?;
        if rank == 0 {
            ctx.bar.finish_and_clear();
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

/// Plans the run and builds what every rank shares. Only `rank` 0 writes the step log and
/// draws the progress bar.
pub fn prepare(args: &TrainArgs, devices: usize, rank: usize) -> Result<RunContext> {
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let cfg = ModelConfig::resolve(&args.model)?;
    let dtype = args.dtype.dtype();
    let vocab = cfg.vocab_size().unwrap_or(0);
    let dataset = load_dataset(args, vocab)?;
    let train_cfg = TrainConfig {
        weight_decay: args.weight_decay,
        max_grad_norm: (args.max_grad_norm > 0.0).then_some(args.max_grad_norm),
        ..TrainConfig::default()
    };
    let cluster_str = args.cluster.clone().unwrap_or_else(|| format!("{devices}xcpu"));
    let cluster = Cluster::parse(&cluster_str).map_err(plan_err)?;
    if cluster.num_devices() != devices {
        bail!(
            "--cluster {cluster_str} has {} devices but --devices is {devices}: make them agree",
            cluster.num_devices()
        );
    }
    let budget = args.memory_budget.unwrap_or_else(|| cluster.device.usable_bytes());
    let full = build(&cfg, &BuildOptions { batch: args.batch, seq: args.seq, dtype })?;
    let global_train = build_training_graph(full.builder, full.loss, &train_cfg)?;
    let g = &global_train.graph;
    if let Some(n) = g.nodes.iter().find(|n| matches!(n.op, Op::Dropout { p, .. } if p > 0.0)) {
        bail!(
            "{} uses dropout, and a sharded run would key its masks by local element indices \
             (not matching one device): use a config with dropout 0 (*_pdrop / *_dropout \
             fields), or --devices 1",
            g.scope_name(n.scope)
        );
    }
    let model_flops = tessera_profile::count_flops(&global_train.graph).matmul as f64;
    let model_cfg = cfg.clone();
    let seq = args.seq;
    let builder = move |mb: usize| -> tessera_plan::Result<Forward> {
        let m = build(&model_cfg, &BuildOptions { batch: mb, seq, dtype })
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    };
    let req = Request {
        build: &builder,
        model: cfg.name().to_string(),
        batch: args.batch,
        seq,
        dtype,
        cluster,
        budget,
        train: train_cfg.clone(),
        model_flops,
        ckpt: tessera_plan::search::CkptSearch::Joint,
    };
    let plan = choose_plan(&req, &args.plan).context("planning the run")?;
    let exe = planner::lower_plan(&req, &plan).map_err(plan_err)?;
    let placements: HashMap<String, Placement> =
        exe.lowered.leaf_specs.iter().map(|(n, s)| (n.clone(), s.dims.clone())).collect();
    let predicted_comm_bytes: u64 = exe.lowered.collectives.iter().map(|c| c.bytes).sum();
    let mut predicted_calls = BTreeMap::new();
    for c in &exe.lowered.collectives {
        *predicted_calls.entry(c.op.to_string()).or_insert(0) += 1;
    }

    let schedule = make_schedule(args);
    let (params, optimizer, steps_done) = match &args.resume {
        Some(dir) => {
            let ckpt = load_checkpoint(dir)?;
            check_resume(args, &ckpt)?;
            let step = ckpt.manifest.step;
            (ckpt.params, Some(ckpt.optimizer), step)
        }
        None => {
            let g = &global_train.graph;
            let init = init_parameters(g, args.seed)?;
            let params = init
                .into_iter()
                .map(|(t, v)| -> Result<(String, Tensor)> {
                    let want = tessera_runtime::tensor::candle_dtype(g.meta(t).dtype);
                    Ok((g.tensor_scope(t).to_string(), v.to_dtype(want)?))
                })
                .collect::<Result<_>>()?;
            (params, None, 0)
        }
    };
    let first = steps_done + 1;
    let last_step = args.stop_after.map_or(args.steps, |k| k.min(args.steps));
    if first > last_step {
        bail!("nothing to do: the run is already at step {steps_done} of {last_step}");
    }
    let eval = build(&cfg.without_dropout(), &BuildOptions { batch: args.batch, seq, dtype })?;
    let log = match &args.log_json {
        Some(p) if rank == 0 => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        _ => None,
    };
    let bar = if rank == 0 { ProgressBar::new(last_step) } else { ProgressBar::hidden() };
    bar.set_position(first - 1);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    Ok(RunContext {
        args: args.clone(),
        cfg,
        predicted_peak: plan.predicted.peak_bytes_per_device.clone(),
        plan,
        training: exe.lowered.training,
        setup_placements: placements,
        mesh_shape: exe.mesh.shape.clone(),
        micro_batches: exe.micro_batches,
        budget: Some(budget),
        schedule,
        dataset,
        params,
        optimizer,
        steps_done,
        first,
        last_step,
        predicted_comm_bytes,
        predicted_calls,
        eval_model: (eval.builder.finish(), eval.loss),
        log: Mutex::new(log),
        bar,
    })
}

fn check_resume(args: &TrainArgs, ckpt: &Checkpoint) -> Result<()> {
    let m = &ckpt.manifest;
    let mut facts = m.extra.clone();
    if let Some(map) = facts.as_object_mut() {
        map.remove(SCALER_KEY);
    }
    let want = run_facts(args);
    if m.total_steps != args.steps || m.seed != args.seed || facts != want {
        bail!(
            "{} was saved by a run with --steps {} --seed {} {}; resume with the same settings \
             (got --steps {} --seed {} {want})",
            ckpt.dir.display(),
            m.total_steps,
            m.seed,
            m.extra,
            args.steps,
            args.seed
        );
    }
    Ok(())
}

/// Packs u64s into f32s exactly (16 bits each), to gather counters through a communicator.
fn pack(values: &[u64]) -> Vec<f32> {
    values.iter().flat_map(|&v| (0..4).map(move |k| ((v >> (16 * k)) & 0xFFFF) as f32)).collect()
}

fn unpack(data: &[f32]) -> Vec<u64> {
    data.chunks(4)
        .map(|c| c.iter().enumerate().map(|(k, &x)| (x as u64) << (16 * k)).sum())
        .collect()
}

fn calls_of(before: &CommStats, after: &CommStats) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (kind, s) in &after.per_kind {
        let prev = before.per_kind.get(kind).map_or(0, |p| p.calls);
        if s.calls > prev {
            out.insert(kind.name().to_string(), s.calls - prev);
        }
    }
    out
}

/// One rank's whole run: bind its shards, train, save, gather the report.
pub fn run_rank(ctx: &RunContext, comm: Box<dyn Communicator>, rank: usize) -> Result<RankOutcome> {
    let mesh = DeviceMesh::new(&ctx.mesh_shape, rank)?;
    let n = mesh.size();
    let runner = CommRunner::new(comm, mesh.clone())?;
    let setup = DeviceSetup {
        mesh: mesh.clone(),
        placements: ctx.setup_placements.clone(),
        micro_batches: ctx.micro_batches,
        budget: ctx.budget,
    };
    let state = GlobalState {
        params: &ctx.params,
        optimizer: ctx.optimizer.as_ref(),
        steps_done: ctx.steps_done,
    };
    let mut trainer = SpmdTrainer::new(
        ctx.training.clone(),
        CpuBackend::new(rank),
        runner,
        setup,
        ctx.schedule.clone(),
        ctx.args.seed,
        state,
    )?;
    let args = &ctx.args;
    let mut steps = Vec::new();
    let mut last_bytes = 0u64;
    let mut last_calls = BTreeMap::new();
    let mut measured = 0u64;
    let start = Instant::now();
    let fault = Fault::from_env()?;
    for step in ctx.first..=ctx.last_step {
        if let Some(f) = fault.filter(|f| f.rank == rank && f.step == step) {
            f.trigger(args.comm_timeout)?;
        }
        let b = ctx.dataset.train_batch(args.seed, step, args.batch, args.seq)?;
        let before = trainer.comm_stats();
        let t0 = Instant::now();
        let stats = trainer.step(&b.inputs, &b.targets)?;
        let dt = t0.elapsed().as_secs_f64();
        let after = trainer.comm_stats();
        last_bytes = after.total_bytes() - before.total_bytes();
        last_calls = calls_of(&before, &after);
        measured = measured.max(stats.peak_bytes);
        if rank == 0 {
            log_step(ctx, &stats, dt)?;
            steps.push((stats, dt));
        }
        if args.save_every.is_some_and(|k| k > 0 && step % k == 0) && step != ctx.last_step {
            save(ctx, &mut trainer)?;
        }
    }
    save(ctx, &mut trainer)?;
    let elapsed_s = start.elapsed().as_secs_f64();

    // Every rank's peak and traffic, on every rank.
    let world = Group::world(n)?;
    let mine = pack(&[measured, last_bytes]);
    let all = match trainer.communicator() {
        Some(c) if n > 1 => c.all_gather(&world, &mine)?,
        _ => mine,
    };
    let all = unpack(&all);
    let measured_peak: Vec<u64> = all.iter().step_by(2).copied().collect();
    let measured_comm: Vec<u64> = all.iter().skip(1).step_by(2).copied().collect();

    let eval_loss = if args.eval_batches > 0 {
        match gather_params_to(&mut trainer, 0)? {
            Some(params) => Some(evaluate(ctx, &params)?),
            None => None,
        }
    } else {
        None
    };
    Ok(RankOutcome { steps, measured_peak, measured_comm, calls: last_calls, eval_loss, elapsed_s })
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

    fn trigger(self, timeout_s: f64) -> Result<()> {
        match self.kind {
            FaultKind::Error => {}
            FaultKind::Hang => std::thread::sleep(Duration::from_secs_f64(3.0 * timeout_s)),
            FaultKind::Kill => std::process::exit(137),
        }
        bail!("fault injected by TESSERA_FAULT before step {}", self.step)
    }
}

fn log_step(ctx: &RunContext, stats: &StepStats, dt: f64) -> Result<()> {
    let tps = (ctx.args.batch * ctx.args.seq) as f64 / dt;
    if let Ok(mut guard) = ctx.log.lock() {
        if let Some(w) = guard.as_mut() {
            let line = json!({"step": stats.step, "loss": stats.loss, "grad_norm": stats.grad_norm,
                              "lr": stats.lr, "tokens_per_s": tps, "peak_bytes": stats.peak_bytes});
            writeln!(w, "{line}").context("writing the step log")?;
        }
    }
    ctx.bar.set_position(stats.step);
    ctx.bar.set_message(format!(
        "loss {:.4} | {:.0} tok/s | mem {} (predicted {})",
        stats.loss,
        tps,
        bytes(stats.peak_bytes),
        bytes(ctx.predicted_peak.first().copied().unwrap_or(0))
    ));
    Ok(())
}

fn save(ctx: &RunContext, trainer: &mut SpmdTrainer<CpuBackend>) -> Result<()> {
    let Some(dir) = &ctx.args.save else { return Ok(()) };
    let args = &ctx.args;
    let mut manifest = Manifest::new(
        trainer.steps_done(),
        args.steps,
        args.seed,
        &args.model,
        ctx.schedule.clone(),
    );
    manifest.extra = run_facts(args);
    let local = trainer.local_state()?;
    let mesh = trainer.mesh().clone();
    let layout = json!({"config": ctx.plan.config, "mesh": ctx.plan.mesh.shape,
                        "zero_stage": ctx.plan.zero_stage, "micro_batches": ctx.plan.micro_batches});
    let comm = trainer
        .communicator()
        .ok_or_else(|| anyhow!("saving a sharded checkpoint needs a communicator"))?;
    save_sharded(dir, &mesh, &local, comm, &ctx.cfg.to_hf_json(), &manifest, layout)
        .with_context(|| format!("saving a checkpoint to {}", dir.display()))?;
    Ok(())
}

/// Held-out loss of the gathered parameters on one device (rank 0).
fn evaluate(ctx: &RunContext, params: &HashMap<String, Tensor>) -> Result<f64> {
    let (graph, loss) = &ctx.eval_model;
    let program = tessera_ir::Program::lower_graph(graph.clone(), vec![*loss], &[]);
    let mut exec = tessera_runtime::Executor::new(program, CpuBackend::new(0), None);
    for p in graph.parameters() {
        let name = graph.tensor_scope(p);
        let v = params.get(name).ok_or_else(|| anyhow!("eval parameter {name} was not trained"))?;
        exec.bind(p, v.clone())?;
    }
    let ids = graph.find_leaf("input_ids").ok_or_else(|| anyhow!("eval model has no input_ids"))?;
    let labels = graph.find_leaf("labels").ok_or_else(|| anyhow!("eval model has no labels"))?;
    let args = &ctx.args;
    let batches = ctx.dataset.val_batches(args.batch, args.seq, args.eval_batches)?;
    if batches.is_empty() {
        bail!("no held-out batches to evaluate");
    }
    let mut total = 0.0;
    let dims = [args.batch, args.seq];
    for b in &batches {
        exec.bind(ids, tessera_runtime::tensor::from_vec(b.inputs.clone(), &dims)?)?;
        exec.bind(labels, tessera_runtime::tensor::from_vec(b.targets.clone(), &dims)?)?;
        if let Some(tt) = graph.find_leaf("token_type_ids") {
            exec.bind(tt, tessera_runtime::tensor::from_vec(vec![0i64; b.inputs.len()], &dims)?)?;
        }
        exec.run()?;
        let v = exec.get(*loss).ok_or_else(|| anyhow!("eval loss not kept"))?;
        total += v.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
    }
    Ok(total / batches.len() as f64)
}

pub fn report(ctx: &RunContext, o: &RankOutcome, heap_peak: Option<u64>) -> Result<()> {
    if let Ok(mut guard) = ctx.log.lock() {
        if let Some(w) = guard.as_mut() {
            w.flush().context("writing the step log")?;
        }
    }
    let args = &ctx.args;
    let n = o.measured_peak.len();
    let (first, last) = match (o.steps.first(), o.steps.last()) {
        (Some(f), Some(l)) => (f.0, l.0),
        _ => bail!("no step ran"),
    };
    let steps_run = o.steps.len() as u64;
    let tokens_per_s = (args.batch * args.seq) as f64 * steps_run as f64 / o.elapsed_s;
    let predicted_comm = vec![ctx.predicted_comm_bytes; n];
    let plan = &ctx.plan;
    match args.format {
        OutputFormat::Json => {
            let mut doc = json!({
                "model": ctx.cfg.name(),
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
                "batch": args.batch,
                "seq": args.seq,
                "initial_loss": first.loss,
                "final_loss": last.loss,
                "final_grad_norm": last.grad_norm,
                "eval_loss": o.eval_loss,
                "tokens_per_s": tokens_per_s,
                "elapsed_s": o.elapsed_s,
                "memory": {
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
            print_stdout(&format!("{}\n", serde_json::to_string_pretty(&doc)?))
        }
        OutputFormat::Table => {
            let mut s = format!(
                "{} · {} devices · plan {} (mesh {:?}, {} layout) · {} steps · batch {} × seq {} · \
                 {:.0} tokens/s\n",
                ctx.cfg.name(),
                n,
                plan.config,
                plan.mesh.shape,
                plan.layout,
                steps_run,
                args.batch,
                args.seq,
                tokens_per_s
            );
            s += &format!("loss      {:.4} → {:.4} (train)", first.loss, last.loss);
            if let Some(e) = o.eval_loss {
                s += &format!(", {e:.4} (held-out)");
            }
            s += "\n";
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
            s += "device    peak predicted   peak measured   comm/step predicted   measured\n";
            for (d, (measured, comm)) in o.measured_peak.iter().zip(&o.measured_comm).enumerate() {
                s += &format!(
                    "{d:>6}    {:>14}   {:>13}   {:>19}   {:>8}\n",
                    bytes(ctx.predicted_peak.get(d).copied().unwrap_or(0)),
                    bytes(*measured),
                    bytes(ctx.predicted_comm_bytes),
                    bytes(*comm)
                );
            }
            if let Some(h) = heap_peak {
                s += &format!("process heap peak {} (all devices)\n", bytes(h));
            }
            print_stdout(&s)
        }
    }
}
