//! Memory that waits for the GPU: batches of things behind fences, and the one routine that
//! decides which batches may go, shared by tensor pools and the remains of dropped ones.
//!
//! The routine is generic over where fences come from, so that its promise, "a poll never
//! blocks", is tested on the host with a fake GPU (see the tests below).

use std::collections::VecDeque;

use crate::error::{Error, Result};

/// Whether a collect or a reap may wait for the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Record and query fences only: never blocks on the GPU. What it has not passed stays.
    Poll,
    /// Block until the GPU has passed every fence.
    Block,
}

/// Points in one GPU stream, recorded in order.
pub(crate) trait FenceSource {
    /// One point.
    type Fence;
    /// A fence after everything queued so far. Never blocks.
    fn record(&self) -> Result<Self::Fence>;
    /// Whether the GPU has passed `fence`. Never blocks.
    fn is_passed(&self, fence: &Self::Fence) -> Result<bool>;
    /// Block until the GPU has passed `fence`.
    fn wait(&self, fence: &Self::Fence) -> Result<()>;
    /// Block until the GPU has done everything queued so far.
    fn synchronize(&self) -> Result<()>;
}

/// Things that may go once the GPU has passed `fence`. `fence: None`: recording one failed;
/// the next poll records one, a blocking settle synchronizes.
pub(crate) struct Batch<T, F> {
    pub(crate) fence: Option<F>,
    pub(crate) items: Vec<T>,
    pub(crate) bytes: u64,
}

impl<T, F> Batch<T, F> {
    /// `items` behind a fence recorded now (without one, and the error, when recording fails).
    pub(crate) fn fenced<S>(source: &S, items: Vec<T>, bytes: u64) -> (Self, Option<Error>)
    where
        S: FenceSource<Fence = F>,
    {
        let (fence, error) = match source.record() {
            Ok(f) => (Some(f), None),
            Err(e) => (None, Some(e)),
        };
        (
            Batch {
                fence,
                items,
                bytes,
            },
            error,
        )
    }
}

/// The outcome of [`settle`].
pub(crate) struct Settled<T, F> {
    /// Batches the GPU has passed, oldest first: their items may go.
    pub(crate) passed: Vec<Batch<T, F>>,
    /// Batches still waiting, oldest first.
    pub(crate) waiting: VecDeque<Batch<T, F>>,
    /// The first failure; the batch it concerned is waiting.
    pub(crate) error: Option<Error>,
}

/// Sort `batches` (oldest first, fences recorded in that order on one stream) into those the
/// GPU has passed and those still waiting.
///
/// - [`Wait::Poll`] never blocks: it queries fences in order and stops at the first one the GPU
///   has not reached (later fences of the same stream are not reached either); a batch without
///   a fence gets one recorded now.
/// - [`Wait::Block`] waits for every fence; batches without one are covered by a single
///   synchronize.
pub(crate) fn settle<S, T>(
    source: &S,
    batches: VecDeque<Batch<T, S::Fence>>,
    wait: Wait,
) -> Settled<T, S::Fence>
where
    S: FenceSource,
{
    let mut out = Settled {
        passed: Vec::new(),
        waiting: VecDeque::new(),
        error: None,
    };
    // Poll: the GPU has not reached an earlier fence, so it has not reached this one.
    let mut behind = false;
    // Block: a synchronize made every fence passed.
    let mut synchronized = false;
    for mut batch in batches {
        let passed = match wait {
            Wait::Poll => match &batch.fence {
                Some(_) if behind => Ok(false),
                Some(f) => source.is_passed(f),
                // Newer than every other fence: not asked about, only put in place.
                None => source.record().map(|f| {
                    batch.fence = Some(f);
                    false
                }),
            },
            Wait::Block if synchronized => Ok(true),
            Wait::Block => match &batch.fence {
                Some(f) => source.wait(f).map(|()| true),
                None => source.synchronize().map(|()| {
                    synchronized = true;
                    true
                }),
            },
        };
        match passed {
            Ok(true) => out.passed.push(batch),
            Ok(false) => {
                behind = true;
                out.waiting.push_back(batch);
            }
            Err(e) => {
                behind = true;
                out.error.get_or_insert(e);
                out.waiting.push_back(batch);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// A GPU that has done the work up to `done`; fences are sequence numbers.
    #[derive(Default)]
    struct FakeGpu {
        queued: Cell<u64>,
        done: Cell<u64>,
        fail_record: Cell<bool>,
        fail_query: Cell<bool>,
        queries: Cell<u32>,
        waits: Cell<u32>,
        syncs: Cell<u32>,
    }

    impl FenceSource for FakeGpu {
        type Fence = u64;
        fn record(&self) -> Result<u64> {
            if self.fail_record.get() {
                return Err(Error::InvalidArgument("record failed".into()));
            }
            self.queued.set(self.queued.get() + 1);
            Ok(self.queued.get())
        }
        fn is_passed(&self, f: &u64) -> Result<bool> {
            self.queries.set(self.queries.get() + 1);
            if self.fail_query.get() {
                return Err(Error::InvalidArgument("query failed".into()));
            }
            Ok(*f <= self.done.get())
        }
        fn wait(&self, f: &u64) -> Result<()> {
            self.waits.set(self.waits.get() + 1);
            self.done.set(self.done.get().max(*f));
            Ok(())
        }
        fn synchronize(&self) -> Result<()> {
            self.syncs.set(self.syncs.get() + 1);
            self.done.set(self.queued.get());
            Ok(())
        }
    }

    fn batches(gpu: &FakeGpu, n: u32) -> VecDeque<Batch<u32, u64>> {
        (0..n)
            .map(|i| {
                let (b, e) = Batch::fenced(gpu, vec![i], u64::from(i) * 10);
                assert!(e.is_none());
                b
            })
            .collect()
    }

    fn items<'a>(b: impl IntoIterator<Item = &'a Batch<u32, u64>>) -> Vec<u32> {
        b.into_iter().flat_map(|b| b.items.clone()).collect()
    }

    #[test]
    fn a_poll_never_blocks_and_stops_at_the_first_fence_not_passed() {
        let gpu = FakeGpu::default();
        let queue = batches(&gpu, 6);
        gpu.done.set(2);
        let s = settle(&gpu, queue, Wait::Poll);
        assert_eq!(items(&s.passed), [0, 1]);
        assert_eq!(items(&s.waiting), [2, 3, 4, 5]);
        assert!(s.error.is_none());
        assert_eq!((gpu.waits.get(), gpu.syncs.get()), (0, 0), "a poll waited");
        assert_eq!(
            gpu.queries.get(),
            3,
            "fences after the first not passed were asked"
        );
    }

    #[test]
    fn a_poll_while_the_gpu_is_busy_gives_nothing_back_and_a_later_one_does() {
        let gpu = FakeGpu::default();
        let s = settle(&gpu, batches(&gpu, 3), Wait::Poll);
        assert!(s.passed.is_empty());
        assert_eq!(s.waiting.len(), 3);
        // The GPU moves on; the next poll gives everything back, still without waiting.
        gpu.done.set(gpu.queued.get());
        let s = settle(&gpu, s.waiting, Wait::Poll);
        assert_eq!(items(&s.passed), [0, 1, 2]);
        assert!(s.waiting.is_empty());
        assert_eq!((gpu.waits.get(), gpu.syncs.get()), (0, 0));
    }

    #[test]
    fn a_blocking_settle_waits_for_every_fence() {
        let gpu = FakeGpu::default();
        let s = settle(&gpu, batches(&gpu, 4), Wait::Block);
        assert_eq!(items(&s.passed), [0, 1, 2, 3]);
        assert!(s.waiting.is_empty() && s.error.is_none());
        assert_eq!(gpu.waits.get(), 4);
        assert_eq!(gpu.done.get(), 4);
    }

    #[test]
    fn batches_without_a_fence_get_one_on_poll_and_one_synchronize_on_block() {
        let gpu = FakeGpu::default();
        let mut queue = batches(&gpu, 1);
        gpu.fail_record.set(true);
        for i in 1..3 {
            let (b, e) = Batch::fenced(&gpu, vec![i], 0);
            assert!(b.fence.is_none() && e.is_some());
            queue.push_back(b);
        }
        gpu.fail_record.set(false);
        gpu.done.set(1);
        let s = settle(&gpu, queue, Wait::Poll);
        assert_eq!(items(&s.passed), [0]);
        assert_eq!(items(&s.waiting), [1, 2]);
        assert!(
            s.waiting.iter().all(|b| b.fence.is_some()),
            "a poll records the missing fences"
        );
        assert_eq!((gpu.waits.get(), gpu.syncs.get()), (0, 0));

        // Without fences again, a blocking settle synchronizes once for all of them.
        let mut queue = s.waiting;
        for b in &mut queue {
            b.fence = None;
        }
        let s = settle(&gpu, queue, Wait::Block);
        assert_eq!(items(&s.passed), [1, 2]);
        assert_eq!((gpu.waits.get(), gpu.syncs.get()), (0, 1));
    }

    #[test]
    fn failures_keep_the_batch_and_report_the_first_error() {
        let gpu = FakeGpu::default();
        let queue = batches(&gpu, 3);
        gpu.fail_query.set(true);
        let s = settle(&gpu, queue, Wait::Poll);
        assert!(s.passed.is_empty());
        assert_eq!(s.waiting.len(), 3, "nothing lost");
        assert_eq!(gpu.queries.get(), 1, "no query after a failure");
        assert!(s
            .error
            .is_some_and(|e| e.to_string().contains("query failed")));

        gpu.fail_query.set(false);
        gpu.fail_record.set(true);
        let (b, _) = Batch::fenced(&gpu, vec![9], 0);
        let s = settle(&gpu, VecDeque::from([b]), Wait::Poll);
        assert_eq!(s.waiting.len(), 1);
        assert!(s
            .error
            .is_some_and(|e| e.to_string().contains("record failed")));
    }
}
