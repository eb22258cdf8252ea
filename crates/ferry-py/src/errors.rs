//! ferry's errors as Python exceptions: one `ferry.FerryError` (a `RuntimeError`) carrying
//! ferry's message, which names the cause and the fix.

use pyo3::PyErr;
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
