//! The planner's entry points: the automatic search, a fixed configuration, a plan file, and
//! the Megatron-LM baseline — all priced by the same cost model on lowered Programs.
//!
//! Search space of `auto`: meshes `[N]` and `[N/t, t]` for every tensor-axis size `t` that
//! divides a node (so the inner axis stays on the fast link), each with the free per-op ILP,
//! plus every Megatron-style configuration (the ILP constrained to `dp` on the batch); ZeRO
//! stages 0–3 and power-of-two micro-batch counts. For each mesh and ZeRO stage the smallest
//! micro-batch count that fits is kept (more micro-batches only add per-kernel overhead and
//! ZeRO-3 gathers); ZeRO stages above the first that fits without micro-batching are skipped
//! (they save memory that is not needed and add communication or nothing).

use crate::config::ParallelConfig;
use crate::plan::{BaselineJson, Plan, PlanContext};
use crate::search::{self, AxisRule, Candidate, Evaluated, Forward, Problem0};
use crate::{Cluster, Mesh, PlanError, Result};
use std::time::Instant;
use tessera_ir::{DType, TrainConfig};

pub struct Request<'a> {
    /// Builds the global forward graph for a micro-batch size.
    pub build: &'a (dyn Fn(usize) -> Result<Forward> + Sync),
    pub model: String,
    pub batch: usize,
    pub seq: usize,
    pub dtype: DType,
    pub cluster: Cluster,
    /// Per-device memory budget, bytes.
    pub budget: u64,
    pub train: TrainConfig,
    /// Matmul FLOPs of one global step (for MFU).
    pub model_flops: f64,
}

impl Request<'_> {
    fn problem(&self) -> Problem0<'_> {
        Problem0 {
            build: self.build,
            batch: self.batch,
            cost: crate::cost::CostModel::new(self.cluster.device.clone()),
            train: self.train.clone(),
            solve: crate::ilp::SolveOptions { time_limit_s: 5.0, mip_rel_gap: 1e-2 },
            graphs: Default::default(),
        }
    }

    fn context<'g>(&self, forward: &'g tessera_ir::Graph) -> PlanContext<'g> {
        PlanContext {
            model: self.model.clone(),
            cluster: self.cluster.to_string(),
            batch: self.batch,
            seq: self.seq,
            dtype: self.dtype.to_string(),
            budget: self.budget,
            model_flops: self.model_flops,
            peak_flops: self.cluster.device.peak_flops(self.dtype),
            forward,
        }
    }

    fn to_plan(&self, e: &Evaluated, source: &str, ms: f64) -> Result<Plan> {
        let fwd = (self.build)(self.batch / e.candidate.micro_batches.max(1))?;
        Ok(Plan::from_evaluated(&self.context(&fwd.graph), e, source, ms))
    }

    fn micro_batch_options(&self) -> Vec<usize> {
        (0..8)
            .map(|k| 1usize << k)
            .filter(|&m| m <= self.batch && self.batch.is_multiple_of(m))
            .collect()
    }
}

fn megatron_mesh(cluster: &Cluster, cfg: &ParallelConfig) -> Result<Mesh> {
    cfg.check_devices(cluster.num_devices())?;
    Mesh::new(cluster, &[cfg.dp, cfg.tp], &["dp", "tp"])
}

/// The smallest fitting micro-batch count for one (mesh, rule, zero).
fn first_fit(
    req: &Request<'_>,
    p: &Problem0<'_>,
    mesh: &Mesh,
    rule: &AxisRule,
    zero: u8,
    mbs: &[usize],
) -> Result<(usize, Option<Evaluated>)> {
    let mut tried = 0;
    for &mb in mbs {
        tried += 1;
        let cand = Candidate { mesh: mesh.clone(), rule: rule.clone(), zero, micro_batches: mb };
        if let Some(e) = search::evaluate(p, &cand, req.budget as f64)? {
            return Ok((tried, Some(e)));
        }
    }
    Ok((tried, None))
}

/// Evaluates a fixed configuration (the best plan within it).
pub fn plan_fixed(req: &Request<'_>, cfg: &ParallelConfig) -> Result<Plan> {
    let t0 = Instant::now();
    let mesh = megatron_mesh(&req.cluster, cfg)?;
    if !req.batch.is_multiple_of(cfg.dp * cfg.micro_batches) {
        return Err(PlanError::Invalid(format!(
            "batch {} does not split into {} data-parallel replicas × {} micro-batches: use a batch \
             that is a multiple of {}",
            req.batch,
            cfg.dp,
            cfg.micro_batches,
            cfg.dp * cfg.micro_batches
        )));
    }
    let p = req.problem();
    let cand = Candidate {
        mesh,
        rule: AxisRule::Megatron { sp: cfg.sp },
        zero: cfg.zero,
        micro_batches: cfg.micro_batches,
    };
    match search::evaluate(&p, &cand, req.budget as f64)? {
        Some(e) => {
            let mut plan = req.to_plan(&e, "fixed", t0.elapsed().as_secs_f64() * 1e3)?;
            plan.config = cfg.canonical();
            Ok(plan)
        }
        None => {
            let needed = search::min_peak(&p, &cand)?;
            match needed {
                Some(n) => Err(PlanError::Infeasible {
                    budget: req.budget,
                    needed: n,
                    hint: format!("`{}` at its most memory-frugal layout; raise ZeRO, add micro-batches or devices", cfg.canonical()),
                }),
                None => Err(PlanError::Invalid(format!(
                    "`{}` cannot split this model: a degree does not divide the batch, heads or hidden size",
                    cfg.canonical()
                ))),
            }
        }
    }
}

/// All Megatron-LM-style configurations (dp × tp within a node, sp on/off, ZeRO 0–3, micro
/// batches); returns the fastest that fits, with the counts tried and fitting.
pub fn megatron(req: &Request<'_>) -> Result<Option<(Evaluated, ParallelConfig, usize, usize)>> {
    megatron_in(req, &req.problem())
}

fn megatron_in(
    req: &Request<'_>,
    p: &Problem0<'_>,
) -> Result<Option<(Evaluated, ParallelConfig, usize, usize)>> {
    let n = req.cluster.num_devices();
    let mbs = req.micro_batch_options();
    let mut jobs = Vec::new();
    for tp in (1..=req.cluster.gpus_per_node.min(n)).filter(|&t| n.is_multiple_of(t)) {
        for sp in [false, true] {
            if sp && tp == 1 {
                continue;
            }
            for zero in 0..=3u8 {
                jobs.push(ParallelConfig { dp: n / tp, tp, zero, micro_batches: 1, sp });
            }
        }
    }
    let results =
        parallel_map(&jobs, |cfg| -> Result<(usize, Option<(Evaluated, ParallelConfig)>)> {
            let mesh = megatron_mesh(&req.cluster, cfg)?;
            let mbs: Vec<usize> =
                mbs.iter().copied().filter(|m| req.batch.is_multiple_of(m * cfg.dp)).collect();
            let (tried, e) =
                first_fit(req, p, &mesh, &AxisRule::Megatron { sp: cfg.sp }, cfg.zero, &mbs)?;
            Ok((
                tried,
                e.map(|e| {
                    let mb = e.candidate.micro_batches;
                    (e, ParallelConfig { micro_batches: mb, ..cfg.clone() })
                }),
            ))
        });
    let (mut tried, mut fitting) = (0, 0);
    let mut best: Option<(Evaluated, ParallelConfig)> = None;
    for r in results {
        let (t, e) = r?;
        tried += t;
        if let Some((e, cfg)) = e {
            fitting += 1;
            if best.as_ref().is_none_or(|(b, _)| e.step_time_s() < b.step_time_s()) {
                best = Some((e, cfg));
            }
        }
    }
    Ok(best.map(|(e, c)| (e, c, tried, fitting)))
}

/// The automatic plan: the fastest fitting candidate of the whole space.
pub fn plan_auto(req: &Request<'_>) -> Result<Plan> {
    let t0 = Instant::now();
    let n = req.cluster.num_devices();
    let p = req.problem();
    let mbs = req.micro_batch_options();
    let mut meshes: Vec<Vec<usize>> = vec![vec![n]];
    for t in 2..=req.cluster.gpus_per_node.min(n) {
        if n.is_multiple_of(t) && req.cluster.gpus_per_node.is_multiple_of(t) && t < n {
            meshes.push(vec![n / t, t]);
        }
    }
    let results = parallel_map(&meshes, |shape| -> Result<Option<Evaluated>> {
        let names: Vec<&str> = if shape.len() == 1 { vec!["a0"] } else { vec!["a0", "a1"] };
        let mesh = Mesh::new(&req.cluster, shape, &names)?;
        let mut best: Option<Evaluated> = None;
        for zero in 0..=3u8 {
            let (_, e) = first_fit(req, &p, &mesh, &AxisRule::Free, zero, &mbs)?;
            let Some(e) = e else { continue };
            let done = e.candidate.micro_batches == 1;
            if best.as_ref().is_none_or(|b| e.step_time_s() < b.step_time_s()) {
                best = Some(e);
            }
            if done {
                break;
            }
        }
        Ok(best)
    });
    let mut best: Option<Evaluated> = None;
    for r in results {
        if let Some(e) = r? {
            if best.as_ref().is_none_or(|b| e.step_time_s() < b.step_time_s()) {
                best = Some(e);
            }
        }
    }
    if let Some((e, _, _, _)) = megatron_in(req, &p)? {
        if best.as_ref().is_none_or(|b| e.step_time_s() < b.step_time_s()) {
            best = Some(e);
        }
    }
    match best {
        Some(e) => req.to_plan(&e, "auto", t0.elapsed().as_secs_f64() * 1e3),
        None => Err(infeasible(req, &p, &mbs)?),
    }
}

/// Re-lowers a plan file's strategies (hand edits included) with the current cost model.
pub fn plan_from_file(req: &Request<'_>, file: &Plan) -> Result<Plan> {
    let t0 = Instant::now();
    if file.version != crate::plan::PLAN_VERSION {
        return Err(PlanError::Invalid(format!(
            "plan file version {} is not supported (this tessera writes version {})",
            file.version,
            crate::plan::PLAN_VERSION
        )));
    }
    let mesh = Mesh::new(
        &req.cluster,
        &file.mesh.shape,
        &file.mesh.axes.iter().map(String::as_str).collect::<Vec<_>>(),
    )?;
    let mb = file.micro_batches.max(1);
    if !req.batch.is_multiple_of(mb) {
        return Err(PlanError::Invalid(format!(
            "batch {} does not split into {mb} micro-batches",
            req.batch
        )));
    }
    let fwd = (req.build)(req.batch / mb)?;
    let strategies = file.node_strategies(&fwd.graph, &mesh)?;
    let p = req.problem();
    let opts = crate::lower::LowerOptions {
        zero: file.zero_stage,
        micro_batches: mb,
        train: req.train.clone(),
    };
    let lowered = crate::lower::lower(&fwd.graph, fwd.loss, &strategies, &mesh, &p.cost, &opts)?;
    let e = Evaluated {
        candidate: Candidate {
            mesh,
            rule: AxisRule::Free,
            zero: file.zero_stage,
            micro_batches: mb,
        },
        strategies,
        lowered,
        ilp_objective_s: f64::NAN,
    };
    if e.peak_bytes() > req.budget {
        return Err(PlanError::Infeasible {
            budget: req.budget,
            needed: e.peak_bytes(),
            hint: "this plan file's layout".into(),
        });
    }
    req.to_plan(&e, "file", t0.elapsed().as_secs_f64() * 1e3)
}

/// The error when nothing fits: the least memory any candidate needs.
fn infeasible(req: &Request<'_>, p: &Problem0<'_>, mbs: &[usize]) -> Result<PlanError> {
    let n = req.cluster.num_devices();
    let mut needed: Option<u64> = None;
    let mb = mbs.last().copied().unwrap_or(1);
    let mut shapes = vec![vec![n]];
    for t in 2..=req.cluster.gpus_per_node.min(n) {
        if n.is_multiple_of(t) && req.cluster.gpus_per_node.is_multiple_of(t) && t < n {
            shapes.push(vec![n / t, t]);
        }
    }
    for shape in shapes {
        let mesh = Mesh::new(&req.cluster, &shape, &[])?;
        let cand = Candidate { mesh, rule: AxisRule::Free, zero: 3, micro_batches: mb };
        if let Some(b) = search::min_peak(p, &cand)? {
            needed = Some(needed.map_or(b, |x: u64| x.min(b)));
        }
    }
    Ok(PlanError::Infeasible {
        budget: req.budget,
        needed: needed.unwrap_or(u64::MAX),
        hint: format!(
            "with ZeRO-3 and {mb} micro-batches on {n} devices; add devices or memory, or shorten the sequence"
        ),
    })
}

/// Runs `f` over `items` on the machine's threads, keeping order.
fn parallel_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads =
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(items.len()).max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut out: Vec<Option<R>> = (0..items.len()).map(|_| None).collect();
    let slots: Vec<std::sync::Mutex<&mut Option<R>>> =
        out.iter_mut().map(std::sync::Mutex::new).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= items.len() {
                    break;
                }
                let r = f(&items[i]);
                if let Ok(mut slot) = slots[i].lock() {
                    **slot = Some(r);
                }
            });
        }
    });
    drop(slots);
    out.into_iter().map(|r| r.expect("every item ran")).collect()
}

/// Fills the Megatron baseline of a plan.
pub fn attach_megatron(req: &Request<'_>, plan: &mut Plan) -> Result<()> {
    if let Some((e, cfg, tried, fitting)) = megatron(req)? {
        plan.baselines.megatron = Some(BaselineJson {
            config: cfg.canonical(),
            step_time_s: e.step_time_s(),
            peak_bytes_per_device: vec![e.peak_bytes(); req.cluster.num_devices()],
            configurations_tried: tried,
            configurations_fitting: fitting,
        });
    }
    Ok(())
}
