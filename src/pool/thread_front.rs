//! Thread fronts: a block a thread freed, kept (when the thread keeps none) for that thread's
//! next allocation of the same size, so that the hot allocate+free pair takes no pool lock
//! (one atomic exchange each way instead of a lock and an unlock each way).
//!
//! A thread front is a front cache ([`super::front`]): the block it holds stays a live
//! allocation in the pool's books, and the pool's state governs it through the [`FrontGate`]:
//! nothing is kept or served while the pool is not awake or is closed, and the pool takes the
//! block back (a flush) before it measures or gives back memory (trim, sleep, close, the
//! shared pool's and the broker's donations, reclaims and limits) and before [`crate::Pool::stats`]
//! and [`crate::Pool::live_allocations`], so that a block freed is not counted in use there.
//!
//! Only blocks without a name and with a built-in tag are kept, and served only to a request
//! of the same footprint and tag, so the book's record stays true.
//!
//! One slot per thread and pool. Its states, and who moves between them:
//! - `EMPTY -> FULL`: the owner thread, after writing the block (a free);
//! - `FULL -> EMPTY`: the owner, taking the block (an allocation);
//! - `FULL -> TAKING -> EMPTY`: anyone flushing, who reads the block and frees it to the pool
//!   in between (a flush that finds `TAKING` waits for `EMPTY`: the block is the pool's then).
//!
//! The owner writes the block only in `EMPTY`, where nobody else reads it. The gate and the
//! slot are a Dekker pair: the pool shuts the gate and then flushes; the owner stores `FULL`
//! and then reads the gate, all sequentially consistent, so either the flush finds the block or
//! the owner sees the gate shut and takes its block back to the pool.

use std::cell::{RefCell, UnsafeCell};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Weak};

use super::front::{FrontCache, FrontGate};
use super::Inner;
use crate::tag::Tag;

const EMPTY: u8 = 0;
const FULL: u8 = 1;
const TAKING: u8 = 2;

/// Which freed blocks a thread front may keep: 0 for none (a named allocation or a
/// [`Tag::Named`] tag), else the built-in tag, which a request must match to be served.
pub(super) fn front_kind(name: Option<&Arc<str>>, tag: &Tag) -> u8 {
    if name.is_some() {
        return 0;
    }
    match tag {
        Tag::Weights => 1,
        Tag::Kv => 2,
        Tag::Activations => 3,
        Tag::Scratch => 4,
        Tag::Named(_) => 0,
    }
}

/// A live block held by a thread front.
#[derive(Debug, Clone, Copy, Default)]
struct Held {
    offset: u64,
    footprint: u64,
    slot: u32,
    kind: u8,
}

/// One thread's slot for one pool (see the module documentation).
struct ThreadSlot {
    /// The pool. Its allocation outlives this weak reference, so no other pool can take its
    /// address while the slot exists (the key of the thread's lookup).
    pool: Weak<Inner>,
    gate: Arc<FrontGate>,
    state: AtomicU8,
    held: UnsafeCell<Held>,
    /// Pairs served here, written by the owner only (no read-modify-write on the hot path);
    /// read for the pool's stats and folded into its books when the thread ends.
    reuses: AtomicU64,
}

// SAFETY: `held` is written only by the owner thread in `EMPTY`, when nobody else reads it, and
// read by the owner (its own writes) or by the one flusher that moved the slot to `TAKING`
// (after the owner's `FULL` store, which it acquired).
unsafe impl Sync for ThreadSlot {}
// SAFETY: as above; the fields are plain data, atomics and reference-counted pointers.
unsafe impl Send for ThreadSlot {}

impl ThreadSlot {
    /// The owner keeps a freed block if it holds none. Returns what the caller frees to the
    /// pool: `block` itself when it was not kept. (A block held stays: replacing it would
    /// cost a batch of frees a lock and two exchanges each.)
    fn keep(&self, block: Held) -> Option<Held> {
        if self.state.load(Ordering::Acquire) != EMPTY {
            return Some(block);
        }
        // SAFETY: the owner in `EMPTY` (see `Sync`).
        unsafe { *self.held.get() = block };
        self.state.store(FULL, Ordering::SeqCst);
        if self.gate.is_open() {
            return None;
        }
        // The pool shut the gate meanwhile: take the block back unless its flush did.
        self.state
            .compare_exchange(FULL, EMPTY, Ordering::SeqCst, Ordering::SeqCst)
            .ok()
            .map(|_| block)
    }

    /// Free a block of this slot to its pool (alive: the block keeps it so).
    fn free_to_pool(&self, held: Held) {
        if let Some(pool) = self.pool.upgrade() {
            drop(pool.free(held.offset, held.footprint, held.slot));
        }
    }

    /// The owner takes its block if it has `footprint` and `kind`.
    fn take(&self, footprint: u64, kind: u8) -> Option<Held> {
        if self.state.load(Ordering::Relaxed) != FULL {
            return None;
        }
        // SAFETY: the owner reads its own write; a flusher may read it too, nobody writes it.
        let held = unsafe { *self.held.get() };
        if held.footprint != footprint || held.kind != kind {
            return None;
        }
        self.state
            .compare_exchange(FULL, EMPTY, Ordering::SeqCst, Ordering::SeqCst)
            .ok()?;
        Some(held)
    }

    /// The owner served its block again: one pair the books did not see.
    fn count_reuse(&self) {
        let n = self.reuses.load(Ordering::Relaxed);
        self.reuses.store(n + 1, Ordering::Relaxed);
    }

    /// Give the block held (if any) back to the pool; waits for a flush by another thread.
    fn give_back(&self) {
        loop {
            match self
                .state
                .compare_exchange(FULL, TAKING, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => break,
                // Another thread is giving it back: done when it is the pool's.
                Err(TAKING) => std::thread::yield_now(),
                Err(_) => return,
            }
        }
        // SAFETY: this thread moved the slot to `TAKING` (see `Sync`).
        let held = unsafe { *self.held.get() };
        self.free_to_pool(held);
        // Only now: a concurrent flush waits in `TAKING` until the block is the pool's.
        self.state.store(EMPTY, Ordering::Release);
    }
}

impl FrontCache for ThreadSlot {
    fn flush(&self) {
        self.give_back();
    }

    fn close(&self) {
        self.give_back();
    }

    fn flush_now(&self) {
        self.give_back();
    }

    fn reuses(&self) -> u64 {
        self.reuses.load(Ordering::Relaxed)
    }
}

/// This thread's slots, one per pool it freed a block of; given back when the thread ends.
struct Slots(Vec<Arc<ThreadSlot>>);

impl Drop for Slots {
    fn drop(&mut self) {
        for s in &self.0 {
            s.give_back();
            if let Some(pool) = s.pool.upgrade() {
                pool.fold_reuses(&s.reuses);
            }
        }
    }
}

thread_local! {
    static SLOTS: RefCell<Slots> = const { RefCell::new(Slots(Vec::new())) };
}

impl Inner {
    /// The allocation fast path: this thread's block of `footprint` and `kind`, still live in
    /// the books (`(offset, slot)`), if the gate is open.
    #[inline]
    pub(super) fn take_from_thread_front(&self, footprint: u64, kind: u8) -> Option<(u64, u32)> {
        if kind == 0 {
            return None;
        }
        let taken = SLOTS
            .try_with(|s| {
                let s = s.try_borrow().ok()?;
                let slot = s.0.iter().find(|x| std::ptr::eq(x.pool.as_ptr(), self))?;
                let held = slot.take(footprint, kind)?;
                if self.front_gate.is_open() {
                    slot.count_reuse();
                    Some(Ok(held))
                } else {
                    Some(Err(held))
                }
            })
            .ok()
            .flatten()?;
        match taken {
            Ok(held) => Some((held.offset, held.slot)),
            Err(held) => {
                // The pool left `Awake` or closed after the block was kept: it goes back, and
                // the caller's slow path says why nothing is served.
                drop(self.free(held.offset, held.footprint, held.slot));
                None
            }
        }
    }

    /// The free fast path: keep a block of `kind` in this thread's front if it holds none.
    /// False when not kept (the caller frees it to the pool).
    #[inline]
    pub(super) fn keep_in_thread_front(
        &self,
        offset: u64,
        footprint: u64,
        slot: u32,
        kind: u8,
    ) -> bool {
        if kind == 0 || !self.front_gate.is_open() {
            return false;
        }
        let block = Held {
            offset,
            footprint,
            slot,
            kind,
        };
        let to_free = SLOTS
            .try_with(|s| {
                let Ok(mut s) = s.try_borrow_mut() else {
                    return Some(block);
                };
                if let Some(x) = s.0.iter().find(|x| std::ptr::eq(x.pool.as_ptr(), self)) {
                    return x.keep(block);
                }
                self.new_thread_slot(&mut s).keep(block)
            })
            .unwrap_or(Some(block));
        to_free.is_none()
    }

    /// A thread front's pairs, counted in the books as its thread ends (under the lock, as
    /// stats read them: never both or neither).
    fn fold_reuses(&self, reuses: &AtomicU64) {
        let mut st = self.state.lock();
        let n = reuses.swap(0, Ordering::Relaxed);
        st.allocations += n;
        st.frees += n;
    }

    /// Register a slot of this thread for this pool (the first free of a kept kind here).
    #[cold]
    #[inline(never)]
    fn new_thread_slot(&self, slots: &mut Slots) -> Arc<ThreadSlot> {
        // Slots of closed pools keep nothing any more. One may still hold a block kept just
        // before the close shut the gate and not yet flushed by it: given back before the slot
        // goes (the pool reaches its slots only through weak references).
        slots.0.retain(|x| {
            let closed = x.gate.is_closed();
            if closed {
                x.give_back();
            }
            !closed
        });
        let slot = Arc::new(ThreadSlot {
            pool: self.me.clone(),
            gate: self.front_gate.clone(),
            state: AtomicU8::new(EMPTY),
            held: UnsafeCell::new(Held::default()),
            reuses: AtomicU64::new(0),
        });
        let weak: Weak<dyn FrontCache> = Arc::downgrade(&slot) as Weak<dyn FrontCache>;
        self.add_front(weak);
        slots.0.push(slot.clone());
        slot
    }
}
