//! Memory whose owner went away while candle tensors still use it.
//!
//! A [`super::TensorPool`] dropped while some of its tensors live, or an [`super::ElasticKv`]
//! dropped while a view of it lives, cannot give the memory back (a kernel on a live tensor would
//! read unmapped memory and fault the whole CUDA context) and cannot wait for the tensors either.
//! Its remains are adopted here, logged, and given back once their tensors are gone: checked by
//! every later [`super::TensorPool::collect`] and by [`reap_orphans`]. Nothing is freed early;
//! if nothing ever reaps, the memory simply stays mapped.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

/// Remains that wait for their last tensors.
pub(crate) trait Orphan: Send {
    /// Give back what no tensor uses any more; true when nothing is left.
    fn reap(&mut self) -> bool;
}

static ADOPTED: Mutex<Vec<Box<dyn Orphan>>> = Mutex::new(Vec::new());
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// Keep `orphan` until its tensors are gone.
pub(crate) fn adopt(orphan: Box<dyn Orphan>) {
    let mut list = ADOPTED.lock();
    list.push(orphan);
    WAITING.store(list.len(), Ordering::Release);
}

/// Give back the memory of dropped tensor pools and elastic tensors whose last tensors are
/// gone now; returns how many such owners still wait for live tensors. Every
/// [`super::TensorPool::collect`] calls it; it costs one atomic load when nothing waits.
pub fn reap_orphans() -> usize {
    if WAITING.load(Ordering::Acquire) == 0 {
        return 0;
    }
    // Reaping makes driver calls: take the list out instead of holding the lock across them.
    let mut taken = std::mem::take(&mut *ADOPTED.lock());
    taken.retain_mut(|o| !o.reap());
    let mut list = ADOPTED.lock();
    list.extend(taken);
    WAITING.store(list.len(), Ordering::Release);
    list.len()
}
