//! `tessera._native`, the Python package's native module. `report(argv)` runs a command
//! (`profile`, `plan`, `train`, `eval`, `generate`) through the CLI's own code
//! ([`tessera_cli::run_json`]: the same parsing, defaults, validation and command code) and
//! returns what `--format json` prints, as the dict `json.loads` makes of it. [`Run`] does the
//! same in a thread of its own and talks to Python while it runs: progress and tokens come
//! out as events, batches (and saves, evaluations, the end) go in when the run asks for
//! them. A failure is a `tessera.TesseraError` (a `ValueError`) with the CLI's message and, as
//! `.error`, the error object `--format json` prints; a panic is caught and raised the same
//! way, never unwound into Python. `python/tessera/__init__.py` turns keyword arguments into
//! the command line and drives [`Run`].
//!
//! The GIL: the command runs without it, in its own thread, and never calls Python. Every
//! Python object (an iterable's next batch, a callback) is touched by the thread that called
//! `Run.wait`, holding the GIL; waiting, it lets the GIL go and every 50 ms takes it back to
//! run Python's signal handlers, so Ctrl-C raises `KeyboardInterrupt` there.

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tessera_cli::hooks::{BatchSource, Events, Hooks, Request, StepBatch, Values};
use tessera_cli::ReportError;

create_exception!(
    tessera,
    TesseraError,
    PyValueError,
    "A `tessera` command failed: the message is the CLI's (`error: ...`); `.error` is the error \
     object `--format json` prints (`kind`: usage, invalid, infeasible, internal or failed)."
);

/// `run_json` with a panic turned into an `internal` error.
fn run_caught(argv: Vec<String>, hooks: &Hooks) -> Result<serde_json::Value, ReportError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tessera_cli::run_json(argv, hooks)))
        .unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_string());
            let message = format!("internal error (a bug in tessera, please report it): {what}");
            let error = serde_json::json!({ "kind": "internal", "message": message });
            Err(ReportError { message, error })
        })
}

/// A JSON value as the Python object `json.loads` makes of it.
fn loads<'py>(py: Python<'py>, value: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (value.to_string(),))
}

/// The report, or the `TesseraError` carrying the CLI's message and error object.
fn into_py<'py>(
    py: Python<'py>,
    result: Result<serde_json::Value, ReportError>,
) -> PyResult<Bound<'py, PyAny>> {
    match result {
        Ok(doc) => loads(py, &doc),
        Err(e) => {
            let err = TesseraError::new_err(e.message);
            err.value(py).setattr("error", loads(py, &e.error)?)?;
            Err(err)
        }
    }
}

/// What `tessera ARGV... --format json` prints (`argv`: `["plan", "--model", "gpt2", ...]`),
/// as Python objects. Runs without the GIL.
#[pyfunction]
fn report<'py>(py: Python<'py>, argv: Vec<String>) -> PyResult<Bound<'py, PyAny>> {
    let result = py.detach(move || run_caught(argv, &Hooks::default()));
    into_py(py, result)
}

/// What the command's thread tells the caller.
enum Message {
    /// An event (`step`, `eval`, `token`) and its value.
    Event(String, serde_json::Value),
    /// The run asks what to do before this step; the answer goes back on the sender.
    Ask(u64, Sender<Request>),
    /// The command ended.
    Done(Result<serde_json::Value, ReportError>),
}

/// Events into the channel.
struct ToChannel(Mutex<Sender<Message>>);

impl Events for ToChannel {
    fn event(&self, kind: &str, value: serde_json::Value) {
        if let Ok(tx) = self.0.lock() {
            let _ = tx.send(Message::Event(kind.to_string(), value));
        }
    }
}

/// Steps asked of the caller through the channel.
struct AskChannel(Sender<Message>);

impl BatchSource for AskChannel {
    fn next(&mut self, step: u64) -> anyhow::Result<Request> {
        let (tx, rx) = channel();
        self.0
            .send(Message::Ask(step, tx))
            .map_err(|_| anyhow::anyhow!("the Python side of the run is gone"))?;
        // The caller gone (its Run dropped) ends the run as a stop would.
        Ok(rx.recv().unwrap_or(Request::Stop))
    }
}

/// A command running in its own thread (see the module doc). `wait()` returns the next of
/// `("event", kind, value)`, `("ask", step)` and `("done", report)`, or raises the command's
/// `TesseraError`; an `ask` is answered with `answer(...)` before waiting again.
#[pyclass(module = "tessera._native")]
struct Run {
    messages: Mutex<Receiver<Message>>,
    /// The sender of the question being answered.
    pending: Mutex<Option<Sender<Request>>>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    finished: AtomicBool,
}

#[pymethods]
impl Run {
    /// Starts `argv` (a command line after `tessera`). `steps`: the run asks the caller what
    /// each step does (`ask`); `caller_data`: only the caller's batches (no `--data` set).
    #[new]
    #[pyo3(signature = (argv, steps=false, caller_data=false))]
    fn new(argv: Vec<String>, steps: bool, caller_data: bool) -> PyResult<Run> {
        let (tx, rx) = channel();
        let stop = Arc::new(AtomicBool::new(false));
        let hooks = Hooks {
            steps: steps.then(|| {
                let source: Box<dyn BatchSource> = Box::new(AskChannel(tx.clone()));
                Arc::new(Mutex::new(source))
            }),
            caller_data: steps && caller_data,
            events: Some(Arc::new(ToChannel(Mutex::new(tx.clone())))),
            stop: Some(stop.clone()),
        };
        let thread = std::thread::Builder::new()
            .name("tessera".into())
            .spawn(move || {
                let result = run_caught(argv, &hooks);
                drop(hooks);
                let _ = tx.send(Message::Done(result));
            })
            .map_err(|e| PyRuntimeError::new_err(format!("starting the run's thread: {e}")))?;
        Ok(Run {
            messages: Mutex::new(rx),
            pending: Mutex::new(None),
            stop,
            thread: Mutex::new(Some(thread)),
            finished: AtomicBool::new(false),
        })
    }

    /// The next message (see the class doc); Python's signal handlers run while it waits.
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        if self.finished.load(Ordering::SeqCst) {
            return Err(PyRuntimeError::new_err("the run is over"));
        }
        if self.pending.lock().map(|p| p.is_some()).unwrap_or(false) {
            return Err(PyRuntimeError::new_err("answer the run's question (ask) first"));
        }
        let messages = &self.messages;
        let poisoned = || PyRuntimeError::new_err("the run's channel is poisoned");
        loop {
            let next = py.detach(|| {
                messages.lock().map(|rx| rx.recv_timeout(Duration::from_millis(50))).map_err(|_| ())
            });
            match next.map_err(|_| poisoned())? {
                Ok(Message::Event(kind, value)) => {
                    let value = loads(py, &value)?;
                    return Ok(PyTuple::new(
                        py,
                        [
                            "event".into_pyobject(py)?.into_any(),
                            kind.into_pyobject(py)?.into_any(),
                            value,
                        ],
                    )?
                    .into_any());
                }
                Ok(Message::Ask(step, reply)) => {
                    if let Ok(mut p) = self.pending.lock() {
                        *p = Some(reply);
                    }
                    return Ok(("ask", step).into_pyobject(py)?.into_any());
                }
                Ok(Message::Done(result)) => {
                    self.finished.store(true, Ordering::SeqCst);
                    if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
                        py.detach(|| t.join()).ok();
                    }
                    let report = into_py(py, result)?;
                    return Ok(("done", report).into_pyobject(py)?.into_any());
                }
                Err(RecvTimeoutError::Timeout) => py.check_signals()?,
                Err(RecvTimeoutError::Disconnected) => {
                    self.finished.store(true, Ordering::SeqCst);
                    return Err(PyRuntimeError::new_err("the run's thread ended without a word"));
                }
            }
        }
    }

    /// Answers the run's question: `"stop"`, `"save"`, `"data"` (the run's own data set's
    /// batch), `"evaluate"` (its held-out split), `("batch", fields)` or `("evaluate",
    /// [fields, ...])`, where `fields` is a list of `(name, kind, shape, bytes)`: `kind` `"i"`
    /// (little-endian int64) or `"f"` (little-endian float32), C order.
    fn answer(&self, answer: &Bound<'_, PyAny>) -> PyResult<()> {
        let request = if let Ok(word) = answer.extract::<String>() {
            match word.as_str() {
                "stop" => Request::Stop,
                "save" => Request::Save,
                "data" => Request::Data,
                "evaluate" => Request::EvaluateHeldOut,
                other => return Err(PyValueError::new_err(format!("unknown answer `{other}`"))),
            }
        } else {
            let (word, value): (String, Bound<'_, PyAny>) = answer.extract()?;
            match word.as_str() {
                "batch" => Request::Batch(batch(&value)?),
                "evaluate" => {
                    let list = value.cast::<PyList>()?;
                    Request::Evaluate(list.iter().map(|b| batch(&b)).collect::<PyResult<_>>()?)
                }
                other => return Err(PyValueError::new_err(format!("unknown answer `{other}`"))),
            }
        };
        let reply = self
            .pending
            .lock()
            .ok()
            .and_then(|mut p| p.take())
            .ok_or_else(|| PyRuntimeError::new_err("the run asked nothing"))?;
        // A run that ended meanwhile needs no answer.
        let _ = reply.send(request);
        Ok(())
    }

    /// Ends the run at the next step boundary (saving if `--save` was given).
    fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Whether the run has ended (its report, or its error, was returned by `wait`).
    #[getter]
    fn finished(&self) -> bool {
        self.finished.load(Ordering::SeqCst)
    }

    /// Whether a question is waiting for its answer.
    #[getter]
    fn asking(&self) -> bool {
        self.pending.lock().map(|p| p.is_some()).unwrap_or(false)
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        // Dropped mid-run: the run stops at its next step; its thread ends on its own.
        self.stop.store(true, Ordering::SeqCst);
        if let Ok(mut p) = self.pending.lock() {
            if let Some(reply) = p.take() {
                let _ = reply.send(Request::Stop);
            }
        }
    }
}

/// A batch from `[(name, kind, shape, bytes), ...]` (see [`Run::answer`]).
fn batch(fields: &Bound<'_, PyAny>) -> PyResult<StepBatch> {
    let mut out = Vec::new();
    for field in fields.try_iter()? {
        let (name, kind, shape, data): (String, String, Vec<usize>, Bound<'_, PyBytes>) =
            field?.extract()?;
        let bytes = data.as_bytes();
        let values = match kind.as_str() {
            "i" => Values::I64(
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                    .collect(),
            ),
            "f" => Values::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap_or([0; 4])))
                    .collect(),
            ),
            _ => {
                return Err(PyTypeError::new_err(format!(
                    "data: field `{name}`: its kind `{kind}` is neither integer nor float"
                )))
            }
        };
        out.push((name, shape, values));
    }
    tessera_cli::hooks::batch(out).map_err(|e| TesseraError::new_err(e.to_string()))
}

#[pymodule(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TesseraError", m.py().get_type::<TesseraError>())?;
    m.add_function(wrap_pyfunction!(report, m)?)?;
    m.add_class::<Run>()?;
    Ok(())
}
