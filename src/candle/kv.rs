//! An elastic KV tensor: shaped for a model's largest KV cache, physical memory only under the
//! blocks in use.
//!
//! The tensor `[max_blocks, ...block_shape]` lies in one [`crate::Region`] of the pool; a
//! [`BlockBacking`] maps the pages under backed blocks and unmaps pages no backed block touches.
//! A kernel that read an unmapped block would fault and poison the CUDA context of the whole
//! process, so no tensor over unbacked memory ever reaches the user:
//! - [`ElasticKv::view`] gives a tensor over a range of blocks that are all backed, and the view
//!   is tracked: [`ElasticKv::release`] of a block under a live view is refused (with the block
//!   and the views named) instead of unmapping memory a tensor still points at;
//! - [`ElasticKv::gather`], [`ElasticKv::write`] and [`ElasticKv::write_blocks`] work on the
//!   whole tensor internally (one `index_select`, or one copy into the blocks on the device's
//!   ordering stream) after checking that every block they touch is backed, and hold those
//!   blocks against release while they queue their work;
//! - a release waits for the GPU to finish the work queued before it, then unmaps.

use std::collections::{BTreeSet, VecDeque};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};
use parking_lot::Mutex;

use super::orphans::{self, Orphan};
use super::retire::{Batch, Wait};
use super::slices::{
    last_use_passed, with_device_ptr, Fence, Fences, Queue, SliceFactory, Tracker,
};
use super::{candle_error, element_size, TensorPool};
use crate::backing::{BackingChange, BackingStats, BlockBacking, UniformBlocks};
use crate::error::{Error, Result};
use crate::pool::MemOptions;

/// Views are pruned on creation once they exceed twice the survivors of the last prune plus
/// this many.
const PRUNE_SLACK: usize = 16;

/// A tensor `[max_blocks, ...block_shape]` whose blocks have physical memory only while backed.
/// `Send + Sync`, every method takes `&self`.
///
/// A kernel that read an unbacked block would fault and poison the CUDA context of the whole
/// process, so no tensor over unbacked memory ever reaches the user:
/// - [`ElasticKv::view`] gives a tensor over a range of blocks that are all backed, and the view
///   is tracked: [`ElasticKv::release`] of a block under a live view is refused (with the block
///   and the view named) instead of unmapping memory a tensor still points at;
/// - [`ElasticKv::gather`], [`ElasticKv::write`] and [`ElasticKv::write_blocks`] work on the
///   whole tensor internally (one `index_select`, or one copy into the blocks on the device's
///   ordering stream) after checking that every block they touch is backed, and hold those
///   blocks against release while they queue their work;
/// - a release waits for the GPU to finish the work queued before it, then unmaps.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use candle_core::{DType, Device, Tensor};
/// use elastic_vmm::{candle::{ElasticKv, TensorPool}, MemOptions, Pool};
///
/// let device = Device::new_cuda(0)?;
/// let tensors = TensorPool::new(&Pool::cuda(0, 64 << 30)?, &device)?;
/// // 4096 blocks of 16 tokens x 8 KV heads x 128 dims: 8 GiB virtual, nothing physical yet.
/// let k = ElasticKv::new(&tensors, 4096, &[16, 8, 128], DType::F16, &MemOptions::new())?;
/// k.ensure_backed(0..2)?; // maps the pages under blocks 0 and 1
/// let token = Tensor::zeros((1, 8, 128), DType::F16, &device)?;
/// k.write(1, 5, &token)?; // token 5 of block 1
/// let keys = k.gather(&[1, 0])?; // [2, 16, 8, 128], an ordinary candle tensor
/// let view = k.view(0..2)?; // a tensor over the blocks themselves
/// assert!(k.release(0..1).is_err()); // the view still covers block 0
/// drop(view);
/// k.release(0..2)?; // waits for the GPU, then unmaps
/// # drop(keys); Ok(()) }
/// ```
pub struct ElasticKv {
    core: Arc<Core>,
}

/// Everything an elastic tensor holds. Fields drop in order: the internal tensor first, then the
/// GPU finishes its queued work, then the pages are unmapped.
///
/// It holds the parts of its [`TensorPool`] it uses, not the tensor pool itself, so that
/// dropping a core (which a non-blocking reap does) never drops a tensor pool, whose drop waits.
struct Core {
    whole: Whole,
    finish: FinishGpuWork,
    backing: BlockBacking<UniformBlocks>,
    book: Mutex<Book>,
    device: Device,
    slices: Arc<SliceFactory>,
    fences: Arc<Fences>,
    queue: Queue,
    shape: Shape,
    block_shape: Vec<usize>,
    dtype: DType,
    block_elems: usize,
    block_bytes: u64,
}

/// The tensor over every block, used only by this module's own checked operations.
struct Whole {
    /// `[max_blocks, ...block_shape]`.
    blocks: Tensor,
}

/// Waits, when dropped, for the GPU to finish everything queued on the device's ordering stream
/// (every kernel of the device, from any thread), unless the GPU is known to be past every use
/// of the tensor already.
struct FinishGpuWork {
    fences: Arc<Fences>,
    needed: bool,
}

impl FinishGpuWork {
    /// The GPU has passed a fence recorded after the last use of the tensor.
    fn passed(&mut self) {
        self.needed = false;
    }
}

impl Drop for FinishGpuWork {
    fn drop(&mut self) {
        if !self.needed {
            return;
        }
        if let Err(e) = self.fences.synchronize() {
            tracing::error!(error = %e, "waiting for the GPU before unmapping an elastic tensor failed");
        }
    }
}

/// Who uses which blocks.
#[derive(Default)]
struct Book {
    views: Vec<ViewRecord>,
    survivors: usize,
    /// Per block: operations queuing a kernel on it now.
    pinned: Vec<u32>,
    /// Per block: a release is unmapping it now.
    releasing: Vec<bool>,
}

struct ViewRecord {
    blocks: Range<usize>,
    tracker: Tracker,
}

impl Book {
    /// Take out the views whose tensors are gone; absorb failed frees that copies of live views
    /// would see. Returns the dead trackers and the number of errors absorbed.
    fn prune(&mut self) -> (Vec<Tracker>, u64) {
        let mut dead = Vec::new();
        let mut absorbed = 0;
        let mut i = 0;
        while i < self.views.len() {
            if self.views[i].tracker.is_unique() {
                dead.push(self.views.swap_remove(i).tracker);
            } else {
                absorbed += u64::from(self.views[i].tracker.absorb_copy_error());
                i += 1;
            }
        }
        self.survivors = self.views.len();
        (dead, absorbed)
    }

    /// Why `block` cannot be released now, if anything holds it.
    fn holder(&self, block: usize, all: &BTreeSet<usize>) -> Option<Error> {
        if let Some(v) = self.views.iter().find(|v| v.blocks.contains(&block)) {
            let users = self
                .views
                .iter()
                .filter(|v| all.range(v.blocks.clone()).next().is_some())
                .count();
            return Some(Error::ElasticBlockInUse {
                block,
                users,
                detail: format!(
                    "a view over blocks {}..{} is alive (a Tensor::copy() of a view counts until it is dropped too)",
                    v.blocks.start, v.blocks.end
                ),
            });
        }
        if self.pinned[block] > 0 {
            return Some(Error::ElasticBlockInUse {
                block,
                users: self.pinned[block] as usize,
                detail: "operations are queuing kernels on it".into(),
            });
        }
        if self.releasing[block] {
            return Some(Error::ElasticBlockInUse {
                block,
                users: 1,
                detail: "another release of it is in progress".into(),
            });
        }
        None
    }
}

/// Blocks held against release while an operation queues its kernel.
struct Pin<'a> {
    book: &'a Mutex<Book>,
    blocks: &'a [usize],
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        let mut book = self.book.lock();
        for &b in self.blocks {
            book.pinned[b] -= 1;
        }
    }
}

/// A snapshot of an [`ElasticKv`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Blocks and pages: backed blocks, mapped pages, mapped bytes.
    pub backing: BackingStats,
    /// Live views (a `Tensor::copy()` of a view counts until it is dropped too).
    pub live_views: usize,
    /// Operations queuing a kernel right now.
    pub operations_in_flight: usize,
}

impl fmt::Debug for ElasticKv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ElasticKv")
            .field("shape", &self.core.shape)
            .field("dtype", &self.core.dtype)
            .field("backing", &self.core.backing.stats())
            .finish()
    }
}

impl ElasticKv {
    /// A tensor `[max_blocks, ...block_shape]` of `dtype` in `tensors`' pool: the address space
    /// of all blocks is reserved, nothing is backed yet. `block_shape` needs at least one
    /// dimension (the first is the one [`ElasticKv::write`] indexes, tokens in a KV block).
    /// [`MemOptions`] as for [`BlockBacking::reserve`]: the tag defaults to [`crate::Tag::Kv`]
    /// (sleep policies and stats go by it), `chunk` is the page size (default: the granularity).
    pub fn new(
        tensors: &TensorPool,
        max_blocks: usize,
        block_shape: &[usize],
        dtype: DType,
        opts: &MemOptions,
    ) -> Result<ElasticKv> {
        let elem = element_size(dtype)?;
        if max_blocks == 0 || max_blocks > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "an elastic tensor needs 1 to {} blocks, got {max_blocks}",
                u32::MAX
            )));
        }
        if block_shape.is_empty() || block_shape.contains(&0) {
            return Err(Error::InvalidArgument(format!(
                "block shape {block_shape:?} must have at least one dimension, none of them zero"
            )));
        }
        let overflow = || Error::SizeOverflow {
            what: "elastic tensor bytes",
            detail: format!("{max_blocks} blocks of {block_shape:?} {dtype:?}"),
        };
        let block_elems = block_shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(overflow)?;
        let block_bytes = block_elems.checked_mul(elem).ok_or_else(overflow)? as u64;
        let total = block_bytes
            .checked_mul(max_blocks as u64)
            .ok_or_else(overflow)?;
        let geometry = UniformBlocks::packed(max_blocks, block_bytes);
        let backing = BlockBacking::reserve(tensors.pool(), geometry, opts, None)?;
        let addr = backing.addr();
        let mut dims = vec![max_blocks];
        dims.extend_from_slice(block_shape);
        let shape = Shape::from(dims);
        let ctx = tensors.slices().take_context()?;
        // SAFETY: the region holds `max_blocks` blocks of `block_shape` elements and lives as
        // long as this tensor (fields drop in order: the tensor, the GPU past its work, then the
        // backing). Parts of it are unmapped: the tensor never leaves this module, whose
        // kernels touch only blocks checked to be backed and held against release meanwhile.
        // Its tracker is not needed: the tensor lives exactly as long as the core.
        let (blocks, _) = unsafe { tensors.slices().tensor(ctx, addr, shape.clone(), dtype)? };
        tracing::debug!(
            max_blocks,
            ?block_shape,
            ?dtype,
            total,
            "elastic tensor reserved"
        );
        Ok(ElasticKv {
            core: Arc::new(Core {
                whole: Whole { blocks },
                finish: FinishGpuWork {
                    fences: tensors.fences().clone(),
                    needed: true,
                },
                backing,
                book: Mutex::new(Book {
                    pinned: vec![0; max_blocks],
                    releasing: vec![false; max_blocks],
                    ..Book::default()
                }),
                device: tensors.device().clone(),
                slices: tensors.slices().clone(),
                fences: tensors.fences().clone(),
                queue: tensors.queue().clone(),
                shape,
                block_shape: block_shape.to_vec(),
                dtype,
                block_elems,
                block_bytes,
            }),
        })
    }

    /// `[max_blocks, ...block_shape]`.
    pub fn shape(&self) -> &Shape {
        &self.core.shape
    }

    /// The shape of one block.
    pub fn block_shape(&self) -> &[usize] {
        &self.core.block_shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.core.dtype
    }

    /// Number of blocks.
    pub fn max_blocks(&self) -> usize {
        self.core.shape.dims()[0]
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> u64 {
        self.core.block_bytes
    }

    /// The mapping unit: physical memory comes and goes in pages of this size.
    pub fn page_size(&self) -> u64 {
        self.core.backing.page_size()
    }

    /// The candle device.
    pub fn device(&self) -> &Device {
        &self.core.device
    }

    /// Whether `block` is backed now.
    pub fn is_backed(&self, block: usize) -> bool {
        self.core.backing.is_backed(block)
    }

    /// Physical bytes mapped under the tensor now.
    pub fn physical_bytes(&self) -> u64 {
        self.core.backing.stats().mapped_bytes
    }

    /// Back `blocks` with physical memory (the pages under them not mapped yet are mapped;
    /// admission by the pool's limits comes first). Blocks backed already stay as they are;
    /// fresh blocks have unspecified contents. On failure nothing changes.
    pub fn ensure_backed(&self, blocks: impl IntoIterator<Item = usize>) -> Result<BackingChange> {
        self.core.backing.ensure_backed(blocks)
    }

    /// Release `blocks`: every block must be backed and no live view or operation may hold it
    /// (an error names the block and what holds it, and nothing changes). Waits for the GPU to
    /// finish the work queued so far, then unmaps the pages no other backed block touches.
    pub fn release(&self, blocks: impl IntoIterator<Item = usize>) -> Result<BackingChange> {
        let blocks = self.checked_set(blocks)?;
        if blocks.is_empty() {
            return Ok(BackingChange::default());
        }
        let (dead, absorbed, checked) = {
            let mut book = self.core.book.lock();
            let (dead, absorbed) = book.prune();
            let checked = self.claim_for_release(&mut book, &blocks);
            (dead, absorbed, checked)
        };
        self.retire(dead, absorbed);
        checked?;
        let result = self
            .core
            .fences
            .synchronize()
            .and_then(|()| self.core.backing.release(blocks.iter().copied()));
        let mut book = self.core.book.lock();
        for &b in &blocks {
            book.releasing[b] = false;
        }
        drop(book);
        if let Ok(change) = &result {
            tracing::trace!(
                blocks = blocks.len(),
                bytes = change.bytes,
                "elastic blocks released"
            );
        }
        result
    }

    /// Check that nothing holds `blocks` and that all are backed; mark them being released.
    fn claim_for_release(&self, book: &mut Book, blocks: &BTreeSet<usize>) -> Result<()> {
        for &b in blocks {
            if let Some(e) = book.holder(b, blocks) {
                return Err(e);
            }
        }
        if let Some(b) = self.core.backing.first_unbacked(blocks.iter().copied()) {
            return Err(self.not_backed("release", b, blocks.len()));
        }
        for &b in blocks {
            book.releasing[b] = true;
        }
        Ok(())
    }

    /// A tensor `[blocks.len(), ...block_shape]` over the blocks themselves (writes through it
    /// land in the cache). Every block must be backed. The view holds its blocks against
    /// [`ElasticKv::release`] until it, every tensor sharing its storage and every
    /// `Tensor::copy()` of it are dropped.
    pub fn view(&self, blocks: Range<usize>) -> Result<Tensor> {
        let n = self.max_blocks();
        if blocks.start >= blocks.end || blocks.end > n {
            return Err(Error::InvalidArgument(format!(
                "view over blocks {}..{} refused: the range must be non-empty and within the {n} blocks",
                blocks.start, blocks.end
            )));
        }
        let slices = &self.core.slices;
        let ctx = slices.take_context()?;
        let mut dims = vec![blocks.len()];
        dims.extend_from_slice(&self.core.block_shape);
        let addr = self.base_addr() + blocks.start as u64 * self.core.block_bytes;
        let (dead, absorbed, made) = {
            let mut book = self.core.book.lock();
            let (dead, absorbed) = if book.views.len() > 2 * book.survivors + PRUNE_SLACK {
                book.prune()
            } else {
                (Vec::new(), 0)
            };
            let made = match self.check_usable(&book, "view", blocks.clone()) {
                // SAFETY: every block of the range is backed and none is being released; the
                // record below makes a release of any of them fail until the view's tracker is
                // unique (the view and everything sharing its slice are gone). The region lives
                // as long as `core`, which outlives the record (an elastic tensor dropped with
                // live views is kept alive as an orphan until they are gone).
                Ok(()) => {
                    match unsafe { slices.tensor(ctx, addr, Shape::from(dims), self.core.dtype) } {
                        Ok((tensor, tracker)) => {
                            book.views.push(ViewRecord {
                                blocks: blocks.clone(),
                                tracker,
                            });
                            Ok(tensor)
                        }
                        Err(e) => Err((e, None)),
                    }
                }
                Err(e) => Err((e, Some(ctx))),
            };
            (dead, absorbed, made)
        };
        self.retire(dead, absorbed);
        made.map_err(|(e, ctx)| {
            if let Some(ctx) = ctx {
                slices.put_back(ctx);
            }
            e
        })
    }

    /// The blocks `blocks` (in that order, repeats allowed) copied into an ordinary candle
    /// tensor `[blocks.len(), ...block_shape]`: one `index_select` on the device's stream, as on
    /// an ordinary KV cache tensor. Every block must be backed.
    pub fn gather(&self, blocks: &[usize]) -> Result<Tensor> {
        if blocks.is_empty() {
            return Err(Error::ZeroSize {
                what: "blocks to gather",
            });
        }
        self.check_indices(blocks.iter().copied())?;
        let _pin = self.pin("gather", blocks)?;
        let ids: Vec<u32> = blocks.iter().map(|&b| b as u32).collect();
        let ids =
            Tensor::new(ids.as_slice(), self.device()).map_err(candle_error("Tensor::new"))?;
        self.core
            .whole
            .blocks
            .index_select(&ids, 0)
            .map_err(candle_error("index_select"))
    }

    /// Write `src` (`[n, ...block_shape[1..]]`, e.g. `n` tokens of `[kv_heads, head_dim]`) into
    /// block `block` at positions `at..at + n` of its first dimension. The block must be backed;
    /// `src` must be on this tensor's candle device. One copy on the device's ordering stream:
    /// after every kernel queued before on the device (by any thread, so `src` may come from
    /// another thread), before every kernel queued after.
    pub fn write(&self, block: usize, at: usize, src: &Tensor) -> Result<()> {
        let bs = self.core.block_shape[0];
        let dims = src.dims();
        let fits = dims.len() == self.core.block_shape.len()
            && dims[1..] == self.core.block_shape[1..]
            && dims[0] > 0
            && at.checked_add(dims[0]).is_some_and(|end| end <= bs);
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "write of {dims:?} at position {at} of a block {:?} does not fit",
                self.core.block_shape
            )));
        }
        self.check_source(src)?;
        self.check_indices([block])?;
        let blocks = [block];
        let pin = self.pin("write", &blocks)?;
        let row = block * bs + at;
        let row_bytes = self.core.block_bytes / bs as u64;
        self.copy_in(&pin, row as u64 * row_bytes, src)
    }

    /// Copy `src` (checked: same dtype and device, fits in the blocks `pin` holds) to `at` bytes
    /// into the region: one copy on the ordering stream, whatever kernels candle ships for the
    /// dtype (two, through candle memory, when `src` is a view of these very blocks).
    fn copy_in(&self, _pin: &Pin<'_>, at: u64, src: &Tensor) -> Result<()> {
        let src = src.contiguous().map_err(candle_error("contiguous"))?;
        let bytes = src.elem_count() * self.core.dtype.size_in_bytes();
        let dst = self.base_addr() + at;
        let queue = &self.core.queue;
        // SAFETY (copies below): `dst..dst + bytes` lies in blocks that `_pin` holds backed
        // and unreleased until it drops, and a later release waits for the GPU (a synchronize
        // on the ordering stream) before it unmaps. `src` is a live contiguous tensor of the
        // same device, held by `with_device_ptr` until the copy is queued and freed (by candle
        // or by a collect behind a fence) only in stream order after it. Other users of both
        // are candle kernels of the device, which the ordering stream is in order with.
        with_device_ptr(&src, |from| {
            let overlap = from < dst + bytes as u64 && dst < from + bytes as u64;
            if !overlap {
                // SAFETY: see above; the ranges are disjoint.
                return unsafe { queue.copy(dst, from, bytes) };
            }
            // A view of these blocks written onto them: through a buffer of candle's own.
            // SAFETY: every byte of the buffer is written by the first copy before it is read.
            let buffer = unsafe { Tensor::empty(src.shape(), src.dtype(), &self.core.device) }
                .map_err(candle_error("empty"))?;
            with_device_ptr(&buffer, |tmp| {
                // SAFETY: see above; the fresh buffer overlaps neither range, and candle frees
                // it with a stream-ordered free queued after these copies.
                unsafe {
                    queue.copy(tmp, from, bytes)?;
                    queue.copy(dst, tmp, bytes)
                }
            })
        })
    }

    /// The address of block 0.
    fn base_addr(&self) -> u64 {
        self.core.backing.addr()
    }

    /// Write whole blocks: `src` (`[n, ...block_shape]`) into blocks `first..first + n`, which
    /// must be backed.
    pub fn write_blocks(&self, first: usize, src: &Tensor) -> Result<()> {
        let dims = src.dims();
        let n = dims.first().copied().unwrap_or(0);
        let fits = dims.len() == 1 + self.core.block_shape.len()
            && dims[1..] == self.core.block_shape[..]
            && n > 0
            && first
                .checked_add(n)
                .is_some_and(|end| end <= self.max_blocks());
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "write of {dims:?} into blocks from {first} does not fit {:?}",
                self.core.shape
            )));
        }
        self.check_source(src)?;
        let blocks: Vec<usize> = (first..first + n).collect();
        let pin = self.pin("write_blocks", &blocks)?;
        self.copy_in(&pin, first as u64 * self.core.block_bytes, src)
    }

    /// A snapshot (dead views are pruned first).
    pub fn stats(&self) -> KvStats {
        let (dead, absorbed, live_views, in_flight) = {
            let mut book = self.core.book.lock();
            let (dead, absorbed) = book.prune();
            let in_flight = book.pinned.iter().map(|&p| p as usize).sum();
            (dead, absorbed, book.views.len(), in_flight)
        };
        self.retire(dead, absorbed);
        KvStats {
            backing: self.core.backing.stats(),
            live_views,
            operations_in_flight: in_flight,
        }
    }

    /// Elements of one block.
    pub fn block_elems(&self) -> usize {
        self.core.block_elems
    }

    // ---- checks ----

    fn checked_set(&self, blocks: impl IntoIterator<Item = usize>) -> Result<BTreeSet<usize>> {
        let set: BTreeSet<usize> = blocks.into_iter().collect();
        self.check_indices(set.iter().copied())?;
        Ok(set)
    }

    fn check_indices(&self, blocks: impl IntoIterator<Item = usize>) -> Result<()> {
        let n = self.max_blocks();
        match blocks.into_iter().find(|&b| b >= n) {
            Some(b) => Err(Error::InvalidArgument(format!(
                "block {b} does not exist: the elastic tensor has {n} blocks"
            ))),
            None => Ok(()),
        }
    }

    fn check_source(&self, src: &Tensor) -> Result<()> {
        if src.dtype() != self.core.dtype {
            return Err(Error::InvalidArgument(format!(
                "source is {:?}, the elastic tensor {:?}",
                src.dtype(),
                self.core.dtype
            )));
        }
        if !src.device().same_device(self.device()) {
            return Err(Error::InvalidArgument(format!(
                "source is on {:?}, not on the elastic tensor's candle device {:?}: move it with to_device first",
                src.device().location(),
                self.device().location()
            )));
        }
        Ok(())
    }

    /// Every block usable by a kernel: backed and not being released.
    fn check_usable(
        &self,
        book: &Book,
        op: &'static str,
        blocks: impl IntoIterator<Item = usize> + Clone,
    ) -> Result<()> {
        if let Some(b) = blocks.clone().into_iter().find(|&b| book.releasing[b]) {
            return Err(Error::ElasticBlockInUse {
                block: b,
                users: 1,
                detail: format!("{op} refused: the block is being released"),
            });
        }
        if let Some(b) = self.core.backing.first_unbacked(blocks.clone()) {
            return Err(self.not_backed(op, b, blocks.into_iter().count()));
        }
        Ok(())
    }

    fn not_backed(&self, op: &'static str, block: usize, blocks: usize) -> Error {
        Error::ElasticBlockNotBacked {
            op,
            block,
            blocks,
            backed: self.core.backing.stats().backed_blocks,
            max_blocks: self.max_blocks(),
        }
    }

    /// Check `blocks` usable and hold them against release until the pin drops.
    fn pin<'a>(&'a self, op: &'static str, blocks: &'a [usize]) -> Result<Pin<'a>> {
        let mut book = self.core.book.lock();
        self.check_usable(&book, op, blocks.iter().copied())?;
        for &b in blocks {
            book.pinned[b] += 1;
        }
        Ok(Pin {
            book: &self.core.book,
            blocks,
        })
    }

    /// Recycle the contexts of dead views (outside the book's lock).
    fn retire(&self, dead: Vec<Tracker>, absorbed: u64) {
        self.core.retire(dead, absorbed);
    }
}

impl Core {
    /// Recycle the contexts of dead views (outside the book's lock).
    fn retire(&self, dead: Vec<Tracker>, absorbed: u64) {
        self.slices.count_absorbed(absorbed);
        for t in dead {
            self.slices.retire(t);
        }
    }
}

impl Drop for ElasticKv {
    fn drop(&mut self) {
        let (dead, absorbed, live) = {
            let mut book = self.core.book.lock();
            let (dead, absorbed) = book.prune();
            (dead, absorbed, book.views.len())
        };
        self.retire(dead, absorbed);
        if live > 0 {
            tracing::warn!(
                live_views = live,
                shape = ?self.core.shape,
                mapped_bytes = self.core.backing.stats().mapped_bytes,
                "elastic tensor dropped while views of it live; its memory stays mapped until they are dropped (see elastic_vmm::candle::reap_orphans)"
            );
            orphans::adopt(Box::new(OrphanKv {
                core: self.core.clone(),
                last_use: VecDeque::new(),
            }));
        }
    }
}

/// An elastic tensor dropped while views of it live: kept whole until they are gone and the GPU
/// has passed a fence recorded after that.
struct OrphanKv {
    core: Arc<Core>,
    /// Once no view is left: the fence after their last kernels (one batch, nothing in it).
    last_use: VecDeque<Batch<(), Fence>>,
}

impl Orphan for OrphanKv {
    fn reap(&mut self, wait: Wait) -> bool {
        if self.last_use.is_empty() {
            let (dead, absorbed, live) = {
                let mut book = self.core.book.lock();
                let (dead, absorbed) = book.prune();
                (dead, absorbed, book.views.len())
            };
            self.core.retire(dead, absorbed);
            if live > 0 {
                return false;
            }
        }
        // Every kernel on the views was queued before they died, so before the fence.
        if !last_use_passed(
            &self.core.fences,
            &mut self.last_use,
            wait,
            "elastic tensor",
        ) {
            return false;
        }
        // The GPU is past every use: dropping the core (ours is the last handle once the
        // elastic tensor's drop has finished) unmaps without waiting again.
        if let Some(core) = Arc::get_mut(&mut self.core) {
            core.finish.passed();
        }
        true
    }
}
