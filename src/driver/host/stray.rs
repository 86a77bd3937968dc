//! What a stray access hit, on the host backend: a SIGSEGV or SIGBUS inside a live reservation
//! prints the tensor (its base address and reserved bytes), the offset, and the segment with
//! its committed bytes, then hands the signal on unchanged.
//!
//! Why: touching a byte past a segment's committed prefix (a block index off by one, a view
//! kept past a shrink) faults, and the default action ends the process in silence. The report
//! says which tensor and how far past its committed bytes the touch was. The Python stack
//! comes from the handler we chain to: the facade enables Python's `faulthandler` before its
//! first tensor, so ours runs first and then faulthandler's.
//!
//! On CUDA the same mistake is not a signal: a kernel that touches an unmapped address of a
//! reservation fails with `CUDA_ERROR_ILLEGAL_ADDRESS` ("an illegal memory access was
//! encountered"), reported asynchronously by a later call (torch raises it at the next
//! synchronising call, not at the faulty line), with no address. The error is sticky: the
//! context is unusable for the rest of the process, so every later CUDA call fails too.
//! `CUDA_LAUNCH_BLOCKING=1` moves the report to the offending launch; `compute-sanitizer` names
//! the address.
//!
//! Contract:
//! - The handler is async-signal-safe: it reads atomics only, formats into a buffer on its
//!   stack and writes with `write(2)`; no allocation, no lock.
//! - The registry is lock-free: a fixed table of slots, each a reservation's start and length
//!   (atomics) and its layout (an `AtomicPtr`); a layout is freed only once no handler reads
//!   the table (`READERS`).
//! - It chains: the handlers installed before ours (Python's faulthandler, torch's) run next,
//!   with the same arguments. Where there was none, the default action is restored and the
//!   fault recurs on return, so the process dies of the same signal: the exit status does not
//!   change.
//! - `EXTENSIBLE_KV_STRAY_REPORT=0` (or `false`, `no`, `off`, any case) in the environment
//!   leaves the signal handlers alone, as the Python package's switches read them.
//!
//! Limitations: a touch past the committed bytes but inside their last granule does not fault
//! at all (the granule is mapped); the registry holds `SLOTS` reservations (others are not
//! reported on); a reservation is reported on by start and size, as `base_ptr` and
//! `capacity_bytes` name it.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::Once;

/// How many live reservations can be reported on.
pub const SLOTS: usize = 1024;

/// The environment variable that, set to `0`, keeps the handler from being installed.
pub const ENV_VAR: &str = "EXTENSIBLE_KV_STRAY_REPORT";

/// Whether a switch's value says off: `0`, `false`, `no`, `off`, in any case (the words
/// `extensible_kv._plugins.env_flag` reads as off).
fn switched_off(value: &str) -> bool {
    let value = value.trim().to_ascii_lowercase();
    matches!(value.as_str(), "0" | "false" | "no" | "off")
}

/// One live reservation: `base == 0` is a free slot.
struct Slot {
    base: AtomicU64,
    num_bytes: AtomicU64,
    layout: AtomicPtr<Layout>,
}

/// A reservation's segments: where each starts and its capacity (fixed), and its committed
/// bytes (updated after every change).
struct Layout {
    offsets: Box<[u64]>,
    capacities: Box<[u64]>,
    committed: Box<[AtomicU64]>,
}

static REGISTRY: [Slot; SLOTS] = [const {
    Slot {
        base: AtomicU64::new(0),
        num_bytes: AtomicU64::new(0),
        layout: AtomicPtr::new(std::ptr::null_mut()),
    }
}; SLOTS];

/// Handlers reading the registry now; a layout is freed only when there are none.
static READERS: AtomicUsize = AtomicUsize::new(0);

/// The actions installed before ours, for SIGSEGV and SIGBUS: the handler address and flags.
static PREVIOUS: [(AtomicUsize, AtomicI32); 2] = [
    (AtomicUsize::new(libc::SIG_DFL), AtomicI32::new(0)),
    (AtomicUsize::new(libc::SIG_DFL), AtomicI32::new(0)),
];
const SIGNALS: [libc::c_int; 2] = [libc::SIGSEGV, libc::SIGBUS];

/// The slot a reservation at `base` hashes to first; probing goes on from there.
fn home(base: u64) -> usize {
    ((base >> 21) as usize) % SLOTS
}

fn slots_from(base: u64) -> impl Iterator<Item = &'static Slot> {
    let start = home(base);
    (0..SLOTS).map(move |i| &REGISTRY[(start + i) % SLOTS])
}

/// Notes a new reservation, and installs the handler on the first. A full table is not an
/// error: that reservation goes unreported.
pub fn register(base: u64, num_bytes: u64) {
    install();
    for slot in slots_from(base) {
        if slot.base.load(Ordering::Relaxed) != 0 {
            continue;
        }
        slot.num_bytes.store(num_bytes, Ordering::SeqCst);
        let claimed = slot
            .base
            .compare_exchange(0, base, Ordering::SeqCst, Ordering::SeqCst);
        if claimed.is_ok() {
            return;
        }
    }
}

/// Forgets the reservation at `base` before its addresses are given back.
pub fn unregister(base: u64) {
    let Some(slot) = slots_from(base).find(|s| s.base.load(Ordering::SeqCst) == base) else {
        return;
    };
    let layout = slot.layout.swap(std::ptr::null_mut(), Ordering::SeqCst);
    slot.base.store(0, Ordering::SeqCst);
    free_when_unread(layout);
}

/// Publishes the segments of the reservation at `base` and their committed bytes.
pub fn note_layout(base: u64, offsets: &[u64], capacities: &[u64], committed: &[u64]) {
    let Some(slot) = slots_from(base).find(|s| s.base.load(Ordering::SeqCst) == base) else {
        return;
    };
    let current = slot.layout.load(Ordering::SeqCst);
    // SAFETY: a non-null layout stays allocated while its slot holds `base`: only `unregister`
    // (after clearing the slot) and this function (after swapping it out) free one, and both
    // run under the owner's lock of that reservation, as this call does.
    if let Some(layout) = unsafe { current.as_ref() } {
        if layout.offsets.as_ref() == offsets && layout.capacities.as_ref() == capacities {
            for (cell, &bytes) in layout.committed.iter().zip(committed) {
                cell.store(bytes, Ordering::Relaxed);
            }
            return;
        }
    }
    let layout = Box::new(Layout {
        offsets: offsets.into(),
        capacities: capacities.into(),
        committed: committed.iter().map(|&b| AtomicU64::new(b)).collect(),
    });
    let old = slot.layout.swap(Box::into_raw(layout), Ordering::SeqCst);
    free_when_unread(old);
}

/// Frees a layout taken out of the registry once no handler can be reading it.
fn free_when_unread(layout: *mut Layout) {
    if layout.is_null() {
        return;
    }
    // A handler that saw this layout counted itself in before loading the pointer (SeqCst),
    // and it is out of the table before it chains on, so this wait is short.
    while READERS.load(Ordering::SeqCst) != 0 {
        std::thread::yield_now();
    }
    // SAFETY: `layout` came from `Box::into_raw` in `note_layout` and is no longer reachable
    // from the registry, and no handler is reading it (above): this is its only owner.
    drop(unsafe { Box::from_raw(layout) });
}

/// Installs the handler for SIGSEGV and SIGBUS once per process, unless the environment says
/// not to, keeping the actions it replaces to chain to.
pub fn install() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        if std::env::var(ENV_VAR).is_ok_and(|v| switched_off(&v)) {
            return;
        }
        for (i, &signal) in SIGNALS.iter().enumerate() {
            // SAFETY: a zeroed sigaction is a valid value (empty mask, no flags); the handler
            // has the three-argument signature SA_SIGINFO calls it with, and `old` receives
            // the action replaced, which the handler chains to.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_fault as *const () as usize;
                action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut action.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(signal, &action, &mut old) == 0 {
                    PREVIOUS[i].0.store(old.sa_sigaction, Ordering::SeqCst);
                    PREVIOUS[i].1.store(old.sa_flags, Ordering::SeqCst);
                }
            }
        }
    });
}

/// The signal handler: reports an address inside a registered reservation, then chains.
extern "C" fn on_fault(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo (or null, checked) to a handler installed
    // with SA_SIGINFO, and si_addr is set for SIGSEGV and SIGBUS, the signals it handles.
    let address = unsafe { info.as_ref().map_or(0, |info| info.si_addr() as u64) };
    READERS.fetch_add(1, Ordering::SeqCst);
    let mut message = Message::new();
    if describe(signal, address, &mut message) {
        message.write_to_stderr();
    }
    READERS.fetch_sub(1, Ordering::SeqCst);
    // SAFETY: `info` and `context` are the kernel's, passed on unchanged to the handler that
    // was installed before ours, as it expects them.
    unsafe { chain(signal, info, context) };
}

/// Writes what `address` hit into `out`; false when it is in no registered reservation.
fn describe(signal: libc::c_int, address: u64, out: &mut Message) -> bool {
    let Some(slot) = REGISTRY.iter().find(|slot| {
        let base = slot.base.load(Ordering::SeqCst);
        base != 0 && address >= base && address - base < slot.num_bytes.load(Ordering::SeqCst)
    }) else {
        return false;
    };
    let base = slot.base.load(Ordering::SeqCst);
    let num_bytes = slot.num_bytes.load(Ordering::SeqCst);
    let offset = address - base;
    let name = if signal == libc::SIGBUS {
        "SIGBUS"
    } else {
        "SIGSEGV"
    };
    out.push("extensible_kv: stray access (")
        .push(name)
        .push(") at offset ");
    out.number(offset)
        .push(" of the tensor at base_ptr ")
        .hex(base)
        .push(" (");
    out.number(num_bytes).push(" bytes reserved)");
    // SAFETY: READERS counts this handler in, so a layout loaded now is not freed until it
    // is done (`free_when_unread`).
    let layout = unsafe { slot.layout.load(Ordering::SeqCst).as_ref() };
    match layout {
        Some(layout) => describe_segment(layout, offset, out),
        None => {
            out.push(": no committed bytes are known for it");
        }
    }
    out.push(
        ". Only the committed bytes of a segment may be touched: grow it first \
              (resize_per_segment_), or index below its committed blocks.\n",
    );
    true
}

fn describe_segment(layout: &Layout, offset: u64, out: &mut Message) {
    let n = layout.offsets.len();
    let Some(i) = (0..n).rev().find(|&i| layout.offsets[i] <= offset) else {
        out.push(": before its first segment");
        return;
    };
    let (start, capacity) = (layout.offsets[i], layout.capacities[i]);
    let within = offset - start;
    if within >= capacity {
        out.push(": past the end of its last segment (capacity ")
            .number(capacity);
        out.push(" bytes)");
        return;
    }
    let committed = layout.committed[i].load(Ordering::Relaxed);
    out.push(", in segment ")
        .number(i as u64)
        .push(" of ")
        .number(n as u64);
    out.push(" (offset ")
        .number(start)
        .push(", capacity ")
        .number(capacity);
    out.push(" bytes), ")
        .number(within)
        .push(" bytes into it; committed bytes of that segment: ");
    out.number(committed);
    if within >= committed {
        out.push(", so the access is ")
            .number(within - committed)
            .push(" bytes past them");
    } else {
        out.push(" (its memory was released while this access was possible)");
    }
}

/// Hands the signal to the action installed before ours; without one, restores the default
/// action so that the process ends as it would have without us.
///
/// # Safety
/// Call only from the signal handler, with the arguments the kernel gave it.
unsafe fn chain(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let i = usize::from(signal == libc::SIGBUS);
    let handler = PREVIOUS[i].0.load(Ordering::SeqCst);
    let flags = PREVIOUS[i].1.load(Ordering::SeqCst);
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // SAFETY: restoring the default action with a zeroed sigaction is always valid; a
        // fault then recurs when this handler returns, and a signal sent by kill or raise
        // (si_code <= 0) is raised again, pending until we return.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = libc::SIG_DFL;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
            if info.as_ref().is_none_or(|info| info.si_code <= 0) {
                libc::raise(signal);
            }
        }
        return;
    }
    if flags & libc::SA_SIGINFO != 0 {
        type Action = extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);
        // SAFETY: the previous action was installed with SA_SIGINFO, so its address is a
        // three-argument handler; it gets what the kernel gave us.
        let previous: Action = unsafe { std::mem::transmute::<usize, Action>(handler) };
        previous(signal, info, context);
    } else {
        type Handler = extern "C" fn(libc::c_int);
        // SAFETY: without SA_SIGINFO the previous action's address is a one-argument handler.
        let previous: Handler = unsafe { std::mem::transmute::<usize, Handler>(handler) };
        previous(signal);
    }
}

/// A report built on the handler's stack: no allocation. Text past its size is cut.
pub struct Message {
    bytes: [u8; 1024],
    len: usize,
}

impl Message {
    fn new() -> Message {
        Message {
            bytes: [0; 1024],
            len: 0,
        }
    }

    fn push(&mut self, text: &str) -> &mut Message {
        let room = self.bytes.len() - self.len;
        let n = text.len().min(room);
        self.bytes[self.len..self.len + n].copy_from_slice(&text.as_bytes()[..n]);
        self.len += n;
        self
    }

    fn digits(&mut self, mut value: u64, radix: u64) -> &mut Message {
        let mut digits = [0u8; 20];
        let mut start = digits.len();
        loop {
            start -= 1;
            digits[start] = b"0123456789abcdef"[(value % radix) as usize];
            value /= radix;
            if value == 0 {
                break;
            }
        }
        // The digits are ASCII.
        self.push(std::str::from_utf8(&digits[start..]).unwrap_or("?"))
    }

    fn number(&mut self, value: u64) -> &mut Message {
        self.digits(value, 10)
    }

    fn hex(&mut self, value: u64) -> &mut Message {
        self.push("0x").digits(value, 16)
    }

    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..self.len]).unwrap_or("")
    }

    fn write_to_stderr(&self) {
        let mut written = 0;
        while written < self.len {
            let rest = &self.bytes[written..self.len];
            // rustix's write is the bare system call, which is async-signal-safe.
            match rustix::io::write(rustix::stdio::stderr(), rest) {
                Ok(n) if n > 0 => written += n,
                _ => return, // nothing better to do in a dying process
            }
        }
    }
}

/// The report for an access at `address`, as the handler would print it; `None` outside every
/// registered reservation. For tests.
pub fn report_for(address: u64) -> Option<String> {
    let mut message = Message::new();
    describe(libc::SIGSEGV, address, &mut message).then(|| message.as_str().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_reads_the_packages_words_for_off() {
        for off in ["0", "off", " False ", "NO"] {
            assert!(switched_off(off), "{off:?}");
        }
        for other in ["", "1", "on", "yes", "maybe"] {
            assert!(!switched_off(other), "{other:?}");
        }
    }

    #[test]
    fn a_report_names_the_offset_segment_and_committed_bytes() {
        let base = 0x7000_0000_0000u64 + (1 << 40); // never a real mapping of this test
        register(base, 1 << 20);
        assert_eq!(
            report_for(base + 100)
                .as_deref()
                .map(|r| r.contains("no committed bytes")),
            Some(true)
        );
        note_layout(base, &[0, 4096], &[4096, 8192], &[100, 5000]);
        let report = report_for(base + 4096 + 6000).unwrap();
        for fragment in [
            "stray access (SIGSEGV) at offset 10096 of the tensor at base_ptr 0x7100",
            "(1048576 bytes reserved), in segment 1 of 2 (offset 4096, capacity 8192 bytes)",
            "6000 bytes into it; committed bytes of that segment: 5000, so the access is 1000 \
             bytes past them",
        ] {
            assert!(report.contains(fragment), "{fragment:?} not in {report:?}");
        }
        note_layout(base, &[0, 4096], &[4096, 8192], &[100, 7000]);
        assert!(report_for(base + 4096 + 6000).unwrap().contains("released"));
        assert!(report_for(base + 20000)
            .unwrap()
            .contains("past the end of its last segment"));
        assert_eq!(report_for(base + (1 << 20)), None);
        unregister(base);
        assert_eq!(report_for(base + 100), None);
    }

    #[test]
    fn numbers_format_without_allocating() {
        let mut message = Message::new();
        message
            .number(0)
            .push(" ")
            .number(u64::MAX)
            .push(" ")
            .hex(0xdead_beef);
        assert_eq!(message.as_str(), "0 18446744073709551615 0xdeadbeef");
        let long = "x".repeat(2000);
        assert_eq!(Message::new().push(&long).as_str().len(), 1024);
    }
}
