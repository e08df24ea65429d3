//! Sleep and wake: a pool gives its physical memory back and gets it again at the **same
//! virtual addresses**, so every pointer, tensor and CUDA graph over it stays valid.
//!
//! - [`Pool::sleep`] gives back idle and cached memory, then, chunk by chunk, copies what the
//!   [`SleepPolicy`] says to keep (by [`Tag`]) into a host staging buffer ([`SleepAction::Offload`])
//!   or drops it ([`SleepAction::Discard`]), unmaps and releases the chunks. Their charge is
//!   credited at once (a model's memory is free for the others). Address space, allocations,
//!   ranges and regions keep their place in the books.
//! - [`Pool::wake`] asks admission for the bytes asleep (donation from idle models and reclaim
//!   run as for any growth), creates and maps chunks at the same addresses and copies the
//!   offloaded contents back.
//! - Both are all or nothing: a failure half way (no room, a driver error at any chunk, a hook
//!   error) undoes what was done; the pool is awake or asleep, never half, and host copies are
//!   never dropped before the device has them back. A failed sleep whose rollback cannot map a
//!   chunk back with access leaves the pool asleep (never awake over unmapped memory): that
//!   chunk is kept with its contents ([`Kept`]) and the wake maps it again.
//! - While asleep (or falling asleep, or waking) allocations, maps, unmaps, region copies and
//!   allocation copies are refused with [`crate::Error::Asleep`]; block pins of backings on the
//!   pool are refused too, and front caches (`front.rs`: routing's freed blocks) serve and keep
//!   nothing, their blocks given back as the sleep begins. Addresses stay reserved, so live
//!   allocations, views and tensors stay valid as values; a kernel that touches a sleeping
//!   pool's memory is the caller's bug (on CUDA it faults). The caller also makes sure no kernel
//!   still uses the memory when it calls `sleep` (synchronize the streams that use it): sleep
//!   copies on its own stream.
//!
//! Staging: one buffer per pool, allocated on the first sleep that needs it (or ahead with
//! [`Pool::reserve_host_staging`]: pinning costs about 0.6 s per GiB on CUDA and belongs off
//! the sleep path) and reused by every later sleep; [`AfterWake::FreeHostMemory`] frees it.
//! Through a host tier ([`Pool::stage_through`]) the buffer is an allocation of the tier
//! instead: freed, it stays mapped in the tier for the next pool's sleep, and
//! [`Pool::prefill`] readies the tier once for every pool of the process.
//! A physical chunk holding any byte to offload is copied whole; copies go out in runs of
//! contiguous chunks of up to 256 MiB on one stream, each followed by a marker that the unmap
//! of its chunks waits for (so unmapping overlaps the next copies).
//!
//! Lock order: the pool's state, then nothing; a backing's lock is taken (by its watcher) with
//! no pool lock held. The phase (`FallingAsleep`, `Waking`) is what makes one sleep or wake
//! exclusive; no lock is held across a driver call, a copy, a hook or a watcher.

mod run;
mod staging;
#[cfg(test)]
mod tests;

use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::backend::PhysicalChunk;
use crate::error::{Error, Result};
use crate::tag::Tag;

use super::Pool;
pub(crate) use staging::Staging;

/// What a sleep does with memory of one tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SleepAction {
    /// Copy the contents to host memory, then release the physical memory; wake copies them back.
    Offload,
    /// Release the physical memory; the contents are lost (a KV cache the engine rebuilds).
    Discard,
}

/// Where a sleep's host copies go when the staging buffer is too small (or not there yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostStaging {
    /// Allocate a larger buffer on the sleep path (logged: pinning is slow on CUDA).
    Grow,
    /// Use only what [`Pool::reserve_host_staging`] set aside; refuse the sleep otherwise.
    Reserved,
}

/// What happens to the host copies after a wake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterWake {
    /// Keep the staging buffer for the next sleep (no pinning then).
    KeepHostMemory,
    /// Free the staging buffer.
    FreeHostMemory,
}

/// What a sleep keeps, by tag. Memory of a tag not named goes by the default action.
#[derive(Debug, Clone)]
pub struct SleepPolicy {
    default: SleepAction,
    tags: Vec<(Tag, SleepAction)>,
    staging: HostStaging,
}

impl SleepPolicy {
    /// Offload everything (the default for tags not named otherwise).
    pub fn offload_all() -> Self {
        SleepPolicy {
            default: SleepAction::Offload,
            tags: Vec::new(),
            staging: HostStaging::Grow,
        }
    }

    /// Discard everything.
    pub fn discard_all() -> Self {
        SleepPolicy {
            default: SleepAction::Discard,
            ..Self::offload_all()
        }
    }

    /// Memory tagged `tag` gets `action`.
    pub fn tag(mut self, tag: Tag, action: SleepAction) -> Self {
        self.tags.retain(|(t, _)| *t != tag);
        self.tags.push((tag, action));
        self
    }

    /// What memory of tags not named gets.
    pub fn otherwise(mut self, action: SleepAction) -> Self {
        self.default = action;
        self
    }

    /// Where host copies go when the staging buffer is too small (default [`HostStaging::Grow`]).
    pub fn staging(mut self, staging: HostStaging) -> Self {
        self.staging = staging;
        self
    }

    /// The action for memory tagged `tag`.
    pub fn action_for(&self, tag: &Tag) -> SleepAction {
        self.tags
            .iter()
            .find(|(t, _)| t == tag)
            .map_or(self.default, |(_, a)| *a)
    }
}

impl Default for SleepPolicy {
    fn default() -> Self {
        Self::offload_all()
    }
}

/// Where a pool stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SleepStatus {
    /// Memory mapped; everything works.
    #[default]
    Awake,
    /// A sleep is under way.
    FallingAsleep,
    /// Physical memory given back; addresses kept.
    Asleep,
    /// A wake is under way.
    Waking,
}

impl SleepStatus {
    /// Lowercase words, for messages.
    pub fn name(self) -> &'static str {
        match self {
            SleepStatus::Awake => "awake",
            SleepStatus::FallingAsleep => "falling asleep",
            SleepStatus::Asleep => "asleep",
            SleepStatus::Waking => "waking",
        }
    }
}

/// What one [`Pool::sleep`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SleepReport {
    /// Bytes copied to host memory (whole chunks).
    pub offloaded: u64,
    /// Bytes of chunks dropped without a copy.
    pub discarded: u64,
    /// Bytes of idle and cached memory given back first.
    pub trimmed: u64,
    /// Bytes released to the driver by the sleep itself (offloaded + discarded, less failures).
    pub released: u64,
    /// Bytes whose release failed: kept in the pool's cache (still charged), retried by trim.
    pub kept_cached: u64,
    /// Chunks put to sleep.
    pub chunks: usize,
    /// Wall time.
    pub duration: Duration,
}

/// What one [`Pool::wake`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WakeReport {
    /// Bytes mapped again.
    pub mapped: u64,
    /// Bytes copied back from host memory.
    pub restored: u64,
    /// Chunks mapped (donated chunks may split a slept chunk in several).
    pub chunks: usize,
    /// Wall time.
    pub duration: Duration,
}

/// Sleep-related numbers of a pool ([`Pool::sleep_stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SleepStats {
    /// Where the pool stands.
    pub status: SleepStatus,
    /// Bytes of address space whose physical memory sleeps (whole chunks).
    pub asleep_bytes: u64,
    /// Of the memory in use when the pool fell asleep, bytes per tag (allocation footprints and
    /// mapped ranges).
    pub asleep_by_tag: Vec<(Tag, u64)>,
    /// Bytes of host copies waiting for a wake.
    pub offloaded_bytes: u64,
    /// Bytes of host staging memory held (allocated once, reused).
    pub host_bytes: u64,
    /// Wall time of the last sleep.
    pub last_sleep: Option<Duration>,
    /// Wall time of the last wake.
    pub last_wake: Option<Duration>,
    /// Sleeps completed.
    pub sleeps: u64,
    /// Wakes completed.
    pub wakes: u64,
}

/// A component holding memory of the pool that must hear of sleep and wake (a block backing:
/// its pins and its mapping hook). Called with no pool lock held.
pub(crate) trait SleepWatcher: Send + Sync {
    /// The pool is about to start falling asleep (nothing refused yet): finish background work
    /// that needs the pool awake (a KV compaction's give-back unmaps). Bounded; no lock held.
    fn settle(&self) {}
    /// Refuse (memory in use, e.g. pinned blocks) or stop handing out new uses until `thaw`.
    fn freeze(&self) -> Result<()>;
    /// Hand out uses again.
    fn thaw(&self);
    /// Every mapping is about to go (tell the mapping hook).
    fn unmapping_all(&self);
    /// Every mapping is back (tell the mapping hook); an error undoes the wake.
    fn mapped_all(&self) -> Result<()>;
}

/// A chunk's place while its pool sleeps: where it was mapped, how big, and where its copy is
/// in the staging buffer when offloaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    pub(crate) offset: u64,
    pub(crate) size: u64,
    pub(crate) host: Option<u64>,
    /// The chunk itself, when a failed sleep could not map it back (see [`Kept`]).
    pub(crate) kept: Option<Kept>,
}

/// A chunk an asleep slot keeps: one that a failed sleep unmapped and could not map back with
/// access (it holds the contents; the slot has no host copy), or one that a failed wake mapped
/// and could not unmap (the contents are in the slot's host copy, if any). It stays the pool's
/// (charged, counted in flight) and the pool asleep over it, so nothing reads or writes
/// through its addresses; a wake maps it again instead of obtaining new memory (copying the
/// host copy back as for any slot); teardown releases it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Kept {
    pub(crate) chunk: PhysicalChunk,
    /// Still mapped at its slot, perhaps without access (the rollback of a failed access grant
    /// could not unmap it): a wake unmaps it first.
    pub(crate) mapped: bool,
    /// Not the slot's own memory (a failed wake's rollback kept a chunk it had taken, perhaps
    /// another model's, perhaps not cleared yet): cleared by the wake that maps it where the
    /// slot's content was dropped.
    pub(crate) foreign: bool,
}

/// The sleep part of a pool's state (under the pool's lock).
#[derive(Debug, Default)]
pub(crate) struct SleepBook {
    pub(crate) status: SleepStatus,
    /// Chunks asleep (from the moment a sleep claims them until a wake maps them again).
    pub(crate) slots: Vec<Slot>,
    pub(crate) asleep: u64,
    pub(crate) by_tag: Vec<(Tag, u64)>,
    pub(crate) offloaded: u64,
    /// The staging buffer; `None` while none is allocated or while a sleep or wake holds it.
    pub(crate) staging: Option<Staging>,
    /// Its size, also while an operation holds it.
    pub(crate) staging_bytes: u64,
    /// A [`Pool::reserve_host_staging`] is making a buffer (with no lock held): sleeps wait.
    pub(crate) staging_busy: bool,
    /// A wake has marked the pool awake and is thawing its watchers (with no lock held): a
    /// sleep now would freeze them and then see that thaw undo its freeze, so sleeps are
    /// refused until it is done, as while waking.
    pub(crate) thawing: bool,
    /// The host tier staging buffers come from ([`Pool::stage_through`]); `None`: the
    /// backend's own staging memory.
    pub(crate) host_tier: Option<Pool>,
    pub(crate) last_sleep: Option<Duration>,
    pub(crate) last_wake: Option<Duration>,
    pub(crate) sleeps: u64,
    pub(crate) wakes: u64,
    pub(crate) watchers: Vec<(u64, Weak<dyn SleepWatcher>)>,
    pub(crate) next_watcher: u64,
    /// Regions dropped while the pool was not awake, as `(offset, len, zeroed)`: nothing can be
    /// unmapped then, so each keeps its span (its memory sleeping with the rest) until the pool
    /// is awake again and [`super::Inner::end_regions_dropped_asleep`] gives it back.
    pub(crate) dropped_regions: Vec<(u64, u64, bool)>,
}

impl SleepBook {
    pub(crate) fn asleep_bytes(&self) -> u64 {
        self.asleep
    }

    /// Whether trim and hand-over may take idle mapped chunks now: not while a wake holds the
    /// chunks it mapped (its rollback unmaps exactly those).
    pub(crate) fn idle_chunks_movable(&self) -> bool {
        self.status != SleepStatus::Waking
    }

    /// `Ok` when awake, else the [`Error::Asleep`] refusing `op`.
    pub(crate) fn refuse_unless_awake(&self, pool: &str, op: &'static str) -> Result<()> {
        match self.status {
            SleepStatus::Awake => Ok(()),
            s => Err(Error::Asleep {
                pool: pool.to_string(),
                op,
                state: s.name(),
            }),
        }
    }

    pub(crate) fn stats(&self) -> SleepStats {
        SleepStats {
            status: self.status,
            asleep_bytes: self.asleep,
            asleep_by_tag: self.by_tag.clone(),
            offloaded_bytes: self.offloaded,
            host_bytes: self.staging_bytes,
            last_sleep: self.last_sleep,
            last_wake: self.last_wake,
            sleeps: self.sleeps,
            wakes: self.wakes,
        }
    }

    /// Asleep chunks add up and no mapped chunk lies on one.
    pub(crate) fn audit(
        &self,
        chunks: &std::collections::BTreeMap<u64, PhysicalChunk>,
    ) -> Result<(), String> {
        let sum: u64 = self.slots.iter().map(|s| s.size).sum();
        if sum != self.asleep {
            return Err(format!(
                "asleep chunks sum to {sum}, counter says {}",
                self.asleep
            ));
        }
        for s in &self.slots {
            let end = s.offset + s.size;
            let before = chunks.range(..end).next_back();
            if let Some((&o, c)) = before {
                if o + c.size as u64 > s.offset {
                    return Err(format!(
                        "mapped chunk at {o:#x} lies on the asleep chunk at {:#x}",
                        s.offset
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Pool {
    /// Put the pool to sleep: give back idle and cached memory, copy to host what `policy`
    /// offloads, unmap and release every chunk; addresses stay reserved; the charge is
    /// credited. All or nothing (README, "Sleep and wake"). Operations under way are waited
    /// for (up to 5 s) while new ones are refused. Refused, nothing changed, when the pool is
    /// not awake, while a block of a backing on the pool is pinned, or while a
    /// `RegisteredLayout` holds NIXL registrations of its memory. The caller makes sure no
    /// kernel still uses the memory. On a driver error the pool is awake as before, unless a
    /// chunk could not even be mapped back: then it is asleep ([`Pool::is_asleep`]) and
    /// [`Pool::wake`] maps that chunk back with its contents.
    pub fn sleep(&self, policy: &SleepPolicy) -> Result<SleepReport> {
        self.inner().sleep(policy)
    }

    /// Wake the pool: admission for the bytes asleep (as for any growth), chunks mapped at the
    /// same addresses, offloaded contents copied back. Without room: [`Error::WakeRefused`]
    /// with the numbers, and the pool stays asleep with its host copies.
    pub fn wake(&self, after: AfterWake) -> Result<WakeReport> {
        self.inner().wake(after)
    }

    /// Allocate (pin, on CUDA) `bytes` of host staging memory now, off the sleep path, for
    /// later sleeps to reuse. Replaces a smaller buffer; keeps a larger one. Allocations and
    /// maps go on meanwhile (call it from a background thread: pinning takes about 0.6 s per
    /// GiB on CUDA); a sleep is refused until it is done. Refused while the pool is not awake
    /// (its copies live in the buffer).
    pub fn reserve_host_staging(&self, bytes: u64) -> Result<()> {
        self.inner().reserve_staging(bytes)
    }

    /// Stage sleeps through `tier`, an elastic host tier ([`Pool::host_tier`]), instead of a
    /// staging buffer of this pool's own (`None`: back to the backend's staging memory). The
    /// buffer becomes an allocation of the tier, taken when a sleep (or
    /// [`Pool::reserve_host_staging`]) needs it, under the tier's budget: no pinning per pool.
    /// Host memory a pool gives back ([`AfterWake::FreeHostMemory`]) stays mapped in the tier
    /// as idle memory and serves the next sleep of any pool sharing it with no driver call
    /// (make the tier ready once per process with [`Pool::prefill`]; a tier at its budget gives
    /// idle memory back when something else needs the room). While such a buffer lives (from the first sleep or
    /// reservation until [`Pool::release_host_staging`], [`AfterWake::FreeHostMemory`] or
    /// `stage_through(None)`), a sleep of the tier itself is refused: it would unmap the buffer
    /// under this pool. Any staging buffer held now is freed. Refused while
    /// the pool is not awake, for a tier that is not page-locked host memory this pool's
    /// device reaches, and for the pool itself.
    pub fn stage_through(&self, tier: Option<Pool>) -> Result<()> {
        self.inner().stage_through(tier)
    }

    /// Free the host staging memory of an awake pool; returns the bytes freed.
    pub fn release_host_staging(&self) -> Result<u64> {
        self.inner().release_staging()
    }

    /// Where the pool stands with sleep, and the numbers of the last sleep and wake.
    pub fn sleep_stats(&self) -> SleepStats {
        self.inner().state.lock().sleep.stats()
    }

    /// Whether the pool is asleep (a sleep completed and no wake has yet).
    pub fn is_asleep(&self) -> bool {
        self.inner().state.lock().sleep.status == SleepStatus::Asleep
    }
}

impl super::Inner {
    /// Change the sleep status (under the pool's lock): front caches keep and serve blocks only
    /// while it is `Awake`.
    fn set_status_in(&self, st: &mut super::state::State, status: SleepStatus) {
        st.sleep.status = status;
        self.front_gate.follow(status);
    }

    /// Register a watcher; returns its id for [`super::Inner::remove_watcher`].
    pub(crate) fn add_watcher(&self, w: Weak<dyn SleepWatcher>) -> u64 {
        let mut st = self.state.lock();
        let id = st.sleep.next_watcher;
        st.sleep.next_watcher += 1;
        st.sleep.watchers.push((id, w));
        id
    }

    pub(crate) fn remove_watcher(&self, id: u64) {
        self.state.lock().sleep.watchers.retain(|(i, _)| *i != id);
    }

    /// The live watchers (strong references: dropped by the caller with no lock held).
    fn watchers(&self) -> Vec<Arc<dyn SleepWatcher>> {
        let st = self.state.lock();
        st.sleep
            .watchers
            .iter()
            .filter_map(|(_, w)| w.upgrade())
            .collect()
    }
}
