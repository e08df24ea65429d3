//! Compaction of a [`super::PagedKv`]: live blocks moved off sparsely used pages into free
//! slots of densely used ones, so that the sparse pages go back to the pool.
//!
//! # Why
//! A page of each tensor holds `page / span` blocks (64 for a Llama-8B-like shape in 2 MiB
//! pages). Sequences allocated interleaved in time and finished in random order leave the
//! survivors scattered over many pages: after a spike, the idle footprint is a few times the
//! packed floor ([`super::PagedKvStats::packed_floor_bytes`]) and no placement policy at
//! `alloc` time can prevent it. Only moving blocks can, and moving a block changes its id, so
//! the engine must agree: compaction is never automatic. [`super::PagedKv::compaction_gain`]
//! says what a compaction would give back now; an engine calls [`super::PagedKv::compact`]
//! between steps when that is worth it and renames the ids in its block tables.
//!
//! # The plan
//! Blocks are grouped by the page they lie on (the same page index in every tensor: a group
//! costs `tensors` pages). Groups with memory are ranked by their backed blocks (live plus
//! warm). The *targets* are the densest groups, as few as hold every backed block (the packed
//! floor); every other group is a source. From the sparsest source, a group is *evacuated*
//! into the free unbacked slots of the targets (slots whose pages are mapped already, so taking
//! them costs no memory): its live blocks are copied into those slots and renamed, its warm
//! blocks are replaced by warm blocks in those slots (no copy), and its pages go back to the
//! pool. A group is evacuated whole or not at all (half an evacuation gives nothing back), and
//! a group with blocks in flight (an alloc, a release or a look-ahead still mapping) is left
//! for a later call; once every source is evacuated the cache is at its packed floor and a
//! compaction moves nothing. Only pages of `page / span >= 2` blocks are compacted (a block with pages of its
//! own has nothing to share); other geometries plan nothing.
//!
//! # Steps, and what can fail
//! 1. Under the book's lock: pick the groups (at most `max_moves` live blocks), mark the live
//!    blocks to move *moving* ([`super::PagedKv::free`] refuses them until the compaction
//!    ends) and take the destination slots out of the free lists (no `alloc` hands them out).
//! 2. Back the destinations (their pages are mapped already: no memory, no driver call, unless
//!    a concurrent release unmapped one meanwhile).
//! 3. Pin the moving blocks and the destinations in the backing: nothing can unmap them, and a
//!    sleep of the pool is refused while the pin is held (a sleep under way refuses the pin).
//! 4. Copy every moved block's span in every tensor in one batch: on device memory, one launch
//!    of the gather kernel (or a batch of device-to-device copies where the backend has none) on
//!    `stream`, then a wait for the stream; on host memory, through a bounce buffer with the
//!    backend's staging copies (a host `memcpy` on the host backend).
//! 5. Under the lock: the destinations become live, the old blocks free; the pin goes.
//! 6. The old blocks and the evacuated groups' warm blocks are released (their pages unmapped,
//!    aliased to the zero page again) on a background thread: [`PagedKv::compact`] returns
//!    once it is handed over, with a [`GiveBack`] to wait on. The driver's unmaps cost tens of
//!    microseconds a page (a spike's give-back is 70-110 ms on the H100), which the engine
//!    between two steps should not wait for. Until it lands the blocks are in transit (in no
//!    free list: no `alloc` takes them, no compaction plans their group), and
//!    [`PagedKv::trim`] waits for it, so a limit lowered right after a compaction sees the
//!    pages back.
//!
//! A sleep of the pool waits for give-backs under way before it begins (their unmaps need the
//! pool awake); one that a sleep overtakes anyway (a compaction started as the sleep began)
//! leaves its pages mapped, unused, through the sleep, and the next [`PagedKv::trim`]
//! unmaps them. Lock order: the book, then a [`GiveBack`]'s own state (a leaf).
//!
//! A failure in 2 to 4 rolls everything back: the destinations are released (free again), the
//! moving blocks stay live under their ids with their contents, and the error is
//! [`crate::Error::KvCompactionFailed`]. A failure in 6 cannot lose a block: a release that
//! fails keeps the blocks warm (mapped, free), as any release of the cache.
//!
//! # Contract with the engine, and why it is sound
//! - **Ids**: when `compact` returns `Ok`, every moved block is free and its contents live
//!   under the new id ([`Compaction::moves`]); the engine renames them in its block tables
//!   before it queues more work on them. Until `compact` returns, the old ids are live and
//!   cannot be freed ([`crate::Error::KvBadBlock`] says why); other blocks can be allocated and
//!   freed as usual from other threads.
//! - **Work in flight** on a moved block must be finished, or ordered before the copy, when
//!   `compact` is called. On CUDA the copy runs on `stream`: [`super::PagedKv::compact`] uses
//!   the legacy default stream, which CUDA orders after all work queued before on every blocking
//!   stream (every thread's per-thread default stream, which candle launches on), and
//!   [`crate::candle::PagedKvTensors::compact`] the candle device's ordering stream: kernels
//!   queued on those before the call are safe. A kernel on an unordered stream (a non-blocking
//!   stream of the engine's own) that still writes a moved block may have its write lost (the
//!   copy read it before), and one that touches the old block after its release reads zeros (its
//!   pages are aliased to the zero page) or, writing, faults like any write into a free block
//!   (CUDA: an illegal-address error that poisons the context). That is GPU-side misuse by the
//!   engine, never host memory unsafety.
//! - **Host soundness**: the only host-side memory accesses the compaction makes are the
//!   staging copies of step 4, on the spans of pinned blocks: mapped (the pin keeps them from
//!   being released or slept) and not aliased by any Rust reference the cache handed out (it
//!   hands out none: its memory is reached through addresses, and reading or writing them needs
//!   `unsafe` code whose contract excludes touching a block while a compaction may move it, as
//!   it excludes touching a free block). Destinations are free blocks that no safe code can
//!   reach, taken out of the free lists before the copy. So no safe call (alloc, free, trim,
//!   sleep, a second compaction, another thread's anything) can make the copy race a Rust
//!   reference or touch unmapped memory: free of a moving block is refused, release of a pinned
//!   block is refused, sleep is refused while pinned, and a second compaction is refused
//!   ([`crate::Error::KvCompactionBusy`]).

use std::cmp::Reverse;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::paged::{group_of, Book, Core};
use super::BlockId;
use crate::backend::{gather_or_copy_async, GatherPiece, GatherShift, MemoryKind};
use crate::error::{Error, Result};
use crate::layout::copies::runs;

/// What a [`super::PagedKv::compact`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Compaction {
    /// `(old id, new id)` of every moved block, sorted by old id: rename them in the block
    /// tables. Empty when nothing was worth moving.
    pub moves: Vec<(BlockId, BlockId)>,
    /// Bytes copied (every moved block's span in every tensor).
    pub bytes_copied: u64,
    /// Giving the emptied pages back to the pool, after the call (see [`GiveBack`]).
    pub give_back: GiveBack,
    /// Wall time of the call (what the engine waited for; not the give-back).
    pub elapsed: Duration,
    /// Of `elapsed`: backing the destinations (maps, and clearing where the cache clears).
    pub backing: Duration,
    /// Of `elapsed`: the copies, queued and waited for (not the pin before them, which may
    /// wait for blocks another thread maps).
    pub copying: Duration,
}

/// The give-back of a compaction's emptied pages, on a background thread after
/// [`super::PagedKv::compact`] returned: the old blocks and the evacuated groups' warm blocks
/// released, their pages unmapped and aliased to the zero page again. Clones share it; dropping
/// it waits for nothing (the give-back goes on; dropping the cache waits for it).
#[derive(Clone, Default)]
pub struct GiveBack {
    /// `None`: nothing was given back (an empty compaction).
    shared: Option<Arc<GiveBackState>>,
}

struct GiveBackState {
    /// Blocks handed over.
    blocks: usize,
    /// Bytes of pages given back and the time it took, once done.
    done: Mutex<Option<(u64, Duration)>>,
    landed: Condvar,
}

impl GiveBack {
    fn start(blocks: usize) -> GiveBack {
        GiveBack {
            shared: Some(Arc::new(GiveBackState {
                blocks,
                done: Mutex::new(None),
                landed: Condvar::new(),
            })),
        }
    }

    fn finish(&self, bytes: u64, took: Duration) {
        if let Some(s) = &self.shared {
            *s.done.lock() = Some((bytes, took));
            s.landed.notify_all();
        }
    }

    /// Blocks handed to the give-back (the moved blocks' old ids and the evacuated groups'
    /// warm blocks).
    pub fn blocks(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.blocks)
    }

    /// Whether it is done.
    pub fn is_done(&self) -> bool {
        self.shared.as_ref().is_none_or(|s| s.done.lock().is_some())
    }

    /// Wait until it is done; the bytes of pages given back to the pool (a release that failed
    /// keeps its blocks warm, logged, and gives nothing back).
    pub fn wait(&self) -> u64 {
        let Some(s) = &self.shared else {
            return 0;
        };
        let mut done = s.done.lock();
        loop {
            if let Some((bytes, _)) = *done {
                return bytes;
            }
            s.landed.wait(&mut done);
        }
    }

    /// How long the give-back took on its thread (the device wait before it, the unmaps), once
    /// done.
    pub fn took(&self) -> Option<Duration> {
        match &self.shared {
            None => Some(Duration::ZERO),
            Some(s) => s.done.lock().map(|(_, took)| took),
        }
    }
}

impl std::fmt::Debug for GiveBack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let done = self.shared.as_ref().map(|s| *s.done.lock());
        f.debug_struct("GiveBack")
            .field("blocks", &self.blocks())
            .field("done", &done)
            .finish()
    }
}

/// Two handles are equal when they are the same give-back (or both empty).
impl PartialEq for GiveBack {
    fn eq(&self, other: &Self) -> bool {
        match (&self.shared, &other.shared) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Eq for GiveBack {}

impl Compaction {
    /// The new id of `old`, if it was moved.
    pub fn new_id(&self, old: BlockId) -> Option<BlockId> {
        self.moves
            .binary_search_by_key(&old, |m| m.0)
            .ok()
            .map(|i| self.moves[i].1)
    }

    /// `id` after the compaction: its new id if it moved, else itself.
    pub fn rename(&self, id: BlockId) -> BlockId {
        self.new_id(id).unwrap_or(id)
    }

    /// Whether nothing moved and nothing is given back.
    pub fn is_empty(&self) -> bool {
        self.moves.is_empty() && self.give_back.blocks() == 0
    }
}

/// What a compaction without a move limit would do now ([`super::PagedKv::compaction_gain`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompactionGain {
    /// Live blocks it would move (and rename).
    pub moves: usize,
    /// Bytes it would copy.
    pub bytes_to_copy: u64,
    /// Bytes of pages it would give back to the pool.
    pub bytes_released: u64,
}

/// A compaction's plan: which live blocks go where, which slots become warm, which groups
/// empty.
#[derive(Debug, Default)]
struct Plan {
    /// `(old, new)`, sorted by old.
    moves: Vec<(usize, usize)>,
    /// Slots that become warm in place of the evacuated groups' warm blocks.
    rewarm: Vec<usize>,
    /// The groups evacuated.
    groups: Vec<usize>,
}

impl Core {
    /// Blocks per group when they share pages evenly (`page / span >= 2`, a whole number).
    fn per_group(&self) -> Option<usize> {
        let unit = self.geo.unit;
        (self.page % unit == 0)
            .then_some(self.page / unit)
            .filter(|&p| p >= 2)
            .map(|p| p as usize)
    }

    /// Bytes of pages a group costs (one page per tensor).
    fn group_bytes(&self) -> u64 {
        self.geo.tensors * self.page
    }

    /// The plan for at most `max_moves` moved blocks; read-only.
    fn plan(&self, book: &Book, max_moves: usize) -> Plan {
        let mut plan = Plan::default();
        let Some(per) = self.per_group() else {
            return plan;
        };
        let n = self.config.max_blocks;
        let groups = book.group_backed.len();
        let (mut live, mut warm, mut cold) = (vec![0; groups], vec![0; groups], vec![0; groups]);
        for (b, _) in book.live.iter().enumerate().filter(|(_, &l)| l) {
            live[b / per] += 1;
        }
        for &b in &book.warm {
            warm[b / per] += 1;
        }
        for &(_, b) in &book.cold {
            cold[b / per] += 1;
        }
        debug_assert!((0..n).all(|b| group_of(&self.geo, self.page, b) == b / per));
        let blocks = |g: usize| g * per..((g + 1) * per).min(n);
        // Every block of the group is live (handed out, not moving), warm or cold: none is in
        // the middle of an alloc, a release, a look-ahead or a move between caches, so the
        // group can be emptied.
        let settled = |g: usize| {
            let r = blocks(g);
            live[g] + warm[g] + cold[g] == r.len()
                && book.in_alloc.range(r.clone()).next().is_none()
                && book.tiered.range(r).next().is_none()
        };
        let is_cold = |b: usize| book.cold.contains(&(0, b)) || book.cold.contains(&(1, b));
        let need = |g: usize| live[g] + warm[g];
        // Targets: the densest backed groups, as few as hold every live and warm block (the
        // packed floor); every other group is a source whose blocks move into the targets'
        // free slots. (Moving only into groups denser than the source stopped half way on the
        // H100: survivors fill their groups unevenly, 2.52x the floor after compaction.)
        let mut ranked: Vec<usize> = (0..groups).filter(|&g| book.group_backed[g] > 0).collect();
        // The null block's group is never emptied: always a target, first.
        let null_group = self
            .config
            .null_block
            .then(|| group_of(&self.geo, self.page, 0));
        ranked.sort_by_key(|&g| (Some(g) != null_group, Reverse(need(g)), g));
        let total: usize = ranked.iter().map(|&g| need(g)).sum();
        let (mut held, mut free, mut t) = (0usize, 0usize, 0usize);
        while t < ranked.len() && held + free < total {
            let g = ranked[t];
            held += need(g);
            free += blocks(g).filter(|&b| is_cold(b)).count();
            t += 1;
        }
        // Slots of the targets, lowest ids popped first.
        let mut slots: Vec<usize> = ranked[..t]
            .iter()
            .flat_map(|&g| blocks(g))
            .filter(|&b| is_cold(b))
            .collect();
        slots.sort_unstable_by(|a, b| b.cmp(a));
        // Sources, sparsest first (they cost the fewest moves per page given back).
        for &g in ranked[t..].iter().rev() {
            if need(g) == 0 || !settled(g) || Some(g) == null_group {
                continue;
            }
            if plan.moves.len() + live[g] > max_moves || slots.len() < need(g) {
                break;
            }
            for b in blocks(g) {
                if book.live[b] {
                    plan.moves.extend(slots.pop().map(|to| (b, to)));
                } else if book.warm.contains(&b) {
                    plan.rewarm.extend(slots.pop());
                }
            }
            plan.groups.push(g);
        }
        plan.moves.sort_unstable();
        plan
    }

    /// What an unlimited compaction would do now.
    pub(super) fn compaction_gain(&self) -> CompactionGain {
        let plan = {
            let book = self.book.lock();
            self.plan(&book, usize::MAX)
        };
        CompactionGain {
            moves: plan.moves.len(),
            bytes_to_copy: plan.moves.len() as u64 * self.geo.unit * self.geo.tensors,
            bytes_released: plan.groups.len() as u64 * self.group_bytes(),
        }
    }

    /// See [`super::PagedKv::compact`]; the copies go on `stream` where the memory is a
    /// device's.
    pub(super) fn compact(self: &Arc<Self>, max_moves: usize, stream: u64) -> Result<Compaction> {
        if max_moves == 0 {
            return Err(Error::InvalidArgument(
                "paged KV compaction: max_moves is 0 (at least the blocks of one page, e.g. page / span - 1, to make progress)".into(),
            ));
        }
        let started = Instant::now();
        let plan = {
            let mut book = self.book.lock();
            if book.asleep {
                return Err(self.asleep_error("compact"));
            }
            if book.compacting {
                return Err(Error::KvCompactionBusy { op: "compact" });
            }
            let plan = self.plan(&book, max_moves);
            if plan.groups.is_empty() {
                return Ok(Compaction {
                    elapsed: started.elapsed(),
                    ..Compaction::default()
                });
            }
            book.compacting = true;
            for &(old, new) in &plan.moves {
                book.moving.insert(old);
                take_cold(&mut book, new);
            }
            for &new in &plan.rewarm {
                take_cold(&mut book, new);
            }
            plan
        };
        let copy_bytes = plan.moves.len() as u64 * self.geo.unit * self.geo.tensors;
        match self.move_blocks(&plan, stream) {
            Ok((pin, backing, copying)) => {
                let (to_release, parked) = {
                    let mut book = self.book.lock();
                    for &(old, new) in &plan.moves {
                        book.live[old] = false;
                        book.live[new] = true;
                        book.moving.remove(&old);
                    }
                    book.warm.extend(plan.rewarm.iter().copied());
                    self.landed.notify_all();
                    let mut out: Vec<usize> = plan.moves.iter().map(|m| m.0).collect();
                    // The groups' free unbacked blocks rank as costing no memory until their
                    // pages are unmapped: parked in transit meanwhile, so no alloc or look-ahead
                    // takes them and keeps the pages the give-back is about to return.
                    let mut parked = Vec::new();
                    let per = self.per_group().unwrap_or(1);
                    for &g in &plan.groups {
                        let end = ((g + 1) * per).min(self.config.max_blocks);
                        // Warm blocks an alloc took meanwhile are live now: they stay.
                        for b in g * per..end {
                            if book.warm.remove(&b) {
                                out.push(b);
                            } else if book.cold.remove(&(0, b)) || book.cold.remove(&(1, b)) {
                                parked.push(b);
                            }
                        }
                    }
                    // Counted in the same critical section: a trim from now on waits for it.
                    book.giving_back += 1;
                    book.compacting = false;
                    book.compactions += 1;
                    book.blocks_moved += plan.moves.len() as u64;
                    (out, parked)
                };
                drop(pin);
                let give_back = self.give_back(to_release, parked, true);
                let done = Compaction {
                    moves: plan.moves,
                    bytes_copied: copy_bytes,
                    give_back,
                    elapsed: started.elapsed(),
                    backing,
                    copying,
                };
                tracing::debug!(moved = done.moves.len(), groups = plan.groups.len(), bytes_copied = copy_bytes, giving_back = done.give_back.blocks(), elapsed = ?done.elapsed, "paged KV cache compacted");
                Ok(done)
            }
            Err(e) => {
                {
                    let mut book = self.book.lock();
                    for &(old, _) in &plan.moves {
                        book.moving.remove(&old);
                    }
                    book.compacting = false;
                }
                tracing::warn!(error = %e, moves = plan.moves.len(), "paged KV compaction failed; rolled back");
                Err(Error::KvCompactionFailed {
                    moves: plan.moves.len(),
                    bytes: copy_bytes,
                    source: Box::new(e),
                })
            }
        }
    }

    /// Step 6: release `blocks` (taken out of the book: in transit, counted in `giving_back`)
    /// on a background thread, or on this one where no thread can be started; then put the
    /// `parked` free blocks back in the cold list, ranked by what is mapped then. Also the
    /// source's pages after a move between caches (`compaction` false).
    pub(super) fn give_back(
        self: &Arc<Self>,
        blocks: Vec<usize>,
        parked: Vec<usize>,
        compaction: bool,
    ) -> GiveBack {
        let handle = GiveBack::start(blocks.len());
        let run = {
            let (core, handle) = (self.clone(), handle.clone());
            move || {
                // Whatever happens (a panic included), the give-back ends in the books.
                let mut landing = Landing {
                    core: &core,
                    handle: &handle,
                    parked: &parked,
                    compaction,
                    bytes: 0,
                    took: Duration::ZERO,
                };
                let t = Instant::now();
                landing.bytes = core.release(&blocks);
                landing.took = t.elapsed();
                tracing::debug!(
                    blocks = blocks.len(),
                    bytes = landing.bytes,
                    took = ?landing.took,
                    compaction,
                    "paged KV cache gave pages back after the call"
                );
                drop(landing);
            }
        };
        {
            // Threads that ended are let go here; the cache's drop joins the rest.
            self.book.lock().give_backs.retain(|t| !t.is_finished());
        }
        // `spawn` does not hand the closure back when it fails: it waits in a slot.
        let job = Arc::new(Mutex::new(Some(run)));
        let spawned = {
            let job = job.clone();
            std::thread::Builder::new()
                .name("kv-give-back".into())
                .spawn(move || job.lock().take().into_iter().for_each(|run| run()))
        };
        match spawned {
            Ok(t) => self.book.lock().give_backs.push(t),
            Err(e) => {
                tracing::warn!(error = %e, "no thread for a compaction's give-back; giving back on the caller's");
                job.lock().take().into_iter().for_each(|run| run());
            }
        }
        handle
    }

    /// Steps 2 to 4: back the destinations, pin, copy; with the time backing and copying
    /// took. On failure the destinations are released again (free, out of the compaction's
    /// hands) before this returns.
    fn move_blocks(
        &self,
        plan: &Plan,
        stream: u64,
    ) -> Result<(crate::backing::BlockPin, Duration, Duration)> {
        let t = Instant::now();
        let fresh: Vec<usize> = plan
            .moves
            .iter()
            .map(|m| m.1)
            .chain(plan.rewarm.iter().copied())
            .collect();
        if let Err(e) = self.backing.ensure_backed(fresh.iter().copied()) {
            // Nothing was backed: the slots go back to the free lists as they were.
            let mut book = self.book.lock();
            for &b in &fresh {
                let r = book.rank(&self.geo, self.page, b);
                book.cold.insert((r, b));
            }
            self.landed.notify_all();
            return Err(e);
        }
        {
            let mut book = self.book.lock();
            for &b in &fresh {
                self.backed(&mut book, b);
            }
        }
        let backing = t.elapsed();
        let pinned = plan.moves.iter().flat_map(|&(old, new)| [old, new]);
        let done = self
            .backing
            .pin(pinned, "paged KV compaction")
            .and_then(|pin| {
                // The copy alone: the pin may have waited for blocks being mapped elsewhere.
                let t = Instant::now();
                self.copy(&plan.moves, stream)
                    .map(|()| (pin, backing, t.elapsed()))
            });
        if done.is_err() {
            // The pin (if any) is gone: the destinations are backed blocks of ours alone.
            self.release(&fresh);
        }
        done
    }

    /// Copy each moved block's span in every tensor, old to new, and wait for the copies.
    fn copy(&self, moves: &[(usize, usize)], stream: u64) -> Result<()> {
        if moves.is_empty() {
            return Ok(());
        }
        let unit = self.geo.unit;
        // One piece per run of consecutive blocks moved to consecutive slots.
        let (olds, news): (Vec<usize>, Vec<usize>) = moves.iter().copied().unzip();
        let pieces: Vec<GatherPiece> = runs(&olds, &news)
            .into_iter()
            .map(|(old, new, n)| GatherPiece {
                src: old as u64 * unit,
                dst: new as u64 * unit,
                len: n as u64 * unit,
            })
            .collect();
        let base = self.backing.addr();
        let shifts: Vec<GatherShift> = (0..self.geo.tensors)
            .map(|t| {
                let at = base + t * self.geo.stride;
                GatherShift { src: at, dst: at }
            })
            .collect();
        let backend = self.pool.backend();
        let copies = backend.copies();
        if backend.info().memory_kind == MemoryKind::Device {
            // SAFETY: every range is a span of a pinned block in the cache's region: mapped
            // with access until the pin goes, which is after the wait below. Sources are live
            // blocks, destinations free slots taken out of the free lists: no destination
            // overlaps another copy's source or destination. Work queued before on streams
            // `stream` is ordered with precedes the copy; the engine promises nothing else
            // touches the blocks (see the module's contract).
            let queued = unsafe { gather_or_copy_async(copies, &pieces, &shifts, stream) };
            // Whatever failed, nothing may stay queued on the blocks once the pin goes.
            let waited = copies.synchronize(stream);
            return queued.and(waited);
        }
        // Host memory: through a bounce buffer of one piece at most, in order on one stream.
        let longest = pieces.iter().map(|p| p.len).max().unwrap_or(0) as usize;
        let bounce = copies.staging_alloc(longest)?;
        let stream = match copies.copy_stream_create() {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: allocated above, nothing queued on it.
                let _ = unsafe { copies.staging_free(bounce, longest) };
                return Err(e);
            }
        };
        let mut result = Ok(());
        'all: for s in &shifts {
            for p in &pieces {
                let len = p.len as usize;
                // SAFETY: the source is a pinned live block's span (mapped with access), the
                // bounce buffer staging memory of this backend of at least `len` bytes, used by
                // nothing else; copies on one stream run in order, so the write below reads
                // what this read wrote, and the next read waits for it.
                let r = unsafe {
                    copies
                        .copy_to_host_async(bounce, s.src + p.src, len, stream)
                        .and_then(|()| {
                            copies.copy_from_host_async(s.dst + p.dst, bounce, len, stream)
                        })
                };
                if let Err(e) = r {
                    result = Err(e);
                    break 'all;
                }
            }
        }
        // SAFETY: `stream` came from `copy_stream_create`; the marker is waited for once.
        let waited = unsafe { copies.marker_record(stream) }
            .and_then(|m| unsafe { copies.marker_wait(m) })
            .or_else(|e| copies.synchronize(stream).map(|_| ()).or(Err(e)));
        if let Err(e) = waited {
            // Copies may still be queued on the buffer: leak it rather than free it under them.
            tracing::error!(error = %e, bytes = longest, "waiting for a compaction's copies failed; its bounce buffer and stream are leaked");
            return Err(e);
        }
        // SAFETY: everything queued on the stream ran (waited above), so the buffer and the
        // stream are free.
        unsafe {
            if let Err(e) = copies.copy_stream_destroy(stream) {
                tracing::warn!(error = %e, "destroying a compaction's copy stream failed");
            }
            if let Err(e) = copies.staging_free(bounce, longest) {
                tracing::warn!(error = %e, "freeing a compaction's bounce buffer failed");
            }
        }
        result
    }
}

/// The end of a give-back, in its drop so that a panic ends it too: the parked blocks back in
/// the cold list, the bytes counted, the handle done, then `giving_back` down (a trim that
/// returns finds the handle done) and waiters woken.
struct Landing<'a> {
    core: &'a Core,
    handle: &'a GiveBack,
    parked: &'a [usize],
    /// A compaction's (its bytes counted as compacted), or a move's source.
    compaction: bool,
    bytes: u64,
    took: Duration,
}

impl Drop for Landing<'_> {
    fn drop(&mut self) {
        let mut book = self.core.book.lock();
        for &b in self.parked {
            let r = book.rank(&self.core.geo, self.core.page, b);
            book.cold.insert((r, b));
        }
        if self.compaction {
            book.bytes_compacted += self.bytes;
        }
        self.handle.finish(self.bytes, self.took);
        book.giving_back -= 1;
        drop(book);
        self.core.landed.notify_all();
    }
}

/// Take free unbacked block `b` out of the cold list (a slot chosen by the plan, under the
/// same lock, so it is there).
fn take_cold(book: &mut Book, b: usize) {
    if !book.cold.remove(&(0, b)) {
        book.cold.remove(&(1, b));
    }
}
