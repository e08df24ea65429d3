//! Physical chunks that are created but not mapped, kept for the next map instead of being
//! released and created again.

use std::collections::BTreeMap;

use crate::backend::PhysicalChunk;

/// Unmapped chunks by size.
#[derive(Debug, Default)]
pub(crate) struct ChunkCache {
    by_size: BTreeMap<usize, Vec<PhysicalChunk>>,
    bytes: u64,
    count: usize,
}

impl ChunkCache {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Chunks held.
    pub(crate) fn len(&self) -> usize {
        self.count
    }

    pub(crate) fn put(&mut self, chunk: PhysicalChunk) {
        self.bytes += chunk.size as u64;
        self.count += 1;
        self.by_size.entry(chunk.size).or_default().push(chunk);
    }

    /// The largest chunk no bigger than `max`.
    pub(crate) fn take_at_most(&mut self, max: usize) -> Option<PhysicalChunk> {
        let size = *self.by_size.range(..=max).next_back()?.0;
        self.pop(size)
    }

    /// The smallest chunk of at least `min` and at most `max` bytes.
    pub(crate) fn take_smallest_in(&mut self, min: usize, max: usize) -> Option<PhysicalChunk> {
        if min > max {
            return None;
        }
        let size = *self.by_size.range(min..=max).next()?.0;
        self.pop(size)
    }

    /// One chunk of exactly `size`, if held.
    fn pop(&mut self, size: usize) -> Option<PhysicalChunk> {
        let list = self.by_size.get_mut(&size)?;
        let chunk = list.pop()?;
        if list.is_empty() {
            self.by_size.remove(&size);
        }
        self.bytes -= chunk.size as u64;
        self.count -= 1;
        Some(chunk)
    }

    /// Chunks covering up to `bytes` exactly (largest first, each no bigger than `max_chunk`),
    /// leaving the cache untouched for the part it cannot cover.
    pub(crate) fn take_up_to(&mut self, bytes: u64, max_chunk: usize) -> Vec<PhysicalChunk> {
        let mut out = Vec::new();
        let mut left = bytes;
        while left > 0 {
            let cap = left.min(max_chunk as u64) as usize;
            match self.take_at_most(cap) {
                Some(c) => {
                    left -= c.size as u64;
                    out.push(c);
                }
                None => break,
            }
        }
        out
    }

    /// Remove everything.
    pub(crate) fn drain(&mut self) -> Vec<PhysicalChunk> {
        self.bytes = 0;
        self.count = 0;
        std::mem::take(&mut self.by_size)
            .into_values()
            .flatten()
            .collect()
    }

    /// Remove chunks until at most `keep` bytes remain, releasing as little beyond the excess
    /// as the chunk sizes allow.
    pub(crate) fn shrink_to(&mut self, keep: u64) -> Vec<PhysicalChunk> {
        let mut out = Vec::new();
        while self.bytes > keep {
            let excess = (self.bytes - keep) as usize;
            let next = match self.take_at_most(excess) {
                Some(c) => Some(c),
                None => self.take_smallest(),
            };
            match next {
                Some(c) => out.push(c),
                None => break,
            }
        }
        out
    }

    fn take_smallest(&mut self) -> Option<PhysicalChunk> {
        let size = *self.by_size.keys().next()?;
        self.pop(size)
    }
}
