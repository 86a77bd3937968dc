//! Sharing a tensor's memory with other processes.
//!
//! The owner describes its memory (`share`): the geometry, the committed bytes, and per mapped
//! handle its granule run, a serial number and how to get it (the owner's pid and the number
//! of an fd it keeps open, or a fabric handle). Each handle is exported once, lazily, and the
//! export kept for the handle's life (an export costs ~0.6 ms on CUDA: few, large handles
//! make sharing cheap). Another process builds its own reservation of the same geometry and
//! maps the same handles at the same offsets (`import`); `refresh` follows the owner's later
//! grows and shrinks by serial number. An importer never grows, shrinks or frees the owner's
//! memory; what it maps lives on, whatever the owner does, until the importer lets go.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;

use super::{ExtensibleTensor, Mapping, PhysicalHandle};
use crate::driver::{ipc, DeviceKind, Driver, ExportTypes, Exported, ImportSource};
use crate::error::{Error, Result};
use crate::plan::{self, Geometry, HandlePolicy, Run};

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
    /// Sorted by run, disjoint, covering every granule a committed byte needs.
    pub handles: Vec<SharedHandle>,
}

impl SharedDescription {
    /// The geometry the description states, checked: valid capacities, committed bytes within
    /// them, handle runs sorted, disjoint, inside the reservation and covering every committed
    /// byte, serials unique. A description that fails this was tampered with or mixed up.
    fn geometry(&self) -> Result<Geometry> {
        let tampered = |why: String| Error::invalid(format!("invalid shared description: {why}"));
        let geometry = Geometry::new(self.segment_capacities.clone(), self.granularity)
            .map_err(|e| tampered(e.to_string()))?;
        geometry
            .check_request(&self.segment_bytes)
            .map_err(|e| tampered(e.to_string()))?;
        let runs: Vec<Run> = self.handles.iter().map(|h| h.run).collect();
        plan::check_runs(&runs, geometry.num_granules()).map_err(tampered)?;
        let missing = plan::subtract(&geometry.needed_runs(&self.segment_bytes), &runs);
        if !missing.is_empty() {
            return Err(tampered(format!(
                "committed granules {missing:?} are in no handle"
            )));
        }
        let mut serials: Vec<u64> = self.handles.iter().map(|h| h.serial).collect();
        serials.sort_unstable();
        if serials.windows(2).any(|w| w[0] == w[1]) {
            return Err(tampered("two handles share a serial".into()));
        }
        Ok(geometry)
    }
}

/// Where an importer's fds come from: the owner, by pid (pidfd_getfd), or fds this process
/// already holds (received over a Unix socket), one per fd handle in order, consumed.
pub type LocalFds = Option<Vec<OwnedFd>>;

impl ExtensibleTensor {
    /// Describes this tensor's memory for other processes, exporting (once, lazily) each
    /// handle not yet exported. Needs the tensor created with export types
    /// (`Options::export_types`); an importer cannot share again.
    pub fn share(&self) -> Result<SharedDescription> {
        let state = self.lock_owned("share imported memory (share from the owner)")?;
        let kind = self.export_kind()?;
        let owner_pid = std::process::id();
        let mut handles = Vec::with_capacity(state.mappings.len());
        for mapping in state.mappings.values() {
            let handle = mapping.handle();
            let exported = match handle.exported.get() {
                Some(exported) => exported,
                None => {
                    let exported = self.inner.ctx.driver.export(handle.id, kind)?;
                    handle.exported.get_or_init(|| exported)
                }
            };
            let export = match exported {
                Exported::Fd(fd) => SharedExport::Fd {
                    pid: owner_pid,
                    fd: fd.as_raw_fd(),
                },
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
    /// owner does.
    pub fn import(
        driver: Arc<dyn Driver>,
        description: &SharedDescription,
        fds: LocalFds,
    ) -> Result<ExtensibleTensor> {
        let geometry = description.geometry()?;
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
            Some(description.owner_pid),
        )?;
        // On error the tensor drops here: what was mapped unmaps, the reservation goes.
        let handles = tensor.import_handles(&description.handles, fds)?;
        let mut state = tensor.lock();
        for (run, handle) in handles {
            let mapping = Mapping::map(handle, run)?;
            state.mappings.insert(run.first_granule, mapping);
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
    /// description's. All or nothing.
    pub fn refresh(&self, description: &SharedDescription, fds: LocalFds) -> Result<()> {
        let mut state = self.lock_open()?;
        let Some(owner_pid) = self.inner.imported_from else {
            return Err(Error::Unsupported(
                "refresh is for tensors imported with from_shared; this one owns its memory".into(),
            ));
        };
        let geometry = description.geometry()?;
        if geometry != self.inner.geometry || description.owner_pid != owner_pid {
            return Err(Error::invalid(format!(
                "this description is of another tensor (owner {}, {} segments): this one \
                 maps process {owner_pid}'s",
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
                "invalid shared description: handle {serial} moved from {run:?}"
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
        let handles = self.import_handles(&new, fds)?;
        if !gone.is_empty() || !handles.is_empty() {
            self.replace(&mut state, &gone, handles)?;
        }
        state.segment_bytes.clone_from(&description.segment_bytes);
        debug_assert_eq!(super::check_state(&self.inner, &state), Ok(()));
        Ok(())
    }

    /// Imports `shared` handles into this tensor's driver (not mapped yet).
    fn import_handles(
        &self,
        shared: &[SharedHandle],
        fds: LocalFds,
    ) -> Result<Vec<(Run, PhysicalHandle)>> {
        let ctx = &self.inner.ctx;
        let mut local = fds.map(Vec::into_iter);
        let mut handles = Vec::with_capacity(shared.len());
        for wanted in shared {
            let num_bytes = ctx.span(wanted.run).1;
            let id = match &wanted.export {
                SharedExport::Fd { pid, fd } => {
                    let owned = match local.as_mut() {
                        Some(fds) => fds.next().ok_or_else(|| {
                            Error::invalid("fewer received fds than fd handles in the description")
                        })?,
                        None => ipc::fd_of_process(*pid as i32, *fd)?,
                    };
                    ctx.driver
                        .import(ImportSource::Fd(owned.as_fd()), num_bytes)?
                }
                SharedExport::Fabric(bytes) => {
                    ctx.driver.import(ImportSource::Fabric(bytes), num_bytes)?
                }
            };
            handles.push((wanted.run, PhysicalHandle::adopt(ctx, id, wanted.serial)));
        }
        Ok(handles)
    }

    /// The pid of the process whose memory this tensor maps, if it was imported.
    pub fn imported_from(&self) -> Option<u32> {
        self.inner.imported_from
    }
}
