//! The crate's one error type. Every variant carries the numbers a user needs to act on it;
//! the bindings map each variant to one Python exception class.

use std::fmt;

/// The operation of the driver boundary that failed; used in messages and by fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `Driver::reserve`.
    Reserve,
    /// `Driver::free_reservation`.
    FreeReservation,
    /// `Driver::create`, and the room check before it (`Driver::check_room`).
    Create,
    /// `Driver::release`.
    Release,
    /// `Driver::map`.
    Map,
    /// `Driver::unmap`.
    Unmap,
    /// `Driver::set_access`.
    SetAccess,
    /// `Driver::memset_zero`.
    Memset,
    /// `Driver::copy`.
    Copy,
    /// `Driver::synchronize`.
    Synchronize,
    /// `Driver::mem_info`.
    MemInfo,
    /// `Driver::export`.
    Export,
    /// `Driver::import`.
    Import,
    /// `Driver::record_event`.
    RecordEvent,
    /// `Driver::wait_event`, and `Driver::destroy_event`.
    WaitEvent,
}

impl Op {
    /// Every operation, in declaration order (`op as usize` indexes it).
    pub const ALL: [Op; 15] = [
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
        Op::Export,
        Op::Import,
        Op::RecordEvent,
        Op::WaitEvent,
    ];

    /// The operation's name in messages and in Python (`create`, `set_access`, ...).
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
            Op::Export => "export",
            Op::Import => "import",
            Op::RecordEvent => "record_event",
            Op::WaitEvent => "wait_event",
        }
    }

    /// The operation of that `name`, if any.
    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An operation on a tensor's committed bytes, as a structured error names it: the core's
/// message uses the Rust method names, and each facade words it with its own verbs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SizeOp {
    /// `ExtensibleTensor::resize` and `resize_per_segment`: grows.
    Resize,
    /// `ExtensibleTensor::shrink` and `shrink_per_segment`.
    Shrink,
}

impl SizeOp {
    /// The verb: `resize` or `shrink`.
    pub fn name(self) -> &'static str {
        match self {
            SizeOp::Resize => "resize",
            SizeOp::Shrink => "shrink",
        }
    }
}

impl fmt::Display for SizeOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything that can fail, each variant with the numbers a user needs to act on it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A size, offset, count or shape that cannot work; nothing was changed.
    #[error("{0}")]
    InvalidArgument(String),

    /// Physical memory could not be had; nothing was mapped. With `op` `Reserve`, it is
    /// address space that ran out (the message says so): no physical memory was asked for.
    #[error("{}", out_of_memory_message(*.op, *.requested_bytes, *.free_bytes, .code))]
    OutOfMemory {
        /// The operation that could not get memory.
        op: Op,
        /// The bytes it asked for.
        requested_bytes: u64,
        /// The bytes the backend said were free, if it could tell.
        free_bytes: Option<u64>,
        /// The backend's name for the failure: a CUresult name or an errno name.
        code: String,
    },

    /// Any other failure of the backend, named as the backend names it.
    #[error("{op} failed: {code}{}", if .detail.is_empty() { String::new() } else { format!(" ({})", .detail) })]
    Driver {
        /// The operation that failed.
        op: Op,
        /// A CUresult name (`CUDA_ERROR_INVALID_VALUE`) or an errno name (`EINVAL`).
        code: String,
        /// What was asked (sizes, addresses), for the message.
        detail: String,
    },

    /// A one-size call (`resize`, `shrink`) on a tensor of several segments; nothing was
    /// changed.
    #[error("{op} takes one size, for a tensor of one segment; this tensor has {num_segments}: use {op}_per_segment")]
    NotOneSegment {
        /// The call.
        op: SizeOp,
        /// How many segments the tensor has.
        num_segments: usize,
    },

    /// A resize that would shrink a segment, or a shrink that would grow one; nothing was
    /// changed.
    #[error("{}", wrong_direction_message(*.op, *.segment, *.from_bytes, *.to_bytes))]
    WrongDirection {
        /// The call.
        op: SizeOp,
        /// The first segment that would go the wrong way.
        segment: usize,
        /// Its committed bytes.
        from_bytes: u64,
        /// The bytes asked for.
        to_bytes: u64,
    },

    /// The backend or device cannot do this at all.
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// A wait (`reclaim`'s for a give-back) ran past its time limit; nothing was changed.
    #[error("timed out: {0}")]
    Timeout(String),

    /// Memory that is not this tensor's alone to pass on: a borrowed handle lent onward or
    /// described by `share`, or a handle `share` described (importers may map it) lent;
    /// nothing was changed.
    #[error("{0}")]
    LoanConflict(String),

    /// The kernel refused to let this process take another one's fd (`pidfd_getfd`: EPERM or
    /// EACCES, where this process may not trace the other); nothing was mapped.
    #[error("{call} refused ({code}): {detail}")]
    PtraceRefused {
        /// The call the kernel refused.
        call: &'static str,
        /// The process whose fd was asked for.
        pid: i32,
        /// `EPERM` or `EACCES`.
        code: String,
        /// What was asked, and what to do instead.
        detail: String,
    },

    /// The caller gave up a long wait (`reclaim`'s `stop`: a signal, in Python) before it
    /// ended; nothing was changed.
    #[error("interrupted: {0}")]
    Interrupted(String),

    /// The tensor was closed; its addresses are gone.
    #[error("the tensor is closed")]
    Closed,

    /// `close()` was called while views still point into the reservation.
    #[error(
        "cannot close: {live_views} view(s) still point into the reservation; \
         drop them first (the memory is released with the last view if the tensor is dropped instead)"
    )]
    ViewsAlive {
        /// How many views still point into the reservation.
        live_views: usize,
    },
}

/// The message of `Error::WrongDirection`, in the Rust method names.
fn wrong_direction_message(op: SizeOp, segment: usize, from_bytes: u64, to_bytes: u64) -> String {
    let (other, change) = match op {
        SizeOp::Resize => (SizeOp::Shrink, "shrink"),
        SizeOp::Shrink => (SizeOp::Resize, "grow"),
    };
    format!(
        "{op} cannot {change} segment {segment} from {from_bytes} to {to_bytes} bytes: use \
         {other}_per_segment"
    )
}

/// The message of `Error::OutOfMemory`: a failed reservation ran out of address space, not of
/// memory, and committing fewer bytes would not help.
fn out_of_memory_message(
    op: Op,
    requested_bytes: u64,
    free_bytes: Option<u64>,
    code: &str,
) -> String {
    if op == Op::Reserve {
        return format!(
            "out of address space: reserving {requested_bytes} bytes failed ({code}); this \
             process cannot reserve that much address space (no memory was asked for): reserve \
             a smaller capacity (max_bytes), or raise the address-space limit (ulimit -v)"
        );
    }
    let free = free_bytes.map_or_else(String::new, |b| format!(", {b} bytes free"));
    format!(
        "out of memory: {op} of {requested_bytes} bytes failed ({code}){free}; commit fewer \
         bytes or free memory first"
    )
}

impl Error {
    /// `Error::InvalidArgument` with `msg`.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
}

/// The crate's `Result`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An OS call's failure, as rustix returns it.
pub(crate) use rustix::io::Errno;

/// The name of an errno value (`ENOMEM`), as `Error::Driver` and `Error::OutOfMemory` carry it.
pub(crate) fn errno_name(errno: Errno) -> String {
    let name = match errno {
        Errno::NOMEM => "ENOMEM",
        Errno::NOSPC => "ENOSPC",
        Errno::INVAL => "EINVAL",
        Errno::BADF => "EBADF",
        Errno::FAULT => "EFAULT",
        Errno::MFILE => "EMFILE",
        Errno::NFILE => "ENFILE",
        Errno::PERM => "EPERM",
        Errno::ACCESS => "EACCES",
        Errno::OVERFLOW => "EOVERFLOW",
        Errno::FBIG => "EFBIG",
        Errno::INTR => "EINTR",
        Errno::NOENT => "ENOENT",
        Errno::SRCH => "ESRCH",
        Errno::NOSYS => "ENOSYS",
        Errno::NOTSOCK => "ENOTSOCK",
        Errno::IO => "EIO",
        _ => return format!("errno {}", errno.raw_os_error()),
    };
    name.to_string()
}

impl Error {
    /// The error of an OS call for `op` that failed with `errno`.
    pub(crate) fn os(op: Op, errno: Errno, detail: impl Into<String>) -> Error {
        Error::Driver {
            op,
            code: errno_name(errno),
            detail: detail.into(),
        }
    }
}

/// A failed call's status as this crate's error: each backend's statuses (errno values here,
/// `CUresult`s in the CUDA backend) implement it, so every call site reads `.on(op, detail)`.
pub(crate) trait OnOp<T> {
    /// This crate's error for a failed `op`; `detail` is built only on failure.
    fn on(self, op: Op, detail: impl FnOnce() -> String) -> Result<T>;
}

impl<T> OnOp<T> for Result<T, Errno> {
    fn on(self, op: Op, detail: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|errno| Error::os(op, errno, detail()))
    }
}

/// For the std calls (files, fd clones): named by their errno, `EIO` for one without.
impl<T> OnOp<T> for Result<T, std::io::Error> {
    fn on(self, op: Op, detail: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|err| {
            let errno = Errno::from_io_error(&err).unwrap_or(Errno::IO);
            Error::os(op, errno, format!("{}: {err}", detail()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_errors_are_named_by_their_errno() {
        let refused: Result<(), Errno> = Err(Errno::NOMEM);
        match refused.on(Op::Create, || "a memfd".into()) {
            Err(Error::Driver { op, code, detail }) => {
                assert_eq!(
                    (op, code.as_str(), detail.as_str()),
                    (Op::Create, "ENOMEM", "a memfd")
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(errno_name(Errno::from_raw_os_error(4095)), "errno 4095");
        let missing = std::fs::read("/nonexistent/extensible-kv").map(drop);
        let err = missing.on(Op::MemInfo, || "reading".into()).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("mem_info failed: ENOENT (reading: "),
            "{err}"
        );
        let plain: Result<(), std::io::Error> = Err(std::io::Error::other("no errno"));
        let err = plain.on(Op::Import, || "fstat".into()).unwrap_err();
        assert!(err.to_string().contains("EIO"), "{err}");
    }
}
