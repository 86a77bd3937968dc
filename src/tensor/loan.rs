//! Lending and borrowing: handing committed memory to another tensor (in this process or
//! another one) in milliseconds, contents kept, and taking it back at the same addresses.
//!
//! Approach. `lend` is a shrink that keeps the whole handles past the new sizes instead of
//! releasing them: each is exported (once: the export is cached in the handle, so a later
//! loan of it costs nothing), unmapped after a fence on the caller's stream (an event, never a
//! context synchronize: a decoding engine can lend), and moved into a `Lent` record of the
//! lender. The lender's addresses stay reserved. The loan's description names exactly those
//! handles, with the number of a **loan board** (`crate::ipc::LoanBoard`): a memfd named
//! after the tensor and the loan, holding the loan's random epoch, its state word and, per
//! handle, what the lender lent (serial, run, fd number) and a claim word.
//!
//! A loan is memory, not the lender's blocks: a borrower of another layout (other block
//! bytes, segments, buffers) turns its handles into blocks of its own. Where each handle goes
//! is policy, decided by the caller (`extensible_kv.shape.deal`, from `borrow_room`);
//! `borrow_placed` is the mechanism: it checks the placement as untrusted (each handle inside
//! its segment's room, right after what the segment maps past its committed end, never over
//! anything mapped or lent; committed sizes only over mapped granules), validates the loans
//! field by field and against their boards, claims each handle on its board by
//! compare-and-swap (a handle is borrowed at most once, even within the process: a loan's
//! handles may be split between several tensors of it; a replay finds them claimed, a stale
//! loan finds no board or a closed one), imports and maps them, all or nothing. Handles the
//! borrower cannot use are given back at once, unmapped (`LoanDescription::decline`), so that
//! the lender's reclaim never waits for them. `borrow`, for a loan of the same geometry,
//! places the handles evenly over the segments and takes the same path. Each borrowed handle
//! carries a slot of the board (`LoanSlot`): however the borrower lets go of it (`give_back`,
//! a shrink, a release, a close, process exit), it is unmapped and released first and then
//! marked returned. `reclaim` waits, without the tensor's lock, until every handle is
//! returned, or the borrower is gone (a pidfd, checked against the borrower's start time), or
//! the loan was never borrowed, then maps the handles back at their addresses.
//!
//! Invariants, on top of the owner's (`mod.rs`):
//! 1. a lent handle is held by exactly one `Lent` record of its lender, never mapped by it,
//!    and its granules are mapped by nothing of the lender until it is reclaimed (a grow over
//!    them is refused): the lender's memory is never counted twice, and reclaim finds its
//!    addresses free;
//! 2. a handle is mapped by at most one owner at a time: the lender unmaps before the board is
//!    offered, and maps back only once the borrower has marked the handle returned (after its
//!    unmap) or is dead, having closed the board from the state it saw (so no borrower can
//!    claim it, nor a failed borrow offer it again, meanwhile); one reclaim of a loan at a
//!    time;
//! 3. only a tensor's own, unshared handles are lent: a borrowed one goes back to its lender,
//!    never onward (nor is it copied by a consolidation or an exact shrink), and one `share`
//!    described is never lent (its importers may map it); a tensor that maps borrowed handles
//!    is not shared;
//! 4. a borrower maps only handles the board names, as the board names them, each once (its
//!    claim word), wherever the placement puts it within the room past a segment's end:
//!    every fd it takes is checked against the board after it was taken, and the lender
//!    withdraws the board's fds before it closes any (`Lent`'s drop), so a number reused
//!    meanwhile is refused; anything else is refused before anything is mapped;
//! 5. a reclaim commits only mapped granules: the segments grow back to their sizes before
//!    the lend only where every granule up to there is mapped;
//! 6. a failed lend, borrow, give-back or reclaim leaves both sides as they were (a failed
//!    borrow releases what it imported and unclaims its handles; the board is offered again
//!    once no handle of it is claimed or returned).

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::share::handles_refused;
use super::{check_state, ExtensibleTensor, Mapping, PerSegment, PhysicalHandle, State};
use crate::driver::{DeviceKind, ExportTypes, Exported, ImportSource, Stream};
use crate::error::{Error, Result};
use crate::ipc::{self, BoardState, ClaimRefused, FdSource, LoanBoard, LoanEntry, Watched};
use crate::plan::{self, Run};

/// One lent handle, as a loan's description names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoanHandle {
    /// The lender's granules the handle backed (and backs again once reclaimed).
    pub run: Run,
    /// The lender's serial for the handle.
    pub serial: u64,
    /// The lender's fd number of the exported handle.
    pub fd: i32,
}

/// What a borrower needs: `ExtensibleTensor::lend`'s result. Untrusted: checked field by
/// field, then against the lender's loan board, before anything is mapped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoanDescription {
    /// The lender's device.
    pub device: DeviceKind,
    /// The lender's granularity: runs are in granules of it.
    pub granularity: u64,
    /// The lender's process id.
    pub owner_pid: u32,
    /// The lender tensor's random id.
    pub tensor_id: u128,
    /// The loan's number, unique for the lender tensor's life.
    pub loan_id: u64,
    /// The loan's random epoch (never 0), which the board must hold too.
    pub epoch: u64,
    /// The lender's fd number of the loan board.
    pub board_fd: i32,
    /// The lent handles, in address order.
    pub handles: Vec<LoanHandle>,
}

/// A loan as the lender holds it until it is reclaimed.
pub(super) struct Lent {
    epoch: u64,
    board: Arc<LoanBoard>,
    /// Unmapped, still the lender's: they go back over their runs when reclaimed.
    handles: Vec<(Run, PhysicalHandle)>,
    /// The segment sizes right after the lend, and before it.
    kept_bytes: Vec<u64>,
    before_bytes: Vec<u64>,
    /// Set while a `reclaim` of the loan waits (without the tensor's lock): a second one is
    /// refused, since it could take the first one's closing of the board for a completed
    /// reclaim, or offer the loan again while the first maps its handles back.
    reclaiming: bool,
}

impl Lent {
    pub(super) fn runs(&self) -> impl Iterator<Item = Run> + '_ {
        self.handles.iter().map(|(run, _)| *run)
    }
}

impl Drop for Lent {
    /// A loan dropped unreclaimed (the lender closed): no one may borrow it any more. A
    /// borrower that has it keeps what it mapped. The board stops naming the loan's fds before
    /// the handles (their fields, dropped after this) close them: a borrow under way checks
    /// every fd it takes against the board, and a closed number soon names other memory.
    fn drop(&mut self) {
        self.board.close_if_offered();
        self.board.withdraw();
    }
}

/// The borrower's mark on a borrowed handle: the board slot it sets once the handle is
/// unmapped and released (`PhysicalHandle`'s drop).
pub(super) struct LoanSlot {
    pub(super) board: Arc<LoanBoard>,
    pub(super) index: usize,
    pub(super) tensor_id: u128,
    pub(super) loan_id: u64,
}

fn bad(why: String) -> Error {
    Error::invalid(format!("invalid loan: {why}"))
}

impl LoanDescription {
    /// Checks the fields and how they fit together (no fd is touched).
    fn validate(&self) -> Result<()> {
        if self.tensor_id == 0 || self.epoch == 0 || self.loan_id == 0 {
            return Err(bad(format!(
                "tensor_id {:#x}, loan_id {} and epoch {:#x} must all be non-zero (use lend()'s)",
                self.tensor_id, self.loan_id, self.epoch
            )));
        }
        if !self.granularity.is_power_of_two() {
            return Err(bad(format!(
                "granularity {} is not a power of two",
                self.granularity
            )));
        }
        if self.board_fd < 0 {
            return Err(bad(format!(
                "board_fd {} is not an fd number",
                self.board_fd
            )));
        }
        if self.handles.is_empty() {
            return Err(bad("it names no handle".into()));
        }
        let runs: Vec<Run> = self.handles.iter().map(|h| h.run).collect();
        // No reservation bounds a loan's runs here (the borrower checks them against its own):
        // only that each ends inside 64 bits.
        plan::check_runs(&runs, u64::MAX).map_err(|e| bad(handles_refused(e)))?;
        if let Some((i, h)) = self.handles.iter().enumerate().find(|(_, h)| h.fd < 0) {
            return Err(bad(format!("handles[{i}].fd {} is not an fd number", h.fd)));
        }
        Ok(())
    }

    /// The physical bytes the loan moves.
    pub fn num_bytes(&self) -> u64 {
        let granules: u64 = self.handles.iter().map(|h| h.run.num_granules).sum();
        granules.saturating_mul(self.granularity)
    }

    /// What the board must say: one entry per handle.
    fn entries(&self) -> Vec<LoanEntry> {
        self.handles
            .iter()
            .map(|h| LoanEntry {
                serial: h.serial,
                run: h.run,
                fd: h.fd,
            })
            .collect()
    }

    /// The fds the lender (this process) holds for the loan, checked current: the board's,
    /// then one per handle, as `send_loan` passes them on. The caller owns them.
    pub fn owner_fds(&self) -> Result<Vec<OwnedFd>> {
        self.validate()?;
        if self.owner_pid != std::process::id() {
            return Err(Error::invalid(format!(
                "only the lender process ({}) can pass on its fds, not {}",
                self.owner_pid,
                std::process::id()
            )));
        }
        let mut source = self.fd_source(None)?;
        let board = self.open_board(&mut source)?;
        if board.state() != BoardState::Offered {
            return Err(ipc::stale_loan(format!(
                "loan {} is no longer offered ({:?})",
                self.loan_id,
                board.state()
            )));
        }
        let mut fds = vec![self.take(&mut source, self.board_fd)?];
        for index in 0..self.handles.len() {
            fds.push(self.take_handle(&mut source, &board, index)?);
        }
        Ok(fds)
    }

    /// Where the loan's fds come from: the lender by pid, or `fds` received (the board's,
    /// then one per handle).
    fn fd_source(&self, fds: Option<Vec<OwnedFd>>) -> Result<FdSource> {
        let numbers: Vec<i32> = std::iter::once(self.board_fd)
            .chain(self.handles.iter().map(|h| h.fd))
            .collect();
        let what = "the loan's board's, then one per handle";
        FdSource::new(self.owner_pid, numbers, fds, what)
    }

    /// The lender's fd `number`: a stale or foreign loan where it cannot be taken (another
    /// process, an fd it no longer holds); a refused trace stays `PtraceRefused`, for the
    /// caller to have the fds sent instead.
    fn take(&self, source: &mut FdSource, number: i32) -> Result<OwnedFd> {
        let by_pid = matches!(source, FdSource::Owner { .. });
        source.take(number).map_err(|err| match err {
            Error::PtraceRefused { .. } => err,
            _ if by_pid => ipc::stale_loan(format!(
                "cannot take fd {number} of process {}: {err}",
                self.owner_pid
            )),
            _ => err,
        })
    }

    /// Handle `index`'s fd, checked against the board after it was taken: the lender stops
    /// naming the loan's fds on the board before it closes any (`Lent`'s drop), so an entry
    /// that still names the number proves that the fd taken was the lent handle's. Checked
    /// before, a number the lender closed meanwhile could name another of its files by now.
    fn take_handle(
        &self,
        source: &mut FdSource,
        board: &LoanBoard,
        index: usize,
    ) -> Result<OwnedFd> {
        let wanted = &self.handles[index];
        let fd = self.take(source, wanted.fd)?;
        let named = LoanEntry {
            serial: wanted.serial,
            run: wanted.run,
            fd: wanted.fd,
        };
        if board.entry(index) != Some(named) {
            return Err(ipc::stale_loan(format!(
                "the lender let go of loan {} (it closed its tensor) before its handle {} \
                 was taken: fd {} may name other memory by now",
                self.loan_id, wanted.serial, wanted.fd
            )));
        }
        Ok(fd)
    }

    /// The error for a claim of this loan's handles that its board refused.
    fn claim_refused(&self, why: ClaimRefused) -> Error {
        ipc::stale_loan(match why {
            ClaimRefused::Taken { pid } => format!(
                "loan {} was borrowed already, by process {pid}: a loan is borrowed at most \
                 once",
                self.loan_id
            ),
            ClaimRefused::Closed => format!("loan {} was reclaimed by its lender", self.loan_id),
            ClaimRefused::Handle { index } => format!(
                "handle {index} of loan {} was borrowed already, or given back: a handle is \
                 borrowed at most once",
                self.loan_id
            ),
        })
    }

    /// Gives handles `indices` of the loan back at once, unmapped: the borrower's layout
    /// cannot use them (`extensible_kv.shape.deal` left them out), and its lender must not
    /// wait for them. Each handle no tensor claimed becomes returned on the lender's board,
    /// which this process claims first if no tensor of it did; handles claimed or returned
    /// already are left as they are. `fds` as `ExtensibleTensor::borrow`'s. How many it marked.
    pub fn decline(&self, fds: Option<Vec<OwnedFd>>, indices: &[usize]) -> Result<usize> {
        self.validate()?;
        if let Some(index) = indices.iter().find(|&&i| i >= self.handles.len()) {
            return Err(bad(format!(
                "handle {index} of a loan of {} handles",
                self.handles.len()
            )));
        }
        let mut source = self.fd_source(fds)?;
        let board = self.open_board(&mut source)?;
        board
            .decline(indices)
            .map_err(|why| self.claim_refused(why))
    }

    /// The lender's board, checked to be this loan's and to say what the description says.
    fn open_board(&self, source: &mut FdSource) -> Result<LoanBoard> {
        let board = LoanBoard::open(
            self.take(source, self.board_fd)?,
            self.tensor_id,
            self.loan_id,
        )?;
        if board.epoch() != self.epoch {
            return Err(ipc::stale_loan(format!(
                "loan {} has epoch {:#x} on the lender's board, not {:#x}",
                self.loan_id,
                board.epoch(),
                self.epoch
            )));
        }
        if board.is_withdrawn() {
            return Err(ipc::stale_loan(format!(
                "the lender let go of loan {} (it closed its tensor)",
                self.loan_id
            )));
        }
        if board.entries() != self.entries() {
            return Err(ipc::stale_loan(format!(
                "the handles of loan {} differ from what the lender lent (altered?)",
                self.loan_id
            )));
        }
        Ok(board)
    }
}

/// One handle of a loan that a borrower maps, and the segment whose end it extends
/// (`ExtensibleTensor::borrow_placed`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlacedHandle {
    /// The loan's index in the call's loans.
    pub loan: usize,
    /// The handle's index in that loan.
    pub handle: usize,
    /// The borrower's segment it goes to.
    pub segment: usize,
}

/// Where a borrow may place handles in one segment now (`ExtensibleTensor::borrow_room`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BorrowRoom {
    /// The granule the first handle placed in the segment goes to: right after the mapped
    /// memory that holds (or starts at) its committed end.
    pub start_granule: u64,
    /// What the segment can grow into with no new memory: the bytes from its committed end to
    /// where that mapped memory ends (within its capacity). Negative when the first handle
    /// placed would also hold bytes before the committed end (an empty segment that starts
    /// inside a granule nothing maps).
    pub slack_bytes: i64,
    /// The free granules from `start_granule` up to the segment's last one (a granule it
    /// shares with the next segment is that one's) or the first granule mapped or lent.
    pub room_granules: u64,
    /// The bytes the segment may still grow: its capacity less its committed bytes.
    pub limit_bytes: u64,
}

/// A checked placement: per placed handle its run, the sizes to commit, and the newly
/// committed bytes outside the placed handles (`(offset, bytes)` from the reservation's start).
struct Planned {
    handles: Vec<(PlacedHandle, Run)>,
    segment_bytes: Vec<u64>,
    zero_past: Vec<(u64, u64)>,
}

impl ExtensibleTensor {
    /// Lends the memory past `bytes` of every segment (one size per segment, or one for all):
    /// the segments shrink to those sizes (keeping the bytes below) and every whole handle past
    /// them becomes the loan, exported (once per handle: later loans reuse the export) and
    /// unmapped after a fence on `stream` (an event: the device need not be idle). A handle
    /// that straddles a new size stays with the lender. The addresses stay reserved: views
    /// and graphs stay valid, and `reclaim` maps the handles back there. All or nothing.
    pub fn lend(&self, bytes: impl PerSegment, stream: Stream) -> Result<LoanDescription> {
        let segment_bytes = &*bytes.per_segment(self.num_segments());
        let mut state = self.lock_owned("lend")?;
        let dead = self.plan_lend(&state, segment_bytes)?;
        let entries = self.export_for_loan(&state, &dead)?;
        state.next_loan_id += 1;
        let loan_id = state.next_loan_id;
        let epoch = (super::random_id() as u64).max(1);
        let board = LoanBoard::create(self.inner.tensor_id, loan_id, epoch, &entries)?;
        // The fence: work queued on `stream` may still touch the lent memory.
        self.inner.ctx.driver.fence(stream)?;
        let handles = self.unmap_all(&mut state, &dead)?;
        let lent = Lent {
            epoch,
            board: Arc::new(board),
            handles,
            kept_bytes: segment_bytes.to_vec(),
            before_bytes: state.segment_bytes.clone(),
            reclaiming: false,
        };
        let description = self.describe_loan(loan_id, &lent, &entries);
        state.loans.insert(loan_id, lent);
        state.segment_bytes.copy_from_slice(segment_bytes);
        debug_assert_eq!(check_state(&self.inner, &state), Ok(()));
        Ok(description)
    }

    /// The granule runs of the handles `lend(bytes)` would lend now, in address order, with
    /// the same checks (and errors) as the lend itself, changing nothing: what a donor reads
    /// to lend only memory its borrower can use (`extensible_kv.shape.blocks_from`).
    pub fn lend_runs(&self, bytes: impl PerSegment) -> Result<Vec<Run>> {
        let segment_bytes = &*bytes.per_segment(self.num_segments());
        let state = self.lock_owned("lend")?;
        self.plan_lend(&state, segment_bytes)
    }

    /// What a lend keeping `segment_bytes` lends: every whole handle past those sizes, each
    /// this tensor's own to lend; refused, saying why, where nothing is.
    fn plan_lend(&self, state: &State, segment_bytes: &[u64]) -> Result<Vec<Run>> {
        let geometry = &self.inner.geometry;
        geometry.check_request(segment_bytes)?;
        if let Some(segment) =
            (0..segment_bytes.len()).find(|&i| segment_bytes[i] > state.segment_bytes[i])
        {
            return Err(Error::invalid(format!(
                "lend keeps {} bytes of segment {segment}, which holds {}: the size kept \
                 cannot be larger than what is committed",
                segment_bytes[segment], state.segment_bytes[segment]
            )));
        }
        if !self.export_types().contains(ExportTypes::POSIX_FD) {
            return Err(Error::Unsupported(
                "loans travel as POSIX fds: create the lender with \
                 export_handle_types='posix_fd'"
                    .into(),
            ));
        }
        let needed = geometry.needed_runs(segment_bytes);
        let mapped: Vec<Run> = state.mappings.values().map(|m| m.run).collect();
        let dead = plan::plan_shrink(&mapped, &needed).dead;
        if dead.is_empty() {
            return Err(Error::invalid(format!(
                "nothing to lend: no whole handle lies past {segment_bytes:?} bytes per segment \
                 (a handle that straddles the size kept stays with the lender)"
            )));
        }
        self.refuse_not_own(state, &dead)?;
        Ok(dead)
    }

    /// Exports up to `max_handles` of the handles not exported yet, the highest addresses
    /// first (a lend gives the top of each segment), so that a later `lend` of them only
    /// unmaps: the exports (the export cost, docs/design.md §2) were half of a first 60 GiB
    /// loan. A donor calls it a few handles at a time between its steps (the tensor's lock is
    /// held while it exports). Returns how many handles (of its own: not borrowed ones) are still not
    /// exported. Does nothing, and returns 0, for a tensor whose handles do not export as
    /// POSIX fds (no loan could take them).
    /// Each export holds one fd until its handle is released.
    pub fn export_ahead(&self, max_handles: usize) -> Result<usize> {
        if !self.export_types().contains(ExportTypes::POSIX_FD) {
            return Ok(0);
        }
        let state = self.lock_owned("export ahead of a loan")?;
        let mut exported = 0;
        let mut left = 0;
        for mapping in state.mappings.values().rev() {
            let handle = mapping.handle();
            // A borrowed handle goes back to its lender, never onward.
            if handle.exported.get().is_some() || handle.loan.is_some() {
                continue;
            }
            if exported == max_handles {
                left += 1;
                continue;
            }
            handle.export_once(ExportTypes::POSIX_FD)?;
            exported += 1;
        }
        Ok(left)
    }

    /// Refuses to lend any handle over `runs` that is not this tensor's alone to lend: a
    /// borrowed one goes back to its lender, never onward (else, once the tensor between let
    /// go of it, its lender would reclaim what a third tensor still maps), and one that
    /// `share` described may still be mapped by importers (they would read what the borrower
    /// writes, and write into its memory).
    fn refuse_not_own(&self, state: &State, runs: &[Run]) -> Result<()> {
        for run in runs {
            let handle = state.mappings[&run.first_granule].handle();
            let (first, last) = (run.first_granule, run.end_granule() - 1);
            if let Some(slot) = &handle.loan {
                return Err(Error::LoanConflict(format!(
                    "cannot lend granules {first} to {last}: they are a handle borrowed from \
                     loan {} of tensor {:032x}, which goes back to its lender, never onward; \
                     lend keeping every borrowed byte, or give the loan back",
                    slot.loan_id, slot.tensor_id
                )));
            }
            if handle.published_at.get().is_some() {
                return Err(Error::LoanConflict(format!(
                    "cannot lend granules {first} to {last}: share() described that handle \
                     (serial {}), and importers may map it still: they would read what the \
                     borrower writes, and write into its memory; lend memory grown after the \
                     last share(), or from a tensor that is not shared",
                    handle.serial
                )));
            }
        }
        Ok(())
    }

    /// Exports (once) the handles over `runs` and names them for the board.
    fn export_for_loan(&self, state: &State, runs: &[Run]) -> Result<Vec<LoanEntry>> {
        let mut entries = Vec::with_capacity(runs.len());
        for run in runs {
            let handle = state.mappings[&run.first_granule].handle();
            let Exported::Fd(fd) = handle.export_once(ExportTypes::POSIX_FD)? else {
                return Err(Error::Unsupported(
                    "this handle was exported as a fabric handle; loans travel as POSIX fds".into(),
                ));
            };
            entries.push(LoanEntry {
                serial: handle.serial,
                run: *run,
                fd: fd.as_raw_fd(),
            });
        }
        Ok(entries)
    }

    /// Unmaps the mappings over `runs` (after the caller's fence), handing their handles
    /// back; all or nothing: on error the ones unmapped are mapped back.
    fn unmap_all(&self, state: &mut State, runs: &[Run]) -> Result<Vec<(Run, PhysicalHandle)>> {
        let mut unmapped = Vec::with_capacity(runs.len());
        for &run in runs {
            let mapping = state
                .mappings
                .remove(run.first_granule)
                .expect("planned from the mappings");
            match mapping.unmap() {
                Ok(handle) => unmapped.push((run, handle)),
                Err((err, mapping)) => {
                    state.mappings.insert(mapping);
                    for (run, handle) in unmapped {
                        self.map_back(state, run, handle);
                    }
                    return Err(err);
                }
            }
        }
        Ok(unmapped)
    }

    fn describe_loan(&self, loan_id: u64, lent: &Lent, entries: &[LoanEntry]) -> LoanDescription {
        LoanDescription {
            device: self.device(),
            granularity: self.granularity(),
            owner_pid: std::process::id(),
            tensor_id: self.inner.tensor_id,
            loan_id,
            epoch: lent.epoch,
            board_fd: lent.board.raw_fd(),
            handles: entries
                .iter()
                .map(|e| LoanHandle {
                    run: e.run,
                    serial: e.serial,
                    fd: e.fd,
                })
                .collect(),
        }
    }

    /// Maps the handles of `loan` at the ends of this tensor's segments, growing every segment
    /// by the same number of bytes (the loan's, split evenly, handle after handle in the
    /// loan's order): the borrow of a loan from a tensor of the same geometry. The loan must
    /// fit that plan: the same device and granularity, segments that start and end at granule
    /// boundaries with no memory mapped past their ends, room for the loan, and no handle
    /// crossing a segment's end; else it is refused before anything is mapped, saying why. A
    /// loan of another geometry is dealt by the caller instead (`borrow_placed`). With `zero`,
    /// the borrowed bytes are zeroed on `stream` (skip it only for a trusted pair). `fds`,
    /// when given, are duplicates of fds received from the lender (its board's, then one per
    /// handle). A handle is borrowed at most once. All or nothing.
    pub fn borrow(
        &self,
        loan: &LoanDescription,
        fds: Option<Vec<OwnedFd>>,
        zero: bool,
        stream: Stream,
    ) -> Result<()> {
        loan.validate()?;
        let mut state = self.lock_owned("borrow")?;
        self.check_borrower(loan)?;
        // The loan goes past each segment's end, where a shrink's mappings may still wait for
        // their stream: let them go first.
        self.inner.releaser.settle();
        let (placed, segment_bytes) = self.place(&state, loan)?;
        let loans = std::slice::from_ref(loan);
        let planned = self.plan_placed(&state, loans, &placed, &segment_bytes)?;
        self.map_planned(&mut state, loans, vec![fds], planned, zero, stream)
    }

    /// Maps handles of `loans` where the caller placed them (`placed`, in order: each handle
    /// right after the previous one placed in its segment, the first right after what the
    /// segment maps from its committed end on, `borrow_room`), then sets every segment's
    /// committed bytes to `segment_bytes`. The placement comes from the caller's dealing of
    /// loans of any geometry over this tensor's segments (`extensible_kv.shape.deal`), and is
    /// checked here, untrusted: every handle inside its segment's room (granules free up to
    /// the segment's last, never over anything mapped or lent), each at most once, sizes no
    /// smaller than now and within capacity, every committed granule mapped. A loan's other
    /// handles may go to other tensors of this process: each handle is claimed on the
    /// lender's board on its own (a replay, even here, is refused). With `zero`, the mapped
    /// handles and the newly committed bytes are zeroed on `stream`. `fds[k]`, when given,
    /// are duplicates of fds received from the lender of `loans[k]`. All or nothing: a
    /// failure releases what it imported, unclaims its handles (the loan is offered again
    /// once no handle of it is claimed or returned) and leaves this tensor as it was.
    pub fn borrow_placed(
        &self,
        loans: &[LoanDescription],
        fds: Vec<Option<Vec<OwnedFd>>>,
        placed: &[PlacedHandle],
        segment_bytes: &[u64],
        zero: bool,
        stream: Stream,
    ) -> Result<()> {
        for loan in loans {
            loan.validate()?;
        }
        if fds.len() > loans.len() {
            return Err(Error::invalid(format!(
                "{} lists of received fds for {} loans",
                fds.len(),
                loans.len()
            )));
        }
        let mut state = self.lock_owned("borrow")?;
        for (k, loan) in loans.iter().enumerate() {
            self.check_borrower(loan)?;
            let twice = loans[..k]
                .iter()
                .any(|l| (l.tensor_id, l.loan_id) == (loan.tensor_id, loan.loan_id));
            if twice {
                return Err(Error::invalid(format!(
                    "loan {} of tensor {:032x} is listed twice",
                    loan.loan_id, loan.tensor_id
                )));
            }
        }
        self.inner.releaser.settle();
        let planned = self.plan_placed(&state, loans, placed, segment_bytes)?;
        self.map_planned(&mut state, loans, fds, planned, zero, stream)
    }

    /// Where a borrow may place handles now, per segment (what a caller deals by). Pending
    /// releases count as free: a borrow waits for them first.
    pub fn borrow_room(&self) -> Result<Vec<BorrowRoom>> {
        let state = self.lock_owned("borrow")?;
        let lent: Vec<Run> = state.loans.values().flat_map(Lent::runs).collect();
        Ok((0..self.num_segments())
            .map(|i| self.room_of(&state, &lent, i))
            .collect())
    }

    /// Segment `i`'s room: from the end of the mapped run that holds (or starts at) its
    /// committed end, the free granules up to its last one. A granule it shares with the next
    /// segment is that one's (its first): two segments never place into the same granule.
    fn room_of(&self, state: &State, lent: &[Run], i: usize) -> BorrowRoom {
        let geometry = &self.inner.geometry;
        let g = geometry.granularity();
        let (offset, capacity) = (
            geometry.segment_offsets()[i],
            geometry.segment_capacities()[i],
        );
        let committed = state.segment_bytes[i];
        let (end, at) = (offset + capacity, offset + committed);
        let last = match i + 1 < geometry.num_segments() && end % g != 0 {
            true => end / g,
            false => end.div_ceil(g),
        };
        let covering = |granule: u64| {
            let before = state.mappings.range(..=granule).next_back();
            before
                .map(|(_, m)| m.run)
                .filter(|run| run.end_granule() > granule)
        };
        let mut start = at / g;
        while let Some(run) = covering(start) {
            start = run.end_granule();
        }
        let next_mapped = state
            .mappings
            .range(start..)
            .next()
            .map(|(&first, _)| first);
        let next_lent = lent
            .iter()
            .filter(|run| run.end_granule() > start)
            .map(|run| run.first_granule.max(start))
            .min();
        let stop = [Some(last), next_mapped, next_lent]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(last);
        let usable = (start * g).min(end);
        let slack = i128::from(usable) - i128::from(at);
        BorrowRoom {
            start_granule: start,
            slack_bytes: i64::try_from(slack).unwrap_or(i64::MAX),
            room_granules: stop.saturating_sub(start),
            limit_bytes: capacity - committed,
        }
    }

    /// Checks a placement (`borrow_placed`) against this tensor and the loans: the runs the
    /// handles take, in the order placed, and what to zero past them.
    fn plan_placed(
        &self,
        state: &State,
        loans: &[LoanDescription],
        placed: &[PlacedHandle],
        segment_bytes: &[u64],
    ) -> Result<Planned> {
        let geometry = &self.inner.geometry;
        let g = geometry.granularity();
        let refuse =
            |why: String| Error::invalid(format!("this tensor cannot take the placement: {why}"));
        geometry.check_request(segment_bytes)?;
        let num_segments = geometry.num_segments();
        if let Some(i) = (0..num_segments).find(|&i| segment_bytes[i] < state.segment_bytes[i]) {
            return Err(refuse(format!(
                "segment {i} holds {} bytes, and a borrow never shrinks it (asked {})",
                state.segment_bytes[i], segment_bytes[i]
            )));
        }
        let mut seen = std::collections::HashSet::with_capacity(placed.len());
        for (n, p) in placed.iter().enumerate() {
            let Some(loan) = loans.get(p.loan) else {
                return Err(refuse(format!(
                    "placed[{n}] names loan {} of {}",
                    p.loan,
                    loans.len()
                )));
            };
            if p.handle >= loan.handles.len() || p.segment >= num_segments {
                return Err(refuse(format!(
                    "placed[{n}] names handle {} of {} and segment {} of {num_segments}",
                    p.handle,
                    loan.handles.len(),
                    p.segment
                )));
            }
            if !seen.insert((p.loan, p.handle)) {
                return Err(refuse(format!(
                    "handle {} of loan {} is placed twice",
                    p.handle, loan.loan_id
                )));
            }
        }
        let lent: Vec<Run> = state.loans.values().flat_map(Lent::runs).collect();
        let rooms: Vec<BorrowRoom> = (0..num_segments)
            .map(|i| self.room_of(state, &lent, i))
            .collect();
        let mut cursor: Vec<u64> = rooms.iter().map(|r| r.start_granule).collect();
        let mut handles = Vec::with_capacity(placed.len());
        for p in placed {
            let granules = loans[p.loan].handles[p.handle].run.num_granules;
            let (room, at) = (rooms[p.segment], cursor[p.segment]);
            let taken = at - room.start_granule;
            if granules > room.room_granules - taken {
                return Err(refuse(format!(
                    "segment {} has room for {} granules from granule {} (up to its end, or \
                     to memory mapped or lent past it); the placement puts {} or more there",
                    p.segment,
                    room.room_granules,
                    room.start_granule,
                    taken + granules
                )));
            }
            cursor[p.segment] = at + granules;
            handles.push((*p, Run::new(at, granules)));
        }
        let mut all: Vec<Run> = state.mappings.values().map(|m| m.run).collect();
        all.extend(handles.iter().map(|(_, run)| *run));
        all.sort_by_key(|run| run.first_granule);
        let missing = plan::subtract(&geometry.needed_runs(segment_bytes), &all);
        if let Some(run) = missing.first() {
            return Err(refuse(format!(
                "committing {segment_bytes:?} bytes per segment needs granules {} to {}, which \
                 neither this tensor nor the placement maps",
                run.first_granule,
                run.end_granule() - 1
            )));
        }
        // Newly committed bytes outside the placed handles (which are zeroed whole): the
        // slack before them, and any mapped memory past them.
        let mut zero_past = Vec::new();
        for i in 0..num_segments {
            let offset = geometry.segment_offsets()[i];
            let (from, to) = (offset + state.segment_bytes[i], offset + segment_bytes[i]);
            let (first, end) = (rooms[i].start_granule * g, cursor[i] * g);
            for (a, b) in [(from, to.min(first)), (from.max(end), to)] {
                if a < b && !(first < end && a >= first && b <= end) {
                    zero_past.push((a, b - a));
                }
            }
        }
        zero_past.dedup();
        Ok(Planned {
            handles,
            segment_bytes: segment_bytes.to_vec(),
            zero_past,
        })
    }

    /// Claims, imports, maps and (when asked) zeroes what `plan_placed` planned, all or
    /// nothing, and commits the sizes.
    fn map_planned(
        &self,
        state: &mut super::Locked<'_>,
        loans: &[LoanDescription],
        mut fds: Vec<Option<Vec<OwnedFd>>>,
        planned: Planned,
        zero: bool,
        stream: Stream,
    ) -> Result<()> {
        let mut used: Vec<Vec<usize>> = vec![Vec::new(); loans.len()];
        for (p, _) in &planned.handles {
            used[p.loan].push(p.handle);
        }
        fds.resize_with(loans.len(), || None);
        // Every board first, checked against its loan, then every claim: a refusal maps
        // nothing and leaves every board as it was.
        let mut opened: Vec<Option<(FdSource, Arc<LoanBoard>)>> = Vec::with_capacity(loans.len());
        for ((loan, fds), used) in loans.iter().zip(fds).zip(&used) {
            if used.is_empty() {
                opened.push(None);
                continue;
            }
            let mut source = loan.fd_source(fds)?;
            let board = Arc::new(loan.open_board(&mut source)?);
            opened.push(Some((source, board)));
        }
        let unclaim = |opened: &[Option<(FdSource, Arc<LoanBoard>)>], upto: usize| {
            for (k, entry) in opened.iter().enumerate().take(upto) {
                if let Some((_, board)) = entry {
                    board.unclaim(&used[k]);
                }
            }
        };
        for (k, entry) in opened.iter().enumerate() {
            let Some((_, board)) = entry else { continue };
            if let Err(why) = board.claim(&used[k]) {
                unclaim(&opened, k);
                return Err(loans[k].claim_refused(why));
            }
        }
        let mut fresh = Vec::with_capacity(planned.handles.len());
        let mut queued = false;
        let mapped = self.map_borrowed(
            loans,
            &mut opened,
            &planned,
            (zero, stream, &mut queued),
            &mut fresh,
        );
        if let Err(err) = mapped {
            if queued {
                self.inner.ctx.defer(self.inner.ctx.driver.fence(stream));
            }
            drop(fresh); // unmaps and releases what was imported (marking it returned)
            unclaim(&opened, opened.len());
            return Err(err);
        }
        for mapping in fresh {
            state.mappings.insert(mapping);
        }
        state.segment_bytes = planned.segment_bytes;
        debug_assert_eq!(check_state(&self.inner, state), Ok(()));
        Ok(())
    }

    /// Imports, maps, grants access to and (when asked) zeroes each placed handle, pushing
    /// each mapping into `fresh` as soon as it exists, then zeroes the other newly committed
    /// bytes.
    fn map_borrowed(
        &self,
        loans: &[LoanDescription],
        opened: &mut [Option<(FdSource, Arc<LoanBoard>)>],
        planned: &Planned,
        (zero, stream, queued): (bool, Stream, &mut bool),
        fresh: &mut Vec<Mapping>,
    ) -> Result<()> {
        let ctx = &self.inner.ctx;
        for &(p, run) in &planned.handles {
            let loan = &loans[p.loan];
            let (source, board) = opened[p.loan].as_mut().expect("opened for its handles");
            // Taken and checked one at a time, right before its import: the zeroing of the
            // handles before it is slow (~0.7 s a GiB on the host), and the lender may close
            // meanwhile.
            let fd = loan.take_handle(source, board, p.handle)?;
            let (va, num_bytes) = ctx.span(run);
            let id = ctx.driver.import(ImportSource::Fd(fd.as_fd()), num_bytes)?;
            let mut handle = PhysicalHandle::adopt(ctx, id, ctx.next_serial());
            handle.loan = Some(LoanSlot {
                board: Arc::clone(board),
                index: p.handle,
                tensor_id: loan.tensor_id,
                loan_id: loan.loan_id,
            });
            fresh.push(Mapping::map(handle, run)?);
            ctx.driver.set_access(va, num_bytes)?;
            if zero {
                *queued = true;
                ctx.driver.memset_zero(va, num_bytes, stream)?;
            }
        }
        if zero {
            for &(offset, num_bytes) in &planned.zero_past {
                *queued = true;
                ctx.driver
                    .memset_zero(ctx.base + offset, num_bytes, stream)?;
            }
        }
        Ok(())
    }

    /// Refuses a loan of another device or granularity, or of this very tensor.
    fn check_borrower(&self, loan: &LoanDescription) -> Result<()> {
        if loan.device != self.device() || loan.granularity != self.granularity() {
            return Err(Error::invalid(format!(
                "cannot borrow a loan of {} with granularity {} into a tensor on {} with \
                 granularity {}: the device and granularity must be the same",
                loan.device.torch_name(),
                loan.granularity,
                self.device().torch_name(),
                self.granularity()
            )));
        }
        if loan.tensor_id == self.inner.tensor_id {
            return Err(Error::invalid(
                "a tensor cannot borrow its own loan: reclaim it instead".to_string(),
            ));
        }
        Ok(())
    }

    /// Where `borrow` maps the loan: the granules past each segment's end, the same number
    /// per segment, handle after handle in order; refused, saying why, where that cannot be.
    fn place(
        &self,
        state: &State,
        loan: &LoanDescription,
    ) -> Result<(Vec<PlacedHandle>, Vec<u64>)> {
        let geometry = &self.inner.geometry;
        let g = geometry.granularity();
        let num_segments = geometry.num_segments() as u64;
        let total: u64 = loan.handles.iter().map(|h| h.run.num_granules).sum();
        let refuse =
            |why: String| Error::invalid(format!("this tensor cannot take the loan: {why}"));
        if total % num_segments != 0 {
            return Err(refuse(format!(
                "its {total} granules do not split evenly over {num_segments} segments"
            )));
        }
        let per_segment = total / num_segments;
        let mut handles = loan.handles.iter().enumerate().peekable();
        let mut placed = Vec::with_capacity(loan.handles.len());
        let mut segment_bytes = state.segment_bytes.clone();
        let lent: Vec<Run> = state.loans.values().flat_map(Lent::runs).collect();
        for (i, size) in segment_bytes.iter_mut().enumerate() {
            let (offset, capacity) = (
                geometry.segment_offsets()[i],
                geometry.segment_capacities()[i],
            );
            if offset % g != 0 || *size % g != 0 {
                return Err(refuse(format!(
                    "segment {i} (at byte {offset}, holding {size} bytes) does not end at a \
                     granule boundary of {g} bytes, where a handle must start"
                )));
            }
            let room = (capacity - *size) / g;
            if room < per_segment {
                return Err(refuse(format!(
                    "segment {i} has room for {room} granules past its {size} bytes; the loan \
                     needs {per_segment} in every segment"
                )));
            }
            let mut next = (offset + *size) / g;
            let end = next + per_segment;
            let span = Run::new(next, per_segment);
            let mut busy = state
                .mappings
                .values()
                .map(|m| m.run)
                .chain(lent.iter().copied());
            if let Some(run) = busy.find(|r| {
                r.first_granule < span.end_granule() && span.first_granule < r.end_granule()
            }) {
                return Err(refuse(format!(
                    "segment {i} has granules {} to {} mapped or lent past its {size} bytes \
                     (slack of a shrink, or a loan of its own): shrink exact or reclaim first",
                    run.first_granule,
                    run.end_granule() - 1
                )));
            }
            while next < end {
                let (index, h) = handles.next().expect("the total splits evenly");
                if next + h.run.num_granules > end {
                    return Err(refuse(format!(
                        "handle of {} granules would cross the end of segment {i}: {} granules \
                         per segment do not fall on the loan's handle boundaries",
                        h.run.num_granules, per_segment
                    )));
                }
                placed.push(PlacedHandle {
                    loan: 0,
                    handle: index,
                    segment: i,
                });
                next += h.run.num_granules;
            }
            *size += per_segment * g;
        }
        Ok((placed, segment_bytes))
    }

    /// Gives the handles of `loan` back to their lender: every segment shrinks to where the
    /// loan's handles begin in it (bytes past them, which this tensor grew later, are
    /// released), after a fence on `stream`. Each handle is unmapped and released, then
    /// marked returned on the lender's board. If the lender is gone, the memory goes back to
    /// the driver. A `ValueError` if this tensor maps no handle of the loan. All or nothing.
    pub fn give_back(&self, loan: &LoanDescription, stream: Stream) -> Result<()> {
        match self.give_back_loans(std::slice::from_ref(loan), stream)? {
            0 => Err(Error::invalid(format!(
                "this tensor holds no handle of loan {} (never borrowed here, or given back \
                 already)",
                loan.loan_id
            ))),
            _ => Ok(()),
        }
    }

    /// `give_back` of the handles of any of `loans` this tensor maps (a loan dealt over
    /// several tensors goes back from each): every segment whose committed bytes reach one
    /// of them shrinks to where it begins. The bytes of those handles, 0 (and nothing done)
    /// if it maps none. All or nothing.
    pub fn give_back_loans(&self, loans: &[LoanDescription], stream: Stream) -> Result<u64> {
        let mut state = self.lock_owned("give back")?;
        let geometry = &self.inner.geometry;
        let g = geometry.granularity();
        let theirs: Vec<Run> = state
            .mappings
            .values()
            .filter(|m| {
                m.handle().loan.as_ref().is_some_and(|slot| {
                    loans
                        .iter()
                        .any(|l| (slot.tensor_id, slot.loan_id) == (l.tensor_id, l.loan_id))
                })
            })
            .map(|m| m.run)
            .collect();
        if theirs.is_empty() {
            return Ok(0);
        }
        let mut sizes = state.segment_bytes.clone();
        for (i, size) in sizes.iter_mut().enumerate() {
            let offset = geometry.segment_offsets()[i];
            let committed = Run::new(offset / g, (offset + *size).div_ceil(g) - offset / g);
            for run in &theirs {
                if !plan::intersect_run(*run, &[committed]).is_empty() {
                    *size = (*size).min((run.first_granule * g).saturating_sub(offset));
                }
            }
        }
        let needed = geometry.needed_runs(&sizes);
        let mapped: Vec<Run> = state.mappings.values().map(|m| m.run).collect();
        let dead = plan::plan_shrink(&mapped, &needed).dead;
        // The fence: work queued on `stream` may still touch the borrowed memory.
        self.inner.ctx.driver.fence(stream)?;
        self.swap_in(&mut state, &dead, Vec::new())?;
        state.segment_bytes = sizes;
        debug_assert_eq!(check_state(&self.inner, &state), Ok(()));
        Ok(theirs.iter().map(|run| run.num_granules * g).sum())
    }

    /// Takes loan `loan` back: waits (without the tensor's lock) up to `timeout` (`None`:
    /// for ever) until the borrower has given back every handle, or is gone, or never
    /// borrowed it; then maps the handles back at their addresses, zeroed on `stream` with
    /// `zero`. The segments grow back to their sizes before the lend if they still hold what
    /// the lend kept and every granule up to those sizes is mapped (an exact shrink, a
    /// consolidation or a shrink and grow since may have dropped the tail of a handle that
    /// straddled the size kept); else the handles are mapped as slack, for a later grow.
    /// Past the timeout, `Error::Timeout` and nothing changes. All or nothing. One reclaim of
    /// a loan at a time: a second, meanwhile, is refused.
    pub fn reclaim(
        &self,
        loan: &LoanDescription,
        zero: bool,
        timeout: Option<Duration>,
        stream: Stream,
    ) -> Result<()> {
        self.reclaim_or_stop(loan, zero, timeout, stream, &mut || false)
    }

    /// `reclaim`, asking `stop` every 50 ms or so of the wait whether the caller gives up (the
    /// bindings check for signals there): then the wait ends, with the reclaim if the loan is
    /// back by then, else with `Error::Interrupted` and nothing changed.
    pub fn reclaim_or_stop(
        &self,
        loan: &LoanDescription,
        zero: bool,
        timeout: Option<Duration>,
        stream: Stream,
        stop: &mut dyn FnMut() -> bool,
    ) -> Result<()> {
        let board = {
            let mut state = self.lock_owned("reclaim")?;
            let lent = self.lent_mut(&mut state, loan)?;
            if lent.reclaiming {
                return Err(Error::invalid(format!(
                    "loan {} is being reclaimed already, by another call that waits for it",
                    loan.loan_id
                )));
            }
            lent.reclaiming = true;
            Arc::clone(&lent.board)
        };
        let waited = wait_returned(&board, loan.loan_id, timeout, stop);
        let mut state = self.lock_owned("reclaim")?; // closed meanwhile: the loan went with it
        let result = waited.and_then(|was| {
            let mapped = self.map_lent_back(&mut state, loan.loan_id, zero, stream);
            if mapped.is_err() {
                board.reopen(was);
            }
            mapped
        });
        if let Some(lent) = state.loans.get_mut(&loan.loan_id) {
            lent.reclaiming = false;
        }
        result?;
        board.close();
        debug_assert_eq!(check_state(&self.inner, &state), Ok(()));
        Ok(())
    }

    fn lent_mut<'s>(&self, state: &'s mut State, loan: &LoanDescription) -> Result<&'s mut Lent> {
        self.lent(state, loan)?;
        Ok(state.loans.get_mut(&loan.loan_id).expect("found just now"))
    }

    fn lent<'s>(&self, state: &'s State, loan: &LoanDescription) -> Result<&'s Lent> {
        let lent = state.loans.get(&loan.loan_id);
        match lent {
            Some(lent) if loan.tensor_id == self.inner.tensor_id && lent.epoch == loan.epoch => {
                Ok(lent)
            }
            _ => Err(Error::invalid(format!(
                "loan {} of tensor {:032x} is not outstanding here (reclaimed already, or \
                 another tensor's)",
                loan.loan_id, loan.tensor_id
            ))),
        }
    }

    /// Maps the handles of loan `loan_id` back over their runs, all or nothing, and removes
    /// the loan.
    fn map_lent_back(
        &self,
        state: &mut State,
        loan_id: u64,
        zero: bool,
        stream: Stream,
    ) -> Result<()> {
        let ctx = &self.inner.ctx;
        let mut lent = state.loans.remove(&loan_id).expect("checked by the caller");
        let mut left = std::mem::take(&mut lent.handles).into_iter();
        let mut fresh: Vec<Mapping> = Vec::with_capacity(left.len());
        let mut queued = false;
        let mut failed = None;
        for (run, handle) in left.by_ref() {
            let mapping = match Mapping::try_map(handle, run) {
                Ok(mapping) => mapping,
                Err((err, handle)) => {
                    lent.handles.push((run, handle));
                    failed = Some(err);
                    break;
                }
            };
            fresh.push(mapping);
            let (va, num_bytes) = ctx.span(run);
            let step = ctx.driver.set_access(va, num_bytes).and_then(|()| {
                queued |= zero;
                match zero {
                    true => ctx.driver.memset_zero(va, num_bytes, stream),
                    false => Ok(()),
                }
            });
            if let Err(err) = step {
                failed = Some(err);
                break;
            }
        }
        if let Some(err) = failed {
            // Back as it was: what this call mapped is unmapped (after a fence if it queued
            // memsets) and the loan keeps every handle.
            if queued {
                ctx.defer(ctx.driver.fence(stream));
            }
            lent.handles.extend(self.unmap_fresh(fresh));
            lent.handles.extend(left);
            lent.handles.sort_by_key(|(run, _)| *run);
            state.loans.insert(loan_id, lent);
            return Err(err);
        }
        for mapping in fresh {
            state.mappings.insert(mapping);
        }
        // Only over mapped granules: since the lend, the handle that straddled the size kept
        // may have lost its tail (an exact shrink, a consolidation, a shrink and a grow).
        let mapped: Vec<Run> = state.mappings.values().map(|m| m.run).collect();
        let needed = self.inner.geometry.needed_runs(&lent.before_bytes);
        if state.segment_bytes == lent.kept_bytes && plan::subtract(&needed, &mapped).is_empty() {
            state.segment_bytes.clone_from(&lent.before_bytes);
        }
        Ok(())
    }

    /// Unmaps mappings this call just made, handing their handles back (one the driver will
    /// not unmap is dropped, which unmaps it later and records the error).
    fn unmap_fresh(&self, fresh: Vec<Mapping>) -> Vec<(Run, PhysicalHandle)> {
        let mut handles = Vec::with_capacity(fresh.len());
        for mapping in fresh {
            let run = mapping.run;
            match mapping.unmap() {
                Ok(handle) => handles.push((run, handle)),
                Err((err, mapping)) => {
                    self.inner.ctx.defer(Err(err));
                    drop(mapping);
                }
            }
        }
        handles
    }

    /// The bytes lent out and not reclaimed yet.
    pub fn lent_bytes(&self) -> u64 {
        let state = self.lock();
        let runs = state.loans.values().flat_map(Lent::runs);
        runs.map(|run| self.inner.ctx.span(run).1).sum()
    }

    /// The bytes of borrowed handles this tensor maps (part of `physical_bytes`).
    pub fn borrowed_bytes(&self) -> u64 {
        let state = self.lock();
        let borrowed = state
            .mappings
            .values()
            .filter(|m| m.handle().loan.is_some());
        borrowed.map(Mapping::num_bytes).sum()
    }

    /// Refuses a grow that would map any of `new_runs` over lent granules (invariant 1).
    pub(super) fn refuse_lent(&self, state: &State, new_runs: &[Run]) -> Result<()> {
        for (loan_id, lent) in &state.loans {
            for run in lent.runs() {
                if !plan::intersect_run(run, new_runs).is_empty() {
                    return Err(Error::invalid(format!(
                        "cannot grow over granules {} to {}: they are lent (loan {loan_id}); \
                         reclaim the loan first",
                        run.first_granule,
                        run.end_granule() - 1
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Waits until loan `loan_id`'s board says its handles may be mapped again, then closes it
/// (atomically, from the state it found: no borrower can claim it, nor a failed borrow offer
/// it again, while the lender maps the handles back) and returns that state, for a reclaim
/// that fails to put back. Ready: never borrowed, every handle returned, or the borrower gone.
/// Polls the board every few milliseconds, sleeping on the borrower's pidfd, and asks `stop`
/// every `STOP_EVERY`: once it says so, a loan not back at the next look ends the wait with
/// `Error::Interrupted`.
fn wait_returned(
    board: &LoanBoard,
    loan_id: u64,
    timeout: Option<Duration>,
    stop: &mut dyn FnMut() -> bool,
) -> Result<BoardState> {
    const SLICE_MS: i32 = 2;
    const STOP_EVERY: Duration = Duration::from_millis(50);
    let started = Instant::now();
    let mut asked = started;
    let mut stopping = false;
    let mut watched: Option<(u32, Watched)> = None;
    let mut gone: Option<u32> = None;
    loop {
        let now = board.state();
        let (pid, start_time) = match now {
            BoardState::Closed => return Ok(now),
            BoardState::Offered if board.close_from(now) => return Ok(now),
            BoardState::Offered => continue, // claimed or unclaimed meanwhile: look again
            BoardState::Taken { pid, start_time } => (pid, start_time),
        };
        if board.num_returned() == board.num_handles() || gone == Some(pid) {
            match board.close_from(now) {
                true => return Ok(now),
                false => continue, // a failed borrow offered it again: look again
            }
        }
        let still = |after: String| {
            format!(
                "loan {loan_id} is still borrowed by process {pid}{after} ({} of {} handles \
                 given back); nothing was changed",
                board.num_returned(),
                board.num_handles()
            )
        };
        if stopping {
            return Err(Error::Interrupted(still(String::new())));
        }
        if let Some(limit) = timeout.filter(|&limit| started.elapsed() >= limit) {
            let after = format!(" after {} ms", limit.as_millis());
            return Err(Error::Timeout(still(after)));
        }
        if asked.elapsed() >= STOP_EVERY {
            asked = Instant::now();
            stopping = stop();
            continue; // one more look: a loan back by now is reclaimed all the same
        }
        let watch = match &watched {
            Some((watching, watch)) if *watching == pid => watch,
            _ => &watched.insert((pid, Watched::new(pid, start_time))).1,
        };
        if watch.wait_gone(SLICE_MS) {
            gone = Some(pid);
        }
    }
}
