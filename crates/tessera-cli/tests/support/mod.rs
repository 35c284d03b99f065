//! The harness the run tests share (`chunked_loss.rs`, `tiled_mlp.rs`, `act_offload.rs`): a
//! config planned exactly on `Nxcpu` (thread devices) for a model given as a config.json, and
//! trained a few steps on those devices from a fixed seed, returning rank 0's per-step losses
//! and each device's measured device and host peaks — what the tests hold against one device
//! and against the plan's prediction. The parallel-axis tests' runs of the binary itself are
//! [`axis_runs`]'s.
#![allow(dead_code)] // each test file uses its part

pub mod axis_runs;

use std::collections::HashMap;
use std::time::Duration;
use tessera_comm::ThreadComm;
use tessera_ir::{DType, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::config::ParallelConfig;
use tessera_plan::plan::Plan;
use tessera_plan::planner::{self, Executable, Request};
use tessera_plan::search::Forward;
use tessera_plan::{Cluster, PlanError};
use tessera_runtime::collective::{CommRunner, DeviceMesh};
use tessera_runtime::init::{init_rules_by_name, InitRule};
use tessera_runtime::{CpuBackend, DeviceSetup, LrSchedule, StartState, StepBatch, Trainer};

/// One test's run shape: fp32, AdamW (weight decay 0.1, clipping at 1), warmup-cosine lr.
pub struct Run {
    pub batch: usize,
    pub seq: usize,
    pub steps: u64,
    pub seed: u64,
    /// Token ids are drawn below this.
    pub tokens: u64,
    /// Host memory per device (`None`: the `Nxcpu` preset's).
    pub host_memory: Option<u64>,
}

/// What a run measured: rank 0's per-step losses and each device's device and host peaks
/// (the largest over the steps).
pub struct Measured {
    pub losses: Vec<f64>,
    pub peaks: Vec<u64>,
    pub host_peaks: Vec<u64>,
}

/// Writes `json` as `<name>.json` in this process's temporary directory for `test`; returns
/// its path. Written beside and renamed into place, so a test reading it while another
/// thread of the binary writes it again never sees half a file.
pub fn write_model(test: &str, name: &str, json: &serde_json::Value) -> String {
    let dir = std::env::temp_dir().join(format!("tessera-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.json"));
    let tmp = dir.join(format!("{name}.json.{:?}", std::thread::current().id()));
    std::fs::write(&tmp, json.to_string()).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    path.to_str().unwrap().to_string()
}

pub fn assert_losses(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (s, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * y.abs(), "{what} step {}: {x} vs {y}", s + 1);
    }
}

impl Run {
    fn schedule(&self) -> LrSchedule {
        LrSchedule::WarmupCosine { peak: 1e-3, min_lr: 1e-4, warmup: 1, total: self.steps }
    }

    pub fn train_cfg(&self) -> TrainConfig {
        TrainConfig { weight_decay: 0.1, max_grad_norm: Some(1.0), ..TrainConfig::default() }
    }

    pub fn batch(&self, step: u64) -> StepBatch {
        let (n, tokens) = ((self.batch * self.seq) as u64, self.tokens);
        let tok = |salt: u64| -> Vec<i64> {
            (0..n)
                .map(|i| {
                    (tessera_ir::rng::splitmix64(i ^ salt.wrapping_mul(0x9E37_79B9)) % tokens)
                        as i64
                })
                .collect()
        };
        StepBatch::tokens(tok(step * 2 + 1), tok(step * 2 + 2), self.batch, self.seq).unwrap()
    }

    /// `config` planned exactly (its unwritten knobs searched) on `devices` thread devices.
    pub fn plan(
        &self,
        model: &str,
        devices: usize,
        config: &str,
    ) -> Result<(Plan, Executable), PlanError> {
        let cfg = ModelConfig::resolve(model).unwrap();
        let seq = self.seq;
        let builder = |mb: usize| -> tessera_plan::Result<Forward> {
            let m = build(&cfg, &BuildOptions { batch: mb, seq, dtype: DType::F32 })
                .map_err(|e| PlanError::Invalid(e.to_string()))?;
            Ok(Forward { graph: m.builder.finish(), loss: m.loss })
        };
        let mut cluster = Cluster::parse(&format!("{devices}xcpu")).unwrap();
        if let Some(h) = self.host_memory {
            cluster.host.memory_bytes = h;
        }
        let req = Request {
            build: &builder,
            model: cfg.name().to_string(),
            batch: self.batch,
            seq,
            dtype: DType::F32,
            cluster,
            budget: 1 << 40,
            train: self.train_cfg(),
            model_flops: 1.0,
            ckpt: tessera_plan::search::CkptSearch::Joint,
            pipeline: Default::default(),
            search: Default::default(),
        };
        let plan = planner::plan_fixed(&req, &ParallelConfig::parse(config)?)?;
        let exe = planner::lower_plan(&req, &plan)?;
        Ok((plan, exe))
    }

    /// The plan trained `steps` steps on its thread devices.
    pub fn train(&self, model: &str, exe: &Executable) -> Measured {
        let cfg = ModelConfig::resolve(model).unwrap();
        let opts = BuildOptions { batch: self.batch, seq: self.seq, dtype: DType::F32 };
        let m = build(&cfg, &opts).unwrap();
        let rules: HashMap<String, InitRule> = init_rules_by_name(&m.builder.finish());
        let n: usize = exe.mesh.shape.iter().product();
        let comms = ThreadComm::world(n, Duration::from_secs(60)).unwrap();
        let out: Vec<(Vec<f64>, u64, u64)> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let rules = &rules;
                    s.spawn(move || {
                        let mesh = DeviceMesh::new(&exe.mesh.shape, rank).unwrap();
                        let runner = CommRunner::new(Box::new(comm), mesh.clone()).unwrap();
                        let setup = DeviceSetup {
                            mesh,
                            budget: None,
                            host_budget: None,
                            offload_dir: None,
                        };
                        let mut t = Trainer::new(
                            exe.lowered.training_graph(),
                            CpuBackend::new(rank),
                            Some(runner),
                            setup,
                            self.schedule(),
                            self.seed,
                            StartState::Fresh { rules },
                        )
                        .unwrap();
                        let (mut losses, mut peak, mut host) = (Vec::new(), 0, 0);
                        for step in 1..=self.steps {
                            let st = t.step_batch(&self.batch(step)).unwrap();
                            losses.push(st.loss);
                            peak = peak.max(st.peak_bytes);
                            host = host.max(st.host_peak_bytes);
                        }
                        (losses, peak, host)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
        });
        Measured {
            losses: out[0].0.clone(),
            peaks: out.iter().map(|o| o.1).collect(),
            host_peaks: out.iter().map(|o| o.2).collect(),
        }
    }
}
