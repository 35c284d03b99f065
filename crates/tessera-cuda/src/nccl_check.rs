//! The NCCL transport's checks on a GPU, for the GPU check binary: [`run`] returns one JSON line
//! per check, each with an `"ok"` field.
//!
//! - `nccl_conformance`: tessera-comm's conformance suite on [`NcclComm::single`] (a world of
//!   one rank: every collective through NCCL, messages to self on the host).
//! - `nccl_train_step`: a few gpt2-tiny training steps through the SPMD path (`Trainer::new`
//!   with a `CommRunner` over the NCCL communicator) against `Trainer::single` on the same
//!   backend without one; the losses must agree as closely as the GPU agrees with itself run to
//!   run (bit for bit where its kernels are deterministic). A one-device program has no
//!   reshards, so the step itself makes no collective call: the line says how many it made
//!   (`collective_calls`, from the trainer's counters), then one barrier is made through the
//!   trainer's communicator to show it is live.
//!
//! A panic inside cudarc (it panics on some failures, e.g. a missing NCCL symbol) is caught and
//! reported as a failed check rather than ending the binary.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use tessera_comm::conformance::check_all;
use tessera_comm::{CommStats, Group};
use tessera_ir::{DType, TrainingGraph};
use tessera_runtime::collective::{CommRunner, DeviceMesh};
use tessera_runtime::init::init_rules_by_name;
use tessera_runtime::{DeviceSetup, LrSchedule, StartState, Trainer};

use crate::fixtures::{token_batches as batches, training_graph, vocab};
use crate::nccl::NcclComm;
use crate::{CudaBackend, Gpu};

const MODEL: &str = "gpt2-tiny";
const STEPS: usize = 3;
const SEED: u64 = 7;

/// Runs every NCCL check on `gpu`; one JSON object per line, each with `"ok"`.
pub fn run(gpu: &Arc<Gpu>) -> Vec<String> {
    vec![
        guarded("nccl_conformance", || conformance(gpu)),
        guarded("nccl_train_step", || train_step(gpu)),
    ]
}

/// `s` as a JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn failed(check: &str, error: &str) -> String {
    format!("{{\"check\":{},\"ok\":false,\"error\":{}}}", json_str(check), json_str(error))
}

/// Runs one check, turning an error or a panic into a failed line.
fn guarded(check: &str, f: impl FnOnce() -> Result<String, String>) -> String {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(line)) => line,
        Ok(Err(e)) => failed(check, &e),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic without a message".into());
            failed(check, &format!("panicked: {msg}"))
        }
    }
}

/// `{"all_reduce":{"calls":..,"bytes":..},...}`.
fn stats_json(s: &CommStats) -> String {
    let kinds: Vec<String> = s
        .per_kind
        .iter()
        .map(|(k, v)| format!("\"{k}\":{{\"calls\":{},\"bytes\":{}}}", v.calls, v.bytes))
        .collect();
    format!("{{{}}}", kinds.join(","))
}

fn conformance(gpu: &Arc<Gpu>) -> Result<String, String> {
    let mut comm = NcclComm::single(gpu.clone()).map_err(|e| e.to_string())?;
    let version = cudarc::nccl::result::get_nccl_version().unwrap_or(0);
    let outcome = check_all(&mut comm);
    let stats = tessera_comm::Communicator::stats(&comm);
    let (ok, error) = match &outcome {
        Ok(()) => (true, String::new()),
        Err(e) => (false, e.to_string()),
    };
    Ok(format!(
        "{{\"check\":\"nccl_conformance\",\"world_size\":1,\"nccl_version\":{version},\
         \"calls\":{},\"bytes\":{},\"per_kind\":{},\"ok\":{ok},\"error\":{}}}",
        stats.total_calls(),
        stats.total_bytes(),
        stats_json(&stats),
        json_str(&error)
    ))
}

fn graph(batch: usize, seq: usize) -> Result<(TrainingGraph, usize), String> {
    Ok((training_graph(MODEL, batch, seq, DType::F32)?, vocab(MODEL)?))
}

fn losses<B: tessera_runtime::Backend>(
    t: &mut Trainer<B>,
    data: &[(Vec<i64>, Vec<i64>)],
) -> Result<Vec<f64>, String> {
    data.iter().map(|(i, o)| t.step(i, o).map(|s| s.loss).map_err(|e| e.to_string())).collect()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f64, f64::max)
}

fn schedule() -> LrSchedule {
    LrSchedule::Constant { lr: 1e-3 }
}

fn reference(gpu: &Arc<Gpu>, batch: usize, seq: usize) -> Result<Vec<f64>, String> {
    let (tg, vocab) = graph(batch, seq)?;
    let backend = CudaBackend::new(gpu.clone());
    let mut t = Trainer::single(tg, backend, schedule(), SEED, None).map_err(|e| e.to_string())?;
    losses(&mut t, &batches(vocab, batch, seq, STEPS))
}

fn train_step(gpu: &Arc<Gpu>) -> Result<String, String> {
    let (batch, seq) = (2, 64);
    let want = reference(gpu, batch, seq)?;
    // The GPU's own run-to-run spread: the bound the SPMD run is held to (0 if deterministic).
    let again = reference(gpu, batch, seq)?;
    let noise = max_diff(&want, &again);

    let comm = NcclComm::single(gpu.clone()).map_err(|e| e.to_string())?;
    let runner =
        CommRunner::new(Box::new(comm), DeviceMesh::single()).map_err(|e| e.to_string())?;
    let (tg, vocab) = graph(batch, seq)?;
    let rules = init_rules_by_name(&tg.graph);
    let mut t = Trainer::new(
        tg,
        CudaBackend::new(gpu.clone()),
        Some(runner),
        DeviceSetup::single(None),
        schedule(),
        SEED,
        StartState::Fresh { rules: &rules },
    )
    .map_err(|e| e.to_string())?;
    let got = losses(&mut t, &batches(vocab, batch, seq, STEPS))?;
    let during = t.comm_stats();
    // The step made no call on one device; show the attached communicator is live anyway.
    let barrier = match t.communicator() {
        Some(c) => {
            let world = Group::world(1).map_err(|e| e.to_string())?;
            c.barrier(&world).map_err(|e| e.to_string())
        }
        None => Err("the trainer holds no communicator".to_string()),
    };
    let diff = max_diff(&got, &want);
    let equal = got.len() == want.len() && diff <= noise;
    let ok = equal && barrier.is_ok();
    let note = if during.total_calls() == 0 {
        "a 1-device program has no reshards: the steps ran with the NCCL communicator attached \
         but made no collective call; the barrier after them went through NCCL"
    } else {
        "the steps' collectives went through NCCL"
    };
    let list = |v: &[f64]| v.iter().map(|x| format!("{x:e}")).collect::<Vec<_>>().join(",");
    Ok(format!(
        "{{\"check\":\"nccl_train_step\",\"model\":\"{MODEL}\",\"steps\":{STEPS},\
         \"loss_spmd\":[{}],\"loss_single\":[{}],\"max_abs_diff\":{diff:e},\
         \"run_to_run_diff\":{noise:e},\"collective_calls\":{},\"collective_bytes\":{},\
         \"per_kind\":{},\"barrier_after\":{},\"note\":{},\"ok\":{ok}}}",
        list(&got),
        list(&want),
        during.total_calls(),
        during.total_bytes(),
        stats_json(&during),
        json_str(&barrier.err().unwrap_or_else(|| "ok".into())),
        json_str(note)
    ))
}
