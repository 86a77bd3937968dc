//! extensible-kv: reserve a KV cache's address space up front, commit physical memory later.
//!
//! Layers, bottom up: `driver` (the only FFI: CUDA's VMM API or Linux mmap, behind one trait),
//! `plan` (pure arithmetic: which granules to map and how to cut them into handles), `tensor`
//! (the owner that applies plans all-or-nothing), `dlpack` (handing memory to consumers), and,
//! behind the `python` feature, the bindings, which only convert.

pub mod dlpack;
pub mod driver;
pub mod error;
pub mod plan;
pub mod tensor;

#[cfg(feature = "python")]
mod python;

pub use driver::{DeviceKind, Driver, Stream};
pub use error::{Error, Op, Result};
pub use plan::{Geometry, HandlePolicy, Run};
pub use tensor::{Cut, ExtensibleTensor, GrowOptions, Options, Segments, ShrinkOptions};
