//! Builder placements on storage the layout owns (see [`super::StorageKind`]): system memory,
//! pinned host memory, a file on disk. Each build sizes the memory to the layout's extent.
//!
//! ```
//! use elastic_vmm::layout::{LayoutBuilder, LayoutConfig, StorageKind};
//! # fn main() -> elastic_vmm::Result<()> {
//! let config = LayoutConfig::new(16, 4, 2, 16, 128, 2);
//! let host = LayoutBuilder::new().config(config).fully_contiguous().system().build()?;
//! let disk = LayoutBuilder::new().config(config).fully_contiguous().disk_temp(std::env::temp_dir()).build()?;
//! assert_eq!((host.storage(), disk.storage()), (StorageKind::System, StorageKind::Disk));
//! # Ok(()) }
//! ```

use std::path::PathBuf;

use super::builder::LayoutBuilder;
use super::mapped::{Layout, LayoutMemory};
use super::storage::{DiskFile, HostBuffer, StorageKind};
use super::view::LayoutViews;
use super::LayoutConfig;
use super::LayoutKind;
use crate::backend::MemoryKind;
use crate::error::{Error, Result};
use crate::pool::Pool;

/// Builder memory: ordinary host memory the layout owns.
#[derive(Debug)]
pub struct SystemMemory;

/// Builder memory: page-locked host memory the layout owns, for moves to and from `pool`.
#[derive(Debug, Clone, Copy)]
pub struct PinnedMemory<'a> {
    pool: &'a Pool,
    numa_aware: bool,
}

/// Builder memory: a file the layout owns (a path, or a temporary file in a directory).
#[derive(Debug)]
pub struct DiskStorage {
    path: PathBuf,
    temporary: bool,
}

impl LayoutBuilder<LayoutConfig, LayoutKind, super::NoMemory> {
    /// Place the layout in ordinary (pageable, zeroed) host memory of its own
    /// ([`StorageKind::System`]).
    pub fn system(self) -> LayoutBuilder<LayoutConfig, LayoutKind, SystemMemory> {
        self.with(SystemMemory)
    }

    /// Place the layout in page-locked host memory of its own ([`StorageKind::Pinned`]), pinned
    /// for moves to and from `pool`'s memory: with a device pool, the backend's staging memory
    /// (CUDA: `cuMemHostAlloc`), which the device copies at link speed; with a host pool,
    /// `mmap` + `mlock`, bound to the building CPU's NUMA node first when `numa_aware` and the
    /// machine has more than one node ([`Layout::numa_node`] says which).
    pub fn pinned(
        self,
        pool: &Pool,
        numa_aware: bool,
    ) -> LayoutBuilder<LayoutConfig, LayoutKind, PinnedMemory<'_>> {
        self.with(PinnedMemory { pool, numa_aware })
    }

    /// Place the layout in the file at `path` ([`StorageKind::Disk`]): created and given the
    /// layout's extent on disk (`posix_fallocate`) when it does not exist; an existing file must
    /// hold at least the extent ([`Error::FileTooSmall`] otherwise) and keeps its contents.
    /// The file stays when the layout goes.
    pub fn disk(
        self,
        path: impl Into<PathBuf>,
    ) -> LayoutBuilder<LayoutConfig, LayoutKind, DiskStorage> {
        self.with(DiskStorage {
            path: path.into(),
            temporary: false,
        })
    }

    /// Place the layout in a temporary file in `dir`, removed from the directory at once and
    /// gone with the layout.
    pub fn disk_temp(
        self,
        dir: impl Into<PathBuf>,
    ) -> LayoutBuilder<LayoutConfig, LayoutKind, DiskStorage> {
        self.with(DiskStorage {
            path: dir.into(),
            temporary: true,
        })
    }
}

fn extent(b: &super::LayoutGeometry) -> Result<usize> {
    usize::try_from(b.extent()).map_err(|_| Error::SizeOverflow {
        what: "layout extent",
        detail: format!("{} bytes", b.extent()),
    })
}

/// Views over one range starting at `base` (an address, or offset 0 of a file).
fn views(geometry: super::LayoutGeometry, base: u64, storage: StorageKind) -> Result<LayoutViews> {
    let bases = (0..geometry.num_regions())
        .map(|r| {
            base.checked_add(geometry.region_offset(r))
                .ok_or_else(|| Error::SizeOverflow {
                    what: "layout region address",
                    detail: format!("{base:#x} + {}", geometry.region_offset(r)),
                })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(LayoutViews::new(geometry, bases, MemoryKind::Host, None).with_storage(storage))
}

impl LayoutBuilder<LayoutConfig, LayoutKind, SystemMemory> {
    /// Validate, allocate and carve.
    pub fn build(self) -> Result<Layout> {
        let geometry = self.geometry()?;
        let buf = HostBuffer::system(extent(&geometry)?)?;
        let views = views(geometry, buf.addr, StorageKind::System)?;
        tracing::debug!(kind = %geometry.kind(), addr = buf.addr, bytes = buf.len, "layout in system memory");
        Ok(Layout::new(views, LayoutMemory::Host(buf)))
    }
}

impl LayoutBuilder<LayoutConfig, LayoutKind, PinnedMemory<'_>> {
    /// Validate, allocate, pin and carve.
    pub fn build(self) -> Result<Layout> {
        let geometry = self.geometry()?;
        let bytes = extent(&geometry)?;
        let PinnedMemory { pool, numa_aware } = *self.memory();
        let buf = match pool.backend_info().memory_kind {
            MemoryKind::Device => HostBuffer::staging(pool.backend(), bytes)?,
            MemoryKind::Host => HostBuffer::locked(bytes, numa_aware)?,
        };
        let views = views(geometry, buf.addr, StorageKind::Pinned)?;
        tracing::debug!(kind = %geometry.kind(), addr = buf.addr, bytes, numa = ?buf.numa_node, "layout in pinned memory");
        Ok(Layout::new(views, LayoutMemory::Host(buf)))
    }
}

impl LayoutBuilder<LayoutConfig, LayoutKind, DiskStorage> {
    /// Validate, create (or open) the file and size it.
    pub fn build(self) -> Result<Layout> {
        let geometry = self.geometry()?;
        let DiskStorage { path, temporary } = self.memory();
        let file = if *temporary {
            DiskFile::temp(path, geometry.extent())?
        } else {
            DiskFile::at(path, geometry.extent())?
        };
        let views = views(geometry, 0, StorageKind::Disk)?.with_file(file.fd());
        tracing::debug!(kind = %geometry.kind(), file = %file.describe(), bytes = geometry.extent(), direct = file.direct.is_some(), "layout on disk");
        Ok(Layout::new(views, LayoutMemory::Disk(file)))
    }
}
