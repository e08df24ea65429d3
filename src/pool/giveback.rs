//! Giving memory back: trim, reclaim for limit changes, hand-over to other models, closing the
//! pool and its teardown. All of it goes through the mapper's unmap and the sources' release.

use std::cmp::Reverse;
use std::sync::atomic::Ordering;

use super::mapper::{bytes_of, Placed};
use super::ranges::Space;
use super::{Inner, TrimReport};
use crate::backend::{DriverCall, PhysicalChunk};
use crate::error::{Error, Result};

/// What a trim gives back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TrimScope {
    /// Idle mapped chunks only (the cache is left alone).
    IdleOnly,
    /// Idle mapped chunks and every cached chunk.
    IdleAndCache,
}

impl Inner {
    /// Put chunks whose unmap failed back where they were: idle (`stuck == false`) or stuck.
    fn put_back_mapped(&self, kept: &[Placed], as_stuck: &[Placed]) {
        let mut st = self.state.lock();
        for &(o, c) in kept {
            let size = c.size as u64;
            st.chunks.insert(o, c);
            st.mapped += size;
            st.in_transit -= size;
            st.idle.insert(o, o + size);
        }
        for &(_, c) in as_stuck {
            st.in_transit -= c.size as u64;
        }
        st.put_stuck(as_stuck);
        let settled = kept.iter().chain(as_stuck).map(|(_, c)| c);
        self.in_flight
            .fetch_sub(bytes_of(settled), Ordering::AcqRel);
    }

    /// Unmap up to `limit` bytes of idle chunks (and every stuck one) and release them; with
    /// [`TrimScope::IdleAndCache`], release the whole cache too.
    pub(crate) fn trim(&self, limit: u64, scope: TrimScope) -> Result<TrimReport> {
        let (idle, stuck, cached) = {
            let mut st = self.state.lock();
            let idle = st.take_idle_chunks(limit);
            let stuck = st.take_stuck_chunks();
            let cached = match scope {
                TrimScope::IdleAndCache => st.cache.drain(),
                TrimScope::IdleOnly => Vec::new(),
            };
            let moving = bytes_of(idle.iter().chain(&stuck).map(|(_, c)| c)) + bytes_of(&cached);
            self.in_flight.fetch_add(moving, Ordering::AcqRel);
            (idle, stuck, cached)
        };
        // SAFETY: these chunks lay wholly in idle memory (or were stuck: never handed out), now
        // claimed: nothing uses them.
        let idle_out = unsafe { self.unmap_placed(idle) };
        // SAFETY: as above.
        let stuck_out = unsafe { self.unmap_placed(stuck) };
        self.put_back_mapped(&idle_out.kept, &stuck_out.kept);
        let gone: Vec<Placed> = idle_out.gone.into_iter().chain(stuck_out.gone).collect();
        let unmapped = bytes_of(gone.iter().map(|(_, c)| c));
        {
            let mut st = self.state.lock();
            for &(o, c) in &gone {
                let e = o + c.size as u64;
                st.in_transit -= c.size as u64;
                st.unmapped_home(o, e).insert(o, e);
            }
        }
        let mut first_err = idle_out.error.or(stuck_out.error);
        let mut release: Vec<PhysicalChunk> = cached;
        release.extend(gone.into_iter().map(|(_, c)| c));
        let (released, err) = self.release_chunks(release);
        if let Some(e) = err {
            first_err.get_or_insert(e);
        }
        if unmapped > 0 || released > 0 {
            tracing::debug!(pool = %self.name, unmapped, released, "trimmed");
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(TrimReport { unmapped, released }),
        }
    }

    /// Give back up to `want` bytes of memory nobody uses: cached chunks first, then idle
    /// chunks. Returns the bytes released.
    pub(crate) fn reclaim(&self, want: u64) -> Result<u64> {
        let keep = self.state.lock().cache.bytes().saturating_sub(want);
        let mut released = self.release_cached(keep)?;
        if released < want {
            released += self.trim(want - released, TrimScope::IdleOnly)?.released;
        }
        if released > 0 {
            tracing::debug!(pool = %self.name, want, released, "reclaimed");
        }
        Ok(released)
    }

    /// Hand idle physical memory over to another pool without releasing it: cached chunks, then
    /// idle mapped chunks (unmapped here), largest first, each at most `max_size` bytes, until
    /// `want` bytes are taken and never more than `cap` bytes. The chunks come back in flight
    /// (still charged to this pool): the caller moves their charge and in-flight count to the
    /// recipient, or gives them back with [`Inner::release_chunks`].
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
            if got < want && st.sleep.idle_chunks_movable() {
                st.flush_quick();
                let mut candidates: Vec<Placed> = st
                    .chunks
                    .iter()
                    .filter(|(&o, c)| {
                        c.size as u64 <= max_size
                            && st.idle.intervals().covers(o, o + c.size as u64)
                    })
                    .map(|(&o, &c)| (o, c))
                    .collect();
                candidates.sort_by_key(|(o, c)| (Reverse(c.size), *o));
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
            let moving = bytes_of(&out) + bytes_of(idle.iter().map(|(_, c)| c));
            self.in_flight.fetch_add(moving, Ordering::AcqRel);
            (out, idle)
        };
        // SAFETY: the chunks lay wholly in idle memory and are claimed: nobody uses them.
        let u = unsafe { self.unmap_placed(idle) };
        if let Some(e) = &u.error {
            tracing::warn!(pool = %self.name, error = %e, "unmapping a chunk to hand over failed; it stays");
        }
        self.put_back_mapped(&u.kept, &[]);
        {
            let mut st = self.state.lock();
            for &(o, c) in &u.gone {
                st.in_transit -= c.size as u64;
                st.cold.insert(o, o + c.size as u64);
            }
        }
        out.extend(u.gone.into_iter().map(|(_, c)| c));
        out
    }

    /// `bytes` of in-flight chunks left this pool for another (their charge moved with them);
    /// called inside the ledger's critical section that moved the charge.
    pub(crate) fn hand_off(&self, bytes: u64) {
        self.in_flight.fetch_sub(bytes, Ordering::AcqRel);
    }

    pub(super) fn refusal(&self, reason: &str) -> Error {
        Error::PoolClosed {
            pool: self.name.to_string(),
            reason: reason.to_string(),
        }
    }

    /// Take no new memory from now on, if nothing is in use; else say what is.
    pub(crate) fn close_if_unused(&self, reason: &str) -> Result<()> {
        let mut st = self.state.lock();
        // Memory only passing through (trim, hand-over) does not keep a model busy; a growth
        // in progress would end in an allocation or a mapped range.
        if st.live.live() > 0 || st.ranges.total() > 0 || st.growing > 0 {
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

    /// The last pool handle is gone (no region is left either: each holds a handle): give back
    /// everything no allocation holds, report leaks.
    pub(super) fn close(&self) {
        // Front caches keep nothing from now on and give back what they hold (idle now, given
        // back by the trim below).
        self.front_gate.close();
        self.close_fronts();
        let (spans, live, live_bytes, names, unused) = {
            let mut st = self.state.lock();
            st.closed = true;
            // No allocation live: nothing needs the pool past its handles (dropped after the
            // trim below; the closing handle still holds the pool).
            let unused = st.take_unused_keep_alive();
            let mut spans: Vec<(u64, u64)> = Vec::new();
            for (s, e) in st.ranges.iter() {
                spans.extend(st.chunks.range(s..e).map(|(&o, c)| (o, c.size as u64)));
            }
            let names: Vec<String> = st
                .live
                .iter()
                .filter_map(|r| r.name.as_deref().map(str::to_owned))
                .take(16)
                .collect();
            (spans, st.live.live(), st.alloc_bytes, names, unused)
        };
        // Range mappings belong to the pool alone now: give them back chunk by chunk.
        for (o, size) in spans {
            let space = if self.state.lock().regions.covers(o, o + size) {
                Space::Region
            } else {
                Space::Pool
            };
            if let Err(e) = self.unmap_range(o, size, space) {
                tracing::error!(pool = %self.name, error = %e, "unmapping a range at pool drop failed");
            }
        }
        if let Err(e) = self.trim(u64::MAX, TrimScope::IdleAndCache) {
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
        drop(unused);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // No allocation and no handle is left: everything can go.
        let (mapped, cached, kept) = {
            let st = self.state.get_mut();
            st.flush_quick();
            // Chunks a failed sleep kept asleep are counted in flight already.
            let kept: Vec<(Placed, bool)> = std::mem::take(&mut st.sleep.slots)
                .into_iter()
                .filter_map(|s| s.kept.map(|k| ((s.offset, k.chunk), k.mapped)))
                .collect();
            st.sleep.asleep = 0;
            let mapped: Vec<Placed> = std::mem::take(&mut st.chunks).into_iter().collect();
            let mut cached = st.cache.drain();
            cached.append(&mut st.given_away);
            cached.append(&mut st.peer_held);
            st.peer_held_apart.clear();
            let bytes = bytes_of(mapped.iter().map(|(_, c)| c));
            st.mapped -= bytes;
            self.in_flight
                .fetch_add(bytes + bytes_of(&cached), Ordering::AcqRel);
            (mapped, cached, kept)
        };
        let zero = self.take_zero();
        let (kept_mapped, kept_unmapped): (Vec<_>, Vec<_>) = kept.into_iter().partition(|k| k.1);
        let mapped = mapped
            .into_iter()
            .chain(kept_mapped.into_iter().map(|(p, _)| p));
        // SAFETY: no allocation, handle or range user is left; the chunks are ours and mapped.
        let out = unsafe { self.unmap_placed(mapped.collect()) };
        let still_mapped = bytes_of(out.kept.iter().map(|(_, c)| c));
        let release: Vec<PhysicalChunk> = out
            .gone
            .into_iter()
            .map(|(_, c)| c)
            .chain(cached)
            .chain(kept_unmapped.into_iter().map(|((_, c), _)| c))
            .chain(zero)
            .collect();
        if let Some(keeper) = super::keeper::active() {
            // Released whatever peers keep imported (nothing is left to charge them to): they
            // are told to forget them, and the keeper forgets the handles first, so one the
            // driver reuses is exported with a descriptor again.
            if let Some(later) = keeper.purge(&self.backend, &release) {
                later();
            }
        }
        let (_, err) = self.release_chunks(release);
        // What could not be unmapped or released stays charged to whoever admitted it (the
        // shared ledger keeps it counted against the budget when the model's line goes).
        let st = self.state.get_mut();
        let left = still_mapped + st.cache.bytes() + bytes_of(&st.given_away);
        if let Some(e) = err {
            tracing::error!(pool = %self.name, error = %e, "release at pool teardown failed");
        }
        if left > 0 {
            tracing::error!(pool = %self.name, bytes = left, "physical memory could not be given back at teardown; it stays leaked and counted");
            return;
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
