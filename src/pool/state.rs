//! The pool's bookkeeping, changed only under the pool's lock and never across a driver call.
//!
//! Every byte of the reservation is in exactly one place:
//! - `cold`: unmapped and free;
//! - `idle` or `quick`: mapped and free (the allocator's warm memory);
//! - a live allocation;
//! - `ranges`: mapped through the range API (inside a region or not);
//! - `held`: unmapped, inside a [`crate::Region`] (set aside for its owner's range mappings);
//! - `stuck`: mapped chunks whose unmap failed during a rollback: kept out of every use, retried
//!   by trim and teardown;
//! - in transit: claimed by an operation that is making driver calls right now.
//!
//! Physical chunks are in `chunks` (mapped), in `cache`, or in flight (see `sources.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::cache::ChunkCache;
use super::intervals::{FreeRanges, Intervals};
use super::mapper::bytes_of;
use super::sleep::SleepBook;
use super::tags::TagMap;
use crate::backend::PhysicalChunk;
use crate::tag::Tag;

/// Exact-size lists of recently freed ranges, so that allocate/free of the same size does not
/// walk the coalescing structures. Flushed into `idle` before growing and when trimming.
#[derive(Debug, Default)]
pub(crate) struct QuickBins {
    bins: Vec<(u64, Vec<u64>)>,
    bytes: u64,
}

const QUICK_SIZES: usize = 16;
const QUICK_DEPTH: usize = 256;

impl QuickBins {
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn take(&mut self, size: u64) -> Option<u64> {
        let (_, list) = self.bins.iter_mut().find(|(s, _)| *s == size)?;
        let off = list.pop()?;
        self.bytes -= size;
        Some(off)
    }

    /// Keep `[off, off + size)` in a bin; gives it back when the bins are full.
    pub(crate) fn put(&mut self, off: u64, size: u64) -> Option<u64> {
        if let Some((_, list)) = self.bins.iter_mut().find(|(s, _)| *s == size) {
            if list.len() < QUICK_DEPTH {
                list.push(off);
                self.bytes += size;
                return None;
            }
            return Some(off);
        }
        if self.bins.len() < QUICK_SIZES {
            self.bins.push((size, vec![off]));
            self.bytes += size;
            return None;
        }
        Some(off)
    }

    /// Everything in the bins, as `(offset, size)`.
    pub(crate) fn drain(&mut self) -> Vec<(u64, u64)> {
        self.bytes = 0;
        let mut out = Vec::new();
        for (size, list) in &mut self.bins {
            out.extend(list.drain(..).map(|off| (off, *size)));
        }
        self.bins.retain(|(_, l)| !l.is_empty());
        out
    }
}

/// One live allocation, for reports and leak warnings.
#[derive(Debug, Clone)]
pub(crate) struct LiveRecord {
    pub(crate) offset: u64,
    pub(crate) footprint: u64,
    pub(crate) name: Option<Arc<str>>,
    pub(crate) tag: Tag,
}

/// Live allocations in O(1) slots.
#[derive(Debug, Default)]
pub(crate) struct Slab {
    entries: Vec<Option<LiveRecord>>,
    vacant: Vec<u32>,
    live: u64,
}

impl Slab {
    pub(crate) fn insert(&mut self, rec: LiveRecord) -> u32 {
        self.live += 1;
        if let Some(i) = self.vacant.pop() {
            self.entries[i as usize] = Some(rec);
            i
        } else {
            self.entries.push(Some(rec));
            (self.entries.len() - 1) as u32
        }
    }

    pub(crate) fn remove(&mut self, slot: u32) -> Option<LiveRecord> {
        let rec = self.entries.get_mut(slot as usize)?.take()?;
        self.vacant.push(slot);
        self.live -= 1;
        Some(rec)
    }

    pub(crate) fn get(&self, slot: u32) -> Option<&LiveRecord> {
        self.entries.get(slot as usize)?.as_ref()
    }

    pub(crate) fn live(&self) -> u64 {
        self.live
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &LiveRecord> {
        self.entries.iter().flatten()
    }
}

/// One reference to the pool shared by all its live allocations, so that allocating and freeing
/// touch no reference count: taken with the first allocation, given up once the pool is closed
/// and no allocation is live (while the pool is open its handle keeps the pool alive anyway).
/// Invariant: held whenever an allocation is live.
#[derive(Default)]
pub(crate) struct KeepAlive(Option<Arc<super::Inner>>);

impl KeepAlive {
    /// Hold the pool (an allocation was just recorded live).
    pub(crate) fn hold(&mut self, pool: &Arc<super::Inner>) {
        if self.0.is_none() {
            self.0 = Some(pool.clone());
        }
    }

    /// A reference of its own for a caller that uses the pool past the lock.
    pub(crate) fn clone_held(&self) -> Option<Arc<super::Inner>> {
        self.0.clone()
    }
}

impl std::fmt::Debug for KeepAlive {
    // Not the pool itself: it contains this.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "held" } else { "none" })
    }
}

/// All of a pool's mutable bookkeeping.
#[derive(Debug, Default)]
pub(crate) struct State {
    /// Set once the last [`crate::Pool`] handle is gone: frees then give memory straight back.
    pub(crate) closed: bool,
    /// Set when the pool must take no new memory (its model was unregistered): why.
    pub(crate) refusing: Option<Arc<str>>,
    pub(crate) cold: Intervals,
    pub(crate) idle: FreeRanges,
    pub(crate) quick: QuickBins,
    pub(crate) ranges: Intervals,
    /// The tag of each range-API mapping (read where `ranges` says mapped).
    pub(crate) range_tags: TagMap,
    /// Sleep and wake: the pool's phase, its sleeping chunks and host copies.
    pub(crate) sleep: SleepBook,
    /// The zero page and which unmapped granules of regions alias it (`zero.rs`).
    pub(crate) zero: super::zero::ZeroBook,
    /// Holders of freed blocks in front of the pool (`front.rs`).
    pub(crate) fronts: Vec<std::sync::Weak<dyn super::FrontCache>>,
    /// Address ranges set aside as [`crate::Region`]s: the allocator and [`crate::Pool::map`]
    /// never use them. Mapped parts are in `ranges`, unmapped parts in `held`.
    pub(crate) regions: Intervals,
    /// The unmapped part of `regions`.
    pub(crate) held: Intervals,
    /// Mapped chunks that a failed rollback left behind (perhaps without access): never handed
    /// out, retried by trim and teardown. Their chunks are in `chunks`.
    pub(crate) stuck: Intervals,
    /// Ranges being read or written through a [`crate::Region`] right now: unmapping any byte
    /// of them is refused until the copy is done.
    pub(crate) pins: Vec<(u64, u64)>,
    /// Mapped chunks by offset.
    pub(crate) chunks: BTreeMap<u64, PhysicalChunk>,
    pub(crate) cache: ChunkCache,
    /// Chunks another process took over (a p2p hand-off) whose release here failed: never
    /// reused (the other process owns their memory), still charged, released at teardown.
    pub(crate) given_away: Vec<PhysicalChunk>,
    /// Chunks released here that another process still keeps imported (a p2p peer's import
    /// cache, see `crate::p2p`): never reused, still charged (their memory is alive), released
    /// once every peer forgot them.
    pub(crate) peer_held: Vec<PhysicalChunk>,
    /// Handles of `peer_held` chunks that were handed off: kept apart if their release fails.
    pub(crate) peer_held_apart: Vec<u64>,
    pub(crate) live: Slab,
    /// The reference to the pool that live allocations share (see [`KeepAlive`]).
    pub(crate) keep_alive: KeepAlive,
    pub(crate) alloc_bytes: u64,
    pub(crate) mapped: u64,
    pub(crate) in_transit: u64,
    /// Allocations and range mappings in progress (each holds part of `in_transit`).
    pub(crate) growing: u32,
    pub(crate) peak_in_use: u64,
    pub(crate) peak_physical: u64,
    pub(crate) allocations: u64,
    pub(crate) frees: u64,
}

impl State {
    /// The shared reference of the allocations, once no allocation is live (the pool closed):
    /// to be dropped by the caller with no lock held.
    pub(crate) fn take_unused_keep_alive(&mut self) -> Option<Arc<super::Inner>> {
        if self.live.live() == 0 {
            self.keep_alive.0.take()
        } else {
            None
        }
    }

    pub(crate) fn in_use(&self) -> u64 {
        self.alloc_bytes + self.ranges.total()
    }

    pub(crate) fn physical(&self) -> u64 {
        self.mapped
            + self.cache.bytes()
            + bytes_of(&self.given_away)
            + bytes_of(&self.peer_held)
            + self.zero.chunk.map_or(0, |c| c.size as u64)
    }

    pub(crate) fn note_peaks(&mut self) {
        self.peak_in_use = self.peak_in_use.max(self.in_use());
        self.peak_physical = self.peak_physical.max(self.physical());
    }

    /// Move everything in the quick bins into the coalescing idle set.
    pub(crate) fn flush_quick(&mut self) {
        for (off, size) in self.quick.drain() {
            self.idle.insert(off, off + size);
        }
    }

    /// Take idle memory for `footprint` bytes without any driver call.
    pub(crate) fn take_warm(&mut self, footprint: u64) -> Option<u64> {
        if let Some(off) = self.quick.take(footprint) {
            return Some(off);
        }
        self.idle.take_best_fit(footprint)
    }

    /// Return a freed range to the warm memory.
    pub(crate) fn put_warm(&mut self, off: u64, size: u64) {
        if let Some(off) = self.quick.put(off, size) {
            self.idle.insert(off, off + size);
        }
    }

    /// The free set that unmapped range-API memory at `[start, end)` belongs to: `held` inside a
    /// region, `cold` outside. Ranges never straddle a region's edge.
    pub(crate) fn unmapped_home(&mut self, start: u64, end: u64) -> &mut Intervals {
        if self.regions.covers(start, end) {
            &mut self.held
        } else {
            &mut self.cold
        }
    }

    /// Remove from `chunks` and `idle` every mapped chunk that lies wholly in idle memory;
    /// returns them as `(offset, chunk)`. The caller unmaps them and then returns the ranges to
    /// `cold` (or, on failure, puts them back).
    pub(crate) fn take_idle_chunks(&mut self, limit: u64) -> Vec<(u64, PhysicalChunk)> {
        if !self.sleep.idle_chunks_movable() {
            return Vec::new();
        }
        self.flush_quick();
        let mut out = Vec::new();
        let mut taken = 0u64;
        let candidates: Vec<(u64, PhysicalChunk)> = self
            .chunks
            .iter()
            .filter(|(&off, c)| self.idle.intervals().covers(off, off + c.size as u64))
            .map(|(&off, &c)| (off, c))
            .collect();
        for (off, c) in candidates {
            if taken >= limit {
                break;
            }
            self.idle.remove(off, off + c.size as u64);
            self.chunks.remove(&off);
            taken += c.size as u64;
            out.push((off, c));
        }
        self.mapped -= taken;
        self.in_transit += taken;
        out
    }

    /// Take every stuck chunk out, as [`State::take_idle_chunks`] does idle ones, to unmap it
    /// again.
    pub(crate) fn take_stuck_chunks(&mut self) -> Vec<(u64, PhysicalChunk)> {
        let mut out = Vec::new();
        let ranges: Vec<(u64, u64)> = self.stuck.iter().collect();
        for (s, e) in ranges {
            self.stuck.remove(s, e);
            let placed: Vec<(u64, PhysicalChunk)> =
                self.chunks.range(s..e).map(|(&o, &c)| (o, c)).collect();
            for (o, c) in placed {
                self.chunks.remove(&o);
                self.mapped -= c.size as u64;
                self.in_transit += c.size as u64;
                out.push((o, c));
            }
        }
        out
    }

    /// Record chunks still mapped after a failed rollback as stuck.
    pub(crate) fn put_stuck(&mut self, placed: &[(u64, PhysicalChunk)]) {
        for &(o, c) in placed {
            let size = c.size as u64;
            self.chunks.insert(o, c);
            self.stuck.insert(o, o + size);
            self.mapped += size;
        }
    }

    /// Whether any byte of `[start, end)` is pinned.
    pub(crate) fn pinned_in(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        self.pins
            .iter()
            .copied()
            .find(|&(s, e)| s < end && start < e)
    }

    /// Verify that every byte is accounted for exactly once. O(n); for tests and debugging.
    pub(crate) fn audit(&self, capacity: u64) -> Result<(), String> {
        let chunk_bytes: u64 = self.chunks.values().map(|c| c.size as u64).sum();
        if chunk_bytes != self.mapped {
            return Err(format!(
                "mapped chunks sum to {chunk_bytes}, counter says {}",
                self.mapped
            ));
        }
        let live_bytes: u64 = self.live.iter().map(|r| r.footprint).sum();
        if live_bytes != self.alloc_bytes {
            return Err(format!(
                "live allocations sum to {live_bytes}, counter says {}",
                self.alloc_bytes
            ));
        }
        let mapped_parts = self.idle.total()
            + self.quick.bytes()
            + self.alloc_bytes
            + self.ranges.total()
            + self.stuck.total();
        // Memory whose chunks sleep keeps its place in the books (allocations, ranges, idle).
        let asleep = self.sleep.asleep_bytes();
        if self.in_transit == 0 && mapped_parts != self.mapped + asleep {
            return Err(format!(
                "idle {} + quick {} + allocations {} + ranges {} = {mapped_parts}, but {} mapped and {asleep} asleep",
                self.idle.total(),
                self.quick.bytes(),
                self.alloc_bytes,
                self.ranges.total(),
                self.mapped
            ));
        }
        self.sleep.audit(&self.chunks)?;
        let all = mapped_parts + self.cold.total() + self.held.total() + self.in_transit;
        if all != capacity {
            return Err(format!(
                "mapped parts {mapped_parts} + cold {} + held {} + in transit {} = {all}, capacity {capacity}",
                self.cold.total(),
                self.held.total(),
                self.in_transit
            ));
        }
        self.zero.audit(&self.held)?;
        for (s, e) in self.held.iter() {
            if !self.regions.covers(s, e) {
                return Err(format!(
                    "held range [{s:#x}, {e:#x}) lies outside every region"
                ));
            }
        }
        for (&off, c) in &self.chunks {
            if self.cold.first_overlap(off, off + c.size as u64).is_some() {
                return Err(format!("chunk at {off:#x} overlaps unmapped space"));
            }
        }
        Ok(())
    }
}
