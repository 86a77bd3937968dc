//! extensible-kv: reserve a KV cache's address space up front, commit physical memory later.
//!
//! Layers, bottom up: `driver` (the only FFI: CUDA's VMM API or Linux mmap, behind one trait),
//! `plan` (pure arithmetic: which granules to map and how to cut them into handles), `tensor`
//! (the owner that applies plans all-or-nothing), `dlpack` (handing memory to consumers), and,
//! behind the `python` feature, the bindings, which only convert. `ipc` is the process
//! plumbing that sharing with other processes needs (pidfds, the export registry).
//!
//! `unsafe` is denied crate-wide (`Cargo.toml`) and allowed only in the boundary modules that
//! must use it, each with `#![allow(unsafe_code)]` and a `// SAFETY:` comment on every block:
//! the driver backends (`driver::host`, `driver::cuda` and its `context` and `vmm`,
//! `driver::host::stray`), `dlpack`, `ipc`, and the bindings' `python::capsule` (plus one `unsafe fn`
//! in `driver`, `Stream::from_raw`, and its one caller in the bindings).
//!
//! # Example
//!
//! ```
//! use extensible_kv::{driver, ExtensibleTensor, GrowOptions, Options, ShrinkOptions};
//!
//! // The host backend (Linux mmap + memfd) with 4 KiB granules; "cuda:0" on a GPU.
//! let driver = driver::open("cpu", Some(4096))?;
//! // 1 MiB of address space in 2 segments (K and V) that grow in lockstep; nothing committed.
//! let kv = ExtensibleTensor::with_equal_segments(driver, 1 << 20, 2, Options::default())?;
//! let base = kv.base_ptr()?; // every view is an offset from it, for the tensor's life
//!
//! // Commit the first 10,000 bytes of each segment, zeroed: 3 whole granules each.
//! kv.resize_per_segment(10_000, GrowOptions::zeroed())?;
//! assert_eq!(kv.segment_bytes(), [10_000, 10_000]);
//! assert_eq!(kv.physical_bytes(), 2 * 3 * 4096);
//!
//! // A view (what DLPack hands to torch) keeps the memory alive: close refuses meanwhile.
//! let view = kv.view(0, 10_000)?;
//! assert_eq!(view.ptr(), base);
//! assert!(kv.close().is_err());
//! drop(view);
//!
//! // Give memory back, keeping the first 4 KiB of each segment and every address. Each
//! // segment's 3 granules are one handle: a plain shrink keeps it whole, an exact one
//! // replaces it by a copy of the granule still needed.
//! kv.shrink_per_segment(&[4096, 4096], ShrinkOptions::default())?;
//! assert_eq!(kv.physical_bytes(), 2 * 3 * 4096);
//! let exact = ShrinkOptions { exact: true, ..ShrinkOptions::default() };
//! kv.shrink_per_segment(&[4096, 4096], exact)?;
//! assert_eq!(kv.physical_bytes(), 2 * 4096);
//! kv.close()?;
//! # Ok::<(), extensible_kv::Error>(())
//! ```

pub mod dlpack;
pub mod driver;
pub mod error;
pub mod ipc;
pub mod plan;
pub mod tensor;

#[cfg(feature = "python")]
mod python;

pub use driver::{DeviceKind, Driver, Stream};
pub use error::{Error, Op, Result, SizeOp};
pub use plan::{Geometry, HandlePolicy, Run};
pub use tensor::{
    BorrowRoom, ExtensibleTensor, GrowOptions, HandleSizing, LoanDescription, LoanHandle, Options,
    PlacedHandle, Segments, ShrinkOptions,
};
