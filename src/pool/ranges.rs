//! The range API: granule-aligned ranges mapped and unmapped where the caller says, outside
//! every region ([`crate::Pool::map`]) or inside one ([`crate::Region::map`]).

use std::sync::atomic::Ordering;

use super::admission::{Fit, Urgency};
use super::mapper::{bytes_of, Placed};
use super::Inner;
use crate::backend::PhysicalChunk;
use crate::error::{Error, Result};
use crate::tag::Tag;

/// Where chunks go once unmapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChunkFate {
    /// To the pool's cache, for reuse.
    Cache,
    /// Back to the driver at once, never reused here (chunks another process still maps:
    /// handed off to it, or adopted from it and rolled back).
    Release,
}

/// The zero-page aliases a failed [`Inner::map_batch`] took out: to be mapped again, or still
/// mapped.
pub(super) enum Zeroed<'a> {
    Remap(&'a [(u64, u64)]),
    Still(Vec<(u64, u64)>),
    /// Some to map again (their chunks were mapped over them), some still mapped.
    Split {
        remap: Vec<(u64, u64)>,
        still: Vec<(u64, u64)>,
    },
}

/// Address ranges, start to end.
type Spans = Vec<(u64, u64)>;

/// `parts` cut into what lies under the `placed` chunks and what does not.
fn split_under(parts: &[(u64, u64)], placed: &[Placed]) -> (Spans, Spans) {
    let mut under = super::intervals::Intervals::default();
    for &(o, c) in placed {
        under.insert(o, o + c.size as u64);
    }
    let mut inside = Vec::new();
    let mut outside = Vec::new();
    for &(s, e) in parts {
        let mut at = s;
        for (us, ue) in under.iter().filter(|&(us, ue)| us < e && ue > s) {
            if at < us {
                outside.push((at, us));
            }
            inside.push((at.max(us), ue.min(e)));
            at = ue.min(e);
        }
        if at < e {
            outside.push((at, e));
        }
    }
    (inside, outside)
}

/// Which address space a range-API call works in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Space {
    /// The pool's own range API: free space outside every region.
    Pool,
    /// Inside a [`crate::Region`], set aside for its owner.
    Region,
}

impl Inner {
    /// Fill `[offset, offset + len)` of `space`, just mapped by the caller, with zeros; on
    /// failure unmap it again, so that a zeroed map is all or nothing.
    pub(crate) fn zero_mapped(&self, offset: u64, len: u64, space: Space) -> Result<()> {
        let filled = self.pin(offset, len).and_then(|()| {
            // SAFETY: mapped with access, and pinned against unmapping and sleep until the
            // unpin below; the caller has not handed the range to anyone yet.
            let r = unsafe {
                self.backend
                    .copies()
                    .fill(self.base + offset, len as usize, 0)
            };
            self.unpin(offset, len);
            r
        });
        if let Err(e) = filled {
            if let Err(u) = self.unmap_range(offset, len, space) {
                tracing::error!(pool = %self.name, offset, len, error = %u, "unmapping a range whose zeroing failed failed");
            }
            return Err(e);
        }
        Ok(())
    }

    pub(super) fn check_range(&self, offset: u64, len: u64) -> Result<u64> {
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
        offset
            .checked_add(len)
            .filter(|&e| e <= self.capacity)
            .ok_or(Error::RangeOutOfBounds {
                offset,
                len,
                capacity: self.capacity,
            })
    }

    /// Map `[offset, offset + len)`, which must be unmapped free space of `space`, with chunks
    /// of at most `max_chunk` bytes. On failure nothing stays mapped.
    pub(crate) fn map_range(
        &self,
        offset: u64,
        len: u64,
        max_chunk: u64,
        space: Space,
        tag: Tag,
    ) -> Result<()> {
        self.map_batch(&[(offset, len)], max_chunk, space, tag, Urgency::Required)
    }

    /// Map every `(offset, len)` of `ranges` (disjoint, each unmapped free space of `space`) as
    /// one operation: one claim, one request for new chunks (one admission, one batch create:
    /// one message where chunks come from a broker), then one map per chunk and one access
    /// grant per range. All of them or none: on failure nothing stays mapped. Several ranges
    /// need `max_chunk` to be the granularity (every chunk then fits any range). `urgency`
    /// [`Urgency::LookAhead`] takes only memory admitted at once, never another model's.
    pub(crate) fn map_batch(
        &self,
        ranges: &[(u64, u64)],
        max_chunk: u64,
        space: Space,
        tag: Tag,
        urgency: Urgency,
    ) -> Result<()> {
        let mut spans = Vec::with_capacity(ranges.len());
        for &(offset, len) in ranges {
            spans.push((offset, self.check_range(offset, len)?));
        }
        spans.sort_unstable();
        if spans.is_empty() {
            return Ok(());
        }
        if spans.len() > 1 && max_chunk != self.gran {
            return Err(Error::InvalidArgument(format!(
                "a batch of {} ranges needs chunks of one granule ({} bytes), not up to {max_chunk}",
                spans.len(),
                self.gran
            )));
        }
        for w in spans.windows(2) {
            if w[0].1 > w[1].0 {
                return Err(Error::InvalidArgument(format!(
                    "ranges [{:#x}, {:#x}) and [{:#x}, {:#x}) of one batch overlap",
                    w[0].0, w[0].1, w[1].0, w[1].1
                )));
            }
        }
        // Disjoint ranges inside the reservation: the sum cannot overflow.
        let total: u64 = spans.iter().map(|(s, e)| e - s).sum();
        let (cached, zeroed) = {
            let mut st = self.state.lock();
            if let Some(reason) = &st.refusing {
                return Err(self.refusal(reason));
            }
            st.sleep.refuse_unless_awake(&self.name, "map")?;
            for &(offset, end) in &spans {
                let free = match space {
                    Space::Region => &st.held,
                    Space::Pool => &st.cold,
                };
                if let Some((s, e)) = free.first_gap(offset, end) {
                    let len = end - offset;
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
            }
            let mut cached = Vec::with_capacity(spans.len());
            let mut zeroed = Vec::new();
            for &(offset, end) in &spans {
                match space {
                    Space::Region => st.held.remove(offset, end),
                    Space::Pool => st.cold.remove(offset, end),
                }
                zeroed.extend(st.zero.take(offset, end));
                let c = st.cache.take_up_to(end - offset, max_chunk as usize);
                cached.push(self.take_out(c));
            }
            st.in_transit += total;
            st.growing += 1;
            (cached, zeroed)
        };
        let cached_all: Vec<PhysicalChunk> = cached.concat();
        let need = total - bytes_of(&cached_all);
        let fit = Fit {
            max_chunk,
            room: need,
        };
        let (donated, created) = match self.obtain(need, urgency, fit) {
            Ok(o) => (o.donated, o.created),
            Err(e) => {
                // The aliases are unmapped only once every chunk is in hand: still there.
                self.undo_batch(&spans, cached_all, Vec::new(), &[], Zeroed::Still(zeroed));
                return Err(e);
            }
        };
        let mut reusable = cached_all;
        reusable.extend_from_slice(&donated);
        // Each range: its cached chunks, then fresh ones (donated first) up to its length.
        let mut fresh = donated.iter().chain(&created).copied();
        let mut per_range: Vec<Vec<PhysicalChunk>> = Vec::with_capacity(spans.len());
        let mut misfit = None;
        for (&(offset, end), mut chunks) in spans.iter().zip(cached) {
            let mut got = bytes_of(&chunks);
            while got < end - offset {
                let Some(c) = fresh.next() else { break };
                got += c.size as u64;
                chunks.push(c);
            }
            if got != end - offset {
                misfit.get_or_insert((offset, end - offset, got));
            }
            per_range.push(chunks);
        }
        if let Some(c) = fresh.next() {
            misfit.get_or_insert((spans[0].0, total, total + c.size as u64));
        }
        if let Some((offset, len, got)) = misfit {
            // Sources must fit the room they were given; never map past the claim.
            tracing::error!(pool = %self.name, offset, len, got, "chunk sources did not fit a range");
            self.undo_batch(&spans, reusable, created, &[], Zeroed::Still(zeroed));
            return Err(Error::InvalidArgument(format!(
                "chunk sources returned {got} bytes for a range of {len} bytes at {offset:#x}"
            )));
        }
        // A batch over zero-page aliases maps pages that serve blocks nobody allocated: every
        // chunk of it is cleared. Otherwise only chunks whose bytes were someone else's are:
        // handed over by another model, or new from a backend that promises no zeros.
        let serves_unallocated = !zeroed.is_empty();
        let dirty: Vec<PhysicalChunk> = if serves_unallocated {
            per_range.concat()
        } else if self.backend.creates_zeroed() {
            donated.clone()
        } else {
            donated.iter().chain(&created).copied().collect()
        };
        let to_fill = self.wipe_unmapped(dirty);
        // Where the backend can replace a mapping in one step, each chunk goes in place of the
        // aliases under it, so a reader of a neighbouring unallocated block never finds a hole.
        let over = serves_unallocated && to_fill.is_empty() && self.backend.maps_over();
        if !over {
            // SAFETY: the zero-page aliases lie in ranges claimed above (in transit) and nothing
            // writes through them.
            if let Err(f) = unsafe { self.unmap_zero(&zeroed) } {
                self.undo_batch(&spans, reusable, created, &[], Zeroed::Still(f.still));
                return Err(f.error);
            }
        }
        let mut done: Vec<Placed> = Vec::new();
        let mut failed: Option<(Error, Vec<Placed>)> = None;
        'ranges: for (&(offset, _), chunks) in spans.iter().zip(&per_range) {
            if over {
                let mut at = offset;
                for &c in chunks {
                    self.drivers.bump(crate::backend::DriverCall::Map);
                    // SAFETY: the range is claimed (in transit) and holds only zero-page aliases
                    // (read-only, never written) or nothing; the chunk is ours, mapped nowhere.
                    let r = unsafe {
                        self.backend.map_over(
                            self.base + at,
                            c,
                            crate::backend::AccessMode::ReadWrite,
                        )
                    };
                    if let Err(e) = r {
                        failed = Some((e, Vec::new()));
                        break 'ranges;
                    }
                    done.push((at, c));
                    at += c.size as u64;
                }
                continue;
            }
            // SAFETY: the range is claimed (in transit) and unmapped; the chunks are ours.
            if let Err(f) = unsafe { self.map_run(offset, chunks) } {
                failed = Some((f.error, f.stuck));
                break;
            }
            let mut at = offset;
            for &c in chunks {
                done.push((at, c));
                at += c.size as u64;
            }
        }
        if failed.is_none() && !to_fill.is_empty() {
            if let Err(e) = self.fill_placed(&done, &to_fill) {
                failed = Some((e, Vec::new()));
            }
        }
        if let Some((error, mut stuck)) = failed {
            // Aliases under chunks mapped over them are gone once those are unmapped; the rest
            // of the aliases of a replacing batch are still in place.
            let zeroed = if over {
                let (remap, still) = split_under(&zeroed, &done);
                Zeroed::Split { remap, still }
            } else {
                Zeroed::Remap(&zeroed)
            };
            // SAFETY: ranges mapped just above that nobody has seen yet.
            let undone = unsafe { self.unmap_placed(std::mem::take(&mut done)) };
            stuck.extend(undone.kept);
            let is_stuck = |c: &PhysicalChunk| stuck.iter().any(|(_, s)| s == c);
            reusable.retain(|c| !is_stuck(c));
            let created = created.into_iter().filter(|c| !is_stuck(c)).collect();
            self.undo_batch(&spans, reusable, created, &stuck, zeroed);
            return Err(error);
        }
        let mut st = self.state.lock();
        for &(o, c) in &done {
            st.chunks.insert(o, c);
        }
        st.mapped += total;
        self.in_flight.fetch_sub(total, Ordering::AcqRel);
        st.in_transit -= total;
        st.growing -= 1;
        for &(offset, end) in &spans {
            st.ranges.insert(offset, end);
            st.range_tags.insert(offset, end, tag.clone());
        }
        st.note_peaks();
        drop(st);
        tracing::debug!(pool = %self.name, ranges = spans.len(), bytes = total, chunks = done.len(), "ranges mapped");
        Ok(())
    }

    /// Undo a claimed [`Inner::map_batch`]: its ranges go home (except chunks left `stuck`),
    /// aliased to the zero page again where they were (`zeroed`), and its chunks go back.
    pub(super) fn undo_batch(
        &self,
        spans: &[(u64, u64)],
        reusable: Vec<PhysicalChunk>,
        created: Vec<PhysicalChunk>,
        stuck: &[Placed],
        zeroed: Zeroed<'_>,
    ) {
        let zeroed = match zeroed {
            // SAFETY: the ranges are still claimed (in transit) and unmapped but for `stuck`
            // chunks, which `map_zero_back` skips.
            Zeroed::Remap(parts) => unsafe { self.map_zero_back(parts, stuck) },
            Zeroed::Still(parts) => parts,
            Zeroed::Split { remap, mut still } => {
                // SAFETY: as for `Remap`, for the parts whose chunks were unmapped.
                still.extend(unsafe { self.map_zero_back(&remap, stuck) });
                still
            }
        };
        let mut st = self.state.lock();
        let total: u64 = spans.iter().map(|(s, e)| e - s).sum();
        st.in_transit -= total;
        st.growing -= 1;
        for &(offset, end) in spans {
            let mut at = offset;
            for &(o, c) in stuck.iter().filter(|(o, _)| *o >= offset && *o < end) {
                if at < o {
                    st.unmapped_home(at, o).insert(at, o);
                }
                at = o + c.size as u64;
            }
            if at < end {
                st.unmapped_home(at, end).insert(at, end);
            }
        }
        for (s, e) in zeroed {
            st.zero.insert(s, e);
        }
        st.put_stuck(stuck);
        self.in_flight
            .fetch_sub(bytes_of(stuck.iter().map(|(_, c)| c)), Ordering::AcqRel);
        drop(st);
        self.stash(reusable);
        // Rollback: a chunk that cannot be released stays cached (logged).
        let _ = self.release_chunks(created);
    }

    /// Unmap `[offset, offset + len)`, mapped through the range API in `space`. Refused while
    /// a [`crate::Region`] read or write is copying any byte of it. If an unmap fails, what was
    /// already unmapped is mapped back, so the range is as before and the error is returned.
    pub(crate) fn unmap_range(&self, offset: u64, len: u64, space: Space) -> Result<()> {
        self.unmap_range_as(offset, len, space, ChunkFate::Cache)
    }

    /// As [`Inner::unmap_range`], the chunks unmapped going where `fate` says.
    pub(crate) fn unmap_range_as(
        &self,
        offset: u64,
        len: u64,
        space: Space,
        fate: ChunkFate,
    ) -> Result<()> {
        let end = self.check_range(offset, len)?;
        let victims = self.claim_unmap(offset, end, space)?;
        // Chunk by chunk, stopping at the first failure so that the range can be restored.
        let mut gone: Vec<Placed> = Vec::with_capacity(victims.len());
        let mut failure = None;
        for (i, &p) in victims.iter().enumerate() {
            // SAFETY: the range left the range set under the lock: nobody else touches these
            // chunks, and the caller said it no longer uses the memory.
            let u = unsafe { self.unmap_placed(vec![p]) };
            if let Some(e) = u.error {
                failure = Some((i, e));
                break;
            }
            gone.push(p);
        }
        if let Some((i, error)) = failure {
            // SAFETY: the unmapped ranges are still claimed (in transit); the chunks are ours.
            let back = unsafe { self.remap_each(gone) };
            let mut st = self.state.lock();
            st.in_transit -= len;
            let mut still: Vec<Placed> = victims[i..].to_vec();
            still.extend(back.restored);
            for &(o, c) in &still {
                st.chunks.insert(o, c);
                st.ranges.insert(o, o + c.size as u64);
                st.mapped += c.size as u64;
            }
            for &(o, c) in &back.unmapped {
                let e = o + c.size as u64;
                st.unmapped_home(o, e).insert(o, e);
            }
            st.put_stuck(&back.stuck);
            let settled = still.iter().chain(&back.stuck).map(|(_, c)| c);
            self.in_flight
                .fetch_sub(bytes_of(settled), Ordering::AcqRel);
            drop(st);
            if !back.unmapped.is_empty() || !back.stuck.is_empty() {
                tracing::error!(pool = %self.name, offset, len, "unmap failed and could not be rolled back fully");
            }
            self.put_away(back.unmapped.into_iter().map(|(_, c)| c).collect(), fate);
            return Err(error);
        }
        {
            let mut st = self.state.lock();
            st.in_transit -= len;
            st.unmapped_home(offset, end).insert(offset, end);
        }
        tracing::debug!(pool = %self.name, offset, len, chunks = victims.len(), "range unmapped");
        self.put_away(victims.into_iter().map(|(_, c)| c).collect(), fate);
        Ok(())
    }

    /// Take the chunks of `[offset, end)` of `space` (mapped through the range API, unpinned,
    /// whole chunks) out of the books for an unmap: the range goes in transit, its bytes in
    /// flight.
    pub(super) fn claim_unmap(&self, offset: u64, end: u64, space: Space) -> Result<Vec<Placed>> {
        let len = end - offset;
        let mut st = self.state.lock();
        st.sleep.refuse_unless_awake(&self.name, "unmap")?;
        if space == Space::Pool {
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
        if let Some((s, e)) = st.pinned_in(offset, end) {
            return Err(Error::RangeInUse {
                offset,
                len,
                busy_offset: s,
                busy_len: e - s,
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
        let victims: Vec<Placed> = st
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
        self.in_flight.fetch_add(len, Ordering::AcqRel);
        Ok(victims)
    }

    /// Pin `[offset, offset + len)`, which must be mapped through the range API, against
    /// unmapping until [`Inner::unpin`]; else say where the hole is.
    pub(crate) fn pin(&self, offset: u64, len: u64) -> Result<()> {
        let end = offset.checked_add(len).ok_or(Error::RangeOutOfBounds {
            offset,
            len,
            capacity: self.capacity,
        })?;
        let mut st = self.state.lock();
        st.sleep.refuse_unless_awake(&self.name, "copy")?;
        if let Some((s, e)) = st.ranges.first_gap(offset, end) {
            return Err(Error::RangeNotMapped {
                offset,
                len,
                hole_offset: s,
                hole_len: e - s,
            });
        }
        st.pins.push((offset, end));
        Ok(())
    }

    /// Undo one [`Inner::pin`] of exactly this range.
    pub(crate) fn unpin(&self, offset: u64, len: u64) {
        let mut st = self.state.lock();
        if let Some(i) = st.pins.iter().position(|&p| p == (offset, offset + len)) {
            st.pins.swap_remove(i);
        }
    }
}
