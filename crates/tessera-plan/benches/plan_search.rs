//! Speed of the automatic search (`tessera plan`), the two bounds: llama3-8b on
//! `8xH100` (batch 32, seq 4096) under 2 s and llama2-70b on `8x8xH100` (batch 256, seq 4096)
//! under 10 s, on the 2-core development machine. Each case also prints its wall time against
//! the bound measured in the same run; figures go to BENCHMARKS.md.
//!
//! `cargo bench -p tessera-plan --bench plan_search`

use criterion::{criterion_group, criterion_main, Criterion};
use std::time::{Duration, Instant};
use tessera_ir::{DType, TrainConfig};
use tessera_models::{build, BuildOptions, ModelConfig};
use tessera_plan::planner::{plan_auto, Request};
use tessera_plan::search::Forward;
use tessera_plan::{Cluster, PlanError};

struct Case {
    model: &'static str,
    cluster: &'static str,
    batch: usize,
    seq: usize,
    bound_s: f64,
}

const CASES: &[Case] = &[
    Case { model: "llama3-8b", cluster: "8xH100", batch: 32, seq: 4096, bound_s: 2.0 },
    Case { model: "llama2-70b", cluster: "8x8xH100", batch: 256, seq: 4096, bound_s: 10.0 },
];

fn search(case: &Case) -> String {
    let cfg = ModelConfig::preset(case.model).expect("preset");
    let seq = case.seq;
    let builder = move |mb: usize| -> tessera_plan::Result<Forward> {
        let m = build(&cfg, &BuildOptions::new(mb, seq, DType::BF16))
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        Ok(Forward { graph: m.builder.finish(), loss: m.loss })
    };
    let cluster = Cluster::parse(case.cluster).expect("cluster");
    let req = Request {
        build: &builder,
        model: case.model.into(),
        batch: case.batch,
        seq,
        dtype: DType::BF16,
        budget: cluster.device.usable_bytes(),
        cluster,
        train: TrainConfig::default(),
        model_flops: 1.0,
        ckpt: tessera_plan::search::CkptSearch::Joint,
        pipeline: Default::default(),
    };
    plan_auto(&req).expect("a plan").config
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan_auto");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(1));
    for case in CASES {
        let t0 = Instant::now();
        let config = search(case);
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "{} on {} (batch {}, seq {}): `{config}` in {secs:.2} s; bound {} s = {:.1}× the time",
            case.model,
            case.cluster,
            case.batch,
            case.seq,
            case.bound_s,
            case.bound_s / secs
        );
        group.bench_function(format!("{}_{}", case.model, case.cluster), |b| {
            b.iter(|| search(case))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
