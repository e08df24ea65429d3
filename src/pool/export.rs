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
