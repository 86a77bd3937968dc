//! A state-machine property test: random geometries (capacities that are not granule
//! multiples, so segments share granules), random handle policies, and random sequences of
//! grows, writes, shrinks (plain and exact), consolidations and releases, checked against a
//! plain model of each segment's bytes.

mod common;

use std::sync::Arc;

use extensible_kv::driver::host::HostDriver;
use extensible_kv::{Cut, ExtensibleTensor, GrowOptions, Options, ShrinkOptions};
use proptest::prelude::*;

const G: u64 = 4096;

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
    Release,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (prop::collection::vec(0.0f64..=1.0, 5), any::<bool>(), any::<bool>())
            .prop_map(|(fractions, lockstep, zero_new)| Step::Grow { fractions, lockstep, zero_new }),
        3 => (0usize..5, any::<u8>()).prop_map(|(segment, seed)| Step::Write { segment, seed }),
        2 => (prop::collection::vec(0.0f64..=1.0, 5), any::<bool>())
            .prop_map(|(fractions, exact)| Step::Shrink { fractions, exact }),
        1 => Just(Step::Consolidate),
        1 => Just(Step::Release),
    ]
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8) | 1)
        .collect()
}

fn run(
    caps: Vec<u64>,
    equal: bool,
    dirty: bool,
    options: Options,
    steps: Vec<Step>,
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
    for step in steps {
        match step {
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
                tensor
                    .resize_segments(
                        &targets,
                        GrowOptions {
                            zero_new,
                            ..Default::default()
                        },
                    )
                    .unwrap();
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
                tensor.shrink_segments(&targets, options).unwrap();
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
            Step::Release => {
                tensor.release_physical().unwrap();
                model.iter_mut().for_each(Vec::clear);
                exact_footprint = true;
                prop_assert_eq!(driver.live_counts().0, 0);
            }
        }
        prop_assert!(tensor.take_deferred_errors().is_empty());
        tensor.check_invariants().map_err(TestCaseError::fail)?;
        let committed: Vec<u64> = model.iter().map(|m| m.len() as u64).collect();
        prop_assert_eq!(tensor.segment_bytes(), committed.clone());
        // The mapped granules are those the committed prefixes need, plus, after a plain
        // shrink, the slack of handles that still hold a needed granule.
        let needed_runs = geometry.needed_runs(&committed);
        let needed: u64 = needed_runs.iter().map(|r| r.num_granules).sum();
        if exact_footprint {
            prop_assert_eq!(tensor.physical_bytes(), needed * G);
        } else {
            prop_assert!(tensor.physical_bytes() >= needed * G);
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
    tensor.close().unwrap();
    prop_assert_eq!(driver.live_counts(), (0, 0, 0));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn matches_the_model(
        caps in prop::collection::vec(1u64..4 * G, 1..5),
        equal in any::<bool>(),
        dirty in any::<bool>(),
        adaptive_cap in 1u64..8,
        fixed in prop::option::of(1u64..3),
        cut in prop::sample::select(vec![Cut::AlignedPowersOfTwo, Cut::AtCapMultiples, Cut::WholeRuns]),
        steps in prop::collection::vec(step(), 1..12),
    ) {
        let options = Options {
            granularity: None,
            max_handle_bytes: Some(adaptive_cap * G),
            fixed_handle_bytes: fixed.map(|f| f * G),
            cut,
        };
        run(caps, equal, dirty, options, steps)?;
    }
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
    let region = tensor.export(0, G).unwrap();
    assert!(matches!(
        tensor.close(),
        Err(extensible_kv::Error::ViewsAlive { live_views: 1 })
    ));
    drop(tensor);
    assert_eq!(driver.live_counts(), (1, 1, 1));
    drop(region);
    assert_eq!(driver.live_counts(), (0, 0, 0));
}
