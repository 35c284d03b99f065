//! `tessera._native`, the Python package's native module: `report(argv)` runs `tessera profile`
//! or `tessera plan` through the CLI's own code ([`tessera_cli::json_report`]: the same parsing,
//! defaults, validation and model resolution) and returns what `--format json` prints, as the
//! dict `json.loads` makes of it. A failure is a `tessera.TesseraError` (a `ValueError`) with the
//! CLI's message and, as `.error`, the error object `--format json` prints; a panic is caught
//! here and raised the same way, never unwound into Python. `python/tessera/__init__.py` turns
//! keyword arguments into the command line.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

create_exception!(
    tessera,
    TesseraError,
    PyValueError,
    "A `tessera` command failed: the message is the CLI's (`error: ...`); `.error` is the error \
     object `--format json` prints (`kind`: usage, invalid, infeasible, internal or failed)."
);

/// What `tessera ARGV... --format json` prints (`argv`: `["plan", "--model", "gpt2", ...]`),
/// as Python objects. Runs without the GIL.
#[pyfunction]
fn report<'py>(py: Python<'py>, argv: Vec<String>) -> PyResult<Bound<'py, PyAny>> {
    let result = py.detach(move || {
        std::panic::catch_unwind(move || tessera_cli::json_report(argv)).unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_string());
            let message = format!("internal error (a bug in tessera, please report it): {what}");
            let error = serde_json::json!({ "kind": "internal", "message": message });
            Err(tessera_cli::ReportError { message, error })
        })
    });
    let loads =
        |value: &serde_json::Value| py.import("json")?.call_method1("loads", (value.to_string(),));
    match result {
        Ok(doc) => loads(&doc),
        Err(e) => {
            let err = TesseraError::new_err(e.message);
            err.value(py).setattr("error", loads(&e.error)?)?;
            Err(err)
        }
    }
}

#[pymodule(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TesseraError", m.py().get_type::<TesseraError>())?;
    m.add_function(wrap_pyfunction!(report, m)?)?;
    Ok(())
}
