//! Helpers shared by the Rust integration tests, each of which includes this file as `mod common`
//! (`#[path = "support/common.rs"]`): byte access to host-backend memory through an export (whose
//! guard keeps the memory alive), and /proc-based leak counts.
#![allow(unsafe_code, dead_code)]

use extensible_kv::ExtensibleTensor;

/// Reads `len` bytes at `offset` of a host-backend tensor; the range must be committed.
pub fn read(tensor: &ExtensibleTensor, offset: u64, len: u64) -> Vec<u8> {
    let region = tensor.view(offset, len).expect("export");
    // SAFETY: the export checked the range lies in the reservation and its guard keeps the
    // memory mapped; callers only read committed (mapped, accessible) bytes.
    unsafe { std::slice::from_raw_parts(region.ptr() as *const u8, len as usize).to_vec() }
}

/// Writes `bytes` at `offset` of a host-backend tensor; the range must be committed.
pub fn write(tensor: &ExtensibleTensor, offset: u64, bytes: &[u8]) {
    let region = tensor.view(offset, bytes.len() as u64).expect("export");
    // SAFETY: as in `read`; no Rust reference aliases this memory.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), region.ptr() as *mut u8, bytes.len()) }
}

/// `(open memfds, mapped memfd regions)` whose name contains `name` as a whole word, from
/// /proc/self. Whole words, because driver names end in a counter: `extensible-kv:<pid>:1` is
/// a prefix of driver 10's name, whose files other tests' threads open and close meanwhile.
pub fn proc_memfds(name: &str) -> (usize, usize) {
    let fds = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| names(&target.to_string_lossy(), name))
        .count();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let maps = maps.lines().filter(|l| names(l, name)).count();
    (fds, maps)
}

/// Whether `text` holds `name` with no name character right after it.
fn names(text: &str, name: &str) -> bool {
    text.match_indices(name).any(|(at, _)| {
        text[at + name.len()..]
            .chars()
            .next()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == ':' || c == '-'))
    })
}
