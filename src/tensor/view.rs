//! Views: byte ranges of a tensor handed to consumers (DLPack), each holding a guard that
//! keeps the memory alive and counts towards `live_views` (`close` refuses while any is).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{relock, ExtensibleTensor, Inner};
use crate::driver::DeviceKind;
use crate::error::{Error, Result};

/// Keeps a tensor's memory alive for one view; counts towards `live_views`.
struct ViewGuard {
    inner: Arc<Inner>,
}

impl Drop for ViewGuard {
    fn drop(&mut self) {
        self.inner.live_views.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A byte range of a tensor handed to a consumer (DLPack), with the guard that keeps it valid.
/// Only `ExtensibleTensor::view` makes one, after checking the range against the capacity,
/// so its pointer can be trusted: the fields are private, and nothing can forge one.
///
/// ```compile_fail,E0451
/// use extensible_kv::{tensor::ViewRegion, DeviceKind};
/// let forged = ViewRegion { ptr: 0xdead, num_bytes: 1, device: DeviceKind::Cpu, _guard: todo!() };
/// ```
pub struct ViewRegion {
    ptr: u64,
    num_bytes: u64,
    device: DeviceKind,
    _guard: ViewGuard,
}

impl ViewRegion {
    /// The first byte's address; `num_bytes` from it lie in the tensor's reservation.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The region's length in bytes.
    pub fn num_bytes(&self) -> u64 {
        self.num_bytes
    }

    /// Where the region's memory lives.
    pub fn device(&self) -> DeviceKind {
        self.device
    }
}

impl ExtensibleTensor {
    /// Hands out `[offset, offset + num_bytes)` of the capacity; the guard keeps it alive.
    /// Never waits for an operation in progress (it takes no lock but the snapshot's).
    pub fn view(&self, offset: u64, num_bytes: u64) -> Result<ViewRegion> {
        let capacity = self.inner.geometry.capacity_bytes();
        if offset
            .checked_add(num_bytes)
            .is_none_or(|end| end > capacity)
        {
            return Err(Error::invalid(format!(
                "a view of {num_bytes} bytes at offset {offset} exceeds the capacity of \
                 {capacity} bytes"
            )));
        }
        {
            let snapshot = relock(&self.inner.snapshot);
            if snapshot.closed {
                return Err(Error::Closed);
            }
            self.inner.live_views.fetch_add(1, Ordering::AcqRel);
        }
        Ok(ViewRegion {
            ptr: self.inner.ctx.base + offset,
            num_bytes,
            device: self.inner.ctx.driver.device(),
            _guard: ViewGuard {
                inner: Arc::clone(&self.inner),
            },
        })
    }
}
