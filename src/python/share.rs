//! Shared descriptions across the binding: a plain tuple each way, which the facade
//! (`extensible_kv.ipc`) turns into its picklable dataclasses.
//!
//! `(device, granularity, segment_capacities, segment_bytes, owner_pid, tensor_id,
//! registry_fd, handles)` with each handle `(first_granule, num_granules, serial, pid, fd,
//! fabric)`: `pid` and `fd` for an fd export, `fabric` (64 bytes) for a fabric one, the others
//! `None`. Every field is untrusted: a wrong type is a `TypeError` and a wrong value a
//! `ValueError`, each naming the field; the core checks how the fields fit together.

use std::os::fd::{IntoRawFd, OwnedFd};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyTuple};

use crate::driver::parse_device;
use crate::ipc;
use crate::plan::Run;
use crate::tensor::{SharedDescription, SharedExport, SharedHandle};

const FIELDS: [&str; 8] = [
    "device",
    "granularity",
    "segment_capacities",
    "segment_bytes",
    "owner_pid",
    "tensor_id",
    "registry_fd",
    "handles",
];
const HANDLE_FIELDS: [&str; 6] = [
    "first_granule",
    "num_granules",
    "serial",
    "pid",
    "fd",
    "fabric",
];

/// `obj` as a sequence of exactly `names.len()` items, else a `TypeError` about `what`.
fn items<'py>(
    obj: &Bound<'py, PyAny>,
    names: &[&str],
    what: &str,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let items: Option<Vec<Bound<'py, PyAny>>> = obj
        .try_iter()
        .ok()
        .and_then(|it| it.collect::<PyResult<_>>().ok());
    match items {
        Some(items)
            if items.len() == names.len() && !obj.is_instance_of::<pyo3::types::PyString>() =>
        {
            Ok(items)
        }
        _ => Err(PyTypeError::new_err(format!(
            "{what} must be a sequence of {} fields ({}), not {}",
            names.len(),
            names.join(", "),
            obj.get_type().name()?
        ))),
    }
}

/// `item` as a `T`: a `TypeError` naming `name` unless it is an int (or, for `ints`, a
/// sequence of them), a `ValueError` when its value does not fit.
fn field<'a, 'py, T: FromPyObject<'a, 'py>>(
    item: &'a Bound<'py, PyAny>,
    name: &str,
    kind: &str,
) -> PyResult<T> {
    item.extract::<T>().map_err(|_| {
        let is_int =
            item.is_instance_of::<PyInt>() && !item.is_instance_of::<pyo3::types::PyBool>();
        match is_int {
            true => PyValueError::new_err(format!(
                "invalid shared description: {name} = {item} is out of range for {kind}"
            )),
            false => PyTypeError::new_err(format!(
                "invalid shared description: {name} must be {kind}, not {}",
                item.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            )),
        }
    })
}

fn ints(item: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u64>> {
    let list = items_any(item, name)?;
    list.iter()
        .enumerate()
        .map(|(i, v)| field::<u64>(v, &format!("{name}[{i}]"), "an int ≥ 0"))
        .collect()
}

/// `item` as a list of any length, else a `TypeError` naming `name`.
fn items_any<'py>(item: &Bound<'py, PyAny>, name: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let list: Option<Vec<Bound<'py, PyAny>>> = match item.is_instance_of::<pyo3::types::PyString>()
    {
        true => None,
        false => item
            .try_iter()
            .ok()
            .and_then(|it| it.collect::<PyResult<_>>().ok()),
    };
    list.ok_or_else(|| {
        PyTypeError::new_err(format!(
            "invalid shared description: {name} must be a sequence, not {}",
            item.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })
}

fn handle(obj: &Bound<'_, PyAny>, i: usize) -> PyResult<SharedHandle> {
    let at = |f: &str| format!("handles[{i}].{f}");
    let h = items(obj, &HANDLE_FIELDS, &format!("handles[{i}]"))?;
    let first = field::<u64>(&h[0], &at("first_granule"), "an int ≥ 0")?;
    let num = field::<u64>(&h[1], &at("num_granules"), "an int ≥ 0")?;
    let serial = field::<u64>(&h[2], &at("serial"), "an int ≥ 0")?;
    let pid = field::<Option<u32>>(&h[3], &at("pid"), "a pid or None")?;
    let fd = field::<Option<i32>>(&h[4], &at("fd"), "an fd number or None")?;
    let fabric = field::<Option<Vec<u8>>>(&h[5], &at("fabric"), "bytes or None")?;
    let export = match (pid, fd, fabric) {
        (Some(pid), Some(fd), None) => SharedExport::Fd { pid, fd },
        (None, None, Some(bytes)) => {
            SharedExport::Fabric(bytes.try_into().map_err(|b: Vec<u8>| {
                PyValueError::new_err(format!(
                    "invalid shared description: {} holds {} bytes; a fabric handle is 64",
                    at("fabric"),
                    b.len()
                ))
            })?)
        }
        _ => {
            return Err(PyValueError::new_err(format!(
                "invalid shared description: handles[{i}] has either pid and fd, or fabric bytes"
            )))
        }
    };
    Ok(SharedHandle {
        run: Run::new(first, num),
        serial,
        export,
    })
}

pub fn to_description(obj: &Bound<'_, PyAny>) -> PyResult<SharedDescription> {
    let f = items(obj, &FIELDS, "a shared description")?;
    let device: String = field(&f[0], "device", "a device name")?;
    let handles = items_any(&f[7], "handles")?
        .iter()
        .enumerate()
        .map(|(i, h)| handle(h, i))
        .collect::<PyResult<_>>()?;
    Ok(SharedDescription {
        device: parse_device(&device).map_err(|e| {
            PyValueError::new_err(format!("invalid shared description: device: {e}"))
        })?,
        granularity: field(&f[1], "granularity", "an int ≥ 0")?,
        segment_capacities: ints(&f[2], "segment_capacities")?,
        segment_bytes: ints(&f[3], "segment_bytes")?,
        owner_pid: field(&f[4], "owner_pid", "a pid")?,
        tensor_id: field(&f[5], "tensor_id", "a 128-bit int")?,
        registry_fd: field(&f[6], "registry_fd", "an fd number or None")?,
        handles,
    })
}

pub fn from_description<'py>(
    py: Python<'py>,
    description: &SharedDescription,
) -> PyResult<Bound<'py, PyTuple>> {
    let handles = description
        .handles
        .iter()
        .map(|h| {
            let (pid, fd, fabric) = match &h.export {
                SharedExport::Fd { pid, fd } => (Some(*pid), Some(*fd), None),
                SharedExport::Fabric(bytes) => (None, None, Some(PyBytes::new(py, bytes))),
            };
            let run = h.run;
            (
                run.first_granule,
                run.num_granules,
                h.serial,
                pid,
                fd,
                fabric,
            )
        })
        .collect::<Vec<_>>();
    (
        description.device.torch_name(),
        description.granularity,
        PyTuple::new(py, &description.segment_capacities)?,
        PyTuple::new(py, &description.segment_bytes)?,
        description.owner_pid,
        description.tensor_id,
        description.registry_fd,
        handles,
    )
        .into_pyobject(py)
}

/// Duplicates of fds the caller holds (received over a Unix socket): each checked open, the
/// caller keeping and closing its own. A number that names nothing is a `ValueError`, and no
/// call can close a descriptor the process uses elsewhere.
pub fn to_fds(fds: Option<Vec<i32>>) -> PyResult<Option<Vec<OwnedFd>>> {
    fds.map(|fds| {
        fds.into_iter()
            .map(ipc::borrow_fd)
            .collect::<crate::Result<_>>()
    })
    .transpose()
    .map_err(Into::into)
}

/// The fds `description` names, taken from this (the owner) process and checked current:
/// the registry's, then one per fd handle. The caller owns (and closes) them.
pub fn owner_fds(description: &SharedDescription) -> PyResult<Vec<i32>> {
    Ok(description
        .owner_fds()?
        .into_iter()
        .map(IntoRawFd::into_raw_fd)
        .collect())
}
