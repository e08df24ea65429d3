//! A typed builder: config, then kind, then memory, then build. Each step is a different type,
//! so a layout without a config, a kind or memory does not compile.
//!
//! ```
//! use elastic_vmm::layout::{BlockDim, LayoutBuilder, LayoutConfig};
//! use elastic_vmm::{MemOptions, Pool};
//! # fn main() -> elastic_vmm::Result<()> {
//! let pool = Pool::host(1 << 30)?;
//! let config = LayoutConfig::new(16, 4, 2, 16, 128, 2); // blocks, layers, K/V, tokens, inner, bf16
//! let kv = LayoutBuilder::new()
//!     .config(config)
//!     .layer_separate(BlockDim::First)
//!     .allocate(&pool, &MemOptions::new())
//!     .build()?;
//! let k = kv.unit(3, 1, 0)?; // block 3, layer 1, K: an offset view of the allocation
//! assert_eq!(k.len, 16 * 128 * 2);
//! # Ok(()) }
//! ```

use std::sync::Arc;

use super::elastic::ElasticLayout;
use super::geometry::LayoutGeometry;
use super::kind::{BlockDim, LayoutKind};
use super::mapped::{Layout, LayoutMemory, MemoryRange};
use super::storage::StorageKind;
use super::view::LayoutViews;
use super::{LayoutConfig, REGION_ALIGNMENT};
use crate::backend::{Backend, MemoryKind};
use crate::backing::{BlockBacking, MappingHook};
use crate::error::{round_up, Error, Result};
use crate::pool::{MemOptions, Pool, Space};
use crate::tag::Tag;

/// Builder state: no config yet.
#[derive(Debug, Default)]
pub struct NoConfig;
/// Builder state: no kind yet.
#[derive(Debug, Default)]
pub struct NoKind;
/// Builder state: no memory yet.
#[derive(Debug, Default)]
pub struct NoMemory;

/// Builder memory: one allocation of a pool.
#[derive(Debug)]
pub struct PoolAllocation<'a> {
    pool: &'a Pool,
    opts: MemOptions,
}

/// Builder memory: a region of a pool, mapped in full.
#[derive(Debug)]
pub struct PoolRegion<'a> {
    pool: &'a Pool,
    opts: MemOptions,
}

/// Builder memory: ranges the caller supplies, one per layout region, and the backend that
/// checks their declared kind, if one does ([`LayoutBuilder::checked_by`]).
#[derive(Debug)]
pub struct CallerRegions(Vec<MemoryRange>, Option<Arc<dyn Backend>>);

/// Builder memory: a region of a pool backed block by block on demand.
pub struct ElasticRegion<'a> {
    pool: &'a Pool,
    opts: MemOptions,
    hook: Option<Arc<dyn MappingHook>>,
}

/// The typed layout builder; see the module documentation.
#[derive(Debug, Default)]
pub struct LayoutBuilder<C = NoConfig, K = NoKind, M = NoMemory> {
    config: C,
    kind: K,
    memory: M,
}

impl LayoutBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        LayoutBuilder::default()
    }

    /// The dimensions (validated at build).
    pub fn config(self, config: LayoutConfig) -> LayoutBuilder<LayoutConfig, NoKind, NoMemory> {
        LayoutBuilder {
            config,
            kind: NoKind,
            memory: NoMemory,
        }
    }
}

impl LayoutBuilder<LayoutConfig, NoKind, NoMemory> {
    /// The order of the dimensions.
    pub fn kind(self, kind: LayoutKind) -> LayoutBuilder<LayoutConfig, LayoutKind, NoMemory> {
        LayoutBuilder {
            config: self.config,
            kind,
            memory: NoMemory,
        }
    }

    /// One region, `[block][layer][outer][page][inner]`.
    pub fn fully_contiguous(self) -> LayoutBuilder<LayoutConfig, LayoutKind, NoMemory> {
        self.kind(LayoutKind::FullyContiguous)
    }

    /// One region per layer, the block dimension first or second.
    pub fn layer_separate(
        self,
        block_dim: BlockDim,
    ) -> LayoutBuilder<LayoutConfig, LayoutKind, NoMemory> {
        self.kind(LayoutKind::LayerSeparate(block_dim))
    }
}

impl LayoutBuilder<LayoutConfig, LayoutKind, NoMemory> {
    pub(super) fn with<M>(self, memory: M) -> LayoutBuilder<LayoutConfig, LayoutKind, M> {
        LayoutBuilder {
            config: self.config,
            kind: self.kind,
            memory,
        }
    }

    /// Place the layout in one allocation of `pool` (regions carved out of it at 512-byte
    /// aligned offsets). Its memory may share physical chunks with other allocations.
    /// [`MemOptions`] as for [`Pool::allocate_with`], except that the tag defaults to
    /// [`Tag::Kv`] and the name to `kv-layout`.
    pub fn allocate<'a>(
        self,
        pool: &'a Pool,
        opts: &MemOptions,
    ) -> LayoutBuilder<LayoutConfig, LayoutKind, PoolAllocation<'a>> {
        let opts = opts.clone();
        self.with(PoolAllocation { pool, opts })
    }

    /// Place the layout in a region of `pool` of its own, mapped in full: its chunks hold
    /// nothing else. [`MemOptions`]: `tag` (default [`Tag::Kv`]), `chunk` (default the pool's
    /// largest chunk, 1 GiB; each chunk is one NIXL registration), `zeroed`; `name` is refused.
    pub fn map_region<'a>(
        self,
        pool: &'a Pool,
        opts: &MemOptions,
    ) -> LayoutBuilder<LayoutConfig, LayoutKind, PoolRegion<'a>> {
        let opts = opts.clone();
        self.with(PoolRegion { pool, opts })
    }

    /// Place the layout in memory the caller owns: one range per layout region (1 for fully
    /// contiguous, `num_layers` for layer separate), each 512-byte aligned, large enough, all
    /// of one storage kind: the same memory kind and device (a device ordinal, at least 0, for
    /// device memory; none for host memory). `build` checks all of that.
    ///
    /// # Safety
    /// Each range must be memory of the kind and device it names, mapped with access, and stay
    /// so for as long as the layout and anything made of it lives (a NIXL registration through
    /// `NixlAgent::register`, and any transfer over it until NIXL reports it finished, after a
    /// timeout included): NIXL and the layout's users read and write it without further checks.
    pub unsafe fn regions(
        self,
        ranges: Vec<MemoryRange>,
    ) -> LayoutBuilder<LayoutConfig, LayoutKind, CallerRegions> {
        self.with(CallerRegions(ranges, None))
    }

    /// Lay the layout out over a region of `pool` with no physical memory yet: blocks are
    /// backed with [`ElasticLayout::ensure_backed`]. [`MemOptions`] as for
    /// [`BlockBacking::reserve`]: `chunk` is the page size (default: the granularity; each page
    /// is whole physical chunks of its own, one NIXL registration per chunk, so it can be
    /// unmapped alone), `tag` defaults to [`Tag::Kv`].
    pub fn elastic<'a>(
        self,
        pool: &'a Pool,
        opts: &MemOptions,
    ) -> LayoutBuilder<LayoutConfig, LayoutKind, ElasticRegion<'a>> {
        let opts = opts.clone();
        self.with(ElasticRegion {
            pool,
            opts,
            hook: None,
        })
    }
}

impl<M> LayoutBuilder<LayoutConfig, LayoutKind, M> {
    pub(super) fn geometry(&self) -> Result<LayoutGeometry> {
        LayoutGeometry::new(self.config, self.kind)
    }

    pub(super) fn memory(&self) -> &M {
        &self.memory
    }
}

/// The views of `geometry` carved out of one range starting at `base`.
fn carved(geometry: LayoutGeometry, base: u64, pool: &Pool) -> LayoutViews {
    let info = pool.backend_info();
    let bases = (0..geometry.num_regions())
        .map(|r| base + geometry.region_offset(r))
        .collect();
    LayoutViews::new(geometry, bases, info.memory_kind, info.device_ordinal)
        .with_storage(StorageKind::of_backend(info))
}

fn extent_usize(geometry: &LayoutGeometry, pad: u64) -> Result<usize> {
    geometry
        .extent()
        .checked_add(pad)
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| Error::SizeOverflow {
            what: "layout allocation",
            detail: format!("{} + {pad} bytes", geometry.extent()),
        })
}

impl LayoutBuilder<LayoutConfig, LayoutKind, PoolAllocation<'_>> {
    /// Validate, allocate and carve.
    pub fn build(self) -> Result<Layout> {
        let geometry = self.geometry()?;
        let PoolAllocation { pool, opts } = self.memory;
        let mut opts = opts.clone().tag(opts.tag_or(Tag::Kv));
        if opts.name.is_none() {
            opts = opts.name("kv-layout");
        }
        let bytes = extent_usize(&geometry, 0)?;
        let mut alloc = pool.allocate_with(bytes, &opts)?;
        if alloc.addr() % REGION_ALIGNMENT != 0 {
            // A pool configured with a smaller alignment: ask for room to align the start.
            drop(alloc);
            let bytes = extent_usize(&geometry, REGION_ALIGNMENT - 1)?;
            alloc = pool.allocate_with(bytes, &opts)?;
        }
        let start = alloc.addr().next_multiple_of(REGION_ALIGNMENT);
        let views = carved(geometry, start, pool);
        tracing::debug!(kind = %geometry.kind(), start, bytes = geometry.extent(), "layout allocated");
        Ok(Layout::new(
            views,
            LayoutMemory::Allocation {
                alloc,
                pool: pool.clone(),
                start,
            },
        ))
    }
}

impl LayoutBuilder<LayoutConfig, LayoutKind, PoolRegion<'_>> {
    /// Validate, reserve a region, map it and carve. On failure nothing stays mapped.
    pub fn build(self) -> Result<Layout> {
        let geometry = self.geometry()?;
        let PoolRegion { pool, opts } = self.memory;
        opts.refuse("LayoutBuilder::map_region", &["name"])?;
        let chunk = match opts.chunk_checked(pool.granularity())? {
            Some(c) => c,
            None => round_up(
                "default layout chunk",
                crate::DEFAULT_MAX_CHUNK as u64,
                pool.granularity(),
            )?,
        };
        let reserve = MemOptions::new().tag(opts.tag_or(Tag::Kv)).chunk(chunk);
        let region = pool.reserve_region_with(geometry.extent(), &reserve)?;
        // A failed map leaves nothing mapped; dropping the region returns its address space.
        region.map(0, region.len())?;
        if opts.zeroed {
            let inner = pool.inner();
            inner.zero_mapped(region.offset(), region.len(), Space::Region)?;
        }
        let views = carved(geometry, region.addr(), pool);
        tracing::debug!(kind = %geometry.kind(), addr = region.addr(), bytes = region.len(), chunk, "layout region mapped");
        Ok(Layout::new(views, LayoutMemory::Region(region)))
    }
}

impl LayoutBuilder<LayoutConfig, LayoutKind, CallerRegions> {
    /// Check every range's declared kind and device with `backend` at build, where its driver
    /// can tell ([`Backend::pointer_kind`]: on CUDA device memory declared as host memory, or
    /// host memory declared as device memory, is refused; on the host backend anything
    /// declared as device memory is).
    pub fn checked_by(mut self, backend: Arc<dyn Backend>) -> Self {
        self.memory.1 = Some(backend);
        self
    }

    /// Validate the config and the ranges, and place the regions in them.
    pub fn build(self) -> Result<Layout> {
        let geometry = self.geometry()?;
        let CallerRegions(ranges, checker) = self.memory;
        let need = geometry.num_regions();
        if ranges.len() != need {
            return Err(Error::InvalidLayout(format!(
                "{} regions supplied, the {} layout needs {need}",
                ranges.len(),
                geometry.kind()
            )));
        }
        let first = ranges[0];
        match (first.kind, first.device) {
            (MemoryKind::Host, None) => {}
            (MemoryKind::Device, Some(d)) if d >= 0 => {}
            (kind, device) => {
                return Err(Error::InvalidLayout(format!(
                    "region 0 is {kind:?} memory with device {device:?}: device memory needs a device ordinal of at least 0, host memory none"
                )))
            }
        }
        for (i, r) in ranges.iter().enumerate() {
            if r.addr == 0 || r.addr % REGION_ALIGNMENT != 0 {
                return Err(Error::InvalidLayout(format!(
                    "region {i} starts at {:#x}, which is not a non-null multiple of {REGION_ALIGNMENT}",
                    r.addr
                )));
            }
            if r.len < geometry.region_bytes() {
                return Err(Error::InvalidLayout(format!(
                    "region {i} has {} bytes, each region needs {}",
                    r.len,
                    geometry.region_bytes()
                )));
            }
            if r.addr.checked_add(r.len).is_none() {
                return Err(Error::SizeOverflow {
                    what: "caller region end",
                    detail: format!("{:#x} + {}", r.addr, r.len),
                });
            }
            if (r.kind, r.device) != (first.kind, first.device) {
                return Err(Error::InvalidLayout(format!(
                    "region {i} is {:?} memory of device {:?}, region 0 is {:?} of device {:?}: all regions of a layout share one storage kind",
                    r.kind, r.device, first.kind, first.device
                )));
            }
        }
        if let Some(backend) = checker {
            for (i, r) in ranges.iter().enumerate() {
                let Some((kind, device)) = backend.pointer_kind(r.addr)? else {
                    break; // The backend cannot tell.
                };
                if (kind, device) != (r.kind, r.device) {
                    return Err(Error::InvalidLayout(format!(
                        "region {i} at {:#x} is declared {:?} memory of device {:?}, but the {} driver says it is {kind:?} memory of device {device:?}",
                        r.addr,
                        r.kind,
                        r.device,
                        backend.info().name
                    )));
                }
            }
        }
        let bases = ranges.iter().map(|r| r.addr).collect();
        let views = LayoutViews::new(geometry, bases, first.kind, first.device);
        Ok(Layout::new(views, LayoutMemory::Caller(ranges)))
    }
}

impl LayoutBuilder<LayoutConfig, LayoutKind, ElasticRegion<'_>> {
    /// Tell `hook` of every page mapped and unmapped (NIXL registration:
    /// `NixlAgent::mapping_hook` with the `nixl` feature).
    pub fn hook(mut self, hook: Arc<dyn MappingHook>) -> Self {
        self.memory.hook = Some(hook);
        self
    }

    /// Validate and reserve the region; nothing physical is mapped.
    pub fn build(self) -> Result<ElasticLayout> {
        let geometry = self.geometry()?;
        let ElasticRegion { pool, opts, hook } = self.memory;
        // Whole pages: the last page may reach past the layout's last byte.
        let backing = BlockBacking::reserve(pool, geometry, &opts, hook)?;
        let views = carved(geometry, backing.addr(), pool);
        tracing::debug!(kind = %geometry.kind(), addr = backing.addr(), bytes = backing.len(), page = backing.page_size(), "elastic layout reserved");
        Ok(ElasticLayout::new(views, backing))
    }
}

impl std::fmt::Debug for ElasticRegion<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElasticRegion")
            .field("pool", &self.pool.name())
            .field("opts", &self.opts)
            .field("hook", &self.hook.is_some())
            .finish()
    }
}
