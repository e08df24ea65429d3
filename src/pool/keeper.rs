//! Chunks a pool releases that a layer above it still uses (a p2p peer keeps them imported):
//! the pool does not know who, it asks the keeper registered in this process. A chunk the
//! keeper holds back stays apart, still charged ([`crate::PoolStats::peer_held`]), until the
//! keeper calls [`Inner::release_held_back`]; a pool that goes away releases its chunks anyway
//! and tells the keeper first ([`ChunkKeeper::purge`]).
//!
//! Lock order: the keeper's own lock is a leaf, taken under a pool's state lock
//! ([`ChunkKeeper::hold_back`]), so a chunk is marked held back and put apart in one step. What
//! the keeper must do without locks (messages to peers) it returns as a [`Later`], which the
//! pool runs once its lock is released.

use std::sync::{Arc, OnceLock, Weak};

use super::Inner;
use crate::backend::{Backend, PhysicalChunk};

/// Work a keeper does once the pool's lock is released.
pub(crate) type Later = Box<dyn FnOnce()>;

/// Chunks being released, as the keeper sorted them.
pub(crate) struct HeldBack {
    /// Still used above the pool: kept apart, charged, until the keeper releases them.
    pub(crate) held: Vec<PhysicalChunk>,
    /// Free to release now.
    pub(crate) free: Vec<PhysicalChunk>,
    /// To run after the pool's lock.
    pub(crate) later: Option<Later>,
}

/// What keeps chunks of this process alive after their pool released them.
pub(crate) trait ChunkKeeper: Send + Sync {
    /// Whether it keeps any chunk now: pools releasing chunks skip it otherwise.
    fn keeps_any(&self) -> bool;

    /// `pool` releases `chunks` of `backend`: those still kept are marked held back for `pool`
    /// (released by [`Inner::release_held_back`] once free). Called under the pool's state
    /// lock: no driver call, no pool lock, no message here (put those in `later`).
    fn hold_back(
        &self,
        backend: &Arc<dyn Backend>,
        chunks: Vec<PhysicalChunk>,
        pool: &Weak<Inner>,
    ) -> HeldBack;

    /// A pool going away releases `chunks` of `backend` whatever is kept: forget them (a
    /// handle the driver reuses must not be taken for the old chunk).
    fn purge(&self, backend: &Arc<dyn Backend>, chunks: &[PhysicalChunk]) -> Option<Later>;
}

/// The keeper of this process: one (p2p's), registered before it keeps anything.
static KEEPER: OnceLock<&'static dyn ChunkKeeper> = OnceLock::new();

/// Register `keeper` for every pool of this process; once only (later calls change nothing).
pub(crate) fn register(keeper: &'static dyn ChunkKeeper) {
    let _ = KEEPER.set(keeper);
}

/// The keeper, where one is registered and keeps something.
pub(crate) fn active() -> Option<&'static dyn ChunkKeeper> {
    KEEPER.get().copied().filter(|k| k.keeps_any())
}
