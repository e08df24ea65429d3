//! Blocks moved between two paged KV caches of one shape on different memory: a cache on the
//! device and one on a host tier ([`crate::Pool::host_tier`]), so that an engine evicts cold
//! blocks to host memory and brings them back ([`PagedKv::move_to`]). Both caches are elastic:
//! the destination maps what it takes under its pool's limit, the source gives back what it
//! frees. Which blocks go, and when, is the engine's policy.
//!
//! A move takes its destination blocks (an `alloc` of the destination cache) and starts the
//! copies (a copy stream of the device, optionally ordered after the engine's stream; threads
//! between two host caches), then returns a [`KvMove`]. It does so in up to [`BATCHES`]
//! batches, so that the destination maps a batch's pages while the copies of the batches
//! before it run: a cold destination (pages not mapped yet) costs its mapping or its copies,
//! whichever is longer, not both. Until it is waited for:
//! - the source blocks keep their ids and contents; the destination blocks are the move's;
//!   both are pinned: neither freed (refused, nothing changed) nor moved by a compaction, and
//!   neither cache's pool sleeps (refused);
//! - the engine must not write the source blocks, nor read the destination ones before
//!   [`KvMove::is_done`] or a stream ordered after it ([`KvMove::order_before`]).
//!
//! [`KvMove::wait`] settles: on success the source blocks are freed (kept warm as a `free`
//! does, or their pages given back on a background thread after the wait, as a compaction's
//! are: [`PagedKv::trim`], a sleep and the cache's drop wait for it) and the destination ids
//! are the engine's; on a failure the destination blocks are freed and the source blocks are
//! as they were. A move dropped unwaited settles then; a
//! move forgotten keeps both caches' memory (it holds them) and their pools awake: nothing is
//! unmapped under a copy.
//!
//! Lock order: each cache's book is taken alone, never across a copy, a driver call or a
//! join.

use std::cell::Cell;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use super::paged::{BlockId, Core, PagedKv};
use crate::error::{Error, Result};
use crate::layout::copies::{check_between_pools, runs, start_between_pools, Flight, Piece};
use crate::layout::MoveReport;

/// A move of blocks between two paged KV caches, under way ([`PagedKv::move_to`]). Wait for it
/// with [`KvMove::wait`]; dropped without a wait, it is waited for then (the outcome logged).
#[must_use = "a move is settled when it is waited for (or dropped, which waits)"]
pub struct KvMove {
    src: Arc<Core>,
    dst: Arc<Core>,
    from: Vec<BlockId>,
    to: Vec<BlockId>,
    /// One per batch; empty once settled.
    flights: Vec<Flight>,
    bytes: u64,
    copies: usize,
    started: Instant,
}

/// Most batches a move is cut into (each its own alloc and its own copies).
const BATCHES: usize = 4;
/// Fewest blocks worth a batch of their own.
const BATCH_MIN: usize = 32;

impl PagedKv {
    /// Move blocks `ids` of this cache to `dst`, a cache of the same shape (layout, layers,
    /// block size; any `max_blocks`) on other memory: device <-> a host tier of that device,
    /// or host <-> host. Returns at once with the copies under way; see the
    /// [module documentation](crate::kv) and [`KvMove`]. [`KvMove::destinations`] are the
    /// blocks' ids in `dst`, paired by position with `ids`.
    ///
    /// Refused before anything changes: an id out of range, not allocated, named twice, or
    /// busy (being allocated, compacted or moved); two caches of different shapes, or memory
    /// no copy reaches (device <-> device: same device copies are not a tier move); either
    /// pool asleep; too few blocks free in `dst`. Blocks `dst` cannot admit (its pool's limit),
    /// or blocks a concurrent alloc of `dst` took meanwhile, fail the move part way: then the
    /// copies started are waited for and everything is given back, as after a failed copy.
    pub fn move_to(&self, ids: &[BlockId], dst: &PagedKv) -> Result<KvMove> {
        // SAFETY: no stream to order after.
        unsafe { start(self.core(), ids, dst.core(), None) }
    }

    /// [`PagedKv::move_to`], with the device copies ordered after the work queued so far on
    /// `stream` (the engine's stream whose kernels wrote the blocks): the host does not wait.
    /// Refused (nothing changed) for a move no device makes (between two host caches).
    ///
    /// # Safety
    /// `stream` is a live stream (a raw `CUstream`, or a special handle of
    /// [`crate::backend::Copies::copy_async`]) of the device whose cache the move copies.
    pub unsafe fn move_to_after(
        &self,
        ids: &[BlockId],
        dst: &PagedKv,
        stream: u64,
    ) -> Result<KvMove> {
        // SAFETY: the caller's promise.
        unsafe { start(self.core(), ids, dst.core(), Some(stream)) }
    }
}

/// # Safety
/// `after`, when given, is a live stream of the device whose cache the move copies.
unsafe fn start(
    src: &Arc<Core>,
    ids: &[BlockId],
    dst: &Arc<Core>,
    after: Option<u64>,
) -> Result<KvMove> {
    let started = Instant::now();
    if Arc::ptr_eq(src, dst) {
        return Err(Error::InvalidArgument(
            "a move between caches needs two caches: within one, PagedKv::compact moves blocks"
                .into(),
        ));
    }
    let (sc, dc) = (&src.config, &dst.config);
    if sc.layout != dc.layout || src.geo.tensors != dst.geo.tensors || src.geo.unit != dst.geo.unit
    {
        return Err(Error::LayoutMismatch {
            detail: format!(
                "source cache {:?} with {} tensors of {}-byte block spans, destination {:?} with {} of {}: a move between caches needs one shape",
                sc.layout, src.geo.tensors, src.geo.unit, dc.layout, dst.geo.tensors, dst.geo.unit
            ),
        });
    }
    check_between_pools(src.pool.backend(), dst.pool.backend(), after.is_some())?;
    let mut m = KvMove {
        src: src.clone(),
        dst: dst.clone(),
        from: Vec::new(),
        to: Vec::with_capacity(ids.len()),
        flights: Vec::new(),
        bytes: 0,
        copies: 0,
        started,
    };
    if ids.is_empty() {
        return Ok(m);
    }
    pin_sources(src, ids)?;
    // The sources no batch has taken yet, unpinned however this function is left (the move
    // then holds, and settles, only the batches that started).
    let rest = Unstarted {
        core: src,
        ids,
        from: Cell::new(0),
    };
    {
        // Refused before anything moves when the destination sleeps or lacks the blocks
        // (allocated by nobody: free, or in transit and landing free), as one alloc of them
        // all would be. Advisory: a concurrent alloc there may still fail a later batch.
        let book = dst.book.lock();
        if book.asleep {
            return Err(dst.asleep_error("move_to"));
        }
        let max = dst.config.max_blocks;
        let free = max - book.live_count;
        if free < ids.len() {
            return Err(Error::KvOutOfBlocks {
                requested: ids.len(),
                free,
                max_blocks: max,
            });
        }
    }
    let per = ids.len().div_ceil(BATCHES).max(BATCH_MIN);
    for batch in ids.chunks(per) {
        let to = match dst.alloc(batch.len(), true) {
            Ok(to) => to,
            Err(e) => return Err(m.roll_back(e)),
        };
        let pieces = pieces(src, batch, dst, &to);
        // SAFETY: the source blocks are live and pinned (not freed, compacted or unmapped:
        // their pool cannot sleep, and the move holds both caches until its flights are
        // finished); the destination blocks are mapped, live and pinned, known to nobody else
        // yet; `after` is the caller's promise.
        match unsafe { start_between_pools(src.pool.backend(), dst.pool.backend(), &pieces, after) }
        {
            Ok(flight) => {
                m.flights.push(flight);
                m.to.extend_from_slice(&to);
                m.from.extend_from_slice(batch);
                m.bytes += pieces.iter().map(|p| p.len).sum::<u64>();
                m.copies += pieces.len();
                rest.from.set(m.from.len());
            }
            Err(e) => {
                // A failed start left nothing queued on this batch's blocks.
                give_back(dst, &to);
                return Err(m.roll_back(e));
            }
        }
    }
    Ok(m)
}

/// Sources a move pinned that no batch has taken (`ids[from..]`), unpinned when it drops.
struct Unstarted<'a> {
    core: &'a Core,
    ids: &'a [BlockId],
    from: Cell<usize>,
}

impl Drop for Unstarted<'_> {
    fn drop(&mut self) {
        if let Some(rest) = self.ids.get(self.from.get()..) {
            unpin(self.core, rest);
        }
    }
}

/// Pin `ids` of `core` as the sources of a move, all or none.
fn pin_sources(core: &Core, ids: &[BlockId]) -> Result<()> {
    let max = core.config.max_blocks;
    let mut book = core.book.lock();
    if book.asleep {
        return Err(core.asleep_error("move_to"));
    }
    let mut seen = HashSet::with_capacity(ids.len());
    for &b in ids {
        let reason = if b >= max {
            Some("out of range")
        } else if core.is_null(b) {
            Some("the reserved null block (never moved)")
        } else if !seen.insert(b) {
            Some("named twice in one move")
        } else if book.in_alloc.contains(&b) {
            Some("not handed out yet (its alloc is still mapping)")
        } else if book.moving.contains(&b) {
            Some("being moved by a compaction")
        } else if book.tiered.contains(&b) {
            Some("being moved between caches by another move")
        } else if !book.live[b] {
            Some("not allocated")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(Error::KvBadBlock {
                block: b,
                max_blocks: max,
                reason,
            });
        }
    }
    book.tiered.extend(ids.iter().copied());
    Ok(())
}

fn unpin(core: &Core, ids: &[BlockId]) {
    let mut book = core.book.lock();
    for b in ids {
        book.tiered.remove(b);
    }
}

/// Unpin and free blocks of `core` a move pinned, under one lock.
fn give_back(core: &Core, ids: &[BlockId]) {
    if let Err(e) = core.free_as(ids, true) {
        tracing::error!(error = %e, "freeing the blocks of a settled move between caches failed");
    }
}

/// The copies: runs of consecutive ids on both sides merged, tensor by tensor (a copy walks
/// each tensor's pages in order: scattered blocks of a per-layer cache otherwise jump between
/// tensors at every piece).
fn pieces(src: &Core, from: &[BlockId], dst: &Core, to: &[BlockId]) -> Vec<Piece> {
    let (unit, tensors) = (src.geo.unit, src.geo.tensors);
    let (sa, da) = (src.backing.addr(), dst.backing.addr());
    let runs: Vec<(u64, u64, u64)> = runs(from, to)
        .into_iter()
        .map(|(s, d, n)| (s as u64, d as u64, n as u64))
        .collect();
    let mut out = Vec::with_capacity(runs.len() * tensors as usize);
    for t in 0..tensors {
        out.extend(runs.iter().map(|&(s, d, n)| Piece {
            src: sa + t * src.geo.stride + s * unit,
            dst: da + t * dst.geo.stride + d * unit,
            len: n * unit,
        }));
    }
    out
}

impl KvMove {
    /// The blocks' ids in the destination cache, paired by position with the ids moved.
    pub fn destinations(&self) -> &[BlockId] {
        &self.to
    }

    /// The ids moved (in the source cache).
    pub fn sources(&self) -> &[BlockId] {
        &self.from
    }

    /// Whether every copy has run (or failed), without waiting.
    pub fn is_done(&self) -> bool {
        // SAFETY: the flights are this handle's, not finished before `wait` or the drop.
        self.flights.iter().all(|f| unsafe { f.probe().is_done() })
    }

    /// Make the work queued on `stream` from now on wait for this move's copies without the
    /// host waiting (kernels reading the destination blocks after an onboard). Copies between
    /// host caches have nothing a stream can wait on: this waits for them here.
    ///
    /// # Safety
    /// `stream` is a live stream (a raw `CUstream`, or a special handle of
    /// [`crate::backend::Copies::copy_async`]) of the device whose cache the move copies.
    pub unsafe fn order_before(&self, stream: u64) -> Result<()> {
        for f in &self.flights {
            // SAFETY: as in `is_done`; the stream is the caller's promise.
            unsafe { f.probe().order_before(stream) }?;
        }
        Ok(())
    }

    /// Wait for the copies and settle: the source blocks are freed and the destination ids are
    /// the engine's; or, on a failure, the destination blocks are freed, the source blocks are
    /// untouched, and the error ([`Error::TierMoveFailed`]) says how many bytes had moved.
    pub fn wait(mut self) -> Result<MoveReport> {
        self.settle()
    }

    /// Undo the batches started so far after `e`: their copies finish first, then their
    /// destination blocks go back and their sources are unpinned; the move then holds nothing.
    fn roll_back(&mut self, e: Error) -> Error {
        for f in self.flights.drain(..) {
            let _ = f.finish();
        }
        give_back(&self.dst, &self.to);
        unpin(&self.src, &self.from);
        self.to.clear();
        self.from.clear();
        e
    }

    fn settle(&mut self) -> Result<MoveReport> {
        if self.flights.is_empty() {
            return Ok(MoveReport::default());
        }
        // Every batch is waited for, whatever another one did.
        let (mut copied, mut r) = (0, Ok(()));
        for f in self.flights.drain(..) {
            let (c, done) = f.finish();
            copied += c;
            r = r.and(done);
        }
        match r {
            Ok(()) => {
                unpin(&self.dst, &self.to);
                // The source's pages go back after the wait, as a compaction's do.
                if let Err(e) = self.src.free_in_background(&self.from, true) {
                    tracing::error!(error = %e, "freeing the sources of a settled move between caches failed");
                }
                let report = MoveReport {
                    blocks: self.from.len(),
                    bytes: self.bytes,
                    copies: self.copies,
                    elapsed: self.started.elapsed(),
                };
                tracing::debug!(src = %self.src.pool.name(), dst = %self.dst.pool.name(), blocks = report.blocks, bytes = report.bytes, elapsed = ?report.elapsed, "KV blocks moved between caches");
                Ok(report)
            }
            Err(e) => {
                give_back(&self.dst, &self.to);
                unpin(&self.src, &self.from);
                let e = Error::TierMoveFailed {
                    blocks: self.from.len(),
                    from: self.src.pool.name().to_string(),
                    to: self.dst.pool.name().to_string(),
                    copied,
                    bytes: self.bytes,
                    source: Box::new(e),
                };
                tracing::warn!(error = %e, "move between KV caches rolled back");
                Err(e)
            }
        }
    }
}

impl Drop for KvMove {
    fn drop(&mut self) {
        if let Err(e) = self.settle() {
            tracing::warn!(error = %e, "a KV move dropped without a wait failed");
        }
    }
}

impl std::fmt::Debug for KvMove {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvMove")
            .field("blocks", &self.from.len())
            .field("bytes", &self.bytes)
            .field("under_way", &!self.flights.is_empty())
            .finish()
    }
}
