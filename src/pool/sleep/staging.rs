//! The host staging buffer a pool sleeps into: allocated once (pinned on CUDA, which is slow),
//! reused by every later sleep, with the copy stream beside it. With a host tier
//! ([`crate::Pool::stage_through`]) the buffer is an allocation of the tier: no per-pool
//! pinning, and when it is given back its memory stays mapped in the tier as idle memory (under
//! the tier's budget), so the next staging buffer of any pool sharing the tier is served from it
//! with no driver call at all (no create, no map, no access grant: on CUDA those cost about
//! 200 ms per GiB of host memory). [`crate::Pool::prefill`] makes a tier ready once per process.

use std::sync::Arc;

use super::SleepWatcher;
use crate::backend::Backend;
use crate::error::Result;
use crate::pool::{Allocation, Pool};
use crate::MemOptions;

/// Host memory and a copy stream of one backend. Dropping it frees both: it runs driver calls,
/// so it is never dropped under a lock (the pool takes it out of its state first).
pub(crate) struct Staging {
    backend: Arc<dyn Backend>,
    ptr: *mut u8,
    bytes: u64,
    stream: u64,
    /// The host tier's allocation the buffer is, if it is one (`None`: the backend's staging
    /// memory, freed with `staging_free`).
    tier_memory: Option<Allocation>,
    /// Keeps the tier awake while the buffer lives (registered before the memory is allocated).
    hold: Option<TierHold>,
}

/// A watcher on the host tier holding a staging buffer: the tier's sleep would unmap the buffer
/// under the pool that copies into and out of it through a raw pointer, so it is refused.
struct TierHold {
    tier: Pool,
    id: u64,
    _watcher: Arc<dyn SleepWatcher>,
}

struct RefuseSleep {
    tier: String,
    bytes: u64,
}

impl SleepWatcher for RefuseSleep {
    fn freeze(&self) -> Result<()> {
        Err(crate::error::Error::SleepRefused {
            pool: self.tier.clone(),
            op: "sleep",
            reason: format!(
                "a pool's host staging buffer of {} bytes lives in this tier (Pool::stage_through); release it first (Pool::release_host_staging, or stage_through(None))",
                self.bytes
            ),
        })
    }
    fn thaw(&self) {}
    fn unmapping_all(&self) {}
    fn mapped_all(&self) -> Result<()> {
        Ok(())
    }
}

impl TierHold {
    fn new(tier: &Pool, bytes: u64) -> TierHold {
        let watcher: Arc<dyn SleepWatcher> = Arc::new(RefuseSleep {
            tier: tier.name().to_string(),
            bytes,
        });
        let id = tier.inner().add_watcher(Arc::downgrade(&watcher));
        TierHold {
            tier: tier.clone(),
            id,
            _watcher: watcher,
        }
    }
}

impl Drop for TierHold {
    fn drop(&mut self) {
        self.tier.inner().remove_watcher(self.id);
    }
}

// SAFETY: the buffer is owned by this value alone (no alias outlives it) and only the sleep or
// wake that holds the pool's phase touches it; the stream handle is a process-wide driver object.
unsafe impl Send for Staging {}
// SAFETY: as above: `&Staging` only reads the handle values.
unsafe impl Sync for Staging {}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging")
            .field("bytes", &self.bytes)
            .field("stream", &format_args!("{:#x}", self.stream))
            .finish()
    }
}

impl Staging {
    /// Allocate `bytes` of staging memory and a copy stream: the backend's staging memory, or
    /// an allocation of `tier` (its idle memory when it has enough, else grown under the
    /// tier's budget; a tier at its budget gives its idle memory back for it first).
    pub(crate) fn new(
        backend: &Arc<dyn Backend>,
        bytes: u64,
        tier: Option<&Pool>,
    ) -> Result<Staging> {
        let len = usize::try_from(bytes).map_err(|_| crate::error::Error::SizeOverflow {
            what: "staging buffer",
            detail: format!("{bytes} bytes do not fit in usize"),
        })?;
        let (ptr, tier_memory, hold) = match tier {
            Some(tier) => {
                // First: a sleep of the tier from here on is refused (one under way refuses
                // the map below).
                let hold = TierHold::new(tier, bytes);
                // On failure nothing was allocated; the hold drops.
                let a = tier.allocate_with(len, &MemOptions::new().name("host staging"))?;
                (a.addr() as *mut u8, Some(a), Some(hold))
            }
            None => (backend.copies().staging_alloc(len)?, None, None),
        };
        let stream = match backend.copies().copy_stream_create() {
            Ok(s) => s,
            Err(e) => {
                if tier_memory.is_none() {
                    // SAFETY: the buffer was just allocated by this backend; nothing uses it.
                    let _ = unsafe { backend.copies().staging_free(ptr, len) };
                }
                // The memory before the hold that keeps the tier awake under it.
                drop(tier_memory);
                drop(hold);
                return Err(e);
            }
        };
        Ok(Staging {
            backend: backend.clone(),
            ptr,
            bytes,
            stream,
            tier_memory,
            hold,
        })
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn stream(&self) -> u64 {
        self.stream
    }

    /// The host address `at` bytes into the buffer; `at + len` must lie within it.
    pub(crate) fn at(&self, at: u64, len: u64) -> *mut u8 {
        assert!(
            at.checked_add(len).is_some_and(|e| e <= self.bytes),
            "staging range {at}+{len} outside a buffer of {} bytes",
            self.bytes
        );
        // SAFETY: checked just above to lie within the allocation.
        unsafe { self.ptr.add(at as usize) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: the stream is ours; every copy on it was waited for by the operation that
        // queued it (sleep and wake wait for all their markers, also when they fail).
        if let Err(e) = unsafe { self.backend.copies().copy_stream_destroy(self.stream) } {
            tracing::warn!(error = %e, "destroying the staging copy stream failed");
        }
        if self.tier_memory.take().is_some() {
            // The tier's allocation went (idle in the tier, mapped, for the next buffer); then
            // the tier may sleep again.
            drop(self.hold.take());
            return;
        }
        // SAFETY: allocated by this backend with this size; no copy on it is queued any more.
        if let Err(e) = unsafe {
            self.backend
                .copies()
                .staging_free(self.ptr, self.bytes as usize)
        } {
            tracing::warn!(error = %e, bytes = self.bytes, "freeing the staging buffer failed");
        }
    }
}
