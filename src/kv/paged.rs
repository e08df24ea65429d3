//! The block allocator of [`PagedKv`] over a [`BlockBacking`] of its tensors' region.
//!
//! Locking: the cache's book (a `parking_lot` mutex) is a leaf: never held across a call into
//! the backing (which maps and unmaps), the pool, or a drop. Blocks taken out of the book by an
//! operation belong to it alone until it puts them back, so driver calls happen unlocked.
//!
//! Free blocks out of both free lists (a release unmapping them, the look-ahead or a
//! compaction mapping them) are *in transit*: allocated by nobody, so `alloc` counts them
//! (`max_blocks - live`) and waits on `Core::landed` for them rather than refuse. Every path
//! that puts blocks back in a free list notifies `landed`. Such a wait ends with a map, an unmap
//! or a compaction's copy: none of them waits for an `alloc` of the cache.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::backing::{BlockBacking, BlockGeometry};
use crate::error::{round_up, Error, Result};
use crate::pool::{MemOptions, Pool, SleepWatcher};
use crate::tag::Tag;

/// A block of a [`PagedKv`]: an index `0..max_blocks` into the first dimension of its tensors.
pub type BlockId = usize;

/// How a [`PagedKv`] lays out its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLayout {
    /// Per layer a K and a V tensor `[max_blocks, block_tokens, kv_heads, head_dim]`, each
    /// starting on a page (layer `l`'s K is tensor `2l`, its V `2l + 1`). A block has one span
    /// in each tensor. The layout of mistral.rs and candle-vllm.
    PerLayer,
    /// One tensor `[max_blocks, layers, 2, block_tokens, kv_heads, head_dim]`: a block's K and
    /// V of every layer are contiguous (one span per block).
    Contiguous,
}

/// The mapped-but-free blocks a [`PagedKv`] keeps ahead of need (its background thread).
///
/// - When fewer than `low` blocks are warm, the thread maps more, up to `high`, with memory the
///   pool's admission gives at once only: never reclaimed or handed over from another model
///   (what is not free now is not taken; the thread tries again later).
/// - [`PagedKv::free`] keeps freed blocks warm up to `high`, and gives the rest back (all of
///   them after a [`PagedKv::trim`], until the next `alloc`).
/// - Once no `alloc` came for `idle_after`, the thread gives warm blocks above `low` back: after
///   a spike the cache is back at its idle floor (live blocks plus `low` warm ones) within
///   `idle_after` plus one `tick`.
/// - The thread starts with the cache and takes at most `high` blocks before any request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Watermarks {
    /// Warm blocks kept at least (the idle floor above the live blocks).
    pub low: usize,
    /// Warm blocks kept at most.
    pub high: usize,
    /// How long without an `alloc` before warm blocks above `low` are given back.
    pub idle_after: Duration,
    /// How often the thread looks when nothing wakes it.
    pub tick: Duration,
}

impl Watermarks {
    /// `low` and `high` warm blocks, back to `low` after 200 ms without an `alloc`.
    pub fn new(low: usize, high: usize) -> Self {
        Watermarks {
            low,
            high,
            idle_after: Duration::from_millis(200),
            tick: Duration::from_millis(20),
        }
    }
}

/// What a [`PagedKv`] holds: the model's shape, the block size and the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedKvConfig {
    /// Transformer layers (each has a K and a V).
    pub layers: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Bytes per element (2 for f16/bf16).
    pub elem_bytes: usize,
    /// Blocks of the cache (its largest size).
    pub max_blocks: usize,
    /// How the tensors are laid out.
    pub layout: KvLayout,
    /// Blocks kept mapped ahead of need, if any.
    pub watermarks: Option<Watermarks>,
    /// Whether pages under no block are aliased read-only to the pool's zero page (reads of an
    /// unallocated block give zeros) or left unmapped (reads fault). `None`: aliased, except
    /// on a host tier (page-locked host memory: a cache that holds offloaded blocks, which no
    /// kernel reads through a padded block table; CUDA also limits how many times one host
    /// allocation may be mapped, so a large host cache could not alias every page).
    pub zero_unbacked: Option<bool>,
    /// Whether block 0 is the reserved *null block*: backed and all zeros from creation to
    /// drop, never handed out by `alloc`, never freed, released, compacted or moved, so a block
    /// table padded with 0 (mistral.rs, candle-vllm) always reads zeros there, also on CUDA
    /// while neighbours on its pages are mapped or unmapped. It costs its pages (one per tensor,
    /// charged to the model as a live block's) for the cache's lifetime, and `max_blocks - 1`
    /// blocks are left to allocate. Off by default: the cache then holds no memory until the
    /// first `alloc` and hands out every block id, as before; turn it on where tables are
    /// padded with block 0.
    pub null_block: bool,
}

impl PagedKvConfig {
    /// A per-layer cache ([`KvLayout::PerLayer`]) without look-ahead.
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        block_tokens: usize,
        elem_bytes: usize,
        max_blocks: usize,
    ) -> Self {
        PagedKvConfig {
            layers,
            kv_heads,
            head_dim,
            block_tokens,
            elem_bytes,
            max_blocks,
            layout: KvLayout::PerLayer,
            watermarks: None,
            zero_unbacked: None,
            null_block: false,
        }
    }

    /// With block 0 reserved as the null block (`true`); see [`PagedKvConfig::null_block`].
    pub fn null_block(mut self, on: bool) -> Self {
        self.null_block = on;
        self
    }

    /// Blocks `alloc` can hand out: `max_blocks`, less the null block if reserved.
    pub fn allocatable_blocks(&self) -> usize {
        self.max_blocks - usize::from(self.null_block)
    }

    /// With unbacked pages aliased to the zero page (`true`) or unmapped (`false`); see
    /// [`PagedKvConfig::zero_unbacked`].
    pub fn zero_unbacked(mut self, zero: bool) -> Self {
        self.zero_unbacked = Some(zero);
        self
    }

    /// With `layout`.
    pub fn layout(mut self, layout: KvLayout) -> Self {
        self.layout = layout;
        self
    }

    /// With blocks kept mapped ahead of need.
    pub fn watermarks(mut self, w: Watermarks) -> Self {
        self.watermarks = Some(w);
        self
    }

    /// Bytes of one block in one K or V tensor of one layer.
    pub fn block_bytes_per_tensor(&self) -> Result<u64> {
        let overflow = || Error::SizeOverflow {
            what: "KV block",
            detail: format!(
                "{} tokens x {} heads x {} dims x {} bytes",
                self.block_tokens, self.kv_heads, self.head_dim, self.elem_bytes
            ),
        };
        [self.kv_heads, self.head_dim, self.elem_bytes]
            .iter()
            .try_fold(self.block_tokens as u64, |a, &d| a.checked_mul(d as u64))
            .ok_or_else(overflow)
    }

    fn check(&self) -> Result<()> {
        for (what, v) in [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("block_tokens", self.block_tokens),
            ("elem_bytes", self.elem_bytes),
            ("max_blocks", self.max_blocks),
        ] {
            if v == 0 {
                return Err(Error::InvalidArgument(format!(
                    "paged KV cache: {what} is 0 (layers {}, kv_heads {}, head_dim {}, block_tokens {}, elem_bytes {}, max_blocks {})",
                    self.layers, self.kv_heads, self.head_dim, self.block_tokens, self.elem_bytes, self.max_blocks
                )));
            }
        }
        if u32::try_from(self.max_blocks).is_err() {
            return Err(Error::InvalidArgument(format!(
                "paged KV cache: {} blocks, at most {}",
                self.max_blocks,
                u32::MAX
            )));
        }
        if self.null_block && self.max_blocks < 2 {
            return Err(Error::InvalidArgument(format!(
                "paged KV cache: a null block needs max_blocks of at least 2 (one reserved, one to allocate), got {}",
                self.max_blocks
            )));
        }
        if let Some(w) = self.watermarks {
            if w.low > w.high || w.high > self.allocatable_blocks() || w.tick.is_zero() {
                return Err(Error::InvalidArgument(format!(
                    "paged KV cache: watermarks low {} high {} tick {:?} must satisfy low <= high <= allocatable blocks ({}) and a tick above 0",
                    w.low, w.high, w.tick, self.allocatable_blocks()
                )));
            }
        }
        Ok(())
    }
}

/// Where each block lies: `tensors` tensors of `max_blocks` units of `unit` bytes, each tensor
/// starting every `stride` bytes (a whole number of pages).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvGeometry {
    pub(crate) tensors: u64,
    pub(crate) unit: u64,
    pub(crate) stride: u64,
    pub(crate) max_blocks: usize,
}

impl KvGeometry {
    fn new(c: &PagedKvConfig, page: u64) -> Result<Self> {
        let b = c.block_bytes_per_tensor()?;
        let kv = (c.layers as u64).checked_mul(2);
        let (tensors, unit) = match c.layout {
            KvLayout::PerLayer => (kv, Some(b)),
            KvLayout::Contiguous => (Some(1), kv.and_then(|t| t.checked_mul(b))),
        };
        let overflow = || Error::SizeOverflow {
            what: "paged KV cache",
            detail: format!(
                "{} layers x 2 x {} blocks of {b} bytes in pages of {page}",
                c.layers, c.max_blocks
            ),
        };
        let (tensors, unit) = tensors.zip(unit).ok_or_else(overflow)?;
        let bytes = unit.checked_mul(c.max_blocks as u64).ok_or_else(overflow)?;
        let stride = round_up("paged KV tensor", bytes, page)?;
        stride.checked_mul(tensors).ok_or_else(overflow)?;
        Ok(KvGeometry {
            tensors,
            unit,
            stride,
            max_blocks: c.max_blocks,
        })
    }

    /// Bytes of the region: every tensor in whole pages.
    fn region_bytes(&self) -> u64 {
        self.stride * self.tensors
    }
}

impl BlockGeometry for KvGeometry {
    fn num_blocks(&self) -> usize {
        self.max_blocks
    }

    fn extent(&self) -> Result<u64> {
        Ok(self.region_bytes())
    }

    fn block_spans(&self, block: usize, out: &mut Vec<(u64, u64)>) {
        for t in 0..self.tensors {
            out.push((t * self.stride + block as u64 * self.unit, self.unit));
        }
    }
}

/// A snapshot of a [`PagedKv`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PagedKvStats {
    /// Blocks of the cache.
    pub max_blocks: usize,
    /// Blocks allocated (handed out by `alloc`, not freed); the null block is not one of them.
    pub live: usize,
    /// Whether block 0 is the reserved null block ([`PagedKvConfig::null_block`]): always
    /// backed, its pages counted in `mapped_bytes` and `packed_floor_bytes`.
    pub null_block: bool,
    /// Free blocks kept mapped ahead of need.
    pub warm: usize,
    /// Bytes mapped under the tensors now.
    pub mapped_bytes: u64,
    /// Bytes the live blocks would need packed on as few pages as possible: the floor the
    /// mapped bytes are compared with (idle footprint after a spike).
    pub packed_floor_bytes: u64,
    /// Blocks mapped ahead by the background thread since the cache was made.
    pub mapped_ahead: u64,
    /// Look-ahead attempts the pool refused (no free budget at once); retried later.
    pub ahead_refused: u64,
    /// Warm blocks given back after an idle period or a trim.
    pub warm_returned: u64,
    /// Compactions that moved or re-placed blocks ([`PagedKv::compact`]).
    pub compactions: u64,
    /// Live blocks moved (renamed) by compactions.
    pub blocks_moved: u64,
    /// Bytes of pages compactions gave back to the pool.
    pub bytes_compacted: u64,
}

/// The allocator's books, under the cache's mutex (a leaf lock).
#[derive(Debug)]
pub(crate) struct Book {
    /// Allocated blocks, and the null block if reserved (so no path frees, moves or
    /// releases it as a free block; the paths that take live blocks refuse it by id).
    pub(super) live: Vec<bool>,
    /// Blocks marked in `live`.
    pub(super) live_count: usize,
    /// Free and backed.
    pub(super) warm: BTreeSet<usize>,
    /// Free and unbacked, ranked: blocks whose pages another block keeps mapped first (taking
    /// them costs no memory), then by id.
    pub(super) cold: BTreeSet<(u8, usize)>,
    /// Per group of blocks sharing their first page: blocks backed (live or warm).
    pub(super) group_backed: Vec<u32>,
    /// Live blocks of an `alloc` still mapping some of them (not handed out yet): never moved.
    pub(super) in_alloc: BTreeSet<usize>,
    /// Live blocks a compaction is copying (they cannot be freed until it ends).
    pub(super) moving: BTreeSet<usize>,
    /// Live blocks a move between caches ([`super::KvMove`]) copies from or into: neither
    /// freed nor compacted until it is waited for, and the pool does not sleep meanwhile.
    pub(super) tiered: BTreeSet<usize>,
    /// A compaction runs (one at a time).
    pub(super) compacting: bool,
    /// Compactions' give-backs still releasing their blocks (in transit meanwhile); a trim
    /// waits for them.
    pub(super) giving_back: usize,
    /// Their threads, joined when the cache is dropped.
    pub(super) give_backs: Vec<std::thread::JoinHandle<()>>,
    pub(super) compactions: u64,
    pub(super) blocks_moved: u64,
    pub(super) bytes_compacted: u64,
    pub(crate) asleep: bool,
    /// [`PagedKv::trim`] ran and no `alloc` since: the look-ahead thread maps nothing and
    /// `free` keeps nothing warm (a trim in a reclaim would otherwise be undone a tick later,
    /// or by the frees after it, under a limit being lowered).
    pub(crate) trimmed: bool,
    /// The look-ahead thread has a batch out of the free lists (mapping, or giving back after
    /// a trim came meanwhile); a trim waits for it to land.
    pub(crate) ahead_busy: bool,
    pub(crate) stop: bool,
    pub(crate) last_alloc: Instant,
    pub(crate) mapped_ahead: u64,
    pub(crate) ahead_refused: u64,
    pub(crate) warm_returned: u64,
}

/// Shared by the handle and the background thread.
pub(crate) struct Core {
    pub(crate) backing: BlockBacking<KvGeometry>,
    pub(super) geo: KvGeometry,
    pub(super) page: u64,
    pub(crate) config: PagedKvConfig,
    pub(crate) book: Mutex<Book>,
    /// Wakes the background thread (warm below low, stop).
    pub(crate) wake: Condvar,
    /// Blocks in transit landed in a free list, or the look-ahead's batch did (see the module
    /// documentation): wakes an `alloc` or a trim waiting for them.
    pub(super) landed: Condvar,
    pub(super) pool: Pool,
    watcher: u64,
    /// Called before pages may be unmapped (set once by a face whose device queues work, e.g.
    /// the candle one: waits for the GPU to finish what was queued on the blocks).
    before_release: std::sync::OnceLock<BeforeRelease>,
}

/// The id of the reserved null block ([`PagedKvConfig::null_block`]).
pub(crate) const NULL_BLOCK: BlockId = 0;

/// Write zeros over the null block's span in every tensor (mapped with access): its pages
/// may come from the pool's cache, or back from a sleep that discarded their contents.
fn zero_null_block(pool: &Pool, geo: &KvGeometry, base: u64) -> Result<()> {
    let mut spans = Vec::with_capacity(geo.tensors as usize);
    geo.block_spans(NULL_BLOCK, &mut spans);
    let len = usize::try_from(geo.unit).map_err(|_| Error::SizeOverflow {
        what: "KV null block",
        detail: format!("a span of {} bytes", geo.unit),
    })?;
    for (offset, _) in spans {
        // SAFETY: the null block is backed (mapped with access) for as long as the cache lives
        // and the pool is awake; nothing else writes it (no `alloc` hands it out).
        unsafe { pool.backend().copies().fill(base + offset, len, 0) }?;
    }
    Ok(())
}

/// See `Core::before_release`.
pub(crate) type BeforeRelease = Box<dyn Fn() -> Result<()> + Send + Sync>;

/// A paged KV cache over a pool; see the [module documentation](crate::kv).
/// `Send + Sync`; every method takes `&self`.
pub struct PagedKv {
    core: Arc<Core>,
    ahead: Option<super::ahead::Ahead>,
}

impl fmt::Debug for PagedKv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagedKv")
            .field("config", &self.core.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Book {
    pub(crate) fn warm_len(&self) -> usize {
        self.warm.len()
    }

    pub(super) fn rank(&self, geo: &KvGeometry, page: u64, b: usize) -> u8 {
        u8::from(self.group_backed[group_of(geo, page, b)] == 0)
    }
}

pub(super) fn group_of(geo: &KvGeometry, page: u64, b: usize) -> usize {
    (b as u64 * geo.unit / page) as usize
}

impl PagedKv {
    /// A cache shaped by `config` in a region of `pool` (a [`crate::ModelHandle`] derefs to its
    /// pool): the address space of every tensor reserved, each unbacked page aliased to the
    /// zero page (unless [`PagedKvConfig::zero_unbacked`] says otherwise), no memory of its
    /// own yet. Tagged [`Tag::Kv`]. With watermarks, the
    /// background thread starts here.
    ///
    /// The pool's zero page (one granule per pool, made with its first zero-filled region) is
    /// charged like any of its memory: to the pool's limit, or to the model's line of a
    /// [`crate::SharedPool`].
    ///
    /// Errors: a zero or overflowing shape, watermarks out of order, a reservation the pool
    /// cannot hold, a backend that cannot map read-only, a limit with no room for the zero
    /// page ([`crate::Error::OutOfPhysicalMemory`] naming it); nothing is left reserved or
    /// mapped.
    pub fn new(pool: &Pool, config: PagedKvConfig) -> Result<PagedKv> {
        config.check()?;
        let page = pool.granularity();
        let geo = KvGeometry::new(&config, page)?;
        let info = pool.backend_info();
        let host_tier = info.memory_kind == crate::MemoryKind::Host && info.page_locked;
        let options = MemOptions::new().tag(Tag::Kv);
        let options = if config.zero_unbacked.unwrap_or(!host_tier) {
            options.zeroed()
        } else {
            options
        };
        let region = pool.reserve_region_with(geo.region_bytes(), &options)?;
        if info.memory_kind == crate::MemoryKind::Device {
            // A compaction's copies are one gather launch: its kernel is loaded now rather
            // than inside the first compaction an engine waits for (CUDA JIT-compiles it).
            if let Err(e) = pool.backend().copies().prepare_gather() {
                tracing::debug!(error = %e, "no gather kernel: compactions copy span by span");
            }
        }
        let backing = BlockBacking::new(region, geo, None)?;
        let groups = group_of(&geo, page, config.max_blocks - 1) + 1;
        let mut group_backed = vec![0; groups];
        let mut live = vec![false; config.max_blocks];
        if config.null_block {
            // Backed before anyone can see the cache; dropping the backing on an error unmaps
            // and uncharges it.
            backing.ensure_backed([NULL_BLOCK])?;
            zero_null_block(pool, &geo, backing.addr())?;
            live[NULL_BLOCK] = true;
            group_backed[group_of(&geo, page, NULL_BLOCK)] = 1;
        }
        // Free blocks on the null block's pages cost nothing to take: ranked first.
        let rank = |b: usize| u8::from(group_backed[group_of(&geo, page, b)] == 0);
        let book = Book {
            live_count: usize::from(config.null_block),
            warm: BTreeSet::new(),
            cold: (0..config.max_blocks)
                .filter(|&b| !live[b])
                .map(|b| (rank(b), b))
                .collect(),
            live,
            group_backed,
            in_alloc: BTreeSet::new(),
            moving: BTreeSet::new(),
            tiered: BTreeSet::new(),
            compacting: false,
            giving_back: 0,
            give_backs: Vec::new(),
            compactions: 0,
            blocks_moved: 0,
            bytes_compacted: 0,
            asleep: false,
            trimmed: false,
            ahead_busy: false,
            stop: false,
            last_alloc: Instant::now(),
            mapped_ahead: 0,
            ahead_refused: 0,
            warm_returned: 0,
        };
        let inner = pool.inner().clone();
        let core = Arc::new_cyclic(|weak: &std::sync::Weak<Core>| {
            let watcher: std::sync::Weak<dyn SleepWatcher> = weak.clone();
            Core {
                backing,
                geo,
                page,
                config: config.clone(),
                book: Mutex::new(book),
                wake: Condvar::new(),
                landed: Condvar::new(),
                pool: pool.clone(),
                watcher: inner.add_watcher(watcher),
                before_release: std::sync::OnceLock::new(),
            }
        });
        let ahead = match config.watermarks {
            Some(w) => Some(super::ahead::Ahead::start(core.clone(), w)?),
            None => None,
        };
        tracing::debug!(pool = %pool.name(), ?config, bytes = geo.region_bytes(), "paged KV cache reserved");
        Ok(PagedKv { core, ahead })
    }

    /// Make `f` run before any page of the cache may be unmapped (a release of blocks), once
    /// per release; an error keeps the blocks mapped (warm). Set once, by a face that queues
    /// device work on the blocks, right after `new`; later calls are ignored.
    #[cfg_attr(not(feature = "candle"), allow(dead_code))]
    pub(crate) fn set_before_release(&self, f: BeforeRelease) {
        let _ = self.core.before_release.set(f);
    }

    /// What the cache was made with.
    pub fn config(&self) -> &PagedKvConfig {
        &self.core.config
    }

    /// Address of the first byte of the tensors' region (tensor 0).
    pub fn addr(&self) -> u64 {
        self.core.backing.addr()
    }

    /// Address of tensor `t` ([`KvLayout::PerLayer`]: layer `t / 2`, K if even, V if odd;
    /// [`KvLayout::Contiguous`]: `t` is 0). `None` past the last tensor.
    pub fn tensor_addr(&self, t: usize) -> Option<u64> {
        (t < self.core.geo.tensors as usize).then(|| self.addr() + t as u64 * self.core.geo.stride)
    }

    /// Number of tensors: `2 * layers` per layer, 1 contiguous.
    pub fn tensors(&self) -> usize {
        self.core.geo.tensors as usize
    }

    /// Bytes of one block in one tensor (the block's span).
    pub fn block_span_bytes(&self) -> u64 {
        self.core.geo.unit
    }

    /// The pool the cache lives in.
    pub fn pool(&self) -> &Pool {
        &self.core.pool
    }

    pub(super) fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// `n` free blocks (free ones a release or the look-ahead is unmapping or mapping are
    /// waited for, not refused), each mapped in every tensor when this returns (one request for the
    /// memory it needs, under the model's limit; reclaim from others as any required growth).
    /// Blocks kept warm are taken first, so in steady state no driver call is made. `n == 0`
    /// gives none. Errors (fewer free blocks than `n`, a refused admission, the pool asleep, a
    /// driver failure) allocate nothing and leave nothing mapped or charged.
    pub fn alloc(&self, n: usize) -> Result<Vec<BlockId>> {
        self.core.alloc(n, false)
    }

    /// Give back `ids`, each allocated and named once. Freed blocks stay mapped while warm
    /// blocks are below the high watermark (none after a trim, until the next `alloc`); the
    /// rest are released (a page goes back to the
    /// pool when no backed block touches it). A bad id (out of range, not allocated, repeated)
    /// is an error naming it and frees nothing.
    pub fn free(&self, ids: &[BlockId]) -> Result<()> {
        self.core.free(ids)
    }

    /// Blocks that could be allocated now without reclaiming anything: warm ones, free ones
    /// on pages mapped already, and as many others as the pool's free budget maps (exact when
    /// a block's span divides the page or is a whole number of pages).
    pub fn available(&self) -> usize {
        self.core.available()
    }

    /// Whether `id` is allocated (the null block is not: it is reserved).
    pub fn is_live(&self, id: BlockId) -> bool {
        !self.core.is_null(id) && self.core.book.lock().live.get(id).copied().unwrap_or(false)
    }

    /// The reserved null block's id (0), if [`PagedKvConfig::null_block`] is on: pad block
    /// tables with it.
    pub fn null_block(&self) -> Option<BlockId> {
        self.core.config.null_block.then_some(NULL_BLOCK)
    }

    /// Give every warm block back (pages no live block touches go back to the pool), a batch
    /// the background thread is mapping ahead included (waited for: when this returns, no
    /// memory of the cache is warm or on its way to being warm), and compactions' give-backs
    /// still running waited for. Returns the blocks released here. Until the next `alloc`, the thread maps nothing and freed blocks are not kept warm.
    pub fn trim(&self) -> usize {
        self.core.trim()
    }

    /// A snapshot.
    pub fn stats(&self) -> PagedKvStats {
        self.core.stats()
    }

    /// Move live blocks off sparsely used pages into free slots of densely used pages that are
    /// mapped already, and give the emptied pages back to the pool (on a background thread once
    /// this returns: [`Compaction::give_back`](super::Compaction::give_back) waits for it, as
    /// [`PagedKv::trim`] and the cache's drop do): at most `max_moves` blocks
    /// moved per call (bounded work: call it between steps, again until it returns an empty
    /// [`Compaction`](super::Compaction)). Returns the renaming `old id -> new id` ([`Compaction::moves`](super::Compaction::moves)), which
    /// the engine applies to its block tables before queuing more work on those blocks.
    ///
    /// Blocks move into the densest pages that together hold every live and warm block; a
    /// page is emptied whole or not at all (half an evacuation gives nothing back), so
    /// `max_moves` below `page / span - 1` may move nothing;
    /// a cache whose blocks do not share pages evenly (`page % span != 0`, or one block per
    /// page) never moves anything. Warm blocks of an emptied page are replaced by warm blocks on
    /// the target pages (no copy, no memory).
    ///
    /// Contract: the old ids stay live, and cannot be freed (the error says why), until this
    /// returns; work in flight on a moved block must be done or ordered before the copy. On
    /// device memory the copy is one gather launch on CUDA's legacy default stream, which runs
    /// after everything queued before on blocking streams (candle's per-thread streams among
    /// them), then waited for; on host memory, staging copies (a host `memcpy`). Blocks being
    /// copied are pinned: no release unmaps them and a sleep of the pool is refused meanwhile.
    /// Nothing in safe code can make the copy touch unmapped memory or memory behind a Rust
    /// reference (the cache hands none out).
    ///
    /// Errors: `max_moves == 0`; the pool asleep ([`Error::Asleep`]); another compaction
    /// running ([`Error::KvCompactionBusy`]); a failure to back the destinations, to pin, or to
    /// copy ([`Error::KvCompactionFailed`]): then nothing moved, every block keeps its id and
    /// contents, and what the compaction took is free again.
    pub fn compact(&self, max_moves: usize) -> Result<super::Compaction> {
        self.core.compact(max_moves, crate::backend::LEGACY_STREAM)
    }

    /// [`PagedKv::compact`] with the copies queued on the GPU stream `stream` (a raw
    /// `CUstream`, or CUDA's special handles 1 and 2); ignored on host memory.
    #[cfg_attr(not(feature = "candle"), allow(dead_code))]
    pub(crate) fn compact_on(&self, max_moves: usize, stream: u64) -> Result<super::Compaction> {
        self.core.compact(max_moves, stream)
    }

    /// What [`PagedKv::compact`] without a move limit would do now: blocks it would move,
    /// bytes it would copy, bytes of pages it would give back. Costs a pass over the blocks
    /// (no driver call); an engine compares `bytes_released` with what it would gain, e.g.
    /// against [`PagedKvStats::mapped_bytes`] and [`PagedKvStats::packed_floor_bytes`].
    pub fn compaction_gain(&self) -> super::CompactionGain {
        self.core.compaction_gain()
    }
}

impl Drop for PagedKv {
    fn drop(&mut self) {
        // The threads first (they hold the core), then the core: its backing unmaps the pages.
        if let Some(a) = self.ahead.take() {
            a.stop(&self.core);
        }
        let give_backs = std::mem::take(&mut self.core.book.lock().give_backs);
        for t in give_backs {
            if t.join().is_err() {
                tracing::error!("a KV compaction's give-back thread panicked");
            }
        }
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        self.pool.inner().remove_watcher(self.watcher);
    }
}

impl Core {
    pub(super) fn asleep_error(&self, op: &'static str) -> Error {
        Error::Asleep {
            pool: self.pool.name().to_string(),
            op,
            state: "asleep",
        }
    }

    /// Allocate `n` blocks; `pin`: as blocks a move copies into (in `tiered` from the moment
    /// they are taken, so no compaction renames them before the move knows them).
    pub(super) fn alloc(&self, n: usize, pin: bool) -> Result<Vec<BlockId>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let max = self.config.max_blocks;
        let (ids, to_back, low) = {
            let mut book = self.book.lock();
            loop {
                if book.asleep {
                    return Err(self.asleep_error("alloc"));
                }
                book.trimmed = false;
                if n <= book.warm.len() + book.cold.len() {
                    break;
                }
                // Allocated by nobody: the free lists and blocks in transit, which land free.
                let free = max - book.live_count;
                if n > free {
                    return Err(Error::KvOutOfBlocks {
                        requested: n,
                        free,
                        max_blocks: max,
                    });
                }
                self.landed.wait(&mut book);
            }
            let mut ids = Vec::with_capacity(n);
            let mut to_back = Vec::new();
            // Free blocks on pages mapped already (no memory), then warm, then fresh pages.
            while ids.len() < n {
                let first_cold = book.cold.first().copied();
                let b = match first_cold {
                    Some((0, b)) => {
                        book.cold.remove(&(0, b));
                        to_back.push(b);
                        b
                    }
                    _ => match book.warm.pop_first() {
                        Some(b) => b,
                        None => {
                            // `n <= free` so a cold one is there.
                            let Some((r, b)) = first_cold else { break };
                            book.cold.remove(&(r, b));
                            to_back.push(b);
                            b
                        }
                    },
                };
                book.live[b] = true;
                ids.push(b);
            }
            book.live_count += ids.len();
            if pin {
                book.tiered.extend(ids.iter().copied());
            }
            if !to_back.is_empty() {
                // Every block of the alloc, warm ones too: none is handed out until the map
                // below is done, so a compaction meanwhile must not move (rename) any of them.
                book.in_alloc.extend(ids.iter().copied());
            }
            book.last_alloc = Instant::now();
            let low = self
                .config
                .watermarks
                .is_some_and(|w| book.warm.len() < w.low);
            (ids, to_back, low)
        };
        if low {
            self.wake.notify_all();
        }
        if to_back.is_empty() {
            return Ok(ids);
        }
        match self.backing.ensure_backed(to_back.iter().copied()) {
            Ok(_) => {
                let mut book = self.book.lock();
                for &b in &ids {
                    book.in_alloc.remove(&b);
                }
                for &b in &to_back {
                    self.backed(&mut book, b);
                }
                Ok(ids)
            }
            Err(e) => {
                let mut book = self.book.lock();
                for &b in &ids {
                    book.in_alloc.remove(&b);
                    book.tiered.remove(&b);
                    book.live[b] = false;
                    if to_back.contains(&b) {
                        let r = book.rank(&self.geo, self.page, b);
                        book.cold.insert((r, b));
                    } else {
                        book.warm.insert(b);
                    }
                }
                book.live_count -= ids.len();
                self.landed.notify_all();
                Err(e)
            }
        }
    }

    /// `b` became backed: its group's other cold blocks cost nothing now.
    pub(super) fn backed(&self, book: &mut Book, b: usize) {
        let g = group_of(&self.geo, self.page, b);
        book.group_backed[g] += 1;
        if book.group_backed[g] == 1 {
            self.rerank(book, g, 1, 0);
        }
    }

    /// `b` was released.
    fn unbacked(&self, book: &mut Book, b: usize) {
        let g = group_of(&self.geo, self.page, b);
        book.group_backed[g] -= 1;
        if book.group_backed[g] == 0 {
            self.rerank(book, g, 0, 1);
        }
    }

    fn rerank(&self, book: &mut Book, g: usize, from: u8, to: u8) {
        let (unit, page) = (self.geo.unit, self.page);
        let first = (g as u64 * page).div_ceil(unit) as usize;
        let mut b = first;
        while b < self.config.max_blocks && group_of(&self.geo, page, b) == g {
            if book.cold.remove(&(from, b)) {
                book.cold.insert((to, b));
            }
            b += 1;
        }
    }

    /// Whether `b` is the reserved null block.
    pub(super) fn is_null(&self, b: BlockId) -> bool {
        self.config.null_block && b == NULL_BLOCK
    }

    pub(super) fn free(&self, ids: &[BlockId]) -> Result<()> {
        self.free_as(ids, false)
    }

    /// [`Core::free`]; `unpin`: the blocks are a settled move's, pinned in `tiered`: unpinned
    /// and freed under one lock (between two, another thread could free an unpinned id, have
    /// it allocated again, and this free would then take the new owner's block).
    pub(super) fn free_as(&self, ids: &[BlockId], unpin: bool) -> Result<()> {
        let to_release = self.take_freed(ids, unpin, false)?;
        self.release(&to_release);
        Ok(())
    }

    /// [`Core::free_as`] whose pages go back on a background thread, as a compaction's do
    /// (a trim, a sleep and the cache's drop wait for it): for a move between caches, whose
    /// engine waits for the copies, not for the source's unmaps.
    pub(super) fn free_in_background(self: &Arc<Self>, ids: &[BlockId], unpin: bool) -> Result<()> {
        let to_release = self.take_freed(ids, unpin, true)?;
        if !to_release.is_empty() {
            drop(self.give_back(to_release, Vec::new(), false));
        }
        Ok(())
    }

    /// The book's part of a free: marks `ids` free (all or none), keeps some warm, and
    /// returns the rest, in transit, for the caller to release; with `giving_back`, counted
    /// as a give-back in the same critical section when there is any.
    fn take_freed(&self, ids: &[BlockId], unpin: bool, giving_back: bool) -> Result<Vec<usize>> {
        let max = self.config.max_blocks;
        let to_release = {
            let mut book = self.book.lock();
            for (i, &b) in ids.iter().enumerate() {
                let reason = if b >= max {
                    Some("out of range")
                } else if self.is_null(b) {
                    Some("the reserved null block (never allocated, never freed)")
                } else if book.moving.contains(&b) {
                    Some("being moved by a compaction (free it under its new id once compact returns)")
                } else if book.tiered.contains(&b) != unpin {
                    Some(if unpin {
                        "not pinned by the move that frees it"
                    } else {
                        "being moved between caches (free it once the move is waited for)"
                    })
                } else if book.in_alloc.contains(&b) {
                    // Freed before its alloc returned: the alloc would then hand out a free
                    // block (or put it back twice on failure).
                    Some("not handed out yet (its alloc is still mapping)")
                } else if book.live[b] {
                    None
                } else if ids[..i].contains(&b) {
                    Some("named twice in one free")
                } else {
                    Some("not allocated (freed twice, or never allocated)")
                };
                if let Some(reason) = reason {
                    for &p in &ids[..i] {
                        book.live[p] = true;
                    }
                    return Err(Error::KvBadBlock {
                        block: b,
                        max_blocks: max,
                        reason,
                    });
                }
                // Marked free as we go: a repeat finds itself free (caught above).
                book.live[b] = false;
            }
            // After a trim (until the next alloc) nothing is kept warm: a reclaim's frees
            // would otherwise refill what its trim gave back.
            let keep = match self.config.watermarks {
                Some(w) if !book.trimmed => w.high.saturating_sub(book.warm.len()),
                _ => 0,
            }
            .min(ids.len());
            book.live_count -= ids.len();
            if unpin {
                for b in ids {
                    book.tiered.remove(b);
                }
            }
            for &b in &ids[..keep] {
                book.warm.insert(b);
            }
            self.landed.notify_all();
            if giving_back && keep < ids.len() {
                // Counted here: a trim from now on waits for it.
                book.giving_back += 1;
            }
            ids[keep..].to_vec()
        };
        Ok(to_release)
    }

    /// Release backed, free blocks taken out of the book (none live or warm): unmapped where
    /// no other block needs the page, then cold again. Returns the bytes unmapped.
    pub(crate) fn release(&self, blocks: &[usize]) -> u64 {
        if blocks.is_empty() {
            return 0;
        }
        let ready = match self.before_release.get() {
            Some(f) => f(),
            None => Ok(()),
        };
        let released = ready.and_then(|()| self.backing.release(blocks.iter().copied()));
        match released {
            Ok(change) => {
                let mut book = self.book.lock();
                for &b in blocks {
                    self.unbacked(&mut book, b);
                    let r = book.rank(&self.geo, self.page, b);
                    book.cold.insert((r, b));
                }
                self.landed.notify_all();
                change.bytes
            }
            Err(e) => {
                // The device wait failed, or the release did (only a compaction pins, and only
                // blocks that are live or its own): keep them warm, still backed.
                tracing::error!(error = %e, blocks = blocks.len(), "releasing KV blocks failed; they stay mapped as warm blocks");
                let mut book = self.book.lock();
                book.warm.extend(blocks.iter().copied());
                self.landed.notify_all();
                0
            }
        }
    }

    /// Release warm blocks above `keep`, highest ids first. Returns the blocks released.
    pub(crate) fn release_warm(&self, keep: usize) -> usize {
        let taken: Vec<usize> = {
            let mut book = self.book.lock();
            let over = book.warm.len().saturating_sub(keep);
            let mut t = Vec::with_capacity(over);
            for _ in 0..over {
                if let Some(b) = book.warm.pop_last() {
                    t.push(b);
                }
            }
            book.warm_returned += t.len() as u64;
            t
        };
        self.release(&taken);
        taken.len()
    }

    /// Map up to `want` cold blocks ahead of need with memory given at once, one page per
    /// tensor at a time (so a budget that holds part of `want` is used, and a refusal costs one
    /// request). Returns the blocks made warm.
    pub(crate) fn map_ahead(&self, want: usize) -> usize {
        let per_group = (self.page / self.geo.unit).max(1) as usize;
        let mut done = 0;
        while done < want {
            let n = self.map_ahead_once((want - done).min(per_group));
            if n == 0 {
                break;
            }
            done += n;
        }
        done
    }

    fn map_ahead_once(&self, want: usize) -> usize {
        let taken: Vec<usize> = {
            let mut book = self.book.lock();
            if book.asleep || book.trimmed {
                return 0;
            }
            let mut t = Vec::with_capacity(want);
            while t.len() < want {
                let Some((_, b)) = book.cold.pop_first() else {
                    break;
                };
                t.push(b);
            }
            book.ahead_busy = !t.is_empty();
            t
        };
        if taken.is_empty() {
            return 0;
        }
        let ok = self.backing.ensure_backed_ahead(taken.iter().copied());
        let mut book = self.book.lock();
        let made = match ok {
            Ok(_) if book.trimmed => {
                // A trim came while these were mapping (it waits for this batch): it holds
                // until the next alloc, so they go back rather than sit warm under a limit
                // being lowered.
                for &b in &taken {
                    self.backed(&mut book, b);
                }
                drop(book);
                self.release(&taken);
                book = self.book.lock();
                0
            }
            Ok(_) => {
                for &b in &taken {
                    self.backed(&mut book, b);
                    book.warm.insert(b);
                }
                book.mapped_ahead += taken.len() as u64;
                taken.len()
            }
            Err(e) => {
                tracing::trace!(error = %e, blocks = taken.len(), "KV look-ahead refused");
                book.ahead_refused += 1;
                for &b in &taken {
                    let r = book.rank(&self.geo, self.page, b);
                    book.cold.insert((r, b));
                }
                0
            }
        };
        book.ahead_busy = false;
        self.landed.notify_all();
        made
    }

    /// See [`PagedKv::trim`]. The wait for the look-ahead's batch is bounded by its map: the
    /// look-ahead takes only memory admission gives at once (no reclaim, so no callback, such
    /// as the one this trim may run in, is waited for). The wait for compactions' give-backs is
    /// bounded by their unmaps (a release asks nobody for anything).
    pub(super) fn trim(&self) -> usize {
        {
            let mut book = self.book.lock();
            book.trimmed = true;
            while book.ahead_busy || book.giving_back > 0 {
                self.landed.wait(&mut book);
            }
        }
        let released = self.release_warm(0);
        // Pages a release could not unmap (a give-back a sleep overtook) go now.
        let left = self.backing.unmap_unused();
        if left > 0 {
            tracing::debug!(
                bytes = left,
                "trim unmapped pages a release had left mapped"
            );
        }
        released
    }

    fn available(&self) -> usize {
        let (warm, shared, fresh) = {
            let book = self.book.lock();
            let shared = book.cold.range((0, 0)..(1, 0)).count();
            (book.warm.len(), shared, book.cold.len() - shared)
        };
        let per_group = (self.page / self.geo.unit).max(1);
        let group_bytes = self.geo.tensors * self.geo.unit.div_ceil(self.page) * self.page;
        let fits = match self.pool.headroom() {
            None => fresh as u64,
            Some(room) => (room / group_bytes).saturating_mul(per_group),
        };
        warm + shared + fits.min(fresh as u64) as usize
    }

    fn stats(&self) -> PagedKvStats {
        let (live, warm, ahead, refused, returned, compacted) = {
            let b = self.book.lock();
            (
                b.live_count,
                b.warm.len(),
                b.mapped_ahead,
                b.ahead_refused,
                b.warm_returned,
                (b.compactions, b.blocks_moved, b.bytes_compacted),
            )
        };
        let per_group = (self.page / self.geo.unit).max(1);
        let group_bytes = self.geo.tensors * self.geo.unit.div_ceil(self.page) * self.page;
        let null = usize::from(self.config.null_block);
        PagedKvStats {
            max_blocks: self.config.max_blocks,
            live: live - null,
            null_block: self.config.null_block,
            warm,
            mapped_bytes: self.backing.stats().mapped_bytes,
            packed_floor_bytes: (live as u64).div_ceil(per_group) * group_bytes,
            mapped_ahead: ahead,
            ahead_refused: refused,
            warm_returned: returned,
            compactions: compacted.0,
            blocks_moved: compacted.1,
            bytes_compacted: compacted.2,
        }
    }
}

impl SleepWatcher for Core {
    fn settle(&self) {
        // A compaction's give-back unmaps, refused once the pool is falling asleep.
        let mut book = self.book.lock();
        while book.giving_back > 0 {
            self.landed.wait(&mut book);
        }
    }

    fn freeze(&self) -> Result<()> {
        let mut book = self.book.lock();
        if !book.tiered.is_empty() {
            return Err(Error::SleepRefused {
                pool: self.pool.name().to_string(),
                op: "sleep",
                reason: format!(
                    "{} block(s) of a paged KV cache are being moved between caches; retry when the moves are waited for",
                    book.tiered.len()
                ),
            });
        }
        book.asleep = true;
        // An alloc waiting for blocks in transit is refused now.
        self.landed.notify_all();
        Ok(())
    }

    fn thaw(&self) {
        self.book.lock().asleep = false;
        self.wake.notify_all();
    }

    fn unmapping_all(&self) {}

    fn mapped_all(&self) -> Result<()> {
        // A sleep may have discarded the null block's contents: zeros again before any
        // kernel can read it.
        if self.config.null_block {
            zero_null_block(&self.pool, &self.geo, self.backing.addr())?;
        }
        Ok(())
    }
}
