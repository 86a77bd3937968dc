//! Mapping benchmarks: bulk commit with the default handle policy (`CapAligned`) against fixed
//! one-granule handles (what per-granule peers do) in the same run, incremental one-granule
//! grows, the cost of planning over a 64 TiB reservation, and the orders a teardown could give
//! its driver calls in (issue 21: a teardown within 1.1x of its `cuMemRelease` calls).
//!
//! `EKV_BENCH_DEVICE` picks the backend (`cpu`, the default, or `cuda:N` in a build with the
//! `cuda` feature); `EKV_BENCH_MIB` the bytes committed per segment in the bulk bench
//! (default 64 on cpu, 8192 on cuda).

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use extensible_kv::driver::Stream;
use extensible_kv::plan::{self, Geometry, HandlePolicy, Run};
use extensible_kv::{driver, Driver, ExtensibleTensor, GrowOptions, HandleSizing, Options};

const MIB: u64 = 1 << 20;
/// One 16-token bf16 block of 8 KV heads of 128 per segment: the flow's first commit.
const BLOCK: u64 = 16 * 8 * 128 * 2;

fn device() -> String {
    std::env::var("EKV_BENCH_DEVICE").unwrap_or_else(|_| "cpu".into())
}

fn open_driver() -> Arc<dyn Driver> {
    driver::open(&device(), None).expect("bench device")
}

fn bulk_bytes_per_segment() -> u64 {
    let default = if device() == "cpu" { 64 } else { 8192 };
    std::env::var("EKV_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
        * MIB
}

fn stream() -> Stream {
    Stream::DEFAULT
}

fn zeroed_on(stream: Stream) -> GrowOptions {
    GrowOptions {
        stream,
        ..GrowOptions::zeroed()
    }
}

fn bulk_commit(c: &mut Criterion) {
    let driver = open_driver();
    let per_segment = bulk_bytes_per_segment();
    let g = driver.granularity();
    let mut group = c.benchmark_group(format!("bulk_commit/{}", device()));
    group.throughput(Throughput::Bytes(2 * per_segment));
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(5));
    for (name, options) in [
        ("cap_aligned", Options::default()),
        (
            "fixed_granule",
            Options {
                handle_sizing: HandleSizing::PerRun { max_bytes: Some(g) },
                ..Options::default()
            },
        ),
    ] {
        group.bench_function(name, |b| {
            b.iter_batched(
                || {
                    let t = ExtensibleTensor::with_equal_segments(
                        driver.clone(),
                        2 * per_segment,
                        2,
                        options,
                    )
                    .unwrap();
                    t.resize_per_segment(BLOCK, zeroed_on(stream())).unwrap();
                    driver.synchronize().unwrap();
                    t
                },
                |t| {
                    t.resize_per_segment(per_segment, zeroed_on(stream()))
                        .unwrap();
                    driver.synchronize().unwrap();
                    t
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

/// One granule more per segment, up to `MAX_STEPS` granules; releases (untimed) and starts
/// again from one granule when full.
fn incremental_grow(c: &mut Criterion) {
    const MAX_STEPS: u64 = 256;
    let driver = open_driver();
    let g = driver.granularity();
    let mut group = c.benchmark_group(format!("incremental_grow/{}", device()));
    group.throughput(Throughput::Bytes(2 * g));
    let t = ExtensibleTensor::with_equal_segments(
        driver.clone(),
        2 * MAX_STEPS * g,
        2,
        Options::default(),
    )
    .unwrap();
    let mut size = 0;
    group.bench_function("one_granule_per_segment", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                if size == MAX_STEPS * g {
                    // Released before the next timed grow, so that no grow takes it back.
                    t.release_physical(stream()).unwrap();
                    t.wait_released(None);
                    size = 0;
                }
                size += g;
                let start = std::time::Instant::now();
                t.resize_per_segment(size, zeroed_on(stream())).unwrap();
                total += start.elapsed();
            }
            total
        })
    });
    group.finish();
    driver.synchronize().unwrap();
}

fn planning(c: &mut Criterion) {
    let g = 2 * MIB;
    let geometry = Geometry::equal(64 << 40, 2, g).unwrap();
    let aligned_powers_of_two = HandlePolicy::AlignedPowersOfTwo {
        max_handle_granules: (1 << 30) / g,
    };
    // What a grow plans from the old and new sizes (all of `mapped` passed: the tensor passes
    // only the runs that overlap the new granules).
    let grow = |mapped: &[Run], old: &[u64], new: &[u64]| {
        let new_ranges = geometry.new_ranges(old, new);
        let new_granules = plan::granules_of(&new_ranges, g);
        plan::plan_grow(new_ranges, &new_granules, mapped, aligned_powers_of_two)
    };
    let mut group = c.benchmark_group("planning_64TiB");
    group.bench_function("full_grow_1GiB_cap", |b| {
        b.iter(|| black_box(grow(&[], &[0, 0], &[32 << 40, 32 << 40]).new_handles.len()))
    });
    let half = [16u64 << 40, 16 << 40];
    let mapped = grow(&[], &[0, 0], &half).new_handles;
    let next = [half[0] + g, half[1] + g];
    group.bench_function("one_granule_grow_over_32k_handles", |b| {
        b.iter(|| black_box(grow(&mapped, &half, &next)))
    });
    group.finish();
}

/// A teardown of `handles`, each `size` bytes and mapped in turn from `va`.
type Teardown = fn(&dyn Driver, u64, u64, &[driver::HandleId]);

/// Handles a teardown bench tears down, and their size: 1 GiB handles on CUDA (the default
/// cut's), one granule on the host (a teardown there is `munmap`s and `close`s).
fn teardown_handles(driver: &dyn Driver) -> (u64, u64) {
    if device() == "cpu" {
        (32, driver.granularity())
    } else {
        (32, 1 << 30)
    }
}

/// The same mapped handles torn down in four orders, only the teardown timed: what the owner
/// does (unmap, then release, handle by handle); every release before the unmaps (a mapped
/// handle's memory goes when its last mapping does); and each with one unmap of the whole
/// range instead of one per mapping. `release_only` times the releases of unmapped handles
/// alone: the sum a teardown cannot go below.
fn teardown(c: &mut Criterion) {
    let driver = open_driver();
    let (count, size) = teardown_handles(driver.as_ref());
    let mut group = c.benchmark_group(format!("teardown/{}", device()));
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(3));
    let orders: [(&str, Teardown); 5] = [
        ("unmap_then_release_each", |d, va, size, handles| {
            for (i, &h) in handles.iter().enumerate() {
                d.unmap(va + i as u64 * size, size).unwrap();
                d.release(h).unwrap();
            }
        }),
        ("release_all_then_unmap_each", |d, va, size, handles| {
            for &h in handles {
                d.release(h).unwrap();
            }
            for i in 0..handles.len() as u64 {
                d.unmap(va + i * size, size).unwrap();
            }
        }),
        ("unmap_range_then_release_all", |d, va, size, handles| {
            d.unmap(va, size * handles.len() as u64).unwrap();
            for &h in handles {
                d.release(h).unwrap();
            }
        }),
        ("release_all_then_unmap_range", |d, va, size, handles| {
            for &h in handles {
                d.release(h).unwrap();
            }
            d.unmap(va, size * handles.len() as u64).unwrap();
        }),
        ("release_only", |d, _va, _size, handles| {
            for &h in handles {
                d.release(h).unwrap();
            }
        }),
    ];
    for (name, order) in orders {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let va = driver.reserve(count * size).unwrap();
                    let handles: Vec<_> = (0..count)
                        .map(|i| {
                            let h = driver.create(size, Default::default()).unwrap();
                            driver.map(va + i * size, size, h).unwrap();
                            driver.set_access(va + i * size, size).unwrap();
                            h
                        })
                        .collect();
                    if name == "release_only" {
                        driver.unmap(va, count * size).unwrap(); // untimed: not a teardown's part
                    }
                    driver.synchronize().unwrap();
                    let start = Instant::now();
                    order(driver.as_ref(), va, size, &handles);
                    spent += start.elapsed();
                    driver.free_reservation(va, count * size).unwrap();
                }
                spent
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bulk_commit, incremental_grow, planning, teardown);
criterion_main!(benches);
