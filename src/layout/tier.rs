//! Moving blocks between layouts of one geometry on different storage: device <-> host through
//! the pool backend's copies (queued on a copy stream, awaited through a marker), host <-> disk
//! with `pread`/`pwrite` (`O_DIRECT` where address, offset and length are 4 KiB aligned), host
//! <-> host with `memcpy`.
//!
//! - [`copy_blocks`]: the mechanism. Everything is checked before any byte moves (geometry,
//!   counts, block ids, a destination block named twice, a pair of storages it cannot move
//!   between); runs of consecutive ids on both sides become one copy per view of a block (a
//!   fully contiguous layout: one copy per run).
//! - [`KvTiers`]: an engine's view of where each block is. Blocks have ids; each lives in one
//!   slot of one tier (a layout). [`KvTiers::move_blocks`] moves a set of blocks to a tier
//!   (offload or onboard): it takes free slots there, copies outside its lock, and on success
//!   frees the source slots; on failure every block stays where it was, the destination slots
//!   go back, and the error says how far it got. Which blocks go where is the engine's policy.
//!
//! - Host tiers: a layout on [`crate::Pool::host_tier`] (VMM host memory of the device, or
//!   pinned fallback) is [`StorageKind::Pinned`]; device <-> host tier goes through the device
//!   backend's copy stream like device <-> `LayoutBuilder::pinned`.
//!
//! - Pools under tiers cannot sleep under a move: `KvTiers` watches each tier's pool, refuses a
//!   sleep while a move copies its memory, and refuses a move (nothing changed) while the pool
//!   is not awake.
//!
//! Lock order: `KvTiers` has one mutex (its books), never held across a copy; each pool guard
//! has one (a count), taken alone, also by the pool's sleep (no pool lock held then).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::mapped::{Layout, LayoutMemory};
use super::storage::{DiskFile, StorageKind};
use super::view::LayoutViews;
use crate::backend::{Backend, MemoryKind};
use crate::error::{Error, Result};

/// What a move did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MoveReport {
    /// Blocks moved.
    pub blocks: usize,
    /// Bytes copied.
    pub bytes: u64,
    /// Copies made, after merging runs.
    pub copies: usize,
    /// From the first copy to completion.
    pub elapsed: Duration,
}

/// One copy: `len` bytes from `src` to `dst` (addresses, or offsets in a layout's file).
#[derive(Debug, Clone, Copy)]
struct Piece {
    src: u64,
    dst: u64,
    len: u64,
}

/// How a layout's bytes are reached.
enum End<'a> {
    /// Pool memory: through its backend.
    Pool(&'a Arc<dyn Backend>),
    /// Host memory by address; `staging` is the backend whose staging memory it is.
    Host {
        staging: Option<&'a Arc<dyn Backend>>,
    },
    /// A file.
    File(&'a DiskFile),
}

impl End<'_> {
    /// Whether the CPU reaches its bytes by address.
    fn cpu(&self) -> bool {
        match self {
            End::Pool(b) => b.info().memory_kind == MemoryKind::Host,
            End::Host { .. } => true,
            End::File(_) => false,
        }
    }
}

fn end_of(layout: &Layout) -> Result<End<'_>> {
    Ok(match layout.memory() {
        LayoutMemory::Allocation { pool, .. } => End::Pool(pool.backend()),
        LayoutMemory::Region(r) => End::Pool(r.pool().backend()),
        LayoutMemory::Caller(_) if layout.memory_kind() == MemoryKind::Host => {
            End::Host { staging: None }
        }
        LayoutMemory::Caller(_) => {
            return Err(Error::InvalidArgument(format!(
                "the layout lies in caller device memory of device {:?}: no backend to copy it with (build it on a pool)",
                layout.device()
            )))
        }
        LayoutMemory::Host(b) => End::Host {
            staging: b.staging_backend(),
        },
        LayoutMemory::Disk(f) => End::File(f),
    })
}

/// Whether `host`, a host pool's backend, is a host tier the device of `device` copies to.
fn reaches(device: &Arc<dyn Backend>, host: &Arc<dyn Backend>) -> bool {
    let h = host.info();
    h.memory_kind == MemoryKind::Host
        && h.page_locked
        && (h.device_ordinal.is_none() || h.device_ordinal == device.info().device_ordinal)
}

fn same_backend(a: &Arc<dyn Backend>, b: &Arc<dyn Backend>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// The copies that move `src_blocks` of `src` onto `dst_blocks` of `dst`, runs merged; every
/// check done first.
fn plan(
    src: &LayoutViews,
    src_blocks: &[usize],
    dst: &LayoutViews,
    dst_blocks: &[usize],
) -> Result<Vec<Piece>> {
    if src.geometry() != dst.geometry() {
        return Err(Error::LayoutMismatch {
            detail: format!(
                "source {:?} ({}), destination {:?} ({}): a move needs one geometry",
                src.config(),
                src.kind(),
                dst.config(),
                dst.kind()
            ),
        });
    }
    if src_blocks.len() != dst_blocks.len() {
        return Err(Error::LayoutMismatch {
            detail: format!(
                "{} source blocks, {} destination blocks: they pair by position",
                src_blocks.len(),
                dst_blocks.len()
            ),
        });
    }
    let count = src.num_blocks();
    for &b in src_blocks.iter().chain(dst_blocks) {
        if b >= count {
            return Err(Error::OutOfLayout {
                what: "block",
                index: b,
                count,
            });
        }
    }
    let mut seen = HashSet::with_capacity(dst_blocks.len());
    for &b in dst_blocks {
        if !seen.insert(b) {
            return Err(Error::InvalidArgument(format!(
                "destination block {b} is named twice: a move writes each destination block once"
            )));
        }
    }
    let mut pieces = Vec::new();
    let mut i = 0;
    while i < src_blocks.len() {
        let mut n = 1;
        while i + n < src_blocks.len()
            && src_blocks[i + n - 1] + 1 == src_blocks[i + n]
            && dst_blocks[i + n - 1] + 1 == dst_blocks[i + n]
        {
            n += 1;
        }
        let (s, d) = (src.blocks(src_blocks[i], n)?, dst.blocks(dst_blocks[i], n)?);
        pieces.extend(s.iter().zip(&d).map(|(s, d)| Piece {
            src: s.addr,
            dst: d.addr,
            len: s.len,
        }));
        i += n;
    }
    Ok(pieces)
}

/// How a copy goes between two storages.
enum Way<'a> {
    ToHost(&'a Arc<dyn Backend>),
    FromHost(&'a Arc<dyn Backend>),
    Memcpy,
    Write(&'a DiskFile),
    Read(&'a DiskFile),
}

/// The way from `from` to `to`, or why there is none.
fn way<'a>(from: &End<'a>, to: &End<'a>, sk: StorageKind, dk: StorageKind) -> Result<Way<'a>> {
    let refuse = |why: &str| {
        Err(Error::InvalidArgument(format!(
            "no way to move blocks from {} to {} storage: {why}",
            sk.name(),
            dk.name()
        )))
    };
    let device = |b: &Arc<dyn Backend>| b.info().memory_kind == MemoryKind::Device;
    let way = match (from, to) {
        (End::File(_), End::File(_)) => return refuse("disk to disk"),
        (End::File(f), e) if e.cpu() => Way::Read(f),
        (e, End::File(f)) if e.cpu() => Way::Write(f),
        (End::File(_), _) | (_, End::File(_)) => {
            return refuse("no GPUDirect Storage here: stage through a pinned host layout")
        }
        (End::Pool(a), End::Pool(b)) if !device(a) && !device(b) => Way::Memcpy,
        // Device memory and a host tier it reaches (VMM host memory of the same device, or
        // the pinned fallback, which has no device).
        (End::Pool(a), End::Pool(b)) if device(a) && reaches(a, b) => Way::ToHost(a),
        (End::Pool(a), End::Pool(b)) if device(b) && reaches(b, a) => Way::FromHost(b),
        (End::Pool(_), End::Pool(_)) => {
            return refuse(
                "device to device, or a host pool that is no host tier of this device: copy within the device (p2p), or use Pool::host_tier",
            )
        }
        (End::Pool(b), End::Host { staging }) | (End::Host { staging }, End::Pool(b)) => {
            if device(b) && !staging.is_some_and(|s| same_backend(s, b)) {
                return refuse(
                    "the host layout is not pinned by the device pool's backend (build it with LayoutBuilder::pinned(&pool, ..))",
                );
            }
            if matches!(from, End::Pool(_)) {
                Way::ToHost(b)
            } else {
                Way::FromHost(b)
            }
        }
        (End::Host { .. }, End::Host { .. }) => Way::Memcpy,
    };
    Ok(way)
}

/// Whether blocks can move from `src` to `dst` at all (storage kinds and backends): an error
/// saying why not, before anything is taken or copied.
fn check_path(src: &Layout, dst: &Layout) -> Result<()> {
    let (from, to) = (end_of(src)?, end_of(dst)?);
    way(&from, &to, src.storage(), dst.storage()).map(|_| ())
}

/// Copy `src_blocks` of `src` onto `dst_blocks` of `dst` (paired by position), two layouts of
/// one geometry. Device <-> host needs the host side pinned by the device pool's backend
/// (`LayoutBuilder::pinned`); host <-> disk and host <-> host work with any host memory;
/// device <-> disk and device <-> device are refused (stage through a pinned layout).
///
/// Everything is checked before any byte moves. On a failure part way the source is intact and
/// the destination blocks hold unspecified bytes ([`KvTiers`] rolls its books back); the error
/// is [`Error::TierMoveFailed`] with the bytes copied.
///
/// # Safety
/// Nobody else writes the source blocks, or uses the destination blocks, until this returns.
pub unsafe fn copy_blocks(
    src: &Layout,
    src_blocks: &[usize],
    dst: &Layout,
    dst_blocks: &[usize],
) -> Result<MoveReport> {
    let pieces = plan(src.views(), src_blocks, dst.views(), dst_blocks)?;
    let (sk, dk) = (src.storage(), dst.storage());
    let (from, to) = (end_of(src)?, end_of(dst)?);
    let way = way(&from, &to, sk, dk)?;
    let bytes: u64 = pieces.iter().map(|p| p.len).sum();
    let started = Instant::now();
    let mut copied = 0u64;
    let result = match way {
        Way::Memcpy => {
            for p in &pieces {
                // SAFETY: both ranges lie in their layouts' host memory (views of a checked
                // plan), mapped while the layouts live; exclusive use is the caller's promise.
                unsafe { std::ptr::copy(p.src as *const u8, p.dst as *mut u8, p.len as usize) };
                copied += p.len;
            }
            Ok(())
        }
        Way::Write(f) => pieces.iter().try_for_each(|p| {
            // SAFETY: the source is host memory of the layout, readable while it lives.
            unsafe { f.write_from(p.src, p.dst, p.len) }?;
            copied += p.len;
            Ok(())
        }),
        Way::Read(f) => pieces.iter().try_for_each(|p| {
            // SAFETY: the destination is host memory of the layout; exclusive use promised.
            unsafe { f.read_into(p.dst, p.src, p.len) }?;
            copied += p.len;
            Ok(())
        }),
        // SAFETY: the ranges are the layouts' memory (pool memory mapped for the layout's
        // life; host memory pinned by this backend where it is a device's); awaited below.
        Way::ToHost(b) => unsafe { streamed(b, &pieces, true, &mut copied) },
        // SAFETY: as above.
        Way::FromHost(b) => unsafe { streamed(b, &pieces, false, &mut copied) },
    };
    match result {
        Ok(()) => {
            let report = MoveReport {
                blocks: src_blocks.len(),
                bytes,
                copies: pieces.len(),
                elapsed: started.elapsed(),
            };
            tracing::debug!(from = %sk.name(), to = %dk.name(), blocks = report.blocks, bytes, copies = report.copies, elapsed = ?report.elapsed, "blocks moved");
            Ok(report)
        }
        Err(e) => Err(Error::TierMoveFailed {
            blocks: src_blocks.len(),
            from: sk.name(),
            to: dk.name(),
            copied,
            bytes,
            source: Box::new(e),
        }),
    }
}

/// Queue every piece on a copy stream of `backend` (to host memory when `to_host`), then wait
/// for all of them, whatever failed: nothing stays queued on the memory when this returns.
///
/// # Safety
/// Pool-side ranges are mapped memory of `backend`, host-side ranges its staging memory (any
/// host memory on a host backend), all alive and unshared until this returns.
unsafe fn streamed(
    backend: &Arc<dyn Backend>,
    pieces: &[Piece],
    to_host: bool,
    copied: &mut u64,
) -> Result<()> {
    let copies = backend.copies();
    let stream = copies.copy_stream_create()?;
    let mut queued = 0u64;
    let mut failed = None;
    for p in pieces {
        // SAFETY: the caller's promise for both ranges; awaited below before returning.
        let r = unsafe {
            if to_host {
                copies.copy_to_host_async(p.dst as *mut u8, p.src, p.len as usize, stream)
            } else {
                copies.copy_from_host_async(p.dst, p.src as *const u8, p.len as usize, stream)
            }
        };
        if let Err(e) = r {
            failed = Some(e);
            break;
        }
        queued += p.len;
    }
    // SAFETY: `stream` came from `copy_stream_create`; the marker is waited for once.
    let waited = unsafe { copies.marker_record(stream) }
        .and_then(|m| unsafe { copies.marker_wait(m) })
        .or_else(|e| {
            // Without a marker, wait for the whole stream: nothing may stay queued.
            copies.synchronize(stream).map(|_| ()).or(Err(e))
        });
    // SAFETY: everything queued on it ran (waited above).
    if let Err(e) = unsafe { copies.copy_stream_destroy(stream) } {
        tracing::warn!(error = %e, "destroying a tier move's copy stream failed");
    }
    if let Some(e) = failed {
        return Err(e);
    }
    waited?;
    *copied = queued;
    Ok(())
}

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

struct Books {
    free: Vec<BTreeSet<usize>>,
    blocks: HashMap<u64, Place>,
    next_id: u64,
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

    /// Move blocks `ids` to tier `to` (from wherever each is; those already there stay),
    /// taking its lowest free slots in order so that runs stay runs. All or nothing: on a
    /// failure every block stays where it was and the slots taken go back. A block must not
    /// be written while it moves.
    pub fn move_blocks(&self, ids: &[u64], to: usize) -> Result<MoveReport> {
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
            for t in sources {
                check_path(&self.tiers[t], &self.tiers[to])?;
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
        // The pools under the tiers involved stay awake while we copy.
        let mut involved: Vec<usize> = moves.iter().map(|m| m.1.tier).collect();
        involved.push(to);
        involved.sort_unstable();
        involved.dedup();
        let mut entered = Vec::with_capacity(involved.len());
        let mut result = Ok(());
        for &t in &involved {
            if let Some(w) = &self.watched[t] {
                match w.enter() {
                    Ok(()) => entered.push(w),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
        }
        // Copies, one per source tier, with no lock held.
        let mut total = MoveReport::default();
        let mut i = if result.is_ok() { 0 } else { moves.len() };
        while i < moves.len() {
            let tier = moves[i].1.tier;
            let n = moves[i..].iter().take_while(|m| m.1.tier == tier).count();
            let group = &moves[i..i + n];
            let s: Vec<usize> = group.iter().map(|m| m.1.slot).collect();
            let d: Vec<usize> = group.iter().map(|m| m.2.slot).collect();
            // SAFETY: the source slots hold blocks marked moving (no other call of ours moves
            // or removes them, and the engine does not write a moving block); the destination
            // slots were free, which no one uses.
            match unsafe { copy_blocks(&self.tiers[tier], &s, &self.tiers[to], &d) } {
                Ok(r) => {
                    total.blocks += r.blocks;
                    total.bytes += r.bytes;
                    total.copies += r.copies;
                    total.elapsed += r.elapsed;
                }
                Err(e) => {
                    result = Err(match e {
                        Error::TierMoveFailed {
                            from,
                            to,
                            copied,
                            bytes,
                            source,
                            ..
                        } => Error::TierMoveFailed {
                            blocks: moves.len(),
                            from,
                            to,
                            copied: total.bytes + copied,
                            bytes: total.bytes + bytes,
                            source,
                        },
                        e => e,
                    });
                    break;
                }
            }
            i += n;
        }
        entered.iter().for_each(|w| w.leave());
        let mut books = self.books.lock();
        match result {
            Ok(()) => {
                for (id, src, dst) in moves {
                    books.blocks.insert(id, Place::At(dst));
                    books.free[src.tier].insert(src.slot);
                }
                Ok(total)
            }
            Err(e) => {
                for (id, src, dst) in moves {
                    books.blocks.insert(id, Place::At(src));
                    books.free[dst.tier].insert(dst.slot);
                }
                tracing::warn!(to, error = %e, "tier move rolled back");
                Err(e)
            }
        }
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
