//! Imports kept between grants, and both sides' books of them.
//!
//! Importing a chunk is a driver call per chunk (about 75-80 µs on the H100, whatever its
//! size), and a prefill engine grants the same pages again and again. So the receiver of a grant
//! for copying keeps its chunks imported (not mapped) after the grant ends, under a key the
//! sender chose, and the sender sends later grants of those chunks as keys, with no descriptor:
//! a steady stream of grants imports each page once.
//!
//! The memory a peer keeps imported stays alive whatever the sender does, so the sender's books
//! follow it. A process-wide registry says which chunk (backend, handle) which links' peers
//! keep, under which key. A pool that releases such a chunk keeps it apart instead, still
//! charged ([`crate::PoolStats::peer_held`]), and asks those peers to forget it; the last one's
//! answer releases it. Nothing can reuse the handle meanwhile, so a key never names two
//! allocations; a pool that goes away releases such chunks anyway, and forgets them here
//! first, so the next export of a handle reused by the driver carries a descriptor again.
//!
//! Pools ask through the keeper trait they define ([`crate::pool::keeper`]), which this registry
//! implements and registers when it records its first chunk: the pool imports nothing of p2p.
//!
//! Hand-offs never use the cache: the receiver takes the chunks over, so it imports them fresh.
//!
//! Lock order: the registry's mutex is a leaf, taken under a pool's state lock (so a chunk is
//! marked held back and put apart in one step) and under a link's send lock; it guards
//! bookkeeping only (no driver call, no message, no drop of a link under it).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Weak};

use parking_lot::Mutex;

use super::link::LinkShared;
use crate::backend::{Backend, PhysicalChunk};
use crate::pool::keeper::{self, ChunkKeeper, HeldBack, Later};
use crate::pool::Inner as PoolInner;

/// What names a backend in the registry while it lives (pools that hand chunks to each other
/// share one).
pub(crate) fn backend_key(backend: &Arc<dyn Backend>) -> usize {
    Arc::as_ptr(backend).cast::<()>() as usize
}

/// A peer that keeps a chunk imported: the link to it, and the key it knows the chunk by.
struct Holder {
    link: Weak<LinkShared>,
    key: u64,
}

/// One chunk some peers keep imported.
struct Entry {
    holders: Vec<Holder>,
    /// Released by this pool and kept apart until the last holder forgot it.
    held_back: Option<Weak<PoolInner>>,
}

/// Chunks of this process that peers keep imported, by (backend, handle).
static REGISTRY: LazyLock<Mutex<HashMap<(usize, u64), Entry>>> = LazyLock::new(Default::default);
/// Entries in the registry: pools skip it while it is empty.
static ENTRIES: AtomicUsize = AtomicUsize::new(0);

/// Keys to send in a `Forget` to one link.
type Notices = Vec<(Arc<LinkShared>, Vec<u64>)>;

fn add_notice(notices: &mut Notices, link: Arc<LinkShared>, key: u64) {
    match notices.iter_mut().find(|(l, _)| Arc::ptr_eq(l, &link)) {
        Some((_, keys)) => keys.push(key),
        None => notices.push((link, vec![key])),
    }
}

/// Whether any chunk of this process is kept by a peer (a pool releasing chunks checks first).
fn any() -> bool {
    ENTRIES.load(Ordering::Acquire) > 0
}

/// For each of `raws` of `backend`, the key `link`'s peer keeps it under, if it keeps it and
/// it is not held back (one lock for the whole grant).
pub(crate) fn keys_of(
    backend: usize,
    raws: impl Iterator<Item = u64>,
    link: &Arc<LinkShared>,
) -> Vec<Option<u64>> {
    let reg = REGISTRY.lock();
    raws.map(|raw| {
        let e = reg.get(&(backend, raw))?;
        if e.held_back.is_some() {
            return None;
        }
        e.holders
            .iter()
            .find(|h| std::ptr::eq(h.link.as_ptr(), Arc::as_ptr(link)))
            .map(|h| h.key)
    })
    .collect()
}

/// Record that `link`'s peer keeps `raw` of `backend` imported under `key`.
pub(crate) fn record(backend: usize, raw: u64, link: &Arc<LinkShared>, key: u64) {
    // Pools ask the registry about the chunks they release from now on.
    keeper::register(&KEEPER);
    let mut reg = REGISTRY.lock();
    let e = reg.entry((backend, raw)).or_insert_with(|| {
        ENTRIES.fetch_add(1, Ordering::AcqRel);
        Entry {
            holders: Vec::new(),
            held_back: None,
        }
    });
    e.holders.push(Holder {
        link: Arc::downgrade(link),
        key,
    });
}

/// A pool releasing `chunks` of `backend`: those a live peer keeps are marked held back for
/// `pool` and returned first (the pool keeps them apart, still charged), the rest second (to
/// release), and the keys to ask each peer to forget. Entries of links that are gone are
/// dropped. Called under the pool's state lock.
fn hold_back(
    backend: usize,
    chunks: Vec<PhysicalChunk>,
    pool: &Weak<PoolInner>,
) -> (Vec<PhysicalChunk>, Vec<PhysicalChunk>, Notices) {
    let mut held = Vec::new();
    let mut free = Vec::with_capacity(chunks.len());
    let mut notices: Notices = Vec::new();
    let mut reg = REGISTRY.lock();
    for c in chunks {
        let Some(e) = reg.get_mut(&(backend, c.raw)) else {
            free.push(c);
            continue;
        };
        let live: Vec<(Arc<LinkShared>, u64)> = e
            .holders
            .iter()
            .filter_map(|h| h.link.upgrade().map(|l| (l, h.key)))
            .collect();
        if live.is_empty() {
            reg.remove(&(backend, c.raw));
            ENTRIES.fetch_sub(1, Ordering::AcqRel);
            free.push(c);
            continue;
        }
        e.held_back = Some(pool.clone());
        // Holders whose link is gone never answer: only the live ones are waited for.
        e.holders.retain(|h| h.link.strong_count() > 0);
        for (link, key) in live {
            add_notice(&mut notices, link, key);
        }
        held.push(c);
    }
    drop(reg);
    (held, free, notices)
}

/// A pool going away releases `chunks` whatever peers keep: forget them here (so a handle the
/// driver reuses is exported with a descriptor again) and return the keys to tell the peers.
fn purge(backend: usize, chunks: &[PhysicalChunk]) -> Notices {
    let mut notices: Notices = Vec::new();
    let mut reg = REGISTRY.lock();
    for c in chunks {
        if let Some(e) = reg.remove(&(backend, c.raw)) {
            ENTRIES.fetch_sub(1, Ordering::AcqRel);
            for h in e.holders {
                if let Some(l) = h.link.upgrade() {
                    add_notice(&mut notices, l, h.key);
                }
            }
        }
    }
    drop(reg);
    notices
}

/// `link`'s peer forgot `raw` of `backend`, which it kept under `key`: if no peer keeps it any
/// more and a pool held it back, that pool and the handle, to release it now.
pub(crate) fn forgotten(
    backend: usize,
    raw: u64,
    link: &Arc<LinkShared>,
    key: u64,
) -> Option<Weak<PoolInner>> {
    let mut reg = REGISTRY.lock();
    let e = reg.get_mut(&(backend, raw))?;
    // The key too: after a pool's teardown the handle may name another allocation, which the
    // same peer keeps under another key.
    e.holders
        .retain(|h| !(std::ptr::eq(h.link.as_ptr(), Arc::as_ptr(link)) && h.key == key));
    if !e.holders.is_empty() {
        return None;
    }
    let e = reg.remove(&(backend, raw))?;
    ENTRIES.fetch_sub(1, Ordering::AcqRel);
    e.held_back
}

/// Send each link its `Forget` (once the pool's lock is released), marking the keys as being
/// forgotten in its books.
fn notify_later(notices: Notices) -> Option<Later> {
    if notices.is_empty() {
        return None;
    }
    Some(Box::new(move || {
        for (link, keys) in notices {
            link.forget_out(keys);
        }
    }))
}

/// The registry as the pools' keeper of released chunks.
struct Registry;

static KEEPER: Registry = Registry;

impl ChunkKeeper for Registry {
    fn keeps_any(&self) -> bool {
        any()
    }

    fn hold_back(
        &self,
        backend: &Arc<dyn Backend>,
        chunks: Vec<PhysicalChunk>,
        pool: &Weak<PoolInner>,
    ) -> HeldBack {
        let (held, free, notices) = hold_back(backend_key(backend), chunks, pool);
        HeldBack {
            held,
            free,
            later: notify_later(notices),
        }
    }

    fn purge(&self, backend: &Arc<dyn Backend>, chunks: &[PhysicalChunk]) -> Option<Later> {
        notify_later(purge(backend_key(backend), chunks))
    }
}

/// What a sender's link knows of a chunk its peer keeps imported.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeptOut {
    pub(crate) backend: usize,
    pub(crate) raw: u64,
    pub(crate) size: u64,
    /// A `Forget` went out for it.
    pub(crate) forgetting: bool,
}

/// A chunk of the peer's kept imported here.
#[derive(Debug)]
pub(crate) struct KeptIn {
    pub(crate) chunk: PhysicalChunk,
    /// Mappings of grants using it now.
    pub(crate) users: usize,
    /// The sender asked us to forget it: released once unused.
    pub(crate) forgotten: bool,
}
