//! Memory whose owner went away while candle tensors still use it.
//!
//! A [`super::TensorPool`] dropped while some of its tensors live, or an [`super::ElasticKv`]
//! dropped while a view of it lives, cannot give the memory back (a kernel on a live tensor would
//! read unmapped memory and fault the whole CUDA context) and cannot wait for the tensors either.
//! Its remains are adopted here, logged, and given back once their tensors are gone and the GPU
//! has passed a fence recorded after that: checked by every later [`super::TensorPool::collect`]
//! and by [`reap_orphans`], which never wait for the GPU (a fence not passed yet is checked again
//! by the next one), and waited for by [`super::TensorPool::collect_blocking`] and
//! [`reap_orphans_blocking`]. Nothing is freed early; if nothing ever reaps, the memory simply
//! stays mapped.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::retire::Wait;

/// Remains that wait for their last tensors and for the GPU.
pub(crate) trait Orphan: Send {
    /// Give back what no tensor uses any more and the GPU is done with; with [`Wait::Poll`]
    /// this must not block on the GPU. True when nothing is left.
    fn reap(&mut self, wait: Wait) -> bool;
}

static ADOPTED: Mutex<Vec<Box<dyn Orphan>>> = Mutex::new(Vec::new());
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// Keep `orphan` until its tensors are gone.
pub(crate) fn adopt(orphan: Box<dyn Orphan>) {
    let mut list = ADOPTED.lock();
    list.push(orphan);
    WAITING.store(list.len(), Ordering::Release);
}

/// Give back the memory of dropped tensor pools and elastic tensors whose last tensors are gone
/// and whose fences the GPU has passed; returns how many such owners still wait (for live
/// tensors, or for the GPU). Never waits for the GPU: an owner whose tensors just went gets a
/// fence now and goes at a later call. Every [`super::TensorPool::collect`] calls it; it costs
/// one atomic load when nothing waits.
pub fn reap_orphans() -> usize {
    reap(Wait::Poll)
}

/// As [`reap_orphans`], and wait for the GPU to pass the fences of every owner whose tensors
/// are all gone: afterwards only owners with live tensors wait (except those another thread's
/// reap, running at the same moment, has in hand). [`super::TensorPool::collect_blocking`]
/// calls it.
pub fn reap_orphans_blocking() -> usize {
    reap(Wait::Block)
}

pub(crate) fn reap(wait: Wait) -> usize {
    if WAITING.load(Ordering::Acquire) == 0 {
        return 0;
    }
    // Reaping makes driver calls and drops memory: take the list out instead of holding the
    // lock across them (an orphan adopted meanwhile lands in the emptied list and is kept).
    let mut taken = std::mem::take(&mut *ADOPTED.lock());
    taken.retain_mut(|o| !o.reap(wait));
    let mut list = ADOPTED.lock();
    list.extend(taken);
    WAITING.store(list.len(), Ordering::Release);
    list.len()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;
    use std::sync::Arc;

    use super::*;

    /// Remains that go after `polls_left` polls, or at once on a blocking reap; they count the
    /// reaps of each kind they saw.
    struct Fake {
        polls_left: u32,
        polls: Arc<AtomicU32>,
        blocks: Arc<AtomicU32>,
    }

    impl Orphan for Fake {
        fn reap(&mut self, wait: Wait) -> bool {
            match wait {
                Wait::Poll => {
                    self.polls.fetch_add(1, Ordering::SeqCst);
                    if self.polls_left == 0 {
                        return true;
                    }
                    self.polls_left -= 1;
                    false
                }
                Wait::Block => {
                    self.blocks.fetch_add(1, Ordering::SeqCst);
                    true
                }
            }
        }
    }

    // One test: the adopted list is process-wide.
    #[test]
    fn polling_reaps_never_ask_to_block_and_keep_what_is_not_done() {
        let polls = Arc::new(AtomicU32::new(0));
        let blocks = Arc::new(AtomicU32::new(0));
        let fake = |polls_left| {
            Box::new(Fake {
                polls_left,
                polls: polls.clone(),
                blocks: blocks.clone(),
            })
        };
        adopt(fake(0));
        adopt(fake(2));
        adopt(fake(100));
        assert_eq!(reap_orphans(), 2, "the first one went");
        assert_eq!(reap_orphans(), 2);
        assert_eq!(reap_orphans(), 1, "the second went after two polls");
        assert_eq!(blocks.load(Ordering::SeqCst), 0, "a poll asked to block");
        assert_eq!(polls.load(Ordering::SeqCst), 3 + 2 + 2);
        assert_eq!(
            reap_orphans_blocking(),
            0,
            "a blocking reap waits for the rest"
        );
        assert_eq!(blocks.load(Ordering::SeqCst), 1);
        assert_eq!(reap_orphans(), 0);
        assert_eq!(polls.load(Ordering::SeqCst), 7, "nothing left to ask");
    }
}
