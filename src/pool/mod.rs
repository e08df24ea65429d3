//! The pool: one virtual reservation on one backend, physical memory mapped on demand.
//!
//! Two ways to use it, over the same reservation:
//! - [`Pool::allocate`] returns an RAII [`Allocation`]. Freed memory stays mapped ("idle") and
//!   is reused by the next allocation without any driver call; growth maps ahead in ever larger
//!   chunks; [`Pool::trim`] gives idle and cached memory back to the driver.
//! - [`Pool::map`] / [`Pool::unmap`] back chosen granule-aligned ranges, for KV-cache managers
//!   that place their blocks themselves.
//!
//! Along the request path, one file each:
//! - `state.rs`: which addresses are free, idle, mapped, in transit (bookkeeping, no driver);
//! - `sources.rs`: where chunks come from (cache, admission with donation, backend) and go;
//! - `mapper.rs`: the only code that calls the backend; map, access, unmap and the rollback;
//! - `allocator.rs` (plan and grow), `ranges.rs` (range API), `region.rs` (regions),
//!   `giveback.rs` (trim, reclaim, hand-over, close, teardown);
//! - `sleep/`: sleep and wake at the same addresses (claim, copy to host staging, unmap and
//!   release; obtain, map, copy back), with `tags.rs` saying what each range holds.
//!
//! Ownership: every [`Allocation`] holds an `Arc` of the pool's internals, so the reservation
//! and the bookkeeping outlive the last allocation whatever thread drops what when. Dropping the
//! last [`Pool`] handle *closes* the pool (everything unused goes back at once); the internals go
//! when the last allocation does.
//!
//! Locking: one `parking_lot` mutex guards the bookkeeping ([`state::State`]); every driver call
//! happens with it released, on ranges and chunks claimed beforehand, and a failure puts back
//! what was claimed. Lock order, crate-wide: a shared pool's model registry, then its ledger,
//! then a pool's state; a `BlockBacking`'s state is never held while taking any of them. No
//! lock is held across a driver call, a callback, or a drop of a pool reference (which may run
//! the teardown and its driver calls).

mod admission;
mod adopt;
mod allocation;
mod allocator;
mod cache;
mod config;
mod export;
mod front;
mod giveback;
mod intervals;
pub(crate) mod keeper;
mod mapper;
mod options;
mod ranges;
mod region;
mod sleep;
mod sources;
mod state;
mod tags;
mod thread_front;
mod zero;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use parking_lot::Mutex;

pub use allocation::Allocation;
pub use config::{PoolConfig, DEFAULT_ALIGNMENT, DEFAULT_GROWTH_DIVISOR, DEFAULT_MAX_CHUNK};
pub use options::MemOptions;
pub use region::Region;
pub(crate) use sleep::SleepWatcher;
pub use sleep::{
    AfterWake, HostStaging, SleepAction, SleepPolicy, SleepReport, SleepStats, SleepStatus,
    WakeReport,
};

pub(crate) use admission::{Acquired, Admission, Fit, PhysicalLimit, Urgency};

pub(crate) use export::RangePin;
pub(crate) use front::{FrontCache, FrontGate};
pub(crate) use giveback::TrimScope;
use mapper::bytes_of;
pub(crate) use ranges::{ChunkFate, Space};
use state::State;

use crate::backend::{Backend, BackendInfo, DriverCall};
use crate::error::Result;
use crate::stats::{DriverCounters, PoolStats};
use crate::tag::Tag;

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
        self.inner.close();
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
    /// Whether front caches (`front.rs`) may keep and serve blocks: follows the sleep status
    /// and closing.
    front_gate: Arc<FrontGate>,
    /// Bytes of physical chunks held by operations in progress (see `sources.rs`).
    in_flight: AtomicU64,
    drivers: DriverCounters,
    /// This pool, for chunks another process keeps imported (released once it forgot them).
    me: std::sync::Weak<Inner>,
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

    pub(crate) fn audit(&self) -> Result<(), String> {
        self.state.audit(self.inner.capacity)
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

    /// An elastic host tier for CUDA device `ordinal`: a pool (reserved once, mapped on
    /// demand, `config`'s limits as its host budget, the same stats as any pool) over VMM host
    /// memory the device and the host both access ([`crate::backend::cuda::CudaBackend::host_tier`]),
    /// or, where that cannot be had (no driver, no device, no host VMM), over page-locked host
    /// memory ([`crate::backend::host::HostBackend::locked`]). Which one it is shows in its
    /// backend's `device_name` (and in `page_locked`, true for both); the fallback is logged.
    /// Layouts on it are [`crate::layout::StorageKind::Pinned`].
    pub fn host_tier(ordinal: i32, config: PoolConfig) -> Result<Pool> {
        let backend: Arc<dyn Backend> = match crate::backend::cuda::CudaBackend::host_tier(ordinal)
        {
            Ok(b) => Arc::new(b),
            Err(e) => {
                tracing::info!(ordinal, reason = %e, "host tier: no VMM host memory, pinned (mlock'd) host memory instead");
                Arc::new(crate::backend::host::HostBackend::locked(
                    crate::backend::host::DEFAULT_GRANULARITY,
                )?)
            }
        };
        Self::new(backend, config)
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
        let inner = Arc::new_cyclic(|me| Inner {
            me: me.clone(),
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
            front_gate: Arc::new(FrontGate::new()),
            in_flight: AtomicU64::new(0),
            drivers,
            backend,
        });
        Ok(Pool {
            handle: Arc::new(Handle { inner }),
        })
    }

    /// Driver calls this pool made so far, all kinds together.
    pub(crate) fn driver_call_total(&self) -> u64 {
        self.inner().drivers.total()
    }

    /// What identifies this pool while it is open (the same for all its clones).
    pub(crate) fn identity(&self) -> usize {
        Arc::as_ptr(self.inner()) as usize
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
    /// The allocation is tagged [`Tag::Scratch`]; see [`Pool::allocate_with`].
    pub fn allocate(&self, bytes: usize) -> Result<Allocation> {
        self.inner().allocate(bytes, None, Tag::default())
    }

    /// As [`Pool::allocate`], with [`MemOptions`]: `tag`, `name` and `zeroed` apply, `chunk` is
    /// refused (the allocator chooses its chunks).
    pub fn allocate_with(&self, bytes: usize, opts: &MemOptions) -> Result<Allocation> {
        opts.refuse("Pool::allocate_with", &["chunk"])?;
        let tag = opts.tag_or(Tag::default());
        let mut a = self.inner().allocate(bytes, opts.name.clone(), tag)?;
        if opts.zeroed {
            a.fill(0)?;
        }
        Ok(a)
    }

    /// Back `[offset, offset + len)` of the reservation with physical memory (range API).
    /// Both must be multiples of the granularity; the range must be unmapped and used neither by
    /// the allocator nor by a [`Region`]. Physical chunks are at most the configured range chunk
    /// (default: one granule). The mapping is tagged [`Tag::Scratch`]; see [`Pool::map_with`].
    pub fn map(&self, offset: u64, len: u64) -> Result<()> {
        self.map_with(offset, len, &MemOptions::new())
    }

    /// As [`Pool::map`], with [`MemOptions`]: `tag` says what the range holds, `chunk` is the
    /// largest physical chunk ([`Pool::unmap`] must then cover whole chunks), `zeroed` fills the
    /// range with zeros (on failure nothing stays mapped); `name` is refused.
    pub fn map_with(&self, offset: u64, len: u64, opts: &MemOptions) -> Result<()> {
        let inner = self.inner();
        opts.refuse("Pool::map_with", &["name"])?;
        let chunk = opts.chunk_checked(inner.gran)?.unwrap_or(inner.range_chunk);
        let tag = opts.tag_or(Tag::default());
        inner.map_range(offset, len, chunk, Space::Pool, tag)?;
        if opts.zeroed {
            inner.zero_mapped(offset, len, Space::Pool)?;
        }
        Ok(())
    }

    /// Give back the physical memory under `[offset, offset + len)`, which must be mapped through
    /// the range API and made of whole chunks. Its chunks go to the cache.
    pub fn unmap(&self, offset: u64, len: u64) -> Result<()> {
        self.inner().unmap_range(offset, len, Space::Pool)
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
        self.inner().chunks_in(offset, len)
    }

    /// Bytes this pool could map now without reclaiming anything from anyone: its cached chunks
    /// plus what its admission (a physical limit, or a shared pool's model limit and budget)
    /// would charge at once; `None` where no admission limits it (the device's memory does).
    pub fn headroom(&self) -> Option<u64> {
        let inner = self.inner();
        let room = inner.admission.as_ref()?.room().0;
        Some(room.saturating_add(inner.state.lock().cache.bytes()))
    }

    /// Map memory ahead of need, so that at least `bytes` lie idle in one contiguous range
    /// (what is idle already counts): the next allocation of up to that size makes no driver
    /// call. For a host tier shared by the models of a process ([`Pool::host_tier`]) this is
    /// the one set-up, once per process instead of staging pinned per model: every sleep staged
    /// through the tier ([`Pool::stage_through`]) then takes its buffer from this memory and
    /// gives it back to it. On CUDA creating host memory costs about 0.2 s per GiB, spread
    /// over several threads ([`crate::backend::cuda::CudaBackend::create_threads`]): call it
    /// off the critical path (a background thread at start-up). Returns the bytes newly
    /// mapped. The memory is the pool's idle memory: charged under its limit, given back by
    /// [`Pool::trim`], or by a growth of the pool that needs the room (a tier at its budget
    /// gives idle memory back before refusing). Refused while the pool is not awake.
    pub fn prefill(&self, bytes: u64) -> Result<u64> {
        let inner = self.inner();
        if bytes == 0 {
            return Ok(0);
        }
        let len = usize::try_from(bytes).map_err(|_| crate::error::Error::SizeOverflow {
            what: "prefill",
            detail: format!("{bytes} bytes do not fit in usize"),
        })?;
        let footprint = inner.footprint(len)?;
        let before = {
            let mut st = inner.state.lock();
            st.sleep.refuse_unless_awake(&inner.name, "prefill")?;
            st.flush_quick();
            if st.idle.largest() >= footprint {
                return Ok(0);
            }
            st.mapped
        };
        // Allocated and freed at once: the memory stays mapped, idle.
        drop(self.allocate_with(len, &MemOptions::new().name("prefill"))?);
        let after = inner.state.lock().mapped;
        let made = after.saturating_sub(before);
        tracing::debug!(pool = %inner.name, bytes, made, "prefilled");
        Ok(made)
    }

    /// Give idle mapped memory and every cached chunk back to the driver.
    pub fn trim(&self) -> Result<TrimReport> {
        // Freed blocks front caches keep (routing's, for same-stream reuse) are idle too (waits
        // for the GPU to pass a fence on their streams).
        self.inner().flush_fronts();
        self.inner().trim(u64::MAX, TrimScope::IdleAndCache)
    }

    /// Release cached chunks only (keeping idle mapped memory for the hot path).
    pub fn release_cached(&self) -> Result<u64> {
        self.inner().release_cached(0)
    }

    /// A snapshot of the pool's counters. Blocks that threads freed and keep for their next
    /// allocation (their fronts) go back to the pool first, so a freed block is never counted
    /// in use; O(1) in the pool's size, O(threads that freed memory of it).
    pub fn stats(&self) -> PoolStats {
        self.inner().stats_flushed()
    }

    /// Live allocations, for reports.
    pub fn live_allocations(&self) -> Vec<LiveAllocation> {
        self.inner().flush_fronts_now();
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
    pub(crate) fn name(&self) -> &str {
        &self.name
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

    pub(super) fn stats_of(&self, st: &State) -> PoolStats {
        PoolStats {
            capacity: self.capacity,
            granularity: self.gran,
            mapped: st.mapped,
            in_use: st.in_use(),
            range_mapped: st.ranges.total(),
            reserved_regions: st.regions.total(),
            cached: st.cache.bytes(),
            in_flight: self.in_flight(),
            peak_in_use: st.peak_in_use,
            peak_physical: st.peak_physical,
            live_allocations: st.live.live(),
            allocations: st.allocations,
            frees: st.frees,
            mapped_chunks: st.chunks.len() as u64,
            cached_chunks: st.cache.len() as u64,
            driver_calls: self.drivers.snapshot(),
            asleep: st.sleep.asleep_bytes(),
            host_staging: st.sleep.staging_bytes,
            given_away: bytes_of(&st.given_away),
            peer_held: bytes_of(&st.peer_held),
            zero_page: st.zero.chunk.map_or(0, |c| c.size as u64),
            zero_alias_failed: st.zero.failed,
            zero_aliased: st.zero.aliased(),
        }
    }
}
