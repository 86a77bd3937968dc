//! The driver boundary: the few virtual-memory operations the owner needs, behind one trait.
//!
//! Addresses and handles cross this boundary as plain integers so the trait is object-safe and
//! knows nothing of CUDA or Linux. Every method is safe to call with any arguments: each backend
//! checks that an address range lies inside a reservation it made (and, where touching memory,
//! that it is mapped) before it reaches the OS or the driver, so a bad call is an error, never
//! memory corruption. That check is what lets the owner (`src/tensor/`) stay free of `unsafe`.
//! The one thing no backend can check is whether a stream is live, so a `Stream` other than the
//! default can only be made through an `unsafe` constructor, by whoever vouches for it (the
//! bindings, for a stream torch made).
//!
//! Semantics follow CUDA's VMM API: `reserve` takes address space only; `create` takes physical
//! memory as a handle; `map` places a whole handle at an address (no partial maps);
//! `set_access` makes mapped ranges readable and writable; `unmap` returns a range to reserved,
//! inaccessible address space; `release` drops a handle (its memory lives on while mapped).

mod books;
pub mod host;
pub mod wrap;

#[cfg(feature = "cuda")]
pub mod cuda;

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use crate::error::{Error, Result};

/// An opaque physical-memory handle: a CUDA `CUmemGenericAllocationHandle`, or a host memfd id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HandleId(pub u64);

/// A marker recorded on a stream (`Driver::record_event`): complete once the work queued on
/// the stream before it has run. A CUDA `CUevent` as an integer, or a host stand-in's number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EventId(pub u64);

/// The stream device work is ordered on: a CUDA `CUstream` as an integer, 0 being the legacy
/// default stream. The host backend ignores it (it zeroes before returning).
///
/// ```
/// use extensible_kv::driver::Stream;
/// assert_eq!(Stream::default(), Stream::DEFAULT);
/// // SAFETY: 0 names the legacy default stream, which every context has.
/// assert_eq!(unsafe { Stream::from_raw(0) }, Stream::DEFAULT);
/// ```
///
/// Safe code cannot name any other stream, neither by the field nor by `from_raw`:
///
/// ```compile_fail,E0603
/// let stream = extensible_kv::driver::Stream(0x5555);
/// ```
///
/// ```compile_fail,E0133
/// let stream = extensible_kv::driver::Stream::from_raw(0x5555);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Stream(u64);

impl Stream {
    /// CUDA's legacy default stream, which every context has and which never dies.
    pub const DEFAULT: Stream = Stream(0);

    /// A stream named by its raw handle.
    ///
    /// # Safety
    /// `raw` must be 0 or a `CUstream` of the primary context of the device whose driver is
    /// given the stream (torch's streams are), and that stream must not be destroyed before
    /// the calls given it have returned: the CUDA backend enqueues work on it, and libcuda
    /// does not promise to reject a dead or foreign stream.
    #[allow(unsafe_code)]
    pub const unsafe fn from_raw(raw: u64) -> Stream {
        Stream(raw)
    }

    /// The raw handle, for the backend that enqueues work on it.
    pub const fn as_raw(self) -> u64 {
        self.0
    }
}

/// The ways a physical allocation may be handed to another process, asked for when it is
/// created: CUDA's `CUmemAllocationHandleType` bits (an export of a type not asked for at
/// creation is refused; asking costs nothing). The host backend's memfds are POSIX fds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ExportTypes(u32);

impl ExportTypes {
    /// Not exportable (CUDA's `CU_MEM_HANDLE_TYPE_NONE`).
    pub const NONE: ExportTypes = ExportTypes(0);
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a file descriptor, passed to processes of
    /// the same host (pidfd_getfd, or SCM_RIGHTS over a Unix socket).
    pub const POSIX_FD: ExportTypes = ExportTypes(1);
    /// `CU_MEM_HANDLE_TYPE_FABRIC`: 64 bytes any process of the NVLink fabric can import.
    pub const FABRIC: ExportTypes = ExportTypes(8);

    /// The types named by CUDA's bits; `InvalidArgument` for bits of other types.
    pub fn from_bits(bits: u32) -> Result<ExportTypes> {
        let known = ExportTypes::POSIX_FD.0 | ExportTypes::FABRIC.0;
        if bits & !known != 0 {
            return Err(Error::invalid(format!(
                "export handle types {bits:#x}: only POSIX fd (1) and fabric (8) are supported"
            )));
        }
        Ok(ExportTypes(bits))
    }

    /// CUDA's bits for these types.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Whether every type of `other` is among these.
    pub const fn contains(self, other: ExportTypes) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether no type is asked for.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The types in both.
    pub const fn intersection(self, other: ExportTypes) -> ExportTypes {
        ExportTypes(self.0 & other.0)
    }

    /// The types in either.
    pub const fn union(self, other: ExportTypes) -> ExportTypes {
        ExportTypes(self.0 | other.0)
    }

    /// These types but those of `other`.
    pub const fn without(self, other: ExportTypes) -> ExportTypes {
        ExportTypes(self.0 & !other.0)
    }
}

/// A physical handle exported for another process.
#[derive(Debug)]
pub enum Exported {
    /// A file descriptor of this process (closing it does not free the memory).
    Fd(OwnedFd),
    /// CUDA's fabric handle.
    Fabric([u8; 64]),
}

/// What an importer names an exported handle by, in its own process.
#[derive(Clone, Copy, Debug)]
pub enum ImportSource<'a> {
    /// An fd this process holds (duplicated from the owner's); the driver does not take it.
    Fd(BorrowedFd<'a>),
    /// The 64 bytes of a fabric handle.
    Fabric(&'a [u8; 64]),
}

/// Where memory lives, in DLPack's terms (`kDLCPU` = 1, `kDLCUDA` = 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// Host memory (the host backend).
    Cpu,
    /// A CUDA device, by ordinal.
    Cuda(i32),
}

impl DeviceKind {
    /// `(device_type, device_id)` as DLPack names them.
    pub fn dlpack(self) -> (i32, i32) {
        match self {
            DeviceKind::Cpu => (1, 0),
            DeviceKind::Cuda(ordinal) => (2, ordinal),
        }
    }

    /// The name torch uses for the device: `cpu` or `cuda:N`.
    pub fn torch_name(self) -> String {
        match self {
            DeviceKind::Cpu => "cpu".to_string(),
            DeviceKind::Cuda(ordinal) => format!("cuda:{ordinal}"),
        }
    }
}

/// The operations the owner needs from a backend; see the module doc for the contract.
pub trait Driver: Send + Sync + 'static {
    /// `host` or `cuda`.
    fn backend_name(&self) -> &'static str;

    /// Where the memory of this driver lives.
    fn device(&self) -> DeviceKind;

    /// The mapping granularity in bytes: reservations, handles and maps are multiples of it.
    fn granularity(&self) -> u64;

    /// Whether a freshly created handle reads as zeros (a memfd does, `cuMemCreate` does not).
    fn fresh_memory_is_zeroed(&self) -> bool;

    /// Reserves `num_bytes` (a granularity multiple) of address space; returns its start,
    /// aligned to the granularity.
    fn reserve(&self, num_bytes: u64) -> Result<u64>;

    /// Frees a whole reservation made by `reserve`. Everything in it must be unmapped.
    fn free_reservation(&self, va: u64, num_bytes: u64) -> Result<()>;

    /// The export types this device can give a handle (a subset of POSIX fd and fabric).
    fn supported_export_types(&self) -> ExportTypes;

    /// Takes `num_bytes` (a granularity multiple) of physical memory, exportable as `export`
    /// (which must be among `supported_export_types`).
    fn create(&self, num_bytes: u64, export: ExportTypes) -> Result<HandleId>;

    /// Exports a live handle as one type (`POSIX_FD` or `FABRIC`) it was created for.
    fn export(&self, handle: HandleId, kind: ExportTypes) -> Result<Exported>;

    /// Imports a handle another process exported, of `num_bytes`: a live handle of this
    /// driver from then on (mapped, released like any other; the owner's memory lives while
    /// either side holds it).
    fn import(&self, source: ImportSource<'_>, num_bytes: u64) -> Result<HandleId>;

    /// Drops a handle from `create`; its memory lives on while it is mapped.
    fn release(&self, handle: HandleId) -> Result<()>;

    /// Maps all of `handle` (`num_bytes` long) at `va`, inside a reservation, over unmapped space.
    fn map(&self, va: u64, num_bytes: u64, handle: HandleId) -> Result<()>;

    /// Unmaps `[va, va + num_bytes)`, which must cover whole mappings.
    fn unmap(&self, va: u64, num_bytes: u64) -> Result<()>;

    /// Grants read-write access to mapped `[va, va + num_bytes)`.
    fn set_access(&self, va: u64, num_bytes: u64) -> Result<()>;

    /// Zeroes mapped, accessible `[va, va + num_bytes)`, ordered on `stream` (ignored by the
    /// host backend, which zeroes before returning).
    fn memset_zero(&self, va: u64, num_bytes: u64, stream: Stream) -> Result<()>;

    /// Copies `num_bytes` from `src` to `dst`, both mapped and accessible and not overlapping,
    /// ordered on `stream` (the host backend copies before returning).
    fn copy(&self, dst: u64, src: u64, num_bytes: u64, stream: Stream) -> Result<()>;

    /// Waits for all work the device may still do on memory of this driver.
    fn synchronize(&self) -> Result<()>;

    /// Waits for the work queued on `stream` so far, and for nothing else: an event recorded
    /// on the stream, then waited on (never a context or device synchronize, which waits for
    /// every stream: ~0.42 s per call on an H200 while a decode loop kept it busy). Work the
    /// caller queued on other streams is the caller's to order. Counted as a `Synchronize`
    /// by the test wrappers. The default (the host backend's stand-in) synchronizes.
    fn fence(&self, stream: Stream) -> Result<()> {
        let _ = stream;
        self.synchronize()
    }

    /// Records an event on `stream`, complete once the work queued on it so far has run;
    /// `None` when that work is complete already (a backend that runs work before returning,
    /// as the host backend does unless `hold_events`). The event is the caller's to
    /// `destroy_event`. Never waits. The default fences and returns `None`.
    fn record_event(&self, stream: Stream) -> Result<Option<EventId>> {
        self.fence(stream).map(|()| None)
    }

    /// Blocks the calling thread until `event` (from `record_event`, not destroyed) is
    /// complete. Waits for nothing else: the device and the other streams go on.
    fn wait_event(&self, event: EventId) -> Result<()> {
        let _ = event;
        Ok(())
    }

    /// Destroys `event`; a wait on it must have returned first.
    fn destroy_event(&self, event: EventId) -> Result<()> {
        let _ = event;
        Ok(())
    }

    /// The host backend's stand-in for a busy stream, for tests: while held, `record_event`
    /// returns events that stay pending until let go (or until a `synchronize`, which waits
    /// for everything). Other backends refuse with `Error::Unsupported`.
    fn hold_events(&self, held: bool) -> Result<()> {
        let _ = held;
        Err(Error::Unsupported(format!(
            "the {} backend's events follow its device: only the host backend can hold them",
            self.backend_name()
        )))
    }

    /// `(free_bytes, total_bytes)` of the memory `create` draws from.
    fn mem_info(&self) -> Result<(u64, u64)>;

    /// Refuses, with `Error::OutOfMemory`, to create `num_bytes` in all when the backend can
    /// tell up front that they will not fit: a grow asks once for all its new handles, so it
    /// fails before its first create rather than after taking what it could. The default
    /// allows everything (CUDA's `cuMemCreate` fails cleanly by itself).
    fn check_room(&self, num_bytes: u64) -> Result<()> {
        let _ = num_bytes;
        Ok(())
    }

    /// Tells the backend where the segments of the reservation at `va` lie and how many bytes
    /// each has committed; the owner calls it after every change. The host backend keeps it
    /// for the report of a stray access (`stray`); the default ignores it.
    fn note_layout(&self, va: u64, offsets: &[u64], capacities: &[u64], committed: &[u64]) {
        let _ = (va, offsets, capacities, committed);
    }
}

/// Parses a torch-style device name: `cpu`, `cuda` (device 0) or `cuda:N`.
pub fn parse_device(device: &str) -> Result<DeviceKind> {
    let invalid = || {
        crate::error::Error::invalid(format!(
            "unknown device {device:?}: expected 'cpu', 'cuda' or 'cuda:N'"
        ))
    };
    match device.trim() {
        "cpu" => Ok(DeviceKind::Cpu),
        "cuda" => Ok(DeviceKind::Cuda(0)),
        other => {
            let ordinal = other.strip_prefix("cuda:").ok_or_else(invalid)?;
            ordinal
                .parse::<i32>()
                .ok()
                .filter(|n| *n >= 0)
                .map(DeviceKind::Cuda)
                .ok_or_else(invalid)
        }
    }
}

/// A driver for `device`. The host backend takes `granularity` as its own; CUDA has a fixed
/// granularity per device (a coarser one is applied by the tensor's geometry) and one shared
/// driver per device.
pub fn open(device: &str, granularity: Option<u64>) -> Result<Arc<dyn Driver>> {
    match parse_device(device)? {
        DeviceKind::Cpu => Ok(Arc::new(host::HostDriver::new(
            granularity.unwrap_or(host::DEFAULT_GRANULARITY),
        )?)),
        DeviceKind::Cuda(ordinal) => open_cuda(ordinal),
    }
}

/// What `open_with` opens: the granularity `open` takes, and the wrappers that tests and
/// profiling put around the driver.
#[derive(Clone, Copy, Debug, Default)]
pub struct OpenOptions {
    /// The host backend's granularity (see `open`); `None` for its default.
    pub granularity: Option<u64>,
    /// Fail one call (`FaultyDriver`), for fault-injection tests.
    pub fault: Option<wrap::faulty::Fault>,
    /// Count calls and host time per operation (`ProfilingDriver`).
    pub profile: bool,
}

/// A driver from `open_with`, and its profiling wrapper when asked for, to read the counts from.
pub struct Opened {
    /// The driver, wrapped as asked.
    pub driver: Arc<dyn Driver>,
    /// The profiling wrapper, when asked for.
    pub profile: Option<Arc<wrap::profile::ProfilingDriver>>,
}

/// `open`, then the wrappers `options` asks for: the fault innermost, so that the profile sees the
/// injected failures as calls too.
pub fn open_with(device: &str, options: OpenOptions) -> Result<Opened> {
    let mut driver = open(device, options.granularity)?;
    if let Some(fault) = options.fault {
        driver = Arc::new(wrap::faulty::FaultyDriver::new(driver, fault));
    }
    let mut profile = None;
    if options.profile {
        let profiled = Arc::new(wrap::profile::ProfilingDriver::new(driver));
        profile = Some(Arc::clone(&profiled));
        driver = profiled;
    }
    Ok(Opened { driver, profile })
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: i32) -> Result<Arc<dyn Driver>> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static DRIVERS: OnceLock<Mutex<HashMap<i32, Arc<cuda::CudaDriver>>>> = OnceLock::new();
    let mut drivers = DRIVERS
        .get_or_init(Default::default)
        .lock()
        .expect("drivers poisoned");
    if let Some(driver) = drivers.get(&ordinal) {
        return Ok(driver.clone());
    }
    let driver = Arc::new(cuda::CudaDriver::new(ordinal)?);
    drivers.insert(ordinal, driver.clone());
    Ok(driver)
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: i32) -> Result<Arc<dyn Driver>> {
    Err(crate::error::Error::Unsupported(NO_CUDA_BUILD.into()))
}

#[cfg(not(feature = "cuda"))]
const NO_CUDA_BUILD: &str =
    "this build of extensible-kv has no CUDA backend (cargo feature 'cuda')";

/// None when `device` can reserve and map memory, else why not.
pub fn unavailable_reason(device: &str) -> Option<String> {
    match parse_device(device) {
        Err(err) => Some(err.to_string()),
        Ok(DeviceKind::Cpu) => None,
        #[cfg(feature = "cuda")]
        Ok(DeviceKind::Cuda(ordinal)) => cuda::vmm_unavailable_reason(ordinal),
        #[cfg(not(feature = "cuda"))]
        Ok(DeviceKind::Cuda(_)) => Some(NO_CUDA_BUILD.into()),
    }
}
