//! The deferred release (`src/tensor/release.rs`) on the host backend, whose held events stand
//! in for a stream a decode loop keeps busy: memory given back by a shrink or
//! `release_physical` stays mapped, counted, and readable until the stream's event completes,
//! and goes back right after; a grow maps it again instead of waiting; teardown with releases
//! pending leaks nothing.

#[path = "support/common.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use extensible_kv::driver::host::HostDriver;
use extensible_kv::driver::wrap::faulty::{Fault, FaultKind, FaultyDriver};
use extensible_kv::driver::wrap::profile::ProfilingDriver;
use extensible_kv::{
    Driver, Error, ExtensibleTensor, GrowOptions, HandleSizing, Op, Options, ShrinkOptions, Stream,
};

const G: u64 = 4096;

fn options() -> Options {
    Options {
        handle_sizing: HandleSizing::CapAligned { max_bytes: Some(G) },
        ..Options::default()
    }
}

/// A one-segment tensor of 8 granules over `driver`, 6 committed, each granule's bytes its
/// index + 1.
fn tensor_on(driver: Arc<dyn Driver>) -> ExtensibleTensor {
    let tensor = ExtensibleTensor::with_equal_segments(driver, 8 * G, 1, options()).unwrap();
    tensor.resize(6 * G, GrowOptions::zeroed()).unwrap();
    for i in 0..6 {
        common::write(&tensor, i * G, &[i as u8 + 1; G as usize]);
    }
    tensor
}

fn short() -> Option<Duration> {
    Some(Duration::from_millis(50))
}

#[test]
fn a_shrink_waits_for_the_stream_not_the_caller() {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let tensor = tensor_on(host.clone());
    tensor.hold_events(true).unwrap();
    tensor.shrink(2 * G, ShrinkOptions::default()).unwrap();
    assert_eq!(tensor.segment_bytes(), [2 * G]);
    assert_eq!(tensor.pending_release_bytes(), 4 * G);
    assert_eq!(tensor.physical_bytes(), 6 * G, "counted until released");
    assert_eq!(tensor.num_handles(), 6);
    assert_eq!(
        host.live_counts().1,
        6,
        "still mapped while the stream is busy"
    );
    assert!(
        !tensor.wait_released(short()),
        "nothing goes before its event"
    );
    assert_eq!(host.live_counts().1, 6);
    tensor.check_invariants().unwrap();
    tensor.hold_events(false).unwrap();
    assert!(tensor.wait_released(Some(Duration::from_secs(5))));
    assert_eq!(tensor.pending_release_bytes(), 0);
    assert_eq!((tensor.physical_bytes(), tensor.num_handles()), (2 * G, 2));
    assert_eq!(host.live_counts(), (2, 2, 1));
    assert_eq!(common::read(&tensor, G, G), vec![2; G as usize], "kept");
    assert!(tensor.take_deferred_errors().is_empty());
}

#[test]
fn releases_go_in_order_each_after_its_own_event() {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let tensor = tensor_on(host.clone());
    tensor.shrink(5 * G, ShrinkOptions::default()).unwrap();
    assert_eq!(
        tensor.pending_release_bytes(),
        0,
        "an idle stream: released at once"
    );
    assert_eq!(host.live_counts().1, 5);
    tensor.hold_events(true).unwrap();
    tensor.shrink(3 * G, ShrinkOptions::default()).unwrap();
    tensor.release_physical(Stream::DEFAULT).unwrap();
    assert_eq!(tensor.segment_bytes(), [0]);
    assert_eq!(tensor.pending_release_bytes(), 5 * G);
    assert_eq!(host.live_counts().1, 5);
    host.synchronize().unwrap(); // completes both events, as a device synchronize would
    assert!(tensor.wait_released(Some(Duration::from_secs(5))));
    assert_eq!(host.live_counts(), (0, 0, 1));
    tensor.check_invariants().unwrap();
}

#[test]
fn a_grow_maps_pending_memory_again_and_zeroes_it() {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let timing = Arc::new(ProfilingDriver::new(host.clone()));
    let tensor = tensor_on(timing.clone());
    tensor.hold_events(true).unwrap();
    tensor.shrink(2 * G, ShrinkOptions::default()).unwrap();
    let creates = || {
        timing
            .report()
            .into_iter()
            .find(|c| c.0 == Op::Create)
            .unwrap()
            .1
    };
    let before = creates();
    tensor.resize(4 * G, GrowOptions::zeroed()).unwrap();
    assert_eq!(
        creates(),
        before,
        "granules 2 and 3 were still mapped: no new handle"
    );
    assert_eq!(
        tensor.pending_release_bytes(),
        2 * G,
        "granules 4 and 5 still go"
    );
    assert_eq!(common::read(&tensor, 2 * G, 2 * G), vec![0; 2 * G as usize]);
    assert_eq!(common::read(&tensor, G, G), vec![2; G as usize]);
    tensor.check_invariants().unwrap();
    tensor.hold_events(false).unwrap();
    assert!(tensor.wait_released(Some(Duration::from_secs(5))));
    assert_eq!(host.live_counts().1, 4);
    assert_eq!(tensor.physical_bytes(), 4 * G);
}

#[test]
fn a_failed_grow_leaves_what_it_took_back_pending() {
    let host = Arc::new(HostDriver::new(G).unwrap());
    // `tensor_on` creates 6 one-granule handles; the 7th create is the grow's first new one.
    let fault = Fault {
        op: Op::Create,
        nth: 7,
        kind: FaultKind::OutOfMemory,
    };
    let tensor = tensor_on(Arc::new(FaultyDriver::new(host.clone(), fault)));
    tensor.hold_events(true).unwrap();
    tensor.shrink(2 * G, ShrinkOptions::default()).unwrap();
    let before = host.live_counts();
    let err = tensor.resize(8 * G, GrowOptions::zeroed()).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    assert_eq!(tensor.segment_bytes(), [2 * G]);
    assert_eq!(
        tensor.pending_release_bytes(),
        4 * G,
        "taken back, then pending again"
    );
    assert_eq!(host.live_counts(), before);
    tensor.check_invariants().unwrap();
    tensor.hold_events(false).unwrap();
    assert!(tensor.wait_released(Some(Duration::from_secs(5))));
    assert_eq!(host.live_counts().1, 2);
}

#[test]
fn a_failed_event_record_changes_nothing() {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let fault = Fault {
        op: Op::RecordEvent,
        nth: 1,
        kind: FaultKind::Driver,
    };
    let faulty = Arc::new(FaultyDriver::new(host.clone(), fault));
    let tensor = tensor_on(faulty);
    let err = tensor.shrink(2 * G, ShrinkOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Driver {
                op: Op::RecordEvent,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(tensor.segment_bytes(), [6 * G]);
    assert_eq!(
        (tensor.physical_bytes(), tensor.pending_release_bytes()),
        (6 * G, 0)
    );
    assert_eq!(host.live_counts().1, 6);
    assert_eq!(common::read(&tensor, 5 * G, G), vec![6; G as usize]);
    tensor.check_invariants().unwrap();
}

#[test]
fn teardown_with_releases_pending_leaks_nothing() {
    for close in [true, false] {
        let host = Arc::new(HostDriver::new(G).unwrap());
        let tensor = tensor_on(host.clone());
        tensor.hold_events(true).unwrap();
        tensor.shrink(G, ShrinkOptions::default()).unwrap();
        assert_eq!(tensor.pending_release_bytes(), 5 * G);
        match close {
            true => tensor.close().unwrap(),
            false => drop(tensor),
        }
        assert_eq!(host.live_counts(), (0, 0, 0), "close: {close}");
        assert_eq!(common::proc_memfds(host.memfd_name()), (0, 0));
    }
}

#[test]
fn a_grow_on_another_thread_does_not_wait_for_a_busy_stream() {
    // The release thread waits on the event; the state lock is not held meanwhile, so a grow
    // (taking nothing back) and the getters go on.
    let host = Arc::new(HostDriver::new(G).unwrap());
    let tensor = ExtensibleTensor::with_equal_segments(host.clone(), 16 * G, 1, options());
    let tensor = tensor.unwrap();
    tensor.resize(8 * G, GrowOptions::zeroed()).unwrap();
    tensor.hold_events(true).unwrap();
    tensor.shrink(4 * G, ShrinkOptions::default()).unwrap();
    let grower = {
        let tensor = tensor.clone();
        std::thread::spawn(move || tensor.resize(6 * G, GrowOptions::zeroed()))
    };
    grower.join().unwrap().unwrap();
    assert_eq!(tensor.segment_bytes(), [6 * G]);
    assert_eq!(tensor.pending_release_bytes(), 2 * G);
    tensor.hold_events(false).unwrap();
    assert!(tensor.wait_released(Some(Duration::from_secs(5))));
    tensor.check_invariants().unwrap();
}

#[test]
fn a_mapping_the_driver_would_not_unmap_is_kept_not_leaked() {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let fault = Fault {
        op: Op::Unmap,
        nth: 1,
        kind: FaultKind::Driver,
    };
    let tensor = tensor_on(Arc::new(FaultyDriver::new(host.clone(), fault)));
    tensor.hold_events(true).unwrap();
    tensor.shrink(2 * G, ShrinkOptions::default()).unwrap();
    tensor.hold_events(false).unwrap();
    assert!(tensor.wait_released(Some(Duration::from_secs(5))));
    let errors = tensor.take_deferred_errors();
    assert!(
        matches!(errors[..], [Error::Driver { op: Op::Unmap, .. }]),
        "{errors:?}"
    );
    assert_eq!(
        tensor.pending_release_bytes(),
        G,
        "the one the driver kept mapped"
    );
    assert_eq!(host.live_counts().1, 3);
    tensor.check_invariants().unwrap();
    tensor.resize(6 * G, GrowOptions::zeroed()).unwrap();
    assert_eq!(tensor.pending_release_bytes(), 0, "the grow took it back");
    assert_eq!(common::read(&tensor, 2 * G, 4 * G), vec![0; 4 * G as usize]);
    tensor.check_invariants().unwrap();
    tensor.close().unwrap();
    assert_eq!(host.live_counts(), (0, 0, 0));
}

/// Polls `condition` every millisecond for up to 5 s: whether it came true.
fn eventually(condition: impl Fn() -> bool) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !condition() {
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

#[test]
fn a_paced_release_goes_one_handle_at_a_time_at_its_rate() {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let tensor = tensor_on(host.clone());
    assert_eq!(tensor.driver_rate(), None, "unpaced unless asked");
    let gap = Duration::from_millis(60);
    let rate = (G as f64 / gap.as_secs_f64()) as u64; // a handle per `gap`
    tensor.set_driver_rate(Some(rate)).unwrap();
    assert_eq!(tensor.driver_rate(), Some(rate));
    tensor.hold_events(true).unwrap();
    tensor.shrink(2 * G, ShrinkOptions::default()).unwrap();
    let start = std::time::Instant::now();
    tensor.hold_events(false).unwrap();
    let mut seen = vec![tensor.pending_release_bytes()];
    while !tensor.wait_released(Some(Duration::from_millis(1))) {
        let pending = tensor.pending_release_bytes();
        if seen.last() != Some(&pending) {
            seen.push(pending);
        }
    }
    let took = start.elapsed();
    seen.push(tensor.pending_release_bytes());
    seen.dedup();
    // The first may have gone before the first look: it goes as soon as its event completes.
    assert!(seen[0] >= 3 * G && seen.last() == Some(&0), "{seen:?}");
    assert!(
        seen.windows(2).all(|w| w[0] - w[1] == G),
        "one handle at a time: {seen:?}"
    );
    assert!(
        took >= 2 * gap,
        "4 handles at one per {gap:?} went in {took:?}"
    );
    assert_eq!(host.live_counts(), (2, 2, 1));
    assert_eq!(common::read(&tensor, G, G), vec![2; G as usize], "kept");
    assert!(tensor.take_deferred_errors().is_empty());
    tensor.check_invariants().unwrap();
}

/// `tensor_on` shrunk from 6 granules to 2 at a driver rate of a handle per 10 s, once the
/// first of the 4 handles has gone (at once: nothing was created or released before).
fn three_left_to_release_at_a_handle_per_10_s() -> (Arc<HostDriver>, ExtensibleTensor) {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let tensor = tensor_on(host.clone());
    tensor.set_driver_rate(Some(G / 10)).unwrap();
    tensor.hold_events(true).unwrap();
    tensor.shrink(2 * G, ShrinkOptions::default()).unwrap();
    tensor.hold_events(false).unwrap();
    assert!(
        eventually(|| tensor.pending_release_bytes() == 3 * G),
        "the first goes at once"
    );
    (host, tensor)
}

#[test]
fn a_grow_takes_back_the_handles_a_paced_release_has_not_reached() {
    let (_, tensor) = three_left_to_release_at_a_handle_per_10_s();
    // The thread went top down: granules 2-4 are still pending, and a grow over them maps
    // them again with no create (which would wait its turn at this rate).
    let start = std::time::Instant::now();
    tensor.resize(5 * G, GrowOptions::zeroed()).unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(tensor.pending_release_bytes(), 0, "the three not reached");
    assert_eq!(common::read(&tensor, 2 * G, 3 * G), vec![0; 3 * G as usize]);
    tensor.check_invariants().unwrap();
}

#[test]
fn lifting_the_pace_or_closing_does_not_wait_out_the_rate() {
    for lift in [true, false] {
        let (host, tensor) = three_left_to_release_at_a_handle_per_10_s();
        let start = std::time::Instant::now();
        match lift {
            true => {
                assert!(matches!(
                    tensor.set_driver_rate(Some(0)),
                    Err(Error::InvalidArgument(_))
                ));
                assert_eq!(
                    tensor.driver_rate(),
                    Some(G / 10),
                    "a refused rate changes nothing"
                );
                tensor.set_driver_rate(None).unwrap();
                assert!(tensor.wait_released(Some(Duration::from_secs(5))));
                assert_eq!(host.live_counts(), (2, 2, 1));
            }
            false => {
                tensor.close().unwrap();
                assert_eq!(host.live_counts(), (0, 0, 0), "teardown is never paced");
            }
        }
        let took = start.elapsed();
        assert!(took < Duration::from_secs(5), "lift {lift}: {took:?}");
    }
}

#[test]
fn a_paced_grow_creates_one_handle_at_a_time_at_the_rate() {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let tensor = ExtensibleTensor::with_equal_segments(host.clone(), 8 * G, 1, options()).unwrap();
    let gap = Duration::from_millis(60);
    tensor
        .set_driver_rate(Some((G as f64 / gap.as_secs_f64()) as u64))
        .unwrap();
    let start = std::time::Instant::now();
    tensor.resize(4 * G, GrowOptions::zeroed()).unwrap();
    let took = start.elapsed();
    assert!(
        took >= 3 * gap,
        "4 handles at one per {gap:?} grew in {took:?}"
    );
    assert_eq!((tensor.num_handles(), host.live_counts().1), (4, 4));
    tensor.set_driver_rate(None).unwrap();
    let start = std::time::Instant::now();
    tensor.resize(8 * G, GrowOptions::zeroed()).unwrap();
    assert!(
        start.elapsed() < gap,
        "unpaced again: {:?}",
        start.elapsed()
    );
    tensor.check_invariants().unwrap();
}

#[test]
fn lifting_the_pace_ends_a_paced_grow_s_wait() {
    let host = Arc::new(HostDriver::new(G).unwrap());
    let tensor = ExtensibleTensor::with_equal_segments(host.clone(), 4 * G, 1, options()).unwrap();
    tensor.set_driver_rate(Some(G / 10)).unwrap(); // a handle per 10 s
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        let grow = s.spawn(|| tensor.resize(4 * G, GrowOptions::zeroed()));
        std::thread::sleep(Duration::from_millis(50)); // past the first create, waiting
        tensor.set_driver_rate(None).unwrap();
        grow.join().unwrap().unwrap();
    });
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "the grow waited out the rate: {took:?}"
    );
    assert_eq!((tensor.num_handles(), host.live_counts().1), (4, 4));
    tensor.check_invariants().unwrap();
}
