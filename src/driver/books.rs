//! What a backend has handed out and not yet taken back: reservations, mappings (and whether
//! access was granted) and physical handles. Both backends check every address range against
//! these books before touching the OS or the driver — that check is what makes the `Driver`
//! trait's methods safe to call with any arguments. Pure bookkeeping: no FFI.
//!
//! The mutating calls (`map`, `unmap`, `set_access`, `free_reservation`) take the backend's
//! FFI call as a closure: the books check the range, run the call, and change only once it
//! succeeded, so a backend states nothing but its call and how it names a refusal.

use std::collections::{BTreeMap, HashMap};

/// The books of one backend; `H` is what the backend keeps per handle (a memfd, or nothing).
pub(crate) struct Books<H> {
    /// start → length of each live reservation.
    pub reservations: BTreeMap<u64, u64>,
    /// start → (length, accessible) of each live mapping.
    pub mappings: BTreeMap<u64, (u64, bool)>,
    /// handle id → (backend data, length) of each live handle.
    pub handles: HashMap<u64, (H, u64)>,
}

impl<H> Default for Books<H> {
    fn default() -> Self {
        Books {
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            handles: HashMap::new(),
        }
    }
}

impl<H> Books<H> {
    /// `(live handles, live mappings, live reservations)`, for leak checks.
    pub fn live_counts(&self) -> (usize, usize, usize) {
        (
            self.handles.len(),
            self.mappings.len(),
            self.reservations.len(),
        )
    }

    /// Frees the reservation `[va, va + num_bytes)` with `free`, once the books allow it
    /// (else `refused(why)`), and forgets it once `free` succeeded.
    pub fn free_reservation<E>(
        &mut self,
        va: u64,
        num_bytes: u64,
        refused: impl FnOnce(&str) -> E,
        free: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        if let Some(why) = self.refuse_free(va, num_bytes) {
            return Err(refused(why));
        }
        free()?;
        self.reservations.remove(&va);
        Ok(())
    }

    /// Maps `handle` at `[va, va + num_bytes)` with `map`, given the backend's data of the
    /// handle, once the books allow it (else `refused(why)`); books the mapping, not yet
    /// accessible, once `map` succeeded.
    pub fn map<E>(
        &mut self,
        va: u64,
        num_bytes: u64,
        handle: u64,
        refused: impl FnOnce(&str) -> E,
        map: impl FnOnce(&H) -> Result<(), E>,
    ) -> Result<(), E> {
        if let Some(why) = self.refuse_map(va, num_bytes, handle) {
            return Err(refused(&why));
        }
        map(&self.handles[&handle].0)?;
        self.mappings.insert(va, (num_bytes, false));
        Ok(())
    }

    /// Unmaps the whole mappings that tile `[va, va + num_bytes)` with `unmap` (else
    /// `refused(why)`), and forgets them once `unmap` succeeded.
    pub fn unmap<E>(
        &mut self,
        va: u64,
        num_bytes: u64,
        refused: impl FnOnce(&str) -> E,
        unmap: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        let why = "does not cover whole mappings";
        for start in self.call_on_tiling(va, num_bytes, why, refused, unmap)? {
            self.mappings.remove(&start);
        }
        Ok(())
    }

    /// Grants access to the whole mappings that tile `[va, va + num_bytes)` with `grant` (else
    /// `refused(why)`), and marks them accessible once `grant` succeeded.
    pub fn set_access<E>(
        &mut self,
        va: u64,
        num_bytes: u64,
        refused: impl FnOnce(&str) -> E,
        grant: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        let why = "is not wholly mapped";
        for start in self.call_on_tiling(va, num_bytes, why, refused, grant)? {
            self.mappings
                .entry(start)
                .and_modify(|(_, accessible)| *accessible = true);
        }
        Ok(())
    }

    /// The starts of the whole mappings that tile `[va, va + num_bytes)`, once `call` on the
    /// range succeeded; `refused(why)` where they do not tile it, and `call` is not made.
    fn call_on_tiling<E>(
        &self,
        va: u64,
        num_bytes: u64,
        why: &str,
        refused: impl FnOnce(&str) -> E,
        call: impl FnOnce() -> Result<(), E>,
    ) -> Result<Vec<u64>, E> {
        let starts = self.tiling(va, num_bytes).ok_or_else(|| refused(why))?;
        call()?;
        Ok(starts)
    }

    fn inside_reservation(&self, va: u64, num_bytes: u64) -> bool {
        let Some((&start, &len)) = self.reservations.range(..=va).next_back() else {
            return false;
        };
        va.checked_add(num_bytes)
            .is_some_and(|end| end <= start + len)
    }

    /// Why `[va, va + num_bytes)` cannot be freed as a reservation, if it cannot.
    fn refuse_free(&self, va: u64, num_bytes: u64) -> Option<&'static str> {
        if self.reservations.get(&va) != Some(&num_bytes) {
            return Some("is not a reservation");
        }
        let end = va.checked_add(num_bytes)?;
        self.mappings
            .range(va..end)
            .next()
            .map(|_| "is still mapped")
    }

    /// Why a mapping of `handle` cannot go at `[va, va + num_bytes)`, if it cannot.
    fn refuse_map(&self, va: u64, num_bytes: u64, handle: u64) -> Option<String> {
        match self.handles.get(&handle) {
            None => return Some(format!("names no live handle ({handle:#x})")),
            Some((_, len)) if *len != num_bytes => {
                return Some(format!("!= the handle's {len} bytes"))
            }
            Some(_) => {}
        }
        if !self.inside_reservation(va, num_bytes) {
            return Some("is outside every reservation".into());
        }
        let before_end = self.mappings.range(..va + num_bytes).next_back();
        before_end
            .is_some_and(|(&start, &(len, _))| start + len > va)
            .then(|| "is already mapped".into())
    }

    /// The starts of the whole mappings that tile `[va, va + num_bytes)` exactly, if they do.
    fn tiling(&self, va: u64, num_bytes: u64) -> Option<Vec<u64>> {
        let end = va.checked_add(num_bytes)?;
        let mut cursor = va;
        let mut starts = Vec::new();
        for (&start, &(len, _)) in self.mappings.range(va..end) {
            if start != cursor {
                return None;
            }
            starts.push(start);
            cursor = start + len;
        }
        (cursor == end && !starts.is_empty()).then_some(starts)
    }

    /// Whether accessible mappings cover `[va, va + num_bytes)` (which may cut through them).
    pub fn accessible(&self, va: u64, num_bytes: u64) -> bool {
        let Some(end) = va.checked_add(num_bytes) else {
            return false;
        };
        let first = self
            .mappings
            .range(..=va)
            .next_back()
            .map_or(va, |(&start, _)| start);
        let mut cursor = va;
        for (&start, &(len, accessible)) in self.mappings.range(first..end) {
            if start > cursor || !accessible {
                return false;
            }
            cursor = cursor.max(start + len);
        }
        cursor >= end
    }

    /// Why `[va, va + num_bytes)` cannot be zeroed, if it cannot: it must lie in accessible
    /// mappings (and may cut through them).
    pub fn refuse_memset(&self, va: u64, num_bytes: u64) -> Option<&'static str> {
        (!self.accessible(va, num_bytes)).then_some("is not mapped read-write")
    }

    /// Why `num_bytes` cannot be copied from `src` to `dst`, if they cannot: the address of
    /// the range at fault and why. Both ranges must lie in accessible mappings and be disjoint.
    pub fn refuse_copy(&self, dst: u64, src: u64, num_bytes: u64) -> Option<(u64, &'static str)> {
        if let Some(va) = [dst, src]
            .into_iter()
            .find(|&va| !self.accessible(va, num_bytes))
        {
            return Some((va, "is not mapped read-write"));
        }
        (dst.abs_diff(src) < num_bytes).then_some((dst, "overlaps the source"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Books with one 8 MiB reservation at 64 MiB, 2 MiB mapped at its start (accessible) and
    /// 2 MiB right after (not yet accessible), and a free 2 MiB handle 7.
    fn books() -> Books<()> {
        let mut books = Books::default();
        books.reservations.insert(64 * MIB, 8 * MIB);
        books.mappings.insert(64 * MIB, (2 * MIB, true));
        books.mappings.insert(66 * MIB, (2 * MIB, false));
        books.handles.insert(7, ((), 2 * MIB));
        books
    }

    #[test]
    fn books_refuse_bad_maps() {
        let books = books();
        assert_eq!(books.refuse_map(68 * MIB, 2 * MIB, 7), None);
        assert_eq!(books.refuse_map(70 * MIB, 2 * MIB, 7), None);
        assert!(books
            .refuse_map(68 * MIB, 2 * MIB, 8)
            .unwrap()
            .contains("no live handle"));
        assert!(books
            .refuse_map(68 * MIB, 4 * MIB, 7)
            .unwrap()
            .contains("!="));
        assert!(books
            .refuse_map(72 * MIB, 2 * MIB, 7)
            .unwrap()
            .contains("outside"));
        assert!(books
            .refuse_map(62 * MIB, 2 * MIB, 7)
            .unwrap()
            .contains("outside"));
        assert!(books
            .refuse_map(u64::MAX - MIB, 2 * MIB, 7)
            .unwrap()
            .contains("outside"));
        assert!(books
            .refuse_map(66 * MIB, 2 * MIB, 7)
            .unwrap()
            .contains("already mapped"));
        assert!(books
            .refuse_map(67 * MIB, 2 * MIB, 7)
            .unwrap()
            .contains("already mapped"));
    }

    #[test]
    fn books_tile_whole_mappings_only() {
        let books = books();
        assert_eq!(
            books.tiling(64 * MIB, 4 * MIB),
            Some(vec![64 * MIB, 66 * MIB])
        );
        assert_eq!(books.tiling(66 * MIB, 2 * MIB), Some(vec![66 * MIB]));
        assert_eq!(books.tiling(64 * MIB, MIB), None, "part of a mapping");
        assert_eq!(
            books.tiling(64 * MIB, 6 * MIB),
            None,
            "runs past the mappings"
        );
        assert_eq!(books.tiling(68 * MIB, 2 * MIB), None, "nothing mapped");
        assert_eq!(books.tiling(u64::MAX, 2), None);
    }

    #[test]
    fn books_know_what_is_accessible() {
        let books = books();
        assert!(books.accessible(64 * MIB, 2 * MIB));
        assert!(
            books.accessible(64 * MIB + 3, MIB),
            "may cut through a mapping"
        );
        assert!(
            !books.accessible(64 * MIB, 2 * MIB + 1),
            "runs into an inaccessible mapping"
        );
        assert!(!books.accessible(68 * MIB, 1), "unmapped");
        assert!(
            !books.accessible(63 * MIB, 2 * MIB),
            "starts before the mappings"
        );
        assert!(!books.accessible(u64::MAX, 2));
    }

    #[test]
    fn books_refuse_memsets_outside_accessible_mappings() {
        let books = books();
        assert_eq!(books.refuse_memset(64 * MIB, 2 * MIB), None);
        assert_eq!(books.refuse_memset(65 * MIB + 3, MIB - 3), None);
        let refused = Some("is not mapped read-write");
        assert_eq!(
            books.refuse_memset(66 * MIB, 1),
            refused,
            "mapped, not accessible"
        );
        assert_eq!(
            books.refuse_memset(64 * MIB, 2 * MIB + 1),
            refused,
            "runs past access"
        );
        assert_eq!(
            books.refuse_memset(68 * MIB, MIB),
            refused,
            "reserved, not mapped"
        );
        assert_eq!(
            books.refuse_memset(63 * MIB, MIB + 1),
            refused,
            "starts outside"
        );
        assert_eq!(books.refuse_memset(u64::MAX, 2), refused, "wraps around");
    }

    #[test]
    fn books_refuse_copies_outside_accessible_mappings_or_overlapping() {
        let books = books();
        assert_eq!(books.refuse_copy(64 * MIB, 65 * MIB, MIB), None);
        let unmapped = "is not mapped read-write";
        assert_eq!(
            books.refuse_copy(66 * MIB, 64 * MIB, MIB),
            Some((66 * MIB, unmapped)),
            "destination not accessible"
        );
        assert_eq!(
            books.refuse_copy(64 * MIB, 68 * MIB, MIB),
            Some((68 * MIB, unmapped)),
            "source not mapped"
        );
        assert_eq!(
            books.refuse_copy(64 * MIB, 64 * MIB + 4096, MIB),
            Some((64 * MIB, "overlaps the source"))
        );
        assert_eq!(
            books.refuse_copy(64 * MIB, u64::MAX, 2),
            Some((u64::MAX, unmapped)),
            "wraps around"
        );
    }

    /// A call that records it ran and then succeeds or fails.
    fn call(ran: &mut bool, ok: bool) -> Result<(), String> {
        *ran = true;
        ok.then_some(()).ok_or_else(|| "the call failed".into())
    }

    #[test]
    fn books_change_only_after_the_call_succeeded() {
        let mut books = books();
        let refused = |why: &str| format!("refused: {why}");
        let mut ran = false;
        let err = books.unmap(64 * MIB, MIB, refused, || call(&mut ran, true));
        assert_eq!(err.unwrap_err(), "refused: does not cover whole mappings");
        assert!(!ran, "a refused range reaches no call");
        let err = books.set_access(68 * MIB, 2 * MIB, refused, || call(&mut ran, true));
        assert_eq!(err.unwrap_err(), "refused: is not wholly mapped");
        let err = books.map(66 * MIB, 2 * MIB, 7, refused, |_| call(&mut ran, true));
        assert!(err.unwrap_err().contains("already mapped"));
        let err = books.free_reservation(64 * MIB, 8 * MIB, refused, || call(&mut ran, true));
        assert_eq!(err.unwrap_err(), "refused: is still mapped");
        assert!(!ran);

        let failed = books.unmap(64 * MIB, 4 * MIB, refused, || call(&mut ran, false));
        assert_eq!(failed.unwrap_err(), "the call failed");
        assert!(ran);
        assert!(books
            .set_access(66 * MIB, 2 * MIB, refused, || call(&mut ran, false))
            .is_err());
        assert!(books
            .map(68 * MIB, 2 * MIB, 7, refused, |_| call(&mut ran, false))
            .is_err());
        assert_eq!(books.mappings.len(), 2, "a failed call books nothing");
        assert!(!books.accessible(66 * MIB, 1));

        books
            .set_access(66 * MIB, 2 * MIB, refused, || call(&mut ran, true))
            .unwrap();
        assert!(books.accessible(64 * MIB, 4 * MIB));
        books
            .map(68 * MIB, 2 * MIB, 7, refused, |()| call(&mut ran, true))
            .unwrap();
        assert_eq!(books.mappings.get(&(68 * MIB)), Some(&(2 * MIB, false)));
        books
            .unmap(64 * MIB, 6 * MIB, refused, || call(&mut ran, true))
            .unwrap();
        assert!(books.mappings.is_empty());
        let failed = books.free_reservation(64 * MIB, 8 * MIB, refused, || call(&mut ran, false));
        assert!(failed.is_err());
        assert_eq!(books.live_counts(), (1, 0, 1));
        books
            .free_reservation(64 * MIB, 8 * MIB, refused, || call(&mut ran, true))
            .unwrap();
        assert_eq!(books.live_counts(), (1, 0, 0));
    }

    #[test]
    fn books_refuse_bad_frees() {
        let books = books();
        assert_eq!(
            books.refuse_free(64 * MIB, 8 * MIB),
            Some("is still mapped")
        );
        assert_eq!(
            books.refuse_free(64 * MIB, 4 * MIB),
            Some("is not a reservation")
        );
        let mut empty = books;
        empty.mappings.clear();
        assert_eq!(empty.refuse_free(64 * MIB, 8 * MIB), None);
    }
}
