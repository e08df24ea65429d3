//! Admission of new physical memory: decided before any driver call, credited after release.
//!
//! An admission stands between a pool and its backend in the chunk-source stack (cache ->
//! admission -> donation -> backend, see `sources.rs`). It charges bytes the pool is about to
//! create, or answers with chunks other users held idle (a donation: already created, charged
//! over to the asking pool). Every byte charged is counted in the asking pool's in-flight
//! counter in the same critical section as the charge, so that an observer holding the
//! admission's lock and then the pool's sees `charge == mapped + cached + in flight` at every
//! instant.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::PhysicalChunk;
use crate::error::{Error, Result};

/// How much a growth matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Urgency {
    /// The request needs it: other users' idle memory may be handed over or reclaimed first.
    Required,
    /// Look-ahead: taken only if admitted at once, never at anyone's expense.
    LookAhead,
}

/// Which chunks a pool can use for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fit {
    /// The largest chunk it can map.
    pub(crate) max_chunk: u64,
    /// The most bytes it can map in all (donated chunks may exceed the request up to this).
    pub(crate) room: u64,
}

/// What an admission answered.
#[derive(Debug)]
pub(crate) struct Acquired {
    /// Chunks handed over from other users, already charged to the asking pool and counted in
    /// its in-flight bytes.
    pub(crate) donated: Vec<PhysicalChunk>,
    /// Bytes charged for the pool to create (counted in its in-flight bytes too), or why not.
    pub(crate) charged: Result<u64>,
}

/// Decides whether a pool may hold more physical memory.
pub(crate) trait Admission: Send + Sync + fmt::Debug {
    /// Charge `bytes` of new memory, or hand over chunks of other users that fit `fit` (which
    /// may cover all or part of `bytes`), or refuse with an error naming the limit. Whatever is
    /// charged or donated is added to `in_flight` in the same critical section.
    fn acquire(&self, bytes: u64, urgency: Urgency, fit: Fit, in_flight: &AtomicU64) -> Acquired;

    /// Give back `bytes` charged earlier (released, or never created), taking them out of
    /// `in_flight` in the same critical section.
    fn credit(&self, bytes: u64, in_flight: &AtomicU64);

    /// Bytes that could be charged now without reclaiming, and the limit that applies (for the
    /// numbers of a refusal).
    fn room(&self) -> (u64, u64);
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
    fn acquire(&self, bytes: u64, _: Urgency, _: Fit, in_flight: &AtomicU64) -> Acquired {
        // A compare-and-swap loop: the limit is never overshot, not even briefly.
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let Some(next) = used.checked_add(bytes).filter(|&n| n <= self.limit) else {
                return Acquired {
                    donated: Vec::new(),
                    charged: Err(Error::OutOfPhysicalMemory {
                        requested: bytes,
                        available: self.limit.saturating_sub(used),
                        source_of_limit: format!(
                            "pool physical limit of {} bytes, {used} in use",
                            self.limit
                        ),
                    }),
                };
            };
            match self
                .used
                .compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    in_flight.fetch_add(bytes, Ordering::AcqRel);
                    return Acquired {
                        donated: Vec::new(),
                        charged: Ok(bytes),
                    };
                }
                Err(actual) => used = actual,
            }
        }
    }

    fn credit(&self, bytes: u64, in_flight: &AtomicU64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
        in_flight.fetch_sub(bytes, Ordering::AcqRel);
    }

    fn room(&self) -> (u64, u64) {
        let used = self.used.load(Ordering::Acquire);
        (self.limit.saturating_sub(used), self.limit)
    }
}
