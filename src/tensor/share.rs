//! Sharing a tensor's memory with other processes.
//!
//! The owner describes its memory (`share`): the tensor's random id, the geometry, the
//! committed bytes, and per mapped handle its granule run, a serial number and how to get it
//! (the owner's pid and the number of an fd it keeps open, or a fabric handle). Fd numbers are
//! checked against the owner's export registry (`crate::ipc`) before anything is mapped, so a
//! stale description, whose fd numbers may name other memory by now, is refused. Each handle is exported once, lazily, and the
//! export kept for the handle's life (the export cost, docs/design.md §2: few, large handles
//! make sharing cheap). Another process builds its own reservation of the same geometry and
//! maps the same handles at the same offsets (`import`); `refresh` follows the owner's later
//! grows and shrinks by serial number. An importer never grows, shrinks or frees the owner's
//! memory; what it maps lives on, whatever the owner does, until the importer lets go.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;

use super::{relock, ExtensibleTensor, Mapping, PhysicalHandle};
use crate::driver::{DeviceKind, Driver, ExportTypes, Exported, ImportSource};
use crate::error::{Error, Result};
use crate::ipc::{self, ExportRegistry, FdSource, RegistryView};
use crate::plan::{self, BadRun, Geometry, HandlePolicy, Run};

/// How an importer gets one handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SharedExport {
    /// File descriptor `fd` of process `pid`, kept open by the owner while the handle lives.
    Fd {
        /// The owner's process id.
        pid: u32,
        /// The number of the fd in the owner's process.
        fd: i32,
    },
    /// CUDA's fabric handle.
    Fabric([u8; 64]),
}

/// One mapped handle of a shared tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedHandle {
    /// The granules the handle backs.
    pub run: Run,
    /// The owner's number for the handle, unique for the owner tensor's life.
    pub serial: u64,
    /// How an importer gets it.
    pub export: SharedExport,
}

/// What another process needs to map a tensor's memory: `ExtensibleTensor::share`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedDescription {
    /// The owner's device.
    pub device: DeviceKind,
    /// The owner's granularity: runs are in granules of it.
    pub granularity: u64,
    /// The capacity of each segment, laid back to back.
    pub segment_capacities: Vec<u64>,
    /// The committed bytes of each segment.
    pub segment_bytes: Vec<u64>,
    /// The owner's process id.
    pub owner_pid: u32,
    /// The owner tensor's random id (never 0): names it across processes and over time.
    pub tensor_id: u128,
    /// The owner's fd number of its export registry, when any handle is an fd.
    pub registry_fd: Option<i32>,
    /// Sorted by run, disjoint, covering every granule a committed byte needs.
    pub handles: Vec<SharedHandle>,
}

impl SharedDescription {
    /// The geometry the description states, checked field by field: a description that fails
    /// this was tampered with or mixed up, and nothing is mapped for it.
    fn validate(&self) -> Result<Geometry> {
        let bad = |why: String| Error::invalid(format!("invalid shared description: {why}"));
        if self.tensor_id == 0 {
            return Err(bad(
                "tensor_id is 0: it names no tensor (use share()'s)".into()
            ));
        }
        let geometry = Geometry::new(self.segment_capacities.clone(), self.granularity)
            .map_err(|e| bad(format!("segment_capacities / granularity: {e}")))?;
        geometry
            .check_request(&self.segment_bytes)
            .map_err(|e| bad(format!("segment_bytes: {e}")))?;
        let runs: Vec<Run> = self.handles.iter().map(|h| h.run).collect();
        plan::check_runs(&runs, geometry.num_granules()).map_err(|e| bad(handles_refused(e)))?;
        for (i, handle) in self.handles.iter().enumerate() {
            if let SharedExport::Fd { pid, fd } = handle.export {
                if pid != self.owner_pid {
                    return Err(bad(format!(
                        "handles[{i}].pid is {pid}, not the owner's ({})",
                        self.owner_pid
                    )));
                }
                if fd < 0 || self.registry_fd.is_none_or(|r| r < 0) {
                    return Err(bad(format!(
                        "handles[{i}] is fd {fd} with registry fd {:?}: both must be fd numbers",
                        self.registry_fd
                    )));
                }
            }
        }
        let missing = plan::subtract(&geometry.needed_runs(&self.segment_bytes), &runs);
        if let Some(run) = missing.first() {
            return Err(bad(format!(
                "segment_bytes needs granules {} to {} mapped, and no handle covers them",
                run.first_granule,
                run.end_granule() - 1
            )));
        }
        let mut serials: Vec<u64> = self.handles.iter().map(|h| h.serial).collect();
        serials.sort_unstable();
        if let Some(pair) = serials.windows(2).find(|w| w[0] == w[1]) {
            return Err(bad(format!("two handles have serial {}", pair[0])));
        }
        Ok(geometry)
    }
}

/// Why `check_runs` refused the granule runs of a description's (or a loan's) handles, worded
/// for handles.
pub(super) fn handles_refused(bad: BadRun) -> String {
    match bad {
        BadRun::Outside {
            index,
            run,
            num_granules,
        } => format!(
            "handles[{index}] covers granules {} + {}, not a non-empty range below granule \
             {num_granules}",
            run.first_granule, run.num_granules
        ),
        BadRun::Overlapping {
            index,
            run,
            end_of_previous,
        } => format!(
            "handles[{index}] starts at granule {}, inside the handle before it (which ends at \
             {end_of_previous}): handles must be sorted and disjoint",
            run.first_granule
        ),
    }
}

/// Where an importer's fds come from: the owner, by pid (pidfd_getfd), or fds this process
/// already holds (received over a Unix socket, duplicated from the caller's): the registry's
/// first, then one per fd handle in order.
pub type LocalFds = Option<Vec<OwnedFd>>;

/// The fds of one import: the registry's, then one per fd handle (received fds must be exactly
/// those, or none at all where the description has no fd handle).
fn fd_source(description: &SharedDescription, fds: LocalFds) -> Result<FdSource> {
    let handle_fds: Vec<i32> = description
        .handles
        .iter()
        .filter_map(|h| match h.export {
            SharedExport::Fd { fd, .. } => Some(fd),
            SharedExport::Fabric(_) => None,
        })
        .collect();
    let registry = description.registry_fd.filter(|_| !handle_fds.is_empty());
    let numbers: Vec<i32> = registry.into_iter().chain(handle_fds).collect();
    FdSource::new(
        description.owner_pid,
        numbers,
        fds,
        "the description's registry's, then one per fd handle",
    )
}

impl ExtensibleTensor {
    /// Describes this tensor's memory for other processes, exporting (once, lazily) each
    /// handle not yet exported and recording its fd in the export registry. Needs the tensor
    /// created with export types (`Options::export_types`); an importer cannot share again.
    /// A tensor that maps borrowed handles is refused (`Error::LoanConflict`), before anything
    /// is exported: its importers would keep mapping the lender's memory after the give-back.
    /// Every handle described is never lent (`lend`), since importers may map it for as long
    /// as they like.
    pub fn share(&self) -> Result<SharedDescription> {
        let state = self.lock_owned("share imported memory (share from the owner)")?;
        let kind = self.export_kind()?;
        if let Some(mapping) = state.mappings.values().find(|m| m.handle().loan.is_some()) {
            let slot = mapping.handle().loan.as_ref().expect("found by its loan");
            return Err(Error::LoanConflict(format!(
                "cannot share: granules {} to {} are a handle borrowed from loan {} of tensor \
                 {:032x}, and importers would keep mapping the lender's memory after it is given \
                 back; give the loans back first (borrowed_bytes is {}), or share a tensor \
                 that borrows nothing",
                mapping.run.first_granule,
                mapping.run.end_granule() - 1,
                slot.loan_id,
                slot.tensor_id,
                state
                    .mappings
                    .values()
                    .filter(|m| m.handle().loan.is_some())
                    .map(Mapping::num_bytes)
                    .sum::<u64>()
            )));
        }
        let ctx = &self.inner.ctx;
        let owner_pid = std::process::id();
        let mut registry = relock(&ctx.registry);
        if kind == ExportTypes::POSIX_FD && registry.is_none() {
            let num_granules = self.inner.geometry.num_granules();
            *registry = Some(ExportRegistry::create(self.inner.tensor_id, num_granules)?);
        }
        let registry = registry.as_ref().filter(|_| kind == ExportTypes::POSIX_FD);
        let mut handles = Vec::with_capacity(state.mappings.len());
        for mapping in state.mappings.values() {
            let handle = mapping.handle();
            let export = match handle.export_once(kind)? {
                Exported::Fd(fd) => {
                    let fd = fd.as_raw_fd();
                    if let Some(registry) = registry {
                        registry.publish(mapping.run, handle.serial, fd)?;
                        handle
                            .published_at
                            .get_or_init(|| mapping.run.first_granule);
                    }
                    SharedExport::Fd { pid: owner_pid, fd }
                }
                Exported::Fabric(bytes) => SharedExport::Fabric(bytes.to_owned()),
            };
            handles.push(SharedHandle {
                run: mapping.run,
                serial: handle.serial,
                export,
            });
        }
        Ok(SharedDescription {
            device: self.device(),
            granularity: self.granularity(),
            segment_capacities: self.inner.geometry.segment_capacities().to_vec(),
            segment_bytes: state.segment_bytes.clone(),
            owner_pid,
            tensor_id: self.inner.tensor_id,
            registry_fd: registry.map(ExportRegistry::raw_fd),
            handles,
        })
    }

    /// The type `share` exports handles as: POSIX fd where asked for, else fabric.
    fn export_kind(&self) -> Result<ExportTypes> {
        let types = self.export_types();
        if types.contains(ExportTypes::POSIX_FD) {
            Ok(ExportTypes::POSIX_FD)
        } else if types.contains(ExportTypes::FABRIC) {
            Ok(ExportTypes::FABRIC)
        } else {
            Err(Error::Unsupported(
                "this tensor's memory is not exportable: create it with export handle types \
                 (export_handle_types='posix_fd' or 'fabric')"
                    .into(),
            ))
        }
    }

    /// The export types new handles are created with (the requested ones the driver offers).
    pub fn export_types(&self) -> ExportTypes {
        let ctx = &self.inner.ctx;
        ctx.export_types
            .intersection(ctx.driver.supported_export_types())
    }

    /// The memory `description` describes, mapped in this process at the same offsets of a
    /// reservation of its own, on `driver`'s device. All or nothing: a failure maps nothing and
    /// keeps no fd or handle. Views of the result keep the imported memory alive, whatever the
    /// owner does. `fds`, when given, are duplicates the caller made of fds it received.
    pub fn import(
        driver: Arc<dyn Driver>,
        description: &SharedDescription,
        fds: LocalFds,
    ) -> Result<ExtensibleTensor> {
        let geometry = description.validate()?;
        if geometry.granularity() % driver.granularity() != 0 {
            return Err(Error::invalid(format!(
                "the shared granularity {} is not a multiple of this device's {}",
                geometry.granularity(),
                driver.granularity()
            )));
        }
        let tensor = ExtensibleTensor::reserve(
            driver,
            geometry,
            HandlePolicy::WholeRuns, // never used: an importer does not grow
            ExportTypes::NONE,
            Some((description.owner_pid, description.tensor_id)),
        )?;
        // On error the tensor drops here: what was mapped unmaps, the reservation goes.
        let handles = tensor.import_handles(description, &description.handles, fds)?;
        let mut state = tensor.lock();
        for (run, handle) in handles {
            let mapping = Mapping::map(handle, run)?;
            state.mappings.insert(mapping);
            let (va, num_bytes) = tensor.inner.ctx.span(run);
            tensor.inner.ctx.driver.set_access(va, num_bytes)?;
        }
        state.segment_bytes.clone_from(&description.segment_bytes);
        debug_assert_eq!(super::check_state(&tensor.inner, &state), Ok(()));
        drop(state);
        Ok(tensor)
    }

    /// Follows the owner: maps the handles of `description` this importer lacks and unmaps
    /// (after the fence) those the owner no longer has; the committed sizes become the
    /// description's. All or nothing. A description of another tensor is refused.
    pub fn refresh(&self, description: &SharedDescription, fds: LocalFds) -> Result<()> {
        let mut state = self.lock_open()?;
        let Some(owner_pid) = self.inner.imported_from else {
            return Err(Error::Unsupported(
                "refresh is for tensors imported with from_shared; this one owns its memory".into(),
            ));
        };
        let geometry = description.validate()?;
        if description.tensor_id != self.inner.tensor_id {
            return Err(Error::invalid(format!(
                "this description is of another tensor ({:032x} of process {}): this one maps \
                 tensor {:032x} of process {owner_pid}",
                description.tensor_id, description.owner_pid, self.inner.tensor_id
            )));
        }
        if geometry != self.inner.geometry || description.owner_pid != owner_pid {
            return Err(Error::invalid(format!(
                "invalid shared description: tensor {:032x} is process {owner_pid}'s with {} \
                 segments, not process {}'s with {}",
                self.inner.tensor_id,
                self.inner.geometry.num_segments(),
                description.owner_pid,
                description.segment_capacities.len()
            )));
        }
        let held: BTreeMap<u64, Run> = state
            .mappings
            .values()
            .map(|m| (m.handle().serial, m.run))
            .collect();
        let wanted: BTreeMap<u64, Run> = description
            .handles
            .iter()
            .map(|h| (h.serial, h.run))
            .collect();
        if let Some((serial, run)) = held
            .iter()
            .find(|(serial, run)| wanted.get(serial).is_some_and(|r| r != *run))
        {
            return Err(Error::invalid(format!(
                "invalid shared description: handle {serial} moved from granule {}",
                run.first_granule
            )));
        }
        let mut gone: Vec<Run> = held
            .iter()
            .filter(|(serial, _)| !wanted.contains_key(serial))
            .map(|(_, run)| *run)
            .collect();
        let new: Vec<SharedHandle> = description
            .handles
            .iter()
            .filter(|h| !held.contains_key(&h.serial))
            .cloned()
            .collect();
        gone.sort_unstable();
        let handles = self.import_handles(description, &new, fds)?;
        if !gone.is_empty() || !handles.is_empty() {
            // Work on any stream may still read the handles that went: wait for the device.
            self.inner.ctx.driver.synchronize()?;
            self.swap_in(&mut state, &gone, handles)?;
        }
        state.segment_bytes.clone_from(&description.segment_bytes);
        debug_assert_eq!(super::check_state(&self.inner, &state), Ok(()));
        Ok(())
    }

    /// Imports `shared` handles of `description` into this tensor's driver (not mapped yet),
    /// each fd checked against the owner's registry first: all are the described handles'.
    fn import_handles(
        &self,
        description: &SharedDescription,
        shared: &[SharedHandle],
        fds: LocalFds,
    ) -> Result<Vec<(Run, PhysicalHandle)>> {
        let ctx = &self.inner.ctx;
        let (_, taken) = description.checked_fds(shared, fds)?;
        let mut handles = Vec::with_capacity(shared.len());
        for (wanted, fd) in shared.iter().zip(taken) {
            let num_bytes = ctx.span(wanted.run).1;
            let source = match (&wanted.export, &fd) {
                (_, Some(fd)) => ImportSource::Fd(fd.as_fd()),
                (SharedExport::Fabric(bytes), None) => ImportSource::Fabric(bytes),
                (SharedExport::Fd { .. }, None) => unreachable!("checked_fds takes every fd"),
            };
            let id = ctx.driver.import(source, num_bytes)?;
            handles.push((wanted.run, PhysicalHandle::adopt(ctx, id, wanted.serial)));
        }
        Ok(handles)
    }

    /// The pid of the process whose memory this tensor maps, if it was imported.
    pub fn imported_from(&self) -> Option<u32> {
        self.inner.imported_from
    }
}

impl SharedDescription {
    /// The fds this (the owner) process holds for the description, checked current: the
    /// registry's, then one per fd handle, as `send_shared` passes them on.
    pub fn owner_fds(&self) -> Result<Vec<OwnedFd>> {
        self.validate()?;
        if self.owner_pid != std::process::id() {
            return Err(Error::invalid(format!(
                "only the owner process ({}) can pass on its fds, not {}",
                self.owner_pid,
                std::process::id()
            )));
        }
        let (registry, fds) = self.checked_fds(&self.handles, None)?;
        Ok(registry
            .into_iter()
            .chain(fds.into_iter().flatten())
            .collect())
    }

    /// The registry's fd and one fd per fd handle of `shared` (`None` for fabric ones), taken
    /// from `fds` or from the owner, each checked against the registry after it was taken:
    /// the owner clears a handle's word before closing its fd, so a word that still names the
    /// handle's serial and fd number proves the fd taken was the handle's.
    fn checked_fds(
        &self,
        shared: &[SharedHandle],
        fds: LocalFds,
    ) -> Result<(Option<OwnedFd>, Vec<Option<OwnedFd>>)> {
        // Received fds are checked even when none is needed: they must be what they claim.
        let received = matches!(&fds, Some(fds) if !fds.is_empty());
        let wants_fds = received
            || shared
                .iter()
                .any(|h| matches!(h.export, SharedExport::Fd { .. }));
        let mut source = fd_source(self, fds)?;
        let Some(registry_fd) = self.registry_fd.filter(|_| wants_fds) else {
            return Ok((None, shared.iter().map(|_| None).collect()));
        };
        let registry_file = source.take(registry_fd)?;
        let registry = RegistryView::open(
            registry_file
                .try_clone()
                .map_err(|e| ipc::stale(format!("duplicating the registry fd: {e}")))?,
            self.tensor_id,
        )?;
        let mut taken = Vec::with_capacity(shared.len());
        for wanted in shared {
            let SharedExport::Fd { fd, .. } = wanted.export else {
                taken.push(None);
                continue;
            };
            let owned = source.take(fd)?;
            if !registry.is_live(wanted.run, wanted.serial, fd) {
                return Err(ipc::stale(format!(
                    "the owner holds no handle {} over granules {} to {} exported as fd {fd} \
                     (it released it, or the description was altered)",
                    wanted.serial,
                    wanted.run.first_granule,
                    wanted.run.end_granule() - 1
                )));
            }
            taken.push(Some(owned));
        }
        Ok((Some(registry_file), taken))
    }
}
