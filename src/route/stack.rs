//! Which pool the calling thread's allocations go to: a stack of routes per thread, and a
//! process-wide default for allocations made outside any route.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::target::{Place, TagCounters, Target};
use crate::backend::{driver, MemoryKind};
use crate::{Pool, Tag};

/// Bytes of freed blocks a model keeps for same-stream reuse before fencing them back to its
/// pool (see [`super::set_stream_cache_limit`]).
pub const DEFAULT_STREAM_CACHE: u64 = 256 << 20;

/// A route: where allocations go and under which tag.
#[derive(Clone)]
pub(crate) struct Entry {
    id: u64,
    pub(crate) pool: Pool,
    pub(crate) target: Arc<Target>,
    pub(crate) tag: Arc<TagCounters>,
}

thread_local! {
    static STACK: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
    static DEPTH: Cell<usize> = const { Cell::new(0) };
    /// The context last seen current on this thread and its device.
    static PLACE: Cell<(usize, i32)> = const { Cell::new((0, 0)) };
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);
static DEFAULT: RwLock<Option<Entry>> = RwLock::new(None);
static HAS_DEFAULT: AtomicBool = AtomicBool::new(false);

/// Every pool routing has seen, by identity (removed when the pool closes).
static TARGETS: Mutex<Option<HashMap<usize, Arc<Target>>>> = Mutex::new(None);

/// The routing state of `pool`, made (and registered with the pool as its front cache) on
/// first use. Lock order: `TARGETS` -> the pool's state.
pub(crate) fn target_of(pool: &Pool) -> Arc<Target> {
    let mut targets = TARGETS.lock();
    let map = targets.get_or_insert_with(HashMap::new);
    map.entry(pool.identity())
        .or_insert_with(|| {
            let info = pool.backend_info();
            let place = match (info.memory_kind, info.device_ordinal) {
                (MemoryKind::Device, Some(o)) => Place::Cuda(o),
                _ => Place::Host,
            };
            Target::new(pool, place, DEFAULT_STREAM_CACHE)
        })
        .clone()
}

/// The routing state of `pool` if it has one.
pub(crate) fn existing_target(pool: &Pool) -> Option<Arc<Target>> {
    let id = pool.identity();
    TARGETS.lock().as_ref().and_then(|m| m.get(&id).cloned())
}

/// The pool with identity `id` has closed (its last handle is gone): forget its target (a new
/// pool may get the same identity once this one's memory is gone).
pub(crate) fn forget(id: usize) {
    let t = TARGETS.lock().as_mut().and_then(|m| m.remove(&id));
    drop(t); // outside the lock: the caller holds a reference, this is not the last
}

pub(crate) fn new_entry(pool: &Pool, tag: Tag) -> Entry {
    let target = target_of(pool);
    let tag = target.tag(&tag);
    Entry {
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        pool: pool.clone(),
        target,
        tag,
    }
}

/// A route is in force while this guard lives. Not `Send`: it routes the thread that made it.
#[must_use = "the route ends when the guard is dropped"]
pub struct RouteGuard {
    id: u64,
    _thread_bound: PhantomData<*const ()>,
}

impl std::fmt::Debug for RouteGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteGuard").field("id", &self.id).finish()
    }
}

pub(crate) fn push(entry: Entry) -> RouteGuard {
    let id = entry.id;
    STACK.with(|s| s.borrow_mut().push(entry));
    DEPTH.with(|d| d.set(d.get() + 1));
    RouteGuard {
        id,
        _thread_bound: PhantomData,
    }
}

impl Drop for RouteGuard {
    fn drop(&mut self) {
        // Guards normally end innermost first; one dropped out of order still removes exactly
        // its own route. The entry (and the pool handle in it) is dropped after the borrow.
        // During thread teardown the stack may be gone already: nothing left to remove.
        let entry = STACK
            .try_with(|s| {
                let mut s = s.borrow_mut();
                s.iter().rposition(|e| e.id == self.id).map(|i| s.remove(i))
            })
            .ok()
            .flatten();
        if entry.is_some() {
            let _ = DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
        }
        drop(entry);
    }
}

pub(crate) fn set_default(entry: Option<Entry>) {
    let old = {
        let mut d = DEFAULT.write();
        HAS_DEFAULT.store(entry.is_some(), Ordering::Release);
        std::mem::replace(&mut *d, entry)
    };
    drop(old);
}

/// Where the calling thread's CUDA work goes: the device of its current context, or the host
/// when it has none. With it, the context (for fences).
pub(crate) fn current_place() -> (Place, Option<usize>) {
    let Some(d) = driver::driver() else {
        return (Place::Host, None);
    };
    let Some(ctx) = driver::current_context() else {
        return (Place::Host, None);
    };
    let ctx = ctx as usize;
    let (seen, dev) = PLACE.try_with(Cell::get).unwrap_or((0, 0));
    if seen == ctx {
        return (Place::Cuda(dev), Some(ctx));
    }
    match driver::current_device(d) {
        Some(dev) => {
            let _ = PLACE.try_with(|p| p.set((ctx, dev)));
            (Place::Cuda(dev), Some(ctx))
        }
        None => (Place::Host, None),
    }
}

/// The route for an allocation made now on this thread: the innermost route of this thread to
/// a pool on the calling thread's device, else the default if it is on that device.
pub(crate) fn current_route() -> Option<(Entry, Option<usize>)> {
    let routed = DEPTH.try_with(Cell::get).unwrap_or(0) > 0;
    if !routed && !HAS_DEFAULT.load(Ordering::Acquire) {
        return None;
    }
    let (place, ctx) = current_place();
    if routed {
        let found = STACK
            .try_with(|s| {
                s.borrow()
                    .iter()
                    .rev()
                    .find(|e| e.target.place == place)
                    .cloned()
            })
            .ok()
            .flatten();
        if let Some(e) = found {
            return Some((e, ctx));
        }
    }
    let d = DEFAULT.read();
    d.as_ref()
        .filter(|e| e.target.place == place)
        .cloned()
        .map(|e| (e, ctx))
}
