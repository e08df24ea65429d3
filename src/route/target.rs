//! What routing keeps per pool (a model): counters per tag, blocks freed on each stream and
//! waiting for reuse, blocks behind fences, memory held by CUDA graphs, the last refusal.
//!
//! Locks here guard bookkeeping only and are never held while an [`Allocation`] is dropped
//! (the last one of a closed pool gives memory back to the driver) or a driver call is made.
//! Lock order: `PENDING` -> `ALL`; a target's own locks (`tags`, `cache`, `fenced`, `parked`,
//! `refusal`) are each taken alone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::fence::{Fence, FenceState, StreamKey};
use super::stats::{Refusal, RouteStats, TagStats};
use crate::pool::Allocation;
use crate::Tag;

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
    /// The pool has closed: freed blocks are fenced at once instead of cached.
    closed: bool,
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
    pub(crate) name: Arc<str>,
    pub(crate) place: Place,
    /// Bytes of freed blocks kept per target for same-stream reuse before they are fenced.
    cache_limit: AtomicU64,
    /// The CUDA context of the first routed allocation (fences are recorded in it).
    ctx: AtomicUsize,
    tags: Mutex<Vec<Arc<TagCounters>>>,
    cache: Mutex<Cache>,
    fenced: Mutex<Vec<Fenced>>,
    fenced_bytes: AtomicU64,
    parked: Mutex<Vec<Allocation>>,
    parked_bytes: AtomicU64,
    refusal: Mutex<Option<Refusal>>,
    pub(crate) pool_allocations: AtomicU64,
    pub(crate) fences: AtomicU64,
    pub(crate) captured_allocations: AtomicU64,
}

/// Every target with blocks behind fences, so that any routed call can give them back.
static PENDING: Mutex<Vec<Arc<Target>>> = Mutex::new(Vec::new());
static PENDING_COUNT: AtomicUsize = AtomicUsize::new(0);
/// Every target, for the stream-destroy hook.
static ALL: Mutex<Vec<Weak<Target>>> = Mutex::new(Vec::new());

impl Target {
    pub(crate) fn new(name: Arc<str>, place: Place, cache_limit: u64) -> Arc<Target> {
        let t = Arc::new(Target {
            name,
            place,
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

    fn fence_context(&self) -> Option<usize> {
        match self.place {
            Place::Host => None,
            Place::Cuda(_) => Some(self.ctx.load(Ordering::Relaxed)).filter(|&c| c != 0),
        }
    }

    /// A block of `class` bytes freed on `key`, if one is cached.
    pub(crate) fn take_cached(&self, key: StreamKey, class: usize) -> Option<Allocation> {
        let mut cache = self.cache.lock();
        if cache.bytes == 0 {
            return None;
        }
        let s = cache.streams.get_mut(&key)?;
        let a = s.by_class.get_mut(&class)?.pop()?;
        s.bytes -= a.footprint();
        cache.bytes -= a.footprint();
        Some(a)
    }

    /// Keep a block freed on `key` for reuse on that stream. When the cache grows past its
    /// limit, that stream's blocks are fenced and go back to the pool once the GPU passed.
    pub(crate) fn put_cached(&self, key: StreamKey, class: usize, block: Allocation) {
        let over = {
            let mut cache = self.cache.lock();
            let bytes = block.footprint();
            let s = cache.streams.entry(key).or_default();
            s.by_class.entry(class).or_default().push(block);
            s.bytes += bytes;
            cache.bytes += bytes;
            if cache.closed || cache.bytes > self.cache_limit.load(Ordering::Relaxed) {
                let s = cache.streams.remove(&key).unwrap_or_default();
                cache.bytes -= s.bytes;
                Some(s)
            } else {
                None
            }
        };
        if let Some(s) = over.filter(|s| s.bytes > 0) {
            self.fence_stream(key, s);
        }
    }

    /// Bytes of freed blocks cached for same-stream reuse.
    pub(crate) fn cached_bytes(&self) -> u64 {
        self.cache.lock().bytes
    }

    pub(crate) fn set_cache_limit(&self, bytes: u64) {
        self.cache_limit.store(bytes, Ordering::Relaxed);
    }

    /// The pool closed: nothing is cached from now on.
    pub(crate) fn close(&self) {
        self.cache.lock().closed = true;
    }

    /// Fence one stream's freed blocks; if that cannot be done now they go back to the cache.
    fn fence_stream(self: &Target, key: StreamKey, s: StreamFree) {
        let bytes = s.bytes;
        match Fence::record(self.fence_context(), key) {
            Some(fence) => {
                self.fences.fetch_add(1, Ordering::Relaxed);
                self.fenced_bytes.fetch_add(bytes, Ordering::Relaxed);
                self.fenced.lock().push(Fenced {
                    fence,
                    blocks: s.into_blocks(),
                    bytes,
                });
                self.mark_pending();
            }
            None => {
                let mut cache = self.cache.lock();
                let dst = cache.streams.entry(key).or_default();
                for (class, blocks) in s.by_class {
                    dst.by_class.entry(class).or_default().extend(blocks);
                }
                dst.bytes += bytes;
                cache.bytes += bytes;
            }
        }
    }

    fn mark_pending(&self) {
        // Found by address: the target is alive (we are in a method of it).
        let mut pending = PENDING.lock();
        if !pending.iter().any(|t| std::ptr::eq(&**t, self)) {
            if let Some(me) = ALL
                .lock()
                .iter()
                .filter_map(Weak::upgrade)
                .find(|t| std::ptr::eq(&**t, self))
            {
                pending.push(me);
                PENDING_COUNT.store(pending.len(), Ordering::Release);
            }
        }
    }

    /// Give back to the pool the fenced blocks the GPU has passed (all of them, waiting,
    /// with [`Wait::Yes`]).
    pub(crate) fn reap(&self, wait: Wait) {
        let fenced = std::mem::take(&mut *self.fenced.lock());
        let mut keep = Vec::new();
        let mut done: Vec<Allocation> = Vec::new();
        for f in fenced {
            let state = match wait {
                Wait::Yes => f.fence.wait(),
                Wait::No => f.fence.poll(),
            };
            if state == FenceState::Passed {
                self.fenced_bytes.fetch_sub(f.bytes, Ordering::Relaxed);
                done.extend(f.blocks);
            } else {
                keep.push(f);
            }
        }
        if !keep.is_empty() {
            self.fenced.lock().extend(keep);
        }
        drop(done); // outside every lock: the memory is the pool's again
    }

    /// Fence every stream's cached blocks, then give back what has passed (or wait).
    pub(crate) fn flush(&self, wait: Wait) {
        let streams = {
            let mut cache = self.cache.lock();
            cache.bytes = 0;
            std::mem::take(&mut cache.streams)
        };
        for (key, s) in streams.into_iter().filter(|(_, s)| s.bytes > 0) {
            self.fence_stream(key, s);
        }
        self.reap(wait);
    }

    /// Fence the blocks freed on a stream about to be destroyed (its handle is valid only
    /// until then).
    pub(crate) fn stream_destroyed(&self, key: StreamKey) {
        let s = {
            let mut cache = self.cache.lock();
            let s = cache.streams.remove(&key);
            if let Some(s) = &s {
                cache.bytes -= s.bytes;
            }
            s
        };
        if let Some(s) = s.filter(|s| s.bytes > 0) {
            self.fence_stream(key, s);
        }
    }

    /// Keep a block a CUDA graph may still use until [`Target::release_parked`].
    pub(crate) fn park(&self, block: Allocation) {
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

impl Drop for Target {
    fn drop(&mut self) {
        // Normally empty: a closed target caches nothing and stays pending until its fences
        // passed. Anything left is fenced and waited for here rather than handed back early.
        let streams = std::mem::take(&mut self.cache.get_mut().streams);
        let mut fenced = std::mem::take(self.fenced.get_mut());
        for (key, s) in streams {
            if let Some(fence) = Fence::record(self.fence_context(), key) {
                fenced.push(Fenced {
                    fence,
                    bytes: s.bytes,
                    blocks: s.into_blocks(),
                });
            } else {
                tracing::error!(model = %self.name, bytes = s.bytes, "routing: freed blocks of a dropped target kept forever: no fence could be recorded");
                std::mem::forget(s);
            }
        }
        for f in fenced {
            if f.fence.wait() != FenceState::Passed {
                tracing::error!(model = %self.name, bytes = f.bytes, "routing: fenced blocks of a dropped target kept forever: the fence did not pass");
                std::mem::forget(f.blocks);
            }
        }
    }
}

/// Give back fenced blocks the GPU has passed, for every target (cheap when there are none).
pub(crate) fn reap_pending() {
    if PENDING_COUNT.load(Ordering::Acquire) == 0 {
        return;
    }
    let targets: Vec<Arc<Target>> = PENDING.lock().clone();
    for t in &targets {
        t.reap(Wait::No);
    }
    drop(targets);
    let done: Vec<Arc<Target>> = {
        let mut pending = PENDING.lock();
        let (keep, done) = std::mem::take(&mut *pending)
            .into_iter()
            .partition(|t| t.fenced_bytes.load(Ordering::Relaxed) > 0);
        *pending = keep;
        PENDING_COUNT.store(pending.len(), Ordering::Release);
        done
    };
    drop(done); // a closed target may end here, outside the lock
}

/// Fence, on every target, the blocks freed on `key` (a stream about to be destroyed).
pub(crate) fn stream_destroyed(key: StreamKey) {
    let all: Vec<Arc<Target>> = ALL.lock().iter().filter_map(Weak::upgrade).collect();
    for t in all {
        t.stream_destroyed(key);
    }
}
