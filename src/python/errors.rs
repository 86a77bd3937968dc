//! The exception classes of `extensible_kv._native` and the one conversion from the crate's
//! `Error`: each variant becomes one class, subclassing the builtin a user would catch
//! (`ValueError`, `MemoryError`, `BufferError`), with the variant's numbers as attributes.

use pyo3::exceptions::{
    PyBaseException, PyBufferError, PyKeyboardInterrupt, PyRuntimeError, PyValueError,
};
use pyo3::prelude::*;

use crate::error::{Error, SizeOp};

// The module is the full import path: pickle finds a class by its `__module__`, and a serving
// stack's worker processes send these errors to the engine (the fields travel in `__dict__`).

pyo3::create_exception!(
    extensible_kv._native,
    OutOfMemoryError,
    pyo3::exceptions::PyMemoryError,
    "Physical memory could not be committed; the tensor is unchanged."
);
pyo3::create_exception!(
    extensible_kv._native,
    DriverError,
    PyRuntimeError,
    "The backend (CUDA driver or OS) failed; `code` holds its name for the failure."
);
pyo3::create_exception!(
    extensible_kv._native,
    UnsupportedError,
    PyRuntimeError,
    "The backend or device cannot do this (e.g. no CUDA VMM support)."
);
pyo3::create_exception!(
    extensible_kv._native,
    LoanTimeoutError,
    pyo3::exceptions::PyTimeoutError,
    "A loan was not given back in time; nothing was changed."
);
pyo3::create_exception!(
    extensible_kv._native,
    ClosedError,
    PyValueError,
    "The tensor was closed."
);
pyo3::create_exception!(
    extensible_kv._native,
    LoanConflictError,
    PyValueError,
    "Memory that is not this tensor's alone to pass on: a borrowed handle lent onward or \
     shared, or a handle share() described lent; nothing was changed."
);
pyo3::create_exception!(
    extensible_kv._native,
    PtraceRefusedError,
    pyo3::exceptions::PyPermissionError,
    "The kernel refused this process another one's fd (pidfd_getfd: EPERM or EACCES, where \
     it may not trace that process); nothing was mapped. Have the owner send the fds over a \
     Unix socket instead (send_shared, then recv_shared or recv_loan)."
);

/// The facade's method for `op`: a one-size call, or the per-segment one.
fn python_method(op: SizeOp, per_segment: bool) -> String {
    let suffix = if per_segment { "_per_segment_" } else { "_" };
    format!("{}{suffix}", op.name())
}

/// `err`'s message in the Python facade's words: its method names where the core's error names
/// an operation (the core words them in Rust's).
fn python_message(err: &Error) -> String {
    match *err {
        Error::NotOneSegment { op, num_segments } => format!(
            "{} is for one segment; this tensor has {num_segments}: use {}",
            python_method(op, false),
            python_method(op, true)
        ),
        Error::WrongDirection {
            op,
            segment,
            from_bytes,
            to_bytes,
        } => {
            let (change, other) = match op {
                SizeOp::Resize => ("shrink", SizeOp::Shrink),
                SizeOp::Shrink => ("grow", SizeOp::Resize),
            };
            format!(
                "{} cannot {change} segment {segment} from {from_bytes} to {to_bytes} bytes: use \
                 {}",
                python_method(op, true),
                python_method(other, true)
            )
        }
        _ => err.to_string(),
    }
}

impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        let message = python_message(&err);
        match err {
            Error::InvalidArgument(_)
            | Error::NotOneSegment { .. }
            | Error::WrongDirection { .. } => PyValueError::new_err(message),
            Error::OutOfMemory {
                op,
                requested_bytes,
                free_bytes,
                code,
            } => with_attrs(OutOfMemoryError::new_err(message), |e| {
                e.setattr("op", op.name())?;
                e.setattr("code", code)?;
                e.setattr("requested_bytes", requested_bytes)?;
                e.setattr("free_bytes", free_bytes)
            }),
            Error::Driver { op, code, .. } => with_attrs(DriverError::new_err(message), |e| {
                e.setattr("op", op.name())?;
                e.setattr("code", code)
            }),
            Error::Unsupported(_) => UnsupportedError::new_err(message),
            Error::Closed => ClosedError::new_err(message),
            Error::Timeout(_) => LoanTimeoutError::new_err(message),
            Error::ViewsAlive { .. } => PyBufferError::new_err(message),
            Error::LoanConflict(_) => LoanConflictError::new_err(message),
            Error::PtraceRefused {
                call,
                pid,
                ref code,
                ..
            } => {
                let errno = match code.as_str() {
                    "EACCES" => 13,
                    _ => 1, // EPERM
                };
                with_attrs(PtraceRefusedError::new_err(message), |e| {
                    // `errno` alone (no `strerror`), so that str() stays the message.
                    e.setattr("errno", errno)?;
                    e.setattr("call", call)?;
                    e.setattr("pid", pid)?;
                    e.setattr("code", code)
                })
            }
            // The bindings raise the signal's own exception in its place; this is the
            // fallback for a core caller that stopped a wait for reasons of its own.
            Error::Interrupted(_) => PyKeyboardInterrupt::new_err(message),
        }
    }
}

/// `err` with the attributes `set` gives it. Setting an attribute on a fresh exception cannot
/// fail in practice; if it did, the exception still has the right type and message.
fn with_attrs(err: PyErr, set: impl FnOnce(&Bound<'_, PyBaseException>) -> PyResult<()>) -> PyErr {
    Python::attach(|py| {
        let _ = set(err.value(py));
    });
    err
}

pub fn add_to(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    module.add("OutOfMemoryError", py.get_type::<OutOfMemoryError>())?;
    module.add("DriverError", py.get_type::<DriverError>())?;
    module.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    module.add("LoanTimeoutError", py.get_type::<LoanTimeoutError>())?;
    module.add("ClosedError", py.get_type::<ClosedError>())?;
    module.add("LoanConflictError", py.get_type::<LoanConflictError>())?;
    module.add("PtraceRefusedError", py.get_type::<PtraceRefusedError>())
}
