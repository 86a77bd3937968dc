//! All or nothing: a grow that fails at any driver call leaves the tensor exactly as it was —
//! same committed bytes, same handles, same contents — and leaks no memfd or mapping.

#[path = "support/common.rs"]
mod common;

use std::sync::Arc;

use extensible_kv::driver::host::HostDriver;
use extensible_kv::driver::wrap::faulty::{Fault, FaultKind, FaultyDriver};
use extensible_kv::{Error, ExtensibleTensor, GrowOptions, HandleSizing, Op, Options, Stream};

const G: u64 = 4096;
/// 2 segments of 3.5 granules: they share granule 3, and the first grow leaves slack in
/// mapped granules, so the second grow both maps new handles and zeroes mapped bytes.
const SEGMENT: u64 = 7 * G / 2;
const FIRST: u64 = G / 2;

fn options() -> Options {
    // One-granule handles: the second grow needs several of every call.
    Options {
        handle_sizing: HandleSizing::CapAligned { max_bytes: Some(G) },
        ..Options::default()
    }
}

fn build(fault: Fault) -> (Arc<HostDriver>, Arc<FaultyDriver>, ExtensibleTensor) {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let faulty = Arc::new(FaultyDriver::new(host.clone(), fault));
    let tensor =
        ExtensibleTensor::with_equal_segments(faulty.clone(), 2 * SEGMENT, 2, options()).unwrap();
    tensor
        .resize_per_segment(FIRST, GrowOptions::zeroed())
        .unwrap();
    common::write(&tensor, 0, &[0xab; FIRST as usize]);
    common::write(&tensor, SEGMENT, &[0xcd; FIRST as usize]);
    (host, faulty, tensor)
}

/// A fault on no call of `op`: the driver only counts the calls.
fn never(op: Op) -> Fault {
    Fault {
        op,
        nth: u64::MAX,
        kind: FaultKind::Driver,
    }
}

/// How many calls of `op` the second grow makes.
fn calls_in_second_grow(op: Op) -> u64 {
    let (_, faulty, tensor) = build(never(op));
    let before = faulty.calls(op);
    tensor
        .resize_per_segment(SEGMENT, GrowOptions::zeroed())
        .unwrap();
    faulty.calls(op) - before
}

#[test]
fn every_failed_call_leaves_the_tensor_unchanged() {
    let mut injected = 0;
    for op in [Op::Create, Op::Map, Op::SetAccess, Op::Memset] {
        let calls = calls_in_second_grow(op);
        assert!(
            calls >= 2 || op == Op::SetAccess,
            "{op}: only {calls} calls to fail"
        );
        for k in 1..=calls {
            for kind in [FaultKind::Driver, FaultKind::OutOfMemory] {
                let probe = Fault {
                    op,
                    nth: u64::MAX,
                    kind,
                };
                let (_, counter, _) = build(probe);
                let nth = counter.calls(op) + k;
                let (host, _, tensor) = build(Fault { op, nth, kind });
                let name = host.memfd_name().to_string();
                let before = (
                    tensor.segment_bytes(),
                    tensor.physical_bytes(),
                    tensor.handle_runs(),
                    host.live_counts(),
                    common::proc_memfds(&name),
                );
                let err = tensor
                    .resize_per_segment(SEGMENT, GrowOptions::zeroed())
                    .unwrap_err();
                match (kind, &err) {
                    (
                        FaultKind::Driver,
                        Error::Driver {
                            op: failed, code, ..
                        },
                    ) => {
                        assert_eq!((*failed, code.as_str()), (op, "INJECTED_FAULT"))
                    }
                    (FaultKind::OutOfMemory, Error::OutOfMemory { op: failed, .. }) => {
                        assert_eq!(*failed, op)
                    }
                    _ => panic!("{op} call {k}: unexpected {err:?}"),
                }
                let after = (
                    tensor.segment_bytes(),
                    tensor.physical_bytes(),
                    tensor.handle_runs(),
                    host.live_counts(),
                    common::proc_memfds(&name),
                );
                assert_eq!(before, after, "{op} call {k} ({kind:?}) changed the tensor");
                assert!(tensor.take_deferred_errors().is_empty());
                tensor.check_invariants().unwrap();
                assert_eq!(common::read(&tensor, 0, FIRST), vec![0xab; FIRST as usize]);
                assert_eq!(
                    common::read(&tensor, SEGMENT, FIRST),
                    vec![0xcd; FIRST as usize]
                );
                // Only the nth call fails: the same grow now succeeds.
                tensor
                    .resize_per_segment(SEGMENT, GrowOptions::zeroed())
                    .unwrap();
                assert_eq!(
                    common::read(&tensor, FIRST, SEGMENT - FIRST),
                    vec![0; (SEGMENT - FIRST) as usize]
                );
                tensor.close().unwrap();
                assert_eq!(host.live_counts(), (0, 0, 0));
                assert_eq!(common::proc_memfds(&name), (0, 0));
                injected += 1;
            }
        }
    }
    assert!(injected >= 20, "only {injected} faults injected");
}

#[test]
fn a_failed_reserve_is_a_typed_error() {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let faulty = Arc::new(FaultyDriver::new(
        host.clone(),
        Fault {
            op: Op::Reserve,
            nth: 1,
            kind: FaultKind::Driver,
        },
    ));
    let result = ExtensibleTensor::with_equal_segments(faulty, 4 * G, 1, options());
    assert!(matches!(
        result,
        Err(Error::Driver {
            op: Op::Reserve,
            ..
        })
    ));
    assert_eq!(host.live_counts(), (0, 0, 0));
}

/// A failed unmap during release is reported, not swallowed, and never panics.
#[test]
fn destructor_errors_are_reported() {
    let fault = Fault {
        op: Op::Unmap,
        nth: 1,
        kind: FaultKind::Driver,
    };
    let (_, _, tensor) = build(fault);
    let err = tensor.release_physical(Stream::DEFAULT).unwrap_err();
    assert!(
        matches!(err, Error::Driver { op: Op::Unmap, .. }),
        "{err:?}"
    );
    assert_eq!(tensor.num_handles(), 0);
}

/// A grow that fails after queuing memsets fences before it unmaps what it mapped: on a
/// device the memsets may still be writing there (invariant 5).
#[test]
fn a_failed_grow_fences_before_unmapping() {
    {
        // Dirty fresh memory: every new handle gets a memset, as on CUDA.
        let host = Arc::new(HostDriver::new_dirty(G).unwrap());
        let fault = Fault {
            op: Op::SetAccess,
            nth: 4,
            kind: FaultKind::Driver,
        };
        let faulty = Arc::new(FaultyDriver::new(host.clone(), fault));
        let tensor =
            ExtensibleTensor::with_equal_segments(faulty.clone(), 2 * SEGMENT, 2, options())
                .unwrap();
        tensor
            .resize_per_segment(SEGMENT, GrowOptions::zeroed())
            .unwrap_err();
        let log = faulty.log();
        let last_memset = log.iter().rposition(|&op| op == Op::Memset).unwrap();
        let first_unmap = log.iter().position(|&op| op == Op::Unmap).unwrap();
        assert!(last_memset < first_unmap, "{log:?}");
        assert!(
            log[last_memset..first_unmap].contains(&Op::Synchronize),
            "unmapped without a fence after the memsets: {log:?}"
        );
        assert_eq!(host.live_counts(), (0, 0, 1));
    }
}

/// The shrink and consolidate operations the next test breaks at every call.
fn shrink_exact(tensor: &ExtensibleTensor) -> extensible_kv::Result<()> {
    let options = extensible_kv::ShrinkOptions {
        exact: true,
        ..Default::default()
    };
    tensor.shrink_per_segment([2 * G + G / 2, 3 * G], options)
}

fn shrink_plain(tensor: &ExtensibleTensor) -> extensible_kv::Result<()> {
    tensor.shrink_per_segment([G, G / 2], Default::default())
}

fn consolidate(tensor: &ExtensibleTensor) -> extensible_kv::Result<()> {
    tensor.consolidate(extensible_kv::Stream::DEFAULT)
}

type Operation = fn(&ExtensibleTensor) -> extensible_kv::Result<()>;
/// Closes `tensor` (whatever errors it kept) and drops it and its backend: no memfd of the
/// backend's may be left open or mapped. Whatever a failed clean-up left, the driver's own
/// teardown reclaims.
fn closes_without_a_leak(host: Arc<HostDriver>, tensor: ExtensibleTensor, what: &str) {
    let name_fd = host.memfd_name().to_string();
    let _ = tensor.close();
    let _ = tensor.take_deferred_errors();
    drop(tensor);
    drop(host);
    assert_eq!(common::proc_memfds(&name_fd), (0, 0), "{what}");
}

type Builder = fn(Fault) -> (Arc<HostDriver>, Arc<FaultyDriver>, ExtensibleTensor);

/// Every fault that `operation` on a tensor from `build` can meet at a call of `op`: each of
/// its calls (counted on a tensor built with no fault), failing as a driver error and as an
/// out-of-memory. `nth` counts the setup's calls too.
fn faults_in(op: Op, build: Builder, operation: Operation) -> Vec<Fault> {
    let (_, counter, tensor) = build(never(op));
    let setup = counter.calls(op);
    operation(&tensor).unwrap();
    let kinds = [FaultKind::Driver, FaultKind::OutOfMemory];
    (setup + 1..=counter.calls(op))
        .flat_map(|nth| kinds.map(|kind| Fault { op, nth, kind }))
        .collect()
}

/// Two segments of 3.5 granules grown in one-granule handles and filled with a pattern.
fn build_full(fault: Fault) -> (Arc<HostDriver>, Arc<FaultyDriver>, ExtensibleTensor) {
    let (host, faulty, tensor) = build(fault);
    tensor
        .resize_per_segment(SEGMENT, GrowOptions::zeroed())
        .unwrap();
    common::write(&tensor, 0, &pattern_of(0, 2 * SEGMENT));
    (host, faulty, tensor)
}

fn pattern_of(seed: u8, len: u64) -> Vec<u8> {
    (0..len).map(|i| seed ^ (i % 253) as u8 | 1).collect()
}

#[test]
fn every_failed_call_of_a_shrink_or_consolidate_leaves_the_tensor_unchanged() {
    let operations: [(&str, Operation); 3] = [
        ("exact shrink", shrink_exact),
        ("plain shrink", shrink_plain),
        ("consolidate", consolidate),
    ];
    let mut injected = 0;
    for (name, operation) in operations {
        for op in Op::ALL {
            for fault in faults_in(op, build_full, operation) {
                let (k, kind) = (fault.nth, fault.kind);
                let (host, _, tensor) = build_full(fault);
                let snapshot = |t: &ExtensibleTensor| {
                    (
                        t.segment_bytes(),
                        t.handle_runs(),
                        common::read(t, 0, 2 * SEGMENT),
                    )
                };
                let before = snapshot(&tensor);
                let result = operation(&tensor);
                if let Err(err) = &result {
                    assert_eq!(
                        snapshot(&tensor),
                        before,
                        "{name}: {op} call {k} ({kind:?}) changed the tensor: {err}"
                    );
                    assert!(tensor.take_deferred_errors().is_empty());
                    tensor.check_invariants().unwrap();
                    operation(&tensor).unwrap();
                    injected += 1;
                } else {
                    // A clean-up call after the swap (releasing an old handle, unmapping
                    // the scratch copy): the operation took effect, the error is kept.
                    assert!(
                        matches!(op, Op::Release | Op::Unmap | Op::FreeReservation),
                        "{name}: {op} call {k} did not fail the operation"
                    );
                    assert!(!tensor.take_deferred_errors().is_empty());
                }
                tensor.check_invariants().unwrap();
                let sizes = tensor.segment_bytes();
                for (s, &num_bytes) in sizes.iter().enumerate() {
                    let offset = s as u64 * SEGMENT;
                    let all = pattern_of(0, 2 * SEGMENT);
                    let want = &all[offset as usize..(offset + num_bytes) as usize];
                    assert_eq!(common::read(&tensor, offset, num_bytes), want);
                }
                closes_without_a_leak(host, tensor, &format!("{name}: {op} {k}"));
            }
        }
    }
    assert!(injected >= 30, "only {injected} faults injected");
}

/// Two segments of 4 granules that share none, each 3 granules grown one at a time and
/// filled with a pattern: a consolidation of two steps, the second staged ahead (its copy
/// queued before the first is swapped in: the host backend always has the room).
fn build_two_steps(fault: Fault) -> (Arc<HostDriver>, Arc<FaultyDriver>, ExtensibleTensor) {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let faulty = Arc::new(FaultyDriver::new(host.clone(), fault));
    let tensor =
        ExtensibleTensor::with_equal_segments(faulty.clone(), 8 * G, 2, options()).unwrap();
    for granules in 1..=3 {
        tensor
            .resize_per_segment(granules * G, GrowOptions::zeroed())
            .unwrap();
    }
    common::write(&tensor, 0, &pattern_of(1, 3 * G));
    common::write(&tensor, 4 * G, &pattern_of(2, 3 * G));
    (host, faulty, tensor)
}

fn two_steps_intact(tensor: &ExtensibleTensor) {
    tensor.check_invariants().unwrap();
    assert_eq!(tensor.segment_bytes(), vec![3 * G, 3 * G]);
    assert_eq!(common::read(tensor, 0, 3 * G), pattern_of(1, 3 * G));
    assert_eq!(common::read(tensor, 4 * G, 3 * G), pattern_of(2, 3 * G));
}

#[test]
fn a_consolidation_copies_the_next_step_while_it_swaps_this_one_in() {
    let (host, faulty, tensor) = build_two_steps(never(Op::Create));
    let skip = faulty.log().len();
    tensor.consolidate(extensible_kv::Stream::DEFAULT).unwrap();
    two_steps_intact(&tensor);
    assert_eq!(tensor.num_handles(), 2);
    // The old handles and the scratch reservations went before consolidate returned.
    assert_eq!(host.live_counts(), (2, 2, 1));
    let log = &faulty.log()[skip..];
    let at = |op: Op| -> Vec<usize> { (0..log.len()).filter(|&i| log[i] == op).collect() };
    let (copies, releases) = (at(Op::Copy), at(Op::Release));
    assert_eq!(copies.len(), 2, "{log:?}");
    assert!(
        copies[1] < releases[0],
        "the second copy was not queued before the first step's old handles went: {log:?}"
    );
    // The fence: each step's unmaps (its old mappings', then its scratch mapping's) come after
    // a synchronize that follows the step's copy. The next step's copy may be queued in
    // between: it reads and writes other memory.
    let unmap_stretches: Vec<usize> = (0..log.len())
        .filter(|&i| log[i] == Op::Unmap && (i == 0 || log[i - 1] != Op::Unmap))
        .collect();
    assert_eq!(unmap_stretches.len(), 4, "{log:?}");
    for (step, &copy) in copies.iter().enumerate() {
        let first_unmap = unmap_stretches[2 * step];
        assert!(
            log[copy..first_unmap].contains(&Op::Synchronize),
            "step {step} unmapped without a fence after its copy: {log:?}"
        );
    }
}

#[test]
fn every_failed_call_of_a_pipelined_consolidation_keeps_the_bytes_and_leaks_nothing() {
    let mut injected = 0;
    for op in Op::ALL {
        for fault in faults_in(op, build_two_steps, consolidate) {
            let (k, kind) = (fault.nth, fault.kind);
            let (host, _, tensor) = build_two_steps(fault);
            let before = tensor.handle_runs();
            let result = tensor.consolidate(extensible_kv::Stream::DEFAULT);
            // A step is all or nothing, whichever call failed: in the staging ahead (the
            // step is then staged again in its turn), in a step's own staging or swap, or
            // in a clean-up after the swap (kept for take_deferred_errors).
            two_steps_intact(&tensor);
            let after = tensor.handle_runs();
            match &result {
                Err(_) => {
                    injected += 1;
                    assert!(after.len() >= 4, "{op} {k} {kind:?}: {after:?}");
                    assert!(after
                        .iter()
                        .all(|r| before.contains(r) || r.num_granules == 3));
                }
                Ok(()) => assert_eq!(after.len(), 2, "{op} {k} {kind:?}"),
            }
            tensor.consolidate(extensible_kv::Stream::DEFAULT).unwrap();
            two_steps_intact(&tensor);
            assert_eq!(tensor.num_handles(), 2);
            closes_without_a_leak(host, tensor, &format!("{op} {k} {kind:?}"));
        }
    }
    assert!(injected >= 20, "only {injected} faults injected");
}
