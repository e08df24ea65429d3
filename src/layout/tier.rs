//! [`KvTiers`]: an engine's view of where each block of a KV cache is, over layouts of one
//! geometry on different storage (device, host tier, disk).
//!
//! Blocks have ids; each lives in one slot of one tier (a layout). [`KvTiers::start_move`]
//! moves a set of blocks to a tier (offload or onboard): it takes free slots there, starts the
//! copies ([`super::copies`]: a device's copy stream, optionally ordered after the engine's
//! stream, or I/O threads) and returns a [`TierMove`] at once. The blocks stay where they were,
//! marked moving (served from their source, neither removed nor moved again), until the move
//! is waited for: then, on success, they live in their new slots and the source slots are
//! free; on failure every block stays where it was, the destination slots go back, and the
//! error says how far it got. [`KvTiers::move_blocks`] is the same, waited for at once. Which
//! blocks go where is the engine's policy.
//!
//! - Host tiers: a layout on [`crate::Pool::host_tier`] (VMM host memory of the device, or
//!   pinned fallback) is [`StorageKind::Pinned`]; device <-> host tier goes through the device
//!   backend's copy stream like device <-> `LayoutBuilder::pinned`.
//! - Pools under tiers cannot sleep under a move: `KvTiers` watches each tier's pool, refuses a
//!   sleep while a move copies its memory (from its start until it is waited for), and refuses
//!   a move (nothing changed) while the pool is not awake.
//! - Nothing outlives the tiers: a [`TierMove`] dropped without a wait is waited for then, one
//!   forgotten is waited for when the `KvTiers` goes, before its layouts do.
//!
//! Lock order: `KvTiers` has one mutex (its books, which hold the moves under way), never held
//! across a copy, a driver call or a join; each pool guard has one (a count), taken alone,
//! also by the pool's sleep (no pool lock held then).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::copies::{check_path, start, Flight, MoveReport, Probe};
use super::mapped::Layout;
use super::storage::StorageKind;
use crate::error::{Error, Result};

/// Where a block of [`KvTiers`] lives: slot `slot` (a block index of the layout) of tier
/// `tier`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TierBlock {
    /// The tier (an index into the layouts given to [`KvTiers::new`]).
    pub tier: usize,
    /// The block index in that tier's layout.
    pub slot: usize,
}

#[derive(Debug, Clone, Copy)]
enum Place {
    At(TierBlock),
    /// Being moved away from here; still served from here until the move ends.
    Moving(TierBlock),
}

impl Place {
    fn at(self) -> TierBlock {
        match self {
            Place::At(t) | Place::Moving(t) => t,
        }
    }
}

/// Keeps a tier's pool awake while a move copies its memory (a sleep watcher of the pool).
struct TierGuard {
    pool: String,
    /// (moves copying now, frozen by a sleep)
    state: Mutex<(usize, bool)>,
}

impl crate::pool::SleepWatcher for TierGuard {
    fn freeze(&self) -> Result<()> {
        let mut st = self.state.lock();
        if st.0 > 0 {
            return Err(Error::SleepRefused {
                pool: self.pool.clone(),
                op: "sleep",
                reason: format!(
                    "{} KvTiers move(s) are copying blocks of its memory; retry when they are done",
                    st.0
                ),
            });
        }
        st.1 = true;
        Ok(())
    }
    fn thaw(&self) {
        self.state.lock().1 = false;
    }
    fn unmapping_all(&self) {}
    fn mapped_all(&self) -> Result<()> {
        Ok(())
    }
}

/// A tier's pool and the guard watching it.
struct Watched {
    pool: crate::pool::Pool,
    guard: Arc<TierGuard>,
    id: u64,
}

impl Watched {
    /// Count a move in, unless the pool is (falling) asleep.
    fn enter(&self) -> Result<()> {
        let mut st = self.guard.state.lock();
        if !st.1 {
            st.0 += 1;
            drop(st);
            // A sleep that began before the count went up has its status set already.
            if self.pool.sleep_stats().status == crate::pool::SleepStatus::Awake {
                return Ok(());
            }
            self.leave();
        }
        Err(Error::Asleep {
            pool: self.pool.name().to_string(),
            op: "KvTiers::move_blocks",
            state: self.pool.sleep_stats().status.name(),
        })
    }

    fn leave(&self) {
        let mut st = self.guard.state.lock();
        st.0 = st.0.saturating_sub(1);
    }
}

/// A move under way: its blocks `(id, from, to)`, its copies, the tiers whose pools it keeps
/// awake.
struct Pending {
    moves: Vec<(u64, TierBlock, TierBlock)>,
    flights: Vec<Flight>,
    entered: Vec<usize>,
    started: Instant,
    bytes: u64,
    copies: usize,
    from: StorageKind,
    to: StorageKind,
}

struct Books {
    free: Vec<BTreeSet<usize>>,
    blocks: HashMap<u64, Place>,
    next_id: u64,
    pending: HashMap<u64, Pending>,
    next_move: u64,
}

/// Blocks of a KV cache spread over tiers (device, host, disk...): layouts of one geometry, one
/// per tier, whose block slots hold the blocks. See the module documentation.
pub struct KvTiers {
    tiers: Vec<Layout>,
    /// Per tier, its pool's guard (`None`: memory that is no pool's).
    watched: Vec<Option<Watched>>,
    books: Mutex<Books>,
}

impl KvTiers {
    /// Tiers over `tiers` (all of one geometry), every slot free.
    pub fn new(tiers: Vec<Layout>) -> Result<Self> {
        let Some(first) = tiers.first() else {
            return Err(Error::InvalidArgument(
                "KvTiers needs at least one layout".into(),
            ));
        };
        for (i, t) in tiers.iter().enumerate() {
            if t.geometry() != first.geometry() {
                return Err(Error::LayoutMismatch {
                    detail: format!(
                        "tier {i} is {:?} ({}), tier 0 is {:?} ({}): tiers share one geometry",
                        t.config(),
                        t.kind(),
                        first.config(),
                        first.kind()
                    ),
                });
            }
        }
        let free = tiers
            .iter()
            .map(|t| (0..t.num_blocks()).collect())
            .collect();
        let watched = tiers
            .iter()
            .map(|t| {
                t.pool().map(|pool| {
                    let guard = Arc::new(TierGuard {
                        pool: pool.name().to_string(),
                        state: Mutex::new((0, false)),
                    });
                    let w: Arc<dyn crate::pool::SleepWatcher> = guard.clone();
                    let id = pool.inner().add_watcher(Arc::downgrade(&w));
                    Watched {
                        pool: pool.clone(),
                        guard,
                        id,
                    }
                })
            })
            .collect();
        Ok(KvTiers {
            tiers,
            watched,
            books: Mutex::new(Books {
                free,
                blocks: HashMap::new(),
                next_id: 0,
                pending: HashMap::new(),
                next_move: 0,
            }),
        })
    }

    /// The layout of tier `tier`.
    pub fn tier(&self, tier: usize) -> Option<&Layout> {
        self.tiers.get(tier)
    }

    /// Number of tiers.
    pub fn num_tiers(&self) -> usize {
        self.tiers.len()
    }

    /// Free slots of `tier` (0 for a tier that does not exist).
    pub fn free_slots(&self, tier: usize) -> usize {
        self.books.lock().free.get(tier).map_or(0, |f| f.len())
    }

    /// A new block in the lowest free slot of `tier`: its id and place.
    pub fn insert(&self, tier: usize) -> Result<(u64, TierBlock)> {
        let mut books = self.books.lock();
        let free = books.free.get_mut(tier).ok_or_else(|| self.no_tier(tier))?;
        let Some(slot) = free.pop_first() else {
            return Err(Error::InvalidArgument(format!(
                "tier {tier} ({}) has no free slot of {}",
                self.tiers[tier].storage().name(),
                self.tiers[tier].num_blocks()
            )));
        };
        let id = books.next_id;
        books.next_id += 1;
        let place = TierBlock { tier, slot };
        books.blocks.insert(id, Place::At(place));
        Ok((id, place))
    }

    /// Forget block `id`, freeing its slot; refused while it is being moved.
    pub fn remove(&self, id: u64) -> Result<TierBlock> {
        let mut books = self.books.lock();
        match books.blocks.get(&id).copied() {
            None => Err(Self::unknown(id)),
            Some(Place::Moving(_)) => Err(Self::moving(id)),
            Some(Place::At(t)) => {
                books.blocks.remove(&id);
                books.free[t.tier].insert(t.slot);
                Ok(t)
            }
        }
    }

    /// Where block `id` is served from now (during a move, its source); `None` if unknown.
    pub fn locate(&self, id: u64) -> Option<TierBlock> {
        self.books.lock().blocks.get(&id).map(|p| p.at())
    }

    /// Whether block `id` is being moved.
    pub fn is_moving(&self, id: u64) -> bool {
        matches!(self.books.lock().blocks.get(&id), Some(Place::Moving(_)))
    }

    /// Move blocks `ids` to tier `to` and wait: [`KvTiers::start_move`], then
    /// [`TierMove::wait`].
    pub fn move_blocks(&self, ids: &[u64], to: usize) -> Result<MoveReport> {
        self.start_move(ids, to)?.wait()
    }

    /// Start moving blocks `ids` to tier `to` (from wherever each is; those already there
    /// stay), taking its lowest free slots in order so that runs stay runs, and return at once
    /// with the copies under way. All or nothing: a check that fails, or copies that fail to
    /// start, leave every block where it was and change nothing; copies that fail later are
    /// rolled back when the move is waited for. A block must not be written while it moves.
    pub fn start_move(&self, ids: &[u64], to: usize) -> Result<TierMove<'_>> {
        // SAFETY: no stream to order after.
        unsafe { self.start(ids, to, None) }
    }

    /// [`KvTiers::start_move`], with the device copies ordered after the work queued so far on
    /// `stream` (the engine's stream whose kernels wrote the blocks): the host does not wait
    /// for it. Refused (nothing changed) for a move no device makes (host <-> disk, host <->
    /// host).
    ///
    /// # Safety
    /// `stream` is a live stream (a raw `CUstream`, or a special handle of
    /// [`crate::backend::Copies::copy_async`]) of the device whose pool the move copies.
    pub unsafe fn start_move_after(
        &self,
        ids: &[u64],
        to: usize,
        stream: u64,
    ) -> Result<TierMove<'_>> {
        // SAFETY: the caller's promise.
        unsafe { self.start(ids, to, Some(stream)) }
    }

    /// # Safety
    /// As for [`KvTiers::start_move_after`] when `after` is given.
    unsafe fn start(&self, ids: &[u64], to: usize, after: Option<u64>) -> Result<TierMove<'_>> {
        let started = Instant::now();
        // Books: check everything, take the slots, mark the blocks moving.
        let mut moves: Vec<(u64, TierBlock, TierBlock)> = Vec::with_capacity(ids.len());
        {
            let mut books = self.books.lock();
            if to >= self.tiers.len() {
                return Err(self.no_tier(to));
            }
            let mut seen = HashSet::with_capacity(ids.len());
            let mut from = Vec::with_capacity(ids.len());
            for &id in ids {
                if !seen.insert(id) {
                    return Err(Error::InvalidArgument(format!(
                        "block {id} is named twice in one move"
                    )));
                }
                match books.blocks.get(&id) {
                    None => return Err(Self::unknown(id)),
                    Some(Place::Moving(_)) => return Err(Self::moving(id)),
                    Some(Place::At(t)) if t.tier == to => {}
                    Some(Place::At(t)) => from.push((id, *t)),
                }
            }
            // Every path first (device to disk has none): refused before anything is taken.
            let mut sources: Vec<usize> = from.iter().map(|(_, t)| t.tier).collect();
            sources.sort_unstable();
            sources.dedup();
            let mut devices = HashSet::new();
            for &t in &sources {
                match check_path(&self.tiers[t], &self.tiers[to])? {
                    Some(device) => {
                        devices.insert(device);
                    }
                    None if after.is_some() => {
                        return Err(Error::InvalidArgument(format!(
                            "blocks of tier {t} ({}) move to tier {to} ({}) with no device copy to order after a stream: synchronize the stream and use start_move",
                            self.tiers[t].storage().name(),
                            self.tiers[to].storage().name()
                        )))
                    }
                    None => {}
                }
            }
            if after.is_some() && devices.len() > 1 {
                return Err(Error::InvalidArgument(format!(
                    "the move copies on {} devices ({devices:?}): one stream orders the copies of one device",
                    devices.len()
                )));
            }
            let free = &mut books.free[to];
            if free.len() < from.len() {
                return Err(Error::InvalidArgument(format!(
                    "tier {to} ({}) has {} free slots, the move needs {}: nothing moved",
                    self.tiers[to].storage().name(),
                    free.len(),
                    from.len()
                )));
            }
            from.sort_by_key(|(_, t)| (t.tier, t.slot));
            for (id, src) in from {
                let slot = free.pop_first().unwrap_or_default(); // counted above
                moves.push((id, src, TierBlock { tier: to, slot }));
            }
            for (id, src, _) in &moves {
                books.blocks.insert(*id, Place::Moving(*src));
            }
        }
        // The first source's kind names the move in messages (a move may gather from several
        // tiers).
        let from = moves
            .first()
            .map_or(self.tiers[to].storage(), |m| self.tiers[m.1.tier].storage());
        let mut pending = Pending {
            moves,
            flights: Vec::new(),
            entered: Vec::new(),
            started,
            bytes: 0,
            copies: 0,
            from,
            to: self.tiers[to].storage(),
        };
        // The pools under the tiers involved stay awake until the move is waited for.
        let mut involved: Vec<usize> = pending.moves.iter().map(|m| m.1.tier).collect();
        involved.push(to);
        involved.sort_unstable();
        involved.dedup();
        let mut result = Ok(());
        for &t in &involved {
            if let Some(w) = &self.watched[t] {
                match w.enter() {
                    Ok(()) => pending.entered.push(t),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
        }
        // Copies, one flight per source tier, with no lock held.
        let moves = std::mem::take(&mut pending.moves);
        let mut i = if result.is_ok() { 0 } else { moves.len() };
        while i < moves.len() {
            let tier = moves[i].1.tier;
            let n = moves[i..].iter().take_while(|m| m.1.tier == tier).count();
            let group = &moves[i..i + n];
            let s: Vec<usize> = group.iter().map(|m| m.1.slot).collect();
            let d: Vec<usize> = group.iter().map(|m| m.2.slot).collect();
            // SAFETY: the source slots hold blocks marked moving (no other call of ours moves
            // or removes them, and the engine does not write a moving block); the destination
            // slots were free, which no one uses; the layouts live until the flight is
            // finished (by the move's wait, its drop, or the tiers' drop); `after` is the
            // caller's promise.
            match unsafe { start(&self.tiers[tier], &s, &self.tiers[to], &d, after) } {
                Ok(st) => {
                    pending.bytes += st.bytes;
                    pending.copies += st.copies;
                    pending.flights.push(st.flight);
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            i += n;
        }
        pending.moves = moves;
        let destinations = pending.moves.iter().map(|m| (m.0, m.2)).collect();
        if let Err(e) = result {
            // Started flights run out, then everything goes back.
            let started_any = !pending.flights.is_empty();
            let (copied, _) = self.run_out(&mut pending);
            return Err(self.undo(pending, copied, e, started_any));
        }
        let mut books = self.books.lock();
        let id = books.next_move;
        books.next_move += 1;
        books.pending.insert(id, pending);
        Ok(TierMove {
            tiers: self,
            id,
            destinations,
            waited: false,
        })
    }

    /// Wait for a move's copies (no lock held) and let its pools sleep again: the bytes that
    /// moved, and the first failure.
    fn run_out(&self, p: &mut Pending) -> (u64, Option<Error>) {
        let mut copied = 0u64;
        let mut failed = None;
        for f in std::mem::take(&mut p.flights) {
            let (n, r) = f.finish();
            copied += n;
            if let (Err(e), None) = (r, &failed) {
                failed = Some(e);
            }
        }
        for t in std::mem::take(&mut p.entered) {
            if let Some(w) = &self.watched[t] {
                w.leave();
            }
        }
        (copied, failed)
    }

    /// Finish a move: its copies run out, then the books settle: the blocks in their new
    /// slots, or everything back on a failure.
    fn settle(&self, mut p: Pending) -> Result<MoveReport> {
        let (copied, failed) = self.run_out(&mut p);
        if let Some(e) = failed {
            return Err(self.undo(p, copied, e, true));
        }
        let mut books = self.books.lock();
        for &(id, src, dst) in &p.moves {
            books.blocks.insert(id, Place::At(dst));
            books.free[src.tier].insert(src.slot);
        }
        drop(books);
        let report = MoveReport {
            blocks: p.moves.len(),
            bytes: p.bytes,
            copies: p.copies,
            elapsed: p.started.elapsed(),
        };
        tracing::debug!(from = %p.from.name(), to = %p.to.name(), blocks = report.blocks, bytes = report.bytes, copies = report.copies, elapsed = ?report.elapsed, "blocks moved");
        Ok(report)
    }

    /// Put every block of a move that ran out back where it was and free the destination
    /// slots; the error to return: `e` as it is when no copy had started, else a
    /// [`Error::TierMoveFailed`] of the whole move.
    fn undo(&self, p: Pending, copied: u64, e: Error, started_any: bool) -> Error {
        let mut books = self.books.lock();
        for &(id, src, dst) in &p.moves {
            books.blocks.insert(id, Place::At(src));
            books.free[dst.tier].insert(dst.slot);
        }
        drop(books);
        if !started_any {
            return e;
        }
        let e = match e {
            Error::TierMoveFailed { source, .. } => *source,
            e => e,
        };
        let e = Error::TierMoveFailed {
            blocks: p.moves.len(),
            from: p.from.name(),
            to: p.to.name(),
            copied,
            bytes: p.bytes,
            source: Box::new(e),
        };
        tracing::warn!(error = %e, "tier move rolled back");
        e
    }

    /// Finish move `id` (see [`KvTiers::settle`]); its entry leaves the books first.
    fn finish(&self, id: u64) -> Result<MoveReport> {
        let pending = self.books.lock().pending.remove(&id);
        match pending {
            Some(p) => self.settle(p),
            None => Err(Error::InvalidArgument(format!(
                "tier move {id} is not under way"
            ))),
        }
    }

    /// Moves under way (started, not waited for yet).
    pub fn moves_under_way(&self) -> usize {
        self.books.lock().pending.len()
    }

    fn no_tier(&self, tier: usize) -> Error {
        Error::OutOfLayout {
            what: "tier",
            index: tier,
            count: self.tiers.len(),
        }
    }

    fn unknown(id: u64) -> Error {
        Error::InvalidArgument(format!("no block {id} in these tiers"))
    }

    fn moving(id: u64) -> Error {
        Error::InvalidArgument(format!(
            "block {id} is being moved by another call: refused, nothing changed"
        ))
    }
}

impl Drop for KvTiers {
    fn drop(&mut self) {
        // Moves whose handle was forgotten: their copies run out before the layouts go.
        let pending: Vec<Pending> = self.books.lock().pending.drain().map(|(_, p)| p).collect();
        for p in pending {
            if let Err(e) = self.settle(p) {
                tracing::warn!(error = %e, "a tier move nobody waited for failed");
            }
        }
        for w in self.watched.iter().flatten() {
            w.pool.inner().remove_watcher(w.id);
        }
    }
}

impl std::fmt::Debug for KvTiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kinds: Vec<StorageKind> = self.tiers.iter().map(|t| t.storage()).collect();
        f.debug_struct("KvTiers")
            .field("tiers", &kinds)
            .field("blocks", &self.books.lock().blocks.len())
            .finish()
    }
}

/// A move of blocks between tiers, under way ([`KvTiers::start_move`]). Wait for it with
/// [`TierMove::wait`], which settles the books; dropped without a wait, it is waited for then
/// (the outcome logged).
#[must_use = "a move is settled when it is waited for (or dropped, which waits)"]
pub struct TierMove<'a> {
    tiers: &'a KvTiers,
    id: u64,
    destinations: Vec<(u64, TierBlock)>,
    waited: bool,
}

impl TierMove<'_> {
    /// Where each moved block will live once the move succeeds: `(id, place)`. Blocks already
    /// in the target tier are not listed. The destination slots are the move's while it is
    /// under way: a kernel ordered after it ([`TierMove::order_before`]) may read them.
    pub fn destinations(&self) -> &[(u64, TierBlock)] {
        &self.destinations
    }

    /// Whether every copy has run (or failed), without waiting. The books change only at
    /// [`TierMove::wait`].
    pub fn is_done(&self) -> bool {
        // SAFETY: the flights stay under way until this handle's `wait` or drop (or the
        // tiers' drop, which the borrow excludes).
        self.probes().iter().all(|p| unsafe { p.is_done() })
    }

    /// Make the work queued on `stream` from now on wait for this move's copies, without the
    /// host waiting (an onboard, then the kernels that read the blocks at
    /// [`TierMove::destinations`]). Copies between host and disk have nothing a stream can
    /// wait on: this waits for them here.
    ///
    /// # Safety
    /// `stream` is a live stream (a raw `CUstream`, or a special handle of
    /// [`crate::backend::Copies::copy_async`]) of the device whose pool the move copies.
    pub unsafe fn order_before(&self, stream: u64) -> Result<()> {
        for p in self.probes() {
            // SAFETY: as in `is_done`; the stream is the caller's promise.
            unsafe { p.order_before(stream) }?;
        }
        Ok(())
    }

    /// Probes of the flights, taken under the books' lock and asked after it is released (no
    /// driver call under a lock).
    fn probes(&self) -> Vec<Probe> {
        let books = self.tiers.books.lock();
        books
            .pending
            .get(&self.id)
            .map(|p| p.flights.iter().map(Flight::probe).collect())
            .unwrap_or_default()
    }

    /// Wait for the copies and settle: the blocks now live in [`TierMove::destinations`] and
    /// their source slots are free; or, on a failure, every block is where it was, the
    /// destination slots are free again, and the error ([`Error::TierMoveFailed`]) says how
    /// many bytes had moved.
    pub fn wait(mut self) -> Result<MoveReport> {
        self.waited = true;
        self.tiers.finish(self.id)
    }
}

impl Drop for TierMove<'_> {
    fn drop(&mut self) {
        if !self.waited {
            if let Err(e) = self.tiers.finish(self.id) {
                tracing::warn!(error = %e, "a tier move dropped without a wait failed");
            }
        }
    }
}

impl std::fmt::Debug for TierMove<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierMove")
            .field("id", &self.id)
            .field("blocks", &self.destinations.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::layout::copies::IO_DELAY_MS;
    use crate::layout::{LayoutBuilder, LayoutConfig};

    /// Tiers over system memory and a temporary file, `n` blocks of 8 KiB in the first.
    fn tiers(n: usize) -> (KvTiers, Vec<u64>) {
        let c = LayoutConfig::new(16, 2, 2, 16, 64, 2);
        let tiers = KvTiers::new(vec![
            LayoutBuilder::new()
                .config(c)
                .fully_contiguous()
                .system()
                .build()
                .expect("system"),
            LayoutBuilder::new()
                .config(c)
                .fully_contiguous()
                .disk_temp(std::env::temp_dir())
                .build()
                .expect("disk"),
        ])
        .expect("tiers");
        let ids = (0..n).map(|_| tiers.insert(0).expect("slot").0).collect();
        (tiers, ids)
    }

    /// The I/O threads wait `ms` before copying, for the life of the guard (tests that delay
    /// take turns: the delay is one for the process).
    struct Delay(#[allow(dead_code)] parking_lot::MutexGuard<'static, ()>);
    static TURNS: parking_lot::Mutex<()> = parking_lot::const_mutex(());
    impl Delay {
        fn ms(ms: u64) -> Self {
            let turn = TURNS.lock();
            IO_DELAY_MS.store(ms, Ordering::Relaxed);
            Delay(turn)
        }
    }
    impl Drop for Delay {
        fn drop(&mut self) {
            IO_DELAY_MS.store(0, Ordering::Relaxed);
        }
    }

    /// A move under way keeps its blocks where they were (moving, neither removed nor moved
    /// again) and its destination slots taken; it is done only when its copies ran; the wait
    /// settles the books.
    #[test]
    fn a_move_under_way_settles_at_its_wait() {
        let _delay = Delay::ms(300);
        let (tiers, ids) = tiers(4);
        let before: Vec<_> = ids.iter().map(|&id| tiers.locate(id)).collect();
        let m = tiers.start_move(&ids, 1).expect("start");
        assert!(!m.is_done(), "done before the delayed copies ran");
        assert_eq!(m.destinations().len(), 4);
        assert_eq!(tiers.moves_under_way(), 1);
        assert_eq!(
            tiers.free_slots(1),
            12,
            "the destination slots are the move's"
        );
        assert!(ids.iter().all(|&id| tiers.is_moving(id)));
        assert_eq!(
            before,
            ids.iter().map(|&id| tiers.locate(id)).collect::<Vec<_>>()
        );
        let e = tiers.remove(ids[0]).expect_err("remove while moving");
        assert!(e.to_string().contains("being moved"), "{e}");
        let e = tiers.move_blocks(&ids[..1], 1).expect_err("moved twice");
        assert!(e.to_string().contains("being moved"), "{e}");
        let t = Instant::now();
        while !m.is_done() {
            assert!(t.elapsed() < Duration::from_secs(10), "never done");
            std::thread::sleep(Duration::from_millis(5));
        }
        let dest = m.destinations().to_vec();
        let r = m.wait().expect("wait");
        assert_eq!((r.blocks, r.bytes), (4, 4 * 8192));
        assert_eq!(tiers.moves_under_way(), 0);
        for (id, at) in dest {
            assert_eq!(tiers.locate(id), Some(at));
        }
        assert_eq!((tiers.free_slots(0), tiers.free_slots(1)), (16, 12));
    }

    /// A move dropped without a wait is waited for then; one forgotten is waited for when the
    /// tiers go, before their layouts do (its threads would write freed memory otherwise).
    /// Without the waits, both drops return before the delayed copies ran.
    #[test]
    fn dropped_and_forgotten_moves_are_waited_for() {
        let _delay = Delay::ms(300);
        let (tiers, ids) = tiers(4);
        let t = Instant::now();
        drop(tiers.start_move(&ids[..2], 1).expect("start"));
        assert!(
            t.elapsed() >= Duration::from_millis(250),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(tiers.locate(ids[0]).map(|b| b.tier), Some(1), "settled");
        std::mem::forget(tiers.start_move(&ids[2..], 1).expect("start"));
        assert_eq!(tiers.moves_under_way(), 1);
        let t = Instant::now();
        drop(tiers);
        assert!(
            t.elapsed() >= Duration::from_millis(250),
            "{:?}",
            t.elapsed()
        );
    }

    /// Host <-> disk has no device copy a stream could order: asking for one is refused before
    /// anything is taken.
    #[test]
    fn ordering_a_disk_move_after_a_stream_is_refused() {
        let (tiers, ids) = tiers(2);
        // SAFETY: refused before any stream is used.
        let e = unsafe { tiers.start_move_after(&ids, 1, 2) }.expect_err("no device copy");
        assert!(e.to_string().contains("no device copy"), "{e}");
        assert_eq!(tiers.free_slots(1), 16);
        assert!(ids.iter().all(|&id| !tiers.is_moving(id)));
    }
}
