//! The crate's one error type. Every variant carries the numbers a user needs to act on it;
//! the bindings map each variant to one Python exception class.

use std::fmt;

/// The operation of the driver boundary that failed; used in messages and by fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Reserve,
    FreeReservation,
    Create,
    Release,
    Map,
    Unmap,
    SetAccess,
    Memset,
    Copy,
    Synchronize,
    MemInfo,
}

impl Op {
    pub const ALL: [Op; 11] = [
        Op::Reserve,
        Op::FreeReservation,
        Op::Create,
        Op::Release,
        Op::Map,
        Op::Unmap,
        Op::SetAccess,
        Op::Memset,
        Op::Copy,
        Op::Synchronize,
        Op::MemInfo,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Reserve => "reserve",
            Op::FreeReservation => "free_reservation",
            Op::Create => "create",
            Op::Release => "release",
            Op::Map => "map",
            Op::Unmap => "unmap",
            Op::SetAccess => "set_access",
            Op::Memset => "memset",
            Op::Copy => "copy",
            Op::Synchronize => "synchronize",
            Op::MemInfo => "mem_info",
        }
    }

    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A size, offset, count or shape that cannot work; nothing was changed.
    #[error("{0}")]
    InvalidArgument(String),

    /// Physical memory could not be had; nothing was mapped.
    #[error(
        "out of memory: {op} of {requested_bytes} bytes failed ({code}){}; \
         commit fewer bytes or free memory first",
        match .free_bytes { Some(b) => format!(", {b} bytes free"), None => String::new() }
    )]
    OutOfMemory {
        op: Op,
        requested_bytes: u64,
        free_bytes: Option<u64>,
        /// The backend's name for the failure: a CUresult name or an errno name.
        code: String,
    },

    /// Any other failure of the backend, named as the backend names it.
    #[error("{op} failed: {code}{}", if .detail.is_empty() { String::new() } else { format!(" ({})", .detail) })]
    Driver {
        op: Op,
        /// A CUresult name (`CUDA_ERROR_INVALID_VALUE`) or an errno name (`EINVAL`).
        code: String,
        detail: String,
    },

    /// The backend or device cannot do this at all.
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// The tensor was closed; its addresses are gone.
    #[error("the tensor is closed")]
    Closed,

    /// `close()` was called while views still point into the reservation.
    #[error(
        "cannot close: {live_views} view(s) still point into the reservation; \
         drop them first (the memory is released with the last view if the tensor is dropped instead)"
    )]
    ViewsAlive { live_views: usize },
}

impl Error {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
