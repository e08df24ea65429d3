//! The zero page: one physical granule of zeros per pool, mapped read-only under every unbacked
//! granule of a zero-filled [`crate::Region`] ([`crate::MemOptions::zeroed`] at [`crate::Pool::reserve_region_with`]).
//!
//! A kernel that reads a page nobody backed then reads zeros instead of faulting (and poisoning
//! a CUDA context); a write through such a page faults (host: `SIGSEGV`; CUDA: an illegal
//! address error). The aliases are not memory: in the books their ranges stay unmapped (in
//! `held`), this module keeps which of them are aliased (`ZeroBook`), and sleep, trim, stats
//! and limits see only the chunks. The zero chunk itself is the pool's memory like any chunk:
//! made on the first zero-filled region from the pool's cache or through admission (so charged
//! to the pool's limit or its model's ledger line, like every chunk a broker creates), shown in
//! [`crate::PoolStats::zero_page`] and counted in [`crate::PoolStats::physical`], and released
//! (credited) when the last zero-filled region goes, or at the pool's teardown. A sleep leaves
//! it in place: a sleeping pool with a zero-filled region holds one granule.
//!
//! Mapping a range over aliases ([`Inner::map_batch`]) puts its chunks in place of them in one
//! step where the backend can ([`crate::backend::Backend::maps_over`], the host backend), and
//! unmapping a range of a zero-filled region puts the zero page in place of its chunks
//! ([`Inner::unmap_to_zero`]): a read of a neighbouring unallocated block never finds a hole.
//! Elsewhere (CUDA) the aliases are unmapped first, after the new chunks are in hand, and put
//! back after the unmap: a read racing them may fault.
//!
//! Clearing: chunks mapped over aliases serve bytes nobody allocated, and chunks from another
//! owner (handed over, or new from a backend that promises no zeros) hold someone else's
//! bytes: both are cleared before the range is handed out ([`Inner::wipe_unmapped`] before
//! mapping where the backend can, [`Inner::fill_placed`] after mapping otherwise).

use super::intervals::Intervals;
use super::mapper::Placed;
use super::Inner;
use crate::backend::{AccessMode, DriverCall, PhysicalChunk};
use crate::error::{Error, Result};

/// Which unmapped granules are aliased to the zero page, and the chunk.
#[derive(Debug, Default)]
pub(crate) struct ZeroBook {
    /// The pool's zero chunk, once made (charged like any chunk of the pool).
    pub(crate) chunk: Option<PhysicalChunk>,
    /// Zero-filled regions alive: the chunk is given back when the last one goes.
    pub(crate) users: u64,
    /// Aliased ranges (a part of `held`).
    ranges: Intervals,
    /// Granule bytes whose aliasing failed (a driver error): left unmapped, so a read there
    /// faults until the range is mapped again ([`crate::PoolStats::zero_alias_failed`]).
    pub(crate) failed: u64,
}

impl ZeroBook {
    /// Take the aliased parts of `[start, end)` out of the book.
    pub(crate) fn take(&mut self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let parts: Vec<(u64, u64)> = self
            .ranges
            .iter()
            .filter(|&(s, e)| s < end && e > start)
            .map(|(s, e)| (s.max(start), e.min(end)))
            .collect();
        for &(s, e) in &parts {
            self.ranges.remove(s, e);
        }
        parts
    }

    pub(crate) fn insert(&mut self, start: u64, end: u64) {
        self.ranges.insert(start, end);
    }

    /// Bytes of address space aliased.
    pub(crate) fn aliased(&self) -> u64 {
        self.ranges.total()
    }

    /// Every aliased range must be unmapped space of a region.
    pub(crate) fn audit(&self, held: &Intervals) -> Result<(), String> {
        for (s, e) in self.ranges.iter() {
            if !held.covers(s, e) {
                return Err(format!(
                    "zero-page alias [{s:#x}, {e:#x}) lies outside the regions' unmapped space"
                ));
            }
        }
        Ok(())
    }
}

/// A failed [`Inner::unmap_zero`]: the aliases that are still mapped.
pub(crate) struct ZeroFailure {
    pub(crate) error: Error,
    pub(crate) still: Vec<(u64, u64)>,
}

impl Inner {
    /// Clear `chunks` (in flight, mapped nowhere) where the backend can without mapping them
    /// ([`crate::backend::Backend::wipe_chunk`]); the ones it cannot clear come back, for
    /// [`Inner::fill_placed`] once mapped.
    pub(crate) fn wipe_unmapped(&self, chunks: Vec<PhysicalChunk>) -> Vec<PhysicalChunk> {
        let mut left = Vec::new();
        for c in chunks {
            // SAFETY: in flight: ours, mapped nowhere, seen by nobody.
            if let Err(e) = unsafe { self.backend.wipe_chunk(c) } {
                let unsupported =
                    matches!(&e, Error::Backend { code, .. } if code == "UNSUPPORTED");
                if left.is_empty() && !unsupported {
                    tracing::debug!(pool = %self.name, error = %e, "clearing a chunk before mapping failed; it is cleared once mapped");
                }
                left.push(c);
            }
        }
        left
    }

    /// Write zeros over every chunk of `placed` (mapped with access, claimed, unseen) that is
    /// in `dirty`, before the range is handed to anyone.
    pub(crate) fn fill_placed(&self, placed: &[Placed], dirty: &[PhysicalChunk]) -> Result<()> {
        let dirty: std::collections::HashSet<PhysicalChunk> = dirty.iter().copied().collect();
        let mut runs = Intervals::default();
        for &(o, c) in placed.iter().filter(|(_, c)| dirty.contains(c)) {
            runs.insert(o, o + c.size as u64);
        }
        // One fill per contiguous run (on CUDA each is a driver call and a wait).
        for (s, e) in runs.iter() {
            // SAFETY: mapped read-write just before, claimed (in transit): nobody else uses it.
            unsafe {
                self.backend
                    .copies()
                    .fill(self.base + s, (e - s) as usize, 0)
            }?;
        }
        Ok(())
    }
}

impl Inner {
    /// The pool's zero chunk, made (and filled with zeros) on first use: a granule of the
    /// pool's cache, else one obtained like any growth ([`Inner::obtain`]: admission charges
    /// it, to the pool's limit or its model's ledger line). A refusal says the zero page asked.
    fn zero_chunk(&self) -> Result<PhysicalChunk> {
        let cached = {
            let mut st = self.state.lock();
            if let Some(c) = st.zero.chunk {
                return Ok(c);
            }
            // Counted in flight in the same critical section as it leaves the cache: the
            // charge always equals mapped + cached + zero page + in flight.
            st.cache
                .take_smallest_in(self.gran as usize, self.gran as usize)
                .map(|c| self.take_out(vec![c])[0])
        };
        let made = match cached {
            Some(c) => c,
            None => self.obtain_zero_granule()?,
        };
        // Fresh memory need not be zero (CUDA), nor is a cached or donated chunk: map it
        // read-write once, clear it, unmap.
        let cleared = self.clear_chunk(made);
        if let Err((e, free)) = cleared {
            if free {
                // Credited; a chunk whose release fails is cached (logged there).
                let _ = self.release_chunks(vec![made]);
            }
            return Err(e);
        }
        let mut st = self.state.lock();
        if let Some(c) = st.zero.chunk {
            drop(st);
            // Another thread made one first: ours goes back to the cache.
            self.stash(vec![made]);
            return Ok(c);
        }
        st.zero.chunk = Some(made);
        self.in_flight
            .fetch_sub(made.size as u64, std::sync::atomic::Ordering::AcqRel);
        st.note_peaks();
        tracing::debug!(pool = %self.name, bytes = self.gran, "zero page made");
        Ok(made)
    }

    /// One granule obtained for the zero page (in flight, charged); a refusal names it.
    fn obtain_zero_granule(&self) -> Result<PhysicalChunk> {
        let fit = super::Fit {
            max_chunk: self.gran,
            room: self.gran,
        };
        let got = self
            .obtain(self.gran, super::Urgency::Required, fit)
            .map_err(|e| match e {
                Error::OutOfPhysicalMemory {
                    requested,
                    available,
                    source_of_limit,
                } => Error::OutOfPhysicalMemory {
                    requested,
                    available,
                    source_of_limit: format!(
                        "{source_of_limit}; asked for the pool's zero page (one granule, charged \
                         once per pool for its zero-filled regions)"
                    ),
                },
                other => other,
            })?;
        let mut chunks: Vec<PhysicalChunk> = got.donated.into_iter().chain(got.created).collect();
        // Chunks are whole granules and at most `fit.room` came: exactly one.
        let made = chunks.pop().ok_or_else(|| {
            Error::backend(
                self.backend.info().name,
                "create",
                "NO_RESULT",
                "no chunk for the zero page",
            )
        })?;
        self.stash(chunks);
        Ok(made)
    }

    /// Unmap `[offset, offset + len)` of a zero-filled region (mapped, whole chunks) where the
    /// backend replaces mappings in one step ([`crate::backend::Backend::maps_over`]): the
    /// zero page goes in place of each chunk at once, so a reader of any byte of the range
    /// finds the chunk or zeros, never a hole. A chunk whose replacement fails is unmapped
    /// plainly (the caller aliases what is left unaliased). If that unmap fails too, every
    /// chunk is mapped back (the range is as before) and the error returned. The chunks go
    /// where `fate` says.
    pub(crate) fn unmap_to_zero(
        &self,
        offset: u64,
        len: u64,
        fate: super::ChunkFate,
    ) -> Result<()> {
        let zero = self.zero_chunk()?;
        let end = self.check_range(offset, len)?;
        let victims = self.claim_unmap(offset, end, super::Space::Region)?;
        let mut aliased: Vec<(u64, u64)> = Vec::new();
        let mut failure = None;
        for (i, &(o, c)) in victims.iter().enumerate() {
            let size = c.size as u64;
            // SAFETY: the chunk's range was claimed above (out of the books, in transit): the
            // caller no longer uses it and only the zero page, read-only, goes there.
            if unsafe { self.alias_over(o, size, zero) }.is_ok() {
                aliased.push((o, o + size));
                continue;
            }
            // SAFETY: as above; an unmap takes out the chunk and the aliases made over parts of it.
            if let Some(e) = unsafe { self.unmap_placed(vec![(o, c)]) }.error {
                failure = Some((i, e));
                break;
            }
        }
        let Some((failed_at, error)) = failure else {
            let mut st = self.state.lock();
            st.in_transit -= len;
            st.unmapped_home(offset, end).insert(offset, end);
            for &(s, e) in &aliased {
                st.zero.insert(s, e);
            }
            drop(st);
            self.put_away(victims.into_iter().map(|(_, c)| c).collect(), fate);
            return Ok(());
        };
        // Put every chunk touched back where it was, in one step each (the rest never moved).
        let mut restored: Vec<Placed> = victims[failed_at + 1..].to_vec();
        let mut lost: Vec<Placed> = Vec::new();
        let mut stuck: Vec<Placed> = Vec::new();
        for &(o, c) in &victims[..=failed_at] {
            // SAFETY: claimed; what is mapped there is the chunk itself, zero aliases or nothing.
            let back = unsafe {
                self.backend
                    .map_over(self.base + o, c, crate::backend::AccessMode::ReadWrite)
            };
            self.drivers.bump(DriverCall::Map);
            match back {
                Ok(()) => restored.push((o, c)),
                // SAFETY: as above; nothing uses the range.
                Err(_) => match unsafe { self.unmap_placed(vec![(o, c)]) }.error {
                    None => lost.push((o, c)),
                    Some(_) => stuck.push((o, c)),
                },
            }
        }
        tracing::error!(pool = %self.name, offset, len, error = %error, restored = restored.len(), lost = lost.len(), stuck = stuck.len(), "unmapping to the zero page failed; the range was mapped back");
        let mut st = self.state.lock();
        st.in_transit -= len;
        for &(o, c) in &restored {
            st.chunks.insert(o, c);
            st.ranges.insert(o, o + c.size as u64);
            st.mapped += c.size as u64;
        }
        for &(o, c) in &lost {
            let e = o + c.size as u64;
            st.unmapped_home(o, e).insert(o, e);
        }
        st.put_stuck(&stuck);
        let settled = restored.iter().chain(&stuck).map(|(_, c)| c);
        self.in_flight.fetch_sub(
            super::mapper::bytes_of(settled),
            std::sync::atomic::Ordering::AcqRel,
        );
        drop(st);
        self.put_away(lost.into_iter().map(|(_, c)| c).collect(), fate);
        Err(error)
    }

    /// Put the zero page, read-only, in place of whatever is mapped at `[offset, offset +
    /// len)`, granule by granule, each in one step.
    ///
    /// # Safety
    /// The range is claimed by the caller and nothing uses what is mapped there.
    unsafe fn alias_over(&self, offset: u64, len: u64, zero: PhysicalChunk) -> Result<()> {
        let mut at = offset;
        while at < offset + len {
            self.drivers.bump(DriverCall::Map);
            // SAFETY: forwarded; the zero chunk is only ever mapped read-only.
            unsafe {
                self.backend
                    .map_over(self.base + at, zero, crate::backend::AccessMode::ReadOnly)
            }?;
            at += self.gran;
        }
        Ok(())
    }

    /// Map `made` (one new granule) read-write at a free place, write zeros, unmap it. On
    /// failure, whether the chunk is still free to release (false: it stays mapped, stuck).
    fn clear_chunk(&self, made: PhysicalChunk) -> Result<(), (Error, bool)> {
        let addr = {
            let mut st = self.state.lock();
            let Some((s, _)) = st.cold.iter().find(|(s, e)| e - s >= self.gran) else {
                let largest_free = st.cold.iter().map(|(s, e)| e - s).max().unwrap_or(0);
                return Err((
                    Error::OutOfAddressSpace {
                        requested: self.gran,
                        largest_free,
                        capacity: self.capacity,
                    },
                    true,
                ));
            };
            st.cold.remove(s, s + self.gran);
            st.in_transit += self.gran;
            s
        };
        // SAFETY: `[addr, addr + gran)` was claimed above (unmapped, ours); the chunk is
        // new and mapped nowhere.
        let (r, stuck) = match unsafe { self.map_run(addr, &[made]) } {
            Ok(()) => {
                let zeros = vec![0u8; self.gran as usize];
                // SAFETY: mapped with access just above; nobody else knows the range.
                let w = unsafe { self.backend.copies().write(self.base + addr, &zeros) };
                // SAFETY: the one chunk mapped above, unused now.
                let u = unsafe { self.unmap_placed(vec![(addr, made)]) };
                (w.and(u.error.map_or(Ok(()), Err)), u.kept)
            }
            Err(f) => (Err(f.error), f.stuck),
        };
        let mut st = self.state.lock();
        st.in_transit -= self.gran;
        if stuck.is_empty() {
            st.cold.insert(addr, addr + self.gran);
        } else {
            // Still mapped: kept out of every use, retried by trim and teardown.
            st.put_stuck(&stuck);
            self.in_flight.fetch_sub(
                super::mapper::bytes_of(stuck.iter().map(|(_, c)| c)),
                std::sync::atomic::Ordering::AcqRel,
            );
        }
        r.map_err(|e| (e, stuck.is_empty()))
    }

    /// Alias the unmapped, unaliased granules of `[offset, offset + len)` (inside a region) to
    /// the zero page, read-only. Parts mapped or being mapped meanwhile are skipped. On failure
    /// what was aliased stays aliased.
    pub(crate) fn zero_alias(&self, offset: u64, len: u64) -> Result<()> {
        let chunk = self.zero_chunk()?;
        let end = offset.saturating_add(len);
        let parts: Vec<(u64, u64)> = {
            let mut st = self.state.lock();
            // Only what overlaps the range: the sets hold thousands of intervals after a spike,
            // and this runs once per run a region unmaps.
            let aliased: Vec<(u64, u64)> = st.zero.ranges.overlapping(offset, end).collect();
            let mut parts: Vec<(u64, u64)> = st
                .held
                .overlapping(offset, end)
                .map(|(s, e)| (s.max(offset), e.min(end)))
                .collect();
            for &(s, e) in &aliased {
                parts = parts
                    .into_iter()
                    .flat_map(|(ps, pe)| {
                        if e <= ps || s >= pe {
                            vec![(ps, pe)]
                        } else {
                            [(ps, s.max(ps)), (e.min(pe), pe)]
                                .into_iter()
                                .filter(|(a, b)| a < b)
                                .collect()
                        }
                    })
                    .collect();
            }
            for &(s, e) in &parts {
                st.held.remove(s, e);
                st.in_transit += e - s;
            }
            parts
        };
        let mut done: Vec<(u64, u64)> = Vec::new();
        let mut failure = None;
        'parts: for &(s, e) in &parts {
            let mut at = s;
            while at < e {
                // SAFETY: claimed above: unmapped space of a region; the zero chunk is only
                // ever mapped read-only.
                if let Err(err) = unsafe { self.map_zero_granule(at, chunk) } {
                    failure = Some(err);
                    if at > s {
                        done.push((s, at));
                    }
                    break 'parts;
                }
                at += self.gran;
            }
            done.push((s, e));
        }
        let mut st = self.state.lock();
        for &(s, e) in &parts {
            st.in_transit -= e - s;
            st.held.insert(s, e);
        }
        for &(s, e) in &done {
            st.zero.insert(s, e);
        }
        drop(st);
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Map the zero chunk read-only at one granule.
    ///
    /// # Safety
    /// `[offset, offset + gran)` is unmapped space claimed by the caller.
    unsafe fn map_zero_granule(&self, offset: u64, chunk: PhysicalChunk) -> Result<()> {
        // SAFETY: forwarded.
        let r = unsafe { self.try_map_zero_granule(offset, chunk) };
        if r.is_err() {
            let mut st = self.state.lock();
            st.zero.failed = st.zero.failed.saturating_add(self.gran);
        }
        r
    }

    /// [`Self::map_zero_granule`] without the failure count.
    ///
    /// # Safety
    /// As [`Self::map_zero_granule`].
    unsafe fn try_map_zero_granule(&self, offset: u64, chunk: PhysicalChunk) -> Result<()> {
        let addr = self.base + offset;
        self.drivers.bump(DriverCall::Map);
        // SAFETY: forwarded; the zero chunk may be mapped at many places, read-only at each.
        unsafe { self.backend.map(addr, chunk) }?;
        self.drivers.bump(DriverCall::SetAccess);
        // SAFETY: the chunk mapped just above.
        let r = unsafe {
            self.backend
                .set_access_mode(addr, chunk.size, AccessMode::ReadOnly)
        };
        if let Err(e) = r {
            self.drivers.bump(DriverCall::Unmap);
            // SAFETY: mapped just above, never accessible.
            if let Err(u) = unsafe { self.backend.unmap(addr, chunk.size) } {
                tracing::error!(pool = %self.name, offset, error = %u, "unmapping a zero page that could not be made read-only failed");
            }
            return Err(e);
        }
        Ok(())
    }

    /// Unmap the zero aliases over `parts` (taken out of the book by the caller, in a claimed
    /// range). On failure the ones unmapped are aliased again, and the ranges aliased now are
    /// returned for the caller to put back in the book.
    ///
    /// # Safety
    /// `parts` are aliases the caller took out of the book, inside ranges it claimed.
    pub(crate) unsafe fn unmap_zero(&self, parts: &[(u64, u64)]) -> Result<(), ZeroFailure> {
        let mut gone: Vec<(u64, u64)> = Vec::new();
        for (i, &(s, e)) in parts.iter().enumerate() {
            let mut at = s;
            while at < e {
                self.drivers.bump(DriverCall::Unmap);
                // SAFETY: one granule of the zero chunk mapped there, claimed by the caller.
                let r = unsafe { self.backend.unmap(self.base + at, self.gran as usize) };
                if let Err(error) = r {
                    if at > s {
                        gone.push((s, at));
                    }
                    // SAFETY: what was unmapped above is claimed and unmapped.
                    let mut still = unsafe { self.map_zero_back(&gone, &[]) };
                    still.push((at, e));
                    still.extend_from_slice(&parts[i + 1..]);
                    return Err(ZeroFailure { error, still });
                }
                at += self.gran;
            }
            gone.push((s, e));
        }
        Ok(())
    }

    /// Alias `parts` to the zero page again, skipping granules under `stuck` chunks; returns
    /// the ranges aliased (for the book). Failures are logged: the granule stays a hole.
    ///
    /// # Safety
    /// `parts` are unmapped but for `stuck`, inside ranges the caller claimed.
    pub(crate) unsafe fn map_zero_back(
        &self,
        parts: &[(u64, u64)],
        stuck: &[Placed],
    ) -> Vec<(u64, u64)> {
        let Some(chunk) = self.state.lock().zero.chunk else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for &(s, e) in parts {
            let mut at = s;
            while at < e {
                let under_stuck = stuck
                    .iter()
                    .any(|&(o, c)| at >= o && at < o + c.size as u64);
                // SAFETY: forwarded from the caller.
                if !under_stuck {
                    match unsafe { self.map_zero_granule(at, chunk) } {
                        Ok(()) => out.push((at, at + self.gran)),
                        Err(err) => {
                            tracing::error!(pool = %self.name, offset = at, error = %err, "aliasing a granule to the zero page again failed; reads of it fault")
                        }
                    }
                }
                at += self.gran;
            }
        }
        out
    }

    /// Drop the zero aliases of `[offset, offset + len)` (a region going away): unmapped, out
    /// of the book. Failures are logged.
    pub(crate) fn zero_unalias(&self, offset: u64, len: u64) {
        let parts = {
            let mut st = self.state.lock();
            let parts = st.zero.take(offset, offset + len);
            for &(s, e) in &parts {
                st.held.remove(s, e);
                st.in_transit += e - s;
            }
            parts
        };
        // SAFETY: taken out of the book and claimed above.
        let still = match unsafe { self.unmap_zero(&parts) } {
            Ok(()) => Vec::new(),
            Err(f) => {
                tracing::error!(pool = %self.name, offset, len, error = %f.error, "unmapping zero-page aliases failed; they stay");
                f.still
            }
        };
        let mut st = self.state.lock();
        for &(s, e) in &parts {
            st.in_transit -= e - s;
            st.held.insert(s, e);
        }
        for (s, e) in still {
            st.zero.insert(s, e);
        }
    }

    /// A zero-filled region was made: the zero page stays while it lives.
    pub(crate) fn zero_region_made(&self) {
        self.state.lock().zero.users += 1;
    }

    /// A zero-filled region is gone (its aliases dropped): the last one gives the zero page
    /// back (released and credited; a failed release caches it, logged).
    pub(crate) fn zero_region_gone(&self) {
        let chunk = {
            let mut st = self.state.lock();
            st.zero.users = st.zero.users.saturating_sub(1);
            if st.zero.users > 0 || st.zero.aliased() > 0 {
                return;
            }
            let Some(c) = st.zero.chunk.take() else {
                return;
            };
            self.take_out(vec![c])
        };
        if let (_, Some(e)) = self.release_chunks(chunk) {
            tracing::warn!(pool = %self.name, error = %e, "releasing the zero page failed; it is cached");
        }
    }

    /// The zero chunk at teardown, counted in flight for the caller to release (none while
    /// aliases remain: then it stays, leaked and charged).
    pub(super) fn take_zero(&mut self) -> Option<PhysicalChunk> {
        let st = self.state.get_mut();
        let c = st.zero.chunk?;
        if st.zero.aliased() > 0 {
            tracing::error!(pool = %self.name, "zero-page aliases remain at teardown; the zero page is leaked");
            return None;
        }
        st.zero.chunk = None;
        self.in_flight
            .fetch_add(c.size as u64, std::sync::atomic::Ordering::AcqRel);
        Some(c)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::backend::host::HostBackend;
    use crate::backend::testing::FaultInjector;
    use crate::backend::DriverCall;
    use crate::pool::{MemOptions, Pool, PoolConfig};
    use crate::tag::Tag;

    /// A granule whose aliasing back to the zero page fails is counted in the pool's stats
    /// (it used to be only logged, so an engine could not tell that a read there faults).
    #[test]
    fn a_failed_alias_is_counted_in_the_stats() {
        let faults = Arc::new(FaultInjector::new(Arc::new(
            HostBackend::new(4096).expect("host backend"),
        )));
        let pool = Pool::new(faults.clone(), PoolConfig::new(4 * 8192)).expect("pool");
        let region = pool
            .reserve_region_with(8192, &MemOptions::new().tag(Tag::Kv).zeroed())
            .expect("zeroed region");
        region.map(0, 4096).expect("map granule 0");
        assert_eq!(pool.stats().zero_alias_failed, 0);
        // Call 1 puts the zero page in place of the chunk (host: in one step); when it fails
        // the chunk is unmapped plainly and call 2 aliases the hole.
        faults.fail_nth(DriverCall::Map, 1);
        faults.fail_nth(DriverCall::Map, 2);
        region
            .unmap(0, 4096)
            .expect("the memory goes back even if the alias fails");
        let s = pool.stats();
        assert_eq!(s.zero_alias_failed, 4096, "the failed alias is visible");
        assert_eq!(s.zero_aliased, 4096, "granule 1 alone is aliased");
        pool.audit().expect("books agree");
        // Mapping it again and unmapping without a fault aliases it again.
        region.map(0, 4096).expect("map granule 0 again");
        region.unmap(0, 4096).expect("unmap");
        assert_eq!(pool.stats().zero_aliased, 8192);
        assert_eq!(
            pool.stats().zero_alias_failed,
            4096,
            "a count over the pool's life"
        );
    }
}
