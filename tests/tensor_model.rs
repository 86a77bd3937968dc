//! A state-machine property test: random geometries (capacities that are not granule
//! multiples, so segments share granules), random handle policies, and random sequences of
//! grows, writes, shrinks (plain and exact), consolidations, releases, views taken and dropped,
//! closes, and stretches where the host backend holds its events (a busy stream: what shrinks
//! and releases give back stays pending until let go), checked against a plain model of each
//! segment's bytes.
//!
//! 200 cases by default; `EKV_PROPTEST_CASES=10000` for the long run (CI and
//! `scripts/gpu-check` run it once).

#[path = "support/common.rs"]
mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use extensible_kv::driver::host::events::DELAY_ENV_VAR;
use extensible_kv::driver::host::HostDriver;
use extensible_kv::driver::ExportTypes;
use extensible_kv::tensor::ViewRegion;
use extensible_kv::{
    Error, ExtensibleTensor, GrowOptions, HandleSizing, Options, ShrinkOptions, Stream,
};
use proptest::prelude::*;
use proptest::test_runner::{TestError, TestRunner};

const G: u64 = 4096;
const DEFAULT_CASES: u32 = 200;

/// The number of cases: `EKV_PROPTEST_CASES`, else `DEFAULT_CASES`. (proptest's own
/// `PROPTEST_CASES` is overridden by an explicit config, so it cannot be the knob.)
fn configured_cases() -> u32 {
    match std::env::var("EKV_PROPTEST_CASES") {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("EKV_PROPTEST_CASES must be a count, got {text:?}")),
        Err(_) => DEFAULT_CASES,
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// Grow every segment to this fraction of its capacity (lockstep), or each to its own.
    Grow {
        fractions: Vec<f64>,
        lockstep: bool,
        zero_new: bool,
    },
    Write {
        segment: usize,
        seed: u8,
    },
    /// Shrink every segment to this fraction of its committed bytes.
    Shrink {
        fractions: Vec<f64>,
        exact: bool,
    },
    Consolidate,
    /// An importer (made on the first one) follows the tensor: same handles, same bytes.
    Refresh,
    Release,
    /// Export a view of `[offset, offset + len)` of the capacity, fractions of it, and keep it.
    View {
        offset: f64,
        len: f64,
    },
    /// Drop the `index`-th kept view (modulo their number).
    DropView {
        index: usize,
    },
    /// Close: refused while views live, then every later step meets a closed tensor.
    Close,
    /// Hold the host backend's events (memory given back stays pending), or let them go and
    /// wait for the releases.
    Hold {
        held: bool,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (prop::collection::vec(0.0f64..=1.0, 5), any::<bool>(), any::<bool>())
            .prop_map(|(fractions, lockstep, zero_new)| Step::Grow { fractions, lockstep, zero_new }),
        3 => (0usize..5, any::<u8>()).prop_map(|(segment, seed)| Step::Write { segment, seed }),
        2 => (prop::collection::vec(0.0f64..=1.0, 5), any::<bool>())
            .prop_map(|(fractions, exact)| Step::Shrink { fractions, exact }),
        1 => Just(Step::Consolidate),
        1 => Just(Step::Refresh),
        1 => Just(Step::Release),
        2 => (0.0f64..1.0, 0.0f64..=1.0).prop_map(|(offset, len)| Step::View { offset, len }),
        2 => any::<usize>().prop_map(|index| Step::DropView { index }),
        1 => Just(Step::Close),
        1 => any::<bool>().prop_map(|held| Step::Hold { held }),
    ]
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8) | 1)
        .collect()
}

/// Whether a call on a closed tensor was refused as such.
fn refused_closed<T>(result: extensible_kv::Result<T>) -> Result<(), TestCaseError> {
    match result {
        Err(Error::Closed) => Ok(()),
        Err(other) => Err(TestCaseError::fail(format!("closed tensor: {other}"))),
        Ok(_) => Err(TestCaseError::fail("a closed tensor did not refuse")),
    }
}

fn run(
    caps: Vec<u64>,
    equal: bool,
    dirty: bool,
    options: Options,
    steps: Vec<Step>,
    drop_with_views: bool,
) -> Result<(), TestCaseError> {
    let driver = match dirty {
        true => HostDriver::new_dirty(G),
        false => HostDriver::new(G),
    };
    let driver = Arc::new(driver.unwrap());
    let n = caps.len();
    let tensor = if equal {
        let cap = caps[0];
        ExtensibleTensor::with_equal_segments(driver.clone(), cap * n as u64, n as u64, options)
    } else {
        ExtensibleTensor::with_segment_capacities(driver.clone(), caps, options)
    }
    .unwrap();
    let geometry = tensor.geometry().clone();
    let offsets = geometry.segment_offsets().to_vec();
    // The model: the committed bytes of each segment.
    let mut model: Vec<Vec<u8>> = vec![Vec::new(); n];
    // Whether exactly the needed granules are mapped (no slack left by a plain shrink).
    let mut exact_footprint = true;
    let mut importer: Option<ExtensibleTensor> = None;
    let mut views: Vec<ViewRegion> = Vec::new();
    let mut closed = false;
    let mut held = false;
    let capacity = geometry.capacity_bytes();
    for step in steps {
        if closed {
            match step {
                Step::Grow { .. } => {
                    refused_closed(tensor.resize_per_segment(&vec![0; n], GrowOptions::default()))?
                }
                Step::Shrink { .. } => refused_closed(
                    tensor.shrink_per_segment(&vec![0; n], ShrinkOptions::default()),
                )?,
                Step::Consolidate => {
                    refused_closed(tensor.consolidate(extensible_kv::Stream::DEFAULT))?
                }
                Step::Release => refused_closed(tensor.release_physical(Stream::DEFAULT))?,
                Step::View { .. } => refused_closed(tensor.view(0, 1))?,
                Step::Refresh => refused_closed(tensor.share())?,
                Step::Close => tensor
                    .close()
                    .map_err(|e| TestCaseError::fail(e.to_string()))?,
                Step::Write { .. } | Step::DropView { .. } | Step::Hold { .. } => {}
            }
            prop_assert!(tensor.is_closed());
            prop_assert_eq!(driver.live_counts(), (0, 0, 0));
            tensor.check_invariants().map_err(TestCaseError::fail)?;
            continue;
        }
        match step {
            Step::View { offset, len } => {
                let offset = ((capacity as f64 * offset) as u64).min(capacity - 1);
                let len = (((capacity - offset) as f64 * len) as u64).max(1);
                views.push(tensor.view(offset, len).unwrap());
                prop_assert_eq!(
                    views.last().unwrap().ptr(),
                    tensor.base_ptr().unwrap() + offset
                );
            }
            Step::DropView { index } => {
                if !views.is_empty() {
                    views.remove(index % views.len());
                }
            }
            Step::Close => {
                if views.is_empty() {
                    tensor.close().unwrap();
                    closed = true;
                    model.iter_mut().for_each(Vec::clear);
                    prop_assert_eq!(driver.live_counts(), (0, 0, 0));
                    continue;
                }
                match tensor.close() {
                    Err(Error::ViewsAlive { live_views }) => {
                        prop_assert_eq!(live_views, views.len())
                    }
                    other => prop_assert!(false, "close with views: {:?}", other.map(|_| ())),
                }
            }
            Step::Grow {
                fractions,
                lockstep,
                zero_new,
            } => {
                let targets: Vec<u64> = geometry
                    .segment_capacities()
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| {
                        let f = if lockstep { fractions[0] } else { fractions[i] };
                        ((c as f64 * f) as u64).max(model[i].len() as u64)
                    })
                    .collect();
                let targets = if lockstep
                    && geometry
                        .segment_capacities()
                        .iter()
                        .all(|&c| c == geometry.segment_capacities()[0])
                {
                    vec![*targets.iter().max().unwrap(); n]
                } else {
                    targets
                };
                let pending = tensor.pending_release_bytes();
                tensor
                    .resize_per_segment(
                        &targets,
                        GrowOptions {
                            zero_new,
                            ..Default::default()
                        },
                    )
                    .unwrap();
                if tensor.pending_release_bytes() < pending {
                    // Handles taken back whole may reach past what the grow needs: slack, as
                    // after a plain shrink.
                    exact_footprint = false;
                }
                for (i, &t) in targets.iter().enumerate() {
                    // Without zero_new, new bytes hold whatever the memory held: zero or
                    // junk from a fresh handle, or stray writes in a granule mapped earlier.
                    let old = model[i].len();
                    let actual = common::read(&tensor, offsets[i] + old as u64, t - old as u64);
                    if zero_new {
                        prop_assert!(
                            actual.iter().all(|&b| b == 0),
                            "new bytes of segment {i} not zero"
                        );
                    }
                    model[i].extend_from_slice(&actual);
                }
            }
            Step::Write { segment, seed } => {
                let i = segment % n;
                let bytes = pattern(seed, model[i].len());
                common::write(&tensor, offsets[i], &bytes);
                model[i] = bytes;
                // Scribble over the mapped slack past the prefix (inside this segment's
                // capacity): a later grow with zero_new must zero it again.
                let end = offsets[i] + model[i].len() as u64;
                let slack_end = end
                    .next_multiple_of(G)
                    .min(offsets[i] + geometry.segment_capacities()[i]);
                if !model[i].is_empty() && slack_end > end {
                    common::write(
                        &tensor,
                        end,
                        &pattern(seed ^ 0x5a, (slack_end - end) as usize),
                    );
                }
            }
            Step::Shrink { fractions, exact } => {
                let targets: Vec<u64> = model
                    .iter()
                    .zip(&fractions)
                    .map(|(m, f)| (m.len() as f64 * f) as u64)
                    .collect();
                let options = ShrinkOptions {
                    exact,
                    ..Default::default()
                };
                tensor.shrink_per_segment(&targets, options).unwrap();
                for (m, &t) in model.iter_mut().zip(&targets) {
                    m.truncate(t as usize);
                }
                exact_footprint = exact;
            }
            Step::Consolidate => {
                tensor.consolidate(extensible_kv::Stream::DEFAULT).unwrap();
                exact_footprint = true;
                // One handle per maximal run of needed granules.
                let committed: Vec<u64> = model.iter().map(|m| m.len() as u64).collect();
                prop_assert_eq!(tensor.handle_runs(), geometry.needed_runs(&committed));
            }
            Step::Refresh => {
                let description = tensor.share().unwrap();
                match &importer {
                    Some(imported) => imported.refresh(&description, None).unwrap(),
                    None => {
                        let own = Arc::new(HostDriver::new(G).unwrap());
                        importer = Some(ExtensibleTensor::import(own, &description, None).unwrap());
                    }
                }
                let imported = importer.as_ref().expect("made above");
                imported.check_invariants().map_err(TestCaseError::fail)?;
                prop_assert_eq!(imported.handle_runs(), tensor.handle_runs());
                prop_assert_eq!(imported.segment_bytes(), tensor.segment_bytes());
                for (i, bytes) in model.iter().enumerate() {
                    let seen = common::read(imported, offsets[i], bytes.len() as u64);
                    prop_assert_eq!(&seen, bytes);
                }
            }
            Step::Release => {
                tensor.release_physical(Stream::DEFAULT).unwrap();
                model.iter_mut().for_each(Vec::clear);
                exact_footprint = true;
                if !held {
                    prop_assert_eq!(driver.live_counts().0, 0);
                }
            }
            Step::Hold { held: hold } => {
                tensor.hold_events(hold).unwrap();
                if !hold {
                    let released = tensor.wait_released(Some(std::time::Duration::from_secs(10)));
                    prop_assert!(released, "let go, the releases did not happen");
                    prop_assert_eq!(tensor.pending_release_bytes(), 0);
                }
                held = hold;
            }
        }
        if !held && std::env::var_os(DELAY_ENV_VAR).is_none() {
            prop_assert_eq!(
                tensor.pending_release_bytes(),
                0,
                "an idle stream releases at once"
            );
        }
        prop_assert_eq!(tensor.live_views(), views.len());
        prop_assert!(tensor.take_deferred_errors().is_empty());
        tensor.check_invariants().map_err(TestCaseError::fail)?;
        let committed: Vec<u64> = model.iter().map(|m| m.len() as u64).collect();
        prop_assert_eq!(tensor.segment_bytes(), committed.clone());
        // The mapped granules are those the committed prefixes need, plus, after a plain
        // shrink, the slack of handles that still hold a needed granule.
        let needed_runs = geometry.needed_runs(&committed);
        let needed: u64 = needed_runs.iter().map(|r| r.num_granules).sum();
        // Held, nothing is released meanwhile: the pending bytes stand still between reads.
        let mapped = tensor.physical_bytes() - tensor.pending_release_bytes();
        if exact_footprint {
            prop_assert_eq!(mapped, needed * G);
        } else {
            prop_assert!(mapped >= needed * G);
            for run in tensor.handle_runs() {
                prop_assert!(!extensible_kv::plan::intersect_run(run, &needed_runs).is_empty());
            }
        }
        prop_assert_eq!(driver.live_counts().0, tensor.num_handles());
        for (i, bytes) in model.iter().enumerate() {
            prop_assert_eq!(
                &common::read(&tensor, offsets[i], bytes.len() as u64),
                bytes
            );
        }
    }
    prop_assert_eq!(tensor.live_views(), views.len());
    if drop_with_views && !views.is_empty() {
        // The memory outlives the tensor while a view lives, and goes with the last one.
        let (handles, mappings, reservations) = driver.live_counts();
        drop(tensor);
        prop_assert_eq!(driver.live_counts(), (handles, mappings, reservations));
        prop_assert!(reservations == 1 || closed);
        drop(views);
    } else {
        drop(views);
        tensor.close().unwrap();
    }
    prop_assert_eq!(driver.live_counts(), (0, 0, 0));
    if let Some(imported) = importer {
        imported.close().unwrap();
    }
    Ok(())
}

#[test]
fn matches_the_model() {
    let cases = configured_cases();
    let config = ProptestConfig {
        cases,
        // Where the macro would keep failing seeds: tests/tensor_model.proptest-regressions.
        source_file: Some(file!()),
        ..ProptestConfig::default()
    };
    // 0: cap-aligned, 1: aligned powers of two, 2: per run, 3: whole runs.
    let sizing = 0u8..4;
    let strategy = (
        prop::collection::vec(1u64..4 * G, 1..5),
        (any::<bool>(), any::<bool>(), any::<bool>()),
        (1u64..8, sizing),
        prop::collection::vec(step(), 1..16),
    );
    let ran = AtomicU32::new(0);
    let result = TestRunner::new(config).run(
        &strategy,
        |(caps, (equal, dirty, drop_with_views), (cap, sizing), steps)| {
            ran.fetch_add(1, Ordering::Relaxed);
            let options = Options {
                granularity: None,
                handle_sizing: match sizing {
                    0 => HandleSizing::CapAligned {
                        max_bytes: Some(cap * G),
                    },
                    1 => HandleSizing::AlignedPowersOfTwo {
                        max_bytes: Some(cap * G),
                    },
                    2 => HandleSizing::PerRun {
                        max_bytes: Some(cap * G),
                    },
                    _ => HandleSizing::WholeRuns,
                },
                export_types: ExportTypes::POSIX_FD,
            };
            run(caps, equal, dirty, options, steps, drop_with_views)
        },
    );
    if let Err(TestError::Fail(reason, input)) = &result {
        panic!("{reason}\nminimal failing input: {input:#?}");
    }
    result.unwrap();
    let ran = ran.load(Ordering::Relaxed);
    // Seeds of past failures are replayed before the new cases, so a few more may run.
    println!("tensor model: {cases} cases configured, {ran} run");
    assert!(ran >= cases, "{ran} < {cases}");
}

/// The dedup case: 3 granules, 2 segments of 1.5 granules, from ½ granule to full.
#[test]
fn shared_granule_is_mapped_once_and_data_survives() {
    let driver = Arc::new(HostDriver::new(G).unwrap());
    let tensor =
        ExtensibleTensor::with_equal_segments(driver.clone(), 3 * G, 2, Options::default())
            .unwrap();
    tensor
        .resize_per_segment(G / 2, GrowOptions::zeroed())
        .unwrap();
    assert_eq!(tensor.physical_bytes(), 2 * G);
    common::write(&tensor, 0, &pattern(7, (G / 2) as usize));
    common::write(&tensor, 3 * G / 2, &pattern(9, (G / 2) as usize));
    tensor
        .resize_per_segment(3 * G / 2, GrowOptions::zeroed())
        .unwrap();
    assert_eq!(tensor.physical_bytes(), 3 * G);
    assert_eq!(driver.live_counts().0, tensor.num_handles());
    assert_eq!(
        common::read(&tensor, 0, G / 2),
        pattern(7, (G / 2) as usize)
    );
    assert_eq!(
        common::read(&tensor, 3 * G / 2, G / 2),
        pattern(9, (G / 2) as usize)
    );
    assert!(common::read(&tensor, G / 2, G).iter().all(|&b| b == 0));
    assert!(common::read(&tensor, 2 * G, G).iter().all(|&b| b == 0));
}

/// A view outlives the tensor; the memory goes with the last view.
#[test]
fn views_keep_memory_alive() {
    let driver = Arc::new(HostDriver::new(G).unwrap());
    let tensor =
        ExtensibleTensor::with_equal_segments(driver.clone(), 4 * G, 1, Options::default())
            .unwrap();
    tensor.resize_per_segment(G, GrowOptions::zeroed()).unwrap();
    common::write(&tensor, 0, b"alive");
    let region = tensor.view(0, G).unwrap();
    assert!(matches!(
        tensor.close(),
        Err(extensible_kv::Error::ViewsAlive { live_views: 1 })
    ));
    drop(tensor);
    assert_eq!(driver.live_counts(), (1, 1, 1));
    drop(region);
    assert_eq!(driver.live_counts(), (0, 0, 0));
}
