//! The DLPack boundary on the Python side: wraps a view from `dlpack.rs` in a PyCapsule
//! named as the protocol requires, with a destructor that deletes it only if no consumer
//! took it (a consumer renames the capsule to `used_*` and calls the deleter itself).
#![allow(unsafe_code)]

use std::ffi::CStr;

use pyo3::ffi;
use pyo3::prelude::*;

use crate::dlpack::{self, DLManagedTensor, DLManagedTensorVersioned, StridedLayout};
use crate::tensor::ExtensibleTensor;

const VERSIONED: &CStr = c"dltensor_versioned";
const LEGACY: &CStr = c"dltensor";

/// A capsule of `layout` at byte `offset` of `tensor`: DLPack 1.x when `versioned`, else the
/// legacy form.
pub fn new(
    py: Python<'_>,
    tensor: &ExtensibleTensor,
    offset: u64,
    layout: StridedLayout,
    versioned: bool,
) -> PyResult<Py<PyAny>> {
    if versioned {
        let managed = dlpack::view_versioned(tensor, offset, layout)?;
        // SAFETY: `managed` is a live view we own; `wrap` hands it to the capsule or, on
        // failure, deletes it once through the closure.
        unsafe {
            wrap(py, managed.cast(), VERSIONED, destroy_versioned, || {
                delete_versioned(managed)
            })
        }
    } else {
        let managed = dlpack::view_legacy(tensor, offset, layout)?;
        // SAFETY: as above, for the legacy struct.
        unsafe {
            wrap(py, managed.cast(), LEGACY, destroy_legacy, || {
                delete_legacy(managed)
            })
        }
    }
}

/// # Safety
/// `pointer` is a live view not owned by anything else; `on_failure` deletes it.
unsafe fn wrap(
    py: Python<'_>,
    pointer: *mut std::ffi::c_void,
    name: &'static CStr,
    destructor: unsafe extern "C" fn(*mut ffi::PyObject),
    on_failure: impl FnOnce(),
) -> PyResult<Py<PyAny>> {
    // SAFETY: the GIL is held (we have `py`); `name` is 'static as the capsule requires.
    let capsule = unsafe { ffi::PyCapsule_New(pointer, name.as_ptr(), Some(destructor)) };
    if capsule.is_null() {
        on_failure();
        return Err(PyErr::fetch(py));
    }
    // SAFETY: PyCapsule_New returned a new, non-null reference that we now own.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) }.unbind())
}

/// # Safety
/// `managed` is a live view from `view_versioned`; it is deleted here, exactly once.
unsafe fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: per the contract above.
    unsafe { ((*managed).deleter.expect("views always set a deleter"))(managed) }
}

/// # Safety
/// `managed` is a live view from `view_legacy`; it is deleted here, exactly once.
unsafe fn delete_legacy(managed: *mut DLManagedTensor) {
    // SAFETY: per the contract above.
    unsafe { ((*managed).deleter.expect("views always set a deleter"))(managed) }
}

/// # Safety
/// Called by Python with a capsule made by `new`, while holding the GIL.
unsafe extern "C" fn destroy_versioned(capsule: *mut ffi::PyObject) {
    // SAFETY: the capsule is live; a still-valid name means no consumer took the view, so it
    // is ours to delete. Neither call sets an exception when the name matches.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr());
            delete_versioned(managed.cast());
        }
    }
}

/// # Safety
/// Called by Python with a capsule made by `new`, while holding the GIL.
unsafe extern "C" fn destroy_legacy(capsule: *mut ffi::PyObject) {
    // SAFETY: as in `destroy_versioned`, for the legacy name.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr());
            delete_legacy(managed.cast());
        }
    }
}
