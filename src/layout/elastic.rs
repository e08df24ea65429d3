//! An elastic layout: laid out over a large virtual region of a pool, with physical memory only
//! under the blocks in use ([`BlockBacking`] over the layout's geometry).

use std::fmt;
use std::ops::Deref;

use super::geometry::LayoutGeometry;
use super::view::{sealed, KvLayout, LayoutPin, LayoutViews};
use crate::backing::{
    BackingChange, BackingStats, BlockBacking, BlockPin, PinRefused, SortedBlocks,
};
use crate::error::{Error, Result};
use crate::pool::ChunkSpan;

/// A KV-cache layout whose blocks are backed on demand. Dereferences to its [`LayoutViews`]:
/// every view can be computed, but only those of backed blocks have memory under them.
///
/// A page shared by several blocks (small blocks, or the edges of layer regions) is mapped
/// while any of them is backed. A [`crate::MappingHook`] given to the builder (the NIXL
/// registration) hears of every page mapped and is told before any page is unmapped, on
/// [`ElasticLayout::release`], on the rollback of a failed [`ElasticLayout::ensure_backed`] and
/// on drop.
///
/// Blocks in use by a consumer are pinned ([`ElasticLayout::pin`]; NIXL transfers do it
/// themselves): [`ElasticLayout::release`] of a pinned block is an [`Error::BlockPinned`], and
/// the memory and registrations stay until the pin goes, even if the layout is dropped first.
/// The region itself is never handed out, so nothing but `release` can unmap a page:
///
/// ```
/// # use elastic_vmm::layout::{LayoutBuilder, LayoutConfig};
/// # use elastic_vmm::MemOptions;
/// # fn main() -> elastic_vmm::Result<()> {
/// let pool = elastic_vmm::Pool::host(1 << 30)?;
/// let kv = LayoutBuilder::new()
///     .config(LayoutConfig::new(4, 1, 1, 16, 64, 2))
///     .fully_contiguous()
///     .elastic(&pool, &MemOptions::new())
///     .build()?;
/// kv.ensure_backed([0])?;
/// assert!(kv.backing().is_range_mapped(0, kv.backing().granularity()));
/// # Ok(()) }
/// ```
/// ```compile_fail
/// # use elastic_vmm::layout::{LayoutBuilder, LayoutConfig};
/// # use elastic_vmm::MemOptions;
/// # fn main() -> elastic_vmm::Result<()> {
/// # let pool = elastic_vmm::Pool::host(1 << 30)?;
/// # let kv = LayoutBuilder::new()
/// #     .config(LayoutConfig::new(4, 1, 1, 16, 64, 2))
/// #     .fully_contiguous()
/// #     .elastic(&pool, &MemOptions::new())
/// #     .build()?;
/// kv.ensure_backed([0])?;
/// kv.region().unmap(0, kv.backing().granularity())?; // no `&Region` to unmap with
/// # Ok(()) }
/// ```
/// ```compile_fail
/// # use elastic_vmm::layout::{LayoutBuilder, LayoutConfig};
/// # use elastic_vmm::MemOptions;
/// # fn main() -> elastic_vmm::Result<()> {
/// # let pool = elastic_vmm::Pool::host(1 << 30)?;
/// # let kv = LayoutBuilder::new()
/// #     .config(LayoutConfig::new(4, 1, 1, 16, 64, 2))
/// #     .fully_contiguous()
/// #     .elastic(&pool, &MemOptions::new())
/// #     .build()?;
/// kv.ensure_backed([0])?;
/// kv.backing().region().unmap(0, kv.backing().granularity())?; // nor from the backing
/// # Ok(()) }
/// ```
pub struct ElasticLayout {
    views: LayoutViews,
    backing: BlockBacking<LayoutGeometry>,
}

impl ElasticLayout {
    pub(crate) fn new(views: LayoutViews, backing: BlockBacking<LayoutGeometry>) -> Self {
        ElasticLayout { views, backing }
    }

    /// Where everything lies.
    pub fn views(&self) -> &LayoutViews {
        &self.views
    }

    /// Address of the first byte of the reserved range (the first layout region starts here).
    pub fn addr(&self) -> u64 {
        self.backing.addr()
    }

    /// Bytes of address space reserved for the layout (whole pages).
    pub fn len(&self) -> u64 {
        self.backing.len()
    }

    /// Always false: the layout reserves at least one granule.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The physical chunks mapped under `[at, at + len)` of the reserved range (offsets
    /// relative to [`ElasticLayout::addr`]).
    pub fn chunks_in(&self, at: u64, len: u64) -> Vec<ChunkSpan> {
        self.backing.chunks_in(at, len)
    }

    /// Bytes of the reserved range mapped now, as the pool sees it.
    pub fn region_mapped_bytes(&self) -> u64 {
        self.backing.region_mapped_bytes()
    }

    /// The block backing underneath (pages, refcounts, mapped runs, pins).
    pub fn backing(&self) -> &BlockBacking<LayoutGeometry> {
        &self.backing
    }

    /// Pin `blocks` for `holder` (see [`BlockBacking::pin`]): every block must be backed; none
    /// can be released until the pin is dropped.
    pub fn pin(&self, blocks: impl IntoIterator<Item = usize>, holder: &str) -> Result<BlockPin> {
        self.backing.pin(blocks, holder)
    }

    /// [`ElasticLayout::pin`] of blocks sorted and checked already (held as a bitmap).
    pub(crate) fn pin_sorted(&self, blocks: SortedBlocks, holder: &str) -> Result<BlockPin> {
        self.backing.pin_sorted(blocks, holder)
    }

    /// Map the pages under `blocks` that are not mapped yet. Blocks backed already stay as
    /// they are; on failure nothing changes.
    pub fn ensure_backed(&self, blocks: impl IntoIterator<Item = usize>) -> Result<BackingChange> {
        self.backing.ensure_backed(blocks)
    }

    /// Release `blocks` (each must be backed and unpinned, or nothing changes): unmap the pages
    /// no other backed block touches.
    pub fn release(&self, blocks: impl IntoIterator<Item = usize>) -> Result<BackingChange> {
        self.backing.release(blocks)
    }

    /// Whether `block` has memory under it.
    pub fn is_backed(&self, block: usize) -> bool {
        self.backing.is_backed(block)
    }

    /// Physical bytes the pages under `blocks` cost together, each shared page counted once.
    pub fn physical_bytes_for(&self, blocks: impl IntoIterator<Item = usize>) -> Result<u64> {
        self.backing.physical_bytes_for(blocks)
    }

    /// Physical bytes backing `blocks` would map now (pages not mapped yet).
    pub fn additional_bytes_for(&self, blocks: impl IntoIterator<Item = usize>) -> Result<u64> {
        self.backing.additional_bytes_for(blocks)
    }

    /// Blocks and pages now.
    pub fn stats(&self) -> BackingStats {
        self.backing.stats()
    }

    /// `[addr, addr + len)` as an offset in the region, checked to lie in one layout region.
    fn offset_of(&self, addr: u64, len: u64) -> Result<u64> {
        if self.views.locate(addr, len).is_none() {
            return Err(Error::InvalidLayout(format!(
                "[{addr:#x}, +{len}) does not lie in one region of the layout"
            )));
        }
        Ok(addr - self.backing.addr())
    }

    /// Copy `data` to `addr` (inside one region of the layout, on backed pages).
    ///
    /// # Safety
    /// Nobody else may use these bytes meanwhile, and the blocks on them must not be released
    /// meanwhile.
    pub unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        let at = self.offset_of(addr, data.len() as u64)?;
        // SAFETY: forwarded; the backing checks the bytes are mapped.
        unsafe { self.backing.write(at, data) }
    }

    /// Copy the bytes at `addr` (inside one region of the layout, on backed pages) into `out`.
    ///
    /// # Safety
    /// Nobody may write these bytes meanwhile, and the blocks on them must not be released
    /// meanwhile.
    pub unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        let at = self.offset_of(addr, out.len() as u64)?;
        // SAFETY: forwarded; the backing checks the bytes are mapped.
        unsafe { self.backing.read(at, out) }
    }
}

impl Deref for ElasticLayout {
    type Target = LayoutViews;

    fn deref(&self) -> &LayoutViews {
        &self.views
    }
}

impl KvLayout for ElasticLayout {
    fn views(&self) -> &LayoutViews {
        &self.views
    }
}

impl sealed::Sealed for ElasticLayout {
    fn pin_blocks(&self, blocks: &[usize], holder: &str) -> Result<LayoutPin, PinRefused> {
        self.backing
            .try_pin(blocks.iter().copied(), holder)
            .map(LayoutPin::blocks)
    }

    fn pool_of(&self) -> Option<&crate::Pool> {
        Some(self.backing.pool())
    }
}

impl fmt::Debug for ElasticLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ElasticLayout")
            .field("kind", &self.views.kind())
            .field("config", self.views.config())
            .field("backing", &self.backing)
            .finish()
    }
}
