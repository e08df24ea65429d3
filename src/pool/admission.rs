//! Admission of new physical memory: decided before any driver call, credited back after release.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// What an admission granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Grant {
    /// The bytes are charged: create them.
    Charged,
    /// Nothing was charged for the request; instead physical chunks other users held idle were
    /// moved, already created and charged, into the asking pool's cache. Plan again with them.
    Donated,
}

/// Decides whether a pool may create more physical memory.
///
/// `admit` runs before `create` and charges the bytes; `credit` runs after a chunk is released
/// (or when admitted bytes were never created). Chunks taken from a cache are already charged.
pub(crate) trait Admission: Send + Sync + fmt::Debug {
    /// Charge `bytes` of new physical memory or refuse with an error naming the limit.
    /// With `may_reclaim`, memory other users hold idle may be reclaimed to make room; without
    /// it (growth look-ahead, which is optional) the answer is immediate. With `donate`, idle
    /// chunks of other users no bigger than that may be handed over instead (unmapped, never
    /// released and created again), answered with [`Grant::Donated`].
    fn admit(&self, bytes: u64, may_reclaim: bool, donate: Option<u64>) -> Result<Grant>;
    /// Give back `bytes` charged earlier.
    fn credit(&self, bytes: u64);
}

/// A plain physical limit for one pool.
#[derive(Debug)]
pub(crate) struct PhysicalLimit {
    limit: u64,
    used: AtomicU64,
}

impl PhysicalLimit {
    pub(crate) fn new(limit: u64) -> Self {
        PhysicalLimit {
            limit,
            used: AtomicU64::new(0),
        }
    }
}

impl Admission for PhysicalLimit {
    fn admit(&self, bytes: u64, _may_reclaim: bool, _donate: Option<u64>) -> Result<Grant> {
        // A compare-and-swap loop: the limit is never overshot, not even briefly.
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let next = used.checked_add(bytes).filter(|&n| n <= self.limit);
            let Some(next) = next else {
                return Err(Error::OutOfPhysicalMemory {
                    requested: bytes,
                    available: self.limit.saturating_sub(used),
                    source_of_limit: format!(
                        "pool physical limit of {} bytes, {used} in use",
                        self.limit
                    ),
                });
            };
            match self
                .used
                .compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Ok(Grant::Charged),
                Err(actual) => used = actual,
            }
        }
    }

    fn credit(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}
