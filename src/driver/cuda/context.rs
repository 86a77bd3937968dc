//! Loading libcuda, probing a device, and binding its primary context.
//!
//! - Loading: cudarc panics when libcuda or one of its symbols is missing, so `open` checks both
//!   before the first `sys` call. No driver is a reason in words, never a panic.
//! - Context: the device's primary context, the one torch's runtime uses, retained for the
//!   driver's life. Callers can be any thread (Python threads, rayon), so each operation binds it
//!   on the calling thread and then puts back whatever was bound there before: the runtime reads
//!   the current context as the thread's current device, and we must not change it under torch.
#![allow(unsafe_code)]

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::{code_name, vmm};

/// Every libcuda symbol this backend calls: cudarc panics on the first call of a missing one.
const REQUIRED_SYMBOLS: [&str; 27] = [
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
    "cuMemcpyDtoDAsync_v2",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
];

/// The device's primary context, retained: the context torch's runtime uses on that device.
pub(super) struct PrimaryContext {
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
    pub(super) fn bind(&self) -> Result<Bound, DriverError> {
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
pub(super) struct Bound {
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

/// What a device can do with exported memory, from its attributes (a failed query reads as
/// "cannot").
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ExportSupport {
    pub posix_fd: bool,
    /// The device attribute and an IMEX channel this process can open: a fabric allocation
    /// needs both (without a channel, cuMemCreate says CUDA_ERROR_NOT_PERMITTED), and even
    /// both do not guarantee one, so `CudaDriver::create` still falls back.
    pub fabric: bool,
    /// GPUDirect RDMA on VMM allocations: `gpuDirectRDMACapable` may be asked for.
    pub rdma_with_vmm: bool,
}

impl PrimaryContext {
    pub(super) fn export_support(&self) -> ExportSupport {
        use sys::CUdevice_attribute as A;
        let device = self.device;
        let has = |attribute| {
            // SAFETY: `device` came from cuDeviceGet; the query writes only its result.
            unsafe { result::device::get_attribute(device, attribute) }.is_ok_and(|v| v != 0)
        };
        ExportSupport {
            posix_fd: has(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED),
            fabric: has(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)
                && imex_channel_available(),
            rdma_with_vmm: has(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED),
        }
    }
}

/// Whether this process can open an IMEX channel (as vLLM checks): the files alone do not
/// tell, since a container's device cgroup can still deny them.
fn imex_channel_available() -> bool {
    const CHANNELS: &str = "/dev/nvidia-caps-imex-channels";
    std::fs::read_dir(CHANNELS).is_ok_and(|entries| {
        entries.flatten().any(|entry| {
            entry.file_name().to_string_lossy().starts_with("channel")
                && std::fs::File::open(entry.path()).is_ok()
        })
    })
}

/// Everything a working device needs, in order; `Err` is the first reason it cannot be used.
pub(super) fn open(ordinal: i32) -> Result<(PrimaryContext, u64), String> {
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
        .and_then(|_bound| vmm::granularity(&vmm::pinned_prop(ordinal, 0, false)))
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
