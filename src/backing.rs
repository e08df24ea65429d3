//! Elastic backing of blocks: a large virtual [`Region`] whose pages are mapped only under the
//! blocks in use.
//!
//! A KV cache is laid out for its maximum size, but only the blocks that hold tokens need
//! physical memory. [`BlockBacking`] knows where each block's bytes lie in its region (a
//! [`BlockGeometry`]: one span per block for a contiguous tensor, one per layer for a
//! layer-separate layout) and counts, per page, how many backed blocks touch it:
//! [`BlockBacking::ensure_backed`] maps the pages that go from 0 to 1, [`BlockBacking::release`]
//! unmaps the pages that go back to 0. A page shared by several blocks stays mapped while any of
//! them is backed.
//!
//! # Pages
//! A page is the region's chunk ([`MemOptions::chunk`], a multiple of the granularity) and is made of whole physical
//! chunks of its own: no chunk crosses a page boundary, so every page can be unmapped on its own
//! and registered on its own (UCX exports only the first chunk of a range backed by several).
//! The region covers whole pages ([`BlockBacking::reserve`] reserves it so; [`BlockBacking::new`]
//! refuses a region that does not).
//!
//! A [`MappingHook`] hears of every mapping after it is made and of every unmapping before it is
//! made: the NIXL registration hangs on it, so a registration never outlives the memory under
//! it. The hook sees the region through a read-only [`RegionInfo`]; nothing outside this module
//! gets a `&Region`, so nothing else can unmap pages under backed blocks.
//!
//! # Pins
//! A consumer that uses the memory of some blocks (a NIXL transfer, a view) holds a
//! [`BlockPin`] on them ([`BlockBacking::pin`]). The rules:
//! - only backed blocks can be pinned; a block being backed right now is waited for;
//! - a pinned block is never released: [`BlockBacking::release`] of a set holding one is an
//!   [`Error::BlockPinned`] naming the block, its pin count and one holder, and changes nothing
//!   (it does not wait: a pin may be held for as long as a transfer runs);
//! - pinned blocks stay backed, so their pages stay mapped and registered;
//! - a pin keeps the backing's memory alive: dropping the [`BlockBacking`] while pins are held
//!   defers the teardown (hook told, pages unmapped, region returned) until the last pin goes;
//! - pins count: a block pinned twice is released only after both pins are dropped.
//!
//! # Concurrency
//! `&self` everywhere. One `parking_lot` mutex guards the bookkeeping (blocks, pages, pins); it
//! is a leaf: it is never held across a driver call, a hook, a call into the geometry, or a
//! drop that can run any of them, and no other lock is taken while it is held. Pages being
//! mapped or unmapped are marked busy and blocks being backed are marked claimed; an operation
//! that needs them waits on a condition variable (with the lock released).
//!
//! # Bad input
//! Block indices, page sizes and geometries are checked with checked arithmetic: a bad one is an
//! error with the numbers in it and changes nothing. A geometry whose spans are empty or lie
//! outside its extent is refused at the block that has them.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::backend::MemoryKind;
use crate::backend::PhysicalChunk;
use crate::error::{Error, Result};
use crate::pool::{ChunkFate, ChunkSpan, MemOptions, Pool, Region, SleepWatcher, Urgency};
use crate::tag::Tag;

/// Where each block's bytes lie inside a region.
pub trait BlockGeometry: Send + Sync {
    /// Number of blocks.
    fn num_blocks(&self) -> usize;

    /// Bytes of the region the blocks cover, from its start. An invalid geometry (a size that
    /// overflows, an empty block) is an error with the numbers in it.
    fn extent(&self) -> Result<u64>;

    /// Append to `out` the spans `(offset, len)` of `block`, relative to the region's start.
    /// Called only with `block < num_blocks()`. Spans must be non-empty and lie inside
    /// `extent()`; the backing checks, and refuses a block whose spans do not.
    fn block_spans(&self, block: usize, out: &mut Vec<(u64, u64)>);
}

/// `num_blocks` equal blocks of `block_bytes`, one after the other every `stride` bytes: the
/// geometry of a contiguous tensor whose first dimension is the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UniformBlocks {
    /// Number of blocks.
    pub num_blocks: usize,
    /// Bytes of each block (at least 1).
    pub block_bytes: u64,
    /// Distance between the starts of consecutive blocks (at least `block_bytes`).
    pub stride: u64,
}

impl UniformBlocks {
    /// Packed blocks: the stride is the block size.
    pub fn packed(num_blocks: usize, block_bytes: u64) -> Self {
        UniformBlocks {
            num_blocks,
            block_bytes,
            stride: block_bytes,
        }
    }
}

impl BlockGeometry for UniformBlocks {
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn extent(&self) -> Result<u64> {
        let (n, bytes, stride) = (self.num_blocks, self.block_bytes, self.stride);
        if n == 0 {
            return Ok(0);
        }
        if bytes == 0 {
            return Err(Error::InvalidArgument(format!(
                "uniform blocks of 0 bytes ({n} blocks, stride {stride}): a block holds at least one byte"
            )));
        }
        if n > 1 && stride < bytes {
            return Err(Error::InvalidArgument(format!(
                "uniform blocks of {bytes} bytes every {stride} bytes would overlap: the stride must be at least the block size"
            )));
        }
        (n as u64 - 1)
            .checked_mul(stride)
            .and_then(|v| v.checked_add(bytes))
            .ok_or_else(|| Error::SizeOverflow {
                what: "uniform blocks extent",
                detail: format!("({n} - 1) blocks * stride {stride} + {bytes} bytes"),
            })
    }

    fn block_spans(&self, block: usize, out: &mut Vec<(u64, u64)>) {
        // The extent was checked when the backing was made, so this cannot overflow; saturate
        // anyway: the backing refuses a span outside the extent.
        out.push(((block as u64).saturating_mul(self.stride), self.block_bytes));
    }
}

/// What a [`MappingHook`] sees of a backing's region: where it is, what memory it is, which
/// chunks are mapped. Read-only: nothing here can map or unmap.
#[derive(Clone, Copy)]
pub struct RegionInfo<'a> {
    region: &'a Region,
}

impl RegionInfo<'_> {
    /// Address of the region's first byte (a device pointer on CUDA).
    pub fn addr(&self) -> u64 {
        self.region.addr()
    }

    /// Bytes in the region.
    pub fn len(&self) -> u64 {
        self.region.len()
    }

    /// Always false: a region has at least one granule.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The pool's mapping unit.
    pub fn granularity(&self) -> u64 {
        self.region.granularity()
    }

    /// Host or device memory.
    pub fn memory_kind(&self) -> MemoryKind {
        self.region.pool().backend_info().memory_kind
    }

    /// The device ordinal for device memory; `None` for host memory.
    pub fn device(&self) -> Option<i32> {
        self.region.pool().backend_info().device_ordinal
    }

    /// Whether all of `[at, at + len)` (relative to the region) is mapped.
    pub fn is_mapped(&self, at: u64, len: u64) -> bool {
        self.region.is_mapped(at, len)
    }

    /// The physical chunks mapped under `[at, at + len)`, with offsets relative to the region.
    pub fn chunks_in(&self, at: u64, len: u64) -> Vec<ChunkSpan> {
        self.region.chunks_in(at, len)
    }
}

impl fmt::Debug for RegionInfo<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.region.fmt(f)
    }
}

/// Told about mappings of a [`BlockBacking`]: after pages are mapped, before they are unmapped.
/// Offsets are relative to the region's start and cover whole pages (each made of whole chunks).
pub trait MappingHook: Send + Sync {
    /// `[at, at + len)` of `region` was just mapped with access. An error undoes the mapping and
    /// fails the operation that made it.
    fn mapped(&self, region: RegionInfo<'_>, at: u64, len: u64) -> Result<()>;

    /// `[at, at + len)` of `region` is about to be unmapped: drop everything that refers to it.
    fn unmapping(&self, region: RegionInfo<'_>, at: u64, len: u64);
}

/// What one [`BlockBacking::ensure_backed`] or [`BlockBacking::release`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackingChange {
    /// Blocks whose state changed (became backed, or released).
    pub blocks: usize,
    /// Bytes mapped (ensure) or unmapped (release).
    pub bytes: u64,
    /// Release only: bytes that no block uses any more but whose unmap failed (logged); they
    /// stay mapped until a later release or [`BlockBacking::unmap_unused`].
    pub left_mapped: u64,
}

/// A snapshot of a [`BlockBacking`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackingStats {
    /// Blocks in the geometry.
    pub blocks: usize,
    /// Blocks backed now.
    pub backed_blocks: usize,
    /// Blocks pinned now (each counted once, however many pins it has).
    pub pinned_blocks: usize,
    /// The mapping unit of the backing (whole chunks of its own).
    pub page_size: u64,
    /// Pages the geometry spans.
    pub pages: usize,
    /// Pages mapped now.
    pub mapped_pages: usize,
    /// Bytes mapped now (`mapped_pages * page_size`).
    pub mapped_bytes: u64,
}

/// Where a block stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockState {
    Unbacked,
    /// An `ensure_backed` is mapping its pages: not usable yet, not releasable.
    Claimed,
    Backed,
}

/// Whether the hook was told of a mapping that is being undone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hooked {
    Told,
    NotTold,
}

/// One live pin: who holds it and on which blocks (sorted, no repeats; the list is shared
/// with its [`BlockPin`], not copied).
#[derive(Debug)]
struct PinRecord {
    holder: String,
    blocks: Arc<Vec<usize>>,
}

#[derive(Debug)]
struct BackingState {
    blocks: Vec<BlockState>,
    /// Per block: pins held on it.
    pins: Vec<u32>,
    holders: BTreeMap<u64, PinRecord>,
    next_pin: u64,
    /// Per page: how many backed (or claimed) blocks touch it.
    refs: Vec<u32>,
    /// Per page: mapped now.
    mapped: Vec<bool>,
    /// Per page: a driver call on it is in flight.
    busy: Vec<bool>,
    backed_blocks: usize,
    mapped_pages: usize,
    /// The pool sleeps (or is falling asleep, or waking): no pin is taken.
    asleep: bool,
}

/// The backing itself, shared by its handle and its pins (a pin keeps the memory alive).
struct Core<G> {
    region: Region,
    geometry: G,
    page: u64,
    extent: u64,
    hook: Option<Arc<dyn MappingHook>>,
    state: Mutex<BackingState>,
    changed: Condvar,
    /// Its registration as a sleep watcher of the pool.
    watcher: u64,
}

/// Blocks over a region, backed on demand; see the module documentation.
pub struct BlockBacking<G: BlockGeometry> {
    core: Arc<Core<G>>,
}

/// Blocks of a [`BlockBacking`] held against release, and its memory kept alive, until this is
/// dropped; see the module documentation.
pub struct BlockPin {
    target: Arc<dyn PinTarget>,
    id: u64,
    blocks: Arc<Vec<usize>>,
}

/// Block indices in ascending order, each once: what a pin records. Made from a bitmap, so a
/// pin need not check, sort or deduplicate them again ([`BlockBacking::pin_sorted`]).
pub(crate) struct SortedBlocks(Vec<usize>);

impl SortedBlocks {
    /// The blocks whose bit is set in `set` (block `b` is bit `b % 64` of word `b / 64`);
    /// `count` is a capacity hint (the number of bits set).
    pub(crate) fn from_bitmap(set: &[u64], count: usize) -> Self {
        let mut out = Vec::with_capacity(count);
        for (i, &w) in set.iter().enumerate() {
            if w == 0 {
                continue;
            }
            // Bit j of word i is block 64 i + j: a set bit names a `usize`, so neither this
            // nor the sums below overflow.
            let base = i * 64;
            if w == u64::MAX {
                // Runs of blocks (the common case): whole words at once.
                out.extend((0..64).map(|j| base + j));
                continue;
            }
            let mut w = w;
            while w != 0 {
                out.push(base + w.trailing_zeros() as usize);
                w &= w - 1;
            }
        }
        SortedBlocks(out)
    }
}

/// Lets a pin go without knowing the geometry type.
trait PinTarget: Send + Sync {
    fn unpin(&self, id: u64);

    /// Release the pin's blocks (pinned by it alone) and drop the pin in one critical section;
    /// unmapped chunks go where `fate` says.
    fn release_pinned(&self, id: u64, blocks: &[usize], fate: ChunkFate) -> Result<BackingChange>;
}

mod refused {
    use crate::error::Error;

    /// Why a pin was not taken. Public in a private module: it appears in the sealed half of
    /// `layout::KvLayout`, which no user can name.
    #[derive(Debug)]
    pub enum PinRefused {
        /// This block (the first found) has no memory under it.
        NotBacked(usize),
        /// Bad input (an index out of range, a bad geometry, too many pins).
        Invalid(Error),
    }

    impl PinRefused {
        /// The error a pin for `holder` refused this way is.
        pub(crate) fn into_error(self, holder: &str) -> Error {
            match self {
                PinRefused::NotBacked(block) => Error::InvalidArgument(format!(
                    "block {block} is not backed: pin for {holder} refused, nothing pinned"
                )),
                PinRefused::Invalid(e) => e,
            }
        }
    }
}
pub(crate) use refused::PinRefused;

/// Consecutive page indices `[first, last]` folded into runs.
fn runs(pages: &BTreeSet<usize>) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &p in pages {
        match out.last_mut() {
            Some((_, end)) if *end + 1 == p => *end = p,
            _ => out.push((p, p)),
        }
    }
    out
}

/// The bytes of region the blocks need (whole pages of `page`), checked.
fn page_layout(page: u64, extent: u64) -> Result<u64> {
    let pages = extent.div_ceil(page);
    let need = pages.checked_mul(page).ok_or_else(|| Error::SizeOverflow {
        what: "backing region",
        detail: format!("{pages} pages of {page} bytes"),
    })?;
    Ok(need)
}

impl<G: BlockGeometry + 'static> BlockBacking<G> {
    /// Blocks laid out by `geometry` over `region`, mapped in pages of the region's chunk
    /// ([`Region::chunk`]: [`MemOptions::chunk`] at reserve, default the pool's range chunk).
    /// The region must cover the blocks in whole pages (see [`BlockBacking::reserve`]).
    /// Nothing is mapped yet.
    pub fn new(region: Region, geometry: G, hook: Option<Arc<dyn MappingHook>>) -> Result<Self> {
        let extent = geometry.extent()?;
        let page = region.chunk();
        let need = page_layout(page, extent)?;
        if need > region.len() {
            return Err(Error::InvalidArgument(format!(
                "the blocks span {extent} bytes, {need} bytes in whole pages of {page}, but the region has only {} (BlockBacking::reserve reserves whole pages)",
                region.len()
            )));
        }
        let n = geometry.num_blocks();
        if u32::try_from(n).is_err() {
            return Err(Error::InvalidArgument(format!(
                "{n} blocks: a backing holds at most {} blocks",
                u32::MAX
            )));
        }
        let pages = (need / page) as usize;
        let state = BackingState {
            blocks: vec![BlockState::Unbacked; n],
            pins: vec![0; n],
            holders: BTreeMap::new(),
            next_pin: 0,
            refs: vec![0; pages],
            mapped: vec![false; pages],
            busy: vec![false; pages],
            backed_blocks: 0,
            mapped_pages: 0,
            asleep: false,
        };
        let pool = region.pool().inner().clone();
        // The pool tells the backing of sleep and wake (pins refused, hook told); the
        // registration is weak and goes when the core does.
        let core = Arc::new_cyclic(|weak: &std::sync::Weak<Core<G>>| {
            let watcher: std::sync::Weak<dyn SleepWatcher> = weak.clone();
            Core {
                region,
                geometry,
                page,
                extent,
                hook,
                state: Mutex::new(state),
                changed: Condvar::new(),
                watcher: pool.add_watcher(watcher),
            }
        });
        Ok(BlockBacking { core })
    }

    /// As [`BlockBacking::new`] over a region of `pool` reserved for it, covering the blocks in
    /// whole pages. [`MemOptions`]: `chunk` is the page size (a multiple of the granularity;
    /// default: the granularity), `tag` what every page holds (default [`Tag::Kv`], a KV
    /// cache's blocks; sleep policies and stats go by it); `name` and `zeroed` are refused.
    pub fn reserve(
        pool: &Pool,
        geometry: G,
        opts: &MemOptions,
        hook: Option<Arc<dyn MappingHook>>,
    ) -> Result<Self> {
        opts.refuse("BlockBacking::reserve", &["name", "zeroed"])?;
        let g = pool.granularity();
        let page = opts.chunk_checked(g)?.unwrap_or(g);
        let need = page_layout(page, geometry.extent()?)?;
        let opts = MemOptions::new().tag(opts.tag_or(Tag::Kv)).chunk(page);
        let region = pool.reserve_region_with(need.max(g), &opts)?;
        Self::new(region, geometry, hook)
    }
}

impl<G: BlockGeometry> BlockBacking<G> {
    /// Address of the region's first byte (a device pointer on CUDA); block offsets are
    /// relative to it.
    pub fn addr(&self) -> u64 {
        self.core.region.addr()
    }

    /// Bytes of address space the backing holds (whole pages, at least the geometry's extent).
    pub fn len(&self) -> u64 {
        self.core.region.len()
    }

    /// Always false: a backing holds at least one granule of address space.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The pool's mapping unit.
    pub fn granularity(&self) -> u64 {
        self.core.region.granularity()
    }

    /// Where the blocks lie.
    pub fn geometry(&self) -> &G {
        &self.core.geometry
    }

    /// The mapping unit: every page is whole physical chunks of its own.
    pub fn page_size(&self) -> u64 {
        self.core.page
    }

    /// The physical chunks mapped under `[at, at + len)` of the region (offsets relative to it).
    pub fn chunks_in(&self, at: u64, len: u64) -> Vec<ChunkSpan> {
        self.core.region.chunks_in(at, len)
    }

    /// The chunks mapped under `[at, at + len)` of the region with their handles (offsets
    /// relative to the region), for export to another process ([`crate::p2p`]).
    pub(crate) fn placed_chunks_in(
        &self,
        at: u64,
        len: u64,
    ) -> Vec<(u64, crate::backend::PhysicalChunk)> {
        let region = &self.core.region;
        let Some(end) = at.checked_add(len).filter(|&e| e <= region.len()) else {
            return Vec::new();
        };
        region
            .pool()
            .placed_chunks_in(region.offset() + at, end - at)
            .into_iter()
            .map(|(o, c)| (o - region.offset(), c))
            .collect()
    }

    /// The pool the region lies in.
    pub(crate) fn pool(&self) -> &Pool {
        self.core.region.pool()
    }

    /// Bytes of the region mapped now as the pool sees it (equals `stats().mapped_bytes`
    /// except while an operation is in flight).
    pub fn region_mapped_bytes(&self) -> u64 {
        self.core.region.mapped_bytes()
    }

    /// Whether `block` is backed now (its pages mapped, and told to the hook).
    pub fn is_backed(&self, block: usize) -> bool {
        self.core.state.lock().blocks.get(block) == Some(&BlockState::Backed)
    }

    /// The first block of `blocks` that is not backed, if any (for refusing work on it). To use
    /// the blocks' memory afterwards, [`BlockBacking::pin`] them instead: a block checked here
    /// can be released the moment after.
    pub fn first_unbacked(&self, blocks: impl IntoIterator<Item = usize>) -> Option<usize> {
        let st = self.core.state.lock();
        blocks
            .into_iter()
            .find(|&b| st.blocks.get(b) != Some(&BlockState::Backed))
    }

    /// Whether every byte of `[at, at + len)` of the region lies in a mapped page.
    pub fn is_range_mapped(&self, at: u64, len: u64) -> bool {
        if len == 0 {
            return true;
        }
        let Some(end) = at.checked_add(len) else {
            return false;
        };
        let page = self.core.page;
        let (first, last) = ((at / page) as usize, ((end - 1) / page) as usize);
        let st = self.core.state.lock();
        last < st.mapped.len() && st.mapped[first..=last].iter().all(|&m| m)
    }

    /// A snapshot of blocks, pages and pins.
    pub fn stats(&self) -> BackingStats {
        let st = self.core.state.lock();
        BackingStats {
            blocks: st.blocks.len(),
            backed_blocks: st.backed_blocks,
            pinned_blocks: st.pins.iter().filter(|&&p| p > 0).count(),
            page_size: self.core.page,
            pages: st.refs.len(),
            mapped_pages: st.mapped_pages,
            mapped_bytes: st.mapped_pages as u64 * self.core.page,
        }
    }

    /// Physical bytes the pages under `blocks` cost, counting each page once (what they would
    /// hold mapped on their own, whatever is mapped now).
    pub fn physical_bytes_for(&self, blocks: impl IntoIterator<Item = usize>) -> Result<u64> {
        let blocks = self.core.checked(blocks)?;
        Ok(self.core.pages_of(&blocks)?.len() as u64 * self.core.page)
    }

    /// Physical bytes backing `blocks` would map now: the pages under them not mapped yet.
    pub fn additional_bytes_for(&self, blocks: impl IntoIterator<Item = usize>) -> Result<u64> {
        let blocks = self.core.checked(blocks)?;
        let pages = self.core.pages_of(&blocks)?;
        let st = self.core.state.lock();
        Ok(pages.iter().filter(|&&p| !st.mapped[p]).count() as u64 * self.core.page)
    }

    /// Back `blocks` with physical memory: map every page under them that is not mapped yet.
    /// Blocks already backed are left as they are. On failure (a refused admission, a driver
    /// error, a hook error, bad input) nothing changes: what was mapped on the way is unmapped
    /// again.
    pub fn ensure_backed(&self, blocks: impl IntoIterator<Item = usize>) -> Result<BackingChange> {
        self.core.ensure_backed(blocks, Urgency::Required)
    }

    /// As [`BlockBacking::ensure_backed`], with memory taken only if the pool's admission gives
    /// it at once: never reclaimed or handed over from another model (growth ahead of need).
    pub(crate) fn ensure_backed_ahead(
        &self,
        blocks: impl IntoIterator<Item = usize>,
    ) -> Result<BackingChange> {
        self.core.ensure_backed(blocks, Urgency::LookAhead)
    }

    /// Release `blocks`: unmap the pages no other backed block touches. Every block must be
    /// backed and unpinned: releasing one twice is an error naming it, releasing a pinned one is
    /// [`Error::BlockPinned`]; either way nothing changes. A page whose unmap fails stays mapped
    /// (and registered) with no block on it; a later release or [`BlockBacking::unmap_unused`]
    /// tries again.
    pub fn release(&self, blocks: impl IntoIterator<Item = usize>) -> Result<BackingChange> {
        self.core.release(blocks)
    }

    /// Back `blocks` with chunks imported from another process instead of new ones:
    /// `placed` are `(offset in the region, chunk)` tiling exactly the pages under the blocks,
    /// which must be unbacked and touch no page any other backed block uses. The chunks are
    /// charged to the pool as if created here, and consumed whatever happens: on failure
    /// nothing changes and every chunk is released by this process.
    pub(crate) fn adopt(
        &self,
        blocks: &[usize],
        placed: Vec<(u64, PhysicalChunk)>,
    ) -> Result<BackingChange> {
        self.core.adopt(blocks, placed)
    }

    /// Unmap mapped pages that no backed block touches (left behind by a failed unmap).
    pub fn unmap_unused(&self) -> u64 {
        let to_unmap = {
            let mut st = self.core.state.lock();
            let n = st.refs.len();
            Core::<G>::claim_unused(&mut st, 0..n)
        };
        self.core.unmap_claimed(&to_unmap, ChunkFate::Cache)
    }

    /// Runs of mapped pages as `(offset, len)` relative to the region.
    pub fn mapped_runs(&self) -> Vec<(u64, u64)> {
        self.core.mapped_runs()
    }

    /// Copy `data` into the region at `at` (host-to-device on CUDA). The bytes must be mapped.
    ///
    /// # Safety
    /// Nobody else (a kernel, a transfer, another thread) may use these bytes meanwhile, and the
    /// blocks on them must stay backed meanwhile (pin them, or release nothing).
    pub unsafe fn write(&self, at: u64, data: &[u8]) -> Result<()> {
        // SAFETY: forwarded; the region checks the bytes are mapped.
        unsafe { self.core.region.write(at, data) }
    }

    /// Copy bytes of the region at `at` into `out`. The bytes must be mapped.
    ///
    /// # Safety
    /// Nobody may write these bytes meanwhile, and the blocks on them must stay backed
    /// meanwhile (pin them, or release nothing).
    pub unsafe fn read(&self, at: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: forwarded; the region checks the bytes are mapped.
        unsafe { self.core.region.read(at, out) }
    }
}

impl<G: BlockGeometry + 'static> BlockBacking<G> {
    /// Pin `blocks` for `holder` (a name for errors, e.g. `"NIXL WRITE to agent decode"`): they
    /// cannot be released, and the backing's memory stays, until the pin is dropped. Every
    /// block must be backed (a block being backed now is waited for); otherwise nothing is
    /// pinned and the error names the first block without memory.
    pub fn pin(&self, blocks: impl IntoIterator<Item = usize>, holder: &str) -> Result<BlockPin> {
        self.try_pin(blocks, holder)
            .map_err(|e| e.into_error(holder))
    }

    /// [`BlockBacking::pin`] telling an unbacked block apart from bad input.
    pub(crate) fn try_pin(
        &self,
        blocks: impl IntoIterator<Item = usize>,
        holder: &str,
    ) -> Result<BlockPin, PinRefused> {
        let blocks = self
            .core
            .checked_sorted(blocks)
            .map_err(PinRefused::Invalid)?;
        self.pin_checked(Arc::new(blocks), holder)
    }

    /// [`BlockBacking::pin`] of blocks known sorted and without repeats (a caller that holds
    /// them as a bitmap already): only the range is checked, on the last block.
    pub(crate) fn pin_sorted(&self, blocks: SortedBlocks, holder: &str) -> Result<BlockPin> {
        let n = self.core.geometry.num_blocks();
        if let Some(&b) = blocks.0.last().filter(|&&b| b >= n) {
            return Err(Error::InvalidArgument(format!(
                "block {b} does not exist: the layout has {n} blocks"
            )));
        }
        self.pin_checked(Arc::new(blocks.0), holder)
            .map_err(|e| e.into_error(holder))
    }

    /// Pin `blocks`: sorted, no repeats, each below `num_blocks` (checked by the caller).
    fn pin_checked(&self, blocks: Arc<Vec<usize>>, holder: &str) -> Result<BlockPin, PinRefused> {
        let core = &self.core;
        let id = {
            let mut st = core.state.lock();
            // One pass when the pin can be taken (the common case); when it cannot, the checks
            // one by one, in their order, to report the right refusal.
            if st.asleep || !add_pins(&mut st, &blocks) {
                while blocks.iter().any(|&b| st.blocks[b] == BlockState::Claimed) {
                    core.changed.wait(&mut st);
                }
                if st.asleep {
                    return Err(PinRefused::Invalid(Error::Asleep {
                        pool: core.region.pool().name().to_string(),
                        op: "pin",
                        state: "asleep",
                    }));
                }
                if let Some(&b) = blocks.iter().find(|&&b| st.blocks[b] != BlockState::Backed) {
                    return Err(PinRefused::NotBacked(b));
                }
                if let Some(&b) = blocks.iter().find(|&&b| st.pins[b] == u32::MAX) {
                    return Err(PinRefused::Invalid(Error::InvalidArgument(format!(
                        "block {b} holds {} pins already: pin for {holder} refused",
                        u32::MAX
                    ))));
                }
                for &b in blocks.iter() {
                    st.pins[b] += 1;
                }
            }
            let id = st.next_pin;
            st.next_pin += 1;
            st.holders.insert(
                id,
                PinRecord {
                    holder: holder.to_owned(),
                    blocks: blocks.clone(),
                },
            );
            id
        };
        tracing::trace!(blocks = blocks.len(), holder, pin = id, "blocks pinned");
        Ok(BlockPin {
            target: core.clone(),
            id,
            blocks,
        })
    }
}

/// Blocks a pass over a sorted list takes at a time: a chunk whose ends are this far apart is
/// consecutive blocks, handled as one slice (which vectorizes).
const RUN: usize = 64;

/// Add a pin to each of `blocks` (sorted, no repeats, in range) when every one is backed and
/// below the pin limit, in one pass; otherwise undo what was added and return false: nothing
/// changed.
fn add_pins(st: &mut BackingState, blocks: &[usize]) -> bool {
    let BackingState {
        blocks: states,
        pins,
        ..
    } = st;
    let mut done = 0;
    let all = 'add: {
        for chunk in blocks.chunks(RUN) {
            let (first, last) = (chunk[0], chunk[chunk.len() - 1]);
            if last - first == chunk.len() - 1 {
                // Consecutive blocks. Folds, not `all`: a loop that stops early does not
                // vectorize.
                let run = &mut pins[first..=last];
                let backed = states[first..=last]
                    .iter()
                    .fold(true, |ok, &s| ok & (s == BlockState::Backed));
                let room = run.iter().fold(true, |ok, &p| ok & (p != u32::MAX));
                if !(backed && room) {
                    break 'add false;
                }
                run.iter_mut().for_each(|p| *p += 1);
                done += chunk.len();
            } else {
                for &b in chunk {
                    if states[b] != BlockState::Backed || pins[b] == u32::MAX {
                        break 'add false;
                    }
                    pins[b] += 1;
                    done += 1;
                }
            }
        }
        true
    };
    if !all {
        remove_pins(pins, &blocks[..done]);
    }
    all
}

/// Take a pin off each of `blocks` (sorted, no repeats, each pinned).
fn remove_pins(pins: &mut [u32], blocks: &[usize]) {
    for chunk in blocks.chunks(RUN) {
        let (first, last) = (chunk[0], chunk[chunk.len() - 1]);
        if last - first == chunk.len() - 1 {
            pins[first..=last].iter_mut().for_each(|p| *p -= 1);
        } else {
            for &b in chunk {
                pins[b] -= 1;
            }
        }
    }
}

impl<G: BlockGeometry> Core<G> {
    fn info(&self) -> RegionInfo<'_> {
        RegionInfo {
            region: &self.region,
        }
    }

    /// Wait until `ready` holds; returns the lock.
    fn wait_until(
        &self,
        mut ready: impl FnMut(&BackingState) -> bool,
    ) -> MutexGuard<'_, BackingState> {
        let mut st = self.state.lock();
        while !ready(&st) {
            self.changed.wait(&mut st);
        }
        st
    }

    /// Validate block indices; returns them sorted and without repeats.
    fn checked(&self, blocks: impl IntoIterator<Item = usize>) -> Result<BTreeSet<usize>> {
        let n = self.geometry.num_blocks();
        let mut out = BTreeSet::new();
        for b in blocks {
            if b >= n {
                return Err(Error::InvalidArgument(format!(
                    "block {b} does not exist: the layout has {n} blocks"
                )));
            }
            out.insert(b);
        }
        Ok(out)
    }

    /// As [`Core::checked`], as a sorted vector without duplicates: one pass for blocks given
    /// in ascending order, a bitmap or a sort otherwise (pins of thousands of blocks per copy).
    fn checked_sorted(&self, blocks: impl IntoIterator<Item = usize>) -> Result<Vec<usize>> {
        let n = self.geometry.num_blocks();
        let out: Vec<usize> = blocks.into_iter().collect();
        // Ascending with the last in range: all in range.
        if out.last().is_none_or(|&b| b < n) && out.windows(2).all(|w| w[0] < w[1]) {
            return Ok(out);
        }
        if let Some(&b) = out.iter().find(|&&b| b >= n) {
            return Err(Error::InvalidArgument(format!(
                "block {b} does not exist: the layout has {n} blocks"
            )));
        }
        if n / 64 <= out.len().saturating_mul(16) {
            // A bitmap over the blocks: linear, where a sort of thousands costs tens of µs.
            let mut set = vec![0u64; n.div_ceil(64)];
            for &b in &out {
                set[b / 64] |= 1 << (b % 64);
            }
            return Ok(SortedBlocks::from_bitmap(&set, out.len()).0);
        }
        let mut out = out;
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    /// The pages `block` touches, each once, appended to `out`; a span that is empty or lies
    /// outside the extent is an error naming it (and leaves `out` as it was).
    fn block_pages(
        &self,
        block: usize,
        spans: &mut Vec<(u64, u64)>,
        out: &mut Vec<usize>,
    ) -> Result<()> {
        spans.clear();
        self.geometry.block_spans(block, spans);
        let start = out.len();
        for &(at, len) in spans.iter() {
            let end = at.checked_add(len).filter(|&e| len > 0 && e <= self.extent);
            let Some(end) = end else {
                out.truncate(start);
                return Err(Error::InvalidArgument(format!(
                    "block {block}: its geometry gives the span [{at:#x}, +{len}), {}; a span holds at least one byte and lies within the {} bytes the blocks span",
                    if len == 0 { "which is empty" } else { "which lies outside them" },
                    self.extent
                )));
            };
            out.extend((at / self.page) as usize..=((end - 1) / self.page) as usize);
        }
        // A block counts once per page, even when several of its spans share one.
        out[start..].sort_unstable();
        let mut kept = start;
        for i in start..out.len() {
            if i == start || out[i] != out[kept - 1] {
                out[kept] = out[i];
                kept += 1;
            }
        }
        out.truncate(kept);
        Ok(())
    }

    /// Each block with the pages it touches.
    fn pages_per_block(&self, blocks: &BTreeSet<usize>) -> Result<Vec<(usize, Vec<usize>)>> {
        let mut spans = Vec::new();
        blocks
            .iter()
            .map(|&b| {
                let mut pages = Vec::new();
                self.block_pages(b, &mut spans, &mut pages)?;
                Ok((b, pages))
            })
            .collect()
    }

    fn pages_of(&self, blocks: &BTreeSet<usize>) -> Result<BTreeSet<usize>> {
        let mut spans = Vec::new();
        let mut pages = Vec::new();
        for &b in blocks {
            self.block_pages(b, &mut spans, &mut pages)?;
        }
        Ok(pages.into_iter().collect())
    }

    /// Map the pages `[at, at + len)` so that each is whole chunks of its own. On failure
    /// nothing of the run stays mapped.
    fn map_run(&self, at: u64, len: u64) -> Result<()> {
        if self.page == self.region.granularity() {
            // Chunks are whole granules here: none can cross a page.
            return self.region.map(at, len);
        }
        // Page by page: a run in one call could take cached chunks that straddle pages.
        let mut done = 0;
        while done < len {
            if let Err(e) = self.region.map(at + done, self.page) {
                if done > 0 {
                    if let Err(u) = self.region.unmap(at, done) {
                        tracing::error!(at, len = done, error = %u, "unmap during rollback failed");
                    }
                }
                return Err(e);
            }
            done += self.page;
        }
        Ok(())
    }

    fn ensure_backed(
        &self,
        blocks: impl IntoIterator<Item = usize>,
        urgency: Urgency,
    ) -> Result<BackingChange> {
        let blocks = self.checked(blocks)?;
        // The geometry is asked before the lock is taken (it is the caller's code).
        let mut per_block = self.pages_per_block(&blocks)?;
        let all: BTreeSet<usize> = per_block
            .iter()
            .flat_map(|(_, p)| p.iter().copied())
            .collect();
        let to_map = {
            let mut st = self.wait_until(|st| {
                all.iter().all(|&p| !st.busy[p])
                    && blocks.iter().all(|&b| st.blocks[b] != BlockState::Claimed)
            });
            per_block.retain(|(b, _)| st.blocks[*b] == BlockState::Unbacked);
            let mut to_map = BTreeSet::new();
            for (b, pages) in &per_block {
                st.blocks[*b] = BlockState::Claimed;
                for &p in pages {
                    // At most one per block, and blocks fit in u32 (checked in `new`).
                    st.refs[p] += 1;
                    if !st.mapped[p] {
                        to_map.insert(p);
                    }
                }
            }
            for &p in &to_map {
                st.busy[p] = true;
            }
            to_map
        };
        let claimed = per_block;
        if claimed.is_empty() {
            return Ok(BackingChange::default());
        }
        let mut done: Vec<(u64, u64)> = Vec::new();
        let mut failure = None;
        let runs: Vec<(u64, u64)> = runs(&to_map)
            .into_iter()
            .map(|(first, last)| {
                (
                    first as u64 * self.page,
                    (last - first + 1) as u64 * self.page,
                )
            })
            .collect();
        // Pages of one granule: every run in one batch (one request for memory, all or
        // nothing); larger pages: run by run, page by page (see `map_run`).
        let batched = self.page == self.region.granularity() && !runs.is_empty();
        if batched {
            if let Err(e) = self.region.map_batch(&runs, urgency) {
                failure = Some(e);
            }
        }
        let mut next = 0;
        while failure.is_none() && next < runs.len() {
            let (at, len) = runs[next];
            next += 1;
            if !batched {
                if let Err(e) = self.map_run(at, len) {
                    failure = Some(e);
                    break;
                }
            }
            if let Some(hook) = &self.hook {
                if let Err(e) = hook.mapped(self.info(), at, len) {
                    self.unmap_quietly(at, len, Hooked::NotTold);
                    failure = Some(e);
                    break;
                }
            }
            done.push((at, len));
        }
        if batched && failure.is_some() && next > 0 {
            // A hook refused: the runs after it were mapped in the batch but never told.
            for &(at, len) in &runs[next..] {
                self.unmap_quietly(at, len, Hooked::NotTold);
            }
        }
        if let Some(e) = failure {
            for &(at, len) in &done {
                self.unmap_quietly(at, len, Hooked::Told);
            }
            let mut st = self.state.lock();
            for (b, pages) in &claimed {
                st.blocks[*b] = BlockState::Unbacked;
                for &p in pages {
                    st.refs[p] -= 1;
                }
            }
            for &p in &to_map {
                st.busy[p] = false;
            }
            drop(st);
            self.changed.notify_all();
            tracing::debug!(blocks = claimed.len(), error = %e, "ensure_backed rolled back");
            return Err(e);
        }
        let bytes = to_map.len() as u64 * self.page;
        {
            let mut st = self.state.lock();
            for (b, _) in &claimed {
                st.blocks[*b] = BlockState::Backed;
            }
            st.backed_blocks += claimed.len();
            for &p in &to_map {
                st.mapped[p] = true;
                st.busy[p] = false;
            }
            st.mapped_pages += to_map.len();
        }
        self.changed.notify_all();
        tracing::trace!(blocks = claimed.len(), bytes, "blocks backed");
        Ok(BackingChange {
            blocks: claimed.len(),
            bytes,
            left_mapped: 0,
        })
    }

    fn adopt(&self, blocks: &[usize], placed: Vec<(u64, PhysicalChunk)>) -> Result<BackingChange> {
        let backend = self.region.pool().backend().clone();
        let release = |chunks: &mut dyn Iterator<Item = PhysicalChunk>| {
            for c in chunks {
                // SAFETY: imported chunks handed to us, mapped nowhere, not taken by the pool.
                if let Err(e) = unsafe { backend.release(c) } {
                    tracing::error!(error = %e, "releasing an imported chunk failed");
                }
            }
        };
        let checked = self.checked(blocks.iter().copied()).and_then(|set| {
            if set.len() != blocks.len() {
                return Err(Error::InvalidArgument(
                    "a block is listed twice for adoption".into(),
                ));
            }
            let per_block = self.pages_per_block(&set)?;
            Ok((set, per_block))
        });
        let (set, per_block) = match checked {
            Ok(v) => v,
            Err(e) => {
                release(&mut placed.into_iter().map(|(_, c)| c));
                return Err(e);
            }
        };
        let pages: BTreeSet<usize> = per_block
            .iter()
            .flat_map(|(_, p)| p.iter().copied())
            .collect();
        // The chunks must tile the pages exactly, none crossing a page boundary.
        let mut runs_of: Vec<(u64, Vec<PhysicalChunk>)> = Vec::new();
        let mut it = placed.iter().peekable();
        let mut tiling = Ok(());
        for (first, last) in runs(&pages) {
            let (start, end) = (first as u64 * self.page, (last as u64 + 1) * self.page);
            let mut at = start;
            let mut chunks = Vec::new();
            while at < end {
                match it.next() {
                    Some(&(o, c)) if o == at && (o % self.page) + c.size as u64 <= self.page => {
                        chunks.push(c);
                        at += c.size as u64;
                    }
                    other => {
                        tiling = Err(Error::InvalidArgument(format!(
                            "adopted chunks do not tile the pages under the blocks: at region offset {at:#x} (pages of {} bytes) came {other:?}",
                            self.page
                        )));
                        break;
                    }
                }
            }
            if tiling.is_err() {
                break;
            }
            runs_of.push((start, chunks));
        }
        if tiling.is_ok() && it.peek().is_some() {
            tiling = Err(Error::InvalidArgument(format!(
                "{} adopted chunks lie outside the pages under the blocks",
                it.count()
            )));
        }
        if let Err(e) = tiling {
            release(&mut placed.into_iter().map(|(_, c)| c));
            return Err(e);
        }
        drop(placed);
        {
            let mut st = self.wait_until(|st| {
                pages.iter().all(|&p| !st.busy[p])
                    && set.iter().all(|&b| st.blocks[b] != BlockState::Claimed)
            });
            let refused = if let Some(&b) =
                set.iter().find(|&&b| st.blocks[b] != BlockState::Unbacked)
            {
                Some(format!(
                    "block {b} is backed already: its memory cannot be adopted"
                ))
            } else {
                pages.iter().find(|&&p| st.refs[p] > 0 || st.mapped[p]).map(|&p| {
                    format!("page {p} under the blocks is mapped or used by another block: adopt whole pages of the blocks' own")
                })
            };
            if let Some(why) = refused {
                drop(st);
                release(&mut runs_of.into_iter().flat_map(|(_, c)| c));
                return Err(Error::InvalidArgument(why));
            }
            for (b, block_pages) in &per_block {
                st.blocks[*b] = BlockState::Claimed;
                for &p in block_pages {
                    st.refs[p] += 1;
                }
            }
            for &p in &pages {
                st.busy[p] = true;
            }
        }
        let mut done: Vec<(u64, u64)> = Vec::new();
        let mut failure = None;
        let mut runs_left = runs_of.into_iter();
        for (at, chunks) in runs_left.by_ref() {
            let len: u64 = chunks.iter().map(|c| c.size as u64).sum();
            if let Err(e) = self.region.adopt(at, chunks) {
                failure = Some(e);
                break;
            }
            if let Some(hook) = &self.hook {
                if let Err(e) = hook.mapped(self.info(), at, len) {
                    if let Err(u) = self.region.unmap_releasing(at, len) {
                        tracing::error!(at, len, error = %u, "unmap during rollback failed");
                    }
                    failure = Some(e);
                    break;
                }
            }
            done.push((at, len));
        }
        if let Some(e) = failure {
            release(&mut runs_left.flat_map(|(_, c)| c));
            for &(at, len) in &done {
                if let Some(hook) = &self.hook {
                    hook.unmapping(self.info(), at, len);
                }
                if let Err(u) = self.region.unmap_releasing(at, len) {
                    tracing::error!(at, len, error = %u, "unmap during rollback failed");
                }
            }
            let mut st = self.state.lock();
            for (b, block_pages) in &per_block {
                st.blocks[*b] = BlockState::Unbacked;
                for &p in block_pages {
                    st.refs[p] -= 1;
                }
            }
            for &p in &pages {
                st.busy[p] = false;
            }
            drop(st);
            self.changed.notify_all();
            return Err(e);
        }
        {
            let mut st = self.state.lock();
            for (b, _) in &per_block {
                st.blocks[*b] = BlockState::Backed;
            }
            st.backed_blocks += per_block.len();
            for &p in &pages {
                st.mapped[p] = true;
                st.busy[p] = false;
            }
            st.mapped_pages += pages.len();
        }
        self.changed.notify_all();
        tracing::debug!(
            blocks = per_block.len(),
            pages = pages.len(),
            "blocks adopted"
        );
        Ok(BackingChange {
            blocks: per_block.len(),
            bytes: pages.len() as u64 * self.page,
            left_mapped: 0,
        })
    }

    /// Unmap a run this backing mapped, telling the hook first when it knew of the mapping.
    /// Used on rollback, where the operation's own error is the one to report.
    fn unmap_quietly(&self, at: u64, len: u64, hooked: Hooked) {
        if hooked == Hooked::Told {
            if let Some(hook) = &self.hook {
                hook.unmapping(self.info(), at, len);
            }
        }
        if let Err(e) = self.region.unmap(at, len) {
            tracing::error!(at, len, error = %e, "unmap during rollback failed");
        }
    }

    fn release(&self, blocks: impl IntoIterator<Item = usize>) -> Result<BackingChange> {
        let blocks = self.checked(blocks)?;
        self.release_checked(blocks, None, ChunkFate::Cache)
    }

    /// Release `blocks` (checked), which must be backed and pinned by nobody but pin `mine`
    /// (whose record goes in the same critical section); unmapped chunks go where `fate` says.
    /// On a refusal nothing changes (`mine` stays).
    fn release_checked(
        &self,
        blocks: BTreeSet<usize>,
        mine: Option<u64>,
        fate: ChunkFate,
    ) -> Result<BackingChange> {
        let per_block = self.pages_per_block(&blocks)?;
        let pages: BTreeSet<usize> = per_block
            .iter()
            .flat_map(|(_, p)| p.iter().copied())
            .collect();
        let to_unmap = {
            let mut st = self.wait_until(|st| {
                pages.iter().all(|&p| !st.busy[p])
                    && blocks.iter().all(|&b| st.blocks[b] != BlockState::Claimed)
            });
            if let Some(&b) = blocks.iter().find(|&&b| st.blocks[b] != BlockState::Backed) {
                return Err(Error::InvalidArgument(format!(
                    "block {b} is not backed: release of {} blocks refused, nothing changed",
                    blocks.len()
                )));
            }
            let own = |b: usize| match mine.and_then(|id| st.holders.get(&id)) {
                Some(r) if r.blocks.binary_search(&b).is_ok() => 1,
                _ => 0,
            };
            if let Some(&b) = blocks.iter().find(|&&b| st.pins[b] > own(b)) {
                let holder = st
                    .holders
                    .values()
                    .find(|r| r.blocks.binary_search(&b).is_ok())
                    .map_or_else(|| "an unknown holder".to_owned(), |r| r.holder.clone());
                return Err(Error::BlockPinned {
                    block: b,
                    pins: st.pins[b] as usize,
                    holder,
                    blocks: blocks.len(),
                });
            }
            if let Some(record) = mine.and_then(|id| st.holders.remove(&id)) {
                remove_pins(&mut st.pins, &record.blocks);
            }
            for (b, block_pages) in &per_block {
                st.blocks[*b] = BlockState::Unbacked;
                for &p in block_pages {
                    st.refs[p] -= 1;
                }
            }
            st.backed_blocks -= blocks.len();
            Self::claim_unused(&mut st, pages.iter().copied())
        };
        let bytes = self.unmap_claimed(&to_unmap, fate);
        Ok(BackingChange {
            blocks: blocks.len(),
            bytes,
            left_mapped: to_unmap.len() as u64 * self.page - bytes,
        })
    }

    /// Mark busy and return the pages among `pages` that are mapped, idle and unreferenced.
    fn claim_unused(st: &mut BackingState, pages: impl Iterator<Item = usize>) -> BTreeSet<usize> {
        let out: BTreeSet<usize> = pages
            .filter(|&p| st.refs[p] == 0 && st.mapped[p] && !st.busy[p])
            .collect();
        for &p in &out {
            st.busy[p] = true;
        }
        out
    }

    /// Unmap claimed pages run by run, hook first; returns the bytes unmapped.
    fn unmap_claimed(&self, pages: &BTreeSet<usize>, fate: ChunkFate) -> u64 {
        let mut unmapped = BTreeSet::new();
        for (first, last) in runs(pages) {
            let at = first as u64 * self.page;
            let len = (last - first + 1) as u64 * self.page;
            if let Some(hook) = &self.hook {
                hook.unmapping(self.info(), at, len);
            }
            let r = match fate {
                ChunkFate::Cache => self.region.unmap(at, len),
                ChunkFate::Release => self.region.unmap_releasing(at, len),
            };
            match r {
                Ok(()) => unmapped.extend(first..=last),
                Err(e) => {
                    tracing::error!(at, len, error = %e, "unmapping released pages failed; they stay mapped");
                    if let Some(hook) = &self.hook {
                        if let Err(e) = hook.mapped(self.info(), at, len) {
                            tracing::error!(at, len, error = %e, "re-registering pages that stayed mapped failed");
                        }
                    }
                }
            }
        }
        {
            let mut st = self.state.lock();
            for &p in pages {
                st.busy[p] = false;
                if unmapped.contains(&p) {
                    st.mapped[p] = false;
                }
            }
            st.mapped_pages -= unmapped.len();
        }
        self.changed.notify_all();
        unmapped.len() as u64 * self.page
    }

    fn mapped_runs(&self) -> Vec<(u64, u64)> {
        let st = self.state.lock();
        let pages: BTreeSet<usize> = (0..st.mapped.len()).filter(|&p| st.mapped[p]).collect();
        drop(st);
        runs(&pages)
            .into_iter()
            .map(|(f, l)| (f as u64 * self.page, (l - f + 1) as u64 * self.page))
            .collect()
    }
}

impl<G: BlockGeometry> PinTarget for Core<G> {
    fn release_pinned(&self, id: u64, blocks: &[usize], fate: ChunkFate) -> Result<BackingChange> {
        let blocks = self.checked(blocks.iter().copied())?;
        self.release_checked(blocks, Some(id), fate)
    }

    fn unpin(&self, id: u64) {
        let mut st = self.state.lock();
        if let Some(record) = st.holders.remove(&id) {
            remove_pins(&mut st.pins, &record.blocks);
            // Dropping `record` only lets go of a reference: its pin still holds the list.
        }
    }
}

impl BlockPin {
    /// The pinned blocks, sorted.
    pub fn blocks(&self) -> &[usize] {
        &self.blocks
    }

    /// Release the pinned blocks, which no other pin may hold, with the pin dropped in the same
    /// critical section (so no release in between can cache their chunks); the chunks unmapped
    /// go where `fate` says. On a refusal the pin comes back, nothing changed.
    pub(crate) fn release_as(
        self,
        fate: ChunkFate,
    ) -> std::result::Result<BackingChange, Box<(Error, BlockPin)>> {
        match self.target.release_pinned(self.id, &self.blocks, fate) {
            // The record is gone: dropping the pin finds nothing to undo.
            Ok(change) => Ok(change),
            Err(e) => Err(Box::new((e, self))),
        }
    }
}

impl fmt::Debug for BlockPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockPin")
            .field("id", &self.id)
            .field("blocks", &self.blocks)
            .finish()
    }
}

impl Drop for BlockPin {
    fn drop(&mut self) {
        // The count goes under the lock; the backing itself (if this was its last owner) goes
        // after, when `target` drops with no lock held.
        self.target.unpin(self.id);
        tracing::trace!(pin = self.id, blocks = self.blocks.len(), "blocks unpinned");
    }
}

impl<G: BlockGeometry> fmt::Debug for BlockBacking<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockBacking")
            .field("region", &self.core.region)
            .field("page", &self.core.page)
            .field("stats", &self.stats())
            .finish()
    }
}

impl<G: BlockGeometry> Core<G> {
    /// Mapped pages as `(offset, len)` runs relative to the region.
    fn mapped_runs_now(&self) -> Vec<(u64, u64)> {
        let st = self.state.lock();
        let pages: BTreeSet<usize> = (0..st.mapped.len()).filter(|&p| st.mapped[p]).collect();
        drop(st);
        runs(&pages)
            .into_iter()
            .map(|(f, l)| (f as u64 * self.page, (l - f + 1) as u64 * self.page))
            .collect()
    }
}

/// Sleep and wake of the pool under the backing: pins are refused while it sleeps, and the
/// hook lets go of every mapping before sleep and hears of them again after wake. Called with
/// no lock held; the backing's lock is taken only for bookkeeping.
impl<G: BlockGeometry> SleepWatcher for Core<G> {
    fn freeze(&self) -> Result<()> {
        let mut st = self.state.lock();
        if let Some(rec) = st.holders.values().next() {
            let (holder, b) = (rec.holder.clone(), rec.blocks.first().copied().unwrap_or(0));
            let pins = st.holders.len();
            return Err(Error::SleepRefused {
                pool: self.region.pool().name().to_string(),
                op: "sleep",
                reason: format!(
                    "block {b} of a backing is pinned by {holder} ({pins} pin(s) held)"
                ),
            });
        }
        if let Some(p) = st.busy.iter().position(|&b| b) {
            return Err(Error::SleepRefused {
                pool: self.region.pool().name().to_string(),
                op: "sleep",
                reason: format!("page {p} of a backing is being mapped or unmapped"),
            });
        }
        st.asleep = true;
        Ok(())
    }

    fn thaw(&self) {
        self.state.lock().asleep = false;
    }

    fn unmapping_all(&self) {
        if let Some(hook) = &self.hook {
            for (at, len) in self.mapped_runs_now() {
                hook.unmapping(self.info(), at, len);
            }
        }
    }

    fn mapped_all(&self) -> Result<()> {
        let Some(hook) = &self.hook else {
            return Ok(());
        };
        let runs = self.mapped_runs_now();
        for (i, &(at, len)) in runs.iter().enumerate() {
            if let Err(e) = hook.mapped(self.info(), at, len) {
                for &(a, l) in &runs[..i] {
                    hook.unmapping(self.info(), a, l);
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

impl<G> Drop for Core<G> {
    fn drop(&mut self) {
        self.region.pool().inner().remove_watcher(self.watcher);
        // No handle and no pin is left. The hook lets go of every mapping first; the region
        // then unmaps it all as it drops.
        if let Some(hook) = &self.hook {
            let st = self.state.get_mut();
            let pages: BTreeSet<usize> = (0..st.mapped.len()).filter(|&p| st.mapped[p]).collect();
            let info = RegionInfo {
                region: &self.region,
            };
            for (f, l) in runs(&pages) {
                hook.unmapping(info, f as u64 * self.page, (l - f + 1) as u64 * self.page);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::backend::host::HostBackend;
    use crate::PoolConfig;

    /// `n` blocks of one 4 KiB page each, on a host pool.
    fn backing(n: usize, hook: Option<Arc<dyn MappingHook>>) -> BlockBacking<UniformBlocks> {
        let backend = Arc::new(HostBackend::new(4096).expect("host backend"));
        let pool = Pool::new(backend, PoolConfig::new(n * 8192)).expect("pool");
        BlockBacking::reserve(
            &pool,
            UniformBlocks::packed(n, 4096),
            &MemOptions::new(),
            hook,
        )
        .expect("backing")
    }

    fn pins(b: &BlockBacking<UniformBlocks>) -> Vec<u32> {
        b.core.state.lock().pins.clone()
    }

    /// A small generator, the same numbers every run.
    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    #[test]
    fn sorted_blocks_from_bitmaps() {
        let mut seed = 7;
        for round in 0..200 {
            let words = 1 + (lcg(&mut seed) % 6) as usize;
            let set: Vec<u64> = (0..words)
                .map(|_| match lcg(&mut seed) % 4 {
                    0 => 0,
                    1 => u64::MAX,
                    _ => lcg(&mut seed) << 31 ^ lcg(&mut seed),
                })
                .collect();
            let want: Vec<usize> = (0..words * 64)
                .filter(|&b| set[b / 64] & (1 << (b % 64)) != 0)
                .collect();
            assert_eq!(SortedBlocks::from_bitmap(&set, 0).0, want, "round {round}");
        }
    }

    /// Pins and unpins of lists mixing runs of consecutive blocks and single ones count as one
    /// per block, however the list falls into chunks.
    #[test]
    fn pins_count_per_block_in_runs_and_singles() {
        let n = 300;
        let b = backing(n, None);
        b.ensure_backed(0..n).expect("back");
        let mut seed = 11;
        let mut held = Vec::new();
        let mut model = vec![0u32; n];
        for round in 0..100 {
            let mut list = Vec::new();
            let mut at = (lcg(&mut seed) % 8) as usize;
            while at < n {
                let run = 1 + (lcg(&mut seed) % 150) as usize;
                list.extend(at..(at + run).min(n));
                at += run + (lcg(&mut seed) % 3) as usize;
            }
            for &blk in &list {
                model[blk] += 1;
            }
            let pin = b.pin(list.iter().copied(), "t").expect("pin");
            assert_eq!(pin.blocks(), &list[..]);
            held.push(pin);
            if round % 3 == 2 {
                let pin = held.swap_remove((lcg(&mut seed) as usize) % held.len());
                for &blk in pin.blocks() {
                    model[blk] -= 1;
                }
            }
            assert_eq!(pins(&b), model, "round {round}");
        }
        drop(held);
        assert_eq!(pins(&b), vec![0; n]);
        assert_eq!(b.stats().pinned_blocks, 0);
    }

    /// A pin refused by a block late in the list (unbacked, or at the pin limit) leaves every
    /// count as it was, on the run path and on the block-by-block path; the refusal names the
    /// first unbacked block even when a block before it is at the limit.
    #[test]
    fn refused_pins_change_nothing() {
        let n = 200;
        let b = backing(n, None);
        b.ensure_backed((0..n).filter(|&i| i != 150)).expect("back");
        let _held = b.pin(0..10, "held").expect("pin");
        let before = pins(&b);
        let scattered: Vec<usize> = (0..n).step_by(3).collect();
        for list in [(0..n).collect::<Vec<_>>(), scattered.clone()] {
            match b.try_pin(list.iter().copied(), "t") {
                Err(PinRefused::NotBacked(150)) => {}
                other => panic!("expected block 150 not backed, got {other:?}"),
            }
            assert_eq!(pins(&b), before);
        }
        let e = b.pin(140..160, "late").expect_err("refused");
        assert!(
            e.to_string()
                .contains("block 150 is not backed: pin for late refused"),
            "{e}"
        );
        // Block 120 at the limit: refused, nothing changed.
        b.core.state.lock().pins[120] = u32::MAX - 1;
        let at_limit = b.pin([120], "last").expect("the last pin there is");
        let before = pins(&b);
        let scattered: Vec<usize> = scattered.into_iter().filter(|&i| i != 150).collect();
        for list in [(100..140).collect::<Vec<_>>(), scattered] {
            let e = b.pin(list, "over").expect_err("refused");
            assert!(
                e.to_string()
                    .contains("block 120 holds 4294967295 pins already: pin for over refused"),
                "{e}"
            );
            assert_eq!(pins(&b), before);
        }
        // Unbacked is reported before a limit, whatever their order.
        match b.try_pin([120, 150], "t") {
            Err(PinRefused::NotBacked(150)) => {}
            other => panic!("expected block 150 not backed, got {other:?}"),
        }
        assert_eq!(pins(&b), before);
        drop(at_limit);
        assert_eq!(b.core.state.lock().pins[120], u32::MAX - 1);
        b.core.state.lock().pins[120] = 0;
        // Asleep: refused, nothing changed.
        let before = pins(&b);
        b.core.state.lock().asleep = true;
        let e = b.pin(0..4, "sleepy").expect_err("asleep");
        assert!(matches!(e, Error::Asleep { op: "pin", .. }), "{e}");
        b.core.state.lock().asleep = false;
        assert_eq!(pins(&b), before);
    }

    /// Sorted lists from a bitmap pin as the same list would; one past the blocks is refused.
    #[test]
    fn sorted_pins_check_their_range() {
        let n = 100;
        let b = backing(n, None);
        b.ensure_backed(0..n).expect("back");
        let mut set = vec![0u64; 2];
        for blk in [3, 4, 5, 64, 99] {
            set[blk / 64] |= 1 << (blk % 64);
        }
        let pin = b
            .pin_sorted(SortedBlocks::from_bitmap(&set, 5), "s")
            .expect("pin");
        assert_eq!(pin.blocks(), &[3, 4, 5, 64, 99]);
        assert_eq!(b.stats().pinned_blocks, 5);
        set[1] |= 1 << (100 - 64);
        let e = b
            .pin_sorted(SortedBlocks::from_bitmap(&set, 6), "s")
            .expect_err("block 100");
        assert!(e.to_string().contains("block 100 does not exist"), "{e}");
        b.release([7]).expect("release");
        set = vec![1 << 7, 0];
        let e = b
            .pin_sorted(SortedBlocks::from_bitmap(&set, 1), "gone")
            .expect_err("unbacked");
        assert!(
            e.to_string()
                .contains("block 7 is not backed: pin for gone refused, nothing pinned"),
            "{e}"
        );
        drop(pin);
        assert_eq!(pins(&b), vec![0; n]);
    }

    /// Holds `mapped` until told to go on, failing it when told so.
    struct Gate {
        entered: Mutex<mpsc::Sender<()>>,
        go: Mutex<mpsc::Receiver<bool>>,
    }

    impl MappingHook for Gate {
        fn mapped(&self, _: RegionInfo<'_>, _: u64, _: u64) -> Result<()> {
            self.entered.lock().send(()).expect("test alive");
            if self.go.lock().recv().expect("test alive") {
                Ok(())
            } else {
                Err(Error::InvalidArgument("gate refused".into()))
            }
        }

        fn unmapping(&self, _: RegionInfo<'_>, _: u64, _: u64) {}
    }

    /// A pin of a block being backed waits until the backing is done, then pins it (or, when
    /// the backing failed, is refused as not backed); nothing is pinned meanwhile.
    #[test]
    fn pins_wait_for_blocks_being_backed() {
        let (entered_tx, entered) = mpsc::channel();
        let (go, go_rx) = mpsc::channel();
        let gate = Arc::new(Gate {
            entered: Mutex::new(entered_tx),
            go: Mutex::new(go_rx),
        });
        let b = Arc::new(backing(8, Some(gate)));
        for ok in [false, true] {
            // Blocks 0 and 1 backed (the gate let through), block 2 claimed by a backing
            // held in the gate.
            if !b.is_backed(0) {
                let b2 = b.clone();
                let t = std::thread::spawn(move || b2.ensure_backed(0..2));
                entered.recv().expect("mapping");
                go.send(true).expect("gate");
                t.join().expect("thread").expect("back");
            }
            let b2 = b.clone();
            let backer = std::thread::spawn(move || b2.ensure_backed([2]));
            entered.recv().expect("mapping");
            let b2 = b.clone();
            let pinner = std::thread::spawn(move || {
                b2.try_pin(0..3, "waiting")
                    .map(|p| p.blocks().to_vec())
                    .map_err(|e| format!("{e:?}"))
            });
            std::thread::sleep(Duration::from_millis(50));
            assert!(!pinner.is_finished(), "the pin waits for block 2");
            assert_eq!(b.stats().pinned_blocks, 0, "nothing pinned meanwhile");
            go.send(ok).expect("gate");
            assert_eq!(backer.join().expect("thread").is_ok(), ok);
            let got = pinner.join().expect("thread");
            if ok {
                assert_eq!(got, Ok(vec![0, 1, 2]));
            } else {
                assert_eq!(got, Err("NotBacked(2)".to_string()));
            }
            assert_eq!(b.stats().pinned_blocks, 0, "the pin went with its thread");
        }
    }

    /// Adopting chunks into a zero-filled region (a paged KV cache's) replaces the zero-page
    /// aliases under them, and a release that hands them on aliases the pages again: the books
    /// agree with what is mapped (an alias left in the book over adopted memory failed the
    /// audit; on CUDA the map over the alias failed outright).
    #[test]
    fn adopt_into_a_zeroed_region_replaces_the_zero_page() {
        let backend = Arc::new(HostBackend::new(4096).expect("host backend"));
        let pool = Pool::new(backend, PoolConfig::new(4 * 8192)).expect("pool");
        let region = pool
            .reserve_region_with(8192, &MemOptions::new().tag(Tag::Kv).zeroed())
            .expect("zeroed region");
        let b = BlockBacking::new(region, UniformBlocks::packed(2, 4096), None).expect("backing");
        assert_eq!(pool.stats().zero_aliased, 8192);
        let chunk = pool.backend().create(4096).expect("a chunk to adopt");
        b.adopt(&[0], vec![(0, chunk)]).expect("adopt block 0");
        pool.audit().expect("audit after the adopt");
        assert_eq!(pool.stats().zero_aliased, 4096, "block 1 alone is aliased");
        let data = [7u8; 4096];
        // SAFETY: block 0 is backed and nobody else uses it.
        unsafe { b.core.region.write(0, &data) }.expect("write the adopted page");
        let pin = b.pin([0], "test").expect("pin block 0");
        pin.release_as(ChunkFate::Release)
            .map_err(|e| e.0)
            .expect("release block 0, handing its chunk on");
        pool.audit().expect("audit after the release");
        assert_eq!(pool.stats().zero_aliased, 8192, "block 0 aliased again");
        // Block 0 reads zeros again (through the alias, not a fault).
        let p = b.addr() as *const u8;
        // SAFETY: aliased read-only to the zero page (checked by the stats above).
        assert_eq!(unsafe { std::ptr::read_volatile(p) }, 0);
    }

    /// Adopted memory carries the backing's tag like memory it maps itself (issue 22, defect
    /// 3): a sleep that discards `Kv` discards both.
    #[test]
    fn adopted_pages_carry_the_tag() {
        let b = backing(2, None);
        let pool = b.pool().clone();
        b.ensure_backed([1]).expect("back block 1");
        let chunk = pool.backend().create(4096).expect("a chunk to adopt");
        b.adopt(&[0], vec![(0, chunk)]).expect("adopt block 0");
        let policy = crate::SleepPolicy::offload_all().tag(Tag::Kv, crate::SleepAction::Discard);
        let r = pool.sleep(&policy).expect("sleep");
        let by_tag = pool.sleep_stats().asleep_by_tag;
        assert_eq!(by_tag, vec![(Tag::Kv, 8192)], "{r:?}");
        assert_eq!((r.offloaded, r.discarded), (0, 8192), "{r:?}");
        pool.wake(crate::AfterWake::KeepHostMemory).expect("wake");
        pool.audit().expect("audit");
    }
}
