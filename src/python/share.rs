//! Shared descriptions across the binding: a plain tuple each way, which the facade
//! (`extensible_kv.ipc`) turns into its picklable dataclasses.
//!
//! `(device, granularity, segment_capacities, segment_bytes, owner_pid, handles)` with each
//! handle `(first_granule, num_granules, serial, pid, fd, fabric)`: `pid` and `fd` for an fd
//! export, `fabric` (64 bytes) for a fabric one, the others `None`.

use std::os::fd::OwnedFd;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::driver::{ipc, parse_device};
use crate::plan::Run;
use crate::tensor::{SharedDescription, SharedExport, SharedHandle};

type HandleTuple = (u64, u64, u64, Option<u32>, Option<i32>, Option<Vec<u8>>);
type DescriptionTuple = (String, u64, Vec<u64>, Vec<u64>, u32, Vec<HandleTuple>);

pub fn to_description(obj: &Bound<'_, PyAny>) -> PyResult<SharedDescription> {
    let (device, granularity, segment_capacities, segment_bytes, owner_pid, handles): DescriptionTuple =
        obj.extract()?;
    let handles = handles
        .into_iter()
        .map(|(first, num, serial, pid, fd, fabric)| {
            let export = match (pid, fd, fabric) {
                (Some(pid), Some(fd), None) => SharedExport::Fd { pid, fd },
                (None, None, Some(bytes)) => SharedExport::Fabric(
                    bytes
                        .try_into()
                        .map_err(|_| PyValueError::new_err("a fabric handle is 64 bytes"))?,
                ),
                _ => {
                    return Err(PyValueError::new_err(
                        "a shared handle has either pid and fd, or fabric bytes",
                    ))
                }
            };
            Ok(SharedHandle {
                run: Run::new(first, num),
                serial,
                export,
            })
        })
        .collect::<PyResult<_>>()?;
    Ok(SharedDescription {
        device: parse_device(&device)?,
        granularity,
        segment_capacities,
        segment_bytes,
        owner_pid,
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
        handles,
    )
        .into_pyobject(py)
}

/// Fds the facade received (over a Unix socket) and hands over, one per fd handle.
#[allow(unsafe_code)]
pub fn to_fds(fds: Option<Vec<i32>>) -> Option<Vec<OwnedFd>> {
    fds.map(|fds| {
        fds.into_iter()
            // SAFETY: the facade passes the fds `recv_shared` received, which it gives up on
            // passing them (its documented contract): nothing else uses or closes them.
            .map(|raw| unsafe { ipc::adopt_fd(raw) })
            .collect()
    })
}
