//! The Python bindings (`extensible_kv._native`). No logic lives here: each method extracts
//! its arguments, releases the GIL around the core call, and converts the result or error
//! (`errors.rs`). The typed facade (`python/extensible_kv/tensor.py`) adds what needs torch,
//! such as the stream a grow zeroes on.

mod capsule;
mod errors;
mod loan;
mod share;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyBufferError, PyKeyboardInterrupt, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple, PyType};

use crate::dlpack::StridedLayout;
use crate::driver::wrap::faulty::{Fault, FaultKind};
use crate::driver::wrap::profile::ProfilingDriver;
use crate::driver::{self, DeviceKind, ExportTypes, OpenOptions, Stream};
use crate::error::Op;
use crate::tensor::{
    ExtensibleTensor, GrowOptions, HandleSizing, Options, PlacedHandle, Segments, ShrinkOptions,
};

/// The int that `obj` stands for: an int or anything `operator.index` takes (numpy and torch
/// integer scalars), never a bool or a float; `None` for anything else.
fn as_int<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyInt>>> {
    if obj.is_instance_of::<PyBool>() {
        return Ok(None);
    }
    if let Ok(int) = obj.cast::<PyInt>() {
        return Ok(Some(int.clone()));
    }
    if !obj.hasattr("__index__")? {
        return Ok(None);
    }
    static INDEX: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let py = obj.py();
    let index = INDEX.import(py, "operator", "index")?;
    match index.call1((obj,)) {
        Ok(int) => Ok(int.cast_into::<PyInt>().ok()),
        // numpy's bools and arrays of more than one item have `__index__` but refuse it.
        Err(err) if err.is_instance_of::<PyTypeError>(py) => Ok(None),
        Err(err) => Err(err),
    }
}

/// A TypeError naming the argument `what`, what it must be (`expected`), and the type it got.
fn wrong_type(obj: &Bound<'_, PyAny>, what: &str, expected: &str) -> PyErr {
    let type_name = obj
        .get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string());
    PyTypeError::new_err(format!("{what} must be {expected}, not {type_name}"))
}

/// A size from an int or anything with `__index__` (numpy and torch integer scalars): TypeError
/// for other types (bools and floats included), ValueError (not OverflowError) for negative or
/// oversized values. Each message names the argument.
fn to_u64(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    let int = as_int(obj)?.ok_or_else(|| wrong_type(obj, what, "an int"))?;
    int.extract::<u64>().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a non-negative int below 2**64, got {int}"
        ))
    })
}

/// A flag: a bool (numpy's too), never an int or None, which are likely a misplaced argument.
fn to_flag(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<bool> {
    obj.extract::<bool>()
        .map_err(|_| wrong_type(obj, what, "a bool"))
}

// `from_py_with` converters, one per flag name: PyO3 puts an argument's name in a note, not
// in the message, and the message must name it.
fn zero_new_flag(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    to_flag(obj, "zero_new")
}
fn zero_flag(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    to_flag(obj, "zero")
}
fn exact_flag(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    to_flag(obj, "exact")
}
fn one_handle_per_run_flag(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    to_flag(obj, "one_handle_per_run")
}

fn to_u64_opt(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<u64>> {
    obj.filter(|o| !o.is_none())
        .map(|o| to_u64(o, what))
        .transpose()
}

/// The device a Python caller names, as the core parses it: a str or a `torch.device` (its
/// `str()`), or a CUDA index as torch takes one for `cuda:N` (an int or `__index__` integer,
/// at least 0). A bool is a TypeError; a negative index a ValueError.
fn to_device(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    if obj.is_instance_of::<PyBool>() {
        return Err(wrong_type(
            obj,
            "device",
            "a str, a torch.device or a CUDA index",
        ));
    }
    match as_int(obj)? {
        Some(index) => match index.extract::<u32>() {
            Ok(index) => Ok(format!("cuda:{index}")),
            Err(_) => Err(PyValueError::new_err(format!(
                "device: a CUDA index must be an int from 0 to 2**32-1, got {index}"
            ))),
        },
        None => Ok(obj.str()?.to_string()), // accepts str and torch.device alike
    }
}

/// `to_device`, with `None` naming the host backend.
fn to_device_or_cpu(obj: Option<&Bound<'_, PyAny>>) -> PyResult<String> {
    match obj.filter(|d| !d.is_none()) {
        Some(device) => to_device(device),
        None => Ok("cpu".to_string()),
    }
}

/// How to open the backend: the granularity asked, and the test hooks (`_fault`, `_profile`).
fn open_options(
    granularity: Option<u64>,
    fault: Option<&Bound<'_, PyAny>>,
    profile: bool,
) -> PyResult<OpenOptions> {
    Ok(OpenOptions {
        granularity,
        fault: fault.filter(|f| !f.is_none()).map(to_fault).transpose()?,
        profile,
    })
}

fn to_fault(obj: &Bound<'_, PyAny>) -> PyResult<Fault> {
    let (op, nth, kind): (String, u64, String) = obj.extract()?;
    let op = Op::from_name(&op)
        .ok_or_else(|| PyValueError::new_err(format!("unknown driver operation {op:?}")))?;
    let kind = FaultKind::from_name(&kind)
        .ok_or_else(|| PyValueError::new_err("fault kind must be 'driver' or 'oom'"))?;
    Ok(Fault { op, nth, kind })
}

/// The names of `HandleSizing`'s kinds, as Python spells them (`_native.HANDLE_SIZING_KINDS`,
/// which the facade and the vLLM drop-in read); the first is the default.
const HANDLE_SIZING_KINDS: [&str; 4] = [
    "cap_aligned",
    "aligned_powers_of_two",
    "per_run",
    "whole_runs",
];

/// The handle sizing a Python caller names: `(kind, max_bytes)`, as the facade's
/// `HandleSizing` hands it over; `None` is the default. Each wrong part is named.
fn to_handle_sizing(obj: Option<&Bound<'_, PyAny>>) -> PyResult<HandleSizing> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(HandleSizing::default());
    };
    let (kind, max_bytes): (Bound<'_, PyAny>, Bound<'_, PyAny>) = obj.extract().map_err(|_| {
        PyTypeError::new_err("handle_sizing must be a HandleSizing (kind, max_bytes)")
    })?;
    let kind: String = kind
        .extract()
        .map_err(|_| wrong_type(&kind, "handle_sizing.kind", "a str"))?;
    // None stays None: the default cap, which alone rises to a larger granularity.
    let max_bytes = to_u64_opt(Some(&max_bytes), "handle_sizing.max_bytes")?;
    let sizing = match (kind.as_str(), max_bytes) {
        ("whole_runs", Some(_)) => return Err(PyValueError::new_err(
            "handle_sizing: whole_runs takes no max_bytes (its handles are as long as the runs)",
        )),
        ("cap_aligned", _) => HandleSizing::CapAligned { max_bytes },
        ("aligned_powers_of_two", _) => HandleSizing::AlignedPowersOfTwo { max_bytes },
        ("per_run", _) => HandleSizing::PerRun { max_bytes },
        ("whole_runs", None) => HandleSizing::WholeRuns,
        (other, _) => {
            let known = HANDLE_SIZING_KINDS.map(|k| format!("'{k}'")).join(", ");
            return Err(PyValueError::new_err(format!(
                "handle_sizing.kind must be one of {known}, not {other:?}"
            )));
        }
    };
    Ok(sizing)
}

/// The stream a Python caller names (an int, as `torch.cuda.Stream.cuda_stream` gives it);
/// none is the default stream.
#[allow(unsafe_code)]
fn to_stream(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Stream> {
    Ok(match to_u64_opt(obj, "stream")? {
        None => Stream::DEFAULT,
        // SAFETY: the caller vouches for the stream, as `torch.cuda.ExternalStream` makes its
        // caller vouch for the pointer it wraps: it must be 0 or a live CUstream of the
        // tensor's device (its primary context), and stay live until this call returns. Nothing
        // here can check that; the docstrings and the stub say so. The facade passes torch's
        // current stream on the tensor's device, which torch keeps live while this call runs.
        Some(raw) => unsafe { Stream::from_raw(raw) },
    })
}

/// What names the current stream of a CUDA device, `provider(index) -> int`: the facade
/// registers torch's once (`_set_stream_provider`), so that a call given no stream runs on the
/// caller's current stream, as torch's own operations do. Without one (the native module
/// alone), such a call runs on the default stream.
static STREAM_PROVIDER: Mutex<Option<Py<PyAny>>> = Mutex::new(None);

/// Registers `provider` (see `STREAM_PROVIDER`); `None` unregisters it.
#[pyfunction]
#[pyo3(signature = (provider))]
fn _set_stream_provider(provider: Option<Py<PyAny>>) {
    *STREAM_PROVIDER
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = provider;
}

/// A tensor `_import` built, on its way into `#[new]`: PyO3 makes an instance of a subclass
/// (the facade's) only there, so the import hands its result over as the constructor's
/// `max_bytes` instead of a size. Never exported: only `_import` makes one.
#[pyclass(module = "extensible_kv._native", frozen)]
struct Imported(Mutex<Option<PyExtensibleTensor>>);

/// One reservation of address space, split into segments that grow in lockstep.
#[pyclass(
    name = "ExtensibleTensor",
    module = "extensible_kv._native",
    subclass,
    frozen
)]
pub struct PyExtensibleTensor {
    core: ExtensibleTensor,
    /// Per-operation call counts and host time, when built with `_profile=True`.
    profile: Option<Arc<ProfilingDriver>>,
}

/// How long a native wait goes without checking for signals (Ctrl-C): the GIL is taken once
/// per slice, so a wait of hours costs nothing and still ends within this of a signal.
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// A timeout in seconds (negative: none left), `None` for ever. NaN is refused: `max` would
/// make it 0, and a reclaim told to wait a NaN would take back at once a loan never borrowed.
fn to_timeout(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    if timeout.is_some_and(f64::is_nan) {
        return Err(PyValueError::new_err(
            "timeout must be a number of seconds or None, not NaN",
        ));
    }
    timeout
        .map(|s| Duration::try_from_secs_f64(s.max(0.0)))
        .transpose()
        .map_err(|e| PyValueError::new_err(format!("timeout: {e}")))
}

/// Takes the GIL and runs the signal handlers: whether one raised, its exception kept in
/// `raised` (the handler has run: the exception is the caller's to raise, never dropped).
fn check_signals(raised: &mut Option<PyErr>) -> bool {
    match Python::attach(|py| py.check_signals()) {
        Ok(()) => false,
        Err(err) => {
            raised.get_or_insert(err);
            true
        }
    }
}

/// The exception to raise for a signal `signal` whose handler raised after the call's work
/// was done (`done` says what holds): a KeyboardInterrupt saying so in place of the bare one,
/// so that the caller does not take a completed call for a failed one; any other exception
/// is raised as it is, with `done` as a note.
fn interrupted_after(py: Python<'_>, signal: PyErr, done: &str) -> PyErr {
    if signal.is_instance_of::<PyKeyboardInterrupt>(py) {
        return PyKeyboardInterrupt::new_err(format!("interrupted after {done}"));
    }
    let _ = signal
        .value(py)
        .call_method1("add_note", (format!("interrupted after {done}"),));
    signal
}

impl PyExtensibleTensor {
    /// Waits (without the GIL, in slices that check for signals) until every pending release
    /// has happened, or for `timeout`: whether none is pending. A signal raises its exception,
    /// nothing changed.
    fn wait_released_or_signal(&self, py: Python<'_>, timeout: Option<Duration>) -> PyResult<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let slice = left.map_or(SIGNAL_SLICE, |left| left.min(SIGNAL_SLICE));
            if self.run(py, |core| Ok(core.wait_released(Some(slice))))? {
                return Ok(true);
            }
            if left.is_some_and(|left| left <= slice) {
                return Ok(false);
            }
            py.check_signals()?;
        }
    }

    /// Runs `op` on the core without the GIL (it may wait for the tensor's lock and for the
    /// driver), then logs, as warnings, the errors destructors deferred meanwhile (each once;
    /// `take_deferred_errors` still returns them).
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        op: impl FnOnce(&ExtensibleTensor) -> crate::Result<T> + Send,
    ) -> PyResult<T> {
        let result = py.detach(|| op(&self.core));
        for message in self.core.take_unwarned() {
            let logger = py
                .import("logging")?
                .call_method1("getLogger", ("extensible_kv",))?;
            logger.call_method1(
                "warning",
                (
                    "a driver call failed in a destructor (see take_deferred_errors()): %s",
                    message,
                ),
            )?;
        }
        Ok(result?)
    }

    /// The stream a call runs on: `stream` when given; else, for a call that uses one
    /// (`used`) on a GPU, the registered provider's current stream of the tensor's device
    /// (`STREAM_PROVIDER`); else the default stream.
    fn stream_or_current(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        used: bool,
    ) -> PyResult<Stream> {
        let given = stream.filter(|s| !s.is_none());
        let index = match self.core.device() {
            DeviceKind::Cuda(index) if given.is_none() && used => index,
            _ => return to_stream(given),
        };
        let provider = STREAM_PROVIDER
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|p| p.clone_ref(py));
        match provider {
            Some(provider) => to_stream(Some(&provider.bind(py).call1((index,))?)),
            None => Ok(Stream::DEFAULT),
        }
    }

    /// One size per segment from `bytes`: an int (or `__index__` integer) for every segment, or
    /// a sequence of one per segment. Strings and bytes are refused, not read as sequences.
    fn segment_targets(&self, bytes: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let what = "bytes_per_segment";
        let n = self.core.num_segments();
        if as_int(bytes)?.is_some() {
            return Ok(vec![to_u64(bytes, what)?; n]);
        }
        let is_text = bytes.is_instance_of::<PyString>() || bytes.is_instance_of::<PyBytes>();
        let items = match bytes.try_iter() {
            Ok(items) if !is_text => items.collect::<PyResult<Vec<_>>>()?,
            _ => {
                let type_name = bytes.get_type().name()?;
                return Err(PyTypeError::new_err(format!(
                    "{what} must be an int or a sequence of {n} ints, not {type_name}"
                )));
            }
        };
        if items.len() != n {
            return Err(PyValueError::new_err(format!(
                "{what}: expected an int or {n} per-segment sizes, got {}",
                items.len()
            )));
        }
        items.iter().map(|b| to_u64(b, what)).collect()
    }
}

#[pymethods]
impl PyExtensibleTensor {
    #[new]
    #[pyo3(signature = (
        max_bytes, num_segments=None, device=None, *, segment_capacities=None, granularity=None,
        handle_sizing=None, export_handle_types=0, _fault=None, _profile=false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        max_bytes: &Bound<'_, PyAny>,
        num_segments: Option<&Bound<'_, PyAny>>,
        device: Option<&Bound<'_, PyAny>>,
        segment_capacities: Option<&Bound<'_, PyAny>>,
        granularity: Option<&Bound<'_, PyAny>>,
        handle_sizing: Option<&Bound<'_, PyAny>>,
        export_handle_types: u32,
        _fault: Option<&Bound<'_, PyAny>>,
        _profile: bool,
    ) -> PyResult<Self> {
        if let Ok(imported) = max_bytes.cast::<Imported>() {
            let taken = imported
                .get()
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            return taken.ok_or_else(|| PyValueError::new_err("this import was taken already"));
        }
        let max_bytes = to_u64(max_bytes, "max_bytes")?;
        let num_segments = to_u64_opt(num_segments, "num_segments")?;
        let device = to_device_or_cpu(device)?;
        let options = Options {
            granularity: to_u64_opt(granularity, "granularity")?,
            handle_sizing: to_handle_sizing(handle_sizing)?,
            export_types: ExportTypes::from_bits(export_handle_types)?,
        };
        let capacities = match segment_capacities.filter(|c| !c.is_none()) {
            Some(caps) => Some(
                caps.try_iter()?
                    .map(|c| to_u64(&c?, "segment_capacities[i]"))
                    .collect::<PyResult<Vec<u64>>>()?,
            ),
            None => None,
        };
        let open_options = open_options(options.granularity, _fault, _profile)?;
        let build = || -> crate::Result<PyExtensibleTensor> {
            let opened = driver::open_with(&device, open_options)?;
            let segments = Segments::stated(max_bytes, num_segments, capacities)?;
            let core = ExtensibleTensor::new(opened.driver, segments, options)?;
            Ok(PyExtensibleTensor {
                core,
                profile: opened.profile,
            })
        };
        Ok(py.detach(build)?)
    }

    /// The memory a shared description names, mapped in this process at the same offsets of a
    /// reservation of its own on `device` (`extensible_kv.ipc`; fds: received, handed over).
    /// An instance of `cls`, as the constructor makes.
    #[classmethod]
    #[pyo3(signature = (description, device, *, granularity=None, fds=None, _fault=None))]
    fn _import<'py>(
        cls: &Bound<'py, PyType>,
        description: &Bound<'_, PyAny>,
        device: &Bound<'_, PyAny>,
        granularity: Option<&Bound<'_, PyAny>>,
        fds: Option<Vec<i32>>,
        _fault: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = cls.py();
        let description = share::to_description(description)?;
        let device = to_device(device)?;
        let open_options = open_options(to_u64_opt(granularity, "granularity")?, _fault, false)?;
        let fds = share::to_fds(fds)?;
        let build = || -> crate::Result<PyExtensibleTensor> {
            let opened = driver::open_with(&device, open_options)?;
            let core = ExtensibleTensor::import(opened.driver, &description, fds)?;
            Ok(PyExtensibleTensor {
                core,
                profile: opened.profile,
            })
        };
        let imported = Imported(Mutex::new(Some(py.detach(build)?)));
        // The native `__new__`, not `cls(...)`: a subclass's own `__new__` takes sizes.
        py.get_type::<PyExtensibleTensor>()
            .getattr("__new__")?
            .call1((cls, Bound::new(py, imported)?))
    }

    /// Grows every segment to `bytes_per_segment` (an int, or one size per segment), all or
    /// nothing. With `zero_new`, zeroes exactly the new bytes; on a GPU that is ordered on
    /// `stream`, a raw CUDA stream of the tensor's device (e.g. `torch.cuda.Stream.cuda_stream`,
    /// 0 the legacy default stream), by default the current stream (torch's, with the facade).
    /// `one_handle_per_run` overrides `handle_sizing` for this grow: one allocation per run of
    /// new granules (for RDMA registration, which cannot span allocations: vLLM's one chunk per
    /// segment). A `stream` given is vouched for by the caller (see the class), as for
    /// `torch.cuda.ExternalStream`.
    #[pyo3(signature = (bytes_per_segment, zero_new=true, stream=None, *, one_handle_per_run=false))]
    fn resize_per_segment_(
        slf: &Bound<'_, Self>,
        bytes_per_segment: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = zero_new_flag)] zero_new: bool,
        stream: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = one_handle_per_run_flag)] one_handle_per_run: bool,
    ) -> PyResult<Py<Self>> {
        let this = slf.get();
        let targets = this.segment_targets(bytes_per_segment)?;
        if this.core.is_noop_resize(&targets) {
            return Ok(slf.clone().unbind()); // the fast path: no stream lookup, no GIL release
        }
        let options = GrowOptions {
            zero_new,
            stream: this.stream_or_current(slf.py(), stream, zero_new)?,
            one_handle_per_run,
        };
        this.run(slf.py(), |core| core.resize_per_segment(&targets, options))?;
        Ok(slf.clone().unbind())
    }

    /// `resize_per_segment_` for a one-segment tensor.
    #[pyo3(signature = (num_bytes, zero_new=true, stream=None))]
    fn resize_(
        slf: &Bound<'_, Self>,
        num_bytes: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = zero_new_flag)] zero_new: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<Self>> {
        let this = slf.get();
        let num_bytes = to_u64(num_bytes, "num_bytes")?;
        if this.core.is_noop_resize(&[num_bytes]) {
            return Ok(slf.clone().unbind());
        }
        let options = GrowOptions {
            zero_new,
            stream: this.stream_or_current(slf.py(), stream, zero_new)?,
            one_handle_per_run: false,
        };
        this.run(slf.py(), |core| core.resize(num_bytes, options))?;
        Ok(slf.clone().unbind())
    }

    /// Whether `resize_per_segment_(bytes_per_segment)` would do nothing and succeed; false
    /// for anything it would refuse.
    fn _is_noop_resize(&self, bytes_per_segment: &Bound<'_, PyAny>) -> bool {
        self.segment_targets(bytes_per_segment)
            .is_ok_and(|targets| self.core.is_noop_resize(&targets))
    }

    /// Shrinks every segment to `bytes_per_segment` (an int, or one size per segment),
    /// keeping the bytes below, all or nothing. Handles no committed byte needs any more are
    /// released once the work queued on `stream` so far has run (by default the current
    /// stream, torch's with the facade; one given is vouched for by the caller, as for
    /// `torch.cuda.ExternalStream`): the call records an event and returns without waiting for
    /// the device, and a thread of the tensor's releases them after the event
    /// (`pending_release_bytes` until then; `wait_released()` waits). `exact` also replaces the
    /// handles that straddle the new frontier by handles of their live granules (copied on
    /// `stream`, after which the call waits for that stream alone), so `physical_bytes` is the
    /// granule-rounded footprint.
    ///
    /// An `exact` shrink copies the live bytes, then swaps the copy in at the same addresses:
    /// a write to the tensor issued while it runs (from another thread, on any stream) may be
    /// lost, and an access during the swap may fault. Work ordered before the call is kept.
    #[pyo3(signature = (bytes_per_segment, *, exact=false, stream=None))]
    fn shrink_per_segment_(
        slf: &Bound<'_, Self>,
        bytes_per_segment: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = exact_flag)] exact: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<Self>> {
        let this = slf.get();
        let targets = this.segment_targets(bytes_per_segment)?;
        let options = ShrinkOptions {
            exact,
            stream: this.stream_or_current(slf.py(), stream, true)?,
        };
        this.run(slf.py(), |core| core.shrink_per_segment(&targets, options))?;
        Ok(slf.clone().unbind())
    }

    /// `shrink_per_segment_` for a one-segment tensor.
    #[pyo3(signature = (num_bytes, *, exact=false, stream=None))]
    fn shrink_(
        slf: &Bound<'_, Self>,
        num_bytes: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = exact_flag)] exact: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<Self>> {
        let this = slf.get();
        let num_bytes = to_u64(num_bytes, "num_bytes")?;
        let options = ShrinkOptions {
            exact,
            stream: this.stream_or_current(slf.py(), stream, true)?,
        };
        this.run(slf.py(), |core| core.shrink(num_bytes, options))?;
        Ok(slf.clone().unbind())
    }

    /// Backs every run of committed granules (each segment's prefix, where segments share no
    /// granule) by one handle, keeping every byte and address: views and CUDA graphs stay
    /// valid; RDMA registrations of the old pages must be renewed. Runs go largest first,
    /// `OutOfMemoryError` on the first leaves the tensor as it was; extra memory is the
    /// largest new handle, or also the next run's (whose copy then overlaps this run's swap)
    /// when that fits in half the free memory. Copies run on `stream` (by default the current
    /// stream, torch's with the facade; one given is vouched for by the caller, as for
    /// `torch.cuda.ExternalStream`).
    ///
    /// Each run is all or nothing, not the whole call: one that fails past the first run keeps
    /// every committed byte, segment size and address, but the runs done before it stay
    /// consolidated and the others in their old handles; calling again finishes. A write to
    /// the tensor issued while it runs (from another thread, on any stream) may be lost, since
    /// the new handles hold the bytes as copied, and an access during the swap may fault. Work
    /// ordered before the call is kept.
    #[pyo3(signature = (*, stream=None))]
    fn consolidate(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let stream = self.stream_or_current(py, stream, true)?;
        self.run(py, |core| core.consolidate(stream))
    }

    /// The description of this tensor's memory for other processes (`extensible_kv.ipc`).
    fn _share<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let description = py.detach(|| self.core.share())?;
        share::from_description(py, &description)
    }

    /// Follows the owner of imported memory to `description` (fds: received, handed over).
    #[pyo3(signature = (description, fds=None))]
    fn _refresh(
        &self,
        py: Python<'_>,
        description: &Bound<'_, PyAny>,
        fds: Option<Vec<i32>>,
    ) -> PyResult<()> {
        let description = share::to_description(description)?;
        let fds = share::to_fds(fds)?;
        self.run(py, |core| core.refresh(&description, fds))
    }

    /// Lends the whole handles past `bytes_per_segment` (`extensible_kv.ipc.Loan`).
    #[pyo3(signature = (bytes_per_segment, stream=None))]
    fn _lend<'py>(
        &self,
        py: Python<'py>,
        bytes_per_segment: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let bytes = self.segment_targets(bytes_per_segment)?;
        let stream = self.stream_or_current(py, stream, true)?;
        let description = self.run(py, |core| core.lend(&bytes[..], stream))?;
        loan::from_loan(py, &description)
    }

    /// Maps a loan's handles at the ends of the segments (fds: received, handed over).
    #[pyo3(signature = (loan, fds=None, zero=true, stream=None))]
    fn _borrow(
        &self,
        py: Python<'_>,
        loan: &Bound<'_, PyAny>,
        fds: Option<Vec<i32>>,
        #[pyo3(from_py_with = zero_flag)] zero: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (loan, stream) = (
            loan::to_loan(loan)?,
            self.stream_or_current(py, stream, zero)?,
        );
        let fds = share::to_fds(fds)?;
        // A borrow waits, under the tensor's lock, for what shrinks gave back to be released
        // (its place may be there): waited for here first, in slices that check for signals,
        // so that Ctrl-C ends a wait that would not end (a stream that never gets there).
        self.wait_released_or_signal(py, None)?;
        self.run(py, |core| core.borrow(&loan, fds, zero, stream))
    }

    /// Maps handles of `loans` where the caller's dealing placed them
    /// (`(loan, handle, segment)` each, in order) and commits `segment_bytes`
    /// (`ExtensibleTensor::borrow_placed`); `fds[k]`: received fds of loan k, or None.
    #[pyo3(signature = (loans, fds, placed, segment_bytes, zero=true, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn _borrow_placed(
        &self,
        py: Python<'_>,
        loans: Vec<Bound<'_, PyAny>>,
        fds: Vec<Option<Vec<i32>>>,
        placed: Vec<(usize, usize, usize)>,
        segment_bytes: Vec<u64>,
        #[pyo3(from_py_with = zero_flag)] zero: bool,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let loans = loans
            .iter()
            .map(loan::to_loan)
            .collect::<PyResult<Vec<_>>>()?;
        let fds = fds
            .into_iter()
            .map(share::to_fds)
            .collect::<PyResult<Vec<_>>>()?;
        let placed: Vec<PlacedHandle> = placed
            .into_iter()
            .map(|(loan, handle, segment)| PlacedHandle {
                loan,
                handle,
                segment,
            })
            .collect();
        let stream = self.stream_or_current(py, stream, zero)?;
        // As `_borrow`: what shrinks gave back is released first, Ctrl-C ending the wait.
        self.wait_released_or_signal(py, None)?;
        self.run(py, |core| {
            core.borrow_placed(&loans, fds, &placed, &segment_bytes, zero, stream)
        })
    }

    /// Per segment `(start_granule, slack_bytes, room_granules, limit_bytes)`: where a
    /// placed borrow may go now (`ExtensibleTensor::borrow_room`), once what shrinks gave back
    /// is released (Ctrl-C ends that wait).
    fn _borrow_room(&self, py: Python<'_>) -> PyResult<Vec<(u64, i64, u64, u64)>> {
        self.wait_released_or_signal(py, None)?;
        let rooms = self.run(py, |core| core.borrow_room())?;
        Ok(rooms
            .iter()
            .map(|r| {
                (
                    r.start_granule,
                    r.slack_bytes,
                    r.room_granules,
                    r.limit_bytes,
                )
            })
            .collect())
    }

    /// The granule runs `(first_granule, num_granules)` a `lend(bytes_per_segment)` would
    /// lend now, with its checks; nothing changes.
    fn _lend_runs(
        &self,
        py: Python<'_>,
        bytes_per_segment: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(u64, u64)>> {
        let bytes = self.segment_targets(bytes_per_segment)?;
        let runs = self.run(py, |core| core.lend_runs(&bytes[..]))?;
        Ok(runs
            .iter()
            .map(|r| (r.first_granule, r.num_granules))
            .collect())
    }

    /// Gives back the handles of any of `loans` this tensor maps: their bytes (0: none).
    #[pyo3(signature = (loans, stream=None))]
    fn _give_back_loans(
        &self,
        py: Python<'_>,
        loans: Vec<Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let loans = loans
            .iter()
            .map(loan::to_loan)
            .collect::<PyResult<Vec<_>>>()?;
        let stream = self.stream_or_current(py, stream, true)?;
        self.run(py, |core| core.give_back_loans(&loans, stream))
    }

    /// Gives a borrowed loan's handles back to their lender.
    #[pyo3(signature = (loan, stream=None))]
    fn _give_back(
        &self,
        py: Python<'_>,
        loan: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (loan, stream) = (
            loan::to_loan(loan)?,
            self.stream_or_current(py, stream, true)?,
        );
        self.run(py, |core| core.give_back(&loan, stream))
    }

    /// Takes a loan back once given back (or its borrower died), waiting up to `timeout` s;
    /// a signal (Ctrl-C) ends the wait: raised as it is when nothing changed, or as a
    /// KeyboardInterrupt saying the reclaim completed.
    #[pyo3(signature = (loan, zero=true, timeout=None, stream=None))]
    fn _reclaim(
        &self,
        py: Python<'_>,
        loan: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = zero_flag)] zero: bool,
        timeout: Option<f64>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (loan, stream) = (
            loan::to_loan(loan)?,
            self.stream_or_current(py, stream, zero)?,
        );
        let timeout = to_timeout(timeout)?;
        // The wait may last as long as the borrower keeps the loan: every 50 ms or so it takes
        // the GIL to check for signals. A signal's exception (the handler has run) stops the
        // wait: raised as it is when nothing changed, or saying that the reclaim completed.
        let mut raised: Option<PyErr> = None;
        let result = self.run(py, |core| {
            let mut stop = || check_signals(&mut raised);
            Ok(core.reclaim_or_stop(&loan, zero, timeout, stream, &mut stop))
        })?;
        match (result, raised) {
            (Ok(()), None) => Ok(()),
            (Ok(()), Some(signal)) => Err(interrupted_after(
                py,
                signal,
                &format!("the reclaim completed: loan {} is back", loan.loan_id),
            )),
            (Err(crate::Error::Interrupted(_)), Some(signal)) => Err(signal), // nothing changed
            (Err(err), Some(signal)) => {
                // Failed on its own as the signal came (all or nothing: nothing changed).
                let note = format!("the reclaim failed meanwhile: {err}");
                let _ = signal.value(py).call_method1("add_note", (note,));
                Err(signal)
            }
            (Err(err), None) => Err(err.into()),
        }
    }

    /// Bytes lent out and not reclaimed yet.
    #[getter]
    fn lent_bytes(&self) -> u64 {
        self.core.lent_bytes()
    }

    /// Bytes of borrowed handles this tensor maps (part of `physical_bytes`).
    #[getter]
    fn borrowed_bytes(&self) -> u64 {
        self.core.borrowed_bytes()
    }

    /// The export handle types new handles are created with (CUDA's bits).
    #[getter]
    fn export_handle_types(&self) -> u32 {
        self.core.export_types().bits()
    }

    /// The pid of the process that owns this memory, for a tensor made by `from_shared`.
    #[getter]
    fn imported_from(&self) -> Option<u32> {
        self.core.imported_from()
    }

    /// The random id naming this tensor's memory in shared descriptions (an importer's is
    /// its owner's).
    #[getter]
    fn tensor_id(&self) -> u128 {
        self.core.tensor_id()
    }

    /// Drops all physical memory, keeping the addresses: every segment goes back to 0 bytes.
    /// The memory goes back once the work queued on `stream` so far has run (by default the
    /// current stream, torch's with the facade; one given is vouched for by the caller, as for
    /// `torch.cuda.ExternalStream`), from a thread of the tensor's, as a shrink's does: the
    /// call never waits for the device.
    #[pyo3(signature = (*, stream=None))]
    fn release_physical(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let stream = self.stream_or_current(py, stream, true)?;
        self.run(py, |core| core.release_physical(stream))
    }

    /// Bytes given back that are still mapped, waiting for their stream's earlier work (part
    /// of `physical_bytes`).
    #[getter]
    fn pending_release_bytes(&self) -> u64 {
        self.core.pending_release_bytes()
    }

    /// Bytes per second the tensor creates (grows) and releases (shrinks, `release_physical`)
    /// at most, together, one handle at a time; None (the default): unpaced. For a cache
    /// resized under a live decode loop: the driver's work on the device for memory created
    /// and released (its scrub) slows the loop's steps when gigabytes of it come at once. A
    /// grow then takes as long as its bytes at the rate (without the GIL); a shrink still
    /// returns at once, its memory pending (counted in `pending_release_bytes`, taken back by
    /// a grow) until its turn. Teardown, lends, borrows and consolidation are not paced.
    /// `ValueError` for 0 or a negative rate, `TypeError` for a non-int.
    #[getter]
    fn driver_rate(&self) -> Option<u64> {
        self.core.driver_rate()
    }

    #[setter]
    fn set_driver_rate(&self, rate: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let rate = to_u64_opt(rate, "driver_rate")?;
        Ok(self.core.set_driver_rate(rate)?)
    }

    /// Waits (without the GIL) until every pending release has happened, or for `timeout`
    /// seconds: whether none is pending. A signal (Ctrl-C) ends the wait with its exception.
    #[pyo3(signature = (timeout=None))]
    fn wait_released(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let timeout = to_timeout(timeout)?;
        self.wait_released_or_signal(py, timeout)
    }

    /// Exports (without the GIL) up to `max_handles` handles not exported yet, the top ones
    /// first, so that a later `lend` of them need not: how many are still not exported (0 for
    /// a tensor whose handles do not export as POSIX fds).
    fn export_ahead(&self, py: Python<'_>, max_handles: usize) -> PyResult<usize> {
        self.run(py, |core| core.export_ahead(max_handles))
    }

    /// The host backend's stand-in for a busy stream, for tests: while held, released memory
    /// stays pending until let go (or a synchronize). UnsupportedError on CUDA.
    fn _hold_events(&self, py: Python<'_>, held: bool) -> PyResult<()> {
        self.run(py, |core| core.hold_events(held))
    }

    /// Releases memory and addresses now, and the export registry of a shared tensor (its
    /// memfd); BufferError while views exist. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, ExtensibleTensor::close)
    }

    /// A DLPack capsule of `num_bytes` bytes at `offset` (1-D uint8) that keeps the memory alive.
    #[pyo3(signature = (offset, num_bytes, versioned=true))]
    fn _capsule(
        &self,
        py: Python<'_>,
        offset: &Bound<'_, PyAny>,
        num_bytes: &Bound<'_, PyAny>,
        versioned: bool,
    ) -> PyResult<Py<PyAny>> {
        let (offset, num_bytes) = (to_u64(offset, "offset")?, to_u64(num_bytes, "num_bytes")?);
        let layout = StridedLayout::bytes(num_bytes)?;
        capsule::new(py, &self.core, offset, layout, versioned)
    }

    /// A DLPack capsule of a strided view: element type `(code, bits)` in DLPack's terms,
    /// `shape` and `strides` in elements, `offset` in bytes (a multiple of the item size).
    /// Its storage is exactly the bytes the view can address.
    #[pyo3(signature = (offset, code, bits, shape, strides))]
    fn _view_capsule(
        &self,
        py: Python<'_>,
        offset: &Bound<'_, PyAny>,
        code: u8,
        bits: u8,
        shape: Vec<i64>,
        strides: Vec<i64>,
    ) -> PyResult<Py<PyAny>> {
        let offset = to_u64(offset, "offset")?;
        let dtype = crate::dlpack::DLDataType {
            code,
            bits,
            lanes: 1,
        };
        let layout = StridedLayout::new(dtype, shape, strides)?;
        capsule::new(py, &self.core, offset, layout, true)
    }

    /// The DLPack protocol: the whole capacity as a 1-D uint8 tensor.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        // The memory is ready on the stream it was zeroed on, which is the consumer's current
        // stream by default; a consumer on another stream orders itself, as with any allocator.
        let _ = stream;
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "ExtensibleTensor hands out DLPack views without copying only",
            ));
        }
        if let Some(dev) = dl_device {
            if dev != self.core.device().dlpack() {
                return Err(PyBufferError::new_err(format!(
                    "cannot hand a DLPack view to device {dev:?}: the memory lives on {:?}",
                    self.core.device().dlpack()
                )));
            }
        }
        let layout = StridedLayout::bytes(self.core.capacity_bytes())?;
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        capsule::new(py, &self.core, 0, layout, versioned)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        self.core.device().dlpack()
    }

    /// Checks the owner's invariants; raises AssertionError naming the broken one.
    fn _check_invariants(&self) -> PyResult<()> {
        self.core
            .check_invariants()
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    /// `{op: (calls, host nanoseconds)}` since construction or the last reset, for a tensor
    /// built with `_profile=True` (else empty).
    #[pyo3(signature = (reset=false))]
    fn _profile_report(&self, reset: bool) -> std::collections::HashMap<&'static str, (u64, u64)> {
        let Some(profile) = &self.profile else {
            return Default::default();
        };
        let report = profile
            .report()
            .into_iter()
            .map(|(op, n, ns)| (op.name(), (n, ns)))
            .collect();
        if reset {
            profile.reset();
        }
        report
    }

    /// Errors that destructors met (a failed unmap or release) since the last call.
    fn take_deferred_errors(&self) -> Vec<String> {
        self.core
            .take_deferred_errors()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    /// The granule runs `(first_granule, num_granules)` of the mapped handles.
    fn handle_runs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let runs: Vec<(u64, u64)> = py
            .detach(|| self.core.handle_runs())
            .iter()
            .map(|r| (r.first_granule, r.num_granules))
            .collect();
        PyList::new(py, runs)
    }

    /// The reservation's first address (granule-aligned); segment i starts at
    /// `base_ptr + segment_offsets[i]`. Never changes while the tensor lives.
    #[getter]
    fn base_ptr(&self) -> PyResult<u64> {
        Ok(self.core.base_ptr()?)
    }

    /// The bytes all segments can hold together (their capacities' sum): the most that can
    /// ever be committed. The reservation is this rounded up to whole granules.
    #[getter]
    fn capacity_bytes(&self) -> u64 {
        self.core.capacity_bytes()
    }

    /// The capacity of each segment (raises ValueError when they differ: see segment_capacities).
    #[getter]
    fn segment_capacity_bytes(&self) -> PyResult<u64> {
        Ok(self.core.segment_capacity_bytes()?)
    }

    /// The byte offset of each segment from `base_ptr`.
    #[getter]
    fn segment_offsets<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.core.geometry().segment_offsets())
    }

    /// The capacity of each segment in bytes, in order (unequal where `segment_capacities`
    /// was given).
    #[getter]
    fn segment_capacities<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.core.geometry().segment_capacities())
    }

    /// The committed bytes of every segment (raises ValueError when they differ: see
    /// segment_bytes).
    #[getter]
    fn bytes_per_segment(&self) -> PyResult<u64> {
        Ok(self.core.bytes_per_segment()?)
    }

    /// The committed bytes of each segment, in order: each segment's committed bytes are a
    /// prefix of it.
    #[getter]
    fn segment_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.core.segment_bytes())
    }

    /// How many segments the reservation is split into.
    #[getter]
    fn num_segments(&self) -> usize {
        self.core.num_segments()
    }

    /// The physical bytes mapped now (whole granules; a granule two segments share counts
    /// once), counting what a shrink or release gave back and is still pending
    /// (`pending_release_bytes`).
    #[getter]
    fn physical_bytes(&self) -> u64 {
        self.core.physical_bytes()
    }

    /// How many physical handles are mapped now, counting those pending release.
    #[getter]
    fn num_handles(&self) -> usize {
        self.core.num_handles()
    }

    /// The mapping granule in bytes: every handle and every mapping is a multiple of it.
    #[getter]
    fn granularity(&self) -> u64 {
        self.core.granularity()
    }

    /// `cpu` or `cuda:N`, as torch names it.
    #[getter]
    fn device(&self) -> String {
        self.core.device().torch_name()
    }

    /// `host` or `cuda`.
    #[getter]
    fn backend(&self) -> &'static str {
        self.core.backend_name()
    }

    /// How many views (torch tensors, DLPack capsules) still hold this tensor's memory;
    /// `close()` refuses while any is alive.
    #[getter]
    fn live_views(&self) -> usize {
        self.core.live_views()
    }

    /// Whether `close()` has run: a closed tensor holds no memory and refuses every operation.
    #[getter]
    fn closed(&self) -> bool {
        self.core.is_closed()
    }

    fn __repr__(&self) -> String {
        format!(
            "ExtensibleTensor(device={}, backend={}, capacity_bytes={}, num_segments={}, \
             segment_bytes={:?}, physical_bytes={}, num_handles={})",
            self.core.device().torch_name(),
            self.core.backend_name(),
            self.core.capacity_bytes(),
            self.core.num_segments(),
            self.core.segment_bytes(),
            self.core.physical_bytes(),
            self.core.num_handles()
        )
    }
}

/// The physical bytes that committing `prefix_bytes` of every segment maps (`plan.rs`).
#[pyfunction]
fn footprint_bytes(
    segment_offsets: Vec<u64>,
    prefix_bytes: u64,
    granularity: u64,
) -> PyResult<u64> {
    Ok(crate::plan::footprint_bytes(
        &segment_offsets,
        prefix_bytes,
        granularity,
    )?)
}

/// The bytes a strided view can address from its first element (`dlpack.rs`).
#[pyfunction]
fn extent_bytes(shape: Vec<i64>, strides: Vec<i64>, itemsize: u64) -> PyResult<u64> {
    Ok(crate::dlpack::extent_bytes(&shape, &strides, itemsize)?)
}

/// The bytes a host commit can take now: `MemAvailable`, or less where a memory cgroup's
/// limit leaves less room. The very figure the host backend checks each commit against.
#[pyfunction]
fn host_free_bytes() -> PyResult<u64> {
    Ok(driver::host::free_bytes()?)
}

/// `(available_bytes, total_bytes)` of host memory from a file in `/proc/meminfo`'s format,
/// as the host backend reads it.
#[pyfunction]
#[pyo3(signature = (meminfo=driver::host::MEMINFO), text_signature = "(meminfo='/proc/meminfo')")]
fn host_mem_info(meminfo: &str) -> PyResult<(u64, u64)> {
    Ok(driver::host::mem_info_from(meminfo)?)
}

/// None when `device` can map memory through the VMM API, else the reason it cannot.
#[pyfunction]
fn vmm_unavailable_reason(device: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    Ok(driver::unavailable_reason(&to_device(device)?))
}

/// The fds a shared description names, taken from this (the owner) process and checked
/// current: the registry's, then one per fd handle. The caller closes them.
#[pyfunction]
fn _owner_fds(py: Python<'_>, description: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    let description = share::to_description(description)?;
    py.detach(|| share::owner_fds(&description))
}

/// The fds a loan names, taken from this (the lender) process and checked current: the
/// board's, then one per handle. The caller closes them.
#[pyfunction]
fn _loan_owner_fds(py: Python<'_>, loan: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    let loan = loan::to_loan(loan)?;
    py.detach(|| loan::owner_fds(&loan))
}

/// Gives handles `indices` of `loan` back to its lender at once, unmapped (the borrower
/// cannot use them): how many it marked returned (`LoanDescription::decline`). `fds`: the
/// loan's received fds, or None to take them from the lender by pid.
#[pyfunction]
#[pyo3(signature = (loan, indices, fds=None))]
fn _loan_decline(
    py: Python<'_>,
    loan: &Bound<'_, PyAny>,
    indices: Vec<usize>,
    fds: Option<Vec<i32>>,
) -> PyResult<usize> {
    let loan = loan::to_loan(loan)?;
    let fds = share::to_fds(fds)?;
    Ok(py.detach(|| loan.decline(fds, &indices))?)
}

/// Process `pid`'s start time in clock ticks since boot (`/proc/PID/stat` field 22), or None
/// when there is no such live process (`ipc::process_start_time`: a zombie is dead).
#[pyfunction]
fn process_start_time(py: Python<'_>, pid: i64) -> Option<u64> {
    let pid = u32::try_from(pid).ok().filter(|&pid| pid > 0)?;
    py.detach(|| crate::ipc::process_start_time(pid))
}

/// The start time a `/proc/PID/stat` line gives, or None where it names a dead process or
/// is not such a line (`ipc::parse_start_time`).
#[pyfunction]
fn parse_start_time(stat: &[u8]) -> Option<u64> {
    crate::ipc::parse_start_time(stat)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyExtensibleTensor>()?;
    m.add_function(wrap_pyfunction!(vmm_unavailable_reason, m)?)?;
    m.add_function(wrap_pyfunction!(footprint_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(extent_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(host_mem_info, m)?)?;
    m.add_function(wrap_pyfunction!(_owner_fds, m)?)?;
    m.add_function(wrap_pyfunction!(_loan_owner_fds, m)?)?;
    m.add_function(wrap_pyfunction!(_loan_decline, m)?)?;
    m.add_function(wrap_pyfunction!(host_free_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(process_start_time, m)?)?;
    m.add_function(wrap_pyfunction!(parse_start_time, m)?)?;
    errors::add_to(m)?;
    m.add_function(wrap_pyfunction!(_set_stream_provider, m)?)?;
    m.add(
        "DEFAULT_MAX_HANDLE_BYTES",
        crate::tensor::DEFAULT_MAX_HANDLE_BYTES,
    )?;
    m.add(
        "HANDLE_SIZING_KINDS",
        PyTuple::new(m.py(), HANDLE_SIZING_KINDS)?,
    )?;
    m.add("EXPORT_POSIX_FD", ExportTypes::POSIX_FD.bits())?;
    m.add("EXPORT_FABRIC", ExportTypes::FABRIC.bits())?;
    m.add("CUDA_BUILT", cfg!(feature = "cuda"))?;
    Ok(())
}
