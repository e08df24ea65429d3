//! [`BlockPool`]: the block-pool face candle engines (mistral.rs, candle-vllm) call, over a
//! [`PagedKv`], with a prefix cache whose unreferenced blocks are reclaimable.
//!
//! Locking: the pool's state (a `parking_lot` mutex) is a leaf: never held across a call into
//! the [`PagedKv`] (which maps, unmaps and may ask other models for memory). Blocks taken out of
//! the state by an operation (evicted ones) belong to it alone until it frees them.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::Mutex;

use super::paged::{BlockId, PagedKv, PagedKvConfig};
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::shared::ModelHandle;

/// The content hash of a full block, as the engine computes it (mistral.rs and vLLM hash the
/// block's tokens chained with the previous block's hash). Opaque to the pool.
pub type BlockHash = u64;

/// How a model's KV cache is sized from its budget ([`PagedKvConfig::size_for_budget`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSizing {
    /// Blocks of the cache ([`PagedKvConfig::max_blocks`]): every one of them backed fits in
    /// the limit beside the reserved bytes (the null block, if any, is one of them).
    pub max_blocks: usize,
    /// Blocks the guarantee covers beside the reserved bytes: what the model can always hold,
    /// whatever the other models do (the null block, if any, is one of them).
    pub guaranteed_blocks: usize,
    /// Bytes of physical memory per block when blocks are packed on pages: its span in every
    /// tensor.
    pub block_bytes: u64,
}

impl PagedKvConfig {
    /// Blocks whose pages fit in `budget - reserved` bytes (less one page for the zero page
    /// unless [`PagedKvConfig::zero_unbacked`] is `Some(false)`), pages of `page`
    /// bytes: each tensor gets an equal share rounded down to whole pages, and holds as many
    /// blocks as fit in it.
    /// Ignores [`PagedKvConfig::max_blocks`]. `Ok(0)` when `reserved >= budget`.
    ///
    /// Errors: a zero `page`, an overflowing block size.
    pub fn blocks_for_budget(&self, budget: u64, reserved: u64, page: u64) -> Result<usize> {
        if page == 0 {
            return Err(Error::ZeroSize {
                what: "page size for KV sizing",
            });
        }
        let (tensors, unit) = self.tensors_and_unit()?;
        // The zero page under unbacked pages is one page of the model's memory too.
        let zero_page = if self.zero_unbacked.unwrap_or(true) {
            page
        } else {
            0
        };
        let Some(kv) = reserved
            .checked_add(zero_page)
            .and_then(|r| budget.checked_sub(r))
        else {
            return Ok(0);
        };
        let per_tensor = kv / tensors / page * page;
        let blocks = per_tensor / unit;
        Ok(usize::try_from(blocks.min(u64::from(u32::MAX))).unwrap_or(u32::MAX as usize))
    }

    /// Size the cache from a model's budget instead of a fraction of the device's free memory:
    /// `max_blocks` from its `limit`, `guaranteed_blocks` from its `guarantee`, each less
    /// `reserved` (the weights and whatever else the model's pool holds beside the cache), in
    /// pages of `page` bytes (the pool's granularity).
    ///
    /// This is what replaces mistral.rs's `MemoryGpuConfig::Utilization(0.9)` and
    /// candle-vllm's `--kv-fraction`: those read the device's free memory at start-up, so two
    /// models started together both see the same free memory, both size for it, and the second
    /// to fill its cache runs out of memory. Sized by budget, each model's cache depends on its
    /// own limit only, never on start order; the [`PagedKv`] maps blocks only when allocated, so
    /// `max_blocks` costs address space, and admission keeps every model under its limit.
    ///
    /// Errors: a limit that leaves no block ([`Error::InvalidArgument`], with the numbers; two
    /// with a null block), a guarantee above the limit, a zero page, an overflowing block size.
    pub fn size_for_budget(
        &self,
        limit: u64,
        guarantee: u64,
        reserved: u64,
        page: u64,
    ) -> Result<KvSizing> {
        if guarantee > limit {
            return Err(Error::InvalidArgument(format!(
                "KV sizing: guarantee {guarantee} is above the limit {limit}"
            )));
        }
        let max_blocks = self.blocks_for_budget(limit, reserved, page)?;
        let least = 1 + usize::from(self.null_block);
        if max_blocks < least {
            return Err(Error::InvalidArgument(format!(
                "KV sizing: a limit of {limit} bytes less {reserved} reserved holds {max_blocks} blocks in pages of {page}, at least {least} needed"
            )));
        }
        let guaranteed_blocks = self.blocks_for_budget(guarantee, reserved, page)?;
        let (tensors, unit) = self.tensors_and_unit()?;
        Ok(KvSizing {
            max_blocks,
            guaranteed_blocks,
            // Cannot overflow: `tensors * unit * max_blocks` fits below the limit.
            block_bytes: tensors * unit,
        })
    }

    /// With `max_blocks` sized by [`PagedKvConfig::size_for_budget`].
    pub fn for_budget(
        mut self,
        limit: u64,
        guarantee: u64,
        reserved: u64,
        page: u64,
    ) -> Result<PagedKvConfig> {
        self.max_blocks = self
            .size_for_budget(limit, guarantee, reserved, page)?
            .max_blocks;
        Ok(self)
    }

    /// Tensors of the layout and bytes of a block in each (as the cache's geometry counts).
    fn tensors_and_unit(&self) -> Result<(u64, u64)> {
        let b = self.block_bytes_per_tensor()?;
        let kv = (self.layers as u64).checked_mul(2);
        let (t, u) = match self.layout {
            super::KvLayout::PerLayer => (kv, Some(b)),
            super::KvLayout::Contiguous => (Some(1), kv.and_then(|t| t.checked_mul(b))),
        };
        match t.zip(u) {
            Some((t, u)) if t > 0 && u > 0 => Ok((t, u)),
            _ => Err(Error::SizeOverflow {
                what: "KV block",
                detail: format!("{} layers x 2 x {b} bytes", self.layers),
            }),
        }
    }
}

/// A snapshot of a [`BlockPool`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockPoolStats {
    /// Blocks held by at least one reference (taken, or revived from the cache).
    pub referenced: usize,
    /// Blocks kept under their hash with no reference: reclaimable.
    pub cached: usize,
    /// [`BlockPool::take_cached`] calls that found their hash.
    pub hits: u64,
    /// [`BlockPool::take_cached`] calls that did not.
    pub misses: u64,
    /// Cached blocks evicted to serve a [`BlockPool::take`].
    pub evicted_for_take: u64,
    /// Cached blocks evicted by a reclaim ([`BlockPool::reclaim`], the model's callback).
    pub evicted_for_reclaim: u64,
    /// Bytes of pages reclaims gave back.
    pub reclaimed_bytes: u64,
}

/// One block the pool holds from its [`PagedKv`].
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// References; 0 for a cached block.
    refs: u32,
    /// The content hash it is found under, if any.
    hash: Option<BlockHash>,
    /// Its place in the LRU order while cached (unreferenced).
    lru: Option<u64>,
}

#[derive(Debug, Default)]
struct State {
    blocks: HashMap<BlockId, Entry>,
    by_hash: HashMap<BlockHash, BlockId>,
    /// Cached blocks, least recently released first.
    lru: BTreeMap<u64, BlockId>,
    tick: u64,
    referenced: usize,
    stats: BlockPoolStats,
}

impl State {
    /// Take up to `n` least recently used cached blocks out of the state.
    fn evict(&mut self, n: usize) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(n.min(self.lru.len()));
        while out.len() < n {
            let Some((_, b)) = self.lru.pop_first() else {
                break;
            };
            if let Some(e) = self.blocks.remove(&b) {
                if let Some(h) = e.hash {
                    if self.by_hash.get(&h) == Some(&b) {
                        self.by_hash.remove(&h);
                    }
                }
            }
            out.push(b);
        }
        out
    }

    fn bad(&self, b: BlockId, max: usize, reason: &'static str) -> Error {
        Error::KvBadBlock {
            block: b,
            max_blocks: max,
            reason,
        }
    }

    /// The entry of a block just checked ([`State::check_referenced`]) to be held: an error
    /// rather than a panic if the books ever disagree.
    fn held(&mut self, b: BlockId, max: usize) -> Result<&mut Entry> {
        self.blocks.get_mut(&b).ok_or(Error::KvBadBlock {
            block: b,
            max_blocks: max,
            reason: "not taken from this block pool",
        })
    }

    /// `ids` each referenced as many times as named; else the error for the first that is not.
    fn check_referenced(&self, ids: &[BlockId], max: usize, null: BlockId) -> Result<()> {
        let mut named: HashMap<BlockId, u32> = HashMap::with_capacity(ids.len());
        for &b in ids {
            if b == null {
                return Err(self.bad(b, max, "the reserved null block (never taken, never freed)"));
            }
            let times = named.entry(b).or_insert(0);
            *times += 1;
            match self.blocks.get(&b) {
                Some(e) if e.refs >= *times => {}
                Some(e) if e.refs > 0 => {
                    return Err(self.bad(b, max, "named more times than it is referenced"))
                }
                Some(_) => {
                    return Err(self.bad(
                        b,
                        max,
                        "cached with no reference (revive it with take_cached first)",
                    ))
                }
                None => return Err(self.bad(b, max, "not taken from this block pool")),
            }
        }
        Ok(())
    }
}

/// The block-pool face of a [`PagedKv`] with the null block: what a candle engine's block
/// manager calls (mistral.rs's `BlockPool`, candle-vllm's block allocator), with a prefix cache.
///
/// - [`BlockPool::take`] hands out `n` block ids (never the null block 0, which pads block
///   tables and reads zeros), [`BlockPool::free`] gives them back;
/// - [`BlockPool::release_cached`] gives a block back but keeps its content under its hash,
///   unreferenced: [`BlockPool::lookup`] finds it and [`BlockPool::take_cached`] revives it
///   (reference counted: several sequences may share a block found by hash);
/// - cached, unreferenced blocks are **reclaimable**: when a `take` is short (the cache is
///   full, or the model's limit or the global budget does not admit the pages) and when the
///   model's memory is reclaimed ([`BlockPool::reclaim`], which [`BlockPoolHook`] makes the
///   model's reclaim callback), they are evicted least recently released first and freed back
///   to the [`PagedKv`], whose pages then go back to the pool. Referenced blocks are never
///   evicted: an idle engine's prefix cache no longer pins memory against a lowered limit
///   (kvcached issues 359 and 390);
/// - [`BlockPool::free_blocks`] is what a `take` could get now: it rises and falls with the
///   model's budget.
///
/// The pool owns every block id of its cache: compacting or moving blocks of the cache
/// underneath ([`PagedKv::compact`], [`PagedKv::move_to`]) renames or takes blocks the pool
/// keeps books of; do neither through [`BlockPool::kv`].
///
/// `Send + Sync`; every method takes `&self`.
pub struct BlockPool {
    kv: Home,
    state: Mutex<State>,
    sizing: Option<KvSizing>,
}

/// A shared cache outlives the pool: the blocks the pool still holds (referenced or cached) go
/// back to it, so the owner's cache has none allocated (and a new pool can adopt it).
impl Drop for BlockPool {
    fn drop(&mut self) {
        if let Home::Shared(_) = self.kv {
            let held: Vec<BlockId> = self
                .state
                .get_mut()
                .blocks
                .drain()
                .map(|(b, _)| b)
                .collect();
            if let Err(e) = self.kv.free(&held) {
                tracing::error!(error = %e, blocks = held.len(), "a block pool over a shared cache could not free its blocks");
            }
        }
    }
}

/// The cache a block pool hands out: its own, or one it shares with an owner that presents it
/// otherwise (the candle tensors of the cache, so the engine's kernels read the blocks the pool
/// hands out).
enum Home {
    Own(PagedKv),
    Shared(Arc<dyn AsRef<PagedKv> + Send + Sync>),
}

impl std::ops::Deref for Home {
    type Target = PagedKv;
    fn deref(&self) -> &PagedKv {
        match self {
            Home::Own(kv) => kv,
            Home::Shared(owner) => (**owner).as_ref(),
        }
    }
}

impl fmt::Debug for BlockPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockPool")
            .field("kv", &*self.kv)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Whether `e` says the cache or the budget is short (evicting cached blocks may help).
fn is_short(e: &Error) -> bool {
    matches!(
        e,
        Error::KvOutOfBlocks { .. }
            | Error::AdmissionRefused { .. }
            | Error::OutOfPhysicalMemory { .. }
    )
}

impl BlockPool {
    /// A block pool over a new [`PagedKv`] shaped by `config` in `pool` (a [`ModelHandle`]
    /// derefs to its pool), with the null block reserved whatever `config` says.
    pub fn new(pool: &Pool, config: PagedKvConfig) -> Result<BlockPool> {
        Self::over(PagedKv::new(pool, config.null_block(true))?)
    }

    /// A block pool over `kv`, which must reserve the null block
    /// ([`PagedKvConfig::null_block`]) and have no block allocated (the pool owns every id).
    pub fn over(kv: PagedKv) -> Result<BlockPool> {
        Self::adopt(Home::Own(kv))
    }

    /// A block pool over the cache `owner` presents (`PagedKvTensors`: the candle tensors
    /// the engine's kernels read), with the same conditions as [`BlockPool::over`]. The pool
    /// keeps the owner alive; while it lives, take and free blocks through the pool only (not
    /// the owner's `alloc`, `free`, `compact`, `move_out` or `move_in`, which would change ids
    /// behind its books). Dropped, it frees every block it still holds in the owner's cache.
    pub fn over_shared(owner: Arc<dyn AsRef<PagedKv> + Send + Sync>) -> Result<BlockPool> {
        Self::adopt(Home::Shared(owner))
    }

    fn adopt(kv: Home) -> Result<BlockPool> {
        if kv.null_block().is_none() {
            return Err(Error::InvalidArgument(
                "block pool: the paged KV cache must reserve the null block (PagedKvConfig::null_block(true))".into(),
            ));
        }
        let live = kv.stats().live;
        if live != 0 {
            return Err(Error::InvalidArgument(format!(
                "block pool: the paged KV cache has {live} blocks allocated already; the block pool must own every block"
            )));
        }
        Ok(BlockPool {
            kv,
            state: Mutex::new(State::default()),
            sizing: None,
        })
    }

    /// A block pool for `model`, its cache sized by the model's limit and guarantee less
    /// `reserved` bytes (weights and whatever else its pool holds beside the cache):
    /// [`PagedKvConfig::size_for_budget`] with the pool's granularity, `config.max_blocks`
    /// replaced. See there for why this replaces `Utilization(0.9)` and `--kv-fraction`.
    pub fn sized_for(
        model: &ModelHandle,
        config: PagedKvConfig,
        reserved: u64,
    ) -> Result<BlockPool> {
        let m = model.model_stats().ok_or_else(|| Error::UnknownModel {
            model: model.id().to_string(),
        })?;
        let config = config.null_block(true);
        let sizing = config.size_for_budget(m.limit, m.guarantee, reserved, model.granularity())?;
        let config = PagedKvConfig {
            max_blocks: sizing.max_blocks,
            ..config
        };
        tracing::info!(model = %model.id(), limit = m.limit, guarantee = m.guarantee, reserved, ?sizing, "KV block pool sized by budget");
        let mut bp = Self::over(PagedKv::new(model, config)?)?;
        bp.sizing = Some(sizing);
        Ok(bp)
    }

    /// The sizing [`BlockPool::sized_for`] used.
    pub fn sizing(&self) -> Option<KvSizing> {
        self.sizing
    }

    /// The cache underneath: its tensors' addresses, its stats.
    pub fn kv(&self) -> &PagedKv {
        &self.kv
    }

    /// The reserved null block (0): pad block tables with it; it reads zeros and is never
    /// handed out, freed or evicted.
    pub fn null_block(&self) -> BlockId {
        super::paged::NULL_BLOCK
    }

    /// Blocks of the cache a `take` can ever hand out (`max_blocks - 1`).
    pub fn total_blocks(&self) -> usize {
        self.kv.config().allocatable_blocks()
    }

    /// `n` blocks, each referenced once, mapped in every tensor. Free blocks of the cache come
    /// first (the prefix cache is kept as long as possible); when the cache or the budget is
    /// short, cached unreferenced blocks are evicted (least recently released first) and freed
    /// back, and the allocation is tried again, until it succeeds or nothing cached is left.
    /// `n == 0` gives none.
    ///
    /// Errors: more blocks than the cache holds beside the referenced ones
    /// ([`Error::KvOutOfBlocks`], nothing evicted); a budget short even after every cached
    /// block was evicted (the refusal; the evicted blocks stay evicted); the pool asleep.
    pub fn take(&self, n: usize) -> Result<Vec<BlockId>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        {
            let st = self.state.lock();
            let room = self.total_blocks() - st.referenced;
            if n > room {
                return Err(Error::KvOutOfBlocks {
                    requested: n,
                    free: room,
                    max_blocks: self.kv.config().max_blocks,
                });
            }
        }
        loop {
            match self.kv.alloc(n) {
                Ok(ids) => {
                    let mut st = self.state.lock();
                    for &b in &ids {
                        st.blocks.insert(
                            b,
                            Entry {
                                refs: 1,
                                hash: None,
                                lru: None,
                            },
                        );
                    }
                    st.referenced += ids.len();
                    return Ok(ids);
                }
                Err(e) if is_short(&e) => {
                    let short = n.saturating_sub(self.kv.available()).max(1);
                    let evicted = {
                        let mut st = self.state.lock();
                        let ev = st.evict(short);
                        st.stats.evicted_for_take += ev.len() as u64;
                        ev
                    };
                    if evicted.is_empty() {
                        return Err(e);
                    }
                    tracing::debug!(
                        blocks = evicted.len(),
                        wanted = n,
                        "evicting cached KV blocks for a take"
                    );
                    self.kv.free(&evicted)?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Drop one reference to each of `ids` (a block named twice drops two); a block left with
    /// none goes back to the cache's free blocks, its content and hash forgotten. All or
    /// nothing: a bad id (the null block, one not taken, one cached with no reference, one named
    /// more often than referenced) is an error naming it, and nothing changes.
    pub fn free(&self, ids: &[BlockId]) -> Result<()> {
        let max = self.kv.config().max_blocks;
        let gone = {
            let mut st = self.state.lock();
            st.check_referenced(ids, max, self.null_block())?;
            let mut gone = Vec::new();
            for &b in ids {
                let e = st.held(b, max)?;
                e.refs -= 1;
                if e.refs == 0 {
                    let hash = e.hash;
                    st.blocks.remove(&b);
                    if let Some(h) = hash {
                        if st.by_hash.get(&h) == Some(&b) {
                            st.by_hash.remove(&h);
                        }
                    }
                    st.referenced -= 1;
                    gone.push(b);
                }
            }
            gone
        };
        self.kv.free(&gone)
    }

    /// Drop one reference to `id`, and keep its content under `hash`: while it has references
    /// left, [`BlockPool::take_cached`] shares it; once it has none, it is cached (most
    /// recently used), reclaimable, until revived or evicted. If another block is found under
    /// `hash` already, `id` keeps no hash (its last reference frees it as
    /// [`BlockPool::free`] would). A bad id is an error as for `free`.
    pub fn release_cached(&self, id: BlockId, hash: BlockHash) -> Result<()> {
        let max = self.kv.config().max_blocks;
        let gone = {
            let mut st = self.state.lock();
            st.check_referenced(&[id], max, self.null_block())?;
            let other = st.by_hash.get(&hash).copied().filter(|&b| b != id);
            let tick = st.tick;
            let e = st.held(id, max)?;
            let old = e.hash.filter(|&h| h != hash);
            e.refs -= 1;
            e.hash = if other.is_some() { None } else { Some(hash) };
            let (refs, keep) = (e.refs, e.hash.is_some());
            if let Some(h) = old {
                if st.by_hash.get(&h) == Some(&id) {
                    st.by_hash.remove(&h);
                }
            }
            if keep {
                st.by_hash.insert(hash, id);
            }
            if refs > 0 {
                None
            } else if keep {
                st.referenced -= 1;
                st.tick += 1;
                st.lru.insert(tick, id);
                st.held(id, max)?.lru = Some(tick);
                None
            } else {
                st.referenced -= 1;
                st.blocks.remove(&id);
                Some(id)
            }
        };
        match gone {
            Some(b) => self.kv.free(&[b]),
            None => Ok(()),
        }
    }

    /// The block kept under `hash` (referenced or cached), without taking a reference or
    /// touching its place in the eviction order.
    pub fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.state.lock().by_hash.get(&hash).copied()
    }

    /// Take a reference to the block kept under `hash`: a cached one is revived (out of the
    /// eviction order, its bytes as they were released), a referenced one is shared. `None` if
    /// no block is kept under `hash` (never released under it, or evicted since).
    pub fn take_cached(&self, hash: BlockHash) -> Option<BlockId> {
        let mut st = self.state.lock();
        let Some(b) = st.by_hash.get(&hash).copied() else {
            st.stats.misses += 1;
            return None;
        };
        let Some(e) = st.blocks.get_mut(&b) else {
            // Never: a hash names a held block. Forget the stale hash; a miss.
            st.by_hash.remove(&hash);
            st.stats.misses += 1;
            return None;
        };
        let Some(refs) = e.refs.checked_add(1) else {
            tracing::warn!(
                block = b,
                "a block's reference count is at its maximum; not shared"
            );
            return None;
        };
        e.refs = refs;
        let revived = e.lru.take();
        if let Some(t) = revived {
            st.lru.remove(&t);
            st.referenced += 1;
        }
        st.stats.hits += 1;
        Some(b)
    }

    /// What a [`BlockPool::take`] could get now: blocks the cache can allocate under the
    /// model's budget without reclaiming from anyone ([`PagedKv::available`]) plus the cached
    /// unreferenced blocks it would evict. Rises when the limit is raised or other models give
    /// memory back, falls when the limit is lowered or the budget fills.
    pub fn free_blocks(&self) -> usize {
        let (cached, referenced) = {
            let st = self.state.lock();
            (st.lru.len(), st.referenced)
        };
        (self.kv.available() + cached).min(self.total_blocks() - referenced)
    }

    /// Blocks cached with no reference (reclaimable).
    pub fn cached_blocks(&self) -> usize {
        self.state.lock().lru.len()
    }

    /// Evict up to `n` cached blocks, least recently released first, and free them back to
    /// the cache. Returns the blocks evicted.
    pub fn evict_cached(&self, n: usize) -> Result<usize> {
        let ev = {
            let mut st = self.state.lock();
            let ev = st.evict(n);
            st.stats.evicted_for_reclaim += ev.len() as u64;
            ev
        };
        self.kv.free(&ev)?;
        Ok(ev.len())
    }

    /// Give back at least `bytes` of the cache's pages if unreferenced memory allows: warm
    /// blocks first ([`PagedKv::trim`]), then cached blocks, least recently released first,
    /// until the pages given back reach `bytes` or nothing cached is left. Referenced blocks
    /// are never touched. Returns the bytes of pages unmapped: they become the pool's idle
    /// memory, which a shared pool's reclaim gives back to the driver after the callback
    /// returns (called directly, follow with [`Pool::trim`]). What a model's reclaim callback
    /// calls ([`BlockPoolHook`]).
    pub fn reclaim(&self, bytes: u64) -> u64 {
        let mapped = || self.kv.stats().mapped_bytes;
        let before = mapped();
        self.kv.trim();
        let per_block = self.kv.block_span_bytes() * self.kv.tensors() as u64;
        let mut given = before.saturating_sub(mapped());
        let mut evicted = 0;
        while given < bytes {
            let had = given;
            let want = usize::try_from((bytes - given).div_ceil(per_block))
                .unwrap_or(usize::MAX)
                .max(1);
            match self.evict_cached(want) {
                Ok(0) => break,
                Ok(n) => evicted += n,
                Err(e) => {
                    tracing::error!(error = %e, "freeing evicted KV blocks failed");
                    break;
                }
            }
            // After the trim, frees release their pages (none is kept warm).
            given = before.saturating_sub(mapped());
            if given <= had {
                // The batch gave nothing back (its pages shared with referenced blocks, or the
                // engine mapping meanwhile): stop rather than empty the whole prefix cache.
                break;
            }
        }
        self.state.lock().stats.reclaimed_bytes += given;
        tracing::info!(asked = bytes, given, evicted, "KV block pool reclaimed");
        given
    }

    /// A snapshot.
    pub fn stats(&self) -> BlockPoolStats {
        let st = self.state.lock();
        BlockPoolStats {
            referenced: st.referenced,
            cached: st.lru.len(),
            ..st.stats
        }
    }
}

/// Makes a model's reclaim callback ([`crate::ModelConfig::on_reclaim`]) evict a
/// [`BlockPool`]'s cached blocks, for a pool made after the model is registered (it needs the
/// model's handle). Holds the pool weakly: the callback never keeps it alive.
///
/// ```
/// use std::sync::Arc;
/// use elastic_vmm::kv::{BlockPool, BlockPoolHook, PagedKvConfig};
/// use elastic_vmm::{ModelConfig, SharedPool, SharedPoolConfig};
/// # fn main() -> elastic_vmm::Result<()> {
/// let shared = SharedPool::host(SharedPoolConfig::new().global_limit(64 << 20))?;
/// let hook = BlockPoolHook::new();
/// let m = shared.register(ModelConfig::new("m", 1 << 30, 32 << 20).on_reclaim(hook.callback()))?;
/// let bp = Arc::new(BlockPool::new(&m, PagedKvConfig::new(2, 2, 64, 16, 2, 64))?);
/// hook.attach(&bp);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct BlockPoolHook {
    pool: Arc<OnceLock<Weak<BlockPool>>>,
}

impl BlockPoolHook {
    /// A hook attached to nothing yet (its callback does nothing until [`BlockPoolHook::attach`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// The block pool the callback evicts from. Once; later calls are ignored.
    pub fn attach(&self, pool: &Arc<BlockPool>) {
        let _ = self.pool.set(Arc::downgrade(pool));
    }

    /// A reclaim callback: [`BlockPool::reclaim`] of the attached pool.
    pub fn callback(&self) -> impl Fn(u64) + Send + Sync + 'static {
        self.callback_then(|_| {})
    }

    /// A reclaim callback: [`BlockPool::reclaim`], then, if that gave back less than asked,
    /// `then` with the bytes still wanted (the engine preempts sequences and frees their
    /// blocks there): cached blocks always go before anything referenced.
    pub fn callback_then(
        &self,
        then: impl Fn(u64) + Send + Sync + 'static,
    ) -> impl Fn(u64) + Send + Sync + 'static {
        let slot = self.pool.clone();
        move |bytes| {
            let given = match slot.get().and_then(Weak::upgrade) {
                Some(bp) => bp.reclaim(bytes),
                None => 0,
            };
            if given < bytes {
                then(bytes - given);
            }
        }
    }
}
