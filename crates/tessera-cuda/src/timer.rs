//! Where a CUDA step's time goes: [`OpTimer`]'s three ways of measuring each op the backend
//! runs — synchronised around it (with the host's own dispatch time beside, from an empty
//! queue), the host's time inside its dispatch, or a pair of CUDA events on the stream with no
//! synchronisation (each op's own GPU time, the bytes it touches and its dispatch time beside).
//! The GPU check's `speed` reports all three, each per op kind.

use crate::backend::CudaBackend;
use crate::tensor::CudaTensor;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tessera_ir::dist::MeshPos;
use tessera_ir::{Op, TensorMeta};
use tessera_runtime::{Result, RuntimeError};

fn poisoned() -> RuntimeError {
    RuntimeError::Binding("cuda: timer lock poisoned".into())
}

/// Per-op measurements of the backend it is attached to ([`CudaBackend::with_op_timer`]),
/// each switched on by its flag.
#[derive(Clone, Default)]
pub struct OpTimer {
    /// While set, device time per op kind with a synchronisation around each op (the kernels'
    /// own time, at the price of the overlap).
    pub on: Arc<AtomicBool>,
    /// Op name → (calls, seconds).
    pub times: Arc<Mutex<BTreeMap<&'static str, (u64, f64)>>>,
    /// With `on`: op name → (calls, seconds of the host inside the op's dispatch). The queue is
    /// empty when each op starts (the synchronisation before it), so no launch waits for room
    /// in it: this is what issuing the op costs the host, with no GPU time in it.
    pub host_synced: Arc<Mutex<BTreeMap<&'static str, (u64, f64)>>>,
    /// While set (and `on` is not), the host's time inside each op's dispatch, with no
    /// synchronisation: (ops, seconds). Launches are asynchronous, so this is what issuing
    /// a step costs the host — unless the launch queue is full, when it waits on the GPU.
    pub issue: Arc<AtomicBool>,
    pub issued: Arc<Mutex<(u64, f64)>>,
    /// `issued` per op name: (calls, seconds). A launch that finds the GPU's queue full waits
    /// for room, and that wait lands on whichever op made it (compare `host_synced`).
    pub issued_by: Arc<Mutex<BTreeMap<&'static str, (u64, f64)>>>,
    /// While set (and `on` is not), a pair of CUDA events around each op, with no
    /// synchronisation: each op's own time on the GPU, the overlap and the launch queue left
    /// as they are. [`OpTimer::event_times`] reads them once the step is done.
    pub events: Arc<AtomicBool>,
    pub recorded: Arc<Mutex<Vec<OpEvents>>>,
}

/// One op's events (see [`OpTimer::events`]) and the bytes it read and wrote.
pub struct OpEvents {
    pub op: &'static str,
    pub bytes: u64,
    /// The cost model's key and work for the op (`None`: it launches no kernel).
    pub work: Option<tessera_profile::kernels::KernelWork>,
    /// The host's time inside the op's dispatch (allocation, arguments, launches).
    pub host_s: f64,
    start: cudarc::driver::CudaEvent,
    end: cudarc::driver::CudaEvent,
}

/// Per op kind: calls, seconds on the GPU, bytes read and written, seconds on the host.
pub type OpKindTimes = BTreeMap<&'static str, (u64, f64, u64, f64)>;

impl OpTimer {
    /// The recorded ops' GPU time per kind (waits for the events), and the span from the
    /// first op's start to the last op's end; the records are consumed.
    pub fn event_times(&self) -> Result<(OpKindTimes, f64)> {
        let recs = std::mem::take(&mut *self.recorded.lock().map_err(|_| poisoned())?);
        let mut by = OpKindTimes::new();
        for r in &recs {
            let ms = r
                .start
                .elapsed_ms(&r.end)
                .map_err(|e| RuntimeError::Binding(format!("cuda: event: {e:?}")))?;
            let e = by.entry(r.op).or_default();
            e.0 += 1;
            e.1 += ms as f64 / 1e3;
            e.2 += r.bytes;
            e.3 += r.host_s;
        }
        let span = match (recs.first(), recs.last()) {
            (Some(a), Some(b)) => {
                a.start
                    .elapsed_ms(&b.end)
                    .map_err(|e| RuntimeError::Binding(format!("cuda: event: {e:?}")))?
                    as f64
                    / 1e3
            }
            _ => 0.0,
        };
        Ok((by, span))
    }

    /// The recorded ops in order, each as a calibration sample (its kernel key and work, its
    /// GPU time, its host time; waits for the events); the records are consumed.
    pub fn samples(&self) -> Result<Vec<tessera_profile::kernels::KernelSample>> {
        let recs = std::mem::take(&mut *self.recorded.lock().map_err(|_| poisoned())?);
        recs.into_iter()
            .map(|r| {
                let ms = r
                    .start
                    .elapsed_ms(&r.end)
                    .map_err(|e| RuntimeError::Binding(format!("cuda: event: {e:?}")))?;
                Ok(tessera_profile::kernels::KernelSample {
                    kind: r.op.to_string(),
                    work: r.work,
                    device_s: ms as f64 / 1e3,
                    host_s: r.host_s,
                })
            })
            .collect()
    }
}

impl CudaBackend {
    /// [`CudaBackend::execute_impl`] measured as `timer`'s switches say: synchronised around
    /// the op, the host's dispatch time, CUDA events, or not at all.
    pub(crate) fn execute_timed(
        &self,
        timer: &OpTimer,
        op: &Op,
        inputs: &[&CudaTensor],
        outputs: &[TensorMeta],
        at: &MeshPos,
    ) -> Result<Vec<CudaTensor>> {
        if timer.on.load(Ordering::Relaxed) {
            self.gpu().synchronize()?;
            let t0 = Instant::now();
            let out = self.execute_impl(op, inputs, outputs, at)?;
            let host = t0.elapsed().as_secs_f64();
            self.gpu().synchronize()?;
            let total = t0.elapsed().as_secs_f64();
            let mut times = timer.times.lock().map_err(|_| poisoned())?;
            let e = times.entry(op.name()).or_default();
            e.0 += 1;
            e.1 += total;
            let mut hosts = timer.host_synced.lock().map_err(|_| poisoned())?;
            let e = hosts.entry(op.name()).or_default();
            e.0 += 1;
            e.1 += host;
            return Ok(out);
        }
        if timer.issue.load(Ordering::Relaxed) {
            let t0 = Instant::now();
            let out = self.execute_impl(op, inputs, outputs, at)?;
            let host = t0.elapsed().as_secs_f64();
            let mut issued = timer.issued.lock().map_err(|_| poisoned())?;
            issued.0 += 1;
            issued.1 += host;
            let mut by = timer.issued_by.lock().map_err(|_| poisoned())?;
            let e = by.entry(op.name()).or_default();
            e.0 += 1;
            e.1 += host;
            return Ok(out);
        }
        if timer.events.load(Ordering::Relaxed) {
            return self.execute_with_events(timer, op, inputs, outputs, at);
        }
        self.execute_impl(op, inputs, outputs, at)
    }

    /// `execute_impl` between two timing events on the GPU's stream (no synchronisation).
    fn execute_with_events(
        &self,
        timer: &OpTimer,
        op: &Op,
        inputs: &[&CudaTensor],
        outputs: &[TensorMeta],
        at: &MeshPos,
    ) -> Result<Vec<CudaTensor>> {
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let event = |what| {
            self.gpu()
                .stream
                .record_event(timing)
                .map_err(|e| RuntimeError::Binding(format!("cuda: {what}: {e:?}")))
        };
        let start = event("recording an op's start")?;
        let t0 = Instant::now();
        let out = self.execute_impl(op, inputs, outputs, at)?;
        let host_s = t0.elapsed().as_secs_f64();
        let end = event("recording an op's end")?;
        let bytes = inputs.iter().copied().chain(out.iter()).map(|t| t.meta().size_bytes()).sum();
        let x: Vec<TensorMeta> = inputs.iter().map(|t| t.meta()).collect();
        let xr: Vec<&TensorMeta> = x.iter().collect();
        let yr: Vec<&TensorMeta> = outputs.iter().collect();
        let work = tessera_profile::kernels::kernel_work(op, &xr, &yr);
        timer.recorded.lock().map_err(|_| poisoned())?.push(OpEvents {
            op: op.name(),
            bytes,
            work,
            host_s,
            start,
            end,
        });
        Ok(out)
    }
}
