//! The result layer for the VMM calls cudarc lacks: one wrapper per call, status → `Result`,
//! in cudarc's shape (`CUresult::result()`, `DriverError`).
//!
//! Every wrapper needs libcuda loaded with `context::REQUIRED_SYMBOLS` and `cuInit` done (see
//! `context::open`), and a context of the device bound on the calling thread. Those that only
//! query, or take fresh memory or address space, are safe; those that touch existing mappings
//! or handles are `unsafe fn`s whose `# Safety` says what `CudaDriver` checks in its books.
#![allow(unsafe_code)]

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{self, CUdeviceptr, CUmemGenericAllocationHandle as Handle};

pub fn device_location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

/// Pinned memory on device `ordinal`, exportable as the `export` bits of
/// `CUmemAllocationHandleType` (0: none; asking costs nothing at create time, while each
/// later export has the export cost, docs/design.md §2), registrable for GPUDirect RDMA when
/// `rdma`.
pub fn pinned_prop(ordinal: i32, export: u32, rdma: bool) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType(export),
        location: device_location(ordinal),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: u8::from(rdma),
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

pub fn create(num_bytes: usize, prop: &sys::CUmemAllocationProp) -> Result<Handle, DriverError> {
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
pub unsafe fn map(va: CUdeviceptr, num_bytes: usize, handle: Handle) -> Result<(), DriverError> {
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

/// # Safety
/// `[dst, dst + num_bytes)` and `[src, src + num_bytes)` must be covered by live read-write
/// mappings and must not overlap, and `stream` must be null or a live stream of the bound
/// context.
pub unsafe fn copy(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    num_bytes: usize,
    stream: sys::CUstream,
) -> Result<(), DriverError> {
    // SAFETY: the caller vouches for both ranges and the stream.
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, num_bytes, stream) }.result()
}

/// Waits for the work queued on `stream` so far: an event (no timing) recorded on it, waited
/// on, then destroyed, whatever the wait returned.
///
/// # Safety
/// `stream` must be null (the legacy default stream) or a live stream of the bound context.
pub unsafe fn fence(stream: sys::CUstream) -> Result<(), DriverError> {
    use cudarc::driver::result::event;
    let event = event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
    // SAFETY: `event` was just created in the bound context; the caller vouches for `stream`.
    let recorded = unsafe { event::record(event, stream) };
    let waited = match recorded {
        // SAFETY: `event` is live and recorded.
        Ok(()) => unsafe { event::synchronize(event) },
        Err(err) => Err(err),
    };
    // SAFETY: `event` is live and destroyed once; a pending event is released at completion.
    let destroyed = unsafe { event::destroy(event) };
    waited.and(destroyed)
}

/// An event recorded on `stream`, for another thread to wait on (`wait_event`): no timing, and
/// a blocking wait (the waiting thread sleeps rather than spin a core beside a decode loop).
///
/// # Safety
/// `stream` must be null (the legacy default stream) or a live stream of the bound context.
pub unsafe fn record_event(stream: sys::CUstream) -> Result<sys::CUevent, DriverError> {
    use cudarc::driver::result::event;
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
    let mut raw = std::ptr::null_mut();
    // SAFETY: `raw` outlives the call, which writes one CUevent through it.
    unsafe { sys::cuEventCreate(&mut raw, flags) }.result()?;
    // SAFETY: `raw` was just created in the bound context; the caller vouches for `stream`.
    match unsafe { event::record(raw, stream) } {
        Ok(()) => Ok(raw),
        Err(err) => {
            // SAFETY: `raw` is live, unrecorded and destroyed once.
            let _ = unsafe { event::destroy(raw) };
            Err(err)
        }
    }
}

/// # Safety
/// `event` must be a live event of the bound context (from `record_event`).
pub unsafe fn wait_event(event: sys::CUevent) -> Result<(), DriverError> {
    // SAFETY: the caller vouches for the event.
    unsafe { cudarc::driver::result::event::synchronize(event) }
}

/// # Safety
/// `event` must be a live event of the bound context, destroyed once, with no wait on it in
/// progress.
pub unsafe fn destroy_event(event: sys::CUevent) -> Result<(), DriverError> {
    // SAFETY: the caller vouches for the event.
    unsafe { cudarc::driver::result::event::destroy(event) }
}

/// # Safety
/// `handle` must be live and created with the POSIX fd handle type.
pub unsafe fn export_fd(handle: Handle) -> Result<std::os::fd::OwnedFd, DriverError> {
    use std::os::fd::FromRawFd;
    let mut fd: std::ffi::c_int = -1;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: for this handle type the driver writes one int through the pointer, which
    // outlives the call; the caller vouches for the handle.
    unsafe { sys::cuMemExportToShareableHandle((&raw mut fd).cast(), handle, kind, 0) }.result()?;
    // SAFETY: on success the driver handed us a new fd that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// # Safety
/// `handle` must be live and created with the fabric handle type.
pub unsafe fn export_fabric(handle: Handle) -> Result<[u8; 64], DriverError> {
    let mut fabric = sys::CUmemFabricHandle { data: [0; 64] };
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
    // SAFETY: for this handle type the driver writes one 64-byte CUmemFabricHandle through the
    // pointer, which outlives the call; the caller vouches for the handle.
    unsafe { sys::cuMemExportToShareableHandle((&raw mut fabric).cast(), handle, kind, 0) }
        .result()?;
    Ok(fabric.data)
}

pub fn import_fd(fd: std::os::fd::BorrowedFd<'_>) -> Result<Handle, DriverError> {
    use std::os::fd::AsRawFd;
    let mut handle = 0;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // The fd travels as the pointer's value, as CUDA's API takes it; the driver duplicates
    // what it needs and does not keep or close the fd.
    let os_handle = fd.as_raw_fd() as isize as *mut std::ffi::c_void;
    // SAFETY: `handle` outlives the call; `fd` is borrowed live for the call; an fd that is
    // not an exported allocation is refused with a status.
    unsafe { sys::cuMemImportFromShareableHandle(&mut handle, os_handle, kind) }.result()?;
    Ok(handle)
}

pub fn import_fabric(fabric: &[u8; 64]) -> Result<Handle, DriverError> {
    let mut handle = 0;
    let mut data = sys::CUmemFabricHandle { data: *fabric };
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
    // SAFETY: `handle` and `data` outlive the call; the driver reads 64 bytes from `data` and
    // refuses ones that name no exported allocation.
    unsafe { sys::cuMemImportFromShareableHandle(&mut handle, (&raw mut data).cast(), kind) }
        .result()?;
    Ok(handle)
}
