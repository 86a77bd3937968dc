//! Sharing memory between tensors through exported handles, on the host backend (a process
//! may take its own fds with pidfd_getfd, so one process plays owner and importer here; the
//! Python tests run two processes).

#[path = "support/common.rs"]
mod common;

use std::sync::Arc;

use extensible_kv::driver::host::HostDriver;
use extensible_kv::driver::wrap::faulty::{Fault, FaultKind, FaultyDriver};
use extensible_kv::driver::ExportTypes;
use extensible_kv::{
    Error, ExtensibleTensor, GrowOptions, HandleSizing, Op, Options, ShrinkOptions, Stream,
};

const G: u64 = 4096;

fn host_driver() -> Arc<HostDriver> {
    Arc::new(HostDriver::new(G).unwrap())
}

/// An exportable owner of 2 segments of 8 granules on `host`, each grown to `per_segment`.
fn owner(host: &Arc<HostDriver>, per_segment: u64) -> ExtensibleTensor {
    let options = Options {
        handle_sizing: HandleSizing::CapAligned {
            max_bytes: Some(2 * G),
        },
        export_types: ExportTypes::POSIX_FD,
        ..Options::default()
    };
    let owner = ExtensibleTensor::with_equal_segments(host.clone(), 2 * 8 * G, 2, options).unwrap();
    owner
        .resize_per_segment(per_segment, GrowOptions::zeroed())
        .unwrap();
    owner
}

#[test]
fn an_importer_sees_writes_and_follows_grows_and_shrinks() {
    let host = host_driver();
    let owner = owner(&host, 3 * G);
    common::write(&owner, 0, &[7; 16]);
    let importer_driver = host_driver();
    let imported =
        ExtensibleTensor::import(importer_driver.clone(), &owner.share().unwrap(), None).unwrap();
    assert_eq!(imported.segment_bytes(), owner.segment_bytes());
    assert_eq!(imported.handle_runs(), owner.handle_runs());
    assert_eq!(common::read(&imported, 0, 16), vec![7; 16]);
    common::write(&imported, 8 * G, &[9; 8]); // segment 1, through the importer
    assert_eq!(common::read(&owner, 8 * G, 8), vec![9; 8]);

    owner
        .resize_per_segment(7 * G, GrowOptions::zeroed())
        .unwrap();
    common::write(&owner, 6 * G, &[5; 4]);
    imported.refresh(&owner.share().unwrap(), None).unwrap();
    assert_eq!(imported.handle_runs(), owner.handle_runs());
    assert_eq!(common::read(&imported, 6 * G, 4), vec![5; 4]);
    let exact = ShrinkOptions {
        exact: true,
        stream: Stream::DEFAULT,
    };
    owner.shrink_per_segment([G + 1, G + 1], exact).unwrap();
    imported.refresh(&owner.share().unwrap(), None).unwrap();
    assert_eq!(imported.handle_runs(), owner.handle_runs());
    assert_eq!(common::read(&imported, 0, 16), vec![7; 16]);
    imported.check_invariants().unwrap();

    // The importer changes nothing of the owner's, and says whose memory it is.
    for result in [
        imported.resize_per_segment(8 * G, GrowOptions::zeroed()),
        imported.release_physical(Stream::DEFAULT),
        imported.consolidate(Stream::DEFAULT),
    ] {
        assert!(matches!(result, Err(Error::Unsupported(ref why)) if why.contains("owns")));
    }
    // The owner goes; the importer's memory stays until it lets go.
    owner.close().unwrap();
    assert_eq!(common::read(&imported, 0, 16), vec![7; 16]);
    imported.close().unwrap();
    assert_eq!(importer_driver.live_counts(), (0, 0, 0));
}

#[test]
fn a_failed_import_leaves_nothing_behind() {
    let host = host_driver();
    let owner = owner(&host, 7 * G);
    let description = owner.share().unwrap();
    assert!(description.handles.len() >= 6);
    // The owner's memfds, its exported copies and any an importer holds all name the owner's
    // driver (other tests, on other threads, use drivers of their own).
    let name = host.memfd_name().to_string();
    let fds = || common::proc_memfds(&name).0;
    let before = fds();
    let mut injected = 0;
    for op in [Op::Reserve, Op::Import, Op::Map, Op::SetAccess] {
        for nth in 1..=description.handles.len() as u64 {
            let importer = host_driver();
            let fault = Fault {
                op,
                nth,
                kind: FaultKind::Driver,
            };
            let faulty = Arc::new(FaultyDriver::new(importer.clone(), fault));
            match ExtensibleTensor::import(faulty, &description, None) {
                Err(Error::Driver { op: failed, .. }) => {
                    assert_eq!(failed, op);
                    injected += 1;
                }
                Err(other) => panic!("{op} {nth}: {other}"),
                Ok(tensor) => tensor.close().unwrap(), // fewer calls of `op` than `nth`
            }
            assert_eq!(importer.live_counts(), (0, 0, 0), "{op} {nth}");
            assert_eq!(fds(), before, "{op} {nth}: an fd leaked");
        }
    }
    assert!(injected >= 13, "{injected}");
}

#[test]
fn tampered_descriptions_are_refused() {
    let host = host_driver();
    let owner = owner(&host, 3 * G);
    let description = owner.share().unwrap();
    let mut grown = description.clone();
    grown.segment_bytes = vec![5 * G, 5 * G];
    let mut twice = description.clone();
    twice.handles[1].serial = twice.handles[0].serial;
    let mut bigger = description.clone();
    bigger.handles[0].run.num_granules += 1;
    let mut wrapping = description.clone();
    wrapping.handles[0].run.first_granule = u64::MAX;
    for (bad, why) in [
        (grown, "no handle covers them"),
        (twice, "two handles have serial"),
        (bigger, "inside the handle before it"),
        (wrapping, "handles[0] covers granules 18446744073709551615"),
    ] {
        match ExtensibleTensor::import(host_driver(), &bad, None) {
            Err(Error::InvalidArgument(message)) => assert!(message.contains(why), "{message}"),
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("accepted a description with {why}"),
        }
    }
    let plain = ExtensibleTensor::with_equal_segments(host, 4 * G, 1, Options::default()).unwrap();
    assert!(matches!(plain.share(), Err(Error::Unsupported(_))));
}

#[test]
fn fabric_alone_where_the_backend_has_none_is_refused_and_with_fds_falls_back() {
    let host = host_driver();
    let build = |export_types| {
        let options = Options {
            export_types,
            ..Options::default()
        };
        ExtensibleTensor::with_equal_segments(host.clone(), 2 * G, 1, options)
    };
    let Err(err) = build(ExportTypes::FABRIC) else {
        panic!("fabric alone on the host backend was accepted: the memory could not be shared");
    };
    assert!(matches!(err, Error::Unsupported(_)), "{err}");
    assert!(
        err.to_string().contains("cannot export fabric handles"),
        "{err}"
    );
    let both = build(ExportTypes::POSIX_FD.union(ExportTypes::FABRIC)).unwrap();
    assert_eq!(both.export_types(), ExportTypes::POSIX_FD);
}
