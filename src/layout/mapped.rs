//! A layout over memory that is mapped for the layout's whole life: a pool allocation, a pool
//! region mapped in full, or regions the caller supplies (and keeps alive).

use std::fmt;
use std::ops::Deref;

use super::storage::{DiskFile, HostBuffer, StorageKind};
use super::view::{LayoutViews, MemoryView};
use crate::backend::MemoryKind;
use crate::error::{Error, Result};
use crate::pool::{Allocation, Pool, Region};

/// Memory the caller owns and describes: `len` bytes at `addr` of one kind.
///
/// The layout does not own it: the caller keeps it valid (mapped, with access) for as long as
/// the layout, and any NIXL registration of the layout, lives; hence
/// [`crate::layout::LayoutBuilder::regions`] is `unsafe`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRange {
    /// Address of the first byte (512-byte aligned).
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// Host or device memory.
    pub kind: MemoryKind,
    /// The device ordinal for device memory; `None` for host memory.
    pub device: Option<i32>,
}

/// What a [`Layout`] lies in.
pub(crate) enum LayoutMemory {
    /// One allocation of a pool (the pool is kept to list the chunks under it); the layout
    /// starts at `start`, the allocation's first 512-byte aligned address.
    Allocation {
        alloc: Allocation,
        pool: Pool,
        start: u64,
    },
    /// A region of a pool, mapped in full.
    Region(Region),
    /// Caller-owned ranges, one per layout region.
    Caller(Vec<MemoryRange>),
    /// Host memory the layout owns (system or pinned).
    Host(HostBuffer),
    /// A file the layout owns (views are offsets in it).
    Disk(DiskFile),
}

/// A KV-cache layout over mapped memory; see the module documentation. Dereferences to its
/// [`LayoutViews`]. Dropping it gives pool memory back (caller memory stays the caller's).
pub struct Layout {
    views: LayoutViews,
    memory: LayoutMemory,
}

impl Layout {
    pub(crate) fn new(views: LayoutViews, memory: LayoutMemory) -> Self {
        Layout { views, memory }
    }

    /// Where everything lies.
    pub fn views(&self) -> &LayoutViews {
        &self.views
    }

    /// The pool the memory comes from, if it does.
    pub fn pool(&self) -> Option<&Pool> {
        match &self.memory {
            LayoutMemory::Allocation { pool, .. } => Some(pool),
            LayoutMemory::Region(r) => Some(r.pool()),
            LayoutMemory::Caller(_) | LayoutMemory::Host(_) | LayoutMemory::Disk(_) => None,
        }
    }

    /// Where the bytes live (see [`StorageKind`]).
    pub fn storage(&self) -> StorageKind {
        self.views.storage()
    }

    /// The NUMA node the layout's pinned host memory was bound to, where it was.
    pub fn numa_node(&self) -> Option<u32> {
        match &self.memory {
            LayoutMemory::Host(b) => b.numa_node,
            _ => None,
        }
    }

    /// The file of a [`StorageKind::Disk`] layout: its path (`None` for a temporary file)
    /// and its descriptor.
    pub fn file(&self) -> Option<(Option<&std::path::Path>, i32)> {
        match &self.memory {
            LayoutMemory::Disk(f) => Some((f.path.as_deref(), f.fd())),
            _ => None,
        }
    }

    pub(crate) fn memory(&self) -> &LayoutMemory {
        &self.memory
    }

    /// The memory under the layout split at physical chunk boundaries, in address order: what
    /// NIXL must register one by one (UCX exports only the first chunk of a range backed by
    /// several). Pool memory is cut where its chunks are and to the layout's own bytes; each
    /// caller range counts as one chunk.
    pub fn chunks(&self) -> Vec<MemoryView> {
        let clip = |base: u64, start: u64, len: u64, spans: Vec<crate::ChunkSpan>| {
            let end = start + len;
            spans
                .into_iter()
                .filter_map(|c| {
                    let s = c.offset.max(start);
                    let e = (c.offset + c.size).min(end);
                    (s < e).then_some(MemoryView {
                        addr: base + s,
                        len: e - s,
                    })
                })
                .collect::<Vec<_>>()
        };
        let extent = self.views.geometry().extent();
        match &self.memory {
            LayoutMemory::Allocation { alloc, pool, start } => clip(
                pool.base(),
                start - pool.base(),
                extent,
                pool.chunks_in(alloc.offset(), alloc.footprint()),
            ),
            LayoutMemory::Region(r) => clip(r.addr(), 0, extent, r.chunks_in(0, r.len())),
            LayoutMemory::Caller(ranges) => ranges
                .iter()
                .map(|r| MemoryView {
                    addr: r.addr,
                    len: r.len,
                })
                .collect(),
            LayoutMemory::Host(b) => vec![MemoryView {
                addr: b.addr,
                len: extent,
            }],
            LayoutMemory::Disk(_) => vec![MemoryView {
                addr: 0,
                len: extent,
            }],
        }
    }

    /// Check `[addr, addr + len)` lies in one region of the layout and return the pool memory
    /// to copy through.
    fn pool_span(&self, addr: u64, len: u64) -> Result<&Pool> {
        if self.views.locate(addr, len).is_none() {
            return Err(Error::InvalidLayout(format!(
                "[{addr:#x}, +{len}) does not lie in one region of the layout ({} regions of {} bytes)",
                self.views.regions().len(),
                self.views.geometry().region_bytes()
            )));
        }
        self.pool().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the layout lies in {} memory that is not a pool's: copy through the caller's own API or copy_blocks",
                self.storage().name()
            ))
        })
    }

    /// Copy `data` to `addr` (inside one region of the layout; host-to-device on CUDA).
    ///
    /// # Safety
    /// Nobody else (a kernel, a transfer, another thread) may use these bytes meanwhile.
    pub unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        let pool = self.pool_span(addr, data.len() as u64)?;
        // SAFETY: the bytes lie in the layout's pool memory, mapped with access for as long as
        // the layout lives (checked above); exclusive use is the caller's promise.
        unsafe { pool.backend().copies().write(addr, data) }
    }

    /// Copy the bytes at `addr` (inside one region of the layout) into `out`.
    ///
    /// # Safety
    /// Nobody may write these bytes meanwhile.
    pub unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        let pool = self.pool_span(addr, out.len() as u64)?;
        // SAFETY: as in `write`; no writer is the caller's promise.
        unsafe { pool.backend().copies().read(addr, out) }
    }
}

impl Deref for Layout {
    type Target = LayoutViews;

    fn deref(&self) -> &LayoutViews {
        &self.views
    }
}

impl fmt::Debug for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let memory = match &self.memory {
            LayoutMemory::Allocation { .. } => "pool allocation",
            LayoutMemory::Region(_) => "pool region",
            LayoutMemory::Caller(_) => "caller memory",
            LayoutMemory::Host(_) => "host memory of its own",
            LayoutMemory::Disk(_) => "a file",
        };
        f.debug_struct("Layout")
            .field("kind", &self.views.kind())
            .field("config", self.views.config())
            .field("memory", &memory)
            .field("storage", &self.views.storage())
            .field("regions", &self.views.regions())
            .finish()
    }
}
