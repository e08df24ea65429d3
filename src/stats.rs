//! Snapshots of a pool's memory and of the driver calls it made.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::DriverCall;

/// Driver calls by kind, counted as they are made (atomics: the calls happen outside locks).
#[derive(Debug, Default)]
pub(crate) struct DriverCounters {
    counts: [AtomicU64; DriverCall::ALL.len()],
}

impl DriverCounters {
    pub(crate) fn bump(&self, call: DriverCall) {
        self.counts[call.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Count `n` calls of one kind (a batch).
    pub(crate) fn bump_by(&self, call: DriverCall, n: u64) {
        self.counts[call.index()].fetch_add(n, Ordering::Relaxed);
    }

    /// Every call so far, of any kind (cheap: a few atomic loads).
    pub(crate) fn total(&self) -> u64 {
        self.counts
            .iter()
            .fold(0u64, |a, c| a.saturating_add(c.load(Ordering::Relaxed)))
    }

    pub(crate) fn snapshot(&self) -> DriverCalls {
        let mut counts = [0u64; DriverCall::ALL.len()];
        for (dst, src) in counts.iter_mut().zip(&self.counts) {
            *dst = src.load(Ordering::Relaxed);
        }
        DriverCalls { counts }
    }
}

/// How many driver calls of each kind a pool made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverCalls {
    counts: [u64; DriverCall::ALL.len()],
}

impl DriverCalls {
    /// Calls of one kind.
    pub fn get(&self, call: DriverCall) -> u64 {
        self.counts[call.index()]
    }

    /// All calls together (saturating: a sum past `u64::MAX` reads `u64::MAX`).
    pub fn total(&self) -> u64 {
        self.counts.iter().fold(0, |a, &c| a.saturating_add(c))
    }

    /// Calls made between `earlier` and `self`.
    ///
    /// Counts only grow, so each kind is `self - earlier`; where `earlier` is the larger (the
    /// snapshots swapped, or taken from two different pools) that kind reads 0 rather than
    /// wrapping or panicking.
    pub fn since(&self, earlier: &DriverCalls) -> DriverCalls {
        let mut counts = self.counts;
        for (c, e) in counts.iter_mut().zip(earlier.counts) {
            *c = c.saturating_sub(e);
        }
        DriverCalls { counts }
    }
}

impl fmt::Display for DriverCalls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for call in DriverCall::ALL {
            let n = self.get(call);
            if n == 0 {
                continue;
            }
            if !first {
                f.write_str(" ")?;
            }
            first = false;
            write!(f, "{}={}", call.name(), n)?;
        }
        if first {
            f.write_str("none")?;
        }
        Ok(())
    }
}

/// A consistent snapshot of one pool, taken in O(1).
///
/// Physical memory the pool holds is `mapped + cached`. Of the mapped part, `in_use` is held by
/// live allocations and range-API mappings; the rest is idle (mapped, free, reused without a
/// driver call) and goes back with [`crate::Pool::trim`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Virtual bytes reserved.
    pub capacity: u64,
    /// The backend's mapping unit.
    pub granularity: u64,
    /// Physical bytes mapped into the reservation.
    pub mapped: u64,
    /// Bytes held by live allocations (rounded to the allocation unit) and range-API mappings.
    pub in_use: u64,
    /// Of `in_use`, bytes mapped through the range API (regions included).
    pub range_mapped: u64,
    /// Virtual bytes set aside as [`crate::Region`]s, mapped or not.
    pub reserved_regions: u64,
    /// Physical bytes created but unmapped, kept for reuse.
    pub cached: u64,
    /// Physical bytes held by operations in progress (being created, mapped, unmapped,
    /// released or handed over), neither mapped nor cached right now.
    pub in_flight: u64,
    /// Highest `in_use` seen.
    pub peak_in_use: u64,
    /// Highest physical bytes held (see [`PoolStats::physical`]) seen.
    pub peak_physical: u64,
    /// Live allocations.
    pub live_allocations: u64,
    /// Allocations made since the pool was created.
    pub allocations: u64,
    /// Allocations freed since the pool was created.
    pub frees: u64,
    /// Physical chunks currently mapped.
    pub mapped_chunks: u64,
    /// Physical chunks in the cache.
    pub cached_chunks: u64,
    /// Driver calls made, by kind. Creates and releases count the chunks made and given back
    /// (a failed one is not counted: it changed nothing), so for a pool that neither received
    /// nor handed over chunks (shared-pool donation, p2p hand-off), creates minus releases is
    /// the chunks it holds. Other kinds count every call, failed ones included.
    pub driver_calls: DriverCalls,
    /// Bytes of address space whose physical memory sleeps ([`crate::Pool::sleep`]); not
    /// counted in `mapped`.
    pub asleep: u64,
    /// Bytes of host staging memory the pool holds for sleep (allocated once, reused).
    pub host_staging: u64,
    /// Physical bytes another process took over ([`crate::p2p::PeerLink::hand_off`]) whose
    /// release here failed: never reused, still held (and charged) until the pool goes.
    pub given_away: u64,
    /// Physical bytes released here that a p2p peer still keeps imported (its import cache,
    /// [`crate::p2p`]): never reused, still held (and charged) until every such peer forgot
    /// them, released then.
    pub peer_held: u64,
    /// Bytes of the pool's zero page (one granule while a zero-filled region lives, else 0):
    /// physical memory, charged like any chunk (to the pool's limit or its model's ledger
    /// line) and counted in [`PoolStats::physical`], not in `mapped`.
    pub zero_page: u64,
    /// Bytes of address space mapped read-only to the zero page (unbacked parts of
    /// zero-filled regions): no memory of their own, not in `mapped`.
    pub zero_aliased: u64,
    /// Bytes of unbacked region space whose aliasing to the zero page failed (a driver error,
    /// logged), summed over the pool's life: such a granule stays unmapped, so a kernel
    /// reading it faults until it is mapped again. 0 in a healthy pool.
    pub zero_alias_failed: u64,
}

impl PoolStats {
    /// Physical bytes held: mapped, cached, given away but not released, held for peers, and
    /// the zero page.
    pub fn physical(&self) -> u64 {
        self.mapped + self.cached + self.given_away + self.peer_held + self.zero_page
    }

    /// Mapped bytes not in use.
    pub fn idle(&self) -> u64 {
        self.mapped.saturating_sub(self.in_use)
    }
}

/// Bytes as a short human-readable string (binary units).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

impl fmt::Display for PoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "in use {} (peak {}), mapped {} in {} chunks, cached {} in {} chunks, {} live allocations, driver calls: {}",
            human_bytes(self.in_use),
            human_bytes(self.peak_in_use),
            human_bytes(self.mapped),
            self.mapped_chunks,
            human_bytes(self.cached),
            self.cached_chunks,
            self.live_allocations,
            self.driver_calls
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn calls(pairs: &[(DriverCall, u64)]) -> DriverCalls {
        let counters = DriverCounters::default();
        for &(call, n) in pairs {
            for _ in 0..n {
                counters.bump(call);
            }
        }
        counters.snapshot()
    }

    #[test]
    fn since_subtracts_per_kind() {
        let before = calls(&[(DriverCall::Map, 2), (DriverCall::Create, 1)]);
        let after = calls(&[
            (DriverCall::Map, 5),
            (DriverCall::Create, 1),
            (DriverCall::Unmap, 3),
        ]);
        let d = after.since(&before);
        assert_eq!(d.get(DriverCall::Map), 3);
        assert_eq!(d.get(DriverCall::Create), 0);
        assert_eq!(d.get(DriverCall::Unmap), 3);
        assert_eq!(d.total(), 6);
        assert_eq!(d.to_string(), "map=3 unmap=3");
    }

    #[test]
    fn since_with_snapshots_swapped_reads_zero_instead_of_overflowing() {
        // With overflow checks on (scripts/test.sh's profile) this panicked before `since`
        // saturated; in a build without them it wrapped to ~2^64.
        let before = calls(&[(DriverCall::Map, 1)]);
        let after = calls(&[(DriverCall::Map, 4), (DriverCall::SetAccess, 2)]);
        let swapped = before.since(&after);
        assert_eq!(swapped.get(DriverCall::Map), 0);
        assert_eq!(swapped.get(DriverCall::SetAccess), 0);
        assert_eq!(swapped.total(), 0);
        assert_eq!(swapped.to_string(), "none");
        assert_eq!(after.since(&after), DriverCalls::default());
    }

    #[test]
    fn counters_count_each_kind_apart() {
        let counters = DriverCounters::default();
        for (i, call) in DriverCall::ALL.into_iter().enumerate() {
            for _ in 0..=i {
                counters.bump(call);
            }
        }
        let s = counters.snapshot();
        for (i, call) in DriverCall::ALL.into_iter().enumerate() {
            assert_eq!(s.get(call), i as u64 + 1, "{call}");
        }
        assert_eq!(s.total(), (1..=DriverCall::ALL.len() as u64).sum::<u64>());
    }

    #[test]
    fn human_bytes_uses_binary_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1024), "1.00 KiB");
        assert_eq!(human_bytes(3 << 20), "3.00 MiB");
        // PiB is the largest unit: 2^64 bytes read as 16384 PiB.
        assert_eq!(human_bytes(u64::MAX), "16384.00 PiB");
    }
}
