//! Threads on the owner, every time on the host backend and, `#[ignore]`d without a GPU, on
//! CUDA (`scripts/gpu-check` runs it with `--include-ignored`): 8 threads grow, shrink,
//! release and consolidate their own tensors (writing and reading back what they commit, on
//! the host) while 4 others take views of those tensors and drop them, and 4 more race grows,
//! shrinks, releases and consolidations on one shared tensor. Afterwards every tensor must
//! hold its invariants, no view may be counted, and closing everything must leave the driver
//! (and, on the host, /proc) with nothing.

#[path = "support/common.rs"]
mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use extensible_kv::driver::host::HostDriver;
use extensible_kv::tensor::ViewRegion;
use extensible_kv::{
    Driver, Error, ExtensibleTensor, GrowOptions, HandleSizing, Options, ShrinkOptions, Stream,
};

const OWNERS: usize = 8;
const VIEWERS: usize = 4;
const RACERS: usize = 4;
/// Granules per segment of every tensor (2 segments each).
const GRANULES: u64 = 32;

/// xorshift64*: enough randomness for interleavings, with no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

/// An error a race may legitimately give: another thread moved the frontier first, so this
/// grow would shrink (or this shrink grow).
fn expected_race(result: extensible_kv::Result<()>) {
    match result {
        Ok(()) | Err(Error::InvalidArgument(_) | Error::WrongDirection { .. }) => {}
        Err(other) => panic!("unexpected error under contention: {other}"),
    }
}

/// One random mutation of `tensor`; returns the bytes per segment it committed, if it grew.
fn mutate(tensor: &ExtensibleTensor, rng: &mut Rng, capacity: u64) -> Option<u64> {
    let current = *tensor.segment_bytes().iter().max().unwrap();
    match rng.below(10) {
        0..=5 => {
            let target = current + rng.below(capacity - current + 1);
            let grown = tensor.resize_per_segment(target, GrowOptions::zeroed());
            let ok = grown.is_ok();
            expected_race(grown);
            ok.then_some(target)
        }
        6 | 7 => {
            let options = ShrinkOptions {
                exact: rng.below(2) == 0,
                ..ShrinkOptions::default()
            };
            let targets = vec![rng.below(current + 1); tensor.num_segments()];
            expected_race(tensor.shrink_per_segment(&targets, options));
            None
        }
        8 => {
            tensor.release_physical(Stream::DEFAULT).unwrap();
            None
        }
        _ => {
            tensor.consolidate(Stream::DEFAULT).unwrap();
            None
        }
    }
}

fn owner(tensor: &ExtensibleTensor, seed: u64, iterations: usize, touch: bool) {
    let mut rng = Rng::new(seed);
    let capacity = tensor.geometry().segment_capacities()[0];
    let second = tensor.geometry().segment_offsets()[1];
    for i in 0..iterations {
        let grown = mutate(tensor, &mut rng, capacity);
        if let (Some(bytes), true) = (grown, touch) {
            // Only this thread changes this tensor's frontier: its committed bytes stay put.
            let pattern: Vec<u8> = (0..bytes)
                .map(|b| (b as u8) ^ (seed as u8) ^ i as u8)
                .collect();
            common::write(tensor, second, &pattern);
            assert_eq!(common::read(tensor, second, bytes), pattern);
        }
        tensor.check_invariants().unwrap();
    }
}

fn viewer(tensors: &[ExtensibleTensor], seed: u64, done: &AtomicBool) {
    let mut rng = Rng::new(seed);
    let mut held: Vec<ViewRegion> = Vec::new();
    let mut views = 0usize;
    while !done.load(Ordering::Acquire) || views < 1000 {
        let tensor = &tensors[rng.below(tensors.len() as u64) as usize];
        let capacity = tensor.capacity_bytes();
        let offset = rng.below(capacity);
        let num_bytes = 1 + rng.below(capacity - offset);
        let region = tensor.view(offset, num_bytes).unwrap();
        assert_eq!(region.ptr(), tensor.base_ptr().unwrap() + offset);
        held.push(region);
        views += 1;
        if held.len() > 16 || rng.below(2) == 0 {
            held.swap_remove(rng.below(held.len() as u64) as usize);
        }
    }
}

fn racer(shared: &ExtensibleTensor, seed: u64, iterations: usize) {
    let mut rng = Rng::new(seed);
    let capacity = shared.geometry().segment_capacities()[0];
    for _ in 0..iterations {
        mutate(shared, &mut rng, capacity);
        shared.check_invariants().unwrap();
    }
}

/// The whole scenario on `driver`; `live` counts the driver's (handles, mappings,
/// reservations); `touch` writes and reads committed memory (host only: the Rust tests have
/// no device copy).
fn threads(driver: Arc<dyn Driver>, live: &dyn Fn() -> (usize, usize, usize), touch: bool) {
    let g = driver.granularity();
    // Segments that are not granule multiples share a granule: the dedup is under stress too.
    let segment = GRANULES * g - g / 2;
    let options = Options {
        handle_sizing: HandleSizing::CapAligned {
            max_bytes: Some(4 * g),
        },
        ..Options::default()
    };
    let make =
        || ExtensibleTensor::with_equal_segments(driver.clone(), 2 * segment, 2, options).unwrap();
    let owned: Vec<ExtensibleTensor> = (0..OWNERS).map(|_| make()).collect();
    let shared = make();
    let everything: Vec<ExtensibleTensor> = owned.iter().chain([&shared]).cloned().collect();
    let done = AtomicBool::new(false);
    let iterations = 300;
    std::thread::scope(|scope| {
        let workers: Vec<_> = owned
            .iter()
            .enumerate()
            .map(|(i, t)| scope.spawn(move || owner(t, i as u64, iterations, touch)))
            .chain((0..RACERS).map(|i| {
                let shared = &shared;
                scope.spawn(move || racer(shared, 100 + i as u64, iterations))
            }))
            .collect();
        let viewers: Vec<_> = (0..VIEWERS)
            .map(|i| {
                let (everything, done) = (&everything, &done);
                scope.spawn(move || viewer(everything, 200 + i as u64, done))
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        done.store(true, Ordering::Release);
        for viewer in viewers {
            viewer.join().unwrap();
        }
    });
    // A shrink's handles go back from the release thread once their stream passed it (on a
    // device, later than the call): counted by the tensor until then, not yet by the driver.
    for tensor in &everything {
        assert!(tensor.wait_released(Some(std::time::Duration::from_secs(30))));
    }
    let handles: usize = everything.iter().map(ExtensibleTensor::num_handles).sum();
    assert_eq!(live(), (handles, handles, everything.len()));
    for tensor in &everything {
        tensor.check_invariants().unwrap();
        assert_eq!(tensor.live_views(), 0);
        assert!(tensor.take_deferred_errors().is_empty());
        tensor.close().unwrap();
    }
    assert_eq!(live(), (0, 0, 0));
}

#[test]
fn threads_grow_view_and_race_on_the_host() {
    let host = Arc::new(HostDriver::new_dirty(4096).unwrap());
    let name = host.memfd_name().to_string();
    let counts = host.clone();
    threads(host, &|| counts.live_counts(), true);
    assert_eq!(common::proc_memfds(&name), (0, 0));
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU with VMM: run with --include-ignored on one"]
fn gpu_threads_grow_view_and_race() {
    use extensible_kv::driver::cuda::{vmm_unavailable_reason, CudaDriver};
    if let Some(reason) = vmm_unavailable_reason(0) {
        panic!("a GPU test was run without a usable GPU: {reason}");
    }
    let cuda = Arc::new(CudaDriver::new(0).unwrap());
    let counts = cuda.clone();
    threads(cuda, &|| counts.live_counts(), false);
}
