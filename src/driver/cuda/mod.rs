//! The CUDA backend: CUDA's virtual-memory-management (VMM) driver API on one device.
//!
//! Layers, as in cudarc: cudarc's `sys` is the raw FFI (libcuda is loaded at run time, so
//! building needs no CUDA); cudarc's `result` wraps the calls it knows (init, devices, contexts,
//! `cuMemGetInfo`); `vmm.rs` adds the same one-call wrappers for the VMM calls cudarc lacks;
//! `context.rs` loads libcuda, probes the device and binds its primary context; `CudaDriver`
//! (here) keeps the books and turns statuses into this crate's `Error`.
//!
//! Soundness: libcuda does not promise to reject every bad argument: a memset is device work,
//! so a bad range can surface later as an illegal-address fault that poisons the context for
//! every library in the process, and an unknown allocation handle is not documented to be
//! caught. So, as in the host backend, every range and handle is checked against this driver's
//! books (live reservations, mappings and handles) before it reaches libcuda. The one argument
//! taken on trust is the stream that `memset_zero`, `copy` and `fence` order work on, which only
//! its creator (torch) can vouch for: hence `Stream::from_raw` is `unsafe`.
#![allow(unsafe_code)]

mod context;
mod vmm;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

pub use self::context::vmm_unavailable_reason;
use self::context::{Bound, PrimaryContext};
use super::books::Books;
use super::{DeviceKind, Driver, EventId, ExportTypes, Exported, HandleId, ImportSource, Stream};
use crate::error::{Error, OnOp, Op, Result};

// Sizes cross the trait as u64 and libcuda as usize; the casts below rely on equal widths.
const _: () = assert!(usize::BITS == u64::BITS);

/// The name libcuda gives a status, e.g. `CUDA_ERROR_INVALID_VALUE`.
fn code_name(err: DriverError) -> String {
    match err.error_name() {
        Ok(name) => name.to_string_lossy().into_owned(),
        // cuGetErrorName fails only for statuses it does not know; bindgen's name will do.
        Err(_) => format!("{:?}", err.0),
    }
}

impl<T> OnOp<T> for Result<T, DriverError> {
    fn on(self, op: Op, detail: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|err| Error::Driver {
            op,
            code: code_name(err),
            detail: detail(),
        })
    }
}

/// An argument the books refuse; named like the driver's own refusal of a bad range.
fn refused(op: Op, va: u64, num_bytes: u64, why: &str) -> Error {
    Error::Driver {
        op,
        code: "CUDA_ERROR_INVALID_VALUE".into(),
        detail: format!("[{va:#x}, +{num_bytes:#x}) {why}"),
    }
}

/// CUDA's VMM API on one device, through its primary context.
pub struct CudaDriver {
    ordinal: i32,
    granularity: u64,
    export_support: context::ExportSupport,
    /// Set by the first fabric allocation the driver refused: fabric is offered no more.
    fabric_refused: AtomicBool,
    books: Mutex<Books<()>>,
    /// The events `record_event` made and `destroy_event` has not: the only ones it waits on.
    events: Mutex<std::collections::BTreeSet<u64>>,
    /// Last, so it is released after `Drop` has cleaned up with it.
    primary: PrimaryContext,
}

impl CudaDriver {
    /// Opens device `ordinal`: `Error::Unsupported` with `vmm_unavailable_reason`'s words when
    /// it cannot work.
    pub fn new(ordinal: i32) -> Result<CudaDriver> {
        let (primary, granularity) = context::open(ordinal).map_err(Error::Unsupported)?;
        Ok(CudaDriver {
            ordinal,
            granularity,
            export_support: primary.export_support(),
            fabric_refused: AtomicBool::new(false),
            books: Mutex::default(),
            events: Mutex::default(),
            primary,
        })
    }

    /// `(live handles, live mappings, live reservations)`, for leak checks.
    pub fn live_counts(&self) -> (usize, usize, usize) {
        self.books().live_counts()
    }

    /// Books change only after a call succeeded, so a panic elsewhere leaves them consistent.
    fn books(&self) -> MutexGuard<'_, Books<()>> {
        self.books.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bind(&self, op: Op) -> Result<Bound> {
        self.primary.bind().on(op, || {
            format!("binding the primary context of device {}", self.ordinal)
        })
    }

    /// `Error::Driver` for an event this driver did not record, or destroyed.
    fn unknown_event(&self, event: EventId) -> Error {
        Error::Driver {
            op: Op::WaitEvent,
            code: "CUDA_ERROR_INVALID_HANDLE".into(),
            detail: format!("no live event {:#x} of device {}", event.0, self.ordinal),
        }
    }

    fn check_event(&self, event: EventId) -> Result<()> {
        match self
            .events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&event.0)
        {
            true => Ok(()),
            false => Err(self.unknown_event(event)),
        }
    }

    fn out_of_memory(&self, err: DriverError, num_bytes: u64) -> Error {
        Error::OutOfMemory {
            op: Op::Create,
            requested_bytes: num_bytes,
            free_bytes: result::mem_get_info().ok().map(|(free, _)| free as u64),
            code: code_name(err),
        }
    }
}

impl Driver for CudaDriver {
    fn backend_name(&self) -> &'static str {
        "cuda"
    }

    fn device(&self) -> DeviceKind {
        DeviceKind::Cuda(self.ordinal)
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn fresh_memory_is_zeroed(&self) -> bool {
        false
    }

    fn reserve(&self, num_bytes: u64) -> Result<u64> {
        let _bound = self.bind(Op::Reserve)?;
        let va = vmm::address_reserve(num_bytes as usize, self.granularity as usize)
            .on(Op::Reserve, || format!("{num_bytes} bytes"))?;
        self.books().reservations.insert(va, num_bytes);
        Ok(va)
    }

    fn free_reservation(&self, va: u64, num_bytes: u64) -> Result<()> {
        let _bound = self.bind(Op::FreeReservation)?;
        let refused = |why: &str| refused(Op::FreeReservation, va, num_bytes, why);
        self.books().free_reservation(va, num_bytes, refused, || {
            // SAFETY: the books found the range exactly one live reservation with nothing
            // mapped in it, under the lock that every map takes.
            unsafe { vmm::address_free(va, num_bytes as usize) }.on(Op::FreeReservation, || {
                format!("{num_bytes} bytes at {va:#x}")
            })
        })
    }

    fn supported_export_types(&self) -> ExportTypes {
        let support = self.export_support;
        let mut types = ExportTypes::NONE;
        if support.posix_fd {
            types = types.union(ExportTypes::POSIX_FD);
        }
        if support.fabric && !self.fabric_refused.load(Ordering::Relaxed) {
            types = types.union(ExportTypes::FABRIC);
        }
        types
    }

    /// Exportable memory is also made registrable for GPUDirect RDMA where the device allows
    /// it on VMM allocations: a connector that exports the KV cache usually registers it too.
    ///
    /// A refused fabric allocation (no IMEX channel after all, or a fabric the device does not
    /// have) is retried without fabric, and fabric is offered no more, as vLLM does: the
    /// memory stays exportable as POSIX fds where those were asked for too.
    fn create(&self, num_bytes: u64, export: ExportTypes) -> Result<HandleId> {
        let _bound = self.bind(Op::Create)?;
        let attempt = |export: ExportTypes| {
            let rdma = !export.is_empty() && self.export_support.rdma_with_vmm;
            vmm::create(
                num_bytes as usize,
                &vmm::pinned_prop(self.ordinal, export.bits(), rdma),
            )
        };
        let refused_fabric = |err: &DriverError| {
            export.contains(ExportTypes::FABRIC)
                && matches!(
                    err.0,
                    sys::CUresult::CUDA_ERROR_NOT_PERMITTED
                        | sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
                )
        };
        let created = match attempt(export) {
            Err(err) if refused_fabric(&err) => {
                self.fabric_refused.store(true, Ordering::Relaxed);
                attempt(export.without(ExportTypes::FABRIC))
            }
            other => other,
        };
        let handle = match created {
            Ok(handle) => handle,
            Err(err) if err.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                return Err(self.out_of_memory(err, num_bytes))
            }
            Err(err) => return Err(err).on(Op::Create, || format!("{num_bytes} bytes")),
        };
        self.books().handles.insert(handle, ((), num_bytes));
        Ok(HandleId(handle))
    }

    fn export(&self, handle: HandleId, kind: ExportTypes) -> Result<Exported> {
        let _bound = self.bind(Op::Export)?;
        if !self.books().handles.contains_key(&handle.0) {
            return Err(Error::Driver {
                op: Op::Export,
                code: "CUDA_ERROR_INVALID_VALUE".into(),
                detail: format!("no live handle {:#x}", handle.0),
            });
        }
        let detail = || format!("handle {:#x} as {kind:?}", handle.0);
        match kind {
            // SAFETY: the handle is in the books, so it is live; a handle created without
            // this type is refused by the driver with a status.
            ExportTypes::POSIX_FD => unsafe { vmm::export_fd(handle.0) }
                .map(Exported::Fd)
                .on(Op::Export, detail),
            // SAFETY: as above.
            ExportTypes::FABRIC => unsafe { vmm::export_fabric(handle.0) }
                .map(Exported::Fabric)
                .on(Op::Export, detail),
            other => Err(Error::invalid(format!(
                "export one handle type at a time, not {other:?}"
            ))),
        }
    }

    fn import(&self, source: ImportSource<'_>, num_bytes: u64) -> Result<HandleId> {
        let _bound = self.bind(Op::Import)?;
        let handle = match source {
            ImportSource::Fd(fd) => vmm::import_fd(fd),
            ImportSource::Fabric(fabric) => vmm::import_fabric(fabric),
        }
        .on(Op::Import, || format!("{num_bytes} bytes"))?;
        self.books().handles.insert(handle, ((), num_bytes));
        Ok(HandleId(handle))
    }

    fn release(&self, handle: HandleId) -> Result<()> {
        let _bound = self.bind(Op::Release)?;
        let mut books = self.books();
        let Some(&((), num_bytes)) = books.handles.get(&handle.0) else {
            let detail = format!("no live handle {:#x}", handle.0);
            return Err(Error::Driver {
                op: Op::Release,
                code: "CUDA_ERROR_INVALID_VALUE".into(),
                detail,
            });
        };
        // SAFETY: the handle is in the books, so `create` made it and no release has run since.
        unsafe { vmm::release(handle.0) }.on(Op::Release, || format!("{num_bytes} bytes"))?;
        books.handles.remove(&handle.0);
        Ok(())
    }

    fn map(&self, va: u64, num_bytes: u64, handle: HandleId) -> Result<()> {
        let _bound = self.bind(Op::Map)?;
        let refused = |why: &str| refused(Op::Map, va, num_bytes, why);
        self.books().map(va, num_bytes, handle.0, refused, |()| {
            // SAFETY: the books found a live handle of exactly this size and a range inside one
            // of our reservations that overlaps no mapping.
            unsafe { vmm::map(va, num_bytes as usize, handle.0) }
                .on(Op::Map, || format!("{num_bytes} bytes at {va:#x}"))
        })
    }

    fn unmap(&self, va: u64, num_bytes: u64) -> Result<()> {
        let _bound = self.bind(Op::Unmap)?;
        let refused = |why: &str| refused(Op::Unmap, va, num_bytes, why);
        self.books().unmap(va, num_bytes, refused, || {
            // SAFETY: the books found whole live mappings of ours tiling the range. Device work
            // still touching it is the owner's to fence; if it did not, the kernel faults, host
            // memory is untouched.
            unsafe { vmm::unmap(va, num_bytes as usize) }
                .on(Op::Unmap, || format!("{num_bytes} bytes at {va:#x}"))
        })
    }

    fn set_access(&self, va: u64, num_bytes: u64) -> Result<()> {
        let _bound = self.bind(Op::SetAccess)?;
        let location = vmm::device_location(self.ordinal);
        let refused = |why: &str| refused(Op::SetAccess, va, num_bytes, why);
        self.books().set_access(va, num_bytes, refused, || {
            // SAFETY: the books found whole live mappings of ours tiling the range.
            unsafe { vmm::set_access(va, num_bytes as usize, location) }
                .on(Op::SetAccess, || format!("{num_bytes} bytes at {va:#x}"))
        })
    }

    fn memset_zero(&self, va: u64, num_bytes: u64, stream: Stream) -> Result<()> {
        if num_bytes == 0 {
            return Ok(());
        }
        let _bound = self.bind(Op::Memset)?;
        let books = self.books();
        if let Some(why) = books.refuse_memset(va, num_bytes) {
            return Err(refused(Op::Memset, va, num_bytes, why));
        }
        let raw_stream = stream.as_raw();
        // SAFETY: accessible mappings of ours cover the range, and the lock held until the
        // enqueue returns keeps any unmap out; `stream` is the legacy default or a live stream
        // of this device's primary context, as whoever made it with `Stream::from_raw` vouched.
        unsafe { vmm::memset_zero(va, num_bytes as usize, raw_stream as usize as sys::CUstream) }
            .on(Op::Memset, || {
                format!("{num_bytes} bytes at {va:#x}, stream {raw_stream:#x}")
            })
    }

    fn copy(&self, dst: u64, src: u64, num_bytes: u64, stream: Stream) -> Result<()> {
        if num_bytes == 0 {
            return Ok(());
        }
        let _bound = self.bind(Op::Copy)?;
        let books = self.books();
        if let Some((va, why)) = books.refuse_copy(dst, src, num_bytes) {
            return Err(refused(Op::Copy, va, num_bytes, why));
        }
        let raw_stream = stream.as_raw();
        // SAFETY: accessible, disjoint mappings of ours cover both ranges, and the lock held
        // until the enqueue returns keeps any unmap out; `stream` is the legacy default or a
        // live stream of this device's primary context, as `Stream::from_raw`'s caller vouched.
        let enqueued = unsafe {
            vmm::copy(
                dst,
                src,
                num_bytes as usize,
                raw_stream as usize as sys::CUstream,
            )
        };
        enqueued.on(Op::Copy, || {
            format!("{num_bytes} bytes {src:#x} -> {dst:#x}, stream {raw_stream:#x}")
        })
    }

    fn synchronize(&self) -> Result<()> {
        let _bound = self.bind(Op::Synchronize)?;
        result::ctx::synchronize().on(Op::Synchronize, || format!("device {}", self.ordinal))
    }

    fn fence(&self, stream: Stream) -> Result<()> {
        let _bound = self.bind(Op::Synchronize)?;
        let raw_stream = stream.as_raw();
        // SAFETY: `stream` is the legacy default or a live stream of this device's primary
        // context (bound above), as whoever made it with `Stream::from_raw` vouched.
        unsafe { vmm::fence(raw_stream as usize as sys::CUstream) }.on(Op::Synchronize, || {
            format!(
                "an event on stream {raw_stream:#x} of device {}",
                self.ordinal
            )
        })
    }

    fn record_event(&self, stream: Stream) -> Result<Option<EventId>> {
        let _bound = self.bind(Op::RecordEvent)?;
        let raw_stream = stream.as_raw();
        // SAFETY: `stream` is the legacy default or a live stream of this device's primary
        // context (bound above), as whoever made it with `Stream::from_raw` vouched.
        let event = unsafe { vmm::record_event(raw_stream as usize as sys::CUstream) }
            .on(Op::RecordEvent, || {
                format!("stream {raw_stream:#x} of device {}", self.ordinal)
            })?;
        let id = EventId(event as usize as u64);
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id.0);
        Ok(Some(id))
    }

    fn wait_event(&self, event: EventId) -> Result<()> {
        let _bound = self.bind(Op::WaitEvent)?;
        self.check_event(event)?;
        // SAFETY: the event is live (in `events`, recorded by this driver in its primary
        // context, bound above); the owner destroys it only after its wait has returned.
        unsafe { vmm::wait_event(event.0 as usize as sys::CUevent) }
            .on(Op::WaitEvent, || format!("event {:#x}", event.0))
    }

    fn destroy_event(&self, event: EventId) -> Result<()> {
        let _bound = self.bind(Op::WaitEvent)?;
        if !self
            .events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&event.0)
        {
            return Err(self.unknown_event(event));
        }
        // SAFETY: the event was live and is ours (just taken out of `events`, so destroyed
        // once); the owner waits on it no more.
        unsafe { vmm::destroy_event(event.0 as usize as sys::CUevent) }
            .on(Op::WaitEvent, || format!("destroying event {:#x}", event.0))
    }

    fn mem_info(&self) -> Result<(u64, u64)> {
        let _bound = self.bind(Op::MemInfo)?;
        let (free, total) =
            result::mem_get_info().on(Op::MemInfo, || format!("device {}", self.ordinal))?;
        Ok((free as u64, total as u64))
    }
}

impl Drop for CudaDriver {
    /// Owners give everything back before their driver goes; this only keeps a leak from
    /// outliving the driver. Errors are dropped: there is no one left to report them to.
    fn drop(&mut self) {
        let books = std::mem::take(self.books.get_mut().unwrap_or_else(PoisonError::into_inner));
        if books.live_counts() == (0, 0, 0) {
            return;
        }
        let Ok(_bound) = self.primary.bind() else {
            return;
        };
        let _ = result::ctx::synchronize();
        // SAFETY: each entry is live and ours; the driver that hands out these addresses is
        // going, so nothing can reach them any more, and the synchronize drained device work.
        unsafe {
            for (&va, &(num_bytes, _)) in &books.mappings {
                let _ = vmm::unmap(va, num_bytes as usize);
            }
            for &handle in books.handles.keys() {
                let _ = vmm::release(handle);
            }
            for (&va, &num_bytes) in &books.reservations {
                let _ = vmm::address_free(va, num_bytes as usize);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A driver on device 0; panics with the reason when there is none. The `gpu_` tests are
    /// `#[ignore]`d, so that a plain `cargo test` without a GPU reports them ignored rather than
    /// `ok` after an early return; asked for (`--include-ignored`, as `scripts/gpu-check`
    /// does), they must not pass vacuously.
    fn gpu_driver() -> CudaDriver {
        if let Some(reason) = vmm_unavailable_reason(0) {
            panic!("a GPU test was run without a usable GPU: {reason}");
        }
        CudaDriver::new(0).expect("probe passed")
    }

    fn assert_refused<T: std::fmt::Debug>(result: Result<T>, op: Op) {
        match result {
            Err(Error::Driver { op: got, code, .. }) => {
                assert_eq!((got, code.as_str()), (op, "CUDA_ERROR_INVALID_VALUE"));
            }
            other => panic!("expected {op} to be refused, got {other:?}"),
        }
    }

    #[test]
    fn probe_explains_itself_and_never_panics() {
        // SAFETY: only opens and closes candidate libraries, as `load_libcuda` does.
        let libcuda_present = unsafe { sys::is_culib_present() };
        match vmm_unavailable_reason(0) {
            Some(reason) if !libcuda_present => assert!(reason.contains("libcuda"), "{reason}"),
            Some(reason) => eprintln!("device 0 unusable: {reason}"),
            None => assert!(libcuda_present),
        }
        let reason = vmm_unavailable_reason(-1).expect("ordinal -1 never exists");
        if libcuda_present {
            assert!(
                reason.contains("no CUDA device -1") || reason.contains("cuInit"),
                "{reason}"
            );
        }
    }

    #[test]
    fn new_is_unsupported_without_a_usable_device() {
        assert!(matches!(
            CudaDriver::new(i32::MAX),
            Err(Error::Unsupported(_))
        ));
        // Device 0 is usable on a GPU machine; elsewhere, `new` must give the probe's reason.
        if let Some(reason) = vmm_unavailable_reason(0) {
            match CudaDriver::new(0) {
                Err(Error::Unsupported(message)) => assert_eq!(message, reason),
                Err(other) => panic!("expected Unsupported, got {other}"),
                Ok(_) => panic!("expected Unsupported ({reason}), got a driver"),
            }
        }
    }

    /// Fills `[va, va + num_bytes)` with `byte` and waits, outside the driver's own paths.
    fn fill(driver: &CudaDriver, va: u64, num_bytes: u64, byte: u8) {
        let _bound = driver.primary.bind().unwrap();
        // SAFETY: the test mapped the range read-write through `driver` just before.
        unsafe { sys::cuMemsetD8_v2(va, byte, num_bytes as usize) }
            .result()
            .unwrap();
    }

    fn read_back(driver: &CudaDriver, va: u64, num_bytes: u64) -> Vec<u8> {
        let _bound = driver.primary.bind().unwrap();
        let mut bytes = vec![0u8; num_bytes as usize];
        // SAFETY: the range is mapped read-write through `driver`; `bytes` is exactly as long.
        unsafe { result::memcpy_dtoh_sync(&mut bytes, va) }.unwrap();
        bytes
    }

    #[test]
    #[ignore = "needs a CUDA GPU with VMM: run with --include-ignored on one"]
    fn gpu_round_trip_of_two_granules() {
        let driver = gpu_driver();
        assert_eq!(
            (driver.backend_name(), driver.device()),
            ("cuda", DeviceKind::Cuda(0))
        );
        let granularity = driver.granularity();
        assert!(granularity.is_power_of_two(), "{granularity}");
        let num_bytes = 2 * granularity;
        let va = driver.reserve(num_bytes).unwrap();
        assert_eq!(va % granularity, 0);
        let handle = driver.create(num_bytes, ExportTypes::NONE).unwrap();
        driver.map(va, num_bytes, handle).unwrap();
        driver.set_access(va, num_bytes).unwrap();
        fill(&driver, va, num_bytes, 0xab);
        // Unaligned at both ends: zeroing must stop exactly at the range, not at a word.
        driver
            .memset_zero(va + 1, num_bytes - 3, Stream::DEFAULT)
            .unwrap();
        driver.synchronize().unwrap();
        let bytes = read_back(&driver, va, num_bytes);
        let n = num_bytes as usize;
        assert_eq!((bytes[0], bytes[n - 2], bytes[n - 1]), (0xab, 0xab, 0xab));
        assert!(bytes[1..n - 2].iter().all(|&b| b == 0));
        driver.unmap(va, num_bytes).unwrap();
        driver.release(handle).unwrap();
        driver.free_reservation(va, num_bytes).unwrap();
        assert_eq!(driver.live_counts(), (0, 0, 0));
    }

    #[test]
    #[ignore = "needs a CUDA GPU with VMM: run with --include-ignored on one"]
    fn gpu_refuses_what_it_did_not_hand_out() {
        let driver = gpu_driver();
        let granularity = driver.granularity();
        let va = driver.reserve(2 * granularity).unwrap();
        let handle = driver.create(granularity, ExportTypes::NONE).unwrap();
        assert_refused(
            driver.map(va + 2 * granularity, granularity, handle),
            Op::Map,
        );
        assert_refused(driver.map(va, granularity, HandleId(handle.0 ^ 1)), Op::Map);
        assert_refused(driver.memset_zero(va, 4, Stream::DEFAULT), Op::Memset);
        driver.map(va, granularity, handle).unwrap();
        assert_refused(driver.memset_zero(va, 4, Stream::DEFAULT), Op::Memset);
        assert_refused(driver.set_access(va, 2 * granularity), Op::SetAccess);
        assert_refused(
            driver.free_reservation(va, 2 * granularity),
            Op::FreeReservation,
        );
        assert_refused(driver.release(HandleId(handle.0 ^ 1)), Op::Release);
        driver.unmap(va, granularity).unwrap();
        driver.release(handle).unwrap();
        assert_refused(driver.release(handle), Op::Release);
        driver.free_reservation(va, 2 * granularity).unwrap();
    }

    #[test]
    #[ignore = "needs a CUDA GPU with VMM: run with --include-ignored on one"]
    fn gpu_absurd_create_is_out_of_memory() {
        let driver = gpu_driver();
        let num_bytes = (1u64 << 50).next_multiple_of(driver.granularity());
        match driver.create(num_bytes, ExportTypes::NONE) {
            Err(Error::OutOfMemory {
                op,
                requested_bytes,
                free_bytes,
                code,
            }) => {
                assert_eq!((op, requested_bytes), (Op::Create, num_bytes));
                assert_eq!(code, "CUDA_ERROR_OUT_OF_MEMORY");
                assert!(free_bytes.is_some_and(|free| free < num_bytes));
            }
            Err(Error::Driver { code, .. }) => assert!(code.starts_with("CUDA_ERROR_"), "{code}"),
            Err(other) => panic!("unexpected error: {other}"),
            Ok(handle) => {
                driver.release(handle).unwrap();
                panic!("created 1 PiB");
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU with VMM: run with --include-ignored on one"]
    fn gpu_leaves_other_threads_contexts_alone() {
        let driver = gpu_driver();
        std::thread::spawn(move || {
            assert_eq!(result::ctx::get_current().unwrap(), None);
            let (free, total) = driver.mem_info().unwrap();
            assert!(0 < free && free <= total);
            assert_eq!(
                result::ctx::get_current().unwrap(),
                None,
                "binding was undone"
            );
        })
        .join()
        .unwrap();
    }

    #[test]
    #[ignore = "needs a CUDA GPU with VMM: run with --include-ignored on one"]
    fn gpu_drop_gives_back_what_owners_leaked() {
        let driver = gpu_driver();
        let granularity = driver.granularity();
        let va = driver.reserve(granularity).unwrap();
        let handle = driver.create(granularity, ExportTypes::NONE).unwrap();
        driver.map(va, granularity, handle).unwrap();
        driver.set_access(va, granularity).unwrap();
        driver
            .memset_zero(va, granularity, Stream::DEFAULT)
            .unwrap();
        drop(driver); // unmaps, releases and frees without a synchronize by the caller
        let again = CudaDriver::new(0).unwrap();
        again
            .synchronize()
            .expect("the context survived the cleanup");
    }
}
