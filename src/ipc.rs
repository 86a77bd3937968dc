//! Taking another process's file descriptor: `pidfd_open` + `pidfd_getfd` (Linux 5.6), the
//! way PyTorch's expandable segments share memory. The owner keeps each exported fd open for
//! as long as its handle lives; an importer duplicates it by (pid, fd number). That needs
//! ptrace access to the owner (same user, and Yama's `ptrace_scope` allowing it, or
//! `CAP_SYS_PTRACE`); where it is refused, the fds travel over a Unix socket instead
//! (SCM_RIGHTS: `extensible_kv.send_shared` / `recv_shared`).
//!
//! An fd number names a file only while its holder keeps it open: once the owner releases a
//! handle, the kernel hands the same number to the next file opened, maybe another tensor's
//! memory. So the owner keeps an [`ExportRegistry`], a memfd named after the tensor's random
//! id, with two words per granule: the serial and fd number of the exported handle that starts
//! there (cleared *before* that fd is closed), and its length in granules. An importer takes the registry by number too,
//! checks its name (the tensor's id), then takes each handle's fd and only then reads the
//! handle's word: if the word still names that serial and fd, the fd was the handle's when it
//! was taken (the owner clears the word before the number can be reused). Anything else is a
//! stale description, refused before anything is mapped.
//!
//! Promises: the system calls go through rustix, whose fd results are `OwnedFd`s; the
//! `unsafe` here is the shared mapping of a registry or a loan board (read and written only
//! through atomics inside its bounds) and the borrow of a caller's fd number for the one call
//! that duplicates it; nothing else of the process is touched.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::fs::MemfdFlags;
use rustix::mm::{MapFlags, ProtFlags};
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags};

use crate::error::{errno_name, Errno, Error, OnOp, Op, Result};
use crate::plan::Run;

/// The name prefix of registry memfds (`/memfd:<prefix><id as 32 hex digits>`).
const REGISTRY_PREFIX: &str = "extensible-kv-ids:";
/// Bits of a registry word that hold the fd number; the serial + 1 takes the rest.
const FD_BITS: u32 = 24;

/// A duplicate (close-on-exec) of `raw`, an fd the caller keeps and closes itself: checked
/// open first (`F_GETFD`), so a number that names nothing is a `ValueError`, and never adopted,
/// so no call can close a descriptor its caller uses elsewhere.
pub fn borrow_fd(raw: i32) -> Result<OwnedFd> {
    let not_open = || {
        Error::invalid(format!(
            "fd {raw} is not an open file descriptor of this process"
        ))
    };
    if raw < 0 {
        return Err(not_open());
    }
    // SAFETY: `BorrowedFd` asks that the number stay open while borrowed; the borrow lasts
    // for one fcntl, which reads the descriptor table and touches no memory. Were the number
    // closed (the caller's mistake, or another thread's close meanwhile) the kernel answers
    // EBADF, refused below; nothing of this process is used through it.
    let fd = unsafe { BorrowedFd::borrow_raw(raw) };
    rustix::io::fcntl_dupfd_cloexec(fd, 0).map_err(|errno| match errno {
        Errno::BADF => not_open(),
        _ => Error::os(Op::Import, errno, format!("duplicating fd {raw}")),
    })
}

/// What `fd` is, as `/proc/self/fd` says (`/memfd:NAME (deleted)`, `/dev/nvidiactl`, ...).
pub fn fd_target(fd: BorrowedFd<'_>) -> String {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|e| format!("<unreadable: {e}>"))
}

/// One registry word: the handle's serial + 1 (0 means "no handle") and its fd number.
fn registry_word(serial: u64, fd: i32) -> Result<u64> {
    let fd = u64::try_from(fd).ok().filter(|&fd| fd < 1 << FD_BITS);
    match (
        fd,
        serial.checked_add(1).filter(|&s| s < 1 << (64 - FD_BITS)),
    ) {
        (Some(fd), Some(serial)) => Ok(serial << FD_BITS | fd),
        _ => Err(Error::Unsupported(format!(
            "cannot share handle {serial} exported as fd {fd:?}: fd numbers from 2^{FD_BITS} \
             and more than 2^{} handles in one tensor are not supported",
            64 - FD_BITS
        ))),
    }
}

/// A shared mapping of a registry memfd: `num_words` words, unmapped on drop.
struct Words {
    ptr: NonNull<AtomicU64>,
    num_words: usize,
}

// SAFETY: the mapping is only ever accessed through atomics.
unsafe impl Send for Words {}
// SAFETY: as above.
unsafe impl Sync for Words {}

impl Words {
    fn map(fd: &OwnedFd, num_words: usize, writable: bool) -> Result<Words> {
        let prot = match writable {
            true => ProtFlags::READ | ProtFlags::WRITE,
            false => ProtFlags::READ,
        };
        let len = num_words.max(1) * 8;
        // SAFETY: a fresh shared mapping of our own fd, placed where the kernel likes; it
        // touches no existing memory.
        let raw =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, 0) }
                .on(Op::Export, || format!("mapping a registry of {len} bytes"))?;
        let ptr = NonNull::new(raw.cast::<AtomicU64>()).expect("mmap never returns null here");
        Ok(Words { ptr, num_words })
    }

    fn get(&self, index: u64) -> Option<&AtomicU64> {
        let index = usize::try_from(index)
            .ok()
            .filter(|&i| i < self.num_words)?;
        // SAFETY: `index` is inside the mapping, which lives as long as `self`; the kernel
        // aligns mappings to pages, so every word is 8-byte aligned; memory shared with other
        // processes is only ever accessed through atomics.
        Some(unsafe { &*self.ptr.as_ptr().add(index) })
    }
}

impl Drop for Words {
    fn drop(&mut self) {
        let (ptr, len) = (
            self.ptr.as_ptr().cast::<c_void>(),
            self.num_words.max(1) * 8,
        );
        // SAFETY: exactly the mapping `map` made; no reference into it outlives `self`. A
        // failed unmap leaves only a mapping of a memfd, which is nobody's to report to here.
        let _ = unsafe { rustix::mm::munmap(ptr, len) };
    }
}

/// The owner's side: which exported fd backs which handle, for importers to check against.
pub struct ExportRegistry {
    fd: OwnedFd,
    words: Words,
}

impl ExportRegistry {
    /// A registry for a tensor of `num_granules` granules named by `tensor_id`.
    pub fn create(tensor_id: u128, num_granules: u64) -> Result<ExportRegistry> {
        let name = format!("{REGISTRY_PREFIX}{tensor_id:032x}");
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC)
            .on(Op::Export, || "memfd for the export registry".into())?;
        let num_words = usize::try_from(num_granules)
            .ok()
            .and_then(|n| n.checked_mul(2))
            .filter(|n| n.checked_mul(8).is_some_and(|b| i64::try_from(b).is_ok()))
            .ok_or_else(|| Error::invalid(format!("{num_granules} granules is too many")))?;
        // Sparse: only the pages of words ever written take memory.
        rustix::fs::ftruncate(&fd, (num_words.max(1) * 8) as u64)
            .on(Op::Export, || "sizing the export registry".into())?;
        let words = Words::map(&fd, num_words, true)?;
        Ok(ExportRegistry { fd, words })
    }

    /// The registry's fd number in this process (what a description names).
    pub fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// Records that the handle `serial` over granules `run` is exported as `fd`. (Only `share`
    /// publishes, under the owner's lock, after any handle that started at the same granule
    /// was dropped: its length word is never rewritten under a live word.)
    pub fn publish(&self, run: Run, serial: u64, fd: i32) -> Result<()> {
        let word = registry_word(serial, fd)?;
        let (Some(slot), Some(len)) = self.slots(run.first_granule) else {
            return Err(Error::invalid(format!(
                "granule {} is outside the registry",
                run.first_granule
            )));
        };
        len.store(run.num_granules, Ordering::SeqCst);
        slot.store(word, Ordering::SeqCst);
        Ok(())
    }

    /// Forgets the handle `serial` at `first_granule` (exported as `fd`), unless another
    /// handle took the slot since. Call it before closing `fd`.
    pub fn withdraw(&self, first_granule: u64, serial: u64, fd: i32) {
        if let (Ok(word), (Some(slot), _)) = (registry_word(serial, fd), self.slots(first_granule))
        {
            let _ = slot.compare_exchange(word, 0, Ordering::SeqCst, Ordering::SeqCst);
        }
    }

    fn slots(&self, first_granule: u64) -> (Option<&AtomicU64>, Option<&AtomicU64>) {
        slots(&self.words, first_granule)
    }
}

/// The word and the length word of `first_granule`'s slot.
fn slots(words: &Words, first_granule: u64) -> (Option<&AtomicU64>, Option<&AtomicU64>) {
    match first_granule.checked_mul(2) {
        Some(i) => (words.get(i), words.get(i + 1)),
        None => (None, None),
    }
}

/// The importer's side: an owner's registry, checked to be the one of tensor `tensor_id`.
pub struct RegistryView {
    words: Words,
}

impl RegistryView {
    /// Maps `fd` read-only after checking that it is the registry of tensor `tensor_id`.
    pub fn open(fd: OwnedFd, tensor_id: u128) -> Result<RegistryView> {
        let expected = format!("/memfd:{REGISTRY_PREFIX}{tensor_id:032x} (deleted)");
        let target = fd_target(fd.as_fd());
        if target != expected {
            return Err(stale(format!(
                "the owner no longer holds tensor {tensor_id:032x} (its registry fd now names \
                 {target})"
            )));
        }
        let num_words = usize::try_from(file_bytes(&fd)? / 8).unwrap_or(0);
        Ok(RegistryView {
            words: Words::map(&fd, num_words, false)?,
        })
    }

    /// Whether the handle `serial` over granules `run` is still exported as `fd`.
    pub fn is_live(&self, run: Run, serial: u64, fd: i32) -> bool {
        let Ok(word) = registry_word(serial, fd) else {
            return false;
        };
        match slots(&self.words, run.first_granule) {
            (Some(slot), Some(len)) => {
                slot.load(Ordering::SeqCst) == word
                    && len.load(Ordering::SeqCst) == run.num_granules
            }
            _ => false,
        }
    }
}

/// The bytes of the file behind `fd`: a registry's or a loan board's.
fn file_bytes(fd: &OwnedFd) -> Result<u64> {
    let stat = rustix::fs::fstat(fd).on(Op::Import, || "fstat of a shared memfd".into())?;
    Ok(u64::try_from(stat.st_size).unwrap_or(0))
}

/// The error for a description whose memory the owner no longer holds as described.
pub fn stale(why: String) -> Error {
    Error::invalid(format!(
        "stale shared description: {why}; call share() again in the owner for a current one"
    ))
}

/// Another process, held by a pidfd, whose fds this process may duplicate.
pub struct Process {
    pid: i32,
    pidfd: OwnedFd,
}

impl Process {
    /// Holds process `pid` (ESRCH when there is none).
    pub fn open(pid: i32) -> Result<Process> {
        // pid_t is positive; the kernel refuses 0 and below with EINVAL.
        let pidfd = Pid::from_raw(pid.max(0))
            .ok_or(Errno::INVAL)
            .and_then(|id| rustix::process::pidfd_open(id, PidfdFlags::empty()))
            .map_err(|errno| syscall_error("pidfd_open", pid, None, errno))?;
        Ok(Process { pid, pidfd })
    }

    /// A duplicate, in this process, of the process's fd number `fd` (close-on-exec).
    pub fn take(&self, fd: i32) -> Result<OwnedFd> {
        rustix::process::pidfd_getfd(&self.pidfd, fd, PidfdGetfdFlags::empty())
            .map_err(|errno| syscall_error("pidfd_getfd", self.pid, Some(fd), errno))
    }
}

/// What a refused `pidfd_getfd` says. The pool's members look for its first words to ask the
/// lender over its socket instead (`python/extensible_kv/pool/member.py`, `PTRACE_REFUSED`).
const PTRACE_REFUSED_HINT: &str = "; this process may not trace the owner (Yama ptrace_scope, \
     another user, a container without CAP_SYS_PTRACE): have the owner pass the fds over a Unix \
     socket (extensible_kv.ipc.send_shared, then recv_shared or recv_loan here)";

fn syscall_error(call: &'static str, pid: i32, fd: Option<i32>, errno: Errno) -> Error {
    let what = match fd {
        Some(fd) => format!("fd {fd} of process {pid}"),
        None => format!("process {pid}"),
    };
    if let (Errno::BADF, Some(fd)) = (errno, fd) {
        return stale(format!("process {pid} no longer holds fd {fd}"));
    }
    if let Errno::PERM | Errno::ACCESS = errno {
        // Typed, so that callers branch on it (the fds then travel over a socket), not on text.
        return Error::PtraceRefused {
            call,
            pid,
            code: errno_name(errno),
            detail: format!("{what}{PTRACE_REFUSED_HINT}"),
        };
    }
    let hint = match errno {
        Errno::SRCH => "; the owner process is gone",
        _ => "",
    };
    Error::os(Op::Import, errno, format!("{call}: {what}{hint}"))
}

/// Where the fds of one import or borrow come from: the owner, by pid (`pidfd_getfd`, its
/// pidfd opened at the first and kept, so that every fd comes from that very process), or fds
/// this process holds already (received over a Unix socket, duplicated from the caller's),
/// each standing for the number the owner had for it. Either way an fd proves nothing by
/// itself: the caller checks each against the owner's registry or board after taking it.
pub enum FdSource {
    /// Taken from process `pid` by number.
    Owner {
        /// The owner's pid.
        pid: u32,
        /// Its pidfd, opened by the first `take`.
        process: Option<Process>,
    },
    /// Received, each with the owner's number for it.
    Received(Vec<(i32, OwnedFd)>),
}

impl FdSource {
    /// The owner `owner_pid`'s fds, or `fds` when given: exactly one per number of `numbers`
    /// (`what` names, for the error, whose numbers those are, in order).
    pub fn new(
        owner_pid: u32,
        numbers: Vec<i32>,
        fds: Option<Vec<OwnedFd>>,
        what: &str,
    ) -> Result<FdSource> {
        let Some(fds) = fds else {
            return Ok(FdSource::Owner {
                pid: owner_pid,
                process: None,
            });
        };
        if numbers.len() != fds.len() {
            return Err(Error::invalid(format!(
                "received {} fds, but {} are named: {what}",
                fds.len(),
                numbers.len()
            )));
        }
        Ok(FdSource::Received(numbers.into_iter().zip(fds).collect()))
    }

    /// The fd the owner numbers `number` (each received fd is given once).
    pub fn take(&mut self, number: i32) -> Result<OwnedFd> {
        match self {
            FdSource::Owner { pid, process } => {
                let process = match process {
                    Some(process) => process,
                    None => process.insert(Process::open(*pid as i32)?),
                };
                process.take(number)
            }
            FdSource::Received(fds) => {
                let at = fds.iter().position(|(n, _)| *n == number).ok_or_else(|| {
                    Error::invalid(format!("no received fd stands for the owner's fd {number}"))
                })?;
                Ok(fds.remove(at).1)
            }
        }
    }
}

/// The name prefix of loan boards (`/memfd:<prefix><tensor id, 32 hex>:<loan id, 16 hex>`).
const LOAN_PREFIX: &str = "extensible-kv-loan:";
/// Words of a loan board before its handles: state, epoch, borrower's start time, count.
const BOARD_HEADER_WORDS: usize = 4;
/// Words per lent handle: serial, first granule, granules, fd number, claim word.
const BOARD_HANDLE_WORDS: usize = 5;
/// A handle's claim word: no borrower has it (`FREE`), the borrowing process has unmapped and
/// released it, or never mapped it and gave it back at once (`RETURNED`), or a tensor of the
/// borrowing process maps it or is mapping it (`CLAIMED`).
const FREE: u64 = 0;
const RETURNED: u64 = 1;
const CLAIMED: u64 = 2;
/// An fd word once the lender let go of the loan's fds (`LoanBoard::withdraw`): no fd number.
const WITHDRAWN: u64 = u64::MAX;
const OFFERED: u64 = 1;
const TAKEN: u64 = 2;
const CLOSED: u64 = 3;

/// One handle a loan names, as its board records it: the lender's serial and granule run,
/// and the number of the fd the lender keeps open for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoanEntry {
    /// The lender's serial for the handle.
    pub serial: u64,
    /// The lender's granules the handle backed.
    pub run: Run,
    /// The lender's fd number of the exported handle.
    pub fd: i32,
}

/// Where a loan stands, as its board says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoardState {
    /// Lent, not borrowed: a borrower may claim it, the lender may take it back at once.
    Offered,
    /// Claimed by process `pid` (started at `start_time`, in clock ticks since boot, 0 while
    /// the borrower has not written it yet): only its give-back or its death returns it.
    Taken {
        /// The borrower's pid.
        pid: u32,
        /// The borrower's start time (`/proc/PID/stat` field 22).
        start_time: u64,
    },
    /// Reclaimed or dropped by the lender: no one may borrow it any more.
    Closed,
}

/// Why handles of a loan could not be claimed (`LoanBoard::claim`, `decline`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimRefused {
    /// Another process borrowed the loan.
    Taken {
        /// That process's pid.
        pid: u32,
    },
    /// The lender took the loan back (or let go of it).
    Closed,
    /// Handle `index` is claimed or returned already (or is no handle of the loan).
    Handle {
        /// The handle's index in the loan.
        index: usize,
    },
}

/// Serialises this process's claims of loan handles (`LoanBoard::claim`, `unclaim`,
/// `decline`): a failed borrow puts the board back to `Offered` only when no handle is
/// claimed, and no other tensor of the process may claim one between its look and its swap.
static CLAIMS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn relock_claims() -> std::sync::MutexGuard<'static, ()> {
    CLAIMS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The state of one loan, shared by its lender and its borrower: a memfd named after the
/// tensor and the loan (`extensible-kv-loan:<tensor id>:<loan id>`) holding the loan's epoch
/// (random), its state word, and per lent handle its serial, run and fd number (what the lender
/// wrote: a borrower checks the loan it was handed against it, field by field) and a claim
/// word. The state word moves by compare-and-swap only: `Offered` to `Taken` (one borrowing
/// process wins; another finds it taken), `Taken` back to `Offered` (a failed borrow, once no
/// handle of the loan is claimed or returned), and `Offered` or `Taken` to `Closed` (the
/// lender's reclaim, after the give-back or the borrower's death, from the state it saw; back
/// to that state if its mapping fails).
///
/// A loan's handles may be split between several tensors of the borrowing process (one loan
/// per lender buffer, dealt over every buffer of a cache of another model), so each handle is
/// claimed on its own: `FREE` to `CLAIMED` by compare-and-swap, once, by the tensor that maps
/// it (a replay, even in the same process, finds it claimed), then `RETURNED` once unmapped and
/// released; a handle the borrower cannot use goes from `FREE` to `RETURNED` at once
/// (`decline`). The lender maps the handles back once every one is `RETURNED`, or the borrower
/// is gone. Claims of one process are serialised by a lock of the process (`CLAIMS`), so
/// that a failed borrow's return to `Offered` (every claim word `FREE`) cannot race another
/// tensor's claim. The lender withdraws the fd words (`withdraw`) before it closes any of the
/// loan's fds, so that a borrower that reads a word after taking its fd knows the fd was the
/// lent handle's.
pub struct LoanBoard {
    fd: OwnedFd,
    words: Words,
    num_handles: usize,
}

impl LoanBoard {
    /// A board for loan `loan_id` (epoch `epoch`) of tensor `tensor_id`, lending `entries`.
    pub fn create(
        tensor_id: u128,
        loan_id: u64,
        epoch: u64,
        entries: &[LoanEntry],
    ) -> Result<LoanBoard> {
        let fd = rustix::fs::memfd_create(board_name(tensor_id, loan_id), MemfdFlags::CLOEXEC)
            .on(Op::Export, || "memfd for a loan board".into())?;
        let num_words = BOARD_HEADER_WORDS + BOARD_HANDLE_WORDS * entries.len();
        rustix::fs::ftruncate(&fd, (num_words * 8) as u64)
            .on(Op::Export, || "sizing a loan board".into())?;
        let board = LoanBoard {
            words: Words::map(&fd, num_words, true)?,
            fd,
            num_handles: entries.len(),
        };
        for (i, entry) in entries.iter().enumerate() {
            let fd = u64::try_from(entry.fd).map_err(|_| Error::invalid("a negative fd"))?;
            let values = [
                entry.serial,
                entry.run.first_granule,
                entry.run.num_granules,
                fd,
            ];
            for (k, value) in values.into_iter().enumerate() {
                board
                    .word(BOARD_HEADER_WORDS + BOARD_HANDLE_WORDS * i + k)
                    .store(value, SC);
            }
        }
        board.word(1).store(epoch, SC);
        board.word(3).store(entries.len() as u64, SC);
        board.word(0).store(OFFERED, SC); // last: a board is offered once complete
        Ok(board)
    }

    /// The board of loan `loan_id` of tensor `tensor_id` behind `fd` (taken from the lender),
    /// checked by name first: anything else is a stale loan.
    pub fn open(fd: OwnedFd, tensor_id: u128, loan_id: u64) -> Result<LoanBoard> {
        let expected = format!("/memfd:{} (deleted)", board_name(tensor_id, loan_id));
        let target = fd_target(fd.as_fd());
        if target != expected {
            return Err(stale_loan(format!(
                "the lender no longer holds loan {loan_id} of tensor {tensor_id:032x} (its \
                 board fd now names {target})"
            )));
        }
        let len = file_bytes(&fd)?;
        let num_words = usize::try_from(len / 8).unwrap_or(0);
        if num_words < BOARD_HEADER_WORDS {
            return Err(stale_loan(format!("its board holds {len} bytes")));
        }
        let words = Words::map(&fd, num_words, true)?;
        let num_handles = (num_words - BOARD_HEADER_WORDS) / BOARD_HANDLE_WORDS;
        let board = LoanBoard {
            fd,
            words,
            num_handles,
        };
        if board.word(3).load(SC) != num_handles as u64 {
            return Err(stale_loan("its board is not a complete one".into()));
        }
        Ok(board)
    }

    fn word(&self, index: usize) -> &AtomicU64 {
        self.words
            .get(index as u64)
            .expect("board words are inside the board")
    }

    /// The board's fd number in this process (what a loan names).
    pub fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// The loan's epoch (random, set by the lender).
    pub fn epoch(&self) -> u64 {
        self.word(1).load(SC)
    }

    /// The handles the lender lent, in order (a withdrawn one's fd is -1).
    pub fn entries(&self) -> Vec<LoanEntry> {
        (0..self.num_handles)
            .filter_map(|i| self.entry(i))
            .collect()
    }

    /// Handle `index` as the board names it now: read after its fd was taken, an entry that
    /// still names that fd number proves the fd was the lent handle's when it was taken (the
    /// lender withdraws every entry before it closes any of the loan's fds).
    pub fn entry(&self, index: usize) -> Option<LoanEntry> {
        let at = |k: usize| self.word(BOARD_HEADER_WORDS + BOARD_HANDLE_WORDS * index + k);
        (index < self.num_handles).then(|| LoanEntry {
            serial: at(0).load(SC),
            run: Run::new(at(1).load(SC), at(2).load(SC)),
            fd: i32::try_from(at(3).load(SC)).unwrap_or(-1),
        })
    }

    /// The lender lets go of the loan's fds (it closes its tensor): every entry stops naming
    /// an fd, before any of them is closed, since a closed number soon names another file.
    pub fn withdraw(&self) {
        for i in 0..self.num_handles {
            self.word(BOARD_HEADER_WORDS + BOARD_HANDLE_WORDS * i + 3)
                .store(WITHDRAWN, SC);
        }
    }

    /// Whether the lender let go of the loan's fds (`withdraw`).
    pub fn is_withdrawn(&self) -> bool {
        (0..self.num_handles).any(|i| {
            self.word(BOARD_HEADER_WORDS + BOARD_HANDLE_WORDS * i + 3)
                .load(SC)
                == WITHDRAWN
        })
    }

    fn claim_word(&self, index: usize) -> Option<&AtomicU64> {
        (index < self.num_handles)
            .then(|| self.word(BOARD_HEADER_WORDS + BOARD_HANDLE_WORDS * index + 4))
    }

    /// Where the loan stands.
    pub fn state(&self) -> BoardState {
        let word = self.word(0).load(SC);
        match word & 0xff {
            OFFERED => BoardState::Offered,
            TAKEN => BoardState::Taken {
                pid: (word >> 32) as u32,
                start_time: self.word(2).load(SC),
            },
            _ => BoardState::Closed,
        }
    }

    /// Claims handles `indices` for this process: the board goes from `Offered` to `Taken` by
    /// this process (or is so already: another tensor of this process claimed some of its
    /// handles), then each handle from `FREE` to `CLAIMED`. All or nothing: a handle claimed
    /// or returned already, or a board taken by another process or closed, is refused, and
    /// the claims this call made are undone.
    pub fn claim(&self, indices: &[usize]) -> std::result::Result<(), ClaimRefused> {
        let _serial = relock_claims();
        self.take_for_process()?;
        for (done, &index) in indices.iter().enumerate() {
            let claimed = self
                .claim_word(index)
                .is_some_and(|w| w.compare_exchange(FREE, CLAIMED, SC, SC).is_ok());
            if !claimed {
                for &undo in &indices[..done] {
                    if let Some(word) = self.claim_word(undo) {
                        word.store(FREE, SC);
                    }
                }
                self.offer_again_if_untouched();
                return Err(ClaimRefused::Handle { index });
            }
        }
        Ok(())
    }

    /// Undoes this process's `claim` of handles `indices` (a borrow that failed, having
    /// released every handle it imported): they are `FREE` again, and the loan is offered
    /// again once no handle of it is claimed or returned, as before the borrow.
    pub fn unclaim(&self, indices: &[usize]) {
        let _serial = relock_claims();
        for &index in indices {
            if let Some(word) = self.claim_word(index) {
                word.store(FREE, SC);
            }
        }
        self.offer_again_if_untouched();
    }

    /// Gives handles `indices` back at once, unmapped (the borrower cannot use them): each
    /// `FREE` one becomes `RETURNED`, claiming the board for this process first if need be;
    /// one claimed or returned already is left as it is. How many it marked.
    pub fn decline(&self, indices: &[usize]) -> std::result::Result<usize, ClaimRefused> {
        let _serial = relock_claims();
        self.take_for_process()?;
        let marked = indices
            .iter()
            .filter_map(|&index| self.claim_word(index))
            .filter(|word| word.compare_exchange(FREE, RETURNED, SC, SC).is_ok())
            .count();
        self.offer_again_if_untouched();
        Ok(marked)
    }

    /// `Offered` to `Taken` by this process, or `Taken` by it already (with its start time:
    /// a dead process that had this pid is another borrower). Under `CLAIMS`.
    fn take_for_process(&self) -> std::result::Result<(), ClaimRefused> {
        let pid = std::process::id();
        let start_time = process_start_time(pid).unwrap_or(0);
        let taken = u64::from(pid) << 32 | TAKEN;
        match self.word(0).compare_exchange(OFFERED, taken, SC, SC) {
            Ok(_) => {
                self.word(2).store(start_time, SC);
                Ok(())
            }
            Err(now) if now == taken && self.word(2).load(SC) == start_time => Ok(()),
            Err(_) => Err(match self.state() {
                BoardState::Taken { pid, .. } => ClaimRefused::Taken { pid },
                _ => ClaimRefused::Closed,
            }),
        }
    }

    /// Back to `Offered` if this process took the board and no handle is claimed or returned
    /// (a failed borrow undone). Under `CLAIMS`.
    fn offer_again_if_untouched(&self) {
        let untouched =
            (0..self.num_handles).all(|i| self.claim_word(i).is_some_and(|w| w.load(SC) == FREE));
        if !untouched {
            return;
        }
        let taken = u64::from(std::process::id()) << 32 | TAKEN;
        if self.word(0).load(SC) == taken {
            self.word(2).store(0, SC);
            let _ = self.word(0).compare_exchange(taken, OFFERED, SC, SC);
        }
    }

    /// Records that the borrower has unmapped and released handle `index`.
    pub fn mark_returned(&self, index: usize) {
        if let Some(word) = self.claim_word(index) {
            word.store(RETURNED, SC);
        }
    }

    /// How many of the lent handles the borrower has returned.
    pub fn num_returned(&self) -> usize {
        (0..self.num_handles)
            .filter(|&i| self.claim_word(i).is_some_and(|w| w.load(SC) == RETURNED))
            .count()
    }

    /// How many handles the loan names.
    pub fn num_handles(&self) -> usize {
        self.num_handles
    }

    /// Closes an offered loan (the lender takes it back before anyone borrowed it): whether it
    /// was offered.
    pub fn close_if_offered(&self) -> bool {
        self.close_from(BoardState::Offered)
    }

    /// Closes the loan if it still stands as `was` (the lender's reclaim, once it may map the
    /// handles back): whether it did. Atomic, so that no borrower can claim it (nor a failed
    /// borrow offer it again) between the lender's look and its mapping.
    pub fn close_from(&self, was: BoardState) -> bool {
        let was = self.encode(was);
        self.word(0).compare_exchange(was, CLOSED, SC, SC).is_ok()
    }

    /// Puts back the state `close_from` closed (a reclaim that failed to map the handles).
    pub fn reopen(&self, was: BoardState) {
        let was = self.encode(was);
        let _ = self.word(0).compare_exchange(CLOSED, was, SC, SC);
    }

    /// The state word that stands for `state` (the start time has a word of its own).
    fn encode(&self, state: BoardState) -> u64 {
        match state {
            BoardState::Offered => OFFERED,
            BoardState::Taken { pid, .. } => u64::from(pid) << 32 | TAKEN,
            BoardState::Closed => CLOSED,
        }
    }

    /// Closes the loan whatever its state (the lender has it back).
    pub fn close(&self) {
        self.word(0).store(CLOSED, SC);
    }
}

const SC: Ordering = Ordering::SeqCst;

fn board_name(tensor_id: u128, loan_id: u64) -> String {
    format!("{LOAN_PREFIX}{tensor_id:032x}:{loan_id:016x}")
}

/// The error for a loan that can no longer be borrowed as described.
pub fn stale_loan(why: String) -> Error {
    Error::invalid(format!(
        "stale or foreign loan: {why}; ask the lender for a current loan (lend again)"
    ))
}

/// Process `pid`'s start time in clock ticks since boot (`/proc/PID/stat` field 22), which
/// tells it from a later process given the same pid; `None` when there is no such live
/// process (`parse_start_time`). The line is read as bytes: a command name need not be UTF-8
/// (the kernel cuts it at 15 bytes, maybe inside a character), and a live process must never
/// read as dead, or a lender's reclaim would take back memory its borrower still maps.
pub fn process_start_time(pid: u32) -> Option<u64> {
    parse_start_time(&std::fs::read(format!("/proc/{pid}/stat")).ok()?)
}

/// The start time a `/proc/PID/stat` line gives, or `None` where it names a dead process or
/// is not such a line. The command name (field 2) may hold any bytes, spaces and parentheses
/// among them: the fields follow the last `)`, split on ASCII whitespace. State `Z` (a
/// zombie) or `X` (dead) has lost its memory and fds already: dead; every other state is a
/// live process. Field 22 is an unsigned 64-bit decimal (an optional `+`, then digits).
/// The pool's Python reads process liveness through this very function (`_native`).
pub fn parse_start_time(stat: &[u8]) -> Option<u64> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    let mut fields = stat[close + 1..]
        .split(|b| b" \t\n\r\x0b\x0c".contains(b))
        .filter(|field| !field.is_empty());
    let state = fields.next()?; // field 3
    if state == b"Z" || state == b"X" {
        return None; // exited: its fds and mappings are gone, only its exit status is left
    }
    std::str::from_utf8(fields.nth(18)?).ok()?.parse().ok() // field 22
}

/// A process this one waits on: held by a pidfd, so that a later process given the same pid
/// is never taken for it.
pub struct Watched {
    pidfd: Option<OwnedFd>,
}

impl Watched {
    /// Watches process `pid`, which started at `start_time` (0: unknown); a process that is
    /// already gone, or whose pid now names a later process, is watched as gone.
    pub fn new(pid: u32, start_time: u64) -> Watched {
        let Ok(process) = Process::open(pid as i32) else {
            return Watched { pidfd: None };
        };
        // Checked after the pidfd is open: from here on the pidfd follows this very process.
        let same = match process_start_time(pid) {
            None => false,
            Some(now) => start_time == 0 || now == start_time,
        };
        Watched {
            pidfd: same.then_some(process.pidfd),
        }
    }

    /// Waits up to `timeout_ms` for the process to exit: whether it is gone.
    pub fn wait_gone(&self, timeout_ms: i32) -> bool {
        let Some(pidfd) = &self.pidfd else {
            return true;
        };
        // A negative timeout waits for as long as it takes, as poll(2)'s does.
        let timeout = u64::try_from(timeout_ms).ok().map(|ms| Timespec {
            tv_sec: (ms / 1000) as i64,
            tv_nsec: (ms % 1000 * 1_000_000) as _,
        });
        let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
        let ready = rustix::event::poll(&mut fds, timeout.as_ref()).unwrap_or(0);
        ready > 0
            && fds[0]
                .revents()
                .intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn fd_of_process(pid: i32, fd: i32) -> Result<OwnedFd> {
        Process::open(pid)?.take(fd)
    }

    #[test]
    fn takes_a_descriptor_of_this_very_process() {
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let copy = fd_of_process(std::process::id() as i32, file.as_raw_fd()).unwrap();
        assert_ne!(copy.as_raw_fd(), file.as_raw_fd());
        let same = std::fs::File::from(copy).metadata().unwrap();
        assert_eq!(same.len(), file.metadata().unwrap().len());
    }

    #[test]
    fn a_refused_take_is_typed_and_says_that_this_process_may_not_trace_the_owner() {
        for (errno, name) in [(Errno::PERM, "EPERM"), (Errno::ACCESS, "EACCES")] {
            let refused = syscall_error("pidfd_getfd", 1, Some(7), errno);
            assert!(
                matches!(&refused, Error::PtraceRefused { pid: 1, code, .. } if code == name),
                "{refused:?}"
            );
            let refused = refused.to_string();
            assert!(refused.contains("may not trace the owner"), "{refused}");
            assert!(refused.contains("fd 7 of process 1"), "{refused}");
        }
        let gone = syscall_error("pidfd_getfd", 1, Some(7), Errno::SRCH);
        assert!(matches!(gone, Error::Driver { .. }), "{gone:?}");
        assert!(
            !gone.to_string().contains("may not trace the owner"),
            "{gone}"
        );
    }

    #[test]
    fn a_lender_closes_the_board_from_what_it_saw_so_a_failed_borrow_cannot_offer_it_again() {
        let entry = LoanEntry {
            serial: 1,
            run: Run::new(0, 1),
            fd: 40,
        };
        let board = LoanBoard::create(0xfeed, 1, 9, &[entry]).unwrap();
        board.claim(&[0]).unwrap();
        let taken = board.state();
        board.mark_returned(0); // a failed borrow releases what it imported, then unclaims
        assert!(board.close_from(taken), "the lender saw every handle back");
        board.unclaim(&[0]);
        assert_eq!(
            board.state(),
            BoardState::Closed,
            "offered while the lender maps it"
        );
        // The other order: the failed borrow offers it again first, and the lender sees that.
        board.reopen(taken);
        board.unclaim(&[0]);
        assert!(!board.close_from(taken));
        assert_eq!(board.state(), BoardState::Offered);
        assert!(board.close_if_offered());
    }

    #[test]
    fn each_handle_is_claimed_once_and_the_board_is_offered_again_only_when_untouched() {
        let entries: Vec<LoanEntry> = (0..3)
            .map(|i| LoanEntry {
                serial: i,
                run: Run::new(2 * i, 2),
                fd: 40 + i as i32,
            })
            .collect();
        let board = LoanBoard::create(0xfeed, 2, 9, &entries).unwrap();
        // Two tensors of this process split the loan: each claims its own handles.
        board.claim(&[0]).unwrap();
        assert!(
            matches!(board.state(), BoardState::Taken { pid, .. } if pid == std::process::id())
        );
        board.claim(&[2]).unwrap();
        // A handle is claimed once, even within the process; a refused claim undoes its own.
        assert_eq!(board.claim(&[1, 2]), Err(ClaimRefused::Handle { index: 2 }));
        assert_eq!(board.claim(&[7]), Err(ClaimRefused::Handle { index: 7 }));
        board.claim(&[1]).unwrap();
        board.unclaim(&[1]);
        // What nobody can use is given back at once; a claimed handle is left as it is.
        assert_eq!(board.decline(&[0, 1]).unwrap(), 1);
        assert_eq!(board.num_returned(), 1);
        // Undoing the other claims leaves the returned handle: still taken, not offered.
        board.unclaim(&[0, 2]);
        assert!(matches!(board.state(), BoardState::Taken { .. }));
        board.mark_returned(0);
        board.mark_returned(2);
        assert_eq!(board.num_returned(), 3, "the lender may map them all back");
        // A loan untouched after a failed borrow is offered again.
        let fresh = LoanBoard::create(0xfeed, 3, 9, &entries).unwrap();
        fresh.claim(&[0, 1]).unwrap();
        fresh.unclaim(&[0, 1]);
        assert_eq!(fresh.state(), BoardState::Offered);
        assert_eq!(fresh.decline(&[]).unwrap(), 0);
        assert_eq!(
            fresh.state(),
            BoardState::Offered,
            "declining nothing takes nothing"
        );
        assert!(fresh.close_if_offered());
        assert_eq!(fresh.claim(&[0]), Err(ClaimRefused::Closed));
    }

    #[test]
    fn a_withdrawn_board_names_no_fd() {
        let entries = [
            LoanEntry {
                serial: 3,
                run: Run::new(2, 2),
                fd: 40,
            },
            LoanEntry {
                serial: 4,
                run: Run::new(4, 2),
                fd: 41,
            },
        ];
        let board = LoanBoard::create(0xfeed, 1, 9, &entries).unwrap();
        let borrower = LoanBoard::open(borrow_fd(board.raw_fd()).unwrap(), 0xfeed, 1).unwrap();
        assert_eq!(borrower.entries(), entries);
        assert!(!borrower.is_withdrawn());
        board.withdraw();
        assert!(borrower.is_withdrawn());
        assert_eq!(borrower.entry(0).map(|e| e.fd), Some(-1));
        assert_eq!(
            borrower.entry(1).map(|e| (e.serial, e.run)),
            Some((4, Run::new(4, 2)))
        );
        assert_eq!(borrower.entry(2), None);
    }

    #[test]
    fn names_what_went_wrong() {
        let closed = fd_of_process(std::process::id() as i32, 1 << 20).unwrap_err();
        assert!(matches!(&closed, Error::InvalidArgument(_)), "{closed}");
        assert!(
            closed.to_string().contains("stale shared description"),
            "{closed}"
        );
        let gone = fd_of_process(i32::MAX, 0).unwrap_err();
        assert!(
            matches!(gone, Error::Driver { ref code, .. } if code == "ESRCH"),
            "{gone}"
        );
    }

    #[test]
    fn the_registry_names_live_handles_only_and_only_its_tensor() {
        let registry = ExportRegistry::create(0xfeed, 8).unwrap();
        let view = |id| RegistryView::open(borrow_fd(registry.raw_fd()).unwrap(), id);
        let other = view(0xbeef).err().expect("another tensor's id");
        assert!(
            other.to_string().contains("stale shared description"),
            "{other}"
        );
        let importer = view(0xfeed).unwrap();
        let run = Run::new(3, 2);
        assert!(!importer.is_live(run, 5, 40));
        registry.publish(run, 5, 40).unwrap();
        assert!(importer.is_live(run, 5, 40));
        assert!(!importer.is_live(run, 5, 41) && !importer.is_live(run, 6, 40));
        assert!(!importer.is_live(Run::new(3, 1), 5, 40), "another length");
        assert!(!importer.is_live(Run::new(4, 2), 5, 40));
        assert!(!importer.is_live(Run::new(u64::MAX, 1), 5, 40));
        registry.withdraw(3, 6, 40); // another handle's: leaves this one
        assert!(importer.is_live(run, 5, 40));
        registry.withdraw(3, 5, 40);
        assert!(!importer.is_live(run, 5, 40));
        assert!(
            registry.publish(Run::new(8, 1), 0, 1).is_err(),
            "past the last granule"
        );
        assert!(registry.publish(run, 0, 1 << FD_BITS).is_err());
        assert!(registry.publish(run, u64::MAX, 1).is_err());
    }

    /// The cases `tests/support/proc_stat_lines.txt` holds (which the Python tests read too):
    /// `(line, start time)`.
    fn stat_cases() -> Vec<(&'static [u8], Option<u64>)> {
        let file: &'static [u8] = include_bytes!("../tests/support/proc_stat_lines.txt");
        let lines = file
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty() && l[0] != b'#');
        let case = |line: &'static [u8]| {
            let tab = line.iter().position(|&b| b == b'\t').unwrap();
            let want = std::str::from_utf8(&line[..tab]).unwrap();
            (&line[tab + 1..], want.parse().ok())
        };
        lines.map(case).collect()
    }

    #[test]
    fn a_stat_line_gives_its_start_time_whatever_bytes_its_command_name_holds() {
        let cases = stat_cases();
        assert!(cases.len() > 10 && cases.iter().any(|(l, _)| std::str::from_utf8(l).is_err()));
        for (line, want) in cases {
            let shown = String::from_utf8_lossy(line);
            assert_eq!(parse_start_time(line), want, "{shown}");
        }
    }

    #[test]
    fn a_live_process_whose_name_is_not_utf8_is_alive() {
        // 16 bytes: the kernel keeps 15, which end in the middle of the fifth character.
        let script = r"printf 'a\346\227\245\346\234\254\350\252\236\343\201\256\345\220\215' \
                       > /proc/$$/comm && echo ready && read line";
        let mut child = std::process::Command::new("sh")
            .args(["-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = String::new();
        let stdout = child.stdout.take().unwrap();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut ready).unwrap();
        assert_eq!(ready, "ready\n");
        let stat = std::fs::read(format!("/proc/{}/stat", child.id())).unwrap();
        assert!(std::str::from_utf8(&stat).is_err(), "the name is not UTF-8");
        assert!(process_start_time(child.id()).is_some(), "alive");
        drop(child.stdin.take()); // `read` ends
        child.wait().unwrap();
        assert_eq!(process_start_time(child.id()), None, "reaped: gone");
    }

    #[test]
    fn borrowed_fds_are_copies_and_closed_numbers_are_refused() {
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let copy = borrow_fd(file.as_raw_fd()).unwrap();
        assert_ne!(copy.as_raw_fd(), file.as_raw_fd());
        drop(copy);
        file.metadata().unwrap(); // the caller's fd is still open
        for bad in [-1, 1 << 20] {
            let err = borrow_fd(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        }
    }
}
