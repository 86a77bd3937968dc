//! A driver wrapper that fails the k-th call of one operation, for testing that every failure
//! leaves the owner exactly as it was.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{Hook, Wrap};
use crate::driver::Driver;
use crate::error::{Error, Op, Result};

/// How the injected failure looks to the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// `Error::Driver` with code `INJECTED_FAULT`.
    Driver,
    /// `Error::OutOfMemory` with code `INJECTED_OOM`.
    OutOfMemory,
}

impl FaultKind {
    /// `driver` or `oom`.
    pub fn from_name(name: &str) -> Option<FaultKind> {
        match name {
            "driver" => Some(FaultKind::Driver),
            "oom" => Some(FaultKind::OutOfMemory),
            _ => None,
        }
    }
}

/// Which call fails, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The operation whose call fails.
    pub op: Op,
    /// 1-based: the `nth` call of `op` fails, every other call passes through.
    pub nth: u64,
    /// What the failure looks like.
    pub kind: FaultKind,
}

/// A driver that passes every call to `inner` except the one `fault` names.
pub type FaultyDriver = Wrap<Faults>;

/// The hook of `FaultyDriver`: counts and logs every call, and fails the one `fault` names.
pub struct Faults {
    fault: Fault,
    calls: [AtomicU64; Op::ALL.len()],
    /// Every call in order, for tests of ordering (e.g. the fence before an unmap).
    log: Mutex<Vec<Op>>,
}

impl FaultyDriver {
    /// `inner`, failing as `fault` says.
    pub fn new(inner: Arc<dyn Driver>, fault: Fault) -> FaultyDriver {
        let faults = Faults {
            fault,
            calls: Default::default(),
            log: Mutex::default(),
        };
        Wrap::with_hook(inner, faults)
    }

    /// How many times `op` has been called so far, the failed call included.
    pub fn calls(&self, op: Op) -> u64 {
        self.hook().calls[op as usize].load(Ordering::Relaxed)
    }

    /// Every call so far, in order (the failed one included).
    pub fn log(&self) -> Vec<Op> {
        self.hook().log.lock().expect("log poisoned").clone()
    }
}

impl Hook for Faults {
    // Not a call that fault injection counts: it makes nothing to roll back.
    const CHECK_ROOM_AS: Option<Op> = None;

    fn around<T>(&self, op: Op, num_bytes: u64, call: impl FnOnce() -> Result<T>) -> Result<T> {
        self.log.lock().expect("log poisoned").push(op);
        let n = self.calls[op as usize].fetch_add(1, Ordering::Relaxed) + 1;
        if op != self.fault.op || n != self.fault.nth {
            return call();
        }
        Err(match self.fault.kind {
            FaultKind::Driver => Error::Driver {
                op,
                code: "INJECTED_FAULT".into(),
                detail: format!("call {n} of {op}, injected"),
            },
            FaultKind::OutOfMemory => Error::OutOfMemory {
                op,
                requested_bytes: num_bytes,
                free_bytes: None,
                code: "INJECTED_OOM".into(),
            },
        })
    }
}
