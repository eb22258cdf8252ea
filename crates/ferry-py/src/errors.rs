//! ferry's errors as Python exceptions: one `ferry.FerryError` (a `RuntimeError`) carrying
//! ferry's message, which names the cause and the fix; and the guard every entry point runs
//! in, so that no Rust panic reaches Python as pyo3's `PanicException` (a `BaseException`
//! that `except Exception` does not catch).

use std::panic::{AssertUnwindSafe, catch_unwind};

use pyo3::PyErr;
use pyo3::PyResult;
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;

create_exception!(
    _ferry,
    FerryError,
    PyRuntimeError,
    "An error from ferry; the message names the cause and the fix."
);

/// A ferry error as a `FerryError`.
pub fn to_py(err: ferry::TensorError) -> PyErr {
    FerryError::new_err(err.to_string())
}

/// Runs an entry point's body; a panic in it (a broken invariant inside ferry: user input is
/// checked before it can cause one) becomes a `FerryError` that says so, instead of unwinding
/// into Python.
pub fn guarded<T>(body: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Err(FerryError::new_err(format!(
            "internal error in ferry ({what}); this is a bug, please report it with the call \
             that caused it"
        )))
    })
}
