//! DLPack views of a tensor's bytes: the C structs (DLPack 1.x, and the legacy unversioned
//! form for old consumers) and their deleters. Knows nothing of Python: the bindings wrap the
//! pointer in a capsule.
//!
//! A view carries its dtype, shape and strides (`StridedLayout`), so a consumer builds the
//! final view in one step — torch's `from_dlpack` then costs one call, not three. Any offset
//! goes into `data`, with `byte_offset` 0, because torch ignores `byte_offset`.
//!
//! Soundness: a consumer may touch every byte the layout addresses, so a view is made only
//! here, from the tensor itself, over exactly the layout's extent: `ExtensibleTensor::view`
//! checks that range against the capacity and hands back the region whose guard the managed
//! struct then owns, so the memory lives until the consumer calls the deleter — on any thread,
//! with or without the GIL: it only drops a box.
#![allow(unsafe_code)]

use std::ffi::c_void;

use crate::error::{Error, Result};
use crate::tensor::{ExtensibleTensor, ViewRegion};

/// The DLPack version this crate implements: 1.x (`DLManagedTensorVersioned`).
pub const DLPACK_MAJOR: u32 = 1;
/// The DLPack minor version this crate implements.
pub const DLPACK_MINOR: u32 = 1;
/// `DLDataTypeCode::kDLUInt`.
pub const KDL_UINT: u8 = 1;

/// Element type, shape and strides (in elements) of a view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StridedLayout {
    /// The element type.
    pub dtype: DLDataType,
    /// Elements along each dim.
    pub shape: Vec<i64>,
    /// Elements between neighbours along each dim (not bytes, as in DLPack).
    pub strides: Vec<i64>,
}

impl StridedLayout {
    /// `num_bytes` bytes as a 1-D `uint8` tensor.
    pub fn bytes(num_bytes: u64) -> Result<StridedLayout> {
        let dtype = DLDataType {
            code: KDL_UINT,
            bits: 8,
            lanes: 1,
        };
        let len = i64::try_from(num_bytes)
            .map_err(|_| Error::invalid(format!("{num_bytes} bytes is too large a view")))?;
        StridedLayout::new(dtype, vec![len], vec![1])
    }

    /// Checks that sizes and strides are non-negative, agree in length, and that the item
    /// size is a whole number of bytes.
    pub fn new(dtype: DLDataType, shape: Vec<i64>, strides: Vec<i64>) -> Result<StridedLayout> {
        check_dims(&shape, &strides)?;
        if dtype.bits == 0 || dtype.bits % 8 != 0 || dtype.lanes != 1 {
            return Err(Error::invalid(format!(
                "unsupported element type {dtype:?}"
            )));
        }
        Ok(StridedLayout {
            dtype,
            shape,
            strides,
        })
    }

    /// Bytes per element.
    pub fn itemsize(&self) -> u64 {
        u64::from(self.dtype.bits / 8)
    }

    /// The bytes the view can address, from its first element: 0 if any dim is empty.
    pub fn extent_bytes(&self) -> Result<u64> {
        extent_bytes(&self.shape, &self.strides, self.itemsize())
    }
}

fn check_dims(shape: &[i64], strides: &[i64]) -> Result<()> {
    if shape.len() != strides.len() {
        return Err(Error::invalid(format!(
            "shape {shape:?} and strides {strides:?} differ in length"
        )));
    }
    if shape.iter().chain(strides).any(|&v| v < 0) {
        return Err(Error::invalid(format!(
            "shape {shape:?} and strides {strides:?} must be non-negative"
        )));
    }
    Ok(())
}

/// The bytes a view of `shape` and `strides` (in items of `itemsize` bytes) can address, from
/// its first element: 0 if any dim is empty. Sizes and strides must be non-negative.
pub fn extent_bytes(shape: &[i64], strides: &[i64], itemsize: u64) -> Result<u64> {
    check_dims(shape, strides)?;
    if shape.contains(&0) {
        return Ok(0);
    }
    let overflow = || Error::invalid(format!("a view of shape {shape:?} is too large"));
    let mut last: u64 = 0;
    for (&n, &stride) in shape.iter().zip(strides) {
        let step = ((n - 1) as u64)
            .checked_mul(stride as u64)
            .ok_or_else(overflow)?;
        last = last.checked_add(step).ok_or_else(overflow)?;
    }
    last.checked_add(1)
        .and_then(|e| e.checked_mul(itemsize))
        .ok_or_else(overflow)
}

/// `DLPackVersion`: the ABI version of a versioned view.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLPackVersion {
    /// Incompatible changes.
    pub major: u32,
    /// Compatible additions.
    pub minor: u32,
}

/// `DLDevice`: where the memory lives (see `DeviceKind::dlpack`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLDevice {
    /// `kDLCPU` (1) or `kDLCUDA` (2).
    pub device_type: i32,
    /// The device ordinal (0 on the host).
    pub device_id: i32,
}

/// `DLDataType`: an element type.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    /// `DLDataTypeCode`: signed int, unsigned int, float, bfloat, bool, ...
    pub code: u8,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes per element; 1 (no vector types are handed out).
    pub lanes: u16,
}

/// `DLTensor`: a strided view of memory.
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    /// The first element's address (offsets go here, as torch ignores `byte_offset`).
    pub data: *mut c_void,
    /// Where `data` lives.
    pub device: DLDevice,
    /// The number of dims: the length of `shape` and `strides`.
    pub ndim: i32,
    /// The element type.
    pub dtype: DLDataType,
    /// `ndim` sizes, owned by the view's holder.
    pub shape: *mut i64,
    /// `ndim` strides in elements, owned by the view's holder.
    pub strides: *mut i64,
    /// Always 0 (see `data`).
    pub byte_offset: u64,
}

/// `DLManagedTensorVersioned` (DLPack 1.x): a tensor and the deleter that releases it.
#[repr(C)]
pub struct DLManagedTensorVersioned {
    /// The ABI version of this struct.
    pub version: DLPackVersion,
    /// The holder of the view (its guard keeps the memory alive).
    pub manager_ctx: *mut c_void,
    /// Called once by the consumer when done: frees the holder, dropping its guard.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `DLPACK_FLAG_BITMASK_*`: 0 (writable, not a copy).
    pub flags: u64,
    /// The tensor itself.
    pub dl_tensor: DLTensor,
}

/// `DLManagedTensor` (legacy, pre-1.0): a tensor and the deleter that releases it.
#[repr(C)]
pub struct DLManagedTensor {
    /// The tensor itself.
    pub dl_tensor: DLTensor,
    /// The holder of the view (its guard keeps the memory alive).
    pub manager_ctx: *mut c_void,
    /// Called once by the consumer when done: frees the holder, dropping its guard.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// The heap block behind one view: the managed struct first (consumers get a pointer to it),
/// then the arrays it points into and the region whose guard keeps the memory alive.
#[repr(C)]
struct Holder<M> {
    managed: M,
    shape: Vec<i64>,
    strides: Vec<i64>,
    _region: ViewRegion,
}

/// The region of `tensor` that `layout` at byte `offset` addresses: the offset must be a
/// multiple of the item size, and the layout's whole extent must lie in the capacity.
fn region(tensor: &ExtensibleTensor, offset: u64, layout: &StridedLayout) -> Result<ViewRegion> {
    if offset % layout.itemsize() != 0 {
        return Err(Error::invalid(format!(
            "offset {offset} must be a multiple of the {}-byte item size",
            layout.itemsize()
        )));
    }
    tensor.view(offset, layout.extent_bytes()?)
}

fn dl_tensor(region: &ViewRegion, layout: &StridedLayout) -> DLTensor {
    let (device_type, device_id) = region.device().dlpack();
    DLTensor {
        data: region.ptr() as *mut c_void,
        device: DLDevice {
            device_type,
            device_id,
        },
        ndim: i32::try_from(layout.shape.len()).expect("a handful of dims"),
        dtype: layout.dtype,
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// The view both forms share: the region `layout` at `offset` addresses (checked), the
/// managed struct `managed` builds around its `DLTensor`, boxed with the arrays that tensor
/// points into and the region's guard. `tensor_of` finds the `DLTensor` in the managed struct.
fn view<M>(
    tensor: &ExtensibleTensor,
    offset: u64,
    layout: StridedLayout,
    managed: impl FnOnce(DLTensor) -> M,
    tensor_of: impl Fn(&mut M) -> &mut DLTensor,
) -> Result<*mut M> {
    let region = region(tensor, offset, &layout)?;
    let managed = managed(dl_tensor(&region, &layout));
    let StridedLayout { shape, strides, .. } = layout;
    let holder = Holder {
        managed,
        shape,
        strides,
        _region: region,
    };
    let raw = Box::into_raw(Box::new(holder));
    // SAFETY: `raw` comes from Box::into_raw just above, so it is valid and unaliased; the
    // shape and strides pointers point into the same allocation, which lives until the deleter.
    unsafe {
        let t = tensor_of(&mut (*raw).managed);
        t.shape = (*raw).shape.as_mut_ptr();
        t.strides = (*raw).strides.as_mut_ptr();
    }
    Ok(raw.cast::<M>())
}

/// A DLPack 1.x managed tensor of `layout` at byte `offset` of `tensor` (a multiple of the
/// item size; the layout's extent must fit the capacity); the consumer must call its deleter
/// exactly once.
pub fn view_versioned(
    tensor: &ExtensibleTensor,
    offset: u64,
    layout: StridedLayout,
) -> Result<*mut DLManagedTensorVersioned> {
    let managed = |dl_tensor| DLManagedTensorVersioned {
        version: DLPackVersion {
            major: DLPACK_MAJOR,
            minor: DLPACK_MINOR,
        },
        manager_ctx: std::ptr::null_mut(),
        deleter: Some(delete_versioned),
        flags: 0,
        dl_tensor,
    };
    view(tensor, offset, layout, managed, |m| &mut m.dl_tensor)
}

/// A legacy (pre-1.0) managed tensor, under the same rules as `view_versioned`.
pub fn view_legacy(
    tensor: &ExtensibleTensor,
    offset: u64,
    layout: StridedLayout,
) -> Result<*mut DLManagedTensor> {
    let managed = |dl_tensor| DLManagedTensor {
        dl_tensor,
        manager_ctx: std::ptr::null_mut(),
        deleter: Some(delete_legacy),
    };
    view(tensor, offset, layout, managed, |m| &mut m.dl_tensor)
}

/// # Safety
/// `managed` must come from `view_versioned` and not have been deleted before.
unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: per the contract, `managed` is the first field of a live boxed Holder.
    drop(unsafe { Box::from_raw(managed.cast::<Holder<DLManagedTensorVersioned>>()) });
}

/// # Safety
/// `managed` must come from `view_legacy` and not have been deleted before.
unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    // SAFETY: per the contract, `managed` is the first field of a live boxed Holder.
    drop(unsafe { Box::from_raw(managed.cast::<Holder<DLManagedTensor>>()) });
}

#[cfg(test)]
mod tests {
    #[test]
    fn extent_covers_the_farthest_element() {
        let f32 = DLDataType {
            code: 2,
            bits: 32,
            lanes: 1,
        };
        let transposed = StridedLayout::new(f32, vec![3, 4], vec![1, 3]).unwrap();
        assert_eq!(transposed.extent_bytes().unwrap(), 12 * 4);
        let padded = StridedLayout::new(f32, vec![2, 3], vec![8, 1]).unwrap();
        assert_eq!(padded.extent_bytes().unwrap(), (8 + 3) * 4);
        let empty = StridedLayout::new(f32, vec![2, 0], vec![8, 1]).unwrap();
        assert_eq!(empty.extent_bytes().unwrap(), 0);
        assert!(StridedLayout::new(f32, vec![2], vec![-1]).is_err());
        assert!(StridedLayout::new(f32, vec![i64::MAX], vec![i64::MAX])
            .unwrap()
            .extent_bytes()
            .is_err());
    }

    use super::*;
    use crate::driver::host::HostDriver;
    use crate::tensor::{ExtensibleTensor, GrowOptions, Options};
    use std::sync::Arc;

    #[test]
    fn deleter_keeps_then_frees_the_memory() {
        let driver = Arc::new(HostDriver::new(4096).unwrap());
        let tensor =
            ExtensibleTensor::with_equal_segments(driver, 8192, 1, Options::default()).unwrap();
        tensor
            .resize_per_segment(100, GrowOptions::zeroed())
            .unwrap();
        let layout = StridedLayout::bytes(50).unwrap();
        let managed = view_versioned(&tensor, 10, layout).unwrap();
        assert_eq!(tensor.live_views(), 1);
        // SAFETY: `managed` is a live view; we read it, then delete it exactly once.
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

    /// The extent and alignment checks live inside the view: no caller can hand a consumer
    /// a pointer to bytes past the capacity, or a misaligned one.
    #[test]
    fn view_refuses_layouts_past_the_capacity_or_misaligned() {
        let driver = Arc::new(HostDriver::new(4096).unwrap());
        let tensor =
            ExtensibleTensor::with_equal_segments(driver, 8192, 1, Options::default()).unwrap();
        let f32 = DLDataType {
            code: 2,
            bits: 32,
            lanes: 1,
        };
        let layout =
            |shape: Vec<i64>, strides: Vec<i64>| StridedLayout::new(f32, shape, strides).unwrap();
        let refused = |result: Result<*mut DLManagedTensor>, what: &str| match result {
            Err(Error::InvalidArgument(message)) => assert!(message.contains(what), "{message}"),
            Err(other) => panic!("expected InvalidArgument ({what}), got {other}"),
            Ok(_) => panic!("viewed {what}"),
        };
        // One f32 past the end, directly or through a stride, or by the offset.
        refused(
            view_legacy(&tensor, 0, layout(vec![2049], vec![1])),
            "exceeds",
        );
        refused(
            view_legacy(&tensor, 0, layout(vec![2, 2], vec![1, 2048])),
            "exceeds",
        );
        refused(
            view_legacy(&tensor, 4, layout(vec![2048], vec![1])),
            "exceeds",
        );
        refused(
            view_legacy(&tensor, 2, layout(vec![1], vec![1])),
            "item size",
        );
        assert!(matches!(
            view_versioned(&tensor, 0, layout(vec![2049], vec![1])),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(tensor.live_views(), 0, "a refused view holds no guard");
        // Exactly the capacity, and an empty view at its end, are fine.
        for (offset, shape) in [(0, 2048), (8192, 0)] {
            let managed = view_legacy(&tensor, offset, layout(vec![shape], vec![1])).unwrap();
            assert_eq!(tensor.live_views(), 1);
            // SAFETY: a live view, deleted exactly once.
            unsafe { ((*managed).deleter.unwrap())(managed) };
        }
        assert_eq!(tensor.live_views(), 0);
        tensor.close().unwrap();
    }
}
