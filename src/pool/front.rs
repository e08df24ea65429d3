//! Front caches: holders of memory the pool handed out and its users freed, kept in front of
//! the pool for quick reuse before it comes back (routing's per-stream free lists, and the
//! block each thread keeps: `thread_front.rs`). Their blocks are still live allocations in the
//! pool's books; the pool's state governs them:
//! - a [`FrontGate`] says whether they may serve and keep blocks: open while the pool is awake
//!   and not closed. The pool shuts it under its lock as it leaves `Awake`, and at close (no
//!   lock needed there: the gate never opens again), and only then flushes them; a front cache reads the gate under its own lock when it keeps or serves
//!   a block, so after the flush nothing is kept and nothing is served until the gate opens
//!   (a block freed meanwhile goes back to the pool, behind whatever the holder waits for);
//! - the pool flushes them before it measures or gives back idle memory: trim, sleep, close, and
//!   (through [`super::Inner::flush_fronts`]) the donation, reclaim and limit changes of the
//!   shared pool and the broker.
//!
//! Registration takes the pool's lock, which is a leaf; the pool calls front caches with no lock
//! held, and drops its references to them outside every lock too.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use super::sleep::SleepStatus;
use super::Inner;

/// A holder of freed blocks of one pool (see the module documentation). Called with no pool
/// lock held.
pub(crate) trait FrontCache: Send + Sync {
    /// Give every block held back to the pool (waiting for the GPU where a block waits for it),
    /// including blocks another thread is handing back at the moment: on return none of them
    /// is live in the pool's books. Cheap when nothing is held.
    fn flush(&self);
    /// The pool closed (its gate is shut for good): give everything back, as `flush`.
    fn close(&self);
    /// Give back what needs no waiting (before a stats snapshot, or before an allocation
    /// grows); by default nothing.
    fn flush_now(&self) {}
    /// Allocate+free pairs served without the pool's books (counted in its stats); by default
    /// none.
    fn reuses(&self) -> u64 {
        0
    }
}

/// Whether front caches may keep and serve blocks now (see the module documentation).
#[derive(Debug)]
pub(crate) struct FrontGate {
    awake: AtomicBool,
    closed: AtomicBool,
}

impl FrontGate {
    pub(super) fn new() -> FrontGate {
        FrontGate {
            awake: AtomicBool::new(true),
            closed: AtomicBool::new(false),
        }
    }

    /// Open: the pool is awake and not closed. Sequentially consistent, as the changes: thread
    /// fronts pair it with their slot's state (`thread_front.rs`).
    pub(crate) fn is_open(&self) -> bool {
        self.awake.load(Ordering::SeqCst) && !self.closed.load(Ordering::SeqCst)
    }

    /// Shut for good: the pool closed.
    pub(super) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Follow the pool's sleep status (called under the pool's lock, with every change of it).
    pub(super) fn follow(&self, status: SleepStatus) {
        self.awake
            .store(status == SleepStatus::Awake, Ordering::SeqCst);
    }

    /// Shut for good (the pool closed).
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }
}

impl Inner {
    /// Register a front cache of this pool; it keeps and serves blocks only while the gate
    /// returned is open.
    pub(crate) fn add_front(&self, front: Weak<dyn FrontCache>) -> Arc<FrontGate> {
        let mut st = self.state.lock();
        st.fronts.retain(|f| f.strong_count() > 0);
        st.fronts.push(front);
        self.front_gate.clone()
    }

    /// The live front caches (strong references: dropped by the caller with no lock held).
    fn fronts(&self) -> Vec<Arc<dyn FrontCache>> {
        let st = self.state.lock();
        st.fronts.iter().filter_map(Weak::upgrade).collect()
    }

    /// Give back what front caches hold: it is idle memory of the pool. No lock is held.
    pub(crate) fn flush_fronts(&self) {
        let fronts = self.fronts();
        fronts.iter().for_each(|f| f.flush());
        drop(fronts);
    }

    /// Front caches give back what needs no waiting (thread fronts): before a stats snapshot,
    /// or before an allocation grows the pool.
    pub(crate) fn flush_fronts_now(&self) {
        let fronts = self.fronts();
        fronts.iter().for_each(|f| f.flush_now());
        drop(fronts);
    }

    /// The pool's counters, after front caches gave back what needs no waiting, with the
    /// pairs they served counted (under the pool's lock, as a thread front folds its own in
    /// when its thread ends).
    pub(crate) fn stats_flushed(&self) -> crate::stats::PoolStats {
        let fronts = self.fronts();
        fronts.iter().for_each(|f| f.flush_now());
        let s = {
            let st = self.state.lock();
            let reuses: u64 = fronts.iter().map(|f| f.reuses()).sum();
            let mut s = self.stats_of(&st);
            s.allocations += reuses;
            s.frees += reuses;
            s
        };
        drop(fronts);
        s
    }

    /// The pool closed: front caches give everything back and keep nothing from now on.
    pub(super) fn close_fronts(&self) {
        let fronts = self.fronts();
        fronts.iter().for_each(|f| f.close());
        drop(fronts);
    }
}
