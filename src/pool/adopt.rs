//! Chunks that change hands between processes ([`crate::p2p`] hand-off): a range mapped with
//! chunks imported from another process, charged to this pool as if created here, and ranges
//! unmapped with their chunks released at once rather than cached.

use std::sync::atomic::Ordering;

use super::admission::{Fit, Urgency};
use super::mapper::bytes_of;
use super::ranges::{ChunkFate, Space, Zeroed};
use super::sources::KeepFailed;
use super::{Inner, Region};
use crate::backend::PhysicalChunk;
use crate::error::{Error, Result};
use crate::tag::Tag;

impl Inner {
    /// Put chunks just unmapped (in flight) where `fate` says.
    pub(super) fn put_away(&self, chunks: Vec<PhysicalChunk>, fate: ChunkFate) {
        match fate {
            ChunkFate::Cache => self.stash(chunks),
            ChunkFate::Release => {
                // Cached, a chunk another process owns now would be mapped again here.
                if let (_, Some(e)) = self.release_chunks_keeping(chunks, KeepFailed::Apart) {
                    tracing::error!(pool = %self.name, error = %e, "releasing chunks that changed hands failed; they are kept apart, never reused, and released at teardown");
                }
            }
        }
    }

    /// Map `chunks` (this backend's, imported from another process, mapped nowhere) back to
    /// back from `offset` of `space`, charged to admission like created memory (no donation:
    /// the memory exists already), the range tagged `tag` like any range mapping. From then on
    /// the pool owns them. On failure nothing stays mapped or charged here and every chunk is
    /// released (this process lets go of it).
    pub(crate) fn adopt_range(
        &self,
        offset: u64,
        chunks: Vec<PhysicalChunk>,
        space: Space,
        tag: Tag,
    ) -> Result<()> {
        let len = bytes_of(&chunks);
        let release_all = |chunks: &[PhysicalChunk]| {
            for &c in chunks {
                // SAFETY: the caller's chunks, mapped nowhere, not taken by the pool.
                if let Err(e) = unsafe { self.call_release(c) } {
                    tracing::error!(pool = %self.name, error = %e, "releasing an imported chunk failed");
                }
            }
        };
        let end = match self.check_range(offset, len) {
            Ok(end) => end,
            Err(e) => {
                release_all(&chunks);
                return Err(e);
            }
        };
        let claimed = {
            let mut st = self.state.lock();
            let free = match space {
                Space::Region => &st.held,
                Space::Pool => &st.cold,
            };
            if let Some(reason) = st.refusing.clone() {
                Err(self.refusal(&reason))
            } else if let Some((s, e)) = free.first_gap(offset, end) {
                Err(Error::RangeInUse {
                    offset,
                    len,
                    busy_offset: s,
                    busy_len: e - s,
                })
            } else {
                match space {
                    Space::Region => st.held.remove(offset, end),
                    Space::Pool => st.cold.remove(offset, end),
                }
                st.in_transit += len;
                st.growing += 1;
                // A zero-filled region's aliases under the range give way to the chunks.
                Ok(st.zero.take(offset, end))
            }
        };
        let zeroed = match claimed {
            Ok(z) => z,
            Err(e) => {
                release_all(&chunks);
                return Err(e);
            }
        };
        // A pure charge: `max_chunk` 0 takes no other model's chunks (it may reclaim idle ones).
        let got = self.acquire(
            len,
            Urgency::Required,
            Fit {
                max_chunk: 0,
                room: len,
            },
        );
        self.stash(got.donated);
        match got.charged {
            Ok(n) if n == len => {}
            other => {
                if let Ok(n) = other {
                    self.credit(n);
                }
                let spans = [(offset, end)];
                self.undo_batch(&spans, Vec::new(), Vec::new(), &[], Zeroed::Remap(&zeroed));
                release_all(&chunks);
                return Err(match other {
                    Err(e) => e,
                    Ok(n) => Error::InvalidArgument(format!(
                        "admission charged {n} of {len} bytes for adopted chunks"
                    )),
                });
            }
        }
        // Charged and counted in flight, like created chunks: the rollback releases them.
        let spans = [(offset, end)];
        // SAFETY: the aliases lie in the range claimed above, which nothing writes through.
        if let Err(f) = unsafe { self.unmap_zero(&zeroed) } {
            self.undo_batch(&spans, Vec::new(), chunks, &[], Zeroed::Still(f.still));
            return Err(f.error);
        }
        // SAFETY: the range is claimed (in transit) and unmapped; the chunks are ours now.
        if let Err(f) = unsafe { self.map_run(offset, &chunks) } {
            let stuck: Vec<PhysicalChunk> = f.stuck.iter().map(|&(_, c)| c).collect();
            let rest = chunks.into_iter().filter(|c| !stuck.contains(c)).collect();
            self.undo_batch(&spans, Vec::new(), rest, &f.stuck, Zeroed::Remap(&zeroed));
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
        tracing::debug!(pool = %self.name, offset, len, chunks = chunks.len(), "imported chunks adopted");
        Ok(())
    }
}

impl Region {
    /// Map `chunks` (imported, mapped nowhere) back to back from `at`, which must be unmapped;
    /// see [`Inner::adopt_range`]. They carry the region's tag. The chunks are consumed either
    /// way.
    pub(crate) fn adopt(&self, at: u64, chunks: Vec<PhysicalChunk>) -> Result<()> {
        let len = bytes_of(&chunks);
        let inner = self.pool().inner();
        match at.checked_add(len).filter(|&e| e <= self.len()) {
            Some(_) => inner.adopt_range(
                self.offset() + at,
                chunks,
                Space::Region,
                self.tag().clone(),
            ),
            None => {
                for c in chunks {
                    // SAFETY: the caller's chunks, mapped nowhere.
                    let _ = unsafe { inner.call_release(c) };
                }
                Err(Error::RangeOutOfBounds {
                    offset: at,
                    len,
                    capacity: self.len(),
                })
            }
        }
    }

    /// As [`Region::unmap`], releasing the chunks at once (they must never be reused here).
    pub(crate) fn unmap_releasing(&self, at: u64, len: u64) -> Result<()> {
        let abs = match at.checked_add(len).filter(|&e| e <= self.len()) {
            Some(_) => self.offset() + at,
            None => {
                return Err(Error::RangeOutOfBounds {
                    offset: at,
                    len,
                    capacity: self.len(),
                })
            }
        };
        let inner = self.pool().inner();
        if self.is_zeroed() && inner.backend.maps_over() {
            inner.unmap_to_zero(abs, len, ChunkFate::Release)?;
        } else {
            inner.unmap_range_as(abs, len, Space::Region, ChunkFate::Release)?;
        }
        if self.is_zeroed() {
            if let Err(e) = inner.zero_alias(abs, len) {
                // The memory went; only the alias is missing (reads of it fault).
                tracing::error!(pool = %inner.name, offset = abs, len, error = %e, "aliasing a range handed on to the zero page failed");
            }
        }
        Ok(())
    }
}
