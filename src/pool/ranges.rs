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
        let end = self.check_range(offset, len)?;
        let cached = {
            let mut st = self.state.lock();
            if let Some(reason) = &st.refusing {
                return Err(self.refusal(reason));
            }
            st.sleep.refuse_unless_awake(&self.name, "map")?;
            let free = match space {
                Space::Region => &st.held,
                Space::Pool => &st.cold,
            };
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
            match space {
                Space::Region => st.held.remove(offset, end),
                Space::Pool => st.cold.remove(offset, end),
            }
            st.in_transit += len;
            st.growing += 1;
            let c = st.cache.take_up_to(len, max_chunk as usize);
            self.take_out(c)
        };
        let need = len - bytes_of(&cached);
        let fit = Fit {
            max_chunk,
            room: need,
        };
        let (mut reusable, created) = match self.obtain(need, Urgency::Required, fit) {
            Ok(o) => (o.donated, o.created),
            Err(e) => {
                self.undo_range(offset, end, cached, Vec::new(), &[]);
                return Err(e);
            }
        };
        reusable.splice(0..0, cached);
        let chunks: Vec<PhysicalChunk> = reusable.iter().chain(&created).copied().collect();
        let got = bytes_of(&chunks);
        if got != len {
            // Sources must fit the room they were given; never map past the claim.
            tracing::error!(pool = %self.name, offset, len, got, "chunk sources overshot a range");
            self.undo_range(offset, end, reusable, created, &[]);
            return Err(Error::InvalidArgument(format!(
                "chunk sources returned {got} bytes for a range of {len} bytes at {offset:#x}"
            )));
        }
        // SAFETY: the range is claimed (in transit) and unmapped; the chunks are ours.
        if let Err(f) = unsafe { self.map_run(offset, &chunks) } {
            let stuck: Vec<PhysicalChunk> = f.stuck.iter().map(|&(_, c)| c).collect();
            reusable.retain(|c| !stuck.contains(c));
            let created = created.into_iter().filter(|c| !stuck.contains(c)).collect();
            self.undo_range(offset, end, reusable, created, &f.stuck);
            return Err(f.error);
        }
        let mut st = self.state.lock();
        let mut at = offset;
        for c in &chunks {
            st.chunks.insert(at, *c);
            at += c.size as u64;
        }
        st.mapped += len;
        self.in_flight.fetch_sub(len, Ordering::AcqRel);
        st.in_transit -= len;
        st.growing -= 1;
        st.ranges.insert(offset, end);
        st.range_tags.insert(offset, end, tag);
        st.note_peaks();
        drop(st);
        tracing::debug!(pool = %self.name, offset, len, chunks = chunks.len(), "range mapped");
        Ok(())
    }

    pub(super) fn undo_range(
        &self,
        offset: u64,
        end: u64,
        reusable: Vec<PhysicalChunk>,
        created: Vec<PhysicalChunk>,
        stuck: &[Placed],
    ) {
        {
            let mut st = self.state.lock();
            st.in_transit -= end - offset;
            st.growing -= 1;
            let mut at = offset;
            for &(o, c) in stuck {
                if at < o {
                    st.unmapped_home(at, o).insert(at, o);
                }
                at = o + c.size as u64;
            }
            if at < end {
                st.unmapped_home(at, end).insert(at, end);
            }
            st.put_stuck(stuck);
            self.in_flight
                .fetch_sub(bytes_of(stuck.iter().map(|(_, c)| c)), Ordering::AcqRel);
        }
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
        let victims: Vec<Placed> = {
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
            victims
        };
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
