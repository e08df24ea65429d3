//! Regions: parts of a pool's reservation set aside for one owner's range mappings.
//!
//! A KV-cache layout or an elastic tensor needs a fixed, contiguous virtual range whose pages it
//! maps and unmaps itself. [`Pool::reserve_region`] takes such a range out of the allocator's
//! reach (no [`crate::Allocation`] and no [`Pool::map`] ever lands in it), and the [`Region`]
//! maps and unmaps granule-aligned parts of it with the same machinery (chunk cache, admission,
//! rollback) as the pool's own range API. Dropping the region unmaps what is still mapped in it
//! and returns the range to the pool.

use std::fmt;

use super::{ChunkSpan, Inner, MemOptions, Pool, SleepStatus, Space, Urgency};
use crate::error::{round_up, Error, Result};
use crate::tag::Tag;

/// A contiguous part of a pool's reservation owned by one user; see the module documentation.
///
/// Offsets taken by its methods are relative to the region's start. It keeps its pool alive.
pub struct Region {
    pool: Pool,
    offset: u64,
    len: u64,
    /// What its mappings hold (for sleep policies and stats).
    tag: Tag,
    /// Largest physical chunk [`Region::map`] uses.
    chunk: u64,
    /// Unbacked granules alias the pool's zero page ([`MemOptions::zeroed`] at reserve).
    zeroed: bool,
}

impl Pool {
    /// Set aside `len` bytes (rounded up to the granularity) of this pool's address space as a
    /// [`Region`]. Nothing is mapped. The range is taken from the top of the largest free
    /// address space, away from where the allocator grows; when idle mapped memory holds the
    /// address space, it is unmapped first.
    pub fn reserve_region(&self, len: u64) -> Result<Region> {
        self.reserve_region_with(len, &MemOptions::new())
    }

    /// As [`Pool::reserve_region`], with [`MemOptions`]: `tag` is what every mapping of the
    /// region carries (default [`Tag::Scratch`]), `chunk` the largest physical chunk
    /// [`Region::map`] uses (default: the pool's range chunk); `name` is refused.
    ///
    /// `zeroed`: every granule of the region that is not mapped reads as zeros. It is aliased
    /// read-only to the pool's zero page (one granule of zeros per pool, made with its first
    /// zero-filled region and released with its last; charged like any chunk, so a limit too
    /// small for it refuses the region; shown in [`crate::PoolStats::zero_page`] and counted
    /// in [`crate::PoolStats::physical`]): a read of an unbacked part returns zeros instead of
    /// faulting, a write faults (host: `SIGSEGV`; CUDA: an illegal-address error that poisons
    /// the context). [`Region::map`] replaces the aliases under the range it maps;
    /// [`Region::unmap`] puts them back. Aliases are not memory: they count in
    /// [`crate::PoolStats::zero_aliased`], never in `mapped`, limits, sleep or trim (a pool
    /// asleep leaves discarded ranges unmapped, not aliased, until it wakes). Refused, with the
    /// backend's error, where the backend cannot map memory read-only
    /// ([`crate::backend::Backend::set_access_mode`]); nothing is left reserved or mapped.
    pub fn reserve_region_with(&self, len: u64, opts: &MemOptions) -> Result<Region> {
        opts.refuse("Pool::reserve_region_with", &["name"])?;
        let chunk = opts
            .chunk_checked(self.granularity())?
            .unwrap_or(self.inner().range_chunk);
        if len == 0 {
            return Err(Error::ZeroSize {
                what: "region length",
            });
        }
        let inner = self.inner();
        let len = round_up("region length", len, inner.gran)?;
        let offset = match inner.claim_region(len) {
            Err(Error::OutOfAddressSpace { .. }) if self.stats().idle() > 0 => {
                // Idle mapped memory holds address space nobody uses: unmap it (its chunks are
                // released) and look once more.
                inner.trim(u64::MAX, super::TrimScope::IdleOnly)?;
                inner.claim_region(len)?
            }
            other => other?,
        };
        tracing::debug!(pool = %inner.name, offset, len, "region reserved");
        Ok(Region {
            pool: self.clone(),
            offset,
            len,
            tag: opts.tag_or(Tag::default()),
            chunk,
            zeroed: false,
        })
        .and_then(|mut region| {
            if opts.zeroed {
                region.zeroed = true;
                self.inner().zero_region_made();
                // On failure the region's drop takes back what was aliased.
                self.inner().zero_alias(region.offset, region.len)?;
            }
            Ok(region)
        })
    }
}

impl super::Inner {
    /// Take `len` bytes from the top of the largest free address space as a region.
    fn claim_region(&self, len: u64) -> Result<u64> {
        let mut st = self.state.lock();
        if let Some(reason) = &st.refusing {
            return Err(self.refusal(reason));
        }
        let Some((_, e)) = st.cold.iter().filter(|(s, e)| e - s >= len).last() else {
            return Err(Error::OutOfAddressSpace {
                requested: len,
                largest_free: st.cold.iter().map(|(s, e)| e - s).max().unwrap_or(0),
                capacity: self.capacity,
            });
        };
        let offset = e - len;
        st.cold.remove(offset, e);
        st.regions.insert(offset, e);
        st.held.insert(offset, e);
        Ok(offset)
    }
}

impl Region {
    /// The pool the region belongs to.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The tag every mapping of the region carries.
    pub fn tag(&self) -> &Tag {
        &self.tag
    }

    /// The largest physical chunk [`Region::map`] uses (set at reserve).
    pub fn chunk(&self) -> u64 {
        self.chunk
    }

    /// Offset of the region's first byte in the pool's reservation.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes in the region (a multiple of the granularity).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: a region has at least one granule.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether unbacked granules alias the zero page ([`MemOptions::zeroed`] at [`Pool::reserve_region_with`]).
    pub fn is_zeroed(&self) -> bool {
        self.zeroed
    }

    /// Address of the region's first byte (a device pointer on CUDA).
    pub fn addr(&self) -> u64 {
        self.pool.base() + self.offset
    }

    /// The mapping unit.
    pub fn granularity(&self) -> u64 {
        self.pool.granularity()
    }

    /// `[at, at + len)` inside the region, as an offset in the pool's reservation.
    fn absolute(&self, at: u64, len: u64) -> Result<u64> {
        match at.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.offset + at),
            _ => Err(Error::RangeOutOfBounds {
                offset: at,
                len,
                capacity: self.len,
            }),
        }
    }

    /// Back `[at, at + len)` of the region with physical memory in chunks of up to
    /// [`Region::chunk`] bytes (by default one granule, so any granule of it can be unmapped
    /// alone; [`Region::unmap`] must cover whole chunks). Both must be multiples of the
    /// granularity and the range must be unmapped. On failure nothing stays mapped.
    pub fn map(&self, at: u64, len: u64) -> Result<()> {
        let abs = self.absolute(at, len)?;
        let inner = self.pool.inner();
        inner.map_range(abs, len, self.chunk, Space::Region, self.tag.clone())
    }

    /// Map every `(at, len)` of `ranges` (disjoint, unmapped, granule-aligned, relative to the
    /// region) in one operation with chunks of one granule: one request for new memory, all or
    /// nothing. [`Urgency::LookAhead`] takes only memory admitted at once (never reclaimed or
    /// handed over from another model).
    pub(crate) fn map_batch(&self, ranges: &[(u64, u64)], urgency: Urgency) -> Result<()> {
        let inner = self.pool.inner();
        let mut abs = Vec::with_capacity(ranges.len());
        for &(at, len) in ranges {
            abs.push((self.absolute(at, len)?, len));
        }
        inner.map_batch(&abs, inner.gran, Space::Region, self.tag.clone(), urgency)
    }

    /// Give back the physical memory under `[at, at + len)`: mapped, made of whole chunks.
    /// Its chunks go to the pool's cache. Refused (`RangeInUse`) while a [`Region::read`] or
    /// [`Region::write`] is copying any byte of it.
    pub fn unmap(&self, at: u64, len: u64) -> Result<()> {
        let abs = self.absolute(at, len)?;
        let inner = self.pool.inner();
        if self.zeroed && inner.backend.maps_over() {
            inner.unmap_to_zero(abs, len, super::ChunkFate::Cache)?;
        } else {
            inner.unmap_range(abs, len, Space::Region)?;
        }
        if self.zeroed {
            if let Err(e) = self.pool.inner().zero_alias(abs, len) {
                // The memory went back; only the alias is missing (reads of it fault).
                tracing::error!(pool = %self.pool.name(), offset = abs, len, error = %e, "aliasing an unmapped range to the zero page failed");
            }
        }
        Ok(())
    }

    /// Whether all of `[at, at + len)` is mapped.
    pub fn is_mapped(&self, at: u64, len: u64) -> bool {
        self.absolute(at, len)
            .is_ok_and(|abs| self.pool.is_mapped(abs, len))
    }

    /// The physical chunks mapped under `[at, at + len)`, with offsets relative to the region.
    pub fn chunks_in(&self, at: u64, len: u64) -> Vec<ChunkSpan> {
        let Ok(abs) = self.absolute(at, len) else {
            return Vec::new();
        };
        self.pool
            .chunks_in(abs, len)
            .into_iter()
            .map(|c| ChunkSpan {
                offset: c.offset - self.offset,
                size: c.size,
            })
            .collect()
    }

    /// Copy `data` into the region at `at` (host-to-device on CUDA). The range must be mapped;
    /// it stays mapped until the copy is done (an unmap meanwhile is refused).
    ///
    /// # Safety
    /// Nobody else (a kernel, a transfer, another thread) may use these bytes meanwhile.
    pub unsafe fn write(&self, at: u64, data: &[u8]) -> Result<()> {
        let pin = self.pinned_span(at, data.len() as u64)?;
        // SAFETY: mapped with access and pinned against unmapping while `pin` lives; exclusive
        // use is the caller's promise.
        unsafe {
            self.pool
                .backend()
                .copies()
                .write(self.pool.base() + pin.abs, data)
        }
    }

    /// Copy bytes of the region at `at` into `out`. The range must be mapped; it stays mapped
    /// until the copy is done (an unmap meanwhile is refused).
    ///
    /// # Safety
    /// Nobody may write these bytes meanwhile.
    pub unsafe fn read(&self, at: u64, out: &mut [u8]) -> Result<()> {
        let pin = self.pinned_span(at, out.len() as u64)?;
        // SAFETY: mapped with access and pinned against unmapping while `pin` lives; no writer
        // is the caller's promise.
        unsafe {
            self.pool
                .backend()
                .copies()
                .read(self.pool.base() + pin.abs, out)
        }
    }

    /// `[at, at + len)` checked to lie in the region and be mapped, and pinned against
    /// unmapping (when not empty); its reservation offset.
    fn pinned_span(&self, at: u64, len: u64) -> Result<SpanPin<'_>> {
        let abs = self.absolute(at, len)?;
        if len > 0 {
            self.pool.inner().pin(abs, len).map_err(|e| match e {
                Error::RangeNotMapped {
                    hole_offset,
                    hole_len,
                    ..
                } => Error::RangeNotMapped {
                    offset: at,
                    len,
                    hole_offset: hole_offset - self.offset,
                    hole_len,
                },
                other => other,
            })?;
        }
        Ok(SpanPin {
            region: self,
            abs,
            len,
        })
    }

    /// Bytes of the region mapped now. O(number of mapped ranges in it).
    pub fn mapped_bytes(&self) -> u64 {
        let st = self.pool.inner().state.lock();
        let end = self.offset + self.len;
        st.ranges
            .iter()
            .filter(|&(s, e)| s < end && e > self.offset)
            .map(|(s, e)| e.min(end) - s.max(self.offset))
            .sum()
    }
}

/// A range of a region pinned against unmapping for one copy; unpinned on drop, panics too.
struct SpanPin<'a> {
    region: &'a Region,
    abs: u64,
    len: u64,
}

impl Drop for SpanPin<'_> {
    fn drop(&mut self) {
        if self.len > 0 {
            self.region.pool.inner().unpin(self.abs, self.len);
        }
    }
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("pool", &self.pool.name())
            .field("offset", &format_args!("{:#x}", self.offset))
            .field("len", &self.len)
            .field("chunk", &self.chunk)
            .finish()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.pool
            .inner()
            .end_region(self.offset, self.len, self.zeroed);
    }
}

impl Inner {
    /// The physical chunks mapped under `[offset, offset + len)`, in address order.
    pub(crate) fn chunks_in(&self, offset: u64, len: u64) -> Vec<ChunkSpan> {
        let end = offset.saturating_add(len);
        let st = self.state.lock();
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

    /// Give a dropped region's span back: unmap what its owner left mapped, chunk by chunk
    /// (chunks never straddle its edges), and free its address space. While the pool is not
    /// awake nothing can be unmapped: the span stays reserved (its memory asleep with the
    /// rest) and is given back by [`Inner::end_regions_dropped_asleep`] once the pool is awake.
    fn end_region(&self, offset: u64, len: u64, zeroed: bool) {
        let end = offset + len;
        let defer = |st: &mut super::state::State| {
            if st.sleep.status == SleepStatus::Awake {
                return false;
            }
            st.sleep.dropped_regions.push((offset, len, zeroed));
            tracing::debug!(pool = %self.name, offset, len, "region dropped while the pool is not awake; given back at the wake");
            true
        };
        if defer(&mut self.state.lock()) {
            return;
        }
        for c in self.chunks_in(offset, len) {
            if let Err(e) = self.unmap_range(c.offset, c.size, Space::Region) {
                // A sleep that began meanwhile: the rest waits for the wake.
                if matches!(e, Error::Asleep { .. }) && defer(&mut self.state.lock()) {
                    return;
                }
                tracing::error!(pool = %self.name, error = %e, offset = c.offset, "unmapping a region's chunk at drop failed; it stays mapped until the pool goes");
            }
        }
        if zeroed {
            self.zero_unalias(offset, len);
        }
        let mut st = self.state.lock();
        let held: Vec<(u64, u64)> = st
            .held
            .iter()
            .filter(|&(s, e)| s < end && e > offset)
            .map(|(s, e)| (s.max(offset), e.min(end)))
            .collect();
        for (s, e) in held {
            st.held.remove(s, e);
            st.cold.insert(s, e);
        }
        st.regions.remove(offset, end);
        drop(st);
        if zeroed {
            self.zero_region_gone();
        }
        tracing::debug!(pool = %self.name, offset, len, "region returned");
    }

    /// Give back the regions dropped while the pool was not awake, if it is awake now (called
    /// after every sleep and wake, with no lock held).
    pub(super) fn end_regions_dropped_asleep(&self) {
        let dropped = {
            let mut st = self.state.lock();
            if st.sleep.status != SleepStatus::Awake {
                return;
            }
            std::mem::take(&mut st.sleep.dropped_regions)
        };
        for (offset, len, zeroed) in dropped {
            self.end_region(offset, len, zeroed);
        }
    }
}
