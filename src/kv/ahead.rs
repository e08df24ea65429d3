//! The background thread of a [`super::PagedKv`] with [`super::Watermarks`]: maps blocks ahead
//! of need while warm blocks are below `low` (up to `high`, with memory given at once only),
//! and gives warm blocks above `low` back once no `alloc` came for `idle_after`.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use super::paged::Core;
use super::Watermarks;
use crate::error::{Error, Result};

/// The running thread; stopped (and joined) by [`Ahead::stop`].
pub(crate) struct Ahead {
    thread: JoinHandle<()>,
}

impl Ahead {
    pub(crate) fn start(core: Arc<Core>, w: Watermarks) -> Result<Ahead> {
        let thread = std::thread::Builder::new()
            .name("kv-ahead".into())
            .spawn(move || run(&core, w))
            .map_err(|e| {
                Error::InvalidArgument(format!("starting the KV look-ahead thread: {e}"))
            })?;
        Ok(Ahead { thread })
    }

    /// Stop the thread and wait for it (it finishes the batch it is mapping, if any).
    pub(crate) fn stop(self, core: &Core) {
        core.book.lock().stop = true;
        core.wake.notify_all();
        if self.thread.join().is_err() {
            tracing::error!("the KV look-ahead thread panicked");
        }
    }
}

fn run(core: &Core, w: Watermarks) {
    loop {
        let (refill, trim) = {
            let mut book = core.book.lock();
            if book.stop {
                return;
            }
            let warm = book.warm_len();
            let idle = book.last_alloc.elapsed() >= w.idle_after;
            let refilling = warm < w.low && !book.asleep && !book.trimmed;
            let work = refilling || (idle && warm > w.low);
            if !work {
                core.wake.wait_for(&mut book, w.tick);
                if book.stop {
                    return;
                }
            }
            let warm = book.warm_len();
            let idle = book.last_alloc.elapsed() >= w.idle_after;
            let refill = (warm < w.low && !book.asleep && !book.trimmed).then(|| w.high - warm);
            let trim = idle && warm > w.low;
            (refill, trim)
        };
        if let Some(n) = refill {
            if core.map_ahead(n) == 0 {
                // Refused or nothing cold: wait a tick before trying again.
                let mut book = core.book.lock();
                if !book.stop {
                    core.wake.wait_for(&mut book, w.tick);
                }
            }
        } else if trim {
            core.release_warm(w.low);
            // Not again until the next alloc or idle period.
            let mut book = core.book.lock();
            book.last_alloc = Instant::now();
        }
    }
}
