//! The pool: one virtual reservation on one backend, physical memory mapped on demand.
//!
//! Two ways to use it, over the same reservation:
//! - [`Pool::allocate`] returns an RAII [`Allocation`]. Freed memory stays mapped ("idle") and
//!   is reused by the next allocation without any driver call; growth maps ahead in ever larger
//!   chunks; [`Pool::trim`] gives idle and cached memory back to the driver.
//! - [`Pool::map`] / [`Pool::unmap`] back chosen granule-aligned ranges, for KV-cache managers
//!   that place their blocks themselves.
//!
//! Locking: one `parking_lot` mutex guards the bookkeeping ([`state::State`]); every driver call
//! happens with it released, on ranges claimed beforehand, and a failure puts back what was
//! claimed.

mod admission;
mod allocation;
mod cache;
mod config;
mod intervals;
mod region;
mod state;

use std::sync::Arc;

use parking_lot::Mutex;

pub use allocation::Allocation;
pub use config::{PoolConfig, DEFAULT_ALIGNMENT, DEFAULT_GROWTH_DIVISOR, DEFAULT_MAX_CHUNK};
pub use region::Region;

pub(crate) use admission::{Admission, Grant, PhysicalLimit};
use state::{LiveRecord, State};

use crate::backend::{Backend, BackendInfo, DriverCall, PhysicalChunk};
use crate::error::{round_up, Error, Result};
use crate::stats::{DriverCounters, PoolStats};

/// How often one request may be planned again after admission handed it donated chunks.
const MAX_REPLANS: usize = 3;

/// A pool of elastic memory. Cheap to clone (all clones are the same pool), `Send + Sync`,
/// every method takes `&self`.
///
/// When the last clone is dropped the pool gives back everything that is not held by a live
/// [`Allocation`] and logs a leak report (count and bytes) for those that are; their memory is
/// given back as each of them is dropped, so no live allocation ever points at unmapped memory.
#[derive(Clone, Debug)]
pub struct Pool {
    handle: Arc<Handle>,
}

/// The pool as seen by its users; dropping the last one closes the pool.
#[derive(Debug)]
struct Handle {
    inner: Arc<Inner>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        let keepalive = self.inner.close();
        drop(keepalive);
    }
}

/// What allocations keep alive: the reservation, the backend and the bookkeeping.
#[derive(Debug)]
pub(crate) struct Inner {
    backend: Arc<dyn Backend>,
    base: u64,
    capacity: u64,
    gran: u64,
    alignment: u64,
    max_chunk: u64,
    range_chunk: u64,
    growth_divisor: u64,
    max_cached: Option<u64>,
    name: Arc<str>,
    admission: Option<Arc<dyn Admission>>,
    state: Mutex<State>,
    drivers: DriverCounters,
}

/// A pool's lock held for a stats snapshot.
pub(crate) struct StatsGuard<'a> {
    inner: &'a Inner,
    state: parking_lot::MutexGuard<'a, State>,
}

impl StatsGuard<'_> {
    pub(crate) fn snapshot(&self) -> PoolStats {
        self.inner.stats_of(&self.state)
    }
}

/// What [`Pool::trim`] gave back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrimReport {
    /// Idle bytes unmapped.
    pub unmapped: u64,
    /// Bytes released to the driver (unmapped idle plus cached).
    pub released: u64,
}

/// A mapped physical chunk, as seen from outside: where it sits in the reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSpan {
    /// Offset of the chunk in the reservation.
    pub offset: u64,
    /// Size of the chunk.
    pub size: u64,
}

/// A live allocation as listed by [`Pool::live_allocations`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveAllocation {
    /// Offset in the reservation.
    pub offset: u64,
    /// Bytes held (rounded to the allocation unit).
    pub footprint: u64,
    /// Name given at allocation, if any.
    pub name: Option<String>,
}

/// Where a growth could go: `needed` new bytes mapped at `cold`, the allocation starting at
/// `start` (inside the idle neighbour `idle` when one is used).
struct Candidate {
    needed: u64,
    start: u64,
    idle: Option<(u64, u64)>,
    cold: (u64, u64),
}

/// A VA range taken out of `cold` (and perhaps an idle neighbour) for a growth, with the
/// chunks that will back it.
struct Growth {
    /// Where the allocation starts.
    start: u64,
    /// Idle neighbour used, `[s, e)`.
    idle: Option<(u64, u64)>,
    /// Cold range claimed, `[s, e)`.
    cold: (u64, u64),
    /// Of the cold range, how much must be mapped for the request (the rest is look-ahead).
    needed: u64,
    /// Chunks taken from the cache.
    cached: Vec<PhysicalChunk>,
}

impl Pool {
    /// A pool over `backend`.
    pub fn new(backend: Arc<dyn Backend>, config: PoolConfig) -> Result<Pool> {
        let admission: Option<Arc<dyn Admission>> = config
            .physical_limit
            .map(|l| Arc::new(PhysicalLimit::new(l)) as Arc<dyn Admission>);
        Self::with_admission(backend, config, admission)
    }

    /// A pool on host memory with the default 2 MiB granularity.
    pub fn host(capacity: usize) -> Result<Pool> {
        let backend =
            crate::backend::host::HostBackend::new(crate::backend::host::DEFAULT_GRANULARITY)?;
        Self::new(Arc::new(backend), PoolConfig::new(capacity).name("host"))
    }

    /// A pool on CUDA device `ordinal`.
    pub fn cuda(ordinal: i32, capacity: usize) -> Result<Pool> {
        let backend = crate::backend::cuda::CudaBackend::new(ordinal)?;
        Self::new(
            Arc::new(backend),
            PoolConfig::new(capacity).name(format!("cuda:{ordinal}")),
        )
    }

    pub(crate) fn with_admission(
        backend: Arc<dyn Backend>,
        config: PoolConfig,
        admission: Option<Arc<dyn Admission>>,
    ) -> Result<Pool> {
        let gran = backend.info().granularity;
        let capacity = config.validate(gran)?;
        let drivers = DriverCounters::default();
        drivers.bump(DriverCall::Reserve);
        let base = backend.reserve(capacity as usize, gran)?;
        let mut state = State::default();
        state.cold.insert(0, capacity);
        tracing::debug!(pool = %config.name, base, capacity, gran, backend = backend.info().name, "pool reserved");
        let inner = Inner {
            base,
            capacity,
            gran: gran as u64,
            alignment: config.alignment as u64,
            max_chunk: config.max_chunk as u64,
            range_chunk: config.range_chunk.unwrap_or(gran) as u64,
            growth_divisor: config.growth_divisor,
            max_cached: config.max_cached,
            name: config.name.into(),
            admission,
            state: Mutex::new(state),
            drivers,
            backend,
        };
        let inner = Arc::new(inner);
        inner.state.lock().keepalive = Some(inner.clone());
        Ok(Pool {
            handle: Arc::new(Handle { inner }),
        })
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.handle.inner
    }

    /// The backend this pool maps memory from.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner().backend
    }

    /// What the backend is.
    pub fn backend_info(&self) -> &BackendInfo {
        self.inner().backend.info()
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.inner().name
    }

    /// Start address of the reservation.
    pub fn base(&self) -> u64 {
        self.inner().base
    }

    /// Bytes reserved.
    pub fn capacity(&self) -> u64 {
        self.inner().capacity
    }

    /// The mapping unit.
    pub fn granularity(&self) -> u64 {
        self.inner().gran
    }

    /// Allocate `bytes` backed by physical memory; contents are unspecified (see the crate
    /// documentation on zeroing). Dropping the [`Allocation`] frees it.
    pub fn allocate(&self, bytes: usize) -> Result<Allocation> {
        self.inner().allocate(bytes, None)
    }

    /// As [`Pool::allocate`], with a name that shows in reports and leak warnings.
    pub fn allocate_named(&self, bytes: usize, name: &str) -> Result<Allocation> {
        self.inner().allocate(bytes, Some(name.into()))
    }

    /// As [`Pool::allocate`], with every byte set to zero.
    pub fn allocate_zeroed(&self, bytes: usize) -> Result<Allocation> {
        let mut a = self.inner().allocate(bytes, None)?;
        a.fill(0)?;
        Ok(a)
    }

    /// Back `[offset, offset + len)` of the reservation with physical memory (range API).
    /// Both must be multiples of the granularity; the range must be unmapped and used neither by
    /// the allocator nor by a [`Region`]. Physical chunks are at most the configured range chunk (default: one granule).
    pub fn map(&self, offset: u64, len: u64) -> Result<()> {
        self.inner()
            .map_range(offset, len, self.inner().range_chunk, false)
    }

    /// As [`Pool::map`] with chunks of up to `max_chunk` bytes: fewer driver calls, but
    /// [`Pool::unmap`] must then cover whole chunks.
    pub fn map_chunked(&self, offset: u64, len: u64, max_chunk: u64) -> Result<()> {
        self.inner().check_chunk_size(max_chunk)?;
        self.inner().map_range(offset, len, max_chunk, false)
    }

    /// Give back the physical memory under `[offset, offset + len)`, which must be mapped through
    /// the range API and made of whole chunks. Its chunks go to the cache.
    pub fn unmap(&self, offset: u64, len: u64) -> Result<()> {
        self.inner().unmap_range(offset, len, false)
    }

    /// Whether all of `[offset, offset + len)` is mapped through the range API.
    pub fn is_mapped(&self, offset: u64, len: u64) -> bool {
        len > 0
            && self
                .inner()
                .state
                .lock()
                .ranges
                .covers(offset, offset.saturating_add(len))
    }

    /// The physical chunks mapped under `[offset, offset + len)`, in address order.
    pub fn chunks_in(&self, offset: u64, len: u64) -> Vec<ChunkSpan> {
        let end = offset.saturating_add(len);
        let st = self.inner().state.lock();
        let first = st
            .chunks
            .range(..=offset)
            .next_back()
            .map_or(offset, |(&o, _)| o);
        st.chunks
            .range(first..end)
            .filter(|(&o, c)| o + c.size as u64 > offset)
            .map(|(&o, c)| ChunkSpan {
                offset: o,
                size: c.size as u64,
            })
            .collect()
    }

    /// Give idle mapped memory and every cached chunk back to the driver.
    pub fn trim(&self) -> Result<TrimReport> {
        self.inner().trim(u64::MAX, true)
    }

    /// Release cached chunks only (keeping idle mapped memory for the hot path).
    pub fn release_cached(&self) -> Result<u64> {
        self.inner().release_cached(0)
    }

    /// A snapshot of the pool's counters, in O(1).
    pub fn stats(&self) -> PoolStats {
        self.inner().stats()
    }

    /// Live allocations, for reports.
    pub fn live_allocations(&self) -> Vec<LiveAllocation> {
        let st = self.inner().state.lock();
        st.live
            .iter()
            .map(|r| LiveAllocation {
                offset: r.offset,
                footprint: r.footprint,
                name: r.name.as_deref().map(str::to_owned),
            })
            .collect()
    }

    /// Check that every byte of the reservation is accounted for exactly once and that the
    /// counters match the structures. O(number of ranges); meant for tests and debugging.
    pub fn audit(&self) -> Result<(), String> {
        let st = self.inner().state.lock();
        st.audit(self.inner().capacity)
    }
}

impl Inner {
    fn addr(&self, offset: u64) -> u64 {
        self.base + offset
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    // ---- driver calls: counted, traced, and nothing else ----

    fn call_create(&self, size: u64) -> Result<PhysicalChunk> {
        self.drivers.bump(DriverCall::Create);
        tracing::trace!(pool = %self.name, size, "create");
        self.backend.create(size as usize)
    }

    /// # Safety
    /// `chunk` is ours, unmapped, and nothing refers to it any more.
    unsafe fn call_release(&self, chunk: PhysicalChunk) -> Result<()> {
        self.drivers.bump(DriverCall::Release);
        tracing::trace!(pool = %self.name, size = chunk.size, "release");
        // SAFETY: forwarded from the caller.
        unsafe { self.backend.release(chunk) }?;
        if let Some(a) = &self.admission {
            a.credit(chunk.size as u64);
        }
        Ok(())
    }

    /// # Safety
    /// `[offset, offset + chunk.size)` is claimed by the caller and unmapped.
    unsafe fn call_map(&self, offset: u64, chunk: PhysicalChunk) -> Result<()> {
        self.drivers.bump(DriverCall::Map);
        tracing::trace!(pool = %self.name, offset, size = chunk.size, "map");
        // SAFETY: forwarded from the caller; the address lies in our reservation.
        unsafe { self.backend.map(self.addr(offset), chunk) }
    }

    /// # Safety
    /// The range is claimed by the caller and made of chunks it mapped.
    unsafe fn call_set_access(&self, offset: u64, len: u64) -> Result<()> {
        self.drivers.bump(DriverCall::SetAccess);
        tracing::trace!(pool = %self.name, offset, len, "set_access");
        // SAFETY: forwarded from the caller.
        unsafe { self.backend.set_access(self.addr(offset), len as usize) }
    }

    /// # Safety
    /// The range is one whole chunk claimed by the caller that nothing uses any more.
    unsafe fn call_unmap(&self, offset: u64, len: u64) -> Result<()> {
        self.drivers.bump(DriverCall::Unmap);
        tracing::trace!(pool = %self.name, offset, len, "unmap");
        // SAFETY: forwarded from the caller.
        unsafe { self.backend.unmap(self.addr(offset), len as usize) }
    }

    // ---- physical memory: cache, admission, create, release ----

    /// Create `bytes` of new physical memory in chunks of at most `max_chunk`, admitted first.
    /// On failure nothing stays created and nothing stays charged. `optional` growth (look-ahead)
    /// never makes others give memory back. With `donate`, admission may instead move idle
    /// chunks of other users into our cache: then `None` comes back and the caller plans again.
    fn create_chunks(
        &self,
        bytes: u64,
        max_chunk: u64,
        optional: bool,
        donate: bool,
    ) -> Result<Option<Vec<PhysicalChunk>>> {
        if bytes == 0 {
            return Ok(Some(Vec::new()));
        }
        if let Some(a) = &self.admission {
            let donate = (donate && !optional).then_some(max_chunk);
            match a.admit(bytes, !optional, donate) {
                Ok(Grant::Charged) => {}
                Ok(Grant::Donated) => return Ok(None),
                Err(e) => {
                    // Our own cache may hold chunks of sizes that did not fit this request:
                    // they count against the limit too, so give them back and ask once more.
                    if optional || self.state.lock().cache.bytes() == 0 {
                        return Err(e);
                    }
                    self.release_cached(0)?;
                    if a.admit(bytes, true, None)? == Grant::Donated {
                        return Ok(None);
                    }
                }
            }
        }
        let mut out = Vec::new();
        let mut left = bytes;
        while left > 0 {
            let size = left.min(max_chunk);
            match self.call_create(size) {
                Ok(c) => {
                    out.push(c);
                    left -= size;
                }
                Err(e) => {
                    if let Some(a) = &self.admission {
                        a.credit(left);
                    }
                    // Failures here are logged and the chunks cached; the create error is the news.
                    let _ = self.release_all(out);
                    return Err(self.physical_error(e, bytes));
                }
            }
        }
        Ok(Some(out))
    }

    /// A driver out-of-memory becomes [`Error::OutOfPhysicalMemory`] with the device's numbers.
    fn physical_error(&self, e: Error, requested: u64) -> Error {
        if !matches!(e, Error::Backend { .. }) || !e.is_out_of_memory() {
            return e;
        }
        let available = self.backend.memory_info().map(|m| m.free).unwrap_or(0);
        Error::OutOfPhysicalMemory {
            requested,
            available,
            source_of_limit: format!(
                "{} device {} ({e})",
                self.backend.info().name,
                self.backend.info().device_name
            ),
        }
    }

    /// Release chunks that are mapped nowhere; a chunk whose release fails goes to the cache.
    /// Returns the bytes released and the first failure, if any.
    pub(crate) fn release_all(&self, chunks: Vec<PhysicalChunk>) -> (u64, Option<Error>) {
        let mut released = 0;
        let mut kept = Vec::new();
        let mut first_err = None;
        for c in chunks {
            // SAFETY: callers pass chunks they took out of every structure and unmapped.
            match unsafe { self.call_release(c) } {
                Ok(()) => released += c.size as u64,
                Err(e) => {
                    tracing::warn!(pool = %self.name, error = %e, "release failed; chunk kept in the cache");
                    kept.push(c);
                    first_err.get_or_insert(e);
                }
            }
        }
        if !kept.is_empty() {
            let mut st = self.state.lock();
            for c in kept {
                st.cache.put(c);
            }
        }
        (released, first_err)
    }

    /// Put unmapped chunks in the cache, then release whatever exceeds the cache cap.
    fn cache_or_release(&self, chunks: Vec<PhysicalChunk>) {
        let excess = {
            let mut st = self.state.lock();
            for c in chunks {
                st.cache.put(c);
            }
            match self.max_cached {
                Some(cap) => st.cache.shrink_to(cap),
                None => Vec::new(),
            }
        };
        // A chunk that cannot be released stays cached (logged): nothing is lost.
        let _ = self.release_all(excess);
    }

    /// Map `chunks` one after the other from `offset` and grant access to all of them.
    /// On failure everything mapped here is unmapped again and the error returned.
    fn map_chunks(&self, offset: u64, chunks: &[PhysicalChunk]) -> Result<()> {
        let mut at = offset;
        for (i, &c) in chunks.iter().enumerate() {
            // SAFETY: the caller claimed [offset, offset + sum of sizes), which is unmapped.
            if let Err(e) = unsafe { self.call_map(at, c) } {
                self.unmap_quietly(offset, &chunks[..i]);
                return Err(e);
            }
            at += c.size as u64;
        }
        // SAFETY: the range is exactly the chunks mapped just above.
        if let Err(e) = unsafe { self.call_set_access(offset, at - offset) } {
            self.unmap_quietly(offset, chunks);
            return Err(e);
        }
        Ok(())
    }

    /// Roll back mappings made by [`Inner::map_chunks`]. Unmap failures here are only logged:
    /// the caller's error is the one that matters and the chunks are still released/cached.
    fn unmap_quietly(&self, offset: u64, chunks: &[PhysicalChunk]) {
        let mut at = offset;
        for c in chunks {
            // SAFETY: rollback of a mapping this operation made; nothing has used it.
            if let Err(e) = unsafe { self.call_unmap(at, c.size as u64) } {
                tracing::error!(pool = %self.name, error = %e, offset = at, "unmap during rollback failed");
            }
            at += c.size as u64;
        }
    }

    // ---- allocator ----

    fn refusal(&self, reason: &str) -> Error {
        Error::PoolClosed {
            pool: self.name.to_string(),
            reason: reason.to_string(),
        }
    }

    /// Take no new memory from now on, if nothing is in use; else say what is.
    pub(crate) fn close_if_unused(&self, reason: &str) -> Result<()> {
        let mut st = self.state.lock();
        if st.live.live() > 0 || st.ranges.total() > 0 || st.in_transit > 0 {
            return Err(Error::ModelBusy {
                model: self.name.to_string(),
                live_allocations: st.live.live(),
                mapped_ranges: st.ranges.total(),
                bytes: st.in_use(),
            });
        }
        st.refusing = Some(reason.into());
        Ok(())
    }

    /// Give back up to `want` bytes of memory nobody uses: cached chunks first, then idle
    /// chunks. Returns the bytes released.
    pub(crate) fn reclaim(&self, want: u64) -> Result<u64> {
        let keep = self.state.lock().cache.bytes().saturating_sub(want);
        let mut released = self.release_cached(keep)?;
        if released < want {
            released += self.trim(want - released, false)?.released;
        }
        if released > 0 {
            tracing::debug!(pool = %self.name, want, released, "reclaimed");
        }
        Ok(released)
    }

    fn footprint(&self, bytes: usize) -> Result<u64> {
        if bytes == 0 {
            return Err(Error::ZeroSize {
                what: "allocation size",
            });
        }
        let f = round_up("allocation size", bytes as u64, self.alignment)?;
        if f > self.capacity {
            return Err(Error::OutOfAddressSpace {
                requested: f,
                largest_free: self
                    .state
                    .lock()
                    .cold
                    .iter()
                    .map(|(s, e)| e - s)
                    .max()
                    .unwrap_or(0),
                capacity: self.capacity,
            });
        }
        Ok(f)
    }

    fn allocate(&self, bytes: usize, name: Option<Arc<str>>) -> Result<Allocation> {
        let footprint = self.footprint(bytes)?;
        // A growth may be answered with chunks handed over from other models' idle memory
        // instead of new ones: then plan again, now with them in our cache. A few rounds at most;
        // the last one creates fresh memory.
        for round in 0..=MAX_REPLANS {
            if let Some(a) = self.allocate_once(bytes, footprint, &name, round < MAX_REPLANS)? {
                return Ok(a);
            }
        }
        Err(Error::InvalidArgument(format!(
            "allocation of {bytes} bytes was re-planned {MAX_REPLANS} times without settling"
        )))
    }

    /// One planning round of [`Inner::allocate`]; `None` when the cache was refilled by a
    /// donation and the request must be planned again.
    fn allocate_once(
        &self,
        bytes: usize,
        footprint: u64,
        name: &Option<Arc<str>>,
        donate: bool,
    ) -> Result<Option<Allocation>> {
        let growth = {
            let mut st = self.state.lock();
            if let Some(reason) = &st.refusing {
                return Err(self.refusal(reason));
            }
            let warm = match st.take_warm(footprint) {
                // Hot path: warm memory, no driver call.
                Some(off) => Some(off),
                None => {
                    st.flush_quick();
                    st.idle.take_best_fit(footprint)
                }
            };
            if let Some(off) = warm {
                let slot = self.record(&mut st, off, footprint, name.clone());
                // SAFETY: recorded live under the lock; the pool is open (we are called through
                // a handle), so its keepalive is held until this allocation is freed.
                return Ok(Some(unsafe {
                    Allocation::new(self, off, bytes, footprint, slot)
                }));
            }
            self.plan_growth(&mut st, footprint)?
        };
        let Some((off, slot)) = self.grow(growth, footprint, name.clone(), donate)? else {
            return Ok(None);
        };
        // SAFETY: as above.
        Ok(Some(unsafe {
            Allocation::new(self, off, bytes, footprint, slot)
        }))
    }

    fn record(&self, st: &mut State, offset: u64, footprint: u64, name: Option<Arc<str>>) -> u32 {
        st.alloc_bytes += footprint;
        st.allocations += 1;
        st.note_peaks();
        st.live.insert(LiveRecord {
            offset,
            footprint,
            name,
        })
    }

    /// Choose where to grow: the cold range that needs the least new mapping, using an idle
    /// range that ends where it starts. Claims the ranges and takes cached chunks.
    fn plan_growth(&self, st: &mut State, footprint: u64) -> Result<Growth> {
        let g = self.gran;
        let mut best: Option<Candidate> = None;
        let mut consider = |c: Candidate| {
            if best
                .as_ref()
                .is_none_or(|b| (c.needed, c.start) < (b.needed, b.start))
            {
                best = Some(c);
            }
        };
        for (cs, ce) in st.cold.iter() {
            if let Some((is, ie)) = st.idle.intervals().ending_at(cs) {
                let needed = (footprint - (ie - is)).div_ceil(g) * g;
                if needed <= ce - cs {
                    consider(Candidate {
                        needed,
                        start: is,
                        idle: Some((is, ie)),
                        cold: (cs, ce),
                    });
                }
            }
            let needed = footprint.div_ceil(g) * g;
            if needed <= ce - cs {
                consider(Candidate {
                    needed,
                    start: cs,
                    idle: None,
                    cold: (cs, ce),
                });
            }
        }
        let Some(Candidate {
            needed,
            start,
            idle,
            cold: (cs, ce),
        }) = best
        else {
            let largest = st
                .cold
                .iter()
                .map(|(cs, ce)| {
                    ce - cs + st.idle.intervals().ending_at(cs).map_or(0, |(s, e)| e - s)
                })
                .max()
                .unwrap_or(0)
                .max(st.idle.largest());
            return Err(Error::OutOfAddressSpace {
                requested: footprint,
                largest_free: largest,
                capacity: self.capacity,
            });
        };
        let ahead = st
            .mapped
            .checked_div(self.growth_divisor)
            .map_or(0, |a| (a / g * g).clamp(g, self.max_chunk));
        let mut len = needed.max(ahead).min(ce - cs);
        let mut cached = st.cache.take_up_to(len, self.max_chunk as usize);
        let got: u64 = cached.iter().map(|c| c.size as u64).sum();
        if got < needed {
            // A cached chunk bigger than what is left is still better than a new one (it is
            // created and charged already): grow by all of it when the address space allows.
            let room = (ce - cs - got).min(self.max_chunk) as usize;
            if let Some(c) = st.cache.take_smallest_in((needed - got) as usize, room) {
                len = len.max(got + c.size as u64);
                cached.push(c);
            }
        }
        if let Some((is, ie)) = idle {
            st.idle.remove(is, ie);
            st.in_transit += ie - is;
        }
        st.cold.remove(cs, cs + len);
        st.in_transit += len;
        Ok(Growth {
            start,
            idle,
            cold: (cs, cs + len),
            needed,
            cached,
        })
    }

    /// Back a planned growth with physical memory, map it and record the allocation.
    /// Returns the allocation's offset and slot, or `None` (nothing changed) when admission
    /// refilled the cache with donated chunks instead: plan again.
    fn grow(
        &self,
        plan: Growth,
        footprint: u64,
        name: Option<Arc<str>>,
        donate: bool,
    ) -> Result<Option<(u64, u32)>> {
        let (cs, ce) = plan.cold;
        let cached_bytes: u64 = plan.cached.iter().map(|c| c.size as u64).sum();
        let n_cached = plan.cached.len();
        let mut chunks = plan.cached;
        // What the request needs must be created; the look-ahead is best effort.
        let required = plan.needed.saturating_sub(cached_bytes);
        let optional = (ce - cs) - cached_bytes - required;
        let created = match self.create_chunks(required, self.max_chunk, false, donate) {
            Ok(Some(c)) => c,
            Ok(None) => {
                self.undo_growth(plan.idle, (cs, ce), chunks, Vec::new());
                return Ok(None);
            }
            Err(e) => {
                self.undo_growth(plan.idle, (cs, ce), chunks, Vec::new());
                return Err(e);
            }
        };
        chunks.extend(created.iter().copied());
        let mut fresh = created;
        if optional > 0 {
            // Optional growth is never answered with a donation (`None`): nothing to add then.
            match self.create_chunks(optional, self.max_chunk, true, false) {
                Ok(None) => {}
                Ok(Some(extra)) => {
                    chunks.extend(extra.iter().copied());
                    fresh.extend(extra);
                }
                Err(e) if e.is_out_of_memory() => {
                    tracing::debug!(pool = %self.name, optional, "no memory for growth look-ahead; mapping what is needed");
                }
                Err(e) => {
                    self.undo_growth(plan.idle, (cs, ce), chunks[..n_cached].to_vec(), fresh);
                    return Err(e);
                }
            }
        }
        let mapped: u64 = chunks.iter().map(|c| c.size as u64).sum();
        if let Err(e) = self.map_chunks(cs, &chunks) {
            self.undo_growth(plan.idle, (cs, ce), chunks[..n_cached].to_vec(), fresh);
            return Err(e);
        }
        let mut st = self.state.lock();
        let mut at = cs;
        for c in &chunks {
            st.chunks.insert(at, *c);
            at += c.size as u64;
        }
        st.mapped += mapped;
        st.in_transit -= (ce - cs) + plan.idle.map_or(0, |(s, e)| e - s);
        if cs + mapped < ce {
            st.cold.insert(cs + mapped, ce);
        }
        let end = plan.start + footprint;
        if end < cs + mapped {
            st.idle.insert(end, cs + mapped);
        }
        let slot = self.record(&mut st, plan.start, footprint, name);
        drop(st);
        tracing::debug!(pool = %self.name, offset = cs, mapped, chunks = chunks.len(), "grew");
        Ok(Some((plan.start, slot)))
    }

    fn undo_growth(
        &self,
        idle: Option<(u64, u64)>,
        (cs, ce): (u64, u64),
        cached: Vec<PhysicalChunk>,
        fresh: Vec<PhysicalChunk>,
    ) {
        {
            let mut st = self.state.lock();
            if let Some((s, e)) = idle {
                st.idle.insert(s, e);
                st.in_transit -= e - s;
            }
            st.cold.insert(cs, ce);
            st.in_transit -= ce - cs;
            for c in cached {
                st.cache.put(c);
            }
        }
        // Rollback: a chunk that cannot be released stays cached (logged).
        let _ = self.release_all(fresh);
    }

    /// Called by [`Allocation`]'s drop. Returns the pool's keepalive when this was the last
    /// allocation of a closed pool: the caller drops it after its last use of the pool.
    #[must_use]
    pub(crate) fn free(&self, offset: u64, footprint: u64, slot: u32) -> Option<Arc<Inner>> {
        let (closed, last) = {
            let mut st = self.state.lock();
            st.live.remove(slot);
            st.alloc_bytes -= footprint;
            st.frees += 1;
            st.put_warm(offset, footprint);
            (st.closed, st.live.live() == 0)
        };
        if !closed {
            return None;
        }
        if let Err(e) = self.trim(u64::MAX, true) {
            tracing::warn!(pool = %self.name, error = %e, "giving back memory of a closed pool failed");
        }
        if last {
            return self.state.lock().keepalive.take();
        }
        None
    }

    // ---- range API ----

    fn check_chunk_size(&self, max_chunk: u64) -> Result<()> {
        if max_chunk == 0 || max_chunk % self.gran != 0 {
            return Err(Error::Misaligned {
                what: "max_chunk",
                value: max_chunk,
                alignment: self.gran,
            });
        }
        Ok(())
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<u64> {
        if len == 0 {
            return Err(Error::ZeroSize {
                what: "range length",
            });
        }
        for (what, v) in [("range offset", offset), ("range length", len)] {
            if v % self.gran != 0 {
                return Err(Error::Misaligned {
                    what,
                    value: v,
                    alignment: self.gran,
                });
            }
        }
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.capacity)
            .ok_or(Error::RangeOutOfBounds {
                offset,
                len,
                capacity: self.capacity,
            })?;
        Ok(end)
    }

    /// Map `[offset, offset + len)`, which must be unmapped free space: `cold` for the pool's
    /// own range API, `held` (inside a region) for a [`Region`]'s.
    pub(crate) fn map_range(
        &self,
        offset: u64,
        len: u64,
        max_chunk: u64,
        in_region: bool,
    ) -> Result<()> {
        // As for allocations: a donation of idle chunks means planning again with them.
        for round in 0..=MAX_REPLANS {
            if self.map_range_once(offset, len, max_chunk, in_region, round < MAX_REPLANS)? {
                return Ok(());
            }
        }
        Err(Error::InvalidArgument(format!(
            "mapping {len} bytes at {offset:#x} was re-planned {MAX_REPLANS} times without settling"
        )))
    }

    /// One round of [`Inner::map_range`]; `false` (nothing changed) when admission refilled
    /// the cache with donated chunks instead of admitting new ones.
    fn map_range_once(
        &self,
        offset: u64,
        len: u64,
        max_chunk: u64,
        in_region: bool,
        donate: bool,
    ) -> Result<bool> {
        let end = self.check_range(offset, len)?;
        let cached = {
            let mut st = self.state.lock();
            if let Some(reason) = &st.refusing {
                return Err(self.refusal(reason));
            }
            let free = if in_region { &st.held } else { &st.cold };
            if let Some((s, e)) = free.first_gap(offset, end) {
                return Err(match st.ranges.first_overlap(offset, end) {
                    Some((ms, me)) => Error::RangeAlreadyMapped {
                        offset,
                        len,
                        mapped_offset: ms,
                        mapped_len: me - ms,
                    },
                    None => Error::RangeInUse {
                        offset,
                        len,
                        busy_offset: s,
                        busy_len: e - s,
                    },
                });
            }
            if in_region {
                st.held.remove(offset, end);
            } else {
                st.cold.remove(offset, end);
            }
            st.in_transit += len;
            st.cache.take_up_to(len, max_chunk as usize)
        };
        let cached_bytes: u64 = cached.iter().map(|c| c.size as u64).sum();
        let fresh = match self.create_chunks(len - cached_bytes, max_chunk, false, donate) {
            Ok(Some(f)) => f,
            Ok(None) => {
                self.undo_range(offset, end, cached, Vec::new());
                return Ok(false);
            }
            Err(e) => {
                self.undo_range(offset, end, cached, Vec::new());
                return Err(e);
            }
        };
        let mut chunks = cached.clone();
        chunks.extend(fresh.iter().copied());
        if let Err(e) = self.map_chunks(offset, &chunks) {
            self.undo_range(offset, end, cached, fresh);
            return Err(e);
        }
        let mut st = self.state.lock();
        let mut at = offset;
        for c in &chunks {
            st.chunks.insert(at, *c);
            at += c.size as u64;
        }
        st.mapped += len;
        st.in_transit -= len;
        st.ranges.insert(offset, end);
        st.note_peaks();
        tracing::debug!(pool = %self.name, offset, len, chunks = chunks.len(), "range mapped");
        Ok(true)
    }

    fn undo_range(
        &self,
        offset: u64,
        end: u64,
        cached: Vec<PhysicalChunk>,
        fresh: Vec<PhysicalChunk>,
    ) {
        {
            let mut st = self.state.lock();
            st.unmapped_home(offset, end).insert(offset, end);
            st.in_transit -= end - offset;
            for c in cached {
                st.cache.put(c);
            }
        }
        // Rollback: a chunk that cannot be released stays cached (logged).
        let _ = self.release_all(fresh);
    }

    /// Unmap `[offset, offset + len)`, mapped through the range API: inside a region when
    /// `in_region`, outside every region otherwise.
    pub(crate) fn unmap_range(&self, offset: u64, len: u64, in_region: bool) -> Result<()> {
        let end = self.check_range(offset, len)?;
        let victims: Vec<(u64, PhysicalChunk)> = {
            let mut st = self.state.lock();
            if !in_region {
                if let Some((s, e)) = st.regions.first_overlap(offset, end) {
                    return Err(Error::RangeInUse {
                        offset,
                        len,
                        busy_offset: s,
                        busy_len: e - s,
                    });
                }
            }
            if let Some((s, e)) = st.ranges.first_gap(offset, end) {
                return Err(Error::RangeNotMapped {
                    offset,
                    len,
                    hole_offset: s,
                    hole_len: e - s,
                });
            }
            // Chunks are unmapped whole: refuse a range that cuts one.
            for at in [offset, end - 1] {
                if let Some((&co, c)) = st.chunks.range(..=at).next_back() {
                    let ce = co + c.size as u64;
                    if at < ce && (co < offset || ce > end) {
                        return Err(Error::SplitsChunk {
                            offset,
                            len,
                            chunk_offset: co,
                            chunk_len: c.size as u64,
                        });
                    }
                }
            }
            let victims: Vec<_> = st
                .chunks
                .range(offset..end)
                .map(|(&o, &c)| (o, c))
                .collect();
            for (o, _) in &victims {
                st.chunks.remove(o);
            }
            st.ranges.remove(offset, end);
            st.mapped -= len;
            st.in_transit += len;
            victims
        };
        // Unmap chunk by chunk; on a failure, map back what was already unmapped (the chunks
        // keep their contents) so that the range is exactly as before.
        for (i, &(o, c)) in victims.iter().enumerate() {
            // SAFETY: the range was removed from the range set under the lock: nobody else
            // touches these chunks, and the caller said it no longer uses the memory.
            if let Err(e) = unsafe { self.call_unmap(o, c.size as u64) } {
                let restored = victims[..i]
                    .iter()
                    .all(|&(ro, rc)| self.map_chunks(ro, &[rc]).is_ok());
                let mut st = self.state.lock();
                st.in_transit -= len;
                if restored {
                    for &(ro, rc) in &victims {
                        st.chunks.insert(ro, rc);
                    }
                    st.mapped += len;
                    st.ranges.insert(offset, end);
                } else {
                    // Could not restore: the chunks already unmapped stay unmapped (cached), the
                    // rest stays mapped; every byte is still accounted for.
                    tracing::error!(pool = %self.name, offset, len, "unmap failed and could not be rolled back fully");
                    for &(ro, rc) in &victims[i..] {
                        st.chunks.insert(ro, rc);
                        st.mapped += rc.size as u64;
                        st.ranges.insert(ro, ro + rc.size as u64);
                    }
                    for &(ro, rc) in &victims[..i] {
                        st.unmapped_home(ro, ro + rc.size as u64)
                            .insert(ro, ro + rc.size as u64);
                        st.cache.put(rc);
                    }
                }
                return Err(e);
            }
        }
        {
            let mut st = self.state.lock();
            st.in_transit -= len;
            st.unmapped_home(offset, end).insert(offset, end);
        }
        tracing::debug!(pool = %self.name, offset, len, chunks = victims.len(), "range unmapped");
        self.cache_or_release(victims.into_iter().map(|(_, c)| c).collect());
        Ok(())
    }

    // ---- giving memory back ----

    /// Unmap up to `limit` bytes of idle chunks and release them; with `with_cache`, release the
    /// whole cache too.
    pub(crate) fn trim(&self, limit: u64, with_cache: bool) -> Result<TrimReport> {
        let (idle, mut cached) = {
            let mut st = self.state.lock();
            let idle = st.take_idle_chunks(limit);
            let cached = if with_cache {
                st.cache.drain()
            } else {
                Vec::new()
            };
            (idle, cached)
        };
        let mut unmapped = Vec::new();
        let mut first_err = None;
        for (o, c) in idle {
            // SAFETY: these chunks lay wholly in idle memory, now claimed: no allocation uses them.
            match unsafe { self.call_unmap(o, c.size as u64) } {
                Ok(()) => unmapped.push((o, c)),
                Err(e) => {
                    let mut st = self.state.lock();
                    st.chunks.insert(o, c);
                    st.mapped += c.size as u64;
                    st.in_transit -= c.size as u64;
                    st.idle.insert(o, o + c.size as u64);
                    first_err.get_or_insert(e);
                }
            }
        }
        let unmapped_bytes: u64 = unmapped.iter().map(|(_, c)| c.size as u64).sum();
        {
            let mut st = self.state.lock();
            for (o, c) in &unmapped {
                st.in_transit -= c.size as u64;
                st.cold.insert(*o, o + c.size as u64);
            }
        }
        cached.extend(unmapped.into_iter().map(|(_, c)| c));
        let (released, err) = self.release_all(cached);
        if let Some(e) = err {
            first_err.get_or_insert(e);
        }
        if unmapped_bytes > 0 || released > 0 {
            tracing::debug!(pool = %self.name, unmapped = unmapped_bytes, released, "trimmed");
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(TrimReport {
                unmapped: unmapped_bytes,
                released,
            }),
        }
    }

    /// Hand over idle physical memory to another pool without releasing it: cached chunks, then
    /// idle mapped chunks (unmapped here), largest first, each at most `max_size` bytes, until
    /// `want` bytes are taken and never more than `cap` bytes. The chunks leave this pool's
    /// books; their admission charge is the caller's to move or credit.
    pub(crate) fn take_spare(&self, want: u64, max_size: u64, cap: u64) -> Vec<PhysicalChunk> {
        let (mut out, idle) = {
            let mut st = self.state.lock();
            let mut out = Vec::new();
            let mut got = 0u64;
            while got < want {
                let room = max_size.min(cap - got) as usize;
                match st.cache.take_at_most(room) {
                    Some(c) => {
                        got += c.size as u64;
                        out.push(c);
                    }
                    None => break,
                }
            }
            let mut idle = Vec::new();
            if got < want {
                st.flush_quick();
                let mut candidates: Vec<(u64, PhysicalChunk)> = st
                    .chunks
                    .iter()
                    .filter(|(&o, c)| {
                        c.size as u64 <= max_size
                            && st.idle.intervals().covers(o, o + c.size as u64)
                    })
                    .map(|(&o, &c)| (o, c))
                    .collect();
                candidates.sort_by_key(|(o, c)| (std::cmp::Reverse(c.size), *o));
                for (o, c) in candidates {
                    let size = c.size as u64;
                    if got >= want || got + size > cap {
                        continue;
                    }
                    st.idle.remove(o, o + size);
                    st.chunks.remove(&o);
                    st.mapped -= size;
                    st.in_transit += size;
                    got += size;
                    idle.push((o, c));
                }
            }
            (out, idle)
        };
        for (o, c) in idle {
            let size = c.size as u64;
            // SAFETY: the chunk lay wholly in idle memory and is claimed: nobody uses it.
            let unmapped = unsafe { self.call_unmap(o, size) };
            let mut st = self.state.lock();
            st.in_transit -= size;
            match unmapped {
                Ok(()) => {
                    st.cold.insert(o, o + size);
                    out.push(c);
                }
                Err(e) => {
                    tracing::warn!(pool = %self.name, error = %e, "unmapping a chunk to hand over failed; it stays");
                    st.chunks.insert(o, c);
                    st.mapped += size;
                    st.idle.insert(o, o + size);
                }
            }
        }
        out
    }

    /// Take chunks handed over by another pool (already charged to this one) into the cache.
    pub(crate) fn adopt(&self, chunks: Vec<PhysicalChunk>) {
        let mut st = self.state.lock();
        for c in chunks {
            st.cache.put(c);
        }
        st.note_peaks();
    }

    /// Release cached chunks until at most `keep` bytes stay cached.
    pub(crate) fn release_cached(&self, keep: u64) -> Result<u64> {
        let excess = self.state.lock().cache.shrink_to(keep);
        match self.release_all(excess) {
            (released, None) => Ok(released),
            (_, Some(e)) => Err(e),
        }
    }

    pub(crate) fn stats(&self) -> PoolStats {
        self.stats_of(&self.state.lock())
    }

    /// Hold the pool's lock for a snapshot taken together with other pools'.
    pub(crate) fn lock_stats(&self) -> StatsGuard<'_> {
        StatsGuard {
            inner: self,
            state: self.state.lock(),
        }
    }

    fn stats_of(&self, st: &State) -> PoolStats {
        PoolStats {
            capacity: self.capacity,
            granularity: self.gran,
            mapped: st.mapped,
            in_use: st.in_use(),
            range_mapped: st.ranges.total(),
            reserved_regions: st.regions.total(),
            cached: st.cache.bytes(),
            peak_in_use: st.peak_in_use,
            peak_physical: st.peak_physical,
            live_allocations: st.live.live(),
            allocations: st.allocations,
            frees: st.frees,
            mapped_chunks: st.chunks.len() as u64,
            cached_chunks: st.cache.len() as u64,
            driver_calls: self.drivers.snapshot(),
        }
    }

    /// The last pool handle is gone: give back everything no allocation holds, report leaks.
    /// Returns the keepalive when no allocation is live (the caller drops it).
    #[must_use]
    fn close(&self) -> Option<Arc<Inner>> {
        let (ranges, live, live_bytes, names) = {
            let mut st = self.state.lock();
            st.closed = true;
            let ranges: Vec<(u64, u64)> = st.ranges.iter().collect();
            let names: Vec<String> = st
                .live
                .iter()
                .filter_map(|r| r.name.as_deref().map(str::to_owned))
                .take(16)
                .collect();
            (ranges, st.live.live(), st.alloc_bytes, names)
        };
        for (s, e) in ranges {
            // Range mappings belong to the pool alone: give them back chunk by chunk.
            let spans: Vec<(u64, u64)> = {
                let st = self.state.lock();
                st.chunks
                    .range(s..e)
                    .map(|(&o, c)| (o, c.size as u64))
                    .collect()
            };
            for (o, size) in spans {
                let in_region = self.state.lock().regions.covers(o, o + size);
                if let Err(e) = self.unmap_range(o, size, in_region) {
                    tracing::error!(pool = %self.name, error = %e, "unmapping a range at pool drop failed");
                }
            }
        }
        if let Err(e) = self.trim(u64::MAX, true) {
            tracing::error!(pool = %self.name, error = %e, "trimming at pool drop failed");
        }
        if live > 0 {
            tracing::warn!(
                pool = %self.name,
                live_allocations = live,
                bytes = live_bytes,
                named = ?names,
                "pool dropped with live allocations; their memory is given back as each is dropped"
            );
        }
        let mut st = self.state.lock();
        if st.live.live() == 0 {
            st.keepalive.take()
        } else {
            None
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // No allocation and no handle is left: everything can go.
        let st = self.state.get_mut();
        st.flush_quick();
        let chunks: Vec<(u64, PhysicalChunk)> =
            std::mem::take(&mut st.chunks).into_iter().collect();
        let mut cached = st.cache.drain();
        for (o, c) in chunks {
            // SAFETY: no allocation, handle or range user is left; the chunk is ours and mapped.
            match unsafe { self.call_unmap(o, c.size as u64) } {
                Ok(()) => cached.push(c),
                Err(e) => {
                    tracing::error!(pool = %self.name, error = %e, "unmap at pool teardown failed")
                }
            }
        }
        for c in cached {
            // SAFETY: unmapped above or never mapped; released once.
            if let Err(e) = unsafe { self.call_release(c) } {
                tracing::error!(pool = %self.name, error = %e, "release at pool teardown failed");
            }
        }
        self.drivers.bump(DriverCall::FreeReservation);
        // SAFETY: the reservation is ours, everything in it is unmapped, nothing refers to it.
        if let Err(e) = unsafe {
            self.backend
                .free_reservation(self.base, self.capacity as usize)
        } {
            tracing::error!(pool = %self.name, error = %e, "freeing the reservation failed");
        }
        tracing::debug!(pool = %self.name, "pool released");
    }
}
