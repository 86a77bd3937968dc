//! The host backend: CUDA's VMM semantics on Linux virtual memory.
//!
//! - reserve: an anonymous `PROT_NONE | MAP_NORESERVE` mapping, over-reserved and trimmed so
//!   its start is granularity-aligned like a CUDA reservation;
//! - a handle: one memfd, `fallocate`d so that running out of memory is an error at create
//!   time rather than a SIGBUS on first touch;
//! - map: `MAP_FIXED | MAP_SHARED` of the memfd, `PROT_NONE` until `set_access` (`mprotect`);
//! - unmap: `MAP_FIXED` anonymous `PROT_NONE` over the range, never a bare `munmap`, so the
//!   hole can never be taken by another allocation while the reservation lives.
//!
//! Soundness: every address range is checked against this driver's own books (live
//! reservations and live mappings) before any `MAP_FIXED`, `mprotect` or write, so no call can
//! clobber memory this driver does not own, whatever the caller passes.
#![allow(unsafe_code)]

pub mod events;
pub mod headroom;
pub mod stray;

use std::ffi::{c_void, CString};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use rustix::fs::{FallocateFlags, FileType, MemfdFlags};
use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};

use super::books::Books;
use super::{DeviceKind, Driver, EventId, ExportTypes, Exported, HandleId, ImportSource, Stream};
use crate::error::{errno_name, Errno, Error, OnOp, Op, Result};

/// What fresh memory of a `new_dirty` driver reads as.
pub const DIRTY_BYTE: u8 = 0xa5;

/// CUDA's granularity on Hopper, so host tests exercise the same geometry.
pub const DEFAULT_GRANULARITY: u64 = 2 << 20;

static NEXT_DRIVER_ID: AtomicU64 = AtomicU64::new(0);

/// Linux mmap + memfd backend. Each instance names its memfds `extensible-kv:<id>` so tests can
/// find exactly this instance's files and mappings in `/proc/self`.
pub struct HostDriver {
    granularity: u64,
    /// Fill fresh handles with junk and say so, as `cuMemCreate` memory may hold anything:
    /// lets host tests exercise the zeroing a CUDA grow needs.
    dirty_fresh_memory: bool,
    memfd_name: CString,
    books: Mutex<Books<OwnedFd>>,
    next_handle: AtomicU64,
    events: events::Events,
}

impl HostDriver {
    /// `granularity` must be a power of two and a multiple of the page size.
    pub fn new(granularity: u64) -> Result<HostDriver> {
        let page = page_size();
        if !granularity.is_power_of_two() || granularity % page != 0 {
            return Err(Error::invalid(format!(
                "granularity must be a power of two and a multiple of the page size ({page} \
                 bytes); got {granularity}"
            )));
        }
        let id = NEXT_DRIVER_ID.fetch_add(1, Ordering::Relaxed);
        Ok(HostDriver {
            granularity,
            dirty_fresh_memory: false,
            memfd_name: CString::new(format!("extensible-kv:{}:{id}", std::process::id()))
                .expect("no NUL in a formatted name"),
            books: Mutex::new(Books::default()),
            next_handle: AtomicU64::new(1),
            events: events::Events::default(),
        })
    }

    /// Like `new`, but fresh memory reads `DIRTY_BYTE` instead of zero (a test double for the
    /// CUDA backend's uninitialised memory).
    pub fn new_dirty(granularity: u64) -> Result<HostDriver> {
        let mut driver = HostDriver::new(granularity)?;
        driver.dirty_fresh_memory = true;
        Ok(driver)
    }

    /// The name this instance's memfds carry (`/memfd:<name>` in `/proc/self/{fd,maps}`).
    pub fn memfd_name(&self) -> &str {
        self.memfd_name.to_str().expect("ASCII name")
    }

    /// `(live handles, live mappings, live reservations)`, for leak checks.
    pub fn live_counts(&self) -> (usize, usize, usize) {
        self.books().live_counts()
    }

    /// Books change only after a call succeeded, so a panic elsewhere leaves them consistent:
    /// a poisoned lock is taken as it is (as the CUDA backend does).
    fn books(&self) -> MutexGuard<'_, Books<OwnedFd>> {
        self.books.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn check_aligned(&self, op: Op, what: &str, value: u64) -> Result<()> {
        if value % self.granularity != 0 {
            let detail = format!(
                "{what} {value:#x} is not a multiple of {}",
                self.granularity
            );
            return Err(Error::os(op, Errno::INVAL, detail));
        }
        Ok(())
    }
}

fn fill_dirty(fd: &OwnedFd, num_bytes: u64) -> Result<()> {
    let chunk = vec![DIRTY_BYTE; 1 << 16];
    let mut offset = 0u64;
    while offset < num_bytes {
        let len = chunk.len().min(bytes_as_usize(num_bytes - offset));
        let filling = || format!("filling {num_bytes} bytes");
        match rustix::io::pwrite(fd, &chunk[..len], offset).on(Op::Create, filling)? {
            0 => return Err(Error::os(Op::Create, Errno::IO, filling())),
            written => offset += written as u64,
        }
    }
    Ok(())
}

fn page_size() -> u64 {
    rustix::param::page_size() as u64
}

fn invalid_range(op: Op, va: u64, num_bytes: u64, why: &str) -> Error {
    Error::os(
        op,
        Errno::INVAL,
        format!("[{va:#x}, +{num_bytes:#x}) {why}"),
    )
}

fn bytes_as_usize(num_bytes: u64) -> usize {
    usize::try_from(num_bytes).expect("64-bit target")
}

/// Replaces `[va, va + num_bytes)` with fresh inaccessible, unbacked address space.
///
/// # Safety
/// The range must lie inside a live reservation of this driver: `MAP_FIXED` discards whatever
/// was mapped there.
unsafe fn map_inaccessible(va: u64, num_bytes: u64) -> rustix::io::Result<()> {
    let flags = MapFlags::PRIVATE | MapFlags::NORESERVE | MapFlags::FIXED;
    // SAFETY: the caller guarantees the range is ours, page-aligned like every reservation.
    unsafe {
        rustix::mm::mmap_anonymous(
            va as *mut c_void,
            bytes_as_usize(num_bytes),
            ProtFlags::empty(),
            flags,
        )
    }
    .map(drop)
}

impl Driver for HostDriver {
    fn backend_name(&self) -> &'static str {
        "host"
    }

    fn device(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn fresh_memory_is_zeroed(&self) -> bool {
        !self.dirty_fresh_memory
    }

    fn reserve(&self, num_bytes: u64) -> Result<u64> {
        self.check_aligned(Op::Reserve, "size", num_bytes)?;
        if num_bytes == 0 {
            return Err(invalid_range(Op::Reserve, 0, 0, "is empty"));
        }
        let out_of_address_space = |code: &str| Error::OutOfMemory {
            op: Op::Reserve,
            requested_bytes: num_bytes,
            free_bytes: None,
            code: code.into(),
        };
        let padded = num_bytes
            .checked_add(self.granularity)
            .ok_or_else(|| out_of_address_space("EOVERFLOW"))?;
        let flags = MapFlags::PRIVATE | MapFlags::NORESERVE;
        // SAFETY: no address and no MAP_FIXED: the kernel picks fresh address space, which
        // nothing else owns.
        let raw = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                bytes_as_usize(padded),
                ProtFlags::empty(),
                flags,
            )
        }
        .map_err(|errno| match errno {
            Errno::NOMEM => out_of_address_space("ENOMEM"),
            _ => Error::os(Op::Reserve, errno, format!("{num_bytes} bytes")),
        })?;
        let raw = raw as u64;
        let start = raw.next_multiple_of(self.granularity);
        let (head, tail) = (start - raw, padded - (start - raw) - num_bytes);
        // SAFETY: head and tail are the ends of the mapping made just above, outside the
        // aligned range we keep; nobody else has seen these addresses yet. Were an unmap to
        // fail, the end would stay reserved, inaccessible, which harms nothing.
        unsafe {
            if head > 0 {
                let _ = rustix::mm::munmap(raw as *mut c_void, bytes_as_usize(head));
            }
            if tail > 0 {
                let _ =
                    rustix::mm::munmap((start + num_bytes) as *mut c_void, bytes_as_usize(tail));
            }
        }
        let mut books = self.books();
        books.reservations.insert(start, num_bytes);
        stray::register(start, num_bytes);
        Ok(start)
    }

    fn free_reservation(&self, va: u64, num_bytes: u64) -> Result<()> {
        let refused = |why: &str| invalid_range(Op::FreeReservation, va, num_bytes, why);
        self.books().free_reservation(va, num_bytes, refused, || {
            // Unregistered before the addresses can be anyone else's.
            stray::unregister(va);
            // SAFETY: the books found the range exactly one live reservation of ours with
            // nothing mapped in it.
            unsafe { rustix::mm::munmap(va as *mut c_void, bytes_as_usize(num_bytes)) }
                .on(Op::FreeReservation, || format!("{num_bytes} bytes"))
        })
    }

    fn supported_export_types(&self) -> ExportTypes {
        ExportTypes::POSIX_FD
    }

    /// Every memfd is exportable as a POSIX fd, whatever `_export` asks.
    fn create(&self, num_bytes: u64, _export: ExportTypes) -> Result<HandleId> {
        self.check_aligned(Op::Create, "size", num_bytes)?;
        self.check_room(num_bytes)?;
        let fd = rustix::fs::memfd_create(self.memfd_name.as_c_str(), MemfdFlags::CLOEXEC)
            .on(Op::Create, || format!("memfd for {num_bytes} bytes"))?;
        if i64::try_from(num_bytes).is_err() {
            return Err(Error::invalid(format!("{num_bytes} bytes is too large")));
        }
        rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, num_bytes).map_err(|errno| {
            match errno {
                Errno::NOSPC | Errno::NOMEM | Errno::FBIG => Error::OutOfMemory {
                    op: Op::Create,
                    requested_bytes: num_bytes,
                    free_bytes: self.mem_info().ok().map(|(free, _)| free),
                    code: errno_name(errno),
                },
                _ => Error::os(Op::Create, errno, format!("fallocate {num_bytes} bytes")),
            }
        })?;
        if self.dirty_fresh_memory {
            fill_dirty(&fd, num_bytes)?;
        }
        let id = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.books().handles.insert(id, (fd, num_bytes));
        Ok(HandleId(id))
    }

    fn export(&self, handle: HandleId, kind: ExportTypes) -> Result<Exported> {
        if kind != ExportTypes::POSIX_FD {
            return Err(Error::Unsupported(format!(
                "the host backend exports POSIX fds only, not {kind:?}"
            )));
        }
        let books = self.books();
        let Some((fd, _)) = books.handles.get(&handle.0) else {
            let detail = format!("no live handle {}", handle.0);
            return Err(Error::os(Op::Export, Errno::BADF, detail));
        };
        let copy = fd
            .try_clone()
            .on(Op::Export, || "duplicating a memfd".into())?;
        Ok(Exported::Fd(copy))
    }

    fn import(&self, source: ImportSource<'_>, num_bytes: u64) -> Result<HandleId> {
        self.check_aligned(Op::Import, "size", num_bytes)?;
        let ImportSource::Fd(fd) = source else {
            return Err(Error::Unsupported(
                "the host backend imports POSIX fds only, not fabric handles".into(),
            ));
        };
        let stat = rustix::fs::fstat(fd).on(Op::Import, || "fstat of the fd".into())?;
        let is_file = FileType::from_raw_mode(stat.st_mode) == FileType::RegularFile;
        let len = u64::try_from(stat.st_size).unwrap_or(0);
        // A memfd of another size (or not a file at all) is not the handle described.
        if !is_file || len != num_bytes {
            let what = if is_file { "file" } else { "non-file" };
            let detail =
                format!("the fd is a {what} of {len} bytes, not a memfd of {num_bytes} bytes");
            return Err(Error::os(Op::Import, Errno::INVAL, detail));
        }
        let fd = fd
            .try_clone_to_owned()
            .on(Op::Import, || "duplicating the fd".into())?;
        let id = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.books().handles.insert(id, (fd, num_bytes));
        Ok(HandleId(id))
    }

    fn release(&self, handle: HandleId) -> Result<()> {
        let mut books = self.books();
        match books.handles.remove(&handle.0) {
            Some(_) => Ok(()), // the OwnedFd closes here; live mappings keep the file alive
            None => {
                let detail = format!("no live handle {}", handle.0);
                Err(Error::os(Op::Release, Errno::BADF, detail))
            }
        }
    }

    fn map(&self, va: u64, num_bytes: u64, handle: HandleId) -> Result<()> {
        self.check_aligned(Op::Map, "address", va)?;
        let refused = |why: &str| invalid_range(Op::Map, va, num_bytes, why);
        self.books().map(va, num_bytes, handle.0, refused, |fd| {
            let flags = MapFlags::SHARED | MapFlags::FIXED;
            let len = bytes_as_usize(num_bytes);
            // SAFETY: the books found the range inside one of our reservations, overlapping no
            // live mapping, so MAP_FIXED replaces only our own PROT_NONE placeholder; fd is a
            // live memfd of ours of num_bytes.
            unsafe { rustix::mm::mmap(va as *mut c_void, len, ProtFlags::empty(), flags, fd, 0) }
                .map(drop)
                .on(Op::Map, || format!("{num_bytes} bytes at {va:#x}"))
        })
    }

    fn unmap(&self, va: u64, num_bytes: u64) -> Result<()> {
        let refused = |why: &str| invalid_range(Op::Unmap, va, num_bytes, why);
        self.books().unmap(va, num_bytes, refused, || {
            // SAFETY: the books found the range tiled by live mappings of ours, all inside our
            // reservations.
            unsafe { map_inaccessible(va, num_bytes) }
                .on(Op::Unmap, || format!("{num_bytes} bytes at {va:#x}"))
        })
    }

    fn set_access(&self, va: u64, num_bytes: u64) -> Result<()> {
        let refused = |why: &str| invalid_range(Op::SetAccess, va, num_bytes, why);
        self.books().set_access(va, num_bytes, refused, || {
            let prot = MprotectFlags::READ | MprotectFlags::WRITE;
            let len = bytes_as_usize(num_bytes);
            // SAFETY: the books found the range tiled by live shared mappings of ours; mprotect
            // changes only their protection.
            unsafe { rustix::mm::mprotect(va as *mut c_void, len, prot) }
                .on(Op::SetAccess, || format!("{num_bytes} bytes at {va:#x}"))
        })
    }

    fn memset_zero(&self, va: u64, num_bytes: u64, _stream: Stream) -> Result<()> {
        if num_bytes == 0 {
            return Ok(());
        }
        let books = self.books();
        if let Some(why) = books.refuse_memset(va, num_bytes) {
            return Err(invalid_range(Op::Memset, va, num_bytes, why));
        }
        // SAFETY: the range is covered by live read-write mappings of ours (checked above under
        // the lock that every unmap also takes); writing zeros there cannot alias Rust objects.
        unsafe { std::ptr::write_bytes(va as *mut u8, 0, bytes_as_usize(num_bytes)) };
        Ok(())
    }

    fn copy(&self, dst: u64, src: u64, num_bytes: u64, _stream: Stream) -> Result<()> {
        if num_bytes == 0 {
            return Ok(());
        }
        let books = self.books();
        if let Some((va, why)) = books.refuse_copy(dst, src, num_bytes) {
            return Err(invalid_range(Op::Copy, va, num_bytes, why));
        }
        // SAFETY: both ranges are covered by live read-write mappings of ours (checked above
        // under the lock every unmap takes) and are disjoint, so neither aliases a Rust object
        // nor the other.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src as *const u8,
                dst as *mut u8,
                bytes_as_usize(num_bytes),
            )
        };
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.events.synchronize();
        Ok(())
    }

    fn fence(&self, _stream: Stream) -> Result<()> {
        Ok(()) // work on any stream ran before its call returned; held events wait on nothing
    }

    fn record_event(&self, _stream: Stream) -> Result<Option<EventId>> {
        Ok(self.events.record())
    }

    fn wait_event(&self, event: EventId) -> Result<()> {
        self.events.wait(event)
    }

    fn destroy_event(&self, event: EventId) -> Result<()> {
        self.events.destroy(event)
    }

    fn hold_events(&self, held: bool) -> Result<()> {
        self.events.hold(held);
        Ok(())
    }

    fn mem_info(&self) -> Result<(u64, u64)> {
        let (_, total) = mem_info_from(MEMINFO)?;
        Ok((free_bytes()?, total))
    }

    fn note_layout(&self, va: u64, offsets: &[u64], capacities: &[u64], committed: &[u64]) {
        stray::note_layout(va, offsets, capacities, committed);
    }

    /// Refuses what does not fit `MemAvailable` and the memory cgroup's room, before any
    /// memfd exists: `fallocate` would not fail but feed the OOM killer (`headroom`).
    fn check_room(&self, num_bytes: u64) -> Result<()> {
        match headroom::current() {
            Some(room) if num_bytes > room.bytes() => Err(Error::OutOfMemory {
                op: Op::Create,
                requested_bytes: num_bytes,
                free_bytes: Some(room.bytes()),
                code: "ENOMEM".into(),
            }),
            _ => Ok(()),
        }
    }
}

/// The bytes a host commit can take now: `MemAvailable`, or the room under the memory
/// cgroup's limit where that is less (`headroom`). `check_room` refuses a commit of more, so a
/// budget taken from this figure is one the host backend accepts.
pub fn free_bytes() -> Result<u64> {
    let (available, _) = mem_info_from(MEMINFO)?;
    Ok(headroom::current().map_or(available, |h| h.bytes()))
}

/// Where Linux reports memory.
pub const MEMINFO: &str = "/proc/meminfo";

/// `(MemAvailable, MemTotal)` in bytes from a file in `/proc/meminfo`'s format: the host's
/// free and total memory (available counts reclaimable caches, as a new allocation sees it).
pub fn mem_info_from(path: &str) -> Result<(u64, u64)> {
    let meminfo = std::fs::read_to_string(path).on(Op::MemInfo, || format!("reading {path}"))?;
    let field = |name: &str| -> Option<u64> {
        let line = meminfo.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    };
    match (field("MemAvailable:"), field("MemTotal:")) {
        (Some(free), Some(total)) => Ok((free, total)),
        _ => Err(Error::os(
            Op::MemInfo,
            Errno::INVAL,
            format!("no MemAvailable/MemTotal in {path}"),
        )),
    }
}

impl Drop for HostDriver {
    fn drop(&mut self) {
        // Owners free everything before their driver goes; this only guards against a leak
        // of address space if one did not.
        // A destructor never panics: a poisoned lock still holds consistent books (`books`).
        let books = self.books.get_mut().unwrap_or_else(PoisonError::into_inner);
        for (&start, &len) in &books.reservations {
            stray::unregister(start);
            // SAFETY: each entry is a live reservation of ours; nothing can use it any more,
            // since the driver that hands out its addresses is being dropped. A destructor has
            // no one to report a failed unmap to: the range would stay reserved, inaccessible.
            let _ = unsafe { rustix::mm::munmap(start as *mut c_void, bytes_as_usize(len)) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_info_reads_available_and_total() {
        let path = std::env::temp_dir().join(format!("ekv-meminfo-{}", std::process::id()));
        std::fs::write(
            &path,
            "MemTotal:  100 kB\nMemFree: 10 kB\nMemAvailable:   42 kB\n",
        )
        .unwrap();
        let path = path.to_str().unwrap();
        assert_eq!(mem_info_from(path).unwrap(), (42 * 1024, 100 * 1024));
        std::fs::write(path, "MemTotal:  100 kB\n").unwrap();
        assert!(matches!(
            mem_info_from(path),
            Err(Error::Driver {
                op: Op::MemInfo,
                ..
            })
        ));
        std::fs::remove_file(path).unwrap();
        match mem_info_from(path) {
            Err(Error::Driver { code, .. }) => assert_eq!(code, "ENOENT"),
            other => panic!("expected ENOENT, got {other:?}"),
        }
        let (free, total) = HostDriver::new(4096).unwrap().mem_info().unwrap();
        assert!(0 < free && free <= total);
    }

    #[test]
    fn check_room_refuses_more_than_the_headroom_with_the_numbers() {
        let driver = HostDriver::new(4096).unwrap();
        driver.check_room(4096).unwrap();
        let room = headroom::current().unwrap().bytes();
        let requested = room + (1 << 30);
        match driver.check_room(requested) {
            Err(err @ Error::OutOfMemory { .. }) => {
                let message = err.to_string();
                let Error::OutOfMemory {
                    op,
                    requested_bytes,
                    free_bytes: Some(free),
                    code,
                } = err
                else {
                    panic!("no free bytes in {message}");
                };
                assert_eq!(
                    (op, requested_bytes, code.as_str()),
                    (Op::Create, requested, "ENOMEM")
                );
                assert!(free < requested, "{message}");
                assert!(message.contains(&format!("{requested} bytes")), "{message}");
                assert!(message.contains(&format!("{free} bytes free")), "{message}");
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        assert_eq!(driver.live_counts(), (0, 0, 0));
    }

    #[test]
    fn a_poisoned_books_lock_fails_no_call_and_panics_no_destructor() {
        let driver = HostDriver::new(4096).unwrap();
        let kept = driver.reserve(4 * 4096).unwrap();
        let freed = driver.reserve(4096).unwrap();
        std::thread::scope(|scope| {
            let held = scope.spawn(|| {
                let _books = driver.books.lock();
                panic!("poisoning on purpose");
            });
            assert!(held.join().is_err());
        });
        assert!(driver.books.is_poisoned());
        driver.free_reservation(freed, 4096).unwrap();
        assert_eq!(driver.live_counts(), (0, 0, 1));
        let mapped = |va: u64| {
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            maps.lines().any(|line| {
                let range = line.split_whitespace().next().unwrap();
                let (start, end) = range.split_once('-').unwrap();
                let parse = |hex| u64::from_str_radix(hex, 16).unwrap();
                (parse(start)..parse(end)).contains(&va)
            })
        };
        assert!(mapped(kept));
        drop(driver); // unmaps the reservation left behind rather than panic
        assert!(!mapped(kept));
    }
}
