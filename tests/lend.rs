//! Lend and borrow on the host backend, in one process: bytes and addresses kept at every
//! step, loans checked field by field and against the lender's board, refusals that say why,
//! and the all-or-nothing sweep: a lend, borrow, give-back or reclaim that fails at any driver
//! call leaves both sides exactly as they were (tests/fault_injection.rs style).

#[path = "support/common.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use extensible_kv::driver::host::HostDriver;
use extensible_kv::driver::wrap::faulty::{Fault, FaultKind, FaultyDriver};
use extensible_kv::driver::{ExportTypes, Stream};
use extensible_kv::{
    BorrowRoom, Error, ExtensibleTensor, GrowOptions, HandleSizing, LoanDescription, Op, Options,
    PlacedHandle, Run, ShrinkOptions,
};

const G: u64 = 4096;
const CAPACITY: u64 = 8 * G;
const BEFORE: u64 = 6 * G;
const KEPT: u64 = 2 * G;
const BORROWER_START: u64 = 2 * G;
const NOW: Option<Duration> = Some(Duration::from_millis(20));

fn options() -> Options {
    Options {
        handle_sizing: HandleSizing::CapAligned {
            max_bytes: Some(2 * G),
        },
        export_types: ExportTypes::POSIX_FD,
        ..Options::default()
    }
}

fn never(op: Op) -> Fault {
    Fault {
        op,
        nth: u64::MAX,
        kind: FaultKind::Driver,
    }
}

struct Side {
    host: Arc<HostDriver>,
    faulty: Arc<FaultyDriver>,
    tensor: ExtensibleTensor,
}

impl Side {
    fn new(fault: Fault, grow_to: u64) -> Side {
        let host = Arc::new(HostDriver::new(G).unwrap());
        let faulty = Arc::new(FaultyDriver::new(host.clone(), fault));
        let tensor =
            ExtensibleTensor::with_equal_segments(faulty.clone(), 2 * CAPACITY, 2, options())
                .unwrap();
        tensor
            .resize_per_segment(grow_to, GrowOptions::zeroed())
            .unwrap();
        Side {
            host,
            faulty,
            tensor,
        }
    }

    /// Everything a failed operation must leave as it was.
    fn snapshot(&self) -> impl PartialEq + std::fmt::Debug {
        let t = &self.tensor;
        let offsets = t.geometry().segment_offsets();
        (
            t.segment_bytes(),
            t.physical_bytes(),
            t.handle_runs(),
            t.lent_bytes(),
            t.borrowed_bytes(),
            self.host.live_counts(),
            (offsets.iter().zip(t.segment_bytes()))
                .map(|(&offset, bytes)| common::read(t, offset, bytes))
                .collect::<Vec<_>>(),
        )
    }
}

fn pattern(n: u64, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed) | 1)
        .collect()
}

fn fill(tensor: &ExtensibleTensor, seed: u8) {
    for s in 0..2u64 {
        let n = tensor.segment_bytes()[s as usize];
        common::write(tensor, s * CAPACITY, &pattern(n, seed + s as u8));
    }
}

fn lend(lender: &Side) -> LoanDescription {
    lender.tensor.lend(KEPT, Stream::DEFAULT).unwrap()
}

#[test]
fn lend_borrow_give_back_reclaim_keeps_bytes_and_addresses() {
    for zero in [false, true] {
        let lender = Side::new(never(Op::Map), BEFORE);
        let borrower = Side::new(never(Op::Map), BORROWER_START);
        fill(&lender.tensor, 10);
        fill(&borrower.tensor, 50);
        let base = lender.tensor.base_ptr().unwrap();
        let physical_before = lender.tensor.physical_bytes();

        let loan = lend(&lender);
        assert_eq!(loan.handles.len(), 4, "{loan:?}");
        assert_eq!(loan.num_bytes(), 2 * (BEFORE - KEPT));
        assert_eq!(lender.tensor.segment_bytes(), vec![KEPT, KEPT]);
        assert_eq!(lender.tensor.lent_bytes(), loan.num_bytes());
        assert_eq!(
            lender.tensor.physical_bytes() + lender.tensor.lent_bytes(),
            physical_before,
            "lent memory is counted once, not twice"
        );

        borrower
            .tensor
            .borrow(&loan, None, zero, Stream::DEFAULT)
            .unwrap();
        let grown = BORROWER_START + BEFORE - KEPT;
        assert_eq!(borrower.tensor.segment_bytes(), vec![grown, grown]);
        assert_eq!(borrower.tensor.borrowed_bytes(), loan.num_bytes());
        for s in 0..2u64 {
            let got = common::read(&borrower.tensor, s * CAPACITY, grown);
            let own = pattern(BORROWER_START, 50 + s as u8);
            let lent = match zero {
                true => vec![0; (BEFORE - KEPT) as usize],
                false => pattern(BEFORE, 10 + s as u8)[KEPT as usize..].to_vec(),
            };
            assert_eq!(got, [own, lent].concat(), "segment {s}, zero={zero}");
        }
        borrower.tensor.check_invariants().unwrap();
        lender.tensor.check_invariants().unwrap();

        // Replayed: refused, and the borrower is unchanged.
        let other = Side::new(never(Op::Map), BORROWER_START);
        let err = other
            .tensor
            .borrow(&loan, None, false, Stream::DEFAULT)
            .unwrap_err();
        assert!(err.to_string().contains("at most once"), "{err}");
        assert_eq!(other.tensor.borrowed_bytes(), 0);

        // The lender may not grow over what it lent, and a reclaim waits for the give-back.
        let err = lender
            .tensor
            .resize_per_segment(BEFORE, GrowOptions::zeroed())
            .unwrap_err();
        assert!(err.to_string().contains("lent"), "{err}");
        let err = lender
            .tensor
            .reclaim(&loan, false, NOW, Stream::DEFAULT)
            .unwrap_err();
        assert!(matches!(err, Error::Timeout(_)), "{err:?}");
        assert_eq!(lender.tensor.segment_bytes(), vec![KEPT, KEPT]);

        fill(&borrower.tensor, 90);
        borrower.tensor.give_back(&loan, Stream::DEFAULT).unwrap();
        assert_eq!(borrower.tensor.segment_bytes(), vec![BORROWER_START; 2]);
        assert_eq!(borrower.tensor.borrowed_bytes(), 0);
        lender
            .tensor
            .reclaim(&loan, zero, NOW, Stream::DEFAULT)
            .unwrap();
        assert_eq!(lender.tensor.base_ptr().unwrap(), base);
        assert_eq!(lender.tensor.segment_bytes(), vec![BEFORE, BEFORE]);
        assert_eq!(lender.tensor.physical_bytes(), physical_before);
        assert_eq!(lender.tensor.lent_bytes(), 0);
        for s in 0..2u64 {
            let got = common::read(&lender.tensor, s * CAPACITY, BEFORE);
            let kept = pattern(BEFORE, 10 + s as u8)[..KEPT as usize].to_vec();
            let back = match zero {
                true => vec![0; (BEFORE - KEPT) as usize],
                false => pattern(grown, 90 + s as u8)[BORROWER_START as usize..].to_vec(),
            };
            assert_eq!(got, [kept, back].concat(), "segment {s}, zero={zero}");
        }
        lender.tensor.check_invariants().unwrap();
        // Stale: reclaimed loans are refused, by borrowers and by the lender.
        let err = other
            .tensor
            .borrow(&loan, None, false, Stream::DEFAULT)
            .unwrap_err();
        assert!(err.to_string().contains("stale"), "{err}");
        assert!(lender
            .tensor
            .reclaim(&loan, false, NOW, Stream::DEFAULT)
            .is_err());
        // A second loan of the same handles reuses their exports.
        let exports = lender.faulty.calls(Op::Export);
        let again = lend(&lender);
        assert_eq!(lender.faulty.calls(Op::Export), exports);
        lender
            .tensor
            .reclaim(&again, false, NOW, Stream::DEFAULT)
            .unwrap();
        for side in [lender, borrower, other] {
            side.tensor.close().unwrap();
            assert_eq!(side.host.live_counts(), (0, 0, 0));
        }
    }
}

#[test]
fn tampered_loans_are_refused_before_anything_is_mapped() {
    let lender = Side::new(never(Op::Map), BEFORE);
    let borrower = Side::new(never(Op::Map), BORROWER_START);
    let loan = lend(&lender);
    let before = borrower.snapshot();
    let mut tampered: Vec<(&str, LoanDescription)> = Vec::new();
    let mut t = loan.clone();
    t.epoch ^= 1;
    tampered.push(("epoch", t));
    let mut t = loan.clone();
    t.tensor_id ^= 1;
    tampered.push(("tensor_id", t));
    let mut t = loan.clone();
    t.loan_id += 1;
    tampered.push(("loan_id", t));
    let mut t = loan.clone();
    t.handles[0].serial += 100;
    tampered.push(("serial", t));
    let mut t = loan.clone();
    t.handles[1].fd = t.handles[0].fd;
    tampered.push(("fd", t));
    let mut t = loan.clone();
    t.handles.truncate(2);
    tampered.push(("subset", t));
    let mut t = loan.clone();
    t.board_fd = t.handles[0].fd;
    tampered.push(("board_fd", t));
    let mut t = loan.clone();
    t.handles.swap(0, 1);
    tampered.push(("order", t));
    let mut t = loan.clone();
    t.epoch = 0;
    tampered.push(("zero epoch", t));
    let mut t = loan.clone();
    t.handles[0].run = Run::new(u64::MAX, 2);
    tampered.push(("wrapping run", t));
    let mut t = loan.clone();
    t.handles[0].run.num_granules = 0;
    tampered.push(("empty run", t));
    for (what, t) in tampered {
        let err = borrower
            .tensor
            .borrow(&t, None, false, Stream::DEFAULT)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{what}: {err:?}");
        if what.ends_with(" run") {
            assert!(err.to_string().contains("not a non-empty range"), "{err}");
        }
        assert_eq!(borrower.snapshot(), before, "{what}");
    }
    // The genuine loan still goes through: refusals left the board offered.
    borrower
        .tensor
        .borrow(&loan, None, false, Stream::DEFAULT)
        .unwrap();
}

#[test]
fn a_geometry_that_cannot_take_the_loan_is_refused_saying_why() {
    let lender = Side::new(never(Op::Map), BEFORE);
    let loan = lend(&lender);
    let driver = || Arc::new(HostDriver::new(G).unwrap());
    let tensor = |caps: Vec<u64>, grow: Vec<u64>| {
        let t = ExtensibleTensor::with_segment_capacities(driver(), caps, options()).unwrap();
        t.resize_per_segment(&grow[..], GrowOptions::zeroed())
            .unwrap();
        t
    };
    let cases = [
        (tensor(vec![9 * G; 3], vec![0; 3]), "split evenly"),
        (tensor(vec![4 * G; 2], vec![G; 2]), "room for 3 granules"),
        (tensor(vec![8 * G; 2], vec![100, 100]), "granule boundary"),
        (tensor(vec![G, 16 * G], vec![0, 0]), "room for 1 granules"),
        (
            tensor(vec![2 * G; 8], vec![0; 8]),
            "cross the end of segment 0",
        ),
    ];
    for (t, why) in cases {
        let before = (t.segment_bytes(), t.physical_bytes());
        let err = t.borrow(&loan, None, false, Stream::DEFAULT).unwrap_err();
        assert!(err.to_string().contains(why), "{why}: {err}");
        assert_eq!((t.segment_bytes(), t.physical_bytes()), before);
    }
    // Slack past the committed bytes (a shrink that kept a straddling handle).
    let slack = tensor(vec![8 * G; 2], vec![3 * G; 2]);
    slack
        .shrink_per_segment(G, ShrinkOptions::default())
        .unwrap();
    let err = slack
        .borrow(&loan, None, false, Stream::DEFAULT)
        .unwrap_err();
    assert!(err.to_string().contains("mapped or lent"), "{err}");
    // Another granularity, and the lender itself.
    let coarse = ExtensibleTensor::with_equal_segments(
        driver(),
        32 * G,
        2,
        Options {
            granularity: Some(2 * G),
            ..options()
        },
    )
    .unwrap();
    let err = coarse
        .borrow(&loan, None, false, Stream::DEFAULT)
        .unwrap_err();
    assert!(err.to_string().contains("granularity"), "{err}");
    let err = lender
        .tensor
        .borrow(&loan, None, false, Stream::DEFAULT)
        .unwrap_err();
    assert!(err.to_string().contains("own loan"), "{err}");
    // One segment of the right room takes all of it, handle after handle.
    let one = tensor(vec![16 * G], vec![0]);
    one.borrow(&loan, None, false, Stream::DEFAULT).unwrap();
    assert_eq!(one.segment_bytes(), vec![8 * G]);
}

#[test]
fn a_partial_give_back_returns_whole_handles_and_reclaim_waits_for_the_rest() {
    let lender = Side::new(never(Op::Map), BEFORE);
    let borrower = Side::new(never(Op::Map), BORROWER_START);
    let loan = lend(&lender);
    borrower
        .tensor
        .borrow(&loan, None, false, Stream::DEFAULT)
        .unwrap();
    // Into the middle of the second borrowed handle of each segment: it stays whole.
    borrower
        .tensor
        .shrink_per_segment(BORROWER_START + 3 * G, ShrinkOptions::default())
        .unwrap();
    assert_eq!(borrower.tensor.borrowed_bytes(), 2 * 4 * G);
    // Into the middle of the first: the second goes back to the lender, whole.
    borrower
        .tensor
        .shrink_per_segment(BORROWER_START + G, ShrinkOptions::default())
        .unwrap();
    assert_eq!(borrower.tensor.borrowed_bytes(), 2 * 2 * G, "whole handles");
    let err = lender
        .tensor
        .reclaim(&loan, false, NOW, Stream::DEFAULT)
        .unwrap_err();
    assert!(err.to_string().contains("2 of 4 handles"), "{err}");
    borrower.tensor.give_back(&loan, Stream::DEFAULT).unwrap();
    lender
        .tensor
        .reclaim(&loan, false, NOW, Stream::DEFAULT)
        .unwrap();
    assert_eq!(lender.tensor.segment_bytes(), vec![BEFORE, BEFORE]);
}

#[test]
fn a_loan_never_borrowed_comes_back_at_once_and_a_closed_lender_leaves_the_borrower_be() {
    let lender = Side::new(never(Op::Map), BEFORE);
    let borrower = Side::new(never(Op::Map), BORROWER_START);
    let loan = lend(&lender);
    lender
        .tensor
        .reclaim(&loan, false, Some(Duration::ZERO), Stream::DEFAULT)
        .unwrap();
    assert!(borrower
        .tensor
        .borrow(&loan, None, false, Stream::DEFAULT)
        .is_err());

    fill(&lender.tensor, 30);
    let loan = lend(&lender);
    borrower
        .tensor
        .borrow(&loan, None, false, Stream::DEFAULT)
        .unwrap();
    lender.tensor.close().unwrap();
    assert_eq!(lender.host.live_counts(), (0, 0, 0));
    let grown = BORROWER_START + BEFORE - KEPT;
    let got = common::read(&borrower.tensor, 0, grown);
    assert_eq!(
        &got[BORROWER_START as usize..],
        &pattern(BEFORE, 30)[KEPT as usize..]
    );
    borrower.tensor.give_back(&loan, Stream::DEFAULT).unwrap();
    borrower.tensor.check_invariants().unwrap();
}

/// The operations of a loan's life, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd)]
enum Step {
    Lend,
    Borrow,
    GiveBack,
    Reclaim,
}

/// A lender and a borrower, each on its own faulty driver, taken up to just before `step`.
fn up_to(
    step: Step,
    lender_fault: Fault,
    borrower_fault: Fault,
) -> (Side, Side, Option<LoanDescription>) {
    let lender = Side::new(lender_fault, BEFORE);
    let borrower = Side::new(borrower_fault, BORROWER_START);
    fill(&lender.tensor, 10);
    fill(&borrower.tensor, 50);
    if step == Step::Lend {
        return (lender, borrower, None);
    }
    let loan = lend(&lender);
    if step > Step::Borrow {
        borrower
            .tensor
            .borrow(&loan, None, true, Stream::DEFAULT)
            .unwrap();
    }
    if step > Step::GiveBack {
        borrower.tensor.give_back(&loan, Stream::DEFAULT).unwrap();
    }
    (lender, borrower, Some(loan))
}

fn run(
    step: Step,
    lender: &Side,
    borrower: &Side,
    loan: Option<&LoanDescription>,
) -> Result<(), Error> {
    let s = Stream::DEFAULT;
    match (step, loan) {
        (Step::Lend, _) => lender.tensor.lend(KEPT, s).map(drop),
        (Step::Borrow, Some(loan)) => borrower.tensor.borrow(loan, None, true, s),
        (Step::GiveBack, Some(loan)) => borrower.tensor.give_back(loan, s),
        (Step::Reclaim, Some(loan)) => lender.tensor.reclaim(loan, true, NOW, s),
        _ => unreachable!(),
    }
}

#[test]
fn every_failed_call_of_a_loan_leaves_both_sides_as_they_were() {
    let steps = [
        (
            Step::Lend,
            true,
            [Op::Export, Op::Synchronize, Op::Unmap].as_slice(),
        ),
        (
            Step::Borrow,
            false,
            &[Op::Import, Op::Map, Op::SetAccess, Op::Memset],
        ),
        (Step::GiveBack, false, &[Op::Synchronize, Op::Unmap]),
        (Step::Reclaim, true, &[Op::Map, Op::SetAccess, Op::Memset]),
    ];
    let mut injected = 0;
    for (step, on_lender, ops) in steps {
        for &op in ops {
            let faults = |f: Fault| match on_lender {
                true => (f, never(op)),
                false => (never(op), f),
            };
            let (lf, bf) = faults(never(op));
            let (lender, borrower, loan) = up_to(step, lf, bf);
            let side = |l: &Side, b: &Side| {
                if on_lender {
                    l.faulty.calls(op)
                } else {
                    b.faulty.calls(op)
                }
            };
            let base = side(&lender, &borrower);
            run(step, &lender, &borrower, loan.as_ref()).unwrap();
            let calls = side(&lender, &borrower) - base;
            assert!(calls >= 1, "{step:?}: no call of {op}");
            for k in 1..=calls {
                let (lf, bf) = faults(Fault {
                    op,
                    nth: base + k,
                    kind: FaultKind::Driver,
                });
                let (lender, borrower, loan) = up_to(step, lf, bf);
                let before = (lender.snapshot(), borrower.snapshot());
                let err = run(step, &lender, &borrower, loan.as_ref()).unwrap_err();
                assert!(
                    matches!(&err, Error::Driver { op: failed, code, .. } if *failed == op && code == "INJECTED_FAULT"),
                    "{step:?} {op} call {k}: {err:?}"
                );
                let after = (lender.snapshot(), borrower.snapshot());
                assert_eq!(before, after, "{step:?} {op} call {k} changed a side");
                lender.tensor.check_invariants().unwrap();
                borrower.tensor.check_invariants().unwrap();
                assert!(lender.tensor.take_deferred_errors().is_empty());
                assert!(borrower.tensor.take_deferred_errors().is_empty());
                // Only that call failed: the same step now succeeds.
                run(step, &lender, &borrower, loan.as_ref()).unwrap();
                injected += 1;
            }
        }
    }
    assert!(injected >= 20, "only {injected} faults injected");
}

#[test]
fn a_failed_export_ahead_changes_nothing_but_the_exports_made_and_a_lend_reuses_them() {
    let side = Side::new(
        Fault {
            op: Op::Export,
            nth: 2,
            kind: FaultKind::Driver,
        },
        BEFORE,
    );
    fill(&side.tensor, 3);
    let handles = side.tensor.handle_runs().len();
    let before = (
        side.tensor.segment_bytes(),
        side.tensor.handle_runs(),
        common::read(&side.tensor, 0, BEFORE),
    );
    let err = side.tensor.export_ahead(handles).unwrap_err();
    assert!(
        matches!(&err, Error::Driver { op: Op::Export, code, .. } if code == "INJECTED_FAULT"),
        "{err:?}"
    );
    let after = (
        side.tensor.segment_bytes(),
        side.tensor.handle_runs(),
        common::read(&side.tensor, 0, BEFORE),
    );
    assert_eq!(before, after);
    // The first export stays made: the rest follow, then none is left.
    assert_eq!(side.tensor.export_ahead(handles).unwrap(), 0);
    assert_eq!(side.faulty.calls(Op::Export), handles as u64 + 1);
    let loan = lend(&side);
    assert_eq!(
        side.faulty.calls(Op::Export),
        handles as u64 + 1,
        "the lend exported again"
    );
    assert!(!loan.handles.is_empty());
    side.tensor.check_invariants().unwrap();
}

// --------------------------------------------------------------------------------------------
// Loans under attack (issue 51): a handle is never lent onward, a borrow maps only the lent
// handles whatever the lender does meanwhile, a reclaim commits only what is mapped, and loans
// and shares refuse each other.

/// Runs `action` once, just before the `nth` call of `op` goes to the inner driver.
struct Before {
    op: Op,
    nth: u64,
    calls: std::sync::atomic::AtomicU64,
    action: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl extensible_kv::driver::wrap::Hook for Before {
    const CHECK_ROOM_AS: Option<Op> = None;

    fn around<T>(
        &self,
        op: Op,
        _: u64,
        call: impl FnOnce() -> Result<T, Error>,
    ) -> Result<T, Error> {
        if op == self.op {
            let n = self
                .calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1;
            if n == self.nth {
                let action = self.action.lock().unwrap().take();
                action.expect("runs once")();
            }
        }
        call()
    }
}

#[test]
fn a_borrowed_handle_is_never_lent_onward() {
    let lender = Side::new(never(Op::Map), BEFORE);
    let middle = Side::new(never(Op::Map), BORROWER_START);
    let loan = lend(&lender);
    middle
        .tensor
        .borrow(&loan, None, false, Stream::DEFAULT)
        .unwrap();
    let before = middle.snapshot();
    // Keeping less than the borrowed handles' start: every borrowed handle would go onward.
    for kept in [BORROWER_START, BORROWER_START + 2 * G] {
        let err = middle
            .tensor
            .lend(kept, Stream::DEFAULT)
            .expect_err("a borrowed handle was lent onward");
        assert!(matches!(err, Error::LoanConflict(_)), "{err:?}");
        assert!(err.to_string().contains("borrowed"), "{err}");
        assert!(
            err.to_string().contains(&format!("loan {}", loan.loan_id)),
            "{err}"
        );
        assert_eq!(
            middle.snapshot(),
            before,
            "a refused lend changed the borrower"
        );
    }
    middle.tensor.check_invariants().unwrap();
    // What is its own still lends.
    middle.tensor.give_back(&loan, Stream::DEFAULT).unwrap();
    let own = middle.tensor.lend(0, Stream::DEFAULT).unwrap();
    middle
        .tensor
        .reclaim(&own, false, NOW, Stream::DEFAULT)
        .unwrap();
    lender
        .tensor
        .reclaim(&loan, false, NOW, Stream::DEFAULT)
        .unwrap();
}

#[test]
fn a_lender_closed_mid_borrow_never_hands_over_other_memory() {
    // The borrower zeroes each handle after mapping it (slow: ~0.7 s a GiB on the host). The
    // lender closes its tensor during the first zeroing, and its next tensor's files take the
    // numbers of the fds it lent: the borrow must not take them for the loan's handles.
    for op in [Op::Import, Op::Memset] {
        let lender = Arc::new(Side::new(never(Op::Map), BEFORE));
        fill(&lender.tensor, 10);
        let loan = lend(&lender);
        let other: Arc<std::sync::Mutex<Option<Side>>> = Arc::default();
        let host = Arc::new(HostDriver::new(G).unwrap());
        let hook = Before {
            op,
            nth: 1,
            calls: Default::default(),
            action: std::sync::Mutex::new(Some(Box::new({
                let (lender, other) = (Arc::clone(&lender), Arc::clone(&other));
                move || {
                    lender.tensor.close().unwrap();
                    // Same-sized handles, each exported: their fds take the freed numbers.
                    let next = Side::new(never(Op::Map), CAPACITY);
                    assert!(next.tensor.export_ahead(usize::MAX).unwrap() == 0);
                    fill(&next.tensor, 77);
                    *other.lock().unwrap() = Some(next);
                }
            }))),
        };
        let driver = Arc::new(extensible_kv::driver::wrap::Wrap::with_hook(
            host.clone(),
            hook,
        ));
        let borrower =
            ExtensibleTensor::with_equal_segments(driver, 2 * CAPACITY, 2, options()).unwrap();
        borrower
            .resize_per_segment(BORROWER_START, GrowOptions::zeroed())
            .unwrap();
        let before = (
            borrower.segment_bytes(),
            borrower.handle_runs(),
            host.live_counts(),
        );
        let result = borrower.borrow(&loan, None, true, Stream::DEFAULT);
        let other = other.lock().unwrap().take().expect("the lender closed");
        let untouched = (0..2u64).all(|s| {
            common::read(&other.tensor, s * CAPACITY, CAPACITY) == pattern(CAPACITY, 77 + s as u8)
        });
        assert!(untouched, "{op}: the borrow zeroed another tensor's memory");
        let err = result.expect_err("a borrow mapped what the lender no longer lends");
        assert!(
            err.to_string().contains("stale or foreign loan"),
            "{op}: {err}"
        );
        let after = (
            borrower.segment_bytes(),
            borrower.handle_runs(),
            host.live_counts(),
        );
        assert_eq!(before, after, "{op}: a refused borrow changed the borrower");
        borrower.check_invariants().unwrap();
        other.tensor.check_invariants().unwrap();
    }
}

/// What a lender does between its lend and its reclaim that leaves the straddling handle's
/// tail unmapped.
#[derive(Clone, Copy, Debug)]
enum Between {
    ExactShrink,
    Consolidate,
    ShrinkToZeroAndGrowBack,
}

#[test]
fn a_reclaim_grows_back_only_over_mapped_granules() {
    // Handles of 2 granules; keeping 3 leaves the handle over granules 2-3 straddling.
    let kept = 3 * G;
    for between in [
        Between::ExactShrink,
        Between::Consolidate,
        Between::ShrinkToZeroAndGrowBack,
    ] {
        let lender = Side::new(never(Op::Map), BEFORE);
        fill(&lender.tensor, 20);
        let loan = lender.tensor.lend(kept, Stream::DEFAULT).unwrap();
        let t = &lender.tensor;
        match between {
            Between::ExactShrink => {
                let exact = ShrinkOptions {
                    exact: true,
                    ..ShrinkOptions::default()
                };
                t.shrink_per_segment(kept, exact).unwrap();
            }
            Between::Consolidate => t.consolidate(Stream::DEFAULT).unwrap(),
            Between::ShrinkToZeroAndGrowBack => {
                t.shrink_per_segment(0, ShrinkOptions::default()).unwrap();
                t.wait_released(None); // else the grow may take the same handles back
                t.resize_per_segment(kept, GrowOptions::zeroed()).unwrap();
            }
        }
        assert_eq!(t.segment_bytes(), vec![kept, kept], "{between:?}");
        t.check_invariants().unwrap();
        // std::panic::catch_unwind: the core's own debug check may fire inside the reclaim.
        let reclaimed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            t.reclaim(&loan, false, NOW, Stream::DEFAULT)
        }));
        let reclaimed = reclaimed.unwrap_or_else(|_| panic!("{between:?}: the reclaim panicked"));
        reclaimed.unwrap();
        t.check_invariants()
            .unwrap_or_else(|e| panic!("{between:?}: {e}"));
        assert_eq!(t.lent_bytes(), 0);
        // The handles came back as slack: a grow maps only the missing tail, and every byte of
        // the size before the lend is there to write and read.
        t.resize_per_segment(BEFORE, GrowOptions::zeroed()).unwrap();
        t.check_invariants().unwrap();
        for s in 0..2u64 {
            common::write(t, s * CAPACITY, &pattern(BEFORE, 40 + s as u8));
            let got = common::read(t, s * CAPACITY, BEFORE);
            assert_eq!(
                got,
                pattern(BEFORE, 40 + s as u8),
                "{between:?} segment {s}"
            );
        }
        // Nothing left over: lending the same top again works.
        let again = t.lend(kept, Stream::DEFAULT).unwrap();
        t.reclaim(&again, false, NOW, Stream::DEFAULT).unwrap();
        assert_eq!(t.segment_bytes(), vec![BEFORE, BEFORE], "{between:?}");
        t.check_invariants().unwrap();
    }
}

#[test]
fn loans_and_shares_refuse_each_other() {
    // A borrower's memory is not its own to describe: importers would keep the lender's.
    let lender = Side::new(never(Op::Map), BEFORE);
    let borrower = Side::new(never(Op::Map), BORROWER_START);
    let loan = lend(&lender);
    borrower
        .tensor
        .borrow(&loan, None, false, Stream::DEFAULT)
        .unwrap();
    // The borrower's own files only: tests on other threads open and close theirs meanwhile.
    let own = format!("{:032x}", borrower.tensor.tensor_id());
    let fds = common::proc_memfds(&own);
    let err = borrower
        .tensor
        .share()
        .expect_err("a borrower described borrowed memory");
    assert!(matches!(err, Error::LoanConflict(_)), "{err:?}");
    assert!(err.to_string().contains("borrowed"), "{err}");
    assert_eq!(
        common::proc_memfds(&own),
        fds,
        "a refused share kept a file"
    );
    borrower.tensor.give_back(&loan, Stream::DEFAULT).unwrap();
    borrower.tensor.share().unwrap(); // its own memory, once the loan is back
    lender
        .tensor
        .reclaim(&loan, false, NOW, Stream::DEFAULT)
        .unwrap();

    // A handle share() described is not the lender's alone: its importers would read and write
    // what the borrower does.
    let shared = Side::new(never(Op::Map), 4 * G);
    shared.tensor.share().unwrap();
    let before = shared.snapshot();
    let err = shared
        .tensor
        .lend(2 * G, Stream::DEFAULT)
        .expect_err("a shared handle was lent");
    assert!(matches!(err, Error::LoanConflict(_)), "{err:?}");
    assert!(err.to_string().contains("share"), "{err}");
    assert_eq!(
        shared.snapshot(),
        before,
        "a refused lend changed the lender"
    );
    // Handles grown after the last share() were never described: they lend.
    shared
        .tensor
        .resize_per_segment(BEFORE, GrowOptions::zeroed())
        .unwrap();
    let fresh = shared.tensor.lend(4 * G, Stream::DEFAULT).unwrap();
    assert_eq!(fresh.num_bytes(), 2 * 2 * G);
    shared
        .tensor
        .reclaim(&fresh, false, NOW, Stream::DEFAULT)
        .unwrap();
}

#[test]
fn a_reclaim_told_to_stop_changes_nothing_unless_the_loan_is_back() {
    let lender = Side::new(never(Op::Map), BEFORE);
    let borrower = Side::new(never(Op::Map), BORROWER_START);
    let loan = lend(&lender);
    borrower
        .tensor
        .borrow(&loan, None, false, Stream::DEFAULT)
        .unwrap();
    let before = lender.snapshot();
    let mut asked = 0;
    let err = lender
        .tensor
        .reclaim_or_stop(&loan, false, None, Stream::DEFAULT, &mut || {
            asked += 1;
            true
        })
        .unwrap_err();
    assert!(matches!(err, Error::Interrupted(_)), "{err:?}");
    assert!(err.to_string().contains("nothing was changed"), "{err}");
    assert_eq!(asked, 1);
    assert_eq!(
        lender.snapshot(),
        before,
        "an interrupted reclaim changed the lender"
    );
    // Told to stop once the loan is back (the signal handler gave it back, say): the reclaim
    // completes all the same.
    lender
        .tensor
        .reclaim_or_stop(&loan, false, None, Stream::DEFAULT, &mut || {
            borrower.tensor.give_back(&loan, Stream::DEFAULT).unwrap();
            true
        })
        .unwrap();
    assert_eq!(lender.tensor.segment_bytes(), vec![BEFORE, BEFORE]);
    lender.tensor.check_invariants().unwrap();
}

#[test]
fn a_second_reclaim_of_a_loan_is_refused_while_the_first_waits() {
    // Else the second could take the first one's closing of the board for a completed
    // reclaim, and the first offer the loan again while the second maps its handles back.
    let lender = Side::new(never(Op::Map), BEFORE);
    let borrower = Side::new(never(Op::Map), BORROWER_START);
    let loan = lend(&lender);
    borrower
        .tensor
        .borrow(&loan, None, false, Stream::DEFAULT)
        .unwrap();
    let (asked, go) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
    std::thread::scope(|scope| {
        let first = scope.spawn(|| {
            let (asked, go) = (asked.0, go.1);
            lender
                .tensor
                .reclaim_or_stop(&loan, false, None, Stream::DEFAULT, &mut || {
                    // Inside the wait: let the test try its second reclaim, then go on.
                    let _ = asked.send(());
                    let _ = go.recv();
                    false
                })
        });
        asked.1.recv().unwrap();
        let before = lender.snapshot();
        let second = lender
            .tensor
            .reclaim(&loan, false, Some(Duration::ZERO), Stream::DEFAULT);
        let after = lender.snapshot();
        borrower.tensor.give_back(&loan, Stream::DEFAULT).unwrap();
        drop(go.0); // the first goes on, whatever the second did
        first.join().unwrap().unwrap();
        let err = second.expect_err("a second reclaim went ahead while the first waited");
        assert!(err.to_string().contains("being reclaimed already"), "{err}");
        assert_eq!(after, before);
    });
    assert_eq!(lender.tensor.segment_bytes(), vec![BEFORE, BEFORE]);
    // Refused or failed, a reclaim lets the next one in: a timed-out one here.
    let again = lend(&lender);
    let other = Side::new(never(Op::Map), BORROWER_START);
    other
        .tensor
        .borrow(&again, None, false, Stream::DEFAULT)
        .unwrap();
    for _ in 0..2 {
        let err = lender
            .tensor
            .reclaim(&again, false, Some(Duration::ZERO), Stream::DEFAULT)
            .unwrap_err();
        assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    }
    other.tensor.give_back(&again, Stream::DEFAULT).unwrap();
    lender
        .tensor
        .reclaim(&again, false, NOW, Stream::DEFAULT)
        .unwrap();
}

#[test]
fn a_borrower_never_re_backs_a_borrowed_handle() {
    // A consolidation or an exact shrink replaces handles by copies of their bytes; a
    // borrowed one so replaced went back to its lender as a copy the borrower now owns, and
    // `give_back` then found nothing of the loan to give back.
    for exact_shrink in [false, true] {
        let lender = Side::new(never(Op::Map), BEFORE);
        let borrower = Side::new(never(Op::Map), BORROWER_START);
        fill(&lender.tensor, 10);
        let loan = lend(&lender);
        let t = &borrower.tensor;
        t.borrow(&loan, None, false, Stream::DEFAULT).unwrap();
        if exact_shrink {
            // Into the middle of the first borrowed handle of each segment: it stays whole.
            let exact = ShrinkOptions {
                exact: true,
                ..ShrinkOptions::default()
            };
            t.shrink_per_segment(BORROWER_START + G, exact).unwrap();
            assert_eq!(
                t.borrowed_bytes(),
                2 * 2 * G,
                "the borrowed handle was copied"
            );
        } else {
            let borrowed = t.borrowed_bytes();
            t.consolidate(Stream::DEFAULT).unwrap();
            assert_eq!(t.borrowed_bytes(), borrowed, "a borrowed handle was copied");
        }
        t.check_invariants().unwrap();
        let kept = common::read(t, 0, BORROWER_START + G);
        assert_eq!(
            &kept[BORROWER_START as usize..],
            &pattern(BEFORE, 10)[KEPT as usize..(KEPT + G) as usize]
        );
        t.give_back(&loan, Stream::DEFAULT).unwrap();
        assert_eq!(t.borrowed_bytes(), 0);
        lender
            .tensor
            .reclaim(&loan, false, NOW, Stream::DEFAULT)
            .unwrap();
        assert_eq!(lender.tensor.segment_bytes(), vec![BEFORE, BEFORE]);
    }
}

// --------------------------------------------------------------------------------------------
// Loans of another geometry (issue 52): the caller deals a loan's handles over the borrower's
// segments (`extensible_kv.shape.deal`); the core maps them where placed, after checking the
// placement, and each handle is claimed once on the lender's board, whichever tensor of the
// borrowing process maps it.

fn at(handle: usize, segment: usize) -> PlacedHandle {
    PlacedHandle {
        loan: 0,
        handle,
        segment,
    }
}

/// A borrower on its own faulty driver: segments of `capacities`, grown to `grow`.
fn borrower(fault: Fault, capacities: Vec<u64>, grow: &[u64]) -> Side {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let faulty = Arc::new(FaultyDriver::new(host.clone(), fault));
    let tensor =
        ExtensibleTensor::with_segment_capacities(faulty.clone(), capacities, options()).unwrap();
    tensor
        .resize_per_segment(grow, GrowOptions::zeroed())
        .unwrap();
    Side {
        host,
        faulty,
        tensor,
    }
}

/// The lender's bytes of loan handle `index` (its run, before the lend).
fn lent_bytes(loan: &LoanDescription, index: usize, seed: u8) -> Vec<u8> {
    let run = loan.handles[index].run;
    let (start, end) = (run.first_granule * G, run.end_granule() * G);
    let segment = start / CAPACITY;
    let within = (start - segment * CAPACITY, end - segment * CAPACITY);
    pattern(BEFORE, seed + segment as u8)[within.0 as usize..within.1 as usize].to_vec()
}

#[test]
fn a_loan_of_another_geometry_maps_where_it_was_placed_slack_counted() {
    // The lender: 2 segments, 4 handles of 2 granules lent. The borrower: one segment of
    // another block size, 100 bytes committed (a granule mapped: 3,996 bytes of slack).
    for zero in [false, true] {
        let lender = Side::new(never(Op::Map), BEFORE);
        fill(&lender.tensor, 10);
        let loan = lend(&lender);
        let flat = borrower(never(Op::Map), vec![16 * G], &[100]);
        common::write(&flat.tensor, 0, &[7; 100]);
        let room = flat.tensor.borrow_room().unwrap();
        assert_eq!(
            room,
            vec![BorrowRoom {
                start_granule: 1,
                slack_bytes: (G - 100) as i64,
                room_granules: 15,
                limit_bytes: 16 * G - 100,
            }]
        );
        // Handles 3, 0 and 2 (in that order: the caller's dealing), handle 1 left out.
        let placed = [at(3, 0), at(0, 0), at(2, 0)];
        let size = 100 + 6 * G + 1000; // into the last handle placed
        flat.tensor
            .borrow_placed(
                std::slice::from_ref(&loan),
                vec![None],
                &placed,
                &[size],
                zero,
                Stream::DEFAULT,
            )
            .unwrap();
        flat.tensor.check_invariants().unwrap();
        assert_eq!(flat.tensor.segment_bytes(), vec![size]);
        assert_eq!(flat.tensor.borrowed_bytes(), 6 * G);
        let got = common::read(&flat.tensor, 0, size);
        assert_eq!(&got[..100], &[7; 100], "its own bytes are kept");
        if zero {
            assert!(
                got[100..].iter().all(|&b| b == 0),
                "slack and handles zeroed"
            );
        } else {
            let lent = [3, 0, 2].map(|i| lent_bytes(&loan, i, 10)).concat();
            assert_eq!(&got[G as usize..], &lent[..(size - G) as usize]);
        }
        // Handle 1 was never claimed: the lender waits for it until it is given back at
        // once, without being mapped.
        flat.tensor.give_back(&loan, Stream::DEFAULT).unwrap();
        assert_eq!(
            flat.tensor.segment_bytes(),
            vec![G],
            "cut where the loan began"
        );
        let err = lender
            .tensor
            .reclaim(&loan, false, NOW, Stream::DEFAULT)
            .unwrap_err();
        assert!(err.to_string().contains("3 of 4 handles"), "{err}");
        assert_eq!(loan.decline(None, &[0, 1, 2, 3]).unwrap(), 1);
        lender
            .tensor
            .reclaim(&loan, false, NOW, Stream::DEFAULT)
            .unwrap();
        assert_eq!(lender.tensor.segment_bytes(), vec![BEFORE, BEFORE]);
        lender.tensor.check_invariants().unwrap();
    }
}

#[test]
fn a_loan_split_between_tensors_of_one_process_claims_each_handle_once() {
    let lender = Side::new(never(Op::Map), BEFORE);
    fill(&lender.tensor, 10);
    let loan = lend(&lender);
    let loans = std::slice::from_ref(&loan);
    // Two buffers of a cache: a K/V split of 2 segments, and a flat one.
    let kv = borrower(never(Op::Map), vec![8 * G, 8 * G], &[G, G]);
    let flat = borrower(never(Op::Map), vec![16 * G], &[0]);
    kv.tensor
        .borrow_placed(
            loans,
            vec![None],
            &[at(0, 0), at(1, 1)],
            &[3 * G, 3 * G],
            false,
            Stream::DEFAULT,
        )
        .unwrap();
    // A handle is claimed once, even by another tensor of this process.
    let before = flat.snapshot();
    let err = flat
        .tensor
        .borrow_placed(
            loans,
            vec![None],
            &[at(2, 0), at(1, 0)],
            &[4 * G],
            false,
            Stream::DEFAULT,
        )
        .unwrap_err();
    assert!(err.to_string().contains("at most once"), "{err}");
    assert_eq!(
        flat.snapshot(),
        before,
        "a refused claim changed the borrower"
    );
    flat.tensor
        .borrow_placed(
            loans,
            vec![None],
            &[at(2, 0), at(3, 0)],
            &[4 * G],
            false,
            Stream::DEFAULT,
        )
        .unwrap();
    let got = common::read(&flat.tensor, 0, 4 * G);
    assert_eq!(got, [2, 3].map(|i| lent_bytes(&loan, i, 10)).concat());
    // The old whole-loan borrow is refused too: its handles are taken.
    let other = Side::new(never(Op::Map), BORROWER_START);
    let err = other
        .tensor
        .borrow(&loan, None, false, Stream::DEFAULT)
        .unwrap_err();
    assert!(err.to_string().contains("at most once"), "{err}");
    // Each tensor gives back what it holds; the lender waits for both.
    assert_eq!(
        kv.tensor.give_back_loans(loans, Stream::DEFAULT).unwrap(),
        4 * G
    );
    assert_eq!(kv.tensor.segment_bytes(), vec![G, G]);
    assert_eq!(
        kv.tensor.give_back_loans(loans, Stream::DEFAULT).unwrap(),
        0
    );
    let err = lender
        .tensor
        .reclaim(&loan, false, NOW, Stream::DEFAULT)
        .unwrap_err();
    assert!(err.to_string().contains("2 of 4 handles"), "{err}");
    flat.tensor.give_back(&loan, Stream::DEFAULT).unwrap();
    lender
        .tensor
        .reclaim(&loan, false, NOW, Stream::DEFAULT)
        .unwrap();
    let got = common::read(&lender.tensor, 0, BEFORE);
    assert_eq!(got, pattern(BEFORE, 10));
    for side in [&kv, &flat] {
        side.tensor.check_invariants().unwrap();
        assert_eq!(side.tensor.borrowed_bytes(), 0);
    }
}

#[test]
fn segments_that_share_a_granule_never_place_into_it_twice() {
    // Two segments of 3.5 granules: granule 3 holds the end of the first and the start of
    // the second, and is the second's to place into (it starts there).
    let lender = Side::new(never(Op::Map), BEFORE);
    let loan = lend(&lender);
    let shared = borrower(never(Op::Map), vec![7 * G / 2, 7 * G / 2], &[0, 0]);
    let room = shared.tensor.borrow_room().unwrap();
    assert_eq!(
        (
            room[0].start_granule,
            room[0].room_granules,
            room[0].slack_bytes
        ),
        (0, 3, 0)
    );
    assert_eq!(
        (
            room[1].start_granule,
            room[1].room_granules,
            room[1].slack_bytes
        ),
        (3, 4, -(G as i64) / 2),
        "its first granule holds half a granule of the first segment"
    );
    let loans = std::slice::from_ref(&loan);
    let err = shared
        .tensor
        .borrow_placed(
            loans,
            vec![None],
            &[at(0, 0), at(1, 0)],
            &[7 * G / 2, 0],
            false,
            Stream::DEFAULT,
        )
        .unwrap_err();
    assert!(err.to_string().contains("room for 3 granules"), "{err}");
    shared
        .tensor
        .borrow_placed(
            loans,
            vec![None],
            &[at(0, 0), at(1, 1), at(2, 1)],
            &[2 * G, 7 * G / 2],
            false,
            Stream::DEFAULT,
        )
        .unwrap();
    shared.tensor.check_invariants().unwrap();
    // The first segment may grow into the shared granule now: the second's handle maps it.
    shared
        .tensor
        .resize_per_segment(&[7 * G / 2, 7 * G / 2][..], GrowOptions::zeroed())
        .unwrap();
    shared.tensor.check_invariants().unwrap();
    // Giving back cuts every segment whose committed bytes reach a handle of the loan.
    shared.tensor.give_back(&loan, Stream::DEFAULT).unwrap();
    assert_eq!(shared.tensor.segment_bytes(), vec![0, 0]);
    assert_eq!(shared.tensor.borrowed_bytes(), 0);
    shared.tensor.check_invariants().unwrap();
    assert_eq!(loan.decline(None, &[3]).unwrap(), 1);
    lender
        .tensor
        .reclaim(&loan, false, NOW, Stream::DEFAULT)
        .unwrap();
}

#[test]
fn a_placement_is_checked_before_anything_is_mapped() {
    let lender = Side::new(never(Op::Map), BEFORE);
    let loan = lend(&lender);
    let loans = std::slice::from_ref(&loan);
    let t = borrower(never(Op::Map), vec![4 * G, 4 * G], &[G, G]);
    // Slack of a shrink: the room starts past it, and the segment grows into it for free.
    t.tensor
        .resize_per_segment(&[2 * G, G][..], GrowOptions::zeroed())
        .unwrap();
    t.tensor
        .shrink_per_segment(&[G + 10, G][..], ShrinkOptions::default())
        .unwrap();
    let room = t.tensor.borrow_room().unwrap();
    assert_eq!(
        (
            room[0].start_granule,
            room[0].slack_bytes,
            room[0].room_granules
        ),
        (2, (G - 10) as i64, 2)
    );
    let before = t.snapshot();
    let cases: Vec<(Vec<PlacedHandle>, Vec<u64>, &str)> = vec![
        (
            vec![at(0, 0), at(1, 0)],
            vec![4 * G, G],
            "room for 2 granules",
        ),
        (vec![at(0, 0), at(0, 1)], vec![4 * G, 3 * G], "placed twice"),
        (vec![at(9, 0)], vec![G + 10, G], "handle 9 of 4"),
        (vec![at(0, 2)], vec![G + 10, G], "segment 2 of 2"),
        (
            vec![PlacedHandle {
                loan: 1,
                handle: 0,
                segment: 0,
            }],
            vec![G + 10, G],
            "loan 1 of 1",
        ),
        (vec![at(0, 0)], vec![4 * G + 1, G], "exceeds the capacity"),
        (
            vec![at(0, 0)],
            vec![4 * G, 2 * G],
            "neither this tensor nor",
        ),
        (vec![at(0, 0)], vec![4 * G, G - 1], "never shrinks"),
        (vec![at(0, 0)], vec![4 * G], "per-segment sizes"),
    ];
    for (placed, sizes, why) in cases {
        let err = t
            .tensor
            .borrow_placed(loans, vec![None], &placed, &sizes, false, Stream::DEFAULT)
            .unwrap_err();
        assert!(err.to_string().contains(why), "{why}: {err}");
        assert_eq!(t.snapshot(), before, "{why}");
    }
    // Twice the same loan, another device's granularity, one's own loan.
    let twice = [loan.clone(), loan.clone()];
    let err = t
        .tensor
        .borrow_placed(&twice, vec![], &[], &[G, G], false, Stream::DEFAULT)
        .unwrap_err();
    assert!(err.to_string().contains("listed twice"), "{err}");
    let own = lender
        .tensor
        .borrow_placed(loans, vec![], &[], &[KEPT, KEPT], false, Stream::DEFAULT)
        .unwrap_err();
    assert!(own.to_string().contains("own loan"), "{own}");
    // Granules it lent itself are not room.
    let lent_too = borrower(never(Op::Map), vec![4 * G, 4 * G], &[3 * G, 3 * G]);
    let own_loan = lent_too.tensor.lend(G, Stream::DEFAULT).unwrap();
    assert!(lent_too
        .tensor
        .borrow_room()
        .unwrap()
        .iter()
        .all(|r| r.room_granules == 0));
    lent_too
        .tensor
        .reclaim(&own_loan, false, NOW, Stream::DEFAULT)
        .unwrap();
    // What fits: the slack first, then the handle, zeroed past the old end.
    t.tensor
        .borrow_placed(
            loans,
            vec![None],
            &[at(0, 0)],
            &[4 * G, G],
            true,
            Stream::DEFAULT,
        )
        .unwrap();
    t.tensor.check_invariants().unwrap();
    let got = common::read(&t.tensor, G + 10, 3 * G - 10);
    assert!(
        got.iter().all(|&b| b == 0),
        "the slack newly committed is zeroed"
    );
    assert_eq!(loan.decline(None, &[1, 2, 3]).unwrap(), 3);
    t.tensor.give_back(&loan, Stream::DEFAULT).unwrap();
    assert_eq!(t.tensor.segment_bytes(), vec![2 * G, G]);
    lender
        .tensor
        .reclaim(&loan, false, NOW, Stream::DEFAULT)
        .unwrap();
}

#[test]
fn every_failed_call_of_a_placed_borrow_leaves_both_sides_as_they_were() {
    // A borrower of another geometry (3 segments, one with slack, the loan dealt unevenly),
    // each driver call of the borrow and of the give-back failed in turn.
    let placed = [at(0, 0), at(1, 1), at(2, 1), at(3, 2)];
    let sizes = [100 + 2 * G, G + 4 * G, 2 * G];
    let setup = |fault: Fault| {
        let lender = Side::new(never(Op::Map), BEFORE);
        fill(&lender.tensor, 10);
        let loan = lend(&lender);
        let side = borrower(fault, vec![5 * G, 5 * G, 5 * G], &[100, G, 0]);
        common::write(&side.tensor, 0, &[9; 100]);
        (lender, side, loan)
    };
    let borrow = |side: &Side, loan: &LoanDescription| {
        side.tensor.borrow_placed(
            std::slice::from_ref(loan),
            vec![None],
            &placed,
            &sizes,
            true,
            Stream::DEFAULT,
        )
    };
    let give_back = |side: &Side, loan: &LoanDescription| {
        side.tensor
            .give_back_loans(std::slice::from_ref(loan), Stream::DEFAULT)
            .map(drop)
    };
    let snapshot = |side: &Side| {
        let t = &side.tensor;
        let bytes: Vec<Vec<u8>> = (0..3)
            .map(|s| common::read(t, s * 5 * G, t.segment_bytes()[s as usize]))
            .collect();
        (
            t.segment_bytes(),
            t.handle_runs(),
            t.borrowed_bytes(),
            side.host.live_counts(),
            bytes,
        )
    };
    let mut injected = 0;
    for (giving_back, ops) in [
        (
            false,
            [Op::Import, Op::Map, Op::SetAccess, Op::Memset].as_slice(),
        ),
        (true, &[Op::Synchronize, Op::Unmap]),
    ] {
        for &op in ops {
            let (lender, side, loan) = setup(never(op));
            if giving_back {
                borrow(&side, &loan).unwrap();
            }
            let base = side.faulty.calls(op);
            match giving_back {
                true => give_back(&side, &loan).unwrap(),
                false => borrow(&side, &loan).unwrap(),
            }
            let calls = side.faulty.calls(op) - base;
            assert!(calls >= 1, "{op}: no call");
            drop((lender, side, loan));
            for k in 1..=calls {
                let (lender, side, loan) = setup(Fault {
                    op,
                    nth: base + k,
                    kind: FaultKind::Driver,
                });
                if giving_back {
                    borrow(&side, &loan).unwrap();
                }
                let before = (lender.snapshot(), snapshot(&side));
                let err = match giving_back {
                    true => give_back(&side, &loan),
                    false => borrow(&side, &loan),
                }
                .unwrap_err();
                assert!(
                    matches!(&err, Error::Driver { op: failed, code, .. } if *failed == op && code == "INJECTED_FAULT"),
                    "{op} call {k}: {err:?}"
                );
                assert_eq!(
                    (lender.snapshot(), snapshot(&side)),
                    before,
                    "{op} call {k} changed a side"
                );
                side.tensor.check_invariants().unwrap();
                assert!(side.tensor.take_deferred_errors().is_empty());
                // The loan is as before the call: offered again (the reclaim takes it back
                // at once), or still borrowed (the give-back goes through now).
                match giving_back {
                    true => give_back(&side, &loan).unwrap(),
                    false => borrow(&side, &loan).unwrap(),
                }
                side.tensor.check_invariants().unwrap();
                injected += 1;
            }
        }
    }
    assert!(injected >= 10, "only {injected} faults injected");
}
