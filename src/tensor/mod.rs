//! `ExtensibleTensor`: one address reservation whose physical memory is committed later, in
//! lockstep across its segments.
//!
//! Approach: the reservation is made once, so every address handed out stays valid for the
//! tensor's life (CUDA graphs may capture them). A grow plans the missing granules
//! (`plan.rs`), creates and maps one physical handle per planned run into locals, grants
//! access to the new mappings only, zeroes the new logical bytes, and only then moves the new
//! mappings into the tensor. Any failure drops the locals, whose destructors unmap and release
//! what this call made: a failed grow changes nothing.
//!
//! Giving memory back keeps the data: a shrink releases the handles no committed byte needs;
//! an exact shrink and `consolidate` re-back runs of granules by new handles. Those are built
//! at a scratch reservation and filled by a copy, then swapped in at the same addresses; the
//! old handles are released only once every new one is in, so a failed swap maps them back.
//!
//! Invariants (checked by `check_invariants` after every mutation in debug builds and tests):
//! 1. committed bytes are a prefix of every segment: `segment_bytes[i] <= capacity[i]`;
//! 2. `mappings` are sorted, disjoint, granule-aligned, each exactly one live handle, so a
//!    granule is mapped at most once (the dedup of shared granules);
//! 3. every granule holding a committed byte is mapped and accessible;
//! 4. every view handed out holds an `Arc` of the inner state: memory outlives the last view;
//! 5. nothing is unmapped before the driver is synchronised (the fence), except mappings this
//!    very call made and nothing has touched yet.
//!
//! Limitations: `release_physical` drops everything (no pool of handles is kept for a later
//! grow); a consolidation is all or nothing per run of granules, not across runs.

mod reback;
mod share;

pub use share::{SharedDescription, SharedExport, SharedHandle};

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::driver::ipc::ExportRegistry;
use crate::driver::{DeviceKind, Driver, ExportTypes, Exported, HandleId, Stream};
use crate::error::{Error, Result, SizeOp};
use crate::plan::{self, ByteRange, Geometry, HandlePolicy, Run};

/// The default cap on a handle's size: large enough that a bulk commit runs near memset speed,
/// small enough to avoid the outliers of giant handles (docs/design.md §2).
pub const DEFAULT_MAX_HANDLE_BYTES: u64 = 1 << 30;

/// Construction options; `Default` gives the driver's granularity and cap-aligned handles of at
/// most `DEFAULT_MAX_HANDLE_BYTES`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// The mapping granularity: a power-of-two multiple of the driver's. Default: the driver's.
    pub granularity: Option<u64>,
    /// How grows cut runs of missing granules into physical handles.
    pub handle_sizing: HandleSizing,
    /// How every physical allocation may be exported to other processes (`share`). POSIX fd
    /// must be supported by the device; fabric is dropped where it is not.
    pub export_types: ExportTypes,
}

/// How grows cut each run of missing granules into physical handles: the one handle-sizing
/// knob. Each `max_bytes` must be a positive multiple of the granularity, except that the
/// default cap (`DEFAULT_MAX_HANDLE_BYTES`) rises to a larger granularity. Maps onto
/// `plan::HandlePolicy` of the same variant name, in granules.
///
/// Each handle's create and set-access calls cost 40-60 us of host time whatever its size
/// (docs/benchmarks.md), so fewer handles make grows cheaper; a cap keeps giant handles'
/// outliers away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandleSizing {
    /// Cut at the multiples of `max_bytes` in the reservation, nowhere else (the default). On
    /// vLLM 0.34's layouts (a segment per layer, each grown from its first block, so every run
    /// starts one granule past a boundary) aligned powers of two cost 3x the handles.
    CapAligned {
        /// The largest handle, in bytes.
        max_bytes: u64,
    },
    /// Aligned powers of two of at most `max_bytes`: O(log n) handles for a bulk grow.
    AlignedPowersOfTwo {
        /// The largest handle, in bytes.
        max_bytes: u64,
    },
    /// One handle per run from its start, in pieces of `max_bytes`: SGLang's arena does this
    /// (its owner uses 8 GiB); a granule-sized cap is what per-granule peers do.
    PerRun {
        /// The largest handle, in bytes.
        max_bytes: u64,
    },
    /// One handle per run, however long.
    WholeRuns,
}

impl Default for HandleSizing {
    fn default() -> HandleSizing {
        HandleSizing::CapAligned {
            max_bytes: DEFAULT_MAX_HANDLE_BYTES,
        }
    }
}

impl HandleSizing {
    /// The plan's policy for granules of `granularity`; an error names `max_handle_bytes`
    /// when the cap is not a positive multiple of it.
    pub fn policy(self, granularity: u64) -> Result<HandlePolicy> {
        let cap = |max_bytes: u64| {
            let max_bytes = match max_bytes {
                DEFAULT_MAX_HANDLE_BYTES => max_bytes.max(granularity),
                other => other,
            };
            plan::handle_granules(max_bytes, granularity)
        };
        Ok(match self {
            HandleSizing::CapAligned { max_bytes } => HandlePolicy::CapAligned {
                max_handle_granules: cap(max_bytes)?,
            },
            HandleSizing::AlignedPowersOfTwo { max_bytes } => HandlePolicy::AlignedPowersOfTwo {
                max_handle_granules: cap(max_bytes)?,
            },
            HandleSizing::PerRun { max_bytes } => HandlePolicy::PerRun {
                max_handle_granules: cap(max_bytes)?,
            },
            HandleSizing::WholeRuns => HandlePolicy::WholeRuns,
        })
    }
}

/// Sizes for a per-segment call, as Python's `*_per_segment_` take them: one size for every
/// segment (a `u64`), or one per segment (a slice, an array or a `Vec`).
pub trait PerSegment {
    /// One size per segment of a tensor of `num_segments`. (A count other than
    /// `num_segments` is the callee's to refuse.)
    fn per_segment(&self, num_segments: usize) -> Cow<'_, [u64]>;
}

impl PerSegment for u64 {
    fn per_segment(&self, num_segments: usize) -> Cow<'_, [u64]> {
        Cow::Owned(vec![*self; num_segments])
    }
}

impl PerSegment for &[u64] {
    fn per_segment(&self, _: usize) -> Cow<'_, [u64]> {
        Cow::Borrowed(self)
    }
}

impl PerSegment for &Vec<u64> {
    fn per_segment(&self, _: usize) -> Cow<'_, [u64]> {
        Cow::Borrowed(self)
    }
}

impl<const N: usize> PerSegment for [u64; N] {
    fn per_segment(&self, _: usize) -> Cow<'_, [u64]> {
        Cow::Borrowed(self)
    }
}

impl<const N: usize> PerSegment for &[u64; N] {
    fn per_segment(&self, _: usize) -> Cow<'_, [u64]> {
        Cow::Borrowed(*self)
    }
}

/// How a tensor's capacity is cut into segments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segments {
    /// `num_segments` equal segments of `max_bytes / num_segments` bytes.
    Equal {
        /// The total capacity in bytes.
        max_bytes: u64,
        /// How many segments share it.
        num_segments: u64,
    },
    /// Segments of these capacities, back to back.
    Capacities(Vec<u64>),
}

impl Segments {
    /// What a caller means who states the total and, optionally, the count and the capacities:
    /// without capacities, equal segments (one by default); with them, those, which must sum
    /// to `max_bytes` and, if a count is given too, be that many.
    pub fn stated(
        max_bytes: u64,
        num_segments: Option<u64>,
        capacities: Option<Vec<u64>>,
    ) -> Result<Segments> {
        let Some(capacities) = capacities else {
            return Ok(Segments::Equal {
                max_bytes,
                num_segments: num_segments.unwrap_or(1),
            });
        };
        let total: u128 = capacities.iter().map(|&c| u128::from(c)).sum();
        if total != u128::from(max_bytes) {
            return Err(Error::invalid(format!(
                "segment_capacities sum to {total} bytes, but max_bytes is {max_bytes}"
            )));
        }
        match num_segments {
            Some(n) if n != capacities.len() as u64 => Err(Error::invalid(format!(
                "num_segments is {n} but segment_capacities has {} entries",
                capacities.len()
            ))),
            _ => Ok(Segments::Capacities(capacities)),
        }
    }
}

/// What the destructors of driver resources share: the driver, where the reservation starts
/// and its granularity (a mapping's addresses follow from its granule run), and the errors they
/// could not return (a destructor never panics; `take_deferred_errors` reports them later).
struct Ctx {
    driver: Arc<dyn Driver>,
    /// The reservation's first address, for the tensor's whole life.
    base: u64,
    /// The geometry's granularity, which never changes either.
    granularity: u64,
    /// What every new handle is created exportable as.
    export_types: ExportTypes,
    serials: AtomicU64,
    deferred: Mutex<Vec<Error>>,
    /// The messages of deferred errors not yet handed to `take_unwarned` (the bindings log
    /// each once, as a warning).
    unwarned: Mutex<Vec<String>>,
    /// Which exported fd backs which handle, for importers to check (made by the first
    /// `share` of fds; closed after every handle, since each holds the `Ctx`).
    registry: OnceLock<ExportRegistry>,
}

impl Ctx {
    fn next_serial(&self) -> u64 {
        self.serials.fetch_add(1, Ordering::Relaxed)
    }

    /// `(va, num_bytes)` of granule `run`.
    fn span(&self, run: Run) -> (u64, u64) {
        let bytes = run.bytes(self.granularity);
        (self.base + bytes.offset, bytes.num_bytes)
    }

    fn defer(&self, result: Result<()>) {
        if let Err(err) = result {
            relock(&self.unwarned).push(err.to_string());
            relock(&self.deferred).push(err);
        }
    }

    fn num_deferred(&self) -> usize {
        relock(&self.deferred).len()
    }

    /// The errors deferred since there were `mark`, taken out of the deferred list: what the
    /// operation that set the mark met itself.
    fn take_deferred_since(&self, mark: usize) -> Vec<Error> {
        let mut deferred = relock(&self.deferred);
        let mark = mark.min(deferred.len());
        let own = deferred.split_off(mark);
        drop(deferred);
        let mut unwarned = relock(&self.unwarned);
        let keep = unwarned.len().saturating_sub(own.len());
        unwarned.truncate(keep);
        own
    }
}

/// The lock of `mutex`, even when a thread panicked holding it: a destructor must never
/// panic, and what these mutexes guard (lists of errors, a snapshot) stays consistent.
fn relock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `err`, an error met by an operation that went on to complete, saying so: `done` states
/// what holds now. (Only a driver's detail can carry it; other kinds are returned as they are.)
fn completed_despite(err: Error, more: usize, done: &str) -> Error {
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

/// How one grow runs; `Default` maps with the tensor's policy and zeroes nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrowOptions {
    /// Zero the new logical bytes of every segment.
    pub zero_new: bool,
    /// The stream the zeroing is ordered on.
    pub stream: Stream,
    /// Back each run of missing granules by one handle, whatever the policy: after a
    /// `release_physical`, one such grow backs every granule-aligned segment by a single
    /// allocation, which RDMA registration of a segment needs (UCX cannot span handles).
    pub one_handle_per_run: bool,
}

/// How one shrink runs; `Default` keeps straddling handles whole.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShrinkOptions {
    /// Replace each handle that straddles the new frontier by handles of just the granules
    /// still needed, copying their bytes, so that no slack stays mapped. Otherwise such a
    /// handle stays whole and its slack counts in `physical_bytes`.
    pub exact: bool,
    /// The stream the copies are ordered on.
    pub stream: Stream,
}

impl GrowOptions {
    /// Zero the new bytes on the backend's default stream.
    pub fn zeroed() -> GrowOptions {
        GrowOptions {
            zero_new: true,
            ..GrowOptions::default()
        }
    }
}

/// Whether a grow zeroes its new bytes, on which stream, and whether it has queued any.
struct Zeroing {
    enabled: bool,
    stream: Stream,
    queued: bool,
}

impl Zeroing {
    fn new(enabled: bool, stream: Stream) -> Zeroing {
        Zeroing {
            enabled,
            stream,
            queued: false,
        }
    }
}

/// Owns the address reservation that starts at `ctx.base`; frees it on drop.
struct Reservation {
    ctx: Arc<Ctx>,
    num_bytes: u64,
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
struct PhysicalHandle {
    ctx: Arc<Ctx>,
    id: HandleId,
    /// Names the handle across processes: the owner numbers its handles in creation order,
    /// an importer keeps the owner's numbers (so `refresh` can tell which it has).
    serial: u64,
    /// The export made by the first `share` that needed it (~0.6 ms on CUDA), kept for the
    /// handle's life: an importer duplicates the owner's fd while the owner holds it.
    exported: OnceLock<Exported>,
    /// The first granule under which `share` recorded the exported fd in the registry.
    published_at: OnceLock<u64>,
}

impl Drop for PhysicalHandle {
    fn drop(&mut self) {
        // Before the exported fd closes (a field, dropped after this): once it is closed, its
        // number may name other memory, which importers must not take for this handle.
        if let (Some(&granule), Some(registry), Some(Exported::Fd(fd))) = (
            self.published_at.get(),
            self.ctx.registry.get(),
            self.exported.get(),
        ) {
            use std::os::fd::AsRawFd;
            registry.withdraw(granule, self.serial, fd.as_raw_fd());
        }
        self.ctx.defer(self.ctx.driver.release(self.id));
    }
}

/// Owns the mapping of one whole handle over `run`; unmaps on drop, then releases the handle.
struct Mapping {
    run: Run,
    /// `None` only inside `unmap`, which hands the handle back.
    handle: Option<PhysicalHandle>,
}

impl PhysicalHandle {
    fn create(ctx: &Arc<Ctx>, num_bytes: u64) -> Result<PhysicalHandle> {
        // The driver may have stopped offering fabric since (a refused fabric allocation).
        let export = ctx
            .export_types
            .intersection(ctx.driver.supported_export_types());
        let id = ctx.driver.create(num_bytes, export)?;
        Ok(PhysicalHandle::adopt(ctx, id, ctx.next_serial()))
    }

    /// Owns handle `id` of `ctx`'s driver from now on.
    fn adopt(ctx: &Arc<Ctx>, id: HandleId, serial: u64) -> PhysicalHandle {
        PhysicalHandle {
            ctx: Arc::clone(ctx),
            id,
            serial,
            exported: OnceLock::new(),
            published_at: OnceLock::new(),
        }
    }
}

impl Mapping {
    /// Creates a handle for `run` and maps it there.
    fn create(ctx: &Arc<Ctx>, run: Run) -> Result<Mapping> {
        let handle = PhysicalHandle::create(ctx, ctx.span(run).1)?;
        Mapping::map(handle, run)
    }

    /// Maps all of `handle` over `run` (which spans exactly its size).
    fn map(handle: PhysicalHandle, run: Run) -> Result<Mapping> {
        let (va, num_bytes) = handle.ctx.span(run);
        handle.ctx.driver.map(va, num_bytes, handle.id)?;
        Ok(Mapping {
            run,
            handle: Some(handle),
        })
    }

    fn handle(&self) -> &PhysicalHandle {
        self.handle.as_ref().expect("a mapping holds its handle")
    }

    fn ctx(&self) -> &Arc<Ctx> {
        &self.handle().ctx
    }

    fn num_bytes(&self) -> u64 {
        self.ctx().span(self.run).1
    }

    /// Unmaps now and hands back the (still live) handle, or, if the driver refuses, the
    /// mapping itself with the error.
    #[allow(clippy::result_large_err)]
    fn unmap(mut self) -> std::result::Result<PhysicalHandle, (Error, Mapping)> {
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

struct State {
    segment_bytes: Vec<u64>,
    /// Keyed by first granule, so a grow finds and inserts its neighbours in O(log handles)
    /// however many handles the tensor holds (invariant 2).
    mappings: BTreeMap<u64, Mapping>,
    /// `None` once closed.
    reservation: Option<Reservation>,
}

/// What the getters report, published at the end of every hold of the state's lock: getters
/// read it without waiting for an operation that holds the state (a 2 GiB grow holds it for
/// half a second; a serving stack's scheduler thread must not stall on a statistics read).
#[derive(Clone, Debug, Default)]
struct Snapshot {
    segment_bytes: Vec<u64>,
    physical_bytes: u64,
    num_handles: usize,
    /// Set by `close` before it lets go of anything, with the live views checked under the
    /// same lock that `view` counts a new view under: no view can slip in meanwhile.
    closed: bool,
}

impl Snapshot {
    fn of(state: &State) -> Snapshot {
        Snapshot {
            segment_bytes: state.segment_bytes.clone(),
            physical_bytes: state.mappings.values().map(Mapping::num_bytes).sum(),
            num_handles: state.mappings.len(),
            closed: state.reservation.is_none(),
        }
    }
}

/// The state's lock, which publishes what changed when released: a new `Snapshot`, and every
/// segment's committed bytes to the driver (for the report of a stray access,
/// `driver::stray`). No change can forget to.
struct Locked<'a> {
    guard: MutexGuard<'a, State>,
    inner: &'a Inner,
}

impl std::ops::Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.guard
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let snapshot = Snapshot::of(&self.guard);
        if snapshot.segment_bytes != relock(&self.inner.snapshot).segment_bytes {
            self.inner.note_layout(&snapshot.segment_bytes);
        }
        *relock(&self.inner.snapshot) = snapshot;
    }
}

struct Inner {
    ctx: Arc<Ctx>,
    geometry: Geometry,
    policy: HandlePolicy,
    state: Mutex<State>,
    /// Published by every `Locked` as it goes; held only to copy it in or out.
    snapshot: Mutex<Snapshot>,
    live_views: AtomicUsize,
    /// The owner's pid when this tensor maps memory another process owns (`import`): it
    /// follows the owner (`refresh`) and can never grow, shrink or release that memory.
    imported_from: Option<u32>,
    /// A random id (never 0) naming the memory across processes: an owner's own, an
    /// importer's the owner's, so `refresh` can refuse another tensor's description.
    tensor_id: u128,
}

impl Inner {
    fn note_layout(&self, committed: &[u64]) {
        let (ctx, geometry) = (&self.ctx, &self.geometry);
        let (offsets, capacities) = (geometry.segment_offsets(), geometry.segment_capacities());
        ctx.driver
            .note_layout(ctx.base, offsets, capacities, committed);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // A destructor never panics. A panic while another thread held the state left it as
        // it was before the mutation (every mutation builds in locals and moves in at the
        // end), so its mappings and reservation are still the ones to give back.
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !state.mappings.is_empty() {
            self.ctx.defer(self.ctx.driver.synchronize());
            state.mappings.clear();
        }
        state.reservation = None;
    }
}

/// A reservation of `capacity_bytes` split into segments that grow in lockstep.
/// Cloning is cheap and shares the same memory.
#[derive(Clone)]
pub struct ExtensibleTensor {
    inner: Arc<Inner>,
}

/// Keeps a tensor's memory alive for one view; counts towards `live_views`.
struct ViewGuard {
    inner: Arc<Inner>,
}

impl Drop for ViewGuard {
    fn drop(&mut self) {
        self.inner.live_views.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A byte range of a tensor handed to a consumer (DLPack), with the guard that keeps it valid.
/// Only `ExtensibleTensor::view` makes one, after checking the range against the capacity,
/// so its pointer can be trusted: the fields are private, and nothing can forge one.
///
/// ```compile_fail,E0451
/// use extensible_kv::{tensor::ViewRegion, DeviceKind};
/// let forged = ViewRegion { ptr: 0xdead, num_bytes: 1, device: DeviceKind::Cpu, _guard: todo!() };
/// ```
pub struct ViewRegion {
    ptr: u64,
    num_bytes: u64,
    device: DeviceKind,
    _guard: ViewGuard,
}

impl ViewRegion {
    /// The first byte's address; `num_bytes` from it lie in the tensor's reservation.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The region's length in bytes.
    pub fn num_bytes(&self) -> u64 {
        self.num_bytes
    }

    /// Where the region's memory lives.
    pub fn device(&self) -> DeviceKind {
        self.device
    }
}

impl ExtensibleTensor {
    /// Reserves address space for `segments` on `driver`; commits nothing.
    pub fn new(
        driver: Arc<dyn Driver>,
        segments: Segments,
        options: Options,
    ) -> Result<ExtensibleTensor> {
        let granularity = options.granularity.unwrap_or(driver.granularity());
        let geometry = match segments {
            Segments::Equal {
                max_bytes,
                num_segments,
            } => Geometry::equal(max_bytes, num_segments, granularity)?,
            Segments::Capacities(capacities) => Geometry::new(capacities, granularity)?,
        };
        ExtensibleTensor::from_geometry(driver, geometry, options)
    }

    /// `num_segments` equal segments of `max_bytes / num_segments` bytes.
    pub fn with_equal_segments(
        driver: Arc<dyn Driver>,
        max_bytes: u64,
        num_segments: u64,
        options: Options,
    ) -> Result<ExtensibleTensor> {
        let segments = Segments::Equal {
            max_bytes,
            num_segments,
        };
        ExtensibleTensor::new(driver, segments, options)
    }

    /// Segments of the given capacities, back to back.
    pub fn with_segment_capacities(
        driver: Arc<dyn Driver>,
        segment_capacities: Vec<u64>,
        options: Options,
    ) -> Result<ExtensibleTensor> {
        let segments = Segments::Capacities(segment_capacities);
        ExtensibleTensor::new(driver, segments, options)
    }

    fn from_geometry(
        driver: Arc<dyn Driver>,
        geometry: Geometry,
        options: Options,
    ) -> Result<ExtensibleTensor> {
        let granularity = geometry.granularity();
        if granularity % driver.granularity() != 0 {
            return Err(Error::invalid(format!(
                "granularity {granularity} must be a multiple of the {} backend's {}",
                driver.backend_name(),
                driver.granularity()
            )));
        }
        let policy = options.handle_sizing.policy(granularity)?;
        let export_types = export_types_for(driver.as_ref(), options.export_types)?;
        ExtensibleTensor::reserve(driver, geometry, policy, export_types, None)
    }

    /// The random id that names this tensor's memory in shared descriptions (an importer's
    /// is its owner's).
    pub fn tensor_id(&self) -> u128 {
        self.inner.tensor_id
    }

    /// Reserves `geometry`'s address space on `driver`: a tensor that holds no memory yet,
    /// owned (`imported_from` is `None`) or mapping another process's.
    fn reserve(
        driver: Arc<dyn Driver>,
        geometry: Geometry,
        policy: HandlePolicy,
        export_types: ExportTypes,
        imported: Option<(u32, u128)>,
    ) -> Result<ExtensibleTensor> {
        let base = driver.reserve(geometry.reserved_bytes())?;
        let (imported_from, tensor_id) = match imported {
            Some((pid, id)) => (Some(pid), id),
            None => (None, random_id()),
        };
        let ctx = Arc::new(Ctx {
            driver,
            base,
            granularity: geometry.granularity(),
            export_types,
            serials: AtomicU64::new(0),
            deferred: Mutex::new(Vec::new()),
            unwarned: Mutex::new(Vec::new()),
            registry: OnceLock::new(),
        });
        let reservation = Reservation {
            ctx: Arc::clone(&ctx),
            num_bytes: geometry.reserved_bytes(),
        };
        let state = State {
            segment_bytes: vec![0; geometry.num_segments()],
            mappings: BTreeMap::new(),
            reservation: Some(reservation),
        };
        let inner = Inner {
            ctx,
            geometry,
            policy,
            snapshot: Mutex::new(Snapshot::of(&state)),
            state: Mutex::new(state),
            live_views: AtomicUsize::new(0),
            imported_from,
            tensor_id,
        };
        let tensor = ExtensibleTensor {
            inner: Arc::new(inner),
        };
        tensor.note_layout(&tensor.lock().segment_bytes);
        Ok(tensor)
    }

    fn lock(&self) -> Locked<'_> {
        Locked {
            guard: relock(&self.inner.state),
            inner: &self.inner,
        }
    }

    /// `read` of the getters' view, which never waits for an operation in progress.
    fn snapshot<T>(&self, read: impl FnOnce(&Snapshot) -> T) -> T {
        read(&relock(&self.inner.snapshot))
    }

    fn lock_open(&self) -> Result<Locked<'_>> {
        let state = self.lock();
        match state.reservation {
            Some(_) => Ok(state),
            None => Err(Error::Closed),
        }
    }

    /// `lock_open` for what only the memory's owner may do (grow, shrink, release).
    fn lock_owned(&self, what: &str) -> Result<Locked<'_>> {
        let state = self.lock_open()?;
        match self.inner.imported_from {
            None => Ok(state),
            Some(pid) => Err(Error::Unsupported(format!(
                "cannot {what}: this tensor maps memory that process {pid} owns (imported with \
                 from_shared); only the owner can change it, and refresh(description) follows it"
            ))),
        }
    }

    /// Whether resizing to `segment_bytes` would do nothing and succeed: the tensor is open and
    /// holds exactly that much. (A resize that is not a no-op grows, or fails.)
    pub fn is_noop_resize(&self, segment_bytes: &[u64]) -> bool {
        self.snapshot(|s| !s.closed && s.segment_bytes == segment_bytes)
    }

    /// Grows a one-segment tensor to `num_bytes`.
    pub fn resize(&self, num_bytes: u64, options: GrowOptions) -> Result<()> {
        self.check_one_segment(SizeOp::Resize)?;
        self.resize_per_segment([num_bytes], options)
    }

    /// `Error::NotOneSegment` unless the tensor has one segment (for `op`, a one-size call).
    fn check_one_segment(&self, op: SizeOp) -> Result<()> {
        match self.num_segments() {
            1 => Ok(()),
            num_segments => Err(Error::NotOneSegment { op, num_segments }),
        }
    }

    /// Grows segment `i` to `bytes[i]` (or every segment to one size); zeroes the new bytes
    /// `[old_i, new_i)` of each segment on `options.stream` when `options.zero_new`. All or
    /// nothing: on error the tensor is unchanged.
    pub fn resize_per_segment(&self, bytes: impl PerSegment, options: GrowOptions) -> Result<()> {
        let segment_bytes = &*bytes.per_segment(self.num_segments());
        let mut state = self.lock_owned("grow")?;
        let geometry = &self.inner.geometry;
        geometry.check_request(segment_bytes)?;
        if let Some(segment) = state
            .segment_bytes
            .iter()
            .zip(segment_bytes)
            .position(|(o, n)| n < o)
        {
            return Err(Error::WrongDirection {
                op: SizeOp::Resize,
                segment,
                from_bytes: state.segment_bytes[segment],
                to_bytes: segment_bytes[segment],
            });
        }
        if state.segment_bytes == segment_bytes {
            return Ok(());
        }
        let new_ranges = geometry.new_ranges(&state.segment_bytes, segment_bytes);
        let new_granules = plan::granules_of(&new_ranges, geometry.granularity());
        let mapped = mapped_overlapping(&state.mappings, &new_granules);
        let policy = match options.one_handle_per_run {
            true => HandlePolicy::WholeRuns,
            false => self.inner.policy,
        };
        let plan = plan::plan_grow(new_ranges, &new_granules, &mapped, policy);
        if plan.new_handles.len() > 1 {
            // All the new handles at once: a grow that cannot fit fails before its first create
            // rather than after taking what it could (one handle's create checks itself).
            let ctx = &self.inner.ctx;
            let new_bytes = plan.new_handles.iter().map(|&run| ctx.span(run).1).sum();
            ctx.driver.check_room(new_bytes)?;
        }
        let mut zeroing = Zeroing::new(options.zero_new, options.stream);
        // Owned here, not in `map_and_zero`, so that on error the mappings unmap (as `fresh`
        // drops) only after the fence below.
        let mut fresh = Vec::with_capacity(plan.new_handles.len());
        if let Err(err) = self.map_and_zero(&plan, &mapped, &mut zeroing, &mut fresh) {
            if zeroing.queued {
                // Queued memsets may still write to the fresh mappings: fence first.
                self.inner.ctx.defer(self.inner.ctx.driver.synchronize());
            }
            drop(fresh);
            return Err(err);
        }
        for mapping in fresh {
            state.mappings.insert(mapping.run.first_granule, mapping);
        }
        state.segment_bytes.copy_from_slice(segment_bytes);
        debug_assert_eq!(check_state(&self.inner, &state), Ok(()));
        Ok(())
    }

    /// Tells the driver every segment's committed bytes, for the report of a stray access
    /// (`driver::stray`): at reservation, then by every `Locked` that changed them.
    fn note_layout(&self, committed: &[u64]) {
        self.inner.note_layout(committed);
    }

    /// Creates, maps and grants access to one handle per planned run, and zeroes the new
    /// logical bytes, pushing each mapping into `fresh` as soon as it exists. A handle's bytes
    /// are zeroed as soon as it is accessible, so on a device the memsets run while the host
    /// maps the next handles. On error, the caller fences, then drops `fresh` (unmapping and
    /// releasing what this call made).
    ///
    /// (A second thread creating handles ahead of the mapping one was tried on the H200: the
    /// driver serialises the calls, and creates took 1.5-1.9x longer; docs/benchmarks.md.)
    fn map_and_zero(
        &self,
        plan: &plan::GrowPlan,
        mapped: &[Run],
        zeroing: &mut Zeroing,
        fresh: &mut Vec<Mapping>,
    ) -> Result<()> {
        let inner = &*self.inner;
        let g = inner.geometry.granularity();
        let fresh_is_zero = inner.ctx.driver.fresh_memory_is_zeroed();
        // Pieces of the new bytes, each inside one new handle, in address order.
        let in_fresh = match zeroing.enabled && !fresh_is_zero {
            true => plan::intersect(&plan.new_ranges, &plan.new_handles, g),
            false => Vec::new(),
        };
        let mut pending = in_fresh.iter().peekable();
        for &run in &plan.new_handles {
            let bytes = inner.geometry.run_bytes(run);
            fresh.push(Mapping::create(&inner.ctx, run)?);
            inner
                .ctx
                .driver
                .set_access(inner.ctx.base + bytes.offset, bytes.num_bytes)?;
            while let Some(piece) = pending.next_if(|p| p.offset < bytes.end()) {
                self.zero(piece, zeroing)?;
            }
        }
        if zeroing.enabled {
            // New bytes in granules mapped earlier (a granule shared with a neighbour, or the
            // slack past the old prefix) are not fresh memory: zero them on every backend.
            for piece in plan::intersect(&plan.new_ranges, mapped, g) {
                self.zero(&piece, zeroing)?;
            }
        }
        Ok(())
    }

    fn zero(&self, piece: &ByteRange, zeroing: &mut Zeroing) -> Result<()> {
        let va = self.inner.ctx.base + piece.offset;
        zeroing.queued = true;
        self.inner
            .ctx
            .driver
            .memset_zero(va, piece.num_bytes, zeroing.stream)
    }

    /// Drops all physical memory, keeping the addresses; every segment goes back to 0 bytes.
    /// Views stay valid for addressing; touching them faults until the next grow.
    ///
    /// An error before the fence (the device's pending work failed) releases nothing. Driver
    /// errors met while unmapping and releasing do not stop it: the tensor holds nothing
    /// afterwards, and the first such error is returned saying so (the rest stay in
    /// `take_deferred_errors`). Errors deferred by earlier operations are not returned here.
    pub fn release_physical(&self) -> Result<()> {
        let mut state = self.lock_owned("release physical memory")?;
        self.release_locked(&mut state)
    }

    fn release_locked(&self, state: &mut State) -> Result<()> {
        let ctx = &self.inner.ctx;
        if !state.mappings.is_empty() {
            ctx.driver.synchronize()?;
        }
        let mark = ctx.num_deferred();
        state.mappings.clear();
        state.segment_bytes.fill(0);
        self.own_errors(mark, "the release went on: every segment holds 0 bytes now")
    }

    /// The first error deferred since `mark` (what this operation met), saying that the
    /// operation completed regardless (`done`); the rest stay deferred.
    fn own_errors(&self, mark: usize, done: &str) -> Result<()> {
        let ctx = &self.inner.ctx;
        let mut own = ctx.take_deferred_since(mark).into_iter();
        let Some(first) = own.next() else {
            return Ok(());
        };
        let rest: Vec<Error> = own.collect();
        let more = rest.len();
        relock(&ctx.deferred).extend(rest);
        Err(completed_despite(first, more, done))
    }

    /// Releases memory and addresses now. Refused while views exist: their pointers would
    /// dangle. (Dropping the tensor instead defers the release to the last view.) Otherwise it
    /// always ends closed: a driver error on the way is returned after everything that could
    /// be released was, and errors deferred by earlier operations stay in
    /// `take_deferred_errors`.
    pub fn close(&self) -> Result<()> {
        let mut state = self.lock();
        if state.reservation.is_none() {
            return Ok(());
        }
        {
            let mut snapshot = relock(&self.inner.snapshot);
            let live_views = self.inner.live_views.load(Ordering::Acquire);
            if live_views > 0 {
                return Err(Error::ViewsAlive { live_views });
            }
            snapshot.closed = true; // from here on `view` refuses
        }
        let ctx = &self.inner.ctx;
        let mark = ctx.num_deferred();
        if !state.mappings.is_empty() {
            ctx.defer(ctx.driver.synchronize());
            state.mappings.clear();
        }
        state.segment_bytes.fill(0);
        state.reservation = None;
        self.own_errors(mark, "the tensor is closed regardless")
    }

    /// Messages of errors deferred since the last call (each once), for the bindings to log
    /// as warnings; `take_deferred_errors` still returns the errors themselves.
    pub fn take_unwarned(&self) -> Vec<String> {
        std::mem::take(&mut *relock(&self.inner.ctx.unwarned))
    }

    /// Whether `close` has run: the addresses are gone and every call but `close` fails.
    pub fn is_closed(&self) -> bool {
        self.snapshot(|s| s.closed)
    }

    /// Hands out `[offset, offset + num_bytes)` of the capacity; the guard keeps it alive.
    /// Never waits for an operation in progress (it takes no lock but the snapshot's).
    pub fn view(&self, offset: u64, num_bytes: u64) -> Result<ViewRegion> {
        let capacity = self.inner.geometry.capacity_bytes();
        if offset
            .checked_add(num_bytes)
            .is_none_or(|end| end > capacity)
        {
            return Err(Error::invalid(format!(
                "a view of {num_bytes} bytes at offset {offset} exceeds the capacity of \
                 {capacity} bytes"
            )));
        }
        {
            let snapshot = relock(&self.inner.snapshot);
            if snapshot.closed {
                return Err(Error::Closed);
            }
            self.inner.live_views.fetch_add(1, Ordering::AcqRel);
        }
        Ok(ViewRegion {
            ptr: self.inner.ctx.base + offset,
            num_bytes,
            device: self.inner.ctx.driver.device(),
            _guard: ViewGuard {
                inner: Arc::clone(&self.inner),
            },
        })
    }

    /// The reservation's first address (views are offsets from it); `Error::Closed` once closed.
    pub fn base_ptr(&self) -> Result<u64> {
        match self.snapshot(|s| s.closed) {
            true => Err(Error::Closed),
            false => Ok(self.inner.ctx.base),
        }
    }

    /// The segments' capacities and offsets, and the granularity.
    pub fn geometry(&self) -> &Geometry {
        &self.inner.geometry
    }

    /// The reserved bytes the segments can grow into.
    pub fn capacity_bytes(&self) -> u64 {
        self.inner.geometry.capacity_bytes()
    }

    /// The mapping granularity in bytes.
    pub fn granularity(&self) -> u64 {
        self.inner.geometry.granularity()
    }

    /// How many segments grow in lockstep.
    pub fn num_segments(&self) -> usize {
        self.inner.geometry.num_segments()
    }

    /// Where the memory lives.
    pub fn device(&self) -> DeviceKind {
        self.inner.ctx.driver.device()
    }

    /// `host` or `cuda`.
    pub fn backend_name(&self) -> &'static str {
        self.inner.ctx.driver.backend_name()
    }

    /// The committed bytes of each segment.
    pub fn segment_bytes(&self) -> Vec<u64> {
        self.snapshot(|s| s.segment_bytes.clone())
    }

    /// The capacity every segment has; an error when they differ (see `segment_capacities`).
    pub fn segment_capacity_bytes(&self) -> Result<u64> {
        uniform(self.geometry().segment_capacities(), "segment_capacities")
    }

    /// The bytes every segment has committed; an error when they differ (see `segment_bytes`).
    pub fn bytes_per_segment(&self) -> Result<u64> {
        uniform(&self.segment_bytes(), "segment_bytes")
    }

    /// Bytes of physical memory mapped (whole granules, so at least the committed bytes).
    pub fn physical_bytes(&self) -> u64 {
        self.snapshot(|s| s.physical_bytes)
    }

    /// How many physical handles are mapped.
    pub fn num_handles(&self) -> usize {
        self.snapshot(|s| s.num_handles)
    }

    /// The granule runs of the mapped handles, in address order.
    pub fn handle_runs(&self) -> Vec<Run> {
        self.lock().mappings.values().map(|m| m.run).collect()
    }

    /// How many views are alive (`close` refuses while any is).
    pub fn live_views(&self) -> usize {
        self.inner.live_views.load(Ordering::Acquire)
    }

    /// Errors that destructors met (a failed unmap or release) since the last call.
    pub fn take_deferred_errors(&self) -> Vec<Error> {
        relock(&self.inner.ctx.unwarned).clear();
        std::mem::take(&mut *relock(&self.inner.ctx.deferred))
    }

    /// Checks the invariants listed at the top of this module.
    pub fn check_invariants(&self) -> Result<(), String> {
        check_state(&self.inner, &self.lock())
    }
}

/// 128 random bits, never 0: from the kernel's generator, or, should that fail, from the
/// process-seeded hasher keys of std mixed with the pid, the time and a counter.
fn random_id() -> u128 {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    let from_kernel =
        std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    let id = match from_kernel {
        Ok(()) => u128::from_ne_bytes(bytes),
        Err(_) => {
            use std::hash::BuildHasher;
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            let seed = (
                std::process::id(),
                std::time::SystemTime::now(),
                COUNTER.fetch_add(1, Ordering::Relaxed),
            );
            let half =
                |salt: u8| std::collections::hash_map::RandomState::new().hash_one((seed, salt));
            u128::from(half(0)) << 64 | u128::from(half(1))
        }
    };
    id.max(1)
}

/// The one value all of `values` share, else an error naming the per-segment accessor.
fn uniform(values: &[u64], plural: &str) -> Result<u64> {
    match values.split_first() {
        Some((first, rest)) if rest.iter().all(|v| v == first) => Ok(*first),
        _ => Err(Error::invalid(format!(
            "segments differ: use {plural} ({values:?})"
        ))),
    }
}

/// The export types a tensor asks of `driver`: POSIX fd must be supported; fabric is dropped
/// where it is not (as vLLM does), since an importer can fall back to fds or RDMA.
fn export_types_for(driver: &dyn Driver, requested: ExportTypes) -> Result<ExportTypes> {
    let supported = driver.supported_export_types();
    if requested.contains(ExportTypes::POSIX_FD) && !supported.contains(ExportTypes::POSIX_FD) {
        return Err(Error::Unsupported(format!(
            "the {} backend on {} cannot export POSIX file descriptors \
             (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)",
            driver.backend_name(),
            driver.device().torch_name()
        )));
    }
    Ok(requested.intersection(supported))
}

fn check_state(inner: &Inner, state: &State) -> Result<(), String> {
    let geometry = &inner.geometry;
    let runs: Vec<Run> = state.mappings.values().map(|m| m.run).collect();
    plan::check_runs(&runs, geometry.num_granules())?;
    if let Some((key, m)) = state
        .mappings
        .iter()
        .find(|(k, m)| **k != m.run.first_granule)
    {
        return Err(format!("mapping {:?} is filed under granule {key}", m.run));
    }
    geometry
        .check_request(&state.segment_bytes)
        .map_err(|e| e.to_string())?;
    let unmapped = plan::subtract(&geometry.needed_runs(&state.segment_bytes), &runs);
    if !unmapped.is_empty() {
        return Err(format!("committed granules {unmapped:?} are not mapped"));
    }
    if state.reservation.is_none() && !state.mappings.is_empty() {
        return Err("a closed tensor still holds mappings".into());
    }
    Ok(())
}

/// The runs of the mappings that overlap any of `spans` (sorted, disjoint), in order.
fn mapped_overlapping(mappings: &BTreeMap<u64, Mapping>, spans: &[Run]) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for span in spans {
        let before = mappings
            .range(..span.first_granule)
            .next_back()
            .map(|(_, m)| m.run);
        let straddling = before.filter(|run| run.end_granule() > span.first_granule);
        let inside = mappings
            .range(span.first_granule..span.end_granule())
            .map(|(_, m)| m.run);
        for run in straddling.into_iter().chain(inside) {
            if runs.last() != Some(&run) {
                runs.push(run);
            }
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::host::HostDriver;

    #[test]
    fn stated_segments_must_agree_with_the_total_and_count() {
        let equal = Segments::Equal {
            max_bytes: 8,
            num_segments: 1,
        };
        assert_eq!(Segments::stated(8, None, None).unwrap(), equal);
        let caps = Segments::Capacities(vec![3, 5]);
        assert_eq!(Segments::stated(8, None, Some(vec![3, 5])).unwrap(), caps);
        assert_eq!(
            Segments::stated(8, Some(2), Some(vec![3, 5])).unwrap(),
            caps
        );
        for (num_segments, capacities, fragment) in [
            (None, vec![3, 4], "sum to 7 bytes"),
            (Some(3), vec![3, 5], "num_segments is 3"),
            (None, vec![u64::MAX, 9], "sum to"),
        ] {
            let err = Segments::stated(8, num_segments, Some(capacities)).unwrap_err();
            assert!(err.to_string().contains(fragment), "{err}");
        }
    }

    #[test]
    fn noop_resize_is_an_open_tensor_holding_exactly_the_request() {
        let driver = Arc::new(HostDriver::new(4096).unwrap());
        let tensor = ExtensibleTensor::new(
            driver,
            Segments::Capacities(vec![4096, 8192]),
            Options::default(),
        )
        .unwrap();
        tensor
            .resize_per_segment([10, 20], GrowOptions::zeroed())
            .unwrap();
        assert!(tensor.is_noop_resize(&[10, 20]));
        assert!(!tensor.is_noop_resize(&[10, 21]) && !tensor.is_noop_resize(&[10]));
        assert!(matches!(
            tensor.resize(10, GrowOptions::default()),
            Err(Error::NotOneSegment {
                op: SizeOp::Resize,
                num_segments: 2
            })
        ));
        assert!(matches!(
            tensor.segment_capacity_bytes(),
            Err(Error::InvalidArgument(_))
        ));
        assert!(tensor.bytes_per_segment().is_err());
        tensor
            .resize_per_segment([20, 20], GrowOptions::zeroed())
            .unwrap();
        assert_eq!(tensor.bytes_per_segment().unwrap(), 20);
        tensor.close().unwrap();
        assert!(
            !tensor.is_noop_resize(&[0, 0]),
            "a closed tensor refuses every resize"
        );
    }

    /// Panics on another thread while it holds `mutex`, leaving it poisoned.
    fn poison<T: Send>(mutex: &Mutex<T>) {
        std::thread::scope(|scope| {
            let held = scope.spawn(|| {
                let _guard = mutex.lock();
                panic!("poisoning on purpose");
            });
            assert!(held.join().is_err());
        });
        assert!(mutex.is_poisoned());
    }

    #[test]
    fn a_poisoned_state_or_error_list_panics_no_destructor() {
        let driver = Arc::new(HostDriver::new(4096).unwrap());
        let options = Options::default();
        let tensor = ExtensibleTensor::with_equal_segments(driver.clone(), 4 << 12, 2, options);
        let tensor = tensor.unwrap();
        tensor
            .resize_per_segment([5000, 10], GrowOptions::zeroed())
            .unwrap();
        poison(&tensor.inner.ctx.deferred);
        let failed = Error::invalid("a failure a destructor met");
        tensor.inner.ctx.defer(Err(failed));
        let recorded = tensor.take_deferred_errors();
        assert_eq!(recorded.len(), 1, "{recorded:?}");
        poison(&tensor.inner.state);
        drop(tensor); // Inner::drop: must release everything rather than panic
        assert_eq!(driver.live_counts(), (0, 0, 0));
    }
}
