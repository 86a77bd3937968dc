//! Loans across the binding: a plain tuple each way, which the facade (`extensible_kv.ipc`)
//! turns into its picklable `Loan`.
//!
//! `(device, granularity, owner_pid, tensor_id, loan_id, epoch, board_fd, handles)` with each
//! handle `(first_granule, num_granules, serial, fd)`. Every field is untrusted: a wrong type
//! is a `TypeError` and a wrong value a `ValueError`, each naming the field; the core checks
//! how the fields fit together, then checks them against the lender's board.

use std::os::fd::IntoRawFd;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyTuple};

use crate::driver::parse_device;
use crate::plan::Run;
use crate::tensor::{LoanDescription, LoanHandle};

const FIELDS: [&str; 8] = [
    "device",
    "granularity",
    "owner_pid",
    "tensor_id",
    "loan_id",
    "epoch",
    "board_fd",
    "handles",
];

/// `obj` as a sequence of exactly `n` items (not a string), else a `TypeError` about `what`.
fn items<'py>(obj: &Bound<'py, PyAny>, n: usize, what: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let list: Option<Vec<Bound<'py, PyAny>>> = match obj.is_instance_of::<pyo3::types::PyString>() {
        true => None,
        false => obj
            .try_iter()
            .ok()
            .and_then(|it| it.collect::<PyResult<_>>().ok()),
    };
    match list {
        Some(list) if list.len() == n => Ok(list),
        _ => Err(PyTypeError::new_err(format!(
            "invalid loan: {what} must be a sequence of {n} fields, not {}",
            obj.get_type().name()?
        ))),
    }
}

/// `item` as a `T`, else a `ValueError` (an int out of range) or `TypeError` naming `name`.
fn field<'a, 'py, T: FromPyObject<'a, 'py>>(
    item: &'a Bound<'py, PyAny>,
    name: &str,
) -> PyResult<T> {
    item.extract::<T>().map_err(|_| {
        let is_int =
            item.is_instance_of::<PyInt>() && !item.is_instance_of::<pyo3::types::PyBool>();
        let type_name = item
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        match is_int {
            true => PyValueError::new_err(format!("invalid loan: {name} = {item} is out of range")),
            false => PyTypeError::new_err(format!(
                "invalid loan: {name} must be an int, not {type_name}"
            )),
        }
    })
}

pub fn to_loan(obj: &Bound<'_, PyAny>) -> PyResult<LoanDescription> {
    let f = items(
        obj,
        FIELDS.len(),
        &format!("a loan ({})", FIELDS.join(", ")),
    )?;
    let device: String = f[0]
        .extract()
        .map_err(|_| PyTypeError::new_err("invalid loan: device must be a device name"))?;
    let listed = match f[7].is_instance_of::<pyo3::types::PyString>() {
        true => None,
        false => f[7]
            .try_iter()
            .ok()
            .and_then(|it| it.collect::<PyResult<Vec<_>>>().ok()),
    };
    let listed =
        listed.ok_or_else(|| PyTypeError::new_err("invalid loan: handles must be a sequence"))?;
    let mut handles = Vec::with_capacity(listed.len());
    for (i, h) in listed.iter().enumerate() {
        let h = items(h, 4, &format!("handles[{i}]"))?;
        let at = |name: &str| format!("handles[{i}].{name}");
        handles.push(LoanHandle {
            run: Run::new(
                field(&h[0], &at("first_granule"))?,
                field(&h[1], &at("num_granules"))?,
            ),
            serial: field(&h[2], &at("serial"))?,
            fd: field(&h[3], &at("fd"))?,
        });
    }
    Ok(LoanDescription {
        device: parse_device(&device)
            .map_err(|e| PyValueError::new_err(format!("invalid loan: device: {e}")))?,
        granularity: field(&f[1], "granularity")?,
        owner_pid: field(&f[2], "owner_pid")?,
        tensor_id: field(&f[3], "tensor_id")?,
        loan_id: field(&f[4], "loan_id")?,
        epoch: field(&f[5], "epoch")?,
        board_fd: field(&f[6], "board_fd")?,
        handles,
    })
}

pub fn from_loan<'py>(py: Python<'py>, loan: &LoanDescription) -> PyResult<Bound<'py, PyTuple>> {
    let handles: Vec<(u64, u64, u64, i32)> = loan
        .handles
        .iter()
        .map(|h| (h.run.first_granule, h.run.num_granules, h.serial, h.fd))
        .collect();
    (
        loan.device.torch_name(),
        loan.granularity,
        loan.owner_pid,
        loan.tensor_id,
        loan.loan_id,
        loan.epoch,
        loan.board_fd,
        handles,
    )
        .into_pyobject(py)
}

/// The fds `loan` names, taken from this (the lender) process and checked current: the
/// board's, then one per handle. The caller owns (and closes) them.
pub fn owner_fds(loan: &LoanDescription) -> PyResult<Vec<i32>> {
    Ok(loan
        .owner_fds()?
        .into_iter()
        .map(IntoRawFd::into_raw_fd)
        .collect())
}
