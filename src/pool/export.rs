//! Physical chunks under a range, with their driver handles: what [`crate::p2p`] exports to
//! another process. Bookkeeping only (no driver call).

use super::Pool;
use crate::backend::PhysicalChunk;

impl Pool {
    /// The chunks mapped under `[offset, offset + len)` of the reservation, each with its
    /// offset, in address order. The caller keeps them mapped while it uses the handles (a pin
    /// on the blocks over them).
    pub(crate) fn placed_chunks_in(&self, offset: u64, len: u64) -> Vec<(u64, PhysicalChunk)> {
        let end = offset.saturating_add(len);
        let st = self.inner().state.lock();
        let first = st
            .chunks
            .range(..=offset)
            .next_back()
            .map_or(offset, |(&o, _)| o);
        st.chunks
            .range(first..end)
            .filter(|(&o, c)| o + c.size as u64 > offset)
            .map(|(&o, &c)| (o, c))
            .collect()
    }
}

/// A range of a pool pinned against unmapping (the range API's pins, as a copy through a
/// [`crate::Region`] takes them) for as long as it lives; it keeps the pool alive.
pub(crate) struct RangePin {
    pool: Pool,
    offset: u64,
    len: u64,
}

impl Pool {
    /// Pin `[offset, offset + len)` of the reservation, which must be mapped through the range
    /// API (a [`crate::Region`]'s or the pool's own), against unmapping.
    pub(crate) fn pin_range(&self, offset: u64, len: u64) -> crate::Result<RangePin> {
        self.inner().pin(offset, len)?;
        Ok(RangePin {
            pool: self.clone(),
            offset,
            len,
        })
    }
}

impl Drop for RangePin {
    fn drop(&mut self) {
        self.pool.inner().unpin(self.offset, self.len);
    }
}

impl std::fmt::Debug for RangePin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RangePin")
            .field("pool", &self.pool.name())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}
