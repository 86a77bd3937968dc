//! DLPack export of a tensor's bytes: the C structs (DLPack 1.x, and the legacy unversioned
//! form for old consumers) and their deleters. Knows nothing of Python: the bindings wrap the
//! pointer in a capsule.
//!
//! Every export is a 1-D `uint8` tensor; consumers reinterpret dtype, shape and strides
//! themselves (torch: `.view(dtype).as_strided(...)`), which keeps this unsafe surface to one
//! shape. Any offset goes into `data`, with `byte_offset` 0, because torch ignores
//! `byte_offset`. The managed struct owns a `ViewGuard`, so the memory lives until the
//! consumer calls the deleter — on any thread, with or without the GIL: it only drops a box.
#![allow(unsafe_code)]

use std::ffi::c_void;

use crate::tensor::{ExportedRegion, ViewGuard};

pub const DLPACK_MAJOR: u32 = 1;
pub const DLPACK_MINOR: u32 = 1;
/// `DLDataTypeCode::kDLUInt`.
const KDL_UINT: u8 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLPackVersion {
    pub major: u32,
    pub minor: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

#[repr(C)]
pub struct DLManagedTensorVersioned {
    pub version: DLPackVersion,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    pub flags: u64,
    pub dl_tensor: DLTensor,
}

#[repr(C)]
pub struct DLManagedTensor {
    pub dl_tensor: DLTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// The heap block behind one export: the managed struct first (consumers get a pointer to it),
/// then the arrays it points into and the guard that keeps the memory alive.
#[repr(C)]
struct Holder<M> {
    managed: M,
    shape: [i64; 1],
    strides: [i64; 1],
    _guard: ViewGuard,
}

fn dl_tensor(region: &ExportedRegion) -> DLTensor {
    let (device_type, device_id) = region.device.dlpack();
    DLTensor {
        data: region.ptr as *mut c_void,
        device: DLDevice {
            device_type,
            device_id,
        },
        ndim: 1,
        dtype: DLDataType {
            code: KDL_UINT,
            bits: 8,
            lanes: 1,
        },
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// Boxes `holder` and points its tensor's shape and strides into the box.
fn into_raw<M>(holder: Holder<M>, tensor: impl Fn(&mut M) -> &mut DLTensor) -> *mut M {
    let raw = Box::into_raw(Box::new(holder));
    // SAFETY: `raw` comes from Box::into_raw just above, so it is valid and unaliased; the
    // shape and strides pointers point into the same allocation, which lives until the deleter.
    unsafe {
        let t = tensor(&mut (*raw).managed);
        t.shape = (*raw).shape.as_mut_ptr();
        t.strides = (*raw).strides.as_mut_ptr();
    }
    raw.cast::<M>()
}

fn len_i64(region: &ExportedRegion) -> i64 {
    i64::try_from(region.num_bytes).expect("a reservation is far below 2^63 bytes")
}

/// A DLPack 1.x managed tensor; the consumer must call its deleter exactly once.
pub fn export_versioned(region: ExportedRegion) -> *mut DLManagedTensorVersioned {
    let managed = DLManagedTensorVersioned {
        version: DLPackVersion {
            major: DLPACK_MAJOR,
            minor: DLPACK_MINOR,
        },
        manager_ctx: std::ptr::null_mut(),
        deleter: Some(delete_versioned),
        flags: 0,
        dl_tensor: dl_tensor(&region),
    };
    let holder = Holder {
        managed,
        shape: [len_i64(&region)],
        strides: [1],
        _guard: region.guard,
    };
    into_raw(holder, |m| &mut m.dl_tensor)
}

/// A legacy (pre-1.0) managed tensor; the consumer must call its deleter exactly once.
pub fn export_legacy(region: ExportedRegion) -> *mut DLManagedTensor {
    let managed = DLManagedTensor {
        dl_tensor: dl_tensor(&region),
        manager_ctx: std::ptr::null_mut(),
        deleter: Some(delete_legacy),
    };
    let holder = Holder {
        managed,
        shape: [len_i64(&region)],
        strides: [1],
        _guard: region.guard,
    };
    into_raw(holder, |m| &mut m.dl_tensor)
}

/// # Safety
/// `managed` must come from `export_versioned` and not have been deleted before.
unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: per the contract, `managed` is the first field of a live boxed Holder.
    drop(unsafe { Box::from_raw(managed.cast::<Holder<DLManagedTensorVersioned>>()) });
}

/// # Safety
/// `managed` must come from `export_legacy` and not have been deleted before.
unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    // SAFETY: per the contract, `managed` is the first field of a live boxed Holder.
    drop(unsafe { Box::from_raw(managed.cast::<Holder<DLManagedTensor>>()) });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::host::HostDriver;
    use crate::tensor::{ExtensibleTensor, Options};
    use std::sync::Arc;

    #[test]
    fn deleter_keeps_then_frees_the_memory() {
        let driver = Arc::new(HostDriver::new(4096).unwrap());
        let tensor =
            ExtensibleTensor::with_equal_segments(driver, 8192, 1, Options::default()).unwrap();
        tensor.resize_per_segment(100, true, 0).unwrap();
        let managed = export_versioned(tensor.export(10, 50).unwrap());
        assert_eq!(tensor.live_views(), 1);
        // SAFETY: `managed` is a live export; we read it, then delete it exactly once.
        unsafe {
            let t = &(*managed).dl_tensor;
            assert_eq!(t.data as u64, tensor.base_ptr().unwrap() + 10);
            assert_eq!(*t.shape, 50);
            assert_eq!(
                (t.dtype.code, t.dtype.bits, t.dtype.lanes),
                (KDL_UINT, 8, 1)
            );
            ((*managed).deleter.unwrap())(managed);
        }
        assert_eq!(tensor.live_views(), 0);
        tensor.close().unwrap();
    }
}
