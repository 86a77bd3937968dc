//! The RAII owners of driver resources: one per reservation, physical handle and mapping,
//! each releasing its resource on drop, and the context (`Ctx`) their destructors share,
//! which records the errors a destructor cannot return.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;

use crate::driver::{Driver, ExportTypes, Exported, HandleId};
use crate::error::{Error, Result};
use crate::ipc::ExportRegistry;
use crate::plan::Run;

/// What the destructors of driver resources share: the driver, where the reservation starts
/// and its granularity (a mapping's addresses follow from its granule run), and the errors they
/// could not return (a destructor never panics; `take_deferred_errors` reports them later).
pub(super) struct Ctx {
    pub(super) driver: Arc<dyn Driver>,
    /// The reservation's first address, for the tensor's whole life.
    pub(super) base: u64,
    /// The geometry's granularity, which never changes either.
    pub(super) granularity: u64,
    /// What every new handle is created exportable as.
    pub(super) export_types: ExportTypes,
    pub(super) serials: AtomicU64,
    /// Each with the thread that met it: an operation reports as its own only what its
    /// thread met, not what the release thread met meanwhile (`take_deferred_since`).
    pub(super) deferred: Mutex<Vec<(ThreadId, Error)>>,
    /// The messages of deferred errors not yet handed to `take_unwarned` (the bindings log
    /// each once, as a warning).
    pub(super) unwarned: Mutex<Vec<(ThreadId, String)>>,
    /// Which exported fd backs which handle, for importers to check (made by the first
    /// `share` of fds; closed by `close`, after every handle, or with the `Ctx`).
    pub(super) registry: Mutex<Option<ExportRegistry>>,
}

impl Ctx {
    pub(super) fn next_serial(&self) -> u64 {
        self.serials.fetch_add(1, Ordering::Relaxed)
    }

    /// `(va, num_bytes)` of granule `run`.
    pub(super) fn span(&self, run: Run) -> (u64, u64) {
        let bytes = run.bytes(self.granularity);
        (self.base + bytes.offset, bytes.num_bytes)
    }

    pub(super) fn defer(&self, result: Result<()>) {
        if let Err(err) = result {
            let me = std::thread::current().id();
            relock(&self.unwarned).push((me, err.to_string()));
            relock(&self.deferred).push((me, err));
        }
    }

    pub(super) fn num_deferred(&self) -> usize {
        relock(&self.deferred).len()
    }

    /// The errors this thread deferred since there were `mark`, taken out of the deferred
    /// list: what the operation that set the mark met itself. Other threads' (the release
    /// thread's, deferred while the operation ran) stay for `take_deferred_errors`.
    pub(super) fn take_deferred_since(&self, mark: usize) -> Vec<Error> {
        let me = std::thread::current().id();
        let mut deferred = relock(&self.deferred);
        let mark = mark.min(deferred.len());
        let (own, others): (Vec<_>, Vec<_>) = deferred
            .split_off(mark)
            .into_iter()
            .partition(|(by, _)| *by == me);
        deferred.extend(others);
        drop(deferred);
        // Their messages are the last this thread left, unless logged already.
        let mut unwarned = relock(&self.unwarned);
        let mut to_drop = own.len();
        let mut i = unwarned.len();
        while to_drop > 0 && i > 0 {
            i -= 1;
            if unwarned[i].0 == me {
                unwarned.remove(i);
                to_drop -= 1;
            }
        }
        own.into_iter().map(|(_, err)| err).collect()
    }

    /// Puts back errors `take_deferred_since` took that the operation does not return.
    pub(super) fn keep_deferred(&self, errors: Vec<Error>) {
        let me = std::thread::current().id();
        relock(&self.deferred).extend(errors.into_iter().map(|err| (me, err)));
    }

    /// Every deferred error, taken out (their messages too: the caller reports them).
    pub(super) fn take_all_deferred(&self) -> Vec<Error> {
        relock(&self.unwarned).clear();
        let all = std::mem::take(&mut *relock(&self.deferred));
        all.into_iter().map(|(_, err)| err).collect()
    }

    /// The messages of deferred errors not logged yet, each once.
    pub(super) fn take_unwarned(&self) -> Vec<String> {
        let all = std::mem::take(&mut *relock(&self.unwarned));
        all.into_iter().map(|(_, message)| message).collect()
    }
}

/// The lock of `mutex`, even when a thread panicked holding it: a destructor must never
/// panic, and what these mutexes guard (lists of errors, a snapshot) stays consistent.
pub(super) fn relock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `err`, an error met by an operation that went on to complete, saying so: `done` states
/// what holds now. (Only a driver's detail can carry it; other kinds are returned as they are.)
pub(super) fn completed_despite(err: Error, more: usize, done: &str) -> Error {
    match err {
        Error::Driver { op, code, detail } => {
            let more = match more {
                0 => String::new(),
                n => format!("; {n} more in take_deferred_errors()"),
            };
            let sep = if detail.is_empty() { "" } else { "; " };
            Error::Driver {
                op,
                code,
                detail: format!("{detail}{sep}{done}{more}"),
            }
        }
        other => other,
    }
}

/// Owns the address reservation that starts at `ctx.base`; frees it on drop.
pub(super) struct Reservation {
    pub(super) ctx: Arc<Ctx>,
    pub(super) num_bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.ctx.defer(
            self.ctx
                .driver
                .free_reservation(self.ctx.base, self.num_bytes),
        );
    }
}

/// Owns a physical handle; releases it on drop.
pub(super) struct PhysicalHandle {
    pub(super) ctx: Arc<Ctx>,
    pub(super) id: HandleId,
    /// Names the handle across processes: the owner numbers its handles in creation order,
    /// an importer keeps the owner's numbers (so `refresh` can tell which it has).
    pub(super) serial: u64,
    /// The export made by the first `share` that needed it (the export cost, docs/design.md
    /// §2), kept for the
    /// handle's life: an importer duplicates the owner's fd while the owner holds it.
    pub(super) exported: OnceLock<Exported>,
    /// The first granule under which `share` recorded the exported fd in the registry.
    pub(super) published_at: OnceLock<u64>,
    /// For a borrowed handle, the lender's board slot to mark once it is released.
    pub(super) loan: Option<super::loan::LoanSlot>,
}

impl Drop for PhysicalHandle {
    fn drop(&mut self) {
        // Before the exported fd closes (a field, dropped after this): once it is closed, its
        // number may name other memory, which importers must not take for this handle.
        if let (Some(&granule), Some(Exported::Fd(fd))) =
            (self.published_at.get(), self.exported.get())
        {
            use std::os::fd::AsRawFd;
            if let Some(registry) = relock(&self.ctx.registry).as_ref() {
                registry.withdraw(granule, self.serial, fd.as_raw_fd());
            }
        }
        self.ctx.defer(self.ctx.driver.release(self.id));
        // Unmapped (a mapping holds its handle) and released: the lender may map it again.
        if let Some(slot) = &self.loan {
            slot.board.mark_returned(slot.index);
        }
    }
}

/// Owns the mapping of one whole handle over `run`; unmaps on drop, then releases the handle.
pub(super) struct Mapping {
    pub(super) run: Run,
    /// `None` only inside `unmap`, which hands the handle back.
    pub(super) handle: Option<PhysicalHandle>,
}

impl PhysicalHandle {
    pub(super) fn create(ctx: &Arc<Ctx>, num_bytes: u64) -> Result<PhysicalHandle> {
        // The driver may have stopped offering fabric since (a refused fabric allocation).
        let export = ctx
            .export_types
            .intersection(ctx.driver.supported_export_types());
        let id = ctx.driver.create(num_bytes, export)?;
        Ok(PhysicalHandle::adopt(ctx, id, ctx.next_serial()))
    }

    /// The handle's export, made as `kind` by the first caller that needs one and kept for
    /// the handle's life (a later caller gets that one, whatever its kind).
    pub(super) fn export_once(&self, kind: ExportTypes) -> Result<&Exported> {
        if let Some(exported) = self.exported.get() {
            return Ok(exported);
        }
        let exported = self.ctx.driver.export(self.id, kind)?;
        Ok(self.exported.get_or_init(|| exported))
    }

    /// Owns handle `id` of `ctx`'s driver from now on.
    pub(super) fn adopt(ctx: &Arc<Ctx>, id: HandleId, serial: u64) -> PhysicalHandle {
        PhysicalHandle {
            ctx: Arc::clone(ctx),
            id,
            serial,
            exported: OnceLock::new(),
            published_at: OnceLock::new(),
            loan: None,
        }
    }
}

impl Mapping {
    /// Creates a handle for `run` and maps it there.
    pub(super) fn create(ctx: &Arc<Ctx>, run: Run) -> Result<Mapping> {
        let handle = PhysicalHandle::create(ctx, ctx.span(run).1)?;
        Mapping::map(handle, run)
    }

    /// Maps all of `handle` over `run` (which spans exactly its size).
    pub(super) fn map(handle: PhysicalHandle, run: Run) -> Result<Mapping> {
        let (va, num_bytes) = handle.ctx.span(run);
        handle.ctx.driver.map(va, num_bytes, handle.id)?;
        Ok(Mapping {
            run,
            handle: Some(handle),
        })
    }

    /// Maps an unmapped handle, still holding its bytes, back over `run` and grants access:
    /// the undo of a failed swap or release. A failure here (a second fault in one call) is
    /// recorded for `take_deferred_errors`, and `None` leaves the run unmapped.
    pub(super) fn map_back(handle: PhysicalHandle, run: Run) -> Option<Mapping> {
        let ctx = Arc::clone(&handle.ctx);
        match Mapping::map(handle, run) {
            Ok(mapping) => {
                let (va, num_bytes) = ctx.span(run);
                ctx.defer(ctx.driver.set_access(va, num_bytes));
                Some(mapping)
            }
            Err(err) => {
                ctx.defer(Err(err));
                None
            }
        }
    }

    /// `map`, handing the handle back with the error when the driver refuses.
    #[allow(clippy::result_large_err)]
    pub(super) fn try_map(
        handle: PhysicalHandle,
        run: Run,
    ) -> std::result::Result<Mapping, (Error, PhysicalHandle)> {
        let (va, num_bytes) = handle.ctx.span(run);
        match handle.ctx.driver.map(va, num_bytes, handle.id) {
            Ok(()) => Ok(Mapping {
                run,
                handle: Some(handle),
            }),
            Err(err) => Err((err, handle)),
        }
    }

    pub(super) fn handle(&self) -> &PhysicalHandle {
        self.handle.as_ref().expect("a mapping holds its handle")
    }

    pub(super) fn ctx(&self) -> &Arc<Ctx> {
        &self.handle().ctx
    }

    pub(super) fn num_bytes(&self) -> u64 {
        self.ctx().span(self.run).1
    }

    /// Unmaps now and hands back the (still live) handle, or, if the driver refuses, the
    /// mapping itself with the error.
    #[allow(clippy::result_large_err)]
    pub(super) fn unmap(mut self) -> std::result::Result<PhysicalHandle, (Error, Mapping)> {
        let handle = self.handle.take().expect("a mapping holds its handle");
        let (va, num_bytes) = handle.ctx.span(self.run);
        match handle.ctx.driver.unmap(va, num_bytes) {
            Ok(()) => Ok(handle),
            Err(err) => {
                self.handle = Some(handle);
                Err((err, self))
            }
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Some(handle) = &self.handle {
            let (va, num_bytes) = handle.ctx.span(self.run);
            handle.ctx.defer(handle.ctx.driver.unmap(va, num_bytes));
        }
    }
}

/// A tensor's mappings, keyed by first granule (so a grow finds its neighbours in
/// O(log handles)), and the bytes they map, kept as they come and go: the getters' snapshot
/// is taken after every hold of the tensor's lock, and summing the handles there made each
/// one-granule grow cost O(handles) (3.6x slower after 10,000 grows on the H200).
///
/// Invariant: `bytes` is the sum of the mappings' `num_bytes`. Reads go through `Deref`;
/// every change goes through the methods below, which keep it.
#[derive(Default)]
pub(super) struct Mappings {
    by_first_granule: BTreeMap<u64, Mapping>,
    bytes: u64,
}

impl Mappings {
    pub(super) fn insert(&mut self, mapping: Mapping) {
        self.bytes += mapping.num_bytes();
        let first_granule = mapping.run.first_granule;
        let replaced = self.by_first_granule.insert(first_granule, mapping);
        debug_assert!(
            replaced.is_none(),
            "granule {first_granule} was mapped twice"
        );
    }

    pub(super) fn remove(&mut self, first_granule: u64) -> Option<Mapping> {
        let mapping = self.by_first_granule.remove(&first_granule)?;
        self.bytes -= mapping.num_bytes();
        Some(mapping)
    }

    /// Takes every mapping out, in address order.
    pub(super) fn take_all(&mut self) -> Vec<Mapping> {
        self.bytes = 0;
        std::mem::take(&mut self.by_first_granule)
            .into_values()
            .collect()
    }

    /// Drops every mapping, in address order: each unmaps, then releases its handle.
    pub(super) fn clear(&mut self) {
        self.by_first_granule.clear();
        self.bytes = 0;
    }

    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl std::ops::Deref for Mappings {
    type Target = BTreeMap<u64, Mapping>;
    fn deref(&self) -> &Self::Target {
        &self.by_first_granule
    }
}
