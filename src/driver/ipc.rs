//! Taking another process's file descriptor: `pidfd_open` + `pidfd_getfd` (Linux 5.6), the
//! way PyTorch's expandable segments share memory. The owner keeps each exported fd open for
//! as long as its handle lives; an importer duplicates it by (pid, fd number). That needs
//! ptrace access to the owner (same user, and Yama's `ptrace_scope` allowing it, or
//! `CAP_SYS_PTRACE`); where it is refused, the fds travel over a Unix socket instead
//! (SCM_RIGHTS: `extensible_kv.send_shared` / `recv_shared`).
//!
//! Promises: the only `unsafe` here wraps the two raw syscalls, whose results become
//! `OwnedFd`s at once; nothing else of the process is touched.
#![allow(unsafe_code)]

use std::os::fd::{FromRawFd, OwnedFd};

use super::host::os_error;
use crate::error::{Error, Op, Result};

/// Takes ownership of file descriptor `raw`, handed over by its holder (e.g. one received over
/// a Unix socket): it is closed when the result drops.
///
/// # Safety
/// `raw` must be an open fd that nothing else uses or closes from now on.
pub unsafe fn adopt_fd(raw: i32) -> OwnedFd {
    // SAFETY: the caller hands over an open fd that nothing else will use.
    unsafe { OwnedFd::from_raw_fd(raw) }
}

/// A duplicate, in this process, of file descriptor `fd` of process `pid`.
pub fn fd_of_process(pid: i32, fd: i32) -> Result<OwnedFd> {
    let pidfd = pidfd_open(pid)?;
    getfd(&pidfd, pid, fd)
}

fn pidfd_open(pid: i32) -> Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags by value and touches no memory of ours.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let raw = i32::try_from(raw).unwrap_or(-1);
    if raw < 0 {
        return Err(syscall_error("pidfd_open", pid, None));
    }
    // SAFETY: the kernel just returned this fd, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn getfd(pidfd: &OwnedFd, pid: i32, fd: i32) -> Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_getfd takes a live pidfd (borrowed for the call), an fd number and flags
    // by value; it touches no memory of ours.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    let raw = i32::try_from(raw).unwrap_or(-1);
    if raw < 0 {
        return Err(syscall_error("pidfd_getfd", pid, Some(fd)));
    }
    // SAFETY: the kernel just returned this fd (close-on-exec), owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn syscall_error(call: &str, pid: i32, fd: Option<i32>) -> Error {
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    let what = match fd {
        Some(fd) => format!("{call}: fd {fd} of process {pid}"),
        None => format!("{call}: process {pid}"),
    };
    let hint = match errno {
        libc::EPERM | libc::EACCES => {
            "; this process may not trace the owner (Yama ptrace_scope, another user): pass \
             the fds over a Unix socket with send_shared/recv_shared"
        }
        libc::ESRCH => "; the owner process is gone",
        libc::EBADF => "; the owner no longer holds that fd (the handle was released)",
        _ => "",
    };
    os_error(Op::Import, errno, format!("{what}{hint}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn takes_a_descriptor_of_this_very_process() {
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let copy = fd_of_process(std::process::id() as i32, file.as_raw_fd()).unwrap();
        assert_ne!(copy.as_raw_fd(), file.as_raw_fd());
        let same = std::fs::File::from(copy).metadata().unwrap();
        assert_eq!(same.len(), file.metadata().unwrap().len());
    }

    #[test]
    fn names_what_went_wrong() {
        let closed = fd_of_process(std::process::id() as i32, 1 << 20).unwrap_err();
        assert!(
            matches!(&closed, Error::Driver { op: Op::Import, code, .. } if code == "EBADF"),
            "{closed}"
        );
        assert!(closed.to_string().contains("no longer holds"), "{closed}");
        let gone = fd_of_process(i32::MAX, 0).unwrap_err();
        assert!(
            matches!(gone, Error::Driver { ref code, .. } if code == "ESRCH"),
            "{gone}"
        );
    }
}
