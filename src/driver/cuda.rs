//! The CUDA backend: CUDA's virtual-memory-management (VMM) driver API on one device.
//!
//! Layers, as in cudarc: cudarc's `sys` is the raw FFI (libcuda is loaded at run time, so
//! building needs no CUDA); cudarc's `result` wraps the calls it knows (init, devices, contexts,
//! `cuMemGetInfo`); the `vmm` module below adds the same one-call wrappers for the VMM calls
//! cudarc lacks; `CudaDriver` keeps the books and turns statuses into this crate's `Error`.
//!
//! - Context: the device's primary context, the one torch's runtime uses, retained for the
//!   driver's life. Callers can be any thread (Python threads, rayon), so each operation binds it
//!   on the calling thread and then puts back whatever was bound there before: the runtime reads
//!   the current context as the thread's current device, and we must not change it under torch.
//! - Loading: cudarc panics when libcuda or one of its symbols is missing, so `open` checks both
//!   before the first `sys` call. No driver is `Error::Unsupported`, never a panic.
//! - Soundness: libcuda does not promise to reject every bad argument: a memset is device work,
//!   so a bad range can surface later as an illegal-address fault that poisons the context for
//!   every library in the process, and an unknown allocation handle is not documented to be
//!   caught. So, as in the host backend, every range and handle is checked against this driver's
//!   books (live reservations, mappings and handles) before it reaches libcuda. The one argument
//!   taken on trust is `memset_zero`'s stream, which only its creator (torch) can vouch for.
#![allow(unsafe_code)]

use std::sync::{Mutex, MutexGuard, PoisonError};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::books::Books;
use super::{DeviceKind, Driver, HandleId};
use crate::error::{Error, Op, Result};

// Sizes cross the trait as u64 and libcuda as usize; the casts below rely on equal widths.
const _: () = assert!(usize::BITS == u64::BITS);

/// Every libcuda symbol this backend calls: cudarc panics on the first call of a missing one.
const REQUIRED_SYMBOLS: [&str; 20] = [
    "cuInit",
    "cuGetErrorName",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuMemGetInfo_v2",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemsetD8Async",
];

/// The result layer: one wrapper per VMM call, status → `Result`, in cudarc's shape.
///
/// All of them need libcuda loaded with `REQUIRED_SYMBOLS` and `cuInit` done (see `open`), and
/// a context of the device bound on the calling thread.
mod vmm {
    use cudarc::driver::result::DriverError;
    use cudarc::driver::sys::{self, CUdeviceptr, CUmemGenericAllocationHandle as Handle};

    pub fn device_location(ordinal: i32) -> sys::CUmemLocation {
        sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        }
    }

    /// Pinned memory on device `ordinal`, exportable as nothing: an fd handle type would make
    /// every later export cost ~0.57 ms, and nothing here shares memory across processes.
    pub fn pinned_prop(ordinal: i32) -> sys::CUmemAllocationProp {
        sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: device_location(ordinal),
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        }
    }

    pub fn granularity(prop: &sys::CUmemAllocationProp) -> Result<usize, DriverError> {
        let mut granularity = 0;
        let option = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: both pointers are to values that outlive the call; the query writes only
        // `granularity`.
        unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, prop, option) }.result()?;
        Ok(granularity)
    }

    pub fn address_reserve(num_bytes: usize, alignment: usize) -> Result<CUdeviceptr, DriverError> {
        let mut va = 0;
        // SAFETY: `va` outlives the call; address 0 and flags 0 ask for fresh address space
        // anywhere, which cannot overlap anything already in use.
        unsafe { sys::cuMemAddressReserve(&mut va, num_bytes, alignment, 0, 0) }.result()?;
        Ok(va)
    }

    /// # Safety
    /// `[va, va + num_bytes)` must be exactly one live reservation with nothing mapped in it.
    pub unsafe fn address_free(va: CUdeviceptr, num_bytes: usize) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the range is a whole, empty, live reservation.
        unsafe { sys::cuMemAddressFree(va, num_bytes) }.result()
    }

    pub fn create(
        num_bytes: usize,
        prop: &sys::CUmemAllocationProp,
    ) -> Result<Handle, DriverError> {
        let mut handle = 0;
        // SAFETY: `handle` and `prop` outlive the call; creating takes new physical memory and
        // maps nothing, so no existing memory is touched.
        unsafe { sys::cuMemCreate(&mut handle, num_bytes, prop, 0) }.result()?;
        Ok(handle)
    }

    /// # Safety
    /// `handle` must come from `create` and not have been released.
    pub unsafe fn release(handle: Handle) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle is live; its memory lives on while mapped.
        unsafe { sys::cuMemRelease(handle) }.result()
    }

    /// # Safety
    /// `handle` must be live and `num_bytes` long; `[va, va + num_bytes)` must lie inside a live
    /// reservation and overlap no mapping.
    pub unsafe fn map(
        va: CUdeviceptr,
        num_bytes: usize,
        handle: Handle,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees a live handle of this size over free reserved space;
        // offset 0 because the driver refuses partial maps anyway (docs/design.md §2).
        unsafe { sys::cuMemMap(va, num_bytes, 0, handle, 0) }.result()
    }

    /// # Safety
    /// `[va, va + num_bytes)` must be tiled by whole live mappings.
    pub unsafe fn unmap(va: CUdeviceptr, num_bytes: usize) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the range is whole mappings of its own.
        unsafe { sys::cuMemUnmap(va, num_bytes) }.result()
    }

    /// # Safety
    /// `[va, va + num_bytes)` must be tiled by whole live mappings.
    pub unsafe fn set_access(
        va: CUdeviceptr,
        num_bytes: usize,
        location: sys::CUmemLocation,
    ) -> Result<(), DriverError> {
        let flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        let desc = sys::CUmemAccessDesc { location, flags };
        // SAFETY: the caller guarantees whole mappings; `desc` is one descriptor that outlives
        // the call, matching count 1.
        unsafe { sys::cuMemSetAccess(va, num_bytes, &desc, 1) }.result()
    }

    /// Byte stores, whatever the alignment: on an H200 cuMemsetD8Async zeroes as fast as
    /// cuMemsetD32Async (4.55 TB/s on 16 GiB, 4.43 on 1 GiB, for both and for an unaligned
    /// start), so splitting off aligned words would only add launches.
    ///
    /// # Safety
    /// `[va, va + num_bytes)` must be covered by live read-write mappings, and `stream` must be
    /// null (the legacy default stream) or a live stream of the bound context.
    pub unsafe fn memset_zero(
        va: CUdeviceptr,
        num_bytes: usize,
        stream: sys::CUstream,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller vouches for the range and the stream.
        unsafe { sys::cuMemsetD8Async(va, 0, num_bytes, stream) }.result()
    }
}

/// The name libcuda gives a status, e.g. `CUDA_ERROR_INVALID_VALUE`.
fn code_name(err: DriverError) -> String {
    match err.error_name() {
        Ok(name) => name.to_string_lossy().into_owned(),
        // cuGetErrorName fails only for statuses it does not know; bindgen's name will do.
        Err(_) => format!("{:?}", err.0),
    }
}

trait OnOp<T> {
    /// This crate's error for a failed `op`; `detail` is built only on failure.
    fn on(self, op: Op, detail: impl FnOnce() -> String) -> Result<T>;
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

/// The device's primary context, retained: the context torch's runtime uses on that device.
struct PrimaryContext {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUcontext is an opaque driver handle that CUDA lets any thread bind, several at
// once; this type never dereferences it and only passes it to cuCtxSetCurrent, and it is
// released exactly once, in Drop.
unsafe impl Send for PrimaryContext {}
// SAFETY: as for Send: shared use is only cuCtxSetCurrent, which the driver makes thread-safe.
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    fn retain(device: sys::CUdevice) -> Result<PrimaryContext, DriverError> {
        // SAFETY: `device` came from cuDeviceGet on an initialised driver.
        let ctx = unsafe { result::primary_ctx::retain(device) }?;
        Ok(PrimaryContext { device, ctx })
    }

    /// Binds the context on the calling thread until the guard drops.
    fn bind(&self) -> Result<Bound, DriverError> {
        let current = result::ctx::get_current()?;
        if current == Some(self.ctx) {
            return Ok(Bound { previous: None });
        }
        // SAFETY: `self.ctx` stays retained until `self` drops, and `self` outlives this call.
        unsafe { result::ctx::set_current(self.ctx) }?;
        Ok(Bound {
            previous: Some(current.unwrap_or(std::ptr::null_mut())),
        })
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: retained once in `retain`, released once here; nothing can bind it through
        // this value any more.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

/// Puts back the thread's previous context (null: none) if `bind` changed it. A raw pointer
/// inside keeps it `!Send`, so it drops on the thread that bound.
struct Bound {
    previous: Option<sys::CUcontext>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: `previous` was bound on this thread when the guard was made; rebinding it
            // is wrong only if its owner destroyed it meanwhile, which CUDA forbids while the
            // context may be in use by another caller.
            let _ = unsafe { result::ctx::set_current(previous) };
        }
    }
}

/// Loads libcuda and checks it has every symbol this backend calls.
fn load_libcuda() -> Result<(), String> {
    // SAFETY: only opens and closes the candidate libraries; loading runs libcuda's
    // initialisers, which are made to run in any process.
    if !unsafe { sys::is_culib_present() } {
        let tried = cudarc::get_lib_name_candidates("cuda");
        return Err(format!(
            "libcuda not found (tried {} names such as libcuda.so.1): install the NVIDIA driver \
             or put its directory on LD_LIBRARY_PATH",
            tried.len()
        ));
    }
    // cudarc panics if the library went away since the check; that must not reach callers.
    // SAFETY: as above; the library stays loaded for the process's life.
    let lib = std::panic::catch_unwind(|| unsafe { sys::culib() })
        .map_err(|_| "libcuda was found but could not be loaded".to_string())?;
    // SAFETY: symbols are only looked up, never called through this placeholder type.
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .into_iter()
        .filter(|name| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "libcuda lacks {missing:?}: the NVIDIA driver is too old for VMM"
        ));
    }
    Ok(())
}

fn find_device(ordinal: i32) -> Result<sys::CUdevice, String> {
    let count = result::device::get_count()
        .map_err(|e| format!("cuDeviceGetCount failed with {}", code_name(e)))?;
    if !(0..count).contains(&ordinal) {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES")
            .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})"))
            .unwrap_or_default();
        return Err(format!(
            "no CUDA device {ordinal}: {count} device(s) visible{visible}"
        ));
    }
    result::device::get(ordinal)
        .map_err(|e| format!("cuDeviceGet({ordinal}) failed with {}", code_name(e)))
}

fn check_vmm_support(device: sys::CUdevice, ordinal: i32) -> Result<(), String> {
    let attribute =
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
    // SAFETY: `device` came from cuDeviceGet; the query writes only its result.
    let supported = unsafe { result::device::get_attribute(device, attribute) }.map_err(|e| {
        format!(
            "querying VMM support of CUDA device {ordinal}: {}",
            code_name(e)
        )
    })?;
    if supported == 0 {
        return Err(format!(
            "CUDA device {ordinal} does not support virtual memory management \
             (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)"
        ));
    }
    Ok(())
}

/// Everything a working device needs, in order; `Err` is the first reason it cannot be used.
fn open(ordinal: i32) -> Result<(PrimaryContext, u64), String> {
    load_libcuda()?;
    result::init().map_err(|e| format!("cuInit failed with {}", code_name(e)))?;
    let device = find_device(ordinal)?;
    check_vmm_support(device, ordinal)?;
    let primary = PrimaryContext::retain(device).map_err(|e| {
        format!(
            "retaining the primary context of CUDA device {ordinal}: {}",
            code_name(e)
        )
    })?;
    let granularity = primary
        .bind()
        .and_then(|_bound| vmm::granularity(&vmm::pinned_prop(ordinal)))
        .map_err(|e| format!("cuMemGetAllocationGranularity failed with {}", code_name(e)))?;
    Ok((primary, granularity as u64))
}

/// `None` when CUDA's VMM API works on device `ordinal`; otherwise why not, in words fit for a
/// user (no driver, cuInit's status, no such device, no VMM support, no context). Never panics.
///
/// It retains the primary context and lets it go: when nothing else holds that context, this
/// creates and destroys it, so prefer `CudaDriver::new`, which probes the same way and keeps it.
pub fn vmm_unavailable_reason(ordinal: i32) -> Option<String> {
    open(ordinal).err()
}

/// CUDA's VMM API on one device, through its primary context.
pub struct CudaDriver {
    ordinal: i32,
    granularity: u64,
    books: Mutex<Books<()>>,
    /// Last, so it is released after `Drop` has cleaned up with it.
    primary: PrimaryContext,
}

impl CudaDriver {
    /// Opens device `ordinal`: `Error::Unsupported` with `vmm_unavailable_reason`'s words when
    /// it cannot work.
    pub fn new(ordinal: i32) -> Result<CudaDriver> {
        let (primary, granularity) = open(ordinal).map_err(Error::Unsupported)?;
        Ok(CudaDriver {
            ordinal,
            granularity,
            books: Mutex::default(),
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
        let mut books = self.books();
        if let Some(why) = books.refuse_free(va, num_bytes) {
            return Err(refused(Op::FreeReservation, va, num_bytes, why));
        }
        // SAFETY: the range is exactly one live reservation with nothing mapped in it, both
        // checked under the lock that every map takes.
        unsafe { vmm::address_free(va, num_bytes as usize) }.on(Op::FreeReservation, || {
            format!("{num_bytes} bytes at {va:#x}")
        })?;
        books.reservations.remove(&va);
        Ok(())
    }

    fn create(&self, num_bytes: u64) -> Result<HandleId> {
        let _bound = self.bind(Op::Create)?;
        let handle = match vmm::create(num_bytes as usize, &vmm::pinned_prop(self.ordinal)) {
            Ok(handle) => handle,
            Err(err) if err.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                return Err(self.out_of_memory(err, num_bytes))
            }
            Err(err) => return Err(err).on(Op::Create, || format!("{num_bytes} bytes")),
        };
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
        let mut books = self.books();
        if let Some(why) = books.refuse_map(va, num_bytes, handle.0) {
            return Err(refused(Op::Map, va, num_bytes, &why));
        }
        // SAFETY: `refuse_map` found a live handle of exactly this size and a range inside one
        // of our reservations that overlaps no mapping.
        unsafe { vmm::map(va, num_bytes as usize, handle.0) }
            .on(Op::Map, || format!("{num_bytes} bytes at {va:#x}"))?;
        books.mappings.insert(va, (num_bytes, false));
        Ok(())
    }

    fn unmap(&self, va: u64, num_bytes: u64) -> Result<()> {
        let _bound = self.bind(Op::Unmap)?;
        let mut books = self.books();
        let Some(starts) = books.tiling(va, num_bytes) else {
            return Err(refused(
                Op::Unmap,
                va,
                num_bytes,
                "does not cover whole mappings",
            ));
        };
        // SAFETY: whole live mappings of ours tile the range. Device work still touching it is
        // the owner's to fence; if it did not, the kernel faults, host memory is untouched.
        unsafe { vmm::unmap(va, num_bytes as usize) }
            .on(Op::Unmap, || format!("{num_bytes} bytes at {va:#x}"))?;
        for start in starts {
            books.mappings.remove(&start);
        }
        Ok(())
    }

    fn set_access(&self, va: u64, num_bytes: u64) -> Result<()> {
        let _bound = self.bind(Op::SetAccess)?;
        let mut books = self.books();
        let Some(starts) = books.tiling(va, num_bytes) else {
            return Err(refused(
                Op::SetAccess,
                va,
                num_bytes,
                "is not wholly mapped",
            ));
        };
        let location = vmm::device_location(self.ordinal);
        // SAFETY: whole live mappings of ours tile the range.
        unsafe { vmm::set_access(va, num_bytes as usize, location) }
            .on(Op::SetAccess, || format!("{num_bytes} bytes at {va:#x}"))?;
        for start in starts {
            books
                .mappings
                .entry(start)
                .and_modify(|(_, accessible)| *accessible = true);
        }
        Ok(())
    }

    fn memset_zero(&self, va: u64, num_bytes: u64, stream: u64) -> Result<()> {
        if num_bytes == 0 {
            return Ok(());
        }
        let _bound = self.bind(Op::Memset)?;
        let books = self.books();
        if !books.accessible(va, num_bytes) {
            return Err(refused(
                Op::Memset,
                va,
                num_bytes,
                "is not mapped read-write",
            ));
        }
        // SAFETY: accessible mappings of ours cover the range, and the lock held until the
        // enqueue returns keeps any unmap out; `stream` is the caller's (0: legacy default).
        unsafe { vmm::memset_zero(va, num_bytes as usize, stream as usize as sys::CUstream) }
            .on(Op::Memset, || {
                format!("{num_bytes} bytes at {va:#x}, stream {stream:#x}")
            })
    }

    fn synchronize(&self) -> Result<()> {
        let _bound = self.bind(Op::Synchronize)?;
        result::ctx::synchronize().on(Op::Synchronize, || format!("device {}", self.ordinal))
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

    /// A driver on device 0, or `None` (with a note) on machines without a usable GPU.
    fn gpu_driver() -> Option<CudaDriver> {
        if let Some(reason) = vmm_unavailable_reason(0) {
            eprintln!("skipping GPU test: {reason}");
            return None;
        }
        Some(CudaDriver::new(0).expect("probe passed"))
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
        let Some(reason) = vmm_unavailable_reason(0) else {
            return eprintln!("device 0 is usable; nothing to check");
        };
        match CudaDriver::new(0) {
            Err(Error::Unsupported(message)) => assert_eq!(message, reason),
            Err(other) => panic!("expected Unsupported, got {other}"),
            Ok(_) => panic!("expected Unsupported ({reason}), got a driver"),
        }
        assert!(matches!(
            CudaDriver::new(i32::MAX),
            Err(Error::Unsupported(_))
        ));
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
    fn gpu_round_trip_of_two_granules() {
        let Some(driver) = gpu_driver() else { return };
        assert_eq!(
            (driver.backend_name(), driver.device()),
            ("cuda", DeviceKind::Cuda(0))
        );
        let granularity = driver.granularity();
        assert!(granularity.is_power_of_two(), "{granularity}");
        let num_bytes = 2 * granularity;
        let va = driver.reserve(num_bytes).unwrap();
        assert_eq!(va % granularity, 0);
        let handle = driver.create(num_bytes).unwrap();
        driver.map(va, num_bytes, handle).unwrap();
        driver.set_access(va, num_bytes).unwrap();
        fill(&driver, va, num_bytes, 0xab);
        // Unaligned at both ends: zeroing must stop exactly at the range, not at a word.
        driver.memset_zero(va + 1, num_bytes - 3, 0).unwrap();
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
    fn gpu_refuses_what_it_did_not_hand_out() {
        let Some(driver) = gpu_driver() else { return };
        let granularity = driver.granularity();
        let va = driver.reserve(2 * granularity).unwrap();
        let handle = driver.create(granularity).unwrap();
        assert_refused(
            driver.map(va + 2 * granularity, granularity, handle),
            Op::Map,
        );
        assert_refused(driver.map(va, granularity, HandleId(handle.0 ^ 1)), Op::Map);
        assert_refused(driver.memset_zero(va, 4, 0), Op::Memset);
        driver.map(va, granularity, handle).unwrap();
        assert_refused(driver.memset_zero(va, 4, 0), Op::Memset);
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
    fn gpu_absurd_create_is_out_of_memory() {
        let Some(driver) = gpu_driver() else { return };
        let num_bytes = (1u64 << 50).next_multiple_of(driver.granularity());
        match driver.create(num_bytes) {
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
    fn gpu_leaves_other_threads_contexts_alone() {
        let Some(driver) = gpu_driver() else { return };
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
    fn gpu_drop_gives_back_what_owners_leaked() {
        let Some(driver) = gpu_driver() else { return };
        let granularity = driver.granularity();
        let va = driver.reserve(granularity).unwrap();
        let handle = driver.create(granularity).unwrap();
        driver.map(va, granularity, handle).unwrap();
        driver.set_access(va, granularity).unwrap();
        driver.memset_zero(va, granularity, 0).unwrap();
        drop(driver); // unmaps, releases and frees without a synchronize by the caller
        let again = CudaDriver::new(0).unwrap();
        again
            .synchronize()
            .expect("the context survived the cleanup");
    }
}
