//! The mechanics of sleep and wake: claim, copy, unmap and release; obtain, map and copy back;
//! and the rollback of each step. See the parent module for the rules.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{AfterWake, HostStaging, SleepAction, SleepPolicy, SleepReport, SleepStatus};
use super::{Kept, SleepWatcher, Slot, Staging, WakeReport};
use crate::backend::PhysicalChunk;
use crate::error::{Error, Result};
use crate::pool::admission::{Fit, Urgency};
use crate::pool::mapper::{bytes_of, Placed};
use crate::pool::state::State;
use crate::pool::{Inner, TrimScope};
use crate::tag::Tag;

/// Copies are queued in pieces of up to this many bytes (whole chunks, at least one), each
/// followed by a marker, so that unmapping the chunks of one piece overlaps the copy of the
/// next; big enough that per-copy overheads vanish.
const PIECE: u64 = 256 << 20;

/// How long a sleep waits for operations under way (allocations, maps, copies) to finish
/// before it gives up; new ones are refused meanwhile.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);

/// A chunk claimed by a sleep: its slot and the chunk itself.
#[derive(Clone, Copy)]
struct Claimed {
    slot: Slot,
    chunk: PhysicalChunk,
}

/// Queued copies and their markers, in order; every marker is waited for exactly once.
struct Pieces {
    /// (offset of the piece's first byte in the reservation, marker)
    markers: Vec<(u64, u64)>,
    waited: usize,
}

impl Pieces {
    fn new() -> Self {
        Pieces {
            markers: Vec::new(),
            waited: 0,
        }
    }

    /// Wait for every piece that starts before `end` (so every piece holding a byte below it:
    /// pieces are queued in address order and never overlap).
    fn wait_through(&mut self, inner: &Inner, end: u64) -> Result<()> {
        while let Some(&(start, m)) = self.markers.get(self.waited) {
            if start >= end {
                break;
            }
            self.waited += 1;
            // SAFETY: a marker we recorded, waited for once (`waited` moves past it first).
            unsafe { inner.backend.copies().marker_wait(m) }?;
        }
        Ok(())
    }

    /// Wait for everything left, whatever fails; the first error comes back.
    fn drain(&mut self, inner: &Inner) -> Result<()> {
        let mut first = None;
        while let Some(&(_, m)) = self.markers.get(self.waited) {
            self.waited += 1;
            // SAFETY: as in `wait_through`.
            if let Err(e) = unsafe { inner.backend.copies().marker_wait(m) } {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// A failed sleep: why, and whether its rollback left the pool asleep (a chunk it could not map
/// back with access, see `restore_after_failed_sleep`) rather than awake as before.
struct Failed {
    error: Error,
    asleep: bool,
}

impl From<Error> for Failed {
    fn from(error: Error) -> Self {
        Failed {
            error,
            asleep: false,
        }
    }
}

/// A copy of contiguous chunks that continue each other in the reservation and in staging.
#[derive(Clone, Copy)]
struct Run {
    offset: u64,
    host: u64,
    len: u64,
}

impl Run {
    /// Extend by a chunk at `offset`/`host` of `len` bytes if it continues the run.
    fn extend(&mut self, offset: u64, host: u64, len: u64) -> bool {
        if self.offset + self.len == offset && self.host + self.len == host {
            self.len += len;
            true
        } else {
            false
        }
    }
}

impl Inner {
    fn sleep_refused(&self, op: &'static str, reason: String) -> Error {
        Error::SleepRefused {
            pool: self.name.to_string(),
            op,
            reason,
        }
    }

    fn set_status(&self, status: SleepStatus) {
        self.set_status_in(&mut self.state.lock(), status);
    }

    pub(crate) fn sleep(&self, policy: &SleepPolicy) -> Result<SleepReport> {
        let t0 = Instant::now();
        // Background work that needs the pool awake ends first (no lock held).
        let watchers = self.watchers();
        watchers.iter().for_each(|w| w.settle());
        drop(watchers);
        {
            let mut st = self.state.lock();
            if let Some(reason) = &st.refusing {
                return Err(self.refusal(reason));
            }
            if st.sleep.status != SleepStatus::Awake {
                let s = st.sleep.status.name();
                return Err(self.sleep_refused("sleep", format!("the pool is {s}")));
            }
            if st.sleep.thawing {
                return Err(self.sleep_refused(
                    "sleep",
                    "the pool is waking (its watchers are being thawed); retry when it is done"
                        .into(),
                ));
            }
            if st.sleep.staging_busy {
                return Err(self.sleep_refused(
                    "sleep",
                    "host staging is being reserved (Pool::reserve_host_staging); retry when it is done".into(),
                ));
            }
            // From here every new use is refused (front caches serve nothing either); those
            // under way are waited for below.
            self.set_status_in(&mut st, SleepStatus::FallingAsleep);
        }
        // What front caches hold is idle memory: back to the pool, given back by the trim
        // below rather than slept.
        self.flush_fronts();
        let result = self.drain_for_sleep().and_then(|()| {
            let watchers = self.watchers();
            let result = self.sleep_frozen(policy, &watchers, t0);
            drop(watchers);
            result
        });
        // A failed sleep leaves the pool awake: regions dropped meanwhile go now.
        self.end_regions_dropped_asleep();
        result
    }

    /// Wait (polling, no lock held between looks) until no allocation, map, unmap, trim or
    /// copy of the pool is under way; give up after [`DRAIN_LIMIT`] and go back to awake.
    fn drain_for_sleep(&self) -> Result<()> {
        let t0 = Instant::now();
        loop {
            {
                let mut st = self.state.lock();
                if st.growing == 0 && st.in_transit == 0 && st.pins.is_empty() {
                    return Ok(());
                }
                if t0.elapsed() >= DRAIN_LIMIT {
                    let (g, t, p) = (st.growing, st.in_transit, st.pins.len());
                    self.set_status_in(&mut st, SleepStatus::Awake);
                    return Err(self.sleep_refused("sleep", format!("after {} ms, {g} allocation(s) or map(s) are still under way, {t} bytes of address space in transit and {p} copies running", DRAIN_LIMIT.as_millis())));
                }
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Sleep with the phase held: freeze the watchers, then the rest; thaw and go back to
    /// awake on failure, unless the rollback left the pool asleep (then the watchers stay
    /// frozen and told of no mapping, as after a sleep, and the wake tells them).
    fn sleep_frozen(
        &self,
        policy: &SleepPolicy,
        watchers: &[Arc<dyn SleepWatcher>],
        t0: Instant,
    ) -> Result<SleepReport> {
        for (i, w) in watchers.iter().enumerate() {
            if let Err(e) = w.freeze() {
                watchers[..i].iter().for_each(|w| w.thaw());
                self.set_status(SleepStatus::Awake);
                return Err(e);
            }
        }
        self.sleep_claimed(policy, watchers, t0).map_err(|f| {
            if !f.asleep {
                watchers.iter().for_each(|w| w.thaw());
                self.set_status(SleepStatus::Awake);
            }
            f.error
        })
    }

    fn sleep_claimed(
        &self,
        policy: &SleepPolicy,
        watchers: &[Arc<dyn SleepWatcher>],
        t0: Instant,
    ) -> Result<SleepReport, Failed> {
        // Idle and cached memory goes first: nobody needs its contents.
        let trimmed = match self.trim(u64::MAX, TrimScope::IdleAndCache) {
            Ok(r) => r.released,
            Err(e) => {
                tracing::warn!(pool = %self.name, error = %e, "trim before sleep failed; what stayed mapped sleeps with the rest");
                0
            }
        };
        let (claimed, host_needed, staging) = {
            let mut st = self.state.lock();
            let claimed = self.claim_for_sleep(&mut st, policy);
            (claimed, st.sleep.staging_needed(), st.sleep.staging.take())
        };
        let mut staging = staging;
        if let Err(e) = self.staging_for(host_needed, &mut staging, policy.staging) {
            self.unclaim(&claimed, Vec::new(), staging);
            return Err(e.into());
        }
        let mut pieces = Pieces::new();
        if let Err(e) = self.queue_sleep_copies(&claimed, staging.as_ref(), &mut pieces) {
            let _ = pieces.drain(self);
            self.unclaim(&claimed, Vec::new(), staging);
            return Err(e.into());
        }
        // Copies run; the hooks let go of the mappings before the first unmap.
        watchers.iter().for_each(|w| w.unmapping_all());
        let mut gone: Vec<Placed> = Vec::with_capacity(claimed.len());
        let mut failure = None;
        for c in &claimed {
            let end = c.slot.offset + c.slot.size;
            if c.slot.host.is_some() {
                if let Err(e) = pieces.wait_through(self, end) {
                    failure = Some(e);
                    break;
                }
            }
            // SAFETY: the chunk was taken out of the mapping under the lock (nobody else maps,
            // unmaps or hands it out), the pool refuses every use while falling asleep, its
            // copy (if any) is done, and the watchers' hooks let go of it.
            let u = unsafe { self.unmap_placed(vec![(c.slot.offset, c.chunk)]) };
            if let Some(e) = u.error {
                failure = Some(e);
                break;
            }
            gone.extend(u.gone);
        }
        if let Some(error) = failure {
            let _ = pieces.drain(self);
            let asleep = self.restore_after_failed_sleep(&claimed, gone, staging, watchers);
            return Err(Failed { error, asleep });
        }
        if let Err(error) = pieces.drain(self) {
            // Every piece was waited for above; a late error still means a bad copy.
            let asleep = self.restore_after_failed_sleep(&claimed, gone, staging, watchers);
            return Err(Failed { error, asleep });
        }
        let chunks: Vec<PhysicalChunk> = claimed.iter().map(|c| c.chunk).collect();
        let total = bytes_of(&chunks);
        let (released, err) = self.release_chunks(chunks);
        if let Some(e) = err {
            tracing::warn!(pool = %self.name, error = %e, "releasing a slept chunk failed; it stays cached and charged until trim");
        }
        let offloaded: u64 = claimed
            .iter()
            .filter(|c| c.slot.host.is_some())
            .map(|c| c.slot.size)
            .sum();
        let duration = t0.elapsed();
        {
            let mut st = self.state.lock();
            st.sleep.staging = staging;
            st.sleep.offloaded = offloaded;
            self.set_status_in(&mut st, SleepStatus::Asleep);
            st.sleep.last_sleep = Some(duration);
            st.sleep.sleeps += 1;
        }
        let report = SleepReport {
            offloaded,
            discarded: total - offloaded,
            trimmed,
            released,
            kept_cached: total - released,
            chunks: claimed.len(),
            duration,
        };
        tracing::info!(pool = %self.name, offloaded, discarded = report.discarded, trimmed, ms = duration.as_secs_f64() * 1e3, "asleep");
        Ok(report)
    }

    /// Take every mapped chunk (stuck ones aside) out of the mapping as a slot, decide for
    /// each whether it is offloaded, and count what sleeps per tag. Under the pool's lock.
    fn claim_for_sleep(&self, st: &mut State, policy: &SleepPolicy) -> Vec<Claimed> {
        st.flush_quick();
        // What is in use, by tag, in address order: allocations, then mapped ranges.
        let mut pieces: Vec<(u64, u64, Tag)> = st
            .live
            .iter()
            .map(|r| (r.offset, r.offset + r.footprint, r.tag.clone()))
            .collect();
        for (s, e) in st.ranges.iter() {
            let mut at = s;
            for (ps, pe, t) in st.range_tags.overlapping(s, e) {
                if at < ps {
                    pieces.push((at, ps, Tag::default()));
                }
                pieces.push((ps, pe, t));
                at = pe;
            }
            if at < e {
                pieces.push((at, e, Tag::default()));
            }
        }
        pieces.sort_by_key(|p| p.0);
        let mut by_tag: BTreeMap<Tag, u64> = BTreeMap::new();
        for (s, e, t) in &pieces {
            *by_tag.entry(t.clone()).or_default() += e - s;
        }
        let stuck: Vec<(u64, u64)> = st.stuck.iter().collect();
        let chunks: Vec<(u64, PhysicalChunk)> = st
            .chunks
            .iter()
            .filter(|(&o, _)| !stuck.iter().any(|&(s, e)| s <= o && o < e))
            .map(|(&o, &c)| (o, c))
            .collect();
        let mut claimed = Vec::with_capacity(chunks.len());
        let mut host = 0u64;
        let mut first = 0usize;
        for (o, c) in chunks {
            let end = o + c.size as u64;
            while pieces.get(first).is_some_and(|p| p.1 <= o) {
                first += 1;
            }
            let offload = pieces[first..]
                .iter()
                .take_while(|p| p.0 < end)
                .any(|p| policy.action_for(&p.2) == SleepAction::Offload);
            let slot = Slot {
                offset: o,
                size: c.size as u64,
                host: offload.then_some(host),
                kept: None,
            };
            if offload {
                host += slot.size;
            }
            st.chunks.remove(&o);
            st.mapped -= slot.size;
            claimed.push(Claimed { slot, chunk: c });
        }
        let total: u64 = claimed.iter().map(|c| c.slot.size).sum();
        self.in_flight.fetch_add(total, Ordering::AcqRel);
        st.sleep.slots = claimed.iter().map(|c| c.slot).collect();
        st.sleep.asleep = total;
        st.sleep.by_tag = by_tag.into_iter().collect();
        claimed
    }

    /// Put claimed chunks back in the mapping (nothing was unmapped, or it was mapped back) and
    /// forget their slots. `asleep`: chunks that could not be mapped back, kept in their slots
    /// (still in flight); when there are any, the pool is asleep from here on, in the same
    /// critical section.
    fn unclaim(&self, claimed: &[Claimed], asleep: Vec<Slot>, staging: Option<Staging>) {
        let mut st = self.state.lock();
        for c in claimed {
            st.chunks.insert(c.slot.offset, c.chunk);
            st.mapped += c.slot.size;
        }
        let total: u64 = claimed.iter().map(|c| c.slot.size).sum();
        self.in_flight.fetch_sub(total, Ordering::AcqRel);
        st.sleep.asleep = asleep.iter().map(|s| s.size).sum();
        if !asleep.is_empty() {
            st.sleep.status = SleepStatus::Asleep;
        }
        st.sleep.slots = asleep;
        st.sleep.by_tag.clear();
        let old = std::mem::replace(&mut st.sleep.staging, staging);
        drop(st);
        // A buffer replaced meanwhile (never, while the phase is held) is freed unlocked.
        drop(old);
    }

    /// An unmap (or a copy) failed half way through a sleep: map back what was unmapped (the
    /// chunks were not released: their contents are intact). Returns whether the pool is left
    /// asleep.
    ///
    /// When every chunk is back with access, the pool is put back as it was (awake; the hooks
    /// hear of the mappings). A chunk that cannot be mapped back with access must never lie
    /// under an allocation or a range of an awake pool (a read through it would touch unmapped
    /// memory), so the pool stays *asleep* over it instead: the chunk is kept in its slot with
    /// its contents (still charged, in flight), everything else is mapped again as before, every
    /// use is refused as in any asleep pool, the hooks are not told of any mapping, and
    /// [`Inner::wake`] maps the kept chunk back like any asleep memory.
    fn restore_after_failed_sleep(
        &self,
        claimed: &[Claimed],
        gone: Vec<Placed>,
        staging: Option<Staging>,
        watchers: &[Arc<dyn SleepWatcher>],
    ) -> bool {
        // SAFETY: the ranges were unmapped by this sleep and are still claimed by it (the phase
        // refuses every other use); the chunks are ours.
        let back = unsafe { self.remap_each(gone) };
        let unmapped = back.unmapped.iter().map(|&p| (p, false));
        let lost: Vec<Slot> = unmapped
            .chain(back.stuck.iter().map(|&p| (p, true)))
            .map(|((offset, chunk), mapped)| Slot {
                offset,
                size: chunk.size as u64,
                host: None,
                kept: Some(Kept {
                    chunk,
                    mapped,
                    foreign: false,
                }),
            })
            .collect();
        let back_in: Vec<Claimed> = claimed
            .iter()
            .filter(|c| !lost.iter().any(|s| s.offset == c.slot.offset))
            .copied()
            .collect();
        if lost.is_empty() {
            self.unclaim(&back_in, Vec::new(), staging);
            for w in watchers {
                if let Err(e) = w.mapped_all() {
                    tracing::error!(pool = %self.name, error = %e, "a mapping hook refused the memory a failed sleep mapped back");
                }
            }
            return false;
        }
        tracing::error!(pool = %self.name, chunks = lost.len(), bytes = lost.iter().map(|s| s.size).sum::<u64>(), "a failed sleep could not map every chunk back with access; the pool stays asleep over them, their contents kept in them, until a wake maps them");
        self.unclaim(&back_in, lost, staging);
        true
    }

    /// Make `staging` at least `needed` bytes: keep it if big enough, else replace it when the
    /// policy allows; on refusal it is left as it was.
    fn staging_for(
        &self,
        needed: u64,
        staging: &mut Option<Staging>,
        mode: HostStaging,
    ) -> Result<()> {
        if needed == 0 || staging.as_ref().is_some_and(|s| s.bytes() >= needed) {
            return Ok(());
        }
        let have = staging.as_ref().map_or(0, Staging::bytes);
        if mode == HostStaging::Reserved {
            return Err(self.sleep_refused(
                "sleep",
                format!("{needed} bytes to offload, {have} bytes of host staging reserved (Pool::reserve_host_staging)"),
            ));
        }
        // The old buffer goes first (no lock held): both at once may not fit in host memory.
        drop(staging.take());
        self.state.lock().sleep.staging_bytes = 0;
        let t = Instant::now();
        let tier = self.state.lock().sleep.host_tier.clone();
        let made = Staging::new(&self.backend, needed, tier.as_ref());
        let ms = t.elapsed().as_secs_f64() * 1e3;
        tracing::warn!(pool = %self.name, bytes = needed, had = have, ms, "allocated host staging on the sleep path; reserve it ahead with Pool::reserve_host_staging");
        let s = made?;
        self.state.lock().sleep.staging_bytes = s.bytes();
        *staging = Some(s);
        Ok(())
    }

    /// Queue the copies of every offloaded chunk, in pieces, each followed by a marker.
    fn queue_sleep_copies(
        &self,
        claimed: &[Claimed],
        staging: Option<&Staging>,
        pieces: &mut Pieces,
    ) -> Result<()> {
        let mut run: Option<Run> = None;
        for c in claimed {
            let Some(h) = c.slot.host else { continue };
            if let Some(r) = &mut run {
                if r.len < PIECE && r.extend(c.slot.offset, h, c.slot.size) {
                    continue;
                }
                let r = *r;
                self.copy_out(r, staging, pieces)?;
            }
            run = Some(Run {
                offset: c.slot.offset,
                host: h,
                len: c.slot.size,
            });
        }
        if let Some(r) = run {
            self.copy_out(r, staging, pieces)?;
        }
        Ok(())
    }

    fn copy_out(&self, r: Run, staging: Option<&Staging>, pieces: &mut Pieces) -> Result<()> {
        let s = staging
            .ok_or_else(|| Error::InvalidArgument("offloading with no staging buffer".into()))?;
        // SAFETY: `[offset, offset + len)` is made of chunks this sleep claimed, mapped with
        // access until their unmap, which waits for the marker recorded below; the staging
        // range lies in the buffer (`at` checks) and only this sleep uses it.
        unsafe {
            self.backend.copies().copy_to_host_async(
                s.at(r.host, r.len),
                self.base + r.offset,
                r.len as usize,
                s.stream(),
            )?;
            let m = self.backend.copies().marker_record(s.stream())?;
            pieces.markers.push((r.offset, m));
        }
        Ok(())
    }

    pub(crate) fn wake(&self, after: AfterWake) -> Result<WakeReport> {
        let t0 = Instant::now();
        let (slots, staging) = {
            let mut st = self.state.lock();
            if let Some(reason) = &st.refusing {
                return Err(self.refusal(reason));
            }
            if st.sleep.status != SleepStatus::Asleep {
                let s = st.sleep.status.name();
                return Err(self.sleep_refused("wake", format!("the pool is {s}")));
            }
            self.set_status_in(&mut st, SleepStatus::Waking);
            (st.sleep.slots.clone(), st.sleep.staging.take())
        };
        let watchers = self.watchers();
        let result = self.wake_held(slots, staging, after, &watchers, t0);
        drop(watchers);
        self.end_regions_dropped_asleep();
        result
    }

    fn wake_held(
        &self,
        mut slots: Vec<Slot>,
        staging: Option<Staging>,
        after: AfterWake,
        watchers: &[Arc<dyn SleepWatcher>],
        t0: Instant,
    ) -> Result<WakeReport> {
        let asked: u64 = slots.iter().map(|s| s.size).sum();
        // 0. A kept chunk still mapped (perhaps without access) is unmapped, to map as any.
        for s in &mut slots {
            let Some(k) = s.kept.as_mut().filter(|k| k.mapped) else {
                continue;
            };
            // SAFETY: the chunk is mapped at its slot, claimed by this wake (the phase refuses
            // every other use) and used by nobody (the pool has been asleep over it).
            let u = unsafe { self.unmap_placed(vec![(s.offset, k.chunk)]) };
            if let Some(e) = u.error {
                self.back_to_sleep(staging);
                return Err(e);
            }
            k.mapped = false;
            set_kept_mapped(&mut self.state.lock(), s.offset, false);
        }
        let slots = slots;
        // 1. Physical memory for every slot, admitted as any growth (donation, reclaim); a kept
        // chunk is the pool's already.
        let mut got: Vec<Vec<PhysicalChunk>> = Vec::with_capacity(slots.len());
        // A slot whose data was dropped gets no copy over it: chunks whose bytes were someone
        // else's (another model's, or new where the backend promises no zeros) are cleared.
        let mut dirty: Vec<PhysicalChunk> = Vec::new();
        let zeroed_creates = self.backend.creates_zeroed();
        for s in &slots {
            if let Some(k) = s.kept {
                if k.foreign && s.host.is_none() {
                    dirty.push(k.chunk);
                }
                got.push(vec![k.chunk]);
                continue;
            }
            let fit = Fit {
                max_chunk: s.size,
                room: s.size,
            };
            match self.obtain(s.size, Urgency::Required, fit) {
                Ok(o) => {
                    if s.host.is_none() {
                        dirty.extend(&o.donated);
                        if !zeroed_creates {
                            dirty.extend(&o.created);
                        }
                    }
                    got.push(o.donated.into_iter().chain(o.created).collect())
                }
                Err(e) => {
                    let obtained = got
                        .into_iter()
                        .zip(&slots)
                        .filter(|(_, s)| s.kept.is_none());
                    let _ = self.release_chunks(obtained.flat_map(|(g, _)| g).collect());
                    self.back_to_sleep(staging);
                    let (free, limit) = self.room();
                    return Err(Error::WakeRefused {
                        pool: self.name.to_string(),
                        asked,
                        free,
                        limit,
                        reason: e.to_string(),
                    });
                }
            }
        }
        let to_fill = self.wipe_unmapped(dirty);
        // 2. Map slot by slot; copies are queued as runs fill up and overlap the next maps.
        let mut placed: Vec<Placed> = Vec::new();
        let mut pieces = Pieces::new();
        let mut failure: Option<(Error, Vec<Placed>)> = None;
        let mut unplaced: Vec<PhysicalChunk> = Vec::new();
        let mut run: Option<Run> = None;
        let mut restored = 0u64;
        let mut got = got.into_iter();
        for s in &slots {
            let chunks = got.next().unwrap_or_default();
            if failure.is_some() {
                unplaced.extend(chunks);
                continue;
            }
            // SAFETY: the slot's range is unmapped (its chunk was unmapped by the sleep) and
            // claimed by this wake (the phase refuses every other use); the chunks are ours.
            match unsafe { self.map_run(s.offset, &chunks) } {
                Ok(()) => {
                    let mut at = s.offset;
                    for c in chunks {
                        placed.push((at, c));
                        at += c.size as u64;
                    }
                }
                Err(f) => {
                    let stuck: Vec<PhysicalChunk> = f.stuck.iter().map(|(_, c)| *c).collect();
                    unplaced.extend(chunks.into_iter().filter(|c| !stuck.contains(c)));
                    failure = Some((f.error, f.stuck));
                    continue;
                }
            }
            let Some(h) = s.host else { continue };
            restored += s.size;
            let extended = run.as_mut().is_some_and(|r| r.extend(s.offset, h, s.size));
            if !extended {
                if let Some(r) = run.take() {
                    if let Err(e) = self.copy_in(r, staging.as_ref(), &mut pieces) {
                        failure = Some((e, Vec::new()));
                        continue;
                    }
                }
                run = Some(Run {
                    offset: s.offset,
                    host: h,
                    len: s.size,
                });
            }
            // A full piece goes to the GPU at once: its copy overlaps the next maps.
            if let Some(r) = run.take_if(|r| r.len >= PIECE) {
                if let Err(e) = self.copy_in(r, staging.as_ref(), &mut pieces) {
                    failure = Some((e, Vec::new()));
                }
            }
        }
        if failure.is_none() {
            if let Some(r) = run {
                if let Err(e) = self.copy_in(r, staging.as_ref(), &mut pieces) {
                    failure = Some((e, Vec::new()));
                }
            }
        }
        // Every queued copy is waited for, also on failure: nothing is unmapped under one.
        let waited = pieces.drain(self);
        if failure.is_none() {
            if let Err(e) = waited {
                failure = Some((e, Vec::new()));
            }
        }
        if failure.is_none() && !to_fill.is_empty() {
            if let Err(e) = self.fill_placed(&placed, &to_fill) {
                failure = Some((e, Vec::new()));
            }
        }
        if let Some((error, stuck)) = failure {
            self.undo_wake(placed, unplaced, &stuck, staging, &slots);
            return Err(error);
        }
        // 3. The chunks enter the books (hooks look them up), still under the waking phase;
        // the hooks hear of the mappings, and one refusing undoes the wake.
        let mapped = bytes_of(placed.iter().map(|(_, c)| c));
        {
            let mut st = self.state.lock();
            for &(o, c) in &placed {
                st.chunks.insert(o, c);
            }
            st.mapped += mapped;
            self.in_flight.fetch_sub(mapped, Ordering::AcqRel);
            st.sleep.slots.clear();
            st.sleep.asleep = 0;
        }
        for (i, w) in watchers.iter().enumerate() {
            if let Err(e) = w.mapped_all() {
                watchers[..i].iter().for_each(|w| w.unmapping_all());
                {
                    let mut st = self.state.lock();
                    for &(o, _) in &placed {
                        st.chunks.remove(&o);
                    }
                    st.mapped -= mapped;
                    self.in_flight.fetch_add(mapped, Ordering::AcqRel);
                    st.sleep.slots = slots.clone();
                    st.sleep.asleep = asked;
                }
                self.undo_wake(placed, unplaced, &[], staging, &slots);
                return Err(e);
            }
        }
        // 4. Commit.
        let chunks = placed.len();
        let duration = t0.elapsed();
        let freed = {
            let mut st = self.state.lock();
            st.sleep.by_tag.clear();
            st.sleep.offloaded = 0;
            self.set_status_in(&mut st, SleepStatus::Awake);
            st.sleep.thawing = true;
            st.sleep.last_wake = Some(duration);
            st.sleep.wakes += 1;
            st.note_peaks();
            match after {
                AfterWake::KeepHostMemory => {
                    st.sleep.staging = staging;
                    None
                }
                AfterWake::FreeHostMemory => {
                    st.sleep.staging_bytes = 0;
                    staging
                }
            }
        };
        drop(freed);
        watchers.iter().for_each(|w| w.thaw());
        self.state.lock().sleep.thawing = false;
        tracing::info!(pool = %self.name, mapped, restored, ms = duration.as_secs_f64() * 1e3, "awake");
        Ok(WakeReport {
            mapped,
            restored,
            chunks,
            duration,
        })
    }

    fn copy_in(&self, r: Run, staging: Option<&Staging>, pieces: &mut Pieces) -> Result<()> {
        let s = staging.ok_or_else(|| {
            Error::InvalidArgument("restoring offloaded memory with no staging buffer".into())
        })?;
        // SAFETY: `[offset, offset + len)` was just mapped with access by this wake and nobody
        // else can use it (the phase refuses every use); it stays mapped until the marker
        // recorded below is waited for (also on failure); the staging range lies in the buffer.
        unsafe {
            self.backend.copies().copy_from_host_async(
                self.base + r.offset,
                s.at(r.host, r.len),
                r.len as usize,
                s.stream(),
            )?;
            let m = self.backend.copies().marker_record(s.stream())?;
            pieces.markers.push((r.offset, m));
        }
        Ok(())
    }

    /// Undo a wake half way: unmap what it mapped, give every chunk back, stay asleep with the
    /// host copies. A chunk whose unmap fails stays in its slot as [`Kept`] (mapped, out of
    /// every use: the pool is asleep over it), and kept chunks of `slots` stay in their slots
    /// whatever happened to them (those of a failed sleep hold the contents).
    fn undo_wake(
        &self,
        placed: Vec<Placed>,
        mut unplaced: Vec<PhysicalChunk>,
        stuck: &[Placed],
        staging: Option<Staging>,
        slots: &[Slot],
    ) {
        let kept: Vec<PhysicalChunk> = slots
            .iter()
            .filter_map(|s| s.kept)
            .map(|k| k.chunk)
            .collect();
        // SAFETY: mapped by this wake, seen by nobody (the phase refuses every use, hooks were
        // told of nothing or told to let go), every copy onto them waited for.
        let u = unsafe { self.unmap_placed(placed) };
        unplaced.extend(u.gone.into_iter().map(|(_, c)| c));
        unplaced.retain(|c| !kept.contains(c));
        let mut all_stuck: Vec<Placed> = stuck.to_vec();
        all_stuck.extend(u.kept);
        if !all_stuck.is_empty() {
            // Not `stuck` (which trim releases, returning the range to the free space): these
            // lie under allocations and ranges that sleep, so they stay in their slots.
            tracing::error!(pool = %self.name, chunks = all_stuck.len(), "undoing a wake left chunks mapped; each stays in its slot, kept out of use, and the next wake unmaps it first");
            let mut st = self.state.lock();
            for p in all_stuck {
                keep_in_slot(&mut st, p);
            }
        }
        let _ = self.release_chunks(unplaced);
        self.back_to_sleep(staging);
    }

    fn back_to_sleep(&self, staging: Option<Staging>) {
        let mut st = self.state.lock();
        st.sleep.staging = staging;
        self.set_status_in(&mut st, SleepStatus::Asleep);
    }

    /// What admission would give now and under which limit, for a refusal's numbers.
    fn room(&self) -> (u64, u64) {
        match &self.admission {
            Some(a) => a.room(),
            None => self
                .backend
                .memory_info()
                .map_or((0, 0), |m| (m.free, m.total)),
        }
    }

    pub(crate) fn reserve_staging(&self, bytes: u64) -> Result<()> {
        let old = {
            let mut st = self.state.lock();
            if st.sleep.status != SleepStatus::Awake || st.sleep.staging_busy {
                let s = st.sleep.status.name();
                return Err(self.sleep_refused(
                    "reserve_host_staging",
                    format!("the pool is {s}, or another reservation is under way"),
                ));
            }
            if st
                .sleep
                .staging
                .as_ref()
                .is_some_and(|s| s.bytes() >= bytes)
            {
                return Ok(());
            }
            // Marked busy while the new buffer is made (pinning takes seconds): no sleep starts
            // meanwhile, but allocations and maps go on.
            st.sleep.staging_busy = true;
            st.sleep.staging_bytes = 0;
            (st.sleep.staging.take(), st.sleep.host_tier.clone())
        };
        let (old, tier) = old;
        drop(old);
        let made = Staging::new(&self.backend, bytes, tier.as_ref());
        let mut st = self.state.lock();
        st.sleep.staging_busy = false;
        let s = made?;
        st.sleep.staging_bytes = s.bytes();
        st.sleep.staging = Some(s);
        Ok(())
    }

    pub(crate) fn stage_through(&self, tier: Option<crate::Pool>) -> Result<()> {
        if let Some(t) = &tier {
            let (h, ours) = (t.backend_info(), self.backend.info());
            let reaches = h.memory_kind == crate::backend::MemoryKind::Host
                && h.page_locked
                && (h.device_ordinal.is_none() || h.device_ordinal == ours.device_ordinal);
            if !reaches {
                return Err(Error::InvalidArgument(format!(
                    "pool {} cannot stage through pool {}: {:?} memory of device {:?} ({}), not page-locked host memory that device {:?} reaches (Pool::host_tier)",
                    self.name,
                    t.name(),
                    h.memory_kind,
                    h.device_ordinal,
                    h.device_name,
                    ours.device_ordinal
                )));
            }
            if std::ptr::eq(&**t.inner(), self) {
                return Err(Error::InvalidArgument(format!(
                    "pool {} cannot stage through itself",
                    self.name
                )));
            }
        }
        let old = {
            let mut st = self.state.lock();
            if st.sleep.status != SleepStatus::Awake || st.sleep.staging_busy {
                let s = st.sleep.status.name();
                return Err(self.sleep_refused(
                    "stage_through",
                    format!("the pool is {s}, or a reservation is under way"),
                ));
            }
            st.sleep.staging_bytes = 0;
            // The old tier handle is dropped below, with no lock held (it may be the last).
            let old_tier = std::mem::replace(&mut st.sleep.host_tier, tier);
            (st.sleep.staging.take(), old_tier)
        };
        // Driver calls (or a region's unmap): no lock held.
        drop(old);
        Ok(())
    }

    pub(crate) fn release_staging(&self) -> Result<u64> {
        let old = {
            let mut st = self.state.lock();
            if st.sleep.status != SleepStatus::Awake || st.sleep.staging_busy {
                let s = st.sleep.status.name();
                return Err(self.sleep_refused(
                    "release_host_staging",
                    format!("the pool is {s}, or a reservation is under way"),
                ));
            }
            st.sleep.staging_bytes = 0;
            st.sleep.staging.take()
        };
        let bytes = old.as_ref().map_or(0, Staging::bytes);
        drop(old);
        Ok(bytes)
    }
}

/// Keep a chunk that a wake mapped at `offset` and could not unmap again in the slot it lies
/// in, as [`Kept`] and mapped: the slot is split around it (its host copy, if any, goes with
/// each part). It stays in flight, as it was.
fn keep_in_slot(st: &mut State, (offset, chunk): Placed) {
    let slots = &mut st.sleep.slots;
    let Some(i) = slots
        .iter()
        .position(|s| s.offset <= offset && offset < s.offset + s.size)
    else {
        tracing::error!(
            offset,
            "a chunk a wake could not unmap lies in no asleep slot"
        );
        return;
    };
    let s = slots[i];
    if let Some(k) = slots[i].kept.as_mut().filter(|k| k.chunk == chunk) {
        k.mapped = true;
        return;
    }
    let part = |from: u64, to: u64, kept: Option<Kept>| Slot {
        offset: from,
        size: to - from,
        host: s.host.map(|h| h + (from - s.offset)),
        kept,
    };
    let (end, slot_end) = (offset + chunk.size as u64, s.offset + s.size);
    let mut parts = Vec::with_capacity(3);
    if s.offset < offset {
        parts.push(part(s.offset, offset, None));
    }
    let mapped = Kept {
        chunk,
        mapped: true,
        foreign: true,
    };
    parts.push(part(offset, end, Some(mapped)));
    if end < slot_end {
        parts.push(part(end, slot_end, None));
    }
    slots.splice(i..=i, parts);
}

/// Record whether the kept chunk of the slot at `offset` is still mapped there.
fn set_kept_mapped(st: &mut State, offset: u64, mapped: bool) {
    let slot = st.sleep.slots.iter_mut().find(|s| s.offset == offset);
    if let Some(k) = slot.and_then(|s| s.kept.as_mut()) {
        k.mapped = mapped;
    }
}

impl super::SleepBook {
    /// Bytes of staging the current slots need.
    pub(crate) fn staging_needed(&self) -> u64 {
        self.slots
            .iter()
            .filter_map(|s| s.host.map(|h| h + s.size))
            .max()
            .unwrap_or(0)
    }
}
