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
//! 5. nothing is unmapped before the work that may touch it has run: the work queued on the
//!    caller's stream (an event: waited for on the caller's thread before a swap, by the
//!    release thread before a release, `release.rs`), or all of the device's at teardown,
//!    except mappings this very call made and nothing has touched yet.
//!
//! Limitations: `release_physical` drops everything (no pool of handles is kept for a later
//! grow); a consolidation is all or nothing per step (one run of granules moved to one new
//! handle), not across steps.
//!
//! Files by concern: `options.rs` (what a tensor is built with and each call takes),
//! `mapping.rs` (the RAII owners of driver resources), `grow.rs`, `reback.rs` (shrink and
//! consolidate), `view.rs` (views and their guard), `share.rs` (mapping memory into other
//! processes), `loan.rs` (lending it to them); this file holds the type, its state and locking,
//! construction, release and the getters.

mod grow;
mod loan;
mod mapping;
mod options;
mod pace;
mod reback;
mod release;
mod share;
mod view;

pub use loan::{BorrowRoom, LoanDescription, LoanHandle, PlacedHandle};
pub use options::{
    GrowOptions, HandleSizing, Options, PerSegment, Segments, ShrinkOptions,
    DEFAULT_MAX_HANDLE_BYTES,
};
pub use share::{SharedDescription, SharedExport, SharedHandle};
pub use view::ViewRegion;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use mapping::{completed_despite, relock, Ctx, Mapping, Mappings, PhysicalHandle, Reservation};

use crate::driver::{DeviceKind, Driver, ExportTypes, Stream};
use crate::error::{Error, Result};
use crate::plan::{self, Geometry, HandlePolicy, Run};

struct State {
    segment_bytes: Vec<u64>,
    /// Keyed by first granule (invariant 2), with their total bytes.
    mappings: Mappings,
    /// `None` once closed.
    reservation: Option<Reservation>,
    /// Loans out, by loan id (`loan.rs`): their handles are the lender's, unmapped.
    loans: std::collections::BTreeMap<u64, loan::Lent>,
    /// The last loan id handed out (ids start at 1).
    next_loan_id: u64,
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
            physical_bytes: state.mappings.bytes(),
            num_handles: state.mappings.len(),
            closed: state.reservation.is_none(),
        }
    }
}

/// The state's lock, which publishes what changed when released: a new `Snapshot`, and every
/// segment's committed bytes to the driver (for the report of a stray access,
/// `driver::host::stray`). No change can forget to.
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
    /// Mappings given back and waiting for their stream (`release.rs`).
    releaser: Arc<release::Releaser>,
    /// The driver rate the grows and the release thread share (`pace.rs`).
    pace: Arc<pace::Pace>,
}

impl Inner {
    /// Teardown's unmapping (`close` and the destructor): every stream done with the memory
    /// (a device synchronize, once, only if anything is mapped or waits for release), the
    /// release thread drained and stopped, then every mapping dropped.
    fn unmap_all(ctx: &Ctx, releaser: &release::Releaser, state: &mut State) {
        if !state.mappings.is_empty() || releaser.pending_handles() > 0 {
            ctx.defer(ctx.driver.synchronize());
        }
        releaser.shut_down();
        state.mappings.clear();
    }

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
        Self::unmap_all(&self.ctx, &self.releaser, state);
        state.reservation = None;
    }
}

/// A reservation of `capacity_bytes` split into segments that grow in lockstep.
/// Cloning is cheap and shares the same memory.
#[derive(Clone)]
pub struct ExtensibleTensor {
    inner: Arc<Inner>,
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
            registry: Mutex::new(None),
        });
        let reservation = Reservation {
            ctx: Arc::clone(&ctx),
            num_bytes: geometry.reserved_bytes(),
        };
        let state = State {
            segment_bytes: vec![0; geometry.num_segments()],
            mappings: Mappings::default(),
            reservation: Some(reservation),
            loans: Default::default(),
            next_loan_id: 0,
        };
        let pace = Arc::new(pace::Pace::default());
        let inner = Inner {
            releaser: release::Releaser::new(Arc::clone(&ctx), Arc::clone(&pace)),
            pace,
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

    /// Tells the driver every segment's committed bytes, for the report of a stray access
    /// (`driver::host::stray`): at reservation, then by every `Locked` that changed them.
    fn note_layout(&self, committed: &[u64]) {
        self.inner.note_layout(committed);
    }

    /// Drops all physical memory, keeping the addresses; every segment goes back to 0 bytes.
    /// Views stay valid for addressing; touching them faults until the next grow.
    ///
    /// The memory goes back once the work queued on `stream` so far has run, from a thread of
    /// the tensor's (`release.rs`): the call never waits for the device. Until then it counts
    /// in `physical_bytes` and `pending_release_bytes`; `wait_released` waits for it. An error
    /// recording the stream's event releases nothing. Driver errors met while unmapping and
    /// releasing do not stop it: the tensor holds nothing afterwards, and the first such error
    /// is returned saying so when the release happened in this call, else kept for
    /// `take_deferred_errors`. Errors deferred by earlier operations are not returned here.
    pub fn release_physical(&self, stream: Stream) -> Result<()> {
        let mut state = self.lock_owned("release physical memory")?;
        let mark = self.inner.ctx.num_deferred();
        let mappings = state.mappings.take_all();
        if let Err((err, mappings)) = self.inner.releaser.release(mappings, stream, false) {
            for mapping in mappings {
                state.mappings.insert(mapping);
            }
            return Err(err);
        }
        state.segment_bytes.fill(0);
        self.own_errors(mark, "the release went on: every segment holds 0 bytes now")
    }

    /// Bytes given back (by a shrink or `release_physical`) that are still mapped, waiting
    /// for the work queued before on their stream; they count in `physical_bytes`.
    pub fn pending_release_bytes(&self) -> u64 {
        self.inner.releaser.pending_bytes()
    }

    /// Waits until every release given to the tensor's thread has happened, or for
    /// `timeout`: whether none is pending. Errors the releases met are in
    /// `take_deferred_errors`.
    pub fn wait_released(&self, timeout: Option<std::time::Duration>) -> bool {
        self.inner.releaser.wait_released(timeout)
    }

    /// The driver rate: bytes per second the tensor creates (grows) and releases (shrinks,
    /// `release_physical`) at most; `None` (the default): unpaced.
    pub fn driver_rate(&self) -> Option<u64> {
        self.inner.pace.rate()
    }

    /// Paces the tensor's creates and releases at `bytes_per_second` together, one handle at
    /// a time (`None`: unpaced), for a tensor resized under a live decode loop: the driver's
    /// work on the device for memory created and released (its scrub) slows the loop's steps
    /// when gigabytes of it come at once (`pace.rs`). A grow then takes as long as its bytes
    /// at that rate (the caller's thread sleeps between its handles); a shrink still returns
    /// at once, its memory pending (and a grow takes it back) until its turn. Applies from the
    /// next handle on; teardown, lends, borrows and consolidation are never paced.
    /// `InvalidArgument` for 0.
    pub fn set_driver_rate(&self, bytes_per_second: Option<u64>) -> Result<()> {
        if bytes_per_second == Some(0) {
            return Err(Error::invalid(
                "driver_rate must be a positive number of bytes per second, or None",
            ));
        }
        self.inner.pace.set(bytes_per_second);
        Ok(())
    }

    /// Makes the host backend's events stay pending (`held`) or lets them complete: a test's
    /// stand-in for a busy stream (`Driver::hold_events`).
    pub fn hold_events(&self, held: bool) -> Result<()> {
        self.inner.ctx.driver.hold_events(held)
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
        ctx.keep_deferred(rest);
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
        Inner::unmap_all(ctx, &self.inner.releaser, &mut state);
        // After every handle withdrew its fd: the memfd goes now, not when the object does.
        relock(&ctx.registry).take();
        state.loans.clear(); // a borrower keeps what it mapped
        state.segment_bytes.fill(0);
        state.reservation = None;
        self.own_errors(mark, "the tensor is closed regardless")
    }

    /// Messages of errors deferred since the last call (each once), for the bindings to log
    /// as warnings; `take_deferred_errors` still returns the errors themselves.
    pub fn take_unwarned(&self) -> Vec<String> {
        self.inner.ctx.take_unwarned()
    }

    /// Whether `close` has run: the addresses are gone and every call but `close` fails.
    pub fn is_closed(&self) -> bool {
        self.snapshot(|s| s.closed)
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

    /// The bytes the segments can grow into, all together (their capacities' sum). The
    /// reservation is this rounded up to whole granules (`Geometry::reserved_bytes`).
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

    /// Bytes of physical memory mapped (whole granules, so at least the committed bytes),
    /// counting what is still on its way back (`pending_release_bytes`).
    pub fn physical_bytes(&self) -> u64 {
        self.snapshot(|s| s.physical_bytes) + self.inner.releaser.pending_bytes()
    }

    /// How many physical handles are mapped, counting those still on their way back.
    pub fn num_handles(&self) -> usize {
        self.snapshot(|s| s.num_handles) + self.inner.releaser.pending_handles()
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
        self.inner.ctx.take_all_deferred()
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

/// The export types a tensor asks of `driver`: POSIX fd must be supported. Fabric asked with
/// POSIX fd is dropped where it is not supported (as vLLM does: importers fall back to the
/// fds); fabric alone must be supported, since without it the memory could not be shared at
/// all, which the caller would learn only at `share`.
fn export_types_for(driver: &dyn Driver, requested: ExportTypes) -> Result<ExportTypes> {
    let supported = driver.supported_export_types();
    let (backend, device) = (driver.backend_name(), driver.device().torch_name());
    if requested.contains(ExportTypes::POSIX_FD) && !supported.contains(ExportTypes::POSIX_FD) {
        return Err(Error::Unsupported(format!(
            "the {backend} backend on {device} cannot export POSIX file descriptors \
             (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)"
        )));
    }
    if requested == ExportTypes::FABRIC && !supported.contains(ExportTypes::FABRIC) {
        return Err(Error::Unsupported(format!(
            "the {backend} backend on {device} cannot export fabric handles (no fabric support \
             or IMEX channel): ask for POSIX fds, or for both to fall back to fds"
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
    let summed: u64 = state.mappings.values().map(Mapping::num_bytes).sum();
    if state.mappings.bytes() != summed {
        let kept = state.mappings.bytes();
        return Err(format!(
            "the mappings hold {summed} bytes, not the {kept} kept"
        ));
    }
    geometry
        .check_request(&state.segment_bytes)
        .map_err(|e| e.to_string())?;
    let unmapped = plan::subtract(&geometry.needed_runs(&state.segment_bytes), &runs);
    if !unmapped.is_empty() {
        return Err(format!("committed granules {unmapped:?} are not mapped"));
    }
    for (loan_id, lent) in &state.loans {
        for run in lent.runs() {
            if !plan::intersect_run(run, &runs).is_empty() {
                return Err(format!("granules {run:?} of loan {loan_id} are mapped"));
            }
        }
    }
    for run in inner.releaser.pending_runs() {
        if !plan::intersect_run(run, &runs).is_empty() {
            return Err(format!(
                "granules {run:?} are mapped and pending release at once"
            ));
        }
    }
    if state.reservation.is_none() && !state.mappings.is_empty() {
        return Err("a closed tensor still holds mappings".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::host::HostDriver;
    use crate::error::SizeOp;

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
    fn an_operation_reports_only_the_errors_its_own_thread_met() {
        // The release thread defers what it meets while a caller's operation runs; that
        // operation must not raise them as its own (nor drop their warnings).
        let driver = Arc::new(HostDriver::new(4096).unwrap());
        let tensor = ExtensibleTensor::with_equal_segments(driver, 4 << 12, 1, Options::default());
        let tensor = tensor.unwrap();
        let ctx = &tensor.inner.ctx;
        let mark = ctx.num_deferred();
        std::thread::scope(|s| {
            s.spawn(|| ctx.defer(Err(Error::invalid("met by the release thread"))));
        });
        ctx.defer(Err(Error::invalid("met by the operation")));
        let own = ctx.take_deferred_since(mark);
        assert_eq!(own.len(), 1, "{own:?}");
        assert!(own[0].to_string().contains("by the operation"), "{own:?}");
        let unwarned = tensor.take_unwarned();
        assert_eq!(unwarned.len(), 1, "{unwarned:?}");
        assert!(unwarned[0].contains("release thread"), "{unwarned:?}");
        let left = tensor.take_deferred_errors();
        assert_eq!(left.len(), 1, "{left:?}");
        assert!(left[0].to_string().contains("release thread"), "{left:?}");
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
