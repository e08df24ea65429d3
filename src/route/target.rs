//! What routing keeps per pool (a model): counters per tag, blocks freed on each stream and
//! waiting for reuse, blocks behind fences, memory held by CUDA graphs, the last refusal.
//!
//! A target is its pool's front cache ([`FrontCache`]): registered with the pool when made, it
//! keeps and serves freed blocks only while the pool's gate is open (the pool awake and not
//! closed), reading the gate under its `cache` lock; the pool flushes it on trim, sleep and
//! close, and the shared pool and the broker through the pool before they measure or take a
//! model's idle memory. A flush returns only once every block that left the cache (its own or
//! another thread's flush, an eviction) is back in the pool: a block on its way stays counted
//! in `fenced_bytes` until it is dropped, and a flush waits (yielding, no lock held) for that
//! count to reach 0. So an unregister racing a flush never finds the model's freed blocks
//! still live.
//!
//! Locks here guard bookkeeping only and are never held while an [`Allocation`] is dropped
//! (the last one of a closed pool gives memory back to the driver) or a driver call is made.
//! Lock order: `STREAM_LIFE` -> a target's `cache` / `fenced` -> `PENDING`; `TARGETS` (in
//! `stack.rs`) -> a pool's state (registering a new target); `ALL`, `ORPHANS` and a target's
//! other locks (`tags`, `parked`, `refusal`) are each taken alone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::fence::{
    capture_active, synchronize_context, Fence, FenceState, StreamKey, STREAM_LIFE,
};
use super::stats::{Refusal, RouteStats, TagStats};
use crate::pool::{Allocation, FrontCache, FrontGate};
use crate::{Pool, Tag};

/// Where memory lives, as routes and the calling thread see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Place {
    /// Host memory: a host-backend pool, or a thread with no CUDA context current.
    Host,
    /// A CUDA device, by ordinal.
    Cuda(i32),
}

/// Live-memory counters of one tag of one target.
#[derive(Debug)]
pub(crate) struct TagCounters {
    pub(crate) tag: Tag,
    live_bytes: AtomicU64,
    live_blocks: AtomicU64,
    peak_bytes: AtomicU64,
    allocations: AtomicU64,
    frees: AtomicU64,
    reused: AtomicU64,
    refusals: AtomicU64,
    driver_calls: AtomicU64,
}

impl TagCounters {
    fn new(tag: Tag) -> Self {
        TagCounters {
            tag,
            live_bytes: AtomicU64::new(0),
            live_blocks: AtomicU64::new(0),
            peak_bytes: AtomicU64::new(0),
            allocations: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            reused: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            driver_calls: AtomicU64::new(0),
        }
    }

    pub(crate) fn allocated(&self, bytes: u64, reused: bool) {
        let now = self.live_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_bytes.fetch_max(now, Ordering::Relaxed);
        self.live_blocks.fetch_add(1, Ordering::Relaxed);
        self.allocations.fetch_add(1, Ordering::Relaxed);
        if reused {
            self.reused.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn freed(&self, bytes: u64) {
        self.live_bytes.fetch_sub(bytes, Ordering::Relaxed);
        self.live_blocks.fetch_sub(1, Ordering::Relaxed);
        self.frees.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn drove(&self, calls: u64) {
        if calls > 0 {
            self.driver_calls.fetch_add(calls, Ordering::Relaxed);
        }
    }

    pub(crate) fn refused(&self) {
        self.refusals.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> TagStats {
        TagStats {
            tag: self.tag.clone(),
            live_bytes: self.live_bytes.load(Ordering::Relaxed),
            live_blocks: self.live_blocks.load(Ordering::Relaxed),
            peak_bytes: self.peak_bytes.load(Ordering::Relaxed),
            allocations: self.allocations.load(Ordering::Relaxed),
            frees: self.frees.load(Ordering::Relaxed),
            reused: self.reused.load(Ordering::Relaxed),
            refusals: self.refusals.load(Ordering::Relaxed),
            driver_calls: self.driver_calls.load(Ordering::Relaxed),
        }
    }
}

/// Blocks freed on one stream, by size class: reusable on that stream at once.
#[derive(Debug, Default)]
struct StreamFree {
    by_class: HashMap<usize, Vec<Allocation>>,
    bytes: u64,
    /// The CUDA context the blocks were freed in (their fence is recorded there).
    ctx: Option<usize>,
}

impl StreamFree {
    fn into_blocks(self) -> Vec<Allocation> {
        self.by_class.into_values().flatten().collect()
    }
}

#[derive(Debug, Default)]
struct Cache {
    streams: HashMap<StreamKey, StreamFree>,
    bytes: u64,
}

/// Blocks behind one fence.
#[derive(Debug)]
struct Fenced {
    fence: Fence,
    blocks: Vec<Allocation>,
    bytes: u64,
}

/// Whether a flush waits for the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Record fences and give back what has passed already.
    No,
    /// Record fences and wait for them (not during a capture).
    Yes,
}

/// Routing's state for one pool.
#[derive(Debug)]
pub(crate) struct Target {
    /// Itself, for the pending list.
    me: Weak<Target>,
    pub(crate) name: Arc<str>,
    pub(crate) place: Place,
    /// The pool's identity (its key in `stack.rs`'s `TARGETS`).
    pool_id: usize,
    /// Open while the pool is awake and not closed: only then are blocks kept and served.
    gate: Arc<FrontGate>,
    /// Bytes of freed blocks kept per target for same-stream reuse before they are fenced.
    cache_limit: AtomicU64,
    /// The CUDA context of the first routed allocation (fences are recorded in it).
    ctx: AtomicUsize,
    tags: Mutex<Vec<Arc<TagCounters>>>,
    cache: Mutex<Cache>,
    fenced: Mutex<Vec<Fenced>>,
    /// Bytes out of the cache and not yet back in the pool: behind fences, and on their way
    /// (being fenced, or passed and being dropped). Charged under the `cache` lock as blocks
    /// leave it, lowered only once they are dropped: a flush that finds it 0 after finding the
    /// cache empty knows no block of this target is on its way to the pool.
    fenced_bytes: AtomicU64,
    parked: Mutex<Vec<Allocation>>,
    parked_bytes: AtomicU64,
    refusal: Mutex<Option<Refusal>>,
    pub(crate) pool_allocations: AtomicU64,
    pub(crate) fences: AtomicU64,
    pub(crate) captured_allocations: AtomicU64,
    /// Tests: how long a flush pauses while it holds blocks out of both the cache and the
    /// fenced list, and how many times one paused.
    #[cfg(test)]
    transit_pause_ms: AtomicU64,
    #[cfg(test)]
    transit_pauses: AtomicU64,
}

/// Every target with blocks behind fences, so that any routed call can give them back.
static PENDING: Mutex<Vec<Arc<Target>>> = Mutex::new(Vec::new());
static PENDING_COUNT: AtomicUsize = AtomicUsize::new(0);
/// Every target, for the stream-destroy hook.
static ALL: Mutex<Vec<Weak<Target>>> = Mutex::new(Vec::new());

impl Target {
    /// The target of `pool`, registered with it as a front cache.
    pub(crate) fn new(pool: &Pool, place: Place, cache_limit: u64) -> Arc<Target> {
        let t = Arc::new_cyclic(|me: &Weak<Target>| Target {
            me: me.clone(),
            name: pool.name().into(),
            place,
            pool_id: pool.identity(),
            gate: pool.inner().add_front(me.clone()),
            cache_limit: AtomicU64::new(cache_limit),
            ctx: AtomicUsize::new(0),
            tags: Mutex::new(Vec::new()),
            cache: Mutex::new(Cache::default()),
            fenced: Mutex::new(Vec::new()),
            fenced_bytes: AtomicU64::new(0),
            parked: Mutex::new(Vec::new()),
            parked_bytes: AtomicU64::new(0),
            refusal: Mutex::new(None),
            pool_allocations: AtomicU64::new(0),
            fences: AtomicU64::new(0),
            captured_allocations: AtomicU64::new(0),
            #[cfg(test)]
            transit_pause_ms: AtomicU64::new(0),
            #[cfg(test)]
            transit_pauses: AtomicU64::new(0),
        });
        let mut all = ALL.lock();
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&t));
        t
    }

    /// The counters of `tag`, made on first use.
    pub(crate) fn tag(&self, tag: &Tag) -> Arc<TagCounters> {
        let mut tags = self.tags.lock();
        if let Some(t) = tags.iter().find(|t| &t.tag == tag) {
            return t.clone();
        }
        let t = Arc::new(TagCounters::new(tag.clone()));
        tags.push(t.clone());
        t
    }

    /// Remember the CUDA context routed allocations of this target run in.
    pub(crate) fn note_context(&self, ctx: Option<usize>) {
        if let Some(c) = ctx {
            if self.ctx.load(Ordering::Relaxed) == 0 {
                self.ctx.store(c, Ordering::Relaxed);
            }
        }
    }

    /// The context to fence blocks freed in `freed_in`: `Ok(None)` for host memory (nothing to
    /// wait for), `Err(())` when a device context is not known yet.
    fn fence_context(&self, freed_in: Option<usize>) -> Result<Option<usize>, ()> {
        match self.place {
            Place::Host => Ok(None),
            Place::Cuda(_) => freed_in
                .or(Some(self.ctx.load(Ordering::Relaxed)).filter(|&c| c != 0))
                .map(Some)
                .ok_or(()),
        }
    }

    /// A block of `class` bytes freed on `key`, if one is cached and the pool is awake.
    pub(crate) fn take_cached(&self, key: StreamKey, class: usize) -> Option<Allocation> {
        let mut cache = self.cache.lock();
        if cache.bytes == 0 || !self.gate.is_open() {
            return None;
        }
        let s = cache.streams.get_mut(&key)?;
        let a = s.by_class.get_mut(&class)?.pop()?;
        s.bytes -= a.footprint();
        cache.bytes -= a.footprint();
        Some(a)
    }

    /// Keep a block freed on `key` (in context `ctx`) for reuse on that stream. When the cache
    /// grows past its limit, or the pool is not awake or closed, every stream's blocks are
    /// fenced and go back to the pool once the GPU passed: dead threads' and streams' blocks do
    /// not linger, and a pool that is not awake gets its memory back.
    pub(crate) fn put_cached(
        &self,
        key: StreamKey,
        class: usize,
        mut block: Allocation,
        ctx: Option<usize>,
    ) {
        block.bypass_thread_fronts();
        let evict = {
            let mut cache = self.cache.lock();
            let bytes = block.footprint();
            let s = cache.streams.entry(key).or_default();
            s.by_class.entry(class).or_default().push(block);
            s.bytes += bytes;
            if s.ctx.is_none() {
                s.ctx = ctx;
            }
            cache.bytes += bytes;
            !self.gate.is_open() || cache.bytes > self.cache_limit.load(Ordering::Relaxed)
        };
        if evict {
            self.fence_all();
        }
    }

    /// Take every stream's blocks out of the cache and fence them, keeping the stream handles
    /// alive meanwhile.
    fn fence_all(&self) {
        let _life = STREAM_LIFE.read();
        let streams = {
            let mut cache = self.cache.lock();
            self.fenced_bytes.fetch_add(cache.bytes, Ordering::AcqRel);
            cache.bytes = 0;
            std::mem::take(&mut cache.streams)
        };
        if !streams.is_empty() {
            self.pause_in_transit();
        }
        for (key, s) in streams.into_iter().filter(|(_, s)| s.bytes > 0) {
            self.fence_stream(key, s);
        }
    }

    /// Fence one stream's freed blocks (counted in `fenced_bytes` already); if that cannot be
    /// done now they go back to the cache. The caller holds `STREAM_LIFE`.
    fn fence_stream(&self, key: StreamKey, s: StreamFree) {
        let bytes = s.bytes;
        let fence = self
            .fence_context(s.ctx)
            .ok()
            .and_then(|ctx| Fence::record(ctx, key));
        match fence {
            Some(fence) => {
                self.fences.fetch_add(1, Ordering::Relaxed);
                self.push_fenced(fence, s.into_blocks(), bytes);
            }
            None => {
                let mut cache = self.cache.lock();
                let dst = cache.streams.entry(key).or_default();
                for (class, blocks) in s.by_class {
                    dst.by_class.entry(class).or_default().extend(blocks);
                }
                dst.bytes += bytes;
                dst.ctx = dst.ctx.or(s.ctx);
                cache.bytes += bytes;
                self.fenced_bytes.fetch_sub(bytes, Ordering::AcqRel);
            }
        }
    }

    /// Put blocks behind `fence` (their bytes are in `fenced_bytes` already).
    fn push_fenced(&self, fence: Fence, blocks: Vec<Allocation>, bytes: u64) {
        self.fenced.lock().push(Fenced {
            fence,
            blocks,
            bytes,
        });
        if let Some(me) = self.me.upgrade() {
            let mut pending = PENDING.lock();
            if !pending.iter().any(|t| Arc::ptr_eq(t, &me)) {
                pending.push(me);
                PENDING_COUNT.store(pending.len(), Ordering::Release);
                return;
            }
            drop(pending);
            // `me` is not the last reference (the caller holds one): dropping it here runs no
            // target's drop under a lock.
        }
    }

    /// Give back to the pool the fenced blocks the GPU has passed (with [`Wait::Yes`], wait for
    /// all of them, including blocks another thread is fencing or handing back meanwhile, unless
    /// a capture is in progress).
    pub(crate) fn reap(&self, wait: Wait) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            self.reap_once(wait);
            if wait == Wait::No
                || self.fenced_bytes.load(Ordering::Acquire) == 0
                || capture_active()
                || std::time::Instant::now() > deadline
            {
                return;
            }
            std::thread::yield_now();
        }
    }

    fn reap_once(&self, wait: Wait) {
        let fenced = std::mem::take(&mut *self.fenced.lock());
        let mut keep = Vec::new();
        let mut done: Vec<Allocation> = Vec::new();
        let mut done_bytes = 0;
        for f in fenced {
            let state = match wait {
                Wait::Yes => f.fence.wait(),
                Wait::No => f.fence.poll(),
            };
            if state == FenceState::Passed {
                done_bytes += f.bytes;
                done.extend(f.blocks);
            } else {
                keep.push(f);
            }
        }
        if !keep.is_empty() {
            self.fenced.lock().extend(keep);
        }
        if !done.is_empty() {
            self.pause_in_transit();
        }
        drop(done); // outside every lock: the memory is the pool's again
                    // Only now: until the blocks are dropped the pool counts them live.
        self.fenced_bytes.fetch_sub(done_bytes, Ordering::AcqRel);
    }

    /// Tests widen the moment blocks are held out of both lists here.
    fn pause_in_transit(&self) {
        #[cfg(test)]
        {
            let ms = self.transit_pause_ms.load(Ordering::Acquire);
            if ms > 0 {
                self.transit_pauses.fetch_add(1, Ordering::AcqRel);
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
        }
    }

    /// Fence every stream's cached blocks, then give back what has passed (or wait).
    pub(crate) fn flush(&self, wait: Wait) {
        self.fence_all();
        self.reap(wait);
    }

    /// A block freed with `cuMemFree_v2`. The driver's synchronous free waits for the device,
    /// so the block may be in use on any stream of its context until then, a non-blocking one
    /// included (which no fence on the legacy stream waits for): wait as the driver does
    /// (`cuCtxSynchronize` in the context of this target's allocations), then the block is the
    /// pool's again, for any stream. During a capture no synchronize may be made: it waits
    /// among the orphans for a later one.
    pub(crate) fn free_synchronously(&self, mut block: Allocation, freed_in: Option<usize>) {
        block.bypass_thread_fronts();
        let ctx = match self.place {
            Place::Host => return drop(block), // nothing is queued on a GPU
            Place::Cuda(_) => Some(self.ctx.load(Ordering::Relaxed))
                .filter(|&c| c != 0)
                .or(freed_in),
        };
        if ctx.is_some() && !capture_active() && synchronize_context(ctx) {
            drop(block);
            return;
        }
        // No context known (never for a block routing allocated on a device), a capture in
        // progress, or the synchronize failed: kept until a synchronize of the context passes.
        orphan(Orphan {
            key: None,
            ctx,
            fence: None,
            blocks: vec![block],
        });
    }

    /// Fence the blocks freed on a stream about to be destroyed (its handle is valid only
    /// until then). The caller holds `STREAM_LIFE` exclusively. Where no event can be
    /// recorded, the stream is synchronized; during a capture even that is impossible, and the
    /// blocks wait for a whole-context synchronize (orphans).
    pub(crate) fn stream_destroyed(&self, key: StreamKey) {
        let s = {
            let mut cache = self.cache.lock();
            let s = cache.streams.remove(&key);
            if let Some(s) = &s {
                cache.bytes -= s.bytes;
                self.fenced_bytes.fetch_add(s.bytes, Ordering::AcqRel);
            }
            s
        };
        let Some(s) = s.filter(|s| s.bytes > 0) else {
            return;
        };
        let bytes = s.bytes;
        let ctx = self.fence_context(s.ctx).ok().flatten();
        let fence = Fence::record(ctx, key).or_else(|| Fence::by_synchronizing(ctx, key));
        match fence {
            Some(fence) => {
                self.fences.fetch_add(1, Ordering::Relaxed);
                self.push_fenced(fence, s.into_blocks(), bytes);
            }
            None => {
                orphan(Orphan {
                    key: None,
                    ctx,
                    fence: None,
                    blocks: s.into_blocks(),
                });
                // The target's no more: a synchronize of the context gives them back.
                self.fenced_bytes.fetch_sub(bytes, Ordering::AcqRel);
            }
        }
    }

    /// Bytes of freed blocks cached for same-stream reuse.
    pub(crate) fn cached_bytes(&self) -> u64 {
        self.cache.lock().bytes
    }

    pub(crate) fn set_cache_limit(&self, bytes: u64) {
        self.cache_limit.store(bytes, Ordering::Relaxed);
    }

    pub(crate) fn fenced_bytes(&self) -> u64 {
        self.fenced_bytes.load(Ordering::Acquire)
    }

    /// Keep a block a CUDA graph may still use until [`Target::release_parked`].
    pub(crate) fn park(&self, mut block: Allocation) {
        block.bypass_thread_fronts();
        self.parked_bytes
            .fetch_add(block.footprint(), Ordering::Relaxed);
        self.parked.lock().push(block);
    }

    /// Give back every parked block (the caller vouches no graph uses them any more).
    pub(crate) fn release_parked(&self) -> u64 {
        let blocks = std::mem::take(&mut *self.parked.lock());
        let bytes: u64 = blocks.iter().map(Allocation::footprint).sum();
        self.parked_bytes.fetch_sub(bytes, Ordering::Relaxed);
        drop(blocks);
        bytes
    }

    pub(crate) fn set_refusal(&self, r: Refusal) {
        *self.refusal.lock() = Some(r);
    }

    pub(crate) fn stats(&self) -> RouteStats {
        let mut tags: Vec<TagStats> = self.tags.lock().iter().map(|t| t.snapshot()).collect();
        tags.sort_by(|a, b| a.tag.cmp(&b.tag));
        let (cached_bytes, cached_blocks) = {
            let c = self.cache.lock();
            let n = c
                .streams
                .values()
                .flat_map(|s| s.by_class.values())
                .map(|v| v.len() as u64)
                .sum();
            (c.bytes, n)
        };
        RouteStats {
            model: self.name.to_string(),
            tags,
            cached_bytes,
            cached_blocks,
            fenced_bytes: self.fenced_bytes.load(Ordering::Relaxed),
            parked_bytes: self.parked_bytes.load(Ordering::Relaxed),
            pool_allocations: self.pool_allocations.load(Ordering::Relaxed),
            fences: self.fences.load(Ordering::Relaxed),
            captured_allocations: self.captured_allocations.load(Ordering::Relaxed),
            driver_calls: 0,
            last_refusal: self.refusal.lock().clone(),
        }
    }
}

impl FrontCache for Target {
    fn flush(&self) {
        if self.cached_bytes() > 0 || self.fenced_bytes() > 0 {
            Target::flush(self, Wait::Yes);
        }
    }

    fn close(&self) {
        // Routing forgets the pool; later frees of its live blocks are fenced one by one (the
        // gate is shut for good).
        super::stack::forget(self.pool_id);
        Target::flush(self, Wait::Yes);
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        // Normally empty: a closed pool's target caches nothing and stays pending until its
        // fences passed. Whatever is left goes to the orphans, fenced where possible now, never
        // handed back early and never waited for here.
        let streams = std::mem::take(&mut self.cache.get_mut().streams);
        let fenced = std::mem::take(self.fenced.get_mut());
        for f in fenced {
            orphan(Orphan {
                key: None,
                ctx: None,
                fence: Some(f.fence),
                blocks: f.blocks,
            });
        }
        if streams.is_empty() {
            return;
        }
        let _life = STREAM_LIFE.read();
        for (key, s) in streams {
            let ctx = self.fence_context(s.ctx).ok().flatten();
            let fence = Fence::record(ctx, key);
            orphan(Orphan {
                key: Some(key),
                ctx,
                fence,
                blocks: s.into_blocks(),
            });
        }
    }
}

/// Blocks whose target is gone (or whose stream was destroyed during a capture), waiting for
/// the GPU. Without a fence they wait for a synchronize of their whole context.
#[derive(Debug)]
struct Orphan {
    /// The stream they were freed on, if it can still be named.
    key: Option<StreamKey>,
    ctx: Option<usize>,
    fence: Option<Fence>,
    blocks: Vec<Allocation>,
}

static ORPHANS: Mutex<Vec<Orphan>> = Mutex::new(Vec::new());
static ORPHAN_COUNT: AtomicUsize = AtomicUsize::new(0);

fn orphan(o: Orphan) {
    // Never dropped here: callers may hold `STREAM_LIFE`, and the last allocation of a closed
    // pool gives memory back (and flushes routing) when dropped. `reap_orphans` hands them back.
    let mut orphans = ORPHANS.lock();
    orphans.push(o);
    ORPHAN_COUNT.store(orphans.len(), Ordering::Release);
}

/// Give back orphans the GPU has passed (fences polled; unfenced ones by a context
/// synchronize, outside any capture).
fn reap_orphans() {
    if ORPHAN_COUNT.load(Ordering::Acquire) == 0 {
        return;
    }
    let list = std::mem::take(&mut *ORPHANS.lock());
    let mut keep = Vec::new();
    let mut done = Vec::new();
    for mut o in list {
        if o.fence.is_none() && !capture_active() {
            o.fence = match o.key {
                Some(key) => {
                    let _life = STREAM_LIFE.read();
                    Fence::record(o.ctx, key)
                }
                None => None,
            };
        }
        let passed = match (&o.fence, o.ctx) {
            (Some(f), _) => f.poll() == FenceState::Passed,
            (None, Some(ctx)) => !capture_active() && synchronize_context(Some(ctx)),
            // No fence and no known context: nothing proves the GPU is done; kept (leaked, not
            // handed back early).
            (None, None) => false,
        };
        if passed {
            done.extend(o.blocks);
        } else {
            keep.push(o);
        }
    }
    {
        let mut orphans = ORPHANS.lock();
        orphans.extend(keep);
        ORPHAN_COUNT.store(orphans.len(), Ordering::Release);
    }
    drop(done); // outside the lock
}

/// Give back fenced blocks the GPU has passed, for every target and orphan (cheap when there
/// are none).
pub(crate) fn reap_pending() {
    reap_orphans();
    if PENDING_COUNT.load(Ordering::Acquire) == 0 {
        return;
    }
    let targets: Vec<Arc<Target>> = PENDING.lock().clone();
    for t in &targets {
        t.reap(Wait::No);
    }
    let done: Vec<Arc<Target>> = {
        let mut pending = PENDING.lock();
        let (keep, done) = std::mem::take(&mut *pending)
            .into_iter()
            .partition(|t| t.fenced_bytes() > 0);
        *pending = keep;
        PENDING_COUNT.store(pending.len(), Ordering::Release);
        done
    };
    drop(done);
    drop(targets); // a closed target may end here, outside every lock
}

/// Fence, on every target, the blocks freed on `key` (a stream about to be destroyed).
pub(crate) fn stream_destroyed(key: StreamKey) {
    let all: Vec<Arc<Target>> = ALL.lock().iter().filter_map(Weak::upgrade).collect();
    {
        let _life = STREAM_LIFE.write();
        for t in &all {
            t.stream_destroyed(key);
        }
    }
    drop(all); // a target ending here takes STREAM_LIFE itself
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::{ModelConfig, SharedPool, SharedPoolConfig};

    /// Issue 33: `SharedPool::unregister` racing a flush of the same model was refused with
    /// `ModelBusy` though every block had been freed: the flush held them out of both the
    /// cache and the fenced list (while fencing them, and after their fences passed until they
    /// were dropped), so the unregister's own flush found nothing to wait for. The pause widens
    /// each of those moments.
    #[test]
    fn unregister_waits_for_blocks_a_concurrent_flush_holds() {
        let mut refused = Vec::new();
        for window in ["fencing", "landing"] {
            let shared = SharedPool::host(SharedPoolConfig::new().global_limit(64 << 20)).unwrap();
            let model = shared
                .register(ModelConfig::new("rb", 1 << 30, 64 << 20))
                .unwrap();
            let t = Target::new(&model, Place::Host, 1 << 30);
            for i in 0..5usize {
                let a = model.allocate(3 << 20).unwrap();
                t.put_cached(StreamKey::Stream(0x1000 + (i % 2)), 4 << 20, a, None);
            }
            if window == "landing" {
                t.fence_all(); // fenced, and (on the host) passed already
            }
            t.transit_pause_ms.store(300, Ordering::Release);
            let unregistered = std::thread::scope(|s| {
                let flusher = s.spawn(|| t.flush(Wait::Yes));
                while t.transit_pauses.load(Ordering::Acquire) == 0 {
                    std::thread::yield_now();
                }
                let r = shared.unregister("rb");
                flusher.join().unwrap();
                r
            });
            if let Err(e) = unregistered {
                refused.push(format!("{window}: {e}"));
                continue;
            }
            let s = model.stats();
            assert_eq!((s.live_allocations, s.in_use), (0, 0), "{window}");
            shared.audit().unwrap();
            drop(t);
            drop(model);
            assert_eq!(shared.stats().global.used, 0, "{window}");
        }
        assert!(refused.is_empty(), "{refused:#?}");
    }
}
