//! Elastic backing of blocks: a large virtual [`Region`] whose pages are mapped only under the
//! blocks in use.
//!
//! A KV cache is laid out for its maximum size, but only the blocks that hold tokens need
//! physical memory. [`BlockBacking`] knows where each block's bytes lie in its region (a
//! [`BlockGeometry`]: one span per block for a contiguous tensor, one per layer for a
//! layer-separate layout) and counts, per page, how many backed blocks touch it:
//! [`BlockBacking::ensure_backed`] maps the pages that go from 0 to 1, [`BlockBacking::release`]
//! unmaps the pages that go back to 0. A page shared by several blocks stays mapped while any of
//! them is backed.
//!
//! Every page is one physical chunk, so it can be unmapped on its own and registered on its own
//! (UCX exports only the first chunk of a range backed by several). A [`MappingHook`] hears of
//! every mapping after it is made and of every unmapping before it is made: the NIXL
//! registration hangs on it, so a registration never outlives the memory under it.
//!
//! Concurrency: `&self` everywhere. The bookkeeping lock is never held across a driver call or
//! a hook; pages being mapped or unmapped are marked busy, and an operation that needs a busy
//! page waits for it on a condition variable (with the lock released).

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::pool::Region;

/// Where each block's bytes lie inside a region.
pub trait BlockGeometry: Send + Sync {
    /// Number of blocks.
    fn num_blocks(&self) -> usize;

    /// Bytes of the region the blocks cover, from its start.
    fn extent(&self) -> u64;

    /// Append to `out` the spans `(offset, len)` of `block`, relative to the region's start.
    /// Called only with `block < num_blocks()`; spans are non-empty and lie inside `extent()`.
    fn block_spans(&self, block: usize, out: &mut Vec<(u64, u64)>);
}

/// `num_blocks` equal blocks of `block_bytes`, one after the other every `stride` bytes: the
/// geometry of a contiguous tensor whose first dimension is the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UniformBlocks {
    /// Number of blocks.
    pub num_blocks: usize,
    /// Bytes of each block.
    pub block_bytes: u64,
    /// Distance between the starts of consecutive blocks (at least `block_bytes`).
    pub stride: u64,
}

impl UniformBlocks {
    /// Packed blocks: the stride is the block size.
    pub fn packed(num_blocks: usize, block_bytes: u64) -> Self {
        UniformBlocks {
            num_blocks,
            block_bytes,
            stride: block_bytes,
        }
    }
}

impl BlockGeometry for UniformBlocks {
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn extent(&self) -> u64 {
        match self.num_blocks {
            0 => 0,
            n => (n as u64 - 1) * self.stride + self.block_bytes,
        }
    }

    fn block_spans(&self, block: usize, out: &mut Vec<(u64, u64)>) {
        out.push((block as u64 * self.stride, self.block_bytes));
    }
}

/// Told about mappings of a [`BlockBacking`]: after pages are mapped, before they are unmapped.
/// Offsets are relative to the region's start and cover whole pages (one chunk each).
pub trait MappingHook: Send + Sync {
    /// `[at, at + len)` of `region` was just mapped with access. An error undoes the mapping and
    /// fails the operation that made it.
    fn mapped(&self, region: &Region, at: u64, len: u64) -> Result<()>;

    /// `[at, at + len)` of `region` is about to be unmapped: drop everything that refers to it.
    fn unmapping(&self, region: &Region, at: u64, len: u64);
}

/// What one [`BlockBacking::ensure_backed`] or [`BlockBacking::release`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackingChange {
    /// Blocks whose state changed (became backed, or released).
    pub blocks: usize,
    /// Bytes mapped (ensure) or unmapped (release).
    pub bytes: u64,
    /// Release only: bytes that no block uses any more but whose unmap failed (logged); they
    /// stay mapped until a later release or [`BlockBacking::unmap_unused`].
    pub left_mapped: u64,
}

/// A snapshot of a [`BlockBacking`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackingStats {
    /// Blocks in the geometry.
    pub blocks: usize,
    /// Blocks backed now.
    pub backed_blocks: usize,
    /// The mapping unit of the backing (one physical chunk each).
    pub page_size: u64,
    /// Pages the geometry spans.
    pub pages: usize,
    /// Pages mapped now.
    pub mapped_pages: usize,
    /// Bytes mapped now (`mapped_pages * page_size`).
    pub mapped_bytes: u64,
}

#[derive(Debug, Default)]
struct BackingState {
    backed: Vec<bool>,
    /// Per page: how many backed blocks touch it.
    refs: Vec<u32>,
    /// Per page: mapped now.
    mapped: Vec<bool>,
    /// Per page: a driver call on it is in flight.
    busy: Vec<bool>,
    backed_blocks: usize,
    mapped_pages: usize,
}

/// Blocks over a region, backed on demand; see the module documentation.
pub struct BlockBacking<G: BlockGeometry> {
    region: Region,
    geometry: G,
    page: u64,
    hook: Option<Arc<dyn MappingHook>>,
    state: Mutex<BackingState>,
    changed: Condvar,
}

/// Consecutive page indices `[first, last]` folded into runs.
fn runs(pages: &BTreeSet<usize>) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &p in pages {
        match out.last_mut() {
            Some((_, end)) if *end + 1 == p => *end = p,
            _ => out.push((p, p)),
        }
    }
    out
}

impl<G: BlockGeometry> BlockBacking<G> {
    /// Blocks laid out by `geometry` over `region`, mapped in pages of `page_size` bytes (a
    /// multiple of the granularity; `None`: the granularity). Nothing is mapped yet.
    pub fn new(
        region: Region,
        geometry: G,
        page_size: Option<u64>,
        hook: Option<Arc<dyn MappingHook>>,
    ) -> Result<Self> {
        let g = region.granularity();
        let page = page_size.unwrap_or(g);
        if page == 0 || page % g != 0 {
            return Err(Error::Misaligned {
                what: "page size",
                value: page,
                alignment: g,
            });
        }
        let extent = geometry.extent();
        if extent > region.len() {
            return Err(Error::InvalidArgument(format!(
                "the blocks span {extent} bytes but the region has only {}",
                region.len()
            )));
        }
        let pages = extent.div_ceil(page) as usize;
        let state = BackingState {
            backed: vec![false; geometry.num_blocks()],
            refs: vec![0; pages],
            mapped: vec![false; pages],
            busy: vec![false; pages],
            ..BackingState::default()
        };
        Ok(BlockBacking {
            region,
            geometry,
            page,
            hook,
            state: Mutex::new(state),
            changed: Condvar::new(),
        })
    }

    /// The region the blocks live in.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Where the blocks lie.
    pub fn geometry(&self) -> &G {
        &self.geometry
    }

    /// The mapping unit: every page is one physical chunk.
    pub fn page_size(&self) -> u64 {
        self.page
    }

    /// Whether `block` is backed now.
    pub fn is_backed(&self, block: usize) -> bool {
        self.state
            .lock()
            .backed
            .get(block)
            .copied()
            .unwrap_or(false)
    }

    /// The first block of `blocks` that is not backed, if any (for refusing work on it).
    pub fn first_unbacked(&self, blocks: impl IntoIterator<Item = usize>) -> Option<usize> {
        let st = self.state.lock();
        blocks
            .into_iter()
            .find(|&b| !st.backed.get(b).copied().unwrap_or(false))
    }

    /// Whether every byte of `[at, at + len)` of the region lies in a mapped page.
    pub fn is_range_mapped(&self, at: u64, len: u64) -> bool {
        if len == 0 {
            return true;
        }
        let Some(end) = at.checked_add(len) else {
            return false;
        };
        let (first, last) = ((at / self.page) as usize, ((end - 1) / self.page) as usize);
        let st = self.state.lock();
        last < st.mapped.len() && st.mapped[first..=last].iter().all(|&m| m)
    }

    /// A snapshot of blocks and pages.
    pub fn stats(&self) -> BackingStats {
        let st = self.state.lock();
        BackingStats {
            blocks: st.backed.len(),
            backed_blocks: st.backed_blocks,
            page_size: self.page,
            pages: st.refs.len(),
            mapped_pages: st.mapped_pages,
            mapped_bytes: st.mapped_pages as u64 * self.page,
        }
    }

    /// Physical bytes the pages under `blocks` cost, counting each page once (what they would
    /// hold mapped on their own, whatever is mapped now).
    pub fn physical_bytes_for(&self, blocks: impl IntoIterator<Item = usize>) -> Result<u64> {
        let blocks = self.checked(blocks)?;
        Ok(self.pages_of(&blocks).len() as u64 * self.page)
    }

    /// Physical bytes backing `blocks` would map now: the pages under them not mapped yet.
    pub fn additional_bytes_for(&self, blocks: impl IntoIterator<Item = usize>) -> Result<u64> {
        let blocks = self.checked(blocks)?;
        let pages = self.pages_of(&blocks);
        let st = self.state.lock();
        Ok(pages.iter().filter(|&&p| !st.mapped[p]).count() as u64 * self.page)
    }

    /// Validate block indices; returns them sorted and without repeats.
    fn checked(&self, blocks: impl IntoIterator<Item = usize>) -> Result<BTreeSet<usize>> {
        let n = self.geometry.num_blocks();
        let mut out = BTreeSet::new();
        for b in blocks {
            if b >= n {
                return Err(Error::InvalidArgument(format!(
                    "block {b} does not exist: the layout has {n} blocks"
                )));
            }
            out.insert(b);
        }
        Ok(out)
    }

    /// The pages each block touches, with repeats (one entry per block and page).
    fn pages_per_block(&self, block: usize, spans: &mut Vec<(u64, u64)>, out: &mut Vec<usize>) {
        spans.clear();
        self.geometry.block_spans(block, spans);
        let start = out.len();
        for &(at, len) in spans.iter() {
            let first = (at / self.page) as usize;
            let last = ((at + len - 1) / self.page) as usize;
            out.extend(first..=last);
        }
        // A block counts once per page, even when several of its spans share one.
        out[start..].sort_unstable();
        let mut kept = start;
        for i in start..out.len() {
            if i == start || out[i] != out[kept - 1] {
                out[kept] = out[i];
                kept += 1;
            }
        }
        out.truncate(kept);
    }

    fn pages_of(&self, blocks: &BTreeSet<usize>) -> BTreeSet<usize> {
        let mut spans = Vec::new();
        let mut pages = Vec::new();
        for &b in blocks {
            self.pages_per_block(b, &mut spans, &mut pages);
        }
        pages.into_iter().collect()
    }

    /// Wait until none of `pages` is busy; returns the lock.
    fn wait_idle<'a>(
        &'a self,
        pages: &BTreeSet<usize>,
    ) -> parking_lot::MutexGuard<'a, BackingState> {
        let mut st = self.state.lock();
        while pages.iter().any(|&p| st.busy[p]) {
            self.changed.wait(&mut st);
        }
        st
    }

    /// Back `blocks` with physical memory: map every page under them that is not mapped yet.
    /// Blocks already backed are left as they are. On failure (a refused admission, a driver
    /// error, a hook error) nothing changes: what was mapped on the way is unmapped again.
    pub fn ensure_backed(&self, blocks: impl IntoIterator<Item = usize>) -> Result<BackingChange> {
        let blocks = self.checked(blocks)?;
        let mut per_block = Vec::new();
        let mut spans = Vec::new();
        for &b in &blocks {
            let mut pages = Vec::new();
            self.pages_per_block(b, &mut spans, &mut pages);
            per_block.push((b, pages));
        }
        let all: BTreeSet<usize> = per_block
            .iter()
            .flat_map(|(_, p)| p.iter().copied())
            .collect();
        let (claimed, to_map) = {
            let mut st = self.wait_idle(&all);
            per_block.retain(|(b, _)| !st.backed[*b]);
            let mut to_map = BTreeSet::new();
            for (b, pages) in &per_block {
                st.backed[*b] = true;
                for &p in pages {
                    st.refs[p] += 1;
                    if !st.mapped[p] {
                        to_map.insert(p);
                    }
                }
            }
            st.backed_blocks += per_block.len();
            for &p in &to_map {
                st.busy[p] = true;
            }
            (per_block, to_map)
        };
        let mut done: Vec<(u64, u64)> = Vec::new();
        let mut failure = None;
        for (first, last) in runs(&to_map) {
            let at = first as u64 * self.page;
            let len = (last - first + 1) as u64 * self.page;
            if let Err(e) = self.region.map_chunked(at, len, self.page) {
                failure = Some(e);
                break;
            }
            if let Some(hook) = &self.hook {
                if let Err(e) = hook.mapped(&self.region, at, len) {
                    self.unmap_quietly(at, len, false);
                    failure = Some(e);
                    break;
                }
            }
            done.push((at, len));
        }
        if let Some(e) = failure {
            for &(at, len) in &done {
                self.unmap_quietly(at, len, true);
            }
            let mut st = self.state.lock();
            for (b, pages) in &claimed {
                st.backed[*b] = false;
                for &p in pages {
                    st.refs[p] -= 1;
                }
            }
            st.backed_blocks -= claimed.len();
            for &p in &to_map {
                st.busy[p] = false;
            }
            drop(st);
            self.changed.notify_all();
            tracing::debug!(blocks = claimed.len(), error = %e, "ensure_backed rolled back");
            return Err(e);
        }
        let bytes = to_map.len() as u64 * self.page;
        {
            let mut st = self.state.lock();
            for &p in &to_map {
                st.mapped[p] = true;
                st.busy[p] = false;
            }
            st.mapped_pages += to_map.len();
        }
        self.changed.notify_all();
        tracing::trace!(blocks = claimed.len(), bytes, "blocks backed");
        Ok(BackingChange {
            blocks: claimed.len(),
            bytes,
            left_mapped: 0,
        })
    }

    /// Unmap a run this backing mapped, telling the hook first when it knew of the mapping.
    /// Used on rollback, where the operation's own error is the one to report.
    fn unmap_quietly(&self, at: u64, len: u64, hooked: bool) {
        if hooked {
            if let Some(hook) = &self.hook {
                hook.unmapping(&self.region, at, len);
            }
        }
        if let Err(e) = self.region.unmap(at, len) {
            tracing::error!(at, len, error = %e, "unmap during rollback failed");
        }
    }

    /// Release `blocks`: unmap the pages no other backed block touches. Every block must be
    /// backed (releasing one twice is an error naming it, and changes nothing). A page whose
    /// unmap fails stays mapped (and registered) with no block on it; a later release or
    /// [`BlockBacking::unmap_unused`] tries again.
    pub fn release(&self, blocks: impl IntoIterator<Item = usize>) -> Result<BackingChange> {
        let blocks = self.checked(blocks)?;
        let pages = self.pages_of(&blocks);
        let to_unmap = {
            let mut st = self.wait_idle(&pages);
            if let Some(&b) = blocks.iter().find(|&&b| !st.backed[b]) {
                return Err(Error::InvalidArgument(format!(
                    "block {b} is not backed: release of {} blocks refused, nothing changed",
                    blocks.len()
                )));
            }
            let mut spans = Vec::new();
            let mut per = Vec::new();
            for &b in &blocks {
                st.backed[b] = false;
                per.clear();
                self.pages_per_block(b, &mut spans, &mut per);
                for &p in &per {
                    st.refs[p] -= 1;
                }
            }
            st.backed_blocks -= blocks.len();
            Self::claim_unused(&mut st, pages.iter().copied())
        };
        let bytes = self.unmap_claimed(&to_unmap);
        Ok(BackingChange {
            blocks: blocks.len(),
            bytes,
            left_mapped: to_unmap.len() as u64 * self.page - bytes,
        })
    }

    /// Unmap mapped pages that no backed block touches (left behind by a failed unmap).
    pub fn unmap_unused(&self) -> u64 {
        let to_unmap = {
            let mut st = self.state.lock();
            let n = st.refs.len();
            Self::claim_unused(&mut st, 0..n)
        };
        self.unmap_claimed(&to_unmap)
    }

    /// Mark busy and return the pages among `pages` that are mapped, idle and unreferenced.
    fn claim_unused(st: &mut BackingState, pages: impl Iterator<Item = usize>) -> BTreeSet<usize> {
        let out: BTreeSet<usize> = pages
            .filter(|&p| st.refs[p] == 0 && st.mapped[p] && !st.busy[p])
            .collect();
        for &p in &out {
            st.busy[p] = true;
        }
        out
    }

    /// Unmap claimed pages run by run, hook first; returns the bytes unmapped.
    fn unmap_claimed(&self, pages: &BTreeSet<usize>) -> u64 {
        let mut unmapped = BTreeSet::new();
        for (first, last) in runs(pages) {
            let at = first as u64 * self.page;
            let len = (last - first + 1) as u64 * self.page;
            if let Some(hook) = &self.hook {
                hook.unmapping(&self.region, at, len);
            }
            match self.region.unmap(at, len) {
                Ok(()) => unmapped.extend(first..=last),
                Err(e) => {
                    tracing::error!(at, len, error = %e, "unmapping released pages failed; they stay mapped");
                    if let Some(hook) = &self.hook {
                        if let Err(e) = hook.mapped(&self.region, at, len) {
                            tracing::error!(at, len, error = %e, "re-registering pages that stayed mapped failed");
                        }
                    }
                }
            }
        }
        {
            let mut st = self.state.lock();
            for &p in pages {
                st.busy[p] = false;
                if unmapped.contains(&p) {
                    st.mapped[p] = false;
                }
            }
            st.mapped_pages -= unmapped.len();
        }
        self.changed.notify_all();
        unmapped.len() as u64 * self.page
    }

    /// Runs of mapped pages as `(offset, len)` relative to the region.
    pub fn mapped_runs(&self) -> Vec<(u64, u64)> {
        let st = self.state.lock();
        let pages: BTreeSet<usize> = (0..st.mapped.len()).filter(|&p| st.mapped[p]).collect();
        drop(st);
        runs(&pages)
            .into_iter()
            .map(|(f, l)| (f as u64 * self.page, (l - f + 1) as u64 * self.page))
            .collect()
    }
}

impl<G: BlockGeometry> fmt::Debug for BlockBacking<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockBacking")
            .field("region", &self.region)
            .field("page", &self.page)
            .field("stats", &self.stats())
            .finish()
    }
}

impl<G: BlockGeometry> Drop for BlockBacking<G> {
    fn drop(&mut self) {
        // The hook lets go of every mapping first; the region then unmaps it all as it drops.
        if let Some(hook) = &self.hook {
            for (at, len) in self.mapped_runs() {
                hook.unmapping(&self.region, at, len);
            }
        }
    }
}
