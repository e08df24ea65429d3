//! The host staging buffer a pool sleeps into: allocated once (pinned on CUDA, which is slow),
//! reused by every later sleep, with the copy stream beside it. With a host tier
//! ([`crate::Pool::stage_through`]) the buffer is a region of the tier, mapped in full: no
//! per-pool pinning, and the tier's chunks it gives back serve the next pool's staging.

use std::sync::Arc;

use crate::backend::Backend;
use crate::error::Result;
use crate::pool::{Pool, Region};
use crate::MemOptions;

/// Host memory and a copy stream of one backend. Dropping it frees both: it runs driver calls,
/// so it is never dropped under a lock (the pool takes it out of its state first).
pub(crate) struct Staging {
    backend: Arc<dyn Backend>,
    ptr: *mut u8,
    bytes: u64,
    stream: u64,
    /// The host tier's region the buffer is, if it is one (`None`: the backend's staging
    /// memory, freed with `staging_free`).
    region: Option<Region>,
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
    /// a region of `tier` mapped in full (under the tier's budget).
    pub(crate) fn new(
        backend: &Arc<dyn Backend>,
        bytes: u64,
        tier: Option<&Pool>,
    ) -> Result<Staging> {
        let len = usize::try_from(bytes).map_err(|_| crate::error::Error::SizeOverflow {
            what: "staging buffer",
            detail: format!("{bytes} bytes do not fit in usize"),
        })?;
        let (ptr, region) = match tier {
            Some(tier) => {
                // On failure the region drops: nothing stays mapped.
                let chunk = crate::error::round_up(
                    "host tier staging chunk",
                    crate::DEFAULT_MAX_CHUNK as u64,
                    tier.granularity(),
                )?;
                let region = tier.reserve_region_with(bytes, &MemOptions::new().chunk(chunk))?;
                region.map(0, region.len())?;
                (region.addr() as *mut u8, Some(region))
            }
            None => (backend.copies().staging_alloc(len)?, None),
        };
        let stream = match backend.copies().copy_stream_create() {
            Ok(s) => s,
            Err(e) => {
                if region.is_none() {
                    // SAFETY: the buffer was just allocated by this backend; nothing uses it.
                    let _ = unsafe { backend.copies().staging_free(ptr, len) };
                }
                return Err(e);
            }
        };
        Ok(Staging {
            backend: backend.clone(),
            ptr,
            bytes,
            stream,
            region,
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
        if self.region.take().is_some() {
            // The tier's region went (unmapped, its chunks back to the tier).
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
