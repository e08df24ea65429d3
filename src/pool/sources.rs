//! Where a pool's physical chunks come from and go back to: the chunk-source stack.
//!
//! A request is served, in order, by the pool's own cache (taken under the pool's lock while
//! the request is planned), by admission (a limit or the shared ledger), which may answer with
//! chunks handed over from other models' idle memory, and by the backend, which creates what
//! admission charged. Donated chunks arrive exactly like cached ones: the caller maps whatever
//! it gets, and no request is planned twice.
//!
//! Every chunk a pool owns is in exactly one place: mapped (`State::chunks`), cached
//! (`State::cache`), or *in flight*: held by an operation between two of those places or
//! between the pool and the driver, counted in `Inner::in_flight`. Moves between the cache or
//! the mapping and in flight happen under the pool's lock; charges and credits move bytes into
//! and out of in flight inside admission's critical section. So `charge == mapped + cached +
//! in flight` holds at every instant for whoever holds admission's lock and then the pool's.

use std::sync::atomic::Ordering;

use super::admission::{Acquired, Fit, Urgency};
use super::keeper::HeldBack;
use super::mapper::bytes_of;
use super::Inner;
use crate::backend::{Need, PhysicalChunk};
use crate::error::{Error, Result};

/// Chunks [`Inner::obtain`] got, in flight.
#[derive(Debug, Default)]
pub(super) struct Obtained {
    /// Handed over by other models (created and charged already).
    pub(super) donated: Vec<PhysicalChunk>,
    /// Created for this request.
    pub(super) created: Vec<PhysicalChunk>,
}

impl Inner {
    /// Bytes of chunks this pool holds in flight.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }

    /// New physical memory for at least `bytes` (chunks fitting `fit`): admission first (which
    /// may hand over idle chunks of other models), then the backend for what was charged. The
    /// chunks come back in flight. On failure nothing stays in flight: created chunks go back
    /// to the driver, uncreated charges are credited, and donated chunks go to the cache when
    /// the driver failed, back to the driver when admission refused (a refused request keeps
    /// nothing it was handed: its budget is everyone's again).
    pub(super) fn obtain(&self, bytes: u64, urgency: Urgency, fit: Fit) -> Result<Obtained> {
        if bytes == 0 {
            return Ok(Obtained::default());
        }
        let Acquired {
            mut donated,
            charged,
        } = self.acquire(bytes, urgency, fit);
        let charged = match charged {
            Ok(n) => n,
            Err(e) if urgency == Urgency::Required && self.has_spare() => {
                // Our own cache may hold chunks of sizes this request cannot use, and idle
                // mapped memory may sit where it cannot (a host tier's staging buffers, given
                // back by woken models, stay mapped for the next one); both count against the
                // limit: give them back and ask once more for what is missing.
                let have = bytes_of(&donated);
                let freed = self.release_cached(0).and_then(|_| {
                    self.trim(bytes.saturating_sub(have), super::TrimScope::IdleOnly)
                });
                if let Err(release) = freed {
                    let _ = self.release_chunks(donated);
                    return Err(release);
                }
                // What was handed over already takes room: the rest must fit what is left.
                let fit = Fit {
                    room: fit.room.saturating_sub(have),
                    ..fit
                };
                let again = self.acquire(bytes.saturating_sub(have), urgency, fit);
                donated.extend(again.donated);
                match again.charged {
                    Ok(n) => n,
                    Err(_) => {
                        let _ = self.release_chunks(donated);
                        return Err(e);
                    }
                }
            }
            Err(e) => {
                let _ = self.release_chunks(donated);
                return Err(e);
            }
        };
        // Whole chunks of the largest size in one batch (one request where chunks come from a
        // broker), then the remainder.
        let mut created = Vec::new();
        let mut left = charged;
        let full = (charged / fit.max_chunk) as usize;
        let rest = charged % fit.max_chunk;
        let batches = [(fit.max_chunk, full), (rest, usize::from(rest > 0))];
        for (size, count) in batches {
            if count == 0 {
                continue;
            }
            let need = match urgency {
                Urgency::Required => Need::Required,
                Urgency::LookAhead => Need::LookAhead,
            };
            match self.call_create_many(size, count, need) {
                Ok(cs) => {
                    created.extend(cs);
                    left -= size * count as u64;
                }
                Err(e) => {
                    self.credit(left);
                    // Failures here are logged and the chunks cached; the create error is the news.
                    let _ = self.release_chunks(created);
                    self.stash(donated);
                    return Err(self.physical_error(e, bytes));
                }
            }
        }
        Ok(Obtained { donated, created })
    }

    /// Whether the pool holds memory nobody uses: cached chunks, or idle mapped memory.
    fn has_spare(&self) -> bool {
        // Blocks threads keep for their next allocation are idle memory too.
        self.flush_fronts_now();
        let st = self.state.lock();
        st.cache.bytes() > 0 || st.mapped > st.in_use()
    }

    pub(super) fn acquire(&self, bytes: u64, urgency: Urgency, fit: Fit) -> Acquired {
        match &self.admission {
            Some(a) => a.acquire(bytes, urgency, fit, &self.in_flight),
            None => {
                self.in_flight.fetch_add(bytes, Ordering::AcqRel);
                Acquired {
                    donated: Vec::new(),
                    charged: Ok(bytes),
                }
            }
        }
    }

    /// Give back `bytes` charged but not held (released, or never created).
    pub(super) fn credit(&self, bytes: u64) {
        match &self.admission {
            Some(a) => a.credit(bytes, &self.in_flight),
            None => {
                self.in_flight.fetch_sub(bytes, Ordering::AcqRel);
            }
        }
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

    /// Put in-flight chunks in the cache (then release what exceeds the cache cap).
    pub(super) fn stash(&self, chunks: Vec<PhysicalChunk>) {
        if chunks.is_empty() {
            return;
        }
        let excess = {
            let mut st = self.state.lock();
            for &c in &chunks {
                st.cache.put(c);
            }
            self.in_flight
                .fetch_sub(bytes_of(&chunks), Ordering::AcqRel);
            st.note_peaks();
            match self.max_cached {
                Some(cap) => self.take_out(st.cache.shrink_to(cap)),
                None => Vec::new(),
            }
        };
        // A chunk that cannot be released stays cached (logged): nothing is lost.
        let _ = self.release_chunks(excess);
    }

    /// Count chunks just taken out of the cache or the mapping (under the pool's lock) as in
    /// flight; returns them.
    pub(super) fn take_out(&self, chunks: Vec<PhysicalChunk>) -> Vec<PhysicalChunk> {
        self.in_flight
            .fetch_add(bytes_of(&chunks), Ordering::AcqRel);
        chunks
    }

    /// Release in-flight chunks that are mapped nowhere, crediting each; a chunk whose release
    /// fails goes to the cache. Returns the bytes released and the first failure.
    pub(crate) fn release_chunks(&self, chunks: Vec<PhysicalChunk>) -> (u64, Option<Error>) {
        self.release_chunks_keeping(chunks, KeepFailed::InCache)
    }

    /// [`Inner::release_chunks`], with chunks whose release failed kept where `keep` says.
    pub(crate) fn release_chunks_keeping(
        &self,
        chunks: Vec<PhysicalChunk>,
        keep: KeepFailed,
    ) -> (u64, Option<Error>) {
        let mut released = 0;
        let mut kept = Vec::new();
        let mut first_err = None;
        let chunks = self.hold_back_for_peers(chunks, keep);
        if chunks.is_empty() {
            return (0, None);
        }
        // SAFETY: callers pass in-flight chunks they took out of every structure, unmapped.
        let mut results = unsafe { self.call_release_many(&chunks) };
        // A backend that answered for fewer chunks released none of the rest as far as we know.
        while results.len() < chunks.len() {
            results.push(Err(Error::backend(
                self.backend.info().name,
                "release_many",
                "NO_RESULT",
                format!("{} results for {} chunks", results.len(), chunks.len()),
            )));
        }
        for (c, r) in chunks.into_iter().zip(results) {
            match r {
                Ok(()) => {
                    released += c.size as u64;
                    self.credit(c.size as u64);
                }
                Err(e) => {
                    tracing::warn!(pool = %self.name, error = %e, ?keep, "release failed; chunk kept");
                    kept.push(c);
                    first_err.get_or_insert(e);
                }
            }
        }
        if !kept.is_empty() {
            let mut st = self.state.lock();
            match keep {
                KeepFailed::InCache => {
                    for &c in &kept {
                        st.cache.put(c);
                    }
                }
                KeepFailed::Apart => st.given_away.extend_from_slice(&kept),
            }
            self.in_flight.fetch_sub(bytes_of(&kept), Ordering::AcqRel);
            // Chunks that were in flight are held again: physical may be at a new high (a
            // growth's created chunks were never counted before).
            st.note_peaks();
        }
        (released, first_err)
    }

    /// Of in-flight chunks about to be released, keep apart (still charged, out of flight)
    /// those the keeper holds back (a p2p peer keeps them imported; see `keeper.rs`); the rest
    /// to release.
    fn hold_back_for_peers(
        &self,
        chunks: Vec<PhysicalChunk>,
        keep: KeepFailed,
    ) -> Vec<PhysicalChunk> {
        let Some(keeper) = super::keeper::active().filter(|_| !chunks.is_empty()) else {
            return chunks;
        };
        let (free, later) = {
            let mut st = self.state.lock();
            // Marked held back and put apart in one step: an answer that releases it and races
            // this finds the chunk in `peer_held` (it takes this lock after the keeper's).
            let HeldBack { held, free, later } = keeper.hold_back(&self.backend, chunks, &self.me);
            if !held.is_empty() {
                tracing::debug!(pool = %self.name, chunks = held.len(), bytes = bytes_of(&held), "released chunks held back until peers forget their imports");
                self.in_flight.fetch_sub(bytes_of(&held), Ordering::AcqRel);
                if keep == KeepFailed::Apart {
                    // Handed off: a failed release later must not cache it either.
                    st.peer_held_apart.extend(held.iter().map(|c| c.raw));
                }
                st.peer_held.extend(held);
                st.note_peaks();
            }
            (free, later)
        };
        if let Some(later) = later {
            later();
        }
        free
    }

    /// Every peer forgot the chunk `raw` held back here: release it now (credited).
    pub(crate) fn release_held_back(&self, raw: u64) {
        let chunk = {
            let mut st = self.state.lock();
            let Some(i) = st.peer_held.iter().position(|c| c.raw == raw) else {
                tracing::warn!(pool = %self.name, raw, "a chunk peers forgot is not held back here");
                return;
            };
            let c = st.peer_held.swap_remove(i);
            let keep = match st.peer_held_apart.iter().position(|&r| r == raw) {
                Some(j) => {
                    st.peer_held_apart.swap_remove(j);
                    KeepFailed::Apart
                }
                None => KeepFailed::InCache,
            };
            (self.take_out(vec![c]), keep)
        };
        let (chunk, keep) = chunk;
        if let (_, Some(e)) = self.release_chunks_keeping(chunk, keep) {
            tracing::warn!(pool = %self.name, error = %e, "releasing a chunk peers forgot failed; it is cached");
        }
    }

    /// Release cached chunks until at most `keep` bytes stay cached.
    pub(crate) fn release_cached(&self, keep: u64) -> Result<u64> {
        let excess = {
            let mut st = self.state.lock();
            let c = st.cache.shrink_to(keep);
            self.take_out(c)
        };
        match self.release_chunks(excess) {
            (released, None) => Ok(released),
            (_, Some(e)) => Err(e),
        }
    }
}

/// Where chunks whose release failed are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeepFailed {
    /// In the cache, for reuse (the pool's own memory).
    InCache,
    /// Apart, never reused (memory another process took over), released at teardown.
    Apart,
}
